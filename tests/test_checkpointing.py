"""[parallel] activation_checkpointing (parallel.py): what each mode recomputes in backward and what
it keeps, counted op by op, and op-level checkpointing exact against none in every layout it
serves (values and gradients, FP32), eager and compiled."""

import dataclasses
from collections import Counter
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import (
    FIRST_FAMILY_THEN_SECOND_TIER,
    build,
    check_layouts,
    full,
    in_process_group,
    make_batch,
    only,
    spawn,
    tiny_config,
)
from parallel import (
    LayoutError,
    ParallelConfig,
    apply_activation_checkpointing,
    apply_compile,
    build_mesh,
    parallelize,
)
from tools.rehearsal import PeakMemory

# tiny_config("flint"): 4 blocks, dense 0-1 and MoE 2-3. Counted by hand from flint_model.py and
# moe.py: each block has 4 RMSNorms (input, post-attention, q_norm, k_norm), each one rsqrt; a
# dense block 7 matmuls (q, k, v, o; gate, up, down), a MoE block 8 (q, k, v, o; the router; the
# shared expert's gate, up, down) and 2 grouped GEMMs (gate_up, down).
LAYERS, DENSE, MOE = 4, 2, 2
BLOCK_NORMS = 4 * LAYERS
BLOCK_MATMULS = 7 * DENSE + 8 * MOE
BLOCK_GROUPED = 2 * MOE


class OpCounter(TorchDispatchMode):
    """Counts every operator called while active, by its name (aten.mm, flint.grouped_mm, ...)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def counted_step(mode: str, compiled: bool = False) -> dict:
    """One forward and backward of the tiny Flint under `mode` (one process, FP32) -> the ops of
    the forward and of the backward, the bytes the forward leaves live (what backward keeps), the
    loss and every gradient."""
    config = tiny_config("flint", num_hidden_layers=LAYERS)
    model = build(config)
    apply_activation_checkpointing(model, mode)
    if compiled:
        apply_compile(model)
    ids, targets, doc_ids = make_batch()
    forward, backward, memory = OpCounter(), OpCounter(), PeakMemory()
    with memory.watching(), forward:
        loss = model(ids, targets, doc_ids)
    memory.settle()
    with backward:
        loss.backward()
    return {
        "forward": forward.counts,
        "backward": backward.counts,
        "kept bytes": memory.now,
        "loss": loss.detach(),
        "grads": {name: param.grad for name, param in model.named_parameters()},
    }


def assert_equal_steps(actual: dict, expected: dict, what: str) -> None:
    assert torch.equal(actual["loss"], expected["loss"]), f"{what}: loss"
    for name, grad in expected["grads"].items():
        same = (
            actual["grads"][name] is None
            if grad is None
            else torch.equal(actual["grads"][name], grad)
        )
        assert same, f"{what}: gradient of {name}"


@only("flint")
def test_op_level_recomputes_the_pointwise_work_and_keeps_the_matmuls():
    """In backward, op-level checkpointing runs every block's norms again (as full does) but none
    of its matmuls or grouped GEMMs (full runs each again); it keeps less than none and more than
    full, and its loss and gradients are none's, bit for bit."""
    steps = {mode: counted_step(mode) for mode in ("none", "op", "full")}
    none, op, full_ = steps["none"], steps["op"], steps["full"]
    assert op["backward"]["aten.rsqrt"] == full_["backward"]["aten.rsqrt"] == BLOCK_NORMS
    assert none["backward"]["aten.rsqrt"] == 0
    assert op["backward"]["aten.mm"] == none["backward"]["aten.mm"]
    # full's recompute stops early, after the last op whose output backward needs: each block's
    # last matmul (the MLP's or shared expert's down projection) does not run again
    assert full_["backward"]["aten.mm"] == none["backward"]["aten.mm"] + BLOCK_MATMULS - LAYERS
    assert op["backward"]["flint.grouped_mm"] == none["backward"]["flint.grouped_mm"]
    grouped_in_full = full_["backward"]["flint.grouped_mm"] - none["backward"]["flint.grouped_mm"]
    assert grouped_in_full == BLOCK_GROUPED
    assert full_["kept bytes"] < op["kept bytes"] < none["kept bytes"]
    assert_equal_steps(op, none, "op")


def step_in_layout(
    layout: dict, model_overrides: dict | None = None, family: str = "flint"
) -> dict:
    """parallelize's model in this process group: one forward and backward of this rank's rows ->
    the loss and every full gradient (None for a frozen parameter)."""
    from helpers import rows_of_this_rank

    config = tiny_config(family, **(model_overrides or {}))
    cfg = ParallelConfig.from_dict(layout)
    pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
    batch = make_batch(vocab=min(256, config.vocab_size))
    loss = pm.forward_backward(*rows_of_this_rank(pm.mesh, batch))
    return {
        "loss": loss,
        "grads": {
            name: None if param.grad is None else full(param.grad)
            for name, param in pm.module.named_parameters()
        },
    }


@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_op_level_runs_with_the_fp32_units_of_a_bf16_policy(family):
    """Under a BF16 policy each block holds an FSDP unit of its FP32 modules (Flint's sinks and
    router; Large 4's router and indexer), gathered again before the block's backward: torch's own
    selective checkpointing refused the recompute there (it numbers every op, and the gather runs
    ops the forward did not). Op-level checkpointing gives none's loss and gradients bit for bit."""
    bf16 = {"param_dtype": "bfloat16"}
    none = in_process_group(step_in_layout, bf16, None, family)
    op = in_process_group(step_in_layout, {**bf16, "activation_checkpointing": "op"}, None, family)
    assert_equal_steps(op, none, "op under BF16")


def compiled_bf16_steps(family: str) -> None:
    """FSDP over this group (2 ranks) under a BF16 policy: none eager against op compiled whole
    (fullgraph=True, AOT autograd's graphs run as traced), each over two steps of two micro-batches
    (the FP32 units gathered and freed from the blocks' hooks every time), bit for bit."""
    from helpers import rows_of_this_rank

    config = tiny_config(family)
    steps = []
    for checkpointing, compile in (("none", False), ("op", True)):
        torch._dynamo.reset()
        cfg = ParallelConfig.from_dict(
            {
                "dp_shard": 2,
                "param_dtype": "bfloat16",
                "activation_checkpointing": checkpointing,
                "compile": compile,
            }
        )
        pm = parallelize(build(config), cfg, build_mesh(cfg, "cpu", config.num_experts))
        losses, grads = [], []
        for step in range(2):
            for micro in range(2):
                batch = make_batch(2 * step + micro, vocab=min(256, config.vocab_size))
                losses.append(pm.forward_backward(*rows_of_this_rank(pm.mesh, batch)))
            grads.append(
                {n: full(p.grad) for n, p in pm.module.named_parameters() if p.grad is not None}
            )
            pm.module.zero_grad(set_to_none=True)
        losses.append(
            pm.loss(*rows_of_this_rank(pm.mesh, make_batch(9, vocab=min(256, config.vocab_size))))
        )
        steps.append((losses, grads, sum(torch._dynamo.utils.counters["graph_break"].values())))
    (eager_losses, eager_grads, _), (losses, grads, breaks) = steps
    assert breaks == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses)), (losses, eager_losses)
    for step, (actual, expected) in enumerate(zip(grads, eager_grads)):
        assert actual.keys() == expected.keys()
        for name, grad in expected.items():
            assert torch.equal(actual[name], grad), f"step {step}: gradient of {name}"


@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_op_level_compiles_whole_under_a_bf16_policy_and_matches_none(family):
    spawn(2, spawned_with_backend, compiled_bf16_steps, family)


def spawned_with_backend(check, *args) -> None:
    """check(*args) in a spawned rank whose torch.compile traces through AOT autograd and runs the
    traced graphs (no code generation: seconds, and bit for bit against eager)."""
    torch.compile = partial(torch.compile, backend="aot_eager")  # this spawned process only
    check(*args)


def check_op_level_layouts() -> None:
    """FSDP and expert parallel (2 ranks, FP32) with op-level checkpointing against one process
    (check_layouts: loss, gradients, clipped norm, optimizer steps), and bit for bit against the
    same layout without checkpointing."""
    layouts = [{"dp_shard": 2}, {"ep": 2, "dp_shard": 1}]
    op_layouts = [{**layout, "activation_checkpointing": "op"} for layout in layouts]
    checkpointed = check_layouts(op_layouts, {})
    for layout, op_grads in zip(layouts, checkpointed):
        none = step_in_layout({"param_dtype": "float32", **layout}, {"num_hidden_layers": LAYERS})
        for name, grad in none["grads"].items():
            assert torch.equal(op_grads[name], grad), f"{layout}: op changed {name}"


@pytest.mark.slow
@only("flint")
def test_op_level_layouts_match_one_process():
    spawn(2, check_op_level_layouts)


def compiled_step(mode: str) -> dict:
    """counted_step compiled: AOT autograd's forward and backward graphs of each block, partitioned
    as inductor partitions them (min-cut, which follows selective checkpointing's tags), run as
    traced (no code generation) -> the ops of the backward graphs, the bytes the forward graphs
    save for backward, the loss and every gradient. (Dynamo traces nothing under a dispatch mode,
    so the graphs are counted instead.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backward: Counter[str] = Counter()

    def as_traced(graph, inputs):
        return graph

    def counted(graph, inputs):
        for node in graph.graph.nodes:
            if node.op == "call_function" and hasattr(node.target, "overloadpacket"):
                backward[str(node.target.overloadpacket)] += 1
        return graph

    backend = aot_autograd(
        fw_compiler=as_traced,
        bw_compiler=counted,
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    config = tiny_config("flint", num_hidden_layers=LAYERS)
    model = build(config)
    apply_activation_checkpointing(model, mode)
    real_compile = torch.compile
    torch.compile = partial(real_compile, backend=backend)
    try:
        apply_compile(model)
    finally:
        torch.compile = real_compile
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(*make_batch())
    loss.backward()
    return {
        "backward": backward,
        "saved bytes": sum(saved.values()),
        "loss": loss.detach(),
        "grads": {name: param.grad for name, param in model.named_parameters()},
    }


@pytest.mark.slow
@only("flint")
def test_compiled_op_level_keeps_the_matmuls_and_matches_eager():
    """Compiled whole (fullgraph), op-level blocks run in backward none of their matmuls again but
    norms, save less than the compiled blocks without checkpointing, and match the
    eager op-level loss and gradients."""
    none, op, eager = compiled_step("none"), compiled_step("op"), counted_step("op")
    assert op["backward"]["aten.mm"] == none["backward"]["aten.mm"] > 0
    assert op["backward"]["flint.grouped_mm"] == none["backward"]["flint.grouped_mm"] > 0
    # the partitioner recomputes 12 of the 16 norms (measured), none's graphs none of them
    assert op["backward"]["aten.rsqrt"] > none["backward"]["aten.rsqrt"] == 0
    assert op["saved bytes"] < none["saved bytes"]
    torch.testing.assert_close(op["loss"], eager["loss"], rtol=1e-6, atol=1e-6)
    for name, grad in eager["grads"].items():
        torch.testing.assert_close(op["grads"][name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", [{"ep": 2}, {"cp": 2}])
def test_op_level_compiles_only_whole_blocks(layout):
    """Under expert parallelism (the experts' own FSDP unit and the count exchange break the
    block's graph) or context parallelism the checkpoint would run the block eagerly: refused in
    one line naming the key, before any work; the same layout without compile runs."""
    op = ParallelConfig(**layout, activation_checkpointing="op")
    with pytest.raises(LayoutError, match=r"activation_checkpointing = 'op' with compile = true"):
        dataclasses.replace(op, compile=True).validate()
    op.validate()


@pytest.mark.slow
def test_op_level_keeps_flex_attention_and_reuses_it():
    """FlexAttention (the GPUs' attention, a higher-order operator) reaches op-level
    checkpointing's modes: its forward's output is kept, and the recompute returns that very
    storage instead of running the kernel again (1.5 s: flex compiles a wrapper of its own)."""
    from torch.nn.attention.flex_attention import flex_attention

    from parallel import op_level_contexts

    q = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    keep, reuse = op_level_contexts()
    with keep:
        out = flex_attention(q, q, q)
    with reuse:
        again = flex_attention(q, q, q)
    assert again.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
