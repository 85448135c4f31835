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
whose grouped FP8 kernel torch 2.13 does not build (grouped_fp8_kernel). Only the GEMMs are
torch.library custom ops, opaque to the compiler; the quantisation around them (amax, scale, cast,
the kernels' layouts) is plain torch ops inside traceable autograd.Functions, so that a compiled
block (fullgraph=True) fuses it into the kernels that produce and consume the operands
(BENCHMARKS.md, "FP8 quantisation fused"). The GEMMs' fake functions run the CUDA kernels on fake
tensors whenever kernels are chosen for CUDA
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


# ========================================================================= the FP8 GEMMs, opaque
# The only ops a compiler cannot see into: the GEMMs, on operands already quantised and laid out as
# CUDA's kernels take them. Everything before them (amax, scale, cast, layout) is plain torch ops in
# the graph, so that a compiled block fuses it into the kernels that produce the operands, as
# torchao's float8 training does (https://github.com/pytorch/ao/tree/main/torchao/float8: the
# scaled matmul is its only opaque op). The ops keep the names tools/op_trace.py prices at the FP8
# peak.


def uses_cuda_kernels(t: torch.Tensor) -> bool:
    return kernel_device_type(t.device) == "cuda"


def fp8_gemm(
    a8: torch.Tensor,
    b8: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a8 [M, K] row-major @ b8 [K, N] column-major, times the inverse scales ([M, 1] and [1, N],
    or scalars) -> [M, N] in out_dtype (through BF16 out of CUDA's kernel)."""
    kernel_dtype = torch.bfloat16 if uses_cuda_kernels(a8) else out_dtype
    y = torch._scaled_mm(a8, b8, scale_a=a_inverse, scale_b=b_inverse, out_dtype=kernel_dtype)
    return y.to(out_dtype)


@torch.library.custom_op("flint::fp8_matmul", mutates_args=())
def scaled_mm_kernel(
    a8: torch.Tensor,
    b8: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_gemm as one opaque op."""
    return fp8_gemm(a8, b8, a_inverse, b_inverse, out_dtype)


@scaled_mm_kernel.register_fake
def _(a8, b8, a_inverse, b_inverse, out_dtype):
    # a rehearsal or a CUDA compile: the kernel's own checks on fake tensors
    if uses_cuda_kernels(a8):
        return fp8_gemm(a8, b8, a_inverse, b_inverse, out_dtype)
    return a8.new_empty(a8.shape[0], b8.shape[1], dtype=out_dtype)


def grouped_fp8_kernel(device: torch.device) -> bool:
    """Whether the experts' FP8 GEMMs on `device` run torch._scaled_grouped_mm: kernels chosen for
    CUDA, on a Hopper GPU (torch 2.13 builds its row-wise FP8 grouped GEMM for SM90 only: Ada and
    Blackwell loop over the experts with torch._scaled_mm, as the CPU does) or on the fake CPU
    tensors of a rehearsal, which checks the Hopper kernel's shapes."""
    if kernel_device_type(device) != "cuda":
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


def grouped_cuda(
    x8: torch.Tensor,
    w8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scaled_grouped_mm_kernel on Hopper: torch._scaled_grouped_mm, BF16 out."""
    return torch._scaled_grouped_mm(
        x8, w8, x_inverse, w_inverse, offs=offsets, out_dtype=torch.bfloat16
    ).to(out_dtype)


@torch.library.custom_op("flint::fp8_grouped_mm", mutates_args=())
def scaled_grouped_mm_kernel(
    x8: torch.Tensor,
    w8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x8 [M, K] rows sorted by group @ the groups of w8 [G, K, N] (each column-major), offsets
    int32 [G] cumulative ends, inverse scales x [M] and w [G, N] -> [M, N] in out_dtype."""
    if grouped_fp8_kernel(x8.device):
        return grouped_cuda(x8, w8, offsets, x_inverse, w_inverse, out_dtype)
    return grouped_loop(x8, w8, offsets, x_inverse, w_inverse, out_dtype)


@scaled_grouped_mm_kernel.register_fake
def _(x8, w8, offsets, x_inverse, w_inverse, out_dtype):
    if grouped_fp8_kernel(x8.device):  # a rehearsal or a compile on Hopper: the kernel's checks
        return grouped_cuda(x8, w8, offsets, x_inverse, w_inverse, out_dtype)
    return x8.new_empty(x8.shape[0], w8.shape[2], dtype=out_dtype)


def grouped_loop(
    x8: torch.Tensor,
    w8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scaled_grouped_mm_kernel with torch._scaled_mm expert by expert, where there is no grouped
    FP8 kernel (the CPU; GPUs but Hopper: one host sync for the group ends); rows past the last
    group stay zero."""
    out = torch.zeros(x8.shape[0], w8.shape[2], dtype=out_dtype, device=x8.device)
    start = 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = torch._scaled_mm(
                x8[start:end],
                w8[group],
                scale_a=x_inverse[start:end].unsqueeze(1),
                scale_b=w_inverse[group].unsqueeze(0),
                out_dtype=out_dtype,
            )
        start = end
    return out


def weight_grad_cuda(
    x8_t: torch.Tensor,
    g8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    g_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scaled_grouped_weight_grad_kernel on Hopper: torch._scaled_grouped_mm, BF16 out."""
    return torch._scaled_grouped_mm(
        x8_t,
        g8,
        x_inverse.reshape(-1),
        g_inverse.reshape(-1),
        offs=offsets,
        out_dtype=torch.bfloat16,
    ).to(out_dtype)


@torch.library.custom_op("flint::fp8_grouped_mm_weight_grad", mutates_args=())
def scaled_grouped_weight_grad_kernel(
    x8_t: torch.Tensor,
    g8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    g_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Per group x_g^T [K, M_g] @ grad_g [M_g, N]: x8_t [K, M] row-major (x's FP8 values
    transposed), g8 [M, N] column-major, inverse scales x [G, K] and grad [G, N] -> [G, K, N] in
    out_dtype; an empty group's is zero."""
    if grouped_fp8_kernel(x8_t.device):
        return weight_grad_cuda(x8_t, g8, offsets, x_inverse, g_inverse, out_dtype)
    return weight_grad_loop(x8_t, g8, offsets, x_inverse, g_inverse, out_dtype)


@scaled_grouped_weight_grad_kernel.register_fake
def _(x8_t, g8, offsets, x_inverse, g_inverse, out_dtype):
    if grouped_fp8_kernel(x8_t.device):
        return weight_grad_cuda(x8_t, g8, offsets, x_inverse, g_inverse, out_dtype)
    return x8_t.new_empty(offsets.shape[0], x8_t.shape[0], g8.shape[1], dtype=out_dtype)


def weight_grad_loop(
    x8_t: torch.Tensor,
    g8: torch.Tensor,
    offsets: torch.Tensor,
    x_inverse: torch.Tensor,
    g_inverse: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scaled_grouped_weight_grad_kernel with torch._scaled_mm group by group (the CPU's strided
    FP8 GEMM takes the slices as they are)."""
    out = torch.zeros(
        offsets.shape[0], x8_t.shape[0], g8.shape[1], dtype=out_dtype, device=x8_t.device
    )
    start = 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            out[group] = torch._scaled_mm(
                x8_t[:, start:end],
                g8[start:end],
                scale_a=x_inverse[group].unsqueeze(1),
                scale_b=g_inverse[group].unsqueeze(0),
                out_dtype=out_dtype,
            )
        start = end
    return out


# ================================================================= dense: y = a @ b, traced


def operand_formats(recipe: str, gradient: int) -> tuple[torch.dtype, torch.dtype]:
    """The FP8 formats of a dense matmul's operands: E4M3, but tensor-wise the output gradient
    (operand `gradient`: 0 or 1, FORWARD for none) in E5M2, as torchao's tensor-wise recipe keeps
    it. CUDA's torch._scaled_mm takes E4M3 x E5M2 and E5M2 x E4M3 (not E5M2 x E5M2, never asked)."""
    formats = [E4M3, E4M3]
    if recipe == "tensorwise" and gradient != FORWARD:
        formats[gradient] = E5M2
    return formats[0], formats[1]


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, gradient: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] on FP8 operands scaled along K -> [M, N] in a's dtype: the quantisation
    traced, the GEMM opaque."""
    rowwise = recipe != "tensorwise"
    a_format, b_format = operand_formats(recipe, gradient)
    a8, a_inverse = quantize(a, 1, rowwise, a_format)  # [M, 1] or []
    b8, b_inverse = quantize(b, 0, rowwise, b_format)  # [1, N] or []
    return scaled_mm_kernel(a8.contiguous(), column_major(b8), a_inverse, b_inverse, a.dtype)


def weight_grad_high_precision(a: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """rowwise_gw_hp's weight gradient a^T [K, M] @ grad [M, N], unquantised: the compute dtype."""
    return a.T @ grad


class FP8Matmul(torch.autograd.Function):
    """A traceable autograd.Function, not a custom op: torch.compile sees its forward and backward
    whole, quantisation included. b is the weight (fp8_linear): its gradient unquantised in
    rowwise_gw_hp."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, recipe: str, gradient: int) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.recipe = recipe
        return scaled_matmul(a, b, recipe, gradient)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:  # reduces N
            grad_a = scaled_matmul(grad, b.T, ctx.recipe, 0)
        if ctx.needs_input_grad[1]:  # reduces M
            if ctx.recipe == HIGH_PRECISION_WEIGHT_GRAD:
                grad_b = weight_grad_high_precision(a, grad)
            else:
                grad_b = scaled_matmul(a.T, grad, ctx.recipe, 1)
        return grad_a, grad_b, None, None


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, gradient: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N]: FP8 operands, each scaled along K (the module docstring);
    `gradient`: which operand is an output gradient (0, 1, or FORWARD), for operand_formats."""
    return FP8Matmul.apply(a, b, recipe, gradient)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """F.linear without bias in FP8: x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    y = fp8_matmul(rows, weight.to(x.dtype).T, recipe, FORWARD)  # [M, N]
    return y.view(*x.shape[:-1], weight.shape[0])


# ============================================================ grouped: the routed experts, traced


def grouped_scaled_mm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """x [M, K] @ the groups of w [G, K, N] -> [M, N] in x's dtype: x's rows scaled per row, each
    group's weight per output column (or each tensor as a whole), all E4M3."""
    x8, x_inverse = quantize(x, 1, rowwise)  # [M, 1] or []
    w8, w_inverse = quantize(w, 1, rowwise)  # [G, 1, N] or []
    rows, groups, n = x.shape[0], w.shape[0], w.shape[2]
    # the kernels take contiguous scales: a tensor-wise scalar expanded is not
    x_scales = x_inverse.expand(rows, 1).reshape(rows).contiguous()
    w_scales = w_inverse.expand(groups, 1, n).reshape(groups, n).contiguous()
    return scaled_grouped_mm_kernel(
        x8.contiguous(), column_major(w8), offsets, x_scales, w_scales, x.dtype
    )


def grouped_weight_grad(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, rowwise: bool
) -> torch.Tensor:
    """Per group x_g^T @ grad_g -> [G, K, N] in x's dtype, both scaled per column within the
    group's rows. For CUDA's grouped kernel the rows are padded with zeros (in no group) to a
    multiple of 16: the transposed operands' rows must start on 16-byte boundaries, and a padded
    expert buffer's M need not be one."""
    if grouped_fp8_kernel(x.device):
        pad = -x.shape[0] % ALIGNMENT
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        grad = torch.cat([grad, grad.new_zeros(pad, grad.shape[1])])
    x8, x_inverse = quantize_per_group_column(x, offsets, rowwise)  # [M, K], [G, K]
    g8, g_inverse = quantize_per_group_column(grad, offsets, rowwise)  # [M, N], [G, N]
    return scaled_grouped_weight_grad_kernel(
        x8.T.contiguous(), column_major(g8), offsets, x_inverse, g_inverse, x.dtype
    )


def grouped_weight_grad_high_precision(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """rowwise_gw_hp's expert weight gradient, per group x_g^T @ grad_g -> [G, K, N]: moe's grouped
    GEMM (flint::grouped_mm_weight_grad), unquantised, in the compute dtype."""
    return torch.ops.flint.grouped_mm_weight_grad(x, grad, offsets)


class FP8GroupedMM(torch.autograd.Function):
    """As FP8Matmul, for the experts; the weight gradient unquantised in rowwise_gw_hp."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.recipe = recipe
        return grouped_scaled_mm(x, w, offsets, recipe != "tensorwise")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # may arrive strided (an expanded gradient)
        rowwise = ctx.recipe != "tensorwise"
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_scaled_mm(grad, w.transpose(1, 2), offsets, rowwise)
        if ctx.needs_input_grad[1]:
            if ctx.recipe == HIGH_PRECISION_WEIGHT_GRAD:
                grad_w = grouped_weight_grad_high_precision(x, grad, offsets)
            else:
                grad_w = grouped_weight_grad(x, grad, offsets, rowwise)
        return grad_x, grad_w, None, None


def fp8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: str
) -> torch.Tensor:
    """x [M, K] rows sorted by group, w [G, K, N], offsets int32 [G] cumulative ends -> [M, N]:
    moe.grouped_mm on E4M3 operands, rows scaled per row, each group's weight per output column
    (tensorwise: each operand as a whole)."""
    return FP8GroupedMM.apply(x, w, offsets, recipe)


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
