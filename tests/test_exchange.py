"""moe.py's sync-free dropless exchange ([parallel] ep_exchange = "sync_free"): its static blocks,
exact against the sized exchange on gloo (values and gradients, overlapped chunks, activation
checkpointing's recompute), no host copy, equal all-to-all splits, and a block that compiles
whole."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import shard_experts, spawn
from moe import MoE, padded_send_plan, peer_block_rows, received_experts

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 16, 8, 12, 6, 2


def make_moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, INTER, SHARED, EXPERTS, TOP_K, True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def sharded(rank: int, chunks: int, exchange: str, align: int | None = None) -> MoE:
    moe = shard_experts(make_moe(), rank, 2, chunks)
    moe.experts.sync_free = exchange == "sync_free"
    moe.experts.group_align = align
    return moe


def rigged(moe: MoE, favourites: tuple[int, ...] | None) -> MoE:
    """Every (positive) token routes to the favourite experts; None: the random router."""
    if favourites is not None:
        with torch.no_grad():
            moe.router.weight.zero_()
            for place, expert in enumerate(favourites):
                moe.router.weight[expert] = 0.5 / (place + 1)
    return moe


def run(moe, x):
    x = x.clone().requires_grad_()
    y = moe(x)
    y.backward(torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3)
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in moe.named_parameters()}


# ------------------------------------------------------------------------------ the static blocks


def test_a_block_holds_the_most_rows_a_chunk_can_send_one_rank():
    """k = 2 distinct choices per token: 5 tokens can send a rank of 3 experts 10 rows, a rank of
    one expert only 5."""
    assert peer_block_rows(5, 2, 3) == 10
    assert peer_block_rows(5, 2, 1) == 5
    assert peer_block_rows(0, 2, 3) == 0


def test_the_send_plan_puts_each_rank_s_rows_first_in_its_block():
    """2 chunks, 4 experts over 2 ranks (El 2), blocks of 3 and 2 rows; keys (chunk * 4 + expert)
    worked by hand: assignments 0 and 1 go to rank 0 in chunk 0 (experts 1 and 0: sorted, 1 first),
    2 to rank 1 in chunk 0 (expert 3), 3 to rank 1 in chunk 1 (expert 2)."""
    keys = torch.tensor([1, 0, 3, 6])  # assignments 0..3
    plan = padded_send_plan(keys, [3, 2], ep=2, local_experts=2)
    # sorted: key 0 (a1), 1 (a0), 3 (a2), 6 (a3)
    assert plan.order.tolist() == [1, 0, 2, 3]
    # blocks: chunk 0 rank 0 rows 0-2, rank 1 rows 3-5; chunk 1 rank 0 rows 6-7, rank 1 rows 8-9
    assert plan.slots.tolist() == [0, 1, 3, 8]
    assert plan.offsets.tolist() == [3, 6, 8, 10] and plan.rows == 10


def test_more_rows_than_a_block_is_an_error_not_a_drop():
    """Repeated choices (which the router's top-k never makes) could overflow a block: refused."""
    with pytest.raises(RuntimeError, match="more rows to one expert rank than its block"):
        padded_send_plan(torch.tensor([0, 0, 0]), [2], ep=2, local_experts=1)


def test_received_rows_find_their_expert_from_the_device_counts():
    """Blocks of 4 rows from 2 sources, 2 local experts: source 0 sent 1 row of expert 0 and 2 of
    expert 1, source 1 none and 3; El = 2 marks an empty row."""
    counts = torch.tensor([[1, 2], [0, 3]])
    assert received_experts(counts, 4).tolist() == [0, 1, 1, 2, 1, 1, 1, 2]


# ------------------------------------------------------------------- against the sized exchange

ROUTINGS = (None, (4, 1), (1, 2))  # random; every rank's other experts idle; rank 1 receives none


class Exchanges(TorchDispatchMode):
    """The split sizes of every all-to-all started."""

    def __init__(self):
        super().__init__()
        self.splits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "all_to_all_single":
            self.splits.append((list(args[1]), list(args[2])))
        return func(*args, **(kwargs or {}))


def check_sync_free_equals_sized() -> None:
    """Every rank routes 18 tokens (a static block needs the same count on every rank; 2 tokens in
    3 chunks leave the last empty); routed at random, to experts 4 and 1 (padded groups of 8 as on
    CUDA), and to rank 0's experts only (rank 1 receives nothing). In 1, 2 and 3 chunks, eager and
    under activation checkpointing's recompute, sync_free's output, input gradient and parameter
    gradients equal the sized exchange's bit for bit (the same rows reach each expert in the same
    order), with no host copy where sized makes one per forward, and every all-to-all's splits
    equal."""
    from torch.distributed._composable import checkpoint

    from tools.profiling import HostSyncs

    rank = dist.get_rank()
    inputs = [
        torch.rand(shape, generator=torch.Generator().manual_seed(3 + rank)) + 0.1
        for shape in ((2, 9, HIDDEN), (1, 2, HIDDEN))
    ]
    uneven = {"sized": 0, "sync_free": 0}  # all-to-alls whose splits are not all equal
    for favourites in ROUTINGS:
        align = 8 if favourites == (4, 1) else None
        for chunks, x in [(1, inputs[0]), (2, inputs[0]), (3, inputs[0]), (3, inputs[1])]:
            for recompute in (False, True):
                runs, reads = {}, {}
                for exchange in ("sized", "sync_free"):
                    moe = rigged(sharded(rank, chunks, exchange, align), favourites)
                    if recompute:
                        checkpoint(moe)
                    with HostSyncs() as syncs, Exchanges() as exchanges:
                        runs[exchange] = run(moe, x)
                    reads[exchange] = syncs.reads
                    uneven[exchange] += sum(
                        len(set(send + receive)) > 1 for send, receive in exchanges.splits
                    )
                what = f"{favourites}, {x.shape}, {chunks} chunks, recompute {recompute}"
                assert reads == {"sized": ["tolist"], "sync_free": []}, (what, reads)
                (y, dx, grads), (y_ref, dx_ref, grads_ref) = runs["sync_free"], runs["sized"]
                assert torch.equal(y, y_ref), what
                assert torch.equal(dx, dx_ref), what
                for name in grads:
                    assert torch.equal(grads[name], grads_ref[name]), (what, name)
    assert uneven["sync_free"] == 0 and uneven["sized"] > 0, uneven


@pytest.mark.slow
def test_sync_free_equals_the_sized_exchange_bit_for_bit():
    spawn(2, check_sync_free_equals_sized)


def check_sync_free_compiles_whole() -> None:
    """The MoE layer compiled with fullgraph=True under sync_free: no graph break (dynamo's
    counter), output and gradients equal eager's, and a second routing reuses the graph. The sized
    exchange breaks the graph at its count exchange (one break counted), so fullgraph refuses it."""
    rank, counters = dist.get_rank(), torch._dynamo.utils.counters
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = sharded(rank, 2, "sync_free"), sharded(rank, 2, "sync_free")
    compiled.compile(backend="aot_eager", fullgraph=True)
    for seed in range(2):
        x = torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(10 * seed + rank))
        (y, dx, grads), (y_ref, dx_ref, grads_ref) = run(compiled, x), run(eager, x)
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
        for name in grads:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-6, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
    counters.clear()
    sized = sharded(rank, 2, "sized")
    sized.compile(backend="aot_eager")
    run(sized, torch.randn(2, 9, HIDDEN))
    assert sum(counters["graph_break"].values()) >= 1, dict(counters["graph_break"])
    torch._dynamo.reset()
    sized.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        sized(torch.randn(2, 9, HIDDEN))


@pytest.mark.slow
def test_sync_free_compiles_whole_where_sized_breaks_the_graph():
    spawn(2, check_sync_free_compiles_whole)


def check_unequal_token_counts_are_refused() -> None:
    """Rank 0 routes 18 tokens, rank 1 only 2: its blocks would not match, refused in one line
    before any row is sent (gloo would abort on the mismatched all-to-all)."""
    rank = dist.get_rank()
    moe = sharded(rank, 2, "sync_free")
    with pytest.raises(RuntimeError, match="needs every expert rank to route the same number"):
        moe(torch.randn((2, 9, HIDDEN) if rank == 0 else (1, 2, HIDDEN)))


@pytest.mark.slow
def test_sync_free_refuses_unequal_token_counts():
    spawn(2, check_unequal_token_counts_are_refused)


# ----------------------------------------------------------------------------- the setting itself


def test_ep_exchange_is_checked_and_named_on_the_command_line():
    from config import ConfigError, load_config

    assert (
        load_config("configs/debug.toml", ["--parallel.ep_exchange=sync_free"]).parallel.ep_exchange
        == "sync_free"
    )
    with pytest.raises(
        ConfigError, match=r"--parallel.ep_exchange: .*must be one of \['sized', 'sync_free'\]"
    ):
        load_config("configs/debug.toml", ["--parallel.ep_exchange=fast"])


def check_parallelize_passes_ep_exchange() -> None:
    """[parallel] ep_exchange through parallelize: an evaluation forward of the layout model copies
    split sizes to the host once per MoE layer when sized, never when sync_free, whose all-to-alls
    all take equal splits."""
    from helpers import (
        DEFAULT_FAMILY,
        make_batch,
        moe_layers,
        parallel_block_model,
        rows_of_this_rank,
    )
    from parallel import ParallelConfig, build_mesh, parallelize
    from tools.profiling import HostSyncs

    for exchange in ("sized", "sync_free"):
        model = parallel_block_model(DEFAULT_FAMILY)
        layers = len(moe_layers(model.config))
        cfg = ParallelConfig(ep=2, ep_exchange=exchange, param_dtype="float32")
        pm = parallelize(model, cfg, build_mesh(cfg, "cpu", model.config.num_experts))
        batch = rows_of_this_rank(pm.mesh, make_batch(vocab=model.config.vocab_size))
        with HostSyncs() as syncs, Exchanges() as exchanges:
            pm.loss(*batch)
        copies = syncs.reads.count("tolist")
        assert layers and copies == (layers if exchange == "sized" else 0), (exchange, syncs.reads)
        if exchange == "sync_free":
            assert all(len(set(s + r)) == 1 for s, r in exchanges.splits), exchanges.splits


@pytest.mark.slow
def test_parallelize_passes_ep_exchange_to_every_moe_layer():
    spawn(2, check_parallelize_passes_ep_exchange)
