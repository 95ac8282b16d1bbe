"""DeepSeek-V4 MoE ops: sqrt-softplus and hash routers, clamped-SwiGLU experts, ordered combine.

Checked: routers and experts vs their fp64 oracles (with the clamp active); router ties on
constructed equal scores (rule: the lower expert index wins, slots best first; the bias only
selects); bitwise batch invariance of the whole MoE (``Inv.check_rows``) for a regular and a
hash layer; gradients vs fp64 autograd; the missing Triton kernel raises; argument errors.
(Against transformers' ``DeepseekV4SparseMoeBlock``: ``tests/test_deepseek_moe_family.py``.)
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops.moe import (hash_route_reference, hash_select, sqrtsoftplus_route_reference,
                                    sqrtsoftplus_select, swiglu_expert_outputs, swiglu_experts_reference,
                                    swiglu_shared_expert_reference)

T, D, I, E, K, V = 40, 80, 96, 8, 3, 50
LIMIT = 1.5  # small enough that the clamps bite on these inputs (checked below)
ROUTE = dict(norm_topk_prob=True, routed_scaling_factor=1.5)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _weights(gen, dtype=torch.bfloat16):
    return dict(
        gate=(torch.randn(E, D, generator=gen) / D ** 0.5).to(dtype),
        bias=torch.randn(E, generator=gen) * 0.05,
        tid2eid=torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V)]),
        w1=(torch.randn(E, I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
        w3=(torch.randn(E, I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
        w2=(torch.randn(E, D, I, generator=gen) / I ** 0.5).to(dtype),
        s1=(torch.randn(I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
        s3=(torch.randn(I, D, generator=gen) * 2 / D ** 0.5).to(dtype),
        s2=(torch.randn(D, I, generator=gen) / I ** 0.5).to(dtype),
    )


def _x(gen, n=T, dtype=torch.bfloat16):
    return torch.randn(n, D, generator=gen).to(dtype)


def _ids(gen, n=T):
    return torch.randint(0, V, (n,), generator=gen)


def _moe(x, ids_T, w, hash_routing):
    """The whole DeepSeek-V4 MoE as the layer calls it."""
    if hash_routing:
        wts, ids = ops.hash_route(x, w["gate"], w["tid2eid"], ids_T, **ROUTE)
    else:
        wts, ids = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    shared = ops.swiglu_shared_expert(x, w["s1"], w["s3"], w["s2"], swiglu_limit=LIMIT)
    return ops.swiglu_experts(x, ids, wts, w["w1"], w["w3"], w["w2"], shared, swiglu_limit=LIMIT)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def test_router_vs_fp64_reference(gen):
    w, x = _weights(gen), _x(gen)
    wts, ids = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    assert wts.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, K)
    rw, rids = sqrtsoftplus_route_reference(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(wts.double(), rw, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(wts.sum(-1), torch.full((T,), 1.5), rtol=1e-6, atol=0)
    # the bias changes the selection, never the weights' source: without it, other experts win
    _, plain = ops.sqrtsoftplus_route(x, w["gate"], None, top_k=K, **ROUTE)
    big = w["bias"].clone()
    big[E - 1] = 100.0
    bw, bids = ops.sqrtsoftplus_route(x, w["gate"], big, top_k=K, **ROUTE)
    assert torch.all(bids[:, 0] == E - 1) and not torch.equal(bids, plain)
    s = torch.sqrt(torch.nn.functional.softplus(x.double() @ w["gate"].double().t())).gather(1, bids.long())
    torch.testing.assert_close(bw.double(), s / s.sum(-1, keepdim=True) * 1.5, rtol=1e-6, atol=1e-7)


def test_hash_router_vs_fp64_reference(gen):
    w, x, tok = _weights(gen), _x(gen), _ids(gen)
    wts, ids = ops.hash_route(x, w["gate"], w["tid2eid"], tok, **ROUTE)
    assert torch.equal(ids.long(), w["tid2eid"][tok])  # slot order = the table's column order
    rw, rids = hash_route_reference(x, w["gate"], w["tid2eid"], tok, **ROUTE)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(wts.double(), rw, rtol=1e-6, atol=1e-7)
    # same hidden state, another token id: other experts and other weights
    w2, ids2 = ops.hash_route(x, w["gate"], w["tid2eid"], (tok + 1) % V, **ROUTE)
    assert not torch.equal(ids2, ids) and not torch.equal(w2, wts)


def test_router_ties_lower_index_wins():
    """Constructed equal scores: the lower expert index wins every tie; slots best first."""
    logits = torch.tensor([[0.0, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 0.0],   # three-way tie at the top
                           [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3],   # all equal
                           [0.0, 0.0, 0.2, 0.9, 0.2, 0.0, 0.9, 0.2]])  # tie across the k boundary
    w, ids = sqrtsoftplus_select(logits, None, top_k=3, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert ids.tolist() == [[1, 3, 5], [0, 1, 2], [3, 6, 2]]
    assert torch.all(w[1] == w[1, 0]) and torch.all(w[0] == w[0, 0])
    # the bias decides among equal scores; weights still from the unbiased scores
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.1, 0.0])
    w, ids = sqrtsoftplus_select(logits[1:2], bias, top_k=2, norm_topk_prob=True, routed_scaling_factor=1.5)
    assert ids.tolist() == [[4, 6]] and torch.equal(w, torch.tensor([[0.75, 0.75]]))
    # equal biased scores from different (score, bias) pairs also tie to the lower index
    lg = torch.zeros(1, 8)
    s0 = float(torch.sqrt(torch.nn.functional.softplus(torch.tensor(0.0))))
    bias = torch.zeros(8)
    bias[[2, 6]] = 1.0
    lg[0, 5] = 10.0  # sqrt(softplus(10)) vs s0 + 1 differ: 5 is not tied
    _, ids = sqrtsoftplus_select(lg, bias, top_k=2)
    assert ids.tolist() == [[5, 2]] and s0 + 1.0 < float(torch.sqrt(torch.nn.functional.softplus(torch.tensor(10.))))
    # through the router GEMM: identical gate rows give identical logits
    gate = torch.zeros(E, 16, dtype=torch.bfloat16)
    gate[[2, 5, 7]] = 1.0
    gate[[0, 4]] = 0.5
    _, ids = ops.sqrtsoftplus_route(torch.ones(3, 16, dtype=torch.bfloat16), gate, None, top_k=4)
    assert ids.tolist() == [[2, 5, 7, 0]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_vs_fp64_reference(dtype, gen):
    w, x = _weights(gen, dtype), _x(gen, dtype=dtype)
    wts, ids = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    g = torch.einsum("td,tid->ti", x.double(), w["w1"].double()[ids[:, 0].long()])
    assert (g > LIMIT).float().mean() > 0.05 and (g.abs() <= LIMIT).float().mean() > 0.3  # clamp bites, not always
    shared = ops.swiglu_shared_expert(x, w["s1"], w["s3"], w["s2"], swiglu_limit=LIMIT)
    assert shared.dtype == torch.float32
    torch.testing.assert_close(shared.double(), swiglu_shared_expert_reference(x, w["s1"], w["s3"], w["s2"],
                                                                               swiglu_limit=LIMIT),
                               rtol=TOL[dtype], atol=TOL[dtype])
    out = ops.swiglu_experts(x, ids, wts, w["w1"], w["w3"], w["w2"], shared, swiglu_limit=LIMIT)
    assert out.dtype == dtype
    ref = swiglu_experts_reference(x, ids, wts, w["w1"], w["w3"], w["w2"], shared, swiglu_limit=LIMIT)
    err = _rel(out, ref)
    print(f"swiglu_experts {dtype}: rel err {err:.2e}")
    assert err < TOL[dtype] / 4, err
    # the unit-weight combine is the plain slot-order sum of the per-assignment outputs
    y = swiglu_expert_outputs(x, ids, wts, w["w1"], w["w3"], w["w2"], swiglu_limit=LIMIT).view(T, K, D)
    acc = torch.zeros(T, D)
    for k in range(K):
        acc = acc + y[:, k]
    assert torch.equal(out, (acc + shared).to(dtype))


@pytest.mark.parametrize("hash_routing", [False, True])
def test_moe_batch_invariant(hash_routing, gen, inv):
    w = _weights(gen)
    x, tok = _x(gen), _ids(gen)
    pads = inv.padding(D, torch.bfloat16, gen, 30.0)

    def pad(n):
        return pads(n) + (torch.randint(0, V, (n,), generator=gen),)

    inv.check_rows(lambda a, t: _moe(a, t, w, hash_routing), (x, tok), pad, gen, what=f"hash={hash_routing}")
    # each op alone, too
    inv.check_rows(lambda a: ops.sqrtsoftplus_route(a, w["gate"], w["bias"], top_k=K, **ROUTE)[0], (x,),
                   pads, gen, what="router weights")
    wts, ids = ops.hash_route(x, w["gate"], w["tid2eid"], tok, **ROUTE)
    inv.check_rows(lambda a, i, ww: swiglu_expert_outputs(a, i, ww, w["w1"], w["w3"], w["w2"],
                                                          swiglu_limit=LIMIT).view(a.shape[0], -1),
                   (x, ids, wts), lambda n: pads(n) + (torch.zeros(n, K, dtype=torch.int32), torch.ones(n, K)),
                   gen, what="expert outputs")


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_grad(dtype, hash_routing, gen, inv):
    w, x, tok = _weights(gen, dtype), _x(gen, dtype=dtype), _ids(gen)
    g = torch.randn(T, K, generator=gen)
    xs, gs = _leaves(x, w["gate"])
    if hash_routing:
        wts, ids = ops.hash_route(xs, gs, w["tid2eid"], tok, **ROUTE)
        plain = ops.hash_route(x, w["gate"], w["tid2eid"], tok, **ROUTE)[0]
    else:
        wts, ids = ops.sqrtsoftplus_route(xs, gs, w["bias"], top_k=K, **ROUTE)
        plain = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)[0]
    inv.assert_bitwise(wts.detach(), plain, "router forward with grad vs no-grad")
    wts.backward(g)
    x64, g64 = _leaves(x.double(), w["gate"].double())
    s = torch.sqrt(torch.nn.functional.softplus(x64 @ g64.t())).gather(1, ids.long())
    (s / s.sum(-1, keepdim=True) * 1.5).backward(g.double())
    for name, a, b in (("x", xs.grad, x64.grad), ("gate", gs.grad, g64.grad)):
        assert a.dtype == dtype
        err = _rel(a, b)
        print(f"GRAD-ERR route hash={hash_routing} {dtype} {name}: {err:.2e}")
        assert err <= TOL[dtype], f"{name}: {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_grad(dtype, gen, inv):
    """Gradients to x, the routing weights, the shared output and the three stacks vs fp64 autograd."""
    w, x = _weights(gen, dtype), _x(gen, dtype=dtype)
    wts, ids = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    shared = torch.randn(T, D, generator=gen)
    g = torch.randn(T, D, generator=gen).to(dtype)
    leaves = _leaves(x, wts, shared, w["w1"], w["w3"], w["w2"])
    out = ops.swiglu_experts(leaves[0], ids, leaves[1], *leaves[3:], leaves[2], swiglu_limit=LIMIT)
    plain = ops.swiglu_experts(x, ids, wts, w["w1"], w["w3"], w["w2"], shared, swiglu_limit=LIMIT)
    inv.assert_bitwise(out.detach(), plain, "experts forward with grad vs no-grad")
    out.backward(g)
    r = _leaves(*(t.double() for t in (x, wts, shared, w["w1"], w["w3"], w["w2"])))
    swiglu_experts_reference(r[0], ids, r[1], *r[3:], r[2], swiglu_limit=LIMIT).backward(g.double())
    for name, a, b in zip(("x", "weights", "shared", "w1", "w3", "w2"), leaves, r):
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        err = _rel(a.grad, b.grad)
        print(f"GRAD-ERR swiglu_experts {dtype} {name}: {err:.2e}")
        assert err <= TOL[a.dtype], f"{name}: {err:.2e}"


def test_shared_expert_grad(gen):
    w, x = _weights(gen, torch.float32), _x(gen, dtype=torch.float32)
    g = torch.randn(T, D, generator=gen)
    leaves = _leaves(x, w["s1"], w["s3"], w["s2"])
    ops.swiglu_shared_expert(*leaves, swiglu_limit=LIMIT).backward(g)
    r = _leaves(*(t.double() for t in (x, w["s1"], w["s3"], w["s2"])))
    swiglu_shared_expert_reference(*r, swiglu_limit=LIMIT).backward(g.double())
    for a, b in zip(leaves, r):
        assert _rel(a.grad, b.grad) <= 1e-5


def test_stale_weight_refuses_backward(gen):
    w, x = _weights(gen, torch.float32), _x(gen, dtype=torch.float32)
    wts, ids = ops.sqrtsoftplus_route(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    w1 = w["w1"].clone().requires_grad_()
    out = ops.swiglu_experts(x, ids, wts, w1, w["w3"], w["w2"], swiglu_limit=LIMIT)
    with torch.no_grad():
        w1.add_(1.0)
    with pytest.raises(ops.StaleWeightError, match="swiglu_experts"):
        out.sum().backward()


def test_triton_argument_errors(monkeypatch, gen):
    """On CUDA (or with the Triton backend forced) the kernels refuse what they cannot compute, never
    another rule: fp16 activations, fp16 logits for the selection."""
    w = _weights(gen, torch.float16)
    x = _x(gen, n=4, dtype=torch.float16)
    ids = torch.zeros(4, K, dtype=torch.int32)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"swiglu_expert_outputs_triton: x must be bf16 or fp32"):
        swiglu_expert_outputs(x, ids, torch.ones(4, K), w["w1"], w["w3"], w["w2"], swiglu_limit=LIMIT)
    from unified_models.ops.moe.deepseek_triton import hash_select_triton, sqrtsoftplus_select_triton

    with pytest.raises(ValueError, match=r"sqrtsoftplus_select_triton: logits must be fp32"):
        sqrtsoftplus_select_triton(torch.zeros(4, E, dtype=torch.bfloat16), None, top_k=2, norm_topk_prob=True,
                                   routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match=r"hash_select_triton: logits must be fp32"):
        hash_select_triton(torch.zeros(4, E, dtype=torch.bfloat16), w["tid2eid"], torch.zeros(4, dtype=torch.long),
                           norm_topk_prob=True, routed_scaling_factor=1.0)
    # the dispatcher's checks still run first on the Triton path (CPU tensors: ranges too)
    with pytest.raises(ValueError, match=r"top_k = 9 must be in \[1, 8\]"):
        sqrtsoftplus_select(torch.zeros(4, E), None, top_k=9)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        hash_select(torch.zeros(4, E), w["tid2eid"], torch.tensor([0, 1, 2, 50]))


def test_errors(gen):
    w, x = _weights(gen), _x(gen, n=4)
    logits = torch.zeros(4, E)
    with pytest.raises(ValueError, match=r"top_k = 9 must be in \[1, 8\]"):
        sqrtsoftplus_select(logits, None, top_k=9)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        sqrtsoftplus_select(logits, torch.zeros(7), top_k=2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        hash_select(logits, w["tid2eid"], torch.tensor([0, 1, 2, 50]))
    with pytest.raises(ValueError, match=r"tid2eid entries must be expert ids in \[0, 8\)"):
        hash_select(logits, w["tid2eid"] + 6, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="integer"):
        hash_select(logits, w["tid2eid"].float(), torch.tensor([0, 1, 2, 3]))
    ids = torch.zeros(4, K, dtype=torch.int32)
    with pytest.raises(ValueError, match="gate"):
        swiglu_expert_outputs(x, ids, torch.ones(4, K), w["w1"][:, :5], w["w3"], w["w2"], swiglu_limit=LIMIT)
    with pytest.raises(ValueError, match="weights"):
        swiglu_expert_outputs(x, ids, torch.ones(4, 2), w["w1"], w["w3"], w["w2"], swiglu_limit=LIMIT)
    with pytest.raises(ValueError, match="swiglu_limit"):
        swiglu_expert_outputs(x, ids, torch.ones(4, K), w["w1"], w["w3"], w["w2"], swiglu_limit=0.0)


# ----------------------------------------------------------------------------- Triton kernels
# Through the interpreter on CPU (natively on CUDA). T = 40, K = 3, E = 8: experts get ~15 rows,
# crossing the interpreter's 16-row expert tiles; I = 96 < BLOCK_N (masked N); D = 80 > BLOCK_K
# (two K steps, masked tail).


@pytest.fixture
def kdev(monkeypatch, device):
    """The device of the Triton kernels, with the Triton backend forced (CPU: the interpreter)."""
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    return device


def _to(dev, w):
    return {k: v.to(dev) for k, v in w.items()}


@pytest.mark.parametrize("route", [ROUTE, dict(norm_topk_prob=False, routed_scaling_factor=1.0)])
def test_triton_router_vs_fp64_reference(kdev, gen, route, monkeypatch):
    """The selection kernel: ids equal the fp64 oracle's (no near-ties in this draw), weights within
    rtol 1e-5 (interpreter measured 1.5e-7; the GPU's approximate exp costs a few fp32 ulps), for the
    biased top-k and the hash router; and the same ids as the CPU path."""
    w, x, tok = _weights(gen), _x(gen), _ids(gen)
    wd, xd, tokd = _to(kdev, w), x.to(kdev), tok.to(kdev)
    wts, ids = ops.sqrtsoftplus_route(xd, wd["gate"], wd["bias"], top_k=K, **route)
    assert wts.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, K)
    rw, rids = sqrtsoftplus_route_reference(x, w["gate"], w["bias"], top_k=K, **route)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(wts.cpu().double(), rw, rtol=1e-5, atol=1e-7)
    hw, hids = ops.hash_route(xd, wd["gate"], wd["tid2eid"], tokd, **route)
    assert torch.equal(hids.cpu().long(), w["tid2eid"][tok])
    rhw, _ = hash_route_reference(x, w["gate"], w["tid2eid"], tok, **route)
    torch.testing.assert_close(hw.cpu().double(), rhw, rtol=1e-5, atol=1e-7)
    if route["norm_topk_prob"]:
        torch.testing.assert_close(wts.sum(-1).cpu(), torch.full((T,), 1.5), rtol=1e-6, atol=0)
    with monkeypatch.context() as m:
        m.setenv("UM_OPS_BACKEND", "torch")
        cpu_ids = sqrtsoftplus_select(ops.moe.router_logits(x, w["gate"]), w["bias"], top_k=K, **route)[1]
    assert torch.equal(ids.cpu(), cpu_ids)  # GPU / interpreter and CPU: the same selection rule
    # tiny logits: sqrt(softplus(l)) ~ exp(l / 2) keeps its relative accuracy (log1p series, no 1 + e)
    lg = torch.tensor([[-30.0, -25.0, -20.0, -18.0, -12.0, -8.0, 0.0, 25.0]]).to(kdev)
    sw, sids = sqrtsoftplus_select(lg, None, top_k=8, norm_topk_prob=False, routed_scaling_factor=1.0)
    want = torch.sqrt(torch.nn.functional.softplus(lg.cpu().double()))
    torch.testing.assert_close(sw.cpu().double(), want.gather(1, sids.cpu().long()), rtol=1e-5, atol=0)


def test_triton_router_ties_lower_index_wins(kdev):
    """Constructed equal scores through the kernel: the lower expert index wins every tie, slots
    best first, the bias only selects (the CPU test's cases, the same answers)."""
    logits = torch.tensor([[0.0, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 0.0],
                           [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3],
                           [0.0, 0.0, 0.2, 0.9, 0.2, 0.0, 0.9, 0.2]])
    w, ids = sqrtsoftplus_select(logits.to(kdev), None, top_k=3, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert ids.cpu().tolist() == [[1, 3, 5], [0, 1, 2], [3, 6, 2]]
    w = w.cpu()
    assert torch.all(w[1] == w[1, 0]) and torch.all(w[0] == w[0, 0])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.1, 0.0])
    w, ids = sqrtsoftplus_select(logits[1:2].to(kdev), bias.to(kdev), top_k=2, norm_topk_prob=True,
                                 routed_scaling_factor=1.5)
    assert ids.cpu().tolist() == [[4, 6]] and torch.equal(w.cpu(), torch.tensor([[0.75, 0.75]]))
    # E not a power of two (padded lanes never win), all equal: the lowest indices, in order
    w, ids = sqrtsoftplus_select(torch.full((2, 6), -0.5).to(kdev), None, top_k=6, norm_topk_prob=True,
                                 routed_scaling_factor=1.0)
    assert ids.cpu().tolist() == [list(range(6))] * 2
    # through the router GEMM: identical gate rows give identical logits
    gate = torch.zeros(E, 16, dtype=torch.bfloat16)
    gate[[2, 5, 7]] = 1.0
    gate[[0, 4]] = 0.5
    _, ids = ops.sqrtsoftplus_route(torch.ones(3, 16, dtype=torch.bfloat16).to(kdev), gate.to(kdev), None, top_k=4)
    assert ids.cpu().tolist() == [[2, 5, 7, 0]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_experts_vs_fp64_reference(kdev, dtype, gen, inv):
    """The grouped clamped-SwiGLU kernels against the fp64 oracle (clamps active): relative error
    below 1e-5 (fp32) / 5e-3 (bf16; measured 1.9e-3, the bf16 rounding of h and the output); the
    shared expert likewise; the unit-weight combine is the slot-order sum; run twice: bitwise."""
    w, x = _weights(gen, dtype), _x(gen, dtype=dtype)
    wd, xd = _to(kdev, w), x.to(kdev)
    wts, ids = ops.sqrtsoftplus_route(xd, wd["gate"], wd["bias"], top_k=K, **ROUTE)
    shared = ops.swiglu_shared_expert(xd, wd["s1"], wd["s3"], wd["s2"], swiglu_limit=LIMIT)
    assert shared.dtype == torch.float32
    sref = swiglu_shared_expert_reference(x, w["s1"], w["s3"], w["s2"], swiglu_limit=LIMIT)
    assert _rel(shared.cpu(), sref) < TOL[dtype] / 4
    out = ops.swiglu_experts(xd, ids, wts, wd["w1"], wd["w3"], wd["w2"], shared, swiglu_limit=LIMIT)
    assert out.dtype == dtype
    ref = swiglu_experts_reference(x, ids.cpu(), wts.cpu(), w["w1"], w["w3"], w["w2"], shared.cpu(),
                                   swiglu_limit=LIMIT)
    err = _rel(out.cpu(), ref)
    print(f"triton swiglu_experts {dtype}: rel err {err:.2e}")
    assert err < TOL[dtype] / 4, err
    y = swiglu_expert_outputs(xd, ids, wts, wd["w1"], wd["w3"], wd["w2"], swiglu_limit=LIMIT).view(T, K, D)
    acc = torch.zeros(T, D, device=y.device)
    for k in range(K):
        acc = acc + y[:, k]
    inv.assert_bitwise(out, (acc + shared).to(dtype), "unit-weight combine")
    inv.assert_bitwise(ops.swiglu_experts(xd, ids, wts, wd["w1"], wd["w3"], wd["w2"], shared, swiglu_limit=LIMIT),
                       out, "run twice")


def test_triton_experts_nvfp4_weights(kdev, gen, monkeypatch):
    """NVFP4 expert stacks through the same kernels (dequantized in the K loop by ModelOpt's rule, the
    Nemotron-H tile) against the CPU path on the same NVFP4 weights: relative error below 1e-6
    (both sum exact products of the same bf16 values)."""
    from unified_models.ops.nvfp4 import nvfp4_quantize

    w, x = _weights(gen), _x(gen, n=24)
    wts, ids = sqrtsoftplus_route_reference(x, w["gate"], w["bias"], top_k=K, **ROUTE)
    q = [nvfp4_quantize(w[k]) for k in ("w1", "w3", "w2")]
    with monkeypatch.context() as m:
        m.setenv("UM_OPS_BACKEND", "torch")
        cpu = swiglu_expert_outputs(x, ids, wts.float(), *q, swiglu_limit=LIMIT)
    qd = [type(t)(*(None if f is None else f.to(kdev) for f in (t.weight, t.weight_scale, t.weight_scale_2,
                                                                 t.input_scale))) for t in q]
    got = swiglu_expert_outputs(x.to(kdev), ids.to(kdev), wts.float().to(kdev), *qd, swiglu_limit=LIMIT)
    assert _rel(got.cpu(), cpu) < 1e-6


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-large): g / inf = -0
@pytest.mark.parametrize("hash_routing", [False, True])
def test_triton_moe_batch_invariant(kdev, hash_routing, gen, inv):
    """The whole MoE on the kernels (router GEMM + selection, shared expert, grouped experts, combine):
    each row bitwise the same alone, in prefixes, split, and in random subsets in random order with
    zero and junk padding rows."""
    w = _to(kdev, _weights(gen))
    x, tok = _x(gen).to(kdev), _ids(gen).to(kdev)
    pads = inv.padding(D, torch.bfloat16, gen, 30.0)

    def pad(n):
        return tuple(t.to(kdev) for t in pads(n) + (torch.randint(0, V, (n,), generator=gen),))

    inv.check_rows(lambda a, t: _moe(a, t, w, hash_routing), (x, tok), pad, gen, trials=2, pad_counts=(24, 5),
                   what=f"triton hash={hash_routing}")


def test_triton_one_expert_plan_is_moe_plan(kdev):
    """The shared expert's sort-free plan equals the grouped GEMM's plan for one expert and one slot."""
    from unified_models.ops.moe.deepseek_triton import expert_plan
    from unified_models.ops.moe.triton import BLOCK_M, moe_plan
    from unified_models.ops.triton._common import INTERPRET

    for t in (1, BLOCK_M - 1, BLOCK_M, BLOCK_M + 1, 3 * BLOCK_M + 5):
        ids = torch.zeros(t, 1, dtype=torch.int32, device=kdev)
        got, want = expert_plan(ids, 1), moe_plan(ids, 1, BLOCK_M, exact=INTERPRET)
        assert got[2] == want[2], t
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), t
