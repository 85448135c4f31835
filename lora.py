"""LoRA: low-rank adapters on a frozen model, the routed experts included.

    y = W x + (alpha / r) B A dropout(x)

`apply_lora(model, config)` freezes every parameter of the base and gives each targeted map an
adapter whose parameters are FP32 master weights: A drawn from normal(0, 1 / fan_in), seeded by its
name like the models' `initial_value` (so every parallel layout starts from the same adapters), and
B zero, so at step 0 the model computes exactly what the base does. The adapters are new
submodules, so no base parameter is renamed and a base checkpoint loads as it is:

    nn.Linear W [out, in]                 <name>.lora.A [r, in], <name>.lora.B [out, r]  (PEFT's)
    routed experts, in their own x @ w layout (moe.py):
      gate_up_proj [E, H, 2*Im]           <experts>.gate_up_lora.A [E, H, r], .B [E, r, 2*Im]
      down_proj    [E, Im, H]             <experts>.down_lora.A [E, Im, r],  .B [E, r, H]

so that an expert's update is x @ A_e @ B_e: two grouped GEMMs over the rows sorted by expert
(`grouped_lora`), with no transpose, and the merged weight is w_e + scale * A_e @ B_e. A targeted
module keeps its class; its forward becomes the adapted one (an instance attribute, as
parallel.apply_compile sets a compiled forward), which reads the parameters at each call, so FSDP's
gathered weights and a compiled block see the adapters like any other parameter. Routed experts keep
their forward and take an adapted `swiglu` (the grouped GEMMs of their rows, grouped by expert):
under expert parallelism moe.ExpertParallelExperts runs it on this rank's experts, whose adapters
parallel.apply_expert_parallel splits over the experts with the weights.

A LoRA run's checkpoints hold the adapters and RUN_FILE (its settings and its base's identity,
checked on resume here and on export). Their export lives with the other exports, in convert.py:
the merged model (the base plus the scaled products: the published model again) and PEFT's adapter
directory (see tests/make_lora_peft_fixture.py for what peft loads onto transformers' models).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import MethodType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from checkpoint_files import CHECKSUMS, CheckpointError, crc32_of
from hf_io import read_json
from layers import fp32_units, frozen_modules, inside, seeded_normal
from moe import GROUPED_GEMM_MULTIPLE, GroupedExperts, grouped_mm
from registry import ModelConfig, model_class

# the target that adapts every nn.Linear and routed-expert group outside the FP32 units and frozen
# parts
ALL = "all"
# Adapter submodule name -> the base parameter of its owner that it adapts.
ADAPTED = {"lora": "weight", "gate_up_lora": "gate_up_proj", "down_lora": "down_proj"}


# ============================================================================= configuration


@dataclass
class LoraConfig:
    """The `[lora]` section of a training config."""

    rank: int = 16  # r: the adapters' inner width
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on each adapter's input, in training only
    # module names or dotted tails ("q_proj", "mlp.experts"), or "all"
    targets: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, section: dict, where: str = "[lora]") -> LoraConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; expected one of {known}")
        config = cls(**section)
        config.validate(where)
        return config

    def validate(self, where: str = "[lora]") -> None:
        """Each setting on its own, one line naming the key; what the targets match is checked by
        apply_lora."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"{where} rank must be an integer > 0, got {self.rank!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not math.isfinite(self.alpha)
            or self.alpha == 0
        ):
            # alpha 0 scales every update to zero: the adapters would train and change nothing
            raise ValueError(
                f"{where} alpha must be a finite number other than 0, got {self.alpha!r}"
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0 <= self.dropout < 1
        ):
            raise ValueError(f"{where} dropout must be a number in [0, 1), got {self.dropout!r}")
        if (
            not isinstance(self.targets, (list, tuple))
            or not self.targets
            or not all(isinstance(t, str) and t for t in self.targets)
        ):
            raise ValueError(
                f"{where} targets must be a non-empty list of module names such as "
                f'["q_proj", "experts"] or ["{ALL}"], got {self.targets!r}'
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def enabled(self) -> bool:
        """A training config without a [lora] section has no targets: it trains every parameter."""
        return bool(self.targets)


# ============================================================================= the adapters


class LinearAdapter(nn.Module):
    """The update of one nn.Linear (weight [out, in]): scale * B A dropout(x), A [r, in], B [out,
    r]."""

    def __init__(
        self, in_features: int, out_features: int, config: LoraConfig, device: torch.device
    ):
        super().__init__()
        self.scale, self.dropout = config.scale, config.dropout
        self.A = nn.Parameter(
            torch.empty(config.rank, in_features, dtype=torch.float32, device=device)
        )
        self.B = nn.Parameter(
            torch.empty(out_features, config.rank, dtype=torch.float32, device=device)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> the update [..., out], in x's dtype (computed in the adapters' dtype)."""
        x_in = F.dropout(x.to(self.A.dtype), self.dropout, self.training)
        return ((x_in @ self.A.T) * self.scale @ self.B.T).to(x.dtype)  # [..., r] -> [..., out]


class GroupedAdapter(nn.Module):
    """The update of one grouped expert weight w [E, in, out] (x @ w_e): A [E, in, r], B [E, r,
    out]."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        config: LoraConfig,
        device: torch.device,
    ):
        super().__init__()
        self.scale, self.dropout = config.scale, config.dropout
        rank = config.rank
        self.A = nn.Parameter(
            torch.empty(num_experts, in_features, rank, dtype=torch.float32, device=device)
        )
        self.B = nn.Parameter(
            torch.empty(num_experts, rank, out_features, dtype=torch.float32, device=device)
        )

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """rows [R, in] sorted by this rank's experts, offsets int32 [E] (moe.grouped_mm's) -> the
        update [R, out]. Under expert parallelism A and B are split over the experts: this rank's
        are used."""
        A, B = local_experts(self.A), local_experts(self.B)
        rows_in = F.dropout(rows.to(A.dtype), self.dropout, self.training)
        return grouped_lora(rows_in, offsets, A, B, self.scale).to(rows.dtype)


def local_experts(param: torch.Tensor) -> torch.Tensor:
    """An expert adapter's parameter as this rank holds it: a DTensor split over the experts -> its
    local part."""
    return param.to_local() if isinstance(param, DTensor) else param


def grouped_lora(
    rows: torch.Tensor, offsets: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each row's expert update, two grouped GEMMs: rows [R, in] sorted by expert (padding rows
    zero), offsets int32 [E] cumulative group ends, A [E, in, r], B [E, r, out] -> scale * rows_e @
    A_e @ B_e [R, out]. The scale multiplies the narrow [R, r] product."""
    return grouped_mm(grouped_mm(rows, A, offsets) * scale, B, offsets)


def delta_weight(A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    """The update of the base weight: scale * B @ A [out, in] for a Linear (A [r, in], B [out, r]);
    scale * A_e @ B_e [E, in, out] for grouped experts (A [E, in, r], B [E, r, out]). In FP32."""
    A, B = A.float(), B.float()
    return scale * (B @ A if A.dim() == 2 else A @ B)


# ============================================================================= the adapted forwards


def adapted_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An adapted nn.Linear's forward: W x (+ bias) + its adapter's update."""
    return F.linear(x, self.weight, self.bias) + self.lora(x)


def adapted_swiglu(
    gate_up_lora: GroupedAdapter,
    down_lora: GroupedAdapter,
    rows: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """Adapted routed experts: moe.grouped_swiglu (rows [R, H] grouped by expert, routing weights
    [R] -> [R, H]) with each grouped GEMM's update added; GroupedExperts.swiglu, so that the
    dropless grouped path and the expert-parallel one (on this rank's experts) both run it. The
    routing weight scales the hidden row before the down projection, so it scales the down adapter's
    update too, as in the merged weight."""
    gate_up = grouped_mm(rows, gate_up_proj, offsets) + gate_up_lora(rows, offsets)
    gate, up = gate_up.chunk(2, dim=-1)  # [R, Im] each
    hidden = F.silu(gate) * up * weights.unsqueeze(-1)
    return grouped_mm(hidden, down_proj, offsets) + down_lora(hidden, offsets)  # [R, H]


# ============================================================================= applying


def apply_lora(model: nn.Module, config: LoraConfig, seed: int = 0) -> list[str]:
    """Freeze `model` and adapt the modules `config.targets` name -> their names. Call it on the
    whole model (on meta or materialised) before parallelize: adapters are created on the device of
    the weight they adapt and, unless that is meta, initialised (see `initial_value`)."""
    config.validate()
    targets = resolve_targets(model, config.targets)
    check_rank(config.rank, targets)
    if config.rank % GROUPED_GEMM_MULTIPLE and any(
        isinstance(m, GroupedExperts) for m in targets.values()
    ):
        raise ValueError(
            f"[lora] rank must be a multiple of {GROUPED_GEMM_MULTIPLE} to adapt "
            "routed experts (the "
            "grouped GEMM's rows start on 16-byte boundaries, 8 BF16 values), got "
            f"{config.rank}"
        )
    model.requires_grad_(False)
    for name, module in targets.items():
        if isinstance(module, GroupedExperts):
            num_experts, hidden, double = module.gate_up_proj.shape
            device = module.gate_up_proj.device
            module.gate_up_lora = GroupedAdapter(num_experts, hidden, double, config, device)
            module.down_lora = GroupedAdapter(num_experts, double // 2, hidden, config, device)
            module.swiglu = partial(adapted_swiglu, module.gate_up_lora, module.down_lora)
        else:
            module.lora = LinearAdapter(
                module.in_features, module.out_features, config, module.weight.device
            )
            module.forward = MethodType(adapted_linear, module)
    init_adapters(model, seed)
    # parallel.init_weights asks the model for each parameter's initial value: the adapters' come
    # from here.
    model.initial_value = MethodType(initial_value_of_adapted, model)
    return list(targets)


def map_sides(module: nn.Module) -> tuple[int, int]:
    """(in, out) of the narrowest map a target holds: a Linear's; routed experts' down_proj
    [E, Im, H] (their gate_up_proj [E, H, 2*Im] is wider on both sides)."""
    if isinstance(module, GroupedExperts):
        return tuple(module.down_proj.shape[1:])
    return module.in_features, module.out_features


def check_rank(rank: int, targets: dict[str, nn.Module]) -> None:
    """Refuse a rank above min(in, out) of the narrowest adapted map: B A has rank min(in, out) at
    most, so a wider one adds parameters and memory, not reach (2**40 dies in the allocator)."""
    name, module = min(targets.items(), key=lambda item: min(map_sides(item[1])))
    sides = map_sides(module)
    if rank > min(sides):
        raise ValueError(
            f"[lora] rank must be at most {min(sides)}, the smaller side of the "
            f"narrowest adapted map ({name}: in {sides[0]}, out {sides[1]}), "
            f"got {rank}"
        )


def resolve_targets(model: nn.Module, patterns: list[str]) -> dict[str, nn.Module]:
    """The modules the patterns name: a pattern matches a module whose name is it or ends with "." +
    it. Each pattern must match, and only modules that can take an adapter; ALL takes every one of
    those."""
    modules = dict(model.named_modules())
    if any(name.rpartition(".")[2] in ADAPTED for name in modules):
        raise ValueError(
            "[lora] the model already has adapters: apply_lora once, to the base model"
        )
    fp32, frozen = fp32_units(model), frozen_modules(model)
    chosen: dict[str, nn.Module] = {}
    for pattern in patterns:
        if pattern == ALL:
            matches = [
                name
                for name, m in modules.items()
                if isinstance(m, (nn.Linear, GroupedExperts))
                and not inside(name, fp32)
                and not inside(name, frozen)
            ]
        else:
            matches = [
                name
                for name in modules
                if name and (name == pattern or name.endswith("." + pattern))
            ]
        if not matches:
            raise ValueError(
                f"[lora] targets: {pattern!r} matches no module of "
                f"{type(model).__name__} (a target "
                'is a module name or its dotted tail, e.g. "q_proj" or '
                '"mlp.experts")'
            )
        for name in matches:
            check_target(pattern, name, modules[name], fp32, frozen)
            chosen[name] = modules[name]
    return chosen


def check_target(
    pattern: str, name: str, module: nn.Module, fp32: set[str], frozen: set[str]
) -> None:
    """One line on why `module` (matched by `pattern`) cannot take an adapter, if it cannot."""
    where = f"[lora] targets: {pattern!r} matches {name}"
    if inside(name, frozen):
        raise ValueError(
            f"{where}, which is frozen in the base model (Large 4's indexer): it takes no adapter"
        )
    if inside(name, fp32):
        raise ValueError(
            f"{where}, part of an FP32 unit (sinks, routers, head): those take no adapter"
        )
    if not isinstance(module, (nn.Linear, GroupedExperts)):
        raise ValueError(
            f"{where} ({type(module).__name__}): adapters go on nn.Linear maps and "
            "routed experts only"
        )
    if isinstance(module, GroupedExperts) and (
        module.backend != "grouped" or module.capacity_ratio is not None
    ):
        raise ValueError(
            f"{where}: routed-expert adapters need experts_backend 'grouped' and no capacity_factor"
        )


# ========================================================================= initial values and names


def is_adapter_key(key: str) -> bool:
    """Whether a parameter name (state-dict key) is an adapter's:
    <owner>.<lora|gate_up_lora|down_lora>.<A|B>."""
    head, _, leaf = key.rpartition(".")
    return leaf in ("A", "B") and head.rpartition(".")[2] in ADAPTED


def base_key(adapter_key: str) -> str:
    """The base parameter an adapter parameter adapts: q_proj.lora.A -> q_proj.weight,
    experts.gate_up_lora.B -> experts.gate_up_proj."""
    owner, adapter = adapter_key.rsplit(".", 2)[:2]
    return f"{owner}.{ADAPTED[adapter]}"


def adapter_initial_value(name: str, param: torch.Tensor, seed: int) -> torch.Tensor:
    """An adapter parameter's initial value: B zero; A normal(0, 1 / fan_in) from a generator seeded
    by (seed, name), so that each rank and layout draws the same tensor (param gives shape and
    device)."""
    if name.endswith(".B"):
        return torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    fan_in = param.shape[-1] if param.dim() == 2 else param.shape[-2]  # A [r, in] or [E, in, r]
    return seeded_normal(name, param, seed, fan_in**-0.5)


def initial_value(model: nn.Module, name: str, param: torch.Tensor, seed: int) -> torch.Tensor:
    """The initial value of any parameter of an adapted model: the adapter's, or the model's own."""
    if is_adapter_key(name):
        return adapter_initial_value(name, param, seed)
    return type(model).initial_value(model, name, param, seed)


def initial_value_of_adapted(
    self: nn.Module, name: str, param: torch.Tensor, seed: int
) -> torch.Tensor:
    """An adapted model's `initial_value` (apply_lora sets it on the instance, as it sets the
    forwards)."""
    return initial_value(self, name, param, seed)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Set every materialised adapter parameter to its initial value (meta ones wait for
    init_weights)."""
    for name, param in model.named_parameters():
        if is_adapter_key(name) and param.device.type != "meta":
            param.copy_(adapter_initial_value(name, param, seed))


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters' entries of a state dict (what a LoRA checkpoint keeps)."""
    return {key: value for key, value in state.items() if is_adapter_key(key)}


# ============================================================== training runs and their checkpoints

# in each checkpoint of a LoRA run: its [lora] settings and the base's identity
RUN_FILE = "lora.json"


def check_training(model_config: ModelConfig, config: LoraConfig) -> None:
    """What apply_lora would refuse (targets matching nothing or a frozen or FP32 part, the rank,
    experts under capacity), found at config time on a meta model."""
    with torch.device("meta"):
        model = model_class(model_config)(model_config)
    apply_lora(model, config)


def without_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's entries of an adapted model's state dict (what the base checkpoint holds)."""
    return {key: value for key, value in state.items() if not is_adapter_key(key)}


def base_identity(init_from: str | Path) -> dict:
    """The base a LoRA run adapts: its path, the SHA-256 of its config.json (read as JSON, so
    formatting does not count) and that of its weight files' checksums (`weights_sha256`)."""
    path = Path(init_from).resolve()
    text = json.dumps(read_json(path / "config.json"), sort_keys=True)
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "weights_sha256": weights_sha256(path),
    }


def weight_files(base: Path) -> list[Path]:
    """The files that hold a base's tensors: a native checkpoint's .metadata and *.distcp, a
    published one's *.safetensors."""
    if (base / ".metadata").is_file():
        return sorted([base / ".metadata", *base.glob("*.distcp")])
    return sorted(base.glob("*.safetensors"))


# (path, its weight files' names, sizes, inodes, mtimes) -> weights_sha256
_WEIGHT_DIGESTS: dict[tuple, str] = {}


def weights_sha256(base: Path) -> str:
    """SHA-256 over each weight file's name, size and CRC-32. The CRC-32 is the one the base's
    checksums.json lists (no weight is read: cheap for a base of hundreds of GB), or, for a file it
    does not list (a published base has no checksums.json), computed from the file's bytes, once
    per process while the file stays where it is. What this sees: weight files added, removed,
    resized, or replaced together with their checksums.json, or content changed where no
    checksums.json lists it. That a listed file's bytes still match checksums.json is checked when
    the base is loaded (checkpoint_files.verify)."""
    files = weight_files(base)
    stats = {file.name: file.stat() for file in files}
    key = (
        str(base),
        tuple((name, st.st_size, st.st_ino, st.st_mtime_ns) for name, st in stats.items()),
    )
    if key not in _WEIGHT_DIGESTS:
        listed = listed_checksums(base)
        sums = [
            [f.name, stats[f.name].st_size, listed[f.name] if f.name in listed else crc32_of(f)]
            for f in files
        ]
        _WEIGHT_DIGESTS[key] = hashlib.sha256(json.dumps(sums).encode()).hexdigest()
    return _WEIGHT_DIGESTS[key]


def listed_checksums(directory: Path) -> dict[str, int]:
    """{file name: CRC-32} from a checkpoint's checksums.json; {} where it has none or it is
    unreadable (then the weights' checksums are computed; loading the base reports the damage)."""
    try:
        listed = json.loads((directory / CHECKSUMS).read_text())
        return {name: int(entry["crc32"]) for name, entry in listed.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def base_changes(saved: dict, now: dict) -> str | None:
    """What differs, in words, between the base identity a run recorded and that at its path now."""
    changed = [
        f"{what} (SHA-256 {saved[key][:12]} then, {now[key][:12]} now)"
        for key, what in (("config_sha256", "config.json"), ("weights_sha256", "weights"))
        if key in saved and saved[key] != now[key]
    ]
    return " and its ".join(changed) or None


def warn_unrecorded_weights(checkpoint: Path, base: str) -> None:
    """A checkpoint written before the base's weights were recorded is used, not refused (its base
    may be intact), with one line saying what could not be checked."""
    print(
        f"warning: {checkpoint / RUN_FILE} records no checksum of its base's weights (written "
        f"before they were recorded): the base {base} is checked by its config.json only",
        file=sys.stderr,
    )


def run_record(config: LoraConfig, init_from: str | Path) -> dict:
    """RUN_FILE's contents for a run adapting the base `init_from`."""
    return {"lora": dataclasses.asdict(config), "base": base_identity(init_from)}


@dataclass
class RunRecord:
    """A LoRA checkpoint's RUN_FILE, checked: the run's [lora] settings and its base's identity."""

    lora: LoraConfig
    base: dict  # base_identity's keys; weights_sha256 only in records written since it is recorded


BASE_KEYS = {"path": str, "config_sha256": str}
JSON_KINDS = {dict: "a JSON object", str: "a string"}


def read_run_record(checkpoint: Path) -> RunRecord | None:
    """A checkpoint's RUN_FILE, checked before anything in the checkpoint is read, or None for the
    checkpoint of a run without [lora]. A damaged one: one line naming the file and the key."""
    path = checkpoint / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = read_json(path)  # names the file: invalid JSON, an empty file, not an object
        return RunRecord(record_settings(record), record_base(record))
    except ValueError as error:
        problem = str(error).removeprefix(f"{path}: ")
        raise CheckpointError(
            f"{path}: {problem} (train.py writes this file with each checkpoint "
            f"of a LoRA run; restore it from a copy)"
        ) from None


def record_entry(table: dict, key: str, kind: type, name: str) -> object:
    """table[key], which must be a `kind` (a bool is no number): its name in the file is `name`."""
    if key not in table:
        raise ValueError(f"{name} is missing")
    if not isinstance(table[key], kind) or isinstance(table[key], bool):
        raise ValueError(f"{name} must be {JSON_KINDS[kind]}, got {table[key]!r:.60}")
    return table[key]


def record_settings(record: dict) -> LoraConfig:
    settings = record_entry(record, "lora", dict, "lora")
    for field_ in dataclasses.fields(LoraConfig):
        if field_.name not in settings:
            raise ValueError(f"lora.{field_.name} is missing")
    return LoraConfig.from_dict(settings, where="lora:")


def record_base(record: dict) -> dict:
    base = record_entry(record, "base", dict, "base")
    kinds = {**BASE_KEYS, "weights_sha256": str} if "weights_sha256" in base else BASE_KEYS
    for key, kind in kinds.items():
        record_entry(base, key, kind, f"base.{key}")
    return base


def resume_refusal(checkpoint: Path, config: LoraConfig, init_from: str) -> str | None:
    """Why this run cannot resume `checkpoint`, in one line, or None: a LoRA checkpoint resumes only
    in a LoRA run with adapters of the same shapes, on the same base (path, config, weights)."""
    saved = read_run_record(checkpoint)
    if saved is None:
        return (
            None
            if not config.enabled
            else (
                f"checkpoint {checkpoint} holds a whole model, not LoRA adapters; to adapt it, set "
                "[model].init_from "
                f'= "{checkpoint}" and checkpoint.resume = "never"'
            )
        )
    base = saved.base["path"]
    if not config.enabled:
        return (
            f"checkpoint {checkpoint} holds LoRA adapters only (of the base {base}): resume it "
            "with its [lora] section, or export it merged (python convert.py to-hf) and train "
            "from that"
        )
    now = base_identity(init_from)
    if base != now["path"]:
        return (
            f"checkpoint {checkpoint} adapts the base {base}, not [model].init_from "
            f"{now['path']}: resume it on its own base"
        )
    changes = base_changes(saved.base, now)
    if changes:
        return (
            f"checkpoint {checkpoint} adapts the base {base}, whose {changes} changed since "
            f"the run started: resume it on the base it was trained on"
        )
    if "weights_sha256" not in saved.base:
        warn_unrecorded_weights(checkpoint, base)
    if (saved.lora.rank, saved.lora.targets) != (config.rank, list(config.targets)):
        return (
            f"checkpoint {checkpoint} holds adapters of [lora] rank {saved.lora.rank}, "
            f"targets {saved.lora.targets}; this run asks for rank {config.rank}, "
            f"targets {list(config.targets)}"
        )
    return None
