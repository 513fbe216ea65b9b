"""The stages of `tigon sft` (tigon.train.run) on their own: what they decide, without a training run."""

import ast
import random
from pathlib import Path

import pytest

import tigon.train
from tigon.train import run, tiny
from tigon.train.config import SFTConfig, SFTError
from tigon.train.data import Sample, load_samples


def test_train_never_imports_bench():
    """The MFU's matmul rate comes from the ground-floor tigon.timing, not from tigon.bench."""
    for path in Path(tigon.train.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("tigon.bench")], path


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))


@pytest.mark.parametrize("rows, batch, accum, epochs, max_steps", [
    (37, 4, 1, 1.0, -1), (37, 4, 3, 2.5, -1), (5, 8, 2, 3.0, -1), (40, 4, 1, 30.0, 7)])
def test_planned_steps_are_the_trainers_own(tokenizer, tmp_path, rows, batch, accum, epochs, max_steps):
    """What `--resume` compares a checkpoint's step with: the Trainer's own plan for the run."""
    from transformers import TrainingArguments

    from tigon.train.batching import Collator, TokenDataset
    from tigon.train.trainer import TigonTrainer

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, num_train_epochs=epochs, max_steps=max_steps,
                             report_to="none", use_cpu=True, remove_unused_columns=False, disable_tqdm=True)
    data = TokenDataset([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}] * rows)
    trainer = TigonTrainer(model=tiny.build_model(tokenizer, 0), args=args, train_dataset=data,
                           data_collator=Collator(tokenizer.pad_token_id))
    *_, trainers = trainer.set_initial_training_values(args, trainer.get_train_dataloader())
    assert run.planned_steps(args, rows) == trainers


def test_sample_prompts_come_from_samples_trained_on_whole(tokenizer):
    rng = random.Random()
    words = lambda n: " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(n))  # noqa: E731
    long = Sample("a", messages=({"role": "user", "content": words(60)}, {"role": "assistant", "content": words(3)}))
    short = [Sample(f"s{i}", messages=({"role": "user", "content": f"question {i}"},
                                       {"role": "assistant", "content": words(2)})) for i in range(3)]
    text = Sample("t", text=words(60))
    prompts = run.pick_prompts(tokenizer, [long, short[0], long, text, short[1], short[2]], 3, max_length=40)
    assert prompts == [[{"role": "user", "content": "question 0"}], [{"role": "user", "content": "question 1"}],
                       [{"role": "user", "content": "question 2"}]]
    assert run.pick_prompts(tokenizer, [long, text], 3, max_length=400)[0] == [long.messages[0]]


def test_long_sample_text_is_cut_for_the_log():
    assert run._shown("short") == "'short'"
    cut = run._shown("x" * 500)
    assert len(cut) == run._SHOWN_CHARS + 2 and cut.endswith("…'")


def test_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SFTError, match=f"--output-dir {tmp_path}/file/out: {tmp_path}/file is a file"):
        run.start(SFTConfig(output_dir=str(tmp_path / "file" / "out")))
