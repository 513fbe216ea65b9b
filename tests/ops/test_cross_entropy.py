import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops.cross_entropy import cross_entropy_reference
from tests.helpers import assert_close, compare_fwd_bwd

IGNORE = -100


def _inputs(lead, vocab, dtype, device, ignore_index=IGNORE, scale=2.0):
    logits = (scale * torch.randn(*lead, vocab, device=device)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, lead, device=device)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), device=device)[: max(1, flat.numel() // 4)]] = ignore_index
    return logits, target


def _torch_ce(target, vocab, **kwargs):
    """torch.nn.functional.cross_entropy with the class dim last, as the oracle."""
    def fn(x):
        out = TF.cross_entropy(x.reshape(-1, vocab), target.reshape(-1), **kwargs)
        return out.view(target.shape) if kwargs.get("reduction") == "none" else out
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 8197])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch(poison_outputs, device, dtype, vocab, reduction, label_smoothing):
    lead = (13,) if vocab == 1000 else (2, 5)
    logits, target = _inputs(lead, vocab, dtype, device)
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    compare_fwd_bwd(
        lambda x: F.cross_entropy(x, target, **options), _torch_ce(target, vocab, **options),
        (logits,), name=f"cross_entropy {reduction} eps={label_smoothing}",
    )


@pytest.mark.parametrize(
    "z_loss_scale,softcap,label_smoothing,reduction",
    [(1e-3, None, 0.0, "mean"), (0.0, 5.0, 0.0, "sum"), (1e-2, 3.0, 0.2, "none"), (1e-4, 30.0, 0.1, "mean")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_z_loss_and_softcap_match_reference(poison_outputs, device, dtype, z_loss_scale, softcap, label_smoothing, reduction):
    logits, target = _inputs((11,), 8197, dtype, device, scale=4.0)
    options = (IGNORE, reduction, label_smoothing, z_loss_scale, softcap)
    compare_fwd_bwd(
        lambda x: F.cross_entropy(
            x, target, reduction=reduction, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap
        ),
        lambda x: cross_entropy_reference(x, target, *options),
        (logits,), name=f"z={z_loss_scale} softcap={softcap}",
    )


def test_reference_matches_formula():
    # The oracle for z-loss and softcap, checked against the loss written from log_softmax.
    x, target = _inputs((9,), 300, torch.float64, "cpu")
    eps, z, cap = 0.1, 1e-2, 4.0
    capped = cap * torch.tanh(x / cap)
    logp = capped.log_softmax(-1)
    valid = target != IGNORE
    nll = -logp.gather(1, target.clamp_min(0)[:, None])[:, 0]
    per_row = (1 - eps) * nll - eps * logp.mean(-1) + z * torch.logsumexp(capped, -1) ** 2
    want = (per_row * valid).sum() / valid.sum()
    got = cross_entropy_reference(x, target, IGNORE, "mean", eps, z, cap)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_gradient(poison_outputs, device, reduction):
    logits = torch.randn(6, 1000, device=device, requires_grad=True)
    target = torch.full((6,), IGNORE, device=device)
    loss = F.cross_entropy(logits, target, reduction=reduction, z_loss_scale=1e-3, label_smoothing=0.1)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_ignore_index_inside_vocab_and_int32_target(poison_outputs, device):
    logits, target = _inputs((17,), 1000, torch.float32, device, ignore_index=7)
    target[0] = 7
    target32 = target.to(torch.int32)
    compare_fwd_bwd(
        lambda x: F.cross_entropy(x, target32, ignore_index=7),
        _torch_ce(target, 1000, ignore_index=7),
        (logits,), name="ignore_index=7",
    )


def test_logits_used_elsewhere_keep_their_values_and_gradients(poison_outputs, device):
    # The gradient must go to a fresh buffer: the logits feed another term of the loss, and the
    # caller reads them after backward.
    x = torch.randn(9, 1000, device=device, requires_grad=True)
    target = torch.randint(0, 1000, (9,), device=device)

    def loss_fn(ce, x):
        logits = x * 1.5
        loss = ce(logits, target) + (logits * logits).mean()
        return loss, logits

    ours, logits = loss_fn(F.cross_entropy, x)
    before = logits.detach().clone()
    ours.backward()
    assert torch.equal(logits, before)
    x_ref = x.detach().clone().requires_grad_()
    theirs, _ = loss_fn(TF.cross_entropy, x_ref)
    theirs.backward()
    assert_close(ours, theirs, name="loss")
    assert_close(x.grad, x_ref.grad, name="grad")


def test_loss_backward_and_retain_graph(poison_outputs, device):
    logits, target = _inputs((7,), 8197, torch.float32, device)
    loss = F.cross_entropy(logits, target, label_smoothing=0.05)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    loss.backward()
    ref = logits.detach().clone().requires_grad_()
    TF.cross_entropy(ref, target, label_smoothing=0.05).backward()
    assert_close(first, ref.grad, name="grad")
    assert_close(logits.grad, 2 * ref.grad, name="accumulated grad")


def test_non_contiguous_logits(poison_outputs, device):
    wide = torch.randn(8, 1100, device=device)
    logits = wide[:, :1000].detach().requires_grad_()  # rows strided by 1100
    target = torch.randint(0, 1000, (8,), device=device)
    compare_fwd_bwd(lambda x: F.cross_entropy(x, target), _torch_ce(target, 1000), (logits,), name="strided")


def test_masked_vocab(device):
    # Out-of-range targets: tests/ops/test_labels.py.
    logits = torch.randn(3, 500, device=device)
    logits[:, 100:] = float("-inf")  # masked vocabulary: finite loss, as in torch
    target = torch.tensor([5, 50, 99], device=device)
    assert_close(F.cross_entropy(logits, target), TF.cross_entropy(logits, target), name="masked vocab")


def test_no_grad_and_float64(device):
    logits, target = _inputs((5,), 1000, torch.float32, device)
    with torch.no_grad():
        assert_close(F.cross_entropy(logits, target), TF.cross_entropy(logits, target), name="no_grad")
    x64 = logits.detach().double()
    out = F.cross_entropy(x64, target)  # runs the reference
    assert out.dtype == torch.float64
    assert_close(out, TF.cross_entropy(x64, target), name="float64")


def test_inside_torch_compile(device):
    logits, target = _inputs((6,), 1000, torch.float32, device)

    def step(x):
        return F.cross_entropy(x * 2.0, target, label_smoothing=0.1)

    compiled = torch.compile(step, backend="eager")
    loss = compiled(logits)
    loss.backward()
    ref = logits.detach().clone().requires_grad_()
    TF.cross_entropy(ref * 2.0, target, label_smoothing=0.1).backward()
    assert_close(loss, TF.cross_entropy(logits.detach() * 2.0, target, label_smoothing=0.1), name="loss")
    assert_close(logits.grad, ref.grad, name="grad")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(4, dtype=torch.long)), r"target must have shape \(3,\)"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3)), "target must hold class indices"),
        (lambda: F.cross_entropy(torch.ones(3, 8, dtype=torch.long), torch.zeros(3, dtype=torch.long)), "logits must be a floating-point"),
        (lambda: F.cross_entropy(torch.randn(3, 0), torch.zeros(3, dtype=torch.long)), "non-empty last"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), reduction="avg"), "reduction must be one of"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), label_smoothing=1.5), "label_smoothing must be"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), z_loss_scale=-1.0), "z_loss_scale must be"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), softcap=0.0), "softcap must be"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), ignore_index=1.0), "ignore_index must be an int"),
        (lambda: F.cross_entropy(torch.randn(3, 8), torch.zeros(3, dtype=torch.long, device="meta")), "target is on meta"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 128256), (64, 262144), (37, 8197)])
@pytest.mark.parametrize("options", [{}, dict(label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0)])
def test_bf16_on_gpu(shape, options):
    rows, vocab = shape
    logits, target = _inputs((rows,), vocab, torch.bfloat16, torch.device("cuda"))
    compare_fwd_bwd(
        lambda x: F.cross_entropy(x, target, **options),
        lambda x: cross_entropy_reference(x, target, **options),
        (logits,), torch.bfloat16, name=f"bf16 {shape}",
    )


@pytest.mark.gpu
def test_int64_offsets_on_gpu():
    # rows * vocab passes 2**31: the last rows sit beyond any int32 offset.
    rows, vocab = 2**31 // 131072 + 5, 131072
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    losses = F.cross_entropy(logits, target, reduction="none")
    grad = torch.zeros_like(losses)
    grad[-5:] = torch.randn(5, device="cuda")
    losses.backward(grad)
    tail = logits[-5:].detach().clone().requires_grad_()
    ref = cross_entropy_reference(tail, target[-5:], reduction="none")
    ref.backward(grad[-5:])
    assert_close(losses[-5:], ref, torch.bfloat16, name="tail losses")
    assert_close(logits.grad[-5:], tail.grad, name="tail grads")


@pytest.mark.gpu
def test_peak_memory_is_the_gradient_on_gpu():
    logits, target = _inputs((8192,), 128256, torch.bfloat16, torch.device("cuda"))
    F.cross_entropy(logits, target).backward()  # compile and warm up
    logits.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    F.cross_entropy(logits, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.grad.nbytes
    assert extra <= 2**20, f"{extra / 2**20:.1f} MiB beyond the gradient"
