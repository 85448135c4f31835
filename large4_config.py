"""Mistral Large 4's published format: its configuration and its checkpoint layout (the network is
in large4.py).

The configuration: every field of the published text_config, the per-layer schedules derived from it
(NoPE layers, KV sources, indexer types, dense/MoE), presets, and reading and writing the composite
config.json. Validation errors name the field.

The checkpoint layout, for convert.py: the key table, extras and FP8.

Published checkpoints (what transformers' save_pretrained writes and the release ships) use
Mistral's native names at the root, experts one per file entry, and a composite config.json
(`text_config`, `vision_config`); LARGE4.md (repository root) names the native keys. Every published
tensor is a `Part` of one native tensor of `large4.MistralLarge4`, so the same `Part` machinery as
Flint's drives both directions, the key accounting and the shape checks:

    native (flint)                                   published (Mistral)
    embed_tokens / lm_head / norm / rotary.alpha     tok_embeddings / output / norm / lerope.alpha
    layers.i.input_layernorm, post_attention_layernorm   layers.i.attention_norm, ffn_norm
    self_attn.{q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}
                                                     attention.{wq, wkv_a_with_mqa, kv_a_norm,
                                                     wkv_b, wo}
    self_attn[.indexer].softmax_scaling.{scale,bias} attention[.indexer].ssmax_scaling.{s,b}
    self_attn.indexer.*                              attention.indexer.* (same leaf names)
    mlp.{gate,up,down}_proj (dense layers)           feed_forward.{w1,w3,w2}
    mlp.router                                       gate
    mlp.shared_expert.{gate,up,down}_proj            shared_experts.{w1,w3,w2}
    mlp.experts.gate_up_proj [E, H, 2*Im]            experts.{e}.w1 = native[e][:, :Im].T,
                                                     experts.{e}.w3 = native[e][:, Im:].T
    mlp.experts.down_proj [E, Im, H]                 experts.{e}.w2 = native[e].T

KV consumers have no kv_a_* and "shared" indexer layers no indexer.*, in both layouts (the native
model lacks those modules, so the table does too). transformers' fused experts
(`layers.i.mlp.experts.gate_up_proj` [E, 2*Im, H], `down_proj` [E, H, Im]) are accepted on input.

The vision tower, its projector and the `mtp_dspark` draft head are not part of the text model: they
are EXTRA keys, which convert.py copies tensor by tensor on every conversion and never drops
silently. The release stores matrices as FP8 E4M3 with per-block scales (`X.qscale_weight`, or
transformers' `X.weight_scale_inv`); `dequantize` turns them into BF16 or FP32 on load. Export
writes BF16/FP32 only."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from attention import BACKENDS
from balance import NATIVE_FIELDS, check_coefficients
from capacity import check_capacity_factor
from files import read_config_json
from hf_io import Layout, Part, Source
from moe import EXPERT_BACKENDS, check_bias_update_rate, check_grouped_gemm_widths
from registry import check_choices, check_positive_ints, from_preset

LAYER_TYPE = "indexed_attention"  # the only layer type; it selects transformers' cache class
MLP_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")  # shared: no indexer of its own, the previous layer's selection
# Keys of config.json that carry no meaning here (text_config or the composite around it);
# quantization_config concerns the files, and the checkpoint layout below reads it from config.json
# itself.
IGNORED_HF_KEYS = {
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "model_type",
    "_name_or_path",
    "keys_to_ignore_at_inference",
    "output_router_logits",
    "pretraining_tp",
    "num_key_value_heads",
    "rope_interleave",
    "qk_head_dim",
    "head_dim",
    "layer_types",
    "quantization_config",
}
RUNTIME_FIELDS = (
    "attention_backend",
    "experts_backend",
    "loss_chunk_size",
    "indexer_chunk_size",
    "capacity_factor",
    "composite",
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 2048.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.0,
    "truncate": True,
}


@dataclass
class Large4Config:
    """Every field of the published text config (defaults: the released model) plus runtime knobs.

    Per-layer lists left as None are derived in __post_init__ from their scalar schedule fields; a
    list given in config.json wins over them."""

    family: ClassVar[str] = "large4"  # its registry.FAMILIES name

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
    # the indexer's own flags; default: no_rope_layers
    indexer_no_rope_layers: list[int] | None = None
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
    # moves by this much per step towards balance (aux-loss-free balancing, see balance.py).
    router_bias_update_rate: float = 0.0
    # Not in the published format either, written only when on: DeepSeek-V3's sequence-wise balance
    # loss and ST-MoE's router z-loss (balance.py), 0 = off; the papers use 0.0001 and 0.001.
    router_sequence_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Runtime choices (not written to text_config).
    # auto (flex on GPUs, sdpa on the CPU) | flex | sdpa (dense scores)
    attention_backend: str = "auto"
    experts_backend: str = "grouped"  # grouped | loop
    loss_chunk_size: int = 4096  # tokens whose FP32 logits exist at once in the loss
    indexer_chunk_size: int = 1024  # queries whose FP32 index scores exist at once
    # None: dropless; c: <= ceil(c * N * k / E) rows per expert (capacity.py)
    capacity_factor: float | None = None
    # config.json around text_config (vision), carried through
    composite: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The per-layer schedules below are derived from these: check them first, naming the field.
        check_positive_ints(
            self, ("num_hidden_layers", "no_rope_layer_interval", "index_topk_freq")
        )
        for name in ("first_k_dense_replace", "index_skip_topk_offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        n = self.num_hidden_layers
        if self.no_rope_layers is None:
            self.no_rope_layers = [
                int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)
            ]
        if self.indexer_no_rope_layers is None:
            self.indexer_no_rope_layers = list(self.no_rope_layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)
            ]
        if self.kv_source_layers is None:
            self.kv_source_layers = list(range(n))
        if self.indexer_types is None:
            if self.index_topk_pattern is not None:
                self.indexer_types = [
                    {"F": "full", "S": "shared"}.get(c, c) for c in self.index_topk_pattern
                ]
            else:
                offset, freq = self.index_skip_topk_offset, self.index_topk_freq
                self.indexer_types = [
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
                ]
        self.validate()

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "moe_intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "n_routed_experts",
                "num_experts_per_tok",
                "n_shared_experts",
                "index_topk",
                "index_n_heads",
                "index_head_dim",
                "index_topk_freq",
                "no_rope_layer_interval",
                "max_position_embeddings",
                "loss_chunk_size",
                "indexer_chunk_size",
            ),
        )
        choices = {
            "q_lora_rank": (None,),
            "hidden_act": ("silu",),
            "attention_bias": (False,),
            "tie_word_embeddings": (False,),
            "n_group": (1,),
            "topk_group": (1,),
            "norm_topk_prob": (True,),
            "attention_backend": BACKENDS,
            "experts_backend": EXPERT_BACKENDS,
        }
        check_choices(self, choices)
        check_bias_update_rate(self.router_bias_update_rate)
        check_capacity_factor(self.capacity_factor)
        check_grouped_gemm_widths(self)
        check_coefficients(self)
        if self.attention_dropout != 0.0:
            raise ValueError(f"attention_dropout must be 0.0, got {self.attention_dropout!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                "n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(
                f"final_logit_softcapping must be > 0 or null, got {self.final_logit_softcapping!r}"
            )
        if self.rope_parameters.get("rope_type") not in ("yarn", "default"):
            raise ValueError(
                f"rope_parameters.rope_type must be 'yarn' or 'default', got "
                f"{self.rope_parameters.get('rope_type')!r}"
            )
        self._validate_lists()
        self._validate_sharing()
        if any(self.indexer_no_rope_layers) and self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer rotates its first "
                "qk_rope_head_dim channels"
            )

    def _validate_lists(self) -> None:
        n = self.num_hidden_layers
        for name, allowed in (
            ("no_rope_layers", (0, 1)),
            ("indexer_no_rope_layers", (0, 1)),
            ("mlp_layer_types", MLP_TYPES),
            ("indexer_types", INDEXER_TYPES),
            ("kv_source_layers", range(n)),
        ):
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != n:
                raise ValueError(
                    f"{name} must be a list of num_hidden_layers = {n} entries, got {values!r}"
                )
            bad = [i for i, v in enumerate(values) if isinstance(v, bool) or v not in allowed]
            if bad:
                raise ValueError(
                    f"{name}[{bad[0]}] = {values[bad[0]]!r} is not one of {list(allowed)}"
                )
        if self.indexer_types[0] != "full":
            raise ValueError(
                "indexer_types[0] must be 'full': layer 0 has no previous layer whose "
                "selection "
                "it could share"
            )

    def _validate_sharing(self) -> None:
        """A consumer reads an earlier producer of its own RoPE kind, and (as the published
        implementation, which reads the latest producer of a kind, requires) the latest one."""
        sources = self.kv_source_layers
        for i, source in enumerate(sources):
            if source == i:
                continue
            where = f"kv_source_layers[{i}] = {source}"
            if source > i:
                raise ValueError(
                    f"{where}: a layer may only read the KV latent of an earlier layer"
                )
            if sources[source] != source:
                raise ValueError(
                    f"{where}: layer {source} does not own its KV (it reads layer "
                    f"{sources[source]}), "
                    f"so it cannot be a source"
                )
            if self.no_rope_layers[source] != self.no_rope_layers[i]:
                kind = {1: "RoPE", 0: "NoPE"}
                raise ValueError(
                    f"{where}: layer {i} is {kind[self.no_rope_layers[i]]} but layer "
                    f"{source} is "
                    f"{kind[self.no_rope_layers[source]]}; a source must be of the "
                    "same kind "
                    f"(no_rope_layers)"
                )
            later = [
                j
                for j in range(source + 1, i)
                if self.kv_mode(j) == "store" and self.no_rope_layers[j] == self.no_rope_layers[i]
            ]
            if later:
                raise ValueError(
                    f"{where}: layer {later[-1]} is a later producer of the same RoPE "
                    "kind; the "
                    "published implementation reads the latest producer of a kind, so "
                    "the source "
                    f"must be layer {later[-1]}"
                )

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
        return "store" if i in self.kv_source_layers[i + 1 :] else None

    def layout_error(self, pp: int, cp: int) -> tuple[str, str] | None:
        """(the [parallel] key, why) when this config cannot train with pp and cp: None, it trains
        with any."""
        return None

    def training_error(self, seq_len: int, fresh_weights: bool) -> str | None:
        """Why training cannot start, or None. The indexer is frozen (its objective is unpublished):
        a random one would pick arbitrary keys whenever a query sees more than index_topk of
        them."""
        if fresh_weights and seq_len > self.index_topk:
            return (
                f"seq_len {seq_len} > index_topk {self.index_topk} with fresh weights: the "
                "frozen indexer is "
                "random and would select arbitrary keys; start from trained weights, or use "
                "seq_len <= "
                f"index_topk (attention is then dense causal), or raise index_topk"
            )
        return None

    # ------------------------------------------------------------------ presets and HF configs
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Large4Config:
        return from_preset(cls, PRESETS, name, "Large 4", overrides)

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides: Any) -> Large4Config:
        """From the composite config.json (its text_config) or a bare text config: a dict, a file or
        a checkpoint directory. Errors name the field."""
        source, where = read_config_json(source)
        if not isinstance(source.get("text_config", {}), dict):
            raise ValueError(
                f"{where}: text_config must be an object of the text model's fields, "
                "got "
                f"{type(source['text_config']).__name__} {source['text_config']!r:.40}"
            )
        composite = (
            {k: v for k, v in source.items() if k != "text_config" and k not in IGNORED_HF_KEYS}
            if "text_config" in source
            else {}
        )
        text = dict(source.get("text_config", source))
        if text.get("model_type", "mistral_large4_text") not in (
            "mistral_large4_text",
            "mistral_large4",
        ):
            raise ValueError(
                f"{where}: text_config.model_type must be 'mistral_large4_text', got "
                f"{text['model_type']!r}"
            )
        # transformers' aliases of n_routed_experts
        for alias in ("num_local_experts", "num_experts"):
            if alias in text:
                text.setdefault("n_routed_experts", text.pop(alias))
        if "rope_parameters" not in text and "rope_scaling" in text:  # the older form
            text["rope_parameters"] = {
                **text.pop("rope_scaling"),
                "rope_theta": text.pop("rope_theta", 10000.0),
            }
        known = {f.name for f in dataclasses.fields(cls)} - set(RUNTIME_FIELDS)
        unknown = sorted(set(text) - known - IGNORED_HF_KEYS - {"rope_theta"})
        if unknown:
            raise ValueError(
                f"{where}: unknown field text_config.{unknown[0]} for a Mistral Large 4 config"
            )
        try:
            config = cls(
                **{k: v for k, v in text.items() if k in known}, composite=composite, **overrides
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from error
        for name, value in (
            ("qk_head_dim", config.qk_head_dim),
            ("head_dim", config.qk_rope_head_dim),
            ("layer_types", config.layer_types),
        ):
            if name in text and text[name] != value:
                raise ValueError(
                    f"{where}: text_config.{name} = {text[name]!r} contradicts the "
                    "other fields, "
                    f"which give {value!r}"
                )
        return config

    def to_hf_config(self) -> dict:
        """The composite config.json: text_config with every per-layer list written out."""
        text = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}
        if self.indexer_no_rope_layers == self.no_rope_layers:
            del text["indexer_no_rope_layers"]  # flint's own field, only when it differs
        for name in NATIVE_FIELDS:
            if not text[name]:
                del text[name]
        text.update(
            model_type="mistral_large4_text",
            qk_head_dim=self.qk_head_dim,
            head_dim=self.qk_rope_head_dim,
            layer_types=self.layer_types,
        )
        return {
            "architectures": ["MistralLarge4ForConditionalGeneration"],
            **self.composite,
            "model_type": "mistral_large4",
            "text_config": text,
        }


_SCHEDULES = dict(
    kv_source_layers=[0, 1, 2, 3, 4, 4, 6, 3],
    indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"],
)
PRESETS: dict[str, dict] = {
    "large4": {},
    # LARGE4.md section 2: the smoke config (5 reads 4: RoPE; 7 reads 3: NoPE, as in the release).
    "large4-tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_topk=4,
        index_n_heads=2,
        index_head_dim=16,
        max_position_embeddings=4096,
        **_SCHEDULES,
    ),
    # The CPU benchmark shape (tools/bench.py), Flint's bench-cpu widths on the tiny schedules. The
    # frozen indexer starts random, so index_topk covers bench's 512 tokens: every causal key is
    # kept.
    "large4-bench": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=32,
        num_experts_per_tok=4,
        index_topk=512,
        index_n_heads=4,
        index_head_dim=32,
        max_position_embeddings=4096,
        **_SCHEDULES,
    ),
    # The parity config: every width distinct; two RoPE producers (1 and 4) of one slot.
    "large4-parity": dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=4,
        v_head_dim=20,
        n_routed_experts=8,
        num_experts_per_tok=3,
        index_topk=8,
        index_n_heads=3,
        index_head_dim=16,
        max_position_embeddings=4096,
        **{**_SCHEDULES, "kv_source_layers": [0, 1, 1, 3, 4, 4, 6, 3]},
    ),
}


# ================================================================== the published checkpoint layout

# The parts of a published checkpoint outside the text model, under both spellings: Mistral's names
# (the release, and what transformers writes for a tower it loaded under them) and transformers' own
# (what its save_pretrained writes for a tower it initialised itself), and the draft head.
EXTRA_PREFIXES = (
    "vision_encoder.",
    "patch_merger.",
    "pre_mm_projector_norm.",
    "vision_language_adapter.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "mtp_dspark.",
)
# The smallest vision part transformers accepts, for a config.json whose model has none (one trained
# here from fresh weights): without one, transformers' MistralLarge4ForConditionalGeneration builds
# its default vision tower, 1.65B parameters around a text model of a few million. This one, with
# its projector onto the text model's width, has about 20,000 for large4-tiny; transformers
# initialises its weights (they are not in the export: flint trains the text model only).
PLACEHOLDER_VISION = dict(
    model_type="pixtral",
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=1,
    head_dim=16,
    image_size=16,
    patch_size=16,
)
# Native keys the model keeps in FP32 (a checkpoint may hold them in FP32 or in the bulk dtype).
FP32_SUFFIXES = (
    "rotary.alpha",
    "mlp.router.weight",
    "lm_head.weight",
    "indexer.weights_proj.weight",
    "indexer.k_norm.weight",
    "indexer.k_norm.bias",
)
# Of those, the ones transformers keeps in FP32 in any dtype (`_keep_in_fp32_modules_strict`).
PUBLISHED_FP32_SUFFIXES = ("rotary.alpha", "mlp.router.weight")
SCALE_SUFFIXES = (".qscale_weight", ".weight_scale_inv")  # Mistral's name, transformers' name
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}

ROOT = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "norm.weight",
    "rotary.alpha": "lerope.alpha",
}
# Inside a layer: native prefix -> published prefix, the first match wins (longest first where they
# nest).
LAYER = (
    ("input_layernorm.", "attention_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("self_attn.q_proj.", "attention.wq."),
    ("self_attn.kv_a_proj_with_mqa.", "attention.wkv_a_with_mqa."),
    ("self_attn.kv_a_layernorm.", "attention.kv_a_norm."),
    ("self_attn.kv_b_proj.", "attention.wkv_b."),
    ("self_attn.o_proj.", "attention.wo."),
    ("self_attn.", "attention."),
    ("mlp.router.", "gate."),
    ("mlp.shared_expert.gate_proj.", "shared_experts.w1."),
    ("mlp.shared_expert.up_proj.", "shared_experts.w3."),
    ("mlp.shared_expert.down_proj.", "shared_experts.w2."),
    ("mlp.gate_proj.", "feed_forward.w1."),
    ("mlp.up_proj.", "feed_forward.w3."),
    ("mlp.down_proj.", "feed_forward.w2."),
)
LEAF = {"softmax_scaling.scale": "ssmax_scaling.s", "softmax_scaling.bias": "ssmax_scaling.b"}


def published_name(native_key: str) -> str:
    """The published key of a native tensor that is not an expert stack."""
    if native_key in ROOT:
        return ROOT[native_key]
    match = re.fullmatch(r"(layers\.\d+\.)(.+)", native_key)
    if not match:
        raise ValueError(f"no published name for native key {native_key!r}")
    layer, rest = match.groups()
    for native, published in LAYER:
        if rest.startswith(native):
            rest = published + rest.removeprefix(native)
            break
    for native, published in LEAF.items():
        if rest.endswith(native):
            rest = rest.removesuffix(native) + published
    return layer + rest


def published_parts(native_key: str, shape: torch.Size, fused: bool = False) -> list[Part]:
    """The published tensors that make up one native tensor, in the per-expert or the fused form."""
    if not native_key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [Part(published_name(native_key), (), False)]
    if fused:  # transformers' [E, 2*Im, H] / [E, H, Im]: the native layout transposed
        return [Part(native_key, (), True)]
    layer, experts = native_key.split(".mlp.")[0], range(shape[0])
    if native_key.endswith("down_proj"):  # w2_e [H, Im] -> native[e] [Im, H]
        return [Part(f"{layer}.experts.{e}.w2.weight", (e,), True) for e in experts]
    # w1_e (gate), w3_e (up) [Im, H] -> native[e] [H, 2*Im], gate columns first
    inter = shape[-1] // 2
    halves = (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter)))
    return [
        Part(f"{layer}.experts.{e}.{name}.weight", (e, slice(None), columns), True)
        for e in experts
        for name, columns in halves
    ]


def published_layout(
    meta: dict[str, torch.Tensor], present: set[str] | None = None
) -> dict[str, list[Part]]:
    """Native key -> its published parts. With `present` (a source's keys), in the form that source
    uses."""
    present = present or set()
    return {key: published_parts(key, t.shape, fused=key in present) for key, t in meta.items()}


def published_config(config: Large4Config) -> dict:
    """The config.json an export writes: the composite config, with PLACEHOLDER_VISION where the
    model came with no vision part of its own."""
    hf_config = config.to_hf_config()
    hf_config.setdefault("vision_config", dict(PLACEHOLDER_VISION))
    return hf_config


def is_extra(key: str) -> bool:
    """A published key outside the text model (vision tower, projector, draft head)."""
    return key.startswith(EXTRA_PREFIXES)


# ============================================================================= FP8


def block_size(hf_config: dict, where: str) -> tuple[int, int] | None:
    """quantization_config.weight_block_size of config.json (top level or text_config), None if
    absent."""
    quant = hf_config.get("quantization_config") or hf_config.get("text_config", {}).get(
        "quantization_config"
    )
    if quant is None:
        return None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{where}: quantization_config.weight_block_size must be two positive "
            "integers, "
            f"got {block!r}"
        )
    return block[0], block[1]


def scale_key(weight_key: str, keys: set[str] | dict) -> str | None:
    """The per-block scale stored next to an FP8 weight `X.weight`, if any."""
    stem = weight_key.removesuffix(".weight")
    return next((stem + suffix for suffix in SCALE_SUFFIXES if stem + suffix in keys), None)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight: one scale per (possibly partial) block of the last two
    dims."""
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """w = fp8 * scale, with each scale broadcast over its [block_m, block_n] tile, in FP32, then
    cast."""
    rows, cols = weight.shape[-2:]
    full = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    full = full.repeat_interleave(block[1], dim=-1)[..., :cols]  # [.., rows, cols]
    return (weight.float() * full).to(dtype)


class Dequantized(Source):
    """A published source whose FP8 weights read as `dtype`, their scales consumed (hidden from
    `meta`).

    Every other floating tensor is cast to `dtype` too, except FP32 ones that `keep_fp32(key)`
    names, so the result has one bulk dtype like a BF16/FP32 checkpoint."""

    def __init__(
        self,
        source: Source,
        block: tuple[int, int] | None,
        dtype: torch.dtype,
        keep_fp32=lambda key: False,
    ):
        self.source, self.block, self.dtype, self.name = source, block, dtype, source.name
        self.scales: dict[str, str] = {}  # FP8 weight key -> its scale key
        self.meta = {}
        for key, (shape, stored) in source.meta.items():
            if key.endswith(SCALE_SUFFIXES):
                weight = key.removesuffix(key[key.rindex(".") :]) + ".weight"
                if source.meta.get(weight, (None, None))[1] not in FP8_DTYPES.values():
                    raise ValueError(
                        f"{source.where(key)}: scale {key!r} has no FP8 weight "
                        f"{weight!r} next to it"
                    )
                continue
            if stored in FP8_DTYPES.values():
                self.scales[key] = self._scale_of(key, shape)
            keep = stored == torch.float32 and keep_fp32(key)
            self.meta[key] = (shape, stored if keep else dtype)

    def _scale_of(self, key: str, shape: tuple[int, ...]) -> str:
        where, scale = self.source.where(key), scale_key(key, self.source.meta)
        if scale is None:
            raise ValueError(
                f"{where}: FP8 key {key!r} has no per-block scale "
                f"({key.removesuffix('.weight')}"
                f"{SCALE_SUFFIXES[0]})"
            )
        if self.block is None:
            raise ValueError(
                f"{where}: FP8 key {key!r}, but config.json has no "
                "quantization_config."
                f"weight_block_size"
            )
        expected = scale_grid(shape, self.block)
        if self.source.meta[scale][0] != expected:
            raise ValueError(
                f"{self.source.where(scale)}: scale {scale!r} has shape "
                f"{list(self.source.meta[scale][0])}, expected {list(expected)} for "
                "weight "
                f"{list(shape)} in blocks of {list(self.block)}"
            )
        return scale

    def where(self, key: str) -> str:
        return self.source.where(key)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        tensors = self.source.read(keys + [self.scales[k] for k in keys if k in self.scales])
        return {
            k: dequantize(tensors[k], tensors[self.scales[k]], self.block, self.meta[k][1])
            if k in self.scales
            else tensors[k].to(self.meta[k][1])
            for k in keys
        }


def dequantized(
    source: Source, hf_config: dict, where: str, dtype: torch.dtype, keep_fp32
) -> Source:
    """The release's FP8 source read as `dtype` (see Dequantized), with config.json's block size."""
    return Dequantized(source, block_size(hf_config, where), dtype, keep_fp32)


LAYOUT = Layout(
    lambda config, native, present: published_layout(native, present),
    FP32_SUFFIXES,
    PUBLISHED_FP32_SUFFIXES,
    is_extra,
    FP8_DTYPES,
    dequantized,
    published_config=published_config,
    transformers_prefix="model.language_model.",
    transformers_renames={".shared_expert.": ".shared_experts."},
)
