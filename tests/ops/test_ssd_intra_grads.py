"""The fused intra-chunk SSD backward (``ops/mamba2/ssd_intra_grads.py``): through the Triton interpreter on the
CPU, natively on CUDA (``scripts/gpu-run.sh mamba-backward`` runs this file there).

Checked: the kernels against the torch form they replace (``ssd_backward._intra_chunk_grads`` on the
emulated tensor-core path: bf16 terms, exact products, fp32 sums), several row tiles (Q = 128: two 64-row
tiles), a chunk that is no power of two and widths below ``tl.dot``'s 16 (masked tiles), groups of 1 and 2
heads, zero rows past a sequence's end; the whole scan backward on the fused path against fp64 autograd
(the tensor-core bound, 5e-5, as the torch form's test); ``UM_BACKWARD_GEMM=bf16`` honoured (one term:
a larger, bounded error); bad input refused.
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.mamba2 import ssd_chunked_torch_batched
from unified_models.ops.mamba2 import ssd_backward
from unified_models.ops.mamba2.ssd_intra_grads import ssd_intra_chunk_grads

from tensor_cores import emulate_tensor_cores


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(35)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _emulated_torch_form(monkeypatch):
    """``ssd_backward``'s GEMMs through ``grad_matmul``'s CUDA path, the bf16 GEMM emulated on the CPU."""
    emulate_tensor_cores(monkeypatch, ssd_backward)


def _inputs(gen, device, U, H, G, Q, P, N, bf16_bc=False):
    x = torch.randn(U, H, Q, P, generator=gen)
    dt = torch.rand(U, H, Q, generator=gen) * 0.3 + 0.01
    A = -torch.tensor([1.0, 2.0, 4.0, 8.0] * (H // 4 + 1))[:H]
    B, C = (torch.randn(U, G, Q, N, generator=gen) * 0.5 for _ in range(2))
    if bf16_bc:
        B, C = B.bfloat16().float(), C.bfloat16().float()
    x[-1, :, Q // 3:] = 0  # the last chunk: rows past a sequence's end
    dt[-1, :, Q // 3:] = 0
    B[-1, :, Q // 3:] = 0
    C[-1, :, Q // 3:] = 0
    acum = torch.cumsum(dt.double() * A.double()[:, None], dim=-1)
    xd = x * dt[..., None]
    gy = torch.randn(U, H, Q, P, generator=gen)
    return tuple(t.contiguous().to(device) for t in (x, xd, gy, C, B, acum))


@pytest.mark.parametrize("H,G,Q,P,N", [(4, 2, 128, 8, 16), (4, 4, 24, 12, 24), (2, 1, 16, 16, 16)])
def test_fused_intra_chunk_grads_equal_the_torch_form(H, G, Q, P, N, gen, monkeypatch, device):
    """Both forms compute the same products at the same precision (bf16 terms, fp32 sums); they differ in
    grouping only: ``dC`` / ``dB`` here split each head's ``dM`` into bf16 terms, there the group's sum of
    them (each split drops up to 2^-16 of its value). Within 1e-5 of each other relative to the gradient,
    below the split's own 2^-15 bound against fp32."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    _emulated_torch_form(monkeypatch)
    U = 3
    x, xd, gy, C, B, acum = _inputs(gen, device, U, H, G, Q, P, N)
    fused = ssd_intra_chunk_grads(xd, gy, C, B, acum, split=True)
    view = lambda t: t.view(1, U, *t.shape[1:])  # noqa: E731  [Bt=1, c=U, ...]
    torch_form = ssd_backward._intra_chunk_grads(view(x), view(xd), view(gy), view(C), view(B), view(acum), True)
    for name, f, t in zip(("dxd", "dC", "dB", "dacum"), fused, torch_form):
        t = t.view(f.shape)
        assert f.dtype == t.dtype and f.shape == t.shape, name
        err = _rel(f, t)
        print(f"{name} (H={H}, G={G}, Q={Q}): fused vs torch form {err:.1e}")
        assert err <= 1e-5, (name, err)
        if name in ("dxd", "dB"):  # columns past a sequence's end (xd = B = 0 there): exactly zero
            assert float(f[-1, :, Q // 3:].abs().max()) == 0.0 < float(f[-1, :, :Q // 3].abs().max()), name


def test_fused_scan_backward_against_fp64(gen, monkeypatch, device):
    """The whole scan backward with its intra-chunk part fused (split on, bf16-valued B and C as one exact
    term): each gradient within 5e-5 of fp64 autograd (the tensor-core bound of the torch form's test);
    with ``UM_BACKWARD_GEMM=bf16`` (one term per fp32 operand, Megatron-core's precision) the error is
    larger but within 1e-2."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    _emulated_torch_form(monkeypatch)
    calls = []
    real = ssd_backward.ssd_intra_chunk_grads
    monkeypatch.setattr(ssd_backward, "ssd_intra_chunk_grads", lambda *a, **k: calls.append(k) or real(*a, **k))
    Hh, Gg, P_, N_, Q_, L = 4, 2, 8, 16, 32, 80
    ins = (torch.randn(2, L, Hh, P_, generator=gen), torch.rand(2, L, Hh, generator=gen) * 0.3 + 0.01,
           torch.log(torch.tensor([1.0, 2.0, 4.0, 8.0])),
           (torch.randn(2, L, Gg, N_, generator=gen) * 0.5).bfloat16().float(),
           (torch.randn(2, L, Gg, N_, generator=gen) * 0.5).bfloat16().float(), 1 + 0.1 * torch.randn(Hh, generator=gen))
    gy = torch.randn(2, L, Hh, P_, generator=gen)
    leaves = [t.double().requires_grad_() for t in ins]
    exact = torch.autograd.grad(ssd_chunked_torch_batched(*leaves, Q_), leaves, gy.double())
    errors = {}
    for mode in ("split", "bf16"):
        monkeypatch.setenv("UM_BACKWARD_GEMM", mode)
        ours = ssd_backward.ssd_chunked_backward(*(t.to(device) for t in ins), Q_, gy.to(device), split_fp32=True,
                                                 bc_exact=True)
        errors[mode] = {name: _rel(o.cpu(), e) for name, o, e in zip(("x", "dt", "A_log", "B", "C", "D"), ours, exact)}
        print(mode, {k: f"{v:.1e}" for k, v in errors[mode].items()})
    assert [k["split"] for k in calls] == [True, False] and all(k["bc_exact"] for k in calls)
    assert max(errors["split"].values()) <= 5e-5, errors["split"]
    assert max(errors["bf16"].values()) <= 1e-2, errors["bf16"]
    assert errors["bf16"]["x"] > 10 * errors["split"]["x"], errors  # one term: visibly coarser


def test_fused_intra_chunk_grads_refuses_bad_input(gen, device):
    x, xd, gy, C, B, acum = _inputs(gen, device, 2, 4, 2, 16, 8, 16)
    with pytest.raises(ValueError, match="fp64"):
        ssd_intra_chunk_grads(xd, gy, C, B, acum.float())
    with pytest.raises(ValueError, match="contiguous"):
        ssd_intra_chunk_grads(xd.transpose(2, 3), gy, C, B, acum)
    with pytest.raises(ValueError, match="G \\| H"):
        ssd_intra_chunk_grads(xd, gy, C[:, :1].repeat(1, 3, 1, 1), B[:, :1].repeat(1, 3, 1, 1), acum)
    with pytest.raises(ValueError, match="C \\(2, 2, 16, 16, 2\\).*must be 4-D"):  # an extra dim: not read as N
        ssd_intra_chunk_grads(xd, gy, torch.stack([C, C], -1), torch.stack([B, B], -1), acum)
    with pytest.raises(ValueError, match="xd \\(2, 4, 16\\)"):
        ssd_intra_chunk_grads(xd[..., 0], gy, C, B, acum)
    with pytest.raises(ValueError, match="C \\(2, 2, 16, 16\\) bfloat16"):
        ssd_intra_chunk_grads(xd, gy, C.bfloat16(), B, acum)


def test_kernels_that_do_not_build_fall_back_to_the_torch_form(gen, monkeypatch, device):
    """A GPU where the fused kernels do not build (Triton's ``OutOfResources``): one warning, then the torch
    form's gradients (bitwise those of the torch form itself), and the kernels are not tried again."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    _emulated_torch_form(monkeypatch)
    monkeypatch.setattr(ssd_backward, "_FUSED_UNAVAILABLE", None)
    tries = []

    def no_build(*a, **k):
        tries.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    ins = (torch.randn(1, 40, 4, 8, generator=gen), torch.rand(1, 40, 4, generator=gen) * 0.3,
           torch.zeros(4), torch.randn(1, 40, 2, 16, generator=gen), torch.randn(1, 40, 2, 16, generator=gen), None)
    gy = torch.randn(1, 40, 4, 8, generator=gen).to(device)
    ins = tuple(None if t is None else t.to(device) for t in ins)
    monkeypatch.setattr(ssd_backward, "use_triton", lambda x: False)
    want = ssd_backward.ssd_chunked_backward(*ins, 16, gy, split_fp32=True)
    monkeypatch.setattr(ssd_backward, "use_triton", lambda x: True)
    monkeypatch.setattr(ssd_backward, "ssd_intra_chunk_grads", no_build)
    with pytest.warns(RuntimeWarning, match="does not build here.*OutOfResources"):
        got = ssd_backward.ssd_chunked_backward(*ins, 16, gy, split_fp32=True)
    again = ssd_backward.ssd_chunked_backward(*ins, 16, gy, split_fp32=True)
    assert len(tries) == 1
    for a, b, c in zip(got, want, again):
        assert (a is None and b is None) or (torch.equal(a, b) and torch.equal(c, b))
