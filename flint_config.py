"""Flint's configuration: every field of the published config.json (defaults: the released model), the
layer schedule, presets, reading and writing config.json. Validation errors name the field. The network
is in model.py, which re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attention import BACKENDS, FULL, LAYER_TYPES, SLIDING
from capacity import check_capacity_factor
from files import read_config_json
from moe import EXPERT_BACKENDS, check_bias_update_rate
from router_loss import COEFFICIENTS, check_coefficients

def check_positive_ints(config: Any, names: tuple[str, ...]) -> None:
    """Each named field of `config` is an int > 0 (a bool is not), or a ValueError names it."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_choices(config: Any, choices: dict[str, tuple]) -> None:
    """Each named field of `config` holds one of the values this implementation supports."""
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed} in this implementation, got {getattr(config, name)!r}")


def from_preset(cls: type, presets: dict[str, dict], name: str, what: str, overrides: dict) -> Any:
    """cls built from preset `name` of `presets` with `overrides` on top; `what` names the kind in errors."""
    if name not in presets:
        raise ValueError(f"unknown {what} preset {name!r}; choose one of {sorted(presets)}")
    return cls(**{**presets[name], **overrides})


def default_layer_types(num_layers: int) -> list[str]:
    """Full attention at 0, 1, every i with i % 4 == 1, and the last layer; sliding elsewhere."""
    return [FULL if i < 2 or i % 4 == 1 or i == num_layers - 1 else SLIDING for i in range(num_layers)]


GROUPED_GEMM_MULTIPLE = 8  # BF16 values per 16 bytes

# Hugging Face keys that carry no meaning for this implementation (quantization_config concerns the
# files: convert.py refuses a dtype it cannot read, naming the key).
IGNORED_HF_KEYS = {"architectures", "dtype", "torch_dtype", "transformers_version", "auto_map",
                   "use_cache", "model_type", "keys_to_ignore_at_inference", "_name_or_path",
                   "rope_scaling", "rope_theta", "quantization_config"}
# Fields of ours that are runtime choices, not part of the published config.
RUNTIME_FIELDS = ("attention_backend", "experts_backend", "loss_chunk_size", "capacity_factor")
NATIVE_FIELDS = ("router_bias_update_rate", *COEFFICIENTS)  # not in the published format: written only when on


@dataclass
class FlintConfig:
    """Every field of the published Flint config (defaults: the released model) plus runtime knobs."""

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
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
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
    # moves by this much per step towards balance (aux-loss-free balancing, see routing.py).
    router_bias_update_rate: float = 0.0
    # Not in the published format either, written only when on: the router losses beyond the
    # published balance term (router_loss.py), 0 = off. The papers use 0.0001 (DeepSeek-V3's
    # sequence-wise balance loss) and 0.001 (ST-MoE's router z-loss).
    router_sequence_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Runtime choices (not written to config.json).
    attention_backend: str = "auto"  # auto | flex | sdpa
    experts_backend: str = "grouped"  # grouped | loop
    loss_chunk_size: int = 4096  # tokens whose FP32 logits exist at once in the loss
    capacity_factor: float | None = None  # None: dropless; c: <= ceil(c * N * k / E) rows per expert (capacity.py)

    def __post_init__(self) -> None:
        self.check_types()
        schedule = self.schedule_num_hidden_layers or self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = default_layer_types(schedule)
        if len(self.layer_types) not in (self.num_hidden_layers, schedule):
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected "
                             f"num_hidden_layers={self.num_hidden_layers} or schedule_num_hidden_layers={schedule}")
        # A prefix of a deeper model keeps the source schedule of its first layers.
        self.layer_types = list(self.layer_types[: self.num_hidden_layers])
        self.validate()

    def check_types(self) -> None:
        """The fields whose wrong type would otherwise fail later, far from the field's name."""
        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def ints(value) -> bool:
            return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)

        def count(value) -> bool:
            return ints([value]) and value > 0

        rope = self.rope_parameters
        checks = [  # the layer counts first: the layer schedule is derived from them
            ("num_hidden_layers", count(self.num_hidden_layers), "a positive integer"),
            ("schedule_num_hidden_layers", self.schedule_num_hidden_layers is None or count(
                self.schedule_num_hidden_layers), "a positive integer or null"),
            ("rope_parameters", isinstance(rope, dict),
             "an object such as {'rope_type': 'default', 'rope_theta': 1e4}"),
            ("rope_parameters.rope_theta (or rope_theta)",
             isinstance(rope, dict) and number(rope.get("rope_theta")) and rope["rope_theta"] > 0, "a number > 0"),
            ("layer_types", self.layer_types is None or (isinstance(self.layer_types, list) and all(
                isinstance(t, str) for t in self.layer_types)), "a list of layer type names"),
            ("mlp_only_layers", ints(self.mlp_only_layers), "a list of layer indices"),
            ("no_rope_layer_indices", self.no_rope_layer_indices is None or ints(self.no_rope_layer_indices),
             "a list of layer indices or null"),
            ("rms_norm_eps", number(self.rms_norm_eps) and self.rms_norm_eps > 0, "a number > 0"),
            ("initializer_range", number(self.initializer_range) and self.initializer_range > 0, "a number > 0"),
            ("router_aux_loss_coef", number(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0, ">= 0"),
            ("eos_token_id", self.eos_token_id is None or ints([self.eos_token_id]) or (
                ints(self.eos_token_id) and self.eos_token_id), "a token id, a list of token ids or null"),
        ] + [(name, getattr(self, name) is None or ints([getattr(self, name)]), "a token id or null")
             for name in ("bos_token_id", "pad_token_id")] + [
            (name, isinstance(getattr(self, name), bool), "true or false")
            for name in ("use_sliding_window", "norm_topk_prob", "output_router_logits")]
        for name, ok, expected in checks:
            if not ok:
                value = rope.get("rope_theta") if name.startswith("rope_parameters.") else getattr(self, name)
                raise ValueError(f"{name.split(' ')[0]} must be {expected}, got {value!r}")

    def validate(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size",
                                   "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
                                   "max_position_embeddings", "decoder_sparse_step", "loss_chunk_size"))
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs of channels), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
        if self.experts_backend == "grouped":  # CUDA's grouped GEMM needs rows on 16-byte boundaries
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % GROUPED_GEMM_MULTIPLE:
                    raise ValueError(f"{name} must be a multiple of {GROUPED_GEMM_MULTIPLE} for experts_backend "
                                     f"'grouped' (grouped GEMM rows start on 16-byte boundaries, 8 BF16 values), "
                                     f"got {getattr(self, name)}; or use experts_backend 'loop'")
        bad_types = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad_types:
            raise ValueError(f"layer_types may only hold {LAYER_TYPES}, got {bad_types[0]!r}")
        full = [i for i, t in enumerate(self.layer_types) if t == FULL]
        if self.no_rope_layer_indices is not None:
            given = sorted(i for i in self.no_rope_layer_indices if i < self.num_hidden_layers)
            if given != full:
                raise ValueError(f"no_rope_layer_indices must equal the full-attention layers {full}, got {given}")
        choices = {"hidden_act": ("silu",), "router_score_function": ("sigmoid",),
                   "softmax_type": ("learnable",), "tie_word_embeddings": (False,),
                   "attention_bias": (False,), "attention_compute_dtype": (None,),
                   "residual_dtype": (None, "float32", "bfloat16"),
                   "attention_backend": BACKENDS, "experts_backend": EXPERT_BACKENDS}
        check_choices(self, choices)
        check_bias_update_rate(self.router_bias_update_rate)
        check_capacity_factor(self.capacity_factor)
        check_coefficients(self)
        if self.attention_dropout != 0.0:
            raise ValueError(f"attention_dropout must be 0.0 (Flint trains without it), got {self.attention_dropout!r}")
        if self.rope_parameters.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.rope_type must be 'default', got {self.rope_parameters['rope_type']!r}")

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
    def from_name(cls, name: str, **overrides: Any) -> "FlintConfig":
        return from_preset(cls, PRESETS, name, "model", overrides)

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides: Any) -> "FlintConfig":
        """From a config.json dict or path (file or checkpoint directory); errors name the field."""
        source, where = read_config_json(source)
        if not isinstance(source.get("rope_parameters") or {}, dict):
            raise ValueError(f"{where}: rope_parameters must be an object such as {{\"rope_type\": \"default\", "
                             f"\"rope_theta\": 10000.0}}, got {source['rope_parameters']!r}")
        if source.get("model_type", "flint") != "flint":
            raise ValueError(f"{where}: model_type must be 'flint', got {source['model_type']!r}")
        known = {f.name for f in dataclasses.fields(cls)} - set(RUNTIME_FIELDS)
        unknown = sorted(set(source) - known - IGNORED_HF_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} for a Flint config")
        kwargs = {k: v for k, v in source.items() if k in known}
        rope = dict(kwargs.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
        if "rope_theta" in source:  # older configs give it at the top level
            rope["rope_theta"] = source["rope_theta"]
        kwargs["rope_parameters"] = rope
        try:
            return cls(**{**kwargs, **overrides})
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error

    def training_error(self, seq_len: int, fresh_weights: bool) -> str | None:
        """Why training cannot start with this architecture, or None (see large4.py; Flint has no such limit)."""
        return None

    def layout_error(self, pp: int, cp: int) -> tuple[str, str] | None:
        """(the [parallel] key, why) when this config cannot train with pp stages and cp ranks, or None:
        Flint has no such limit (the router losses serve every layout, router_loss.py)."""
        return None

    def to_hf_config(self) -> dict:
        config = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}
        for name in NATIVE_FIELDS:
            if not config[name]:
                del config[name]
        config["no_rope_layer_indices"] = [i for i, t in enumerate(self.layer_types) if t == FULL]
        return {"architectures": ["FlintForCausalLM"], "model_type": "flint", **config}


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=9,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
             num_experts_per_tok=2, router_aux_loss_coef=0.0, max_position_embeddings=4096)
PRESETS: dict[str, dict] = {
    "flint": {},
    "tiny": _TINY,
    # The CPU benchmark shape (bench.py): released schedule, small widths.
    "bench-cpu": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=65,
                      moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=32,
                      num_experts_per_tok=4, router_aux_loss_coef=0.0),
    # Released widths, head counts and experts, shallow enough for one GPU.
    "flint-shallow": dict(num_hidden_layers=6, schedule_num_hidden_layers=49, router_aux_loss_coef=0.0),
}
