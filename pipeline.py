"""Pipeline parallelism: a model cut into stages, the view of a rank's stages under native names,
and the schedule that runs them (torch.distributed.pipelining). parallel.py decides which stages a
rank holds; a stage is the model itself with the other stages' layers deleted, so its forward is the
model's and its parameter names stay the native ones."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _add_unshard_reshard,
    _ComputationType,
)

if TYPE_CHECKING:
    from parallel import ParallelConfig


class ForwardOnlyEvaluation:
    """A V schedule whose evaluation runs forwards only: on each rank, every micro-batch through its
    first stage, then through its second (GPipe over the V). torch 2.13's `eval` runs the schedule's
    own actions with the backward switched off, and the backward of a stage whose previous stage
    sits on the same rank (the turn of the V) then fails ("can't steal_bwd_input if this stage
    doesn't have backward"): evaluation, and with it the run's final checkpoint, never happened
    under these schedules. The training actions are kept and put back after each evaluation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pp = self.pp_group_size
        forwards = {
            rank: _add_unshard_reshard(
                [
                    _Action(stage, _ComputationType.FORWARD, micro)
                    for stage in (rank, 2 * pp - 1 - rank)
                    for micro in range(self._n_microbatches)
                ]
            )
            for rank in range(pp)
        }
        # The sends and receives, placed as torch places them for a training order (whose
        # validation, which asks for a backward of every micro-batch, a forward-only order cannot
        # pass).
        self.forward_order = _add_send_recv(
            forwards, lambda stage: self.stage_index_to_group_rank[stage], self._num_stages
        )

    def eval(self, *args, **kwargs):
        training, self.pipeline_order_with_comms = (
            self.pipeline_order_with_comms,
            self.forward_order,
        )
        try:
            return super().eval(*args, **kwargs)
        finally:
            self.pipeline_order_with_comms = training


class ZBVZeroBubble(ForwardOnlyEvaluation, ScheduleZBVZeroBubble):
    """torch's ZBVZeroBubble, evaluating with forward passes only."""


class DualPipeV(ForwardOnlyEvaluation, ScheduleDualPipeV):
    """torch's DualPipeV, evaluating with forward passes only."""


SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "ZBVZeroBubble": ZBVZeroBubble,
    "DualPipeV": DualPipeV,
}
# Schedules of two stages per rank placed in a V: rank r holds stages r and 2 * pp - 1 - r, so the
# last stage sits beside the first and the backward turns around on one rank.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def pipeline_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of the model holding only the layers of `stage` (contiguous, as even as possible);
    the embedding (and whatever else the model lists in `first_stage_modules`) stays on the first
    stage, norm and head on the last."""
    layers = len(model.layers)
    if num_stages > layers:
        raise ValueError(
            f"[parallel] {num_stages} pipeline stages need at least as many layers, got {layers}"
        )
    owned = set(range(stage * layers // num_stages, (stage + 1) * layers // num_stages))
    part = copy.deepcopy(model)
    for name in list(part.layers):
        if int(name) not in owned:
            del part.layers[name]
    if stage > 0:
        for name in part.first_stage_modules:
            setattr(part, name, None)
    if stage < num_stages - 1:
        part.norm = part.lm_head = None
    return part


def merged_view(parts: list[nn.Module]) -> nn.Module:
    """One module with the native parameter names over all of this rank's pipeline stages, for
    the optimizer and for checkpoints (it shares, not copies, the stages' modules)."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                view.layers.update(child)
            elif child is not None:
                setattr(view, name, child)
    return view


def pipeline_schedule(
    parts: list[nn.Module],
    stage_ids: list[int],
    cfg: ParallelConfig,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch_shape: tuple[int, int],
) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
    """This rank's stages and their schedule for batches of batch_shape (rows, seq_len). A stage
    that declares its input and output tensors (`stage_io(rows, seq_len, dtype)`, meta tensors, in
    the bulk compute `dtype`) gets static metadata; shape inference, which runs a stage on
    uninitialised inputs, serves the others."""
    num_stages = cfg.pp * cfg.stages_per_rank
    microbatches = cfg.pp_microbatches or num_stages
    rows, seq_len = batch_shape
    if rows % microbatches:
        raise ValueError(
            f"[parallel] pp_microbatches = {microbatches} must divide the {rows} rows of a batch"
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    ios = [part.stage_io(rows // microbatches, seq_len, dtype) for part in parts]
    stages = [
        PipelineStage(
            part,
            s,
            num_stages,
            device,
            input_args=inputs,
            output_args=outputs,
            group=mesh["pp"].get_group(),
        )
        for part, s, (inputs, outputs) in zip(parts, stage_ids, ios)
    ]
    # scale_grads=False: the loss function already weighs each micro-batch by its tokens.
    return SCHEDULES[cfg.pp_schedule](
        stages if cfg.stages_per_rank > 1 else stages[0],
        microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
