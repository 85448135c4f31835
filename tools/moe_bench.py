r"""Our MoE layer (moe.MoE) against torchtitan's, side by side in one process: forward and backward.

    /work/refvenv/bin/python -m tools.moe_bench                 # from the repository root
    python -m tools.moe_bench --reps 40 --bf16 --router softmax

The shape is bench-cpu's MoE layer: hidden 256, 32 routed experts of width 128, top 4, one shared
expert of width 256, 2,048 tokens, FP32, one thread. Both layers get the same weights (torchtitan's
w1/w3/w2 from our gate_up_proj/down_proj) and the same input and output gradient; their outputs and
gradients are compared before timing. Steps are timed in rotation (one of each layer in turn, --reps
times) so that a machine whose speed drifts slows both alike; the table gives medians, of wall time
and of this process's CPU time (which leaves out the time it waited for a core on a shared machine).
Profiled steps, in rotation too, then split each layer's step into its matmuls (the self time of mm,
addmm, bmm and _grouped_mm) and the rest (the profiled step minus those: every other op, autograd
and Python), and name the costliest other ops.

torchtitan is optional: without it (a venv without torchtitan 0.3.0) only our layer is timed. Its
expert matmuls cast to BF16; the row compared by default runs them in FP32 like ours (--bf16 adds
the shipped BF16 row). torchtitan imports a Triton kernel module for its GPU-only expert-parallel
path; the CPU has no Triton, so that one module is replaced by a stand-in before the import."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench.py: idle OpenMP threads sleep

import importlib.util
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from flags import OneLineParser, non_negative, positive
from moe import MoE

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, SHARED = 256, 32, 4, 128, 256
AGREE = 1e-4  # FP32 sums in another order differ by far less
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}


def build_ours(router: str, seed: int) -> MoE:
    """Flint's layer (sigmoid router, renormalised top-k) or Large 4's (softmax, renormalised,
    scaled)."""
    torch.manual_seed(seed)
    softmax = router == "softmax"
    layer = MoE(
        HIDDEN,
        INTERMEDIATE,
        SHARED,
        EXPERTS,
        TOP_K,
        norm_topk_prob=True,
        score_function=router,
        scaling=2.5 if softmax else 1.0,
    )
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(std=(1.0 if "router" in name else 0.5) / param.shape[-2] ** 0.5)
    return layer


def import_torchtitan():
    """torchtitan's common MoE module, or None when it is not installed."""
    if importlib.util.find_spec("torchtitan") is None:
        return None
    sys.modules.setdefault("torchtitan.distributed.minimal_async_ep.kernels", mock.MagicMock())
    from torchtitan.models.common import moe as titan_moe

    return titan_moe


def fp32_grouped_experts(experts, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """torchtitan's GroupedExperts.forward without its casts to BF16: three FP32 grouped GEMMs."""
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    gate = torch._grouped_mm(x, experts.w1_EFD.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, experts.w3_EFD.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(F.silu(gate) * up, experts.w2_EDF.transpose(-2, -1), offs=offsets)


def build_theirs(titan_moe, ours: MoE, fp32: bool) -> torch.nn.Module:
    """torchtitan's MoE with our layer's weights (and router: score function, renormalisation,
    scale)."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def linear(fan_in, fan_out):
        return Linear.Config(in_features=fan_in, out_features=fan_out)

    config = titan_moe.MoE.Config(
        num_experts=EXPERTS,
        load_balance_coeff=None,
        router=titan_moe.TokenChoiceTopKRouter.Config(
            num_experts=EXPERTS,
            gate=linear(HIDDEN, EXPERTS),
            top_k=TOP_K,
            score_func=ours.router.score_function,
            route_norm=True,
            route_scale=ours.router.scaling,
        ),
        routed_experts=titan_moe.RoutedExperts.Config(
            inner_experts=titan_moe.GroupedExperts.Config(
                dim=HIDDEN, hidden_dim=INTERMEDIATE, num_experts=EXPERTS
            ),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
        ),
        shared_experts=FeedForward.Config(
            w1=linear(HIDDEN, SHARED), w2=linear(SHARED, HIDDEN), w3=linear(HIDDEN, SHARED)
        ),
    )
    theirs = config.build()
    inner = theirs.routed_experts.inner_experts
    gate, up = ours.experts.gate_up_proj.detach().chunk(2, dim=-1)  # [E, H, I] each
    with torch.no_grad():
        inner.w1_EFD.copy_(gate.transpose(1, 2))
        inner.w3_EFD.copy_(up.transpose(1, 2))
        inner.w2_EDF.copy_(ours.experts.down_proj.detach().transpose(1, 2))
        theirs.router.gate.weight.copy_(ours.router.weight)
        for mine, their in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            getattr(theirs.shared_experts, their).weight.copy_(
                getattr(ours.shared_expert, mine).weight
            )
    if fp32:
        inner.forward = lambda x, counts: fp32_grouped_experts(inner, x, counts)
    return theirs


def their_grads(theirs) -> dict[str, torch.Tensor]:
    """torchtitan's gradients under our parameter names and layouts."""
    inner = theirs.routed_experts.inner_experts
    shared = theirs.shared_experts
    return {
        "router.weight": theirs.router.gate.weight.grad,
        "experts.gate_up_proj": torch.cat([inner.w1_EFD.grad, inner.w3_EFD.grad], dim=1).transpose(
            1, 2
        ),
        "experts.down_proj": inner.w2_EDF.grad.transpose(1, 2),
        "shared_expert.gate_proj.weight": shared.w1.weight.grad,
        "shared_expert.up_proj.weight": shared.w3.weight.grad,
        "shared_expert.down_proj.weight": shared.w2.weight.grad,
    }


def step_of(
    layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """One forward and backward from fresh gradients; returns the output."""

    def step():
        for param in layer.parameters():
            param.grad = None
        x.grad = None
        y = layer(x)
        y.backward(grad)
        return y.detach()

    return step


def worst_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def compare(ours: MoE, theirs, x: torch.Tensor, grad: torch.Tensor) -> str:
    """Both layers' outputs and gradients, as the largest difference over the largest magnitude;
    a difference past AGREE stops the benchmark (the two would not compute the same layer)."""
    y_ours = step_of(ours, x, grad)()
    dx_ours = x.grad.clone()
    y_theirs = step_of(theirs, x, grad)()
    worst = {
        "output": worst_relative(y_theirs, y_ours),
        "input grad": worst_relative(x.grad, dx_ours),
    }
    mine = dict(ours.named_parameters())
    for name, their_grad in their_grads(theirs).items():
        worst[name] = worst_relative(their_grad, mine[name].grad)
    summary = ", ".join(f"{name} {value:.1e}" for name, value in worst.items())
    if max(worst.values()) > AGREE:
        raise RuntimeError(
            f"torchtitan's layer is not ours (largest difference / largest value): {summary}"
        )
    return summary


def time_in_rotation(
    steps: dict[str, Callable], reps: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each step's wall seconds and this process's CPU seconds, one step of each layer in turn. On a
    machine shared with other jobs the CPU time leaves out the time the process waited for a
    core."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    wall, cpu = defaultdict(list), defaultdict(list)
    for _ in range(reps):
        for name, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def matmul_split(
    steps: dict[str, Callable], rotations: int, top: int
) -> dict[str, tuple[float, float, list]]:
    """Profiled steps, in rotation -> per layer: its median profiled step (s), the median self time
    of its matmuls in those steps (s), and its costliest other ops (mean self s per step)."""
    walls, matmuls, others = (
        defaultdict(list),
        defaultdict(list),
        defaultdict(lambda: defaultdict(float)),
    )
    # the profiler's own start-up, outside the figures
    with profile(activities=[ProfilerActivity.CPU]):
        next(iter(steps.values()))()
    for _ in range(rotations):
        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                step()
                walls[name].append(time.perf_counter() - start)
            matmul = 0.0
            for event in prof.key_averages():
                seconds = event.self_cpu_time_total / 1e6
                if event.key in MATMULS:
                    matmul += seconds
                else:
                    others[name][event.key] += seconds / rotations
            matmuls[name].append(matmul)
    return {
        name: (
            statistics.median(walls[name]),
            statistics.median(matmuls[name]),
            sorted(others[name].items(), key=lambda item: -item[1])[:top],
        )
        for name in steps
    }


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=positive, default=2048, help="tokens per step (default 2048)"
    )
    parser.add_argument("--reps", type=positive, default=30, help="rotations timed (default 30)")
    parser.add_argument(
        "--warmup", type=non_negative, default=3, help="untimed steps per layer first (default 3)"
    )
    parser.add_argument("--threads", type=positive, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--router",
        choices=("sigmoid", "softmax"),
        default="sigmoid",
        help="sigmoid: Flint's router; softmax: Large 4's (renormalised, scaled)",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="also time torchtitan's shipped BF16 expert matmuls"
    )
    parser.add_argument(
        "--profile-steps", type=positive, default=9, help="profiled rotations (default 9)"
    )
    parser.add_argument(
        "--top", type=non_negative, default=6, help="costliest non-matmul ops listed per layer"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # torchtitan's FP32 router autocast
    warnings.filterwarnings("ignore", message="In CPU autocast")

    ours = build_ours(args.router, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, HIDDEN, generator=generator).requires_grad_()
    grad = torch.randn(1, args.tokens, HIDDEN, generator=generator)
    steps = {"flint": step_of(ours, x, grad)}
    titan_moe = import_torchtitan()
    if titan_moe is None:
        print(
            "torchtitan: not importable here, timing our layer only (run with a venv holding "
            "torchtitan 0.3.0)"
        )
    else:
        theirs = build_theirs(titan_moe, ours, fp32=True)
        print(
            "torchtitan FP32 against flint, largest difference / largest value: "
            f"{compare(ours, theirs, x, grad)}"
        )
        steps["torchtitan FP32"] = step_of(theirs, x, grad)
        if args.bf16:
            steps["torchtitan BF16 experts"] = step_of(
                build_theirs(titan_moe, ours, fp32=False), x, grad
            )

    times, cpu_times = time_in_rotation(steps, args.reps, args.warmup)
    print(
        f"\n{args.tokens} tokens, hidden {HIDDEN}, {EXPERTS} experts top {TOP_K} of width "
        f"{INTERMEDIATE}, "
        f"shared {SHARED}, {args.router} router, FP32, {args.threads} thread(s), {args.reps} "
        "rotations; "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| layer | median ms per fwd+bwd | min ms | median CPU ms | profiled step ms | its "
        "matmuls ms | the rest ms |\n"
        "|---|---|---|---|---|---|---|"
    )
    split = matmul_split(steps, args.profile_steps, args.top)
    for name in steps:
        wall, matmul, _ = split[name]
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | "
            f"{min(times[name]) * 1e3:.1f} | "
            f"{statistics.median(cpu_times[name]) * 1e3:.1f} | {wall * 1e3:.1f} | "
            f"{matmul * 1e3:.1f} | "
            f"{(wall - matmul) * 1e3:.1f} |"
        )
    for other in list(steps)[1:]:
        ratios = [a / b for a, b in zip(times["flint"], times[other])]
        cpu_ratios = [a / b for a, b in zip(cpu_times["flint"], cpu_times[other])]
        print(
            f"flint / {other}: median per-rotation ratio {statistics.median(ratios):.3f} "
            f"(CPU time: {statistics.median(cpu_ratios):.3f})"
        )
    for name, (_, _, ops) in split.items():
        print(
            f"{name}, costliest other ops (self ms per step): "
            + ", ".join(f"{op.removeprefix('aten::')} {t * 1e3:.1f}" for op, t in ops)
        )


if __name__ == "__main__":
    main()
