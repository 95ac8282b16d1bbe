"""FP8 W8A8 linear (ModelOpt per-tensor format): quantizers bit for bit against NVIDIA ModelOpt
0.47 and vLLM, the e4m3 rounding against a brute-force nearest-value table, the linear (torch
implementation and the Triton kernel) against the fp64 oracle and for batch invariance, the STE
backward against fp64 autograd, and the load-time validator.

Shapes cross the interpreter's tile edges (BLOCK_M=64, BLOCK_N=256, BLOCK_K=64): T up to 70,
N=300, K=200 (a masked K tail).
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.fp8 import (
    FP8_E4M3_MAX,
    FP8Error,
    FP8Weight,
    fp8_clamp_mask,
    fp8_input_scale,
    fp8_linear,
    fp8_linear_reference,
    fp8_linear_torch,
    fp8_quantize,
    fp8_quantize_activation,
    fp8_quantize_activation_torch,
    fp8_quantize_into,
    fp8_quantize_weight,
    fp8_weight_scale,
    validate_fp8,
)

K, N = 200, 300


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _inputs(T, gen, k=K, n=N, x_scale=2.0):
    x = (torch.randn(T, k, generator=gen) * x_scale).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.037).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    return x, w, b


def _in_scale(x, frac=1.0):
    """A static input scale from a calibration amax (``frac`` < 1 makes some rows clamp)."""
    return fp8_input_scale(x.abs().amax().float() * frac)


# ---------------------------------------------------------------------------- e4m3 rounding reference


def _e4m3_pos_values() -> torch.Tensor:
    """Values of codes 0..126 (fp64), computed from the format, not by torch."""
    out = []
    for c in range(127):
        e, m = (c >> 3) & 15, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(out, dtype=torch.float64)


def _e4m3_ref_codes(v: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest e4m3 value of fp64 ``v`` (|v| <= 448), ties to the even code;
    sign bit from ``v``'s sign (``-0.0`` -> 0x80); NaN -> 0x7F."""
    vals = _e4m3_pos_values()
    a = v.double().abs()
    assert bool((a[~torch.isnan(a)] <= 448).all())
    d = (a[:, None] - vals[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = d == best
    codes = torch.arange(127)
    # among the (at most two) nearest codes take the even one
    even = cand & (codes % 2 == 0)[None, :]
    pick = torch.where(even.any(1), even.float().argmax(1), cand.float().argmax(1))
    neg = torch.signbit(v.double())
    out = pick + 128 * neg.long()
    return torch.where(torch.isnan(v), 0x7F, out).to(torch.uint8)


def _tie_points() -> torch.Tensor:
    """Every midpoint between consecutive e4m3 values, its fp32 neighbours, the values
    themselves, half the smallest subnormal and its neighbours, both signs."""
    vals = _e4m3_pos_values().float()
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()  # exact in fp32
    pts = [vals, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
           torch.nextafter(mids, torch.zeros_like(mids)), torch.tensor([2.0 ** -10, 2.0 ** -11, 1e-30, 0.0])]
    p = torch.cat(pts)
    p = torch.cat([p, torch.nextafter(torch.tensor([2.0 ** -10]), torch.tensor([1.0]))])
    return torch.cat([p, -p])


# ---------------------------------------------------------------------------- weight quantizer vs ModelOpt


def _modelopt_fp8(w, s):
    from modelopt.torch.export.quant_utils import QUANTIZATION_FP8, to_quantized_weight

    return to_quantized_weight(w, s, QUANTIZATION_FP8)


def _edge_weight(dtype):
    """[8, 64] with edge elements: zeros, -0.0, the amax on a negative element, its
    neighbours, elements that underflow to (-)0, and values in the e4m3 subnormal range."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)) * 0.3
    w[0, :8] = 0.0
    w[0, 8] = -0.0
    w[1, 3] = -1.7  # amax, negative
    w[1, 4] = 1.69
    w[2, :8] = torch.tensor([1e-30, -1e-30, 1e-6, -1e-6, 2e-6, 3e-6, 7e-6, -5e-6])
    w[3] = torch.linspace(-1.7, 1.7, 64)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 250.0])
def test_weight_quantizer_matches_modelopt(dtype, scale, gen):
    ws = [(torch.randn(64, 96, generator=gen) * scale).to(dtype), _edge_weight(dtype) * scale]
    for w in ws:
        s = fp8_weight_scale(w)
        # ModelOpt's _export_quantized_weight: torch.tensor(amax / maxbound) with the fp32 amax
        s_mo = torch.tensor(w.abs().amax().float() / 448.0)
        assert s.dtype == torch.float32 and s.dim() == 0
        assert torch.equal(s.view(torch.int32), s_mo.view(torch.int32)), "weight scale differs from ModelOpt"
        q = fp8_quantize_weight(w, s)
        q_mo = _modelopt_fp8(w, s_mo)
        assert q.dtype == q_mo.dtype == torch.float8_e4m3fn
        assert torch.equal(_u8(q), _u8(q_mo)), f"{int((_u8(q) != _u8(q_mo)).sum())} codes differ from ModelOpt"
        assert torch.equal(_u8(fp8_quantize_weight(w)), _u8(q))  # default scale = fp8_weight_scale
        assert int(_u8(q).max()) != 0x7F and not bool(torch.isnan(q.float()).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_quantizer_external_scale_saturates_like_modelopt(dtype, gen):
    """A given scale smaller than amax/448: values beyond 448 saturate (ModelOpt's cast in torch 2.13)."""
    w = (torch.randn(32, 64, generator=gen)).to(dtype)
    s = fp8_weight_scale(w) / 3.0
    q = fp8_quantize_weight(w, s)
    assert torch.equal(_u8(q), _u8(_modelopt_fp8(w, s)))
    assert int((_u8(q) & 0x7F).eq(0x7E).sum()) > 10  # many saturated at 448


def test_weight_quantizer_double_rounding_is_modelopts(gen):
    """For bf16 weights ModelOpt rounds W/s to bf16 and then to e4m3 (0-d scale: no type
    promotion): a single rounding of the fp32 quotient gives different codes on some elements,
    and ModelOpt agrees with the double rounding. (Fails if the rule is 'simplified'.)"""
    w = (torch.randn(256, 256, generator=gen) * 0.05).bfloat16()
    s = fp8_weight_scale(w)
    q = _u8(fp8_quantize_weight(w, s))
    single = _u8((w.float() / s).to(torch.float8_e4m3fn))
    assert int((q != single).sum()) > 0
    assert torch.equal(q, _u8(_modelopt_fp8(w, s)))
    # the divisor is the fp32 scale itself (ModelOpt on CPU), not the scale rounded to bf16
    # (what torch's CUDA kernel would do with a CUDA 0-d scale): those codes differ too
    via_bf16_scale = _u8((w.float() / s.bfloat16().float()).bfloat16().to(torch.float8_e4m3fn))
    assert int((q != via_bf16_scale).sum()) > 0


def test_zero_weight_gets_scale_one():
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    s = fp8_weight_scale(w)
    assert float(s) == 1.0
    assert torch.equal(_u8(fp8_quantize_weight(w, s)), torch.zeros(4, 16, dtype=torch.uint8))


def test_modelopt_export_path_end_to_end(gen):
    """mtq.quantize(FP8_DEFAULT_CFG) + max calibration + the HF exporter's per-module export:
    weight codes, weight_scale and input_scale equal ours."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    lin = torch.nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen) * 0.0371)
    model = torch.nn.Sequential(lin).to(torch.bfloat16)
    xs = [(torch.randn(6, 96, generator=gen) * 3.3).bfloat16() for _ in range(3)]
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: [m(x) for x in xs])
    w_master = lin.weight.detach().clone()
    _export_quantized_weight(lin, torch.bfloat16)
    assert torch.equal(lin.weight_scale.view(torch.int32), fp8_weight_scale(w_master).view(torch.int32))
    assert torch.equal(_u8(lin.weight), _u8(fp8_quantize_weight(w_master)))
    amax = torch.stack([x.abs().amax() for x in xs]).amax()
    assert torch.equal(lin.input_scale.view(torch.int32), fp8_input_scale(amax).view(torch.int32))
    q = FP8Weight.from_checkpoint(lin.weight.detach(), lin.weight_scale, lin.input_scale, name="lin")
    assert torch.equal(_u8(q.weight), _u8(fp8_quantize(w_master, amax.float() / 448).weight))


@pytest.mark.parametrize("amax", [12.25, 0.0, float("nan"), 1e-45, 3e38, 0.37109375])
def test_input_scale_matches_modelopt(amax):
    from modelopt.torch.export.quant_utils import get_scaling_factor
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    tq.amax = torch.tensor(amax)
    ref = get_scaling_factor(tq).reshape(())
    ours = fp8_input_scale(torch.tensor(amax))
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), (float(ours), float(ref))
    assert torch.equal(fp8_input_scale(amax).view(torch.int32), ref.view(torch.int32))  # a Python float too


# ---------------------------------------------------------------------------- activation quantizer


def _quantizers(device):
    from unified_models.ops.fp8.triton import fp8_quantize_activation_triton

    return {
        "torch": lambda x, s: fp8_quantize_activation_torch(x, s),
        "triton": lambda x, s: fp8_quantize_activation_triton(x.to(device), s.to(device)).cpu(),
    }


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_activation_rounding_is_rne_everywhere(impl, device):
    """Scale 1 (inv exact): every e4m3 tie point and its fp32 neighbours vs the brute-force table."""
    q = _quantizers(device)[impl]
    v = _tie_points().reshape(1, -1)
    got = _u8(q(v, torch.tensor(1.0)))[0]
    want = _e4m3_ref_codes(v[0])
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(v[0, i]), int(got[i]), int(want[i])) for i in bad[:8]]


def test_activation_triton_reciprocal_sensitive(device):
    from unified_models.ops.fp8.triton import fp8_quantize_activation_triton

    s = torch.tensor(0.0371)
    x = _reciprocal_sensitive(s).reshape(1, -1)
    assert x.numel() >= 4
    got = fp8_quantize_activation_triton(x.to(device), s.to(device)).cpu()
    assert torch.equal(_u8(got), _u8(fp8_quantize_activation_torch(x, s)))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_activation_edge_cases(impl, device):
    q = _quantizers(device)[impl]
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[448.0, 449.0, 463.9, 464.0, 500.0, 1e30, inf, -449.0, -1e30, -inf,
                       -0.0, 0.0, -1e-30, 1e-30, nan, -nan, 1.0625, 17.0, 19.0, 1.5 * 2 ** -9, 2 ** -10]])
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0xFE,
            0x80, 0x00, 0x80, 0x00, 0x7F, 0x7F, 0x38, 0x58, 0x5A, 0x02, 0x00]
    got = _u8(q(x, torch.tensor(1.0)))[0].tolist()
    assert got == want
    # bf16 input, scale 0.0123 (448 * s = 5.51): 5.5 -> 447.2 rounds to 448 (not clamped: the STE
    # passes it), 5.53 -> 449.7 is clamped (the STE stops it); bf16(0.0123) / 0.0123 rounds to 1.0
    s = torch.tensor(0.0123)
    xb = torch.tensor([[5.5, -5.5, 5.53, -5.53, 0.0123]], dtype=torch.bfloat16)
    assert _u8(q(xb, s))[0].tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x38]
    assert fp8_clamp_mask(xb, s)[0].tolist() == [True, True, False, False, True]


def test_activation_inverse_scale_is_ieee_fp32(gen):
    """inv = fp32(1/s) correctly rounded, then ONE fp32 multiply (vLLM's rule): the codes equal the
    brute-force rounding of fp32(x * fp32(1/s)) computed through fp64."""
    scales = torch.rand(64, generator=gen) * 0.3 + 1e-4
    x = torch.randn(64, 128, generator=gen) * 10
    for i, s in enumerate(scales):
        inv64 = 1.0 / float(s)
        inv = torch.tensor(inv64, dtype=torch.float32)  # fp64 quotient rounded to fp32 == IEEE fp32 1/s
        v = (x[i].double() * inv.double()).float()  # one fp32 rounding of the exact product
        want = _e4m3_ref_codes(v.double().clamp(-448, 448))
        got = _u8(fp8_quantize_activation_torch(x[i:i + 1], s))[0]
        assert torch.equal(got, want), f"scale {float(s)}"


def _reciprocal_sensitive(s: torch.Tensor) -> torch.Tensor:
    """fp32 inputs x near ``e4m3 midpoint * s`` whose code differs between ``fp32(x * fp32(1/s))``
    (vLLM's rule) and ``fp32(x / s)`` (a plain division): random data almost never hits these."""
    s32 = s.float().reshape(())
    vals = _e4m3_pos_values()
    mids = ((vals[9:120] + vals[8:119]) / 2).float()  # normal-range midpoints
    x = (mids.double() * s32.double()).float()
    up, down, cands = x, x, [x]
    for _ in range(6):
        up, down = torch.nextafter(up, up * 2), torch.nextafter(down, down * 0)
        cands += [up, down]
    x = torch.cat(cands)
    inv = torch.tensor(1.0 / float(s32), dtype=torch.float32)
    v_mul = (x.double() * inv.double()).float().double().clamp(-448, 448)
    v_div = (x.double() / s32.double()).float().double().clamp(-448, 448)
    keep = _e4m3_ref_codes(v_mul) != _e4m3_ref_codes(v_div)
    return torch.cat([x[keep], -x[keep]])


def test_activation_uses_reciprocal_multiply():
    """``x * fp32(1/s)``, not ``x / s``: on inputs where the two round to different codes."""
    found = 0
    for s in (0.0371, 0.3, 0.013, 1.7e-3, 0.77):
        s = torch.tensor(s)
        x = _reciprocal_sensitive(s)
        found += x.numel()
        inv = torch.tensor(1.0 / float(s), dtype=torch.float32)
        want = _e4m3_ref_codes((x.double() * inv.double()).float().double().clamp(-448, 448))
        assert torch.equal(_u8(fp8_quantize_activation_torch(x.reshape(1, -1), s))[0], want)
    assert found >= 10, found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_matches_vllm_native(dtype, gen):
    """vLLM's QuantFP8 (static, per-tensor) torch path: the same codes (NaN: both NaN; vLLM keeps
    the NaN's sign, we write 0x7F)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        qf = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
    x = (torch.randn(16, 256, generator=gen) * 40).to(dtype)
    x[0, :6] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 1e-30])
    for s in (torch.tensor([0.0371]), torch.tensor([1.0]), torch.tensor([0.09])):
        if dtype == torch.float32 and float(s) != 1.0:
            row = torch.zeros(1, 256)
            hard = _reciprocal_sensitive(s)[:256]
            row[0, :hard.numel()] = hard
            x = torch.cat([x, row], 0)
        ref = _u8(qf.forward_native(x, s)[0])
        ours = _u8(fp8_quantize_activation(x, s))
        nan = (ref & 0x7F) == 0x7F
        assert torch.equal(nan, (ours & 0x7F) == 0x7F)
        assert torch.equal(ours[~nan], ref[~nan]), f"scale {float(s)}"


def test_activation_triton_equals_torch(device, gen):
    from unified_models.ops.fp8.triton import fp8_quantize_activation_triton

    x = (torch.randn(70, 300, generator=gen) * 30).bfloat16()
    s = torch.tensor(0.05)
    xs = torch.randn(70, 600, generator=gen).bfloat16()
    xs[:, ::2] = x  # a strided view
    for xx in (x, xs[:, ::2]):
        got = fp8_quantize_activation_triton(xx.to(device), s.to(device)).cpu()
        assert torch.equal(_u8(got), _u8(fp8_quantize_activation_torch(x, s)))


# ---------------------------------------------------------------------------- linear


def _tol_check(out, ref, x, q):
    """|out - ref| <= 2^-7 |ref| + 2^-9 (|x_dq| @ |W_dq|^T) (bf16 rounding + fp32 accumulation)."""
    xdq = fp8_quantize_activation_torch(x, q.input_scale).double() * q.input_scale.double()
    mag = xdq.abs() @ (q.weight.double() * q.weight_scale.double()).abs().t()
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -7 + mag * 2.0 ** -9 + 1e-30
    assert bool((err <= bound).all()), f"max err {float(err.max())}, worst ratio {float((err / bound).max())}"


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_linear_vs_reference(with_bias, out_dtype, device, gen):
    from unified_models.ops.fp8.triton import fp8_linear_triton

    x, w, b = _inputs(70, gen)
    b = b if with_bias else None
    q = fp8_quantize(w, _in_scale(x, 0.7))  # some elements clamp
    ref = fp8_linear_reference(x, q, None, b, torch.float64)
    out_t = fp8_linear_torch(x, q.weight, q.weight_scale, q.input_scale, b, out_dtype)
    qd = q.to(device)
    out_k = fp8_linear_triton(x.to(device), qd.weight, qd.weight_scale, qd.input_scale,
                              None if b is None else b.to(device), out_dtype).cpu()
    for out in (out_t, out_k):
        assert out.shape == (70, N) and out.dtype == out_dtype
        _tol_check(out, ref, x, q)
    # against the plain bf16 linear: FP8 error only (a loose, independent sanity bound)
    plain = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert float((out_t.double() - plain).abs().max()) < 0.15 * float(plain.abs().max())


def test_linear_rounds_once(gen, inv):
    """CPU: the bf16 output is the fp64 value rounded once (= the fp32 output's exact value
    rounded), and the fp32 output is the fp64 ``acc * s + b`` rounded once."""
    x, w, b = _inputs(20, gen)
    q = fp8_quantize(w, _in_scale(x))
    xq = fp8_quantize_activation_torch(x, q.input_scale).double()
    s = (q.input_scale * q.weight_scale).double()
    y64 = (xq @ q.weight.double().t()) * s + b.double()
    inv.assert_bitwise(fp8_linear_torch(x, q.weight, q.weight_scale, q.input_scale, b, torch.float32),
                       y64.float(), "fp32 output")
    from unified_models.ops.linear import round_f64

    inv.assert_bitwise(fp8_linear_torch(x, q.weight, q.weight_scale, q.input_scale, b, torch.bfloat16),
                       round_f64(y64, torch.bfloat16), "bf16 output")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_interpreter_equals_torch_impl(out_dtype, device, gen, inv):
    """Under the interpreter the Triton FP8 linear is the exact e4m3 dot product with the fp64
    epilogue, i.e. the CPU torch implementation bit for bit."""
    if device != "cpu":
        pytest.skip("the interpreter path exists only on CPU (GPU tiles accumulate in fp32)")
    from unified_models.ops.fp8.triton import fp8_linear_triton

    x, w, b = _inputs(70, gen)
    x[3] = 0.0
    x[5] *= 2.0 ** -20  # underflows to e4m3 subnormals / zero
    x[6] *= 2.0 ** 10  # clamps
    q = fp8_quantize(w, _in_scale(x[:3]))
    for bias in (b, None):
        inv.assert_bitwise(fp8_linear_triton(x, q.weight, q.weight_scale, q.input_scale, bias, out_dtype),
                           fp8_linear_torch(x, q.weight, q.weight_scale, q.input_scale, bias, out_dtype),
                           "interpreter vs torch")


def _pad(k, gen):
    from invariance import Inv

    return Inv.padding(k, torch.bfloat16, gen, 50.0)


def test_torch_impl_batch_invariant(gen, inv):
    x, w, b = _inputs(37, gen)
    q = fp8_quantize(w, _in_scale(x, 0.8))
    inv.check_rows(lambda a: fp8_linear_torch(a, q.weight, q.weight_scale, q.input_scale, b, torch.bfloat16),
                   (x,), _pad(K, gen), gen, prefixes=(1, 3, 17), what="fp8_linear_torch")


def test_triton_batch_invariant(device, gen, inv):
    from unified_models.ops.fp8.triton import fp8_linear_triton

    x, w, b = _inputs(40, gen)
    q = fp8_quantize(w, _in_scale(x, 0.8)).to(device)
    bd = b.to(device)
    full = inv.check_rows(lambda a: fp8_linear_triton(a, q.weight, q.weight_scale, q.input_scale, bd,
                                                      torch.bfloat16),
                          (x.to(device),), _pad(K, gen), gen, trials=2, pad_counts=(7, 60), prefixes=(1, 17),
                          what="fp8_linear_triton")
    # rows that straddle the M tile edge (rows 40..79 of an 80-row batch)
    x80 = torch.cat([_pad(K, gen)(40)[0], x]).to(device)
    inv.assert_bitwise(fp8_linear_triton(x80, q.weight, q.weight_scale, q.input_scale, bd, torch.bfloat16)[40:],
                       full, "rows at offset 40 of an 80-row batch")


def test_triton_strided_and_errors(device, gen, inv):
    from unified_models.ops.fp8.triton import fp8_linear_triton

    x, w, b = _inputs(9, gen, k=64, n=48)
    q = fp8_quantize(w, _in_scale(x)).to(device)
    xb = torch.randn(9, 128, generator=gen).bfloat16()
    xb[:, ::2] = x
    wt = q.weight.t().contiguous().t()  # [N, K] view with strides (1, N)
    ref = fp8_linear_triton(x.to(device), q.weight, q.weight_scale, q.input_scale, None, torch.float32)
    inv.assert_bitwise(fp8_linear_triton(xb[:, ::2].to(device), wt, q.weight_scale, q.input_scale, None,
                                         torch.float32), ref, "strided")
    with pytest.raises(ValueError, match="do not match"):
        fp8_linear_triton(x[:, :10].to(device), q.weight, q.weight_scale, q.input_scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_triton(x.to(device), w.to(device), q.weight_scale, q.input_scale)
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear_triton(x.to(device), q.weight, q.weight_scale, q.input_scale.double())
    with pytest.raises(ValueError, match="bias"):
        fp8_linear_triton(x.to(device), q.weight, q.weight_scale, q.input_scale, b[:5].to(device))
    out = fp8_linear_triton(x[:0].to(device), q.weight, q.weight_scale, q.input_scale, None, torch.float32)
    assert out.shape == (0, 48)


def test_fp8weight_path_equals_master_path(gen, inv):
    """The rollout's FP8Weight (quantized once) and the trainer's master (quantized per call)
    give the same bits; FP8Weight.dequantize is the exact product rounded once."""
    x, w, b = _inputs(33, gen)
    s_x = _in_scale(x, 0.9)
    q = fp8_quantize(w, s_x)
    inv.assert_bitwise(fp8_linear(x, q, bias_N=b), fp8_linear(x, w, s_x, b), "FP8Weight vs master")
    inv.assert_bitwise(fp8_linear(x, q, out_dtype=torch.float32), fp8_linear(x, w, float(s_x), out_dtype=torch.float32),
                       "FP8Weight vs master (Python float scale)")
    deq = q.dequantize(torch.float64)
    assert torch.equal(deq, q.weight.double() * q.weight_scale.double())
    assert float((deq - w.double()).abs().max()) <= float(w.double().abs().max()) * 2.0 ** -4
    dq16 = q.dequantize(torch.bfloat16)
    assert bool(((dq16.double() - deq).abs() <= deq.abs() * 2.0 ** -8).all())  # one RNE rounding: half a bf16 ulp
    # a weight update re-quantized into the same buffers equals a fresh quantization
    w2 = (w.float() * 1.7 + 0.01).bfloat16()
    ptr = q.weight.data_ptr()
    fp8_quantize_into(q, w2)
    assert q.weight.data_ptr() == ptr
    inv.assert_bitwise(fp8_linear(x, q, bias_N=b), fp8_linear(x, w2, s_x, b), "after fp8_quantize_into")


def test_dispatch_backends_agree(monkeypatch, device, gen, inv):
    """``UM_OPS_BACKEND=triton`` (the kernels through the interpreter) and the CPU torch path give
    the same forward bits, activation codes and gradients."""
    if device != "cpu":
        pytest.skip("CPU dispatch only")
    x, w, b = _inputs(20, gen, k=64, n=40)
    s_x = _in_scale(x, 0.6)
    outs = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("UM_OPS_BACKEND", backend)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, s_x, b)
        y.float().square().sum().backward()
        outs.append((y.detach(), xr.grad, wr.grad, _u8(fp8_quantize_activation(x, s_x))))
    for a, c, what in zip(*outs, ("y", "dx", "dW", "x codes")):
        inv.assert_bitwise(a, c, what)


def test_fp8_linear_argument_errors(gen):
    x, w, _ = _inputs(4, gen, k=32, n=8)
    q = fp8_quantize(w, 0.01)
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear(x, w)
    with pytest.raises(ValueError, match="carries its input_scale"):
        fp8_linear(x, q, 0.01)
    with pytest.raises(ValueError, match="do not match"):
        fp8_linear(x[:, :16], q)
    with pytest.raises(TypeError):
        fp8_linear(x, "w", 0.01)


# ---------------------------------------------------------------------------- STE backward


def _ste_reference(x, w_master, q: FP8Weight, b, g):
    """fp64 autograd of ``x_dq W_dq^T + b`` with ModelOpt's STE: x passes where not clamped,
    W passes everywhere."""
    x64 = x.double().requires_grad_()
    w64 = w_master.double().requires_grad_() if w_master is not None else None
    b64 = b.double().requires_grad_()
    xdq = fp8_quantize_activation_torch(x, q.input_scale).double() * q.input_scale.double()
    mask = fp8_clamp_mask(x, q.input_scale)
    xs = torch.where(mask, x64, x64.detach())
    x_ste = xs + (xdq - xs).detach()
    wdq = q.weight.double() * q.weight_scale.double()
    w_ste = w64 + (wdq - w64).detach() if w64 is not None else wdq
    y = x_ste @ w_ste.t() + b64
    y.backward(g.double())
    return x64.grad, None if w64 is None else w64.grad, b64.grad


def test_ste_gradients_master(gen):
    x, w, b = _inputs(24, gen, k=64, n=40)
    s_x = _in_scale(x, 0.5)  # a good share of the activations clamp
    q = fp8_quantize(w, s_x)
    mask = fp8_clamp_mask(x, s_x)
    assert 0 < int((~mask).sum()) < mask.numel() // 2
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, s_x, br)
    assert torch.equal(y.detach().view(torch.int16), fp8_linear(x, w, s_x, b).view(torch.int16)), \
        "values with a graph differ from the no-grad values"
    g = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(g)
    dx, dw, db = _ste_reference(x, w, q, b, g)
    assert bool((xr.grad[~mask] == 0).all()), "gradient leaks through clamped activations"
    assert bool((xr.grad[mask] != 0).any())
    for got, want, what in ((xr.grad, dx, "dx"), (wr.grad, dw, "dW"), (br.grad, db, "db")):
        assert got.dtype == torch.bfloat16, what
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()), msg=what)


def test_ste_gradients_fixed_fp8_weight(gen):
    """An FP8Weight (checkpoint) gets no gradient; x and the bias do."""
    x, w, b = _inputs(12, gen, k=64, n=40)
    q = fp8_quantize(w, _in_scale(x, 0.6))
    xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
    y = fp8_linear(xr, q, bias_N=br, out_dtype=torch.float32)
    assert torch.equal(y.detach(), fp8_linear(x, q, bias_N=b, out_dtype=torch.float32))
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    dx, _, db = _ste_reference(x, None, q, b, g)
    torch.testing.assert_close(xr.grad.double(), dx, rtol=1e-2, atol=1e-2 * float(dx.abs().max()))
    torch.testing.assert_close(br.grad.double(), db, rtol=1e-2, atol=1e-3)


def test_ste_refuses_stale_master(gen):
    from unified_models.ops.autograd import StaleWeightError

    x, w, b = _inputs(4, gen, k=32, n=8)
    wr = w.clone().requires_grad_()
    y = fp8_linear(x, wr, 0.01)
    with torch.no_grad():
        wr.add_(1.0)
    with pytest.raises(StaleWeightError, match="fp8_linear"):
        y.sum().backward()


# ---------------------------------------------------------------------------- validation


def _good(n=8, k=32):
    q = fp8_quantize(torch.randn(n, k).bfloat16(), 0.02)
    return q.weight, q.weight_scale, q.input_scale


def test_validate_accepts_good_and_one_element_scales():
    w, ws, xs = _good()
    validate_fp8(w, ws, xs, name="m", shape=(8, 32))
    q = FP8Weight.from_checkpoint(w, ws.reshape(1), xs.reshape(1), name="m")
    assert q.weight_scale.dim() == 0 and q.input_scale.dim() == 0


@pytest.mark.parametrize("case,match", [
    ("no_weight", "weight is missing"),
    ("no_weight_scale", "weight_scale is missing"),
    ("no_input_scale", "input_scale is missing"),
    ("weight_bf16", "expected torch.float8_e4m3fn"),
    ("weight_1d", "must be 2-D"),
    ("weight_shape", r"expected \[8, 16\]"),
    ("weight_nan", "NaN element"),
    ("scale_bf16", "weight_scale has dtype torch.bfloat16"),
    ("scale_2", r"input_scale must be a scalar"),
    ("scale_zero", "weight_scale is zero"),
    ("scale_neg", "input_scale is negative"),
    ("scale_nan", "weight_scale is NaN"),
    ("scale_inf", "input_scale is inf"),
])
def test_validate_rejects(case, match):
    w, ws, xs = _good()
    shape = None
    if case == "no_weight":
        w = None
    elif case == "no_weight_scale":
        ws = None
    elif case == "no_input_scale":
        xs = None
    elif case == "weight_bf16":
        w = w.float().bfloat16()
    elif case == "weight_1d":
        w = w.flatten()
    elif case == "weight_shape":
        shape = (8, 16)
    elif case == "weight_nan":
        w = w.clone()
        w.view(torch.uint8)[2, 3] = 0xFF
    elif case == "scale_bf16":
        ws = ws.bfloat16()
    elif case == "scale_2":
        xs = torch.tensor([0.1, 0.2])
    elif case == "scale_zero":
        ws = torch.tensor(0.0)
    elif case == "scale_neg":
        xs = torch.tensor(-0.5)
    elif case == "scale_nan":
        ws = torch.tensor(float("nan"))
    elif case == "scale_inf":
        xs = torch.tensor(float("inf"))
    with pytest.raises(FP8Error, match=match) as e:
        validate_fp8(w, ws, xs, name="backbone.layers.3.mixer.in_proj", shape=shape)
    assert "backbone.layers.3.mixer.in_proj" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_fp8weight_checks_dtypes():
    w, ws, xs = _good()
    with pytest.raises(FP8Error, match="dtypes"):
        FP8Weight(w.float(), ws, xs)
    with pytest.raises(FP8Error, match="0-d"):
        FP8Weight(w, ws.reshape(1), xs)
    assert FP8_E4M3_MAX == 448.0
