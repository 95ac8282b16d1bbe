"""RMSNorm: Triton kernel and CPU implementation vs the fp64 oracle, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.rmsnorm import add_rms_norm_reference, rms_norm_reference, rms_norm_torch

EPS = 1e-5


def _inputs(T, D, dtype, gen, scale=3.0):
    x = (torch.randn(T, D, generator=gen) * scale).to(dtype)
    w = (1.0 + 0.5 * torch.randn(D, generator=gen)).to(dtype)
    return x, w


def _pad(D, dtype, gen):
    from invariance import Inv

    return Inv.padding(D, dtype, gen, 100.0)


def _tol(out_dtype):
    return dict(rtol=1e-2, atol=1e-5) if out_dtype != torch.float32 else dict(rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("D", [64, 200])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
def test_triton_vs_reference(D, dtype, out_dtype, device, gen):
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    x, w = _inputs(23, D, dtype, gen)
    out = rms_norm_triton(x.to(device), w.to(device), EPS, out_dtype)
    assert out.dtype == out_dtype and out.shape == (23, D)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    torch.testing.assert_close(out.cpu().double(), exact, **_tol(out_dtype))
    # the rounded oracle agrees too (within one rounding)
    torch.testing.assert_close(out.cpu().double(), rms_norm_reference(x, w, EPS, out_dtype).double(), **_tol(out_dtype))


def test_triton_rounds_once_to_nearest_even(device, gen, inv):
    """bf16 output == the fp32 output rounded by torch (RTNE): one rounding, no truncation."""
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    x, w = _inputs(16, 200, torch.bfloat16, gen)
    xd, wd = x.to(device), w.to(device)
    inv.assert_bitwise(rms_norm_triton(xd, wd, EPS, torch.bfloat16),
                       rms_norm_triton(xd, wd, EPS, torch.float32).to(torch.bfloat16), "bf16 vs fp32->bf16")


@pytest.mark.parametrize("D", [64, 200])
def test_triton_batch_invariant(D, device, gen, inv):
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    x, w = _inputs(31, D, torch.bfloat16, gen)
    wd = w.to(device)
    inv.check_rows(lambda a: rms_norm_triton(a, wd, EPS, torch.bfloat16), (x.to(device),),
                   _pad(D, torch.bfloat16, gen), gen, what=f"rms_norm_triton D={D}")


def test_triton_strided_input(device, gen, inv):
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    x, w = _inputs(12, 2 * 96, torch.bfloat16, gen)
    xs = x.to(device)[:, ::2]
    wd = w[:96].to(device)
    inv.assert_bitwise(rms_norm_triton(xs, wd, EPS, torch.bfloat16),
                       rms_norm_triton(xs.contiguous(), wd, EPS, torch.bfloat16), "strided vs contiguous")


def test_triton_errors(device):
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(torch.zeros(2, 8, device=device), torch.zeros(9, device=device), EPS, torch.float32)
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        rms_norm_triton(torch.zeros(8, device=device), torch.zeros(8, device=device), EPS, torch.float32)
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        rms_norm_triton(torch.zeros(2, 8, dtype=torch.int32, device=device), torch.zeros(8, device=device), EPS,
                        torch.float32)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_torch_impl_vs_reference_and_invariant(dtype, out_dtype, gen, inv):
    D = 128
    x, w = _inputs(37, D, dtype, gen)
    full = inv.check_rows(lambda a: rms_norm_torch(a, w, EPS, out_dtype), (x,), _pad(D, dtype, gen), gen,
                          pad_counts=(0, 5, 40), what="rms_norm_torch")
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    torch.testing.assert_close(full.double(), exact, **_tol(out_dtype))


# ------------------------------------------------------------------ fused residual add + RMSNorm

def _stream(T, D, dtype, gen):
    """A residual stream and a sublayer update of very different scales (the add rounds)."""
    r = (torch.randn(T, D, generator=gen) * 40.0).to(dtype)
    u = (torch.randn(T, D, generator=gen) * 0.3).to(dtype)
    return r, u


@pytest.mark.parametrize("D", [64, 200, 2688])
@pytest.mark.parametrize("stream,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_add_rms_norm_is_add_then_norm(D, stream, out_dtype, device, gen, inv):
    """The fused kernel's two outputs are bitwise torch's ``r + u`` and the plain norm kernel of it
    (natively on CUDA: the H200's reduction; ``tests/test_sm90_lowering.py`` checks its layout)."""
    from unified_models.ops.rmsnorm.triton import add_rms_norm_triton, rms_norm_triton

    r, u = _stream(9, D, stream, gen)
    w = (1.0 + 0.5 * torch.randn(D, generator=gen)).to(torch.bfloat16).to(device)
    r, u = r.to(device), u.to(device)
    s, y = add_rms_norm_triton(r, u, w, EPS, out_dtype)
    assert s.dtype == stream and y.dtype == out_dtype
    inv.assert_bitwise(s, r + u, f"stream D={D}")
    assert not torch.equal(s, r), "the update must change the stream"
    inv.assert_bitwise(y, rms_norm_triton(r + u, w, EPS, out_dtype), f"norm D={D}")
    s_ref, y_ref = add_rms_norm_reference(r.cpu(), u.cpu(), w.cpu(), EPS, out_dtype)
    inv.assert_bitwise(s.cpu(), s_ref, "stream vs the exact sum rounded once")
    torch.testing.assert_close(y.cpu().double(), y_ref.double(), **_tol(out_dtype))


def test_add_rms_norm_strided_and_batch_invariant(device, gen, inv):
    from unified_models.ops.rmsnorm.triton import add_rms_norm_triton

    r, u = _stream(21, 2 * 96, torch.bfloat16, gen)
    w = torch.ones(96, dtype=torch.bfloat16, device=device)
    rs, us = r.to(device)[:, ::2], u.to(device)[:, 1::2]
    s, y = add_rms_norm_triton(rs, us, w, EPS, torch.bfloat16)
    s_c, y_c = add_rms_norm_triton(rs.contiguous(), us.contiguous(), w, EPS, torch.bfloat16)
    inv.assert_bitwise(s, s_c, "strided stream"), inv.assert_bitwise(y, y_c, "strided norm")
    inv.check_rows(lambda a, b: torch.cat(add_rms_norm_triton(a, b, w, EPS, torch.bfloat16), dim=1),
                   (rs.contiguous(), us.contiguous()), lambda n: _pad(96, torch.bfloat16, gen)(n) * 2, gen,
                   what="add_rms_norm_triton")


def test_add_rms_norm_errors_and_empty(device):
    from unified_models.ops.rmsnorm import add_rms_norm
    from unified_models.ops.rmsnorm.triton import add_rms_norm_triton

    a = torch.zeros(3, 8, device=device)
    with pytest.raises(ValueError, match="must match the residual"):
        add_rms_norm_triton(a, a.to(torch.bfloat16), torch.ones(8, device=device), EPS)
    with pytest.raises(ValueError, match="must match the residual"):
        add_rms_norm_triton(a, a[:2], torch.ones(8, device=device), EPS)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm_triton(a, a, torch.ones(9, device=device), EPS)
    with pytest.raises(ValueError, match=r"must match the \[T, D\] residual"):
        add_rms_norm(a.cpu(), a.cpu().double(), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(a.cpu(), a.cpu(), torch.ones(9), EPS)
    s, y = add_rms_norm_triton(a[:0], a[:0], torch.ones(8, device=device), EPS)
    assert s.shape == y.shape == (0, 8)


@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float32])
def test_add_rms_norm_torch_is_add_then_norm(stream, gen, inv):
    from unified_models.ops.rmsnorm import add_rms_norm_torch

    r, u = _stream(37, 300, stream, gen)
    w = (1.0 + 0.5 * torch.randn(300, generator=gen)).to(stream)
    s, y = add_rms_norm_torch(r, u, w, EPS, stream)
    inv.assert_bitwise(s, r + u, "stream")
    inv.assert_bitwise(y, rms_norm_torch(r + u, w, EPS, stream), "norm")


@pytest.mark.parametrize("stream", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("use_stream", [True, False])
def test_add_rms_norm_gradients_are_the_unfused_ones(stream, use_stream, gen, inv):
    """The fused op's autograd gives the gradients (bitwise) of ``r + u`` then ``rms_norm``, whether
    the new stream is used further (the next add) or only its norm (the last sublayer)."""
    from unified_models import ops

    r, u = _stream(19, 72, stream, gen)
    w = (1.0 + 0.5 * torch.randn(72, generator=gen)).to(stream)
    g_s, g_y = torch.randn(19, 72, generator=gen).to(stream), torch.randn(19, 72, generator=gen).to(stream)

    def grads(fused):
        leaves = [t.clone().requires_grad_(True) for t in (r, u, w)]
        if fused:
            s, y = ops.add_rms_norm(*leaves, EPS, out_dtype=stream)
        else:
            s = leaves[0] + leaves[1]
            y = ops.rms_norm(s, leaves[2], EPS, out_dtype=stream)
        loss = (y.float() * g_y.float()).sum() + ((s.float() * g_s.float()).sum() if use_stream else 0.0)
        loss.backward()
        return s.detach(), y.detach(), [t.grad for t in leaves]

    s_f, y_f, g_f = grads(True)
    s_u, y_u, g_u = grads(False)
    inv.assert_bitwise(s_f, s_u, "stream"), inv.assert_bitwise(y_f, y_u, "norm")
    for name, a, b in zip(("residual", "update", "weight"), g_f, g_u):
        inv.assert_bitwise(a, b, f"d{name}")
    assert float(g_f[0].float().abs().sum()) > 0


def test_add_rms_norm_gradients_vs_fp64():
    """The fused op's gradients (fp32 math) against fp64 autograd of ``s = r + u``, ``y = s r(s) w``."""
    from unified_models.ops.rmsnorm.backward import AddRMSNormFn

    gen = torch.Generator().manual_seed(5)
    r, u, w = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((5, 40), (5, 40), (40,)))
    g_s, g_y = torch.randn(5, 40, generator=gen, dtype=torch.float64), torch.randn(5, 40, generator=gen,
                                                                                  dtype=torch.float64)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (r, u, w)]
        s, y = fn(*leaves)
        torch.autograd.backward((s, y), (g_s.to(dtype), g_y.to(dtype)))
        return [t.grad.double() for t in leaves]

    def exact(a, b, c):
        s = a + b
        return s, s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * c

    got = grads(lambda a, b, c: AddRMSNormFn.apply(a, b, c, EPS, torch.float32), torch.float32)
    for name, a, b in zip(("residual", "update", "weight"), got, grads(exact, torch.float64)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")
