"""Where a training step's time goes: one profiled step, its ops attributed to the modules that ran them;
and what bench.py measures around it: a call's seconds, the machine's matmul rate, a row's memory.

profile_step opens a torch.profiler range around the forward of each module kind of TIMED_MODULES (with
hooks, from outside the model), bench.py one around the optimizer; split_step then gives every op of the
step to a category, forward and backward, and the rest (Python, framework) to OTHER.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from decoder import Head
from models import FAMILIES
from moe import GroupedExperts, Router, SwiGLU


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """The best FLOP/s of a square matmul right now: what this machine can do at this moment."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    return 2 * size**3 / min(time_call(lambda: a @ b, device) for _ in range(10))


def memory_in_use(device: torch.device) -> int:
    """Bytes in use now: CUDA's allocated memory, or this process's resident set on Linux (0 elsewhere)
    once glibc has handed freed heap back, so that a row's growth above it is memory of its own, not
    memory the rows built before it freed."""
    gc.collect()
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL(None).malloc_trim(0)
    with suppress(OSError):  # Linux only; resident pages are the second field
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or Linux's peak RSS of this process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with suppress(OSError):  # Linux: writing 5 resets the peak RSS getrusage reports (elsewhere: process-wide)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


# Each timed module opens a profiler range named RANGE + category around its forward; its backward
# is found through the autograd sequence numbers of the ops it ran. Innermost range wins.
RANGE = "bench/"
# Each family's own module kinds (models.py), then the shared ones.
TIMED_MODULES = tuple(kind for family in FAMILIES.values() for kind in family.timed_modules) + (
    (Router, "router"), (GroupedExperts, "routed experts"), (SwiGLU, "dense MLP + shared expert"),
    (Head, "head + loss"))
OPTIMIZER = "optimizer (clip + AdamW)"
OTHER = "other (embedding, norms, residuals, overhead)"
SPLIT_ORDER = [name for _, name in TIMED_MODULES] + [OPTIMIZER, OTHER]


@contextmanager
def module_ranges(model: torch.nn.Module) -> Iterator[None]:
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


def split_step(events: list, step_seconds: float, device: torch.device) -> dict[str, float]:
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


def profile_step(model: torch.nn.Module, step: Callable[[], None], device: torch.device,
                 table_rows: int) -> tuple[dict[str, float], str]:
    """One profiled step: its split (split_step), and the top `table_rows` ops as a table ("" for 0)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with module_ranges(model), profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        synchronize(device)
        step_seconds = time.perf_counter() - start
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=table_rows) if table_rows else ""
    return split_step(prof.events(), step_seconds, device), table


# ============================================================================= comparisons

class NotApplicable(Exception):
    """A comparison the model's family does not have (models.Family.baselines): bench.py shows its
    row as skipped."""


def dense_logits_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Any model's loss the unchunked way: all FP32 logits at once, then one cross-entropy."""
    logits = model(input_ids)  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def cosine_parity(reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor],
                  min_cosine: float) -> tuple[bool, str]:
    """Whether every tensor of `candidate` (a BF16 run's gradients, say) points where the same-named
    tensor of `reference` (the FP32 run's) does: each pair's cosine similarity, in FP64, at least
    `min_cosine`. A direction does not depend on a tensor's scale, so a small gradient (the sinks')
    is judged like a large one, where a relative gap over all gradients flakes on the smallest.
    Two zero tensors agree; one zero tensor does not. -> (verdict, a line naming the worst tensor)."""
    if reference.keys() != candidate.keys():
        raise ValueError(f"the runs' tensors differ: {sorted(reference.keys() ^ candidate.keys())}")
    cosines = {}
    for name, want in reference.items():
        a, b = want.detach().double().flatten(), candidate[name].detach().double().flatten()
        norms = a.norm() * b.norm()
        cosines[name] = float(a @ b / norms) if norms > 0 else float(a.norm() == b.norm())
    worst = min(cosines, key=cosines.get)
    return cosines[worst] >= min_cosine, (f"{len(cosines)} tensors, worst cosine similarity {cosines[worst]:.5f} "
                                         f"({worst}; at least {min_cosine} needed)")
