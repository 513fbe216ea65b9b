"""`tigon sft`, `merge`, `infer` and `chat` end to end on CPU, with the built-in tiny model kept
to a few steps on a slice of the bundled data."""

import errno
import io
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tigon
from tigon.cli import main
from tigon.train import tiny
from tigon.train.data import load_samples

pytest.importorskip("peft")

SHORT = ["--dataset", f"{tiny.BUNDLED_DATASET}#40", "--batch-size", "4", "--max-length", "48", "--samples", "0",
         "--no-kernels"]


def sft(*args):
    assert main(["sft", *SHORT, *args]) == 0


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def no_staging_left(out):
    return not [p.name for p in out.rglob(".tmp-*")]


def test_builtin_default_learns_and_writes_everything(tmp_path):
    out = tmp_path / "run"
    assert main(["sft", "--output-dir", str(out), "--max-steps", "12", "--save-steps", "6", "--samples", "1",
                 "--max-new-tokens", "4", "--dataset", f"{tiny.BUNDLED_DATASET}#48", "--no-kernels"]) == 0
    steps = losses(out)
    assert sorted(steps) == list(range(1, 13))
    first, last = [steps[s] for s in (1, 2, 3)], [steps[s] for s in (10, 11, 12)]
    assert sum(last) < 0.8 * sum(first)  # the loss visibly falls
    assert (out / "loss.png").stat().st_size > 1000
    for d in ("checkpoint-6", "checkpoint-12", "final"):
        assert (out / d / "model.safetensors").is_file() and (out / d / "tokenizer_config.json").is_file()
    assert (out / "checkpoint-6" / "optimizer.pt").is_file()
    assert no_staging_left(out)
    (sample,) = json.loads((out / "samples.json").read_text())
    assert sample["prompt"] and {"before", "after"} <= set(sample)

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    saved = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in saved.items())


def test_kernels_on_trains_like_kernels_off(tmp_path, caplog):
    """The patched model (kernels in Triton's interpreter here) takes the same steps."""
    caplog.set_level(logging.INFO)
    args = ["--max-steps", "2", "--batch-size", "2", "--max-length", "40", "--dataset", f"{tiny.BUNDLED_DATASET}#8",
            "--save-steps", "0", "--samples", "0"]
    assert main(["sft", *args, "--output-dir", str(tmp_path / "off"), "--no-kernels"]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "on")]) == 0
    assert "tigon: applied rms_norm" in caplog.text
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(off) == sorted(on) == [1, 2]
    for step in off:
        assert on[step] == pytest.approx(off[step], rel=1e-4)
    # The patched loss hands over its token accuracy; HF's own loss has none to give.
    records = {kind: [json.loads(line) for line in (tmp_path / kind / "metrics.jsonl").read_text().splitlines()]
               for kind in ("on", "off")}
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records["on"] if "loss" in r)
    assert not any("accuracy" in r for r in records["off"])


RESUMABLE = ["--tuner", "lora", "--lora-dropout", "0.2", "--max-steps", "6", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A LoRA run (dropout on, so the RNG state matters) never interrupted, checkpointed at 3 and 6."""
    full = tmp_path_factory.mktemp("resume") / "full"
    sft("--output-dir", str(full), *RESUMABLE, "--save-steps", "3")
    return full


def same_run(full, cut):
    """Same losses at every step, same final adapter."""
    assert sorted(losses(cut)) == sorted(losses(full)) == list(range(1, 7))
    for step, loss in losses(full).items():
        assert losses(cut)[step] == pytest.approx(loss, rel=1e-6, abs=1e-7)
    a, b = (load_file(d / "final" / "adapter_model.safetensors") for d in (full, cut))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a)


def test_resume_continues_exactly(uninterrupted, tmp_path, caplog):
    """Interrupted after a checkpoint and resumed = never interrupted; the summary counts the steps
    this run took, not those before its checkpoint."""
    caplog.set_level(logging.INFO)
    cut = tmp_path / "cut"
    shutil.copytree(uninterrupted, cut)
    for d in ("checkpoint-6", "final"):
        shutil.rmtree(cut / d)
    sft("--output-dir", str(cut), *RESUMABLE, "--save-steps", "3", "--resume")
    assert "done: 3 steps (steps 4-6, resumed after step 3) in " in caplog.text
    same_run(uninterrupted, cut)


# Runs `tigon sft` with Ctrl-C (a real SIGINT) arriving during step 3.
CTRL_C_IN_STEP_3 = """
import os, signal, sys
from transformers import TrainerCallback
from tigon.cli import main
from tigon.train import run

class CtrlC(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)

class Trainer(run.TigonTrainer):
    def __init__(self, *args, callbacks=(), **kwargs):
        super().__init__(*args, callbacks=[*callbacks, CtrlC()], **kwargs)

run.TigonTrainer = Trainer
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_saves_a_checkpoint_that_resumes_exactly(uninterrupted, tmp_path):
    """Ctrl-C in a run before its first checkpoint (--save-steps 0): the step finishes, a complete
    checkpoint is written, one line says so, exit 130; --resume then ends where the run that was
    never interrupted ended. And no DeepSpeed warning on the way (the dev extra installs it)."""
    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tigon.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CTRL_C_IN_STEP_3, "sft", *SHORT, *RESUMABLE, "--save-steps", "0",
                           "--output-dir", str(cut)], capture_output=True, text=True, env=env, timeout=600)
    lines = proc.stderr.replace("\r", "\n").splitlines()
    assert proc.returncode == 130, proc.stderr
    assert lines[-1] == (f"tigon sft: stopped by Ctrl-C at step 3 of 6: saved {cut / 'checkpoint-3'}; rerun the "
                         "same command with --resume to continue")
    assert "Traceback" not in proc.stderr and sum("Ctrl-C" in line for line in lines) == 1
    assert "DeepSpeed" not in proc.stderr and "Setting accelerator" not in proc.stderr
    assert [p.name for p in cut.iterdir() if p.name.startswith(("checkpoint-", ".tmp-", "final"))] == ["checkpoint-3"]
    assert sorted(losses(cut)) == [1, 2, 3]
    sft("--output-dir", str(cut), *RESUMABLE, "--save-steps", "0", "--resume")
    same_run(uninterrupted, cut)


@pytest.mark.parametrize("signals, code", [(["SIGTERM"], 143), (["SIGINT", "SIGINT"], 130)])
def test_sigterm_saves_and_a_second_signal_quits_without_saving(tmp_path, monkeypatch, capsys, signals, code):
    import signal

    from transformers import TrainerCallback

    from tigon.train import run

    class Send(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                for name in signals:
                    os.kill(os.getpid(), getattr(signal, name))

    class Trainer(run.TigonTrainer):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[*callbacks, Send()], **kwargs)

    monkeypatch.setattr(run, "TigonTrainer", Trainer)
    out = tmp_path / "out"
    assert main(["sft", *SHORT, "--max-steps", "4", "--save-steps", "0", "--output-dir", str(out)]) == code
    err = capsys.readouterr().err.splitlines()[-1]
    saved = [p.name for p in out.iterdir() if p.name.startswith(("checkpoint-", ".tmp-", "final"))]
    if len(signals) == 1:
        assert err.startswith("tigon sft: stopped by SIGTERM at step 2 of 4: saved") and saved == ["checkpoint-2"]
    else:
        assert err == "tigon sft: interrupted; no checkpoint saved" and saved == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers given back


def test_resume_of_a_finished_run_does_nothing_or_writes_only_a_missing_final(tmp_path, caplog, lora_run):
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    args = [*SHORT, "--max-steps", "3", "--save-steps", "3", "--output-dir", str(out)]
    sft(*args)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    sft(*args, "--resume")
    assert f"{out}: the run is complete (step 3 of 3) and its model is in {out / 'final'}: nothing to do" in caplog.text
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == before
    shutil.rmtree(out / "final")
    sft(*args, "--resume")
    assert "writing it from checkpoint-3" in caplog.text and sorted(losses(out)) == [1, 2, 3]
    assert not (out / "checkpoint-4").exists()
    rebuilt, trained = (load_file(out / d / "model.safetensors") for d in ("final", "checkpoint-3"))
    assert rebuilt.keys() == trained.keys() and all(torch.equal(rebuilt[k], trained[k]) for k in trained)
    # A run that kept no checkpoint (--save-steps 0) and finished: nothing to resume, nothing to do.
    assert main(["sft", *SHORT, "--model", str(lora_run / "base"), "--tuner", "lora", "--lora-rank", "4",
                 "--lr", "2e-2", "--max-steps", "3", "--save-steps", "0", "--output-dir", str(lora_run / "out"),
                 "--resume"]) == 0
    assert "the run is complete (no checkpoint kept)" in caplog.text


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A saved tiny model used as a user's --model, and a LoRA adapter trained on it."""
    root = tmp_path_factory.mktemp("lora")
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    model = tiny.build_model(tokenizer, seed=random.randrange(1000))
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    main(["sft", *SHORT, "--model", str(root / "base"), "--tuner", "lora", "--lora-rank", "4", "--lr", "2e-2",
          "--max-steps", "3", "--save-steps", "0", "--output-dir", str(root / "out")])
    return root


def test_lora_adapter_loads_in_peft_and_merges(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = lora_run / "out" / "final"
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_run / "base"), adapter).eval()
    assert main(["merge", str(adapter), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(lora_run / "base").eval()
    ids = torch.randint(4, 1000, (2, 17))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-3)  # the adapter did something
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_infer_and_chat(lora_run, capsys, monkeypatch):
    adapter = str(lora_run / "out" / "final")
    assert main(["infer", adapter, "--prompt", "Who are you?", "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "> Who are you?" in out and "> Hi" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("Who are you?\n/reset\nHi\n/exit\n"))
    assert main(["chat", adapter, "--max-new-tokens", "3", "--system", "Be brief."]) == 0
    assert capsys.readouterr().out.count("model> ") == 2


def test_ctrl_c_in_chat_is_one_line(lora_run, capsys, monkeypatch):
    class CtrlCAtThePrompt(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr("sys.stdin", CtrlCAtThePrompt())
    assert main(["chat", str(lora_run / "out" / "final"), "--max-new-tokens", "3"]) == 130
    assert capsys.readouterr().err == "\ntigon chat: interrupted\n"


@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_fails_fast_in_one_line(tmp_path, capsys, monkeypatch, offline):
    """A hub id with no network (here: a hub that refuses connections) or with HF_HUB_OFFLINE:
    one line within seconds, where the hub client would retry for about a minute."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    # huggingface_hub reads HF_HUB_OFFLINE once, when first imported: in a test process that first
    # imported it under another test's HF_HUB_OFFLINE=1 (the web UI's), the constant says offline.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.perf_counter()
    assert main(["sft", "--model", "made-up/model-name", "--output-dir", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tigon sft: error: model not found: made-up/model-name: not a "
                                                     "local directory")
    assert ("HF_HUB_OFFLINE is set" if offline else "hub (http://127.0.0.1:9) cannot be reached") in err


def test_tensorboard_tracking_logs_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    sft("--max-steps", "3", "--save-steps", "0", "--report-to", "tensorboard", "--output-dir", str(out))
    (run_dir,) = (out / "runs").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged.keys() == losses(out).keys() == {1, 2, 3}
    assert all(logged[s] == pytest.approx(loss, rel=1e-6) for s, loss in losses(out).items())
    assert all(e.value > 0 for e in events.Scalars("train/tokens_per_s"))  # tigon's own figures too


def test_packing_eval_and_other_formats(tmp_path):
    rng = random.Random()
    alpaca = tmp_path / "alpaca.csv"
    alpaca.write_text("instruction,input,output\n" + "".join(
        f"Add {a} and {b},,{a + b}\n" for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(30))))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"line {i} of plain text"}) + "\n" for i in range(10)))
    evals = tmp_path / "eval.json"
    evals.write_text(json.dumps([{"query": "Add 1 and 2", "response": "3"}] * 4))
    out = tmp_path / "run"
    assert main(["sft", "--dataset", str(alpaca), str(text), "--eval-dataset", str(evals), "--packing",
                 "--max-length", "64", "--batch-size", "2", "--max-steps", "3", "--save-steps", "2",
                 "--samples", "0", "--no-kernels", "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    assert all(r["tokens_per_s"] > 0 for r in records if "loss" in r)


def test_failed_save_leaves_nothing_and_the_rerun_says_what_to_pass(tmp_path, monkeypatch, capsys, caplog):
    """A save that fails part-way removes what it wrote. The run, stopped before its first
    checkpoint, is refused by a plain rerun with what to pass, and started over by --resume."""
    from transformers import Trainer

    def crash(self, output_dir):
        raise RuntimeError("power cut")

    monkeypatch.setattr(Trainer, "_save_rng_state", crash)  # after the weights, before the end
    out = tmp_path / "run"
    args = ["sft", *SHORT, "--max-steps", "2", "--save-steps", "1", "--output-dir", str(out)]
    with pytest.raises(RuntimeError, match="power cut"):
        main(args)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no checkpoint, no staging left
    capsys.readouterr()
    monkeypatch.undo()
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"tigon sft: error: {out} holds what is left of a run stopped before its first checkpoint "
        "(metrics.jsonl): pass --resume to start it again from step 0 (or --overwrite), or choose another "
        "--output-dir\n")
    caplog.set_level(logging.INFO)
    assert main([*args, "--resume"]) == 0
    assert f"--resume: no checkpoint in {out} yet (the run there stopped before its first one)" in caplog.text
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert (out / "checkpoint-2").is_dir() and (out / "final").is_dir()


@pytest.mark.parametrize("how", ["ENOSPC", "torch.save"])
def test_full_disk_is_one_line_and_gives_the_space_back(tmp_path, monkeypatch, capsys, how):
    """The optimizer state fails to save on a full disk: as an OSError(ENOSPC), or as torch.save
    reports it, a RuntimeError that names no cause (on a disk with no space left)."""
    from transformers import Trainer

    from tigon.train import checkpoint

    def full(self, output_dir):
        (Path(output_dir) / "optimizer.pt").write_bytes(b"half")
        if how == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.pt"))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", full)
    monkeypatch.setattr(checkpoint, "_NEARLY_FULL", 2**62)  # any disk counts as full
    out = tmp_path / "run"
    assert main(["sft", *SHORT, "--max-steps", "2", "--save-steps", "1", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"\ntigon sft: error: {out / 'checkpoint-1'}: no space left on device; the partial save "
                        "was removed (free some space, or write elsewhere)\n")  # after the progress bar's line
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_resuming_the_builtin_model_on_other_data_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    sft("--max-steps", "1", "--save-steps", "1", "--output-dir", str(out))
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["sft", *SHORT, "--dataset", f"{tiny.BUNDLED_DATASET}#30", "--max-steps", "2", "--save-steps", "1",
                 "--output-dir", str(out), "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"tigon sft: error: --resume {out / 'checkpoint-1'}: the built-in model's tokenizer is trained on the data, "
        "and this --dataset gives another one than the run being resumed: resume with the same --dataset (and "
        "--seed), or start a new run (--overwrite, or another --output-dir)\n")
    assert (out / "metrics.jsonl").read_text() == metrics and not (out / "checkpoint-2").exists()


@pytest.fixture
def bad_row_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    return path


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "missing.jsonl"], "dataset file not found: missing.jsonl"),
    (["--dataset", "{tmp}/bad.jsonl"], "{tmp}/bad.jsonl line 2: no assistant message with content"),
    (["--dataset", "{tmp}/odd.jsonl"], "{tmp}/odd.jsonl line 1: unknown data format"),
    (["--model", "./no/such/model"], "model not found: ./no/such/model"),
    (["--model", "{tmp}/odd.jsonl"], "{tmp}/odd.jsonl: a file, not a model directory (a model directory holds "
                                     "config.json, the weights"),
    (["--model", "{tmp}"], "{tmp}: no tokenizer_config.json or tokenizer.json in this directory: not a model "
                           "directory (a model directory holds config.json"),
    (["--eval-split", "0.1", "--eval-dataset", "e.jsonl"], "--eval-split and --eval-dataset are incompatible"),
    (["--kernels-off", "warp_drive"], "--kernels-off: unknown kernel"),
    (["--tuner", "full", "--lora-rank", "4"], "--lora-rank: only for --tuner lora"),
    (["--output-dir", "{tmp}/odd.jsonl"], "--output-dir {tmp}/odd.jsonl: is a file, not a directory; choose another"),
    (["--dataset", "{tmp}/latin1.csv"], "{tmp}/latin1.csv: not UTF-8 text at byte 22 (line 2): save it as UTF-8"),
    (["--resume", "{tmp}/odd.jsonl"], "--resume {tmp}/odd.jsonl: not a checkpoint directory"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, bad_row_file, argv, message):
    (tmp_path / "odd.jsonl").write_text(json.dumps({"prompt": "p"}) + "\n")
    (tmp_path / "latin1.csv").write_bytes("instruction,output\nCafé?,Oui\n".encode("latin-1"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["sft", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tigon sft: error: {message.format(tmp=tmp_path)}")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_used_output_dir_is_refused_and_debug_shows_the_traceback(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    assert main(["sft", *SHORT, "--output-dir", str(out)]) == 2
    assert f"{out} holds an unfinished run (newest checkpoint: checkpoint-3): pass --resume to continue it, " \
           "--overwrite to replace it" in capsys.readouterr().err
    (out / "final").mkdir()
    assert main(["sft", *SHORT, "--output-dir", str(out)]) == 2
    assert f"{out} already holds a finished run (final/): pass --overwrite" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    with pytest.raises(ValueError, match="dataset file not found"):
        main(["sft", "--debug", "--dataset", "missing.jsonl"])
    assert main(["merge", str(out), "--output", str(tmp_path / "m")]) == 2
    assert "is not a LoRA adapter directory" in capsys.readouterr().err


def _saved_llama(path: Path, **shape) -> str:
    """A random Llama of `shape` (2 KV heads, a 32003-token vocabulary) with the bundled data's
    tokenizer, saved to `path`; returns the path for --model."""
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    tiny.build_model(tokenizer, 0, num_key_value_heads=2, vocab_size=32003, **shape).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.gpu
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_gpu_bf16_kernels_train_like_eager(tmp_path, tuner):
    """On the GPU, in bf16, the compiled kernels take the same steps as plain transformers (bf16
    tolerance), with packing, on a Llama big enough for the kernels' tiling to matter."""
    model = _saved_llama(tmp_path / "m", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8)
    args = ["--model", model, "--tuner", tuner, "--dtype", "bf16", "--lr", "1e-3", "--packing",
            "--max-length", "512", "--batch-size", "4", "--max-steps", "8", "--save-steps", "0", "--samples", "1",
            "--dataset", str(tiny.BUNDLED_DATASET)]
    assert main(["sft", *args, "--output-dir", str(tmp_path / "off"), "--no-kernels"]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "on")]) == 0
    off, on = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(off) == sorted(on) == list(range(1, 9))
    for step in off:
        assert on[step] == pytest.approx(off[step], rel=3e-2), step
    records = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["gpu_mem_gib"] > 0 and r["mfu"] > 0 for r in records if "loss" in r)


@pytest.mark.gpu
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_gpu_cuda_graphs_train_like_without(tmp_path, caplog, tuner):
    """--cuda-graphs (each micro-step replayed from a CUDA graph, batches padded to --max-length,
    unmasked) takes the same steps as the same run without it, with gradient accumulation;
    the metrics say how busy the GPU was where NVML can be read."""
    model = _saved_llama(tmp_path / "m", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4)
    args = ["--model", model, "--tuner", tuner, "--dtype", "bf16", "--lr", "1e-3", "--packing",
            "--max-length", "256", "--batch-size", "2", "--grad-accum", "2", "--max-steps", "6", "--save-steps", "0",
            "--samples", "0", "--dataset", str(tiny.BUNDLED_DATASET)]
    assert main(["sft", *args, "--output-dir", str(tmp_path / "plain")]) == 0
    assert main(["sft", *args, "--output-dir", str(tmp_path / "graphs"), "--cuda-graphs"]) == 0
    assert not [r for r in caplog.records if "cannot be captured" in r.getMessage()]  # it replayed
    plain, graphs = losses(tmp_path / "plain"), losses(tmp_path / "graphs")
    assert sorted(plain) == sorted(graphs) == list(range(1, 7))
    for step in plain:
        # the plain run pads each batch to its longest row, the graphed one to --max-length: the
        # same tokens are trained on, padding never attends or counts
        assert graphs[step] == pytest.approx(plain[step], rel=2e-2), step
    records = [json.loads(line) for line in (tmp_path / "graphs" / "metrics.jsonl").read_text().splitlines()]
    busy = [r["gpu_busy_pct"] for r in records if "gpu_busy_pct" in r]
    assert all(0 <= b <= 100 for b in busy)  # a log window shorter than the meter's 0.2 s may have none


@pytest.mark.gpu
def test_gpu_cuda_graphs_ctrl_c_and_resume_end_like_the_uninterrupted_run(tmp_path, caplog):
    """--cuda-graphs (micro-steps, clipping and AdamW's update replayed): Ctrl-C during step 3
    saves a checkpoint, and --resume, which loads the optimizer's state into fresh graphs, ends
    where the run that was never interrupted ended."""
    model = _saved_llama(tmp_path / "m", hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4)
    args = ["sft", "--model", model, "--tuner", "lora", "--dtype", "bf16", "--lr", "1e-3", "--packing",
            "--max-length", "256", "--batch-size", "2", "--max-steps", "6", "--save-steps", "0", "--samples", "0",
            "--dataset", str(tiny.BUNDLED_DATASET), "--cuda-graphs"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main([*args, "--output-dir", str(full)]) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tigon.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CTRL_C_IN_STEP_3, *args, "--output-dir", str(cut)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert "cannot be captured" not in proc.stderr and (cut / "checkpoint-3").is_dir()
    assert main([*args, "--output-dir", str(cut), "--resume"]) == 0
    assert not [r for r in caplog.records if "cannot be captured" in r.getMessage()]  # every run replayed
    assert sorted(losses(cut)) == sorted(losses(full)) == list(range(1, 7))
    for step, loss in losses(full).items():
        assert losses(cut)[step] == pytest.approx(loss, rel=1e-3), step
    a, b = (load_file(d / "final" / "adapter_model.safetensors") for d in (full, cut))
    assert a.keys() == b.keys()
    for key in a:  # a resume with a fresh optimizer state moves the adapter by about the learning rate
        torch.testing.assert_close(b[key], a[key], rtol=1e-2, atol=1e-4)


def test_samples_are_skipped_when_the_model_will_be_sharded(monkeypatch):
    from types import SimpleNamespace

    from tigon.train.run import _sharded

    plain = SimpleNamespace(fsdp="", deepspeed=None)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert not _sharded(plain)
    assert _sharded(SimpleNamespace(fsdp="full_shard", deepspeed=None))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert _sharded(plain)


@pytest.mark.gpu
def test_gpu_steps_never_wait_for_the_device(tmp_path, monkeypatch):
    """Between logs, nothing in a `tigon sft` step (token counting, the loss's NaN check, the next
    batch's copy, the patched model) reads the GPU back, so the host runs ahead of it. Rows longer
    than --max-length: every batch is unpadded, as in the benchmark."""
    from transformers import TrainerCallback

    from tigon.train import run

    rows = load_samples([str(tiny.BUNDLED_DATASET)], seed=0)
    tokenizer = tiny.build_tokenizer(rows)
    tiny.build_model(tokenizer, 0, hidden_size=256, intermediate_size=704, num_hidden_layers=2).save_pretrained(
        tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    words = " ".join(m["content"] for s in rows for m in s.messages).split()
    rng = random.Random(0)
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=400))}) + "\n"
                                                 for _ in range(64)))

    class StrictSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:  # after the warm-up steps (compilation, first allocations)
                torch.cuda.set_sync_debug_mode("error")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == args.max_steps:  # before the final log reads the loss
                torch.cuda.set_sync_debug_mode("default")

    class Trainer(run.TigonTrainer):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[*callbacks, StrictSteps()], **kwargs)

    monkeypatch.setattr(run, "TigonTrainer", Trainer)
    try:
        for tuner in ("full", "lora"):
            assert main(["sft", "--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "text.jsonl"),
                         "--tuner", tuner, "--dtype", "bf16", "--max-length", "128", "--batch-size", "4",
                         "--max-steps", "6", "--logging-steps", "100", "--save-steps", "0", "--samples", "0",
                         "--output-dir", str(tmp_path / tuner)]) == 0
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_lora_on_a_loaded_model_trains_every_module_in_training_mode(tmp_path, monkeypatch):
    """from_pretrained returns a model in eval mode and PEFT wraps it in a root in training mode:
    the first step must still switch every module (dropout, the fused loss's training path)."""
    from transformers import TrainerCallback

    from tigon.train import run

    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))
    tiny.build_model(tokenizer, 0, hidden_size=64, intermediate_size=128, num_hidden_layers=2).save_pretrained(
        tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    modes = []

    class Modes(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            modes.append(all(m.training for m in model.modules()))

    class Trainer(run.TigonTrainer):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[*callbacks, Modes()], **kwargs)

    monkeypatch.setattr(run, "TigonTrainer", Trainer)
    sft("--model", str(tmp_path / "m"), "--tuner", "lora", "--max-steps", "3", "--save-steps", "0",
        "--output-dir", str(tmp_path / "out"))
    assert modes == [True, True, True]


def test_progress_bar_shows_each_steps_own_figures(tmp_path, capsys):
    """The bar's frame at step 2 carries step 2's loss (the Trainer logs after the bar advanced)."""
    out = tmp_path / "out"
    sft("--max-steps", "3", "--save-steps", "0", "--output-dir", str(out))
    frames = capsys.readouterr().err.replace("\n", "\r").split("\r")
    at_step_2 = [f for f in frames if "| 2/3 [" in f]
    assert at_step_2 and any(f"loss {losses(out)[2]:.4f}" in f for f in at_step_2), at_step_2


def test_gradient_checkpointing_prints_no_library_deprecation(tmp_path, recwarn):
    """Newer transformers renamed gradient checkpointing; tigon (and PEFT, TRL) call the old names
    the GPU images' transformers knows: no notice of that reaches a user."""
    sft("--max-steps", "2", "--save-steps", "0", "--gradient-checkpointing", "--output-dir", str(tmp_path / "o"))
    assert not [str(w.message) for w in recwarn if "deprecated" in str(w.message)]
