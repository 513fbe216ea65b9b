"""tigon bench --host: host time per fwd+bwd call runs for every implementation and says why not."""

import json

import pytest
import torch

from tigon.bench.host import HOST_SIZES, run_host, time_calls
from tigon.cli import main


def test_host_bench_runs_and_compares(tmp_path):
    records = run_host(["rms_norm"], ["tigon", "eager", "peer"], dtype=torch.float32, calls=2, rounds=1,
                       device=torch.device("cpu"), out_dir=tmp_path, log=lambda line: None)
    by_impl = {r["impl"]: r for r in records}
    assert set(by_impl) == {"tigon", "eager", "peer"}
    for impl in ("tigon", "eager"):
        assert by_impl[impl]["issue_us"] > 0 and by_impl[impl]["wall_us"] >= by_impl[impl]["issue_us"]
    assert by_impl["tigon"]["vs_eager"] == pytest.approx(by_impl["tigon"]["issue_us"] / by_impl["eager"]["issue_us"])
    peer = by_impl["peer"]  # Liger-Kernel measured where installed, else its import error said
    assert ("issue_us" in peer) != ("error" in peer)
    assert json.loads((tmp_path / "host.json").read_text())["results"][0]["op"] == "rms_norm"


def test_time_calls_drops_grads_counts_calls_and_takes_turns():
    x = torch.ones(3, requires_grad=True)
    calls = []

    def step(name):
        def run():
            assert x.grad is None
            calls.append(name)
            (2 * x).sum().backward()
        return run

    times = time_calls({"a": step("a"), "b": step("b")}, torch.device("cpu"), calls=3, rounds=2, leaves=[x])
    assert calls == (["a"] * 3 + ["b"] * 3) * 3  # a warm-up round, then two timed, the steps in turn
    assert set(times) == {"a", "b"} and all(0 < issue <= wall for issue, wall in times.values())


def test_host_bench_rejects_unknown_op_and_bad_counts(capsys):
    assert "rope" in HOST_SIZES and "cross_entropy" in HOST_SIZES
    assert main(["bench", "--host", "--ops", "lora_linear"]) == 2
    assert "--ops for --host must be among" in capsys.readouterr().err
    with pytest.raises(ValueError, match="calls and rounds must be >= 1"):
        run_host(["rms_norm"], calls=0, device=torch.device("cpu"))
