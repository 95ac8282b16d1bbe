"""The lightning indexer ``ops.indexer_topk`` (DeepSeek-V4 CSA): Triton kernel (interpreter on
CPU, natively on CUDA) and the CPU path, against the fp64 per-sequence oracle.

Checked (bitwise where it says so):

* the selected entries equal the oracle's on random data (no ties), for bf16 and fp32, and
  the fp32 scores are within rounding of the fp64 scores;
* constructed exact ties (equal keys, so equal scores bit for bit): the larger entry wins,
  also across the top-k boundary; -0.0 and +0.0 are one score; NaN ranks as -inf;
* fewer valid entries than ``topk``: all of them, then -1; padding tokens: all -1;
* causality: only ``j < (p + 1) // ratio``, even when the future entries would score best
  (and entries past the bound, NaN in the cache, never reach a score);
* every output row is strictly descending, then -1 only;
* batch invariance: a token's scores and selection are bitwise the same alone, in any
  batch composition with padding rows, with other block layouts, block sizes and stale
  block-table entries, and (Triton) in token chunks;
* bf16: the Triton kernel under the interpreter gives the CPU path's scores bit for bit
  (up to the sign of a zero score, which the keys canonicalise) and the same selection;
* argument errors name the problem.
"""

from __future__ import annotations

import pytest
import torch

from invariance import scattered_block_table
from unified_models import ops
from unified_models.ops.indexer import (indexer_keys, indexer_scores, indexer_scores_reference, indexer_topk,
                                        indexer_topk_reference, select_entries)
from unified_models.ops.indexer.cpu import entry_bounds

H, I = 4, 16
SCALE = I ** -0.5
IMPLS = ["torch", "triton"]


@pytest.fixture
def impl(request, monkeypatch, device):
    """(name, device): the CPU path on the CPU, or the Triton kernel (interpreter on CPU)."""
    name = request.param
    monkeypatch.setenv("UM_OPS_BACKEND", name)
    return name, ("cpu" if name == "torch" else device)


def _pages(keys, per_block, gen, *, spare=3, stale=None, dtype=torch.bfloat16, fill=float("nan")):
    """Scatter each sequence's logical keys ``[J_b, I]`` into IndexerKeyCache pages ``[N, P, 1, I]``.

    Unused slots hold ``fill`` (NaN: proves they are never read); table entries past a
    sequence's blocks hold ``stale`` (random ids when None)."""
    need = [max(1, -(-k.shape[0] // per_block)) for k in keys]
    width = max(need) + 1
    n_blocks = sum(need) + spare
    table = scattered_block_table(need, n_blocks, gen, width, stale=stale)
    cache = torch.full((n_blocks, per_block, 1, I), fill, dtype=dtype)
    for b, k in enumerate(keys):
        j = torch.arange(k.shape[0])
        cache[table[b, j // per_block].long(), j % per_block, 0] = k.to(dtype)
    return cache, table


def _problem(lens, ratio, gen, dtype=torch.bfloat16):
    """Sequences of ``lens`` tokens (every position a query), their keys and the flat batch."""
    keys = [torch.randn(max(n // ratio, 1), I, generator=gen) for n in lens]
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    q = torch.randn(len(seq), H, I, generator=gen).to(dtype)
    w = torch.randn(len(seq), H, generator=gen) * H ** -0.5
    return keys, q, w, seq, pos


def _to(dev, *xs):
    return [x.to(dev) for x in xs]


def _assert_well_formed(out, bound, topk):
    """Row t: min(topk, bound[t]) distinct ids < bound[t], strictly descending, then -1 only."""
    out = out.cpu()
    assert out.dtype == torch.int32 and out.shape == (bound.shape[0], topk)
    for t in range(out.shape[0]):
        n = min(topk, int(bound[t]))
        row = out[t]
        assert bool((row[n:] == -1).all()), f"row {t}: {row.tolist()} has entries past {n}"
        sel = row[:n]
        assert bool((sel >= 0).all() & (sel < int(bound[t])).all()), f"row {t}: {row.tolist()} bound {int(bound[t])}"
        assert bool((sel[1:] < sel[:-1]).all()), f"row {t}: {row.tolist()} not strictly descending"


def _valid_scores(q, w, cache, table, seq, pos, ratio, width):
    """Scores on each row's valid columns, 0 elsewhere, fixed width (comparable across batches)."""
    s = indexer_scores(q, w, cache, table, seq, pos, ratio, SCALE).cpu()
    bound = entry_bounds(seq, pos, ratio).cpu()
    out = torch.zeros((s.shape[0], width), dtype=torch.float32)
    n = min(width, s.shape[1])
    valid = torch.arange(n).view(1, -1) < bound.view(-1, 1)
    out[:, :n] = torch.where(valid, s[:, :n], 0.0)
    return out


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selection_matches_fp64_reference(impl, dtype, gen):
    _, dev = impl
    ratio, topk = 2, 5
    keys, q, w, seq, pos = _problem([29, 6, 17], ratio, gen, dtype)
    cache, table = _pages(keys, 4, gen, dtype=dtype)
    args = (q, w, cache, table, seq, pos)
    ref = indexer_topk_reference(*args, ratio, topk, SCALE)
    out = ops.indexer_topk(*_to(dev, *args), ratio, topk, SCALE)
    bound = entry_bounds(seq, pos, ratio)
    _assert_well_formed(out, bound, topk)
    assert torch.equal(out.cpu(), ref)
    assert int((bound > topk).sum()) >= 10  # the top-k really chooses for many rows
    # the scores themselves: fp32 within rounding of fp64 on the valid columns
    s = indexer_scores(*_to(dev, *args), ratio, SCALE).cpu().double()
    r = indexer_scores_reference(*args, ratio, SCALE)
    valid = torch.isfinite(r)
    assert int(valid.sum()) > 100
    torch.testing.assert_close(s[:, :r.shape[1]][valid], r[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_exact_ties_go_to_the_larger_entry(impl, gen):
    _, dev = impl
    ratio = 4
    hi = torch.ones(I)  # score A = H * I * SCALE with q = w = 1
    lo = torch.full((I,), 0.5)  # score B = half of it
    # entries 0..9: A at 0, 2, 5; B elsewhere
    pattern = [hi if j in (0, 2, 5) else lo for j in range(10)]
    keys = [torch.stack(pattern)]
    cache, table = _pages(keys, 4, gen)
    pos = torch.tensor([39, 39, 39, 23, 11, 39])
    seq = torch.zeros(6, dtype=torch.long)
    q = torch.ones(6, H, I, dtype=torch.bfloat16)
    w = torch.ones(6, H)
    w[5] = -1.0  # every score negative: B (less negative) now beats A
    # (topk, expected): p = 39 sees entries 0..9, p = 23 entries 0..5, p = 11 entries 0..2
    cases = [(2, [5, 2]),  # three tied A's for two places: the larger two
             (4, [9, 5, 2, 0]),  # all A's, then the largest of the tied B's
             (10, list(range(9, -1, -1))),
             (3, [5, 2, 0]), (2, [2, 0]),
             (3, [9, 8, 7])]  # negative weights: the B's win, largest first
    for t, (topk, expect) in enumerate(cases):
        out = ops.indexer_topk(*_to(dev, q[t:t + 1], w[t:t + 1], cache, table, seq[t:t + 1], pos[t:t + 1]), ratio,
                               topk, SCALE).cpu()
        assert out[0, :len(expect)].tolist() == sorted(expect, reverse=True), (t, out.tolist())
        assert bool((out[0, len(expect):] == -1).all())
    # all-equal keys: the largest entries win
    same = [torch.ones(8, I) * 0.25]
    cache2, table2 = _pages(same, 8, gen)
    out = ops.indexer_topk(*_to(dev, q[:1], w[:1], cache2, table2, seq[:1], torch.tensor([31])), ratio, 3,
                           SCALE).cpu()
    assert out.tolist() == [[7, 6, 5]]


def test_keys_total_order_signed_zeros_nan_and_reference_order():
    s = torch.tensor([[0.0, -0.0, 1.5, -2.0, float("-inf"), float("nan"), 1.5, -0.0, 7.0, 3.0]])
    bound = torch.tensor([9])  # column 9 (the 3.0) is invalid
    keys = indexer_keys(s, bound)
    assert keys[0, 0] < keys[0, 1] < keys[0, 7]  # +0.0 and -0.0 are one score; ties to the larger j
    assert keys[0, 2] < keys[0, 6]
    assert keys[0, 4] < keys[0, 5] < keys[0, 3]  # NaN (j = 5) ranks as -inf: ties the -inf at j = 4 and wins
    assert int(keys[0, 9]) == -(1 << 63) < int(keys[0, 4])
    vals = s[0, :9].tolist()
    order = sorted(range(9), key=lambda j: (-(float("-inf") if vals[j] != vals[j] else vals[j]), -j))
    for k in (1, 3, 6, 9, 12):
        out = select_entries(s, bound, k)
        assert out.tolist()[0] == sorted(order[:k], reverse=True) + [-1] * max(0, k - 9)
    assert select_entries(s, bound, 3).tolist() == [[8, 6, 2]]
    assert select_entries(s, torch.tensor([0]), 2).tolist() == [[-1, -1]]


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_fewer_entries_than_topk_and_padding(impl, gen):
    _, dev = impl
    ratio, topk = 4, 6
    keys, q, w, seq, pos = _problem([22], ratio, gen)
    seq = seq.clone()
    pos = pos.clone()
    pos[3] = -1  # a padding row (position -1)
    seq[5] = -1  # a padding row (sequence -1)
    cache, table = _pages(keys, 4, gen)
    out = ops.indexer_topk(*_to(dev, q, w, cache, table, seq, pos), ratio, topk, SCALE).cpu()
    bound = entry_bounds(seq, pos, ratio)
    _assert_well_formed(out, bound, topk)
    for t in range(len(pos)):
        n = int(bound[t])
        if n <= topk:  # every valid entry, in descending order
            assert out[t].tolist() == list(range(n - 1, -1, -1)) + [-1] * (topk - n), (t, out[t].tolist())
    assert out[3].tolist() == [-1] * topk and out[5].tolist() == [-1] * topk
    assert out[:3].eq(-1).all()  # p < ratio - 1: nothing complete yet
    assert out[-1, :5].tolist() == [4, 3, 2, 1, 0]  # p = 21: entries 0..4
    empty = ops.indexer_topk(*_to(dev, q[:0], w[:0], cache, table, seq[:0], pos[:0]), ratio, topk, SCALE)
    assert empty.shape == (0, topk) and empty.dtype == torch.int32


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_causality_future_entries_never_selected(impl, gen):
    _, dev = impl
    ratio, topk = 4, 3
    n_tok = 26
    keys = torch.randn(n_tok // ratio + 2, I, generator=gen)
    # q = w = positive: entries written past each token's bound would win by far if seen
    q = torch.rand(n_tok, H, I, generator=gen).bfloat16()
    w = torch.rand(n_tok, H, generator=gen) + 0.1
    seq = torch.zeros(n_tok, dtype=torch.long)
    pos = torch.arange(n_tok)
    bound = entry_bounds(seq, pos, ratio)
    base, table = _pages([keys[:n_tok // ratio]], 4, gen, fill=float("nan"))
    out = ops.indexer_topk(*_to(dev, q, w, base, table, seq, pos), ratio, topk, SCALE).cpu()
    _assert_well_formed(out, bound, topk)
    assert torch.equal(out, indexer_topk_reference(q, w, base, table, seq, pos, ratio, topk, SCALE))
    # Entry e made huge (it would win every row that may see it), then NaN: a token selects
    # it iff e < (p + 1) // ratio, and the rows that may not see it keep their bits.
    for e in (1, 3, 5):
        slot = (table[0, e // 4].long(), e % 4, 0)
        for value, must_win in ((50.0, True), (float("nan"), False)):
            cache = base.clone()
            cache[slot] = value
            got = ops.indexer_topk(*_to(dev, q, w, cache, table, seq, pos), ratio, topk, SCALE).cpu()
            assert torch.equal(got[bound <= e], out[bound <= e]), f"entry {e} = {value} changed earlier rows"
            if must_win:
                assert torch.equal((got == e).any(dim=1), bound > e), f"entry {e}: {got.tolist()}"
    assert int((bound <= 1).sum()) > 0 and int((bound > 5).sum()) > 0


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_batch_invariance_compositions_layouts_block_sizes(impl, gen, inv):
    _, dev = impl
    ratio, topk = 2, 4
    lens = [23, 5, 14]
    keys, q, w, seq, pos = _problem(lens, ratio, gen)
    width = max(lens) // ratio
    layouts = [_pages(keys, 4, gen), _pages(keys, 2, gen, spare=5), _pages(keys, 8, gen, stale=10 ** 6)]
    results = []
    for cache, table in layouts:
        cache, table = _to(dev, cache, table)

        def run(q_, w_, s_, p_):
            sel = ops.indexer_topk(*_to(dev, q_, w_), cache, table, *_to(dev, s_, p_), ratio, topk, SCALE).cpu()
            sc = _valid_scores(*_to(dev, q_, w_), cache, table, *_to(dev, s_, p_), ratio, width)
            return torch.cat([sc.view(torch.int32), sel], dim=1)  # one tensor: score bits | selection

        def pads(n):
            return (torch.randn(n, H, I, generator=gen).bfloat16() * 100, torch.randn(n, H, generator=gen),
                    torch.full((n,), -1, dtype=torch.long), torch.randint(0, 30, (n,), generator=gen))

        results.append(inv.check_rows(run, (q, w, seq, pos), pads, gen, trials=3, what=f"P={cache.shape[1]}"))
    for r in results[1:]:
        inv.assert_bitwise(r, results[0], "block layout / block size")
    _assert_well_formed(results[0][:, width:], entry_bounds(seq, pos, ratio), topk)
    # one sequence alone (its own table row 0) gives the same bits as inside the batch
    b = 2
    mine = seq == b
    cache, table = _pages([keys[b]], 4, gen)
    alone = ops.indexer_topk(*_to(dev, q[mine], w[mine], cache, table, torch.zeros(int(mine.sum()), dtype=torch.long),
                                  pos[mine]), ratio, topk, SCALE).cpu()
    assert torch.equal(alone, results[0][mine, width:])


def test_triton_interpreter_equals_cpu_path_and_chunking(device, gen, monkeypatch):
    """bf16: the kernel's scores are the CPU path's bits up to the sign of zero (exact dots
    rounded once, the same h order); token chunks of the CUDA selection change nothing."""
    from unified_models.ops.indexer import triton as tri

    ratio, topk = 2, 3
    keys, q, w, seq, pos = _problem([25, 9], ratio, gen)
    cache, table = _pages(keys, 4, gen)
    width = 12
    monkeypatch.setenv("UM_OPS_BACKEND", "torch")
    cpu_s = _valid_scores(q, w, cache, table, seq, pos, ratio, width)
    cpu_sel = indexer_topk(q, w, cache, table, seq, pos, ratio, topk, SCALE)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    args = _to(device, q, w, cache, table, seq, pos)
    tri_sel = indexer_topk(*args, ratio, topk, SCALE).cpu()
    assert torch.equal(tri_sel, cpu_sel)
    monkeypatch.setattr(tri, "MAX_SCORES_PER_CHUNK", 7 * table.shape[1] * cache.shape[1])  # 7-token chunks
    assert len(tri.chunk_rows(q.shape[0], table.shape[1] * cache.shape[1])) == 5
    assert torch.equal(indexer_topk(*args, ratio, topk, SCALE).cpu(), cpu_sel)
    if device == "cpu":  # on CUDA the kernel's dots are tensor-core fp32 sums: other bits
        # the padded heads (H = 4 of H_PAD = 16) add +0.0, which can turn a -0.0 score into
        # +0.0: the one difference, invisible to the keys (they canonicalise the zeros)
        tri_s = _valid_scores(*args, ratio, width)
        assert torch.equal((tri_s + 0.0).view(torch.int32), (cpu_s + 0.0).view(torch.int32))


def test_argument_errors(gen):
    keys, q, w, seq, pos = _problem([8], 2, gen)
    cache, table = _pages(keys, 4, gen)
    ok = dict(q_THI=q, weights_TH=w, key_cache=cache, block_table_BN=table, seq_idx_T=seq, positions_T=pos,
              ratio=2, topk=2, softmax_scale=SCALE)
    assert indexer_topk(**ok).shape == (8, 2)
    bad = [
        (dict(q_THI=q[0]), "q must be a \\[T, H, I\\]"),
        (dict(q_THI=q.to(torch.int32)), "q dtype"),
        (dict(key_cache=cache[:, :, :, :8]), "key_cache .* must be \\[N, S // ratio, 1, I\\]"),
        (dict(key_cache=cache.expand(-1, -1, 2, -1)), "must be \\[N, S // ratio, 1, I\\]"),
        (dict(key_cache=cache.float()), "key_cache dtype"),
        (dict(weights_TH=w[:, :2]), "weights"),
        (dict(weights_TH=w.long()), "weights"),
        (dict(block_table_BN=table[0]), "block_table"),
        (dict(block_table_BN=table.float()), "block_table"),
        (dict(seq_idx_T=seq[:3]), "seq_idx"),
        (dict(positions_T=pos.float()), "positions"),
        (dict(ratio=0), "ratio must be an int >= 1"),
        (dict(ratio=2.0), "ratio must be an int >= 1"),
        (dict(topk=0), "topk must be an int >= 1"),
        (dict(topk=True), "topk must be an int >= 1"),
        (dict(softmax_scale=float("nan")), "softmax_scale must be a finite float"),
        (dict(positions_T=pos + 20), "needs 4 blocks of indexer keys .* 2 columns"),
        (dict(seq_idx_T=seq + 1), "seq_idx 1 is past the block table's 1 rows"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            indexer_topk(**{**ok, **change})
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="different devices"):
            indexer_topk(**{**ok, "q_THI": q.cuda()})
