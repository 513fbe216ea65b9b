"""The op benchmark's peer column: measured where an op names a peer, its absence said."""

import torch

from tigon.bench.harness import bench_one, format_table
from tigon.bench.registry import BenchOp


def _op(peer):
    return BenchOp(
        name="double", make_inputs=lambda size, dtype, device: (torch.randn(*size, dtype=dtype, device=device, requires_grad=True),),
        tigon=lambda x: x * 2, eager=lambda x: x + x, bytes_moved=lambda size, dtype: 1, sizes=[(8, 8)], cpu_sizes=[(8, 8)],
        peer=peer,
    )


def _missing_peer():
    import tigon_no_such_peer_library  # noqa: F401


def test_peer_is_measured_and_compared():
    records = bench_one(_op(lambda: (lambda x: 2 * x)), (8, 8), torch.float32, torch.device("cpu"), 1e9, None, ("tigon", "eager", "peer"))
    by_impl = {r["impl"]: r for r in records}
    assert set(by_impl) == {"tigon", "eager", "peer"}
    assert "fwd_bwd_ms" in by_impl["peer"] and "vs_peer_host" in by_impl["tigon"]
    assert "vs peer" in format_table(records)


def test_missing_peer_library_is_reported_and_no_peer_means_no_row():
    records = bench_one(_op(_missing_peer), (8, 8), torch.float32, torch.device("cpu"), 1e9, None, ("tigon", "peer"))
    assert records[-1] == {"op": "double", "size": "8x8", "impl": "peer",
                           "skipped": "tigon_no_such_peer_library is not installed"}
    assert "peer" not in format_table(records).splitlines()[-1] and "vs_peer_host" not in records[0]
    records = bench_one(_op(None), (8, 8), torch.float32, torch.device("cpu"), 1e9, None, ("tigon", "peer"))
    assert [r["impl"] for r in records] == ["tigon"]


def _out_of_memory(x):
    raise torch.OutOfMemoryError("CUDA out of memory (planted)")


def test_an_implementation_out_of_memory_is_its_own_error_row():
    op = _op(lambda: (lambda x: 2 * x))
    op.eager = _out_of_memory
    records = bench_one(op, (8, 8), torch.float32, torch.device("cpu"), 1e9, None, ("eager", "tigon", "peer"))
    by_impl = {r["impl"]: r for r in records}
    assert "out of memory" in by_impl["eager"]["error"]
    assert "fwd_bwd_host_ms" in by_impl["tigon"] and "fwd_bwd_host_ms" in by_impl["peer"]
    assert "eager" in format_table(records)
