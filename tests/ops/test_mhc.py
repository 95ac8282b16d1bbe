"""mHC ops (``unified_models.ops.mhc``): against transformers' DeepSeek-V4 modules, batch
invariance, gradients against fp64 autograd, and the contract's errors."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4ForCausalLM, DeepseekV4HyperConnection,
                                                                  DeepseekV4HyperHead)

from unified_models import ops
from unified_models.dsl import HyperConnectionSpec, SpecError
from unified_models.ops.grad.weights import StaleWeightError
from unified_models.ops.mhc import hc_head_reference, hc_post_reference, hc_pre_reference
from unified_models.ops.mhc.cpu import hc_post_torch
from unified_models.ops.mhc.reference import hc_head_math, hc_post_math, hc_pre_math

N, D, ITERS, HC_EPS, NORM_EPS = 4, 64, 20, 1e-6, 1e-6
KW = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=ITERS)
HEAD_KW = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS)
FP32_ULP = 2.0 ** -23
BF16_ULP = 2.0 ** -8


def _config(n=N, d=D):
    return DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=ITERS, hc_eps=HC_EPS, rms_norm_eps=NORM_EPS)


def _modules(seed=0, n=N, d=D):
    """transformers' HC and head modules with random (non-trivial) parameters."""
    g = torch.Generator().manual_seed(seed)
    hc, head = DeepseekV4HyperConnection(_config(n, d)), DeepseekV4HyperHead(_config(n, d))
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 2 / (n * d) ** 0.5)  # logits ~ N(0, 2^2)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g) * 0.5)
        hc.scale.copy_(1 + 0.3 * torch.randn(3, generator=g))
        head.hc_fn.copy_(torch.randn(head.hc_fn.shape, generator=g) * 2 / (n * d) ** 0.5)
        head.hc_base.copy_(torch.randn(n, generator=g) * 0.5)
        head.hc_scale.copy_(torch.tensor([1.3]))
    return hc, head


def _streams(b, s, n=N, d=D, seed=1, dtype=torch.float32):
    return torch.randn(b, s, n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pre(h_TND, hc):
    return ops.hc_pre(h_TND, hc.fn, hc.base, hc.scale, **KW)


def _head(h_TND, head):
    return ops.hc_head(h_TND, head.hc_fn, head.hc_base, head.hc_scale, **HEAD_KW)


def _bound(ulps, unit, t):
    return ulps * unit * t.abs().max().item()


# ----------------------------------------------------------------------------- peer: transformers


def test_hc_pre_post_head_match_transformers_fp32():
    """fp32, parameters copied by name. Measured max |ours - transformers| (this seed):
    collapsed input 9.5e-7 (max |x| 4.9), post 9.5e-7 (max 2.0), comb 4.2e-7 (max 0.99),
    post-update 2.1e-6 (max 6.8), head 7.2e-7 (max 5.9). Against the fp64 oracle, the
    collapsed input is 7.9e-7 off in transformers and 4.8e-7 in ours (our projection
    accumulates in fp64). Bound: 16 fp32 ulps of each output's largest magnitude."""
    hc, head = _modules()
    h = _streams(2, 37)
    y = torch.randn(2, 37, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post_tf, comb_tf, x_tf = hc(h)
        streams_tf = post_tf.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_tf.transpose(-1, -2), h)  # DecoderLayer
        head_tf = head(h)
    x, post, comb = _pre(h.reshape(-1, N, D), hc)
    streams = ops.hc_post(h.reshape(-1, N, D), y.reshape(-1, D), post, comb)
    out = _head(h.reshape(-1, N, D), head)
    assert x.dtype == h.dtype and post.dtype == comb.dtype == torch.float32
    for name, got, want in (("x", x, x_tf), ("post", post, post_tf), ("comb", comb, comb_tf),
                            ("post-update", streams, streams_tf), ("head", out, head_tf)):
        want = want.reshape(got.shape)
        err, bound = (got - want).abs().max().item(), _bound(16, FP32_ULP, want)
        assert err <= bound, (name, err, bound)
    # columns are normalised last (sums 1 within rounding); with these spiky logits 20 iterations
    # leave the row sums within 7% of 1 (measured 0.067; transformers gives the same matrix)
    assert (comb.sum(-2) - 1).abs().max() < 1e-5 and (comb.sum(-1) - 1).abs().max() < 0.1
    assert post.min() > 0 and post.max() < 2


def test_hc_bf16_streams_match_transformers_rounding_points():
    """bf16 streams, fp32 parameters (transformers keeps ``*_hc`` / ``hc_head`` in fp32): the
    collapsed input, the post-update (``post.to(bf16) * y + matmul(comb.to(bf16)^T, h)``) and the
    head round at transformers' points, so they differ from it by at most one bf16 rounding of
    the same fp32 value (measured: at most 1 ulp, in a few elements)."""
    hc, head = _modules(seed=3)
    h = _streams(3, 20, seed=4, dtype=torch.bfloat16)
    y = torch.randn(3, 20, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        post_tf, comb_tf, x_tf = hc(h)
        dt = h.dtype
        streams_tf = post_tf.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_tf.to(dt).transpose(-1, -2), h)
        head_tf = head(h)
    x, post, comb = _pre(h.reshape(-1, N, D), hc)
    streams = ops.hc_post(h.reshape(-1, N, D), y.reshape(-1, D), post, comb)
    out = _head(h.reshape(-1, N, D), head)
    for name, got, want in (("x", x, x_tf), ("post-update", streams, streams_tf), ("head", out, head_tf)):
        want = want.reshape(got.shape)
        assert got.dtype == torch.bfloat16
        ulp = torch.maximum(want.float().abs(), got.float().abs()) * BF16_ULP  # one bf16 step (<= 2^-8 relative)
        excess = ((got.float() - want.float()).abs() - ulp).max().item()
        assert excess <= 0, (name, excess)
        assert (got == want).float().mean() > 0.99, name  # measured: all bitwise equal (this seed)


def test_hc_ops_match_fp64_oracle():
    """Our fp32 path against the fp64 oracle: within 4 fp32 ulps of the largest magnitude."""
    hc, head = _modules(seed=6)
    h = _streams(1, 50, seed=7).reshape(-1, N, D)
    y = torch.randn(50, D, generator=torch.Generator().manual_seed(8))
    got = _pre(h, hc)
    want = hc_pre_reference(h, hc.fn, hc.base, hc.scale, **KW)
    for g_, w_ in zip(got, want):
        assert (g_ - w_).abs().max().item() <= _bound(4, FP32_ULP, w_)
    upd, upd_ref = ops.hc_post(h, y, got[1], got[2]), hc_post_reference(h, y, got[1], got[2])
    assert (upd - upd_ref).abs().max().item() <= _bound(4, FP32_ULP, upd_ref)
    out, out_ref = _head(h, head), hc_head_reference(h, head.hc_fn, head.hc_base, head.hc_scale, **HEAD_KW)
    assert (out - out_ref).abs().max().item() <= _bound(4, FP32_ULP, out_ref)


def test_spec_parameter_names_and_shapes_are_transformers():
    """``HyperConnectionSpec.parameter_shapes()`` = the ``*hc*`` tensors of transformers'
    ``DeepseekV4ForCausalLM`` (names and shapes), for a 2-layer model."""
    cfg = DeepseekV4Config(vocab_size=128, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=16,
                           o_groups=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           index_n_heads=2, index_head_dim=16, index_topk=4, num_hash_layers=0,
                           num_nextn_predict_layers=0, hc_mult=N)
    import tempfile

    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as d:  # the names save_pretrained writes (the published layout's)
        DeepseekV4ForCausalLM(cfg).save_pretrained(d)
        with safe_open(f"{d}/model.safetensors", "pt") as f:
            saved = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if "hc" in n}
    order = ([f"model.layers.{i}.hc_{s}_{p}" for i in range(2) for s in ("attn", "ffn") for p in ("fn", "base", "scale")]
             + [f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")])
    want = {n: saved[n] for n in order}
    assert set(want) == set(saved)
    sites = tuple((f"model.layers.{i}.{norm}", f"model.layers.{i}.{hc}") for i in range(2)
                  for norm, hc in (("input_layernorm", "hc_attn"), ("post_attention_layernorm", "hc_ffn")))
    spec = HyperConnectionSpec(hc_mult=N, hidden_size=D, sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS,
                               sites=sites)
    assert spec.parameter_shapes() == want
    assert list(spec.parameter_shapes()) == list(want)  # same order too
    with pytest.raises(SpecError, match=r"HC module name\(s\) given twice: model.layers.0.hc_attn"):
        HyperConnectionSpec(hc_mult=N, hidden_size=D, sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS,
                            sites=(("a", "model.layers.0.hc_attn"), ("b", "model.layers.0.hc_attn")))
    with pytest.raises(SpecError, match="sinkhorn_iters must be >= 1"):
        HyperConnectionSpec(hc_mult=N, hidden_size=D, sinkhorn_iters=0, hc_eps=HC_EPS, norm_eps=NORM_EPS, sites=sites)


# ----------------------------------------------------------------------------- batch invariance


def _pad(n, d, dtype, gen):
    def f(k):
        rows = torch.randn(k, n, d, generator=gen) * 300.0
        rows[: k // 2] = 0.0
        return (rows.to(dtype),)
    return f


@pytest.mark.parametrize("n,dtype", [(4, torch.bfloat16), (4, torch.float32), (3, torch.bfloat16)])
def test_hc_pre_and_head_are_batch_invariant(inv, n, dtype):
    """Row results bitwise independent of the other rows and the batch size (random compositions
    with zero and large junk padding); n = 3 exercises the wider tiles of odd stream counts."""
    hc, head = _modules(seed=9, n=n)
    gen = torch.Generator().manual_seed(10)
    h = _streams(1, 45, n=n, seed=11, dtype=dtype).reshape(-1, n, D)

    def pre(x):
        a, p, c = _pre(x, hc)
        return torch.cat([a.float(), p, c.flatten(1)], dim=1)  # bf16 -> fp32 is exact

    inv.check_rows(pre, (h,), _pad(n, D, dtype, gen), gen, trials=4, what=f"hc_pre n={n} {dtype}")
    inv.check_rows(lambda x: _head(x, head), (h,), _pad(n, D, dtype, gen), gen, trials=4, what=f"hc_head n={n}")


def test_hc_post_is_batch_invariant(inv):
    hc, _ = _modules(seed=12)
    gen = torch.Generator().manual_seed(13)
    h = _streams(1, 40, seed=14, dtype=torch.bfloat16).reshape(-1, N, D)
    y = torch.randn(40, D, generator=gen).to(torch.bfloat16)
    _, post, comb = _pre(h, hc)

    def pad(k):
        return (torch.randn(k, N, D, generator=gen).bfloat16(), torch.randn(k, D, generator=gen).bfloat16(),
                torch.rand(k, N, generator=gen), torch.rand(k, N, N, generator=gen))

    inv.check_rows(ops.hc_post, (h, y, post, comb), pad, gen, trials=4, what="hc_post")


# ----------------------------------------------------------------------------- gradients


def _leaves(dtype, seed=15):
    hc, head = _modules(seed=seed)
    h = _streams(1, 12, seed=seed + 1).reshape(-1, N, D)
    y = torch.randn(12, D, generator=torch.Generator().manual_seed(seed + 2))
    ts = (h, y, hc.fn.detach(), hc.base.detach(), hc.scale.detach(), head.hc_fn.detach(), head.hc_base.detach(),
          head.hc_scale.detach())
    return [t.clone().to(dtype).requires_grad_(True) for t in ts]


def _block(h, y, fn, base, scale, hfn, hbase, hscale, pre, post, head):
    """One sublayer under mHC (its output ``y`` added to the collapsed input) and the head."""
    x, p, c = pre(h, fn, base, scale)
    return head(post(h, x + y, p, c), hfn, hbase, hscale)


def test_hc_gradients_match_fp64_autograd():
    """The engine ops' backward (fp32 recomputation) against autograd of the fp64 formulas, for
    every input; the fp64 formulas themselves pass ``torch.autograd.gradcheck``."""
    leaves32 = _leaves(torch.float32)
    leaves64 = _leaves(torch.float64)
    w = torch.randn(12, D, generator=torch.Generator().manual_seed(20), dtype=torch.float64)
    eng = _block(*leaves32, lambda *t: ops.hc_pre(*t, **KW), ops.hc_post, lambda *t: ops.hc_head(*t, **HEAD_KW))
    (eng.double() * w).sum().backward()
    ref = _block(*leaves64, lambda *t: hc_pre_math(*t, NORM_EPS, HC_EPS, ITERS), hc_post_math,
                 lambda *t: hc_head_math(*t, NORM_EPS, HC_EPS))
    (ref * w).sum().backward()
    names = ("h", "y", "fn", "base", "scale", "hc_fn", "hc_base", "hc_scale")
    for name, a, b in zip(names, leaves32, leaves64):
        assert a.grad is not None and a.grad.dtype == torch.float32, name
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err <= 1e-4 * b.grad.abs().max().item(), (name, err, b.grad.abs().max().item())
        assert b.grad.abs().max() > 0, name
    # gradcheck of the fp64 formulas on a tiny case (n = 2, D = 3, 2 tokens, 5 iterations)
    g = torch.Generator().manual_seed(21)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    h, y, fn, base, scale = r(2, 2, 3), r(2, 3), r(8, 6), r(8), r(3)
    assert torch.autograd.gradcheck(lambda *t: hc_pre_math(*t, NORM_EPS, HC_EPS, 5), (h, fn, base, scale))
    assert torch.autograd.gradcheck(hc_post_math, (h, y, r(2, 2), r(2, 2, 2)))
    assert torch.autograd.gradcheck(lambda *t: hc_head_math(*t, NORM_EPS, HC_EPS), (h, r(2, 6), r(2), r(1)))


def test_hc_backward_values_are_the_forward_and_weights_are_guarded():
    h, y, fn, base, scale, *_ = _leaves(torch.bfloat16)
    with torch.no_grad():
        plain = ops.hc_pre(h, fn, base, scale, **KW)
    graphed = ops.hc_pre(h, fn, base, scale, **KW)
    for a, b in zip(plain, graphed):
        assert torch.equal(a, b)  # the visible values are the op's, bitwise
    loss = graphed[0].float().sum() + graphed[2].sum()
    with torch.no_grad():
        fn.add_(1.0)
    with pytest.raises(StaleWeightError, match="hc_pre"):
        loss.backward()


# ----------------------------------------------------------------------------- errors


def test_hc_errors_name_what_is_wrong(monkeypatch):
    hc, head = _modules()
    h = _streams(1, 3).reshape(-1, N, D)
    with pytest.raises(ValueError, match=r"hc_pre: fn has shape \(24, 256\), expected \(15, 192\)"):
        ops.hc_pre(h[:, :3], hc.fn, hc.base, hc.scale, **KW)
    with pytest.raises(ValueError, match="sinkhorn_iters must be >= 1"):
        ops.hc_pre(h, hc.fn, hc.base, hc.scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=0)
    with pytest.raises(ValueError, match=r"hc_post: y has shape \(2, 64\), expected \(3, 64\)"):
        ops.hc_post(h, h[:2, 0], torch.ones(3, N), torch.ones(3, N, N))
    with pytest.raises(ValueError, match=r"hc_head: hc_scale has shape \(3,\)"):
        ops.hc_head(h, head.hc_fn, head.hc_base, hc.scale, **HEAD_KW)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")  # what a CUDA tensor takes: the kernels' own checks
    h16 = h.half()
    with pytest.raises(ValueError, match=r"hc_pre_triton: the Triton kernel takes bf16 or fp32 streams"):
        ops.hc_pre(h16, hc.fn, hc.base, hc.scale, **KW)
    with pytest.raises(ValueError, match=r"hc_post_triton: the Triton kernel takes bf16 or fp32 streams"):
        ops.hc_post(h16, h16[:, 0], torch.ones(3, N), torch.ones(3, N, N))
    with pytest.raises(ValueError, match=r"hc_head_triton: the Triton kernel takes bf16 or fp32 streams"):
        ops.hc_head(h16, head.hc_fn, head.hc_base, head.hc_scale, **HEAD_KW)
    with pytest.raises(ValueError, match=r"hc_pre_triton: the streams have hidden size 0"):
        ops.hc_pre(h[:, :, :0], hc.fn[:, :0], hc.base, hc.scale, **KW)


# ----------------------------------------------------------------------------- Triton kernels
# Through the interpreter on CPU (natively on CUDA). D = 80 crosses the interpreter's tiles: the
# projection's 64-column chunks (two per stream, the second masked) and the 64-column output
# blocks of the collapse and the post; 45 + 40 padding rows cross the 64-row tiles.

TD = 80


@pytest.fixture
def kdev(monkeypatch, device):
    """The device of the Triton kernels, with the Triton backend forced (CPU: the interpreter)."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    return device


def _on(dev, *ts):
    return [t.detach().to(dev) for t in ts]


def _bf16_step(v):
    """The spacing of bf16 values at ``|v|`` (fp64): ``2^(floor(log2 |v|) - 7)``, between 2^-8 and 2^-7 of ``|v|``."""
    _, e = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), e - 8)


def _collapse_terms(h, fn, base, scale):
    """fp64 ``sum_j |pre_j h_j|`` (``pre = sigmoid(rms(h) fn[:n]^T scale + base[:n]) + eps``): the size
    the fp32 errors of a collapse are relative to."""
    n = h.shape[1]
    flat = h.double().reshape(h.shape[0], -1)
    mix = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS) @ fn.detach().double()[:n].t()
    pre = torch.sigmoid(mix * float(scale.detach()) + base.detach().double()[:n]) + HC_EPS
    return (pre.unsqueeze(-1) * h.double().abs()).sum(1)


@pytest.mark.parametrize("n,dtype", [(4, torch.float32), (4, torch.bfloat16), (3, torch.bfloat16)])
def test_triton_hc_ops_match_fp64_oracle(kdev, inv, n, dtype):
    """The kernels against the fp64 oracle. fp32 streams: x, the post-update and the head within
    16 fp32 ulps of the largest magnitude, post / comb within 2e-6 absolute (interpreter measured:
    x 4.8e-7 of max 5.1, post 2.4e-7, comb 1.8e-7; the GPU's approximate exp adds a few ulps).
    bf16: x and head within one bf16 step of the oracle (plus 1e-5 of the collapse's term sizes:
    fp32 coefficients; measured: x bitwise the oracle's, head one step off in one element),
    the post-update within three bf16 roundings of its terms of the oracle at the rounded
    coefficients and within one bf16 step of the CPU path (same rounding points). Run twice:
    bitwise the same (deterministic)."""
    hc, head = _modules(seed=30 + n, n=n, d=TD)
    h = _streams(1, 24, n=n, d=TD, seed=31, dtype=dtype).reshape(-1, n, TD)
    y = torch.randn(24, TD, generator=torch.Generator().manual_seed(32)).to(dtype)
    fn, base, scale, hfn, hbase, hscale = _on(kdev, hc.fn, hc.base, hc.scale, head.hc_fn, head.hc_base, head.hc_scale)
    hd, yd = h.to(kdev), y.to(kdev)
    x, post, comb = (t.cpu() for t in ops.hc_pre(hd, fn, base, scale, **KW))
    again = ops.hc_pre(hd, fn, base, scale, **KW)
    for a, b in zip((x, post, comb), again):
        inv.assert_bitwise(a, b.cpu(), "hc_pre run twice")
    upd = ops.hc_post(hd, yd, post.to(kdev), comb.to(kdev)).cpu()
    out = ops.hc_head(hd, hfn, hbase, hscale, **HEAD_KW).cpu()
    assert x.dtype == upd.dtype == out.dtype == dtype and post.dtype == comb.dtype == torch.float32
    xr, pr, cr = hc_pre_reference(h, hc.fn, hc.base, hc.scale, **KW)
    assert (post - pr).abs().max().item() <= 2e-6 and (comb - cr).abs().max().item() <= 2e-6
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # columns normalised last
    upd_ref = hc_post_reference(h, y, post, comb)
    out_ref = hc_head_reference(h, head.hc_fn, head.hc_base, head.hc_scale, **HEAD_KW)
    if dtype == torch.float32:
        for name, got, want in (("x", x, xr), ("post-update", upd, upd_ref), ("head", out, out_ref)):
            err, bound = (got - want).abs().max().item(), _bound(16, FP32_ULP, want)
            assert err <= bound, (name, err, bound)
        return
    # x and head: one bf16 rounding of an fp32 value whose error is relative to the terms
    # |pre_j h_j| (fp32 coefficients and adds; cancellation makes it large against the sum)
    terms = {"x": _collapse_terms(h, hc.fn, hc.base, hc.scale[0]),
             "head": _collapse_terms(h, head.hc_fn, head.hc_base, head.hc_scale[0])}
    for name, got, want in (("x", x, xr), ("head", out, out_ref)):
        ulp = _bf16_step(torch.maximum(want.double().abs(), got.double().abs()))
        excess = ((got.double() - want.double()).abs() - ulp - 1e-5 * terms[name]).max().item()
        assert excess <= 0, (name, excess)
    # the post-update rounds post / comb, post * y and comb^T h to bf16 first (transformers' points):
    # against the oracle at the rounded coefficients, three bf16 roundings of terms bounded by
    # |post_k y| + sum_j |comb_jk h_j| (each <= 2^-9 of it)
    pq, cq = post.to(dtype).double(), comb.to(dtype).double()
    at_rounded = hc_post_reference(h, y, pq, cq).double()
    size = pq.abs().unsqueeze(-1) * y.double().abs().unsqueeze(1) + cq.abs().transpose(-1, -2) @ h.double().abs()
    excess = ((upd.double() - at_rounded).abs() - 2 * BF16_ULP * size).max().item()
    assert excess <= 0, ("post-update", excess)
    if not upd.is_cuda:  # the interpreter runs the CPU path's arithmetic: within one bf16 step of it, nearly
        # always equal (on the H200 the kernel's FMA contractions move roundings: 2 steps measured; the
        # oracle bound above is the contract there)
        upd_cpu = hc_post_torch(h, y, post, comb)
        ulp = torch.maximum(upd_cpu.float().abs(), upd.float().abs()) * BF16_ULP
        assert ((upd.float() - upd_cpu.float()).abs() - ulp).max().item() <= 0
        assert (upd == upd_cpu).float().mean() > 0.99


@pytest.mark.parametrize("n,dtype", [(4, torch.bfloat16), (3, torch.float32)])
def test_triton_hc_pre_and_head_are_batch_invariant(kdev, inv, n, dtype):
    """The kernels' rows bitwise independent of the batch: alone, prefixes, splits, random subsets
    in random order with zero and large junk padding rows (T from 1 to 85)."""
    hc, head = _modules(seed=40, n=n, d=TD)
    gen = torch.Generator().manual_seed(41)
    h = _streams(1, 45, n=n, d=TD, seed=42, dtype=dtype).reshape(-1, n, TD).to(kdev)
    fn, base, scale, hfn, hbase, hscale = _on(kdev, hc.fn, hc.base, hc.scale, head.hc_fn, head.hc_base, head.hc_scale)

    def pre(x):
        a, p, c = ops.hc_pre(x, fn, base, scale, **KW)
        return torch.cat([a.float(), p, c.flatten(1)], dim=1)

    def pad(k):
        return tuple(t.to(kdev) for t in _pad(n, TD, dtype, gen)(k))

    inv.check_rows(pre, (h,), pad, gen, trials=2, pad_counts=(40, 5), what=f"triton hc_pre n={n} {dtype}")
    if n == 4:
        inv.check_rows(lambda x: ops.hc_head(x, hfn, hbase, hscale, **HEAD_KW), (h,), pad, gen, trials=2,
                       pad_counts=(40, 5), what="triton hc_head")


def test_triton_hc_post_is_batch_invariant(kdev, inv):
    gen = torch.Generator().manual_seed(43)
    h = _streams(1, 45, d=TD, seed=44, dtype=torch.bfloat16).reshape(-1, N, TD).to(kdev)
    y = torch.randn(45, TD, generator=gen).bfloat16().to(kdev)
    post, comb = (torch.rand(45, N, generator=gen) * 2).to(kdev), torch.rand(45, N, N, generator=gen).to(kdev)

    def pad(k):
        return tuple(t.to(kdev) for t in (torch.randn(k, N, TD, generator=gen).bfloat16() * 300,
                                          torch.randn(k, TD, generator=gen).bfloat16(), torch.rand(k, N, generator=gen),
                                          torch.rand(k, N, N, generator=gen)))

    inv.check_rows(ops.hc_post, (h, y, post, comb), pad, gen, trials=2, pad_counts=(40, 5), what="triton hc_post")
