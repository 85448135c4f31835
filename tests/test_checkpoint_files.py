"""checkpoint_files.py on one small checkpoint directory: what it saves loads back, checksums catch a
changed byte and a truncated file, and what it reads can never call code (crafted files from a real
training run: tests/test_checkpoint.py)."""

import enum
import pickle

import pytest
import torch

from checkpoint_files import (CheckpointError, damage, enum_member, load_dcp, read_metadata, save_dcp,
                              write_checksums)


@pytest.fixture
def saved(tmp_path):
    state = {"model": {"w": torch.arange(1000.0).view(10, 100)}, "train": {"step": torch.tensor(7)}}
    save_dcp(state, tmp_path / "ckpt")
    write_checksums(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_what_is_saved_loads_back(saved):
    state = {"model": {"w": torch.zeros(10, 100)}, "train": {"step": torch.tensor(0)}}
    load_dcp(state, saved, alone=True)
    assert torch.equal(state["model"]["w"], torch.arange(1000.0).view(10, 100)) and int(state["train"]["step"]) == 7
    assert set(read_metadata(saved).state_dict_metadata) == {"model.w", "train.step"}


def test_a_changed_byte_and_a_truncated_file_are_named(saved):
    shard = next(saved.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert damage(saved).startswith(f"{shard}: checksum mismatch")
    shard.write_bytes(bytes(data[:100]))
    assert damage(saved) == f"{shard}: 100 bytes, {len(data)} when saved (truncated or overwritten)"
    (saved / "checksums.json").unlink()  # then the sizes the metadata records say it
    assert damage(saved).startswith(f"{shard}: truncated (100 of ")
    with pytest.raises(CheckpointError, match=str(shard)):
        load_dcp({"model": {"w": torch.zeros(10, 100)}, "train": {"step": torch.tensor(0)}}, saved, alone=True)


class Colour(enum.Enum):
    RED = 1


def test_getattr_in_metadata_fetches_enum_members_only():
    assert enum_member(Colour, "RED") is Colour.RED
    for cls, name in [(Colour, "__class__"), (Colour, "BLUE"), (dict, "get"), (Colour, 1)]:
        with pytest.raises(pickle.UnpicklingError, match="could run code"):
            enum_member(cls, name)
