"""Lay a single-device model (Flint, Mistral Large 4) across a device mesh, from outside the model
files.

    world size = pp * dp_replicate * dp_shard * ep * cp

Each (dp_replicate, dp_shard, ep) coordinate reads its own batch. The ep ranks are data-parallel
for everything but the routed experts, which they split between them (tokens travel to their
experts with an all-to-all, in moe.py). The cp ranks of a group share a batch and split its
sequence; the pp ranks split the layers. `parallelize` applies, in torchtitan's order: pipeline
split, expert parallel, activation checkpointing, compile per block, then FSDP per block (the FP32
units first), on the embedding and on the root. Parameter names never change, so a checkpoint
written with one layout loads into any other. Pipeline and context parallelism run the model's
own forward, which serves a stage (the layers, embedding or head a stage lacks are deleted) and a
context-parallel rank (its `stage`, stage.py's seam) alike, for models that declare them in
`parallel_dims` (registry.Model); this file holds no model's code.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._higher_order_ops.flex_attention import flex_attention
from torch._higher_order_ops.utils import redirect_to_mode
from torch.distributed._composable import checkpoint as checkpoint_module
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _is_compiling,
)

from fp8 import FP8_RECIPES, apply_fp8
from head import HEAD_PRECISIONS
from moe import EP_EXCHANGES, ExpertParallelExperts, MoE
from pipeline import SCHEDULES, V_SCHEDULES, merged_view, pipeline_schedule, pipeline_stage
from stage import StageContext

if TYPE_CHECKING:
    from registry import ModelConfig

# build_mesh's flattened views (dp, dp_cp, fsdp, efsdp) are sliced from the root mesh, which
# torch 2.13 supports and announces it will deprecate, once per slice: keep the logs readable.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp")
AC_MODES = ("none", "full", "selective", "op")
ACCUMULATION_MODES = ("auto", "sync_each", "sync_last", "gathered")  # [parallel] accumulation
# The share of the device's memory that "auto" lets the accumulation hold (choose_accumulation): the
# rest is for the sharded states, the activations and what the estimate leaves out.
ACCUMULATION_SHARE = 0.25
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MAX_TIMEOUT_MINUTES = 525_600  # a year: [parallel] collective_timeout_minutes


# ============================================================================= configuration


class LayoutError(ValueError):
    """A [parallel] setting that cannot work; `key` names it (for example "ep"), so a caller can say
    where it was set without reading the message; `keys`: every key of a rule between several."""

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.keys = key, (*also, key)


@dataclass
class ParallelConfig:
    """The `[parallel]` section of a training config."""

    dp_replicate: int = 1  # HSDP: full replicas, each sharded over dp_shard
    dp_shard: int = -1  # -1: the world size divided by all other degrees
    ep: int = 1  # expert parallel: must divide num_experts
    # chunks of each micro-batch's tokens exchanged apart, one chunk's all-to-all while
    ep_overlap: int = 2
    # another's experts (or the shared expert) compute (moe.ExpertParallelExperts); 1: one exchange
    # dropless all-to-alls: sized (split sizes copied to the host, one sync per MoE layer) |
    ep_exchange: str = "sized"
    # sync_free (a worst-case static block per rank: no sync, ep times the rows; CONFIG.md)
    pp: int = 1  # pipeline parallel: stages
    cp: int = 1  # context parallel: the sequence length must divide by 2 * cp
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble | DualPipeV
    # 0: 1, or 2 for Interleaved1F1B and the V schedules (ZBVZeroBubble, DualPipeV)
    pp_stages_per_rank: int = 0
    pp_microbatches: int = 0  # 0: as many as pipeline stages
    # none | full (every block) | selective (every 2nd block) | op (every block, keeping the
    activation_checkpointing: str = "none"  # matmul, attention and all-to-all outputs)
    compile: bool = False  # torch.compile each block
    # true: a compiler failure at the first step warns and trains eager;
    compile_fallback: bool = False
    # false: it stops the run (out-of-memory and collective errors always stop it)
    # bulk compute dtype: auto (bfloat16 on GPUs, float32 on the CPU) | bfloat16 |
    param_dtype: str = "auto"
    # float32; sinks, routers and the head always compute in FP32, master weights are always FP32
    reshard_after_forward: bool | None = None  # None: True, but False for pipeline stages
    # grad_accum's micro-batches: sync_each | sync_last | gathered | auto (choose_accumulation)
    accumulation: str = "auto"
    # FSDP2's CPU offload: sharded weights, gradients and AdamW states in host memory
    offload: bool = False
    backend: str = "auto"  # process group: auto (nccl on GPUs, gloo on the CPU) | nccl | gloo
    # the FP32 head's matmuls on GPUs: tf32 | bf16x3 | bf16 | float32 (head.py)
    head_precision: str = "tf32"
    fp8: str = "none"  # none | rowwise | tensorwise | rowwise_gw_hp: FP8 matmuls (fp8.py)
    # how long a rank waits at a collective (for rank 0's data
    collective_timeout_minutes: float = 60.0
    # preparation and checkpoint listing, a slow rank's checkpoint write) before the run stops

    @classmethod
    def from_dict(cls, section: dict, where: str = "[parallel]") -> ParallelConfig:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; expected one of {known}")
        return cls(**section)

    @property
    def named_world_size(self) -> int:
        """The world size the degrees name, dp_shard = -1 counting as 1: the default GPU count of
        the tools that lay a config out without a job (tools/memory.py, tools/planner.py, the
        rehearsal)."""
        return self.dp_replicate * max(self.dp_shard, 1) * self.ep * self.pp * self.cp

    @property
    def stages_per_rank(self) -> int:
        return self.pp_stages_per_rank or (
            2 if self.pp_schedule in ("Interleaved1F1B", *V_SCHEDULES) else 1
        )

    @property
    def blocks_compile_whole(self) -> bool:
        """Whether each block compiles to one graph (apply_compile's fullgraph): nothing in it but
        the model's own code, which expert parallelism (the experts' nested FSDP unit, the count
        exchange) and context parallelism (its key/value all-gather) are not."""
        return self.ep == 1 and self.cp == 1

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages this pp rank holds: looped (r, r + pp, ...), or a V for
        V_SCHEDULES."""
        if self.pp_schedule in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def compute_dtype(self, device_type: str) -> torch.dtype:
        if self.param_dtype == "auto":
            return torch.bfloat16 if device_type == "cuda" else torch.float32
        return DTYPES[self.param_dtype]

    def resolve(self, world_size: int, num_experts: int | None = None) -> ParallelConfig:
        """Check every degree against the world size; return a copy with dp_shard filled in."""
        self.validate(num_experts)
        others = self.dp_replicate * self.ep * self.pp * self.cp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"[parallel] pp * dp_replicate * ep * cp = {others} does not "
                    "divide the world "
                    f"size {world_size}, so dp_shard = -1 cannot fill it"
                )
            dp_shard = world_size // others
        if dp_shard * others != world_size:
            raise ValueError(
                f"[parallel] pp * dp_replicate * dp_shard * ep * cp = {self.pp} * "
                f"{self.dp_replicate} * "
                f"{dp_shard} * {self.ep} * {self.cp} must equal the world size "
                f"{world_size}"
            )
        return dataclasses.replace(self, dp_shard=dp_shard)

    def validate(
        self,
        num_experts: int | None = None,
        num_layers: int | None = None,
        seq_len: int | None = None,
    ) -> None:
        """Every check that does not need the world size, against the model and sequence length
        when given, so that a layout that cannot run fails before any work. Errors name the key."""
        where = "[parallel]"
        for name in ("dp_replicate", "ep", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(name, f"{where} {name} must be an integer >= 1, got {value!r}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise LayoutError(
                "dp_shard",
                f"{where} dp_shard must be -1 (fill the world size) or >= 1, got {self.dp_shard!r}",
            )
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(
                "ep", f"{where} ep = {self.ep} must divide the model's num_experts = {num_experts}"
            )
        if (
            isinstance(self.ep_overlap, bool)
            or not isinstance(self.ep_overlap, int)
            or self.ep_overlap < 1
        ):
            raise LayoutError(
                "ep_overlap",
                f"{where} ep_overlap must be an integer >= 1 (the "
                "chunks whose expert "
                "all-to-alls overlap; 1: one exchange per MoE layer), got "
                f"{self.ep_overlap!r}",
            )
        for key, allowed in (
            ("pp_schedule", list(SCHEDULES)),
            ("activation_checkpointing", list(AC_MODES)),
            ("backend", ["auto", "nccl", "gloo"]),
            ("param_dtype", ["auto", *DTYPES]),
            ("head_precision", list(HEAD_PRECISIONS)),
            ("accumulation", list(ACCUMULATION_MODES)),
            ("fp8", list(FP8_RECIPES)),
            ("ep_exchange", list(EP_EXCHANGES)),
        ):
            if getattr(self, key) not in allowed:
                raise LayoutError(
                    key, f"{where} {key} must be one of {allowed}, got {getattr(self, key)!r}"
                )
        # beyond, datetime.timedelta overflows
        if not 0 < self.collective_timeout_minutes <= MAX_TIMEOUT_MINUTES:
            raise LayoutError(
                "collective_timeout_minutes",
                f"{where} collective_timeout_minutes "
                "must be a number of "
                f"minutes in (0, {MAX_TIMEOUT_MINUTES}] (a year), got "
                f"{self.collective_timeout_minutes!r}",
            )
        if seq_len is not None and self.cp > 1 and seq_len % (2 * self.cp):
            raise LayoutError(
                "cp",
                f"{where} cp = {self.cp} splits each sequence into 2 * cp = "
                f"{2 * self.cp} chunks: "
                f"data.seq_len = {seq_len} must be divisible by {2 * self.cp}",
            )
        if num_layers is not None and self.pp * self.stages_per_rank > num_layers:
            raise LayoutError(
                "pp",
                f"{where} pp = {self.pp} with {self.stages_per_rank} stage(s) "
                "per rank makes "
                f"{self.pp * self.stages_per_rank} pipeline stages, more than the "
                f"model's {num_layers} layers",
            )
        if self.pp_schedule == "Interleaved1F1B":
            needed, fits = "n >= 2", self.stages_per_rank >= 2
        elif self.pp_schedule in V_SCHEDULES:
            needed, fits = "n = 2", self.stages_per_rank == 2
        else:
            needed, fits = "n = 1", self.stages_per_rank == 1
        if not fits:
            raise LayoutError(
                "pp_stages_per_rank",
                f"{where} pp_stages_per_rank = "
                f"{self.stages_per_rank} does not fit "
                f"pp_schedule {self.pp_schedule!r}, which takes {needed} stages per "
                "rank",
            )
        if self.pp > 1 and self.pp_schedule in V_SCHEDULES:
            self.check_v_schedule()
        if self.compile and self.activation_checkpointing == "op" and not self.blocks_compile_whole:
            raise LayoutError(
                "activation_checkpointing",
                f"{where} activation_checkpointing = 'op' with compile = true needs blocks that "
                f"compile whole (ep = 1, cp = 1; here ep = {self.ep}, cp = {self.cp}): a graph "
                "break inside the checkpoint runs the block eagerly; use 'full' or 'selective', "
                "or compile = false",
                also=("compile",),
            )

    def check_v_schedule(self) -> None:
        """What torch 2.13 cannot run under a V schedule: activation checkpointing (the composable
        checkpoint fails in the backward split into input and weight gradients:
        "'_GeneratorContextManager' object has no attribute 'args'"), ZBVZeroBubble with one
        micro-batch (under BF16, FSDP2 asserts "reduce-scatter expects uniform gradient dtype"),
        DualPipeV with fewer micro-batches than stages."""
        schedule, microbatches = (
            self.pp_schedule,
            self.pp_microbatches or self.pp * self.stages_per_rank,
        )
        if self.activation_checkpointing != "none":
            raise LayoutError(
                "activation_checkpointing",
                f"[parallel] activation_checkpointing = "
                f"{self.activation_checkpointing!r} cannot run under pp_schedule "
                f"{schedule!r}: torch's "
                "activation checkpointing fails in its backward split into input and "
                "weight gradients; "
                "use activation_checkpointing = 'none', or pp_schedule '1F1B' or "
                "'Interleaved1F1B'",
                also=("pp_schedule",),
            )
        needed, why = {
            "ZBVZeroBubble": (2, "under BF16 FSDP2 fails on one"),
            "DualPipeV": (
                self.pp * self.stages_per_rank,
                f"one per pipeline stage: pp = {self.pp} x {self.stages_per_rank} stages per rank",
            ),
        }[schedule]
        if microbatches < needed:
            raise LayoutError(
                "pp_microbatches",
                f"[parallel] pp_microbatches = {microbatches}: "
                f"pp_schedule {schedule!r} "
                f"needs at least {needed} ({why}); raise pp_microbatches, or set it "
                "to 0 (one per stage)",
                also=("pp_schedule",),
            )


def choose_accumulation(
    cfg: ParallelConfig, gradient_bytes: float, weight_bytes: float, device_bytes: float
) -> str:
    """[parallel] accumulation as a run uses it; "auto" takes the most that fits (tools/memory.py
    asks the same). sync_last holds `gradient_bytes` (this rank's FSDP units' FP32 gradients,
    unsharded), gathered `weight_bytes` (their gathered weights) as well: gathered if both fit
    ACCUMULATION_SHARE of `device_bytes`, else sync_last if the gradients do, else sync_each;
    sync_each with offload (the gradients would stay on the device it relieves). Under pp sync_last
    (one schedule call holds no more than a call holds), but sync_each for GPipe, which would hold
    the activations of all grad_accum x pp_microbatches micro-batches."""
    if cfg.accumulation != "auto":
        return cfg.accumulation
    if cfg.pp > 1:
        return "sync_each" if cfg.pp_schedule == "GPipe" else "sync_last"
    budget = ACCUMULATION_SHARE * device_bytes
    if cfg.offload or gradient_bytes > budget:
        return "sync_each"
    return "gathered" if gradient_bytes + weight_bytes <= budget else "sync_last"


def device_memory_bytes(device_type: str) -> int:
    """The memory of this process's device: its GPU's, or on the CPU the host's."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# =========================================================================== process group and mesh


def init_distributed(
    backend: str = "auto",
    use_cuda: bool | None = None,
    timeout: timedelta = timedelta(minutes=ParallelConfig.collective_timeout_minutes),
) -> torch.device:
    """Start the process group: from torchrun's environment, or, for a plain `python` process, a
    group of one (so that one process takes the same path as many). NCCL on CUDA, gloo on the CPU.
    A collective that waits longer than `timeout` stops the run: NCCL's and gloo's default of 10
    and 30 minutes is shorter than rank 0 preparing a corpus."""
    cuda = (torch.cuda.is_available() if use_cuda is None else use_cuda) and backend != "gloo"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = backend if backend != "auto" else ("nccl" if cuda else "gloo")
        alone = (
            {}
            if "WORLD_SIZE" in os.environ
            else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        )
        dist.init_process_group(
            backend, device_id=device if cuda else None, timeout=timeout, **alone
        )
    return device


def close_distributed() -> None:
    """End the process group and every group made from it, their backends' threads included.

    destroy_process_group alone leaves the groups alive: DTensor's sharding cache (kept in C++)
    holds each mesh it saw, and a mesh holds its groups. Their gloo worker threads then outlive
    main(), and one that drops the last reference to a collective's tensor after the interpreter
    began to shut down aborts the process ("terminate called without an active exception", SIGABRT)
    at the end of a run that succeeded. With DTensor's and dynamo's caches emptied here, while
    Python still runs, the groups are destroyed now, and each destructor waits for its threads
    (after every multi-process run of train.main in the tests, no gloo thread is left). What the
    caller still holds stays: a model, or a gradient left on a parameter, keeps its meshes'
    groups."""
    from torch.distributed.tensor import _collective_utils, _redistribute

    if dist.is_initialized():
        dist.destroy_process_group()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (
        propagator.propagate_op_sharding,
        type(propagator)._propagate_tensor_meta_cached,
        _redistribute._gen_transform_infos,
        _collective_utils.MeshTopoInfo.build_from_mesh,
    ):
        cache.cache_clear()  # each keeps the meshes (DTensorSpecs) of the calls it saw
    _redistribute.clear_redistribute_planner_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the same, in C++
    torch._dynamo.reset()  # compiled code guards on the modules it compiled
    gc.collect()  # modules, hooks and meshes hold groups in reference cycles too


@contextmanager
def waiting_for_main_rank(
    what: str, minutes: float, where: str, error: type[Exception] = RuntimeError
):
    """Around a collective where the other ranks wait for rank 0 to do `what` alone. The wait ends
    at the group's timeout, [parallel].collective_timeout_minutes (`minutes`, set at `where`): gloo
    then raises a RuntimeError, reported here as `error` naming the key (NCCL's watchdog ends the
    process instead, its log giving the timeout in milliseconds)."""
    try:
        yield
    except RuntimeError as failure:
        if dist.get_rank() == 0:
            raise
        first_line = (str(failure).splitlines() or ["no message"])[0][:200]
        raise error(
            f"rank {dist.get_rank()} waited for rank 0 to {what} and gave up "
            f"({first_line}): rank 0 stopped "
            "(its own error says why) or took longer than "
            "[parallel].collective_timeout_minutes = "
            f"{minutes:g} ({where}); raise it if rank 0 is only slow"
        ) from failure


def barrier() -> None:
    """Wait for every process of the group (nothing to wait for without one)."""
    if dist.is_initialized():
        dist.barrier()


def build_mesh(cfg: ParallelConfig, device_type: str, num_experts: int | None = None) -> DeviceMesh:
    """One mesh with dims (pp, dp_replicate, dp_shard, ep, cp), plus flattened views:
    dp (ranks reading distinct batches), dp_cp (ranks over which the loss is averaged),
    fsdp (sharding of everything but the experts) and efsdp (sharding of the experts)."""
    cfg = cfg.resolve(dist.get_world_size(), num_experts)
    shape = tuple(getattr(cfg, name) for name in MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    for name, dims in (
        ("dp", ("dp_replicate", "dp_shard", "ep")),
        ("dp_cp", ("dp_replicate", "dp_shard", "ep", "cp")),
        ("fsdp", ("dp_shard", "ep", "cp")),
        ("efsdp", ("dp_shard", "cp")),
    ):
        mesh[dims]._flatten(name)
    return mesh


# ============================================================================= this process


@dataclass
class Process:
    """This process in the job: its rank, where its data comes from, its device and the mesh."""

    rank: int
    world_size: int
    dp_rank: int  # which batches this process reads: the cp ranks of a group share them
    dp_size: int
    device: torch.device
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)


# ============================================================================= pipeline stages


def unsupported_layout(cfg: ParallelConfig, model_type: type) -> LayoutError | None:
    """Why `cfg` cannot lay out a `model_type` model, or None: pipeline and context parallelism
    need a forward that serves them, which a model declares in `parallel_dims` ("pp", "cp")."""
    supported = getattr(model_type, "parallel_dims", ())
    for key in ("pp", "cp"):
        if getattr(cfg, key) > 1 and key not in supported:
            what = "pipeline" if key == "pp" else "context"
            return LayoutError(
                key,
                f"[parallel] {key} = {getattr(cfg, key)}: {what} parallelism is "
                "not implemented "
                f"for {model_type.__name__}; use {key} = 1",
            )
    return None


# ============================================================================= context parallel
# Which positions each rank of a cp group computes, and the gather of a sequence over the group.
# parallelize gives a model the StageContext of its rank (stage.py); the model's forward then
# computes the queries of its positions and its blocks gather keys and values.


@lru_cache(maxsize=64)
def _cp_index(seq_len: int, cp: int, rank: int, device: str) -> torch.Tensor:
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallel: sequence length {seq_len} must be divisible by 2 * cp = {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    chunks = (rank, 2 * cp - 1 - rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def cp_token_index(seq_len: int, cp: int, rank: int, device) -> torch.Tensor:
    """Positions [T / cp] that cp rank `rank` computes: chunks rank and 2*cp-1-rank of 2*cp equal
    chunks, so every rank gets the same amount of causal attention work."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    return _cp_index(seq_len, cp, rank, str(device))


def gather_sequence(t: torch.Tensor, cp_group, dim: int) -> torch.Tensor:
    """All-gather this rank's positions of a sequence (dim `dim`, T / cp long) over the cp group
    (backward: reduce-scatter) and put them in sequence order -> T long."""
    cp = dist.get_world_size(cp_group)
    seq_len = t.shape[dim] * cp
    gathered_order = torch.cat([cp_token_index(seq_len, cp, r, t.device) for r in range(cp)])
    return all_gather_single_autograd(t.contiguous(), dim, cp_group).index_select(
        dim, torch.argsort(gathered_order)
    )


def context_parallel(group: dist.ProcessGroup) -> StageContext:
    """The StageContext (stage.py) of this rank of cp group `group`, which parallelize gives the
    model: its queries are cp_token_index's, and its blocks gather keys and values with
    gather_sequence."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)

    def queries(seq_len: int, device: torch.device) -> torch.Tensor:  # [T / cp]
        return cp_token_index(seq_len, cp, rank, device)

    def gather(t: torch.Tensor, dim: int = 1) -> torch.Tensor:  # [B, T / cp, ...] -> [B, T, ...]
        return gather_sequence(t, group, dim)

    return StageContext(cp, group, queries, gather)


# =============================================================== expert parallel, AC, compile, FSDP


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, chunks: int, exchange: str = "sized"
) -> None:
    """Shard every MoE layer's experts over the ep mesh (DTensor Shard(0) on the expert dim), their
    exchange in `chunks` overlapped pieces ([parallel] ep_overlap), sized or sync-free
    ([parallel] ep_exchange)."""
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            experts = layer.mlp.experts
            num_experts = experts.gate_up_proj.shape[0]
            # the weights, and lora.py's adapters of them
            for name, param in list(experts.named_parameters()):
                owner, _, leaf = name.rpartition(".")
                # Every rank holds the same full tensor (or a meta one): keep this rank's slice, no
                # traffic.
                local = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(
                    experts.get_submodule(owner),
                    leaf,
                    nn.Parameter(local, requires_grad=param.requires_grad),
                )
            layer.mlp.experts = ExpertParallelExperts(
                experts, ep_mesh.get_group(), num_experts, chunks, exchange
            )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """In place, names unchanged (composable API: hooks on the block, no wrapper module). `full`
    recomputes every block in backward, `selective` every second block (half the recompute for
    about half the saving), `op` every block's pointwise work only (op_level_contexts: the outputs
    of matmuls, attention and all-to-alls are kept). Masks and RoPE tables are block inputs built
    once per batch, so a recomputed block sees the same values. The hooks run eagerly around a
    compiled block's forward (apply_compile), which the recompute calls again; under `op` the
    compiled forward holds the checkpoint itself (apply_compile), so that the compiler partitions
    each block by the same policy.

    Full and selective do not put torch.utils.checkpoint inside the compiled graph (its higher-order
    op): under expert parallelism the experts' nested FSDP unit's hooks cannot run inside the op's
    body, and dynamo then runs the whole block eagerly. For the same reason `op` compiles only where
    the blocks compile whole (parallelize refuses the rest): no expert or context parallelism."""
    for index, layer in enumerate(model.layers.values()):
        if mode == "op":
            checkpoint_module(layer, context_fn=op_level_contexts)
            OP_LEVEL_BLOCKS.add(layer)
        elif mode == "full" or (mode == "selective" and index % 2 == 0):
            checkpoint_module(layer)


# ------------------------------------------------------------------------ op-level checkpointing
OP_LEVEL_BLOCKS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # apply_compile moves their hooks
# What `op` keeps of a block's forward: the outputs of its matmuls (dense, grouped, FP8), of its
# attention kernels and of its all-to-alls. Everything else (norms, RoPE, activations, the router's
# top-k, row sorting, residual adds) is recomputed in backward from the block's input and those
# outputs: the FLOPs are the matmuls' and attention's, the bytes mostly the pointwise work's
# (torchtitan's op-level policy keeps the same kinds of ops:
# https://github.com/pytorch/torchtitan/blob/main/torchtitan/distributed/activation_checkpoint.py).
KEPT_ATEN_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)
# An all-to-all kept is one the recompute does not run again: no rank exchanges rows in backward but
# for the gradients. Its wait then finds no collective in flight and returns the kept rows as they
# are (the same storage: kept once).
KEPT_COLLECTIVES = frozenset({"all_to_all_single"})
# flint's own custom operators (moe.py, attention.py, fp8.py): matmuls and attention by their name.
KEPT_FLINT_WORDS = ("mm", "matmul", "attention")


def kept_by_op_level(func) -> bool:
    """Whether op-level checkpointing keeps the output of operator `func` (an OpOverload, or
    flex_attention's higher-order operator) rather than recompute it."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return func.name() == "flex_attention"
    namespace, name = func.namespace, func._opname
    if namespace == "aten":
        return name in KEPT_ATEN_OPS
    if namespace == "_c10d_functional":
        return name in KEPT_COLLECTIVES
    return namespace == "flint" and any(word in name for word in KEPT_FLINT_WORDS)


def op_level_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """torch's selective-checkpoint policy of `op`: what the compiler's partitioner follows."""
    return (
        CheckpointPolicy.MUST_SAVE if kept_by_op_level(func) else CheckpointPolicy.PREFER_RECOMPUTE
    )


class _KeepOpOutputs(_CachingTorchDispatchMode):
    """The forward of an op-level checkpointed block: keeps each kept op's outputs, in call order
    per op. Compiled, torch's own selective checkpointing tags the graph instead (the parent).

    torch's eager version also numbers every other op, and its recompute refuses an op the forward
    did not run: a nested FSDP unit's hooks (the experts' own unit under expert parallelism) run
    other ops in the recompute than in the forward (their gather in backward), which it rejects.
    Here the ops recomputed are not numbered at all, so only the kept ones must come in the same
    order, and FSDP's hooks never run them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_compiling(func, args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if kept_by_op_level(func):
            kept = tree_map(lambda x: _Kept(x) if torch.is_tensor(x) else x, out)
            self.kept.setdefault(func, deque()).append((_shapes(args), kept))
        return out


class _ReuseOpOutputs(_CachedTorchDispatchMode):
    """The recompute of an op-level checkpointed block: a kept op returns what its forward call
    returned (checked to have had inputs of the same shapes, and not to have been changed in place
    since); every other op runs again."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_compiling(func, args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if not kept_by_op_level(func):
            return func(*args, **(kwargs or {}))
        queue = self.kept.get(func)
        if not queue:
            raise RuntimeError(
                f"activation_checkpointing 'op': the recompute ran {func} more often than the "
                "forward (a forward that depends on state changed since?)"
            )
        shapes, kept = queue.popleft()
        if shapes != _shapes(args):
            raise RuntimeError(
                f"activation_checkpointing 'op': the recompute's {func} has inputs {_shapes(args)},"
                f" the forward's had {shapes}: they ran different ops"
            )

        def reuse(entry):
            if not isinstance(entry, _Kept):
                return entry
            if entry.tensor._version != entry.version:
                raise RuntimeError(
                    f"activation_checkpointing 'op': the output of {func} that the forward kept "
                    "was changed in place before the backward"
                )
            return entry.tensor

        return tree_map(reuse, kept)


class _Kept:
    """A kept output, detached, with its version counter at the time (in-place changes count)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor.detach(), tensor._version


# Higher-order operators reach a dispatch mode only through an implementation registered for its
# class: FlexAttention's, as for torch's own selective checkpointing.
for _mode in (_KeepOpOutputs, _ReuseOpOutputs):
    redirect_to_mode(flex_attention, _mode)


def _shapes(args) -> list:
    return [tuple(x.shape) for x in tree_flatten(args)[0] if torch.is_tensor(x)]


def op_level_contexts() -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward and recompute contexts of op-level checkpointing (torch.utils.checkpoint's
    context_fn), sharing one store of the kept outputs."""
    keep = _KeepOpOutputs(op_level_policy, defaultdict(dict))  # torch's store, when compiling
    reuse = _ReuseOpOutputs(op_level_policy, keep.storage)
    keep.kept = reuse.kept = {}  # op -> (input shapes, outputs) of each call, in call order
    return keep, reuse


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile the forward of each block and of the head with its chunked loss, in place (names
    unchanged). The module's hooks (FSDP's own, activation checkpointing's) stay outside the graph
    and eager: the checkpoint's hooks hold a generator that dynamo cannot trace ("reconstructing
    @contextmanager object"), and a unit's own FSDP hooks at the edge of its graph add nothing to
    trace. Errors are raised, never hidden by eager.

    fullgraph=True makes any graph break an error: each block is one graph. parallelize asks for
    it whenever the block holds no other distributed code: one process or FSDP, in any dtype,
    without expert or context parallelism. What breaks a block's graph otherwise, which
    train.check_compiled counts:
      - Under expert parallelism, the experts' own FSDP unit: torch 2.13's FSDP2 wraps each of its
        hooks in torch._dynamo.disable (fsdp/_fully_shard/_fsdp_common.py, with no setting to
        trace them), so the experts' call ends a graph at its pre- and its post-forward hook. (The
        FP32 units of a BF16 policy, nested the same way, gather from the block's hooks instead:
        gather_with_block.)
      - Under expert parallelism, dropless with ep_exchange "sized", the count exchange
        (moe.ExpertParallelExperts.exchange_counts: host split sizes), eager between the graph that
        sorts the rows and the one that exchanges them, which reads the sizes as unbacked integers.
        ep_exchange "sync_free" keeps its counts on the device: no break there.
      - Context parallelism (a key/value all-gather in each block) is not asked to be whole.
    Two settings keep those breaks to the ones named: nested_graph_breaks resumes tracing inside
    the module that broke (by default dynamo breaks at every call on the way down to it, each
    module of that chain then running graphs of its own), and capture_scalar_outputs with
    capture_dynamic_output_shape_ops trace what is left of sizes read from tensors as symbolic
    sizes instead of breaking the graph."""
    dynamo = torch._dynamo.config
    dynamo.suppress_errors = False
    dynamo.nested_graph_breaks = True
    dynamo.capture_scalar_outputs = dynamo.capture_dynamic_output_shape_ops = True
    # All blocks share one code object, and dynamo keeps one graph per distinct block and grad mode
    # (training, and evaluation under no_grad): Large 4's 8 distinct blocks make 16, past the
    # default limit of 8, which would stop the run at its first evaluation.
    limit = 2 * model.config.num_hidden_layers
    dynamo.recompile_limit = max(dynamo.recompile_limit, limit)
    # the head is None on all but the last stage
    for module in [*model.layers.values(), model.lm_head]:
        if module in OP_LEVEL_BLOCKS:
            module.forward = torch.compile(op_level_forward(module), fullgraph=fullgraph)
        elif module is not None:
            module.forward = torch.compile(module.forward, fullgraph=fullgraph)


def op_level_forward(block: nn.Module) -> Callable:
    """A block's forward under op-level checkpointing, for the compiler: torch.utils.checkpoint
    inside the graph, so that the partitioner keeps and recomputes by op_level_policy (the
    composable hooks, which would recompute the compiled forward whole, are turned off; uncompile
    turns them on again)."""
    checkpoint_module.state(block).enable_hook = False
    forward = block.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            forward, *args, use_reentrant=False, context_fn=op_level_contexts, **kwargs
        )

    return checkpointed


def least_padding(shards: int) -> Callable[[nn.Parameter], Shard | None]:
    """Where FSDP2 splits a parameter over `shards` ranks: dim 0 (None), in equal chunks with the
    last padded, unless dim 0 is shorter than the shards. Large 4's 16 experts per expert-parallel
    rank over 32 ranks would give every rank a whole expert, half of them padding: twice each rank's
    share of the expert weights, gradients and optimizer states (the rehearsal measured it). Those
    parameters are split along dim 1 instead, as torchtitan splits its experts, where dim 1 divides
    into the shards: FSDP2 pads dim 0 only, and refuses a split of any other dim that leaves a
    remainder (Flint's 2,048-wide k_proj and experts on 768 ranks), so there dim 0 is padded after
    all. The local shape decides: under expert parallelism FSDP splits this rank's experts, not all
    of them."""

    def placement(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        short = local.dim() > 1 and local.shape[0] < shards
        return Shard(1) if short and local.shape[1] % shards == 0 else None

    return placement


@dataclass
class FSDPUnit:
    """One fully_shard of this rank: its module (a list unit's first), the reshard_after_forward it
    was given, and what it gathers here (under ep, this rank's experts): elements, the trainable
    ones, in which dtype."""

    module: FSDPModule
    reshard_after_forward: bool
    numel: int
    trainable_numel: int
    param_dtype: torch.dtype


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reshard: bool,
    offload: bool = False,
) -> list[FSDPUnit]:
    """FSDP2 per unit, innermost first: the model's FP32 modules (`fp32_root_modules`, and under a
    narrower bulk dtype each block's `fp32_modules` as one unit) and the head, stored, gathered and
    computed in FP32; experts over the expert-data-parallel ranks, then each block, the embedding
    and the root in the bulk policy. HSDP when dp_replicate > 1. offload: every unit keeps its
    shards (and so their gradients and the optimizer's states) in host memory, copied to the device
    for each all-gather; the optimizer then steps on the CPU. -> the units, innermost first."""

    def dp_mesh(shard_dim: str) -> DeviceMesh:
        return (
            mesh["dp_replicate", shard_dim] if mesh["dp_replicate"].size() > 1 else mesh[shard_dim]
        )

    # No input casts: a block casts what it computes with to its weights' dtype itself, so an FP32
    # residual stream (residual_dtype) and the FP32 RoPE tables reach it in FP32; the projections
    # around Sinks stay in the bulk dtype and the head and router cast their inputs to FP32.
    bulk = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fsdp_mesh, experts_mesh = dp_mesh("fsdp"), dp_mesh("efsdp")
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    units: list[FSDPUnit] = []
    counted: set[int] = set()  # a unit holds the parameters that no inner unit took

    def shard(target: nn.Module | list[nn.Module], **options) -> None:
        modules = target if isinstance(target, list) else [target]
        params = [p for m in modules for p in m.parameters() if id(p) not in counted]
        # ep: this rank's experts
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        units.append(
            FSDPUnit(
                modules[0],
                options["reshard_after_forward"],
                sum(p.numel() for p in local),
                sum(p.numel() for p in local if p.requires_grad),
                options["mp_policy"].param_dtype,
            )
        )
        options.setdefault("shard_placement_fn", least_padding(mesh["fsdp"].size()))
        fully_shard(target, offload_policy=policy, **options)
        # the shards that replaced them
        counted.update(id(p) for m in modules for p in m.parameters())

    for module in model.fp32_root_modules():
        shard(module, mesh=fsdp_mesh, mp_policy=fp32, reshard_after_forward=reshard)
    for layer in model.layers.values():
        # One list unit per block: one all-gather and one reduce-scatter of FP32 for all its FP32
        # modules (FSDP2 reduces one gradient dtype per unit, so they cannot join the block's).
        fp32_modules = model.fp32_modules(layer)
        if fp32_modules and param_dtype != torch.float32:  # in FP32 the block's own unit serves
            shard(fp32_modules, mesh=fsdp_mesh, mp_policy=fp32, reshard_after_forward=reshard)
            gather_with_block(layer, fp32_modules[0], reshard)
        if isinstance(layer.mlp, MoE):
            if isinstance(layer.mlp.experts, ExpertParallelExperts):
                shard(
                    layer.mlp.experts,
                    mesh=experts_mesh,
                    mp_policy=bulk,
                    reshard_after_forward=reshard,
                    shard_placement_fn=least_padding(mesh["efsdp"].size()),
                )
                # Expert gradients already sum over the ep ranks (their tokens came by all-to-all)
                # and FSDP averages them over the efsdp ranks only: divide by ep as well, so they
                # average over all data-parallel ranks like every other gradient.
                ep = mesh["ep"].size()
                layer.mlp.experts.set_all_reduce_hook(lambda reduced_grad: reduced_grad.div_(ep))
        shard(layer, mesh=fsdp_mesh, mp_policy=bulk, reshard_after_forward=reshard)
    if model.embed_tokens is not None:
        shard(model.embed_tokens, mesh=fsdp_mesh, mp_policy=bulk, reshard_after_forward=reshard)
    if model.lm_head is not None:  # backward starts here: keep it gathered after forward
        shard(model.lm_head, mesh=fsdp_mesh, mp_policy=fp32, reshard_after_forward=False)
    shard(model, mesh=fsdp_mesh, mp_policy=bulk, reshard_after_forward=reshard)
    return units


def gather_with_block(block: nn.Module, unit: FSDPModule, reshard: bool) -> None:
    """Make the block's FP32 unit (its own FSDP unit of sinks, router or indexer under a BF16
    policy) gather and free its parameters from the block's hooks instead of its own, so that no
    FSDP hook runs inside the block's compiled forward: torch 2.13 wraps FSDP2's hooks in
    torch._dynamo.disable, and each call of such a module would end a graph (apply_compile). The
    block's hooks run eagerly around its compiled forward, as its own unit's do.

    What the unit's hooks did, the block's now do: gather before the block's forward, free after
    it (reshard), gather again before the block's backward (its first output gradient; a
    recompute runs inside that backward), and free after a forward without autograd. The unit's
    gradient is reduce-scattered where FSDP2 finishes any unit whose post-backward did not run (its
    root's end-of-backward callback; a pipeline stage's explicit post-backward): a few FP32
    matrices a block, so the collective is small and waiting for the end costs little."""
    state = unit._get_fsdp_state()
    # torch 2.13 keeps the handles of the hooks fully_shard registered (one for a list unit)
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()

    def gather(*_) -> None:
        unit.unshard()

    def free_or_wait_for_backward(module, args, output) -> None:
        needing = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(needing)
        if reshard or not backward_follows:
            unit.reshard()
        if backward_follows:
            torch.autograd.graph.register_multi_grad_hook(needing, gather, mode="any")

    block.register_forward_pre_hook(gather)
    block.register_forward_hook(free_or_wait_for_backward)


def parallelize(model: nn.Module, cfg: ParallelConfig | dict, mesh: DeviceMesh) -> ParallelModel:
    """Lay `model` (FP32 master weights, on its device or on meta) across `mesh`; see the module
    docstring. With pp > 1 this rank keeps only its stages' layers. FSDP applies whenever there is
    more than one data-parallel rank or the bulk computes in BF16 (its mixed-precision policy is
    what keeps the FP32 units in FP32, also on a single GPU)."""
    cfg = ParallelConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    cfg = cfg.resolve(mesh.size(), model.config.num_experts)
    config = model.config
    refusal = unsupported_layout(cfg, type(model))
    if refusal:
        raise refusal
    parts, stage_ids = [model], [0]
    if cfg.pp > 1:
        num_stages = cfg.pp * cfg.stages_per_rank
        pp_rank = mesh["pp"].get_local_rank()
        stage_ids = cfg.stage_ids(pp_rank)
        parts = [pipeline_stage(model, s, num_stages) for s in stage_ids]
    reshard = cfg.reshard_after_forward if cfg.reshard_after_forward is not None else cfg.pp == 1
    param_dtype = cfg.compute_dtype(mesh.device_type)
    fsdp = mesh["dp_cp"].size() > 1 or param_dtype != torch.float32 or cfg.offload
    whole = cfg.blocks_compile_whole
    units: list[FSDPUnit] = []
    for part in parts:
        if part.lm_head is not None:  # None on pipeline stages other than the last
            part.lm_head.precision = cfg.head_precision  # on GPUs only: the CPU's head stays FP32
        if mesh["cp"].size() > 1:
            part.stage = context_parallel(mesh["cp"].get_group())
        if cfg.fp8 != "none":
            apply_fp8(part, cfg.fp8)
        if cfg.ep > 1:
            apply_expert_parallel(part, mesh["ep"], cfg.ep_overlap, cfg.ep_exchange)
        apply_activation_checkpointing(part, cfg.activation_checkpointing)
        if cfg.compile:
            apply_compile(part, fullgraph=whole)
        if fsdp:
            units += apply_fsdp(part, mesh, param_dtype, reshard, cfg.offload)
    pm = ParallelModel(parts, mesh, config, units)
    pm.accumulation = choose_accumulation(
        cfg, *pm.accumulation_bytes(), device_memory_bytes(mesh.device_type)
    )
    if cfg.pp > 1:
        pm.pp_microbatches = cfg.pp_microbatches or cfg.pp * cfg.stages_per_rank

        def make_schedule(batch_shape: tuple[int, int], microbatches: int):
            layout = dataclasses.replace(cfg, pp_microbatches=microbatches)
            return pipeline_schedule(
                parts, stage_ids, layout, mesh, param_dtype, pm.weighted_loss, batch_shape
            )

        pm.make_schedule = make_schedule
    return pm


@torch.no_grad()
def init_weights(pm: ParallelModel, device: torch.device, seed: int | None) -> None:
    """Materialise a meta-built, parallelized model: this rank's shards of the model's
    `initial_value` (the weights of one process), or with seed None just the memory, to load a
    checkpoint into. Each rank draws one full tensor at a time, never the model (the 40B model's
    largest: a few GB on a GPU)."""
    for part in pm.parts:
        part.to_empty(device=device)  # on each FSDP root: it re-registers its shards
        for buffer in part.buffers():  # statistics, not weights
            buffer.zero_()
    if seed is not None:
        set_initial_values(pm, seed)


@torch.no_grad()
def set_initial_values(
    pm: ParallelModel, seed: int, which: Callable[[str], bool] = lambda name: True
) -> None:
    """Set this rank's shards of the parameters `which` names to the model's `initial_value` (LoRA's
    adapters after the base is loaded: lora.py)."""
    for part in pm.parts:
        for name, param in filter(lambda named: which(named[0]), part.named_parameters()):
            full = part.initial_value(name, param, seed)
            # Shard and _StridedShard over FSDP/EP meshes, chunked like FSDP2
            if isinstance(param, DTensor):
                full = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
                param = param.to_local()
            if full.shape != param.shape:
                raise RuntimeError(
                    f"{name}: initial shard {tuple(full.shape)} != local shard {tuple(param.shape)}"
                )
            param.copy_(full)


def uncompile(pm: ParallelModel) -> None:
    """Back to the eager blocks after a compile failure (the caller says so, loudly)."""
    for part in pm.parts:
        for module in [*part.layers.values(), part.lm_head]:
            if module is not None and "forward" in vars(module):
                del module.forward
            if module in OP_LEVEL_BLOCKS:  # back to the eager hooks (op_level_forward)
                checkpoint_module.state(module).enable_hook = True


# ============================================================================= the training surface


class ParallelModel:
    """What train.py holds: `module` (native parameter names, for the optimizer and checkpoints),
    `accumulate_gradients` for an optimizer step's micro-batches, `forward_backward` and `loss` for
    one batch of this rank, and `clip_grad_norm_`.

    Every target token weighs the same in every layout. A rank's model returns the mean loss over
    its batch's target tokens (under cp: its share of that mean); `weighted_loss` turns it into
    loss sum / num_tokens * dp, where num_tokens counts the target tokens of the whole optimizer
    step (all micro-batches, all data-parallel ranks). FSDP averages gradients over the dp_cp
    ranks, so the step's gradient is that of the mean loss over all of its tokens.
    """

    def __init__(
        self,
        parts: list[nn.Module],
        mesh: DeviceMesh,
        config: ModelConfig,
        units: list[FSDPUnit] = (),
    ):
        self.parts, self.mesh, self.config, self.units = parts, mesh, config, list(units)
        self.accumulation = "sync_each"  # [parallel] accumulation, resolved (parallelize)
        # pp > 1: (batch shape, micro-batches) -> the pipeline's schedule (parallelize)
        self.make_schedule = None
        self.pp_microbatches = 1  # pp > 1: [parallel] pp_microbatches, resolved
        self.schedules: dict = {}  # by batch shape and micro-batches
        self.module = merged_view(parts)
        self.token_weight = torch.ones(())  # dp / num_tokens of the current step

    def accumulation_bytes(self) -> tuple[int, int]:
        """(The unsharded gradients of this rank's FSDP units, in their reduce dtype FP32: what
        sync_last holds between micro-batches; their gathered weights, which gathered holds as well)
        in bytes."""
        gradients = sum(4 * unit.trainable_numel for unit in self.units)
        weights = sum(unit.numel * unit.param_dtype.itemsize for unit in self.units)
        return gradients, weights

    @property
    def dp_size(self) -> int:
        """Ranks that read distinct batches (the cp ranks of a group share one)."""
        return self.mesh["dp"].size()

    def global_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """Target tokens (not -100) of `targets` summed over the data-parallel ranks (FP32)."""
        count = (targets != -100).sum().float()
        dist.all_reduce(count, group=self.mesh["dp"].get_group())
        return count

    def weighted_loss(self, mean_loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's mean loss over `targets`' tokens -> this batch's share of the step's loss."""
        return mean_loss * (targets != -100).sum() * self.token_weight

    def accumulate_gradients(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of an optimizer step's micro-batches on this rank (dicts of
        forward_backward's arguments), every target token of the step weighing the same -> the
        step's mean loss per target token. `accumulation` says what FSDP2 communicates in between,
        per unit (CONFIG.md): sync_each reduce-scatters (HSDP: and all-reduces) in every backward;
        sync_last only in the last, the others accumulating unsharded FP32 gradients; gathered as
        sync_last, the weights staying gathered from the first forward to the last backward, which
        reshards them. torch's pipeline schedules already sync once per call (their stages turn the
        sync and the reshard after backward off until REDUCE_GRAD, after the last micro-batch) and
        keep a stage gathered through it: under pp, sync_last and gathered run one call on the
        micro-batches joined, of grad_accum x pp_microbatches pipeline micro-batches. One
        micro-batch: the same in every mode."""
        targets = torch.stack([batch["targets"] for batch in batches])
        num_tokens = self.global_tokens(targets)
        mode = self.accumulation if len(batches) > 1 else "sync_each"
        microbatches = self.pp_microbatches
        if self.make_schedule is not None and mode != "sync_each":
            microbatches *= len(batches)
            # [B, T] -> [n B, T]
            batches = [{key: torch.cat([batch[key] for batch in batches]) for key in batches[0]}]
        loss = torch.zeros((), device=targets.device)
        try:
            for index, batch in enumerate(batches):
                self.communicate(mode, last=index == len(batches) - 1)
                loss = loss + self.forward_backward(
                    **batch, num_tokens=num_tokens, pipeline_microbatches=microbatches
                )
        finally:
            # what a lone forward_backward or `loss` expects
            self.communicate("sync_each", last=True)
        return loss

    def communicate(self, mode: str, last: bool) -> None:
        """FSDP2's settings for the next micro-batch under accumulation `mode`
        (accumulate_gradients)."""
        for unit in self.units:
            unit.module.set_requires_gradient_sync(last or mode == "sync_each", recurse=False)
            unit.module.set_reshard_after_backward(last or mode != "gathered", recurse=False)
            unit.module.set_reshard_after_forward(
                unit.reshard_after_forward and mode != "gathered", recurse=False
            )

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
        *,
        pipeline_microbatches: int = 0,
    ) -> torch.Tensor:
        """Forward and backward on this rank's batch [B, T]; gradients accumulate over calls.
        num_tokens: the target tokens of the optimizer step over all its micro-batches and all
        data-parallel ranks (`global_tokens`); default: this batch's. pipeline_microbatches: what a
        pipeline cuts the batch into (0: [parallel] pp_microbatches). -> this batch's share of the
        step's mean loss per token (detached, equal on every rank): sum it over micro-batches."""
        return self._run(
            input_ids,
            targets,
            doc_ids,
            num_tokens,
            backward=True,
            microbatches=pipeline_microbatches,
        )

    @torch.no_grad()
    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like forward_backward, without the backward (for evaluation). The FSDP units a forward
        leaves gathered (the head; a pipeline stage's blocks) are resharded after it: left gathered
        by a forward without autograd, torch 2.13's FSDP2 doubled the head's gradient in the next
        backward."""
        loss = self._run(input_ids, targets, doc_ids, num_tokens, backward=False)
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return loss

    def _run(
        self, input_ids, targets, doc_ids, num_tokens, backward: bool, microbatches: int = 0
    ) -> torch.Tensor:
        num_tokens = self.global_tokens(targets) if num_tokens is None else num_tokens
        self.token_weight = self.dp_size / num_tokens.clamp(min=1)
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        if self.make_schedule is None:
            loss = self.weighted_loss(self.parts[0](input_ids, targets=targets, **kwargs), targets)
            if backward:
                loss.backward()
            loss = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            key = (tuple(input_ids.shape), microbatches or self.pp_microbatches)
            if key not in self.schedules:
                self.schedules[key] = self.make_schedule(*key)
            run = self.schedules[key].step if backward else self.schedules[key].eval
            run(
                input_ids,
                target=targets,
                losses=losses,
                return_outputs=False,
                targets=targets,
                **kwargs,
            )
            # Only the last stage holds the micro-batch losses: sum them over the pp group.
            loss = (
                torch.stack(losses).sum().detach()
                if losses
                else torch.zeros((), device=input_ids.device)
            )
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
        if self.mesh["dp_cp"].size() > 1:
            dist.all_reduce(loss, group=self.mesh["dp_cp"].get_group())  # gloo has no AVG
            loss = loss / self.mesh["dp_cp"].size()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm of all gradients; returns that norm (FP32).

        Gradients live on different meshes (the experts on (efsdp, ep), the rest on fsdp) and
        pipeline stages hold different parameters, so a per-mesh norm is not the norm: sum the
        squares of the local shards per (mesh, placements), all-reduce over the dims that shard
        them, add the groups, then all-reduce over the pipeline group."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else (None, None)
            groups.setdefault(key, []).append(
                grad.to_local() if isinstance(grad, DTensor) else grad
            )
        total = torch.zeros((), device=self.collective_device, dtype=torch.float32)
        for (grad_mesh, placements), local in groups.items():
            # host shards when offloaded
            squares = sum(g.float().pow(2).sum() for g in local).to(total.device)
            if grad_mesh is not None:
                for dim, placement in enumerate(placements):
                    if not placement.is_replicate():  # Shard and _StridedShard split the tensor
                        dist.all_reduce(squares, group=grad_mesh.get_group(dim))
            total += squares
        if self.mesh["pp"].size() > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        norm = total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(
                scale.to(grad.device, grad.dtype)
            )
        return norm

    @property
    def collective_device(self) -> torch.device:
        """Where this rank's collectives run: its GPU under NCCL, also when the shards are offloaded
        to host memory (NCCL reduces device tensors only); the CPU under gloo."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
