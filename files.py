"""Files, written so that a crash or a second process never sees half of one: atomic writes, renames
made durable, the temporaries of killed processes, JSON objects read with errors that name the file.
A leaf: it imports nothing of this repository, so the data loader, the checkpoint reader and the
tokenizer can use it without loading a model or the parallel layer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def read_config_json(source: dict | str | Path) -> tuple[dict, str]:
    """A config dict as given, or read from a config.json file (or another JSON object such as a
    shard index) or checkpoint directory -> (dict, where it came from, for error messages)."""
    if isinstance(source, dict):
        return source, "config"
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    return read_json_object(path), str(path)


def read_json_object(path: Path) -> dict:
    """The JSON object in the UTF-8 file `path`, or a ValueError naming the file and what is
    wrong."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def write_atomically(path: Path, text: str) -> None:
    """Write to a temporary name of this process, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


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
        pid = stale.name[len(prefix) :].split("-")[0]
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
