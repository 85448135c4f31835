"""How fast Flint trains, side by side, and where the step time goes.

    python bench.py                              # the CPU shape (preset bench-cpu), every comparison
    python bench.py --quick --json out.json      # a seconds-long smoke run on the tiny preset
    python bench.py --sections main --profile 25 # one step's torch.profiler table, top 25 ops

One H100/H200 (preset flint-shallow: released widths, head counts and 256 experts, top-6, the
first 6 layers of the released schedule; MFU against the device's dense BF16 peak):

    python bench.py --preset flint-shallow --device cuda --dtype bfloat16 --batch 2 --seq-len 4096 \
        --json flint-shallow-h200.json

Every row times whole training steps as train.py takes them (forward, backward, gradient clipping,
AdamW from train.build_optimizer) after warm-up, and reports the median of several repetitions.
MFU divides the model's FLOPs (`Flint.flops_per_token`) per second by a peak: on the CPU the best
matmul rate measured in this run (measured again before every row, and shown, so a row timed while
other processes held the cores stands out), on a GPU the dense BF16 peak from a table. Peak memory
is the peak RSS of this process on the CPU (reset per row through /proc/self/clear_refs) and
`max_memory_allocated` on a GPU. A row that cannot run (out of memory, say) is shown as FAILED with
its error and the run goes on. Timings on shared cores are noisy: compare rows of one run.
"""

from __future__ import annotations

import os

# As in train.py: idle OpenMP threads sleep instead of spinning, so a busy neighbour on the cores
# slows a step down instead of stalling every op. Set before torch starts OpenMP; yours wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import gc
import json
import resource
import statistics
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from attention import FULL, SLIDING, build_masks, resolve_backend
from baselines import plain_eager_loss, transformers_loss, transformers_reference
from config import OptimSection
from model import Attention, Flint, FlintConfig, Head, Sinks, build_model, rope_tables
from moe import GroupedExperts, Router, SwiGLU
from parallel import apply_compile
from train import GPU_PEAK_TFLOPS, build_optimizer

SECTIONS = ("main", "compiled", "baseline", "reference", "attention", "experts", "loss", "sweep")


# ============================================================================= measuring

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], warmup: int, reps: int, device: torch.device) -> tuple[list[float], float]:
    """Seconds of each of `reps` calls after `warmup` calls, and the seconds the warm-up took."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    synchronize(device)
    warmup_seconds = time.perf_counter() - start
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds, warmup_seconds


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or Linux's peak RSS of this process."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    with suppress(OSError):  # Linux: writing 5 resets the peak RSS getrusage reports (elsewhere: process-wide)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The best FLOP/s of a square matmul right now: what this machine can do at this moment."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    seconds, _ = time_calls(lambda: a @ b, warmup=2, reps=10, device=device)
    return 2 * size**3 / min(seconds)


def peak_flops(device: torch.device, dtype: torch.dtype, measured: list[float]) -> tuple[float, str]:
    """FLOP/s to divide by for MFU, and where the number comes from.

    On the CPU: the best matmul rate measured in this run (it is measured before every row, so a
    row timed while other processes held the cores shows up as a low rate next to it).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = next((tflops * 1e12 for key, tflops in GPU_PEAK_TFLOPS if key in name), None)
        if table:
            return table, f"dense BF16 peak of {name} (train.GPU_PEAK_TFLOPS)"
        return max(measured), f"best {str(dtype).removeprefix('torch.')} matmul rate measured in this run ({name} is not in the table)"
    return max(measured), f"best {str(dtype).removeprefix('torch.')} matmul rate measured in this run, {torch.get_num_threads()} threads"


# ============================================================================= the step and the split

def flint_loss(model: Flint, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids, targets)


def dense_logits_loss(model: Flint, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """All FP32 logits at once, then one cross-entropy: the unchunked loss."""
    logits = model(input_ids)  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def training_step(model: Flint, input_ids: torch.Tensor, targets: torch.Tensor,
                  loss_fn: Callable) -> Callable[[], None]:
    """train.py's step on one micro-batch: loss, backward, clip the gradient norm, AdamW."""
    optim = OptimSection()
    optimizer = build_optimizer(model, optim, input_ids.device)

    def step() -> None:
        loss_fn(model, input_ids, targets).backward()
        with record_function(RANGE + OPTIMIZER):
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


# Each timed module opens a profiler range named RANGE + category around its forward; its backward
# is found through the autograd sequence numbers of the ops it ran. Innermost range wins.
RANGE = "bench/"
TIMED_MODULES = ((Sinks, "attention core"), (Attention, "attention proj/norm/rope"), (Router, "router"),
                 (GroupedExperts, "routed experts"), (SwiGLU, "dense MLP + shared expert"),
                 (Head, "head + loss"))
OPTIMIZER = "optimizer (clip + AdamW)"
OTHER = "other (embedding, norms, residuals, overhead)"
SPLIT_ORDER = [name for _, name in TIMED_MODULES] + [OPTIMIZER, OTHER]


@contextmanager
def module_ranges(model: torch.nn.Module):
    """Profiler ranges around the timed modules' forwards, placed from outside with hooks."""
    handles, open_ranges = [], []

    def opener(category: str):
        def pre_hook(module, args):
            open_ranges.append(record_function(RANGE + category).__enter__())
        return pre_hook

    def close(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        category = next((name for cls, name in TIMED_MODULES if type(module) is cls), None)
        if category is not None:
            handles.append(module.register_forward_pre_hook(opener(category)))
            handles.append(module.register_forward_hook(close))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def split_step(events, step_seconds: float, device: torch.device) -> dict[str, float]:
    """Attribute one profiled step's time to categories -> {category: fraction of the step}.

    Forward ops belong to the innermost timed module around them. A backward op
    (`autograd::engine::evaluate_function: ...`) carries the sequence number of the forward op
    that created its autograd node, so it goes to that op's module. On a GPU, device time is used.
    """
    def above(event) -> list[str]:  # names of the events around this one, innermost first
        names, parent = [], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        return names

    def module_of(names: list[str]) -> str | None:
        return next((name[len(RANGE):] for name in names if name.startswith(RANGE)), None)

    module_of_node = {}
    for event in events:
        module = module_of(above(event)) if event.sequence_nr >= 0 else None
        if module is not None:
            module_of_node[(event.thread, event.sequence_nr)] = module
    seconds = defaultdict(float)
    for event in events:
        names = above(event)
        if event.name.startswith(RANGE) or not all(name.startswith(RANGE) for name in names):
            continue  # only outermost ops are timed, so nothing counts twice
        if event.name.startswith("autograd::engine::evaluate_function"):
            category = module_of_node.get((event.fwd_thread, event.sequence_nr), OTHER)
        else:
            category = module_of(names) or OTHER
        micros = event.device_time_total if device.type == "cuda" else event.time_range.elapsed_us()
        seconds[category] += micros / 1e6
    seconds[OTHER] += max(step_seconds - sum(seconds.values()), 0.0)  # Python and framework time
    total = sum(seconds.values())
    return {name: seconds[name] / total for name in SPLIT_ORDER}


def profile_step(model: Flint, step: Callable[[], None], device: torch.device, table_rows: int) -> dict[str, float]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with module_ranges(model), profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        synchronize(device)
        step_seconds = time.perf_counter() - start
    if table_rows:
        sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=table_rows))
    return split_step(prof.events(), step_seconds, device)


# ============================================================================= graph counts

def compiled_graph_counts() -> dict[str, int]:
    """Graphs dynamo compiled and graph breaks it met since the counters were last cleared."""
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


# ============================================================================= rows of the table

@dataclasses.dataclass
class Bench:
    """What every row shares: the shape, the device, the repetitions, and the rows so far."""

    config: FlintConfig
    batch: int
    seq_len: int
    device: torch.device
    dtype: torch.dtype
    warmup: int
    reps: int
    matmul_size: int
    rows: list[dict] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=generator)
        ids = ids.to(self.device)
        return ids[:, :-1], ids[:, 1:]  # inputs and next-token targets, [B, T] each

    def model(self, **overrides) -> Flint:
        return build_model(dataclasses.replace(self.config, **overrides), self.device, self.dtype, seed=0)

    def measure_row(self, name: str, note: str, measure: Callable[[], dict]) -> dict:
        """Measure the machine's matmul rate, start a new memory peak, then time the row.

        A row that cannot run here (out of memory, an op this device lacks) is recorded with its
        error and shown in the table, so the other rows of a long run still come back.
        """
        print(f"  timing {name} ...", flush=True)
        row = {"name": name, "note": note, "matmul_flops": matmul_rate(self.device, self.dtype, self.matmul_size)}
        reset_peak_memory(self.device)
        try:
            timed = measure()
        except ImportError as error:  # an optional row (transformers): shown as skipped
            row["error"] = f"skipped: {error}"
            print(f"  {name} skipped: {error}", flush=True)
        except Exception as error:  # reported in the table and the JSON, never dropped
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
            print(f"  {name} failed: {row['error']}", flush=True)
        else:
            step = statistics.median(timed["step_s_all"])
            row.update(timed, step_s=step, tokens_per_s=self.tokens / step,
                       peak_memory_gib=peak_memory_gib(self.device))
        self.rows.append(row)
        return row

    def train(self, name: str, note: str, loss_fn: Callable = flint_loss, compile_blocks: bool = False,
              split_rows: int | None = None, **overrides) -> dict:
        """Time training steps of a fresh model built with `overrides`; optionally split one step."""
        def measure() -> dict:
            model = self.model(**overrides)
            if compile_blocks:
                torch._dynamo.reset()  # compile afresh: every round counts and times its own compilation
                apply_compile(model)  # fullgraph: a graph break fails the row
            step = training_step(model, *self.inputs(), loss_fn)
            torch._dynamo.utils.counters.clear()
            seconds, warmup_seconds = time_calls(step, self.warmup, self.reps, self.device)
            timed = {"step_s_all": seconds, "warmup_s": warmup_seconds,
                     "flops_per_token": model.flops_per_token(self.seq_len)}
            if compile_blocks:
                timed.update(compiled_graph_counts())
            if split_rows is not None:
                timed["split"] = profile_step(model, step, self.device, split_rows)
            return timed
        return self.measure_row(name, note, measure)

    def reference(self, name: str, note: str) -> dict:
        """Time training steps of transformers' FlintForCausalLM on this shape's weights (baselines.py);
        a skipped row when transformers cannot be imported."""
        def measure() -> dict:
            model = transformers_reference(self.model())
            step = training_step(model, *self.inputs(), transformers_loss)
            seconds, warmup_seconds = time_calls(step, self.warmup, self.reps, self.device)
            return {"step_s_all": seconds, "warmup_s": warmup_seconds,
                    "flops_per_token": flops_per_token(self.config, self.seq_len)}
        return self.measure_row(name, note, measure)

    def forward(self, name: str, note: str, **overrides) -> dict:
        """Time forwards without autograd (the only mode of flex attention on the CPU)."""
        def measure() -> dict:
            model = self.model(**overrides)
            input_ids, _ = self.inputs()
            with torch.no_grad():
                seconds, warmup_seconds = time_calls(lambda: model(input_ids), self.warmup, self.reps, self.device)
            return {"step_s_all": seconds, "warmup_s": warmup_seconds,
                    "flops_per_token": model.flops_per_token(self.seq_len) / 3}  # forward: a third
        return self.measure_row(name, note, measure)


def attention_sweep(bench: Bench, lengths: list[int], tokens: int, reps: int) -> list[dict]:
    """One sliding and one full attention layer (projections + core), forward + backward, per length.

    Each point runs about `tokens` tokens (batch = tokens // length, at least 1) so that time per
    token compares across lengths: flat for a cost linear in length, rising for a quadratic one.
    """
    backend = resolve_backend(bench.config.attention_backend, bench.device)
    if backend == "flex" and bench.device.type == "cpu":
        backend = "sdpa"  # flex has no CPU backward
    points = []
    for layer_type in (SLIDING, FULL):
        one_layer = dataclasses.replace(bench.config, num_hidden_layers=1, layer_types=[layer_type],
                                        schedule_num_hidden_layers=None, no_rope_layer_indices=None)
        attention = build_model(one_layer, bench.device, bench.dtype, seed=0).layers["0"].self_attn
        for seq_len in lengths:
            print(f"  timing one {layer_type} layer at length {seq_len} ...", flush=True)
            batch = max(1, tokens // seq_len)
            x = torch.randn(batch, seq_len, one_layer.hidden_size, device=bench.device, dtype=bench.dtype,
                            requires_grad=True)
            mask = build_masks([layer_type], one_layer.window, None, batch, seq_len, bench.device, backend)[layer_type]
            positions = torch.arange(seq_len, device=bench.device).expand(batch, seq_len)
            rope = rope_tables(positions, one_layer.head_dim, one_layer.rope_theta)
            seconds, _ = time_calls(lambda: attention(x, rope, mask).sum().backward(), 1, reps, bench.device)
            step = statistics.median(seconds)
            points.append({"layer": layer_type, "seq_len": seq_len, "batch": batch, "ms": step * 1e3,
                           "us_per_token": step * 1e6 / (batch * seq_len)})
            del x, mask
    return points


# ============================================================================= the run

def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = load_config(args)
    bench = Bench(config, args.batch, args.seq_len, device, dtype, args.warmup, args.reps, args.matmul_size)
    print(f"{config_name(args)}: batch {args.batch} x {args.seq_len} tokens, {device.type} {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.warmup} warm-up + {args.reps} timed steps per row, "
          f"{args.rounds} round(s)")
    for _ in range(args.rounds):
        time_rows(bench, set(args.sections), args.profile)
    rates = [row["matmul_flops"] for row in bench.rows] or [matmul_rate(device, dtype, args.matmul_size)]
    bench.rows = best_rounds(bench.rows)
    notes = []
    if any(row["name"] == "plain eager baseline" and "error" not in row for row in bench.rows):
        model, inputs = bench.model(), bench.inputs()  # the baseline must compute the same network
        with torch.no_grad():
            gap = abs(flint_loss(model, *inputs).item() - plain_eager_loss(model, *inputs).item())
        notes.append(f"baseline and flint losses agree to {gap:.2e} (same weights, same batch)")
    peak, peak_source = peak_flops(device, dtype, rates)
    for row in bench.rows:
        if "error" not in row:
            row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak
    result = {"config": config_name(args), "hf_config": config.to_hf_config(), "batch": args.batch,
              "seq_len": args.seq_len, "device": device.type, "device_name": device_name(device),
              "dtype": args.dtype, "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "warmup": args.warmup, "reps": args.reps, "rounds": args.rounds, "peak_flops": peak,
              "peak_source": peak_source, "flops_per_token": flops_per_token(config, args.seq_len),
              "rows": bench.rows, "notes": notes}
    if "sweep" in args.sections:
        result["sweep"] = attention_sweep(bench, args.sweep_lengths, args.sweep_tokens, args.sweep_reps)
    print_report(result)
    return result


def time_rows(bench: Bench, sections: set[str], profile_rows: int) -> None:
    """One round: every row of the chosen sections, one after another."""
    config, device, tokens = bench.config, bench.device, bench.tokens
    backend = resolve_backend(config.attention_backend, device)
    loss_note = "one chunk" if tokens <= config.loss_chunk_size else f"chunks of {config.loss_chunk_size} rows"
    if "main" in sections:
        bench.train("flint (eager)", f"{backend}, {config.experts_backend} experts, loss in {loss_note}",
                    split_rows=profile_rows)
    if "compiled" in sections:
        bench.train("flint (compiled per block)", "torch.compile(fullgraph=True) per decoder block; warm-up compiles",
                    compile_blocks=True)
    if "baseline" in sections:
        bench.train("plain eager baseline", "scores + sink column + softmax, grouped GEMM, unchunked loss",
                    loss_fn=plain_eager_loss)
    if "reference" in sections:
        bench.reference("transformers reference", "FlintForCausalLM: eager attention, grouped_mm experts, all logits")
    if "attention" in sections:
        if device.type == "cpu":  # flex has no CPU backward: compare forwards
            bench.forward("attention sdpa (forward only)", "no autograd", attention_backend="sdpa")
            bench.forward("attention flex (forward only)", "eager flex, no autograd (no CPU backward)",
                          attention_backend="flex")
        else:
            other = "sdpa" if backend == "flex" else "flex"
            bench.train(f"attention {other}", f"flint (eager) uses {backend}", attention_backend=other)
    if "experts" in sections:
        other = "loop" if config.experts_backend == "grouped" else "grouped"
        bench.train(f"experts {other}", f"flint (eager) uses {config.experts_backend}", experts_backend=other)
    if "loss" in sections:
        chunk = max(1, tokens // 4)
        bench.train(f"loss in chunks of {chunk} rows", "each chunk's logits recomputed in backward",
                    loss_chunk_size=chunk)
        if tokens > config.loss_chunk_size:
            bench.train("loss in one chunk", "logits recomputed in backward", loss_chunk_size=tokens)
        bench.train("loss unchunked (logits + cross_entropy)", "all logits saved for backward",
                    loss_fn=dense_logits_loss)


def best_rounds(rows: list[dict]) -> list[dict]:
    """Per row name, the round with the lowest median step (other processes only ever slow a step
    down), in first-seen order; every round's median is kept under round_step_s."""
    rounds: dict[str, list[dict]] = {}
    for row in rows:
        rounds.setdefault(row["name"], []).append(row)
    best = []
    for same in rounds.values():
        timed = [row for row in same if "error" not in row]
        if not timed:
            best.append(same[0])
            continue
        row = min(timed, key=lambda r: r["step_s"])
        best.append({**row, "round_step_s": [r["step_s"] for r in timed]})
    return best


def flops_per_token(config: FlintConfig, seq_len: int) -> float:
    with torch.device("meta"):  # counting needs the shapes only
        return Flint(config).flops_per_token(seq_len)


def load_config(args: argparse.Namespace) -> FlintConfig:
    if args.config:
        return FlintConfig.from_hf_config(args.config)
    return FlintConfig.from_name(args.preset)


def config_name(args: argparse.Namespace) -> str:
    return str(args.config) if args.config else f"preset {args.preset}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def print_report(result: dict) -> None:
    print(f"\n{result['config']}, batch {result['batch']} x {result['seq_len']}, {result['device_name']}, "
          f"{result['dtype']}; MFU against {result['peak_flops'] / 1e12:.3f} TFLOP/s ({result['peak_source']}); "
          f"median of {result['reps']} steps, fastest of {result['rounds']} round(s)")
    print(f"{'row':<42} {'step s':>7} {'tokens/s':>9} {'MFU %':>6} {'peak GiB':>8} {'warm-up s':>9} "
          f"{'mm TFLOP/s':>10}  note")
    print("-" * 120)
    for row in result["rows"]:
        if "error" in row:
            status = "SKIPPED" if row["error"].startswith("skipped") else "FAILED"
            print(f"{row['name']:<42} {status}: {row['error'].removeprefix('skipped: ')}")
            continue
        print(f"{row['name']:<42} {row['step_s']:>7.3f} {row['tokens_per_s']:>9.0f} {100 * row['mfu']:>6.2f} "
              f"{row['peak_memory_gib']:>8.2f} {row['warmup_s']:>9.1f} {row['matmul_flops'] / 1e12:>10.3f}  {row['note']}")
    print("(mm TFLOP/s: the matmul rate measured just before the row; a low one means the cores were busy)")
    rows = {row["name"]: row for row in result["rows"] if "error" not in row}
    main = rows.get("flint (eager)")
    if main and "split" in main:
        print(f"\nstep time split (flint eager, one profiled step, scaled to the median {main['step_s']:.3f} s):")
        for category, fraction in main["split"].items():
            print(f"  {category:<46} {100 * fraction:>6.1f} %  {fraction * main['step_s']:>7.3f} s")
    baseline = rows.get("plain eager baseline")
    for name in ("flint (eager)", "flint (compiled per block)"):
        if baseline and name in rows:
            print(f"{name} vs plain eager baseline: {rows[name]['tokens_per_s'] / baseline['tokens_per_s']:.2f}x tokens/s")
    reference = rows.get("transformers reference")
    if reference and main:
        ratio = main["tokens_per_s"] / reference["tokens_per_s"]
        print(f"flint (eager) vs transformers reference: {ratio:.2f}x tokens/s")
    compiled = rows.get("flint (compiled per block)")
    if compiled:
        print(f"flint (compiled per block): {compiled['graphs']} graphs, {compiled['graph_breaks']} graph breaks, "
              f"compiled during the {compiled['warmup_s']:.1f} s warm-up")
        if main:
            ratio = compiled["tokens_per_s"] / main["tokens_per_s"]
            print(f"flint (compiled per block) vs flint (eager): {ratio:.2f}x tokens/s")
    for note in result["notes"]:
        print(note)
    if result.get("sweep"):
        print("\none attention layer (projections + core), forward + backward, by sequence length:")
        print(f"  {'layer':<18} {'length':>7} {'batch':>6} {'ms':>10} {'us/token':>10} {'vs first':>9}")
        first = {}
        for point in result["sweep"]:
            base = first.setdefault(point["layer"], point["us_per_token"])
            print(f"  {point['layer']:<18} {point['seq_len']:>7} {point['batch']:>6} {point['ms']:>10.1f} "
                  f"{point['us_per_token']:>10.2f} {point['us_per_token'] / base:>8.2f}x")
        print("  (us/token flat with length: cost linear in length; rising in proportion: quadratic)")


def write_json(result: dict, path: Path) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(temporary, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--preset", default="bench-cpu", help="FlintConfig preset (default: bench-cpu)")
    shape.add_argument("--config", type=Path, help="a config.json, or a checkpoint directory holding one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (compiling happens here)")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per row; the median is reported")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every row this many times, in turn, and keep each row's fastest round")
    parser.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--sweep-lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--sweep-tokens", type=int, default=4096, help="tokens per sweep point (at least one sequence)")
    parser.add_argument("--sweep-reps", type=int, default=2, help="timed calls per sweep point, after one warm-up")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--matmul-size", type=int, default=1024, help="square matmul that measures the machine's rate")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the torch.profiler table of the main step, top N ops")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny preset, batch 2 x 64, 1 rep, 1 thread, no compile, short sweep")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.config, args.batch, args.seq_len = "tiny", None, 2, 64
        args.warmup, args.reps, args.sweep_reps, args.matmul_size = 1, 1, 1, 256
        # Tiny ops gain nothing from threads, and on busy cores each thread barrier waits for a core.
        args.threads = args.threads or 1
        args.sections = [s for s in args.sections if s != "compiled"]
        args.sweep_lengths, args.sweep_tokens = [64, 128], 128
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown section {unknown[0]!r}; choose from {','.join(SECTIONS)}")
    for flag in ("batch", "seq_len", "reps", "rounds", "sweep_tokens", "sweep_reps", "matmul_size", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        with warnings.catch_warnings():
            # Eager flex on the CPU is what the attention comparison measures, on purpose.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            result = run(args)
    finally:
        torch.set_num_threads(threads)  # main() may run inside another process, such as a test
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
