"""tigon.cuda_graphs: micro-steps captured as CUDA graphs take the same steps as plain ones."""

import copy
import logging

import pytest
import torch

from tigon.cuda_graphs import CapturedOptimizer, CapturedStep, _frozen, _shape_key


def test_shape_key_tells_shapes_dtypes_and_other_values_apart():
    ids = torch.zeros(2, 8, dtype=torch.long)
    key = _shape_key({"input_ids": ids, "steps": 2, "mask": None})
    assert key == _shape_key({"mask": None, "steps": 2, "input_ids": torch.ones(2, 8, dtype=torch.long)})
    assert key != _shape_key({"input_ids": torch.zeros(2, 9, dtype=torch.long), "steps": 2, "mask": None})
    assert key != _shape_key({"input_ids": ids.int(), "steps": 2, "mask": None})
    assert key != _shape_key({"input_ids": ids, "steps": 1, "mask": None})


def test_param_group_settings_key_a_graph_whatever_their_container():
    """A group's betas as a list (loaded from a config) key the optimizer's graph as a tuple does."""
    group = {"betas": [0.9, 0.95], "extra": {"b": [1], "a": 2}, "eps": 1e-8}
    key = _shape_key({"group0": tuple((k, _frozen(v)) for k, v in group.items())})
    assert hash(key) == hash(_shape_key({"group0": (("betas", (0.9, 0.95)), ("extra", (("a", 2), ("b", (1,)))),
                                                    ("eps", 1e-8))}))


def test_steps_off_a_cuda_gpu_run_plainly_and_say_so_once(caplog):
    weight = torch.nn.Parameter(torch.ones(3))
    calls = []

    def step(inputs):
        calls.append(inputs["x"])
        loss = (weight * inputs["x"]).sum()
        loss.backward()
        return loss.detach()

    with caplog.at_level(logging.WARNING, logger="tigon"):
        captured = CapturedStep(step, [weight], device="cpu")
        for _ in range(3):
            assert float(captured({"x": torch.full((3,), 2.0)})) == 6.0
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert said == ["--cuda-graphs: the training step cannot be captured as a CUDA graph (the model is on cpu, not "
                    "a CUDA GPU); it runs without one"]
    assert len(calls) == 3 and not captured.graphs
    torch.testing.assert_close(weight.grad, torch.full((3,), 6.0))  # accumulated as without graphs


def _llama(tuner: str, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig

    import tigon
    from tigon.train.tiny import random_model

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa")
    model = random_model(config, seed, device="cuda", dtype=torch.bfloat16)
    if tuner == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    tigon.patch(model)
    return model.train()


@pytest.mark.gpu
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_gpu_captured_micro_steps_train_like_plain_ones(tuner):
    """Two optimizer steps of two micro-batches each, then a batch of another shape: the replayed
    steps give the same losses and gradients as the same steps run plainly (the same kernels), with
    gradient accumulation and gradients dropped by zero_grad between optimizer steps."""
    models = [_llama(tuner), _llama(tuner)]

    def make_step(model):
        def step(inputs):
            loss = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"]).loss / 2
            loss.backward()
            return loss.detach()
        return step

    plain, model = make_step(models[0]), models[1]
    captured = CapturedStep(make_step(model), model.parameters())
    gen = torch.Generator("cuda").manual_seed(0)
    widths = [96, 96, 96, 96, 96, 96, 64, 64, 64, 96]
    for i, width in enumerate(widths):
        ids = torch.randint(0, 512, (2, width), device="cuda", generator=gen)
        want = plain({"input_ids": ids})
        got = captured({"input_ids": ids}).clone()
        torch.testing.assert_close(got, want)
        if i % 2:
            for reference, trained in zip(models[0].parameters(), model.parameters()):
                if reference.requires_grad:
                    torch.testing.assert_close(trained.grad, reference.grad)
                    reference.grad = None
            model.zero_grad(set_to_none=True)
    # 96 wide writing the gradients and adding into them, 64 wide writing them (its adding step
    # ran plainly, the first of its kind); each key ran plainly once before its capture
    assert captured.refused is None and len(captured.graphs) == 3


@pytest.mark.gpu
def test_gpu_a_step_that_waits_on_the_gpu_is_said_once_and_runs_plainly(caplog):
    model = _llama("lora")
    losses = []

    def step(inputs):
        loss = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"]).loss
        losses.append(loss.item())  # a host read: no capture can hold it
        loss.backward()
        return loss.detach()

    captured = CapturedStep(step, model.parameters())
    ids = torch.randint(0, 512, (2, 32), device="cuda")
    with caplog.at_level(logging.WARNING, logger="tigon"):
        results = [float(captured({"input_ids": ids})) for _ in range(4)]
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--cuda-graphs: the training step cannot be captured")
    assert captured.refused and not captured.graphs
    assert results == pytest.approx(losses) and len(losses) == 4  # the abandoned capture stopped at its read
    torch.ones(4, device="cuda").sum().item()  # the GPU is usable after the abandoned capture


SHAPES = [(37, 19), (64,), (5, 3, 7)]


def _adamw_pair(device, **kwargs):
    """Two AdamW optimizers over two copies of the same parameters, in two groups (weight decay
    on the first two, none on the third), each under the same warm-up then decay schedule."""
    gen = torch.Generator(device).manual_seed(0)
    start = [torch.randn(shape, device=device, generator=gen) for shape in SHAPES]
    pairs = []
    for _ in range(2):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.1},
                                       {"params": params[2:], "weight_decay": 0.0}], lr=1e-2, **kwargs)
        pairs.append((params, optimizer))
    return pairs


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4 if step < 4 else 0.7 ** (step - 3))


def _same_steps(plain, captured, plain_params, captured_params, steps, device, reload_at=None):
    """`steps` optimizer steps of both on the same random gradients under the same schedule: the
    parameters stay equal after each. At `reload_at` the captured one loads the plain one's state
    (a resume)."""
    schedules = [_schedule(plain), _schedule(captured)]
    gen = torch.Generator(device).manual_seed(1)
    for step in range(steps):
        grads = [torch.randn(shape, device=device, generator=gen) for shape in SHAPES]
        for params in (plain_params, captured_params):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
        plain.step()
        captured.step()
        for schedule in schedules:
            schedule.step()
        for got, want in zip(captured_params, plain_params, strict=True):
            torch.testing.assert_close(got, want)
        if step == reload_at:
            captured.load_state_dict(copy.deepcopy(plain.state_dict()))


def test_captured_optimizer_off_a_cuda_gpu_steps_plainly_and_says_so_once(caplog):
    """Off a GPU the wrapper steps the optimizer plainly (not made capturable), under a scheduler,
    with the optimizer's own state and checkpoints."""
    (plain_params, plain), (params, optimizer) = _adamw_pair("cpu")
    with caplog.at_level(logging.WARNING, logger="tigon"):
        captured = CapturedOptimizer(optimizer, device="cpu")
        _same_steps(plain, captured, plain_params, params, 6, "cpu", reload_at=2)
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert said == ["--cuda-graphs: the optimizer step cannot be captured as a CUDA graph (the model is on cpu, not "
                    "a CUDA GPU); it runs without one"]
    assert not any(group["capturable"] for group in captured.param_groups)
    assert captured.param_groups is optimizer.param_groups and captured.state is optimizer.state
    assert captured.state_dict()["state"].keys() == plain.state_dict()["state"].keys()
    assert "AdamW" in repr(captured)


def test_only_adam_and_adamw_are_captured(caplog):
    """Another optimizer's learning rate is a number a graph would keep: it steps plainly, said once."""
    params = [torch.nn.Parameter(torch.ones(3))]
    with caplog.at_level(logging.WARNING, logger="tigon"):
        captured = CapturedOptimizer(torch.optim.SGD(params, lr=0.5), device="cuda")
        for _ in range(2):
            params[0].grad = torch.ones(3)
            captured.step()
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert said == ["--cuda-graphs: the optimizer step cannot be captured as a CUDA graph (SGD takes its learning "
                    "rate as a number; Adam and AdamW are captured); it runs without one"]
    torch.testing.assert_close(params[0].detach(), torch.zeros(3))


def test_a_state_load_or_a_new_group_drops_the_optimizer_s_graphs():
    """Graphs hold the tensors of the state and groups they were captured with: a load (a
    resume) or a new group starts a fresh capture, on the same device, every group capturable and
    every step count on the parameters' device. (Nothing here touches a GPU before a step.)"""
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.AdamW([first], lr=0.1)
    first.grad = torch.ones(3)
    plain.step()  # a plain run's state: its step count on the host
    captured = CapturedOptimizer(torch.optim.AdamW([first], lr=0.1), device="cuda")
    before = captured._captured
    captured._captured.seen.add("a shape")
    captured.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert captured._captured is not before and not captured._captured.seen
    assert captured._captured.device == before.device == captured.device
    assert captured.state[first]["step"].dtype == torch.float32 and captured.state[first]["step"].device == first.device
    captured.add_param_group({"params": [second]})
    assert captured._captured.params == [first, second] and all(g["capturable"] for g in captured.param_groups)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_gpu_captured_optimizer_steps_like_the_plain_one(kind):
    """AdamW's update replayed from a graph takes the plain optimizer's steps: the scheduler's
    learning rate reaches every replay, two groups keep their weight decay, a reload of the state
    (a resume) captures again."""
    (plain_params, plain), (params, optimizer) = _adamw_pair("cuda", **{kind: True})
    captured = CapturedOptimizer(optimizer)
    _same_steps(plain, captured, plain_params, params, 5, "cuda")
    assert captured._captured.refused is None and len(captured._captured.graphs) == 1
    (plain_params, plain), (params, optimizer) = _adamw_pair("cuda", **{kind: True})
    captured = CapturedOptimizer(optimizer)
    _same_steps(plain, captured, plain_params, params, 8, "cuda", reload_at=3)
    assert captured._captured.refused is None and len(captured._captured.graphs) == 1
    assert all(state["step"].is_cuda for state in captured.state.values())
