"""`tigon rlhf --method grpo` with images: TRL's GRPOTrainer samples from the built-in tiny Qwen2-VL
with each prompt's image, and tigon's fused policy loss gets the same pixels in its forward."""

from __future__ import annotations

import json

import pytest

from tigon.cli import main
from tigon.train import grpo
from tigon.train.vision_grpo import names_answer

pytest.importorskip("trl")

VARIED = '''
def varied(prompts, completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]
'''


def test_names_answer_scores_the_colour_as_a_word():
    completions = [[{"role": "assistant", "content": c}] for c in ("It is Red.", "redish", "blue", "")]
    assert names_answer([None] * 4, completions, ["red", "red", "red", "red"]) == [1.0, 0.0, 0.0, 0.0]


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


def test_grpo_default_rewards_the_right_colour(tmp_path):
    out = tmp_path / "run"
    assert main(["rlhf", "--modality", "vision", "--method", "grpo", "--output-dir", str(out), "--max-steps", "1",
                 "--batch-size", "4", "--num-generations", "4", "--max-completion-length", "3", "--samples", "0"]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/names_answer/mean" in steps[0]


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "d.jsonl"], "--dataset: tigon rlhf --method grpo reads no prompt files with images yet"),
    (["--beta", "0.1", "--tuner", "full"], "--beta 0.1: a full fine-tune of a vision-language model has no reference"),
])
def test_grpo_with_images_refuses_what_it_does_not_do_in_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "q", "images": ["a.png"]}) + "\n")
    argv = [a if a != "d.jsonl" else str(tmp_path / a) for a in argv]
    code = main(["rlhf", "--modality", "vision", "--method", "grpo", "--output-dir", str(tmp_path / "out"),
                 *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tigon rlhf: error: {message}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
