"""The checkpoints of training runs: checkpoint.dir/run_NNNN/step_NNNNNNNN directories that train.py
saves, resumes from and starts from ([model].init_from). checkpoint_files.py reads and writes the
files of one checkpoint; this file decides which checkpoints a run writes, keeps, locks and resumes.
Every layout saves the same names and full shapes, so a checkpoint saved by any parallel layout
loads in any other.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint_files import (
    CheckpointError,
    checksums,
    damage_found_together,
    from_main_rank,
    is_native_checkpoint,
    load_dcp,
    read_metadata,
    save_dcp,
    to_main_rank,
    write_checksums,
)
from config import INIT_FROM_SETTINGS
from data import check_saved_sources
from files import sync_rename
from lora import RUN_FILE, adapter_state, resume_refusal, run_record
from parallel import ParallelModel, Process, barrier, waiting_for_main_rank
from registry import ModelConfig, config_from_hf

if TYPE_CHECKING:  # only for annotations
    from config import TrainConfig
    from data import PackedLoader


def check_architecture(path: Path, config: ModelConfig) -> None:
    try:
        saved = config_from_hf(path / "config.json").to_hf_config()
    # not JSON, or a field no model can have
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise CheckpointError(
            f"{path / 'config.json'}: not a usable model config ({error})"
        ) from None
    saved, mine = dotted_fields(saved), dotted_fields(config.to_hf_config())
    diffs = [
        f"{k} = {saved.get(k)!r} there, {mine.get(k)!r} here"
        for k in sorted(set(saved) | set(mine))
        if k.rsplit(".", 1)[-1] not in INIT_FROM_SETTINGS and saved.get(k) != mine.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} holds a different architecture: {'; '.join(diffs[:5])}"
        )


def dotted_fields(config: dict, prefix: str = "") -> dict:
    """A config.json's fields, a nested object's under dotted names (Large 4's
    text_config.hidden_size), so a difference is named by the field that differs rather than by the
    whole object around it."""
    fields = {}
    for key, value in config.items():
        if isinstance(value, dict):
            fields.update(dotted_fields(value, f"{prefix}{key}."))
        else:
            fields[prefix + key] = value
    return fields


# ============================================================================= checkpoints of a run

RUN_NAME = re.compile(r"run_\d{4,}")
STEP_NAME = re.compile(r"step_\d{8,}")
REMOVING = ".removing"  # a checkpoint being deleted: no longer complete
# a damaged checkpoint an auto resume skipped, kept for inspection: never listed or rotated
DAMAGED = ".damaged"


def remove_leftovers(run_dir: Path) -> None:
    """What a crash of this run directory's writer left: half-written saves (step_*.tmp) and
    half-deleted checkpoints (step_*.removing). Only called with the directory's lock held."""
    for leftover in [*run_dir.glob("step_*.tmp"), *run_dir.glob(f"step_*{REMOVING}")]:
        shutil.rmtree(leftover)


def hold_lock(directory: Path, what: str):
    """An exclusive flock on directory/.lock, held until the returned file is closed (or the
    process ends), with this process's pid and host written in it for whoever is refused."""
    try:
        lock_file = open(directory / ".lock", "a+")
    except OSError as error:
        raise CheckpointError(
            f"{what} {directory} is not writable ({error.strerror or error})"
        ) from error
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "another process"
        lock_file.close()
        raise CheckpointError(
            f"{what} {directory} is in use by another run ({holder}); wait for it "
            "to finish "
            f"or give this run another checkpoint.dir"
        ) from None
    lock_file.truncate(0)
    lock_file.write(
        f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    lock_file.flush()
    return lock_file


class Checkpointer:
    """Checkpoints of training runs: checkpoint.dir/run_<4 digits>/step_<8 digits>, each holding
    DCP's {"model", "optimizer", "train"} files, config.json, train_config.json and checksums.json.

    - Nothing of another run is ever deleted: a fresh run (checkpoint.resume = "never", or "auto"
      with nothing to resume) writes a new run directory; "auto" continues the newest intact
      checkpoint of the newest run and writes on in that run's directory (with nothing to resume, in
      the newest run directory if a run killed before its first checkpoint left it without one); an
      explicit checkpoint starts a new run directory from its step. keep_last applies to the run's
      own directory.
    - One run per checkpoint.dir: rank 0 holds an exclusive lock on dir/.lock for the life of the
      run.
    - Crash-safe saves: written under a .tmp name, each rank checksumming its own files, renamed by
      rank 0 once every rank's are listed, the rename made durable; a kill at any point leaves the
      checkpoints before it complete. On resume every rank verifies its share of the files.
    - checkpoint.async_save: the state is copied to host memory and written by a background thread
      while training goes on; at most one save is in flight (the next save, the end of the run and
      close() wait for it), and it completes, rotation included, exactly as a synchronous one.
    - A checkpoint whose weights hold non-finite values is never written.
    """

    def __init__(self, cfg: TrainConfig, run: Process):
        self.cfg, self.run, self.dir = cfg, run, Path(cfg.checkpoint.dir)
        self.last: Path | None = None  # saved or resumed from by this run
        # rank 0's: checkpoint.dir's and, once chosen, the run directory's
        self.lock_files: list = []
        self.run_dir: Path | None = None  # chosen at resume
        self.skipped: list[Path] = []  # damaged checkpoints newest_intact passed over
        self.group: dist.ProcessGroup | None = None  # synchronous saves talk over the main group
        self.stager: DefaultStager | None = None
        self.saving: Future | None = None  # the async save in flight
        if cfg.checkpoint.async_save:
            # The background saves talk over a gloo group of their own: dcp.async_save needs one on
            # the CPU, and the training's collectives go on meanwhile in the main group.
            self.group = dist.new_group(
                backend="gloo", timeout=timedelta(minutes=cfg.parallel.collective_timeout_minutes)
            )
            # this rank's state in host memory, reused per save
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=run.device.type == "cuda",
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=run.device.type == "cuda",
                )
            )
        # one save at a time
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        failure = None
        if run.is_main:
            try:
                self.lock()
            except CheckpointError as error:
                failure = str(error)
        failure = from_main_rank(failure)
        if failure:
            raise CheckpointError(failure)

    def where(self) -> str:
        return self.cfg.where("checkpoint.dir")

    def lock(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(
                f"{self.where()}: checkpoint.dir {self.dir} is not a writable "
                "directory "
                f"({error.strerror or error})"
            ) from error
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise CheckpointError(f"{self.where()}: checkpoint.dir {self.dir} is not writable")
        self.lock_files.append(hold_lock(self.dir, f"{self.where()}: checkpoint.dir"))

    def close(self) -> None:
        """Waits for the save in flight, then releases the locks (the operating system also does
        when the process ends)."""
        try:
            self.wait()
        finally:
            self.background.shutdown()
            if self.stager is not None:
                self.stager.close()
            for lock_file in self.lock_files:
                lock_file.close()
            self.lock_files = []

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ finding checkpoints

    def runs(self) -> list[Path]:
        return sorted(
            p for p in self.dir.glob("run_*") if p.is_dir() and RUN_NAME.fullmatch(p.name)
        )

    def checkpoints(self, run_dir: Path | None = None) -> list[Path]:
        """Complete checkpoints (renamed into place under their final name), oldest first: of one
        run directory, or of all (run by run; a checkpoint.dir from before run directories counts as
        the oldest run)."""
        places = [run_dir] if run_dir else [self.dir, *self.runs()]
        return [
            p
            for place in places
            for p in sorted(place.glob("step_*"))
            if STEP_NAME.fullmatch(p.name) and is_native_checkpoint(p)
        ]

    def latest(self) -> Path | None:
        """The newest checkpoint this run saved (the save in flight finished first) or resumed from
        (of the whole directory before it began)."""
        self.wait()
        done = self.checkpoints(self.run_dir)
        return done[-1] if done else self.last

    def newest_intact(self) -> Path | None:
        """The newest checkpoint that is not damaged; damaged newer ones are reported and
        skipped."""
        for path in reversed(self.checkpoints()):
            problem = damage_found_together(path)
            if not problem:
                return path
            self.run.print(
                f"WARNING: checkpoint {path} is damaged, trying the one before it: {problem}"
            )
            self.skipped.append(path)
        return None

    def new_run_dir(self) -> Path:
        """run_<n + 1>, n the highest run number in use by any entry (a stray file named run_0001
        included: it is skipped, never overwritten)."""
        numbers = [int(p.name[4:]) for p in self.dir.glob("run_*") if RUN_NAME.fullmatch(p.name)]
        path = self.dir / f"run_{max(numbers, default=0) + 1:04d}"
        if self.run.is_main:
            path.mkdir()
        return from_main_rank(path)

    def unfinished_run_dir(self) -> Path | None:
        """The newest run directory if it holds no checkpoint, complete or not: its run was killed
        before its first checkpoint. An auto resume that finds nothing to continue starts over there
        rather than in a new directory, so that the killed run's half-written save (step_*.tmp) and
        its records of the steps it logged do not stay beside the run that replaces it."""
        unfinished = None
        if self.run.is_main:
            runs = self.runs()
            if runs and not any(STEP_NAME.fullmatch(p.name) for p in runs[-1].iterdir()):
                unfinished = runs[-1]
        return from_main_rank(unfinished)

    def enter_run_dir(self, path: Path) -> None:
        """Write into `path` from now on: lock it (a run pointed at another run's directory as its
        checkpoint.dir, or one continuing it, is refused), clear what a crash there left and set
        aside the damaged checkpoints there that the resume skipped (set_aside)."""
        failure = None
        if self.run.is_main:
            try:
                if path != self.dir:
                    self.lock_files.append(hold_lock(path, f"{self.where()}: run directory"))
                remove_leftovers(path)
                for damaged in self.skipped:
                    if damaged.parent == path:
                        self.set_aside(damaged)
            except CheckpointError as error:
                failure = str(error)
        failure = from_main_rank(failure)
        if failure:
            raise CheckpointError(failure)
        self.run_dir = path

    def set_aside(self, checkpoint: Path) -> None:
        """Rename a damaged checkpoint out of the step names, never deleting it: rotation
        (keep_last, ordered by step) would otherwise keep it, newer than anything the resumed run
        saves, and delete the intact ones, and every later resume would read it again."""
        aside = checkpoint.with_name(checkpoint.name + DAMAGED)
        number = 1
        while aside.exists():  # set aside before, and that step damaged again
            number += 1
            aside = checkpoint.with_name(f"{checkpoint.name}{DAMAGED}-{number}")
        sync_rename(checkpoint, aside)
        self.run.print(
            f"set aside the damaged checkpoint {checkpoint} as {aside} (kept for "
            "inspection, never "
            f"rotated or resumed from; delete it when you no longer need it)"
        )

    def remove(self, checkpoint: Path) -> None:
        """Unfinish, then delete: renamed away from its step name first, so a crash part-way through
        never leaves a half-deleted checkpoint listed as complete (the next run clears the rest)."""
        doomed = checkpoint.with_name(checkpoint.name + REMOVING)
        sync_rename(checkpoint, doomed)
        shutil.rmtree(doomed)

    # ------------------------------------------------------------------ saving

    def state(
        self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader, step: int
    ) -> dict:
        """The same names and full shapes in every layout: DCP reshards on load."""
        model_state = get_model_state_dict(model.module)
        if self.cfg.lora.enabled:  # the frozen base stays where init_from names it (lora.RUN_FILE)
            model_state = adapter_state(model_state)
        optimizer_state = get_optimizer_state_dict(model.module, optimizer)
        train = {
            "step": torch.tensor(step),
            "cpu_rng": torch.get_rng_state(),
            "data": {k: torch.tensor(v) for k, v in data.state_dict().items()},
        }
        if self.run.device.type == "cuda":
            train["cuda_rng"] = torch.cuda.get_rng_state(self.run.device)
        return {"model": model_state, "optimizer": optimizer_state, "train": train}

    def save(
        self, step: int, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader
    ) -> None:
        """Writes the checkpoint of `step`, once the save before it (if one is in flight) has
        finished: at once, or with checkpoint.async_save while training goes on (wait() waits for
        it)."""
        self.wait()
        if not weights_finite(model):
            raise CheckpointError(
                f"step {step}: the weights hold non-finite values; not saving "
                "them. The last "
                "good checkpoint is "
                f"{self.latest() or 'none (none was saved yet)'}"
            )
        final = self.run_dir / f"step_{step:08d}"
        tmp = final.with_suffix(".tmp")
        if self.run.is_main:
            remove_leftovers(self.run_dir)
            tmp.mkdir(parents=True)
        barrier()
        start = time.perf_counter()
        written = save_dcp(self.state(model, optimizer, data, step), tmp, self.group, self.stager)
        finish = partial(self.complete, written, tmp, final, model.config.to_hf_config(), start)
        if self.stager is None:
            finish()
        else:  # the state is staged in host memory: training may change the weights now
            self.saving = self.background.submit(finish)

    def complete(
        self, written: Future, tmp: Path, final: Path, model_config: dict, start: float
    ) -> None:
        """After this rank's files are written: each rank checksums its own, all at once; rank 0
        lists them in checksums.json, renames tmp to final (then the checkpoint is complete) and
        removes those keep_last lets go, while the others wait (collective_timeout_minutes)."""
        listed = to_main_rank(checksums(written.result()), self.group)
        if self.run.is_main:
            (tmp / "config.json").write_text(json.dumps(model_config, indent=1))
            (tmp / "train_config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
            if self.cfg.lora.enabled:
                record = run_record(self.cfg.lora, self.cfg.model.init_from)
                (tmp / RUN_FILE).write_text(json.dumps(record, indent=1))
            write_checksums(tmp, {name: entry for files in listed for name, entry in files.items()})
            if final.exists():
                shutil.rmtree(final)
            sync_rename(tmp, final)
            for old in self.checkpoints(self.run_dir)[: -self.cfg.checkpoint.keep_last]:
                self.remove(old)
            self.run.print(
                f"saved checkpoint {final} in {time.perf_counter() - start:.1f} s"
                + (" (in the background)" if self.stager else "")
            )
        with waiting_for_main_rank(
            f"list and rename checkpoint {final}",
            self.cfg.parallel.collective_timeout_minutes,
            self.cfg.where("parallel.collective_timeout_minutes"),
            CheckpointError,
        ):
            dist.barrier(group=self.group)
        self.last = final

    def wait(self) -> Path | None:
        """The last finished checkpoint, once the save in flight (if any) has finished; its error,
        if it failed, is raised here."""
        saving, self.saving = self.saving, None
        if saving is not None:
            saving.result()
        return self.last

    # ------------------------------------------------------------------ resuming

    def resume(
        self, model: ParallelModel, optimizer: torch.optim.Optimizer, data: PackedLoader
    ) -> int:
        """-> the step to continue from: 0, or that of the checkpoint that checkpoint.resume
        picks."""
        choice = self.cfg.checkpoint.resume
        path = (
            None
            if choice == "never"
            else self.newest_intact()
            if choice == "auto"
            else Path(choice)
        )
        if choice == "auto" and path is None and self.checkpoints():
            raise CheckpointError(
                f'{self.cfg.where("checkpoint.resume")}: resume = "auto" found '
                f"{len(self.checkpoints())} checkpoint(s) in {self.dir} and none "
                "is intact (each "
                "warning above says why); not starting over. Repair or move "
                "them, or set "
                f'checkpoint.resume = "never" for a fresh run'
            )
        continues = choice == "auto" and path is not None and RUN_NAME.fullmatch(path.parent.name)
        unfinished = self.unfinished_run_dir() if choice == "auto" and path is None else None
        self.enter_run_dir(path.parent if continues else unfinished or self.new_run_dir())
        if path is None:
            self.run.print(
                f"a fresh run: checkpoints go to {self.run_dir}"
                + (
                    " (a run killed before its first checkpoint left it; its leftovers and its "
                    "records "
                    "in "
                    "logging.jsonl are cleared)"
                    if unfinished
                    else ""
                )
            )
            return 0
        if not is_native_checkpoint(path):
            raise CheckpointError(
                f"{self.cfg.where('checkpoint.resume')}: {path} is not a complete "
                "checkpoint "
                f"(it needs .metadata and config.json)"
            )
        check_architecture(path, model.config)
        refusal = resume_refusal(path, self.cfg.lora, self.cfg.model.init_from)
        if refusal:
            raise CheckpointError(f"{self.cfg.where('checkpoint.resume')}: {refusal}")
        saved_keys = read_metadata(path).state_dict_metadata
        check_optimizer(path, saved_keys, self.cfg)
        sources_changed = check_saved_sources(saved_keys, data, path)
        state = self.state(model, optimizer, data, 0)
        if "train.cuda_rng" not in saved_keys:
            state["train"].pop("cuda_rng", None)
        load_dcp(state, path, verified=choice == "auto")  # newest_intact verified it
        set_model_state_dict(
            model.module, state["model"], options=StateDictOptions(strict=not self.cfg.lora.enabled)
        )
        # The param groups hold the [optim] settings (betas, eps, weight_decay; Muon's momentum and
        # lr_scale = muon_lr / lr) and the checkpoint saved them: set_optimizer_state_dict puts the
        # saved values back. A resume trains with the config's settings and the checkpoint's states
        # (moments, momentum buffers).
        configured = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        set_optimizer_state_dict(model.module, optimizer, state["optimizer"])
        for group, settings in zip(optimizer.param_groups, configured):
            group.update(settings)
        data.load_state_dict({k: int(v) for k, v in state["train"]["data"].items()}, path)
        torch.set_rng_state(state["train"]["cpu_rng"])
        if "cuda_rng" in state["train"]:
            torch.cuda.set_rng_state(state["train"]["cuda_rng"], self.run.device)
        step, self.last = int(state["train"]["step"]), path
        self.run.print(
            f"resumed from {path} at step {step} of {self.cfg.training.steps}; "
            "checkpoints go to "
            f"{self.run_dir}"
            + (f"; the data changed: {sources_changed}" if sources_changed else "")
            + (
                ": nothing left to train (raise training.steps, or set "
                'checkpoint.resume = "never" for a fresh run)'
                if step >= self.cfg.training.steps
                else ""
            )
        )
        return step


def check_optimizer(path: Path, saved_keys, cfg: TrainConfig) -> None:
    """A resume continues the optimizer whose states the checkpoint holds (Muon's momentum buffers,
    or AdamW's moments alone); asked for the other, it says so rather than fail to find a state's
    key."""
    saved = "muon" if any(key.endswith(".momentum_buffer") for key in saved_keys) else "adamw"
    if saved != cfg.optim.name:
        raise CheckpointError(
            f"{cfg.where('optim.name')}: checkpoint {path} holds the optimizer "
            f"states of {saved} "
            f"but this run asks for optim.name = {cfg.optim.name!r}. The "
            "checkpoint is intact; a "
            f"resume cannot change optimizers: set optim.name = {saved!r} to "
            "resume it, or train "
            "its weights with a new optimizer from step 1 ([model] init_from = "
            f'"{path}", '
            f'checkpoint.resume = "never")'
        )


def weights_finite(model: ParallelModel) -> bool:
    """Whether every weight of every rank is finite (one pass over this rank's shards, one
    all-reduce)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.module.parameters()]
    bad = torch.zeros((), device=local[0].device) if local else torch.zeros(())
    for tensor in local:
        bad += (~torch.isfinite(tensor)).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        bad = bad.to(model.collective_device)
        dist.all_reduce(bad)
    return not bool(bad)
