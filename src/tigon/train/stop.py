"""Stopping a run cleanly: Ctrl-C (SIGINT) or SIGTERM during training finishes the optimizer
step in progress, writes a complete checkpoint through the Trainer's own (atomic) save, and
ends training, so that ``--resume`` continues exactly where it stopped. A second signal quits at
once, without saving (the save in progress, if any, is removed: nothing half-written remains)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import torch
from transformers import TrainerCallback

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopOnSignal(TrainerCallback):
    """Turns the first SIGINT/SIGTERM received inside `catching()` into "save a checkpoint and stop"
    at the end of the current optimizer step; `signum` says which arrived (None: none).

    With several processes, each rank may see the signal at a different point of a step, so they
    agree (a max over ranks) before acting, at logging steps only: the loss read there already
    waits for the device, so the agreement adds no wait of its own."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return

        def handler(signum: int, frame: object) -> None:
            if self.signum is not None:
                raise KeyboardInterrupt  # asked twice: quit now
            self.signum = signum

        previous = {s: signal.signal(s, handler) for s in SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _agreed(self, args, state) -> bool:
        if args.world_size == 1:
            return self.signum is not None
        if state.global_step % args.logging_steps and state.global_step < state.max_steps:
            return False
        flag = torch.tensor([self.signum or 0], device=args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self.signum = self.signum or int(flag.item()) or None
        return self.signum is not None

    def on_step_end(self, args, state, control, **kwargs):
        if self._agreed(args, state):
            control.should_save = True
            control.should_training_stop = True
            control.should_evaluate = False  # the user asked to stop: no evaluation pass first
            control.should_log = True  # the loss since the last log, which the checkpoint's metrics keep
        return control
