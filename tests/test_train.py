"""train.py end to end on the CPU: learning, exact resume, checkpoints, errors, schedule,
optimizer."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import convert
import train
from config import ConfigError, OptimSection
from data import EMBEDDED_CORPUS, DataError
from helpers import (
    DEFAULT_FAMILY,
    FIRST_FAMILY_THEN_SECOND_TIER,
    FIRST_FAMILY_THEN_SLOW,
    ROOT,
    adamw_matches_plain,
    closing,
    debug_args,
    debug_configs,
    exported_tensors,
    moe_layers,
    only,
    records,
    run_debug,
    run_two_processes,
    step_host_syncs,
    train_losses,
)
from registry import config_from_hf, family
from train import TrainingError

pytestmark = pytest.mark.usefixtures("one_thread")


def run_debug_two_processes(tmp_path: Path, *overrides: str) -> None:
    run_two_processes(debug_args(tmp_path, *overrides))


def debug_schedule(step: int) -> float:
    """configs/debug.toml's learning rate at step 1..20, written out: 2 warmup steps to 3e-3, then a
    cosine to 3e-4 over the remaining 18."""
    if step <= 2:
        return 3e-3 * step / 2
    return 3e-4 + (3e-3 - 3e-4) * (1 + math.cos(math.pi * (step - 2) / 18)) / 2


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_debug_config_trains_and_reports(tmp_path, capsys, family):
    summary = run_debug(tmp_path, "--training.eval_every=10", family=family)
    losses = train_losses(tmp_path)
    assert sorted(losses) == [1, 5, 10, 15, 20]  # the first step is always logged
    # untrained: uniform over the vocabulary
    assert losses[1] == pytest.approx(math.log(264), abs=0.1)
    assert losses[20] < losses[1] - 1.5
    record = records(tmp_path)[-2]
    for key in (
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu_percent",
        "memory_gib",
        "elapsed_s",
        "remaining_s",
    ):
        assert record[key] > 0 or key == "remaining_s"
    config = config_from_hf(tmp_path / "ckpt" / "run_0001" / "step_00000020")
    # Flint's 4-layer tiny: {"2", "3"}; Large 4's: 1-7
    assert set(record["routing"]) == set(moe_layers(config))
    assert all(v["max_load"] >= 1 >= v["min_load"] >= 0 for v in record["routing"].values())
    # Every expert's tokens of the step's last micro-batch: 4 x 64 tokens, each routed to 2 of E
    # experts (Flint's 8, Large 4's 4).
    assert all(
        len(v["tokens"]) == config.num_experts and sum(v["tokens"]) == 4 * 64 * 2
        for v in record["routing"].values()
    )
    assert [r["step"] for r in records(tmp_path) if "val_loss" in r] == [10, 20]
    logged_lr = {r["step"]: r["lr"] for r in records(tmp_path) if "loss" in r}
    assert logged_lr == pytest.approx({step: debug_schedule(step) for step in losses}, rel=1e-9)
    out = capsys.readouterr().out
    assert "\r" not in out and "tokens/s" in out and "MFU" in out and "GiB" in out and "left" in out
    assert summary["sample"].startswith("The ") and summary["val_loss"] < losses[1]
    assert (tmp_path / "ckpt" / "run_0001" / "step_00000020" / "config.json").is_file()


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    """Machinery independent of the model (the step's loss check): the first registered family."""
    model = family(DEFAULT_FAMILY).model
    real_forward, calls = model.forward, []

    def nan_on_third_call(self, *args, **kwargs):
        calls.append(1)
        loss = real_forward(self, *args, **kwargs)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(model, "forward", nan_on_third_call)
    with pytest.raises(TrainingError, match=r"step 3: the training loss is nan.*step_00000002"):
        run_debug(tmp_path, "--training.steps=5", "--checkpoint.every=2")
    # the steps logged before it diverged get their report, as a finished run's do
    kept = sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir())
    assert kept == [".lock", "report.html", "run.json", "step_00000002"]


def compile_with_backend_raising(monkeypatch, error: Exception) -> None:
    """torch.compile as train.py calls it, with a backend that fails the way the compiler would."""

    def failing_backend(graph_module, example_inputs):
        raise error

    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": failing_backend}),
    )


@pytest.mark.slow
def test_compile_failure_stops_the_run(tmp_path, monkeypatch):
    compile_with_backend_raising(monkeypatch, RuntimeError("inductor exploded"))
    with pytest.raises(
        TrainingError,
        match=r"(?s)torch.compile of the decoder blocks "
        r"failed.*inductor exploded.*"
        r"compile_fallback = true",
    ):
        run_debug(tmp_path, "--parallel.compile=true", "--training.steps=2")
    # stopped before any work (only the lock file exists)
    assert not list((tmp_path / "ckpt").glob("run_*"))


@pytest.mark.slow
def test_a_compile_failure_of_the_evaluation_graphs_stops_the_run_before_training(
    tmp_path, monkeypatch
):
    """Evaluation (no_grad) compiles graphs of its own: check_compiled compiles them too, so their
    failure stops the run before the first step, not at the first evaluation."""

    def failing_without_grad(graph_module, example_inputs):
        if not torch.is_grad_enabled():
            raise RuntimeError("the no_grad graph exploded")
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": failing_without_grad}),
    )
    with pytest.raises(
        TrainingError,
        match=r"(?s)torch.compile of the decoder blocks "
        r"failed.*no_grad graph exploded",
    ):
        run_debug(tmp_path, "--parallel.compile=true", "--training.steps=2")
    assert not list((tmp_path / "ckpt").glob("run_*"))


@pytest.mark.slow
def test_compile_fallback_only_when_asked(tmp_path, monkeypatch, capsys):
    compile_with_backend_raising(monkeypatch, RuntimeError("inductor exploded"))
    summary = run_debug(
        tmp_path,
        "--parallel.compile=true",
        "--parallel.compile_fallback=true",
        "--training.steps=2",
        "--training.sample_tokens=0",
    )
    assert "WARNING: torch.compile of the decoder blocks failed" in capsys.readouterr().err
    assert summary["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory"),
        torch.distributed.DistBackendError("NCCL communicator was aborted"),
    ],
)
def test_out_of_memory_and_collective_errors_are_never_compile_errors(tmp_path, monkeypatch, error):
    """Even wrapped by the compiler (BackendCompilerFailed) and with the fallback on, they stop the
    run."""
    compile_with_backend_raising(monkeypatch, error)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        run_debug(
            tmp_path,
            "--parallel.compile=true",
            "--parallel.compile_fallback=true",
            "--training.steps=2",
        )
    assert not train.is_compile_error(raised.value) and raised.value.inner_exception is error
    assert not train.is_compile_error(error) and not train.is_compile_error(
        RuntimeError("a bug of ours")
    )


@pytest.mark.slow
def test_data_errors_stop_before_training(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"data.path .*nowhere does not exist\. Put your corpus "
        r"there",
    ):
        # at config time, before a process group
        run_debug(tmp_path, f"--data.path={tmp_path / 'nowhere'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty directory"):
        run_debug(tmp_path, f"--data.path={tmp_path / 'empty'}")
    with pytest.raises(
        DataError,
        match=r"not enough data: training.steps = 100000 .* data.epochs = "
        r"1",
    ):
        run_debug(tmp_path, "--training.steps=100000")
    with pytest.raises(ConfigError, match=r"257 tokens but the model's vocab_size is 256"):
        run_debug(tmp_path, "--model.vocab_size=256")
    assert not list((tmp_path / "ckpt").glob("run_*"))  # stopped before any run began


@pytest.mark.slow
def test_init_from_a_native_checkpoint_loads_its_weights(tmp_path, monkeypatch, capsys):
    source = tmp_path / "trained"
    run_debug(source, "--training.steps=10", "--training.sample_tokens=0")
    checkpoint = source / "ckpt" / "run_0001" / "step_00000010"
    first_loss = train_losses(source)[1]
    # as if the model were too large to sample
    monkeypatch.setattr(train, "SAMPLE_MAX_PARAMS", 100_000)
    summary = run_debug(
        tmp_path, f"--model.init_from={checkpoint}", "--model.preset=", "--training.steps=1"
    )
    # starts where the source run ended, not at ln(V)
    assert train_losses(tmp_path)[1] < first_loss - 1.0
    assert "sample skipped: 0.0B parameters do not fit one process" in capsys.readouterr().out
    assert "sample" not in summary


@pytest.mark.slow
@only("flint")  # Large 4's: tests/test_large4.py, with the extras its export carries
def test_finetune_from_hugging_face_converts_once_and_exports(tmp_path):
    """Two processes (FSDP): rank 0 converts the Hugging Face weights to a native checkpoint in
    checkpoint.dir, both load their shards from it; a later run reuses it. The first losses are
    the source model's on the same rows, and the export holds the trained weights."""
    from flint_model import FlintConfig, build_model

    config = FlintConfig.from_name(
        "tiny", vocab_size=264, num_hidden_layers=4, router_aux_loss_coef=0.0005
    )
    source = build_model(config, seed=7)
    convert.save_hf(source, tmp_path / "hf")
    finetune = [
        f"--model.init_from={tmp_path / 'hf'}",
        "--model.preset=",
        "--training.sample_tokens=0",
        f"--checkpoint.export_hf={tmp_path / 'out'}",
    ]
    run_two_processes(
        debug_args(
            tmp_path, *finetune, "--training.steps=2", "--parallel.dp_shard=2", family="flint"
        )
    )
    converted = list((tmp_path / "ckpt").glob("init_from_hf-*"))
    assert len(converted) == 1 and train.is_native_checkpoint(converted[0])
    written = (converted[0] / ".metadata").stat().st_mtime_ns
    loader = train.setup_data(
        train.load_config(
            debug_configs()["flint"],
            [f"--data.path={EMBEDDED_CORPUS}", f"--data.cache_dir={tmp_path / 'cache'}"],
        ),
        train.Process(0, 1, 0, 1, torch.device("cpu")),
    )[1]
    batches = [loader.next_batch() for _ in range(2)]  # rank 0's rows, then rank 1's
    with torch.no_grad():
        tokens = [(b["targets"] != -100).sum() for b in batches]
        expected = [source(**b).item() for b in batches]
    two_process_loss = sum(loss * n for loss, n in zip(expected, tokens)) / sum(tokens)
    assert train_losses(tmp_path)[1] == pytest.approx(two_process_loss.item(), rel=1e-5)
    exported = convert.load_hf(tmp_path / "out")
    # trained, then exported
    assert not torch.equal(exported.embed_tokens.weight, source.embed_tokens.weight)
    # with the run's tokenizer (the byte one), as AutoTokenizer reads it
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    added = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["added_tokens"]
    assert tokenizer_config["eos_token"] == "<|endoftext|>"
    assert {t["content"]: t["id"] for t in added}["<|endoftext|>"] == 256  # after the 256 bytes

    shutil.rmtree(tmp_path / "out")
    run_debug(tmp_path, *finetune, "--training.steps=1", family="flint")
    assert list((tmp_path / "ckpt").glob("init_from_hf-*")) == converted
    assert (converted[0] / ".metadata").stat().st_mtime_ns == written  # reused, not converted again
    assert train_losses(tmp_path)[1] == pytest.approx(expected[0], rel=1e-5)


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), f"{what}, step {step}"


@pytest.mark.slow  # five runs, three of two processes
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SLOW)
def test_two_processes_match_one_resume_in_one_and_export(tmp_path, family):
    """Global batch of 8 rows: one process with 2 micro-batches of 4, FSDP 2 and EP 2 with 4 rows
    per rank, PP 2 with 2 micro-batches of 4. Micro-batches and ranks hold different numbers of
    target tokens, so only an exact token weighting agrees. The per-step and validation losses
    agree; the FSDP run's checkpoint resumes in one process; its Hugging Face export (written from
    the sharded run) holds the one-process run's tensors. The first family in the suite, the
    others with FLINT_SLOW=1 (five runs, three of two processes)."""
    common = [
        "--training.steps=4",
        "--logging.every=1",
        "--checkpoint.every=2",
        "--training.sample_tokens=0",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    one, fsdp, ep, pp, resumed = (
        tmp_path / name for name in ("one", "fsdp", "ep", "pp", "resumed")
    )
    run_debug(
        one,
        *common,
        "--training.grad_accum=2",
        f"--checkpoint.export_hf={one / 'hf'}",
        family=family,
    )
    expected = train_losses(one)
    assert expected[4] < expected[1]
    # the same 8 validation rows as 2 batches of 4 in one process
    two = [*common, "--training.eval_batches=1"]
    run_two_processes(
        debug_args(
            fsdp,
            *two,
            "--parallel.dp_shard=2",
            f"--checkpoint.export_hf={fsdp / 'hf'}",
            family=family,
        )
    )
    assert_same_losses(train_losses(fsdp), expected, "FSDP 2")
    run_two_processes(
        debug_args(ep, *two, "--parallel.ep=2", "--parallel.dp_shard=1", family=family)
    )
    assert_same_losses(train_losses(ep), expected, "EP 2")
    # One data-parallel rank: the 2 micro-batches of one process, each split in 2 for the 1F1B
    # schedule.
    run_two_processes(
        debug_args(
            pp,
            *common,
            "--parallel.pp=2",
            "--parallel.dp_shard=1",
            "--training.grad_accum=2",
            family=family,
        )
    )
    assert_same_losses(train_losses(pp), expected, "PP 2")
    val_losses = [
        [r["val_loss"] for r in records(path) if "val_loss" in r] for path in (one, fsdp, ep, pp)
    ]
    assert all(other == pytest.approx(val_losses[0], rel=1e-5) for other in val_losses[1:]), (
        val_losses
    )

    run_debug(
        resumed,
        *common,
        "--training.grad_accum=2",
        f"--checkpoint.resume={fsdp / 'ckpt' / 'run_0001' / 'step_00000002'}",
        family=family,
    )
    assert_same_losses(
        train_losses(resumed), {s: expected[s] for s in (3, 4)}, "FSDP 2 checkpoint resumed in 1"
    )

    reference, sharded = exported_tensors(one / "hf"), exported_tensors(fsdp / "hf")
    assert sorted(sharded) == sorted(reference) and len(reference) > 10
    # the frozen indexer too
    assert family != "large4" or any(".indexer." in name for name in reference)
    # Adam divides each gradient by its running RMS: where a gradient is near zero, a last-bit
    # difference from summing over 2 ranks moves a weight by up to ~1e-3 of lr (3e-3) per step, so
    # atol 1e-5 over 4 steps.
    for name, tensor in reference.items():
        torch.testing.assert_close(
            sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )


def test_learning_rate_schedules():
    cosine = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert train.learning_rate(5, cosine, 110) == pytest.approx(0.5)
    assert train.learning_rate(10, cosine, 110) == pytest.approx(1.0)
    assert train.learning_rate(60, cosine, 110) == pytest.approx(0.55)
    assert train.learning_rate(110, cosine, 110) == pytest.approx(0.1)
    wsd = OptimSection(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    assert train.learning_rate(80, wsd, 100) == 1.0
    assert train.learning_rate(90, wsd, 100) == pytest.approx(0.5)
    assert train.learning_rate(100, wsd, 100) == pytest.approx(0.0)


@only("flint")  # a model without frozen parameters
def test_weight_decay_applies_to_matrices_only():
    from flint_model import FlintConfig, build_model

    model = build_model(FlintConfig.from_name("tiny", num_hidden_layers=3), seed=0)
    decayed, plain = train.build_optimizer(model, OptimSection(weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)] for p in plain["params"]} == {
        n for n, p in model.named_parameters() if p.dim() == 1
    }
    assert "layers.2.mlp.experts.gate_up_proj" in {names[id(p)] for p in decayed["params"]}


@only("flint")  # a model without frozen parameters, which plain AdamW would step
def test_the_optimizer_steps_like_plain_adamw():
    from flint_model import FlintConfig, build_model

    config = FlintConfig.from_name("tiny", num_hidden_layers=3)
    adamw_matches_plain(build_model(config, seed=0), build_model(config, seed=0))


@pytest.mark.slow
def test_choices_that_fail_on_the_cpu_stop_before_the_run_starts(tmp_path):
    with pytest.raises(
        ConfigError, match=r"command line --parallel.backend: .*\"nccl\" needs GPUs"
    ):
        run_debug(tmp_path, "--parallel.backend=nccl", "--training.device=cpu")
    with pytest.raises(
        ConfigError,
        match=r"command line --model.attention_backend: .*\"flex\" "
        r"cannot train on the CPU",
    ):
        run_debug(tmp_path, "--model.attention_backend=flex", "--training.device=cpu")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
@only("flint")  # output_router_logits: Flint's published term
def test_load_balancing_loss_trains_the_same_with_activation_checkpointing(tmp_path):
    """The blocks add the balancing term's statistics as they run; recomputing a block in backward
    must give the same loss and updates as keeping its activations."""
    balance = [
        "--model.output_router_logits=true",
        "--model.router_aux_loss_coef=0.1",
        "--training.steps=3",
        "--logging.every=1",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path / "plain", *balance, family="flint")
    run_debug(
        tmp_path / "recompute", *balance, "--parallel.activation_checkpointing=full", family="flint"
    )
    plain, recompute = train_losses(tmp_path / "plain"), train_losses(tmp_path / "recompute")
    assert plain == pytest.approx(recompute, rel=1e-6, abs=1e-6)
    run_debug(
        tmp_path / "none",
        "--training.steps=3",
        "--logging.every=1",
        "--training.sample_tokens=0",
        family="flint",
    )
    cross_entropy = train_losses(tmp_path / "none")
    # near-uniform routing at init: aux ~ k
    assert plain[1] - cross_entropy[1] == pytest.approx(0.1 * 2, abs=0.02)


# ----------------------------------------------------------------------------- host syncs of a step


def test_a_step_copies_to_the_host_once(tmp_path):
    """No sync per micro-batch (the batches' token ids were checked at load): loss, grad norm, the
    update check and the stop request come back in one copy."""
    assert closing(step_host_syncs)(debug_args(tmp_path, "--training.grad_accum=2")) == ["tolist"]


def check_expert_parallel_step_syncs(argv: list[str]) -> None:
    reads = closing(step_host_syncs)(argv)
    # The step's copy, then one per MoE layer (Flint's debug model: 2) per micro-batch (2): none in
    # the recompute, none for repeat_interleave (given its output size).
    layers = len(moe_layers(train.parse_args(argv).model_config))
    assert reads == ["tolist"] * (1 + layers * 2), reads


@pytest.mark.slow
def test_an_expert_parallel_step_copies_once_per_moe_layer_and_micro_batch(tmp_path):
    run_two_processes(
        debug_args(
            tmp_path,
            "--parallel.ep=2",
            "--parallel.dp_shard=1",
            "--training.grad_accum=2",
            "--parallel.activation_checkpointing=full",
            "--data.seq_len=16",
            "--training.batch_size=2",
        ),
        check_expert_parallel_step_syncs,
    )


@pytest.mark.slow
def test_a_finished_run_leaves_no_gloo_thread_and_each_rank_its_profiled_trace(tmp_path):
    """Expert parallel (DTensor experts), FSDP and an async save's own gloo group on 2 ranks: each
    rank's worker finds no gloo thread left after train.main (see _torchrun_worker). The profiled
    step leaves a trace per rank, naming the expert-parallel exchanges and the collectives
    (metrics.py)."""
    run_debug_two_processes(
        tmp_path,
        "--parallel.ep=2",
        "--training.steps=2",
        "--checkpoint.every=2",
        "--checkpoint.async_save=true",
        "--training.sample_tokens=0",
        "--logging.profile_steps=2-2",
    )
    for rank in (0, 1):
        trace = json.loads(
            (tmp_path / "ckpt" / "run_0001" / f"trace_steps2-2_rank{rank}.json").read_text()
        )
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {
            "step 2",
            "all-to-all: rows to their experts",
            "all-to-all: rows back",
            "gloo:all_to_all",
            "gloo:all_reduce",
        } <= names, rank


def _rank_0_prepares_slowly(argv: list[str]) -> None:
    """train.main, with rank 0's data preparation taking a minute longer."""
    if os.environ["RANK"] == "0":
        real_prepare = train.prepare
        train.prepare = lambda *args, **kwargs: (time.sleep(60), real_prepare(*args, **kwargs))
    train.main(argv)


@pytest.mark.slow
def test_no_rank_waits_for_rank_0_longer_than_collective_timeout_minutes(tmp_path):
    """[parallel].collective_timeout_minutes reaches the process group: while rank 0 prepares the
    data for a minute, rank 1 gives up after 6 s with an error naming the key (the default would
    wait)."""
    argv = debug_args(
        tmp_path,
        "--training.steps=1",
        "--training.sample_tokens=0",
        "--parallel.collective_timeout_minutes=0.1",
    )
    start = time.perf_counter()
    with pytest.raises(
        mp.ProcessRaisedException,
        match=r"DataError: rank 1 waited for rank 0 to "
        r"prepare .* longer "
        r"than \[parallel\].collective_timeout_minutes = 0.1 \(command line "
        r"--parallel.collective_timeout_minutes\)",
    ):
        run_two_processes(argv, _rank_0_prepares_slowly)
    assert time.perf_counter() - start < 60


@pytest.mark.slow
def test_runs_under_the_zero_bubble_schedules_evaluate_and_save_their_final_checkpoint(tmp_path):
    """2 pipeline ranks with the default validation split: the final evaluation ran (it crashed
    under the V schedules, before the final save) and the final checkpoint exists, with the same
    validation loss under both schedules."""
    val_losses = []
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        # One launch each, as torchrun would: a second process group in the same two processes, on
        # the same port, hung once (rank 0 still creating its store, rank 1 already past it, for 17
        # minutes).
        run_two_processes(
            debug_args(
                tmp_path / schedule,
                "--parallel.pp=2",
                "--parallel.dp_shard=1",
                "--training.steps=2",
                "--training.sample_tokens=0",
                f"--parallel.pp_schedule={schedule}",
            )
        )
        assert (tmp_path / schedule / "ckpt" / "run_0001" / "step_00000002").is_dir(), schedule
        val_losses += [r["val_loss"] for r in records(tmp_path / schedule) if "val_loss" in r]
    assert len(val_losses) == 2 and math.isclose(*val_losses, rel_tol=1e-6), val_losses


@pytest.mark.slow
def test_under_torchrun_ctrl_c_ends_with_the_resume_command(tmp_path):
    """Ctrl-C reaches torchrun, which passes SIGINT to the ranks: they finish the step, save and
    print the resume command, and then torchrun prints its own 25-line SignalException traceback,
    which buried it. Rank 0 prints the command again once torchrun has exited: the last thing on the
    terminal."""
    argv = debug_args(
        tmp_path,
        "--training.steps=2000",
        "--data.epochs=1000",
        "--training.sample_tokens=0",
        "--logging.every=1",
        "--data.val_fraction=0",
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = subprocess.Popen(
        [str(torchrun), "--nproc-per-node=2", "train.py", *argv],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = []
    for line in launcher.stdout:  # to the end: the repeated command comes after torchrun has exited
        lines.append(line.rstrip("\n"))
        if line.startswith("step    2/"):
            launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) != 0
    output = [line for line in lines if line.strip()]
    assert any("SignalException" in line for line in output), "\n".join(output[-40:])
    assert output[-2].startswith("stopped by SIGINT after step ") and output[-2].endswith(
        "Resume with:"
    ), output[-5:]
    command = output[-1].split()
    assert (
        command[:3] == ["torchrun", "--nproc-per-node=2", "train.py"]
        and command[-1] == "--checkpoint.resume=auto"
    )
    saved = output[-2].split("; saved ")[1].split(". Resume")[0]
    assert Path(saved).is_dir() and Path(saved).parent == tmp_path / "ckpt" / "run_0001"


@pytest.mark.slow
@only("flint")  # configs/smoke.toml and sft-smoke.toml are Flint's
def test_the_first_runs_next_steps_work_as_the_readme_says(tmp_path, capsys):
    """README, After the first run, with the real configs for a few steps: the smoke run's
    checkpoint dir fine-tunes with sft-smoke.toml (init_from takes the dir; preset cleared), its
    selection-biased model is refused for export with the exportable variant named, and that variant
    exports. The model line gives the active count without the embedding (the released Flint's
    "about 2.5B")."""
    from flint_model import FlintConfig

    paths = [
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--logging.peak_tflops=0.1",
        "--training.sample_tokens=0",
        "--training.eval_every=0",
        "--training.steps=2",
    ]
    smoke = [
        "--config",
        str(ROOT / "configs" / "smoke.toml"),
        f"--checkpoint.dir={tmp_path / 'smoke'}",
        f"--logging.jsonl={tmp_path / 'smoke.jsonl'}",
        *paths,
    ]
    train.main(smoke)
    config = FlintConfig.from_name(
        "tiny",
        vocab_size=264,
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    )
    with torch.device("meta"):
        active = train.model_class(config)(config).num_params(active=True)
    embedding = config.vocab_size * config.hidden_size
    assert (
        f"active per token ({(active - embedding) / 1e6:.2f}M without the embedding)"
        in capsys.readouterr().out
    )
    train.main(
        [
            "--config",
            str(ROOT / "configs" / "sft-smoke.toml"),
            "--model.preset=",
            f"--model.init_from={tmp_path / 'smoke'}",
            f"--checkpoint.dir={tmp_path / 'sft'}",
            f"--logging.jsonl={tmp_path / 'sft.jsonl'}",
            *paths,
        ]
    )
    sft_losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "sft.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(sft_losses) == 2 and (tmp_path / "sft" / "run_0001" / "step_00000002").is_dir()
    with pytest.raises(
        ConfigError,
        match=r"router_bias_update_rate = 0 and "
        r"router_sequence_loss_coef > 0: README, "
        r"After the first run",
    ):
        train.main([*smoke, f"--checkpoint.export_hf={tmp_path / 'hf'}"])
    train.main(
        [
            *smoke,
            "--model.router_bias_update_rate=0",
            "--model.router_sequence_loss_coef=0.01",
            f"--checkpoint.export_hf={tmp_path / 'hf'}",
        ]
    )
    assert convert.load_hf(tmp_path / "hf").config.hidden_size == 128
