"""Everything about attention that is not a projection: masks, block masks, attention with sinks,
the decoding cache.

Masks are written once, as FlexAttention `mask_mod` functions, and realised two ways:
  * a FlexAttention `BlockMask` for the `flex` backend (the GPU path, compiled) and the `flash`
    backend (the same FlexAttention call on flash-attn-4's CuTe DSL kernel: FlashMask), and
  * a dense boolean mask for the `sdpa` backend (the CPU path, and decoding).
Both backends implement learned sinks: one extra softmax column per query head whose logit is the
sink `s_h` and whose value is zero, so  p_j = exp(a_j) / (exp(s_h) + sum_j exp(a_j)).

Mistral Large 4's sparse selection, built on these masks, is in large4.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
)

from devices import kernel_device_type

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
BACKENDS = ("auto", "flex", "flash", "sdpa")
# FlexAttention's FLASH backend (torch 2.13, experimental): the flash-attn-4 package's CuTe DSL
# kernels, built for Hopper (SM90) and Blackwell (SM100) (https://pypi.org/project/flash-attn-4/),
# BF16 or FP16 only. Inductor runs it for a compiled flex_attention given these kernel_options.
FLASH_KERNEL_OPTIONS = {"BACKEND": "FLASH"}
FLASH_CAPABILITY_MAJORS = (9, 10)
FLASH_DTYPES = (torch.bfloat16, torch.float16)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BandMask(NamedTuple):
    """A sliding layer's mask in query blocks of `block` = window - 1 rows (sdpa backend).

    A query sees at most window - 1 earlier keys, all inside its own block or the previous one, so
    each block attends to 2 * block keys only: cost linear in the sequence length, not quadratic.
    """

    allowed: torch.Tensor  # bool [B * blocks, 1, block, 2 * block]
    seq_len: int


# `auto`'s choice where FLASH runs: FLASH for BF16 and FP16 attention, flex for FP32, which
# flash-attn-4 does not take (the dtype is the attention's, known only at the call)
FLASH_OR_FLEX = "flash_or_flex"


class FlashMask(NamedTuple):
    """A BlockMask whose attention runs on FlexAttention's FLASH backend (the flash backend).
    required: asked for by name, so FP32 attention is refused rather than run on flex (auto's
    choice runs FP32 on flex)."""

    block_mask: BlockMask
    required: bool


Mask = BlockMask | FlashMask | BandMask | torch.Tensor  # flex | flash | banded | dense bool sdpa


# ----------------------------------------------------------------------------- mask functions
# Each takes broadcastable index tensors (batch, head, query, key) and returns True where the
# query may attend the key. Written with tensor ops only, so the same function builds a
# BlockMask and, evaluated on index grids, a dense mask.


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskMod:
    """The window counts the current token: window 513 sees keys q-512 .. q."""

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return mask


def same_document(doc_ids: torch.Tensor) -> MaskMod:
    """doc_ids [B, T]: attend only inside the query's document; ids < 0 mark padding, never
    attended.

    A padding query therefore sees no key at all and, thanks to the sink column, outputs exact
    zeros."""

    def mask(b, h, q_idx, kv_idx):
        key_doc = doc_ids[b, kv_idx]
        return (doc_ids[b, q_idx] == key_doc) & (key_doc >= 0)

    return mask


def layer_mask_mod(layer_type: str, window: int | None, doc_ids: torch.Tensor | None) -> MaskMod:
    """The full mask of one layer type: causal, plus the window on sliding layers, plus
    documents."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer type must be one of {LAYER_TYPES}, got {layer_type!r}")
    mods = [causal]
    if layer_type == SLIDING and window is not None:
        mods.append(sliding_window(window))
    if doc_ids is not None:
        mods.append(same_document(doc_ids))
    return and_masks(*mods) if len(mods) > 1 else causal


def at_queries(mask_mod: MaskMod, queries: torch.Tensor) -> MaskMod:
    """mask_mod for the queries at positions `queries` [Tq]: query q_idx is position
    queries[q_idx]."""

    def placed(b, h, q_idx, kv_idx):
        return mask_mod(b, h, queries[q_idx], kv_idx)

    return placed


# ----------------------------------------------------------------------------- realisations


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Evaluate a mask_mod on index grids: bool [B, 1, Tq, Tk] (broadcasts over heads)."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


@lru_cache(maxsize=32)
def _cached_block_mask(layer_type: str, window: int | None, seq_len: int, device: str) -> BlockMask:
    """Masks without documents depend only on the shape: build them once per shape."""
    return new_block_mask(layer_mask_mod(layer_type, window, None), None, seq_len, seq_len, device)


def block_mask(
    layer_type: str,
    window: int | None,
    doc_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device,
) -> BlockMask:
    if doc_ids is None:
        return _cached_block_mask(layer_type, window, seq_len, str(device))
    return new_block_mask(
        layer_mask_mod(layer_type, window, doc_ids), batch, seq_len, seq_len, device
    )


def new_block_mask(
    mask_mod: MaskMod, batch: int | None, q_len: int, kv_len: int, device
) -> BlockMask:
    """A BlockMask built from block-sparse counts, never a dense [B, 1, T, S] mask. On a GPU its
    construction is compiled (the eager one evaluates the mask_mod on the whole grid at once);
    on the CPU it is eager: compiling it costs more than it saves at the CPU's lengths."""
    compiled = torch.device(device).type == "cuda"
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device, _compile=compiled)


def flash_package_available() -> bool:
    """Whether flash-attn-4's CuTe DSL kernels import: what Inductor's FLASH backend calls."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn at all
        return False


def flash_refusal(device: torch.device) -> str | None:
    """Why FlexAttention's FLASH backend cannot run on `device`, or None. A rehearsal (kernels
    chosen for CUDA on fake CPU tensors) runs no kernel: nothing to refuse."""
    if kernel_device_type(device) != "cuda":
        return "needs a CUDA GPU (Hopper or Blackwell), and this run is on the CPU"
    if torch.device(device).type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH_CAPABILITY_MAJORS:
        return (
            f"needs a Hopper or Blackwell GPU (compute capability 9.x or 10.x), but "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    if not flash_package_available():
        return "needs the flash-attn-4 package (flash_attn.cute), which is not installed"
    if torch.are_deterministic_algorithms_enabled() and major < 10:
        return "has no deterministic backward with a block mask before Blackwell (torch 2.13)"
    return None


def resolve_backend(backend: str, device: torch.device, flash: bool = True) -> str:
    """`auto` picks flash where it can run (flash_refusal; FLASH_OR_FLEX: FP32 attention on flex),
    else flex on GPUs (fused, compiled), and sdpa on the CPU (flex has no CPU backward). `flash`
    asked for where it cannot run, or by a model whose attention does not run it (flash=False:
    Large 4's), is refused in one line: never a silent fallback."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flash":
        refusal = flash_refusal(device) if flash else "runs Flint's sink attention only"
        if refusal:
            raise ValueError(
                f'attention_backend = "flash" (FlexAttention\'s FLASH) {refusal}; '
                'use "flex" or "auto"'
            )
    if backend == "auto":
        if kernel_device_type(device) != "cuda":
            return "sdpa"
        return FLASH_OR_FLEX if flash and flash_refusal(device) is None else "flex"
    return backend


def build_masks(
    layer_types: list[str],
    window: int | None,
    doc_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device,
    backend: str,
    queries: torch.Tensor | None = None,
) -> dict[str, Mask]:
    """One mask per layer type present, built once per batch outside the layers. queries [Tq]: the
    positions whose rows to build against all seq_len keys (a context-parallel rank's share), or
    all."""
    masks: dict[str, Mask] = {}
    for layer_type in sorted(set(layer_types)):
        mod = layer_mask_mod(layer_type, window, doc_ids)
        if queries is not None:  # some rows only: neither the cached nor the banded form
            mod, rows = at_queries(mod, queries), queries.numel()
            masks[layer_type] = (
                new_block_mask(mod, batch, rows, seq_len, device)
                if backend in ("flex", "flash", FLASH_OR_FLEX)
                else dense_mask(mod, batch, rows, seq_len, device)
            )
        elif backend in ("flex", "flash", FLASH_OR_FLEX):
            masks[layer_type] = block_mask(layer_type, window, doc_ids, batch, seq_len, device)
        elif layer_type == SLIDING and window is not None and seq_len > 2 * (window - 1) > 0:
            masks[layer_type] = band_mask(mod, window - 1, batch, seq_len, device)
        else:
            masks[layer_type] = dense_mask(mod, batch, seq_len, seq_len, device)
    if backend in ("flash", FLASH_OR_FLEX):
        required = backend == "flash"
        return {layer_type: FlashMask(mask, required) for layer_type, mask in masks.items()}
    return masks


def band_mask(mask_mod: MaskMod, block: int, batch: int, seq_len: int, device) -> BandMask:
    """Evaluate a sliding layer's mask_mod for each query block against its previous and own block.

    The sequence is padded up to whole blocks; padded queries and keys are never allowed.
    """
    blocks = -(-seq_len // block)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    first = torch.arange(blocks, device=device).view(1, blocks, 1, 1) * block
    q = first + torch.arange(block, device=device).view(1, 1, block, 1)  # [1, blocks, block, 1]
    kv = first - block + torch.arange(2 * block, device=device).view(1, 1, 1, 2 * block)
    inside = (kv >= 0) & (kv < seq_len) & (q < seq_len)
    allowed = (
        mask_mod(b, torch.zeros_like(b), q.clamp(max=seq_len - 1), kv.clamp(0, seq_len - 1))
        & inside
    )
    return BandMask(
        allowed.expand(batch, blocks, block, 2 * block).reshape(
            batch * blocks, 1, block, 2 * block
        ),
        seq_len,
    )


# ----------------------------------------------------------------------------- attention with sinks


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def fused_flex_attention(q, k, v, mask: BlockMask, scale: float, kernel_options=None):
    """FlexAttention is fused only when compiled: inside a compiled block it is traced into the
    block's graph; called eagerly on a GPU it goes through a compiled flex_attention of its own; on
    the CPU, outside a compiled block, it runs eagerly. kernel_options: Inductor's (FLASH's).
    -> (out [B, H, T, Dv], aux with lse [B, H, T])."""
    eager = torch.compiler.is_compiling() or q.device.type == "cpu"
    call = flex_attention if eager else _compiled_flex_attention()
    return call(
        q,
        k,
        v,
        block_mask=mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
        kernel_options=kernel_options,
    )


def flex_sink_attention(
    q, k, v, sinks: torch.Tensor, mask: BlockMask, kernel_options=None
) -> torch.Tensor:
    """Plain attention, then the sink: out * sigmoid(lse - s_h), in FP32 so lse carries
    gradients. The sink needs only the lse, which FLASH returns too: no score_mod."""
    # out [B, Hq, T, D], lse [B, Hq, T]
    out, aux = fused_flex_attention(q, k, v, mask, q.shape[-1] ** -0.5, kernel_options)
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(q.dtype)


def sdpa_sink_attention(q, k, v, sinks: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """SDPA over one extra zero key/value whose additive bias is the sink logit (any device).

    q [B, Hq, T, D], k/v [B, Hkv, S, D], allowed bool [B, 1, T, S]. The score of the extra key is
    q . 0 + s_h = s_h, and since the bias is a differentiable input the sink gets its gradient.
    SDPA takes a bias only in q's dtype and the sink logit is FP32 by contract, so narrower inputs
    (BF16 decoding on a GPU) run here in FP32 and the result is cast back.
    """
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    batch, heads, q_len, _ = q.shape
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k = torch.cat([k, zero], dim=2)  # [B, Hkv, S + 1, D]
    v = torch.cat([v, zero], dim=2)
    bias = torch.where(allowed, 0.0, float("-inf")).expand(batch, heads, q_len, allowed.shape[-1])
    sink_column = sinks.float().view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    bias = torch.cat([bias, sink_column], dim=-1)  # FP32 [B, Hq, T, S + 1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True).to(dtype)


# The CPU's fused flash attention returns the lse, so the sink is a rescale: out * sigmoid(lse - s).
# About 3x faster on the CPU than SDPA with an extra column, which materialises a per-head bias and
# runs the unfused math kernel. It is a custom operator so that a compiled block holds it as one
# opaque call (the compiler has no CPU kernel to generate for it). Its outputs are contiguous, as
# its fake says (the kernel's own layout follows q's): the compiler plans strides from the fake.


def _flash_bias(q: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed, 0.0, float("-inf")).to(q.dtype)  # [B, 1, T, S]


def _sink_keep(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The share of each query's softmax mass not taken by the sink: FP32 [B, Hq, T, 1]."""
    return torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)


@torch.library.custom_op("flint::flash_sink_attention", mutates_args=())
def flash_sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D] (GQA needs no repeat), allowed bool [B, 1, T, S]
    -> y [B, Hq, T, D], FP32 lse [B, Hq, T] of the attention without the sink."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_flash_bias(q, allowed), scale=q.shape[-1] ** -0.5
    )
    return (out * _sink_keep(lse, sinks)).to(q.dtype).contiguous(), lse.float().contiguous()


@flash_sink_attention.register_fake
def _(q, k, v, sinks, allowed):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flint::flash_sink_attention_backward", mutates_args=())
def flash_sink_attention_backward(
    dy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    allowed: torch.Tensor,
    y: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward reuses the kernel's own: given dO = keep * dy and y in place of its output, its row
    term rowsum(dO * O) is exactly that of the softmax with the sink column, so dq, dk, dv come out
    right; the sink's gradient is -(1 - keep) * rowsum(dy * y). A query with no allowed key gets
    out = 0 and lse = 0 from the kernel, hence y = 0 and no gradient, as with the sink column."""
    keep = _sink_keep(lse, sinks)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        (dy * keep).to(q.dtype).contiguous(),
        q,
        k,
        v,
        y,
        lse,
        0.0,
        False,
        attn_mask=_flash_bias(q, allowed),
        scale=q.shape[-1] ** -0.5,
    )
    dsinks = -((1 - keep) * (dy * y).sum(-1, keepdim=True).float()).sum((0, 2, 3))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks.to(sinks.dtype)


@flash_sink_attention_backward.register_fake
def _(dy, q, k, v, sinks, allowed, y, lse):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        sinks.new_empty(sinks.shape),
    )


def _flash_setup(ctx, inputs, output):
    q, k, v, sinks, allowed = inputs
    ctx.save_for_backward(q, k, v, sinks, allowed, *output)


def _flash_backward(ctx, dy, dlse):
    return (*flash_sink_attention_backward(dy, *ctx.saved_tensors), None)


flash_sink_attention.register_autograd(_flash_backward, setup_context=_flash_setup)


def dense_sink_attention(q, k, v, sinks: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The sdpa backend: the fused flash kernel on the CPU, SDPA with a sink column elsewhere."""
    if q.device.type == "cpu":
        return flash_sink_attention(q, k, v, sinks, allowed)[0]
    return sdpa_sink_attention(q, k, v, sinks, allowed)


def banded_sink_attention(q, k, v, sinks: torch.Tensor, mask: BandMask) -> torch.Tensor:
    """Dense attention per query block over its previous and own key blocks (see BandMask)."""
    batch, heads, seq_len, dim = q.shape
    kv_heads, block = k.shape[1], mask.allowed.shape[-2]
    blocks = mask.allowed.shape[0] // batch
    pad = blocks * block - seq_len

    def query_blocks(x):  # [B, H, T, D] -> [B * blocks, H, block, D]
        x = F.pad(x, (0, 0, 0, pad)).view(batch, x.shape[1], blocks, block, dim)
        return x.transpose(1, 2).reshape(batch * blocks, x.shape[1], block, dim)

    def key_blocks(x):  # [B, Hkv, T, D] -> [B * blocks, Hkv, 2 * block, D]: previous and own block
        x = F.pad(x, (0, 0, block, pad)).view(batch, kv_heads, blocks + 1, block, dim)
        x = torch.cat([x[:, :, :-1], x[:, :, 1:]], dim=3)
        return x.transpose(1, 2).reshape(batch * blocks, kv_heads, 2 * block, dim)

    out = dense_sink_attention(query_blocks(q), key_blocks(k), key_blocks(v), sinks, mask.allowed)
    out = (
        out.view(batch, blocks, heads, block, dim)
        .transpose(1, 2)
        .reshape(batch, heads, blocks * block, dim)
    )
    return out[:, :, :seq_len]


def flash_sink_attention_flex(q, k, v, sinks: torch.Tensor, mask: FlashMask) -> torch.Tensor:
    """flex_sink_attention on FlexAttention's FLASH backend: BF16 or FP16 inputs only (FP32 on
    flex when auto chose it, refused when asked for by name)."""
    if q.dtype not in FLASH_DTYPES and not mask.required:
        return flex_sink_attention(q, k, v, sinks, mask.block_mask)
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(
            f'attention_backend = "flash" runs BF16 or FP16 attention (flash-attn-4), got '
            f'{str(q.dtype).removeprefix("torch.")}: use param_dtype = "bfloat16" or "flex"'
        )
    return flex_sink_attention(q, k, v, sinks, mask.block_mask, FLASH_KERNEL_OPTIONS)


def sink_attention(q, k, v, sinks: torch.Tensor, mask: Mask) -> torch.Tensor:
    """The backend follows the mask's realisation: BlockMask -> flex, FlashMask -> flash, BandMask
    or dense bool -> sdpa."""
    if isinstance(mask, FlashMask):
        return flash_sink_attention_flex(q, k, v, sinks, mask)
    if isinstance(mask, BlockMask):
        return flex_sink_attention(q, k, v, sinks, mask)
    if isinstance(mask, BandMask):
        return banded_sink_attention(q, k, v, sinks, mask)
    return dense_sink_attention(q, k, v, sinks, mask)


# ----------------------------------------------------------------------------- decoding


class KVCache:
    """Keys and values of one layer during generation.

    Sliding layers keep only the last `window - 1` keys between steps: with the new token that is
    exactly the `window` keys its query may see. Keys are stored after RoPE.
    """

    def __init__(self, window: int | None):
        self.window = window
        self.k = self.v = None
        self.positions = None  # [S] absolute position of each stored key

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Append k/v [B, Hkv, t, D] at `positions` [t]; return all keys, values and the bool
        mask."""
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)
            v = torch.cat([self.v, v], dim=2)
            key_positions = torch.cat([self.positions, positions])
        else:
            key_positions = positions
        q_pos, k_pos = positions.view(-1, 1), key_positions.view(1, -1)
        allowed = k_pos <= q_pos
        if self.window is not None:
            allowed &= q_pos - k_pos < self.window
        first = 0 if self.window is None else max(k.shape[2] - (self.window - 1), 0)
        self.k, self.v, self.positions = k[:, :, first:], v[:, :, first:], key_positions[first:]
        return k, v, allowed.view(1, 1, *allowed.shape)  # allowed [1, 1, t, S]
