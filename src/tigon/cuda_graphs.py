"""Training micro-steps captured as CUDA graphs and replayed (``--cuda-graphs``).

At a small batch (1 × 1024 tokens of a 1B Llama) the host's Python, not the GPU, sets the step
time: hundreds of kernel launches per layer, each a few microseconds of Python and driver work,
while each kernel runs for less. A CUDA graph holds a whole micro-step (forward, loss and
backward, gradient accumulation included) and one call launches all of it again, so the host is
free after microseconds and the GPU runs the kernels back to back.

torch.compile's CUDA-graph mode (``mode="reduce-overhead"``) reaches replays too, but around each
one it checks, in Python, the liveness of every output of the graphs before it (milliseconds per
step for a 16-layer model, with the GPU waiting), and it leaves out the fusions across modules
(tigon's hand-offs are off under torch.compile). Capturing the eager patched step keeps every
fusion and leaves one launch; BENCHMARKS.md has the two side by side.

What a graph fixes and how this module keeps it true:

* **Input memory.** Each input tensor is copied into a buffer of the graph's own before a replay.
  An input of another shape, dtype or device, or another non-tensor value, is another graph: the
  first call of each runs plainly (kernels compile and autotune there, which a capture cannot),
  the second captures and replays it.
* **Gradients.** Autograd writes a gradient where a parameter has none and adds into the one it
  has, and a graph replays whichever it did at capture, into the same memory. So whether the
  parameters have gradients is part of what picks a graph: the first micro-step after an
  optimizer's ``zero_grad`` (set to None) replays the graph that writes them, with no zeroing and
  no add; later micro-steps of a gradient accumulation replay the one that adds into them. After
  a replay the parameters' ``.grad`` are the graph's tensors; a gradient that is not where a
  graph adds is copied there first. A gradient a replay wrote lives in graph memory: the next
  micro-step that starts without gradients overwrites it (the optimizer has used it by then).
* **Outputs.** What the step returns lives in the graph's memory and the next replay overwrites
  it: read or copy it before the next call.
* **Side effects.** A replay runs kernels only. Python the step runs (appending to a list, a
  counter) ran once, at capture: a step hands back every tensor it wants kept in its outputs.

A step that cannot be captured (it waits on the GPU inside, as ``.item()`` does; it runs CPU
work; an op refuses capture) is said once, in one line naming the reason, and every later call
runs plainly, with the same results.

The optimizer's update is a graph of its own (`CapturedOptimizer`): Adam and AdamW, made
``capturable`` (their step count lives on the GPU), replay their update with one launch. A replay
reads the learning rate from a device tensor filled before it, so a scheduler's changes reach it;
the param groups' other settings pick the graph, as input shapes do for micro-steps.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Iterable, Mapping

import torch

log = logging.getLogger("tigon")


def _end_abandoned_capture(device: torch.device) -> None:
    """Leave the CUDA random generators as a finished capture leaves them. An abandoned capture
    never ends them: every later random op on the device would raise ("Offset increment outside
    graph capture encountered unexpectedly"). A capture that ends does."""
    with torch.cuda.device(device):
        placeholder = torch.zeros((), device=device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            placeholder.add_(1)


class _Graph:
    """One captured micro-step: its graph, its input buffers, its outputs, and the parameters'
    gradients before it (None: the step writes them; a tensor: the step adds into that one) and
    after it."""

    def __init__(self, graph: torch.cuda.CUDAGraph, buffers: dict[str, torch.Tensor], outputs: Any,
                 grads_in: list[torch.Tensor | None], grads_out: list[torch.Tensor | None]):
        self.graph, self.buffers, self.outputs = graph, buffers, outputs
        self.grads_in, self.grads_out = grads_in, grads_out


def _shape_key(inputs: Mapping[str, Any]) -> Hashable:
    """What must match for a graph to replay `inputs`: each tensor's shape, dtype and device, and
    every other value itself."""
    return tuple(
        (name, tuple(v.shape), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor) else (name, v)
        for name, v in sorted(inputs.items())
    )


class CapturedStep:
    """`step` (forward, loss and backward of one micro-batch, given as a dict of inputs) replayed
    from a CUDA graph per input shape (see the module docstring).

    `params` are the parameters that train (see the module docstring for their gradients). Calls
    return `step`'s outputs, valid until the next call."""

    def __init__(self, step: Callable[[dict[str, Any]], Any], params: Iterable[torch.nn.Parameter],
                 *, device: torch.device | None = None, what: str = "the training step"):
        """`what` names the step in the line that says it is not captured."""
        self.step, self.what = step, what
        self.params = [p for p in params if p.requires_grad]
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.graphs: dict[Hashable, _Graph] = {}
        self.seen: set[Hashable] = set()
        self.refused: str | None = None  # why steps are not captured, once said
        self.pool = None  # one memory pool for all shapes: they never run at once
        if self.device.type != "cuda":
            self._refuse(f"the model is on {self.device.type}, not a CUDA GPU")

    def __call__(self, inputs: Mapping[str, Any]) -> Any:
        if self.refused is not None:
            return self.step(dict(inputs))
        grads = [p.grad for p in self.params]
        key = (_shape_key(inputs), tuple(g is None for g in grads))
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:  # its kernels compile and autotune here, outside any capture
                self.seen.add(key)
                return self.step(dict(inputs))
            graph = self._capture(key, inputs)
            if graph is None:
                return self.step(dict(inputs))
        for param, grad, into in zip(self.params, grads, graph.grads_in):
            if into is not None and grad is not into:  # the sum so far, moved to where the graph adds
                into.copy_(grad)
                param.grad = into
        for name, buffer in graph.buffers.items():
            buffer.copy_(inputs[name], non_blocking=True)
        graph.graph.replay()
        for param, out in zip(self.params, graph.grads_out):
            if param.grad is not out:
                param.grad = out
        return graph.outputs

    def _capture(self, key: Hashable, inputs: Mapping[str, Any]) -> _Graph | None:
        """Capture `step` over buffers shaped like `inputs`' tensors (nothing runs: the caller
        replays it), or None, the reason said once, where it cannot be captured."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        buffers = {name: torch.empty_like(v, device=self.device) for name, v in inputs.items()
                   if isinstance(v, torch.Tensor)}
        graph = torch.cuda.CUDAGraph()
        grads_in = [p.grad for p in self.params]
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.step({**inputs, **buffers})
        except Exception as err:
            # The capture is abandoned (nothing of it ran); the steps run plainly. The error that
            # ended the capture is the first in the chain: ending an invalidated capture raises again.
            while isinstance(err.__context__, Exception):
                err = err.__context__
            _end_abandoned_capture(self.device)
            self._refuse(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            return None
        self.graphs[key] = _Graph(graph, buffers, outputs, grads_in, [p.grad for p in self.params])
        return self.graphs[key]

    def _refuse(self, reason: str) -> None:
        """Say once why the steps are not captured; they run plainly from now on."""
        self.refused = reason
        log.warning("--cuda-graphs: %s cannot be captured as a CUDA graph (%s); it runs without one",
                    self.what, reason)


def _frozen(value: Any) -> Hashable:
    """`value` as a graph key: lists and dicts (a param group's betas loaded from a config) as tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _capture_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer`'s step cannot be replayed from a graph with the same results, or None."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # Their learning rate would be a constant of the graph, blind to the scheduler.
        return f"{type(optimizer).__name__} takes its learning rate as a number; Adam and AdamW are captured"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "the optimizer is differentiable"
    return None


class CapturedOptimizer(torch.optim.Optimizer):
    """`optimizer` (Adam or AdamW) whose ``step()`` replays its update from a CUDA graph (see the
    module docstring); any other optimizer, a step given a closure and a model off a CUDA GPU
    step plainly, the first said once. State, param groups and checkpoints are `optimizer`'s own.

    The wrapper stands where the optimizer stood (the Trainer's ``optimizer``, a scheduler's), as
    accelerate's optimizer wrapper does: it delegates rather than constructs."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, device: torch.device | None = None):
        self.optimizer = optimizer
        self._captured = self._new_capture(device)
        self.device = self._captured.device
        refusal = _capture_refusal(optimizer)
        if refusal is not None and self._captured.refused is None:
            self._captured._refuse(refusal)
        self._make_capturable()

    def _new_capture(self, device: torch.device | None) -> CapturedStep:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return CapturedStep(self._update, params, device=device, what="the optimizer step")

    def _make_capturable(self) -> None:
        """Keep the step counts on the GPU, where a replay advances them (a plain run's checkpoint
        has them on the host)."""
        if self._captured.refused is not None:
            return
        for group in self.optimizer.param_groups:
            group["capturable"] = True
        for param, state in self.optimizer.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != param.device:
                state["step"] = step.to(device=param.device, dtype=torch.float32)

    def _capture_anew(self) -> None:
        """Drop the graphs, which hold the tensors of the state and groups before a change; a
        refused capture stays refused."""
        if self._captured.refused is None:
            self._captured = self._new_capture(self.device)
            self._make_capturable()

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet: unpickling, a half-made object
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"CapturedOptimizer({self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`optimizer`'s load; the graphs, which hold the old state's tensors, are dropped."""
        self.optimizer.load_state_dict(state_dict)
        self._capture_anew()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._capture_anew()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None or self._captured.refused is not None:  # a closure runs the model again
            return self.optimizer.step(closure)
        inputs: dict[str, Any] = {}
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            inputs[f"lr{i}"] = lr if isinstance(lr, torch.Tensor) else torch.full((), lr, device=self.device)
            inputs[f"group{i}"] = tuple((k, _frozen(v)) for k, v in group.items() if k not in ("params", "lr"))
        self._captured(inputs)
        return None

    def _update(self, inputs: dict[str, Any]) -> None:
        """The wrapped optimizer's step, its groups' learning rates read from `inputs`' tensors."""
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for i, group in enumerate(groups):
            group["lr"] = inputs[f"lr{i}"]
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, rates):
                group["lr"] = lr
