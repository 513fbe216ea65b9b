"""Serving throughput: `tigon serve` on a Llama-shaped model (the 1B Llama: hidden 2048, intermediate
8192, 16 layers, 32/8 heads, vocab 128256, tied embeddings; random bf16 weights), the same requests
answered one at a time and then by N concurrent clients through the openai client; prints a table
and writes serve_bench.json. The target: concurrent tokens/s >= 8x one-at-a-time.

    python -m tigon.serve.bench --out bench-out            # on the GPU: 32 clients x 256 new tokens
    python -m tigon.serve.bench --shape tiny --clients 4 --max-tokens 16   # a smoke run on a CPU

Each request is a completion of random prompt token ids, greedy, so both phases do the same
work; the end-of-sequence token's (tied) embedding is zeroed, so a random model never picks it and
every request generates exactly --max-tokens tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES = {
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=2048),
    "tiny": dict(max_position_embeddings=1024),
}


def build_model_dir(path: Path, shape: str, seed: int = 0) -> Path:
    """A random model of `shape` and a tokenizer covering its vocabulary, saved to `path`."""
    import torch

    from tigon.train import tiny
    from tigon.train.data import load_samples

    sizes = dict(SHAPES[shape])
    tokenizer = tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed))
    vocab = sizes.pop("vocab_size", len(tokenizer))
    # Stand-in tokens up to the model's vocabulary, so that every id the model may emit decodes.
    tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), vocab)])
    model = tiny.build_model(tokenizer, seed, **sizes)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id].zero_()
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, name: str, log_path: Path, timeout: float = 900) -> subprocess.Popen:
    """`tigon serve` in a subprocess; returns once /health answers."""
    import urllib.request

    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tigon.cli", "serve", str(model_dir), "--port", str(port),
                             "--served-model-name", name], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tigon serve exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tigon serve did not answer within {timeout:.0f} s; see {log_path}")


async def _one(client: Any, name: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"latency_s": end - start, "ttft_s": (first or end) - start, "tokens": tokens}


async def run_phase(base_url: str, name: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """`clients` concurrent clients share the prompts (each takes the next one until none is left)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    queue = list(enumerate(prompts))
    records: list[dict[str, float]] = [{}] * len(prompts)

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop(0)
            records[i] = await _one(client, name, prompt, max_tokens)

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(clients)])
    wall = time.perf_counter() - start
    await client.close()
    return summarize(records, wall, clients)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[dict[str, float]], wall: float, clients: int) -> dict[str, Any]:
    latency = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records]
    tokens = sum(int(r["tokens"]) for r in records)
    return {"clients": clients, "requests": len(records), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latency_p50_s": statistics.median(latency),
            "latency_p99_s": _percentile(latency, 99), "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": _percentile(ttft, 99)}


def format_table(phases: dict[str, dict[str, Any]]) -> str:
    head = f"{'phase':<14} {'clients':>7} {'requests':>8} {'tokens':>8} {'wall s':>8} {'tok/s':>9} " \
           f"{'p50 s':>7} {'p99 s':>7} {'ttft p50':>9} {'ttft p99':>9}"
    rows = [f"{name:<14} {p['clients']:>7} {p['requests']:>8} {p['tokens']:>8} {p['wall_s']:>8.2f} "
            f"{p['tokens_per_s']:>9.1f} {p['latency_p50_s']:>7.3f} {p['latency_p99_s']:>7.3f} "
            f"{p['ttft_p50_s']:>9.3f} {p['ttft_p99_s']:>9.3f}" for name, p in phases.items()]
    return "\n".join([head, *rows])


def report(args: argparse.Namespace, phases: dict[str, dict[str, Any]], out: Path) -> None:
    """Print the table and write ``serve_bench.json`` to `out`."""
    import torch
    import transformers

    speedup = phases["concurrent"]["tokens_per_s"] / phases["one at a time"]["tokens_per_s"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"shape": args.model or args.shape, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
              "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
              "phases": phases, "speedup": speedup, "target": 8.0, "meets_target": speedup >= 8.0,
              "date": time.strftime("%Y-%m-%d")}
    (out / "serve_bench.json").write_text(json.dumps(record, indent=1) + "\n")
    print(format_table(phases))
    print(f"concurrent / one at a time: {speedup:.2f}x tokens/s (target >= 8x) on {device}; "
          f"{out / 'serve_bench.json'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.serve.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--model", metavar="DIR", help="serve this model directory instead of building one")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client in the concurrent phase")
    parser.add_argument("--sequential", type=int, metavar="N",
                        help="requests in the one-at-a-time phase (default: one per client); its tokens/s is "
                             "per request, so fewer only shorten the run")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", metavar="DIR", default="bench-out", help="where serve_bench.json and the server log go")
    args = parser.parse_args(argv)
    sequential = args.clients if args.sequential is None else args.sequential
    for flag, value in (("--clients", args.clients), ("--rounds", args.rounds), ("--sequential", sequential),
                        ("--max-tokens", args.max_tokens), ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="tigon-serve-bench-") as tmp:
        model_dir = Path(args.model) if args.model else build_model_dir(Path(tmp) / "model", args.shape)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        n = args.clients * args.rounds
        prompts = [[rng.randrange(10, min(vocab, 1000)) for _ in range(args.prompt_tokens)] for _ in range(n)]
        port = _free_port()
        proc = start_server(model_dir, port, "bench", out / "serve_bench_server.log")
        base = f"http://127.0.0.1:{port}/v1"
        try:
            # Warm-up: every batch size the concurrent phase reaches, at a few tokens per request.
            asyncio.run(run_phase(base, "bench", prompts[: args.clients], args.clients, min(args.max_tokens, 32)))
            phases = {}
            for name, count, clients in (("one at a time", sequential, 1), ("concurrent", n, args.clients)):
                phases[name] = asyncio.run(run_phase(base, "bench", prompts[:count], clients, args.max_tokens))
                print(format_table({name: phases[name]}).splitlines()[1], flush=True)  # a cut run keeps it
            # Written before the server stops: its shutdown (open requests, the engine) takes a while.
            report(args, phases, out)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
