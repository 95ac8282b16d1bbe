"""relu2 / swiglu: Triton kernels and CPU implementations vs fp64 oracles, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.activations import relu2_reference, relu2_torch, swiglu_reference, swiglu_torch

F = 176

# sigmoid of large-magnitude padding rows overflows exp() in the interpreter (harmless: sigmoid -> 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _x(T, dtype, gen, scale=4.0):
    return (torch.randn(T, F, generator=gen) * scale).to(dtype)


def _pad(n_inputs, dtype, gen):
    def f(n):
        return tuple((torch.randn(n, F, generator=gen) * 30.0).to(dtype) for _ in range(n_inputs))
    return f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_relu2_triton(dtype, device, gen, inv):
    from unified_models.ops.activations.triton import relu2_triton

    x = _x(29, dtype, gen)
    out = inv.check_rows(lambda a: relu2_triton(a), (x.to(device),), _pad(1, dtype, gen), gen, what="relu2_triton")
    assert out.dtype == dtype
    # relu and a square rounded once from fp32 are exact in fp32 and correctly rounded in bf16
    inv.assert_bitwise(out.cpu(), relu2_reference(x), "relu2_triton vs reference")
    assert (out.cpu()[x <= 0] == 0).all() and (out.cpu()[x > 0] > 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_triton(dtype, device, gen, inv):
    from unified_models.ops.activations.triton import swiglu_triton

    g, u = _x(29, dtype, gen), _x(29, dtype, gen)
    out = inv.check_rows(lambda a, b: swiglu_triton(a, b), (g.to(device), u.to(device)), _pad(2, dtype, gen), gen,
                         what="swiglu_triton")
    assert out.dtype == dtype
    exact = g.double() * torch.sigmoid(g.double()) * u.double()
    tol = dict(rtol=1e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.cpu().double(), exact, **tol)
    torch.testing.assert_close(out.cpu().double(), swiglu_reference(g, u).double(), **tol)


def test_activations_noncontiguous(device, gen, inv):
    from unified_models.ops.activations.triton import relu2_triton, swiglu_triton

    gu = _x(11, torch.bfloat16, gen).repeat(1, 2).to(device)
    g, u = gu[:, :F], gu[:, F:] * 0.5  # g is a strided view
    inv.assert_bitwise(swiglu_triton(g, u), swiglu_triton(g.contiguous(), u.contiguous()), "swiglu strided")
    inv.assert_bitwise(relu2_triton(g), relu2_triton(g.contiguous()), "relu2 strided")


def test_activation_errors(device):
    from unified_models.ops.activations.triton import relu2_triton, swiglu_triton

    with pytest.raises(ValueError, match="differ"):
        swiglu_triton(torch.zeros(2, 4, device=device), torch.zeros(2, 5, device=device))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        relu2_triton(torch.zeros(2, 4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_impls(dtype, gen, inv):
    x, g, u = _x(37, dtype, gen), _x(37, dtype, gen), _x(37, dtype, gen)
    r = inv.check_rows(relu2_torch, (x,), _pad(1, dtype, gen), gen, what="relu2_torch")
    inv.assert_bitwise(r, relu2_reference(x), "relu2_torch vs reference")
    s = inv.check_rows(swiglu_torch, (g, u), _pad(2, dtype, gen), gen, what="swiglu_torch")
    tol = dict(rtol=1e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.double(), g.double() * torch.sigmoid(g.double()) * u.double(), **tol)
