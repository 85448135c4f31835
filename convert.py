"""Published Flint checkpoints (Hugging Face safetensors) <-> the native checkpoint, one tensor at a time.

    python convert.py to-native HF_DIR OUT      # published -> native (DCP directory + config.json)
    python convert.py to-hf IN HF_DIR           # native (model-only or a training checkpoint) -> published

The native checkpoint is what train.py saves and resumes from: a torch.distributed.checkpoint
directory whose state dict holds {"model": <native state dict>, optional "optimizer", "train"}, plus
config.json. The published layout and the native one are described in ../shared/SPEC.md.

Every published tensor is a `Part` of one native tensor: native[index] == published, transposed or
not. That single table drives both directions, the key accounting and the shape checks. Renames and
transposes never change a dtype, so both round trips are bit-exact; only loading into a model (whose
sinks, routers and head are FP32) or an explicit `dtype` casts. Conversions stream: each native
tensor is built from (or split into) its parts and written before the next one is read, so peak
memory is about two native tensors, never the model. Output goes to a temporary directory that is
renamed into place at the end, and pickle checkpoints (.bin) are refused, never loaded.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from model import Flint, FlintConfig

# The dtypes a Flint checkpoint may hold, by their safetensors names.
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Native keys the model keeps in FP32 (a checkpoint may hold them in FP32 or in the bulk dtype).
FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight", "lm_head.weight")
# Of those, the ones the published layout keeps in FP32 even when exporting to a lower dtype.
PUBLISHED_FP32_SUFFIXES = ("self_attn.sinks.weight", "mlp.router.weight")
Log = Callable[[str], None]


# ============================================================================= the key table

@dataclass(frozen=True)
class Part:
    """A published tensor's place in a native one: native[index] == (published.mT if transposed else published)."""

    key: str
    index: tuple
    transposed: bool


def native_meta(config: FlintConfig) -> dict[str, torch.Tensor]:
    """Every native parameter as a meta tensor (shape only), in model order; builds nothing real."""
    with torch.device("meta"):
        return Flint(config).state_dict()


def published_parts(native_key: str, config: FlintConfig, fused: bool = False,
                    sinks_name: str = "softmax_offset") -> list[Part]:
    """The published tensors that make up one native tensor, in the per-expert or the fused form."""
    key = native_key if native_key == "lm_head.weight" else "model." + native_key
    if native_key.endswith("self_attn.sinks.weight"):
        return [Part(key.replace("sinks.weight", sinks_name), (), False)]
    if native_key.endswith("mlp.router.weight"):
        return [Part(key.replace("router.weight", "gate.weight"), (), False)]
    if not native_key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [Part(key, (), False)]
    if fused:  # [E, 2*Im, H] or [E, H, Im]: transposing the last two dims gives the native layout
        return [Part(key, (), True)]
    experts, inter = key.rsplit(".", 1)[0], config.moe_intermediate_size
    if native_key.endswith("down_proj"):  # down_e [H, Im] -> native[e] [Im, H]
        return [Part(f"{experts}.{e}.down_proj.weight", (e,), True) for e in range(config.num_experts)]
    # gate_e, up_e [Im, H] -> native[e] [H, 2*Im], gate columns first
    halves = (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
    return [Part(f"{experts}.{e}.{name}.weight", (e, slice(None), columns), True)
            for e in range(config.num_experts) for name, columns in halves]


def published_layout(config: FlintConfig, present: set[str] | None = None) -> dict[str, list[Part]]:
    """Native key -> its published parts. With `present` (a source's keys), in the form that source uses."""
    present = present or set()
    layout = {}
    for native_key in native_meta(config):
        fused = "model." + native_key in present  # the fused experts keep the native name (ignored for others)
        sinks = "sinks" if "model." + native_key.removesuffix(".weight") in present else "softmax_offset"
        layout[native_key] = published_parts(native_key, config, fused, sinks)
    return layout


def published_view(native: torch.Tensor, part: Part) -> torch.Tensor:
    """The published tensor as a view into the native one: copy into it to import, read it to export."""
    view = native[part.index]
    return view.mT if part.transposed else view


# ============================================================================= sources

class Source(ABC):
    """Tensors by key, with shapes and dtypes (`meta`) known before any is read; `where(key)` names its file."""

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
    """A published checkpoint: model.safetensors, or the shards listed in model.safetensors.index.json.

    Only headers are read up front. `read` opens the files it needs and closes them again, because
    safetensors memory-maps files and every page touched stays resident while a file is open.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.exists():
            self.name = str(index)
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: expected a non-empty 'weight_map' object of key -> shard file")
        elif single.exists():
            self.name, weight_map = str(single), None
        else:
            pickles = sorted(p.name for p in path.glob("*.bin*")) if path.is_dir() else []
            if pickles:
                raise ValueError(f"{path / pickles[0]}: pickle checkpoints are refused (loading one can run "
                                 f"arbitrary code); convert it to safetensors first")
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json found")
        listed: dict[str, list[str]] = {}  # shard file -> the keys weight_map places in it
        for key, shard in (weight_map or {}).items():
            listed.setdefault(shard, []).append(key)
        for shard, keys in listed.items():
            if ".bin" in shard:
                raise ValueError(f"{path / shard} (holds {keys[0]!r}): pickle checkpoints are refused "
                                 f"(loading one can run arbitrary code)")
            if not (path / shard).exists():
                raise ValueError(f"{self.name}: weight_map names missing shard {shard!r} (holds {keys[0]!r})")
        self.files: dict[str, Path] = {}
        self.meta = {}
        for shard in sorted(listed) if weight_map else [single.name]:
            self._scan(path / shard, listed.get(shard))

    def _scan(self, file: Path, listed: list[str] | None) -> None:
        try:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():
                    view = handle.get_slice(key)
                    dtype = SAFETENSORS_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{file}: key {key!r} has dtype {view.get_dtype()}, expected one of "
                                         f"{list(SAFETENSORS_DTYPES)}")
                    self.meta[key], self.files[key] = (tuple(view.get_shape()), dtype), file
        except SafetensorError as error:
            damaged, holds = _damaged_key(file), listed[0] if listed else None
            detail = f" (tensor {damaged!r} is cut off)" if damaged else f" (holds {holds!r})" if holds else ""
            raise ValueError(f"{file}: truncated or corrupt safetensors file{detail}: {error}") from error
        if listed is None:
            return
        for key in listed:
            if self.files.get(key) != file:
                raise ValueError(f"{file}: missing key {key!r} that {self.name} places in this shard")
        listed_here = set(listed)
        unlisted = [k for k, f in self.files.items() if f == file and k not in listed_here]
        if unlisted:
            raise ValueError(f"{file}: unexpected key {unlisted[0]!r}, not in {self.name}'s weight_map")

    def where(self, key: str) -> str:
        return str(self.files.get(key, self.name))

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        tensors = {}
        for file in dict.fromkeys(self.files[k] for k in keys):
            with safe_open(file, "pt") as handle:
                tensors.update({k: handle.get_tensor(k) for k in keys if self.files[k] == file})
        return tensors


def _damaged_key(file: Path) -> str | None:
    """The first tensor whose bytes lie past the end of a truncated safetensors file, if the header is readable."""
    try:
        with open(file, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            data_size = file.stat().st_size - 8 - header_size
            header = json.loads(f.read(header_size)) if data_size >= 0 else {}
        ends = sorted((info["data_offsets"][1], key) for key, info in header.items() if key != "__metadata__")
        return next((key for end, key in ends if end > data_size), None)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError):
        return None


class NativeDir(Source):
    """The "model" entries of a native checkpoint (model-only or with optimizer and training state)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = str(self.path / ".metadata")
        if not (self.path / ".metadata").exists():
            raise ValueError(f"{self.path}: not a native checkpoint (no .metadata file written by "
                             f"torch.distributed.checkpoint)")
        metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        self.meta = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if not fqn.startswith("model."):
                continue
            if not isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"{self.name}: unexpected key {fqn!r}: not a tensor")
            self.meta[fqn.removeprefix("model.")] = (tuple(entry.size), entry.properties.dtype)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = {k: torch.empty(self.meta[k][0], dtype=self.meta[k][1]) for k in keys}
        _dcp_call(dcp.load, {"model": state}, checkpoint_id=str(self.path))
        return state


def _dcp_call(fn, *args, **kwargs):
    # A single process without a process group is the intended use here, not a mistake to warn about.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=True, **kwargs)


# ============================================================================= checks

def check_layers(source: Source, config: FlintConfig) -> None:
    """Layer indices in the keys must be exactly 0 .. num_hidden_layers - 1 of config.json."""
    count, seen = config.num_hidden_layers, set()
    for key in source.meta:
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
        if match:
            seen.add(int(match.group(1)))
            if int(match.group(1)) >= count:
                raise ValueError(f"{source.where(key)}: key {key!r} is for layer {match.group(1)}, but "
                                 f"config.json has num_hidden_layers={count}")
    missing = sorted(set(range(count)) - seen)
    if missing:
        raise ValueError(f"{source.name}: no keys for layer {missing[0]} (e.g. 'layers.{missing[0]}."
                         f"input_layernorm.weight'), but config.json has num_hidden_layers={count}")


def check_keys(source: Source, expected: dict[str, tuple[int, ...]]) -> None:
    """Strict accounting: every expected key present once with its shape, and nothing else."""
    for key, shape in expected.items():
        if key not in source.meta:
            raise ValueError(f"{source.name}: missing key {key!r} (shape {list(shape)})")
        if source.meta[key][0] != shape:
            raise ValueError(f"{source.where(key)}: key {key!r} has shape {list(source.meta[key][0])}, "
                             f"expected {list(shape)}")
    unexpected = [k for k in source.meta if k not in expected]
    if unexpected:
        raise ValueError(f"{source.where(unexpected[0])}: unexpected key {unexpected[0]!r}")


def check_dtypes(source: Source, layout: dict[str, list[Part]]) -> dict[str, torch.dtype]:
    """One bulk dtype (that of the embedding); FP32 also allowed where the model keeps FP32 -> native dtypes."""
    first = layout["embed_tokens.weight"][0].key
    bulk = source.meta[first][1]
    if bulk not in SAFETENSORS_DTYPES.values():
        raise ValueError(f"{source.where(first)}: key {first!r} has dtype {bulk}, expected one of "
                         f"{list(SAFETENSORS_DTYPES.values())}")
    dtypes = {}
    for native_key, parts in layout.items():
        allowed = {bulk, torch.float32} if native_key.endswith(FP32_SUFFIXES) else {bulk}
        dtypes[native_key] = source.meta[parts[0].key][1]
        for part in parts:
            dtype = source.meta[part.key][1]
            if dtype not in allowed or dtype != dtypes[native_key]:
                expected = " or ".join(sorted({str(d) for d in allowed}))
                raise ValueError(f"{source.where(part.key)}: key {part.key!r} has dtype {dtype}, expected {expected}"
                                 f" like the rest of the checkpoint ({first!r} is {bulk})")
    return dtypes


def check_source(source: Source, config: FlintConfig, published: bool) -> tuple[dict[str, list[Part]], dict]:
    """Check a published or native source against config.json -> (native key -> parts, native key -> dtype)."""
    check_layers(source, config)
    meta = native_meta(config)
    layout = published_layout(config, set(source.meta)) if published else {k: [Part(k, (), False)] for k in meta}
    check_keys(source, {p.key: tuple(published_view(meta[k], p).shape) for k, ps in layout.items() for p in ps})
    return layout, check_dtypes(source, layout)


def build_native(source: Source, parts: list[Part], out: torch.Tensor) -> torch.Tensor:
    tensors = source.read([p.key for p in parts])
    for part in parts:
        published_view(out, part).copy_(tensors.pop(part.key))
    return out


# ============================================================================= state-dict API

def hf_to_native(hf_state: dict[str, torch.Tensor], config: FlintConfig) -> dict[str, torch.Tensor]:
    """Published state dict (either expert form) -> native state dict, same dtypes, new tensors."""
    source = StateSource(hf_state, "hf_state")
    layout, dtypes = check_source(source, config, published=True)
    meta = native_meta(config)
    return {k: build_native(source, parts, torch.empty(meta[k].shape, dtype=dtypes[k]))
            for k, parts in layout.items()}


def native_to_hf(native_state: dict[str, torch.Tensor], config: FlintConfig) -> dict[str, torch.Tensor]:
    """Native state dict -> published state dict (per-expert, softmax_offset form), same dtypes.

    Tensors that need no transpose share memory with `native_state`.
    """
    check_source(StateSource(native_state, "native_state"), config, published=False)
    layout = published_layout(config)
    return {p.key: published_view(native_state[k], p).contiguous() for k, parts in layout.items() for p in parts}


# ============================================================================= output directories

@contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; rename it to `out` only if the body succeeds."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; refusing to overwrite it (remove it or choose another path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_config(directory: Path, config: FlintConfig, dtype: torch.dtype | None = None) -> None:
    hf_config = config.to_hf_config()
    if dtype is not None:
        hf_config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read JSON: {error}") from error


def parse_size(size: int | str) -> int:
    """'5GB' -> 5_000_000_000 bytes (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size must be bytes or a size like '5GB' or '500MiB', got {size!r}")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(match.group(1)) * scale)


# ============================================================================= writing published checkpoints

@dataclass
class Entry:
    """One published tensor to write, and where its data comes from."""

    native_key: str
    part: Part
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def write_safetensors(path: Path, entries: list[Entry], tensor_of: Callable[[Entry], torch.Tensor]) -> None:
    """Write a safetensors file one tensor at a time: the header is known from shapes alone."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        header[entry.part.key] = {"dtype": names[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for entry in entries:
            tensor = tensor_of(entry)
            assert (tuple(tensor.shape), tensor.dtype) == (entry.shape, entry.dtype), entry.part.key  # the header
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def export_published(source: Source, config: FlintConfig, out: str | Path, dtype: torch.dtype | None = None,
                     max_shard_size: int | str = "5GB", log: Log = lambda line: None) -> tuple[int, int]:
    """Write a native source as a published checkpoint directory -> (tensors, bytes)."""
    dtypes = check_source(source, config, published=False)[1]
    meta, limit = native_meta(config), parse_size(max_shard_size)
    entries = []
    for native_key, parts in published_layout(config).items():
        cast = dtype if dtype is not None and not native_key.endswith(PUBLISHED_FP32_SUFFIXES) else None
        entries += [Entry(native_key, p, tuple(published_view(meta[native_key], p).shape), cast or dtypes[native_key])
                    for p in parts]
    shards: list[list[Entry]] = [[]]
    filled = 0
    for entry in entries:  # greedy in model order, so each native tensor is read once
        if shards[-1] and filled + entry.nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += entry.nbytes

    current: dict[str, torch.Tensor] = {}  # the one native tensor being split

    def tensor_of(entry: Entry) -> torch.Tensor:
        if entry.native_key not in current:
            current.clear()
            current.update(source.read([entry.native_key]))
        return published_view(current[entry.native_key], entry.part).to("cpu", entry.dtype)

    with atomic_directory(out) as tmp:
        weight_map = {}
        for number, shard in enumerate(shards, 1):
            start, name = time.perf_counter(), f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(tmp / name, shard, tensor_of)
            weight_map.update({e.part.key: name for e in shard})
            log(f"shard {number}/{len(shards)} {name}: {len(shard)} tensors, "
                f"{sum(e.nbytes for e in shard) / 1e9:.3f} GB, {time.perf_counter() - start:.1f} s")
        total = sum(e.nbytes for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _write_config(tmp, config, dtype or dtypes["embed_tokens.weight"])
    return len(entries), total


def save_hf(model: Flint, path: str | Path, dtype: torch.dtype | None = None,
            max_shard_size: int | str = "5GB") -> None:
    """Write config.json, safetensors shards and model.safetensors.index.json in the published layout.

    dtype None keeps each tensor's dtype; otherwise every tensor is cast to it except the sinks and
    routers, which the published layout keeps in FP32.
    """
    export_published(StateSource(model.state_dict(), "model"), model.config, path, dtype, max_shard_size)


# ============================================================================= native checkpoints

class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors and produces each tensor only when the writer asks for it.

    FileSystemWriter calls `resolve_data` per item while writing; with one file per tensor it keeps
    nothing once that tensor's file is written, so memory stays at about two tensors.
    """

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO or not write_item.index.fqn.startswith("model."):
            return super().resolve_data(write_item)
        return self.produce(write_item.index.fqn.removeprefix("model."))


def write_native(out: str | Path, config: FlintConfig, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 produce: Callable[[str], torch.Tensor]) -> None:
    """Write a model-only native checkpoint whose tensors `produce(native_key)` makes one at a time."""
    state = {"model": {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in shapes.items()}}
    with atomic_directory(out) as tmp:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
        _dcp_call(dcp.save, state, storage_writer=writer, planner=_LazySavePlanner(produce))
        _write_config(tmp, config)


def import_native(source: Source, config: FlintConfig, out: str | Path,
                  log: Log = lambda line: None) -> tuple[int, int]:
    """Write a published source as a native checkpoint -> (tensors, bytes)."""
    layout, dtypes = check_source(source, config, published=True)
    meta = native_meta(config)
    left = Counter(source.where(key) for key in source.meta)  # keys not yet read, for a line per finished shard
    started = time.perf_counter()

    def produce(native_key: str) -> torch.Tensor:
        out = torch.empty(meta[native_key].shape, dtype=dtypes[native_key])
        tensor = build_native(source, layout[native_key], out)
        for part in layout[native_key]:
            left[source.where(part.key)] -= 1
            if left[source.where(part.key)] == 0:
                log(f"read shard {source.where(part.key)}: all its tensors converted "
                    f"({time.perf_counter() - started:.1f} s)")
        return tensor

    write_native(out, config, {k: (meta[k].shape, dtypes[k]) for k in layout}, produce)
    return len(layout), sum(meta[k].numel() * dtypes[k].itemsize for k in layout)


def save_native(model_or_state: Flint | dict[str, torch.Tensor], config: FlintConfig, path: str | Path) -> None:
    """Write a model-only native checkpoint (DCP "model" entry + config.json) from a model or a native state dict."""
    state = model_or_state.state_dict() if isinstance(model_or_state, Flint) else model_or_state
    source = StateSource(state, "native_state")
    check_source(source, config, published=False)
    write_native(path, config, {k: (torch.Size(s), d) for k, (s, d) in source.meta.items()},
                 lambda key: state[key].detach().cpu())


# ============================================================================= loading models

def _empty_model(config: FlintConfig, dtype: torch.dtype, device: torch.device | str) -> Flint:
    with torch.device("meta"):
        model = Flint(config, dtype)
    model.to_empty(device=device)
    for buffer in model.buffers():  # buffers hold statistics, not checkpoint state
        buffer.zero_()
    return model


def load_hf(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Flint:
    """Build a Flint from a published checkpoint directory. dtype None: the checkpoint's bulk dtype."""
    config = FlintConfig.from_hf_config(Path(path) / "config.json")
    source = SafetensorsDir(path)
    layout, dtypes = check_source(source, config, published=True)
    model = _empty_model(config, dtype or dtypes["embed_tokens.weight"], device)
    params = model.state_dict()
    with torch.no_grad():
        for native_key, parts in layout.items():
            build_native(source, parts, params[native_key])
    return model


def load_native(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Flint:
    """Build a Flint from a native checkpoint (model-only or training). dtype None: the checkpoint's bulk dtype."""
    config = FlintConfig.from_hf_config(Path(path) / "config.json")
    source = NativeDir(path)
    dtypes = check_source(source, config, published=False)[1]
    model = _empty_model(config, dtype or dtypes["embed_tokens.weight"], device)
    _dcp_call(dcp.load, {"model": model.state_dict()}, checkpoint_id=str(path))
    return model


# ============================================================================= command line

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_native = commands.add_parser("to-native", help="published HF_DIR -> native checkpoint OUT")
    to_native.add_argument("hf_dir")
    to_native.add_argument("out")
    to_hf = commands.add_parser("to-hf", help="native checkpoint IN (model-only or training) -> published HF_DIR")
    to_hf.add_argument("native_dir")
    to_hf.add_argument("hf_dir")
    to_hf.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                       help="cast to this dtype (sinks and routers stay FP32); default: keep the checkpoint's")
    to_hf.add_argument("--max-shard-size", default="5GB", help="bytes per shard, e.g. 5GB or 500MiB")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.command == "to-native":
            config = FlintConfig.from_hf_config(Path(args.hf_dir) / "config.json")
            tensors, size = import_native(SafetensorsDir(args.hf_dir), config, args.out, log=print)
        else:
            config = FlintConfig.from_hf_config(Path(args.native_dir) / "config.json")
            dtype = getattr(torch, args.dtype) if args.dtype else None
            tensors, size = export_published(NativeDir(args.native_dir), config, args.hf_dir, dtype,
                                             args.max_shard_size, log=print)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    out = args.out if args.command == "to-native" else args.hf_dir
    print(f"wrote {tensors} tensors, {size / 1e9:.3f} GB to {out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
