"""Training configuration: a TOML file, dotted command-line overrides, and every check before any
work.

    [model]       family = "flint" | "large4", then preset = "tiny" | hf_config = "path" |
                  init_from = "checkpoint dir", plus fields of that family's config (FlintConfig,
                  Large4Config)
    [data]        what to read and how to tokenize and pack it
    [training]    steps, batch, device, evaluation, the sample at the end
    [optim]       AdamW and the learning-rate schedule
    [checkpoint]  where, how often, how many to keep, resume, Hugging Face export
    [logging]     how often, the JSONL file, the peak FLOP/s used for MFU
    [parallel]    the layout across processes, compute dtype, checkpointing and compile:
                  parallel.ParallelConfig
    [lora]        optional: train low-rank adapters on the frozen init_from model instead of every
                  weight (lora.py)

An override `--training.steps=200` replaces one key; its value is read as TOML
(`--parallel.compile=true`, `--optim.lr=1e-3`), and as a plain string when it is not valid TOML
(`--data.path=notes/`). Every error names the key and where it was set: the file, or the command
line."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint_files import CheckpointError, resolve_checkpoint
from fp8 import fp8_refusal
from generate import MIN_TEMPERATURE, usable_temperature
from lora import RUN_FILE, LoraConfig, check_training
from parallel import LayoutError, ParallelConfig, unsupported_layout
from registry import FAMILIES, ModelConfig, family, family_of_hf_config, model_class

MODEL_SOURCES = ("preset", "hf_config", "init_from")
# What [model] may change about an init_from checkpoint: training choices, not the architecture.
INIT_FROM_SETTINGS = (
    "router_aux_loss_coef",
    "output_router_logits",
    "router_sequence_loss_coef",
    "router_z_loss_coef",
    "attention_backend",
    "capacity_factor",
)


class ConfigError(ValueError):
    """A configuration mistake, found before any work starts."""


@dataclass
class ModelSection:
    # flint | large4: whose presets and fields; hf_config / init_from tell it themselves. The
    # default is the first registered family (Flint; in a fork that keeps one model, that model).
    family: str = next(iter(FAMILIES))
    # a preset of the family's config (FlintConfig.from_name, Large4Config.from_name)
    preset: str = ""
    # a Hugging Face config.json (or its directory): that architecture, fresh weights
    hf_config: str = ""
    # a checkpoint (Hugging Face or native), or a run's checkpoint dir (its newest intact step)
    init_from: str = ""
    # every other key of [model]: a field of the family's config
    overrides: dict = field(default_factory=dict)


@dataclass
class DataSection:
    path: str = "data/python_reference.jsonl"  # file, directory, JSONL, or a prepared directory
    tokenizer: str = "byte"  # byte | checkpoint | tokenizer.json dir | .tiktoken file | cached name
    eos_token: str = "<|endoftext|>"  # appended to every document
    text_key: str = "text"  # the JSONL field holding a document
    cache_dir: str = "data/cache"  # prepared shards of raw text go here
    seq_len: int = 256  # tokens per row
    val_fraction: float = 0.05  # of the documents, held out for validation
    epochs: int = 1  # passes over the training documents that a run may take
    # a conversation longer than seq_len: truncate (keep its first seq_len tokens) | drop
    overlong: str = "truncate"
    sources: list = field(default_factory=list)  # a mixture: [{path = "web/", weight = 0.7}, ...]
    exhausted: str = "stop"  # a mixture's source read data.epochs times: stop | repeat (new epoch)


@dataclass
class TrainingSection:
    steps: int = 100  # optimizer steps
    batch_size: int = 8  # rows per micro-batch on each data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # weights, data order and sampling
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 0  # steps between validation losses; 0: only after the last step
    eval_batches: int = 4  # validation micro-batches per evaluation
    sample_tokens: int = 200  # tokens generated after training; 0: none
    sample_prompt: str = "The "  # the text the end-of-run sample continues
    sample_temperature: float = 0.8  # 0: greedy
    # true: every expert gets the same tokens (benchmarks, rehearsals; moe.py)
    force_balanced_routing: bool = False


@dataclass
class OptimSection:
    # adamw | muon (Muon for the block matrices and experts, AdamW for the rest; muon.py)
    name: str = "adamw"
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # where the decay ends
    schedule: str = "cosine"  # cosine | wsd (warmup, stable, linear decay) | constant
    warmup_steps: int = 0  # linear warmup from 0 to lr
    decay_fraction: float = 0.2  # wsd: the share of steps spent decaying
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    eps: float = 1e-8  # AdamW
    grad_clip: float = 1.0  # max global gradient norm; 0: no clipping
    # muon: the block matrices' peak learning rate (the schedule scales it as lr)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # muon: the momentum of the orthogonalised update (Nesterov)
    # AdamW's moments: float32 | bfloat16 (stochastically rounded, 4 bytes per parameter less;
    state_dtype: str = "float32"
    # lean_adamw.py)


@dataclass
class CheckpointSection:
    dir: str = "runs/default/checkpoints"  # where step_<N> checkpoints are written
    every: int = 0  # steps between checkpoints; 0: only after the last step
    keep_last: int = 2  # older checkpoints are removed
    # auto (latest in dir, if any) | never (a fresh run; nothing removed) | a checkpoint
    resume: str = "auto"
    export_hf: str = ""  # write the final model here in Hugging Face format
    export_dtype: str = ""  # "" keeps the training dtype | bfloat16 | float32
    # true: training goes on while a checkpoint is written (a copy in host memory)
    async_save: bool = False


@dataclass
class LoggingSection:
    every: int = 10  # steps between log lines
    jsonl: str = "runs/default/metrics.jsonl"  # one JSON record per logged step
    peak_tflops: float = 0.0  # per device, for MFU; 0: measured on the CPU, looked up on GPUs
    # warn when an expert gets no token for this many steps in a row; 0: never
    idle_expert_steps: int = 100
    # "5-6" or "5": torch.profiler traces of those steps, one per rank, in the run directory
    profile_steps: str = ""
    tensorboard: bool = False  # true: event files in run_dir/tensorboard (pip install tensorboard)
    wandb: dict = field(default_factory=dict)  # {project = "..."}: log to W&B (pip install wandb)


SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "training": TrainingSection,
    "optim": OptimSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "parallel": ParallelConfig,
    "lora": LoraConfig,
}


@dataclass
class TrainConfig:
    model: ModelSection
    data: DataSection
    training: TrainingSection
    optim: OptimSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    parallel: ParallelConfig
    lora: LoraConfig  # no [lora] section: no targets, every weight trains
    model_config: ModelConfig  # the architecture, resolved from [model]
    source: str  # the TOML file
    origins: dict[str, str]  # "section.key" -> where it was set, for error messages

    def where(self, key: str) -> str:
        return self.origins.get(key, f"{self.source} (default)")

    def where_any(self, keys: list[str]) -> str:
        """Where the keys that were set were set (the command line, the file), for a rule they
        share."""
        places = dict.fromkeys(self.origins[k] for k in keys if k in self.origins)
        return ", ".join(places) or self.source

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


# ============================================================================= describing


def key_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment written after it in the dataclass source: the keys' documentation
    lives once, next to the defaults."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): [^=]+=[^#]*#\s*(.*)", line)
        if match:
            comments[match.group(1)] = match.group(2)
    return comments


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def help_text() -> str:
    """Every section and key with its default and meaning, for --help."""
    lines = [
        "config sections and keys (default, meaning); set them in the TOML file or as "
        "--section.key=value:"
    ]
    for name, cls in SECTIONS.items():
        lines.append(f"  [{name}]")
        comments = key_comments(cls)
        for f in dataclasses.fields(cls):
            if f.name == "overrides":
                lines.append(
                    "    ... and any field of the family's config (FlintConfig: SPEC.md; "
                    "Large4Config: LARGE4.md): "
                    "hidden_size, num_experts, num_hidden_layers, ..."
                )
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            note = comments.get(f.name, "")
            setting = (
                f"{f.name} = {toml_value(default)}" if default is not None else f"{f.name} (unset)"
            )
            lines.append(f"    {setting}" + (f"  # {note}" if note else ""))
    return "\n".join(lines)


def resolved_values(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """Section -> key -> the value this run uses; [model] holds the whole resolved architecture.
    Unset (None) values are left out: TOML has no null."""
    resolved = {}
    for name in SECTIONS:
        if name == "lora" and not cfg.lora.enabled:
            continue  # no [lora] section: writing an empty one would ask for one
        values = dataclasses.asdict(getattr(cfg, name))
        if name == "model":
            values = {k: v for k, v in values.items() if k != "overrides" and v}
            values.update(dataclasses.asdict(cfg.model_config))
        if name == "data":  # the data is named once: by its sources, or by its path
            values.pop("path" if cfg.data.sources else "sources")
        resolved[name] = {k: v for k, v in values.items() if v is not None}
    return resolved


def resolved_toml(cfg: TrainConfig) -> str:
    """The configuration a run uses, as a TOML file that loads back to the same run
    (--print-config)."""
    lines = [f"# {cfg.source}, with defaults and overrides applied"]
    for name, values in resolved_values(cfg).items():
        lines += [
            "",
            f"[{name}]",
            *(f"{key} = {toml_value(value)}" for key, value in values.items()),
        ]
    return "\n".join(lines)


def resolved_summary(cfg: TrainConfig) -> str:
    """The same, one line per section, for the start of a run's log."""
    return "\n".join(
        f"[{name}] " + " ".join(f"{key}={toml_value(value)}" for key, value in values.items())
        for name, values in resolved_values(cfg).items()
    )


# ============================================================================= reading


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Read the TOML file, apply `--section.key=value` overrides, check everything."""
    return config_from_tables(*read_tables(path), overrides)


def read_tables(path: str | Path) -> tuple[dict, Path, dict[str, str]]:
    """A TOML file's tables, the file, and "section.key" -> the file, for config_from_tables."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); a TOML "
            "file must be "
            f"UTF-8"
        ) from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
    return (
        raw,
        path,
        {
            f"{section}.{key}": str(path)
            for section, table in raw.items()
            if isinstance(table, dict)
            for key in table
        },
    )


def config_from_tables(
    raw: dict, path: Path, origins: dict[str, str], overrides: list[str] = ()
) -> TrainConfig:
    """Tables (changed in place) and where each key was set, then the overrides and every check: a
    file's config, or one that a tool (tools/bench.py) builds from its flags. Errors name `path` for
    defaults."""
    for override in overrides:
        section, key, value = parse_override(override)
        raw.setdefault(section, {})[key] = value
        origins[f"{section}.{key}"] = f"command line {override.split('=')[0]}"
    sections = {
        name: build_section(name, raw.pop(name, {}), origins, path)
        for name in SECTIONS
        if name != "lora"
    }
    sections["lora"] = build_lora_section(raw.pop("lora", None), origins, path)
    if raw:
        name = next(iter(raw))
        raise ConfigError(f"{path}: unknown section [{name}]; sections are {', '.join(SECTIONS)}")
    cfg = TrainConfig(**sections, model_config=None, source=str(path), origins=origins)
    cfg.model.init_from = resolve_init_from(cfg)
    cfg.model_config = resolve_model_config(cfg)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    if not text.startswith("--") or "=" not in text or "." not in text.split("=")[0]:
        raise ConfigError(f"command line: expected --section.key=value, got {text!r}")
    dotted, value = text[2:].split("=", 1)
    section, key = dotted.split(".", 1)
    if is_text_key(section, key) and not value.startswith(('"', "'")):
        # --logging.profile_steps=5 means the text "5", as a path or a name would
        return section, key, value
    try:
        return section, key, tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return section, key, value  # not a TOML value: a plain string such as a path


def is_text_key(section: str, key: str) -> bool:
    """Whether [section].key is a known key whose value is text (its default a str)."""
    fields = (
        {f.name: f for f in dataclasses.fields(SECTIONS[section])} if section in SECTIONS else {}
    )
    return key in fields and isinstance(fields[key].default, str)


def build_section(name: str, table: Any, origins: dict[str, str], path: Path):
    cls = SECTIONS[name]
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{name}] must be a table, got {table!r}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "overrides"}
    values, extra = {}, {}
    for key, value in table.items():
        where = origins.get(f"{name}.{key}", str(path))
        if key in known:
            # None only for [parallel].reshard_after_forward: a bool when set
            default = field_default(known[key])
            check_type(f"[{name}].{key}", value, bool if default is None else type(default), where)
            values[key] = float(value) if known[key].type == "float" else value
        elif name == "model":
            extra[key] = value
        else:
            raise ConfigError(
                f"{where}: unknown key [{name}].{key}; [{name}] keys are {', '.join(known)}"
            )
    section = cls(**values)
    if name == "model":
        section.overrides = extra
    return section


def field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def build_lora_section(table: Any, origins: dict[str, str], path: Path) -> LoraConfig:
    """[lora], present (even empty) or not: a present section asks for adapters, so its keys are
    checked here."""
    if table is None:
        return LoraConfig()
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [lora] must be a table, got {table!r}")
    where = ", ".join(dict.fromkeys(origins.get(f"lora.{key}", str(path)) for key in table)) or str(
        path
    )
    try:
        return LoraConfig.from_dict(table)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from error


def check_type(key: str, value: Any, expected: type, where: str) -> None:
    """bool, int, float (an int is fine), str, list or dict, as the default's type says."""
    if expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(
            f"{where}: {key} must be {expected.__name__}, got {type(value).__name__} {value!r}"
        )


# =========================================================================== the model architecture


def resolve_init_from(cfg: TrainConfig) -> str:
    """[model].init_from as the checkpoint it names: a checkpoint directory itself, or the newest
    intact step of a run's checkpoint directory (what a first run leaves in [checkpoint].dir), as
    sample.py reads it."""
    source = cfg.model.init_from
    if not source or not Path(source).is_dir() or (Path(source) / "config.json").is_file():
        # none, missing (resolve_model_config says so), or a checkpoint (its files checked at load)
        return source
    try:
        return str(resolve_checkpoint(Path(source), "[model].init_from"))
    except CheckpointError as error:
        raise ConfigError(f"{cfg.where('model.init_from')}: {error}") from error


def resolve_model_config(cfg: TrainConfig) -> ModelConfig:
    """Exactly one of preset / hf_config / init_from names the architecture; other keys override it.

    With init_from the checkpoint's config.json decides the architecture: other keys may only
    repeat its values, except the training-time settings in INIT_FROM_SETTINGS.
    """
    section = cfg.model
    chosen = [name for name in MODEL_SOURCES if getattr(section, name)]
    if len(chosen) != 1:
        where = cfg.where_any([f"model.{name}" for name in chosen])
        raise ConfigError(
            f"{where}: [model] needs exactly one of {', '.join(MODEL_SOURCES)}, got "
            f"{chosen or 'none'}"
        )
    config_class = family(model_family(cfg)).config
    defaults, fields = config_class(), {f.name for f in dataclasses.fields(config_class)}
    for key, value in section.overrides.items():
        if key not in fields:
            raise ConfigError(
                f"{cfg.where('model.' + key)}: unknown key [model].{key}; it must be "
                "one of "
                f"family, {', '.join(MODEL_SOURCES)} or a {config_class.__name__} "
                "field"
            )
        if getattr(defaults, key) is not None:
            check_type(
                f"[model].{key}", value, type(getattr(defaults, key)), cfg.where(f"model.{key}")
            )
    where = cfg.where(f"model.{chosen[0]}")
    source = section.hf_config or section.init_from
    if source and not Path(source).exists():
        raise ConfigError(f"{where}: [model].{chosen[0]} {source} does not exist")
    try:
        if not section.init_from:
            return (
                config_class.from_name(section.preset, **section.overrides)
                if section.preset
                else config_class.from_hf_config(source, **section.overrides)
            )
        saved = config_class.from_hf_config(source)
    except (TypeError, ValueError) as error:
        # FlintConfig's messages start with the field's name
        named = str(error).split(" ")[0].split(".")[0]
        where = cfg.where(f"model.{named}") if named in section.overrides else where
        raise ConfigError(f"{where}: [model]: {error}") from error
    for key, value in section.overrides.items():
        if key not in INIT_FROM_SETTINGS and value != getattr(saved, key):
            raise ConfigError(
                f"{cfg.where('model.' + key)}: [model].{key} = {value!r} cannot be "
                "set with init_from: "
                f"the architecture comes from {source}/config.json, which says "
                f"{getattr(saved, key)!r}"
            )
    return dataclasses.replace(saved, **section.overrides)


def model_family(cfg: TrainConfig) -> str:
    """[model].family, or for hf_config / init_from the family their config.json names (a family
    set as well must agree with it)."""
    section, where = cfg.model, cfg.where("model.family")
    if section.family not in FAMILIES:
        raise ConfigError(
            f"{where}: [model].family must be one of {', '.join(FAMILIES)}, got {section.family!r}"
        )
    source = section.hf_config or section.init_from
    if not source or not Path(source).exists():
        return section.family
    try:
        found = family_of_hf_config(source)
    except ValueError as error:
        raise ConfigError(
            f"{cfg.where('model.' + ('hf_config' if section.hf_config else 'init_from'))}: {error}"
        ) from error
    if "model.family" in cfg.origins and found != section.family:
        raise ConfigError(
            f"{where}: [model].family = {section.family!r} but {source} holds a {found!r} model"
        )
    return found


# ============================================================================= checks

# [logging] wandb's keys: wandb.init's arguments of those names (flint sets id and resume).
WANDB_KEYS = ("project", "name", "entity", "mode", "dir")


def check_trackers(cfg: TrainConfig) -> None:
    """[logging] tensorboard and wandb: well formed, and their optional packages importable, before
    anything trains (flint itself needs torch, safetensors, tiktoken and numpy only)."""
    log, where = cfg.logging, cfg.where("logging.wandb")
    for key, value in log.wandb.items():
        if key not in WANDB_KEYS or not isinstance(value, str):
            raise ConfigError(
                f"{where}: [logging].wandb.{key} = {value!r}: the keys are text "
                f"values of {', '.join(WANDB_KEYS)}"
            )
    if log.wandb and not log.wandb.get("project"):
        raise ConfigError(
            f'{where}: [logging].wandb needs a project, e.g. wandb = {{project = "flint"}}'
        )
    if log.wandb.get("mode", "online") not in ("online", "offline"):
        raise ConfigError(
            f'{where}: [logging].wandb.mode must be "online" or "offline", '
            f"got {log.wandb['mode']!r}"
        )
    for package, asked, key in (
        ("tensorboard", log.tensorboard, "tensorboard = true"),
        ("wandb", log.wandb, "wandb"),
    ):
        if asked and importlib.util.find_spec(package) is None:
            where = cfg.where(f"logging.{package}")
            raise ConfigError(
                f"{where}: [logging].{key} needs the {package} package, which flint "
                f"does not require: pip install {package}"
            )


def validate(cfg: TrainConfig) -> None:
    t, d, o, c, log = cfg.training, cfg.data, cfg.optim, cfg.checkpoint, cfg.logging
    rules = [
        ("training.steps", t.steps >= 1, "be >= 1"),
        ("training.batch_size", t.batch_size >= 1, "be >= 1"),
        ("training.grad_accum", t.grad_accum >= 1, "be >= 1"),
        ("training.seed", 0 <= t.seed < 2**64, "be 0 <= seed < 2**64"),
        ("training.device", t.device in ("auto", "cpu", "cuda"), "be auto, cpu or cuda"),
        ("training.eval_every", t.eval_every >= 0, "be >= 0"),
        ("training.eval_batches", t.eval_batches >= 1, "be >= 1"),
        ("training.sample_tokens", t.sample_tokens >= 0, "be >= 0"),
        (
            "training.sample_temperature",
            usable_temperature(t.sample_temperature),
            f"be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}",
        ),
        ("data.path", d.path != "", "name a file or directory"),
        (
            "data.seq_len",
            1 <= d.seq_len <= cfg.model_config.max_position_embeddings,
            f"be in [1, max_position_embeddings = {cfg.model_config.max_position_embeddings}]",
        ),
        ("data.val_fraction", 0 <= d.val_fraction < 1, "be in [0, 1)"),
        ("data.epochs", d.epochs >= 1, "be >= 1"),
        ("data.overlong", d.overlong in ("truncate", "drop"), 'be "truncate" or "drop"'),
        ("data.exhausted", d.exhausted in ("stop", "repeat"), 'be "stop" or "repeat"'),
        ("optim.name", o.name in ("adamw", "muon"), "be adamw or muon"),
        ("optim.lr", 0 < o.lr < math.inf, "be a finite number > 0"),
        ("optim.muon_lr", 0 < o.muon_lr < math.inf, "be a finite number > 0"),
        ("optim.muon_momentum", 0 <= o.muon_momentum < 1, "be in [0, 1)"),
        (
            "optim.state_dtype",
            o.state_dtype in ("float32", "bfloat16"),
            "be float32 or bfloat16",
        ),
        ("optim.min_lr", 0 <= o.min_lr <= o.lr, f"be in [0, optim.lr = {o.lr}]"),
        (
            "optim.schedule",
            o.schedule in ("cosine", "wsd", "constant"),
            "be cosine, wsd or constant",
        ),
        ("optim.warmup_steps", o.warmup_steps >= 0, "be >= 0"),
        ("optim.decay_fraction", 0 < o.decay_fraction <= 1, "be in (0, 1]"),
        ("optim.weight_decay", 0 <= o.weight_decay < math.inf, "be a finite number >= 0"),
        ("optim.beta1", 0 <= o.beta1 < 1, "be in [0, 1)"),
        ("optim.beta2", 0 <= o.beta2 < 1, "be in [0, 1)"),
        ("optim.eps", 0 < o.eps < math.inf, "be a finite number > 0"),
        (
            "optim.grad_clip",
            0 <= o.grad_clip < math.inf,
            "be a finite number >= 0 (0: no clipping)",
        ),
        ("checkpoint.every", c.every >= 0, "be >= 0"),
        ("checkpoint.keep_last", c.keep_last >= 1, "be >= 1"),
        (
            "checkpoint.export_dtype",
            c.export_dtype in ("", "float32", "bfloat16"),
            'be "", float32 or bfloat16',
        ),
        ("checkpoint.dir", c.dir != "", "name a directory"),
        ("logging.every", log.every >= 1, "be >= 1"),
        ("logging.peak_tflops", log.peak_tflops >= 0, "be >= 0 (0: measure or look up)"),
        ("logging.idle_expert_steps", log.idle_expert_steps >= 0, "be >= 0 (0: no warning)"),
    ]
    for key, ok, expected in rules:
        if not ok:
            section, name = key.split(".")
            raise ConfigError(
                f"{cfg.where(key)}: [{section}].{name} must {expected}, "
                f"got {getattr(getattr(cfg, section), name)!r}"
            )
    if d.val_fraction == 0 and t.eval_every > 0:
        raise ConfigError(
            f"{cfg.where('training.eval_every')}: [training].eval_every = "
            f"{t.eval_every} needs a "
            f"validation split, but data.val_fraction = 0"
        )
    check_sources(cfg)
    check_profile_steps(cfg)
    check_trackers(cfg)
    check_router_aux_loss(cfg)
    check_lora(cfg)
    refusal = cfg.model_config.training_error(d.seq_len, fresh_weights=not cfg.model.init_from)
    if refusal:
        raise ConfigError(f"{cfg.where('data.seq_len')}: {refusal}")
    check_paths(cfg)
    try:
        cfg.parallel.validate(
            cfg.model_config.num_experts, cfg.model_config.num_hidden_layers, d.seq_len
        )
        refusal = unsupported_layout(cfg.parallel, model_class(cfg.model_config))
        if refusal:
            raise refusal
    except LayoutError as error:
        keys = [f"parallel.{key}" for key in error.keys]
        raise ConfigError(
            f"{cfg.where(keys[0]) if len(keys) == 1 else cfg.where_any(keys)}: {error}"
        ) from error
    check_microbatches(cfg)
    check_fp8(cfg)


def check_fp8(cfg: TrainConfig) -> None:
    """[parallel] fp8's shapes (fp8.fp8_refusal), on the model built on meta: no weight is made."""
    p, t = cfg.parallel, cfg.training
    if p.fp8 == "none":
        return
    with torch.device("meta"):
        model = model_class(cfg.model_config)(cfg.model_config, torch.float32)
    rows = (
        t.batch_size // (p.pp_microbatches or p.pp * p.stages_per_rank)
        if p.pp > 1
        else t.batch_size
    )
    refusal = fp8_refusal(model, rows * cfg.data.seq_len // p.cp)
    if refusal:
        raise ConfigError(f"{cfg.where('parallel.fp8')}: [parallel].{refusal}")


def check_paths(cfg: TrainConfig) -> None:
    """Every path the run writes, checked now rather than when it is first written (after training,
    for the export): directories that are files, files that are directories, places that cannot be
    written."""
    places = [
        ("checkpoint.dir", Path(cfg.checkpoint.dir), True),
        ("data.cache_dir", Path(cfg.data.cache_dir), True),
        ("logging.jsonl", Path(cfg.logging.jsonl), False),
    ]
    export = cfg.checkpoint.export_hf
    if export and Path(export).exists():
        raise ConfigError(
            f"{cfg.where('checkpoint.export_hf')}: checkpoint.export_hf {export} "
            "already exists; the "
            f"export never overwrites: remove it or choose another directory"
        )
    if export:  # the directory does not exist yet: its nearest existing parent must take it
        places.append(("checkpoint.export_hf", Path(export), True))
    for key, path, is_dir in places:
        if is_dir and path.exists() and not path.is_dir():
            raise ConfigError(f"{cfg.where(key)}: {key} {path} is a file, expected a directory")
        if not is_dir and path.is_dir():
            raise ConfigError(f"{cfg.where(key)}: {key} {path} is a directory, expected a file")
        existing = next(p for p in (path if is_dir else path.parent, *path.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(
                f"{cfg.where(key)}: {key} {path} lies under {existing}, which is a file"
            )
        if not os.access(existing, os.W_OK | os.X_OK) or (
            path.exists() and not os.access(path, os.W_OK)
        ):
            raise ConfigError(f"{cfg.where(key)}: {key} {path} is not writable")


SOURCE_KEYS = ("path", "weight")  # one source of [data].sources


def check_sources(cfg: TrainConfig) -> None:
    """[data].sources: a non-empty list of {path, weight}, each weight a finite number > 0, each
    path named once, and not given together with [data].path (one of the two names the data)."""
    if "data.sources" not in cfg.origins:
        return
    where, sources = cfg.where("data.sources"), cfg.data.sources
    if "data.path" in cfg.origins:
        raise ConfigError(
            f"{where}: [data].sources and [data].path are both given "
            f"({cfg.where('data.path')}); name the data once: sources for a "
            f"mixture, path for one source"
        )
    if not sources:
        raise ConfigError(
            f"{where}: [data].sources is an empty list; name at least one "
            f'{{path = "...", weight = 1.0}}, or remove it and set [data].path'
        )
    seen: dict[Path, int] = {}
    for index, source in enumerate(sources):
        check_source(source, f"{where}: [data].sources[{index}]")
        first = seen.setdefault(Path(source["path"]).resolve(), index)
        if first != index:
            raise ConfigError(
                f"{where}: [data].sources[{index}] names {source['path']!r} again "
                f"(also sources[{first}]); give each source once, with its whole "
                f"weight"
            )


def check_source(source: Any, name: str) -> None:
    if not isinstance(source, dict):
        raise ConfigError(f'{name} must be a table {{path = "...", weight = 0.5}}, got {source!r}')
    extra = [key for key in source if key not in SOURCE_KEYS]
    if extra:
        raise ConfigError(
            f"{name} has key {extra[0]!r}; a source has only path and weight (every "
            f"source shares data.tokenizer, data.seq_len and the other [data] keys)"
        )
    path, weight = source.get("path"), source.get("weight")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{name}.path must name a prepared directory or text, got {path!r}")
    if not Path(path).exists():
        raise ConfigError(
            f"{name}.path {path} does not exist (relative paths start at {Path.cwd()})"
        )
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not number or not 0 < weight < math.inf:
        raise ConfigError(f"{name}.weight must be a finite number > 0, got {weight!r}")


def profile_step_range(text: str) -> range | None:
    """[logging] profile_steps: "" -> None, "5" -> range(5, 6), "5-6" -> range(5, 7); what names no
    step ("x", "6-5") -> range(0), which check_profile_steps refuses."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        return range(0)
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    return range(first, last + 1)


def check_profile_steps(cfg: TrainConfig) -> None:
    """The steps to profile lie within the run, the first no later than the last."""
    text, steps = cfg.logging.profile_steps, cfg.training.steps
    chosen = profile_step_range(text)
    if chosen is not None and not (chosen and 1 <= chosen[0] <= chosen[-1] <= steps):
        raise ConfigError(
            f"{cfg.where('logging.profile_steps')}: [logging].profile_steps must be "
            '"" (none), a step '
            f'"N" or steps "A-B" with 1 <= A <= B <= training.steps = {steps}, '
            f"got {text!r}"
        )


def check_microbatches(cfg: TrainConfig) -> None:
    """A pipeline cuts each rank's batch (training.batch_size rows) into pp_microbatches equal
    parts; refused here rather than by every rank's first step."""
    p, rows = cfg.parallel, cfg.training.batch_size
    if p.pp_microbatches < 0:
        raise ConfigError(
            f"{cfg.where('parallel.pp_microbatches')}: [parallel].pp_microbatches "
            "must be >= 0 "
            f"(0: one per pipeline stage), got {p.pp_microbatches}"
        )
    microbatches = p.pp_microbatches or p.pp * p.stages_per_rank
    if p.pp > 1 and rows % microbatches:
        keys = (
            ["parallel.pp_microbatches"]
            if p.pp_microbatches
            else ["parallel.pp", "training.batch_size"]
        )
        raise ConfigError(
            f"{cfg.where_any(keys)}: [parallel].pp_microbatches = {microbatches}"
            f"{'' if p.pp_microbatches else ' (one per pipeline stage)'} must divide "
            "the "
            f"[training].batch_size = {rows} rows of each rank's batch"
        )


def check_router_aux_loss(cfg: TrainConfig) -> None:
    """What the model's config refuses of the layout (its layout_error), and a selection bias, which
    the published format cannot hold."""
    p = cfg.parallel
    bias_rate = cfg.model_config.router_bias_update_rate
    if bias_rate and cfg.checkpoint.export_hf:
        raise ConfigError(
            f"{cfg.where('checkpoint.export_hf')}: [checkpoint].export_hf cannot "
            "export a model with "
            f"[model].router_bias_update_rate = {bias_rate}: the published format has "
            "no place for "
            "the selection bias. Sample with sample.py from the native checkpoint, "
            "or train an exportable "
            "model balanced by a router loss instead (router_bias_update_rate = 0 "
            "and "
            f"router_sequence_loss_coef > 0: README, After the first run)"
        )
    refusal = cfg.model_config.layout_error(p.pp, p.cp)
    if refusal:
        raise ConfigError(f"{cfg.where('parallel.' + refusal[0])}: {refusal[1]}")


def check_lora(cfg: TrainConfig) -> None:
    """[lora] adapts a trained model (init_from, which is not itself a LoRA run's adapters), and
    each of its targets must take an adapter: checked on a meta model before any work."""
    if cfg.model.init_from and (Path(cfg.model.init_from) / RUN_FILE).is_file():
        raise ConfigError(
            f"{cfg.where('model.init_from')}: [model].init_from {cfg.model.init_from} "
            "is a LoRA run's "
            "checkpoint, which holds adapters only: export it merged (python "
            "convert.py to-hf) and "
            f"start from the export"
        )
    if not cfg.lora.enabled:
        return
    where = cfg.where_any([key for key in cfg.origins if key.startswith("lora.")])
    # both replace an adapted map's forward: one would silently drop the other
    if cfg.parallel.fp8 != "none":
        raise ConfigError(
            f"{where}, {cfg.where('parallel.fp8')}: [lora] with [parallel] fp8 = "
            f"{cfg.parallel.fp8!r} is not supported (the adapters' maps would run one "
            "or the other); "
            f'set fp8 = "none" for a LoRA run'
        )
    if not cfg.model.init_from:
        raise ConfigError(
            f"{where}: [lora] trains adapters on a frozen base: set [model].init_from "
            "to the model "
            f"to adapt (a Hugging Face or native checkpoint)"
        )
    try:
        check_training(cfg.model_config, cfg.lora)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from error
