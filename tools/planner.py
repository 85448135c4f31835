"""Step time per GPU of a training config, predicted op by op without a GPU.

    python3 -m tools.planner --config configs/flint-8gpu.toml  # H100 SXM, the config's layout
    python3 -m tools.planner --config configs/flint-multinode.toml --gpu H200 --gpus 32
    python3 -m tools.planner --config configs/large4-256gpu.toml --gpu B200
    python3 -m tools.planner --preset flint-shallow --gpu H200 --gpus 1 --data.seq_len=4096 \\
        --training.batch_size=2
    python3 -m tools.planner --gpu cpu  # bench.py's CPU shape, this machine
    python3 -m tools.planner --validate  # published runs, measured / predicted
    python3 -m tools.planner --config configs/flint-8gpu.toml --peak  # every op at 100 % of peak

prints tokens/s per GPU, MFU, the step time and the ten ops or collectives that cost most, then the
same step at 100 % of every peak (the bound); --peak prints the table of that bound instead. Method:

1. Compute: one forward and backward (with the recompute forward of activation checkpointing) of the
   whole model at a rank's micro-batch [batch_size, seq_len], in the run's dtypes (BF16 bulk, FP32
   sinks, routers and head), traced op by op on fake tensors (op_trace.py: FLOPs by
   FlopCounterMode's formulas, bytes read and written). An expert-parallel rank computes the same
   (balanced loads), reading 1/ep of the expert weights. Each op costs max(FLOPs / the rate of its
   dtype, bytes / HBM bandwidth), each rate the calibrated fraction of its peak that a published
   measurement found on that GPU generation (tools/gpus.py's EFFICIENCIES; grouped GEMMs lose their
   part-filled 128-row tiles); at 100 %, the bound. Compiled, the bytes left once elementwise chains
   fuse within each graph (op_trace.fuse_chains). With [parallel] fp8, fp8.py's GEMMs run at the
   FP8 peak (FP8_PEAKS); their quantisation (amax, scale, cast) is plain torch ops in the trace,
   priced as the other ops (eager: a pass each; compiled: fused into its chain). [parallel]
   activation_checkpointing = "op" (matmul and attention outputs kept) traces no recompute and adds
   the blocks' FLOP-free forward ops once more (op_recompute_item).
2. The trace runs the CPU's code path (fake CUDA tensors cannot take gradients on a CPU build of
   torch). For a GPU the attention core is replaced: the ops of the CPU kernel (its flash custom op,
   or the dense [B, H, T, S] score matrices of Mistral Large 4's sdpa path) are dropped and one flex
   kernel per step stands in, with the model's own attention FLOPs (model.flops_per_token, its part
   that grows with the keys attended) times (2 forward + 5 backward + 2 per recompute) / 6 for the
   flash kernels' backward, which recomputes the scores, times the 128 x 128 tiles flex computes
   where a tile is only partly visible (attention_tile_ratio), at the measured forward and backward
   rates of [model] attention_backend's kernel on that GPU (flex's Triton kernel; flash: its FLASH
   backend, flash-attn-4). MoE experts are padded to groups of 16 rows as on CUDA (without expert
   parallelism).
3. Layout, per micro-batch, from [parallel] and the parameter sizes on the meta device (ring
   collectives: a group of n moves (n - 1) / n of the gathered bytes per GPU at NCCL's measured bus
   bandwidth: NVLink when the group stays inside a node of 8 GPUs, which the mesh order pp,
   dp_replicate, dp_shard, ep, cp decides, else min(NVLink, its members in a node x their NICs)):
   - FSDP: each block all-gathers its parameters in forward and again in backward (BF16, FP32 units
     in FP32; the root units, embedding, norm and head, once) and reduce-scatters FP32 gradients, as
     [parallel] accumulation runs them (fsdp_passes: sync_each every micro-batch, sync_last gathers
     each but reduce-scatters once, gathered gathers and reduce-scatters once a step; "auto"
     resolved for the device's memory as parallel.choose_accumulation does); routed experts over
     dp_shard x cp, the rest over dp_shard x ep x cp. A block's collectives overlap the compute of
     its neighbours: exposed are the first block's all-gather and reduce-scatter, and whatever of
     each block's collectives outlasts that block's compute. HSDP adds an all-reduce over
     dp_replicate after each reduce-scatter, exposed.
   - Expert parallelism: per MoE layer, 2 all-to-alls in forward (rows to the experts and back,
     tokens x top-k x hidden in BF16 each way), 2 in backward, 2 more per recomputed forward, in
     [parallel] ep_overlap chunks, exposed as moe.ExpertParallelExperts' schedule leaves them
     (overlapped_exchange: dispatch 0 past the shared expert, the last combine, and whatever of the
     transfers outlasts the experts' compute on a chunk), at NCCL all_to_all_single's rate. Expert
     loads are assumed balanced. [parallel] ep_exchange: sized (today) adds one host sync per MoE
     layer and micro-batch (host_sync_item); sync_free none, its static buffers sent whole
     (sync_free_buffer_factor: ep x min(k, E / ep) / k times the balanced rows).
   - Pipeline: each stage computes 1/pp of the rank's trace, sends [B, T, H] BF16 activations
     forward and gradients back per micro-batch (exposed), and idles a bubble of (pp - 1) / (m x v)
     of its compute (m micro-batches of a schedule call, v stages per rank; sync_last and gathered
     run the step's micro-batches in one call).
   - Context parallelism: each rank computes 1/cp of the trace and all-gathers the keys and values
     of every layer (forward, recompute) and reduce-scatters their gradients (backward), exposed.
4. Per step: grad_accum micro-batches, then AdamW over the FP32 shards: 32 bytes per trainable
   parameter (read weight, gradient, 2 moments, write weight, 2 moments, and the norm's read), 24
   with [optim] state_dtype = "bfloat16" moments.
5. `--validate`: published MoE runs (tools/<family>_published_runs.py), measured / predicted beside
   the bound, each marked fitted (a tools/gpus.py constant was fitted to it) or held out.

The design choices beyond the mesh come from the config (read_options): [model]
attention_backend ("flash": flex's FLASH backend; "auto" is priced as flex, which it resolves to
wherever flash-attn-4 is not installed), [parallel] ep_exchange and [optim] state_dtype.

MFU divides the model's FLOPs (model.flops_per_token, as train.py counts them) by the step time and
the dense BF16 peak, with FP8 too. --gpu cpu measures this machine's FP32 matmul rate and copy
bandwidth and predicts bench.py's CPU shape, to check the method against a measured step."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from config import ConfigError, TrainConfig, load_config
from flags import OneLineParser, positive
from parallel import MESH_DIMS, ParallelConfig
from registry import FAMILIES, ModelConfig
from tools.gpus import (
    ATTENTION_BACKENDS,
    FP8_PEAKS,
    GPUS,
    Device,
    Efficiency,
    efficiency_of,
)
from tools.memory import (
    MEMORY_MARGIN,
    OVERHEAD_GIB,
    accumulation_of,
    gib_needed,
    memory_per_gpu,
    meta_model,
    stage_param_counts,
)
from tools.op_trace import OpCost, trace_step

# ============================================================================= calibration

# What real kernels and collectives reach, per GPU generation, is tools/gpus.py's EFFICIENCIES (each
# fraction of a data-sheet peak from a published measurement, cited there). With them a prediction
# is what the step should take, not a bound: `--peak` prices every op at 100 % of its peak instead.
# The MoE grouped GEMM (torch._grouped_mm, CUTLASS) computes each expert's rows in tiles of 128
# rows: an expert's last tile is on average half empty, so it reaches its rate x r / (r + 64) at r
# rows per expert (tile quantisation; thousands of rows per expert come near the dense rate, a few
# hundred do not).
GROUPED_GEMM_TILE_ROWS = 128
# flex computes whole 128 x 128 tiles of scores wherever a tile holds one visible key (block masks):
# on a 128-key sliding window that is about 2 x the attended pairs (attention_tile_ratio). cuDNN and
# flash-attn-4 tile the same way.
ATTENTION_TILE = 128
# [parallel] ep_exchange: sized (moe.py today: NCCL all_to_all_single of exactly the routed rows,
# their split sizes copied to the host once per MoE layer), sync_free (no host copy: static buffers
# of sync_free_buffer_factor x the balanced rows), deepep (DeepEP's kernels: published runs only).
EXCHANGES = ("sized", "sync_free", "deepep")
# AdamW's traffic per trainable parameter and step, by [optim] state_dtype: read the FP32 weight and
# gradient, the two moments, write the weight and the moments, and the gradient norm's read: 4 + 4 +
# 2 m + 4 + 2 m + 4 with m bytes a moment.
OPTIMIZER_BYTES = {"float32": 32, "bfloat16": 24}

# What an FP32 matmul of the head runs at on CUDA, by [parallel] head_precision: its peak from a
# Device.
HEAD_PRECISION_PEAKS = {
    "tf32": lambda d: d.tf32,
    "bf16": lambda d: d.bf16,
    "bf16x3": lambda d: d.bf16 / 3,
    "float32": lambda d: d.fp32,
}


def measure_cpu(matmul_size: int = 1024, copy_mib: int = 512) -> Device:
    """This machine as a Device: its best FP32 matmul rate and large-copy bandwidth (read +
    write)."""
    from tools.profiling import matmul_rate, time_call

    rate = matmul_rate(torch.device("cpu"), torch.float32, matmul_size)
    source = torch.ones(copy_mib * 2**20 // 4)
    target = torch.empty_like(source)
    seconds = min(time_call(lambda: target.copy_(source), torch.device("cpu")) for _ in range(5))
    bandwidth = 2 * source.nbytes / seconds
    return Device(
        f"cpu ({rate / 1e12:.3f} TFLOP/s FP32 matmul, {bandwidth / 1e9:.1f} GB/s copy, "
        "measured now)",
        rate,
        rate,
        rate,
        bandwidth,
        0.0,
        0.0,
        gpus_per_node=1,
    )


def device_named(name: str) -> Device:
    """A GPU of GPUS by name (any case), or `cpu` (this machine, measured now)."""
    if name.lower() == "cpu":
        return measure_cpu()
    for key, device in GPUS.items():
        if name.upper() == key:
            return device
    raise ConfigError(f"--gpu: unknown GPU {name!r}; choose one of {', '.join(GPUS)} or cpu")


# ============================================================================= costing the ops


@dataclasses.dataclass
class Item:
    """A line of the cost table: seconds per step on one GPU, what bounds it, and how much is
    exposed."""

    label: str
    seconds: float
    exposed: float  # of `seconds`, what the step waits for (compute: all of it)
    bound: str  # compute | memory | link


@dataclasses.dataclass(frozen=True)
class Pricing:
    """What an op costs depends on: the device (and its generation's calibrated fractions), the
    head's FP32 matmul precision, the expert-parallel degree (each rank reads 1/ep of the expert
    weights), whether the blocks are compiled, the attention backend and the expert exchange."""

    device: Device
    head_precision: str = "tf32"
    ep: int = 1
    compiled: bool = False
    # the kernels at their measured fractions of peak (calibration); False: at 100 %
    calibrated: bool = True
    # rows each local expert computes per micro-batch (balanced): the grouped GEMM's
    expert_rows: float = 0.0
    # the attention kernel: flex (Flint's Triton one), flash (flex's FLASH backend, flash-attn-4),
    # or fused (cuDNN: published runs only)
    attention: str = "flex"
    exchange: str = "sized"  # EXCHANGES
    # sync_free: static buffer rows over the balanced rows (sync_free_buffer_factor)
    ep_buffer_factor: float = 1.0

    @property
    def gpu(self) -> bool:
        return not self.device.name.startswith("cpu")

    @property
    def rates(self) -> Efficiency:
        """The device generation's calibrated fractions (tools/gpus.py)."""
        return efficiency_of(self.device)

    @property
    def hbm(self) -> float:
        """Bytes/s a memory-bound kernel moves."""
        return self.device.hbm * self.efficiency(self.rates.hbm)

    def efficiency(self, fraction: float) -> float:
        """A calibration constant, or 1 for the 100 %-of-peak bound (and the CPU, whose rates are
        measured)."""
        return fraction if self.calibrated and self.gpu else 1.0

    def matmul_peak(self, cost: OpCost) -> float:
        """FLOP/s for a matmul of this dtype: BF16 tensor cores; FP32 ones in the head at
        head_precision, elsewhere (routers) at torch's default "highest" precision, on CUDA cores;
        fp8.py's ops at the FP8 peak."""
        if cost.op.startswith("flint.fp8"):
            return FP8_PEAKS.get(self.device.name, self.device.bf16)
        if cost.dtype != "float32":
            return self.device.bf16
        if cost.module.startswith("lm_head"):
            return HEAD_PRECISION_PEAKS[self.head_precision](self.device)
        return self.device.fp32

    def seconds(self, cost: OpCost) -> tuple[float, str]:
        """The roofline of one OpCost: max(FLOPs / rate, bytes / HBM bandwidth), and which bounds
        it; the rate and bandwidth at their calibrated fractions (grouped GEMMs at theirs)."""
        moved = (cost.fused_bytes if self.compiled else cost.bytes) - cost.expert_weight_bytes * (
            1 - 1 / self.ep
        )
        fraction = self.efficiency(self.rates.gemm)
        if "grouped_mm" in cost.op:
            fraction *= self.efficiency(self.rates.grouped_gemm)
            if self.expert_rows:
                fraction *= self.efficiency(
                    self.expert_rows / (self.expert_rows + GROUPED_GEMM_TILE_ROWS / 2)
                )
        compute = cost.flops / (self.matmul_peak(cost) * fraction) if cost.flops else 0.0
        memory = moved / self.hbm
        return max(compute, memory), "compute" if compute >= memory else "memory"


def recomputed_share(config: ModelConfig, checkpointing: str) -> float:
    """The share of blocks whose forward runs again in backward
    (parallel.apply_activation_checkpointing)."""
    layers = config.num_hidden_layers
    # op: every matmul and attention output kept, no block's forward runs again (op_recompute_item)
    return {
        "none": 0.0,
        "op": 0.0,
        "full": 1.0,
        "selective": math.ceil(layers / 2) / layers,
    }[checkpointing]


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """The part of model.flops_per_token that grows with the keys each query attends. Both models
    count FLOPs = fixed + c x mean keys per query, and the mean is 1 at seq_len 1 and 1.5 at 2, so
    two evaluations give c and the fixed part."""
    model = meta_model(config)
    one, two = model.flops_per_token(1), model.flops_per_token(2)
    per_key = (two - one) / 0.5
    return model.flops_per_token(seq_len) - (one - per_key)


def tiled_pairs(seq_len: int, window: int | None, tile: int = ATTENTION_TILE) -> tuple[int, int]:
    """(query-key pairs a tiled kernel computes, pairs attended) of one causal layer: query tile i
    computes every key tile holding a key it may see (positions within `window`, None: all before
    it)."""
    computed = attended = 0
    for first in range(0, seq_len, tile):
        last = min(first + tile, seq_len) - 1
        lowest = 0 if window is None else max(0, first - window + 1)
        computed += (last // tile - lowest // tile + 1) * tile * (last - first + 1)
        attended += sum(
            i + 1 if window is None else min(i + 1, window) for i in range(first, last + 1)
        )
    return computed, attended


def attention_tile_ratio(config: ModelConfig, seq_len: int) -> float:
    """The attention FLOPs flex computes over those the model counts: its partly masked tiles, over
    the layers (Flint: full and sliding-window layers; a model without layer_types: causal on every
    layer)."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    pairs = [
        tiled_pairs(seq_len, window if kind == "sliding_attention" else None) for kind in kinds
    ]
    return sum(c for c, _ in pairs) / sum(a for _, a in pairs)


def attention_seconds(
    config: ModelConfig, pricing: Pricing, seq_len: int, tokens: float, checkpointing: str
) -> float:
    """The attention kernels of one micro-batch: per attended key 2 units of the model's 6 in
    forward (and per recompute), 5 in backward (it recomputes the scores), times the partly masked
    tiles, at the backend's rates on this GPU generation."""
    flops = attention_flops_per_token(config, seq_len) * tokens / 6
    if pricing.calibrated:
        flops *= attention_tile_ratio(config, seq_len)
    forward = (2 + 2 * recomputed_share(config, checkpointing)) * flops
    peak = pricing.device.bf16
    forward_fraction, backward_fraction = pricing.rates.attention[pricing.attention]
    return forward / (peak * pricing.efficiency(forward_fraction)) + 5 * flops / (
        peak * pricing.efficiency(backward_fraction)
    )


def compute_items(
    config: ModelConfig,
    costs: list[OpCost],
    pricing: Pricing,
    seq_len: int,
    tokens: float,
    checkpointing: str,
) -> list[Item]:
    """The traced ops grouped by (op, dtype, shapes), in seconds per micro-batch. On a GPU the
    attention core becomes one flex kernel (the module docstring, point 2)."""
    groups: dict[str, Item] = {}
    for cost in costs:
        if pricing.gpu and cost.attention_core:
            continue
        seconds, bound = pricing.seconds(cost)
        where = f" ({cost.module})" if cost.module else ""
        label = f"{cost.op} {cost.dtype} {cost.shapes}"
        item = groups.setdefault(label, Item(label, 0.0, 0.0, bound))
        item.seconds, item.exposed = item.seconds + seconds, item.exposed + seconds
        if where and not item.label.endswith(")"):
            item.label += where
    items = list(groups.values())
    if pricing.gpu:
        seconds = attention_seconds(config, pricing, seq_len, tokens, checkpointing)
        label = f"attention core ({pricing.attention} kernel, BF16)"
        items.append(Item(label, seconds, seconds, "compute"))
    return items


# ======================================================================= the layout's communication


def group_span(layout: ParallelConfig, dims: tuple[str, ...], device: Device) -> tuple[int, int]:
    """(size, members in one node) of the process group over mesh `dims` (rank = sum of coordinate x
    stride over MESH_DIMS, the last dim innermost; nodes of device.gpus_per_node consecutive
    ranks)."""
    size = per_node = 1
    for index, dim in enumerate(MESH_DIMS):
        degree = getattr(layout, dim)
        if dim in dims and degree > 1:
            stride = math.prod(getattr(layout, inner) for inner in MESH_DIMS[index + 1 :])
            size *= degree
            per_node *= max(1, min(degree, device.gpus_per_node // stride))
    return size, per_node


def ring_bandwidth(pricing: Pricing, size: int, per_node: int) -> float:
    """Bus bandwidth per GPU of a ring all-gather or reduce-scatter: NVLink inside a node; a ring
    across nodes runs one channel through the NIC of each member of a node, so min(NVLink, members x
    NIC)."""
    device = pricing.device
    nvlink = device.nvlink * pricing.efficiency(pricing.rates.nvlink_ring)
    if per_node == size:
        return nvlink
    return min(nvlink, per_node * device.network * pricing.efficiency(pricing.rates.network))


def group_link(
    layout: ParallelConfig, dims: tuple[str, ...], pricing: Pricing
) -> tuple[int, float]:
    """(size, ring bus bandwidth per GPU) of the process group over mesh `dims`."""
    size, per_node = group_span(layout, dims, pricing.device)
    return size, ring_bandwidth(pricing, size, per_node)


def ring_seconds(gathered_bytes: float, size: int, bandwidth: float) -> float:
    """All-gather or reduce-scatter of `gathered_bytes` (the whole, unsharded) over `size` GPUs: a
    ring moves (n - 1) / n of it through each GPU's link."""
    return 0.0 if size == 1 else gathered_bytes * (size - 1) / size / bandwidth


def all_to_all_seconds(sent_bytes: float, size: int, per_node: int, pricing: Pricing) -> float:
    """An all-to-all in which each GPU sends `sent_bytes` spread evenly over the group (its own
    share stays): over NVLink inside a node (at DeepEP's rate or NCCL's, by the exchange); across
    nodes the share for other nodes leaves by the GPU's own NIC while the rest crosses NVLink at the
    same time."""
    device = pricing.device
    rates = pricing.rates
    fraction = rates.all_to_all if pricing.exchange == "deepep" else rates.all_to_all_nccl
    nvlink = device.nvlink * pricing.efficiency(fraction)
    inside = sent_bytes * (per_node - 1) / size / nvlink
    outside = (
        sent_bytes
        * (size - per_node)
        / size
        / (device.network * pricing.efficiency(pricing.rates.network))
    )
    return max(inside, outside)


def unit_bytes(
    config: ModelConfig, layout: ParallelConfig, bulk_bytes: int
) -> list[tuple[float, float, float, float]]:
    """Per FSDP unit (each block of one pipeline stage, then the root modules): the bytes gathered
    over the FSDP group and over the experts' group, and their FP32 gradients, for one rank."""
    key = (repr(config), layout.pp, layout.ep, bulk_bytes)
    if key not in _UNITS:
        _UNITS[key] = count_unit_bytes(config, layout, bulk_bytes)
    return _UNITS[key]


_UNITS: dict[tuple, list[tuple[float, float, float, float]]] = {}


def count_unit_bytes(
    config: ModelConfig, layout: ParallelConfig, bulk_bytes: int
) -> list[tuple[float, float, float, float]]:
    """unit_bytes, counted on the meta model."""
    model = meta_model(config)
    layers = list(model.layers.values())
    units = []
    for layer in layers[: math.ceil(len(layers) / layout.pp)]:
        fp32 = {id(p) for module in model.fp32_modules(layer) for p in module.parameters()}
        expert = [p for n, p in layer.named_parameters() if ".mlp.experts." in f".{n}"]
        expert_ids = {id(p) for p in expert}
        others = [p for p in layer.parameters() if id(p) not in expert_ids]
        gathered = sum(p.numel() * (4 if id(p) in fp32 else bulk_bytes) for p in others)
        expert_elements = sum(p.numel() for p in expert) / layout.ep
        units.append(
            (
                gathered,
                expert_elements * bulk_bytes,
                4 * sum(p.numel() for p in others),
                4 * expert_elements,
            )
        )
    block_ids = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in block_ids]  # embedding, final norm, head
    fp32 = {
        id(p) for module in (model.lm_head, *model.fp32_root_modules()) for p in module.parameters()
    }
    units.append(
        (
            sum(p.numel() * (4 if id(p) in fp32 else bulk_bytes) for p in root),
            0.0,
            4 * sum(p.numel() for p in root),
            0.0,
        )
    )
    return units


@dataclasses.dataclass(frozen=True)
class Pass:
    """What FSDP does in one forward and backward (or one pipeline schedule call) of a step:
    all-gathers of each block and of the root units, whether it reduce-scatters, and the
    micro-batches of compute it spans."""

    block_gathers: int
    root_gathers: int
    scatters: int
    microbatches: int = 1


def fsdp_passes(layout: ParallelConfig, microbatches: int, accumulation: str) -> list[Pass]:
    """The passes of a step as parallel.ParallelModel.accumulate_gradients runs them. One
    micro-batch, or each of sync_each's: every block gathered in forward and again in backward (once
    if reshard_after_forward is off), the root units once (kept gathered after forward), gradients
    reduce-scattered. sync_last: the same gathers, gradients reduce-scattered in the last backward
    only; gathered: the weights gathered once in the first forward, kept until the last backward.
    Under pp a schedule call keeps its stage gathered and syncs once: one call per micro-batch
    (sync_each) or one for the step."""
    if layout.pp > 1:
        calls = microbatches if accumulation == "sync_each" else 1
        return [Pass(1, 1, 1, microbatches // calls)] * calls
    regathered = 2 if layout.reshard_after_forward in (None, True) else 1
    if microbatches == 1 or accumulation == "sync_each":
        return [Pass(regathered, 1, 1)] * microbatches
    if accumulation == "sync_last":
        return [Pass(regathered, 1, 0)] * (microbatches - 1) + [Pass(regathered, 1, 1)]
    return [Pass(1, 1, 0)] + [Pass(0, 0, 0)] * (microbatches - 2) + [Pass(0, 0, 1)]


def fsdp_items(
    config: ModelConfig,
    layout: ParallelConfig,
    pricing: Pricing,
    bulk_bytes: int,
    layer_compute: float,
    microbatches: int = 1,
    accumulation: str = "sync_each",
) -> list[Item]:
    """FSDP's collectives of one step, and the part of them exposed: in each pass the first block's
    all-gather and reduce-scatter, and whatever of each other unit's outlasts a block's compute."""
    fsdp, fsdp_bw = group_link(layout, ("dp_shard", "ep", "cp"), pricing)
    efsdp, efsdp_bw = group_link(layout, ("dp_shard", "cp"), pricing)
    units = unit_bytes(config, layout, bulk_bytes)
    gathers, scatters, exposed = 0.0, 0.0, 0.0
    passes = fsdp_passes(layout, microbatches, accumulation)
    for step in passes:
        for index, (other, expert, other_grad, expert_grad) in enumerate(units):
            gather = ring_seconds(other, fsdp, fsdp_bw) + ring_seconds(expert, efsdp, efsdp_bw)
            scatter = step.scatters * (
                ring_seconds(other_grad, fsdp, fsdp_bw) + ring_seconds(expert_grad, efsdp, efsdp_bw)
            )
            gather *= step.root_gathers if index == len(units) - 1 else step.block_gathers
            gathers, scatters = gathers + gather, scatters + scatter
            overlapped = 0.0 if index == 0 else layer_compute * step.microbatches
            exposed += max(0.0, gather + scatter - overlapped)
    items = [
        Item(f"FSDP all-gathers (group {fsdp}, experts {efsdp})", gathers, 0.0, "link"),
        Item(f"FSDP reduce-scatters (group {fsdp}, experts {efsdp})", scatters, 0.0, "link"),
    ]
    total = gathers + scatters
    for item in items:  # the exposed time, shared in proportion
        item.exposed = exposed * item.seconds / total if total else 0.0
    replicas, replica_bw = group_link(layout, ("dp_replicate",), pricing)
    # HSDP: the sharded gradients all-reduced over the replicas (2 ring passes) after each
    # reduce-scatter
    if replicas > 1:
        shard = sum(o / fsdp + e / efsdp for _, _, o, e in units)
        seconds = (
            2 * ring_seconds(shard, replicas, replica_bw) * sum(step.scatters for step in passes)
        )
        items.append(Item(f"HSDP all-reduce (group {replicas})", seconds, seconds, "link"))
    return items


def overlapped_exchange(chunk: float, chunks: int, experts: float, shared: float) -> float:
    """Exposed seconds of one pass (forward, or backward) of moe.ExpertParallelExperts' schedule:
    `chunk` is one chunk's all-to-all one way, `experts` the routed experts' compute on one chunk,
    `shared` the shared expert's. Dispatch 0 travels while the shared expert computes; while the
    experts compute chunk c, combine c-1 and dispatch c+1 travel; the last combine is waited for."""
    exposed = max(0.0, chunk - shared) + chunk
    for index in range(chunks):
        travelling = chunk * ((index >= 1) + (index <= chunks - 2))
        exposed += max(0.0, travelling - experts)
    return exposed


def expert_parallel_item(
    config: ModelConfig,
    layout: ParallelConfig,
    pricing: Pricing,
    tokens: float,
    bulk_bytes: int,
    recomputed: float,
    experts: float = 0.0,
    shared: float = 0.0,
) -> Item | None:
    """The all-to-alls of one micro-batch: per MoE layer, rows to the experts and back in forward,
    each recomputed forward and backward, in [parallel] ep_overlap chunks (overlapped_exchange).
    `experts` and `shared`: one MoE layer's forward compute of the routed and the shared experts
    (backward: twice). A sync_free exchange sends its static buffers whole: ep_buffer_factor x
    the balanced rows."""
    size, per_node = group_span(layout, ("ep",), pricing.device)
    if size == 1:
        return None
    moe_layers = moe_layers_per_stage(config, layout)
    # this rank's, each way
    rows = tokens * config.num_experts_per_tok * config.hidden_size * bulk_bytes
    if pricing.exchange == "sync_free":
        rows *= pricing.ep_buffer_factor
    chunks = layout.ep_overlap
    chunk = all_to_all_seconds(rows, size, per_node, pricing) / chunks
    forward = overlapped_exchange(chunk, chunks, experts / chunks, shared)
    backward = overlapped_exchange(chunk, chunks, 2 * experts / chunks, 2 * shared)
    seconds = moe_layers * (4 + 2 * recomputed) * chunk * chunks
    exposed = moe_layers * ((1 + recomputed) * forward + backward)
    return Item(
        f"expert-parallel all-to-all (group {size}, {chunks} chunks)", seconds, exposed, "link"
    )


def moe_layers_per_stage(config: ModelConfig, layout: ParallelConfig) -> float:
    """MoE layers one pipeline stage holds (balanced over the stages)."""
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) / layout.pp


def host_sync_item(config: ModelConfig, layout: ParallelConfig, pricing: Pricing) -> Item | None:
    """The sized exchange's one device-to-host copy of the split sizes per MoE layer and micro-batch
    (moe.py: in forward; a recompute reuses the sizes it remembered, backward knows them): each
    drains the GPU's queue, priced at the generation's measured stall (tools/gpus.py, host_sync).
    sync_free and DeepEP's exchange copy nothing to the host."""
    if layout.ep == 1 or pricing.exchange != "sized" or not pricing.gpu:
        return None
    stall = pricing.rates.host_sync if pricing.calibrated else 0.0  # the bound: no stall
    seconds = moe_layers_per_stage(config, layout) * stall
    return Item("host syncs (split sizes to the host, one per MoE layer)", seconds, seconds, "link")


def op_recompute_item(costs: list[OpCost], pricing: Pricing) -> Item | None:
    """Op-level selective checkpointing ([parallel] activation_checkpointing = "op"): every matmul
    and attention output is kept, the rest of each block's forward (norms, activations, routing,
    gathers: the ops FlopCounterMode counts no FLOPs for) runs again in backward. The ops come from
    a trace without checkpointing."""
    seconds = sum(
        pricing.seconds(cost)[0]
        for cost in costs
        if cost.phase == "forward"
        and cost.module.startswith("layers.")
        and not cost.flops
        and not cost.attention_core
    )
    if not seconds:
        return None
    return Item("op-level recompute (pointwise and norm ops again)", seconds, seconds, "memory")


def optimizer_seconds(trainable: float, state_dtype: str, pricing: Pricing) -> float:
    """AdamW and the gradient norm over `trainable` FP32 parameters (one GPU's shards), at
    OPTIMIZER_BYTES per parameter for its moments' dtype, memory-bound."""
    return OPTIMIZER_BYTES[state_dtype] * trainable / pricing.hbm


def pipeline_items(
    config: ModelConfig,
    layout: ParallelConfig,
    pricing: Pricing,
    tokens: float,
    bulk_bytes: int,
    compute: float,
    joined: int = 1,
) -> list[Item]:
    """Sends between stages (activations forward, gradients back) and the schedule's bubble, per
    micro-batch; `joined`: training micro-batches one schedule call runs (sync_last and gathered
    join the step's)."""
    if layout.pp == 1:
        return []
    size, per_node = group_span(layout, ("pp",), pricing.device)
    link = pricing.device.nvlink if per_node == size else pricing.device.network
    send = (
        2
        * tokens
        * config.hidden_size
        * bulk_bytes
        / (
            link
            * pricing.efficiency(
                pricing.rates.network if per_node < size else pricing.rates.nvlink_ring
            )
        )
    )
    microbatches = (layout.pp_microbatches or layout.pp * layout.stages_per_rank) * joined
    bubble = compute * (layout.pp - 1) / (microbatches * layout.stages_per_rank)
    return [
        Item(f"pipeline sends ({layout.pp} stages)", send, send, "link"),
        Item(
            f"pipeline bubble ({layout.pp_schedule}, {microbatches} micro-batches a call)",
            bubble,
            bubble,
            "idle",
        ),
    ]


def context_parallel_item(
    config: ModelConfig,
    layout: ParallelConfig,
    pricing: Pricing,
    tokens: float,
    bulk_bytes: int,
    recomputed: float,
) -> Item | None:
    """Each layer all-gathers the keys and values (Flint) or the latent and rotated key (Large 4) of
    the whole sequence in forward and recompute, and reduce-scatters their gradients; exposed."""
    size, bandwidth = group_link(layout, ("cp",), pricing)
    if size == 1:
        return None
    # MLA's latent
    width = (
        config.kv_lora_rank + config.qk_rope_head_dim
        if hasattr(config, "kv_lora_rank")
        else 2 * config.num_key_value_heads * config.head_dim
    )
    gathered = tokens * size * width * bulk_bytes  # the whole sequence's
    layers = config.num_hidden_layers / layout.pp
    seconds = layers * (1 + recomputed + 1) * ring_seconds(gathered, size, bandwidth)
    return Item(f"context-parallel key/value gathers (group {size})", seconds, seconds, "link")


# ============================================================================= the step


@dataclasses.dataclass
class Plan:
    """A predicted step on one GPU of a layout."""

    device: Device
    layout: ParallelConfig
    step_seconds: float
    tokens_per_gpu: float  # per step
    model_flops_per_token: float
    items: list[Item]  # per step
    accumulation: str = "sync_each"  # [parallel] accumulation, resolved
    calibrated: bool = True

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_gpu / self.step_seconds

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_second / self.device.bf16


def trainable_shard(config: ModelConfig, layout: ParallelConfig) -> float:
    """Trainable parameters one GPU holds a shard of (memory.py's count, busiest stage)."""
    return max(
        e / (layout.ep * layout.dp_shard * layout.cp)
        + o / (layout.dp_shard * layout.ep * layout.cp)
        for e, o, _ in stage_param_counts(config, layout.pp)
    )


def head_precision(layout: ParallelConfig) -> str:
    """[parallel] head_precision where the config has it (tf32 otherwise: what the GPU configs
    choose)."""
    precision = getattr(layout, "head_precision", "tf32")
    if precision not in HEAD_PRECISION_PEAKS:
        raise ConfigError(
            f"[parallel] head_precision = {precision!r}: the planner knows "
            f"{sorted(HEAD_PRECISION_PEAKS)}"
        )
    return precision


def moe_layer_forward(
    costs: list[OpCost], pricing: Pricing, config: ModelConfig
) -> tuple[float, float]:
    """(routed experts, shared expert) forward seconds of one MoE layer, from the traced whole
    model."""
    layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) or 1

    def seconds(module: str) -> float:
        return sum(
            pricing.seconds(c)[0]
            for c in costs
            if c.phase == "forward" and c.module.startswith(module)
        )

    return seconds("layers.*.mlp.experts") / layers, seconds("layers.*.mlp.shared_expert") / layers


def step_accumulation(cfg: TrainConfig, layout: ParallelConfig, device: Device) -> str:
    """[parallel] accumulation as the run resolves it on this device (sync_each for one
    micro-batch)."""
    if cfg.training.grad_accum == 1:
        return "sync_each"
    return accumulation_of(cfg.model_config, layout, device.memory_gib)


def expert_rows(config: ModelConfig, layout: ParallelConfig, tokens: float) -> float:
    """Rows each of a rank's experts computes per micro-batch, loads balanced: its tokens' top-k
    rows from every expert rank, over the experts (0 for a model without routed experts)."""
    experts = getattr(config, "num_experts", 0)
    return tokens * config.num_experts_per_tok * layout.ep / experts if experts else 0.0


@dataclasses.dataclass(frozen=True)
class Options:
    """The design choices beyond the mesh that the planner prices: the attention backend (flex,
    flash, or fused for published runs), the expert exchange (EXCHANGES) and AdamW's moment
    dtype."""

    attention: str = "flex"
    exchange: str = "sized"
    state_dtype: str = "float32"


def read_options(cfg: TrainConfig) -> Options:
    """The config's Options: [model] attention_backend (flash: flex's FLASH backend; auto, flex and
    sdpa: the flex kernel, which auto resolves to on a GPU without flash-attn-4), [parallel]
    ep_exchange, [optim] state_dtype."""
    attention = "flash" if cfg.model_config.attention_backend == "flash" else "flex"
    options = Options(attention, cfg.parallel.ep_exchange, cfg.optim.state_dtype)
    check_options(options)
    return options


def check_options(options: Options) -> None:
    """One line naming the key whose value the planner cannot price."""
    known = (
        ("[model] attention_backend", options.attention, ATTENTION_BACKENDS),
        ("[parallel] ep_exchange", options.exchange, EXCHANGES),
        ("[optim] state_dtype", options.state_dtype, tuple(OPTIMIZER_BYTES)),
    )
    for key, value, choices in known:
        if value not in choices:
            raise ConfigError(f"{key} = {value!r}: the planner prices {', '.join(choices)}")


def sync_free_buffer_factor(config: ModelConfig, ep: int) -> float:
    """A sync_free exchange's rows over the balanced ones: each chunk sends every expert rank a
    static block of tokens x min(k, E / ep) rows (the most a rank's distinct top-k choices can put
    on one rank's experts, moe.ExpertParallelExperts.forward_sync_free), where balanced loads send
    tokens x k / ep."""
    experts = getattr(config, "num_experts", 0)
    if not experts or ep == 1:
        return 1.0
    k = config.num_experts_per_tok
    return ep * min(k, experts / ep) / k


def plan_step(
    cfg: TrainConfig,
    layout: ParallelConfig,
    device: Device,
    calibrated: bool = True,
    options: Options | None = None,
) -> Plan:
    """Predict one optimizer step of `cfg` on one GPU of the resolved `layout` (module docstring);
    [parallel] compile chooses the fused bytes of compiled blocks or the eager ones; `calibrated`
    False prices every kernel and link at 100 % of its peak (the bound); `options` (default: the
    config's, read_options) the attention backend, exchange, optimizer states and FP8 fusion."""
    options = options or read_options(cfg)
    config, seq_len, batch = cfg.model_config, cfg.data.seq_len, cfg.training.batch_size
    tokens = batch * seq_len / layout.cp  # this rank's, per micro-batch
    pricing = Pricing(
        device,
        head_precision(layout),
        layout.ep,
        layout.compile,
        calibrated,
        expert_rows(config, layout, tokens),
        options.attention,
        options.exchange,
        sync_free_buffer_factor(config, layout.ep),
    )
    gpu = pricing.gpu
    dtype = layout.compute_dtype("cuda" if gpu else "cpu")
    bulk_bytes = torch.empty((), dtype=dtype).element_size()
    checkpointing = layout.activation_checkpointing
    costs = trace_step(
        # on the CPU's kernels, whatever the GPU's backend: the attention core is priced apart
        dataclasses.replace(config, attention_backend="auto"),
        batch,
        seq_len,
        dtype,
        "none" if checkpointing == "op" else checkpointing,
        16 if gpu and layout.ep == 1 else 1,
        layout.fp8,
    )
    share = 1 / (layout.cp * layout.pp)  # of the traced whole-model, whole-sequence step
    ops = compute_items(config, costs, pricing, seq_len, batch * seq_len, checkpointing)
    if checkpointing == "op":
        ops += [item for item in [op_recompute_item(costs, pricing)] if item is not None]
    for item in ops:
        item.seconds, item.exposed = item.seconds * share, item.exposed * share
    compute = sum(item.seconds for item in ops)
    # embedding, head and loss
    outside_blocks = (
        sum(
            pricing.seconds(c)[0]
            for c in costs
            if c.phase == "forward" and not c.module.startswith("layers.")
        )
        * share
    )
    layer_compute = (compute - outside_blocks) / math.ceil(config.num_hidden_layers / layout.pp)
    recomputed = recomputed_share(config, checkpointing)
    accum = cfg.training.grad_accum
    accumulation = step_accumulation(cfg, layout, device)
    experts, shared = (seconds / layout.cp for seconds in moe_layer_forward(costs, pricing, config))
    joined = 1 if accumulation == "sync_each" else accum
    per_microbatch = [
        item
        for item in (
            expert_parallel_item(
                config, layout, pricing, tokens, bulk_bytes, recomputed, experts, shared
            ),
            context_parallel_item(config, layout, pricing, tokens, bulk_bytes, recomputed),
            host_sync_item(config, layout, pricing),
        )
        if item is not None
    ]
    per_microbatch += pipeline_items(config, layout, pricing, tokens, bulk_bytes, compute, joined)
    items = [
        dataclasses.replace(item, seconds=item.seconds * accum, exposed=item.exposed * accum)
        for item in ops + per_microbatch
    ]
    if gpu:
        items += fsdp_items(config, layout, pricing, bulk_bytes, layer_compute, accum, accumulation)
    optimizer = optimizer_seconds(trainable_shard(config, layout), options.state_dtype, pricing)
    states = "FP32" if options.state_dtype == "float32" else "BF16 moments"
    items.append(Item(f"AdamW + gradient norm ({states})", optimizer, optimizer, "memory"))
    step = sum(item.exposed for item in items)
    tokens_per_gpu = batch * seq_len * accum / (layout.cp * layout.pp)
    return Plan(
        device,
        layout,
        step,
        tokens_per_gpu,
        meta_model(config).flops_per_token(seq_len),
        items,
        accumulation,
        calibrated,
    )


def describe_layout(layout: ParallelConfig) -> str:
    dims = " ".join(
        f"{dim}={getattr(layout, dim)}" for dim in MESH_DIMS if getattr(layout, dim) > 1
    )
    schedule = f" {layout.pp_schedule}" if layout.pp > 1 else ""
    overlap = f" ep_overlap={layout.ep_overlap}" if layout.ep > 1 else ""
    return f"{dims or 'one GPU'}{schedule} ac={layout.activation_checkpointing}{overlap}"


def summary(plan: Plan) -> str:
    """Where the step goes: compute bound by FLOPs, by bytes, exposed communication and the rest."""
    shares: dict[str, float] = defaultdict(float)
    for item in plan.items:
        shares[item.bound] += item.exposed
    names = {
        "compute": "compute-bound ops",
        "memory": "memory-bound ops (AdamW included)",
        "link": "exposed communication",
        "idle": "pipeline bubble",
    }
    return "step = " + " + ".join(
        f"{names[bound]} {seconds:.3f} s" for bound, seconds in shares.items()
    )


def plan_table(plan: Plan, top: int = 10) -> str:
    """The summary line and the `top` items that cost the step most (exposed seconds)."""
    pricing = "calibrated" if plan.calibrated else "100 % of peak"
    lines = [
        f"{plan.device.name}, {describe_layout(plan.layout)}, head_precision "
        f"{head_precision(plan.layout)}, accumulation {plan.accumulation}, {pricing}: step "
        f"{plan.step_seconds:.3f} s, "
        f"{plan.tokens_per_second:,.0f} tokens/s per GPU, MFU {100 * plan.mfu:.1f} % "
        f"({plan.model_flops_per_token * plan.tokens_per_second / 1e12:.3g} model TFLOP/s per "
        "GPU), "
        f"{'compiled' if plan.layout.compile else 'eager'}",
        summary(plan),
        "| # | op or collective | seconds per step | share of step | bound |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(plan.items, key=lambda item: -item.exposed)[:top]
    for rank, item in enumerate(ranked, 1):
        hidden = (
            f" ({item.seconds:.4f} s, the rest overlapped)"
            if item.exposed < item.seconds * 0.999
            else ""
        )
        lines.append(
            f"| {rank} | {item.label} | {item.exposed:.4f}{hidden} | "
            f"{100 * item.exposed / plan.step_seconds:.1f} % | {item.bound} |"
        )
    return "\n".join(lines)


# ============================================================================= validation


def published_runs() -> list:
    """The published MoE runs --validate predicts: every registered family's, from its
    tools/<family>_published_runs.py (Flint's: NeMo AutoModel, torchtitan and Megatron-Bridge runs
    expressed as Flint configs), so that a fork without the family keeps a working planner."""
    runs = []
    for family in FAMILIES:
        module = f"tools.{family}_published_runs"
        if importlib.util.find_spec(module) is not None:
            runs += importlib.import_module(module).RUNS
    return runs


def predict_run(run) -> tuple[Plan, Plan]:
    """A PublishedRun's (calibrated prediction, 100 %-of-peak bound) on its GPUs."""
    cfg = load_config(Path(__file__).resolve().parent.parent / run.config, list(run.overrides))
    layout = cfg.parallel.resolve(run.gpus, cfg.model_config.num_experts)
    device = GPUS[run.gpu]
    calibrated = plan_step(cfg, layout, device, True, run.options)
    return calibrated, plan_step(cfg, layout, device, False, run.options)


def validation_table() -> str:
    """Each published run: whether tools/gpus.py's constants were fitted to it or it is held out,
    its source, layout (what was guessed) and our confidence in expressing it, measured and
    predicted tokens/s per GPU with their MFU, measured / predicted, and the bound."""
    lines = [
        "| run | constants | GPUs | measured tokens/s per GPU (MFU) | predicted (MFU) | "
        "measured / predicted | 100 %-of-peak bound | setup | layout guessed | confidence | "
        "source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in published_runs():
        plan, bound = predict_run(run)
        measured_mfu = run.measured * plan.model_flops_per_token / plan.device.bf16
        lines.append(
            f"| {run.name} | {'fitted' if run.fitted else 'held out'} | {run.gpus} x {run.gpu} | "
            f"{run.measured:,.0f} ({100 * measured_mfu:.1f} %) | "
            f"{plan.tokens_per_second:,.0f} ({100 * plan.mfu:.1f} %) | "
            f"{run.measured / plan.tokens_per_second:.2f} | {bound.tokens_per_second:,.0f} | "
            f"{run.setup}; {describe_layout(plan.layout)}, {run.options.attention} attention, "
            f"{run.options.exchange} exchange | {run.guessed or 'nothing'} | {run.confidence} | "
            f"{run.source} |"
        )
    return "\n".join(lines)


def load_plan_config(config: str | None, preset: str | None, overrides: list[str]) -> TrainConfig:
    """A training TOML as train.py reads it, or a preset at bench.py's shape (batch 4 x 512 unless
    overridden)."""
    if config:
        return load_config(config, overrides)
    from tools.bench import load_bench_config

    args = argparse.Namespace(
        config=None,
        preset=preset,
        batch=None,
        seq_len=None,
        device=None,
        dtype=None,
        overrides=overrides,
    )
    return load_bench_config(args)


def check_flag_combinations(args: argparse.Namespace, overrides: list[str]) -> None:
    """--validate prices the published runs' own configs on their own GPUs: a flag beside it would
    be ignored, so it is refused."""
    if args.validate:
        given = [
            f"--{flag}" for flag in ("config", "preset", "gpus", "peak") if getattr(args, flag)
        ]
        given += overrides + (["--gpu"] if args.gpu != "H100" else [])
        if given:
            raise ConfigError(
                "--validate prices the published runs' own configs on their own GPUs; "
                f"drop {' '.join(given)}"
            )


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--config or --preset, --gpu and --gpus: the step and machine that the planner and the layout
    search (tools/search.py) both read."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--config",
        help="a training TOML: its [model], [data] seq_len, [training] "
        "batch_size "
        "and grad_accum, and [parallel] layout",
    )
    shape.add_argument(
        "--preset", help="a model preset at bench.py's shape (default with --gpu cpu: bench-cpu)"
    )
    parser.add_argument(
        "--gpu", default="H100", help=f"{', '.join(GPUS)}, or cpu: this machine, measured now"
    )
    parser.add_argument(
        "--gpus", type=positive, help="GPUs in all (default: what the config's layout needs)"
    )


def read_shape(
    args: argparse.Namespace, overrides: list[str]
) -> tuple[TrainConfig, Device, int, ParallelConfig]:
    """add_shape_arguments' values -> (the config, the device, the GPUs in all, the layout resolved
    on them)."""
    if not args.config and not args.preset and args.gpu.lower() != "cpu":
        raise ConfigError(
            "give --config or --preset (only --gpu cpu has a default: bench.py's bench-cpu shape)"
        )
    device = device_named(args.gpu)
    cfg = load_plan_config(args.config, args.preset, overrides)
    layout = cfg.parallel
    gpus = args.gpus or layout.named_world_size
    try:
        layout = layout.resolve(gpus, cfg.model_config.num_experts)
    except ValueError as error:
        raise ConfigError(f"{cfg.source} on --gpus {gpus}: {error}") from error
    return cfg, device, gpus, layout


def memory_line(cfg: TrainConfig, layout: ParallelConfig, device: Device) -> str:
    """Whether the layout fits one GPU, judged as search.py judges every layout: memory.py's
    estimate, plus its margin for the checkpointing mode and OVERHEAD_GIB of slack and buffers,
    against the usable GiB."""
    estimate = memory_per_gpu(
        cfg.model_config,
        layout,
        cfg.data.seq_len,
        cfg.training.batch_size,
        cfg.training.grad_accum,
        device.memory_gib,
    )["total"]
    margin = MEMORY_MARGIN[layout.activation_checkpointing]
    needed = gib_needed(estimate, layout.activation_checkpointing)
    how = (
        f"{needed:.1f} GiB needed per GPU (memory.py's {estimate:.1f} + {100 * margin:.0f} % + "
        f"{OVERHEAD_GIB:.0f} GiB of buffers) of the {device.name}'s "
        f"{device.memory_gib:.1f} GiB usable"
    )
    if needed <= device.memory_gib:
        return f"memory: fits, {how}"
    return (
        f"memory: DOES NOT FIT, {how}: the times above are for a step this GPU cannot hold "
        f"(python -m tools.search lists the layouts that fit)"
    )


def main(argv: list[str] | None = None) -> Plan | None:
    parser = OneLineParser(
        description="Predicted step time, tokens/s and MFU per GPU (no GPU needed).",
        epilog="Override any config key as train.py does: --parallel.ep=8 --data.seq_len=8192",
    )
    add_shape_arguments(parser)
    parser.add_argument(
        "--validate", action="store_true", help="the published runs against their predictions"
    )
    parser.add_argument(
        "--peak",
        action="store_true",
        help="price every kernel and link at 100 %% of its data-sheet peak (the bound), not at "
        "its calibrated fraction",
    )
    args, overrides = parser.parse_known_args(argv)
    check_flag_combinations(args, overrides)
    if args.validate:
        print(validation_table())
        return None
    cfg, device, gpus, layout = read_shape(args, overrides)
    started = time.perf_counter()
    plan = plan_step(cfg, layout, device, calibrated=not args.peak)
    print(
        f"{Path(cfg.source).name}: seq_len {cfg.data.seq_len}, batch_size "
        f"{cfg.training.batch_size} x "
        f"grad_accum {cfg.training.grad_accum} per GPU, {gpus} GPUs (traced in "
        f"{time.perf_counter() - started:.0f} s)"
    )
    print(plan_table(plan))
    if not args.peak:
        bound = plan_step(cfg, layout, device, calibrated=False)
        print(
            f"100 % of peak (the bound): step {bound.step_seconds:.3f} s, "
            f"{bound.tokens_per_second:,.0f} tokens/s "
            f"per GPU, MFU {100 * bound.mfu:.1f} %"
        )
    print(memory_line(cfg, layout, device))
    return plan


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
