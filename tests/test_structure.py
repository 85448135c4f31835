"""The repository's shape, as DESIGN.md asks for it: low-level modules load nothing above them, no
object changes its class at run time, and no source file grows past about 600 lines."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(ROOT.glob("*.py"))
MODULES = {path.stem for path in SOURCES}
ABOVE_THE_FILES = {"model", "large4", "flint_config", "large4_config", "models", "parallel", "moe", "attention",
                   "checkpoint", "config", "train", "metrics", "routing", "convert", "decoder"}


def repository_modules_loaded_by(module: str) -> set[str]:
    """What `import module` loads of this repository, in a fresh interpreter."""
    code = f"import sys; import {module}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(loaded.stdout.split()) & MODULES - {module}


@pytest.mark.parametrize("module, allowed", [
    ("files", set()),
    ("tokenizer", set()),
    ("data", {"files", "tokenizer"}),
    ("checkpoint_files", set()),
    ("hf_io", {"files", "checkpoint_files"}),
    ("decoder", set()),
    ("context_parallel", set()),
    ("devices", set()),
    ("report", {"files"}),
])
def test_low_level_modules_load_no_model_and_no_parallel_layer(module, allowed):
    loaded = repository_modules_loaded_by(module)
    assert loaded <= allowed, f"import {module} loads {sorted(loaded - allowed)}"
    assert not loaded & ABOVE_THE_FILES


def test_no_object_changes_its_class():
    """The forward that trains is the forward a reader reads (parallel.py once swapped classes)."""
    swaps = [f"{path.name}:{n}" for path in SOURCES for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"__class__\s*=[^=]", line)]
    assert not swaps, swaps


def test_every_source_file_stays_under_600_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in SOURCES}
    assert max(lengths.values()) < 600, {name: n for name, n in lengths.items() if n >= 600}


MODEL_FILES = {"model", "flint_config", "flint_hf", "flint_baselines", "large4", "large4_config", "large4_hf"}


def test_only_the_registry_names_a_model_outside_its_own_files():
    """A new model touches models.py and its own files only: nothing else imports a model's modules."""
    naming = re.compile(r"^\s*(?:from|import) (" + "|".join(sorted(MODEL_FILES)) + r")\b", re.MULTILINE)
    offenders = {path.stem for path in SOURCES if naming.search(path.read_text())}
    assert offenders - MODEL_FILES == {"models"}


def test_the_readme_is_a_readers_page_that_starts_with_the_two_commands():
    """About nanoGPT's length; its first two code blocks are the commands .ci/run and a newcomer run."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert len(readme.splitlines()) < 300
    assert blocks[0].endswith("train.py --config configs/smoke.toml") and blocks[1].endswith("-m pytest -q")
    assert all(block.startswith("python3 -m venv .venv && .venv/bin/pip install -r requirements.txt")
               for block in blocks[:2])


def test_every_source_file_has_its_test_file():
    missing = [path.name for path in SOURCES if not (ROOT / "tests" / f"test_{path.name}").is_file()]
    assert not missing, missing
