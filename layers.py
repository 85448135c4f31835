"""The layers and helpers both models are built from (model.py: Flint, large4.py: Mistral Large 4), so that
either model's files can be deleted and the other still stands.

- RMSNorm; positions that restart at each packed document; the context-parallel loss share.
- Head: the untied FP32 output head with its fused, chunked cross-entropy (optionally soft-capped).
- Building a model: meta device, materialise, `init_weights` from per-name seeded values, so every
  parallel layout starts from one process's weights; parameter counts.
- Input checks with messages that name the argument; a forward's positional arguments (call_arguments).

Generation (sampling and the KV-cached decoding loop) is in generate.py. This file imports nothing of
this repository.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# Context parallelism's sequence gather (stage.StageContext.gather): a tensor holding this rank's
# positions along `dim` (default 1), T / cp long, -> the whole sequence's, T long.
Gather = Callable[..., torch.Tensor]


# ============================================================================= norm, positions, head

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where each packed document begins: doc_ids [B, T] -> [B, T]."""
    batch, seq_len = doc_ids.shape
    index = torch.arange(seq_len, device=doc_ids.device).expand(batch, seq_len)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=1).values


def default_positions(doc_ids: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
    """Positions [B, T] that restart at 0 where each packed document begins (0 .. T - 1 without doc_ids)."""
    if doc_ids is not None:
        return document_positions(doc_ids)
    return torch.arange(seq_len, device=device).expand(batch, seq_len)


def context_share(loss: torch.Tensor, targets: torch.Tensor, mine: torch.Tensor, cp: int) -> torch.Tensor:
    """The head's mean loss over the targets [B, T] at this cp rank's positions `mine` [T / cp] -> this
    rank's share of the mean over the whole sequence's, so that the mean over the cp ranks is that mean
    (every cp rank holds all targets: no communication)."""
    return loss * (targets[:, mine] != -100).sum() * cp / (targets != -100).sum().clamp(min=1)


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
        self.precision = "float32"  # the loss's matmuls on CUDA (HEAD_PRECISIONS; parallel.py sets it)
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
            return LinearCrossEntropy.apply(h, weight, targets, self.chunk_size, self.softcap, precision) / count
        w = head_operand(weight, precision)
        total = sum(_chunk_loss_sum(h[rows], w, targets[rows], self.softcap, precision)
                    for rows in _chunks(h.shape[0], self.chunk_size))
        return total / count


# The loss's matmul precision on CUDA ([parallel].head_precision; BENCHMARKS.md, The head's precision):
# float32 (IEEE, CUDA cores), tf32 (operands rounded to 10 mantissa bits on the tensor cores),
# bf16x3 (each operand split into BF16 hi + lo, three BF16 products), bf16 (one BF16 product). Every
# one accumulates in FP32 and gives FP32 logits, log-softmax, loss and gradients; the weight and its
# master copy stay FP32. On other devices the head is always FP32.
HEAD_PRECISIONS = ("float32", "tf32", "bf16x3", "bf16")


class HeadOperand(NamedTuple):
    """A matmul operand of the head at its precision: the FP32 tensor (float32, tf32), or its BF16
    rounding `hi` and, for bf16x3, the BF16 rounding of the rest `lo` (x = hi + lo + O(2^-16 x))."""
    hi: torch.Tensor
    lo: torch.Tensor | None = None

    @property
    def T(self) -> "HeadOperand":
        return HeadOperand(self.hi.T, None if self.lo is None else self.lo.T)


def head_operand(x: torch.Tensor, precision: str) -> HeadOperand:
    if precision in ("float32", "tf32"):
        return HeadOperand(x)
    hi = x.bfloat16()
    return HeadOperand(hi, (x - hi.float()).bfloat16() if precision == "bf16x3" else None)


def head_mm(a: HeadOperand, b: HeadOperand, precision: str, out: torch.Tensor | None = None,
            accumulate: bool = False) -> torch.Tensor:
    """a @ b in FP32 at `precision`: a new tensor, or written into `out` (added to it with accumulate)."""
    # bf16x3: lo x hi and hi x lo first, so that the small terms are added before the large one
    for x, y in [(a.hi, b.hi)] if a.lo is None else [(a.lo, b.hi), (a.hi, b.lo), (a.hi, b.hi)]:
        out = _product(x, y, precision, out, accumulate)
        accumulate = True
    return out


def _product(x: torch.Tensor, y: torch.Tensor, precision: str, out: torch.Tensor | None,
             accumulate: bool) -> torch.Tensor:
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
    return torch.addmm(out, x, y, beta=float(accumulate), out=out, **dtype)  # beta 0: out's old values ignored


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


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged when cap is None."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _chunks(rows: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, rows, chunk_size)]


def _chunk_loss_sum(h: torch.Tensor, weight: HeadOperand, targets: torch.Tensor, softcap: float | None = None,
                    precision: str = "float32") -> torch.Tensor:
    logits = soft_cap(head_mm(head_operand(h, precision), weight.T, precision), softcap)  # [chunk, V] in FP32
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of soft_cap(h @ weight^T) against targets (-100: ignored), with its
    gradients taken in the forward, one chunk of rows at a time.

    Per chunk: logits, log-softmax, loss; then, in place, the logits' gradient softmax - onehot
    (times the soft-cap's derivative 1 - tanh^2), and from it the chunk's dh and its share of dW.
    Three matmuls per chunk, as unchunked autograd takes, and no more (checkpointing each chunk
    would recompute its logits: a fourth), and no logits kept. Backward only scales the saved
    gradients by the incoming one. The price: dW [V, H] in FP32 is held from this forward to its
    backward, one per micro-batch in flight (tools/memory.py counts it). The matmuls run at `precision`
    (HEAD_PRECISIONS); everything else is FP32.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                softcap: float | None, precision: str = "float32") -> torch.Tensor:
        """h [N, H] FP32, weight [V, H] FP32, targets [N] -> the summed loss (scalar)."""
        grad_h = torch.empty_like(h)  # [N, H]
        grad_weight = torch.zeros_like(weight)  # [V, H]
        w = head_operand(weight, precision)  # rounded once for all chunks
        total = h.new_zeros(())
        for rows in _chunks(h.shape[0], chunk_size):
            total = total + _chunk_forward_backward(h[rows], w, targets[rows], softcap, grad_h[rows],
                                                    grad_weight, precision)
        ctx.save_for_backward(grad_h, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # Fresh contiguous products: the weight's gradient accumulator takes them as they are, with
        # no copy (a [V, H] FP32 gradient is 1.2 GB for Flint's head)
        grad_h, grad_weight = ctx.saved_tensors
        return grad_h * grad_loss, grad_weight * grad_loss, None, None, None, None


def _chunk_forward_backward(h: torch.Tensor, weight: HeadOperand, targets: torch.Tensor, softcap: float | None,
                            grad_h: torch.Tensor, grad_weight: torch.Tensor, precision: str) -> torch.Tensor:
    """One chunk of LinearCrossEntropy: writes its rows of grad_h [c, H], adds its share to
    grad_weight [V, H], returns its summed loss."""
    logits = head_mm(head_operand(h, precision), weight.T, precision)  # [c, V]
    if softcap is not None:
        capped = logits.div_(softcap).tanh_()  # tanh(logits / cap), in place
        logits = capped * softcap
    log_probs = torch.log_softmax(logits, dim=-1)  # [c, V]
    del logits
    keep = (targets != -100).to(h.dtype).unsqueeze(1)  # [c, 1]: 0 for ignored rows
    picked = targets.clamp(min=0).unsqueeze(1)  # [c, 1]: any class for ignored rows, weighed by keep
    loss = -(log_probs.gather(1, picked) * keep).sum()
    grad = log_probs.exp_()  # softmax, in place: d loss / d logits = softmax - onehot(target)
    grad.scatter_add_(1, picked, -keep)
    if softcap is not None:
        grad.mul_(1 - capped.square_())  # d(cap * tanh(x / cap)) / dx
    # Ignored rows get no gradient: masked on the [c, H] sides of the matmuls, not on the [c, V] grad.
    grad_op = head_operand(grad, precision)
    head_mm(grad_op, weight, precision, out=grad_h).mul_(keep)
    head_mm(grad_op.T, head_operand(h * keep, precision), precision, out=grad_weight, accumulate=True)
    return loss


# ============================================================================= building and counting

def build(model_class: type[nn.Module], config: Any, device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """Construct on the meta device (no memory), materialise on `device`, then `init_weights(seed)`."""
    with torch.device("meta"):
        model = model_class(config, dtype)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Every parameter from the model's `initial_value(name, param, seed)`, buffers zeroed: the same
    weights in every layout, since each value depends on its name and the seed alone."""
    for name, param in model.named_parameters():
        param.copy_(model.initial_value(name, param, seed))
    for buffer in model.buffers():
        buffer.zero_()


def count_params(model: nn.Module, active: bool = False) -> int:
    """All parameters, or those one token uses: of each MoE layer's routed experts, only the top-k
    (SwiGLU experts: 3 matrices of hidden x moe_intermediate each)."""
    total = sum(p.numel() for p in model.parameters())
    if not active:
        return total
    c = model.config
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return total - moe_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size


def check_inputs(config: Any, input_ids: torch.Tensor, targets: torch.Tensor | None, doc_ids: torch.Tensor | None,
                 positions: torch.Tensor | None) -> None:
    """A model's forward inputs, each refused with a message naming it."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
    if 0 in input_ids.shape:  # an empty sequence also crashes the CPU attention kernel (SIGFPE)
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: it needs at least one sequence of at "
                         f"least one token")
    if input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    for name, tensor in (("targets", targets), ("doc_ids", doc_ids), ("positions", positions)):
        if tensor is None:
            continue
        if tensor.shape != input_ids.shape or tensor.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor of shape {tuple(input_ids.shape)} like "
                             f"input_ids, got {tensor.dtype} {tuple(tensor.shape)}")
    if _ids_checked_at_load.get():
        return
    check_token_ids("input_ids", input_ids, config.vocab_size)
    if targets is not None:
        check_token_ids("targets", targets, config.vocab_size, ignored=-100)


_ids_checked_at_load = ContextVar("ids_checked_at_load", default=False)


@contextmanager
def token_ids_checked_at_load() -> Iterator[None]:
    """Inside it, forwards skip check_token_ids (one host sync per call): for the trainer's batches,
    whose ids data.py checked against the vocabulary when it loaded each shard (check_token_range).
    Every other caller of a model keeps the check and its clear error."""
    token = _ids_checked_at_load.set(True)
    try:
        yield
    finally:
        _ids_checked_at_load.reset(token)


def call_arguments(model: str, inputs: tuple, targets, doc_ids, positions) -> tuple:
    """A first stage's forward(*inputs, targets=, doc_ids=, positions=): (input_ids, [targets, [doc_ids,
    [positions]]]) given positionally, each at most once -> ((input_ids,), targets, doc_ids, positions).
    A later pipeline stage takes the previous stage's tuple positionally, so the rest come by keyword."""
    names, given = ("targets", "doc_ids", "positions"), [targets, doc_ids, positions]
    if not 1 <= len(inputs) <= 4:
        raise TypeError(f"{model} takes input_ids, targets, doc_ids, positions; got {len(inputs)} "
                        f"positional arguments")
    for index, value in enumerate(inputs[1:]):
        if given[index] is not None:
            raise TypeError(f"{model} got {names[index]} twice (by position and by keyword)")
        given[index] = value
    return (inputs[0],), *given


def seeded_normal(name: str, param: torch.Tensor, seed: int, std: float) -> torch.Tensor:
    """normal(0, std) of param's shape, dtype and device from a generator seeded by crc32 of
    (seed, name): the same tensor whichever rank, layout or order draws it."""
    # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    generator = torch.Generator(device=param.device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    value = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    return value.normal_(0.0, std, generator=generator)


def check_token_ids(name: str, ids: torch.Tensor, vocab: int, ignored: int | None = None) -> None:
    """Token ids must index the vocabulary (the embedding would fail with a bare IndexError, a GPU
    with a device-side assert). One reduction and one host sync per call."""
    outside = (ids < 0) | (ids >= vocab)
    if ignored is not None:
        outside &= ids != ignored
    if bool(outside.any()):
        bad = ids[outside][0].item()
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab}) of vocab_size {vocab}"
                         + (f" ({ignored} marks an ignored target)" if ignored is not None else ""))
