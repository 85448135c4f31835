"""FP8 under torch.compile (fp8.py): the quantisation (amax, scale, cast) is traced into the graph
around opaque FP8 GEMMs, so Inductor fuses it into the kernels that produce the operands. Counted
on one Flint MoE block, forward and backward, compiled whole (fullgraph=True) by Inductor on the
CPU: Inductor's kernels and the bytes they move (torch._inductor.metrics), plus whatever still runs
eagerly inside the opaque ops besides the GEMMs themselves (a dispatch mode entered in their
bodies). Before, the quantisation ran eagerly inside the opaque ops, pass by pass. And the
compiled ops compute what the eager ones do: bit for bit op by op, and a whole block to FP8's
rounding.

    /work/main/.venv/bin/python -m pytest tests/test_fp8_fusion.py -m slow -s   # prints the counts
"""

import logging
from contextlib import contextmanager

import pytest
import torch
from torch._inductor import metrics
from torch._inductor.compile_fx import inductor_metrics_log
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fp8
from fp8 import FORWARD, apply_fp8, fp8_grouped_mm, fp8_linear
from helpers import assert_close_to_scale, block_inputs, build, tiny_config, values_and_grads

# Measured with the same counting on the MoE block ("2") of the tiny Flint below, before this
# change (commit 2931897, whose fp8.py quantised inside its custom ops): Inductor's kernels plus
# the eager passes inside the opaque ops, and the bytes of both (BENCHMARKS.md, "FP8 quantisation
# fused under torch.compile").
BEFORE = {"rowwise": (767, 19_876_316), "tensorwise": (755, 18_782_716)}
# This change's counts, pinned as ceilings: a change that unfuses the quantisation again fails.
AFTER = {"rowwise": (342, 7_016_668), "tensorwise": (233, 6_983_004)}
GEMMS = {"_scaled_mm", "_scaled_grouped_mm", "mm"}
OPAQUE_BODIES = ("fp8_gemm", "grouped_loop", "weight_grad_loop")  # what the custom ops run


class EagerPasses(TorchDispatchMode):
    """Each op run eagerly (but the GEMMs and aliasing views): its name and the bytes it reads and
    writes."""

    def __init__(self, seen: list[tuple[str, int]]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in ins}
        if name in GEMMS or not outs:
            return out
        if func.is_view and all(t.untyped_storage().data_ptr() in storages for t in outs):
            return out  # an alias: no pass (a cast to FP8 under autograd's `to` is a real one)
        self.seen.append((name, sum(t.nbytes for t in ins + outs)))
        return out


@contextmanager
def inductor_metrics():
    """Inductor's metrics, counted afresh: no cached graph (whose kernels it would not count)."""
    level = inductor_metrics_log.level
    inductor_metrics_log.setLevel(logging.INFO)
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            metrics.reset()
            yield metrics
    finally:
        inductor_metrics_log.setLevel(level)


def fp8_moe_block(recipe: str) -> tuple[torch.nn.Module, tuple]:
    """The tiny Flint's MoE block (its attention projections, shared and routed experts) in FP8,
    its experts' groups padded to 16 rows as on CUDA, and a packed batch of 64 tokens."""
    model = build(tiny_config("flint", num_hidden_layers=4))
    apply_fp8(model, recipe)
    model.layers["2"].mlp.experts.group_align = 16
    return model.layers["2"], block_inputs(model.config)


def count_eager_passes_inside_the_opaque_ops(monkeypatch) -> list[tuple[str, int]]:
    """The FP8 custom ops' bodies (OPAQUE_BODIES) wrapped so that each eager pass they make is
    appended to the returned list (EagerPasses)."""
    seen: list[tuple[str, int]] = []
    for name in OPAQUE_BODIES:
        body = getattr(fp8, name)

        def counted(*args, _body=body, **kwargs):
            with EagerPasses(seen):
                return _body(*args, **kwargs)

        monkeypatch.setattr(fp8, name, counted)
    return seen


def passes_of_compiled_step(block, inputs, monkeypatch) -> dict:
    """Compile `block` (Inductor, fullgraph=True), run forward and backward twice: the kernels and
    bytes Inductor generated, the eager passes the second run made inside the opaque ops, and the
    values and gradients."""
    seen = count_eager_passes_inside_the_opaque_ops(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="inductor")
    with inductor_metrics() as counts:
        values_and_grads(compiled, *inputs)
        kernels, kernel_bytes = counts.generated_kernel_count, counts.num_bytes_accessed
    seen.clear()
    out, grads = values_and_grads(compiled, *inputs)
    return {
        "kernels": kernels + len(seen),
        "bytes": kernel_bytes + sum(size for _, size in seen),
        "eager": sorted({name for name, _ in seen}),
        "out": out,
        "grads": grads,
    }


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_compiled_block_fuses_the_quantisation(recipe, monkeypatch, one_thread):
    """Nothing of the quantisation runs outside Inductor's kernels (eagerly, only the CPU loop's
    output buffer: zeros and its copies); the kernels and bytes at most this change's counts, and
    less than half the counts before it. The compiled block's values and gradients are the eager
    block's to FP8's rounding: Inductor's FP32 sums (the norms') may round differently, and a value
    on a rounding edge of E4M3 (3 mantissa bits) moves by one step of 2^-4 of its magnitude."""
    block, inputs = fp8_moe_block(recipe)
    counted = passes_of_compiled_step(block, inputs, monkeypatch)
    kernels, moved = counted["kernels"], counted["bytes"]
    print(
        f"\n{recipe}: {kernels} kernels and eager passes, {moved:,} bytes "
        f"(before: {BEFORE[recipe][0]}, {BEFORE[recipe][1]:,})"
    )
    assert counted["eager"] == ["copy_", "zeros"], counted["eager"]
    assert kernels <= AFTER[recipe][0] and moved <= AFTER[recipe][1], (kernels, moved)
    assert 2 * kernels < BEFORE[recipe][0] and 2 * moved < BEFORE[recipe][1]
    out, grads = values_and_grads(block, *inputs)
    assert_close_to_scale(counted["out"], out, rtol=2e-2, what="output")
    for i, (g_c, g) in enumerate(zip(counted["grads"], grads)):
        assert_close_to_scale(g_c, g, rtol=2e-2, what=f"gradient {i}")


def fp8_ops_values_and_grads(recipe: str, compiled: bool) -> list[torch.Tensor]:
    """An FP8 linear and grouped GEMM (an expert with no rows), forward and both backward, eager or
    compiled whole by Inductor: outputs and every gradient."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g), torch.randn(48, 32, generator=g)
    rows, experts = torch.randn(64, 32, generator=g), torch.randn(3, 32, 48, generator=g)
    x[1] = 0  # a row of zeros
    x[2] *= 1e4  # a huge row
    leaves = [t.requires_grad_() for t in (x, w, rows, experts)]
    ends = torch.tensor([16, 16, 64], dtype=torch.int32)
    grad_y, grad_z = torch.randn(64, 48, generator=g), torch.randn(64, 48, generator=g)

    def step(x, w, rows, experts):
        # producers to fuse into, exact in any order (powers of two): only the FP8 ops can differ
        y = fp8_linear(x * 2, w, recipe)
        z = fp8_grouped_mm(rows * 0.5, experts, ends, recipe)
        return y, z

    run = torch.compile(step, fullgraph=True, backend="inductor") if compiled else step
    y, z = run(*leaves)
    grads = torch.autograd.grad((y * grad_y).sum() + (z * grad_z).sum(), leaves)
    return [y, z, *grads]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_gw_hp"])
def test_compiled_fp8_ops_equal_the_eager_ones_bit_for_bit(recipe, one_thread):
    """The quantisation compiled by Inductor rounds as the eager one does: the same FP8 values and
    scales reach the same GEMMs, so outputs and gradients are equal, not close."""
    torch._dynamo.reset()
    eager = fp8_ops_values_and_grads(recipe, compiled=False)
    compiled = fp8_ops_values_and_grads(recipe, compiled=True)
    names = ["y", "z", "grad x", "grad w", "grad rows", "grad experts"]
    for name, c, e in zip(names, compiled, eager):
        assert torch.equal(c, e), f"{recipe} {name}: {(c - e).abs().max():.3g} from eager"


def test_the_fp8_gemm_is_the_only_opaque_op(monkeypatch):
    """Eagerly, the quantisation runs outside the custom ops (in the traced autograd.Function), not
    inside them: what runs inside an FP8 GEMM op is the GEMM (and the CPU loop's output buffer)."""
    seen = count_eager_passes_inside_the_opaque_ops(monkeypatch)
    x = torch.randn(32, 16, requires_grad=True)
    experts = torch.randn(2, 16, 16, requires_grad=True)
    y = fp8.fp8_matmul(x, torch.randn(16, 16), "rowwise", FORWARD)
    z = fp8_grouped_mm(x, experts, torch.tensor([16, 32], dtype=torch.int32), "rowwise")
    (y.sum() + z.sum()).backward()
    assert {name for name, _ in seen} <= {"zeros", "copy_"}, seen
