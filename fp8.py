"""FP8 training matmuls: dynamically scaled FP8 operands, FP32 master weights ([parallel] fp8).

Every matmul of a targeted map runs on FP8 operands, forward and both backward: for y = a @ b with
a [M, K] and b [K, N], each operand is scaled along K, the dimension the product reduces, then cast:

    rowwise        a: one scale per row of a [M, 1], b: one per column of b [1, N]; all E4M3
    tensorwise     one scale per operand; E4M3, but a dense map's output gradient in E5M2
    rowwise_gw_hp  rowwise, but the weight gradient (grad_y^T @ x) is not quantised: a plain
                   matmul in the compute dtype (torchao's "rowwise_with_gw_hp")

    scale = 2 ** floor(log2(max / max(amax, 1e-12)))     (max: 448 for E4M3, 57344 for E5M2)
    a8 = clamp(a * scale, -max, max).to(its format)
    y = (a8 @ b8) / (scale_a * scale_b), in FP32

The scales are powers of two, so scaling and unscaling only move exponents: no rounding beyond
the cast to FP8 itself, and the reference of the tests reproduces it exactly. The 1e-12 floor keeps
an all-zero row finite (its FP8 values are zeros whatever the scale); a non-finite amax gives a
zero or infinite scale, so a NaN or an overflow reaches the output and the trainer's divergence
checks name it. Row-wise, gradients are E4M3 too: with a scale per row or column their range
fits E4M3's (E5M2's extra exponent buys nothing the scale does not, and costs a mantissa bit).
Tensor-wise, one scale spans all of a gradient's rows, whose magnitudes differ by orders: a few
rows 10^4x larger set the scale, and E4M3 (smallest subnormal 2^-9, largest value 448) flushes
the others' small entries to zero, where E5M2 (2^-16, 57344) keeps them, as torchao's
tensor-wise recipe does. CUDA's torch._scaled_mm takes one E5M2 operand beside an E4M3 one. The
experts' grouped GEMMs stay E4M3 in every recipe: torch._scaled_grouped_mm takes E4M3 only.

A linear y = x W^T (x [M, K], W [N, K]) is fp8_matmul(x, W^T); its autograd is the same op again:

    grad_x = grad_y @ W       reduces N: grad_y per row, W per column (along its output rows)
    grad_W = grad_y^T @ x     reduces M (the tokens): grad_y and x both per column, along M
                              (rowwise_gw_hp: unquantised, in x's dtype)

The routed experts' grouped GEMM (moe.grouped_mm's x [M, K] rows sorted by expert, w [E, K, N])
scales its rows per row and each expert's weight per output column; its weight gradient, per
expert x_e^T @ grad_e, scales both per column within each expert's rows.

Kernels: on CUDA torch._scaled_mm (dense) and, on Hopper, torch._scaled_grouped_mm (experts:
operands on 16-byte boundaries, which config checks and the experts' 16-row groups give; BF16
output); on the CPU the same quantisation and torch._scaled_mm, expert by expert, as on the GPUs
whose grouped FP8 kernel torch 2.13 does not build (grouped_fp8_kernel). Each matmul is a
torch.library custom op, opaque to the compiler (blocks compile whole, fullgraph=True); its fake
function runs the CUDA kernels on fake tensors whenever kernels are chosen for CUDA
(devices.targeting), so a rehearsal checks their shapes, strides and dtypes."""

from __future__ import annotations

from functools import partial
from types import MethodType

import torch
import torch.nn as nn

from devices import kernel_device_type
from layers import fp32_units, frozen_modules, inside
from moe import GroupedExperts, grouped_swiglu

FP8_RECIPES = ("none", "rowwise", "tensorwise", "rowwise_gw_hp")
HIGH_PRECISION_WEIGHT_GRAD = "rowwise_gw_hp"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # each format's largest finite value
FORWARD = -1  # fp8_matmul's `gradient` when neither operand is an output gradient
AMAX_FLOOR = 1e-12  # an all-zero row's amax: a finite scale, FP8 zeros
ALIGNMENT = 16  # CUDA's FP8 GEMMs: reduced and output dims on 16-byte boundaries, 16 E4M3 values
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


# ============================================================================= quantisation


def power_of_two_scale(amax: torch.Tensor, fp8_max: float = FP8_MAX[E4M3]) -> torch.Tensor:
    """The largest power of two s with amax * s <= fp8_max, in FP32: the exponent bits of
    fp8_max / amax."""
    ratio = fp8_max / amax.float().clamp(min=AMAX_FLOOR)
    # drop the mantissa: round down
    return (ratio.view(torch.int32) & 0x7F800000).view(torch.float32)


def quantize(
    t: torch.Tensor, reduce_dim: int, rowwise: bool, dtype: torch.dtype = E4M3
) -> tuple[torch.Tensor, torch.Tensor]:
    """t -> (FP8 values of `dtype`, the FP32 inverse scale to multiply back): one scale per slice
    along reduce_dim (rowwise; keepdim shape) or one for the tensor (tensorwise; a scalar)."""
    amax = t.abs().amax(dim=reduce_dim, keepdim=True) if rowwise else t.abs().amax()
    scale = power_of_two_scale(amax, FP8_MAX[dtype])
    return to_fp8(t, scale, dtype), scale.reciprocal()


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def group_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """offsets int32 [G] cumulative group ends -> each row's group [rows] (G past the last end)."""
    return torch.searchsorted(
        offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True
    )


def quantize_per_group_column(
    t: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, C] rows in groups -> (FP8 [M, C], inverse scales [G, C]): one scale per column within
    each group's rows (rowwise) or one for the tensor, broadcast to [G, C]. An empty group's scale
    is the floor's, and multiplies nothing."""
    groups = offsets.shape[0]
    if not rowwise:
        values, inverse = quantize(t, 0, rowwise=False)
        return values, inverse.expand(groups, t.shape[1]).contiguous()
    group = group_of_rows(offsets, t.shape[0])  # [M]
    amax = t.new_zeros(groups + 1, t.shape[1], dtype=torch.float32).scatter_reduce_(
        0, group.unsqueeze(1).expand(t.shape), t.abs().float(), "amax"
    )[:groups]  # [G, C]
    scale = power_of_two_scale(amax)
    row_scale = torch.cat([scale, scale.new_ones(1, t.shape[1])])[group]  # [M, C]
    return to_fp8(t, row_scale), scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims column-major, as the FP8 GEMMs take their second
    operand."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


# ============================================================================= dense: y = a @ b


def uses_cuda_kernels(t: torch.Tensor) -> bool:
    return kernel_device_type(t.device) == "cuda"


def operand_formats(recipe: str, gradient: int) -> tuple[torch.dtype, torch.dtype]:
    """The FP8 formats of a dense matmul's operands: E4M3, but tensor-wise the output gradient
    (operand `gradient`: 0 or 1, FORWARD for none) in E5M2, as torchao's tensor-wise recipe keeps
    it. CUDA's torch._scaled_mm takes E4M3 x E5M2 and E5M2 x E4M3 (not E5M2 x E5M2, never asked)."""
    formats = [E4M3, E4M3]
    if recipe == "tensorwise" and gradient != FORWARD:
        formats[gradient] = E5M2
    return formats[0], formats[1]


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, gradient: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] on FP8 operands scaled along K -> [M, N] in a's dtype (BF16 out of CUDA's
    kernel)."""
    rowwise = recipe != "tensorwise"
    a_format, b_format = operand_formats(recipe, gradient)
    a8, a_inverse = quantize(a, 1, rowwise, a_format)  # [M, 1] or []
    b8, b_inverse = quantize(b, 0, rowwise, b_format)  # [1, N] or []
    out_dtype = torch.bfloat16 if uses_cuda_kernels(a) else a.dtype
    y = torch._scaled_mm(
        a8.contiguous(), column_major(b8), scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype
    )
    return y.to(a.dtype)


@torch.library.custom_op("flint::fp8_matmul", mutates_args=())
def fp8_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, gradient: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N]: FP8 operands, each scaled along K (the module docstring);
    `gradient`: which operand is an output gradient (0, 1, or FORWARD), for operand_formats."""
    return scaled_matmul(a, b, recipe, gradient)


@fp8_matmul.register_fake
def _(a, b, recipe, gradient):
    # a rehearsal or a CUDA compile: the kernel's own checks on fake tensors
    if uses_cuda_kernels(a):
        return scaled_matmul(a, b, recipe, gradient)
    return a.new_empty(a.shape[0], b.shape[1])


def weight_grad_high_precision(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """rowwise_gw_hp's weight gradient a^T [K, M] @ grad [M, N], unquantised: the compute dtype."""
    return a.T @ grad


def _matmul_setup(ctx, inputs, output):
    a, b, ctx.recipe, _ = inputs
    ctx.save_for_backward(a, b)


def _matmul_backward(ctx, grad):
    """b is the weight (fp8_linear): its gradient unquantised in rowwise_gw_hp."""
    a, b = ctx.saved_tensors
    grad_a = fp8_matmul(grad, b.T, ctx.recipe, 0) if ctx.needs_input_grad[0] else None  # reduces N
    grad_b = None
    if ctx.needs_input_grad[1]:  # reduces M
        if ctx.recipe == HIGH_PRECISION_WEIGHT_GRAD:
            grad_b = weight_grad_high_precision(a, grad)
        else:
            grad_b = fp8_matmul(a.T, grad, ctx.recipe, 1)
    return grad_a, grad_b, None, None


fp8_matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """F.linear without bias in FP8: x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    y = fp8_matmul(rows, weight.to(x.dtype).T, recipe, FORWARD)  # [M, N]
    return y.view(*x.shape[:-1], weight.shape[0])


# ====================================================================== grouped: the routed experts


def grouped_fp8_kernel(device: torch.device) -> bool:
    """Whether the experts' FP8 GEMMs on `device` run torch._scaled_grouped_mm: kernels chosen for
    CUDA, on a Hopper GPU (torch 2.13 builds its row-wise FP8 grouped GEMM for SM90 only: Ada and
    Blackwell loop over the experts with torch._scaled_mm, as the CPU does) or on the fake CPU
    tensors of a rehearsal, which checks the Hopper kernel's shapes."""
    if kernel_device_type(device) != "cuda":
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


def grouped_cuda(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """x [M, K] @ the groups of w [G, K, N] with torch._scaled_grouped_mm -> [M, N] in BF16."""
    x8, x_inverse = quantize(x, 1, rowwise)  # [M, 1] or []
    w8, w_inverse = quantize(w, 1, rowwise)  # [G, 1, N] or []
    rows, groups, n = x.shape[0], w.shape[0], w.shape[2]
    # the kernel takes contiguous scales: a tensor-wise scalar expanded is not
    x_scales = x_inverse.expand(rows, 1).reshape(rows).contiguous()
    w_scales = w_inverse.expand(groups, 1, n).reshape(groups, n).contiguous()
    return torch._scaled_grouped_mm(
        x8.contiguous(),
        column_major(w8),
        x_scales,
        w_scales,
        offs=offsets,
        out_dtype=torch.bfloat16,
    )


def grouped_loop(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """The same quantisation as grouped_cuda, then torch._scaled_mm expert by expert where there is
    no grouped FP8 kernel (the CPU; GPUs but Hopper: one host sync for the group ends) -> [M, N] in
    x's dtype; rows past the last group stay zero."""
    x8, x_inverse = quantize(x, 1, rowwise)
    w8, w_inverse = quantize(w, 1, rowwise)
    # [M, 1]: the kernel takes contiguous scales
    x_inverse = x_inverse.expand(x.shape[0], 1).contiguous()
    w_inverse = w_inverse.expand(w.shape[0], 1, w.shape[2]).contiguous()  # [G, 1, N]
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = torch._scaled_mm(
                x8[start:end],
                column_major(w8[group]),
                scale_a=x_inverse[start:end],
                scale_b=w_inverse[group],
                out_dtype=x.dtype,
            )
        start = end
    return out


@torch.library.custom_op("flint::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: str
) -> torch.Tensor:
    """x [M, K] rows sorted by group, w [G, K, N], offsets int32 [G] cumulative ends -> [M, N]:
    moe.grouped_mm on E4M3 operands, rows scaled per row, each group's weight per output column
    (tensorwise: each operand as a whole)."""
    rowwise = recipe != "tensorwise"
    if grouped_fp8_kernel(x.device):
        return grouped_cuda(x, w, offsets, rowwise).to(x.dtype)
    return grouped_loop(x.contiguous(), w, offsets, rowwise)


@fp8_grouped_mm.register_fake
def _(x, w, offsets, recipe):
    if grouped_fp8_kernel(x.device):  # a rehearsal or a compile on Hopper: the kernel's checks
        return grouped_cuda(x, w, offsets, recipe != "tensorwise").to(x.dtype)
    return x.new_empty(x.shape[0], w.shape[2])


def weight_grad_cuda(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """Per group x_g^T [K, M_g] @ grad_g [M_g, N] with torch._scaled_grouped_mm -> [G, K, N] in
    BF16. The rows are padded with zeros (in no group) to a multiple of 16: the transposed operands'
    rows must start on 16-byte boundaries, and a padded expert buffer's M need not be one."""
    pad = -x.shape[0] % ALIGNMENT
    x, grad = (
        torch.cat([x, x.new_zeros(pad, x.shape[1])]),
        torch.cat([grad, grad.new_zeros(pad, grad.shape[1])]),
    )
    x8, x_inverse = quantize_per_group_column(x, offsets, rowwise)  # [M, K], [G, K]
    g8, g_inverse = quantize_per_group_column(grad, offsets, rowwise)  # [M, N], [G, N]
    return torch._scaled_grouped_mm(
        x8.T.contiguous(),
        column_major(g8),
        x_inverse.reshape(-1),
        g_inverse.reshape(-1),
        offs=offsets,
        out_dtype=torch.bfloat16,
    )


def weight_grad_loop(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """weight_grad_cuda's quantisation, then torch._scaled_mm per group -> [G, K, N]; an empty
    group's is zero."""
    x8, x_inverse = quantize_per_group_column(x, offsets, rowwise)
    g8, g_inverse = quantize_per_group_column(grad, offsets, rowwise)
    out = x.new_zeros(offsets.shape[0], x.shape[1], grad.shape[1])
    start = 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            out[group] = torch._scaled_mm(
                x8[start:end].T.contiguous(),
                column_major(g8[start:end]),
                scale_a=x_inverse[group].unsqueeze(1),
                scale_b=g_inverse[group].unsqueeze(0),
                out_dtype=x.dtype,
            )
        start = end
    return out


@torch.library.custom_op("flint::fp8_grouped_mm_weight_grad", mutates_args=())
def fp8_grouped_mm_weight_grad(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """x [M, K], grad [M, N] -> [G, K, N]: per group x_g^T @ grad_g, both scaled along the group's
    rows."""
    if grouped_fp8_kernel(x.device):
        return weight_grad_cuda(x, grad, offsets, rowwise).to(x.dtype)
    return weight_grad_loop(x, grad, offsets, rowwise)


@fp8_grouped_mm_weight_grad.register_fake
def _(x, grad, offsets, rowwise):
    if grouped_fp8_kernel(x.device):
        return weight_grad_cuda(x, grad, offsets, rowwise).to(x.dtype)
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def grouped_weight_grad_high_precision(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """rowwise_gw_hp's expert weight gradient, per group x_g^T @ grad_g -> [G, K, N]: moe's grouped
    GEMM (flint::grouped_mm_weight_grad), unquantised, in the compute dtype."""
    return torch.ops.flint.grouped_mm_weight_grad(x, grad, offsets)


def _grouped_setup(ctx, inputs, output):
    x, w, offsets, ctx.recipe = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_backward(ctx, grad):
    """The weight gradient unquantised in rowwise_gw_hp."""
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # may arrive strided (an expanded gradient)
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = fp8_grouped_mm(grad, w.transpose(1, 2), offsets, ctx.recipe)
    grad_w = None
    if ctx.needs_input_grad[1]:
        if ctx.recipe == HIGH_PRECISION_WEIGHT_GRAD:
            grad_w = grouped_weight_grad_high_precision(x, grad, offsets)
        else:
            grad_w = fp8_grouped_mm_weight_grad(x, grad, offsets, ctx.recipe != "tensorwise")
    return grad_x, grad_w, None, None


fp8_grouped_mm.register_autograd(_grouped_backward, setup_context=_grouped_setup)


# ============================================================================ which maps run in FP8


def fp8_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A targeted nn.Linear's forward: F.linear on FP8 operands (+ bias, added in x's dtype)."""
    y = fp8_linear(x, self.weight, self.fp8_recipe)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def fp8_targets(model: nn.Module) -> dict[str, nn.Module]:
    """The maps that run in FP8: every nn.Linear and routed-expert group outside the model's FP32
    units (its declaration: fp32_modules, fp32_root_modules, the head) and its frozen modules (Large
    4's indexer). Norms, sinks and the attention core hold no such map."""
    fp32, frozen = fp32_units(model), frozen_modules(model)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, GroupedExperts))
        and not inside(name, fp32)
        and not inside(name, frozen)
    }


def apply_fp8(model: nn.Module, recipe: str) -> list[str]:
    """Run `model`'s targeted maps (fp8_targets) in FP8 with `recipe` (FP8_RECIPES but "none"), in
    place: parameters, names and master weights unchanged; an nn.Linear's forward becomes
    fp8_linear_forward (an instance attribute, as lora.py and parallel.apply_compile set theirs),
    the routed experts' swiglu runs its grouped GEMMs as fp8_grouped_mm. -> the targeted names. Call
    it before expert parallelism and compile (parallel.parallelize)."""
    if recipe not in FP8_RECIPES[1:]:
        raise ValueError(f"[parallel] fp8 must be one of {list(FP8_RECIPES)}, got {recipe!r}")
    targets = fp8_targets(model)
    for module in targets.values():
        if isinstance(module, GroupedExperts):
            module.swiglu = partial(grouped_swiglu, mm=partial(fp8_grouped_mm, recipe=recipe))
        else:
            module.fp8_recipe = recipe
            module.forward = MethodType(fp8_linear_forward, module)
    return list(targets)


def fp8_refusal(model: nn.Module, tokens: int) -> str | None:
    """Why `model` (built on meta is enough) cannot train in FP8 with `tokens` per micro-batch on a
    rank, or None. CUDA's FP8 GEMMs take every reduced and output dim on 16-byte boundaries: each
    targeted map's widths, and the tokens, which the weight gradient reduces. The CPU is held to
    the same shapes, so that what trains here runs there."""
    if tokens % ALIGNMENT:
        return (
            "fp8 needs the tokens of each micro-batch on a rank (batch rows x seq_len / cp = "
            f"{tokens}) to be a "
            f"multiple of {ALIGNMENT}: the weight gradient's FP8 GEMM reduces over them"
        )
    for name, module in fp8_targets(model).items():
        if isinstance(module, GroupedExperts):
            if module.backend != "grouped" or module.capacity_factor is not None:
                return (
                    f"fp8 runs the routed experts' grouped GEMM: {name} has experts_backend = "
                    f"{module.backend!r} and capacity_factor = {module.capacity_factor!r}; use "
                    "'grouped', dropless"
                )
            widths = (*module.gate_up_proj.shape[1:], module.down_proj.shape[1])
        else:
            widths = (module.in_features, module.out_features)
        if any(width % ALIGNMENT for width in widths):
            return (
                f"fp8 needs every width of its matmuls to be a multiple of {ALIGNMENT} (16-byte "
                "FP8 rows on "
                f"CUDA): {name} has widths {', '.join(map(str, widths))}"
            )
    return None


def fp8_device_refusal(device_index: int = 0) -> str | None:
    """Why this CUDA device cannot run FP8 matmuls (compute capability below 8.9), or None."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability >= MIN_CAPABILITY:
        return None
    return (
        "fp8 needs FP8 tensor cores (compute capability >= "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, "
        f"Hopper, Blackwell), but {torch.cuda.get_device_name(device_index)} has "
        f'{capability[0]}.{capability[1]}; use fp8 = "none"'
    )
