"""Native checkpoint files: DCP directories saved and loaded without running any code they hold,
their checksums, and the one-line report of what is damaged. Used by the training run's checkpoints
(checkpoint.py), convert.py and hf_io.py; it loads no model and no parallel layout.

A checkpoint directory holds DCP's .metadata and .distcp files, config.json (the model's Hugging
Face config), train_config.json (a run's resolved configuration) and checksums.json.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import re
import sys
import warnings
import zlib
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import AsyncStager


class CheckpointError(ValueError):
    """A checkpoint cannot be used (incomplete, damaged, another architecture); the message says
    why."""


# ========================================================================== reading metadata safely

# Everything a DCP .metadata pickle names: its dataclasses, torch.Size, dtypes (below), layouts, and
# the path DCP records as the checkpoint id. Nothing else can be called while unpickling.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def enum_member(cls: type, name: str) -> enum.Enum:
    """What `builtins.getattr` may do in metadata: fetch a member of an allowed enum by name. Some
    Python builds (Debian 12's 3.11.2) pickle an enum member as getattr(its class, its name)."""
    if not (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(name, str)
        and name in cls.__members__
    ):
        raise pickle.UnpicklingError(
            f"it calls getattr({getattr(cls, '__name__', cls)!r}, "
            f"{name!r}), which "
            "checkpoint metadata never holds (refused: loading it could "
            "run code)"
        )
    return cls[name]


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that refuses every global outside METADATA_CLASSES, torch dtypes and enum
    members fetched by name: torch's FileSystemReader.read_metadata calls pickle.load, which runs
    whatever a crafted file names."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return enum_member
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which checkpoint metadata never "
            "holds "
            f"(refused: loading it could run code)"
        )


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of the checkpoint directory `path`, read without running any code it names."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read: {error.strerror or error}") from error
    except Exception as error:  # truncated, empty or garbage: pickle raises many kinds of errors
        raise CheckpointError(
            f"{file}: not a valid checkpoint metadata file "
            f"({type(error).__name__}: "
            f"{error or 'truncated'})"
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{file}: not a valid checkpoint metadata file (it holds a "
            f"{type(metadata).__name__}, expected a DCP Metadata)"
        )
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with read_metadata above. DCP reads each tensor with
    torch.load(weights_only= True); the non-tensor entries go through SafeLoadPlanner."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a non-tensor entry (an optimizer group's lr, betas, ...) is read with
    torch.load(weights_only=True): DCP's own planner loads it with weights_only=False, which runs
    whatever a crafted .distcp file's pickle names."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            what = f"it names {found.group(1)}" if found else "it is not plain data"
            raise CheckpointError(
                f"entry {name!r} is refused: {what} (loading it could run code)"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], loaded)
        else:
            self.state_dict[name] = loaded


# ============================================================================= saving and loading


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, noting the files this process wrote: the ones it checksums."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.written: list[Path] = []

    def write_data(self, plan, planner):
        # a finished future: the writer writes before it returns
        results = super().write_data(plan, planner)
        self.written = sorted(
            {Path(self.path) / r.storage_data.relative_path for r in results.wait()}
        )
        return results


def save_dcp(
    state: dict,
    path: Path,
    group: dist.ProcessGroup | None = None,
    stager: AsyncStager | None = None,
) -> Future:
    """Writes `state` to the checkpoint directory `path` -> a Future of the files this process wrote
    (or of a CheckpointError naming the cause). Without `stager`, they are written when this
    returns; with one, dcp.async_save has copied `state` to host memory when this returns, and a
    background thread writes it while the caller trains on. `group`: the processes saving
    together."""
    writer, written = RecordingWriter(path), Future()

    def settle(error: BaseException | None) -> None:
        if error is None:
            written.set_result(writer.written)
        else:  # DCP reports every rank's failure, the same on every rank
            written.set_exception(
                CheckpointError(f"{path}: cannot write the checkpoint: {root_cause(error)}")
            )

    with warnings.catch_warnings():  # DCP warns that one process saves alone: that is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        where = dict(storage_writer=writer, process_group=group, no_dist=not dist.is_initialized())
        if stager is not None:
            dcp.async_save(state, async_stager=stager, **where).add_done_callback(
                lambda done: settle(done.exception())
            )
            return written
        try:
            dcp.save(state, **where)
        except (Exception, CheckpointException) as error:
            settle(error)
        else:
            settle(None)
    return written


def load_dcp(state: dict, path: Path, alone: bool = False, verified: bool = False) -> None:
    """Fills `state` in place from the checkpoint at `path`; `alone`: this process reads without
    the others (convert.py, the end-of-run sample), even inside a process group; `verified`: the
    caller already checked the files (a streaming reader loads one tensor per call)."""
    # DCP warns that one process loads alone (even with no_dist): intended
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if not verified:
            verify(path, alone)  # its own clear error for a damaged file, before DCP wraps it
        try:
            dcp.load(
                state,
                storage_reader=SafeReader(str(path)),
                planner=SafeLoadPlanner(),
                no_dist=alone or not dist.is_initialized(),
            )
        # DCP wraps a damaged file's error in a long report
        except (Exception, CheckpointException) as error:
            refused = refusal(error)
            if refused:
                raise CheckpointError(f"{path}: {refused}") from None
            raise CheckpointError(
                short_file(Path(path))
                or f"{path}: cannot load the checkpoint's "
                "tensors (a "
                f"damaged .distcp file?): {root_cause(error)}"
            ) from error


def short_file(path: Path) -> str | None:
    """The data file that is missing or shorter than the metadata says, if one is."""
    ends: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"truncated ({size} of {end} bytes)"
            return f"{path / name}: {found}"
    return None


def rank_failures(error: BaseException) -> list[BaseException]:
    """The exceptions behind DCP's CheckpointException, which maps each failed rank to (exception,
    its traceback's frames); [error] for any other exception."""
    failures = getattr(error, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [error]


def refusal(error: BaseException) -> str | None:
    """SafeLoadPlanner's refusal, if that is what DCP's report (or the error itself) holds."""
    return next(
        (str(f) for f in [error, *rank_failures(error)] if isinstance(f, CheckpointError)), None
    )


def root_cause(error: BaseException) -> str:
    """One line for DCP's CheckpointException (its first rank's exception), or any other error."""
    error = rank_failures(error)[0]
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"[:300]


def is_native_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "config.json").is_file()


def is_hf_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_checkpoint(path: Path, what: str) -> Path:
    """A checkpoint directory itself, or the newest intact step_* inside a run's checkpoint dir (its
    run_* directories, or a run directory): what sample.py's --checkpoint and [model].init_from
    take. A damaged newer one is skipped with a warning. what: the flag or key, for the messages."""
    if is_native_checkpoint(path) or is_hf_checkpoint(path):
        return path
    if not path.is_dir():
        raise CheckpointError(f"{what} {path}: no such directory")
    # run directories, oldest first
    places = [path, *sorted(p for p in path.glob("run_*") if p.is_dir())]
    steps = [
        p
        for place in places
        for p in sorted(place.glob("step_*"))
        if p.suffix != ".tmp" and is_native_checkpoint(p)
    ]
    if not steps:
        raise CheckpointError(
            f"{what} {path}: not a checkpoint (no .metadata, no config.json with "
            "safetensors) "
            f"and no complete step_* checkpoint inside"
        )
    for step in reversed(steps):
        problem = damage(step)
        if problem is None:
            return step
        print(
            f"WARNING: skipping the damaged checkpoint {step}: {problem}",
            file=sys.stderr,
            flush=True,
        )
    raise CheckpointError(
        f"{what} {path}: none of its {len(steps)} step_* checkpoints is intact (see the warnings)"
    )


# ============================================================================= checksums

CHECKSUMS = "checksums.json"
CHUNK = 16 * 2**20


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksums(files: list[Path]) -> dict[str, dict]:
    """{file name: its size and CRC-32} (CRC-32: accidents, not attacks)."""
    return {f.name: {"bytes": f.stat().st_size, "crc32": crc32_of(f)} for f in files}


def write_checksums(directory: Path, known: dict[str, dict] | None = None) -> None:
    """The size and CRC-32 of every file of a checkpoint directory, in checksums.json: a flipped bit
    or a truncated file is then reported on load rather than trained on. `known`: the entries of
    files that other processes checksummed (each its own, in parallel); the rest are computed
    here."""
    known = known or {}
    rest = [
        f
        for f in sorted(directory.iterdir())
        if f.is_file() and f.name not in known and f.name != CHECKSUMS
    ]
    files = dict(sorted({**known, **checksums(rest)}.items()))
    (directory / CHECKSUMS).write_text(json.dumps(files, indent=1) + "\n")


def damage(directory: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """None if the checkpoint is intact, else one line naming the damaged file. Checkpoints without
    checksums.json (written before it existed, or converted) are checked for readable metadata and
    data files as long as the metadata says. Of `world_size` processes checking together, `rank`
    reads every world_size-th listed file, largest first, so each reads about as many bytes."""
    try:
        read_metadata(directory)
    except CheckpointError as error:
        return str(error)
    listed = directory / CHECKSUMS
    if not listed.exists():
        return short_file(directory)
    try:
        expected = json.loads(listed.read_text())
        entries = [(name, int(e["bytes"]), int(e["crc32"])) for name, e in expected.items()]
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as error:
        return f"{listed}: not a valid checksum list ({type(error).__name__}: {error})"
    for name, size, crc in sorted(entries, key=lambda e: (-e[1], e[0]))[rank::world_size]:
        file = directory / name
        if "/" in name or name in (".", "..") or not file.is_file():
            return f"{file}: missing (listed in {listed})"
        if file.stat().st_size != size:
            return (
                f"{file}: {file.stat().st_size} bytes, {size} when saved (truncated or overwritten)"
            )
        if crc32_of(file) != crc:
            return (
                f"{file}: checksum mismatch (the file changed since it was saved: a flipped bit or "
                "a damaged disk)"
            )
    return None


def damage_found_together(directory: Path) -> str | None:
    """damage() with every process of the group reading its share of the files at once, on every
    rank: the first problem any rank found (the same on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return damage(directory)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, damage(directory, dist.get_rank(), dist.get_world_size()))
    return next((problem for problem in found if problem), None)


def verify(directory: Path, alone: bool = False) -> None:
    """Raises CheckpointError if `directory` is damaged: read by this process `alone`, or in a
    process group by all its processes, each reading its share of the files."""
    problem = damage(directory) if alone else damage_found_together(directory)
    if problem:
        raise CheckpointError(problem)


def from_main_rank(value):
    """Rank 0's `value` on every rank (itself without a process group of several)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def to_main_rank(value, group: dist.ProcessGroup | None = None) -> list | None:
    """Every rank's `value` of `group`, in rank order, on rank 0; None on the others."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [value]
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered
