"""[parallel] accumulation (parallel.ParallelModel.accumulate_gradients) on gloo: every mode gives
the losses, gradients and AdamW steps of one process accumulating the same micro-batches, and issues
the collectives it promises, counted as FSDP2 calls them.

Per FSDP unit that shards over more than one rank, in one optimizer step of GRAD_ACCUM
micro-batches:
  sync_each: GRAD_ACCUM reduce-scatters, and GRAD_ACCUM all-gathers in forward plus GRAD_ACCUM in
  backward
             for the units resharded after forward (all but the head);
  sync_last: one reduce-scatter, the all-gathers of sync_each;
  gathered:  one reduce-scatter and one all-gather.
HSDP all-reduces where it reduce-scatters. Under a pipeline the schedule reduces once per call
(REDUCE_GRAD): GRAD_ACCUM calls for sync_each, one for the others.
"""

import sys
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from helpers import (
    DEFAULT_FAMILY,
    FIRST_FAMILY_THEN_SECOND_TIER,
    LR,
    assert_close_to_scale,
    build,
    full,
    in_process_group,
    make_batch,
    moe_layers,
    only,
    rows_of_this_rank,
    slow,
    spawn,
    tiny_config,
)
from parallel import ParallelConfig, build_mesh, choose_accumulation, parallelize

GRAD_ACCUM = 3
MODES = ("sync_each", "sync_last", "gathered")
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce")
# The counted pipelines (1F1B, pp = 2, pp_microbatches = 0) cut each micro-batch of a data-parallel
# rank into one pipeline micro-batch per stage, in every mode (sync_last and gathered: in one call).
PIPELINE_MICROBATCHES = 2


@contextmanager
def fsdp_collectives():
    """Counts the collectives FSDP2 issues (torch/distributed/fsdp calls torch.distributed's, by
    name), and the pipeline's gradient reductions (one per stage per REDUCE_GRAD action)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    reduce_grad = PipelineStage.perform_reduce_grad

    def counted(name):
        def call(*args, **kwargs):
            if sys._getframe(1).f_globals["__name__"].startswith("torch.distributed.fsdp"):
                counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    def counted_reduce_grad(stage, *args, **kwargs):
        counts["REDUCE_GRAD"] += 1
        return reduce_grad(stage, *args, **kwargs)

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    PipelineStage.perform_reduce_grad = counted_reduce_grad
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        PipelineStage.perform_reduce_grad = reduce_grad


def units_of(pm) -> tuple[int, int, int]:
    """(FSDP units of this rank that shard over more than one rank, those of them resharded after
    forward, units that all-reduce over HSDP replicas), read from FSDP2's own state."""
    sharded = resharded = replicated = 0
    for unit in pm.units:
        # none for a unit without parameters of its own
        groups = unit.module._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        info = groups[0].mesh_info
        if info.shard_mesh_size > 1:
            sharded += 1
            resharded += unit.reshard_after_forward
        replicated += getattr(info, "replicate_mesh_size", 1) > 1
    return sharded, resharded, replicated


def expected_collectives(
    mode: str, pm, pipelined: bool, micro_batches: int = GRAD_ACCUM
) -> dict[str, int]:
    sharded, resharded, replicated = units_of(pm)
    syncs = micro_batches if mode == "sync_each" else 1
    gathers = sharded if mode == "gathered" else micro_batches * (sharded + resharded)
    # weights gathered through each schedule call (reshard_after_forward false), one call per sync
    if pipelined:
        gathers = syncs * sharded
    counts = {
        "all_gather_single": gathers,
        "reduce_scatter_single": syncs * sharded,
        "all_reduce": syncs * replicated,
        "REDUCE_GRAD": syncs * len(pm.parts) if pipelined else 0,
    }
    return {name: count for name, count in counts.items() if count}


def counting_block_forwards(pm) -> dict[str, list[int]]:
    """The rows of each forward of each of this rank's blocks, by layer name (forward pre-hooks)."""
    rows: dict[str, list[int]] = {}
    for part in pm.parts:
        for name, layer in part.layers.items():
            rows[name] = []
            record = rows[name].append
            layer.register_forward_pre_hook(lambda _, args, record=record: record(len(args[0])))
    return rows


def micro_batches(config) -> list[tuple[torch.Tensor, ...]]:
    """GRAD_ACCUM batches of make_batch's pattern, other tokens each; the last has 2 fewer loss
    tokens per row, so that the micro-batches weigh differently."""
    batches = [make_batch(seed, vocab=min(256, config.vocab_size)) for seed in range(GRAD_ACCUM)]
    batches[-1][1][:, :2] = -100
    return batches


def reference_steps(config, batches, steps: int = 2):
    """One process: `steps` AdamW steps, each accumulating every micro-batch, each weighted by its
    loss tokens over the step's -> (losses, step 0's gradients by name, gradient norms)."""
    model = build(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    total = sum(int((targets != -100).sum()) for _, targets, _ in batches)
    losses, norms, grads = [], [], None
    for step in range(steps):
        loss = torch.zeros(())
        for ids, targets, doc_ids in batches:
            share = model(ids, targets, doc_ids) * (targets != -100).sum() / total
            share.backward()
            loss += share.detach()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return losses, grads, norms


def check_accumulation(layouts: list[dict], family: str, modes=MODES, count: bool = True) -> None:
    """For each layout and mode: both steps' losses, step 0's every gradient and both gradient norms
    equal one process's (two AdamW steps: the second forward reads the weights the first step
    updated), as does an evaluation between them; after each step every parameter is its shard again
    (what the optimizer updates and a checkpoint saves: nothing left gathered), and the collectives
    issued in step 0 are those the mode promises (`count`)."""
    config = tiny_config(family)
    batches = micro_batches(config)
    ref_losses, ref_grads, ref_norms = reference_steps(config, batches)
    for layout in layouts:
        for mode in modes:
            what = f"{family} {layout} {mode}"
            cfg = ParallelConfig.from_dict(
                {"param_dtype": "float32", **layout, "accumulation": mode}
            )
            mesh = build_mesh(cfg, "cpu", config.num_experts)
            pm = parallelize(build(config), cfg, mesh)
            assert pm.accumulation == mode
            optimizer = torch.optim.AdamW(pm.module.parameters(), lr=LR, foreach=False)
            local = [
                dict(zip(("input_ids", "targets", "doc_ids"), rows_of_this_rank(mesh, b)))
                for b in batches
            ]
            forwards = counting_block_forwards(pm)
            for step in range(2):
                for each in forwards.values():
                    each.clear()
                with fsdp_collectives() as counts:
                    loss = pm.accumulate_gradients(local)
                if count and cfg.pp > 1:  # each pipeline micro-batch of each micro-batch ran, whole
                    piece = len(local[0]["input_ids"]) // PIPELINE_MICROBATCHES
                    runs = GRAD_ACCUM * PIPELINE_MICROBATCHES
                    expected = {name: [piece] * runs for name in forwards}
                    assert forwards and forwards == expected, f"{what}: rows per forward {forwards}"
                gathered = [
                    name
                    for name, param in pm.module.named_parameters()
                    if not isinstance(param, DTensor)
                ]
                assert not (pm.units and gathered), (
                    f"{what}: left gathered after the step: {gathered}"
                )
                assert_close_to_scale(loss, ref_losses[step], what=f"{what} step {step} loss")
                if step == 0:
                    if count:
                        expected = expected_collectives(mode, pm, cfg.pp > 1)
                        assert dict(counts) == expected, (
                            f"{what}: collectives {dict(counts)}, expected {expected}"
                        )
                    for name, param in pm.module.named_parameters():
                        if name not in ref_grads:  # frozen (Large 4's indexer)
                            assert param.grad is None, f"{what}: frozen {name} got a gradient"
                        else:
                            assert_close_to_scale(
                                full(param.grad), ref_grads[name], what=f"{what} grad {name}"
                            )
                assert_close_to_scale(
                    pm.clip_grad_norm_(float("inf")),
                    ref_norms[step],
                    what=f"{what} step {step} norm",
                )
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:  # train.evaluate's forward, on the weights the step updated
                    num_tokens = pm.global_tokens(torch.stack([b["targets"] for b in local]))
                    evaluated = sum(pm.loss(**batch, num_tokens=num_tokens) for batch in local)
                    assert_close_to_scale(
                        evaluated, ref_losses[1], what=f"{what} evaluation after step 0"
                    )
            # then FSDP2's settings are back: a lone forward_backward, and a step of one micro-batch
            # in
            if count:
                for run in (
                    lambda: pm.forward_backward(**local[0]),
                    lambda: pm.accumulate_gradients(local[:1]),
                ):
                    with fsdp_collectives() as counts:  # every mode, communicate as sync_each does
                        run()
                    expected = expected_collectives("sync_each", pm, cfg.pp > 1, micro_batches=1)
                    assert dict(counts) == expected, (
                        f"{what}: one micro-batch issued {dict(counts)}, not {expected}"
                    )


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_every_mode_matches_one_process_under_fsdp(family):
    """FSDP over 2 ranks, every registered family (Large 4: its frozen indexer gets no gradient in
    any mode)."""
    spawn(2, check_accumulation, [{"dp_shard": 2}], family)


@pytest.mark.slow
def test_every_mode_matches_one_process_under_expert_parallel_and_a_pipeline():
    """ep 2 (the experts' own FSDP units over one rank each: no collective of theirs), and a 1F1B
    pipeline of 2 stages (no FSDP on one data-parallel rank: the schedule's gradient reductions are
    counted)."""
    spawn(
        2, check_accumulation, [{"ep": 2, "dp_shard": 1}, {"pp": 2, "dp_shard": 1}], DEFAULT_FAMILY
    )


@pytest.mark.slow
def test_every_mode_matches_one_process_under_hsdp_and_a_sharded_pipeline():
    """HSDP (replicate 2 x shard 2: the all-reduces counted) and a 1F1B pipeline of 2 stages over 2
    FSDP ranks each (its units gathered once per schedule call, reduce-scattered once per call)."""
    spawn(
        4,
        check_accumulation,
        [{"dp_replicate": 2, "dp_shard": 2}, {"pp": 2, "dp_shard": 2}],
        DEFAULT_FAMILY,
    )


@slow
def test_every_mode_matches_one_process_under_other_schedules_offload_and_checkpointing():
    """The V and interleaved schedules (two stages per rank, torch's UNSHARD and RESHARD actions),
    CPU offload and full activation checkpointing (whose recompute gathers again): values only."""
    spawn(
        2,
        check_accumulation,
        [
            {"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble"},
            {"pp": 2, "dp_shard": 1, "pp_schedule": "Interleaved1F1B"},
            {"dp_shard": 2, "offload": True},
            {"dp_shard": 2, "activation_checkpointing": "full"},
        ],
        DEFAULT_FAMILY,
        MODES,
        False,
    )


def test_auto_takes_the_most_that_fits_a_quarter_of_the_device():
    """gathered if the unsharded gradients and the gathered weights fit 25 % of the device,
    sync_last if the gradients do, else sync_each; sync_each with offload; under a pipeline
    sync_last, but sync_each for GPipe."""
    auto, gb = ParallelConfig(), 1e9
    assert choose_accumulation(auto, 10 * gb, 15 * gb, 100 * gb) == "gathered"
    assert choose_accumulation(auto, 10 * gb, 15.1 * gb, 100 * gb) == "sync_last"
    assert choose_accumulation(auto, 25 * gb, 1, 100 * gb) == "sync_last"
    assert choose_accumulation(auto, 25.1 * gb, 0, 100 * gb) == "sync_each"
    assert choose_accumulation(ParallelConfig(offload=True), 1, 1, 100 * gb) == "sync_each"
    assert choose_accumulation(ParallelConfig(pp=2), 90 * gb, 90 * gb, 100 * gb) == "sync_last"
    assert (
        choose_accumulation(ParallelConfig(pp=2, pp_schedule="GPipe"), 1, 1, 100 * gb)
        == "sync_each"
    )
    for mode in MODES:
        assert choose_accumulation(ParallelConfig(accumulation=mode), 90 * gb, 90 * gb, gb) == mode


@only("flint")
def test_what_accumulation_holds_counted_by_hand():
    """One process under the BF16 policy: 4 B of FP32 gradient per parameter (all trainable), and
    the weights gathered in 2 B, but the head, the sinks and the routers (the FP32 units) in 4; on
    the CPU the host's memory takes both (the tiny model): auto resolves to gathered."""
    config = tiny_config("flint")

    def laid_out():
        cfg = ParallelConfig(param_dtype="bfloat16")
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        return pm.accumulation_bytes(), pm.accumulation

    (gradients, weights), mode = in_process_group(laid_out)
    total = build(config).num_params()
    fp32 = (
        config.vocab_size * config.hidden_size
        + config.num_hidden_layers * config.num_attention_heads
        + len(moe_layers(config)) * config.num_experts * config.hidden_size
    )
    assert (gradients, weights, mode) == (4 * total, 2 * (total - fp32) + 4 * fp32, "gathered")
