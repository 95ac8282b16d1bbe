"""The MoE experts' backwards (relu2; DeepSeek-V4's clamped SwiGLU) run experts in groups of one padded row
count (``expert_groups_by_count``): one batched GEMM per product per group instead of a dozen GEMMs and
gathers per expert.

Checked: the grouping rule (every expert with assignments exactly once, padding below a quarter of its count,
few groups); gradients vs fp64 autograd of the oracle under routings that stress the padding (one expert takes
most assignments, empty experts, every count different); the same bits on a repeated backward; the launch
count per backward no longer grows with the number of experts.
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops.moe import moe_experts_reference
from unified_models.ops.moe.backward import expert_groups_by_count

from tensor_cores import emulate_tensor_cores, gemm_work

T, D, I, K = 48, 40, 24, 3
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def test_groups_cover_every_expert_once_with_bounded_padding():
    g = torch.Generator().manual_seed(0)
    counts = [0, 1, 7, 8, 9, 15, 16, 17, 100, 127, 128, 129, 1000, 0, 5000] + \
        torch.randint(0, 3000, (200,), generator=g).tolist()
    groups = expert_groups_by_count(counts)
    seen = [e for _, es in groups for e in es]
    assert sorted(seen) == [e for e, c in enumerate(counts) if c > 0]  # each expert with rows, once
    assert [p for p, _ in groups] == sorted({p for p, _ in groups})  # one group per size, ascending
    for P, es in groups:
        assert es == sorted(es)
        for e in es:
            c = counts[e]
            assert c <= P and (P == c if c < 8 else P - c < c / 4), (c, P)
    assert len(groups) <= 4 * max(counts).bit_length() + 4
    # near-uniform routing (the Nano step: 16,384 tokens x top-6 over 128 experts): a handful of groups
    uniform = torch.distributions.Poisson(768.0).sample((128,)).long().tolist()
    assert len(expert_groups_by_count(uniform)) <= 4
    assert expert_groups_by_count([0, 0]) == []


def _ids(kind: str, E: int, gen) -> torch.Tensor:
    """``[T, K]`` int32 routing, K distinct experts per token."""
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    if kind == "skewed":  # expert 0 in every token, experts 1..3 share the rest, 4.. empty
        return torch.stack([torch.tensor([0, 1 + t % 3, 1 + (t + 1) % 3]) for t in range(T)]).int()
    if kind == "staircase":  # every expert a different count (1, 2, 3, ...)
        rows = [e for e in range(E) for _ in range(e + 1)][:T * K]
        return torch.tensor(rows).view(K, T).t().contiguous().int()  # column k holds a run: distinct per token
    raise ValueError(kind)


@pytest.mark.parametrize("kind,E", [("random", 16), ("skewed", 8), ("staircase", 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_backward_matches_fp64_autograd(kind, E, dtype, device):
    """On CUDA (``scripts/gpu-run.sh moe-kernels``) the batched GEMMs are ``torch.bmm(out_dtype=fp32)``."""
    gen = torch.Generator().manual_seed(3)
    ids = _ids(kind, E, gen)
    assert all(len(set(r)) == K for r in ids.tolist())
    x = torch.randn(T, D, generator=gen).to(dtype)
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    shared = torch.randn(T, D, generator=gen).to(dtype)
    up = (torch.randn(E, I, D, generator=gen) / D ** 0.5).to(dtype)
    down = (torch.randn(E, D, I, generator=gen) / I ** 0.5).to(dtype)
    g = torch.randn(T, D, generator=gen).to(dtype)
    leaves = [t.detach().clone().to(device).requires_grad_() for t in (x, w, shared, up, down)]
    ops.moe_experts(leaves[0], ids.to(device), leaves[1], leaves[3], leaves[4], leaves[2]).backward(g.to(device))
    ref = [t.detach().double().requires_grad_() for t in (x, w, shared, up, down)]
    moe_experts_reference(ref[0], ids, ref[1], ref[3], ref[4], ref[2]).backward(g.double())
    for name, a, b in zip(("x", "weights", "shared", "up", "down"), leaves, ref):
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        if b.grad.norm() == 0:  # empty experts' slices are zero in both
            assert float(a.grad.abs().max()) == 0.0, name
            continue
        err = float((a.grad.double().cpu() - b.grad).norm() / b.grad.norm())
        assert err <= TOL[dtype], f"{kind} {name}: {err:.2e}"
    if kind == "skewed":  # experts 4.. had no rows: exactly zero gradient
        assert float(leaves[3].grad[4:].abs().max()) == 0.0 and float(leaves[4].grad[4:].abs().max()) == 0.0


def test_repeated_backward_gives_the_same_bits(device):
    gen = torch.Generator().manual_seed(5)
    E = 12
    ids = _ids("random", E, gen).to(device)
    x = torch.randn(T, D, generator=gen).bfloat16().to(device)
    w = torch.softmax(torch.randn(T, K, generator=gen), -1).to(device)
    up = (torch.randn(E, I, D, generator=gen) / D ** 0.5).bfloat16().to(device)
    down = (torch.randn(E, D, I, generator=gen) / I ** 0.5).bfloat16().to(device)
    g = torch.randn(T, D, generator=gen).bfloat16().to(device)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, up, down)]
        ops.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3]).backward(g)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_backward_launches_do_not_grow_with_the_expert_count():
    """The backward's op count at 8 and at 64 experts (4,096 tokens, near-uniform routing: a few groups
    each): a per-expert loop made it grow ~8x (~40 ops per expert); grouped, it stays nearly flat."""
    from torch.profiler import ProfilerActivity, profile

    def ops_in_backward(E):
        gen = torch.Generator().manual_seed(E)
        ids = torch.rand(4096, E, generator=gen).argsort(-1)[:, :K].int()
        x = torch.randn(4096, D, generator=gen).bfloat16().requires_grad_()
        w = torch.softmax(torch.randn(4096, K, generator=gen), -1).requires_grad_()
        up = (torch.randn(E, I, D, generator=gen) / D ** 0.5).bfloat16().requires_grad_()
        down = (torch.randn(E, D, I, generator=gen) / I ** 0.5).bfloat16().requires_grad_()
        out = ops.moe_experts(x, ids, w, up, down)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out.backward(torch.ones_like(out))
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children)

    few, many = ops_in_backward(8), ops_in_backward(64)
    assert many < 1.5 * few, (few, many)


def testgroup_weights_equal_one_expert_at_a_time():
    """A group's weights (bf16 stack indexed; NVFP4 stack dequantized at once) == ``expert_weight`` per expert."""
    from unified_models.ops.moe.backward import group_weight
    from unified_models.ops.moe.common import expert_weight
    from unified_models.ops.nvfp4 import nvfp4_quantize

    gen = torch.Generator().manual_seed(9)
    stack = (torch.randn(6, 32, 64, generator=gen) * torch.logspace(-2, 1, 6)[:, None, None]).bfloat16()
    for w in (stack, nvfp4_quantize(stack)):
        for es in ([1, 4, 5], list(range(6)), [3]):
            got = group_weight(w, es, torch.tensor(es), torch.bfloat16)
            want = torch.stack([expert_weight(w, e, torch.bfloat16) for e in es])
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (type(w).__name__, es)


@pytest.mark.parametrize("kind,E", [("skewed", 8), ("staircase", 17)])
def test_deepseek_swiglu_grouped_backward_matches_fp64_autograd(kind, E):
    """DeepSeek-V4's clamped-SwiGLU experts take the same groups (autograd over batched GEMMs, fp32);
    the limit small enough that the clamps bite."""
    from unified_models.ops.moe import swiglu_experts_reference

    gen = torch.Generator().manual_seed(4)
    ids = _ids(kind, E, gen)
    x = torch.randn(T, D, generator=gen)
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    shared = torch.randn(T, D, generator=gen)
    mats = [(torch.randn(E, I, D, generator=gen) / D ** 0.5), (torch.randn(E, I, D, generator=gen) / D ** 0.5),
            (torch.randn(E, D, I, generator=gen) / I ** 0.5)]
    g = torch.randn(T, D, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, w, shared, *mats)]
    ops.swiglu_experts(leaves[0], ids, leaves[1], *leaves[3:], leaves[2], swiglu_limit=0.5).backward(g)
    ref = [t.double().requires_grad_() for t in (x, w, shared, *mats)]
    swiglu_experts_reference(ref[0], ids, ref[1], *ref[3:], ref[2], swiglu_limit=0.5).backward(g.double())
    for name, a, b in zip(("x", "weights", "shared", "w1", "w3", "w2"), leaves, ref):
        if b.grad.norm() == 0:
            assert float(a.grad.abs().max()) == 0.0, name
            continue
        err = float((a.grad.double() - b.grad).norm() / b.grad.norm())
        assert err <= 1e-5, f"{kind} {name}: {err:.2e}"


def test_padding_rows_stay_zero_beside_an_infinite_weight():
    """A helper's case: 9 assignments pad to 10 rows; an ``-inf`` in the up weight made the padding row's
    ``0 * inf`` a NaN in the weight gradients, where one expert at a time (and fp64) gives 0."""
    g = torch.Generator().manual_seed(0)
    n, d, i = 9, 4, 3
    x = torch.randn(n, d, generator=g).abs() + 0.1
    ids = torch.zeros(n, 1, dtype=torch.int32)
    w = torch.rand(n, 1, generator=g)
    up = torch.randn(1, i, d, generator=g)
    up[0, 0, 0] = -float("inf")  # u[:, 0] = -inf for every real row: relu^2 = 0
    down = torch.randn(1, d, i, generator=g)
    go = torch.randn(n, d, generator=g)
    assert expert_groups_by_count([n]) == [(10, [0])]
    u_, d_ = up.clone().requires_grad_(), down.clone().requires_grad_()
    ops.moe_experts(x, ids, w, u_, d_).backward(go)
    assert bool(torch.isfinite(d_.grad).all()) and bool(torch.isfinite(u_.grad).all())
    assert float(d_.grad[0, :, 0].abs().max()) == 0.0 and float(u_.grad[0, 0].abs().max()) == 0.0


def _forward_gemm_work(ids: torch.Tensor, E: int) -> int:
    """Multiply-adds of one ``[P, D] x [D, I]`` GEMM per expert group (its padded rows): the forward's size."""
    counts = [0] * E
    for e in ids.view(-1).tolist():
        counts[e] += 1
    return sum(p * len(es) * D * I for p, es in expert_groups_by_count(counts))


def test_deepseek_recompute_gemms_take_the_tensor_core_path(monkeypatch):
    """In a bf16 model the recomputation's GEMMs and their gradients go through ``grad_matmul``'s CUDA path
    (emulated here: bf16 operands, exact products, fp32 sums): every call gets bf16 operands only (the
    input and weights as one term, fp32 values split), and the gradients stay within the bf16 bounds of
    fp64 autograd (the routing weights' fp32 gradient within 2^-15)."""
    from unified_models.ops.grad import helpers
    from unified_models.ops.moe import swiglu_experts_reference

    calls = emulate_tensor_cores(monkeypatch, helpers)  # the backward calls the helpers module's grad_matmul
    E = 17
    gen = torch.Generator().manual_seed(6)
    ids = _ids("staircase", E, gen)
    x = torch.randn(T, D, generator=gen).bfloat16()
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    mats = [(torch.randn(E, I, D, generator=gen) / D ** 0.5).bfloat16(),
            (torch.randn(E, I, D, generator=gen) / D ** 0.5).bfloat16(),
            (torch.randn(E, D, I, generator=gen) / I ** 0.5).bfloat16()]
    g = torch.randn(T, D, generator=gen).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, w, *mats)]
    ops.swiglu_experts(leaves[0], ids, leaves[1], *leaves[2:], swiglu_limit=0.5).backward(g)
    one_gemm = _forward_gemm_work(ids, E)
    print(f"swiglu backward GEMM work: {gemm_work(calls) / one_gemm:.2f} GEMMs of the forward's size")
    assert 0 < gemm_work(calls) <= 13 * one_gemm, gemm_work(calls) / one_gemm  # all with bf16 operands; 17 by autograd
    ref = [t.double().requires_grad_() for t in (x, w, *mats)]
    swiglu_experts_reference(ref[0], ids, ref[1], *ref[2:], swiglu_limit=0.5).backward(g.double())
    for name, a, b in zip(("x", "weights", "w1", "w3", "w2"), leaves, ref):
        err = float((a.grad.double() - b.grad).norm() / b.grad.norm())
        print(f"GRAD-ERR deepseek recompute tensor-core {name}: {err:.2e}")
        assert err <= (2 ** -15 if a.dtype == torch.float32 else TOL[torch.bfloat16]), f"{name}: {err:.2e}"


@pytest.mark.parametrize("mode, gemms", [("split", 8), ("bf16", 5)])
def test_relu2_backward_gemms_on_the_tensor_core_path(mode, gemms, monkeypatch):
    """A bf16 model's relu^2 experts backward through ``grad_matmul``'s CUDA path (emulated: bf16 operands,
    exact products, fp32 sums): every GEMM takes bf16 operands, the upstream gradient enters as one bf16
    term (the routing weight applied as a row scaling, ``dw`` from ``g down``): the work of at most 8 GEMMs
    of the forward's size (12 before), 5 with ``UM_BACKWARD_GEMM=bf16`` (Megatron-core's all-bf16 backward
    does 6); the gradients stay within the bf16 bounds of fp64 autograd (the fp32 routing weights' within
    2^-15: ``g down`` is an exact GEMM in both modes)."""
    monkeypatch.setenv("UM_BACKWARD_GEMM", mode)
    from unified_models.ops.moe import backward as moe_backward

    calls = emulate_tensor_cores(monkeypatch, moe_backward)
    E = 17
    gen = torch.Generator().manual_seed(7)
    ids = _ids("staircase", E, gen)
    x = torch.randn(T, D, generator=gen).bfloat16()
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    up = (torch.randn(E, I, D, generator=gen) / D ** 0.5).bfloat16()
    down = (torch.randn(E, D, I, generator=gen) / I ** 0.5).bfloat16()
    g = torch.randn(T, D, generator=gen).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, w, up, down)]
    ops.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3]).backward(g)
    one_gemm = _forward_gemm_work(ids, E)
    print(f"relu2 backward GEMM work: {gemm_work(calls) / one_gemm:.2f} GEMMs of the forward's size")
    assert gemm_work(calls) <= gemms * one_gemm, gemm_work(calls) / one_gemm
    ref = [t.double().requires_grad_() for t in (x, w, up, down)]
    moe_experts_reference(ref[0], ids, ref[1], ref[2], ref[3]).backward(g.double())
    for name, a, b in zip(("x", "weights", "up", "down"), leaves, ref):
        err = float((a.grad.double() - b.grad).norm() / b.grad.norm())
        print(f"GRAD-ERR relu2 tensor-core {mode} {name}: {err:.2e}")
        assert err <= (2 ** -15 if a.dtype == torch.float32 else TOL[torch.bfloat16]), f"{name}: {err:.2e}"
