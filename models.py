"""The model families flint trains, and how the shared machinery finds a config's model.

Each family is a config class and a model class. A model declares the little that train.py,
parallel.py, memory.py and convert.py need, so those files never ask which model they hold:
    config: num_hidden_layers, num_experts, num_experts_per_tok, is_moe_layer(i), layer_types,
            max_position_embeddings, vocab_size, training_error(seq_len, fresh_weights),
            from_name / from_hf_config / to_hf_config
    model:  embed_tokens, layers (ModuleDict of blocks), norm, lm_head, init_weights(seed),
            initial_value(name, param, seed), fp32_modules(block), fp32_root_modules(),
            num_params(active), flops_per_token(seq_len), block_activation_bytes(), generate(...)
    optional, for pipeline (and context) parallelism: stage_form (the class parallel.py gives the
            model: its forward serves a stage, its parallel_dims lists "pp" and/or "cp"; Flint's is
            model.FlintStage), first_stage_modules (kept by the first stage only; default the
            embedding), and on the form stage_io(rows, seq_len, dtype): the tensors a stage receives
            and returns, as static metadata (Large 4, whose stages exchange indices); under cp > 1
            parallel.py sets the form's `context` (its positions and the sequence gather)
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from large4 import Large4Config, MistralLarge4
from files import read_config_json
from model import Flint, FlintConfig

ModelConfig = FlintConfig | Large4Config
# family name -> (config class, model class)
FAMILIES: dict[str, tuple[type, type[nn.Module]]] = {"flint": (FlintConfig, Flint),
                                                     "large4": (Large4Config, MistralLarge4)}
# config.json model_type -> family name
MODEL_TYPES = {"flint": "flint", "mistral_large4": "large4"}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class that builds from `config`."""
    return next(model for config_class, model in FAMILIES.values() if isinstance(config, config_class))


def family_of_hf_config(source: dict | str | Path) -> str:
    """The family a config.json (dict, file or checkpoint directory) describes, by its model_type."""
    data, where = read_config_json(source)
    model_type = data.get("model_type", "flint")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def config_from_hf(source: dict | str | Path, **overrides) -> ModelConfig:
    """The config of whichever family a config.json describes."""
    return FAMILIES[family_of_hf_config(source)][0].from_hf_config(source, **overrides)
