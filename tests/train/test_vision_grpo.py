"""`tigon rlhf --method grpo` with images: TRL's GRPOTrainer samples from the built-in tiny Qwen2-VL
with each prompt's image, and tigon's fused policy loss gets the same pixels in its forward."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.fused_helpers import one_thread_and_references
from tigon.cli import main
from tigon.train import grpo, tiny_vlm
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.vision import VisionEncoder
from tigon.train.vision_grpo import colour_samples, names_answer

trl = pytest.importorskip("trl")

VARIED = '''
def varied(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]
'''


def test_names_answer_scores_the_colour_as_a_word():
    completions = [[{"role": "assistant", "content": c}] for c in ("It is Red.", "redish", "blue", "", "red")]
    assert names_answer([None] * 5, completions, ["red", "red", "red", "red", None]) == [1.0, 0.0, 0.0, 0.0, None]
    listed = [[{"role": "assistant", "content": c}] for c in ("red", "red blue", "Blue", "red")]
    choices = [["red", "blue"], ["red", "blue"], ["blue", "red"], None]
    assert names_answer([None] * 4, listed, ["red", "red", "blue", "red"], choices) == [1.0, 0.0, 1.0, 1.0]


def test_grpo_trains_the_tiny_vlm_with_its_images_in_the_loss_forward(tmp_path, monkeypatch):
    seen = []
    hidden = grpo.TigonGRPOTrainer._hidden

    def recording(self, model, input_ids, attention_mask, **kwargs):
        seen.append({k: tuple(v.shape) for k, v in kwargs.items()})
        return hidden(self, model, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(grpo.TigonGRPOTrainer, "_hidden", recording)
    (tmp_path / "r.py").write_text(VARIED)
    out = tmp_path / "run"
    assert main(["rlhf", "--modality", "vision", "--method", "grpo", "--output-dir", str(out), "--max-steps", "2",
                 "--batch-size", "8", "--num-generations", "4", "--max-completion-length", "4", "--samples", "1",
                 "--reward-funcs", f"{tmp_path / 'r.py'}:varied"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward"] == pytest.approx(0.5) and r["loss"] == r["loss"] for r in steps)
    # Every loss forward had its 8 completions' images: 4 merged tokens of 2 x 2 patches each.
    assert len(seen) == 2 and all(s["image_grid_thw"] == (8, 3) and s["pixel_values"][0] == 8 * 16 for s in seen)
    assert (out / "final" / "config.json").is_file()


def test_grpo_trains_a_saved_vlm_given_as_model(tmp_path):
    processor = tiny_vlm.build_processor()
    tiny_vlm.build_model(processor, seed=1).save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    out = tmp_path / "run"
    assert main(["rlhf", "--model", str(tmp_path / "m"), "--method", "grpo", "--output-dir", str(out), "--max-steps",
                 "1", "--batch-size", "4", "--num-generations", "4", "--max-completion-length", "3", "--samples", "0",
                 "--tuner", "lora"]) == 0
    assert (out / "final" / "adapter_config.json").is_file()


def test_grpo_default_rewards_the_right_colour(tmp_path):
    out = tmp_path / "run"
    assert main(["rlhf", "--modality", "vision", "--method", "grpo", "--output-dir", str(out), "--max-steps", "1",
                 "--batch-size", "4", "--num-generations", "4", "--max-completion-length", "3", "--samples", "0"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/names_answer/mean" in steps[0]


def test_grpo_reads_prompt_files_with_images_in_each_layout(tmp_path, monkeypatch):
    """A prompt with an <image> placeholder, one with an image part, one with neither (its image
    shown before its text): each rollout's loss forward gets the four images."""
    from PIL import Image

    Image.new("RGB", (56, 56), (220, 40, 40)).save(tmp_path / "r.png")
    Image.new("RGB", (56, 56), (50, 80, 220)).save(tmp_path / "b.png")
    rows = [{"prompt": "<image>What colour?", "images": ["r.png"], "answer": "red"},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "b.png"},
                                                     {"type": "text", "text": "Colour?"}]}], "answer": "blue"},
            {"prompt": "Which colour?", "images": ["b.png"], "answer": "blue"},
            {"prompt": "<image>Which?", "images": ["r.png"], "answer": "red"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    hidden = grpo.TigonGRPOTrainer._hidden
    monkeypatch.setattr(grpo.TigonGRPOTrainer, "_hidden", lambda self, model, ids, mask, **kw: (
        seen.append(kw["image_grid_thw"].shape), hidden(self, model, ids, mask, **kw))[1])
    out = tmp_path / "run"
    assert main(["rlhf", "--modality", "vision", "--method", "grpo", "--dataset", str(tmp_path / "d.jsonl"),
                 "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4", "--num-generations", "4",
                 "--max-completion-length", "3", "--samples", "0"]) == 0
    assert seen == [(4, 3), (4, 3)]


@pytest.mark.parametrize("rows, argv, message", [
    ([{"prompt": "<image>q", "images": ["nope.png"], "answer": "a"}], [],
     "{tmp}/d.jsonl line 1: image 1 (nope.png): no such file ({tmp}/nope.png)"),
    ([{"prompt": "<image>q<image>", "images": ["a.png"], "answer": "a"}], [],
     "{tmp}/d.jsonl line 1: has 2 <image> placeholders (or image parts) but 1 image"),
    ([{"prompt": "<image>q", "images": ["a.png"]}], [], "{tmp}/d.jsonl: no answer column for the default reward"),
    ([{"prompt": "<image>q", "images": ["a.png"], "answer": "a"}], ["--eval-split", "0.5"],
     "--eval-dataset / --eval-split: tigon rlhf --method grpo does not evaluate on images yet"),
    ([{"prompt": "<image>q", "images": ["a.png"], "answer": "a"}], ["--beta", "0.1", "--tuner", "full"],
     "--beta 0.1: a full fine-tune of a vision-language model has no reference"),
])
def test_grpo_with_images_refuses_bad_input_in_one_line(tmp_path, capsys, rows, argv, message):
    from PIL import Image

    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["rlhf", "--modality", "vision", "--method", "grpo", "--dataset", str(tmp_path / "d.jsonl"),
                 "--output-dir", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tigon rlhf: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def image_rollout(trainer, processor, completion_len=5):
    """A generation batch of 4 image prompts as TRL's `_generate_and_score_completions` hands it to
    the loss: the processor's prompt ids, pixels, grids and token types (zeros over the
    completions), completions cut at different lengths, advantages and old log-probs."""
    encoder = VisionEncoder(processor)
    samples = colour_samples(4, 0)
    texts = [encoder.render(s.messages[:1], True) for s in samples]
    batch = processor(text=texts, images=[encoder.images(s.images) for s in samples], padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(3)
    completion_ids = torch.randint(3, 40, (4, completion_len), generator=g)
    completion_mask = (torch.arange(completion_len) < torch.tensor([completion_len, 3, 1, 4])[:, None]).long()
    inputs = {"prompt_ids": batch["input_ids"], "prompt_mask": batch["attention_mask"], "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.randn(4, generator=g),
              "num_items_in_batch": completion_mask.sum().float(), "pixel_values": batch["pixel_values"],
              "image_grid_thw": batch["image_grid_thw"]}
    if "mm_token_type_ids" in batch:
        inputs["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion_ids)], 1)
    inputs = {k: v.to(trainer.model.device) for k, v in inputs.items()} | {"num_images": [1] * 4}
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    media = {k: inputs[k] for k in grpo.MEDIA if k in inputs}
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.cat([inputs["prompt_ids"], completion_ids], 1),
                               attention_mask=torch.cat([inputs["prompt_mask"], completion_mask], 1), **media).logits
    logps = torch.log_softmax(logits[:, -completion_len - 1:-1] / trainer.temperature, -1)
    logps = logps.gather(-1, completion_ids[..., None])[..., 0]
    inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g).to(logps.device)
    return inputs


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_fused_loss_on_images_equals_trls_compute_loss(tmp_path, loss_type):
    """One image rollout, two losses: TRL 1.16's `GRPOTrainer._compute_loss` (its forward with the
    pixels) and tigon's fused one; the loss and every gradient, the vision tower's included."""
    with one_thread_and_references("linear_policy_loss,linear_log_probs"):
        compare_image_loss(tmp_path, loss_type, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_gpu_fused_kernels_on_images_equal_trls_compute_loss(tmp_path, loss_type):
    """The same on the GPU with `linear_policy_loss`'s Triton kernels (fp32; TF32-level tolerance)."""
    compare_image_loss(tmp_path, loss_type, 2e-3)


def compare_image_loss(tmp_path, loss_type, rtol):
    from datasets import Dataset

    processor = tiny_vlm.build_processor()
    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path), method="grpo", modality="vision", loss_type=loss_type,
                                  batch_size=4, num_generations=4, max_completion_length=5, samples=0, tuner="full",
                                  kernels=False, epsilon=0.1, epsilon_high=0.15, grad_accum=2))
    rows = [{"prompt": [{"role": "user", "content": "q"}], "images": [None], "answer": "red"}] * 4
    trainer = grpo.TigonGRPOTrainer(
        model=tiny_vlm.build_model(processor, 0), reward_funcs=[names_answer],
        args=grpo.trl_arguments(cfg, torch.float32, False), train_dataset=Dataset.from_list(rows),
        processing_class=processor)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = image_rollout(trainer, processor)

    def loss_and_grads(compute):
        trainer.model.zero_grad()
        loss = compute(trainer, trainer.model, inputs)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    theirs, their_grads = loss_and_grads(trl.GRPOTrainer._compute_loss)
    ours, our_grads = loss_and_grads(grpo.TigonGRPOTrainer._compute_loss)
    assert ours.item() == pytest.approx(theirs.item(), rel=rtol / 10, abs=1e-7)
    assert any("visual" in name and grad.abs().sum() > 0 for name, grad in their_grads.items())
    assert our_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=rtol, atol=1e-6, msg=name)
