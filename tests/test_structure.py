"""The repository's shape, as the README's Files section describes it: a flat core beside tools/,
low-level modules that load nothing above them and no model, no circle of imports (inside functions
too), the tools reached by no core file, each model named only by its own files and the registry, no
object changing its class at run time, and no comment or docstring naming a file that does not
exist."""

import ast
import functools
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = sorted(ROOT.glob("*.py"))
TOOLS = sorted(p for p in (ROOT / "tools").glob("*.py") if p.name != "__init__.py")
SOURCES = CORE + TOOLS
CORE_MODULES = {path.stem for path in CORE}
# Each registered family's own files (registry.FAMILIES names the first of each;
# tools/flint_baselines.py is Flint's).
MODEL_FILES = {"model", "large4", "large4_config", "flint_baselines"}


# One interpreter that has imported torch and nothing of the repository forks once per module: each
# child imports its module alone and prints what that loaded (one torch import instead of one per
# module). The parent also imports the parts of torch and the packages the heavier modules load
# (seconds each per child otherwise): what a module loads of the repository is unchanged, and only
# that is checked.
FORK_PER_MODULE = """
import json, os, sys
import torch
import torch._dynamo, torch.distributed.checkpoint.state_dict, torch.profiler
import torch.distributed.fsdp
import torch.distributed._composable, torch.distributed.pipelining, safetensors.torch
result = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    if os.fork() == 0:
        __import__(module)
        os.write(write, json.dumps(sorted(sys.modules)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result[module] = json.loads(pipe.read() or "[]")
    os.wait()
print(json.dumps(result))
"""


@functools.lru_cache(maxsize=1)
def modules_loaded() -> dict[str, set[str]]:
    """module -> what `import module` loads of this repository, each in a fresh process."""
    modules = sorted({module for module, _ in LEAVES} | set(LOW_LAYERS))
    out = subprocess.run(
        [sys.executable, "-c", FORK_PER_MODULE, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        module: {name for name in names if name in CORE_MODULES or name.startswith("tools")}
        - {module}
        for module, names in json.loads(out).items()
    }


def repository_modules_loaded_by(module: str) -> set[str]:
    return modules_loaded()[module]


LEAVES = [
    ("files", set()),
    ("flags", set()),
    ("tokenizer", set()),
    ("chat", {"tokenizer"}),
    ("data", {"files", "flags", "tokenizer", "chat"}),
    ("prepare", {"files", "flags", "tokenizer", "chat", "data"}),
    ("checkpoint_files", set()),
    ("hf_io", {"files", "checkpoint_files"}),
    ("layers", set()),
    ("head", set()),
    ("generate", set()),
    ("devices", set()),
    ("report", {"files"}),
    ("registry", {"files"}),
]
LOW_LAYERS = ["parallel", "config", "data", "checkpoint", "registry", "metrics", "convert"]


@pytest.mark.slow
@pytest.mark.parametrize("module, allowed", LEAVES)
def test_leaf_modules_load_nothing_above_them(module, allowed):
    loaded = repository_modules_loaded_by(module)
    assert loaded <= allowed, f"import {module} loads {sorted(loaded - allowed)}"


@pytest.mark.parametrize("module", LOW_LAYERS)
def test_low_layers_load_no_model(module):
    """Type-only imports of a model's names stay under TYPE_CHECKING; models load when a run asks
    for one."""
    loaded = repository_modules_loaded_by(module)
    assert not loaded & MODEL_FILES, f"import {module} loads {sorted(loaded & MODEL_FILES)}"


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """The repository modules `path` imports, each with whether the import is at module level (run
    when the module loads) rather than inside a function or under TYPE_CHECKING."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, top))
            visit(
                child,
                top
                and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)),
            )

    visit(ast.parse(path.read_text()), True)
    return found


def module_name(path: Path) -> str:
    return ("tools." if path.parent.name == "tools" else "") + path.stem


# train.py --dry-run's one lazy doorway (README, Many GPUs): tools/rehearsal.py drives train.py's
# own functions on a fake world, so this import, inside train.py's function, closes a circle on
# purpose.
DOORWAYS = {("train", "tools.rehearsal")}


def import_graph() -> dict[str, set[str]]:
    """module -> the repository modules it imports, at module level or inside a function (an import
    deferred into a function still ties the two modules together), the doorways left out."""
    return {
        module_name(path): {
            name
            for name, _ in imports_of(path)
            if (name in CORE_MODULES or name.startswith("tools."))
            and (module_name(path), name) not in DOORWAYS
        }
        for path in SOURCES
    }


@pytest.mark.slow
def test_no_circle_of_imports_even_inside_functions():
    graph = import_graph()
    done, path = set(), []

    def walk(node: str) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node) :] + [node]))
        if node in done:
            return
        path.append(node)
        for target in graph.get(node, ()):
            walk(target)
        path.pop()
        done.add(node)

    for node in graph:
        walk(node)


def test_the_core_never_imports_the_tools():
    """Except train.py --dry-run, the rehearsal's one lazy doorway (README, Many GPUs)."""
    reaching = {
        (path.name, name)
        for path in CORE
        for name, _ in imports_of(path)
        if name.startswith("tools")
    }
    assert reaching == {("train.py", "tools.rehearsal")}, reaching


def test_only_the_registry_names_a_model_outside_its_own_files():
    """A new model touches registry.py and its own files only; tests and tools reach models through
    the registry or by their family's own test files."""
    offenders = {
        path.name
        for path in SOURCES
        if path.stem not in MODEL_FILES
        for name, _ in imports_of(path)
        if name in MODEL_FILES
    }
    assert offenders == set(), offenders
    registry = (ROOT / "registry.py").read_text()
    assert all(
        f'"{module}"' in registry
        for module in ("model", "large4")
        if (ROOT / f"{module}.py").is_file()
    )


def test_no_object_changes_its_class():
    """The forward that trains is the forward a reader reads (parallel.py once swapped classes)."""
    swaps = [
        f"{path.name}:{n}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"__class__\s*=[^=]", line)
    ]
    assert not swaps, swaps


def test_the_readme_is_a_readers_page_that_starts_with_the_two_commands():
    """About nanoGPT's length; its first two code blocks are the commands .ci/run and a newcomer
    run."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert len(readme.splitlines()) < 330
    assert blocks[0].endswith("train.py --config configs/smoke.toml") and blocks[1].endswith(
        "-m pytest -q"
    )
    assert all(
        block.startswith("python3 -m venv .venv && .venv/bin/pip install -r requirements.txt")
        for block in blocks[:2]
    )


def test_every_source_file_has_its_test_file():
    missing = [
        path.name for path in SOURCES if not (ROOT / "tests" / f"test_{path.name}").is_file()
    ]
    assert not missing, missing


@pytest.mark.slow
def test_no_test_file_imports_another_test_file_or_conftest():
    """What test files share is in tests/helpers.py (plain functions) or conftest.py's fixtures,
    which pytest hands out by name; so a fork that deletes one model's test files leaves every other
    one importable. tools/gpu_check.sh, which runs tests' code on a GPU, reaches it through
    tests/helpers.py too."""
    tests = sorted((ROOT / "tests").glob("*.py"))
    offenders = [
        f"{path.name} imports {name}"
        for path in tests
        for name, _ in imports_of(path)
        if name.split(".")[0].startswith("test_") or name == "conftest"
    ]
    # Flint's GPU checks: a fork without Flint deletes it
    gpu_check = ROOT / "tools" / "gpu_check.sh"
    script = gpu_check.read_text() if gpu_check.is_file() else ""
    offenders += [
        f"gpu_check.sh imports {name}"
        for name in re.findall(
            r"^\s*(?:from|import) "
            r"(test_\w+|conftest)",
            script,
            re.MULTILINE,
        )
    ]
    assert not offenders, offenders


def defined_lines(path: Path) -> dict[str, tuple[int, int]]:
    """Qualified name (Class.method or function) -> its (first, last) line in `path`."""
    lines = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines[prefix + child.name] = (child.lineno, child.end_lineno)
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return lines


def test_the_readers_paths_name_the_lines_that_hold_them():
    """The README's reader's paths cannot drift: each function named there spans exactly the lines
    given beside it. A fork skips the entries of the files it deleted (README, Fork)."""
    section = (ROOT / "README.md").read_text().split("\n## A reader's paths\n")[1].split("\n## ")[0]
    entries = re.findall(r"`(\w+\.py)`\s+(\d+)-(\d+)\s+`([\w.]+)`", section)
    assert len(entries) >= 20, entries
    wrong = [
        f"{file} {first}-{last} {name}: it spans {defined_lines(ROOT / file).get(name)}"
        for file, first, last, name in entries
        if (ROOT / file).is_file()
        and defined_lines(ROOT / file).get(name) != (int(first), int(last))
    ]
    assert not wrong, wrong


# A file's name in prose: NAME.py, NAME.md or NAME.toml, or a path such as tools/NAME.py, not part
# of a longer name or path (`<family>_baselines.py` and `*.toml` are patterns, not names).
NAMED_FILE = re.compile(r"(?<![\w./<>*{}$-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|toml))(?![\w/])")
# Files of other projects that comments cite, and example paths of the tests' own data.
NOT_OURS = {
    "pydoc_data/topics.py",  # CPython's (data.py: the reference text)
    "fsdp/_fully_shard/_fsdp_common.py",  # torch's (parallel.py)
    "docs/performance-summary.md",  # NeMo AutoModel's (tools/flint_baselines.py)
    "sub/b.md",
}  # a file test_data.py makes


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring of `path`."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(node, clean=False) is not None
        ):
            found.append((node.body[0].lineno, ast.get_docstring(node, clean=False)))
    return found


def missing_files_named(path: Path, files: set[str]) -> list[str]:
    """Each file that a comment or docstring of `path` names and the repository lacks: a path
    (tools/NAME.py) must exist as written, a bare name somewhere in the tree. A placeholder in
    capitals (configs/X.toml) names no file; neither is a file the README's Fork table deletes
    missing."""
    names = {Path(file).name for file in files}
    forked = fork_table_files()
    forked |= {Path(file).name for file in forked}
    return [
        f"{path.relative_to(ROOT)}:{line}: {named}"
        for line, text in comments_and_docstrings(path)
        for named in NAMED_FILE.findall(text)
        if named not in NOT_OURS | forked
        and not Path(named).stem.isupper()
        and named not in (files if "/" in named else names)
    ]


def fork_table_files() -> set[str]:
    """The paths the README's Fork table deletes for either model (a fork may still mention
    them)."""
    section = (ROOT / "README.md").read_text().split("\n## Fork\n")[1].split("\n## ")[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {name for cells in rows if len(cells) > 1 for name in re.findall(r"`([^`]+)`", cells[1])}


def repository_files() -> set[str]:
    """Every file of the tree, as a path from the root: tracked, or new and not ignored (a fork's
    copy, which is no git checkout: every file but hidden folders and the virtual environment)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0 and listed.stdout:
        return set(listed.stdout.split())
    found = set()
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [
            name for name in subfolders if not name.startswith(".") and name != "__pycache__"
        ]
        found |= {str((Path(folder) / name).relative_to(ROOT)) for name in names}
    return found


@pytest.mark.slow
def test_comments_name_only_files_that_exist():
    """A comment or docstring that names a file since renamed or deleted sends a reader nowhere
    (issue 40 found five)."""
    files = repository_files()
    python_files = (
        sorted(ROOT.glob("*.py"))
        + sorted((ROOT / "tools").glob("*.py"))
        + sorted((ROOT / "tests").glob("*.py"))
    )
    missing = [entry for path in python_files for entry in missing_files_named(path, files)]
    assert not missing, missing
