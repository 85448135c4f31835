"""The published reference for the fixture scripts: transformers, in a virtual environment of its own.

The test suite never needs transformers; the scripts that write its fixtures once (make_*_fixture.py)
run themselves again under a venv that has it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import venv
from pathlib import Path

REQUIREMENTS = ["torch", "safetensors", "transformers==5.24.0"]
_REEXECUTED = "FLINT_FIXTURE_REEXEC"  # set in the re-executed script: a second failure stops instead of looping


def rerun_with_transformers(script: str, venv_dir: Path) -> None:
    """Return when transformers is importable here; otherwise create venv_dir with REQUIREMENTS on first
    use and re-execute `script` under it with the same arguments."""
    if importlib.util.find_spec("transformers") is not None:
        return
    python = venv_dir / "bin" / "python"
    if os.environ.get(_REEXECUTED):
        sys.exit(f"{python}: transformers does not import in this venv; install {REQUIREMENTS} into it")
    if not python.exists():
        print(f"creating {venv_dir} with {' '.join(REQUIREMENTS)} (once)", flush=True)
        venv.create(venv_dir, with_pip=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    os.execve(str(python), [str(python), script, *sys.argv[1:]], dict(os.environ, **{_REEXECUTED: "1"}))
