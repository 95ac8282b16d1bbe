"""``compress_pool`` (DeepSeek-V4 compressor pooling): the CPU path and the Triton kernel
(through the interpreter on CPU) against the fp64 oracle, batch invariance, ``-inf``
candidates, gradients against fp64 autograd, and the contract's errors."""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops.compressor import compress_pool_reference, compress_pool_torch
from unified_models.ops.compressor.backward import compress_pool_grads

FP32_ULP = 2.0 ** -23
NEG_INF = float("-inf")


def _kernel(device):
    """``f(kv, score)`` running the Triton kernel on ``device`` (CPU: interpreter), result on the CPU."""
    from unified_models.ops.compressor.triton import compress_pool_triton

    return lambda kv, s: compress_pool_triton(kv.to(device), s.to(device)).cpu()


def _impls(device):
    return {"torch": compress_pool_torch, "triton": _kernel(device)}


def _inputs(E, N, C, gen, *, csa_first=True, empty_rows=(), scale=3.0):
    """Random fp32 candidates. ``csa_first``: entry 0 is CSA's first entry (block -1: the first
    N/2 candidates have score -inf and NaN kv, which must never be read); ``empty_rows``:
    entries with every score -inf (and NaN kv)."""
    kv = torch.randn(E, N, C, generator=gen) * 2.0
    score = torch.randn(E, N, C, generator=gen) * scale
    if csa_first:
        score[0, : N // 2] = NEG_INF
        kv[0, : N // 2] = float("nan")
    for e in empty_rows:
        score[e] = NEG_INF
        kv[e] = float("nan")
    return kv, score


def _pad(N, C, gen):
    """``f(n) -> (kv, score)``: n padding entries, half zeros (as engines pad), half junk of a
    very different scale with some -inf scores."""
    def f(n):
        kv = torch.randn(n, N, C, generator=gen) * 1e4
        score = torch.randn(n, N, C, generator=gen) * 50.0
        score[n // 2:, : N // 2] = NEG_INF
        kv[: n // 2] = 0.0
        score[: n // 2] = 0.0
        return kv, score
    return f


def _bound(kv, score, N):
    """Per element: (2N + 8) fp32 ulps of the largest |kv| among the entry's used candidates."""
    used = torch.where(score == NEG_INF, torch.zeros_like(kv), kv.abs())
    return (2 * N + 8) * FP32_ULP * used.amax(dim=1).double()


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("E,N,C", [(37, 8, 48), (9, 16, 70), (3, 1, 5)])
def test_values_vs_fp64_reference(impl, E, N, C, device, gen):
    """CSA-like (N = 2m = 8), HCA-like (N = m = 16) and a single-candidate pool, C not a
    multiple of the tiles. Bound: (2N + 8) fp32 ulps of the entry's largest |kv| (exp, the
    rounding of s - max, the division and the N-term chains). Measured on these seeds: at
    most 2.0 ulps of that scale (CPU and interpreter alike; N = 1 is exact)."""
    kv, score = _inputs(E, N, C, gen, empty_rows=(E - 1,) if E > 2 else ())
    out = _impls(device)[impl](kv, score)
    assert out.dtype == torch.float32 and out.shape == (E, C)
    ref = compress_pool_reference(kv, score)
    assert not out.isnan().any()
    err = (out.double() - ref).abs()
    bound = _bound(kv, score, N)
    assert (err <= bound).all(), f"{impl}: worst error {(err / bound.clamp_min(1e-300)).max():.3g} x the bound"
    # the reference is transformers' expression in fp64 (finite scores: the entries but the masked ones)
    full = slice(1, E - 1) if E > 2 else slice(1, E)
    tf = (kv[full].double() * score[full].double().softmax(dim=1)).sum(dim=1)
    torch.testing.assert_close(ref[full], tf, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_single_candidate_and_equal_scores(impl, device, gen):
    """N = 1 returns kv exactly (w = exp(0) / 1); equal scores give the plain mean in fixed order."""
    run = _impls(device)[impl]
    kv = torch.randn(5, 1, 24, generator=gen)
    assert torch.equal(run(kv, torch.randn(5, 1, 24, generator=gen)), kv[:, 0])
    kv4 = torch.randn(5, 4, 24, generator=gen)
    mean = ((kv4[:, 0] * 0.25 + kv4[:, 1] * 0.25) + kv4[:, 2] * 0.25) + kv4[:, 3] * 0.25
    assert torch.equal(run(kv4, torch.full((5, 4, 24), 7.0)), mean)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_neg_inf_candidates_are_dropped(impl, device, gen):
    """-inf candidates have weight 0 and their kv (NaN here) is never used: CSA's first entry
    (block -1 masked) equals the pool of its last N/2 candidates alone; an all -inf entry is 0."""
    run = _impls(device)[impl]
    E, N, C = 6, 8, 40
    kv, score = _inputs(E, N, C, gen, empty_rows=(3,))
    score[4, 1] = NEG_INF  # one masked candidate inside an entry
    kv[4, 1] = float("inf")
    out = run(kv, score)
    assert not out.isnan().any() and not out.isinf().any()
    assert torch.equal(out[0], run(kv[:1, N // 2:], score[:1, N // 2:])[0])
    keep = [n for n in range(N) if n != 1]
    assert torch.equal(out[4], run(kv[4:5, keep], score[4:5, keep])[0])
    assert torch.equal(out[3], torch.zeros(C))
    # very negative (finite) scores next to a large one: weights underflow to 0, still no NaN
    s = torch.zeros(2, 4, C)
    s[:, 0], s[:, 1:] = 0.0, -1e30
    assert torch.equal(run(torch.ones(2, 4, C), s), torch.ones(2, C))


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_batch_invariant(impl, device, gen, inv):
    """An entry's output is bitwise the same alone, in prefixes, split, and in random
    compositions (permuted, mixed with zero and junk padding entries)."""
    E, N, C = 29, 8, 72
    kv, score = _inputs(E, N, C, gen, empty_rows=(11,))
    run = _impls(device)[impl]
    inv.check_rows(run, (kv, score), _pad(N, C, gen), gen, trials=3, pad_counts=(0, 5, 21),
                   what=f"compress_pool {impl}")
    # a channel does not depend on the other channels either (channel slices, a strided view)
    full = run(kv, score)
    inv.assert_bitwise(run(kv[:, :, 5:37], score[:, :, 5:37]), full[:, 5:37], f"{impl} channel slice")
    inv.assert_bitwise(run(kv[:, :, ::3], score[:, :, ::3]), full[:, ::3], f"{impl} strided channels")


def test_cpu_path_invariant_past_one_exp_tile(gen, inv):
    """More lanes than one exp tile (E C N > LANE_TILE): an entry's bits do not depend on where
    its lanes fall in the tiles."""
    from unified_models.ops.compressor.cpu import LANE_TILE

    E, N, C = 40, 8, 36
    assert E * N * C > 8 * LANE_TILE
    kv, score = _inputs(E, N, C, gen)
    full = compress_pool_torch(kv, score)
    for lo, hi in ((0, 1), (7, 8), (13, 40), (39, 40)):
        inv.assert_bitwise(compress_pool_torch(kv[lo:hi], score[lo:hi]), full[lo:hi], f"entries {lo}:{hi}")
    perm = torch.randperm(E, generator=gen)
    inv.assert_bitwise(compress_pool_torch(kv[perm], score[perm]), full[perm], "permuted entries")


def test_triton_deterministic(device, gen, inv):
    kv, score = _inputs(17, 8, 64, gen)
    run = _kernel(device)
    inv.assert_bitwise(run(kv, score), run(kv, score), "two runs")


# ----------------------------------------------------------------------------- gradients


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def test_grad_formula_equals_fp64_autograd(gen):
    """The analytic backward (dkv = w g, ds = w (g kv - sum w g kv)), evaluated in fp64, equals
    fp64 autograd of the reference to rounding (measured 0 for kv, 4.9e-16 for the scores)."""
    E, N, C = 7, 8, 20
    kv, score = _inputs(E, N, C, gen, empty_rows=(5,))
    kv = torch.where(score == NEG_INF, torch.zeros_like(kv), kv)  # autograd's 0 * NaN would be NaN
    g = torch.randn(E, C, generator=gen, dtype=torch.float64)
    kv64, s64 = kv.double().requires_grad_(), score.double().requires_grad_()
    compress_pool_reference(kv64, s64).backward(g)
    dkv, ds = compress_pool_grads(kv.double(), score.double(), g)
    assert dkv.dtype == ds.dtype == torch.float64
    assert _rel(dkv, kv64.grad) < 1e-13 and _rel(ds, s64.grad) < 1e-13
    torch.autograd.gradcheck(lambda a, b: compress_pool_reference(a, b),
                             (kv64[:2, :, :4].detach().clone().requires_grad_(),
                              s64[:2, :, :4].detach().clone().requires_grad_()))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gradients_vs_fp64_autograd(impl, device, gen, inv, monkeypatch):
    """ops.compress_pool with a graph: values bitwise those without one; fp32 gradients within
    1e-5 relative (docs/consistency.md) of fp64 autograd of the reference at the same inputs
    (measured 6.9e-8 for kv, 1.4e-7 for the scores); zero gradients (no NaN) at -inf candidates and empty entries."""
    dev = "cpu"
    if impl == "triton":
        dev = device  # CUDA runs the kernel natively; on the CPU the interpreter needs the switch
        if dev == "cpu":
            monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    E, N, C = 9, 8, 24
    kv, score = _inputs(E, N, C, gen, empty_rows=(6,))
    g = torch.randn(E, C, generator=gen)
    a, b = kv.to(dev, copy=True).requires_grad_(), score.to(dev, copy=True).requires_grad_()
    y = ops.compress_pool(a, b)
    with torch.no_grad():
        y0 = ops.compress_pool(kv.to(dev), score.to(dev))
    inv.assert_bitwise(y, y0, "with vs without a graph")
    if impl == "triton":  # the kernel ran (its bits differ from the CPU path's here)
        assert not torch.equal(y0.cpu(), compress_pool_torch(kv, score))
    y.backward(g.to(dev))
    da, db = a.grad.cpu(), b.grad.cpu()
    assert da.dtype == db.dtype == torch.float32
    assert not da.isnan().any() and not db.isnan().any()
    masked = score == NEG_INF
    assert torch.equal(da[masked], torch.zeros(int(masked.sum())))
    assert torch.equal(db[masked], torch.zeros(int(masked.sum())))
    kv0 = torch.where(masked, torch.zeros_like(kv), kv)
    kv64, s64 = kv0.double().requires_grad_(), score.double().requires_grad_()
    compress_pool_reference(kv64, s64).backward(g.double())
    assert _rel(da, kv64.grad) < 1e-5, _rel(da, kv64.grad)
    assert _rel(db, s64.grad) < 1e-5, _rel(db, s64.grad)
    # only the scores requiring grad: the same gradient
    b2 = score.to(dev, copy=True).requires_grad_()
    ops.compress_pool(kv.to(dev), b2).backward(g.to(dev))
    assert torch.equal(b2.grad.cpu(), db)


# ----------------------------------------------------------------------------- errors and edges


@pytest.mark.parametrize("impl", ["op", "triton"])
def test_errors(impl, device):
    if impl == "op":
        run = ops.compress_pool
    else:
        from unified_models.ops.compressor.triton import compress_pool_triton as run
    dev = "cpu" if impl == "op" else device
    z = torch.zeros(2, 4, 8, device=dev)
    with pytest.raises(ValueError, match=r"kv must be a 3-D \[E, N, C\]"):
        run(torch.zeros(4, 8, device=dev), z)
    with pytest.raises(ValueError, match=r"score must be a 3-D"):
        run(z, torch.zeros(2, 4, 8, 1, device=dev))
    with pytest.raises(ValueError, match="kv must be float32.*bfloat16"):
        run(z.bfloat16(), z)
    with pytest.raises(ValueError, match="score must be float32.*float64"):
        run(z, z.double())
    with pytest.raises(ValueError, match=r"kv \(2, 4, 8\) and score \(2, 5, 8\) must have the same"):
        run(z, torch.zeros(2, 5, 8, device=dev))
    with pytest.raises(ValueError, match=r"at least one candidate \(N >= 1\)"):
        run(torch.zeros(2, 0, 8, device=dev), torch.zeros(2, 0, 8, device=dev))
    with pytest.raises(ValueError, match="kv on cpu and score on meta"):
        run(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, device="meta"))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty(impl, device):
    run = _impls(device)[impl]
    assert run(torch.zeros(0, 8, 16), torch.zeros(0, 8, 16)).shape == (0, 16)
    assert run(torch.zeros(3, 8, 0), torch.zeros(3, 8, 0)).shape == (3, 0)
