"""tools/search.py: the layouts it enumerates keep the step's tokens, fit memory.py's estimate with
the margin, and come ranked by the calibrated planner."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

import tools.planner as planner
import tools.search as search
from config import load_config
from helpers import only
from tools.memory import OVERHEAD_GIB, memory_per_gpu

ROOT = Path(__file__).resolve().parent.parent
FLINT = only("flint")


@pytest.fixture
def small_space(monkeypatch):
    """One checkpointing mode and overlap, two micro-batch shapes: a few traces of the tiny
    model."""
    monkeypatch.setattr(search, "ROWS", (1, 2))
    monkeypatch.setattr(search, "CHECKPOINTING", ("none",))
    monkeypatch.setattr(search, "OVERLAPS", (1,))


def tiny_config():
    return load_config(
        ROOT / "configs" / "flint-8gpu.toml", ["--model.preset=tiny", "--data.seq_len=64"]
    )


def test_fits_leaves_the_slack_and_the_margin():
    """total x (1 + 6 %) + 10 GiB <= the GPU's usable memory with full checkpointing; 7 %
    without (memory.py's measured misses)."""
    h100 = planner.GPUS["H100"]
    for checkpointing, margin in (("full", 0.06), ("none", 0.07), ("op", 0.06)):
        limit = (h100.memory_gib - OVERHEAD_GIB) / (1 + margin)
        assert search.fits(limit * 0.999, h100, checkpointing) and not search.fits(
            limit * 1.001, h100, checkpointing
        )


@pytest.mark.slow
@FLINT
def test_search_keeps_the_step_and_ranks_what_fits(small_space, capsys, monkeypatch):
    cfg, h100 = tiny_config(), planner.GPUS["H100"]
    tokens = 2 * 64 * 8  # two rows of 64 tokens on each of 8 data-parallel ranks
    found = search.search(cfg, 8, h100, tokens)
    assert found and [c.plan.tokens_per_second for c in found] == sorted(
        (c.plan.tokens_per_second for c in found), reverse=True
    )
    for candidate in found:
        layout = candidate.layout
        assert layout.pp * layout.dp_replicate * layout.dp_shard * layout.ep * layout.cp == 8
        # the ranks that read distinct rows: cp ranks share a sequence, pp stages a micro-batch
        readers = layout.dp_replicate * layout.dp_shard * layout.ep
        assert candidate.rows * 64 * candidate.grad_accum * readers == tokens
        assert candidate.plan.tokens_per_gpu * 8 == tokens  # the GPUs' shares add up to the step
        row = memory_per_gpu(
            cfg.model_config, layout, 64, candidate.rows, candidate.grad_accum, h100.memory_gib
        )
        assert candidate.memory_gib == row["total"] and search.fits(
            row["total"], h100, layout.activation_checkpointing
        )
    modes = {c.layout.accumulation for c in found if c.grad_accum > 1}
    assert modes == {"sync_each", "sync_last", "gathered"}
    cramped = dataclasses.replace(h100, memory_gib=OVERHEAD_GIB)  # nothing fits beside the slack
    assert search.search(cfg, 8, cramped, tokens) == []
    monkeypatch.chdir(ROOT)
    best = search.main(
        [
            "--config",
            "configs/flint-8gpu.toml",
            "--gpus",
            "8",
            "--model.preset=tiny",
            "--data.seq_len=64",
            "--tokens-per-step",
            str(tokens),
        ]
    )
    out = capsys.readouterr().out
    assert f"{tokens:,} tokens per step, {len(found)} layouts fit" in out and "| 1 | " in out
    assert best.tokens_per_second == found[0].plan.tokens_per_second


@pytest.mark.slow
@FLINT
def test_search_tries_only_the_checkpointing_modes_asked(small_space, monkeypatch):
    """Each layout the search prices has one of the modes asked, and each mode asked is priced (the
    planner replaced by a recorder: the traces are the test above's)."""
    priced = []

    def plan_step(cfg, layout, device):
        priced.append(layout.activation_checkpointing)
        return SimpleNamespace(tokens_per_second=1.0)

    monkeypatch.setattr(search, "plan_step", plan_step)
    found = search.search(tiny_config(), 8, planner.GPUS["H100"], 2 * 64 * 8, ("full", "selective"))
    assert len(found) == len(priced) and set(priced) == {"full", "selective"}


@FLINT
def test_search_refuses_a_step_of_no_tokens(small_space):
    """0 tokens is not the config's default, and -4096 ranks nothing: refused; 1 token is a step no
    layout can split into rows of 64, so nothing fits."""
    cfg, h100 = tiny_config(), planner.GPUS["H100"]
    for tokens in (0, -4096):
        with pytest.raises(ValueError, match=f"tokens per step must be >= 1, got {tokens}"):
            search.search(cfg, 8, h100, tokens)
    assert search.search(cfg, 8, h100, 1) == []


@pytest.mark.slow
@FLINT
def test_op_level_is_tried_where_the_blocks_compile_whole(monkeypatch):
    """flint-8gpu compiles its blocks: the search lays out op-level checkpointing on 2 GPUs only
    without expert or context parallelism (parallel.py refuses it compiled there), and full
    checkpointing on every mesh."""
    monkeypatch.setattr(search, "ROWS", (1,))
    monkeypatch.setattr(search, "CHECKPOINTING", ("op", "full"))
    monkeypatch.setattr(search, "OVERLAPS", (1,))
    found = search.search(tiny_config(), 2, planner.GPUS["H100"], 2 * 64)

    def meshes(mode):
        return {
            (c.layout.dp_shard, c.layout.ep, c.layout.cp)
            for c in found
            if c.layout.activation_checkpointing == mode
        }

    assert meshes("op") == {(2, 1, 1)}
    assert meshes("full") >= {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


def test_op_level_is_tried_for_the_models_that_count_it(monkeypatch):
    """memory.py counts op-level blocks only for models with op_block_activation_bytes: the
    search leaves op out for the others."""
    cfg = tiny_config()
    assert search.counted_modes(cfg) == ("none", "selective", "op", "full")
    monkeypatch.delattr(type(planner.meta_model(cfg.model_config)), "op_block_activation_bytes")
    assert search.counted_modes(cfg) == ("none", "selective", "full")
