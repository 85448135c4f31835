"""Mistral Large 4: MLA attention with the DSA indexer, KV and index sharing, LeRoPE, SSMax, MoE,
FP32 head.

A decoder-only MoE transformer (1.05T parameters, 52B active). Attention is DeepSeek-style MLA
without query LoRA: every layer's keys and values are expanded from a 512-wide normed latent plus
one shared rotary key. A frozen "lightning indexer" (DSA) picks the top 2048 keys of each query, and
attention sees only those. Every fourth layer is NoPE; later layers may attend to an earlier layer's
latent (KV sharing) and reuse the previous layer's selection (index sharing). RoPE is YaRN-scaled
with learned per-frequency multipliers (LeRoPE), queries get a learned position-dependent scale
(SSMax), layer 0 is dense and the others route to 4 of 128 softmax-scored experts plus a shared
expert. LARGE4.md (repository root) gives every formula, shape and checkpoint key; large4_config.py
the config and the published checkpoint layout. The indexer's sparse selection and the masks built
from it are here.

State shared between layers (the rope tables, a source layer's latent and rotated key, the
previous layer's selection and the attention mask built from it) is an explicit block input built
once per forward (the mask once per group of layers sharing a selection), never a mutable
dictionary: a checkpointed or pipelined block is then a pure function of its arguments.
The one forward reads as on one device and serves the whole model, a pipeline stage and a
context-parallel rank alike (stage.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from attention import (
    FULL,
    Mask,
    MaskMod,
    at_queries,
    block_mask,
    fused_flex_attention,
    layer_mask_mod,
    new_block_mask,
    resolve_backend,
)
from balance import RouterLosses, Stats, add_layer
from generate import generate
from head import Head
from large4_config import (  # noqa: F401  (PRESETS: re-exported for users of large4)
    LAYOUT,
    PRESETS,
    Large4Config,
)
from layers import Gather, RMSNorm, build, check_inputs, count_params, init_weights, seeded_normal
from moe import MoE, SwiGLU
from registry import Family
from stage import ONE_DEVICE, ForwardPlan, StageContext

# cos or sin [B, T, R/2] FP32, built once per forward; None on a pipeline stage when no layer from
# it on rotates
Angles = torch.Tensor | None

# =========================================================================== rotary, SSMax, indexer


def yarn_frequencies(config: Large4Config) -> list[float]:
    """The R/2 YaRN inverse frequencies, computed in FP32 as transformers does: the fast ones
    (beyond beta_fast rotations over the original context) kept, the slow ones (under beta_slow)
    divided by `factor`, a linear ramp between."""
    dim, rope = config.qk_rope_head_dim, config.rope_parameters
    base = 1.0 / rope["rope_theta"] ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    )
    if rope["rope_type"] == "default":
        return base.tolist()
    factor, original = rope["factor"], rope["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(original / (rotations * 2 * math.pi))
            / (2 * math.log(rope["rope_theta"]))
        )

    low, high = (
        correction_dim(rope.get("beta_fast", 32.0)),
        correction_dim(rope.get("beta_slow", 1.0)),
    )
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    return (base / factor * ramp + base * (1 - ramp)).tolist()


def yarn_attention_factor(rope: dict) -> float:
    """cos/sin are scaled by this; the release gives attention_factor 1.0."""
    if rope["rope_type"] == "default":
        return 1.0
    default = 0.1 * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
    return float(rope.get("attention_factor") or default)


class LeRoPE(nn.Module):
    """YaRN frequencies times exp(alpha), alpha a learned FP32 [R/2] (0 at init: plain YaRN).

    Its forward builds the angles once per model forward, in FP32, for all layers: alpha gets a
    gradient from every RoPE layer of attention (the indexer is frozen and adds none)."""

    def __init__(self, config: Large4Config):
        super().__init__()
        # python floats: no buffer to re-materialise after meta
        self.inv_freq = yarn_frequencies(config)
        self.scale = yarn_attention_factor(config.rope_parameters)
        self.alpha = nn.Parameter(torch.empty(config.qk_rope_head_dim // 2, dtype=torch.float32))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, R/2] in FP32."""
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32, device=positions.device)
        angles = positions.float().unsqueeze(-1) * (inv_freq * self.alpha.float().exp())
        return angles.cos() * self.scale, angles.sin() * self.scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on x [..., R] (pair 2j, 2j+1 turns by angle j), in FP32; cos/sin broadcast
    to [..., R/2]. The result is written de-interleaved, [rotated evens | rotated odds], as
    transformers does: dot products are the same either way, a cached rotary key is not."""
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).to(x.dtype)


class SSMax(nn.Module):
    """Scalable softmax: head h of a query at position p is scaled by scale_h * log(p + 1) +
    bias_h."""

    def __init__(self, num_heads: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(num_heads, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_heads, dtype=dtype))

    def forward(self, q: torch.Tensor, log_positions: torch.Tensor) -> torch.Tensor:
        """q [B, T, heads, D], log_positions [B, T] (log(p + 1), FP32) -> q scaled, same shape."""
        # [B, T, heads]
        factor = self.scale * log_positions.unsqueeze(-1).to(self.scale.dtype) + self.bias
        return q * factor.unsqueeze(-1).to(q.dtype)


class FP32LayerNorm(nn.LayerNorm):
    """A LayerNorm whose parameters stay FP32 and that normalises in FP32 whatever the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps
        )


class Indexer(nn.Module):
    """The DSA lightning indexer: a frozen selector of each query's top index_topk keys.

    index[t, s] = sum_h w[t, h] * relu(qI[t, h] . kI[s] / sqrt(D)), w = weights_proj(x) / sqrt(Hi);
    qI from the LayerNormed input (then SSMax), one key head kI shared by all index heads; on RoPE
    layers the FIRST qk_rope_head_dim channels of both are rotated. No gradient, no optimizer state.
    """

    def __init__(self, config: Large4Config, rope: bool, dtype: torch.dtype | None = None):
        super().__init__()
        hidden, self.heads, self.head_dim = (
            config.hidden_size,
            config.index_n_heads,
            config.index_head_dim,
        )
        self.rope_dim = config.qk_rope_head_dim if rope else 0
        self.top_k, self.chunk = config.index_topk, config.indexer_chunk_size
        self.q_input_norm = nn.LayerNorm(hidden, eps=config.indexer_norm_eps, dtype=dtype)
        self.wq_b = nn.Linear(hidden, self.heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(hidden, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = FP32LayerNorm(self.head_dim, eps=config.indexer_norm_eps, dtype=torch.float32)
        self.weights_proj = nn.Linear(hidden, self.heads, bias=False, dtype=torch.float32)
        self.softmax_scaling = SSMax(self.heads, dtype)
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        cos: Angles,
        sin: Angles,
        log_positions: torch.Tensor,
        visible: Visibility,
        cache: LayerCache | None = None,
        gather: Gather | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] -> key indices [B, T, min(index_topk, S)], -1 where no visible key is
        left."""
        batch, seq_len, _ = x.shape
        q = self.wq_b(self.q_input_norm(x)).view(batch, seq_len, self.heads, self.head_dim)
        q = self.softmax_scaling(q, log_positions)
        k = self.k_norm(self.wk(x))  # [B, T, D] FP32
        if self.rope_dim:
            r = self.rope_dim
            q = torch.cat(
                [rotate(q[..., :r], cos.unsqueeze(2), sin.unsqueeze(2)), q[..., r:]], dim=-1
            )
            k = torch.cat([rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        if gather is not None:
            k = gather(k)  # context parallel: this rank's keys -> the whole sequence's [B, S, D]
        if cache is not None:
            k = cache.extend("index_keys", k)  # [B, S, D]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5
        return top_keys(q, k, weights, visible, min(self.top_k, k.shape[1]), self.chunk)


class LayerCache:
    """What one layer keeps between generation steps: its normed latent and rotated key if it owns
    its KV (a consumer reads its source's), and its indexer keys if it runs an indexer."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def extend(self, name: str, new: torch.Tensor | None) -> torch.Tensor | None:
        """Append new [B, t, ...] along the sequence; return everything so far [B, S, ...]."""
        if new is None:
            return None
        if name in self.tensors:
            new = torch.cat([self.tensors[name], new], dim=1)
        self.tensors[name] = new
        return new


# ============================================================================= sparse attention
# The DSA indexer picks, per query, the top-k keys by a cheap score; attention then sees only
# those keys that are also causal and in the query's document. Visibility describes the causal and
# document part compactly; the attention mask of a group of layers that share one selection is
# built once (selection_attention_mask) and read by each layer of the group.


class Visibility(NamedTuple):
    """The keys each query may see: causal, and inside its document when doc_ids [B, S] is given
    (< 0: padding, never seen). The queries are the last q_len of the kv_len positions (generation
    appends them to cached keys), or those at `queries` [q_len] (a context-parallel rank's share).
    A description, not a bool [B, 1, T, S] (T x S bytes per sequence, 16 GiB at 128k tokens): it is
    realised a chunk of queries at a time."""

    doc_ids: torch.Tensor | None
    batch: int
    q_len: int
    kv_len: int
    device: torch.device
    queries: torch.Tensor | None = None

    def mask_mod(self) -> MaskMod:
        mod, offset, queries = (
            layer_mask_mod(FULL, None, self.doc_ids),
            self.kv_len - self.q_len,
            self.queries,
        )
        if queries is not None:
            return at_queries(mod, queries)
        if offset == 0:
            return mod

        def shifted(b, h, q_idx, kv_idx):
            return mod(b, h, q_idx + offset, kv_idx)

        return shifted

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Queries start .. stop - 1 -> bool [B, 1, stop - start, S]."""
        stop = min(stop, self.q_len)
        b = torch.arange(self.batch, device=self.device).view(-1, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device)
        q = torch.arange(start, stop, device=self.device).view(1, 1, -1, 1)
        kv = torch.arange(self.kv_len, device=self.device).view(1, 1, 1, -1)
        return self.mask_mod()(b, h, q, kv).expand(self.batch, 1, stop - start, self.kv_len)


def top_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    visible: Visibility,
    top_k: int,
    chunk: int,
) -> torch.Tensor:
    """The indexer's selection, computed `chunk` queries at a time in FP32, so the scores never
    exist for all queries at once (O(chunk x heads x S) memory, not O(T x heads x S)).

    q [B, T, Hi, D], k [B, S, D], weights [B, T, Hi], visible: the keys each query may see ->
    key indices int64 [B, T, top_k]; -1 marks a slot that top-k filled with a key the query may
    not see (it sees fewer than top_k keys), so such slots are never attended: every index >= 0
    is a visible key.
    index[b, t, s] = sum_h weights[b, t, h] * relu(q[b, t, h] . k[b, s] / sqrt(D)).
    """
    scale = q.shape[-1] ** -0.5
    q, k, weights = q.float(), k.float(), weights.float()
    picked = []
    for start in range(0, q.shape[1], chunk):
        rows = slice(start, start + chunk)
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q[:, rows], k) * scale)  # [B, C, Hi, S]
        index = torch.einsum("bth,bths->bts", weights[:, rows], scores)  # [B, C, S]
        index = index.masked_fill(~visible.rows(start, start + chunk)[:, 0], float("-inf"))
        values, indices = torch.topk(index, top_k, dim=-1)  # [B, C, top_k]
        picked.append(indices.masked_fill(values == float("-inf"), -1))
    return torch.cat(picked, dim=1)


def selection_mask(indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Key indices [B, T, k] (-1: no key) -> bool [B, 1, T, kv_len], True at the selected keys."""
    slots = indices.masked_fill(indices < 0, kv_len)  # invalid slots go to a scratch column
    chosen = torch.zeros(*indices.shape[:2], kv_len + 1, dtype=torch.bool, device=indices.device)
    return chosen.scatter_(-1, slots, True)[..., :kv_len].unsqueeze(1)


def selection_block_mask(indices: torch.Tensor, kv_len: int, block: int = 128) -> BlockMask:
    """Key indices [B, T, k] (-1: no key) -> a BlockMask built from the indices alone, never from a
    [B, 1, T, S] grid. Its mask_mod reads the selection packed 32 keys to an int32 word, T x S / 8
    bytes (8 MiB per 8k-token sequence, not 64 MiB of bools), and it lists, per block of `block`
    queries, only the key blocks that one of them selected, so FlexAttention skips the others."""
    batch, q_len, _ = indices.shape
    valid, keys = indices >= 0, indices.clamp(min=0)
    bits = torch.bitwise_left_shift(
        torch.ones_like(keys, dtype=torch.int32), (keys % 32).to(torch.int32)
    )
    words = torch.zeros(batch, q_len, -(-kv_len // 32), dtype=torch.int32, device=indices.device)
    # [B, T, S / 32]; keys are distinct, so add = or
    words.scatter_add_(-1, keys // 32, bits * valid)
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    row = (torch.arange(q_len, device=indices.device) // block).view(1, q_len, 1)
    # invalid: a scratch column
    cell = row * (kv_blocks + 1) + torch.where(valid, keys // block, kv_blocks)
    touched = torch.zeros(
        batch, q_blocks * (kv_blocks + 1), dtype=torch.int32, device=indices.device
    )
    touched = touched.scatter_(1, cell.view(batch, -1), 1).view(batch, q_blocks, kv_blocks + 1)[
        ..., :kv_blocks
    ]
    kv_num_blocks = touched.sum(-1, dtype=torch.int32)  # [B, Tq / block]
    # touched first
    kv_indices = torch.argsort(touched, dim=-1, descending=True, stable=True).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((words[b, q_idx, kv_idx // 32] >> (kv_idx % 32)) & 1) == 1

    return BlockMask.from_kv_blocks(
        kv_num_blocks.unsqueeze(1),
        kv_indices.unsqueeze(1),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def selection_attention_mask(
    visible: Visibility, indices: torch.Tensor | None, backend: str
) -> Mask:
    """The attention mask of one group of layers: a layer with its own indexer and those sharing its
    selection (indices [B, T, k], -1: none), or all layers when attention is dense (indices None:
    every visible key). Built once per group and read by each of its layers. Every selected key is
    visible (top_keys), so the selection alone is the mask. sdpa: bool [B, 1, T, S]; flex: a
    BlockMask (the dense one compiled from the mask_mod on GPUs, the sparse one from the
    indices)."""
    if backend == "flex":
        if indices is not None:
            return selection_block_mask(indices, visible.kv_len)
        if visible.queries is None:
            return block_mask(
                FULL, None, visible.doc_ids, visible.batch, visible.q_len, visible.device
            )
        return new_block_mask(
            visible.mask_mod(), visible.batch, visible.q_len, visible.kv_len, visible.device
        )
    return (
        visible.rows(0, visible.q_len)
        if indices is None
        else selection_mask(indices, visible.kv_len)
    )


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain attention with an FP32 softmax: q [B, H, T, Dk], k [B, H, S, Dk], v [B, H, S, Dv],
    allowed bool [B, 1, T, S] -> [B, H, T, Dv]. A query that may see no key (padding) outputs 0.

    Masked scores get the most negative finite value, not -inf, so that such a row stays finite
    (uniform) before it is zeroed and backward never meets a NaN. `where` keeps `allowed` itself for
    backward, so the layers of a group share one saved mask.
    """
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [B, H, T, S]
    scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1) * allowed.any(dim=-1, keepdim=True)
    return probs.to(v.dtype) @ v


def flex_masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    """masked_attention through FlexAttention (the GPU path), with a group's BlockMask: the T x S
    scores never exist and key blocks that no query of a block may see are skipped. A query that
    sees no key outputs 0."""
    return fused_flex_attention(q, k, v, mask, scale)[0]


# ========================================================================== attention and the block


class MLAttention(nn.Module):
    """Multi-head latent attention without query LoRA, restricted to the indexer's selection.

    Keys and values of every head are expanded by this layer's kv_b_proj from a normed latent
    [B, S, r] that this layer computes, or, on a KV consumer, that its source layer computed; the
    one rotary key [B, S, R] is shared by all heads. Per head, query and key are [nope | rope].
    """

    def __init__(self, config: Large4Config, index: int, dtype: torch.dtype | None = None):
        super().__init__()
        hidden, self.heads = config.hidden_size, config.num_attention_heads
        self.rope_dim = config.qk_rope_head_dim if config.no_rope_layers[index] else 0
        self.qk_dim, self.v_dim, self.rank = (
            config.qk_head_dim,
            config.v_head_dim,
            config.kv_lora_rank,
        )
        self.nope_dim = self.qk_dim - self.rope_dim  # NoPE layers: every channel
        self.q_proj = nn.Linear(hidden, self.heads * self.qk_dim, bias=False, dtype=dtype)
        if config.kv_source_layers[index] == index:  # consumers own no latent projection
            self.kv_a_proj_with_mqa = nn.Linear(
                hidden, self.rank + self.rope_dim, bias=False, dtype=dtype
            )
            self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = nn.Linear(
            self.rank, self.heads * (self.nope_dim + self.v_dim), bias=False, dtype=dtype
        )
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False, dtype=dtype)
        self.softmax_scaling = SSMax(self.heads, dtype)
        if config.indexer_types[index] == "full":
            self.indexer = Indexer(config, bool(config.indexer_no_rope_layers[index]), dtype)

    def latent(
        self, x: torch.Tensor, cos: Angles, sin: Angles
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, H] -> normed latent [B, T, r] and rotated key [B, T, R] (None on NoPE
        layers)."""
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent), (rotate(rope_key, cos, sin) if self.rope_dim else None)

    def forward(
        self,
        x: torch.Tensor,
        cos: Angles,
        sin: Angles,
        log_positions: torch.Tensor,
        mask: Mask,
        latent: torch.Tensor,
        rope_key: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, T, H] queries; latent [B, S, r] and rope_key [B, S, R] keys; mask: a BlockMask
        (FlexAttention) or bool [B, 1, T, S] (dense scores)."""
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.heads, self.qk_dim)
        if self.rope_dim:
            q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
            q = torch.cat([q_nope, rotate(q_rope, cos.unsqueeze(2), sin.unsqueeze(2))], dim=-1)
        q = self.softmax_scaling(q, log_positions).transpose(1, 2)  # [B, heads, T, qk]
        keys = latent.shape[1]
        kv = (
            self.kv_b_proj(latent)
            .view(batch, keys, self.heads, self.nope_dim + self.v_dim)
            .transpose(1, 2)
        )
        # [B, heads, S, nope], [B, heads, S, v]
        k, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        if self.rope_dim:
            k = torch.cat(
                [k, rope_key.unsqueeze(1).expand(batch, self.heads, keys, self.rope_dim)], dim=-1
            )
        attend = flex_masked_attention if isinstance(mask, BlockMask) else masked_attention
        out = attend(q, k, v, mask, self.qk_dim**-0.5)  # [B, heads, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, self.heads * self.v_dim))


class Large4Block(nn.Module):
    """Pre-norm: h = x + attention(norm(x)); y = h + mlp(norm(h)); dense or MoE by schedule.

    A pure function of its arguments (see the module docstring):
    (x, cos, sin, log_positions, visible, src_latent, src_rope_key, prev_indices, prev_mask)
        -> (y, own_latent, own_rope_key, indices, mask)
    Given the router-loss statistics so far (`stats`, and real [B, T]: false at padding), the MoE
    adds its own and they come back as a sixth output (only then: stage.ForwardPlan.block). own_*
    are None on a KV consumer; indices is None when attention is dense (every query may
    attend index_topk keys or fewer), else [B, T, k] with -1 for invalid slots. A layer whose
    indexer selects starts a group: it builds the group's attention mask from its selection, once,
    and returns it; the other layers attend with prev_mask. `cache` (generation), `backend` (flex |
    sdpa: how a new mask is realised) and `gather` (context parallelism: [B, T / cp, ...] of this
    rank's positions -> [B, T, ...], for the keys and latents) are keyword settings, not state.
    """

    def __init__(self, config: Large4Config, index: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.index, self.source = index, config.kv_source_layers[index]
        # its place among the MoE layers
        self.loss_slot = sum(config.is_moe_layer(i) for i in range(index))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAttention(config, index, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(index):
            self.mlp = MoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.moe_intermediate_size * config.n_shared_experts,
                config.n_routed_experts,
                config.num_experts_per_tok,
                True,
                config.experts_backend,
                dtype,
                score_function="softmax",
                scaling=config.routed_scaling_factor,
                selection_bias=config.router_bias_update_rate > 0,
                capacity_factor=config.capacity_factor,
            )
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: Angles,
        sin: Angles,
        log_positions: torch.Tensor,
        visible: Visibility,
        src_latent: torch.Tensor | None = None,
        src_rope_key: torch.Tensor | None = None,
        prev_indices: torch.Tensor | None = None,
        prev_mask: Mask | None = None,
        cache: LayerCache | None = None,
        backend: str = "sdpa",
        gather: Gather | None = None,
        stats: Stats | None = None,
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Mask | Stats | None, ...]:
        attn_in = self.input_layernorm(x)
        latent, rope_key, own = src_latent, src_rope_key, self.source == self.index
        if own:
            latent, rope_key = self.self_attn.latent(attn_in, cos, sin)
            if gather is not None:
                latent, rope_key = gather(latent), (None if rope_key is None else gather(rope_key))
            if cache is not None:
                latent, rope_key = (
                    cache.extend("latent", latent),
                    cache.extend("rope_key", rope_key),
                )
        indices, mask = prev_indices, prev_mask
        if hasattr(self.self_attn, "indexer") and selects(
            self.self_attn.indexer.top_k, visible, cache
        ):
            indices = self.self_attn.indexer(
                attn_in, cos, sin, log_positions, visible, cache, gather
            )
            mask = selection_attention_mask(visible, indices, backend)
        h = x + self.self_attn(attn_in, cos, sin, log_positions, mask, latent, rope_key)
        mlp_in = self.post_attention_layernorm(h)
        if stats is None or not isinstance(self.mlp, MoE):
            y = h + self.mlp(mlp_in)
        else:
            routed, logits, chosen = self.mlp.routed(mlp_in)
            y, stats = (
                h + routed,
                add_layer(
                    stats, self.loss_slot, logits, chosen, real, self.mlp.router.score_function
                ),
            )
        outputs = (y, (latent if own else None), (rope_key if own else None), indices, mask)
        return outputs if stats is None else (*outputs, stats)


def selects(top_k: int, visible: Visibility, cache: LayerCache | None) -> bool:
    """Whether the indexers run: not when every visible key would be selected (no query sees more
    than top_k keys; attention is then dense), unless generation needs their keys cached."""
    return cache is not None or visible.kv_len > top_k


# ============================================================================= the model


def router_losses_of(config: Large4Config) -> RouterLosses:
    """The router losses Large 4's config asks for: DeepSeek-V3's sequence-wise term and the z-loss
    (balance.py). The published Large 4 has no balancing term of its own."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return RouterLosses(
        config.num_experts,
        config.num_experts_per_tok,
        moe_layers,
        sequence=config.router_sequence_loss_coef,
        z=config.router_z_loss_coef,
    )


class MistralLarge4(nn.Module):
    """Mistral Large 4. One forward serves the whole model, a pipeline stage (pipeline.py deletes
    the layers of the other stages; the embedding and the rotary (alpha) stay on the first stage,
    norm and head on the last) and a context-parallel rank. Parameter names never change. Each
    stage rebuilds the positions, SSMax's log positions and the causal and document visibility from
    the doc_ids every stage is given. Under context parallelism (`stage`, set by parallel.py)
    every rank of a cp group is given the whole batch and computes the queries at its share of the
    positions; each layer gathers the small compressed latents, rotated keys and indexer keys over
    the group, so attention and the selection see every key of the sequence, exactly."""

    # the layouts its forward serves beyond data and expert parallelism (parallel.py)
    parallel_dims = ("pp", "cp")
    stage: StageContext = ONE_DEVICE  # the seam to the layouts (stage.py); parallel.py sets it

    def __init__(self, config: Large4Config, dtype: torch.dtype | None = None):
        """Bulk parameters in `dtype`; alpha, routers, indexer weights_proj and k_norm, and the head
        are always FP32. Build on the meta device and call `init_weights()` (see `build_large4`)."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = LeRoPE(config)
        self.layers = nn.ModuleDict(
            {str(i): Large4Block(config, i, dtype) for i in range(config.num_hidden_layers)}
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Head(
            config.hidden_size,
            config.vocab_size,
            config.loss_chunk_size,
            config.final_logit_softcapping,
        )

    def init_weights(self, seed: int = 0) -> None:
        """Every parameter from `initial_value` (layers.init_weights): the same weights in every
        layout."""
        init_weights(self, seed)

    @property
    def router_losses(self) -> RouterLosses:
        """The router losses its config asks for (balance.py), read at each forward as the config
        is."""
        return router_losses_of(self.config)

    def check_inputs(self, input_ids, targets, doc_ids, positions) -> None:
        check_inputs(self.config, input_ids, targets, doc_ids, positions)

    # what only the first pipeline stage keeps (parallel.py)
    first_stage_modules = ("embed_tokens", "rotary")

    def initial_value(self, name: str, param: torch.Tensor, seed: int) -> torch.Tensor:
        """As transformers initialises: alpha 0, SSMax scale 0 and bias 1 (identity), norms 1 (and
        LayerNorm biases 0), matrices and routers normal(0, initializer_range) seeded by name."""
        owner, leaf = self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        constants = {
            LeRoPE: {"alpha": 0.0},
            SSMax: {"scale": 0.0, "bias": 1.0},
            RMSNorm: {"weight": 1.0},
            nn.LayerNorm: {"weight": 1.0, "bias": 0.0},
        }
        for kind, values in constants.items():
            if isinstance(owner, kind):
                return torch.full(param.shape, values[leaf], dtype=param.dtype, device=param.device)
        if param.dim() < 2:
            raise ValueError(
                f"{name}: no initialisation rule for a {param.dim()}-D parameter of "
                f"{type(owner).__name__}"
            )
        return seeded_normal(name, param, seed, self.config.initializer_range)

    def forward(
        self,
        *inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids [B, T] -> FP32 soft-capped logits [B, T, V], or with targets [B, T] (shifted,
        -100 ignored) the mean loss, plus the router losses when on; targets, doc_ids and
        positions may also follow input_ids positionally. doc_ids [B, T] marks packed documents
        (< 0: padding); positions default to restarting at each document. The visibility,
        positions and rope tables are built once per forward and passed to every block.

        A layout enters through `self.stage` (stage.py): on a pipeline stage without the
        embedding, the arguments are the previous stage's tuple (`stage_boundary`, which carries
        the rope tables), and without the head the result is the next stage's; a context-parallel
        rank computes its share of the positions (`plan.local`), its loss its share of the mean."""
        plan = self.stage.plan(self, inputs, targets, doc_ids, positions)
        positions = plan.local(plan.positions)  # [B, T / cp]
        visible = Visibility(
            plan.doc_ids, plan.batch, positions.shape[1], plan.seq_len, plan.device, plan.mine
        )
        layers = [int(name) for name in self.layers]
        if self.embed_tokens is not None:
            h, (cos, sin) = self.embed_tokens(plan.local(plan.input_ids)), self.rotary(positions)
            shared, indices = {}, None
        else:
            h, cos, sin, shared, indices = self._unpack(plan.received, layers[0])
        h, shared, indices = self.run_stage(
            h, cos, sin, positions, visible, shared, indices, plan=plan
        )
        if self.lm_head is None:
            return plan.send(*self._pack(h, cos, sin, shared, indices, layers[-1] + 1))
        h = self.norm(h.float())
        if plan.targets is None:
            return self.lm_head(h)
        return plan.loss(self.lm_head(h, plan.local(plan.targets)))

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        visible: Visibility,
        caches: dict[int, LayerCache] | None = None,
    ) -> torch.Tensor:
        """The decoder stack: the rope tables, built once for all layers, then every layer."""
        cos, sin = self.rotary(positions)  # [B, T, R/2] FP32
        return self.run_stage(h, cos, sin, positions, visible, caches=caches)[0]

    def run_stage(
        self,
        h: torch.Tensor,
        cos: Angles,
        sin: Angles,
        positions: torch.Tensor,
        visible: Visibility,
        shared: dict[int, tuple] | None = None,
        indices: torch.Tensor | None = None,
        caches: dict[int, LayerCache] | None = None,
        plan: ForwardPlan | None = None,
    ) -> tuple[torch.Tensor, dict[int, tuple], torch.Tensor | None]:
        """The layers this module holds (all, or a pipeline stage's) -> (h, shared, indices).
        `shared` maps a source layer to its latent and rotated key, `indices` is the current
        selection; both live only in this call (a pipeline stage receives and returns them as
        tensors) and reach each layer as arguments, as does the attention mask of the current group.
        That mask is built here for a dense forward (one group of all layers) or from a selection
        received from the previous stage; each layer whose indexer selects builds its own group's.
        `plan`: the forward's (stage.py), through which each block runs (the layout's gather, the
        router-loss statistics); generation's adds nothing."""
        plan = ForwardPlan() if plan is None else plan
        # Generation stays dense: a compiled flex kernel would recompile for every new key count.
        backend = (
            "sdpa"
            if caches is not None
            else resolve_backend(self.config.attention_backend, h.device, flash=False)
        )
        log_positions = torch.log(positions.float() + 1)  # SSMax, FP32
        shared = dict(shared or {})
        dense = not selects(self.config.index_topk, visible, caches)
        mask = (
            selection_attention_mask(visible, indices, backend)
            if dense or indices is not None
            else None
        )
        for layer in self.layers.values():
            source_kv = shared.get(layer.source, (None, None))
            cache = None if caches is None else caches.setdefault(layer.index, LayerCache())
            h, latent, rope_key, indices, mask = plan.block(
                layer,
                h,
                cos,
                sin,
                log_positions,
                visible,
                *source_kv,
                indices,
                mask,
                cache=cache,
                backend=backend,
            )
            if self.config.kv_mode(layer.index) == "store":
                shared[layer.index] = (latent, rope_key)
        return h, shared, indices

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend prompt [B, T] by up to max_new_tokens -> [B, T + n] (see generate.stream), caching
        compressed latents (+ rotary key, once per source, read by its consumers) and indexer keys:
        equal to running the whole sequence again at every step."""
        return generate(
            self, prompt, max_new_tokens, temperature, top_k, generator, eos_token_id, allowed
        )

    def decode_step(
        self, input_ids: torch.Tensor, caches: dict[int, LayerCache], start: int
    ) -> torch.Tensor:
        """New tokens [B, t] at positions start.. through the cached layers -> last logits [B,
        V]."""
        batch, seq_len = input_ids.shape
        positions = torch.arange(start, start + seq_len, device=input_ids.device).expand(
            batch, seq_len
        )
        # causal over the cache
        visible = Visibility(None, batch, seq_len, start + seq_len, input_ids.device)
        h = self.run_layers(self.embed_tokens(input_ids), positions, visible, caches)
        return self.lm_head(self.norm(h[:, -1:].float()))[:, -1]

    # ----------------------------------------------------------- what train.py and parallel.py need
    def fp32_modules(self, layer: Large4Block) -> list[nn.Module]:
        """The modules of one block that stay FP32 under a BF16 policy (one FSDP unit per block)."""
        modules = [layer.mlp.router] if isinstance(layer.mlp, MoE) else []
        indexer = getattr(layer.self_attn, "indexer", None)
        return modules + ([indexer.weights_proj, indexer.k_norm] if indexer is not None else [])

    def fp32_root_modules(self) -> list[nn.Module]:
        """FP32 units outside the blocks, besides the head: the rotary, which holds alpha (on the
        first pipeline stage only)."""
        return [self.rotary] if self.rotary is not None else []

    def checkpointed_block_bytes(self, seq_len: int) -> float:
        """What a checkpointed block keeps for backward per token (tools/memory.py): its BF16 input
        and, with the selection on (seq_len > index_topk), the int64 top-k key indices [T, k] each
        block receives (the rehearsal measured 128 MiB per block at 8,192 tokens)."""
        c = self.config
        return 2 * c.hidden_size + (8 * c.index_topk if seq_len > c.index_topk else 0)

    def block_activation_bytes(self, seq_len: int) -> float:
        """Activations one block saves for backward per token, in BF16 (tools/memory.py, which
        assumes GPUs): the projections; the selection and its group's attention mask (shared by the
        layers of a group, counted here for every block: bools over seq_len keys with sdpa, one bit
        per key with flex); with the sdpa backend also the FP32 score and probability rows (flex
        keeps only the softmax statistics); the MoE as for Flint."""
        c = self.config
        attended = min(seq_len, c.index_topk)
        projections = 2 * (
            4 * c.hidden_size
            + 3 * c.num_attention_heads * c.qk_head_dim
            + 2 * (c.kv_lora_rank + c.qk_rope_head_dim)
            + c.num_attention_heads * (c.qk_head_dim + 2 * c.v_head_dim)
        )
        sdpa = c.attention_backend == "sdpa"
        rows = 8 * c.num_attention_heads * seq_len if sdpa else 4 * c.num_attention_heads
        # attention rows, mask, indices
        scores = rows + (seq_len if sdpa else seq_len / 8) + 8 * attended
        k, width = c.num_experts_per_tok, c.moe_intermediate_size
        moe = (
            2 * (k * c.hidden_size + 5 * k * width + 3 * width * c.n_shared_experts)
            + 4 * c.n_routed_experts
        )
        return projections + scores + moe

    def num_params(self, active: bool = False) -> int:
        """All parameters, or those one token uses (top-k of the routed experts, not all E)."""
        return count_params(self, active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (LARGE4.md section 6.3): 6 per active trainable matrix weight
        (the head included, the embedding lookup not), 2 per frozen indexer weight (forward only),
        attention 6 * heads * (qk + v) per attended key (min(i + 1, index_topk) at position i), and
        the indexer's scoring 2 * Hi * D per scored key (i + 1) on full-indexer layers."""
        c = self.config
        matrices = sum(p.numel() for p in self.parameters() if p.dim() >= 2 and p.requires_grad)
        idle = self.num_params() - self.num_params(active=True)
        frozen = sum(p.numel() for p in self.parameters() if p.dim() >= 2 and not p.requires_grad)
        flops = 6.0 * (matrices - idle - c.vocab_size * c.hidden_size) + 2.0 * frozen
        attended = sum(min(i + 1, c.index_topk) for i in range(seq_len)) / seq_len
        scored = (seq_len + 1) / 2
        flops += (
            c.num_hidden_layers
            * 6.0
            * c.num_attention_heads
            * (c.qk_head_dim + c.v_head_dim)
            * attended
        )
        flops += c.indexer_types.count("full") * 2.0 * c.index_n_heads * c.index_head_dim * scored
        return flops

    # ------------------------------------------------------------------ pipeline stages
    # Stages exchange the fixed tuple of tensors that `stage_boundary` describes. Stage boundaries
    # may fall anywhere, between a KV source and its consumers or inside a group sharing one
    # selection: what a later layer still needs crosses. The rope tables cross as differentiable
    # tensors, so alpha, on the first stage, receives the gradient of every later layer.
    def stage_io(
        self, batch: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """This stage's (inputs, outputs) for micro-batches [batch, seq_len], as meta tensors:
        static metadata for parallel.py's PipelineStage. Token ids into the first stage, the FP32
        loss out of the last, stage_boundary between."""
        layers = [int(name) for name in self.layers]
        inputs = (
            (torch.empty(batch, seq_len, dtype=torch.long, device="meta"),)
            if self.embed_tokens is not None
            else self.stage_boundary(layers[0], batch, seq_len, dtype)
        )
        outputs = (
            (torch.empty((), device="meta", requires_grad=True),)
            if self.lm_head is not None
            else self.stage_boundary(layers[-1] + 1, batch, seq_len, dtype)
        )
        return inputs, outputs

    def stage_boundary(
        self, layer: int, batch: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        """What crosses into layer `layer` from the stage before it, as meta tensors (requires_grad
        where a gradient flows back): static pipeline metadata, since shape inference would run the
        next stage on uninitialised indices. In order: h [B, T, H]; cos, sin [B, T, R/2] FP32 while
        a later layer rotates; for each source layer a later layer reads, its latent [B, S, r] and,
        if RoPE, its rotated key [B, S, R]; the int32 selection [B, T, k] if `layer` shares it. A
        dense forward (S <= index_topk: no selection) sends it as [B, T, 0], so a boundary is always
        the same tuple of tensors. Last, with a router loss on, its statistics (balance.py). h,
        latents and keys are in the compute `dtype`. S = seq_len; T is seq_len / cp, this rank's
        queries (latents cross gathered over the cp group)."""
        c = self.config
        sources, rope, shares = self._crossing(layer)
        local = seq_len // self.stage.cp

        def meta(width: int, kind: torch.dtype = dtype, length: int = local) -> torch.Tensor:
            return torch.empty(
                batch,
                length,
                width,
                dtype=kind,
                device="meta",
                requires_grad=kind.is_floating_point,
            )

        tensors = [meta(c.hidden_size)] + [meta(c.qk_rope_head_dim // 2, torch.float32)] * 2 * rope
        for source in sources:
            tensors += [meta(c.kv_lora_rank, length=seq_len)]
            tensors += [meta(c.qk_rope_head_dim, length=seq_len)] * c.no_rope_layers[source]
        if shares:
            tensors.append(meta(c.index_topk if seq_len > c.index_topk else 0, torch.int32))
        return tuple(tensors) + self.router_losses.boundary(batch)

    def _crossing(self, layer: int) -> tuple[list[int], bool, bool]:
        """The KV sources that layers from `layer` on read from earlier layers, whether one of them
        rotates (attention or indexer), and whether `layer` shares the previous selection."""
        c = self.config
        sources = sorted({s for j, s in enumerate(c.kv_source_layers) if j >= layer and s < layer})
        rope = any(c.no_rope_layers[layer:]) or any(c.indexer_no_rope_layers[layer:])
        return sources, rope, c.indexer_types[layer] == "shared"

    def _pack(
        self, h, cos, sin, shared: dict[int, tuple], indices: torch.Tensor | None, layer: int
    ) -> tuple:
        """This stage's results -> the tuple stage_boundary(layer) describes."""
        sources, rope, shares = self._crossing(layer)
        tensors = [h] + [cos, sin] * rope
        for source in sources:
            latent, rope_key = shared[source]
            tensors += [latent] + ([rope_key] if rope_key is not None else [])
        if shares:
            tensors.append(
                h.new_zeros(*h.shape[:2], 0, dtype=torch.int32)
                if indices is None
                else indices.to(torch.int32)
            )
        return tuple(tensors)

    def _unpack(self, inputs: tuple, layer: int) -> tuple:
        """The tuple stage_boundary(layer) describes -> (h, cos, sin, shared, indices)."""
        sources, rope, shares = self._crossing(layer)
        h, rest = inputs[0], list(inputs[1:])
        cos, sin = (rest.pop(0), rest.pop(0)) if rope else (None, None)
        shared = {
            source: (rest.pop(0), rest.pop(0) if self.config.no_rope_layers[source] else None)
            for source in sources
        }
        indices = rest.pop(0).long() if shares else None
        return h, cos, sin, shared, (indices if indices is not None and indices.shape[-1] else None)


def build_large4(
    config: Large4Config,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> MistralLarge4:
    """decoder.build for Mistral Large 4: meta build, materialise on `device`, initialise."""
    return build(MistralLarge4, config, device, dtype, seed)


FAMILY = Family(
    "large4",
    Large4Config,
    MistralLarge4,
    model_type="mistral_large4",
    layout=LAYOUT,
    timed_modules=(
        (Indexer, "indexer (Large 4)"),
        (MLAttention, "latent attention (Large 4: projections + core)"),
    ),
    smallest_preset="large4-tiny",
    bench_preset="large4-bench",
)
