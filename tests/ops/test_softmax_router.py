"""Qwen3-MoE ops: the softmax top-k router (CPU path and Triton kernel) and the SwiGLU experts with the
routing weight after the down projection (``swiglu_experts(..., weight_before_down=False)``, no clamp).

Checked: the router vs its fp64 oracle (ids exactly, weights to fp32 rounding), with and without
``norm_topk_prob``, logits rounded to bf16 as the engines do; ties on constructed equal scores (the
lower expert index wins, slots best first) on both paths; bitwise batch invariance of the whole MoE
(router + experts + combine) on both paths; the Triton kernel's ids equal the CPU path's; gradients
of the router and of the experts vs fp64 autograd of the formulas; argument errors.
(Against transformers' ``Qwen3MoeSparseMoeBlock``: ``tests/test_models_qwen3.py``.)
"""

from __future__ import annotations

import math

import pytest
import torch

from unified_models import ops
from unified_models.ops.moe import softmax_route_reference, softmax_select, swiglu_experts_reference

T, D, I, E, K = 40, 80, 96, 8, 2


def _weights(gen, dtype=torch.bfloat16):
    return dict(gate=(torch.randn(E, D, generator=gen) / D ** 0.5).to(dtype),
                wg=(torch.randn(E, I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
                wu=(torch.randn(E, I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
                wd=(torch.randn(E, D, I, generator=gen) / I ** 0.5).to(dtype))


def _x(gen, n=T, dtype=torch.bfloat16):
    return torch.randn(n, D, generator=gen).to(dtype)


def _moe(x, w, norm=True):
    """The whole Qwen3-MoE sublayer as ``layers/qwen3_moe.py`` calls it."""
    wts, ids = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=norm, logits_dtype=x.dtype)
    return ops.swiglu_experts(x, ids, wts, w["wg"], w["wu"], w["wd"], None, swiglu_limit=math.inf,
                              weight_before_down=False)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("logits_dtype", [None, torch.bfloat16])
def test_router_vs_fp64_reference(gen, norm, logits_dtype):
    w, x = _weights(gen), _x(gen)
    wts, ids = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=norm, logits_dtype=logits_dtype)
    assert wts.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, K)
    rw, rids = softmax_route_reference(x, w["gate"], top_k=K, norm_topk_prob=norm, logits_dtype=logits_dtype)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(wts.double(), rw, rtol=2e-6, atol=1e-7)
    # the weights are softmax probabilities of the (rounded) logits at the ids, independently computed
    lg = x.double() @ w["gate"].double().t()
    if logits_dtype is not None:
        lg = lg.float().to(logits_dtype).double()
    p = torch.softmax(lg, -1)
    assert torch.equal(ids.long(), torch.sort(p, -1, descending=True).indices[:, :K])  # no near-ties here
    want = p.gather(1, ids.long())
    if norm:
        want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(wts.sum(-1), torch.ones(T), rtol=1e-6, atol=0)
    torch.testing.assert_close(wts.double(), want, rtol=2e-6, atol=1e-7)


def test_logits_are_rounded_like_transformers(gen):
    """With ``logits_dtype=bf16`` the scores are the softmax of bf16 logits (transformers' ``F.linear`` in
    bf16, then ``softmax(dtype=float)``), which differs from the fp32-logit softmax."""
    w, x = _weights(gen), _x(gen)
    a, _ = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=False, logits_dtype=torch.bfloat16)
    b, _ = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=False)
    assert not torch.equal(a, b)
    tf = torch.softmax(torch.nn.functional.linear(x, w["gate"]), dim=-1, dtype=torch.float).topk(K, -1).values
    torch.testing.assert_close(a, tf, rtol=1e-6, atol=1e-7)


def _tied_logits(dev):
    # rows: all equal; two equal maxima at 5 and 2; equal second place at 1, 3, 6
    return torch.tensor([[0.5] * E,
                         [0.0, 0.1, 1.0, 0.2, 0.0, 1.0, 0.3, 0.0],
                         [2.0, 1.0, -1.0, 1.0, 0.0, -3.0, 1.0, 0.5]], device=dev)


def _check_ties(wts, ids):
    assert ids.cpu().tolist() == [[0, 1], [2, 5], [0, 1]]
    w = wts.cpu()
    assert w[0, 0] == w[0, 1] and w[1, 0] == w[1, 1]


def test_router_ties_lower_index_wins():
    _check_ties(*softmax_select(_tied_logits("cpu"), top_k=K, norm_topk_prob=True))


def test_moe_batch_invariant(gen, inv):
    """CPU path: each row of the whole MoE bitwise the same alone, in prefixes, split and in random
    compositions with zero and junk padding rows."""
    w, x = _weights(gen), _x(gen)
    inv.check_rows(lambda a: _moe(a, w), (x,), inv.padding(D, torch.bfloat16, gen, 30.0), gen, what="cpu qwen3 moe")


def test_moe_vs_fp64_reference(gen):
    """Router + experts vs the fp64 oracles (ids from the oracle router, weights after the down projection
    in exact arithmetic); and the expert output really carries the weight after ``down`` (the DeepSeek
    rule, weight before ``down``, rounds ``h * w`` and gives other bits)."""
    w, x = _weights(gen), _x(gen)
    out = _moe(x, w)
    rw, rids = softmax_route_reference(x, w["gate"], top_k=K, norm_topk_prob=True, logits_dtype=torch.bfloat16)
    ref = swiglu_experts_reference(x, rids, rw, w["wg"], w["wu"], w["wd"], None, swiglu_limit=math.inf)
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2
    wts, ids = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=True, logits_dtype=torch.bfloat16)
    before = ops.swiglu_experts(x, ids, wts, w["wg"], w["wu"], w["wd"], None, swiglu_limit=math.inf)
    assert not torch.equal(before, out) and _rel(before, ref) < 1e-2
    # weight after down == the fp32 combine of unit-weight expert rows (slot order), rounded once
    from unified_models.ops.moe import moe_combine, swiglu_expert_outputs

    rows = swiglu_expert_outputs(x, ids, torch.ones(T, K), w["wg"], w["wu"], w["wd"], swiglu_limit=math.inf)
    assert torch.equal(out, moe_combine(rows, wts, None, torch.bfloat16))


def test_gradients_vs_fp64(gen):
    """Router and experts backward (fp32 inputs) vs fp64 autograd of the plain formulas."""
    w = {k: v.float() for k, v in _weights(gen).items()}
    x = _x(gen, 12).float()

    def leaves(dtype):
        return [t.detach().to(dtype).requires_grad_(True) for t in (x, w["gate"], w["wg"], w["wu"], w["wd"])]

    ours = leaves(torch.float32)
    wts, ids = ops.softmax_route(ours[0], ours[1], top_k=K, norm_topk_prob=True)
    y = ops.swiglu_experts(ours[0], ids, wts, *ours[2:], None, swiglu_limit=math.inf, out_dtype=torch.float32,
                           weight_before_down=False)
    g = torch.randn(y.shape, generator=gen)
    (y * g).sum().backward()
    ref = leaves(torch.float64)
    p = torch.softmax(ref[0] @ ref[1].t(), -1).gather(1, ids.long())
    p = p / p.sum(-1, keepdim=True)
    out = torch.zeros(12, D, dtype=torch.float64)
    for k in range(K):
        e = ids[:, k].long()
        h = torch.nn.functional.silu(torch.einsum("td,tid->ti", ref[0], ref[2][e])) * \
            torch.einsum("td,tid->ti", ref[0], ref[3][e])
        out = out + p[:, k:k + 1] * torch.einsum("ti,tdi->td", h, ref[4][e])
    (out * g.double()).sum().backward()
    for name, a, b in zip(("x", "gate", "gate_proj", "up_proj", "down_proj"), ours, ref):
        assert _rel(a.grad, b.grad) < 1e-5, name


def test_argument_errors():
    with pytest.raises(ValueError, match=r"softmax_select: top_k = 9 must be in \[1, 8\]"):
        softmax_select(torch.zeros(4, E), top_k=9)
    with pytest.raises(ValueError, match=r"softmax_select: logits must be \[T, E\]"):
        softmax_select(torch.zeros(E), top_k=2)
    with pytest.raises(ValueError, match=r"softmax_route: x \(4, 80\) and gate weight \(8, 81\) do not match"):
        ops.softmax_route(torch.zeros(4, D), torch.zeros(E, D + 1), top_k=2)
    from unified_models.ops.moe.softmax_triton import softmax_select_triton

    with pytest.raises(ValueError, match=r"softmax_select_triton: logits must be fp32"):
        softmax_select_triton(torch.zeros(4, E, dtype=torch.bfloat16), top_k=2, norm_topk_prob=True)


# ----------------------------------------------------------------------------- Triton kernel
# Through the interpreter on CPU (natively on CUDA); E = 8 in one register tile, T = 40 over three
# token tiles of the router program (the last one masked).


@pytest.fixture
def kdev(monkeypatch, device):
    """The device of the Triton kernels, with the Triton backend forced (CPU: the interpreter)."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    return device


@pytest.mark.parametrize("norm", [True, False])
def test_triton_router_vs_fp64_reference(kdev, gen, norm, monkeypatch):
    """The selection kernel: ids equal the fp64 oracle's and the CPU path's, weights within rtol 1e-5
    (the GPU's approximate exp costs a few fp32 ulps)."""
    w, x = _weights(gen), _x(gen)
    wts, ids = ops.softmax_route(x.to(kdev), w["gate"].to(kdev), top_k=K, norm_topk_prob=norm,
                                 logits_dtype=torch.bfloat16)
    rw, rids = softmax_route_reference(x, w["gate"], top_k=K, norm_topk_prob=norm, logits_dtype=torch.bfloat16)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(wts.cpu().double(), rw, rtol=1e-5, atol=1e-7)
    with monkeypatch.context() as m:
        m.setenv("UM_OPS_BACKEND", "torch")
        cpu_w, cpu_ids = ops.softmax_route(x, w["gate"], top_k=K, norm_topk_prob=norm, logits_dtype=torch.bfloat16)
    assert torch.equal(ids.cpu(), cpu_ids)
    torch.testing.assert_close(wts.cpu(), cpu_w, rtol=1e-5, atol=1e-7)


def test_triton_router_ties_lower_index_wins(kdev):
    _check_ties(*softmax_select(_tied_logits(kdev), top_k=K, norm_topk_prob=True))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-large): g / inf = -0
def test_triton_moe_batch_invariant(kdev, gen, inv):
    """The whole MoE on the kernels (router GEMM + selection, grouped SwiGLU experts, combine)."""
    w = {k: v.to(kdev) for k, v in _weights(gen).items()}
    x = _x(gen).to(kdev)
    pads = inv.padding(D, torch.bfloat16, gen, 30.0)
    inv.check_rows(lambda a: _moe(a, w), (x,), lambda n: tuple(t.to(kdev) for t in pads(n)), gen, trials=2,
                   pad_counts=(24, 5), what="triton qwen3 moe")
