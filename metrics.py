"""What a person sees of a training run: one line per logging step and the same numbers in a JSON
file (metrics.jsonl), with tokens/s and model FLOPs utilisation against the hardware's peak; at the
end, report.py's page of plots in the run directory; for the steps [logging] profile_steps names, a
torch.profiler trace per rank with named ranges (and on CUDA a memory snapshot, also written when a
step runs out of memory).

train.py writes through MetricsLogger; tools/bench.py divides by the same peak (run_peak_flops). On
the CPU the peak is the machine's FP32 matmul rate, measured once and cached, so MFU does not move
with whatever else ran during one measurement."""

from __future__ import annotations

import json
import os
import platform
import resource
import secrets
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import moe
from balance import worst_layer
from config import TrainConfig, profile_step_range
from files import read_json_object, write_atomically
from head import Head
from parallel import ParallelModel, Process, barrier
from registry import ModelConfig, family_of, model_class
from report import note_run, write_report

# Dense BF16 tensor-core peaks in TFLOP/s, by a part of the device name (first match wins).
GPU_PEAK_TFLOPS = [
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
]


def run_peak_flops(cfg: TrainConfig, run: Process) -> float | None:
    """FLOP/s of all the run's hardware: the config's per-device value or a GPU's table entry times
    the processes (one per device), or on the CPU the machine's cached matmul rate times the
    machines: processes on one machine share its cores, so their peak is not multiplied."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops * 1e12 * run.world_size
    if run.device.type == "cuda":
        name = torch.cuda.get_device_name(run.device)
        gpu = next((tflops * 1e12 for key, tflops in GPU_PEAK_TFLOPS if key in name), None)
        return gpu * run.world_size if gpu else None
    machines = max(1, run.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", run.world_size)))
    return cpu_peak_flops(run) * machines


# The CPU's FP32 matmul rate, measured once per machine (CPU model and core count) and kept here, so
# MFU does not move with whatever else ran during a measurement. Delete the file to measure again.
CPU_PEAK_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flint" / "cpu_peak.json"
)


def cpu_peak_flops(run: Process) -> float:
    """This machine's entry of CPU_PEAK_CACHE, measured by rank 0 if missing (others wait)."""
    key = f"{cpu_model()} x {os.cpu_count()} cores"
    if run.is_main and key not in read_peak_cache():
        cache = {**read_peak_cache(), key: measure_cpu_flops()}
        write_atomically(CPU_PEAK_CACHE, json.dumps(cache, indent=1))
        run.print(
            f"measured this CPU's FP32 matmul rate once: {cache[key] / 1e12:.3f} TFLOP/s, "
            "kept in "
            f"{CPU_PEAK_CACHE} for MFU (delete it to measure again, or set "
            "logging.peak_tflops)"
        )
    barrier()
    return read_peak_cache()[key]


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """The whole model's training FLOPs per token, counted on the meta device (shapes only)."""
    with torch.device("meta"):
        return model_class(config)(config).flops_per_token(seq_len)


def read_peak_cache() -> dict:
    """The cached matmul rates by CPU; a missing or damaged cache is empty (measured again)."""
    try:
        return read_json_object(CPU_PEAK_CACHE) if CPU_PEAK_CACHE.exists() else {}
    except ValueError:
        return {}


def cpu_model() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure_cpu_flops(size: int = 2048) -> float:
    """Best of 5 products of two size x size FP32 matrices on every core (about a second)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(6):  # the first one warms up
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * size**3 / best


PROC_STATUS, PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def interval_peak_gib(run: Process) -> float:
    """This rank's peak memory since the previous call, then the peak starts again from what is in
    use now: so each logged step shows its interval's peak, and a profiled step's spike stays in its
    own interval. On the GPU the allocator's peak of allocated bytes; on the CPU the resident set's
    high-water mark (Linux: VmHWM, reset by writing 5 to clear_refs). Where the system keeps no
    resettable mark, the process's lifetime maximum resident set."""
    if run.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
        return peak / 2**30
    high_water = resident_high_water_kib()
    if high_water is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    try:
        PROC_CLEAR_REFS.write_text("5")
    except OSError:
        pass  # the mark then runs on from the start: still a peak, over a longer span
    return high_water / 2**20


def resident_high_water_kib() -> int | None:
    """VmHWM from /proc/self/status in KiB, or None where there is no such file or field."""
    try:
        lines = PROC_STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def steps_to_profile(text: str, start_step: int) -> tuple[range | None, str | None]:
    """[logging] profile_steps of a run that trains from step start_step + 1 -> (the named steps it
    trains, what it cannot profile: named steps that were trained before a resume, else None)."""
    steps = profile_step_range(text)
    if not steps or steps[0] > start_step:
        return steps, None
    left = range(start_step + 1, steps[-1] + 1)
    named = f"profile_steps = {text!r} names steps {steps[0]}-{steps[-1]}"
    if not left:
        return None, (
            f"{named}, all trained before this run resumed at step {start_step}: none "
            f"is profiled; name steps after {start_step}"
        )
    return left, (
        f"{named}, of which {steps[0]}-{start_step} were trained before this run resumed "
        f"at step {start_step}: profiling steps {left[0]}-{left[-1]} only"
    )


class MetricsLogger:
    """A plain line per logging step (readable in a log file: no carriage returns), and the same
    numbers as one JSON object per line in logging.jsonl."""

    def __init__(
        self, cfg: TrainConfig, run: Process, config: ModelConfig, start_step: int, run_dir: Path
    ):
        t = cfg.training
        self.cfg, self.run, self.total = cfg, run, t.steps
        self.tokens_per_step = t.batch_size * t.grad_accum * cfg.data.seq_len * run.dp_size
        # whichever stages this rank holds
        self.flops_per_token = model_flops_per_token(config, cfg.data.seq_len)
        self.peak = run_peak_flops(cfg, run)
        self.start = self.last_time = time.perf_counter()
        self.last_step = start_step
        self.first_step = start_step + 1  # always logged: the loss before any learning
        self.summary: dict = {"first_loss": None}
        self.path, self.run_name, self.run_dir = (
            Path(cfg.logging.jsonl),
            str(run_dir),
            Path(run_dir),
        )
        self.profile_steps, late = steps_to_profile(cfg.logging.profile_steps, start_step)
        self.profiler = None
        self.interval_loss = self.interval_tokens = 0.0  # add_loss's sums since the last log
        self.trackers = Trackers(cfg, self.run_dir, start_step) if run.is_main else None
        if late:
            run.print(f"WARNING: {cfg.where('logging.profile_steps')}: {late}")
        if run.is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            drop_superseded_records(self.path, self.run_name, start_step)
            # where report.py finds the records
            note_run(self.run_dir, self.path, self.run_name, cfg.to_dict())
            run.print(
                f"training steps {start_step + 1}..{t.steps}: {self.tokens_per_step:,} tokens "
                "per step, "
                f"{self.flops_per_token / 1e6:.2f} MFLOPs per token, peak "
                + (
                    f"{self.peak / 1e12:.2f} TFLOP/s"
                    if self.peak
                    else "unknown (set logging.peak_tflops)"
                )
            )

    def add_loss(self, loss: float, target_tokens: float) -> None:
        """A step's mean loss per target token and its target tokens (or a fixed multiple)."""
        self.interval_loss += loss * target_tokens
        self.interval_tokens += target_tokens

    def log_train(
        self,
        step: int,
        lr: float,
        grad_norm: float,
        routing: dict,
        data_tokens: dict[str, int] | None = None,
    ) -> None:
        """The record's loss is the mean per target token over the steps since the last logged one
        (add_loss), so a curve of few points is as smooth as the run; the other numbers are the
        logged step's own, tokens/s and MFU over the interval. `data_tokens`: a mixture's tokens
        from each source."""
        loss = self.interval_loss / max(self.interval_tokens, 1e-9)
        self.interval_loss = self.interval_tokens = 0.0
        now = time.perf_counter()
        tokens_per_s = (
            (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        )
        remaining = (self.total - step) * (now - self.last_time) / max(step - self.last_step, 1)
        self.last_time, self.last_step = now, step
        mfu = 100 * tokens_per_s * self.flops_per_token / self.peak if self.peak else None
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu_percent": mfu,
            "memory_gib": interval_peak_gib(self.run),
            "elapsed_s": now - self.start,
            "remaining_s": remaining,
            "tokens": step * self.tokens_per_step,
            "routing": routing,
        }
        if data_tokens is not None:
            record["data_tokens"] = data_tokens
        if self.summary["first_loss"] is None:
            self.summary["first_loss"] = loss
        self.summary.update(step=step, loss=loss, tokens_per_s=tokens_per_s, mfu_percent=mfu)
        self.write(record)
        self.run.print(
            f"step {step:>{len(str(self.total))}}/{self.total} | loss {loss:.4f} | lr "
            f"{lr:.2e} | "
            f"grad norm {grad_norm:.3f} | {tokens_per_s:,.0f} tokens/s | MFU "
            f"{f'{mfu:.2f}%' if mfu is not None else 'n/a'} | mem "
            f"{record['memory_gib']:.2f} GiB | "
            f"{duration(now - self.start)} elapsed | {duration(remaining)} left"
            f"{worst_layer(routing)}{drawn_per_source(data_tokens)}"
        )

    def log_eval(self, step: int, val_loss: float) -> None:
        self.summary["val_loss"] = val_loss
        self.write({"step": step, "val_loss": val_loss})
        self.run.print(
            f"step {step:>{len(str(self.total))}}/{self.total} | validation loss {val_loss:.4f}"
        )

    def write(self, record: dict) -> None:
        if self.run.is_main:
            with open(self.path, "a") as log:
                log.write(json.dumps({"run": self.run_name, **record}) + "\n")
            self.trackers.log(record["step"], tracker_scalars(record))

    def close(self) -> None:
        """Closes TensorBoard's and W&B's files (train.py, however the run ends)."""
        if self.trackers:
            self.trackers.close()

    @contextmanager
    def untimed(self):
        """Time spent inside is left out of tokens/s and the remaining-time estimate."""
        start = time.perf_counter()
        yield
        self.last_time += time.perf_counter() - start

    def write_report(self) -> None:
        """report.py's page of this run, in its directory (rank 0); a failure is reported, never
        fatal: the checkpoints are written."""
        if not self.run.is_main:
            return
        try:
            self.run.print(f"report: {write_report([self.run_dir])}")
        except (OSError, ValueError) as error:
            print(
                f"WARNING: the report of {self.run_dir} failed: {error}",
                file=sys.stderr,
                flush=True,
            )

    @contextmanager
    def traced(self, step: int, model: ParallelModel, optimizer: torch.optim.Optimizer):
        """Around a training step: the steps of [logging] profile_steps run under torch.profiler
        with named ranges (on CUDA recording the allocator's history too), written out after the
        last of them; on CUDA a step that runs out of memory ends the process with the allocator's
        snapshot."""
        if self.profile_steps and step in self.profile_steps and self.profiler is None:
            self.start_profiler(model, optimizer)
        try:
            with record_function(f"step {step}") if self.profiler else nullcontext():
                yield
        except torch.OutOfMemoryError as error:
            if self.run.device.type != "cuda":
                raise
            self.exit_with_memory_snapshot(step, error)
        if self.profiler and step == self.profile_steps[-1]:
            with self.untimed():
                self.write_traces()

    def start_profiler(self, model: ParallelModel, optimizer: torch.optim.Optimizer) -> None:
        self.ranges = ExitStack()
        self.ranges.enter_context(named_ranges(model, optimizer))
        cuda = self.run.device.type == "cuda"
        self.profiler = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            record_shapes=True,
        )
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler.start()

    def write_traces(self) -> None:
        """This rank's trace (and on CUDA its memory snapshot) of the profiled steps, in the run
        directory."""
        steps = self.profile_steps
        name = f"steps{steps[0]}-{steps[-1]}"
        self.profiler.stop()
        self.ranges.close()
        self.profiler.export_chrome_trace(
            str(self.run_dir / f"trace_{name}_rank{self.run.rank}.json")
        )
        memory = ""
        if self.run.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(
                str(self.run_dir / f"memory_{name}_rank{self.run.rank}.pickle")
            )
            torch.cuda.memory._record_memory_history(enabled=None)
            snapshots = f"{self.run_dir}/memory_{name}_rank*.pickle"
            memory = f"; memory snapshots {snapshots} (https://pytorch.org/memory_viz)"
        self.run.print(
            f"profiled steps {steps[0]}-{steps[-1]}: traces "
            f"{self.run_dir}/trace_{name}_rank*.json, one "
            f"per rank (open in https://ui.perfetto.dev){memory}"
        )
        self.profiler = None

    def exit_with_memory_snapshot(self, step: int, error: torch.OutOfMemoryError):
        """One line naming the allocator's snapshot at the failure: every segment and block with its
        size, and the stacks that allocated them when the allocator's history was on (profiled
        steps)."""
        path = self.run_dir / f"memory_oom_step{step}_rank{self.run.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        raise SystemExit(
            f"step {step}: rank {self.run.rank} ran out of GPU memory ({reason}); the "
            "allocator's "
            f"snapshot is {path} (open it in https://pytorch.org/memory_viz)"
        ) from error


# metrics.jsonl's fields -> the trackers' scalar names, grouped as TensorBoard and W&B show them.
TRACKED = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu_percent": "perf/mfu_percent",
    "memory_gib": "perf/memory_gib",
}
EXPERT_LOADS = ("max_load", "min_load", "dropped")  # per MoE layer, of balance.RoutingMonitor.stats


def tracker_scalars(record: dict) -> dict[str, float]:
    """One metrics.jsonl record -> its scalars under TRACKED's names, and each MoE layer's busiest
    and idlest expert's load over the mean (and the assignments dropped) as experts/layer N/..."""
    scalars = {
        TRACKED[key]: value for key, value in record.items() if key in TRACKED and value is not None
    }
    for layer, stats in record.get("routing", {}).items():
        loads = {key: stats[key] for key in EXPERT_LOADS if key in stats}
        scalars.update({f"experts/layer {layer}/{key}": value for key, value in loads.items()})
    return scalars


class Trackers:
    """TensorBoard and W&B ([logging] tensorboard, wandb), written by rank 0 with metrics.jsonl:
    the same scalars at the same steps. Their packages are optional extras, imported only here and
    only when asked for (config.py checks at load that they import). A resumed run continues the
    same curves: TensorBoard's directory is the run's, its events past the resumed step dropped
    (purge_step); W&B's run id is kept in the run directory and the run resumed."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, start_step: int):
        self.tensorboard = self.wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            directory = str(run_dir / "tensorboard")
            self.tensorboard = SummaryWriter(directory, purge_step=start_step + 1)
        if cfg.logging.wandb:
            self.wandb = start_wandb(cfg, run_dir)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """A logged step's scalars, on disk when this returns (TensorBoard; W&B writes a step's
        row once the next step or the end comes, so that a validation loss joins its step's row)."""
        if self.tensorboard:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        self.tensorboard = self.wandb = None


# The W&B run id of a run directory: a resumed run logs to the same W&B run.
WANDB_ID_FILE = "wandb_id"


def start_wandb(cfg: TrainConfig, run_dir: Path):
    """wandb.init with [logging] wandb's settings (files under `dir`, default the run directory),
    the run's resolved config, and the run directory's W&B id, made on first use."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
    write_atomically(id_file, run_id)
    settings = {"dir": str(run_dir), **cfg.logging.wandb}
    Path(settings["dir"]).mkdir(parents=True, exist_ok=True)
    return wandb.init(**settings, id=run_id, resume="allow", config=cfg.to_dict())


# Allocations and frees the CUDA allocator remembers while profiling: a few steps of a large model.
MEMORY_HISTORY_ENTRIES = 1_000_000


def named_modules(config: ModelConfig) -> list[tuple[type, str]]:
    """The module kinds a trace names, the model's family's own (registry.Family.timed_modules)
    first."""
    return [
        *family_of(config).timed_modules,
        (moe.Router, "router"),
        (moe.GroupedExperts, "routed experts"),
        (moe.ExpertParallelExperts, "routed experts (expert parallel)"),
        (moe.SwiGLU, "dense MLP or shared expert"),
        (Head, "head and loss"),
    ]


# Functions of moe.py named in a trace: wrapped while profiling eager blocks only (a compiled
# block's code is fixed, and dynamo ignores profiler ranges inside a graph: its kernels carry their
# own names).
NAMED_FUNCTIONS = [
    (moe, "dispatch", "expert dispatch"),
    (moe, "combine", "expert combine"),
    (moe, "grouped_mm", "grouped GEMM"),
    (moe, "batched_swiglu", "expert GEMMs (capacity buffer)"),
    (moe.ExpertParallelExperts, "send_rows", "all-to-all: rows to their experts"),
    (moe.ExpertParallelExperts, "return_rows", "all-to-all: rows back"),
]


def in_range(name: str, fn):
    def ranged(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return ranged


def is_compiled(module: torch.nn.Module) -> bool:
    """parallel.apply_compile replaces a block's (and the head's) forward with a compiled one."""
    return "forward" in vars(module)


@contextmanager
def named_ranges(model: ParallelModel, optimizer: torch.optim.Optimizer):
    """Profiler ranges, placed from outside the model while profiling: each micro-batch's forward
    and backward, each decoder layer's forward and backward, the module kinds of named_modules and
    the functions of NAMED_FUNCTIONS (inside eager blocks only), gradient clipping and the
    optimizer. Collectives are named by torch."""
    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(
                model, "forward_backward", in_range("forward and backward", model.forward_backward)
            )
        )
        stack.enter_context(
            mock.patch.object(
                model, "clip_grad_norm_", in_range("gradient clipping", model.clip_grad_norm_)
            )
        )
        ends = []
        handles = [
            optimizer.register_step_pre_hook(
                lambda *_: ends.append(record_function("optimizer").__enter__())
            ),
            optimizer.register_step_post_hook(lambda *_: ends.pop().__exit__(None, None, None)),
        ]
        stack.callback(lambda: [handle.remove() for handle in handles])
        compiled = [m for m in model.module.modules() if is_compiled(m)]
        inside_compiled = {id(m) for c in compiled for m in c.modules() if m is not c}
        layers, kinds = (
            {id(layer) for layer in model.module.layers.values()},
            named_modules(model.config),
        )
        for name, module in model.module.named_modules():
            kind = next((label for cls, label in kinds if isinstance(module, cls)), None)
            if id(module) in layers:
                kind = f"layer {name.rsplit('.', 1)[-1]}"
                handles += backward_range(module, f"{kind} backward")
            if kind and id(module) not in inside_compiled:
                handles += module_range(module, kind, ends)
        if not compiled:
            for owner, attribute, label in NAMED_FUNCTIONS:
                stack.enter_context(
                    mock.patch.object(owner, attribute, in_range(label, getattr(owner, attribute)))
                )
        yield


def module_range(module: torch.nn.Module, label: str, ends: list) -> list:
    """A range named `label` around each forward of `module` (recomputed forwards included)."""

    def enter(*_):
        ends.append(record_function(label).__enter__())

    def leave(*_):
        ends.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def backward_range(layer: torch.nn.Module, label: str) -> list:
    """A range named `label` around each backward of `layer`: from the backward of its last op
    starting to its input's gradient complete (hooks placed by each forward; not by a recomputing
    forward, which runs inside the range already). The start is a hook on the last op's node, not
    on the output tensor: a node's hooks run after its tensors', so the next layer's range, ending
    on that same tensor, closes before this one opens. A layer whose input or output takes no
    gradient (a frozen first layer's input) gets none."""

    def place(_, inputs: tuple, output) -> None:
        first_input = first_tensor_with_grad(inputs)
        first_output = first_tensor_with_grad(output if isinstance(output, tuple) else (output,))
        if first_input is None or first_output is None or first_output.grad_fn is None:
            return
        if moe.in_recompute():
            return
        open_range = []
        first_output.grad_fn.register_prehook(
            lambda *_: open_range.append(record_function(label).__enter__())
        )
        first_input.register_hook(
            lambda _: open_range.pop().__exit__(None, None, None) if open_range else None
        )

    return [layer.register_forward_hook(place)]


def first_tensor_with_grad(values: tuple) -> torch.Tensor | None:
    return next((v for v in values if isinstance(v, torch.Tensor) and v.requires_grad), None)


def drop_superseded_records(path: Path, run_name: str, step: int) -> None:
    """Records are appended, one file for any number of runs, each record naming its run directory.
    A run that continues its own directory from `step` drops that directory's records of later steps
    (logged past the checkpoint it resumes from, and trained again now) so that no step of a run
    appears twice; a half-written line (a crash) is dropped too. Every other run's records stay."""
    if not path.exists():
        return
    kept, dropped = [], False
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            superseded = record.get("run") == run_name and record["step"] > step
        except (ValueError, TypeError, KeyError, AttributeError):
            superseded = True  # not a record
        dropped |= superseded
        if not superseded:
            kept.append(line + "\n")
    if dropped:
        write_atomically(path, "".join(kept))


def drawn_per_source(data_tokens: dict[str, int] | None) -> str:
    """ " | drawn: web/ 3,328 tokens, code/ 768 tokens" for a mixture's log line; "" for one
    source."""
    if not data_tokens:
        return ""
    return " | drawn: " + ", ".join(f"{n} {v:,} tokens" for n, v in data_tokens.items())
