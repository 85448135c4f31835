"""moe.py: grouped experts equal the per-expert loop and the plain reference, values and gradients."""

import pytest
import torch

from moe import MoE, sort_by_expert
from reference import reference_moe

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 16, 8, 12, 6, 2


def make_moe(backend="grouped", seed=0, norm_topk_prob=True):
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, INTER, SHARED, EXPERTS, TOP_K, norm_topk_prob, backend)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def run(moe, x):
    x = x.clone().requires_grad_()
    y = moe(x)
    y.backward(torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3)
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return y.detach(), x.grad, grads


def routing_cases():
    torch.manual_seed(1)
    x = torch.randn(2, 9, HIDDEN)
    return {"random": x, "single token": x[:1, :1]}


@pytest.mark.parametrize("case", ["random", "single token"])
@pytest.mark.parametrize("align", [None, 8])
def test_grouped_equals_loop(case, align):
    x = routing_cases()[case]
    grouped, loop = make_moe("grouped"), make_moe("loop")
    grouped.experts.group_align = align  # 8 exercises the padded layout CUDA uses
    y_g, dx_g, g_g = run(grouped, x)
    y_l, dx_l, g_l = run(loop, x)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-6)
    for name in g_g:
        torch.testing.assert_close(g_g[name], g_l[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_token_picks_the_same_experts():
    """A router that sends all tokens to experts 4 and 1 leaves the other experts empty."""
    grouped, loop = make_moe("grouped"), make_moe("loop")
    for moe in (grouped, loop):
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[4] = 5.0
            moe.router.weight[1] = 2.0
    x = torch.rand(3, 5, HIDDEN) + 0.1  # positive inputs: experts 4 and 1 win everywhere
    y_g, dx_g, g_g = run(grouped, x)
    y_l, dx_l, g_l = run(loop, x)
    assert grouped.router.tokens_per_expert.tolist() == [0, 15, 0, 0, 15, 0]
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-6)
    for name in g_g:
        torch.testing.assert_close(g_g[name], g_l[name], rtol=1e-5, atol=1e-6, msg=name)
    assert g_g["experts.gate_up_proj"][0].abs().max() == 0  # an expert with no tokens gets no gradient


def test_grouped_backward_gathers_and_never_scatter_adds():
    """Dispatch and combine move rows by a permutation: their backward gathers by the inverse one.
    A scatter-add there is slow compiled for the CPU and, with atomics on GPUs, not reproducible."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    moe = make_moe("grouped")
    y = moe(routing_cases()["random"].requires_grad_())
    with OpNames() as ops:
        y.sum().backward()
    assert "index_select" in ops.names
    assert not ops.names & {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put", "index_put_"}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_matches_reference(norm_topk_prob):
    moe = make_moe(norm_topk_prob=norm_topk_prob)
    x = routing_cases()["random"].reshape(-1, HIDDEN)
    shared = moe.shared_expert
    expected = reference_moe(x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj,
                             TOP_K, norm_topk_prob)
    expected = expected + shared.down_proj(torch.nn.functional.silu(shared.gate_proj(x)) * shared.up_proj(x))
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)


def test_sort_plan_pads_groups_without_overlap():
    indices = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, slots, offsets, rows = sort_by_expert(indices, num_experts=4, align=4)
    assert offsets.tolist() == [4, 8, 12, 12]  # each group padded to 4 rows, expert 3 empty
    assert rows == 6 + 4 * 3
    assert sorted(slots.tolist()) == [0, 1, 4, 8, 9, 10]
    assert indices.flatten()[order].tolist() == [0, 0, 1, 2, 2, 2]


def test_router_statistics_count_tokens():
    moe = make_moe()
    moe(torch.randn(4, 7, HIDDEN))
    counts = moe.router.tokens_per_expert
    assert counts.sum().item() == 4 * 7 * TOP_K
    assert moe.router.weight.dtype == torch.float32


def test_routed_gives_the_output_and_what_the_router_losses_read():
    """MoE.routed: forward's output, with the router's FP32 logits x @ W^T [B, T, E] and its chosen
    experts [B, T, k] (the top-k of the sigmoid scores), shaped like the tokens."""
    moe, x = make_moe(), torch.randn(3, 5, HIDDEN)
    y, logits, indices = moe.routed(x)
    assert torch.equal(y, moe(x))
    torch.testing.assert_close(logits, x @ moe.router.weight.T)
    assert torch.equal(indices, torch.topk(torch.sigmoid(logits), TOP_K, dim=-1).indices)
