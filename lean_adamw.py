"""AdamW with its moments kept in BF16 ([optim] state_dtype = "bfloat16"): 4 bytes per parameter of
optimizer state instead of 8.

torch 2.13's fused and multi-tensor AdamW refuse BF16 moments beside FP32 parameters ("expected
scalar type Float but found BFloat16"), so this step is its own, one parameter at a time: the
moments are widened to FP32, updated, and the update applied to the FP32 master weight from those
FP32 values; only what is stored is rounded. The rounding is stochastic (round up with probability
equal to the discarded fraction), so the stored moments are unbiased: with round-to-nearest, an
increment (1 - beta2) * g^2 under half a BF16 unit (2^-9 of the moment, e.g. beta2 = 0.999) would
never land and the second moment would stall. The random bits come from a generator seeded by the
step and the parameter's place, so a resumed run draws the same bits as an uninterrupted one.

    m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
    w = w * (1 - lr * weight_decay) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Each parameter's step widens its two moments (8 bytes per element, transient): the largest
parameter's shard bounds the extra memory. Not fused: an eager sequence of elementwise ops."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# a large prime: the seeds of consecutive steps' parameters never coincide below it
SEED_STRIDE = 1_000_003


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in-place ops on it update the DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """FP32 x -> BF16, rounded up (away from zero) with probability equal to the 16 low bits
    dropped: a uniform 16-bit integer is added to the bits before they are cut, so E[result] = x."""
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits = (x.contiguous().view(torch.int32) + noise) & -(1 << 16)
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def adamw_step(
    param: torch.Tensor,
    state: dict,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    generator: torch.Generator,
) -> None:
    """One AdamW step of param (its .grad) with BF16 moments state["exp_avg"], state["exp_avg_sq"]
    and state["step"] (a host FP32 scalar, as torch's AdamW keeps it)."""
    beta1, beta2 = betas
    state["step"] += 1
    step = int(state["step"])
    p, grad = local(param), local(param.grad).float()
    exp_avg = local(state["exp_avg"]).float().lerp_(grad, 1 - beta1)
    exp_avg_sq = (
        local(state["exp_avg_sq"]).float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    )
    p.mul_(1 - lr * weight_decay)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(exp_avg.to(p.dtype), denominator.to(p.dtype), value=-lr / (1 - beta1**step))
    local(state["exp_avg"]).copy_(round_stochastic(exp_avg, generator))
    local(state["exp_avg_sq"]).copy_(round_stochastic(exp_avg_sq, generator))


class BF16StatesAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) whose exp_avg and exp_avg_sq are BF16,
    stochastically rounded (module docstring). States keep their dtype through a checkpoint: saved
    as BF16, and cast back to BF16 after load_state_dict (torch's casts them to the parameter's
    dtype)."""

    def __init__(
        self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, seed: int = 0
    ):
        # torch.optim.AdamW's group keys, though this step reads only the first four: a
        # checkpoint's param groups then load into either optimizer, so a run resumes under the
        # other state_dtype (its moments cast on load)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, amsgrad=False)
        defaults.update(maximize=False, foreach=None, capturable=False, differentiable=False)
        super().__init__(groups, dict(defaults, fused=False, decoupled_weight_decay=True))
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}
        self.register_load_state_dict_post_hook(keep_bfloat16_states)

    @torch.no_grad()
    def step(self, closure=None):
        params = (param for group in self.param_groups for param in group["params"])
        groups = (group for group in self.param_groups for _ in group["params"])
        for place, (param, group) in enumerate(zip(params, groups), start=1):
            if param.grad is not None:
                step_group(self, param, group, place)


def step_group(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: dict, place: int):
    """One parameter's BF16-state AdamW step in `optimizer` (BF16StatesAdamW, or Muon's AdamW
    groups), its states made on first use; `place`: the parameter's fixed index in the optimizer,
    which with the step seeds its random bits."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
    device = local(param).device
    generator = optimizer.generators.get(device) or torch.Generator(device)
    optimizer.generators[device] = generator
    generator.manual_seed(optimizer.seed + (int(state["step"]) + 1) * SEED_STRIDE + place)
    adamw_step(
        param, state, group["lr"], group["betas"], group["eps"], group["weight_decay"], generator
    )


def keep_bfloat16_states(optimizer: torch.optim.Optimizer) -> None:
    """After load_state_dict: the moments back to BF16 (a checkpoint of FP32 moments, too)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and state[key].dtype != torch.bfloat16:
                state[key] = state[key].to(torch.bfloat16)
