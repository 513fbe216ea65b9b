"""What is alive at the GPU memory peak of a training step: the caching allocator's record of every
allocation and free during the step (``torch.cuda.memory._record_memory_history``) is replayed to its
largest total, and the blocks live there are listed by the Python code that allocated them, in MiB
and bytes per token. Blocks allocated before the step (weights, optimizer state) are one line.

The record and its report are tigon.bench.memory's PeakRecord (also behind scripts/qlora_bench.py
--inspect memory, scripts/profile_e2e.py and `python -m tigon.bench.e2e --memory-snapshot`).

As a command, around one step of `tigon sft` / `tigon rlhf` (the step after the 4th):

    PYTHONPATH=src python3 scripts/memory_peak_gpu.py rlhf --method dpo --model ... [tigon options]
"""

from __future__ import annotations

import sys

import torch

from tigon.bench.memory import PeakRecord


def main() -> int:
    if not torch.cuda.is_available():
        print("memory_peak_gpu.py: the allocator's record is CUDA's: run it on a machine with a GPU", file=sys.stderr)
        return 2
    from transformers import TrainerCallback

    from tigon import cli
    from tigon.train.trainer import TigonTrainer

    recorded_step = 5

    class OneStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == recorded_step:
                sequences = args.per_device_train_batch_size * args.gradient_accumulation_steps
                self.record = PeakRecord(sequences, "sequence").__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == recorded_step + 1:
                self.record.__exit__(None, None, None)
                print(self.record.report())

    base_init = TigonTrainer.__init__

    def init_with_record(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        self.add_callback(OneStep())

    TigonTrainer.__init__ = init_with_record
    command = sys.argv[1:2] if sys.argv[1:2] == ["rlhf"] else []
    return cli.main([*(command or ["sft"]), *sys.argv[1 + len(command):]])


if __name__ == "__main__":
    sys.exit(main())
