"""Where one end-to-end training step (tigon bench --e2e's model and batch) spends GPU time and
what is alive at its memory peak.

Usage (GPU): PYTHONPATH=src python3 scripts/profile_e2e.py [full|lora|qlora|lora-fp8] [--eager|--unsloth]
    [--graphs|--reduce-overhead] [--off SWITCH ...] [--ops] [--shape 1b|8b] [--lora-rank R]
    [--lora-targets q_proj v_proj ...] [--checkpointing] [--fp8 tensorwise|rowwise] [--host]
The model, adapters and batch are `python -m tigon.bench.e2e`'s with the same options (e.g. the 8B
r=64 q,v step: `lora --shape 8b --lora-rank 64 --lora-targets q_proj v_proj`). With --fp8 the
patched model's projections are torchao's FP8 linears (`tigon.patch(model, fp8=...)`, torchao on the
path), as the e2e bench's `tigon+fp8` rows.
With --unsloth the step is Unsloth's (`FastLanguageModel`, as `tigon.bench.e2e` builds it; its
wheels on the path first, as `scripts/gpu_check.sh unsloth` puts them).
With --graphs each forward + backward replays from a CUDA graph, and AdamW's update from another
(`tigon sft --cuda-graphs`); with --reduce-overhead the model runs under torch.compile's CUDA-graph
mode. The step reads its loss after backward, as `tigon bench --e2e` does. Prints the host's time in each phase of the step, the
kernels by total GPU time, grouped by family, where the GPU sits idle between kernels (by tenth of
the step, and the longest gaps), and the live allocations at the step's peak grouped by the
tigon/transformers/peft/torch.optim frames that made them (scripts/memory_peak_gpu.py).
"""

import argparse
import collections
import cProfile
import pstats
import time

import torch

import tigon
from tigon.bench.e2e import (LLAMA_1B, LORA_TARGETS, MODES, build_model, build_unsloth, captured_micro_step, micro_step,
                             shape_arg)
from tigon.cuda_graphs import CapturedOptimizer
from tigon.patch import SWITCHES

from kernel_report import idle_gaps, kernel_spans
from tigon.bench.memory import PeakRecord

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=MODES, nargs="?", default="full")
parser.add_argument("--eager", action="store_true", help="profile the unpatched model")
parser.add_argument("--unsloth", action="store_true", help="profile Unsloth's model (lora and qlora modes)")
parser.add_argument("--off", nargs="+", default=[], choices=SWITCHES,
                    help="tigon.patch switches to turn off")
parser.add_argument("--graphs", action="store_true",
                    help="forward + backward and the optimizer's update replayed from CUDA graphs (tigon.cuda_graphs)")
parser.add_argument("--reduce-overhead", action="store_true", help="under torch.compile(mode='reduce-overhead')")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--shape", type=shape_arg, default=LLAMA_1B, help="1b (default) or 8b: the Llama shape")
parser.add_argument("--lora-rank", type=int, default=16)
parser.add_argument("--lora-targets", nargs="+", choices=LORA_TARGETS, default=list(LORA_TARGETS))
parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
parser.add_argument("--fp8", choices=("tensorwise", "rowwise"), help="the patched model's projections in FP8 (torchao)")
parser.add_argument("--trace", metavar="FILE", help="also write a Chrome trace of one step (CPU + GPU, Python stacks)")
parser.add_argument("--host", action="store_true",
                    help="also profile one step's host (cProfile): the functions by own time, and tigon's by total")
parser.add_argument("--ops", action="store_true",
                    help="also list the aten ops by GPU time with their input shapes (which GEMM is which)")
args = parser.parse_args()
if args.fp8 and (args.eager or args.unsloth):
    parser.error("--fp8 is tigon's patch option: not with --eager or --unsloth")
if not torch.cuda.is_available():
    parser.exit(2, "profile_e2e.py: needs a CUDA GPU (none is visible here)\n")

device = torch.device("cuda")
build = build_unsloth if args.unsloth else build_model
checkpointing = ("unsloth" if args.unsloth else True) if args.checkpointing else False
model = build(args.mode, args.seq, device, shape=args.shape, lora_rank=args.lora_rank, checkpointing=checkpointing,
              lora_targets=args.lora_targets)
if not (args.eager or args.unsloth):
    print(tigon.patch(model, fp8=args.fp8, **dict.fromkeys(args.off, False)))
model.train()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
if args.graphs:
    optimizer = CapturedOptimizer(optimizer, device=device)
ids = torch.randint(0, args.shape["vocab_size"], (args.batch, args.seq), device=device)
if args.graphs:
    forward_backward = captured_micro_step(model)
else:
    forward_backward = micro_step(torch.compile(model, mode="reduce-overhead") if args.reduce_overhead else model)
PHASES = ("optimizer", "zero_grad", "forward + backward", "loss read")
phase_s = collections.defaultdict(list)


def step():
    marks = [time.perf_counter()]
    optimizer.step()
    marks.append(time.perf_counter())
    optimizer.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    loss = forward_backward(ids)
    marks.append(time.perf_counter())
    loss.item()  # where the Trainer reads it (its NaN check)
    marks.append(time.perf_counter())
    for name, begin, end in zip(PHASES, marks, marks[1:]):
        phase_s[name].append(end - begin)


for _ in range(4):
    step()
torch.cuda.synchronize()
phase_s.clear()
start = time.perf_counter()
for _ in range(10):
    step()
torch.cuda.synchronize()
print(f"step {1e3 * (time.perf_counter() - start) / 10:.1f} ms wall; host ms per phase (median; the loss read "
      "waits for the GPU): " + ", ".join(f"{name} {1e3 * sorted(t)[len(t) // 2]:.2f}" for name, t in phase_s.items()))

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
total = sum(e.device_time_total for e in kernels) / 1e3
print(f"GPU kernel time {total:.1f} ms per step")


def family(name: str) -> str:
    low = name.lower()
    for key, label in (("flash", "attention"), ("fmha", "attention"), ("attention", "attention"),
                       ("gemm", "gemm"), ("sm90_xmma", "gemm"), ("cutlass", "gemm"), ("nvjet", "gemm"),
                       ("adam", "optimizer"), ("cross_entropy", "tigon loss"), ("rms_norm", "tigon norm"),
                       ("rope", "tigon rope"), ("glu", "tigon glu"), ("lora", "tigon lora"),
                       ("embedding", "embedding"), ("elementwise", "elementwise"), ("reduce", "reduce"),
                       ("copy", "copy"), ("fill", "fill")):
        if key in low:
            return label
    return "other"


# Where the GPU waits (kernel timestamps from the CUDA-only profile, which adds little host time):
# by tenth of the step, and the longest gaps with the kernels around them.
spans = kernel_spans(prof)
if spans:
    gaps = idle_gaps(spans)
    first, last_end = min(s[0] for s in spans), max(s[1] for s in spans)
    tenths = [0.0] * 10
    for start, length, *_ in gaps:
        tenths[min(9, int(10 * (start - first) / (last_end - first)))] += length / 1e3
    print(f"GPU idle {sum(g[1] for g in gaps) / 1e3:.1f} ms of a {(last_end - first) / 1e3:.1f} ms kernel span; "
          "by tenth of the span (ms): " + " ".join(f"{t:.1f}" for t in tenths))
    for start, length, before, after in sorted(gaps, key=lambda g: -g[1])[:10]:
        print(f"  {length / 1e3:6.2f} ms at {(start - first) / 1e3:7.1f} ms, after {before[:45]} before {after[:45]}")

groups = collections.Counter()
for e in kernels:
    groups[family(e.key)] += e.device_time_total / 1e3
for name, ms in groups.most_common():
    print(f"  {name:<14}{ms:8.2f} ms {100 * ms / total:5.1f}%")
print("top kernels:")
for e in sorted(kernels, key=lambda e: -e.device_time_total)[:25]:
    print(f"  {e.device_time_total / 1e3:8.2f} ms x{e.count:<4} {e.key[:110]}")

if args.ops:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    print("aten ops by their own GPU time, with input shapes:")
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:30]:
        per_call = e.self_device_time_total / e.count
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms x{e.count:<4} {per_call:8.1f} us  {e.key:<28} {e.input_shapes}")

if args.host:
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    print("host, one step under cProfile (its own overhead included), by own time:")
    stats.sort_stats("tottime").print_stats(30)
    print("host, by total time, tigon's and transformers' functions:")
    stats.sort_stats("cumulative").print_stats(r"tigon|transformers", 40)

if args.trace:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(args.trace)

torch.cuda.reset_peak_memory_stats()
with PeakRecord(args.batch * args.seq) as record:
    step()
print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
print(record.report())
