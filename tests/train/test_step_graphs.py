"""tigon.train.step_graphs: micro-steps captured as CUDA graphs take the same steps as plain ones."""

import logging

import pytest
import torch

from tigon.train.step_graphs import CapturedStep, _shape_key


def test_shape_key_tells_shapes_dtypes_and_other_values_apart():
    ids = torch.zeros(2, 8, dtype=torch.long)
    key = _shape_key({"input_ids": ids, "steps": 2, "mask": None})
    assert key == _shape_key({"mask": None, "steps": 2, "input_ids": torch.ones(2, 8, dtype=torch.long)})
    assert key != _shape_key({"input_ids": torch.zeros(2, 9, dtype=torch.long), "steps": 2, "mask": None})
    assert key != _shape_key({"input_ids": ids.int(), "steps": 2, "mask": None})
    assert key != _shape_key({"input_ids": ids, "steps": 1, "mask": None})


def test_steps_off_a_cuda_gpu_run_plainly_and_say_so_once(caplog):
    weight = torch.nn.Parameter(torch.ones(3))
    calls = []

    def step(inputs):
        calls.append(inputs["x"])
        loss = (weight * inputs["x"]).sum()
        loss.backward()
        return loss.detach()

    with caplog.at_level(logging.WARNING, logger="tigon.train"):
        captured = CapturedStep(step, [weight], device="cpu")
        for _ in range(3):
            assert float(captured({"x": torch.full((3,), 2.0)})) == 6.0
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert said == ["--cuda-graphs: the training step cannot be captured as a CUDA graph (the model is on cpu, not "
                    "a CUDA GPU); training without graphs"]
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
    with caplog.at_level(logging.WARNING, logger="tigon.train"):
        results = [float(captured({"input_ids": ids})) for _ in range(4)]
    said = [r.getMessage() for r in caplog.records if "--cuda-graphs" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--cuda-graphs: the training step cannot be captured")
    assert captured.refused and not captured.graphs
    assert results == pytest.approx(losses) and len(losses) == 4  # the abandoned capture stopped at its read
    torch.ones(4, device="cuda").sum().item()  # the GPU is usable after the abandoned capture
