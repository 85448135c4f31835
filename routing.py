"""Routing health while training: expert loads per MoE layer, a warning for idle experts, and the
aux-loss-free balancing bias.

Every router counts the tokens each expert received in its last forward (moe.Router's
tokens_per_expert). After each optimizer step the trainer sums those counts over all processes
(one small all-reduce of [layers, experts]) and hands them to `RoutingMonitor`, which
  - keeps, per expert, how many steps in a row it received no token, and warns once when an
    expert has been idle for `idle_steps` steps;
  - with `router_bias_update_rate` > 0, moves each router's selection bias towards balance, as
    DeepSeek-V3 does without an auxiliary loss: bias_e += rate * sign(mean load - load_e). The
    bias only chooses experts; the gate weights stay the unbiased scores (sigmoid or softmax);
  - reports, at logged steps, each layer's max and min load over the mean load (1.0 and 1.0:
    perfectly balanced; min 0: an expert got nothing) and every expert's token count (routed,
    before any drop), under expert capacity (capacity.py) the (token, expert) assignments
    the layer dropped, and each expert's selection bias where the run moves it.
The counts are those of the step's last micro-batch (on every data-parallel rank).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from capacity import capacity_ratio, dropped_assignments
from models import ModelConfig
from moe import Router


class RoutingMonitor:
    def __init__(self, module: torch.nn.Module, config: ModelConfig, device: torch.device, idle_steps: int,
                 is_main: bool = True):
        """module: the model (or this rank's stages); idle_steps: warn after this many (0: never)."""
        self.config, self.idle_steps, self.is_main = config, idle_steps, is_main
        # Layer index -> router, for the MoE layers this rank holds (a pipeline stage holds some).
        self.routers = {int(name.split(".")[1]): m for name, m in module.named_modules() if isinstance(m, Router)}
        self.moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self.counts = torch.zeros(config.num_hidden_layers, config.num_experts, device=device)  # [layers, E]
        factor = config.capacity_factor
        self.capacity_ratio = None if factor is None else capacity_ratio(factor)
        self.dropped = torch.zeros(config.num_hidden_layers, device=device)  # [layers] assignments past capacity
        self.idle = torch.zeros_like(self.counts, dtype=torch.long)  # steps in a row without a token
        self.idle_since = torch.zeros_like(self.idle)  # step a streak reached idle_steps, not yet reported (0: none)

    def after_step(self, step: int) -> None:
        """Gather this step's counts, update the idle streaks and the biases: all on the device (no
        host sync); a streak that reaches idle_steps is noted with its step and reported by `stats`."""
        if not self.moe_layers:
            return
        self.counts.zero_()
        for layer, router in self.routers.items():
            self.counts[layer] = router.tokens_per_expert.float()
            if self.capacity_ratio:  # per rank, before the sum: each rank drops past its own capacity
                self.dropped[layer] = dropped_assignments(router.tokens_per_expert, self.config.num_experts_per_tok,
                                                          self.capacity_ratio).sum()
        if dist.is_initialized():
            dist.all_reduce(self.counts)  # over data-parallel ranks, and the stages that hold each layer
            if self.capacity_ratio:
                dist.all_reduce(self.dropped)
        self.idle = torch.where(self.counts == 0, self.idle + 1, 0)
        if self.idle_steps:  # the step at which each streak reached idle_steps, until reported
            reached = (self.idle == self.idle_steps) & (self.idle_since == 0)
            self.idle_since = torch.where(reached, step, self.idle_since)
        rate = self.config.router_bias_update_rate
        if rate > 0:
            update_selection_bias(self.routers, self.counts, rate)

    def warn_idle(self) -> None:
        """One warning per idle streak noted since the last report, with the step it reached idle_steps."""
        since = self.idle_since.tolist()
        self.idle_since.zero_()
        for layer in self.moe_layers:
            for step in sorted({s for s in since[layer] if s}):
                experts = [e for e, s in enumerate(since[layer]) if s == step]
                if self.is_main:
                    print(f"WARNING: step {step}: layer {layer}: expert(s) {', '.join(map(str, experts))} "
                          f"received no tokens for {self.idle_steps} steps in a row (routing collapse: "
                          f"see the README's Load balancing)", file=sys.stderr, flush=True)

    def stats(self) -> dict[str, dict]:
        """At logged steps (the only time the monitor reads the device): the idle-expert warnings
        since the last call, then per MoE layer (by index) the busiest and idlest expert's load over
        the mean load, and the token count of every expert, so that a collapse shows in the record
        before it is complete."""
        if not self.moe_layers:
            return {}
        if self.idle_steps:
            self.warn_idle()
        counts = self.counts[self.moe_layers]  # [moe layers, E]
        load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-9)
        stats = {str(layer): {"max_load": round(hi, 3), "min_load": round(lo, 3), "tokens": tokens}
                 for layer, hi, lo, tokens in zip(self.moe_layers, load.max(dim=1).values.tolist(),
                                                  load.min(dim=1).values.tolist(), counts.long().tolist())}
        if self.capacity_ratio:
            for layer, dropped in zip(self.moe_layers, self.dropped[self.moe_layers].long().tolist()):
                stats[str(layer)]["dropped"] = dropped
        biases = {layer: router.selection_bias for layer, router in self.routers.items()
                  if router.selection_bias is not None}  # this rank's layers: all but under pipeline parallel
        if biases:  # report.py draws how far apart they have moved
            for layer, bias in zip(biases, torch.stack(list(biases.values())).tolist()):
                stats[str(layer)]["bias"] = [round(b, 5) for b in bias]
        return stats


def worst_layer(stats: dict[str, dict[str, float]]) -> str:
    """The log line's summary: the layer whose busiest expert is the busiest, and under expert
    capacity the assignments all layers dropped."""
    if not stats:
        return ""
    layer, worst = max(stats.items(), key=lambda item: item[1]["max_load"])
    dropped = [layer_stats["dropped"] for layer_stats in stats.values() if "dropped" in layer_stats]
    return (f" | experts max/min load {worst['max_load']:.2f}/{worst['min_load']:.2f} (layer {layer})"
            + (f", {sum(dropped)} assignments dropped" if dropped else ""))


@torch.no_grad()
def update_selection_bias(routers: dict[int, Router], counts: torch.Tensor, rate: float) -> None:
    """counts [layers, E]: each router's bias rises by `rate` for experts below the mean load and
    falls by `rate` for those above it (unchanged at exactly the mean)."""
    for layer, router in routers.items():
        load = counts[layer]
        router.selection_bias += rate * torch.sign(load.mean() - load)
