"""Block-FP8 (W8A8) DeepSeek-V4 SwiGLU experts: the shared expert of every published block-FP8
checkpoint and the routed experts of DeepSeek-V4-Flash-Base (``ops.fp8_block.experts``).

The rule (``ops.moe.deepseek`` package doc): weight dequantized exactly (e4m3 times its 128x128
block's power of two), activation per token to FP8 1x128 ue8m0 tiles and back exactly, then the
experts' GEMMs. Checked against plain torch, for batch invariance with 1000x larger tokens in
the batch, masters == stored codes, and the straight-through gradient against fp64 autograd.
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops.fp8_block import (FP8BlockExperts, FP8BlockMaster, fp8_block_dequantize,
                                          fp8_block_quantize_activation, fp8_block_quantize_weight)
from unified_models.ops.moe import swiglu_expert_outputs, swiglu_experts
from unified_models.ops.moe.deepseek import swiglu_shared_expert

E, I, D, L = 3, 256, 128, 10.0


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def _masters(gen, scale=1.0):
    mk = lambda *s: (torch.randn(*s, generator=gen) * scale / s[-1] ** 0.5 * 2).bfloat16()  # noqa: E731
    return mk(E, I, D), mk(E, I, D), mk(E, D, I)


def _stored(m: torch.Tensor) -> FP8BlockExperts:
    parts = [fp8_block_quantize_weight(m[e]) for e in range(m.shape[0])]
    return FP8BlockExperts(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))


def _act_dq(a: torch.Tensor) -> torch.Tensor:
    q, s = fp8_block_quantize_activation(a)
    return q.double() * s.double().repeat_interleave(128, 1)


def _w8a8_plain(x, ids, wts, masters):
    """Per assignment in plain torch: dequantized weights (DeepSeek ``weight_dequant``), per-token FP8
    activations, fp64 products rounded to fp32 at the op's points (g, u; h to bf16; y)."""
    deq = [torch.stack([fp8_block_dequantize(*fp8_block_quantize_weight(m[e]), torch.float64)
                        for e in range(m.shape[0])]) for m in masters]
    T, K = ids.shape
    out = torch.zeros(T * K, D, dtype=torch.float32)
    for t in range(T):
        xq = _act_dq(x[t:t + 1])
        for k in range(K):
            e = int(ids[t, k])
            g = (xq @ deq[0][e].t()).float()
            u = (xq @ deq[1][e].t()).float()
            h = (torch.nn.functional.silu(g.clamp(max=L)) * u.clamp(-L, L) * wts[t, k]).bfloat16()
            out[t * K + k] = (_act_dq(h) @ deq[2][e].t()).float()[0]
    return out


def test_dequantize_is_exact_and_master_quantizes_to_the_stored_codes(gen):
    m = _masters(gen)[0]
    q = _stored(m)
    deq = q.dequantize(torch.float64)
    assert torch.equal(q.dequantize(torch.bfloat16).double(), deq)  # e4m3 * 2^j is exact in bf16
    assert torch.equal(deq[1], fp8_block_dequantize(q.weight[1], q.weight_scale_inv[1], torch.float64))
    mq = FP8BlockMaster(m).quantize()
    assert torch.equal(mq.weight.view(torch.uint8), q.weight.view(torch.uint8))
    assert torch.equal(mq.weight_scale_inv.view(torch.uint8), q.weight_scale_inv.view(torch.uint8))
    one = FP8BlockExperts(q.weight[0], q.weight_scale_inv[0]).stacked()
    assert one.shape == (1, I, D) and torch.equal(one.dequantize(torch.float32)[0], deq[0].float())


def test_w8a8_expert_outputs_equal_the_plain_formula(gen):
    masters = _masters(gen)
    x = torch.randn(7, D, generator=gen).bfloat16()
    ids = torch.randint(0, E, (7, 2), generator=gen).int()
    wts = torch.rand(7, 2, generator=gen)
    qs = [_stored(m) for m in masters]
    y = swiglu_expert_outputs(x, ids, wts, *qs, swiglu_limit=L)
    assert torch.equal(y.view(torch.int32), _w8a8_plain(x, ids, wts, masters).view(torch.int32))
    y2 = swiglu_expert_outputs(x, ids, wts, *(FP8BlockMaster(m) for m in masters), swiglu_limit=L)
    assert torch.equal(y2.view(torch.int32), y.view(torch.int32))
    # the activation rounding is real: the dequantized weights without it (W8A16) give other bits
    w16 = [q.dequantize(torch.bfloat16) for q in qs]
    assert not torch.equal(swiglu_expert_outputs(x, ids, wts, *w16, swiglu_limit=L), y)


def test_token_output_unchanged_when_much_larger_tokens_join(gen):
    qs = [_stored(m) for m in _masters(gen)]
    x = torch.randn(4, D, generator=gen).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], dtype=torch.int32)
    wts = torch.rand(4, 2, generator=gen)
    alone = swiglu_experts(x, ids, wts, *qs, swiglu_limit=L)
    big = (torch.randn(5, D, generator=gen) * 1000).bfloat16()
    big_ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], dtype=torch.int32)
    order = torch.tensor([4, 0, 5, 6, 1, 7, 2, 8, 3])  # the small tokens land at 1, 4, 6, 8
    xb, ib = torch.cat([x, big])[order], torch.cat([ids, big_ids])[order]
    wb = torch.cat([wts, torch.rand(5, 2, generator=gen)])[order]
    together = swiglu_experts(xb, ib, wb, *qs, swiglu_limit=L)
    mine = torch.tensor([1, 4, 6, 8])
    assert torch.equal(together[mine].view(torch.int16), alone.view(torch.int16))
    assert together[~torch.isin(torch.arange(9), mine)].float().abs().max() > 10 * alone.float().abs().max()


def test_shared_expert_is_the_one_expert_kernel(gen):
    gm, um, dm = (m[0] for m in _masters(gen))
    x = torch.randn(5, D, generator=gen).bfloat16()
    stored = [FP8BlockExperts(*fp8_block_quantize_weight(m)) for m in (gm, um, dm)]
    shared = swiglu_shared_expert(x, *stored, swiglu_limit=L)
    ids = torch.zeros(5, 1, dtype=torch.int32)
    want = swiglu_expert_outputs(x, ids, torch.ones(5, 1), *(s.stacked() for s in stored), swiglu_limit=L)
    assert shared.dtype == torch.float32 and torch.equal(shared.view(torch.int32), want.view(torch.int32))
    masters = swiglu_shared_expert(x, *(FP8BlockMaster(m) for m in (gm, um, dm)), swiglu_limit=L)
    assert torch.equal(masters.view(torch.int32), shared.view(torch.int32))


def test_ste_gradient_matches_fp64(gen):
    masters = [m.float().requires_grad_(True) for m in _masters(gen)]
    x = torch.randn(6, D, generator=gen).bfloat16().requires_grad_(True)
    ids = torch.randint(0, E, (6, 2), generator=gen).int()
    wts = torch.rand(6, 2, generator=gen).requires_grad_(True)
    G = torch.randn(6, D, generator=gen)
    out = ops.swiglu_experts(x, ids, wts, *(FP8BlockMaster(m) for m in masters), swiglu_limit=L,
                             out_dtype=torch.float32)
    (out * G).sum().backward()
    ours = [x.grad, wts.grad, *(m.grad for m in masters)]

    m64 = [m.detach().double().requires_grad_(True) for m in masters]
    x64 = x.detach().double().requires_grad_(True)
    w64 = wts.detach().double().requires_grad_(True)
    ste = lambda a, q: a + (q - a).detach()  # noqa: E731
    wq = [ste(m, torch.stack([fp8_block_dequantize(*fp8_block_quantize_weight(m.detach().float()[e]),
                                                   torch.float64) for e in range(E)])) for m in m64]
    xq = ste(x64, _act_dq(x.detach()))
    out64 = torch.zeros(6, D, dtype=torch.float64)
    for k in range(2):
        e = ids[:, k].long()
        g = torch.einsum("td,tid->ti", xq, wq[0][e])
        u = torch.einsum("td,tid->ti", xq, wq[1][e])
        h = torch.nn.functional.silu(g.clamp(max=L)) * u.clamp(-L, L) * w64[:, k:k + 1]
        hq = ste(h, _act_dq(h.detach().bfloat16()))
        out64 = out64 + torch.einsum("ti,tdi->td", hq, wq[2][e])
    (out64 * G.double()).sum().backward()
    want = [x64.grad, w64.grad, *(m.grad for m in m64)]
    for name, a, b in zip(("x", "routing weights", "w1", "w3", "w2"), ours, want):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        assert b.abs().max() > 0
        assert err < 4e-3 if name == "x" else err < 1e-5, (name, err)  # x: its gradient is rounded to bf16
    # stored codes take no gradient, the input still does
    xs = x.detach().requires_grad_(True)
    ops.swiglu_experts(xs, ids, wts.detach(), *(_stored(m.detach().bfloat16()) for m in masters),
                       swiglu_limit=L).float().sum().backward()
    assert xs.grad is not None and xs.grad.abs().max() > 0


def test_triton_path_is_row_local_and_close_to_the_cpu_rule(gen, device, monkeypatch):
    """The Triton experts (natively on CUDA, through the interpreter on CPU: the ``device`` fixture; the
    interpreter is chosen when Triton is imported, never switched on here) give a token the same row
    alone and in a batch, within 2e-2 of the CPU rule."""
    qs = [_stored(m) for m in _masters(gen)]
    x = torch.randn(6, D, generator=gen).bfloat16()
    ids = torch.randint(0, E, (6, 2), generator=gen).int()
    wts = torch.rand(6, 2, generator=gen)
    cpu = swiglu_expert_outputs(x, ids, wts, *qs, swiglu_limit=L)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    on = [FP8BlockExperts(q.weight.to(device), q.weight_scale_inv.to(device)) for q in qs]
    x, ids, wts = x.to(device), ids.to(device), wts.to(device)
    tri = swiglu_expert_outputs(x, ids, wts, *on, swiglu_limit=L)
    sub = swiglu_expert_outputs(x[2:5], ids[2:5], wts[2:5], *on, swiglu_limit=L)
    assert torch.equal(sub.view(torch.int32), tri[4:10].view(torch.int32))  # rows do not depend on the batch
    err = (tri.cpu() - cpu).abs().max() / cpu.abs().max()
    assert err < 2e-2, err  # h is rounded to bf16 on both; the GEMMs accumulate in another order


def test_k_must_be_a_multiple_of_128(gen):
    with pytest.raises(ValueError, match="K = 64 is not a multiple of the block-FP8 tile"):
        FP8BlockMaster(torch.zeros(2, 128, 64))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        FP8BlockExperts(torch.zeros(2, 128, 128).to(torch.float8_e4m3fn), torch.ones(2, 2, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_dequantize_equals_the_torch_form_bitwise(dtype, device):
    """The one-kernel dequantization of a stack (N not a multiple of 128, scales 2^-20 .. 2^20 and 2^-127, every
    non-NaN e4m3 code incl. -0.0 and subnormals) equals ``(w.float() * scale).to(dtype)`` bit for bit,
    for a stack and for one ``[N, K]`` weight; the experts op's Triton path takes it."""
    from unified_models.ops.fp8_block.triton import fp8_block_dequantize_triton

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (3, 200, 256), generator=g, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x80  # no NaN code (no quantizer writes one): -0.0 instead
    codes[0, 0, :256] = torch.arange(256).masked_fill((torch.arange(256) & 0x7F) == 0x7F, 0)  # every code
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(device)
    s = torch.pow(2.0, torch.randint(-20, 21, (3, 2, 2), generator=g).float())
    s[2, 1, 1] = 2.0 ** -127  # bf16 results below 2^-126: rounded to nearest even like torch's cast
    s = s.to(torch.float8_e8m0fnu).to(device)
    full = s.float().repeat_interleave(128, -2)[..., :200, :].repeat_interleave(128, -1)
    want = (w.float() * full).to(dtype)
    got = fp8_block_dequantize_triton(w, s, dtype)
    assert got.dtype == dtype and got.shape == w.shape
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    one = fp8_block_dequantize_triton(w[1], s[1], dtype)
    assert torch.equal(one.view(torch.uint8), want[1].view(torch.uint8))
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        fp8_block_dequantize_triton(w.float(), s, dtype)
    with pytest.raises(ValueError, match="expected float8_e8m0fnu or fp32"):
        fp8_block_dequantize_triton(w, s.view(torch.uint8), dtype)
    with pytest.raises(ValueError, match="ceil"):
        fp8_block_dequantize_triton(w, s[:, :1], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_in_loop_tiles_equal_the_dequantized_stack_bitwise(dtype, device, monkeypatch):
    """Block-FP8 experts dequantized tile by tile in the GEMMs' K loop (decode batches) give the same
    bits as the GEMMs on the stack dequantized once (large batches): gate/up and down, scales
    2^-20 .. 2^20 differing per 128x128 block (so a wrong block index shows), every non-NaN code; and
    through the op, a token's row is the same in a batch on either side of the threshold."""
    from unified_models.ops.moe.deepseek_triton import swiglu_down_triton, swiglu_hidden_triton
    from unified_models.ops.moe.triton import fp8_dequantize_rows_per_expert

    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    g = torch.Generator().manual_seed(11)

    def stack(n, k, lo, hi):
        codes = torch.randint(0, 256, (E, n, k), generator=g, dtype=torch.int32)
        codes[(codes & 0x7F) == 0x7F] = 0x80
        every = torch.arange(256)[:k]
        codes[0, 0, :every.numel()] = every.masked_fill((every & 0x7F) == 0x7F, 0)  # every code
        s = torch.pow(2.0, torch.randint(lo, hi + 1, (E, n // 128, k // 128), generator=g).float())
        return FP8BlockExperts(codes.to(torch.uint8).view(torch.float8_e4m3fn).to(device),
                               s.to(torch.float8_e8m0fnu).to(device))

    gate, up, down = stack(I, D, -12, -6), stack(I, D, -12, -6), stack(D, I, -20, 20)
    assert len({float(v) for v in gate.weight_scale_inv.float().flatten()}) > 1
    T, K = 5, 2
    x = (torch.randn(T, D, generator=g) * 4).to(dtype).to(device)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]], dtype=torch.int32, device=device)
    wts = torch.rand(T, K, generator=g).to(device)
    threshold = fp8_dequantize_rows_per_expert(gate.weight)  # rows per expert (GPU conversion or bytes)
    assert ids.numel() < threshold * E  # the op takes the in-loop path at this size

    def bits(t):
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    h_loop, plan = swiglu_hidden_triton(x, ids, wts, gate, up, L)
    h_once, plan_once = swiglu_hidden_triton(x, ids, wts, gate.dequantize(dtype), up.dequantize(dtype), L)
    rows = plan[0] < T * K  # padding rows are unspecified
    assert torch.equal(plan[0], plan_once[0]) and int(rows.sum()) == T * K
    assert torch.equal(bits(h_loop[rows]), bits(h_once[rows]))
    assert h_loop[rows].abs().max() > 0
    y_loop = swiglu_down_triton(h_loop, plan, down, ids)
    y_once = swiglu_down_triton(h_loop, plan, down.dequantize(dtype), ids)
    assert torch.equal(bits(y_loop), bits(y_once)) and y_loop.abs().max() > 0

    big = threshold * E // K + 1  # this batch dequantizes the stacks once
    xb = torch.cat([x, (torch.randn(big, D, generator=g) * 100).to(dtype).to(device)])
    idb = torch.cat([ids, torch.randint(0, E, (big, K), generator=g, dtype=torch.int32).to(device)])
    wb = torch.cat([wts, torch.rand(big, K, generator=g).to(device)])
    empty = swiglu_expert_outputs(x[:0], ids[:0], wts[:0], gate, up, down, swiglu_limit=L)  # an EP rank without rows
    assert empty.shape == (0, D) and empty.dtype == torch.float32
    alone = swiglu_expert_outputs(x, ids, wts, gate, up, down, swiglu_limit=L)
    batched = swiglu_expert_outputs(xb, idb, wb, gate, up, down, swiglu_limit=L)
    assert torch.equal(bits(alone), bits(batched[:T * K])) and alone.abs().max() > 0


def test_each_stack_takes_its_own_threshold(gen, device, monkeypatch):
    """Past the threshold every block-FP8 stack is dequantized once, also beside a gate in another
    format (the decision is per stack, not read off the gate); below it none is."""
    from unified_models.ops.moe.triton import fp8_dequantize_rows_per_expert

    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    masters = _masters(gen)
    up, down = (_stored(m) for m in masters[1:])
    up, down = (FP8BlockExperts(q.weight.to(device), q.weight_scale_inv.to(device)) for q in (up, down))
    gate = up.dequantize(torch.bfloat16)  # a gate of another format (its values: bf16)
    calls = []
    real = FP8BlockExperts.dequantize
    monkeypatch.setattr(FP8BlockExperts, "dequantize", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    big = fp8_dequantize_rows_per_expert(up.weight) * E // 2 + 1
    for T, want in ((3, 0), (big, 2)):
        calls.clear()
        x = torch.randn(T, D, generator=gen).bfloat16().to(device)
        ids = torch.randint(0, E, (T, 2), generator=gen).int().to(device)
        swiglu_expert_outputs(x, ids, torch.rand(T, 2, generator=gen).to(device), gate, up, down, swiglu_limit=L)
        assert len(calls) == want, (T, len(calls))
