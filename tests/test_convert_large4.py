"""convert.py on Mistral Large 4 checkpoints: the published layout (tests/fixtures/large4, written
by transformers' save_pretrained), round trips, key accounting, extras and FP8 dequantization."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import StorageWeakRef

import convert
import large4_config
from helpers import dequantize_by_hand, quantize
from large4 import Large4Config

FIXTURES = Path(__file__).parent / "fixtures" / "large4"


def published() -> dict:
    return load_file(FIXTURES / "model.safetensors")


def read_published(directory: Path) -> dict:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / shard))
    return tensors


def write_checkpoint(directory: Path, state: dict, config: dict | None = None) -> Path:
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    config = config or json.loads((FIXTURES / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def assert_bit_exact(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def tracked(function, live: list):
    """`function`, checking that at most one tensor it returned earlier is still alive when
    called."""

    def wrapper(*args):
        assert sum(not ref.expired() for ref in live) <= 1, "an earlier tensor is still held"
        result = function(*args)
        live.extend(StorageWeakRef(t.untyped_storage()) for t in result.values())
        return result

    return wrapper


@pytest.mark.slow
def test_round_trip_hf_native_hf_is_bit_exact_one_tensor_at_a_time(tmp_path, capsys, monkeypatch):
    live = []  # weak references to the storage of every tensor read so far (DCP holds aliases)
    monkeypatch.setattr(convert.SafetensorsDir, "read", tracked(convert.SafetensorsDir.read, live))
    convert.main(["to-native", str(FIXTURES), str(tmp_path / "native")])
    extras = sum(large4_config.is_extra(k) for k in published())
    assert len(live) == len(published()) and extras == 17  # experts read one by one
    live.clear()
    monkeypatch.setattr(convert.NativeDir, "read", tracked(convert.NativeDir.read, live))
    convert.main(
        ["to-hf", str(tmp_path / "native"), str(tmp_path / "hf"), "--max-shard-size", "1MB"]
    )
    assert f"{extras} of them extras" in capsys.readouterr().out
    assert len(live) == len(convert.native_meta(convert.read_config(FIXTURES)[0])) + extras
    assert_bit_exact(read_published(tmp_path / "hf"), published())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["text_config"]["kv_source_layers"] == [0, 1, 1, 3, 4, 4, 6, 3]
    assert (
        written["vision_config"]["hidden_size"] == 32 and written["model_type"] == "mistral_large4"
    )


@pytest.mark.slow
def test_round_trip_native_hf_native_is_bit_exact(tmp_path, capsys):
    model = convert.load_hf(FIXTURES)
    # keeps no extras, as training does
    convert.save_native(model, model.config, tmp_path / "native")
    convert.main(["to-hf", str(tmp_path / "native"), str(tmp_path / "text")])
    assert "0 of them extras" in capsys.readouterr().out
    assert not any(large4_config.is_extra(k) for k in read_published(tmp_path / "text"))
    convert.main(
        ["to-hf", str(tmp_path / "native"), str(tmp_path / "hf"), "--extras-from", str(FIXTURES)]
    )
    convert.main(["to-native", str(tmp_path / "hf"), str(tmp_path / "again")])
    assert_bit_exact(convert.load_native(tmp_path / "again").state_dict(), model.state_dict())
    assert_bit_exact(read_published(tmp_path / "hf"), published())


def test_save_hf_carries_the_extras_of_the_loaded_checkpoint(tmp_path):
    model = convert.load_hf(FIXTURES)
    convert.save_hf(model, tmp_path / "hf")
    assert_bit_exact(read_published(tmp_path / "hf"), published())


def test_hf_to_native_refuses_extras_by_name():
    model = convert.load_hf(FIXTURES)
    with pytest.raises(
        ValueError, match="'mtp_dspark.layers.0.attention.wq.weight' is not part of the text model"
    ):
        convert.hf_to_native(published(), model.config)
    text = {k: v for k, v in published().items() if not large4_config.is_extra(k)}
    assert_bit_exact(convert.hf_to_native(text, model.config), model.state_dict())
    assert_bit_exact(convert.native_to_hf(model.state_dict(), model.config), text)


def test_fused_transformers_experts_load_like_per_expert_ones(tmp_path):
    state, fused = published(), {}
    for key, tensor in state.items():
        if ".experts." not in key:
            fused[key] = tensor
    for layer in range(1, 8):

        def stack(name):
            return torch.stack(
                [state[f"layers.{layer}.experts.{e}.{name}.weight"] for e in range(8)]
            )

        # [E, 2Im, H]
        fused[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack("w1"), stack("w3")], dim=1
        )
        fused[f"layers.{layer}.mlp.experts.down_proj"] = stack("w2")  # [E, H, Im]
    model = convert.load_hf(write_checkpoint(tmp_path / "fused", fused))
    assert_bit_exact(model.state_dict(), convert.load_hf(FIXTURES).state_dict())


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s: s.pop("layers.4.attention.kv_a_norm.weight"),
            "missing key 'layers.4.attention.kv_a_norm.weight'",
        ),
        (
            lambda s: s.__setitem__(
                "layers.2.attention.wkv_a_with_mqa.weight", torch.zeros(28, 64)
            ),
            "unexpected key 'layers.2.attention.wkv_a_with_mqa.weight'",
        ),  # layer 2 reads layer 1's latent
        (
            lambda s: s.__setitem__("layers.2.attention.indexer.wk.weight", torch.zeros(16, 64)),
            "unexpected key 'layers.2.attention.indexer.wk.weight'",
        ),  # layer 2 shares layer 1's selection
        (
            lambda s: s.__setitem__("layers.3.attention.wkv_b.weight", torch.zeros(128, 24)),
            # NoPE: no rope part
            r"'layers.3.attention.wkv_b.weight' has shape \[128, 24\], expected \[144, 24\]",
        ),
        (
            lambda s: s.__setitem__("layers.1.experts.8.w1.weight", torch.zeros(40, 64)),
            "unexpected key 'layers.1.experts.8.w1.weight'",
        ),
    ],
)
def test_strict_key_accounting_names_the_key(tmp_path, change, message):
    state = published()
    change(state)
    with pytest.raises(ValueError, match=message):
        convert.load_hf(write_checkpoint(tmp_path / "bad", state))


# ============================================================================= FP8


def fp8_checkpoint(
    directory: Path, block=(16, 32), scale_suffix=".qscale_weight"
) -> tuple[Path, dict]:
    """The fixture with every 2-D text matrix except router and embeddings in FP8 -> (dir, want)."""
    state, want = published(), {}
    for key in list(state):
        if (
            key.endswith(".weight")
            and state[key].dim() == 2
            and not large4_config.is_extra(key)
            and not key.endswith(("gate.weight", "tok_embeddings.weight", "output.weight"))
        ):
            quantized, scale = quantize(state[key], block)
            state[key], state[key.removesuffix(".weight") + scale_suffix] = quantized, scale
            want[key] = dequantize_by_hand(quantized, scale, block)
    config = json.loads((FIXTURES / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
    return write_checkpoint(directory, state, config), want


@pytest.mark.slow
@pytest.mark.parametrize("scale_suffix", [".qscale_weight", ".weight_scale_inv"])
def test_fp8_checkpoints_are_dequantized_on_load(tmp_path, scale_suffix):
    directory, want = fp8_checkpoint(tmp_path / "fp8", scale_suffix=scale_suffix)
    model = convert.load_hf(directory, dtype=torch.float32)
    layout, params = convert.published_table(model.config), model.state_dict()
    checked = 0
    for native_key, parts in layout.items():
        for part in parts:
            if part.key in want:
                assert torch.equal(
                    convert.published_view(params[native_key], part), want[part.key]
                ), part.key
                checked += 1
    assert checked == len(want) > 100
    bf16 = convert.load_hf(directory)  # default: BF16, FP32 modules stay FP32
    assert bf16.layers["1"].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert bf16.layers["1"].mlp.router.weight.dtype == torch.float32


def test_fp8_import_then_export_writes_bfloat16_without_quantization_config(tmp_path):
    directory, said = fp8_checkpoint(tmp_path / "fp8")[0], []
    model = convert.load_hf(directory)
    # as train.py reads it: quantization_config kept aside
    config = Large4Config.from_hf_config(directory)
    convert.export_published(
        convert.StateSource(model.state_dict(), "model"),
        config,
        tmp_path / "hf",
        log=said.append,
        extras=convert.published_extras(directory, config),
    )
    assert "wrote bfloat16 and float32 tensors" in said[-1] and "nothing is FP8" in said[-1]
    written = read_published(tmp_path / "hf")
    assert written["layers.1.attention.wq.weight"].dtype == torch.bfloat16
    assert not any(k.endswith(large4_config.SCALE_SUFFIXES) for k in written)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s, c: s.pop("layers.1.attention.wq.qscale_weight"),
            "FP8 key 'layers.1.attention.wq.weight' has no per-block scale",
        ),
        (
            lambda s, c: s.__setitem__("layers.1.attention.wq.qscale_weight", torch.ones(2, 2)),
            r"scale 'layers.1.attention.wq.qscale_weight' has shape \[2, 2\], expected \[4, 2\]",
        ),
        (
            lambda s, c: c.pop("quantization_config"),
            "config.json has no quantization_config.weight_block_size",
        ),
    ],
)
def test_bad_fp8_checkpoints_name_the_key(tmp_path, edit, message):
    directory = fp8_checkpoint(tmp_path / "fp8")[0]
    state, config = (
        load_file(directory / "model.safetensors"),
        json.loads((directory / "config.json").read_text()),
    )
    edit(state, config)
    shutil.rmtree(directory)
    with pytest.raises(ValueError, match=message):
        convert.load_hf(write_checkpoint(directory, state, config))


SAVED = Path(__file__).parent / "fixtures" / "large4_saved"


@pytest.mark.slow
def test_what_transformers_writes_back_converts_and_gives_its_logits(tmp_path):
    """tests/make_large4_saved_fixture.py: flint's export loaded by transformers and written back by
    its save_pretrained, which names the vision tower it initialised `model.vision_tower.*`
    (transformers' own spelling of the parts the text model does not use). to-native carries them
    through as extras, and the text model gives transformers' logits."""
    saved_keys = set(load_file(SAVED / "model.safetensors"))
    assert any(key.startswith("model.vision_tower.") for key in saved_keys)
    convert.main(["to-native", str(SAVED), str(tmp_path / "native")])
    model = convert.load_native(tmp_path / "native")
    expected = load_file(SAVED / "expected.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(
            model(expected["input_ids"]), expected["logits"], rtol=1e-4, atol=1e-4
        )
    convert.main(["to-hf", str(tmp_path / "native"), str(tmp_path / "again")])
    assert set(read_published(tmp_path / "again")) == saved_keys


def test_an_export_without_a_vision_part_names_the_smallest_one(tmp_path):
    """A model trained here has no vision tower: the export's config.json gives transformers the
    placeholder (large4_config.PLACEHOLDER_VISION), not nothing, from which it would build its 1.65B
    default tower."""
    from large4 import MistralLarge4
    from layers import build

    config = Large4Config.from_name("large4-tiny")
    convert.save_hf(build(MistralLarge4, config), tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["vision_config"] == large4_config.PLACEHOLDER_VISION
    assert written["architectures"] == ["MistralLarge4ForConditionalGeneration"]
    # the native config.json keeps its own composite
    assert config.to_hf_config().get("vision_config") is None
