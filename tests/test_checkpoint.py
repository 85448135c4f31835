"""checkpoint.py: saving, exact resume, crash-safe saves, and the checks on what a checkpoint holds.

GUIDE.md's Reliability table: each guarantee whose outcome depends on what a model saves (exact
resume, crash-safe saves, damage found, no diverged checkpoint) runs once per registered family; the
machinery that is the same whatever the model holds (locks, run directories, the shared log,
SIGTERM, asynchronous saves) runs on the first registered family, as its docstring says."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import checkpoint
import checkpoint_files
import convert
import train
from checkpoint import CheckpointError
from helpers import (
    DEFAULT_FAMILY,
    FAMILY_NAMES,
    FIRST_FAMILY_THEN_SECOND_TIER,
    debug_args,
    debug_configs,
    free_port,
    records,
    run_debug,
    start,
    train_losses,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_resume_gives_exactly_the_uninterrupted_losses(family, tmp_path):
    common = [
        "--training.steps=6",
        "--training.grad_accum=2",
        "--logging.every=1",
        "--checkpoint.every=2",
        "--checkpoint.keep_last=2",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path, *common, family=family)
    uninterrupted = train_losses(tmp_path)
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir())
    # keep_last = 2
    assert checkpoints == [".lock", "report.html", "run.json", "step_00000004", "step_00000006"]
    shutil.rmtree(tmp_path / "ckpt" / "run_0001" / "step_00000006")
    with open(tmp_path / "metrics.jsonl", "a") as log:
        log.write('{"step": 7, "lo')  # a line cut off by a crash
    run_debug(tmp_path, *common, "--checkpoint.resume=auto", family=family)
    steps = [(r["step"], "loss" in r) for r in records(tmp_path)]
    assert sorted(set(steps)) == sorted(steps) and [s for s, train in steps if train] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert train_losses(tmp_path) == uninterrupted  # bit for bit
    # continued there
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "run_0001"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_a_crash_while_saving_keeps_the_last_good_checkpoint(family, tmp_path, monkeypatch):
    real_save = checkpoint.save_dcp

    def crash_at_step_4(state, path, *how):
        if path.name.startswith("step_00000004"):
            (path / "__0_0.distcp").write_bytes(b"half written")
            raise KeyboardInterrupt("power cut")
        return real_save(state, path, *how)

    monkeypatch.setattr(checkpoint, "save_dcp", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        run_debug(
            tmp_path,
            "--training.steps=4",
            "--checkpoint.every=2",
            "--training.sample_tokens=0",
            family=family,
        )
    monkeypatch.setattr(checkpoint, "save_dcp", real_save)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [
        ".lock",
        "run.json",
        "step_00000002",
        "step_00000004.tmp",
    ]
    summary = run_debug(
        tmp_path,
        "--training.steps=4",
        "--checkpoint.resume=auto",
        "--training.sample_tokens=0",
        family=family,
    )
    assert summary["step"] == 4  # resumed from step 2 and went on
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000002",
        "step_00000004",
    ]


@pytest.mark.slow
def test_checkpoint_from_another_architecture_is_refused(tmp_path):
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    checkpoint = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    # Large 4's is nested
    architecture = r"different architecture: (text_config\.)?hidden_size = 64 there, 96 here$"
    with pytest.raises(CheckpointError, match=architecture):
        run_debug(tmp_path, "--model.hidden_size=96", f"--checkpoint.resume={checkpoint}")


@pytest.mark.slow
@pytest.mark.parametrize("written", ["{not json", '{"model_type": "flint", "hidden_size": -4}'])
def test_an_explicit_resume_of_a_checkpoint_with_a_bad_config_says_so_in_one_line(
    tmp_path, trained_once, written
):
    path = tmp_path / "copy"
    shutil.copytree(trained_once, path)
    (path / "config.json").write_text(written)
    with pytest.raises(
        CheckpointError, match=rf"{path / 'config.json'}: not a usable model config"
    ) as refused:
        run_debug(tmp_path, f"--checkpoint.resume={path}")
    assert "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_auto_resume_that_can_read_no_checkpoint_stops(family, tmp_path):
    """Checkpoints found, none intact: the run stops and says so, and never starts over from step
    1."""
    run_debug(
        tmp_path,
        "--training.steps=2",
        "--checkpoint.every=1",
        "--training.sample_tokens=0",
        family=family,
    )
    for step in (1, 2):
        (tmp_path / "ckpt" / "run_0001" / f"step_0000000{step}" / ".metadata").write_bytes(
            b"garbage"
        )
    with pytest.raises(
        CheckpointError,
        match=r'resume = "auto" found 2 checkpoint\(s\) .* none is '
        r"intact",
    ):
        run_debug(
            tmp_path,
            "--training.steps=3",
            "--checkpoint.resume=auto",
            "--training.sample_tokens=0",
            family=family,
        )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "run_0001"]


@pytest.mark.slow
def test_rerunning_never_deletes_a_run_and_auto_continues_the_latest(tmp_path, capsys):
    short = ["--training.steps=2", "--training.sample_tokens=0"]
    run_debug(tmp_path, *short)  # debug.toml: resume = "never", as the README's first command
    run_debug(tmp_path, *short)
    ckpt = tmp_path / "ckpt"
    assert all((ckpt / run / "step_00000002").is_dir() for run in ("run_0001", "run_0002"))
    run_debug(
        tmp_path, "--training.steps=3", "--training.sample_tokens=0", "--checkpoint.resume=auto"
    )
    assert (
        f"resumed from {ckpt / 'run_0002' / 'step_00000002'} at step 2" in capsys.readouterr().out
    )
    assert sorted(p.name for p in (ckpt / "run_0002").iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000002",
        "step_00000003",
    ]
    assert sorted(p.name for p in (ckpt / "run_0001").iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000002",
    ]


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_is_refused(tmp_path):
    """Machinery independent of the model: the first registered family."""
    import fcntl

    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / ".lock", "a+") as held:  # as a running run holds it
        held.write("pid 12345 on elsewhere, since then\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(
            CheckpointError,
            match=r"ckpt is in use by another run \(pid 12345 on "
            r"elsewhere",
        ):
            run_debug(tmp_path, "--training.steps=1")
    assert not list((tmp_path / "ckpt").glob("run_*"))
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")  # released: runs


@pytest.mark.slow
def test_a_run_pointed_at_a_live_runs_own_directory_is_refused(tmp_path):
    """A live run holds its run directory's lock too: a second run whose checkpoint.dir is that
    run_0001, or one continuing it through the parent directory, is refused before any work.
    Machinery independent of the model: the first registered family."""
    import fcntl

    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    live = tmp_path / "ckpt" / "run_0001"
    with open(live / ".lock", "a+") as held:  # as the live run holds it while it trains there
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(
            CheckpointError, match=rf"checkpoint.dir {live} is in use by another run"
        ):
            run_debug(tmp_path / "second", f"--checkpoint.dir={live}", "--checkpoint.resume=auto")
        with pytest.raises(
            CheckpointError, match=rf"run directory {live} is in use by another run"
        ):
            run_debug(tmp_path, "--training.steps=2", "--checkpoint.resume=auto")
    assert sorted(p.name for p in live.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000001",
    ]


@pytest.mark.slow
def test_a_kill_during_rotation_never_leaves_a_half_deleted_checkpoint_listed(
    tmp_path, monkeypatch
):
    """keep_last renames a checkpoint away before deleting it: killed part-way through the delete,
    the checkpoint is no longer listed as complete, and the next run clears what is left, and the
    half-written save of a run killed while saving. Machinery independent of the model: the first
    registered family."""
    real_rmtree = shutil.rmtree

    def killed_part_way(path, *args, **kwargs):
        if not str(path).endswith(".removing"):
            return real_rmtree(path, *args, **kwargs)
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt("kill -9")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        run_debug(
            tmp_path,
            "--training.steps=2",
            "--checkpoint.every=1",
            "--checkpoint.keep_last=1",
            "--training.sample_tokens=0",
        )
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    run_dir = tmp_path / "ckpt" / "run_0001"
    (run_dir / "step_00000003.tmp").mkdir()  # and a save that was killed
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "run.json",
        "step_00000001.removing",
        "step_00000002",
        "step_00000003.tmp",
    ]
    run_debug(
        tmp_path,
        "--training.steps=3",
        "--checkpoint.resume=auto",
        "--checkpoint.keep_last=1",
        "--training.sample_tokens=0",
    )
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000003",
    ]


def test_a_stray_file_named_like_a_run_is_skipped(tmp_path):
    """Machinery independent of the model: the first registered family."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "run_0001").write_text("not a run")
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    assert (tmp_path / "ckpt" / "run_0001").read_text() == "not a run"
    assert (tmp_path / "ckpt" / "run_0002" / "step_00000001").is_dir()


@pytest.mark.slow
def test_a_truncated_data_file_without_checksums_is_reported_and_the_one_before_used(
    tmp_path, capsys
):
    """Machinery independent of the model: the first registered family."""
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=2", "--training.sample_tokens=0")
    newest = tmp_path / "ckpt" / "run_0001" / "step_00000004"
    (newest / "checksums.json").unlink()
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    run_debug(
        tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0"
    )
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {newest} is damaged" in out and f"{shard}: truncated" in out
    assert f"resumed from {newest.parent / 'step_00000002'} at step 2" in out


@pytest.mark.slow
def test_runs_sharing_a_log_never_delete_each_others_records(tmp_path):
    """A second fresh run appends to the same logging.jsonl; an explicit resume into a new run
    directory keeps the first run's records of later steps; each record names its run.
    Machinery independent of the model: the first registered family."""
    short = [
        "--training.steps=2",
        "--logging.every=1",
        "--training.sample_tokens=0",
        "--checkpoint.every=1",
    ]
    run_debug(tmp_path, *short)
    first = records(tmp_path)
    run_debug(tmp_path, *short)
    run_debug(
        tmp_path, *short, f"--checkpoint.resume={tmp_path / 'ckpt' / 'run_0001' / 'step_00000001'}"
    )
    runs = [(Path(r["run"]).name, r["step"]) for r in records(tmp_path) if "loss" in r]
    assert records(tmp_path)[: len(first)] == first
    assert runs == [
        ("run_0001", 1),
        ("run_0001", 2),
        ("run_0002", 1),
        ("run_0002", 2),
        ("run_0003", 2),
    ]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_prints_the_resume_command(tmp_path, monkeypatch, capsys):
    common = ["--training.steps=5", "--logging.every=1", "--training.sample_tokens=0"]
    run_debug(tmp_path / "whole", *common)
    uninterrupted = train_losses(tmp_path / "whole")
    real_step = train.train_step

    def signalled_during_step_3(*args):
        result = real_step(*args)
        if args[-2] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(train, "train_step", signalled_during_step_3)
    with pytest.raises(SystemExit) as stop:
        run_debug(tmp_path, *common)
    assert stop.value.code == 128 + signal.SIGTERM
    out = capsys.readouterr().out
    assert (
        f"stopped by SIGTERM after step 3; saved {tmp_path / 'ckpt' / 'run_0001' / 'step_00000003'}"
        in out
    )
    command = out.split("Resume with:\n")[1].split("\n")[0].split()
    assert command[:2] == ["python3", "train.py"] and command[-1] == "--checkpoint.resume=auto"
    monkeypatch.setattr(train, "train_step", real_step)
    train.main(command[2:])  # the printed command, as a user would paste it
    assert train_losses(tmp_path) == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_a_damaged_newest_checkpoint_is_reported_and_the_one_before_used(family, tmp_path, capsys):
    run_debug(
        tmp_path,
        "--training.steps=4",
        "--checkpoint.every=2",
        "--training.sample_tokens=0",
        family=family,
    )
    run_dir = tmp_path / "ckpt" / "run_0001"
    shard = next((run_dir / "step_00000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: checksum mismatch"):
        run_debug(
            tmp_path / "explicit", f"--checkpoint.resume={run_dir / 'step_00000004'}", family=family
        )
    run_debug(
        tmp_path,
        "--training.steps=4",
        "--checkpoint.resume=auto",
        "--training.sample_tokens=0",
        family=family,
    )
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {run_dir / 'step_00000004'} is damaged" in out
    assert f"resumed from {run_dir / 'step_00000002'} at step 2" in out


@pytest.mark.slow
@pytest.mark.parametrize("family", FIRST_FAMILY_THEN_SECOND_TIER)
def test_a_diverging_run_stops_at_the_step_it_diverges(family, tmp_path):
    """lr 3e-2 trains for a step (step_1 saved); a step at lr 1e3 then blows the weights up, and
    the run stops at that step, before saving it, naming step_1 as the last good checkpoint."""
    run_debug(
        tmp_path,
        "--optim.lr=3e-2",
        "--training.steps=1",
        "--training.sample_tokens=0",
        family=family,
    )
    good = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    with pytest.raises(
        train.TrainingError,
        match=r"step 2: the update took the norm of the "
        r"weights from [\d.]+ to "
        r"[\d.e+]+: the run diverged.*last good "
        rf"checkpoint is {good}",
    ):
        run_debug(
            tmp_path,
            "--optim.lr=1e3",
            "--optim.schedule=constant",
            "--optim.warmup_steps=0",
            "--training.steps=8",
            "--checkpoint.every=1",
            "--checkpoint.resume=auto",
            family=family,
        )
    # the report is the first run's; run.json the second's, which continued in the same directory
    assert sorted(p.name for p in good.parent.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000001",
    ]


@pytest.mark.parametrize("lr, shown", [("1e6", r"1e\+06"), ("1e30", r"1e\+30")])
def test_blown_up_weights_are_never_saved_or_exported(tmp_path, lr, shown):
    """One step at a constant lr of 1e6 (weights of about 1 moved by about 1e6) or 1e30: stopped at
    step 1 with optim.lr named; no checkpoint and no export written.
    Machinery independent of the model: the first registered family."""
    with pytest.raises(
        train.TrainingError,
        match=r"step 1: .*diverged; nothing of this step is "
        r"saved.*"
        rf"try a lower optim.lr \(now {shown}, command "
        r"line --optim.lr\)",
    ):
        run_debug(
            tmp_path,
            f"--optim.lr={lr}",
            "--optim.schedule=constant",
            "--optim.warmup_steps=0",
            "--training.steps=1",
            f"--checkpoint.export_hf={tmp_path / 'hf'}",
        )
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [
        ".lock",
        "run.json",
    ]
    assert not (tmp_path / "hf").exists()


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    real_step = train.train_step

    def poison_after_step_2(model, *args):
        result = real_step(model, *args)
        if args[-2] == 2:
            with torch.no_grad():
                next(model.module.parameters()).fill_(float("inf"))
        return result

    monkeypatch.setattr(train, "train_step", poison_after_step_2)
    with pytest.raises(
        CheckpointError,
        match=r"step 2: the weights hold non-finite values; not "
        r"saving them. "
        r"The last good checkpoint is .*step_00000001",
    ):
        run_debug(
            tmp_path, "--training.steps=4", "--checkpoint.every=1", "--training.sample_tokens=0"
        )
    good = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    assert sorted(p.name for p in good.parent.iterdir()) == [".lock", "run.json", good.name]
    assert all(torch.isfinite(t).all() for t in convert.load_native(good).state_dict().values())


def test_killed_conversions_and_preparations_leave_no_temporaries_for_good(tmp_path, trained_once):
    """A folder of a process that is gone (pid 4194304 is above Linux's pid_max) is removed by the
    next run; one of a live process (pytest's parent) is its work in progress and stays."""
    dead, live = 4194304, os.getppid()
    for name in (
        f".hf.tmp-{dead}-abc",
        f".hf.tmp-{live}-abc",
        f"prepared.tmp-{dead}",
        f"prepared.tmp-{live}",
    ):
        (tmp_path / name).mkdir()
    convert.main(["to-hf", str(trained_once), str(tmp_path / "hf")])
    from prepare import prepare
    from tokenizer import load_tokenizer

    (tmp_path / "text.txt").write_text("a document\n")
    prepare(tmp_path / "text.txt", load_tokenizer("byte", "<|endoftext|>"), tmp_path / "prepared")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".hf.tmp-{live}-abc", f"prepared.tmp-{live}", "hf", "prepared", "text.txt"]
    )


# ----------------------------------------------------------------------------- asynchronous saves


def saved_data_checksums(checkpoint_dir: Path) -> dict[str, int]:
    """The CRC-32 of each .distcp file (the tensors; .metadata holds a save id and differs per
    save)."""
    listed = json.loads((checkpoint_dir / "checksums.json").read_text())
    return {name: entry["crc32"] for name, entry in listed.items() if name.endswith(".distcp")}


@pytest.mark.slow
def test_async_save_writes_while_training_and_a_crash_in_flight_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """async_save: step 2's checkpoint is written only after steps 3 and 4 have trained (its write
    is held back until then), yet holds bit for bit the tensors of the synchronous save of step 2;
    the losses are the synchronous run's; step 4's save starts once step 2's has completed. A crash
    while step 4's save is in flight leaves step_00000004.tmp and step 2 complete (keep_last = 1
    removes it only once step 4 is complete); auto-resume picks step 2 and trains steps 3 and 4 to
    the same losses. Machinery independent of the model: the first registered family."""
    common = [
        "--training.steps=4",
        "--checkpoint.every=2",
        "--logging.every=1",
        "--training.sample_tokens=0",
    ]
    run_debug(tmp_path / "sync", *common)
    expected = train_losses(tmp_path / "sync")
    events, real_step, real_write = (
        [],
        train.train_step,
        checkpoint_files.RecordingWriter.write_data,
    )

    def recorded_step(*args):
        result = real_step(*args)
        events.append(f"trained {args[-2]}")
        return result

    def held_back_write(self, plan, planner):
        step = int(Path(self.path).name[5:13])
        if step == 4:
            events.append(
                "writing 4, step 2 "
                f"{'complete' if (run_dir / 'step_00000002').is_dir() else 'in flight'}"
            )
            (Path(self.path) / "__0_0.distcp").write_bytes(b"half written")
            raise OSError("the disk went away")
        for _ in range(600):  # up to 60 s for the main thread to train steps 3 and 4
            if "trained 4" in events:
                break
            time.sleep(0.1)
        events.append(f"writing {step}")
        return real_write(self, plan, planner)

    run_dir = tmp_path / "async" / "ckpt" / "run_0001"
    monkeypatch.setattr(train, "train_step", recorded_step)
    monkeypatch.setattr(checkpoint_files.RecordingWriter, "write_data", held_back_write)
    asynchronous = [*common, "--checkpoint.async_save=true", "--checkpoint.keep_last=1"]
    with pytest.raises(
        CheckpointError,
        match=r"step_00000004.tmp: cannot write the checkpoint: "
        r"OSError: the disk went away",
    ):
        run_debug(tmp_path / "async", *asynchronous)
    assert (
        events.index("writing 2") > events.index("trained 4")
        and "writing 4, step 2 complete" in events
    )
    assert train_losses(tmp_path / "async") == expected  # bit for bit
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "run.json",
        "step_00000002",
        "step_00000004.tmp",
    ]
    sync_step_2 = tmp_path / "sync" / "ckpt" / "run_0001" / "step_00000002"
    assert saved_data_checksums(run_dir / "step_00000002") == saved_data_checksums(sync_step_2)

    monkeypatch.setattr(checkpoint_files.RecordingWriter, "write_data", real_write)
    capsys.readouterr()
    run_debug(tmp_path / "async", *asynchronous, "--checkpoint.resume=auto")
    assert f"resumed from {run_dir / 'step_00000002'} at step 2" in capsys.readouterr().out
    # the resumed steps 3 and 4 (records of 3, 4 replaced)
    assert train_losses(tmp_path / "async") == expected
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000004",
    ]


def _rank_of_train(
    rank: int, world: int, port: int, argv: list[str], killed_at_step: int, crc_log: str
) -> None:
    """One rank of `torchrun --nproc-per-node world train.py argv`, noting in `crc_log` each file it
    checksums; with `killed_at_step`, killed (SIGKILL) half-way through writing its files of that
    step's checkpoint."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    real_write, real_crc = checkpoint_files.RecordingWriter.write_data, checkpoint_files.crc32_of

    def killed_at_its_step(self, plan, planner):
        if Path(self.path).name == f"step_{killed_at_step:08d}.tmp":
            (Path(self.path) / f"__{rank}_0.distcp").write_bytes(b"half written")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, plan, planner)

    def noted_crc(file: Path) -> int:
        with open(crc_log, "a") as log:
            log.write(f"{rank} {file.parent.name} {file.name}\n")
        return real_crc(file)

    checkpoint_files.RecordingWriter.write_data, checkpoint_files.crc32_of = (
        killed_at_its_step,
        noted_crc,
    )
    train.main(argv)


@pytest.mark.slow
def test_kill_9_of_two_ranks_during_an_async_save_keeps_the_last_checkpoint(tmp_path):
    """FSDP on 2 gloo ranks with async_save, both killed with SIGKILL while step 2's checkpoint is
    being written (after step 2 trained and was logged): step 1's checkpoint is intact, auto-resume
    picks it, and 2 ranks train step 2 again to the killed run's loss, bit for bit. Each rank
    checksums the files it wrote, and on resume verifies its share: every file read once.
    Machinery independent of the model: the first registered family."""
    argv = debug_args(
        tmp_path,
        "--training.steps=2",
        "--checkpoint.every=1",
        "--logging.every=1",
        "--training.sample_tokens=0",
        "--training.eval_every=0",
        "--parallel.dp_shard=2",
        "--checkpoint.async_save=true",
    )
    crc_log = tmp_path / "crc.log"
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        start(_rank_of_train, (2, free_port(), argv, 2, str(crc_log)), nprocs=2)
    killed = train_losses(tmp_path)
    run_dir = tmp_path / "ckpt" / "run_0001"
    assert sorted(killed) == [1, 2]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "run.json",
        "step_00000001",
        "step_00000002.tmp",
    ]
    start(
        _rank_of_train,
        (2, free_port(), [*argv, "--checkpoint.resume=auto"], 0, str(crc_log)),
        nprocs=2,
    )
    # continued it
    assert [Path(r["run"]).name for r in records(tmp_path) if "loss" in r] == ["run_0001"] * 2
    # step 2 trained again from step 1 (its record replaced)
    assert train_losses(tmp_path) == killed
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000001",
        "step_00000002",
    ]

    checksummed = [line.split() for line in crc_log.read_text().splitlines()]
    assert sorted(
        (int(rank), name) for rank, where, name in checksummed if where == "step_00000001.tmp"
    ) == [
        (0, ".metadata"),
        (0, "__0_0.distcp"),
        (0, "config.json"),
        (0, "train_config.json"),
        (1, "__1_0.distcp"),
    ]
    verified = [(int(rank), name) for rank, where, name in checksummed if where == "step_00000001"]
    assert sorted(name for _, name in verified) == sorted(
        json.loads((run_dir / "step_00000001" / "checksums.json").read_text())
    )
    assert {rank for rank, _ in verified} == {0, 1}


# ------------------------------------------------------------------ third hardening pass (issue 32)


def flip_a_bit(checkpoint_dir: Path) -> None:
    shard = next(checkpoint_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_rotation_after_skipping_a_damaged_checkpoint_keeps_the_good_one(
    tmp_path, monkeypatch, capsys
):
    """keep_last = 1: an auto resume skips a damaged step 4 and resumes step 2. The damaged step is
    set aside (renamed, never deleted, said so), so the save of step 3 rotates away step 2 only, and
    a run killed at step 4 resumes from step 3: rotation, ordered by step, once kept the damaged
    step 4 alone."""
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=2", "--training.sample_tokens=0")
    run_dir = tmp_path / "ckpt" / "run_0001"
    flip_a_bit(run_dir / "step_00000004")
    real_step = train.train_step

    def killed_at_step_4(*args):
        if args[-2] == 4:
            raise KeyboardInterrupt("kill -9")
        return real_step(*args)

    monkeypatch.setattr(train, "train_step", killed_at_step_4)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        run_debug(
            tmp_path,
            "--training.steps=6",
            "--checkpoint.every=1",
            "--checkpoint.keep_last=1",
            "--checkpoint.resume=auto",
            "--training.sample_tokens=0",
        )
    out = capsys.readouterr().out
    assert (
        f"set aside the damaged checkpoint {run_dir / 'step_00000004'} as "
        f"{run_dir / 'step_00000004.damaged'}" in out
    )
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000003",
        "step_00000004.damaged",
    ]
    monkeypatch.setattr(train, "train_step", real_step)
    run_debug(
        tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0"
    )
    assert f"resumed from {run_dir / 'step_00000003'} at step 3" in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000003",
        "step_00000004",
        "step_00000004.damaged",
    ]


DEBUG_CONFIG = debug_configs()[DEFAULT_FAMILY]
# Every [optim] key changed at once on a resume: the optimizer settings (param groups) and the
# schedule.
OPTIM_CHANGES = {
    "lr": 1e-3,
    "min_lr": 1e-4,
    "schedule": "wsd",
    "warmup_steps": 1,
    "decay_fraction": 0.5,
    "weight_decay": 0.05,
    "beta1": 0.8,
    "beta2": 0.9,
    "eps": 1e-6,
    "grad_clip": 0.5,
    "muon_lr": 0.05,
    "muon_momentum": 0.9,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_resume_trains_with_the_configs_optimizer_settings_and_says_what_changed(
    tmp_path, monkeypatch, capsys, name
):
    """A checkpoint saves the optimizer's param groups (betas, eps, weight_decay; Muon's momentum
    and lr_scale = muon_lr / lr), and set_optimizer_state_dict put them back over the config's: a
    resume trained with the saved values while printing the new ones. Now the config's values train,
    for every key, and the resume names each change."""
    run_debug(tmp_path, f"--optim.name={name}", "--training.steps=2", "--training.sample_tokens=0")
    saved = train.load_config(DEBUG_CONFIG).optim
    changes = [f"--optim.{key}={value}" for key, value in OPTIM_CHANGES.items()]
    groups, real_step = [], train.train_step

    def recorded(model, optimizer, *args):
        if not groups:  # step 3, before its update
            groups.extend(
                {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
            )
            expected = train.build_optimizer(model.module, args[1].optim)
            train.set_learning_rate(
                expected, train.learning_rate(3, args[1].optim, args[1].training.steps)
            )
            groups.append(
                [{k: v for k, v in g.items() if k != "params"} for g in expected.param_groups]
            )
        return real_step(model, optimizer, *args)

    monkeypatch.setattr(train, "train_step", recorded)
    capsys.readouterr()
    run_debug(
        tmp_path,
        f"--optim.name={name}",
        *changes,
        "--training.steps=3",
        "--checkpoint.resume=auto",
        "--training.sample_tokens=0",
    )
    *used, expected = groups
    assert used == expected
    out = capsys.readouterr().out
    for key, value in OPTIM_CHANGES.items():
        assert f"optim.{key} {getattr(saved, key)} -> {value}" in out, key


@pytest.mark.slow
def test_a_longer_resumed_run_says_how_the_learning_rate_moves(tmp_path, capsys):
    """training.steps 4 -> 8 on a resume moves the cosine schedule under the run: one line says the
    learning rate goes from step 4's to step 5's, which the run then uses."""
    run_debug(tmp_path, "--training.steps=4", "--training.sample_tokens=0")
    capsys.readouterr()
    run_debug(
        tmp_path,
        "--training.steps=8",
        "--checkpoint.resume=auto",
        "--training.sample_tokens=0",
        "--logging.every=1",
    )
    debug = train.load_config(DEBUG_CONFIG).optim
    before, after = train.learning_rate(4, debug, 4), train.learning_rate(5, debug, 8)
    assert after > 2 * before  # the jump the line warns of
    lines = [line for line in capsys.readouterr().out.splitlines() if "learning rate" in line]
    assert (
        len(lines) == 1 and f"from {before:.2e} at step 4 to {after:.2e} at step 5" in lines[0]
    ), lines
    assert "training.steps 4 -> 8" in lines[0]
    assert [r["lr"] for r in records(tmp_path) if r.get("step") == 5 and "lr" in r] == [after]


@pytest.mark.slow
@pytest.mark.parametrize("saved, asked", [("adamw", "muon"), ("muon", "adamw")])
def test_resuming_with_the_other_optimizer_says_which_the_checkpoint_holds(tmp_path, saved, asked):
    """Not "a damaged .distcp file?: Missing key ...momentum_buffer": the checkpoint is intact."""
    run_debug(tmp_path, f"--optim.name={saved}", "--training.steps=1", "--training.sample_tokens=0")
    checkpoint = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    with pytest.raises(
        CheckpointError,
        match=rf"command line --optim.name: checkpoint {checkpoint} "
        r"holds the "
        rf"optimizer states of {saved} but this run asks for "
        r"optim.name = "
        rf"{asked!r}.*checkpoint is intact",
    ) as refused:
        run_debug(
            tmp_path, f"--optim.name={asked}", "--training.steps=2", "--checkpoint.resume=auto"
        )
    assert "\n" not in str(refused.value) and "damaged" not in str(refused.value)


@pytest.mark.slow
def test_a_run_killed_in_its_first_save_leaves_no_leftovers_and_no_duplicate_records(tmp_path):
    """kill -9 while the first checkpoint is written (step 1 trained and logged): the auto resume
    has no checkpoint to continue and starts over, in the run directory the killed run left,
    clearing its step_00000001.tmp and its record of step 1. It wrote run_0002 before, leaving
    run_0001's leftover for good and two records of step 1 in metrics.jsonl."""
    argv = debug_args(
        tmp_path,
        "--training.steps=2",
        "--checkpoint.every=1",
        "--logging.every=1",
        "--training.sample_tokens=0",
        "--training.eval_every=0",
        "--checkpoint.resume=auto",
    )
    crc_log = tmp_path / "crc.log"
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        start(_rank_of_train, (1, free_port(), argv, 1, str(crc_log)), nprocs=1)
    run_dir = tmp_path / "ckpt" / "run_0001"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "run.json", "step_00000001.tmp"]
    killed = train_losses(tmp_path)
    start(_rank_of_train, (1, free_port(), argv, 0, str(crc_log)), nprocs=1)
    assert [(Path(r["run"]).name, r["step"]) for r in records(tmp_path) if "loss" in r] == [
        ("run_0001", 1),
        ("run_0001", 2),
    ]
    assert train_losses(tmp_path)[1] == killed[1]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "run_0001"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".lock",
        "report.html",
        "run.json",
        "step_00000001",
        "step_00000002",
    ]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["--optim.name=muon", "--optim.muon_lr=1e6"],
            r"try a lower optim.muon_lr \(now 1e\+06, "
            r"command line "
            r"--optim.muon_lr\) or optim.lr \(now 0.003, "
            r".*debug.toml\)",
        ),
        (
            ["--model.router_z_loss_coef=1e6"],
            r"the loss holds the router losses of \[model\] "
            r"router_z_loss_coef = 1e\+06 "
            r"\(command line --model.router_z_loss_coef\): try a lower coefficient",
        ),
    ],
)
def test_a_divergence_names_the_keys_that_drive_it(tmp_path, overrides, named):
    """Muon's matrices step at muon_lr, and router losses join the loss: a divergence they cause was
    blamed on optim.lr alone."""
    with pytest.raises(train.TrainingError, match=rf"step 1: .*diverged.*{named}") as stopped:
        run_debug(tmp_path, *overrides, "--training.steps=2")
    assert "\n" not in str(stopped.value)


def test_two_checkpointers_on_one_directory_are_refused(tmp_path):
    """The checkpoint.dir lock is exclusive: a second Checkpointer (another run) on the same
    directory is refused while the first holds it, and takes it once the first has closed. (A shared
    lock would let both run; the other lock tests take the lock by hand, exclusively, and could not
    tell.)"""
    import torch.distributed as dist

    from parallel import Process

    cfg = train.parse_args(debug_args(tmp_path))
    run = Process(rank=0, world_size=1, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    assert not dist.is_initialized()
    with checkpoint.Checkpointer(cfg, run):
        with pytest.raises(
            CheckpointError,
            match=rf"checkpoint.dir {tmp_path / 'ckpt'} is in use "
            r"by another run "
            rf"\(pid {os.getpid()} on ",
        ):
            checkpoint.Checkpointer(cfg, run)
    checkpoint.Checkpointer(cfg, run).close()
