"""checkpoint.py: saving, exact resume, crash-safe saves, and the checks on what a checkpoint holds."""

import shutil

import pytest

import checkpoint
from checkpoint import CheckpointError
from test_train import run_debug, train_losses

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path):
    common = ["--training.steps=6", "--training.grad_accum=2", "--logging.every=1", "--checkpoint.every=2",
              "--checkpoint.keep_last=2", "--training.sample_tokens=0"]
    run_debug(tmp_path, *common)
    uninterrupted = train_losses(tmp_path)
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert checkpoints == ["step_00000004", "step_00000006"]  # keep_last = 2
    shutil.rmtree(tmp_path / "ckpt" / "step_00000006")
    (tmp_path / "metrics.jsonl").unlink()
    run_debug(tmp_path, *common, "--checkpoint.resume=auto")
    resumed = train_losses(tmp_path)
    assert sorted(resumed) == [5, 6]
    assert all(resumed[s] == uninterrupted[s] for s in (5, 6))  # bit for bit


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
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000004.tmp"]
    summary = run_debug(tmp_path, "--training.steps=4", "--checkpoint.resume=auto", "--training.sample_tokens=0")
    assert summary["step"] == 4  # resumed from step 2 and went on
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000004"]


def test_checkpoint_from_another_architecture_is_refused(tmp_path):
    run_debug(tmp_path, "--training.steps=1", "--training.sample_tokens=0")
    checkpoint = tmp_path / "ckpt" / "step_00000001"
    with pytest.raises(CheckpointError, match=r"different architecture: hidden_size = 64 there, 96 here"):
        run_debug(tmp_path, "--model.hidden_size=96", f"--checkpoint.resume={checkpoint}")
