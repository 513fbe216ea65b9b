"""Host time per op call: what one fwd+bwd costs the Python side when the GPU's work is negligible.

At batch 1 × 1024 a training step issues hundreds of small kernels, and the GPU waits for the host
between them. This bench calls each op's fwd+bwd on inputs so small that the GPU finishes each
kernel before the host has issued the next, for tigon, PyTorch eager, torch.compile and the peer
(Liger-Kernel, where it is installed) in the same run, and reports microseconds per call:

* ``issue_us``: host time to issue one call (the loop's wall time before the final synchronise,
  over the calls): the Python path from the public function to the kernel launches, autograd's
  bookkeeping included;
* ``wall_us``: the same loop to the end of the GPU's work, over the calls (on a GPU that keeps
  up, about ``issue_us``).

Each figure is the median of several rounds of `calls` calls. On a CPU the kernels run in the
interpreter or as the reference: the numbers check the bench runs, they say nothing about a GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tigon.bench.harness import differentiable_outputs, environment, fwd_bwd_step
from tigon.bench.registry import BENCH_OPS, Size

IMPLS = ("tigon", "eager", "compile", "peer")
# Sizes whose GPU time is a few microseconds, in each op's registry layout (rope: batch, q heads,
# k heads, tokens, head dim; the rest rows x cols).
HOST_SIZES: dict[str, Size] = {
    "rms_norm": (16, 256),
    "add_rms_norm": (16, 256),
    "layer_norm": (16, 256),
    "swiglu": (16, 256),
    "geglu": (16, 256),
    "rope": (1, 4, 2, 16, 64),
    "cross_entropy": (16, 512),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(steps: dict[str, Callable[[], None]], device: torch.device, calls: int, rounds: int,
               leaves: Sequence[torch.Tensor] = ()) -> dict[str, tuple[float, float]]:
    """(issue, wall) microseconds per call of each of `steps`, medians over `rounds` rounds of
    `calls` calls after one warm-up round; the `.grad` of `leaves` is dropped before each call, as a
    training step's zero_grad does. The steps take turns within each round, so that a host whose
    speed drifts during the run (clock boost, a noisy neighbour) moves every figure alike."""
    issue: dict[str, list[float]] = {name: [] for name in steps}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                for leaf in leaves:
                    leaf.grad = None
                step()
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            if round_:  # the first round compiles and warms caches
                issue[name].append((issued - start) * 1e6 / calls)
                wall[name].append((done - start) * 1e6 / calls)
    return {name: (statistics.median(issue[name]), statistics.median(wall[name])) for name in steps}


def host_one(name: str, dtype: torch.dtype, device: torch.device, impls: Sequence[str], calls: int,
             rounds: int) -> list[dict[str, Any]]:
    """One record per implementation of op `name` at its :data:`HOST_SIZES` size."""
    op = BENCH_OPS[name]
    size = HOST_SIZES[name]
    impls = [impl for impl in impls if impl != "peer" or op.peer is not None]
    torch.manual_seed(0)
    args = op.make_inputs(size, dtype, device)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in differentiable_outputs(op.eager(*args))]
    records = {impl: {"op": name, "size": "x".join(map(str, size)), "impl": impl} for impl in impls}
    steps = {}
    for impl in impls:
        try:
            if impl == "peer":
                fn = op.peer()
            elif impl == "compile":
                fn = torch.compile(op.eager, dynamic=False)
            else:
                fn = op.tigon if impl == "tigon" else op.eager
            step = fwd_bwd_step(fn, args, grads)
            step()  # one that fails here must not stop the others' rounds
            steps[impl] = step
        except Exception as err:  # one failing implementation must not hide the others' numbers
            records[impl]["error"] = f"{type(err).__name__}: {err}"
        for leaf in leaves:
            leaf.grad = None
    for impl, (issue, wall) in time_calls(steps, device, calls, rounds, leaves).items():
        records[impl]["issue_us"], records[impl]["wall_us"] = issue, wall
    by_impl = {impl: r for impl, r in records.items() if "issue_us" in r}
    for record in records.values():
        for base in ("eager", "compile", "peer"):
            if "issue_us" in record and base in by_impl:
                record[f"vs_{base}"] = record["issue_us"] / by_impl[base]["issue_us"]
    return list(records.values())


def format_table(records: list[dict[str, Any]]) -> str:
    nan = float("nan")
    lines = [f"{'op':<16}{'size':<14}{'impl':<9}{'issue us':>9}{'wall us':>9}{'vs eager':>9}{'vs comp':>8}{'vs peer':>8}"]
    for r in records:
        head = f"{r['op']:<16}{r['size']:<14}{r['impl']:<9}"
        if "error" in r:
            lines.append(f"{head}  failed: {r['error'][:80]}")
            continue
        lines.append(f"{head}{r['issue_us']:>9.1f}{r['wall_us']:>9.1f}{r.get('vs_eager', nan):>8.2f}x"
                     f"{r.get('vs_compile', nan):>7.2f}x{r.get('vs_peer', nan):>7.2f}x")
    return "\n".join(lines)


def run_host(
    ops: Sequence[str] | None = None,
    impls: Sequence[str] = IMPLS,
    *,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 200,
    rounds: int = 5,
    device: torch.device | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Host time per fwd+bwd call of `ops` (default: every op of :data:`HOST_SIZES`) for each of
    `impls`; print the table, optionally write ``host.json`` to `out_dir`, return the records."""
    import tigon.bench.ops  # noqa: F401  (registers the cases)

    names = list(ops) if ops else list(HOST_SIZES)
    unknown = [n for n in names if n not in HOST_SIZES]
    if unknown:
        raise ValueError(f"--ops for --host must be among {', '.join(HOST_SIZES)}, got {', '.join(unknown)}")
    if calls < 1 or rounds < 1:
        raise ValueError(f"calls and rounds must be >= 1, got {calls} and {rounds}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    log(f"tigon bench --host on {env['device']} (torch {env['torch']}, triton {env['triton']}, {dtype}): "
        f"microseconds per fwd+bwd call, median of {rounds} rounds of {calls} calls, the implementations "
        "taking turns")
    records: list[dict[str, Any]] = []
    for name in names:
        records += host_one(name, dtype, device, impls, calls, rounds)
        log(format_table([r for r in records if r["op"] == name]))
    log("\n" + format_table(records))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"environment": env, "dtype": str(dtype), "calls": calls, "rounds": rounds, "results": records}
        (out_dir / "host.json").write_text(json.dumps(payload, indent=1))
        log(f"wrote {out_dir / 'host.json'}")
    return records
