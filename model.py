"""The Flint network: decoder layers, FP32 head, loss and generation.

Flint is a decoder-only mixture-of-experts transformer. Most layers attend inside a sliding window
of 513 tokens with NeoX RoPE; every fourth layer (and the first two and the last) attends to the
whole causal context with no positional encoding at all. Every attention head has a learned sink.
All layers but the first two are MoE: 256 sigmoid-routed experts, top 6, plus one shared expert.
See SPEC.md for the contract this file implements. The one forward serves the whole model, a
pipeline stage and a context-parallel rank alike.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from attention import SLIDING, KVCache, build_masks, resolve_backend, sink_attention
from decoder import (Gather, Head, RMSNorm, build, call_arguments, check_inputs, context_share, count_params,
                     default_positions, generate, init_weights, seeded_normal)
from flint_config import FlintConfig
from moe import MoE, SwiGLU
from router_loss import RouterLosses, Stats, add_layer, real_tokens


# ============================================================================= building blocks

def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE over all head_dim channels: positions [B, T] -> cos, sin [B, 1, T, D] in FP32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, T, D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention: pairs channel i with channel i + D/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class Sinks(nn.Module):
    """The learned sink logits [Hq] in FP32, and the attention core that uses them.

    Attention runs inside this module's forward so that, in its block's FP32 FSDP unit (with the
    router: `fp32_modules`), the sinks are gathered and used in FP32 while the projections around it
    run in the bulk dtype.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))

    def forward(self, q, k, v, mask) -> torch.Tensor:
        return sink_attention(q, k, v, self.weight, mask)


class Attention(nn.Module):
    """GQA with per-head q/k RMSNorm, RoPE on sliding layers only (full layers are NoPE), sinks."""

    def __init__(self, config: FlintConfig, layer_type: str, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.sinks = Sinks(self.num_heads)

    def forward(self, x: torch.Tensor, rope, mask, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, gather: Gather | None = None) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. gather (context parallelism): this rank's keys or values and
        their sequence dim -> the whole sequence's, so T queries attend to all S keys."""
        batch, seq_len, _ = x.shape
        # [B, T, H] -> [B, heads, T, D]
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.layer_type == SLIDING:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if gather is not None:  # [B, Hkv, T, D] -> [B, Hkv, S, D]: small, with few KV heads
            k, v = gather(k, 2), gather(v, 2)
        if cache is not None:
            k, v, mask = cache.update(k, v, positions)
        out = self.sinks(q, k, v, mask)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


def router_losses_of(config: FlintConfig) -> RouterLosses:
    """The router losses Flint's config asks for: the published balance term (with output_router_logits),
    DeepSeek-V3's sequence-wise term and the z-loss (router_loss.py)."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return RouterLosses(config.num_experts, config.num_experts_per_tok, moe_layers,
                        balance=config.router_aux_loss_coef if config.output_router_logits else 0.0,
                        sequence=config.router_sequence_loss_coef, z=config.router_z_loss_coef)


class DecoderLayer(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); y = h + mlp(norm(h)). The MLP is dense or MoE by schedule."""

    def __init__(self, config: FlintConfig, index: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.loss_slot = sum(config.is_moe_layer(i) for i in range(index))  # its place among the MoE layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, self.layer_type, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(index):
            self.mlp = MoE(config.hidden_size, config.moe_intermediate_size,
                           config.shared_expert_intermediate_size, config.num_experts,
                           config.num_experts_per_tok, config.norm_topk_prob, config.experts_backend, dtype,
                           selection_bias=config.router_bias_update_rate > 0, capacity_factor=config.capacity_factor)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype)

    def forward(self, x: torch.Tensor, rope, masks: dict, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, gather: Gather | None = None, stats: Stats | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, Stats]:
        """x [B, T, H] -> [B, T, H]; given the router-loss statistics so far (and real [B, T], false
        at padding), also those statistics with this layer's added."""
        compute_dtype = self.input_layernorm.weight.dtype  # the residual stream may be wider
        attn_in = self.input_layernorm(x).to(compute_dtype)
        mask = None if cache is not None else masks[self.layer_type]
        h = x + self.self_attn(attn_in, rope, mask, cache, positions, gather).to(x.dtype)
        mlp_in = self.post_attention_layernorm(h).to(compute_dtype)
        if stats is None:
            return h + self.mlp(mlp_in).to(x.dtype)
        if not isinstance(self.mlp, MoE):
            return h + self.mlp(mlp_in).to(x.dtype), stats
        y, logits, indices = self.mlp.routed(mlp_in)
        return h + y.to(x.dtype), add_layer(stats, self.loss_slot, logits, indices, real, self.mlp.router.score_function)


# ============================================================================= the model

class Flint(nn.Module):
    """The Flint decoder. One forward serves the whole model, a pipeline stage and a context-parallel
    rank: parallel.py deletes the layers of other stages (and the embedding, or the final norm and
    head), and sets `context`. Parameter names never change. Under context parallelism every rank of
    a cp group is given the whole batch and computes the queries at its share of the positions
    (`context.positions`); attention gathers the keys and values over the group, so it sees every
    key of the sequence, exactly."""

    parallel_dims = ("pp", "cp")  # the layouts its forward serves beyond data and expert parallelism (parallel.py)
    context = None  # cp > 1: context_parallel.ContextParallel (this rank's positions, the sequence gather)

    def __init__(self, config: FlintConfig, dtype: torch.dtype | None = None):
        """Bulk parameters in `dtype`; sinks, routers and the head are always FP32.

        Build on the meta device and call `init_weights()` (see `build_model`).
        """
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Head(config.hidden_size, config.vocab_size, config.loss_chunk_size)

    def init_weights(self, seed: int = 0) -> None:
        """Every parameter from `initial_value` (decoder.init_weights): the same weights in every layout."""
        init_weights(self, seed)

    @property
    def router_losses(self) -> RouterLosses:
        """The router losses its config asks for (router_loss.py), read at each forward as the config is."""
        return router_losses_of(self.config)

    def initial_value(self, name: str, param: torch.Tensor, seed: int) -> torch.Tensor:
        """The whole initial tensor of parameter `name` (param gives shape, dtype and device):
        ones for norms; normal(0, initializer_range) for matrices and sinks, drawn from a generator
        seeded by crc32 of (seed, name). It depends on nothing else, so a sharded, expert- or
        pipeline-split model (parallel.py) starts from the weights of one process on the same
        device type, whatever order or subset of parameters each rank initialises."""
        owner = self.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, RMSNorm):
            return torch.ones(param.shape, dtype=param.dtype, device=param.device)
        if param.dim() < 2 and not isinstance(owner, Sinks):
            raise ValueError(f"{name}: no initialisation rule for a {param.dim()}-D parameter of "
                             f"{type(owner).__name__}")
        return seeded_normal(name, param, seed, self.config.initializer_range)

    # ------------------------------------------------------------------ what parallel.py needs
    def fp32_modules(self, layer: nn.Module) -> list[nn.Module]:
        """The modules of one block that stay FP32 under a BF16 policy (one FSDP unit per block)."""
        return [layer.self_attn.sinks] + ([layer.mlp.router] if isinstance(layer.mlp, MoE) else [])

    def fp32_root_modules(self) -> list[nn.Module]:
        """FP32 units outside the blocks, besides the head (which parallel.py keeps gathered)."""
        return []

    def forward(self, input_ids: torch.Tensor, *rest: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The whole model, or one pipeline stage of it, or one context-parallel rank's share.

        input_ids, rest: where the model holds the embedding (the whole model, a first stage), token
        ids [B, T], optionally followed by targets, doc_ids and positions as in model(ids, targets);
        on a later stage, what the previous stage returned: its hidden states [B, T / cp, H], then
        the router-loss statistics when a router loss is on (router_loss.py), so the others come
        by keyword. -> FP32 logits [B, T, V] (of this rank's positions under cp), the mean loss when
        targets are given (under cp: this rank's share of the mean over all positions), plus the
        router losses when on, or, without a head, what the next stage takes. doc_ids [B, T] marks
        packed documents (< 0: padding); positions default to restarting at each document. Masks
        and RoPE tables are built once here, outside the layers, on every stage, from the doc_ids
        every stage is given.
        """
        first = self.embed_tokens is not None
        if first:
            (x,), targets, doc_ids, positions = call_arguments("Flint", (input_ids, *rest), targets, doc_ids, positions)
            self._check_inputs(x, targets, doc_ids, positions)
        else:
            x = input_ids
        cp = self.context.size if self.context is not None else 1
        batch, seq_len = x.shape[0], x.shape[1] * (1 if first else cp)
        mine = self.context.positions(seq_len, x.device) if cp > 1 else None  # [T / cp]
        rope, masks = self.block_inputs(doc_ids, positions, batch, seq_len, x.device, mine)
        h = self.embed(x if mine is None else x[:, mine]) if first else x  # [B, T / cp, H]
        gather = None if mine is None else self.context.gather
        stats = None  # the router losses' statistics, in training with a router loss on
        if self.router_losses.active and targets is not None:
            stats = self.router_losses.start(batch, x.device) if first else self.router_losses.unpack(rest)
            real = real_tokens(doc_ids, batch, seq_len, x.device)  # [B, T]
            mine_real = real if mine is None else real[:, mine]
        for layer in self.layers.values():
            if stats is None:
                h = layer(h, rope, masks, gather=gather)
            else:
                h, stats = layer(h, rope, masks, gather=gather, stats=stats, real=mine_real)
        if self.lm_head is None:
            return h if stats is None else (h, *self.router_losses.pack(stats))
        h = self.norm(h.float())
        if targets is None:
            return self.lm_head(h)
        loss = self.lm_head(h, targets) if mine is None else context_share(self.lm_head(h, targets[:, mine]),
                                                                            targets, mine, cp)
        if stats is None:
            return loss
        return loss + self.router_losses.loss(stats, real, targets, None if mine is None else self.context.group)

    def block_inputs(self, doc_ids: torch.Tensor | None, positions: torch.Tensor | None, batch: int, seq_len: int,
                     device, queries: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """What every block reads, built once per forward: the RoPE tables and one mask per layer type.
        queries [Tq]: build them for the queries at these positions only (a context-parallel rank's)."""
        positions = default_positions(doc_ids, batch, seq_len, device) if positions is None else positions
        positions = positions if queries is None else positions[:, queries]  # [B, T] -> [B, Tq]
        backend = resolve_backend(self.config.attention_backend, device)
        masks = build_masks(self.config.layer_types, self.config.window, doc_ids, batch, seq_len, device, backend,
                            queries)
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta), masks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h.to(getattr(torch, self.config.residual_dtype)) if self.config.residual_dtype else h

    def _check_inputs(self, input_ids, targets, doc_ids, positions) -> None:
        check_inputs(self.config, input_ids, targets, doc_ids, positions)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 eos_token_id: int | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Extend prompt [B, T] by up to max_new_tokens with a KV cache -> [B, T + n] (see `stream`).
        Sliding layers cache only the last `window - 1` keys."""
        return generate(self, prompt, max_new_tokens, temperature, top_k, generator, eos_token_id, allowed)

    def decode_step(self, input_ids: torch.Tensor, caches: dict[str, KVCache], start: int) -> torch.Tensor:
        """Run new tokens [B, t] at positions start.. through the cached layers -> last logits [B, V].
        caches starts empty and is filled here, one entry per layer."""
        batch, seq_len = input_ids.shape
        positions = torch.arange(start, start + seq_len, device=input_ids.device)
        rope = rope_tables(positions.expand(batch, seq_len), self.config.head_dim, self.config.rope_theta)
        h = self.embed(input_ids)
        for name, layer in self.layers.items():
            cache = caches.setdefault(name, KVCache(self.config.window if layer.layer_type == SLIDING else None))
            h = layer(h, rope, {}, cache, positions)
        return self.lm_head(self.norm(h[:, -1:].float()))[:, -1]

    # ------------------------------------------------------------------ accounting
    def num_params(self, active: bool = False) -> int:
        """All parameters, or those one token uses (top-k of the routed experts, not all E)."""
        return count_params(self, active)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), checkable by hand.

        Matmuls: 6 FLOPs per active weight per token (2 forward, 4 backward), counting every
        active matrix except the embedding lookup. Attention: QK^T and PV each take
        2 * Hq * D FLOPs per attended key in forward, so 12 * Hq * D per key for training, times
        the mean number of keys a query attends: (T + 1) / 2 on full layers, and on sliding layers
        the mean of min(i + 1, window) over positions i.
        """
        c = self.config
        matmul_params = self.num_params(active=True) - c.vocab_size * c.hidden_size - self._norm_and_sink_params()
        flops = 6.0 * matmul_params
        for layer_type in c.layer_types:
            window = c.window if layer_type == SLIDING and c.window else seq_len
            mean_keys = sum(min(i + 1, window) for i in range(seq_len)) / seq_len
            flops += 12.0 * c.num_attention_heads * c.head_dim * mean_keys
        return flops

    def stage_io(self, batch: int, seq_len: int, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], ...]:
        """This stage's (inputs, outputs) for micro-batches [batch, seq_len], as meta tensors: static
        metadata for parallel.py's PipelineStage (no shape inference, no metadata exchanged between
        ranks at the first step). Token ids into the first stage, the FP32 loss out of the last; between
        stages the hidden states [B, T / cp, H] in the residual stream's dtype, then the router-loss
        statistics when a router loss is on."""
        local = seq_len // (self.context.size if self.context is not None else 1)
        residual = getattr(torch, self.config.residual_dtype) if self.config.residual_dtype else dtype
        between = (torch.empty(batch, local, self.config.hidden_size, dtype=residual, device="meta",
                               requires_grad=True), *self.router_losses.boundary(batch))
        inputs = ((torch.empty(batch, seq_len, dtype=torch.long, device="meta"),) if self.embed_tokens is not None
                  else between)
        outputs = (torch.empty((), device="meta", requires_grad=True),) if self.lm_head is not None else between
        return inputs, outputs

    def checkpointed_block_bytes(self, seq_len: int) -> float:
        """What a checkpointed block keeps for backward per token: its BF16 input (memory.py)."""
        return 2 * self.config.hidden_size

    def block_activation_bytes(self, seq_len: int) -> float:
        """Activations one block saves for backward per token, in BF16 (FP32 router scores and
        lse); flash attention keeps no score matrix, so seq_len does not enter (memory.py)."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        attention = 2 * (4 * c.hidden_size + 2 * q + 2 * kv) + 4 * c.num_attention_heads
        k = c.num_experts_per_tok
        # per routed choice (moe.grouped_swiglu): its dispatched row, gate_up, silu, their product, weighted
        moe = (2 * (k * c.hidden_size + 5 * k * c.moe_intermediate_size + 3 * c.shared_expert_intermediate_size)
               + 4 * c.num_experts)
        return attention + moe

    def _norm_and_sink_params(self) -> int:
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, (RMSNorm, Sinks)))


def build_model(config: FlintConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, model_class: type[nn.Module] = Flint) -> nn.Module:
    """decoder.build for Flint (or, through model_class, any model with the same constructor)."""
    return build(model_class, config, device, dtype, seed)
