"""The mixture of experts of both models (Flint: sigmoid routing; Mistral Large 4: softmax): router,
grouped experts, shared expert, dense SwiGLU.

Routed experts hold native grouped weights so that `x @ w` needs no transpose:
    gate_up_proj [E, H, 2 * Im]   (gate columns first, then up)
    down_proj    [E, Im, H]
Tokens are sorted by expert, each projection is one grouped GEMM over the sorted rows, the routing
weight scales each hidden row before the down projection, and each token's rows are summed back.
With a capacity factor (capacity.py) the rows go to a static [E, C, H] buffer instead, and past C
they drop. Under expert parallelism (the last section) the rows cross ranks by all-to-all, in chunks
whose exchanges overlap the experts' and the shared expert's compute: the schedule, forward and
backward, is ExpertParallelExperts' docstring.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from capacity import batched_swiglu, capacity_ratio, expert_capacity, plan_capacity
from devices import kernel_device_type

EXPERT_BACKENDS = ("grouped", "loop")
# [parallel] ep_exchange: how a dropless expert-parallel layer sizes its all-to-alls
EP_EXCHANGES = ("sized", "sync_free")
# CUDA's grouped GEMM starts every expert's rows on a 16-byte boundary: 8 BF16 values, so each width
# it multiplies (the model's hidden and expert sizes, a LoRA rank on the experts) is a multiple of
# 8.
GROUPED_GEMM_MULTIPLE = 8
SCORE_FUNCTIONS = ("sigmoid", "softmax")


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP of `mlp_only_layers` and the ungated shared
    expert."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `indices` (any shape) pick each expert -> int64 [E].

    A scatter-add into a fixed size: unlike bincount its shape does not depend on the data, so it
    compiles into the graph with no host sync.
    """
    flat = indices.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def balanced_choices(
    num_tokens: int, top_k: int, num_experts: int, device: torch.device
) -> torch.Tensor:
    """Forced-balance routing's expert choices [N, k], round-robin: assignment a = token * k +
    choice goes to expert a % E (k consecutive, so distinct, experts per token), so expert e gets
    balanced_counts(N * k, E)[e] rows whatever the scores: known on the host from the shapes."""
    return torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k) % num_experts


def balanced_counts(rows: int, num_experts: int) -> list[int]:
    """Rows per expert of balanced_choices: rows / E each (the first rows % E experts one more)."""
    return [rows // num_experts + (expert < rows % num_experts) for expert in range(num_experts)]


def set_balanced_routing(model: nn.Module, enabled: bool) -> None:
    """Forced-balance routing in every MoE layer of `model` ([training].force_balanced_routing, the
    rehearsal, benchmarks): each router assigns its tokens round-robin (balanced_choices) and weighs
    them by its real scores at those experts, so the router still learns; expert-parallel layers
    then take their split sizes from the shapes and read nothing from the device. What published
    MoE throughput tables measure; not a way to train a model that routes."""
    for module in model.modules():
        if isinstance(module, (Router, ExpertParallelExperts)):
            module.balanced = enabled


def check_grouped_gemm_widths(config: object) -> None:
    """A model config's hidden_size and moe_intermediate_size, with experts_backend 'grouped': each
    a multiple of GROUPED_GEMM_MULTIPLE, or a ValueError naming the field."""
    if config.experts_backend != "grouped":
        return
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(config, name) % GROUPED_GEMM_MULTIPLE:
            raise ValueError(
                f"{name} must be a multiple of {GROUPED_GEMM_MULTIPLE} for "
                "experts_backend "
                "'grouped' (grouped GEMM rows start on 16-byte boundaries, 8 BF16 "
                "values), "
                f"got {getattr(config, name)}; or use experts_backend 'loop'"
            )


def check_bias_update_rate(rate: object) -> None:
    """The configs' router_bias_update_rate (a native-only field of both models): a number >= 0."""
    if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and rate >= 0):
        raise ValueError(
            f"router_bias_update_rate must be >= 0 (0: no selection bias), got {rate!r}"
        )


def router_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """A router's scores over all experts from its logits [..., E]: sigmoid or softmax."""
    return torch.softmax(logits, dim=-1) if score_function == "softmax" else torch.sigmoid(logits)


class Router(nn.Module):
    """Scores over experts, top-k, optionally renormalised. An FP32 module of its own.

    Flint scores with a sigmoid. Mistral Large 4 takes a softmax over all experts, renormalises the
    chosen k (+1e-20 in the denominator, as its reference does) and multiplies by `scaling`.

    It also records how many tokens each expert received in its last forward, as a buffer, so the
    trainer can read routing statistics without a host sync per layer. It keeps no tensor of the
    graph: its logits go out with the weights, to the router losses (balance.py), and live on
    only in what autograd saves for backward.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_function: str = "sigmoid",
        scaling: float = 1.0,
        selection_bias: bool = False,
    ):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"router score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}"
            )
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.score_function, self.scaling = score_function, scaling
        self.balanced = False  # forced balance: see set_balanced_routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        # Aux-loss-free balancing (balance.py updates it from the measured load): saved with the
        # weights, but the published format has no place for it.
        self.selection_bias = nn.Buffer(torch.zeros(num_experts)) if selection_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> FP32 weights [N, k], expert indices [N, k] and the FP32 logits [N, E]."""
        logits = x.float() @ self.weight.float().T  # [N, E]
        scores = router_scores(logits, self.score_function)
        if self.balanced:  # round-robin experts, weighed by the real scores there
            indices = balanced_choices(x.shape[0], self.top_k, self.weight.shape[0], x.device)
            weights = scores.gather(-1, indices)
        elif self.selection_bias is None:
            weights, indices = torch.topk(scores, self.top_k, dim=-1)
        else:  # the bias chooses the experts; the unbiased scores weigh them
            indices = torch.topk(scores + self.selection_bias, self.top_k, dim=-1).indices
            weights = scores.gather(-1, indices)
        if self.score_function == "softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        elif self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            # copy, not add: activation recompute stays exact
            self.tokens_per_expert.copy_(expert_counts(indices, self.weight.shape[0]))
        return weights, indices, logits


# torch 2.13's _grouped_mm has a meta (shape) kernel for BF16 only, so the compiler cannot trace an
# FP32 grouped GEMM on any device (and on the CPU it has no kernel to generate). Everywhere but
# BF16 on CUDA it is therefore an opaque custom operator: one call inside the compiled graph.
@torch.library.custom_op("flint::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # rows may arrive strided (an expanded grad)
    return torch._grouped_mm(x.contiguous(), w, offs=offsets)


@_grouped_mm_op.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("flint::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(
    x: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [M, K], grad_out [M, N] -> [G, K, N]: per group, x_g^T @ grad_out_g."""
    return torch._grouped_mm(x.contiguous().T, grad_out.contiguous(), offs=offsets)


@_grouped_mm_weight_grad.register_fake
def _(x, grad_out, offsets):
    return x.new_empty(offsets.shape[0], x.shape[1], grad_out.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad_out):
    x, w, offsets = ctx.saved_tensors
    grad_x = (
        _grouped_mm_op(grad_out, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    )
    grad_w = _grouped_mm_weight_grad(x, grad_out, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] rows sorted by group, w [G, K, N], offsets int32 [G] cumulative ends -> [M, N].

    Native (and compiled by inductor) for BF16 on CUDA; the opaque custom operator otherwise.
    """
    if kernel_device_type(x.device) == "cuda" and x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w, offs=offsets)
    return _grouped_mm_op(x, w, offsets)


def group_alignment(device: torch.device) -> int:
    """Rows per expert group are padded to a multiple of this: CUDA's bf16/fp8 grouped GEMMs need
    aligned groups (16 covers both); the CPU kernel needs none."""
    return 16 if kernel_device_type(device) == "cuda" else 1


class ExpertPlan(NamedTuple):
    """How rows sorted by expert sit in the (possibly padded) buffer of the grouped GEMM."""

    order: torch.Tensor  # [R] assignment ids in expert order
    slots: torch.Tensor | None  # [R] buffer row of each sorted assignment; None when not padded
    offsets: torch.Tensor  # int32 [E] cumulative padded group ends
    rows: int  # static buffer length: R + E * (align - 1)

    @property
    def padded(self) -> bool:
        """align > 1: the buffer has gaps between groups."""
        return self.slots is not None


def sort_by_expert(indices: torch.Tensor, num_experts: int, align: int) -> ExpertPlan:
    """Plan the grouped GEMM for expert indices [N, k] without a host sync."""
    flat = indices.flatten()  # [N*k]
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    if align == 1:  # no gaps: sorted assignment i sits in buffer row i
        return ExpertPlan(order, None, torch.cumsum(counts, 0).to(torch.int32), flat.numel())
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(counts, 0) - counts
    padded_ends = torch.cumsum(padded, 0)
    expert_of_sorted = flat[order]
    rank_in_group = torch.arange(flat.numel(), device=flat.device) - starts[expert_of_sorted]
    slots = padded_ends[expert_of_sorted] - padded[expert_of_sorted] + rank_in_group
    rows = flat.numel() + num_experts * (align - 1)
    return ExpertPlan(order, slots, padded_ends.to(torch.int32), rows)


def grouped_swiglu(
    rows: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    mm: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Rows grouped by expert [R, H] (groups ending at offsets) and their routing weights [R] ->
    weight * each row's expert SwiGLU [R, H], a grouped GEMM per projection (mm: fp8.py's, or None
    for grouped_mm, looked up at each call so that a profiler's range around it is seen). The weight
    scales the I-wide hidden row before the down projection (not the H-wide output), so combine only
    sums."""
    mm = mm or grouped_mm
    gate, up = mm(rows, gate_up_proj, offsets).chunk(2, dim=-1)  # [R, Im] each
    return mm(F.silu(gate) * up * weights.unsqueeze(-1), down_proj, offsets)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """order [R], a permutation -> inverse [R] with inverse[order[i]] = i."""
    return torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )


# --------------------------------------------------------------- token rows to expert rows and back
# Every routed path moves rows by one RowMap per forward: dispatch gathers each token's row into its
# experts' rows, combine sums a token's k rows back in one embedding_bag (no [N, k, H] tensor), and
# each is the other's backward. Autograd's own backward of a gather is a scatter-add, compiled for
# the CPU row by row with atomics (about 5x slower), and on GPUs its atomics make the gradient vary
# from run to run; an embedding_bag sums each bag in order, one thread per value (in FP32 for BF16
# rows).


class RowMap(NamedTuple):
    """Where each (token, choice) assignment a = token * k + choice sits among the experts' rows."""

    choice_of_row: torch.Tensor  # [R] the assignment each row holds; N * k for an empty row
    # [N, k] the row each assignment sits in (any row where it was dropped)
    row_of_choice: torch.Tensor
    # bool [N, k]: the assignment has a row (False: dropped); None: all have one
    kept: torch.Tensor | None
    has_empty_rows: bool  # padded groups or expert capacity: some rows hold no assignment

    @property
    def token_of_row(self) -> torch.Tensor:
        return self.choice_of_row // self.row_of_choice.shape[1]  # [R]; N for an empty row

    def per_assignment(self) -> RowMap:
        """The same rows, each assignment a token of its own (k = 1): how routing weights [N * k]
        move."""
        kept = None if self.kept is None else self.kept.view(-1, 1)
        return RowMap(self.choice_of_row, self.row_of_choice.view(-1, 1), kept, self.has_empty_rows)


def expert_rows(plan: ExpertPlan, top_k: int) -> RowMap:
    """The RowMap of a sort_by_expert plan over expert indices [N, top_k]."""
    order = plan.order  # [N*k]
    if not plan.padded:
        return RowMap(order, inverse_permutation(order).view(-1, top_k), None, False)
    # [rows]
    choice_of_row = order.new_full((plan.rows,), order.numel()).scatter_(0, plan.slots, order)
    row_of_choice = torch.empty_like(order).scatter_(0, order, plan.slots)  # [N*k]
    return RowMap(choice_of_row, row_of_choice.view(-1, top_k), None, True)


def gather_rows(x: torch.Tensor, source: torch.Tensor, has_empty_rows: bool) -> torch.Tensor:
    """x [M, H], source [R] -> x[source] [R, H]; source M (with has_empty_rows) gives a zero row."""
    if has_empty_rows:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x.index_select(0, source)


def sum_rows(rows: torch.Tensor, index: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """rows [R, H], index [M, k] -> [M, H]: out[m] = the sum over j of rows[index[m, j]] where
    kept."""
    mask = None if kept is None else kept.to(rows.dtype)
    return F.embedding_bag(index, rows.contiguous(), mode="sum", per_sample_weights=mask)


class _Dispatch(torch.autograd.Function):
    """Tokens [N, H] -> the experts' rows [R, H] (zero where empty); backward: sum_rows."""

    @staticmethod
    def forward(ctx, x, source, index, kept, has_empty_rows):
        ctx.save_for_backward(index, kept)
        return gather_rows(x, source, has_empty_rows)

    @staticmethod
    def backward(ctx, grad):
        index, kept = ctx.saved_tensors
        return sum_rows(grad, index, kept), None, None, None, None


class _Combine(torch.autograd.Function):
    """The experts' rows [R, H] -> each token's sum over its choices [N, H]; backward:
    gather_rows."""

    @staticmethod
    def forward(ctx, rows, source, index, kept, has_empty_rows):
        ctx.save_for_backward(source)
        ctx.has_empty_rows = has_empty_rows
        return sum_rows(rows, index, kept)

    @staticmethod
    def backward(ctx, grad):
        (source,) = ctx.saved_tensors
        return gather_rows(grad, source, ctx.has_empty_rows), None, None, None, None


def dispatch(x: torch.Tensor, rows: RowMap) -> torch.Tensor:
    """Each token's row in the rows of its chosen experts: x [N, H] -> [R, H]."""
    return _Dispatch.apply(x, rows.token_of_row, rows.row_of_choice, rows.kept, rows.has_empty_rows)


def dispatch_weights(weights: torch.Tensor, rows: RowMap, dtype: torch.dtype) -> torch.Tensor:
    """The routing weight of each expert row: weights [N, k] -> [R] in dtype (0 where empty)."""
    return dispatch(weights.to(dtype).view(-1, 1), rows.per_assignment()).view(-1)


def combine(out: torch.Tensor, rows: RowMap) -> torch.Tensor:
    """The experts' (weighted) rows back to their tokens, summed over the k choices: out [R, H] ->
    [N, H]; a dropped assignment adds nothing."""
    return _Combine.apply(
        out, rows.token_of_row, rows.row_of_choice, rows.kept, rows.has_empty_rows
    )


def capacity_rows(indices: torch.Tensor, num_experts: int, capacity: int) -> RowMap:
    """The RowMap of the capacity buffer's E * C rows for expert indices [N, k]
    (capacity.plan_capacity)."""
    plan = plan_capacity(indices, num_experts, capacity)
    kept = plan.slots < num_experts * capacity  # [N*k]
    return RowMap(
        plan.sources,
        torch.where(kept, plan.slots, 0).view(indices.shape),
        kept.view(indices.shape),
        True,
    )


def capacity_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    ratio: tuple[int, int],
    experts: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Routed experts under expert capacity (capacity.py: who counts, what drops and in what
    order): x [N, H], weights/indices [N, k], ratio the capacity factor's capacity_ratio; experts
    maps the buffer [E, C, H] and its routing weights [E, C] to the weighted outputs [E, C, H]."""
    capacity = expert_capacity(x.shape[0], indices.shape[1], num_experts, ratio)
    rows = capacity_rows(indices, num_experts, capacity)
    out = experts(
        dispatch(x, rows).view(num_experts, capacity, -1),
        dispatch_weights(weights, rows, x.dtype).view(num_experts, capacity),
    )
    return combine(out.view(num_experts * capacity, -1), rows)


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts held as two grouped weights, run with one grouped GEMM each (under
    expert capacity, one batched matmul each over the static [E, C, H] buffer: capacity.py)."""

    # the grouped path's experts; lora.py's adapters add their updates
    swiglu = staticmethod(grouped_swiglu)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        backend: str = "grouped",
        dtype: torch.dtype | None = None,
        capacity_factor: float | None = None,
    ):
        super().__init__()
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"experts_backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
        self.backend, self.capacity_factor = backend, capacity_factor
        self.capacity_ratio = None if capacity_factor is None else capacity_ratio(capacity_factor)
        self.group_align: int | None = None  # None: group_alignment(device); tests force padding
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, hidden, 2 * intermediate, dtype=dtype)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden, dtype=dtype))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H], weights/indices [N, k] -> [N, H]."""
        if self.backend == "loop":
            return self.forward_loop(x, weights, indices)
        if self.capacity_ratio is not None:
            return capacity_forward(
                x,
                weights,
                indices,
                self.gate_up_proj.shape[0],
                self.capacity_ratio,
                partial(batched_swiglu, gate_up_proj=self.gate_up_proj, down_proj=self.down_proj),
            )
        return self.forward_grouped(x, weights, indices)

    def forward_grouped(self, x, weights, indices):
        plan = sort_by_expert(
            indices, self.gate_up_proj.shape[0], self.group_align or group_alignment(x.device)
        )
        rows = expert_rows(plan, indices.shape[1])
        out = self.swiglu(
            dispatch(x, rows),
            dispatch_weights(weights, rows, x.dtype),
            plan.offsets,
            self.gate_up_proj,
            self.down_proj,
        )
        return combine(out, rows)

    def forward_loop(self, x, weights, indices):
        """The plain per-expert loop: the readable reference for the grouped path (host syncs)."""
        num_experts, intermediate = self.gate_up_proj.shape[0], self.down_proj.shape[1]
        capacity = (
            None
            if self.capacity_ratio is None
            else expert_capacity(x.shape[0], indices.shape[1], num_experts, self.capacity_ratio)
        )
        y = torch.zeros_like(x)
        for expert in range(num_experts):
            token, slot = torch.where(indices == expert)  # in token order
            token, slot = token[:capacity], slot[:capacity]  # the earliest tokens within capacity
            if token.numel() == 0:
                continue
            gate_up = x[token] @ self.gate_up_proj[expert]  # [n, 2*Im]
            hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
            out = (hidden @ self.down_proj[expert]) * weights[token, slot].unsqueeze(-1).to(x.dtype)
            y = y.index_add(0, token, out)
        return y


class MoE(nn.Module):
    """Routed experts plus one shared expert that is always added in full, with no gate."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        shared_intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        backend: str = "grouped",
        dtype: torch.dtype | None = None,
        score_function: str = "sigmoid",
        scaling: float = 1.0,
        selection_bias: bool = False,
        capacity_factor: float | None = None,
    ):
        super().__init__()
        self.router = Router(
            hidden, num_experts, top_k, norm_topk_prob, score_function, scaling, selection_bias
        )
        self.experts = GroupedExperts(
            hidden, intermediate, num_experts, backend, dtype, capacity_factor
        )
        self.shared_expert = SwiGLU(hidden, shared_intermediate, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x)[0]

    def routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> y [B, T, H], and the router's FP32 logits [B, T, E] and chosen experts
        [B, T, k] (what the router losses read)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [B, T, H] -> [N, H]
        weights, indices, logits = self.router(x)
        # the shared expert runs while rows travel
        if isinstance(self.experts, ExpertParallelExperts):
            y = self.experts(x, weights, indices, self.shared_expert)
        else:
            y = self.experts(x, weights, indices) + self.shared_expert(x)
        return y.view(shape), logits.view(*shape[:-1], -1), indices.view(*shape[:-1], -1)


# ============================================================================= expert parallel
# Used only when parallel.py shards the experts over an expert-parallel mesh: the one place where
# tokens cross ranks. Everything above stays single-device code.


def _local_shard(weight: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: a DTensor sharded over experts -> its local [E/ep, ...] part."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def local_experts_forward(
    xs: torch.Tensor,
    weights: torch.Tensor,
    expert_of_row: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    align: int,
    swiglu: Callable = grouped_swiglu,
    padding: bool = False,
) -> torch.Tensor:
    """xs [R, H] in any order, their routing weights [R] and local expert ids expert_of_row [R] ->
    each row's weighted SwiGLU [R, H], same order (`swiglu`: GroupedExperts.swiglu's signature).
    padding: expert_of_row may also be El, a row that holds no token (sync_free's padded blocks):
    sorted after every group, outside the grouped GEMM's offsets, so no expert computes it and its
    output row is undefined (whoever receives it never reads it)."""
    local = gate_up_proj.shape[0]
    plan = sort_by_expert(expert_of_row.unsqueeze(1), local + padding, align)
    rows = expert_rows(plan, 1)  # each received row a token with one choice
    out = swiglu(
        dispatch(xs, rows),
        dispatch_weights(weights.unsqueeze(1), rows, xs.dtype),
        plan.offsets[:local],
        gate_up_proj,
        down_proj,
    )
    return combine(out, rows)  # back to the order of xs


# ----------------------------------------------------------- all-to-alls started and finished apart
# An all-to-all is started, and waited for later, so that a rank computes while the rows travel, in
# forward and in backward: the gradient's all-to-all starts in _FinishExchange's backward and is
# waited for in _AwaitGradient's, the node where the rows left. torch's functional collectives (a
# tensor in, a tensor out) trace into a compiled graph; on NCCL a wait makes the compute stream, not
# the host, wait for the collective's stream.
_c10d = torch.ops._c10d_functional


class _AwaitGradient(torch.autograd.Function):
    """The rows [S, ...] about to be sent, unchanged; backward: waits for their gradient's
    all-to-all."""

    @staticmethod
    def forward(ctx, rows):
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad_in_flight):
        return _c10d.wait_tensor(grad_in_flight)


class _FinishExchange(torch.autograd.Function):
    """The rows in flight -> the rows received [R, ...]; backward: the gradient [R, ...] starts its
    way back, in flight, as the gradient of the rows sent [S, ...] (waited for in
    _AwaitGradient)."""

    @staticmethod
    def forward(ctx, in_flight, sent, output_splits, input_splits, group_name):
        ctx.splits, ctx.group_name = (output_splits, input_splits), group_name
        return _c10d.wait_tensor(in_flight)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_sent = _c10d.all_to_all_single(
            grad.contiguous(), input_splits, output_splits, ctx.group_name
        )
        return None, grad_sent, None, None, None


class Exchange(NamedTuple):
    """An all-to-all in flight: started by start_exchange, waited for by finish."""

    sent: torch.Tensor  # the rows sent [S, ...], as autograd knows them
    in_flight: torch.Tensor  # the rows being received [R, ...]: not to be read before finish
    output_splits: list[int]
    input_splits: list[int]
    group_name: str

    def finish(self) -> torch.Tensor:
        return _FinishExchange.apply(
            self.in_flight, self.sent, self.output_splits, self.input_splits, self.group_name
        )


def start_exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
) -> Exchange:
    """Start an all-to-all of rows [S, ...]: input_splits[r] of them to rank r, output_splits[r]
    from it."""
    sent = _AwaitGradient.apply(rows)
    in_flight = _c10d.all_to_all_single(
        sent.detach().contiguous(), output_splits, input_splits, group_name
    )
    return Exchange(sent, in_flight, output_splits, input_splits, group_name)


Sizes = tuple[list[int], list[int]]  # one chunk's rows sent to and received from each expert rank


# --------------------------------------------------------- the sync-free exchange's static blocks
# [parallel] ep_exchange = "sync_free": every chunk sends each expert rank one block of a size known
# from the shapes, its rows first and empty rows after, so the all-to-alls take equal splits and no
# split size is copied to the host. The block is the worst case, so no routing can overflow it.


def peer_block_rows(tokens: int, top_k: int, local_experts: int) -> int:
    """The most rows `tokens` tokens can send one expert rank: each token's k choices are distinct
    experts (the router's top-k), at most El of them on one rank."""
    return tokens * min(top_k, local_experts)


def padded_send_plan(
    keys: torch.Tensor, blocks: list[int], ep: int, local_experts: int
) -> ExpertPlan:
    """Where each assignment sits in the send buffer of the sync-free exchange, no host sync: keys
    [N*k] are chunk * E + expert; chunk c sends every expert rank a block of blocks[c] rows (that
    rank's rows in expert order, then empty rows), the chunks' ep blocks one after another. offsets:
    each (chunk, rank) block's end. More rows for a rank than its block is an error raised on the
    device (distinct top-k choices cannot make one), never a dropped row."""
    order = torch.argsort(keys, stable=True)
    group = keys // local_experts  # [N*k]: chunk * ep + expert rank
    counts = expert_counts(group, len(blocks) * ep)  # [n * ep]
    sizes = [block for block in blocks for _ in range(ep)]
    block_rows = torch.tensor(sizes, device=keys.device)  # [n * ep]
    torch._assert_async(
        (counts <= block_rows).all(),
        "expert parallel sync_free: a rank routed more rows to one expert rank than its block "
        "holds (repeated expert choices?)",
    )
    block_ends = torch.cumsum(block_rows, 0)
    group_of_sorted = group[order]
    rank_in_group = (
        torch.arange(keys.numel(), device=keys.device)
        - (torch.cumsum(counts, 0) - counts)[group_of_sorted]
    )
    slots = (block_ends - block_rows)[group_of_sorted] + rank_in_group
    return ExpertPlan(order, slots, block_ends.to(torch.int32), sum(sizes))


def received_experts(counts: torch.Tensor, block: int) -> torch.Tensor:
    """counts [ep, El]: the rows each source rank sent for each local expert, in blocks of `block`
    rows (expert order, then empty rows) -> the local expert of each received row [ep * block]; El
    for an empty row."""
    ends = counts.cumsum(1)  # [ep, El]
    position = torch.arange(block, device=counts.device).expand(counts.shape[0], block)
    return torch.searchsorted(ends, position.contiguous(), right=True).flatten()


class ExpertSplits:
    """What one expert-parallel forward exchanges, per chunk and expert rank. A plain object, not a
    tuple: a compiled block takes it from the eager count exchange without guarding on the sizes
    inside (a tuple of ints would be specialised, and recompiled for, as the routing changes)."""

    def __init__(
        self, received_counts: torch.Tensor, send: list[list[int]], receive: list[list[int]]
    ):
        # [n, ep * El] on the device: chunk c's rows from source s for local expert j
        self.received_counts = received_counts
        self.send = send  # [n][ep]: rows this rank sends to each expert rank, per chunk (host)
        self.receive = receive  # [n][ep]: rows it receives from each
        # [2, n, ep]: the same in a host tensor, for compiled graphs
        self.host = torch.tensor([send, receive])

    def sizes(self, chunk_rows: list[int]) -> list[Sizes]:
        """Each chunk's (send, receive); chunk_rows: the rows each chunk sends (known from the
        shapes). Compiled, read inside the graph from the host tensor as unbacked integers (no
        device sync): one graph serves every routing."""
        if not torch.compiler.is_compiling():
            return list(zip(self.send, self.receive))
        send, receive = self.host.tolist()
        for sizes in send + receive:
            for size in sizes:
                torch._check(size >= 0)
        for sizes, rows in zip(send, chunk_rows):
            # so the rows that come back have the shape of those sent
            torch._check(sum(sizes) == rows)
        return list(zip(send, receive))


class SplitsForRecompute:
    """The split sizes of the forwards an activation-checkpointed backward will recompute, kept on
    the host so the recompute makes no device-to-host copy (nor count exchange) of its own.

    An entry lives as long as its forward's autograd graph: it holds a weak reference to a node of
    that graph (the dispatch's), so a forward whose backward never comes (no checkpointing, an
    abandoned step) leaves nothing stale behind. Recomputes come in the order of their forwards
    (each micro-batch's backward follows its forward, in every pipeline schedule), so a recompute
    takes the oldest live entry, and checks on the device (no sync) that its own counts match."""

    def __init__(self):
        self.entries: deque[tuple[weakref.ref, torch.Tensor, ExpertSplits]] = deque()

    def remember(self, node, counts: torch.Tensor, splits: ExpertSplits) -> None:
        self.entries.append((weakref.ref(node, self._forget_dead), counts, splits))

    def take(self, counts: torch.Tensor) -> ExpertSplits | None:
        """In a recompute: the splits of the forward it recomputes (None if there is none)."""
        if not self.entries:
            return None
        _, remembered, splits = self.entries.popleft()
        torch._assert_async(
            (remembered == counts).all(),
            "expert parallel: a recompute routed "
            "differently "
            "from its forward (backward out of forward order?)",
        )
        return splits

    def _forget_dead(self, _) -> None:
        """A graph died: its entry goes (called by the weak reference)."""
        self.entries = deque(entry for entry in self.entries if entry[0]() is not None)


def in_recompute() -> bool:
    """A forward that runs inside a backward pass: activation checkpointing recomputing a block."""
    return torch._C._current_graph_task_id() != -1


def chunk_bounds(length: int, chunks: int) -> list[int]:
    """`chunks` near-equal pieces of range(length): piece c is [bounds[c], bounds[c + 1]), the i
    with i * chunks // length == c (empty pieces when length < chunks)."""
    return [-(-c * length // chunks) for c in range(chunks + 1)]


def joined(pieces: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, without the copy of a single piece."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


class ExpertParallelExperts(nn.Module):
    """GroupedExperts sharded over the expert dimension: the expert rank r holds experts
    [r * E / ep, (r + 1) * E / ep) and exchanges tokens with the other expert ranks.

    Forward: sort this rank's (token, expert) assignments by chunk, then expert; exchange how many
    rows go where (one all-to-all of counts for all chunks); then chunk by chunk send each
    expert's rows (and routing weights) to the rank that owns it, run the grouped GEMM on the local
    experts, send the outputs back, and sum them into their tokens, adding the shared expert's
    output, computed meanwhile. Autograd runs through every all-to-all. Parameter names match
    GroupedExperts.

    The overlap ([parallel] ep_overlap = n chunks). A rank's N tokens split into n chunks of
    consecutive tokens (chunk c: the tokens t with t * n // N == c; under expert capacity, each
    expert's C slots in n ranges), each exchanged by all-to-alls of its own: dispatch (rows and
    routing weights, two collectives) and combine (outputs, one). Each is started, then waited for
    where its result is needed (exchange), and NCCL runs one group's collectives one after another
    in the order they start. Forward:
        start dispatch 0; shared expert                    while dispatch 0 travels
        for c = 0 .. n-1: start dispatch c+1 (if c+1 < n); wait dispatch c;
                          experts on chunk c               while combine c-1, dispatch c+1 travel
                          start combine c
        wait combine 0 .. n-1; sum each token's rows, add the shared expert's
    Backward, in autograd's order (the latest node first), mirrors it:
        start the gradients of combine n-1, n-2, .., 0 (all ready at once)
        for c = n-1 .. 0: wait combine c's; experts' backward on chunk c  while combine c-1 .. 0's
                          and dispatch c+1's travel; start dispatch c's; wait dispatch c+1's
        shared expert's backward                                 while dispatch 0's travels
        wait dispatch 0's
    Exposed: the count exchange, dispatch 0 past the shared expert, combine n-1; in backward
    combine n-1's gradient and dispatch 0's past the shared expert's backward. An activation
    checkpointing recompute runs the forward schedule again, without the count exchange. n = 1 sends
    the micro-batch in one piece, still overlapping its dispatch with the shared expert.

    Host syncs: the all-to-all needs its split sizes on the host, so each forward copies them from
    the device once, every chunk's in one copy, after the count exchange; a recompute reuses them
    (SplitsForRecompute). Under forced balance (`balanced`, see set_balanced_routing) they follow
    from the shapes and nothing is read from the device. Under expert capacity (capacity.py) every
    split is C rows per expert, the exchanges pass no split sizes at all, and the layer compiles
    whole. With [parallel] ep_exchange = "sync_free" (forward_sync_free), dropless, nothing is
    copied either: each chunk sends every rank a worst-case block, the counts stay on the device,
    and the layer compiles whole; the price is ep blocks per chunk on the wire and in memory.
    Compiled, the sized count exchange is a graph break of its own (exchange_counts: host values,
    the recompute's bookkeeping); the chunks' exchanges and experts trace into the graph after it,
    the split sizes as unbacked integers (ExpertSplits.sizes)."""

    def __init__(
        self,
        experts: GroupedExperts,
        group,
        num_experts: int,
        chunks: int = 2,
        exchange: str = "sized",
    ):
        super().__init__()
        if exchange not in EP_EXCHANGES:
            raise ValueError(
                f"[parallel] ep_exchange must be one of {EP_EXCHANGES}, got {exchange!r}"
            )
        if experts.backend != "grouped":
            raise ValueError(
                f"expert parallelism needs experts_backend 'grouped', got {experts.backend!r}"
            )
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(
                f"expert parallelism's overlap (ep_overlap) takes chunks >= 1, got {chunks!r}"
            )
        self.group, self.group_name, self.num_experts = group, group.group_name, num_experts
        self.chunks = chunks  # [parallel] ep_overlap
        self.sync_free = exchange == "sync_free"  # [parallel] ep_exchange
        self.group_align, self.capacity_ratio = experts.group_align, experts.capacity_ratio
        self.balanced = False
        self.recompute_splits = SplitsForRecompute()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        # with lora.py's adapters, their updates too: the adapters come along
        self.swiglu = experts.swiglu
        for name, adapter in experts.named_children():
            self.add_module(name, adapter)

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        shared_expert: nn.Module | None = None,
    ) -> torch.Tensor:
        """x [N, H], weights/indices [N, k] -> the routed experts' output [N, H], plus the shared
        expert's when given (computed while the rows travel)."""
        gate_up, down = _local_shard(self.gate_up_proj), _local_shard(self.down_proj)
        meanwhile = None if shared_expert is None else partial(shared_expert, x)
        forward = self.forward_dropless if self.capacity_ratio is None else self.forward_capacity
        routed, shared = forward(x, weights, indices, gate_up, down, meanwhile)
        routed = routed.to(x.dtype)
        return routed if shared is None else routed + shared

    def forward_dropless(self, x, weights, indices, gate_up, down, meanwhile):
        num_tokens, top_k = indices.shape
        local = gate_up.shape[0]
        # [N]
        chunk_of_token = torch.arange(num_tokens, device=x.device) * self.chunks // num_tokens
        # [N, k]: by chunk, then expert
        keys = chunk_of_token.unsqueeze(1) * self.num_experts + indices
        if self.sync_free:
            return self.forward_sync_free(x, weights, keys, gate_up, down, meanwhile)
        # so by chunk, then rank
        rows = expert_rows(sort_by_expert(keys, self.chunks * self.num_experts, 1), top_k)
        # [N*k, H], [N*k]
        sent, sent_weights = dispatch(x, rows), dispatch_weights(weights, rows, x.dtype)
        bounds = chunk_bounds(num_tokens, self.chunks)
        # each chunk's rows
        pieces = [slice(start * top_k, end * top_k) for start, end in zip(bounds, bounds[1:])]
        splits = self.exchange_counts(keys.flatten(), pieces, local, sent)
        sizes = splits.sizes([piece.stop - piece.start for piece in pieces])
        # [ep * El]
        source_experts = torch.arange(local, device=x.device).repeat(self.num_experts // local)
        align = self.group_align or group_alignment(x.device)

        # rows ordered by source rank, then local expert
        def experts(chunk, received, received_weights):
            expert_of_row = torch.repeat_interleave(
                source_experts, splits.received_counts[chunk], output_size=received.shape[0]
            )  # [R]
            return local_experts_forward(
                received, received_weights, expert_of_row, gate_up, down, align, self.swiglu
            )

        returned, shared = self.exchange(
            [(sent[piece], sent_weights[piece]) for piece in pieces], sizes, experts, meanwhile
        )
        return combine(joined(returned), rows), shared

    def forward_sync_free(self, x, weights, keys, gate_up, down, meanwhile):
        """Dropless with no host sync ([parallel] ep_exchange = "sync_free"): chunk c sends every
        expert rank a static block (padded_send_plan), so each all-to-all has equal splits known
        from the shapes; the counts travel on the device (exchange_counts_on_device), and each
        chunk's experts use them to find each received row's expert (received_experts) and leave
        the empty rows out of the grouped GEMM. Costs: ep blocks per chunk on the wire and in the
        buffers (peer_block_rows: ep * min(k, El) / k times the rows the sized exchange moves)."""
        num_tokens, top_k = keys.shape
        local = gate_up.shape[0]
        ep, flat = self.num_experts // local, keys.flatten()
        bounds = chunk_bounds(num_tokens, self.chunks)
        blocks = [
            peer_block_rows(end - start, top_k, local) for start, end in zip(bounds, bounds[1:])
        ]
        counts = self.exchange_counts_on_device(flat, num_tokens, local)  # [n, ep, El]
        rows = expert_rows(padded_send_plan(flat, blocks, ep, local), top_k)
        # [n * ep * block, H], [n * ep * block]
        sent, sent_weights = dispatch(x, rows), dispatch_weights(weights, rows, x.dtype)
        starts = [ep * sum(blocks[:chunk]) for chunk in range(len(blocks))]
        pieces = [slice(start, start + ep * block) for start, block in zip(starts, blocks)]
        align = self.group_align or group_alignment(x.device)

        # rows ordered by source rank, then local expert, then empty rows: [ep * block, H]
        def experts(chunk, received, received_weights):
            expert_of_row = received_experts(counts[chunk], blocks[chunk])
            return local_experts_forward(
                received, received_weights, expert_of_row, gate_up, down, align, self.swiglu, True
            )

        returned, shared = self.exchange(
            [(sent[piece], sent_weights[piece]) for piece in pieces],
            [([block] * ep, [block] * ep) for block in blocks],
            experts,
            meanwhile,
        )
        return combine(joined(returned), rows), shared

    def forward_capacity(self, x, weights, indices, gate_up, down, meanwhile):
        """Under expert capacity: the buffer [E, C, H] sends C rows per expert to its owner, and the
        outputs come back, in even all-to-alls (chunks of the C slots); the local experts run on the
        [El, ep * Cc, H] rows of every source rank."""
        num_experts, hidden, local = self.num_experts, x.shape[1], gate_up.shape[0]
        ep = num_experts // local
        capacity = expert_capacity(x.shape[0], indices.shape[1], num_experts, self.capacity_ratio)
        rows = capacity_rows(indices, num_experts, capacity)
        buffer = dispatch(x, rows).view(num_experts, capacity, hidden)
        buffer_weights = dispatch_weights(weights, rows, x.dtype).view(num_experts, capacity)
        bounds = chunk_bounds(capacity, self.chunks)
        widths = [end - start for start, end in zip(bounds, bounds[1:])]
        chunks = [
            (buffer[:, start:end].flatten(0, 1), buffer_weights[:, start:end].flatten())
            for start, end in zip(bounds, bounds[1:])
        ]  # [E * Cc, H], [E * Cc]

        # [ep * El * Cc, H]: by source, local expert, slot
        def experts(chunk, received, received_weights):
            width = widths[chunk]
            by_expert = (
                received.view(ep, local, width, hidden)
                .transpose(0, 1)
                .reshape(local, ep * width, hidden)
            )
            weights_by_expert = (
                received_weights.view(ep, local, width).transpose(0, 1).reshape(local, ep * width)
            )
            out = batched_swiglu(by_expert, weights_by_expert, gate_up, down)  # [El, ep * Cc, H]
            return out.view(local, ep, width, hidden).transpose(0, 1).reshape(-1, hidden)

        sizes = [([local * width] * ep, [local * width] * ep) for width in widths]
        returned, shared = self.exchange(chunks, sizes, experts, meanwhile)
        out = joined(
            [piece.view(num_experts, width, hidden) for piece, width in zip(returned, widths)],
            dim=1,
        )
        return combine(out.flatten(0, 1), rows), shared

    def exchange(
        self,
        chunks: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[Sizes],
        experts: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
        meanwhile: Callable[[], torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The overlapped schedule of the class docstring. chunks[c]: chunk c's rows [S_c, H],
        ordered by expert rank, and their routing weights [S_c]; sizes[c]: its (send, receive);
        experts(c, rows, weights): the local experts' outputs for the rows chunk c received;
        meanwhile: work that needs no exchange -> each chunk's outputs back [S_c, H], in its send
        order, and meanwhile's result."""
        dispatches = [self.send_rows(*chunks[0], sizes[0])]
        side = None if meanwhile is None else meanwhile()
        combines = []
        for chunk in range(len(chunks)):
            if chunk + 1 < len(chunks):
                dispatches.append(self.send_rows(*chunks[chunk + 1], sizes[chunk + 1]))
            rows, weights = (exchange.finish() for exchange in dispatches[chunk])
            combines.append(self.return_rows(experts(chunk, rows, weights), sizes[chunk]))
        return [exchange.finish() for exchange in combines], side

    def send_rows(
        self, rows: torch.Tensor, weights: torch.Tensor, sizes: Sizes
    ) -> tuple[Exchange, Exchange]:
        """Start a chunk's dispatch: its rows [S, H] and their weights [S] to their experts'
        ranks."""
        send, receive = sizes
        return (
            start_exchange(rows, receive, send, self.group_name),
            start_exchange(weights, receive, send, self.group_name),
        )

    def return_rows(self, out: torch.Tensor, sizes: Sizes) -> Exchange:
        """Start a chunk's combine: the experts' outputs [R, H] back to the ranks that sent the
        rows."""
        send, receive = sizes
        return start_exchange(out, send, receive, self.group_name)

    def exchange_counts_on_device(
        self, keys: torch.Tensor, num_tokens: int, local_experts: int
    ) -> torch.Tensor:
        """sync_free's count exchange, device to device: keys [N*k] are chunk * E + expert ->
        [n, ep (source), El] the rows each source sends each local expert per chunk. Each rank's
        token count travels too, and a mismatch stops the layer (an error raised on the device)
        before any row is sent: every rank must size its blocks alike."""
        ep = self.num_experts // local_experts
        counts = expert_counts(keys, self.chunks * self.num_experts)  # [n * E]
        # [ep, n * El + 1]: per destination rank, its experts' counts and this rank's token count
        to_ranks = torch.cat(
            [
                counts.view(self.chunks, ep, local_experts).transpose(0, 1).flatten(1),
                counts.new_full((ep, 1), num_tokens),
            ],
            dim=1,
        )
        from_ranks = _c10d.wait_tensor(
            _c10d.all_to_all_single(to_ranks, [1] * ep, [1] * ep, self.group_name)
        )
        torch._assert_async(
            (from_ranks[:, -1] == num_tokens).all(),
            "[parallel] ep_exchange = 'sync_free' needs every expert rank to route the same "
            "number of tokens per micro-batch (its blocks are sized from them); use 'sized'",
        )
        return from_ranks[:, :-1].view(ep, self.chunks, local_experts).transpose(0, 1)

    @torch.compiler.disable
    def exchange_counts(
        self, keys: torch.Tensor, pieces: list[slice], local_experts: int, sent: torch.Tensor
    ) -> ExpertSplits:
        """How many rows go to and come from each expert rank, per chunk: keys [N*k] are chunk * E +
        expert, chunk c's rows are pieces[c] of them. sent: the dispatched rows, whose autograd node
        a remembered entry lives as long as. Eager in a compiled block: host values and
        bookkeeping."""
        import torch.distributed as dist

        ep = dist.get_world_size(self.group)
        if self.balanced:
            return balanced_splits(
                pieces, self.num_experts, ep, dist.get_rank(self.group), keys.device
            )
        counts = expert_counts(keys, self.chunks * self.num_experts)  # [n * E] rows this rank sends
        recomputing = in_recompute()
        remembered = self.recompute_splits.take(counts) if recomputing else None
        if remembered is not None:
            return remembered
        # [ep, n, El]
        to_ranks = counts.view(self.chunks, ep, local_experts).transpose(0, 1).contiguous()
        from_ranks = torch.empty_like(to_ranks)  # [ep (source), n, El]
        dist.all_to_all_single(from_ranks, to_ranks, group=self.group)
        per_rank = torch.stack([to_ranks.sum(2), from_ranks.sum(2)]).transpose(1, 2)  # [2, n, ep]
        send, receive = per_rank.tolist()  # the layer's one device-to-host copy
        splits = ExpertSplits(from_ranks.transpose(0, 1).reshape(self.chunks, -1), send, receive)
        if sent.grad_fn is not None and not recomputing:
            self.recompute_splits.remember(sent.grad_fn, counts, splits)
        return splits


def balanced_splits(
    pieces: list[slice], num_experts: int, ep: int, rank: int, device: torch.device
) -> ExpertSplits:
    """The splits of forced-balance routing (balanced_choices) from the shapes alone: every expert
    rank routes the same assignments (equal micro-batches), chunk c those in pieces[c], and
    assignment a goes to expert a % E (balanced_counts(a, E) counts those below a)."""
    local = num_experts // ep
    mine = torch.arange(rank * local, (rank + 1) * local, device=device)

    # [El] assignments below it for each of my experts, no copy
    def below(assignment: int) -> torch.Tensor:
        return assignment // num_experts + (mine < assignment % num_experts).long()

    send, receive, received_counts = [], [], []
    for piece in pieces:
        counts = [
            end - start
            for end, start in zip(
                balanced_counts(piece.stop, num_experts), balanced_counts(piece.start, num_experts)
            )
        ]
        per_rank = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
        send.append(per_rank)
        receive.append([per_rank[rank]] * ep)
        received_counts.append((below(piece.stop) - below(piece.start)).repeat(ep))  # [ep * El]
    return ExpertSplits(torch.stack(received_counts), send, receive)
