"""tools/compare_trees.py: the verdict on two runs' logged steps."""

import tomllib
from pathlib import Path

from tools.compare_trees import DEBUG_MODELS, compare, config_text


def records(*values: tuple[float, float]) -> list[dict]:
    return [{"step": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(values)]


def test_identical_runs_say_so_and_a_difference_names_its_size_and_first_step():
    run = records((5.0, 2.0), (4.0, 1.0), (3.0, 1.0))
    assert compare(run, run) == "identical"
    moved = records((5.0, 2.0), (4.0, 1.0 + 3e-7), (3.0 * (1 + 1e-6), 1.0))
    assert compare(run, moved) == "largest relative difference 1.0e-06, first at step 2"


def test_runs_that_logged_other_steps_are_not_compared_value_by_value():
    assert compare(records((5.0, 2.0)), records((5.0, 2.0), (4.0, 1.0))).startswith("different steps logged")


def test_the_config_every_tree_reads_is_each_debug_configs_model(tmp_path):
    assert DEBUG_MODELS and "debug" in next(iter(DEBUG_MODELS))
    for name in DEBUG_MODELS:
        text = config_text(name, 6, tmp_path)
        shipped = tomllib.loads((Path(__file__).resolve().parent.parent / "configs" / f"{name}.toml").read_text())
        assert tomllib.loads(text)["model"] == shipped["model"]
        assert "steps = 6" in text and f'jsonl = "{tmp_path}/metrics.jsonl"' in text
