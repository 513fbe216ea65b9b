"""Why a plainly launched fwd+bwd of an op takes longer than its GPU time: for each op and
implementation, the plain-launch time (`do_bench`, as `tigon bench` takes it), the CUDA-graph time,
the host's time to issue one fwd+bwd (on an idle GPU, split at the forward's return), and from a
profiler trace the GPU's kernels of one call with the idle gaps between them.

Usage (GPU): PYTHONPATH=src python3 scripts/launch_timeline.py [rms_norm rope:8x32x8x2048x128 ...]
                 [--impls tigon peer compile eager]
Each op at its first registered size (its headline shape) unless NAME:SIZE gives one.
"""

import argparse
import statistics
import time

import torch

import tigon.bench.ops  # noqa: F401  (registers the bench ops)
from tigon.bench.harness import differentiable_outputs, fwd_bwd_step
from tigon.bench.registry import BENCH_OPS, parse_size
from tigon.timing import time_ms

parser = argparse.ArgumentParser()
parser.add_argument("ops", nargs="*", default=["rms_norm", "rope", "swiglu"], metavar="NAME[:SIZE]")
parser.add_argument("--impls", nargs="+", default=["tigon", "peer", "compile"])
args = parser.parse_args()
device = torch.device("cuda")


def idle_gpu_host_us(fn, grads, leaves, calls=100):
    """Median host µs, on an idle GPU, until the forward returns and until the backward returns."""
    fwd, total = [], []
    for _ in range(calls):
        for leaf in leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = differentiable_outputs(fn())
        mid = time.perf_counter()
        torch.autograd.backward(outs, grads)
        end = time.perf_counter()
        fwd.append(mid - start)
        total.append(end - start)
    return 1e6 * statistics.median(fwd), 1e6 * statistics.median(total)


def kernel_timeline(step, leaves, reps=12):
    """The kernels of the last call of `reps` do_bench-like calls (an L2-flushing memset before
    each): (name, start µs after the first kernel, duration µs) and the idle µs before each."""
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    marker = "launch_timeline_call"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for leaf in leaves:
                leaf.grad = None
            cache.zero_()
            with torch.profiler.record_function(marker):
                step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    # Kernels after the last L2-flushing memset (256 MiB: tens of µs) are the last call's.
    last_fill = max(i for i, e in enumerate(events) if e.time_range.elapsed_us() > 30
                    and ("memset" in e.name.lower() or "fill" in e.name.lower()))
    call = events[last_fill + 1:]
    fill_end = events[last_fill].time_range.end
    rows, prev_end = [], fill_end
    for e in call:
        rows.append((e.name[:70], e.time_range.start - fill_end, e.time_range.elapsed_us(),
                     max(0, e.time_range.start - prev_end)))
        prev_end = max(prev_end, e.time_range.end)
    return rows, prev_end - fill_end


for case in args.ops:
    name, _, size_text = case.partition(":")
    op = BENCH_OPS[name]
    size = parse_size(size_text) if size_text else op.sizes[0]
    torch.manual_seed(0)
    inputs = op.make_inputs(size, torch.bfloat16, device)
    leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = [torch.randn_like(o) for o in differentiable_outputs(op.eager(*inputs))]
    print(f"=== {name} {'x'.join(map(str, size))}")
    for impl in args.impls:
        if impl == "peer" and op.peer is None:
            continue
        try:
            fn = {"tigon": op.tigon, "eager": op.eager}.get(impl) or (
                op.peer() if impl == "peer" else torch.compile(op.eager, dynamic=False))
            step = fwd_bwd_step(fn, inputs, grads)
            launched = time_ms(step, device, leaves)
            graphed = time_ms(step, device, leaves, graph=True) if impl != "peer" else float("nan")
            fwd_us, total_us = idle_gpu_host_us(lambda: fn(*inputs), grads, leaves)
            rows, span = kernel_timeline(step, leaves)
        except Exception as err:  # a diagnostic: report and go on
            print(f"  {impl}: failed: {type(err).__name__}: {err}")
            continue
        busy = sum(r[2] for r in rows)
        print(f"  {impl}: launched {launched * 1e3:.1f} us, graph {graphed * 1e3:.1f} us; host on an idle GPU: "
              f"forward returns {fwd_us:.1f} us, backward {total_us:.1f} us; profiled call: span {span:.1f} us, "
              f"kernels {busy:.1f} us")
        for kname, start, dur, gap in rows:
            print(f"      +{start:7.1f} us  {dur:7.1f} us  (idle before {gap:6.1f})  {kname}")
