"""The Trainer `tigon sft` runs: atomic checkpoints (`AtomicTrainer`) and a step loop whose host
does not wait for the GPU between logs.

A Hugging Face Trainer reads device values back in every step: the token count
(``include_num_input_tokens_seen``) and the NaN/inf filter of the logged loss each block until the
GPU has finished the step, and the dataloader's copies to the GPU (``non_blocking`` off) until it
has finished everything queued. Each such wait empties the GPU's queue, and the host's Python
between steps (optimizer step, bookkeeping, the next batch, the next forward's first layers) then
runs with the GPU idle: 12-70 ms per step on an H200 host for a 1B Llama, against a
100-140 ms step. Here the tokens are counted on the host, from the count the collator puts in each
batch; `run._training_arguments` turns the filter off (a NaN loss shows as NaN, not as the running
mean) and the copies asynchronous. The loss read at each log is the one wait left.

What is left of a step's host time outside the model is the Trainer's bookkeeping; four walks
over every module and parameter per step (counting parameters for the FLOP total, putting the
model in training mode, collecting parameters to clip, zeroing gradients) are done once instead.
For LoRA the host, not the GPU, sets the step time, so each millisecond of Python is a
millisecond per step.

accelerate's ``unwrap_model`` walks every module on each call; its answer is kept per model.

Under DDP (``torchrun``) the gradients are views into DDP's all-reduce buckets instead of a second
copy beside them.

With ``--cuda-graphs`` each micro-step (forward, loss, backward) is replayed from a CUDA graph per
batch shape (`tigon.cuda_graphs`). The graph replays kernels only: the metrics a step adds
(``_add``: token accuracy, the preference methods' rewards) are recorded at capture as the graph's
outputs and copied out after each replay, and the loss the step returns is copied before the next.
The gradient clipping and the optimizer's update are replayed too, one graph each
(`cuda_graphs.CapturedOptimizer`), so between two micro-steps the host launches three graphs and
the Trainer's bookkeeping: at 1 x 1024 tokens the optimizer's Python would otherwise leave the GPU
waiting after every loss read.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from accelerate.utils import DistributedType

from tigon.cuda_graphs import CapturedOptimizer, CapturedStep
from tigon.patch.apply import lent_methods, token_accuracy
from tigon.train.batching import NUM_TOKENS
from tigon.train.checkpoint import AtomicTrainer

log = logging.getLogger("tigon.train")


TOKEN_ACCURACY = "accuracy"  # the next-token accuracy of the training steps, where the patched loss gives it
# Under cuda_graphs, the keys of a micro-step's inputs holding the Trainer's item count and its
# accumulation steps (the model's batch never has them).
_NUM_ITEMS, _ACCUMULATION = " num_items_in_batch", " gradient_accumulation_steps"


def _unwrap_once(unwrap: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    """accelerate's ``unwrap_model``, asked once per model and arguments.

    Each call walks every module looking for compiled regions (1337 modules for LoRA on the
    16-layer 1B Llama, ~5-20 ms of host time), and the preference and GRPO trainers ask for
    the LM head and the reference's switch several times a step. What a model unwraps to does not
    change while it trains; compiling it or wrapping it again makes a new object, asked anew."""
    known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def unwrap_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        answers = known.setdefault(model, {})
        key = (args, tuple(sorted(kwargs.items())))
        if key not in answers:
            answers[key] = unwrap(model, *args, **kwargs)
        return answers[key]

    return unwrap_model


class TigonTrainer(AtomicTrainer):
    """`AtomicTrainer` whose training steps do not read the device. With one process it counts
    the tokens it trains on from the collator's host-side counts (set
    ``include_num_input_tokens_seen="no"``, or the Trainer counts them again on the device);
    with several, the Trainer's own count, which gathers every process's, is kept."""

    _flops_per_token: float | None = None
    _trainable: list | None = None
    _in_training_mode: Any = None  # the model whose every module the last full train() walk set
    _captured: CapturedStep | None = None  # cuda_graphs: the micro-steps replayed
    _captured_model: Any = None  # the model whose micro-steps _captured replays
    _recording: list | None = None  # what _add was given inside a micro-step under cuda_graphs
    _captured_clip: CapturedStep | None = None  # cuda_graphs: the gradient clipping replayed

    def __init__(self, *args, cuda_graphs: bool = False, token_accuracy: bool = False, **kwargs):
        """`cuda_graphs`: each micro-step is replayed from a CUDA graph (``--cuda-graphs``, see the
        module docstring).
        `token_accuracy`: log the training steps' next-token accuracy (``accuracy``) where the
        model's loss is tigon's patched one, which hands it over (:func:`tigon.patch.token_accuracy`)."""
        # Metrics summed on the device per mode, key -> [stack([total, count])], read once per log.
        self._sums: dict[str, dict[str, list[torch.Tensor]]] = {"train": {}, "eval": {}}
        super().__init__(*args, **kwargs)
        self.cuda_graphs = cuda_graphs
        self.token_accuracy = token_accuracy
        if cuda_graphs and self.args.fp16:
            log.warning("--cuda-graphs: the gradient clipping and the optimizer step cannot be captured as CUDA "
                        "graphs (fp16's loss scaler reads the GPU before the step); they run without them")

    def compute_loss(self, model, inputs, *args, **kwargs):
        labels = inputs.get("labels") if self.token_accuracy and model.training and isinstance(inputs, dict) else None
        if labels is None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        hits: list[tuple[torch.Tensor, torch.Tensor]] = []
        with token_accuracy(model, hits):
            out = super().compute_loss(model, inputs, *args, **kwargs)
        for hit, count in hits:
            self._add("train", TOKEN_ACCURACY, hit, count)
        return out

    def _add(self, mode: str, key: str, total: torch.Tensor, count: torch.Tensor | float) -> None:
        """Accumulate `total` over `count` items for the next log (no host sync: a count given
        as a number becomes a device tensor by a fill, not a copy)."""
        total = total.detach().float()
        if not isinstance(count, torch.Tensor):
            count = total.new_full((), float(count))
        pair = torch.stack([total, count.float()])
        if self._recording is not None:
            self._recording.append((mode, key, pair))
        else:
            self._sums[mode].setdefault(key, []).append(pair)

    def _averages(self, mode: str) -> dict[str, float]:
        """The accumulated metrics' means over their items (and over the processes)."""
        store = self._sums[mode]
        if not store:
            return {}
        keys = list(store)
        totals = torch.stack([torch.stack(store[k]).sum(0) for k in keys])
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, "sum")
        store.clear()
        return {k: s / c for k, (s, c) in zip(keys, totals.tolist()) if c > 0}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        values = self._averages(mode)
        if hasattr(self, "_metrics"):  # TRL's trainers log their metrics from there
            for key, value in values.items():
                self._metrics[mode][key] = [value]
        else:
            logs.update({(f"eval_{k}" if mode == "eval" else k): v for k, v in values.items()})
        super().log(logs, start_time)


    def training_step(self, model, inputs: dict[str, Any], *args, **kwargs):
        # TRL's GRPO steps take their generation batch, a list of rows, and count their own tokens.
        tokens = inputs.pop(NUM_TOKENS, 0) if isinstance(inputs, dict) else 0
        if self.args.include_num_input_tokens_seen == "no":
            self.state.num_input_tokens_seen += tokens
        if (self._in_training_mode is not model or model is not self.model or not model.training
                or "train" in vars(model)):
            # The root's flag alone says nothing of its modules (PEFT wraps an eval-mode model in
            # a root in training mode): walk them all once, as the Trainer does in every step.
            # A wrapper (DDP, DataParallel) is walked every step: evaluation switches the model
            # inside it, not the wrapper.
            self._in_training_mode = model
            return self._micro_step(model, inputs, *args, **kwargs)
        # The Trainer calls model.train() in every step, a walk over every module (1337 for LoRA
        # on a 16-layer Llama: ~4-8 ms of host time per step). Every module is in training mode
        # since the last walk: evaluation and sample generation, which leave it, switch this root.
        with lent_methods(model, train=lambda mode=True: model if mode else type(model).train(model, mode)):
            return self._micro_step(model, inputs, *args, **kwargs)

    def _micro_step(self, model, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's training step; under cuda_graphs replayed from a CUDA graph, what it
        added to the metrics copied out of the graph's outputs."""
        if not self.cuda_graphs:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._captured is None or self._captured_model is not model:
            self._captured_model = model
            self._captured = CapturedStep(lambda batch: self._recorded_step(model, batch),
                                          self._trainable_parameters(model), device=self.args.device)
        if isinstance(num_items_in_batch, (int, float)):  # a graph input, not a constant of the graph
            num_items_in_batch = torch.full((), num_items_in_batch, device=self.args.device)
        # The loss is divided by the accumulation steps the Trainer takes now, a number the
        # graph holds: a last, shorter accumulation of an epoch is a graph of its own.
        loss, recorded = self._captured({**inputs, _NUM_ITEMS: num_items_in_batch,
                                         _ACCUMULATION: self.current_gradient_accumulation_steps})
        for mode, key, pair in recorded:
            self._sums[mode].setdefault(key, []).append(pair.clone())
        return loss.clone()

    def _recorded_step(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, list]:
        """The Trainer's training step on `batch` (with the count of its items and the
        accumulation steps under their keys) and what it gave ``_add``."""
        batch = dict(batch)
        num_items_in_batch = batch.pop(_NUM_ITEMS)
        del batch[_ACCUMULATION]
        self._recording = []
        try:
            loss = super().training_step(model, batch, num_items_in_batch)
            return loss, self._recording
        finally:
            self._recording = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # The Trainer calls model.zero_grad() after every optimizer step, another walk over every
        # module and parameter (~1.5 ms on a 2-core host for LoRA on the 16-layer Llama); only the
        # trainable parameters have gradients. One process trains self.model itself (several
        # train it inside a wrapper, whose zero_grad walks as before).
        if self.accelerator.distributed_type != DistributedType.NO:
            return super().train(*args, **kwargs)
        with lent_methods(self.model, zero_grad=self._zero_trainable_grads):
            return super().train(*args, **kwargs)

    def _zero_trainable_grads(self, set_to_none: bool = True) -> None:
        """``model.zero_grad`` over the trainable parameters, the only ones autograd gives a
        gradient."""
        for param in self._trainable_parameters(self.model):
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                param.grad.detach_()
                param.grad.zero_()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # DDP all-reduces gradients through flat buckets of its own, by default a second copy of
        # every gradient (2.3 GiB for the 1.24B-parameter Llama in bf16) and a copy
        # into it per gradient per step. As views into the buckets the gradients exist once. The
        # peak (early in backward, gradients freed between steps) holds the buckets either way:
        # measured on two H200s, it did not move. The Trainer offers no argument for it.
        if self.accelerator.ddp_handler is not None:
            self.accelerator.ddp_handler.gradient_as_bucket_view = True
        self.accelerator.unwrap_model = _unwrap_once(self.accelerator.unwrap_model)

    def _captures_updates(self) -> bool:
        """Whether the clipping and the optimizer step replay from graphs: under cuda_graphs, on one
        CUDA device, without fp16's loss scaler (it reads the GPU before each step and hands the
        step arguments of its own)."""
        return (self.cuda_graphs and self.args.device.type == "cuda" and not self.args.fp16
                and self.accelerator.distributed_type == DistributedType.NO)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._captures_updates() and not isinstance(optimizer, CapturedOptimizer):
            self.optimizer = optimizer = CapturedOptimizer(optimizer, device=self.args.device)
        return optimizer

    def _clip_grad_norm(self, model):
        # The Trainer hands the clip model.parameters(), another walk over every module per step;
        # one process clips the same trainable parameters every step (the others have no gradient).
        # accelerate's clip then sorts them by DTensor mesh, a Python pass over every parameter
        # (~2 ms a step on a 2-core host for LoRA on the 16-layer Llama); one process has none.
        if self.accelerator.distributed_type != DistributedType.NO:
            return super()._clip_grad_norm(model)
        if self._captures_updates():
            if self._captured_clip is None:
                params = self._trainable_parameters(model)
                self._captured_clip = CapturedStep(
                    lambda inputs: torch.nn.utils.clip_grad_norm_(params, inputs["max_norm"]), params,
                    device=self.args.device, what="the gradient clipping")
            return self._captured_clip({"max_norm": self.args.max_grad_norm}).clone()
        self.accelerator.unscale_gradients()  # fp16's loss scaler, as accelerate's clip does first
        return torch.nn.utils.clip_grad_norm_(self._trainable_parameters(model), self.args.max_grad_norm)

    def _trainable_parameters(self, model) -> list:
        """The parameters that train, collected once (they are the same every step)."""
        if self._trainable is None:
            self._trainable = [p for p in model.parameters() if p.requires_grad]
        return self._trainable

    def prediction_step(self, model, inputs: dict[str, Any], *args, **kwargs):
        if isinstance(inputs, dict):
            inputs.pop(NUM_TOKENS, None)
        return super().prediction_step(model, inputs, *args, **kwargs)

    def floating_point_ops(self, inputs: dict[str, Any]) -> float:
        # The Trainer counts the model's parameters again for every batch (a walk over every
        # module and parameter, milliseconds per step for a PEFT model); the count is fixed.
        tokens = inputs["input_ids"].numel() if "input_ids" in inputs else 0
        if self._flops_per_token is None and tokens:
            self._flops_per_token = super().floating_point_ops(inputs) / tokens
        return (self._flops_per_token or 0.0) * tokens
