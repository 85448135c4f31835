"""hf_io.py: the pieces conversions are made of (tests/test_convert.py runs them whole): sizes, the
view a published tensor is of a native one, the atomic output directory."""

import pytest
import torch

from hf_io import Part, atomic_directory, parse_size, published_view


@pytest.mark.parametrize("size, expected", [(123, 123), ("5GB", 5_000_000_000), ("500MiB", 500 * 2**20),
                                            ("1.5 kb", 1500), ("7", 7)])
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
    assert not (tmp_path / "failed").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
