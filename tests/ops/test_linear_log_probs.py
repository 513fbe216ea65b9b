import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops.linear_log_probs import linear_log_probs_reference
from tests.helpers import assert_close, compare_fwd_bwd, count_gemms as _count_gemms, head_inputs as _inputs

IGNORE = -100


def _budget(vocab, dtype, rows=5):
    """A chunk budget of `rows` rows: with 14 tokens, two full chunks and a partial one."""
    return rows * vocab * dtype.itemsize


def _torch_log_probs(target, temperature=1.0, entropy=False):
    """From torch alone: logp as -cross_entropy, the entropy from torch.distributions."""
    def fn(h, w, b=None):
        z = (TF.linear(h, w, b) / temperature).reshape(-1, w.shape[0])
        flat = target.reshape(-1)
        logp = -TF.cross_entropy(z, flat.clamp(min=0), reduction="none")
        valid = flat != IGNORE
        logp = torch.where(valid, logp, 0.0).view(target.shape)
        if not entropy:
            return logp
        ent = torch.distributions.Categorical(logits=z).entropy()
        return logp, torch.where(valid, ent, 0.0).view(target.shape)
    return fn


def test_reference_matches_torch(device):
    h, w, b, target = _inputs((3, 5), 16, 300, torch.float64, device)
    for temperature in (1.0, 0.6):
        want = _torch_log_probs(target, temperature, entropy=True)(h, w, b)
        got = linear_log_probs_reference(h, w, target, b, IGNORE, temperature, True)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 1031), (torch.float16, 257)])
@pytest.mark.parametrize("entropy,temperature", [(False, 1.0), (True, 0.7), (True, 1.0), (False, 1.9)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(poison_outputs, device, dtype, vocab, entropy, temperature, bias):
    # Trainable head: backward recomputes the chunks with random upstream gradients of both outputs.
    h, w, b, target = _inputs((2, 7), 19, vocab, dtype, device, bias)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_log_probs(
            h, w, target, b, temperature=temperature, return_entropy=entropy, max_chunk_bytes=_budget(vocab, dtype)
        ),
        _torch_log_probs(target, temperature, entropy),
        (h, w, b), name=f"log_probs entropy={entropy} T={temperature} bias={bias}",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("entropy", [False, True])
def test_frozen_head_forms_hidden_gradient_in_forward(poison_outputs, device, monkeypatch, dtype, entropy):
    # A frozen head costs no weight-gradient GEMM; the logp part of grad_hidden comes from forward
    # (one GEMM more there, none in backward), the entropy part from a recompute only when used.
    h, w, b, target = _inputs((14,), 19, 1031, dtype, device)
    w.requires_grad_(False)
    b.requires_grad_(False)
    shapes = _count_gemms(monkeypatch)
    budget = _budget(1031, dtype)
    out = compare_fwd_bwd(
        lambda h: F.linear_log_probs(h, w, target, b, temperature=0.8, return_entropy=entropy, max_chunk_bytes=budget),
        lambda h: _torch_log_probs(target, 0.8, entropy)(h, w.to(h.dtype), b.to(h.dtype)),
        (h,), name=f"frozen head entropy={entropy}",
    )
    assert tuple(w.shape) not in shapes
    # forward: 3 logits GEMMs + 3 grad_hidden GEMMs; the entropy's gradient: 3 + 3 more
    assert len(shapes) == (12 if entropy else 6), shapes
    assert out[0].dtype == torch.float32


def test_frozen_head_with_unused_entropy_skips_the_recompute(poison_outputs, device, monkeypatch):
    h, w, b, target = _inputs((14,), 19, 1031, torch.float32, device, bias=False)
    w.requires_grad_(False)
    shapes = _count_gemms(monkeypatch)
    logp, entropy = F.linear_log_probs(h, w, target, return_entropy=True, max_chunk_bytes=_budget(1031, torch.float32))
    grad = torch.randn_like(logp)
    logp.backward(grad)
    assert len(shapes) == 6
    ref = h.detach().double().requires_grad_()
    _torch_log_probs(target)(ref, w.double()).backward(grad.double())
    assert_close(h.grad, ref.grad.float(), name="grad h")


def test_frozen_hidden_computes_only_the_weight_gradient(poison_outputs, device, monkeypatch):
    h, w, b, target = _inputs((14,), 19, 1031, torch.float32, device)
    h.requires_grad_(False)
    shapes = _count_gemms(monkeypatch)
    compare_fwd_bwd(
        lambda w, b: F.linear_log_probs(h, w, target, b, max_chunk_bytes=_budget(1031, torch.float32)),
        lambda w, b: _torch_log_probs(target)(h.to(w.dtype), w, b),
        (w, b), name="frozen hidden",
    )
    assert (5, 19) not in shapes and (4, 19) not in shapes
    assert shapes.count(tuple(w.shape)) == 3


def test_no_grad_runs_one_gemm_per_chunk(device, monkeypatch):
    h, w, b, target = _inputs((14,), 19, 1031, torch.float32, device)
    shapes = _count_gemms(monkeypatch)
    with torch.no_grad():
        logp = F.linear_log_probs(h, w, target, b, max_chunk_bytes=_budget(1031, torch.float32))
    assert len(shapes) == 3
    assert_close(logp, _torch_log_probs(target)(h, w, b).detach(), name="no_grad logp")


@pytest.mark.parametrize("frozen", [False, True])
def test_second_backward_with_retain_graph(poison_outputs, device, frozen):
    h, w, b, target = _inputs((14,), 19, 257, torch.float32, device)
    w.requires_grad_(not frozen)
    b.requires_grad_(not frozen)
    logp = F.linear_log_probs(h, w, target, b, max_chunk_bytes=_budget(257, torch.float32))
    grad = torch.randn_like(logp)
    logp.backward(grad, retain_graph=True)
    first = h.grad.clone()
    logp.backward(grad)
    ref = h.detach().clone().requires_grad_()
    _torch_log_probs(target)(ref, w.detach(), b.detach()).backward(grad)
    assert_close(first, ref.grad, name="first backward")
    assert_close(h.grad, 2 * ref.grad, name="accumulated")


@pytest.mark.parametrize("frozen", [False, True])
def test_ignored_tokens_are_zero_and_pass_no_gradient(poison_outputs, device, frozen):
    h, w, b, target = _inputs((14,), 19, 257, torch.float32, device)
    w.requires_grad_(not frozen)
    target[:5] = IGNORE
    logp, entropy = F.linear_log_probs(h, w, target, b, return_entropy=True, max_chunk_bytes=_budget(257, torch.float32))
    assert torch.equal(logp[:5], torch.zeros(5)) and torch.equal(entropy[:5], torch.zeros(5))
    # Whatever upstream gradient an ignored position gets, even NaN, it reaches nothing.
    grad = torch.randn_like(logp)
    grad[:5] = float("nan")
    (logp * grad).sum().backward()
    assert torch.equal(h.grad[:5], torch.zeros(5, 19))
    ref = h.detach().clone().requires_grad_()
    (_torch_log_probs(target)(ref, w.detach(), b.detach()) * grad.nan_to_num()).sum().backward()
    assert_close(h.grad, ref.grad, name="grad h")


def test_all_ignored_gives_zeros(poison_outputs, device):
    h, w, b, _ = _inputs((6,), 19, 257, torch.float32, device)
    target = torch.full((6,), IGNORE, device=device)
    logp, entropy = F.linear_log_probs(h, w, target, b, return_entropy=True)
    assert torch.equal(logp, torch.zeros(6)) and torch.equal(entropy, torch.zeros(6))
    (logp.sum() + entropy.sum()).backward()
    for p in (h, w, b):
        assert torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
@pytest.mark.parametrize("frozen", [False, True])
def test_nan_in_a_row_gives_nan_there(poison_outputs, device, frozen):
    # tl.max skips NaN on the GPU (and in the interpreter): the row's outputs must still be NaN.
    h, w, b, target = _inputs((6,), 19, 257, torch.float32, device)
    target[:] = torch.arange(6, device=device)
    w.requires_grad_(not frozen)
    with torch.no_grad():
        h[2, 3] = float("nan")
        w[100, :] = torch.where(torch.arange(19, device=device) == 0, float("inf"), 0.0).to(w.dtype)
    logp, entropy = F.linear_log_probs(h, w, target, b, return_entropy=True)
    assert torch.isnan(logp[2]) and torch.isnan(entropy[2])
    # Column 100's logit is +inf (NaN outputs) or -inf (harmless) by the sign of h[:, 0], as in torch.
    want = linear_log_probs_reference(h.detach(), w.detach(), target, b.detach(), IGNORE, 1.0, True)
    for got, expected in zip((logp, entropy), want):
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    logp.sum().backward()
    assert torch.isnan(h.grad[2]).all()


def test_target_outside_vocab_gives_nan(poison_outputs, device):
    h, w, b, target = _inputs((4,), 19, 257, torch.float32, device)
    target[:] = torch.tensor([0, 257, -1, 3])
    logp = F.linear_log_probs(h.detach(), w.detach(), target, b.detach())
    assert torch.isnan(logp[1:3]).all() and torch.isfinite(logp[[0, 3]]).all()


def test_strided_hidden_and_int32_target(poison_outputs, device):
    base = torch.randn(2, 8, 24, device=device)
    h = base[:, 1:, :19].detach().requires_grad_()  # (2, 7, 19), rows strided
    _, w, b, target = _inputs((2, 7), 19, 257, torch.float32, device)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_log_probs(h, w, target.to(torch.int32), b, return_entropy=True, max_chunk_bytes=_budget(257, torch.float32)),
        _torch_log_probs(target, entropy=True), (h, w, b), name="strided",
    )


def _torch_stats(h, w, b, target, temperature=1.0):
    """The statistics from torch alone: the mean logit, argmax == target, log of sum p^2. The
    argmax is taken over the logits in the input dtype, as the op rounds them: two fp16 logits that
    differ in float64 can be one value there, and the first of them is the argmax."""
    z = (TF.linear(h.double(), w.double(), None if b is None else b.double()) / temperature)
    rounded = TF.linear(h, w, b).double() / temperature
    valid = target != IGNORE
    p = z.softmax(-1)
    return (torch.where(valid, z.mean(-1), 0.0).float(), valid & (rounded.argmax(-1) == target),
            torch.where(valid, (p * p).sum(-1).log(), 0.0).float())


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 1031), (torch.float16, 257)])
@pytest.mark.parametrize("entropy", [False, True])
def test_stats_match_torch_and_change_no_gradient(poison_outputs, device, dtype, vocab, entropy):
    """The statistics TRL's fused head reports (mean logit, top-1, log sum p^2), from the chunks'
    one pass; asking for them leaves the outputs and the gradients as they are."""
    h, w, b, target = _inputs((3, 7), 19, vocab, dtype, device)
    with torch.no_grad():  # a third of the tokens predicted right (and not ignored), so that top-1 is both
        best = TF.linear(h.float(), w.float(), b.float()).argmax(-1)
    target = torch.where((torch.arange(21, device=device) % 3 == 0).view(3, 7), best, target)
    budget = _budget(vocab, dtype)
    *out, stats = F.linear_log_probs(h, w, target, b, temperature=0.8, return_entropy=entropy, return_stats=True,
                                     max_chunk_bytes=budget)
    mean, top1, log_sum_sq = _torch_stats(h.detach(), w.detach(), b.detach(), target, 0.8)
    assert stats.is_top1.dtype == torch.bool and torch.equal(stats.is_top1, top1) and 3 <= top1.sum() < 16
    assert_close(stats.mean_logits, mean, dtype, name="mean logits")
    assert_close(stats.log_sum_sq_probs, log_sum_sq, dtype, name="log sum p^2")
    assert not any(t.requires_grad for t in stats)
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    plain = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    again = F.linear_log_probs(*plain[:2], target, plain[2], temperature=0.8, return_entropy=entropy,
                               max_chunk_bytes=budget)
    again = list(again) if entropy else [again]
    torch.autograd.backward(again, grads)
    for ours, theirs in zip([*out, h.grad, w.grad, b.grad], [*again, *(t.grad for t in plain)]):
        assert torch.equal(ours, theirs)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
def test_stats_take_the_first_argmax_and_no_argmax_in_a_nan_row(poison_outputs, device):
    h, w, b, target = _inputs((5,), 19, 257, torch.float32, device, bias=False)
    with torch.no_grad():  # columns 100 and 200 tie, far above all others
        w[200] = w[100] = 5.0 * (torch.arange(19, device=device) == 0)
        h[:, 0] = 3.0
        h[4, 3] = float("nan")
    target[:] = torch.tensor([100, 200, 100, IGNORE, 100], device=device)
    for fn in (lambda: F.linear_log_probs(h, w, target, return_stats=True)[1],
               lambda: linear_log_probs_reference(h, w, target, None, IGNORE, 1.0, False, True)[1]):
        stats = fn()
        assert stats.is_top1.tolist() == [True, False, True, False, False]
        assert stats.mean_logits[3] == 0 and stats.log_sum_sq_probs[3] == 0
        assert torch.isnan(stats.mean_logits[4]) and torch.isnan(stats.log_sum_sq_probs[4])


def test_stats_under_compile_equal_eager(device):
    h, w, b, target = _inputs((2, 5), 16, 37, torch.float32, device)

    def fn(h, w, b):
        return F.linear_log_probs(h, w, target, b, temperature=0.7, return_entropy=True, return_stats=True,
                                  max_chunk_bytes=600)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager", fullgraph=True)(h, w, b)
    want = fn(h, w, b)
    for ours, theirs in zip([*got[:2], *got[2]], [*want[:2], *want[2]]):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(w=torch.randn(10, 7)), r"weight must have shape \(vocab, 8\)"),
        (dict(w=torch.randn(10, 8).half()), "weight must have the dtype of hidden"),
        (dict(b=torch.randn(9)), r"bias must have shape \(10,\)"),
        (dict(t=torch.zeros(4, dtype=torch.long)), r"target must have shape \(3,\)"),
        (dict(temperature=0.0), "temperature must be a positive float"),
        (dict(return_entropy=1), "return_entropy must be a bool"),
        (dict(return_stats="yes"), "return_stats must be a bool"),
        (dict(ignore_index=1.5), "ignore_index must be an int"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(h=torch.randn(3, 8), w=torch.randn(10, 8), t=torch.zeros(3, dtype=torch.long), b=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        F.linear_log_probs(args["h"], args["w"], args["t"], args["b"], **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [False, True])
def test_bf16_on_gpu(frozen):
    h, w, b, target = _inputs((2, 1000), 1024, 32064, torch.bfloat16, torch.device("cuda"))
    w.requires_grad_(not frozen)
    b.requires_grad_(not frozen)
    if frozen:
        compare_fwd_bwd(
            lambda h: F.linear_log_probs(h, w, target, b, temperature=0.9, return_entropy=True),
            lambda h: linear_log_probs_reference(h, w.to(h.dtype), target, b.to(h.dtype), IGNORE, 0.9, True),
            (h,), torch.bfloat16, name="bf16 frozen",
        )
    else:
        compare_fwd_bwd(
            lambda h, w, b: F.linear_log_probs(h, w, target, b, temperature=0.9, return_entropy=True),
            lambda h, w, b: linear_log_probs_reference(h, w, target, b, IGNORE, 0.9, True),
            (h, w, b), torch.bfloat16, name="bf16",
        )


@pytest.mark.gpu
def test_peak_memory_on_gpu():
    # issue 21: at N=8192, H=4096, V=128256 (bf16) at most 256 MiB beyond the gradients.
    h, w, _, target = _inputs((8192,), 4096, 128256, torch.bfloat16, torch.device("cuda"), bias=False)
    grad = torch.randn(8192, device="cuda")
    F.linear_log_probs(h, w, target).backward(grad)  # compile kernels, create cuBLAS workspaces
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    F.linear_log_probs(h, w, target).backward(grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes
    assert extra <= 256 * 2**20, f"{extra / 2**20:.1f} MiB beyond the gradients"


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [False, True])
def test_no_host_sync_on_gpu(frozen):
    h, w, b, target = _inputs((1000,), 1024, 32064, torch.bfloat16, torch.device("cuda"))
    w.requires_grad_(not frozen)
    F.linear_log_probs(h, w, target, b).sum().backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, entropy = F.linear_log_probs(h, w, target, b, return_entropy=True)
        (logp.sum() + 0.1 * entropy.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
