"""flint_hf.py: Flint's published key table (SPEC.md), read both ways by tests/test_convert.py."""

import torch

from flint_hf import LAYOUT, published_layout
from model import Flint, FlintConfig


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
    assert len(experts) == 2 * config.num_experts and experts[0].key == "model.layers.2.mlp.experts.0.gate_proj.weight"
    assert table["layers.0.self_attn.sinks.weight"][0].key == "model.layers.0.self_attn.softmax_offset"
    assert table["layers.2.mlp.router.weight"][0].key == "model.layers.2.mlp.gate.weight"
    assert table["lm_head.weight"][0].key == "lm_head.weight"


def test_a_source_in_transformers_form_is_read_in_that_form():
    """Fused experts keep the native name; sinks are called `sinks`."""
    config = FlintConfig.from_name("tiny", num_hidden_layers=3)
    present = {"model.layers.2.mlp.experts.gate_up_proj", "model.layers.0.self_attn.sinks"}
    table = published_layout(config, native_meta(config), present)
    assert [p.key for p in table["layers.2.mlp.experts.gate_up_proj"]] == ["model.layers.2.mlp.experts.gate_up_proj"]
    assert table["layers.0.self_attn.sinks.weight"][0].key == "model.layers.0.self_attn.sinks"


def test_the_fields_a_config_json_leaves_out_are_named():
    config = FlintConfig.from_name("tiny")
    given = {k: v for k, v in config.to_hf_config().items() if k not in ("sliding_window", "rope_parameters")}
    assert set(LAYOUT.missing_fields(config, given)) == {"sliding_window", "rope_parameters"}
    assert "rope_parameters" not in LAYOUT.missing_fields(config, {**given, "rope_theta": 1e4})
