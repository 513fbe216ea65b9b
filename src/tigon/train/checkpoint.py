"""Atomic checkpoints: everything is written into a hidden staging directory next to the target
and renamed into place only when complete, so a crash mid-save never leaves a ``checkpoint-N``
(or ``final``) that looks finished. Resuming only ever sees complete checkpoints."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from transformers import Trainer

from tigon.train.config import SFTError

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STAGING_PREFIX = ".tmp-"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete step checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := _CHECKPOINT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: Path, resume: str) -> Path:
    """The checkpoint ``--resume`` names: the newest in `output_dir` for "latest", else the path."""
    if resume == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            raise SFTError(f"--resume: no checkpoint-N directory in {output_dir}")
        return checkpoints[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise SFTError(f"--resume {resume}: not a checkpoint directory (no trainer_state.json)")
    return path


def staging_dir(target: Path) -> Path:
    """An empty hidden directory next to `target` to write it into (leftovers of a crash removed)."""
    staging = target.with_name(STAGING_PREFIX + target.name)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, target: Path) -> None:
    """Move the complete `staging` directory to `target` by rename; an older `target` is moved
    aside first and deleted after, so `target` is always either the old or the new whole."""
    old = target.with_name(STAGING_PREFIX + "old-" + target.name)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


class AtomicTrainer(Trainer):
    """A `Trainer` whose step checkpoints appear only when complete (see the module docstring).
    ``save_limit`` keeps the newest N checkpoints, counted after each rename."""

    def __init__(self, *args, save_limit: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_limit = save_limit
        self._staging: str | None = None

    def _get_output_dir(self, trial):
        # While a checkpoint is being written, the Trainer's own save code writes into staging.
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        run_dir = Path(super()._get_output_dir(trial))
        target = run_dir / f"checkpoint-{self.state.global_step}"
        staging = target.with_name(STAGING_PREFIX + target.name)
        if self.args.should_save:
            staging_dir(target)
        self.accelerator.wait_for_everyone()
        self._staging = str(staging)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG states, shards)
        if self.args.should_save:
            # The Trainer wrote staging/checkpoint-N; the extra level keeps its own name intact.
            publish(staging / target.name, target)
            shutil.rmtree(staging)
            if self.save_limit is not None:
                for old in list_checkpoints(run_dir)[: -self.save_limit]:
                    shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
