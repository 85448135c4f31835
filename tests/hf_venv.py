"""The published reference for the fixture scripts: transformers, in a virtual environment of its
own (with tensorboard and wandb, whose real files test_metrics.py reads back there).

The test suite never needs transformers; the scripts that write its fixtures once
(make_*_fixture.py) run themselves again under a venv that has it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import venv
from pathlib import Path

# The suite's torch (a bare "torch" takes a CUDA build); tensorboard and wandb for test_metrics.py's
# read-back of [logging] tensorboard and wandb (optional extras of flint, never of the suite).
REQUIREMENTS = [
    "torch==2.13.0",
    "safetensors==0.8.0",
    "transformers==5.24.0",
    "tensorboard==2.21.0",
    "wandb==0.31.0",
]
# set in the re-executed script: a second failure stops instead of looping
_REEXECUTED = "FLINT_FIXTURE_REEXEC"


def rerun_with_transformers(script: str, venv_dir: Path, extra: tuple[str, ...] = ()) -> None:
    """Return when transformers (and the `extra` packages, by their import names) is importable
    here; otherwise create venv_dir with REQUIREMENTS and `extra` on first use and re-execute
    `script` under it with the same arguments."""
    if all(importlib.util.find_spec(name) is not None for name in ("transformers", *extra)):
        return
    python = venv_dir / "bin" / "python"
    if os.environ.get(_REEXECUTED):
        sys.exit(
            f"{python}: transformers or {list(extra)} does not import in this venv; install "
            f"{REQUIREMENTS + list(extra)} into it"
        )
    if not python.exists():
        print(f"creating {venv_dir} with {' '.join(REQUIREMENTS + list(extra))} (once)", flush=True)
        venv.create(venv_dir, with_pip=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *REQUIREMENTS, *extra], check=True
        )
    os.execve(
        str(python), [str(python), script, *sys.argv[1:]], dict(os.environ, **{_REEXECUTED: "1"})
    )
