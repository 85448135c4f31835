"""large4_config.py: presets and the composite config.json (the schedules' validation is in
tests/test_large4.py, beside the sharing it protects)."""

import pytest

from large4_config import PRESETS, Large4Config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_the_composite_config_json(name):
    config = Large4Config.from_name(name)
    hf = config.to_hf_config()
    assert hf["model_type"] == "mistral_large4" and "text_config" in hf
    assert Large4Config.from_hf_config(hf).to_hf_config() == hf


def test_large4_trains_with_any_layout_and_refuses_a_random_indexer_past_index_topk():
    config = Large4Config.from_name("large4-tiny")
    assert config.layout_error(4, 4) is None
    assert config.training_error(config.index_topk, fresh_weights=True) is None
    assert "index_topk" in config.training_error(config.index_topk + 1, fresh_weights=True)
    assert config.training_error(config.index_topk + 1, fresh_weights=False) is None
