"""The FP8 rows of the end-to-end benchmark (tigon.bench.fp8) and the accuracy script
(tigon.bench.fp8_accuracy): their pipelines on the CPU, where torch._scaled_mm runs too (their
numbers mean nothing there), and torch._scaled_mm's rowwise linear against torchao's."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import skip_without_cpu_rowwise_scaled_mm
from tests.patch.test_fp8 import fp8_anywhere  # noqa: F401  (a fixture)
from tigon.patch import fp8 as patch_fp8

pytest.importorskip("torchao")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=True)


def test_e2e_fp8_rows_run_and_follow_eager(fp8_anywhere):
    from tigon.bench import fp8
    from tigon.bench.e2e import COMPILE_MODES, GRAPHS_IMPLS, run_e2e

    skip_without_cpu_rowwise_scaled_mm()
    # torchao-fp8+compile is torchao-fp8's model under the compile impls' torch.compile (a minute
    # of inductor on this CPU) and tigon+fp8+graphs tigon+fp8's replayed from CUDA graphs: run on the GPU.
    assert "torchao-fp8+compile" in COMPILE_MODES and fp8.IMPLS["torchao-fp8+compile"] == fp8.IMPLS["torchao-fp8"]
    assert "tigon+fp8+graphs" in GRAPHS_IMPLS and fp8.IMPLS["tigon+fp8+graphs"] == fp8.IMPLS["tigon+fp8"]
    lines = []
    impls = [impl for impl in fp8.IMPLS if impl not in COMPILE_MODES and impl not in GRAPHS_IMPLS]
    records = run_e2e(modes=["full"], impls=["eager", *impls], batch=2, seq=8, steps=2, warmup=1, shape=TINY,
                      device=torch.device("cpu"), log=lines.append)
    assert not [r["error"] for r in records if "error" in r]
    by = {r["impl"]: r for r in records}
    assert by["torchao-fp8"]["applied"] == "torchao fp8 tensorwise (14 linears) on the unpatched model"
    assert "fp8 rowwise (14 linears)" in by["tigon+fp8-rowwise"]["applied"]
    scaled_mm = by["tigon+scaled-mm"]["applied"]  # tigon's kernels, then the linears swapped
    assert scaled_mm.startswith("tigon: applied rms_norm") and "fp8" not in scaled_mm
    assert scaled_mm.endswith(" to LlamaForCausalLM (2 layers), torch._scaled_mm rowwise (14 linears)")
    for record in records:
        assert record["max_loss_diff"] < 0.02 and "floor_pct" not in record  # no floor off CUDA
    assert "torchao-fp8-rowwise " in lines[-1]  # the whole table, the impl names in full


def test_scaled_mm_linear_computes_what_torchao_rowwise_does():
    """Both scale each row of each operand's contracted side by a power of two into e4m3: the same
    GEMMs, so the same outputs and gradients (up to the GEMM's summation order)."""
    from tigon.bench.fp8 import ScaledMMLinear

    skip_without_cpu_rowwise_scaled_mm()
    float8 = patch_fp8.torchao_float8()
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    ours = ScaledMMLinear(64, 48, bias=False, dtype=torch.bfloat16)
    ours.weight = torch.nn.Parameter(linear.weight.detach().clone())
    theirs = float8.float8_linear.Float8Linear.from_float(linear, config=patch_fp8.config("rowwise"))
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 64).to(torch.bfloat16)
    grad = torch.randn(3, 16, 48, dtype=torch.bfloat16)
    results = []
    for module in (ours, theirs):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(grad)
        results.append((out, leaf.grad, module.weight.grad))
    exact = (x.float() @ linear.weight.float().t())
    assert (results[0][0].float() - exact).norm() < 0.1 * exact.norm()  # FP8, not noise
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2)


def test_floor_counts_fp8_linears_at_the_fp8_rate():
    from tigon.bench.fp8 import floor_tokens_per_s
    from tigon.train.modeling import flops_per_token
    from tests.patch.tiny import tiny_model

    model = tiny_model("llama", 0, intermediate_size=96)
    total = flops_per_token(model, 8)
    assert floor_tokens_per_s(model, 8, (1e12, 2e12)) == pytest.approx(1e12 / total)
    float8 = patch_fp8.torchao_float8()
    float8.convert_to_float8_training(model.model.layers, config=patch_fp8.config("tensorwise"))
    in_fp8 = 6.0 * sum(m.weight.numel() for layer in model.model.layers for m in layer.modules()
                       if isinstance(m, torch.nn.Linear))
    assert floor_tokens_per_s(model, 8, (1e12, 2e12)) == pytest.approx(1 / ((total - in_fp8) / 1e12 + in_fp8 / 2e12))


def test_floor_counts_frozen_fp8_bases_forward_and_input_gradient():
    """LoRA on an FP8 base: a row-scaled frozen base's forward and input-gradient GEMMs count at the
    FP8 rate; a block-scaled one (dequantised for bf16 GEMMs) and the trained linears at bf16's."""
    from tigon.bench.fp8 import floor_tokens_per_s
    from tigon.nn import Fp8Linear

    model = torch.nn.Sequential(Fp8Linear(32, 16, bias=False), torch.nn.Linear(16, 8),
                                Fp8Linear(32, 16, bias=False, block_size=(16, 16)))
    total = 4.0 * (512 + 512) + 6.0 * 128  # frozen: forward and input gradient; trained: its weight gradient too
    in_fp8 = 4.0 * 512
    assert floor_tokens_per_s(model, 8, (1e12, 2e12)) == pytest.approx(1 / ((total - in_fp8) / 1e12 + in_fp8 / 2e12))
    assert floor_tokens_per_s(model, 8, (1e12, None)) == pytest.approx(1e12 / total)  # a GPU without FP8


def test_accuracy_script_reports_relative_differences_and_plots(tmp_path, monkeypatch, capsys):
    import tigon.bench.fp8_accuracy as accuracy

    runs = []

    def train(model, out, recipe, args):
        runs.append((model, out.name, recipe, args.steps))
        return [3.0, 2.0, 1.0] if recipe is None else [3.0, 2.0, 1.01 if recipe == "tensorwise" else 0.98]

    monkeypatch.setattr(accuracy, "train", train)
    monkeypatch.setattr(accuracy, "unsupported", lambda: None)
    png = tmp_path / "curves.png"
    assert accuracy.main(["--model", str(tmp_path), "--steps", "3", "--last", "1", "--png", str(png)]) == 0
    assert runs == [(tmp_path, "bf16", None, 3), (tmp_path, "fp8-tensorwise", "tensorwise", 3),
                    (tmp_path, "fp8-rowwise", "rowwise", 3)]
    out = capsys.readouterr().out
    assert "fp8 tensorwise   final loss 1.0100  (+1.00% vs bf16)" in out
    assert "fp8 rowwise      final loss 0.9800  (-2.00% vs bf16)" in out
    assert png.stat().st_size > 1000



def test_accuracy_script_trains_the_random_1b_shape_when_asked(tmp_path, monkeypatch, capsys):
    import tigon.bench.fp8_accuracy as accuracy

    trained = []
    monkeypatch.setattr(accuracy, "unsupported", lambda: None)
    monkeypatch.setattr(accuracy, "smollm2", lambda: pytest.fail("--random-1b must not build SmolLM2"))
    monkeypatch.setattr(accuracy, "random_1b", lambda folder: folder)
    monkeypatch.setattr(accuracy, "train", lambda model, out, recipe, args: trained.append(model.name) or [2.0, 1.0])
    assert accuracy.main(["--random-1b", "--recipes", "rowwise", "--steps", "2", "--png", str(tmp_path / "c.png")]) == 0
    assert trained == ["random-1b", "random-1b"]
    assert "the 1B Llama shape, random weights, 2 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        accuracy.main(["--random-1b", "--model", str(tmp_path)])
    assert "--model and --random-1b name two models" in capsys.readouterr().err


def test_accuracy_script_refuses_without_fp8_and_names_a_failed_run(tmp_path, monkeypatch, capsys):
    import tigon.bench.fp8_accuracy as accuracy

    monkeypatch.setattr(accuracy, "train", lambda *args: pytest.fail("nothing may train without FP8"))
    if torch.cuda.is_available():
        monkeypatch.setattr(accuracy, "unsupported", lambda: "FP8 matmuls need compute capability >= 8.9")
    assert accuracy.main(["--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("fp8 accuracy: FP8 matmuls need")
    # A tigon sft run that fails (its own message printed above): one line, exit 1.
    monkeypatch.undo()
    monkeypatch.setattr(accuracy, "unsupported", lambda: None)
    commands = []
    monkeypatch.setattr(accuracy.subprocess, "run", lambda command: commands.append(command) or
                        accuracy.subprocess.CompletedProcess(command, 3))
    assert accuracy.main(["--model", str(tmp_path), "--steps", "1", "--png", str(tmp_path / "c.png")]) == 1
    assert len(commands) == 1 and commands[0][1:4] == ["-m", "tigon.cli", "sft"] and "--fp8" not in commands[0]
    assert "fp8 accuracy: the bf16 run of tigon sft failed (exit " in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_accuracy_script_never_overwrites_without_being_told(tmp_path, monkeypatch, capsys):
    import tigon.bench.fp8_accuracy as accuracy

    monkeypatch.setattr(accuracy, "unsupported", lambda: None)
    monkeypatch.setattr(accuracy, "train", lambda *args: pytest.fail("nothing may train"))
    png, out = tmp_path / "curves.png", tmp_path / "runs"
    png.write_text("the user's picture")
    (out / "bf16").mkdir(parents=True)
    (out / "bf16" / "notes.txt").write_text("the user's notes")
    cases = [(["--png", str(png)], f"{png} already exists: pass --overwrite"),
             (["--png", str(tmp_path / "new.png"), "--out", str(out)], f"{out / 'bf16'} already exists"),
             (["--png", str(tmp_path / "missing" / "c.png")], "its folder does not exist"),
             (["--png", str(tmp_path / "new.png"), "--out", str(png)], "is a file, not a folder"),
             (["--png", str(out), "--overwrite"], "is a folder: name the PNG file to write")]
    for extra, words in cases:
        assert accuracy.main(["--model", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fp8 accuracy: ") and words in err and err.count("\n") == 1
    assert png.read_text() == "the user's picture" and (out / "bf16" / "notes.txt").read_text() == "the user's notes"
    assert not (tmp_path / "new.png").exists()


def test_accuracy_script_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    import tigon.bench.fp8_accuracy as accuracy

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(accuracy, "unsupported", lambda: None)
    monkeypatch.setattr(accuracy, "train", interrupted)
    assert accuracy.main(["--model", str(tmp_path), "--png", str(tmp_path / "c.png")]) == 130
    assert capsys.readouterr().err == "fp8 accuracy: stopped (Ctrl-C); nothing was compared\n"
    assert not (tmp_path / "c.png").exists()

@pytest.mark.gpu
def test_gpu_e2e_fp8_rows_report_their_floor():
    """On an FP8 GPU: every FP8 row runs, follows tigon's bf16 losses, and reports a % of its
    matmul floor (FP8 linears at the FP8 rate) below 100."""
    from tigon.bench import fp8
    from tigon.bench.e2e import run_e2e

    if patch_fp8.unsupported() is not None:
        pytest.skip(patch_fp8.unsupported())
    shape = dict(TINY, hidden_size=512, intermediate_size=1536, vocab_size=32000)
    records = run_e2e(modes=["full"], impls=["tigon", *fp8.IMPLS], batch=2, seq=512, steps=3, warmup=2, shape=shape,
                      log=lambda line: None)
    assert not [r["error"] for r in records if "error" in r]
    bf16 = records[0]
    for record in records:
        assert 0 < record["floor_pct"] < 100 and record["fp8_tflops"] > record["bf16_tflops"]
        both = min(len(record["losses"]), len(bf16["losses"]))  # with NVML the timed steps run >= 3 s
        assert record["losses"][:both] == pytest.approx(bf16["losses"][:both], rel=3e-2)
    assert all(r["floor_tokens_per_s"] > bf16["floor_tokens_per_s"] for r in records[1:])
