"""`tigon sft --task classification`: a run on a tiny model whose eval accuracy and F1 are logged
and whose labels are saved in its config, `tigon infer` on it (a full model and a LoRA adapter),
the label mapping, macro F1 against its definition, and bad rows refused in one line."""

import json
import logging

import pytest
import torch

from tests.train.fused_helpers import argv_of, one_thread_and_references
from tigon.cli import main
from tigon.train import classify


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_thread_and_references(""):
        yield


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_classification_run_then_infer(tmp_path, capsys, tuner):
    """The bundled topics, 96 rows, on the built-in model: eval accuracy and F1 in the metrics,
    id2label in the saved config (the labels file beside an adapter), and `tigon infer` printing
    a label and its probability, the one the model's own forward gives."""
    data = f"{classify.BUNDLED_CLASSIFICATION}#96"
    values = dict(task="classification", dataset=[data], eval_dataset=[f"{classify.BUNDLED_CLASSIFICATION}#40"],
                  batch_size=8, epochs=2.0, save_steps=6, samples=0, tuner=tuner, kernels=False)
    if tuner == "lora":
        values["lr"] = 5e-3
    out = tmp_path / "out"
    assert main(["sft", *argv_of(values), "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all({"eval_accuracy", "eval_f1"} <= set(r) for r in evals)
    assert evals[-1]["eval_accuracy"] > 0.5 and evals[-1]["eval_f1"] > 0.4
    assert any("accuracy" in r and "eval_loss" not in r for r in records)
    names = ["food", "sports", "technology", "weather"]
    final = out / "final"
    if tuner == "full":
        config = json.loads((final / "config.json").read_text())
        assert config["id2label"] == {str(i): n for i, n in enumerate(names)}
        assert config["label2id"] == {n: i for i, n in enumerate(names)}
        assert config["architectures"] == ["LlamaForSequenceClassification"]
    else:
        assert json.loads((final / "tigon_labels.json").read_text()) == {str(i): n for i, n in enumerate(names)}
    text = "The striker scored twice in the final at the stadium."
    capsys.readouterr()
    assert main(["infer", str(final), "--prompt", text]) == 0
    label, probability = capsys.readouterr().out.strip().split("\t")
    from tigon.train.infer import load_for_inference

    model, tokenizer = load_for_inference(str(final), torch.float32)
    with torch.no_grad():
        probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
    assert label == names[int(probs.argmax())] and float(probability) == pytest.approx(float(probs.max()), abs=1e-4)


def test_label_names_and_ids():
    rows = [classify.Labeled(f"f line {i}", "t", n) for i, n in enumerate(["10", "9", "2", "9"])]
    assert classify.label_names(rows, None) == ["2", "9", "10"]  # numbers in their order
    rows = [classify.Labeled(f"f line {i}", "t", n) for i, n in enumerate(["pos", "neg", "pos"])]
    assert classify.label_names(rows, None) == ["neg", "pos"]
    assert classify.label_names(rows, ["pos", "neg", "neutral"]) == ["pos", "neg", "neutral"]


def test_macro_f1_is_the_mean_of_each_labels_f1():
    generator = torch.Generator().manual_seed(0)
    true = torch.randint(0, 4, (200,), generator=generator)
    predicted = torch.where(torch.rand(200, generator=generator) < 0.6, true,
                            torch.randint(0, 4, (200,), generator=generator))
    predicted[predicted == 3] = 2  # a label never predicted
    confusion = torch.bincount(true * 4 + predicted, minlength=16).view(4, 4)
    scores = []
    for label in range(4):  # precision and recall per label, from the rows themselves
        t, p = true.tolist(), predicted.tolist()
        hits = sum(a == b == label for a, b in zip(t, p))
        precision = hits / max(p.count(label), 1)
        recall = hits / t.count(label)
        scores.append(2 * precision * recall / (precision + recall) if hits else 0.0)
    assert classify.macro_f1(confusion) == pytest.approx(sum(scores) / 4, rel=1e-6)


@pytest.mark.parametrize("rows,extra,message", [
    ([{"text": "a", "label": "x"}, {"text": "b"}], [], "{f} line 2: missing label (the file is text/label format)"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": None}], [], "{f} line 2: label is missing (null)"),
    ([{"text": "a", "label": "x"}, {"text": " ", "label": "y"}], [], "{f} line 2: text is empty"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": ""}], [], "{f} line 2: label is empty"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "z"}], ["--labels", "x,y"],
     "{f} line 2: label 'z' is not one of --labels x,y"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "x"}], [], "the data has one label ('x')"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}], ["--labels", "x,x"],
     "--labels x,x: give two or more distinct labels"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}], ["--packing"],
     "--packing: not for --task classification"),
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}], ["--task", "causal_lm", "--labels", "x,y"],
     "--labels: only for --task classification"),
    ([{"query": "q", "document": "d", "label": 1}, {"query": "q", "label": 0}], [],
     "{f} line 2: missing document (the file is query/document/label (a reranker) format)"),
    ([{"query": "q", "document": "d", "label": 1}, {"query": " ", "document": "d", "label": 0}], [],
     "{f} line 2: query is empty"),
])
def test_bad_rows_are_one_line_and_write_nothing(tmp_path, capsys, rows, extra, message):
    f = write_rows(tmp_path / "bad.jsonl", rows)
    assert main(["sft", "--task", "classification", "--dataset", f, "--output-dir", str(tmp_path / "out"),
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon sft: error: {message.format(f=f)}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_eval_rows_with_an_unknown_label_are_refused(tmp_path, capsys):
    f = write_rows(tmp_path / "train.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    g = write_rows(tmp_path / "eval.jsonl", [{"text": "c", "label": "w"}])
    assert main(["sft", "--task", "classification", "--dataset", f, "--eval-dataset", g, "--output-dir",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon sft: error: {g} line 1: label 'w' (evaluation data) is not among the training "
                          "data's labels x, y")


def test_builtin_default_holds_out_a_tenth_and_evaluates(tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="tigon"):
        assert main(["sft", "--task", "classification", "--max-steps", "3", "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_f1" in r for r in records)
    assert json.loads((out / "final" / "config.json").read_text())["id2label"]["3"] == "weather"
    # What the run says at its end: a classifier is tried with tigon infer, and tigon's patch line
    # names no fused LM-head loss (a classifier has no LM head).
    lines = [r.getMessage() for r in caplog.records]
    finish = [line for line in lines if line.startswith("model: ") and "final" in line][-1]
    assert "tigon infer" in finish and "tigon chat" not in finish, finish
    patched = [line for line in lines if line.startswith("tigon: applied")]
    assert patched and not any("linear_cross_entropy" in line for line in patched), patched


def test_a_reranker_is_a_classifier_of_query_document_pairs(tmp_path, capsys):
    """Rows {query, document, label} train a reranker: each pair read as one text, the label whether
    the document answers the query; `tigon infer` on a pair in that layout prints the label the
    model gives it."""
    import random

    rng = random.Random(0)
    facts = [(f"What colour is item {i}?", f"Item {i} is {c}.") for i, c in
             enumerate(rng.choice(["red", "blue", "green", "gold"]) for _ in range(48))]
    rows = [{"query": q, "document": d, "label": 1} for q, d in facts]
    rows += [{"query": q, "document": facts[(i + 7) % len(facts)][1], "label": 0} for i, (q, _) in enumerate(facts)]
    rng.shuffle(rows)
    data = write_rows(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    values = dict(task="classification", dataset=[data], batch_size=8, epochs=1.0, save_steps=0, samples=0,
                  tuner="full", kernels=False)
    assert main(["sft", *argv_of(values), "--output-dir", str(out)]) == 0
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1"}
    capsys.readouterr()
    pair = classify.RERANK_TEXT.format(query="What colour is item 3?", document=facts[3][1])
    assert main(["infer", str(out / "final"), "--prompt", pair]) == 0
    label, probability = capsys.readouterr().out.strip().split("\t")
    assert label in ("0", "1") and 0.5 <= float(probability) <= 1.0
