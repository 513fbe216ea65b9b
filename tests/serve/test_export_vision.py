"""`tigon export` of a vision-language model: --to merged writes the whole model with its
processor (which reads images as the original's does); --to gguf is refused in one line, before
anything is written."""

import pytest
import torch

from tigon.cli import main
from tigon.train import tiny_vlm

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm_export") / "m"
    processor = tiny_vlm.build_processor()
    tiny_vlm.build_model(processor, seed=2).save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_a_vision_language_model_exports_merged_with_its_processor(vlm_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from tigon.train.vision import load_processor, model_config

    out = tmp_path / "merged"
    assert main(["export", str(vlm_dir), "--to", "merged", "--dtype", "bf16", "--output", str(out)]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(out)
    original = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert merged.dtype == torch.bfloat16 and type(merged) is type(original)
    want = original.state_dict()
    assert merged.state_dict().keys() == want.keys()
    for name, tensor in merged.state_dict().items():
        assert torch.equal(tensor, want[name].to(torch.bfloat16)), name
    image = Image.new("RGB", (56, 56), (220, 40, 40))
    theirs, ours = (load_processor(str(d), model_config(str(d))) for d in (vlm_dir, out))
    text = "<|vision_start|><|image_pad|><|vision_end|>" + tiny_vlm.QUESTION
    a, b = (p(text=[text], images=[[image]], return_tensors="pt") for p in (theirs, ours))
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert ours.chat_template == theirs.chat_template


def test_gguf_of_a_vision_language_model_is_one_line_and_writes_nothing(vlm_dir, tmp_path, capsys):
    for output in (tmp_path / "out", tmp_path / "m.gguf"):
        assert main(["export", str(vlm_dir), "--to", "gguf", "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tigon export: error: {vlm_dir}: GGUF is not available for qwen2_vl, a "
                              "vision-language model"), err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
