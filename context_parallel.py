"""Context parallelism's sequence sharding: which positions each rank of a cp group computes, and the
gather of a sequence over the group. parallel.py sets a model's `context` to a ContextParallel; the
model's forward then computes the queries of its positions and gathers keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor_autograd


@lru_cache(maxsize=64)
def _cp_index(seq_len: int, cp: int, rank: int, device: str) -> torch.Tensor:
    if seq_len % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seq_len} must be divisible by 2 * cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    chunks = (rank, 2 * cp - 1 - rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def cp_token_index(seq_len: int, cp: int, rank: int, device) -> torch.Tensor:
    """Positions [T / cp] that cp rank `rank` computes: chunks rank and 2*cp-1-rank of 2*cp equal
    chunks, so every rank gets the same amount of causal attention work."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    return _cp_index(seq_len, cp, rank, str(device))


def gather_sequence(t: torch.Tensor, cp_group, dim: int) -> torch.Tensor:
    """All-gather this rank's positions of a sequence (dim `dim`, T / cp long) over the cp group
    (backward: reduce-scatter) and put them in sequence order -> T long."""
    cp = dist.get_world_size(cp_group)
    seq_len = t.shape[dim] * cp
    gathered_order = torch.cat([cp_token_index(seq_len, cp, r, t.device) for r in range(cp)])
    return all_gather_tensor_autograd(t.contiguous(), dim, cp_group).index_select(dim, torch.argsort(gathered_order))


@dataclass
class ContextParallel:
    """A cp group, as a model's forward reads it (its `context`): the positions of this rank's
    queries, and the gather of a sequence's keys."""
    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def positions(self, seq_len: int, device) -> torch.Tensor:  # this rank's queries [T / cp]
        return cp_token_index(seq_len, self.size, dist.get_rank(self.group), device)

    def gather(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:  # [B, T / cp, ...] -> [B, T, ...]
        return gather_sequence(t, self.group, dim)
