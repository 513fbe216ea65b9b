"""A disk that fills up while the model file is written, on a real tmpfs: `tigon sft`'s checkpoint
save and `tigon export` each stop with one line, remove what they had half written, and leave the
earlier checkpoints as they were. Skipped where mounting a tmpfs is not allowed."""

import shutil
import subprocess

import pytest
import safetensors

from tigon.cli import main
from tigon.train import tiny
from tigon.train.config import SFTError

pytest.importorskip("peft")

RUN = ["--tuner", "full", "--dataset", f"{tiny.BUNDLED_DATASET}#40", "--batch-size", "4", "--max-length", "48",
       "--samples", "0", "--no-kernels", "--save-steps", "1"]


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    """A small tmpfs holding a one-step run (checkpoint-1/, final/), then filled until half of a
    model file still fits: the next save runs out of space inside model.safetensors."""
    disk = tmp_path_factory.mktemp("disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = disk / "run"
        assert main(["sft", *RUN, "--max-steps", "1", "--output-dir", str(run)]) == 0
        model_file = (run / "checkpoint-1" / "model.safetensors").stat().st_size
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(bytes(free - model_file // 2))
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a loaded model still maps its file


def test_a_checkpoint_save_that_fills_the_disk_is_one_line_and_keeps_the_earlier_checkpoint(full_disk, capsys):
    run = full_disk / "run"
    before = _tree(run)
    capsys.readouterr()
    assert main(["sft", *RUN, "--max-steps", "2", "--output-dir", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith(f"\ntigon sft: error: {run / 'checkpoint-2'}: no space left on device; the partial save was "
                        "removed (free some space, or write elsewhere)\n")  # after the progress bar's line
    after = _tree(run)
    assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == {
        k: v for k, v in before.items() if k != "metrics.jsonl"}  # checkpoint-1/ and final/ byte for byte


@pytest.mark.parametrize("to, name", [("merged", "merged"), ("gguf", "gguf"), ("gguf", "model.gguf")])
def test_an_export_that_fills_the_disk_is_one_line_and_leaves_nothing(to, name, full_disk, capsys):
    out = full_disk / name
    before = sorted(p.name for p in full_disk.iterdir())
    assert main(["export", str(full_disk / "run" / "final"), "--to", to, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"tigon export: error: {out}: no space left on device; the partial save was removed (free some space, or "
        "write elsewhere)")
    assert sorted(p.name for p in full_disk.iterdir()) == before


def test_the_model_file_is_what_ran_out_of_space(full_disk):
    """safetensors reports a full disk as a plain Exception, recognised by its "(os error 28)"."""
    with pytest.raises(SFTError, match="no space left on device") as caught:
        main(["export", str(full_disk / "run" / "final"), "--to", "merged", "--output", str(full_disk / "m"),
              "--debug"])
    assert isinstance(caught.value.__cause__, safetensors.SafetensorError)
    assert "(os error 28)" in str(caught.value.__cause__)
