"""Where the vision tower's forward + backward spends GPU time (tigon.bench.vlm_e2e's tower and
batch), unpatched and tigon-patched, one after the other in this process.

Usage (GPU): PYTHONPATH=src python3 scripts/profile_vision_tower.py [--shape 2b] [--batch 4] [--reps 3]
Prints, per implementation, the median fwd+bwd time, the kernels by GPU time and idle stretches
(scripts/kernel_report.py) and the aten ops by GPU time with their input shapes.
"""

import argparse

import torch

import tigon
from tigon.bench.vlm_e2e import SHAPES, build_vlm, image_batch, time_vision

from kernel_report import report_profile

parser = argparse.ArgumentParser()
parser.add_argument("--shape", choices=sorted(SHAPES), default="2b")
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--reps", type=int, default=3)
args = parser.parse_args()
device = torch.device("cuda")
grid = SHAPES[args.shape]["grid"]
for impl in ("eager", "tigon"):
    model = build_vlm("full", 2048, device, shape=args.shape, lora_rank=16)
    if impl == "tigon":
        print(tigon.patch(model))
    print(f"== {impl}: vision fwd+bwd median {time_vision(model, device, args.batch, 5, grid):.2f} ms")
    visual = model.model.visual  # (a full fine-tune: no PEFT wrapper)
    pixels, grid_thw = image_batch(device, args.batch, grid)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        for _ in range(args.reps):
            out = visual(pixels, grid_thw=grid_thw).pooler_output
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    report_profile(prof, args.reps, top=20)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=40,
                                                             max_shapes_column_width=60))
    tigon.unpatch(model)
    del model, visual, out, prof
    torch.cuda.empty_cache()
