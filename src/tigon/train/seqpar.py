"""``--sequence-parallel N``: one sequence split over N processes, by DeepSpeed's Ulysses (ALST) as
the Hugging Face Trainer integrates it.

The Trainer, given a ``ParallelismConfig(sp_backend="deepspeed")``, wraps the training dataloader
in DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (each batch's ``input_ids``, ``position_ids`` and
labels cut along the sequence, the labels shifted before the cut into ``shift_labels``, so a label
at a shard's border belongs to the right token), puts an all-to-all around the model's attention
function (each rank attends over the whole sequence for 1/N of the heads) and weighs each rank's
mean loss by its count of labelled tokens across the group. Everything else in the model runs on
the rank's shard alone, tigon's kernels included: RoPE reads the shard's true positions from
``position_ids`` (which the collator always gives under SP), the fused linear + cross-entropy reads
``shift_labels``.

Why this engine: it works on the Trainer, PEFT models and tigon's patched forwards as they are (it
replaces only the attention function's entry); torch's context parallelism needs CUDA SDPA and
DTensor-sharded modules, and a home-made one would have to be proven exact again."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from tigon.train.config import SFTError

# The Ulysses all-to-all drops every attention mask and attends causally over the gathered
# sequence; packed rows need their samples kept apart, which `_packed_sdpa` does from positions.
# Its wrapper of sdpa, once installed in this process (an n x n mask per row: packing is for
# rows of ordinary length, a long single sequence needs none).
_installed: list[Any] = []


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_settings(n: int, *, cuda_graphs: bool) -> None:
    """Refuse, in one line each, what --sequence-parallel `n` cannot run with (before any loading)."""
    if n < 1:
        raise SFTError(f"--sequence-parallel must be >= 1, got {n}")
    if n == 1:
        return
    ranks = world_size()
    if ranks < n or ranks % n:
        raise SFTError(f"--sequence-parallel {n}: the processes ({ranks}) must be a multiple of it: launch with "
                       f"torchrun --nproc-per-node {n} (or accelerate launch --num-processes {n})")
    if importlib.util.find_spec("deepspeed") is None:
        raise SFTError(f"--sequence-parallel {n}: runs on DeepSpeed's Ulysses, which is not installed "
                       "(pip install deepspeed)")
    try:
        from accelerate.utils import DeepSpeedSequenceParallelConfig  # noqa: F401
        from transformers.integrations.deepspeed import deepspeed_sp_compute_loss  # noqa: F401
    except ImportError as err:
        package = "accelerate" if "accelerate" in str(err) else "transformers"
        raise SFTError(f"--sequence-parallel {n}: this {package} has no DeepSpeed sequence parallelism "
                       f"(pip install -U {package})") from None
    if cuda_graphs:
        raise SFTError("--cuda-graphs with --sequence-parallel: a captured step cannot hold the all-to-alls "
                       "between the processes; give one or the other")


def method_refusal(method: str) -> SFTError:
    """The line refusing --sequence-parallel for a `tigon rlhf` method, none of which splits exactly."""
    return SFTError(f"--sequence-parallel: --method {method} scores each whole sequence (its summed "
                    "log-probability or last token), which no shard holds, and TRL's trainer has no sequence "
                    f"parallelism; train {method} without --sequence-parallel (tigon sft takes it)")


def check_model(n: int, config: Any) -> None:
    """Refuse a model whose heads the all-to-all cannot split over `n` ranks (DeepSpeed's rule: the
    attention heads a multiple of `n`; the key/value heads a multiple or a divisor of `n`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads % n:
        raise SFTError(f"--sequence-parallel {n}: the model's {heads} attention heads do not divide among {n} "
                       "ranks; choose a divisor of them")
    if kv % n and n % kv:
        raise SFTError(f"--sequence-parallel {n}: the model's {kv} key/value heads neither divide among {n} "
                       "ranks nor divide it; choose another --sequence-parallel")


def _packed_sdpa(core: Any) -> Any:
    """`core` (transformers' sdpa attention) attending within each packed sample: the samples are
    where ``position_ids`` (gathered whole by Ulysses) do not step by one, as transformers finds
    them for an unsharded row. Rows without a restart keep the plain causal attention."""

    def attend(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        if attention_mask is None and position_ids is not None and query.shape[2] == position_ids.shape[-1]:
            step = torch.diff(position_ids, dim=-1) != 1
            if bool(step.any()):
                sample = torch.nn.functional.pad(step.long().cumsum(-1), (1, 0))
                n = sample.shape[-1]
                causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                attention_mask = (sample[:, :, None] == sample[:, None, :]) & causal
                attention_mask = attention_mask[:, None]
        return core(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)

    return attend


def prepare_model(model: torch.nn.Module, packing: bool) -> None:
    """Check that `model` runs the attention Ulysses is told to wrap (sdpa, which every model tigon
    loads runs); for packed rows make that attention keep the samples apart (`_packed_sdpa`). The
    entry is transformers' process-wide one, which Ulysses itself replaces next: only a run under
    --sequence-parallel changes it, once, and a mask given to it is obeyed as before."""
    name = model.config._attn_implementation
    if name != "sdpa":
        raise SFTError(f"--sequence-parallel: tigon runs Ulysses around sdpa attention, and the model runs {name}")
    if packing and not _installed:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _installed.append(_packed_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"]))
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _installed[0]


def trainer_arguments(n: int) -> dict[str, Any]:
    """The TrainingArguments' keywords for SP over `n` ranks around sdpa: DeepSpeed (ZeRO
    stage 0: the model whole on every rank, its settings from the Trainer's) and the parallelism
    config. On CPUs (tests) the process group is gloo's, which DeepSpeed must be told first."""
    import deepspeed
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    if not torch.cuda.is_available() and not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    auto = "auto"
    config = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": auto}, "fp16": {"enabled": auto},
              "train_micro_batch_size_per_gpu": auto, "gradient_accumulation_steps": auto,
              "gradient_clipping": auto}
    # Only the training dataloader is sharded: evaluation runs each rank's batches whole, as DDP would.
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa",
                                              sp_disable_in_eval=True)
    return {"deepspeed": config,
            "parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=n, sp_handler=handler)}
