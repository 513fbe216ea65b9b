"""The GPU's side of profiled steps, from a ``torch.profiler`` run: kernel span, busy and idle time per
step, the longest idle stretches and the kernels that take the most time (scripts/profile_sft.py,
scripts/qlora_bench.py --inspect profile; scripts/profile_e2e.py reads the idle stretches too)."""

import collections

import torch


def idle_gaps(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """(start, length, kernel before, kernel after) of every stretch with no kernel running, from
    (start, end, name) kernel intervals in any order."""
    gaps, busy_until, last = [], None, ""
    for start, end, name in sorted(intervals):
        if busy_until is not None and start > busy_until:
            gaps.append((busy_until, start - busy_until, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    return gaps


def kernel_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every kernel `prof` recorded."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def report_profile(prof, steps: int, top: int = 25) -> None:
    """Print, per step of the `steps` that `prof` recorded, the kernels' span, busy and idle time,
    the longest idle stretches, and the `top` kernels by time."""
    spans = kernel_spans(prof)
    if not spans:
        print("no kernels profiled")
        return
    gaps = idle_gaps(spans)
    span = max(s[1] for s in spans) - min(s[0] for s in spans)
    idle = sum(g[1] for g in gaps)
    print(f"profiled {steps} steps: kernel span {span / 1e3 / steps:.1f} ms per step, GPU busy "
          f"{(span - idle) / 1e3 / steps:.1f} ms, idle {idle / 1e3 / steps:.1f} ms per step")
    for _, length, _, after in sorted(gaps, key=lambda g: -g[1])[:8]:
        print(f"  idle {length / 1e3:6.2f} ms before {after[:70]}")
    totals = collections.Counter()
    counts = collections.Counter()
    for start, end, name in spans:
        totals[name] += (end - start) / steps
        counts[name] += 1
    for name, us in totals.most_common(top):
        print(f"  {us / 1e3:7.2f} ms x{counts[name] // steps:<4} {name[:100]}")
