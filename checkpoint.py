"""Native checkpoints: torch.distributed.checkpoint (DCP) directories that train.py saves, resumes
from and starts from ([model].init_from), and that convert.py reads and writes.

A checkpoint is a directory holding DCP's .metadata and .distcp files plus config.json (the model's
Hugging Face config) and train_config.json (the run's resolved configuration). Every layout saves the
same names and full shapes, so a checkpoint saved by any parallel layout loads in any other.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from models import ModelConfig, config_from_hf
from parallel import ParallelModel, barrier

if TYPE_CHECKING:  # only for annotations: train.py imports this file
    from config import TrainConfig
    from data import PackedLoader
    from train import Run


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (incomplete, damaged, another architecture); the message says why."""


def save_dcp(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # DCP warns that one process saves alone: that is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def load_dcp(state: dict, path: Path) -> None:
    """Fills `state` in place from the checkpoint at `path`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())


def is_native_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "config.json").is_file()


def check_architecture(path: Path, config: ModelConfig) -> None:
    saved = config_from_hf(path / "config.json").to_hf_config()
    mine = config.to_hf_config()
    diffs = [f"{k} = {saved.get(k)!r} there, {mine.get(k)!r} here" for k in sorted(set(saved) | set(mine))
             if k != "router_aux_loss_coef" and saved.get(k) != mine.get(k)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} holds a different architecture: {'; '.join(diffs[:5])}")


class Checkpointer:
    """DCP checkpoints in dir/step_<8-digit step>: {"model", "optimizer", "train"} plus config.json.

    Each is first written to a .tmp name and renamed when complete, so a crash while saving leaves
    the previous checkpoints untouched; only the newest keep_last are kept.
    """

    def __init__(self, cfg: TrainConfig, run: Run):
        self.cfg, self.run, self.dir = cfg, run, Path(cfg.checkpoint.dir)
        self.last: Path | None = None  # saved or resumed from by this run

    def latest(self) -> Path | None:
        done = sorted(p for p in self.dir.glob("step_*") if p.suffix != ".tmp" and is_native_checkpoint(p))
        return done[-1] if done else None

    def remove_earlier_run(self) -> None:
        """checkpoint.resume = "never" starts this directory afresh: older checkpoints would
        otherwise count as newer than the new run's and be resumed or kept instead of them."""
        earlier = sorted(self.dir.glob("step_*"))
        if earlier and self.run.is_main:
            self.run.print(f"checkpoint.resume = \"never\": removing {len(earlier)} earlier checkpoint(s) in {self.dir}")
            for path in earlier:
                shutil.rmtree(path)
        barrier()

    def state(self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader, step: int) -> dict:
        """The same names and full shapes in every layout: DCP reshards on load."""
        model_state = get_model_state_dict(model.module)
        optimizer_state = get_optimizer_state_dict(model.module, optimizer)
        train = {"step": torch.tensor(step), "cpu_rng": torch.get_rng_state(),
                 "data": {k: torch.tensor(v) for k, v in data.state_dict().items()}}
        if self.run.device.type == "cuda":
            train["cuda_rng"] = torch.cuda.get_rng_state(self.run.device)
        return {"model": model_state, "optimizer": optimizer_state, "train": train}

    def save(self, step: int, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader) -> Path:
        final = self.dir / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        if self.run.is_main:
            for stale in self.dir.glob("step_*.tmp"):  # left by a crash
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        barrier()
        start = time.perf_counter()
        save_dcp(self.state(model, optimizer, data, step), tmp)
        if self.run.is_main:
            (tmp / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=1))
            (tmp / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            done = sorted(p for p in self.dir.glob("step_*") if p.suffix != ".tmp")
            for old in done[:-self.cfg.checkpoint.keep_last]:
                shutil.rmtree(old)
            self.run.print(f"saved checkpoint {final} in {time.perf_counter() - start:.1f} s")
        barrier()
        self.last = final
        return final

    def resume(self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader) -> int:
        """-> the step to continue from: 0, or that of the checkpoint that checkpoint.resume picks."""
        choice = self.cfg.checkpoint.resume
        if choice == "never":
            self.remove_earlier_run()
            return 0
        path = self.latest() if choice == "auto" else Path(choice)
        if path is None:
            return 0
        if not is_native_checkpoint(path):
            raise CheckpointError(f"{self.cfg.where('checkpoint.resume')}: {path} is not a complete checkpoint "
                                f"(it needs .metadata and config.json)")
        check_architecture(path, model.config)
        state = self.state(model, optimizer, data, 0)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if "train.cuda_rng" not in saved:
            state["train"].pop("cuda_rng", None)
        load_dcp(state, path)
        set_model_state_dict(model.module, state["model"])
        set_optimizer_state_dict(model.module, optimizer, state["optimizer"])
        data.load_state_dict({k: int(v) for k, v in state["train"]["data"].items()})
        torch.set_rng_state(state["train"]["cpu_rng"])
        if "cuda_rng" in state["train"]:
            torch.cuda.set_rng_state(state["train"]["cuda_rng"], self.run.device)
        step, self.last = int(state["train"]["step"]), path
        self.run.print(f"resumed from {path} at step {step} of {self.cfg.training.steps}"
                       + (": nothing left to train (raise training.steps or set checkpoint.resume = \"never\")"
                          if step >= self.cfg.training.steps else ""))
        return step
