r"""How fast a model trains, side by side, and where the step time goes.

    # the CPU shape (preset bench-cpu), every comparison
    python3 -m tools.bench
    # a seconds-long smoke run on the smallest preset
    python3 -m tools.bench --quick --json out.json
    # one step's torch.profiler table, top 25 ops
    python3 -m tools.bench --sections main --profile 25
    # a training config's step
    python3 -m tools.bench --config configs/smoke.toml --sections main,compiled
    # Large 4, overridden
    python3 -m tools.bench --config configs/large4-smoke.toml --model.n_routed_experts=4
    # one GPU
    python3 -m tools.bench --preset flint-shallow --device cuda --dtype bfloat16 --batch 2 \
        --seq-len 4096

What is timed is read as train.py reads it (--config or --preset, then --batch, --seq-len, --device,
--dtype, then `--section.key=value` overrides). The first row is the config's own step on one
process; the others change one thing. Every row times whole training steps (forward, backward,
clipping, AdamW from train.build_optimizer) after --warmup steps, and reports the median of --reps.
The rows that compare steps (main, compiled, baseline, reference) are built and warmed up first,
then timed in rotation, one step of each in turn, so a machine whose speed drifts slows every row
alike; ratios are given of the medians and as the median per-rotation ratio. MFU is against
train.py's peak (a GPU's dense BF16 peak, or the CPU's cached matmul rate, also measured before each
row so a loaded machine stands out). Peak memory is taken during a row's own warm-up, above what the
process held before. A row that cannot run is shown as FAILED with its error, and the run goes on.
"""

from __future__ import annotations

import os

# As in train.py: idle OpenMP threads sleep instead of spinning, so a busy neighbour on the cores
# slows a step down instead of stalling every op. Set before torch starts OpenMP; yours wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import importlib
import importlib.util
import json
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import record_function

from attention import FULL, SLIDING, resolve_backend
from config import (
    ConfigError,
    ModelSection,
    OptimSection,
    TrainConfig,
    config_from_tables,
    model_family,
    parse_override,
    read_tables,
)
from files import write_atomically
from flags import OneLineParser, non_negative, positive
from layers import build
from metrics import CPU_PEAK_CACHE, model_flops_per_token, run_peak_flops
from parallel import Process, apply_activation_checkpointing, apply_compile
from registry import FAMILIES, ModelConfig, family, model_class
from tools.profiling import (
    OPTIMIZER,
    RANGE,
    NotApplicable,
    dense_logits_loss,
    matmul_rate,
    memory_in_use,
    peak_memory,
    profile_step,
    reset_peak_memory,
    time_call,
)
from train import build_optimizer

SECTIONS = ("main", "compiled", "baseline", "reference", "attention", "experts", "loss", "sweep")


# ============================================================================= the peak for MFU


def peak_flops(cfg: TrainConfig, device: torch.device) -> tuple[float | None, str]:
    """FLOP/s to divide by for MFU, as train.py takes it for one process, and where it comes from;
    None for a GPU missing from metrics.GPU_PEAK_TFLOPS (then: the best matmul rate of this run)."""
    peak = run_peak_flops(cfg, Process(0, 1, 0, 1, device))
    if cfg.logging.peak_tflops:
        return peak, f"[logging].peak_tflops, {cfg.where('logging.peak_tflops')}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return peak, (
            f"dense BF16 peak of {name} (metrics.GPU_PEAK_TFLOPS)"
            if peak
            else f"best matmul rate measured in this run ({name} is not in metrics.GPU_PEAK_TFLOPS)"
        )
    return (
        peak,
        f"this machine's FP32 matmul rate on {os.cpu_count()} cores, measured once "
        f"({CPU_PEAK_CACHE})",
    )


# ============================================================================= the step


def model_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return model(input_ids, targets)


def training_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable,
    optim: OptimSection,
) -> Callable[[], None]:
    """train.py's step on one micro-batch: loss, backward, clip the gradient norm, AdamW."""
    optimizer = build_optimizer(model, optim)

    def step() -> None:
        loss_fn(model, input_ids, targets).backward()
        with record_function(RANGE + OPTIMIZER):
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def compiled_graph_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks it met since the counters were last cleared."""
    counters = torch._dynamo.utils.counters
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def describe(error: Exception) -> str:
    """A row's error in one line; an optional row (transformers) or another model's comparison is
    skipped."""
    if isinstance(error, (ImportError, NotApplicable)):
        return f"skipped: {error}"
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


# ============================================================================= rows of the table

# a row's model, the call timed, its FLOPs per token
Built = tuple[torch.nn.Module, Callable[[], None], float]


@dataclasses.dataclass
class Prepared:
    """A row built and warmed up (row["error"] when it could not be): its record, model and timed
    call."""

    row: dict
    model: torch.nn.Module | None = None
    call: Callable[[], None] | None = None


@dataclasses.dataclass
class Bench:
    """What every row shares: the config (model, shape, optimizer, checkpointing, compile), the
    device, the repetitions, the peak for MFU, the rows so far and every matmul rate measured."""

    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype
    warmup: int
    reps: int
    matmul_size: int
    peak: float | None  # FLOP/s for MFU; None: known only at the end (peak_flops)
    rows: list[dict] = dataclasses.field(default_factory=list)
    rates: list[float] = dataclasses.field(default_factory=list)

    @property
    def config(self) -> ModelConfig:
        return self.cfg.model_config

    @property
    def seq_len(self) -> int:
        return self.cfg.data.seq_len

    @property
    def tokens(self) -> int:
        return self.cfg.training.batch_size * self.seq_len

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(
            0,
            self.config.vocab_size,
            (self.cfg.training.batch_size, self.seq_len + 1),
            generator=generator,
        ).to(self.device)
        return ids[:, :-1], ids[:, 1:]  # inputs and next-token targets, [B, T] each

    def model(self, **overrides) -> torch.nn.Module:
        config = dataclasses.replace(self.config, **overrides)
        model = build(model_class(config), config, self.device, self.dtype, seed=0)
        apply_activation_checkpointing(model, self.cfg.parallel.activation_checkpointing)
        return model

    def matmul_rate(self) -> float:
        self.rates.append(matmul_rate(self.device, self.dtype, self.matmul_size))
        return self.rates[-1]

    # ------------------------------------------------------------------ what a row builds

    def training(
        self, loss_fn: Callable = model_loss, compiled: bool = False, **overrides
    ) -> Built:
        """Training steps of a fresh model built with `overrides`, its blocks compiled or not."""
        model = self.model(**overrides)
        if compiled:
            # compile afresh, so that the warm-up counts and times the compilation
            torch._dynamo.reset()
            apply_compile(model)  # fullgraph: a graph break fails the row
        return (
            model,
            training_step(model, *self.inputs(), loss_fn, self.cfg.optim),
            model.flops_per_token(self.seq_len),
        )

    def reference(self) -> Built:
        """Training steps of the published implementation (transformers) on this shape's weights, as
        the family's baselines build it; ImportError (a skipped row) when transformers is
        missing."""
        model = baseline(self.config, "transformers_reference")(self.model())
        step = training_step(
            model, *self.inputs(), baseline(self.config, "transformers_loss"), self.cfg.optim
        )
        return model, step, model_flops_per_token(self.config, self.seq_len)

    def forward(self, **overrides) -> Built:
        """Forwards without autograd (the only mode of flex attention on the CPU); a third of the
        FLOPs."""
        model, (input_ids, _) = self.model(**overrides), self.inputs()
        return (
            model,
            torch.no_grad()(lambda: model(input_ids)),
            model.flops_per_token(self.seq_len) / 3,
        )

    # ----------------------------------------------------------------- warming up, timing, printing

    def prepare(
        self, label: str, name: str, note: str, build: Callable[[], Built], compiled: bool = False
    ) -> Prepared:
        """Build a row and run its warm-up calls (which compile a compiled row). Recorded: the
        warm-up's seconds, the graphs compiled, and peak_memory_gib, the most memory in use during
        the warm-up above what the process held before the build (other rows' models stay out of
        it). A row that cannot run here (out of memory, an op this device lacks) keeps its error and
        the run goes on."""
        row = {"label": label, "name": name, "note": note}
        self.rows.append(row)
        before = memory_in_use(self.device)
        reset_peak_memory(self.device)
        try:
            model, call, flops = build()
            torch._dynamo.utils.counters.clear()
            row["warmup_s"] = sum(time_call(call, self.device) for _ in range(self.warmup))
        except Exception as error:  # reported in the table and the JSON, never dropped
            row["error"] = describe(error)
            return Prepared(row)
        row.update(
            flops_per_token=flops,
            peak_memory_gib=(peak_memory(self.device) - before) / 2**30,
            **(compiled_graph_counts() if compiled else {}),
        )
        return Prepared(row, model, call)

    def finish(self, row: dict) -> None:
        """The median step of a timed row, its tokens/s and MFU; then it is printed."""
        if "error" not in row:
            row["step_s"] = statistics.median(row["step_s_all"])
            row["tokens_per_s"] = self.tokens / row["step_s"]
            if self.peak:
                row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / self.peak
        print(
            f"{row['label']:<{LABEL_WIDTH}} {row['name']:<{NAME_WIDTH}} {row_columns(row)}",
            flush=True,
        )

    def sequential(self, label: str, name: str, note: str, build: Callable[[], Built]) -> None:
        """A row timed on its own: the machine's matmul rate, warm-up, then `reps` calls one after
        another."""
        rate = self.matmul_rate()
        prepared = self.prepare(label, name, note, build)
        prepared.row["matmul_flops"] = rate
        alternate([prepared], self.reps, self.device)
        self.finish(prepared.row)


def alternate(
    rows: list[Prepared], reps: int, device: torch.device, rate: Callable[[], float] | None = None
) -> None:
    """Time `reps` rotations, one call of each row in turn (a0, b0, c0, a1, b1, c1, ...), so that
    every row sees the same state of a machine whose speed drifts; each call's seconds go to the
    row's step_s_all. rate() (the machine's matmul rate) is measured before each rotation. A row
    that fails (or was never built) keeps its error and sits out; the others go on."""
    for _ in range(reps):
        if rate:
            rate()
        for prepared in rows:
            if "error" in prepared.row:
                continue
            try:
                prepared.row.setdefault("step_s_all", []).append(time_call(prepared.call, device))
            except Exception as error:
                prepared.row["error"] = describe(error)
                prepared.model = prepared.call = None  # its memory goes back to the other rows


def compare(bench: Bench, own_label: str, sections: set[str], profile_rows: int) -> list[dict]:
    """The rows that compare whole training steps, built and warmed up first, then timed alternating
    (alternate): the config's own step (labelled with the config), the other of eager and compiled,
    the plain eager baseline and the transformers reference. All are alive at once, so their models
    and optimizer states must fit together (else choose fewer --sections). The config's own step,
    when eager, is then profiled once for its time split."""
    config, device, parallel = bench.config, bench.device, bench.cfg.parallel
    family, compiled = model_family(bench.cfg), parallel.compile
    backend = resolve_backend(config.attention_backend, device)
    chunks = (
        "one chunk"
        if bench.tokens <= config.loss_chunk_size
        else f"chunks of {config.loss_chunk_size} rows"
    )
    modes = {False: "eager", True: "compiled per block"}
    candidates = {
        "main": (
            own_label,
            f"{family} ({modes[compiled]})",
            f"{backend}, {config.experts_backend} "
            "experts, loss in "
            f"{chunks}, checkpointing {parallel.activation_checkpointing}",
            compiled,
            lambda: bench.training(compiled=compiled),
        ),
        "compiled": (
            "variant",
            f"{family} ({modes[not compiled]})",
            "not compiled"
            if compiled
            else "torch.compile(fullgraph=True) per block; warm-up compiles",
            not compiled,
            lambda: bench.training(compiled=not compiled),
        ),
        "baseline": (
            "baseline",
            "plain eager baseline",
            "scores + sink column + softmax, grouped GEMM, unchunked loss",
            False,
            lambda: bench.training(baseline(config, "plain_eager_loss")),
        ),
        "reference": (
            "reference",
            "transformers reference",
            "FlintForCausalLM: eager attention, grouped_mm experts, all logits",
            False,
            bench.reference,
        ),
    }
    rows = []
    for section, (label, name, note, compiles, make) in candidates.items():
        if section in sections:
            print(f"warming up {name} ...", end=" ", flush=True)
            rows.append(bench.prepare(label, name, note, make, compiles))
            print(rows[-1].row.get("error") or f"{rows[-1].row['warmup_s']:.1f} s", flush=True)
    if not rows:
        return rows
    print(
        f"timing {bench.reps} rotation(s) of the rows above, one step of each in turn", flush=True
    )
    first_rate = len(bench.rates)
    alternate(rows, bench.reps, device, bench.matmul_rate)
    print(table_header(), flush=True)
    for prepared in rows:
        prepared.row["matmul_flops_all"] = bench.rates[first_rate:]  # before each rotation
        prepared.row["matmul_flops"] = statistics.median(prepared.row["matmul_flops_all"])
        bench.finish(prepared.row)
    own = rows[0]
    # hooks would break compiled graphs
    if "main" in sections and not compiled and "error" not in own.row:
        own.row["split"], table = profile_step(own.model, own.call, device, profile_rows)
        print(table, end="", flush=True)
    return [prepared.row for prepared in rows]


def variants(bench: Bench, sections: set[str]) -> None:
    """Rows that change one thing of the config's step, each timed on its own."""
    config, device = bench.config, bench.device
    backend = resolve_backend(config.attention_backend, device)
    if "attention" in sections:
        if device.type == "cpu":  # flex has no CPU backward: compare forwards
            bench.sequential(
                "variant",
                "attention sdpa (forward only)",
                "no autograd",
                lambda: bench.forward(attention_backend="sdpa"),
            )
            bench.sequential(
                "variant",
                "attention flex (forward only)",
                "eager flex, no autograd (no CPU backward)",
                lambda: bench.forward(attention_backend="flex"),
            )
        else:
            other = "sdpa" if backend == "flex" else "flex"
            bench.sequential(
                "variant",
                f"attention {other}",
                f"the config uses {backend}",
                lambda: bench.training(attention_backend=other),
            )
    if "experts" in sections:
        other = "loop" if config.experts_backend == "grouped" else "grouped"
        bench.sequential(
            "variant",
            f"experts {other}",
            f"the config uses {config.experts_backend}",
            lambda: bench.training(experts_backend=other),
        )
    if "loss" in sections:
        chunk = max(1, bench.tokens // 4)
        bench.sequential(
            "variant",
            f"loss in chunks of {chunk} rows",
            "fused: each chunk's gradients taken in forward",
            lambda: bench.training(loss_chunk_size=chunk),
        )
        if bench.tokens > config.loss_chunk_size:
            bench.sequential(
                "variant",
                "loss in one chunk",
                "fused: gradients taken in forward",
                lambda: bench.training(loss_chunk_size=bench.tokens),
            )
        bench.sequential(
            "variant",
            "loss unchunked (logits + cross_entropy)",
            "all logits saved for backward",
            lambda: bench.training(dense_logits_loss),
        )


def attention_sweep(bench: Bench, lengths: list[int], tokens: int, reps: int) -> list[dict]:
    """One sliding and one full attention layer (projections + core), forward + backward, per
    length.

    Each point runs about `tokens` tokens (batch = tokens // length, at least 1) so that time per
    token compares across lengths: flat for a cost linear in length, rising for a quadratic one.
    The family's baselines build the layer (Flint's: flint_baselines.attention_layer_step).
    """
    try:
        layer_step_of = baseline(bench.config, "attention_layer_step")
    except NotApplicable as error:
        print(f"\nsweep skipped: {error}")
        return []
    backend = resolve_backend(bench.config.attention_backend, bench.device)
    if backend == "flex" and bench.device.type == "cpu":
        backend = "sdpa"  # flex has no CPU backward
    print("\none attention layer (projections + core), forward + backward, by sequence length:")
    print(
        f"  {'layer':<18} {'length':>7} {'batch':>6} {'ms':>10} {'us/token':>10} {'vs first':>9}",
        flush=True,
    )
    points = []
    for layer_type in (SLIDING, FULL):
        for seq_len in lengths:
            batch = max(1, tokens // seq_len)
            layer_step = layer_step_of(
                bench.config, layer_type, batch, seq_len, bench.device, bench.dtype, backend
            )
            layer_step()  # warm-up
            step = statistics.median([time_call(layer_step, bench.device) for _ in range(reps)])
            points.append(
                {
                    "layer": layer_type,
                    "seq_len": seq_len,
                    "batch": batch,
                    "ms": step * 1e3,
                    "us_per_token": step * 1e6 / (batch * seq_len),
                }
            )
            first = next(p for p in points if p["layer"] == layer_type)["us_per_token"]
            print(
                f"  {layer_type:<18} {seq_len:>7} {batch:>6} {step * 1e3:>10.1f} "
                f"{points[-1]['us_per_token']:>10.2f} "
                f"{points[-1]['us_per_token'] / first:>8.2f}x",
                flush=True,
            )
    print("  (us/token flat with length: cost linear in length; rising in proportion: quadratic)")
    return points


def baseline(config: ModelConfig, name: str) -> Callable:
    """The family's comparison `name` from tools/<family>_baselines.py (Flint's:
    flint_baselines.py), or NotApplicable (a skipped row) when the family has no such file."""
    module_name = f"tools.{config.family}_baselines"
    if importlib.util.find_spec(module_name) is None:
        raise NotApplicable(
            f"{type(config).__name__}'s family has no {name} to compare with "
            f"(tools/{config.family}_baselines.py)"
        )
    return getattr(importlib.import_module(module_name), name)


# ============================================================================= the run


def run(args: argparse.Namespace, cfg: TrainConfig, device: torch.device) -> dict:
    config, dtype = cfg.model_config, cfg.parallel.compute_dtype(device.type)
    batch, seq_len = cfg.training.batch_size, cfg.data.seq_len
    peak, peak_source = peak_flops(cfg, device)
    bench = Bench(cfg, device, dtype, args.warmup, args.reps, args.matmul_size, peak)
    sections = set(args.sections)
    print(
        f"{source_label(args, cfg)}: {model_family(cfg)}, batch {batch} x {seq_len} tokens, "
        f"{device_name(device)}, "
        f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, {args.warmup} "
        "warm-up + "
        f"{args.reps} timed steps per row (median); MFU against "
        f"{f'{peak / 1e12:.3f} TFLOP/s' if peak else 'the best matmul rate'} ({peak_source})"
    )
    compared = compare(bench, source_label(args, cfg), sections, args.profile)
    if not compared and sections & {"attention", "experts", "loss"}:
        print(table_header(), flush=True)
    variants(bench, sections)
    if not peak:
        peak = max(bench.rates or [bench.matmul_rate()])
        for row in bench.rows:
            if "error" not in row:
                row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak
    notes = []
    if any(row["name"] == "plain eager baseline" and "error" not in row for row in bench.rows):
        model, inputs = bench.model(), bench.inputs()  # the baseline must compute the same network
        with torch.no_grad():
            gap = abs(
                model_loss(model, *inputs).item()
                - baseline(config, "plain_eager_loss")(model, *inputs).item()
            )
        notes.append(
            f"baseline and {model_family(cfg)} losses agree to {gap:.2e} (same weights, same batch)"
        )
    result = {
        "config": source_label(args, cfg),
        "family": model_family(cfg),
        "hf_config": config.to_hf_config(),
        "batch": batch,
        "seq_len": seq_len,
        "device": device.type,
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "warmup": args.warmup,
        "reps": args.reps,
        "peak_flops": peak,
        "peak_source": peak_source,
        "flops_per_token": model_flops_per_token(config, seq_len),
        "rows": bench.rows,
        "alternated": [row["name"] for row in compared if "error" not in row],
        "ratios": ratios(bench.rows, model_family(cfg)),
        "notes": notes,
    }
    if "sweep" in sections:
        result["sweep"] = attention_sweep(
            bench, args.sweep_lengths, args.sweep_tokens, args.sweep_reps
        )
    print_summary(result)
    return result


def ratios(rows: list[dict], family: str) -> list[dict]:
    """How the compared rows stand, in tokens/s: the ratio of their median steps, and the median
    over rotations of each rotation's own ratio (the two steps taken moments apart: the figure least
    moved by a drifting machine). The eager and compiled steps against the plain baseline and the
    reference, and compiled against eager."""
    timed = {row["name"]: row for row in rows if "error" not in row}
    eager, compiled = (timed.get(f"{family} ({mode})") for mode in ("eager", "compiled per block"))
    baseline, reference = timed.get("plain eager baseline"), timed.get("transformers reference")
    result = []
    for row, other in (
        (eager, baseline),
        (compiled, baseline),
        (eager, reference),
        (compiled, eager),
    ):
        if row and other:
            per_rotation = [
                theirs / ours for ours, theirs in zip(row["step_s_all"], other["step_s_all"])
            ]
            result.append(
                {
                    "row": row["name"],
                    "vs": other["name"],
                    "of_medians": other["step_s"] / row["step_s"],
                    "median_per_rotation": statistics.median(per_rotation),
                    "per_rotation": per_rotation,
                }
            )
    return result


# ============================================================================= what is timed

# Flags that set a config key, and their values for a config built from --preset or a config.json.
FLAG_KEYS = {
    "batch": ("training", "batch_size", 4),
    "seq_len": ("data", "seq_len", 512),
    "device": ("training", "device", "cpu"),
    "dtype": ("parallel", "param_dtype", "auto"),
}


def chosen_family(overrides: list[str]) -> str:
    """The family a --model.family override names (its presets are the defaults), else the default
    one; a name no family has is left to the config's check, which names the flag."""
    named = [parse_override(o)[2] for o in overrides if o.startswith("--model.family=")]
    return named[-1] if named and named[-1] in FAMILIES else ModelSection().family


def load_bench_config(args: argparse.Namespace) -> TrainConfig:
    """The config to time, read and checked as train.py reads one: a training TOML, or tables built
    from --preset / a config.json; then the flags of FLAG_KEYS, then the --section.key=value
    overrides."""
    if args.config and args.config.suffix == ".toml":
        tables, path, origins = read_tables(args.config)
    else:
        named = any(
            o.split("=")[0] in ("--model.hf_config", "--model.init_from") for o in args.overrides
        )
        default = family(chosen_family(args.overrides))
        model = (
            {"hf_config": str(args.config)}
            if args.config
            else {"preset": args.preset or default.bench_preset or default.smallest_preset}
        )
        tables = {"model": {} if named and not args.config and not args.preset else model}
        path, origins = Path("bench.py"), {}  # errors call a default "bench.py (default)"
        if args.config or args.preset:
            origins[f"model.{next(iter(model))}"] = (
                f"command line --{'config' if args.config else 'preset'}"
            )
        for section, key, default in FLAG_KEYS.values():
            tables.setdefault(section, {})[key] = default
    for flag, (section, key, _) in FLAG_KEYS.items():
        if getattr(args, flag) is not None:
            tables.setdefault(section, {})[key] = getattr(args, flag)
            origins[f"{section}.{key}"] = f"command line --{flag.replace('_', '-')}"
    return config_from_tables(tables, path, origins, args.overrides)


def bench_device(cfg: TrainConfig) -> torch.device:
    """[training].device on one process: auto is the GPU when there is one. A layout of several
    processes, or cuda without a GPU, is a ConfigError naming where it was set."""
    choice = cfg.training.device
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{cfg.where('training.device')}: device cuda, but no GPU is available "
            "here; "
            f"use --device cpu"
        )
    try:
        cfg.parallel.resolve(1, cfg.model_config.num_experts)
    except ValueError as error:
        layout = [f"parallel.{key}" for key in ("pp", "dp_replicate", "dp_shard", "ep", "cp")]
        raise ConfigError(
            f"{cfg.where_any(layout)}: bench.py times one process on one device, but "
            f"{error}; "
            f"set the layout's degrees to 1 (memory.py sizes a layout without GPUs)"
        ) from error
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def source_label(args: argparse.Namespace, cfg: TrainConfig) -> str:
    """The label of the config's own row: where its model comes from."""
    if args.config:
        return f"config {args.config.name}"
    return (
        f"preset {cfg.model.preset}"
        if cfg.model.preset
        else f"config {cfg.model.hf_config or cfg.model.init_from}"
    )


def device_name(device: torch.device) -> str:
    return (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({os.cpu_count()} cores)"
    )


# ============================================================================= printing

LABEL_WIDTH, NAME_WIDTH = 22, 42


def table_header() -> str:
    columns = (
        f"{'step s':>7} {'tokens/s':>9} {'MFU %':>6} {'peak GiB':>8} {'warm-up s':>9} "
        f"{'mm TFLOP/s':>10}  note"
    )
    return f"{'label':<{LABEL_WIDTH}} {'row':<{NAME_WIDTH}} {columns}\n" + "-" * 150


def row_columns(row: dict) -> str:
    """A row's numbers, after its label and name (mm TFLOP/s: the matmul rate just before the row,
    or for the alternating rows the median of those measured before each rotation; a low one means
    the cores were busy)."""
    if "error" in row:
        status = "SKIPPED" if row["error"].startswith("skipped") else "FAILED"
        return f"{status}: {row['error'].removeprefix('skipped: ')}"
    mfu = f"{100 * row['mfu']:>6.2f}" if "mfu" in row else f"{'-':>6}"
    return (
        f"{row['step_s']:>7.3f} {row['tokens_per_s']:>9.0f} {mfu} "
        f"{row['peak_memory_gib']:>8.2f} "
        f"{row['warmup_s']:>9.1f} {row['matmul_flops'] / 1e12:>10.3f}  {row['note']}"
    )


def print_summary(result: dict) -> None:
    """After the rows: the table again when MFU was known only at the end, the split of the config's
    step, and how the compared rows stand."""
    if any("mfu" not in row for row in result["rows"] if "error" not in row):
        print(
            f"\nMFU against {result['peak_flops'] / 1e12:.3f} TFLOP/s, the best matmul rate of "
            "the run:"
        )
        print(table_header())
        for row in result["rows"]:
            print(f"{row['label']:<{LABEL_WIDTH}} {row['name']:<{NAME_WIDTH}} {row_columns(row)}")
    own = (
        result["rows"][0]
        if result["rows"] and result["rows"][0]["label"] == result["config"]
        else {}
    )
    if "split" in own:
        print(
            f"\nstep time split ({own['name']}, one profiled step, scaled to the median "
            f"{own['step_s']:.3f} s):"
        )
        # the model's own categories
        for category, fraction in filter(lambda item: item[1], own["split"].items()):
            print(f"  {category:<46} {100 * fraction:>6.1f} %  {fraction * own['step_s']:>7.3f} s")
    if result["ratios"]:
        print(
            f"\ntokens/s, {', '.join(result['alternated'])} alternating step by step "
            f"({result['reps']} rotations):"
        )
    for ratio in result["ratios"]:
        print(
            f"  {ratio['row']} vs {ratio['vs']}: {ratio['of_medians']:.2f}x of the median steps, "
            f"{ratio['median_per_rotation']:.2f}x the median of the per-rotation ratios"
        )
    compiled = next((row for row in result["rows"] if "graphs" in row and "error" not in row), None)
    if compiled:
        print(
            f"{compiled['name']}: {compiled['graphs']} graphs, {compiled['graph_breaks']} graph "
            "breaks, "
            f"compiled during the {compiled['warmup_s']:.1f} s warm-up"
        )
    for note in result["notes"]:
        print(note)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; the rest must be --section.key=value overrides (checked by load_bench_config)."""
    parser = OneLineParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--preset",
        help="a preset of the model family ([model].family; default: its "
        "bench preset, "
        "Flint's bench-cpu)",
    )
    shape.add_argument(
        "--config",
        type=Path,
        help="a training TOML, or a config.json or checkpoint directory holding one "
        "(its architecture)",
    )
    parser.add_argument(
        "--device", help="cpu | cuda | auto (default: the TOML's [training].device, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="bulk compute dtype (default: [parallel].param_dtype, auto: BF16 on GPUs, else FP32)",
    )
    parser.add_argument(
        "--batch", type=int, help="rows per step (default: [training].batch_size, else 4)"
    )
    parser.add_argument(
        "--seq-len", type=int, help="tokens per row (default: [data].seq_len, else 512)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps before timing, at least 1 (compiling happens here)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed steps per row (the compared rows alternate: rotations); the median is reported",
    )
    # replaced by alternation: named in its error
    parser.add_argument("--rounds", help=argparse.SUPPRESS)
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=list(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--sweep-lengths",
        type=sweep_lengths,
        default=[512, 1024, 2048, 4096, 8192],
        help="comma-separated sequence lengths of the sweep",
    )
    parser.add_argument(
        "--sweep-tokens",
        type=int,
        default=4096,
        help="tokens per sweep point (at least one sequence)",
    )
    parser.add_argument(
        "--sweep-reps", type=int, default=2, help="timed calls per sweep point, after one warm-up"
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads for torch (default: torch's choice)"
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=1024,
        help="square matmul that measures the machine's rate",
    )
    parser.add_argument(
        "--profile",
        type=non_negative,
        default=0,
        metavar="N",
        help="also print the torch.profiler table of the main step, top N ops",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: the family's smallest preset (unless --preset/--config), "
        "batch 2 x 64 "
        "(unless given), 1 rep, 1 thread, no compiled section, short sweep",
    )
    args, args.overrides = parser.parse_known_args(argv)
    if args.quick:
        args.preset = args.preset or (
            None if args.config else family(chosen_family(args.overrides)).smallest_preset
        )
        args.batch, args.seq_len = args.batch or 2, args.seq_len or 64
        args.warmup, args.reps, args.sweep_reps, args.matmul_size = 1, 1, 1, 256
        # Tiny ops gain nothing from threads, and on busy cores each thread barrier waits for a
        # core.
        args.threads = args.threads or 1
        args.sections = [s for s in args.sections if s != "compiled"]
        args.sweep_lengths, args.sweep_tokens = [64, 128], 128
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"--sections: unknown section {unknown[0]!r}; choose from {','.join(SECTIONS)}"
        )
    if args.rounds is not None:
        raise ConfigError(
            "--rounds was removed: the compared rows (main, compiled, baseline, "
            "reference) now "
            "alternate step by step; --reps sets the number of rotations"
        )
    for flag in ("reps", "sweep_tokens", "sweep_reps", "matmul_size", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.warmup < 1:  # the warm-up compiles, and its steps give a row's peak memory
        raise ConfigError(f"--warmup must be >= 1, got {args.warmup}")
    check_json_target(args.json)
    return args


def sweep_lengths(text: str) -> list[int]:
    """--sweep-lengths: comma-separated sequence lengths, each >= 1."""
    return [positive(length) for length in text.split(",")]


def check_json_target(path: Path | None) -> None:
    """--json is written after minutes of timing: a path that cannot take the file is refused
    first."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"--json {path} is a directory, expected a file name")
    if not path.parent.is_dir():
        raise ConfigError(f"--json {path}: its directory {path.parent} does not exist")


def main(argv: list[str] | None = None) -> dict:
    """Every mistake in the flags, config or overrides is a ConfigError before any timing."""
    args = parse_args(argv)
    cfg = load_bench_config(args)
    device = bench_device(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        with warnings.catch_warnings():
            # Eager flex on the CPU is what the attention comparison measures, on purpose.
            warnings.filterwarnings(
                "ignore", message=".*flex_attention called without torch.compile"
            )
            result = run(args, cfg, device)
    finally:
        torch.set_num_threads(threads)  # main() may run inside another process, such as a test
    if args.json:
        write_atomically(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
