"""Forking tested both ways (README, Fork): for each model, a copy of the repository's tracked files
without that model's files and its line of registry.FAMILIES, exactly as the README's Fork table
lists them (read from the README, so the two never drift). In the copy: every remaining module of
the core and the tools imports in a fresh interpreter; no remaining core or tool file imports a
deleted module or names a deleted file in its code; the remaining tests collect; and a few steps of
the remaining model's debug config train through train.py (the second tier: `-m slow`). With
FLINT_SLOW=1, the remaining model's whole test suite, both tiers, runs in the copy as well (tens of
minutes).

Tests of one family's own behaviour that live beside shared ones (helpers.only) are skipped in the
copy, and tables keyed by family keep only the registered entries (helpers.registered): the
remaining tests pass."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT


def fork_table() -> dict[str, tuple[list[str], str]]:
    """The README's Fork table: model -> (the paths to delete, the registry line to remove)."""
    section = (ROOT / "README.md").read_text().split("\n## Fork\n")[1].split("\n## ")[0]
    # no header
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][
        1:
    ]
    table = {}
    for row in rows:
        model, delete, line = (cell.strip() for cell in row.strip("|").split("|"))
        table[model] = (re.findall(r"`([^`]+)`", delete), line.strip("`"))
    return table


FORKS = fork_table()


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in listed.stdout.split("\0") if name and (ROOT / name).exists()]


def make_fork(destination: Path, dropped: str) -> tuple[Path, list[str]]:
    """A copy of the tracked files without `dropped`'s files and registry line -> (the copy, its
    deleted paths)."""
    paths, registry_line = FORKS[dropped]
    for name in tracked_files():
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    for path in paths:
        assert (destination / path).exists(), (
            f"the README's Fork table lists {path}, which is not in the repository"
        )
        (shutil.rmtree if (destination / path).is_dir() else Path.unlink)(destination / path)
    registry = destination / "registry.py"
    lines = registry.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip().split("#")[0].strip() != registry_line]
    assert len(kept) == len(lines) - 1, f"registry.py holds the line {registry_line!r} exactly once"
    registry.write_text("".join(kept))
    return destination, paths


# In one fresh interpreter (one torch import): every module named, then train.py's main on the rest
# of argv.
IMPORT_ALL_THEN_TRAIN = """
import importlib, sys
count = int(sys.argv[1])
failed = []
for name in sys.argv[2:2 + count]:
    try:
        importlib.import_module(name)
    except Exception as error:
        failed.append(f"{name}: {type(error).__name__}: {error}")
if failed:
    sys.exit("modules fail to import:\\n" + "\\n".join(failed))
import train
train.main(sys.argv[2 + count:])
"""


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """A fresh interpreter in the copy, which must not see this checkout's modules (nor run its
    tests beyond CI's tiers)."""
    env = {**os.environ, "PYTHONPATH": ""}
    env.pop("FLINT_SLOW", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def code_files(copy: Path) -> list[Path]:
    return (
        sorted(copy.glob("*.py"))
        + sorted((copy / "tools").glob("*.py"))
        + sorted((copy / "tools").glob("*.sh"))
    )


def module_name(path: Path, copy: Path) -> str:
    return ".".join(path.relative_to(copy).with_suffix("").parts)


def what_names_the_deleted(path: Path, modules: set[str], files: set[str]) -> list[str]:
    """Where `path` imports a deleted module or names a deleted file in its code (not its docstrings
    or comments: a reader's note of where the other model lived is no dependency)."""
    text = path.read_text()
    if path.suffix == ".sh":
        found = [
            f"imports {name}"
            for name in re.findall(r"^\s*(?:from|import) (\w+)", text, re.MULTILINE)
            if name in modules
        ]
        return found + [
            f"names {name}"
            for name in files
            if re.search(rf"(?<![\w./-]){re.escape(name)}\b", text)
        ]
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"imports {alias.name}" for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            found.append(f"imports {node.module}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found += [
                f"names {name}"
                for name in files
                if node.value == name
                or node.value.endswith("/" + name)
                or node.value == Path(name).name
            ]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("dropped", list(FORKS))
def test_a_fork_without_one_model_imports_trains_and_collects_its_tests(tmp_path, dropped):
    copy, deleted = make_fork(tmp_path / "fork", dropped)
    modules = {module_name(Path(path), Path(".")) for path in deleted if path.endswith(".py")}
    files = {path for path in deleted if not path.endswith(".md")}

    named = {
        str(path.relative_to(copy)): found
        for path in code_files(copy)
        if (found := what_names_the_deleted(path, modules, files))
    }
    assert not named, f"without {dropped}, these files still need it: {named}"

    remaining = [
        module_name(path, copy)
        for path in code_files(copy)
        if path.suffix == ".py" and path.name != "__init__.py"
    ]
    (debug,) = sorted(copy.glob("configs/*debug.toml"))  # the remaining family's
    argv = [
        "--config",
        str(debug),
        "--training.steps=3",
        "--logging.every=1",
        "--training.sample_tokens=0",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        f"--logging.jsonl={tmp_path / 'metrics.jsonl'}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--logging.peak_tflops=0.1",
    ]
    imported_then_trained = run(
        ["-c", IMPORT_ALL_THEN_TRAIN, str(len(remaining)), *remaining, *argv], copy
    )
    assert imported_then_trained.returncode == 0, (
        f"without {dropped}:\n{imported_then_trained.stdout[-3000:]}"
        f"{imported_then_trained.stderr[-3000:]}"
    )
    assert (tmp_path / "metrics.jsonl").read_text().count('"loss"') == 3

    collected = run(
        ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"], copy
    )
    assert collected.returncode == 0, (
        f"without {dropped}, the tests do not collect:\n{collected.stdout[-3000:]}"
    )


@pytest.mark.slow(beyond_ci=True)  # each remaining model's whole suite: tens of minutes
@pytest.mark.parametrize("dropped", list(FORKS))
def test_the_remaining_models_whole_suite_passes_in_the_fork(tmp_path, dropped):
    copy, _ = make_fork(tmp_path / "fork", dropped)
    suite = run(
        [
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "",
            "tests",
            "--ignore=tests/test_fork.py",
        ],
        copy,
        timeout=3600,
    )
    assert suite.returncode == 0, f"without {dropped}:\n{suite.stdout[-6000:]}"
