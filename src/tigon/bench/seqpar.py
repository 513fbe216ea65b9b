"""Sequence-parallel benchmark: one long sequence split over the GPUs of a ``torchrun`` group by
DeepSpeed's Ulysses, as ``tigon sft --sequence-parallel N`` runs it (the Hugging Face Trainer,
`tigon.train.seqpar`), against one GPU without it.

The setting of issue 45's targets: the Llama-3-8B shape (bf16, SDPA), PEFT LoRA r=16 on every
linear layer, gradient checkpointing, batch 1, random tokens, AdamW, one warm-up step and timed
steps after it. Variants (each on the same engine):

* ``eager``: transformers' and PEFT's own code;
* ``tigon``: ``tigon.patch(model)``;
* ``long``: ``tigon.patch(model, offload_activations=True, tiled_mlp=True)``;
* ``peer``: Liger-Kernel's patch (`tigon.bench.e2e.apply_peer`).

Run once per (variant, length); a length that does not fit ends with an error record. Under
``torchrun --nproc-per-node N`` the sequence is split N ways; run alone, the same Trainer trains on
one GPU. Rank 0 prints one JSON record and appends it to ``seqpar.json`` in ``--out``: tokens,
GPUs, seconds per step, tokens/s per GPU, the largest peak of the ranks' allocated memory (GB).
The targets compare records: the longest length that fits on N GPUs against the one on one GPU,
and tok/s per GPU at 128K on 2 GPUs against one GPU's at 64K.

    torchrun --nproc-per-node 2 -m tigon.bench.seqpar --seq 131072 --variant long
    python -m tigon.bench.seqpar --seq 65536 --variant long
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tigon.bench.e2e import LLAMA_1B, apply_peer, build_model, current_cuda_device

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
# tigon.patch's switches per variant (eager and peer are not tigon's).
VARIANTS: dict[str, dict[str, bool]] = {"eager": {}, "tigon": {}, "long": {"offload_activations": True, "tiled_mlp": True},
                                        "peer": {}}
RESULTS = "seqpar.json"


def _timer() -> Any:
    """A Trainer callback keeping each optimizer step's wall time (the GPU waited for at both ends)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.started)

    return StepTimes()


def run(seq: int, variant: str, shape: str, lora_rank: int, steps: int, out: Path) -> dict[str, Any]:
    """`steps` timed LoRA steps (after one warm-up) of one `seq`-token row split over this
    torchrun group (or on one GPU); returns rank 0's record (others: {})."""
    from transformers import TrainingArguments

    import tigon
    from tigon.train import seqpar
    from tigon.train.batching import Collator, TokenDataset
    from tigon.train.trainer import TigonTrainer

    device = current_cuda_device("tigon.bench.seqpar")
    gpus = seqpar.world_size()
    dims = SHAPES[shape]
    record: dict[str, Any] = {"variant": variant, "shape": shape, "seq": seq, "gpus": gpus,
                              "device": torch.cuda.get_device_name(device)}
    model = build_model("lora", seq, device, shape=dims, lora_rank=lora_rank, checkpointing=True)
    extra = {}
    if gpus > 1:
        seqpar.check_model(gpus, model.config)
        seqpar.prepare_model(model, packing=False)
        extra = seqpar.trainer_arguments(gpus)
    if variant == "peer":
        apply_peer(model)
    elif variant != "eager":
        tigon.patch(model, **VARIANTS[variant])
    total = 1 + steps
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in
            torch.randint(0, dims["vocab_size"], (total * gpus, seq), generator=gen).tolist()]
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=1, max_steps=total,
                             learning_rate=1e-5, bf16=True, report_to=[], save_strategy="no", logging_steps=total,
                             disable_tqdm=True, remove_unused_columns=False, **extra)
    timer = _timer()
    trainer = TigonTrainer(model=model, args=args, train_dataset=TokenDataset(rows),
                           data_collator=Collator(0, shards=gpus), callbacks=[timer])
    try:
        trainer.train()
        timed = timer.times[1:]
        record["step_s"] = sum(timed) / len(timed)
        record["tok_s_per_gpu"] = seq / record["step_s"] / gpus
    except torch.cuda.OutOfMemoryError as err:
        record["error"] = f"OutOfMemoryError: {str(err).splitlines()[0][:160]}"
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9], device=device)
    if gpus > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    record["peak_gb"] = peak.item()
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    records = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(records + [record], indent=1) + "\n")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.seqpar", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, required=True, help="tokens of the one row (a multiple of the GPUs)")
    parser.add_argument("--variant", choices=list(VARIANTS), default="long")
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args(argv)
    try:
        record = run(args.seq, args.variant, args.shape, args.lora_rank, args.steps, args.out)
    except (RuntimeError, ValueError) as err:
        print(f"tigon.bench.seqpar: {str(err).splitlines()[0]}")
        return 2
    if record:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.seqpar"))
