"""The GPU's side of profiled steps, from a ``torch.profiler`` run: kernel span, busy and idle time per
step, the longest idle stretches and the kernels that take the most time (scripts/profile_sft.py,
scripts/qlora_bench.py --profile)."""

import collections

import torch


def report_profile(prof, steps: int, top: int = 25) -> None:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    if not spans:
        print("no kernels profiled")
        return
    busy, busy_until, idle = 0.0, None, []
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            idle.append((start - busy_until, name))
        if busy_until is None or end > busy_until:
            busy += end - max(start, busy_until or start)
            busy_until = end
    span = spans[-1][1] - spans[0][0]
    print(f"profiled {steps} steps: kernel span {span / 1e3 / steps:.1f} ms per step, GPU busy "
          f"{busy / 1e3 / steps:.1f} ms, idle {sum(i[0] for i in idle) / 1e3 / steps:.1f} ms per step")
    for length, after in sorted(idle, reverse=True)[:8]:
        print(f"  idle {length / 1e3:6.2f} ms before {after[:70]}")
    totals = collections.Counter()
    counts = collections.Counter()
    for e in kernels:
        totals[e.name] += e.time_range.elapsed_us() / steps
        counts[e.name] += 1
    for name, us in totals.most_common(top):
        print(f"  {us / 1e3:7.2f} ms x{counts[name] // steps:<4} {name[:100]}")
