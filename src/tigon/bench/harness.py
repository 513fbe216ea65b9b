"""Time and measure tigon, PyTorch eager, torch.compile and (where an op names one) the
best-known peer library on the same inputs in one run.

Times are medians (`tigon.timing`): on CUDA of ``triton.testing.do_bench_cudagraph`` (CUDA-graph
replay, the GPU's time alone) and, as the "launch" column, of plain ``do_bench`` (Python and
launch overhead included, which dominates a lone call of a small op); on CPU a wall-clock median.
A plain launch times the host as much as the GPU, and a host's speed drifts within a run: the
implementations take turns over LAUNCH_ROUNDS rounds and each keeps its median round.
Peak memory is the rise of ``torch.cuda.max_memory_allocated()`` during one fwd+bwd over what the
inputs hold, less the ``.grad`` buffers it produces (the gradients themselves are not counted;
everything else the op allocates is).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tigon.bench.registry import BENCH_OPS, BenchOp, Size
from tigon.timing import measure_bandwidth, measure_matmul_rate, time_ms

IMPLS = ("tigon", "eager", "compile", "peer")  # peer: only for ops that name one
LAUNCH_ROUNDS = 3


def differentiable_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's output (one tensor or a sequence) that require a gradient."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def fwd_bwd_step(fn: Callable, args: Sequence[Any], grads: list[torch.Tensor] | None) -> Callable[[], None]:
    """A call of `fn` on `args` and the backward of its differentiable outputs with `grads`."""

    def step() -> None:
        outs = differentiable_outputs(fn(*args))
        torch.autograd.backward(outs, grads)

    return step


def peak_mib(step: Callable[[], None], device: torch.device, leaves: list[torch.Tensor]) -> float | None:
    """Peak allocation of one fwd+bwd above the inputs, less the gradients it hands back: the
    `.grad` buffers are left out, everything else the op allocates counts."""
    if device.type != "cuda":
        return None
    step()  # warm: caches and lazily built state are not part of the op's peak
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    grad_bytes = sum(leaf.grad.nbytes for leaf in leaves if leaf.grad is not None)
    return (torch.cuda.max_memory_allocated(device) - base - grad_bytes) / 2**20


def bench_one(
    op: BenchOp,
    size: Size,
    dtype: torch.dtype,
    device: torch.device,
    bandwidth: float,
    matmul_rate: float | None,
    impls: Sequence[str] = IMPLS,
) -> list[dict[str, Any]]:
    """Measure each implementation of `op` at `size`; one record per implementation (none for
    "peer" where the op has no peer)."""
    impls = [impl for impl in impls if impl != "peer" or op.peer is not None]
    torch.manual_seed(0)
    args = op.make_inputs(size, dtype, device)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    fns = {"tigon": op.tigon, "eager": op.eager}
    if "compile" in impls:
        fns["compile"] = torch.compile(op.eager, dynamic=False)
    # A scalar output is a loss: backpropagate 1 as `loss.backward()` does. The outputs' shapes come
    # from tigon's call where it is measured: eager's may not fit where tigon's does (it is then an
    # error row of its own, not the end of the run).
    probe = op.tigon if "tigon" in impls else op.eager
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in differentiable_outputs(probe(*args))]
    floor_s = op.bytes_moved(size, dtype) / bandwidth
    if op.flops(size) and matmul_rate:
        floor_s = max(floor_s, op.flops(size) / matmul_rate)
    records, steps = [], {}
    for impl in impls:
        record: dict[str, Any] = {"op": op.name, "size": "x".join(map(str, size)), "impl": impl}
        try:
            fn = op.peer() if impl == "peer" else fns[impl]
        except ImportError as err:  # the peer is measured where it is installed
            records.append({**record, "skipped": f"{err.name or err} is not installed"})
            continue
        try:
            step = fwd_bwd_step(fn, args, grads)
            record["peak_mib"] = peak_mib(step, device, leaves)
            # A peer is launch-timed only: its torch.compile'd chunks need not survive CUDA-graph
            # capture. Compare it by the launch-timed ratio.
            if device.type == "cuda" and impl != "peer":
                record["fwd_ms"] = time_ms(lambda fn=fn: fn(*args), device, [], graph=True)
                record["fwd_bwd_ms"] = time_ms(step, device, leaves, graph=True)
            steps[impl] = (fn, step, record)
        except Exception as err:  # one failing implementation must not hide the others' numbers
            record["error"] = f"{type(err).__name__}: {err}"
        for leaf in leaves:
            leaf.grad = None
        records.append(record)
    launches: dict[str, list[tuple[float, float]]] = {impl: [] for impl in steps}
    for _ in range(LAUNCH_ROUNDS if device.type == "cuda" else 1):
        for impl, (fn, step, record) in steps.items():
            if "error" in record:
                continue
            try:
                launches[impl].append((time_ms(lambda fn=fn: fn(*args), device, []), time_ms(step, device, leaves)))
            except Exception as err:
                record["error"] = f"{type(err).__name__}: {err}"
            for leaf in leaves:
                leaf.grad = None
    for impl, (_, _, record) in steps.items():
        if "error" in record:
            continue
        record["fwd_host_ms"] = statistics.median(fwd for fwd, _ in launches[impl])
        record["fwd_bwd_host_ms"] = statistics.median(fwd_bwd for _, fwd_bwd in launches[impl])
        record.setdefault("fwd_ms", record["fwd_host_ms"])
        record.setdefault("fwd_bwd_ms", record["fwd_bwd_host_ms"])
        if device.type == "cuda":  # the floor is the GPU's: a CPU run has none worth a ratio
            record["roofline_pct"] = 100 * floor_s * 1e3 / record["fwd_bwd_ms"]
    by_impl = {r["impl"]: r for r in records}
    for record in records:
        for base in ("eager", "compile", "peer"):
            for key, suffix in (("fwd_bwd_ms", ""), ("fwd_bwd_host_ms", "_host")):
                if key in record and key in by_impl.get(base, {}):
                    record[f"vs_{base}{suffix}"] = record[key] / by_impl[base][key]
    return records


def environment(device: torch.device) -> dict[str, Any]:
    """Date, device and versions, recorded with every result."""
    import triton

    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    return info


def run_isolated(module: str, argv: Sequence[str], record: dict[str, Any], *, timeout_s: float | None = None,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module *argv --record FILE`` in a fresh process; returns `record` updated with
    the dict that process wrote to FILE as JSON. A process that dies before writing it (killed for
    memory, a CUDA fault, a hang past `timeout_s`) gives `record` an ``error`` with its exit status
    and last output line instead: one case's crash is that case's result, and the run goes on.
    A fresh process per case also keeps a peer library's global patches and one case's allocator
    state (fragmentation after an out-of-memory) from reaching the next case."""
    with tempfile.TemporaryDirectory(prefix="tigon-case-") as folder:
        out = Path(folder) / "record.json"
        try:
            done = subprocess.run([sys.executable, "-m", module, *argv, "--record", str(out)], capture_output=True,
                                  text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            return {**record, "error": f"timed out after {timeout_s:.0f} s"}
        if out.is_file():
            return {**record, **json.loads(out.read_text())}
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        status = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
        print(f"{module} {' '.join(argv)}: {status}; its last output:", *lines[-30:], sep="\n", file=sys.stderr)
        return {**record, "error": f"process ended ({status}) without a result: {lines[-1][:200] if lines else ''}"}


def format_table(records: list[dict[str, Any]]) -> str:
    """One line per record: graph-replayed (GPU) times and ratios first (the peer's launch-timed,
    and its column the launch-timed ratio), then the plain-launch fwd+bwd time (host overhead
    included) and its ratio to torch.compile."""
    def ratio(key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else "-"

    header = (f"{'op':<24}{'size':<20}{'impl':<8}{'fwd ms':>8}{'fwd+bwd':>9}{'peak MiB':>9}"
              f"{'vs eager':>9}{'vs comp':>8}{'vs peer':>8}{'roofline':>9}{'launch ms':>10}{'vs comp':>8}")
    lines = [header]
    for r in records:
        head = f"{r['op']:<24}{r['size']:<20}{r['impl']:<8}"
        if "skipped" in r:
            continue
        if "error" in r:
            lines.append(f"{head}  failed: {r['error'][:80]}")
            continue
        peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        roofline = f"{r['roofline_pct']:.0f}%" if "roofline_pct" in r else "-"
        lines.append(
            f"{head}{r['fwd_ms']:>8.3f}{r['fwd_bwd_ms']:>9.3f}{peak:>9}"
            f"{ratio('vs_eager'):>9}{ratio('vs_compile'):>8}{ratio('vs_peer_host'):>8}{roofline:>9}"
            f"{r['fwd_bwd_host_ms']:>10.3f}{ratio('vs_compile_host'):>8}"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], op: str, path: Path) -> bool:
    """fwd+bwd time over the size sweep, one line per implementation. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in records if r["op"] == op and "fwd_bwd_ms" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in IMPLS:
        pts = [r for r in rows if r["impl"] == impl]
        if not pts:
            continue
        ax.plot([r["size"] for r in pts], [r["fwd_bwd_ms"] for r in pts], marker="o", label=impl)
    ax.set_title(f"{op}: forward + backward")
    ax.set_xlabel("size")
    ax.set_ylabel("ms (median)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_benchmarks(
    ops: Sequence[str] | None = None,
    sizes: Sequence[Size] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    impls: Sequence[str] = IMPLS,
    headline: bool = False,
) -> list[dict[str, Any]]:
    """Benchmark `ops` (all registered when None) over `sizes` (each op's sweep when None, only
    its first, headline size when `headline`), for the implementations in `impls`."""
    import tigon.bench.ops  # noqa: F401  (registers the cases)

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = list(ops) if ops else list(BENCH_OPS)
    unknown = [n for n in names if n not in BENCH_OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(BENCH_OPS)}")
    env = environment(device)
    bandwidth = measure_bandwidth(device)
    needs_matmul = any(BENCH_OPS[n].flops(BENCH_OPS[n].sizes[0]) for n in names)
    matmul_rate = measure_matmul_rate(device, dtype) if needs_matmul else None
    if device.type == "cuda":
        log(f"tigon bench on {env['device']} (torch {env['torch']}, triton {env['triton']}, {dtype}), "
            f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"
            + (f", matmul {matmul_rate / 1e12:.0f} TFLOP/s" if matmul_rate else ""))
    else:
        log(f"tigon bench on the CPU (torch {env['torch']}, {dtype}): the benchmarks are for CUDA GPUs; here they "
            "time each implementation plainly, with no peak memory and no roofline")
    records: list[dict[str, Any]] = []
    groups = 0
    for name in names:
        op = BENCH_OPS[name]
        op_sizes = sizes or (op.sizes if device.type == "cuda" else op.cpu_sizes)
        for size in op_sizes[:1] if headline else op_sizes:
            records += bench_one(op, size, dtype, device, bandwidth, matmul_rate, impls)
            log(format_table([r for r in records if r["op"] == name and r["size"] == "x".join(map(str, size))]))
            groups += 1
    for reason in dict.fromkeys(r["skipped"] for r in records if "skipped" in r):
        log(f"peer: not measured, {reason}")
    if groups > 1:  # the whole sweep again in one table, after the progress above
        log("\n" + format_table(records))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"environment": env, "bandwidth_bytes_per_s": bandwidth, "matmul_flops": matmul_rate,
                   "dtype": str(dtype), "results": records}
        (out_dir / "bench.json").write_text(json.dumps(payload, indent=1))
        for name in names:
            if plot(records, name, out_dir / f"{name}.png"):
                log(f"wrote {out_dir / (name + '.png')}")
        log(f"wrote {out_dir / 'bench.json'}")
    return records
