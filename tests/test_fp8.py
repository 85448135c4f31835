"""FP8 matmuls (fp8.py) against a plain reference written here: each operand quantised by the
formula, slice by slice in Python loops, dequantised, multiplied in FP64. Every op's output and both
gradients, dense and grouped, every recipe, on rows of zeros, huge and tiny values and an expert
with no rows; tensor-wise gradients in E5M2 where E4M3 would flush them; what the config refuses;
compiled blocks; the CUDA kernels' checks on fake tensors (what a rehearsal runs); FSDP and expert
parallel against one process."""

import math
from collections import Counter
from functools import partial

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from config import ConfigError
from devices import targeting
from fp8 import FORWARD, apply_fp8, fp8_grouped_mm, fp8_linear, fp8_matmul, fp8_targets
from helpers import (
    DEFAULT_FAMILY,
    FAMILY_NAMES,
    FIRST_FAMILY_THEN_SLOW,
    assert_close_to_scale,
    block_inputs,
    build,
    debug_args,
    in_process_group,
    only,
    parallel_step,
    slow,
    spawn,
    stops_with_one_line,
    tiny_config,
    values_and_grads,
)
from moe import GroupedExperts

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LARGEST = {E4M3: 448.0, E5M2: 57344.0}  # each format's largest finite value (its data sheet)
RECIPES = ["rowwise", "tensorwise", "rowwise_gw_hp"]
# Large 4's debug config has a 24-wide latent projection: these widths (configs/large4-smoke.toml's)
# align it.
FP8_WIDTHS = {
    "large4": [
        "--model.kv_lora_rank=32",
        "--model.qk_rope_head_dim=16",
        "--model.qk_nope_head_dim=16",
        "--model.v_head_dim=32",
    ]
}


def fp8_debug_args(tmp_path, *overrides: str) -> list[str]:
    """The default family's debug config, FP8 widths and all, with fp8 = rowwise (then the
    overrides)."""
    return debug_args(
        tmp_path, "--parallel.fp8=rowwise", *FP8_WIDTHS.get(DEFAULT_FAMILY, []), *overrides
    )


# ============================================================================= the plain reference


def reference_scale(amax: float, largest: float = 448.0) -> float:
    """The largest power of two s with amax * s <= largest (amax floored at 1e-12), largest / amax
    in FP32."""
    ratio = float(torch.tensor(largest) / torch.tensor(max(amax, 1e-12), dtype=torch.float32))
    mantissa, exponent = math.frexp(ratio)  # ratio = mantissa * 2 ** exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1)


def fake_quantized(values: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """One scaling slice: quantised to `dtype` with its own scale, then multiplied back, in FP64."""
    largest = LARGEST[dtype]
    scale = reference_scale(values.abs().max().item(), largest)
    return (values.double() * scale).clamp(-largest, largest).to(dtype).double() / scale


def quantized_along(
    t: torch.Tensor, reduce_dim: int, rowwise: bool, dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """t [A, B] with a scale per slice along reduce_dim (rowwise) or one for the tensor,
    dequantised."""
    if not rowwise:
        return fake_quantized(t.flatten(), dtype).view(t.shape)
    out = torch.empty(t.shape, dtype=torch.float64)
    for i in range(t.shape[1 - reduce_dim]):
        if reduce_dim == 1:
            out[i, :] = fake_quantized(t[i, :], dtype)
        else:
            out[:, i] = fake_quantized(t[:, i], dtype)
    return out


def reference_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    rowwise: bool,
    formats: tuple[torch.dtype, torch.dtype] = (E4M3, E4M3),
) -> torch.Tensor:
    """a [M, K] @ b [K, N], each operand scaled along K and quantised to its format."""
    return quantized_along(a, 1, rowwise, formats[0]) @ quantized_along(b, 0, rowwise, formats[1])


def plain_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b unquantised, in FP64: rowwise_gw_hp's weight gradient."""
    return a.double() @ b.double()


def reference_grouped(x, w, ends, rowwise):
    """Per group g: x_g @ w_g; x per row, w per (group, column) or each tensor as a whole."""
    xq = quantized_along(x, 1, rowwise)
    wq = (
        torch.stack([quantized_along(w[g], 0, True) for g in range(w.shape[0])])
        if rowwise
        else fake_quantized(w.flatten()).view(w.shape)
    )
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    for g, (start, end) in enumerate(zip([0, *ends], ends)):
        out[start:end] = xq[start:end] @ wq[g]
    return out


def reference_grouped_weight_grad(x, grad, ends, rowwise, quantized=True):
    """Per group g: x_g^T @ grad_g, both scaled per column within the group's rows (or per tensor);
    or unquantised (rowwise_gw_hp)."""
    out = torch.zeros(len(ends), x.shape[1], grad.shape[1], dtype=torch.float64)
    whole_x, whole_grad = quantized_along(x, 0, False), quantized_along(grad, 0, False)
    for g, (start, end) in enumerate(zip([0, *ends], ends)):
        if end > start and not quantized:
            out[g] = x[start:end].double().T @ grad[start:end].double()
        elif end > start:
            xq = quantized_along(x[start:end], 0, True) if rowwise else whole_x[start:end]
            gq = quantized_along(grad[start:end], 0, True) if rowwise else whole_grad[start:end]
            out[g] = xq.T @ gq
    return out


def hard_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows, and among them: a row of zeros, a huge row (up to 448 * 2**20, so that the huge
    row does not quantise to the others' scale), a tiny row (1e-7) and a row with one outlier."""
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    t[1] = 0
    t[2] *= 448 * 2.0**20 / t[2].abs().max()
    t[3] *= 1e-7
    t[4, 0] = 3e4
    return t


def assert_exact(actual: torch.Tensor, reference, *operands: torch.Tensor, what: str) -> None:
    """actual equals reference(*operands) element by element to FP32 accumulation (the FP8 products
    are exact, only the sums' rounding differs): within 1e-6 of the same sum of absolute values, so
    that a huge row cannot hide an error in a small one, and a row of zeros must be exactly zero."""
    expected = reference(*operands)
    bound = 1e-6 * reference(*(t.abs() for t in operands))
    error = (actual.double() - expected).abs()
    assert (error <= bound).all(), f"{what}: worst error {(error - bound).max():.3g} past the bound"


# ============================================================================= the ops against it


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_output_and_both_gradients_match_the_reference(recipe):
    """Tensor-wise, the output gradient is E5M2 (the first operand of grad x, as grad_y @ W, and of
    grad W, as grad_y^T @ x); rowwise_gw_hp's grad W is the unquantised product."""
    rowwise = recipe != "tensorwise"
    gradient_format = E5M2 if recipe == "tensorwise" else E4M3
    x = hard_values(24, 32, seed=0).requires_grad_()
    w = hard_values(16, 32, seed=1).requires_grad_()
    grad = hard_values(24, 16, seed=2)
    y = fp8_linear(x, w, recipe)
    y.backward(grad)
    forward = partial(reference_matmul, rowwise=rowwise)
    backward = partial(reference_matmul, rowwise=rowwise, formats=(gradient_format, E4M3))
    assert_exact(y, forward, x.detach(), w.detach().T, what=f"{recipe} y")
    assert_exact(x.grad, backward, grad, w.detach(), what=f"{recipe} grad x (reduces N)")
    weight_grad = plain_matmul if recipe == "rowwise_gw_hp" else backward
    assert_exact(
        w.grad, weight_grad, grad.T, x.detach(), what=f"{recipe} grad W (reduces the tokens)"
    )
    assert y[1].abs().max() == 0 and torch.isfinite(y).all(), (
        "a row of zeros gives zeros, nothing overflows"
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_output_and_both_gradients_match_the_reference(recipe):
    """Groups of 8, 0 (an expert with no rows), 13 and 11 rows; every operand E4M3 (the grouped
    kernel takes no other), rowwise_gw_hp's grad w unquantised."""
    rowwise = recipe != "tensorwise"
    ends = [8, 8, 21, 32]
    x = hard_values(32, 16, seed=3).requires_grad_()
    # [G, K, N]
    w = torch.stack([hard_values(16, 48, seed=4 + g) for g in range(len(ends))]).requires_grad_()
    grad = hard_values(32, 48, seed=9)
    y = fp8_grouped_mm(x, w, torch.tensor(ends, dtype=torch.int32), recipe)
    y.backward(grad)
    grouped = partial(reference_grouped, ends=ends, rowwise=rowwise)
    assert_exact(y, grouped, x.detach(), w.detach(), what=f"{recipe} y")
    assert_exact(x.grad, grouped, grad, w.detach().transpose(1, 2), what=f"{recipe} grad x")
    weight_grad = partial(
        reference_grouped_weight_grad,
        ends=ends,
        rowwise=rowwise,
        quantized=recipe != "rowwise_gw_hp",
    )
    assert_exact(w.grad, weight_grad, x.detach(), grad, what=f"{recipe} grad w")
    assert w.grad[1].abs().max() == 0, "the expert with no rows gets no gradient"


def gradient_with_eight_huge_rows() -> torch.Tensor:
    """[4096, 16] standard normal rows, and 8 rows 10^4x larger, clamped below 4e4, one value 4e4:
    their largest value, which sets a tensor-wise scale, is exactly 4e4."""
    grad = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    grad[HUGE_ROWS] = (grad[HUGE_ROWS] * 1e4).clamp(-3.9e4, 3.9e4)
    grad[HUGE_ROWS[0], 0] = 4e4
    return grad


HUGE_ROWS = torch.arange(0, 4096, 512)  # 8 rows
OTHER_ROWS = torch.ones(4096, dtype=torch.bool).index_fill_(0, HUGE_ROWS, False)


def relative_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return ((actual.double() - exact).norm() / exact.norm()).item()


def test_tensorwise_gradients_in_e5m2_keep_what_e4m3_flushes_to_zero():
    """The issue's case, by hand. One scale for the gradient, set by the huge rows' 4e4:
    E4M3's is 2^-7 (448 / 4e4 = 0.0112), so every other entry of magnitude <= 2^-3 lands at or
    below 2^-10, half of E4M3's smallest subnormal 2^-9, and becomes zero: of standard normal
    entries, P(|z| <= 1/8) = erf(1/(8 sqrt 2)) = 9.95 %. Below 4 every step is 2^-9 / 2^-7 = 1/4,
    so E4M3's error is uniform in +-1/8: relative RMS 1/(8 sqrt 3) = 7.2 %. E5M2's scale is 1
    (57344 / 4e4 = 1.43), its smallest subnormal 2^-16: only entries <= 2^-17 flush, and its
    relative error is at most half its 2-bit mantissa step, 2^-3. Then grad x = grad_y @ W through
    fp8.py's tensor-wise linear: closer to the exact product than with the gradient in E4M3."""
    import fp8

    grad = gradient_with_eight_huge_rows()
    others = grad[OTHER_ROWS].double()
    for dtype, threshold in ((E4M3, 2.0**-3), (E5M2, 2.0**-17)):
        values, inverse = fp8.quantize(grad, 0, False, dtype)
        assert values.dtype == dtype and inverse.item() == {E4M3: 2.0**7, E5M2: 1.0}[dtype]
        flushed = values[OTHER_ROWS].float() == 0
        assert torch.equal(flushed, others.abs() <= threshold), dtype
    e4m3, e5m2 = (
        fake_quantized(grad.flatten(), dtype).view(grad.shape)[OTHER_ROWS] for dtype in (E4M3, E5M2)
    )
    flushed_share = (e4m3 == 0).double().mean().item()
    expected_share = math.erf(1 / (8 * math.sqrt(2)))
    assert abs(flushed_share - expected_share) < 0.006, flushed_share  # 5 sigma of 65,408 entries
    assert (e5m2 == 0).double().mean().item() < 1e-4
    assert abs(relative_error(e4m3, others) - 1 / (8 * math.sqrt(3))) < 0.003
    assert relative_error(e5m2, others) < relative_error(e4m3, others)
    assert ((e5m2 - others).abs() <= 2.0**-3 * others.abs() + 2.0**-17).all()

    x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
    x.requires_grad_()
    fp8_linear(x, w, "tensorwise").backward(grad)
    exact = plain_matmul(grad, w.detach())[OTHER_ROWS]
    with_e4m3 = reference_matmul(grad, w.detach(), False)[OTHER_ROWS]
    assert relative_error(x.grad[OTHER_ROWS], exact) < relative_error(with_e4m3, exact)


def test_scales_are_powers_of_two_and_the_cast_is_all_the_rounding():
    """Values already on E4M3's grid at a power-of-two scale come back exactly."""
    grid = torch.tensor([[448.0, -0.5, 0.015625, 3.0] * 4]) * 2.0**-30  # [1, 16]
    eye = torch.eye(16)
    assert torch.equal(fp8_matmul(grid, eye, "rowwise", FORWARD), grid)


def test_a_nan_or_an_infinity_reaches_the_output():
    """No scale hides a non-finite value: the trainer's checks see it (tests/test_train.py names
    them)."""
    for bad in (float("nan"), float("inf")):
        x = torch.randn(16, 16)
        x[0, 0] = bad
        y = fp8_matmul(x, torch.randn(16, 16), "rowwise", FORWARD)
        assert not torch.isfinite(y[0]).all() and torch.isfinite(y[1:]).all(), bad


# ================================================================== which maps, and what is refused


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fp8_targets_the_projections_mlps_and_experts_only(family):
    model = build(tiny_config(family))
    targets = apply_fp8(model, "rowwise")
    assert targets == list(fp8_targets(model))
    leaves = {name.rpartition(".")[2] for name in targets}
    assert {"o_proj", "gate_proj", "up_proj", "down_proj", "experts"} <= leaves
    for name in targets:  # never an FP32 unit, the head, a norm or the frozen indexer
        assert not any(
            part in name for part in ("router", "sinks", "lm_head", "norm", "indexer")
        ), name
    assert not any("indexer" in name for name in targets)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.swiglu.keywords["mm"].func is fp8_grouped_mm for m in experts)


def scales_of_each_fp8_call(monkeypatch) -> dict[str, list[list[tuple]]]:
    """Counting wrappers on fp8.py's quantise-then-GEMM functions (the dense matmul, the experts'
    grouped GEMM and its weight gradient) and on rowwise_gw_hp's unquantised weight gradients: for
    each call of each, (the shape of the inverse scale, the FP8 format) of each operand it
    quantised; () is one scale for the tensor. The weight gradient's own per-(group, column)
    scales are recorded by quantize_per_group_column, its tensor-wise ones by the quantize it
    calls."""
    import fp8

    calls = {
        "scaled_matmul": [],
        "grouped_scaled_mm": [],
        "grouped_weight_grad": [],
        "weight_grad_high_precision": [],
        "grouped_weight_grad_high_precision": [],
    }
    current: list[list] = [[]]

    def recording(name):
        body = getattr(fp8, name)

        def run(*args, **kwargs):
            current[0] = []
            calls[name].append(current[0])
            return body(*args, **kwargs)

        monkeypatch.setattr(fp8, name, run)

    for name in calls:
        recording(name)
    quantize, per_group_column = fp8.quantize, fp8.quantize_per_group_column

    def recorded_quantize(*args, **kwargs):
        values, inverse = quantize(*args, **kwargs)
        current[0].append((tuple(inverse.shape), values.dtype))
        return values, inverse

    def recorded_per_group_column(*args, **kwargs):
        before = len(current[0])
        values, inverse = per_group_column(*args, **kwargs)
        if len(current[0]) == before:  # its own scales, not quantize's
            current[0].append((tuple(inverse.shape), values.dtype))
        return values, inverse

    monkeypatch.setattr(fp8, "quantize", recorded_quantize)
    monkeypatch.setattr(fp8, "quantize_per_group_column", recorded_per_group_column)
    return calls


@only("flint")
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_reaches_every_projection_mlp_and_expert_op(recipe, monkeypatch):
    """[parallel] fp8 through parallelize, one forward and backward: every FP8 op call quantises
    with the recipe's scales, one per tensor (tensorwise) or one per row, column or (group, column)
    (rowwise, rowwise_gw_hp), in E4M3 but for tensorwise's dense output gradients, in E5M2; and the
    ops ran as often as the targets ask: a linear once forward, twice backward (its input's and
    its weight's gradients); an expert group's two grouped GEMMs once each forward, and each twice
    backward (its input's gradient in the grouped GEMM, its weight's in the weight-gradient op).
    rowwise_gw_hp's weight gradients run the unquantised ops instead of the FP8 ones."""
    from helpers import parallel_block_model

    calls = scales_of_each_fp8_call(monkeypatch)
    in_process_group(parallel_step, "flint", {"fp8": recipe}, False)
    model = parallel_block_model("flint")
    linears = sum(isinstance(m, torch.nn.Linear) for m in fp8_targets(model).values())
    expert_groups = sum(isinstance(m, GroupedExperts) for m in model.modules())
    # projections, the dense MLP; the MoE block's experts
    assert linears >= 8 and expert_groups == 1
    counts = {name: len(each) for name, each in calls.items()}
    high_precision = recipe == "rowwise_gw_hp"  # the weight gradients: which op, not how many
    fp8_grads, plain_grads = (0, 1) if high_precision else (1, 0)  # weight gradients per map
    assert counts == {
        "scaled_matmul": (2 + fp8_grads) * linears,
        "grouped_scaled_mm": 4 * expert_groups,
        "grouped_weight_grad": fp8_grads * 2 * expert_groups,
        "weight_grad_high_precision": plain_grads * linears,
        "grouped_weight_grad_high_precision": plain_grads * 2 * expert_groups,
    }, counts
    for name, each in calls.items():
        quantised = 0 if "high_precision" in name else 2  # operands
        for scales in each:
            assert len(scales) == quantised, (name, scales)
            one_per_tensor = [shape == () for shape, _ in scales]
            tensorwise = [recipe == "tensorwise"] * quantised
            assert one_per_tensor == tensorwise, f"{recipe}: {name} {scales}"
    formats = Counter(tuple(dtype for _, dtype in scales) for scales in calls["scaled_matmul"])
    gradient = E5M2 if recipe == "tensorwise" else E4M3
    forward, grad_x, grad_w = (E4M3, E4M3), (gradient, E4M3), (E4M3, gradient)  # gradient's place
    assert formats == Counter([forward, grad_x] * linears + [grad_w] * fp8_grads * linears), formats
    grouped_formats = {
        dtype
        for name in ("grouped_scaled_mm", "grouped_weight_grad")
        for scales in calls[name]
        for _, dtype in scales
    }
    assert grouped_formats == {E4M3}, grouped_formats


@pytest.mark.parametrize(
    "override, pattern",
    [
        (
            "--parallel.fp8=fp16",
            r"fp8 must be one of \['none', 'rowwise', 'tensorwise', 'rowwise_gw_hp'\], got 'fp16'",
        ),
        ("--model.hidden_size=120", r"multiple of 16 .*q_proj has widths 120"),
        ("--data.seq_len=62", r"tokens of each micro-batch .* = \d+\) to be a multiple of 16"),
        ("--model.capacity_factor=1.25", r"capacity_factor = 1.25; use 'grouped', dropless"),
    ],
)
def test_bad_fp8_settings_stop_with_one_line(tmp_path, override, pattern):
    from train import main

    args = fp8_debug_args(tmp_path, override)
    stops_with_one_line(lambda: main(args), ConfigError, "parallel.fp8", pattern)


@pytest.mark.parametrize(
    "accepted, refused",
    [
        (
            ["--training.batch_size=2", "--data.seq_len=8"],
            ["--training.batch_size=1", "--data.seq_len=8"],
        ),
        (["--model.hidden_size=128"], ["--model.hidden_size=120"]),
    ],
)
def test_fp8_shapes_on_16_value_boundaries_are_accepted(tmp_path, accepted, refused):
    """The accepted boundary beside a refusal: 16 tokens per micro-batch (8 refused); a hidden size
    of 128, a multiple of 16 (120 refused)."""
    from config import load_config

    args = fp8_debug_args(tmp_path)
    path = args[args.index("--config") + 1]
    overrides = [arg for arg in args if arg not in ("--config", path)]
    assert load_config(path, [*overrides, *accepted]).parallel.fp8 == "rowwise"
    with pytest.raises(ConfigError, match=r"--parallel.fp8: \[parallel\].fp8 needs"):
        load_config(path, [*overrides, *refused])


def test_a_gpu_without_fp8_tensor_cores_is_refused_before_the_process_group(tmp_path, monkeypatch):
    import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA A100")
    monkeypatch.setattr(
        train, "init_distributed", lambda *a, **k: pytest.fail("the process group started")
    )
    args = fp8_debug_args(tmp_path)
    stops_with_one_line(
        lambda: train.main(args),
        ConfigError,
        "parallel.fp8",
        r"NVIDIA A100 has "
        r"8\.0",
    )


# =============================================================== compiled, and on fake CUDA tensors


@pytest.mark.slow
@only("flint")
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
@pytest.mark.parametrize("layer", ["0", "2"])
def test_fp8_blocks_compile_to_one_graph(layer, recipe, one_thread):
    """A dense and an MoE block (its experts' groups padded, as on CUDA), fullgraph=True: the FP8
    GEMMs are opaque custom ops with fake functions, the quantisation traced (rowwise_gw_hp's
    weight gradients a traced matmul and moe's grouped custom op); values and gradients are the
    eager FP8 block's."""
    model = build(tiny_config("flint", num_hidden_layers=4))
    apply_fp8(model, recipe)
    model.layers["2"].mlp.experts.group_align = 16
    block = model.layers[layer]
    inputs = block_inputs(model.config)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    (out, grads), (out_c, grads_c) = (
        values_and_grads(block, *inputs),
        values_and_grads(compiled, *inputs),
    )
    assert_close_to_scale(out_c, out, rtol=1e-5, what="output")
    for i, (g, g_c) in enumerate(zip(grads, grads_c)):
        assert_close_to_scale(g_c, g, rtol=1e-4, what=f"gradient {i}")


@pytest.mark.slow
def test_the_gemm_ops_pass_opcheck():
    """The opaque FP8 GEMMs' fake functions and registrations as torch.library checks them, on
    operands quantised and laid out as fp8.py passes them (rowwise and tensorwise scales). Not
    test_schema: it compares the FP8 inputs with ops that FP8 has no CPU kernel for."""
    import fp8

    opcheck = partial(
        torch.library.opcheck,
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 16, generator=g), torch.randn(16, 48, generator=g)
    experts, grad = torch.randn(3, 16, 48, generator=g), torch.randn(32, 48, generator=g)
    ends = torch.tensor([16, 16, 32], dtype=torch.int32)
    for rowwise in (True, False):
        x8, x_inverse = fp8.quantize(x, 1, rowwise)
        w8, w_inverse = fp8.quantize(w, 0, rowwise)
        opcheck(
            fp8.scaled_mm_kernel, (x8, fp8.column_major(w8), x_inverse, w_inverse, torch.float32)
        )
    x8, x_inverse = fp8.quantize(x, 1, True)
    e8, e_inverse = fp8.quantize(experts, 1, True)
    opcheck(
        fp8.scaled_grouped_mm_kernel,
        (x8, fp8.column_major(e8), ends, x_inverse.view(32), e_inverse.view(3, 48), torch.float32),
    )
    x8, x_inverse = fp8.quantize_per_group_column(x, ends, True)
    g8, g_inverse = fp8.quantize_per_group_column(grad, ends, True)
    opcheck(
        fp8.scaled_grouped_weight_grad_kernel,
        (x8.T.contiguous(), fp8.column_major(g8), ends, x_inverse, g_inverse, torch.float32),
    )


def cuda_kernels_on_fake_tensors(width: int, recipe: str = "rowwise") -> torch.Tensor:
    """A BF16 linear on 64 tokens and a grouped GEMM on a padded expert buffer of 72 rows (groups of
    16 ending at 64, then rows in no group), forward and backward, on fake tensors with CUDA's
    kernels chosen."""
    with FakeTensorMode(), targeting("cuda"):
        x = torch.empty(64, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(32, width, dtype=torch.bfloat16, requires_grad=True)
        rows = torch.empty(72, width, dtype=torch.bfloat16, requires_grad=True)
        experts = torch.empty(4, width, 32, dtype=torch.bfloat16, requires_grad=True)
        ends = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
        y, y_rows = fp8_linear(x, w, recipe), fp8_grouped_mm(rows, experts, ends, recipe)
        (y.sum() + y_rows.sum()).backward()
        return y, y_rows, w.grad, experts.grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_kernels_check_their_shapes_on_fake_tensors(recipe):
    """What a rehearsal runs: torch._scaled_mm and torch._scaled_grouped_mm's own meta checks (for
    tensorwise, _scaled_mm's on an E5M2 gradient beside an E4M3 operand)."""
    y, y_rows, grad_w, grad_experts = cuda_kernels_on_fake_tensors(32, recipe)
    assert (y.dtype, y_rows.shape, grad_w.shape, grad_experts.shape) == (
        torch.bfloat16,
        (72, 32),
        (32, 32),
        (4, 32, 32),
    )
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        cuda_kernels_on_fake_tensors(24, recipe)  # the 24-wide rows: not on 16-byte boundaries


# ====================================================================== layouts against one process


def fp8_step(layout: dict):
    return parallel_step("flint", {"fp8": "rowwise", **layout}, False)[:2]


def check_layout_matches_one_process(layout: dict, one_process) -> None:
    """Rowwise activations are quantised row by row, so the loss is one process's; the weight
    gradients' scales span each rank's tokens (one process: all of them), so those agree to FP8's
    rounding."""
    loss, grads = fp8_step(layout)
    reference_loss, reference_grads = one_process
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    assert grads and set(grads) <= set(reference_grads)  # a pipeline stage: its own layers' only
    for name, grad in grads.items():
        assert_close_to_scale(grad, reference_grads[name], rtol=0.1, what=name)


@pytest.mark.slow
@only("flint")
def test_fsdp_and_expert_parallel_match_one_process():
    one_process = in_process_group(fp8_step, {})
    without_fp8 = in_process_group(parallel_step, "flint", {}, False)[0]
    assert abs(one_process[0] - without_fp8) > 1e-5, "FP8 changed nothing: it did not run"
    spawn(2, check_layout_matches_one_process, {"dp_shard": 2}, one_process)
    spawn(2, check_layout_matches_one_process, {"ep": 2}, one_process)


@slow
@only("flint")
@pytest.mark.parametrize(
    "layout", [{"pp": 2}, {"cp": 2}, {"dp_shard": 2, "activation_checkpointing": "full"}]
)
def test_pipeline_context_parallel_and_checkpointing_match_one_process(layout):
    spawn(2, check_layout_matches_one_process, layout, in_process_group(fp8_step, {}))


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SLOW)
def test_the_rehearsal_runs_the_cuda_fp8_kernels_on_fake_tensors(family, tmp_path, monkeypatch):
    """`train.py --dry-run` with fp8: every dense FP8 matmul and every grouped one goes through the
    CUDA kernels (their meta functions, on fake tensors), forward and backward."""
    import train
    from helpers import debug_configs

    calls = {"_scaled_mm": 0, "_scaled_grouped_mm": 0}
    for name in calls:
        kernel = getattr(torch, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    widths = FP8_WIDTHS.get(family, [])
    with pytest.raises(SystemExit) as stop:
        train.main(
            [
                "--config",
                str(debug_configs()[family]),
                "--dry-run",
                "--world-size=2",
                "--parallel.fp8=rowwise",
                "--training.steps=1",
                f"--checkpoint.dir={tmp_path}/ck",
                f"--logging.jsonl={tmp_path}/m.jsonl",
                *widths,
            ]
        )
    assert stop.value.code == 0
    assert calls["_scaled_mm"] > 0 and calls["_scaled_grouped_mm"] > 0, calls


def test_a_nan_in_fp8_stops_the_run_naming_fp8(tmp_path, monkeypatch):
    """A NaN scale (as an infinite amax makes one) reaches the loss; the trainer's check stops the
    run at that step and names parallel.fp8."""
    import fp8
    import train

    monkeypatch.setattr(
        fp8, "power_of_two_scale", lambda amax, *_: torch.full_like(amax.float(), float("nan"))
    )
    with pytest.raises(
        train.TrainingError,
        match=r"step 1: the training loss is nan .*diverged.*"
        r"parallel.fp8 = 'rowwise', command line "
        r"--parallel.fp8",
    ):
        train.main(fp8_debug_args(tmp_path, "--training.steps=2"))


# ======================================================================== the planner and memory.py


@pytest.mark.slow
@only("flint")
def test_the_planner_prices_fp8_matmuls_at_the_fp8_peak_and_traces_their_quantisation():
    """The same FLOPs traced with fp8, every BF16 matmul FLOP outside the attention core now in an
    FP8 GEMM op, on FP8 operands, priced at the data sheet's FP8 peak; the quantisation (amax,
    cast) is in the traced graph beside it, as plain ops the planner's fusion model sees."""
    from tools.op_trace import trace_step
    from tools.planner import GPUS, Pricing

    config = tiny_config("flint")
    plain = trace_step(config, 1, 64, torch.bfloat16, "none")
    costs = trace_step(config, 1, 64, torch.bfloat16, "none", fp8="rowwise")
    assert sum(c.flops for c in costs) == sum(c.flops for c in plain)
    fp8_ops = [c for c in costs if c.op.startswith("flint.fp8")]
    assert {c.op for c in fp8_ops} == {
        "flint.fp8_matmul",
        "flint.fp8_grouped_mm",
        "flint.fp8_grouped_mm_weight_grad",
    }
    assert {c.dtype for c in fp8_ops} == {"float8_e4m3fn"}
    assert not any(
        c.flops
        for c in costs
        if c.dtype == "bfloat16" and not c.attention_core and c not in fp8_ops
    )
    pricing = Pricing(GPUS["H100"])
    assert (
        pricing.matmul_peak(fp8_ops[0]) == 1979e12
        and Pricing(GPUS["B200"]).matmul_peak(fp8_ops[0]) == 4500e12
    )
    q_proj = {c.op for c in costs if c.module.endswith("q_proj")}
    assert {"amax", "_to_copy", "flint.fp8_matmul"} <= q_proj, q_proj


@only("flint")
def test_the_planner_prices_rowwise_gw_hp_weight_gradients_at_the_bf16_peak():
    """By hand, the tiny Flint (hidden 64, 4 layers, 64 tokens): the FP8 maps' forward FLOPs are
    attention 4 layers x 2 x 64 x 64 x (64 + 32 + 32 + 64) = 6,291,456, dense MLPs 2 x 2 x 64 x 64 x
    128 x 3 = 6,291,456, MoE layers 2 x (experts 2 x 128 rows x 64 x (64 + 32) + shared 3 x 2 x 64 x
    64 x 64) = 6,291,456: 18,874,368. With rowwise_gw_hp the backward's FP8 ops are the input
    gradients only, as many FLOPs, and the weight gradients as many again in BF16 ops (aten.mm,
    moe's grouped one), which the planner prices at the BF16 peak."""
    from tools.op_trace import trace_step
    from tools.planner import GPUS, Pricing

    config = tiny_config("flint")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 4, 128)
    costs = trace_step(config, 1, 64, torch.bfloat16, "none", fp8="rowwise_gw_hp")
    fp8_flops = {
        phase: sum(c.flops for c in costs if c.phase == phase and c.op.startswith("flint.fp8"))
        for phase in ("forward", "backward")
    }
    weight_grads = [
        c
        for c in costs
        if c.phase == "backward"
        and c.dtype == "bfloat16"
        and c.flops
        and not c.attention_core
        and not c.op.startswith("flint.fp8")
    ]
    assert fp8_flops == {"forward": 18_874_368, "backward": 18_874_368}
    assert {c.op for c in weight_grads} == {"mm", "flint.grouped_mm_weight_grad"}
    assert sum(c.flops for c in weight_grads) == 18_874_368
    pricing = Pricing(GPUS["H100"])
    assert all(pricing.matmul_peak(c) == 989.4e12 for c in weight_grads)  # H100's BF16 peak


def test_memory_counts_the_fp8_copies():
    from parallel import ParallelConfig
    from tools.memory import memory_per_gpu

    config = tiny_config(DEFAULT_FAMILY)
    plain, fp8 = (
        memory_per_gpu(config, ParallelConfig(dp_shard=1, fp8=recipe), 64, 1)
        for recipe in ("none", "rowwise")
    )
    assert fp8["activations"] > plain["activations"] and fp8["params"] == plain["params"]


# ====================================================== compiled through parallelize: the pins hold


def check_compiled_matches_eager(
    layout: dict, expected_graphs: dict, rtol: float, atol: float
) -> None:
    """The compiled step of `layout` against the eager one: loss and gradients within rtol/atol, the
    graphs each block ran as expected, and every graph break at an FSDP hook."""
    eager_loss, eager_grads = parallel_step("flint", layout, False)[:2]
    loss, grads, graphs, _, breaks = parallel_step("flint", layout, True)
    torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=atol)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=rtol, atol=atol, msg=lambda m: f"gradient {name}: {m}"
        )
    assert graphs == expected_graphs, f"graphs per block {graphs}, expected {expected_graphs}"
    assert all("_fsdp_common.py" in reason for reason in breaks), list(breaks)


@pytest.mark.slow
@only("flint")
@pytest.mark.parametrize(
    "layout, tolerance",
    [
        ({"activation_checkpointing": "selective"}, (1e-5, 1e-6)),
        ({"param_dtype": "bfloat16", "activation_checkpointing": "full"}, (1e-2, 1e-3)),
    ],
)
def test_fp8_blocks_compiled_through_parallelize_keep_the_graph_pins(
    layout, tolerance, monkeypatch
):
    """FP32 in a group of one and a BF16 FSDP policy, both whole (fullgraph=True, one graph per
    block): with fp8 the compiled step equals the eager one and runs the same graphs as without."""
    from helpers import counting_backend, one_graph_per_block

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=counting_backend))
    expected = one_graph_per_block("flint")
    in_process_group(
        check_compiled_matches_eager, {**layout, "fp8": "rowwise"}, expected, *tolerance
    )


def test_the_grouped_fp8_kernel_is_chosen_on_hopper_and_in_rehearsals_only(monkeypatch):
    """torch 2.13 builds _scaled_grouped_mm's row-wise FP8 for SM90 only: other GPUs loop over
    experts."""
    from fp8 import grouped_fp8_kernel

    assert not grouped_fp8_kernel(torch.device("cpu"))
    with targeting("cuda"):
        # a rehearsal's fake tensors: Hopper's kernel checked
        assert grouped_fp8_kernel(torch.device("cpu"))
        for capability, grouped in [((9, 0), True), ((8, 9), False), ((10, 0), False)]:
            monkeypatch.setattr(
                torch.cuda, "get_device_capability", lambda device=None, c=capability: c
            )
            assert grouped_fp8_kernel(torch.device("cuda")) == grouped, capability


# ======================================================================== training through train.py


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SLOW)
def test_fp8_trains_through_train_py_close_to_the_run_without(family, tmp_path):
    """The debug config's 20 steps with fp8 = rowwise against the same run without: the validation
    loss within 2 % (configs/smoke.toml's 300 steps in BENCHMARKS.md, FP8)."""
    from helpers import run_debug

    widths = FP8_WIDTHS.get(family, [])
    losses = {
        recipe: run_debug(
            tmp_path / recipe,
            f"--parallel.fp8={recipe}",
            "--training.sample_tokens=0",
            *widths,
            family=family,
        )["val_loss"]
        for recipe in ("none", "rowwise")
    }
    assert losses["rowwise"] != losses["none"], "FP8 changed nothing: it did not run"
    assert abs(losses["rowwise"] - losses["none"]) <= 0.02 * losses["none"], losses
