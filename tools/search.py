"""Layout search: every layout of a model on N GPUs that fits memory.py's estimate, ranked by
planner.py.

    python3 -m tools.search --config configs/flint-8gpu.toml --gpus 8 --gpu H200
    python3 -m tools.search --config configs/flint.toml --gpus 64 --gpu H100 \\
        --tokens-per-step 1048576

The step's tokens (--tokens-per-step; default: the config's global batch, rows x seq_len x
grad_accum x the data-parallel ranks) stay fixed: each layout takes the micro-batches of `rows`
sequences per rank that make it up. Enumerated: pp (1, 2, 4, 8 where the model has stages) with its
schedule, dp_replicate (HSDP, one node a replica), ep (dividing the experts), cp (1, 2 where the
model has it), dp_shard the rest; rows per micro-batch 1, 2, 4, 8; the accumulation modes;
activation checkpointing none, selective, op, full (op where parallel.py runs it, compiled only on
blocks that compile whole, and where the model counts what it keeps for memory.py); ep_overlap 1, 2,
4. A layout fits when memory.py's
total, plus its 10 GiB of slack and buffers, plus memory.MEMORY_MARGIN of the total (memory.py's
largest miss against the rehearsals of its checkpointing mode), stays under the GPU's usable memory.
Ranked by calibrated tokens/s per GPU; each trace (per rows and checkpointing) is made once."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

from config import ConfigError, TrainConfig
from flags import OneLineParser, names_from, positive
from parallel import AC_MODES, ParallelConfig, unsupported_layout
from registry import model_class
from tools.memory import gib_needed, memory_per_gpu
from tools.planner import Device, Plan, add_shape_arguments, describe_layout, plan_step, read_shape

ROWS = (1, 2, 4, 8)
CHECKPOINTING = ("none", "selective", "op", "full")
OVERLAPS = (1, 2, 4)
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "DualPipeV": 2}  # pp_schedule: stages per rank


@dataclasses.dataclass
class Candidate:
    """A layout with its micro-batch shape, its memory estimate (GiB) and its predicted step."""

    layout: ParallelConfig
    rows: int
    grad_accum: int
    memory_gib: float
    plan: Plan


def data_parallel(layout: ParallelConfig) -> int:
    """Ranks that read distinct batches (parallel.build_mesh's dp: the cp ranks of a group share
    one)."""
    return layout.dp_replicate * layout.dp_shard * layout.ep


def tokens_per_step(cfg: TrainConfig, gpus: int) -> int:
    """The config's global batch in tokens on `gpus` GPUs."""
    layout = cfg.parallel.resolve(gpus, cfg.model_config.num_experts)
    return (
        cfg.training.batch_size * cfg.data.seq_len * cfg.training.grad_accum * data_parallel(layout)
    )


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def meshes(cfg: TrainConfig, gpus: int, device: Device) -> Iterator[ParallelConfig]:
    """Every (pp and schedule, dp_replicate, dp_shard, ep, cp) of `gpus` the model can run."""
    config = cfg.model_config
    model = model_class(config)
    pipelines = unsupported_layout(ParallelConfig(pp=2), model) is None
    contexts = (1, 2) if unsupported_layout(ParallelConfig(cp=2), model) is None else (1,)
    for pp in (1, 2, 4, 8) if pipelines else (1,):
        for schedule, stages in SCHEDULES.items() if pp > 1 else [("1F1B", 0)]:
            # a stage needs a layer (pipeline.pipeline_stage)
            if pp * max(1, stages) > config.num_hidden_layers:
                continue
            for cp in contexts:
                for ep in divisors(config.num_experts, min(64, gpus)):
                    rest, step = gpus // (pp * cp * ep), pp * cp * ep
                    if gpus % step or cfg.data.seq_len % (2 * cp):
                        continue
                    node = (
                        device.gpus_per_node // (cp * ep)
                        if device.gpus_per_node % (cp * ep) == 0
                        else 0
                    )
                    for replicas in {1, rest // node if node and rest % node == 0 else 1}:
                        yield dataclasses.replace(
                            cfg.parallel,
                            pp=pp,
                            pp_schedule=schedule,
                            pp_stages_per_rank=stages,
                            pp_microbatches=0,
                            cp=cp,
                            ep=ep,
                            dp_replicate=replicas,
                            dp_shard=rest // replicas,
                        )


def candidates(
    cfg: TrainConfig,
    gpus: int,
    device: Device,
    tokens: int,
    checkpointing_modes: tuple[str, ...] = CHECKPOINTING,
) -> Iterator[tuple[ParallelConfig, int, int]]:
    """(layout, rows, grad_accum) of each mesh, micro-batch shape, accumulation, checkpointing and
    overlap that keep the step at `tokens` and that parallel.py accepts."""
    num_experts, seq_len = cfg.model_config.num_experts, cfg.data.seq_len
    for mesh, rows, checkpointing, overlap in itertools.product(
        meshes(cfg, gpus, device), ROWS, checkpointing_modes, OVERLAPS
    ):
        per_step = rows * seq_len * data_parallel(mesh)
        if tokens % per_step or (mesh.ep == 1 and overlap > 1):
            continue
        accum = tokens // per_step
        modes = ("sync_each", "sync_last", "gathered") if accum > 1 else ("sync_each",)
        for mode in modes:
            layout = dataclasses.replace(
                mesh, activation_checkpointing=checkpointing, ep_overlap=overlap, accumulation=mode
            )
            microbatches = layout.pp_microbatches or layout.pp * max(1, layout.stages_per_rank)
            if layout.pp > 1 and rows % microbatches:
                continue
            try:
                yield layout.resolve(gpus, num_experts), rows, accum
            # a schedule this layout cannot run (parallel.ParallelConfig.validate)
            except ValueError:
                continue


def counted_modes(cfg: TrainConfig) -> tuple[str, ...]:
    """The checkpointing modes memory.py counts for this model: op only where the model says what
    its op-level blocks keep (op_block_activation_bytes)."""
    counts_op = hasattr(model_class(cfg.model_config), "op_block_activation_bytes")
    return tuple(mode for mode in CHECKPOINTING if mode != "op" or counts_op)


def fits(memory_gib: float, device: Device, checkpointing: str) -> bool:
    return gib_needed(memory_gib, checkpointing) <= device.memory_gib


def search(
    cfg: TrainConfig,
    gpus: int,
    device: Device,
    tokens: int | None = None,
    checkpointing_modes: tuple[str, ...] | None = None,
) -> list[Candidate]:
    """The layouts that fit, best calibrated tokens/s per GPU first; `checkpointing_modes` narrows
    the modes tried (default: counted_modes)."""
    tokens = tokens_per_step(cfg, gpus) if tokens is None else tokens
    checkpointing_modes = checkpointing_modes or counted_modes(cfg)
    if tokens < 1:  # 0 would be every layout's step of no micro-batches
        raise ValueError(f"tokens per step must be >= 1, got {tokens}")
    config, seq_len = cfg.model_config, cfg.data.seq_len
    found = []
    for layout, rows, accum in candidates(cfg, gpus, device, tokens, checkpointing_modes):
        memory = memory_per_gpu(config, layout, seq_len, rows, accum, device.memory_gib)["total"]
        if not fits(memory, device, layout.activation_checkpointing):
            continue
        shaped = dataclasses.replace(
            cfg, training=dataclasses.replace(cfg.training, batch_size=rows, grad_accum=accum)
        )
        found.append(Candidate(layout, rows, accum, memory, plan_step(shaped, layout, device)))
    return sorted(found, key=lambda c: -c.plan.tokens_per_second)


def search_table(found: list[Candidate], top: int = 5) -> str:
    """The best `top`: layout, micro-batch shape, memory, calibrated tokens/s and MFU, and its
    costliest ops."""
    lines = [
        "| # | layout | rows x grad_accum | accumulation | GiB (memory.py) | tokens/s per GPU "
        "| MFU | costliest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, found_one in enumerate(found[:top], 1):
        plan = found_one.plan
        costliest = ", ".join(
            f"{item.label.split(' (')[0]} {100 * item.exposed / plan.step_seconds:.0f} %"
            for item in sorted(plan.items, key=lambda item: -item.exposed)[:3]
        )
        lines.append(
            f"| {rank} | {describe_layout(found_one.layout)} | {found_one.rows} x "
            f"{found_one.grad_accum} | "
            f"{plan.accumulation} | {found_one.memory_gib:.1f} | "
            f"{plan.tokens_per_second:,.0f} | "
            f"{100 * plan.mfu:.1f} % | {costliest} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Plan | None:
    parser = OneLineParser(
        description="The layouts of --gpus GPUs that fit, best tokens/s per GPU first (no GPU).",
        epilog="Override any config key as train.py does: --data.seq_len=8192",
    )
    add_shape_arguments(parser)
    parser.add_argument(
        "--tokens-per-step", type=positive, help="the global batch (default: the config's)"
    )
    parser.add_argument(
        "--checkpointing",
        type=names_from(AC_MODES),
        help="the activation checkpointing modes to try, comma-separated "
        f"(default: {','.join(CHECKPOINTING)}, op where the model counts it)",
    )
    args, overrides = parser.parse_known_args(argv)
    cfg, device, gpus, _ = read_shape(args, overrides)
    started = time.perf_counter()
    tokens = (
        args.tokens_per_step if args.tokens_per_step is not None else tokens_per_step(cfg, gpus)
    )
    modes = tuple(args.checkpointing) if args.checkpointing else None
    found = search(cfg, gpus, device, tokens, modes)
    print(
        f"{Path(cfg.source).name} on {gpus} x {device.name}: {tokens:,} tokens per step, "
        f"{len(found)} layouts fit ({time.perf_counter() - started:.0f} s)"
    )
    if found:
        print(search_table(found))
    else:
        print(
            f"none: a layout needs --tokens-per-step a multiple of seq_len {cfg.data.seq_len} x "
            "rows x its data-parallel ranks, and its memory estimate to fit the GPU"
        )
    return found[0].plan if found else None


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        raise SystemExit(f"error: {error}")
