"""add_low_rank_ (out += alpha · a bᵀ in place): the kernel against addmm on odd shapes, ranks
narrower than the dot's tile and wider, sliced and transposed operands, non-finite values; the
cases it hands to addmm; on a GPU, bf16 at the LoRA shapes."""

import pytest
import torch

from tigon.ops import low_rank
from tigon.ops.low_rank import add_low_rank_, add_low_rank_reference
from tests.helpers import assert_close


def _operands(device, dtype, rows, cols, rank, a_wide=0, b_transposed=False):
    out = torch.randn(rows, cols, device=device, dtype=dtype)
    a = torch.randn(rows, rank + a_wide, device=device, dtype=dtype)[:, :rank]  # a column slice, as a group passes it
    b = torch.randn(rank, cols, device=device, dtype=dtype).t() if b_transposed else \
        torch.randn(cols, rank, device=device, dtype=dtype)
    return out, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,cols,rank", [(37, 70, 5), (65, 129, 16), (3, 300, 33), (130, 17, 1)])
@pytest.mark.parametrize("layout", ["plain", "sliced", "transposed"])
def test_matches_addmm(device, dtype, rows, cols, rank, layout):
    out, a, b = _operands(device, dtype, rows, cols, rank, a_wide=7 if layout == "sliced" else 0,
                          b_transposed=layout == "transposed")
    want = add_low_rank_reference(out.clone(), a, b, 0.75)
    got = out.clone()
    returned = add_low_rank_(got, a, b, 0.75)
    assert returned is got  # in place
    # One rounding of the fp32 sum either way; the product's terms may be added in another order.
    assert_close(got, want, tol=1e-5 if dtype == torch.float32 else 2e-3, name="out")
    assert not torch.equal(got, out)  # it did add


def test_every_element_is_written(device):
    """Each element of out is read and written by exactly one program: a sentinel row and column
    past a tile's edge get their sum, and the zero product leaves out unchanged."""
    out = torch.randn(67, 131, device=device)
    zero_a = torch.zeros(67, 16, device=device)
    b = torch.randn(131, 16, device=device)
    assert torch.equal(add_low_rank_(out.clone(), zero_a, b, 1.0), out)
    ones = torch.ones(67, 1, device=device)
    got = add_low_rank_(torch.zeros(67, 131, device=device), ones, torch.arange(131., device=device)[:, None], 1.0)
    assert torch.equal(got, torch.arange(131., device=device).expand(67, 131))


def test_nonfinite_propagates(device):
    out, a, b = _operands(device, torch.float32, 20, 40, 8)
    out[3, 4] = float("nan")
    a[5, 2] = float("inf")
    b[7, 1] = float("nan")
    got = add_low_rank_(out.clone(), a, b, 1.0)
    want = add_low_rank_reference(out.clone(), a, b, 1.0)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[3, 4].isnan() and got[5].isinf().any() and got[:, 7].isnan().all()


def test_wide_rank_and_column_major_a_run_addmm(device, monkeypatch):
    calls = []
    monkeypatch.setattr(low_rank.ADD_LOW_RANK, "kernel", lambda *args: calls.append(args))
    out, a, b = _operands(device, torch.float32, 9, 12, low_rank.MAX_RANK + 1)
    assert_close(add_low_rank_(out.clone(), a, b, 2.0), out.clone().addmm_(a, b.t(), alpha=2.0), tol=1e-5)
    out, _, b = _operands(device, torch.float32, 9, 12, 4)
    a = torch.randn(4, 9, device=device).t()
    assert_close(add_low_rank_(out.clone(), a, b, 1.0), out.clone().addmm_(a, b.t()), tol=1e-5)
    assert calls == []


def test_shape_mismatch_is_one_line(device):
    out, a, b = _operands(device, torch.float32, 9, 12, 4)
    with pytest.raises(ValueError, match=r"add_low_rank_ takes out \(N, M\), a \(N, r\) and b \(M, r\), got out "
                                         r"\(9, 12\), a \(9, 4\) and b \(4, 12\)"):
        add_low_rank_(out, a, b.t())


@pytest.mark.gpu
@pytest.mark.parametrize("cols,rank", [(14336, 16), (4096, 64), (1024, 8)])
def test_bf16_lora_shapes_on_gpu(cols, rank):
    out, a, b = _operands(torch.device("cuda"), torch.bfloat16, 4096 + 3, cols, rank, a_wide=rank)
    b = b * 0.05
    got = add_low_rank_(out.clone(), a, b, 2.0)
    # The exact sum rounded once to bf16: within half a unit in its last place (at most 2**-8 of
    # its magnitude), plus what fp32 accumulation of the product's terms may add.
    exact = out.double() + 2.0 * (a.double() @ b.double().t())
    terms = out.double().abs() + 2.0 * (a.double().abs() @ b.double().abs().t())
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + terms * 2 ** -20).all()
