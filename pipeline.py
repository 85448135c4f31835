"""Pipeline parallelism: a model cut into stages, the view of a rank's stages under native names, and
the schedule that runs them (torch.distributed.pipelining). parallel.py decides which stages a rank
holds; a stage is the model itself with the other stages' layers deleted, so its forward is the
model's and its parameter names stay the native ones.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                         ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

if TYPE_CHECKING:
    from parallel import ParallelConfig

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
# Schedules of two stages per rank placed in a V: rank r holds stages r and 2 * pp - 1 - r, so the
# last stage sits beside the first and the backward turns around on one rank.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def pipeline_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of the model holding only the layers of `stage` (contiguous, as even as possible);
    the embedding (and whatever else the model lists in `first_stage_modules`) stays on the first
    stage, norm and head on the last."""
    layers = len(model.layers)
    if num_stages > layers:
        raise ValueError(f"[parallel] {num_stages} pipeline stages need at least as many layers, got {layers}")
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


def pipeline_schedule(parts: list[nn.Module], stage_ids: list[int], cfg: ParallelConfig, mesh: DeviceMesh,
                      dtype: torch.dtype, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      batch_shape: tuple[int, int]) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
    """This rank's stages and their schedule for batches of batch_shape (rows, seq_len). A stage that
    declares its input and output tensors (`stage_io(rows, seq_len, dtype)`, meta tensors, in the bulk
    compute `dtype`) gets static metadata; shape inference, which runs a stage on uninitialised
    inputs, serves the others."""
    num_stages = cfg.pp * cfg.stages_per_rank
    microbatches = cfg.pp_microbatches or num_stages
    rows, seq_len = batch_shape
    if rows % microbatches:
        raise ValueError(f"[parallel] pp_microbatches = {microbatches} must divide the {rows} rows of a batch")
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    ios = [part.stage_io(rows // microbatches, seq_len, dtype) for part in parts]
    stages = [PipelineStage(part, s, num_stages, device, input_args=inputs, output_args=outputs,
                            group=mesh["pp"].get_group()) for part, s, (inputs, outputs) in zip(parts, stage_ids, ios)]
    # scale_grads=False: the loss function already weighs each micro-batch by its tokens.
    return SCHEDULES[cfg.pp_schedule](stages if cfg.stages_per_rank > 1 else stages[0], microbatches,
                                      loss_fn=loss_fn, scale_grads=False)
