"""Train Flint or Mistral Large 4: `python train.py --config configs/smoke.toml [--section.key=value
...]`, or on several processes `torchrun --nproc-per-node N train.py --config ...`.

main() is the table of contents: configuration, data, model, optimizer, resume, then the loop. Each
step takes grad_accum micro-batches, weights every token equally across micro-batches and ranks,
clips the global gradient norm and steps AdamW; evaluation, checkpoints and logs follow at their
intervals. config.py reads and checks the TOML, data.py tokenizes and packs the text, checkpoint.py
saves and resumes, parallel.py lays the model across the processes ([parallel]: FSDP, HSDP, expert,
pipeline and context parallel, BF16 compute with FP32 master weights on GPUs), metrics.py prints and
records each logged step, profiles the steps [logging] profile_steps names and writes report.py's
page at the end. One process takes the same path as many: it runs in a process group of one."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. When another process shares the cores, spinning
# threads wait on a descheduled peer at every op: a 2-core smoke step then took 30x longer. Set
# before torch starts OpenMP; an OMP_WAIT_POLICY of your own wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
import math
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zlib
from contextlib import closing, contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from attention import flash_refusal
from balance import COEFFICIENTS, RoutingMonitor
from checkpoint import Checkpointer, CheckpointError, check_architecture
from checkpoint_files import is_native_checkpoint, load_dcp
from config import (
    ConfigError,
    OptimSection,
    TrainConfig,
    TrainingSection,
    help_text,
    load_config,
    resolved_summary,
    resolved_toml,
)
from data import (
    DataError,
    MixedLoader,
    PackedLoader,
    TokenShards,
    changed_settings,
    split_documents,
    stream_settings,
)
from files import read_json_object
from fp8 import fp8_device_refusal
from layers import token_ids_checked_at_load
from lean_adamw import BF16StatesAdamW
from lora import apply_lora, is_adapter_key, without_adapters
from metrics import MetricsLogger
from moe import set_balanced_routing
from muon import Muon, takes_muon
from parallel import (
    ParallelModel,
    Process,
    barrier,
    build_mesh,
    close_distributed,
    init_distributed,
    init_weights,
    parallelize,
    set_initial_values,
    uncompile,
    waiting_for_main_rank,
)
from prepare import prepare, prepared_dir
from registry import config_from_hf, model_class
from tokenizer import Tokenizer, TokenizerError, load_tokenizer


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, an unusable checkpoint); the message says why."""


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    missing = missing_inputs(cfg)
    if missing:  # before any process group or model: a user-supplied input is not there
        raise ConfigError(missing)
    try:
        return run_training(cfg, argv)
    except BaseException as error:
        # the failed frames let go of the model and its meshes
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        close_distributed()  # after run_training's frame, holding the model and its groups, is gone


def run_training(cfg: TrainConfig, argv: list[str]) -> dict:
    """One training run of cfg in the process group it starts: data, model, the steps, the export
    and sample. main closes the group once this frame, which holds the model, has returned."""
    run = start_run(cfg)
    with Checkpointer(cfg, run) as checkpoints:  # locks checkpoint.dir: one run per directory
        tokenizer, train_data, val_data = setup_data(cfg, run)
        model = load_model(cfg, run)
        if cfg.parallel.compile:
            check_compiled(model, train_data.peek(), run, cfg.parallel.compile_fallback)
        optimizer = build_optimizer(model.module, cfg.optim)
        step = checkpoints.resume(model, optimizer, train_data)
        explain_resumed_settings(cfg, checkpoints.last if step else None, step, run)
        logger = MetricsLogger(cfg, run, model.config, start_step=step, run_dir=checkpoints.run_dir)
        # A LoRA run keeps its base frozen, the routers' selection bias (aux-loss-free balancing)
        # included.
        frozen = (
            dataclasses.replace(model.config, router_bias_update_rate=0.0)
            if cfg.lora.enabled
            else model.config
        )
        routing = RoutingMonitor(
            model.module, frozen, run.device, cfg.logging.idle_expert_steps, run.is_main
        )
        # closing(logger): TensorBoard and W&B are closed however the loop ends (divergence, a stop)
        stops = explain_stop(checkpoints, run, argv, logger)
        with Interruption(run) as interruption, stops, closing(logger):
            while step < cfg.training.steps:
                step += 1
                lr = set_learning_rate(
                    optimizer, learning_rate(step, cfg.optim, cfg.training.steps)
                )
                # [logging] profile_steps; a CUDA OOM's snapshot
                with logger.traced(step, model, optimizer):
                    loss, grad_norm, targets, stop = train_step(
                        model,
                        optimizer,
                        train_data,
                        cfg,
                        run,
                        routing,
                        interruption,
                        step,
                        checkpoints,
                    )
                logger.add_loss(loss, targets)  # logged: the mean since the last logged step
                if due(step, cfg.logging.every, cfg.training.steps) or step == logger.first_step:
                    logger.log_train(step, lr, grad_norm, routing.stats(), data_tokens(train_data))
                stopping = interruption.requested(stop)
                with logger.untimed():  # tokens/s counts training only
                    if val_data and due(step, cfg.training.eval_every, cfg.training.steps):
                        logger.log_eval(step, evaluate(model, val_data, cfg, run))
                    if due(step, cfg.checkpoint.every, cfg.training.steps) or stopping:
                        checkpoints.save(step, model, optimizer, train_data)
                if stopping:
                    stopped = (
                        f"stopped by {interruption.name} after step {step}; saved "
                        f"{checkpoints.wait()}. "
                        f"Resume with:\n  {resume_command(argv, run)}"
                    )
                    run.print(stopped)
                    if run.is_main:
                        say_after_the_launcher(stopped)
                    raise SystemExit(128 + getattr(signal, interruption.name))
        return finish(checkpoints.wait(), tokenizer, cfg, run, logger)


@contextmanager
def explain_stop(checkpoints: Checkpointer, run: Process, argv: list[str], logger: MetricsLogger):
    """A second Ctrl-C stops at once: say that nothing was saved, and how to resume from what was.
    A run stopped by divergence (check_loss, check_update) gets its report, as a finished run does:
    the run that most needs one."""
    try:
        yield
    except TrainingError:
        if logger.summary["first_loss"] is not None:  # a step was logged: report.py has records
            logger.write_report()  # the page of the steps logged before it diverged
        raise
    except KeyboardInterrupt:
        run.print(
            f"\ninterrupted without saving; the last checkpoint is "
            f"{checkpoints.latest() or 'none (none was saved yet)'}. Resume with:\n  "
            f"{resume_command(argv, run)}"
        )
        raise


def resume_command(argv: list[str], run: Process) -> str:
    """The command line of this run, continuing from its latest checkpoint."""
    start = (
        ["torchrun", f"--nproc-per-node={run.world_size}"] if run.world_size > 1 else ["python3"]
    )
    kept = [arg for arg in argv if not arg.startswith("--checkpoint.resume")]
    return shlex.join([*start, "train.py", *kept, "--checkpoint.resume=auto"])


# Waits (up to a minute) until process argv[1] has exited, then writes argv[2] to stderr.
AFTER_EXIT = """
import os, sys, time
pid = int(sys.argv[1])
def alive():
    try:  # a zombie (exited, not yet reaped by its parent) has exited: its output is all written
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
for _ in range(1200):
    if not alive():
        break
    time.sleep(0.05)
sys.stderr.write(sys.argv[2] + "\\n")
"""


def say_after_the_launcher(message: str) -> None:
    """Under torchrun, `message` once more after torchrun has exited. Ctrl-C reaches torchrun, which
    sends SIGINT on to the ranks and, once they have saved and stopped, prints its own
    SignalException traceback of 25 lines, burying what the ranks said. A detached process waits for
    torchrun (this rank's parent) to exit and repeats the message, so that it is the last thing on
    the terminal."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not started by torchrun
        return
    subprocess.Popen(
        [sys.executable, "-c", AFTER_EXIT, str(os.getppid()), message],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def due(step: int, every: int, last: int) -> bool:
    """Every `every` steps (0: never) and always at the last step."""
    return step == last or (every > 0 and step % every == 0)


def parse_args(argv: list[str] | None) -> TrainConfig:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a TOML file, e.g. configs/smoke.toml")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as TOML and exit without training",
    )
    rehearsal = parser.add_argument_group(
        "rehearsal",
        "run rank R's first steps of the GPU job on "
        "this CPU, on a "
        "fake world of its size (tools/rehearsal.py), and exit",
    )
    rehearsal.add_argument("--dry-run", action="store_true", help="rehearse instead of training")
    rehearsal.add_argument(
        "--world-size", type=int, help="the job's GPUs (default: what [parallel] needs)"
    )
    rehearsal.add_argument(
        "--rank",
        type=int,
        help="the rank to rehearse (default: rank 0, and under a pipeline also the last rank)",
    )
    rehearsal.add_argument(
        "--gpu", default="H200", help="H100 | H200 | B200: the capacity to check against"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(resolved_toml(cfg))
        raise SystemExit(0)
    if args.dry_run:
        # fake tensors and a fake world: only a rehearsal needs them
        from tools.rehearsal import ranks_to_rehearse, rehearse

        for rank in ranks_to_rehearse(cfg, args.world_size, args.rank):
            rehearse(cfg, args.world_size, rank, args.gpu)
        raise SystemExit(0)
    return cfg


# ============================================================================ devices and processes


def start_run(cfg: TrainConfig) -> Process:
    """One process per device, always in a process group (of one without torchrun), and the mesh."""
    t, parallel = cfg.training, cfg.parallel
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f'{cfg.where("training.device")}: [training].device = "cuda" but no GPU is available'
        )
    use_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    check_device_choices(cfg, on_gpu=use_cuda and parallel.backend != "gloo")
    device = init_distributed(
        parallel.backend, use_cuda, timedelta(minutes=parallel.collective_timeout_minutes)
    )
    run = join_mesh(cfg, device)
    torch.manual_seed(t.seed)
    run.print(
        f"config {cfg.source}: {run.world_size} process(es) on {device.type} "
        f"({layout_of(run)}), "
        f"{str(parallel.compute_dtype(device.type))[6:]} compute, FP32 master "
        f"weights\n{resolved_summary(cfg)}"
    )
    return run


def join_mesh(cfg: TrainConfig, device: torch.device) -> Process:
    """This process of the started process group, with the config's mesh over the group."""
    try:
        mesh = build_mesh(cfg.parallel, device.type, cfg.model_config.num_experts)
    except ValueError as error:  # the layout does not fit the world size
        layout = [f"parallel.{key}" for key in ("pp", "dp_replicate", "dp_shard", "ep", "cp")]
        raise ConfigError(f"{cfg.where_any(layout)}: {error}") from error
    return Process(
        dist.get_rank(),
        dist.get_world_size(),
        mesh["dp"].get_local_rank(),
        mesh["dp"].size(),
        device,
        mesh,
    )


def layout_of(run: Process) -> str:
    """The mesh's parallel degrees, e.g. "dp_shard 2 x ep 2"."""
    mesh = run.mesh
    return (
        " x ".join(
            f"{name} {mesh[name].size()}" for name in mesh.mesh_dim_names if mesh[name].size() > 1
        )
        or "no parallelism"
    )


def check_device_choices(cfg: TrainConfig, on_gpu: bool) -> None:
    """Choices that fail on this machine's device (the CPU, or a GPU without FP8), refused before
    the process group starts."""
    if cfg.parallel.backend == "nccl" and not on_gpu:
        raise ConfigError(
            f'{cfg.where("parallel.backend")}: [parallel].backend = "nccl" needs '
            "GPUs but this run "
            f'is on the CPU; use "auto" or "gloo"'
        )
    refusal = fp8_device_refusal() if cfg.parallel.fp8 != "none" and on_gpu else None
    if refusal:
        raise ConfigError(f"{cfg.where('parallel.fp8')}: [parallel].{refusal}")
    if cfg.model_config.attention_backend == "flex" and not on_gpu:
        raise ConfigError(
            f'{cfg.where("model.attention_backend")}: attention_backend = "flex" '
            "cannot train on the "
            f'CPU (FlexAttention has no CPU backward); use "auto" or "sdpa"'
        )
    if cfg.model_config.attention_backend == "flash":
        refusal = flash_refusal(torch.device("cuda" if on_gpu else "cpu"))
        if refusal:
            raise ConfigError(
                f'{cfg.where("model.attention_backend")}: attention_backend = "flash" {refusal}; '
                'use "flex" or "auto"'
            )


# ============================================================================= data and model


def missing_inputs(cfg: TrainConfig) -> str | None:
    """What the config names that is not on this machine (the corpus, a tokenizer directory or
    file), said with how to supply it; None when everything is there."""
    d = cfg.data
    if not d.sources and not Path(d.path).exists():  # config.py checked each of [data].sources
        return (
            f"{cfg.where('data.path')}: data.path {d.path} does not exist. Put your corpus "
            "there (text files, "
            f"a directory of them, or JSONL with a {d.text_key!r} field), or tokenize it once "
            "with "
            f"`python3 prepare.py prepare CORPUS... --out {d.path} --tokenizer TOKENIZER` "
            "(GUIDE.md, Data)"
        )
    if ("/" in d.tokenizer or d.tokenizer.endswith(".tiktoken")) and not Path(d.tokenizer).exists():
        return (
            f"{cfg.where('data.tokenizer')}: data.tokenizer {d.tokenizer} does not exist: name "
            "a directory "
            "holding tokenizer.json (the released one comes with its checkpoint) or a "
            ".tiktoken file"
        )
    return None


def setup_data(
    cfg: TrainConfig, run: Process
) -> tuple[Tokenizer, PackedLoader, PackedLoader | None]:
    """Tokenizer, then shards (prepared once, by rank 0), then the training and validation
    loaders."""
    d, t = cfg.data, cfg.training
    tokenizer = load_tokenizer(d.tokenizer, d.eos_token, cfg.model.init_from)
    if tokenizer.vocab_size > cfg.model_config.vocab_size:
        raise ConfigError(
            f"{cfg.where('data.tokenizer')}: tokenizer {d.tokenizer!r} has "
            f"{tokenizer.vocab_size} "
            f"tokens but the model's vocab_size is {cfg.model_config.vocab_size}; use "
            "a model with "
            f"[model].vocab_size >= {tokenizer.vocab_size} or a smaller tokenizer"
        )
    loader = dict(
        seq_len=d.seq_len,
        batch_size=t.batch_size,
        seed=t.seed,
        rank=run.dp_rank,
        world_size=run.dp_size,
        overlong=d.overlong,
        settings=stream_settings(cfg.to_dict()),
    )
    sources = d.sources or [{"path": d.path, "weight": 1.0}]
    trains, vals, described = [], [], []
    for stream, source in enumerate(sources):
        shards = open_source(cfg, Path(source["path"]), tokenizer, run)
        train_docs, val_docs = split_documents(shards.num_docs, d.val_fraction, source["path"])
        trains.append(
            PackedLoader(shards, train_docs, shuffle=True, epochs=d.epochs, stream=stream, **loader)
        )
        vals.append(
            PackedLoader(
                shards, val_docs, shuffle=False, name="validation", stream=stream, **loader
            )
            if len(val_docs)
            else None
        )
        described.append(f"{source['path']}, {shards.num_docs} documents")
    train, val = trains[0], vals[0]
    if d.sources:  # validation draws from each source's held-out documents with the same weights
        names, weights = [s["path"] for s in sources], [s["weight"] for s in sources]
        train = MixedLoader(trains, names, weights, t.seed, d.exhausted)
        val = (
            MixedLoader(vals, names, weights, t.seed, "repeat", "validation") if all(vals) else None
        )
    check_enough_data(cfg, train, val, run)
    validation = val.describe() if val else "no validation"
    run.print(f"data: {'; '.join(described)}; {train.describe()}; {validation}")
    return tokenizer, train, val


def open_source(cfg: TrainConfig, source: Path, tokenizer: Tokenizer, run: Process) -> TokenShards:
    """One source's shards: prepared once (by rank 0) when it is raw text, then opened on every
    rank."""
    d = cfg.data
    directory = prepared_dir(source, tokenizer, Path(d.cache_dir), d.text_key)
    if run.is_main and not (directory / "meta.json").is_file():
        # every core of the host (the other ranks only wait), with progress lines on stderr
        workers = len(os.sched_getaffinity(0))
        run.print(f"preparing {source} -> {directory} with {workers} worker processes")
        prepare(source, tokenizer, directory, d.text_key, workers=workers, progress_every=30.0)
    with waiting_for_main_rank(
        f"prepare {source} in {directory}",
        cfg.parallel.collective_timeout_minutes,
        cfg.where("parallel.collective_timeout_minutes"),
        DataError,
    ):
        barrier()
    return TokenShards(directory, tokenizer)


def data_tokens(data: PackedLoader | MixedLoader) -> dict[str, int] | None:
    """A mixture's tokens drawn from each source so far (data_tokens in the log and the JSONL)."""
    return data.tokens_drawn() if isinstance(data, MixedLoader) else None


def check_enough_data(
    cfg: TrainConfig, train: PackedLoader, val: PackedLoader | None, run: Process
) -> None:
    t, global_rows = cfg.training, run.dp_size * cfg.training.batch_size
    needed = t.steps * t.grad_accum * global_rows
    available = train.rows_available()  # None for a mixture: it stops when a source runs out
    if available is not None and needed > available:
        raise DataError(
            f"not enough data: training.steps = {t.steps} needs {needed} rows of "
            f"{cfg.data.seq_len} "
            f"tokens, {needed / train.rows_per_epoch:.2f} epochs of the "
            f"{train.num_tokens:,}-token "
            f"training split of {cfg.data.path}, but data.epochs = {cfg.data.epochs}; "
            "raise "
            f"data.epochs, add data, or lower training.steps"
        )
    if val is not None and val.rows_per_epoch < global_rows:
        raise DataError(
            f"the validation split of {cfg.data.path} has {val.rows_per_epoch} rows of "
            f"{cfg.data.seq_len} tokens, fewer than one batch ({global_rows} rows); "
            "raise "
            f"data.val_fraction or lower training.batch_size"
        )


def load_model(cfg: TrainConfig, run: Process) -> ParallelModel:
    """FP32 master weights, laid out by parallel.py: fresh from the seed, or from [model].init_from
    (native, or Hugging Face converted to native first). Built on meta and parallelized before
    any weight exists, so each rank only ever holds its own shards (the 40B model fits)."""
    pm = build_model(cfg, run)
    config = pm.config
    if not cfg.model.init_from:
        init_weights(pm, run.device, cfg.training.seed)
        return pm
    source = Path(cfg.model.init_from)
    native = source if is_native_checkpoint(source) else converted_checkpoint(source, cfg, run)
    check_architecture(native, config)
    init_weights(pm, run.device, seed=None)  # allocated, then filled from the checkpoint
    state = {"model": get_model_state_dict(pm.module)}  # this rank's shards; DCP reads just those
    adapting = cfg.lora.enabled
    if adapting:  # the base holds no adapters: they start from their initial values (B = 0)
        state["model"] = without_adapters(state["model"])
        set_initial_values(pm, cfg.training.seed, is_adapter_key)
    load_dcp(state, native)
    set_model_state_dict(pm.module, state["model"], options=StateDictOptions(strict=not adapting))
    run.print(
        f"loaded the weights of {source}" + (" (frozen; LoRA adapters train)" if adapting else "")
    )
    return pm


def build_model(cfg: TrainConfig, run: Process) -> ParallelModel:
    """The model on the meta device (no weight exists yet), laid out by parallel.py, its routers
    forced balanced if [training] force_balanced_routing asks (benchmarks, rehearsals)."""
    # an init_from checkpoint's config.json, with the training settings of [model]
    config = cfg.model_config
    with torch.device("meta"):
        model = model_class(config)(config, torch.float32)
    # before parallelize: the adapters are sharded, split and compiled with their modules
    if cfg.lora.enabled:
        adapted = apply_lora(model, cfg.lora, cfg.training.seed)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        run.print(
            f"LoRA: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {len(adapted)} "
            "modules, "
            f"{trainable / 1e6:.2f}M trainable parameters; the rest frozen"
        )
    # a lookup: no matmul, not in flops_per_token
    embedding = config.vocab_size * config.hidden_size
    run.print(
        f"model: {model.num_params() / 1e6:.2f}M parameters, "
        f"{model.num_params(active=True) / 1e6:.2f}M "
        f"active per token ({(model.num_params(active=True) - embedding) / 1e6:.2f}M without "
        "the embedding); "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_experts} experts (top {config.num_experts_per_tok}), vocab "
        f"{config.vocab_size}"
    )
    pm = parallelize(model, cfg.parallel, run.mesh)
    if cfg.training.grad_accum > 1:
        chosen = (
            " (auto: parallel.choose_accumulation)" if cfg.parallel.accumulation == "auto" else ""
        )
        run.print(
            f"accumulation over {cfg.training.grad_accum} micro-batches: {pm.accumulation}{chosen}"
        )
    set_balanced_routing(pm.module, cfg.training.force_balanced_routing)
    return pm


def converted_checkpoint(hf_dir: Path, cfg: TrainConfig, run: Process) -> Path:
    """A Hugging Face init_from as a native checkpoint in checkpoint.dir, written by rank 0 with
    convert.py's streaming import (memory: about two tensors) and reused while the source's
    safetensors files are unchanged; other checkpoints of earlier sources there are removed."""
    # only fine-tuning from Hugging Face needs convert.py
    from convert import import_native, open_published

    files = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(hf_dir.glob("*.safetensors"))
    ]
    key = zlib.crc32(json.dumps([str(hf_dir.resolve()), files]).encode())
    out = Path(cfg.checkpoint.dir) / f"init_from_hf-{key:08x}"
    with main_rank_works(run):
        if run.is_main and not is_native_checkpoint(out):
            for stale in Path(cfg.checkpoint.dir).glob("init_from_hf-*"):
                shutil.rmtree(stale)
            run.print(
                f"converting {hf_dir} to a native checkpoint {out} (once; reused while the "
                "source is unchanged)"
            )
            try:
                # FP8 weights (the Large 4 release) read as BF16
                config, source = open_published(hf_dir)
                import_native(source, config, out, log=run.print)
            except (ValueError, OSError) as error:
                raise TrainingError(
                    f"{cfg.where('model.init_from')}: cannot convert {hf_dir}: {error}"
                ) from error
    return out


@contextmanager
def main_rank_works(run: Process, hours: float = 4.0):
    """Rank 0 does the body's long work (converting or exporting a checkpoint) while the others wait
    at a gloo barrier of `hours`: the NCCL default of 10 minutes is shorter than a 40B
    conversion."""
    group = (
        dist.new_group(backend="gloo", timeout=timedelta(hours=hours))
        if run.world_size > 1
        else None
    )
    yield
    if group is not None:
        dist.barrier(group=group)
        dist.destroy_process_group(group)


def check_compiled(
    model: ParallelModel, example: dict[str, torch.Tensor], run: Process, fallback: bool
) -> None:
    """parallel.py compiled each decoder block; compilation happens at the first call, so one
    forward and backward, then one evaluation forward (no_grad graphs of their own), on a real batch
    shape show a failure here, not mid-run, and count the graphs and graph breaks. A failure stops
    the run on this rank, whose exit ends the others (torchrun stops the group), unless `fallback`
    ([parallel].compile_fallback) asks for eager blocks instead, and then only for a failure of the
    compiler itself (`is_compile_error`)."""
    start = time.perf_counter()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        batch = {k: v.to(run.device) for k, v in example.items()}
        model.forward_backward(**batch)
        model.loss(**batch)
    except Exception as error:
        if not is_compile_error(error):
            raise
        if not fallback:
            raise TrainingError(
                "torch.compile of the decoder blocks failed: "
                f"{type(error).__name__}: "
                f"{str(error)[:2000]}\nfix the cause, set [parallel].compile = "
                "false, or set "
                f"[parallel].compile_fallback = true to train eager on such a failure"
            ) from error
        uncompile(model)
        print(
            "WARNING: torch.compile of the decoder blocks failed, training in eager mode "
            "instead "
            f"([parallel].compile_fallback = true): {type(error).__name__}: {str(error)[:2000]}",
            file=sys.stderr,
            flush=True,
        )
    else:
        breaks = sum(counters["graph_break"].values())
        run.print(
            f"compiled the decoder blocks and the head in {time.perf_counter() - start:.1f} "
            "s: "
            f"{counters['stats']['unique_graphs']} graphs, {breaks} graph breaks"
        )
    model.module.zero_grad(set_to_none=True)


def is_compile_error(error: BaseException) -> bool:
    """A failure of the compiler itself (dynamo, AOT autograd, inductor). Out-of-memory and
    collective errors are never compile errors, even when the compiler wraps them: they are
    the run's, and other ranks wait on this one."""
    chain, cause = [], error
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    if any(isinstance(e, (torch.OutOfMemoryError, dist.DistError)) for e in chain):
        return False
    return isinstance(error, torch._dynamo.exc.TorchDynamoException)


# ============================================================================= optimizer and step


def build_optimizer(model: torch.nn.Module, o: OptimSection) -> torch.optim.Optimizer:
    """[optim] name: AdamW, weight decay on matrices (2-D weights and the stacked 3-D expert
    matrices), not on norms or sinks; the fused kernel on every device, eager: faster than the
    multi-tensor one and than a compiled step, which would also compile for seconds (BENCHMARKS.md,
    Compiled code). Or Muon (muon.py) for the block matrices and experts, at muon_lr, and AdamW for
    the embedding, head, routers (decayed) and 1-D parameters. state_dtype bfloat16: AdamW's
    moments in BF16 (lean_adamw.py's own step: the fused kernel takes FP32 moments only), in Muon's
    AdamW groups too."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if o.name == "muon":
        matrices = [p for n, p in named if takes_muon(n, p)]
        others = [(n, p) for n, p in named if not takes_muon(n, p)]
        groups = [
            {
                "params": matrices,
                "muon": True,
                "weight_decay": o.weight_decay,
                "lr_scale": o.muon_lr / o.lr,
            },
            {"params": [p for _, p in others if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for _, p in others if p.dim() < 2], "weight_decay": 0.0},
        ]
        return Muon(
            groups,
            lr=o.lr,
            momentum=o.muon_momentum,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            state_dtype=o.state_dtype,
        )
    params = [p for _, p in named]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if o.state_dtype == "bfloat16":
        return BF16StatesAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def learning_rate(step: int, o: OptimSection, total: int) -> float:
    """Step 1..total: linear warmup to lr, then cosine to min_lr, or WSD (hold lr, then a linear
    decay to min_lr over the last decay_fraction of the steps), or constant."""
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "cosine":
        progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = max(o.warmup_steps, total - round(o.decay_fraction * total))
    if step <= decay_start:
        return o.lr
    return o.lr + (o.min_lr - o.lr) * (step - decay_start) / max(1, total - decay_start)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """The schedule's lr on every group, times the group's lr_scale (Muon's matrices: muon_lr /
    lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


# The keys whose change moves the learning rate of the steps a resumed run has left.
SCHEDULE_KEYS = (
    "optim.lr",
    "optim.min_lr",
    "optim.schedule",
    "optim.warmup_steps",
    "optim.decay_fraction",
    "training.steps",
)


def explain_resumed_settings(
    cfg: TrainConfig, checkpoint: Path | None, step: int, run: Process
) -> None:
    """What changed since the resumed checkpoint's run (its train_config.json): every [optim]
    setting and training.steps take the config's value from the next step (Checkpointer.resume keeps
    the config's optimizer settings over the saved ones), each change named; a change that moves the
    learning rate away from where the checkpoint's schedule would have taken it is said with both
    rates."""
    try:
        saved = read_json_object(checkpoint / "train_config.json") if checkpoint else None
    except ValueError:  # a checkpoint written without one: nothing to compare
        return
    data_changes = changed_settings(stream_settings(saved or {}), stream_settings(cfg.to_dict()))
    if data_changes:  # the row count held (Checkpointer.resume refuses otherwise), the rows may not
        run.print(
            f"WARNING: resumed with data settings changed since {checkpoint}: "
            f"{', '.join(data_changes)}; from step {step + 1} the run reads other rows than "
            f"the checkpoint's run would have"
        )
    if not saved or not isinstance(saved.get("optim"), dict):
        return
    was = {f"optim.{key}": value for key, value in saved["optim"].items()}
    was["training.steps"] = saved.get("training", {}).get("steps")
    now = {f"optim.{key}": value for key, value in dataclasses.asdict(cfg.optim).items()}
    now["training.steps"] = cfg.training.steps
    changed = [key for key in now if key in was and was[key] != now[key]]
    if not changed:
        return
    run.print(
        f"resumed with settings changed since {checkpoint}: "
        + ", ".join(f"{key} {was[key]} -> {now[key]}" for key in changed)
        + f"; the config's values apply from step {step + 1}"
    )
    moved = [key for key in changed if key in SCHEDULE_KEYS]
    if not moved:
        return
    old = dataclasses.replace(
        cfg.optim, **{key[6:]: was[key] for key in moved if key.startswith("optim.")}
    )
    old_total = was["training.steps"] or cfg.training.steps
    before = learning_rate(step, old, old_total)
    continued = learning_rate(min(step + 1, old_total), old, old_total)  # a finished run's lr holds
    after = learning_rate(step + 1, cfg.optim, cfg.training.steps)
    if not math.isclose(after, continued, rel_tol=1e-9):
        run.print(
            f"WARNING: {', '.join(f'{key} {was[key]} -> {now[key]}' for key in moved)} moves "
            "the "
            f"{cfg.optim.schedule} schedule under the run: the learning rate goes from "
            f"{before:.2e} at step "
            f"{step} to {after:.2e} at step {step + 1} (GUIDE.md, Continuing a run: schedule "
            '= "wsd" runs '
            f"can be extended)"
        )


class Interruption:
    """Ctrl-C (SIGINT) or SIGTERM while training: the step in progress finishes, a checkpoint is
    saved and the run stops; a second signal stops at once, without saving. Every rank stops at the
    same step: train_step sums each rank's `flag` over the ranks, in the step's one copy."""

    def __init__(self, run: Process):
        self.run, self.name, self.previous = run, None, {}

    def __enter__(self) -> Interruption:
        for number in (signal.SIGINT, signal.SIGTERM):
            self.previous[number] = signal.signal(number, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def handle(self, number: int, frame) -> None:
        self.name = signal.Signals(number).name
        self.restore()  # a second signal acts as usual
        print(
            f"\n{self.name}: saving a checkpoint after this step, then stopping (send it again to "
            "stop at once, "
            f"without saving)",
            file=sys.stderr,
            flush=True,
        )

    def flag(self, device: torch.device) -> torch.Tensor:
        """[1]: 1 when this rank was asked to stop, else 0; train_step sums it over the ranks in the
        step's all-reduce (a fill on the device: no copy)."""
        return torch.full((1,), float(self.name is not None), device=device)

    def requested(self, shared: bool) -> bool:
        """shared: whether a rank had been asked to stop when the step read the flags (train_step).
        A single process needs no agreement: a signal since then counts too. Several processes stop
        at the step where they agree, the next one at the latest."""
        return shared or (self.run.world_size == 1 and self.name is not None)


# A loss above this many times that of a uniform guess, ln(vocab_size), means the run diverged: a
# model starts near ln(vocab_size) and only a blown-up update goes far above it (lr 1e3: 2.6e6 at
# step 2).
DIVERGED = 3.0
# An update that more than doubles the norm of all the weights at once blew them up. A healthy step
# changes it by well under 1%; AdamW moves each weight by about lr per step, so lr 1e6 takes weights
# of about 1 to about 1e6 in one step, after which the loss can look ordinary (saturated outputs,
# zero gradients) while every checkpoint after it is garbage.
EXPLODED = 2.0


def train_step(
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    data: PackedLoader,
    cfg: TrainConfig,
    run: Process,
    routing: RoutingMonitor,
    interruption: Interruption,
    step: int,
    checkpoints: Checkpointer,
) -> tuple[float, float, float, bool]:
    """One optimizer step over grad_accum micro-batches -> (mean loss per target token, grad norm,
    the step's target tokens summed over all ranks (a fixed multiple of the step's own: the loss's
    weight in the logged interval mean), whether any rank was asked to stop).

    Every target token weighs the same, whichever micro-batch or rank holds it: each micro-batch
    is weighted by its tokens over those of the whole step (see parallel.ParallelModel).

    The host waits for the device once per step: what the step's checks need (loss, grad norm, the
    weights' norm before and after the update, the stop request) comes back in one copy, after the
    update. A diverged step has then updated the weights in memory, never on disk: its error stops
    the run before anything is saved. The batches' token ids were checked by data.py when read.
    """
    batches = [
        {k: v.to(run.device) for k, v in data.next_batch().items()}
        for _ in range(cfg.training.grad_accum)
    ]
    with token_ids_checked_at_load():
        # [parallel] accumulation: what communicates between them
        loss = model.accumulate_gradients(batches)
    grad_norm = model.clip_grad_norm_(cfg.optim.grad_clip or float("inf"))
    before = weight_squares(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    routing.after_step(step)  # expert loads, idle streaks, the selection bias: on the device
    squares = torch.stack([before, weight_squares(model)]).to(model.collective_device)
    targets = sum((batch["targets"] != -100).sum() for batch in batches).float().reshape(1)
    # [before^2, after^2, target tokens, stop requests]
    shared = torch.cat([squares, targets.to(squares.device), interruption.flag(squares.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        # squares: replicas counted on each rank that holds them, the same way every step
        dist.all_reduce(shared)
    norms = torch.cat([shared[:2].sqrt(), shared[2:]])
    checked = torch.cat([torch.stack([loss.float(), grad_norm.float()]).to(norms.device), norms])
    # the step's one copy to the host
    loss, grad_norm, before, after, targets, stop = checked.tolist()
    check_loss(loss, grad_norm, step, model, cfg, checkpoints)
    check_update(before, after, step, cfg, checkpoints)
    return loss, grad_norm, targets, stop > 0


def check_loss(
    loss: float,
    grad_norm: float,
    step: int,
    model: ParallelModel,
    cfg: TrainConfig,
    checkpoints: Checkpointer,
) -> None:
    """Stops the run, before anything is saved, on a non-finite loss or gradient norm, or a loss far
    above a uniform guess's."""
    uniform = math.log(model.config.vocab_size)  # the loss of a model that predicts nothing
    if math.isfinite(loss) and math.isfinite(grad_norm) and loss <= DIVERGED * uniform:
        return
    latest = checkpoints.latest()
    raise TrainingError(
        f"step {step}: the training loss is {loss} (a uniform guess scores "
        f"{uniform:.2f}) and "
        f"the gradient norm {grad_norm}: the run diverged; nothing of this step is "
        "saved. "
        f"The last good checkpoint is {latest or 'none (none was saved yet)'}; "
        f"{divergence_remedy(cfg)}"
    )


def weight_squares(model: ParallelModel) -> torch.Tensor:
    """The sum of squares of this rank's local weights, on the device (no host sync)."""
    squares = torch.zeros((), device=next(model.module.parameters()).device)
    for param in model.module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        # no FP32 copy
        squares += torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()
    return squares


def check_update(
    before: float, after: float, step: int, cfg: TrainConfig, checkpoints: Checkpointer
) -> None:
    """Stops the run, before anything is saved, when the update made the weights non-finite or blew
    them up. before, after: the norm of all the weights (summed over the ranks) around the
    update."""
    if math.isfinite(after) and after <= EXPLODED * before:
        return
    latest = checkpoints.latest()
    raise TrainingError(
        f"step {step}: the update took the norm of the weights from {before:.4g} to "
        f"{after:.4g}: "
        "the run diverged; nothing of this step is saved. The last good checkpoint "
        "is "
        f"{latest or 'none (none was saved yet)'}; {divergence_remedy(cfg)}"
    )


def divergence_remedy(cfg: TrainConfig) -> str:
    """What to lower after a divergence: the learning rates that drive the update (Muon's matrices
    step at muon_lr), and the router-loss coefficients when their losses join the loss."""
    o, config = cfg.optim, cfg.model_config
    rates = (
        [f"optim.muon_lr (now {o.muon_lr:g}, {cfg.where('optim.muon_lr')})"]
        if o.name == "muon"
        else []
    )
    rates.append(f"optim.lr (now {o.lr:g}, {cfg.where('optim.lr')})")
    remedy = f"a lower {' or '.join(rates)} or more warmup"
    coefficients = [name for name in COEFFICIENTS if getattr(config, name)]
    if getattr(config, "output_router_logits", False) and getattr(
        config, "router_aux_loss_coef", 0
    ):
        coefficients.insert(0, "router_aux_loss_coef")  # Flint's published balance term
    if not coefficients:
        return f"try {remedy}{fp8_suspect(cfg)}"
    listed = ", ".join(
        f"{name} = {getattr(config, name):g} ({cfg.where('model.' + name)})"
        for name in coefficients
    )
    return (
        f"the loss holds the router losses of [model] {listed}: try a lower coefficient, or "
        f"{remedy}{fp8_suspect(cfg)}"
    )


def fp8_suspect(cfg: TrainConfig) -> str:
    """A NaN or an overflowing scale in FP8 matmuls (fp8.py lets them through) reaches the same
    checks: name it."""
    if cfg.parallel.fp8 == "none":
        return ""
    return (
        f"; the matmuls run in FP8 (parallel.fp8 = {cfg.parallel.fp8!r}, "
        f"{cfg.where('parallel.fp8')}): "
        f'a run with fp8 = "none" from the same checkpoint tells whether FP8 causes it'
    )


def evaluate(model: ParallelModel, data: PackedLoader, cfg: TrainConfig, run: Process) -> float:
    """Mean loss per target token over the same first validation batches every time."""
    data.rewind()
    count = min(
        cfg.training.eval_batches, data.rows_per_epoch // (run.dp_size * cfg.training.batch_size)
    )
    batches = [{k: v.to(run.device) for k, v in data.next_batch().items()} for _ in range(count)]
    num_tokens = model.global_tokens(torch.stack([b["targets"] for b in batches]))
    with token_ids_checked_at_load():
        return sum(model.loss(**batch, num_tokens=num_tokens) for batch in batches).item()


# Rank 0 loads the final model on the CPU in FP32 for the sample only up to this size (4 GB).
SAMPLE_MAX_PARAMS = 1_000_000_000


def finish(
    checkpoint: Path, tokenizer: Tokenizer, cfg: TrainConfig, run: Process, logger: MetricsLogger
) -> dict:
    """The Hugging Face export (with the run's tokenizer in transformers' format) and a text sample
    when asked, made by rank 0 from the final checkpoint, whatever layout (sharded, expert- or
    pipeline-split) trained it. The export streams one tensor at a time and comes first; the sample
    needs the whole model in one process, so large models skip it, and a failing sample is reported
    without failing the run."""
    t, export = cfg.training, cfg.checkpoint.export_hf
    with main_rank_works(run):
        if run.is_main and export:
            from convert import MergedSource, NativeDir, export_published, published_extras

            dtype = (
                getattr(torch, cfg.checkpoint.export_dtype) if cfg.checkpoint.export_dtype else None
            )
            config = config_from_hf(checkpoint / "config.json")
            # Training keeps no vision tower or draft head: the export copies them from the
            # init_from source.
            extras = published_extras(cfg.model.init_from, config) if cfg.model.init_from else None
            source = MergedSource(checkpoint) if cfg.lora.enabled else NativeDir(checkpoint)
            export_published(source, config, export, dtype, extras=extras, tokenizer=tokenizer)
            run.print(
                f"exported the model{' merged with its LoRA adapters' * cfg.lora.enabled} and "
                f"its tokenizer in Hugging Face format to {export}"
            )
        if run.is_main and t.sample_tokens:
            with torch.device("meta"):
                saved = config_from_hf(checkpoint / "config.json")
                num_params = model_class(saved)(saved).num_params()
            if num_params > SAMPLE_MAX_PARAMS:
                run.print(
                    f"sample skipped: {num_params / 1e9:.1f}B parameters do not fit one "
                    "process (the limit "
                    f"is {SAMPLE_MAX_PARAMS / 1e9:.0f}B); export with checkpoint.export_hf "
                    "and sample "
                    f"from the export in an inference engine"
                )
            else:
                draw_sample(checkpoint, tokenizer, t, logger, run)
    logger.write_report()  # report.py's page of the run, in its directory
    return logger.summary


def draw_sample(
    checkpoint: Path, tokenizer: Tokenizer, t: TrainingSection, logger: MetricsLogger, run: Process
) -> None:
    """sample.py's generation from the final checkpoint, printed as it comes."""
    from sample import generate_text
    from sample import load_model as load_for_sampling

    run.print(
        f"sample ({t.sample_tokens} tokens, temperature {t.sample_temperature}; more with "
        f"python3 sample.py --checkpoint {checkpoint}):"
    )
    try:
        model = load_for_sampling(checkpoint)
        print(t.sample_prompt, end="", flush=True)
        text = generate_text(
            model,
            tokenizer,
            t.sample_prompt,
            t.sample_tokens,
            t.sample_temperature,
            None,
            torch.Generator().manual_seed(t.seed),
            on_text=lambda s: print(s, end="", flush=True),
        )
    # the checkpoint and export are already written: report, never lose them
    except Exception as error:
        print(
            f"\nWARNING: the sample failed ({type(error).__name__}: {error}); the checkpoint "
            f"{checkpoint} "
            f"is complete",
            file=sys.stderr,
            flush=True,
        )
        return
    print(flush=True)
    logger.summary["sample"] = t.sample_prompt + text


if __name__ == "__main__":
    # Run as a script, this module is __main__, and a later `import train` (tools/rehearsal.py)
    # would load a second copy whose error classes the handler below does not catch: that import
    # gets this module.
    sys.modules.setdefault("train", sys.modules[__name__])
    try:
        main()
    except (CheckpointError, ConfigError, DataError, TokenizerError, TrainingError) as error:
        raise SystemExit(f"error: {error}")
    except KeyboardInterrupt:  # a second Ctrl-C: explain_stop said what was saved and how to resume
        raise SystemExit(128 + signal.SIGINT)
