"""What the cross-entropy kernels' NaN propagation and target-range check cost (one GPU call).

Times, with CUDA graphs (GPU time), the three cross-entropy passes at the TARGETS.md logits
(8192 x 128256 bf16, a quarter of the targets ignored): the forward (loss and lse), the backward
(gradient from the lse), and the forward that writes the gradient in place on one 512-row chunk
(the pass the fused linear + cross-entropy runs per chunk). With ``--base FILE`` (an older
src/tigon/ops/cross_entropy.py, e.g. from ``git show REV:src/tigon/ops/cross_entropy.py > FILE``)
the same passes of that file's kernels are timed in the same process, interleaved, so the
difference is the change and not the machine. Also times TIGON_DEBUG=1's host check of the
targets (it reads them back, so it is plainly launched, sync included).

Usage: PYTHONPATH=src python3 scripts/bench_ce_checks.py [--base FILE] [--rounds 5]
"""

import argparse
import importlib.util
import statistics
import sys
import types
from unittest import mock

import torch
from triton.testing import do_bench, do_bench_cudagraph

from tigon.ops import _checks, _dispatch, cross_entropy

ROWS, VOCAB, CHUNK = 8192, 128256, 512


def load(path):
    """An older cross_entropy.py as a module. One from before tigon.ops had its dispatcher imports
    tigon._backend and tigon._checks: while it loads they are stand-ins (its kernels and
    launchers need only triton, tl and the checks; the dispatching public function is not timed)."""
    backend = types.SimpleNamespace(triton=_dispatch.triton, tl=_dispatch.tl, register=lambda name, **_: name)
    spec = importlib.util.spec_from_file_location("base_cross_entropy", path)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"tigon._backend": backend, "tigon._checks": _checks}):
        spec.loader.exec_module(module)
    return module


def passes(ce, logits, target):
    """name -> a callable that launches one pass of module `ce`'s kernels."""
    loss = torch.empty(ROWS, device="cuda")
    lse = torch.empty(ROWS, device="cuda")
    scale = torch.full((), 1.0 / ROWS, device="cuda")
    chunk = logits[:CHUNK].clone()
    options = ce.LossOptions()
    # The backward launcher's name before the dispatcher, and after it.
    backward = getattr(ce, "cross_entropy_backward", None) or ce._cross_entropy_backward
    return {
        "forward": lambda: ce.cross_entropy_rows(logits, target, loss, lse, options),
        "backward": lambda: backward(logits, target, lse, scale, options),
        f"fused in place ({CHUNK} rows)": lambda: ce.cross_entropy_rows(
            chunk, target[:CHUNK], loss[:CHUNK], lse[:CHUNK], options, grad=chunk, scale=scale
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="an older cross_entropy.py to time against")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    logits = (4 * torch.randn(ROWS, VOCAB, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    target[torch.randperm(ROWS, device="cuda")[: ROWS // 4]] = -100
    impls = {"this tree": passes(cross_entropy, logits, target)}
    if args.base:
        impls["base"] = passes(load(args.base), logits, target)

    times = {(impl, name): [] for impl, fns in impls.items() for name in fns}
    for _ in range(args.rounds):
        for impl, fns in impls.items():
            for name, fn in fns.items():
                times[impl, name].append(do_bench_cudagraph(fn, rep=100))
    print(f"cross-entropy passes, {ROWS} x {VOCAB} bf16, median of {args.rounds} rounds (CUDA-graph ms):")
    for name in impls["this tree"]:
        line = "  ".join(f"{impl} {statistics.median(times[impl, name]):.4f}" for impl in impls)
        if args.base:
            new, old = (statistics.median(times[impl, name]) for impl in ("this tree", "base"))
            line += f"  ({(new / old - 1) * 100:+.1f}%)"
        print(f"  {name:28s} {line}")

    check = do_bench(lambda: cross_entropy.check_target_range(target, VOCAB, -100), rep=100)
    print(f"TIGON_DEBUG=1 target check ({ROWS} targets, plainly launched, host sync included): {check:.4f} ms")


if __name__ == "__main__":
    main()
