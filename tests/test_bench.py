"""tools/bench.py: it runs end to end, reads its config as train.py does, prints each row as it
finishes, and stops on a bad flag with one line naming it. Speed is never asserted."""

import io
import json
import math
import re
import statistics
import subprocess
import sys

import pytest
import torch

import metrics
import tools.bench as bench
from config import ConfigError
from helpers import FAMILY_NAMES, ROOT, only, stops_with_one_line
from registry import family
from tools.profiling import OPTIMIZER, SPLIT_ORDER

# Flint's rows and its baselines (tools/flint_baselines.py): plain eager, the transformers
# reference, one layer.
FLINT = only("flint")


class FlushedOutput(io.StringIO):
    """stdout that keeps what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.at_flush: list[str] = []

    def flush(self) -> None:
        self.at_flush.append(self.getvalue())


@pytest.mark.slow
@FLINT
def test_quick_run_writes_wellformed_json(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "CPU_PEAK_CACHE", tmp_path / "cpu_peak.json")
    # the peak MFU divides by, measured once
    monkeypatch.setattr(metrics, "measure_cpu_flops", lambda: 2e11)
    stdout = FlushedOutput()
    monkeypatch.setattr(sys, "stdout", stdout)
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--json", str(out), "--model.num_hidden_layers=3"])
    result = json.loads(out.read_text())
    assert not list(tmp_path.glob("*.tmp")), "the temporary JSON was not renamed into place"

    # The compared rows are all warmed up before any is timed; a row timed on its own is on the
    # screen as soon as it finishes: at some flush, the first variant is complete and the next has
    # not started.
    text = stdout.getvalue()
    assert (
        text.index("warming up plain eager baseline")
        < text.index("timing 1 rotation(s)")
        < text.index("\npreset tiny ")
    )
    # labelled with the config
    assert re.search(r"\npreset tiny +flint \(eager\) +[\d.]+ +\d+ ", text)
    first_done = next(
        text for text in stdout.at_flush if re.search(r"sdpa \(forward only\) +[\d.]+ +\d+ ", text)
    )
    assert "attention flex" not in first_done
    assert result["peak_flops"] == 2e11 and "measured once" in result["peak_source"]

    rows = {row["name"]: row for row in result["rows"]}
    assert {"flint (eager)", "plain eager baseline", "attention flex (forward only)"} <= set(rows)
    if "transformers reference" in rows and rows["transformers reference"].get(
        "error", ""
    ).startswith("skipped"):
        del rows["transformers reference"]  # optional: transformers is not a dependency
    for row in rows.values():
        assert "error" not in row, row
        for key in ("step_s", "tokens_per_s", "mfu", "peak_memory_gib"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert len(row["step_s_all"]) == result["reps"] == 1
    assert (
        rows["flint (eager)"]["label"] == "preset tiny"
        and rows["experts loop"]["label"] == "variant"
    )
    assert rows["flint (eager)"]["mfu"] == pytest.approx(
        rows["flint (eager)"]["tokens_per_s"] * rows["flint (eager)"]["flops_per_token"] / 2e11
    )

    # The override reached the model: 3 layers, and the FLOPs of 3 layers.
    flint = family("flint")
    config = flint.config.from_hf_config(result["hf_config"])
    assert config.hidden_size == 64 and config.num_hidden_layers == 3  # the tiny preset, overridden
    with torch.device("meta"):
        assert rows["flint (eager)"]["flops_per_token"] == flint.model(config).flops_per_token(64)

    split = rows["flint (eager)"]["split"]
    assert list(split) == SPLIT_ORDER
    assert all(fraction >= 0 for fraction in split.values())
    assert sum(split.values()) == pytest.approx(1.0)
    # Every timed module ran inside the profiled step, so each got some of its time.
    for category in ("attention core", "routed experts", "router", "head + loss", OPTIMIZER):
        assert split[category] > 0, category

    sweep = result["sweep"]
    assert {point["layer"] for point in sweep} == {"sliding_attention", "full_attention"}
    assert all(point["ms"] > 0 for point in sweep)
    assert result["flops_per_token"] > 0


@FLINT
def test_the_configs_own_step_compiles_and_checkpoints_as_its_parallel_section_says(monkeypatch):
    """--parallel.compile=true makes the config's own row the compiled one (compiling itself is
    tests/test_compile.py's; here it is recorded, not run), and activation checkpointing reaches
    it."""
    compiled, checkpointed = [], []
    monkeypatch.setattr(bench, "apply_compile", lambda model: compiled.append(type(model).__name__))
    original = bench.apply_activation_checkpointing
    monkeypatch.setattr(
        bench,
        "apply_activation_checkpointing",
        lambda model, mode: checkpointed.append(mode) or original(model, mode),
    )
    result = bench.main(
        [
            "--quick",
            "--sections",
            "main",
            "--parallel.compile=true",
            "--logging.peak_tflops=1",
            "--parallel.activation_checkpointing=full",
            "--optim.grad_clip=0.5",
        ]
    )
    (row,) = result["rows"]
    assert (row["label"], row["name"]) == (
        "preset tiny",
        "flint (compiled per block)",
    ) and "error" not in row
    assert (
        compiled == ["Flint"] and checkpointed == ["full"] and "checkpointing full" in row["note"]
    )
    assert result["peak_flops"] == 1e12
    assert "split" not in row  # its profiler hooks inside compiled blocks would break fullgraph


@pytest.mark.slow
@FLINT  # Large 4's 8 distinct blocks take a minute to trace: tests/test_compile.py's slow test
def test_the_compiled_row_counts_the_graphs_it_really_compiled(monkeypatch):
    """Compiled for real (aot_eager: dynamo's graphs and the backward, without code generation):
    one graph per distinct block and the head, and no graph break, as fullgraph=True demands."""
    from functools import partial

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))
    result = bench.main(
        ["--quick", "--sections", "main", "--parallel.compile=true", "--logging.peak_tflops=1"]
    )
    (row,) = result["rows"]
    assert "error" not in row and row["graphs"] >= 2 and row["graph_breaks"] == 0


@pytest.mark.slow
@only("large4")
def test_mistral_large4_is_timed_like_flint():
    """A Large 4 config gets its own row with tokens/s and MFU from MistralLarge4.flops_per_token;
    the comparisons written for Flint (plain baseline, transformers reference, sweep) say they are
    skipped."""
    large4 = family("large4")
    result = bench.main(
        [
            "--config",
            "configs/large4-smoke.toml",
            "--quick",
            "--sections",
            "main,baseline,sweep",
            "--logging.peak_tflops=1",
        ]
    )
    own, baseline = result["rows"]
    assert (own["label"], own["name"], result["family"]) == (
        "config large4-smoke.toml",
        "large4 (eager)",
        "large4",
    )
    config = large4.config.from_hf_config(result["hf_config"])
    with torch.device("meta"):
        assert own["flops_per_token"] == large4.model(config).flops_per_token(64) > 0
    assert own["mfu"] == pytest.approx(own["tokens_per_s"] * own["flops_per_token"] / 1e12)
    assert own["split"]["latent attention (Large 4: projections + core)"] > 0
    assert baseline["error"].startswith("skipped: Large4Config's family has no plain_eager_loss")
    assert result["sweep"] == []


TINY = [
    "--preset",
    "tiny",
    "--batch",
    "2",
    "--seq-len",
    "32",
    "--threads",
    "1",
    "--matmul-size",
    "64",
    "--warmup",
    "1",
    "--logging.peak_tflops=1",
]


@pytest.mark.slow
@FLINT
def test_the_compared_rows_are_timed_in_rotation(monkeypatch, tmp_path):
    """main, compiled, baseline and reference are warmed up in turn, then timed one step of each in
    turn (e0 c0 b0 r0 e1 c1 b1 r1 ...); each ratio comes from the steps of its own two rows."""
    import tools.flint_baselines as flint_baselines
    from tools.flint_baselines import plain_eager_loss

    compiled_models, calls = [], []
    # recorded, not compiled: order only
    monkeypatch.setattr(bench, "apply_compile", compiled_models.append)

    # stands for transformers' model, which may be absent
    def reference_loss(model, input_ids, targets):
        return model(input_ids, targets)

    monkeypatch.setattr(flint_baselines, "transformers_reference", lambda model: model)
    monkeypatch.setattr(flint_baselines, "transformers_loss", reference_loss)
    original = bench.training_step

    def recorded_step(model, input_ids, targets, loss_fn, optim):
        step = original(model, input_ids, targets, loss_fn, optim)
        tag = {plain_eager_loss: "b", reference_loss: "r"}.get(loss_fn) or "ec"[
            model in compiled_models
        ]
        return lambda: calls.append(tag) or step()

    monkeypatch.setattr(bench, "training_step", recorded_step)
    out = tmp_path / "bench.json"
    bench.main(
        TINY + ["--sections", "main,compiled,baseline,reference", "--reps", "3", "--json", str(out)]
    )

    # warm-ups, rotations, the main row's profiled step
    assert "".join(calls) == "ecbr" + "ecbr" * 3 + "e"
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["rows"]}
    assert (
        result["alternated"]
        == [
            "flint (eager)",
            "flint (compiled per block)",
            "plain eager baseline",
            "transformers reference",
        ]
        == list(rows)
    )
    for row in rows.values():
        assert len(row["step_s_all"]) == len(row["matmul_flops_all"]) == 3
        assert row["step_s"] == statistics.median(row["step_s_all"])
    assert [(r["row"], r["vs"]) for r in result["ratios"]] == [
        ("flint (eager)", "plain eager baseline"),
        ("flint (compiled per block)", "plain eager baseline"),
        ("flint (eager)", "transformers reference"),
        ("flint (compiled per block)", "flint (eager)"),
    ]
    ratio = result["ratios"][3]
    eager, compiled = (
        rows["flint (eager)"]["step_s_all"],
        rows["flint (compiled per block)"]["step_s_all"],
    )
    assert ratio["of_medians"] == pytest.approx(
        statistics.median(eager) / statistics.median(compiled)
    )
    assert ratio["per_rotation"] == pytest.approx([e / c for e, c in zip(eager, compiled)])
    assert ratio["median_per_rotation"] == pytest.approx(statistics.median(ratio["per_rotation"]))


@pytest.mark.slow
@FLINT
def test_a_row_that_cannot_run_sits_out_of_the_rotation(monkeypatch):
    """transformers missing: the reference is skipped and the others alternate without it; a row
    whose step fails mid-rotation keeps its error, and the rows after it go on."""
    import tools.flint_baselines as flint_baselines

    def missing(model):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(flint_baselines, "transformers_reference", missing)
    result = bench.main(TINY + ["--sections", "main,baseline,reference", "--reps", "2"])
    eager, baseline, reference = result["rows"]
    assert (
        reference["error"] == "skipped: No module named 'transformers'"
        and "step_s_all" not in reference
    )
    assert len(eager["step_s_all"]) == len(baseline["step_s_all"]) == 2
    assert result["alternated"] == ["flint (eager)", "plain eager baseline"]
    assert [(r["row"], r["vs"]) for r in result["ratios"]] == [
        ("flint (eager)", "plain eager baseline")
    ]

    calls = []

    def failing_second_time():
        calls.append("f")
        if calls.count("f") == 2:
            raise RuntimeError("out of memory\nmore detail")

    rows = [
        bench.Prepared({"name": name}, call=call)
        for name, call in (
            ("a", lambda: calls.append("a")),
            ("f", failing_second_time),
            ("z", lambda: calls.append("z")),
        )
    ]
    rows.append(bench.Prepared({"name": "skipped", "error": "skipped: absent"}))
    bench.alternate(rows, 3, torch.device("cpu"), rate=lambda: calls.append("|") or 1.0)
    assert "".join(calls) == "|afz|afz|az"
    assert (
        rows[1].row["error"] == "RuntimeError: out of memory"
        and len(rows[1].row["step_s_all"]) == 1
    )
    assert rows[1].call is None  # let go of, so that its memory serves the others
    assert [len(prepared.row["step_s_all"]) for prepared in (rows[0], rows[2])] == [3, 3]
    assert "step_s_all" not in rows[3].row


@FLINT  # configs/smoke.toml
def test_a_training_config_is_read_as_train_py_reads_it():
    args = bench.parse_args(
        ["--config", "configs/smoke.toml", "--batch", "3", "--model.num_experts=4"]
    )
    cfg = bench.load_bench_config(args)
    # smoke.toml, overridden
    assert (cfg.model_config.hidden_size, cfg.model_config.num_experts) == (128, 4)
    assert (cfg.training.batch_size, cfg.data.seq_len, cfg.optim.lr) == (3, 256, 3e-3)
    assert bench.source_label(args, cfg) == "config smoke.toml"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_family_has_a_default_shape_that_loads(name):
    """bench.py with no model named times the family's bench preset (a --model.family override picks
    the family whose presets are the defaults), at 4 x 512 tokens: a config train.py would
    accept."""
    cfg = bench.load_bench_config(bench.parse_args([f"--model.family={name}"]))
    assert cfg.model_config.family == name
    assert cfg.model.preset == (family(name).bench_preset or family(name).smallest_preset)
    assert (cfg.training.batch_size, cfg.data.seq_len) == (4, 512)


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ["--preset", "huge"],
            r"^command line --preset: \[model\]: unknown model preset 'huge'",
            marks=FLINT,
        ),
        (
            ["--config", "/nowhere/checkpoint"],
            r"^command line --config: \[model\].hf_config "
            r"/nowhere/checkpoint does not",
        ),
        (
            ["--model.init_from=/nowhere"],
            r"^command line --model.init_from: \[model\].init_from "
            r"/nowhere does not exist",
        ),
        pytest.param(
            ["--config", "configs/flint-8gpu.toml"],
            r"^configs/flint-8gpu.toml: bench.py "
            r"times one process .* "
            r"ep \* cp = 1 \* 1 \* 2 \* 4 \* 1 must equal the world size 1",
            marks=FLINT,
        ),
        (
            ["--parallel.dp_shard=2"],
            r"^command line --parallel.dp_shard: bench.py times one process",
        ),
        pytest.param(
            ["--model.num_experts=many"],
            r"^command line --model.num_experts: "
            r"\[model\].num_experts must be int",
            marks=FLINT,
        ),
        (
            ["--model.hidden_sise=8"],
            r"^command line --model.hidden_sise: unknown key "
            r"\[model\].hidden_sise",
        ),
        (["--reeps", "3"], r"^command line: expected --section.key=value, got '--reeps'"),
        (["--batch", "0"], r"^command line --batch: \[training\].batch_size must be >= 1, got 0"),
        (["--sections", "main,warp"], r"^--sections: unknown section 'warp'"),
        (
            ["--rounds", "2"],
            r"^--rounds was removed: the compared rows .* alternate step by step; "
            r"--reps sets",
        ),
        (["--warmup", "0"], r"^--warmup must be >= 1, got 0"),
    ],
)
def test_command_line_errors_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message) as error:
        bench.main(argv)
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_status_1():
    result = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--device", "cuda"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        "error: command line --device: device cuda, but no GPU is available "
        "here; "
        "use --device cpu\n"
    )


@pytest.mark.parametrize(
    "argv, kind, named, pattern",
    [
        (["--sweep-lengths", "512,0"], SystemExit, "--sweep-lengths", r"must be >= 1, got 0$"),
        (["--sweep-lengths", "512,-64"], SystemExit, "--sweep-lengths", r"must be >= 1, got -64$"),
        (
            ["--sweep-lengths", "512,long"],
            SystemExit,
            "--sweep-lengths",
            r"expected an integer >= 1, got 'long'",
        ),
        (["--profile", "-1"], SystemExit, "--profile", r"must be >= 0, got -1$"),
        (["--batch", "four"], SystemExit, "--batch", r"invalid int value: 'four'"),
        (["--dtype", "float16"], SystemExit, "--dtype", r"invalid choice: 'float16'"),
        (["--seq-len", "0"], ConfigError, "--seq-len", r"\[data\].seq_len must be in \[1, "),
        (["--device", "gpu"], ConfigError, "--device", r"must be auto, cpu or cuda, got 'gpu'"),
        (["--json", "{tmp}"], ConfigError, "--json {tmp}", r"is a directory, expected a file name"),
        (
            ["--json", "{tmp}/missing/out.json"],
            ConfigError,
            "--json {tmp}/missing/out.json",
            r"its directory .*missing does not exist",
        ),
    ],
)
def test_flags_and_paths_are_refused_in_one_line_before_any_timing(
    tmp_path, monkeypatch, argv, kind, named, pattern
):
    monkeypatch.setattr(bench, "run", lambda *args: pytest.fail("timed despite a bad flag"))
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    stops_with_one_line(lambda: bench.main(argv), kind, named.format(tmp=tmp_path), pattern)


def test_the_smallest_accepted_sweep_length_and_profile_are_kept(tmp_path):
    args = bench.parse_args(
        ["--sweep-lengths", "1,64", "--profile", "0", "--json", str(tmp_path / "out.json")]
    )
    assert (args.sweep_lengths, args.profile, args.json) == ([1, 64], 0, tmp_path / "out.json")
