"""The progress bar and metrics.jsonl of a run (tigon.train.callbacks.Reporter)."""

import json
from types import SimpleNamespace

from tigon.train.callbacks import Reporter


def test_a_step_without_a_metric_value_is_logged_not_a_crash(tmp_path):
    """A GRPO step whose rows were all unscored logs its reward as None: the bar and the summary
    skip it, metrics.jsonl keeps it, and the next step's value is shown."""
    reporter = Reporter(tmp_path, 1.0, 1.0, 1, command="rlhf", metrics={"reward": "reward"})
    reporter.on_train_begin(None, SimpleNamespace(is_world_process_zero=True, max_steps=2, global_step=0,
                                                  num_input_tokens_seen=0), None)
    for step, reward in ((1, None), (2, 0.5)):
        state = SimpleNamespace(is_world_process_zero=True, global_step=step, epoch=0.0, num_input_tokens_seen=8 * step)
        reporter.on_log(None, state, None, logs={"loss": 1.0, "learning_rate": 1e-3, "reward": reward})
    assert "reward 0.500" in reporter.postfix
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in records] == [None, 0.5] and reporter.series["reward"] == [0.5]
    eval_state = SimpleNamespace(is_world_process_zero=True, global_step=2, epoch=0.0, num_input_tokens_seen=16)
    reporter.on_log(None, eval_state, None, logs={"eval_loss": 1.0, "eval_reward": None})
    reporter.close()
