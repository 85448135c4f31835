"""tools/compare_trees.py: the verdict on two runs' logged steps."""

from tools.compare_trees import compare, config_text


def records(*values: tuple[float, float]) -> list[dict]:
    return [{"step": i + 1, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(values)]


def test_identical_runs_say_so_and_a_difference_names_its_size_and_first_step():
    run = records((5.0, 2.0), (4.0, 1.0), (3.0, 1.0))
    assert compare(run, run) == "identical"
    moved = records((5.0, 2.0), (4.0, 1.0 + 3e-7), (3.0 * (1 + 1e-6), 1.0))
    assert compare(run, moved) == "largest relative difference 1.0e-06, first at step 2"


def test_runs_that_logged_other_steps_are_not_compared_value_by_value():
    assert compare(records((5.0, 2.0)), records((5.0, 2.0), (4.0, 1.0))).startswith("different steps logged")


def test_the_config_every_tree_reads_is_the_familys_debug_model(tmp_path):
    text = config_text("large4", 6, tmp_path)
    assert 'family = "large4"' in text and "steps = 6" in text and f'jsonl = "{tmp_path}/metrics.jsonl"' in text
