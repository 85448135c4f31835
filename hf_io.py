"""Checkpoint files tensor by tensor: where a published tensor sits in a native one (`Part`),
sources that read tensors by key (a state dict, a safetensors directory, a native DCP checkpoint), a
streaming safetensors writer, and output directories that appear only when complete. convert.py
builds the conversions on these; the model files' key tables are lists of `Part`s."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint_files import load_dcp, read_metadata, verify
from files import read_config_json, remove_stale_temporaries, sync_rename

# The dtypes a checkpoint may hold, by their safetensors names.
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class Part:
    """A published tensor's place in a native one: native[index] == (published.mT if transposed else
    published)."""

    key: str
    index: tuple
    transposed: bool


@dataclass(frozen=True)
class Layout:
    """A model family's published checkpoint layout, declared beside the model (flint_model.py,
    large4_config.py) and reached through registry.py: everything a conversion needs to know of
    it."""

    # (config, native meta, keys present) -> table
    table: Callable[[Any, dict, set[str]], dict[str, list[Part]]]
    fp32_suffixes: tuple[str, ...]  # native keys the model keeps in FP32
    # those the published layout keeps in FP32 in any dtype
    published_fp32_suffixes: tuple[str, ...]
    # published keys outside the model, carried through
    is_extra: Callable[[str], bool] = lambda key: False
    # block-scaled, dequantized on import
    quantized_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    # (source, config.json, its path, dtype, keep_fp32) -> the source read dequantized
    dequantize: Callable[..., Source] | None = None
    # published fields config.json leaves out
    missing_fields: Callable[[Any, dict], list[str]] | None = None
    # config -> the config.json an export writes (default: config.to_hf_config())
    published_config: Callable[[Any], dict] | None = None
    # Where transformers' model puts a native module (peft matches an adapter's targets against
    # those names): a prefix, and renamed pieces of the name.
    transformers_prefix: str = "model."
    transformers_renames: dict[str, str] = field(default_factory=dict)


def published_view(native: torch.Tensor, part: Part) -> torch.Tensor:
    """The published tensor as a view into the native one: copy into it to import, read it to
    export."""
    view = native[part.index]
    return view.mT if part.transposed else view


class Source(ABC):
    """Tensors by key, with shapes and dtypes (`meta`) known before any is read; `where(key)` names
    its file."""

    name: str
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def where(self, key: str) -> str:
        return self.name

    @abstractmethod
    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys`, read now."""


class StateSource(Source):
    """An in-memory state dict."""

    def __init__(self, state: dict[str, torch.Tensor], name: str):
        self.name, self.state = name, state
        self.meta = {k: (tuple(t.shape), t.dtype) for k, t in state.items()}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: self.state[k].detach() for k in keys}


class SafetensorsDir(Source):
    """A published checkpoint: model.safetensors, or the shards listed in
    model.safetensors.index.json.

    Only headers are read up front. `read` opens the files it needs and closes them again, because
    safetensors memory-maps files and every page touched stays resident while a file is open.
    """

    def __init__(self, path: str | Path, extra_dtypes: dict[str, torch.dtype] | None = None):
        path = Path(path)
        # e.g. FP8 for a source that dequantizes
        self.dtypes = {**SAFETENSORS_DTYPES, **(extra_dtypes or {})}
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.exists():
            self.name = str(index)
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(
                    f"{index}: expected a non-empty 'weight_map' object of key -> shard file"
                )
        elif single.exists():
            self.name, weight_map = str(single), None
        else:
            pickles = sorted(p.name for p in path.glob("*.bin*")) if path.is_dir() else []
            if pickles:
                raise ValueError(
                    f"{path / pickles[0]}: pickle checkpoints are refused (loading one "
                    "can run "
                    f"arbitrary code); convert it to safetensors first"
                )
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json found")
        listed: dict[str, list[str]] = {}  # shard file -> the keys weight_map places in it
        for key, shard in (weight_map or {}).items():
            if not isinstance(shard, str):
                raise ValueError(
                    f"{index}: weight_map[{key!r}] must be a shard file name, got {shard!r}"
                )
            listed.setdefault(shard, []).append(key)
        for shard, keys in listed.items():
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise ValueError(
                    f"{index}: weight_map places {keys[0]!r} in {shard!r}, outside "
                    f"{path}; only "
                    f"files inside the checkpoint directory are read"
                )
            if ".bin" in shard:
                raise ValueError(
                    f"{path / shard} (holds {keys[0]!r}): pickle checkpoints are "
                    "refused "
                    f"(loading one can run arbitrary code)"
                )
            if not (path / shard).exists():
                raise ValueError(
                    f"{self.name}: weight_map names missing shard {shard!r} (holds {keys[0]!r})"
                )
            if not (path / shard).is_file():  # "" and "." name the directory itself
                raise ValueError(
                    f"{self.name}: weight_map places {keys[0]!r} in {shard!r}, which "
                    "is not a file of "
                    f"{path}; expected a shard file name such as "
                    "'model-00001-of-00002.safetensors'"
                )
        self.files: dict[str, Path] = {}
        self.meta = {}
        for shard in sorted(listed) if weight_map else [single.name]:
            self._scan(path / shard, listed.get(shard))

    def _scan(self, file: Path, listed: list[str] | None) -> None:
        try:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    view = handle.get_slice(key)
                    dtype = self.dtypes.get(view.get_dtype())
                    if dtype is None:
                        raise ValueError(
                            f"{file}: key {key!r} has dtype {view.get_dtype()}, "
                            "expected one of "
                            f"{list(self.dtypes)}"
                        )
                    self.meta[key], self.files[key] = (tuple(view.get_shape()), dtype), file
        except SafetensorError as error:
            damaged, holds = _damaged_key(file), listed[0] if listed else None
            detail = (
                f" (tensor {damaged!r} is cut off)"
                if damaged
                else f" (holds {holds!r})"
                if holds
                else ""
            )
            raise ValueError(
                f"{file}: truncated or corrupt safetensors file{detail}: {error}"
            ) from error
        if listed is None:
            return
        for key in listed:
            if self.files.get(key) != file:
                raise ValueError(
                    f"{file}: missing key {key!r} that {self.name} places in this shard"
                )
        listed_here = set(listed)
        unlisted = [k for k, f in self.files.items() if f == file and k not in listed_here]
        if unlisted:
            raise ValueError(
                f"{file}: unexpected key {unlisted[0]!r}, not in {self.name}'s weight_map"
            )

    def where(self, key: str) -> str:
        return str(self.files.get(key, self.name))

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        tensors = {}
        for file in dict.fromkeys(self.files[k] for k in keys):
            with safe_open(file, "pt") as handle:
                tensors.update({k: handle.get_tensor(k) for k in keys if self.files[k] == file})
        return tensors


def _damaged_key(file: Path) -> str | None:
    """The first tensor whose bytes lie past the end of a truncated safetensors file, if the header
    is readable."""
    try:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            data_size = file.stat().st_size - 8 - header_size
            header = json.loads(f.read(header_size)) if data_size >= 0 else {}
        ends = sorted(
            (info["data_offsets"][1], key) for key, info in header.items() if key != "__metadata__"
        )
        return next((key for end, key in ends if end > data_size), None)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError):
        return None


class NativeDir(Source):
    """The "model" entries of a native checkpoint (model-only or with optimizer and training state),
    or those under another `prefix` ("extra": published tensors outside the model, kept for
    export)."""

    def __init__(self, path: str | Path, prefix: str = "model"):
        self.path, self.prefix = Path(path), prefix
        self.name = str(self.path / ".metadata")
        if not (self.path / ".metadata").exists():
            raise ValueError(
                f"{self.path}: not a native checkpoint (no .metadata file written by "
                f"torch.distributed.checkpoint)"
            )
        metadata = read_metadata(self.path)
        self.meta = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if not fqn.startswith(prefix + "."):
                continue
            if not isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"{self.name}: unexpected key {fqn!r}: not a tensor")
            self.meta[fqn.removeprefix(prefix + ".")] = (tuple(entry.size), entry.properties.dtype)
        if self.meta:  # checksums once, here: read() then loads a tensor at a time
            verify(self.path, alone=True)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in keys}
        load_dcp({self.prefix: state}, self.path, alone=True, verified=True)
        return state


def dcp_call(fn, *args, **kwargs):
    # A single process without a process group is the intended use here, not a mistake to warn
    # about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=True, **kwargs)


@contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; rename it to `out` only if the body succeeds."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(
            f"{out}: already exists; refusing to overwrite it (remove it or choose another path)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, f".{out.name}.tmp-")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would hide the output from the group
    try:
        yield tmp
        sync_rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_json(path: Path) -> dict:
    """A JSON object (a shard index, a config): anything else is refused with the file's name."""
    return read_config_json(path)[0]


def parse_size(size: int | str) -> int:
    """'5GB' -> 5_000_000_000 bytes (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(
            f"max_shard_size must be bytes or a size like '5GB' or '500MiB', got {size!r}"
        )
    unit = (match.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }[unit]
    return int(float(match.group(1)) * scale)


@dataclass
class Entry:
    """One published tensor to write, and where its data comes from."""

    native_key: str | None  # None: an extra tensor, copied as it is
    part: Part
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def write_safetensors(
    path: Path, entries: list[Entry], tensor_of: Callable[[Entry], torch.Tensor]
) -> None:
    """Write a safetensors file one tensor at a time: the header is known from shapes alone."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        header[entry.part.key] = {
            "dtype": names[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for entry in entries:
            tensor = tensor_of(entry)
            # the header
            assert (tuple(tensor.shape), tensor.dtype) == (entry.shape, entry.dtype), entry.part.key
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
