"""A plain, slow, independent reference of Mistral Large 4, written from LARGE4.md alone.

The fast model's tests compare against this file, so it is built to be obviously right rather than
fast: a loop over batch rows and queries, explicit lists of the keys each query may see, a full FP32
softmax over them, rotary pairs kept interleaved (the model writes them de-interleaved: dot products
are the same), a per-token loop over the chosen experts, and a dict of every layer's latent read by
declared source. It imports nothing from the repository, only torch and math. Parameters are a dict
of native names."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight.float() * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    return (x32 - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()


def yarn_inv_freq(dim: int, rope: dict) -> Tensor:
    """base_j = theta^(-2j/dim); d(b) = dim ln(orig / (2 pi b)) / (2 ln theta); low =
    floor(d(beta_fast)), high = ceil(d(beta_slow)); r_j = clamp((j - low) / (high - low), 0, 1);
    base_j (1 - r_j) + base_j / factor r_j."""
    theta, factor, orig = (
        rope["rope_theta"],
        rope["factor"],
        rope["original_max_position_embeddings"],
    )
    d = lambda b: dim * math.log(orig / (2 * math.pi * b)) / (2 * math.log(theta))  # noqa: E731
    low, high = (
        max(math.floor(d(rope["beta_fast"])), 0),
        min(math.ceil(d(rope["beta_slow"])), dim - 1),
    )
    freqs = []
    for j in range(dim // 2):
        base = theta ** (-2 * j / dim)
        r = min(max((j - low) / (high - low), 0.0), 1.0)
        freqs.append(base * (1 - r) + base / factor * r)
    return torch.tensor(freqs, dtype=torch.float32)


def yarn_magnitude(rope: dict) -> float:
    """What YaRN multiplies cos and sin by: attention_factor when given, else 0.1 ln(factor) + 1
    (1 for factor <= 1); 1 without YaRN."""
    if rope["rope_type"] != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return rope["attention_factor"]
    return 0.1 * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0


def rope_pairs(x: Tensor, angles: Tensor, magnitude: float) -> Tensor:
    """Interleaved RoPE, output kept interleaved: x [..., R], angles [..., R/2] (broadcast); cos and
    sin each scaled by `magnitude`."""
    out = []
    for j in range(x.shape[-1] // 2):
        a, b = x[..., 2 * j], x[..., 2 * j + 1]
        c, s = magnitude * torch.cos(angles[..., j]), magnitude * torch.sin(angles[..., j])
        out += [a * c - b * s, b * c + a * s]
    return torch.stack(out, dim=-1)


def positions_and_mask(doc_ids: Tensor | None, B: int, T: int) -> tuple[Tensor, Tensor]:
    """Positions restart at each document; visible[b, q, k]: k <= q, same document, k not
    padding."""
    positions = torch.zeros(B, T, dtype=torch.int64)
    visible = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            same = doc_ids is None or bool(doc_ids[b, q] == doc_ids[b, q - 1]) if q > 0 else False
            positions[b, q] = positions[b, q - 1] + 1 if same else 0
            for k in range(q + 1):
                ok = doc_ids is None or (
                    bool(doc_ids[b, k] == doc_ids[b, q]) and bool(doc_ids[b, k] >= 0)
                )
                visible[b, q, k] = ok
    return positions, visible


def indexer_selection(
    p: dict,
    pre: str,
    x: Tensor,
    angles: Tensor | None,
    positions: Tensor,
    visible: Tensor,
    cfg: dict,
) -> tuple[Tensor, Tensor]:
    """-> selected bool [B, T, T] (each query's top-k visible keys, or all of them when it sees <=
    k) and the index scores [B, T, T] (for tie checks). Frozen: computed without gradients."""
    Hi, D, R = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    eps = cfg.get("indexer_norm_eps", 1e-6)
    with torch.no_grad():
        B, T, _ = x.shape
        q = (
            layer_norm(x, p[pre + "q_input_norm.weight"], p[pre + "q_input_norm.bias"], eps)
            @ p[pre + "wq_b.weight"].T
        ).view(B, T, Hi, D)
        ssmax = (
            p[pre + "softmax_scaling.scale"] * torch.log(positions.float() + 1)[..., None]
            + p[pre + "softmax_scaling.bias"]
        )
        q = q * ssmax[..., None]
        k = layer_norm(
            x @ p[pre + "wk.weight"].T, p[pre + "k_norm.weight"], p[pre + "k_norm.bias"], eps
        )
        if angles is not None:  # rope on the FIRST R channels
            m = yarn_magnitude(cfg["rope_parameters"])
            q = torch.cat([rope_pairs(q[..., :R], angles[:, :, None], m), q[..., R:]], -1)
            k = torch.cat([rope_pairs(k[..., :R], angles, m), k[..., R:]], -1)
        w = (x @ p[pre + "weights_proj.weight"].T) / math.sqrt(Hi)  # [B, T, Hi]
        index = torch.zeros(B, T, T)
        selected = torch.zeros(B, T, T, dtype=torch.bool)
        for b in range(B):
            for t in range(T):
                keys = visible[b, t].nonzero().flatten().tolist()
                if not keys:
                    continue
                per_head = torch.relu(k[b, keys] @ q[b, t].T / math.sqrt(D))  # [n, Hi]
                index[b, t, keys] = per_head @ w[b, t]
                if len(keys) <= cfg["index_topk"]:
                    chosen = keys
                else:
                    order = torch.argsort(index[b, t, keys], descending=True, stable=True)
                    chosen = [keys[j] for j in order[: cfg["index_topk"]].tolist()]
                selected[b, t, chosen] = True
    return selected, index


def mla(
    p: dict,
    pre: str,
    x: Tensor,
    latent: Tensor,
    k_rope: Tensor | None,
    angles: Tensor | None,
    positions: Tensor,
    attend: Tensor,
    cfg: dict,
) -> Tensor:
    """x [B, T, H] normed input; latent [B, T, r]; k_rope [B, T, R] rotated (None: NoPE); attend [B,
    T, T]."""
    heads, qk, v_dim = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    R = cfg["qk_rope_head_dim"] if k_rope is not None else 0
    B, T, _ = x.shape
    q = (x @ p[pre + "q_proj.weight"].T).view(B, T, heads, qk)
    if R:
        m = yarn_magnitude(cfg["rope_parameters"])
        q = torch.cat([q[..., : qk - R], rope_pairs(q[..., qk - R :], angles[:, :, None], m)], -1)
    ssmax = (
        p[pre + "softmax_scaling.scale"] * torch.log(positions.float() + 1)[..., None]
        + p[pre + "softmax_scaling.bias"]
    )
    q = q * ssmax[..., None]
    kv = (latent @ p[pre + "kv_b_proj.weight"].T).view(B, T, heads, (qk - R) + v_dim)
    k_nope, v = kv[..., : qk - R], kv[..., qk - R :]
    out = torch.zeros(B, T, heads, v_dim)
    rows = []
    for b in range(B):
        for t in range(T):
            keys = attend[b, t].nonzero().flatten().tolist()
            if not keys:
                rows.append(torch.zeros(heads, v_dim))
                continue
            k = k_nope[b, keys]  # [n, heads, qk - R]
            if R:
                k = torch.cat([k, k_rope[b, keys][:, None, :].expand(len(keys), heads, R)], -1)
            scores = torch.einsum("hd,nhd->hn", q[b, t], k) / math.sqrt(qk)
            probs = torch.softmax(scores.float(), dim=-1)
            rows.append(torch.einsum("hn,nhd->hd", probs, v[b, keys]))
    out = torch.stack(rows).view(B, T, heads * v_dim)
    return out @ p[pre + "o_proj.weight"].T


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(p: dict, pre: str, x: Tensor, cfg: dict) -> Tensor:
    B, T, H = x.shape
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat.float() @ p[pre + "router.weight"].float().T, dim=-1)  # [N, E]
    gate_up, down = p[pre + "experts.gate_up_proj"], p[pre + "experts.down_proj"]
    im = down.shape[1]
    out = []
    for n in range(flat.shape[0]):
        top = torch.topk(probs[n], cfg["num_experts_per_tok"])
        weights = top.values / (top.values.sum() + 1e-20) * cfg["routed_scaling_factor"]
        y = torch.zeros(H)
        for w, e in zip(weights, top.indices.tolist()):
            h = flat[n] @ gate_up[e]
            y = y + w * ((F.silu(h[:im]) * h[im:]) @ down[e])
        out.append(y)
    shared = swiglu(
        flat,
        p[pre + "shared_expert.gate_proj.weight"],
        p[pre + "shared_expert.up_proj.weight"],
        p[pre + "shared_expert.down_proj.weight"],
    )
    return (torch.stack(out) + shared).view(B, T, H)


def reference_forward(
    p: dict, cfg: dict, ids: Tensor, doc_ids: Tensor | None = None, record: dict | None = None
) -> Tensor:
    """ids [B, T] -> soft-capped FP32 logits [B, T, V]. cfg: the text_config dict (lists written
    out). record, if given, receives each full-indexer layer's selection and index scores by
    layer."""
    B, T = ids.shape
    R, r = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    positions, visible = positions_and_mask(doc_ids, B, T)
    inv_freq = yarn_inv_freq(R, cfg["rope_parameters"]) * torch.exp(p["rotary.alpha"])
    angles = positions.float()[..., None] * inv_freq  # [B, T, R/2]
    x = p["embed_tokens.weight"][ids]
    produced, selected = {}, None
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        rope = cfg["no_rope_layers"][i] == 1
        n1 = rms_norm(x, p[pre + "input_layernorm.weight"], cfg["rms_norm_eps"])
        if cfg["kv_source_layers"][i] == i:
            kv = n1 @ p[pre + "self_attn.kv_a_proj_with_mqa.weight"].T
            latent = rms_norm(
                kv[..., :r], p[pre + "self_attn.kv_a_layernorm.weight"], cfg["rms_norm_eps"]
            )
            k_rope = (
                rope_pairs(kv[..., r:], angles, yarn_magnitude(cfg["rope_parameters"]))
                if rope
                else None
            )
            produced[i] = (latent, k_rope)
        latent, k_rope = produced[cfg["kv_source_layers"][i]]
        if cfg["indexer_types"][i] == "full":
            indexer_rope = cfg.get("indexer_no_rope_layers", cfg["no_rope_layers"])[i] == 1
            selected, index = indexer_selection(
                p,
                pre + "self_attn.indexer.",
                n1,
                angles if indexer_rope else None,
                positions,
                visible,
                cfg,
            )
            if record is not None:
                record[i] = (selected, index)
        attend = selected & visible
        x = x + mla(
            p,
            pre + "self_attn.",
            n1,
            latent,
            k_rope,
            angles if rope else None,
            positions,
            attend,
            cfg,
        )
        n2 = rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        if cfg["mlp_layer_types"][i] == "dense":
            x = x + swiglu(
                n2,
                p[pre + "mlp.gate_proj.weight"],
                p[pre + "mlp.up_proj.weight"],
                p[pre + "mlp.down_proj.weight"],
            )
        else:
            x = x + moe(p, pre + "mlp.", n2, cfg)
    logits = rms_norm(x, p["norm.weight"], cfg["rms_norm_eps"]) @ p["lm_head.weight"].float().T
    cap = cfg["final_logit_softcapping"]
    return cap * torch.tanh(logits / cap) if cap else logits


def reference_loss(
    p: dict, cfg: dict, ids: Tensor, targets: Tensor, doc_ids: Tensor | None = None
) -> Tensor:
    logits = reference_forward(p, cfg, ids, doc_ids)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
    )
