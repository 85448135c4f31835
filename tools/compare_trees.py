"""The same training numbers from two checkouts: a refactor's proof that nothing moved.

    python3 -m tools.compare_trees OLD_TREE NEW_TREE [--steps 6] [--layouts one,dp_shard,ep,pp,cp]

trains each registered family's debug model (configs/*debug.toml) for a few steps in each layout,
once with each tree's own train.py (under torchrun for the 2-process layouts), and compares the
losses and gradient norms every step logs. A tree is any checkout (`git worktree add /tmp/old
COMMIT`). Both trees get the same config, written here from what every tree since the first layouts
understands, so an old tree needs none of the new configs. Prints one line per debug model and
layout: identical, or the largest relative difference and the first step where the two runs part (a
NaN or infinite loss or norm is a difference); exits 1 if any run differs."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from flags import OneLineParser, names_from, positive

ROOT = Path(__file__).resolve().parent.parent


def debug_models(root: Path = ROOT) -> dict[str, str]:
    """Each registered family's debug model, as this checkout's configs/*debug.toml define it: the
    config's name -> its [model] table as TOML text (keys every tree since the first layouts
    reads)."""
    return {
        path.stem: "".join(
            f"{key} = {json.dumps(value)}\n"
            for key, value in tomllib.loads(path.read_text())["model"].items()
        )
        for path in sorted((root / "configs").glob("*debug.toml"))
    }


DEBUG_MODELS = debug_models()
LAYOUTS = {
    "one": [],
    "dp_shard": ["--parallel.dp_shard=2"],
    "ep": ["--parallel.ep=2"],
    "pp": ["--parallel.pp=2"],
    "cp": ["--parallel.cp=2"],
}


def config_text(model: str, steps: int, run_dir: Path) -> str:
    return (
        f"[model]\n{DEBUG_MODELS[model]}\n"
        f'[data]\npath = "data/python_reference.jsonl"\nseq_len = 64\nval_fraction = 0.05\n\n'
        f"[training]\nsteps = {steps}\nbatch_size = 4\nseed = 0\neval_batches = "
        "2\nsample_tokens = 0\n\n"
        f"[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 2\n\n"
        f'[checkpoint]\ndir = "{run_dir}/checkpoints"\nresume = "never"\n\n'
        f'[logging]\nevery = 1\njsonl = "{run_dir}/metrics.jsonl"\n'
    )


def train(tree: Path, model: str, layout: str, steps: int, work: Path) -> list[dict]:
    """One run of `tree`'s train.py -> its per-step training records ([{step, loss, grad_norm},
    ...])."""
    run_dir = work / f"{tree.name}-{model}-{layout}"
    config = run_dir / "config.toml"
    run_dir.mkdir(parents=True)
    config.write_text(config_text(model, steps, run_dir))
    extra = LAYOUTS[layout]
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        if extra
        else [sys.executable]
    )
    result = subprocess.run(
        [*launcher, "train.py", "--config", str(config), *extra],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode:
        raise SystemExit(
            f"{tree}: {model} {layout} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    return logged_steps(run_dir / "metrics.jsonl", f"{tree}: {model} {layout}")


def logged_steps(metrics: Path, run: str) -> list[dict]:
    """The training records ({step, loss, grad_norm, ...}) of a run's metrics JSONL; a missing
    file or a line that is not a JSON object stops in one line naming it."""
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    except (OSError, ValueError) as error:
        raise SystemExit(f"{run}: cannot read {metrics}: {error}") from error
    if not all(isinstance(r, dict) for r in records):
        raise SystemExit(f"{run}: {metrics} holds a line that is not a JSON object")
    return [r for r in records if "loss" in r and "step" in r]


def not_finite(run: list[dict], name: str) -> str | None:
    """The first loss or gradient norm of `run` that is NaN or infinite, said as a failure (NaN
    equals nothing, so the relative difference below would read it as agreement)."""
    for record in run:
        for key in ("loss", "grad_norm"):
            value = record.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"{key} is {value!r} at step {record['step']} in the {name} run"
    return None


def compare(old: list[dict], new: list[dict]) -> str:
    """'identical', or the largest relative difference of loss and gradient norm and the first
    step that differs; a run with no steps, or with a NaN or infinite value, is a difference of
    its own."""
    if [r["step"] for r in old] != [r["step"] for r in new]:
        return f"different steps logged: {[r['step'] for r in old]} vs {[r['step'] for r in new]}"
    if not old:
        return "no steps logged by either run"
    broken = not_finite(old, "old") or not_finite(new, "new")
    if broken:
        return broken
    worst, first = 0.0, None
    for a, b in zip(old, new):
        for key in ("loss", "grad_norm"):
            gap = abs(a[key] - b[key]) / max(abs(a[key]), 1e-30)
            if gap and first is None:
                first = a["step"]
            worst = max(worst, gap)
    return (
        "identical"
        if first is None
        else f"largest relative difference {worst:.1e}, first at step {first}"
    )


def checkout(text: str) -> Path:
    """An argparse type: a directory holding a train.py (a checkout of this repository)."""
    tree = Path(text).resolve()
    if not (tree / "train.py").is_file():
        raise argparse.ArgumentTypeError(
            f"{text} is not a checkout: {tree / 'train.py'} does not exist"
        )
    return tree


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=checkout)
    parser.add_argument("new", type=checkout)
    parser.add_argument("--steps", type=positive, default=6)
    parser.add_argument("--layouts", type=names_from(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--models",
        type=names_from(DEBUG_MODELS),
        default=list(DEBUG_MODELS),
        help="debug configs' names",
    )
    args = parser.parse_args(argv)
    differ = 0
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            for layout in args.layouts:
                old = train(args.old, model, layout, args.steps, Path(work) / "old")
                new = train(args.new, model, layout, args.steps, Path(work) / "new")
                verdict = compare(old, new)
                differ += verdict != "identical"
                print(f"{model:12} {layout:9} {len(old)} steps: {verdict}", flush=True)
    if differ:
        raise SystemExit(f"{differ} of {len(args.models) * len(args.layouts)} runs differ")


if __name__ == "__main__":
    main()
