"""The layers and helpers both models are built from (flint_model.py: Flint, large4.py: Mistral
Large 4), so that either model's files can be deleted and the other still stands.

- RMSNorm; positions that restart at each packed document; the context-parallel loss share.
- Building a model: meta device, materialise, `init_weights` from per-name seeded values, so every
  parallel layout starts from one process's weights; parameter counts.
- A model's units by name: its FP32 modules, its frozen ones, and whether a module lies inside one
  (what LoRA and FP8 leave alone).
- Input checks with messages that name the argument; a forward's positional arguments
  (call_arguments).

The output head and its fused loss are in head.py; generation (sampling and the KV-cached decoding
loop) is in generate.py. This file imports nothing of this repository.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn as nn

# Context parallelism's sequence gather (stage.StageContext.gather): a tensor holding this rank's
# positions along `dim` (default 1), T / cp long, -> the whole sequence's, T long.
Gather = Callable[..., torch.Tensor]


# ============================================================================= norm, positions


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


def default_positions(
    doc_ids: torch.Tensor | None, batch: int, seq_len: int, device
) -> torch.Tensor:
    """Positions [B, T] that restart at 0 where each packed document begins (0 .. T - 1 without
    doc_ids)."""
    if doc_ids is not None:
        return document_positions(doc_ids)
    return torch.arange(seq_len, device=device).expand(batch, seq_len)


def context_share(
    loss: torch.Tensor, targets: torch.Tensor, mine: torch.Tensor, cp: int
) -> torch.Tensor:
    """The head's mean loss over the targets [B, T] at this cp rank's positions `mine` [T / cp] ->
    this rank's share of the mean over the whole sequence's, so that the mean over the cp ranks is
    that mean (every cp rank holds all targets: no communication)."""
    return loss * (targets[:, mine] != -100).sum() * cp / (targets != -100).sum().clamp(min=1)


# ========================================================================== a model's units by name


def fp32_units(model: nn.Module) -> set[str]:
    """Names of the modules the model keeps in FP32 (its declaration: fp32_modules,
    fp32_root_modules, the head)."""
    units = [*model.fp32_root_modules(), model.lm_head]
    for layer in model.layers.values():
        units += model.fp32_modules(layer)
    ids = {id(unit) for unit in units if unit is not None}
    return {name for name, module in model.named_modules() if id(module) in ids}


def frozen_modules(model: nn.Module) -> set[str]:
    """Names of the modules whose parameters are all frozen in the base (Large 4's indexer)."""
    return {
        name
        for name, module in model.named_modules()
        if (params := list(module.parameters())) and not any(p.requires_grad for p in params)
    }


def inside(name: str, owners: set[str]) -> bool:
    """Whether module `name` is one of `owners` or lies inside one."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in owners for i in range(1, len(parts) + 1))


# ============================================================================ building and counting


def build(
    model_class: type[nn.Module],
    config: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """Construct on the meta device (no memory), materialise on `device`, then
    `init_weights(seed)`."""
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
    return (
        total
        - moe_layers
        * (c.num_experts - c.num_experts_per_tok)
        * 3
        * c.hidden_size
        * c.moe_intermediate_size
    )


def check_inputs(
    config: Any,
    input_ids: torch.Tensor,
    targets: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> None:
    """A model's forward inputs, each refused with a message naming it."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
    ):
        raise ValueError(
            f"input_ids must be an integer tensor [batch, seq], got "
            f"{getattr(input_ids, 'dtype', type(input_ids))} "
            f"{tuple(getattr(input_ids, 'shape', ()))}"
        )
    if 0 in input_ids.shape:  # an empty sequence also crashes the CPU attention kernel (SIGFPE)
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}: it needs at least one "
            "sequence of at "
            f"least one token"
        )
    if input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    for name, tensor in (("targets", targets), ("doc_ids", doc_ids), ("positions", positions)):
        if tensor is None:
            continue
        if tensor.shape != input_ids.shape or tensor.is_floating_point():
            raise ValueError(
                f"{name} must be an integer tensor of shape {tuple(input_ids.shape)} "
                "like "
                f"input_ids, got {tensor.dtype} {tuple(tensor.shape)}"
            )
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
    """A first stage's forward(*inputs, targets=, doc_ids=, positions=): (input_ids, [targets,
    [doc_ids, [positions]]]) given positionally, each at most once -> ((input_ids,), targets,
    doc_ids, positions). A later pipeline stage takes the previous stage's tuple positionally, so
    the rest come by keyword."""
    names, given = ("targets", "doc_ids", "positions"), [targets, doc_ids, positions]
    if not 1 <= len(inputs) <= 4:
        raise TypeError(
            f"{model} takes input_ids, targets, doc_ids, positions; got {len(inputs)} "
            f"positional arguments"
        )
    for index, value in enumerate(inputs[1:]):
        if given[index] is not None:
            raise TypeError(f"{model} got {names[index]} twice (by position and by keyword)")
        given[index] = value
    return (inputs[0],), *given


def seeded_normal(name: str, param: torch.Tensor, seed: int, std: float) -> torch.Tensor:
    """normal(0, std) of param's shape, dtype and device from a generator seeded by crc32 of
    (seed, name): the same tensor whichever rank, layout or order draws it."""
    # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    generator = torch.Generator(device=param.device).manual_seed(
        zlib.crc32(f"{seed}/{name}".encode())
    )
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
        raise ValueError(
            f"{name} holds token id {bad}, outside the vocabulary [0, {vocab}) of "
            f"vocab_size {vocab}"
            + (f" ({ignored} marks an ignored target)" if ignored is not None else "")
        )
