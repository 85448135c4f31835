"""Memory per GPU of each parallel layout, computed without a GPU, to pick a layout before renting
one.

    python3 -m tools.memory --config configs/flint-8gpu.toml --gpus 8
    python3 -m tools.memory --config configs/large4.toml --gpus 256 --model.init_from=PATH
    python3 -m tools.memory --config configs/large4-256gpu.toml --gpus 256

prints GiB per GPU (FP32 master weights, FP32 gradients and AdamW moments of the trainable
parameters (under [lora] the adapters alone), the unsharded FP32 gradients that gradient
accumulation holds, the weights FSDP gathers, and activations) for the config's own layout and, with
--gpus, the usual alternatives, marking which fit 141 GB and 80 GB GPUs ([parallel] accumulation =
"auto" resolved for a 141 GB one, as parallel.choose_accumulation would)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from config import ConfigError, load_config
from flags import OneLineParser, positive
from lora import LoraConfig, apply_lora
from parallel import MESH_DIMS, ParallelConfig, choose_accumulation, unsupported_layout
from pipeline import pipeline_stage
from registry import ModelConfig, model_class

GIB = 2**30
# The GPUs the table marks, by usable memory (nvidia-smi: 143,771 MiB on an H200, 81,559 MiB on an
# H100 80GB), and what the estimate leaves out: allocator slack, NCCL buffers, the CUDA context.
GPU_GIB = {"141GB": 140.4, "80GB": 79.6}
OVERHEAD_GIB = 10.0
# This estimate's largest miss against a rehearsal's measured peak (BENCHMARKS.md), by activation
# checkpointing: within 6 % for every fully checkpointed GPU config. Without checkpointing it missed
# by 27 % (flint-8gpu's layout, dp_shard 2 x ep 4: rehearsed 101.6 GiB against 80.3) while
# block_activation_bytes counted the saved tensors in BF16 alone: autograd saves each RMSNorm's
# input and normalised input in FP32, the router's FP32 input, every step of the SwiGLUs. Counted
# term by term now (flint_model.py, pinned in tests/test_memory.py against a measurement of what
# autograd saves), the same layout misses by 6 % (95.3 GiB); with `op`, which keeps only what
# parallel.kept_by_op_level names, by 2 % (85.6 against 87.1). Selective keeps half its blocks
# whole: none's margin.
MEMORY_MARGIN = {"full": 0.06, "selective": 0.07, "none": 0.07, "op": 0.06}


def gib_needed(estimate_gib: float, checkpointing: str) -> float:
    """What a layout needs of a GPU, as the search and the planner judge it: the estimate plus its
    margin for the checkpointing mode, plus OVERHEAD_GIB of slack and buffers."""
    return estimate_gib * (1 + MEMORY_MARGIN[checkpointing]) + OVERHEAD_GIB


def meta_model(config: ModelConfig, lora: LoraConfig | None = None) -> torch.nn.Module:
    """The model on the meta device, in its stage-aware form where it has one (parallel.py), with
    `lora`'s adapters on its frozen base when given; built once per config (the released Large 4
    takes seconds even on meta)."""
    key = repr((config, lora))  # configs are mutable dataclasses, so not hashable
    if key not in _META_MODELS:
        cls = model_class(config)
        with torch.device("meta"):
            _META_MODELS[key] = cls(config)
        if lora is not None:
            apply_lora(_META_MODELS[key], lora)
    return _META_MODELS[key]


_META_MODELS: dict[str, torch.nn.Module] = {}


def _stage_counts(
    config: ModelConfig, pp: int, lora: LoraConfig | None = None
) -> list[tuple[int, ...]]:
    """(expert trainable, expert frozen, other trainable, other frozen) parameter counts of each
    pipeline stage, counted on the meta device. Frozen parameters (Large 4's indexer; under LoRA the
    whole base) have no gradient and no optimizer state. Counted once per (config, pp, lora): a
    layout search asks for the same counts many times."""
    key = repr((config, pp, lora))
    if key not in _STAGE_COUNTS:
        model = meta_model(config, lora)
        stages = [pipeline_stage(model, s, pp) if pp > 1 else model for s in range(pp)]
        _STAGE_COUNTS[key] = [
            tuple(
                sum(
                    p.numel()
                    for n, p in part.named_parameters()
                    if (".mlp.experts." in n) == expert and p.requires_grad == trainable
                )
                for expert in (True, False)
                for trainable in (True, False)
            )
            for part in stages
        ]
    return _STAGE_COUNTS[key]


_STAGE_COUNTS: dict[str, list[tuple[int, ...]]] = {}


def stage_param_counts(config: ModelConfig, pp: int) -> list[tuple[int, int, int]]:
    """(expert, other trainable, other frozen) parameter counts of each of `pp` pipeline stages,
    on the meta device: what a stage holds before sharding (the planner sizes its collectives
    with it)."""
    return [(et + ef, ot, of) for et, ef, ot, of in _stage_counts(config, pp)]


def _stage_fp32_params(config: ModelConfig, pp: int) -> list[int]:
    """Parameters of each pipeline stage that FSDP gathers in FP32 under the BF16 policy: the head
    and the model's FP32 modules (parallel.apply_fsdp's FP32 units), expert parameters among them
    none."""
    key = (repr(config), pp)
    if key not in _STAGE_FP32:
        _STAGE_FP32[key] = _count_stage_fp32_params(config, pp)
    return _STAGE_FP32[key]


_STAGE_FP32: dict[tuple[str, int], list[int]] = {}


def _count_stage_fp32_params(config: ModelConfig, pp: int) -> list[int]:
    model = meta_model(config)
    stages = [pipeline_stage(model, s, pp) if pp > 1 else model for s in range(pp)]
    units = [
        [
            *part.fp32_root_modules(),
            part.lm_head,
            *(m for layer in part.layers.values() for m in part.fp32_modules(layer)),
        ]
        for part in stages
    ]
    return [sum(p.numel() for m in unit if m is not None for p in m.parameters()) for unit in units]


def accumulation_bytes(
    config: ModelConfig, cfg: ParallelConfig, lora: LoraConfig | None = None
) -> tuple[float, float]:
    """parallel.ParallelModel.accumulation_bytes on the busiest stage of a GPU run: (its FSDP units'
    trainable parameters unsharded, in FP32; all their weights gathered, BF16 but the FP32 units) in
    bytes. Under expert parallelism a rank's units hold its own experts."""
    stages = zip(_stage_counts(config, cfg.pp, lora), _stage_fp32_params(config, cfg.pp))
    return max(
        (4 * (et / cfg.ep + ot), 2 * ((et + ef) / cfg.ep + ot + of) + 2 * fp32)
        for (et, ef, ot, of), fp32 in stages
    )


def accumulation_of(
    config: ModelConfig, cfg: ParallelConfig, gpu_gib: float, lora: LoraConfig | None = None
) -> str:
    """[parallel] accumulation as parallel.choose_accumulation resolves it on a GPU of `gpu_gib`
    usable GiB."""
    return choose_accumulation(cfg, *accumulation_bytes(config, cfg, lora), gpu_gib * GIB)


def activation_bytes_per_token(
    config: ModelConfig, layers: int, checkpointing: str, seq_len: int, ep: int = 1
) -> float:
    """Bytes of saved activations per token of `layers` blocks under `checkpointing` (none,
    selective, op, full), from the model's own per-block estimates; `ep`: the expert-parallel
    degree (op keeps what the all-to-alls received)."""
    model = meta_model(config)
    block, checkpointed = (
        model.block_activation_bytes(seq_len),
        model.checkpointed_block_bytes(seq_len),
    )
    if checkpointing == "op":
        return layers * op_block_bytes(model, seq_len, ep) + block  # one block recomputed at a time
    kept = {"none": layers, "full": 0, "selective": layers // 2}[checkpointing]
    # Checkpointed blocks keep their inputs only; one block at a time is recomputed in full.
    return kept * block + (layers - kept) * checkpointed + (block if kept < layers else 0)


def op_block_bytes(model: torch.nn.Module, seq_len: int, ep: int = 1) -> float:
    """What one op-level checkpointed block keeps per token (the model's op_block_activation_bytes),
    or a ValueError naming the setting for a model that does not count it."""
    if not hasattr(model, "op_block_activation_bytes"):
        raise ValueError(
            "[parallel] activation_checkpointing = 'op': "
            f"{type(model).__name__} does not count what its op-level checkpointed blocks keep "
            "(op_block_activation_bytes); use 'none', 'selective' or 'full'"
        )
    return model.op_block_activation_bytes(seq_len, ep)


def microbatches_in_flight(cfg: ParallelConfig, grad_accum: int = 1, calls: int = 1) -> int:
    """Pipeline micro-batches whose activations a stage holds at its peak: GPipe all of them (of a
    schedule call: grad_accum / calls training micro-batches of pp_microbatches each), 1F1B and
    interleaving pp, ZB-V pp as well (its point: 1F1B's memory), DualPipeV pp + 1 (DeepSeek-V3's
    report, DualPipe's README)."""
    if cfg.pp == 1:
        return 1
    microbatches = cfg.pp_microbatches or cfg.pp * cfg.stages_per_rank
    return {"GPipe": microbatches * grad_accum // calls, "DualPipeV": cfg.pp + 1}.get(
        cfg.pp_schedule, cfg.pp
    )


def memory_per_gpu(
    config: ModelConfig,
    cfg: ParallelConfig,
    seq_len: int,
    batch_size: int,
    grad_accum: int = 1,
    gpu_gib: float = GPU_GIB["141GB"],
    lora: LoraConfig | None = None,
) -> dict[str, float]:
    """GiB per GPU on the busiest pipeline stage: FP32 master weights, FP32 gradients and AdamW
    moments (2 x FP32) of the trainable ones (in host memory instead with [parallel] offload:
    `host`), the unsharded FP32 gradients that accumulation holds (`held grads`), the weights FSDP
    gathers (BF16, the FP32 units in FP32: the current block and the prefetched next, or all of them
    when they stay gathered), and activations of the micro-batches in flight; with `lora`, only the
    adapters train. An estimate: no allocator slack or buffers. [parallel] accumulation "auto" is
    resolved for a GPU of `gpu_gib` (parallel.choose_accumulation); with one micro-batch every mode
    is sync_each.

    `total` is the step's peak. With one micro-batch and no pipeline, activations and gradients
    never peak together: the activations peak at the head, before any block has a gradient, and the
    gradients at the end of the backward, when only the last block's recompute is left (the
    rehearsal measures both, rehearsal.py). Under gradient accumulation or a pipeline, later
    micro-batches run their forward while gradients are there: the sum, with the gradients held:
    sync_each's sharded ones after its first micro-batch; sync_last's and gathered's unsharded ones,
    which become the sharded ones only in the last backward; under a pipeline a stage's unsharded
    ones through each schedule call (torch's stages sync once per call), and the sharded ones too
    where sync_each makes several calls. A pipeline keeps its stage's weights gathered through a
    call when reshard_after_forward is off (its default there), and under sync_last and gathered
    runs one call for the step: GPipe then holds the activations of all grad_accum x pp_microbatches
    micro-batches."""
    other_shards = cfg.dp_shard * cfg.ep * cfg.cp
    expert_shards = cfg.ep * cfg.dp_shard * cfg.cp
    stages = _stage_counts(config, cfg.pp, lora)
    layers_per_stage = math.ceil(config.num_hidden_layers / cfg.pp)
    sharded = max(et / expert_shards + ot / other_shards for et, _, ot, _ in stages)  # trainable
    frozen = max(ef / expert_shards + of / other_shards for _, ef, _, of in stages)
    expert_block = max(et + ef for et, ef, _, _ in stages) / layers_per_stage / cfg.ep
    other_block = (
        max(ot + of for _, _, ot, of in stages)
        - 2 * config.vocab_size * config.hidden_size / cfg.pp
    ) / layers_per_stage
    accumulation = accumulation_of(config, cfg, gpu_gib, lora) if grad_accum > 1 else "sync_each"
    # schedule calls per step
    calls = grad_accum if cfg.pp > 1 and accumulation == "sync_each" else 1
    unsharded_grads, all_gathered = accumulation_bytes(config, cfg, lora)
    # unsharded gradients held across micro-batches
    held = cfg.pp > 1 or accumulation != "sync_each"
    stays_gathered = accumulation == "gathered" or (cfg.pp > 1 and not cfg.reshard_after_forward)
    microbatches = cfg.pp_microbatches or cfg.pp * cfg.stages_per_rank
    in_flight = microbatches_in_flight(cfg, grad_accum, calls)
    tokens = batch_size * seq_len / cfg.cp / (microbatches if cfg.pp > 1 else 1)
    per_token = activation_bytes_per_token(
        config, layers_per_stage, cfg.activation_checkpointing, seq_len, cfg.ep
    )
    activations = tokens * in_flight * per_token
    # Two FP32 chunks of logits at once, and the unsharded FP32 head gradient [V, H] before its
    # reduce-scatter: the fused loss (model.LinearCrossEntropy) makes it in the head's forward, at
    # the activations' peak, one per micro-batch in flight there (GPipe runs every forward first;
    # 1F1B runs the last stage's backward right after its forward).
    head_in_flight = in_flight if cfg.pp > 1 and cfg.pp_schedule == "GPipe" else 1
    logits = 2 * 4 * min(config.loss_chunk_size, tokens) * config.vocab_size
    logits += 4 * config.vocab_size * config.hidden_size * head_in_flight
    states = {"params": 4 * (sharded + frozen), "grads": 4 * sharded, "optimizer": 8 * sharded}
    row = {
        **({name: 0.0 for name in states} if cfg.offload else states),
        "held grads": unsharded_grads if held else 0.0,
        "gathered": all_gathered if stays_gathered else 2 * 2 * (expert_block + other_block),
        "activations": activations + logits + fp8_copy_bytes(config, cfg, tokens, expert_block),
    }
    row = {name: value / GIB for name, value in row.items()}
    if cfg.pp > 1 or grad_accum > 1:
        sharded_grads_meanwhile = accumulation == "sync_each" and (cfg.pp == 1 or calls > 1)
        row["total"] = sum(row.values()) - (0.0 if sharded_grads_meanwhile else row["grads"])
    else:
        last_block = tokens * meta_model(config).block_activation_bytes(seq_len) / GIB
        row["total"] = (
            row["params"]
            + row["optimizer"]
            + row["gathered"]
            + max(row["activations"], row["grads"] + last_block)
        )
    # [parallel] offload: in host memory
    row["host"] = sum(states.values()) / GIB if cfg.offload else 0.0
    return row


def fp8_copy_bytes(
    config: ModelConfig, cfg: ParallelConfig, tokens: float, expert_block: float
) -> float:
    """[parallel] fp8's copies at their largest: the FP8 operands of one expert GEMM, made in the op
    and freed after it (fp8.py saves its BF16 inputs, no FP8 copy outlives an op): the local gate_up
    weight [E/ep, H, 2 * Im] (2/3 of a block's expert parameters) and its column-major copy, and the
    routed rows [tokens * k, H] with theirs, 1 byte each."""
    if cfg.fp8 == "none":
        return 0.0
    return 2 * (expert_block * 2 / 3 + tokens * config.num_experts_per_tok * config.hidden_size)


def candidate_layouts(gpus: int, num_experts: int, pipelines: bool = True) -> list[ParallelConfig]:
    """FSDP alone, FSDP with expert parallel, with a pipeline (if the model has stages), and HSDP
    across nodes of 8."""
    layouts = [ParallelConfig(dp_shard=gpus)]
    layouts += [
        ParallelConfig(dp_shard=gpus // ep, ep=ep)
        for ep in (2, 4, 8, 16, 32)
        if gpus % ep == 0 and num_experts % ep == 0 and gpus > ep
    ]
    layouts += [
        ParallelConfig(dp_shard=gpus // pp, pp=pp)
        for pp in (2, 4)
        if pipelines and gpus % pp == 0 and gpus > pp
    ]
    if gpus > 8 and gpus % 8 == 0:
        layouts += [
            ParallelConfig(dp_replicate=gpus // 8, dp_shard=8 // ep, ep=ep) for ep in (1, 8)
        ]
    # 2 replicas, each sharded over half the GPUs
    if gpus >= 32 and gpus % 16 == 0 and num_experts % 8 == 0:
        layouts.append(ParallelConfig(dp_replicate=2, dp_shard=gpus // 16, ep=8))
    return layouts


def memory_table(
    config: ModelConfig,
    layouts: list[tuple[str, ParallelConfig]],
    seq_len: int,
    batch_size: int,
    grad_accum: int = 1,
    lora: LoraConfig | None = None,
) -> str:
    """layouts: (label, layout) rows; the label says where a row comes from (the config, a
    candidate)."""
    names = ("params", "grads", "held grads", "optimizer", "gathered", "activations", "total")
    # [parallel] offload's host memory
    names += ("host",) if any(cfg.offload for _, cfg in layouts) else ()
    fits = [f"fits {gpu}" for gpu in GPU_GIB]
    lines = [
        f"Memory per GPU (GiB, estimate) for seq_len {seq_len}, batch_size {batch_size} rows "
        "per "
        f"data-parallel rank, {grad_accum} micro-batch(es) per step, "
        f"{config.num_hidden_layers} layers, "
        f"{config.num_experts} experts; a layout "
        f"fits a GPU if total + {OVERHEAD_GIB:.0f} GiB (slack, buffers) <= its usable memory",
        "| layout | " + " | ".join(names + tuple(fits)) + " |",
        "|---" * (len(names) + len(fits) + 1) + "|",
    ]
    for label, cfg in layouts:
        layout = " ".join(f"{d}={getattr(cfg, d)}" for d in MESH_DIMS if getattr(cfg, d) > 1)
        layout = f"{label}: {layout or 'one GPU'} ac={cfg.activation_checkpointing}"
        if grad_accum > 1:  # [parallel] accumulation, resolved
            layout += f" accumulation={accumulation_of(config, cfg, GPU_GIB['141GB'], lora)}"
        row = memory_per_gpu(config, cfg, seq_len, batch_size, grad_accum, lora=lora)
        marks = [
            "yes" if row["total"] + OVERHEAD_GIB <= usable else "NO" for usable in GPU_GIB.values()
        ]
        lines.append(f"| {layout} | " + " | ".join([f"{row[n]:.1f}" for n in names] + marks) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        description="Memory per GPU of parallel layouts (no GPU needed).",
        epilog="Override any config key as train.py does: --parallel.ep=8 --data.seq_len=8192",
    )
    parser.add_argument(
        "--config",
        required=True,
        help="a training TOML: its [model], [data] "
        "seq_len, "
        "[training] batch_size and [parallel] layout",
    )
    parser.add_argument(
        "--gpus",
        type=positive,
        help="the GPUs to lay out (default: what the config's layout needs); "
        "also lists candidate layouts for that many",
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    config, parallel = cfg.model_config, cfg.parallel
    gpus = args.gpus or parallel.named_world_size
    try:
        own = parallel.resolve(gpus, config.num_experts)
    except ValueError as error:
        raise ConfigError(f"{cfg.source} on --gpus {gpus}: {error}") from error
    layouts = [(f"config {Path(cfg.source).name}", own)]
    if args.gpus:
        pipelines = unsupported_layout(ParallelConfig(pp=2), model_class(config)) is None
        candidates = candidate_layouts(gpus, config.num_experts, pipelines)
        layouts += [("candidate", c) for c in candidates]
        layouts += [
            ("candidate", dataclasses.replace(c, activation_checkpointing="full"))
            for c in candidates
        ]
    print(
        memory_table(
            config,
            layouts,
            cfg.data.seq_len,
            cfg.training.batch_size,
            cfg.training.grad_accum,
            cfg.lora if cfg.lora.enabled else None,
        )
    )


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
