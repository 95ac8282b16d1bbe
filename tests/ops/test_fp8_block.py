"""Block-FP8 W8A8 linear (DeepSeek ue8m0 format, ``ops/fp8_block``): the ue8m0 scale rule against an
independent fp64 formula, stored codes == cast(w / stored scale), the rounding of the scale applied
before quantizing, per-token activation tiles (a token's result does not move when tokens with 1000x
larger activations join), batch invariance, the fp64 oracle, the STE backward against fp64 autograd,
the load-time checks, and the weight-format table entry (stored codes and masters give the same bits).

Shapes: N = 200 (a partial last 128-row block), K = 256 (two K tiles).
"""

from __future__ import annotations

import math

import pytest
import torch
from invariance import Inv

from unified_models.dsl import SpecError
from unified_models.dsl.weights import LinearFormat, linear_tensors
from unified_models.layers.weight_formats import WEIGHT_FORMATS
from unified_models.ops.fp8_block import (FP8BlockWeight, fp8_block_dequantize, fp8_block_linear,
                                          fp8_block_linear_reference, fp8_block_problems,
                                          fp8_block_quantize_activation, fp8_block_quantize_weight, ue8m0_scale)

N, K = 200, 256


def _w(gen, n=N, k=K, scale=0.05):
    w = torch.randn(n, k, generator=gen) * scale
    w[:, :128] *= 7.3  # blocks of different magnitudes, amax/448 not a power of two
    return w.to(torch.bfloat16)


def test_ue8m0_scale_is_the_smallest_power_of_two_covering_amax():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 1e-9, 3.5e4, 2.0 ** -3 * 448], dtype=torch.float32)
    s = ue8m0_scale(amax)
    want = [2.0 ** math.ceil(math.log2(max(a, 1e-4) / 448.0)) for a in amax.double().tolist()]
    assert s.tolist() == want
    assert s[0] == 1.0 and s[1] == 2.0 and s[3] == s[4]  # amax floor 1e-4
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4096, generator=g) * 1000
    s = ue8m0_scale(a)
    m, _ = torch.frexp(s)
    assert bool((m == 0.5).all())  # powers of two
    assert bool((s * 448 >= a).all()) and bool((s * 448 / 2 < torch.clamp(a, min=1e-4)).all())


def test_stored_codes_equal_cast_of_w_over_the_stored_scale():
    g = torch.Generator().manual_seed(1)
    w = _w(g)
    q, s = fp8_block_quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (N, K)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    full = s.float().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
    want = (w.float() / full).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    # the scale is rounded to a power of two BEFORE quantizing: the unrounded amax/448 scale gives other codes
    amax = w.float()[:128, :128].abs().amax()
    assert float(s.float()[0, 0]) != float(amax / 448)
    raw = (w.float()[:128, :128] / (amax / 448)).to(torch.float8_e4m3fn)
    assert not torch.equal(raw.view(torch.uint8), q[:128, :128].view(torch.uint8))
    # dequantize(quantize(w)) is within half an e4m3 step of w: 2^-4 relative (3 mantissa bits),
    # or half the subnormal step 2^-9 of the block scale
    err = (fp8_block_dequantize(q, s, torch.float32) - w.float()).abs()
    assert bool((err <= torch.maximum(w.float().abs() * 2 ** -4, full * 2 ** -10)).all())


def test_activation_tiles_are_per_token():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, K, generator=g).to(torch.bfloat16)
    q, s = fp8_block_quantize_activation(x)
    big = torch.cat([x[:2], x[2:] * 1000])
    qb, sb = fp8_block_quantize_activation(torch.cat([big, torch.randn(3, K, generator=g).to(torch.bfloat16) * 1e3]))
    assert torch.equal(q[:2].view(torch.uint8), qb[:2].view(torch.uint8)) and torch.equal(s[:2], sb[:2])
    w = _w(g)
    y = fp8_block_linear(x[:2], w)
    y_big = fp8_block_linear(torch.cat([x[:2], torch.randn(9, K, generator=g).to(torch.bfloat16) * 1000]), w)
    Inv.assert_bitwise(y_big[:2], y, "rows next to 1000x larger tokens")


def test_linear_is_batch_invariant_and_close_to_the_fp64_oracle():
    g = torch.Generator().manual_seed(3)
    w = _w(g)
    q, s = fp8_block_quantize_weight(w)
    b = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(37, K, generator=g).to(torch.bfloat16)
    wt = FP8BlockWeight(q, s)
    full = Inv.check_rows(lambda xx: fp8_block_linear(xx, wt, b), (x,), Inv.padding(K, torch.bfloat16, g, 50.0), g,
                          what="fp8_block_linear")
    ref = fp8_block_linear_reference(x, q, s, b)
    out32 = fp8_block_linear(x, wt, b, out_dtype=torch.float32).double()
    # fp32 rounding of 2 block dots and 2 adds: a few fp32 ulps of the row's magnitude
    assert float(((out32 - ref).abs() / ref.abs().amax(1, keepdim=True)).max()) < 2 ** -21
    assert float(((full.double() - ref).abs() / ref.abs().amax(1, keepdim=True)).max()) < 2 ** -8  # bf16 rounding
    # a master weight quantized on the call gives the stored codes' bits
    Inv.assert_bitwise(fp8_block_linear(x, w, b), full, "master vs stored")


def test_ste_backward_matches_fp64_autograd_of_the_dequantized_formula():
    g = torch.Generator().manual_seed(4)
    w = _w(g, n=130).float().requires_grad_(True)
    x = torch.randn(9, K, generator=g, requires_grad=True)
    b = torch.randn(130, generator=g, requires_grad=True)
    y = fp8_block_linear(x, w, b, out_dtype=torch.float32)
    gy = torch.randn_like(y)
    y.backward(gy)
    q, s = fp8_block_quantize_weight(w.detach())
    xq, sx = fp8_block_quantize_activation(x.detach())
    x_dq = (xq.double() * sx.double().repeat_interleave(128, 1)).requires_grad_(True)
    w_dq = fp8_block_dequantize(q, s, torch.float64).requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    (x_dq @ w_dq.t() + b64).backward(gy.double())
    for got, want in ((x.grad, x_dq.grad), (w.grad, w_dq.grad), (b.grad, b64.grad)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_triton_kernel(device, monkeypatch):
    """The kernel source. Under the interpreter (CPU) it gives the CPU path's bits; on a GPU
    (fp8 tensor cores) it is batch-invariant and within fp32 accumulation error of the fp64
    oracle. Partial row and column tiles (T = 70 > BLOCK_M = 64, N = 200 > 128), bias, bf16 and
    fp32 outputs."""
    g = torch.Generator().manual_seed(7)
    q, s = fp8_block_quantize_weight(_w(g))
    x = torch.randn(70, K, generator=g).to(torch.bfloat16)
    b = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16)
    if device == "cpu":
        w = FP8BlockWeight(q, s)
        want = [fp8_block_linear(x, w, b), fp8_block_linear(x, w, None, out_dtype=torch.float32)]
        monkeypatch.setenv("UM_OPS_BACKEND", "triton")
        got = [fp8_block_linear(x, w, b), fp8_block_linear(x, w, None, out_dtype=torch.float32)]
        for a, c in zip(got, want):
            Inv.assert_bitwise(a, c, "triton vs torch")
        return
    w = FP8BlockWeight(q.to(device), s.to(device))
    xd, bd = x.to(device), b.to(device)
    Inv.check_rows(lambda xx: fp8_block_linear(xx, w, bd), (xd,), lambda n: (torch.randn(n, K, generator=g)
                   .mul(30).to(torch.bfloat16).to(device),), g, what="fp8_block_linear cuda")
    ref = fp8_block_linear_reference(x, q, s, b)
    out32 = fp8_block_linear(xd, w, bd, out_dtype=torch.float32).cpu().double()
    # Hopper's fp8 MMA accumulates each 128-long block in ~14 significand bits before the
    # promotion to fp32 (DeepSeek-V3 report, section 3.3.2); measured 4.5e-4 on the H200
    assert float(((out32 - ref).abs() / ref.abs().amax(1, keepdim=True)).max()) < 2 ** -9


def test_problems_and_refusals_name_what_is_wrong():
    g = torch.Generator().manual_seed(5)
    q, s = fp8_block_quantize_weight(_w(g))
    assert fp8_block_problems(q, s, shape=(N, K)) == []
    bad = s.view(torch.uint8).clone()
    bad[1, 0] = 0xFF
    assert "1 NaN scale(s) (first at [1, 0])" in " ".join(fp8_block_problems(q, bad.view(torch.float8_e8m0fnu)))
    assert "expected [2, 2]" in " ".join(fp8_block_problems(q, s[:1]))
    assert "weight_scale_inv is missing" in fp8_block_problems(q, None)
    assert "non-power-of-two" in " ".join(fp8_block_problems(q, s.float() * 1.5))
    with pytest.raises(ValueError, match="K = 200 must be a multiple of 128"):
        fp8_block_quantize_weight(torch.zeros(4, 200))
    with pytest.raises(SpecError, match="needs K = 100 to be a multiple of 128"):
        linear_tensors("l", LinearFormat("fp8_block"), 8, 100, torch.bfloat16)


def test_the_weight_format_entry_round_trips_and_stored_equals_master():
    g = torch.Generator().manual_seed(6)
    w = _w(g)
    fmt = LinearFormat("fp8_block")
    assert {n: v for n, v in linear_tensors("l", fmt, N, K, torch.bfloat16).items()} == {
        "l.weight": ((N, K), torch.float8_e4m3fn), "l.weight_scale_inv": ((2, 2), torch.float8_e8m0fnu)}
    rules = WEIGHT_FORMATS["fp8_block"]
    stored = rules.quantize(w)
    x = torch.randn(6, K, generator=g).to(torch.bfloat16)
    a = rules.linear(x, stored, fmt, None, torch.bfloat16)
    b = rules.linear(x, {"weight": w}, fmt.master(), None, torch.bfloat16)
    Inv.assert_bitwise(a, b, "stored vs master")
    wq = rules.fake_quantized(w.float())
    assert torch.equal(wq, rules.dequantize(stored, torch.float32))
    assert rules.problems(stored, (N, K), fmt) == [] and rules.modelopt_algo is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_activation_quantizer_equals_the_torch_form_bitwise(dtype, device):
    """The one-kernel 1x128 activation quantizer against the torch form, codes and scales bit for bit, and its
    quantize-dequantize form against ``fp8_activation_f64(x).to(dtype)``: tiles of every size from 2^-40 to
    2^40, values that round to every e4m3 code incl. subnormals, ties and -0.0, an all-zero tile (the amax
    floor), a tile whose amax is the floor exactly, rows beyond one program, a strided input; NaN tiles give
    NaN in both."""
    from unified_models.ops.fp8_block.common import fp8_block_quantize_activation_torch
    from unified_models.ops.fp8_block.triton import (fp8_block_activation_qdq_triton,
                                                     fp8_block_quantize_activation_triton)
    from unified_models.ops.moe.deepseek_cpu import fp8_activation_f64

    g = torch.Generator().manual_seed(5)
    T, K = 37, 512
    x = torch.randn(T, K, generator=g) * torch.pow(2.0, torch.randint(-40, 41, (T, 1), generator=g).float())
    codes = torch.arange(256)
    codes = codes[(codes & 0x7F) != 0x7F]
    grid = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()  # every e4m3 value, and midpoints (ties)
    x[0, :254] = grid
    x[0, 254:256] = 448.0
    x[1, :253] = (grid[:-1] + grid[1:]) / 2
    x[1, 253:256] = -0.0
    x[2, :128] = 0.0
    x[3, :128] = 0.0
    x[3, 5] = 1e-4
    x[4, 128:256] = 1e-30
    x = x.to(dtype)
    xd = x.to(device)
    q, s = fp8_block_quantize_activation_triton(xd)
    q0, s0 = fp8_block_quantize_activation_torch(x)
    assert torch.equal(q.cpu().view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s.cpu(), s0)
    for view in (torch.cat([xd, xd], 1)[:, :K], torch.stack([xd, xd], 2)[:, :, 0]):  # row / column strides
        qs, ss = fp8_block_quantize_activation_triton(view)
        assert torch.equal(qs.cpu().view(torch.uint8), q0.view(torch.uint8)) and torch.equal(ss.cpu(), s0)
    want = fp8_activation_f64(x).to(dtype)
    got = fp8_block_activation_qdq_triton(xd)
    assert got.dtype == dtype and torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    bad = x[:2].clone()
    bad[0, 3] = float("nan")
    assert bool(torch.isnan(fp8_block_quantize_activation_triton(bad.to(device))[1][0, 0]))
    assert bool(torch.isnan(fp8_block_quantize_activation_torch(bad)[1][0, 0]))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_block_quantize_activation_triton(xd[:, :100])
