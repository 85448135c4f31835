"""checkpoint_files.py: what it saves loads back, checksums catch a changed byte and a truncated
file, damaged files are named in one line, and what it reads can never call code: crafted metadata
and .distcp entries in a real training run's checkpoint are refused by every reader of native
checkpoints."""

import enum
import io
import json
import pickle
import pickletools
import re
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint_files
import convert
from checkpoint_files import (
    CheckpointError,
    damage,
    enum_member,
    load_dcp,
    read_metadata,
    save_dcp,
    write_checksums,
)
from helpers import FAMILY_NAMES, run_debug, trained_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def saved(tmp_path):
    state = {"model": {"w": torch.arange(1000.0).view(10, 100)}, "train": {"step": torch.tensor(7)}}
    save_dcp(state, tmp_path / "ckpt")
    write_checksums(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_what_is_saved_loads_back(saved):
    state = {"model": {"w": torch.zeros(10, 100)}, "train": {"step": torch.tensor(0)}}
    load_dcp(state, saved, alone=True)
    assert (
        torch.equal(state["model"]["w"], torch.arange(1000.0).view(10, 100))
        and int(state["train"]["step"]) == 7
    )
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
        load_dcp(
            {"model": {"w": torch.zeros(10, 100)}, "train": {"step": torch.tensor(0)}},
            saved,
            alone=True,
        )


class Colour(enum.Enum):
    RED = 1


def test_getattr_in_metadata_fetches_enum_members_only():
    assert enum_member(Colour, "RED") is Colour.RED
    for cls, name in [(Colour, "__class__"), (Colour, "BLUE"), (dict, "get"), (Colour, 1)]:
        with pytest.raises(pickle.UnpicklingError, match="could run code"):
            enum_member(cls, name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_crafted_metadata_never_runs_code(tmp_path, family):
    """A .metadata whose pickle would create `marker` is refused by every reader of native
    checkpoints: convert.py to-hf, convert.load_native, a resume and [model].init_from, of each
    family."""
    marker = tmp_path / "code_ran"

    class Trap:
        def __reduce__(self):
            return open, (str(marker), "w")

    crafted = trained_checkpoint(tmp_path / "run", family)
    (crafted / ".metadata").write_bytes(pickle.dumps(Trap()))
    refused = r"\.metadata: not a valid checkpoint metadata file .*names io.open.*could run code"
    with pytest.raises(SystemExit, match=refused):
        convert.main(["to-hf", str(crafted), str(tmp_path / "hf")])
    with pytest.raises(CheckpointError, match=refused):
        convert.load_native(crafted)
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "resume", f"--checkpoint.resume={crafted}", family=family)
    with pytest.raises(CheckpointError, match=refused):
        run_debug(
            tmp_path / "init", f"--model.init_from={crafted}", "--model.preset=", family=family
        )
    assert not marker.exists() and not (tmp_path / "hf").exists()
    pickle.loads((crafted / ".metadata").read_bytes())  # what torch's own reader does
    assert marker.exists()  # the trap works: the test above would have seen it


class CreatesMarker:
    """Unpickled, it creates the file `path`: the stand-in for any code a crafted pickle could
    run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def plant_in_entry(checkpoint_dir: Path, key: str, payload) -> None:
    """What an attacker can do to a checkpoint: make entry `key` a non-tensor entry whose bytes are
    torch.save(payload), in a new .distcp file, and list every file's checksum again."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(checkpoint_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, just written
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (checkpoint_dir / "__9_0.distcp").write_bytes(buffer.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [index for index in metadata.storage_data if index.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
        "__9_0.distcp", 0, len(buffer.getvalue())
    )
    with open(checkpoint_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    (checkpoint_dir / "checksums.json").unlink()
    checkpoint_files.write_checksums(checkpoint_dir)


@pytest.mark.slow
def test_crafted_entries_of_distcp_files_never_run_code(tmp_path):
    """A non-tensor entry whose pickle would create `marker` (an optimizer group's lr, which every
    resume reads; a model weight, which every reader of weights reads) is refused on every path: an
    explicit resume, resume = "auto", [model].init_from, convert.py to-hf and convert.load_native.
    Machinery independent of the model (the entries' bytes): the first registered family."""
    marker = tmp_path / "code_ran"
    optimizer_entry = trained_checkpoint(tmp_path / "optimizer")
    lr_key = next(
        key
        for key in checkpoint_files.read_metadata(optimizer_entry).state_dict_metadata
        if key.startswith("optimizer.param_groups.") and key.endswith(".lr")
    )
    plant_in_entry(optimizer_entry, lr_key, CreatesMarker(marker))
    model_entry = trained_checkpoint(tmp_path / "model")
    plant_in_entry(model_entry, "model.norm.weight", CreatesMarker(marker))
    refused = r"entry '.*' is refused: it names io.open \(loading it could run code\)"
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "explicit", f"--checkpoint.resume={optimizer_entry}")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "optimizer", "--checkpoint.resume=auto")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "model", "--checkpoint.resume=auto")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "init", f"--model.init_from={model_entry}", "--model.preset=")
    # convert.py lists a checkpoint's weights first, and refuses one that is not a tensor before any
    # load.
    not_a_tensor = r"unexpected key 'model.norm.weight': not a tensor"
    with pytest.raises(SystemExit, match=not_a_tensor):
        convert.main(["to-hf", str(model_entry), str(tmp_path / "hf")])
    with pytest.raises(ValueError, match=not_a_tensor):
        convert.load_native(model_entry)
    # and the loader they use, were that check gone
    with pytest.raises(CheckpointError, match=refused):
        checkpoint_files.load_dcp(
            {"model": {"norm.weight": torch.zeros(64)}}, model_entry, alone=True
        )
    assert not marker.exists() and not (tmp_path / "hf").exists()
    # what DCP's planner does
    torch.load(io.BytesIO((model_entry / "__9_0.distcp").read_bytes()), weights_only=False)
    assert marker.exists()  # the trap works: the checks above would have seen it


def test_plain_non_tensor_entries_still_load(tmp_path):
    """What DCP stores as bytes in our checkpoints (floats, tuples, bools, None of the optimizer
    groups) loads through the weights-only reader, values intact."""
    path = trained_checkpoint(tmp_path)
    state = {"optimizer.param_groups.x.betas": None}
    plant_in_entry(path, "optimizer.param_groups.x.betas", (0.9, 0.95, True, None, "adamw"))
    checkpoint_files.load_dcp(state, path, alone=True)
    assert state["optimizer.param_groups.x.betas"] == (0.9, 0.95, True, None, "adamw")


def pickled_with_enums_by_name(obj) -> bytes:
    """obj pickled as Debian 12's Python 3.11.2 pickles enum members: getattr(their class, their
    name)."""

    class ByName(pickle.Pickler):
        def reducer_override(self, value):
            if isinstance(value, enum.Enum):
                return getattr, (type(value), value.name)
            return NotImplemented

    buffer = io.BytesIO()
    ByName(buffer).dump(obj)  # the default protocol, as DCP's writer uses
    return buffer.getvalue()


def globals_named(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle asks for, as the unpickler is asked for it."""
    named = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return named


def test_metadata_with_enum_members_by_name_is_read(tmp_path):
    """A legitimate checkpoint written under a Python that pickles enums by name is accepted: its
    exact globals are the allowed classes and builtins.getattr, applied to an allowed enum only."""
    path = trained_checkpoint(tmp_path)
    with open(path / ".metadata", "rb") as f:
        expected = pickle.load(f)
    data = pickled_with_enums_by_name(expected)
    assert {
        ("builtins", "getattr"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    } <= globals_named(data)
    assert "STACK_GLOBAL" in {op.name for op, _, _ in pickletools.genops(data)}
    (path / ".metadata").write_bytes(data)
    assert checkpoint_files.read_metadata(path) == expected
    # getattr on anything else is refused: a module (never allowed), an allowed class that is no
    # enum.
    for module, name, attribute in [
        ("os", "system", "__call__"),
        ("torch.distributed.checkpoint.metadata", "Metadata", "__init__"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "__new__"),
    ]:
        call = f"cbuiltins\ngetattr\n(c{module}\n{name}\nS'{attribute}'\ntR.".encode()
        (path / ".metadata").write_bytes(call)
        with pytest.raises(CheckpointError, match="could run code"):
            checkpoint_files.read_metadata(path)


def test_metadata_of_real_checkpoints_reads_with_the_restricted_unpickler(tmp_path):
    """Every global a training checkpoint's metadata names is allowed (the unpickler is not too
    strict)."""
    path = trained_checkpoint(tmp_path)
    with open(path / ".metadata", "rb") as f:
        # our own file, just written: safe to read the unrestricted way here
        expected = pickle.load(f)
    assert checkpoint_files.read_metadata(path) == expected


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
@pytest.mark.parametrize("file", [".metadata", ".distcp"])
def test_damaged_files_stop_with_one_line_naming_them(tmp_path, trained_once, damage, file):
    """Without checksums.json (as an older or converted checkpoint): the readers themselves say
    it."""
    path = tmp_path / "copy"
    shutil.copytree(trained_once, path)
    (path / "checksums.json").unlink()
    target = path / ".metadata" if file == ".metadata" else next(path.glob("*.distcp"))
    data = target.read_bytes()
    target.write_bytes(
        {"empty": b"", "truncated": data[: len(data) // 8], "garbage": b"\x80\x04garbage" * 9}[
            damage
        ]
    )
    with pytest.raises(SystemExit) as stop:
        convert.main(["to-hf", str(path), str(tmp_path / "hf")])
    message = str(stop.value.code)
    # same size: which is unknown
    named = str(path) if (file, damage) == (".distcp", "garbage") else str(target)
    assert "\n" not in message and named in message, message
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        convert.load_native(path)


def test_streaming_readers_verify_each_file_once(tmp_path, trained_once, monkeypatch):
    """convert.py reads one tensor at a time: the checksums are checked once, not once per
    tensor."""
    real, checked = checkpoint_files.crc32_of, []
    monkeypatch.setattr(
        checkpoint_files, "crc32_of", lambda file: checked.append(file.name) or real(file)
    )
    convert.main(["to-hf", str(trained_once), str(tmp_path / "hf")])
    listed = json.loads((trained_once / "checksums.json").read_text())
    assert sorted(checked) == sorted(listed) and len(listed) >= 4


def test_processes_checking_together_read_each_file_once_in_shares_of_similar_size(
    saved, monkeypatch
):
    """damage(rank, world_size): every listed file is read by exactly one of the processes, largest
    first in turn, so no share exceeds another by more than one file; a damaged file is found by the
    process that reads it, and only by it."""
    for index, size in enumerate([900, 50, 400, 10, 700, 300]):
        (saved / f"__{index}_0.distcp").write_bytes(
            bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        )
    (saved / "checksums.json").unlink()
    write_checksums(saved)
    sizes = {
        name: entry["bytes"]
        for name, entry in json.loads((saved / "checksums.json").read_text()).items()
    }
    real, read = checkpoint_files.crc32_of, {}
    for rank in range(3):
        monkeypatch.setattr(
            checkpoint_files,
            "crc32_of",
            lambda file: read.setdefault(rank, []).append(file.name) or real(file),
        )
        assert damage(saved, rank, 3) is None
    assert sorted(name for names in read.values() for name in names) == sorted(sizes)
    shares = sorted(sum(sizes[name] for name in names) for names in read.values())
    assert shares[-1] - shares[0] <= max(sizes.values())
    victim = read[2][0]
    (saved / victim).write_bytes(b"\0" * sizes[victim])
    assert [damage(saved, rank, 3) is not None for rank in range(3)] == [False, False, True]


def test_write_checksums_reads_only_the_files_no_other_process_listed(saved, monkeypatch):
    """Rank 0 lists what the other ranks checksummed of their own files and reads only the rest."""
    listed = json.loads((saved / "checksums.json").read_text())
    shard = next(name for name in listed if name.endswith(".distcp"))
    real, read = checkpoint_files.crc32_of, []
    monkeypatch.setattr(
        checkpoint_files, "crc32_of", lambda file: read.append(file.name) or real(file)
    )
    write_checksums(saved, {shard: listed[shard]})
    assert shard not in read and sorted(read) == sorted(set(listed) - {shard})
    assert json.loads((saved / "checksums.json").read_text()) == listed
