"""End-to-end fine-tuning benchmark: PyTorch eager vs tigon-patched, same model, data and run.

The model is a 1B Llama shape (hidden 2048, intermediate 8192, 16 layers, 32 heads /
8 KV heads, vocab 128256, tied embeddings; ~1.24 B parameters) with random weights, in bf16 with
SDPA attention, trained by AdamW on random tokens:

* ``full``: every parameter trains;
* ``lora``: PEFT LoRA r=16 (alpha 32, no dropout) on every linear layer of the decoder;
* ``lora-fp8``: the same LoRA on a frozen FP8 base (``tigon sft --quant fp8``: the decoder's
  linears in e4m3 with a scale per output row, :class:`tigon.nn.Fp8Linear`; its peak counts from
  after the quantisation, as a model loaded from an FP8 checkpoint would start).

``--shape 8b`` is the 8B Llama shape (hidden 4096, intermediate 14336, 32 layers, untied head).

Each (mode, implementation) gets a fresh model from the same seed and the same batches, so the
per-step losses are comparable: they are reported next to eager's. Throughput is tokens per
second over the timed steps (after warm-up steps, which also absorb torch.compile's compilation),
at the cadence of the HF Trainer between logging steps: each step's loss is read after its
backward, so the next step's forward is issued while the GPU runs the optimizer
(``--sync-steps``: none of that overlap, each step timed alone). Peak is
``torch.cuda.max_memory_allocated()`` over the whole run from building the model on, in GiB
(weights, gradients and optimizer state included). GPU busy is the mean NVML
utilisation over the timed steps after their first second (`tigon.timing.BusyMeter`; absent
without pynvml): each NVML sample covers up to the last second, which at first holds the warm-up
(compilation, capture). Where it is measured, the timed steps go on past their number until they
span three seconds, so that the reading holds two seconds of samples.

``peer`` is the same model with Liger-Kernel's kernels (``_apply_liger_kernel_to_instance``, on
the base model under PEFT), when its package is installed.

``tigon+graphs`` replays each step's forward and backward of the patched model from a CUDA graph,
and AdamW's update from another (`tigon.cuda_graphs`, ``tigon sft --cuda-graphs``): at batch
1 × 1024 tokens (``tigon bench --e2e 1x1024``) the host, not the GPU, sets the step time of the
plain runs.
``tigon+reduce-overhead`` reaches replays through ``torch.compile(mode="reduce-overhead")`` of the
patched model instead.

``tigon bench --e2e`` runs the defaults; ``python -m tigon.bench.e2e --help`` lists the knobs
(long-context runs: ``--modes lora --batch 1 --seq 65536 --checkpointing``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench.harness import environment
from tigon.timing import BusyMeter

# NVML's utilisation sample covers up to the last second: the busy reading skips that much of the
# timed steps, which run at least BUSY_MIN_TIMED_S where it is read.
BUSY_SETTLE_S, BUSY_MIN_TIMED_S = 1.0, 3.0
MODES = ("full", "lora", "lora-fp8")
DEFAULT_MODES = ("full", "lora")
# "tigon+compile" is the patched model under torch.compile, "tigon+reduce-overhead" under its CUDA-graph
# mode; "tigon+graphs" replays the patched model's micro-steps from CUDA graphs (tigon sft --cuda-graphs).
IMPLS = ("eager", "tigon", "compile", "tigon+compile", "tigon+graphs", "tigon+reduce-overhead", "peer")
COMPILE_MODES = {"compile": None, "tigon+compile": None, "tigon+reduce-overhead": "reduce-overhead"}
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
)
LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(
    mode: str, seq: int, device: torch.device, *, shape: dict, lora_rank: int, checkpointing: bool, seed: int = 0
):
    """A Llama of `shape` on `device`, in bf16, random weights from `seed`."""
    from transformers import LlamaConfig

    from tigon.train.tiny import random_model

    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 8192), use_cache=False)
    config._attn_implementation = "sdpa"
    model = random_model(config, seed, device=device, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora-fp8":
        from tigon.nn.fp8 import quantize_linears

        quantize_linears(model)
        release_memory(device)
    if mode.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # the adapters' initialisation, the same for every implementation
        model = get_peft_model(
            model,
            LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)),
        )
        if checkpointing:
            model.enable_input_require_grads()
    return model


def apply_peer(model: torch.nn.Module) -> Callable[[], None]:
    """Liger-Kernel's kernels on `model` (the base model under PEFT); returns what undoes them.
    Liger also replaces names in the model's transformers module (its RMSNorm and MLP classes,
    the rotary function, the loss), which the later cases' fresh models would pick up: the undo
    puts that module's namespace back."""
    import importlib

    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = importlib.import_module(type(base).__module__)
    saved = dict(vars(module))
    _apply_liger_kernel_to_instance(model=base)

    def undo() -> None:
        for name in set(vars(module)) - set(saved):
            delattr(module, name)
        for name, value in saved.items():
            setattr(module, name, value)

    return undo


def release_memory(device: torch.device) -> None:
    """Free what a finished case left (its model, optimizer, cached blocks) and restart the peak count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def current_cuda_device(bench: str) -> torch.device:
    """The current CUDA device, or a RuntimeError saying that `bench` needs one."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{bench} needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())


def micro_step(step_model: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One forward + backward of `step_model` on a batch of token ids (labels the same); returns
    the loss."""

    def forward_backward(ids: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # under CUDA-graph replay: the last step's outputs are read
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return forward_backward


def captured_micro_step(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`micro_step` of `model` replayed from a CUDA graph (`tigon.cuda_graphs`)."""
    from tigon.cuda_graphs import CapturedStep

    plain = micro_step(model)
    captured = CapturedStep(lambda inputs: plain(inputs["input_ids"]), model.parameters())
    return lambda ids: captured({"input_ids": ids})


def timed_steps(
    model: torch.nn.Module,
    step: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    *,
    sync_steps: bool = False,
    busy: BusyMeter | None = None,
    captured_update: bool = False,
) -> tuple[list[float], list[float]]:
    """`warmup + steps` AdamW steps (`step`: forward + backward of a batch of ids, its loss returned) on random tokens (the same tokens for every
    case); returns the seconds of the timed steps and the loss of every step. `busy`, if given,
    is read at the first timed step and again BUSY_SETTLE_S later, so that its window holds timed
    steps only; the timed steps then go on until they span BUSY_MIN_TIMED_S.

    Each step's loss is read after its backward, where the Hugging Face Trainer reads it (its
    per-step NaN/inf check; between logging steps it reads nothing else): the host waits there for
    the GPU, then issues the optimizer step and the next forward while the GPU runs that step. A
    step's time runs from one loss read to the next, so it holds one forward + backward and the
    previous step's optimizer update. `sync_steps` instead synchronises before and after every step
    and times each alone: stricter, as no host work of one step overlaps GPU work of another.
    `captured_update`: AdamW's update is replayed from a CUDA graph (`CapturedOptimizer`).
    """
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=device.type == "cuda"
    )
    if captured_update:
        from tigon.cuda_graphs import CapturedOptimizer

        optimizer = CapturedOptimizer(optimizer, device=device)
    gen = torch.Generator(device).manual_seed(1234)
    times, losses = [], []
    settled, min_timed_s = busy is None, 0.0 if busy is None else BUSY_MIN_TIMED_S
    _sync(device)
    last_read = time.perf_counter()
    i = timed_s = 0
    while i < warmup + steps or timed_s < min_timed_s:
        ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
        if sync_steps:
            _sync(device)
            last_read = time.perf_counter()
        if busy is not None and i == warmup:
            busy.window()
        if not settled and timed_s >= BUSY_SETTLE_S:
            busy.window()  # drop the samples that reach back into the warm-up
            settled = True
        losses.append(step(ids).item())
        read = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if sync_steps:
            _sync(device)
            read = time.perf_counter()
        if i >= warmup:
            times.append(read - last_read)
            timed_s += read - last_read
        last_read = read
        i += 1
    _sync(device)
    return times, losses


def measure_training(
    model: torch.nn.Module, step: Callable[[torch.Tensor], torch.Tensor], vocab: int, batch: int, seq: int, warmup: int,
    steps: int, sync_steps: bool = False, captured_update: bool = False,
) -> dict[str, Any]:
    """:func:`timed_steps` in train mode; tokens/s, median step ms, peak GiB (CUDA) and losses."""
    device = next(model.parameters()).device
    model.train()
    busy = BusyMeter()
    sampling = device.type == "cuda" and busy.start()
    try:
        times, losses = timed_steps(model, step, vocab, batch, seq, warmup, steps, sync_steps=sync_steps,
                                    busy=busy if sampling else None, captured_update=captured_update)
        window = busy.window() if sampling else None
    finally:
        busy.stop()
    record = dict(
        tokens_per_s=batch * seq * len(times) / sum(times),
        step_ms=1e3 * statistics.median(times),
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
        losses=losses,
    )
    if window is not None:
        record["gpu_busy_pct"] = round(window, 1)
    return record


def run_case(
    mode: str,
    impl: str,
    device: torch.device,
    *,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    shape: dict = LLAMA_1B,
    lora_rank: int = 16,
    checkpointing: bool = False,
    sync_steps: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train one model for `warmup` + `steps` AdamW steps; throughput, peak memory (CUDA only)
    and losses."""
    release_memory(device)
    model = build_model(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing=checkpointing)
    record: dict[str, Any] = {"mode": mode, "impl": impl, "batch": batch, "seq": seq}
    undo_peer = None
    try:
        if impl == "peer":
            undo_peer = apply_peer(model)
        if impl.startswith("tigon"):
            record["applied"] = str(tigon.patch(model))
            log(record["applied"])
        if impl == "tigon+graphs":
            step = captured_micro_step(model)
        else:
            step = micro_step(torch.compile(model, mode=COMPILE_MODES[impl]) if impl in COMPILE_MODES else model)
        record.update(measure_training(model, step, shape["vocab_size"], batch, seq, warmup, steps, sync_steps,
                                       captured_update=impl == "tigon+graphs"))
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        tigon.unpatch(model)
        if undo_peer is not None:
            undo_peer()
        del model
        release_memory(device)
    return record


def compare(records: list[dict[str, Any]]) -> None:
    """Add speed-up, memory ratio and the largest per-step loss difference against eager."""
    eager = {r["mode"]: r for r in records if r["impl"] == "eager" and "losses" in r}
    for record in records:
        base = eager.get(record["mode"])
        if base is None or "losses" not in record:
            continue
        record["vs_eager_speed"] = record["tokens_per_s"] / base["tokens_per_s"]
        record["vs_eager_peak"] = record["peak_gib"] / base["peak_gib"]
        record["max_loss_diff"] = max(abs(a - b) for a, b in zip(record["losses"], base["losses"]))


def format_table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'mode':<9}{'impl':<15}{'tok/s':>10}{'step ms':>9}{'peak GiB':>10}{'speed-up':>10}"
             f"{'peak/eager':>11}{'first loss':>11}{'max |dloss|':>12}{'GPU busy':>9}"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['mode']:<9}{r['impl']:<15}  {r['error']}")
            continue
        lines.append(
            f"{r['mode']:<9}{r['impl']:<15}{r['tokens_per_s']:>10.0f}{r['step_ms']:>9.1f}{r['peak_gib']:>10.2f}"
            f"{r.get('vs_eager_speed', float('nan')):>9.2f}x{r.get('vs_eager_peak', float('nan')):>11.2f}"
            f"{r['losses'][0]:>11.4f}{r.get('max_loss_diff', float('nan')):>12.4f}"
            + (f"{r['gpu_busy_pct']:>8.0f}%" if "gpu_busy_pct" in r else f"{'-':>9}")
        )
    return "\n".join(lines)


def run_e2e(
    modes: Sequence[str] = DEFAULT_MODES,
    impls: Sequence[str] = ("eager", "tigon"),
    *,
    batch: int = 4,
    seq: int = 2048,
    steps: int = 10,
    warmup: int = 3,
    lora_rank: int = 16,
    checkpointing: bool = False,
    sync_steps: bool = False,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    shape: dict = LLAMA_1B,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Run every (mode, impl) pair on the current CUDA device (or `device`: a CPU run of a small
    `shape` checks the pipeline, not speed); print a table, optionally write ``e2e.json`` to
    `out_dir`, and return the records."""
    cadence = "synchronised around each step" if sync_steps else "each loss read after its backward, as the HF Trainer does"
    settings = dict(
        batch=batch, seq=seq, steps=steps, warmup=warmup, lora_rank=lora_rank, checkpointing=checkpointing,
        sync_steps=sync_steps, shape=shape,
    )

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        return run_case(
            mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape,
            lora_rank=lora_rank, checkpointing=checkpointing, sync_steps=sync_steps, log=log,
        )

    return run_all(
        "e2e bench", "the end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one, settings=settings,
        summary=f"batch {batch} x {seq} tokens, {steps} timed steps after {warmup}, {cadence}",
        out_dir=out_dir, out_name="e2e.json", log=log, device=device,
    )


def run_all(
    title: str,
    needs: str,
    modes: Sequence[str],
    impls: Sequence[str],
    known: tuple[Sequence[str], Sequence[str]],
    run_one: Callable[[str, str, torch.device], dict[str, Any]],
    *,
    settings: dict,
    summary: str,
    out_dir: Path | None,
    out_name: str,
    log: Callable[[str], None],
    device: torch.device | None,
) -> list[dict[str, Any]]:
    """``run_one(mode, impl, device)`` for every pair (`known`: the valid modes and impls), each
    compared with eager and logged as it ends, then the whole table; ``out_dir/out_name`` gets
    the environment, `settings` and the records. `needs` names the bench in the no-GPU error."""
    for name, values, valid in (("modes", modes, known[0]), ("impls", impls, known[1])):
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"{name} must be among {', '.join(valid)}, got {', '.join(unknown)}")
    device = device or current_cuda_device(needs)
    env = environment(device)
    import transformers

    env["transformers"] = transformers.__version__
    log(f"tigon {title} on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}): {summary}")
    records = []
    for mode in modes:
        for impl in impls:
            records.append(run_one(mode, impl, device))
            compare(records)
            log(format_table(records[-1:]))
    log("\n" + format_table(records))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / out_name).write_text(json.dumps({"environment": env, "settings": settings, "results": records}, indent=1))
        log(f"wrote {out_dir / out_name}")
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--shape", choices=SHAPES, default="1b", help="the Llama shape (default 1b)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["eager", "tigon"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (long context)")
    parser.add_argument("--sync-steps", action="store_true",
                        help="synchronise around every step instead of reading each loss after its backward")
    parser.add_argument("--out", metavar="DIR", help="write e2e.json here")
    args = parser.parse_args(argv)
    records = run_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        lora_rank=args.lora_rank, checkpointing=args.checkpointing, sync_steps=args.sync_steps,
        out_dir=Path(args.out) if args.out else None, shape=SHAPES[args.shape],
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
