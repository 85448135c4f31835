"""Step time per GPU of a training config, predicted op by op without a GPU.

    python3 -m tools.planner --config configs/flint-8gpu.toml                 # H100 SXM, the config's layout
    python3 -m tools.planner --config configs/flint-multinode.toml --gpu H200 --gpus 32
    python3 -m tools.planner --config configs/large4-256gpu.toml --gpu B200
    python3 -m tools.planner --preset flint-shallow --gpu H200 --gpus 1 --data.seq_len=4096 --training.batch_size=2
    python3 -m tools.planner --gpu cpu                                        # bench.py's CPU shape, this machine

prints tokens/s per GPU, MFU, the step time and the ten ops or collectives that cost most. Method:

1. Compute: one forward and backward (with the recompute forward of activation checkpointing) of the
   whole model at a rank's micro-batch [batch_size, seq_len], in the run's dtypes (BF16 bulk, FP32
   sinks, routers and head), traced op by op on fake tensors (op_trace.py: FLOPs by FlopCounterMode's
   formulas, bytes read and written). An expert-parallel rank computes the same (balanced loads),
   reading 1/ep of the expert weights. Each op costs max(FLOPs / the peak of its dtype, bytes / HBM
   bandwidth): a roofline at 100% of the data sheets' peaks, so a prediction bounds the speed from
   above. With [parallel] compile the bytes are those left once chains of elementwise ops are fused
   (op_trace.fuse_chains, perfect fusion inside each forward or backward graph); eager, every op's own.
2. The trace runs the CPU's code path (fake CUDA tensors cannot take gradients on a CPU build of
   torch). For a GPU the attention core is replaced: the ops of the CPU kernel (its flash custom op,
   or the dense [B, H, T, S] score matrices of Mistral Large 4's sdpa path) are dropped and one flex
   kernel per step stands in, with the model's own attention FLOPs (model.flops_per_token, its part
   that grows with the keys attended) times (2 forward + 5 backward + 2 per recompute) / 6 for the
   flash kernels' backward, which recomputes the scores; tiles only partly masked are not counted.
   MoE experts are padded to groups of 16 rows as on CUDA (without expert parallelism).
3. Layout, per micro-batch, from [parallel] and the parameter sizes on the meta device (ring
   collectives: a group of n moves (n - 1) / n of the gathered bytes per GPU; NVLink when the group
   stays inside a node of 8 GPUs, which the mesh order pp, dp_replicate, dp_shard, ep, cp decides,
   else the network):
   - FSDP: each block all-gathers its parameters in forward and again in backward (BF16, FP32 units
     in FP32; the root units, embedding, norm and head, once) and reduce-scatters FP32 gradients, every
     micro-batch (train.py keeps gradient sync on during accumulation); routed experts over dp_shard x cp, the rest over
     dp_shard x ep x cp. A block's collectives overlap the compute of its neighbours: exposed are the
     first block's all-gather and reduce-scatter, and whatever of each block's collectives outlasts
     that block's compute. HSDP adds an all-reduce over dp_replicate, exposed.
   - Expert parallelism: per MoE layer, 2 all-to-alls in forward (rows to the experts and back,
     tokens x top-k x hidden in BF16 each way), 2 in backward, 2 more per recomputed forward. They
     do not overlap (the experts wait for their rows). Expert loads are assumed balanced.
   - Pipeline: each stage computes 1/pp of the rank's trace, sends [B, T, H] BF16 activations forward
     and gradients back per micro-batch (exposed), and idles a bubble of (pp - 1) / (m x v) of its
     compute (m micro-batches, v stages per rank).
   - Context parallelism: each rank computes 1/cp of the trace and all-gathers the keys and values
     of every layer (forward, recompute) and reduce-scatters their gradients (backward), exposed.
4. Per step: grad_accum micro-batches, then AdamW over the FP32 shards: 32 bytes per trainable
   parameter (read weight, gradient, 2 moments, write weight, 2 moments, and the norm's read).

With [parallel] fp8, fp8.py's matmuls are priced at the dense FP8 peak (FP8_PEAKS) and their operands'
quantisation as one memory-bound item (fp8_quantisation_bytes). MFU divides the model's FLOPs
(model.flops_per_token, as train.py reports it) by the step time and the dense BF16 peak, with FP8 too. The CPU device (--gpu cpu) measures this machine's FP32 matmul rate and copy
bandwidth and predicts bench.py's CPU shape, to check the method against a measured step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from config import ConfigError, TrainConfig, load_config
from tools.memory import _meta_model, _stage_params
from registry import ModelConfig
from tools.op_trace import OpCost, trace_step
from parallel import MESH_DIMS, ParallelConfig

TFLOPS, TBPS, GBPS = 1e12, 1e12, 1e9


# ============================================================================= the hardware

@dataclasses.dataclass(frozen=True)
class Device:
    """Dense peaks in FLOP/s and bandwidths in bytes/s per GPU (one direction for links)."""

    name: str
    bf16: float  # tensor cores, dense
    tf32: float  # tensor cores, dense
    fp32: float  # CUDA cores (FP32 matmuls at torch's default "highest" precision)
    hbm: float
    nvlink: float  # per GPU, each way
    network: float  # per GPU, each way
    gpus_per_node: int = 8


GPUS = {
    # NVIDIA H100 Tensor Core GPU data sheet (SXM column; sparse figures halved to dense): BF16
    # 1,979 TFLOP/s sparse, TF32 989 sparse, FP32 67; HBM3 3.35 TB/s; NVLink 900 GB/s (both ways).
    # Network: DGX H100 user guide, 8 ConnectX-7 at 400 Gb/s InfiniBand, one per GPU.
    "H100": Device("H100 SXM", 989.4 * TFLOPS, 494.7 * TFLOPS, 67 * TFLOPS, 3.35 * TBPS, 450 * GBPS, 50 * GBPS),
    # NVIDIA H200 Tensor Core GPU data sheet (SXM): the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s.
    # Network: HGX H200 reference, 400 Gb/s per GPU (ConnectX-7).
    "H200": Device("H200 SXM", 989.4 * TFLOPS, 494.7 * TFLOPS, 67 * TFLOPS, 4.8 * TBPS, 450 * GBPS, 50 * GBPS),
    # NVIDIA DGX B200 data sheet, per GPU of 8 (sparse halved): BF16 4.5 PFLOP/s sparse, TF32 2.2
    # sparse, FP32 75 TFLOP/s (600 for 8 GPUs); HBM3e 8 TB/s (64 for 8); NVLink 5 1.8 TB/s both ways;
    # 8 ConnectX-7 at 400 Gb/s.
    "B200": Device("B200", 2250 * TFLOPS, 1100 * TFLOPS, 75 * TFLOPS, 8.0 * TBPS, 900 * GBPS, 50 * GBPS),
}
# [parallel] fp8's matmuls, by Device name: the same data sheets' dense FP8 (E4M3) peaks (sparse halved:
# H100 and H200 3,958 TFLOP/s, B200 9 PFLOP/s). The CPU runs them at its measured rate. MFU stays against bf16.
FP8_PEAKS = {"H100 SXM": 1979 * TFLOPS, "H200 SXM": 1979 * TFLOPS, "B200": 4500 * TFLOPS}

# What an FP32 matmul of the head runs at on CUDA, by [parallel] head_precision: its peak from a Device.
HEAD_PRECISION_PEAKS = {"tf32": lambda d: d.tf32, "bf16": lambda d: d.bf16, "bf16x3": lambda d: d.bf16 / 3,
                        "float32": lambda d: d.fp32}


def measure_cpu(matmul_size: int = 1024, copy_mib: int = 512) -> Device:
    """This machine as a Device: its best FP32 matmul rate and large-copy bandwidth (read + write)."""
    from tools.profiling import matmul_rate, time_call
    rate = matmul_rate(torch.device("cpu"), torch.float32, matmul_size)
    source = torch.ones(copy_mib * 2 ** 20 // 4)
    target = torch.empty_like(source)
    seconds = min(time_call(lambda: target.copy_(source), torch.device("cpu")) for _ in range(5))
    bandwidth = 2 * source.nbytes / seconds
    return Device(f"cpu ({rate / 1e12:.3f} TFLOP/s FP32 matmul, {bandwidth / 1e9:.1f} GB/s copy, measured now)",
                  rate, rate, rate, bandwidth, 0.0, 0.0, gpus_per_node=1)


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
    """A line of the cost table: seconds per step on one GPU, what bounds it, and how much is exposed."""

    label: str
    seconds: float
    exposed: float  # of `seconds`, what the step waits for (compute: all of it)
    bound: str  # compute | memory | link


@dataclasses.dataclass(frozen=True)
class Pricing:
    """What an op costs depends on: the device, the head's FP32 matmul precision, the expert-parallel
    degree (each rank reads 1/ep of the expert weights), and whether the blocks are compiled."""

    device: Device
    head_precision: str = "tf32"
    ep: int = 1
    compiled: bool = False

    @property
    def gpu(self) -> bool:
        return not self.device.name.startswith("cpu")

    def matmul_peak(self, cost: OpCost) -> float:
        """FLOP/s for a matmul of this dtype: BF16 tensor cores; FP32 ones in the head at head_precision,
        elsewhere (routers) at torch's default "highest" precision, on CUDA cores; fp8.py's ops at the FP8 peak."""
        if cost.op.startswith("flint.fp8"):
            return FP8_PEAKS.get(self.device.name, self.device.bf16)
        if cost.dtype != "float32":
            return self.device.bf16
        if cost.module.startswith("lm_head"):
            return HEAD_PRECISION_PEAKS[self.head_precision](self.device)
        return self.device.fp32

    def seconds(self, cost: OpCost) -> tuple[float, str]:
        """The roofline of one OpCost: max(FLOPs / peak, bytes / HBM bandwidth), and which bounds it."""
        moved = (cost.fused_bytes if self.compiled else cost.bytes) - cost.expert_weight_bytes * (1 - 1 / self.ep)
        compute = cost.flops / self.matmul_peak(cost) if cost.flops else 0.0
        memory = moved / self.device.hbm
        return max(compute, memory), "compute" if compute >= memory else "memory"


def recomputed_share(config: ModelConfig, checkpointing: str) -> float:
    """The share of blocks whose forward runs again in backward (parallel.apply_activation_checkpointing)."""
    layers = config.num_hidden_layers
    return {"none": 0.0, "full": 1.0, "selective": math.ceil(layers / 2) / layers}[checkpointing]


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """The part of model.flops_per_token that grows with the keys each query attends. Both models
    count FLOPs = fixed + c x mean keys per query, and the mean is 1 at seq_len 1 and 1.5 at 2, so
    two evaluations give c and the fixed part."""
    model = _meta_model(config)
    one, two = model.flops_per_token(1), model.flops_per_token(2)
    per_key = (two - one) / 0.5
    return model.flops_per_token(seq_len) - (one - per_key)


def compute_items(config: ModelConfig, costs: list[OpCost], pricing: Pricing, seq_len: int, tokens: float,
                  checkpointing: str) -> list[Item]:
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
    quantisation = sum(fp8_quantisation_bytes(cost, pricing.ep) for cost in costs) / pricing.device.hbm
    if quantisation:
        items.append(Item("FP8 quantisation passes (amax, scale and cast of every operand)", quantisation,
                          quantisation, "memory"))
    if pricing.gpu:
        units = 2 + 5 + 2 * recomputed_share(config, checkpointing)  # flash: the backward recomputes the scores
        seconds = attention_flops_per_token(config, seq_len) * tokens * units / 6 / pricing.device.bf16
        items.append(Item("attention core (flex kernel, BF16)", seconds, seconds, "compute"))
    return items


def fp8_quantisation_bytes(cost: OpCost, ep: int) -> float:
    """What fp8.py's quantisation of an FP8 op's two operands moves: each is read twice (its absolute
    maximum, then scaled) and written once in FP8; outside the op's GEMM, so never fused into it. An
    expert-parallel rank quantises 1/ep of the expert weights (a grouped GEMM's second operand)."""
    if not cost.op.startswith("flint.fp8"):
        return 0.0
    element_bytes = torch.empty((), dtype=getattr(torch, cost.dtype)).element_size()
    sizes = [math.prod(int(n) for n in dims.split(", ")) for dims in re.findall(r"\[([\d, ]+)\]", cost.shapes)]
    if cost.op == "flint.fp8_grouped_mm":
        sizes[1] /= ep
    return cost.calls * sum(sizes) * (2 * element_bytes + 1)


# ============================================================================= the layout's communication

def group_link(layout: ParallelConfig, dims: tuple[str, ...], device: Device) -> tuple[int, float]:
    """(size, bandwidth per GPU) of the process group over mesh `dims`: NVLink if every member sits
    in one node (rank = sum of coordinate x stride over MESH_DIMS, the last dim innermost), else the network."""
    sizes = [getattr(layout, dim) for dim in MESH_DIMS]
    size, inside = 1, True
    for index, dim in enumerate(MESH_DIMS):
        if dim in dims and sizes[index] > 1:
            size *= sizes[index]
            inside &= math.prod(sizes[index:]) <= device.gpus_per_node
    return size, device.nvlink if inside else device.network


def ring_seconds(gathered_bytes: float, size: int, bandwidth: float) -> float:
    """All-gather or reduce-scatter of `gathered_bytes` (the whole, unsharded) over `size` GPUs: a
    ring moves (n - 1) / n of it through each GPU's link. The same for an all-to-all of that many bytes."""
    return 0.0 if size == 1 else gathered_bytes * (size - 1) / size / bandwidth


def unit_bytes(config: ModelConfig, layout: ParallelConfig, bulk_bytes: int) -> list[tuple[float, float, float, float]]:
    """Per FSDP unit (each block of one pipeline stage, then the root modules): the bytes gathered
    over the FSDP group and over the experts' group, and their FP32 gradients, for one rank."""
    model = _meta_model(config)
    layers = list(model.layers.values())
    units = []
    for layer in layers[: math.ceil(len(layers) / layout.pp)]:
        fp32 = {id(p) for module in model.fp32_modules(layer) for p in module.parameters()}
        expert = [p for n, p in layer.named_parameters() if ".mlp.experts." in f".{n}"]
        expert_ids = {id(p) for p in expert}
        others = [p for p in layer.parameters() if id(p) not in expert_ids]
        gathered = sum(p.numel() * (4 if id(p) in fp32 else bulk_bytes) for p in others)
        expert_elements = sum(p.numel() for p in expert) / layout.ep
        units.append((gathered, expert_elements * bulk_bytes, 4 * sum(p.numel() for p in others), 4 * expert_elements))
    block_ids = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in block_ids]  # embedding, final norm, head
    fp32 = {id(p) for module in (model.lm_head, *model.fp32_root_modules()) for p in module.parameters()}
    units.append((sum(p.numel() * (4 if id(p) in fp32 else bulk_bytes) for p in root), 0.0,
                  4 * sum(p.numel() for p in root), 0.0))
    return units


def fsdp_items(config: ModelConfig, layout: ParallelConfig, device: Device, bulk_bytes: int,
               layer_compute: float) -> list[Item]:
    """FSDP's collectives of one micro-batch, and the part of them exposed (module docstring, point 3)."""
    fsdp, fsdp_bw = group_link(layout, ("dp_shard", "ep", "cp"), device)
    efsdp, efsdp_bw = group_link(layout, ("dp_shard", "cp"), device)
    units = unit_bytes(config, layout, bulk_bytes)
    gathers, scatters, exposed = 0.0, 0.0, 0.0
    for index, (other, expert, other_grad, expert_grad) in enumerate(units):
        gather = ring_seconds(other, fsdp, fsdp_bw) + ring_seconds(expert, efsdp, efsdp_bw)
        scatter = ring_seconds(other_grad, fsdp, fsdp_bw) + ring_seconds(expert_grad, efsdp, efsdp_bw)
        times = 1 if index == len(units) - 1 else 2  # blocks are gathered again in backward; the root units once
        gathers, scatters = gathers + times * gather, scatters + scatter
        exposed += gather + scatter if index == 0 else max(0.0, times * gather + scatter - layer_compute)
    items = [Item(f"FSDP all-gathers (group {fsdp}, experts {efsdp})", gathers, 0.0, "link"),
             Item(f"FSDP reduce-scatters (group {fsdp}, experts {efsdp})", scatters, 0.0, "link")]
    total = gathers + scatters
    for item in items:  # the exposed time, shared in proportion
        item.exposed = exposed * item.seconds / total if total else 0.0
    replicas, replica_bw = group_link(layout, ("dp_replicate",), device)
    if replicas > 1:  # HSDP: the sharded gradients all-reduced over the replicas (2 ring passes)
        shard = sum(o / fsdp + e / efsdp for _, _, o, e in units)
        seconds = 2 * ring_seconds(shard, replicas, replica_bw)
        items.append(Item(f"HSDP all-reduce (group {replicas})", seconds, seconds, "link"))
    return items


def expert_parallel_item(config: ModelConfig, layout: ParallelConfig, device: Device, tokens: float,
                         bulk_bytes: int, recomputed: float) -> Item | None:
    """The all-to-alls of one micro-batch: per MoE layer, rows to the experts and back, in forward,
    backward and each recomputed forward; not overlapped."""
    size, bandwidth = group_link(layout, ("ep",), device)
    if size == 1:
        return None
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) / layout.pp
    rows = tokens * config.num_experts_per_tok * config.hidden_size * bulk_bytes  # this rank's, each way
    seconds = moe_layers * (4 + 2 * recomputed) * ring_seconds(rows, size, bandwidth)
    return Item(f"expert-parallel all-to-all (group {size})", seconds, seconds, "link")


def pipeline_items(config: ModelConfig, layout: ParallelConfig, device: Device, tokens: float,
                   bulk_bytes: int, compute: float) -> list[Item]:
    """Sends between stages (activations forward, gradients back) and the schedule's bubble."""
    if layout.pp == 1:
        return []
    _, bandwidth = group_link(layout, ("pp",), device)
    send = 2 * tokens * config.hidden_size * bulk_bytes / bandwidth
    microbatches = layout.pp_microbatches or layout.pp * layout.stages_per_rank
    bubble = compute * (layout.pp - 1) / (microbatches * layout.stages_per_rank)
    return [Item(f"pipeline sends ({layout.pp} stages)", send, send, "link"),
            Item(f"pipeline bubble ({layout.pp_schedule}, {microbatches} micro-batches)", bubble, bubble, "idle")]


def context_parallel_item(config: ModelConfig, layout: ParallelConfig, device: Device, tokens: float,
                          bulk_bytes: int, recomputed: float) -> Item | None:
    """Each layer all-gathers the keys and values (Flint) or the latent and rotated key (Large 4) of
    the whole sequence in forward and recompute, and reduce-scatters their gradients; exposed."""
    size, bandwidth = group_link(layout, ("cp",), device)
    if size == 1:
        return None
    width = (2 * config.num_key_value_heads * config.head_dim if hasattr(config, "num_key_value_heads")
             else config.kv_lora_rank + config.qk_rope_head_dim)
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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_gpu / self.step_seconds

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_second / self.device.bf16


def trainable_shard(config: ModelConfig, layout: ParallelConfig) -> float:
    """Trainable parameters one GPU holds a shard of (memory.py's count, busiest stage)."""
    return max(e / (layout.ep * layout.dp_shard * layout.cp) + o / (layout.dp_shard * layout.ep * layout.cp)
               for e, o, _ in _stage_params(config, layout.pp))


def head_precision(layout: ParallelConfig) -> str:
    """[parallel] head_precision where the config has it (tf32 otherwise: what the GPU configs choose)."""
    precision = getattr(layout, "head_precision", "tf32")
    if precision not in HEAD_PRECISION_PEAKS:
        raise ConfigError(f"[parallel] head_precision = {precision!r}: the planner knows {sorted(HEAD_PRECISION_PEAKS)}")
    return precision


def plan_step(cfg: TrainConfig, layout: ParallelConfig, device: Device) -> Plan:
    """Predict one optimizer step of `cfg` on one GPU of the resolved `layout` (module docstring);
    [parallel] compile chooses the fused bytes of compiled blocks or the eager ones."""
    config, seq_len, batch = cfg.model_config, cfg.data.seq_len, cfg.training.batch_size
    pricing = Pricing(device, head_precision(layout), layout.ep, layout.compile)
    gpu = pricing.gpu
    dtype = layout.compute_dtype("cuda" if gpu else "cpu")
    bulk_bytes = torch.empty((), dtype=dtype).element_size()
    checkpointing = layout.activation_checkpointing
    costs = trace_step(config, batch, seq_len, dtype, checkpointing, 16 if gpu and layout.ep == 1 else 1, layout.fp8)
    tokens = batch * seq_len / layout.cp  # this rank's, per micro-batch
    share = 1 / (layout.cp * layout.pp)  # of the traced whole-model, whole-sequence step
    ops = compute_items(config, costs, pricing, seq_len, batch * seq_len, checkpointing)
    for item in ops:
        item.seconds, item.exposed = item.seconds * share, item.exposed * share
    compute = sum(item.seconds for item in ops)
    outside_blocks = sum(pricing.seconds(c)[0] for c in costs if c.phase == "forward"  # embedding, head and loss
                         and not c.module.startswith("layers.")) * share
    layer_compute = (compute - outside_blocks) / math.ceil(config.num_hidden_layers / layout.pp)
    recomputed = recomputed_share(config, checkpointing)
    comms = fsdp_items(config, layout, device, bulk_bytes, layer_compute) if gpu else []
    comms += [item for item in (expert_parallel_item(config, layout, device, tokens, bulk_bytes, recomputed),
                                context_parallel_item(config, layout, device, tokens, bulk_bytes, recomputed))
              if item is not None]
    comms += pipeline_items(config, layout, device, tokens, bulk_bytes, compute)
    accum = cfg.training.grad_accum
    items = [dataclasses.replace(item, seconds=item.seconds * accum, exposed=item.exposed * accum) for item in ops + comms]
    optimizer = 32 * trainable_shard(config, layout) / device.hbm  # AdamW and the norm, FP32 shards
    items.append(Item("AdamW + gradient norm (FP32 shards)", optimizer, optimizer, "memory"))
    step = sum(item.exposed for item in items)
    tokens_per_gpu = batch * seq_len * accum / (layout.cp * layout.pp)
    return Plan(device, layout, step, tokens_per_gpu, _meta_model(config).flops_per_token(seq_len), items)


def describe_layout(layout: ParallelConfig) -> str:
    dims = " ".join(f"{dim}={getattr(layout, dim)}" for dim in MESH_DIMS if getattr(layout, dim) > 1)
    return f"{dims or 'one GPU'} ac={layout.activation_checkpointing}"


def summary(plan: Plan) -> str:
    """Where the step goes: compute bound by FLOPs, by bytes, exposed communication and the rest."""
    shares: dict[str, float] = defaultdict(float)
    for item in plan.items:
        shares[item.bound] += item.exposed
    names = {"compute": "compute-bound ops", "memory": "memory-bound ops (AdamW included)",
             "link": "exposed communication", "idle": "pipeline bubble"}
    return "step = " + " + ".join(f"{names[bound]} {seconds:.3f} s" for bound, seconds in shares.items())


def plan_table(plan: Plan, top: int = 10) -> str:
    """The summary line and the `top` items that cost the step most (exposed seconds)."""
    lines = [f"{plan.device.name}, {describe_layout(plan.layout)}, head_precision "
             f"{head_precision(plan.layout)}: step {plan.step_seconds:.3f} s, "
             f"{plan.tokens_per_second:,.0f} tokens/s per GPU, MFU {100 * plan.mfu:.1f} % "
             f"({plan.model_flops_per_token * plan.tokens_per_second / 1e12:.3g} model TFLOP/s per GPU), "
             f"{'compiled' if plan.layout.compile else 'eager'}",
             summary(plan), "| # | op or collective | seconds per step | share of step | bound |", "|---|---|---|---|---|"]
    ranked = sorted(plan.items, key=lambda item: -item.exposed)[:top]
    for rank, item in enumerate(ranked, 1):
        hidden = f" ({item.seconds:.4f} s, the rest overlapped)" if item.exposed < item.seconds * 0.999 else ""
        lines.append(f"| {rank} | {item.label} | {item.exposed:.4f}{hidden} | "
                     f"{100 * item.exposed / plan.step_seconds:.1f} % | {item.bound} |")
    return "\n".join(lines)


def load_plan_config(config: str | None, preset: str | None, overrides: list[str]) -> TrainConfig:
    """A training TOML as train.py reads it, or a preset at bench.py's shape (batch 4 x 512 unless overridden)."""
    if config:
        return load_config(config, overrides)
    from tools.bench import load_bench_config
    args = argparse.Namespace(config=None, preset=preset, batch=None, seq_len=None, device=None, dtype=None,
                              overrides=overrides)
    return load_bench_config(args)


def main(argv: list[str] | None = None) -> Plan:
    parser = argparse.ArgumentParser(description="Predicted step time, tokens/s and MFU per GPU (no GPU needed).",
                                     epilog="Override any config key as train.py does: --parallel.ep=8 --data.seq_len=8192")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--config", help="a training TOML: its [model], [data] seq_len, [training] batch_size "
                       "and grad_accum, and [parallel] layout")
    shape.add_argument("--preset", help="a model preset at bench.py's shape (default with --gpu cpu: bench-cpu)")
    parser.add_argument("--gpu", default="H100", help=f"{', '.join(GPUS)}, or cpu: this machine, measured now")
    parser.add_argument("--gpus", type=int, help="GPUs in all (default: what the config's layout needs)")
    args, overrides = parser.parse_known_args(argv)
    if not args.config and not args.preset and args.gpu.lower() != "cpu":
        raise ConfigError("give --config or --preset (only --gpu cpu has a default: bench.py's bench-cpu shape)")
    device = device_named(args.gpu)
    cfg = load_plan_config(args.config, args.preset, overrides)
    layout = cfg.parallel
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    gpus = args.gpus or layout.named_world_size
    try:
        layout = layout.resolve(gpus, cfg.model_config.num_experts)
    except ValueError as error:
        raise ConfigError(f"{cfg.source} on --gpus {gpus}: {error}") from error
    started = time.perf_counter()
    plan = plan_step(cfg, layout, device)
    print(f"{Path(cfg.source).name}: seq_len {cfg.data.seq_len}, batch_size {cfg.training.batch_size} x "
          f"grad_accum {cfg.training.grad_accum} per GPU, {gpus} GPUs (traced in {time.perf_counter() - started:.0f} s)")
    print(plan_table(plan))
    return plan


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
