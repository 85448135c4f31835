"""Flint's published checkpoint layout (SPEC.md), for convert.py: the key table and its FP32 keys.

Published names are the native ones under `model.` (the head at the root), with three differences:
sinks are `self_attn.softmax_offset` (or transformers' `sinks`), routers `mlp.gate`, and the routed
experts are stored one per key (`mlp.experts.{e}.{gate,up,down}_proj.weight`, [Im, H] / [H, Im]) or
fused as transformers writes them (`mlp.experts.gate_up_proj` [E, 2*Im, H], `down_proj` [E, H, Im]).
Every published tensor is a `Part` of one native tensor of `model.Flint`.
"""

from __future__ import annotations

import torch

from flint_config import FlintConfig
from hf_io import Layout, Part

# Native keys the model keeps in FP32 (a checkpoint may hold them in FP32 or in the bulk dtype).
FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight", "lm_head.weight")
# Of those, the ones the published layout keeps in FP32 even when exporting to a lower dtype.
PUBLISHED_FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight")

def published_parts(native_key: str, config: FlintConfig, fused: bool = False,
                    sinks_name: str = "softmax_offset") -> list[Part]:
    """The published tensors that make up one native tensor, in the per-expert or the fused form."""
    key = native_key if native_key == "lm_head.weight" else "model." + native_key
    if native_key.endswith("self_attn.sinks.weight"):
        return [Part(key.replace("sinks.weight", sinks_name), (), False)]
    if native_key.endswith("mlp.router.weight"):
        return [Part(key.replace("router.weight", "gate.weight"), (), False)]
    if not native_key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [Part(key, (), False)]
    if fused:  # [E, 2*Im, H] or [E, H, Im]: transposing the last two dims gives the native layout
        return [Part(key, (), True)]
    experts, inter = key.rsplit(".", 1)[0], config.moe_intermediate_size
    if native_key.endswith("down_proj"):  # down_e [H, Im] -> native[e] [Im, H]
        return [Part(f"{experts}.{e}.down_proj.weight", (e,), True) for e in range(config.num_experts)]
    # gate_e, up_e [Im, H] -> native[e] [H, 2*Im], gate columns first
    halves = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
    return [Part(f"{experts}.{e}.{name}.weight", (e, slice(None), columns), True)
            for e in range(config.num_experts) for name, columns in halves]


def published_layout(config: FlintConfig, native: dict[str, torch.Tensor],
                     present: set[str]) -> dict[str, list[Part]]:
    """Native key (of `native`, the model's meta state dict) -> its published parts, in the form a
    source with the keys `present` uses (fused experts, `sinks` or `softmax_offset`)."""
    layout = {}
    for native_key in native:
        fused = "model." + native_key in present  # the fused experts keep the native name (ignored for others)
        sinks = "sinks" if "model." + native_key.removesuffix(".weight") in present else "softmax_offset"
        layout[native_key] = published_parts(native_key, config, fused, sinks)
    return layout


def missing_fields(config: FlintConfig, given: dict) -> list[str]:
    """The published fields a config.json leaves out (their defaults are used)."""
    given = {*given, *(["rope_parameters"] if "rope_theta" in given else [])}
    return [key for key in config.to_hf_config() if key not in given and hasattr(config, key)]


LAYOUT = Layout(published_layout, FP32_SUFFIXES, PUBLISHED_FP32_SUFFIXES, missing_fields=missing_fields)
