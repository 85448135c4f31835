"""train.py end to end on the CPU: learning, exact resume, checkpoints, errors, schedule, optimizer."""

import json
import math
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import convert
import train
from config import ConfigError, OptimSection
from data import EMBEDDED_CORPUS, DataError
from model import Flint, FlintConfig, build_model
from parallel import close_distributed
from train import TrainingError
from conftest import assert_weights_match, gloo_threads, debug_args, give_same_gradients, records, run_debug, train_losses

ROOT = Path(__file__).resolve().parent.parent
DEBUG = str(ROOT / "configs" / "debug.toml")


pytestmark = pytest.mark.usefixtures("one_thread")
slow = pytest.mark.skipif(os.environ.get("FLINT_SLOW") != "1", reason="multi-process Large 4 runs: FLINT_SLOW=1")


def _torchrun_worker(rank: int, world: int, port: int, argv: list[str], fn=None) -> None:
    """What torchrun does for one process: the environment, then train.py's main (or fn) on argv."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    (fn or train.main)(argv)
    left = gloo_threads()  # none may outlive the run: see parallel.close_distributed
    assert not left, f"rank {rank}: gloo threads still running after the run: {left}"


def run_two_processes(argv: list[str], fn=None) -> None:
    """train.main(argv), or fn(argv), in 2 processes, as `torchrun --nproc-per-node 2` would start it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torchrun_worker, args=(2, port, argv, fn), nprocs=2)


def run_debug_two_processes(tmp_path: Path, *overrides: str) -> None:
    run_two_processes(debug_args(tmp_path, *overrides))


def debug_schedule(step: int) -> float:
    """configs/debug.toml's learning rate at step 1..20, written out: 2 warmup steps to 3e-3, then a
    cosine to 3e-4 over the remaining 18."""
    if step <= 2:
        return 3e-3 * step / 2
    return 3e-4 + (3e-3 - 3e-4) * (1 + math.cos(math.pi * (step - 2) / 18)) / 2


def test_debug_config_trains_and_reports(tmp_path, capsys):
    summary = run_debug(tmp_path, "--training.eval_every=10")
    losses = train_losses(tmp_path)
    assert sorted(losses) == [1, 5, 10, 15, 20]  # the first step is always logged
    assert losses[1] == pytest.approx(math.log(264), abs=0.1)  # untrained: uniform over the vocabulary
    assert losses[20] < losses[1] - 1.5
    record = records(tmp_path)[-2]
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu_percent", "memory_gib", "elapsed_s", "remaining_s"):
        assert record[key] > 0 or key == "remaining_s"
    assert set(record["routing"]) == {"2", "3"}  # the MoE layers of a 4-layer tiny Flint
    assert all(v["max_load"] >= 1 >= v["min_load"] >= 0 for v in record["routing"].values())
    # Every expert's tokens of the step's last micro-batch: 4 x 64 tokens, each routed to 2 of 8 experts.
    assert all(len(v["tokens"]) == 8 and sum(v["tokens"]) == 4 * 64 * 2 for v in record["routing"].values())
    assert [r["step"] for r in records(tmp_path) if "val_loss" in r] == [10, 20]
    logged_lr = {r["step"]: r["lr"] for r in records(tmp_path) if "loss" in r}
    assert logged_lr == pytest.approx({step: debug_schedule(step) for step in losses}, rel=1e-9)
    out = capsys.readouterr().out
    assert "\r" not in out and "tokens/s" in out and "MFU" in out and "GiB" in out and "left" in out
    assert summary["sample"].startswith("The ") and summary["val_loss"] < losses[1]
    assert (tmp_path / "ckpt" / "run_0001" / "step_00000020" / "config.json").is_file()


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    real_forward, calls = Flint.forward, []

    def nan_on_third_call(self, *args, **kwargs):
        calls.append(1)
        loss = real_forward(self, *args, **kwargs)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(Flint, "forward", nan_on_third_call)
    with pytest.raises(TrainingError, match=r"step 3: the training loss is nan.*step_00000002"):
        run_debug(tmp_path, "--training.steps=5", "--checkpoint.every=2")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [".lock", "step_00000002"]


def compile_with_backend_raising(monkeypatch, error: Exception) -> None:
    """torch.compile as train.py calls it, with a backend that fails the way the compiler would."""
    def failing_backend(graph_module, example_inputs):
        raise error

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": failing_backend}))


def test_compile_failure_stops_the_run(tmp_path, monkeypatch):
    compile_with_backend_raising(monkeypatch, RuntimeError("inductor exploded"))
    with pytest.raises(TrainingError, match=r"(?s)torch.compile of the decoder blocks failed.*inductor exploded.*"
                                            r"compile_fallback = true"):
        run_debug(tmp_path, "--parallel.compile=true", "--training.steps=2")
    assert not list((tmp_path / "ckpt").glob("run_*"))  # stopped before any work (only the lock file exists)


def test_a_compile_failure_of_the_evaluation_graphs_stops_the_run_before_training(tmp_path, monkeypatch):
    """Evaluation (no_grad) compiles graphs of its own: check_compiled compiles them too, so their
    failure stops the run before the first step, not at the first evaluation."""
    def failing_without_grad(graph_module, example_inputs):
        if not torch.is_grad_enabled():
            raise RuntimeError("the no_grad graph exploded")
        return graph_module.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": failing_without_grad}))
    with pytest.raises(TrainingError, match=r"(?s)torch.compile of the decoder blocks failed.*no_grad graph exploded"):
        run_debug(tmp_path, "--parallel.compile=true", "--training.steps=2")
    assert not list((tmp_path / "ckpt").glob("run_*"))


def test_compile_fallback_only_when_asked(tmp_path, monkeypatch, capsys):
    compile_with_backend_raising(monkeypatch, RuntimeError("inductor exploded"))
    summary = run_debug(tmp_path, "--parallel.compile=true", "--parallel.compile_fallback=true",
                        "--training.steps=2", "--training.sample_tokens=0")
    assert "WARNING: torch.compile of the decoder blocks failed" in capsys.readouterr().err
    assert summary["step"] == 2


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   torch.distributed.DistBackendError("NCCL communicator was aborted")])
def test_out_of_memory_and_collective_errors_are_never_compile_errors(tmp_path, monkeypatch, error):
    """Even wrapped by the compiler (BackendCompilerFailed) and with the fallback on, they stop the run."""
    compile_with_backend_raising(monkeypatch, error)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        run_debug(tmp_path, "--parallel.compile=true", "--parallel.compile_fallback=true", "--training.steps=2")
    assert not train.is_compile_error(raised.value) and raised.value.inner_exception is error
    assert not train.is_compile_error(error) and not train.is_compile_error(RuntimeError("a bug of ours"))


def test_data_errors_stop_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path .*nowhere does not exist\. Put your corpus there"):
        run_debug(tmp_path, f"--data.path={tmp_path / 'nowhere'}")  # at config time, before a process group
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty directory"):
        run_debug(tmp_path, f"--data.path={tmp_path / 'empty'}")
    with pytest.raises(DataError, match=r"not enough data: training.steps = 100000 .* data.epochs = 1"):
        run_debug(tmp_path, "--training.steps=100000")
    with pytest.raises(ConfigError, match=r"257 tokens but the model's vocab_size is 256"):
        run_debug(tmp_path, "--model.vocab_size=256")
    assert not list((tmp_path / "ckpt").glob("run_*"))  # stopped before any run began


def test_init_from_a_native_checkpoint_loads_its_weights(tmp_path, monkeypatch, capsys):
    source = tmp_path / "trained"
    run_debug(source, "--training.steps=10", "--training.sample_tokens=0")
    checkpoint = source / "ckpt" / "run_0001" / "step_00000010"
    first_loss = train_losses(source)[1]
    monkeypatch.setattr(train, "SAMPLE_MAX_PARAMS", 100_000)  # as if the model were too large to sample
    summary = run_debug(tmp_path, f"--model.init_from={checkpoint}", "--model.preset=", "--training.steps=1")
    assert train_losses(tmp_path)[1] < first_loss - 1.0  # starts where the source run ended, not at ln(V)
    assert "sample skipped: 0.0B parameters do not fit one process" in capsys.readouterr().out
    assert "sample" not in summary


def test_finetune_from_hugging_face_converts_once_and_exports(tmp_path):
    """Two processes (FSDP): rank 0 converts the Hugging Face weights to a native checkpoint in
    checkpoint.dir, both load their shards from it; a later run reuses it. The first losses are
    the source model's on the same rows, and the export holds the trained weights."""
    config = FlintConfig.from_name("tiny", vocab_size=264, num_hidden_layers=4, router_aux_loss_coef=0.0005)
    source = build_model(config, seed=7)
    convert.save_hf(source, tmp_path / "hf")
    finetune = [f"--model.init_from={tmp_path / 'hf'}", "--model.preset=",
                "--training.sample_tokens=0", f"--checkpoint.export_hf={tmp_path / 'out'}"]
    run_debug_two_processes(tmp_path, *finetune, "--training.steps=2", "--parallel.dp_shard=2")
    converted = list((tmp_path / "ckpt").glob("init_from_hf-*"))
    assert len(converted) == 1 and train.is_native_checkpoint(converted[0])
    written = (converted[0] / ".metadata").stat().st_mtime_ns
    loader = train.setup_data(train.load_config(DEBUG, [f"--data.path={EMBEDDED_CORPUS}",
                                                        f"--data.cache_dir={tmp_path / 'cache'}"]),
                              train.Run(0, 1, 0, 1, torch.device("cpu")))[1]
    batches = [loader.next_batch() for _ in range(2)]  # rank 0's rows, then rank 1's
    with torch.no_grad():
        tokens = [(b["targets"] != -100).sum() for b in batches]
        expected = [source(**b).item() for b in batches]
    two_process_loss = sum(loss * n for loss, n in zip(expected, tokens)) / sum(tokens)
    assert train_losses(tmp_path)[1] == pytest.approx(two_process_loss.item(), rel=1e-5)
    exported = convert.load_hf(tmp_path / "out")
    assert not torch.equal(exported.embed_tokens.weight, source.embed_tokens.weight)  # trained, then exported

    shutil.rmtree(tmp_path / "out")
    run_debug(tmp_path, *finetune, "--training.steps=1")
    assert list((tmp_path / "ckpt").glob("init_from_hf-*")) == converted
    assert (converted[0] / ".metadata").stat().st_mtime_ns == written  # reused, not converted again
    assert train_losses(tmp_path)[1] == pytest.approx(expected[0], rel=1e-5)


def exported_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for step in expected:
        assert actual[step] == pytest.approx(expected[step], rel=1e-5), f"{what}, step {step}"


def test_two_processes_match_one_resume_in_one_and_export(tmp_path):
    """Global batch of 8 rows: one process with 2 micro-batches of 4, FSDP 2 and EP 2 with 4 rows
    per rank, PP 2 with 2 micro-batches of 4. Micro-batches and ranks hold different numbers of
    target tokens, so only an exact token weighting agrees. The per-step and validation losses
    agree; the FSDP run's checkpoint resumes in one process; its Hugging Face export holds the
    one-process run's tensors."""
    common = ["--training.steps=4", "--logging.every=1", "--checkpoint.every=2", "--training.sample_tokens=0",
              f"--data.cache_dir={tmp_path / 'cache'}"]
    one, fsdp, ep, pp, resumed = (tmp_path / name for name in ("one", "fsdp", "ep", "pp", "resumed"))
    run_debug(one, *common, "--training.grad_accum=2", f"--checkpoint.export_hf={one / 'hf'}")
    expected = train_losses(one)
    assert expected[4] < expected[1]
    two = [*common, "--training.eval_batches=1"]  # the same 8 validation rows as 2 batches of 4 in one process
    run_debug_two_processes(fsdp, *two, "--parallel.dp_shard=2", f"--checkpoint.export_hf={fsdp / 'hf'}")
    assert_same_losses(train_losses(fsdp), expected, "FSDP 2")
    run_debug_two_processes(ep, *two, "--parallel.ep=2", "--parallel.dp_shard=1")
    assert_same_losses(train_losses(ep), expected, "EP 2")
    # One data-parallel rank: the 2 micro-batches of one process, each split in 2 for the 1F1B schedule.
    run_debug_two_processes(pp, *common, "--parallel.pp=2", "--parallel.dp_shard=1", "--training.grad_accum=2")
    assert_same_losses(train_losses(pp), expected, "PP 2")
    val_losses = [[r["val_loss"] for r in records(path) if "val_loss" in r] for path in (one, fsdp, ep, pp)]
    assert all(other == pytest.approx(val_losses[0], rel=1e-5) for other in val_losses[1:]), val_losses

    run_debug(resumed, *common, "--training.grad_accum=2", f"--checkpoint.resume={fsdp / 'ckpt' / 'run_0001' / 'step_00000002'}")
    assert_same_losses(train_losses(resumed), {s: expected[s] for s in (3, 4)}, "FSDP 2 checkpoint resumed in 1")

    reference, sharded = exported_tensors(one / "hf"), exported_tensors(fsdp / "hf")
    assert sorted(sharded) == sorted(reference) and len(reference) > 10
    # Adam divides each gradient by its running RMS: where a gradient is near zero, a last-bit difference
    # from summing over 2 ranks moves a weight by up to ~1e-3 of lr (3e-3) per step, so atol 1e-5 over 4 steps.
    for name, tensor in reference.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


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


def test_weight_decay_applies_to_matrices_only():
    model = build_model(FlintConfig.from_name("tiny", num_hidden_layers=3), seed=0)
    decayed, plain = train.build_optimizer(model, OptimSection(weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert {names[id(p)] for p in plain["params"]} == {n for n, p in model.named_parameters() if p.dim() == 1}
    assert "layers.2.mlp.experts.gate_up_proj" in {names[id(p)] for p in decayed["params"]}


def adamw_matches_plain(model: torch.nn.Module, reference: torch.nn.Module, steps: int = 4) -> None:
    """train.build_optimizer on `model` (plain tensors or DTensor shards) against a plain for-loop
    torch.optim.AdamW on `reference` (the same weights, full tensors), both fed the same random
    gradients and the same learning rate schedule: the weights agree to FP32 rounding."""
    o = OptimSection(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    chosen = train.build_optimizer(model, o)
    decayed = [p for p in reference.parameters() if p.dim() >= 2]
    plain = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1},
                               {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                              betas=(0.8, 0.9), eps=1e-6, foreach=False)
    references = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        for optimizer in (chosen, plain):
            train.set_learning_rate(optimizer, 1e-2 / step)
        give_same_gradients(model, references, generator)
        chosen.step()
        plain.step()
    assert_weights_match(model, references, rtol=1e-6)


def test_the_optimizer_steps_like_plain_adamw():
    config = FlintConfig.from_name("tiny", num_hidden_layers=3)
    adamw_matches_plain(build_model(config, seed=0), build_model(config, seed=0))


LARGE4_SMOKE = str(ROOT / "configs" / "large4-smoke.toml")


def large4_args(tmp_path: Path, *overrides: str) -> list[str]:
    """configs/large4-smoke.toml, shrunk to seconds, every path under tmp_path. No sample: a model
    this little trained may pick an id of the padded vocabulary that the byte tokenizer cannot decode."""
    return ["--config", LARGE4_SMOKE, f"--data.path={EMBEDDED_CORPUS}", f"--data.cache_dir={tmp_path / 'cache'}",
            f"--checkpoint.dir={tmp_path / 'ckpt'}", f"--logging.jsonl={tmp_path / 'metrics.jsonl'}",
            "--logging.peak_tflops=0.1", "--data.seq_len=32", "--training.batch_size=4", "--training.steps=6",
            "--training.eval_every=0", "--logging.every=2", "--optim.warmup_steps=2",
            "--training.sample_tokens=0", *overrides]


def test_large4_trains_through_train_main(tmp_path):
    """A few steps of the tiny Mistral Large 4 through the same path as Flint: loss falls, the frozen
    indexer is neither updated nor in the optimizer, the checkpoint resumes."""
    summary = train.main(large4_args(tmp_path))
    losses = train_losses(tmp_path)
    assert losses[1] == pytest.approx(math.log(264), abs=0.15) and losses[6] < losses[1] - 0.5
    assert set(records(tmp_path)[-2]["routing"]) == {str(i) for i in range(1, 8)}  # layer 0 is dense
    state = convert.NativeDir(tmp_path / "ckpt" / "run_0001" / "step_00000006").read(["layers.0.self_attn.indexer.wk.weight"])
    from large4 import Large4Config, build_large4
    fresh = build_large4(Large4Config.from_hf_config(tmp_path / "ckpt" / "run_0001" / "step_00000006"))
    assert torch.equal(state["layers.0.self_attn.indexer.wk.weight"], fresh.state_dict()[
        "layers.0.self_attn.indexer.wk.weight"])  # frozen: still its initial value
    optimized = {id(p) for group in train.build_optimizer(fresh, OptimSection()).param_groups
                 for p in group["params"]}
    assert {n for n, p in fresh.named_parameters() if id(p) not in optimized} == {
        n for n in fresh.state_dict() if ".indexer." in n}
    assert summary["step"] == 6
    resumed = train.main(large4_args(tmp_path, "--training.steps=8", "--checkpoint.resume=auto"))
    assert resumed["step"] == 8


def test_large4_refuses_a_random_indexer_beyond_index_topk(tmp_path):
    with pytest.raises(ConfigError, match="index_topk"):
        train.main(large4_args(tmp_path, "--data.seq_len=256"))


def test_large4_finetune_from_hugging_face_exports_the_extras_of_its_source(tmp_path):
    """Training keeps only the text model; the export copies the vision tower and draft head from
    the init_from checkpoint, so the published loader finds nothing missing."""
    from large4 import build_large4
    unbiased = "--model.router_bias_update_rate=0"  # the smoke config's selection bias is never exported
    config = train.load_config(LARGE4_SMOKE, ["--model.index_topk=128", unbiased]).model_config
    convert.save_hf(build_large4(config, seed=3), tmp_path / "hf")
    shard = next((tmp_path / "hf").glob("*.safetensors"))
    state, extra = load_file(shard), torch.arange(6.0)
    save_file({**state, "mtp_dspark.norm.weight": extra}, str(shard))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp_dspark.norm.weight"] = shard.name
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    train.main(large4_args(tmp_path, f"--model.init_from={tmp_path / 'hf'}", "--model.preset=", unbiased,
                           "--training.steps=2", f"--checkpoint.export_hf={tmp_path / 'out'}"))
    exported = exported_tensors(tmp_path / "out")
    assert torch.equal(exported["mtp_dspark.norm.weight"], extra)
    assert not torch.equal(exported["tok_embeddings.weight"], state["tok_embeddings.weight"])  # trained


def test_choices_that_fail_on_the_cpu_stop_before_the_run_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"command line --parallel.backend: .*\"nccl\" needs GPUs"):
        run_debug(tmp_path, "--parallel.backend=nccl", "--training.device=cpu")
    with pytest.raises(ConfigError, match=r"command line --model.attention_backend: .*\"flex\" cannot train on the CPU"):
        run_debug(tmp_path, "--model.attention_backend=flex", "--training.device=cpu")
    assert not (tmp_path / "ckpt").exists()


@slow
def test_large4_two_processes_match_one_resume_in_one_and_export(tmp_path):
    """Large 4 through train.py, global batch of 8 rows: one process with 2 micro-batches of 4, then
    FSDP 2 and EP 2 with 4 rows per rank. The losses agree; the FSDP run's checkpoint resumes in one
    process; its Hugging Face export (written from the sharded run) holds the one-process run's tensors."""
    common = ["--training.steps=4", "--logging.every=1", "--checkpoint.every=2"]
    one, fsdp, ep, resumed = (tmp_path / name for name in ("one", "fsdp", "ep", "resumed"))
    train.main(large4_args(one, *common, "--training.grad_accum=2", f"--checkpoint.export_hf={one / 'hf'}"))
    expected = train_losses(one)
    assert expected[4] < expected[1]
    run_two_processes(large4_args(fsdp, *common, "--parallel.dp_shard=2", f"--checkpoint.export_hf={fsdp / 'hf'}"))
    assert_same_losses(train_losses(fsdp), expected, "Large 4, FSDP 2")
    run_two_processes(large4_args(ep, *common, "--parallel.ep=2", "--parallel.dp_shard=1"))
    assert_same_losses(train_losses(ep), expected, "Large 4, EP 2")
    train.main(large4_args(resumed, *common, "--training.grad_accum=2",
                           f"--checkpoint.resume={fsdp / 'ckpt' / 'run_0001' / 'step_00000002'}"))
    assert_same_losses(train_losses(resumed), {s: expected[s] for s in (3, 4)}, "Large 4, FSDP 2 resumed in 1")
    reference, sharded = exported_tensors(one / "hf"), exported_tensors(fsdp / "hf")
    assert sorted(sharded) == sorted(reference) and any(".indexer." in name for name in reference)
    for name, tensor in reference.items():  # tolerances as for Flint's export above
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_load_balancing_loss_trains_the_same_with_activation_checkpointing(tmp_path):
    """The blocks add the balancing term's statistics as they run; recomputing a block in backward
    must give the same loss and updates as keeping its activations."""
    balance = ["--model.output_router_logits=true", "--model.router_aux_loss_coef=0.1", "--training.steps=3",
               "--logging.every=1", "--training.sample_tokens=0"]
    run_debug(tmp_path / "plain", *balance)
    run_debug(tmp_path / "recompute", *balance, "--parallel.activation_checkpointing=full")
    plain, recompute = train_losses(tmp_path / "plain"), train_losses(tmp_path / "recompute")
    assert plain == pytest.approx(recompute, rel=1e-6, abs=1e-6)
    run_debug(tmp_path / "none", "--training.steps=3", "--logging.every=1", "--training.sample_tokens=0")
    cross_entropy = train_losses(tmp_path / "none")
    assert plain[1] - cross_entropy[1] == pytest.approx(0.1 * 2, abs=0.02)  # near-uniform routing at init: aux ~ k


def test_large4_trains_with_the_selection_bias_and_never_exports_it(tmp_path):
    """router_bias_update_rate on Large 4: the bias moves by the rate each step, a native checkpoint
    carries it and the rate, and both ways of exporting to the published format refuse."""
    bias = "--model.router_bias_update_rate=0.01"
    train.main(large4_args(tmp_path, bias, "--training.steps=4", "--checkpoint.every=4"))
    step4 = tmp_path / "ckpt" / "run_0001" / "step_00000004"
    model = convert.load_native(step4)
    assert model.config.router_bias_update_rate == 0.01
    biases = torch.stack([model.layers[str(i)].mlp.router.selection_bias for i in range(1, 8)])  # 0 is dense
    steps = biases / 0.01  # each step moved each bias by -0.01, 0 or +0.01
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert steps.abs().max().item() == pytest.approx(4) and (steps.abs().sum(dim=1) > 0).all()
    with pytest.raises(ConfigError, match=r"export_hf cannot export a model with \[model\].router_bias_update_rate"):
        train.main(large4_args(tmp_path / "export", bias, f"--checkpoint.export_hf={tmp_path / 'hf'}"))
    with pytest.raises(ValueError, match=r"per-expert selection bias .* the published format has no place for"):
        convert.export_published(convert.NativeDir(step4), model.config, tmp_path / "hf")


# ----------------------------------------------------------------------------- host syncs of a step

def step_host_syncs(argv: list[str]) -> list[str]:
    """What train_step copies to the host in step 2 (not a logged step) of train.py's run of argv:
    main's setup, step 1, then step 2 under profiling.HostSyncs (see there what counts)."""
    from checkpoint import Checkpointer
    from tools.profiling import HostSyncs
    from balance import RoutingMonitor
    cfg = train.parse_args(argv)
    run = train.start_run(cfg)
    with Checkpointer(cfg, run) as checkpoints, train.Interruption(run) as interruption:
        _, data, _ = train.setup_data(cfg, run)
        model = train.load_model(cfg, run)
        optimizer = train.build_optimizer(model.module, cfg.optim)
        routing = RoutingMonitor(model.module, model.config, run.device, cfg.logging.idle_expert_steps)
        step = (model, optimizer, data, cfg, run)
        train.train_step(*step, routing, interruption, 1, checkpoints)
        with HostSyncs() as syncs:
            train.train_step(*step, routing, interruption, 2, checkpoints)
    return syncs.reads


def closing(fn):
    """fn, then the process group closed once fn's frame (its model) is gone, as train.main does."""
    def closed(*args):
        try:
            return fn(*args)
        finally:
            close_distributed()
    return closed


def test_a_step_copies_to_the_host_once(tmp_path):
    """No sync per micro-batch (the batches' token ids were checked at load): loss, grad norm, the
    update check and the stop request come back in one copy."""
    assert closing(step_host_syncs)(debug_args(tmp_path, "--training.grad_accum=2")) == ["tolist"]


def check_expert_parallel_step_syncs(argv: list[str]) -> None:
    reads = closing(step_host_syncs)(argv)
    # The step's copy, then one per MoE layer (2) per micro-batch (2): none in the recompute, none
    # for repeat_interleave (given its output size).
    assert reads == ["tolist"] * (1 + 2 * 2), reads


def test_an_expert_parallel_step_copies_once_per_moe_layer_and_micro_batch(tmp_path):
    run_two_processes(debug_args(tmp_path, "--parallel.ep=2", "--parallel.dp_shard=1", "--training.grad_accum=2",
                                 "--parallel.activation_checkpointing=full", "--data.seq_len=16",
                                 "--training.batch_size=2"), check_expert_parallel_step_syncs)


def test_a_finished_run_leaves_no_gloo_thread(tmp_path):
    """Expert parallel (DTensor experts), FSDP and an async save's own gloo group on 2 ranks: each
    rank's worker finds no gloo thread left after train.main (see _torchrun_worker)."""
    run_debug_two_processes(tmp_path, "--parallel.ep=2", "--training.steps=2", "--checkpoint.every=2",
                            "--checkpoint.async_save=true", "--training.sample_tokens=0")


def _rank_0_prepares_slowly(argv: list[str]) -> None:
    """train.main, with rank 0's data preparation taking a minute longer."""
    if os.environ["RANK"] == "0":
        real_prepare = train.prepare
        train.prepare = lambda *args: (time.sleep(60), real_prepare(*args))
    train.main(argv)


def test_no_rank_waits_for_rank_0_longer_than_collective_timeout_minutes(tmp_path):
    """[parallel].collective_timeout_minutes reaches the process group: while rank 0 prepares the data
    for a minute, rank 1 gives up after 6 s with an error naming the key (the default would wait)."""
    argv = debug_args(tmp_path, "--training.steps=1", "--training.sample_tokens=0",
                      "--parallel.collective_timeout_minutes=0.1")
    start = time.perf_counter()
    with pytest.raises(mp.ProcessRaisedException, match=r"DataError: rank 1 waited for rank 0 to prepare .* longer "
                       r"than \[parallel\].collective_timeout_minutes = 0.1 \(command line "
                       r"--parallel.collective_timeout_minutes\)"):
        run_two_processes(argv, _rank_0_prepares_slowly)
    assert time.perf_counter() - start < 60


def _train_under_each_v_schedule(argv: list[str]) -> None:
    """train.main(argv) under ZBVZeroBubble, then DualPipeV, each into a checkpoint directory and log of its own."""
    base = Path(next(a for a in argv if a.startswith("--checkpoint.dir=")).split("=", 1)[1]).parent
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        train.main([*argv, f"--parallel.pp_schedule={schedule}", f"--checkpoint.dir={base / schedule / 'ckpt'}",
                    f"--logging.jsonl={base / schedule / 'metrics.jsonl'}"])


def test_runs_under_the_zero_bubble_schedules_evaluate_and_save_their_final_checkpoint(tmp_path):
    """2 pipeline ranks with the default validation split: the final evaluation ran (it crashed under
    the V schedules, before the final save) and the final checkpoint exists, with the same validation
    loss under both schedules."""
    run_two_processes(debug_args(tmp_path, "--parallel.pp=2", "--parallel.dp_shard=1", "--training.steps=2",
                                 "--training.sample_tokens=0"), _train_under_each_v_schedule)
    val_losses = []
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert (tmp_path / schedule / "ckpt" / "run_0001" / "step_00000002").is_dir(), schedule
        val_losses += [r["val_loss"] for r in records(tmp_path / schedule) if "val_loss" in r]
    assert len(val_losses) == 2 and math.isclose(*val_losses, rel_tol=1e-6), val_losses


def test_under_torchrun_ctrl_c_ends_with_the_resume_command(tmp_path):
    """Ctrl-C reaches torchrun, which passes SIGINT to the ranks: they finish the step, save and print the
    resume command, and then torchrun prints its own 25-line SignalException traceback, which buried it.
    Rank 0 prints the command again once torchrun has exited: the last thing on the terminal."""
    import signal
    import subprocess
    import sys
    argv = debug_args(tmp_path, "--training.steps=2000", "--data.epochs=1000", "--training.sample_tokens=0",
                      "--logging.every=1", "--data.val_fraction=0")
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = subprocess.Popen([str(torchrun), "--nproc-per-node=2", "train.py", *argv], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    for line in launcher.stdout:  # to the end: the repeated command comes after torchrun has exited
        lines.append(line.rstrip("\n"))
        if line.startswith("step    2/"):
            launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=60) != 0
    output = [line for line in lines if line.strip()]
    assert any("SignalException" in line for line in output), "\n".join(output[-40:])
    assert output[-2].startswith("stopped by SIGINT after step ") and output[-2].endswith("Resume with:"), output[-5:]
    command = output[-1].split()
    assert command[:3] == ["torchrun", "--nproc-per-node=2", "train.py"] and command[-1] == "--checkpoint.resume=auto"
    saved = output[-2].split("; saved ")[1].split(". Resume")[0]
    assert Path(saved).is_dir() and Path(saved).parent == tmp_path / "ckpt" / "run_0001"
