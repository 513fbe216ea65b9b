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

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sft_worker(rank: int, port: int, out: str, record: str, bucket_view: bool | None) -> None:
    # What torchrun sets for each process.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.nn.parallel import DistributedDataParallel

    from tigon.cli import main
    from tigon.train import tiny

    wrap = DistributedDataParallel.__init__

    def recording_init(self, *args, **kwargs):
        if bucket_view is not None:  # DDP as the Trainer alone would build it
            kwargs["gradient_as_bucket_view"] = bucket_view
        wrap(self, *args, **kwargs)
        Path(record, f"rank{rank}.json").write_text(json.dumps({"gradient_as_bucket_view": self.gradient_as_bucket_view}))

    DistributedDataParallel.__init__ = recording_init
    argv = ["sft", "--dataset", f"{tiny.BUNDLED_DATASET}#24", "--batch-size", "2", "--grad-accum", "2",
            "--max-length", "40", "--max-steps", "3", "--save-steps", "0", "--samples", "0", "--no-kernels",
            "--output-dir", out]
    assert main(argv) == 0


def _run(tmp_path: Path, name: str, bucket_view: bool | None) -> tuple[list[dict], dict[int, tuple[float, float]]]:
    import torch.multiprocessing as mp

    out, record = tmp_path / name, tmp_path / f"{name}-record"
    record.mkdir()
    mp.spawn(_sft_worker, args=(_free_port(), str(out), str(record), bucket_view), nprocs=WORLD, join=True)
    wrappers = [json.loads((record / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return wrappers, {row["step"]: (row["loss"], row["grad_norm"]) for row in rows if "loss" in row}


def test_ddp_run_keeps_one_copy_of_the_gradients(tmp_path):
    """Both processes train under DDP, which holds the gradients as views into its all-reduce
    buckets (one copy of them, not two), with gradient accumulation: the losses and gradient norms
    are those of the same run with DDP's default separate gradients, step for step."""
    wrappers, logged = _run(tmp_path, "views", None)
    assert wrappers == [{"gradient_as_bucket_view": True}] * WORLD
    _, default_logged = _run(tmp_path, "copies", False)
    assert sorted(logged) == [1, 2, 3] and all(math.isfinite(v) for row in logged.values() for v in row), logged
    assert logged[3][0] < logged[1][0], logged  # it trains
    assert logged == default_logged
