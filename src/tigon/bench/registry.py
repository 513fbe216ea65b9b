"""The op benchmark registry: each op family registers its cases from a module in bench/ops/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

Size = tuple[int, ...]


@dataclass
class BenchOp:
    """One benchmarked op.

    `make_inputs(size, dtype, device)` returns the positional arguments shared by the three
    implementations; tensors among them that require grad get gradients in the fwd+bwd timing.
    `bytes_moved(size, dtype)` is the fewest bytes fwd+bwd must move (each input read once, each
    output written once); `flops` the matrix FLOPs, 0 for memory-bound ops. Together they give
    the floor that the roofline % is measured against. `peer`, where the best-known peer library
    has the op, imports it and returns its implementation (same arguments); an ImportError leaves
    that column empty, with the reason.
    """

    name: str
    make_inputs: Callable[[Size, torch.dtype, torch.device], Sequence[Any]]
    tigon: Callable[..., Any]
    eager: Callable[..., Any]
    bytes_moved: Callable[[Size, torch.dtype], int]
    sizes: list[Size]
    cpu_sizes: list[Size]
    flops: Callable[[Size], float] = field(default=lambda size: 0.0)
    size_names: str = "rows x cols"
    peer: Callable[[], Callable[..., Any]] | None = None


BENCH_OPS: dict[str, BenchOp] = {}


def liger(name: str, **fixed: Any) -> Callable[[], Callable[..., Any]]:
    """A `peer` factory: Liger-Kernel's ``liger_kernel.transformers.functional.<name>``, called
    with the case's arguments and then `fixed` (the settings tigon's default has, such as eps)."""

    def load() -> Callable[..., Any]:
        from liger_kernel.transformers import functional

        fn = getattr(functional, name)
        return (lambda *args: fn(*args, **fixed)) if fixed else fn

    return load


def register(op: BenchOp) -> BenchOp:
    BENCH_OPS[op.name] = op
    return op


def parse_size(text: str, option: str = "--sizes") -> Size:
    """'16384x4096' -> (16384, 4096); `option` is named in the error."""
    try:
        return tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{option} entries look like 16384x4096, got {text!r}") from None
