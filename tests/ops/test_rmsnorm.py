"""RMSNorm: Triton kernel and CPU implementation vs the fp64 oracle, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.rmsnorm import rms_norm_reference, rms_norm_torch

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
