"""flint_config.py: the released layer schedule, presets, the config.json round trip, and what a config
refuses, naming the field or the file (tests/test_config.py reads configs through train.py)."""

import json

import pytest

from flint_config import PRESETS, FlintConfig
from reference import layer_types_from_schedule


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_its_config_json(name):
    config = FlintConfig.from_name(name)
    hf = config.to_hf_config()
    assert hf["model_type"] == "flint" and FlintConfig.from_hf_config(hf).to_hf_config() == hf


def test_the_router_losses_refuse_no_layout_and_are_written_only_when_on():
    """The router losses serve pipelines and context splits (router_loss.py, tests/test_router_loss.py);
    the two native coefficients reach config.json only when on, and come back from it."""
    config = FlintConfig.from_name("tiny", output_router_logits=True, router_sequence_loss_coef=1e-4,
                                   router_z_loss_coef=1e-3)
    assert config.layout_error(4, 4) is None
    loaded = FlintConfig.from_hf_config(config.to_hf_config())
    assert (loaded.router_sequence_loss_coef, loaded.router_z_loss_coef) == (1e-4, 1e-3)
    assert not {"router_sequence_loss_coef", "router_z_loss_coef"} & set(FlintConfig().to_hf_config())


@pytest.mark.parametrize("field, value, message", [
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be >= 0, got -0.1"),
    ("router_sequence_loss_coef", "1e-4", r"router_sequence_loss_coef must be a number >= 0 \(0: off\), got '1e-4'"),
    ("num_experts_per_tok", 99, r"num_experts_per_tok \(99\) must be <= num_experts"),
])
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
    assert prefix.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    alone = FlintConfig.from_name("tiny", num_hidden_layers=4)
    assert alone.layer_types[3] == "full_attention"


def test_hf_config_round_trip_and_ignored_keys(tmp_path):
    config = FlintConfig.from_name("tiny")
    hf = config.to_hf_config()
    hf.update(transformers_version="5.0", torch_dtype="bfloat16", use_cache=False, auto_map={"x": "y"})
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


@pytest.mark.parametrize("changes, field", [
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
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), r"rope_theta must be a number > 0, got '1e4'"),
    (dict(rope_parameters=None, rope_theta=[1]), r"rope_theta must be a number > 0, got \[1\]"),
    (dict(layer_types="full_attention"), "layer_types must be a list"),
    (dict(mlp_only_layers=0), "mlp_only_layers must be a list of layer indices, got 0"),
    (dict(mlp_only_layers=["0"]), "mlp_only_layers must be a list of layer indices"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a number > 0, got '1e-6'"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id, a list of token ids or null, got '2'"),
    (dict(eos_token_id=[2, None]), "eos_token_id must be"),
])
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
