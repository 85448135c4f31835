"""lora.py against the formula written out: W x + (alpha / r) B A dropout(x) for a Linear, a loop
over tokens and experts for the grouped experts; values and every gradient, the base frozen. Whole
tiny models: step 0 is the base model, merged weights give the adapted logits, compiled blocks match
eager, FSDP on gloo matches one process. The PEFT export against what peft loaded onto transformers'
models (tests/fixtures/lora_peft, written by tests/make_lora_peft_fixture.py)."""

import copy
import hashlib
import json
import math
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import convert
import lora
from helpers import FAMILY_NAMES, assert_close_to_scale, build, only, tiny_config
from lora import LoraConfig, apply_lora, grouped_lora
from moe import GroupedExperts

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lora_peft"
RANK, ALPHA = 8, 12.0
SCALE = ALPHA / RANK


def tiny(family, **overrides):
    """The layout tests' model of the family (helpers.LAYOUT_MODELS): Flint's 4 layers, dense 0-1,
    MoE 2-3, full and sliding attention; Large 4's 8, dense 0, MoE 1-7, every parameter random."""
    return build(tiny_config(family, **overrides))


def first_experts(model) -> str:
    """The name of the model's first routed experts (Flint: layers.2.mlp.experts, Large 4:
    layers.1...)."""
    return next(
        name for name, module in model.named_modules() if isinstance(module, GroupedExperts)
    )


def adapted(model, targets=("all",), dropout=0.0, seed=0):
    """`model` with adapters on `targets`, B random (at its zero init every A gets a zero
    gradient)."""
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, dropout=dropout, targets=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".B"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def adapter_params(model):
    return {name: p for name, p in model.named_parameters() if lora.is_adapter_key(name)}


def batch(vocab, seed=0, shape=(2, 12)):
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    return ids, torch.roll(ids, -1, 1)


# ======================================================================== configuration and targets


@pytest.mark.parametrize(
    "section, message",
    [
        ({"rank": 0}, r"\[lora\] rank must be an integer > 0, got 0"),
        ({"rank": 2.5}, r"\[lora\] rank must be an integer > 0, got 2.5"),
        ({"alpha": math.inf}, r"\[lora\] alpha must be a finite number other than 0, got inf"),
        ({"alpha": math.nan}, r"\[lora\] alpha must be a finite number other than 0, got nan"),
        ({"alpha": 0}, r"\[lora\] alpha must be a finite number other than 0, got 0"),
        ({"alpha": 0.0}, r"\[lora\] alpha must be a finite number other than 0, got 0.0"),
        ({"alpha": True}, r"\[lora\] alpha must be a finite number other than 0, got True"),
        ({"dropout": 1.0}, r"\[lora\] dropout must be a number in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, r"\[lora\] dropout must be a number in \[0, 1\), got -0.1"),
        ({"targets": []}, r"\[lora\] targets must be a non-empty list"),
        ({"rnak": 4}, r"\[lora\]: unknown key 'rnak'"),
    ],
)
def test_config_errors_name_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig.from_dict({"targets": ["q_proj"], **section})


@pytest.mark.parametrize("alpha, scale", [(1e-3, 1e-3 / 4), (-2.0, -0.5), (3, 0.75)])
def test_the_alpha_next_to_zero_is_accepted_and_reaches_the_scale(alpha, scale):
    """The boundary of the alpha = 0 refusal: any other finite alpha trains (a negative one flips
    the update's sign), and the adapter multiplies its update by alpha / rank (rank 4)."""
    model = tiny("flint")
    apply_lora(model, LoraConfig.from_dict({"rank": 4, "alpha": alpha, "targets": ["q_proj"]}))
    assert model.layers["0"].self_attn.q_proj.lora.scale == scale


REFUSED_TARGETS = [
    ("flint", "qproj", r"'qproj' matches no module of Flint"),
    ("flint", "sinks", r"'sinks' matches layers.0.self_attn.sinks, part of an FP32 unit"),
    ("flint", "router", r"'router' matches layers.2.mlp.router, part of an FP32 unit"),
    ("flint", "lm_head", r"'lm_head' matches lm_head, part of an FP32 unit"),
    ("flint", "embed_tokens", r"matches embed_tokens \(Embedding\): adapters go on nn.Linear"),
    ("flint", "self_attn", r"matches layers.0.self_attn \(Attention\)"),
    ("large4", "router", r"'router' matches layers.1.mlp.router, part of an FP32 unit"),
    ("large4", "lm_head", r"'lm_head' matches lm_head, part of an FP32 unit"),
    (
        "large4",
        "indexer",
        r"'indexer' matches layers.0.self_attn.indexer, which is frozen in the "
        r"base model",
    ),
    ("large4", "wk", r"'wk' matches layers.0.self_attn.indexer.wk, which is frozen"),
    ("large4", "weights_proj", r"matches layers.0.self_attn.indexer.weights_proj, which is frozen"),
]


@pytest.mark.parametrize(
    "family, target, message",
    [pytest.param(*case, marks=only(case[0])) for case in REFUSED_TARGETS],
)
def test_targets_that_cannot_take_an_adapter_are_refused(family, target, message):
    model = tiny(family)
    with pytest.raises(ValueError, match=r"\[lora\] targets: .*" + message):
        apply_lora(model, LoraConfig(rank=RANK, targets=["q_proj", target]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_experts_under_capacity_are_refused_until_moe_takes_the_adapters(family):
    model = tiny(family, capacity_factor=1.25)
    with pytest.raises(
        ValueError,
        match=rf"'all' matches {first_experts(model)}: routed-expert "
        r"adapters need "
        r"experts_backend 'grouped' and no capacity_factor",
    ):
        apply_lora(model, LoraConfig(rank=RANK, targets=["all"]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_deep_copy_runs_its_own_adapters(family):
    """pipeline.py deep-copies the model for each stage: a copy's adapted forwards read the copy's
    parameters."""
    model = adapted(tiny(family))
    ids, _ = batch(model.config.vocab_size)
    expected = model(ids)
    twin = copy.deepcopy(model)
    for adapter in (
        twin.get_submodule(first_experts(twin)).down_lora,
        twin.layers["0"].self_attn.q_proj.lora,
    ):
        saved = adapter.B.detach().clone()
        with torch.no_grad():
            adapter.B.zero_()
        assert not torch.allclose(twin(ids), expected, atol=1e-4), (
            "the copy ran the original's adapter"
        )
        with torch.no_grad():
            adapter.B.copy_(saved)
    assert torch.equal(model(ids), expected) and torch.equal(twin(ids), expected)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_expert_adapters_need_a_rank_the_grouped_gemm_takes(family):
    with pytest.raises(
        ValueError,
        match=r"\[lora\] rank must be a multiple of 8 to adapt routed "
        r"experts.*got 4",
    ):
        apply_lora(tiny(family), LoraConfig(rank=4, targets=["q_proj", "experts"]))
    # Linear maps take any rank
    assert apply_lora(tiny(family), LoraConfig(rank=4, targets=["q_proj"]))


# Flint's tiny layout model (hidden 64, 4 query heads and 2 key-value heads of 16, dense MLP 128,
# experts of intermediate 32): k_proj is [64 -> 32], an expert's down_proj [32 -> 64], q_proj
# [64 -> 64].
@pytest.mark.parametrize(
    "targets, largest, narrowest",
    [
        (["k_proj"], 32, r"layers\.0\.self_attn\.k_proj: in 64, out 32"),
        (["q_proj", "experts"], 32, r"layers\.2\.mlp\.experts: in 32, out 64"),
        (["q_proj"], 64, r"layers\.0\.self_attn\.q_proj: in 64, out 64"),
    ],
)
@only("flint")
def test_a_rank_above_the_narrowest_map_is_refused(targets, largest, narrowest):
    """rank <= min(in, out) of the narrowest adapted map, checked before any adapter is allocated
    (2**40 is refused, not attempted); the largest rank the grouped GEMM takes there is accepted,
    and shapes the adapters (the refusal's boundary)."""
    above = largest + 8 if "experts" in targets else largest + 1
    for rank in (above, 2**40):
        refusal = (
            rf"^\[lora\] rank must be at most {largest}, the smaller side of the narrowest "
            rf"adapted map \({narrowest}\), got {rank}$"
        )
        with pytest.raises(ValueError, match=refusal):
            apply_lora(tiny("flint"), LoraConfig(rank=rank, targets=targets))
    model = tiny("flint")
    apply_lora(model, LoraConfig(rank=largest, targets=targets))
    shapes = {name: tuple(p.shape) for name, p in adapter_params(model).items()}
    if "k_proj" in targets:
        assert shapes["layers.0.self_attn.k_proj.lora.A"] == (32, 64)
        assert shapes["layers.0.self_attn.k_proj.lora.B"] == (32, 32)
    if "experts" in targets:
        assert shapes["layers.2.mlp.experts.down_lora.A"] == (8, 32, 32)  # [E, Im, r]
        assert shapes["layers.2.mlp.experts.gate_up_lora.B"] == (8, 32, 64)  # [E, r, 2*Im]


@only("flint")
def test_each_setting_reaches_the_adapters():
    """rank 8, alpha 6 (scale 0.75), targets q_proj, v_proj and the experts on Flint's tiny model
    (4 layers, experts in layers 2-3): adapters on exactly those 10 modules, shaped by the rank, and
    each update with A and B all ones equal to 0.75 * rank * in: 0.75 * 8 * 64 = 384 (q, v,
    gate_up), 0.75 * 8 * 32 = 192 (an expert's down_proj, in = 32)."""
    model = tiny("flint")
    config = LoraConfig(rank=8, alpha=6.0, targets=["q_proj", "v_proj", "experts"])
    names = apply_lora(model, config)
    expected = {f"layers.{i}.self_attn.{proj}" for i in range(4) for proj in ("q_proj", "v_proj")}
    expected |= {"layers.2.mlp.experts", "layers.3.mlp.experts"}
    assert set(names) == expected
    owners = {key.rsplit(".", 2)[0] for key in adapter_params(model)}
    assert owners == expected
    assert tuple(model.layers["1"].self_attn.v_proj.lora.B.shape) == (32, 8)  # [out, r]
    with torch.no_grad():
        for param in adapter_params(model).values():
            param.fill_(1.0)
    update = model.layers["1"].self_attn.v_proj.lora(torch.ones(1, 64))
    assert torch.equal(update, torch.full((1, 32), 384.0))
    experts = model.layers["3"].mlp.experts
    offsets = torch.tensor([2, 2, 2, 2, 2, 2, 2, 2], dtype=torch.int32)  # both rows to expert 0
    assert torch.equal(experts.gate_up_lora(torch.ones(2, 64), offsets), torch.full((2, 64), 384.0))
    assert torch.equal(experts.down_lora(torch.ones(2, 32), offsets), torch.full((2, 64), 192.0))


@only("large4")
def test_the_targets_and_names():
    """Adapters sit under new child names, so every base key stays; 'all' skips the FP32 units and
    the frozen indexer; everything but the adapters is frozen; a second apply_lora is refused."""
    model = tiny("large4")
    base_keys = set(model.state_dict())
    targets = apply_lora(model, LoraConfig(rank=RANK, targets=["all"]))
    assert set(model.state_dict()) - base_keys == set(adapter_params(model))
    assert {
        "layers.0.self_attn.kv_b_proj",
        "layers.0.mlp.gate_proj",
        "layers.1.mlp.experts",
        "layers.1.mlp.shared_expert.down_proj",
        "layers.1.self_attn.kv_a_proj_with_mqa",
    } <= set(targets)
    assert not [t for t in targets if "indexer" in t]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapter_params(model))
    # [E, H, r]
    assert adapter_params(model)["layers.1.mlp.experts.gate_up_lora.A"].shape == (8, 64, RANK)
    # [E, r, H]
    assert adapter_params(model)["layers.1.mlp.experts.down_lora.B"].shape == (8, RANK, 64)
    assert lora.base_key("layers.1.mlp.experts.down_lora.B") == "layers.1.mlp.experts.down_proj"
    with pytest.raises(ValueError, match="already has adapters"):
        apply_lora(model, LoraConfig(rank=RANK, targets=["q_proj"]))


# =================================================================== one module against the formula


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_linear_adapter_equals_the_formula_values_and_gradients(family):
    model = adapted(tiny(family), ["layers.1.self_attn.q_proj"])
    linear = model.layers["1"].self_attn.q_proj
    A, B = linear.lora.A, linear.lora.B
    x = torch.randn(
        3, 5, linear.in_features, generator=torch.Generator().manual_seed(1), requires_grad=True
    )
    weight = torch.randn(3, 5, linear.out_features, generator=torch.Generator().manual_seed(2))
    out = linear(x)
    grads = torch.autograd.grad((out * weight).sum(), [x, A, B])
    # the reference, written out: W x + (alpha / r) B A x, on copies
    xr, Ar, Br = (t.detach().clone().requires_grad_() for t in (x, A, B))
    expected = xr @ linear.weight.detach().T + (ALPHA / RANK) * (xr @ Ar.T) @ Br.T
    expected_grads = torch.autograd.grad((expected * weight).sum(), [xr, Ar, Br])
    assert_close_to_scale(out, expected, what="output")
    for got, want, what in zip(grads, expected_grads, ("x", "A", "B")):
        assert_close_to_scale(got, want, what=f"grad {what}")
    assert linear.weight.grad is None and not linear.weight.requires_grad


def test_grouped_lora_equals_a_loop_over_experts():
    """Rows sorted by expert with an empty group and zero padding rows (CUDA's aligned layout)."""
    g = torch.Generator().manual_seed(3)
    counts, width_in, width_out = [3, 0, 5, 2], 16, 24
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = torch.randn(sum(counts), width_in, generator=g)
    rows[2] = 0.0  # a padding row
    rows.requires_grad_()
    A = torch.randn(4, width_in, RANK, generator=g, requires_grad=True)
    B = torch.randn(4, RANK, width_out, generator=g, requires_grad=True)
    weight = torch.randn(sum(counts), width_out, generator=g)
    out = grouped_lora(rows, ends, A, B, SCALE)
    grads = torch.autograd.grad((out * weight).sum(), [rows, A, B])
    xr, Ar, Br = (t.detach().clone().requires_grad_() for t in (rows, A, B))
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        pieces.append(SCALE * xr[start : start + count] @ Ar[expert] @ Br[expert])
        start += count
    expected = torch.cat(pieces)
    expected_grads = torch.autograd.grad((expected * weight).sum(), [xr, Ar, Br])
    assert_close_to_scale(out, expected, what="output")
    for got, want, what in zip(grads, expected_grads, ("rows", "A", "B")):
        assert_close_to_scale(got, want, what=f"grad {what}")
    # padding adds nothing; empty expert idle
    assert out[2].abs().max() == 0 and grads[1][1].abs().max() == 0


def reference_adapted_experts(x, weights, indices, experts):
    """Token by token, choice by choice: the expert's SwiGLU with each weight plus its scaled
    update."""
    gate_up = experts.gate_up_proj.detach()
    down = experts.down_proj.detach()
    (A1, B1), (A2, B2) = ((a.A, a.B) for a in (experts.gate_up_lora, experts.down_lora))
    inter = down.shape[1]
    rows = []
    for token in range(x.shape[0]):
        y = torch.zeros(x.shape[1])
        for choice in range(indices.shape[1]):
            e = int(indices[token, choice])
            h = x[token] @ gate_up[e] + SCALE * (x[token] @ A1[e]) @ B1[e]
            h = F.silu(h[:inter]) * h[inter:]
            y = y + weights[token, choice] * (h @ down[e] + SCALE * (h @ A2[e]) @ B2[e])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("align", [None, 4])
def test_adapted_experts_equal_the_loop_values_and_gradients(align, family):
    model = tiny(family)
    name = first_experts(model)
    experts = adapted(model, [name]).get_submodule(name)
    experts.group_align = align  # 4: the padded layout of CUDA's grouped GEMM
    g = torch.Generator().manual_seed(4)
    hidden = experts.gate_up_proj.shape[1]
    x = torch.randn(10, hidden, generator=g, requires_grad=True)
    indices = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(10)])
    indices[:, 0][indices[:, 0] == 5] = 6  # expert 5 gets fewer rows; some may get none
    weights = torch.rand(10, 2, generator=g)
    adapters = [
        experts.gate_up_lora.A,
        experts.gate_up_lora.B,
        experts.down_lora.A,
        experts.down_lora.B,
    ]
    probe = torch.randn(10, hidden, generator=g)
    out = experts(x, weights, indices)
    grads = torch.autograd.grad((out * probe).sum(), [x, *adapters])
    expected = reference_adapted_experts(x, weights, indices, experts)
    expected_grads = torch.autograd.grad((expected * probe).sum(), [x, *adapters])
    assert_close_to_scale(out, expected, what="output")
    for got, want, what in zip(
        grads, expected_grads, ("x", "gate_up A", "gate_up B", "down A", "down B")
    ):
        assert_close_to_scale(got, want, rtol=1e-4, what=f"grad {what}")
    assert experts.gate_up_proj.grad is None and experts.down_proj.grad is None


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_dropout_acts_on_the_adapter_input_only(family):
    """Seeded: the output is W x + s B A dropout(x) with the mask of the same generator state; in
    evaluation, and for the grouped adapter's rows, likewise."""
    model = tiny(family)
    experts = first_experts(model)
    adapted(model, ["layers.0.mlp.up_proj", experts], dropout=0.5)
    linear, grouped = model.layers["0"].mlp.up_proj, model.get_submodule(experts).down_lora
    x = torch.randn(6, linear.in_features, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(11)
    out = linear(x)
    torch.manual_seed(11)
    dropped = F.dropout(x, 0.5, training=True)
    base = x @ linear.weight.T
    assert_close_to_scale(out, base + SCALE * (dropped @ linear.lora.A.T) @ linear.lora.B.T)
    assert not torch.allclose(out, base + SCALE * (x @ linear.lora.A.T) @ linear.lora.B.T)
    model.eval()
    assert_close_to_scale(linear(x), base + SCALE * (x @ linear.lora.A.T) @ linear.lora.B.T)
    model.train()
    rows = torch.randn(7, grouped.A.shape[1], generator=torch.Generator().manual_seed(6))
    ends = torch.tensor([3, 3, 7] + [7] * (grouped.A.shape[0] - 3))
    ends = ends.to(torch.int32)
    torch.manual_seed(12)
    got = grouped(rows, ends)
    torch.manual_seed(12)
    assert_close_to_scale(
        got, grouped_lora(F.dropout(rows, 0.5, training=True), ends, grouped.A, grouped.B, SCALE)
    )


# ============================================================================= whole models


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_step_zero_is_the_base_model(family):
    """B starts at zero: logits and loss bit-equal to the base's; B gets gradients (A none yet), the
    base none."""
    model = tiny(family)
    ids, targets = batch(model.config.vocab_size)
    base_logits, base_loss = model(ids), model(ids, targets)
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, targets=["all"]))
    assert torch.equal(model(ids), base_logits)
    loss = model(ids, targets)
    assert torch.equal(loss, base_loss)
    loss.backward()
    for name, param in model.named_parameters():
        if not lora.is_adapter_key(name):
            assert param.grad is None, name
        elif name.endswith(".A"):
            assert param.grad.abs().max() == 0, name
    assert all(
        p.grad.abs().max() > 0
        for n, p in model.named_parameters()
        if n.endswith("lora.B")
        # the second layer's B all learn at once (MoE in both models)
        and n.startswith("layers.1.")
    )


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_merged_weights_give_the_adapted_logits(family):
    model = adapted(tiny(family))
    ids, _ = batch(model.config.vocab_size)
    base = tiny(family)
    before = base(ids)
    merged = convert.merge_lora(
        model.state_dict(), LoraConfig(rank=RANK, alpha=ALPHA, targets=["all"])
    )
    assert set(merged) == set(base.state_dict())
    base.load_state_dict(merged)
    after, expected = base(ids), model(ids)
    assert_close_to_scale(after, expected, rtol=1e-5, what="merged logits")
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapters changed the model


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_adapters_are_seeded_by_name_in_every_layout(family):
    """A meta build initialised parameter by parameter (as parallel.init_weights does, any rank, any
    order) through lora.initial_value equals the adapters of a model built and adapted at once."""
    config = tiny_config(family)
    lora_config = LoraConfig(rank=RANK, alpha=ALPHA, targets=["all"])
    eager = build(config, seed=3, plain=True)
    apply_lora(eager, lora_config, seed=3)
    with torch.device("meta"):
        meta = type(eager)(config)
    apply_lora(meta, lora_config, seed=3)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in reversed(list(meta.named_parameters())):
            param.copy_(lora.initial_value(meta, name, param, seed=3))
    for name, value in eager.state_dict().items():
        assert torch.equal(meta.state_dict()[name], value), name
    a = eager.get_submodule(first_experts(eager)).gate_up_lora.A
    b = eager.get_submodule(first_experts(eager)).gate_up_lora.B
    # A ~ N(0, 1 / H), B zero
    assert abs(a.std().item() * math.sqrt(a.shape[1]) - 1) < 0.1 and b.abs().max() == 0


@pytest.mark.slow
@only("flint")
@pytest.mark.parametrize("kind", ["0", "2"])
def test_adapted_blocks_compile_whole_and_match_eager(kind, one_thread):
    """fullgraph=True: an adapted block (dense; MoE with padded experts) is one graph whose values
    and adapter gradients equal the eager block's."""
    from helpers import block_inputs

    model = adapted(tiny("flint"))
    model.layers["2"].mlp.experts.group_align = 4
    block = model.layers[kind]
    x, rope, masks = block_inputs(model.config)
    params = [p for p in block.parameters() if p.requires_grad]

    def values_and_grads(fn):
        out = fn(x, rope, masks)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        return out, torch.autograd.grad((out * probe).sum(), [x, *params])

    torch._dynamo.reset()
    compiled_block = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager, compiled = values_and_grads(block), values_and_grads(compiled_block)
    assert_close_to_scale(compiled[0], eager[0], what="output")
    for i, (got, want) in enumerate(zip(compiled[1], eager[1])):
        assert_close_to_scale(got, want, rtol=1e-4, what=f"gradient {i}")


def check_layout(family: str, layout: dict) -> None:
    """One spawned rank: the adapted model laid out by `layout` equals one process (loss, the
    gradients of the adapters this rank holds, clipped norm, two AdamW steps on the adapters); the
    base gets no gradient."""
    from helpers import full, make_batch, rows_of_this_rank
    from parallel import ParallelConfig, build_mesh, parallelize

    def adapted_tiny():
        return adapted(tiny(family))

    reference = adapted_tiny()
    data = make_batch(vocab=reference.config.vocab_size)
    ref_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-2, foreach=False
    )
    cfg = ParallelConfig.from_dict({"param_dtype": "float32", **layout})
    mesh = build_mesh(cfg, "cpu", 8)
    pm = parallelize(adapted_tiny(), cfg, mesh)
    optimizer = torch.optim.AdamW(
        [p for p in pm.module.parameters() if p.requires_grad], lr=1e-2, foreach=False
    )
    for step in range(3):
        ref_loss = reference(*data)
        ref_loss.backward()
        loss = pm.forward_backward(*rows_of_this_rank(mesh, data))
        assert_close_to_scale(loss, ref_loss.detach(), what=f"step {step} loss")
        if step == 0:  # a pipeline stage holds its own layers' parameters
            grads = {n: p.grad for n, p in pm.module.named_parameters()}
            assert any(lora.is_adapter_key(name) for name in grads)
            for name, param in ((n, p) for n, p in reference.named_parameters() if n in grads):
                if lora.is_adapter_key(name):
                    assert_close_to_scale(full(grads[name]), param.grad, what=f"grad {name}")
                else:
                    assert grads[name] is None, name
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in reference.parameters() if p.requires_grad], 0.05
        )
        assert_close_to_scale(pm.clip_grad_norm_(0.05), norm, what=f"step {step} norm")
        for opt in (ref_opt, optimizer):
            opt.step()
            opt.zero_grad()


LAYOUTS = {
    "fsdp2": {"dp_shard": 2},
    "ep2": {"ep": 2, "dp_shard": 1},
    "pp2": {"pp": 2, "dp_shard": 1},
    "cp2": {"cp": 2, "dp_shard": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts_match_one_process(family, layout):
    """FSDP 2, EP 2 (the expert adapters split with their experts), PP 2 and CP 2 on gloo, 3-8 s
    each."""
    from helpers import spawn

    spawn(2, check_layout, family, layout)


# ============================================================================= the base's identity


def test_a_native_base_is_identified_by_its_listed_checksums(tmp_path, trained_once, monkeypatch):
    """A native base with checksums.json: its weight files' CRC-32s are read from the list, no
    byte of the weights is read (crc32_of is never called)."""
    base = tmp_path / "base"  # a path this process has not identified yet
    shutil.copytree(trained_once, base)
    listed = json.loads((base / "checksums.json").read_text())
    names = sorted(name for name in listed if name == ".metadata" or name.endswith(".distcp"))
    expected = json.dumps([[name, listed[name]["bytes"], listed[name]["crc32"]] for name in names])

    def no_reading(file):
        raise AssertionError(f"read {file}")

    monkeypatch.setattr(lora, "crc32_of", no_reading)
    assert lora.weights_sha256(base) == hashlib.sha256(expected.encode()).hexdigest()


def test_a_published_base_is_identified_by_its_content(tmp_path, trained_once):
    """A Hugging Face base (no checksums.json): the CRC-32 of each safetensors file's bytes; a file
    replaced by one of the same size with one byte changed gives another digest."""
    base = tmp_path / "hf"
    convert.main(["to-hf", str(trained_once), str(base)])
    assert not (base / "checksums.json").exists()

    def digest():
        files = sorted(base.glob("*.safetensors"))
        sums = [[f.name, f.stat().st_size, zlib.crc32(f.read_bytes())] for f in files]
        return hashlib.sha256(json.dumps(sums).encode()).hexdigest()

    before = lora.weights_sha256(base)
    assert before == digest()
    shard = sorted(base.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    (tmp_path / "changed").write_bytes(data)
    os.replace(tmp_path / "changed", shard)
    assert lora.weights_sha256(base) == digest() != before


# ============================================================================= export


def peft_delta(lora_a, lora_b, num_experts, scale):
    """peft's ParamWrapper update of fused experts [E, out, in], from its own reshapes, written
    out."""
    a = lora_a.reshape(num_experts, -1, lora_a.shape[-1])  # [E, r, in]
    b = lora_b.reshape(lora_b.shape[0], -1, num_experts)  # [out, r, E]
    return torch.einsum("ore,eri->eoi", b, a) * scale


@only("flint")
def test_peft_tensors_hold_the_same_updates():
    """Each PEFT tensor pair, read as peft reads it, gives the native update (transposed, for
    transformers' [E, out, in] experts), under the published module names."""
    from convert import published_table

    model = adapted(tiny("flint"))
    adapters = lora.adapter_state(model.state_dict())
    tensors = convert.peft_state(adapters, published_table(model.config))
    assert len(tensors) == len(adapters)
    prefix = "base_model.model.model.layers.2"
    gate_up = peft_delta(
        tensors[f"{prefix}.mlp.experts.base_layer.lora_A.weight"],
        tensors[f"{prefix}.mlp.experts.base_layer.lora_B.weight"],
        8,
        SCALE,
    )
    native = lora.delta_weight(
        adapters["layers.2.mlp.experts.gate_up_lora.A"],
        # [E, H, 2*Im]
        adapters["layers.2.mlp.experts.gate_up_lora.B"],
        SCALE,
    )
    assert_close_to_scale(gate_up, native.transpose(1, 2))
    down = peft_delta(
        tensors[f"{prefix}.mlp.experts.lora_A.weight"],
        tensors[f"{prefix}.mlp.experts.lora_B.weight"],
        8,
        SCALE,
    )
    assert_close_to_scale(
        down,
        lora.delta_weight(
            adapters["layers.2.mlp.experts.down_lora.A"],
            adapters["layers.2.mlp.experts.down_lora.B"],
            SCALE,
        ).transpose(1, 2),
    )
    q = (
        tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"]
        @ tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"]
    )
    assert_close_to_scale(
        SCALE * q,
        lora.delta_weight(
            adapters["layers.2.self_attn.q_proj.lora.A"],
            adapters["layers.2.self_attn.q_proj.lora.B"],
            SCALE,
        ),
    )


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_convert_names_modules_as_the_fixture_checked_them(family):
    """convert.py to-peft's module names (convert.transformers_module_name) are those the fixture's
    check gave peft, under which it found every target in transformers' model."""
    from make_lora_peft_fixture import transformers_module_name

    model = tiny(family)
    names = [name for name, _ in model.named_modules() if name]
    assert [convert.transformers_module_name(model.config, name) for name in names] == [
        transformers_module_name(family, name) for name in names
    ]


# The cases of tests/make_lora_peft_fixture.py (family, [lora] settings, base_model_name_or_path).
PEFT_CASES = ["flint", "large4", "flint_linear", "large4_experts"]
# What peft read back from each case's adapter_config.json, from the case's settings by hand: r,
# lora_alpha, lora_dropout (flint_linear's 0.1 on Linear maps; large4_experts' 0.2 written as 0, as
# peft refuses a dropout on target parameters) and the scaling lora_alpha / r: 16 / 8, 3 / 4, 4 / 8.
PEFT_READ = {
    "flint": (8, 16.0, 0.0, [2.0]),
    "large4": (8, 16.0, 0.0, [2.0]),
    "flint_linear": (4, 3.0, 0.1, [0.75]),
    "large4_experts": (8, 4.0, 0.0, [0.5]),
}


def peft_case(case: str):
    from make_lora_peft_fixture import CASES

    return pytest.param(case, marks=only(CASES[case][0]))


@pytest.mark.parametrize("case", [peft_case(case) for case in PEFT_CASES])
def test_the_peft_directory_is_the_one_peft_loaded(case, tmp_path):
    """tests/make_lora_peft_fixture.py loaded this adapter directory with peft onto transformers'
    model (and the merged export with transformers) and got the adapted model's logits: the same
    directory is still written, byte for byte, and the native model still computes those logits.
    Each option the directory carries reached peft: r, lora_alpha, lora_dropout and the scaling as
    peft read them, base_model_name_or_path where set, and as many adapted Linear maps and expert
    weights in peft's model as in the native one."""
    from make_lora_peft_fixture import CASES, adapted_model, adapter_directory, inputs
    from safetensors.torch import load_file

    family, settings, base_model = CASES[case]
    result = json.loads((FIXTURE / case / "result.json").read_text())
    assert result["peft_loads"] and result["merged_loads"] and not result["peft_key_warnings"]
    read = result["peft_read"]
    options = (read["r"], read["lora_alpha"], read["lora_dropout"], read["scalings"])
    assert options == PEFT_READ[case]
    assert not read["use_rslora"]
    if base_model is not None:
        assert read["base_model_name_or_path"] == base_model
    model = adapted_model(family, settings)
    linear = [m for m in model.modules() if isinstance(m, lora.LinearAdapter)]
    grouped = [m for m in model.modules() if isinstance(m, lora.GroupedAdapter)]  # 2 per experts
    assert len(linear) == result["adapted_linear_maps"]
    assert len(grouped) == result["adapted_expert_weights"]
    adapter_directory(family, model, tmp_path / "adapter", settings, base_model)
    written = (tmp_path / "adapter" / "adapter_config.json").read_text()
    assert written == (FIXTURE / case / "adapter_config.json").read_text()
    assert (
        hashlib.sha256(
            (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes()
        ).hexdigest()
        == result["adapter_sha256"]
    )
    expected = load_file(FIXTURE / case / "expected.safetensors")
    assert torch.equal(expected["input_ids"], inputs(family))
    with torch.no_grad():
        logits = model(expected["input_ids"])
    assert_close_to_scale(logits, expected["peft_logits"], rtol=1e-4, what="peft's logits")
    assert_close_to_scale(
        logits, expected["merged_logits"], rtol=1e-4, what="the merged export's logits"
    )


@only("flint")
def test_the_linear_case_adapts_the_maps_its_targets_name():
    """flint_linear's targets q_proj and down_proj on the fixture's 3-layer Flint (layers 0-1
    dense, 2 MoE): q_proj in each layer, the dense MLPs' down_proj and the shared expert's, not the
    routed experts (their down_proj is a parameter, not a module): 6 maps, as peft adapted."""
    from make_lora_peft_fixture import CASES, adapted_model

    family, settings, _ = CASES["flint_linear"]
    model = adapted_model(family, settings)
    adapted = {name for name, m in model.named_modules() if hasattr(m, "lora")}
    assert adapted == {
        "layers.0.self_attn.q_proj",
        "layers.1.self_attn.q_proj",
        "layers.2.self_attn.q_proj",
        "layers.0.mlp.down_proj",
        "layers.1.mlp.down_proj",
        "layers.2.mlp.shared_expert.down_proj",
    }
    result = json.loads((FIXTURE / "flint_linear" / "result.json").read_text())
    assert result["adapted_linear_maps"] == 6
