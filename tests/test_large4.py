"""large4.py: the released size, parity with the plain reference (values and every gradient), the
sparse selection's masks, KV and index sharing, activation checkpointing, frozen indexer,
generation, pipeline stage boundaries, and its own parts through train.py (the config contract is
tests/test_large4_config.py's)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

import convert
import large4
import train
from config import ConfigError, OptimSection
from data import EMBEDDED_CORPUS
from helpers import (
    LARGE4_PARITY,
    ROOT,
    SEQ,
    TWO_PRODUCERS,
    assert_close_to_scale,
    exported_tensors,
    randomized,
    records,
    text_config,
    tiny_config,
    train_losses,
)
from large4 import (
    Large4Config,
    MistralLarge4,
    Visibility,
    build_large4,
    selection_attention_mask,
    selection_block_mask,
    selection_mask,
    top_keys,
)
from reference_large4 import reference_forward, reference_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def params_of(model: MistralLarge4) -> dict:
    return {
        name: param.detach().clone().requires_grad_(param.requires_grad)
        for name, param in model.named_parameters()
    }


@pytest.fixture(scope="module")
def parity_model():
    return randomized(Large4Config.from_name(LARGE4_PARITY))


def boundary_gap(record: dict, visible_counts: torch.Tensor, top_k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th index score over queries that see > k keys."""
    gaps = []
    for _, index in record.values():
        for b, t in (visible_counts > top_k).nonzero().tolist():
            values = index[b, t, : t + 1].sort(descending=True).values
            gaps.append(float(values[top_k - 1] - values[top_k]))
    return min(gaps)


# ======================================================================== parity with the reference


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [40, 7])
def test_logits_loss_and_every_gradient_match_reference(parity_model, seq_len):
    """T = 40 > index_topk = 8 (really sparse, shared indices, both KV consumer kinds); T = 7 <= 8
    (dense)."""
    model, config = parity_model, parity_model.config
    ids = torch.randint(
        0, config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    targets = ids.roll(-1, dims=1)
    targets[0, -3:] = -100
    params = params_of(model)
    record = {}
    ref_logits = reference_forward(params, text_config(config), ids, record=record)
    if seq_len > config.index_topk:
        assert (
            boundary_gap(record, torch.arange(1, seq_len + 1).expand(2, seq_len), config.index_topk)
            > 1e-4
        )
    torch.testing.assert_close(model(ids), ref_logits, rtol=0, atol=2e-5)

    model.zero_grad(set_to_none=True)
    loss = model(ids, targets)
    loss.backward()
    ref_loss = reference_loss(params, text_config(config), ids, targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-6
    checked = 0
    for name, param in model.named_parameters():
        if ".indexer." in name:
            assert param.grad is None and params[name].grad is None, name
            continue
        expected = params[name].grad
        assert param.grad is not None, name
        scale = expected.abs().max().clamp(min=1e-6)
        assert ((param.grad - expected).abs().max() / scale) < 1e-4, name
        checked += 1
    assert checked == sum(".indexer." not in n for n, _ in model.named_parameters())


def test_yarn_default_attention_factor_matches_reference():
    """A published config may omit attention_factor: cos and sin are then scaled by 0.1 ln(factor) +
    1 (1.76 for the release's factor 2048), in attention and in the indexer alike."""
    rope = {
        key: value
        for key, value in Large4Config().rope_parameters.items()
        if key != "attention_factor"
    }
    config = Large4Config.from_hf_config(
        Large4Config.from_name(LARGE4_PARITY, rope_parameters=rope).to_hf_config()
    )
    assert "attention_factor" not in config.rope_parameters
    model = randomized(config)
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    record = {}
    expected = reference_forward(params_of(model), text_config(config), ids, record=record)
    assert boundary_gap(record, torch.arange(1, 41).expand(2, 40), config.index_topk) > 1e-4
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=2e-5)


def test_packed_documents_match_reference_and_never_select_across(parity_model):
    model, config = parity_model, parity_model.config
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 14 + [1] * 18, [5] * 20 + [6] * 9 + [-1] * 3])
    logits = model(ids, doc_ids=doc_ids)
    torch.testing.assert_close(
        logits,
        reference_forward(params_of(model), text_config(config), ids, doc_ids),
        rtol=0,
        atol=2e-5,
    )
    # The second document of row 0 alone gives the same logits: nothing crossed from the first.
    alone = model(ids[:1, 14:])
    torch.testing.assert_close(logits[:1, 14:], alone, rtol=0, atol=2e-5)


# ============================================================================= the selection


def test_indexer_chunking_equals_unchunked():
    generator = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(2, 23, 3, 16, generator=generator),
        torch.randn(2, 23, 16, generator=generator),
    )
    weights = torch.randn(2, 23, 3, generator=generator)
    visible = Visibility(None, 2, 23, 23, torch.device("cpu"))
    whole = top_keys(q, k, weights, visible, 5, chunk=23)
    for chunk in (1, 4, 7):
        assert torch.equal(top_keys(q, k, weights, visible, 5, chunk=chunk), whole)


def test_slots_with_masked_keys_are_invalid_and_never_attended():
    """A query that sees fewer keys than k: top-k fills the rest with future keys, which become
    -1."""
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 10, 2, 8, generator=generator), torch.randn(1, 10, 8, generator=generator)
    allowed = torch.ones(10, 10, dtype=torch.bool).tril().expand(1, 1, 10, 10)
    visible = Visibility(None, 1, 10, 10, torch.device("cpu"))
    assert torch.equal(visible.rows(0, 10), allowed)
    indices = top_keys(q, k, torch.randn(1, 10, 2, generator=generator), visible, 4, chunk=3)
    for t in range(10):
        valid = indices[0, t][indices[0, t] >= 0]
        assert len(valid) == min(t + 1, 4) and bool((valid <= t).all())
    selected = selection_mask(indices, 10)
    assert not bool((selected & ~allowed).any())


def test_a_query_never_sees_the_future_through_the_selection(parity_model):
    """Changing later tokens leaves earlier logits unchanged (T > index_topk, sparse), up to the
    rounding of expert GEMMs whose row counts change (a leak would move logits by ~1e-2)."""
    ids = torch.randint(0, 160, (1, 30), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 160
    torch.testing.assert_close(
        parity_model(ids)[:, :12], parity_model(changed)[:, :12], rtol=0, atol=1e-5
    )


# ======================================================================== sharing and checkpointing


def test_kv_and_index_sharing_wired_by_declared_source(parity_model):
    """The consumer's source latent reaches it: its source's kv_a gets a gradient from layer 7's
    input side, and each consumer owns no kv_a projection (absent keys)."""
    keys = set(parity_model.state_dict())
    for i, source in enumerate(TWO_PRODUCERS):
        has_kv_a = f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight" in keys
        assert has_kv_a == (source == i)
    for i, kind in enumerate(parity_model.config.indexer_types):
        assert (f"layers.{i}.self_attn.indexer.wk.weight" in keys) == (kind == "full")
    assert [parity_model.config.kv_mode(i) for i in range(8)] == [
        None,
        "store",
        "reuse",
        "store",
        "store",
        "reuse_but_indexer",
        None,
        "reuse_but_indexer",
    ]


def test_activation_checkpointing_gradients_bit_identical(parity_model):
    """Two producers of one slot (1 and 4): checkpointed blocks replay with their explicit
    inputs."""
    model = parity_model
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(5))

    def gradients():
        model.zero_grad(set_to_none=True)
        model(ids, ids.roll(-1, 1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    blocks = list(model.layers.values())
    originals = [block.forward for block in blocks]
    try:
        for block, forward in zip(blocks, originals):
            block.forward = lambda *a, f=forward, **kw: checkpoint(f, *a, use_reentrant=False, **kw)
        checkpointed = gradients()
    finally:
        for block, forward in zip(blocks, originals):
            block.forward = forward
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


def test_indexer_is_frozen(parity_model):
    frozen = [n for n, p in parity_model.named_parameters() if not p.requires_grad]
    assert frozen and all(".indexer." in n for n in frozen)
    assert all(p.requires_grad for n, p in parity_model.named_parameters() if ".indexer." not in n)


@pytest.mark.slow
@pytest.mark.parametrize("doc_ids", [[0] * 12 + [1] * 6 + [-1] * 2, [0] * 4 + [1] * 2 + [-1]])
def test_flex_backend_equals_dense_values_and_gradients(parity_model, monkeypatch, doc_ids):
    """The GPU path (FlexAttention with each group's BlockMask) on the CPU, as
    tests/test_attention.py runs flex: its backward is refused on the CPU by a device check only,
    lifted here. T = 20 > index_topk (sparse: the selection's bitmap), T = 7 (dense: the document
    mask); padding queries see no key at all."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    doc_ids = torch.tensor([doc_ids])
    ids = torch.randint(0, 160, doc_ids.shape, generator=torch.Generator().manual_seed(7))

    def run(backend):
        parity_model.config = dataclasses.replace(parity_model.config, attention_backend=backend)
        parity_model.zero_grad(set_to_none=True)
        loss = parity_model(ids, ids.roll(-1, 1), doc_ids=doc_ids)
        loss.backward()
        return loss, {
            n: p.grad.clone() for n, p in parity_model.named_parameters() if p.grad is not None
        }

    config = parity_model.config
    try:
        (dense_loss, dense), (flex_loss, flex) = run("sdpa"), run("flex")
    finally:
        parity_model.config = config
    assert_close_to_scale(flex_loss, dense_loss, rtol=1e-6)
    assert dense.keys() == flex.keys()
    for name in dense:
        assert_close_to_scale(flex[name], dense[name], rtol=1e-4, what=name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("seq_len, groups", [(40, 5), (7, 1)])
def test_attention_mask_built_once_per_group(parity_model, monkeypatch, backend, seq_len, groups):
    """One mask per group of layers sharing a selection (the 5 full indexers of the parity config),
    or one for the whole forward when attention is dense (T <= index_topk), whatever the backend."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    built = []

    def counting(visible, indices, backend):
        built.append(indices)
        return selection_attention_mask(visible, indices, backend)

    monkeypatch.setattr(large4, "selection_attention_mask", counting)
    monkeypatch.setattr(
        parity_model, "config", dataclasses.replace(parity_model.config, attention_backend=backend)
    )
    ids = torch.randint(0, 160, (2, seq_len), generator=torch.Generator().manual_seed(8))
    parity_model(ids, ids.roll(-1, 1)).backward()
    assert len(built) == groups
    assert all(indices is None for indices in built) == (seq_len <= parity_model.config.index_topk)


@pytest.mark.parametrize("q_len, kv_len", [(11, 11), (3, 13)])
def test_selection_block_mask_is_the_selection(q_len, kv_len):
    """The flex mask built from indices alone: its mask_mod is exactly the selection, and the key
    blocks it lists per query block (blocks of 4, partial at the end) are exactly those holding a
    selected key."""
    generator = torch.Generator().manual_seed(9)
    indices = torch.stack(
        [torch.randperm(kv_len, generator=generator)[:5] for _ in range(2 * q_len)]
    ).view(2, q_len, 5)
    indices[torch.rand(indices.shape, generator=generator) < 0.3] = -1
    selected = selection_mask(indices, kv_len)  # [B, 1, T, S]
    mask = selection_block_mask(indices, kv_len, block=4)
    b, q, kv = (
        torch.arange(2).view(2, 1, 1),
        torch.arange(q_len).view(1, q_len, 1),
        torch.arange(kv_len).view(1, 1, -1),
    )
    assert torch.equal(mask.mask_mod(b, None, q, kv), selected[:, 0])
    padded = torch.nn.functional.pad(selected[:, 0], (0, -kv_len % 4, 0, -q_len % 4))
    touched = padded.view(2, -(-q_len // 4), 4, -(-kv_len // 4), 4).any(dim=(2, 4))
    assert torch.equal(mask.to_dense()[:, 0].bool(), touched)


# ============================================================================= generation


def test_generation_equals_recomputation(parity_model):
    """Greedy tokens with the latent cache equal argmax of a full forward at every step, across T >
    k."""
    prompt = torch.randint(0, 160, (2, 5), generator=torch.Generator().manual_seed(6))
    tokens = parity_model.generate(prompt, 10)
    with torch.no_grad():
        for t in range(5, 15):
            logits = parity_model(tokens[:, :t])[:, -1]
            assert torch.equal(logits.argmax(-1), tokens[:, t])
        caches = {}
        step = parity_model.decode_step(tokens[:, :12], caches, 0)
        step = parity_model.decode_step(tokens[:, 12:13], caches, 12)
        torch.testing.assert_close(step, parity_model(tokens[:, :13])[:, -1], rtol=0, atol=1e-5)


def test_rows_that_reach_eos_stop_there(parity_model, check_rows_stop_at_their_eos):
    """Through the shared model.stream, as Flint's: rows finishing at different steps."""
    prompt = torch.randint(0, 160, (3, 5), generator=torch.Generator().manual_seed(6))
    check_rows_stop_at_their_eos(parity_model, prompt, 10)


# ============================================================================= the released model


def test_released_config_counts_and_schedules():
    config = Large4Config()
    assert [i for i, flag in enumerate(config.no_rope_layers) if flag == 0] == list(range(3, 72, 4))
    assert (
        config.mlp_layer_types[:2] == ["dense", "sparse"] and config.indexer_types == ["full"] * 72
    )
    with torch.device("meta"):
        model = MistralLarge4(config)
    assert model.num_params() == 1_050_118_202_912
    assert round(model.num_params(active=True) / 1e9, 2) == 53.10
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert round(frozen / 1e9, 3) == 1.884
    released = Large4Config(
        kv_source_layers=[35 if i >= 39 and i % 4 == 3 else i for i in range(72)]
    )
    with torch.device("meta"):
        assert MistralLarge4(released).num_params() == 1_050_089_886_752


# ============================================================ aux-loss-free balancing (native only)


def test_selection_bias_only_chooses_the_experts(parity_model):
    """A zero bias changes nothing: same loss, same gradients, and no gradient of its own. A large
    one sends every token to the favoured experts, whose gate weights stay the unbiased softmax
    scores."""
    config = dataclasses.replace(parity_model.config, router_bias_update_rate=0.01)
    biased = build_large4(config)
    missing = biased.load_state_dict(parity_model.state_dict(), strict=False).missing_keys
    assert missing and all(key.endswith("mlp.router.selection_bias") for key in missing)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (parity_model, biased):
        model.zero_grad()
        loss = model(ids, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(losses[0], losses[1]) and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
    routers = [layer.mlp.router for layer in biased.layers.values() if hasattr(layer.mlp, "router")]
    favoured = torch.arange(config.num_experts_per_tok)
    for router in routers:
        assert (
            isinstance(router.selection_bias, torch.Tensor)
            and not router.selection_bias.requires_grad
        )
        router.selection_bias[favoured] = 10.0  # far above any softmax score difference
    x = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, indices, _ = routers[0](x)
    assert (indices.sort(dim=1).values == favoured).all()
    scores = torch.softmax(x @ routers[0].weight.T, dim=-1).gather(-1, indices)
    torch.testing.assert_close(
        weights, scores / scores.sum(-1, keepdim=True) * config.routed_scaling_factor
    )
    biased.zero_grad()
    biased(ids, ids).backward()
    for router in routers:
        assert router.tokens_per_expert[favoured].sum() == router.tokens_per_expert.sum()
        assert router.weight.grad.abs().sum() > 0  # the gate weights still train the router


def test_pipeline_stage_boundaries():
    """The tiny config's stage boundaries split what the pipeline layouts must carry: with 2 stages
    (layers 0-3 | 4-7) layer 4 reads layer 1's RoPE latent and key and shares layer 3's selection,
    and layer 7 reads layer 3's NoPE latent; with 4 (0-1 | 2-3 | 4-5 | 6-7) layer 2 reads layer 1's
    RoPE latent and key and shares its selection, layer 3's latent crosses two boundaries to reach
    layer 7, and layer 6 reads layer 5's latent and key. A dense forward (T <= index_topk) sends its
    absent selection as [B, T, 0]."""
    config = tiny_config("large4")
    with torch.device("meta"):
        stage = MistralLarge4(config)

    def shapes(layer, seq_len=SEQ):
        return [
            (tuple(t.shape), t.dtype, t.requires_grad)
            for t in stage.stage_boundary(layer, 2, seq_len, torch.bfloat16)
        ]

    h, table = ((2, SEQ, 64), torch.bfloat16, True), ((2, SEQ, 2), torch.float32, True)
    latent, key = ((2, SEQ, 24), torch.bfloat16, True), ((2, SEQ, 4), torch.bfloat16, True)
    selection = ((2, SEQ, 4), torch.int32, False)
    # layer 1 (RoPE), layer 3 (NoPE)
    assert shapes(4) == [h, table, table, latent, key, latent, selection]
    assert shapes(2) == [h, table, table, latent, key, selection]  # layer 1
    assert shapes(6) == [h, table, table, latent, latent, key, selection]  # layer 3, layer 5
    assert shapes(4, seq_len=4)[-1] == ((2, 4, 0), torch.int32, False)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    # what a first stage reads positionally
    with pytest.raises(TypeError, match="got targets twice"):
        stage(ids, ids, targets=ids)


def test_a_pipeline_stage_sends_the_statistics_on():
    """Large 4's static stage metadata ends with the enabled losses' statistics; off, nothing
    more."""
    losses = dict(router_sequence_loss_coef=0.1, router_z_loss_coef=0.01)
    with torch.device("meta"):
        stage, plain = (
            MistralLarge4(tiny_config("large4", **losses)),
            MistralLarge4(tiny_config("large4")),
        )

    def described(model) -> list[tuple]:
        return [
            (tuple(t.shape), t.dtype, t.requires_grad)
            for t in model.stage_boundary(4, 2, 16, torch.bfloat16)
        ]

    moe_layers, experts = 7, plain.config.num_experts
    assert described(stage) == described(plain) + [
        ((moe_layers, 2, experts), torch.int32, False),
        ((moe_layers, 2, experts), torch.float32, True),
        ((1,), torch.float32, True),
    ]


# ============================================================================= through train.py
# What train.py does with Large 4's own parts: its frozen indexer, its length limit, the extras of
# its published checkpoint. The guarantees both families share run for it in the shared test files.

LARGE4_SMOKE = str(ROOT / "configs" / "large4-smoke.toml")


def large4_args(tmp_path: Path, *overrides: str) -> list[str]:
    """configs/large4-smoke.toml, shrunk to seconds, every path under tmp_path. No sample: a model
    this little trained may pick an id of the padded vocabulary that the byte tokenizer cannot
    decode."""
    return [
        "--config",
        LARGE4_SMOKE,
        f"--data.path={EMBEDDED_CORPUS}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        f"--logging.jsonl={tmp_path / 'metrics.jsonl'}",
        "--logging.peak_tflops=0.1",
        "--data.seq_len=32",
        "--training.batch_size=4",
        "--training.steps=6",
        "--training.eval_every=0",
        "--logging.every=2",
        "--optim.warmup_steps=2",
        "--training.sample_tokens=0",
        *overrides,
    ]


@pytest.mark.slow
def test_trains_through_train_main_with_the_indexer_frozen(tmp_path):
    """A few steps of the tiny Mistral Large 4 through the same path as Flint: loss falls, the
    frozen indexer is neither updated nor in the optimizer, the checkpoint resumes."""
    summary = train.main(large4_args(tmp_path))
    losses = train_losses(tmp_path)
    assert losses[1] == pytest.approx(math.log(264), abs=0.15) and losses[6] < losses[1] - 0.5
    # layer 0 is dense
    assert set(records(tmp_path)[-2]["routing"]) == {str(i) for i in range(1, 8)}
    state = convert.NativeDir(tmp_path / "ckpt" / "run_0001" / "step_00000006").read(
        ["layers.0.self_attn.indexer.wk.weight"]
    )
    fresh = build_large4(
        Large4Config.from_hf_config(tmp_path / "ckpt" / "run_0001" / "step_00000006")
    )
    assert torch.equal(
        state["layers.0.self_attn.indexer.wk.weight"],
        fresh.state_dict()["layers.0.self_attn.indexer.wk.weight"],
    )  # frozen: still its initial value
    optimized = {
        id(p)
        for group in train.build_optimizer(fresh, OptimSection()).param_groups
        for p in group["params"]
    }
    assert {n for n, p in fresh.named_parameters() if id(p) not in optimized} == {
        n for n in fresh.state_dict() if ".indexer." in n
    }
    assert summary["step"] == 6
    resumed = train.main(large4_args(tmp_path, "--training.steps=8", "--checkpoint.resume=auto"))
    assert resumed["step"] == 8


def test_train_py_refuses_a_random_indexer_beyond_index_topk(tmp_path):
    with pytest.raises(ConfigError, match="index_topk"):
        train.main(large4_args(tmp_path, "--data.seq_len=256"))


@pytest.mark.slow
def test_finetune_from_hugging_face_exports_the_extras_of_its_source(tmp_path):
    """Training keeps only the text model; the export copies the vision tower and draft head from
    the init_from checkpoint, so the published loader finds nothing missing."""
    # the smoke config's selection bias is never exported
    unbiased = "--model.router_bias_update_rate=0"
    config = train.load_config(LARGE4_SMOKE, ["--model.index_topk=128", unbiased]).model_config
    convert.save_hf(build_large4(config, seed=3), tmp_path / "hf")
    shard = next((tmp_path / "hf").glob("*.safetensors"))
    state, extra = load_file(shard), torch.arange(6.0)
    save_file({**state, "mtp_dspark.norm.weight": extra}, str(shard))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp_dspark.norm.weight"] = shard.name
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    train.main(
        large4_args(
            tmp_path,
            f"--model.init_from={tmp_path / 'hf'}",
            "--model.preset=",
            unbiased,
            "--training.steps=2",
            f"--checkpoint.export_hf={tmp_path / 'out'}",
        )
    )
    exported = exported_tensors(tmp_path / "out")
    assert torch.equal(exported["mtp_dspark.norm.weight"], extra)
    # trained
    assert not torch.equal(exported["tok_embeddings.weight"], state["tok_embeddings.weight"])
