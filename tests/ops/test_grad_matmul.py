"""``grad_matmul``: the backward's GEMM on tensor cores (bf16 terms, fp32 accumulation).

The CUDA path's term splitting runs here with ``torch.mm(out_dtype=fp32)`` emulated exactly:
a product of two bf16 values is exact in fp32, so ``x.float() @ y.float()`` is that GEMM up to
summation order. Bounds are against the fp64 product, relative to ``|a| @ |b|`` per element.
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.grad.helpers import _bf16_terms, grad_matmul


def _mm_emulated(calls):
    def mm(x, y):
        assert x.dtype == y.dtype == torch.bfloat16 or x.dtype == y.dtype == torch.float16, (x.dtype, y.dtype)
        calls.append((x.dtype, tuple(x.shape), tuple(y.shape)))
        return x.float() @ y.float()
    return mm


def _rel_err(out, a, b):
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    return float(((out.double() - exact).abs() / scale).max())


@pytest.mark.parametrize("da,db,gemms,bound", [
    (torch.bfloat16, torch.bfloat16, 1, 2 ** -22),   # one GEMM: only fp32 summation error
    (torch.float32, torch.bfloat16, 2, 2 ** -15),    # hi + lo of a
    (torch.bfloat16, torch.float32, 2, 2 ** -15),
    (torch.float32, torch.float32, 3, 2 ** -15),     # with split_fp32: lo x lo dropped
    (torch.float16, torch.float16, 1, 2 ** -22),
    (torch.float16, torch.float32, 4 - 1, 2 ** -15),  # fp16 beside fp32: both split (fp16 is exact in hi + lo)
])
def test_split_terms_bound_and_gemm_count(da, db, gemms, bound):
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(48, 320, generator=g) * torch.logspace(-3, 3, 320)).to(da)  # columns of very different scale
    b = torch.randn(320, 24, generator=g).to(db)
    calls = []
    out = grad_matmul(a, b, mm=_mm_emulated(calls), split_fp32=True)
    assert out.dtype == torch.float32 and out.shape == (48, 24)
    assert len(calls) == gemms, calls
    err = _rel_err(out, a, b)
    assert err <= bound, err
    # without the split (both operands rounded to bf16, as Megatron-core's backward) the error is far larger
    if da == torch.float32 and db == torch.bfloat16:
        naive = a.to(torch.bfloat16).float() @ b.float()
        assert _rel_err(naive, a, b) > 2 ** -10 > err


def test_bf16_terms_hold_sixteen_bits():
    t = torch.tensor([1.0 + 2 ** -7 + 2 ** -12 + 2 ** -20, -3.0e-30, 7.5e30, 0.0])
    hi, lo = _bf16_terms(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    rest = (t.double() - hi.double() - lo.double()).abs()
    assert bool((rest <= t.double().abs() * 2 ** -16).all()), rest
    assert float(hi[0]) == 1.0 + 2 ** -7 and float(lo[0]) == 2 ** -12  # 2^-20 is below the split
    assert _bf16_terms(t.to(torch.bfloat16))[0] is not None and len(_bf16_terms(t.to(torch.bfloat16))) == 1


def test_cpu_and_fp64_keep_the_plain_product():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g)
    assert torch.equal(grad_matmul(a, b), a @ b.double())
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    assert torch.equal(grad_matmul(ab, bb), ab.float() @ bb.float())  # CPU: no split, no tensor cores
    assert torch.equal(grad_matmul(a, b, mm=_mm_emulated([])), a @ b.double())  # fp64 never splits


def test_two_fp32_operands_stay_fp32_without_split():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(6, 9, generator=g), torch.randn(9, 4, generator=g)
    calls = []
    assert torch.equal(grad_matmul(a, b, mm=_mm_emulated(calls)), a @ b) and calls == []  # an fp32 model


@pytest.mark.parametrize("da,db,gemms", [(torch.bfloat16, torch.bfloat16, 1), (torch.float32, torch.bfloat16, 2),
                                         (torch.float32, torch.float32, 3)])
def test_batched_operands_equal_one_product_per_entry(da, db, gemms):
    """``[B, M, K] @ [B, K, N]`` (one GEMM per expert of a group): the same terms per entry as the 2-D call,
    batched GEMMs of the same count (the CUDA path's ``torch.bmm(out_dtype=fp32)``, emulated)."""
    g = torch.Generator().manual_seed(11)
    a = (torch.randn(4, 9, 64, generator=g) * torch.logspace(-2, 2, 64)).to(da)
    b = torch.randn(4, 64, 5, generator=g).to(db)
    calls = []
    out = grad_matmul(a, b, mm=_mm_emulated(calls), split_fp32=True)
    assert out.shape == (4, 9, 5) and len(calls) == gemms and all(len(c[1]) == 3 for c in calls)
    for i in range(4):
        one = grad_matmul(a[i], b[i], mm=_mm_emulated([]), split_fp32=True)
        assert torch.allclose(out[i], one, rtol=0, atol=1e-6 * float(one.abs().max()))
        assert _rel_err(out[i], a[i], b[i]) <= 2 ** -15
    assert torch.equal(grad_matmul(a.double(), b), a.double() @ b.double())


def test_shape_errors_name_the_operands():
    with pytest.raises(ValueError, match=r"\[2, 3\] @ \[4, 5\]"):
        grad_matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="2-D"):
        grad_matmul(torch.zeros(2, 3, 4), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="batched"):
        grad_matmul(torch.zeros(2, 3, 4), torch.zeros(3, 4, 5))  # batch sizes differ


@pytest.mark.parametrize("da,db,pairs", [(torch.float32, torch.bfloat16, 2), (torch.bfloat16, torch.float32, 2),
                                         (torch.float32, torch.float32, 3)])
@pytest.mark.parametrize("batch", [None, 3])
def test_activation_gradient_shapes_run_the_pairs_as_one_gemm(da, db, pairs, batch):
    """A large fp32 result beside small operands (``M`` tokens x ``N`` features over a small ``K``):
    the term pairs go side by side along ``K`` into one GEMM, within the same bound."""
    g = torch.Generator().manual_seed(11)
    lead = () if batch is None else (batch,)
    a = (torch.randn(*lead, 512, 40, generator=g) * torch.logspace(-3, 3, 40)).to(da)
    b = torch.randn(*lead, 40, 256, generator=g).to(db)
    calls = []
    out = grad_matmul(a, b, mm=_mm_emulated(calls), split_fp32=True)
    assert out.dtype == torch.float32 and out.shape == (*lead, 512, 256)
    assert len(calls) == 1 and calls[0][1][-1] == 40 * pairs and calls[0][2][-2] == 40 * pairs, calls
    if batch is None:
        assert _rel_err(out, a, b) <= 2 ** -15
    else:
        for i in range(batch):
            assert _rel_err(out[i], a[i], b[i]) <= 2 ** -15


@pytest.mark.parametrize("da,db", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                   (torch.float32, torch.float32)])
def test_bf16_mode_rounds_each_operand_once(da, db, monkeypatch):
    """``UM_BACKWARD_GEMM=bf16`` (Megatron-core's backward precision): one GEMM of the operands rounded
    to bf16, within ``2^-8`` of ``|a| @ |b|`` (two roundings of ``2^-9`` each), where the default split
    is within ``2^-15``; bf16 operands are unchanged (one exact GEMM in either mode)."""
    g = torch.Generator().manual_seed(11)
    a = (torch.randn(40, 256, generator=g) * torch.logspace(-3, 3, 256)).to(da)
    b = torch.randn(256, 16, generator=g).to(db)
    monkeypatch.setenv("UM_BACKWARD_GEMM", "bf16")
    calls = []
    out = grad_matmul(a, b, mm=_mm_emulated(calls), split_fp32=True)
    assert len(calls) == 1 and out.dtype == torch.float32
    assert torch.equal(out, a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float())
    err = _rel_err(out, a, b)
    assert 2 ** -15 < err <= 2 ** -8, err
    monkeypatch.setenv("UM_BACKWARD_GEMM", "split")
    split_calls = []
    assert _rel_err(grad_matmul(a, b, mm=_mm_emulated(split_calls), split_fp32=True), a, b) <= 2 ** -15
    assert len(split_calls) > 1


def test_bad_backward_gemm_mode_is_named(monkeypatch):
    a, b = torch.randn(4, 8), torch.randn(8, 2).bfloat16()
    monkeypatch.setenv("UM_BACKWARD_GEMM", "fp8")
    with pytest.raises(ValueError, match="UM_BACKWARD_GEMM='fp8'.*split, bf16"):
        grad_matmul(a, b, mm=_mm_emulated([]))
    monkeypatch.setenv("UM_BACKWARD_GEMM", "")  # empty: the default
    assert grad_matmul(a, b, mm=_mm_emulated([])).shape == (4, 2)


def test_trainer_refuses_a_bad_backward_gemm_mode_at_construction(tiny_model, monkeypatch):
    """A typo in ``UM_BACKWARD_GEMM`` is refused when the trainer is built, on any device (the GEMM path that
    reads it runs only on CUDA, at the first backward)."""
    from unified_models.backends.megatron.trainer import Trainer

    _, spec, sd = tiny_model
    monkeypatch.setenv("UM_BACKWARD_GEMM", "BF16")
    with pytest.raises(ValueError, match="UM_BACKWARD_GEMM='BF16'"):
        Trainer(spec, sd)
