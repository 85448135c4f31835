"""Plain, slow, independent references of what both models are built from: RMSNorm, positions within
packed documents, the attention masks and softmax attention with sinks (attention.py), SwiGLU and
routed experts (moe.py). Each model's own reference (tests/reference_flint.py,
tests/reference_large4.py) assembles its network.

Built to be obviously right rather than fast: loops instead of batching tricks, explicit boolean
masks, an explicit sink column inside a full softmax, and FP32 everywhere. It imports nothing from
the repository, only torch and math."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor


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


def reference_mask(
    layer_type: str, sliding_window: int, doc_ids: Tensor | None, T: int, B: int
) -> Tensor:
    """Which keys each query may attend to; bool [B, T(query), T(key)]."""
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(
            f"layer_type must be 'full_attention' or 'sliding_attention', got {layer_type!r}"
        )
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


def reference_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, allowed: Tensor) -> Tensor:
    """Softmax attention with one learnable sink logit per query head.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D]; sinks [Hq]; allowed bool [B, T, S]. Returns [B, Hq, T, D]
    FP32."""
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

    x [N, H]; router_w [E, H]; gate_up [E, H, 2*Im] (gate columns first); down [E, Im, H]. Returns
    [N, H]."""
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
            # weight applied after the down projection
            y = y + weights[n, j] * (hidden @ down[e].float())
        rows.append(y)
    return torch.stack(rows)
