"""`tigon rlhf` on a vision-language model: image preference rows in every layout, the batches
(TRL's vision collators: no image, prompt or padding token scored), the losses against TRL's own
DPOTrainer and KTOTrainer on the same tiny Qwen2-VL with the same image rows, the built-in default,
each method, and the bad input refused in one line.

The fused loss runs its PyTorch reference here, and the runs go without tigon's kernels (as
tests/train/test_rlhf.py and test_vision.py say why); the GPU test runs both on the device."""

import io
import json
import logging
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.train.fused_helpers import one_thread_and_references
from tests.train.test_rlhf import records
from tigon.cli import main
from tigon.train import builtin, rlhf, tiny_vlm, vision_rlhf
from tigon.train.config import RLHFConfig, resolve_rlhf
from tigon.train.vision import VisionEncoder, load_processor, model_config, vision_token_ids
from tigon.train.vision_data import open_image

trl = pytest.importorskip("trl")
Image = pytest.importorskip("PIL.Image")

# One worker sets up its trained runs (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("train-vision_rlhf")

QUESTION = tiny_vlm.QUESTION


@pytest.fixture(scope="module", autouse=True)
def quick():
    with one_thread_and_references("linear_preference_loss,linear_log_probs"):
        yield


def _answer(text):
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """A saved tiny Qwen2-VL with its processor (a user's --model), and 12 of the shapes task's
    pairs as a data file, their images PNG files beside it."""
    root = tmp_path_factory.mktemp("vlm_rlhf")
    processor = tiny_vlm.build_processor()
    tiny_vlm.build_model(processor, seed=1).save_pretrained(root / "m")
    processor.save_pretrained(root / "m")
    (root / "img").mkdir()
    rows = []
    for i, pair in enumerate(vision_rlhf.shapes_pairs(12, seed=3)):
        (root / "img" / f"{i}.png").write_bytes(pair.images[0])
        rows.append({"images": [f"img/{i}.png"], "prompt": f"<image>{QUESTION}",
                     "chosen": pair.chosen[0]["content"][0]["text"], "rejected": pair.rejected[0]["content"][0]["text"]})
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, rows


def _settings(root, **extra):
    values = dict(model=str(root / "m"), dataset=[str(root / "pairs.jsonl")], kernels=False, batch_size=2, lr=1e-3,
                  save_steps=0, samples=0, tuner="full", max_steps=3)
    values.update(extra)
    argv = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        argv += ([flag if value else "--no-" + flag[2:]] if isinstance(value, bool)
                 else [flag, *map(str, value if isinstance(value, list) else [value])])
    return values, argv


def _trl_history(root, rows, tmp_path, values, kto=False, dtype=torch.float32):
    """TRL's own trainer (DPOTrainer, or KTOTrainer) on the unpatched model with the image rows as
    TRL reads them (PIL images, the prompt's text; TRL puts the image before it), processing them
    with its vision collator, with the arguments tigon gives its trainer."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, set_seed

    cfg = resolve_rlhf(RLHFConfig(output_dir=str(tmp_path / "trl"), **values))
    args = rlhf.trl_arguments(cfg, dtype, False)
    args.precompute_ref_log_probs = False
    images = [[Image.open(root / r["images"][0]).convert("RGB")] for r in rows]
    prompts = [[{"role": "user", "content": QUESTION}] for _ in rows]
    if kto:  # each pair's answers, desirable then not, in tigon's seeded order
        judged = [{"images": im, "prompt": p, "completion": _answer(r[key]), "label": key == "chosen"}
                  for im, p, r in zip(images, prompts, rows) for key in ("chosen", "rejected")]
        data = Dataset.from_list([judged[i] for i in _shuffled_order(len(judged), cfg.seed)])
    else:
        data = Dataset.from_list([{"images": im, "prompt": p, "chosen": _answer(r["chosen"]),
                                   "rejected": _answer(r["rejected"])} for im, p, r in zip(images, prompts, rows)])
    set_seed(cfg.seed)
    model = AutoModelForImageTextToText.from_pretrained(root / "m", dtype=dtype).to(args.device)
    model.config.use_cache = False
    processor = load_processor(str(root / "m"), model_config(str(root / "m")))
    cls = trl.KTOTrainer if kto else trl.DPOTrainer
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=processor)
    assert trainer._is_vision_dataset  # TRL's own vision path
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


def _shuffled_order(n, seed):
    from tigon.train import preference

    return preference.shuffled(list(range(n)), seed)


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_dpo_and_ipo_on_images_equal_trls_dpo_trainer(vlm_run, tmp_path, method):
    """The fused loss on the language head computes TRL's DPO (IPO) on image pairs: same model,
    rows, order and seed, TRL batching them with its vision collator and scoring its own loss:
    equal losses, reward margins and accuracies at every step."""
    root, rows = vlm_run
    values, argv = _settings(root, method=method)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    theirs = _trl_history(root, rows, tmp_path, values)
    ours = records(tmp_path / "tigon")
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-5), a["step"]
        assert a["rewards/accuracies"] == b["rewards/accuracies"]
    assert ours[-1]["loss"] != pytest.approx(ours[0]["loss"])  # it trains


def test_kto_on_images_equals_trls_kto_trainer(vlm_run, tmp_path):
    """KTO on judged image answers, its KL baseline from each prompt (and its image) with the next
    row's answer: TRL's KTOTrainer's losses and KL at every step."""
    root, rows = vlm_run
    values, argv = _settings(root, method="kto", batch_size=4)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    theirs = _trl_history(root, rows, tmp_path, values, kto=True)
    ours = records(tmp_path / "tigon")
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6), a["step"]


def test_batches_score_the_answers_only_never_an_image_or_padding(vlm_run):
    """The collator's batch: the prompts' images as pixels, each pair's two sequences, and targets
    on the answers' tokens alone (no image or vision token, no prompt or padding token)."""
    root, rows = vlm_run
    processor = load_processor(str(root / "m"), model_config(str(root / "m")))
    items = vision_rlhf.load_vision_preferences([str(root / "pairs.jsonl")], seed=0, method="dpo")
    collator = vision_rlhf.VisionPreferenceCollator(VisionEncoder(processor), kto=False, max_length=128)
    data = collator.dataset(items[:3])
    batch = collator([data[i] for i in range(3)])
    assert batch["pixel_values"].shape[0] == 2 * 3 * 16 and batch["image_grid_thw"].shape == (6, 3)
    target = rlhf._targets(batch["input_ids"], batch["completion_mask"])
    scored = target != -100
    assert not (scored & (batch["attention_mask"][:, 1:] == 0)).any()
    assert not set(target[scored].tolist()) & vision_token_ids(processor)
    tokenizer = processor.tokenizer
    for i, key in enumerate(["chosen"] * 3 + ["rejected"] * 3):
        assert tokenizer.decode(target[i][scored[i]]) == rows[i % 3][key] + "<|im_end|>\n"
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ((batch["input_ids"] == image_pad).sum(1) == 4).all()  # 56 x 56 pixels: 4 tokens each
    assert batch[rlhf.NUM_TOKENS] == int(batch["attention_mask"].sum())
    assert rlhf.media(batch).keys() >= {"pixel_values", "image_grid_thw"}


def test_every_layout_reads_into_the_same_pair(tmp_path):
    png = io.BytesIO()
    Image.new("RGB", (30, 20), (220, 40, 40)).save(png, format="PNG")
    (tmp_path / "a.png").write_bytes(png.getvalue())
    user = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                         {"type": "text", "text": QUESTION}]}]
    layouts = {
        "pcr": {"images": ["a.png"], "prompt": f"<image>{QUESTION}", "chosen": "a red circle", "rejected": "a blue one"},
        "trl": {"images": ["a.png"], "prompt": [{"role": "user", "content": QUESTION}],
                "chosen": _answer("a red circle"), "rejected": _answer("a blue one")},
        "chats": {"chosen": user + _answer("a red circle"), "rejected": user + _answer("a blue one")},
        "swift": {"messages": [{"role": "user", "content": f"<image>{QUESTION}"}, *_answer("a red circle")],
                  "rejected_response": "a blue one", "images": ["a.png"]},
    }
    pairs = []
    for name, row in layouts.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        pairs += vision_rlhf.load_vision_preferences([str(tmp_path / f"{name}.jsonl")], seed=0, method="dpo")
    for pair in pairs:
        assert pair.prompt == ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},)
        assert pair.chosen == tuple(_answer("a red circle")) and pair.rejected == tuple(_answer("a blue one"))
        assert open_image(pair.images[0]).getpixel((3, 3)) == (220, 40, 40)
    kto = vision_rlhf.load_vision_preferences([str(tmp_path / "pcr.jsonl")], seed=0, method="kto")
    assert [(j.desirable, j.images) for j in kto] == [(True, pairs[0].images), (False, pairs[0].images)]


@pytest.fixture(scope="module")
def vision_sft_stage(tmp_path_factory):
    """The sft stage `tigon rlhf --modality vision` trains first (shortened), with one DPO step
    after it: the runs below find a copy in their output directories."""
    out = tmp_path_factory.mktemp("vision-default")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtin, "SFT_STAGE_STEPS", 160)
        assert main(["rlhf", "--modality", "vision", "--output-dir", str(out), "--max-steps", "1", "--samples", "0",
                     "--no-kernels"]) == 0
    for stage in ("sft", "."):  # the stage is tigon sft --modality vision: the model with its processor
        assert json.loads((out / stage / "final" / "config.json").read_text())["model_type"] == "qwen2_vl"
        assert (out / stage / "final" / "processor_config.json").is_file()
    return out / "sft"


def _with_stage(out, stage):
    shutil.copytree(stage, out / "sft")
    return out


def test_builtin_default_trains_dpo_on_the_shapes_pairs(tmp_path, caplog, vision_sft_stage):
    """No model, no data: DPO of the built-in tiny Qwen2-VL after its sft stage on the shapes task's
    pairs, the policy starting as its reference, the margin and accuracy rising; final/ holds the
    processor."""
    caplog.set_level(logging.INFO)
    out = _with_stage(tmp_path / "run", vision_sft_stage)
    assert main(["rlhf", "--modality", "vision", "--output-dir", str(out), "--samples", "1",
                 "--max-new-tokens", "3", "--no-kernels"]) == 0
    assert "the synthetic shapes task's pairs: 192" in caplog.text
    assert f"policy: the built-in model after sft, from {out / 'sft' / 'final'}" in caplog.text
    steps = records(out)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert steps[-1]["rewards/margins"] > 0.05 and steps[-1]["rewards/accuracies"] > 0.6
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / "processor_config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    (sample,) = json.loads((out / "samples.json").read_text())
    assert {"prompt", "before", "after"} <= set(sample)


@pytest.mark.parametrize("method", ["orpo", "simpo", "cpo", "kto"])
def test_every_preference_method_trains_on_images(tmp_path, method, vision_sft_stage):
    out = _with_stage(tmp_path / method, vision_sft_stage)
    assert main(["rlhf", "--modality", "vision", "--method", method, "--output-dir", str(out), "--max-steps", "3",
                 "--samples", "0", "--no-kernels"]) == 0
    steps = records(out)
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) for r in steps)
    # (From the sft stage, three batches' losses differ by their batches as much as by the updates.)
    trained, started = (load_file(d / "final" / "model.safetensors") for d in (out, out / "sft"))
    assert trained.keys() == started.keys() and all(t.isfinite().all() for t in trained.values())
    assert any(not torch.equal(trained[k], started[k]) for k in trained), f"{method} changed no weight"


def test_lora_on_images_keeps_the_vision_tower_frozen(vlm_run, tmp_path, caplog):
    """LoRA: the reference is the policy with its adapter off; vision encoder and projector frozen."""
    caplog.set_level(logging.INFO)
    root, _ = vlm_run
    _, argv = _settings(root, tuner="lora", lr=1e-2, max_steps=12)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "out")]) == 0
    assert "(vision encoder and projector frozen)" in caplog.text
    steps = records(tmp_path / "out")
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the adapter starts at zero: the reference
    assert sum(r["loss"] for r in steps[-6:]) / 6 < math.log(2)
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()


@pytest.mark.parametrize("rows, argv, message", [
    ([{"images": ["nope.png"], "prompt": "<image>q", "chosen": "a", "rejected": "b"}], [],
     "{tmp}/d.jsonl line 1: image 1 (nope.png): no such file ({tmp}/nope.png)"),
    ([{"images": ["a.png"], "prompt": "<image>q<image>", "chosen": "a", "rejected": "b"}], [],
     "{tmp}/d.jsonl line 1: has 2 <image> placeholders (or image parts) but 1 image"),
    ([{"images": ["a.png"], "prompt": "q", "chosen": "<image>a", "rejected": "b"}], [],
     "{tmp}/d.jsonl line 1: chosen holds an image: a row's images belong to its prompt"),
    ([{"images": ["a.png"], "prompt": "<image>q", "chosen": "a", "rejected": "a"}], [],
     "{tmp}/d.jsonl line 1: the chosen and rejected answers are the same"),
    ([{"images": ["a.png"], "prompt": "<image>q", "chosen": "a", "rejected": "b"}], ["--method", "grpo"],
     "{tmp}/d.jsonl: no answer column for the default reward"),
    ([{"images": ["a.png"], "prompt": "<image>q", "chosen": "a", "rejected": "b"}], ["--precompute-ref-log-probs"],
     "--precompute-ref-log-probs: not for images"),
])
def test_bad_image_rows_are_one_line_and_write_nothing(tmp_path, capsys, rows, argv, message):
    Image.new("RGB", (28, 28)).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["rlhf", "--modality", "vision", "--dataset", str(tmp_path / "d.jsonl"), "--output-dir",
                 str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tigon rlhf: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_image_rows_to_a_text_only_model_are_one_line(tmp_path, capsys):
    """Preference rows with images given to the built-in text model (or --modality vision to a
    text-only --model) are refused before anything is written."""
    from tests.train.fused_helpers import save_tiny
    from tigon.train import tiny
    from tigon.train.data import load_samples

    (tmp_path / "d.jsonl").write_text(json.dumps({"images": ["a.png"], "prompt": "<image>q", "chosen": "a",
                                                  "rejected": "b"}) + "\n")
    assert main(["rlhf", "--dataset", str(tmp_path / "d.jsonl"), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"tigon rlhf: error: {tmp_path}/d.jsonl line 1: has images: a text-only "
                                              "model cannot train on images")
    save_tiny(tmp_path / "m", tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0)))
    assert main(["rlhf", "--model", str(tmp_path / "m"), "--modality", "vision", "--output-dir",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"tigon rlhf: error: --modality vision: {tmp_path / 'm'} is a text-only "
                                              "model")
    assert main(["rlhf", "--max-pixels", "100", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--max-pixels: only for vision-language models" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_gpu_bf16_kernels_train_image_pairs_like_trl(vlm_run, tmp_path, monkeypatch, caplog):
    """On the GPU, in bf16: DPO on image pairs with tigon's kernels patched into the Qwen2-VL and
    the fused loss's Triton path takes TRL's DPOTrainer's steps (unpatched, bf16 tolerance)."""
    caplog.set_level(logging.INFO)
    monkeypatch.delenv("TIGON_DISABLE")  # the Triton paths, compiled
    root, rows = vlm_run
    values, argv = _settings(root, kernels=True, dtype="bf16", tuner="full", max_steps=6)
    assert main(["rlhf", *argv, "--output-dir", str(tmp_path / "tigon")]) == 0
    assert "tigon: kernels off" not in caplog.text
    assert "tigon: applied rms_norm" in caplog.text and "to Qwen2VLForConditionalGeneration" in caplog.text
    ours = records(tmp_path / "tigon")
    theirs = _trl_history(root, rows, tmp_path, values, dtype=torch.bfloat16)
    assert len(ours) == len(theirs) == 6
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=3e-2, abs=3e-3), a["step"]
