import importlib.util
import json
import math

import pytest
import torch

from tigon.cli import main
from tigon.train.template import render


def _hand_nll(model, ids, first_scored):
    """Summed NLL of ids[first_scored:] given what precedes each, straight from the model."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return -sum(float(logp[t - 1, ids[t]]) for t in range(first_scored, len(ids))), len(ids) - first_scored


def test_perplexity_is_exp_of_the_mean_token_nll(tiny_dir, tiny_model, tmp_path, capsys):
    model, tokenizer = tiny_model
    chats = [("Who are you?", "I am Tigon."), ("Name a colour.", "Blue, like the sea on a clear day."),
             ("What is 2+2?", "4")]
    texts = ["the cat sat on the mat", "a longer line of plain text, scored on every token it has"]
    (tmp_path / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in chats))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_dir), "--dataset", str(tmp_path / "chat.jsonl"), str(tmp_path / "text.jsonl"),
                 "--batch-size", "2", "--dtype", "fp32", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    chat, text = result["datasets"]

    nll = count = 0
    for q, a in chats:  # the reply and its end-of-turn marker are scored, the prompt is not
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        prompt = tokenizer(render(tokenizer, messages[:1], True), add_special_tokens=False)["input_ids"]
        full = tokenizer(render(tokenizer, messages, False), add_special_tokens=False)["input_ids"]
        assert full[:len(prompt)] == prompt
        n, c = _hand_nll(model, full, len(prompt))
        nll, count = nll + n, count + c
    assert chat["tokens"] == count and chat["rows"] == 3
    assert math.isclose(chat["loss"], nll / count, rel_tol=1e-5)
    assert math.isclose(chat["perplexity"], math.exp(nll / count), rel_tol=1e-5)

    nll = count = 0
    for t in texts:  # plain text: every token after the first, with the EOS sft appends
        ids = tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]
        n, c = _hand_nll(model, ids, 1)
        nll, count = nll + n, count + c
    assert text["tokens"] == count and math.isclose(text["loss"], nll / count, rel_tol=1e-5)

    table = capsys.readouterr().out
    assert "perplexity" in table and f"{chat['perplexity']:.4f}" in table and str(out) in table


def test_eval_errors_are_one_line(tiny_dir, tmp_path, capsys):
    assert main(["eval", str(tiny_dir)]) == 2
    assert capsys.readouterr().err.strip() == "tigon eval: error: tigon eval needs --dataset FILE... and/or --tasks T1,T2"
    assert main(["eval", str(tiny_dir), "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "dataset file not found" in capsys.readouterr().err
    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm-eval is installed here")
    assert main(["eval", str(tiny_dir), "--tasks", "hellaswag"]) == 2
    assert capsys.readouterr().err.strip() == ("tigon eval: error: --tasks needs lm-evaluation-harness, which is not "
                                               "installed (pip install lm-eval)")
