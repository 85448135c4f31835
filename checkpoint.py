"""Native checkpoints: torch.distributed.checkpoint (DCP) directories that train.py saves, resumes
from and starts from ([model].init_from), and that convert.py reads and writes.

A checkpoint is a directory holding DCP's .metadata and .distcp files plus config.json (the model's
Hugging Face config) and train_config.json (the run's resolved configuration). Every layout saves the
same names and full shapes, so a checkpoint saved by any parallel layout loads in any other.
"""

from __future__ import annotations

import enum
import fcntl
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from config import INIT_FROM_SETTINGS
from models import ModelConfig, config_from_hf
from parallel import ParallelModel, barrier

if TYPE_CHECKING:  # only for annotations: train.py imports this file
    from config import TrainConfig
    from data import PackedLoader
    from train import Run


class CheckpointError(ValueError):
    """A checkpoint cannot be used (incomplete, damaged, another architecture); the message says why."""


# ============================================================================= reading metadata safely

# Everything a DCP .metadata pickle names: its dataclasses, torch.Size, dtypes (below), layouts, and
# the path DCP records as the checkpoint id. Nothing else can be called while unpickling.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


def enum_member(cls: type, name: str) -> enum.Enum:
    """What `builtins.getattr` may do in metadata: fetch a member of an allowed enum by name. Some
    Python builds (Debian 12's 3.11.2) pickle an enum member as getattr(its class, its name)."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str)
            and name in cls.__members__):
        raise pickle.UnpicklingError(f"it calls getattr({getattr(cls, '__name__', cls)!r}, {name!r}), which "
                                     f"checkpoint metadata never holds (refused: loading it could run code)")
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
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never holds "
                                     f"(refused: loading it could run code)")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of the checkpoint directory `path`, read without running any code it names."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read: {error.strerror or error}") from error
    except Exception as error:  # truncated, empty or garbage: pickle raises many kinds of errors
        raise CheckpointError(f"{file}: not a valid checkpoint metadata file ({type(error).__name__}: "
                              f"{error or 'truncated'})") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: not a valid checkpoint metadata file (it holds a "
                              f"{type(metadata).__name__}, expected a DCP Metadata)")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with read_metadata above. DCP reads each tensor with torch.load(weights_only=
    True); the non-tensor entries go through SafeLoadPlanner."""

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
            raise CheckpointError(f"entry {name!r} is refused: {what} (loading it could run code)") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], loaded)
        else:
            self.state_dict[name] = loaded


# ============================================================================= saving and loading


def save_dcp(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # DCP warns that one process saves alone: that is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def load_dcp(state: dict, path: Path, alone: bool = False, verified: bool = False) -> None:
    """Fills `state` in place from the checkpoint at `path`; `alone`: this process reads without
    the others (convert.py, the end-of-run sample), even inside a process group; `verified`: the
    caller already checked the files (a streaming reader loads one tensor per call)."""
    with warnings.catch_warnings():  # DCP warns that one process loads alone (even with no_dist): intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if not verified:
            verify(path, alone)  # its own clear error for a damaged file, before DCP wraps it
        try:
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                     no_dist=alone or not dist.is_initialized())
        except (Exception, CheckpointException) as error:  # DCP wraps a damaged file's error in a long report
            refused = refusal(error)
            if refused:
                raise CheckpointError(f"{path}: {refused}") from None
            raise CheckpointError(short_file(Path(path)) or f"{path}: cannot load the checkpoint's tensors (a "
                                  f"damaged .distcp file?): {root_cause(error)}") from error


def short_file(path: Path) -> str | None:
    """The data file that is missing or shorter than the metadata says, if one is."""
    ends: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            return f"{path / name}: {'missing' if size is None else f'truncated ({size} of {end} bytes)'}"
    return None


def refusal(error: BaseException) -> str | None:
    """SafeLoadPlanner's refusal, if that is what DCP's report (or the error itself) holds."""
    failures = getattr(error, "failures", None) or {}
    for failure in [error, *failures.values()]:
        failure = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(failure, CheckpointError):
            return str(failure)
    return None


def root_cause(error: BaseException) -> str:
    """One line for DCP's CheckpointException, which holds each rank's exception and traceback."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))  # (exception, its traceback's frames)
        error = first[0] if isinstance(first, tuple) else first
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"[:300]


def is_native_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "config.json").is_file()


def check_architecture(path: Path, config: ModelConfig) -> None:
    try:
        saved = config_from_hf(path / "config.json").to_hf_config()
    except (OSError, ValueError, TypeError, KeyError) as error:  # not JSON, or a field no model can have
        raise CheckpointError(f"{path / 'config.json'}: not a usable model config ({error})") from None
    mine = config.to_hf_config()
    diffs = [f"{k} = {saved.get(k)!r} there, {mine.get(k)!r} here" for k in sorted(set(saved) | set(mine))
             if k not in INIT_FROM_SETTINGS and saved.get(k) != mine.get(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} holds a different architecture: {'; '.join(diffs[:5])}")


# ============================================================================= checksums

CHECKSUMS = "checksums.json"
CHUNK = 16 * 2 ** 20


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_checksums(directory: Path) -> None:
    """CRC-32 and size of every file of a checkpoint directory, in checksums.json: a flipped bit or
    a truncated file is then reported on load rather than trained on (CRC-32: accidents, not attacks)."""
    files = {f.name: {"bytes": f.stat().st_size, "crc32": crc32_of(f)}
             for f in sorted(directory.iterdir()) if f.is_file() and f.name != CHECKSUMS}
    (directory / CHECKSUMS).write_text(json.dumps(files, indent=1) + "\n")


def damage(directory: Path) -> str | None:
    """None if the checkpoint is intact, else one line naming the damaged file. Checkpoints without
    checksums.json (written before it existed, or converted) are checked for readable metadata and
    data files as long as the metadata says."""
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
    for name, size, crc in entries:
        file = directory / name
        if "/" in name or name in (".", "..") or not file.is_file():
            return f"{file}: missing (listed in {listed})"
        if file.stat().st_size != size:
            return f"{file}: {file.stat().st_size} bytes, {size} when saved (truncated or overwritten)"
        if crc32_of(file) != crc:
            return f"{file}: checksum mismatch (the file changed since it was saved: a flipped bit or a damaged disk)"
    return None


def verify(directory: Path, alone: bool = False) -> None:
    """Raises CheckpointError if `directory` is damaged. In a process group rank 0 reads the files
    and tells the others, so a checkpoint is read once for the check, not once per process."""
    problem = damage(directory) if alone or main_rank() else None
    problem = problem if alone else from_main_rank(problem)
    if problem:
        raise CheckpointError(problem)


def main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def from_main_rank(value):
    """Rank 0's `value` on every rank (itself without a process group of several)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_rename(source: Path, target: Path) -> None:
    """Rename, then fsync the parent directory so that the rename itself survives a power cut."""
    source.rename(target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: Path, prefix: str) -> None:
    """Remove directory/<prefix><pid>-* folders whose process is gone: what a killed conversion or
    preparation left behind (a live process's folder is its work in progress, left alone)."""
    for stale in directory.glob(f"{prefix}*"):
        pid = stale.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# ============================================================================= checkpoints of a run

RUN_NAME = re.compile(r"run_\d{4,}")
STEP_NAME = re.compile(r"step_\d{8,}")
REMOVING = ".removing"  # a checkpoint being deleted: no longer complete


def remove_leftovers(run_dir: Path) -> None:
    """What a crash of this run directory's writer left: half-written saves (step_*.tmp) and
    half-deleted checkpoints (step_*.removing). Only called with the directory's lock held."""
    for leftover in [*run_dir.glob("step_*.tmp"), *run_dir.glob(f"step_*{REMOVING}")]:
        shutil.rmtree(leftover)


def hold_lock(directory: Path, what: str):
    """An exclusive flock on directory/.lock, held until the returned file is closed (or the
    process ends), with this process's pid and host written in it for whoever is refused."""
    try:
        lock_file = open(directory / ".lock", "a+")
    except OSError as error:
        raise CheckpointError(f"{what} {directory} is not writable ({error.strerror or error})") from error
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "another process"
        lock_file.close()
        raise CheckpointError(f"{what} {directory} is in use by another run ({holder}); wait for it to finish "
                              f"or give this run another checkpoint.dir") from None
    lock_file.truncate(0)
    lock_file.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock_file.flush()
    return lock_file


class Checkpointer:
    """Checkpoints of training runs: checkpoint.dir/run_<4 digits>/step_<8 digits>, each holding DCP's
    {"model", "optimizer", "train"} files, config.json, train_config.json and checksums.json.

    - Nothing of another run is ever deleted: a fresh run (checkpoint.resume = "never", or "auto"
      with nothing to resume) writes a new run directory; "auto" continues the newest intact
      checkpoint of the newest run and writes on in that run's directory; an explicit checkpoint
      starts a new run directory from its step. keep_last applies to the run's own directory.
    - One run per checkpoint.dir: rank 0 holds an exclusive lock on dir/.lock for the life of the run.
    - Crash-safe saves: written under a .tmp name, checksummed, renamed, the rename made durable.
    - A checkpoint whose weights hold non-finite values is never written.
    """

    def __init__(self, cfg: TrainConfig, run: Run):
        self.cfg, self.run, self.dir = cfg, run, Path(cfg.checkpoint.dir)
        self.last: Path | None = None  # saved or resumed from by this run
        self.lock_files: list = []  # rank 0's: checkpoint.dir's and, once chosen, the run directory's
        self.run_dir: Path | None = None  # chosen at resume
        failure = None
        if run.is_main:
            try:
                self.lock()
            except CheckpointError as error:
                failure = str(error)
        failure = from_main_rank(failure)
        if failure:
            raise CheckpointError(failure)

    def where(self) -> str:
        return self.cfg.where("checkpoint.dir")

    def lock(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"{self.where()}: checkpoint.dir {self.dir} is not a writable directory "
                                  f"({error.strerror or error})") from error
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise CheckpointError(f"{self.where()}: checkpoint.dir {self.dir} is not writable")
        self.lock_files.append(hold_lock(self.dir, f"{self.where()}: checkpoint.dir"))

    def close(self) -> None:
        """Releases the locks (the operating system also does when the process ends)."""
        for lock_file in self.lock_files:
            lock_file.close()
        self.lock_files = []

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ finding checkpoints

    def runs(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("run_*") if p.is_dir() and RUN_NAME.fullmatch(p.name))

    def checkpoints(self, run_dir: Path | None = None) -> list[Path]:
        """Complete checkpoints (renamed into place under their final name), oldest first: of one
        run directory, or of all (run by run; a checkpoint.dir from before run directories counts as
        the oldest run)."""
        places = [run_dir] if run_dir else [self.dir, *self.runs()]
        return [p for place in places for p in sorted(place.glob("step_*"))
                if STEP_NAME.fullmatch(p.name) and is_native_checkpoint(p)]

    def latest(self) -> Path | None:
        """The newest checkpoint this run saved or resumed from (of the whole directory before it began)."""
        done = self.checkpoints(self.run_dir)
        return done[-1] if done else self.last

    def newest_intact(self) -> Path | None:
        """The newest checkpoint that is not damaged; damaged newer ones are reported and skipped."""
        for path in reversed(self.checkpoints()):
            problem = from_main_rank(damage(path) if self.run.is_main else None)
            if not problem:
                return path
            self.run.print(f"WARNING: checkpoint {path} is damaged, trying the one before it: {problem}")
        return None

    def new_run_dir(self) -> Path:
        """run_<n + 1>, n the highest run number in use by any entry (a stray file named run_0001
        included: it is skipped, never overwritten)."""
        numbers = [int(p.name[4:]) for p in self.dir.glob("run_*") if RUN_NAME.fullmatch(p.name)]
        path = self.dir / f"run_{max(numbers, default=0) + 1:04d}"
        if self.run.is_main:
            path.mkdir()
        return from_main_rank(path)

    def enter_run_dir(self, path: Path) -> None:
        """Write into `path` from now on: lock it (a run pointed at another run's directory as its
        checkpoint.dir, or one continuing it, is refused) and clear what a crash there left."""
        failure = None
        if self.run.is_main:
            try:
                if path != self.dir:
                    self.lock_files.append(hold_lock(path, f"{self.where()}: run directory"))
                remove_leftovers(path)
            except CheckpointError as error:
                failure = str(error)
        failure = from_main_rank(failure)
        if failure:
            raise CheckpointError(failure)
        self.run_dir = path

    def remove(self, checkpoint: Path) -> None:
        """Unfinish, then delete: renamed away from its step name first, so a crash part-way through
        never leaves a half-deleted checkpoint listed as complete (the next run clears the rest)."""
        doomed = checkpoint.with_name(checkpoint.name + REMOVING)
        sync_rename(checkpoint, doomed)
        shutil.rmtree(doomed)

    # ------------------------------------------------------------------ saving

    def state(self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader, step: int) -> dict:
        """The same names and full shapes in every layout: DCP reshards on load."""
        model_state = get_model_state_dict(model.module)
        optimizer_state = get_optimizer_state_dict(model.module, optimizer)
        train = {"step": torch.tensor(step), "cpu_rng": torch.get_rng_state(),
                 "data": {k: torch.tensor(v) for k, v in data.state_dict().items()}}
        if self.run.device.type == "cuda":
            train["cuda_rng"] = torch.cuda.get_rng_state(self.run.device)
        return {"model": model_state, "optimizer": optimizer_state, "train": train}

    def save(self, step: int, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader) -> Path:
        if not weights_finite(model):
            raise CheckpointError(f"step {step}: the weights hold non-finite values; not saving them. The last "
                                  f"good checkpoint is {self.latest() or 'none (none was saved yet)'}")
        final = self.run_dir / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        if self.run.is_main:
            remove_leftovers(self.run_dir)
            tmp.mkdir(parents=True)
        barrier()
        start = time.perf_counter()
        save_dcp(self.state(model, optimizer, data, step), tmp)
        barrier()  # every rank's files are written
        if self.run.is_main:
            (tmp / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=1))
            (tmp / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
            write_checksums(tmp)
            if final.exists():
                shutil.rmtree(final)
            sync_rename(tmp, final)
            for old in self.checkpoints(self.run_dir)[:-self.cfg.checkpoint.keep_last]:
                self.remove(old)
            self.run.print(f"saved checkpoint {final} in {time.perf_counter() - start:.1f} s")
        barrier()
        self.last = final
        return final

    # ------------------------------------------------------------------ resuming

    def resume(self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader) -> int:
        """-> the step to continue from: 0, or that of the checkpoint that checkpoint.resume picks."""
        choice = self.cfg.checkpoint.resume
        path = None if choice == "never" else self.newest_intact() if choice == "auto" else Path(choice)
        if choice == "auto" and path is None and self.checkpoints():
            raise CheckpointError(f"{self.cfg.where('checkpoint.resume')}: resume = \"auto\" found "
                                  f"{len(self.checkpoints())} checkpoint(s) in {self.dir} and none is intact (each "
                                  f"warning above says why); not starting over. Repair or move them, or set "
                                  f"checkpoint.resume = \"never\" for a fresh run")
        continues = choice == "auto" and path is not None and RUN_NAME.fullmatch(path.parent.name)
        self.enter_run_dir(path.parent if continues else self.new_run_dir())
        if path is None:
            self.run.print(f"a fresh run: checkpoints go to {self.run_dir}")
            return 0
        if not is_native_checkpoint(path):
            raise CheckpointError(f"{self.cfg.where('checkpoint.resume')}: {path} is not a complete checkpoint "
                                  f"(it needs .metadata and config.json)")
        check_architecture(path, model.config)
        state = self.state(model, optimizer, data, 0)
        if "train.cuda_rng" not in read_metadata(path).state_dict_metadata:
            state["train"].pop("cuda_rng", None)
        load_dcp(state, path, verified=choice == "auto")  # newest_intact verified it
        set_model_state_dict(model.module, state["model"])
        set_optimizer_state_dict(model.module, optimizer, state["optimizer"])
        data.load_state_dict({k: int(v) for k, v in state["train"]["data"].items()})
        torch.set_rng_state(state["train"]["cpu_rng"])
        if "cuda_rng" in state["train"]:
            torch.cuda.set_rng_state(state["train"]["cuda_rng"], self.run.device)
        step, self.last = int(state["train"]["step"]), path
        self.run.print(f"resumed from {path} at step {step} of {self.cfg.training.steps}; checkpoints go to "
                       f"{self.run_dir}" + (": nothing left to train (raise training.steps, or set "
                                            "checkpoint.resume = \"never\" for a fresh run)"
                                            if step >= self.cfg.training.steps else ""))
        return step


def weights_finite(model: ParallelModel) -> bool:
    """Whether every weight of every rank is finite (one pass over this rank's shards, one all-reduce)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.module.parameters()]
    bad = torch.zeros((), device=local[0].device) if local else torch.zeros(())
    for tensor in local:
        bad += (~torch.isfinite(tensor)).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    return not bool(bad)


class Interruption:
    """Ctrl-C (SIGINT) or SIGTERM while training: the step in progress finishes, a checkpoint is
    saved and the run stops; a second signal stops at once, without saving. Every rank stops at the
    same step: `requested` is the OR over the ranks."""

    def __init__(self, run: Run):
        self.run, self.name, self.previous = run, None, {}

    def __enter__(self) -> "Interruption":
        for number in (signal.SIGINT, signal.SIGTERM):
            self.previous[number] = signal.signal(number, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def handle(self, number: int, frame) -> None:
        self.name = signal.Signals(number).name
        self.restore()  # a second signal acts as usual
        print(f"\n{self.name}: saving a checkpoint after this step, then stopping (send it again to stop at once, "
              f"without saving)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        flag = torch.tensor(float(self.name is not None), device=self.run.device)
        if self.run.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)
