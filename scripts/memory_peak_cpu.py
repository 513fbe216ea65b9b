"""What is alive at the memory peak of one training step, on a machine without a GPU: every tensor
an aten op creates during the step is counted until its storage is freed, and at the peak the
live ones are listed by the op that made them, dtype and shape, in bytes per token. For a scaled
Llama (the Llama-3-8B ratios at a smaller width) with LoRA r=16 on every linear layer, optionally
on an NF4 base (bitsandbytes' CPU backend) and with gradient checkpointing, tigon's patch on or off.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/memory_peak_cpu.py --quant nf4 --checkpointing --tokens 512

Per-token figures carry over to the full width in proportion to the hidden size: what the GPU's
peak grows by per token shows here as the same tensors.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that ops create while it is active, until each is freed;
    records the largest total and what made up it."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.sites = sites
        self.live: dict[int, tuple[int, str]] = {}
        self.total = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []

    def _freed(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, ""))
        self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or id(storage) in inputs or storage.nbytes() == 0:
                continue
            what = f"{func.__name__} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
            if self.sites:
                what += " @ " + code_site()
            self.live[key] = (storage.nbytes(), what)
            self.total += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = list(self.live.values())
        return out


def code_site(frames: int = 2) -> str:
    """The innermost lines of tigon, transformers or PEFT code on the stack."""
    own = [f for f in traceback.extract_stack() if any(p in f.filename for p in ("tigon/", "transformers/", "peft/"))]
    return " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in own[::-1][:frames])


def build(args, path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tigon.train.modeling import prepare_quantized, quantization_config

    hidden = args.hidden
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * args.intermediate_ratio), num_hidden_layers=args.layers,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                         vocab_size=args.vocab, tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    kwargs = {}
    if args.quant:
        kwargs = dict(quantization_config=quantization_config(args.quant, torch.bfloat16), device_map={"": "cpu"})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa", **kwargs)
    model.config.use_cache = False
    if args.quant:
        prepare_quantized(model, args.checkpointing)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, lora).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate-ratio", type=float, default=3.5, help="3.5: Llama-3-8B; 4: the 1B Llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--quant", choices=["nf4", "fp4", "int8"])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sites", action="store_true", help="name the code that made each tensor, too")
    args = parser.parse_args()
    import tigon

    with tempfile.TemporaryDirectory() as tmp:
        model = build(args, tmp)
    if not args.no_kernels:
        tigon.patch(model)
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    meter = LiveBytes(args.sites)
    with meter, torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    per_token = 1 / args.tokens / 1024
    print(f"peak {meter.peak / 2**20:.1f} MiB of tensors made in the step: {meter.peak * per_token:.1f} KiB per token "
          f"({meter.peak / args.tokens / (2 * args.hidden):.1f} bf16 hidden vectors per token)")
    groups: collections.Counter = collections.Counter()
    for nbytes, what in meter.at_peak:
        groups[what] += nbytes
    for what, nbytes in groups.most_common(args.top):
        print(f"  {nbytes * per_token:8.2f} KiB/token  {what}")


if __name__ == "__main__":
    main()
