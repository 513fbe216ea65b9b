"""What the cross-layer residual add + RMSNorm fusion is worth, end to end.

A patched model instance runs each decoder layer's closing residual add with the next layer's
input norm in one kernel (each layer's plan names that norm: ``tigon.patch.apply.layer_plans``). This
times `tigon bench --e2e`'s training step (the 1.2 B Llama, full fine-tune and LoRA) with tigon's
patch as shipped ("linked") and with that one fusion off ("unlinked": every layer's planned next
norm cleared after the patch), alternating the two over several rounds so that
drift in the GPU's clocks falls on both alike; it prints each round and the medians.

    python scripts/cross_layer_norm_e2e.py [--modes full lora] [--rounds 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics

import tigon
from tigon.bench import e2e
from tigon.patch import apply


def _unlinked_patch(target, **switches):
    """tigon.patch, then each decoder layer's closing add planned to run alone."""
    result = apply.patch(target, **switches)
    for plan in apply.layer_plans(target):
        plan.next_norm = None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=e2e.MODES, default=list(e2e.MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = e2e.current_cuda_device("scripts/cross_layer_norm_e2e.py")
    failed = False
    for mode in args.modes:
        step_ms: dict[str, list[float]] = {"linked": [], "unlinked": []}
        for round_ in range(args.rounds):
            for variant in ("linked", "unlinked") if round_ % 2 == 0 else ("unlinked", "linked"):
                tigon.patch = apply.patch if variant == "linked" else _unlinked_patch
                try:
                    record = e2e.run_case(
                        mode, "tigon", device, batch=args.batch, seq=args.seq, steps=args.steps,
                        warmup=args.warmup, log=lambda line: None,
                    )
                finally:
                    tigon.patch = apply.patch
                if "error" in record:
                    print(f"{mode} {variant}: {record['error']}")
                    failed = True
                    continue
                step_ms[variant].append(record["step_ms"])
                print(f"{mode:<5} round {round_} {variant:<9} {record['step_ms']:8.2f} ms/step "
                      f"{record['peak_gib']:6.2f} GiB  first loss {record['losses'][0]:.4f}")
        if all(step_ms.values()):
            linked, unlinked = (statistics.median(step_ms[v]) for v in ("linked", "unlinked"))
            print(f"{mode:<5} median: linked {linked:.2f} ms, unlinked {unlinked:.2f} ms "
                  f"(the fusion saves {unlinked - linked:+.2f} ms, {100 * (unlinked / linked - 1):+.1f}%)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
