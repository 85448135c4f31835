"""hf_io.py: the pieces conversions are made of (tests/test_convert.py runs them whole): sizes, the
view a published tensor is of a native one, the atomic output directory, the streaming safetensors
writer and the reader of published directories."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_io import (
    Entry,
    Part,
    SafetensorsDir,
    atomic_directory,
    parse_size,
    published_view,
    write_safetensors,
)


@pytest.mark.parametrize(
    "size, expected",
    [(123, 123), ("5GB", 5_000_000_000), ("500MiB", 500 * 2**20), ("1.5 kb", 1500), ("7", 7)],
)
def test_sizes_in_decimal_and_binary_units(size, expected):
    assert parse_size(size) == expected


def test_a_size_that_is_no_size_names_the_setting():
    with pytest.raises(ValueError, match="max_shard_size must be bytes or a size like '5GB'"):
        parse_size("five gigabytes")


def test_a_published_tensor_is_a_view_of_its_native_one():
    native = torch.arange(24.0).view(2, 3, 4)  # [E, H, 2 * Im]
    part = Part("experts.1.w3.weight", (1, slice(None), slice(2, 4)), True)
    view = published_view(native, part)
    assert view.shape == (2, 3) and torch.equal(view, native[1, :, 2:4].T)
    view.fill_(-1)  # importing copies into the view: it writes the native tensor
    assert (native[1, :, 2:4] == -1).all() and (native[0] >= 0).all()


def test_the_output_directory_appears_whole_or_not_at_all(tmp_path):
    with atomic_directory(tmp_path / "out") as work:
        (work / "a.safetensors").write_text("x")
        assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.safetensors"]
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "failed") as work:
        (work / "half").write_text("x")
        raise RuntimeError("a conversion that fails part-way")
    assert not (tmp_path / "failed").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "out"
    ]


def write(path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` through the streaming writer, each entry's data asked for only when it is
    written."""
    entries = [
        Entry(None, Part(key, (), False), tuple(t.shape), t.dtype) for key, t in tensors.items()
    ]
    write_safetensors(path, entries, lambda entry: tensors[entry.part.key])


def test_the_streaming_writer_writes_what_safetensors_reads(tmp_path):
    # 10 bytes: b ends unaligned
    tensors = {
        "a": torch.arange(6.0).view(2, 3),
        "b": torch.arange(5).to(torch.bfloat16),
        "c": torch.arange(4.0).view(2, 2).T.to(torch.float16),
    }  # not contiguous
    write(tmp_path / "model.safetensors", tensors)
    written = load_file(tmp_path / "model.safetensors")
    assert list(written) == list(tensors) and all(
        torch.equal(written[k], t) for k, t in tensors.items()
    )
    source = SafetensorsDir(tmp_path)
    assert source.meta == {
        "a": ((2, 3), torch.float32),
        "b": ((5,), torch.bfloat16),
        "c": ((2, 2), torch.float16),
    }
    assert all(torch.equal(tensors[k], t) for k, t in source.read(["c", "a"]).items())


def test_a_sharded_directory_reads_each_key_from_the_shard_its_index_names(tmp_path):
    write(tmp_path / "one.safetensors", {"a": torch.ones(3)})
    write(tmp_path / "two.safetensors", {"b": torch.zeros(2, 2), "c": torch.full((1,), 7.0)})
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    source = SafetensorsDir(tmp_path)
    assert (source.where("a"), source.where("c")) == (
        str(tmp_path / "one.safetensors"),
        str(tmp_path / "two.safetensors"),
    )
    read = source.read(["c", "a"])
    assert (
        sorted(read) == ["a", "c"]
        and torch.equal(read["a"], torch.ones(3))
        and read["c"].item() == 7.0
    )


def test_a_truncated_file_names_the_tensor_that_is_cut_off(tmp_path):
    write(tmp_path / "model.safetensors", {"a": torch.ones(4), "b": torch.ones(100)})
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # the last two of b's floats
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: truncated or corrupt .* \(tensor 'b' "
        r"is cut off\)",
    ):
        SafetensorsDir(tmp_path)
