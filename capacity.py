"""Optional expert capacity ([model] capacity_factor; None, the default, is dropless).

With a factor c, each expert takes at most C = min(N, ceil(c * N * k / E)) rows per forward
(training, validation and generation alike), N the tokens this rank's forward holds (its
micro-batch: a pipeline micro-batch under pp, its shard of the sequence under cp), k the experts per
token, E the routed experts. The routed experts then run on a static [E, C, H] buffer, so no shape
depends on the routing: under expert parallelism every all-to-all split is C * E / ep rows, known
from the shapes, and an MoE block compiles whole.

Which assignments drop: an expert keeps the (token, expert) assignments of the earliest tokens, by
position in the micro-batch (the [B, T] tokens flattened row by row), and drops the rest, as Switch
Transformer and GShard do. A token's k choices go to k distinct experts, so the order of its
choices never matters. A dropped assignment contributes zero, and the token's other weights are
not renormalised: the shared expert and the residual stream still carry the token.

Under expert parallelism the capacity is per source rank: each rank keeps at most C rows of its own
tokens per expert and sends exactly C rows per expert (empty slots are zero rows), so an expert
receives ep * C rows, and a rank's tokens meet the same drops with expert parallelism as without.
Every expert rank must then route micro-batches of the same size (as training's are).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.nn.functional as F


def check_capacity_factor(factor: object) -> None:
    """The configs' capacity_factor (a runtime field of both models): None (dropless) or a finite
    number > 0."""
    if factor is not None and (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not 0 < factor < math.inf
    ):
        raise ValueError(
            "capacity_factor must be a finite number > 0 (rows per expert over the "
            "balanced share "
            f"tokens * k / E) or unset for dropless routing, got {factor!r}"
        )


def capacity_ratio(factor: float) -> tuple[int, int]:
    """The factor as the fraction it was written as: 1.1 is 11/10, not the binary float just above
    it (with which 1.1 * 100 / 10 is 11.000000000000002, a row too many). Integers, so that the
    capacity traces into a compiled graph as integer arithmetic, whatever the factor."""
    fraction = Fraction(str(factor))
    return fraction.numerator, fraction.denominator


def expert_capacity(tokens: int, top_k: int, num_experts: int, ratio: tuple[int, int]) -> int:
    """C = ceil(factor * tokens * top_k / num_experts) for the factor's capacity_ratio, at most
    `tokens`: an expert takes each token at most once, so a factor above num_experts / top_k counts
    as that."""
    numerator, denominator = (
        ratio if ratio[0] * top_k <= ratio[1] * num_experts else (num_experts, top_k)
    )
    return -(-numerator * tokens * top_k // (denominator * num_experts))


def dropped_assignments(counts: torch.Tensor, top_k: int, ratio: tuple[int, int]) -> torch.Tensor:
    """The assignments past capacity, per expert [E], of a forward whose router counted `counts` [E]
    (moe.Router's tokens_per_expert: N * k in all), on the device: what balance.RoutingMonitor
    logs."""
    counts = counts.long()
    return (counts - expert_capacity(counts.sum() // top_k, top_k, counts.numel(), ratio)).clamp(
        min=0
    )


class CapacityPlan(NamedTuple):
    """Where each (token, choice) assignment a = token * k + choice sits in the [E * C] buffer
    rows."""

    sources: torch.Tensor  # [E * C] the assignment in each buffer row; N * k: an empty row
    slots: torch.Tensor  # [N * k] the buffer row of each assignment; E * C: dropped


def plan_capacity(indices: torch.Tensor, num_experts: int, capacity: int) -> CapacityPlan:
    """Expert indices [N, k] -> the buffer layout keeping each expert's earliest `capacity`
    assignments, with static shapes and no host sync."""
    flat = indices.flatten()  # [A = N*k]
    assignments = flat.numel()
    order = torch.argsort(flat, stable=True)  # by expert, then by assignment (token) order
    sorted_experts = flat[order]
    expert_ids = torch.arange(num_experts, device=flat.device)
    # [E] each expert's first sorted position
    starts = torch.searchsorted(sorted_experts, expert_ids)
    counts = torch.searchsorted(sorted_experts, expert_ids, right=True) - starts  # [E]
    # place within its expert
    rank = torch.arange(assignments, device=flat.device) - starts[sorted_experts]
    dropped_slot = num_experts * capacity
    slot_sorted = torch.where(rank < capacity, sorted_experts * capacity + rank, dropped_slot)
    # [A], back to assignment order
    slots = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    place = torch.arange(capacity, device=flat.device)
    # [E, C] sorted position of a slot
    position = (starts.unsqueeze(1) + place).clamp(max=assignments - 1)
    # [E * C]
    sources = torch.where(place < counts.unsqueeze(1), order[position], assignments).flatten()
    return CapacityPlan(sources, slots)


def batched_swiglu(
    rows: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> torch.Tensor:
    """rows [G, C, H], one group per expert, and their routing weights [G, C] -> weight * each row's
    expert SwiGLU [G, C, H]: a batched matmul per projection (equal groups need no grouped GEMM),
    the weight applied to the hidden row before the down projection (as moe.grouped_swiglu)."""
    gate, up = torch.bmm(rows, gate_up_proj).chunk(2, dim=-1)  # [G, C, Im] each
    return torch.bmm(F.silu(gate) * up * weights.unsqueeze(-1), down_proj)
