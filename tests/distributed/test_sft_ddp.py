"""`tigon sft` as `torchrun --nproc_per_node 2` runs it: two CPU processes on gloo, the built-in
tiny model, the Trainer's DistributedDataParallel."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import spawn

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sft_worker(rank: int, port: int, runs: list[tuple[str, str, bool | None]]) -> None:
    # What torchrun sets for each process.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.nn.parallel import DistributedDataParallel

    from tigon.cli import main
    from tigon.train import tiny

    wrap = DistributedDataParallel.__init__
    # The runs one after another in the same two processes (their start-up is most of the time).
    for out, record, bucket_view in runs:
        def recording_init(self, *args, record=record, bucket_view=bucket_view, **kwargs):
            if bucket_view is not None:  # DDP as the Trainer alone would build it
                kwargs["gradient_as_bucket_view"] = bucket_view
            wrap(self, *args, **kwargs)
            Path(record, f"rank{rank}.json").write_text(json.dumps({"gradient_as_bucket_view": self.gradient_as_bucket_view}))

        DistributedDataParallel.__init__ = recording_init
        argv = ["sft", "--dataset", f"{tiny.BUNDLED_DATASET}#24", "--batch-size", "2", "--grad-accum", "2",
                "--max-length", "40", "--max-steps", "3", "--save-steps", "0", "--samples", "0", "--no-kernels",
                "--output-dir", out]
        assert main(argv) == 0


def _run(tmp_path: Path, runs: dict[str, bool | None]) -> dict[str, tuple[list[dict], dict[int, tuple[float, float]]]]:
    """Each named run's DDP settings per rank and its logged (loss, grad_norm) per step."""
    paths = {name: (tmp_path / name, tmp_path / f"{name}-record") for name in runs}
    for _, record in paths.values():
        record.mkdir()
    args = [(str(out), str(record), runs[name]) for name, (out, record) in paths.items()]
    spawn(_sft_worker, args=(_free_port(), args), nprocs=WORLD)
    results = {}
    for name, (out, record) in paths.items():
        wrappers = [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        results[name] = wrappers, {row["step"]: (row["loss"], row["grad_norm"]) for row in rows if "loss" in row}
    return results


def test_ddp_run_keeps_one_copy_of_the_gradients(tmp_path):
    """Both processes train under DDP, which holds the gradients as views into its all-reduce
    buckets (one copy of them, not two), with gradient accumulation: the losses and gradient norms
    are those of the same run with DDP's default separate gradients, step for step."""
    results = _run(tmp_path, {"views": None, "copies": False})
    (wrappers, logged), (default_wrappers, default_logged) = results["views"], results["copies"]
    assert wrappers == [{"gradient_as_bucket_view": True}] * WORLD
    assert default_wrappers == [{"gradient_as_bucket_view": False}] * WORLD
    assert sorted(logged) == [1, 2, 3] and all(math.isfinite(v) for row in logged.values() for v in row), logged
    assert logged[3][0] < logged[1][0], logged  # it trains
    assert logged == default_logged
