"""pipeline.py: a model's stages and the view of a rank's stages (the schedules run in
test_parallel.py, for every family). The stages here are cut from Flint, whose layer count is
free."""

import pytest
import torch

from helpers import only, spawn, tiny_config
from pipeline import SCHEDULES, V_SCHEDULES, merged_view, pipeline_stage
from registry import model_class


def meta_flint(layers: int) -> torch.nn.Module:
    config = tiny_config("flint", num_hidden_layers=layers)
    with torch.device("meta"):
        return model_class(config)(config)


@only("flint")
def test_stages_split_the_layers_contiguously_with_the_embedding_first_and_the_head_last():
    model = meta_flint(7)
    stages = [pipeline_stage(model, s, 3) for s in range(3)]
    assert [list(stage.layers) for stage in stages] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    assert [stage.embed_tokens is not None for stage in stages] == [True, False, False]
    assert [stage.lm_head is not None and stage.norm is not None for stage in stages] == [
        False,
        False,
        True,
    ]
    assert len(model.layers) == 7  # the model itself is left whole


@only("flint")
def test_a_rank_s_stages_keep_the_native_parameter_names():
    model = meta_flint(4)
    names = {name for name, _ in model.named_parameters()}
    first, last = pipeline_stage(model, 0, 4), pipeline_stage(model, 3, 4)
    view = merged_view([first, last])  # a V placement: rank 0 of 2 holds stages 0 and 3
    assert {name for name, _ in view.named_parameters()} == {
        n for n in names if not n.startswith(("layers.1.", "layers.2."))
    }
    assert merged_view([first]) is first


@only("flint")
def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="3 pipeline stages need at least as many layers, got 2"):
        pipeline_stage(meta_flint(2), 0, 3)


def test_the_v_schedules_are_schedules():
    assert set(V_SCHEDULES) <= set(SCHEDULES)


def stage_order(schedule: str) -> str:
    """This rank's block of parallel_step's model in a 2-stage pipeline of 4 micro-batches under
    `schedule`: F for each forward, B for each backward through it, in the order they ran."""
    from helpers import make_batch, parallel_block_model, rows_of_this_rank
    from parallel import ParallelConfig, build_mesh, parallelize

    model = parallel_block_model("flint")
    cfg = ParallelConfig(pp=2, pp_microbatches=4, pp_schedule=schedule, param_dtype="float32")
    pm = parallelize(model, cfg, build_mesh(cfg, "cpu", model.config.num_experts))
    events = []

    def forward_then_backward(module, args, out):
        events.append("F")
        out.register_hook(lambda grad: events.append("B"))

    for part in pm.parts:
        for layer in part.layers.values():
            layer.register_forward_hook(forward_then_backward)
    pm.forward_backward(*rows_of_this_rank(pm.mesh, make_batch(vocab=model.config.vocab_size)))
    return "".join(events)


def check_the_schedule_runs_pp_microbatches(microbatches: int) -> None:
    """[parallel] pp_microbatches and pp_schedule reach the pipeline: `microbatches` forwards per
    stage; GPipe runs every forward before any backward, 1F1B starts backwards before its last
    forward."""
    from helpers import parallel_step

    calls = parallel_step("flint", {"pp": 2, "pp_microbatches": microbatches}, False)[3]
    assert list(calls.values()) == [[microbatches, 0]], calls
    assert stage_order("GPipe") == "FFFFBBBB"
    order = stage_order("1F1B")
    assert sorted(order) == sorted("FFFFBBBB") and order.index("B") < order.rindex("F"), order


@only("flint")
def test_the_schedule_runs_pp_microbatches_micro_batches_in_its_order():
    """4 micro-batches, not the default (one per stage: 2)."""
    spawn(2, check_the_schedule_runs_pp_microbatches, 4)
