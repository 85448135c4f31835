"""tools/compare_trees.py: the verdict on two runs' logged steps."""

import tomllib
from math import inf, nan
from pathlib import Path

import pytest

from helpers import stops_with_one_line
from tools import compare_trees
from tools.compare_trees import DEBUG_MODELS, compare, config_text


def records(*values: tuple[float, float]) -> list[dict]:
    return [
        {"step": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(values)
    ]


def test_identical_runs_say_so_and_a_difference_names_its_size_and_first_step():
    run = records((5.0, 2.0), (4.0, 1.0), (3.0, 1.0))
    assert compare(run, run) == "identical"
    moved = records((5.0, 2.0), (4.0, 1.0 + 3e-7), (3.0 * (1 + 1e-6), 1.0))
    assert compare(run, moved) == "largest relative difference 1.0e-06, first at step 2"


def test_runs_that_logged_other_steps_are_not_compared_value_by_value():
    assert compare(records((5.0, 2.0)), records((5.0, 2.0), (4.0, 1.0))).startswith(
        "different steps logged"
    )


def test_the_config_every_tree_reads_is_each_debug_configs_model(tmp_path):
    assert DEBUG_MODELS and "debug" in next(iter(DEBUG_MODELS))
    for name in DEBUG_MODELS:
        text = config_text(name, 6, tmp_path)
        shipped = tomllib.loads(
            (Path(__file__).resolve().parent.parent / "configs" / f"{name}.toml").read_text()
        )
        assert tomllib.loads(text)["model"] == shipped["model"]
        assert "steps = 6" in text and f'jsonl = "{tmp_path}/metrics.jsonl"' in text


def test_a_nan_or_infinite_value_is_a_difference_never_agreement():
    """NaN equals nothing, so a relative difference of NaN compares as 0: each run's first
    non-finite value is named instead; runs with no steps are not identical either."""
    run = records((5.0, 2.0), (4.0, 1.0))
    assert compare(run, records((5.0, 2.0), (nan, 1.0))) == "loss is nan at step 2 in the new run"
    assert (
        compare(records((5.0, inf), (4.0, 1.0)), run) == "grad_norm is inf at step 1 in the old run"
    )
    both = records((5.0, 2.0), (nan, 1.0))
    assert compare(both, both) == "loss is nan at step 2 in the old run"
    assert compare([], []) == "no steps logged by either run"
    unlogged = [{"step": 1, "loss": 5.0}]
    assert compare(unlogged, unlogged) == "grad_norm is None at step 1 in the old run"
    assert (
        compare(records((5.0, 1e300)), records((5.0, 1e300))) == "identical"
    )  # finite, however large


def a_checkout(tmp_path, name):
    tree = tmp_path / name
    tree.mkdir()
    (tree / "train.py").write_text("")
    return str(tree)


@pytest.mark.parametrize(
    "argv, named, pattern",
    [
        (["{missing}", "{old}"], "{missing}", r"is not a checkout: .*train.py does not exist"),
        (["{old}", "{tmp}"], "{tmp}", r"is not a checkout"),
        (
            ["{old}", "{new}", "--layouts", "bogus"],
            "--layouts",
            r"unknown name 'bogus'; choose from one,dp_shard,ep",
        ),
        (["{old}", "{new}", "--layouts", "one,"], "--layouts", r"unknown name ''"),
        (
            ["{old}", "{new}", "--models", "bogus"],
            "--models",
            r"unknown name 'bogus'; choose from .*debug",
        ),
        (["{old}", "{new}", "--steps", "0"], "--steps", r"must be >= 1, got 0$"),
        (["{old}", "{new}", "--steps", "-3"], "--steps", r"must be >= 1, got -3$"),
        (["{old}"], "new", r"required"),
    ],
)
def test_bad_trees_and_flags_stop_in_one_line(tmp_path, monkeypatch, argv, named, pattern):
    paths = {
        "missing": str(tmp_path / "missing"),
        "tmp": str(tmp_path),
        "old": a_checkout(tmp_path, "old"),
        "new": a_checkout(tmp_path, "new"),
    }
    monkeypatch.setattr(
        compare_trees, "train", lambda *args: pytest.fail("trained despite a bad flag")
    )
    stops_with_one_line(
        lambda: compare_trees.main([arg.format(**paths) for arg in argv]),
        SystemExit,
        named.format(**paths),
        pattern,
    )


def test_the_smallest_accepted_flags_reach_the_runs_and_a_difference_exits_1(
    tmp_path, monkeypatch, capsys
):
    """--steps 1 and one layout and model each reach train(); the run that differs sets the exit
    status."""
    trained = []

    def train(tree, model, layout, steps, work):
        trained.append((Path(tree).name, model, layout, steps))
        return records((5.0, 2.0 if Path(tree).name == "old" else 3.0))

    monkeypatch.setattr(compare_trees, "train", train)
    model = next(iter(DEBUG_MODELS))
    argv = [
        a_checkout(tmp_path, "old"),
        a_checkout(tmp_path, "new"),
        "--steps",
        "1",
        "--layouts",
        "one",
        "--models",
        model,
    ]
    stops_with_one_line(lambda: compare_trees.main(argv), SystemExit, "1 of 1 runs differ", "")
    assert trained == [("old", model, "one", 1), ("new", model, "one", 1)]
    assert "largest relative difference 5.0e-01, first at step 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, pattern",
    [
        (None, r"cannot read .*metrics.jsonl: \[Errno 2\]"),
        ('{"step": 1, "loss": 5.0}\n{"step": 2,', r"cannot read .*metrics.jsonl: Expecting"),
        (
            '{"step": 1, "loss": 5.0}\n[1, 2]\n',
            r"metrics.jsonl holds a line that is not a JSON object",
        ),
    ],
)
def test_a_missing_or_damaged_metrics_file_is_one_line(tmp_path, text, pattern):
    metrics = tmp_path / "metrics.jsonl"
    if text is not None:
        metrics.write_text(text)
    stops_with_one_line(
        lambda: compare_trees.logged_steps(metrics, "old: debug one"),
        SystemExit,
        "old: debug one",
        pattern,
    )


def test_the_training_records_are_the_lines_with_a_step_and_a_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 1, "loss": 5.0, "grad_norm": 2.0}\n{"step": 1, "val_loss": 5.5}\n{"run": "x"}\n'
    )
    expected = [{"step": 1, "loss": 5.0, "grad_norm": 2.0}]
    assert compare_trees.logged_steps(metrics, "old") == expected
