"""tools/checkpoint_cost.py: it runs end to end on the debug model and reports both saving modes."""

import subprocess
import sys

import pytest

from config import ConfigError
from helpers import DEFAULT_FAMILY, ROOT, debug_configs, stops_with_one_line
from tools import checkpoint_cost


@pytest.mark.slow
def test_it_times_synchronous_and_asynchronous_saves():
    config = str(debug_configs()[DEFAULT_FAMILY])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.checkpoint_cost",
            "--config",
            config,
            "--steps",
            "4",
            "--every",
            "2",
            "--rounds",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("sync:", "async:"))]
    assert len(lines) == 2 and all("ms per save" in line for line in lines), result.stdout


@pytest.mark.parametrize(
    "argv, kind, named, pattern",
    [
        (["--steps", "0"], SystemExit, "--steps", r"must be >= 1, got 0$"),
        (["--every", "-5"], SystemExit, "--every", r"must be >= 1, got -5$"),
        (["--rounds", "0"], SystemExit, "--rounds", r"must be >= 1, got 0$"),
        (
            ["--steps", "5", "--every", "3"],
            ConfigError,
            "--steps",
            r"at least twice --every .* got --steps 5 --every 3",
        ),
        (
            ["--config", "{tmp}/missing.toml"],
            ConfigError,
            "{tmp}/missing.toml",
            r"cannot read config file",
        ),
    ],
)
def test_bad_flags_stop_in_one_line_before_any_run(
    tmp_path, monkeypatch, argv, kind, named, pattern
):
    monkeypatch.setattr(
        checkpoint_cost, "timed_run", lambda *args: pytest.fail("ran despite a bad flag")
    )
    argv = [
        "--config",
        str(debug_configs()[DEFAULT_FAMILY]),
        *(arg.format(tmp=tmp_path) for arg in argv),
    ]
    stops_with_one_line(
        lambda: checkpoint_cost.main(argv), kind, named.format(tmp=tmp_path), pattern
    )


def test_the_smallest_accepted_flags_reach_each_run(monkeypatch, capsys):
    """--steps 2 --every 1 --rounds 1: one run per mode, saving every step (or only at the end)."""
    runs = []

    def timed_run(config, steps, every, async_save, directory):
        runs.append((steps, every, async_save))
        return [0.001], 1.0

    monkeypatch.setattr(checkpoint_cost, "timed_run", timed_run)
    checkpoint_cost.main(
        [
            "--config",
            str(debug_configs()[DEFAULT_FAMILY]),
            "--steps",
            "2",
            "--every",
            "1",
            "--rounds",
            "1",
        ]
    )
    assert runs == [(2, "0", "false"), (2, "1", "false"), (2, "1", "true")]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["sync", "async"]
    assert "median of 1 saves" in lines[0]
