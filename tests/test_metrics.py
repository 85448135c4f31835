"""metrics.py: what a person sees of a run besides the loss curve: durations, the records a run
keeps or drops in a shared log, the model's FLOPs per token, the cached CPU peak, the traces of
chosen steps and the report at the end."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import metrics
import moe
import train
from helpers import (
    DEFAULT_FAMILY,
    FAMILY_NAMES,
    debug_args,
    debug_configs,
    only,
    run_debug,
    run_two_processes,
    tiny_config,
)
from metrics import drop_superseded_records, duration, model_flops_per_token
from registry import model_class

DEBUG = str(debug_configs()[DEFAULT_FAMILY])  # the metrics machinery is the same for every model


def test_durations_read_as_minutes_and_seconds_then_hours_and_minutes():
    assert [duration(s) for s in (0, 59.9, 61, 3599, 3600, 7325)] == [
        "0m00s",
        "0m59s",
        "1m01s",
        "59m59s",
        "1h00m",
        "2h02m",
    ]


def test_a_run_drops_only_its_own_records_past_its_resume_step(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [{"run": "a", "step": 1}, {"run": "b", "step": 5}, {"run": "a", "step": 3}, {"step": 9}]
    # a crash mid-line
    log.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"run": "a", "ste')
    drop_superseded_records(log, "a", 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        lines[0],
        lines[1],
        lines[3],
    ]
    before = log.read_text()
    drop_superseded_records(log, "c", 0)  # nothing of run c: the file is left as it is
    assert log.read_text() == before


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_flops_per_token_are_the_whole_models_counted_on_meta(family):
    config = tiny_config(family)
    assert model_flops_per_token(config, 64) == model_class(config)(config).flops_per_token(64) > 0


def test_a_damaged_peak_cache_is_measured_again(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_peak.json"
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", cache)
    assert metrics.read_peak_cache() == {}
    cache.write_text("[1, 2")
    assert metrics.read_peak_cache() == {}
    cache.write_text('{"some cpu": 1.5e11}')
    assert metrics.read_peak_cache() == {"some cpu": 1.5e11}


def test_cpu_peak_is_measured_once_per_machine_and_shared_by_its_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", tmp_path / "cache" / "cpu_peak.json")
    measured = []
    monkeypatch.setattr(metrics, "measure_cpu_flops", lambda: measured.append(1) or 2e11)
    cfg = train.load_config(DEBUG)
    one = train.Process(0, 1, 0, 1, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, one) == 2e11 and metrics.run_peak_flops(cfg, one) == 2e11
    assert len(measured) == 1  # the second run reads the cache
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two_on_one_machine = train.Process(0, 2, 0, 2, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, two_on_one_machine) == 2e11  # shared cores: not 2 x
    four_on_two_machines = train.Process(0, 4, 0, 4, torch.device("cpu"))
    assert metrics.run_peak_flops(cfg, four_on_two_machines) == 4e11
    given = train.load_config(DEBUG, ["--logging.peak_tflops=0.5"])
    # per device, as the key says
    assert metrics.run_peak_flops(given, two_on_one_machine) == pytest.approx(1e12)


def test_a_logged_step_is_one_line_with_units_and_the_same_numbers_in_the_log(tmp_path, capsys):
    """The line a person reads and the JSON record agree: the loss as given, MFU from tokens/s, the
    FLOPs per token and the given peak, and the busiest layer's expert loads at the end."""
    log = tmp_path / "metrics.jsonl"
    cfg = train.load_config(DEBUG, [f"--logging.jsonl={log}", "--logging.peak_tflops=0.1"])
    logger = metrics.MetricsLogger(
        cfg,
        train.Process(0, 1, 0, 1, torch.device("cpu")),
        cfg.model_config,
        start_step=0,
        run_dir=tmp_path / "run_0001",
    )
    routing = {"2": {"max_load": 1.75, "min_load": 0.25}, "3": {"max_load": 3.5, "min_load": 0.0}}
    logger.log_train(5, loss=2.5, lr=1e-3, grad_norm=0.5, routing=routing)
    line = capsys.readouterr().out.splitlines()[-1]
    (record,) = [json.loads(text) for text in log.read_text().splitlines()]
    # steps x batch x seq
    assert record["run"] == str(tmp_path / "run_0001") and record["tokens"] == 5 * 4 * 64
    assert record["mfu_percent"] == pytest.approx(
        100 * record["tokens_per_s"] * logger.flops_per_token / 1e11
    )
    # steps padded to 20's width
    assert line.startswith("step  5/20 | loss 2.5000 | lr 1.00e-03 | grad norm 0.500 | ")
    assert (
        f"{record['tokens_per_s']:,.0f} tokens/s | MFU {record['mfu_percent']:.2f}% | mem " in line
    )
    assert " GiB | " in line and " elapsed | " in line
    # the busiest layer, its own min
    assert line.endswith(" left | experts max/min load 3.50/0.00 (layer 3)")
    assert logger.summary["first_loss"] == 2.5


# --------------------------------------------------------------- traces of chosen steps, the report

# The ranges named_ranges places in an eager dropless Flint's profiled step (and moe.py's functions
# it wraps): the two tests that read them are about Flint's module kinds (its family's
# timed_modules).
NAMED = {
    "forward and backward",
    "layer 0",
    "layer 3",
    "attention core",
    "attention proj/norm/rope",
    "router",
    "routed experts",
    "expert dispatch",
    "expert combine",
    "grouped GEMM",
    "dense MLP or shared expert",
    "head and loss",
    "gradient clipping",
    "optimizer",
}


def trace_names(path: Path) -> set[str]:
    return {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}


@only("flint")
def test_profiled_steps_write_a_trace_with_named_ranges_and_the_run_its_report(tmp_path, capsys):
    summary = run_debug(
        tmp_path,
        "--training.steps=3",
        "--logging.profile_steps=2-3",
        "--training.sample_tokens=0",
        family="flint",
    )
    run_dir = tmp_path / "ckpt" / "run_0001"
    names = trace_names(run_dir / "trace_steps2-3_rank0.json")
    assert NAMED | {"step 2", "step 3", "gloo:all_reduce"} <= names and "step 1" not in names
    printed = capsys.readouterr().out
    assert (
        f"profiled steps 2-3: traces {run_dir}/trace_steps2-3_rank*.json, one per rank" in printed
    )
    assert printed.rstrip().endswith(f"report: {run_dir / 'report.html'}")
    assert json.loads((run_dir / "run.json").read_text())["jsonl"] == str(
        tmp_path / "metrics.jsonl"
    )
    assert f"{summary['loss']:.4f}" in (run_dir / "report.html").read_text()


@only("flint")
def test_two_processes_write_one_trace_per_rank(tmp_path):
    """Each rank of a gloo run records its own profiled step, with its collectives among the named
    ranges."""
    run_two_processes(
        debug_args(
            tmp_path,
            "--training.steps=2",
            "--logging.profile_steps=2",
            "--training.sample_tokens=0",
            "--parallel.dp_shard=2",
            family="flint",
        )
    )
    run_dir = tmp_path / "ckpt" / "run_0001"
    assert sorted(p.name for p in run_dir.glob("trace_*.json")) == [
        "trace_steps2-2_rank0.json",
        "trace_steps2-2_rank1.json",
    ]
    for rank in (0, 1):
        names = trace_names(run_dir / f"trace_steps2-2_rank{rank}.json")
        assert {"step 2", "optimizer"} <= names and "step 1" not in names
        assert any(name.startswith("gloo:") for name in names)


@only("flint")
def test_named_ranges_are_placed_while_profiling_and_all_taken_away_after():
    """Around a forward and backward and an optimizer step, from outside a model: every range named,
    and afterwards no hook, wrapper or patched function left."""
    from flint_model import FlintConfig, build_model

    module = build_model(FlintConfig.from_name("tiny", num_hidden_layers=4, vocab_size=64))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = SimpleNamespace(
        module=module,
        config=module.config,
        forward_backward=lambda ids: module(ids, targets=ids).backward(),
        clip_grad_norm_=lambda limit: torch.nn.utils.clip_grad_norm_(module.parameters(), limit),
    )
    before = (model.forward_backward, model.clip_grad_norm_, moe.dispatch, moe.grouped_mm)
    with torch.profiler.profile() as profiler, metrics.named_ranges(model, optimizer):
        model.forward_backward(torch.randint(0, 64, (2, 16)))
        model.clip_grad_norm_(1.0)
        optimizer.step()
    assert NAMED <= {event.name for event in profiler.events()}
    assert (model.forward_backward, model.clip_grad_norm_, moe.dispatch, moe.grouped_mm) == before

    def hooked() -> list[str]:
        return [
            name for name, m in module.named_modules() if m._forward_hooks or m._forward_pre_hooks
        ]

    assert (
        not hooked()
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
    )
    # as parallel.apply_compile leaves a compiled block
    module.layers["2"].forward = module.layers["2"].forward
    # a compiled block: a range around it, none inside, no wrappers
    with metrics.named_ranges(model, optimizer):
        assert "layers.2" in hooked() and not [
            name for name in hooked() if name.startswith("layers.2.")
        ]
        assert "layers.3.mlp.router" in hooked() and moe.dispatch is before[2]


def test_a_step_out_of_gpu_memory_exits_with_one_line_naming_its_snapshot(tmp_path, monkeypatch):
    cfg = train.load_config(
        DEBUG, [f"--logging.jsonl={tmp_path / 'm.jsonl'}", "--logging.peak_tflops=0.1"]
    )
    logger = metrics.MetricsLogger(
        cfg,
        train.Process(0, 1, 0, 1, torch.device("cpu")),
        cfg.model_config,
        start_step=0,
        run_dir=tmp_path / "run_0001",
    )
    out_of_memory = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has ..."
    )
    with pytest.raises(torch.OutOfMemoryError):  # on the CPU: as it came
        with logger.traced(7, None, None):
            raise out_of_memory
    logger.run = dataclasses.replace(logger.run, rank=1, device=torch.device("cuda"))
    monkeypatch.setattr(
        torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_bytes(b"snapshot")
    )
    with pytest.raises(SystemExit) as stop:
        with logger.traced(7, None, None):
            raise out_of_memory
    snapshot = tmp_path / "run_0001" / "memory_oom_step7_rank1.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    assert stop.value.code == (
        "step 7: rank 1 ran out of GPU memory (CUDA out of memory. Tried to "
        "allocate 2.00 "
        f"GiB.); the allocator's snapshot is {snapshot} (open it in "
        "https://pytorch.org/memory_viz)"
    )


@pytest.mark.parametrize(
    "text, start_step, steps, said",
    [
        ("", 4, None, None),
        ("5-6", 4, range(5, 7), None),  # the boundary: the first step the resumed run trains
        (
            "4-6",
            4,
            range(5, 7),
            "names steps 4-6, of which 4-4 were trained before this run resumed at step 4: "
            "profiling steps 5-6 only",
        ),
        (
            "2-4",
            4,
            None,
            "names steps 2-4, all trained before this run resumed at step 4: none is profiled; "
            "name steps after 4",
        ),
        (
            "3",
            7,
            None,
            "names steps 3-3, all trained before this run resumed at step 7: none is profiled; "
            "name steps after 7",
        ),
    ],
)
def test_profile_steps_before_a_resume_are_said_to_be_lost(text, start_step, steps, said):
    """[logging] profile_steps naming steps a resumed run does not train: the rest are profiled, and
    a warning says which were lost (they were silently never profiled); none lost at the
    boundary."""
    got, message = metrics.steps_to_profile(text, start_step)
    assert got == steps
    assert message == (None if said is None else f"profile_steps = {text!r} {said}")
