"""Compiled code: every block kind as one graph (fullgraph=True), the custom operators that keep
the CPU kernels inside it, and no host sync in a block. Through parallelize: checkpointed blocks
compiled whole in FP32, and under BF16 policies (FSDP, FSDP x EP, PP) the graphs each block kind
runs pinned, all against the eager blocks.

Dynamo and AOT autograd (backend aot_eager: the graph, its fake shapes and its backward formula,
as inductor receives them) run in the suite in seconds; inductor's code generation, about a
minute per block on 2 busy cores with a cold cache, runs with FLINT_SLOW=1 (`helpers.slow`).
"""

from functools import partial

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.utils._python_dispatch import TorchDispatchMode

from attention import FULL, SLIDING, flash_sink_attention
from helpers import (
    FAMILY_NAMES,
    FIRST_FAMILY_THEN_SECOND_TIER,
    assert_close_to_scale,
    block_inputs,
    build,
    counting_backend,
    in_process_group,
    make_batch,
    one_graph_per_block,
    only,
    parallel_block_model,
    parallel_step,
    registered,
    slow,
    spawn,
    tiny_config,
    values_and_grads,
)
from moe import _grouped_mm_op, expert_counts, grouped_mm

# FP32 under ep = 2 (FSDP over the ep ranks, no FP32 units of their own): a dense block is one
# graph; an MoE block 4: the experts' FSDP unit breaks the block before and after it, and their
# count exchange in between.
EP_FP32_GRAPHS = registered({"flint": {"0": 1, "1": 4}, "large4": {"0": 1, "1": 4, "2": 4}})
BACKENDS = ["aot_eager", pytest.param("inductor", marks=slow)]
BATCH, SEQ = 2, 32  # 32 > 2 * (window 9 - 1): sliding layers take the banded path

# Every block kind of Flint: (attention, MLP). Layers 0-1 are dense by mlp_only_layers.
BLOCK_KINDS = {"dense full": "0", "dense sliding": "1", "moe sliding": "2", "moe full": "3"}
# the tests of Flint's blocks, one at a time (Large 4's compile whole in its model below)
FLINT = only("flint")


def block_model(**overrides):
    config = tiny_config(
        "flint", num_hidden_layers=4, layer_types=[FULL, SLIDING, SLIDING, FULL], **overrides
    )
    model = build(config)
    with torch.no_grad():  # sinks away from their initial ~0, so that they matter
        for name, param in model.named_parameters():
            if name.endswith("sinks.weight"):
                param.add_(torch.linspace(-1.0, 2.0, param.numel()))
    return model


def assert_same(eager, compiled, what: str):
    (out, grads), (out_c, grads_c) = eager, compiled
    assert_close_to_scale(out_c, out, rtol=1e-5, what=f"{what} output")
    for i, (g, g_c) in enumerate(zip(grads, grads_c)):
        assert_close_to_scale(g_c, g, rtol=1e-4, what=f"{what} gradient {i}")


@pytest.mark.slow
@FLINT
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(BLOCK_KINDS))
def test_every_block_kind_compiles_to_one_graph(kind, backend, one_thread):
    """fullgraph=True raises on any graph break: the block must be a single graph, with the
    CPU's grouped GEMM and flash attention inside it as opaque custom operators."""
    model = block_model()
    model.layers["2"].mlp.experts.group_align = 4  # the padded grouped-GEMM path, as on CUDA
    block = model.layers[BLOCK_KINDS[kind]]
    inputs = block_inputs(model.config)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    assert_same(values_and_grads(block, *inputs), values_and_grads(compiled, *inputs), kind)


@pytest.mark.slow
@FLINT
@pytest.mark.parametrize("kind", list(BLOCK_KINDS))
def test_flex_blocks_trace_to_one_graph(kind, monkeypatch, one_thread):
    """The GPU's attention path, traced here: FlexAttention with BlockMasks of packed documents
    inside a fullgraph block under aot_eager (flex's own CPU backward check lifted: its eager
    implementation is differentiable), against the eager block."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    model = block_model(attention_backend="flex")
    block = model.layers[BLOCK_KINDS[kind]]
    inputs = block_inputs(model.config, backend="flex")
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert_same(
        values_and_grads(block, *inputs), values_and_grads(compiled, *inputs), f"flex {kind}"
    )


@pytest.mark.slow
@FLINT
def test_bf16_block_tracks_fp32(one_thread):
    """The BF16 bulk with FP32 sinks and router, as on a GPU: an MoE sliding block's output and
    input gradient stay within 3% (relative RMS) of the FP32 block's on the same weights; about
    0.5% is measured, a few BF16 roundings deep. The BF16 block also traces to one graph."""
    from flint_model import build_model

    fp32_model = block_model()
    bf16_model = build_model(fp32_model.config, dtype=torch.bfloat16, seed=0)
    bf16_model.load_state_dict(fp32_model.state_dict())
    assert bf16_model.layers["2"].mlp.router.weight.dtype == torch.float32
    x, rope, masks = block_inputs(fp32_model.config)
    x16 = x.detach().to(torch.bfloat16).requires_grad_()
    out, grads = values_and_grads(fp32_model.layers["2"], x, rope, masks)
    out16, grads16 = values_and_grads(bf16_model.layers["2"], x16, rope, masks)

    def relative_rms(a, b):
        return ((a.float() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    assert relative_rms(out16, out) < 3e-2 and relative_rms(grads16[0], grads[0]) < 3e-2
    torch._dynamo.reset()
    compiled = torch.compile(bf16_model.layers["2"], fullgraph=True, backend="aot_eager")
    out16_c, _ = values_and_grads(compiled, x16, rope, masks)
    torch.testing.assert_close(out16_c, out16, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
@FLINT
@pytest.mark.parametrize("chunk_size", [4096, 24])
def test_head_and_chunked_loss_compile_to_one_graph(chunk_size, one_thread):
    """The head's loss in one chunk, and in chunks recomputed in backward (activation checkpoints
    inside the graph), with ignored targets: one graph, equal values and gradients."""
    model = block_model(loss_chunk_size=chunk_size)
    head = model.lm_head
    h = torch.randn(
        BATCH,
        SEQ,
        model.config.hidden_size,
        generator=torch.Generator().manual_seed(0),
        requires_grad=True,
    )
    targets = torch.randint(
        0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    targets[:, -5:] = -100
    torch._dynamo.reset()
    compiled = torch.compile(head, fullgraph=True, backend="aot_eager")
    results = []
    for module in (head, compiled):
        loss = module(h, targets)
        results.append((loss, torch.autograd.grad(loss, [h, head.weight])))
    assert_same(*results, f"head, chunks of {chunk_size}")


class LogitRows(TorchDispatchMode):
    """The rows of each matmul that makes logits (an output `vocab` wide): one per loss chunk."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm") and out.shape[-1] == self.vocab:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_model_s_loss_runs_loss_chunk_size_rows_at_a_time(family):
    """[model] loss_chunk_size reaches the head: a training forward of 2 x 16 tokens with chunks of
    12 makes its logits 12, 12 and 8 rows at a time (the default, 4096: all 32 at once)."""
    config = tiny_config(family, loss_chunk_size=12)
    model = build(config)
    ids, targets, doc_ids = make_batch(vocab=config.vocab_size)
    with LogitRows(config.vocab_size) as log:
        model(ids[:2], targets[:2], doc_ids[:2])
    assert log.rows == [12, 12, 8], log.rows


@slow  # about a minute of tracing on 2 idle cores
@only("large4")
@pytest.mark.parametrize("attention_backend", ["sdpa", "flex"])
def test_large4_blocks_compile_to_one_graph_each(attention_backend, monkeypatch, one_thread):
    """Every Mistral Large 4 block kind of the parity preset (dense and MoE; own and shared
    indexer; own and shared KV latent; NoPE), each compiled with fullgraph=True inside the whole
    model, with a sparse selection (index_topk 8 < 32 tokens): loss and gradients equal eager. With
    flex, a full-indexer block builds its group's BlockMask inside its graph and returns it."""
    from large4 import Large4Config, build_large4

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    model = build_large4(
        Large4Config.from_name("large4-parity", attention_backend=attention_backend), seed=0
    )
    ids = torch.randint(
        0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            for layer in model.layers.values():
                layer.compile(fullgraph=True, backend="aot_eager")
        loss = model(ids, ids.roll(-1, 1))
        results.append((loss, torch.autograd.grad(loss, params, allow_unused=True)))
    (loss, grads), (loss_c, grads_c) = results
    assert_close_to_scale(loss_c, loss, rtol=1e-5)
    for g, g_c in zip(grads, grads_c):
        assert (g is None) == (g_c is None)
        if g is not None:
            assert_close_to_scale(g_c, g, rtol=1e-4)


@pytest.mark.slow
@FLINT
def test_router_counts_are_recorded_inside_the_graph(one_thread):
    """The router's tokens_per_expert buffer update survives compilation (a buffer mutation in
    the graph, no bincount): the compiled block leaves the same counts as the eager one."""
    model = block_model()
    block = model.layers["2"]
    x, rope, masks = block_inputs(model.config)
    block(x, rope, masks)
    eager_counts = block.mlp.router.tokens_per_expert.clone()
    block.mlp.router.tokens_per_expert.zero_()
    torch._dynamo.reset()
    torch.compile(block, fullgraph=True, backend="aot_eager")(x, rope, masks)
    assert eager_counts.sum() == BATCH * SEQ * model.config.num_experts_per_tok
    assert torch.equal(block.mlp.router.tokens_per_expert, eager_counts)


def test_expert_counts_match_bincount():
    indices = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(indices, 9), torch.bincount(indices.flatten(), minlength=9))


# ----------------------------------------------------------------------------- custom operators


def test_grouped_mm_operator_matches_per_group_matmuls():
    """The op and its backward against a plain loop over groups, with an empty group; opcheck
    tests the fake, the schema and the autograd registration."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    ends = [5, 5, 12]
    offsets = torch.tensor(ends, dtype=torch.int32)
    out = _grouped_mm_op(x, w, offsets)
    expected = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
    assert_close_to_scale(out, expected, rtol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (x, w), grad)
    want = torch.autograd.grad(expected, (x, w), grad)
    for a, b in zip(got, want):
        assert_close_to_scale(a, b, rtol=1e-6)
    torch.library.opcheck(_grouped_mm_op, (x, w, offsets))


def test_fp32_grouped_mm_has_a_fake_where_the_native_op_has_none():
    """torch 2.13's _grouped_mm meta kernel takes BF16 only, so tracing an FP32 grouped GEMM
    (CUDA FP32 with compile) needs the custom operator, whose fake serves every dtype."""
    x, w = torch.empty(32, 16, device="meta"), torch.empty(2, 16, 8, device="meta")
    offsets = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(x, w, offs=offsets)
    assert grouped_mm(x, w, offsets).shape == (32, 8)


def test_flash_sink_operator_passes_opcheck():
    """Schema, fake (shapes and the [B, T, H, D] layout the compiler plans with) and autograd
    registration of the CPU flash attention operator; its values are tested in test_attention."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 6, 8, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=g).requires_grad_()
    allowed = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    torch.library.opcheck(flash_sink_attention, (q, k, v, sinks, allowed))


def train_then_evaluate_compiled(model, monkeypatch) -> None:
    """parallel.apply_compile, one training step, then a no_grad loss equal to eager's."""
    from functools import partial

    from parallel import apply_compile

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))
    ids = torch.randint(
        0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        eager = model(ids, ids.roll(-1, 1))
    torch._dynamo.reset()
    apply_compile(model)
    model(ids, ids.roll(-1, 1)).backward()
    with torch.no_grad():
        assert_close_to_scale(model(ids, ids.roll(-1, 1)), eager, rtol=1e-5)


@pytest.mark.slow
@FLINT
def test_compiled_blocks_train_and_evaluate_past_the_recompile_limit(monkeypatch, one_thread):
    """All blocks share one code object; dynamo keeps a graph per distinct block and grad mode
    (training, evaluation under no_grad). Two block kinds make 4 graphs: past a limit of 2,
    apply_compile raises the limit for the model, so the first evaluation does not stop the run."""
    config = tiny_config(
        "flint", num_hidden_layers=2, mlp_only_layers=[0], layer_types=[FULL, SLIDING]
    )
    # torch's own means: monkeypatch would delete the key
    with torch._dynamo.config.patch(recompile_limit=2):
        train_then_evaluate_compiled(build(config), monkeypatch)


def test_dynamo_config_is_intact_after_a_patched_test():
    """Runs after the test above: the key it patched is still there, at its default (conftest's
    fresh_dynamo also undoes what apply_compile set), so later compiles in the process still
    work."""
    assert (
        torch._dynamo.config.recompile_limit
        == torch._dynamo.config._config["recompile_limit"].default
    )
    assert "recompile_limit" in torch._dynamo.config.get_config_copy()


@slow
@only("large4")
def test_large4_compiled_trains_and_evaluates(monkeypatch, one_thread):
    """Mistral Large 4's parity preset: 8 blocks that all differ, 16 graphs, past dynamo's default
    limit of 8 (which stopped configs/large4-smoke.toml with compile = true at its first
    evaluation)."""
    from large4 import Large4Config, build_large4

    train_then_evaluate_compiled(
        build_large4(Large4Config.from_name("large4-parity"), seed=0), monkeypatch
    )


# ------------------------------------------------------- parallelize: checkpointed, compiled blocks


def check_checkpointed_compiled_matches_eager(
    family: str, layout: dict, expected_graphs: dict, rtol: float, atol: float, batches: int = 1
) -> None:
    """The compiled step against the eager one of the same layout: loss and gradients within
    rtol/atol, every block recomputed as the checkpointing mode says, and the graphs each block ran
    in its forward as `expected_graphs` (by layer name, this rank's), every break at an FSDP
    hook."""
    eager_loss, eager_grads, _, eager_calls, _ = parallel_step(
        family, layout, False, batches=batches
    )
    loss, grads, graphs, calls, breaks = parallel_step(family, layout, True, batches=batches)
    torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=atol)
    assert grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(
            grads[name], grad, rtol=rtol, atol=atol, msg=lambda m: f"gradient {name}: {m}"
        )
    mode = layout.get("activation_checkpointing", "none")
    for name, (forwards, recomputes) in calls.items():
        checkpointed = mode == "full" or (mode == "selective" and int(name) % 2 == 0)
        # a pipeline stage's shape inference is one more forward, with no backward
        assert 1 <= forwards and (recomputes > 0) == checkpointed and recomputes <= forwards, (
            name,
            calls[name],
        )
    assert calls == eager_calls, (calls, eager_calls)
    expected_graphs = {name: expected_graphs[name] for name in calls}  # this pipeline rank's blocks
    assert graphs == expected_graphs, f"graphs per block {graphs}, expected {expected_graphs}"
    # FSDP's hooks, and under expert parallelism the count exchange moe.py keeps eager
    # (torch.compiler.disable)
    known = ("_fsdp_common.py", "exchange_counts")
    unknown = [
        reason.splitlines()[0] for reason in breaks if not any(mark in reason for mark in known)
    ]
    assert not unknown, unknown


def spawned(check, *args) -> None:
    """check(*args) in a spawned rank, whose torch.compile counts its graphs."""
    torch.compile = partial(torch.compile, backend=counting_backend)  # this spawned process only
    check(*args)


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_checkpointed_blocks_compile_whole_and_match_eager(family, monkeypatch):
    """FP32 in a group of one, selective checkpointing (block 0 recomputed in backward, block 1
    not): every block compiles with fullgraph=True (a break raises) to one graph; loss and gradients
    equal the eager blocks'; the parameter names are the model's own."""
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=counting_backend))
    layers = parallel_block_model(family).config.num_hidden_layers
    in_process_group(
        check_checkpointed_compiled_matches_eager,
        family,
        {"activation_checkpointing": "selective"},
        {str(i): 1 for i in range(layers)},
        1e-5,
        1e-6,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [name if name == FAMILY_NAMES[0] else pytest.param(name, marks=slow) for name in FAMILY_NAMES],
)
def test_checkpointed_blocks_under_a_bf16_policy(family, monkeypatch):
    """A BF16 FSDP policy in a group of one, every block checkpointed: each block compiles to one
    graph (fullgraph=True: the FP32 units gather from the block's hooks, parallel.gather_with_block,
    not from hooks of their own inside it), and the values are the eager blocks'."""
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=counting_backend))
    in_process_group(
        check_checkpointed_compiled_matches_eager,
        family,
        {"param_dtype": "bfloat16", "activation_checkpointing": "full"},
        one_graph_per_block(family),
        1e-2,
        1e-3,
    )


@pytest.mark.slow
@FLINT
def test_checkpointed_blocks_under_bf16_expert_parallel():
    """ep = 2 over 2 gloo ranks, BF16 policy, every block checkpointed: a dense block is one graph
    (its FP32 unit gathers from the block's hooks), an MoE block runs 4: the experts' own unit on
    the efsdp mesh ends a graph at its FSDP pre- and post-forward hooks, and the count exchange
    (moe.ExpertParallelExperts.exchange_counts) runs eager between two graphs, so that its host
    split sizes are read once per forward and reused by the recompute. The graph after it exchanges
    the chunks' rows, runs the experts and the shared expert, and reads the split sizes as unbacked
    integers, so a second batch, routed otherwise, runs the same graphs."""
    spawn(
        2,
        spawned,
        check_checkpointed_compiled_matches_eager,
        "flint",
        {"param_dtype": "bfloat16", "ep": 2, "activation_checkpointing": "full"},
        {"0": 1, "1": 4},
        1e-2,
        1e-3,
        2,
    )


@slow
@FLINT
def test_checkpointed_blocks_under_bf16_pipeline_stages():
    """pp = 2 over 2 gloo ranks, BF16 policy: each stage's blocks run the graphs of the FSDP
    layout."""
    spawn(
        2,
        spawned,
        check_checkpointed_compiled_matches_eager,
        "flint",
        {"param_dtype": "bfloat16", "pp": 2, "activation_checkpointing": "full"},
        one_graph_per_block("flint"),
        1e-2,
        1e-3,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [name if name == FAMILY_NAMES[0] else pytest.param(name, marks=slow) for name in FAMILY_NAMES],
)
def test_checkpointed_blocks_under_fp32_expert_parallel_in_three_chunks(family):
    """ep = 2 over 2 gloo ranks in FP32, every block checkpointed, the exchange in 3 chunks: the
    compiled step equals the eager one to FP32 rounding over two batches routed differently (no
    recompile), and the graphs are pinned (EP_FP32_GRAPHS)."""
    spawn(
        2,
        spawned,
        check_checkpointed_compiled_matches_eager,
        family,
        {"ep": 2, "activation_checkpointing": "full", "ep_overlap": 3},
        EP_FP32_GRAPHS[family],
        1e-5,
        1e-6,
        2,
    )
