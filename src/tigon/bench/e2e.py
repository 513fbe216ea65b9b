"""End-to-end fine-tuning benchmark: PyTorch eager vs tigon-patched, same model, data and run.

The model is a 1B Llama shape (hidden 2048, intermediate 8192, 16 layers, 32 heads /
8 KV heads, vocab 128256, tied embeddings; ~1.24 B parameters) with random weights, in bf16 with
SDPA attention, trained by AdamW on random tokens:

* ``full``: every parameter trains;
* ``lora``: PEFT LoRA r=16 (alpha 32, no dropout) on every linear layer of the decoder;
* ``lora-fp8``: the same LoRA on a frozen FP8 base (``tigon sft --quant fp8``: the decoder's
  linears in e4m3 with a scale per output row, :class:`tigon.nn.Fp8Linear`; its peak counts from
  after the quantisation, as a model loaded from an FP8 checkpoint would start).

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

``qlora`` is LoRA on a base whose linear layers bitsandbytes quantises to NF4 with double
quantisation as they load (``tigon sft --quant nf4``): the random model is saved once to a folder
under the temporary directory and loaded from there, as a user's model is. Its ``eager`` is PEFT +
bitsandbytes. ``--shape 8b`` is the Llama-3-8B shape (hidden 4096, 32 layers, untied 128256 vocabulary).

``unsloth`` is Unsloth's ``FastLanguageModel`` (its own kernels, compiled regions and LoRA wrapping)
on the same saved random model, LoRA or 4-bit QLoRA with the same rank, alpha, targets, steps and
data, trained by the same AdamW loop (with ``--checkpointing``, under its own recommended
``use_gradient_checkpointing="unsloth"``); it runs where the package is importable (it needs a GPU at
import) and is a skipped row otherwise. Unsloth patches transformers when imported, so it always runs
in a process of its own.

``--rounds N`` runs every (mode, implementation) N times, each in a fresh process, the
implementations taking turns (each round starts one further along the list), and each row reports
the median tokens/s over its rounds, their spread ((max - min) / median) and the largest peak: a
drift of the machine between runs then shows as spread instead of deciding a comparison. A case
that runs out of memory or kills its process is that row's result; the others go on.

``--memory-snapshot DIR`` records the CUDA allocator's history of each case from before its model
is built (use it with ``--steps 1 --warmup 1``) and writes ``DIR/MODE-IMPL.pickle`` (for
pytorch.org/memory_viz) and ``DIR/MODE-IMPL.txt``: what is live at the peak, by allocating code and by
block (:mod:`tigon.bench.memory`).

The FP8 rows (``torchao-fp8``, ``tigon+fp8`` and their ``-rowwise`` recipes, ``tigon+scaled-mm``)
are :mod:`tigon.bench.fp8`'s; on a GPU every row then reports its % of the matmul floor.

``tigon bench --e2e`` runs the defaults; ``python -m tigon.bench.e2e --help`` lists the knobs
(long-context runs: ``--modes lora --batch 1 --seq 65536 --checkpointing``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import tigon
from tigon.bench import fp8
from tigon.bench.harness import environment, run_isolated
from tigon.timing import BusyMeter

# NVML's utilisation sample covers up to the last second: the busy reading skips that much of the
# timed steps, which run at least BUSY_MIN_TIMED_S where it is read.
BUSY_SETTLE_S, BUSY_MIN_TIMED_S = 1.0, 3.0
MODES = ("full", "lora", "qlora", "lora-fp8")
DEFAULT_MODES = ("full", "lora")
# "tigon+compile" is the patched model under torch.compile, "tigon+reduce-overhead" under its CUDA-graph
# mode; "tigon+graphs" replays the patched model's micro-steps from CUDA graphs (tigon sft --cuda-graphs).
IMPLS = ("eager", "tigon", "compile", "tigon+compile", "tigon+graphs", "tigon+reduce-overhead", "peer", "unsloth",
         *fp8.IMPLS)
# Replayed from CUDA graphs: each micro-step and AdamW's update (tigon sft --cuda-graphs).
GRAPHS_IMPLS = ("tigon+graphs", "tigon+fp8+graphs")
COMPILE_MODES = {"compile": None, "tigon+compile": None, "tigon+reduce-overhead": "reduce-overhead",
                 "torchao-fp8+compile": None}
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
)
LLAMA_8B = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(shape: dict, seq: int):
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 8192), use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def saved_model(shape: dict, seq: int, device: torch.device, seed: int = 0) -> Path:
    """The random bf16 model that :func:`build_model` makes, saved with a small tokenizer to a folder
    under the temporary directory (made once per shape, seed and position count; later cases and
    processes load it), for the implementations that load a model from a folder: QLoRA's
    quantise-on-load and Unsloth's ``from_pretrained``."""
    config = _config(shape, seq)
    key = hashlib.sha256(json.dumps([shape, config.max_position_embeddings, seed], sort_keys=True).encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / "tigon-e2e-models" / key[:16]
    if (folder / "config.json").is_file():
        return folder
    from tigon.train import tiny
    from tigon.train.data import Sample
    from tigon.train.tiny import random_model

    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")  # whole or absent: renamed when written
    model = random_model(config, seed, device=device, dtype=torch.bfloat16)
    model.save_pretrained(partial)
    del model
    release_memory(device)
    # the ids are given: the tokenizer is read by loaders that insist on one, never used
    tiny.build_tokenizer([Sample("", text="tokens")]).save_pretrained(partial)
    partial.rename(folder)
    return folder


def _quantized(shape: dict, seq: int, device: torch.device, checkpointing: bool, seed: int) -> torch.nn.Module:
    """The saved random model loaded with its linear layers quantised to NF4 (double quantisation,
    bf16 compute) by bitsandbytes, prepared for k-bit training as `tigon sft --quant nf4` does."""
    from tigon.train.modeling import load_model, prepare_quantized, quantization_config

    model = load_model(str(saved_model(shape, seq, device, seed)), torch.bfloat16,
                       quantization_config("nf4", torch.bfloat16), device)
    model.config.use_cache = False
    prepare_quantized(model, checkpointing)
    return model


def build_unsloth(mode: str, seq: int, device: torch.device, *, shape: dict, lora_rank: int, checkpointing: bool | str,
                  seed: int = 0, lora_targets: Sequence[str] = LORA_TARGETS, **options: Any) -> torch.nn.Module:
    """Unsloth's LoRA (`mode` "lora", bf16 base) or QLoRA ("qlora", its NF4 with double
    quantisation) model of the saved random model, with the adapters :func:`build_model` gives
    (rank `lora_rank` on the `lora_targets` projections).
    `checkpointing`: Unsloth's ``use_gradient_checkpointing`` (True, False or "unsloth", its own
    with activations offloaded to host memory); `options` go to ``from_pretrained`` (such as
    ``unsloth_tiled_mlp``). Raises ImportError where Unsloth cannot be imported."""
    if mode not in ("lora", "qlora"):
        raise ValueError(f"unsloth is measured in lora and qlora modes, not {mode}")
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch, no statistics to send
    try:  # first: it patches transformers as it is imported
        from unsloth import FastLanguageModel
    except Exception as err:  # without a GPU it raises at import, not only ImportError
        if offline is None:  # the process goes on without Unsloth: as it was
            del os.environ["HF_HUB_OFFLINE"]
        raise ImportError(f"{type(err).__name__}: {err}", name="unsloth") from err

    path = saved_model(shape, seq, device, seed)
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(path), max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=mode == "qlora",
        device_map={"": str(device)}, use_gradient_checkpointing=checkpointing, fix_tokenizer=False,
        random_state=seed, **options,
    )
    model.config.use_cache = False
    return FastLanguageModel.get_peft_model(
        model, r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, bias="none", target_modules=list(lora_targets),
        use_gradient_checkpointing=checkpointing, random_state=seed, max_seq_length=seq,
    )


def build_model(
    mode: str, seq: int, device: torch.device, *, shape: dict, lora_rank: int, checkpointing: bool, seed: int = 0,
    lora_targets: Sequence[str] = LORA_TARGETS,
):
    """A Llama of `shape` on `device`, in bf16, random weights from `seed`; in "qlora" mode its
    linear layers quantised to NF4 by bitsandbytes; in the LoRA modes with rank-`lora_rank`
    adapters on the `lora_targets` projections."""
    from tigon.train.tiny import random_model

    if mode == "qlora":
        model = _quantized(shape, seq, device, checkpointing, seed)
    else:
        model = random_model(_config(shape, seq), seed, device=device, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "lora-fp8":
        from tigon.nn.fp8 import quantize_linears

        quantize_linears(model)
        release_memory(device)
    if mode in ("lora", "qlora", "lora-fp8"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # the adapters' initialisation, the same for every implementation
        model = get_peft_model(
            model,
            LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules=list(lora_targets)),
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
        torch.cuda.init()  # a fresh case process: the allocator's statistics exist only once CUDA is set up
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NeedsGPU(RuntimeError):
    """A benchmark was asked for where no CUDA GPU is visible."""


def exit_status(main: Callable[[], int], prog: str) -> int:
    """`main()`'s exit status for a benchmark module run as ``python -m``: where it needs a GPU
    this machine lacks, one line (``prog: error: ...``) and 2, not a traceback."""
    try:
        return main()
    except NeedsGPU as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def current_cuda_device(bench: str) -> torch.device:
    """The current CUDA device, or :class:`NeedsGPU` saying that `bench` needs one."""
    if not torch.cuda.is_available():
        raise NeedsGPU(f"{bench} needs a CUDA GPU")
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
    memory_snapshot: Path | None = None,
    log: Callable[[str], None] = print,
    lora_targets: Sequence[str] = LORA_TARGETS,
) -> dict[str, Any]:
    """Train one model for `warmup` + `steps` AdamW steps; throughput, peak memory (CUDA only)
    and losses. A failure (out of memory included) is the record's ``error``; an implementation
    that cannot be imported, or does not do `mode`, its ``skipped``. `memory_snapshot`: a folder
    for the allocator record of the case (:mod:`tigon.bench.memory`)."""
    release_memory(device)
    record: dict[str, Any] = {"mode": mode, "impl": impl, "batch": batch, "seq": seq}
    if impl == "unsloth" and mode == "full":
        return {**record, "skipped": "unsloth is measured in lora and qlora modes"}
    model = undo_peer = peak = None
    try:
        if memory_snapshot is not None:
            from tigon.bench.memory import PeakRecord

            if mode == "qlora" or impl == "unsloth":
                saved_model(shape, seq, device)  # written first: making it is not the case's peak
            peak = PeakRecord(batch * seq * (warmup + steps)).__enter__()
        if impl == "unsloth":
            model = build_unsloth(mode, seq, device, shape=shape, lora_rank=lora_rank,
                                  checkpointing="unsloth" if checkpointing else False, lora_targets=lora_targets)
        else:
            model = build_model(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing=checkpointing,
                                lora_targets=lora_targets)
        if impl == "peer":
            undo_peer = apply_peer(model)
        if impl in fp8.IMPLS:
            record["applied"] = fp8.prepare(model, impl)
            log(record["applied"])
        elif impl.startswith("tigon"):
            patched = tigon.patch(model)
            record["applied"] = str(patched)
            log(record["applied"])
            if patched.lora is not None:
                record["lora"] = str(patched.lora)
        if impl in GRAPHS_IMPLS:
            step = captured_micro_step(model)
        else:
            step = micro_step(torch.compile(model, mode=COMPILE_MODES[impl]) if impl in COMPILE_MODES else model)
        record.update(measure_training(model, step, shape["vocab_size"], batch, seq, warmup, steps, sync_steps,
                                       captured_update=impl in GRAPHS_IMPLS))
        record.update(fp8.floor_pct(model, seq, record["tokens_per_s"], device))
    except ImportError as err:  # a peer is measured where it is installed
        if impl not in ("peer", "unsloth"):
            raise
        record["skipped"] = f"{impl} cannot be imported here ({str(err).splitlines()[0][:160]})"
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
    finally:
        if peak is not None:
            peak.__exit__(None, None, None)
            record["memory_snapshot"] = [str(p) for p in peak.dump(memory_snapshot / f"{mode}-{impl}")]
        if model is not None:
            tigon.unpatch(model)
        if undo_peer is not None:
            undo_peer()
        del model
        release_memory(device)
    return record


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of a case's rounds: the median tokens/s and step time, their spread ((max - min) /
    median, in %), the largest peak, the losses of the first round that finished; rounds that
    failed are listed in ``failed_rounds``, and the record is an error only if every round failed."""
    done = [r for r in runs if "tokens_per_s" in r]
    if len(runs) == 1 or not done:
        return {**runs[0], "rounds": len(runs)}
    speeds = [r["tokens_per_s"] for r in done]
    record = {**done[0], "rounds": len(runs), "tokens_per_s": statistics.median(speeds), "tokens_per_s_rounds": speeds,
              "spread_pct": 100 * (max(speeds) - min(speeds)) / statistics.median(speeds),
              "step_ms": statistics.median(r["step_ms"] for r in done), "peak_gib": max(r["peak_gib"] for r in done)}
    if all("gpu_busy_pct" in r for r in done):
        record["gpu_busy_pct"] = statistics.median(r["gpu_busy_pct"] for r in done)
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        record["failed_rounds"] = failed
    return record


def compare(records: list[dict[str, Any]]) -> None:
    """Add speed-up, memory ratio and the largest per-step loss difference against eager, and the
    speed and memory ratios to Unsloth where it ran."""
    eager = {r["mode"]: r for r in records if r["impl"] == "eager" and "losses" in r}
    unsloth = {r["mode"]: r for r in records if r["impl"] == "unsloth" and "tokens_per_s" in r}
    for record in records:
        if "losses" not in record:
            continue
        base = eager.get(record["mode"])
        if base is not None:
            record["vs_eager_speed"] = record["tokens_per_s"] / base["tokens_per_s"]
            record["vs_eager_peak"] = record["peak_gib"] / base["peak_gib"]
            record["max_loss_diff"] = max(abs(a - b) for a, b in zip(record["losses"], base["losses"]))
        peer = unsloth.get(record["mode"])
        if peer is not None and record is not peer:
            record["vs_unsloth_speed"] = record["tokens_per_s"] / peer["tokens_per_s"]
            record["vs_unsloth_peak"] = record["peak_gib"] / peer["peak_gib"]


def format_table(records: list[dict[str, Any]]) -> str:
    """One line per record; the spread column is over its rounds ((max - min) / median tokens/s)."""
    lines = [f"{'mode':<9}{'impl':<20}{'tok/s':>10}{'spread':>8}{'step ms':>9}{'peak GiB':>10}{'speed-up':>10}"
             f"{'peak/eager':>11}{'vs unsloth':>11}{'first loss':>11}{'max |dloss|':>12}{'GPU busy':>9}{'floor':>7}"]
    for r in records:
        head = f"{r['mode']:<9}{r['impl']:<20}"
        if "skipped" in r or "error" in r:
            lines.append(f"{head}  {'skipped: ' + r['skipped'] if 'skipped' in r else r['error']}")
            continue
        spread = f"{r['spread_pct']:.1f}%" if "spread_pct" in r else "-"
        lines.append(
            f"{head}{r['tokens_per_s']:>10.0f}{spread:>8}{r['step_ms']:>9.1f}{r['peak_gib']:>10.2f}"
            + (f"{r['vs_eager_speed']:>9.2f}x{r['vs_eager_peak']:>11.2f}" if "vs_eager_speed" in r
               else f"{'-':>10}{'-':>11}")
            + (f"{r['vs_unsloth_speed']:>10.2f}x" if "vs_unsloth_speed" in r else f"{'-':>11}")
            + f"{r['losses'][0]:>11.4f}"
            + (f"{r['max_loss_diff']:>12.4f}" if "max_loss_diff" in r else f"{'-':>12}")
            + (f"{r['gpu_busy_pct']:>8.0f}%" if "gpu_busy_pct" in r else f"{'-':>9}")
            + (f"{r['floor_pct']:>6.0f}%" if "floor_pct" in r else f"{'-':>7}")
            + (f"  ({len(r['failed_rounds'])} of {r['rounds']} rounds failed: {r['failed_rounds'][0]})"
               if "failed_rounds" in r else "")
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
    lora_targets: Sequence[str] = LORA_TARGETS,
    checkpointing: bool = False,
    sync_steps: bool = False,
    rounds: int = 1,
    memory_snapshot: Path | None = None,
    case_timeout_s: float | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    shape: dict = LLAMA_1B,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """Run every (mode, impl) pair on the current CUDA device (or `device`: a CPU run of a small
    `shape` checks the pipeline, not speed) `rounds` times, taking turns; print a table,
    optionally write ``e2e.json`` to `out_dir`, and return the records (one per pair, combined
    over its rounds). With more than one round every case runs in a fresh process (Unsloth's
    always does), given `case_timeout_s` at most."""
    cadence = "synchronised around each step" if sync_steps else "each loss read after its backward, as the HF Trainer does"
    settings = dict(
        batch=batch, seq=seq, steps=steps, warmup=warmup, lora_rank=lora_rank, lora_targets=list(lora_targets),
        checkpointing=checkpointing, sync_steps=sync_steps, shape=shape, rounds=rounds,
    )

    def run_one(mode: str, impl: str, device: torch.device) -> dict[str, Any]:
        if rounds == 1 and impl != "unsloth":
            return run_case(
                mode, impl, device, batch=batch, seq=seq, steps=steps, warmup=warmup, shape=shape, lora_rank=lora_rank,
                checkpointing=checkpointing, sync_steps=sync_steps, memory_snapshot=memory_snapshot, log=log,
                lora_targets=lora_targets,
            )
        argv = ["--case", mode, impl, "--device", str(device), "--shape", json.dumps(shape), "--batch", str(batch),
                "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup), "--lora-rank", str(lora_rank),
                "--lora-targets", *lora_targets]
        argv += ["--checkpointing"] * checkpointing + ["--sync-steps"] * sync_steps
        argv += ["--memory-snapshot", str(memory_snapshot)] if memory_snapshot is not None else []
        return run_isolated("tigon.bench.e2e", argv, {"mode": mode, "impl": impl, "batch": batch, "seq": seq},
                            timeout_s=case_timeout_s)

    return run_all(
        "e2e bench", "the end-to-end benchmark", modes, impls, (MODES, IMPLS), run_one, settings=settings,
        summary=f"batch {batch} x {seq} tokens, {steps} timed steps after {warmup}, {cadence}"
        + (f", {rounds} interleaved rounds, each case in its own process" if rounds > 1 else ""),
        out_dir=out_dir, out_name="e2e.json", log=log, device=device, rounds=rounds,
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
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """``run_one(mode, impl, device)`` for every pair (`known`: the valid modes and impls), over
    `rounds` rounds in which the implementations take turns (round r starts r places further along
    `impls`, so none always runs first or right after the same neighbour); each run is logged as
    it ends, then the table of each pair's rounds combined (:func:`combine_rounds`) and compared
    with eager. ``out_dir/out_name`` gets the environment, `settings` and the records. `needs` names
    the bench in the no-GPU error. A skipped pair (its package missing) is not run again."""
    for name, values, valid in (("modes", modes, known[0]), ("impls", impls, known[1])):
        unknown = [v for v in values if v not in valid]
        if unknown:
            raise ValueError(f"{name} must be among {', '.join(valid)}, got {', '.join(unknown)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    device = device or current_cuda_device(needs)
    env = environment(device)
    import transformers

    env["transformers"] = transformers.__version__
    log(f"tigon {title} on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}): {summary}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(mode, impl): [] for mode in modes for impl in impls}
    for turn in range(rounds):
        for mode in modes:
            for impl in [*impls[turn % len(impls):], *impls[: turn % len(impls)]]:
                if any("skipped" in r for r in runs[(mode, impl)]):
                    continue
                runs[(mode, impl)].append(run_one(mode, impl, device))
                done = [combine_rounds(cases) for cases in runs.values() if cases]
                compare(done)
                row = format_table([r for r in done if (r["mode"], r["impl"]) == (mode, impl)])
                log(f"round {turn + 1}/{rounds} (median so far) {row.splitlines()[-1]}" if rounds > 1 else row)
    records = [combine_rounds(cases) for cases in runs.values()]
    compare(records)
    log("\n" + format_table(records))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / out_name).write_text(json.dumps({"environment": env, "settings": settings, "results": records}, indent=1))
        log(f"wrote {out_dir / out_name}")
    return records


def shape_arg(text: str) -> dict:
    """--shape: a name in SHAPES or a JSON object of LlamaConfig fields."""
    if text in SHAPES:
        return SHAPES[text]
    try:
        shape = json.loads(text)
    except json.JSONDecodeError:
        shape = None
    if not isinstance(shape, dict):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SHAPES)} or give a JSON object, got {text!r}")
    return shape


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                        help="full, lora, qlora (LoRA on an NF4 base), lora-fp8 (LoRA on an FP8 base; default full lora)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=["eager", "tigon"])
    parser.add_argument("--shape", type=shape_arg, default=LLAMA_1B, help="1b (default) or 8b: the Llama shape")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-targets", nargs="+", choices=LORA_TARGETS, default=list(LORA_TARGETS),
                        help="the projections that get adapters (default: every linear of a layer)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (long context)")
    parser.add_argument("--sync-steps", action="store_true",
                        help="synchronise around every step instead of reading each loss after its backward")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each case this many times, implementations taking turns, each run in its own "
                             "process; rows report the median tok/s, its spread and the largest peak")
    parser.add_argument("--case-timeout", type=float, metavar="S", help="with --rounds > 1: seconds a case may run")
    parser.add_argument("--memory-snapshot", metavar="DIR",
                        help="write each case's CUDA allocator record and what is live at its peak to DIR "
                             "(MODE-IMPL.pickle and .txt; use with --steps 1 --warmup 1)")
    parser.add_argument("--out", metavar="DIR", help="write e2e.json here")
    # one case in this process, its record written as JSON to FILE (how --rounds runs each case)
    parser.add_argument("--case", nargs=2, metavar=("MODE", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument("--record", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    snapshot = Path(args.memory_snapshot) if args.memory_snapshot else None
    device = torch.device(args.device) if args.device else None
    if snapshot is not None and not (torch.cuda.is_available() and (device is None or device.type == "cuda")):
        parser.error("--memory-snapshot records CUDA's allocator: run it on a machine with a GPU")
    if args.case:
        mode, impl = args.case
        record = run_case(mode, impl, device or current_cuda_device("the end-to-end benchmark"), batch=args.batch,
                          seq=args.seq, steps=args.steps, warmup=args.warmup, shape=args.shape, lora_rank=args.lora_rank,
                          checkpointing=args.checkpointing, sync_steps=args.sync_steps, memory_snapshot=snapshot,
                          log=lambda line: None, lora_targets=args.lora_targets)
        Path(args.record).write_text(json.dumps(record))
        return 0
    records = run_e2e(
        args.modes, args.impls, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup,
        lora_rank=args.lora_rank, lora_targets=args.lora_targets, checkpointing=args.checkpointing,
        sync_steps=args.sync_steps, rounds=args.rounds,
        memory_snapshot=snapshot, case_timeout_s=args.case_timeout, shape=args.shape, device=device,
        out_dir=Path(args.out) if args.out else None,
    )
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main, "python -m tigon.bench.e2e"))
