"""The rehearsal (tools/rehearsal.py, `train.py --dry-run`): its memory count, its fake world, and
that it fails where the GPU job would."""

import json
import os
import re
import xml.etree.ElementTree as ElementTree

import pytest
import torch

import tools.rehearsal as rehearsal
import train
from config import load_config
from helpers import DEFAULT_FAMILY, debug_configs, only
from registry import family, model_class
from tools.rehearsal import GIB, PeakMemory, RehearsalError

# their own configs and numbers; the rest rehearse the debug config
FLINT, LARGE4 = only("flint"), only("large4")

MIB = 2**20


def test_peak_memory_counts_each_storage_once_and_follows_frees_and_resizes():
    tracker = PeakMemory()
    with tracker.watching():
        a = torch.zeros(MIB // 4)  # 1 MiB of FP32
        view = a[: MIB // 8]  # a view: no new memory
        b = torch.ones(MIB // 2, dtype=torch.bfloat16)  # 1 MiB
        c = b + 1  # 1 MiB
        tracker.settle()
        assert tracker.now == tracker.peak == 3 * MIB
        del a, view
        tracker.settle()  # a Python free is counted at the next op, or here
        assert tracker.now == 2 * MIB and tracker.peak == 3 * MIB
        c.untyped_storage().resize_(0)  # how FSDP2 frees a gathered weight
        tracker.settle()
        assert tracker.now == MIB
    assert tracker.largest_at_peak(1)[0][0] == "start: aten.zeros.default"


def rehearse_tiny(
    tmp_path, capsys, *overrides: str, world: int = 4, steps: int = 1, config: str = ""
) -> dict:
    """A rehearsal of configs/{config}.toml (by default the debug config of the first registered
    family)."""
    path = f"configs/{config}.toml" if config else debug_configs()[DEFAULT_FAMILY]
    cfg = load_config(
        path,
        [
            f"--checkpoint.dir={tmp_path}/ck",
            f"--logging.jsonl={tmp_path}/m.jsonl",
            "--parallel.activation_checkpointing=full",
            *overrides,
        ],
    )
    result = rehearsal.rehearse(cfg, world, rank=world - 1, steps=steps)
    result["printed"] = capsys.readouterr().out
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, layout, world, mesh",
    [
        pytest.param("debug", ["--parallel.ep=2"], 4, "dp_shard 2 x ep 2", marks=FLINT),
        pytest.param("debug", ["--parallel.pp=2"], 4, "pp 2 x dp_shard 2", marks=FLINT),
        pytest.param(
            "debug", ["--parallel.cp=2", "--parallel.ep=2"], 4, "ep 2 x cp 2", marks=FLINT
        ),
        pytest.param(
            "large4-smoke", ["--parallel.pp=2", "--training.steps=10"], 2, "pp 2", marks=LARGE4
        ),
    ],
)
def test_a_tiny_job_is_rehearsed_on_a_fake_world_of_its_size(
    tmp_path, capsys, config, layout, world, mesh
):
    result = rehearse_tiny(tmp_path, capsys, *layout, world=world, config=config)
    printed = result["printed"]
    for phase in (
        f"fake world of {world} ({mesh})",
        "data: data/python_reference.jsonl has enough rows",
        "step 1: forward, backward, clipping and adamw passed",
        "checkpoint:",
        f"rank {world - 1} of {world}: peak",
    ):
        assert phase in printed, printed
    assert 0 < result["peak_gib"] < 0.1 and result["estimate_gib"] > 0
    assert not torch.distributed.is_initialized()  # the fake world is gone
    picture = tmp_path / f"rehearsal_rank{world - 1}_of_{world}_memory.svg"
    assert f"by what holds it: {picture}" in printed
    assert drawn_peak_gib(picture) == pytest.approx(result["peak_gib"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["--parallel.ep=2"], id="fsdp-ep"),
        pytest.param(["--parallel.pp=2"], id="pipeline", marks=pytest.mark.slow),
        pytest.param(
            ["--parallel.cp=2", "--training.grad_accum=2"],
            id="cp-accumulation",
            marks=pytest.mark.slow,
        ),
        pytest.param(["--optim.name=muon"], id="muon", marks=pytest.mark.slow),
        pytest.param(["--parallel.offload=true"], id="offload", marks=pytest.mark.slow),
        pytest.param(
            ["--parallel.activation_checkpointing=none", "--parallel.dp_replicate=2"],
            id="hsdp",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_one_step_after_the_states_measures_the_peak_of_two_steps_without(
    tmp_path, capsys, monkeypatch, layout
):
    """The rehearsal makes the optimizer's states before step 1 and runs one step: its peak is that
    of the two steps it ran before (step 1 making the states at its end, step 2 the steady step), in
    the same phase, to within a step's scalars (its loss, norms and token counts live into the next:
    80 bytes measured under ep 2, 372 with 2 micro-batches; nothing that grows with the model)."""
    one_step = rehearse_tiny(tmp_path / "one", capsys, *layout)
    monkeypatch.setattr(rehearsal, "make_optimizer_states", lambda optimizer, tracker: None)
    before = rehearse_tiny(tmp_path / "before", capsys, *layout, steps=2)
    assert "step 2: forward" in before["printed"] and "step 2:" not in one_step["printed"]
    assert one_step["phase"] == before["phase"] == "forward and backward"
    assert abs(one_step["peak_gib"] - before["peak_gib"]) * GIB <= 1024, (one_step, before)
    assert one_step["host_gib"] == before["host_gib"]


def drawn_peak_gib(picture) -> float:
    """The GiB at which the memory timeline draws its peak line, read through its y axis' tick
    labels."""
    svg, ns = ElementTree.parse(picture).getroot(), {"s": "http://www.w3.org/2000/svg"}
    ticks = [
        (float(t.get("y")), float(t.text))
        for t in svg.find("s:g[@class='y-ticks']", ns).findall("s:text", ns)
    ]
    (y0, v0), (y1, v1) = ticks[0], ticks[-1]
    return v0 + (float(svg.find("s:line[@class='peak']", ns).get("y1")) - y0) * (v1 - v0) / (
        y1 - y0
    )


@pytest.mark.slow
def test_train_py_dry_run_exits_zero(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        train.main(
            [
                "--config",
                str(debug_configs()[DEFAULT_FAMILY]),
                "--dry-run",
                "--world-size=2",
                f"--checkpoint.dir={tmp_path}/ck",
                f"--logging.jsonl={tmp_path}/m.jsonl",
            ]
        )
    assert stop.value.code == 0
    assert "rehearsal rank 0 of 2: peak" in capsys.readouterr().out
    assert not (tmp_path / "ck").exists()  # a rehearsal writes no checkpoint


@pytest.mark.slow
def test_train_py_dry_run_rehearses_a_pipelines_first_and_last_rank(tmp_path, capsys):
    """Under a pipeline the last rank (the head's stage) usually holds the most: --dry-run rehearses
    rank 0 and it; --rank picks one."""
    args = [
        "--config",
        str(debug_configs()[DEFAULT_FAMILY]),
        "--dry-run",
        "--parallel.pp=2",
        f"--checkpoint.dir={tmp_path}/ck",
        f"--logging.jsonl={tmp_path}/m.jsonl",
    ]
    for extra, ranks in (([], [0, 1]), (["--rank=1"], [1])):
        with pytest.raises(SystemExit):
            train.main(args + extra)
        out = capsys.readouterr().out
        assert re.findall(r"rehearsal rank (\d) of 2: peak", out) == [str(r) for r in ranks]


@pytest.mark.slow
@FLINT
def test_a_layout_whose_weights_exceed_the_gpu_fails_before_its_first_step(capsys):
    cfg = load_config(
        "configs/flint-8gpu.toml",
        ["--data.path=data/pretrain", "--parallel.ep=1", "--parallel.dp_shard=1"],
    )
    with pytest.raises(
        RehearsalError,
        match=r"rank 0 of 1 needs 1\d\d\.\d GiB .* more than the "
        r"79.6 GiB of an H100",
    ):
        rehearsal.rehearse(cfg, 1, gpu="H100")
    assert "step 1" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_grouped_gemm_misalignment_fails_as_on_a_gpu(tmp_path, capsys, monkeypatch):
    # 12 BF16 values are 24 bytes: CUDA's grouped GEMM needs rows of a multiple of 16 bytes. The
    # config refuses this width; a model that slipped past its config check meets the kernel's own.
    cfg = load_config(debug_configs()[DEFAULT_FAMILY], [f"--checkpoint.dir={tmp_path}/ck"])
    cfg.model_config.moe_intermediate_size = 12
    with pytest.raises(RehearsalError, match=r"moe.py:\d+, grouped_mm.*16 bytes"):
        rehearsal.rehearse(cfg, 2)


@pytest.mark.slow
@FLINT
def test_an_fp32_unit_meeting_bf16_fails_as_on_a_gpu(tmp_path, capsys, monkeypatch):
    # Experts put in a block's FP32 unit are gathered in FP32 while their rows arrive in BF16: the
    # grouped GEMM refuses the mix, as it would on a GPU.
    from flint_model import Flint
    from moe import MoE

    monkeypatch.setattr(
        Flint,
        "fp32_modules",
        lambda self, layer: [layer.self_attn.sinks]
        + ([layer.mlp.router, layer.mlp.experts] if isinstance(layer.mlp, MoE) else []),
    )
    with pytest.raises(RehearsalError, match="grouped_mm.*BF16|bfloat16"):
        rehearse_tiny(tmp_path, capsys, world=2, config="debug")


@pytest.mark.slow
def test_missing_user_data_is_reported_by_the_rehearsal_and_refused_by_the_run(tmp_path, capsys):
    result = rehearse_tiny(tmp_path, capsys, f"--data.path={tmp_path}/corpus", world=2)
    assert (
        f"data: not checked: command line --data.path: data.path {tmp_path}/corpus does not exist"
        in result["printed"]
    )
    with pytest.raises(train.ConfigError, match="python3 prepare.py prepare"):
        train.main(
            ["--config", str(debug_configs()[DEFAULT_FAMILY]), f"--data.path={tmp_path}/corpus"]
        )


def test_too_little_data_for_the_world_fails_the_rehearsal(tmp_path, capsys):
    with pytest.raises(train.DataError, match="not enough data"):
        rehearse_tiny(tmp_path, capsys, "--training.steps=100000", world=2)


# --------------------------------------------------------------- every GPU config, at its real size


def released_checkpoint(tmp_path, name: str) -> str:
    """A stand-in for a released checkpoint directory: its config.json only (a rehearsal reads no
    weight). Each family's released preset is named as the family is."""
    config = family(name).config.from_name(name)
    directory = tmp_path / f"released-{name}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    return str(directory)


def rehearse_config(tmp_path, capsys, name: str, world: int, *overrides: str) -> dict:
    """Rank 0 of the job, and under a pipeline also its last rank (the head's stage, often the
    busiest): each passes its step, and tools/memory.py's estimate, made for the busiest stage,
    agrees with the largest of their peaks (the balanced routing both assume) -> that rank's
    result."""
    cfg = load_config(
        f"configs/{name}.toml",
        [f"--checkpoint.dir={tmp_path}/ck", f"--logging.jsonl={tmp_path}/m.jsonl", *overrides],
    )
    results = []
    for rank in rehearsal.ranks_to_rehearse(cfg, world, None):
        results.append(rehearsal.rehearse(cfg, world, rank, gpu="H200"))
        printed = capsys.readouterr().out
        assert (
            f"rehearsal rank {rank} of {world}: step 1: forward, backward, clipping and adamw "
            "passed" in printed
        ), printed
        assert f"rehearsal rank {rank} of {world}: peak" in printed
    result = max(results, key=lambda r: r["peak_gib"])
    assert abs(result["estimate_gib"] - result["peak_gib"]) <= 0.1 * result["peak_gib"], result
    return result


@pytest.mark.slow
@FLINT
def test_flint_8gpu_is_rehearsed_at_its_real_size(tmp_path, capsys):
    """The released Flint, 8 ranks as dp_shard 2 x ep 4 (experts split 64 per rank), without
    activation checkpointing: what `torchrun --nproc-per-node 8 train.py --config
    configs/flint-8gpu.toml` runs on rank 0 (101.6 GiB, memory.py 95.3: within 10 %)."""
    result = rehearse_config(tmp_path, capsys, "flint-8gpu", 8)
    assert result["peak_gib"] < rehearsal.GPU_GIB["H200"]


@pytest.mark.slow(beyond_ci=True)  # released-size rehearsals of minutes each
@pytest.mark.parametrize(
    "name, world, overrides",
    [
        pytest.param("flint-multinode", 32, (), marks=FLINT),
        pytest.param("flint", 64, (), marks=FLINT),
        pytest.param("large4-256gpu", 256, (), marks=LARGE4),
        pytest.param("finetune", 8, ("init_from:flint",), marks=FLINT),
        pytest.param("flint-lora", 2, ("init_from:flint",), marks=FLINT),
        pytest.param("large4", 256, ("init_from:large4",), marks=LARGE4),
        pytest.param("large4-lora", 48, ("init_from:large4",), marks=LARGE4),
    ],
)
def test_every_gpu_config_is_rehearsed_at_its_real_size(tmp_path, capsys, name, world, overrides):
    args = [
        f"--model.init_from={released_checkpoint(tmp_path, o.split(':')[1])}" for o in overrides
    ]
    rehearse_config(tmp_path, capsys, name, world, *args)


@pytest.mark.slow
@FLINT  # every parameter trainable (16 bytes each)
def test_offload_counts_the_sharded_states_in_host_memory(tmp_path, capsys):
    """[parallel] offload: the GPU's peak leaves out the shards of weights, gradients and AdamW
    states (16 bytes per trainable parameter's shard), which the rehearsal reports as host
    memory."""
    on_gpu = rehearse_tiny(tmp_path / "gpu", capsys, world=2, config="debug")
    offloaded = rehearse_tiny(
        tmp_path / "host", capsys, "--parallel.offload=true", world=2, config="debug"
    )
    config = load_config("configs/debug.toml").model_config
    with torch.device("meta"):
        params = model_class(config)(config).num_params()
    assert offloaded["host_gib"] == pytest.approx(16 * params / 2 / GIB, rel=0.02)
    assert offloaded["peak_gib"] < on_gpu["peak_gib"]
    assert "GiB in host memory ([parallel] offload)" in offloaded["printed"]


@pytest.mark.slow
@FLINT
def test_a_lora_job_is_rehearsed_with_its_base_frozen(tmp_path, capsys):
    """[lora] on the debug model (its config.json as the init_from, as for the released configs):
    the frozen base has no gradient and no AdamW states, so the peak is below full training's
    although the adapters add weights (the activations of so small a model are most of either
    peak)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(
        json.dumps(load_config("configs/debug.toml").model_config.to_hf_config())
    )
    full = rehearse_tiny(
        tmp_path / "full",
        capsys,
        f"--model.init_from={base}",
        "--model.preset=",
        world=2,
        config="debug",
    )
    adapted = rehearse_tiny(
        tmp_path / "lora",
        capsys,
        f"--model.init_from={base}",
        "--model.preset=",
        '--lora.targets=["all"]',
        "--lora.rank=8",
        world=2,
        config="debug",
    )
    assert "step 1: forward, backward, clipping and adamw passed" in adapted["printed"]
    # 0.86 measured
    assert adapted["peak_gib"] < 0.9 * full["peak_gib"], (adapted["peak_gib"], full["peak_gib"])


@pytest.mark.slow
@FLINT
def test_accumulation_auto_is_resolved_for_the_jobs_gpu(tmp_path, capsys, monkeypatch):
    """The rehearsal runs a step's micro-batches as train.py does
    (ParallelModel.accumulate_gradients), with [parallel] accumulation "auto" resolved against the
    GPU's memory, not this host's (here: none at all)."""
    import parallel

    monkeypatch.setattr(parallel, "device_memory_bytes", lambda device_type: 0)
    result = rehearse_tiny(tmp_path, capsys, "--training.grad_accum=2", world=2)
    assert "GiB, accumulation gathered (" in result["printed"], result["printed"]


@pytest.mark.slow
def test_train_py_dry_run_as_a_script_reports_a_failing_rehearsal_in_one_line():
    """`python train.py --dry-run` runs train.py as __main__, and tools/rehearsal.py's `import
    train` loaded a second copy: RehearsalError subclassed that copy's TrainingError, which
    __main__'s handler did not catch, so every verdict came out as a traceback. The tests that
    import train could not see it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # a vocabulary of 10^8: its tables pass 80 GiB
    debug = debug_configs()[DEFAULT_FAMILY].relative_to(root)
    done = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            str(debug),
            "--model.vocab_size=100000000",
            "--dry-run",
            "--world-size=1",
            "--gpu=H100",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {debug}: rank 0 of 1 needs "), (
        done.stderr
    )
    assert "more than the 79.6 GiB of an H100" in lines[0]


TWO_EXPERTS = {"flint": ["--model.num_experts=2"], "large4": ["--model.n_routed_experts=2"]}


@pytest.mark.slow
def test_experts_shorter_than_the_shards_with_an_uneven_dim_1_are_rehearsed(tmp_path, capsys):
    """2 experts of 64 rows over 3 FSDP ranks: dim 0 is shorter than the shards and 64 does not
    split 3 ways, where FSDP2 refuses a split of dim 1 ("uneven sharding on dim 1", Flint on 768
    ranks): dim 0 is padded instead (parallel.least_padding), and the rehearsal goes through its
    steps and an evaluation."""
    result = rehearse_tiny(
        tmp_path, capsys, *TWO_EXPERTS[DEFAULT_FAMILY], "--model.num_experts_per_tok=1", world=3
    )
    assert "evaluation (train.py's" in result["printed"] and "step 1: forward" in result["printed"]


def test_a_failure_while_laying_out_the_model_is_a_rehearsal_verdict(tmp_path, capsys, monkeypatch):
    """The rehearsal built the model outside its error handling: a layout torch refuses came out as
    a traceback. A least_padding that splits dim 1 whatever its length (as it did) stands for such a
    refusal."""
    from torch.distributed.tensor import Shard

    import parallel

    monkeypatch.setattr(
        parallel,
        "least_padding",
        lambda shards: lambda param: Shard(1) if param.dim() > 1 else None,
    )
    debug = re.escape(debug_configs()[DEFAULT_FAMILY].name)
    with pytest.raises(
        RehearsalError,
        match=debug + r": rank 2 of 3 fails while laying out the "
        r"model "
        r"\(parallel.py:\d+, shard\), as the GPU job would: "
        r"NotImplementedError: FSDP does not support uneven sharding on dim 1",
    ) as refused:
        rehearse_tiny(tmp_path, capsys, world=3)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_each_phase_is_printed_as_it_starts_and_the_picture_last(tmp_path, capsys):
    """A large job's rehearsal runs for minutes on a busy CPU: each phase prints a line as it starts
    and one as it ends, with the seconds since the rehearsal began; the last line names the memory
    picture, written beside [logging] jsonl."""
    result = rehearse_tiny(tmp_path, capsys, world=2, steps=2)
    printed = [
        line for line in result["printed"].splitlines() if line.startswith("rehearsal ")
    ]  # data.py's own line between
    started = r"rehearsal rank 1 of 2: (.*) \.\.\. \(at (\d+\.\d) s\)$"
    ended = r"rehearsal rank 1 of 2: (.*) \((\d+\.\d) s, at (\d+\.\d) s\)$"
    assert all(re.match(started, line) or re.match(ended, line) for line in printed), printed
    starts = [re.match(started, line).group(1) for line in printed if re.match(started, line)]
    assert starts == [
        "joining a fake world of 2",
        "data: checking data/python_reference.jsonl (preparing it as rank 0 would)",
        "building the model on meta and sharding it",
        "step 1: tracing the forward, backward and adamw on fake tensors",
        "step 2: tracing the forward, backward and adamw on fake tensors",
        "evaluation: tracing on fake tensors",
    ]
    first_step = next(i for i, line in enumerate(printed) if "step 1: tracing" in line)
    assert "step 1: forward, backward, clipping and adamw passed" in printed[first_step + 1]
    times = [float(re.search(r"at (\d+\.\d) s\)$", line).group(1)) for line in printed]
    assert times == sorted(times)
    picture = tmp_path / "rehearsal_rank1_of_2_memory.svg"
    assert printed[-1].startswith(
        f"rehearsal rank 1 of 2: live memory over the steps, by phase "
        f"and by what holds it: {picture} (beside [logging] jsonl)"
    )
    assert picture.is_file()
