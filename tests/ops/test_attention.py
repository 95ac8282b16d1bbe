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
The Triton read path's query tiles and KV splits (small under the interpreter,
so these sequences cross several): a token's bits are the same whether its tile
is full, partial or a single token, its sequence one run or split into several
runs among other sequences, its tokens chunked by the workspace cap; the tile
schedule follows its rule; the launch grid (a size only) never changes a result.
"""

from __future__ import annotations

import pytest
import torch

from invariance import scattered_block_table
from unified_models.ops.attention import (dense_causal_attention_reference, paged_attention_reference,
                                          paged_attention_torch, write_kv_cache_torch)

E = 32
SCALE = E ** -0.5


def _triton_impl():
    from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

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
        # Entries past a sequence's end hold stale ids (as vLLM's persistent block table does):
        # other sequences' blocks / stale blocks by default, or ``junk_table`` (e.g. out of range).
        self.block_table = scattered_block_table(need, num_blocks, gen, max(need) + 2, junk_table).to(device)
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
# (as BLOCK_KV=64 over 16-slot blocks does on GPU). The interpreter pays per step:
# the second case (more query heads per KV head, a block size that is not a power of
# two) compares its schedules within one block size; the first compares 16 with 8.
@pytest.mark.parametrize("H,G,block_sizes", [(4, 2, (16, 8)), (8, 2, (24,))])
def test_triton_prefill_chunked_decode_block_sizes(H, G, block_sizes, device, gen, inv):
    _check_schedules(_triton_impl(), device, gen, inv, H, G, torch.bfloat16, LENGTHS, BF16_TOL, block_sizes)


def test_triton_fp32_mha(device, gen, inv):
    _check_schedules(_triton_impl(), device, gen, inv, 2, 2, torch.float32, [19, 33], FP32_TOL, (8,))


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
    from unified_models.ops.attention.triton import AttentionLaunch

    # fp32 cache (and, on CPU, the interpreter): TMA K/V loads do not apply, and asking for them says so
    with pytest.raises(ValueError, match="kv_tma=True"):
        attend(torch.zeros(3, 8, E, device=device), kc, kc, bt, idx, idx, SCALE, launch=AttentionLaunch(kv_tma=True))


@pytest.mark.parametrize("H,G", [(4, 2)])
def test_torch_prefill_chunked_decode_block_sizes(H, G, gen, inv):
    _check_schedules(_torch_impl(), "cpu", gen, inv, H, G, torch.bfloat16, LENGTHS, BF16_TOL)


# ----------------------------------------------------------------------------- query tiles and KV splits
#
# The Triton read path runs query tiles (up to BLOCK_T consecutive tokens of one sequence x the q heads
# of one kv head) over KV splits of SPLIT_KV positions (32 under the interpreter, so these small
# sequences cross several), merged in a second kernel. A token's bits must not depend on its tile's
# other rows, on how many splits the batch has, on the chunking of the tokens, or on the launch grid.


def _tri():
    from unified_models.ops.attention import triton as tri

    return tri


class FlatRun:
    """A paged cache (bf16, or FP8 with scales) and steps given as explicit flat token lists."""

    def __init__(self, seqs, S, G, device, gen, scales=None):
        tri = _tri()
        self.seqs, self.S, self.device, self.gen = seqs, S, device, gen
        self.scales = None if scales is None else tuple(s.to(device) for s in scales)
        need = [-(-s["q"].shape[0] // S) for s in seqs]
        nb = sum(need) + 2
        shape = (nb, 2, S, G, E)
        if scales is None:
            self.buf = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
        else:  # stale NaN codes everywhere
            self.buf = torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        self.k_cache, self.v_cache = self.buf[:, 0], self.buf[:, 1]
        self.block_table = scattered_block_table(need, nb, gen, max(need) + 1).to(device)
        self.out = [torch.full_like(s["q"], float("nan")) for s in seqs]
        self.write, self.attend = tri.write_kv_cache_triton, tri.paged_attention_triton

    def inputs(self, toks):
        H, G = self.seqs[0]["q"].shape[1], self.seqs[0]["k"].shape[1]
        dt = self.seqs[0]["q"].dtype
        junk = lambda *shape: (torch.randn(*shape, generator=self.gen) * 100).to(dt)  # noqa: E731
        q = torch.stack([self.seqs[b]["q"][p] if b >= 0 else junk(H, E) for b, p in toks]).to(self.device)
        k = torch.stack([self.seqs[b]["k"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        v = torch.stack([self.seqs[b]["v"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        slots = torch.tensor([int(self.block_table[b, p // self.S]) * self.S + p % self.S if b >= 0 else -1
                              for b, p in toks], dtype=torch.int64, device=self.device)
        seq = torch.tensor([max(b, 0) for b, _ in toks], dtype=torch.int32, device=self.device)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64, device=self.device)
        return q, k, v, slots, seq, pos

    def step(self, toks):
        """``toks``: [(seq, pos)] in flat order, ``(-1, -1)`` for a padding token."""
        q, k, v, slots, seq, pos = self.inputs(toks)
        sc = self.scales or ()
        self.write(k, v, self.k_cache, self.v_cache, slots, *sc)
        o = self.attend(q, self.k_cache, self.v_cache, self.block_table, seq, pos, SCALE, *sc).cpu()
        pad = torch.tensor([b < 0 for b, _ in toks])
        assert (o[pad] == 0).all(), "padding tokens must give zeros"
        for i, (b, p) in enumerate(toks):
            if b >= 0:
                self.out[b][p] = o[i]
        return o


def _with_padding(toks, n_pad, gen):
    """``toks`` with ``n_pad`` padding tokens inserted at random places (order kept)."""
    for _ in range(n_pad):
        i = int(torch.randint(0, len(toks) + 1, (1,), generator=gen))
        toks = toks[:i] + [(-1, -1)] + toks[i:]
    return toks


def _run_tiles(run, name, gen, cuts=(1, 7, 31, 33, 64), prefix=44):
    lens = [s["q"].shape[0] for s in run.seqs]
    if name == "prefill":  # sequences in order, each one run
        run.step([(b, p) for b, n in enumerate(lens) for p in range(n)] + [(-1, -1)] * 3)
    elif name == "mixed":  # random sequence order, sequence 0 in two runs with others between, padding
        a = int(torch.randint(2, lens[0] - 1, (1,), generator=gen))
        parts = [[(0, p) for p in range(a)], [(0, p) for p in range(a, lens[0])]]
        parts += [[(b, p) for p in range(n)] for b, n in enumerate(lens) if b > 0]
        order = [0] + [i + 2 for i in torch.randperm(len(parts) - 2, generator=gen).tolist()] + [1]
        run.step(_with_padding([t for i in order for t in parts[i]], 4, gen))
    elif name == "permuted":  # every token on its own (random flat order)
        toks = [(b, p) for b, n in enumerate(lens) for p in range(n)] + [(-1, -1)] * 2
        run.step([toks[i] for i in torch.randperm(len(toks), generator=gen).tolist()])
    elif name == "chunked":  # sequence 0 cut at ``cuts``, the others at random points
        bounds = [sorted({0, lens[0], *[c for c in cuts if c < lens[0]]})]
        for n in lens[1:]:
            bounds.append(sorted({0, n, *torch.randint(1, max(n, 2), (2,), generator=gen).tolist()}))
            bounds[-1] = [c for c in bounds[-1] if c <= n]
        for i in range(max(len(bd) for bd in bounds) - 1):
            chunks = [[(b, p) for p in range(bd[i], bd[i + 1])] for b, bd in enumerate(bounds) if i + 1 < len(bd)]
            chunks = [chunks[j] for j in torch.randperm(len(chunks), generator=gen).tolist()]
            run.step(_with_padding([t for c in chunks for t in c], 1, gen))
    else:  # decode: a prefix of each sequence (none of the last), then token by token, all per step
        run.step([(b, p) for b, n in enumerate(lens[:-1]) for p in range(min(prefix, n))])
        for p in range(min(prefix, lens[-1])):
            run.step([(len(lens) - 1, p)])
        for p in range(prefix, max(lens)):
            run.step(_with_padding([(b, p) for b, n in enumerate(lens) if p < n], 1, gen))


TILE_CASES = [(1, 2), (4, 2), (16, 1)]  # (q heads per kv head, kv heads)


# every tile case with a bf16 cache; the FP8 cache (its read rule inside the same tiles) at 4 q/kv
# (the FP8 write/read rules themselves: tests/ops/test_attention_fp8.py)
@pytest.mark.parametrize("q_per_kv,G,kv", [(q, g, "bf16") for q, g in TILE_CASES] + [(4, 2, "fp8")])
def test_triton_query_tiles_and_kv_splits_bitwise(q_per_kv, G, kv, device, gen, inv):
    """prefill == mixed batch (sequence 0 in two runs, other sequences before/after, padding)
    == every token alone == chunked prefill at arbitrary points == decode token by token,
    bitwise, for sequences spanning several query tiles and 3 KV splits; and the fp64 oracle."""
    tri = _tri()
    H = q_per_kv * G
    assert tri.SPLIT_KV == 32 and tri.BLOCK_KV == 16  # the interpreter's constants (splits at 32, 64)
    lens = [70, 41, 5]
    seqs = _sequences(lens, H, G, torch.bfloat16, gen)
    scales = None
    if kv == "fp8":
        scales = (torch.tensor(max(float(s["k"].float().abs().max()) for s in seqs) / 448 * 0.7),
                  torch.tensor(max(float(s["v"].float().abs().max()) for s in seqs) / 448))
    S = 16 if kv == "bf16" else 8
    runs = {}
    for name in ("prefill", "mixed", "permuted", "chunked", "decode"):
        run = FlatRun(seqs, S, G, device, gen, scales)
        _run_tiles(run, name, gen)
        runs[name] = run
    base = runs["prefill"]
    for name, run in runs.items():
        for b in range(len(seqs)):
            inv.assert_bitwise(run.out[b], base.out[b], f"seq {b} {name} vs prefill ({kv}, {q_per_kv} q/kv)")
    for b, s in enumerate(seqs):
        toks = [(b, p) for p in range(lens[b])]
        _, _, _, _, seq, pos = base.inputs(toks)
        ref = paged_attention_reference(s["q"].double(), base.k_cache.cpu(), base.v_cache.cpu(),
                                        base.block_table.cpu(), seq.cpu(), pos.cpu(), SCALE,
                                        *(scales or ()), **({"kv_dtype": torch.bfloat16} if scales else {}))
        torch.testing.assert_close(base.out[b].double(), ref, **BF16_TOL)


def test_triton_token_chunking_and_wide_block_tables(device, gen, inv, monkeypatch):
    """The workspace cap splits the tokens into chunks (tiles cut at chunk edges) and a wider
    block table adds splits past every token: neither changes a bit."""
    tri = _tri()
    H, G = 8, 2
    seqs = _sequences([70, 23], H, G, torch.bfloat16, gen)
    run = FlatRun(seqs, 16, G, device, gen)
    toks = _with_padding([(b, p) for b, n in enumerate([70, 23]) for p in range(n)], 3, gen)
    full = run.step(toks)
    q, _, _, _, seq, pos = run.inputs(toks)
    n_split = tri.num_splits(run.block_table, 16)
    per_token = H * n_split * (E + 2) * 4
    for tc in (1, 5, 32, 33):
        monkeypatch.setattr(tri, "WORKSPACE_BYTES", per_token * tc)
        got = run.attend(q, run.k_cache, run.v_cache, run.block_table, seq, pos, SCALE).cpu()
        inv.assert_bitwise(got, full, f"tokens in chunks of {tc}")
    monkeypatch.undo()
    wide = torch.cat([run.block_table, torch.full((2, 9), 10 ** 6, dtype=torch.int32, device=device)], dim=1)
    assert tri.num_splits(wide, 16) > n_split
    got = run.attend(q, run.k_cache, run.v_cache, wide, seq, pos, SCALE).cpu()
    inv.assert_bitwise(got, full, "wider block table (more splits)")


def _schedule_transcription(seq, pos, block_t, chunk):
    """Tile starts per chunk by the rule, written out in Python."""
    out = []
    for a in range(0, len(seq), chunk):
        starts, run0 = [], 0
        for i in range(a, min(len(seq), a + chunk)):
            brk = i == a or seq[i] != seq[i - 1] or pos[i] != pos[i - 1] + 1 or pos[i - 1] < 0 or pos[i] < 0
            run0 = i if brk else run0
            if pos[i] >= 0 and (i - run0) % block_t == 0:
                starts.append(i - a)
        out.append(starts)
    return out


@pytest.mark.parametrize("block_t,chunk", [(2, 1000), (8, 1000), (32, 1000), (4, 7), (8, 64)])
def test_triton_tile_schedule(block_t, chunk, device, gen):
    tri = _tri()
    seq, pos = [], []
    for _ in range(40):  # runs of random sequences, lengths and starts, padding between
        b, n, p0 = (int(x) for x in torch.randint(0, 4, (1,), generator=gen).tolist()
                    + torch.randint(1, 40, (1,), generator=gen).tolist()
                    + torch.randint(0, 100, (1,), generator=gen).tolist())
        seq += [b] * n
        pos += list(range(p0, p0 + n))
        if int(torch.randint(0, 3, (1,), generator=gen)) == 0:
            seq.append(0)
            pos.append(-1)
    T = len(seq)
    n_chunks = -(-T // chunk)
    sched = torch.full((n_chunks, chunk + 1), -7, dtype=torch.int32, device=device)
    tri._tile_schedule_kernel[(n_chunks,)](torch.tensor(seq, dtype=torch.int32, device=device),
                                           torch.tensor(pos, device=device), sched, T, chunk, sched.stride(0),
                                           BLOCK_T=block_t, SB=tri.SCHED_BLOCK)
    want = _schedule_transcription(seq, pos, block_t, chunk)
    for c, starts in enumerate(want):
        assert int(sched[c, 0]) == len(starts)
        assert sched[c, 1:1 + len(starts)].tolist() == starts


def test_triton_grid_is_a_launch_size_only(device, gen, inv):
    """The partial kernel's grid comes from host-known sizes (no device read) and is only a
    launch size: with the default grid, with programs capped so each walks several tiles,
    and for a shuffled batch (every token its own run: far more tiles than the default grid
    has programs), every token gets the bits of the contiguous batch."""
    tri = _tri()
    H, G = 8, 2
    lens = [40, 12]
    seqs = _sequences(lens, H, G, torch.bfloat16, gen)
    run = FlatRun(seqs, 16, G, device, gen)
    contiguous = [(b, p) for b, n in enumerate(lens) for p in range(n)]
    run.step(contiguous)  # fills the cache
    perm = torch.randperm(len(contiguous), generator=gen).tolist()
    shuffled = [contiguous[i] for i in perm]
    q, _, _, _, seq, pos = run.inputs(contiguous)
    _, _, _, _, seq_s, pos_s = run.inputs(shuffled)
    q_s = q[torch.tensor(perm, device=device)]

    def attend(q_, seq_, pos_, **launch):
        return run.attend(q_, run.k_cache, run.v_cache, run.block_table, seq_, pos_, SCALE,
                          launch=tri.AttentionLaunch(**launch) if launch else None)

    _, _, block_t = tri.tile_shape(H, G)
    T, B = len(contiguous), run.block_table.shape[0]
    sched = torch.empty((1, T + 1), dtype=torch.int32, device=device)

    def tiles(seq_, pos_):  # the device tile count of a one-chunk batch
        tri._tile_schedule_kernel[(1,)](seq_, pos_, sched, T, T, sched.stride(0), BLOCK_T=block_t, SB=tri.SCHED_BLOCK)
        return int(sched[0, 0])

    # contiguous runs (as vLLM sends them): the host-only bound gives every tile its own program
    assert tiles(seq, pos) <= tri._grid_sizes([(0, T)], block_t, B)[0] <= T
    want = attend(q, seq, pos)
    for cap in (1, 3):
        inv.assert_bitwise(attend(q, seq, pos, max_programs=cap), want, f"contiguous, {cap} program(s)")
    n_tiles = tiles(seq_s, pos_s)
    assert n_tiles > tri._grid_sizes([(0, T)], block_t, B)[0], (n_tiles, "tiles: expected more than programs")
    back = torch.tensor([perm.index(i) for i in range(T)], device=device)
    for launch in ({}, {"max_programs": 2}):
        inv.assert_bitwise(attend(q_s, seq_s, pos_s, **launch)[back], want, f"shuffled, {launch or 'default grid'}")
