"""Where a training step's time goes: one profiled step, its ops attributed to the modules that ran
them; and what bench.py measures around it: a call's seconds, the machine's matmul rate, a row's
memory.

profile_step opens a torch.profiler range around the forward of each module kind of TIMED_MODULES
(with hooks, from outside the model), bench.py one around the optimizer; split_step then gives every
op of the step to a category, forward and backward, and the rest (Python, framework) to OTHER."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from head import HEAD_PRECISIONS, Head
from moe import GroupedExperts, Router, SwiGLU
from registry import FAMILIES, family


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
    """Bytes in use now: CUDA's allocated memory, or this process's resident set on Linux (0
    elsewhere) once glibc has handed freed heap back, so that a row's growth above it is memory of
    its own, not memory the rows built before it freed."""
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
    # Linux: writing 5 resets the peak RSS getrusage reports (elsewhere: process-wide)
    with suppress(OSError):
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
# Each family's own module kinds (its Family's timed_modules, registry.py), then the shared ones.
TIMED_MODULES = tuple(kind for name in FAMILIES for kind in family(name).timed_modules) + (
    (Router, "router"),
    (GroupedExperts, "routed experts"),
    (SwiGLU, "dense MLP + shared expert"),
    (Head, "head + loss"),
)
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
        return next((name[len(RANGE) :] for name in names if name.startswith(RANGE)), None)

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


def profile_step(
    model: torch.nn.Module, step: Callable[[], None], device: torch.device, table_rows: int
) -> tuple[dict[str, float], str]:
    """One profiled step: its split (split_step), and the top `table_rows` ops as a table ("" for
    0)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with module_ranges(model), profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        synchronize(device)
        step_seconds = time.perf_counter() - start
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=table_rows) if table_rows else ""
    return split_step(prof.events(), step_seconds, device), table


# ============================================================================= host syncs

# Ops whose output shape depends on tensor values: on a GPU the kernel reads a size back to the
# host. (Those fake tensors refuse with DynamicOutputShapeException; reads_device_memory names the
# calls of them that read nothing.)
SIZE_READS = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.bincount.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.repeat_interleave.Tensor,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.one_hot.default,
}
# Ops that return a host value computed from device tensors.
VALUE_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
}
CONVERSIONS = {torch.Tensor.tolist, torch.Tensor.numpy}
# DeviceMesh keeps its table of ranks on the CPU on every device, and reads it (nonzero, tolist)
# each time a sub-mesh is taken (mesh["dp"]): host work, never a device sync.
HOST_SIDE = (str(Path(torch.distributed.__file__).parent / "device_mesh.py"),)


def called_from_host_side() -> bool:
    """Is the op being counted called, at any depth, from HOST_SIDE code?"""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in HOST_SIDE:
            return True
        frame = frame.f_back
    return False


def reads_device_memory(func, args: tuple, kwargs: dict) -> bool:
    """Would this aten op, run on a GPU, make the host wait for the device?"""
    if func in VALUE_READS:
        return True
    if func is torch.ops.aten.repeat_interleave.Tensor:  # not when the caller gives the output size
        return kwargs.get("output_size") is None
    # only boolean masks (a nonzero inside); integer indices are not
    if func is torch.ops.aten.index.Tensor:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is torch.ops.aten.one_hot.default:  # only without num_classes (a max inside)
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0
    if func in SIZE_READS:
        return True
    if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):  # device -> host
        source, target = (
            (args[0], kwargs.get("device"))
            if func is torch.ops.aten._to_copy.default
            else args[1::-1]
        )
        target = target.device if isinstance(target, torch.Tensor) else target
        return (
            source.device.type not in ("cpu", "meta")
            and torch.device(target or source.device).type == "cpu"
        )
    return False


class HostSyncs(TorchDispatchMode):
    """Inside `with HostSyncs() as syncs:`, `syncs.reads` lists every device-to-host copy the code
    makes in eager mode, as the op's name: scalar reads (.item(), bool(), float(), int():
    aten._local_scalar_dense), tensor -> list or array (.tolist(), .numpy(), seen by a function
    mode: they never reach the dispatcher), ops whose output size depends on the values (nonzero,
    boolean indexing, repeat_interleave without output_size, ...) and copies from a GPU to the CPU.

    It counts what the same code would sync on a GPU: on the CPU every tensor is on the host and no
    read waits for anything, so reads are counted whatever the device (`.to("cpu")` of a CPU tensor
    is no copy, and is not counted). Host-side tensors the code reads on purpose count too (keep
    them numpy or Python values), except DeviceMesh's own rank table (HOST_SIDE)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._conversions = _Conversions(self.reads)

    def __enter__(self) -> HostSyncs:
        self._conversions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._conversions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_device_memory(func, args, kwargs) and not called_from_host_side():
            self.reads.append(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


class _Conversions(TorchFunctionMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in CONVERSIONS and not called_from_host_side():
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ====================================================================== the head's matmul precision
# decoder.Head's three matmuls per chunk at the precisions a GPU offers ([parallel].head_precision),
# emulated on the CPU by rounding the operands and multiplying in FP32 (every product of the rounded
# operands is exact in FP32, so only the rounding differs from the tensor cores, which also
# accumulate in FP32), against the same head in FP64.


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """FP32 x with its mantissa rounded to `bits` bits (to nearest, ties away from zero, as CUDA's
    cvt.rna.tf32.f32); TF32 is bits = 10. The sign bit is left alone, so adding half of the dropped
    unit to the bit pattern rounds the magnitude, and a carry moves into the exponent."""
    drop = 23 - bits
    pattern = x.float().contiguous().view(torch.int32)
    return ((pattern + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo + O(2^-16 |x|): hi its BF16 rounding, lo the BF16 rounding of the rest (as
    FP32)."""
    hi = x.bfloat16().float()
    return hi, (x - hi).bfloat16().float()


def emulated_mm(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b as a GPU computes it at `precision` (FP32 accumulation in every case)."""
    if precision == "float32":
        return a @ b
    if precision == "tf32":
        return round_mantissa(a, 10) @ round_mantissa(b, 10)
    if precision == "bf16":
        return a.bfloat16().float() @ b.bfloat16().float()
    # bf16x3: three BF16 products, lo x lo dropped
    (a_hi, a_lo), (b_hi, b_lo) = split_bf16(a), split_bf16(b)
    return a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi


def head_loss_and_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """The head's mean cross-entropy and its gradients as LinearCrossEntropy takes them, with every
    matmul through `mm`: h [N, H], weight [V, H] -> loss, d loss / d h [N, H], d loss / d weight [V,
    H]."""
    log_probs = torch.log_softmax(mm(h, weight.T), dim=-1)  # [N, V]
    rows = torch.arange(h.shape[0])
    loss = -log_probs[rows, targets].mean()
    grad = log_probs.exp_()
    # N x d loss / d logits [N, V]; the 1 / N comes after the matmuls, as there
    grad[rows, targets] -= 1
    return loss, mm(grad, weight) / h.shape[0], mm(grad.T, h) / h.shape[0]


def head_precision_errors(
    vocab: int, hidden: int, tokens: int, logit_std: float = 3.0, seed: int = 0
) -> list[dict[str, float]]:
    """Each precision's error against the FP64 head on one batch: the loss's absolute error (nats)
    and each gradient's relative error (Frobenius norm of the difference over the reference's).

    The batch looks like a trained head's: hidden states of unit RMS (the final norm's output),
    weights giving logits of std `logit_std`, targets drawn from the model's own distribution."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=generator)
    weight = torch.randn(vocab, hidden, generator=generator) * (logit_std / hidden**0.5)
    with torch.no_grad():
        probs = torch.softmax((h.double() @ weight.double().T), dim=-1)
        targets = torch.multinomial(probs.float(), 1, generator=generator).flatten()
        del probs
        reference = head_loss_and_grads(h.double(), weight.double(), targets, torch.mm)
        rows = []
        for precision in HEAD_PRECISIONS:
            got = head_loss_and_grads(h, weight, targets, lambda a, b: emulated_mm(a, b, precision))
            rows.append(
                {
                    "precision": precision,
                    "loss": reference[0].item(),
                    "loss_error": abs(got[0].double() - reference[0]).item(),
                    **{
                        f"{name}_error": ((g.double() - r).norm() / r.norm()).item()
                        for name, g, r in zip(("grad_h", "grad_weight"), got[1:], reference[1:])
                    },
                }
            )
            del got
    return rows


def print_head_precision(vocab: int = 150144, hidden: int = 2048, tokens: int = 256) -> None:
    """The BENCHMARKS.md table (Flint's head by default):
    python3 -c 'import profiling; profiling.print_head_precision()'."""
    rows = head_precision_errors(vocab, hidden, tokens)
    print(
        f"head {vocab} x {hidden}, {tokens} tokens, loss {rows[0]['loss']:.3f} nats; errors "
        "against FP64:"
    )
    print(
        "| precision | loss error (nats) | grad h rel. error | grad W rel. error "
        "|\n|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['precision']} | {row['loss_error']:.2e} | {row['grad_h_error']:.2e} | "
            f"{row['grad_weight_error']:.2e} |",
            flush=True,
        )


# ============================================================================= comparisons


class NotApplicable(Exception):
    """A comparison the model's family does not have (tools/<family>_baselines.py): bench.py shows
    its row as skipped."""


def dense_logits_loss(
    model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Any model's loss the unchunked way: all FP32 logits at once, then one cross-entropy."""
    logits = model(input_ids)  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def cosine_parity(
    reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor], min_cosine: float
) -> tuple[bool, str]:
    """Whether every tensor of `candidate` (a BF16 run's gradients, say) points where the same-named
    tensor of `reference` (the FP32 run's) does: each pair's cosine similarity, in FP64, at least
    `min_cosine`. A direction does not depend on a tensor's scale, so a small gradient (the sinks')
    is judged like a large one, where a relative gap over all gradients flakes on the smallest. Two
    zero tensors agree; one zero tensor does not. -> (verdict, a line naming the worst tensor)."""
    if reference.keys() != candidate.keys():
        raise ValueError(f"the runs' tensors differ: {sorted(reference.keys() ^ candidate.keys())}")
    cosines = {}
    for name, want in reference.items():
        a, b = want.detach().double().flatten(), candidate[name].detach().double().flatten()
        norms = a.norm() * b.norm()
        cosines[name] = float(a @ b / norms) if norms > 0 else float(a.norm() == b.norm())
    worst = min(cosines, key=cosines.get)
    return cosines[worst] >= min_cosine, (
        f"{len(cosines)} tensors, worst cosine similarity "
        f"{cosines[worst]:.5f} "
        f"({worst}; at least {min_cosine} needed)"
    )
