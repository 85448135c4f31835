"""Mistral Large 4's configuration: every field of the published text_config, the per-layer schedules
derived from it (NoPE layers, KV sources, indexer types, dense/MoE), presets, and reading and writing the
composite config.json. Validation errors name the field. The network is in large4.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attention import BACKENDS
from capacity import check_capacity_factor
from files import read_config_json
from flint_config import NATIVE_FIELDS, check_choices, check_positive_ints, from_preset
from moe import EXPERT_BACKENDS, check_bias_update_rate
from router_loss import check_coefficients

LAYER_TYPE = "indexed_attention"  # the only layer type; it selects transformers' cache class
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")  # shared: no indexer of its own, the previous layer's selection
# Keys of config.json that carry no meaning here (text_config or the composite around it);
# quantization_config concerns the files, and large4_hf.py reads it from config.json itself.
IGNORED_HF_KEYS = {"architectures", "dtype", "torch_dtype", "transformers_version", "use_cache", "model_type",
                   "_name_or_path", "keys_to_ignore_at_inference", "output_router_logits", "pretraining_tp",
                   "num_key_value_heads", "rope_interleave", "qk_head_dim", "head_dim", "layer_types",
                   "quantization_config"}
RUNTIME_FIELDS = ("attention_backend", "experts_backend", "loss_chunk_size", "indexer_chunk_size", "capacity_factor",
                  "composite")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0, "original_max_position_embeddings": 512,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0, "truncate": True}


@dataclass
class Large4Config:
    """Every field of the published text config (defaults: the released model) plus runtime knobs.

    Per-layer lists left as None are derived in __post_init__ from their scalar schedule fields; a
    list given in config.json wins over them."""

    vocab_size: int = 204800
    hidden_size: int = 6144
    intermediate_size: int = 24576  # the dense SwiGLU of the first_k_dense_replace layers
    moe_intermediate_size: int = 6144  # per routed expert, and per shared expert
    num_hidden_layers: int = 72
    num_attention_heads: int = 64
    num_key_value_heads: int = 64  # meaningless for MLA; carried through config.json
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    mlp_layer_types: list[str] | None = None
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | None = None  # "F"/"S" per layer
    indexer_types: list[str] | None = None
    no_rope_layer_interval: int = 4
    no_rope_layers: list[int] | None = None  # 1 = RoPE, 0 = NoPE (smollm3 convention)
    indexer_no_rope_layers: list[int] | None = None  # the indexer's own flags; default: no_rope_layers
    kv_source_layers: list[int] | None = None  # layer whose latent layer i attends to; default: i
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    indexer_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: dict(YARN))
    final_logit_softcapping: float | None = 30.0
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    # Not in the published format: > 0 gives each router a per-expert selection bias that training
    # moves by this much per step towards balance (aux-loss-free balancing, see routing.py).
    router_bias_update_rate: float = 0.0
    # Not in the published format either, written only when on: DeepSeek-V3's sequence-wise balance
    # loss and ST-MoE's router z-loss (router_loss.py), 0 = off; the papers use 0.0001 and 0.001.
    router_sequence_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Runtime choices (not written to text_config).
    attention_backend: str = "auto"  # auto (flex on GPUs, sdpa on the CPU) | flex | sdpa (dense scores)
    experts_backend: str = "grouped"  # grouped | loop
    loss_chunk_size: int = 4096  # tokens whose FP32 logits exist at once in the loss
    indexer_chunk_size: int = 1024  # queries whose FP32 index scores exist at once
    capacity_factor: float | None = None  # None: dropless; c: <= ceil(c * N * k / E) rows per expert (capacity.py)
    composite: dict = field(default_factory=dict)  # config.json around text_config (vision), carried through

    def __post_init__(self) -> None:
        # The per-layer schedules below are derived from these: check them first, naming the field.
        check_positive_ints(self, ("num_hidden_layers", "no_rope_layer_interval", "index_topk_freq"))
        for name in ("first_k_dense_replace", "index_skip_topk_offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        n = self.num_hidden_layers
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if self.indexer_no_rope_layers is None:
            self.indexer_no_rope_layers = list(self.no_rope_layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]
        if self.kv_source_layers is None:
            self.kv_source_layers = list(range(n))
        if self.indexer_types is None:
            if self.index_topk_pattern is not None:
                self.indexer_types = [{"F": "full", "S": "shared"}.get(c, c) for c in self.index_topk_pattern]
            else:
                offset, freq = self.index_skip_topk_offset, self.index_topk_freq
                self.indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        self.validate()

    def validate(self) -> None:
        check_positive_ints(self, (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "index_topk", "index_n_heads",
            "index_head_dim", "index_topk_freq", "no_rope_layer_interval", "max_position_embeddings",
            "loss_chunk_size", "indexer_chunk_size"))
        choices = {"q_lora_rank": (None,), "hidden_act": ("silu",), "attention_bias": (False,),
                   "tie_word_embeddings": (False,), "n_group": (1,), "topk_group": (1,), "norm_topk_prob": (True,),
                   "attention_backend": BACKENDS, "experts_backend": EXPERT_BACKENDS}
        check_choices(self, choices)
        check_bias_update_rate(self.router_bias_update_rate)
        check_capacity_factor(self.capacity_factor)
        check_coefficients(self)
        if self.attention_dropout != 0.0:
            raise ValueError(f"attention_dropout must be 0.0, got {self.attention_dropout!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts "
                             f"({self.n_routed_experts})")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or null, got {self.final_logit_softcapping!r}")
        if self.rope_parameters.get("rope_type") not in ("yarn", "default"):
            raise ValueError(f"rope_parameters.rope_type must be 'yarn' or 'default', got "
                             f"{self.rope_parameters.get('rope_type')!r}")
        self._validate_lists()
        self._validate_sharing()
        if any(self.indexer_no_rope_layers) and self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}): the indexer rotates its first qk_rope_head_dim channels")

    def _validate_lists(self) -> None:
        n = self.num_hidden_layers
        for name, allowed in (("no_rope_layers", (0, 1)), ("indexer_no_rope_layers", (0, 1)),
                              ("mlp_layer_types", MLP_TYPES), ("indexer_types", INDEXER_TYPES),
                              ("kv_source_layers", range(n))):
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(f"{name} must be a list of num_hidden_layers = {n} entries, got {values!r}")
            bad = [i for i, v in enumerate(values) if isinstance(v, bool) or v not in allowed]
            if bad:
                raise ValueError(f"{name}[{bad[0]}] = {values[bad[0]]!r} is not one of {list(allowed)}")
        if self.indexer_types[0] != "full":
            raise ValueError("indexer_types[0] must be 'full': layer 0 has no previous layer whose selection "
                             "it could share")

    def _validate_sharing(self) -> None:
        """A consumer reads an earlier producer of its own RoPE kind, and (as the published
        implementation, which reads the latest producer of a kind, requires) the latest one."""
        sources = self.kv_source_layers
        for i, source in enumerate(sources):
            if source == i:
                continue
            where = f"kv_source_layers[{i}] = {source}"
            if source > i:
                raise ValueError(f"{where}: a layer may only read the KV latent of an earlier layer")
            if sources[source] != source:
                raise ValueError(f"{where}: layer {source} does not own its KV (it reads layer {sources[source]}), "
                                 f"so it cannot be a source")
            if self.no_rope_layers[source] != self.no_rope_layers[i]:
                kind = {1: "RoPE", 0: "NoPE"}
                raise ValueError(f"{where}: layer {i} is {kind[self.no_rope_layers[i]]} but layer {source} is "
                                 f"{kind[self.no_rope_layers[source]]}; a source must be of the same kind "
                                 f"(no_rope_layers)")
            later = [j for j in range(source + 1, i) if self.kv_mode(j) == "store"
                     and self.no_rope_layers[j] == self.no_rope_layers[i]]
            if later:
                raise ValueError(f"{where}: layer {later[-1]} is a later producer of the same RoPE kind; the "
                                 f"published implementation reads the latest producer of a kind, so the source "
                                 f"must be layer {later[-1]}")

    # ------------------------------------------------------------------ derived facts
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_experts(self) -> int:
        """n_routed_experts, under the name train.py and parallel.py use for every model."""
        return self.n_routed_experts

    @property
    def layer_types(self) -> list[str]:
        return [LAYER_TYPE] * self.num_hidden_layers

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    def kv_mode(self, i: int) -> str | None:
        """None: owns its KV; store: owns it and a later layer reads it; reuse (shared indexer) or
        reuse_but_indexer (own indexer): reads another layer's KV."""
        if self.kv_source_layers[i] != i:
            return "reuse" if self.indexer_types[i] == "shared" else "reuse_but_indexer"
        return "store" if i in self.kv_source_layers[i + 1:] else None

    def layout_error(self, pp: int, cp: int) -> tuple[str, str] | None:
        """(the [parallel] key, why) when this config cannot train with pp and cp: None, it trains with any."""
        return None

    def training_error(self, seq_len: int, fresh_weights: bool) -> str | None:
        """Why training cannot start, or None. The indexer is frozen (its objective is unpublished):
        a random one would pick arbitrary keys whenever a query sees more than index_topk of them."""
        if fresh_weights and seq_len > self.index_topk:
            return (f"seq_len {seq_len} > index_topk {self.index_topk} with fresh weights: the frozen indexer is "
                    f"random and would select arbitrary keys; start from trained weights, or use seq_len <= "
                    f"index_topk (attention is then dense causal), or raise index_topk")
        return None

    # ------------------------------------------------------------------ presets and HF configs
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Large4Config":
        return from_preset(cls, PRESETS, name, "Large 4", overrides)

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides: Any) -> "Large4Config":
        """From the composite config.json (its text_config) or a bare text config: a dict, a file or a
        checkpoint directory. Errors name the field."""
        source, where = read_config_json(source)
        if not isinstance(source.get("text_config", {}), dict):
            raise ValueError(f"{where}: text_config must be an object of the text model's fields, got "
                             f"{type(source['text_config']).__name__} {source['text_config']!r:.40}")
        composite = ({k: v for k, v in source.items() if k != "text_config" and k not in IGNORED_HF_KEYS}
                     if "text_config" in source else {})
        text = dict(source.get("text_config", source))
        if text.get("model_type", "mistral_large4_text") not in ("mistral_large4_text", "mistral_large4"):
            raise ValueError(f"{where}: text_config.model_type must be 'mistral_large4_text', got {text['model_type']!r}")
        for alias in ("num_local_experts", "num_experts"):  # transformers' aliases of n_routed_experts
            if alias in text:
                text.setdefault("n_routed_experts", text.pop(alias))
        if "rope_parameters" not in text and "rope_scaling" in text:  # the older form
            text["rope_parameters"] = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta", 10000.0)}
        known = {f.name for f in dataclasses.fields(cls)} - set(RUNTIME_FIELDS)
        unknown = sorted(set(text) - known - IGNORED_HF_KEYS - {"rope_theta"})
        if unknown:
            raise ValueError(f"{where}: unknown field text_config.{unknown[0]} for a Mistral Large 4 config")
        try:
            config = cls(**{k: v for k, v in text.items() if k in known}, composite=composite, **overrides)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error
        for name, value in (("qk_head_dim", config.qk_head_dim), ("head_dim", config.qk_rope_head_dim),
                            ("layer_types", config.layer_types)):
            if name in text and text[name] != value:
                raise ValueError(f"{where}: text_config.{name} = {text[name]!r} contradicts the other fields, "
                                 f"which give {value!r}")
        return config

    def to_hf_config(self) -> dict:
        """The composite config.json: text_config with every per-layer list written out."""
        text = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}
        if self.indexer_no_rope_layers == self.no_rope_layers:
            del text["indexer_no_rope_layers"]  # flint's own field, only when it differs
        for name in NATIVE_FIELDS:
            if not text[name]:
                del text[name]
        text.update(model_type="mistral_large4_text", qk_head_dim=self.qk_head_dim,
                    head_dim=self.qk_rope_head_dim, layer_types=self.layer_types)
        return {"architectures": ["MistralLarge4ForConditionalGeneration"], **self.composite,
                "model_type": "mistral_large4", "text_config": text}


_SCHEDULES = dict(kv_source_layers=[0, 1, 2, 3, 4, 4, 6, 3], indexer_types=["full", "full", "shared", "full",
                                                                          "shared", "full", "shared", "full"])
PRESETS: dict[str, dict] = {
    "large4": {},
    # LARGE4.md section 2: the smoke config (5 reads 4: RoPE; 7 reads 3: NoPE, as in the release).
    "large4-tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, index_topk=4, index_n_heads=2, index_head_dim=16,
                        max_position_embeddings=4096, **_SCHEDULES),
    # The parity config: every width distinct; two RoPE producers (1 and 4) of one slot.
    "large4-parity": dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                          num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24,
                          qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=20, n_routed_experts=8,
                          num_experts_per_tok=3, index_topk=8, index_n_heads=3, index_head_dim=16,
                          max_position_embeddings=4096,
                          **{**_SCHEDULES, "kv_source_layers": [0, 1, 1, 3, 4, 4, 6, 3]}),
}
