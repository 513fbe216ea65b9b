"""How long the host takes to issue one training step (tigon bench --e2e's model and batch), next to
how long the GPU takes to run it: where the host is slower, the GPU waits.

Usage (GPU): PYTHONPATH=src python3 scripts/host_time.py [full|lora] [--profile N]
For eager and tigon: host milliseconds to return from forward, backward and optimizer.step (launches
are asynchronous, so these are the host's own costs), then the whole step to the last kernel.
--profile N prints the N Python functions with the most own time in one forward of each.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import tigon
from tigon.bench.e2e import LLAMA_1B, build_model

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=("full", "lora"), nargs="?", default="full")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--profile", type=int, default=0, metavar="N")
parser.add_argument("--dump", metavar="DIR", help="also write each forward's profile (pstats) here")
args = parser.parse_args()
device = torch.device("cuda")


def measure(impl: str) -> None:
    model = build_model(args.mode, args.seq, device, shape=LLAMA_1B, lora_rank=16, checkpointing=False)
    if impl == "tigon":
        tigon.patch(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (args.batch, args.seq), device=device)
    rows = []
    for i in range(args.steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        if i >= 2:
            rows.append([1e3 * (b - a) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t0, t4))])
    fwd, bwd, opt, step = (statistics.median(c) for c in zip(*rows))
    print(f"{args.mode} {impl:6} host: forward {fwd:6.1f} ms, backward {bwd:6.1f} ms, optimizer {opt:5.1f} ms; step {step:6.1f} ms")
    if args.profile:
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        loss = model(input_ids=ids, labels=ids).loss
        profiler.disable()
        loss.backward()
        torch.cuda.synchronize()
        if args.dump:
            profiler.dump_stats(f"{args.dump}/forward_{args.mode}_{impl}.pstats")
        print(f"-- {impl} forward, by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    tigon.unpatch(model)
    del model, optimizer
    torch.cuda.empty_cache()


for impl in ("eager", "tigon"):
    measure(impl)
