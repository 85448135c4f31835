"""Expert load balance: the router losses that pull the routers towards balance, the aux-loss-free
selection bias that pushes them, and the monitor that measures the loads while training.

## The router losses, formed per micro-batch from the small statistics each MoE layer adds.

Three terms, each off at coefficient 0 (the released configs):
  - balance (Flint's published `router_aux_loss_coef`, with `output_router_logits`): the Switch
    Transformer term as transformers' FlintForCausalLM computes it, pooled over all MoE layers of
    the forward: per layer, p = softmax(router logits) and its top-k experts; summed over the real
    tokens and the layers, divided by (real tokens x MoE layers): f_e (top-k share, sums to k) and
    P_e (mean probability); coef * E * sum_e f_e * P_e. Balanced routing gives coef * k.
  - sequence (DeepSeek-V3, arXiv 2412.19437, section 2.1.2, eqs. 17-20): per MoE layer and sequence,
    alpha * sum_e f_e * P_e with f_e = E / (k * T) * (tokens of the sequence routed to e) and P_e
    the mean over its T tokens of s'_e, the router's scores (sigmoid for Flint, softmax for Large 4)
    normalised to sum 1 over all experts. Summed over layers; the sequences are weighed by their
    loss tokens (targets != -100), so that each weighs the same however a step is cut into
    micro-batches and ranks (all rows full: the plain mean over sequences). With packed documents a
    sequence is a row. Routed to: the experts the router chose (with a selection bias, the biased
    choice).
  - z (ST-MoE, arXiv 2202.08906, eq. 5): coef * the mean over the real tokens of
    logsumexp(router logits)^2, summed over MoE layers.

Why statistics and not a finished term per layer: the published balance term pools the counts of all
layers, so no layer's term is known before the last MoE layer has run. Each MoE layer instead adds
its statistics ([E] or [B, E] numbers per layer, never its [N, E] logits) to a dict that the blocks
pass along as an explicit input and output (a pipeline stage sends it on with the hidden state); the
model forms the loss after its last layer and adds it to the cross-entropy. Gradients reach every
router by ordinary autograd, through the pipeline's own backward and whatever weight the trainer
gives the loss. (An autograd function injecting each layer's gradient in backward, torchtitan's
proposal, would need there every later layer's counts and, on an early pipeline stage, the weight
the trainer gives the loss: neither is at hand.) The result is exact in every layout:
  - pp: the statistics cross the stage boundaries; the last stage holds all layers' sums.
  - cp: a rank sees its positions only. Expert counts (no gradient) are summed over the cp group;
    the probability, score and logsumexp sums are linear in the tokens, so each rank returns cp x
    its share (FSDP averages gradients over the cp ranks, as for the cross-entropy's context_share):
    the mean over the group of the values and of the gradients is the whole sequence's.
  - dp and ep: per micro-batch of each rank (the reference's forward), not pooled over ranks.
The balance and z terms are means over a micro-batch, as the reference's over its forward, so how a
step is cut into micro-batches (a pipeline's, gradient accumulation, data-parallel ranks) changes
them; the sequence-wise term does not depend on the cut. A row of padding only counts for nothing.

## Routing health while training: expert loads per MoE layer, a warning for idle experts, and the
aux-loss-free balancing bias.

Every router counts the tokens each expert received in its last forward (moe.Router's
tokens_per_expert). After each optimizer step the trainer sums those counts over all processes
(one small all-reduce of [layers, experts]) and hands them to `RoutingMonitor`, which
  - keeps, per expert, how many steps in a row it received no token, and warns once when an
    expert has been idle for `idle_steps` steps;
  - with `router_bias_update_rate` > 0, moves each router's selection bias towards balance, as
    DeepSeek-V3 does without an auxiliary loss: bias_e += rate * sign(mean load - load_e). The
    bias only chooses experts; the gate weights stay the unbiased scores (sigmoid or softmax);
  - reports, at logged steps, each layer's max and min load over the mean load (1.0 and 1.0:
    perfectly balanced; min 0: an expert got nothing) and every expert's token count (routed,
    before any drop), under expert capacity (capacity.py) the (token, expert) assignments
    the layer dropped, and each expert's selection bias where the run moves it.
The counts are those of the step's last micro-batch (on every data-parallel rank).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce

from capacity import capacity_ratio, dropped_assignments
from moe import Router, router_scores

if TYPE_CHECKING:
    from registry import ModelConfig

# Both models' config fields beyond the published formats (0: off; the papers' values in CONFIG.md).
COEFFICIENTS = ("router_sequence_loss_coef", "router_z_loss_coef")
# not in the published format: written only when on
NATIVE_FIELDS = ("router_bias_update_rate", *COEFFICIENTS)
Stats = dict[str, torch.Tensor]  # the statistics of the layers run so far, by name (FIELDS)
# name -> (shape in (E, M moe layers, B rows), dtype): counts are exact integers and carry no
# gradient
FIELDS = {
    "balance_counts": (("E",), torch.int32),
    "balance_probs": (("E",), torch.float32),
    "sequence_counts": (("M", "B", "E"), torch.int32),
    "sequence_scores": (("M", "B", "E"), torch.float32),
    "z": ((1,), torch.float32),
}


def check_coefficients(config: object) -> None:
    """A config's router-loss coefficients (COEFFICIENTS): finite numbers >= 0."""
    for name in COEFFICIENTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not (
            isinstance(value, (int, float)) and 0 <= value < math.inf
        ):
            raise ValueError(f"{name} must be a finite number >= 0 (0: off), got {value!r}")


def real_tokens(doc_ids: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
    """Which positions hold a token, not padding: doc_ids [B, T] >= 0 (all, without doc_ids) -> bool
    [B, T]."""
    return (
        torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        if doc_ids is None
        else doc_ids >= 0
    )


def real_counts(indices: torch.Tensor, real: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the real entries pick each expert: expert ids [..., n] and real [..., n] (false:
    padding) -> int32 [..., E]. A scatter-add into a fixed size, as moe.expert_counts: no
    data-dependent shape, no host sync."""
    zeros = torch.zeros(*indices.shape[:-1], num_experts, dtype=torch.int32, device=indices.device)
    return zeros.scatter_add_(-1, indices, real.int())


def add_layer(
    stats: Stats,
    slot: int,
    logits: torch.Tensor,
    indices: torch.Tensor,
    real: torch.Tensor,
    score_function: str,
) -> Stats:
    """One MoE layer's share of the statistics (those `stats` holds, see RouterLosses.fields): its
    router's FP32 logits [B, T, E] and chosen experts [B, T, k], real [B, T] (false: padding), slot:
    its place among the model's MoE layers, score_function: its router's (sigmoid | softmax)."""
    batch, _, num_experts = logits.shape
    top_k, weight = indices.shape[-1], real.float()  # [B, T]
    out = dict(stats)
    if "balance_probs" in stats:
        flat, rows = logits.reshape(-1, num_experts), weight.reshape(-1)  # [N, E], [N]
        probs = torch.softmax(flat, dim=-1)
        # [N, k]: of the softmax, as the reference
        chosen = torch.topk(probs, top_k, dim=-1).indices
        chosen_real = real.reshape(-1).repeat_interleave(top_k)  # [N * k]
        out["balance_counts"] = stats["balance_counts"] + real_counts(
            chosen.flatten(), chosen_real, num_experts
        )
        out["balance_probs"] = stats["balance_probs"] + (probs * rows.unsqueeze(-1)).sum(dim=0)
    if "sequence_scores" in stats:
        scores = router_scores(logits, score_function)
        scores = scores / scores.sum(dim=-1, keepdim=True)  # s': sums to 1 over the experts
        # [B, E]
        routed = real_counts(
            indices.reshape(batch, -1), real.repeat_interleave(top_k, dim=1), num_experts
        )
        slot_index = torch.full((1,), slot, device=logits.device)
        out["sequence_counts"] = stats["sequence_counts"].index_add(
            0, slot_index, routed.unsqueeze(0)
        )
        out["sequence_scores"] = stats["sequence_scores"].index_add(
            0, slot_index, (scores * weight.unsqueeze(-1)).sum(dim=1).unsqueeze(0)
        )  # [1, B, E]
    if "z" in stats:
        out["z"] = stats["z"] + (torch.logsumexp(logits, dim=-1).square() * weight).sum().view(1)
    return out


@dataclass(frozen=True)
class RouterLosses:
    """The router losses one model's config asks for (coefficients 0: off) and what forms them."""

    num_experts: int
    top_k: int
    num_moe_layers: int
    balance: float = 0.0
    sequence: float = 0.0
    z: float = 0.0

    @property
    def fields(self) -> tuple[str, ...]:
        """The statistics the enabled losses need, in the order they cross a pipeline boundary."""
        on = {"balance": self.balance, "sequence": self.sequence, "z": self.z}
        return tuple(name for name in FIELDS if on[name.split("_")[0]])

    @property
    def active(self) -> bool:
        return bool(self.fields)

    def _shape(self, name: str, rows: int) -> tuple[int, ...]:
        sizes = {"E": self.num_experts, "M": self.num_moe_layers, "B": rows}
        return tuple(sizes.get(d, d) for d in FIELDS[name][0])

    def start(self, rows: int, device: torch.device) -> Stats:
        """The statistics before the first layer, for micro-batches of `rows` rows: zeros."""
        return {
            name: torch.zeros(self._shape(name, rows), dtype=FIELDS[name][1], device=device)
            for name in self.fields
        }

    def boundary(self, rows: int) -> tuple[torch.Tensor, ...]:
        """What crosses a pipeline boundary, as meta tensors (requires_grad where a gradient flows
        back)."""
        return tuple(
            torch.empty(
                self._shape(name, rows),
                dtype=FIELDS[name][1],
                device="meta",
                requires_grad=FIELDS[name][1].is_floating_point,
            )
            for name in self.fields
        )

    def pack(self, stats: Stats) -> tuple[torch.Tensor, ...]:
        return tuple(stats[name] for name in self.fields)

    def unpack(self, tensors: tuple[torch.Tensor, ...]) -> Stats:
        if len(tensors) != len(self.fields):
            raise ValueError(
                f"router losses: a stage received {len(tensors)} statistics, expected "
                f"{len(self.fields)} ({', '.join(self.fields)})"
            )
        return dict(zip(self.fields, tensors))

    def loss(
        self, stats: Stats, real: torch.Tensor, targets: torch.Tensor, cp_group=None
    ) -> torch.Tensor:
        """The weighted sum of the enabled losses after the model's last layer. real and targets
        [B, S]: every position of the micro-batch (also under cp, where each rank holds them all);
        cp_group: this rank's share of the losses (see the module docstring)."""
        counts = {name: stats[name] for name in stats if name.endswith("_counts")}
        if cp_group is not None:  # the whole sequences' expert counts (no gradient)
            counts = {name: all_reduce(c, "sum", cp_group) for name, c in counts.items()}
        tokens = real.sum().float().clamp(min=1)
        total = torch.zeros((), device=real.device)
        if self.balance:
            pooled = tokens * self.num_moe_layers  # real tokens x MoE layers
            # f_e * P_e
            share = counts["balance_counts"].float() / pooled * stats["balance_probs"] / pooled
            total = total + self.balance * (self.num_experts * torch.sum(share))
        if self.sequence:
            # [1, B, 1]: T of each sequence
            row_tokens = real.sum(dim=1).float().clamp(min=1).view(1, -1, 1)
            # [M, B, E]
            f = counts["sequence_counts"].float() * (self.num_experts / self.top_k) / row_tokens
            per_sequence = (f * stats["sequence_scores"] / row_tokens).sum(dim=-1)  # [M, B]
            loss_tokens = (targets != -100).sum(dim=1).float()  # [B]
            total = total + self.sequence * (
                per_sequence * loss_tokens
            ).sum() / loss_tokens.sum().clamp(min=1)
        if self.z:
            total = total + self.z * stats["z"].sum() / tokens
        return total if cp_group is None else total * dist.get_world_size(cp_group)


# ==================================================================== routing health while training


class RoutingMonitor:
    def __init__(
        self,
        module: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        idle_steps: int,
        is_main: bool = True,
    ):
        """module: the model (or this rank's stages); idle_steps: warn after this many (0:
        never)."""
        self.config, self.idle_steps, self.is_main = config, idle_steps, is_main
        # Layer index -> router, for the MoE layers this rank holds (a pipeline stage holds some).
        self.routers = {
            int(name.split(".")[1]): m
            for name, m in module.named_modules()
            if isinstance(m, Router)
        }
        self.moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        # [layers, E]
        self.counts = torch.zeros(config.num_hidden_layers, config.num_experts, device=device)
        factor = config.capacity_factor
        self.capacity_ratio = None if factor is None else capacity_ratio(factor)
        # [layers] assignments past capacity
        self.dropped = torch.zeros(config.num_hidden_layers, device=device)
        # steps in a row without a token
        self.idle = torch.zeros_like(self.counts, dtype=torch.long)
        # step a streak reached idle_steps, not yet reported (0: none)
        self.idle_since = torch.zeros_like(self.idle)

    def after_step(self, step: int) -> None:
        """Gather this step's counts, update the idle streaks and the biases: all on the device (no
        host sync); a streak that reaches idle_steps is noted with its step and reported by
        `stats`."""
        if not self.moe_layers:
            return
        self.counts.zero_()
        for layer, router in self.routers.items():
            self.counts[layer] = router.tokens_per_expert.float()
            # per rank, before the sum: each rank drops past its own capacity
            if self.capacity_ratio:
                self.dropped[layer] = dropped_assignments(
                    router.tokens_per_expert, self.config.num_experts_per_tok, self.capacity_ratio
                ).sum()
        if dist.is_initialized():
            # over data-parallel ranks, and the stages that hold each layer
            dist.all_reduce(self.counts)
            if self.capacity_ratio:
                dist.all_reduce(self.dropped)
        self.idle = torch.where(self.counts == 0, self.idle + 1, 0)
        if self.idle_steps:  # the step at which each streak reached idle_steps, until reported
            reached = (self.idle == self.idle_steps) & (self.idle_since == 0)
            self.idle_since = torch.where(reached, step, self.idle_since)
        rate = self.config.router_bias_update_rate
        if rate > 0:
            update_selection_bias(self.routers, self.counts, rate)

    def warn_idle(self) -> None:
        """One warning per idle streak noted since the last report, with the step it reached
        idle_steps."""
        since = self.idle_since.tolist()
        self.idle_since.zero_()
        for layer in self.moe_layers:
            for step in sorted({s for s in since[layer] if s}):
                experts = [e for e, s in enumerate(since[layer]) if s == step]
                if self.is_main:
                    print(
                        f"WARNING: step {step}: layer {layer}: expert(s) "
                        f"{', '.join(map(str, experts))} "
                        f"received no tokens for {self.idle_steps} steps in a row (routing "
                        "collapse: "
                        f"see GUIDE.md, Load balancing)",
                        file=sys.stderr,
                        flush=True,
                    )

    def stats(self) -> dict[str, dict]:
        """At logged steps (the only time the monitor reads the device): the idle-expert warnings
        since the last call, then per MoE layer (by index) the busiest and idlest expert's load over
        the mean load, and the token count of every expert, so that a collapse shows in the record
        before it is complete."""
        if not self.moe_layers:
            return {}
        if self.idle_steps:
            self.warn_idle()
        counts = self.counts[self.moe_layers]  # [moe layers, E]
        load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-9)
        stats = {
            str(layer): {"max_load": round(hi, 3), "min_load": round(lo, 3), "tokens": tokens}
            for layer, hi, lo, tokens in zip(
                self.moe_layers,
                load.max(dim=1).values.tolist(),
                load.min(dim=1).values.tolist(),
                counts.long().tolist(),
            )
        }
        if self.capacity_ratio:
            for layer, dropped in zip(
                self.moe_layers, self.dropped[self.moe_layers].long().tolist()
            ):
                stats[str(layer)]["dropped"] = dropped
        biases = {
            layer: router.selection_bias
            for layer, router in self.routers.items()
            # this rank's layers: all but under pipeline parallel
            if router.selection_bias is not None
        }
        if biases:  # report.py draws how far apart they have moved
            for layer, bias in zip(biases, torch.stack(list(biases.values())).tolist()):
                stats[str(layer)]["bias"] = [round(b, 5) for b in bias]
        return stats


def worst_layer(stats: dict[str, dict[str, float]]) -> str:
    """The log line's summary: the layer whose busiest expert is the busiest, and under expert
    capacity the assignments all layers dropped."""
    if not stats:
        return ""
    layer, worst = max(stats.items(), key=lambda item: item[1]["max_load"])
    dropped = [layer_stats["dropped"] for layer_stats in stats.values() if "dropped" in layer_stats]
    return (
        f" | experts max/min load {worst['max_load']:.2f}/{worst['min_load']:.2f} (layer "
        f"{layer})" + (f", {sum(dropped)} assignments dropped" if dropped else "")
    )


@torch.no_grad()
def update_selection_bias(routers: dict[int, Router], counts: torch.Tensor, rate: float) -> None:
    """counts [layers, E]: each router's bias rises by `rate` for experts below the mean load and
    falls by `rate` for those above it (unchanged at exactly the mean)."""
    for layer, router in routers.items():
        load = counts[layer]
        router.selection_bias += rate * torch.sign(load.mean() - load)
