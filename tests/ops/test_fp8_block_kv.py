"""DeepSeek-V4's FP8 KV rule (``ops.ds_kv_fp8_roundtrip``): the values against an independent fp64
formula, the RoPE dims untouched, per-vector tiles (a vector's result does not move when vectors with
1000x larger values join the batch), exactness of the bf16 round trip (re-applying it is the identity:
the values are what an FP8 cache of codes + scales dequantizes to), the straight-through gradient and
the argument errors. Shapes: E = 192 = two 64-dim FP8 tiles + 64 RoPE dims."""

from __future__ import annotations

import math

import pytest
import torch

from unified_models.ops import ds_kv_fp8_roundtrip

E, R = 192, 64


def _kv(gen, t=9, scale=1.0):
    x = torch.randn(t, E, generator=gen) * scale
    x[:, :64] *= 13.7  # the two tiles differ in magnitude
    return x.to(torch.bfloat16)


def _e4m3_rne(v: float) -> float:
    """Round to the nearest e4m3 value (ties to even), |v| <= 448, in plain Python."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = max(math.floor(math.log2(a)), -6)  # subnormals below 2^-6
    step = 2.0 ** (e - 3)
    q = a / step
    r = math.floor(q)
    if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1):
        r += 1
    return math.copysign(min(r * step, 448.0), v)


def test_values_match_an_independent_formula_and_rope_dims_pass():
    g = torch.Generator().manual_seed(0)
    x = _kv(g)
    y = ds_kv_fp8_roundtrip(x, R)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y[:, E - R:], x[:, E - R:])
    xd = x.double()
    for t in range(x.shape[0]):
        for tile in range(2):
            v = xd[t, tile * 64:(tile + 1) * 64]
            s = 2.0 ** math.ceil(math.log2(max(float(v.abs().max()), 1e-4) / 448.0))
            want = [_e4m3_rne(float(a) / s) * s for a in v.tolist()]
            assert y[t, tile * 64:(tile + 1) * 64].double().tolist() == want
    assert not torch.equal(y[:, :E - R], x[:, :E - R])  # it does quantize


def test_round_trip_is_exact_in_bf16_and_idempotent():
    g = torch.Generator().manual_seed(1)
    x = _kv(g, scale=3.0)
    y = ds_kv_fp8_roundtrip(x, R)
    assert torch.equal(ds_kv_fp8_roundtrip(y, R), y)  # the values are e4m3 codes * 2^k, exact in bf16
    assert torch.equal(ds_kv_fp8_roundtrip(x.float(), R).to(torch.bfloat16), y)


def test_a_vector_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    x = _kv(g, t=5)
    big = _kv(g, t=7) * 1000
    alone = ds_kv_fp8_roundtrip(x[2:3], R)
    together = ds_kv_fp8_roundtrip(torch.cat([big[:3], x, big[3:]]), R)
    assert torch.equal(together[5:6], alone)
    assert torch.equal(ds_kv_fp8_roundtrip(x.view(5, 1, E), R).view(5, E), ds_kv_fp8_roundtrip(x, R))


def test_gradient_is_straight_through():
    g = torch.Generator().manual_seed(3)
    x = _kv(g).float().requires_grad_()
    w = torch.randn(x.shape, generator=g)
    (ds_kv_fp8_roundtrip(x, R) * w).sum().backward()
    assert torch.equal(x.grad, w)


@pytest.mark.parametrize("shape, rope, dtype, match", [
    ((3, 192), 100, torch.bfloat16, "positive multiple of 64"),
    ((3, 64), 64, torch.bfloat16, "positive multiple of 64"),
    ((3, 192), 64, torch.float16, "bf16, fp32 or fp64"),
])
def test_bad_arguments_are_refused(shape, rope, dtype, match):
    with pytest.raises(ValueError, match=match):
        ds_kv_fp8_roundtrip(torch.zeros(shape, dtype=dtype), rope)
