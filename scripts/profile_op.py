"""Where the time of one op's fwd+bwd goes: GPU kernel time vs the wall time of a step.

Usage: PYTHONPATH=src python3 scripts/profile_op.py rms_norm 16384x4096
"""

import sys
import time

import torch

import tigon.bench.ops  # noqa: F401
from tigon.bench.registry import BENCH_OPS, parse_size

op = BENCH_OPS[sys.argv[1]]
size = parse_size(sys.argv[2])
args = op.make_inputs(size, torch.bfloat16, torch.device("cuda"))
leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
for impl_name, fn in (("tigon", op.tigon), ("eager", op.eager)):
    outs = fn(*args)
    outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if isinstance(o, torch.Tensor)]
    grads = [torch.randn_like(o) for o in outs]

    def step():
        for leaf in leaves:
            leaf.grad = None
        o = fn(*args)
        o = [o] if isinstance(o, torch.Tensor) else [t for t in o if isinstance(t, torch.Tensor)]
        torch.autograd.backward(o, grads)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        step()
    cpu_issue = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / n * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"== {impl_name}: CPU issue {cpu_issue:.3f} ms/step, wall {wall:.3f} ms/step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
