"""The seam between a model's forward and the parallel layouts: what a layout adds to the math.

A model's forward reads as on one device: embedding -> blocks -> norm -> head and loss
(flint_model.py, large4.py). What a layout changes reaches it through one object, the model's
`stage` (a StageContext: by default one device; parallel.py gives each context-parallel rank its
own), which plans each call (a ForwardPlan) and answers the forward's few questions:
- Pipeline parallelism: which layers this rank runs, and whether its embedding and head, is the
  model itself (pipeline.py deletes the rest; the forward passes over what is missing, as
  torchtitan's decoder does). A stage without the embedding starts from what the stage before
  sent (`received`); one without the head returns what the next stage takes (`send`).
- Context parallelism: every rank of a cp group is given the whole batch and computes the queries
  at its share of the positions (`mine`, `local`); its blocks gather keys and values over the
  group (`gather`), and its loss is its share of the whole sequence's mean (`loss`).
- The router losses (balance.py): each MoE block adds small statistics as it runs (`block`); they
  start at the first stage, cross each stage boundary after the model's own tensors (`send`), and
  become a loss after the last layer (`loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from balance import RouterLosses, Stats, real_tokens
from layers import Gather, call_arguments, context_share, default_positions

if TYPE_CHECKING:
    import torch.distributed as dist

# A cp rank's queries: the sequence length and device -> the positions this rank computes [T / cp].
Queries = Callable[[int, torch.device], torch.Tensor]


@dataclass(frozen=True)
class StageContext:
    """What a layout tells a model's forward beyond the layers the model holds. The default is one
    device; parallel.context_parallel builds a context-parallel rank's."""

    cp: int = 1  # ranks of the cp group, which split each sequence between them
    group: dist.ProcessGroup | None = None  # the cp group (None: no context parallelism)
    queries: Queries | None = None  # this rank's positions, with cp > 1
    # [B, T / cp, ...] at this rank's positions -> the whole sequence's [B, T, ...], with cp > 1
    gather: Gather | None = None

    def plan(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        targets: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> ForwardPlan:
        """One call of `model`'s forward (its arguments) -> its plan. Where the model holds the
        embedding (the whole model, a first stage), inputs is input_ids [B, T], optionally followed
        by targets, doc_ids and positions as in model(ids, targets), each checked here; on a later
        stage, what the stage before sent: the model's tensors, then the router-loss statistics
        when a router loss is on, so the rest come by keyword. Positions default to restarting at
        each document."""
        first = model.embed_tokens is not None
        input_ids, received = None, inputs
        if first:
            (input_ids,), targets, doc_ids, positions = call_arguments(
                type(model).__name__, inputs, targets, doc_ids, positions
            )
            model.check_inputs(input_ids, targets, doc_ids, positions)
            received = ()
        x = inputs[0]  # token ids [B, T], or a later stage's hidden states [B, T / cp, H]
        batch, seq_len, device = x.shape[0], x.shape[1] * (1 if first else self.cp), x.device
        mine = self.queries(seq_len, device) if self.cp > 1 else None  # [T / cp]
        if positions is None:
            positions = default_positions(doc_ids, batch, seq_len, device)
        losses, stats, real = model.router_losses, None, None
        if losses.active and targets is not None:  # in training with a router loss on
            carried = len(losses.fields)
            stats = losses.start(batch, device) if first else losses.unpack(inputs[-carried:])
            received = received if first else inputs[:-carried]
            real = real_tokens(doc_ids, batch, seq_len, device)  # [B, T]
        return ForwardPlan(
            self,
            losses,
            input_ids,
            received,
            targets=targets,
            doc_ids=doc_ids,
            positions=positions,
            batch=batch,
            seq_len=seq_len,
            device=device,
            mine=mine,
            stats=stats,
            real=real,
        )


ONE_DEVICE = StageContext()


@dataclass
class ForwardPlan:
    """One forward call on this rank (StageContext.plan): its inputs, and what the layout adds to
    the model's math. `ForwardPlan()` adds nothing (generation's path through the blocks)."""

    stage: StageContext = ONE_DEVICE
    router_losses: RouterLosses | None = None
    input_ids: torch.Tensor | None = None  # token ids [B, T] where the model holds the embedding
    # on a later pipeline stage, what the stage before sent, its statistics taken off
    received: tuple[torch.Tensor, ...] = ()
    targets: torch.Tensor | None = None  # [B, T], shifted, -100 ignored; a cp rank holds them all
    doc_ids: torch.Tensor | None = None  # [B, T], < 0: padding
    positions: torch.Tensor | None = None  # [B, T], of every position
    batch: int = 0
    seq_len: int = 0  # T, the whole sequence (a cp rank computes T / cp of it)
    device: torch.device | None = None
    mine: torch.Tensor | None = None  # this cp rank's positions [T / cp]; None: all of them
    stats: Stats | None = None  # the router losses' statistics so far (None: no router loss now)
    real: torch.Tensor | None = None  # with the statistics: which positions hold a token [B, T]

    def __post_init__(self) -> None:
        self.local_real = self.local(self.real)  # [B, T / cp]: what blocks weigh statistics by

    @property
    def gather(self) -> Gather | None:
        return self.stage.gather

    def local(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's share of t [B, T, ...]: [B, T / cp, ...] (t itself without cp)."""
        return t if t is None or self.mine is None else t[:, self.mine]

    def block(self, layer: nn.Module, *inputs, **settings):
        """layer(*inputs, **settings) with this rank's gather; with the router losses on, the block
        also takes the statistics so far and returns them with its own added, as its last output,
        which this plan keeps. -> the block's other outputs (one tensor, or their tuple)."""
        if self.stats is None:
            return layer(*inputs, gather=self.gather, **settings)
        *outputs, self.stats = layer(
            *inputs, gather=self.gather, stats=self.stats, real=self.local_real, **settings
        )
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def send(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a stage without the head returns, for the next: its tensors, then the statistics."""
        return tensors + (() if self.stats is None else self.router_losses.pack(self.stats))

    def loss(self, head_loss: torch.Tensor) -> torch.Tensor:
        """The head's mean loss over this rank's targets -> the forward's loss: under context
        parallelism this rank's share of the mean over the whole sequence (layers.context_share),
        plus the router losses when on (under cp, this rank's share of them: balance.py)."""
        loss = head_loss
        if self.mine is not None:
            loss = context_share(head_loss, self.targets, self.mine, self.stage.cp)
        if self.stats is None:
            return loss
        return loss + self.router_losses.loss(self.stats, self.real, self.targets, self.stage.group)
