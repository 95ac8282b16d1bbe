"""mHC's analytic backward (``ops/mhc/backward.py`` ``HCPreFn``, ``ops/mhc/sinkhorn_grads.py``): against
fp64 autograd of the formulas, on the CPU path and the Triton kernel (interpreter), and its cost flat
in ``sinkhorn_iters`` (autograd of the loop was ~320 ATen ops per ``hc_pre`` at 20 iterations)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unified_models import ops
from unified_models.ops.mhc.reference import hc_head_math, hc_pre_math
from unified_models.ops.mhc.sinkhorn_grads import sinkhorn_grad, sinkhorn_grad_torch, sinkhorn_grad_triton

HC_EPS, NORM_EPS = 1e-6, 1e-6


def _comb(logits, eps, iters):
    """``hc_pre_math``'s comb from its logits (the formula the gradient is of)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("n,iters", [(4, 20), (3, 5), (2, 1), (4, 2)])
def test_sinkhorn_grad_matches_fp64_autograd(n, iters, device):
    """fp64 torch form == autograd of the loop to 1e-12 (the formulas); fp32 torch and the Triton kernel
    (interpreter; n = 3 pads the 4 x 4 tile) within 1e-6 relative. Logits of scale 3: peaked rows."""
    g = torch.Generator().manual_seed(n * 10 + iters)
    logits = torch.randn(37, n, n, generator=g) * 3
    grad = torch.randn(37, n, n, generator=g)
    l64 = logits.double().requires_grad_()
    (ref,) = torch.autograd.grad(_comb(l64, HC_EPS, iters), l64, grad.double())
    assert _rel(sinkhorn_grad_torch(logits.double(), grad.double(), HC_EPS, iters), ref) < 1e-12
    assert _rel(sinkhorn_grad_torch(logits, grad, HC_EPS, iters), ref) < 1e-6
    tri = sinkhorn_grad_triton(logits.to(device), grad.to(device), HC_EPS, iters).cpu()
    assert tri.dtype == torch.float32 and _rel(tri, ref) < 1e-6


def test_sinkhorn_grad_rows_are_independent_and_errors_name_the_shape(device):
    """A token's gradient is the same bits alone as among others (the kernel's tiles), zero tokens give an
    empty result, and bad shapes or iteration counts are named."""
    g = torch.Generator().manual_seed(3)
    logits, grad = torch.randn(70, 4, 4, generator=g).to(device), torch.randn(70, 4, 4, generator=g).to(device)
    full = sinkhorn_grad_triton(logits, grad, HC_EPS, 20)
    assert torch.equal(sinkhorn_grad_triton(logits[33:34], grad[33:34], HC_EPS, 20), full[33:34])
    assert sinkhorn_grad_triton(logits[:0], grad[:0], HC_EPS, 20).shape == (0, 4, 4)
    with pytest.raises(ValueError, match=r"must both be \[T, n, n\]"):
        sinkhorn_grad(logits, grad[:, :3], hc_eps=HC_EPS, sinkhorn_iters=20)
    with pytest.raises(ValueError, match="sinkhorn_iters must be >= 1"):
        sinkhorn_grad(logits, grad, hc_eps=HC_EPS, sinkhorn_iters=0)


def _leaves(n, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device, dtype).requires_grad_()

    scale = (1 + 0.3 * torch.randn(3, generator=g)).to(device, dtype).requires_grad_()
    head_scale = torch.tensor([1.3], dtype=dtype, device=device).requires_grad_()
    return (r(9, n, d), r(m, n * d, s=2 / (n * d) ** 0.5), r(m, s=0.5), scale, r(n, n * d, s=2 / (n * d) ** 0.5),
            r(n, s=0.5), head_scale)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n,outputs", [(4, "x post comb"), (4, "x"), (4, "comb"), (3, "x post comb")])
def test_hc_pre_and_head_gradients_match_fp64(monkeypatch, device, backend, n, outputs):
    """``ops.hc_pre`` (of the outputs used: x alone leaves post and comb without a gradient) and
    ``ops.hc_head``, fp32 and fp64 inputs, against autograd of the fp64 formulas: every input's gradient
    within 1e-5 relative (fp32) and 1e-10 (fp64: the analytic formulas themselves)."""
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    dev = device if backend == "triton" else "cpu"
    d, iters = 24, 20
    # upstream weights exact in fp32: post and comb are fp32 outputs (also for fp64 streams), so their
    # gradients arrive in fp32, and the fp64 comparison checks the formulas, not that rounding
    w = {k: torch.randn(*shape, generator=torch.Generator().manual_seed(7)).double()
         for k, shape in (("x", (9, d)), ("post", (9, n)), ("comb", (9, n, n)), ("head", (9, d)))}

    def loss(outs, head, w_dev=None):
        x, post, comb = outs
        terms = {"x": x, "post": post, "comb": comb}
        ws = {k: v.to(w_dev or dev) for k, v in w.items()}
        return sum((terms[k].double() * ws[k]).sum() for k in outputs.split()) + (head.double() * ws["head"]).sum()

    ref = _leaves(n, d, torch.float64, 5)
    loss(hc_pre_math(*ref[:4], NORM_EPS, HC_EPS, iters), hc_head_math(ref[0], *ref[4:], NORM_EPS, HC_EPS),
         w_dev="cpu").backward()
    cases = ((torch.float64, 1e-10), (torch.float32, 1e-5))
    for dtype, tol in cases[1:] if backend == "triton" else cases:  # the kernels take fp32
        xs = _leaves(n, d, dtype, 5, dev)
        outs = ops.hc_pre(*xs[:4], norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=iters)
        head = ops.hc_head(xs[0], *xs[4:], norm_eps=NORM_EPS, hc_eps=HC_EPS)
        loss(outs, head).backward()
        for name, a, b in zip(("h", "fn", "base", "scale", "hc_fn", "hc_base", "hc_scale"), xs, ref):
            assert a.grad is not None and a.grad.dtype == dtype, name
            assert _rel(a.grad.cpu(), b.grad) < tol, (dtype, name, _rel(a.grad.cpu(), b.grad))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_hc_pre_backward_launches_do_not_grow_with_iterations(monkeypatch, device):
    """On the Triton path (a GPU's), one ``hc_pre`` backward runs the same ATen ops at 2 and at 20
    Sinkhorn iterations (the chain is one kernel): 110 (views included), where autograd of the formulas
    runs 98 at 2 iterations and 386 at 20 (:func:`_autograd_ops`, measured the same way)."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    counts = []
    for iters in (2, 20):
        h, fn, base, scale, *_ = _leaves(4, 16, torch.float32, 1, device)
        x, post, comb = ops.hc_pre(h, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=iters)
        loss = x.sum() + post.sum() + (comb * torch.arange(16.0, device=device).view(4, 4)).sum()
        with _Count() as c:
            loss.backward()
        counts.append(sum(c.ops.values()))
    assert counts[0] == counts[1] <= 120, counts
    assert _autograd_ops(20) > 3 * counts[1]


def _autograd_ops(iters: int) -> int:
    """ATen ops of autograd through ``hc_pre_math`` (the backward before ``HCPreFn``), same inputs and loss."""
    h, fn, base, scale, *_ = _leaves(4, 16, torch.float32, 1)
    x, post, comb = hc_pre_math(h, fn, base, scale, NORM_EPS, HC_EPS, iters)
    loss = x.sum() + post.sum() + (comb * torch.arange(16.0).view(4, 4)).sum()
    with _Count() as c:
        loss.backward()
    return sum(c.ops.values())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tokens(monkeypatch, device, backend):
    """T = 0 (an empty batch): the forward gives empty outputs and the backward zero weight gradients, on both
    paths (the CPU path's ``reshape(0, -1)`` raised before)."""
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    dev = device if backend == "triton" else "cpu"
    h, fn, base, scale, hfn, hbase, hscale = _leaves(4, 8, torch.float32, 2, dev)
    h = h[:0].detach().requires_grad_()
    x, post, comb = ops.hc_pre(h, fn, base, scale, norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=20)
    y = ops.hc_head(h, hfn, hbase, hscale, norm_eps=NORM_EPS, hc_eps=HC_EPS)
    assert x.shape == (0, 8) and post.shape == (0, 4) and comb.shape == (0, 4, 4) and y.shape == (0, 8)
    (x.sum() + post.sum() + comb.sum() + y.sum()).backward()
    assert h.grad.shape == (0, 4, 8) and float(fn.grad.abs().sum()) == 0.0 and float(hscale.grad.abs().sum()) == 0.0
