"""Where a `tigon sft` (or `tigon rlhf`) step spends its time: wall time per step, the host's Python by function
over five steps (cProfile), the GPU's kernels and idle stretches over two steps, and every
device-to-host synchronisation in one step with the Python line that made it (GPU only).

Usage: PYTHONPATH=src python3 scripts/profile_sft.py [rlhf] [tigon sft / tigon rlhf options...]
e.g. after scripts/sft_gpu_compare.sh has written its model and data to /tmp/sft-compare:
    python3 scripts/profile_sft.py --model /tmp/sft-compare/model --dataset /tmp/sft-compare/text.jsonl \
        --tuner lora --dtype bf16 --max-length 2048 --batch-size 4 --max-steps 24 --save-steps 0 \
        --samples 0 --overwrite --output-dir /tmp/sft-profile
"""

import collections
import cProfile
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch
from transformers import TrainerCallback

from kernel_report import report_profile
from tigon import cli
from tigon.train.trainer import TigonTrainer

HOST_PROFILED, PROFILED, SYNC_CHECKED = (3, 7), (8, 9), 11


class StepProfiler(TrainerCallback):
    def __init__(self):
        self.starts: list[float] = []
        self.prof = None
        self.syncs: collections.Counter = collections.Counter()
        self.host = cProfile.Profile()

    def on_step_begin(self, args, state, control, **kwargs):
        self.starts.append(time.perf_counter())
        step = state.global_step
        if step == HOST_PROFILED[0]:
            self.host.enable()
        if step == PROFILED[0]:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step  # already advanced past the step that ended
        if step == HOST_PROFILED[1] + 1:
            self.host.disable()
            steps = HOST_PROFILED[1] - HOST_PROFILED[0] + 1
            print(f"host Python over {steps} steps (cProfile; its own overhead inflates the model's many small calls):")
            stats = pstats.Stats(self.host)
            stats.sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(20)
        if step == PROFILED[1] + 1:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            report_profile(self.prof, len(PROFILED))
        if step == SYNC_CHECKED:  # from here: this step's log, the next batch, the next step
            torch.cuda.set_sync_debug_mode("warn")
        if step == SYNC_CHECKED + 1:
            torch.cuda.set_sync_debug_mode("default")

    def on_train_end(self, args, state, control, **kwargs):
        # Steps after the instrumented ones (the profilers slow the host): run --max-steps 24 or more.
        steps = [b - a for a, b in zip(self.starts, self.starts[1:])][SYNC_CHECKED + 2:]
        if steps:
            print(f"step wall time after step {SYNC_CHECKED + 1}: median {1e3 * statistics.median(steps):.1f} ms, "
                  f"min {1e3 * min(steps):.1f}, max {1e3 * max(steps):.1f} ({len(steps)} steps)")
        print(f"device-to-host synchronisations from the end of step {SYNC_CHECKED} to the end of the next:")
        for where, n in self.syncs.most_common(20):
            print(f"  x{n} {where}")


profiler = StepProfiler()


def record_sync(message, category, filename, lineno, file=None, line=None):
    if "synchronizing" not in str(message):
        return
    frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
    where = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}" for f in frames[-4:][::-1])
    profiler.syncs[where] += 1


warnings.showwarning = record_sync
warnings.simplefilter("always")
# Every trainer tigon builds (sft's, and rlhf's TRL subclasses) runs TigonTrainer.__init__: the
# profiler joins its callbacks there.
base_init = TigonTrainer.__init__


def init_with_profiler(self, *args, **kwargs):
    base_init(self, *args, **kwargs)
    if profiler not in self.callback_handler.callbacks:
        self.add_callback(profiler)


TigonTrainer.__init__ = init_with_profiler
command = sys.argv[1:2] if sys.argv[1:2] == ["rlhf"] else []
sys.exit(cli.main([*(command or ["sft"]), *sys.argv[1 + len(command):]]))
