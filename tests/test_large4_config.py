"""large4_config.py: presets, the per-layer schedules derived from the scalar fields, the composite
config.json both ways, what a config refuses, naming the field; and the published names, extras, FP8
block layout and dequantization (the conversions that use them run in tests/test_convert_large4.py
against the transformers fixture)."""

import json

import pytest
import torch

import large4_config
from helpers import LARGE4_PARITY, TWO_PRODUCERS, dequantize_by_hand, quantize, text_config
from large4 import MistralLarge4
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


def test_index_schedule_from_freq_offset_and_pattern():
    glm = Large4Config.from_name(
        "large4-tiny", index_topk_freq=4, index_skip_topk_offset=3, indexer_types=None
    )
    assert glm.indexer_types == [
        "full",
        "full",
        "full",
        "shared",
        "shared",
        "shared",
        "full",
        "shared",
    ]
    pattern = Large4Config.from_name(
        "large4-tiny", index_topk_pattern="FFSFSFSF", indexer_types=None
    )
    assert pattern.indexer_types == Large4Config.from_name("large4-tiny").indexer_types


def test_composite_hf_config_round_trip(tmp_path):
    config = Large4Config.from_name(
        LARGE4_PARITY, composite={"vision_config": {"hidden_size": 32}, "image_token_index": 10}
    )
    hf = config.to_hf_config()
    assert (
        hf["model_type"] == "mistral_large4"
        and hf["text_config"]["kv_source_layers"] == TWO_PRODUCERS
    )
    hf["text_config"].update(transformers_version="5.24", dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = Large4Config.from_hf_config(tmp_path)
    assert loaded == config and loaded.to_hf_config()["vision_config"] == {"hidden_size": 32}
    bare = dict(hf["text_config"])
    del bare["indexer_types"], bare["n_routed_experts"]
    bare["num_local_experts"] = 8  # transformers' alias
    assert Large4Config.from_hf_config(bare).n_routed_experts == 8


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(kv_source_layers=[0, 1, 1, 3, 4, 4, 6, 1]), "kv_source_layers[7]"),  # NoPE reads RoPE
        # 4 is a later producer
        (dict(kv_source_layers=[0, 1, 2, 3, 4, 1, 4, 3]), "kv_source_layers[5]"),
        # source is a consumer
        (dict(kv_source_layers=[0, 1, 1, 3, 4, 2, 6, 3]), "kv_source_layers[5]"),
        (dict(kv_source_layers=[0, 2, 2, 3, 4, 4, 6, 3]), "kv_source_layers[1]"),  # later source
        (dict(indexer_types=["shared"] + ["full"] * 7), "indexer_types[0]"),
        (dict(index_head_dim=2), "index_head_dim"),
        (dict(no_rope_layers=[1] * 7), "no_rope_layers"),
        (dict(mlp_layer_types=["dense"] * 7 + ["moe"]), "mlp_layer_types[7]"),
        (dict(q_lora_rank=64), "q_lora_rank"),
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
    ],
)
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        Large4Config.from_name(LARGE4_PARITY, **change)


def test_hf_config_errors_name_the_field():
    hf = Large4Config.from_name(LARGE4_PARITY).to_hf_config()
    hf["text_config"]["mystery"] = 1
    with pytest.raises(ValueError, match="text_config.mystery"):
        Large4Config.from_hf_config(hf)
    hf = Large4Config.from_name(LARGE4_PARITY).to_hf_config()
    hf["text_config"]["qk_head_dim"] = 99
    with pytest.raises(ValueError, match="text_config.qk_head_dim"):
        Large4Config.from_hf_config(hf)


def test_training_from_scratch_beyond_index_topk_is_refused():
    config = Large4Config.from_name("large4-tiny")
    assert "index_topk" in config.training_error(seq_len=16, fresh_weights=True)
    assert config.training_error(seq_len=16, fresh_weights=False) is None
    assert config.training_error(seq_len=4, fresh_weights=True) is None


@pytest.mark.parametrize("rate", [-0.01, "0.01", True])
def test_router_bias_update_rate_must_be_a_number_at_least_zero(rate):
    with pytest.raises(ValueError, match="router_bias_update_rate must be >= 0"):
        Large4Config.from_name(LARGE4_PARITY, router_bias_update_rate=rate)


def test_router_loss_coefficients_are_checked_and_written_only_when_on():
    with pytest.raises(
        ValueError,
        match=r"router_z_loss_coef must be a finite number >= 0 \(0: "
        r"off\), got -1",
    ):
        Large4Config.from_name(LARGE4_PARITY, router_z_loss_coef=-1)
    assert not {"router_sequence_loss_coef", "router_z_loss_coef"} & set(
        text_config(Large4Config.from_name(LARGE4_PARITY))
    )
    config = Large4Config.from_name(
        LARGE4_PARITY, router_sequence_loss_coef=1e-4, router_z_loss_coef=1e-3
    )
    assert Large4Config.from_hf_config(config.to_hf_config()) == config


def test_router_bias_update_rate_is_written_only_when_in_use():
    assert "router_bias_update_rate" not in text_config(Large4Config.from_name(LARGE4_PARITY))
    config = Large4Config.from_name(LARGE4_PARITY, router_bias_update_rate=0.01)
    assert text_config(config)["router_bias_update_rate"] == 0.01
    assert Large4Config.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize(
    "native, published",
    [
        ("embed_tokens.weight", "tok_embeddings.weight"),
        ("rotary.alpha", "lerope.alpha"),
        (
            "layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "layers.3.attention.wkv_a_with_mqa.weight",
        ),
        ("layers.3.self_attn.indexer.wk.weight", "layers.3.attention.indexer.wk.weight"),
        ("layers.1.mlp.shared_expert.down_proj.weight", "layers.1.shared_experts.w2.weight"),
        ("layers.1.mlp.router.weight", "layers.1.gate.weight"),
        ("layers.0.mlp.up_proj.weight", "layers.0.feed_forward.w3.weight"),
    ],
)
def test_native_names_map_to_mistrals(native, published):
    assert large4_config.published_name(native) == published


def test_each_expert_is_a_part_of_the_stacked_native_tensors():
    config = Large4Config.from_name("large4-tiny")
    with torch.device("meta"):
        native = MistralLarge4(config).state_dict()
    table = large4_config.published_layout(native)
    gate_up = table["layers.1.mlp.experts.gate_up_proj"]
    assert [p.key for p in gate_up[:2]] == [
        "layers.1.experts.0.w1.weight",
        "layers.1.experts.0.w3.weight",
    ]
    assert len(gate_up) == 2 * config.n_routed_experts and all(p.transposed for p in gate_up)
    fused = large4_config.published_layout(native, {"layers.1.mlp.experts.gate_up_proj"})
    assert [p.key for p in fused["layers.1.mlp.experts.gate_up_proj"]] == [
        "layers.1.mlp.experts.gate_up_proj"
    ]


def test_extras_are_the_keys_outside_the_text_model():
    assert large4_config.is_extra("vision_encoder.blocks.0.weight") and large4_config.is_extra(
        "mtp_dspark.norm.weight"
    )
    assert not large4_config.is_extra("layers.0.attention.wq.weight")


def test_the_fp8_block_comes_from_either_level_of_the_config_and_scales_are_found_by_either_name():
    quant = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    assert large4_config.block_size({"quantization_config": quant}, "config.json") == (128, 64)
    assert large4_config.block_size(
        {"text_config": {"quantization_config": quant}}, "config.json"
    ) == (128, 64)
    assert large4_config.block_size({}, "config.json") is None
    assert large4_config.scale_key("a.weight", {"a.weight_scale_inv"}) == "a.weight_scale_inv"
    assert large4_config.scale_key("a.weight", {"a.qscale_weight"}) == "a.qscale_weight"
    assert large4_config.scale_grid((3, 300, 130), (128, 64)) == (3, 3, 3)


def test_dequantize_broadcasts_each_scale_over_its_block_partial_edges_included():
    weight = torch.randn(28, 40, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize(weight, (8, 16))
    got = large4_config.dequantize(quantized, scale, (8, 16), torch.float32)
    assert torch.equal(got, dequantize_by_hand(quantized, scale, (8, 16)))
    assert (got - weight).abs().max() <= weight.abs().max() / 8  # E4M3 keeps 3 mantissa bits


@pytest.mark.parametrize("field", ["moe_intermediate_size", "hidden_size"])
def test_grouped_experts_need_widths_on_16_byte_boundaries(field):
    """The grouped GEMM's rows start on 16-byte boundaries: 8 BF16 values. 36 and 60 are refused
    with experts_backend 'grouped' (the field named), taken with 'loop'; 40 and 64 are taken by
    both."""
    refused, accepted = {"moe_intermediate_size": (36, 40), "hidden_size": (60, 64)}[field]
    message = rf"{field} must be a multiple of 8 for experts_backend 'grouped'.* got {refused}"
    with pytest.raises(ValueError, match=message):
        Large4Config.from_name(LARGE4_PARITY, **{field: refused})
    looped = Large4Config.from_name(LARGE4_PARITY, **{field: refused}, experts_backend="loop")
    assert getattr(looped, field) == refused
    assert getattr(Large4Config.from_name(LARGE4_PARITY, **{field: accepted}), field) == accepted
