"""What one training step asks of the hardware, op by op, without running it: FLOPs and bytes.

The model runs one forward and backward on fake tensors (shapes and dtypes, no values; built on the
meta device and materialised on fake CPU tensors) under a dispatch mode that records every op: its
FLOPs by torch.utils.flop_counter's formulas (FlopCounterMode's registry, with this repo's custom
operators added), the bytes it reads and writes, its dtype and input shapes, and the module it ran
in. `fuse_chains` also gives the bytes once a compiler fuses chains of elementwise ops. planner.py
prices the result on a GPU."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from contextlib import ExitStack

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

import attention  # noqa: F401  (registers the flint::flash_sink_attention operators counted below)
import layers
import moe
from fp8 import apply_fp8
from parallel import apply_activation_checkpointing
from registry import ModelConfig, model_class


def _grouped_mm_flop(x_shape, w_shape, offsets_shape, out_shape=None, **kwargs) -> int:
    """flint::grouped_mm: x [M, K] @ the groups of w [G, K, N]: each row meets one group."""
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


def _grouped_mm_weight_grad_flop(
    x_shape, grad_shape, offsets_shape, out_shape=None, **kwargs
) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[1]


def _fp8_matmul_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """flint::fp8_matmul: a [M, K] @ b [K, N] on FP8 operands (fp8.py)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _fp8_grouped_mm_flop(x_shape, w_shape, offsets_shape, *args, out_shape=None, **kwargs) -> int:
    return _grouped_mm_flop(x_shape, w_shape, offsets_shape)


def _fp8_grouped_mm_weight_grad_flop(
    x_shape, grad_shape, offsets_shape, *args, out_shape=None, **kwargs
) -> int:
    return _grouped_mm_weight_grad_flop(x_shape, grad_shape, offsets_shape)


def _addmm_inplace_flop(self_shape, mat1_shape, mat2_shape, *args, out_shape=None, **kwargs) -> int:
    """aten.addmm_ (the fused loss's head gradient): as addmm, which torch's registry counts."""
    return 2 * mat1_shape[0] * mat1_shape[1] * mat2_shape[1]


def _flash_sink_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    # every key given, as the CPU kernel with a mask
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _flash_sink_backward_flop(
    dy_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(dy_shape, q_shape, k_shape, v_shape)


# FLOP formulas of this repo's custom operators and an in-place matmul, beside torch's own:
# FlopCounterMode's custom_mapping.
CUSTOM_FLOPS = {
    torch.ops.aten.addmm_: _addmm_inplace_flop,
    torch.ops.flint.grouped_mm: _grouped_mm_flop,
    torch.ops.flint.grouped_mm_weight_grad: _grouped_mm_weight_grad_flop,
    torch.ops.flint.fp8_matmul: _fp8_matmul_flop,
    torch.ops.flint.fp8_grouped_mm: _fp8_grouped_mm_flop,
    torch.ops.flint.fp8_grouped_mm_weight_grad: _fp8_grouped_mm_weight_grad_flop,
    torch.ops.flint.flash_sink_attention: _flash_sink_flop,
    torch.ops.flint.flash_sink_attention_backward: _flash_sink_backward_flop,
}


@dataclasses.dataclass
class OpCost:
    """One kind of op in a traced step (same phase, module, op, dtype and input shapes), summed over
    its calls."""

    phase: str  # forward | backward (the recompute forward of checkpointed blocks runs in backward)
    # where a forward op ran, layer numbers as *: layers.*.self_attn.q_proj ("" in backward)
    module: str
    op: str
    dtype: str
    shapes: str  # of the first two tensor inputs: which matmul it is
    attention_core: bool  # part of the attention kernel (replaced by one flex kernel on a GPU)
    flops: float = 0.0
    bytes: float = 0.0
    # of `bytes`: the grouped GEMMs' expert weights (1/ep of them per rank)
    expert_weight_bytes: float = 0.0
    fused_bytes: float = 0.0  # `bytes` once compiling fuses chains of elementwise ops (fuse_chains)
    calls: int = 0


def _bytes(tensor: object) -> int:
    """Bytes a kernel touches in a tensor: its elements, or its storage if smaller (an expanded
    view)."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    return min(tensor.numel() * tensor.element_size(), tensor.untyped_storage().nbytes())


def moved_bytes(func, args: tuple, kwargs: dict, out: object) -> int:
    """Bytes an op reads and writes: every tensor in and out; views move nothing; indexed reads
    (gather, index_select, embedding) read only the rows they return; indexed writes (scatter,
    index_add, index_copy, index_put) touch only the rows they write (plus a copy of self unless in
    place)."""
    if func.is_view:
        return 0
    name = func._overloadpacket.__name__
    tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if name in INDEXED_READS:
        return 2 * sum(map(_bytes, tensors_out)) + sum(_bytes(t) for t in tensors_in[1:])
    if name.rstrip("_") in INDEXED_WRITES:
        others = [_bytes(t) for t in tensors_in[1:]]
        copy = 0 if name.endswith("_") else 2 * _bytes(tensors_in[0])
        return sum(others) + max(others, default=0) + copy
    return sum(map(_bytes, tensors_in + tensors_out))


INDEXED_READS = {"gather", "index_select", "embedding"}
INDEXED_WRITES = {"scatter", "scatter_add", "index_add", "index_copy", "index_put"}
ATTENTION_KERNELS = {
    torch.ops.flint.flash_sink_attention,
    torch.ops.flint.flash_sink_attention_backward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten._scaled_dot_product_attention_math,
}
BATCHED_MATMULS = {torch.ops.aten.bmm, torch.ops.aten.baddbmm}
GROUPED_GEMMS = {
    torch.ops.flint.grouped_mm: 1,
    torch.ops.flint.grouped_mm_weight_grad: None,
    # the weight: arg 1, the output
    torch.ops.flint.fp8_grouped_mm: 1,
    torch.ops.flint.fp8_grouped_mm_weight_grad: None,
}


# Ops the compiler fuses into one kernel with their neighbours (torch's pointwise and reduction
# tags, casts, softmax).
FUSIBLE_NAMES = {
    "_to_copy",
    "clone",
    "copy_",
    "_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
}


def fusible(func) -> bool:
    return (
        torch.Tag.pointwise in func.tags
        or torch.Tag.reduction in func.tags
        or func._overloadpacket.__name__ in FUSIBLE_NAMES
    )


@dataclasses.dataclass
class Call:
    """One op call as fuse_chains sees it: which OpCost, and the storages it reads and writes."""

    cost: OpCost
    fusible: bool
    phase: str
    reads: list[tuple[int, int]]  # (storage id, bytes)
    writes: list[tuple[int, int]]
    moved: int  # moved_bytes: what it moves unfused


def fuse_chains(calls: list[Call]) -> None:
    """Set each OpCost's fused_bytes: within a phase (a compiled forward or backward graph), a
    fusible op does not read a storage another fusible op wrote, and does not write one that only
    fusible ops of the same phase read (one nothing reads is written: a result); other ops move what
    they always move. Perfect fusion: an optimistic bound on what a compiler leaves."""
    writer: dict[int, Call] = {}
    read: set[tuple[int, int]] = set()  # (id of the writing call, storage) that some op reads
    needed: set[tuple[int, int]] = set()  # of those, what must reach memory
    elided_reads: dict[int, int] = defaultdict(int)  # id of call -> bytes it need not read
    for call in calls:
        for storage, size in call.reads:
            source = writer.get(storage)
            if source is None:
                continue
            read.add((id(source), storage))
            if call.fusible and source.fusible and source.phase == call.phase:
                elided_reads[id(call)] += size
            else:
                needed.add((id(source), storage))
        for storage, _ in call.writes:
            writer[storage] = call
    for call in calls:
        if not call.fusible:
            call.cost.fused_bytes += call.moved
            continue
        written = sum(
            size
            for storage, size in call.writes
            if (id(call), storage) in needed or (id(call), storage) not in read
        )
        call.cost.fused_bytes += (
            sum(size for _, size in call.reads) - elided_reads[id(call)] + written
        )


class StepRecorder(TorchDispatchMode):
    """Records every op's FLOPs (FlopCounterMode's formulas, CUSTOM_FLOPS included) and bytes, by
    OpCost's key. An op is of the attention core if it is an attention kernel or touches a [B, H,
    q_len, kv_len] score matrix ([B * H, q_len, kv_len] in a bmm; kv_len + 1: with a sink
    column)."""

    def __init__(self, q_len: int, kv_len: int):
        super().__init__()
        self.formulas = FlopCounterMode(display=False, custom_mapping=CUSTOM_FLOPS).flop_registry
        self.scores = {(q_len, kv_len), (q_len, kv_len + 1)}
        self.tracker = ModuleTracker()  # its parents are reliable in forward only
        self.phase = "forward"
        self.costs: dict[tuple, OpCost] = {}
        self.calls: list[Call] = []
        self.storages: list = []  # held, so that no storage id is reused during the trace

    def storage(self, tensor: torch.Tensor) -> tuple[int, int]:
        storage = tensor.untyped_storage()
        self.storages.append(storage)
        return storage._cdata, _bytes(tensor)

    def __enter__(self):
        self.tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    def module(self) -> str:
        if self.phase != "forward":
            return ""
        deepest = max(self.tracker.parents, key=lambda name: name.count("."))
        return re.sub(r"\.\d+(?=\.|$)", ".*", deepest.partition(".")[2]) or "(model)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace == "prim" or not any(
            isinstance(t, torch.Tensor) for t in tree_leaves(out)
        ):
            return out  # metadata (prim.device, sizes): no kernel
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        batched = packet in BATCHED_MATMULS  # q @ k^T and p @ v run as bmm on [B * H, T, S]
        core = packet in ATTENTION_KERNELS or any(
            (t.dim() == 4 or batched and t.dim() == 3) and tuple(t.shape[-2:]) in self.scores
            for t in tensors
        )
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)][:2]
        shapes = "x".join(str(list(t.shape)) for t in inputs)
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        key = (self.phase, self.module(), str(packet).removeprefix("aten."), dtype, shapes, core)
        cost = self.costs.setdefault(key, OpCost(*key))
        cost.flops += (
            self.formulas[packet](*args, **kwargs, out_val=out) if packet in self.formulas else 0
        )
        moved = moved_bytes(func, args, kwargs, out)
        cost.bytes += moved
        if not func.is_view:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            outs += ins[:1] if packet.__name__.endswith("_") else []  # in place: self is written
            self.calls.append(
                Call(
                    cost,
                    fusible(func),
                    self.phase,
                    [self.storage(t) for t in ins],
                    [self.storage(t) for t in outs],
                    moved,
                )
            )
        if packet in GROUPED_GEMMS:
            cost.expert_weight_bytes += _bytes(
                out if GROUPED_GEMMS[packet] is None else args[GROUPED_GEMMS[packet]]
            )
        cost.calls += 1
        return out


_TRACES: dict[str, list[OpCost]] = {}


def trace_step(
    config: ModelConfig,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    checkpointing: str,
    group_align: int = 1,
    fp8: str = "none",
) -> list[OpCost]:
    """The ops of one forward and backward of the whole model on fake CPU tensors: micro-batch
    [batch, seq_len], bulk `dtype`, [parallel] activation_checkpointing, expert groups padded to
    `group_align` rows, [parallel] fp8 (its matmuls are fp8.py's ops). Traced once per argument set
    (the released models take a minute)."""
    key = repr((config, batch, seq_len, dtype, checkpointing, group_align, fp8))
    if key in _TRACES:
        return _TRACES[key]
    with torch.device("meta"):
        model = model_class(config)(config, dtype)
    apply_activation_checkpointing(model, checkpointing)
    if fp8 != "none":
        apply_fp8(model, fp8)
    for module in model.modules():
        if isinstance(module, moe.GroupedExperts):
            module.group_align = group_align
    recorder = StepRecorder(seq_len, seq_len)
    with ExitStack() as stack:
        # The token-id check reads values (a host sync, which fake tensors refuse); train.py's data
        # is checked.
        stack.enter_context(layers.token_ids_checked_at_load())
        # to_empty reads the meta parameters
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        model.to_empty(device="cpu")
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        with recorder:
            loss = model(ids, ids)
            recorder.phase = "backward"
            loss.backward()
    fuse_chains(recorder.calls)
    _TRACES[key] = list(recorder.costs.values())
    return _TRACES[key]
