"""large4_hf.py: Mistral Large 4's published names, extras, FP8 block layout and dequantization (the
conversions that use them run in tests/test_convert_large4.py against the transformers fixture)."""

import pytest
import torch

import large4_hf
from conftest import dequantize_by_hand, quantize
from large4 import Large4Config, MistralLarge4


@pytest.mark.parametrize("native, published", [
    ("embed_tokens.weight", "tok_embeddings.weight"), ("rotary.alpha", "lerope.alpha"),
    ("layers.3.self_attn.kv_a_proj_with_mqa.weight", "layers.3.attention.wkv_a_with_mqa.weight"),
    ("layers.3.self_attn.indexer.wk.weight", "layers.3.attention.indexer.wk.weight"),
    ("layers.1.mlp.shared_expert.down_proj.weight", "layers.1.shared_experts.w2.weight"),
    ("layers.1.mlp.router.weight", "layers.1.gate.weight"),
    ("layers.0.mlp.up_proj.weight", "layers.0.feed_forward.w3.weight"),
])
def test_native_names_map_to_mistrals(native, published):
    assert large4_hf.published_name(native) == published


def test_each_expert_is_a_part_of_the_stacked_native_tensors():
    config = Large4Config.from_name("large4-tiny")
    with torch.device("meta"):
        native = MistralLarge4(config).state_dict()
    table = large4_hf.published_layout(native)
    gate_up = table["layers.1.mlp.experts.gate_up_proj"]
    assert [p.key for p in gate_up[:2]] == ["layers.1.experts.0.w1.weight", "layers.1.experts.0.w3.weight"]
    assert len(gate_up) == 2 * config.n_routed_experts and all(p.transposed for p in gate_up)
    fused = large4_hf.published_layout(native, {"layers.1.mlp.experts.gate_up_proj"})
    assert [p.key for p in fused["layers.1.mlp.experts.gate_up_proj"]] == ["layers.1.mlp.experts.gate_up_proj"]


def test_extras_are_the_keys_outside_the_text_model():
    assert large4_hf.is_extra("vision_encoder.blocks.0.weight") and large4_hf.is_extra("mtp_dspark.norm.weight")
    assert not large4_hf.is_extra("layers.0.attention.wq.weight")


def test_the_fp8_block_comes_from_either_level_of_the_config_and_scales_are_found_by_either_name():
    quant = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    assert large4_hf.block_size({"quantization_config": quant}, "config.json") == (128, 64)
    assert large4_hf.block_size({"text_config": {"quantization_config": quant}}, "config.json") == (128, 64)
    assert large4_hf.block_size({}, "config.json") is None
    assert large4_hf.scale_key("a.weight", {"a.weight_scale_inv"}) == "a.weight_scale_inv"
    assert large4_hf.scale_key("a.weight", {"a.qscale_weight"}) == "a.qscale_weight"
    assert large4_hf.scale_grid((3, 300, 130), (128, 64)) == (3, 3, 3)


def test_dequantize_broadcasts_each_scale_over_its_block_partial_edges_included():
    weight = torch.randn(28, 40, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize(weight, (8, 16))
    got = large4_hf.dequantize(quantized, scale, (8, 16), torch.float32)
    assert torch.equal(got, dequantize_by_hand(quantized, scale, (8, 16)))
    assert (got - weight).abs().max() <= weight.abs().max() / 8  # E4M3 keeps 3 mantissa bits
