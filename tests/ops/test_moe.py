"""MoE (Nemotron-H): router, grouped relu2 experts (bf16 and NVFP4 weights), ordered combine.

Checked: router and experts vs fp64 oracles and vs transformers' ``NemotronHMoE``;
router ties on constructed equal scores (rule: the lower expert index wins;
slots best first); bitwise batch invariance of the whole MoE for random batch
compositions, on the CPU torch path and the Triton kernels (interpreter on
CPU); the interpreter kernels equal the CPU path bit for bit; gradients vs
fp64 autograd (STE through NVFP4); the weight-version guard.

Shapes are small but cross the interpreter's tiles: BLOCK_M = 16 rows per
expert tile (experts get 0 to ~20 assignments), I = 96 < BLOCK_N = 128
(masked N), D = 80 > BLOCK_K = 64 (two K steps with a masked tail).
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops import StaleWeightError
from unified_models.ops.moe import (
    moe_combine_torch,
    moe_expert_outputs_torch,
    moe_experts_reference,
    moe_route_reference,
    moe_select,
    moe_shared_expert_reference,
    total_order_keys,
)
from unified_models.ops.nvfp4 import nvfp4_dequantize, nvfp4_quantize

T, D, I, E, K, S = 40, 80, 96, 8, 2, 112  # S: shared expert width
ROUTE = dict(top_k=K, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
GROUPED = dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch, device):
    monkeypatch.setenv("UM_OPS_BACKEND", request.param)
    return request.param


@pytest.fixture
def dev(backend, device):
    """Where the op runs: the CPU torch implementation, or the Triton kernels (CUDA, or the interpreter)."""
    return "cpu" if backend == "torch" else device


def _weights(gen, dtype=torch.bfloat16, d=D, i=I, e=E, s=S, dev="cpu"):
    return dict(
        gate=(torch.randn(e, d, generator=gen) / d ** 0.5).to(dtype).to(dev),
        bias=(torch.randn(e, generator=gen) * 0.05).to(dev),
        up=(torch.randn(e, i, d, generator=gen) / d ** 0.5).to(dtype).to(dev),
        down=(torch.randn(e, d, i, generator=gen) / i ** 0.5).to(dtype).to(dev),
        sup=(torch.randn(s, d, generator=gen) / d ** 0.5).to(dtype).to(dev),
        sdown=(torch.randn(d, s, generator=gen) / s ** 0.5).to(dtype).to(dev),
    )


def _x(gen, n=T, dtype=torch.bfloat16, dev="cpu"):
    return torch.randn(n, D, generator=gen).to(dtype).to(dev)




def _moe(x, w, nvfp4=False, route=ROUTE):
    """The whole Nemotron-H MoE mixer as a layer would call it."""
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **route)
    shared = ops.moe_shared_expert(x, w["sup"], w["sdown"], nvfp4=nvfp4)
    return ops.moe_experts(x, ids, weights, w["up"], w["down"], shared, nvfp4=nvfp4)


def _rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------- router


@pytest.mark.parametrize("route", [ROUTE, GROUPED, dict(ROUTE, norm_topk_prob=False, routed_scaling_factor=1.0)])
def test_router_vs_fp64_reference(route, dev, gen):
    w, x = _weights(gen), _x(gen)
    weights, ids = ops.moe_route(x.to(dev), w["gate"].to(dev), w["bias"].to(dev), **route)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, route["top_k"])
    rw, rids = moe_route_reference(x, w["gate"], w["bias"], **route)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(weights.cpu().double(), rw, rtol=1e-5, atol=1e-6)


def test_router_matches_transformers(gen):
    """Against transformers' NemotronHTopkRouter (fp32), grouped routing included; transformers'
    top-k is unsorted, so ids are compared as sets and weights per expert."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    for route in (ROUTE, GROUPED):
        cfg = NemotronHConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=route["top_k"],
                              n_group=route["n_group"], topk_group=route["topk_group"],
                              routed_scaling_factor=route["routed_scaling_factor"], norm_topk_prob=True)
        r = NemotronHTopkRouter(cfg)
        w = _weights(gen, torch.float32)
        with torch.no_grad():
            r.weight.copy_(w["gate"])
            r.e_score_correction_bias.copy_(w["bias"])
        x = torch.randn(T, D, generator=gen)
        _, hw, hids = r(x)
        weights, ids = ops.moe_route(x, w["gate"], w["bias"], **route)
        order_h, order_o = hids.sort(-1), ids.long().sort(-1)
        assert torch.equal(order_h.values, order_o.values)
        torch.testing.assert_close(weights.gather(1, order_o.indices), hw.gather(1, order_h.indices),
                                   rtol=1e-5, atol=1e-6)


def test_total_order_keys():
    """Keys rank fp32 values descending, -0.0 == +0.0, ties to the lower column."""
    v = torch.tensor([[-float("inf"), -2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, float("inf"), 1.0]])
    k = total_order_keys(v)[0]
    assert k.unique().numel() == 10
    order = torch.argsort(k, descending=True).tolist()
    assert order == [8, 7, 9, 6, 4, 5, 3, 2, 1, 0]  # 1.0 at col 7 before col 9; -0.0 (col 4) == +0.0 (col 5)


def test_router_ties_lower_index_wins():
    """Constructed equal scores: the lower expert index wins every tie, slots best first."""
    logits = torch.tensor([[0.0, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 0.0],   # three-way tie at the top
                           [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3],   # all equal
                           [0.0, 0.0, 0.2, 0.9, 0.2, 0.0, 0.9, 0.2]])  # tie across the k boundary
    w, ids = moe_select(logits, None, top_k=3, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert ids.tolist() == [[1, 3, 5], [0, 1, 2], [3, 6, 2]]
    assert torch.all(w[1] == w[1, 0])  # equal scores, equal weights
    # the bias decides among equal scores; the weights still come from the unbiased scores
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.1, 0.0])
    w, ids = moe_select(logits[1:2], bias, top_k=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    assert ids.tolist() == [[4, 6]] and torch.equal(w, torch.tensor([[1.25, 1.25]]))
    # through the router GEMM: identical gate rows give identical logits
    gate = torch.zeros(E, 16, dtype=torch.bfloat16)
    gate[[2, 5, 7]] = 1.0
    gate[[0, 4]] = 0.5
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    w, ids = ops.moe_route(x, gate, None, top_k=4, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert ids.tolist() == [[2, 5, 7, 0]] * 3


def test_router_group_ties():
    """Equal group scores: the lower group index wins; experts outside the kept groups never win."""
    logits = torch.full((1, 8), -1.0)
    logits[0, [0, 1]] = 0.5  # group 0 score = 2 * sigmoid(0.5)
    logits[0, [4, 5]] = 0.5  # group 2: the same score
    logits[0, [6]] = 2.0  # group 3: one high expert, one at -1: lower group score
    _, ids = moe_select(logits, None, top_k=2, n_group=4, topk_group=1, routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1]]
    _, ids = moe_select(logits, None, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1, 4]]


def test_router_errors():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    gate = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(x, gate, None, top_k=9)
    with pytest.raises(ValueError, match="n_group"):
        ops.moe_route(x, gate, None, top_k=2, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        ops.moe_route(x, gate, None, top_k=5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="do not match"):
        ops.moe_route(x, torch.zeros(8, 12, dtype=torch.bfloat16), None, top_k=2)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        ops.moe_route(x, gate, torch.zeros(7), top_k=2)


# ---------------------------------------------------------------------------- experts


@pytest.mark.parametrize("nvfp4", [False, True])
def test_moe_vs_fp64_reference(nvfp4, backend, dev, gen):
    w, x = _weights(gen), _x(gen)
    wd = {k: v.to(dev) for k, v in w.items()}
    out = _moe(x.to(dev), wd, nvfp4)
    assert out.shape == (T, D) and out.dtype == torch.bfloat16
    weights, ids = (t.cpu() for t in ops.moe_route(x.to(dev), wd["gate"], wd["bias"], **ROUTE))
    up, down, sup, sdown = w["up"], w["down"], w["sup"], w["sdown"]
    if nvfp4:  # the oracle computes with the dequantized weights (ModelOpt's rule)
        up, down, sup, sdown = (nvfp4_quantize(t) for t in (up, down, sup, sdown))
    ref = moe_experts_reference(x, ids, weights, up, down, moe_shared_expert_reference(x, sup, sdown))
    err = _rel(out, ref)
    print(f"MOE-ERR nvfp4={nvfp4} {backend}: {err:.2e}")
    assert err < 8e-3  # bf16 h and one bf16 output rounding


def test_interpreter_equals_torch_impl(device, gen, inv):
    """Under the interpreter the grouped GEMM and the combine equal the CPU torch implementation
    bit for bit (exact sums rounded once; fp32 elementwise combine), for bf16 and NVFP4 weights."""
    if device != "cpu":
        pytest.skip("the interpreter path exists only on CPU")
    from unified_models.ops.moe.triton import moe_combine_triton, moe_expert_outputs_triton

    w = _weights(gen)
    x = torch.randn(T, D, generator=gen).bfloat16()
    x[3] = 0.0
    x[5] *= 2.0 ** -40
    x[6] *= 2.0 ** 30
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **ROUTE)
    for up, down in ((w["up"], w["down"]), (nvfp4_quantize(w["up"]), nvfp4_quantize(w["down"]))):
        y_t = moe_expert_outputs_triton(x, ids, up, down)
        y_c = moe_expert_outputs_torch(x, ids, up, down)
        inv.assert_bitwise(y_t, y_c, "expert outputs interpreter vs torch")
        shared = torch.randn(T, D, generator=gen)
        for s in (None, shared, shared.bfloat16()):
            for od in (torch.bfloat16, torch.float32):
                inv.assert_bitwise(moe_combine_triton(y_t, weights, s, od), moe_combine_torch(y_c, weights, s, od),
                                   "combine interpreter vs torch")


def test_nvfp4_kernel_uses_modelopt_dequantization(dev, gen, inv):
    """Experts with NVFP4 weights == the same experts with the bf16 weights ModelOpt's dequantizer
    gives (the kernel dequantizes tiles in-kernel by the same rule)."""
    w, x = _weights(gen, dev=dev), _x(gen, dev=dev)
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **ROUTE)
    qu, qd = nvfp4_quantize(w["up"]), nvfp4_quantize(w["down"])
    a = ops.moe_experts(x, ids, weights, qu, qd)
    b = ops.moe_experts(x, ids, weights, nvfp4_dequantize(qu), nvfp4_dequantize(qd))
    c = ops.moe_experts(x, ids, weights, w["up"], w["down"], nvfp4=True)
    inv.assert_bitwise(a, b, "NVFP4 kernel vs dequantized bf16")
    inv.assert_bitwise(a, c, "NVFP4Weight vs masters quantized on the fly")


def test_nvfp4_experts_dequantized_once_equal_in_loop(device, gen, inv, monkeypatch):
    """Large batches dequantize the NVFP4 experts once per call instead of in every row tile's K
    loop (``NVFP4_DEQUANTIZE_ROWS_PER_EXPERT``): the dequantize kernel equals ModelOpt's rule bit for
    bit, and the expert outputs of the two paths are bitwise equal (the batch size picks the path, so
    a row's bits must not depend on it). The threshold is forced to 0 for the second call."""
    from unified_models.ops.moe import triton as moe_triton

    w, x = _weights(gen, dev=device), _x(gen, dev=device)
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **ROUTE)
    qu, qd = nvfp4_quantize(w["up"]), nvfp4_quantize(w["down"])
    odd = nvfp4_quantize(torch.randn(2, 17, 48, generator=gen).bfloat16().to(device))  # N and K tails of the tiles
    for q in (qu, qd, odd):
        inv.assert_bitwise(moe_triton.nvfp4_dequantize_experts_triton(q), nvfp4_dequantize(q),
                           "dequantize kernel vs ModelOpt's rule")
    assert T * K < moe_triton.NVFP4_DEQUANTIZE_ROWS_PER_EXPERT * E  # the first call dequantizes in the K loop
    in_loop = moe_triton.moe_expert_outputs_triton(x, ids, qu, qd)
    monkeypatch.setattr(moe_triton, "NVFP4_DEQUANTIZE_ROWS_PER_EXPERT", 0)
    once = moe_triton.moe_expert_outputs_triton(x, ids, qu, qd)
    inv.assert_bitwise(once, in_loop, "NVFP4 experts dequantized once vs in the K loop")


@pytest.mark.parametrize("nvfp4", [False, True])
def test_moe_batch_invariant(nvfp4, backend, dev, gen, inv):
    """Each token's MoE output is bitwise the same whatever batch it is in (alone, prefixes, splits,
    random compositions with padding rows of zeros and of junk at random places)."""
    w = _weights(gen, dev=dev)
    if nvfp4:
        w = dict(w, up=nvfp4_quantize(w["up"]), down=nvfp4_quantize(w["down"]),
                 sup=nvfp4_quantize(w["sup"]), sdown=nvfp4_quantize(w["sdown"]))
    x = _x(gen, dev=dev)
    inv.check_rows(lambda a: _moe(a, w), (x,), inv.padding(D, torch.bfloat16, gen, 30.0), gen,
                   trials=2 if nvfp4 else 3, pad_counts=(9, 33, 0), prefixes=(1, 17) if nvfp4 else (1, 3, 17),
                   what=f"moe nvfp4={nvfp4} {backend}")


def test_moe_matches_transformers(gen):
    """fp32 weights and activations: our MoE == transformers' NemotronHMoE (eager experts)."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = NemotronHConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                          moe_shared_expert_intermediate_size=S, n_group=1, topk_group=1,
                          routed_scaling_factor=2.5, norm_topk_prob=True, mlp_hidden_act="relu2")
    m = NemotronHMoE(cfg)
    w = _weights(gen, torch.float32)
    with torch.no_grad():
        m.gate.weight.copy_(w["gate"])
        m.gate.e_score_correction_bias.copy_(w["bias"])
        m.experts.up_proj.copy_(w["up"])
        m.experts.down_proj.copy_(w["down"])
        m.shared_experts.up_proj.weight.copy_(w["sup"])
        m.shared_experts.down_proj.weight.copy_(w["sdown"])
        x = torch.randn(T, D, generator=gen)
        hf = m(x[None])[0]
    ours = _moe(x, w)
    err = _rel(ours, hf)
    print(f"MOE-VS-HF fp32: {err:.2e}")
    assert err < 1e-5


def test_moe_errors(gen):
    w = _weights(gen)
    x = torch.randn(4, D, generator=gen).bfloat16()
    ids = torch.zeros(4, 2, dtype=torch.int32)
    wts = torch.ones(4, 2)
    with pytest.raises(ValueError, match="expert ids"):
        ops.moe_experts(x, ids + E, wts, w["up"], w["down"])
    with pytest.raises(ValueError, match="do not match"):
        ops.moe_experts(x, ids, wts, w["up"], w["down"][:, :-1])
    with pytest.raises(ValueError, match="dtype"):
        ops.moe_experts(x, ids, wts, w["up"].float(), w["down"])
    with pytest.raises(ValueError, match="T = 4"):
        ops.moe_experts(x, ids[:3], wts[:3], w["up"], w["down"])


def test_empty_batch(dev, gen):
    w = _weights(gen, dev=dev)
    x = torch.zeros(0, D, dtype=torch.bfloat16, device=dev)
    assert _moe(x, w).shape == (0, D)


# ---------------------------------------------------------------------------- gradients

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_grad(dtype, backend, dev, gen, inv):
    w, x = _weights(gen, dtype, dev=dev), _x(gen, dtype=dtype, dev=dev)
    g = torch.randn(T, GROUPED["top_k"], generator=gen).to(dev)
    xs, gs = _leaves(x, w["gate"])
    weights, ids = ops.moe_route(xs, gs, w["bias"], **GROUPED)
    plain_w, plain_ids = ops.moe_route(x, w["gate"], w["bias"], **GROUPED)
    inv.assert_bitwise(weights.detach(), plain_w, "router forward with grad vs no-grad")
    assert torch.equal(ids, plain_ids) and not ids.requires_grad
    weights.backward(g)
    x64, g64 = _leaves(x.cpu().double(), w["gate"].cpu().double())
    s = torch.sigmoid(x64 @ g64.t()).gather(1, ids.cpu().long())
    (s / s.sum(-1, keepdim=True) * 2.5).backward(g.cpu().double())
    for name, a, b in (("x", xs.grad, x64.grad), ("gate", gs.grad, g64.grad)):
        assert a.dtype == dtype
        err = _rel(a, b)
        print(f"GRAD-ERR moe_route {dtype} {backend} {name}: {err:.2e}")
        assert err <= TOL[dtype], f"{name}: {err:.2e}"


@pytest.mark.parametrize("dtype,nvfp4", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_experts_grad(dtype, nvfp4, backend, dev, gen, inv):
    """Gradients to x, the routing weights, the shared output and the expert masters vs fp64 autograd
    of the oracle; with NVFP4 the oracle runs on the dequantized weights W_q and the masters must
    receive dL/dW_q (straight through)."""
    w, x = _weights(gen, dtype, dev=dev), _x(gen, dtype=dtype, dev=dev)
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **ROUTE)
    shared = torch.randn(T, D, generator=gen).to(dev)
    g = torch.randn(T, D, generator=gen).to(dtype).to(dev)
    xs, ws, ss, us, ds = _leaves(x, weights, shared, w["up"], w["down"])
    out = ops.moe_experts(xs, ids, ws, us, ds, ss, nvfp4=nvfp4)
    with torch.no_grad():
        plain = ops.moe_experts(x, ids, weights, w["up"], w["down"], shared, nvfp4=nvfp4)
    inv.assert_bitwise(out.detach(), plain, "experts forward with grad vs no-grad")
    out.backward(g)
    up_eff = nvfp4_dequantize(nvfp4_quantize(w["up"])) if nvfp4 else w["up"]
    down_eff = nvfp4_dequantize(nvfp4_quantize(w["down"])) if nvfp4 else w["down"]
    r = _leaves(*(t.cpu().double() for t in (x, weights, shared, up_eff, down_eff)))
    moe_experts_reference(r[0], ids.cpu(), r[1], r[3], r[4], r[2]).backward(g.cpu().double())
    for name, a, b in zip(("x", "weights", "shared", "up", "down"), (xs, ws, ss, us, ds), r):
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        err = _rel(a.grad, b.grad)
        print(f"GRAD-ERR moe_experts {dtype} nvfp4={nvfp4} {backend} {name}: {err:.2e}")
        assert err <= TOL[a.dtype], f"{name}: {err:.2e}"


def test_shared_expert_grad(backend, dev, gen):
    w, x = _weights(gen, torch.float32, dev=dev), _x(gen, dtype=torch.float32, dev=dev)
    g = torch.randn(T, D, generator=gen).to(dev)
    xs, us, ds = _leaves(x, w["sup"], w["sdown"])
    out = ops.moe_shared_expert(xs, us, ds)
    assert out.dtype == torch.float32
    out.backward(g)
    r = _leaves(x.cpu().double(), w["sup"].cpu().double(), w["sdown"].cpu().double())
    moe_shared_expert_reference(*r).backward(g.cpu().double())
    for name, a, b in zip(("x", "up", "down"), (xs, us, ds), r):
        err = _rel(a.grad, b.grad)
        print(f"GRAD-ERR moe_shared_expert {backend} {name}: {err:.2e}")
        assert err <= 1e-5, f"{name}: {err:.2e}"


def test_stale_expert_weight_refuses_backward(gen):
    w = _weights(gen, torch.float32)
    x = torch.randn(6, D, generator=gen)
    up = w["up"].clone().requires_grad_()
    ops.name_weights([("layers.1.mixer.experts.up_proj", up)])
    weights, ids = ops.moe_route(x, w["gate"], w["bias"], **ROUTE)
    out = ops.moe_experts(x, ids, weights, up, w["down"], nvfp4=False)
    with torch.no_grad():
        up.add_(1.0)
    with pytest.raises(StaleWeightError, match="experts.up_proj"):
        out.sum().backward()
    gate = w["gate"].clone().requires_grad_()
    weights, _ = ops.moe_route(x, gate, w["bias"], **ROUTE)
    ops.bump_weight_version(gate)
    with pytest.raises(StaleWeightError, match="moe_route"):
        weights.sum().backward()



@pytest.mark.parametrize("exact", [True, False])
def test_one_expert_plan_equals_the_sorted_one(exact):
    """The shared expert's plan (one expert, every row) built without the sort gives the tensors of the
    general expert-sorted form, tile count and sentinels included, at R = 0, 1 and around tile
    boundaries; ``moe_plan`` takes it for every one-expert stack."""
    from unified_models.ops.moe.triton import _one_expert_plan, _sorted_plan, moe_plan

    for R in (0, 1, 2, 31, 32, 33, 64, 65, 1000):
        ids = torch.zeros(R, 1, dtype=torch.int32)
        fast, general = _one_expert_plan(R, 32, exact, ids.device), _sorted_plan(ids, 1, 32, exact)
        assert fast[2] == general[2], (R, fast[2], general[2])
        for a, b in zip(fast[:2], general[:2]):
            assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (R, a, b)
        assert all(torch.equal(a, b) for a, b in zip(moe_plan(ids, 1, 32, exact)[:2], fast[:2]))


def test_triton_plan_equals_the_sorted_one(device):
    """The GPU's plan kernels (per-expert counts, then one program per expert writing its run) give the
    sort's tensors (``exact=False``: the upper-bound tile count, every sentinel and past-the-end tile
    included) for int32 and int64 ids, block_m 16/64/128, expert counts that are and are not powers of
    two, empty experts, everything on one expert, strided ids, and more assignments than one program step
    (1,024)."""
    from unified_models.ops.moe.triton import _sorted_plan, _sorted_plan_triton

    gen = torch.Generator().manual_seed(7)
    cases = [(1, 3, 16, 128), (5, 6, 64, 3), (37, 6, 16, 8), (300, 6, 128, 5), (700, 2, 64, 8)]  # (T, K, block_m, E)
    if device == "cuda":  # natively also the Nano widths' decode and prefill steps (128 experts, top-6)
        cases += [(128, 6, 64, 128), (16384, 6, 128, 128)]
    for i, (T, K, bm, E) in enumerate(cases):
        ids = torch.randint(0, E, (T, K), generator=gen)
        if i % 2:
            ids = torch.where(ids < E // 2, ids, torch.zeros_like(ids))  # the upper half empty
        if i == 3:
            ids[:] = E - 1  # every assignment on the last expert
        if i == 4:
            ids = torch.randint(0, E, (T, 2 * K), generator=gen)[:, ::2]  # a strided view
        for dt in (torch.int32, torch.int64):
            want = _sorted_plan(ids.to(dt), E, bm, exact=False)
            got = _sorted_plan_triton(ids.to(device=device, dtype=dt), E, bm)
            assert got[2] == want[2], (T, K, E, bm, got[2], want[2])
            for a, b in zip(got[:2], want[:2]):
                assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), (T, K, E, bm, dt)
