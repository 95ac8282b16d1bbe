"""Compressed entries in paged attention (DeepSeek-V4 CSA / HCA) and ``ops.read_kv_cache``:
Triton kernel (interpreter on CPU) and CPU path.

A row attends its sliding window (shared K = V cache, vLLM's freed blocks replaced by a NaN
null block), then the compressed entries listed for it (ids into a ``[N, S//ratio, 1, E]``
compressed cache written at ``state.entry_slots`` as each entry's block completes; unwritten
pages are NaN), in one online softmax, then the sink. Checked, bitwise unless stated:

* one prefill (sequences in random order, padding rows), chunked prefill and token-by-token
  decode give every token the same bits, for several window/compressed block sizes and
  layouts, CSA-like lists (a random causal subset, descending, -1 trailing) and HCA-like
  lists (every complete entry); within bf16 tolerance the output is the fp64 oracle's, and
  measurably not the window-only output;
* a row's bits do not depend on the list width K (extra -1 columns), on the other rows
  (a sequence alone vs batched), nor on K = 0 vs all -1;
* the CPU path and the oracle raise for an id that breaks causality (``j >= (p+1)//ratio``),
  naming the row; the Triton kernel masks it (equal to the list without it);
* gradients to q, the sink, the window K = V and the compressed entries written this step
  match fp64 autograd of the dense oracle; entries and keys written in an earlier step are
  constants;
* ``read_kv_cache`` is an exact copy (fp32 cache, padding slots give zeros) and sends
  gradients to the rows written this step only.
"""

from __future__ import annotations

import pytest
import torch

from invariance import scattered_block_table
from tensor_cores import emulate_tensor_cores
from test_attention_window import SCHEDULES, WindowRun
from unified_models import ops
from unified_models.ops.attention import (CompressedKV, dense_compressed_attention_reference,
                                          paged_attention_reference, paged_attention_torch, read_kv_cache_reference,
                                          write_kv_cache_torch)
from unified_models.state import entry_slots

E = 32
SCALE = E ** -0.5
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _triton():
    from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

    return write_kv_cache_triton, paged_attention_triton


IMPLS = {"triton": _triton, "torch": lambda: (write_kv_cache_torch, paged_attention_torch)}


def _lists(lengths, ratio, topk, gen, hca=False):
    """Per sequence, per position: the causal entry list (HCA: every complete entry, ascending;
    CSA-like: a random subset of at most ``topk`` complete entries, descending)."""
    out = []
    for n in lengths:
        rows = []
        for p in range(n):
            done = (p + 1) // ratio
            if hca:
                rows.append(list(range(done)))
            else:
                pick = torch.randperm(done, generator=gen)[:topk].tolist() if done else []
                rows.append(sorted(pick, reverse=True))
        out.append(rows)
    return out


def _padded(rows, k):
    return torch.tensor([r + [-1] * (k - len(r)) for r in rows], dtype=torch.int32).view(len(rows), k)


class CompressedSide:
    """The compressed cache of a run: NaN pages, a scattered block table of its own group; each
    step writes the entries its tokens complete (``entry_slots``), then attends with the lists."""

    def __init__(self, comp, lists, ratio, pages, k, write, attend, device, gen, sink, dtype):
        self.comp, self.lists, self.ratio, self.pages, self.k = comp, lists, ratio, pages, k
        self.write, self.attend_fn, self.device, self.sink = write, attend, device, sink
        lens = [len(r) for r in lists]
        need = [-(-n // (pages * ratio)) for n in lens]
        n_blocks = sum(need) + 2
        self.cache = torch.full((n_blocks, pages, 1, E), float("nan"), dtype=dtype, device=device)
        self.block_table = scattered_block_table(need, n_blocks, gen, max(need) + 1).to(torch.int32).to(device)

    def attend(self, q, kc, vc, bt, seq, pos, scale, sliding_window):
        slots = entry_slots(self.block_table, seq, pos, self.ratio, self.pages * self.ratio)
        e = torch.stack([self.comp[int(b)][int(p) // self.ratio] if int(sl) >= 0 else self.comp[0][0] * 0
                         for b, p, sl in zip(seq.tolist(), pos.tolist(), slots.tolist())]).to(self.device)
        self.write(e, e, self.cache, self.cache, slots)
        ent = torch.stack([_padded([self.lists[b][p] if p >= 0 else []], self.k)[0]
                           for b, p in zip(seq.tolist(), pos.tolist())]).to(self.device)
        comp = CompressedKV(self.cache, self.ratio, ent, self.block_table)
        return self.attend_fn(q, kc, vc, bt, seq, pos, scale, sliding_window=sliding_window, sink=self.sink,
                              compressed=comp)


def _case(lengths, ratio, gen, hca=False, topk=3, dtype=torch.bfloat16, H=4):
    seqs = [dict(q=torch.randn(n, H, E, generator=gen).to(dtype), k=(torch.randn(n, 1, E, generator=gen) * 2).to(dtype))
            for n in lengths]
    for s in seqs:
        s["v"] = s["k"]
    comp = [(torch.randn(max(n // ratio, 1), 1, E, generator=gen) * 2).to(dtype) for n in lengths]
    lists = _lists(lengths, ratio, topk, gen, hca)
    k = max(len(r) for rows in lists for r in rows) + 2  # at least two trailing -1
    sink = (torch.randn(H, generator=gen) * 2.0).float()
    return seqs, comp, lists, k, sink


def _run(case, S, pages, window, ratio, impl_name, device, gen, schedule, k=None):
    seqs, comp, lists, k0, sink = case
    write, attend = IMPLS[impl_name]()
    side = CompressedSide([c.to(device) for c in comp], lists, ratio, pages, k or k0, write, attend, device, gen,
                          sink.to(device), seqs[0]["q"].dtype)
    run = WindowRun(seqs, S, 1, window, (write, side.attend), device, gen, shared=True)
    SCHEDULES[schedule](run)
    return run


def _oracle(case, b, window):
    seqs, comp, lists, k, sink = case
    s = seqs[b]
    return dense_compressed_attention_reference(s["q"].double(), s["k"].double(), s["k"].double(), comp[b].double(),
                                                _padded(lists[b], k), SCALE, window, sink=sink)


# Triton under the interpreter: BLOCK_KV 16, SPLIT_KV 32: the 37-token sequence spans two KV
# splits, and its compressed lists fill one 16-slot tile (HCA at ratio 2: 18 entries, two tiles).
@pytest.mark.parametrize("impl_name,layouts,ratio,hca", [
    ("torch", ((16, 4), (32, 2)), 4, False),
    ("torch", ((16, 8), (32, 16)), 2, True),
    ("triton", ((16, 4), (8, 2)), 4, False),
    ("triton", ((16, 8),), 2, True),
])
def test_compressed_prefill_chunked_decode_bitwise_and_oracle(impl_name, layouts, ratio, hca, device, gen, inv):
    device = "cpu" if impl_name == "torch" else device
    window = 9
    case = _case([37, 3, 20], ratio, gen, hca=hca)
    runs = {}
    for S, pages in layouts:
        for name in SCHEDULES:
            runs[(S, pages, name)] = _run(case, S, pages, window, ratio, impl_name, device, gen, name)
    base = runs[(*layouts[0], "prefill")]
    for key, run in runs.items():
        for b in range(3):
            inv.assert_bitwise(run.out[b], base.out[b], f"seq {b} {key} vs prefill")
    seqs = case[0]
    for b in range(3):
        want = _oracle(case, b, window)
        torch.testing.assert_close(base.out[b].double(), want, **BF16_TOL)
    no_comp = dense_compressed_attention_reference(seqs[0]["q"].double(), seqs[0]["k"].double(),
                                                   seqs[0]["k"].double(), case[1][0].double(),
                                                   _padded([[] for _ in range(37)], 1), SCALE, window, sink=case[4])
    assert (base.out[0].double() - no_comp).abs().max() > 0.05, "the compressed entries must matter in this test"


def _one_step(case, S, pages, window, ratio, impl_name, device, gen, chunks, k):
    """One step over ``chunks`` ``(seq, start, end)`` (after writing nothing before); returns the outputs."""
    seqs = case[0]
    write, attend = IMPLS[impl_name]()
    side = CompressedSide([c.to(device) for c in case[1]], case[2], ratio, pages, k, write, attend, device, gen,
                          case[4].to(device), seqs[0]["q"].dtype)
    run = WindowRun(seqs, S, 1, window, (write, side.attend), device, gen, shared=True, free=False)
    run.step(chunks, n_pad=2)
    return run


@pytest.mark.parametrize("impl_name", ["torch", "triton"])
def test_compressed_list_width_and_batch_bitwise(impl_name, device, gen, inv):
    device = "cpu" if impl_name == "torch" else device
    ratio, window = 4, 7
    case = _case([26, 11], ratio, gen)
    k = case[3]
    lens = [26, 11]
    full = _one_step(case, 16, 4, window, ratio, impl_name, device, gen, [(0, 0, 26), (1, 0, 11)], k)
    for width in (k + 1, k + 21):  # one more -1 slot; more than a whole tile of -1
        wide = _one_step(case, 16, 4, window, ratio, impl_name, device, gen, [(0, 0, 26), (1, 0, 11)], width)
        for b in range(2):
            inv.assert_bitwise(wide.out[b], full.out[b], f"seq {b}: K={width} vs K={k}")
    for b in range(2):
        alone = _one_step(case, 16, 4, window, ratio, impl_name, device, gen, [(b, 0, lens[b])], k)
        inv.assert_bitwise(alone.out[b], full.out[b], f"seq {b} alone vs batched")


def _tiny_cache(gen, dtype=torch.bfloat16, ratio=4, n=10):
    """One sequence of n tokens fully written: window cache S=16, compressed pages of 4 entries."""
    H = 2
    q = torch.randn(n, H, E, generator=gen).to(dtype)
    k = torch.randn(n, 1, E, generator=gen).to(dtype)
    kc = torch.zeros(2, 16, 1, E, dtype=dtype)
    bt = torch.tensor([[1]], dtype=torch.int32)
    pos = torch.arange(n)
    seq = torch.zeros(n, dtype=torch.int32)
    ops.write_kv_cache(k, k, kc, kc, bt[0, 0].long() * 16 + pos)
    cc = torch.zeros(2, 4, 1, E, dtype=dtype)
    cbt = torch.tensor([[1]], dtype=torch.int32)
    c = torch.randn(n // ratio, 1, E, generator=gen).to(dtype)
    cc[1, : n // ratio] = c
    return q, k, kc, bt, seq, pos, cc, cbt, c


def _kernel_call(device, monkeypatch, q, kc, bt, seq, pos, comp, **kw):
    """The Triton kernel (CUDA natively, else the interpreter) on the same inputs."""
    if device == "cpu":
        monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    to = lambda x: x.to(device)  # noqa: E731
    c = CompressedKV(to(comp.cache), comp.ratio, to(comp.entries_TK), to(comp.block_table_BN))
    out = ops.paged_attention(to(q), to(kc), to(kc), to(bt), to(seq), to(pos), SCALE, compressed=c, **kw).cpu()
    monkeypatch.delenv("UM_OPS_BACKEND", raising=False)
    return out


def test_compressed_causality_error_names_the_row(gen, device, monkeypatch):
    q, k, kc, bt, seq, pos, cc, cbt, c = _tiny_cache(gen)
    ent = torch.full((10, 2), -1, dtype=torch.int32)
    ent[7, 0] = 1  # position 7 completes entry 1 (tokens 4..7): allowed
    ok = CompressedKV(cc, 4, ent, cbt)
    ops.paged_attention(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=ok)
    paged_attention_reference(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=ok)
    bad = ent.clone()
    bad[6, 1] = 1  # position 6: entry 1 is not complete yet
    comp = CompressedKV(cc, 4, bad, cbt)
    with pytest.raises(ValueError, match=r"row 6 \(position 6\).*entry 1.*j < \(p\+1\)//4 = 1"):
        ops.paged_attention(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=comp)
    with pytest.raises(ValueError, match=r"row 6 \(position 6\)"):
        paged_attention_reference(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=comp)
    # the kernel masks it: the bits of the list without it
    masked = _kernel_call(device, monkeypatch, q, kc, bt, seq, pos, comp, sliding_window=4)
    clean = _kernel_call(device, monkeypatch, q, kc, bt, seq, pos, ok, sliding_window=4)
    assert torch.equal(masked, clean)


def test_compressed_argument_errors(gen):
    q, k, kc, bt, seq, pos, cc, cbt, c = _tiny_cache(gen)
    ent = torch.full((10, 2), -1, dtype=torch.int32)
    attend = lambda comp, **kw: ops.paged_attention(q, kc, kc, bt, seq, pos, SCALE, compressed=comp, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="needs sliding_window"):
        attend(CompressedKV(cc, 4, ent, cbt))
    for comp, what in ((CompressedKV(cc.to(torch.float8_e4m3fn), 4, ent, cbt), "no FP8"),
                       (CompressedKV(cc[..., :16], 4, ent, cbt), r"\[N, S//ratio, 1, 32\]"),
                       (CompressedKV(cc, 0, ent, cbt), "ratio must be an int >= 1"),
                       (CompressedKV(cc, 4, ent[:3], cbt), r"entries_TK must be int32/int64 \[10, K\]"),
                       (CompressedKV(cc, 4, ent.float(), cbt), "entries_TK"),
                       (CompressedKV(cc, 4, ent, cbt[0]), "block_table_BN"),
                       ("nope", "must be a CompressedKV")):
        with pytest.raises(ValueError, match=what):
            attend(comp, sliding_window=4)
    far = ent.clone()
    far[9, 0] = 5  # causal at ratio 1 (j < 10), but past the block table's one page of 4 entries
    with pytest.raises(ValueError, match="row 9 lists compressed entry 5, past the compressed block table"):
        attend(CompressedKV(cc, 1, far, cbt), sliding_window=4)
    with pytest.raises(ValueError, match="S//ratio = 0"):
        attend(CompressedKV(cc[:, :0], 4, ent, cbt), sliding_window=4)


def test_compressed_k_zero_equals_all_minus_one(gen, inv, device, monkeypatch):
    q, k, kc, bt, seq, pos, cc, cbt, c = _tiny_cache(gen)
    k0 = CompressedKV(cc, 4, torch.zeros(10, 0, dtype=torch.int32), cbt)
    none = CompressedKV(cc, 4, torch.full((10, 3), -1, dtype=torch.int32), cbt)
    ref = paged_attention_reference(q.double(), kc, kc, bt, seq, pos, SCALE, sliding_window=4)
    for backend in ("torch", "triton"):
        if backend == "torch":
            a = ops.paged_attention(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=k0)
            b = ops.paged_attention(q, kc, kc, bt, seq, pos, SCALE, sliding_window=4, compressed=none)
        else:
            a = _kernel_call(device, monkeypatch, q, kc, bt, seq, pos, k0, sliding_window=4)
            b = _kernel_call(device, monkeypatch, q, kc, bt, seq, pos, none, sliding_window=4)
        inv.assert_bitwise(a, b, f"{backend}: K=0 vs all -1")
        torch.testing.assert_close(a.double(), ref, **BF16_TOL)


@pytest.mark.parametrize("backend,chunking", [("torch", "default"), ("triton", "default"),
                                              ("torch", "chunks of 4, one per batch"),
                                              ("torch", "chunks of 4, one batch")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_gradients_match_fp64(backend, chunking, dtype, device, gen, inv, monkeypatch):
    """Two packed sequences (21 and 9 tokens), window 5, ratio 4, CSA-like lists, a sink. Step 1
    (no grad) writes the first 6 tokens of sequence 0 and its first entry; step 2 writes the rest
    with grad and attends: gradients to q, the sink, the window K = V and the entries written in
    step 2 vs fp64 autograd of the dense oracle (step 1's keys and entries constants)."""
    if backend == "triton" and device == "cuda":
        pytest.skip("CPU inputs; the CUDA kernels' gradients run in tests/gpu/")
    if chunking != "default":  # the windowed backward's layout: partial chunks, padded slots and spans, batches
        from unified_models.ops.attention import backward as attn_backward

        monkeypatch.setattr(attn_backward, "GRAD_TOKENS", 4)
        monkeypatch.setattr(attn_backward, "GRAD_BATCH_ELEMENTS", 1 if chunking.endswith("per batch") else 1 << 40)
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    H, S, W, r, pages = 4, 16, 5, 4, 2
    lens, pre = [21, 9], 6
    lists = _lists(lens, r, 3, gen)
    kw = max(len(x) for rows in lists for x in rows) + 1
    q = [torch.randn(n, H, E, generator=gen).to(dtype) for n in lens]
    k = [torch.randn(n, 1, E, generator=gen).to(dtype) for n in lens]
    c = [torch.randn(n // r, 1, E, generator=gen).to(dtype) for n in lens]
    sink = (torch.randn(H, generator=gen) * 2.0).float()
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    ctable = torch.tensor([[4, 1, 3], [0, 2, 5]], dtype=torch.int32)
    kc = torch.zeros(4, S, 1, E, dtype=dtype)
    cc = torch.zeros(6, pages, 1, E, dtype=dtype)

    def tokens(items):
        seq = torch.tensor([b for b, _ in items], dtype=torch.int32)
        pos = torch.tensor([p for _, p in items])
        return seq, pos

    def write_step(items, ks, cs):
        seq, pos = tokens(items)
        slots = table[seq.long(), pos // S].long() * S + pos % S
        kk = torch.stack([ks[b][p] for b, p in items])
        ops.write_kv_cache(kk, kk, kc, kc, slots)
        cslots = entry_slots(ctable, seq, pos, r, pages * r)
        ee = torch.stack([cs[b][p // r] if int(sl) >= 0 else cs[0][0] * 0 for (b, p), sl in zip(items, cslots)])
        ops.write_kv_cache(ee, ee, cc, cc, cslots)
        return seq, pos

    first = [(0, p) for p in range(pre)]
    rest = [(0, p) for p in range(pre, lens[0])] + [(1, p) for p in range(lens[1])]
    perm = torch.randperm(len(rest), generator=gen).tolist()
    rest = [rest[i] for i in perm]
    with torch.no_grad():
        write_step(first, k, c)
    qs = [x.detach().clone().requires_grad_() for x in q]
    ks = [x.detach().clone().requires_grad_() for x in k]
    cs = [x.detach().clone().requires_grad_() for x in c]
    ss = sink.detach().clone().requires_grad_()
    seq, pos = write_step(rest, ks, cs)
    ent = torch.stack([_padded([lists[b][p]], kw)[0] for b, p in rest])
    qq = torch.stack([qs[b][p] for b, p in rest])
    comp = CompressedKV(cc, r, ent, ctable)
    out = ops.paged_attention(qq, kc, kc, table, seq, pos, SCALE, sliding_window=W, sink=ss, compressed=comp)
    with torch.no_grad():
        again = ops.paged_attention(qq, kc, kc, table, seq, pos, SCALE, sliding_window=W, sink=sink, compressed=comp)
    inv.assert_bitwise(out.detach(), again, "grad vs no-grad forward")
    g = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(g)

    # fp64 oracle: step-1 keys/entries detached (constants), the rest differentiable
    q64 = [x.detach().double().requires_grad_() for x in q]
    k64 = [x.detach().double().requires_grad_() for x in k]
    c64 = [x.detach().double().requires_grad_() for x in c]
    s64 = sink.detach().double().requires_grad_()
    n_pre_c = (pre // r)  # entries completed in step 1 (of sequence 0)
    k_seq0 = torch.cat([k64[0][:pre].detach(), k64[0][pre:]])
    c_seq0 = torch.cat([c64[0][:n_pre_c].detach(), c64[0][n_pre_c:]])
    ref = [dense_compressed_attention_reference(q64[0], k_seq0, k_seq0, c_seq0, _padded(lists[0], kw), SCALE, W,
                                                sink=s64),
           dense_compressed_attention_reference(q64[1], k64[1], k64[1], c64[1], _padded(lists[1], kw), SCALE, W,
                                                sink=s64)]
    ref_rows = torch.stack([ref[b][p] for b, p in rest])
    ref_rows.backward(g.double())
    checks = [("sink", ss.grad, s64.grad)]
    for b in range(2):
        checks += [(f"q{b}", qs[b].grad[pre if b == 0 else 0:], q64[b].grad[pre if b == 0 else 0:]),
                   (f"k{b}", ks[b].grad, k64[b].grad), (f"c{b}", cs[b].grad, c64[b].grad)]
    for name, got, want in checks:
        assert got is not None, name
        err = float((got.double() - want).norm() / want.norm())
        assert err <= TOL[dtype], f"{name}: gradient rel. error {err:.3e}"
    # step-1 rows are constants: no gradient reaches them
    assert float(ks[0].grad[:pre].abs().max()) == 0 and float(cs[0].grad[:n_pre_c].abs().max()) == 0
    assert float(c64[0].grad[n_pre_c:].abs().max()) > 1e-3  # the entries' gradient is real


def test_read_kv_cache_exact_and_gradients(gen, inv):
    """fp32 rows cache (the compressor's ``kv | score`` rows): values are an exact copy (vs the
    oracle, padding slots zero); rows written this step carry their graph, older rows are constants."""
    S, G, C = 8, 1, 12
    cache = torch.full((4, S, G, C), float("nan"), dtype=torch.float32)
    old = torch.randn(5, G, C, generator=gen)
    old_slots = torch.tensor([9, 10, 11, 12, 13])
    ops.write_kv_cache(old, old, cache, cache, old_slots)  # no grad: constants
    new = torch.randn(6, G, C, generator=gen).requires_grad_()
    new_slots = torch.tensor([14, 15, 24, 25, -1, 26])
    ops.write_kv_cache(new, new, cache, cache, new_slots)
    read = torch.tensor([26, 9, 14, -1, 25, 13, 15, 14])
    rows = ops.read_kv_cache(cache, read)
    inv.assert_bitwise(rows.detach(), read_kv_cache_reference(cache, read), "read vs oracle")
    assert torch.equal(rows[3], torch.zeros(G, C))
    assert torch.equal(rows[0].detach(), new[5].detach()) and torch.equal(rows[1], old[0])
    w = torch.randn(rows.shape, generator=gen)
    (rows * w).sum().backward()
    want = torch.zeros_like(new)
    for x, sl in enumerate(read.tolist()):
        hit = (new_slots == sl).nonzero().view(-1)
        if sl >= 0 and hit.numel():
            want[int(hit[-1])] += w[x]
    assert torch.equal(new.grad, want)
    assert float(want.abs().max()) > 0  # rows of this step were read
    # bf16 rows into an fp32 cache: straight through the cast
    with pytest.raises(ValueError, match="no FP8"):
        ops.read_kv_cache(cache.to(torch.float8_e4m3fn), read)
    with pytest.raises(ValueError, match="past the cache"):
        ops.read_kv_cache(cache, torch.tensor([32]))


def test_windowed_recompute_tensor_core_path(monkeypatch):
    """The windowed backward's recomputation (``_attend_window``) in a bf16 model on CUDA runs its four
    products as bf16 GEMMs with fp32 sums (``RecomputeBmm``; emulated here: bf16 operands, exact products):
    queries, keys and entries (bf16 values) as one term, probabilities and gradients as ``hi + lo``; every
    GEMM gets bf16 operands only and the gradients to q, k, v, the entries and the sink stay within 3e-5
    of fp64 autograd of the same formula (measured ~5e-6; fp32 GEMMs ~1e-7)."""
    from unified_models.ops.attention.backward import _attend_window
    from unified_models.ops.grad import helpers

    real = helpers.grad_matmul
    calls = emulate_tensor_cores(monkeypatch, helpers)
    gen = torch.Generator().manual_seed(9)
    B, Q, S, K, G, R, E_ = 3, 5, 7, 4, 2, 3, 16
    q = torch.randn(B, Q, G * R, E_, generator=gen).bfloat16().float()
    k, v = (torch.randn(B, S, G, E_, generator=gen).bfloat16().float() for _ in range(2))
    c = torch.randn(B, Q, K, G, E_, generator=gen).bfloat16().float()
    pos = torch.arange(S)
    qpos = torch.randint(2, S, (B, Q), generator=gen)
    mask = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] > qpos[:, :, None] - 3)
    cvalid = torch.rand(B, Q, K, generator=gen) > 0.3
    sink = torch.randn(G * R, generator=gen)
    grad = torch.randn(B, Q, G * R, E_, generator=gen)

    def grads(dtype, half):
        xs = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v, c, sink)]
        out = _attend_window(xs[0], xs[1], xs[2], mask, 0.25, xs[4], xs[3], cvalid, half)
        out.backward(grad.to(dtype))
        return [x.grad for x in xs]

    got = grads(torch.float32, torch.bfloat16)
    assert len(calls) >= 4 * 2  # four products forward, their gradients backward, all bf16
    monkeypatch.setattr(helpers, "grad_matmul", real)
    ref = grads(torch.float64, None)
    plain = grads(torch.float32, None)
    for name, a, p32, r in zip(("q", "k", "v", "entries", "sink"), got, plain, ref):
        err = float((a.double() - r).norm() / r.norm())
        print(f"GRAD-ERR windowed recompute tensor-core d{name}: {err:.2e}")
        assert err <= 3e-5, f"d{name}: {err:.2e}"
        assert float((p32.double() - r).norm() / r.norm()) <= 1e-5, name
