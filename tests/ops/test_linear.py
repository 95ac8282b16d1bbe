"""Linear: Triton GEMM and CPU implementation vs the fp64 oracle, and batch invariance.

Shapes cross the interpreter's tile edges (BLOCK_M=64, BLOCK_N=256,
BLOCK_K=256): T up to 80, N=300, K=320, so rows move between M tiles and
every output needs two K steps with a masked tail.
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.linear import linear_reference, linear_torch

K, N = 320, 300


def _inputs(T, gen, dtype=torch.bfloat16, k=K, n=N):
    x = torch.randn(T, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


def _pad(k, dtype, gen):
    from invariance import Inv

    return Inv.padding(k, dtype, gen, 50.0)


def _tol(out_dtype):
    return dict(rtol=1e-2, atol=1e-2) if out_dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float32)])
def test_triton_vs_reference(with_bias, dtype, out_dtype, device, gen):
    from unified_models.ops.linear.triton import linear_triton

    x, w, b = _inputs(70, gen, dtype)
    b = b if with_bias else None
    out = linear_triton(x.to(device), w.to(device), None if b is None else b.to(device), out_dtype)
    assert out.shape == (70, N) and out.dtype == out_dtype
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    torch.testing.assert_close(out.cpu().double(), exact, **_tol(out_dtype))
    torch.testing.assert_close(out.cpu().double(), linear_reference(x, w, b, out_dtype).double(), **_tol(out_dtype))


def test_triton_rounds_once_to_nearest_even(device, gen, inv):
    """bf16 output == the fp32 output (bias included) rounded by torch (RTNE)."""
    from unified_models.ops.linear.triton import linear_triton

    x, w, b = (t.to(device) for t in _inputs(20, gen))
    inv.assert_bitwise(linear_triton(x, w, b, torch.bfloat16),
                       linear_triton(x, w, b, torch.float32).to(torch.bfloat16), "bf16 vs fp32->bf16")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_triton_batch_invariant(out_dtype, device, gen, inv):
    from unified_models.ops.linear.triton import linear_triton

    x, w, b = _inputs(48, gen)
    wd, bd = w.to(device), b.to(device)
    full = inv.check_rows(lambda a: linear_triton(a, wd, bd, out_dtype), (x.to(device),), _pad(K, torch.bfloat16, gen),
                          gen, trials=3, pad_counts=(0, 7, 60), prefixes=(1, 3, 17), what="linear_triton")
    # rows that straddle the M tile edge (rows 60..79 of an 80-row batch)
    x80 = torch.cat([_pad(K, torch.bfloat16, gen)(32)[0], x]).to(device)
    inv.assert_bitwise(linear_triton(x80, wd, bd, out_dtype)[32:], full, "rows at offset 32 of an 80-row batch")


def test_triton_strided_operands(device, gen, inv):
    from unified_models.ops.linear.triton import linear_triton

    x, w, b = _inputs(9, gen)
    xb = torch.randn(9, 2 * K, generator=gen).to(torch.bfloat16)
    xb[:, ::2] = x
    wt = w.t().contiguous().t()  # [N, K] view with strides (1, N)
    out = linear_triton(xb[:, ::2].to(device), wt.to(device), b.to(device), torch.bfloat16)
    inv.assert_bitwise(out, linear_triton(x.to(device), w.to(device), b.to(device), torch.bfloat16), "strided")


def test_triton_errors(device):
    from unified_models.ops.linear.triton import linear_triton

    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="do not match"):
        linear_triton(x, torch.zeros(4, 9, dtype=torch.bfloat16, device=device), None, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        linear_triton(x, torch.zeros(4, 8, dtype=torch.float32, device=device), None, torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        linear_triton(x, torch.zeros(4, 8, dtype=torch.bfloat16, device=device),
                      torch.zeros(5, dtype=torch.bfloat16, device=device), torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        linear_triton(x, torch.zeros(4, 8, dtype=torch.bfloat16, device=device), None, torch.int32)


def test_triton_empty_batch(device):
    from unified_models.ops.linear.triton import linear_triton

    out = linear_triton(torch.zeros(0, 8, dtype=torch.bfloat16, device=device),
                        torch.zeros(4, 8, dtype=torch.bfloat16, device=device), None, torch.float32)
    assert out.shape == (0, 4) and out.dtype == torch.float32


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_torch_impl_vs_reference_and_invariant(out_dtype, gen, inv):
    x, w, b = _inputs(37, gen)
    full = inv.check_rows(lambda a: linear_torch(a, w, b, out_dtype), (x,), _pad(K, torch.bfloat16, gen), gen,
                          prefixes=(1, 3, 17), what="linear_torch")
    exact = x.double() @ w.double().t() + b.double()
    torch.testing.assert_close(full.double(), exact, **_tol(out_dtype))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreter_equals_torch_impl(out_dtype, device, gen, inv):
    """Under the interpreter the Triton linear is the exact dot product rounded once,
    i.e. the CPU torch implementation bit for bit (neither depends on the host's BLAS)."""
    if device != "cpu":
        pytest.skip("the interpreter path exists only on CPU (GPU tiles accumulate in fp32)")
    from unified_models.ops.linear.triton import linear_triton

    x, w, b = _inputs(70, gen)
    x[3] = 0.0  # an all-zero row, and rows of very different scale
    x[5] *= 2.0 ** -60
    x[6] *= 2.0 ** 40
    inv.assert_bitwise(linear_triton(x, w, b, out_dtype), linear_torch(x, w, b, out_dtype), "interpreter vs torch")


def test_gpu_tier_selection(monkeypatch):
    """The GPU tier table as ``linear_triton`` reads it (checked here on the CPU): tier
    boundaries, the fp32-output last tier, the fp32-operand tiers, and that launching
    ``tier_probe_rows`` touches every tier (the load-time compilation relies on it)."""
    from unified_models.ops.linear import triton as lin

    monkeypatch.setattr(lin, "INTERPRET", False)
    bf16, f32 = torch.bfloat16, torch.float32
    tiers = [cfg for _, cfg in lin.GPU_TIERS]
    bounds = [rows for rows, _ in lin.GPU_TIERS[:-1]]
    assert bounds == sorted(bounds)
    for i, rows in enumerate(bounds):
        assert lin.gemm_config(4096, 4096, rows) == tiers[i]
        assert lin.gemm_config(4096, 4096, rows + 1) == tiers[i + 1]
    assert lin.gemm_config(4096, 4096, 1) == tiers[0]
    assert lin.gemm_config(4096, 4096, 10 ** 6) == tiers[-1] and tiers[-1].persistent
    assert lin.gemm_config(32064, 4096, 10 ** 6, bf16, f32) == lin.FP32_OUT_LAST_TIER
    assert lin.gemm_config(32064, 4096, 1, bf16, f32) == tiers[0]  # only the last tier differs for fp32 out
    f32_tiers = [cfg for _, cfg in lin.FP32_OPERAND_TIERS]
    assert lin.gemm_config(128, 2688, 1, f32, f32) == f32_tiers[0]
    assert lin.gemm_config(128, 2688, 10 ** 6, f32, f32) == f32_tiers[-1]
    assert not any(cfg.tma for cfg in f32_tiers)
    probes = lin.tier_probe_rows()
    assert {lin.gemm_config(4096, 4096, t) for t in probes} == set(tiers)
    assert any(t % 16 == 0 for t in probes) and any(t % 16 for t in probes)
    for cfg in tiers + f32_tiers + [lin.FP32_OUT_LAST_TIER]:
        assert cfg.block_k == lin.BIT_COMPATIBLE_BLOCK_K and cfg.block_m >= 64
