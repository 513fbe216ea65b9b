"""`tigon serve`, `tigon export` and `tigon eval`: argument parsing over tigon.serve."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tigon.serve.server import Limits

_DEBUG = {"action": "store_true", "default": argparse.SUPPRESS, "help": "show full tracebacks"}
API_KEY_ENV = "TIGON_API_KEY"


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $TIGON_API_KEY (set but empty counts as unset), else None."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not (key and key.isascii() and key.isprintable() and key.strip() == key):
        raise ValueError(f"--api-key / {API_KEY_ENV} must be printable ASCII without surrounding spaces "
                         "(clients send it in an HTTP header)")
    return key


def _limits(args: argparse.Namespace) -> Limits:
    """The server's `Limits`: its defaults, with the ones given on the command line."""
    from dataclasses import replace

    from tigon.serve.server import Limits

    given: dict[str, int] = {}
    for flag, field, mib in (("--max-body-mb", "max_body_bytes", args.max_body_mb),
                             ("--max-inflight-mb", "max_inflight_bytes", args.max_inflight_mb)):
        if mib is not None:
            if not 0 < mib < 2**20:  # also refuses nan and inf
                raise ValueError(f"{flag} must be a number of MiB above 0 and below {2**20}, got {mib}")
            given[field] = max(1, int(mib * 2**20))
    if args.max_choices is not None:
        if args.max_choices < 1:
            raise ValueError(f"--max-choices must be >= 1, got {args.max_choices}")
        given["max_choices"] = args.max_choices
    limits = replace(Limits(), **given)
    if limits.max_inflight_bytes < limits.max_body_bytes:
        raise ValueError(f"--max-inflight-mb ({limits.max_inflight_bytes / 2**20:g}) must be at least --max-body-mb "
                         f"({limits.max_body_bytes / 2**20:g}): else no request of the largest size could be taken")
    return limits


def _cmd_serve(args: argparse.Namespace) -> int:
    from tigon.serve.loading import resolve_model_path
    from tigon.security import check_listen_address

    try:
        api_key = _api_key(args)
        # before the demo model is trained or any model loaded: a refusal comes at once
        check_listen_address("serve", args.host, api_key is not None, args.insecure,
                             f"--api-key KEY (or {API_KEY_ENV})")
        image_flags = [flag for flag, value in (("--image-root", args.image_root), ("--max-images", args.max_images),
                                                ("--max-image-mb", args.max_image_mb),
                                                ("--max-image-pixels", args.max_image_pixels)) if value is not None]
        if args.backend == "vllm" and (args.max_body_mb, args.max_inflight_mb, args.max_choices) != (None,) * 3:
            raise ValueError("--max-body-mb, --max-inflight-mb and --max-choices are limits of tigon's own server; "
                             "vLLM's server (--backend vllm) has its own and does not take these")
        if args.backend == "vllm" and image_flags:
            raise ValueError(f"{image_flags[0]}: a setting of tigon's own server; vLLM's server (--backend vllm) has "
                             "its own for images")
        if args.path is not None and args.modality is not None:
            raise ValueError("--modality picks the built-in demo model when PATH is left out; a PATH says what it is")
        path = resolve_model_path(args.path, args.modality)
        name = args.served_model_name or path
        if args.backend == "vllm":
            from tigon.serve.vllm import serve_with_vllm

            if embedding_model(path):
                raise ValueError(f"{path} is an embedding model (tigon embed): serve it with tigon's own backend "
                                 "(leave out --backend vllm)")

            return serve_with_vllm(path, name, args.host, args.port, args.dtype, args.base, args.max_model_len,
                                   api_key)
        _check_serving_installed()
        limits = _limits(args)
        _check_port(args.host, args.port)  # before minutes of loading, not after
        from tigon.serve.engine import Engine
        from tigon.serve.loading import context_length, load_model_for_serving
        from tigon.serve.server import ServedModel, serve_forever
        from tigon.train.vision import load_vision_for_inference, vision_config_of

        vision = None if embedding_model(path) else vision_config_of(path, args.base)
        if image_flags and vision is None:
            raise ValueError(f"{image_flags[0]}: only for a vision-language model, and {path} is text-only")
        if embedding_model(path):
            from tigon.serve.embeddings import load_embedder_for_serving

            embedder = load_embedder_for_serving(path, args.dtype, args.base)
            model, tokenizer, engine = embedder.decoder, embedder.tokenizer, None
        elif vision is not None:
            from tigon.serve.engine import VisionEngine
            from tigon.train.modeling import pick_dtype

            model, encoder = load_vision_for_inference(path, pick_dtype(args.dtype), args.base, "tigon serve")
            tokenizer, embedder = encoder.processor.tokenizer, None
            engine = VisionEngine(model, tokenizer)
        else:
            model, tokenizer = load_model_for_serving(path, args.dtype, args.base)
            embedder, engine = None, Engine(model, tokenizer)
        served = ServedModel(engine, tokenizer, name, context_length(model, args.max_model_len), embedder)
        if vision is not None:
            served.vision, served.images = encoder, _image_policy(args, path)
        print(f"tigon serve: {name} ({type(model).__name__}, {model.dtype}, {model.device}, context "
              f"{served.max_model_len}) on http://{args.host}:{args.port}/v1 ("
              f"{_serving_what(served)}; "
              f"{'API key required' if api_key else 'no API key'})",
              file=sys.stderr, flush=True)
        serve_forever(served, args.host, args.port, api_key, limits)
    except KeyboardInterrupt:
        print("tigon serve: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    return 0


def _serving_what(served: Any) -> str:
    if served.embedder is not None:
        return f"/v1/embeddings, {served.embedder.settings['pooling']} pooling"
    if served.vision is not None:
        roots = ", ".join(map(str, served.images.roots)) or "none"
        return (f"images: data: URLs, files under {roots}, at most {served.images.max_images} per request; "
                "one request at a time")
    return "transformers continuous batching"


def _image_policy(args: argparse.Namespace, path: str) -> Any:
    """What images requests may send: files in the model's folder (a local one) and under each
    --image-root, within the limits given."""
    from tigon.serve.images import ImagePolicy

    roots = [path] if os.path.isdir(path) else []
    for root in args.image_root or []:
        if not os.path.isdir(root):
            raise ValueError(f"--image-root {root}: no such folder")
        roots.append(root)
    bounds: dict[str, int] = {}
    for flag, field, value, least in (("--max-images", "max_images", args.max_images, 0),
                                      ("--max-image-pixels", "max_pixels", args.max_image_pixels, 1)):
        if value is not None:
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
            bounds[field] = value
    if args.max_image_mb is not None:
        if not 0 < args.max_image_mb < 2**20:
            raise ValueError(f"--max-image-mb must be a number of MiB above 0 and below {2**20}, got {args.max_image_mb}")
        bounds["max_bytes"] = max(1, int(args.max_image_mb * 2**20))
    return ImagePolicy.over(roots, **bounds)


def embedding_model(path: str) -> bool:
    """Whether `path` holds a model `tigon embed` saved (its embedding.json)."""
    from tigon.train.embed import embedding_settings

    return embedding_settings(path) is not None


# The continuous-batching pieces the engine builds on (per-request logits processors,
# ContinuousBatchingConfig) first shipped together in this release.
MIN_TRANSFORMERS = (5, 24)


def _check_serving_installed() -> None:
    missing = [name for name in ("fastapi", "uvicorn") if _missing(name)]
    if missing:
        raise ValueError(f"tigon serve needs {' and '.join(missing)} (pip install 'tigon[hf]')")
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ValueError(f"tigon serve needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} for its continuous "
                         f"batching, this is {transformers.__version__} (pip install -U transformers)")


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as err:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def _cmd_export(args: argparse.Namespace) -> int:
    from tigon.serve.export import export

    export(args.path, args.to, args.output, dtype=args.dtype, base=args.base, overwrite=args.overwrite)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from tigon.serve.evaluate import EvalSettings, run_eval

    settings = EvalSettings(datasets=args.dataset or [], tasks=args.tasks or [], max_length=args.max_length,
                            batch_size=args.batch_size, dtype=args.dtype, base=args.base, output=args.output,
                            limit=args.limit, seed=args.seed)
    run_eval(args.path, settings)
    return 0


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """Register `serve`, `export` and `eval` on the `tigon` command's subparsers."""
    dtypes = ["auto", "bf16", "fp16", "fp32"]
    serve = sub.add_parser("serve", help="an OpenAI-compatible API (/v1/chat/completions, /v1/completions) for a "
                           "model, checkpoint or LoRA adapter (no PATH: the built-in demo model)")
    serve.add_argument("path", nargs="?", metavar="PATH",
                       help="tigon output (final/, checkpoint-N/, LoRA adapter) or HF model directory "
                            "(default: demo-out/final, trained first if missing)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; any other needs --api-key "
                            "or --insecure)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", metavar="KEY",
                       help=f"clients must send 'Authorization: Bearer KEY' (all but /health and /docs); "
                            f"${API_KEY_ENV} sets it without showing it in the process list")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a --host other machines can reach without an API key")
    serve.add_argument("--max-body-mb", type=float, metavar="MB",
                       help="largest request body in MiB; larger ones get 413 (default 4)")
    serve.add_argument("--max-inflight-mb", type=float, metavar="MB",
                       help="request bodies held at once, all requests together, in MiB; past it new ones get 503 "
                            "(default 64)")
    serve.add_argument("--max-choices", type=int, metavar="N",
                       help="most completions one request may ask for, prompts times n (default 128)")
    serve.add_argument("--modality", choices=["vision"],
                       help="vision: with no PATH, the built-in vision-language demo model (demo-vision-out/final, "
                            "trained first by tigon sft --modality vision if missing)")
    serve.add_argument("--image-root", action="append", metavar="DIR",
                       help="a vision-language model may be sent image files (file:// or paths) under DIR "
                            "(repeatable; the model's own folder always)")
    serve.add_argument("--max-images", type=int, metavar="N", help="most images in one request (default 8)")
    serve.add_argument("--max-image-mb", type=float, metavar="MB", help="largest image in MiB (default 16)")
    serve.add_argument("--max-image-pixels", type=int, metavar="N",
                       help="largest image in pixels, read from its header before decoding (default 16777216)")
    serve.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                       help="transformers: its continuous batching (default); vllm: vLLM's OpenAI server, if installed")
    serve.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: PATH)")
    serve.add_argument("--max-model-len", type=int, metavar="N",
                       help="longest prompt + completion in tokens (default: the model's context length)")
    serve.add_argument("--base", metavar="MODEL", help="base model of a LoRA adapter (default: the one it names)")
    serve.add_argument("--dtype", choices=dtypes, default="auto", help="auto: bf16 on a GPU that has it, else fp32")
    serve.add_argument("--debug", **_DEBUG)
    serve.set_defaults(run=_cmd_serve)

    export = sub.add_parser("export", help="write a model or LoRA adapter as merged HF safetensors or as GGUF "
                            "(llama.cpp, Ollama) with a Modelfile")
    export.add_argument("path", metavar="PATH", help="tigon output, LoRA adapter or HF model directory")
    export.add_argument("--to", choices=["merged", "gguf"], required=True, help="output format")
    export.add_argument("--output", required=True, metavar="OUT",
                        help="directory to write, new or empty unless --overwrite (merged: the HF model; gguf: "
                             "model.gguf and Modelfile), or with --to gguf a file ending in .gguf (no Modelfile)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output (never PATH or its base, nor a folder holding them)")
    export.add_argument("--dtype", choices=["auto", "bf16", "f16", "f32", "q8_0"], default="auto",
                        help="stored weights (auto: the model's own dtype; q8_0: GGUF only)")
    export.add_argument("--base", metavar="MODEL", help="base model of a LoRA adapter (default: the one it names)")
    export.add_argument("--debug", **_DEBUG)
    export.set_defaults(run=_cmd_export)

    ev = sub.add_parser("eval", help="loss and perplexity on dataset files (as tigon sft scores them), and "
                        "benchmark tasks through lm-evaluation-harness")
    ev.add_argument("path", metavar="PATH", help="tigon output, LoRA adapter or HF model directory")
    ev.add_argument("--dataset", nargs="+", metavar="FILE", help="data files in any format tigon sft reads")
    ev.add_argument("--tasks", type=lambda s: [t.strip() for t in s.split(",") if t.strip()], metavar="T1,T2",
                    help="lm-evaluation-harness tasks, e.g. hellaswag,arc_easy (needs lm-eval installed)")
    ev.add_argument("--max-length", type=int, default=2048, metavar="N", help="truncate samples to N tokens")
    ev.add_argument("--batch-size", type=int, default=8, metavar="N", help="samples per forward pass")
    ev.add_argument("--limit", type=int, metavar="N", help="lm-eval: at most N examples per task")
    ev.add_argument("--output", metavar="FILE", help="result JSON (default: ./eval.json)")
    ev.add_argument("--base", metavar="MODEL", help="base model of a LoRA adapter (default: the one it names)")
    ev.add_argument("--dtype", choices=dtypes, default="auto", help="auto: bf16 on a GPU that has it, else fp32")
    ev.add_argument("--seed", type=int, default=42, help="seed for PATH#N row sampling")
    ev.add_argument("--debug", **_DEBUG)
    ev.set_defaults(run=_cmd_eval)
