"""tools/gpus.py: each GPU generation's calibrated fractions, as planner.py prices an op with them,
against rates computed by hand from the cited measurements."""

import pytest

import tools.planner as planner
from helpers import only
from registry import family
from tools.op_trace import OpCost
from tools.planner import GPUS, Pricing, attention_flops_per_token


def tiny():
    # 6 layers (0, 1 dense), 8 experts top 2, window 9
    return family("flint").config.from_name("tiny")


def matmul(op: str = "mm", flops: float = 1e12) -> OpCost:
    return OpCost("forward", "layers.*.mlp.experts", op, "bfloat16", "", False, flops=flops)


def test_each_generation_prices_its_own_fractions():
    """A B200 runs dense BF16 GEMMs at 0.70 x 1.55 / (2,250 / 989.4) of its peak (the H100's
    fraction times the measured B200 / H200 training speed-up over their peak ratio), not the H100's
    0.70; its grouped GEMM at 0.41 of that times the tile loss; copies at 0.75 of 8 TB/s. The H200
    is the H100's die: the same 0.70 and 0.87."""
    b200, h200, h100 = GPUS["B200"], GPUS["H200"], GPUS["H100"]
    b200_gemm = 0.70 * 1.55 / (2250 / 989.4)
    assert Pricing(b200).seconds(matmul())[0] == pytest.approx(1e12 / (2250e12 * b200_gemm))
    assert Pricing(b200).seconds(matmul())[0] > 1e12 / (2250e12 * 0.70) * 1.4
    grouped = Pricing(b200, expert_rows=192).seconds(matmul("flint.grouped_mm"))[0]
    assert grouped == pytest.approx(1e12 / (2250e12 * b200_gemm * 0.41 * 192 / 256))
    copy = OpCost("forward", "layers.*", "copy_", "bfloat16", "", False, bytes=1e9)
    assert Pricing(b200).seconds(copy)[0] == pytest.approx(1e9 / (8e12 * 0.75))
    assert Pricing(h200).seconds(matmul())[0] == pytest.approx(1e12 / (989.4e12 * 0.70))
    assert Pricing(h200).seconds(copy)[0] == pytest.approx(1e9 / (4.8e12 * 0.87))
    assert Pricing(h100, expert_rows=192).seconds(matmul("flint.grouped_mm"))[0] == pytest.approx(
        1e12 / (989.4e12 * 0.70 * 192 / 256)
    )


@only("flint")
def test_attention_backends_by_hand():
    """The same attention FLOPs at each backend's rates, forward 2 and backward 5 units (no
    recompute): flex (Triton) 0.315 / 0.255 and flash (FA4 class) 0.60 / 0.45 on an H100; on a B200
    flash 0.71 / 0.53, flex 0.71 / 2.4 and 0.53 / 2.4, cuDNN 0.55 / 0.41."""
    c, tokens = tiny(), 128

    def seconds(gpu, backend):
        pricing = Pricing(GPUS[gpu], attention=backend)
        return planner.attention_seconds(c, pricing, 64, tokens, "none")

    def by_hand(forward, backward):
        return 2 / forward + 5 / backward

    h100 = by_hand(0.90 * 0.35, 0.85 * 0.30) / by_hand(0.60, 0.45)
    assert seconds("H100", "flex") / seconds("H100", "flash") == pytest.approx(h100)
    b200 = by_hand(0.71 / 2.4, 0.53 / 2.4) / by_hand(0.71, 0.53)
    assert seconds("B200", "flex") / seconds("B200", "flash") == pytest.approx(b200)
    cudnn = by_hand(0.55, 0.41) / by_hand(0.71, 0.53)
    assert seconds("B200", "fused") / seconds("B200", "flash") == pytest.approx(cudnn)
    unit = attention_flops_per_token(c, 64) * tokens / 6 * planner.attention_tile_ratio(c, 64)
    assert seconds("B200", "flash") == pytest.approx(unit / 2250e12 * by_hand(0.71, 0.53))
