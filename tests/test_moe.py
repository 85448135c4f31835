"""moe.py: grouped experts equal the per-expert loop and the plain reference, values and
gradients."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_close_to_scale, only, shard_experts, spawn
from moe import MoE, balanced_counts, set_balanced_routing, sort_by_expert
from parallel import close_distributed
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
    assert_close_to_scale(y_g, y_l, rtol=1e-5)
    assert_close_to_scale(dx_g, dx_l, rtol=1e-5)
    for name in g_g:
        assert_close_to_scale(g_g[name], g_l[name], rtol=1e-5, what=name)


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
    assert_close_to_scale(y_g, y_l, rtol=1e-5)
    assert_close_to_scale(dx_g, dx_l, rtol=1e-5)
    for name in g_g:
        assert_close_to_scale(g_g[name], g_l[name], rtol=1e-5, what=name)
    # an expert with no tokens gets no gradient
    assert g_g["experts.gate_up_proj"][0].abs().max() == 0


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
    assert not ops.names & {
        "index_add",
        "index_add_",
        "scatter_add",
        "scatter_add_",
        "index_put",
        "index_put_",
    }


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_matches_reference(norm_topk_prob):
    moe = make_moe(norm_topk_prob=norm_topk_prob)
    x = routing_cases()["random"].reshape(-1, HIDDEN)
    shared = moe.shared_expert
    expected = reference_moe(
        x, moe.router.weight, moe.experts.gate_up_proj, moe.experts.down_proj, TOP_K, norm_topk_prob
    )
    expected = expected + shared.down_proj(
        torch.nn.functional.silu(shared.gate_proj(x)) * shared.up_proj(x)
    )
    assert_close_to_scale(moe(x), expected, rtol=1e-5)


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


# ------------------------------------------------------------------ forced balance, expert parallel


def balanced_reference(x, router_w, gate_up, down, top_k, norm_topk_prob):
    """Forced balance by hand: the j-th choice of token n is expert (n * k + j) mod E, weighed by
    its sigmoid score (renormalised over the token's choices)."""
    num_experts, im = router_w.shape[0], down.shape[1]
    rows = []
    for n in range(x.shape[0]):
        experts = [(n * top_k + j) % num_experts for j in range(top_k)]
        scores = [torch.sigmoid(x[n] @ router_w[e]) for e in experts]
        total = sum(scores) if norm_topk_prob else 1.0
        y = torch.zeros(x.shape[1])
        for e, score in zip(experts, scores):
            hidden = F.silu(x[n] @ gate_up[e, :, :im]) * (x[n] @ gate_up[e, :, im:])
            y = y + score / total * (hidden @ down[e])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_forced_balance_routes_round_robin_by_the_real_scores(norm_topk_prob):
    moe = make_moe(norm_topk_prob=norm_topk_prob)
    set_balanced_routing(moe, True)
    # 18 tokens x 2 choices over 6 experts: 6 each
    x = routing_cases()["random"].reshape(-1, HIDDEN)
    y, dx, grads = run(moe, x)
    assert (
        moe.router.tokens_per_expert.tolist()
        == [6] * EXPERTS
        == balanced_counts(18 * TOP_K, EXPERTS)
    )
    reference = make_moe(norm_topk_prob=norm_topk_prob)
    params = dict(reference.named_parameters())
    x_ref = x.clone().requires_grad_()
    expected = balanced_reference(
        x_ref,
        params["router.weight"],
        params["experts.gate_up_proj"],
        params["experts.down_proj"],
        TOP_K,
        norm_topk_prob,
    ) + reference.shared_expert(x_ref)
    expected.backward(
        torch.ones_like(expected) + torch.arange(expected.numel()).view_as(expected) * 1e-3
    )
    assert_close_to_scale(y, expected.detach(), rtol=1e-5)
    assert_close_to_scale(dx, x_ref.grad, rtol=1e-5)
    for name, param in params.items():
        assert_close_to_scale(grads[name], param.grad, 1e-5, name)  # FP32 sums in another order
    assert grads["router.weight"].abs().max() > 0  # the router still learns
    assert balanced_counts(7, 3) == [3, 2, 2]


def expert_parallel_moe(rank: int, ep: int, norm_topk_prob: bool = True, chunks: int = 2) -> MoE:
    """make_moe's layer with its experts sharded: this rank holds E / ep of them."""
    return shard_experts(make_moe(norm_topk_prob=norm_topk_prob), rank, ep, chunks)


def test_forced_balance_reads_nothing_from_the_device_under_expert_parallelism():
    """On fake tensors over a fake world of 2, where any host read of a device value raises: the
    forward and backward of an expert-parallel layer pass under forced balance, and fail without."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with FakeTensorMode():
            moe = expert_parallel_moe(rank=0, ep=2)
            x = torch.randn(2, 9, HIDDEN, requires_grad=True)
            set_balanced_routing(moe, True)
            moe(x).sum().backward()
            assert moe.experts.gate_up_proj.grad.shape == (EXPERTS // 2, HIDDEN, 2 * INTER)
            set_balanced_routing(moe, False)
            with pytest.raises(DataDependentOutputException):
                moe(x)
    finally:
        close_distributed()


def check_forced_balance_on_two_ranks(norm_topk_prob: bool) -> None:
    rank = dist.get_rank()
    inputs = [
        torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(r)) for r in range(2)
    ]
    references = [make_moe(norm_topk_prob=norm_topk_prob) for _ in inputs]
    expected = []
    for reference, x in zip(references, inputs):
        set_balanced_routing(reference, True)
        expected.append(run(reference, x))
    moe = expert_parallel_moe(rank, ep=2, norm_topk_prob=norm_topk_prob)
    set_balanced_routing(moe, True)
    y, dx, grads = run(moe, inputs[rank])
    y_ref, dx_ref, grads_ref = expected[rank]
    assert_close_to_scale(y, y_ref, rtol=1e-5)
    assert_close_to_scale(dx, dx_ref, rtol=1e-5)
    mine = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    for name, grad in grads.items():  # the experts' gradients gather both ranks' tokens
        want = (
            sum(g[name][mine] for _, _, g in expected)
            if name.startswith("experts.")
            else grads_ref[name]
        )
        assert_close_to_scale(grad, want, rtol=1e-5, what=name)


def check_compiled_routing_changes_without_recompiling() -> None:
    """Compiled (dynamo only), the layer's graphs after its first call serve every later routing:
    the exchanged rows' count is dynamic from the start, the split sizes are never guarded on."""
    rank, counters = dist.get_rank(), torch._dynamo.utils.counters
    eager, compiled = expert_parallel_moe(rank, ep=2), expert_parallel_moe(rank, ep=2)
    # as parallel.apply_compile sets them: the split sizes, read inside the graph, are unbacked
    # integers
    torch._dynamo.config.capture_scalar_outputs = (
        torch._dynamo.config.capture_dynamic_output_shape_ops
    ) = True
    compiled.compile(backend="eager")
    loads, graphs = [], []
    for seed in range(3):
        x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(10 * seed + rank))
        want, got = run(eager, x), run(compiled, x)
        assert_close_to_scale(got[0], want[0], rtol=1e-6)
        assert_close_to_scale(got[1], want[1], rtol=1e-6)
        loads.append(compiled.router.tokens_per_expert.tolist())
        graphs.append(counters["stats"]["unique_graphs"])
    assert len({tuple(load) for load in loads}) == 3, loads  # the splits did change
    assert graphs[0] == graphs[-1], graphs


def check_expert_parallel_on_two_ranks() -> None:
    check_forced_balance_on_two_ranks(norm_topk_prob=True)
    check_compiled_routing_changes_without_recompiling()


@pytest.mark.slow
def test_expert_parallel_forced_balance_equals_one_process_and_compiles_once():
    spawn(2, check_expert_parallel_on_two_ranks)


def test_routed_gives_the_output_and_what_the_router_losses_read():
    """MoE.routed: forward's output, with the router's FP32 logits x @ W^T [B, T, E] and its chosen
    experts [B, T, k] (the top-k of the sigmoid scores), shaped like the tokens."""
    moe, x = make_moe(), torch.randn(3, 5, HIDDEN)
    y, logits, indices = moe.routed(x)
    assert torch.equal(y, moe(x))
    torch.testing.assert_close(logits, x @ moe.router.weight.T)
    assert torch.equal(indices, torch.topk(torch.sigmoid(logits), TOP_K, dim=-1).indices)


def test_a_recompute_reuses_its_forwards_splits_and_nothing_goes_stale():
    """Activation checkpointing recomputes an expert-parallel layer in backward (here ep = 1 in a
    group of one): the recompute copies nothing to the host (its forward's splits are reused), an
    abandoned forward's splits die with its graph, and a recompute out of forward order is
    refused."""
    import gc

    from torch.distributed._composable import checkpoint

    from tools.profiling import HostSyncs

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain, recomputed = expert_parallel_moe(0, ep=1), expert_parallel_moe(0, ep=1)
        checkpoint(recomputed)
        first, second = (
            torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(s)) for s in (1, 2)
        )
        recomputed(first.requires_grad_())  # abandoned: its graph, and so its splits, are dropped
        gc.collect()
        assert not recomputed.experts.recompute_splits.entries
        with HostSyncs() as syncs:
            y, dx, grads = run(recomputed, second)
        assert syncs.reads == ["tolist"]  # the forward's; the recompute's came from the forward
        y_ref, dx_ref, grads_ref = run(plain, second)
        assert_close_to_scale(dx, dx_ref, rtol=1e-6)
        for name in grads:
            assert_close_to_scale(grads[name], grads_ref[name], rtol=1e-6, what=name)
        early, late = (
            recomputed(first.clone().requires_grad_()),
            recomputed(second.clone().requires_grad_()),
        )
        with pytest.raises(RuntimeError, match="a recompute routed differently from its forward"):
            late.sum().backward()  # recomputes `late` first, with `early`'s splits
        del early
    finally:
        close_distributed()


# ------------------------------------------------------------------------- rows to experts and back


def plain_routed_moe(x, params, top_k, score_function, scaling):
    """Routed experts plus the shared expert, token by token, from the contract: the router's
    sigmoid (Flint: top-k renormalised) or softmax (Large 4: the chosen k renormalised with 1e-20
    in the denominator, times `scaling`), each chosen expert's output weighted AFTER its down
    projection and summed."""
    gate_up, down = params["experts.gate_up_proj"], params["experts.down_proj"]
    im = down.shape[1]
    logits = x @ params["router.weight"].T  # [N, E]
    rows = []
    for n in range(x.shape[0]):
        scores = (
            torch.softmax(logits[n], -1)
            if score_function == "softmax"
            else torch.sigmoid(logits[n])
        )
        weights, experts = torch.topk(scores, top_k)
        if score_function == "softmax":
            weights = weights / (weights.sum() + 1e-20) * scaling
        else:
            weights = weights / weights.sum()
        y = torch.zeros(x.shape[1])
        for weight, e in zip(weights, experts.tolist()):
            hidden = F.silu(x[n] @ gate_up[e, :, :im]) * (x[n] @ gate_up[e, :, im:])
            y = y + weight * (hidden @ down[e])
        shared = F.silu(x[n] @ params["shared_expert.gate_proj.weight"].T) * (
            x[n] @ params["shared_expert.up_proj.weight"].T
        )
        rows.append(y + shared @ params["shared_expert.down_proj.weight"].T)
    return torch.stack(rows)


def idle_experts(moe: MoE) -> MoE:
    """A router that sends every (positive) token to experts 4 and 1: the others get no row."""
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[4] = 0.5
        moe.router.weight[1] = 0.2
    return moe


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("align", [None, 8])
@pytest.mark.parametrize("routing", ["random", "idle experts"])
def test_weighting_before_the_down_projection_equals_the_plain_loop(score_function, align, routing):
    """The weight scales each expert's hidden row before its down projection; the contract weights
    the output after it. Flint's and Large 4's routers, unpadded and padded groups (as on CUDA),
    and experts that receive no token: values and every gradient equal a token-by-token loop."""
    torch.manual_seed(0)
    moe = MoE(
        HIDDEN, INTER, SHARED, EXPERTS, TOP_K, True, score_function=score_function, scaling=2.5
    )
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = routing_cases()["random"]
    if routing == "idle experts":
        idle_experts(moe)
        x = x.abs() + 0.1
    moe.experts.group_align = align
    y, dx, grads = run(moe, x)
    if routing == "idle experts":
        assert moe.router.tokens_per_expert.tolist() == [0, 18, 0, 0, 18, 0]
    params = {name: p.detach().clone().requires_grad_() for name, p in moe.named_parameters()}
    x_ref = x.reshape(-1, HIDDEN).clone().requires_grad_()
    expected = plain_routed_moe(x_ref, params, TOP_K, score_function, 2.5)
    expected.backward(
        (torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3).view_as(expected)
    )
    assert_close_to_scale(y.view_as(expected), expected.detach(), rtol=1e-5)
    assert_close_to_scale(dx.view_as(x_ref), x_ref.grad, rtol=1e-5)
    for name, param in params.items():
        assert_close_to_scale(grads[name], param.grad, rtol=1e-5, what=name)


def row_maps() -> dict:
    """RowMaps of each kind for 5 tokens x 2 choices over 4 experts (expert 3 chosen by nobody)."""
    from capacity import plan_capacity
    from moe import RowMap, expert_rows

    indices = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1], [1, 0]])
    plan = plan_capacity(indices, num_experts=4, capacity=2)  # expert 2's third assignment drops
    kept = plan.slots < 8
    capacity_map = RowMap(
        plan.sources, torch.where(kept, plan.slots, 0).view(5, 2), kept.view(5, 2), True
    )
    return {
        "sorted": expert_rows(sort_by_expert(indices, 4, 1), 2),
        "padded": expert_rows(sort_by_expert(indices, 4, 4), 2),
        "capacity": capacity_map,
    }


@pytest.mark.parametrize("kind", ["sorted", "padded", "capacity"])
def test_dispatch_and_combine_are_each_others_transpose(kind):
    """dispatch puts each token's row in the rows its assignments hold (zero rows elsewhere),
    combine sums each token's rows over its kept choices, and each one's backward is exactly the
    other."""
    from moe import combine, dispatch

    rows = row_maps()[kind]
    x = torch.randn(5, 3, requires_grad=True)
    out = torch.randn(rows.choice_of_row.numel(), 3, requires_grad=True)
    dispatched, combined = dispatch(x, rows), combine(out, rows)
    for r, choice in enumerate(rows.choice_of_row.tolist()):  # by hand, row by row
        assert torch.equal(dispatched[r], x[choice // 2] if choice < 10 else torch.zeros(3))
    kept = torch.ones(5, 2, dtype=torch.bool) if rows.kept is None else rows.kept
    for n in range(5):
        want = sum((out[rows.row_of_choice[n, j]] for j in range(2) if kept[n, j]), torch.zeros(3))
        assert_close_to_scale(combined[n], want, rtol=1e-6)
    assert kind != "capacity" or not kept.all()  # the capacity map drops one assignment
    grad_rows, grad_tokens = torch.randn_like(dispatched), torch.randn_like(combined)
    dispatched.backward(grad_rows)
    combined.backward(grad_tokens)
    assert torch.equal(x.grad, combine(grad_rows, rows))
    assert torch.equal(out.grad, dispatch(grad_tokens, rows))


@pytest.mark.parametrize("path", ["padded", "capacity", "expert parallel"])
def test_every_routed_path_gathers_in_backward(path):
    """Padded groups (CUDA), capacity and the expert-parallel layer (one rank): their backward
    moves rows by gathers only, never a scatter-add (see test_grouped_backward_gathers_...)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    if path == "expert parallel":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if path == "capacity":
            torch.manual_seed(0)
            moe = MoE(HIDDEN, INTER, SHARED, EXPERTS, TOP_K, True, capacity_factor=0.5)
        else:
            moe = expert_parallel_moe(0, ep=1) if path == "expert parallel" else make_moe()
            moe.experts.group_align = 8
        y = moe(routing_cases()["random"].requires_grad_())
        with OpNames() as ops:
            y.sum().backward()
    finally:
        if path == "expert parallel":
            close_distributed()
    assert "index_select" in ops.names
    assert not ops.names & {
        "index_add",
        "index_add_",
        "scatter_add",
        "scatter_add_",
        "index_put",
        "index_put_",
    }


def check_expert_parallel_padded_with_idle_experts() -> None:
    """Real routing over 2 ranks with local groups padded to 8 rows (as on CUDA): experts 4 and 1
    take every token, so each rank has idle local experts (empty padded groups); then every token
    goes to rank 0's experts 1 and 2, and rank 1 receives no row at all."""
    rank = dist.get_rank()
    inputs = [
        torch.rand(2, 9, HIDDEN, generator=torch.Generator().manual_seed(r)) + 0.1 for r in range(2)
    ]
    for favourites in ((4, 1), (1, 2)):

        def rigged(moe):
            with torch.no_grad():
                moe.router.weight.zero_()
                moe.router.weight[favourites[0]] = 0.5
                moe.router.weight[favourites[1]] = 0.2
            return moe

        expected = [run(rigged(make_moe()), x) for x in inputs]
        moe = rigged(expert_parallel_moe(rank, ep=2))
        moe.experts.group_align = 8
        y, dx, grads = run(moe, inputs[rank])
        assert_close_to_scale(y, expected[rank][0], rtol=1e-5)
        assert_close_to_scale(dx, expected[rank][1], rtol=1e-5)
        mine = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
        for name, grad in grads.items():
            want = (
                sum(g[name][mine] for _, _, g in expected)
                if name.startswith("experts.")
                else expected[rank][2][name]
            )
            assert_close_to_scale(grad, want, rtol=1e-5, what=name)


def test_expert_parallel_with_padded_groups_and_idle_experts_equals_one_process():
    from helpers import spawn

    spawn(2, check_expert_parallel_padded_with_idle_experts)


# ------------------------------------------------------------------- the overlapped expert exchange


def rigged(moe: MoE, favourites: tuple[int, ...]) -> MoE:
    """Every (positive) token routes to the favourite experts, the first ones first."""
    with torch.no_grad():
        moe.router.weight.zero_()
        for rank, expert in enumerate(favourites):
            moe.router.weight[expert] = 0.5 / (rank + 1)
    return moe


def check_overlapped_exchange_with_uneven_routing() -> None:
    """Rank 0 routes 18 tokens, rank 1 only 2: in 3 chunks, rank 1's last chunk is empty. Routed at
    random; to experts 4 and 1 (each rank's other experts idle, local groups padded to 8 rows as on
    CUDA); and to rank 0's experts 1 and 2 (rank 1 receives no row in any chunk). For every chunk
    count, each rank's output, input gradient and every parameter gradient equal one process's (the
    experts' summed over both ranks' tokens), and the overlapped runs equal the one-chunk run."""
    rank = dist.get_rank()
    inputs = [
        torch.rand(2, 9, HIDDEN, generator=torch.Generator().manual_seed(3)) + 0.1,
        torch.rand(1, 2, HIDDEN, generator=torch.Generator().manual_seed(4)) + 0.1,
    ]
    mine = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    for favourites in (None, (4, 1), (1, 2)):

        def layer(moe):
            return moe if favourites is None else rigged(moe, favourites)

        expected = [run(layer(make_moe()), x) for x in inputs]
        want_grads = {
            name: sum(g[name][mine] for _, _, g in expected)
            if name.startswith("experts.")
            else expected[rank][2][name]
            for name in expected[rank][2]
        }
        runs = {}
        for chunks in (1, 2, 3):
            moe = layer(expert_parallel_moe(rank, ep=2, chunks=chunks))
            moe.experts.group_align = 8 if favourites == (4, 1) else None
            runs[chunks] = y, dx, grads = run(moe, inputs[rank])
            what = f"{favourites} in {chunks} chunks"
            assert_close_to_scale(y, expected[rank][0], rtol=1e-5, what=what)
            assert_close_to_scale(dx, expected[rank][1], rtol=1e-5, what=what)
            for name, grad in grads.items():
                assert_close_to_scale(grad, want_grads[name], rtol=1e-5, what=f"{what}: {name}")
        for chunks in (2, 3):  # the same sums, but over fewer rows at a time: FP32 rounding apart
            what = f"{favourites}: {chunks} chunks against 1"
            assert_close_to_scale(runs[chunks][0], runs[1][0], rtol=1e-6, what=what)
            assert_close_to_scale(runs[chunks][1], runs[1][1], rtol=1e-6, what=what)
            for name, grad in runs[chunks][2].items():
                assert_close_to_scale(grad, runs[1][2][name], rtol=1e-6, what=f"{what}: {name}")


def test_the_overlapped_exchange_equals_one_process_with_uneven_routing():
    spawn(2, check_overlapped_exchange_with_uneven_routing)


class ScheduleLog(TorchDispatchMode):
    """The order of what runs: S<rows> an all-to-all started (its input rows), W<rows> one waited
    for (its rows), M a matmul (router, shared expert), G and g the grouped GEMMs and their weight
    gradients."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("all_to_all_single", "wait_tensor"):
            self.events.append(f"{'S' if name == 'all_to_all_single' else 'W'}{args[0].shape[0]}")
        elif name in ("mm", "grouped_mm", "grouped_mm_weight_grad"):
            self.events.append({"mm": "M", "grouped_mm": "G", "grouped_mm_weight_grad": "g"}[name])
        return func(*args, **(kwargs or {}))


def documented_schedule(sent: list[int], received: list[int]) -> tuple[list[str], list[str]]:
    """ExpertParallelExperts' schedule, written out from its docstring, for chunks that send sent[c]
    rows and receive received[c]: forward, then backward (one process's events)."""
    n, forward, backward = len(sent), ["M", f"S{sent[0]}", f"S{sent[0]}", "M", "M", "M"], []
    for c in range(n):
        if c + 1 < n:
            forward += [f"S{sent[c + 1]}"] * 2  # start dispatch c+1 (rows, weights)
        # wait dispatch c, experts, combine c
        forward += [f"W{received[c]}"] * 2 + ["G", "G", f"S{received[c]}"]
    forward += [f"W{sent[c]}" for c in range(n)]
    backward += [f"S{sent[c]}" for c in reversed(range(n))]  # the combines' gradients start
    for c in reversed(range(n)):
        backward += [f"W{received[c]}", "G", "g", "G", "g", f"S{received[c]}", f"S{received[c]}"]
        if c + 1 < n:
            backward += [f"W{sent[c + 1]}"] * 2  # dispatch c+1's gradients
    # shared, dispatch 0, router
    return forward, backward + ["M"] * 6 + [f"W{sent[0]}"] * 2 + ["M", "M"]


def check_the_schedule_is_the_documented_one() -> None:
    """Forced balance (so the rows of each chunk are known) over 2 ranks of 9 tokens, 6 experts,
    top 2: rank 0's chunks of 5 and 4 tokens send 10 and 8 rows and receive 12 and 6 (in 3 chunks:
    6 each way each). The events in forward and backward are the documented schedule's."""

    def received(tokens: range) -> int:  # both ranks send the same: rank 0 holds experts 0-2
        return 2 * sum(
            (token * TOP_K + choice) % EXPERTS < EXPERTS // 2
            for token in tokens
            for choice in range(TOP_K)
        )

    chunked = {
        1: [range(0, 9)],
        2: [range(0, 5), range(5, 9)],
        3: [range(0, 3), range(3, 6), range(6, 9)],
    }
    for chunks, pieces in chunked.items():
        moe = expert_parallel_moe(dist.get_rank(), ep=2, chunks=chunks)
        set_balanced_routing(moe, True)
        x = torch.randn(1, 9, HIDDEN, requires_grad=True)
        with ScheduleLog() as forward:
            y = moe(x)
        with ScheduleLog() as backward:
            y.sum().backward()
        if dist.get_rank() == 0:
            expected = documented_schedule(
                [TOP_K * len(piece) for piece in pieces], [received(p) for p in pieces]
            )
            assert (forward.events, backward.events) == expected, (
                chunks,
                forward.events,
                backward.events,
            )


def test_the_overlapped_exchange_runs_the_documented_schedule():
    spawn(2, check_the_schedule_is_the_documented_one)


def check_parallelize_exchanges_in_ep_overlap_chunks() -> None:
    """[parallel] ep_overlap through parallelize: an evaluation forward of the layout model starts
    3 all-to-alls per chunk in each MoE layer (the rows, their routing weights, the outputs back:
    the count exchange is not one of them), so n chunks start 3 n."""
    from helpers import (
        DEFAULT_FAMILY,
        make_batch,
        moe_layers,
        parallel_block_model,
        rows_of_this_rank,
    )
    from parallel import ParallelConfig, build_mesh, parallelize

    for chunks in (1, 3):
        model = parallel_block_model(DEFAULT_FAMILY)
        layers = len(moe_layers(model.config))
        cfg = ParallelConfig(ep=2, ep_overlap=chunks, param_dtype="float32")
        pm = parallelize(model, cfg, build_mesh(cfg, "cpu", model.config.num_experts))
        batch = rows_of_this_rank(pm.mesh, make_batch(vocab=model.config.vocab_size))
        with ScheduleLog() as log:
            pm.loss(*batch)
        started = sum(event.startswith("S") for event in log.events)
        assert layers and started == 3 * chunks * layers, (chunks, layers, log.events)


def test_parallelize_exchanges_the_experts_rows_in_ep_overlap_chunks():
    spawn(2, check_parallelize_exchanges_in_ep_overlap_chunks)


@only("flint")
def test_the_model_s_routers_take_norm_topk_prob_from_its_config():
    """[model] norm_topk_prob reaches every router of the model: each token's top-k weights (seen by
    a forward hook) sum to 1 with it; without it they are the k chosen sigmoid scores, whose sums
    differ from 1 by up to 0.1 on these tokens."""
    from helpers import build, make_batch, tiny_config
    from moe import Router

    sums = {}
    for norm in (True, False):
        config = tiny_config("flint", norm_topk_prob=norm)
        model = build(config)
        weights = []
        for router in filter(lambda m: isinstance(m, Router), model.modules()):
            router.register_forward_hook(lambda module, args, out: weights.append(out[0].sum(-1)))
        ids, targets, doc_ids = make_batch(vocab=config.vocab_size)
        model(ids, targets, doc_ids)
        sums[norm] = torch.cat(weights)
    assert len(sums[True]) == len(sums[False]) > 0
    torch.testing.assert_close(sums[True], torch.ones_like(sums[True]))
    assert (sums[False] - 1).abs().max() > 0.05, sums[False]
