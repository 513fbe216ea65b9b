"""The `tigon` command: thin argument parsing over tigon's library code."""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import sys
from pathlib import Path
from typing import Callable, NoReturn

E2E_TOKENS = 10 * 4 * 2048  # tokens timed per `tigon bench --e2e` shape (10 steps at 4 x 2048)


def _cmd_env(args: argparse.Namespace) -> int:
    import torch

    from tigon import ops

    print(f"tigon      {__import__('tigon').__version__}")
    print(f"python     {platform.python_version()} ({platform.system()} {platform.machine()})")
    print(f"torch      {torch.__version__}")
    try:
        import triton

        print(f"triton     {triton.__version__}")
    except ImportError:
        print("triton     not installed")
    for name in ("transformers", "peft", "accelerate"):
        try:
            print(f"{name:<10} {__import__(name).__version__}")
        except ImportError:
            print(f"{name:<10} not installed")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        props = torch.cuda.get_device_properties(device)
        print(f"gpu        {props.name}, compute capability {major}.{minor}, "
              f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        device = torch.device("cpu")
        print("gpu        none (CUDA not available)")
    if ops.INTERPRET:
        print("mode       TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (slow; for tests)")
    # One row per op, each reason said once: ops are grouped by where they run and why.
    groups: dict[tuple[str, str | None], list[str]] = {}
    for op in ops.op_names():
        groups.setdefault(ops.placement(op, device), []).append(op)
    headings = {"triton": "Triton kernels", "torch": "torch calls only (no Triton kernel), on any device"}
    print(f"\nops on {device}:")
    for (where, reason), names in groups.items():
        print(f"  {headings.get(where) or 'PyTorch reference: ' + reason}")
        for name in names:
            print(f"    {name}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tigon.bench.e2e import exit_status

    return _bench(args) if args.debug else exit_status(lambda: _bench(args), "tigon bench")


def _bench(args: argparse.Namespace) -> int:
    if args.max_context is not None:
        from tigon.bench.max_context import SEQS, run_max_context

        records = run_max_context(args.max_context or SEQS, out_dir=Path(args.out) if args.out else None)
        return 1 if any("error" in r for r in records) else 0
    if args.reward:
        from tigon.bench.reward import run_reward

        records = run_reward(out_dir=Path(args.out) if args.out else None)
        return 1 if any("error" in r for r in records) else 0
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.ppo:
        from tigon.bench.ppo import run_ppo_bench

        records = run_ppo_bench(impls=("eager", "tigon", "compile"), out_dir=Path(args.out) if args.out else None)
        return 1 if any("error" in r for r in records) else 0
    if args.host:
        from tigon.bench.host import run_host

        records = run_host(args.ops, args.impls, dtype=dtype, out_dir=Path(args.out) if args.out else None)
        return 1 if any("error" in r for r in records) else 0
    if args.e2e is not None:
        from tigon.bench.e2e import run_e2e
        from tigon.bench.registry import parse_size

        shapes = [parse_size(text, "--e2e") for text in args.e2e] or [(4, 2048)]
        if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
            raise ValueError(f"--e2e takes batch x tokens shapes such as 1x1024, got {' '.join(args.e2e)}")
        failed = False
        for batch, seq in shapes:  # one e2e.json per shape, in OUT/BxT when there are several
            out = None if not args.out else Path(args.out) / f"{batch}x{seq}" if len(shapes) > 1 else Path(args.out)
            # At least the tokens of 10 steps of 4 x 2048: a small batch's timed window then spans
            # several of the GPU-utilisation counter's sample periods (up to 1 s each).
            steps = max(10, E2E_TOKENS // (batch * seq))
            records = run_e2e(impls=args.e2e_impls or ["eager", "tigon"], batch=batch, seq=seq, steps=steps, out_dir=out,
                              **({"rounds": args.rounds} if args.rounds != 1 else {}))
            failed |= any("error" in r for r in records)
        return 1 if failed else 0
    from tigon.bench import run_benchmarks
    from tigon.bench.registry import parse_size

    sizes = [parse_size(s) for s in args.sizes] if args.sizes else None
    run_benchmarks(
        ops=args.ops, sizes=sizes, dtype=dtype, out_dir=Path(args.out) if args.out else None,
        impls=args.impls, headline=args.headline,
    )
    return 0


def _train():
    try:
        import tigon.train
    except ImportError as err:
        raise ValueError(f"{err}: tigon sft needs transformers, peft and accelerate (pip install 'tigon[hf]')") from None
    return tigon.train


def _cmd_sft(args: argparse.Namespace) -> int:
    train = _train()
    train.run_sft(*train.config_from_args(args))
    return 0


def _cmd_rlhf(args: argparse.Namespace) -> int:
    from tigon.train.config import RLHFConfig

    train = _train()
    try:
        from tigon.train.rlhf import run_rlhf
    except ImportError as err:
        raise ValueError(f"{err}: tigon rlhf runs on TRL's trainers (pip install 'trl>=1.16')") from None
    run_rlhf(*train.config_from_args(args, RLHFConfig))
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    from tigon.train.embed import run_embed
    from tigon.train.embed_config import EmbedConfig

    run_embed(*_train().config_from_args(args, EmbedConfig))
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    _train().merge(args.adapter, args.output, base=args.base, dtype=args.dtype, overwrite=args.overwrite)
    return 0


def _load_for_generation(args: argparse.Namespace):
    train = _train()
    from tigon.train.modeling import pick_dtype

    return train.load_for_inference(args.model, pick_dtype(args.dtype), base=args.base)


def _cmd_infer(args: argparse.Namespace) -> int:
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.image:
        from tigon.train.modeling import pick_dtype
        from tigon.train.vision import answer_about_images

        replies = answer_about_images(args.model, prompts, args.image, pick_dtype(args.dtype), args.max_new_tokens)
        for prompt, reply in zip(prompts, replies):
            print(reply if len(prompts) == 1 else f"> {prompt}\n{reply}\n")
        return 0
    model, tokenizer = _load_for_generation(args)
    from tigon.train.modeling import is_classifier

    if is_classifier(model):  # a sequence classifier (or reward model) labels each text as it is
        from tigon.train.classify import classify

        for prompt, (label, value) in zip(prompts, classify(model, tokenizer, prompts)):
            line = f"{label}\t{value:.4f}"
            print(line if len(prompts) == 1 else f"> {prompt}\n{line}\n")
        return 0
    system = [{"role": "system", "content": args.system}] if args.system else []
    for prompt in prompts:
        chat = prompt if args.raw else system + [{"role": "user", "content": prompt}]
        reply = _train().generate(model, tokenizer, chat, args.max_new_tokens, args.temperature)
        print(reply if len(prompts) == 1 else f"> {prompt}\n{reply}\n")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from tigon.train.vision import vision_config_of

    if args.image or vision_config_of(args.model, args.base) is not None:
        from tigon.train.modeling import pick_dtype
        from tigon.train.vision import image_files, load_vision_for_inference

        images = image_files(args.image or [])  # before the model loads: a bad path is said at once
        model, encoder = load_vision_for_inference(args.model, pick_dtype(args.dtype), args.base)
        _train().chat(model, None, args.max_new_tokens, args.temperature, args.system, sys.stdin, sys.stdout,
                      encoder, images)
        return 0
    model, tokenizer = _load_for_generation(args)
    _train().chat(model, tokenizer, args.max_new_tokens, args.temperature, args.system, sys.stdin, sys.stdout)
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default at the end of its help, where there is one to show (`tigon sft`'s
    options, whose defaults argparse does not hold, carry theirs in their help already)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        from tigon.train.config import help_with_default

        help = action.help or ""
        if not action.option_strings or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return help
        default = " ".join(map(str, action.default)) if isinstance(action.default, list) else "%(default)s"
        return help_with_default(help, default)


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line, naming where the options are listed, instead of the usage (23
    lines for `tigon sft`) with the line that matters last."""

    def error(self, message: str) -> NoReturn:
        hint = f" ({self.prog} --help lists the options)" if " " in self.prog else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def _add_train_commands(sub: argparse._SubParsersAction) -> None:
    """`sft`, `rlhf`, `merge`, `infer` and `chat` (the options of sft and rlhf come from tigon.train.config)."""
    from tigon.train.config import RLHFConfig, add_sft_arguments

    debug = {"action": "store_true", "default": argparse.SUPPRESS, "help": "show full tracebacks"}
    sft = sub.add_parser("sft", help="fine-tune a model on a dataset with tigon's kernels (no arguments: "
                         "a built-in tiny model on bundled data, on CPU in minutes)")
    add_sft_arguments(sft)
    sft.add_argument("--debug", **debug)
    sft.set_defaults(run=_cmd_sft)

    rlhf = sub.add_parser("rlhf", help="align a model with preference training (DPO, IPO, KTO, ORPO, SimPO, CPO), "
                          "online RL from reward functions (--method grpo) or on-policy distillation (--method gkd), "
                          "on tigon's fused losses (no arguments: DPO of the built-in tiny model after sft, on "
                          "bundled pairs, on CPU in minutes; --method grpo / gkd alone: the same for those)")
    add_sft_arguments(rlhf, RLHFConfig)
    rlhf.add_argument("--debug", **debug)
    rlhf.set_defaults(run=_cmd_rlhf)

    from tigon.train.embed_config import EmbedConfig

    embed = sub.add_parser("embed", help="fine-tune a decoder into a text-embedding model (last-token or mean "
                           "pooling, in-batch-negatives InfoNCE, hard negatives, Matryoshka dims) on tigon's fused "
                           "loss (no arguments: the built-in tiny model on bundled pairs, recall@1 before and after, "
                           "on CPU in a minute)")
    add_sft_arguments(embed, EmbedConfig)
    embed.add_argument("--debug", **debug)
    embed.set_defaults(run=_cmd_embed)

    merge = sub.add_parser("merge", help="fold a LoRA adapter into its base model (the same as tigon export ADAPTER --to merged); "
                           "a QLoRA adapter into its dequantised base")
    merge.add_argument("adapter", help="adapter directory (e.g. tigon-out/final)")
    merge.add_argument("--output", required=True, metavar="DIR",
                       help="where to write the merged model (a new or empty directory, unless --overwrite)")
    merge.add_argument("--overwrite", action="store_true",
                       help="replace an existing --output (never the adapter or its base, nor a folder holding them)")
    merge.add_argument("--base", metavar="MODEL", help="base model (default: the one the adapter names)")
    merge.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                       help="stored dtype (auto: the base model's; bf16 for a QLoRA adapter)")
    merge.add_argument("--debug", **debug)
    merge.set_defaults(run=_cmd_merge)

    for name, helptext in (("infer", "answer prompts (--prompt, or one per line on stdin); a classifier prints each "
                                     "text's label and its probability (a reward model: its score)"),
                           ("chat", "talk to a model or adapter on the terminal")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="model directory, hub id, or LoRA adapter directory")
        if name == "infer":
            p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
            p.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
        p.add_argument("--image", action="append", metavar="PATH",
                       help="an image the prompts are about, for a vision-language model (repeatable; shown in "
                            "order before each prompt; in chat, with the first message, and /image PATH adds one)")
        p.add_argument("--system", help="system message")
        p.add_argument("--base", metavar="MODEL", help="base model for an adapter (default: the one it names)")
        p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="length of each answer")
        p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0: greedy)")
        p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                       help="weight dtype (auto: bf16 on a GPU that has it, else fp32)")
        p.add_argument("--debug", **debug)
        p.set_defaults(run=_cmd_infer if name == "infer" else _cmd_chat)


@functools.cache  # parsing leaves no state in it; a process that calls main() often builds it once
def build_parser() -> argparse.ArgumentParser:
    """The `tigon` command line: every subcommand and its options."""
    parser = _Parser(prog="tigon", description="Fused Triton kernels for LLM fine-tuning.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(_Parser, formatter_class=_HelpFormatter))

    env = sub.add_parser("env", help="versions, GPU, and which ops run as Triton here (and why not)")
    env.set_defaults(run=_cmd_env)

    bench = sub.add_parser("bench", help="time ops against PyTorch eager and torch.compile")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: all registered)")
    bench.add_argument("--sizes", nargs="+", metavar="RxC", help="sizes such as 16384x4096 (default: each op's sweep)")
    bench.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="dtype of the inputs")
    bench.add_argument("--headline", action="store_true", help="only each op's first (headline) size")
    bench.add_argument("--impls", nargs="+", choices=["tigon", "eager", "compile", "peer"], default=["tigon", "eager", "compile", "peer"],
                       help="implementations to measure (default: all, in the same run; peer: the best-known peer "
                            "library, for the ops that name one, when it is installed)")
    bench.add_argument("--out", metavar="DIR", help="write bench.json and one PNG plot per op here")
    bench.add_argument("--host", action="store_true",
                       help="host time per fwd+bwd call (microseconds) at tiny sizes, where the GPU's work is negligible")
    bench.add_argument("--e2e", nargs="*", metavar="BxT",
                       help="end-to-end fine-tuning (full and LoRA) eager vs tigon instead of ops, at each batch x "
                            "tokens shape given (default 4x2048; 1x1024 is host-bound), timing as many tokens as 10 steps of "
                            "4x2048 (80 steps at 1x1024); more knobs: "
                            "python -m tigon.bench.e2e --help")
    bench.add_argument("--e2e-impls", nargs="+", metavar="IMPL",
                       choices=["eager", "tigon", "compile", "tigon+compile", "tigon+graphs", "tigon+reduce-overhead",
                                "peer", "unsloth", "torchao-fp8", "torchao-fp8-rowwise", "torchao-fp8+compile", "tigon+fp8",
                                "tigon+fp8-rowwise", "tigon+fp8+graphs", "tigon+scaled-mm"],
                       help="with --e2e: what to run (default eager tigon; tigon+graphs: the steps replayed from "
                            "CUDA graphs, as --cuda-graphs does; tigon+reduce-overhead: torch.compile's CUDA-graph mode; "
                            "unsloth: Unsloth's FastLanguageModel, LoRA modes only, where it is installed; "
                            "FP8 linears: torchao-fp8[-rowwise][+compile] on the unpatched model, tigon+fp8[-rowwise], "
                            "tigon+fp8+graphs, "
                            "tigon+scaled-mm: torch._scaled_mm rowwise without torchao)")
    bench.add_argument("--rounds", type=int, default=1, metavar="N",
                       help="with --e2e: run each case N times in turn, each in its own process, and report the median "
                            "tok/s, its spread and the largest peak (run-to-run drift then cannot decide a comparison)")
    bench.add_argument("--ppo", action="store_true",
                       help="PPO's training step without sampling (8 prompts x 256 new tokens, 1B Llama shape, LoRA): "
                            "eager, tigon and torch.compile; full fine-tuning and more knobs: python -m tigon.bench.ppo "
                            "--help")
    bench.add_argument("--max-context", nargs="*", type=int, metavar="TOKENS",
                       help="long-context LoRA: peak memory and s/step by length (default 65536 ... 524288), "
                            "with and without offload + tiled MLP; more knobs: python -m tigon.bench.max_context --help")
    bench.add_argument("--reward", action="store_true",
                       help="reward-model training (tigon rlhf --method rm), 1B Llama shape, LoRA r=16, 8 pairs x 2 x "
                            "1024 tokens: tigon against TRL's RewardTrainer, eager and compiled; more knobs: "
                            "python -m tigon.bench.reward --help")
    bench.set_defaults(run=_cmd_bench)
    _add_train_commands(sub)
    from tigon.serve.cli import add_serve_commands

    add_serve_commands(sub)
    from tigon.webui.cli import add_webui_commands

    add_webui_commands(sub)
    return parser


def _torchao_import_noise(record: logging.LogRecord) -> bool:
    """False for torchao's import-time lines (transformers imports it wherever it is installed):
    its compiled extensions do not match this torch, and none of them is what --fp8 uses."""
    return not record.getMessage().startswith(("Failed to load", "Skipping import of cpp extensions"))


def _pytree_enum_noise(record: logging.LogRecord) -> bool:
    """False for torch's deprecation line, once per enum, as torchao registers its enums as pytree
    constants."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def main(argv: list[str] | None = None) -> int:
    from tigon.train.config import Interrupted

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # bitsandbytes' CPU backend warns at import (PEFT imports it wherever it is installed) that an
    # optional kernel package is missing; on CPUs with AVX-512 bf16 that line opens every command.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Its kernel loader then warns, with HF_HUB_OFFLINE set, that it cannot check a hub kernel's
    # publisher: bitsandbytes' own business, and the first line a user would see.
    logging.getLogger("kernels._internals.hf_hub").setLevel(logging.ERROR)
    # torchao's import lines would open every command's output. (One filter object each: a process
    # that calls main() often adds each once.)
    logging.getLogger("torchao").addFilter(_torchao_import_noise)
    logging.getLogger("torch.utils._pytree").addFilter(_pytree_enum_noise)
    run: Callable[[argparse.Namespace], int] = args.run
    # A line of its own, also when Ctrl-C arrives at chat's "you> " prompt.
    start = "\n" if args.command == "chat" else ""
    try:
        return run(args)
    except Interrupted as err:
        print(f"{start}tigon {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{start}tigon {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:
        if args.debug:
            raise
        if isinstance(err, OSError) and err.filename is not None:
            err = f"{err.filename}: {err.strerror}"  # "No space left on device", "Permission denied" ...
        print(f"tigon {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
