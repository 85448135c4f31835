"""The router losses, formed per micro-batch from small statistics that each MoE layer adds as it runs.

Three terms, each off at coefficient 0 (the released configs):
  - balance (Flint's published `router_aux_loss_coef`, with `output_router_logits`): the Switch
    Transformer term as transformers' FlintForCausalLM computes it, pooled over all MoE layers of the
    forward: per layer, p = softmax(router logits) and its top-k experts; summed over the real tokens
    and the layers, divided by (real tokens x MoE layers): f_e (top-k share, sums to k) and P_e (mean
    probability); coef * E * sum_e f_e * P_e. Balanced routing gives coef * k.
  - sequence (DeepSeek-V3, arXiv 2412.19437, section 2.1.2, eqs. 17-20): per MoE layer and sequence,
    alpha * sum_e f_e * P_e with f_e = E / (k * T) * (tokens of the sequence routed to e) and P_e the
    mean over its T tokens of s'_e, the router's scores (sigmoid for Flint, softmax for Large 4)
    normalised to sum 1 over all experts. Summed over layers; the sequences are weighed by their loss
    tokens (targets != -100), so that each weighs the same however a step is cut into micro-batches
    and ranks (all rows full: the plain mean over sequences). With packed documents a sequence is a
    row. Routed to: the experts the router chose (with a selection bias, the biased choice).
  - z (ST-MoE, arXiv 2202.08906, eq. 5): coef * the mean over the real tokens of
    logsumexp(router logits)^2, summed over MoE layers.

Why statistics and not a finished term per layer: the published balance term pools the counts of all
layers, so no layer's term is known before the last MoE layer has run. Each MoE layer instead adds its
statistics ([E] or [B, E] numbers per layer, never its [N, E] logits) to a dict that the blocks pass
along as an explicit input and output (a pipeline stage sends it on with the hidden state); the
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce

from moe import router_scores

# Both models' config fields beyond the published formats (0: off; the papers' values in CONFIG.md).
COEFFICIENTS = ("router_sequence_loss_coef", "router_z_loss_coef")
Stats = dict[str, torch.Tensor]  # the statistics of the layers run so far, by name (FIELDS)
# name -> (shape in (E, M moe layers, B rows), dtype): counts are exact integers and carry no gradient
FIELDS = {"balance_counts": (("E",), torch.int32), "balance_probs": (("E",), torch.float32),
          "sequence_counts": (("M", "B", "E"), torch.int32), "sequence_scores": (("M", "B", "E"), torch.float32),
          "z": ((1,), torch.float32)}


def check_coefficients(config: object) -> None:
    """A config's router-loss coefficients (COEFFICIENTS): numbers >= 0."""
    for name in COEFFICIENTS:
        value = getattr(config, name)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"{name} must be a number >= 0 (0: off), got {value!r}")


def real_tokens(doc_ids: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
    """Which positions hold a token, not padding: doc_ids [B, T] >= 0 (all, without doc_ids) -> bool [B, T]."""
    return torch.ones(batch, seq_len, dtype=torch.bool, device=device) if doc_ids is None else doc_ids >= 0


def real_counts(indices: torch.Tensor, real: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the real entries pick each expert: expert ids [..., n] and real [..., n] (false:
    padding) -> int32 [..., E]. A scatter-add into a fixed size, as moe.expert_counts: no
    data-dependent shape, no host sync."""
    zeros = torch.zeros(*indices.shape[:-1], num_experts, dtype=torch.int32, device=indices.device)
    return zeros.scatter_add_(-1, indices, real.int())


def add_layer(stats: Stats, slot: int, logits: torch.Tensor, indices: torch.Tensor, real: torch.Tensor,
              score_function: str) -> Stats:
    """One MoE layer's share of the statistics (those `stats` holds, see RouterLosses.fields): its
    router's FP32 logits [B, T, E] and chosen experts [B, T, k], real [B, T] (false: padding), slot:
    its place among the model's MoE layers, score_function: its router's (sigmoid | softmax)."""
    batch, _, num_experts = logits.shape
    top_k, weight = indices.shape[-1], real.float()  # [B, T]
    out = dict(stats)
    if "balance_probs" in stats:
        flat, rows = logits.reshape(-1, num_experts), weight.reshape(-1)  # [N, E], [N]
        probs = torch.softmax(flat, dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [N, k]: of the softmax, as the reference
        chosen_real = real.reshape(-1).repeat_interleave(top_k)  # [N * k]
        out["balance_counts"] = stats["balance_counts"] + real_counts(chosen.flatten(), chosen_real, num_experts)
        out["balance_probs"] = stats["balance_probs"] + (probs * rows.unsqueeze(-1)).sum(dim=0)
    if "sequence_scores" in stats:
        scores = router_scores(logits, score_function)
        scores = scores / scores.sum(dim=-1, keepdim=True)  # s': sums to 1 over the experts
        routed = real_counts(indices.reshape(batch, -1), real.repeat_interleave(top_k, dim=1), num_experts)  # [B, E]
        slot_index = torch.full((1,), slot, device=logits.device)
        out["sequence_counts"] = stats["sequence_counts"].index_add(0, slot_index, routed.unsqueeze(0))
        out["sequence_scores"] = stats["sequence_scores"].index_add(
            0, slot_index, (scores * weight.unsqueeze(-1)).sum(dim=1).unsqueeze(0))  # [1, B, E]
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
        return {name: torch.zeros(self._shape(name, rows), dtype=FIELDS[name][1], device=device)
                for name in self.fields}

    def boundary(self, rows: int) -> tuple[torch.Tensor, ...]:
        """What crosses a pipeline boundary, as meta tensors (requires_grad where a gradient flows back)."""
        return tuple(torch.empty(self._shape(name, rows), dtype=FIELDS[name][1], device="meta",
                                 requires_grad=FIELDS[name][1].is_floating_point) for name in self.fields)

    def pack(self, stats: Stats) -> tuple[torch.Tensor, ...]:
        return tuple(stats[name] for name in self.fields)

    def unpack(self, tensors: tuple[torch.Tensor, ...]) -> Stats:
        if len(tensors) != len(self.fields):
            raise ValueError(f"router losses: a stage received {len(tensors)} statistics, expected "
                             f"{len(self.fields)} ({', '.join(self.fields)})")
        return dict(zip(self.fields, tensors))

    def loss(self, stats: Stats, real: torch.Tensor, targets: torch.Tensor, cp_group=None) -> torch.Tensor:
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
            share = counts["balance_counts"].float() / pooled * stats["balance_probs"] / pooled  # f_e * P_e
            total = total + self.balance * (self.num_experts * torch.sum(share))
        if self.sequence:
            row_tokens = real.sum(dim=1).float().clamp(min=1).view(1, -1, 1)  # [1, B, 1]: T of each sequence
            f = counts["sequence_counts"].float() * (self.num_experts / self.top_k) / row_tokens  # [M, B, E]
            per_sequence = (f * stats["sequence_scores"] / row_tokens).sum(dim=-1)  # [M, B]
            loss_tokens = (targets != -100).sum(dim=1).float()  # [B]
            total = total + self.sequence * (per_sequence * loss_tokens).sum() / loss_tokens.sum().clamp(min=1)
        if self.z:
            total = total + self.z * stats["z"].sum() / tokens
        return total if cp_group is None else total * dist.get_world_size(cp_group)
