"""Flint: its configuration, its network and its published checkpoint layout, in reading order.

Flint is a decoder-only mixture-of-experts transformer. Most layers attend inside a sliding window
of 513 tokens with NeoX RoPE; every fourth layer (and the first two and the last) attends to the
whole causal context with no positional encoding at all. Every attention head has a learned sink.
All layers but the first two are MoE: 256 sigmoid-routed experts, top 6, plus one shared expert.
SPEC.md is the contract this file implements.

- FlintConfig: every field of the published config.json (defaults: the released model), the layer
  schedule, presets, reading and writing config.json; validation errors name the field.
- The network: attention with sinks, the decoder layer, the model. The one forward reads as on one
  device and serves the whole model, a pipeline stage and a context-parallel rank alike (stage.py).
- The published checkpoint layout (SPEC.md), for convert.py: the key table and its FP32 keys.
- FAMILY: what registry.py, parallel.py, train.py and convert.py read of this model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn

from attention import (
    BACKENDS,
    FULL,
    LAYER_TYPES,
    SLIDING,
    KVCache,
    build_masks,
    resolve_backend,
    sink_attention,
)
from balance import NATIVE_FIELDS, RouterLosses, Stats, add_layer, check_coefficients
from capacity import check_capacity_factor
from files import read_config_json
from generate import generate
from head import Head
from hf_io import Layout, Part
from layers import (
    Gather,
    RMSNorm,
    build,
    check_inputs,
    count_params,
    default_positions,
    init_weights,
    seeded_normal,
)
from moe import EXPERT_BACKENDS, MoE, SwiGLU, check_bias_update_rate, check_grouped_gemm_widths
from registry import Family, check_choices, check_positive_ints, from_preset
from stage import ONE_DEVICE, StageContext

# ============================================================================= the config


def default_layer_types(num_layers: int) -> list[str]:
    """Full attention at 0, 1, every i with i % 4 == 1, and the last layer; sliding elsewhere."""
    return [
        FULL if i < 2 or i % 4 == 1 or i == num_layers - 1 else SLIDING for i in range(num_layers)
    ]


# Hugging Face keys that carry no meaning for this implementation (quantization_config concerns the
# files: convert.py refuses a dtype it cannot read, naming the key).
IGNORED_HF_KEYS = {
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "auto_map",
    "use_cache",
    "model_type",
    "keys_to_ignore_at_inference",
    "_name_or_path",
    "rope_scaling",
    "rope_theta",
    "quantization_config",
}
# Fields of ours that are runtime choices, not part of the published config.
RUNTIME_FIELDS = ("attention_backend", "experts_backend", "loss_chunk_size", "capacity_factor")


@dataclass
class FlintConfig:
    """Every field of the published Flint config (defaults: the released model) plus runtime
    knobs."""

    family: ClassVar[str] = "flint"  # its registry.FAMILIES name

    vocab_size: int = 150144
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 49
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    sliding_window: int | None = 513
    use_sliding_window: bool = True
    layer_types: list[str] | None = None
    no_rope_layer_indices: list[int] | None = None
    schedule_num_hidden_layers: int | None = None
    mlp_only_layers: list[int] = field(default_factory=lambda: [0, 1])
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 1024
    num_experts: int = 256
    num_experts_per_tok: int = 6
    norm_topk_prob: bool = True
    router_score_function: str = "sigmoid"
    router_aux_loss_coef: float = 0.0005
    softmax_type: str = "learnable"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    residual_dtype: str | None = None
    attention_compute_dtype: str | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    output_router_logits: bool = False
    # Not in the published format: > 0 gives each router a per-expert selection bias that training
    # moves by this much per step towards balance (aux-loss-free balancing, see balance.py).
    router_bias_update_rate: float = 0.0
    # Not in the published format either, written only when on: the router losses beyond the
    # published balance term (balance.py), 0 = off. The papers use 0.0001 (DeepSeek-V3's
    # sequence-wise balance loss) and 0.001 (ST-MoE's router z-loss).
    router_sequence_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Runtime choices (not written to config.json).
    attention_backend: str = "auto"  # auto | flex | sdpa
    experts_backend: str = "grouped"  # grouped | loop
    loss_chunk_size: int = 4096  # tokens whose FP32 logits exist at once in the loss
    # None: dropless; c: <= ceil(c * N * k / E) rows per expert (capacity.py)
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        self.check_types()
        schedule = self.schedule_num_hidden_layers or self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = default_layer_types(schedule)
        if len(self.layer_types) not in (self.num_hidden_layers, schedule):
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers={self.num_hidden_layers} or "
                f"schedule_num_hidden_layers={schedule}"
            )
        # A prefix of a deeper model keeps the source schedule of its first layers.
        self.layer_types = list(self.layer_types[: self.num_hidden_layers])
        self.validate()

    def check_types(self) -> None:
        """The fields whose wrong type would otherwise fail later, far from the field's name."""

        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def ints(value) -> bool:
            return isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )

        def count(value) -> bool:
            return ints([value]) and value > 0

        rope = self.rope_parameters
        checks = (
            [  # the layer counts first: the layer schedule is derived from them
                ("num_hidden_layers", count(self.num_hidden_layers), "a positive integer"),
                (
                    "schedule_num_hidden_layers",
                    self.schedule_num_hidden_layers is None
                    or count(self.schedule_num_hidden_layers),
                    "a positive integer or null",
                ),
                (
                    "rope_parameters",
                    isinstance(rope, dict),
                    "an object such as {'rope_type': 'default', 'rope_theta': 1e4}",
                ),
                (
                    "rope_parameters.rope_theta (or rope_theta)",
                    isinstance(rope, dict)
                    and number(rope.get("rope_theta"))
                    and rope["rope_theta"] > 0,
                    "a number > 0",
                ),
                (
                    "layer_types",
                    self.layer_types is None
                    or (
                        isinstance(self.layer_types, list)
                        and all(isinstance(t, str) for t in self.layer_types)
                    ),
                    "a list of layer type names",
                ),
                ("mlp_only_layers", ints(self.mlp_only_layers), "a list of layer indices"),
                (
                    "no_rope_layer_indices",
                    self.no_rope_layer_indices is None or ints(self.no_rope_layer_indices),
                    "a list of layer indices or null",
                ),
                (
                    "rms_norm_eps",
                    number(self.rms_norm_eps) and self.rms_norm_eps > 0,
                    "a number > 0",
                ),
                (
                    "initializer_range",
                    number(self.initializer_range) and self.initializer_range > 0,
                    "a number > 0",
                ),
                (
                    "router_aux_loss_coef",
                    number(self.router_aux_loss_coef) and 0 <= self.router_aux_loss_coef < math.inf,
                    "a finite number >= 0",
                ),
                (
                    "eos_token_id",
                    self.eos_token_id is None
                    or ints([self.eos_token_id])
                    or (ints(self.eos_token_id) and self.eos_token_id),
                    "a token id, a list of token ids or null",
                ),
            ]
            + [
                (
                    name,
                    getattr(self, name) is None or ints([getattr(self, name)]),
                    "a token id or null",
                )
                for name in ("bos_token_id", "pad_token_id")
            ]
            + [
                (name, isinstance(getattr(self, name), bool), "true or false")
                for name in ("use_sliding_window", "norm_topk_prob", "output_router_logits")
            ]
        )
        for name, ok, expected in checks:
            if not ok:
                value = (
                    rope.get("rope_theta")
                    if name.startswith("rope_parameters.")
                    else getattr(self, name)
                )
                raise ValueError(f"{name.split(' ')[0]} must be {expected}, got {value!r}")

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "num_experts",
                "num_experts_per_tok",
                "max_position_embeddings",
                "decoder_sparse_step",
                "loss_chunk_size",
            ),
        )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or null, got {self.sliding_window!r}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim must be even (RoPE rotates pairs of channels), got {self.head_dim}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible "
                "by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"num_experts ({self.num_experts})"
            )
        check_grouped_gemm_widths(self)
        bad_types = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad_types:
            raise ValueError(f"layer_types may only hold {LAYER_TYPES}, got {bad_types[0]!r}")
        full = [i for i, t in enumerate(self.layer_types) if t == FULL]
        if self.no_rope_layer_indices is not None:
            given = sorted(i for i in self.no_rope_layer_indices if i < self.num_hidden_layers)
            if given != full:
                raise ValueError(
                    "no_rope_layer_indices must equal the full-attention layers "
                    f"{full}, got {given}"
                )
        choices = {
            "hidden_act": ("silu",),
            "router_score_function": ("sigmoid",),
            "softmax_type": ("learnable",),
            "tie_word_embeddings": (False,),
            "attention_bias": (False,),
            "attention_compute_dtype": (None,),
            "residual_dtype": (None, "float32", "bfloat16"),
            "attention_backend": BACKENDS,
            "experts_backend": EXPERT_BACKENDS,
        }
        check_choices(self, choices)
        check_bias_update_rate(self.router_bias_update_rate)
        check_capacity_factor(self.capacity_factor)
        check_coefficients(self)
        if self.attention_dropout != 0.0:
            raise ValueError(
                "attention_dropout must be 0.0 (Flint trains without it), got "
                f"{self.attention_dropout!r}"
            )
        if self.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(
                "rope_parameters.rope_type must be 'default', got "
                f"{self.rope_parameters['rope_type']!r}"
            )

    # ------------------------------------------------------------------ derived facts
    @property
    def window(self) -> int | None:
        """The attention window of sliding layers (None: they see the whole causal context)."""
        return self.sliding_window if self.use_sliding_window else None

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    # ------------------------------------------------------------------ presets and HF configs
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> FlintConfig:
        return from_preset(cls, PRESETS, name, "model", overrides)

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides: Any) -> FlintConfig:
        """From a config.json dict or path (file or checkpoint directory); errors name the field."""
        source, where = read_config_json(source)
        if not isinstance(source.get("rope_parameters") or {}, dict):
            raise ValueError(
                f'{where}: rope_parameters must be an object such as {{"rope_type": '
                '"default", '
                f'"rope_theta": 10000.0}}, got {source["rope_parameters"]!r}'
            )
        if source.get("model_type", "flint") != "flint":
            raise ValueError(f"{where}: model_type must be 'flint', got {source['model_type']!r}")
        known = {f.name for f in dataclasses.fields(cls)} - set(RUNTIME_FIELDS)
        unknown = sorted(set(source) - known - IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} for a Flint config")
        kwargs = {k: v for k, v in source.items() if k in known}
        rope = dict(
            kwargs.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
        )
        if "rope_theta" in source:  # older configs give it at the top level
            rope["rope_theta"] = source["rope_theta"]
        kwargs["rope_parameters"] = rope
        try:
            return cls(**{**kwargs, **overrides})
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error

    def training_error(self, seq_len: int, fresh_weights: bool) -> str | None:
        """Why training cannot start with this architecture, or None (see large4.py; Flint has no
        such limit)."""
        return None

    def layout_error(self, pp: int, cp: int) -> tuple[str, str] | None:
        """(the [parallel] key, why) when this config cannot train with pp stages and cp ranks, or
        None: Flint has no such limit (the router losses serve every layout, balance.py)."""
        return None

    def to_hf_config(self) -> dict:
        config = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}
        for name in NATIVE_FIELDS:
            if not config[name]:
                del config[name]
        config["no_rope_layer_indices"] = [i for i, t in enumerate(self.layer_types) if t == FULL]
        return {"architectures": ["FlintForCausalLM"], "model_type": "flint", **config}


_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=9,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,
    max_position_embeddings=4096,
)
PRESETS: dict[str, dict] = {
    "flint": {},
    "tiny": _TINY,
    # The CPU benchmark shape (tools/bench.py): released schedule, small widths.
    "bench-cpu": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=65,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        router_aux_loss_coef=0.0,
    ),
    # Released widths, head counts and experts, shallow enough for one GPU.
    "flint-shallow": dict(
        num_hidden_layers=6, schedule_num_hidden_layers=49, router_aux_loss_coef=0.0
    ),
}


# ============================================================================= building blocks


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE over all head_dim channels: positions [B, T] -> cos, sin [B, 1, T, D] in FP32."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    )
    angles = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, T, D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention: pairs channel i with channel i + D/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def rms_norm_bytes(width: int, rows: int) -> int:
    """What an RMSNorm over `width` channels of one token (in `rows` normalised rows) saves for
    backward, BF16 bulk: its FP32 input and normalised FP32 input, each row's FP32 rsqrt, and its
    BF16 output (saved by what reads it) (layers.RMSNorm)."""
    return 4 * width + 4 * width + 4 * rows + 2 * width


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
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.sinks = Sinks(self.num_heads)

    def forward(
        self,
        x: torch.Tensor,
        rope,
        mask,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        gather: Gather | None = None,
    ) -> torch.Tensor:
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
    """The router losses Flint's config asks for: the published balance term (with
    output_router_logits), DeepSeek-V3's sequence-wise term and the z-loss (balance.py)."""
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return RouterLosses(
        config.num_experts,
        config.num_experts_per_tok,
        moe_layers,
        balance=config.router_aux_loss_coef if config.output_router_logits else 0.0,
        sequence=config.router_sequence_loss_coef,
        z=config.router_z_loss_coef,
    )


class DecoderLayer(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); y = h + mlp(norm(h)). The MLP is dense or MoE by
    schedule."""

    def __init__(self, config: FlintConfig, index: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_type = config.layer_types[index]
        # its place among the MoE layers
        self.loss_slot = sum(config.is_moe_layer(i) for i in range(index))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, self.layer_type, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(index):
            self.mlp = MoE(
                config.hidden_size,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.experts_backend,
                dtype,
                selection_bias=config.router_bias_update_rate > 0,
                capacity_factor=config.capacity_factor,
            )
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope,
        masks: dict,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        gather: Gather | None = None,
        stats: Stats | None = None,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Stats]:
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
        return h + y.to(x.dtype), add_layer(
            stats, self.loss_slot, logits, indices, real, self.mlp.router.score_function
        )


# ============================================================================= the model


class Flint(nn.Module):
    """The Flint decoder. One forward serves the whole model, a pipeline stage and a
    context-parallel rank: pipeline.py deletes the layers of other stages (and the embedding, or the
    final norm and head), and parallel.py sets `stage` (stage.py). Parameter names never change.
    Under context parallelism every rank of a cp group is given the whole batch and computes the
    queries at its share of the positions; attention gathers the keys and values over the group, so
    it sees every key of the sequence, exactly."""

    # the layouts its forward serves beyond data and expert parallelism (parallel.py)
    parallel_dims = ("pp", "cp")
    # what only the first pipeline stage keeps (pipeline.py)
    first_stage_modules = ("embed_tokens",)
    stage: StageContext = ONE_DEVICE  # the seam to the layouts (stage.py); parallel.py sets it

    def __init__(self, config: FlintConfig, dtype: torch.dtype | None = None):
        """Bulk parameters in `dtype`; sinks, routers and the head are always FP32.

        Build on the meta device and call `init_weights()` (see `build_model`).
        """
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)}
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Head(config.hidden_size, config.vocab_size, config.loss_chunk_size)

    def init_weights(self, seed: int = 0) -> None:
        """Every parameter from `initial_value` (layers.init_weights): the same weights in every
        layout."""
        init_weights(self, seed)

    @property
    def router_losses(self) -> RouterLosses:
        """The router losses its config asks for (balance.py), read at each forward as the config
        is."""
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
            raise ValueError(
                f"{name}: no initialisation rule for a {param.dim()}-D parameter of "
                f"{type(owner).__name__}"
            )
        return seeded_normal(name, param, seed, self.config.initializer_range)

    # ------------------------------------------------------------------ what parallel.py needs
    def fp32_modules(self, layer: nn.Module) -> list[nn.Module]:
        """The modules of one block that stay FP32 under a BF16 policy (one FSDP unit per block)."""
        return [layer.self_attn.sinks] + ([layer.mlp.router] if isinstance(layer.mlp, MoE) else [])

    def fp32_root_modules(self) -> list[nn.Module]:
        """FP32 units outside the blocks, besides the head (which parallel.py keeps gathered)."""
        return []

    def forward(
        self,
        input_ids: torch.Tensor,
        *rest: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids [B, T] -> FP32 logits [B, T, V], or with targets [B, T] (shifted, -100
        ignored) the mean loss, plus the router losses when on; targets, doc_ids and positions may
        also follow input_ids positionally. doc_ids [B, T] marks packed documents (< 0: padding);
        positions default to restarting at each document. The masks and RoPE tables are built
        once here, outside the layers.

        A layout enters through `self.stage` (stage.py): on a pipeline stage without the
        embedding, the arguments are what the stage before sent, and without the head the result
        is what the next stage takes; a context-parallel rank computes its share of the positions
        (`plan.local`), its loss its share of the mean."""
        plan = self.stage.plan(self, (input_ids, *rest), targets, doc_ids, positions)
        rope, masks = self.block_inputs(
            plan.doc_ids, plan.positions, plan.batch, plan.seq_len, plan.device, plan.mine
        )
        if self.embed_tokens is not None:
            h = self.embed(plan.local(plan.input_ids))
        else:
            h = plan.received[0]  # the hidden states [B, T / cp, H] the stage before sent
        for layer in self.layers.values():  # [B, T / cp, H] under context parallelism
            h = plan.block(layer, h, rope, masks)
        if self.lm_head is None:
            return plan.send(h)
        h = self.norm(h.float())
        if plan.targets is None:
            return self.lm_head(h)
        return plan.loss(self.lm_head(h, plan.local(plan.targets)))

    def block_inputs(
        self,
        doc_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        batch: int,
        seq_len: int,
        device,
        queries: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """What every block reads, built once per forward: the RoPE tables and one mask per layer
        type. queries [Tq]: build them for the queries at these positions only (a context-parallel
        rank's)."""
        positions = (
            default_positions(doc_ids, batch, seq_len, device) if positions is None else positions
        )
        positions = positions if queries is None else positions[:, queries]  # [B, T] -> [B, Tq]
        backend = resolve_backend(self.config.attention_backend, device)
        masks = build_masks(
            self.config.layer_types,
            self.config.window,
            doc_ids,
            batch,
            seq_len,
            device,
            backend,
            queries,
        )
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta), masks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h.to(getattr(torch, self.config.residual_dtype)) if self.config.residual_dtype else h

    def check_inputs(self, input_ids, targets, doc_ids, positions) -> None:
        check_inputs(self.config, input_ids, targets, doc_ids, positions)

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
        """Extend prompt [B, T] by up to max_new_tokens with a KV cache -> [B, T + n] (see
        `stream`). Sliding layers cache only the last `window - 1` keys."""
        return generate(
            self, prompt, max_new_tokens, temperature, top_k, generator, eos_token_id, allowed
        )

    def decode_step(
        self, input_ids: torch.Tensor, caches: dict[str, KVCache], start: int
    ) -> torch.Tensor:
        """Run new tokens [B, t] at positions start.. through the cached layers -> last logits [B,
        V]. caches starts empty and is filled here, one entry per layer."""
        batch, seq_len = input_ids.shape
        positions = torch.arange(start, start + seq_len, device=input_ids.device)
        rope = rope_tables(
            positions.expand(batch, seq_len), self.config.head_dim, self.config.rope_theta
        )
        h = self.embed(input_ids)
        for name, layer in self.layers.items():
            cache = caches.setdefault(
                name, KVCache(self.config.window if layer.layer_type == SLIDING else None)
            )
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
        matmul_params = (
            self.num_params(active=True)
            - c.vocab_size * c.hidden_size
            - self._norm_and_sink_params()
        )
        flops = 6.0 * matmul_params
        for layer_type in c.layer_types:
            window = c.window if layer_type == SLIDING and c.window else seq_len
            mean_keys = sum(min(i + 1, window) for i in range(seq_len)) / seq_len
            flops += 12.0 * c.num_attention_heads * c.head_dim * mean_keys
        return flops

    def stage_io(
        self, batch: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """This stage's (inputs, outputs) for micro-batches [batch, seq_len], as meta tensors:
        static metadata for parallel.py's PipelineStage (no shape inference, no metadata exchanged
        between ranks at the first step). Token ids into the first stage, the FP32 loss out of the
        last; between stages the hidden states [B, T / cp, H] in the residual stream's dtype, then
        the router-loss statistics when a router loss is on."""
        local = seq_len // self.stage.cp
        residual = (
            getattr(torch, self.config.residual_dtype) if self.config.residual_dtype else dtype
        )
        between = (
            torch.empty(
                batch,
                local,
                self.config.hidden_size,
                dtype=residual,
                device="meta",
                requires_grad=True,
            ),
            *self.router_losses.boundary(batch),
        )
        inputs = (
            (torch.empty(batch, seq_len, dtype=torch.long, device="meta"),)
            if self.embed_tokens is not None
            else between
        )
        outputs = (
            (torch.empty((), device="meta", requires_grad=True),)
            if self.lm_head is not None
            else between
        )
        return inputs, outputs

    def checkpointed_block_bytes(self, seq_len: int) -> float:
        """What a checkpointed block keeps for backward per token: its BF16 input
        (tools/memory.py)."""
        return 2 * self.config.hidden_size

    def block_widths(self) -> tuple[int, int, int, int, int]:
        """A block's widths that its saved activations scale with: the query and key/value
        projections', the routed choices per token, an expert's and the shared expert's."""
        c = self.config
        return (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        )

    def block_activation_bytes(self, seq_len: int) -> float:
        """Activations one MoE block saves for backward per token, eager, BF16 bulk (FP32 norms,
        router and softmax statistics), term by term as autograd saves them (measured on the CPU:
        tests/test_memory.py); flash attention keeps no score matrix, so seq_len does not enter
        (tools/memory.py)."""
        c = self.config
        q, kv, k, width, shared = self.block_widths()
        attention = (
            rms_norm_bytes(c.hidden_size, 1)  # input_layernorm, its output the q/k/v input
            + rms_norm_bytes(q, c.num_attention_heads)  # q_norm: its output is attention's q
            + rms_norm_bytes(kv, c.num_key_value_heads)  # k_norm
            + 2 * kv  # v
            + 2 * q
            + 4 * c.num_attention_heads  # attention's output and FP32 log-sum-exp
            + 2 * q  # o_proj's input (the heads made contiguous)
        )
        # the router's FP32 input, scores, weights and their sum; int64 choices, row map, inverse
        router = 4 * c.hidden_size + 4 * c.num_experts + 4 * k + 4 + 3 * 8 * k
        routed = 2 * k * c.hidden_size + 2 * k  # the dispatched rows and their routing weights
        routed += 2 * 5 * k * width  # gate_up, silu(gate), silu(gate) * up, times the weight
        moe = (
            rms_norm_bytes(c.hidden_size, 1)  # post_attention_layernorm
            + router
            + routed
            + 2 * 4 * shared  # the shared expert's gate, up, silu(gate), silu(gate) * up
        )
        return attention + moe

    def op_block_activation_bytes(self, seq_len: int, ep: int = 1) -> float:
        """What an op-level checkpointed MoE block keeps per token (parallel.kept_by_op_level): its
        BF16 input and the outputs of its matmuls (q, k, v, o; the router's FP32 logits; the shared
        expert's gate, up, down; the grouped gate_up and down), attention's output and log-sum-exp,
        and under expert parallelism (ep > 1) the rows, weights and outputs its all-to-alls
        received (as many as it sent, under balanced routing)."""
        c = self.config
        q, kv, k, width, shared = self.block_widths()
        matmuls = 2 * (q + 2 * kv + c.hidden_size) + 4 * c.num_experts
        matmuls += 2 * (2 * shared + c.hidden_size) + 2 * (2 * k * width + k * c.hidden_size)
        attention = 2 * q + 4 * c.num_attention_heads
        exchanged = 2 * (2 * k * c.hidden_size + k) if ep > 1 else 0
        return 2 * c.hidden_size + matmuls + attention + exchanged

    def _norm_and_sink_params(self) -> int:
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, (RMSNorm, Sinks)))


def build_model(
    config: FlintConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    model_class: type[nn.Module] = Flint,
) -> nn.Module:
    """layers.build for Flint (or, through model_class, any model with the same constructor)."""
    return build(model_class, config, device, dtype, seed)


# ================================================================== the published checkpoint layout
# Published names are the native ones under `model.` (the head at the root), with three differences:
# sinks are `self_attn.softmax_offset` (or transformers' `sinks`), routers `mlp.gate`, and the
# routed experts are stored one per key (`mlp.experts.{e}.{gate,up,down}_proj.weight`, [Im, H] / [H,
# Im]) or fused as transformers writes them (`mlp.experts.gate_up_proj` [E, 2*Im, H], `down_proj`
# [E, H, Im]). Every published tensor is a `Part` of one native tensor of `Flint`.

# Native keys the model keeps in FP32 (a checkpoint may hold them in FP32 or in the bulk dtype).
FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight", "lm_head.weight")
# Of those, the ones the published layout keeps in FP32 even when exporting to a lower dtype.
PUBLISHED_FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight")


def published_parts(
    native_key: str, config: FlintConfig, fused: bool = False, sinks_name: str = "softmax_offset"
) -> list[Part]:
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
        return [
            Part(f"{experts}.{e}.down_proj.weight", (e,), True) for e in range(config.num_experts)
        ]
    # gate_e, up_e [Im, H] -> native[e] [H, 2*Im], gate columns first
    halves = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
    return [
        Part(f"{experts}.{e}.{name}.weight", (e, slice(None), columns), True)
        for e in range(config.num_experts)
        for name, columns in halves
    ]


def published_layout(
    config: FlintConfig, native: dict[str, torch.Tensor], present: set[str]
) -> dict[str, list[Part]]:
    """Native key (of `native`, the model's meta state dict) -> its published parts, in the form a
    source with the keys `present` uses (fused experts, `sinks` or `softmax_offset`)."""
    layout = {}
    for native_key in native:
        # the fused experts keep the native name (ignored for others)
        fused = "model." + native_key in present
        sinks = (
            "sinks"
            if "model." + native_key.removesuffix(".weight") in present
            else "softmax_offset"
        )
        layout[native_key] = published_parts(native_key, config, fused, sinks)
    return layout


def missing_fields(config: FlintConfig, given: dict) -> list[str]:
    """The published fields a config.json leaves out (their defaults are used)."""
    given = {*given, *(["rope_parameters"] if "rope_theta" in given else [])}
    return [key for key in config.to_hf_config() if key not in given and hasattr(config, key)]


LAYOUT = Layout(
    published_layout, FP32_SUFFIXES, PUBLISHED_FP32_SUFFIXES, missing_fields=missing_fields
)


FAMILY = Family(
    "flint",
    FlintConfig,
    Flint,
    model_type="flint",
    layout=LAYOUT,
    timed_modules=((Sinks, "attention core"), (Attention, "attention proj/norm/rope")),
    smallest_preset="tiny",
    bench_preset="bench-cpu",
)
