"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the hidden matrices; AdamW for
the rest.

The form modded-nanogpt and nanochat use (Keller Jordan's Muon): for each matrix parameter,
    m = beta * m + (1 - beta) * g                  (momentum, kept per element)
    u = g + beta * (m - g)                         (Nesterov: g.lerp(m, beta))
    o = NewtonSchulz5(u)                           (about the nearest semi-orthogonal matrix, U V^T)
    w = w * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * o
The iteration is the quintic X <- a X + (b A + c A A) X, A = X X^T, with (a, b, c) = (3.4445,
-4.7750, 2.0315), 5 steps, after X = u / ||u||_F (on the wide orientation: X X^T is the smaller Gram
matrix).

Which parameters: the matrices inside the blocks (attention projections, dense and shared-expert
MLPs) and the routed experts' stacked `[E, H, 2*Im]` / `[E, Im, H]` weights, orthogonalised one
expert matrix at a time (batched). The embedding, the head, norms, sinks, routers and every other
1-D parameter take AdamW.

Sharded parameters (DTensor): the experts are sharded along the expert dimension (FSDP's Shard(0) of
[E, ., .], expert parallelism's slice of E) wherever each rank gets whole experts, so it
orthogonalises the expert matrices it holds, with no communication; where FSDP splits them along dim
1 instead (fewer local experts than ranks, parallel.least_padding) they are gathered like any other
matrix. Any other sharded matrix is all-gathered (its momentum-updated gradient, one all-gather per
matrix per step), orthogonalised on every rank alike, and each rank keeps its own shard: the
communication of one extra all-gather of the matrix gradients per step, and redundant compute."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim.adamw import adamw

from lean_adamw import keep_bfloat16_states, step_group

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def newton_schulz(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """[..., rows, cols] -> the same shape, each trailing matrix approximately orthogonalised (its
    singular values pushed into about [0.7, 1.2]). In FP32 (BF16 on GPUs would do; this stays
    exact)."""
    a, b, c = NEWTON_SCHULZ
    x = update.float()
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else x.mT  # [..., small, large]
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT  # [..., small, small]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(update.dtype)


def muon_scale(shape: torch.Size) -> float:
    """sqrt(max(1, rows / cols)): an orthogonal update's RMS is 1 / sqrt(cols) when rows <= cols."""
    return math.sqrt(max(1.0, shape[-2] / shape[-1]))


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The matrices Muon updates: 2-D and 3-D weights inside the blocks, except the routers and
    sinks."""
    return (
        param.dim() >= 2
        and name.startswith("layers.")
        and ".router." not in name
        and ".sinks." not in name
        and param.requires_grad
    )


def whole_matrices_local(param: torch.Tensor) -> bool:
    """Whether this rank's piece of `param` holds whole trailing matrices (plain tensor, or a 3-D
    DTensor split along dim 0 only)."""
    if not isinstance(param, DTensor):
        return True
    return param.dim() == 3 and all(
        p.is_replicate() or (isinstance(p, Shard) and p.dim == 0) for p in param.placements
    )


def orthogonalised(update: torch.Tensor) -> torch.Tensor:
    """newton_schulz of whole matrices, gathering a DTensor whose shards split them."""
    if whole_matrices_local(update):
        local = update.to_local() if isinstance(update, DTensor) else update
        result = newton_schulz(local) * muon_scale(update.shape)
        return (
            DTensor.from_local(
                result,
                update.device_mesh,
                update.placements,
                shape=update.shape,
                stride=update.stride(),
            )
            if isinstance(update, DTensor)
            else result
        )
    full = newton_schulz(update.full_tensor()) * muon_scale(update.shape)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `muon: True`, AdamW (torch's functional step) for the others. Every
    group's lr is set by the schedule (train.set_learning_rate) as the run's lr times its
    `lr_scale`."""

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        momentum: float,
        betas: tuple[float, float],
        eps: float,
        state_dtype: str = "float32",
    ):
        super().__init__(
            groups,
            dict(
                lr=lr,
                momentum=momentum,
                betas=betas,
                eps=eps,
                weight_decay=0.0,
                muon=False,
                lr_scale=1.0,
            ),
        )
        # [optim] state_dtype: the AdamW groups' moments (lean_adamw.py); momentum stays FP32
        self.bfloat16_states, self.seed, self.generators = state_dtype == "bfloat16", 0, {}
        if self.bfloat16_states:
            self.register_load_state_dict_post_hook(keep_bfloat16_states)

    @torch.no_grad()
    def step(self, closure=None):
        place = 0  # each parameter's index in the optimizer: with the step, its seed
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            elif self.bfloat16_states:
                for index, param in enumerate(group["params"], start=place + 1):
                    if param.grad is not None:
                        step_group(self, param, group, index)
            else:
                self._adamw_step(group)
            place += len(group["params"])

    def _muon_step(self, group: dict) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            momentum = state["momentum_buffer"]
            momentum.lerp_(param.grad, 1 - group["momentum"])
            update = param.grad.lerp(momentum, group["momentum"])  # Nesterov
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(orthogonalised(update), alpha=-group["lr"])

    def _adamw_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        for param in params:
            if not self.state[param]:
                self.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param),
                    "exp_avg_sq": torch.zeros_like(param),
                }
        states = [self.state[p] for p in params]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=False,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
