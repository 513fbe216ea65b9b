"""Reward-model training benchmark: `tigon rlhf --method rm`'s trainer on the patched model against
TRL's `RewardTrainer` (the peer) on the same model, data and optimizer.

The model is the 1B Llama shape of the end-to-end benchmark (`tigon.bench.e2e.LLAMA_1B`) as a
sequence classifier with one output, random weights, bf16, SDPA, PEFT LoRA r=16 (alpha 32) on
every decoder linear with the head trained whole (PEFT's ``SEQ_CLS`` task). Each step is
``--pairs`` pairs of two ``--seq``-token sequences of random tokens. Implementations:

* ``peer``: TRL's RewardTrainer as it is, on the unpatched model;
* ``compile``: the same with ``torch_compile`` (the Trainer compiles the model);
* ``eager``: tigon's reward trainer (the head read at each sequence's last token, the host-side
  step loop) on the unpatched model: what the trainer alone brings;
* ``tigon``: the same on the model patched by `tigon.patch` (``tigon rlhf --method rm``).

Throughput is trained tokens per second from the end of the warm-up steps to the end of training
(the Trainer's own loop, one log at the end). Peak is ``torch.cuda.max_memory_allocated()`` from
building the model on, in GiB. ``tigon bench --reward`` runs the defaults; ``python -m
tigon.bench.reward --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tigon.bench.e2e import LLAMA_1B, LORA_TARGETS, _sync, current_cuda_device, release_memory
from tigon.bench.harness import environment

IMPLS = ("peer", "compile", "eager", "tigon")
PAD = 0  # the pad id the models get; the random tokens never take it


def _model(shape: dict[str, Any], seq: int, device: torch.device, lora_rank: int, seed: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    from tigon.train.tiny import random_model

    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 8192), use_cache=False, num_labels=1,
                         pad_token_id=PAD)
    config._attn_implementation = "sdpa"
    model = random_model(config, seed, device=device, dtype=torch.bfloat16, auto=AutoModelForSequenceClassification)
    torch.manual_seed(seed)  # the adapters' initialisation, the same for every implementation
    return get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                            target_modules=list(LORA_TARGETS), task_type="SEQ_CLS"))


def _tokenizer() -> Any:
    """A tokenizer whose pad token has id `PAD` (RewardTrainer sets the model's pad id from it); the
    rows are token ids already."""
    from tigon.train.data import Sample
    from tigon.train.tiny import build_tokenizer

    tokenizer = build_tokenizer([Sample("", text="a reward model benchmark")])
    assert tokenizer.pad_token_id == PAD
    return tokenizer


def _rows(n_pairs: int, seq: int, vocab: int, seed: int) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(PAD + 1, vocab, (n_pairs, 2, seq), generator=generator)
    return Dataset.from_dict({"chosen_ids": ids[:, 0].tolist(), "rejected_ids": ids[:, 1].tolist()})


class _Clock:
    """A TrainerCallback timing the steps after the first `warmup` (the GPU drained at both ends)."""

    def __init__(self, warmup: int, device: torch.device):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == warmup:
                    _sync(device)
                    clock.start = time.perf_counter()

            def on_train_end(self, args, state, control, **kwargs):
                _sync(device)
                clock.end = time.perf_counter()

        self.callback = Callback()
        self.start = self.end = 0.0


def run_case(impl: str, *, pairs: int, seq: int, steps: int, warmup: int, lora_rank: int, seed: int,
             device: torch.device, shape: dict[str, Any] = LLAMA_1B) -> dict[str, Any]:
    """One implementation's run: tokens/s, step time, peak memory (on a CUDA device) and the mean
    training loss. `shape`: the Llama's config fields (the tests' is tiny)."""
    from trl import RewardConfig, RewardTrainer

    import tigon
    from tigon.train.fused import checkpointing_off
    from tigon.train.reward import RewardCollator, TigonRewardTrainer

    release_memory(device)
    model = _model(shape, seq, device, lora_rank, seed)
    if impl == "tigon":
        tigon.patch(model)
    tokenizer = _tokenizer()
    total = warmup + steps
    data = _rows(pairs * total, seq, shape["vocab_size"], seed)
    clock = _Clock(warmup, device)
    with tempfile.TemporaryDirectory() as out:
        args = RewardConfig(output_dir=out, per_device_train_batch_size=pairs, max_steps=total, learning_rate=1e-4,
                            bf16=True, use_cpu=device.type == "cpu", logging_steps=total, save_strategy="no",
                            report_to="none",
                            **checkpointing_off(RewardConfig), max_length=None, disable_tqdm=True, seed=seed,
                            data_seed=seed, torch_compile=impl == "compile",
                            dataloader_pin_memory=device.type == "cuda",
                            remove_unused_columns=False)
        if impl in ("peer", "compile"):
            trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                    callbacks=[clock.callback])
        else:
            args.include_num_input_tokens_seen = "no"
            trainer = TigonRewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                         data_collator=RewardCollator(PAD), callbacks=[clock.callback])
        trainer.train()
    loss = next((r["train_loss"] for r in reversed(trainer.state.log_history) if "train_loss" in r), None)
    seconds = clock.end - clock.start
    tokens = steps * pairs * 2 * seq
    record = {"impl": impl, "tok_s": tokens / seconds, "step_ms": 1e3 * seconds / steps,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
              "train_loss": loss}
    del trainer, model
    return record


def run_reward(impls: list[str] | None = None, *, pairs: int = 8, seq: int = 1024, steps: int = 10, warmup: int = 3,
               lora_rank: int = 16, seed: int = 0, out_dir: Path | None = None) -> list[dict[str, Any]]:
    """Run each implementation, print a table (ratios against the peer) and write reward.json to
    `out_dir`; a failing case is recorded with its error."""
    device = current_cuda_device("tigon bench --reward")
    records = []
    for impl in impls or IMPLS:
        try:
            records.append(run_case(impl, pairs=pairs, seq=seq, steps=steps, warmup=warmup, lora_rank=lora_rank,
                                    seed=seed, device=device))
        except Exception as err:  # one case failing (out of memory, compile) leaves the others to run
            records.append({"impl": impl, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
    peer = next((r for r in records if r["impl"] == "peer" and "error" not in r), None)
    print(f"reward model, Llama 1B shape, LoRA r={lora_rank}, {pairs} pairs x 2 x {seq} tokens, {steps} timed steps "
          f"after {warmup}, bf16")
    print(f"{'impl':<8} {'tok/s':>9} {'step ms':>9} {'peak GiB':>9} {'vs peer':>8} {'peak vs peer':>13} {'loss':>8}")
    for r in records:
        if "error" in r:
            print(f"{r['impl']:<8} error: {r['error']}")
            continue
        speed = f"{r['tok_s'] / peer['tok_s']:.2f}x" if peer else "-"
        memory = f"{r['peak_gib'] / peer['peak_gib']:.2f}x" if peer else "-"
        loss = f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-"
        print(f"{r['impl']:<8} {r['tok_s'] / 1e3:>8.1f}k {r['step_ms']:>9.1f} {r['peak_gib']:>9.2f} {speed:>8} "
              f"{memory:>13} {loss:>8}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "reward.json").write_text(json.dumps({"environment": environment(device), "records": records},
                                                        indent=1) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.reward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--pairs", type=int, default=8, help="pairs per step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", metavar="DIR", help="write reward.json here")
    args = parser.parse_args(argv)
    records = run_reward(args.impls, pairs=args.pairs, seq=args.seq, steps=args.steps, warmup=args.warmup,
                         lora_rank=args.lora_rank, out_dir=Path(args.out) if args.out else None)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.reward"))
