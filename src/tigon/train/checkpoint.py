"""Atomic checkpoints and outputs: everything is written into a hidden staging directory (or
file) next to the target and renamed into place only when complete, so a crash mid-save never
leaves a ``checkpoint-N`` (or ``final``, or an export) that looks finished. Resuming only ever
sees complete checkpoints. A save that fails with an error removes what it staged (a full disk
gets its space back) and a full disk is said as such, in one line.

What is published is on the disk before its name is (fsync, then rename), and a published
directory carries a manifest of its files' sizes: a file cut or lost afterwards (a copy stopped
halfway, a failing disk, a power cut on a file system that reorders writes) is found by `damage`
before anything loads it, and named, instead of surfacing as a loader's traceback or, worse, as a
resume that quietly starts a fresh optimizer (the Trainer skips a missing optimizer.pt)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from transformers import Trainer

from tigon.patch.fp8 import plain_state_dict
from tigon.train.config import SFTError

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STAGING_PREFIX = ".tmp-"
MANIFEST_FILE = "tigon-manifest.json"  # in every published directory: its files and their sizes
# torch.save reports a failed write as "unexpected pos ..." or "file write failed", and numpy's
# tofile (the gguf writer's) as an OSError "N requested and M written" without an errno: naming no
# cause; below this much free space, the cause is taken to be a full disk.
_NEARLY_FULL = 64 * 2**20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Libraries written in Rust (safetensors, tokenizers) raise plain exceptions whose text ends in
# Rust's rendering of the errno, e.g. "No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete step checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if p.is_dir() and (m := _CHECKPOINT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def resume_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """The checkpoint ``--resume`` names: for "latest" the newest complete one in `output_dir`
    (None while there is none), else the path given, which must be a checkpoint. A damaged one
    (see `damage`) is an SFTError naming its file. It is never passed over for an older one
    unasked, nor deleted: a checkpoint is published whole, so damage is done to it afterwards (by
    a disk, or a hand), and whether to continue from an older one is the user's call."""
    if resume == "latest":
        checkpoints = list_checkpoints(output_dir)
        if not checkpoints:
            return None
        wrong = damage(checkpoints[-1])
        if wrong is not None:
            older = f"continue from {checkpoints[-2].name}" if len(checkpoints) > 1 else "start again from step 0"
            raise SFTError(f"--resume: {wrong}: move {checkpoints[-1].name} out of {output_dir} (or delete it), "
                           f"then --resume again to {older}")
        return checkpoints[-1]
    path = Path(resume)
    wrong = damage(path)
    if wrong is not None:
        raise SFTError(f"--resume {resume}: {wrong}: resume from another checkpoint")
    if not (path / "trainer_state.json").is_file():
        raise SFTError(f"--resume {resume}: not a checkpoint directory (no trainer_state.json)")
    return path


def staging_dir(target: Path) -> Path:
    """An empty hidden directory next to `target` to write it into (leftovers of a crash removed)."""
    staging = target.with_name(STAGING_PREFIX + target.name)
    remove_path(staging)
    staging.mkdir(parents=True)
    return staging


def _staging_file(target: Path) -> Path:
    """A hidden file path next to `target` to write it into (leftovers of a crash removed)."""
    staging = target.with_name(STAGING_PREFIX + target.name)
    remove_path(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def _disk_full(err: BaseException, where: Path) -> bool:
    """Whether `err` comes from the disk running out of space (or quota)."""
    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            return True
        if any(int(code) in _DISK_FULL for code in _RUST_OS_ERROR.findall(str(cause))):
            return True
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, RuntimeError) or (isinstance(err, OSError) and err.errno is None):
        try:
            return shutil.disk_usage(where).free < _NEARLY_FULL
        except OSError:
            return False
    return False


def remove_path(path: Path) -> None:
    """Delete `path`, a directory tree or a file; a symbolic link itself, never what it points to.
    A directory is renamed to a hidden staging name first: a crash halfway through deleting it
    leaves what remains under that name (cleared by the next run), never under its own, where a
    checkpoint without its manifest would pass for a whole one of an older tigon."""
    if path.is_dir() and not path.is_symlink():
        if not path.name.startswith(STAGING_PREFIX):
            doomed = path.with_name(STAGING_PREFIX + "old-" + path.name)
            remove_path(doomed)
            os.replace(path, doomed)
            path = doomed
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def removed_on_failure(staging: Path, target: Path) -> Iterator[None]:
    """Remove `staging` (a directory or a file) if the block raises (Ctrl-C included), so that a
    failed save of `target` leaves nothing that holds disk space or looks complete; a full disk
    becomes one SFTError."""
    try:
        yield
    except BaseException as err:
        full = _disk_full(err, staging.parent)  # asked before the removal gives the space back
        remove_path(staging)
        if full:
            raise SFTError(f"{target}: no space left on device; the partial save was removed (free some "
                           "space, or write elsewhere)") from err
        raise


def _fsync(path: Path) -> None:
    """Flush `path` (a file, or a directory's entries) to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return  # a directory one may write in but not read: its entries reach the disk in the system's own time
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:  # some file systems cannot flush a directory: nothing to wait for
            raise
    finally:
        os.close(fd)


def _write_manifest(directory: Path) -> None:
    sizes = {p.relative_to(directory).as_posix(): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": sizes}, indent=1) + "\n")


def publish(staging: Path, target: Path) -> None:
    """Move the complete `staging` directory (or file) to `target` by rename, a directory with its
    manifest (see `damage`), everything flushed to the disk first; an older `target` is moved aside
    first and deleted after, so `target` is always either the old or the new whole."""
    if staging.is_dir():
        _write_manifest(staging)
        for path in sorted(staging.rglob("*"), reverse=True):  # files before the directories naming them
            _fsync(path)
    _fsync(staging)
    old = target.with_name(STAGING_PREFIX + "old-" + target.name)
    if target.exists() or target.is_symlink():
        remove_path(old)
        os.replace(target, old)
    os.replace(staging, target)
    _fsync(target.parent)
    remove_path(old)


def damage(directory: Path) -> str | None:
    """What is wrong with `directory`, as its manifest knows it was published: the first file that
    is missing or not of its written size, said as "PATH is ...", or an unreadable manifest. None
    for an intact directory and for one without a manifest (not written by `publish`: a model of
    the user's, a checkpoint of an older tigon), which is taken as it is."""
    manifest = directory / MANIFEST_FILE
    if not manifest.exists():
        return None
    try:
        sizes = json.loads(manifest.read_text())["files"]
        written = {str(name): int(size) for name, size in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest} is damaged (not the list of files tigon wrote)"
    for name, size in written.items():
        path = directory / name
        try:
            found = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if found != size:
            return f"{path} is damaged ({found} bytes where {size} were written)"
    return None


def check_output(output: Path, overwrite: bool, sources: Iterable[str | Path | None]) -> None:
    """Refuse, as one SFTError, to write `output` (``--output``) where that would destroy what the
    user has: an existing file or non-empty directory unless `overwrite`, and, even with it, any of
    the local `sources` the command reads (missing ones and hub ids are skipped), a directory that
    contains one of them, or a place inside one."""
    where = output.resolve()
    for source in sources:
        if source is None or not Path(source).exists():
            continue
        read = Path(source).resolve()
        relation = ("is" if where == read else "contains" if where in read.parents
                    else "lies inside" if read in where.parents else None)
        if relation is not None:
            itself = " itself" if relation == "is" else ""
            raise SFTError(f"--output {output} {relation} {source}{itself}, which this command reads: choose "
                           "another --output")
    if overwrite or not (output.exists() or output.is_symlink()):
        return
    if output.is_dir() and not output.is_symlink():
        if next(output.iterdir(), None) is None:
            return  # an empty directory holds nothing to lose
        raise SFTError(f"--output {output} is a directory that is not empty: pass --overwrite to replace it "
                       "(everything in it is deleted), or choose another --output")
    raise SFTError(f"--output {output} already exists: pass --overwrite to replace it, or choose another --output")


@contextlib.contextmanager
def written_atomically(target: Path, directory: bool = True) -> Iterator[Path]:
    """A staging directory (or, with ``directory=False``, a staging file path) to write `target`
    into; published as `target` when the block completes, removed if the block or the publishing
    fails (a mount point cannot be renamed, for one)."""
    target = Path(os.path.abspath(target))  # "." and "dir/.." have no name to stage beside
    staging = staging_dir(target) if directory else _staging_file(target)
    with removed_on_failure(staging, target):
        yield staging
        publish(staging, target)


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
        # FSDP2's gathered state dict of an --fp8 run may hold torchao's all-gather wrappers: the
        # files hold the bf16 weights inside them.
        super()._save(output_dir, None if state_dict is None else plain_state_dict(state_dict))
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
            with removed_on_failure(staging, target):  # its manifest and flushes can meet a full disk too
                publish(staging / target.name, target)
            shutil.rmtree(staging)
            if self.save_limit is not None:
                for old in list_checkpoints(run_dir)[: -self.save_limit]:
                    remove_path(old)
        self.accelerator.wait_for_everyone()
