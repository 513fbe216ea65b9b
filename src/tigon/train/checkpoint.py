"""Atomic checkpoints: everything is written into a hidden staging directory next to the target
and renamed into place only when complete, so a crash mid-save never leaves a ``checkpoint-N``
(or ``final``) that looks finished. Resuming only ever sees complete checkpoints. A save that
fails with an error removes its staging directory (a full disk gets its space back) and a full
disk is said as such, in one line."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from transformers import Trainer

from tigon.train.config import SFTError

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STAGING_PREFIX = ".tmp-"
# torch.save reports a failed write as "unexpected pos ..." or "file write failed", naming no
# cause; below this much free space, the cause is taken to be a full disk.
_NEARLY_FULL = 64 * 2**20


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete step checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := _CHECKPOINT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """The checkpoint ``--resume`` names: for "latest" the newest complete one in `output_dir`
    (None while there is none), else the path given, which must be a checkpoint."""
    if resume == "latest":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
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


def _disk_full(err: BaseException, where: Path) -> bool:
    """Whether `err` comes from the disk running out of space (or quota)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, RuntimeError):
        try:
            return shutil.disk_usage(where).free < _NEARLY_FULL
        except OSError:
            return False
    return False


@contextlib.contextmanager
def removed_on_failure(staging: Path, target: Path) -> Iterator[None]:
    """Remove `staging` if the block raises (Ctrl-C included), so that a failed save of `target`
    leaves nothing that holds disk space or looks complete; a full disk becomes one SFTError."""
    try:
        yield
    except BaseException as err:
        full = _disk_full(err, staging.parent)  # asked before the removal gives the space back
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise SFTError(f"{target}: no space left on device; the partial save was removed (free some "
                           "space, or write elsewhere)") from err
        raise


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
    ``save_limit`` keeps the newest N checkpoints, counted after each rename. ``model_files``
    (name -> text) are written beside the model in every save, inside the staging directory."""

    model_files: dict[str, str] = {}

    def __init__(self, *args, save_limit: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_limit = save_limit
        self._staging: str | None = None

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            target = Path(output_dir or self.args.output_dir)
            for name, text in self.model_files.items():
                (target / name).write_text(text)

    def _get_output_dir(self, trial):
        # While a checkpoint is being written, the Trainer's own save code writes into staging.
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _issue_warnings_after_load(self, load_result):
        # A tied weight (an lm_head sharing the embeddings) is saved once, under the embeddings'
        # name: its own key is "missing" from every checkpoint, yet loaded through the tie.
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or ())
        load_result.missing_keys[:] = [k for k in load_result.missing_keys if k not in tied]
        super()._issue_warnings_after_load(load_result)

    def _save_checkpoint(self, model, trial):
        run_dir = Path(super()._get_output_dir(trial))
        target = run_dir / f"checkpoint-{self.state.global_step}"
        staging = target.with_name(STAGING_PREFIX + target.name)
        if self.args.should_save:
            staging_dir(target)
        self.accelerator.wait_for_everyone()
        self._staging = str(staging)
        try:
            with removed_on_failure(staging, target):
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
