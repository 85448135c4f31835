"""What bench.py measures Flint against, on the same weights: the plain eager formulation of its
architecture, the published implementation in transformers (FlintForCausalLM), when present, and one
attention layer by itself (the sweep). bench.py finds it by its name, tools/<family>_baselines.py;
the published runs planner.py is checked against are tools/flint_published_runs.py.

transformers is not a dependency of this repository. The reference row runs when it can be
imported, for example from another environment's site-packages:

    PYTHONPATH=/path/to/venv/lib/python3.11/site-packages \\
        python -m tools.bench --sections main,reference
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import FULL, SLIDING, build_masks
from flint_model import Attention, Flint, FlintConfig, build_model, rope_tables
from moe import MoE, SwiGLU

# ========================================================================= the plain eager baseline


def plain_eager_loss(model: Flint, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The widely used eager formulation of this architecture, over the same weights, to measure
    against.

    What most eager ports do: attention repeats the KV heads, materialises the scores with an
    additive mask, appends the sink column and soft-maxes; experts sort tokens by expert and run two
    grouped GEMMs; the loss takes FP32 logits of every token at once. Written only from SPEC.md."""
    c = model.config
    batch, seq_len = input_ids.shape
    positions = torch.arange(seq_len, device=input_ids.device)
    cos, sin = rope_tables(positions.expand(batch, seq_len), c.head_dim, c.rope_theta)
    q_idx, k_idx = positions.view(-1, 1), positions.view(1, -1)
    window = c.window or seq_len
    allowed = {FULL: k_idx <= q_idx, SLIDING: (k_idx <= q_idx) & (q_idx - k_idx < window)}  # [T, T]
    masks = {
        kind: torch.zeros(seq_len, seq_len, device=input_ids.device).masked_fill(~ok, float("-inf"))
        for kind, ok in allowed.items()
    }
    h = model.embed_tokens.weight[input_ids]  # [B, T, H]
    for layer in model.layers.values():
        attn_in = _rms_norm(h, layer.input_layernorm.weight, c.rms_norm_eps)
        h = h + _eager_attention(
            layer.self_attn, attn_in, masks[layer.layer_type], cos, sin, c.rms_norm_eps
        )
        mlp_in = _rms_norm(h, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        h = h + (
            _eager_moe(layer.mlp, mlp_in)
            if isinstance(layer.mlp, MoE)
            else _swiglu(layer.mlp, mlp_in)
        )
    # [B, T, V]
    logits = _rms_norm(h, model.norm.weight, c.rms_norm_eps).float() @ model.lm_head.weight.T
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _eager_attention(attn: Attention, x, mask, cos, sin, eps) -> torch.Tensor:
    batch, seq_len, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def project(linear, n):  # [B, T, H] -> [B, n, T, D]
        return linear(x).view(batch, seq_len, n, dim).transpose(1, 2)

    q = _rms_norm(project(attn.q_proj, heads), attn.q_norm.weight, eps)
    k = _rms_norm(project(attn.k_proj, kv_heads), attn.k_norm.weight, eps)
    v = project(attn.v_proj, kv_heads)
    if attn.layer_type == SLIDING:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # [B, Hq, T, D]
    scores = (q @ k.transpose(-1, -2)).float() * dim**-0.5 + mask  # [B, Hq, T, T]
    sink = attn.sinks.weight.view(1, -1, 1, 1).expand(batch, heads, seq_len, 1)
    scores = torch.cat([scores, sink], dim=-1)  # [B, Hq, T, T + 1]
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)[..., :-1].to(v.dtype)  # the sink's value is zero
    return attn.o_proj((probs @ v).transpose(1, 2).reshape(batch, seq_len, -1))


def _swiglu(mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))


def _eager_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    shape, x = x.shape, x.reshape(-1, x.shape[-1])  # [B, T, H] -> [N, H]
    top_k, experts = moe.router.top_k, moe.experts
    scores = torch.sigmoid(x.float() @ moe.router.weight.T)  # [N, E]
    weights, chosen = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    order = chosen.flatten().argsort()  # [N*k] assignments, grouped by expert
    token = order // top_k
    ends = (
        torch.bincount(chosen.flatten(), minlength=experts.gate_up_proj.shape[0])
        .cumsum(0)
        .to(torch.int32)
    )
    gate, up = torch._grouped_mm(x[token], experts.gate_up_proj, offs=ends).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, experts.down_proj, offs=ends)  # [N*k, H]
    out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    routed = torch.zeros_like(x).index_add(0, token, out)
    return (routed + _swiglu(moe.shared_expert, x)).view(shape)


# ===================================================================== the published implementation


def transformers_reference(model: Flint) -> nn.Module:
    """transformers' FlintForCausalLM holding `model`'s weights, with eager attention and grouped_mm
    experts, in training mode. Loaded the way users load it: from a Hugging Face export of the model
    (convert.save_hf) through from_pretrained. Raises ImportError without transformers."""
    from transformers import FlintForCausalLM

    from convert import save_hf

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "hf"
        save_hf(model, path)
        reference = FlintForCausalLM.from_pretrained(
            path,
            attn_implementation="eager",
            experts_implementation="grouped_mm",
            dtype=model.embed_tokens.weight.dtype,
        )
    return reference.to(model.embed_tokens.weight.device).train()


def transformers_loss(
    reference: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The mean next-token loss of `targets` (already shifted), from the reference's FP32 logits."""
    logits = reference(input_ids=input_ids).logits.float()  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


# ============================================================================= the attention sweep


def attention_layer_step(
    config: FlintConfig,
    layer_type: str,
    batch: int,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
) -> Callable[[], None]:
    """One attention layer of `layer_type` (projections + core) on random [batch, seq_len] input:
    a function running its forward and backward once."""
    one_layer = dataclasses.replace(
        config,
        num_hidden_layers=1,
        layer_types=[layer_type],
        schedule_num_hidden_layers=None,
        no_rope_layer_indices=None,
    )
    attention = build_model(one_layer, device, dtype, seed=0).layers["0"].self_attn
    x = torch.randn(
        batch, seq_len, one_layer.hidden_size, device=device, dtype=dtype, requires_grad=True
    )
    mask = build_masks([layer_type], one_layer.window, None, batch, seq_len, device, backend)[
        layer_type
    ]
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    rope = rope_tables(positions, one_layer.head_dim, one_layer.rope_theta)
    return lambda: attention(x, rope, mask).sum().backward()
