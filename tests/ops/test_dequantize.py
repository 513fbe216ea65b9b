"""The dequantisation kernels against bitsandbytes' own dequantisation: the same bits.

bfloat16 outputs are checked in the interpreter too: the kernel rounds them by hand (the
interpreter's cast would truncate), and bit-equality with bitsandbytes is the property that
matters most in the dtype QLoRA trains in."""

import pytest
import torch

from tigon import ops
from tigon.ops.dequantize import QuantizedWeight, dequantize, dequantize_reference, dequantized, release_workspaces
from tigon.patch.quantized import from_4bit, from_int8

bnb_functional = pytest.importorskip("bitsandbytes.functional")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _nan(shape, dtype, device):
    """An output buffer poisoned with NaN, so that an element the kernel does not write shows.
    (The poison_outputs fixture would poison bitsandbytes' own integer buffers as well.)"""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _quantize_4bit(shape, quant_type, double, dtype, device, blocksize=64):
    weight = (torch.randn(*shape, device=device) * 2).to(dtype)
    data, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=double
    )
    return data, state


def _bnb_dequantize_4bit(data, state):
    """bitsandbytes' own 4-bit dequantisation. On the CPU, the pure-PyTorch implementation of its
    default back end (the one its CPU op itself falls back to for odd widths): its compiled CPU
    kernel (bitsandbytes 0.50 on CPUs with AVX-512) gets rows that end inside a block wrong, e.g.
    (23, 192) with blocks of 128 does not come back from its own quantize_4bit (twice the error of
    the pure-PyTorch path's, which is the CUDA kernel's result)."""
    if data.device.type != "cpu":
        return bnb_functional.dequantize_4bit(data, state)
    compute = getattr(pytest.importorskip("bitsandbytes.backends.default.ops"), "_dequantize_4bit_compute", None)
    if compute is None:
        pytest.skip("this bitsandbytes has no pure-PyTorch 4-bit dequantisation to compare with on the CPU")
    absmax = state.absmax
    if state.nested:
        absmax = (bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    with torch.compiler.set_stance("force_eager"):  # bitsandbytes would compile it: seconds
        return compute(data.view(torch.uint8).reshape(-1), absmax, state.code, state.blocksize, state.shape, state.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_bit_for_bit(device, quant_type, double, dtype):
    for shape, blocksize in (((37, 70), 64), ((23, 192), 128)):
        data, state = _quantize_4bit(shape, quant_type, double, dtype, device, blocksize)
        want = _bnb_dequantize_4bit(data, state)
        weight = from_4bit(data, state)
        assert weight.nested == double
        got = dequantize(weight, dtype, out=_nan(shape, dtype, device))
        assert got.dtype == dtype and got.shape == shape
        assert torch.equal(got, want), f"{shape}: max diff {(got.float() - want.float()).abs().max()}"
        assert torch.equal(dequantize_reference(weight, dtype), want)


def test_4bit_odd_width_and_other_output_dtype(device):
    """An odd number of weights leaves the last byte half used; bitsandbytes' compute path (the
    one its 4-bit GEMM uses) dequantises straight to the input's dtype."""
    data, state = _quantize_4bit((5, 7), "nf4", True, torch.bfloat16, device)
    weight = from_4bit(data, state)
    with torch.compiler.set_stance("force_eager"):  # bitsandbytes compiles its odd-width path: seconds
        want = bnb_functional.dequantize_4bit(data, state)
    assert torch.equal(dequantize(weight, torch.bfloat16, out=_nan((5, 7), torch.bfloat16, device)), want)
    # Another output dtype: the fp32 product rounded once to it.
    as_fp16 = dequantize(weight, torch.float16)
    assert torch.equal(as_fp16, dequantize(weight, torch.float32).half())


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_bit_for_bit(device, dtype):
    for shape in ((37, 70), (5, 9)):
        data, row_absmax, _ = bnb_functional.int8_vectorwise_quant(torch.randn(*shape, device=device).half())
        want = bnb_functional.int8_vectorwise_dequant(data, row_absmax).to(dtype)
        weight = from_int8(data, row_absmax)
        assert torch.equal(dequantize(weight, dtype, out=_nan(shape, dtype, device)), want)
        assert torch.equal(dequantize_reference(weight, dtype), want)


def test_nan_absmax_gives_nan(device):
    data, state = _quantize_4bit((4, 64), "nf4", False, torch.float32, device)
    state.absmax[1] = float("nan")
    got = dequantize(from_4bit(data, state), torch.bfloat16)
    assert got.view(-1)[64:128].isnan().all() and not got.view(-1)[:64].isnan().any()


def test_reference_when_disabled(monkeypatch, device):
    data, state = _quantize_4bit((9, 70), "fp4", True, torch.float16, device)
    weight = from_4bit(data, state)
    monkeypatch.setenv("TIGON_DISABLE", "dequantize")
    assert ops.placement("dequantize", torch.device(device))[0] == "reference"
    assert torch.equal(dequantize(weight, torch.float16), bnb_functional.dequantize_4bit(data, state))


def test_out_argument_and_workspace(device):
    """`dequantized` writes into one buffer per device and dtype, grown as needed."""
    release_workspaces()
    small = from_4bit(*_quantize_4bit((6, 64), "nf4", False, torch.float32, device))
    large = from_4bit(*_quantize_4bit((20, 64), "nf4", False, torch.float32, device))
    first = dequantized(large, torch.float32)
    assert torch.equal(first, dequantize(large, torch.float32))
    second = dequantized(small, torch.float32)
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert torch.equal(second, dequantize(small, torch.float32))
    plain = torch.randn(3, 4, device=device)
    assert dequantized(plain, torch.float32) is plain
    out = torch.empty(6, 64, device=device)
    assert dequantize(small, torch.float32, out=out) is out
    release_workspaces()


def test_bad_arguments(device):
    data, state = _quantize_4bit((6, 64), "nf4", False, torch.float32, device)
    weight = from_4bit(data, state)
    cases = [
        (lambda: dequantize(data, torch.float32), "must be a tigon.ops.QuantizedWeight"),
        (lambda: dequantize(weight, torch.int8), "dtype must be one of"),
        (lambda: dequantize(weight, torch.float32, out=torch.empty(6, 63)), r"out must be a contiguous \(6, 64\)"),
        (lambda: dequantize(weight._replace(shape=(7, 64)), torch.float32), "data must hold 224 bytes"),
        (lambda: dequantize(weight._replace(absmax=weight.absmax[:-1]), torch.float32), "absmax must hold 6 values"),
        (lambda: dequantize(weight._replace(code=weight.code[:8]), torch.float32), "code must be the 16 float32"),
        (lambda: dequantize(weight._replace(blocksize=48), torch.float32), "blocksize must be a power of two"),
        (lambda: dequantize(QuantizedWeight(torch.zeros(3, 4, dtype=torch.int8), torch.ones(2), (3, 4)), torch.float32),
         "one float32 scale per row"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
