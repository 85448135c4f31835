"""A plain, slow, independent reference of the Flint network, written from SPEC.md alone.

The fast model's tests compare against this file, so it is built to be obviously right rather than fast:
loops instead of batching tricks, explicit boolean masks, an explicit sink column inside a full softmax, and
FP32 everywhere. It imports nothing from the repository, only torch and math.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def layer_types_from_schedule(num_layers: int, schedule_num_layers: int | None = None) -> list[str]:
    # A prefix of a deeper model keeps the source schedule, so "last layer" means the source's last layer.
    last = (schedule_num_layers or num_layers) - 1
    return [
        "full_attention" if i < 2 or i % 4 == 1 or i == last else "sliding_attention"
        for i in range(num_layers)
    ]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def reference_positions(doc_ids: Tensor | None, B: int, T: int) -> Tensor:
    """Position of each token inside its document; [B, T] int64."""
    if doc_ids is None:
        return torch.arange(T, dtype=torch.int64).expand(B, T).clone()
    positions = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        for t in range(1, T):
            # A new document starts wherever the id changes; padding simply counts on.
            same_doc = bool(doc_ids[b, t] == doc_ids[b, t - 1])
            positions[b, t] = positions[b, t - 1] + 1 if same_doc else 0
    return positions


def reference_mask(layer_type: str, sliding_window: int, doc_ids: Tensor | None, T: int, B: int) -> Tensor:
    """Which keys each query may attend to; bool [B, T(query), T(key)]."""
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(f"layer_type must be 'full_attention' or 'sliding_attention', got {layer_type!r}")
    q_idx = torch.arange(T)[:, None]  # [T, 1]
    k_idx = torch.arange(T)[None, :]  # [1, T]
    allowed = k_idx <= q_idx  # causal
    if layer_type == "sliding_attention":
        # The window counts the current token: window W keeps keys q-W+1 .. q.
        allowed = allowed & (k_idx > q_idx - sliding_window)
    allowed = allowed.expand(B, T, T)
    if doc_ids is not None:
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
        key_is_real = (doc_ids >= 0)[:, None, :]  # [B, 1, T]: nobody attends a padding key
        allowed = allowed & same_doc & key_is_real
    return allowed.clone()


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


def reference_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, allowed: Tensor) -> Tensor:
    """Softmax attention with one learnable sink logit per query head.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D]; sinks [Hq]; allowed bool [B, T, S]. Returns [B, Hq, T, D] FP32.
    """
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]  # query heads per kv head (GQA)
    out = []
    for b in range(B):
        heads = []
        for h in range(Hq):
            qh, kh, vh = q[b, h].float(), k[b, h // group].float(), v[b, h // group].float()
            scores = (qh @ kh.T) * D**-0.5  # [T, S]
            # -inf (not a large negative number) gives masked keys exactly zero weight; the finite
            # sink column keeps the softmax well defined when a query has no allowed key at all.
            scores = scores.masked_fill(~allowed[b], -math.inf)
            sink_col = sinks[h].float().expand(T, 1)  # [T, 1]
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)  # [T, S + 1]
            heads.append(probs[:, :-1] @ vh)  # the sink's value is zero, so its column drops out
        out.append(torch.stack(heads))
    return torch.stack(out)


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """Dense SwiGLU with nn.Linear weights: down(silu(gate(x)) * up(x))."""
    return (F.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def reference_moe(
    x: Tensor, router_w: Tensor, gate_up: Tensor, down: Tensor, top_k: int, norm_topk_prob: bool
) -> Tensor:
    """Routed experts only (the caller adds the shared expert).

    x [N, H]; router_w [E, H]; gate_up [E, H, 2*Im] (gate columns first); down [E, Im, H]. Returns [N, H].
    """
    x = x.float()
    scores = torch.sigmoid(x @ router_w.float().T)  # [N, E]
    weights, experts = torch.topk(scores, top_k, dim=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    im = down.shape[1]
    rows = []
    for n in range(x.shape[0]):
        y = torch.zeros(x.shape[1])
        for j in range(top_k):
            e = int(experts[n, j])
            w_gate, w_up = gate_up[e, :, :im].float(), gate_up[e, :, im:].float()  # [H, Im] each
            hidden = F.silu(x[n] @ w_gate) * (x[n] @ w_up)  # [Im]
            y = y + weights[n, j] * (hidden @ down[e].float())  # weight applied after the down projection
        rows.append(y)
    return torch.stack(rows)


def is_moe_layer(cfg: dict, i: int) -> bool:
    if i in cfg.get("mlp_only_layers", [0, 1]):
        return False
    return (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def attention_block(cfg: dict, p: dict[str, Tensor], x: Tensor, layer_type: str,
                    allowed: Tensor, positions: Tensor) -> Tensor:
    """q/k/v projections, per-head q/k RMSNorm, RoPE on sliding layers only, sink attention, o_proj."""
    B, T, _ = x.shape
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def heads(w: Tensor, n: int) -> Tensor:  # [B, T, H] -> [B, n, T, D]
        return (x @ w.T).view(B, T, n, D).transpose(1, 2)

    q = rms_norm(heads(p["q_proj.weight"], Hq), p["q_norm.weight"], eps)
    k = rms_norm(heads(p["k_proj.weight"], Hkv), p["k_norm.weight"], eps)
    v = heads(p["v_proj.weight"], Hkv)
    if layer_type == "sliding_attention":  # full-attention layers have no positional encoding (NoPE)
        theta = cfg["rope_parameters"]["rope_theta"]
        q, k = reference_rope(q, positions, theta), reference_rope(k, positions, theta)
    out = reference_attention(q, k, v, p["sinks.weight"], allowed)  # [B, Hq, T, D]
    return out.transpose(1, 2).reshape(B, T, Hq * D) @ p["o_proj.weight"].T


def mlp_block(cfg: dict, p: dict[str, Tensor], x: Tensor, moe: bool) -> Tensor:
    if not moe:
        return swiglu(x, p["gate_proj.weight"], p["up_proj.weight"], p["down_proj.weight"])
    flat = x.reshape(-1, x.shape[-1])  # [B, T, H] -> [B*T, H]
    routed = reference_moe(flat, p["router.weight"], p["experts.gate_up_proj"], p["experts.down_proj"],
                           cfg["num_experts_per_tok"], cfg["norm_topk_prob"])
    shared = swiglu(flat, p["shared_expert.gate_proj.weight"], p["shared_expert.up_proj.weight"],
                    p["shared_expert.down_proj.weight"])
    return (routed + shared).view_as(x)


def sub_params(params: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries under `prefix`, with the prefix stripped, cast to FP32."""
    return {k[len(prefix):]: v.float() for k, v in params.items() if k.startswith(prefix)}


def reference_forward(cfg: dict, params: dict[str, Tensor], input_ids: Tensor,
                      doc_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """FP32 logits [B, T, V] for input_ids [B, T]."""
    B, T = input_ids.shape
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    layer_types = cfg.get("layer_types") or layer_types_from_schedule(L, cfg.get("schedule_num_hidden_layers"))
    if positions is None:
        positions = reference_positions(doc_ids, B, T)
    x = params["embed_tokens.weight"].float()[input_ids]  # [B, T, H]
    for i in range(L):
        p = sub_params(params, f"layers.{i}.")
        allowed = reference_mask(layer_types[i], cfg["sliding_window"], doc_ids, T, B)
        attn_p = sub_params(p, "self_attn.")
        x = x + attention_block(cfg, attn_p, rms_norm(x, p["input_layernorm.weight"], eps),
                                layer_types[i], allowed, positions)
        x = x + mlp_block(cfg, sub_params(p, "mlp."), rms_norm(x, p["post_attention_layernorm.weight"], eps),
                          is_moe_layer(cfg, i))
    x = rms_norm(x, params["norm.weight"], eps)
    return x @ params["lm_head.weight"].float().T


def reference_loss(cfg: dict, params: dict[str, Tensor], input_ids: Tensor, targets: Tensor,
                   doc_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """Mean cross-entropy over positions whose (already shifted) target is not -100."""
    logits = reference_forward(cfg, params, input_ids, doc_ids, positions)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
