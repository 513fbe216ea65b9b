"""The end-to-end benchmark's pipeline on a tiny Llama on CPU (its numbers mean nothing here)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import tigon
from tigon.bench.e2e import run_e2e

TINY = dict(
    hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1000, tie_word_embeddings=True,
)


def test_e2e_runs_both_modes_and_reports_matching_losses(tmp_path):
    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb  # (a module, not a function, where `kernels` is installed)
    lines = []
    records = run_e2e(
        batch=1, seq=8, steps=2, warmup=1, shape=TINY, device=torch.device("cpu"), out_dir=tmp_path, log=lines.append
    )
    assert [(r["mode"], r["impl"]) for r in records] == [
        ("full", "eager"), ("full", "tigon"), ("lora", "eager"), ("lora", "tigon"),
    ]
    assert not [r["error"] for r in records if "error" in r]
    for record in records:
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == 3
        assert record["max_loss_diff"] < 0.02, "bf16 runs of the same model and data"
    assert "lora" in records[-1]["applied"]
    assert json.loads((tmp_path / "e2e.json").read_text())["results"][0]["impl"] == "eager"
    # Every patch is undone after its run.
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    tigon.unpatch()


def test_e2e_cadences_train_alike():
    """Synchronising around each step changes what is timed, not what is trained."""
    runs = [
        run_e2e(modes=["full"], impls=["tigon"], batch=1, seq=8, steps=2, warmup=1, shape=TINY,
                device=torch.device("cpu"), sync_steps=sync, log=lambda line: None)[0]
        for sync in (False, True)
    ]
    for record in runs:
        assert "error" not in record, record.get("error")
        assert record["tokens_per_s"] > 0 and len(record["losses"]) == 3
    assert runs[0]["losses"] == runs[1]["losses"]


def test_busy_reading_skips_the_warm_up_and_spans_the_minimum_time(monkeypatch):
    """Where GPU busy is read, its window opens at the first timed step and again BUSY_SETTLE_S
    later (NVML's samples reach back into the warm-up), and the timed steps go on past their
    number until they span BUSY_MIN_TIMED_S (a clock that each step moves by 20 ms)."""
    from types import SimpleNamespace

    import tigon.bench.e2e as e2e

    now = [0.0]
    monkeypatch.setattr(e2e, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(e2e, "BUSY_SETTLE_S", 0.05)
    monkeypatch.setattr(e2e, "BUSY_MIN_TIMED_S", 0.19)
    model = e2e.build_model("full", 8, torch.device("cpu"), shape=TINY, lora_rank=4, checkpointing=False)
    forward_backward = e2e.micro_step(model)
    opened = []

    class Meter:
        def window(self):
            opened.append(now[0])

    def step(ids):
        now[0] += 0.02
        return forward_backward(ids)

    times, losses = e2e.timed_steps(model, step, TINY["vocab_size"], 1, 8, 2, 3, busy=Meter())
    assert times == pytest.approx([0.02] * 10) and len(losses) == 12  # 2 warm-up steps, then 0.19 s or more
    assert opened == pytest.approx([0.04, 0.1])  # at the first timed step, and 0.06 s of steps later
    plain_times, plain_losses = e2e.timed_steps(model, step, TINY["vocab_size"], 1, 8, 2, 3)
    assert len(plain_times) == 3 and len(plain_losses) == 5  # no meter: the steps asked for


def test_bench_e2e_runs_each_shape_given(tmp_path, monkeypatch, capsys):
    import tigon.bench.e2e as e2e
    from tigon.cli import main

    calls = []
    monkeypatch.setattr(e2e, "run_e2e", lambda **kw: calls.append(kw) or [{"mode": "full"}])
    assert main(["bench", "--e2e", "1x1024", "4x2048", "--e2e-impls", "tigon", "tigon+graphs", "--out", str(tmp_path)]) == 0
    assert [(c["batch"], c["seq"], c["impls"], c["out_dir"].name, c["steps"]) for c in calls] == [
        (1, 1024, ["tigon", "tigon+graphs"], "1x1024", 80), (4, 2048, ["tigon", "tigon+graphs"], "4x2048", 10)]
    calls.clear()
    assert main(["bench", "--e2e"]) == 0
    assert [(c["batch"], c["seq"], c["impls"], c["out_dir"], c["steps"]) for c in calls] == [
        (4, 2048, ["eager", "tigon"], None, 10)]
    assert main(["bench", "--e2e", "1x1024x3"]) == 2
    assert "--e2e takes batch x tokens shapes such as 1x1024, got 1x1024x3" in capsys.readouterr().err


def test_bench_e2e_impls_are_the_benchmarks_own():
    """`tigon bench --e2e-impls` offers every implementation the benchmark has, and no other."""
    from tigon.bench.e2e import IMPLS
    from tigon.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    (impls,) = [action for action in bench._actions if action.dest == "e2e_impls"]
    assert sorted(impls.choices) == sorted(IMPLS)


@pytest.mark.gpu
def test_gpu_e2e_graph_replay_trains_like_plain_and_reports_busy():
    """tigon+graphs (the patched model's micro-steps and AdamW's update replayed from CUDA graphs)
    takes the same steps as tigon, over every step both ran (with NVML the timed steps go on for
    seconds, the replayed ones many more), and the GPU busy reading is a percentage."""
    shape = dict(TINY, hidden_size=256, intermediate_size=688, vocab_size=32000)
    records = run_e2e(modes=["full", "lora"], impls=["tigon", "tigon+graphs"], batch=1, seq=256, steps=3, warmup=3,
                      shape=shape, log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    by = {(r["mode"], r["impl"]): r for r in records}
    for mode in ("full", "lora"):
        plain, graphs = by[(mode, "tigon")]["losses"], by[(mode, "tigon+graphs")]["losses"]
        both = min(len(plain), len(graphs))
        assert both >= 6 and graphs[:both] == pytest.approx(plain[:both], rel=2e-2)
    assert all(0 <= r["gpu_busy_pct"] <= 100 for r in records if "gpu_busy_pct" in r)


def test_rounds_take_turns_and_rows_report_median_spread_and_max_peak():
    """Round r starts r places along the implementations; a row is the median tok/s of its rounds,
    their spread and the largest peak; a round that failed is noted and the others still count; a
    skipped implementation is not run again."""
    from tigon.bench.e2e import run_all

    calls = []
    speeds = {"eager": [100.0, 120.0, 110.0], "tigon": [200.0, None, 260.0]}

    def run_one(mode, impl, device):
        calls.append(impl)
        record = {"mode": mode, "impl": impl, "batch": 1, "seq": 8}
        if impl == "peer":
            return {**record, "skipped": "peer cannot be imported here (liger_kernel)"}
        speed = speeds[impl][sum(c == impl for c in calls) - 1]
        if speed is None:
            return {**record, "error": "OutOfMemoryError: CUDA out of memory"}
        return {**record, "tokens_per_s": speed, "step_ms": 8e3 / speed, "peak_gib": speed / 100, "losses": [5.0, 4.0]}

    lines = []
    records = run_all("test", "the test", ["lora"], ["eager", "tigon", "peer"], (["lora"], ["eager", "tigon", "peer"]),
                      run_one, settings={}, summary="", out_dir=None, out_name="", log=lines.append, device=torch.device("cpu"),
                      rounds=3)
    assert calls == ["eager", "tigon", "peer", "tigon", "eager", "eager", "tigon"]
    eager, tigon_row, peer = records
    assert eager["tokens_per_s"] == 110.0 and eager["tokens_per_s_rounds"] == [100.0, 120.0, 110.0]
    assert eager["spread_pct"] == pytest.approx(100 * 20 / 110) and eager["peak_gib"] == 1.2 and eager["rounds"] == 3
    assert tigon_row["tokens_per_s"] == 230.0 and tigon_row["peak_gib"] == 2.6 and "error" not in tigon_row
    assert tigon_row["failed_rounds"] == ["OutOfMemoryError: CUDA out of memory"]
    assert tigon_row["vs_eager_speed"] == pytest.approx(230 / 110)
    assert peer["skipped"].startswith("peer cannot be imported")
    table = lines[-1]
    assert "1 of 3 rounds failed: OutOfMemoryError" in table and "skipped: peer" in table and "18.2%" in table
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        run_all("test", "the test", ["lora"], ["eager"], (["lora"], ["eager"]), run_one, settings={}, summary="",
                out_dir=None, out_name="", log=lines.append, device=torch.device("cpu"), rounds=0)


def test_lora_targets_reach_every_case_in_process_and_isolated(monkeypatch, tmp_path):
    """--lora-targets puts adapters on those projections only, in this process and in a case
    process (whose command line is replayed here in-process)."""
    import tigon.bench.e2e as e2e

    record = run_e2e(modes=["lora"], impls=["tigon"], batch=1, seq=8, steps=1, warmup=1, shape=TINY,
                     lora_targets=["q_proj", "v_proj"], device=torch.device("cpu"), log=lambda line: None)[0]
    assert "error" not in record, record.get("error")
    assert record["lora"].startswith("tigon: fused LoRA on 4 of 4 LoRA layers"), record["lora"]

    def in_process(module, argv, record, **kwargs):
        out = tmp_path / "record.json"
        assert e2e.main([*argv, "--record", str(out)]) == 0
        return {**record, **json.loads(out.read_text())}

    monkeypatch.setattr(e2e, "run_isolated", in_process)
    records = run_e2e(modes=["lora"], impls=["tigon"], batch=1, seq=8, steps=1, warmup=1, shape=TINY, rounds=2,
                      lora_targets=["down_proj"], device=torch.device("cpu"), out_dir=tmp_path, log=lambda line: None)
    assert records[0]["lora"].startswith("tigon: fused LoRA on 2 of 2 LoRA layers"), records[0]["lora"]
    assert json.loads((tmp_path / "e2e.json").read_text())["settings"]["lora_targets"] == ["down_proj"]
    tigon.unpatch()


def test_rows_without_an_eager_row_print_dashes_not_nan():
    """A run without eager (Unsloth against tigon+graphs, say) has no speed-up, memory ratio or
    loss difference to print: its columns say '-', not 'nan'."""
    from tigon.bench.e2e import compare, format_table

    records = [{"mode": "lora", "impl": impl, "tokens_per_s": speed, "step_ms": 10.0, "peak_gib": 3.5,
                "losses": [12.17, 11.9]} for impl, speed in (("unsloth", 11334.0), ("tigon+graphs", 66598.0))]
    compare(records)
    table = format_table(records)
    assert "nan" not in table, table
    assert table.splitlines()[2].split()[:9] == ["lora", "tigon+graphs", "66598", "-", "10.0", "3.50", "-", "-", "5.88x"]


def test_out_of_memory_while_building_a_model_is_that_cases_row(monkeypatch):
    import tigon.bench.e2e as e2e

    build = e2e.build_model

    def build_or_fail(mode, *args, **kwargs):
        if mode == "full":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return build(mode, *args, **kwargs)

    monkeypatch.setattr(e2e, "build_model", build_or_fail)
    records = run_e2e(modes=["full", "lora"], impls=["eager"], batch=1, seq=8, steps=1, warmup=0, shape=TINY,
                      device=torch.device("cpu"), log=lambda line: None)
    assert records[0]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert "error" not in records[1] and records[1]["tokens_per_s"] > 0


def test_a_case_process_that_ends_without_a_result_is_that_cases_error():
    from tigon.bench.harness import run_isolated

    record = run_isolated("tigon.bench.e2e", ["--case", "lora", "eager", "--shape", "[1]"], {"impl": "eager"})
    assert record["impl"] == "eager"
    assert record["error"].startswith("process ended (exit code 2) without a result: ") and "--shape" in record["error"]


def test_unsloth_rows_are_skipped_where_it_cannot_be_imported(monkeypatch):
    """Unsloth is not installable without a GPU: its rows say so in one line (its LoRA case in a
    process of its own, as Unsloth patches transformers on import) and the run succeeds."""
    pytest.importorskip("peft")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    lines = []
    records = run_e2e(modes=["full", "lora"], impls=["unsloth"], batch=1, seq=8, steps=1, warmup=0, shape=TINY,
                      device=torch.device("cpu"), log=lines.append)
    assert records[0]["skipped"] == "unsloth is measured in lora and qlora modes"
    assert records[1]["skipped"].startswith("unsloth cannot be imported here (")
    assert not [r for r in records if "error" in r]
    assert "lora     unsloth               skipped: unsloth cannot be imported here" in lines[-1]
    assert "HF_HUB_OFFLINE" not in os.environ  # set for Unsloth's import alone; this process goes on


def test_unsloth_gets_the_saved_random_model_and_the_cases_adapters(monkeypatch, tmp_path):
    """build_unsloth calls FastLanguageModel as documented (a fake here: the real one needs a GPU),
    on a folder holding the same random weights as build_model's model and a tokenizer."""
    import sys
    import tempfile
    import types

    import transformers

    import tigon.bench.e2e as e2e

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(model_name, **kwargs):
            calls["load"] = kwargs
            calls["tokenizer"] = transformers.AutoTokenizer.from_pretrained(model_name)
            return transformers.AutoModelForCausalLM.from_pretrained(model_name), calls["tokenizer"]

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls["peft"] = kwargs
            return model

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    model = e2e.build_unsloth("qlora", 16, torch.device("cpu"), shape=TINY, lora_rank=4, checkpointing="unsloth")
    assert calls["load"] == dict(max_seq_length=16, dtype=torch.bfloat16, load_in_4bit=True, device_map={"": "cpu"},
                                 use_gradient_checkpointing="unsloth", fix_tokenizer=False, random_state=0)
    assert calls["peft"] == dict(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", target_modules=list(e2e.LORA_TARGETS),
                                 use_gradient_checkpointing="unsloth", random_state=0, max_seq_length=16)
    plain = e2e.build_model("full", 16, torch.device("cpu"), shape=TINY, lora_rank=4, checkpointing=False)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, plain.model.layers[1].mlp.down_proj.weight)
    assert [p.name for p in (tmp_path / "tigon-e2e-models").iterdir()] == [e2e.saved_model(TINY, 16, "cpu").name]
    with pytest.raises(ValueError, match="lora and qlora modes"):
        e2e.build_unsloth("full", 16, torch.device("cpu"), shape=TINY, lora_rank=4, checkpointing=False)


@pytest.mark.parametrize("checkpointing, unsloths", [(False, False), (True, "unsloth")])
def test_unsloth_checkpoints_its_own_recommended_way(monkeypatch, checkpointing, unsloths):
    """With --checkpointing the Unsloth row runs under use_gradient_checkpointing="unsloth", the
    mode Unsloth recommends, and gets the case's adapter targets."""
    import tigon.bench.e2e as e2e

    asked = {}

    def build(*args, **kwargs):
        asked.update(kwargs)
        raise ImportError("no GPU here", name="unsloth")

    monkeypatch.setattr(e2e, "build_unsloth", build)
    record = e2e.run_case("lora", "unsloth", torch.device("cpu"), batch=1, seq=8, steps=1, warmup=1, shape=TINY,
                          checkpointing=checkpointing, lora_targets=["q_proj"])
    assert record["skipped"].startswith("unsloth cannot be imported here")
    assert asked["checkpointing"] == unsloths and asked["lora_targets"] == ["q_proj"]


def test_qlora_mode_trains_tigon_like_peft_and_bitsandbytes(monkeypatch, tmp_path):
    pytest.importorskip("bitsandbytes")
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    records = run_e2e(modes=["qlora"], impls=["eager", "tigon"], batch=1, seq=8, steps=1, warmup=1, shape=TINY,
                      device=torch.device("cpu"), log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    assert "lora" in records[1]["applied"]
    assert records[1]["max_loss_diff"] < 0.02 and len(records[1]["losses"]) == 2
    tigon.unpatch()


def test_peak_record_lists_what_is_live_at_the_peak():
    """The allocator's trace replayed: the peak is where the most is live, listed by allocating
    code and by block; what was freed before the peak is not."""
    from tigon.bench.memory import PeakRecord

    mib = 2**20

    def event(action, addr, size, where):
        return {"action": action, "addr": addr, "size": size * mib,
                "frames": [{"filename": f"/x/site-packages/torch/nn/{where}.py", "line": 1, "name": "plumbing"},
                           {"filename": f"/repo/src/tigon/{where}.py", "line": 7, "name": where}]}

    record = PeakRecord(units=4)
    record.device, record.before = 0, 100 * mib
    trace = [event("alloc", 1, 300, "logits"), event("alloc", 2, 50, "grad"), event("free_completed", 1, 300, "logits"),
             event("alloc", 3, 200, "dequant"), event("alloc", 4, 120, "dequant"), event("free_completed", 4, 120, "dequant"),
             event("alloc", 5, 10, "grad")]
    record.snapshot = {"device_traces": [trace]}
    peak, events, live, freed = record.live_at_peak()
    assert (peak, events, sorted(e["addr"] for e in live), freed) == (470 * mib, 7, [2, 3, 4], 0)
    report = record.report().splitlines()
    assert report[0].startswith("peak 470 MiB (7 events): 100 MiB from before the record, 370 MiB allocated in it")
    assert report[1].strip().startswith("320.0 MiB") and "x2" in report[1] and "tigon/dequant.py:7 dequant" in report[1]
    assert report[-3].strip().startswith("200.0 MiB") and report[-1].strip().startswith("50.0 MiB")
    assert not [line for line in report if "logits" in line]


@pytest.mark.gpu
def test_gpu_e2e_rounds_of_qlora_with_a_memory_snapshot(tmp_path):
    """Two interleaved rounds, each case in its own process, QLoRA with tigon and Unsloth (skipped
    where it is not installed), and the allocator's record of each case."""
    shape = dict(TINY, hidden_size=256, intermediate_size=688, vocab_size=32000)
    records = run_e2e(modes=["qlora"], impls=["tigon", "unsloth"], batch=1, seq=256, steps=2, warmup=1,
                      shape=shape, rounds=2, memory_snapshot=tmp_path, log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    ran = [r for r in records if "skipped" not in r]
    assert all(r["rounds"] == 2 and len(r["tokens_per_s_rounds"]) == 2 and r["peak_gib"] > 0 for r in ran)
    for record in ran:
        text = (tmp_path / f"{record['mode']}-{record['impl']}.txt").read_text()
        assert text.startswith("peak ") and "largest blocks live at the peak" in text
        assert (tmp_path / f"{record['mode']}-{record['impl']}.pickle").stat().st_size > 0
