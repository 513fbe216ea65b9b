"""The fused 4-bit GEMM against bitsandbytes' own dequantisation and a float32 matmul.

The kernel dequantises to the bits bitsandbytes' ``dequantize_4bit`` gives and accumulates in fp32,
so it differs from ``x.float() @ W.float()ᵀ`` only by the order of the fp32 sums and the one
rounding of the output."""

import logging

import pytest
import torch

from tigon.ops import gemm_4bit
from tigon.ops.composite import lora
from tigon.ops.composite.lora import LoraProjection, lora_linear_group, lora_linear_reference
from tigon.ops.gemm_4bit import base_gemm, fused_4bit, linear_4bit, linear_4bit_reference
from tigon.patch.quantized import from_4bit, from_int8
from tests.helpers import assert_close
from tests.ops.test_dequantize import _bnb_dequantize_4bit, _quantize_4bit, bnb_functional

# Tiles the interpreter runs: the default (a tile inside one quantisation block), swapped operands
# with a tile spanning two blocks of 64, and a tile as wide as a block of 64; the weight's halves
# interleaved or each multiplied by its own dot.
TILES = [
    None,
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SWAP=True, SPLIT=False),
    dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, SWAP=False, SPLIT=False),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SWAP=False, SPLIT=True),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SWAP=True, SPLIT=True),
    dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, SWAP=True, SPLIT=True),
]


def _always_fused(monkeypatch):
    monkeypatch.setattr(gemm_4bit, "DEFAULT_FUSED_TOKENS_UP_TO", (1 << 30, 1 << 30))


def _weight(shape, quant_type, double, blocksize, device):
    data, state = _quantize_4bit(shape, quant_type, double, torch.float32, device, blocksize)
    return from_4bit(data, state), data, state


def _spy_dequantized(monkeypatch):
    """A list that records every dequantisation of a base weight for a GEMM."""
    calls = []
    real = gemm_4bit.dequantized

    def spy(weight, dtype):
        if not isinstance(weight, torch.Tensor):
            calls.append(tuple(weight.shape))
        return real(weight, dtype)

    for module in (gemm_4bit, lora):
        monkeypatch.setattr(module, "dequantized", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_matches_bitsandbytes_dequantize_and_matmul(poison_outputs, device, monkeypatch, quant_type, double,
                                                    blocksize, dtype):
    _always_fused(monkeypatch)
    calls = _spy_dequantized(monkeypatch)
    weight, data, state = _weight((37, 3 * blocksize), quant_type, double, blocksize, device)
    want_w = _bnb_dequantize_4bit(data, state).to(dtype).float()  # what cuBLAS would read
    x = torch.randn(2, 11, 3 * blocksize, dtype=dtype, device=device, requires_grad=True)
    out = linear_4bit(x, weight)
    assert out.dtype == dtype and out.shape == (2, 11, 37)
    assert_close(out, (x.detach().float() @ want_w.t()).to(dtype), name="forward")
    dy = torch.randn_like(out)
    out.backward(dy)
    assert_close(x.grad, (dy.float() @ want_w).to(dtype), name="input gradient")
    assert calls == [], "the fused path dequantised the weight"


def _identity_products(weight, dtype, device):
    """``I · Wᵀ`` and ``I · W`` by the fused GEMM: W's own values, each product with one 1 and
    zeros, so any difference from bitsandbytes' dequantised weight is a dequantisation error."""
    out_features, in_features = weight.shape
    forward = linear_4bit(torch.eye(in_features, dtype=dtype, device=device), weight)
    backward = base_gemm(torch.eye(out_features, dtype=dtype, device=device), weight, backward=True)
    return forward.t(), backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("quant_type,double,blocksize", [("nf4", True, 64), ("fp4", False, 128)])
def test_dequantises_bit_for_bit(poison_outputs, device, monkeypatch, quant_type, double, blocksize, dtype):
    _always_fused(monkeypatch)
    weight, data, state = _weight((40, 2 * blocksize), quant_type, double, blocksize, device)
    want = _bnb_dequantize_4bit(data, state).to(dtype)
    for got in _identity_products(weight, dtype, device):
        assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiles_and_added_term(poison_outputs, device, monkeypatch, tile, dtype):
    """``c + a Wᵀ`` and ``c + a W`` (what the LoRA ops ask for) on every tiling, odd shapes; c is
    left as it is."""
    _always_fused(monkeypatch)
    if tile is not None:
        monkeypatch.setattr(gemm_4bit, "INTERPRETER_TILE", tile)
    weight, data, state = _weight((45, 320), "nf4", True, 64, device)
    want_w = _bnb_dequantize_4bit(data, state).to(dtype).float()
    for backward, rows, cols in ((False, 19, 45), (True, 19, 320)):
        a = torch.randn(rows, 320 if not backward else 45, dtype=dtype, device=device)
        before = torch.randn(rows, cols, dtype=dtype, device=device)
        kept = before.clone()
        out = base_gemm(a, weight, backward=backward, add=before)
        want = before.float() + a.float() @ (want_w if backward else want_w.t())
        assert_close(out, want.to(dtype), name=f"backward={backward}")
        assert torch.equal(before, kept)


@pytest.mark.parametrize("parts", [1, 3])
def test_reduction_split_in_parts(poison_outputs, device, monkeypatch, parts):
    """The reduced dimension in one part or in three uneven ones (their fp32 sums and the added
    term added up on the host, rounded once), forward and input gradient; a NaN in one part's
    range reaches the output."""
    _always_fused(monkeypatch)
    monkeypatch.setattr(gemm_4bit, "_parts", lambda programs, steps, device: min(parts, steps))
    weight, data, state = _weight((160, 448), "nf4", True, 64, device)
    want_w = _bnb_dequantize_4bit(data, state).to(torch.float16).float()
    for backward, depth, width in ((False, 448, 160), (True, 160, 448)):
        a = torch.randn(13, depth, dtype=torch.float16, device=device)
        a[4, depth - 1] = float("nan")
        add = torch.randn(13, width, dtype=torch.float16, device=device)
        out = base_gemm(a, weight, backward=backward, add=add)
        want = add.float() + a.float() @ (want_w if backward else want_w.t())
        assert out[4].isnan().all() and not out[torch.arange(13) != 4].isnan().any()
        assert_close(out[torch.arange(13) != 4], want.to(torch.float16)[torch.arange(13) != 4],
                     name=f"backward={backward}")


def test_debug_mode_checks_without_adding_twice(device, monkeypatch):
    """TIGON_DEBUG runs the reference on the op's own arguments after the kernel: the added term
    is read, never written, so neither the result nor the check is off."""
    _always_fused(monkeypatch)
    monkeypatch.setenv("TIGON_DEBUG", "1")
    weight, _, _ = _weight((24, 128), "fp4", True, 64, device)
    a, add = torch.randn(7, 128, device=device), torch.randn(7, 24, device=device)
    want = add + linear_4bit_reference(a, weight)
    assert_close(base_gemm(a, weight, add=add.clone()), want)


def test_nan_in_activations_propagates(device, monkeypatch):
    _always_fused(monkeypatch)
    weight, _, _ = _weight((40, 128), "nf4", False, 64, device)
    x = torch.randn(17, 128, device=device, requires_grad=True)
    with torch.no_grad():
        x[3, 100] = float("nan")
    out = linear_4bit(x, weight)
    assert out[3].isnan().all() and not out[torch.arange(17) != 3].isnan().any()
    dy = torch.randn_like(out)
    dy[5, 7] = float("nan")
    out.backward(dy)
    assert x.grad[5].isnan().all() and not x.grad[torch.arange(17) != 5].isnan().any()


def test_rule_sends_many_tokens_to_dequantize_and_cublas(device, monkeypatch):
    """Above the table's token count the weight is dequantised for cuBLAS; both paths agree."""
    calls = _spy_dequantized(monkeypatch)
    monkeypatch.setattr(gemm_4bit, "FUSED_TOKENS_UP_TO", {(24, 64): (8, 16)})
    assert fused_4bit(8, 24, 64) and not fused_4bit(9, 24, 64) and fused_4bit(16, 24, 64, backward=True)
    assert not fused_4bit(1, 4096, 4096) and not fused_4bit(256, 4096, 4096, backward=True)  # the default: cuBLAS
    weight, _, _ = _weight((24, 64), "fp4", False, 64, device)
    x = torch.randn(12, 64, device=device, requires_grad=True)
    out = linear_4bit(x, weight)
    out.backward(torch.ones_like(out))
    assert calls == [(24, 64)]  # forward dequantised (12 > 8 tokens), input gradient fused (12 <= 16)
    assert_close(out, linear_4bit_reference(x.detach(), weight))


def test_unaligned_rows_and_disabled_run_dequantize(device, monkeypatch):
    """Rows that are not whole blocks (in = 70) and TIGON_DISABLE=gemm_4bit take the dequantising path."""
    calls = _spy_dequantized(monkeypatch)
    weight, data, state = _weight((9, 70), "nf4", True, 64, device)
    x = torch.randn(5, 70, device=device)
    assert_close(linear_4bit(x, weight), linear_4bit_reference(x, weight))
    assert calls == [(9, 70)]
    aligned, _, _ = _weight((9, 64), "nf4", True, 64, device)
    monkeypatch.setenv("TIGON_DISABLE", "gemm_4bit")  # what the LoRA ops call runs dequantise + cuBLAS
    out = base_gemm(x[:, :64], aligned)
    assert_close(out, linear_4bit_reference(x[:, :64], aligned))
    assert calls == [(9, 70), (9, 64)]


def test_qlora_group_runs_the_fused_gemm(poison_outputs, device, monkeypatch):
    """Where the table sends a shape to it, the LoRA ops' base GEMMs on a 4-bit base (forward and
    input gradient) are the fused ones: the weight is never dequantised; results match the
    reference LoRA on bitsandbytes' weight."""
    _always_fused(monkeypatch)
    calls = _spy_dequantized(monkeypatch)
    x = torch.randn(2, 5, 128, device=device, requires_grad=True)
    projections = []
    for out_features, quant_type in ((48, "nf4"), (16, "fp4")):
        weight, _, _ = _weight((out_features, 128), quant_type, True, 64, device)
        lora_a = (torch.randn(4, 128, device=device) * 0.1).requires_grad_()
        lora_b = (torch.randn(out_features, 4, device=device) * 0.1).requires_grad_()
        projections.append(LoraProjection(weight, lora_a, lora_b, 2.0))
    outs = lora_linear_group(x, projections)
    sum(o.square().sum() for o in outs).backward()
    assert calls == []
    x_ref = x.detach().clone().requires_grad_()
    refs = [lora_linear_reference(x_ref, p.weight, p.lora_a.detach(), p.lora_b.detach(), p.scaling)
            for p in projections]
    sum(r.square().sum() for r in refs).backward()
    for got, want in zip(outs, refs):
        assert_close(got, want, name="output")
    assert_close(x.grad, x_ref.grad, name="input gradient")


def test_bad_arguments(device):
    weight, _, _ = _weight((6, 64), "nf4", False, 64, device)
    int8 = from_int8(*bnb_functional.int8_vectorwise_quant(torch.randn(6, 64, device=device).half())[:2])
    for call, message in (
        (lambda: linear_4bit(torch.randn(3, 63, device=device), weight), r"weight must have shape \(out, 63\)"),
        (lambda: linear_4bit(torch.randn(3, 64, device=device), int8), "4-bit"),
        (lambda: linear_4bit(torch.randn(3, 64, device=device), weight._replace(code=weight.code[:8])), "code must be"),
    ):
        with pytest.raises(ValueError, match=message):
            call()


# --- The code lookup's PTX, run by a model of the four instructions it uses -----------------------


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``s & 7`` of {b, a} for the
    4-bit selector s at bits 4i of `selector`, or that byte's sign bit spread over 8 when s & 8."""
    source = (a | b << 32).to_bytes(8, "little")
    result = 0
    for i in range(4):
        s = selector >> (4 * i) & 15
        byte = source[s & 7]
        result |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << (8 * i)
    return result


def _run_ptx(ptx: str, packed: int) -> list[int]:
    """The words ``$0..$7`` after `ptx` runs on ``$8 = packed``."""
    ops = {"shr.b32": lambda a, b: a >> b, "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
           "prmt.b32": _prmt}
    registers = {"$8": packed}
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        out, *sources = (o.strip() for o in operands.split(","))
        registers[out] = ops[op](*(registers[o] if o in registers else int(o, 0) for o in sources)) & 0xFFFFFFFF
    return [registers[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_code_lookup_ptx_gives_every_codes_exact_bits(quant_type):
    """For bitsandbytes' own NF4 and FP4 codes and every byte in each of the 4 lanes, the lookup
    returns the high nibble's value then the low one's, bit for bit."""
    code = bnb_functional.get_4bit_type(quant_type, device="cpu").float()
    bits = code.view(torch.int32).tolist()
    ptx = gemm_4bit.code_lookup_ptx(code.tolist())
    generator = torch.Generator().manual_seed(0)
    for lanes in [[b, 255 - b, (b * 7) % 256, (b * 13 + 5) % 256] for b in range(256)]:
        lanes = [lanes[i] for i in torch.randperm(4, generator=generator).tolist()]
        words = _run_ptx(ptx, int.from_bytes(bytes(lanes), "little"))
        want = [bits[b >> 4] & 0xFFFFFFFF for b in lanes] + [bits[b & 15] & 0xFFFFFFFF for b in lanes]
        assert words == want, lanes
    with pytest.raises(ValueError, match="16 code values"):
        gemm_4bit.code_lookup_ptx(code.tolist()[:8])


def test_code_lookup_is_built_once_per_code_tensor_and_never_on_rocm(monkeypatch):
    """The PTX is read from the code tensor once and kept while it lives unchanged; an in-place
    change rebuilds it; on ROCm (no PTX) the kernel gathers from memory instead."""
    code = bnb_functional.get_4bit_type("nf4", device="cpu").float()
    reads = []
    real = gemm_4bit.code_lookup_ptx
    monkeypatch.setattr(gemm_4bit, "code_lookup_ptx", lambda values: reads.append(values) or real(values))
    first = gemm_4bit._code_lookup(code)
    assert gemm_4bit._code_lookup(code) == first and len(reads) == 1
    code[0] = -0.5
    assert gemm_4bit._code_lookup(code) != first and len(reads) == 2
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert gemm_4bit._code_lookup(code.clone()) == ""


# --- On the GPU: bf16 at Llama-3-8B's projection shapes -------------------------------------------

SHAPES_8B = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]  # (out, in): q/o, gate/up, down, k/v


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 512, 2048])
@pytest.mark.parametrize("shape", SHAPES_8B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_llama_8b_shapes_on_gpu(monkeypatch, shape, tokens):
    """bf16, NF4 with double quantisation: the fused GEMM is as accurate as bitsandbytes'
    dequantise + cuBLAS bf16 matmul, both against the same product in fp32."""
    _always_fused(monkeypatch)
    torch.manual_seed(0)
    weight, data, state = _weight(shape, "nf4", True, 64, "cuda")
    dense = bnb_functional.dequantize_4bit(data, state).to(torch.bfloat16)  # the bits cuBLAS reads
    x = torch.randn(tokens, shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = linear_4bit(x, weight)
    dy = torch.randn_like(out)
    out.backward(dy)
    for name, got, cublas, exact in (
        ("forward", out, x.detach() @ dense.t(), x.detach().float() @ dense.float().t()),
        ("input gradient", x.grad, dy @ dense, dy.float() @ dense.float()),
    ):
        error = ((got.float() - exact).norm() / exact.norm()).item()
        cublas_error = ((cublas.float() - exact).norm() / exact.norm()).item()
        assert error <= 1.25 * cublas_error + 1e-6, f"{name}: {error:.3e} vs cuBLAS {cublas_error:.3e}"


@pytest.mark.gpu
def test_bf16_dequantises_bit_for_bit_on_gpu(monkeypatch):
    """In bf16 on the GPU, the tiles dequantised in registers are bitsandbytes' own bf16 weight."""
    _always_fused(monkeypatch)
    weight, data, state = _weight((1024, 4096), "nf4", True, 64, "cuda")
    want = bnb_functional.dequantize_4bit(data, state).to(torch.bfloat16)
    for got in _identity_products(weight, torch.bfloat16, "cuda"):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("lookup", ["registers", "memory"])
@pytest.mark.parametrize("config", [c for c in gemm_4bit.CONFIGS if c.kwargs["BLOCK_M"] in (16, 128, 256)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.all_kwargs().items()))
def test_every_tuned_tile_dequantises_bit_for_bit_on_gpu(monkeypatch, config, lookup):
    """Each tile the autotuner may pick (of the swapped ones, the narrowest and widest token sides),
    launched as it is (not only the one the tuning chose), with the codes' values from the
    register lookup and from memory: in bf16 its products with the identity are bitsandbytes'
    own bf16 weight, forward and input gradient, with an added term read once."""
    _always_fused(monkeypatch)
    monkeypatch.setattr(gemm_4bit, "_TUNED", None)
    monkeypatch.setattr(gemm_4bit, "INTERPRETER_TILE", config.all_kwargs())
    if lookup == "memory":
        monkeypatch.setattr(gemm_4bit, "_code_lookup", lambda code: "")
    weight, data, state = _weight((192, 512), "nf4" if config.kwargs["SPLIT"] else "fp4", True, 64, "cuda")
    want = bnb_functional.dequantize_4bit(data, state).to(torch.bfloat16)
    for got in _identity_products(weight, torch.bfloat16, "cuda"):
        assert torch.equal(got, want)
    a = torch.randn(19, 512, device="cuda", dtype=torch.bfloat16)
    added = torch.randn(19, 192, device="cuda", dtype=torch.bfloat16)
    out = base_gemm(a, weight, add=added)
    exact = added.float() + a.float() @ want.float().t()
    assert ((out.float() - exact).norm() / exact.norm()).item() < 4e-3


@pytest.mark.gpu
def test_first_use_under_cuda_graph_capture_gathers_from_memory(monkeypatch):
    """A weight whose codes were never read, first multiplied under CUDA graph capture (where a
    read would sync), gathers the values from memory instead; the replay is still exact, and the
    capture leaves the codes unread."""
    _always_fused(monkeypatch)
    monkeypatch.setattr(gemm_4bit, "_TUNED", None)
    monkeypatch.setattr(gemm_4bit, "INTERPRETER_TILE", gemm_4bit.CONFIGS[0].all_kwargs())
    weight, data, state = _weight((192, 512), "nf4", True, 64, "cuda")
    want = bnb_functional.dequantize_4bit(data, state).to(torch.bfloat16)
    a = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    with monkeypatch.context() as patch:  # compile the gathering kernel before the capture
        patch.setattr(gemm_4bit, "_code_lookup", lambda code: "")
        base_gemm(a, weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = base_gemm(a, weight)
    assert id(weight.code) not in gemm_4bit._LOOKUPS
    out.fill_(float("nan"))
    graph.replay()
    exact = a.float() @ want.float().t()
    assert ((out.float() - exact).norm() / exact.norm()).item() < 4e-3


@pytest.mark.gpu
def test_later_calls_launch_the_tuned_tile_directly(monkeypatch, caplog):
    """A key's first call goes through the autotuner (said once, in one line); later ones launch
    the tile it chose without it, with the same result, and a new token bucket is tuned again."""
    _always_fused(monkeypatch)
    monkeypatch.setattr(gemm_4bit, "_CHOSEN", {})
    tuned = gemm_4bit._TUNED
    calls = []

    class CountingAutotuner:
        best_config = property(lambda self: tuned.best_config)

        def __getitem__(self, grid):
            calls.append(grid)
            return tuned[grid]

    monkeypatch.setattr(gemm_4bit, "_TUNED", CountingAutotuner())
    weight, data, state = _weight((384, 512), "nf4", True, 64, "cuda")
    want = bnb_functional.dequantize_4bit(data, state).to(torch.bfloat16)
    a = torch.randn(12, 512, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="tigon"):
        first = base_gemm(a, weight)
        second = base_gemm(a, weight)
    assert len(calls) == 1 and torch.equal(first, second)
    assert sum("times its tiles" in r.getMessage() for r in caplog.records) == 1
    exact = a.float() @ want.float().t()
    assert ((second.float() - exact).norm() / exact.norm()).item() < 4e-3
    base_gemm(torch.randn(40, 512, device="cuda", dtype=torch.bfloat16), weight)
    assert len(calls) == 2
