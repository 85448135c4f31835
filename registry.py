"""The model families flint trains, and the interface through which the rest of the repository uses
them.

FAMILIES is the one place outside a model's own files that names a model: family name -> the module
that declares it. That module holds the model's config, network and published checkpoint layout, and
ends with `FAMILY = Family(...)`. It is imported only when the family is asked for, so that
importing this file (and config.py, parallel.py, data.py, checkpoint.py above it) loads no model.

What parallel.py, train.py, convert.py and the tools read from a model is declared below as two
protocols, `ModelConfig` and `Model`; tests/test_registry.py checks every registered family against
them. A new model adds its files and one line to FAMILIES; a fork drops a model by deleting its
files and its line (README, Fork)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from files import read_config_json

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from balance import RouterLosses
    from hf_io import Layout
    from stage import StageContext

FAMILIES: dict[str, str] = {
    # Flint: flint_model.py. Not a module named `flint`: sympy, which torch imports, tries
    # `import flint` for the python-flint library, and would find ours first.
    "flint": "flint_model",
    "large4": "large4",  # Mistral Large 4: large4.py, large4_config.py
}


# ============================================================================= the interface


@runtime_checkable
class ModelConfig(Protocol):
    """What the shared machinery reads from a model's config (a dataclass of the published
    fields)."""

    family: ClassVar[str]  # its FAMILIES name
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    max_position_embeddings: int
    layer_types: list[str]
    attention_backend: str  # auto | flex | sdpa
    capacity_factor: float | None
    router_bias_update_rate: float

    def is_moe_layer(self, i: int) -> bool: ...

    def training_error(self, seq_len: int, fresh_weights: bool) -> str | None:
        """Why training cannot start with this architecture, or None."""

    def layout_error(self, pp: int, cp: int) -> tuple[str, str] | None:
        """(the [parallel] key, why) when this config cannot train with pp stages and cp ranks, or
        None."""

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig: ...

    @classmethod
    def from_hf_config(cls, source: dict | str | Path, **overrides: Any) -> ModelConfig: ...

    def to_hf_config(self) -> dict: ...


@runtime_checkable
class Model(Protocol):
    """What the shared machinery reads from a model: single-device code that parallel.py lays out.

    Its forward(input_ids, targets=None, doc_ids=None, positions=None) returns FP32 logits, or the
    mean loss with targets. It reads as on one device; what a layout adds goes through its `stage`
    (stage.py's seam, shared by every model): the forward plans each call with
    `self.stage.plan(self, ...)`, and on a later pipeline stage takes the previous stage's outputs
    instead of token ids (stage_io). Layers live in an nn.ModuleDict keyed by index, so a pipeline
    stage deletes the layers it does not own (and the embedding, or the final norm and head, set to
    None; the forward passes over what is missing) and every parameter keeps its name in every
    layout."""

    config: ModelConfig
    embed_tokens: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    lm_head: nn.Module | None  # head.Head
    # the layouts its forward serves beyond data and expert parallelism: "pp", "cp"
    parallel_dims: tuple[str, ...]
    # what only the first pipeline stage keeps (the embedding, ...)
    first_stage_modules: tuple[str, ...]
    # What a layout adds to its forward (stage.py): one device, unless parallelize sets a cp rank's.
    stage: StageContext
    router_losses: RouterLosses  # what its config asks for (balance.py); its stage plans them

    def init_weights(self, seed: int = 0) -> None: ...

    def initial_value(self, name: str, param: torch.Tensor, seed: int) -> torch.Tensor:
        """The whole initial tensor of parameter `name`, from the seed and the name alone."""

    def fp32_modules(self, layer: nn.Module) -> list[nn.Module]:
        """The modules of one block that stay FP32 under a BF16 policy (one FSDP unit per block)."""

    def fp32_root_modules(self) -> list[nn.Module]:
        """FP32 units outside the blocks, besides the head."""

    def stage_io(
        self, batch: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """This pipeline stage's (inputs, outputs) for micro-batches [batch, seq_len], as meta
        tensors."""

    def num_params(self, active: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward), for MFU."""

    def block_activation_bytes(self, seq_len: int) -> float:
        """Activations one block saves for backward per token (tools/memory.py)."""

    def checkpointed_block_bytes(self, seq_len: int) -> float:
        """What a checkpointed block keeps for backward per token (tools/memory.py)."""

    def check_inputs(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> None:
        """Refuse bad forward inputs with a message naming the argument."""

    def decode_step(self, input_ids: torch.Tensor, caches: dict, start: int) -> torch.Tensor:
        """New tokens [B, t] at positions start.. through the KV caches -> the last logits [B,
        V]."""

    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Family:
    """A model family: its config and model classes, its config.json model_type, its published
    checkpoint layout (convert.py), the module kinds of its own that tools/profiling.py times, its
    smallest preset (what trains in seconds: `tools.bench --quick`'s, the tests') and the preset
    tools/bench.py times by default (its smallest when empty)."""

    name: str
    config: type
    model: type
    model_type: str
    layout: Layout
    timed_modules: tuple[tuple[type, str], ...] = ()
    smallest_preset: str = ""
    bench_preset: str = ""


# ============================================================================= looking families up


def family(name: str) -> Family:
    """The registered family `name`, its module imported on first use."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name]).FAMILY


def family_of(config: ModelConfig) -> Family:
    """The family whose config `config` is."""
    return family(config.family)


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class that builds from `config`."""
    return family_of(config).model


def family_of_hf_config(source: dict | str | Path) -> str:
    """The family a config.json (dict, file or checkpoint directory) describes, by its
    model_type."""
    data, where = read_config_json(source)
    model_types = {family(name).model_type: name for name in FAMILIES}
    model_type = data.get("model_type", "flint")
    if not isinstance(model_type, str) or model_type not in model_types:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of {sorted(model_types)}")
    return model_types[model_type]


def config_from_hf(source: dict | str | Path, **overrides) -> ModelConfig:
    """The config of whichever family a config.json describes."""
    return family(family_of_hf_config(source)).config.from_hf_config(source, **overrides)


# ======================================================================== checks both configs share


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
            raise ValueError(
                f"{name} must be one of {allowed} in this implementation, got "
                f"{getattr(config, name)!r}"
            )


def from_preset(cls: type, presets: dict[str, dict], name: str, what: str, overrides: dict) -> Any:
    """cls built from preset `name` of `presets` with `overrides` on top; `what` names the kind in
    errors."""
    if name not in presets:
        raise ValueError(f"unknown {what} preset {name!r}; choose one of {sorted(presets)}")
    return cls(**{**presets[name], **overrides})
