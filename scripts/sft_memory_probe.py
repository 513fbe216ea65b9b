"""Where a `tigon sft` run's GPU memory goes, on every rank (plain, torchrun or accelerate launch):
the parameters by kind and dtype once training starts, the dtypes the first decoder layer sees in
its first forward, memory allocated / peak after each of the first steps, and for step 2 the
tensors autograd saved for backward (by dtype and shape) and how often each fused LoRA op ran.

Usage: [accelerate launch --config_file ... | torchrun ...] scripts/sft_memory_probe.py [tigon sft options...]
"""

import collections
import sys
from functools import wraps

import torch
from transformers import TrainerCallback

from tigon import cli
from tigon import functional
from tigon.train import run

GIB = 2**30
REPORTED_STEPS = 4
SAVED_STEP = 1  # global_step at the start of the step whose saved tensors are summarised
FUSED = ("lora_linear", "lora_linear_group", "lora_gated_mlp", "linear_cross_entropy", "add_rms_norm_glu_mlp")
calls: collections.Counter = collections.Counter()


def _counted(name):
    op = getattr(functional, name)

    @wraps(op)
    def counted(*args, **kwargs):
        calls[name] += 1
        return op(*args, **kwargs)

    return counted


for _name in FUSED:
    if hasattr(functional, _name):
        setattr(functional, _name, _counted(_name))


def _memory() -> str:
    if not torch.cuda.is_available():
        return "no GPU"
    torch.cuda.synchronize()
    return f"{torch.cuda.memory_allocated() / GIB:.2f} GiB allocated, peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class MemoryReport(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        kinds = collections.Counter(
            (type(p).__name__, str(p.dtype).removeprefix("torch."), "trained" if p.requires_grad else "frozen")
            for p in model.parameters()
        )
        print(f"[rank {_rank()}] train begin: {_memory()}; parameters {dict(kinds)}", flush=True)
        layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        handle = None

        def first_forward(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            weights = {n: f"{type(p).__name__}/{p.dtype}".replace("torch.", "") for n, p in module.named_parameters()
                       if n.endswith(("q_proj.weight", "q_proj.base_layer.weight", "gate_proj.base_layer.weight",
                                      "gate_proj.weight", "input_layernorm.weight"))}
            print(f"[rank {_rank()}] first decoder layer's forward: hidden {hidden.dtype}, autocast "
                  f"{torch.is_autocast_enabled('cuda')} ({torch.get_autocast_dtype('cuda')}), weights {weights}",
                  flush=True)
            handle.remove()

        handle = layer.register_forward_pre_hook(first_forward, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == SAVED_STEP:
            calls.clear()
            self.saved = collections.defaultdict(lambda: [0, 0])
            self.storages = set()

            def pack(t):
                key = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                self.saved[key][0] += 1
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.storages and storage.nbytes() > 0:
                    self.storages.add(storage.data_ptr())
                    self.saved[key][1] += storage.nbytes()
                return t

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.hooks.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == SAVED_STEP + 1:
            self.hooks.__exit__(None, None, None)
            if _rank() == 0:
                total = sum(b for _, b in self.saved.values())
                print(f"[rank 0] step {state.global_step}: fused op calls {dict(calls)}; saved for backward "
                      f"{total / GIB:.2f} GiB (distinct storages), largest:", flush=True)
                for (dtype, shape), (n, nbytes) in sorted(self.saved.items(), key=lambda kv: -kv[1][1])[:14]:
                    print(f"    {nbytes / GIB:6.2f} GiB  x{n:<4} {dtype} {shape}", flush=True)
        if state.global_step <= REPORTED_STEPS:
            print(f"[rank {_rank()}] after step {state.global_step}: {_memory()}", flush=True)


class ReportingTrainer(run.TigonTrainer):
    def __init__(self, *args, callbacks=None, **kwargs):
        super().__init__(*args, callbacks=[*(callbacks or []), MemoryReport()], **kwargs)


run.TigonTrainer = ReportingTrainer
sys.exit(cli.main(["sft", *sys.argv[1:]]))
