"""tigon.webui.runs without a server: the command a run's settings make, the methods offered,
what "more options" and the path fields take, and what is read back from a run's directory."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tigon.train.config import METHODS
from tigon.webui.runs import (FINISHED, INCOMPLETE, RunStore, TrainSettings, WebUIError, available_methods,
                              read_records)


@pytest.fixture
def store(tmp_path):
    return RunStore(tmp_path / "runs")


def test_command_for_the_builtin_default_is_the_shortest(store):
    assert store.command_arguments(TrainSettings(), store.root / "r") == [
        "sft", "--tuner", "full", "--output-dir", str(store.root / "r")]


def test_command_carries_every_field(store):
    (store.root / "uploads").mkdir(parents=True)
    for name in ("a.jsonl", "uploads/b c.csv"):
        (store.root / name).write_text("x\n")
    settings = TrainSettings(model="org/model", dataset="a.jsonl 'uploads/b c.csv#5'", tuner="lora", lora_rank=8,
                             lora_alpha=24.0, lr=1e-4, max_steps=30, max_length=512, save_steps=10, packing=True,
                             kernels=False, extra="--batch-size 2 --kernels-off rope")
    assert store.command_arguments(settings, store.root / "r") == [
        "sft", "--model", "org/model", "--dataset", str(store.root / "a.jsonl"),
        str(store.root / "uploads/b c.csv") + "#5",
        "--tuner", "lora", "--lora-rank", "8", "--lora-alpha", "24", "--lr", "0.0001", "--max-steps", "30",
        "--max-length", "512", "--save-steps", "10", "--packing", "--no-kernels", "--batch-size", "2",
        "--kernels-off", "rope", "--output-dir", str(store.root / "r")]


def test_lora_options_are_left_out_of_a_full_run(store):
    """`tigon sft` refuses --lora-rank with --tuner full; the form keeps its LoRA fields filled."""
    args = store.command_arguments(TrainSettings(tuner="full", lora_rank=8, lora_alpha=16.0), store.root)
    assert "--lora-rank" not in args and "--lora-alpha" not in args


def test_preference_methods_run_tigon_rlhf(store):
    args = store.command_arguments(TrainSettings(method="dpo", model="org/m", tuner="lora"), store.root)
    assert args[:3] == ["rlhf", "--method", "dpo"] and args[3:5] == ["--model", "org/m"]
    with pytest.raises(WebUIError, match="method 'evil': this tigon offers sft, classification, embed, dpo"):
        store.command_arguments(TrainSettings(method="evil"), store.root)


@pytest.mark.parametrize("method, command", [
    ("classification", ["sft", "--task", "classification"]), ("embed", ["embed"]), ("rm", ["rlhf", "--method", "rm"]),
    ("ppo", ["rlhf", "--method", "ppo"]), ("rloo", ["rlhf", "--method", "rloo"]),
])
def test_the_other_tasks_start_their_embedded_defaults(store, method, command):
    """Reward models, classifiers (and rerankers), embedders, PPO and RLOO start from the form with
    nothing filled in: their command's embedded default (built-in model, bundled data)."""
    out = store.root / "r"
    assert store.command_arguments(TrainSettings(method=method), out) == [*command, "--tuner", "full", "--output-dir",
                                                                          str(out)]


def test_the_other_tasks_take_their_own_options(store):
    args = store.command_arguments(TrainSettings(method="embed", extra="--pooling last --temperature 0.1 "
                                                 "--matryoshka-dims 8,16 --symmetric"), store.root)
    assert args[args.index("--pooling"):-2] == ["--pooling", "last", "--temperature", "0.1", "--matryoshka-dims",
                                                "8,16", "--symmetric"]
    args = store.command_arguments(TrainSettings(method="classification", extra="--labels no,yes"), store.root)
    assert args[args.index("--labels"):-2] == ["--labels", "no,yes"]
    with pytest.raises(WebUIError, match="--task: set it in the form's field \"method\""):
        store.command_arguments(TrainSettings(extra="--task classification"), store.root)
    with pytest.raises(WebUIError, match="packing: `tigon embed` packs no rows"):
        store.command_arguments(TrainSettings(method="embed", packing=True), store.root)
    with pytest.raises(WebUIError, match="--pooling"):  # embed's option, not sft's
        store.command_arguments(TrainSettings(method="classification", extra="--pooling last"), store.root)


def test_methods_come_from_the_train_config_without_the_command_line():
    assert available_methods() == ["sft", "classification", "embed", *METHODS]  # TRL is installed here
    # The UI reads them from tigon.train.config: it imports neither the whole command line
    # (tigon.cli imports tigon.webui: a circle) nor a parser's internals.
    code = "import sys, tigon.webui.runs; print(sorted(m for m in sys.modules if m.startswith('tigon.cli')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unparseable_options_are_one_line(store):
    with pytest.raises(WebUIError, match="more options: No closing quotation"):
        store.command_arguments(TrainSettings(extra="--epochs 'x"), store.root)


@pytest.mark.parametrize("extra, refused", [
    ("--reward-funcs x.py:f", "--reward-funcs x.py:f: the web UI takes only the built-in rewards"),
    ("--reward-funcs builtin:format,x.py:f", "--reward-funcs x.py:f: the web UI takes only the built-in"),
    ("--reward-funcs builtin:format /tmp/x.py:f", "--reward-funcs /tmp/x.py:f: the web UI takes only"),
    ("--output-dir /tmp/x", "--output-dir: the run's folder, RUNS/NAME, is the UI's"),
    ("--output-dir=/tmp/x", "--output-dir: the run's folder"),
    ("--out /tmp/x", "unrecognized arguments: --out /tmp/x"),  # no abbreviations
    ("--model /etc", "--model: set it in the form's field \"model\""),
    ("--dataset ../../secret.jsonl", "--dataset: set it in the form's field \"dataset\""),
    ("--eval-dataset ../../secret.jsonl", "--eval-dataset '../../secret.jsonl': outside the runs folder"),
    ("--eval-dataset /etc/passwd", "--eval-dataset '/etc/passwd': outside the runs folder"),
    ("--teacher /etc", "--teacher '/etc': not a model directory in the runs folder"),
    ("--reward-model /etc", "--reward-model '/etc': not a model directory in the runs folder"),
    ("--config /tmp/settings.yaml", "--config: a settings file; not taken from the web UI"),
    ("--resume /tmp/ckpt", "--resume: the UI starts new runs"),
    ("--overwrite", "--overwrite: the UI starts new runs in new folders"),
    ("--method grpo", "--method: set it in the form's field \"method\""),
    ("@/etc/passwd", "unrecognized arguments: @/etc/passwd"),
    ("-h", "unrecognized arguments: -h"),
    ("--lr nan", "--lr: set it in the form's field"),
    ("--warmup nan", "--warmup: nan is not a number"),
])
def test_more_options_cannot_name_code_or_files_outside(store, extra, refused):
    with pytest.raises(WebUIError) as err:
        store.command_arguments(TrainSettings(method="grpo", extra=extra), store.root / "r")
    assert refused in str(err.value) and "\n" not in str(err.value)


def test_numbers_and_export_settings_are_checked_before_any_command(store):
    with pytest.raises(WebUIError, match="--lr: nan is not a number"):
        store.command_arguments(TrainSettings(lr=float("nan")), store.root / "r")
    (store.root / "run" / "final").mkdir(parents=True)
    with pytest.raises(WebUIError, match="export dtype '--output=/tmp/x': expected one of auto, bf16"):
        store.export("run/final", "merged", "--output=/tmp/x")
    with pytest.raises(WebUIError, match="export to 'safetensors': expected merged or gguf"):
        store.export("run/final", "safetensors")


def test_more_options_are_passed_as_parsed(store):
    (store.root / "uploads").mkdir(parents=True)
    (store.root / "uploads" / "ev.jsonl").write_text("x\n")
    extra = ("--reward-funcs builtin:exact_answer,builtin:length --format-regex=-x --eval-dataset uploads/ev.jsonl#3 "
             "--no-gradient-checkpointing --dtype fp32 --warmup 0.125 --kernels-off rope,swiglu")
    args = store.command_arguments(TrainSettings(method="grpo", extra=extra), store.root / "r")
    assert args[args.index("--tuner") + 2:-2] == [
        "--reward-funcs", "builtin:exact_answer,builtin:length", "--format-regex=-x",
        "--eval-dataset", str(store.root / "uploads/ev.jsonl") + "#3", "--no-gradient-checkpointing",
        "--dtype", "fp32", "--warmup", "0.125", "--kernels-off", "rope,swiglu"]


def test_paths_are_resolved_inside_the_runs_folder(store, tmp_path):
    outside = tmp_path / "outside"
    (outside / "final").mkdir(parents=True)
    (outside / "secret.jsonl").write_text("{}\n")
    (outside / "final" / "config.json").write_text("{}")
    (store.root / "run" / "final").mkdir(parents=True)
    (store.root / "uploads").mkdir()
    (store.root / "link").symlink_to(outside)
    (store.root / "run" / "data.jsonl").symlink_to(outside / "secret.jsonl")
    for text in ("../outside/secret.jsonl", str(outside / "secret.jsonl"), "run/../../outside/secret.jsonl",
                 "link/secret.jsonl", "run/data.jsonl"):
        with pytest.raises(WebUIError, match="outside the runs folder"):
            store.data_files(text)
    with pytest.raises(WebUIError, match="not a data file"):
        store.data_files("run/tigon-webui.log")
    for text in ("../outside/final", str(outside / "final"), "run/../../outside/final", "link/final", "/etc", ".",
                 "uploads"):
        with pytest.raises(WebUIError):
            store.model_dir(text)
        with pytest.raises(WebUIError, match="nor a hub id|outside"):
            store.model_source(text)
    assert store.model_dir("run/final") == store.model_dir(str(store.root / "run/final")) == store.root / "run/final"
    assert store.model_source("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    # a run folder that links out is no run
    with pytest.raises(WebUIError, match="run 'link': outside the runs folder"):
        store.run_dir("link")
    assert "link" not in store.names()
    with pytest.raises(WebUIError, match="outside the runs folder"):
        store.export(str(store.root / "run/../../outside/final"), "merged")
    assert sorted(p.name for p in outside.iterdir()) == ["final", "secret.jsonl"]  # nothing written next to it


def test_uploads_keep_their_data_type_and_never_overwrite(store, tmp_path):
    source = tmp_path / "my data (1).jsonl"
    source.write_text("a\n")
    assert store.keep_upload(source) == "uploads/my_data__1_.jsonl"
    source.write_text("b\n")
    assert store.keep_upload(source) == "uploads/my_data__1_-2.jsonl"
    assert (store.root / "uploads/my_data__1_.jsonl").read_text() == "a\n"
    (tmp_path / "evil.py").write_text("import os\n")
    with pytest.raises(WebUIError, match="upload 'evil.py': not a data file"):
        store.keep_upload(tmp_path / "evil.py")


def test_a_start_beyond_max_running_is_refused(tmp_path):
    store = RunStore(tmp_path, max_running=1)
    name = store.start(TrainSettings(max_steps=100_000))  # a real `tigon sft` process
    try:
        with pytest.raises(WebUIError, match=r"already 1 run\(s\) going, .* \(tigon webui --max-running 1\)"):
            store.start(TrainSettings(name="second"))
        assert store.names() == [name]
    finally:
        os.kill(store._record(name)["pid"], signal.SIGKILL)
        store.wait(name, 30)


def test_metrics_being_appended_are_read_up_to_the_last_complete_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n" + '{"step": 2, "lo')
    assert read_records(tmp_path) == [{"step": 1, "loss": 2.5}]


def test_runs_from_the_command_line_are_listed(tmp_path):
    """A directory `tigon sft` wrote without the UI: finished when it has final/, else incomplete
    (nothing on disk says whether it crashed, was stopped or runs elsewhere)."""
    for name, files in (("done", ["final/config.json", "metrics.jsonl"]), ("cut", ["checkpoint-5/x"]),
                        ("other", ["notes.txt"])):
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text(json.dumps({"step": 3, "loss": 1.25}) + "\n")
    store = RunStore(tmp_path)
    assert sorted(store.names()) == ["cut", "done"]
    done, cut = store.info("done"), store.info("cut")
    assert (done.status, done.final_loss, done.step) == (FINISHED, 1.25, 3)
    assert (cut.status, cut.checkpoint) == (INCOMPLETE, "checkpoint-5")
    assert [label for label, _ in store.model_paths()] == ["done/final", "cut/checkpoint-5"]
    with pytest.raises(WebUIError, match="run name '../x'"):
        store.info("../x")


def test_a_damaged_final_is_no_finished_run_and_a_cut_record_no_crash(tmp_path):
    """final/ published by tigon (with its manifest) and then cut: the run is not finished and its
    model is not offered; the UI's own run record, cut anywhere, leaves the run listed."""
    from tigon.train.checkpoint import publish

    staging = tmp_path / "run" / ".tmp-final"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"x" * 100)
    publish(staging, tmp_path / "run" / "final")
    store = RunStore(tmp_path)
    assert store.info("run").status == FINISHED and [p for p, _ in store.model_paths()] == ["run/final"]
    (tmp_path / "run" / "final" / "model.safetensors").write_bytes(b"x" * 50)
    assert store.info("run").status == INCOMPLETE and store.model_paths() == []
    store._update("run", command="tigon sft", exit_code=0)
    record = tmp_path / "run" / "tigon-webui.json"
    whole = record.read_bytes()
    assert json.loads(whole)["exit_code"] == 0 and not list(record.parent.glob(".tmp-*"))
    for cut in (0, 1, len(whole) // 2, len(whole) - 1):
        record.write_bytes(whole[:cut])
        assert store.names() == ["run"] and store.info("run").status == INCOMPLETE


def test_runs_started_by_the_ui_read_media_only_from_its_folder(tmp_path):
    """The UI's child processes get the runs folder as the one folder their data files' images and
    video frames may come from (`tigon.train.vision_data.confined`)."""
    from tigon.train.vision_data import MEDIA_ROOT_ENV
    from tigon.webui.runs import _child_env

    assert _child_env(tmp_path)[MEDIA_ROOT_ENV] == str(tmp_path)
