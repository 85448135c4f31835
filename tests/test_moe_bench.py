"""tools/moe_bench.py: it times our MoE layer (and torchtitan's, where a venv holds it) and prints
the table; speed is never asserted."""

import importlib.util

import pytest
import torch

from helpers import stops_with_one_line
from tools import moe_bench

FAST = ["--tokens", "64", "--reps", "1", "--warmup", "0", "--profile-steps", "1", "--top", "2"]


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_the_benchmark_runs_and_prints_its_table(router, capsys, one_thread):
    moe_bench.main(FAST + ["--router", router])
    out = capsys.readouterr().out
    assert f"{router} router" in out
    row = next(line for line in out.splitlines() if line.startswith("| flint |"))
    median, fastest, cpu, profiled, matmul, rest = (float(cell) for cell in row.split("|")[2:-1])
    assert 0 < fastest <= median and 0 < cpu and 0 < matmul < profiled and rest > 0
    if importlib.util.find_spec("torchtitan") is None:
        assert "torchtitan: not importable here" in out


@pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan 0.3.0 (/work/refvenv)"
)
def test_torchtitans_layer_with_our_weights_computes_ours(one_thread):
    """The weights copied across give torchtitan's layer our outputs and gradients (FP32)."""
    ours = moe_bench.build_ours("softmax", seed=0)
    theirs = moe_bench.build_theirs(moe_bench.import_torchtitan(), ours, fp32=True)
    x = torch.randn(1, 64, moe_bench.HIDDEN, requires_grad=True)
    assert "output" in moe_bench.compare(ours, theirs, x, torch.randn(1, 64, moe_bench.HIDDEN))
    with torch.no_grad():
        theirs.routed_experts.inner_experts.w2_EDF.mul_(1.01)
    with pytest.raises(RuntimeError, match="torchtitan's layer is not ours"):
        moe_bench.compare(ours, theirs, x, torch.randn(1, 64, moe_bench.HIDDEN))


@pytest.mark.parametrize(
    "argv, named, pattern",
    [
        (["--tokens", "0"], "--tokens", r"must be >= 1, got 0$"),
        (["--tokens", "-64"], "--tokens", r"must be >= 1, got -64$"),
        (["--reps", "0"], "--reps", r"must be >= 1, got 0$"),
        (["--warmup", "-1"], "--warmup", r"must be >= 0, got -1$"),
        (["--threads", "0"], "--threads", r"must be >= 1, got 0$"),
        (["--profile-steps", "0"], "--profile-steps", r"must be >= 1, got 0$"),
        (["--top", "-1"], "--top", r"must be >= 0, got -1$"),
        (["--tokens", "nan"], "--tokens", r"expected an integer >= 1, got 'nan'"),
        (["--router", "topk"], "--router", r"invalid choice: 'topk'"),
    ],
)
def test_bad_flags_stop_in_one_line_before_any_layer_is_built(monkeypatch, argv, named, pattern):
    monkeypatch.setattr(
        moe_bench, "build_ours", lambda *args, **kwargs: pytest.fail("built despite a bad flag")
    )
    stops_with_one_line(lambda: moe_bench.main(argv), SystemExit, named, pattern)


def test_the_smallest_accepted_counts_reach_the_timing(monkeypatch, capsys, one_thread):
    """--tokens 1, --reps 1, --warmup 0, --profile-steps 1, --top 0: one token's layer, timed once,
    nothing listed beside the matmuls."""
    timed = {}
    real = moe_bench.time_in_rotation

    def time_in_rotation(steps, reps, warmup):
        timed.update(reps=reps, warmup=warmup)
        return real(steps, reps, warmup)

    monkeypatch.setattr(moe_bench, "time_in_rotation", time_in_rotation)
    moe_bench.main(
        ["--tokens", "1", "--reps", "1", "--warmup", "0", "--profile-steps", "1", "--top", "0"]
    )
    out = capsys.readouterr().out
    assert timed == {"reps": 1, "warmup": 0} and "\n1 tokens, hidden" in out
    assert "flint, costliest other ops (self ms per step): \n" in out + "\n"
