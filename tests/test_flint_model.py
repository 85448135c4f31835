"""flint_model.py: Flint's config (the released layer schedule, presets, the config.json round trip,
what a config refuses, naming the field or the file), its network (the released size, whole-model
parity with the plain reference, loss, generation) and its published key table (SPEC.md, read both
ways by tests/test_convert.py)."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from safetensors.torch import load_file

import convert
from flint_model import LAYOUT, PRESETS, Flint, FlintConfig, build_model, published_layout
from helpers import assert_close_to_scale
from layers import document_positions
from reference import reference_positions
from reference_flint import layer_types_from_schedule, reference_forward, reference_loss


def test_released_size_counts():
    with torch.device("meta"):
        model = Flint(FlintConfig())
    assert model.num_params() == pytest.approx(39.8e9, rel=0.01)
    embedding = 150144 * 2048  # a lookup, not a matmul: not counted as active
    # SPEC.md's "about 2.5B active"
    assert round((model.num_params(active=True) - embedding) / 1e6) == 2515


# ======================================================================== parity with the reference

PARITY_CONFIG = dict(
    num_hidden_layers=7, sliding_window=6, mlp_only_layers=[0, 1], decoder_sparse_step=1
)


def parity_inputs(seq_len=20):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, seq_len), generator=g)
    targets = torch.randint(0, 256, (2, seq_len), generator=g)
    doc_ids = torch.tensor(
        [[0] * 8 + [1] * 7 + [2] * (seq_len - 15), [4] * 13 + [-1] * (seq_len - 13)]
    )
    targets[doc_ids < 0] = -100
    return ids, targets, doc_ids


def perturbed_model(**overrides):
    """A tiny model whose norms are not all ones, so norm weights are really tested."""
    config = FlintConfig.from_name("tiny", **{**PARITY_CONFIG, **overrides})
    model = build_model(config, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=g))
            if name.endswith("sinks.weight"):
                param.normal_(0.0, 1.0, generator=g)
    return model


def reference_params(model):
    return {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}


def test_parity_setup_covers_the_contract():
    config = perturbed_model().config
    assert {"full_attention", "sliding_attention"} == set(config.layer_types)
    assert config.layer_types.count("sliding_attention") >= 2
    assert any(config.is_moe_layer(i) for i in range(7)) and not config.is_moe_layer(0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_logits_match_reference(backend, monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    model = perturbed_model(attention_backend=backend)
    ids, _, doc_ids = parity_inputs()
    params = reference_params(model)
    hf = model.config.to_hf_config()
    for docs in (None, doc_ids):
        logits = model(ids, doc_ids=docs)
        expected = reference_forward(hf, params, ids, doc_ids=docs)
        assert logits.dtype == torch.float32
        assert (logits - expected).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_gradients_match_reference(backend, monkeypatch):
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    model = perturbed_model(attention_backend=backend, loss_chunk_size=7)
    ids, targets, doc_ids = parity_inputs()
    params = reference_params(model)
    loss = model(ids, targets, doc_ids=doc_ids)
    expected = reference_loss(model.config.to_hf_config(), params, ids, targets, doc_ids=doc_ids)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    expected.backward()
    for name, param in model.named_parameters():
        assert_close_to_scale(param.grad, params[name].grad, rtol=1e-4, what=name)


def test_documents_do_not_see_each_other():
    model = perturbed_model()
    ids, _, doc_ids = parity_inputs()
    changed = ids.clone()
    changed[0, :8] = (changed[0, :8] + 1) % 256  # rewrite document 0 of row 0
    before, after = model(ids, doc_ids=doc_ids), model(changed, doc_ids=doc_ids)
    # Equal up to rounding: the grouped GEMM sees the other tokens in a different order.
    assert_close_to_scale(before[0, 8:], after[0, 8:], rtol=1e-6)
    assert not torch.allclose(before[0, :8], after[0, :8])


def test_positions_restart_per_document():
    _, _, doc_ids = parity_inputs()
    real = doc_ids >= 0  # padding positions produce no loss: their positions do not matter
    assert torch.equal(
        document_positions(doc_ids)[real], reference_positions(doc_ids, *doc_ids.shape)[real]
    )
    assert document_positions(doc_ids)[0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_untrained_loss_is_near_log_vocab():
    model = build_model(FlintConfig.from_name("tiny"), seed=0)
    ids = torch.randint(0, 256, (4, 32))
    assert model(ids, ids).item() == pytest.approx(math.log(256), abs=0.05)


def test_chunked_loss_equals_dense_loss():
    ids, targets, doc_ids = parity_inputs()
    losses, grads = [], []
    for chunk in (5, 10_000):
        model = perturbed_model(loss_chunk_size=chunk)
        loss = model(ids, targets, doc_ids=doc_ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.lm_head.weight.grad)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    assert_close_to_scale(grads[0], grads[1], 1e-5, "head weight gradient")


def test_dtypes_of_fp32_units_with_bf16_bulk():
    model = build_model(FlintConfig.from_name("tiny"), dtype=torch.bfloat16, seed=0)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["embed_tokens.weight"] == torch.bfloat16
    assert dtypes["layers.3.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dtypes["layers.0.self_attn.sinks.weight"] == torch.float32
    assert dtypes["layers.3.mlp.router.weight"] == torch.float32
    assert dtypes["lm_head.weight"] == torch.float32
    loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(input_ids=torch.zeros(2, 4)), "input_ids"),
        (dict(input_ids=torch.zeros(8, dtype=torch.long)), "input_ids"),
        (dict(targets=torch.zeros(2, 5, dtype=torch.long)), "targets"),
        (dict(doc_ids=torch.zeros(2, 4)), "doc_ids"),
    ],
)
def test_bad_inputs_are_named(bad, message):
    model = build_model(FlintConfig.from_name("tiny"), seed=0)
    args = dict(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        **{k: v for k, v in bad.items() if k != "input_ids"},
    )
    if "input_ids" in bad:
        args["input_ids"] = bad["input_ids"]
    with pytest.raises(ValueError, match=message):
        model(**args)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda m: m(torch.zeros(2, 0, dtype=torch.long)),
            r"shape \(2, 0\): it needs at least one "
            r"sequence of at least one",
        ),
        (lambda m: m(torch.zeros(0, 4, dtype=torch.long)), r"shape \(0, 4\)"),
        (lambda m: m.generate(torch.zeros(1, 0, dtype=torch.long), 3), r"shape \(1, 0\)"),
        (
            lambda m: m(torch.tensor([[1, 256]])),
            r"input_ids holds token id 256, outside the vocabulary "
            r"\[0, 256\)",
        ),
        (lambda m: m(torch.tensor([[-1, 2]])), r"input_ids holds token id -1, outside"),
        (
            lambda m: m(torch.tensor([[1, 2]]), torch.tensor([[300, -100]])),
            r"targets holds token id "
            r"300, outside",
        ),
        (
            lambda m: m.generate(torch.tensor([[1]]), 3, temperature=1.0, top_k=0),
            "top_k must be a positive integer",
        ),
        (
            lambda m: m.generate(torch.tensor([[1]]), 3, temperature=-0.5),
            "temperature must be a number >= 0",
        ),
        (lambda m: m.generate(torch.tensor([[1]]), 4096), r"1 \+ 4096 > 4096"),
    ],
)
def test_inputs_that_would_crash_or_mislead_are_refused(call, message):
    model = build_model(FlintConfig.from_name("tiny", num_hidden_layers=2), seed=0)
    with pytest.raises(ValueError, match=message):
        call(model)
    # the edges are allowed
    assert model(torch.tensor([[1, 255]]), torch.tensor([[255, -100]])).isfinite()


def test_flops_per_token_by_hand():
    config = FlintConfig.from_name("tiny", num_hidden_layers=3)  # layers: full, full, full (last)
    model = build_model(config, seed=0)
    H, V, D, Hq, Hkv = 64, 256, 16, 4, 2
    attn = H * Hq * D * 2 + H * Hkv * D * 2
    dense = 3 * H * 128
    moe = 8 * H + 2 * 3 * H * 32 + 3 * H * 64  # router, top-2 experts, shared expert
    matmul_params = 3 * attn + 2 * dense + moe + V * H
    mean_keys = (10 + 1) / 2
    expected = 6 * matmul_params + 3 * 12 * Hq * D * mean_keys
    assert model.flops_per_token(10) == pytest.approx(expected)


# ============================================================================= generation


def recompute_greedy(model, prompt, steps):
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_generate_equals_full_recompute_beyond_the_window():
    model = perturbed_model(sliding_window=4)
    prompt = torch.randint(0, 256, (2, 6))
    generated = model.generate(prompt, max_new_tokens=12)
    assert torch.equal(generated, recompute_greedy(model, prompt, 12))


def test_rows_that_reach_eos_stop_there(check_rows_stop_at_their_eos):
    prompt = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(2))
    check_rows_stop_at_their_eos(perturbed_model(), prompt, 10)


def test_sampling_respects_top_k_and_seed():
    model = perturbed_model()
    prompt = torch.randint(0, 256, (1, 3))
    first = model.generate(
        prompt, 8, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7)
    )
    second = model.generate(
        prompt, 8, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(first, second)
    logits = model(first[:, :3])[:, -1]
    assert first[0, 3].item() in torch.topk(logits, 3).indices[0].tolist()


def test_initial_weights_depend_only_on_the_seed_and_the_name():
    """What lets every parallel layout (parallel.init_weights) start from one process's weights."""
    config = FlintConfig.from_name("tiny")
    model = build_model(config, seed=3).state_dict()
    fewer_layers = build_model(
        FlintConfig.from_name("tiny", num_hidden_layers=3), seed=3
    ).state_dict()
    assert all(torch.equal(fewer_layers[name], model[name]) for name in fewer_layers)
    other_seed = build_model(config, seed=4).state_dict()
    for name, tensor in model.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)) and torch.equal(
                other_seed[name], tensor
            ), name
        else:
            assert not torch.equal(other_seed[name], tensor), name
    q, k = model["layers.0.self_attn.q_proj.weight"], model["layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(q[: k.shape[0]], k)  # each name has its own stream
    assert (
        abs(model["embed_tokens.weight"].std().item() - config.initializer_range)
        < 0.1 * config.initializer_range
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_its_config_json(name):
    config = FlintConfig.from_name(name)
    hf = config.to_hf_config()
    assert hf["model_type"] == "flint" and FlintConfig.from_hf_config(hf).to_hf_config() == hf


def test_the_router_losses_refuse_no_layout_and_are_written_only_when_on():
    """The router losses serve pipelines and context splits (balance.py, tests/test_balance.py);
    the two native coefficients reach config.json only when on, and come back from it."""
    config = FlintConfig.from_name(
        "tiny", output_router_logits=True, router_sequence_loss_coef=1e-4, router_z_loss_coef=1e-3
    )
    assert config.layout_error(4, 4) is None
    loaded = FlintConfig.from_hf_config(config.to_hf_config())
    assert (loaded.router_sequence_loss_coef, loaded.router_z_loss_coef) == (1e-4, 1e-3)
    assert not {"router_sequence_loss_coef", "router_z_loss_coef"} & set(
        FlintConfig().to_hf_config()
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "router_aux_loss_coef",
            -0.1,
            "router_aux_loss_coef must be a finite number >= 0, got -0.1",
        ),
        (
            "router_sequence_loss_coef",
            "1e-4",
            r"router_sequence_loss_coef must be a finite number >= 0 "
            r"\(0: off\), got '1e-4'",
        ),
        ("num_experts_per_tok", 99, r"num_experts_per_tok \(99\) must be <= num_experts"),
    ],
)
def test_impossible_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        FlintConfig.from_name("tiny", **{field: value})


def test_released_schedule():
    config = FlintConfig()
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert full == [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48]
    assert config.layer_types == layer_types_from_schedule(49)
    assert [config.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


def test_prefix_keeps_source_schedule():
    prefix = FlintConfig.from_name("tiny", num_hidden_layers=4, schedule_num_hidden_layers=49)
    assert prefix.layer_types == [
        "full_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    alone = FlintConfig.from_name("tiny", num_hidden_layers=4)
    assert alone.layer_types[3] == "full_attention"


def test_hf_config_round_trip_and_ignored_keys(tmp_path):
    config = FlintConfig.from_name("tiny")
    hf = config.to_hf_config()
    hf.update(
        transformers_version="5.0", torch_dtype="bfloat16", use_cache=False, auto_map={"x": "y"}
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    loaded = FlintConfig.from_hf_config(tmp_path)
    assert loaded.to_hf_config() == config.to_hf_config()


def test_top_level_rope_theta():
    hf = FlintConfig.from_name("tiny").to_hf_config()
    del hf["rope_parameters"]
    hf["rope_theta"] = 500000.0
    assert FlintConfig.from_hf_config(hf).rope_theta == 500000.0


def tiny_hf(**changes):
    hf = FlintConfig.from_name("tiny").to_hf_config()
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(layer_types=["full_attention"] * 3), "layer_types"),
        (dict(layer_types=["full_attention"] * 5 + ["local"]), "layer_types"),
        (dict(no_rope_layer_indices=[0, 1]), "no_rope_layer_indices"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(router_score_function="softmax"), "router_score_function"),
        (dict(softmax_type="vanilla"), "softmax_type"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(moe_intermediate_size=-4), "moe_intermediate_size"),
        (dict(model_type="llama"), "model_type"),
        (dict(some_new_field=1), "some_new_field"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(rope_parameters=[10000.0]), "rope_parameters must be an object"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
            r"rope_theta must be a "
            r"number > 0, got '1e4'",
        ),
        (dict(rope_parameters=None, rope_theta=[1]), r"rope_theta must be a number > 0, got \[1\]"),
        (dict(layer_types="full_attention"), "layer_types must be a list"),
        (dict(mlp_only_layers=0), "mlp_only_layers must be a list of layer indices, got 0"),
        (dict(mlp_only_layers=["0"]), "mlp_only_layers must be a list of layer indices"),
        (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number > 0, got '1e-6'"),
        (
            dict(eos_token_id="2"),
            "eos_token_id must be a token id, a list of token ids or null, got '2'",
        ),
        (dict(eos_token_id=[2, None]), "eos_token_id must be"),
    ],
)
def test_contract_violations_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        FlintConfig.from_hf_config(tiny_hf(**changes))


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset"):
        FlintConfig.from_name("gigantic")


def test_config_json_of_the_wrong_shape_or_encoding_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"{path}: expected a JSON object, got a list"):
        FlintConfig.from_hf_config(path)
    path.write_bytes(b'{"model_type": "fl\xefnt"}')
    with pytest.raises(ValueError, match=rf"{path}: cannot read JSON: 'utf-8' codec"):
        FlintConfig.from_hf_config(path)
    path.write_text(json.dumps(tiny_hf(rms_norm_eps=[1e-6])))
    with pytest.raises(ValueError, match=rf"{path}: rms_norm_eps must be a number > 0"):
        FlintConfig.from_hf_config(path)


def native_meta(config: FlintConfig) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return Flint(config).state_dict()


def test_every_native_tensor_is_covered_exactly_once_by_its_published_parts():
    """Per-expert form: each routed expert's gate and up halves and its down matrix are parts of the
    stacked native tensors, and together they cover each native element once."""
    config = FlintConfig.from_name("tiny", num_hidden_layers=3)
    native = native_meta(config)
    table = published_layout(config, native, set())
    assert set(table) == set(native)
    for key, parts in table.items():
        covered = torch.zeros(native[key].shape, dtype=torch.int32)
        for part in parts:
            covered[part.index] += 1
        assert (covered == 1).all(), key
    experts = table["layers.2.mlp.experts.gate_up_proj"]
    assert (
        len(experts) == 2 * config.num_experts
        and experts[0].key == "model.layers.2.mlp.experts.0.gate_proj.weight"
    )
    assert (
        table["layers.0.self_attn.sinks.weight"][0].key == "model.layers.0.self_attn.softmax_offset"
    )
    assert table["layers.2.mlp.router.weight"][0].key == "model.layers.2.mlp.gate.weight"
    assert table["lm_head.weight"][0].key == "lm_head.weight"


def test_a_source_in_transformers_form_is_read_in_that_form():
    """Fused experts keep the native name; sinks are called `sinks`."""
    config = FlintConfig.from_name("tiny", num_hidden_layers=3)
    present = {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.0.self_attn.sinks"}
    table = published_layout(config, native_meta(config), present)
    assert [p.key for p in table["layers.2.mlp.experts.gate_up_proj"]] == [
        "model.layers.2.mlp.experts.gate_up_proj"
    ]
    assert table["layers.0.self_attn.sinks.weight"][0].key == "model.layers.0.self_attn.sinks"


def test_the_fields_a_config_json_leaves_out_are_named():
    config = FlintConfig.from_name("tiny")
    given = {
        k: v
        for k, v in config.to_hf_config().items()
        if k not in ("sliding_window", "rope_parameters")
    }
    assert set(LAYOUT.missing_fields(config, given)) == {"sliding_window", "rope_parameters"}
    assert "rope_parameters" not in LAYOUT.missing_fields(config, {**given, "rope_theta": 1e4})


# ======================================================================= the published balance term
# tests/make_flint_aux_fixture.py wrote tests/fixtures/flint_aux/ once with transformers'
# FlintForCausalLM (output_router_logits true, router_aux_loss_coef 0.25): a tiny random model, a
# batch with a right-padded row, and the reference's losses and gradients with and without its
# attention_mask. Here the same weights, loaded with convert.load_hf, must give the same numbers.

AUX_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "flint_aux"


@pytest.fixture(scope="module")
def aux_batch():
    inputs = load_file(AUX_FIXTURE / "inputs.safetensors")
    # the reference shifts its labels inside the loss
    targets = torch.full_like(inputs["labels"], -100)
    targets[:, :-1] = inputs["labels"][:, 1:]
    doc_ids = torch.where(inputs["attention_mask"] == 1, 0, -1)  # padding: doc id -1
    return inputs["input_ids"], targets, doc_ids


@pytest.mark.parametrize("case", ["masked", "unmasked"])
def test_loss_and_gradients_equal_the_reference(case, aux_batch):
    model = convert.load_hf(AUX_FIXTURE / "model", dtype=torch.float32)
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.25
    expected = load_file(AUX_FIXTURE / f"{case}.safetensors")
    input_ids, targets, doc_ids = aux_batch
    loss = model(input_ids, targets, doc_ids=doc_ids if case == "masked" else None)
    loss.backward()
    assert_close_to_scale(loss.detach(), expected["loss"], rtol=1e-6)
    reference_grads = convert.hf_to_native(
        {k[5:]: v for k, v in expected.items() if k.startswith("grad.")}, model.config
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        assert_close_to_scale(grad, reference_grads[name], rtol=1e-4, what=f"{name}")


def test_without_output_router_logits_the_loss_is_the_cross_entropy(aux_batch):
    """The released default: the coefficient is carried but unused, as in the reference."""
    expected = load_file(AUX_FIXTURE / "masked.safetensors")
    model = convert.load_hf(AUX_FIXTURE / "model", dtype=torch.float32)
    input_ids, targets, doc_ids = aux_batch
    with_term = model(input_ids, targets, doc_ids=doc_ids).detach()
    model.config = dataclasses.replace(model.config, output_router_logits=False)
    without = model(input_ids, targets, doc_ids=doc_ids).detach()
    assert_close_to_scale(without, expected["ce_loss"], rtol=1e-6)
    assert_close_to_scale((with_term - without) / 0.25, expected["aux_loss"], rtol=1e-5)
