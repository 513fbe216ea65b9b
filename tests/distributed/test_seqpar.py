"""``--sequence-parallel``: the step of DeepSpeed's Ulysses over 2 gloo CPU processes, tigon's
kernels on, against the same steps in one process on the same batches: the logged losses, and
every trained parameter after two plain-SGD steps without clipping (which carry both steps'
gradients, each scaled by the learning rate)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn

pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"),
    pytest.mark.xdist_group("seqpar"),  # two processes each: not beside the rest of the suite's workers
]

VOCAB, LR = 96, 0.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sample(gen: torch.Generator, length: int, prompt: int) -> dict[str, list[int]]:
    ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}


def _rows(packing: bool) -> list[dict[str, list[int]]]:
    """Two steps' rows. Unpacked, one row a step: a 16-token row whose labels start at token 8,
    the border of 2 shards (its first label is the last token of shard 0 after the shift), then a
    15-token row (padded to 16) whose shard 0 has no label at all. Packed: rows of two or three
    samples, their positions restarting at each, of lengths that pad unevenly."""
    gen = torch.Generator().manual_seed(3)
    if not packing:
        return [_sample(gen, 16, 8), _sample(gen, 15, 10)]
    rows = []
    for lengths in ((5, 7, 6), (9, 4), (6, 6, 3), (8, 9)):
        parts = [_sample(gen, n, 2) for n in lengths]
        rows.append({"input_ids": sum((p["input_ids"] for p in parts), []),
                     "labels": sum((p["labels"] for p in parts), []),
                     "position_ids": sum((list(range(n)) for n in lengths), [])})
    return rows


def _train(out: str, sp: int, packing: bool, lora: bool) -> None:  # unpacked: with the long-context switches
    """Two steps of the run (sp > 1: this process is one of the Ulysses group); writes the logged
    losses and the trained parameters (rank 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import tigon
    from tigon.train import seqpar
    from tigon.train.batching import Collator, TokenDataset
    from tigon.train.trainer import TigonTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights="gaussian"))
    extra = {}
    if sp > 1:
        seqpar.check_model(sp, model.config)
        seqpar.prepare_model(model, packing)
        extra = seqpar.trainer_arguments(sp)
    if not packing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tigon.patch(model, offload_activations=not packing, tiled_mlp=not packing)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2 if packing else 1, max_steps=2,
                             learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                             use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, seed=0, **extra)
    trainer = TigonTrainer(model=model, args=args, train_dataset=TokenDataset(_rows(packing)),
                           data_collator=Collator(0, shards=sp))
    trainer.train()
    if args.process_index == 0:
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        Path(out, "losses.json").write_text(json.dumps(losses))
        torch.save({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                   Path(out, "params.pt"))


def _worker(rank: int, world: int, port: int, out: str, packing: bool, lora: bool) -> None:
    # What torchrun sets for each process.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _train(out, world, packing, lora)


def _compare(tmp_path: Path, packing: bool, lora: bool, world: int = 2) -> None:
    split, whole = tmp_path / "split", tmp_path / "whole"
    spawn(_worker, args=(world, _free_port(), str(split), packing, lora), nprocs=world)
    _train(str(whole), 1, packing, lora)
    got, want = (json.loads(Path(d, "losses.json").read_text()) for d in (split, whole))
    assert len(got) == 2 and got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    params, reference = (torch.load(Path(d, "params.pt")) for d in (split, whole))
    assert params.keys() == reference.keys() and reference
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_split_sequence_step_equals_the_whole_one(tmp_path):
    """Full fine-tuning, one row a step: prompt tokens ignored, the first label at the shards'
    border, a shard without labels, a row padded to a multiple of 2; gradient checkpointing with
    the activations offloaded and the tiled MLP."""
    _compare(tmp_path, packing=False, lora=False)


def test_split_packed_lora_step_equals_the_whole_one(tmp_path):
    """LoRA, packed rows (per-sample positions, samples kept apart across the all-to-all), two
    rows a step padded to a multiple of 2."""
    _compare(tmp_path, packing=True, lora=True)




def test_four_way_split_lora_step_equals_the_whole_one(tmp_path):
    """LoRA over 4 ranks, more than the model's 2 key/value heads (Ulysses replicates them): the
    first label of the first row at the border of shards 1 and 2, the second row's labels all in
    its last shards."""
    _compare(tmp_path, packing=False, lora=True, world=4)


def _sft_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from tigon.cli import main

    assert main(argv) == 0


def test_sft_command_splits_packed_rows_as_one_process_trains_them(tmp_path):
    """`tigon sft --sequence-parallel 2 --packing` on the built-in model, kernels on, under two
    processes: its logged losses, evaluation loss and final weights are those of `tigon sft` in one
    process."""
    from safetensors.torch import load_file

    from tigon.cli import main
    from tigon.train import tiny

    def argv(out: Path) -> list[str]:
        return ["sft", "--dataset", f"{tiny.BUNDLED_DATASET}#24", "--packing", "--max-length", "40", "--batch-size",
                "2", "--max-steps", "2", "--save-steps", "0", "--samples", "0", "--eval-split", "0.25", "--output-dir", str(out)]

    spawn(_sft_worker, args=(2, _free_port(), argv(tmp_path / "split") + ["--sequence-parallel", "2"]), nprocs=2)
    assert main(argv(tmp_path / "whole")) == 0
    for key, count in (("loss", 2), ("eval_loss", 1)):  # evaluation runs each rank's rows whole
        logged = [[json.loads(line)[key] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
                   if key in json.loads(line)] for d in ("split", "whole")]
        assert len(logged[1]) == count and logged[0] == pytest.approx(logged[1], rel=1e-5), (key, logged)
    split, whole = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("split", "whole"))
    # DeepSpeed's save writes the tied output matrix too: the embedding's, as the model loads it.
    torch.testing.assert_close(split.pop("lm_head.weight", split["model.embed_tokens.weight"]),
                               split["model.embed_tokens.weight"], rtol=0, atol=0)
    assert split.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-5)


# --- refusals, one line each, before anything loads ---------------------------------------------

@pytest.mark.parametrize("world, n, words", [("1", "2", "processes (1) must be a multiple"),
                                             ("4", "3", "processes (4) must be a multiple"),
                                             ("2", "0", "must be >= 1")])
def test_sequence_parallel_refuses_a_group_it_cannot_split(monkeypatch, capsys, tmp_path, world, n, words):
    from tigon.cli import main

    monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["sft", "--sequence-parallel", n, "--output-dir", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "--sequence-parallel" in err[0], err
    assert not (tmp_path / "out").exists()


def test_sequence_parallel_refusals(monkeypatch):
    from transformers import LlamaConfig

    from tigon.train import seqpar
    from tigon.train.config import RLHFConfig, SFTConfig, SFTError, resolve, resolve_rlhf

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SFTError, match="--cuda-graphs with --sequence-parallel"):
        resolve(SFTConfig(sequence_parallel=2, cuda_graphs=True))
    with pytest.raises(SFTError, match="not for --task classification"):
        resolve(SFTConfig(sequence_parallel=2, task="classification"))
    from tigon.train.vision_run import vision_settings

    vision_refusal = "--sequence-parallel: not for vision-language models"
    with pytest.raises(SFTError, match=vision_refusal):
        resolve(SFTConfig(sequence_parallel=2, modality="vision"))
    with pytest.raises(SFTError, match=vision_refusal):  # found so: a --model whose config has a vision_config
        vision_settings(SFTConfig(sequence_parallel=2))
    for method in ("dpo", "kto", "orpo", "rm"):
        with pytest.raises(SFTError, match=f"--method {method} scores each whole sequence"):
            resolve_rlhf(RLHFConfig(method=method, sequence_parallel=2))
    resolve(SFTConfig(sequence_parallel=2))  # what the tests above run
    import transformers.integrations.deepspeed as hf_deepspeed

    with monkeypatch.context() as patched:  # transformers before its Trainer took DeepSpeed's SP
        patched.delattr(hf_deepspeed, "deepspeed_sp_compute_loss")
        with pytest.raises(SFTError, match=r"this transformers has no DeepSpeed sequence parallelism \(pip install -U"):
            resolve(SFTConfig(sequence_parallel=2))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(SFTError, match=r"not installed \(pip install deepspeed\)"):
        resolve(SFTConfig(sequence_parallel=2))
    with pytest.raises(SFTError, match="6 attention heads do not divide among 4"):
        seqpar.check_model(4, LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(SFTError, match="3 key/value heads neither divide among 2"):
        seqpar.check_model(2, LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3))
    seqpar.check_model(4, LlamaConfig(num_attention_heads=8, num_key_value_heads=2))  # kv heads replicated


def test_collator_pads_to_whole_shards_with_positions():
    from tigon.train.batching import Collator

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8] * 6, "labels": [8] * 6}]
    batch = Collator(0, shards=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8] * 6 + [0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7] + [-100] * 5, [8] * 6 + [-100] * 2]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2 and "attention_mask" not in batch
    packed = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "position_ids": [0, 1, 0]}]
    assert Collator(0, shards=2)(packed)["position_ids"].tolist() == [[0, 1, 0, 0]]
