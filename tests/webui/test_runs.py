"""tigon.webui.runs without a server: the command a run's settings make, the methods offered,
and what is read back from a run's directory."""

import argparse
import json

import pytest

from tigon.cli import build_parser
from tigon.webui.runs import (FINISHED, INCOMPLETE, RunStore, TrainSettings, WebUIError, available_methods,
                              command_arguments, read_records)


def test_command_for_the_builtin_default_is_the_shortest(tmp_path):
    assert command_arguments(TrainSettings(), tmp_path / "r", ["sft"]) == [
        "sft", "--tuner", "full", "--output-dir", str(tmp_path / "r")]


def test_command_carries_every_field(tmp_path):
    settings = TrainSettings(model="./m", dataset="a.jsonl 'b c.csv#5'", tuner="lora", lora_rank=8, lora_alpha=24.0,
                             lr=1e-4, max_steps=30, max_length=512, save_steps=10, packing=True, kernels=False,
                             extra="--batch-size 2 --kernels-off rope")
    assert command_arguments(settings, tmp_path, ["sft"]) == [
        "sft", "--model", "./m", "--dataset", "a.jsonl", "b c.csv#5", "--tuner", "lora", "--lora-rank", "8",
        "--lora-alpha", "24", "--lr", "0.0001", "--max-steps", "30", "--max-length", "512", "--save-steps", "10",
        "--packing", "--no-kernels", "--batch-size", "2", "--kernels-off", "rope", "--output-dir", str(tmp_path)]


def test_lora_options_are_left_out_of_a_full_run(tmp_path):
    """`tigon sft` refuses --lora-rank with --tuner full; the form keeps its LoRA fields filled."""
    args = command_arguments(TrainSettings(tuner="full", lora_rank=8, lora_alpha=16.0), tmp_path, ["sft"])
    assert "--lora-rank" not in args and "--lora-alpha" not in args


def test_preference_methods_run_tigon_rlhf(tmp_path):
    args = command_arguments(TrainSettings(method="dpo", model="./m", tuner="lora"), tmp_path, ["sft", "dpo"])
    assert args[:3] == ["rlhf", "--method", "dpo"] and args[3:5] == ["--model", "./m"]
    with pytest.raises(WebUIError, match="method 'dpo': this tigon offers sft"):
        command_arguments(TrainSettings(method="dpo"), tmp_path, ["sft"])


def _parser(rlhf_methods=None):
    parser = argparse.ArgumentParser(prog="tigon")
    sub = parser.add_subparsers()
    sub.add_parser("sft")
    if rlhf_methods is not None:
        sub.add_parser("rlhf").add_argument("--method", choices=rlhf_methods)
    return parser


def test_methods_come_from_the_command_line_parser():
    assert available_methods(_parser()) == ["sft"]
    assert available_methods(_parser(["dpo", "orpo", "kto"])) == ["sft", "dpo", "orpo", "kto"]
    commands = next(a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert (available_methods() != ["sft"]) == ("rlhf" in commands)  # this tree's own tigon


def test_unparseable_options_are_one_line(tmp_path):
    with pytest.raises(WebUIError, match="dataset / more options: No closing quotation"):
        command_arguments(TrainSettings(extra="--model 'x"), tmp_path, ["sft"])


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
