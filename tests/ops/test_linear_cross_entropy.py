import pytest
import torch
import torch.nn.functional as TF

import tigon.functional as F
from tigon.ops import linear_cross_entropy as lce
from tigon.ops._chunked_head import chunk_rows
from tigon.ops.linear_cross_entropy import linear_cross_entropy_reference
from tests.helpers import assert_close, compare_fwd_bwd

IGNORE = -100


def _inputs(lead, hidden, vocab, dtype, device, bias=True):
    h = torch.randn(*lead, hidden, device=device).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device) * 2 * hidden**-0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab, device=device)).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, lead, device=device)
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), device=device)[: max(1, flat.numel() // 4)]] = IGNORE
    return h, w, b, target


def _budget(vocab, dtype, rows=5):
    """A chunk budget of `rows` rows: with 13 tokens, two full chunks and a partial one."""
    return rows * vocab * dtype.itemsize


def _torch_loss(target, **options):
    """F.cross_entropy(F.linear(h, w, b), t) from torch alone, as the oracle."""
    def fn(h, w, b=None):
        logits = TF.linear(h, w, b)
        out = TF.cross_entropy(logits.reshape(-1, w.shape[0]), target.reshape(-1), **options)
        return out.view(target.shape) if options.get("reduction") == "none" else out
    return fn


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 8197), (torch.float16, 1000)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch(poison_outputs, device, dtype, vocab, reduction, bias):
    h, w, b, target = _inputs((13,), 16, vocab, dtype, device, bias)
    budget = _budget(vocab, dtype)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(h, w, target, b, reduction=reduction, max_chunk_bytes=budget),
        _torch_loss(target, reduction=reduction),
        (h, w, b), name=f"linear_cross_entropy {reduction} bias={bias}",
    )


@pytest.mark.parametrize(
    "label_smoothing,z_loss_scale,softcap,reduction",
    [(0.1, 0.0, None, "mean"), (0.0, 1e-3, None, "sum"), (0.0, 0.0, 5.0, "mean"), (0.2, 1e-2, 3.0, "none")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_options_match_reference(poison_outputs, device, dtype, label_smoothing, z_loss_scale, softcap, reduction):
    h, w, b, target = _inputs((2, 6), 16, 1000, dtype, device)
    options = (IGNORE, reduction, label_smoothing, z_loss_scale, softcap)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(
            h, w, target, b, reduction=reduction, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
            softcap=softcap, max_chunk_bytes=_budget(1000, dtype),
        ),
        lambda h, w, b: linear_cross_entropy_reference(h, w, target, b, *options),
        (h, w, b), name=f"eps={label_smoothing} z={z_loss_scale} softcap={softcap}",
    )


def test_reference_matches_torch(device):
    h, w, b, target = _inputs((9,), 16, 300, torch.float64, device)
    for reduction in ("mean", "sum", "none"):
        want = _torch_loss(target, reduction=reduction, label_smoothing=0.1)(h, w, b)
        got = linear_cross_entropy_reference(h, w, target, b, IGNORE, reduction, 0.1)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_items", [5, "cpu tensor", "device tensor"])
def test_num_items_in_batch(poison_outputs, device, num_items):
    h, w, b, target = _inputs((13,), 16, 1000, torch.float32, device)
    count = {5: 5, "cpu tensor": torch.tensor(37), "device tensor": torch.tensor(37, device=device)}[num_items]
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(h, w, target, b, num_items_in_batch=count, max_chunk_bytes=_budget(1000, torch.float32)),
        lambda h, w, b: _torch_loss(target, reduction="sum")(h, w, b) / int(count),
        (h, w, b), name=f"num_items_in_batch={num_items}",
    )


def test_all_ignored_gives_zero_loss_and_gradients(poison_outputs, device):
    h, w, b, _ = _inputs((10,), 16, 1000, torch.float32, device)
    target = torch.full((10,), IGNORE, device=device)
    for num_items in (None, 0):
        loss = F.linear_cross_entropy(h, w, target, b, z_loss_scale=1e-3, num_items_in_batch=num_items)
        assert torch.equal(loss, torch.zeros_like(loss))
        loss.backward()
        for p in (h, w, b):
            assert torch.equal(p.grad, torch.zeros_like(p)), "gradient of an all-ignored batch"
            p.grad = None


def test_frozen_tensors_skip_their_gemms(poison_outputs, device, monkeypatch):
    # A frozen weight must cost no weight-gradient GEMM, a frozen hidden no hidden-gradient GEMM.
    h, w, b, target = _inputs((13,), 16, 1000, torch.float32, device, bias=False)
    out_shapes = []
    real_mm, real_addmm_ = torch.mm, torch.Tensor.addmm_
    monkeypatch.setattr(torch, "mm", lambda *a, **k: out_shapes.append(tuple(real_mm(*a, **k).shape)) or k["out"])
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda self, *a, **k: out_shapes.append(tuple(self.shape)) or real_addmm_(self, *a, **k))
    budget = _budget(1000, torch.float32)

    w.requires_grad_(False)
    compare_fwd_bwd(lambda h: F.linear_cross_entropy(h, w, target, max_chunk_bytes=budget), lambda h: _torch_loss(target)(h, w.to(h.dtype)), (h,), name="frozen w")
    assert tuple(w.shape) not in out_shapes and out_shapes.count((5, 16)) == 2  # grad_h: 5, 5, 3 rows
    out_shapes.clear()

    w.requires_grad_(True)
    h.requires_grad_(False)
    compare_fwd_bwd(lambda w: F.linear_cross_entropy(h, w, target, max_chunk_bytes=budget), lambda w: _torch_loss(target)(h.to(w.dtype), w), (w,), name="frozen h")
    assert out_shapes.count(tuple(w.shape)) == 3 and (5, 16) not in out_shapes and (3, 16) not in out_shapes


def test_no_grad_computes_no_gradient(device, monkeypatch):
    h, w, b, target = _inputs((13,), 16, 1000, torch.float32, device)
    gemms = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: gemms.append(1) or real_mm(*a, **k))
    with torch.no_grad():
        loss = F.linear_cross_entropy(h, w, target, max_chunk_bytes=_budget(1000, torch.float32))
    assert_close(loss, _torch_loss(target)(h, w).detach(), name="no_grad loss")
    assert len(gemms) == 3  # the logits of three chunks, nothing else


def test_loss_backward_and_retain_graph(poison_outputs, device):
    # grad_output = 1 takes the skip path; a second backward recomputes the consumed gradients.
    h, w, b, target = _inputs((13,), 16, 8197, torch.float32, device)
    loss = F.linear_cross_entropy(h, w, target, b, label_smoothing=0.1, max_chunk_bytes=_budget(8197, torch.float32))
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in (h, w, b)]
    loss.backward()
    refs = [p.detach().clone().requires_grad_() for p in (h, w, b)]
    _torch_loss(target, label_smoothing=0.1)(*refs).backward()
    for name, p, once, ref in zip("hwb", (h, w, b), first, refs):
        assert_close(once, ref.grad, name=f"grad {name}")
        assert_close(p.grad, 2 * ref.grad, name=f"accumulated grad {name}")


def test_strided_hidden_and_int32_target(poison_outputs, device):
    base = torch.randn(2, 7, 20, device=device)
    h = base[:, 1:, :16].detach().requires_grad_()  # (2, 6, 16), rows strided
    _, w, b, target = _inputs((2, 6), 16, 1000, torch.float32, device)
    target32 = target.to(torch.int32)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(h, w, target32, b, max_chunk_bytes=_budget(1000, torch.float32)),
        _torch_loss(target), (h, w, b), name="strided",
    )


def test_inside_torch_compile(device):
    h, w, b, target = _inputs((12,), 16, 1000, torch.float32, device)

    def step(x, w):
        return F.linear_cross_entropy(x * 2.0, w, target, max_chunk_bytes=_budget(1000, torch.float32))

    loss = torch.compile(step, backend="eager")(h, w)
    loss.backward()
    refs = [p.detach().clone().requires_grad_() for p in (h, w)]
    want = _torch_loss(target)(refs[0] * 2.0, refs[1])
    want.backward()
    assert_close(loss, want.detach(), name="loss")
    assert_close(h.grad, refs[0].grad, name="grad h")
    assert_close(w.grad, refs[1].grad, name="grad w")


def test_chunk_rows():
    assert chunk_rows(128 * 2**20, 128256, torch.bfloat16) == 512  # 523 rows fit: whole 64-row tiles
    assert chunk_rows(2**30, 128256, torch.bfloat16) == 4160
    assert chunk_rows(10 * 8197 * 4, 8197, torch.float32) == 10
    assert chunk_rows(1, 8197, torch.float32) == 1  # below one row: one row
    assert lce.DEFAULT_MAX_CHUNK_BYTES >= chunk_rows(lce.DEFAULT_MAX_CHUNK_BYTES, 128256, torch.bfloat16) * 128256 * 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(w=torch.randn(10, 7)), r"weight must have shape \(vocab, 8\)"),
        (dict(w=torch.randn(10, 8).half()), "weight must have the dtype of hidden"),
        (dict(b=torch.randn(9)), r"bias must have shape \(10,\)"),
        (dict(b=torch.randn(10).half()), "bias must have the dtype"),
        (dict(t=torch.zeros(4, dtype=torch.long)), r"target must have shape \(3,\)"),
        (dict(num_items_in_batch=2.5), "num_items_in_batch must be an int or a 0-dim tensor"),
        (dict(num_items_in_batch=torch.tensor([3])), "num_items_in_batch must be an int or a 0-dim tensor"),
        (dict(num_items_in_batch=4, reduction="sum"), "reduction must be 'mean'"),
        (dict(max_chunk_bytes=0), "max_chunk_bytes must be a positive int"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(softcap=-1.0), "softcap must be"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(h=torch.randn(3, 8), w=torch.randn(10, 8), t=torch.zeros(3, dtype=torch.long), b=None)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        F.linear_cross_entropy(args["h"], args["w"], args["t"], args["b"], **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,bias", [((8192, 4096, 128256), False), ((1000, 1024, 32064), True), ((37, 256, 8197), True)])
def test_bf16_on_gpu(shape, bias):
    rows, hidden, vocab = shape
    h, w, b, target = _inputs((rows,), hidden, vocab, torch.bfloat16, torch.device("cuda"), bias)
    compare_fwd_bwd(
        lambda h, w, b: F.linear_cross_entropy(h, w, target, b, label_smoothing=0.1),
        lambda h, w, b: linear_cross_entropy_reference(h, w, target, b, label_smoothing=0.1),
        (h, w, b), torch.bfloat16, name=f"bf16 {shape}",
    )


@pytest.mark.gpu
def test_peak_memory_on_gpu():
    # The bound: at N=8192, H=4096, V=128256 (bf16) the op may allocate at most 128 MiB beyond
    # the gradients it returns, in forward and backward together.
    h, w, _, target = _inputs((8192,), 4096, 128256, torch.bfloat16, torch.device("cuda"), bias=False)
    F.linear_cross_entropy(h, w, target).backward()  # compile kernels, create cuBLAS workspaces
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    F.linear_cross_entropy(h, w, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes
    assert extra <= 128 * 2**20, f"{extra / 2**20:.1f} MiB beyond the gradients"


@pytest.mark.gpu
@pytest.mark.parametrize("num_items", [None, 1000, "tensor"])
def test_no_host_sync_on_gpu(num_items):
    h, w, b, target = _inputs((1000,), 1024, 32064, torch.bfloat16, torch.device("cuda"))
    count = torch.tensor(1000, device="cuda") if num_items == "tensor" else num_items
    F.linear_cross_entropy(h, w, target, b, num_items_in_batch=count).backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = F.linear_cross_entropy(h, w, target, b, num_items_in_batch=count)
        (loss * 0.5).backward()  # grad_output != 1: the scaling pass runs too
    finally:
        torch.cuda.set_sync_debug_mode(0)
