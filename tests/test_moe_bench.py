"""tools/moe_bench.py: it times our MoE layer (and torchtitan's, where a venv holds it) and prints the
table; speed is never asserted."""

import importlib.util

import pytest
import torch

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


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan 0.3.0 (/work/refvenv)")
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
