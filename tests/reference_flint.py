"""A plain, slow, independent reference of the Flint network, written from SPEC.md alone.

The fast model's tests compare against this file, so it is built to be obviously right rather than
fast: loops instead of batching tricks, explicit boolean masks, an explicit sink column inside a
full softmax, and FP32 everywhere. It imports nothing from the repository, only torch, math and the
shared pieces of tests/reference.py."""

import torch
import torch.nn.functional as F
from torch import Tensor

from reference import (
    reference_attention,
    reference_mask,
    reference_moe,
    reference_positions,
    rms_norm,
    swiglu,
)


def layer_types_from_schedule(num_layers: int, schedule_num_layers: int | None = None) -> list[str]:
    # A prefix of a deeper model keeps the source schedule, so "last layer" means the source's last
    # layer.
    last = (schedule_num_layers or num_layers) - 1
    return [
        "full_attention" if i < 2 or i % 4 == 1 or i == last else "sliding_attention"
        for i in range(num_layers)
    ]


def reference_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """NeoX (rotate-half) RoPE over all head_dim channels. x [B, H, T, D], positions [B, T]."""
    D = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)  # [D/2]
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # [B, 1, T, D]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x.float() * cos + rotated * sin


def is_moe_layer(cfg: dict, i: int) -> bool:
    if i in cfg.get("mlp_only_layers", [0, 1]):
        return False
    return (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def attention_block(
    cfg: dict, p: dict[str, Tensor], x: Tensor, layer_type: str, allowed: Tensor, positions: Tensor
) -> Tensor:
    """q/k/v projections, per-head q/k RMSNorm, RoPE on sliding layers only, sink attention,
    o_proj."""
    B, T, _ = x.shape
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def heads(w: Tensor, n: int) -> Tensor:  # [B, T, H] -> [B, n, T, D]
        return (x @ w.T).view(B, T, n, D).transpose(1, 2)

    q = rms_norm(heads(p["q_proj.weight"], Hq), p["q_norm.weight"], eps)
    k = rms_norm(heads(p["k_proj.weight"], Hkv), p["k_norm.weight"], eps)
    v = heads(p["v_proj.weight"], Hkv)
    # full-attention layers have no positional encoding (NoPE)
    if layer_type == "sliding_attention":
        theta = cfg["rope_parameters"]["rope_theta"]
        q, k = reference_rope(q, positions, theta), reference_rope(k, positions, theta)
    out = reference_attention(q, k, v, p["sinks.weight"], allowed)  # [B, Hq, T, D]
    return out.transpose(1, 2).reshape(B, T, Hq * D) @ p["o_proj.weight"].T


def mlp_block(cfg: dict, p: dict[str, Tensor], x: Tensor, moe: bool) -> Tensor:
    if not moe:
        return swiglu(x, p["gate_proj.weight"], p["up_proj.weight"], p["down_proj.weight"])
    flat = x.reshape(-1, x.shape[-1])  # [B, T, H] -> [B*T, H]
    routed = reference_moe(
        flat,
        p["router.weight"],
        p["experts.gate_up_proj"],
        p["experts.down_proj"],
        cfg["num_experts_per_tok"],
        cfg["norm_topk_prob"],
    )
    shared = swiglu(
        flat,
        p["shared_expert.gate_proj.weight"],
        p["shared_expert.up_proj.weight"],
        p["shared_expert.down_proj.weight"],
    )
    return (routed + shared).view_as(x)


def sub_params(params: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries under `prefix`, with the prefix stripped, cast to FP32."""
    return {k[len(prefix) :]: v.float() for k, v in params.items() if k.startswith(prefix)}


def reference_forward(
    cfg: dict,
    params: dict[str, Tensor],
    input_ids: Tensor,
    doc_ids: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """FP32 logits [B, T, V] for input_ids [B, T]."""
    B, T = input_ids.shape
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    layer_types = cfg.get("layer_types") or layer_types_from_schedule(
        L, cfg.get("schedule_num_hidden_layers")
    )
    if positions is None:
        positions = reference_positions(doc_ids, B, T)
    x = params["embed_tokens.weight"].float()[input_ids]  # [B, T, H]
    for i in range(L):
        p = sub_params(params, f"layers.{i}.")
        allowed = reference_mask(layer_types[i], cfg["sliding_window"], doc_ids, T, B)
        attn_p = sub_params(p, "self_attn.")
        x = x + attention_block(
            cfg,
            attn_p,
            rms_norm(x, p["input_layernorm.weight"], eps),
            layer_types[i],
            allowed,
            positions,
        )
        x = x + mlp_block(
            cfg,
            sub_params(p, "mlp."),
            rms_norm(x, p["post_attention_layernorm.weight"], eps),
            is_moe_layer(cfg, i),
        )
    x = rms_norm(x, params["norm.weight"], eps)
    return x @ params["lm_head.weight"].float().T


def reference_loss(
    cfg: dict,
    params: dict[str, Tensor],
    input_ids: Tensor,
    targets: Tensor,
    doc_ids: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Mean cross-entropy over positions whose (already shifted) target is not -100."""
    logits = reference_forward(cfg, params, input_ids, doc_ids, positions)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
