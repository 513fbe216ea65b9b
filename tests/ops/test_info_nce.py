import pytest
import torch
import torch.nn.functional as F

from tigon.ops import info_nce as info_nce_module
from tigon.ops.info_nce import info_nce, info_nce_reference
from tests.helpers import assert_close, compare_fwd_bwd


def _embeddings(rows, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=g), dim=-1).to(device=device, dtype=dtype).requires_grad_()


def _fn(temperature, symmetric, max_chunk_bytes=None):
    return lambda q, d: info_nce(q, d, temperature=temperature, symmetric=symmetric, max_chunk_bytes=max_chunk_bytes)


def _ref(temperature, symmetric):
    return lambda q, d: info_nce_reference(q, d, temperature, symmetric)


def _fused_chunk(rows, docs, chunk):
    """A max_chunk_bytes that sends (rows, docs) to the fused path: `chunk`, or just below the fp32 matrix."""
    return chunk if chunk is not None else rows * docs * 4 - 1


# Odd sizes: rows and documents that fill no tile, a width that is no multiple of the K slice,
# hard negatives (N > B), and a backward in several chunks of rows; each on both paths (the
# default max_chunk_bytes holds these matrices: the scores path).
@pytest.mark.parametrize("path", ["scores", "fused"])
@pytest.mark.parametrize("dtype, rows, docs, dim, symmetric, chunk, temperature", [
    (torch.float32, 37, 37, 50, False, None, 0.05),
    (torch.float32, 70, 131, 90, True, 16 * 131 * 4, 0.5),
    (torch.float16, 19, 83, 72, False, 5 * 83 * 2, 0.02),
    (torch.float16, 66, 66, 40, True, None, 1.0),
    (torch.float32, 1, 1, 24, False, None, 0.1),
])
def test_matches_reference(poison_outputs, device, dtype, rows, docs, dim, symmetric, chunk, temperature, path):
    q, d = _embeddings(rows, dim, dtype, device, 1), _embeddings(docs, dim, dtype, device, 2)
    chunk = _fused_chunk(rows, docs, chunk) if path == "fused" else None
    out = compare_fwd_bwd(_fn(temperature, symmetric, chunk), _ref(temperature, symmetric), (q, d), name="info_nce")
    assert out[0].dtype == torch.float32 and out[0].shape == (rows,)


@pytest.mark.parametrize("chunk, path", [(None, "scores"), (41 * 45 * 4, "scores"), (41 * 45 * 4 - 1, "fused")])
def test_path_rule(device, monkeypatch, chunk, path):
    """The fp32 similarity matrix runs through cuBLAS where it fits max_chunk_bytes, else the fused kernel."""
    ran = []
    for name in ("scores", "fused"):
        real = getattr(info_nce_module, f"_{name}_forward")
        monkeypatch.setattr(info_nce_module, f"_{name}_forward",
                            lambda *args, name=name, real=real: ran.append(name) or real(*args))
    info_nce(_embeddings(41, 16, torch.float32, device), _embeddings(45, 16, torch.float32, device, 1),
             max_chunk_bytes=chunk)
    assert ran == [path]


@pytest.mark.parametrize("path", ["scores", "fused"])
def test_matryoshka_prefixes(device, path):
    """Matryoshka training scores each prefix of the embeddings, renormalised: the op takes the slices."""
    q, d = _embeddings(21, 48, torch.float16, device, 3), _embeddings(29, 48, torch.float16, device, 4)
    chunk = _fused_chunk(21, 29, None) if path == "fused" else None

    def loss(fn):
        return lambda q, d: sum(fn(F.normalize(q[:, :k], dim=-1), F.normalize(d[:, :k], dim=-1)) for k in (8, 24, 48))

    compare_fwd_bwd(loss(_fn(0.05, False, chunk)), loss(_ref(0.05, False)), (q, d), name="matryoshka")


def test_fused_forward_splits_the_documents(device, monkeypatch):
    """A batch of few row blocks has its documents split among programs (a grid of several
    columns); the splits' log-sum-exps merge to the reference's, a NaN document's in any split."""
    kernel, grids = info_nce_module._info_nce_fwd_kernel, []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(info_nce_module, "_info_nce_fwd_kernel", Spy())
    q, d = _embeddings(70, 24, torch.float32, device, 13), _embeddings(200, 24, torch.float32, device, 14)
    chunk = _fused_chunk(70, 200, None)
    assert_close(info_nce(q, d, max_chunk_bytes=chunk), info_nce_reference(q, d), torch.float32, "split")
    assert grids and grids[-1][1] > 1, grids
    d = d.detach().clone()
    d[170, 3] = float("nan")  # a document of the last split
    assert info_nce(q.detach(), d, max_chunk_bytes=chunk).isnan().all()


def test_is_sentence_transformers_loss(device):
    """MultipleNegativesRankingLoss's formula: cross-entropy of cos-sim * scale rows (anchor against
    positives then hard negatives) against the anchor's own positive, averaged."""
    anchors, positives, negatives = (torch.randn(12, 24, device=device) for _ in range(3))
    scale = 20.0
    candidates = torch.cat([positives, negatives])
    scores = F.cosine_similarity(anchors[:, None, :], candidates[None, :, :], dim=-1) * scale
    want = F.cross_entropy(scores, torch.arange(12, device=device))
    got = info_nce(F.normalize(anchors, dim=-1), F.normalize(candidates, dim=-1), temperature=1 / scale).mean()
    assert_close(got, want, torch.float32, "mean loss")
    # The symmetric variant also scores each positive against the anchors.
    backward = F.cross_entropy(scores[:, :12].T, torch.arange(12, device=device))
    got = info_nce(F.normalize(anchors, dim=-1), F.normalize(candidates, dim=-1), temperature=1 / scale, symmetric=True)
    assert_close(got.mean(), (want + backward) / 2, torch.float32, "symmetric")


def test_against_installed_sentence_transformers(device):
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    try:  # its home from sentence-transformers 6 on
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses
    anchors, positives, negatives = (torch.randn(8, 16, device=device) for _ in range(3))
    loss = losses.MultipleNegativesRankingLoss(model=None, scale=20.0)  # the model only encodes texts
    want = loss.compute_loss_from_embeddings([anchors, positives, negatives], None)
    got = info_nce(F.normalize(anchors, dim=-1), F.normalize(torch.cat([positives, negatives]), dim=-1),
                   temperature=0.05).mean()
    assert_close(got, want.float(), torch.float32, "st")


@pytest.mark.parametrize("chunk", [None, 20 * 25 * 4 - 1])
def test_nan_reaches_only_the_losses_it_enters(device, chunk):
    q, d = _embeddings(20, 32, torch.float32, device, 3), _embeddings(25, 32, torch.float32, device, 4)
    q, d = q.detach().clone(), d.detach().clone()
    q[3, 5] = float("nan")
    loss = info_nce(q, d, max_chunk_bytes=chunk)
    assert loss[3].isnan() and not loss[[0, 1, 2, 4, 19]].isnan().any()
    # A NaN document is a candidate of every query: every loss is NaN, as the reference's.
    q[3, 5] = 0.0
    d[22, 0] = float("nan")
    assert info_nce(q, d, max_chunk_bytes=chunk).isnan().all() and info_nce_reference(q, d).isnan().all()
    d[22, 0] = float("inf")
    got, want = info_nce(q, d, max_chunk_bytes=chunk), info_nce_reference(q, d)
    assert (~torch.isfinite(got) == ~torch.isfinite(want)).all()


@pytest.mark.parametrize("chunk", [None, 20 * 20 * 4 - 1])
def test_nan_gradient(device, chunk):
    q, d = _embeddings(20, 32, torch.float32, device, 5), _embeddings(20, 32, torch.float32, device, 6)
    with torch.no_grad():
        q[7, 1] = float("nan")
    info_nce(q, d, max_chunk_bytes=chunk).mean().backward()
    assert q.grad.isnan().any() and d.grad.isnan().all()


def test_gradients_of_one_input(device):
    q, d = _embeddings(17, 24, torch.float32, device, 7), _embeddings(30, 24, torch.float32, device, 8)
    q.requires_grad_(False)
    info_nce(q, d).sum().backward()
    want_d = d.detach().clone().requires_grad_()
    info_nce_reference(q, want_d).sum().backward()
    assert_close(d.grad, want_d.grad, torch.float32, "grad d")


def test_kernel_runs_not_the_reference(device, monkeypatch):
    monkeypatch.setattr(info_nce_module, "info_nce_reference", None)
    monkeypatch.setattr(info_nce_module.INFO_NCE, "reference", None)
    q, d = _embeddings(9, 16, torch.float32, device), _embeddings(9, 16, torch.float32, device, 1)
    info_nce(q, d).sum().backward()
    assert d.grad is not None


@pytest.mark.parametrize("kwargs, message", [
    (dict(q=torch.zeros(4, 8), d=torch.zeros(3, 8)), "at least one document per query"),
    (dict(q=torch.zeros(4, 8), d=torch.zeros(4, 9)), "same dim"),
    (dict(q=torch.zeros(4, 8), d=torch.zeros(4, 8, dtype=torch.float16)), "dtype"),
    (dict(q=torch.zeros(4, 8), d=torch.zeros(4, 8), temperature=0.0), "temperature"),
    (dict(q=torch.zeros(4), d=torch.zeros(4, 8)), "2-D"),
    (dict(q=torch.zeros(4, 8), d=torch.zeros(4, 8), max_chunk_bytes=0), "max_chunk_bytes"),
])
def test_bad_arguments(kwargs, message):
    q, d = kwargs.pop("q"), kwargs.pop("d")
    with pytest.raises(ValueError, match=message):
        info_nce(q, d, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 64 * 517 * 2])
@pytest.mark.parametrize("symmetric", [False, True])
def test_bf16_matches_reference(device, symmetric, chunk):
    q, d = _embeddings(300, 1000, torch.bfloat16, device, 9), _embeddings(517, 1000, torch.bfloat16, device, 10)
    compare_fwd_bwd(_fn(0.02, symmetric, chunk), _ref(0.02, symmetric), (q, d), name="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 1024 * 1024 * 4 - 1])
def test_bf16_embedder_shape(device, chunk):
    """An LLM embedder's width and a batch of 1024 (with 64 hard negatives) on both paths."""
    q, d = _embeddings(1024, 2048, torch.bfloat16, device, 11), _embeddings(1088, 2048, torch.bfloat16, device, 12)
    compare_fwd_bwd(_fn(0.05, False, chunk), _ref(0.05, False), (q, d), name="bf16 2048")
