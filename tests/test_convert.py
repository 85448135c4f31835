"""convert.py: published safetensors <-> native DCP checkpoints and bad input, on Flint's layout
(Large 4's: tests/test_convert_large4.py).

The published checkpoints here are written by hand from SPEC.md's layout (not by convert.py), so
the converter is checked against the spec rather than against itself.
"""

import json
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.multiprocessing.reductions import StorageWeakRef

import convert
from convert import hf_to_native, load_hf, load_native, main, native_to_hf, save_hf, save_native
from registry import FAMILIES

# a fork without Flint: convert.py is tested through tests/test_convert_large4.py
if "flint" not in FAMILIES:
    pytest.skip("Flint's published layout: Flint is not registered", allow_module_level=True)

from flint_model import FlintConfig, build_model  # noqa: E402

CONFIG = FlintConfig.from_name("tiny", num_hidden_layers=4)  # layers 0, 1 dense; 2, 3 MoE


# ============================================================================= helpers


def published_from_model(model, fused=False, sinks="softmax_offset", head_dtype=None) -> dict:
    """The published state dict of a model, written out from SPEC.md's table."""
    inter, out = model.config.moe_intermediate_size, {}
    for name, t in model.state_dict().items():
        key = name if name == "lm_head.weight" else "model." + name
        experts = key.rsplit(".", 1)[0]
        if name.endswith("self_attn.sinks.weight"):
            out[key.replace("sinks.weight", sinks)] = t.clone()
        elif name.endswith("mlp.router.weight"):
            out[key.replace("router.weight", "gate.weight")] = t.clone()
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and fused:
            out[key] = t.transpose(1, 2).contiguous()  # [E, 2Im, H] gate rows first / [E, H, Im]
        elif name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"{experts}.{e}.gate_proj.weight"] = t[e, :, :inter].T.contiguous()  # [Im, H]
                out[f"{experts}.{e}.up_proj.weight"] = t[e, :, inter:].T.contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{experts}.{e}.down_proj.weight"] = t[e].T.contiguous()  # [H, Im]
        else:
            out[key] = t.clone()
    if head_dtype is not None:
        out["lm_head.weight"] = out["lm_head.weight"].to(head_dtype)
    return out


def write_published(directory: Path, state: dict, config=CONFIG, shards: int = 1) -> Path:
    """model.safetensors, or `shards` files with model.safetensors.index.json, plus config.json."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps({**config.to_hf_config(), "dtype": "bfloat16"})
    )
    if shards == 1:
        save_file(state, directory / "model.safetensors")
        return directory
    keys, weight_map = list(state), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = keys[i * len(keys) // shards : (i + 1) * len(keys) // shards]
        save_file({k: state[k] for k in chunk}, directory / name)
        weight_map.update({k: name for k in chunk})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def read_published(directory: Path) -> dict:
    index = directory / "model.safetensors.index.json"
    files = (
        set(json.loads(index.read_text())["weight_map"].values())
        if index.exists()
        else {"model.safetensors"}
    )
    return {k: v for f in sorted(files) for k, v in load_file(directory / f).items()}


def read_native(directory: Path) -> dict:
    """Every tensor entry of a DCP checkpoint, by its flattened key ("model.embed_tokens.weight",
    ...)."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


def assert_bit_exact(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(
            got[key].contiguous().view(torch.uint8), want[key].contiguous().view(torch.uint8)
        ), key


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids)


# =========================================================================== state dicts and models


def test_state_dict_conversion_follows_the_published_table():
    model = build_model(CONFIG, dtype=torch.float32, seed=0)
    native = model.state_dict()
    assert_bit_exact(native_to_hf(native, CONFIG), published_from_model(model))
    assert_bit_exact(hf_to_native(published_from_model(model), CONFIG), native)
    assert_bit_exact(
        hf_to_native(published_from_model(model, fused=True, sinks="sinks"), CONFIG), native
    )


@pytest.mark.parametrize(
    "dtype, fused, sinks, shards, head_dtype",
    [
        (torch.bfloat16, False, "softmax_offset", 3, torch.bfloat16),
        (torch.bfloat16, True, "sinks", 2, None),
        (torch.float32, True, "softmax_offset", 1, None),
        (torch.float32, False, "sinks", 3, None),
    ],
)
def test_load_hf_matches_the_model_built_directly(
    tmp_path, dtype, fused, sinks, shards, head_dtype
):
    model = build_model(CONFIG, dtype=dtype, seed=0)
    if head_dtype is not None:  # the release ships a BF16 head; the model upcasts it exactly
        model.lm_head.weight.data = model.lm_head.weight.data.to(head_dtype).float()
    state = published_from_model(model, fused, sinks, head_dtype)
    loaded = load_hf(write_published(tmp_path / "hf", state, shards=shards))
    for name, param in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == param.dtype, name
        assert torch.equal(loaded.state_dict()[name], param), name
    assert loaded.layers["2"].mlp.router.weight.dtype == torch.float32
    assert torch.equal(logits(loaded), logits(model))


def test_load_hf_casts_bulk_weights_when_asked(tmp_path):
    model = build_model(CONFIG, dtype=torch.float32, seed=0)
    loaded = load_hf(
        write_published(tmp_path / "hf", published_from_model(model)), dtype=torch.bfloat16
    )
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.layers["0"].self_attn.sinks.weight.dtype == torch.float32
    assert loaded.lm_head.weight.dtype == torch.float32
    assert torch.equal(
        loaded.layers["3"].mlp.experts.down_proj, model.layers["3"].mlp.experts.down_proj.bfloat16()
    )


# ===================================================================== command line and round trips


def test_round_trip_hf_native_hf_is_bit_exact(tmp_path, capsys):
    model = build_model(CONFIG, dtype=torch.bfloat16, seed=0)
    original = published_from_model(model, head_dtype=torch.bfloat16)
    hf = write_published(tmp_path / "hf", original, shards=3)
    main(["to-native", str(hf), str(tmp_path / "native")])
    main(["to-hf", str(tmp_path / "native"), str(tmp_path / "back"), "--max-shard-size", "60KB"])
    assert_bit_exact(read_published(tmp_path / "back"), original)
    printed = capsys.readouterr().out
    assert printed.count("read shard") == 3 and "shard 3/" in printed
    assert re.search(rf"wrote {len(original)} tensors, [\d.]+ GB to .*back in [\d.]+ s", printed)
    # no temporary leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "native"]
    # A fused checkpoint comes back in the per-expert form with the same bytes.
    fused = write_published(
        tmp_path / "fused", published_from_model(model, fused=True, sinks="sinks")
    )
    main(["to-native", str(fused), str(tmp_path / "fused-native")])
    main(["to-hf", str(tmp_path / "fused-native"), str(tmp_path / "fused-back")])
    assert_bit_exact(read_published(tmp_path / "fused-back"), published_from_model(model))


def test_round_trip_native_hf_native_is_bit_exact(tmp_path):
    model = build_model(CONFIG, dtype=torch.bfloat16, seed=0)
    save_native(model, CONFIG, tmp_path / "native")
    main(["to-hf", str(tmp_path / "native"), str(tmp_path / "hf")])
    main(["to-native", str(tmp_path / "hf"), str(tmp_path / "again")])
    assert_bit_exact(read_native(tmp_path / "again"), read_native(tmp_path / "native"))
    assert FlintConfig.from_hf_config(tmp_path / "again").to_hf_config() == CONFIG.to_hf_config()
    loaded = load_native(tmp_path / "again")
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(logits(loaded), logits(model))
    assert (
        load_native(tmp_path / "again", dtype=torch.float32).embed_tokens.weight.dtype
        == torch.float32
    )


def test_to_hf_reads_only_the_model_of_a_training_checkpoint(tmp_path):
    model = build_model(CONFIG, dtype=torch.float32, seed=0)
    state = {
        "model": model.state_dict(),
        "optimizer": {"state.embed_tokens.weight.exp_avg": torch.ones(3)},
        "train": {"step": torch.tensor(7)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "step-7"), no_dist=True)
    (tmp_path / "step-7" / "config.json").write_text(json.dumps(CONFIG.to_hf_config()))
    main(["to-hf", str(tmp_path / "step-7"), str(tmp_path / "hf"), "--dtype", "bfloat16"])
    exported = read_published(tmp_path / "hf")
    want = published_from_model(model)
    assert sorted(exported) == sorted(want)
    for key, tensor in want.items():  # the published layout keeps sinks and routers in FP32
        fp32 = key.endswith(("softmax_offset", "mlp.gate.weight"))
        assert torch.equal(exported[key], tensor if fp32 else tensor.bfloat16()), key
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_save_hf_writes_loadable_shards(tmp_path):
    model = build_model(CONFIG, dtype=torch.bfloat16, seed=0)
    save_hf(model, tmp_path / "hf", max_shard_size=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (
        len(shards) > 2
        and sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == shards
    )
    tensors = read_published(tmp_path / "hf")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors) == sorted(published_from_model(model))
    assert torch.equal(logits(load_hf(tmp_path / "hf")), logits(model))
    with pytest.raises(FileExistsError, match="already exists"):
        save_hf(model, tmp_path / "hf")


def test_conversions_hold_at_most_two_native_tensors(tmp_path, monkeypatch):
    # weak references to the storage of every native tensor made so far (DCP holds aliases)
    live = []

    def tracked(function):
        def wrapper(*args):
            assert sum(not ref.expired() for ref in live) <= 1, (
                "an earlier native tensor is still held"
            )
            result = function(*args)
            tensors = result.values() if isinstance(result, dict) else [result]
            live.extend(StorageWeakRef(t.untyped_storage()) for t in tensors)
            return result

        return wrapper

    model = build_model(CONFIG, dtype=torch.bfloat16, seed=0)
    hf = write_published(tmp_path / "hf", published_from_model(model), shards=2)
    monkeypatch.setattr(convert, "build_native", tracked(convert.build_native))
    main(["to-native", str(hf), str(tmp_path / "native")])
    assert len(live) == len(model.state_dict())
    live.clear()
    monkeypatch.setattr(convert.NativeDir, "read", tracked(convert.NativeDir.read))
    main(["to-hf", str(tmp_path / "native"), str(tmp_path / "back")])
    assert len(live) == len(model.state_dict())


# ============================================================================= bad input


def _drop(key):
    return lambda state, d: state.pop(key)


def _set(key, value):
    return lambda state, d: state.__setitem__(key, value(state))


def _config_layers(count):
    config = FlintConfig.from_name("tiny", num_hidden_layers=count)
    return lambda state, d: (d / "config.json").write_text(json.dumps(config.to_hf_config()))


def _edit_index(key, shard):
    def edit(state, d):
        path = d / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        index["weight_map"][key] = shard
        path.write_text(json.dumps(index))

    return edit


def _damage(shard, how):
    def edit(state, d):
        data = (d / shard).read_bytes()
        (d / shard).write_bytes(data[:-100] if how == "truncate" else b"\xff" * 16 + data[16:])

    return edit


S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.3.mlp.experts.5.up_proj.weight"
BAD_INPUT = {  # name: (edit before writing (state) or after (directory), file named, key named)
    "missing expert": (_drop(EXPERT), None, INDEX, EXPERT),
    "unexpected key": (
        _set("model.layers.0.self_attn.bias", lambda s: torch.zeros(4)),
        None,
        S3,
        "model.layers.0.self_attn.bias",
    ),
    "wrong shape": (
        _set("model.layers.1.self_attn.k_proj.weight", lambda s: torch.zeros(64, 32)),
        None,
        S1,
        "model.layers.1.self_attn.k_proj.weight",
    ),
    "wrong dtype": (
        _set("model.norm.weight", lambda s: s["model.norm.weight"].half()),
        None,
        S3,
        "model.norm.weight",
    ),
    "fused and per-expert": (
        _set("model.layers.2.mlp.experts.down_proj", lambda s: torch.zeros(8, 64, 32)),
        None,
        S2,
        "model.layers.2.mlp.experts.0.down_proj.weight",
    ),
    "fewer layers in config": (None, _config_layers(3), S2, "model.layers.3."),
    "more layers in config": (None, _config_layers(5), INDEX, "layers.4."),
    "missing shard": (None, lambda s, d: (d / S2).unlink(), S2, "model.layers."),
    # the last bytes of S3
    "truncated shard": (None, _damage(S3, "truncate"), S3, "model.norm.weight"),
    "corrupt shard": (None, _damage(S2, "corrupt"), S2, "model.layers."),
    "shard outside the directory": (
        None,
        _edit_index("model.norm.weight", "../x.safetensors"),
        INDEX,
        "model.norm.weight",
    ),
    "shard at an absolute path": (
        None,
        _edit_index("model.norm.weight", "/etc/x.safetensors"),
        INDEX,
        "model.norm.weight",
    ),
    "pickle shard": (
        None,
        _edit_index("model.norm.weight", "pytorch_model-00004.bin"),
        "pytorch_model-00004.bin",
        "model.norm.weight",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_published_checkpoints_stop_with_file_and_key_and_write_nothing(tmp_path, case):
    edit_state, edit_dir, file, key = BAD_INPUT[case]
    state = published_from_model(build_model(CONFIG, dtype=torch.bfloat16, seed=0))
    if edit_state:
        edit_state(state, None)
    hf = write_published(tmp_path / "hf", state, shards=3)
    if edit_dir:
        edit_dir(state, hf)
    with pytest.raises(SystemExit) as stop:
        main(["to-native", str(hf), str(tmp_path / "out")])
    message = str(stop.value.code)
    assert file in message and key in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no temporary directory
    with pytest.raises(ValueError, match=re.escape(file)):
        load_hf(hf)


def test_pickle_checkpoints_are_refused_unread(tmp_path):
    marker = tmp_path / "unpickled"

    class Trap:  # unpickling this would create `marker`
        def __reduce__(self):
            return open, (str(marker), "w")

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG.to_hf_config()))
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(pickle.dumps(Trap()))
    with pytest.raises(SystemExit, match="pytorch_model.bin: pickle checkpoints are refused"):
        main(["to-native", str(tmp_path / "hf"), str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing", "shape"])
def test_bad_native_checkpoints_stop_with_file_and_key(tmp_path, case):
    state = build_model(CONFIG, dtype=torch.float32, seed=0).state_dict()
    key = "layers.1.self_attn.q_norm.weight"
    if case == "missing":
        del state[key]
    else:
        state[key] = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, checkpoint_id=str(tmp_path / "native"), no_dist=True)
    (tmp_path / "native" / "config.json").write_text(json.dumps(CONFIG.to_hf_config()))
    with pytest.raises(
        SystemExit,
        match=rf"native/\.metadata.*{case} key '{re.escape(key)}'|"
        rf"native/\.metadata: key '{re.escape(key)}' has {case}",
    ):
        main(["to-hf", str(tmp_path / "native"), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match=re.escape(key)):
        save_native(state, CONFIG, tmp_path / "other")


def test_existing_output_is_never_overwritten(tmp_path):
    hf = write_published(
        tmp_path / "hf", published_from_model(build_model(CONFIG, dtype=torch.float32, seed=0))
    )
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="out: already exists"):
        main(["to-native", str(hf), str(tmp_path / "out")])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_index_and_config_of_the_wrong_shape_name_the_file_and_missing_fields_are_reported(
    tmp_path, capsys
):
    hf = write_published(
        tmp_path / "hf",
        published_from_model(build_model(CONFIG, dtype=torch.float32, seed=0)),
        shards=2,
    )
    index = hf / "model.safetensors.index.json"
    good_index = index.read_text()
    index.write_text("[]")
    with pytest.raises(SystemExit, match=rf"{index}: expected a JSON object, got a list"):
        main(["to-native", str(hf), str(tmp_path / "out")])
    index.write_text(good_index)
    config = json.loads((hf / "config.json").read_text())
    del config["rms_norm_eps"], config["initializer_range"]
    (hf / "config.json").write_text(json.dumps(config))
    main(["to-native", str(hf), str(tmp_path / "out")])
    assert (
        f"{hf / 'config.json'}: 2 field(s) missing, using the defaults: initializer_range = "
        "0.02, "
        f"rms_norm_eps = 1e-06"
    ) in capsys.readouterr().out


def test_output_directories_get_the_permissions_of_a_plain_mkdir(tmp_path):
    """mkdtemp makes 0700 directories; a finished output is readable as umask allows (the group
    too)."""
    from hf_io import atomic_directory, current_umask

    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "x").write_text("x")
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~current_umask()


def test_to_hf_takes_a_runs_checkpoint_directory_as_its_newest_step(tmp_path, capsys):
    """`to-hf runs/x/checkpoints` converts the newest intact step_* of its run_* directories, as
    sample.py's --checkpoint and init_from take it, and names the step; a directory with no
    checkpoint inside says so."""
    older, newer = (build_model(CONFIG, dtype=torch.float32, seed=seed) for seed in (0, 1))
    run = tmp_path / "checkpoints" / "run_0001"
    save_native(older, CONFIG, run / "step_00000001")
    save_native(newer, CONFIG, run / "step_00000002")
    main(["to-hf", str(tmp_path / "checkpoints"), str(tmp_path / "hf")])
    printed = capsys.readouterr().out
    assert f"converting its newest intact step {run / 'step_00000002'}" in printed
    # a model-only checkpoint records no tokenizer
    assert f"no tokenizer written: {run / 'step_00000002'} records none" in printed
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    exported = read_published(tmp_path / "hf")
    for key, value in published_from_model(newer).items():
        assert torch.equal(exported[key], value), key
    (tmp_path / "empty").mkdir()
    refused = r"^error: to-hf .*empty: not a checkpoint .* no complete step_\* checkpoint inside$"
    with pytest.raises(SystemExit, match=refused):
        main(["to-hf", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif("large4" not in FAMILIES, reason="Mistral Large 4 is not registered")
def test_to_hf_explains_what_transformers_reports_on_loading_a_large4_export(tmp_path, capsys):
    """transformers lists a text-only Large 4 export's vision tower as MISSING and warns that a tiny
    preset's YaRN factor (2048) is not its 4096 / 512 = 8 positions ratio: to-hf says why in one
    line. A Flint export gets none (the boundary)."""
    from large4 import Large4Config, MistralLarge4
    from layers import build

    config = Large4Config.from_name("large4-tiny")
    save_native(build(MistralLarge4, config, seed=0), config, tmp_path / "native")
    capsys.readouterr()
    main(["to-hf", str(tmp_path / "native"), str(tmp_path / "hf")])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note")]
    assert notes == [
        f"note, transformers loading {tmp_path / 'hf'}: its load report lists the "
        f"vision tower and projector as MISSING: this export is the text model only, "
        f"so it initializes them fresh, and text generation never runs them "
        f"(--extras-from a release checkpoint writes real ones); it warns that the "
        f"YaRN factor 2048 is not max_position_embeddings / "
        f"original_max_position_embeddings = 8 and uses the explicit factor, as "
        f"flint does: the same rotary frequencies"
    ]
    save_native(build_model(CONFIG, dtype=torch.float32, seed=0), CONFIG, tmp_path / "flint")
    main(["to-hf", str(tmp_path / "flint"), str(tmp_path / "flint_hf")])
    assert "note" not in capsys.readouterr().out
