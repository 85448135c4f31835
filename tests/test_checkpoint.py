"""checkpoint.py: saving, exact resume, crash-safe saves, and the checks on what a checkpoint holds."""

import enum
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

import checkpoint
import checkpoint_files
import convert
import train
from checkpoint import CheckpointError
from conftest import records, run_debug, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path):
    common = ["--training.steps=6", "--training.grad_accum=2", "--logging.every=1", "--checkpoint.every=2",
              "--checkpoint.keep_last=2", "--training.sample_tokens=0"]
    run_debug(tmp_path, *common)
    uninterrupted = train_losses(tmp_path)
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir())
    assert checkpoints == [".lock", "step_00000004", "step_00000006"]  # keep_last = 2
    shutil.rmtree(tmp_path / "ckpt" / "run_0001" / "step_00000006")
    with open(tmp_path / "metrics.jsonl", "a") as log:
        log.write('{"step": 7, "lo')  # a line cut off by a crash
    run_debug(tmp_path, *common, "--checkpoint.resume=auto")
    steps = [(r["step"], "loss" in r) for r in records(tmp_path)]
    assert sorted(set(steps)) == sorted(steps) and [s for s, train in steps if train] == [1, 2, 3, 4, 5, 6]
    assert train_losses(tmp_path) == uninterrupted  # bit for bit
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "run_0001"]  # continued there


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real_save = checkpoint.save_dcp

    def crash_at_step_4(state, path):
        if path.name.startswith("step_00000004"):
            (path / "__0_0.distcp").write_bytes(b"half written")
            raise KeyboardInterrupt("power cut")
        real_save(state, path)

    monkeypatch.setattr(checkpoint, "save_dcp", crash_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=2", "--training.sample_tokens=0")
    monkeypatch.setattr(checkpoint, "save_dcp", real_save)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [".lock", "step_00000002", "step_00000004.tmp"]
    summary = run_debug(tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0")
    assert summary["step"] == 4  # resumed from step 2 and went on
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [".lock", "step_00000002", "step_00000004"]


def test_checkpoint_from_another_architecture_is_refused(tmp_path):
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    checkpoint = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    with pytest.raises(CheckpointError, match=r"different architecture: hidden_size = 64 there, 96 here"):
        run_debug(tmp_path, "--model.hidden_size=96", f"--checkpoint.resume={checkpoint}")


@pytest.mark.parametrize("written", ["{not json", '{"model_type": "flint", "hidden_size": -4}'])
def test_an_explicit_resume_of_a_checkpoint_with_a_bad_config_says_so_in_one_line(tmp_path, trained_once, written):
    path = tmp_path / "copy"
    shutil.copytree(trained_once, path)
    (path / "config.json").write_text(written)
    with pytest.raises(CheckpointError, match=rf"{path / 'config.json'}: not a usable model config") as refused:
        run_debug(tmp_path, f"--checkpoint.resume={path}")
    assert "\n" not in str(refused.value)


def trained_checkpoint(tmp_path: Path) -> Path:
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    return tmp_path / "ckpt" / "run_0001" / "step_00000001"


def test_crafted_metadata_never_runs_code(tmp_path):
    """A .metadata whose pickle would create `marker` is refused by every reader of native
    checkpoints: convert.py to-hf, convert.load_native, a resume and [model].init_from."""
    marker = tmp_path / "code_ran"

    class Trap:
        def __reduce__(self):
            return open, (str(marker), "w")

    crafted = trained_checkpoint(tmp_path / "run")
    (crafted / ".metadata").write_bytes(pickle.dumps(Trap()))
    refused = r"\.metadata: not a valid checkpoint metadata file .*names io.open.*could run code"
    with pytest.raises(SystemExit, match=refused):
        convert.main(["to-hf", str(crafted), str(tmp_path / "hf")])
    with pytest.raises(CheckpointError, match=refused):
        convert.load_native(crafted)
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "resume", f"--checkpoint.resume={crafted}")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "init", f"--model.init_from={crafted}", "--model.preset=")
    assert not marker.exists() and not (tmp_path / "hf").exists()
    pickle.loads((crafted / ".metadata").read_bytes())  # what torch's own reader does
    assert marker.exists()  # the trap works: the test above would have seen it


class CreatesMarker:
    """Unpickled, it creates the file `path`: the stand-in for any code a crafted pickle could run."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def plant_in_entry(checkpoint_dir: Path, key: str, payload) -> None:
    """What an attacker can do to a checkpoint: make entry `key` a non-tensor entry whose bytes are
    torch.save(payload), in a new .distcp file, and list every file's checksum again."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    with open(checkpoint_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, just written
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    (checkpoint_dir / "__9_0.distcp").write_bytes(buffer.getvalue())
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [index for index in metadata.storage_data if index.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    with open(checkpoint_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    (checkpoint_dir / "checksums.json").unlink()
    checkpoint_files.write_checksums(checkpoint_dir)


def test_crafted_entries_of_distcp_files_never_run_code(tmp_path):
    """A non-tensor entry whose pickle would create `marker` (an optimizer group's lr, which every
    resume reads; a model weight, which every reader of weights reads) is refused on every path:
    an explicit resume, resume = "auto", [model].init_from, convert.py to-hf and convert.load_native."""
    marker = tmp_path / "code_ran"
    optimizer_entry = trained_checkpoint(tmp_path / "optimizer")
    lr_key = next(key for key in checkpoint_files.read_metadata(optimizer_entry).state_dict_metadata
                  if key.startswith("optimizer.param_groups.") and key.endswith(".lr"))
    plant_in_entry(optimizer_entry, lr_key, CreatesMarker(marker))
    model_entry = trained_checkpoint(tmp_path / "model")
    plant_in_entry(model_entry, "model.norm.weight", CreatesMarker(marker))
    refused = r"entry '.*' is refused: it names io.open \(loading it could run code\)"
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "explicit", f"--checkpoint.resume={optimizer_entry}")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "optimizer", "--checkpoint.resume=auto")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "model", "--checkpoint.resume=auto")
    with pytest.raises(CheckpointError, match=refused):
        run_debug(tmp_path / "init", f"--model.init_from={model_entry}", "--model.preset=")
    # convert.py lists a checkpoint's weights first, and refuses one that is not a tensor before any load.
    not_a_tensor = r"unexpected key 'model.norm.weight': not a tensor"
    with pytest.raises(SystemExit, match=not_a_tensor):
        convert.main(["to-hf", str(model_entry), str(tmp_path / "hf")])
    with pytest.raises(ValueError, match=not_a_tensor):
        convert.load_native(model_entry)
    with pytest.raises(CheckpointError, match=refused):  # and the loader they use, were that check gone
        checkpoint_files.load_dcp({"model": {"norm.weight": torch.zeros(64)}}, model_entry, alone=True)
    assert not marker.exists() and not (tmp_path / "hf").exists()
    torch.load(io.BytesIO((model_entry / "__9_0.distcp").read_bytes()), weights_only=False)  # what DCP's planner does
    assert marker.exists()  # the trap works: the checks above would have seen it


def test_plain_non_tensor_entries_still_load(tmp_path):
    """What DCP stores as bytes in our checkpoints (floats, tuples, bools, None of the optimizer
    groups) loads through the weights-only reader, values intact."""
    path = trained_checkpoint(tmp_path)
    state = {"optimizer.param_groups.x.betas": None}
    plant_in_entry(path, "optimizer.param_groups.x.betas", (0.9, 0.95, True, None, "adamw"))
    checkpoint_files.load_dcp(state, path, alone=True)
    assert state["optimizer.param_groups.x.betas"] == (0.9, 0.95, True, None, "adamw")


def pickled_with_enums_by_name(obj) -> bytes:
    """obj pickled as Debian 12's Python 3.11.2 pickles enum members: getattr(their class, their name)."""
    class ByName(pickle.Pickler):
        def reducer_override(self, value):
            if isinstance(value, enum.Enum):
                return getattr, (type(value), value.name)
            return NotImplemented
    buffer = io.BytesIO()
    ByName(buffer).dump(obj)  # the default protocol, as DCP's writer uses
    return buffer.getvalue()


def globals_named(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle asks for, as the unpickler is asked for it."""
    named = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)
    Recorder(io.BytesIO(data)).load()
    return named


def test_metadata_with_enum_members_by_name_is_read(tmp_path):
    """A legitimate checkpoint written under a Python that pickles enums by name is accepted: its
    exact globals are the allowed classes and builtins.getattr, applied to an allowed enum only."""
    path = trained_checkpoint(tmp_path)
    with open(path / ".metadata", "rb") as f:
        expected = pickle.load(f)
    data = pickled_with_enums_by_name(expected)
    assert {("builtins", "getattr"), ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")} \
        <= globals_named(data)
    assert "STACK_GLOBAL" in {op.name for op, _, _ in pickletools.genops(data)}
    (path / ".metadata").write_bytes(data)
    assert checkpoint_files.read_metadata(path) == expected
    # getattr on anything else is refused: a module (never allowed), an allowed class that is no enum.
    for module, name, attribute in [("os", "system", "__call__"),
                                    ("torch.distributed.checkpoint.metadata", "Metadata", "__init__"),
                                    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "__new__")]:
        call = f"cbuiltins\ngetattr\n(c{module}\n{name}\nS'{attribute}'\ntR.".encode()
        (path / ".metadata").write_bytes(call)
        with pytest.raises(CheckpointError, match="could run code"):
            checkpoint_files.read_metadata(path)


def test_auto_resume_that_can_read_no_checkpoint_stops(tmp_path):
    """Checkpoints found, none intact: the run stops and says so, and never starts over from step 1."""
    run_debug(tmp_path, "--training.steps=2", "--checkpoint.every=1", "--training.sample_tokens=0")
    for step in (1, 2):
        (tmp_path / "ckpt" / "run_0001" / f"step_0000000{step}" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r'resume = "auto" found 2 checkpoint\(s\) .* none is intact'):
        run_debug(tmp_path, "--training.steps=3", "--checkpoint.resume=auto", "--training.sample_tokens=0")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".lock", "run_0001"]


def test_metadata_of_real_checkpoints_reads_with_the_restricted_unpickler(tmp_path):
    """Every global a training checkpoint's metadata names is allowed (the unpickler is not too strict)."""
    path = trained_checkpoint(tmp_path)
    with open(path / ".metadata", "rb") as f:
        expected = pickle.load(f)  # our own file, just written: safe to read the unrestricted way here
    assert checkpoint_files.read_metadata(path) == expected


def test_rerunning_never_deletes_a_run_and_auto_continues_the_latest(tmp_path, capsys):
    short = ["--training.steps=2", "--training.sample_tokens=0"]
    run_debug(tmp_path, *short)  # debug.toml: resume = "never", as the README's first command
    run_debug(tmp_path, *short)
    ckpt = tmp_path / "ckpt"
    assert all((ckpt / run / "step_00000002").is_dir() for run in ("run_0001", "run_0002"))
    run_debug(tmp_path, "--training.steps=3", "--training.sample_tokens=0", "--checkpoint.resume=auto")
    assert f"resumed from {ckpt / 'run_0002' / 'step_00000002'} at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in (ckpt / "run_0002").iterdir()) == [".lock", "step_00000002", "step_00000003"]
    assert sorted(p.name for p in (ckpt / "run_0001").iterdir()) == [".lock", "step_00000002"]


def test_a_second_run_on_the_same_directory_is_refused(tmp_path):
    import fcntl
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / ".lock", "a+") as held:  # as a running run holds it
        held.write("pid 12345 on elsewhere, since then\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=r"ckpt is in use by another run \(pid 12345 on elsewhere"):
            run_debug(tmp_path, "--training.steps=1")
    assert not list((tmp_path / "ckpt").glob("run_*"))
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")  # released: runs


def test_a_run_pointed_at_a_live_runs_own_directory_is_refused(tmp_path):
    """A live run holds its run directory's lock too: a second run whose checkpoint.dir is that
    run_0001, or one continuing it through the parent directory, is refused before any work."""
    import fcntl
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    live = tmp_path / "ckpt" / "run_0001"
    with open(live / ".lock", "a+") as held:  # as the live run holds it while it trains there
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=rf"checkpoint.dir {live} is in use by another run"):
            run_debug(tmp_path / "second", f"--checkpoint.dir={live}", "--checkpoint.resume=auto")
        with pytest.raises(CheckpointError, match=rf"run directory {live} is in use by another run"):
            run_debug(tmp_path, "--training.steps=2", "--checkpoint.resume=auto")
    assert sorted(p.name for p in live.iterdir()) == [".lock", "step_00000001"]


def test_a_kill_during_rotation_never_leaves_a_half_deleted_checkpoint_listed(tmp_path, monkeypatch):
    """keep_last renames a checkpoint away before deleting it: killed part-way through the delete,
    the checkpoint is no longer listed as complete, and the next run clears what is left, and the
    half-written save of a run killed while saving."""
    real_rmtree = shutil.rmtree

    def killed_part_way(path, *args, **kwargs):
        if not str(path).endswith(".removing"):
            return real_rmtree(path, *args, **kwargs)
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt("kill -9")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_part_way)
    with pytest.raises(KeyboardInterrupt):
        run_debug(tmp_path, "--training.steps=2", "--checkpoint.every=1", "--checkpoint.keep_last=1",
                  "--training.sample_tokens=0")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    run_dir = tmp_path / "ckpt" / "run_0001"
    (run_dir / "step_00000003.tmp").mkdir()  # and a save that was killed
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "step_00000001.removing", "step_00000002",
                                                          "step_00000003.tmp"]
    run_debug(tmp_path, "--training.steps=3", "--checkpoint.resume=auto", "--checkpoint.keep_last=1",
              "--training.sample_tokens=0")
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "step_00000003"]


def test_a_stray_file_named_like_a_run_is_skipped(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "run_0001").write_text("not a run")
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    assert (tmp_path / "ckpt" / "run_0001").read_text() == "not a run"
    assert (tmp_path / "ckpt" / "run_0002" / "step_00000001").is_dir()


def test_a_truncated_data_file_without_checksums_is_reported_and_the_one_before_used(tmp_path, capsys):
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=2", "--training.sample_tokens=0")
    newest = tmp_path / "ckpt" / "run_0001" / "step_00000004"
    (newest / "checksums.json").unlink()
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0")
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {newest} is damaged" in out and f"{shard}: truncated" in out
    assert f"resumed from {newest.parent / 'step_00000002'} at step 2" in out


def test_runs_sharing_a_log_never_delete_each_others_records(tmp_path):
    """A second fresh run appends to the same logging.jsonl; an explicit resume into a new run
    directory keeps the first run's records of later steps; each record names its run."""
    short = ["--training.steps=2", "--logging.every=1", "--training.sample_tokens=0", "--checkpoint.every=1"]
    run_debug(tmp_path, *short)
    first = records(tmp_path)
    run_debug(tmp_path, *short)
    run_debug(tmp_path, *short, f"--checkpoint.resume={tmp_path / 'ckpt' / 'run_0001' / 'step_00000001'}")
    runs = [(Path(r["run"]).name, r["step"]) for r in records(tmp_path) if "loss" in r]
    assert records(tmp_path)[:len(first)] == first
    assert runs == [("run_0001", 1), ("run_0001", 2), ("run_0002", 1), ("run_0002", 2), ("run_0003", 2)]


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
    assert f"stopped by SIGTERM after step 3; saved {tmp_path / 'ckpt' / 'run_0001' / 'step_00000003'}" in out
    command = out.split("Resume with:\n")[1].split("\n")[0].split()
    assert command[:2] == ["python3", "train.py"] and command[-1] == "--checkpoint.resume=auto"
    monkeypatch.setattr(train, "train_step", real_step)
    train.main(command[2:])  # the printed command, as a user would paste it
    assert train_losses(tmp_path) == uninterrupted


def test_a_damaged_newest_checkpoint_is_reported_and_the_one_before_used(tmp_path, capsys):
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=2", "--training.sample_tokens=0")
    run_dir = tmp_path / "ckpt" / "run_0001"
    shard = next((run_dir / "step_00000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: checksum mismatch"):
        run_debug(tmp_path / "explicit", f"--checkpoint.resume={run_dir / 'step_00000004'}")
    run_debug(tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0")
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {run_dir / 'step_00000004'} is damaged" in out
    assert f"resumed from {run_dir / 'step_00000002'} at step 2" in out


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
@pytest.mark.parametrize("file", [".metadata", ".distcp"])
def test_damaged_files_stop_with_one_line_naming_them(tmp_path, trained_once, damage, file):
    """Without checksums.json (as an older or converted checkpoint): the readers themselves say it."""
    path = tmp_path / "copy"
    shutil.copytree(trained_once, path)
    (path / "checksums.json").unlink()
    target = path / ".metadata" if file == ".metadata" else next(path.glob("*.distcp"))
    data = target.read_bytes()
    target.write_bytes({"empty": b"", "truncated": data[:len(data) // 8], "garbage": b"\x80\x04garbage" * 9}[damage])
    with pytest.raises(SystemExit) as stop:
        convert.main(["to-hf", str(path), str(tmp_path / "hf")])
    message = str(stop.value.code)
    named = str(path) if (file, damage) == (".distcp", "garbage") else str(target)  # same size: which is unknown
    assert "\n" not in message and named in message, message
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        convert.load_native(path)


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory) -> Path:
    return trained_checkpoint(tmp_path_factory.mktemp("trained"))


def test_a_diverging_run_stops_at_the_step_it_diverges(tmp_path):
    """lr 3e-2 trains for a step (step_1 saved); a step at lr 1e3 then blows the weights up, and
    the run stops at that step, before saving it, naming step_1 as the last good checkpoint."""
    run_debug(tmp_path, "--optim.lr=3e-2", "--training.steps=1", "--training.sample_tokens=0")
    good = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    with pytest.raises(train.TrainingError, match=rf"step 2: the update took the norm of the weights from [\d.]+ to "
                                                  rf"[\d.e+]+: the run diverged.*last good checkpoint is {good}"):
        run_debug(tmp_path, "--optim.lr=1e3", "--optim.schedule=constant", "--optim.warmup_steps=0",
                  "--training.steps=8", "--checkpoint.every=1", "--checkpoint.resume=auto")
    assert sorted(p.name for p in good.parent.iterdir()) == [".lock", "step_00000001"]


@pytest.mark.parametrize("lr, shown", [("1e6", r"1e\+06"), ("inf", "inf")])
def test_blown_up_weights_are_never_saved_or_exported(tmp_path, lr, shown):
    """One step at a constant lr of 1e6 (weights of about 1 moved by about 1e6) or inf: stopped at
    step 1 with optim.lr named; no checkpoint and no export written."""
    with pytest.raises(train.TrainingError, match=rf"step 1: .*diverged; nothing of this step is saved.*"
                                                  rf"try a lower optim.lr \(now {shown}, command line --optim.lr\)"):
        run_debug(tmp_path, f"--optim.lr={lr}", "--optim.schedule=constant", "--optim.warmup_steps=0",
                  "--training.steps=1", f"--checkpoint.export_hf={tmp_path / 'hf'}")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_0001").iterdir()) == [".lock"]
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
    with pytest.raises(CheckpointError, match=r"step 2: the weights hold non-finite values; not saving them. "
                                              r"The last good checkpoint is .*step_00000001"):
        run_debug(tmp_path, "--training.steps=4", "--checkpoint.every=1", "--training.sample_tokens=0")
    good = tmp_path / "ckpt" / "run_0001" / "step_00000001"
    assert sorted(p.name for p in good.parent.iterdir()) == [".lock", good.name]
    assert all(torch.isfinite(t).all() for t in convert.load_native(good).state_dict().values())


def test_killed_conversions_and_preparations_leave_no_temporaries_for_good(tmp_path, trained_once):
    """A folder of a process that is gone (pid 4194304 is above Linux's pid_max) is removed by the
    next run; one of a live process (pytest's parent) is its work in progress and stays."""
    dead, live = 4194304, os.getppid()
    for name in (f".hf.tmp-{dead}-abc", f".hf.tmp-{live}-abc", f"prepared.tmp-{dead}", f"prepared.tmp-{live}"):
        (tmp_path / name).mkdir()
    convert.main(["to-hf", str(trained_once), str(tmp_path / "hf")])
    from data import prepare
    from tokenizer import load_tokenizer
    (tmp_path / "text.txt").write_text("a document\n")
    prepare(tmp_path / "text.txt", load_tokenizer("byte", "<|endoftext|>"), tmp_path / "prepared")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".hf.tmp-{live}-abc", f"prepared.tmp-{live}", "hf", "prepared", "text.txt"])


def test_streaming_readers_verify_each_file_once(tmp_path, trained_once, monkeypatch):
    """convert.py reads one tensor at a time: the checksums are checked once, not once per tensor."""
    real, checked = checkpoint_files.crc32_of, []
    monkeypatch.setattr(checkpoint_files, "crc32_of", lambda file: checked.append(file.name) or real(file))
    convert.main(["to-hf", str(trained_once), str(tmp_path / "hf")])
    listed = json.loads((trained_once / "checksums.json").read_text())
    assert sorted(checked) == sorted(listed) and len(listed) >= 4
