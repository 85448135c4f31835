"""metrics.py: what a person sees of a run besides the loss curve: durations, the records a run
keeps or drops in a shared log, the model's FLOPs per token, the cached CPU peak, the traces of
chosen steps and the report at the end."""

import dataclasses
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
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
    ROOT,
    debug_args,
    debug_configs,
    only,
    records,
    run_debug,
    run_two_processes,
    tiny_config,
    train_losses,
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


def test_the_logged_memory_is_each_intervals_peak_not_the_processs_lifetime(tmp_path):
    """A spike of 256 MiB shows in the interval it happened in and is gone from the next one: the
    high-water mark starts again after each reading (on the CPU: VmHWM, reset by clear_refs)."""
    cpu = train.Process(0, 1, 0, 1, torch.device("cpu"))
    metrics.interval_peak_gib(cpu)
    spike = torch.ones(2**26)  # 256 MiB, every page touched
    before_spike_ends = metrics.resident_high_water_kib() / 2**20
    del spike
    with_spike = metrics.interval_peak_gib(cpu)
    after = metrics.interval_peak_gib(cpu)
    # the kernel's resident counters are approximate (batched per CPU): a few pages either way
    assert with_spike == pytest.approx(before_spike_ends, abs=0.01) and with_spike >= 0.25
    assert with_spike - after >= 0.2


def test_the_interval_peak_reads_vmhwm_and_resets_it(tmp_path, monkeypatch):
    """The mark is read from the status file's VmHWM (KiB), and 5 is written to clear_refs; with no
    such field, the lifetime maximum resident set."""
    status, clear = tmp_path / "status", tmp_path / "clear_refs"
    status.write_text("Name:\tpython\nVmPeak:\t 9999999 kB\nVmHWM:\t 3145728 kB\n")
    monkeypatch.setattr(metrics, "PROC_STATUS", status)
    monkeypatch.setattr(metrics, "PROC_CLEAR_REFS", clear)
    cpu = train.Process(0, 1, 0, 1, torch.device("cpu"))
    assert metrics.interval_peak_gib(cpu) == 3.0 and clear.read_text() == "5"
    status.write_text("Name:\tpython\n")
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert metrics.interval_peak_gib(cpu) == pytest.approx(lifetime, rel=0.05)


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
    logger.add_loss(2.5, target_tokens=256)
    logger.log_train(5, lr=1e-3, grad_norm=0.5, routing=routing)
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
    "layer 0 backward",
    "layer 3 backward",
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    spans = {e.name: e.time_range for e in profiler.events() if e.name.startswith("layer ")}
    # backward in reverse layer order, each after every forward, one layer's inside no other's
    backward = [spans[f"layer {i} backward"] for i in (3, 2, 1, 0)]
    assert spans["layer 3"].end <= backward[0].start
    assert all(later.end <= earlier.start for later, earlier in zip(backward, backward[1:]))
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


# ------------------------------------------------------------ the interval's loss, the trackers


def logger_at(tmp_path: Path, rank: int, start_step: int, *overrides: str) -> metrics.MetricsLogger:
    """A MetricsLogger of rank `rank` of 2 on the debug config, writing tmp_path/metrics.jsonl."""
    jsonl = f"--logging.jsonl={tmp_path / 'metrics.jsonl'}"
    cfg = train.load_config(DEBUG, [jsonl, "--logging.peak_tflops=0.1", *overrides])
    process = train.Process(rank, 2, rank, 2, torch.device("cpu"))
    return metrics.MetricsLogger(
        cfg, process, cfg.model_config, start_step=start_step, run_dir=tmp_path / "run_0001"
    )


def test_the_logged_loss_is_the_mean_per_target_token_since_the_last_logged_step(tmp_path):
    logger = logger_at(tmp_path, 0, 0)
    logger.add_loss(2.0, target_tokens=100)
    logger.add_loss(4.0, target_tokens=300)
    logger.log_train(2, lr=1e-3, grad_norm=0.5, routing={})
    logger.add_loss(1.0, target_tokens=50)  # a new interval: nothing of the last one is left
    logger.log_train(3, lr=1e-3, grad_norm=0.5, routing={})
    losses = [record["loss"] for record in records(tmp_path)]
    # 3.5: not 3.0 (unweighted) or 4.0 (the logged step's own)
    assert losses == [pytest.approx((2.0 * 100 + 4.0 * 300) / 400), 1.0]
    assert logger.summary["first_loss"] == pytest.approx(3.5) and logger.summary["loss"] == 1.0


class FakeTrackers:
    """Stand-ins for torch.utils.tensorboard and wandb, recording every call in `calls`: the wiring
    is tested with neither package installed."""

    def __init__(self):
        self.calls = []
        fake = self

        class SummaryWriter:
            def __init__(self, log_dir, purge_step=None):
                fake.calls.append(("open", log_dir, purge_step))

            def add_scalar(self, name, value, step):
                fake.calls.append(("scalar", step, name, value))

            def flush(self):
                fake.calls.append(("flush",))

            def close(self):
                fake.calls.append(("close",))

        class WandbRun:
            def log(self, scalars, step):
                fake.calls.append(("wandb log", step, scalars))

            def finish(self):
                fake.calls.append(("wandb finish",))

        self.tensorboard = SimpleNamespace(SummaryWriter=SummaryWriter)

        def init(**settings):
            fake.calls.append(("wandb init", settings))
            return WandbRun()

        self.wandb = SimpleNamespace(init=init)

    def scalars(self, step: int) -> dict[str, float]:
        """TensorBoard's scalars at `step`."""
        return {
            name: value
            for kind, *rest in self.calls
            if kind == "scalar"
            for at, name, value in [rest]
            if at == step
        }


@pytest.fixture
def fake_trackers(monkeypatch) -> FakeTrackers:
    from importlib.machinery import ModuleSpec

    fake = FakeTrackers()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake.tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", fake.wandb)
    for name in (
        "tensorboard",
        "wandb",
    ):  # what config.py asks importlib for, before anything trains
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, SimpleNamespace()))
        monkeypatch.setattr(sys.modules[name], "__spec__", ModuleSpec(name, None), raising=False)
    return fake


TRACKERS = [
    "--logging.tensorboard=true",
    '--logging.wandb={project = "flint-test", mode = "offline"}',
]


def test_the_trackers_get_each_records_scalars_from_rank_0_flushed_at_each_logged_step(
    tmp_path, fake_trackers
):
    routing = {"2": {"max_load": 1.5, "min_load": 0.5, "tokens": [3, 1], "bias": [0.1, -0.1]}}
    for rank in (1, 0):
        logger = logger_at(tmp_path, rank, 0, *TRACKERS)
        logger.add_loss(3.0, target_tokens=10)
        logger.log_train(1, lr=1e-3, grad_norm=0.5, routing=routing)
        logger.log_eval(1, val_loss=2.75)
        logger.add_loss(2.0, target_tokens=10)
        logger.log_train(2, lr=2e-3, grad_norm=0.25, routing=routing)
        logger.close()
    calls, run_dir = fake_trackers.calls, tmp_path / "run_0001"
    assert calls[0] == ("open", str(run_dir / "tensorboard"), 1)  # rank 1 opened nothing
    assert [call for call in calls if call[0] == "open"] == [calls[0]]
    step_1 = fake_trackers.scalars(1)
    assert set(step_1) == {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu_percent",
        "perf/memory_gib",
        "experts/layer 2/max_load",
        "experts/layer 2/min_load",
        "val/loss",
    }
    assert (
        step_1["train/loss"],
        step_1["train/lr"],
        step_1["train/grad_norm"],
        step_1["val/loss"],
    ) == (3.0, 1e-3, 0.5, 2.75)
    assert (step_1["experts/layer 2/max_load"], step_1["experts/layer 2/min_load"]) == (1.5, 0.5)
    assert (
        fake_trackers.scalars(2)["train/loss"] == 2.0
        and fake_trackers.scalars(2)["train/lr"] == 2e-3
    )
    kinds = [call[0] for call in calls if call[0] in ("scalar", "flush", "close")]
    groups = "".join("s" if kind == "scalar" else kind[0] for kind in kinds)
    assert (
        groups == "s" * 8 + "f" + "s" + "f" + "s" * 8 + "f" + "c"
    )  # train, validation, train: each flushed
    (init,) = [call[1] for call in calls if call[0] == "wandb init"]
    assert (
        init["project"] == "flint-test"
        and init["mode"] == "offline"
        and init["dir"] == str(run_dir)
    )
    assert init["id"] == (run_dir / metrics.WANDB_ID_FILE).read_text() and init["resume"] == "allow"
    assert init["config"]["logging"]["wandb"]["project"] == "flint-test"
    logged = [(call[1], call[2]) for call in calls if call[0] == "wandb log"]
    assert [step for step, _ in logged] == [1, 1, 2] and logged[1][1] == {"val/loss": 2.75}
    assert {name: value for name, value in step_1.items() if name != "val/loss"} == logged[0][1]
    assert calls[-1] == ("wandb finish",)


def test_a_resumed_run_continues_the_same_tensorboard_directory_and_wandb_run(
    tmp_path, fake_trackers
):
    logger_at(tmp_path, 0, 0, *TRACKERS).close()
    logger_at(tmp_path, 0, 4, *TRACKERS).close()  # resumed from its step-4 checkpoint
    opened = [call for call in fake_trackers.calls if call[0] == "open"]
    tensorboard = str(tmp_path / "run_0001" / "tensorboard")
    assert opened == [
        ("open", tensorboard, 1),
        ("open", tensorboard, 5),
    ]  # steps from 5 on are trained again
    inits = [call[1] for call in fake_trackers.calls if call[0] == "wandb init"]
    run_id = (tmp_path / "run_0001" / metrics.WANDB_ID_FILE).read_text()
    assert [init["id"] for init in inits] == [run_id, run_id] and len(
        run_id
    ) == 16  # not a second id


@pytest.mark.slow
def test_train_logs_the_interval_mean_to_the_trackers_and_closes_them(
    tmp_path, fake_trackers, monkeypatch
):
    """A run of 4 steps logged every 3: step 3's loss is steps 2 and 3's mean per target token,
    counted here from the batches themselves; the trackers get each record and are closed."""
    batches, steps = [], []
    next_batch = train.PackedLoader.next_batch
    monkeypatch.setattr(
        train.PackedLoader,
        "next_batch",
        lambda self: batches.append((self, next_batch(self))) or batches[-1][1],
    )
    check_loss = train.check_loss
    monkeypatch.setattr(
        train, "check_loss", lambda loss, *args: steps.append(loss) or check_loss(loss, *args)
    )
    corpus = (
        tmp_path / "short_documents.jsonl"
    )  # documents of 7 to 97 bytes: rows hold uneven targets
    corpus.write_text(
        "".join(json.dumps({"text": "flint " * (1 + n % 16)}) + "\n" for n in range(300))
    )
    run_debug(
        tmp_path,
        "--training.steps=4",
        "--logging.every=3",
        "--training.sample_tokens=0",
        "--training.grad_accum=1",
        f"--data.path={corpus}",
        *TRACKERS,
    )
    loader = batches[0][0]  # the training data's: validation reads its own after step 4
    targets = [
        int((batch["targets"] != -100).sum()) for read_by, batch in batches if read_by is loader
    ]
    assert len(targets) == 4
    assert len(set(targets)) > 1  # the weights matter: the steps' target counts differ
    logged = train_losses(tmp_path)
    assert logged[3] == pytest.approx(
        (steps[1] * targets[1] + steps[2] * targets[2]) / (targets[1] + targets[2])
    )
    assert logged[1] == pytest.approx(steps[0]) and logged[4] == pytest.approx(steps[3])
    assert {step: fake_trackers.scalars(step)["train/loss"] for step in logged} == logged
    assert fake_trackers.calls[-2:] == [("close",), ("wandb finish",)]


# ------------------------------------------------------------ the real TensorBoard and W&B

# tests/hf_venv.py's reference venv (REQUIREMENTS: tensorboard and wandb too), with main's torch.
REFERENCE_VENV = Path(os.environ.get("FLINT_HF_VENV", Path.home() / ".cache" / "flint" / "hfvenv"))
REFERENCE_PYTHON = REFERENCE_VENV / "bin" / "python"

# Run by the reference venv's python on a run directory: prints TensorBoard's scalars (tag ->
# [[step, value]]) as EventAccumulator reads them, and each W&B offline run file's run id and
# history rows, read as W&B's own LevelDB-style log (7-byte header, 32 KiB blocks of records:
# crc, length, type, data).
READ_BACK = """
import json, struct, sys
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2
run_dir = Path(sys.argv[1])
events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
events.Reload()
tags = events.Tags()["scalars"]
tensorboard = {tag: [[e.step, e.value] for e in events.Scalars(tag)] for tag in tags}
runs = []
for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
    data, pos, pending, run = path.read_bytes(), 7, b"", {"rows": []}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending, what = b"", record.WhichOneof("record_type")
            if what == "run":
                run["id"] = record.run.run_id
            if what == "history":
                items = record.history.item  # a name with "/" is kept as its parts
                run["rows"].append({item.key or "/".join(item.nested_key):
                                    json.loads(item.value_json) for item in items})
    runs.append(run)
print(json.dumps({"tensorboard": tensorboard, "wandb": runs}))
"""


def reference_python() -> str:
    """The reference venv's python, where tensorboard and wandb import; else the test is skipped."""
    imports = [str(REFERENCE_PYTHON), "-c", "import tensorboard, wandb"]
    if not REFERENCE_PYTHON.exists() or subprocess.run(imports, capture_output=True).returncode:
        pytest.skip(
            f"tensorboard and wandb do not import in {REFERENCE_PYTHON} (tests/hf_venv.py's "
            f"REQUIREMENTS list them: pip install them there)"
        )
    return str(REFERENCE_PYTHON)


@pytest.mark.slow
def test_real_tensorboard_and_wandb_offline_read_back_the_records_and_a_resume_continues_them(
    tmp_path,
):
    """train.py in the reference venv: 4 steps, then the step-4 checkpoint lost (as if the run had
    stopped after logging step 4, before saving it) and the run resumed from step 2. TensorBoard
    holds each step once, with the records' values; W&B's two offline files are one run."""
    python = reference_python()
    args = debug_args(
        tmp_path,
        "--training.steps=4",
        "--logging.every=1",
        "--checkpoint.every=2",
        "--training.sample_tokens=0",
        "--checkpoint.resume=auto",
        *TRACKERS,
    )
    train_py = [python, str(ROOT / "train.py"), *args]
    subprocess.run(train_py, cwd=tmp_path, check=True, capture_output=True, timeout=600)
    run_dir = tmp_path / "ckpt" / "run_0001"
    shutil.rmtree(run_dir / "step_00000004")
    resumed = subprocess.run(
        train_py, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=600
    )
    assert "training steps 3..4" in resumed.stdout
    read = subprocess.run(
        [python, "-c", READ_BACK, str(run_dir)], check=True, capture_output=True, text=True
    )
    tensorboard, wandb_runs = json.loads(read.stdout).values()
    losses = train_losses(
        tmp_path
    )  # the records: one per step, the resumed run's for steps 3 and 4
    (val,) = [(r["step"], r["val_loss"]) for r in records(tmp_path) if "val_loss" in r]
    assert [step for step, _ in tensorboard["train/loss"]] == [1, 2, 3, 4]  # 3 and 4 not twice
    assert [value for _, value in tensorboard["train/loss"]] == pytest.approx(
        list(losses.values()), rel=1e-6
    )
    assert tensorboard["val/loss"] == [[val[0], pytest.approx(val[1], rel=1e-6)]]
    assert {
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu_percent",
        "perf/memory_gib",
        "experts/layer 2/max_load",
        "experts/layer 3/min_load",
    } <= set(tensorboard)
    run_id = (run_dir / metrics.WANDB_ID_FILE).read_text()
    assert [run["id"] for run in wandb_runs] == [run_id, run_id]
    steps = [[row["_step"] for row in run["rows"]] for run in wandb_runs]
    assert steps == [[1, 2, 3, 4], [3, 4]]
    last = wandb_runs[1]["rows"]
    assert [row["train/loss"] for row in last] == pytest.approx([losses[3], losses[4]], rel=1e-12)
    assert last[-1]["val/loss"] == pytest.approx(val[1], rel=1e-12) and val[0] == 4


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "--logging.tensorboard=true",
            "[logging].tensorboard = true needs the tensorboard package, which flint "
            "does not require: pip install tensorboard",
        ),
        (
            '--logging.wandb={project = "p"}',
            "[logging].wandb needs the wandb package, which flint does not "
            "require: pip install wandb",
        ),
        (
            '--logging.wandb={name = "a"}',
            '[logging].wandb needs a project, e.g. wandb = {project = "flint"}',
        ),
        (
            '--logging.wandb={project = "p", mode = "disabled"}',
            '[logging].wandb.mode must be "online" or "offline", got \'disabled\'',
        ),
        (
            '--logging.wandb={project = "p", group = "g"}',
            "[logging].wandb.group = 'g': the keys are text values of project, name, entity, "
            "mode, dir",
        ),
        ("--logging.wandb=true", "[logging].wandb must be dict, got bool True"),
    ],
)
def test_trackers_asked_for_without_their_package_or_set_wrong_stop_at_load(
    override, said, monkeypatch
):
    """One line naming the key and the pip command, at load: before any process group or model."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name in ("tensorboard", "wandb") else find_spec(name, *args),
    )
    with pytest.raises(train.ConfigError) as stop:
        train.load_config(DEBUG, [override])
    assert str(stop.value) == f"command line --logging.{override[10:].split('=')[0]}: {said}"


def test_trackers_load_when_their_packages_import_and_the_settings_are_whole(fake_trackers):
    cfg = train.load_config(
        DEBUG,
        [
            "--logging.tensorboard=true",
            '--logging.wandb={project = "p", name = "n", '
            'entity = "e", mode = "offline", dir = "d"}',
        ],
    )
    assert cfg.logging.tensorboard and cfg.logging.wandb == {
        "project": "p",
        "name": "n",
        "entity": "e",
        "mode": "offline",
        "dir": "d",
    }
    assert (
        not train.load_config(DEBUG).logging.tensorboard
        and train.load_config(DEBUG).logging.wandb == {}
    )
