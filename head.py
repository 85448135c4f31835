"""The output head both models end in: an untied FP32 projection [V, H] and its cross-entropy.

- Head: FP32 logits, or the mean loss over the kept targets.
- The loss: chunked, so that at most `chunk_size` rows of FP32 logits exist at once, and in training
  fused (LinearCrossEntropy: each chunk's gradients taken in the forward); an optional soft-cap.
- Its precision on CUDA ([parallel] head_precision, HEAD_PRECISIONS): the loss's matmuls at float32,
  tf32, bf16x3 or bf16, always accumulated in FP32.

This file imports nothing of this repository.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    """Untied FP32 output head [V, H], with a chunked cross-entropy.

    The loss never holds more than `chunk_size` rows of FP32 logits. In training it is one fused
    step (LinearCrossEntropy): each chunk's gradients are taken as soon as its logits exist, so the
    logits are neither saved nor recomputed. An optional soft-cap (Mistral Large 4) bounds the
    logits, in FP32, inside each chunk.
    """

    def __init__(self, hidden: int, vocab: int, chunk_size: int, softcap: float | None = None):
        super().__init__()
        self.chunk_size, self.softcap = chunk_size, softcap
        # the loss's matmuls on CUDA (HEAD_PRECISIONS; parallel.py sets it)
        self.precision = "float32"
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=torch.float32))

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, H] -> FP32 logits [B, T, V], or with targets [B, T] the mean loss (scalar)."""
        h = h.float()
        if targets is None:
            return soft_cap(h @ self.weight.float().T, self.softcap)
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # [N, H], [N]
        count = (targets != -100).sum().clamp(min=1)
        weight = self.weight.float()
        precision = self.precision if h.device.type == "cuda" else "float32"
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return (
                LinearCrossEntropy.apply(
                    h, weight, targets, self.chunk_size, self.softcap, precision
                )
                / count
            )
        w = head_operand(weight, precision)
        total = sum(
            _chunk_loss_sum(h[rows], w, targets[rows], self.softcap, precision)
            for rows in _chunks(h.shape[0], self.chunk_size)
        )
        return total / count


# ============================================================================= the loss


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged when cap is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _chunks(rows: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, rows, chunk_size)]


def _chunk_loss_sum(
    h: torch.Tensor,
    weight: HeadOperand,
    targets: torch.Tensor,
    softcap: float | None = None,
    precision: str = "float32",
) -> torch.Tensor:
    # [chunk, V] in FP32
    logits = soft_cap(head_mm(head_operand(h, precision), weight.T, precision), softcap)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of soft_cap(h @ weight^T) against targets (-100: ignored), with its
    gradients taken in the forward, one chunk of rows at a time.

    Per chunk: logits, log-softmax, loss; then, in place, the logits' gradient softmax - onehot
    (times the soft-cap's derivative 1 - tanh^2), and from it the chunk's dh and its share of dW.
    Three matmuls per chunk, as unchunked autograd takes, and no more (checkpointing each chunk
    would recompute its logits: a fourth), and no logits kept. Backward only scales the saved
    gradients by the incoming one. The price: dW [V, H] in FP32 is held from this forward to its
    backward, one per micro-batch in flight (tools/memory.py counts it). The matmuls run at
    `precision` (HEAD_PRECISIONS); everything else is FP32."""

    @staticmethod
    def forward(
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        softcap: float | None,
        precision: str = "float32",
    ) -> torch.Tensor:
        """h [N, H] FP32, weight [V, H] FP32, targets [N] -> the summed loss (scalar)."""
        grad_h = torch.empty_like(h)  # [N, H]
        grad_weight = torch.zeros_like(weight)  # [V, H]
        w = head_operand(weight, precision)  # rounded once for all chunks
        total = h.new_zeros(())
        for rows in _chunks(h.shape[0], chunk_size):
            total = total + _chunk_forward_backward(
                h[rows], w, targets[rows], softcap, grad_h[rows], grad_weight, precision
            )
        ctx.save_for_backward(grad_h, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Fresh contiguous products: the weight's gradient accumulator takes them as they are, with
        # no copy (a [V, H] FP32 gradient is 1.2 GB for Flint's head)
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h * grad_loss, grad_weight * grad_loss, None, None, None, None


def _chunk_forward_backward(
    h: torch.Tensor,
    weight: HeadOperand,
    targets: torch.Tensor,
    softcap: float | None,
    grad_h: torch.Tensor,
    grad_weight: torch.Tensor,
    precision: str,
) -> torch.Tensor:
    """One chunk of LinearCrossEntropy: writes its rows of grad_h [c, H], adds its share to
    grad_weight [V, H], returns its summed loss."""
    logits = head_mm(head_operand(h, precision), weight.T, precision)  # [c, V]
    if softcap is not None:
        capped = logits.div_(softcap).tanh_()  # tanh(logits / cap), in place
        logits = capped * softcap
    log_probs = torch.log_softmax(logits, dim=-1)  # [c, V]
    del logits
    keep = (targets != -100).to(h.dtype).unsqueeze(1)  # [c, 1]: 0 for ignored rows
    # [c, 1]: any class for ignored rows, weighed by keep
    picked = targets.clamp(min=0).unsqueeze(1)
    loss = -(log_probs.gather(1, picked) * keep).sum()
    grad = log_probs.exp_()  # softmax, in place: d loss / d logits = softmax - onehot(target)
    grad.scatter_add_(1, picked, -keep)
    if softcap is not None:
        grad.mul_(1 - capped.square_())  # d(cap * tanh(x / cap)) / dx
    # Ignored rows get no gradient: masked on the [c, H] sides of the matmuls, not on the [c, V]
    # grad.
    grad_op = head_operand(grad, precision)
    head_mm(grad_op, weight, precision, out=grad_h).mul_(keep)
    head_mm(
        grad_op.T, head_operand(h * keep, precision), precision, out=grad_weight, accumulate=True
    )
    return loss


# ============================================================================= the precision

# The loss's matmul precision on CUDA ([parallel].head_precision; BENCHMARKS.md, The head's
# precision): float32 (IEEE, CUDA cores), tf32 (operands rounded to 10 mantissa bits on the tensor
# cores), bf16x3 (each operand split into BF16 hi + lo, three BF16 products), bf16 (one BF16
# product). Every one accumulates in FP32 and gives FP32 logits, log-softmax, loss and gradients;
# the weight and its master copy stay FP32. On other devices the head is always FP32.
HEAD_PRECISIONS = ("float32", "tf32", "bf16x3", "bf16")


class HeadOperand(NamedTuple):
    """A matmul operand of the head at its precision: the FP32 tensor (float32, tf32), or its BF16
    rounding `hi` and, for bf16x3, the BF16 rounding of the rest `lo` (x = hi + lo + O(2^-16 x))."""

    hi: torch.Tensor
    lo: torch.Tensor | None = None

    @property
    def T(self) -> HeadOperand:
        return HeadOperand(self.hi.T, None if self.lo is None else self.lo.T)


def head_operand(x: torch.Tensor, precision: str) -> HeadOperand:
    if precision in ("float32", "tf32"):
        return HeadOperand(x)
    hi = x.bfloat16()
    return HeadOperand(hi, (x - hi.float()).bfloat16() if precision == "bf16x3" else None)


def head_mm(
    a: HeadOperand,
    b: HeadOperand,
    precision: str,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """a @ b in FP32 at `precision`: a new tensor, or written into `out` (added to it with
    accumulate)."""
    # bf16x3: lo x hi and hi x lo first, so that the small terms are added before the large one
    for x, y in [(a.hi, b.hi)] if a.lo is None else [(a.lo, b.hi), (a.hi, b.lo), (a.hi, b.hi)]:
        out = _product(x, y, precision, out, accumulate)
        accumulate = True
    return out


def _product(
    x: torch.Tensor, y: torch.Tensor, precision: str, out: torch.Tensor | None, accumulate: bool
) -> torch.Tensor:
    """One GEMM with FP32 accumulation and output. TF32 goes through an opaque operator, so that the
    compiler cannot move the product out of its setting's scope. BF16 operands on CUDA take FP32
    outputs (out_dtype); elsewhere the same exact products go through FP32 copies (for tests)."""
    if precision == "tf32":
        if out is None:
            return _mm_tf32(x, y)
        _addmm_tf32_(out, x, y, float(accumulate))
        return out
    dtype = {"out_dtype": torch.float32} if x.dtype == torch.bfloat16 and x.is_cuda else {}
    if not dtype:
        x, y = x.float(), y.float()
    if out is None:
        return torch.mm(x, y, **dtype)
    # beta 0: out's old values ignored
    return torch.addmm(out, x, y, beta=float(accumulate), out=out, **dtype)


@torch.library.custom_op("flint::mm_tf32", mutates_args=())
def _mm_tf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with _tf32():
        return a @ b


@_mm_tf32.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.custom_op("flint::addmm_tf32_", mutates_args=("out",))
def _addmm_tf32_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    with _tf32():
        torch.addmm(out, a, b, beta=beta, out=out)


@contextmanager
def _tf32() -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
