"""The model families flint trains: the one place outside a model's own files that names it.

Each family is a config class, a model class, its config.json model_type, its published checkpoint
layout (the key table beside the model: flint_hf.py, large4_hf.py), the module kinds of its own that
profiling.py times, and what bench.py compares it with (flint_baselines.py). A model declares the
little that train.py, parallel.py, memory.py and convert.py need, so those files never ask which
model they hold:
    config: num_hidden_layers, num_experts, num_experts_per_tok, is_moe_layer(i), layer_types,
            max_position_embeddings, vocab_size, training_error(seq_len, fresh_weights),
            layout_error(pp, cp), from_name / from_hf_config / to_hf_config
    model:  embed_tokens, layers (ModuleDict of blocks), norm, lm_head, init_weights(seed),
            initial_value(name, param, seed), fp32_modules(block), fp32_root_modules(),
            num_params(active), flops_per_token(seq_len), block_activation_bytes(seq_len),
            checkpointed_block_bytes(seq_len), generate(...)
    optional, for pipeline (and context) parallelism: parallel_dims ("pp" and/or "cp": its forward
            serves a stage holding some of the layers, and a cp rank once parallel.py sets its
            `context`), first_stage_modules (kept by the first stage only; default the embedding),
            stage_io(rows, seq_len, dtype): the tensors a stage receives and returns, as static
            metadata (Large 4, whose stages exchange more than the hidden state)
A new model adds its files and one entry to FAMILIES.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch.nn as nn

import flint_baselines
import flint_hf
import large4_hf
from files import read_config_json
from hf_io import Layout
from large4 import Indexer, Large4Config, MistralLarge4, MLAttention
from model import Attention, Flint, FlintConfig, Sinks

ModelConfig = FlintConfig | Large4Config


@dataclass(frozen=True)
class Family:
    config: type
    model: type[nn.Module]
    model_type: str  # config.json's model_type
    layout: Layout  # the published checkpoint layout (convert.py)
    timed_modules: tuple[tuple[type[nn.Module], str], ...]  # its own module kinds, for profiling.py
    baselines: ModuleType | None = None  # what bench.py compares it with: plain_eager_loss,
    # transformers_reference and transformers_loss, attention_layer_step (flint_baselines.py)


FAMILIES: dict[str, Family] = {
    "flint": Family(FlintConfig, Flint, "flint", flint_hf.LAYOUT,
                    ((Sinks, "attention core"), (Attention, "attention proj/norm/rope")), flint_baselines),
    "large4": Family(Large4Config, MistralLarge4, "mistral_large4", large4_hf.LAYOUT,
                     ((Indexer, "indexer (Large 4)"), (MLAttention, "latent attention (Large 4: projections + core)"))),
}
MODEL_TYPES = {family.model_type: name for name, family in FAMILIES.items()}  # config.json model_type -> family


def family_of(config: ModelConfig) -> Family:
    """The family whose config class `config` is."""
    return next(family for family in FAMILIES.values() if isinstance(config, family.config))


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class that builds from `config`."""
    return family_of(config).model


def family_of_hf_config(source: dict | str | Path) -> str:
    """The family a config.json (dict, file or checkpoint directory) describes, by its model_type."""
    data, where = read_config_json(source)
    model_type = data.get("model_type", "flint")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def config_from_hf(source: dict | str | Path, **overrides) -> ModelConfig:
    """The config of whichever family a config.json describes."""
    return FAMILIES[family_of_hf_config(source)].config.from_hf_config(source, **overrides)
