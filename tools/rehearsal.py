"""Rehearse a GPU job on this CPU: `python3 train.py --config configs/X.toml --dry-run [--world-size
N] [--rank R] [--gpu H200]` runs, in one process, what rank R of the real job runs in its first
step, on a fake world of the job's size, and says what would fail before any GPU hour is spent.

- The world: a fake process group of N ranks (torch.testing's `fake_pg`: every collective returns at
  once, moving nothing) and the real device mesh over it.
- The tensors: fake (FakeTensorMode: shapes, dtypes and strides, no values, no memory), on the CPU
  device, in the GPU run's dtypes (BF16 bulk compute, FP32 master weights, sinks, routers and head).
  The kernels are chosen as on a GPU (devices.targeting): the grouped GEMM with its 16-row groups,
  whose CUDA shape and dtype checks run on fake tensors too, and FlexAttention for "auto".
- The job: the real-size model built on meta and laid out by the real `parallelize` (FSDP2 or HSDP,
  expert parallel, this rank's pipeline stages, context parallel, activation checkpointing), its
  optimizer's states, then one step (forward, backward, clipping, the optimizer; the job's own step
  1 makes the states at its end, so its step 2 holds the most: this step holds the same), an
  evaluation and the checkpoint's state dicts, with the data check on the real data the config names
  when it is there.
- Measured: the peak of live tensor memory of this rank (every fake allocation, FSDP's storage
  resizes included), beside memory.py's estimate and the GPU's capacity. A peak above the capacity
  fails the rehearsal, as it would fail the job.

What a rehearsal cannot show: values (no loss, no NaN), speed, and anything a fake world hides (a
collective's timeout, a hang). What it treats differently, printed as such:
- Routing is forced to be balanced ([training] force_balanced_routing, moe.py): with no values a
  router cannot choose, and expert-parallel split sizes must be known on the host. Every expert gets
  the same rows, as in published MoE throughput tables; a real router's imbalance needs more memory.
- Block masks are built without document boundaries (they cannot be built on fake tensors; the
  masks' memory is that of their block counts, the same either way) and the data's tokens are not
  read.
- torch.compile is not rehearsed: dynamo refuses to trace under the memory tracker's dispatch mode.
  The compiled blocks are traced whole in tests/test_compile.py, and compiling changes no tensor a
  step keeps.
- FlexAttention refuses a backward on CPU tensors and, called eagerly, compiles a wrapper of its
  own: both are lifted for fake tensors (`flex_on_fake_tensors`), whose kernels compute nothing.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.attention.flex_attention as flex_module
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import attention
import parallel
import train
from config import ConfigError, TrainConfig
from devices import targeting
from layers import token_ids_checked_at_load
from lora import adapter_state
from parallel import Process, close_distributed
from report import write_memory_timeline
from tools.memory import GPU_GIB as MEMORY_GPU_GIB
from tools.memory import memory_per_gpu

GIB = 2**30
# Usable memory per GPU: memory.py's (nvidia-smi's totals), and 183,359 MiB on a B200.
GPU_GIB = {"H100": MEMORY_GPU_GIB["80GB"], "H200": MEMORY_GPU_GIB["141GB"], "B200": 179.1}


class RehearsalError(train.TrainingError):
    """What would stop the real job, found by the rehearsal; the message says what to change."""


# ============================================================================= measuring memory


class PeakMemory(TorchDispatchMode):
    """The live bytes of every CPU tensor storage created while active (fake tensors count their
    size), their peak, and the phase of the step it came in. Storages are counted once however many
    views share them, and freed when Python frees them; FSDP2 frees and re-allocates its gathered
    weights by resizing their storage, which is followed too.

    DTensor computes the global shape of an op's output by running the op on fake tensors of the
    global size; on a GPU those never exist (DTensor makes them in a fake mode of its own), so they
    are not counted (`ShardingPropagator._propagate_tensor_meta_non_cached`, paused). Counting them
    is what made torch's FSDPMemTracker report 537 GiB per rank for the 40B model on 8 ranks."""

    supports_higher_order_operators = True  # FlexAttention is a higher-order operator

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # id of a storage -> its bytes, and what made it
        # live bytes by what made them: the phase and the op
        self.by_origin: Counter[str] = Counter()
        self.now = self.peak = 0
        self.at_peak: Counter[str] = Counter()
        self.phase, self.peak_phase = "start", "start"
        self.paused = 0
        self.freed: list[int] = []  # storages freed since the last settle
        # (phase, origin, bytes made or freed): report.py draws it
        self.timeline: list[tuple[str, str, int]] = []

    def track(self, tensor: torch.Tensor, origin: str) -> None:
        if tensor.device.type != "cpu":  # meta tensors hold no memory
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        origin = f"{self.phase}: {origin}"
        self.live[key] = (storage.nbytes(), origin)
        weakref.finalize(storage, self._free, key)
        self._add(storage.nbytes(), origin)

    def _free(self, key: int) -> None:
        self.freed.append(key)  # a finalizer may run mid-update: counted at the next op (settle)

    def settle(self) -> None:
        while self.freed:
            nbytes, origin = self.live.pop(self.freed.pop(), (0, ""))
            self._add(-nbytes, origin)

    def _add(self, nbytes: int, origin: str) -> None:
        self.timeline.append((self.phase, origin, nbytes))
        self.now += nbytes
        self.by_origin[origin] += nbytes
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
            self.at_peak = +self.by_origin

    def largest_at_peak(self, count: int = 8) -> list[tuple[str, float]]:
        """What held the most memory at the peak, in GiB: (phase: op that made it, GiB)."""
        return [(origin, nbytes / GIB) for origin, nbytes in self.at_peak.most_common(count)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        self.settle()
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf, str(func))
        return out

    @contextmanager
    def watching(self) -> Iterator[PeakMemory]:
        """Active, following storage resizes, and blind to DTensor's global-shape propagation."""
        resize, propagate = (
            torch.UntypedStorage.resize_,
            ShardingPropagator._propagate_tensor_meta_non_cached,
        )
        tracker = self

        def tracked_resize(storage, size):
            tracker.settle()
            key, old = id(storage), storage.nbytes()
            result = resize(storage, size)
            if key in tracker.live:
                origin = tracker.live[key][1]
                tracker.live[key] = (storage.nbytes(), origin)
                tracker._add(storage.nbytes() - old, origin)
            return result

        def unseen_propagation(propagator, op_schema):
            tracker.paused += 1
            try:
                return propagate(propagator, op_schema)
            finally:
                tracker.paused -= 1

        with (
            mock.patch.object(torch.UntypedStorage, "resize_", tracked_resize),
            mock.patch.object(
                ShardingPropagator, "_propagate_tensor_meta_non_cached", unseen_propagation
            ),
            self,
        ):
            yield self


# ============================================================================= the fake world


def world_size_of(cfg: TrainConfig, world_size: int | None) -> int:
    """--world-size, or what the config's layout needs (dp_shard = -1 counting as 1), as
    memory.py."""
    if world_size is not None:
        if world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {world_size}")
        return world_size
    return cfg.parallel.named_world_size


def ranks_to_rehearse(cfg: TrainConfig, world_size: int | None, rank: int | None) -> list[int]:
    """--rank, or rank 0 and, under a pipeline, also the last rank: its stages end with the head
    and usually hold the most (memory.py sizes the busiest stage; rank 0 of flint-multinode needs
    a quarter less than its last rank)."""
    if rank is not None:
        return [rank]
    world = world_size_of(cfg, world_size)
    return [0, world - 1] if cfg.parallel.pp > 1 and world > 1 else [0]


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank `rank` of a fake process group of `world_size`."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        close_distributed()


@contextmanager
def flex_on_fake_tensors() -> Iterator[None]:
    """FlexAttention as a GPU runs it, on fake CPU tensors: its device check refuses a backward on
    CPU tensors (the CPU has no backward kernel, and fake tensors need none), and called eagerly it
    wraps its operator in a torch.compile, which cannot run under the memory tracker: call the
    operator directly (its fake kernels give the GPU kernel's outputs and saved tensors)."""
    with (
        mock.patch.object(flex_module, "_validate_device", lambda query, key, value: None),
        mock.patch.object(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True),
    ):
        yield


@contextmanager
def pipeline_votes_on_fake_tensors() -> Iterator[None]:
    """A pipeline schedule's first step has its stages vote, through the ring of ranks, for static
    or dynamic metadata, and reads the result (a value): in a fake world no vote arrives. Every rank
    runs the same model code, whose stages declare the same metadata, so each stage takes the vote
    of its own declaration, which is what the real vote returns."""

    def vote_alone(schedule, stages, has_backward, p2p_done):
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    with mock.patch.object(_PipelineSchedule, "_warmup_p2p", vote_alone):
        yield


def gpu_config(cfg: TrainConfig) -> TrainConfig:
    """The config as the GPU job resolves it: its compute dtype on CUDA, eager blocks (see the
    module docstring), balanced routing."""
    parallel = dataclasses.replace(
        cfg.parallel,
        compile=False,
        param_dtype=str(cfg.parallel.compute_dtype("cuda")).removeprefix("torch."),
    )
    training = dataclasses.replace(cfg.training, force_balanced_routing=True)
    return dataclasses.replace(cfg, parallel=parallel, training=training)


# ============================================================================= the rehearsal


def rehearse(
    cfg: TrainConfig,
    world_size: int | None = None,
    rank: int = 0,
    gpu: str = "H200",
    steps: int = 1,
) -> dict:
    """Rank `rank`'s first `steps` steps of `cfg` on a fake world; prints each phase as it passes
    and returns the measurements. Raises RehearsalError (or the error the real run would raise)."""
    if gpu not in GPU_GIB:
        raise ConfigError(f"--gpu must be one of {', '.join(GPU_GIB)}, got {gpu!r}")
    world = world_size_of(cfg, world_size)
    if not 0 <= rank < world:
        raise ConfigError(f"--rank must be in [0, {world}), got {rank}")
    job = gpu_config(cfg)
    say = Phases(f"rank {rank} of {world}")
    say.start(f"joining a fake world of {world}")
    with (
        fake_world(world, rank),
        targeting("cuda"),
        flex_on_fake_tensors(),
        block_masks_on_real_tensors(),
        pipeline_votes_on_fake_tensors(),
    ):
        run = start_fake_run(job, say)
        batches = rehearsal_batches(job, run, say)
        tracker = PeakMemory()
        say.start("building the model on meta and sharding it")
        with (
            failing_as_the_job(job, rank, world, lambda: "while laying out the model"),
            mock.patch.object(
                parallel, "device_memory_bytes", lambda device_type: GPU_GIB[gpu] * GIB
            ),
        ):
            # on meta; [parallel] accumulation "auto" for the GPU's memory
            model = train.build_model(job, run)
        with FakeTensorMode(allow_non_fake_inputs=True), tracker.watching():
            with failing_as_the_job(
                job, rank, world, lambda: "while allocating the weights and the optimizer"
            ):
                for part in model.parts:
                    part.to_empty(device="cpu")  # fake: nothing is allocated, nothing initialised
                optimizer = train.build_optimizer(model.module, job.optim)
            say(
                f"model: {job.model_config.num_hidden_layers} layers laid out ({len(model.parts)} "
                "stage(s) here), "
                f"{str(job.parallel.compute_dtype('cuda'))[6:]} compute, weights "
                f"{tracker.now / GIB:.1f} GiB, "
                f"accumulation {model.accumulation}"
            )
            if not job.parallel.offload:
                check_fits(job, world, rank, gpu, tracker.peak / GIB, "for its FP32 weights alone")
            with failing_as_the_job(
                job, rank, world, lambda: "while making the optimizer's states"
            ):
                make_optimizer_states(optimizer, tracker)
            for step in range(1, steps + 1):
                say.start(
                    f"step {step}: tracing the forward, backward and {job.optim.name} "
                    f"on fake tensors"
                )
                with failing_as_the_job(
                    job, rank, world, lambda: f"at step {step}, in the {tracker.phase}"
                ):
                    fake_step(model, optimizer, batches(), job, tracker)
                say(f"step {step}: forward, backward, clipping and {job.optim.name} passed")
            say.start("evaluation: tracing on fake tensors")
            with failing_as_the_job(job, rank, world, lambda: "in the evaluation"):
                fake_evaluation(model, batches()[0], tracker)
            say("evaluation (train.py's, after the last step and every eval_every steps) passed")
            checkpoint_bytes = state_dict_bytes(model, optimizer, job.lora.enabled)
            say(
                f"checkpoint: this rank's state dicts hold {checkpoint_bytes / GIB:.1f} GiB (model "
                "and optimizer)"
            )
            host = offloaded_bytes(model, optimizer) if job.parallel.offload else 0
    picture = write_memory_timeline(
        Path(cfg.logging.jsonl).parent / f"rehearsal_rank{rank}_of_{world}_memory.svg",
        tracker.timeline,
        f"{cfg.source}: rank {rank} of {world}, live memory (fake tensors)",
    )
    measured = report(job, world, rank, gpu, tracker, say, host)
    say(
        f"live memory over the steps, by phase and by what holds it: {picture} "
        f"(beside [logging] jsonl)"
    )
    return measured


@contextmanager
def failing_as_the_job(cfg: TrainConfig, rank: int, world: int, when) -> Iterator[None]:
    """An error of the job's own code or torch's, inside, as the one line of a RehearsalError: where
    (when(), called on failure: the phase it reached), the innermost line of this repository it
    passed through, and the error's first line."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RehearsalError(
            f"{cfg.source}: rank {rank} of {world} fails {when()} "
            f"({where_in_repository(error)}), "
            f"as the GPU job would: {type(error).__name__}: {first_line}"
        ) from error


def where_in_repository(error: BaseException) -> str:
    """The innermost line of this repository's code that the error passed through: file:line
    (function)."""
    root = Path(__file__).resolve().parent.parent
    ours = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if Path(frame.filename).resolve().parent in (root, root / "tools")
        and Path(frame.filename).resolve() != Path(__file__).resolve()
    ]
    return (
        f"{Path(ours[-1].filename).relative_to(root)}:{ours[-1].lineno}, {ours[-1].name}"
        if ours
        else "in torch"
    )


class Phases:
    """Prints each phase as it starts (a large job's phases take minutes on a busy CPU: the user
    sees which one runs) and as it ends, with the seconds it took and those since the rehearsal
    began."""

    def __init__(self, who: str):
        self.who = who
        self.began = self.last = time.perf_counter()

    def start(self, message: str) -> None:
        self.last = time.perf_counter()
        print(
            f"rehearsal {self.who}: {message} ... (at {self.last - self.began:.1f} s)", flush=True
        )

    def __call__(self, message: str) -> None:
        now = time.perf_counter()
        took, since = now - self.last, now - self.began
        print(f"rehearsal {self.who}: {message} ({took:.1f} s, at {since:.1f} s)", flush=True)
        self.last = now


def start_fake_run(cfg: TrainConfig, say: Phases) -> Process:
    run = train.join_mesh(cfg, torch.device("cpu"))  # the mesh is built outside FakeTensorMode
    say(
        f"fake world of {run.world_size} ({train.layout_of(run)}); routing forced balanced, block "
        "masks "
        f"without documents, blocks eager (see rehearsal.py)"
    )
    return run


def rehearsal_batches(cfg: TrainConfig, run: Process, say: Phases):
    """The data check on the data the config names, when it exists here; the step's batches are
    fake token ids of the real shape (a rehearsal reads no values)."""
    missing = train.missing_inputs(cfg)
    if missing:
        say(f"data: not checked: {missing}")
    else:  # as rank 0 for the preparation the real job's rank 0 does while this rank waits
        say.start(f"data: checking {cfg.data.path} (preparing it as rank 0 would)")
        train.setup_data(cfg, dataclasses.replace(run, rank=0))
        say(
            f"data: {cfg.data.path} has enough rows for {cfg.training.steps} steps on "
            f"{run.dp_size} "
            f"data-parallel ranks"
        )
    shape = (cfg.training.batch_size, cfg.data.seq_len)

    def batches() -> list[dict[str, torch.Tensor]]:
        return [
            {
                "input_ids": torch.zeros(shape, dtype=torch.long),
                "targets": torch.zeros(shape, dtype=torch.long),
            }
            for _ in range(cfg.training.grad_accum)
        ]

    return batches


@contextmanager
def block_masks_on_real_tensors() -> Iterator[None]:
    """create_block_mask evaluates its mask_mod through a trace of its own, which fake tensors
    refuse: the shape-only masks the rehearsal uses (no documents) are built on real tensors (block
    counts and indices, a few MiB) and handed to the fake step like any other constant."""
    build = attention.new_block_mask

    def build_for_real(*args, **kwargs):
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    with mock.patch.object(attention, "new_block_mask", build_for_real):
        yield


def make_optimizer_states(optimizer: torch.optim.Optimizer, tracker: PeakMemory) -> None:
    """The optimizer's states, made before step 1 by a step on zero gradients (fake tensors: no
    value changes). A job's step 1 makes them at its end, so its peak, a forward and backward with
    the states alive, comes in step 2; with them made first, step 1 is that step, and one step
    measures the job's peak (tests/test_rehearsal.py checks it against two steps without)."""
    tracker.phase = "optimizer states"
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fake_step(model, optimizer, batches: list[dict], cfg: TrainConfig, tracker: PeakMemory) -> None:
    """train.train_step without its one copy to the host (the loss, the norms: fake tensors hold no
    values): micro-batches weighted by the step's tokens, clipping, the optimizer. Any other read of
    a value fails here (DataDependentOutputException), as a host sync the GPU step would make."""
    tracker.phase = "forward and backward"
    with token_ids_checked_at_load():  # as in train_step: data.py checks the real run's ids at load
        model.accumulate_gradients(batches)
    tracker.phase = "optimizer"
    model.clip_grad_norm_(cfg.optim.grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fake_evaluation(model, batch: dict, tracker: PeakMemory) -> None:
    """train.evaluate's forward without a backward (ParallelModel.loss), which a pipeline runs with
    a schedule of its own (pipeline.ForwardOnlyEvaluation)."""
    tracker.phase = "evaluation"
    num_tokens = model.global_tokens(batch["targets"].unsqueeze(0))
    with token_ids_checked_at_load():
        model.loss(**batch, num_tokens=num_tokens)


def state_dict_bytes(model, optimizer, adapters_only: bool = False) -> int:
    """The bytes this rank's checkpoint would write: its shards of the model (a LoRA run's: of its
    adapters, checkpoint.py) and optimizer states."""
    weights = get_model_state_dict(model.module)
    states = [
        adapter_state(weights) if adapters_only else weights,
        get_optimizer_state_dict(model.module, optimizer),
    ]
    local = [
        t.to_local() if isinstance(t, DTensor) else t
        for t in pytree.tree_leaves(states)
        if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in local)


def check_fits(cfg: TrainConfig, world: int, rank: int, gpu: str, needed: float, what: str) -> None:
    """The job would run out of memory where this rank needs more than the GPU's capacity (GiB)."""
    capacity = GPU_GIB[gpu]
    if needed > capacity:
        raise RehearsalError(
            f"{cfg.source}: rank {rank} of {world} needs {needed:.1f} GiB {what}, "
            "more than the "
            f"{capacity:.1f} GiB of an {gpu}: the job would run out of memory. "
            "Shard more "
            "([parallel] dp_shard, ep, pp), set [parallel] "
            'activation_checkpointing = "full" '
            f"or offload = true, or lower [training] batch_size"
        )


def offloaded_bytes(model, optimizer) -> int:
    """What [parallel] offload keeps in host memory: this rank's shards of the weights, of the
    gradients of the trainable ones, and the optimizer's states."""
    params = [p.to_local() if isinstance(p, DTensor) else p for p in model.module.parameters()]
    states = [
        t
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in states]
    return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params) + sum(
        t.numel() * t.element_size() for t in local
    )


def report(
    cfg: TrainConfig, world: int, rank: int, gpu: str, tracker: PeakMemory, say: Phases, host: int
) -> dict:
    """The measured peak on the GPU (less what offload keeps in host memory: on fake CPU tensors
    both are counted), beside memory.py's estimate and the GPU's capacity."""
    parallel = cfg.parallel.resolve(world, cfg.model_config.num_experts)
    estimate = memory_per_gpu(
        cfg.model_config,
        parallel,
        cfg.data.seq_len,
        cfg.training.batch_size,
        cfg.training.grad_accum,
        GPU_GIB[gpu],
        cfg.lora if cfg.lora.enabled else None,
    )["total"]
    peak, capacity = (tracker.peak - host) / GIB, GPU_GIB[gpu]
    offloaded = f", and {host / GIB:.1f} GiB in host memory ([parallel] offload)" if host else ""
    say(
        f"peak {peak:.1f} GiB of {capacity:.1f} GiB on an {gpu} (memory.py {estimate:.1f} "
        f"GiB){offloaded}, "
        f"in the {tracker.peak_phase}; held by: "
        + ", ".join(f"{gib:.1f} GiB from {origin}" for origin, gib in tracker.largest_at_peak())
    )
    check_fits(cfg, world, rank, gpu, peak, "at its peak")
    return {
        "peak_gib": peak,
        "estimate_gib": estimate,
        "capacity_gib": capacity,
        "host_gib": host / GIB,
        "phase": tracker.peak_phase,
        "world_size": world,
        "rank": rank,
    }
