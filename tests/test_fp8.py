"""FP8 matmuls (fp8.py) against a plain reference written here: each operand quantised by the
formula, slice by slice in Python loops, dequantised, multiplied in FP64. Every op's output and both
gradients, dense and grouped, rowwise and tensorwise, on rows of zeros, huge and tiny values and an
expert with no rows; what the config refuses; compiled blocks; the CUDA kernels' checks on fake
tensors (what a rehearsal runs); FSDP and expert parallel against one process."""

import math
from functools import partial

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from config import ConfigError
from devices import targeting
from fp8 import apply_fp8, fp8_grouped_mm, fp8_linear, fp8_matmul, fp8_targets
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

E4M3 = torch.float8_e4m3fn
RECIPES = ["rowwise", "tensorwise"]
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


def reference_scale(amax: float) -> float:
    """The largest power of two s with amax * s <= 448 (amax floored at 1e-12), 448 / amax in
    FP32."""
    ratio = float(torch.tensor(448.0) / torch.tensor(max(amax, 1e-12), dtype=torch.float32))
    mantissa, exponent = math.frexp(ratio)  # ratio = mantissa * 2 ** exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1)


def fake_quantized(values: torch.Tensor) -> torch.Tensor:
    """One scaling slice: quantised to E4M3 with its own scale, then multiplied back, in FP64."""
    scale = reference_scale(values.abs().max().item())
    return (values.double() * scale).clamp(-448, 448).to(E4M3).double() / scale


def quantized_along(t: torch.Tensor, reduce_dim: int, rowwise: bool) -> torch.Tensor:
    """t [A, B] with a scale per slice along reduce_dim (rowwise) or one for the tensor,
    dequantised."""
    if not rowwise:
        return fake_quantized(t.flatten()).view(t.shape)
    out = torch.empty(t.shape, dtype=torch.float64)
    for i in range(t.shape[1 - reduce_dim]):
        if reduce_dim == 1:
            out[i, :] = fake_quantized(t[i, :])
        else:
            out[:, i] = fake_quantized(t[:, i])
    return out


def reference_matmul(a: torch.Tensor, b: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """a [M, K] @ b [K, N], each operand scaled along K."""
    return quantized_along(a, 1, rowwise) @ quantized_along(b, 0, rowwise)


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


def reference_grouped_weight_grad(x, grad, ends, rowwise):
    """Per group g: x_g^T @ grad_g, both scaled per column within the group's rows (or per
    tensor)."""
    out = torch.zeros(len(ends), x.shape[1], grad.shape[1], dtype=torch.float64)
    whole_x, whole_grad = quantized_along(x, 0, False), quantized_along(grad, 0, False)
    for g, (start, end) in enumerate(zip([0, *ends], ends)):
        if end > start:
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
    rowwise = recipe == "rowwise"
    x = hard_values(24, 32, seed=0).requires_grad_()
    w = hard_values(16, 32, seed=1).requires_grad_()
    grad = hard_values(24, 16, seed=2)
    y = fp8_linear(x, w, rowwise)
    y.backward(grad)
    matmul = partial(reference_matmul, rowwise=rowwise)
    assert_exact(y, matmul, x.detach(), w.detach().T, what=f"{recipe} y")
    assert_exact(x.grad, matmul, grad, w.detach(), what=f"{recipe} grad x (reduces N)")
    assert_exact(w.grad, matmul, grad.T, x.detach(), what=f"{recipe} grad W (reduces the tokens)")
    assert y[1].abs().max() == 0 and torch.isfinite(y).all(), (
        "a row of zeros gives zeros, nothing overflows"
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_output_and_both_gradients_match_the_reference(recipe):
    """Groups of 8, 0 (an expert with no rows), 13 and 11 rows."""
    rowwise = recipe == "rowwise"
    ends = [8, 8, 21, 32]
    x = hard_values(32, 16, seed=3).requires_grad_()
    # [G, K, N]
    w = torch.stack([hard_values(16, 48, seed=4 + g) for g in range(len(ends))]).requires_grad_()
    grad = hard_values(32, 48, seed=9)
    y = fp8_grouped_mm(x, w, torch.tensor(ends, dtype=torch.int32), rowwise)
    y.backward(grad)
    grouped = partial(reference_grouped, ends=ends, rowwise=rowwise)
    assert_exact(y, grouped, x.detach(), w.detach(), what=f"{recipe} y")
    assert_exact(x.grad, grouped, grad, w.detach().transpose(1, 2), what=f"{recipe} grad x")
    assert_exact(
        w.grad,
        partial(reference_grouped_weight_grad, ends=ends, rowwise=rowwise),
        x.detach(),
        grad,
        what=f"{recipe} grad w",
    )
    assert w.grad[1].abs().max() == 0, "the expert with no rows gets no gradient"


def test_scales_are_powers_of_two_and_the_cast_is_all_the_rounding():
    """Values already on E4M3's grid at a power-of-two scale come back exactly."""
    grid = torch.tensor([[448.0, -0.5, 0.015625, 3.0] * 4]) * 2.0**-30  # [1, 16]
    eye = torch.eye(16)
    assert torch.equal(fp8_matmul(grid, eye, True), grid)


def test_a_nan_or_an_infinity_reaches_the_output():
    """No scale hides a non-finite value: the trainer's checks see it (tests/test_train.py names
    them)."""
    for bad in (float("nan"), float("inf")):
        x = torch.randn(16, 16)
        x[0, 0] = bad
        y = fp8_matmul(x, torch.randn(16, 16), True)
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


def scales_of_each_fp8_call(monkeypatch) -> dict[str, list[list[tuple[int, ...]]]]:
    """Counting wrappers on the bodies of the FP8 ops (the dense matmul, the experts' grouped GEMM
    and its weight gradient): for each call of each, the shapes of the inverse scales its operands
    were quantised with; () is one scale for the tensor. The weight gradient's own per-(group,
    column) scales are recorded by quantize_per_group_column, its tensor-wise ones by the quantize
    it calls."""
    import fp8

    calls = {"scaled_matmul": [], "grouped_loop": [], "weight_grad_loop": []}
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
        current[0].append(tuple(inverse.shape))
        return values, inverse

    def recorded_per_group_column(*args, **kwargs):
        before = len(current[0])
        values, inverse = per_group_column(*args, **kwargs)
        if len(current[0]) == before:  # its own scales, not quantize's
            current[0].append(tuple(inverse.shape))
        return values, inverse

    monkeypatch.setattr(fp8, "quantize", recorded_quantize)
    monkeypatch.setattr(fp8, "quantize_per_group_column", recorded_per_group_column)
    return calls


@only("flint")
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_reaches_every_projection_mlp_and_expert_op(recipe, monkeypatch):
    """[parallel] fp8 through parallelize, one forward and backward: every FP8 op call quantises
    with the recipe's scales, one per tensor (tensorwise) or one per row, column or (group, column)
    (rowwise); and the ops ran as often as the targets ask: a linear once forward, twice backward
    (its input's and its weight's gradients); an expert group's two grouped GEMMs once each forward,
    and each twice backward (its input's gradient in the grouped GEMM, its weight's in the
    weight-gradient op)."""
    from helpers import parallel_block_model

    calls = scales_of_each_fp8_call(monkeypatch)
    in_process_group(parallel_step, "flint", {"fp8": recipe}, False)
    model = parallel_block_model("flint")
    linears = sum(isinstance(m, torch.nn.Linear) for m in fp8_targets(model).values())
    expert_groups = sum(isinstance(m, GroupedExperts) for m in model.modules())
    # projections, the dense MLP; the MoE block's experts
    assert linears >= 8 and expert_groups == 1
    counts = {name: len(each) for name, each in calls.items()}
    assert counts == {
        "scaled_matmul": 3 * linears,
        "grouped_loop": 4 * expert_groups,
        "weight_grad_loop": 2 * expert_groups,
    }, counts
    for name, each in calls.items():
        for scales in each:
            assert len(scales) == 2, (name, scales)  # both operands quantised
            one_per_tensor = [shape == () for shape in scales]
            assert one_per_tensor == [recipe == "tensorwise"] * 2, f"{recipe}: {name} {scales}"


@pytest.mark.parametrize(
    "override, pattern",
    [
        (
            "--parallel.fp8=fp16",
            r"fp8 must be one of \['none', 'rowwise', 'tensorwise'\], got 'fp16'",
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


@only("flint")
@pytest.mark.parametrize("layer", ["0", "2"])
def test_fp8_blocks_compile_to_one_graph(layer, one_thread):
    """A dense and an MoE block (its experts' groups padded, as on CUDA), fullgraph=True: the FP8
    ops are opaque custom ops with fake functions; values and gradients are the eager FP8
    block's."""
    model = build(tiny_config("flint", num_hidden_layers=4))
    apply_fp8(model, "rowwise")
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


def test_ops_pass_opcheck():
    """Fake functions, autograd registration and schemas as torch.library checks them."""
    x, w = torch.randn(32, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    torch.library.opcheck(fp8_matmul, (x, w, True))
    ends = torch.tensor([16, 16, 32], dtype=torch.int32)
    torch.library.opcheck(
        fp8_grouped_mm, (x, torch.randn(3, 16, 32, requires_grad=True), ends, False)
    )


def cuda_kernels_on_fake_tensors(width: int) -> torch.Tensor:
    """A BF16 linear on 64 tokens and a grouped GEMM on a padded expert buffer of 72 rows (groups of
    16 ending at 64, then rows in no group), forward and backward, on fake tensors with CUDA's
    kernels chosen."""
    with FakeTensorMode(), targeting("cuda"):
        x = torch.empty(64, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(32, width, dtype=torch.bfloat16, requires_grad=True)
        rows = torch.empty(72, width, dtype=torch.bfloat16, requires_grad=True)
        experts = torch.empty(4, width, 32, dtype=torch.bfloat16, requires_grad=True)
        ends = torch.tensor([16, 16, 48, 64], dtype=torch.int32)
        y, y_rows = fp8_linear(x, w, True), fp8_grouped_mm(rows, experts, ends, True)
        (y.sum() + y_rows.sum()).backward()
        return y, y_rows, w.grad, experts.grad


def test_cuda_kernels_check_their_shapes_on_fake_tensors():
    """What a rehearsal runs: torch._scaled_mm and torch._scaled_grouped_mm's own meta checks."""
    y, y_rows, grad_w, grad_experts = cuda_kernels_on_fake_tensors(32)
    assert (y.dtype, y_rows.shape, grad_w.shape, grad_experts.shape) == (
        torch.bfloat16,
        (72, 32),
        (32, 32),
        (4, 32, 32),
    )
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        cuda_kernels_on_fake_tensors(24)  # the 24-wide rows: not on 16-byte boundaries


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
        fp8, "power_of_two_scale", lambda amax: torch.full_like(amax.float(), float("nan"))
    )
    with pytest.raises(
        train.TrainingError,
        match=r"step 1: the training loss is nan .*diverged.*"
        r"parallel.fp8 = 'rowwise', command line "
        r"--parallel.fp8",
    ):
        train.main(fp8_debug_args(tmp_path, "--training.steps=2"))


# ======================================================================== the planner and memory.py


@only("flint")
def test_the_planner_prices_fp8_matmuls_at_the_fp8_peak_and_counts_their_quantisation():
    """The same FLOPs traced with fp8, every BF16 matmul FLOP outside the attention core now in an
    FP8 op, priced at the data sheet's FP8 peak; each FP8 op's operands read twice and written once
    in FP8."""
    from tools.op_trace import trace_step
    from tools.planner import GPUS, Pricing, fp8_quantisation_bytes

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
    q_proj = next(c for c in fp8_ops if c.module.endswith("q_proj"))  # x [64, H] @ W^T [H, Hq * D]
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    assert fp8_quantisation_bytes(q_proj, ep=1) == q_proj.calls * (64 * h + h * q) * 5
    assert not any(fp8_quantisation_bytes(c, ep=1) for c in plain)


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


@only("flint")
@pytest.mark.parametrize(
    "layout, bf16, tolerance",
    [
        ({"activation_checkpointing": "selective"}, False, (1e-5, 1e-6)),
        ({"param_dtype": "bfloat16", "activation_checkpointing": "full"}, True, (1e-2, 1e-3)),
    ],
)
def test_fp8_blocks_compiled_through_parallelize_keep_the_graph_pins(
    layout, bf16, tolerance, monkeypatch
):
    """FP32 in a group of one (fullgraph=True, one graph per block) and a BF16 FSDP policy (the
    graphs pinned in helpers.BF16_GRAPHS, every break at an FSDP hook): with fp8 the compiled step
    equals the eager one and runs the same graphs as without."""
    from helpers import BF16_GRAPHS, counting_backend, parallel_block_model

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=counting_backend))
    expected = (
        BF16_GRAPHS["flint"]
        if bf16
        else {str(i): 1 for i in range(parallel_block_model("flint").config.num_hidden_layers)}
    )
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
