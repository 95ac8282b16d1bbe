"""Paged attention and KV-cache write: Triton kernels and CPU implementations.

Properties (DESIGN.md rule 3), all bitwise:
* a token's output is the same in one full prefill (tokens of all sequences
  mixed in random order, with padding tokens), in chunked prefill (random
  chunks of several sequences per step) and in token-by-token decode with the
  cache written incrementally;
* the same for cache block sizes 16 and 32, with block tables that are random
  permutations of the physical blocks, K/V caches that are strided views of
  one allocation, and stale (NaN) memory in every unused slot;
and, within dtype tolerance, the output equals the fp64 dense causal oracle.
"""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.attention import (dense_causal_attention_reference, paged_attention_reference,
                                          paged_attention_torch, write_kv_cache_torch)

E = 32
SCALE = E ** -0.5


def _triton_impl():
    from unified_models.ops.triton.attention import paged_attention_triton, write_kv_cache_triton

    return write_kv_cache_triton, paged_attention_triton


def _torch_impl():
    return write_kv_cache_torch, paged_attention_torch


def _sequences(lengths, H, G, dtype, gen):
    return [dict(q=torch.randn(n, H, E, generator=gen).to(dtype),
                 k=(torch.randn(n, G, E, generator=gen) * 2.0).to(dtype),
                 v=torch.randn(n, G, E, generator=gen).to(dtype)) for n in lengths]


class PagedRun:
    """One cache (random block permutation, block size S) and a schedule of steps."""

    def __init__(self, seqs, S, G, dtype, device, gen, impl, junk_table=None):
        self.seqs, self.S, self.device, self.gen = seqs, S, device, gen
        self.write, self.attend = impl
        need = [-(-s["q"].shape[0] // S) for s in seqs]
        num_blocks = sum(need) + 3  # some blocks stay unused (stale)
        # K and V are strided views of one allocation, [num_blocks, 2, S, G, E], filled with stale NaN.
        self.buf = torch.full((num_blocks, 2, S, G, E), float("nan"), dtype=dtype, device=device)
        self.k_cache, self.v_cache = self.buf[:, 0], self.buf[:, 1]
        perm = torch.randperm(num_blocks, generator=gen)
        # Entries past a sequence's end hold stale ids (as vLLM's persistent block table does):
        # other sequences' blocks / stale blocks by default, or ``junk_table`` (e.g. out of range).
        shape = (len(seqs), max(need) + 2)
        self.block_table = (torch.randint(0, num_blocks, shape, generator=gen, dtype=torch.int32) if junk_table is None
                            else torch.full(shape, junk_table, dtype=torch.int32))
        used = 0
        for b, n in enumerate(need):
            self.block_table[b, :n] = perm[used:used + n].int()
            used += n
        self.block_table = self.block_table.to(device)
        self.out = [torch.full_like(s["q"], float("nan")) for s in seqs]

    def slot(self, b, p):
        return int(self.block_table[b, p // self.S]) * self.S + p % self.S

    def step(self, chunks, n_pad=0):
        """Run one batch: ``chunks`` = [(seq, start, end)], plus ``n_pad`` padding tokens."""
        toks = [(b, p) for b, s, e in chunks for p in range(s, e)] + [(-1, -1)] * n_pad
        order = torch.randperm(len(toks), generator=self.gen).tolist()
        toks = [toks[i] for i in order]
        H, G = self.seqs[0]["q"].shape[1], self.seqs[0]["k"].shape[1]
        junk = lambda *shape: (torch.randn(*shape, generator=self.gen) * 100).to(self.buf.dtype)  # noqa: E731
        q = torch.stack([self.seqs[b]["q"][p] if b >= 0 else junk(H, E) for b, p in toks]).to(self.device)
        k = torch.stack([self.seqs[b]["k"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        v = torch.stack([self.seqs[b]["v"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        slots = torch.tensor([self.slot(b, p) if b >= 0 else -1 for b, p in toks], dtype=torch.int64)
        seq_idx = torch.tensor([max(b, 0) for b, _ in toks], dtype=torch.int32)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64)
        self.write(k, v, self.k_cache, self.v_cache, slots.to(self.device))
        o = self.attend(q, self.k_cache, self.v_cache, self.block_table, seq_idx.to(self.device),
                        pos.to(self.device), SCALE).cpu()
        for i, (b, p) in enumerate(toks):
            if b >= 0:
                self.out[b][p] = o[i]
        return o, toks

    def check_cache(self, inv):
        """Every written slot holds its token's K/V exactly; every other slot is still NaN."""
        expect = torch.full_like(self.buf.cpu(), float("nan"))
        for b, s in enumerate(self.seqs):
            for p in range(s["q"].shape[0]):
                blk, off = int(self.block_table[b, p // self.S]), p % self.S
                expect[blk, 0, off] = s["k"][p]
                expect[blk, 1, off] = s["v"][p]
        got = self.buf.cpu()
        assert torch.equal(got.isnan(), expect.isnan()), "cache: written slots differ (padding written?)"
        inv.assert_bitwise(got[~got.isnan()], expect[~expect.isnan()], "cache contents")


def _prefill(run, n_pad=3):
    run.step([(b, 0, s["q"].shape[0]) for b, s in enumerate(run.seqs)], n_pad=n_pad)


def _chunked(run, gen, n_pad=2):
    pos = [0] * len(run.seqs)
    lens = [s["q"].shape[0] for s in run.seqs]
    while any(p < n for p, n in zip(pos, lens)):
        chunks = []
        for b in range(len(run.seqs)):
            if pos[b] < lens[b] and int(torch.randint(0, 4, (1,), generator=gen)) > 0:
                c = int(torch.randint(1, 14, (1,), generator=gen))
                chunks.append((b, pos[b], min(pos[b] + c, lens[b])))
                pos[b] = chunks[-1][2]
        if chunks:
            run.step(chunks, n_pad=n_pad)


def _decode(run):
    lens = [s["q"].shape[0] for s in run.seqs]
    for p in range(max(lens)):
        run.step([(b, p, p + 1) for b in range(len(run.seqs)) if p < lens[b]], n_pad=1)


def _check_schedules(impl, device, gen, inv, H, G, dtype, lengths, tol, block_sizes=(16, 32)):
    seqs = _sequences(lengths, H, G, dtype, gen)
    runs = {}
    for S in block_sizes:
        for name in ("prefill", "chunked", "decode"):
            run = PagedRun(seqs, S, G, dtype, device, gen, impl)
            {"prefill": lambda: _prefill(run), "chunked": lambda: _chunked(run, gen), "decode": lambda: _decode(run)}[name]()
            run.check_cache(inv)
            runs[(name, S)] = run
    base = runs[("prefill", block_sizes[0])]
    for key, run in runs.items():
        for b in range(len(seqs)):
            inv.assert_bitwise(run.out[b], base.out[b], f"seq {b} {key} vs (prefill, {block_sizes[0]})")
    for b, s in enumerate(seqs):
        ref = dense_causal_attention_reference(s["q"], s["k"], s["v"], SCALE)
        exact = dense_causal_attention_reference(s["q"].double(), s["k"].double(), s["v"].double(), SCALE)
        torch.testing.assert_close(base.out[b].double(), exact, **tol)
        torch.testing.assert_close(base.out[b].double(), ref.double(), **tol)
    return base


LENGTHS = [37, 1, 16, 22]
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


# The Triton kernel looks up each position's block on its own, so any block size
# works and gives the same bits; 8 and 24 make one KV tile span several blocks
# (as BLOCK_KV=64 over 16-slot blocks does on GPU).
@pytest.mark.parametrize("H,G,block_sizes", [(4, 2, (16, 32, 8)), (8, 2, (16, 32, 24))])
def test_triton_prefill_chunked_decode_block_sizes(H, G, block_sizes, device, gen, inv):
    _check_schedules(_triton_impl(), device, gen, inv, H, G, torch.bfloat16, LENGTHS, BF16_TOL, block_sizes)


def test_triton_fp32_mha(device, gen, inv):
    _check_schedules(_triton_impl(), device, gen, inv, 2, 2, torch.float32, [19, 33], FP32_TOL, (16, 8))


def test_triton_vs_paged_reference(device, gen):
    seqs = _sequences([21, 9], 4, 2, torch.bfloat16, gen)
    run = PagedRun(seqs, 16, 2, torch.bfloat16, device, gen, _triton_impl())
    o, toks = run.step([(0, 0, 21), (1, 0, 9)])
    q = torch.stack([seqs[b]["q"][p] for b, p in toks])
    ref = paged_attention_reference(q.double(), run.k_cache.cpu(), run.v_cache.cpu(), run.block_table.cpu(),
                                    torch.tensor([b for b, _ in toks]), torch.tensor([p for _, p in toks]), SCALE)
    torch.testing.assert_close(o.double(), ref, **BF16_TOL)


def test_triton_never_reads_block_table_past_the_token(device, gen, inv):
    """Block-table entries past a token's own blocks are never loaded (here: out-of-range ids)."""
    seqs = _sequences([21, 9], 4, 2, torch.bfloat16, gen)
    a = PagedRun(seqs, 16, 2, torch.bfloat16, device, gen, _triton_impl())
    b = PagedRun(seqs, 16, 2, torch.bfloat16, device, gen, _triton_impl(), junk_table=10 ** 6)
    _prefill(a)
    _decode(b)
    for i in range(2):
        inv.assert_bitwise(a.out[i], b.out[i], f"seq {i}")


def test_triton_padding_tokens_give_zeros(device, gen):
    seqs = _sequences([5], 4, 2, torch.bfloat16, gen)
    run = PagedRun(seqs, 16, 2, torch.bfloat16, device, gen, _triton_impl())
    o, toks = run.step([(0, 0, 5)], n_pad=3)
    pad = torch.tensor([b < 0 for b, _ in toks])
    assert (o[pad] == 0).all() and torch.isfinite(o[~pad]).all()


def test_triton_write_rounds_to_cache_dtype(device, gen, inv):
    write, _ = _triton_impl()
    k = torch.randn(5, 2, E, generator=gen).to(device)
    v = torch.randn(5, 2, E, generator=gen).to(device)
    kc = torch.zeros(2, 4, 2, E, dtype=torch.bfloat16, device=device)
    vc = torch.zeros(2, 4, 2, E, dtype=torch.bfloat16, device=device)
    write(k, v, kc, vc, torch.tensor([7, 0, -1, 3, 4], device=device))
    for i, s in [(0, 7), (1, 0), (3, 3), (4, 4)]:
        inv.assert_bitwise(kc[s // 4, s % 4], k[i].to(torch.bfloat16), f"k slot {s}")
        inv.assert_bitwise(vc[s // 4, s % 4], v[i].to(torch.bfloat16), f"v slot {s}")
    assert (kc.view(-1, 2, E)[[1, 2, 5, 6]] == 0).all(), "padding token or unused slot written"


def test_triton_errors(device):
    write, attend = _triton_impl()
    q = torch.zeros(3, 6, E, device=device)
    kc = torch.zeros(2, 16, 4, E, device=device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    idx = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple"):
        attend(q, kc, kc, bt, idx, idx, SCALE)
    with pytest.raises(ValueError, match="seq_idx"):
        attend(torch.zeros(3, 8, E, device=device), kc, kc, bt, idx[:2], idx, SCALE)
    with pytest.raises(ValueError, match="k_cache"):
        attend(torch.zeros(3, 8, E, device=device), kc[0], kc, bt, idx, idx, SCALE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write(torch.zeros(3, 4, E, device=device), torch.zeros(3, 4, E, device=device), kc, kc, idx[:2])


@pytest.mark.parametrize("H,G", [(4, 2)])
def test_torch_prefill_chunked_decode_block_sizes(H, G, gen, inv):
    _check_schedules(_torch_impl(), "cpu", gen, inv, H, G, torch.bfloat16, LENGTHS, BF16_TOL)
