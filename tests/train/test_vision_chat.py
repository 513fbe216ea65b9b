"""`tigon chat --image PATH` on the built-in tiny vision-language model (random weights, saved with
its processor): the answers are the model's about the images given (with the first message, and
by /image PATH later); a text-only model or an unreadable image is one line and a non-zero exit."""

import io

import pytest
import torch

from tests.helpers import save_tiny_vlm
from tigon.cli import main
from tigon.train import tiny, tiny_vlm
from tigon.train.vision import VisionPrompt, load_vision_for_inference, user_turn, vision_generate

TOKENS = 5


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-chat")
    save_tiny_vlm(root / "vlm")
    for i, sample in enumerate(tiny_vlm.shapes_task(2, seed=5)):
        (root / f"{'ab'[i]}.png").write_bytes(sample.images[0])
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    from transformers import LlamaConfig

    tiny.random_model(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1), 0).save_pretrained(root / "text")
    return root


def test_chat_answers_about_the_images_it_is_given(place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is this?\n/image b.png\nAnd this?\n/exit\n"))
    assert main(["chat", "vlm", "--image", "a.png", "--max-new-tokens", str(TOKENS), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "/image PATH attaches an image" in out
    replies = [line.split("model> ", 1)[1] for line in out.splitlines() if "model> " in line]
    assert len(replies) == 2 and all(replies), replies

    model, encoder = load_vision_for_inference(str(place / "vlm"), torch.float32)
    a, b = (place / "a.png").read_bytes(), (place / "b.png").read_bytes()
    first = (user_turn("What is this?", 1),)
    assert replies[0] == vision_generate(model, encoder, VisionPrompt(first, (a,), ""), TOKENS)
    second = first + ({"role": "assistant", "content": [{"type": "text", "text": replies[0]}]},
                      user_turn("And this?", 1))
    assert replies[1] == vision_generate(model, encoder, VisionPrompt(second, (a, b), ""), TOKENS)
    # the model reads the image: with the other one it answers otherwise
    assert replies[0] != vision_generate(model, encoder, VisionPrompt(first, (b,), ""), TOKENS)


def test_a_bad_image_path_in_the_chat_is_said_and_the_chat_goes_on(place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    monkeypatch.setattr("sys.stdin", io.StringIO("/image nothing.png\n/image broken.png\nHi\n/exit\n"))
    assert main(["chat", "vlm", "--max-new-tokens", "2", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "/image nothing.png: " in out and "/image broken.png: " in out and out.count("model> ") == 1


@pytest.mark.parametrize("argv, message", [
    (["text", "--image", "a.png"], "--image: text is not a vision-language model"),
    (["vlm", "--image", "nothing.png"], "--image nothing.png: "),
    (["vlm", "--image", "broken.png"], "--image broken.png: "),
    (["vlm", "--image", "https://example.com/a.png"], "a remote URL"),
])
def test_a_text_model_or_an_unreadable_image_is_one_line(place, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(place)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/exit\n"))
    assert main(["chat", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "model> " not in captured.out, captured
