"""Sliding-window and shared-K=V paged attention: Triton kernel (interpreter on CPU) and CPU path.

Properties, all bitwise unless stated:

* with a window W a token at position p reads positions ``max(0, p-W+1)..p``; its output
  is the same in one prefill (tokens of all sequences in random order, padding rows),
  chunked prefill and token-by-token decode, for several block sizes, across the
  window edge (sequences much longer than W) and, for the Triton kernel, across its
  query tiles and KV splits (32 positions under the interpreter);
* the kernels never read behind the window: as vLLM's sliding-window manager does, the
  blocks that left every future token's window are swapped for a NaN "null" block in the
  block table and their physical pages refilled with NaN before each step;
* a window at least as long as the sequence gives the bits of full attention;
* within dtype tolerance the output equals the fp64 windowed oracle;
* a shared K = V cache (one tensor, ``v_cache is k_cache``) gives the bits of separate
  caches holding ``v = k``;
* gradients (recomputation in the backward) match fp64 autograd of the windowed oracle.
"""

from __future__ import annotations

import pytest
import torch

from invariance import scattered_block_table
from unified_models import ops
from unified_models.ops.attention import (dense_causal_attention_reference, paged_attention_reference,
                                          paged_attention_torch, write_kv_cache_torch)

E = 32
SCALE = E ** -0.5
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
NULL = 0
"""Physical block 0: vLLM's null block (never written here, NaN)."""


def _triton():
    from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

    return write_kv_cache_triton, paged_attention_triton


def _torch():
    return write_kv_cache_torch, paged_attention_torch


IMPLS = {"triton": _triton, "torch": _torch}


def _seqs(lengths, H, G, gen, dtype=torch.bfloat16):
    return [dict(q=torch.randn(n, H, E, generator=gen).to(dtype), k=(torch.randn(n, G, E, generator=gen) * 2).to(dtype),
                 v=torch.randn(n, G, E, generator=gen).to(dtype)) for n in lengths]


class WindowRun:
    """A paged cache with block 0 reserved as the null block, and a schedule of steps.

    ``free=True``: before each step, blocks wholly below ``num_computed - W + 1`` of each
    sequence (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``) are replaced by the
    null block in the block table and their pages filled with NaN (reuse by others).
    ``shared``: one K = V cache (``v = k``).
    """

    def __init__(self, seqs, S, G, window, impl, device, gen, *, free=True, shared=False):
        self.seqs, self.S, self.window, self.device, self.gen = seqs, S, window, device, gen
        self.write, self.attend = impl
        self.free, self.shared = free, shared
        need = [-(-s["q"].shape[0] // S) for s in seqs]
        n_blocks = sum(need) + 3
        dtype = seqs[0]["q"].dtype
        self.buf = torch.full((n_blocks, 2, S, G, E), float("nan"), dtype=dtype, device=device)
        self.k_cache = self.buf[:, 0]
        self.v_cache = self.k_cache if shared else self.buf[:, 1]
        table = scattered_block_table(need, n_blocks - 1, gen, max(need) + 2) + 1  # block 0 stays null
        self.block_table = table.to(torch.int32).to(device)
        self.done = [0] * len(seqs)
        self.out = [torch.full_like(s["q"], float("nan")) for s in seqs]

    def _free_behind_window(self):
        for b, n in enumerate(self.done):
            skipped = max(0, n - self.window + 1) if self.window is not None else 0
            for i in range(skipped // self.S):
                blk = int(self.block_table[b, i])
                if blk != NULL:
                    self.buf[blk] = float("nan")
                    self.block_table[b, i] = NULL

    def step(self, chunks, n_pad=0):
        if self.free:
            self._free_behind_window()
        toks = [(b, p) for b, s, e in chunks for p in range(s, e)] + [(-1, -1)] * n_pad
        toks = [toks[i] for i in torch.randperm(len(toks), generator=self.gen).tolist()]
        H, G = self.seqs[0]["q"].shape[1], self.seqs[0]["k"].shape[1]
        junk = lambda *shape: (torch.randn(*shape, generator=self.gen) * 100).to(self.buf.dtype)  # noqa: E731
        q = torch.stack([self.seqs[b]["q"][p] if b >= 0 else junk(H, E) for b, p in toks]).to(self.device)
        k = torch.stack([self.seqs[b]["k"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        v = k if self.shared else torch.stack(
            [self.seqs[b]["v"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        slots = torch.tensor([int(self.block_table[b, p // self.S]) * self.S + p % self.S if b >= 0 else -1
                              for b, p in toks], dtype=torch.int64, device=self.device)
        seq = torch.tensor([max(b, 0) for b, _ in toks], dtype=torch.int32, device=self.device)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64, device=self.device)
        self.write(k, v, self.k_cache, self.v_cache, slots)
        o = self.attend(q, self.k_cache, self.v_cache, self.block_table, seq, pos, SCALE,
                        sliding_window=self.window).cpu()
        for i, (b, p) in enumerate(toks):
            if b >= 0:
                self.out[b][p] = o[i]
        for b, s, e in chunks:
            self.done[b] = max(self.done[b], e)
        return o, toks


def _prefill(run):
    run.step([(b, 0, s["q"].shape[0]) for b, s in enumerate(run.seqs)], n_pad=3)


def _chunked(run):
    lens = [s["q"].shape[0] for s in run.seqs]
    while any(d < n for d, n in zip(run.done, lens)):
        chunks = []
        for b, n in enumerate(lens):
            if run.done[b] < n and int(torch.randint(0, 4, (1,), generator=run.gen)) > 0:
                c = int(torch.randint(1, 14, (1,), generator=run.gen))
                chunks.append((b, run.done[b], min(run.done[b] + c, n)))
        if chunks:
            run.step(chunks, n_pad=2)


def _decode(run):
    lens = [s["q"].shape[0] for s in run.seqs]
    for p in range(max(lens)):
        run.step([(b, p, p + 1) for b in range(len(lens)) if p < lens[b]], n_pad=1)


SCHEDULES = {"prefill": _prefill, "chunked": _chunked, "decode": _decode}


def _all_schedules(impl, device, gen, inv, seqs, G, window, block_sizes, shared=False):
    runs = {}
    for S in block_sizes:
        for name, fn in SCHEDULES.items():
            run = WindowRun(seqs, S, G, window, impl, device, gen, shared=shared)
            fn(run)
            runs[(name, S)] = run
    base = runs[("prefill", block_sizes[0])]
    for key, run in runs.items():
        for b in range(len(seqs)):
            inv.assert_bitwise(run.out[b], base.out[b], f"W={window} seq {b} {key} vs prefill")
    return base


# Triton under the interpreter: BLOCK_KV 16, SPLIT_KV 32, 32 rows per program, so a 70-token
# sequence spans 3 splits, and windows 5/16/40 start inside a KV tile, on a tile edge and a
# split behind the token.
# (The interpreter is slow: the Triton cases are fewer.)
@pytest.mark.parametrize("impl_name,block_sizes,window", [("triton", (8,), 5), ("triton", (16,), 40),
                                                          ("torch", (16, 32), 5), ("torch", (16, 32), 16),
                                                          ("torch", (16, 32), 40)])
def test_window_prefill_chunked_decode_bitwise_and_oracle(impl_name, block_sizes, window, device, gen, inv):
    if impl_name == "torch":
        device = "cpu"
    H, G = 4, 2
    seqs = _seqs([66, 1, 20], H, G, gen)
    base = _all_schedules(IMPLS[impl_name](), device, gen, inv, seqs, G, window, block_sizes)
    for b, s in enumerate(seqs):
        exact = dense_causal_attention_reference(s["q"].double(), s["k"].double(), s["v"].double(), SCALE, window)
        torch.testing.assert_close(base.out[b].double(), exact, **BF16_TOL)
    # the window is really applied: full attention differs past the edge
    full = dense_causal_attention_reference(seqs[0]["q"].double(), seqs[0]["k"].double(), seqs[0]["v"].double(),
                                            SCALE)
    assert (base.out[0][window:].double() - full[window:]).abs().max() > 0.1


@pytest.mark.parametrize("impl_name", ["triton", "torch"])
def test_long_window_equals_full_attention(impl_name, device, gen, inv):
    if impl_name == "torch":
        device = "cpu"
    seqs = _seqs([40, 7], 4, 2, gen)
    a = WindowRun(seqs, 16, 2, None, IMPLS[impl_name](), device, gen)
    b = WindowRun(seqs, 16, 2, 40, IMPLS[impl_name](), device, gen)
    _prefill(a)
    _decode(b)
    for i in range(2):
        inv.assert_bitwise(b.out[i], a.out[i], f"seq {i}: W=40 decode vs full prefill")


def test_window_triton_matches_paged_reference_and_torch_path(device, gen):
    seqs = _seqs([45, 12], 4, 2, gen)
    run = WindowRun(seqs, 16, 2, 9, _triton(), device, gen, free=False)
    o, toks = run.step([(0, 0, 45), (1, 0, 12)])
    q = torch.stack([seqs[b]["q"][p] for b, p in toks])
    seq, pos = torch.tensor([b for b, _ in toks]), torch.tensor([p for _, p in toks])
    ref = paged_attention_reference(q.double(), run.k_cache.cpu(), run.v_cache.cpu(), run.block_table.cpu(), seq, pos,
                                    SCALE, sliding_window=9)
    torch.testing.assert_close(o.double(), ref, **BF16_TOL)


@pytest.mark.parametrize("impl_name", ["triton", "torch"])
def test_shared_kv_cache_equals_separate_caches_with_v_equal_k(impl_name, device, gen, inv):
    if impl_name == "torch":
        device = "cpu"
    seqs = _seqs([30, 11], 4, 1, gen)
    for s in seqs:
        s["v"] = s["k"]
    sep = WindowRun(seqs, 16, 1, 12, IMPLS[impl_name](), device, gen)
    shared = WindowRun(seqs, 16, 1, 12, IMPLS[impl_name](), device, gen, shared=True)
    _prefill(sep)
    _chunked(shared)
    assert shared.v_cache is shared.k_cache
    for i in range(2):
        inv.assert_bitwise(shared.out[i], sep.out[i], f"seq {i}: shared K=V chunked vs separate prefill")


def test_sliding_window_argument_errors(device):
    q = torch.zeros(3, 4, E)
    kc = torch.zeros(2, 16, 2, E)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    idx = torch.zeros(3, dtype=torch.int32)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            ops.paged_attention(q, kc, kc.clone(), bt, idx, idx, SCALE, sliding_window=bad)
    k = torch.zeros(3, 2, E)
    with pytest.raises(ValueError, match="shared K = V cache"):
        ops.write_kv_cache(k, k.clone(), kc, kc, idx.long())


# ----------------------------------------------------------------------------- gradients

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("backend,chunking", [("torch", "default"), ("triton", "default"),
                                              ("torch", "chunks of 4, one per batch"),
                                              ("torch", "chunks of 4, one batch")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_gradients_match_fp64(backend, chunking, dtype, device, gen, inv, monkeypatch):
    """Two packed sequences (29 and 6 tokens), window 7 (sequence 0 crosses it, sequence 1
    does not), plus a shared K = V layer; gradients to q, k, v vs fp64 autograd."""
    if backend == "triton" and device == "cuda":
        pytest.skip("CPU inputs; the CUDA kernels' gradients run in tests/gpu/")
    if chunking != "default":  # the windowed backward's layout: partial chunks, padded slots and spans, batches
        from unified_models.ops.attention import backward as attn_backward

        monkeypatch.setattr(attn_backward, "GRAD_TOKENS", 4)
        monkeypatch.setattr(attn_backward, "GRAD_BATCH_ELEMENTS", 1 if chunking.endswith("per batch") else 1 << 40)
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    H, G, S, W = 4, 2, 16, 7
    lens = [29, 6]
    t = sum(lens)
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens)).int()
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = table[seq.long(), pos // S].long() * S + pos % S
    q, k, v = (torch.randn(t, h, E, generator=gen).to(dtype) for h in (H, G, G))
    g = torch.randn(t, H, E, generator=gen).to(dtype)
    cuts = [0, lens[0], t]

    def op(q_, k_, v_, shared=False):
        kc = torch.zeros(4, S, G, E, dtype=dtype)
        vc = kc if shared else torch.zeros_like(kc)
        ops.write_kv_cache(k_, k_ if shared else v_, kc, vc, slots)
        return ops.paged_attention(q_, kc, vc, table, seq, pos, SCALE, sliding_window=W)

    def ref(q64, k64, v64, shared=False):
        return torch.cat([dense_causal_attention_reference(q64[a:b], k64[a:b], (k64 if shared else v64)[a:b], SCALE,
                                                           W) for a, b in zip(cuts[:-1], cuts[1:])])

    for shared in (False, True):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = op(*xs, shared=shared)
        with torch.no_grad():
            inv.assert_bitwise(out.detach(), op(q, k, v, shared=shared), f"shared={shared}: grad vs no-grad forward")
        out.backward(g)
        x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref(*x64, shared=shared).backward(g.double())
        for i in range(2 if shared else 3):  # shared: v is unused
            err = float((xs[i].grad.double() - x64[i].grad).norm() / x64[i].grad.norm())
            assert err <= TOL[dtype], f"shared={shared} input {i}: gradient rel. error {err:.3e}"
