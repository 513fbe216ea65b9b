"""NaN and +-inf planted in the inputs, weights and biases of every op that reduces over a row.

Each output must be NaN, +inf or -inf exactly where PyTorch's own result is, and finite and close
where PyTorch's is finite; each gradient must be non-finite exactly where PyTorch's is (the NaN/inf
split of a gradient depends on the order of its terms, which differs between implementations).
Both the kernel path (the interpreter on the CPU, which copies the GPU's NaN-skipping max) and the
reference path (TIGON_DISABLE=all) are checked. The documented departures from PyTorch: an
ignored row of a loss is never read, so its gradient is 0 even where PyTorch's is NaN (the loss
itself matches PyTorch there too); and a norm's row that holds a NaN or +-inf is NaN as a whole,
output and gradients (issue #19), where PyTorch's rms_norm gives NaN on CUDA but 0 for the row's
finite elements on the CPU: the norms are checked against PyTorch's norm of that row made all NaN.
"""

import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tests.helpers import assert_close

NAN, INF = float("nan"), float("inf")
VALUES = pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
IGNORE = -100
# numpy, under the interpreter, warns on the NaN and inf arithmetic these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("TIGON_DISABLE", "all")
    return request.param


def assert_nonfinite_like(got, want, dtype, name, exact=True):
    """`got` is NaN/+inf/-inf where `want` is (`exact`), or non-finite where `want` is (not
    `exact`), and close to it everywhere else."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    assert got64.shape == want64.shape, f"{name}: shape {tuple(got64.shape)} != {tuple(want64.shape)}"
    kinds = (torch.isnan, torch.isposinf, torch.isneginf) if exact else (torch.isfinite,)
    for kind in kinds:
        differ = kind(got64) != kind(want64)
        assert not differ.any(), (
            f"{name}: {kind.__name__} differs from torch at {differ.nonzero()[:4].tolist()} "
            f"(got {got64[differ][:4].tolist()}, torch {want64[differ][:4].tolist()})"
        )
    finite = torch.isfinite(want64)
    assert_close(got64[finite], want64[finite], dtype, name)


def _leaves(tensors, dtype=None):
    return [t if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def check_against_torch(fn, torch_fn, args, dtype, name, torch_grad_fn=None):
    """Outputs of ``fn(*args)`` against ``torch_fn`` on float64 copies; gradients (of the same
    random output gradients) against ``torch_grad_fn or torch_fn``."""
    ours, theirs = _leaves(args), _leaves(args, torch.float64)
    outs, want = fn(*ours), torch_fn(*theirs)
    outs, want = (outs, want) if isinstance(outs, tuple) else ((outs,), (want,))
    for i, (o, w) in enumerate(zip(outs, want)):
        assert_nonfinite_like(o, w, dtype, f"{name} output {i}")
    if torch_grad_fn is not None:
        theirs = _leaves(args, torch.float64)
        want = torch_grad_fn(*theirs)
        want = want if isinstance(want, tuple) else (want,)
    grads = [torch.randn(w.shape, dtype=torch.float64, device=w.device) for w in want]
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])
    torch.autograd.backward(want, grads)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a is not None:
            assert_nonfinite_like(a.grad, b.grad, dtype, f"{name} grad {i}", exact=False)


def _torch_losses(logits, target, mask_ignored, label_smoothing=0.0, z_loss_scale=0.0, softcap=None):
    """Per-row losses from PyTorch's cross_entropy, z-loss and softcap written out in torch ops.
    `mask_ignored` zeroes the ignored rows first: the gradient tigon defines (0 on ignored rows)."""
    valid = target != IGNORE
    if mask_ignored:
        logits = torch.where(valid[:, None], logits, 0.0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = TF.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none", label_smoothing=label_smoothing)
    if z_loss_scale:
        losses = losses + torch.where(valid, z_loss_scale * torch.logsumexp(logits, -1) ** 2, 0.0)
    return losses


def _reduce(losses, target, reduction, num_items=None):
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (num_items if num_items is not None else (target != IGNORE).sum())


def planted_logits(rows, vocab, value, dtype, device):
    """Logits with `value` at a row's target, early in a row, in the last block of a row, in an
    ignored row, and as a whole row; the other rows are clean."""
    logits = 2 * torch.randn(rows, vocab, device=device)
    target = torch.randint(0, vocab, (rows,), device=device)
    target[:5] = torch.tensor([17, vocab - 1, 1, IGNORE, 0], device=device)
    logits[0, 17] = value
    logits[1, 3] = value
    logits[2, vocab - 2] = value
    logits[3, 10] = value
    logits[4] = value
    return logits.to(dtype), target


CE_CASES = [
    ("mean", {}),
    ("none", {}),
    ("sum", dict(label_smoothing=0.1)),
    ("none", dict(label_smoothing=0.2, z_loss_scale=1e-3)),
    ("mean", dict(softcap=5.0, z_loss_scale=1e-4)),
]


def check_cross_entropy(logits, target, reduction, options, dtype, name):
    def torch_fn(mask):
        return lambda x: _reduce(_torch_losses(x, target, mask, **options), target, reduction)

    check_against_torch(
        lambda x: F.cross_entropy(x, target, reduction=reduction, **options),
        torch_fn(False), (logits,), dtype, name, torch_grad_fn=torch_fn(True),
    )


@VALUES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction,options", CE_CASES)
def test_cross_entropy(poison_outputs, device, path, value, dtype, reduction, options):
    logits, target = planted_logits(8, 8197, value, dtype, device)  # two vocab blocks per row
    check_cross_entropy(logits, target, reduction, options, dtype, f"cross_entropy {path} {value} {options}")


def _lce_inputs(value, where, dtype, device, rows=11, hidden=16, vocab=1000):
    """hidden, weight, bias and targets, with `value` in one valid and one ignored hidden row, or
    one element of the weight (row 7: that logit of every token), or one element of the bias."""
    h = torch.randn(rows, hidden, device=device)
    w = torch.randn(vocab, hidden, device=device) * 2 * hidden**-0.5
    b = 0.5 * torch.randn(vocab, device=device)
    target = torch.randint(0, vocab, (rows,), device=device)
    target[[3, 8]] = IGNORE
    if where == "hidden":
        h[2, 5] = value
        h[3, 1] = value
    elif where == "weight":
        w[7, 4] = value
    else:
        b[7] = value
    return h.to(dtype), w.to(dtype), b.to(dtype), target


def check_linear_cross_entropy(h, w, b, target, reduction, num_items, chunk, dtype, name):
    def torch_fn(mask):
        def fn(h, w, b):
            return _reduce(_torch_losses(TF.linear(h, w, b), target, mask), target, reduction, num_items)
        return fn

    budget = chunk * w.shape[0] * dtype.itemsize
    check_against_torch(
        lambda h, w, b: F.linear_cross_entropy(
            h, w, target, b, reduction=reduction, num_items_in_batch=num_items, max_chunk_bytes=budget
        ),
        torch_fn(False), (h, w, b), dtype, name, torch_grad_fn=torch_fn(True),
    )


@VALUES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("sum", None), ("none", None), ("mean", 23)])
def test_linear_cross_entropy(poison_outputs, device, path, value, dtype, where, reduction, num_items):
    h, w, b, target = _lce_inputs(value, where, dtype, device)
    # Chunks of 4 rows: three chunks, the last partial.
    check_linear_cross_entropy(
        h, w, b, target, reduction, num_items, 4, dtype, f"linear_cross_entropy {path} {value} in {where}"
    )


def nan_rows(t):
    """`t` with each row that holds a NaN or +-inf made all NaN: PyTorch's norm of it is what the
    norms must give on every device, forward and backward."""
    return t * torch.where(torch.isfinite(t).all(-1, keepdim=True), 1.0, NAN)


def _norm_inputs(value, where, dtype, device, rows=6, width=37):
    x, r = torch.randn(rows, width, device=device), torch.randn(rows, width, device=device)
    w, b = 1 + 0.3 * torch.randn(width, device=device), 0.3 * torch.randn(width, device=device)
    planted = {"x": (x, (2, 5)), "residual": (r, (4, 0)), "weight": (w, 9), "bias": (b, 9)}[where]
    planted[0][planted[1]] = value
    return [t.to(dtype) for t in (x, r, w, b)]


@VALUES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["x", "weight"])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
def test_rms_norm(poison_outputs, device, path, value, dtype, where, casting, offset):
    x, _, w, _ = _norm_inputs(value, where, dtype, device)
    check_against_torch(
        lambda x, w: F.rms_norm(x, w, 1e-6, offset=offset, casting=casting),
        lambda x, w: TF.rms_norm(nan_rows(x), (x.shape[-1],), offset + w, 1e-6),
        (x, w), dtype, f"rms_norm {path} {casting} {value} in {where}",
    )


@VALUES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["x", "residual", "weight"])
def test_add_rms_norm(poison_outputs, device, path, value, dtype, where):
    x, r, w, _ = _norm_inputs(value, where, dtype, device)

    check_against_torch(
        lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6), _torch_add_rms_norm, (x, r, w), dtype,
        f"add_rms_norm {path} {value} in {where}",
    )


def _torch_add_rms_norm(x, r, w):
    total = x + r
    return TF.rms_norm(nan_rows(total), (x.shape[-1],), w, 1e-6), total


@VALUES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["x", "weight", "bias"])
def test_layer_norm(poison_outputs, device, path, value, dtype, where):
    x, _, w, b = _norm_inputs(value, where, dtype, device)
    check_against_torch(
        lambda x, w, b: F.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: TF.layer_norm(nan_rows(x), (x.shape[-1],), w, b, 1e-5),
        (x, w, b), dtype, f"layer_norm {path} {value} in {where}",
    )


@pytest.mark.parametrize("norm", ["rms_norm", "add_rms_norm", "layer_norm"])
def test_norm_row_past_fp32_range_is_nan(poison_outputs, device, path, norm):
    # Finite values whose sum of squares (variance) overflows fp32: rsqrt(inf) = 0 would give the
    # row zeros (or the bare bias) for an answer; it is NaN, with NaN gradients, like a row with an inf.
    x, r, w, b = _norm_inputs(0.0, "x", torch.float32, device)
    x[2] *= 1e20
    x, r, w, b = (t.requires_grad_() for t in (x, r, w, b))
    out = {"rms_norm": lambda: F.rms_norm(x, w), "add_rms_norm": lambda: F.add_rms_norm(x, r, w)[0],
           "layer_norm": lambda: F.layer_norm(x, w, b)}[norm]()
    out.backward(torch.randn_like(out))
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3, 4, 5]]).all(), out
    assert torch.isnan(x.grad[2]).all() and torch.isfinite(x.grad[[0, 1, 3, 4, 5]]).all(), x.grad


# On the GPU: bf16 and fp32, a vocabulary of 16 blocks per row, and the GPU's own max.f32.

GPU = torch.device("cuda")
GPU_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


@pytest.mark.gpu
@VALUES
@GPU_DTYPES
@pytest.mark.parametrize("reduction,options", CE_CASES)
def test_cross_entropy_on_gpu(value, dtype, reduction, options):
    logits, target = planted_logits(8, 128256, value, dtype, GPU)
    check_cross_entropy(logits, target, reduction, options, dtype, f"cross_entropy gpu {value} {options}")


@pytest.mark.gpu
@VALUES
@GPU_DTYPES
@pytest.mark.parametrize("where", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("none", None), ("mean", 23)])
def test_linear_cross_entropy_on_gpu(value, dtype, where, reduction, num_items):
    h, w, b, target = _lce_inputs(value, where, dtype, GPU, rows=80, hidden=256, vocab=128256)
    # Chunks of 64 rows: one full, one of 16.
    check_linear_cross_entropy(
        h, w, b, target, reduction, num_items, 64, dtype, f"linear_cross_entropy gpu {value} in {where}"
    )


@pytest.mark.gpu
@VALUES
@GPU_DTYPES
@pytest.mark.parametrize("where", ["x", "residual", "weight", "bias"])
def test_norms_on_gpu(path, value, dtype, where):
    x, r, w, b = _norm_inputs(value, where, dtype, GPU, rows=64, width=4096)
    name = f"gpu {path} {value} in {where}"
    check_against_torch(
        lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6), _torch_add_rms_norm, (x, r, w), dtype, f"add_rms_norm {name}",
    )
    check_against_torch(
        lambda x, w: F.rms_norm(x, w, 1e-6, offset=1.0, casting="gemma"),
        lambda x, w: TF.rms_norm(nan_rows(x), (x.shape[-1],), 1.0 + w, 1e-6),
        (x, w), dtype, f"rms_norm {name}",
    )
    check_against_torch(
        lambda x, w, b: F.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: TF.layer_norm(nan_rows(x), (x.shape[-1],), w, b, 1e-5),
        (x, w, b), dtype, f"layer_norm {name}",
    )
