"""tools/profiling.py: one profiled step's time split by module kind, with every family's kinds
timed, the unchunked loss tools/bench.py compares the fused one with, and tools/gpu_check.sh's BF16
parity verdict."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

from head import Head
from helpers import assert_close_to_scale, build, only, tiny_config
from registry import FAMILIES, family
from tools.profiling import (
    SPLIT_ORDER,
    TIMED_MODULES,
    cosine_parity,
    dense_logits_loss,
    profile_step,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_familys_module_kinds_and_the_shared_ones_are_timed():
    kinds = {cls for cls, _ in TIMED_MODULES}
    assert all(cls in kinds for name in FAMILIES for cls, _ in family(name).timed_modules)
    assert Head in kinds and len(SPLIT_ORDER) == len(set(SPLIT_ORDER))


@only("flint")  # its kinds: Flint's attention core
def test_a_profiled_step_splits_its_time_across_the_modules():
    model = build(tiny_config("flint", num_hidden_layers=3))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    split, table = profile_step(
        model, lambda: model(ids, ids).backward(), torch.device("cpu"), table_rows=5
    )
    assert set(split) <= set(SPLIT_ORDER) and sum(split.values()) == pytest.approx(1.0, abs=0.05)
    assert split["head + loss"] > 0 and split["attention core"] > 0 and split["routed experts"] > 0
    assert table.count("\n") > 5


@only("flint")
def test_the_unchunked_loss_is_the_fused_one():
    model = build(tiny_config("flint", num_hidden_layers=3))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert_close_to_scale(dense_logits_loss(model, ids, ids), model(ids, ids), rtol=1e-6)


def test_tf32_rounding_keeps_ten_mantissa_bits_rounding_ties_away_from_zero():
    from tools.profiling import round_mantissa

    x = torch.tensor([1 + 2**-11, 1 + 2**-12, 1 + 3 * 2**-12, -(1 + 2**-11), 0.1, 2 - 2**-12, 3.0])
    # 2 - 2^-12: carries
    expected = [1 + 2**-10, 1.0, 1 + 2**-10, -(1 + 2**-10), 0.0999755859375, 2.0, 3.0]
    assert round_mantissa(x, 10).tolist() == expected


def test_the_bf16_split_keeps_sixteen_bits_and_the_precisions_rank_as_measured():
    from tools.profiling import head_precision_errors, split_bf16

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    hi, lo = split_bf16(x)
    assert hi.bfloat16().float().equal(hi) and ((hi + lo - x).abs() <= x.abs() * 2**-16).all()
    errors = {
        row["precision"]: row for row in head_precision_errors(vocab=2000, hidden=256, tokens=32)
    }
    # the loss, one number, sits in FP32 noise for the first two
    for key in ("grad_h_error", "grad_weight_error"):
        order = [errors[p][key] for p in ("float32", "bf16x3", "tf32", "bf16")]
        assert order == sorted(order), (key, order)
    assert (
        errors["bf16x3"]["loss_error"] < errors["tf32"]["loss_error"] < errors["bf16"]["loss_error"]
    )
    assert (
        errors["float32"]["grad_weight_error"] < 1e-5 and errors["bf16"]["grad_weight_error"] > 1e-3
    )


def gradients_of_two_runs():
    """An FP32 run's gradients and a BF16 run's stand-in (each rounded to BF16 and back): a large
    matrix, and sinks of 4 heads whose gradient is a thousand times smaller."""
    g = torch.Generator().manual_seed(0)
    fp32 = {
        "layers.0.mlp.down_proj.weight": torch.randn(64, 32, generator=g),
        "layers.0.self_attn.sinks.weight": 1e-3 * torch.tensor([0.9, -0.4, 0.05, 0.7]),
    }
    return fp32, {name: grad.bfloat16().float() for name, grad in fp32.items()}


def test_cosine_parity_accepts_bf16_rounding_at_every_scale():
    fp32, bf16 = gradients_of_two_runs()
    ok, line = cosine_parity(fp32, bf16, 0.9999)
    assert ok and "2 tensors" in line
    for name, grad in fp32.items():  # the verdict's measure, against torch's own cosine similarity
        expected = torch.nn.functional.cosine_similarity(
            grad.flatten().double(), bf16[name].flatten().double(), dim=0
        )
        assert expected >= 0.9999


def test_cosine_parity_names_the_tensor_that_points_elsewhere():
    """A wrong sink gradient fails the verdict however small it is; a zero gradient against a
    nonzero one fails too, and two zeros agree."""
    fp32, bf16 = gradients_of_two_runs()
    sinks = "layers.0.self_attn.sinks.weight"
    wrong = {**bf16, sinks: bf16[sinks].flip(0)}
    ok, line = cosine_parity(fp32, wrong, 0.98)
    expected = torch.nn.functional.cosine_similarity(
        fp32[sinks].double(), wrong[sinks].double(), dim=0
    )
    assert not ok and sinks in line and f"{expected:.5f}" in line
    assert not cosine_parity(fp32, {**bf16, sinks: torch.zeros(4)}, 0.98)[0]
    assert cosine_parity({sinks: torch.zeros(4)}, {sinks: torch.zeros(4)}, 0.98)[0]
    with pytest.raises(ValueError, match="down_proj"):
        cosine_parity(fp32, {sinks: bf16[sinks]}, 0.98)


@only("flint")  # tools/gpu_check.sh checks Flint (README, Fork)
def test_gpu_check_script_parses():
    """tools/gpu_check.sh cannot run here (no GPU): its bash and each of its Python pieces at least
    parse."""
    script = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    pieces = re.findall(r"<<'PY'[^\n]*\n(.*?)\nPY\n", text, re.DOTALL)
    assert (
        len(pieces) == text.count("<<'PY'") == 9
    )  # parity, graphs, train, bench, fp8, flash, two GPUs (sized, sync_free), sync_free's layer
    for number, piece in enumerate(pieces):
        compile(piece, f"gpu_check.sh, Python piece {number + 1}", "exec")
