"""The attention sink of paged attention (DeepSeek-V4 / gpt-oss): Triton kernel (interpreter on
CPU) and CPU path.

The sink is one fp32 logit per query head that joins each row's softmax as a column
without a value: ``o = sum_i e^(x_i - m) v_i / (sum_i e^(x_i - m) + e^(sink_h - m))``
(transformers' ``eager_attention_forward`` for DeepSeek-V4 concatenates it to the scores
and drops its column after the softmax). Checked, bitwise unless stated:

* absent (``None``) it is neutral; ``-inf`` (the sink code path, adding ``e^-inf = 0``)
  gives the bits of no sink;
* with a sink, one prefill (all sequences in random order, padding rows), chunked prefill
  and token-by-token decode give every token the same bits, across a sliding window and,
  for the Triton kernel, across KV splits (the split merge adds the sink);
* within bf16 tolerance the output is the fp64 oracle's with the sink, and measurably not
  the output without it;
* gradients to q, k, v and the sink match fp64 autograd of the oracle;
* a sink of the wrong shape or dtype is refused.
"""

from __future__ import annotations

import functools

import pytest
import torch

from test_attention_window import IMPLS, SCALE, SCHEDULES, WindowRun, _seqs
from unified_models import ops
from unified_models.ops.attention import dense_causal_attention_reference

BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _sink(h, gen):
    return (torch.randn(h, generator=gen) * 2.0).float()


def _with_sink(impl_name, sink):
    write, attend = IMPLS[impl_name]()
    return write, functools.partial(attend, sink=sink)


def _device(impl_name, device):
    return "cpu" if impl_name == "torch" else device


def _run(seqs, S, G, window, impl, device, gen, schedule, shared=False):
    run = WindowRun(seqs, S, G, window, impl, device, gen, shared=shared)
    SCHEDULES[schedule](run)
    return run


# Triton under the interpreter: SPLIT_KV 32, so the 40-token sequence is finalized by the merge
# kernel past position 31 and by the partial kernel below it.
@pytest.mark.parametrize("impl_name,window", [("triton", 9), ("torch", 9), ("torch", None)])
def test_sink_prefill_chunked_decode_bitwise_and_oracle(impl_name, window, device, gen, inv):
    device = _device(impl_name, device)
    H, G = 4, 1
    seqs = _seqs([40, 3, 17], H, G, gen)
    for s in seqs:  # shared K = V, as DeepSeek-V4's sliding layers
        s["v"] = s["k"]
    sink = _sink(H, gen).to(device)
    impl = _with_sink(impl_name, sink)
    base = _run(seqs, 16, G, window, impl, device, gen, "prefill", shared=True)
    for name in ("chunked", "decode"):
        run = _run(seqs, 16, G, window, impl, device, gen, name, shared=True)
        for b in range(len(seqs)):
            inv.assert_bitwise(run.out[b], base.out[b], f"sink, W={window}: seq {b} {name} vs prefill")
    for b, s in enumerate(seqs):
        q, k = s["q"].double(), s["k"].double()
        want = dense_causal_attention_reference(q, k, k, SCALE, window, sink=sink.cpu())
        torch.testing.assert_close(base.out[b].double(), want, **BF16_TOL)
        without = dense_causal_attention_reference(q, k, k, SCALE, window)
        assert (want - without).abs().max() > 0.05, "the sink must matter in this test"
        assert (base.out[b].double() - without).abs().max() > 0.05


@pytest.mark.parametrize("impl_name", ["triton", "torch"])
def test_sink_absent_or_minus_inf_is_neutral(impl_name, device, gen, inv):
    device = _device(impl_name, device)
    H, G = 4, 2
    seqs = _seqs([37, 5], H, G, gen)
    plain = _run(seqs, 16, G, 7, IMPLS[impl_name](), device, gen, "prefill")
    none = _run(seqs, 16, G, 7, _with_sink(impl_name, None), device, gen, "prefill")
    minus_inf = _run(seqs, 16, G, 7, _with_sink(impl_name, torch.full((H,), float("-inf"), device=device)),
                     device, gen, "decode")
    for b in range(2):
        inv.assert_bitwise(none.out[b], plain.out[b], f"seq {b}: sink=None vs no argument")
        inv.assert_bitwise(minus_inf.out[b], plain.out[b], f"seq {b}: sink=-inf (decode) vs no sink (prefill)")


def test_sink_argument_errors():
    q = torch.zeros(3, 4, 32)
    kc = torch.zeros(2, 16, 1, 32)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    idx = torch.zeros(3, dtype=torch.int32)
    for bad, what in ((torch.zeros(3), r"\[4\]"), (torch.zeros(4, dtype=torch.bfloat16), "float32"),
                      (torch.zeros(1, 4), r"shape \[4\]")):
        with pytest.raises(ValueError, match=f"sink must be a float32 tensor of shape.*{what}|{what}"):
            ops.paged_attention(q, kc, kc, bt, idx, idx, SCALE, sink=bad)


TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("backend,chunking", [("torch", "default"), ("triton", "default"),
                                              ("torch", "chunks of 4, one per batch"),
                                              ("torch", "chunks of 4, one batch")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_gradients_match_fp64(backend, chunking, dtype, device, gen, inv, monkeypatch):
    """Two packed sequences (21 and 6 tokens) over one shared K = V cache, window 7, a sink:
    gradients to q, k (= v) and the sink vs fp64 autograd of the oracle."""
    if backend == "triton" and device == "cuda":
        pytest.skip("CPU inputs; the CUDA kernels' gradients run in tests/gpu/")
    if chunking != "default":  # the windowed backward's layout: partial chunks, padded slots and spans, batches
        from unified_models.ops.attention import backward as attn_backward

        monkeypatch.setattr(attn_backward, "GRAD_TOKENS", 4)
        monkeypatch.setattr(attn_backward, "GRAD_BATCH_ELEMENTS", 1 if chunking.endswith("per batch") else 1 << 40)
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    H, G, S, W, E = 4, 1, 16, 7, 32
    lens = [21, 6]
    t = sum(lens)
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens)).int()
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = table[seq.long(), pos // S].long() * S + pos % S
    q, k = (torch.randn(t, h, E, generator=gen).to(dtype) for h in (H, G))
    sink = _sink(H, gen)
    g = torch.randn(t, H, E, generator=gen).to(dtype)
    cuts = [0, lens[0], t]

    qs, ks, ss = (x.detach().clone().requires_grad_() for x in (q, k, sink))
    kc = torch.zeros(4, S, G, E, dtype=dtype)
    ops.write_kv_cache(ks, ks, kc, kc, slots)
    out = ops.paged_attention(qs, kc, kc, table, seq, pos, SCALE, sliding_window=W, sink=ss)
    with torch.no_grad():
        kc2 = torch.zeros_like(kc)
        ops.write_kv_cache(k, k, kc2, kc2, slots)
        no_grad = ops.paged_attention(q, kc2, kc2, table, seq, pos, SCALE, sliding_window=W, sink=sink)
    inv.assert_bitwise(out.detach(), no_grad, "grad vs no-grad forward")
    out.backward(g)
    q64, k64, s64 = (x.detach().double().requires_grad_() for x in (q, k, sink))
    ref = torch.cat([dense_causal_attention_reference(q64[a:b], k64[a:b], k64[a:b], SCALE, W, sink=s64)
                     for a, b in zip(cuts[:-1], cuts[1:])])
    ref.backward(g.double())
    for name, got, want in (("q", qs.grad, q64.grad), ("k=v", ks.grad, k64.grad), ("sink", ss.grad, s64.grad)):
        assert got is not None, name
        err = float((got.double() - want).norm() / want.norm())
        assert err <= TOL[dtype], f"{name}: gradient rel. error {err:.3e}"
    assert ss.grad.dtype == torch.float32 and float(s64.grad.abs().max()) > 1e-3  # the sink's gradient is real
