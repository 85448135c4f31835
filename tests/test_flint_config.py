"""flint_config.py: presets, the config.json round trip, and what a config refuses (more in
tests/test_model.py and tests/test_config.py, which read configs through the model and train.py)."""

import pytest

from flint_config import PRESETS, FlintConfig


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_its_config_json(name):
    config = FlintConfig.from_name(name)
    hf = config.to_hf_config()
    assert hf["model_type"] == "flint" and FlintConfig.from_hf_config(hf).to_hf_config() == hf


def test_the_load_balancing_term_refuses_pipelines_and_context_splits_by_key():
    config = FlintConfig.from_name("tiny", output_router_logits=True)
    assert config.layout_error(1, 1) is None
    assert config.layout_error(2, 1)[0] == "pp" and config.layout_error(1, 2)[0] == "cp"
    assert "works with [parallel].pp = 1 and cp = 1 only" in config.layout_error(2, 2)[1]
    assert FlintConfig.from_name("tiny").layout_error(4, 4) is None


@pytest.mark.parametrize("field, value, message", [
    ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be >= 0, got -0.1"),
    ("num_experts_per_tok", 99, r"num_experts_per_tok \(99\) must be <= num_experts"),
])
def test_impossible_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        FlintConfig.from_name("tiny", **{field: value})
