"""tigon.patch under sharded training: two CPU processes on gloo against one unsharded process.

Each rank trains on its own batch; the single-process oracle (plain Hugging Face, unpatched) runs
both batches and averages the gradients, which is what data-parallel training must reproduce.
The same tests run on two GPUs with NCCL (marked gpu) where a machine has them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn

WORLD = 2
STEPS = 2
LR = 0.5

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs"),
    ]),
]


def _batch(step: int, rank: int, device: str):
    from tests.patch.tiny import batch

    ids, mask, labels = batch(seed=100 * step + rank, rows=2, cols=11 + rank, pad_tail=2)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def _model(tuner: str, seed: int, device: str, tied: bool = False) -> torch.nn.Module:
    from tests.patch.test_training import lora_model
    from tests.patch.tiny import tiny_model

    if tuner == "lora":
        assert not tied, "lora_model builds an untied head"
        return lora_model("llama", seed, device=device)
    return tiny_model("llama", seed, device=device, tie_word_embeddings=tied)


def _shard(model: torch.nn.Module, base: torch.nn.Module, layout: str) -> None:
    """fully_shard each decoder layer, then the root; with layout "accelerate", as accelerate 1.15
    prepares a model for FSDP2, also the final norm and the lm_head (and the tied embeddings) as
    one group that stays unsharded from forward to backward; with layout "head", the lm_head
    alone as a group that reshards after its forward (the loss then reads a sharded weight)."""
    from torch.distributed.fsdp import fully_shard

    for layer in base.model.layers:
        fully_shard(layer)
    if layout == "accelerate":
        embed, head = base.get_input_embeddings(), base.get_output_embeddings()
        tail = [base.model.norm, embed, head] if embed.weight is head.weight else [base.model.norm, head]
        fully_shard(tail, reshard_after_forward=False)
    if layout == "head":
        fully_shard(base.get_output_embeddings(), reshard_after_forward=True)
    fully_shard(model)  # the root: what no group above holds


def _oracle(model: torch.nn.Module, steps: int, device: str):
    """Per step: every rank's loss, and the rank-averaged gradients; then an SGD step on those."""
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=LR)
    model.train()
    history = []
    for step in range(steps):
        losses, grads = [], {}
        for rank in range(WORLD):
            model.zero_grad(set_to_none=True)
            loss = model(**_batch(step, rank, device)).loss
            loss.backward()
            losses.append(loss.detach())
            for name, param in model.named_parameters():
                if param.requires_grad:
                    grads[name] = grads.get(name, 0) + param.grad / WORLD
        history.append((losses, grads))
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.grad = grads[name]
        optimizer.step()
    return history


def _spawn(worker, tmp_path, device: str, *args) -> None:
    spawn(worker, args=(str(tmp_path / "store"), device, *args), nprocs=WORLD)


def _setup(rank: int, store: str, device: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _fsdp2_worker(rank: int, store: str, device: str, tuner: str) -> None:
    import tigon

    _setup(rank, store, device)
    try:
        # Every layout in one pair of processes: their start-up (imports) is most of a case's time.
        for layout in LAYOUTS:
            try:
                _fsdp2_case(rank, device, tuner, layout)
            except Exception as error:
                raise AssertionError(f"layout {layout!r}: {error}") from error
            finally:
                tigon.unpatch()  # the next case's oracle runs unpatched (RoPE's replacement is module-wide)
    finally:
        dist.destroy_process_group()


def _fsdp2_case(rank: int, device: str, tuner: str, layout: str) -> None:
    import tigon
    from tests.helpers import assert_close
    from tigon import functional

    tied = layout == "accelerate" and tuner == "full"
    # The oracle runs before tigon.patch: the RoPE replacement is module-wide.
    want = _oracle(_model(tuner, 3, device, tied), STEPS, device)
    model = _model(tuner, 3, device, tied)
    result = tigon.patch(model)
    kernels = {"linear_cross_entropy", "add_rms_norm", "rms_norm", "swiglu", "lora" if tuner == "lora" else "rope"}
    assert kernels <= set(result.applied), result.applied
    base = model.get_base_model() if tuner == "lora" else model
    _shard(model, base, layout)
    # The fused MLP reads its projections' weights without calling them: count that it ran (a
    # plain one in one op with the add + RMSNorm before it).
    mlp_name = "lora_gated_mlp" if tuner == "lora" else "add_rms_norm_glu_mlp"
    fused_mlp, mlp_calls = getattr(functional, mlp_name), []
    setattr(functional, mlp_name, lambda *a, **k: mlp_calls.append(1) or fused_mlp(*a, **k))
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=LR)
    model.train()
    for step, (want_losses, want_grads) in enumerate(want):
        optimizer.zero_grad(set_to_none=True)
        out = model(**_batch(step, rank, device))
        assert out.logits is None, "the fused loss did not run"
        assert len(mlp_calls) == len(base.model.layers) * (step + 1), f"{mlp_name} ran {len(mlp_calls)} times"
        out.loss.backward()
        grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert grad is not None, f"no gradient for {name}"
            assert_close(grad.full_tensor(), want_grads[name], name=f"step {step} grad {name}")
        optimizer.step()
    if layout == "accelerate":
        # A hook of the user's own on the sharded head: the loss goes through the module again.
        handle = base.get_output_embeddings().register_forward_hook(lambda module, args, output: None)
        with torch.no_grad():
            assert model(**_batch(0, rank, device)).logits is not None, "a head with a user hook was read directly"
        handle.remove()
    setattr(functional, mlp_name, fused_mlp)


def _dtensor_head_worker(rank: int, store: str, device: str) -> None:
    import tigon
    from tests.helpers import assert_close
    from tests.patch.tiny import tiny_model
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    _setup(rank, store, device)
    try:
        ((want_losses, want_grads),) = _oracle(tiny_model("llama", 4, device), 1, device)
        own = tiny_model("llama", 4, device)  # this rank's batch alone: the unsharded parameters' gradients
        own(**_batch(0, rank, device)).loss.backward()
        model = tiny_model("llama", 4, device)
        tigon.patch(model)
        mesh = init_device_mesh(device, (WORLD,))
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
        model.train()
        out = model(**_batch(0, rank, device))
        assert out.logits is None, "the fused loss did not run"
        out.loss.backward()
        assert_close(out.loss.detach(), want_losses[rank], name="loss")
        grad = model.lm_head.weight.grad
        assert grad.placements == (Shard(0),), grad.placements
        assert_close(grad.full_tensor(), want_grads["lm_head.weight"], name="grad lm_head.weight")
        own_grads = dict(own.named_parameters())
        for name, param in model.named_parameters():
            if name != "lm_head.weight":
                assert_close(param.grad, own_grads[name].grad, name=f"grad {name}")
    finally:
        dist.destroy_process_group()


LAYOUTS = ("layers", "accelerate", "head")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_fsdp2_matches_single_process(tmp_path, tuner, device):
    """fully_shard per decoder layer and at the root ("layers"), with the head's group that
    accelerate makes ("accelerate": full fine-tuning with tied embeddings, LoRA untied), or with
    the head in a group of its own that reshards after forward ("head"), the kernels patched on
    every rank: two SGD steps with the fused loss (no logits), and the same
    losses, gathered gradients and updates as one unsharded process."""
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2").fully_shard
    if tuner == "lora":
        pytest.importorskip("peft")
    _spawn(_fsdp2_worker, tmp_path, device, tuner)


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_dtensor_head_weight(tmp_path, device):
    """An lm_head weight still sharded when the fused loss reads it (no FSDP hook unsharded it):
    gathered for the loss, its gradient averaged over the ranks onto the local shards."""
    pytest.importorskip("torch.distributed.tensor", reason="needs DTensor")
    _spawn(_dtensor_head_worker, tmp_path, device)


def _zero3_losses(patched: bool, device: str, tied: bool) -> list[torch.Tensor]:
    """This rank's loss at each step of ZeRO-3 training (SGD), every parameter partitioned."""
    import deepspeed

    import tigon
    from tests.patch.tiny import tiny_model
    from tigon import functional

    model = tiny_model("llama", 5, device=device, tie_word_embeddings=tied)
    if patched:
        tigon.patch(model)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        # Threshold 0: no parameter persists whole, the head too is partitioned between uses.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    trained = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trained, lr=LR), config=config)
    assert hasattr(model.lm_head.weight, "ds_id"), "ZeRO-3 did not partition the head"
    fused_loss, loss_calls = functional.linear_cross_entropy, []
    functional.linear_cross_entropy = lambda *a, **k: loss_calls.append(1) or fused_loss(*a, **k)
    losses = []
    try:
        for step in range(STEPS):
            out = engine(**_batch(step, dist.get_rank(), device))
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.detach())
    finally:
        functional.linear_cross_entropy = fused_loss
    assert (out.logits is None, len(loss_calls)) == ((True, STEPS) if patched else (False, 0))
    assert all(param.numel() == 0 for param in model.lm_head.parameters()), "the head was left gathered"
    return losses


def _zero3_worker(rank: int, store: str, device: str) -> None:
    import importlib
    import os

    import tigon
    from tests.helpers import assert_close

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))  # as a launcher sets them
    # DeepSpeed's CPU accelerator compiles a shared-memory all-reduce with ninja at first use
    # (minutes on a fresh CI machine); gloo carries the collectives, which is what is tested.
    # (The package's attribute `torch` is torch itself, so the module is looked up by name.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    _setup(rank, store, device)
    try:
        for tied in (False, True):  # in one pair of processes: DeepSpeed's start-up is most of the time
            want = _zero3_losses(False, device, tied)
            got = _zero3_losses(True, device, tied)
            tigon.unpatch()
            for step, (loss, want_loss) in enumerate(zip(got, want)):
                # Each step's loss follows from the previous steps' reduced gradients and updates.
                assert_close(loss, want_loss, name=f"{'tied' if tied else 'untied'} head, step {step} loss")
    finally:
        dist.destroy_process_group()


def test_deepspeed_zero3_fused_loss_matches_unpatched(tmp_path, monkeypatch):
    """ZeRO-3 partitions the lm_head (tied to the embeddings or not): the fused loss gathers it for the loss only (read-only) and
    hands its gradient to DeepSpeed's reduce-scatter. Losses over the steps equal those of the
    unpatched model under the same ZeRO-3 engine, so the gradients reduced and applied were the
    same (ZeRO-3's own numbers differ from one unsharded process's by ~5e-4 here, patched or not)."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    _spawn(_zero3_worker, tmp_path, "cpu")
