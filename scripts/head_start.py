"""How much of a training step (tigon bench --e2e's model and batch) waits for the host: each step
starts with a sleep kernel of S ms, so the host issues S ms of the step ahead of the GPU. A step
that was GPU-bound takes S ms longer; one whose host was late gets back what the head start hid.
With a head start longer than the host's lag the step shows its pure GPU time, measured without a
profiler (whose own host cost changes what it measures).

Usage (GPU): PYTHONPATH=src python3 scripts/head_start.py [full|lora] [--impls eager tigon]
Prints, per implementation and head start, the median step minus the head start.
"""

import argparse
import statistics
import time

import torch

import tigon
from tigon.bench.e2e import LLAMA_1B, build_model

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("full", "lora"), nargs="?", default="full")
parser.add_argument("--impls", nargs="+", default=["eager", "tigon"], choices=("eager", "tigon"))
parser.add_argument("--head-starts", nargs="+", type=float, default=[0.0, 5.0, 15.0, 40.0], metavar="MS")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
device = torch.device("cuda")


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def measure(impl: str, cycles_per_ms: float) -> None:
    model = build_model(args.mode, 2048, device, shape=LLAMA_1B, lora_rank=16, checkpointing=False)
    if impl == "tigon":
        tigon.patch(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (4, 2048), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    for head_start in args.head_starts:
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            if head_start:
                torch.cuda._sleep(int(head_start * cycles_per_ms))
            step()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - begin) - head_start)
        print(f"{args.mode} {impl:6} head start {head_start:5.1f} ms: step {statistics.median(times):6.1f} ms "
              f"(min {min(times):6.1f})", flush=True)
    tigon.unpatch(model)


rate = sleep_cycles_per_ms()
print(f"sleep kernel: {rate / 1e3:.0f} cycles per us")
for impl in args.impls:
    measure(impl, rate)
    torch.cuda.empty_cache()  # the model went with measure's frame
