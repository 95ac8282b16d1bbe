"""MXFP4 (DeepSeek-V4-Flash's routed experts): the e2m1 rounding and the block-scale rule against
independent plain-Python formulas, exact dequantization, the code round trip, the table entries,
the load-time validator, and the W4A8 experts op (per-token activation rounding, batch
invariance, STE gradients against fp64)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch

from unified_models import ops
from unified_models.dsl import SpecError
from unified_models.dsl.weights import LinearFormat, linear_tensors
from unified_models.layers.weight_formats import WEIGHT_FORMATS, weight_problems
from unified_models.ops.fp8_block import fp8_block_quantize_activation
from unified_models.ops.moe import moe_experts, swiglu_expert_outputs, swiglu_experts
from unified_models.ops.mxfp4 import (
    E2M1_SIGNED_VALUES,
    MXFP4Error,
    MXFP4Master,
    MXFP4Weight,
    cast_e2m1_signed,
    mxfp4_dequantize,
    mxfp4_problems,
    mxfp4_quantize,
    mxfp4_quantize_into,
    mxfp4_scale_codes,
    validate_mxfp4,
)
from unified_models.ops.nvfp4 import pack_e2m1, unpack_e2m1

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _py_e2m1_code(v: float) -> int:
    """Plain Python: the signed e2m1 code nearest to ``v`` (exact rational distances), ties to the
    even magnitude index, saturating at 6, the sign from the sign bit."""
    a = Fraction(abs(v))
    if a >= 6:
        idx = 7
    else:
        dist = [abs(a - Fraction(g)) for g in GRID]
        best = min(dist)
        cands = [i for i, d in enumerate(dist) if d == best]
        idx = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
    return idx | (8 if math.copysign(1.0, v) < 0 else 0)


def _py_block_scale_exp(block: list[float]) -> int:
    """Plain Python: the smallest k with ``2^k >= max(amax, 6 * 2^-126) / 6`` (exact rationals)."""
    amax = max(Fraction(max(abs(v) for v in block)), Fraction(6) * Fraction(1, 2 ** 126))
    t = amax / 6
    k = math.floor(math.log2(t.numerator) - math.log2(t.denominator)) - 2
    while Fraction(2) ** k < t:
        k += 1
    return k


def _py_quantize(w: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Plain-Python MXFP4 of a 2-D float tensor: (codes [N][K], e8m0 scale codes [N][K/32])."""
    codes, scales = [], []
    for row in w.float().tolist():
        crow, srow = [], []
        for b in range(0, len(row), 32):
            blk = row[b:b + 32]
            k = _py_block_scale_exp(blk)
            srow.append(k + 127)
            s = Fraction(2) ** k
            crow += [_py_e2m1_code(math.copysign(float(min(max(Fraction(v) / s, Fraction(-6)), Fraction(6))), v))
                     for v in blk]
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----------------------------------------------------------------------------- rounding and scale rule


def test_e2m1_rounding_matches_plain_python():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = list(GRID) + ties + [6.5, 7.0, 1e30, 0.0, -0.0, 1e-30, 0.1]
    for t in ties:  # fp32 neighbours of every tie
        f = torch.tensor([t], dtype=torch.float32)
        vals += [torch.nextafter(f, torch.tensor([0.0])).item(), torch.nextafter(f, torch.tensor([9.0])).item()]
    vals += torch.empty(400).uniform_(-7, 7, generator=torch.Generator().manual_seed(0)).tolist()
    vals += [-v for v in vals]
    x = torch.tensor(vals, dtype=torch.float32)
    got = cast_e2m1_signed(x).tolist()
    want = [_py_e2m1_code(v) for v in x.tolist()]
    assert got == want
    # the ties really went to the even code: 0.75 -> 1.0 (index 2), 1.25 -> 1.0, 2.5 -> 2.0, 5 -> 4.0
    assert cast_e2m1_signed(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert cast_e2m1_signed(torch.tensor([-0.0, -0.1])).tolist() == [8, 8]


def _edge_weight() -> torch.Tensor:
    """[5, 128] fp32 (4 blocks a row): random blocks at several magnitudes, an all-zero block, a
    subnormal block; blocks whose amax is exactly 6 * 2^k, 3 * 2^k, or one fp32 ulp either side
    (rows 1-3); blocks of e2m1 ties times a scale (row 4)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 128, generator=g)
    w[0, :32] *= 1e-3
    w[0, 32:64] *= 300.0
    w[0, 64:96] = 0.0
    w[0, 96:128] = 1e-41  # fp32 subnormal: below the floor
    blocks = w[1:4].view(12, 32)
    for j, amax in enumerate((6.0, 6.0 * 2 ** -20, 3.0, 1.5 * 2 ** 40)):
        a = torch.tensor([amax], dtype=torch.float32)
        for i, v in enumerate((a, torch.nextafter(a, torch.tensor([0.0])), torch.nextafter(a, torch.tensor([1e38])))):
            blk = blocks[3 * j + i]
            blk.copy_(torch.randn(32, generator=g) * amax / 8)
            blk[5] = v if i != 1 else -v
    w[4, 64:96] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * 2.0 ** -3
    w[4, 96:128] = -w[4, 64:96]
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_matches_plain_python_rule(dtype):
    w = _edge_weight().to(dtype)
    q = mxfp4_quantize(w)
    codes, scales = _py_quantize(w)
    assert unpack_e2m1(q.weight).tolist() == codes
    assert _u8(q.weight_scale).tolist() == scales
    assert q.weight.dtype == torch.uint8 and q.weight_scale.dtype == torch.float8_e8m0fnu
    assert _u8(q.weight_scale)[0, 2].item() == 1  # the all-zero block: the floor's 2^-126


def test_scale_division_equals_the_official_multiply_form():
    """The official kernel computes ``amax * fp32(1/6)``; the rule divides by 6. For every fp32 mantissa
    within 4096 ulps of 1.5 (where ``amax / 6`` is near a power of two), at many exponents, the
    rounded-up power of two is the same."""
    m = torch.arange(-4096, 4097, dtype=torch.int32) + 0x3FC00000  # 1.5 = 0x3FC00000
    base = m.view(torch.float32)
    amax = torch.cat([base * 2.0 ** e for e in range(-120, 126, 7)] +
                     [torch.empty(5000).uniform_(1e-30, 1e30, generator=torch.Generator().manual_seed(2))])
    ours = mxfp4_scale_codes(amax)
    s = torch.clamp(amax, min=6.0 * 2.0 ** -126) * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    bits = s.view(torch.int32)
    official = torch.where((bits & 0x7FFFFF) != 0, ((bits >> 23) & 0xFF) + 1, (bits >> 23) & 0xFF)
    assert torch.equal(ours.to(torch.int32), official)


def test_dequantize_is_exact():
    codes = torch.arange(16, dtype=torch.uint8).repeat(8, 2)  # [8, 32]
    scale_codes = torch.tensor([0, 1, 2, 100, 127, 130, 200, 252], dtype=torch.uint8)[:, None]
    q = MXFP4Weight(pack_e2m1(codes), scale_codes.view(torch.float8_e8m0fnu))
    want = torch.tensor([[E2M1_SIGNED_VALUES[c] * 2.0 ** (int(s) - 127) for c in row]
                         for row, s in zip(codes.tolist(), scale_codes[:, 0].tolist())], dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        got = mxfp4_dequantize(q, dtype)
        assert got.dtype == dtype and torch.equal(got.double(), want), dtype
        assert torch.equal(torch.signbit(got), torch.signbit(want))  # code 8 is -0


# ----------------------------------------------------------------------------- round trips


def _random_codes(gen, n, k, canonical):
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if canonical:  # each block's largest magnitude 4 or 6 (index 6 or 7), sign random
        blk = codes.view(n, k // 32, 32)
        blk[:, :, 0] = (blk[:, :, 0] & 8) | torch.randint(6, 8, blk[:, :, 0].shape, generator=gen, dtype=torch.uint8)
    return codes


def test_stored_codes_equal_quantize_of_dequantize(gen):
    codes = _random_codes(gen, 16, 128, canonical=True)
    scales = torch.randint(100, 150, (16, 4), generator=gen, dtype=torch.uint8)
    q = MXFP4Weight(pack_e2m1(codes), scales)
    for dtype in (torch.bfloat16, torch.float32):
        back = mxfp4_quantize(mxfp4_dequantize(q, dtype))
        assert torch.equal(back.weight, q.weight) and torch.equal(_u8(back.weight_scale), scales), dtype


def test_noncanonical_codes_re_encode_to_the_same_values(gen):
    """A block whose largest magnitude is below 4 (the quantizer's own output for amax / s in (3, 3.5))
    gets another encoding of the same values; canonical blocks keep their codes."""
    codes = _random_codes(gen, 16, 128, canonical=False)
    codes[0, :32] = 0  # all-zero block
    codes[1, :32] = torch.randint(0, 6, (32,), generator=gen, dtype=torch.uint8)  # max magnitude <= 3
    scales = torch.randint(100, 150, (16, 4), generator=gen, dtype=torch.uint8)
    q = MXFP4Weight(pack_e2m1(codes), scales)
    v = mxfp4_dequantize(q, torch.bfloat16)
    back = mxfp4_quantize(v)
    assert torch.equal(mxfp4_dequantize(back, torch.bfloat16).view(torch.int16), v.view(torch.int16))
    top = (codes & 7).view(16, 4, 32).amax(-1)
    canonical = top >= 6
    same = (unpack_e2m1(back.weight).view(16, 4, 32) == codes.view(16, 4, 32)).all(-1) & \
        (_u8(back.weight_scale) == scales)
    assert torch.equal(same | ~canonical, torch.ones_like(same)) and not bool(same[1, 0])
    assert (~canonical).any() and canonical.any()
    # and the quantizer's own non-canonical output: amax / s = 3.25 -> largest code 3
    w = torch.zeros(1, 128)
    w[0, 0] = 3.25
    q1 = mxfp4_quantize(w)
    assert unpack_e2m1(q1.weight)[0, 0].item() == 5 and _u8(q1.weight_scale)[0, 0].item() == 127
    q2 = mxfp4_quantize(mxfp4_dequantize(q1, torch.float32))
    assert unpack_e2m1(q2.weight)[0, 0].item() == 7 and _u8(q2.weight_scale)[0, 0].item() == 126
    assert torch.equal(mxfp4_dequantize(q2, torch.float32), mxfp4_dequantize(q1, torch.float32))


def test_stack_equals_per_expert_and_quantize_into(gen):
    w = torch.randn(3, 16, 128, generator=gen).bfloat16()
    q = mxfp4_quantize(w)
    for e in range(3):
        qe = mxfp4_quantize(w[e])
        assert torch.equal(q.expert(e).weight, qe.weight) and torch.equal(_u8(q.expert(e).weight_scale),
                                                                          _u8(qe.weight_scale))
    w2 = w * 3
    ptr = q.weight.data_ptr()
    mxfp4_quantize_into(q, w2)
    assert q.weight.data_ptr() == ptr and torch.equal(q.weight, mxfp4_quantize(w2).weight)
    with pytest.raises(ValueError, match="does not fit"):
        mxfp4_quantize_into(q, w2[:, :8])


def test_nonfinite_block_gets_the_nan_scale_and_is_refused():
    w = torch.full((2, 128), 6.0)
    w[1, 40] = float("nan")
    w[0, 100] = float("inf")
    q = mxfp4_quantize(w)
    assert _u8(q.weight_scale).tolist() == [[127, 127, 127, 255], [127, 255, 127, 127]]
    assert torch.isnan(mxfp4_dequantize(q, torch.float32)[1, 32:64]).all()
    probs = mxfp4_problems(q.weight, q.weight_scale)
    assert probs == ["weight_scale has 2 NaN scale(s) (e8m0 code 255; first at [0, 3])"]


def test_quantize_argument_errors():
    with pytest.raises(ValueError, match="multiple of the MXFP4 block"):
        mxfp4_quantize(torch.ones(4, 48))
    with pytest.raises(ValueError, match=r"expected \[N, K\]"):
        mxfp4_quantize(torch.ones(64))
    with pytest.raises(MXFP4Error, match="do not match"):
        MXFP4Weight(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu))
    with pytest.raises(MXFP4Error, match="dtype torch.float16"):
        MXFP4Weight(torch.zeros(4, 64, dtype=torch.float16), torch.zeros(4, 4, dtype=torch.float8_e8m0fnu))
    with pytest.raises(MXFP4Error, match="multiple of the MXFP4 block"):
        MXFP4Master(torch.zeros(4, 48))


# ----------------------------------------------------------------------------- validation


def _good(gen, n=8, k=256):
    return mxfp4_quantize(torch.randn(n, k, generator=gen))


def _overflow(q):
    c = unpack_e2m1(q.weight)
    c[2, 40] = 7  # 6 * 2^126 = 1.5 * 2^128: Inf
    s = _u8(q.weight_scale).clone()
    s[2, 1] = 253
    return pack_e2m1(c), s.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("mutate,msg", [
    (lambda q: (None, q.weight_scale), "weight is missing"),
    (lambda q: (q.weight, None), "weight_scale is missing"),
    (lambda q: (q.weight.bfloat16(), q.weight_scale), "weight has dtype torch.bfloat16, expected torch.uint8"),
    (lambda q: (q.weight, q.weight_scale.float()),
     "weight_scale has dtype torch.float32, expected torch.float8_e8m0fnu"),
    (lambda q: (q.weight, q.weight_scale[:, :4]), r"weight_scale has shape \[8, 4\], expected \[8, 8\]"),
    (lambda q: (q.weight[0], q.weight_scale), r"weight must be 2-D \[N, K/2\]"),
    (lambda q: (q.weight[:, :80], q.weight_scale[:, :5]), r"weight K = 160 is not a multiple of 128"),
    (lambda q: (q.weight, _u8(q.weight_scale).clone().index_fill_(1, torch.tensor([3]), 255)),
     r"weight_scale has 8 NaN scale\(s\) \(e8m0 code 255; first at \[0, 3\]\)"),
    (_overflow, r"weight_scale has 1 scale\(s\) whose block values overflow bf16/fp32 .*first at \[2, 1\]"),
])
def test_problems_name_the_tensor(mutate, msg, gen):
    q = _good(gen)
    assert mxfp4_problems(q.weight, q.weight_scale, shape=(8, 256)) == []
    w, s = mutate(q)
    probs = mxfp4_problems(w, s, shape=(8, 256) if "K = 160" not in msg else None)
    assert any(re.search(msg, p) for p in probs), probs
    with pytest.raises(MXFP4Error, match="^model.layers.3.ffn.experts.5.w1: "):
        validate_mxfp4(w, s, name="model.layers.3.ffn.experts.5.w1", shape=(8, 256))


def test_problems_accept_the_same_bytes_under_other_dtypes_and_check_the_expected_shape(gen):
    q = _good(gen)
    assert mxfp4_problems(q.weight.view(torch.int8), _u8(q.weight_scale), shape=(8, 256)) == []
    assert mxfp4_problems(q.weight.view(torch.float4_e2m1fn_x2), q.weight_scale) == []
    assert mxfp4_problems(q.weight, q.weight_scale, shape=(8, 512)) == ["weight unpacks to [8, 256], expected [8, 512]"]
    assert torch.equal(MXFP4Weight(q.weight.view(torch.int8), _u8(q.weight_scale)).weight, q.weight)


def test_weight_problems_prefix_the_linear_name(gen):
    class Model:
        @staticmethod
        def weight_format(name):
            return LinearFormat("mxfp4")

    q = _good(gen)
    name = "model.layers.1.ffn.experts.2.w3"
    state = {f"{name}.weight": q.weight, f"{name}.weight_scale": _u8(q.weight_scale).clone().fill_(255)}
    probs = weight_problems(Model(), name, state, (8, 256))
    assert probs == [f"{name}: weight_scale has 64 NaN scale(s) (e8m0 code 255; first at [0, 0])"]
    del state[f"{name}.weight_scale"]
    assert weight_problems(Model(), name, state, (8, 256)) == [f"{name}: weight_scale is missing"]


# ----------------------------------------------------------------------------- the table entries


def test_layout_and_rules_entries(gen):
    fmt = LinearFormat("mxfp4")
    assert linear_tensors("l", fmt, 8, 256, torch.bfloat16) == {
        "l.weight": ((8, 128), torch.uint8), "l.weight_scale": ((8, 8), torch.float8_e8m0fnu)}
    assert linear_tensors("l", fmt.master(), 8, 256, torch.bfloat16) == {"l.weight": ((8, 256), torch.bfloat16)}
    with pytest.raises(SpecError, match="l: weight format 'mxfp4' needs K = 96 to be a multiple of 128"):
        linear_tensors("l", fmt, 8, 96, torch.bfloat16)
    rules = WEIGHT_FORMATS["mxfp4"]
    w = torch.randn(8, 256, generator=gen).bfloat16()
    stored = rules.quantize(w)
    assert rules.problems(stored, (8, 256), fmt) == [] and rules.modelopt_algo is None
    q = mxfp4_quantize(w)
    assert torch.equal(stored["weight"], q.weight)
    deq = rules.dequantize(stored, torch.bfloat16)
    assert torch.equal(deq.view(torch.int16), mxfp4_dequantize(q).view(torch.int16))
    m = w.float().requires_grad_(True)
    fq = rules.fake_quantized(m)
    assert torch.equal(fq.detach(), mxfp4_dequantize(q, torch.float32))
    fq.sum().backward()
    assert torch.equal(m.grad, torch.ones_like(m))  # straight through
    g = rules.grouped({"weight": stored["weight"][None], "weight_scale": stored["weight_scale"][None]}, fmt)
    assert isinstance(g, MXFP4Weight) and g.shape == (1, 8, 256) and rules.grouped_kernel == "mxfp4"
    assert isinstance(rules.grouped({"weight": w[None]}, fmt.master()), MXFP4Master)
    with pytest.raises(SpecError, match="routed experts only"):
        rules.linear(torch.zeros(2, 256), stored, fmt, None, torch.bfloat16)


# ----------------------------------------------------------------------------- the W4A8 experts op

E, I, D, L = 4, 128, 128, 10.0


def _experts(gen, scale=1.0):
    mk = lambda *s: (torch.randn(*s, generator=gen) * scale / s[-1] ** 0.5 * 2).bfloat16()  # noqa: E731
    return mk(E, I, D), mk(E, I, D), mk(E, D, I)


def _act_dq(a: torch.Tensor) -> torch.Tensor:
    q, s = fp8_block_quantize_activation(a)
    return q.double() * s.double().repeat_interleave(128, 1)


def _w4a8_plain(x, ids, wts, masters):
    """Per assignment, plain torch: the dequantized weights, per-token FP8 activations, fp64 products
    rounded to fp32 at the op's points (g, u; h to bf16; y)."""
    wg, wu, wd = (mxfp4_dequantize(mxfp4_quantize(m), torch.float64) for m in masters)
    T, K = ids.shape
    out = torch.zeros(T * K, D, dtype=torch.float32)
    for t in range(T):
        xq = _act_dq(x[t:t + 1])
        for k in range(K):
            e = int(ids[t, k])
            g = (xq @ wg[e].t()).float()
            u = (xq @ wu[e].t()).float()
            h = (torch.nn.functional.silu(g.clamp(max=L)) * u.clamp(-L, L) * wts[t, k]).bfloat16()
            out[t * K + k] = (_act_dq(h) @ wd[e].t()).float()[0]
    return out


def test_w4a8_expert_outputs_equal_the_plain_formula(gen):
    masters = _experts(gen)
    x = torch.randn(7, D, generator=gen).bfloat16()
    ids = torch.randint(0, E, (7, 2), generator=gen).int()
    wts = torch.rand(7, 2, generator=gen)
    qs = [mxfp4_quantize(m) for m in masters]
    y = swiglu_expert_outputs(x, ids, wts, *qs, swiglu_limit=L)
    assert torch.equal(y.view(torch.int32), _w4a8_plain(x, ids, wts, masters).view(torch.int32))
    # masters are quantized inside the op: the same bits
    y2 = swiglu_expert_outputs(x, ids, wts, *(MXFP4Master(m) for m in masters), swiglu_limit=L)
    assert torch.equal(y2.view(torch.int32), y.view(torch.int32))
    # the activation rounding is real: the same weights without it (W4A16 on the dequantized bf16) differ
    w16 = [mxfp4_dequantize(q) for q in qs]
    assert not torch.equal(swiglu_expert_outputs(x, ids, wts, *w16, swiglu_limit=L), y)


def test_token_output_unchanged_when_much_larger_tokens_join(gen):
    masters = _experts(gen)
    qs = [mxfp4_quantize(m) for m in masters]
    x = torch.randn(5, D, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], dtype=torch.int32)
    wts = torch.rand(5, 2, generator=gen)
    alone = swiglu_experts(x, ids, wts, *qs, swiglu_limit=L)
    rows = swiglu_expert_outputs(x, ids, wts, *qs, swiglu_limit=L)
    big = (torch.randn(6, D, generator=gen) * 1000).bfloat16()
    big_ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]], dtype=torch.int32)  # same experts
    order = torch.tensor([5, 0, 6, 1, 7, 8, 2, 9, 3, 10, 4])  # small tokens at 1, 3, 6, 8, 10
    xb = torch.cat([x, big])[order]
    ib = torch.cat([ids, big_ids])[order]
    wb = torch.cat([wts, torch.rand(6, 2, generator=gen)])[order]
    together = swiglu_experts(xb, ib, wb, *qs, swiglu_limit=L)
    mine = torch.tensor([1, 3, 6, 8, 10])
    assert torch.equal(together[mine].view(torch.int16), alone.view(torch.int16))
    rows_b = swiglu_expert_outputs(xb, ib, wb, *qs, swiglu_limit=L).view(11, 2, D)
    assert torch.equal(rows_b[mine].reshape(10, D).view(torch.int32), rows.view(torch.int32))
    # the large tokens' own outputs are not those of the small ones scaled: they ran through other tiles
    assert together[~torch.isin(torch.arange(11), mine)].float().abs().max() > 10 * alone.float().abs().max()


def test_ste_gradient_matches_fp64(gen):
    masters = [m.float().requires_grad_(True) for m in _experts(gen)]
    x = torch.randn(9, D, generator=gen).bfloat16().requires_grad_(True)
    ids = torch.randint(0, E, (9, 2), generator=gen).int()
    wts = torch.rand(9, 2, generator=gen).requires_grad_(True)
    G = torch.randn(9, D, generator=gen)
    out = ops.swiglu_experts(x, ids, wts, *(MXFP4Master(m) for m in masters), swiglu_limit=L,
                             out_dtype=torch.float32)
    (out * G).sum().backward()
    ours = [x.grad, wts.grad, *(m.grad for m in masters)]

    # fp64: the same forward with straight-through quantizers (weights, activations)
    m64 = [m.detach().double().requires_grad_(True) for m in masters]
    x64 = x.detach().double().requires_grad_(True)
    w64 = wts.detach().double().requires_grad_(True)
    ste = lambda a, q: a + (q - a).detach()  # noqa: E731
    wq = [ste(m, mxfp4_dequantize(mxfp4_quantize(m.detach().float()), torch.float64)) for m in m64]
    xq = ste(x64, _act_dq(x.detach()))
    out64 = torch.zeros(9, D, dtype=torch.float64)
    for k in range(2):
        e = ids[:, k].long()
        g = torch.einsum("td,tid->ti", xq, wq[0][e])
        u = torch.einsum("td,tid->ti", xq, wq[1][e])
        h = torch.nn.functional.silu(g.clamp(max=L)) * u.clamp(-L, L) * w64[:, k:k + 1]
        hq = ste(h, _act_dq(h.detach().bfloat16()))
        out64 = out64 + torch.einsum("ti,tdi->td", hq, wq[2][e])
    (out64 * G.double()).sum().backward()
    want = [x64.grad, w64.grad, *(m.grad for m in m64)]
    for name, a, b in zip(("x", "routing weights", "w1", "w3", "w2"), ours, want):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        print(f"STE grad {name}: max rel err {err:.2e}")
        assert err < 4e-3 if name == "x" else err < 1e-5, (name, err)  # x: its gradient is rounded to bf16
        assert b.abs().max() > 0


def test_triton_path_runs_w4a8_and_relu2_experts_refuse_mxfp4(gen, monkeypatch):
    qs = [mxfp4_quantize(m) for m in _experts(gen)]
    x = torch.randn(3, D, generator=gen).bfloat16()
    ids = torch.tensor([[0], [2], [1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="relu2 experts take model-dtype or NVFP4"):
        moe_experts(x, ids, torch.ones(3, 1), qs[1], qs[2])
    cpu = swiglu_expert_outputs(x, ids, torch.ones(3, 1), *qs, swiglu_limit=L)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    tri = swiglu_expert_outputs(x, ids, torch.ones(3, 1), *qs, swiglu_limit=L)
    one = swiglu_expert_outputs(x[1:2], ids[1:2], torch.ones(1, 1), *qs, swiglu_limit=L)
    assert torch.equal(one.view(torch.int32), tri[1:2].view(torch.int32))  # row-local
    assert (tri - cpu).abs().max() <= 2e-2 * cpu.abs().max()  # the same rule, GPU-order accumulation


def test_w4a8_needs_k_a_multiple_of_128(gen):
    q = mxfp4_quantize(torch.randn(E, I, 64, generator=gen))
    d = mxfp4_quantize(torch.randn(E, 64, I, generator=gen))
    with pytest.raises(ValueError, match="MXFP4Weight w1 computes with 1x128 FP8 activation tiles; its K = 64 is not a "
                                         "multiple of 128"):
        swiglu_expert_outputs(torch.zeros(1, 64).bfloat16(), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1),
                              q, q, d, swiglu_limit=L)
