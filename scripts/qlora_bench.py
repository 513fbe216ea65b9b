"""QLoRA / DoRA training steps: tigon's fused ops vs PEFT (+ bitsandbytes) eager vs Liger-Kernel on
PEFT, on one model loaded once (random weights, saved and loaded through transformers as a user's
model is, quantised by bitsandbytes if asked). Per implementation: the same initial adapters, the
same random token batches, AdamW, bf16 autocast; tokens/s over the timed steps, peak GPU memory
(weights included), and the per-step losses. With --seq-sweep, peak memory and tokens/s at batch 1
over those sequence lengths too.

    python3 scripts/qlora_bench.py --shape 8b --quant nf4 --checkpointing --out gpu-out/qlora-8b.json
    python3 scripts/qlora_bench.py --shape 1b --variant dora --out gpu-out/dora-1b.json

Liger-Kernel runs last (its patches cannot be undone) and only where it is importable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama-3-8B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    # the 1B Llama (tigon.bench.e2e.LLAMA_1B)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    # a CPU smoke run of this script
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def saved_model(work: Path, shape: str, max_len: int) -> Path:
    """A random Llama of `shape` in bf16 under `work` (written once; filled on the GPU, where an 8B
    initialisation takes seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = work / f"llama-{shape}"
    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(8192, max_len))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return path


def load(path: Path, quant: str | None, dtype: torch.dtype, device: torch.device, rank: int, variant: str,
         checkpointing: bool):
    """The PEFT model on `path`, as `tigon sft` builds it (tigon.train.modeling)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tigon.train.modeling import prepare_quantized, quantization_config

    kwargs = {}
    if quant is not None:
        kwargs = dict(quantization_config=quantization_config(quant, dtype), device_map={"": str(device)})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kwargs)
    if quant is None:
        model.to(device)
    model.config.use_cache = False
    if quant is not None:
        prepare_quantized(model, checkpointing)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM",
                      use_dora=variant == "dora")
    return get_peft_model(model, lora).train()


def train_step(model, ids: torch.Tensor, optimizer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def steps(model, batches: list[torch.Tensor], warmup: int, dtype: torch.dtype, device: torch.device,
          inspect: tuple[str, ...] = ()) -> dict:
    """Train on `batches` (the first `warmup` untimed); tokens/s of the rest, peak memory, losses.
    `inspect` adds steps after them: "memory" prints what is live at one step's memory peak,
    "profile" the kernels of two steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, start = [], None
    for i, ids in enumerate(batches):
        if i == warmup:
            torch.cuda.synchronize() if cuda else None
            start = time.perf_counter()
        losses.append(train_step(model, ids, optimizer, dtype, device))
    torch.cuda.synchronize() if cuda else None
    seconds = time.perf_counter() - start
    if "memory" in inspect:
        from tigon.bench.memory import PeakRecord

        with PeakRecord(batches[0].numel()) as record:
            train_step(model, batches[-1], optimizer, dtype, device)
        print(record.report(), flush=True)
    if "profile" in inspect:
        from kernel_report import report_profile

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for ids in batches[-2:]:
                train_step(model, ids, optimizer, dtype, device)
            torch.cuda.synchronize()
        report_profile(prof, 2)
    timed = sum(b.numel() for b in batches[warmup:])
    out = {"tokens_per_s": round(timed / seconds, 1), "losses": [round(float(x), 5) for x in losses]}
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    del optimizer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--quant", choices=["nf4", "fp4", "int8"], default=None)
    parser.add_argument("--variant", choices=["lora", "dora"], default="lora")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    parser.add_argument("--seq-sweep", default="", help="comma-separated lengths, batch 1, 2 timed steps each")
    parser.add_argument("--impls", default="tigon,peft,liger")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--work", default="/tmp/qlora-bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--prep-only", action="store_true", help="only write the random model under --work")
    parser.add_argument("--inspect", nargs="*", choices=["memory", "profile"], default=[],
                        help="after the timed steps: what is live at a step's memory peak, the kernels of two steps")
    args = parser.parse_args()
    if args.inspect and not torch.cuda.is_available():
        parser.error("--inspect reads CUDA's allocator record and kernel profile: run it on a machine with a GPU")

    import tigon

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    sweep = [int(s) for s in args.seq_sweep.split(",") if s]
    path = saved_model(Path(args.work), args.shape, max([args.seq, *sweep]))
    if args.prep_only:
        return
    model = load(path, args.quant, dtype, device, args.rank, args.variant, args.checkpointing)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    sweeps = {n: [torch.randint(0, vocab, (1, n), generator=gen).to(device) for _ in range(3)] for n in sweep}
    result = {"settings": vars(args), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "runs": {}}
    for impl in [s for s in args.impls.split(",") if s]:
        model.load_state_dict(initial, strict=False)
        run: dict = {}
        try:
            if impl == "tigon":
                tigon.patch(model)
            elif impl == "liger":
                from liger_kernel.transformers import apply_liger_kernel_to_llama

                apply_liger_kernel_to_llama(model=model.get_base_model())
            elif impl != "peft":
                raise ValueError(f"--impls: unknown {impl!r}; choose from tigon, peft, liger")
            run = steps(model, batches, args.warmup, dtype, device, tuple(args.inspect))
            run["sweep"] = {n: steps(model, b, 1, dtype, device) for n, b in sweeps.items()}
        except ImportError as err:
            run = {"error": f"not installed: {err}"}
        except Exception as err:  # one implementation failing (out of memory, a peer's bug) spoils no other's figures
            run.setdefault("error", f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}")
        finally:
            if impl == "tigon":
                tigon.unpatch(model)
        result["runs"][impl] = run
        print(impl, json.dumps({k: v for k, v in run.items() if k != "sweep"}), flush=True)
        for n, r in run.get("sweep", {}).items():
            print(f"  seq {n}: {r.get('tokens_per_s')} tok/s, peak {r.get('peak_gib')} GiB", flush=True)
    runs = result["runs"]
    if "tigon" in runs and "peft" in runs and "tokens_per_s" in runs["tigon"] and "tokens_per_s" in runs["peft"]:
        t, p = runs["tigon"], runs["peft"]
        result["tigon_vs_peft"] = {
            "speedup": round(t["tokens_per_s"] / p["tokens_per_s"], 3),
            "peak_ratio": round(t["peak_gib"] / p["peak_gib"], 3) if "peak_gib" in t else None,
            "max_loss_diff": max(abs(a - b) for a, b in zip(t["losses"], p["losses"])),
        }
        print("tigon vs peft:", json.dumps(result["tigon_vs_peft"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
