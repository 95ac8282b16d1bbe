"""The fused causal self-attention backward (:mod:`unified_models.ops.attention.causal_grads`).

On the CPU the kernels run through the Triton interpreter (their dots in fp64 without BLAS,
rounded as on the GPU: ``ops/triton/_common.py``); on CUDA natively. Checked: dq/dk/dv of packed
whole sequences against fp64 autograd of the dense causal reference, at tile edges (lengths 1,
63, 64, 65, 130 around the 64-row tiles), GQA layouts, a head dim that is not a power of two and
fp16; a sequence's gradients are the same bits alone and inside a pack; bad input is refused.

Tolerance: FlashAttention-2's backward rounds the probabilities and the score gradients to the
operand dtype before their dots (one rounding per term; the inputs are exact and the results
fp32, not rounded to the model dtype here), so ``2^-8`` for bf16 and ``2^-11`` for fp16 (bounds
4e-3 and 5e-4; measured 1.5e-3 to 1.8e-3 and 1.9e-4 to 2.2e-4).
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.attention import dense_causal_attention_reference
from unified_models.ops.attention.causal_grads import BLOCK_M, causal_attention_grads

TOL = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(lens, h, g, e, dtype, gen, device):
    t = sum(lens)
    q = torch.randn(t, h, e, generator=gen).to(dtype)
    k = torch.randn(t, g, e, generator=gen).to(dtype)
    v = torch.randn(t, g, e, generator=gen).to(dtype)
    do = torch.randn(t, h, e, generator=gen).to(dtype)
    return [x.to(device) for x in (q, k, v, do)]


def _reference_grads(q, k, v, do, lens, scale):
    """fp64 autograd of the dense causal reference, one sequence at a time."""
    x64 = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    cuts = torch.tensor([0, *lens]).cumsum(0).tolist()
    out = torch.cat([dense_causal_attention_reference(x64[0][a:b], x64[1][a:b], x64[2][a:b], scale)
                     for a, b in zip(cuts[:-1], cuts[1:])])
    out.backward(do.cpu().double())
    return [x.grad for x in x64]


@pytest.mark.parametrize("lens,h,g,e,dtype", [
    ([1, 63, 64, 65], 4, 2, 32, torch.bfloat16),   # tile edges, GQA 2
    ([130], 2, 2, 64, torch.bfloat16),              # three query tiles, MHA
    ([70, 9], 6, 1, 24, torch.bfloat16),            # MQA, head dim not a power of two
    ([40, 77], 4, 4, 32, torch.float16),            # fp16
], ids=["edges-gqa2", "long-mha", "mqa-e24", "fp16"])
def test_grads_match_fp64_autograd(lens, h, g, e, dtype, gen, device):
    scale = e ** -0.5
    q, k, v, do = _inputs(lens, h, g, e, dtype, gen, device)
    dq, dk, dv = causal_attention_grads(q, k, v, do, lens, scale)
    assert (dq.dtype, dk.dtype, dv.dtype) == (torch.float32,) * 3
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, got, ref in zip("qkv", (dq, dk, dv), _reference_grads(q, k, v, do, lens, scale)):
        err = _rel(got.cpu(), ref)
        print(f"GRAD-ERR causal_attention_grads d{name} {lens} H{h} G{g} E{e} {dtype}: {err:.3e}")
        assert err <= TOL[dtype], f"d{name}: rel. error {err:.3e}"
        assert torch.isfinite(got).all()


def test_a_sequence_has_the_same_bits_alone_and_in_a_pack(gen, device, inv):
    """Every program reads one sequence: packing others beside it changes no bit of its gradients."""
    lens = [BLOCK_M + 3, 0, 20, 7]  # an empty sequence too
    scale = 0.2
    q, k, v, do = _inputs(lens, 4, 2, 32, torch.bfloat16, gen, device)
    packed = causal_attention_grads(q, k, v, do, lens, scale)
    a, b = lens[0], lens[0] + lens[2]
    alone = causal_attention_grads(q[a:b], k[a:b], v[a:b], do[a:b], [lens[2]], scale)
    for name, x, y in zip("qkv", packed, alone):
        inv.assert_bitwise(x[a:b], y, f"d{name}: sequence 1 in the pack vs alone")


def test_strided_query_gives_the_same_bits(gen, device, inv):
    """q/dO as views with a row stride (a fused qkv projection's slices) read the same values."""
    lens = [33]
    q, k, v, do = _inputs(lens, 4, 2, 16, torch.bfloat16, gen, device)
    wide = torch.zeros(33, 4, 48, dtype=q.dtype, device=device)
    wide[..., 8:24] = q
    a = causal_attention_grads(q, k, v, do, lens, 0.25)
    b = causal_attention_grads(wide[..., 8:24], k, v, do, lens, 0.25)
    for name, x, y in zip("qkv", a, b):
        inv.assert_bitwise(x, y, f"d{name}: strided q")


def test_bad_input_is_refused(device):
    q = torch.zeros(4, 3, 8, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(4, 2, 8, dtype=torch.bfloat16, device=device)
    q4 = torch.zeros(4, 4, 8, dtype=torch.bfloat16, device=device)
    cases = [
        ((q, kv, kv, q, [4]), "not a multiple"),                                   # 3 query heads over 2
        ((q4[0], kv, kv, q4[0], [4]), "must be 3-D"),
        ((q4, kv[:, :0], kv[:, :0], q4, [4]), "not a multiple"),                    # no kv head
        ((q4, kv[:3], kv[:3], q4, [4]), "must be \\[T, G, E\\]"),
        ((q4.float(), kv.float(), kv.float(), q4.float(), [4]), "half-precision"),
        ((q4, kv, kv.half(), q4, [4]), "half-precision"),
        ((q4, kv, kv, q4.transpose(1, 2).contiguous().transpose(1, 2), [4]), "contiguous"),
        ((q4, kv, kv, q4, [3]), "sum to T = 4"),
        ((q4, kv, kv, q4, [5, -1]), "sum to T = 4"),
        ((torch.zeros(4, 4, 256, dtype=torch.bfloat16, device=device),
          torch.zeros(4, 2, 256, dtype=torch.bfloat16, device=device),
          torch.zeros(4, 2, 256, dtype=torch.bfloat16, device=device),
          torch.zeros(4, 4, 256, dtype=torch.bfloat16, device=device), [4]), "head dim 256 above 128"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            causal_attention_grads(*args, 0.3)
