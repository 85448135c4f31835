"""Mistral Large 4's published checkpoint layout, for convert.py: the key table, extras and FP8.

Published checkpoints (what transformers' save_pretrained writes and the release ships) use Mistral's
native names at the root, experts one per file entry, and a composite config.json (`text_config`,
`vision_config`); LARGE4.md (repository root) names the native keys. Every published tensor is a `Part`
of one native tensor of `large4.MistralLarge4`, so the same `Part` machinery as Flint's drives both
directions, the key accounting and the shape checks:

    native (flint)                                   published (Mistral)
    embed_tokens / lm_head / norm / rotary.alpha     tok_embeddings / output / norm / lerope.alpha
    layers.i.input_layernorm, post_attention_layernorm   layers.i.attention_norm, ffn_norm
    self_attn.{q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
                                                     attention.{wq, wkv_a_with_mqa, kv_a_norm, wkv_b, wo}
    self_attn[.indexer].softmax_scaling.{scale,bias} attention[.indexer].ssmax_scaling.{s,b}
    self_attn.indexer.*                              attention.indexer.* (same leaf names)
    mlp.{gate,up,down}_proj (dense layers)           feed_forward.{w1,w3,w2}
    mlp.router                                       gate
    mlp.shared_expert.{gate,up,down}_proj            shared_experts.{w1,w3,w2}
    mlp.experts.gate_up_proj [E, H, 2*Im]            experts.{e}.w1 = native[e][:, :Im].T, w3 = [:, Im:].T
    mlp.experts.down_proj [E, Im, H]                 experts.{e}.w2 = native[e].T

KV consumers have no kv_a_* and "shared" indexer layers no indexer.*, in both layouts (the native
model lacks those modules, so the table does too). transformers' fused experts
(`layers.i.mlp.experts.gate_up_proj` [E, 2*Im, H], `down_proj` [E, H, Im]) are accepted on input.

The vision tower, its projector and the `mtp_dspark` draft head are not part of the text model: they are
EXTRA keys, which convert.py copies tensor by tensor on every conversion and never drops silently.
The release stores matrices as FP8 E4M3 with per-block scales (`X.qscale_weight`, or transformers'
`X.weight_scale_inv`); `dequantize` turns them into BF16 or FP32 on load. Export writes BF16/FP32 only.
"""

from __future__ import annotations

import math
import re

import torch

from hf_io import Layout, Part, Source

EXTRA_PREFIXES = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.",
                  "mtp_dspark.")
# Native keys the model keeps in FP32 (a checkpoint may hold them in FP32 or in the bulk dtype).
FP32_SUFFIXES = ("rotary.alpha", "mlp.router.weight", "lm_head.weight", "indexer.weights_proj.weight",
                 "indexer.k_norm.weight", "indexer.k_norm.bias")
# Of those, the ones transformers keeps in FP32 in any dtype (`_keep_in_fp32_modules_strict`).
PUBLISHED_FP32_SUFFIXES = ("rotary.alpha", "mlp.router.weight")
SCALE_SUFFIXES = (".qscale_weight", ".weight_scale_inv")  # Mistral's name, transformers' name
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}

ROOT = {"embed_tokens.weight": "tok_embeddings.weight", "lm_head.weight": "output.weight",
        "norm.weight": "norm.weight", "rotary.alpha": "lerope.alpha"}
# Inside a layer: native prefix -> published prefix, the first match wins (longest first where they nest).
LAYER = (("input_layernorm.", "attention_norm."), ("post_attention_layernorm.", "ffn_norm."),
         ("self_attn.q_proj.", "attention.wq."), ("self_attn.kv_a_proj_with_mqa.", "attention.wkv_a_with_mqa."),
         ("self_attn.kv_a_layernorm.", "attention.kv_a_norm."), ("self_attn.kv_b_proj.", "attention.wkv_b."),
         ("self_attn.o_proj.", "attention.wo."), ("self_attn.", "attention."), ("mlp.router.", "gate."),
         ("mlp.shared_expert.gate_proj.", "shared_experts.w1."), ("mlp.shared_expert.up_proj.", "shared_experts.w3."),
         ("mlp.shared_expert.down_proj.", "shared_experts.w2."), ("mlp.gate_proj.", "feed_forward.w1."),
         ("mlp.up_proj.", "feed_forward.w3."), ("mlp.down_proj.", "feed_forward.w2."))
LEAF = {"softmax_scaling.scale": "ssmax_scaling.s", "softmax_scaling.bias": "ssmax_scaling.b"}


def published_name(native_key: str) -> str:
    """The published key of a native tensor that is not an expert stack."""
    if native_key in ROOT:
        return ROOT[native_key]
    match = re.fullmatch(r"(layers\.\d+\.)(.+)", native_key)
    if not match:
        raise ValueError(f"no published name for native key {native_key!r}")
    layer, rest = match.groups()
    for native, published in LAYER:
        if rest.startswith(native):
            rest = published + rest.removeprefix(native)
            break
    for native, published in LEAF.items():
        if rest.endswith(native):
            rest = rest.removesuffix(native) + published
    return layer + rest


def published_parts(native_key: str, shape: torch.Size, fused: bool = False) -> list[Part]:
    """The published tensors that make up one native tensor, in the per-expert or the fused form."""
    if not native_key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [Part(published_name(native_key), (), False)]
    if fused:  # transformers' [E, 2*Im, H] / [E, H, Im]: the native layout transposed
        return [Part(native_key, (), True)]
    layer, experts = native_key.split(".mlp.")[0], range(shape[0])
    if native_key.endswith("down_proj"):  # w2_e [H, Im] -> native[e] [Im, H]
        return [Part(f"{layer}.experts.{e}.w2.weight", (e,), True) for e in experts]
    inter = shape[-1] // 2  # w1_e (gate), w3_e (up) [Im, H] -> native[e] [H, 2*Im], gate columns first
    halves = (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter)))
    return [Part(f"{layer}.experts.{e}.{name}.weight", (e, slice(None), columns), True)
            for e in experts for name, columns in halves]


def published_layout(meta: dict[str, torch.Tensor], present: set[str] | None = None) -> dict[str, list[Part]]:
    """Native key -> its published parts. With `present` (a source's keys), in the form that source uses."""
    present = present or set()
    return {key: published_parts(key, t.shape, fused=key in present) for key, t in meta.items()}


def is_extra(key: str) -> bool:
    """A published key outside the text model (vision tower, projector, draft head)."""
    return key.startswith(EXTRA_PREFIXES)


# ============================================================================= FP8

def block_size(hf_config: dict, where: str) -> tuple[int, int] | None:
    """quantization_config.weight_block_size of config.json (top level or text_config), None if absent."""
    quant = hf_config.get("quantization_config") or hf_config.get("text_config", {}).get("quantization_config")
    if quant is None:
        return None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                         f"got {block!r}")
    return block[0], block[1]


def scale_key(weight_key: str, keys: set[str] | dict) -> str | None:
    """The per-block scale stored next to an FP8 weight `X.weight`, if any."""
    stem = weight_key.removesuffix(".weight")
    return next((stem + suffix for suffix in SCALE_SUFFIXES if stem + suffix in keys), None)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight: one scale per (possibly partial) block of the last two dims."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """w = fp8 * scale, with each scale broadcast over its [block_m, block_n] tile, in FP32, then cast."""
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    full = full.repeat_interleave(block[1], dim=-1)[..., :cols]  # [.., rows, cols]
    return (weight.float() * full).to(dtype)


class Dequantized(Source):
    """A published source whose FP8 weights read as `dtype`, their scales consumed (hidden from `meta`).

    Every other floating tensor is cast to `dtype` too, except FP32 ones that `keep_fp32(key)` names,
    so the result has one bulk dtype like a BF16/FP32 checkpoint."""

    def __init__(self, source: Source, block: tuple[int, int] | None, dtype: torch.dtype, keep_fp32=lambda key: False):
        self.source, self.block, self.dtype, self.name = source, block, dtype, source.name
        self.scales: dict[str, str] = {}  # FP8 weight key -> its scale key
        self.meta = {}
        for key, (shape, stored) in source.meta.items():
            if key.endswith(SCALE_SUFFIXES):
                weight = key.removesuffix(key[key.rindex("."):]) + ".weight"
                if source.meta.get(weight, (None, None))[1] not in FP8_DTYPES.values():
                    raise ValueError(f"{source.where(key)}: scale {key!r} has no FP8 weight {weight!r} next to it")
                continue
            if stored in FP8_DTYPES.values():
                self.scales[key] = self._scale_of(key, shape)
            keep = stored == torch.float32 and keep_fp32(key)
            self.meta[key] = (shape, stored if keep else dtype)

    def _scale_of(self, key: str, shape: tuple[int, ...]) -> str:
        where, scale = self.source.where(key), scale_key(key, self.source.meta)
        if scale is None:
            raise ValueError(f"{where}: FP8 key {key!r} has no per-block scale ({key.removesuffix('.weight')}"
                             f"{SCALE_SUFFIXES[0]})")
        if self.block is None:
            raise ValueError(f"{where}: FP8 key {key!r}, but config.json has no quantization_config."
                             f"weight_block_size")
        expected = scale_grid(shape, self.block)
        if self.source.meta[scale][0] != expected:
            raise ValueError(f"{self.source.where(scale)}: scale {scale!r} has shape "
                             f"{list(self.source.meta[scale][0])}, expected {list(expected)} for weight "
                             f"{list(shape)} in blocks of {list(self.block)}")
        return scale

    def where(self, key: str) -> str:
        return self.source.where(key)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        tensors = self.source.read(keys + [self.scales[k] for k in keys if k in self.scales])
        return {k: dequantize(tensors[k], tensors[self.scales[k]], self.block, self.meta[k][1]) if k in self.scales
                else tensors[k].to(self.meta[k][1]) for k in keys}


def dequantized(source: Source, hf_config: dict, where: str, dtype: torch.dtype,
                keep_fp32) -> Source:
    """The release's FP8 source read as `dtype` (see Dequantized), with config.json's block size."""
    return Dequantized(source, block_size(hf_config, where), dtype, keep_fp32)


LAYOUT = Layout(lambda config, native, present: published_layout(native, present), FP32_SUFFIXES,
                PUBLISHED_FP32_SUFFIXES, is_extra, FP8_DTYPES, dequantized)
