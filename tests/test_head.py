"""head.py: the fused chunked loss of the shared head against a plain per-row softmax, and the
head's GPU precisions (on the CPU: always FP32; the BF16 products as profiling emulates them; one
compiled graph)."""

import pytest
import torch

from head import HEAD_PRECISIONS, Head, LinearCrossEntropy
from helpers import assert_close_to_scale

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_head_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """The contract's loss row by row: full softmax of the (soft-capped) logits, mean over kept
    rows."""
    total, kept = 0.0, 0
    for row, target in zip(h, targets.tolist()):
        if target == -100:
            continue
        logits = weight @ row  # [V]
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        total = total - (logits[target] - torch.log(torch.exp(logits).sum()))
        kept += 1
    return total / max(kept, 1)


@pytest.mark.parametrize("chunk", [4, 7, 10_000])
@pytest.mark.parametrize("cap", [None, 2.5])
def test_fused_head_loss_matches_plain_reference(chunk, cap):
    """Head's fused chunked loss (gradients taken in its forward) against a per-row full softmax:
    values and both gradients, ignored rows included; the no_grad path gives the same loss."""
    generator = torch.Generator().manual_seed(0)
    head = Head(12, 40, chunk, cap)
    with torch.no_grad():
        head.weight.copy_(torch.randn(40, 12, generator=generator))
    h = torch.randn(2, 11, 12, generator=generator, requires_grad=True)
    targets = torch.randint(0, 40, (2, 11), generator=generator)
    targets[0, 2], targets[1, :4] = -100, -100
    loss = head(h, targets)
    (3.0 * loss).backward()  # a non-unit incoming gradient must scale both saved gradients
    weight = head.weight.detach().clone().requires_grad_()
    h_ref = h.detach().clone().requires_grad_()
    expected = plain_head_loss(h_ref.reshape(-1, 12), weight, targets.reshape(-1), cap)
    (3.0 * expected).backward()
    assert_close_to_scale(loss, expected, rtol=1e-6)
    assert_close_to_scale(h.grad, h_ref.grad, 1e-5, "input gradient")
    assert_close_to_scale(head.weight.grad, weight.grad, 1e-5, "weight gradient")
    assert h.grad[0, 2].abs().max() == 0 and h.grad[1, :4].abs().max() == 0
    with torch.no_grad():
        assert_close_to_scale(head(h, targets), expected, rtol=1e-6)


def small_head_case(generator_seed: int = 0):
    generator = torch.Generator().manual_seed(generator_seed)
    h = torch.randn(19, 24, generator=generator)
    weight = torch.randn(50, 24, generator=generator) * 0.5
    targets = torch.randint(0, 50, (19,), generator=generator)
    return h, weight, targets


def test_the_cpu_head_computes_fp32_at_every_gpu_precision():
    """[parallel].head_precision applies on CUDA only: on the CPU every setting is the FP32 head,
    bit for bit."""
    h, weight, targets = small_head_case()
    results = []
    for precision in HEAD_PRECISIONS:
        head = Head(24, 50, chunk_size=8)
        head.precision = precision
        with torch.no_grad():
            head.weight.copy_(weight)
        x = h.clone().requires_grad_()
        loss = head(x[None], targets[None])
        loss.backward()
        results.append((loss.detach(), x.grad, head.weight.grad))
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result, results[0]))


@pytest.mark.parametrize("precision", ["bf16", "bf16x3"])
def test_the_bf16_head_products_are_the_emulated_ones(precision):
    """The fused loss at a BF16 precision (on the CPU, the same exact products through FP32 copies)
    equals profiling's emulation of it (operands rounded by hand, plain log-softmax), and differs
    from FP32 by about what that emulation says."""
    from tools.profiling import emulated_mm, head_loss_and_grads

    h, weight, targets = small_head_case()
    x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = LinearCrossEntropy.apply(x, w, targets, 8, None, precision) / len(targets)
    loss.backward()
    expected = head_loss_and_grads(h, weight, targets, lambda a, b: emulated_mm(a, b, precision))
    fp32 = head_loss_and_grads(h, weight, targets, torch.mm)
    assert_close_to_scale(loss.detach(), expected[0], rtol=1e-6)
    assert_close_to_scale(x.grad, expected[1], 1e-5, "input gradient")
    assert_close_to_scale(w.grad, expected[2], 1e-5, "weight gradient")
    # the rounding is there
    assert (w.grad - fp32[2]).abs().max() > 10 * (w.grad - expected[2]).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["tf32", "bf16x3"])
def test_the_gpu_precisions_compile_to_one_graph(precision):
    """The fused loss at each GPU precision traces whole (the TF32 product as its opaque operator),
    equal to eager. On the CPU the TF32 operator computes FP32: this checks the tracing, not
    TF32."""
    h, weight, targets = small_head_case()

    def loss(x, w):
        return LinearCrossEntropy.apply(x, w, targets, 10, None, precision)  # two chunks

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        value = fn(x, w)
        results.append((value, *torch.autograd.grad(value, [x, w])))
    for eager, compiled in zip(*results):
        assert_close_to_scale(compiled, eager, rtol=1e-6)
