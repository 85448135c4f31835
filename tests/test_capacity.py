"""capacity.py: expert capacity drops exactly what a plain per-token loop drops, equals dropless
when nothing drops, and under expert parallelism equals one process, compiles whole and reads
nothing from the device."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from capacity import capacity_ratio, dropped_assignments, expert_capacity, plan_capacity
from config import load_config
from helpers import (
    FAMILY_NAMES,
    FIRST_FAMILY_THEN_SECOND_TIER,
    assert_close_to_scale,
    build,
    check_layouts,
    closing,
    debug_args,
    only,
    registered,
    run_two_processes,
    shard_experts,
    spawn,
    step_host_syncs,
    tiny_config,
    values_and_grads,
)
from moe import GroupedExperts, MoE
from parallel import close_distributed
from registry import family

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 16, 8, 12, 6, 2
NO_DROP = EXPERTS / TOP_K  # C = ceil(N * k / E * E / k) = N: an expert takes every token


def make_moe(factor=None, backend="grouped", seed=0):
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, INTER, SHARED, EXPERTS, TOP_K, True, backend, capacity_factor=factor)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def tokens(seed=1, batch=2, seq=9):
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(moe, x):
    """Output, input gradient and parameter gradients of a fixed, uneven projection of the
    output."""
    x = x.clone().requires_grad_()
    y = moe(x)
    y.backward(torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3)
    return y.detach(), x.grad, {name: p.grad.clone() for name, p in moe.named_parameters()}


def assert_runs_equal(got, want, rtol=1e-5):
    assert_close_to_scale(got[0], want[0], rtol, "output")
    assert_close_to_scale(got[1], want[1], rtol, "input gradient")
    for name in want[2]:
        assert_close_to_scale(got[2][name], want[2][name], rtol, name)


def capacity_reference(x, router_w, gate_up, down, top_k, factor):
    """Routed experts with capacity, by hand: tokens in order, each expert counting the tokens it
    has taken and refusing any past ceil(factor * N * k / E); a refused choice adds nothing and the
    kept weights stay as the router gave them (sigmoid top-k, renormalised over all k). -> [N, H]
    and the refused (token, expert) pairs."""
    num_tokens, num_experts, im = x.shape[0], router_w.shape[0], down.shape[1]
    capacity = math.ceil(factor * num_tokens * top_k / num_experts)
    taken = [0] * num_experts
    rows, refused = [], []
    for n in range(num_tokens):
        scores = torch.sigmoid(x[n] @ router_w.T)  # [E]
        weights, experts = torch.topk(scores, top_k)
        weights = weights / weights.sum()
        y = torch.zeros(x.shape[1])
        for weight, e in zip(weights, experts.tolist()):
            if taken[e] == capacity:
                refused.append((n, e))
                continue
            taken[e] += 1
            hidden = F.silu(x[n] @ gate_up[e, :, :im]) * (x[n] @ gate_up[e, :, im:])
            y = y + weight * (hidden @ down[e])
        rows.append(y)
    return torch.stack(rows), refused


def run_reference(moe, x, factor):
    params = dict(moe.named_parameters())
    x = x.clone().requires_grad_()
    routed, refused = capacity_reference(
        x,
        params["router.weight"],
        params["experts.gate_up_proj"],
        params["experts.down_proj"],
        TOP_K,
        factor,
    )
    y = routed + moe.shared_expert(x)
    y.backward(torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3)
    return (y.detach(), x.grad, {name: p.grad.clone() for name, p in params.items()}), refused


def test_a_factor_large_enough_to_drop_nothing_equals_dropless():
    x = tokens()
    dropless = run(make_moe(), x)
    for factor in (NO_DROP, 10.0):
        capped = make_moe(factor)
        assert_runs_equal(run(capped, x), dropless)
        assert (
            dropped_assignments(
                capped.router.tokens_per_expert, TOP_K, capacity_ratio(factor)
            ).sum()
            == 0
        )


@pytest.mark.parametrize("factor", [0.25, 0.75, 1.0])
@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_a_small_factor_drops_exactly_what_the_plain_reference_drops(factor, backend):
    moe, x = make_moe(factor, backend), tokens().reshape(-1, HIDDEN)  # 18 tokens
    want, refused = run_reference(make_moe(factor), x, factor)
    assert refused  # the factor does drop
    assert_runs_equal(run(moe, x), want)
    indices = moe.router(x)[1]
    plan = plan_capacity(
        indices, EXPERTS, expert_capacity(18, TOP_K, EXPERTS, capacity_ratio(factor))
    )
    dropped = (plan.slots == plan.sources.numel()).view(18, TOP_K)  # the dropped row E * C
    assert sorted((n, int(indices[n, j])) for n, j in dropped.nonzero().tolist()) == sorted(refused)
    per_expert = dropped_assignments(moe.router.tokens_per_expert, TOP_K, capacity_ratio(factor))
    assert per_expert.tolist() == [
        sum(e == expert for _, e in refused) for expert in range(EXPERTS)
    ]


def test_plan_keeps_the_earliest_tokens_and_leaves_empty_rows_empty():
    indices = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 1]])  # assignments 0..7
    sources, slots = plan_capacity(indices, num_experts=3, capacity=2)
    assert sources.tolist() == [1, 4, 3, 7, 0, 2]  # expert 0: tokens 0, 2; 1: 1, 3; 2: tokens 0, 1
    assert slots.tolist() == [4, 0, 5, 2, 1, 6, 6, 3]  # token 2's and 3's expert 2 dropped (row 6)
    # capacity ceil(1.5 * 4 * 2 / 3) = 4, ceil(0.75 * 8 / 3) = 2
    counts = torch.tensor([2.0, 2.0, 4.0])
    assert dropped_assignments(counts, 2, (3, 2)).tolist() == [0, 0, 0]
    assert dropped_assignments(counts, 2, (3, 4)).tolist() == [0, 0, 2]
    sources, slots = plan_capacity(indices[:1], num_experts=3, capacity=2)
    assert sources.tolist() == [1, 2, 2, 2, 0, 2] and slots.tolist() == [4, 0]  # 2: the empty row


def test_capacity_is_the_ceiling_of_the_factor_as_written():
    assert capacity_ratio(1.1) == (11, 10) and capacity_ratio(2) == (2, 1)
    # float 1.1 * 100 / 10 = 11.000000000000002
    assert expert_capacity(100, 1, 10, capacity_ratio(1.1)) == 11
    assert expert_capacity(18, 2, 6, capacity_ratio(1.25)) == 8  # ceil(7.5)
    assert expert_capacity(1, 2, 6, capacity_ratio(0.01)) == 1


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_capacity_factor_is_a_runtime_field_checked_by_name(name):
    config_class = family(name).config
    assert config_class().capacity_factor is None
    assert "capacity_factor" not in str(config_class(capacity_factor=1.5).to_hf_config())
    for bad in (0, -1.0, True, "1.25"):
        with pytest.raises(
            ValueError,
            match=r"capacity_factor must be a finite number > 0 .* or "
            r"unset for dropless",
        ):
            config_class(capacity_factor=bad)


@only("flint")  # configs/finetune.toml
def test_a_run_may_set_the_capacity_factor_over_an_init_from_checkpoint(tmp_path):
    """A run setting, not the architecture: allowed with init_from, whose config.json never holds
    it."""
    from flint_model import FlintConfig

    (tmp_path / "config.json").write_text(
        json.dumps(FlintConfig.from_name("tiny", capacity_factor=2.0).to_hf_config())
    )
    finetune = Path(__file__).resolve().parent.parent / "configs" / "finetune.toml"
    cfg = load_config(finetune, [f"--model.init_from={tmp_path}", "--model.capacity_factor=1.25"])
    assert cfg.model_config.capacity_factor == 1.25
    assert (
        load_config(finetune, [f"--model.init_from={tmp_path}"]).model_config.capacity_factor
        is None
    )


@pytest.mark.parametrize(
    "name, preset", registered({"flint": "tiny", "large4": "large4-parity"}).items()
)
def test_models_route_their_moe_layers_with_the_configured_capacity(name, preset):
    config_class = family(name).config
    ids = torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for factor in (None, 100.0, 0.5):
        config = config_class.from_name(preset, capacity_factor=factor)
        model = build(config, plain=True)
        assert {m.capacity_factor for m in model.modules() if isinstance(m, GroupedExperts)} == {
            factor
        }
        logits[factor] = model(ids)
    torch.testing.assert_close(logits[100.0], logits[None], rtol=1e-5, atol=1e-5)
    assert (logits[0.5] - logits[None]).abs().max() > 1e-3


@only("flint")  # capacity_reference routes by sigmoid scores, as Flint's router does
def test_the_routing_record_gives_each_layer_its_dropped_assignments():
    """RoutingMonitor's stats under capacity: each MoE layer's dropped assignments, as many as the
    plain reference refuses for that layer's input (balance.py derives them from the router's
    counts)."""
    from balance import RoutingMonitor, worst_layer

    factor = 0.5
    config = tiny_config("flint", capacity_factor=factor)  # 4 layers
    model, inputs = build(config), {}
    for index, layer in model.layers.items():
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_forward_hook(
                lambda module, args, out, index=index: inputs.update({index: args[0]})
            )
    model(torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0)))
    monitor = RoutingMonitor(model, config, torch.device("cpu"), idle_steps=0)
    monitor.after_step(1)
    stats = monitor.stats()
    assert sorted(stats) == sorted(inputs) == ["2", "3"]
    for index, x in inputs.items():
        mlp = model.layers[index].mlp
        with torch.no_grad():
            _, refused = capacity_reference(
                x.reshape(-1, x.shape[-1]),
                mlp.router.weight,
                mlp.experts.gate_up_proj,
                mlp.experts.down_proj,
                config.num_experts_per_tok,
                factor,
            )
        assert stats[index]["dropped"] == len(refused) > 0, index
    assert worst_layer(stats).endswith(
        f", {stats['2']['dropped'] + stats['3']['dropped']} assignments dropped"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_capacity_moe_layer_compiles_to_one_graph(name, one_thread):
    """With static [E, C, H] buffers each family's MoE layer (router, experts under capacity, shared
    expert) is one graph (fullgraph), equal to eager."""
    config = tiny_config(name, capacity_factor=1.0)
    layer = build(config).layers["2"].mlp  # an MoE layer of every family's layout model
    x = torch.randn(
        2, 32, config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True
    )
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    (out, grads), (out_c, grads_c) = values_and_grads(layer, x), values_and_grads(compiled, x)
    assert_close_to_scale(out_c, out, rtol=1e-5)
    for g, g_c in zip(grads, grads_c):
        assert_close_to_scale(g_c, g, rtol=1e-4)


# ----------------------------------------------------------------------------- expert parallel


def expert_parallel_moe(rank: int, ep: int, factor: float, chunks: int = 2) -> MoE:
    """make_moe's layer with its experts sharded: this rank holds E / ep of them, exchanged in
    chunks."""
    return shard_experts(make_moe(factor), rank, ep, chunks, capacity_factor=factor)


def test_capacity_reads_nothing_from_the_device_under_expert_parallelism():
    """On fake tensors over a fake world of 2, where any host read of a device value raises: the
    expert-parallel layer's forward and backward pass under capacity, with no split size to read."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with FakeTensorMode():
            moe = expert_parallel_moe(rank=0, ep=2, factor=1.0)
            x = torch.randn(2, 9, HIDDEN, requires_grad=True)
            moe(x).sum().backward()
            assert moe.experts.gate_up_proj.grad.shape == (EXPERTS // 2, HIDDEN, 2 * INTER)
    finally:
        close_distributed()


def check_capacity_on_two_ranks() -> None:
    """Each rank's tokens through the expert-parallel layer equal them through one process with the
    same factor (capacity per source rank), values and gradients, eager (the C slots exchanged in
    1, 2 or 3 chunks: C = 3 at the factor that drops) and compiled whole; and the eager forward and
    backward copy nothing to the host."""
    from tools.profiling import HostSyncs

    rank = dist.get_rank()
    inputs = [tokens(seed=10 + r) for r in range(2)]
    for factor, chunks in ((NO_DROP, 1), (NO_DROP, 2), (0.5, 1), (0.5, 3)):
        expected = [run(make_moe(factor), x) for x in inputs]
        moe = expert_parallel_moe(rank, ep=2, factor=factor, chunks=chunks)
        x = inputs[rank].clone().requires_grad_()
        with HostSyncs() as syncs:
            y = moe(x)
            y.backward(torch.ones_like(y) + torch.arange(y.numel()).view_as(y) * 1e-3)
        assert syncs.reads == [], syncs.reads
        moe.zero_grad()
        mine = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
        want = dict(expected[rank][2])
        # the experts see both ranks' tokens
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            want[name] = sum(grads[name][mine] for _, _, grads in expected)
        assert_runs_equal(run(moe, inputs[rank]), (*expected[rank][:2], want))
    compiled = expert_parallel_moe(rank, ep=2, factor=0.5)  # the factor that drops, compared last
    compiled.compile(fullgraph=True, backend="aot_eager")
    assert_runs_equal(run(compiled, inputs[rank]), (*expected[rank][:2], want))


@pytest.mark.slow
def test_expert_parallel_capacity_equals_one_process_compiles_whole_and_never_syncs():
    spawn(2, check_capacity_on_two_ranks)


def check_capacity_step_syncs(argv: list[str]) -> None:
    reads = closing(step_host_syncs)(argv)
    # the step's own copy only: no split size per layer, none in the recompute
    assert reads == ["tolist"], reads


@pytest.mark.slow
def test_an_expert_parallel_training_step_under_capacity_copies_to_the_host_once(tmp_path):
    """train.py's step with ep 2, 2 micro-batches and full activation checkpointing: where dropless
    routing copies once per MoE layer and micro-batch, capacity copies nothing beyond the step's
    one."""
    run_two_processes(
        debug_args(
            tmp_path,
            "--parallel.ep=2",
            "--parallel.dp_shard=1",
            "--training.grad_accum=2",
            "--parallel.activation_checkpointing=full",
            "--data.seq_len=16",
            "--training.batch_size=2",
            "--model.capacity_factor=1.25",
        ),
        check_capacity_step_syncs,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", FIRST_FAMILY_THEN_SECOND_TIER)
def test_expert_parallel_training_under_capacity_matches_one_process(name):
    """parallel.py's expert-parallel model (DTensor expert shards, ep 2) under a capacity that drops
    nothing at either batch size (factor 4 >= E / k: C >= the tokens of a forward): three AdamW
    steps' losses, every gradient and the clipped norms equal the single-process run, through the
    static all-to-alls."""
    spawn(2, check_layouts, [{"ep": 2, "dp_shard": 1}], {"capacity_factor": 4.0}, name)


def test_the_capacity_never_exceeds_the_tokens_of_the_forward():
    """A token's k choices go to k distinct experts, so no expert can take more than the N tokens of
    the forward: any factor above E / k makes C = N, the same routing as dropless. Uncapped, a
    factor of 1,000 asked for [E, 1000 N k / E, H] buffers of empty rows (hundreds of GB at real
    sizes, 50x slower)."""
    assert expert_capacity(18, TOP_K, EXPERTS, capacity_ratio(1000)) == 18
    assert expert_capacity(18, TOP_K, EXPERTS, capacity_ratio(NO_DROP)) == 18  # exactly E / k
    # below the cap: unchanged
    assert expert_capacity(18, TOP_K, EXPERTS, capacity_ratio(1.25)) == 8
    x = tokens()
    assert_runs_equal(run(make_moe(1000), x), run(make_moe(), x))
