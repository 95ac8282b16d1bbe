"""Gradient of paged attention over a packed (THD) batch, by recomputation.

The forward writes K/V into a paged cache (:func:`ops.write_kv_cache`) and the
attention kernel reads them back (:func:`ops.paged_attention`); neither has a
backward, and the cache write is an in-place copy that carries no graph. So:

* :func:`record_write` keeps a **tape** on the K cache tensor: for each write
  since the cache was created, the slots and the K/V tensors written (with
  their graphs when they require grad; detached otherwise, so later writes
  still override earlier ones). No tape is kept while nothing requires grad.
* :class:`PagedAttentionFn` returns the kernel's output unchanged (the
  *visible* values, bitwise) and differentiates a plain-torch recomputation:
  for each sequence, causal softmax attention of its query tokens over its
  keys ``0..max position``, taken from the tape (differentiable) or, for slots
  no recorded write covers (earlier chunks), from a snapshot of the cache
  (constants). This is ``visible + (graph - graph.detach())`` of DESIGN.md
  rule 11, done exactly (the output is the visible tensor itself; no
  ``x + 0`` that could flip a ``-0.0``) and lazily: the recomputation runs in
  the backward, one sequence at a time, so no attention graph is kept
  between forward and backward (only q, the taped K/V and index vectors).

Precision of the recomputation: fp32 (``acc``), except for a half-precision model's full
causal self-attention of a sequence on CUDA (every query row is a key row, keys from position 0,
no window, no sink, K/V read back in the query's dtype; ``UM_FUSED_ATTENTION_BACKWARD=0`` turns it
off, :data:`FUSED_BACKWARD`): there all such sequences of the batch are recomputed together, fused,
in the operands' own dtype (:func:`_fused_causal_grads` -> :mod:`.causal_grads`, our Triton form of
FlashAttention-2's backward: fp32 accumulation, probabilities and score gradients rounded to bf16
inside, as FlashAttention's and Megatron-core's backward do; deterministic, unlike SDPA's fused
backward). The fp32 form materialized a ``[H, T, T]`` fp32 score matrix per sequence and ran on
CUDA cores: it made our optimizer step's backward 1.8x Megatron's
(``benchmarks/results/h200_session28/trainer_cost_nemotron_h_dense_bench.json``); SDPA's fused
backward brought it to 1.14x but was not bitwise run to run (session 29).
The forward's values never depend on this (the visible output is the kernel's).

The recomputation reads the cache's rounding of K/V (``k.to(cache dtype)``;
for an FP8 cache the write-and-read round trip
``q.dtype(fp32(e4m3(clamp(k / k_scale))) * k_scale)`` of
:func:`~unified_models.ops.attention.kv_fp8_roundtrip`, so the backward
differentiates at the values the kernel read) and passes gradients straight
through it (STE); the scales get no gradient. Shapes: T query tokens, H/G
query/kv heads, E head dim, N blocks, S block size, Kt keys over all sequences.

Compressed entries (``compressed=`` :class:`~.common.CompressedKV`, DeepSeek-V4): the
compressed cache ``[N, S//ratio, G, E]`` carries its own tape (its entries are written
with ``write_kv_cache(e, e, cache, cache, entry_slots)``); each listed entry of each row
is resolved the same way (the latest taped write of its slot, else a constant snapshot),
and the recomputation attends, per row, its window keys then its listed entries (K = V)
in one softmax with the sink.

Windowed attention (a sliding window, with or without compressed entries: DeepSeek-V4's layers)
is recomputed in chunks of :data:`GRAD_TOKENS` tokens of one sequence (by position; a chunk reads
its window span only), the chunks of all sequences batched up to :data:`GRAD_BATCH_ELEMENTS`
(:func:`_backward_windowed`): memory bounded whatever the sequence length (a whole-sequence
``[H, T, T]`` score matrix is not), and the layout worked out on the host in the forward, so the
backward waits for the device nowhere and launches a few dozen kernels per batch, not per sequence
and chunk (DeepSeek-V4 tiny, 4 x 1,024 tokens: 51,278 ATen ops and 411 device reads in the step's
backward before, 12,477 and 3 after). In a bf16 model on CUDA its products are bf16 GEMMs with fp32 sums
(:class:`~unified_models.ops.grad.helpers.RecomputeBmm`: queries, keys and entries are bf16 values, one
term; probabilities and gradients ``hi + lo``), not fp32 GEMMs on CUDA cores.

:func:`read_kv_cache` reads cache rows back (the compressor's per-token rows) and is
differentiable the same way: rows of a taped write carry its graph, others are constants.

The differentiable :func:`write_kv_cache`, :func:`paged_attention` and :func:`read_kv_cache`
at the end of this file are what :mod:`unified_models.ops` exports.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from .._dispatch import host_to_device
from ..grad.helpers import _HALF, RecomputeBmm, acc, index_add_rows, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch
from .causal_grads import MAX_HEAD_DIM
from .common import CompressedKV, compressed_entry_slots, kv_fp8_dequantize, kv_fp8_roundtrip, window_start
from .reference import softmax_with_sink


TAPE_ATTR = "_um_kv_tape"

GRAD_TOKENS = 64
"""Query tokens per chunk of the windowed backward (:func:`_backward_windowed`): a chunk is that many
consecutive tokens of one sequence, read over its window span only (memory only, not the values)."""

GRAD_BATCH_ELEMENTS = 1 << 28
"""fp32 elements (1 GiB) the windowed backward's chunks of one batch may hold in gathered keys, entries
and scores together (:func:`_window_layout`'s estimate): chunks of every sequence are batched up to it,
so a micro-batch's backward is a few batches, not one loop per sequence and chunk."""


@dataclass
class _Write:
    slots_T: torch.Tensor
    k_TGE: torch.Tensor
    v_TGE: torch.Tensor


@dataclass
class KVTape:
    """The writes into one (K cache, V cache) pair, in order."""

    v_cache: weakref.ref
    writes: list[_Write] = field(default_factory=list)

    @property
    def differentiable(self) -> bool:
        return any(w.k_TGE.requires_grad or w.v_TGE.requires_grad for w in self.writes)


def tape_of(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVTape | None:
    """The tape kept on ``k_cache``, checked to belong to ``v_cache``.

    Raises:
        ValueError: ``k_cache`` was written together with another V cache.
    """
    tape = getattr(k_cache, TAPE_ATTR, None)
    if tape is not None and tape.v_cache() is not v_cache:
        raise ValueError("attention: this K cache was written (with gradients) together with a different "
                         "V cache tensor; pass the same k_cache/v_cache pair to write_kv_cache and paged_attention")
    return tape


def record_write(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, differentiable: bool) -> None:
    """Append a write to ``k_cache``'s tape (created on the first differentiable write)."""
    tape = tape_of(k_cache, v_cache)
    if tape is None:
        if not differentiable:
            return
        tape = KVTape(weakref.ref(v_cache))
        setattr(k_cache, TAPE_ATTR, tape)
    if not differentiable:
        k_TGE, v_TGE = k_TGE.detach(), v_TGE.detach()
    tape.writes.append(_Write(slot_mapping_T.detach().long().clone(), k_TGE, v_TGE))


def _resolve(slots_X: torch.Tensor, writes: list[_Write], n_slots: int, block_size: int,
             caches: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Where each slot's row comes from: the latest taped write of the slot, else the cache.

    Args:
        slots_X: int64 ``[X]`` cache slots, ``-1`` = no row.
        writes: the tape's writes, in order (later ones override earlier ones).
        n_slots: ``N * S`` of the cache; block_size: S.
        caches: the tensors to snapshot the uncovered rows of (``[N, S, G, E]`` each).

    Returns:
        ``(consts, index, sizes)``: ``consts[i]`` the rows of ``caches[i]`` at the slots no
        write covers (clones: constants); ``index [X]`` the row of each slot in
        ``[const rows | write 0 rows | write 1 rows | ... | one zero row]`` (``-1`` slots: the
        zero row); ``sizes`` the lengths of those parts.
    """
    dev = slots_X.device
    present = slots_X >= 0
    s0 = torch.where(present, slots_X, 0)
    owner = torch.full_like(slots_X, -1)
    row = torch.full_like(slots_X, -1)
    for e, w in enumerate(writes):  # later writes override earlier ones
        keep = (w.slots_T >= 0).nonzero().view(-1)
        where = torch.full((n_slots,), -1, dtype=torch.long, device=dev)
        where[w.slots_T[keep]] = keep
        r = torch.where(present, where[s0], -1)
        owner = torch.where(r >= 0, e, owner)
        row = torch.where(r >= 0, r, row)
    const = ((owner < 0) & present).nonzero().view(-1)
    blk, off = slots_X[const] // block_size, slots_X[const] % block_size
    consts = [c[blk, off].clone() for c in caches]
    index = torch.empty_like(slots_X)
    index[const] = torch.arange(const.shape[0], device=dev)
    sizes = [const.shape[0]] + [w.slots_T.shape[0] for w in writes] + [1]
    base = const.shape[0]
    for e, w in enumerate(writes):
        sel = (owner == e).nonzero().view(-1)
        index[sel] = base + row[sel]
        base += w.slots_T.shape[0]
    index[~present] = base
    return consts, index, sizes


class _Plan:
    """Where every key of every query sequence comes from (built once in the forward).

    ``groups``: per sequence ``(token indices [Tb], their positions [Tb], first key row, P keys,
    position of the first key)``; the keys of a sequence are positions ``lo..max position``,
    ``lo`` the window start of its lowest query position (0 without a window), so nothing
    behind every query's window is read;
    ``index [Kt]``: row of each key in ``[cache snapshot rows | write 0 rows | write 1 rows | ... | zero row]``.

    With ``compressed``: ``c_index [T, K]`` the row of each listed entry in ``[compressed cache
    snapshot rows | compressed write 0 rows | ... | zero row]`` and ``c_valid [T, K]`` which
    slots the kernels attend (id >= 0 and ``j < (p+1)//ratio``).
    """

    def __init__(self, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, writes: list[_Write],
                 k_scale=None, v_scale=None, read_dtype=None, sliding_window: int | None = None,
                 compressed: CompressedKV | None = None, c_writes: list[_Write] | None = None):
        self.k_cache, self.v_cache, self.scale = k_cache, v_cache, scale
        self.compressed, self.c_writes = compressed, list(c_writes or [])
        self.has_compressed = compressed is not None
        self.n_kv = 2 * len(writes)
        self.sliding_window = sliding_window
        self.block_table, self.seq_idx, self.positions = block_table_BN, seq_idx_T, positions_T
        self.writes = writes
        self.cache_dtype = k_cache.dtype
        self.k_scale, self.v_scale, self.read_dtype = k_scale, v_scale, read_dtype
        self.kv_read_dtype = k_cache.dtype if k_scale is None else read_dtype
        self.self_attention: list[bool] = []  # per group: queries == keys 0..P-1 in order (fused-eligible)

    def read_const(self, codes: torch.Tensor, which: int) -> torch.Tensor:
        """Cache contents (earlier chunks) as the kernel reads them."""
        if self.k_scale is None:
            return codes
        return kv_fp8_dequantize(codes, (self.k_scale, self.v_scale)[which], self.read_dtype)

    def read_written(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """A taped K/V row as the kernel reads it back after the write."""
        if self.k_scale is None:
            return x.to(self.cache_dtype)
        return kv_fp8_roundtrip(x, (self.k_scale, self.v_scale)[which], self.read_dtype)

    def build(self, mark_self_attention: bool = False, num_heads: int = 1) -> None:
        """Resolve every key's source. The sequences' layout is read to the host once (one device
        read for ``seq_idx`` and ``positions`` together; it was three per sequence) and worked out
        in numpy; the index tensors go back in one non-blocking copy. With ``mark_self_attention``
        (:func:`fused_recompute_eligible`), also mark the groups whose queries are exactly their
        keys ``0..P-1`` (:attr:`self_attention`). With a window or compressed entries, also lay out
        the chunks of :func:`_backward_windowed` (:attr:`window_batches`; ``num_heads``: the query's
        H, for the memory estimate)."""
        kc, vc = self.k_cache, self.v_cache
        dev, s = kc.device, kc.shape[1]
        n_slots = kc.shape[0] * s
        t = self.seq_idx.shape[0]
        seq_pos = torch.stack([self.seq_idx.reshape(-1).long(), self.positions.reshape(-1).long()]).cpu().numpy()
        seq_h, pos_h = seq_pos[0], seq_pos[1]
        by_pos = np.argsort(pos_h, kind="stable")  # each sequence's rows in position order, wherever they sit
        order = by_pos[np.argsort(seq_h[by_pos], kind="stable")]
        if t:
            cut = np.flatnonzero(np.diff(seq_h[order])) + 1
            firsts = np.concatenate([[0], cut])
            counts = np.diff(np.concatenate([firsts, [t]]))
        else:
            firsts = counts = np.zeros(0, dtype=np.int64)
        # each group's first key: the window start of its first (lowest) position, for all groups at once
        los = window_start(torch.from_numpy(pos_h[order[firsts]]), self.sliding_window).tolist()
        plan = []  # (b, first row in order, n, lo, number of keys)
        for f, n, lo in zip(firsts.tolist(), counts.tolist(), los):
            rows_pos = pos_h[order[f:f + n]]  # ascending
            plan.append((int(seq_h[order[f]]), f, n, lo, int(rows_pos[-1]) + 1 - lo))
            self.self_attention.append(mark_self_attention and lo == 0 and n == int(rows_pos[-1]) + 1
                                       and bool((rows_pos == np.arange(n)).all()))
        key_b = np.repeat(np.array([g[0] for g in plan], dtype=np.int64), [g[4] for g in plan]) if plan else \
            np.zeros(0, dtype=np.int64)
        key_p = np.concatenate([np.arange(g[3], g[3] + g[4], dtype=np.int64) for g in plan]) if plan else \
            np.zeros(0, dtype=np.int64)
        packed = host_to_device(torch.from_numpy(np.concatenate([order.astype(np.int64), key_b, key_p])), dev)
        order_d, key_b_d, key_p_d = packed.split([t, key_b.shape[0], key_p.shape[0]])
        pos_d = self.positions.reshape(-1).long().to(dev)
        self.groups, start = [], 0
        for b, f, n, lo, n_keys in plan:
            tok = order_d[f:f + n]
            self.groups.append((tok, pos_d[tok], start, n_keys, lo))
            start += n_keys
        self.window_batches = None
        if self.sliding_window is not None or self.compressed is not None:
            k_per_row = 0 if self.compressed is None else self.compressed.entries_TK.shape[1]
            self.window_batches = _window_layout(order, pos_h, plan, self.sliding_window, t, int(key_p.shape[0]),
                                                 k_per_row, num_heads, kc.shape[2] * kc.shape[3], dev)
        kslots = self.block_table.long().to(dev)[key_b_d, key_p_d // s] * s + key_p_d % s
        # constants (earlier chunks): the cache rows no taped write covers
        (self.k_const, self.v_const), self.index, self.sizes = _resolve(kslots, self.writes, n_slots, s, (kc, vc))
        if self.compressed is not None:
            comp = self.compressed
            cc = comp.cache
            cslots = compressed_entry_slots(comp, self.seq_idx)  # [T, K], -1 = none
            pos = self.positions.long()
            limit = torch.where(pos >= 0, (pos + 1).div(comp.ratio, rounding_mode="floor"), 0)
            ent = comp.entries_TK.long()
            self.c_valid = (cslots >= 0) & (ent < limit.view(-1, 1))  # what the kernels attend
            cslots = torch.where(self.c_valid, cslots, -1)
            (self.c_const,), c_index, self.c_sizes = _resolve(cslots.reshape(-1), self.c_writes,
                                                              cc.shape[0] * cc.shape[1], cc.shape[1], (cc,))
            self.c_index = c_index.view(cslots.shape)
            self.c_dtype = cc.dtype
        self.k_cache = self.v_cache = self.block_table = self.writes = None  # keep no cache alive
        self.compressed = self.c_writes = None


def _causal(q_THE, k_PGE, v_PGE, qpos_T, scale, key0: int = 0, sliding_window: int | None = None, sink_H=None):
    """fp32 attention of queries at positions ``qpos`` over keys at ``key0..key0+P-1``
    (key <= query, and with a window W also key > query - W); with ``sink_H`` ``[H]`` the
    sink's logit joins each row's softmax as a column without a value."""
    rep = q_THE.shape[1] // k_PGE.shape[1]
    kpos = key0 + torch.arange(k_PGE.shape[0], device=q_THE.device)
    mask = kpos[None, :] <= qpos_T[:, None]
    if sliding_window is not None:
        mask &= kpos[None, :] > qpos_T[:, None] - sliding_window
    if sink_H is not None:  # SDPA has no sink: the same math spelled out
        q, k = q_THE.transpose(0, 1), k_PGE.repeat_interleave(rep, 1).transpose(0, 1)
        sc = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))  # [H, Tb, P]
        return (softmax_with_sink(sc, sink_H) @ v_PGE.repeat_interleave(rep, 1).transpose(0, 1)).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q_THE.transpose(0, 1), k_PGE.repeat_interleave(rep, 1).transpose(0, 1),
        v_PGE.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _attend_window(q_BTHE, k_BSGE, v_BSGE, mask_BTS, scale, sink_H, c_BTKGE=None, cvalid_BTK=None, half=None):
    """fp32 attention of B chunks of queries over their chunk's keys (``mask_BTS``: which key each
    query attends, its window) and, with ``c_BTKGE``, each query's own compressed entries (K = V;
    ``cvalid_BTK`` the attended ones), one softmax per query with the sink's column. Plain torch
    (differentiable); q heads grouped per kv head, so no key is repeated across heads. Every query
    must attend at least one key or have a sink (else its row is NaN). Its four products are batched
    GEMMs through :class:`~unified_models.ops.grad.helpers.RecomputeBmm` (``half``: bf16 for a bf16 model
    on CUDA, tensor cores; the queries, keys and entries are bf16 values, exact there, the probabilities
    and gradients ``hi + lo``; None: plain fp32 products).

    Returns:
        ``[B, T, H, E]``.
    """
    b, t, h, e = q_BTHE.shape
    s, g = k_BSGE.shape[1], k_BSGE.shape[2]
    r = h // g
    qg = q_BTHE.view(b, t, g, r, e)
    q_win = qg.permute(0, 2, 3, 1, 4).reshape(b * g, r * t, e)  # batch (b, g): rows (r, t)
    k_win = k_BSGE.permute(0, 2, 3, 1).reshape(b * g, e, s)
    sw = RecomputeBmm.apply(q_win, k_win, True, True, half).view(b, g, r, t, s).permute(1, 2, 0, 3, 4)
    parts = [(sw.reshape(h, b, t, s) * scale).masked_fill(~mask_BTS, float("-inf"))]
    if c_BTKGE is not None:
        k = c_BTKGE.shape[2]
        q_tok = qg.reshape(b * t * g, r, e)  # batch (b, t, g): each token's own entries
        c_tok = c_BTKGE.permute(0, 1, 3, 4, 2).reshape(b * t * g, e, k)
        sc = RecomputeBmm.apply(q_tok, c_tok, True, True, half).view(b, t, g, r, k).permute(2, 3, 0, 1, 4)
        parts.append((sc.reshape(h, b, t, k) * scale).masked_fill(~cvalid_BTK, float("-inf")))
    probs = softmax_with_sink(torch.cat(parts, dim=-1), sink_H)  # [H, B, T, S + K]
    p_win = probs[..., :s].reshape(g, r, b, t, s).permute(2, 0, 1, 3, 4).reshape(b * g, r * t, s)
    v_win = v_BSGE.permute(0, 2, 1, 3).reshape(b * g, s, e)
    out = RecomputeBmm.apply(p_win, v_win, False, True, half).view(b, g, r, t, e).permute(0, 3, 1, 2, 4)
    if c_BTKGE is not None:
        p_tok = probs[..., s:].reshape(g, r, b, t, k).permute(2, 3, 0, 1, 4).reshape(b * t * g, r, k)
        c_val = c_BTKGE.permute(0, 1, 3, 2, 4).reshape(b * t * g, k, e)
        out = out + RecomputeBmm.apply(p_tok, c_val, False, True, half).view(b, t, g, r, e)
    return out.reshape(b, t, h, e)


def _window_layout(order: np.ndarray, pos_h: np.ndarray, plan: list, window: int | None, t: int, n_keys: int,
                   k_per_row: int, num_heads: int, kv_width: int, dev: torch.device) -> list:
    """The chunks of :func:`_backward_windowed`, worked out on the host and batched.

    Each sequence's real tokens (position >= 0), in position order, are cut into chunks of
    :data:`GRAD_TOKENS`; a chunk reads the keys of its window span only (``window_start`` of its
    first position .. its last position). Chunks of all sequences are batched in order while a
    batch's estimate (gathered entries, keys and scores, fp32 elements) stays within
    :data:`GRAD_BATCH_ELEMENTS`; each batch is padded to ``[B, GRAD_TOKENS]`` queries and ``[B, S]``
    keys, S its widest span.

    Args:
        order: ``[T]`` row of each token, grouped by sequence, each sequence in position order;
        pos_h: ``[T]`` positions (host); plan: per sequence ``(b, first index in order, n, lo, n keys)``
            as :meth:`_Plan.build` lays them out (key rows of sequence i start at the sum of the earlier
            ones' key counts, its key j at position ``lo + j``); window: W or None; t: T; n_keys: the key
            rows in all (the zero key row's index); k_per_row: compressed entries per token (0: none);
            num_heads: H; kv_width: G * E; dev: where the batches go.

    Returns:
        Per batch ``(tok [B, Q], ctok [B, Q], qpos [B, Q], krow [B, S], klo [B])`` int64 on ``dev`` (views
        of one tensor copied once): the query rows (padding slots: ``t``, a zero row), the rows whose
        entries and position a slot uses (a padding slot: its chunk's last token, so its softmax is a real
        one), the keys' rows (past a chunk's span: ``n_keys``, a zero row) and the position of each
        chunk's first key.
    """
    gt = GRAD_TOKENS
    chunks = []  # (rows [n], positions [n], first key row, first key position, span)
    key0 = 0
    for _, f, n, lo, nk in plan:
        rows = order[f:f + n]
        rp = pos_h[rows]
        real = rp >= 0
        rows, rp = rows[real], rp[real]
        for a in range(0, rows.shape[0], gt):
            cr, cp = rows[a:a + gt], rp[a:a + gt]
            clo = 0 if window is None else max(0, int(cp[0]) - window + 1)
            chunks.append((cr, cp, key0 + clo - lo, clo, int(cp[-1]) - clo + 1))
        key0 += nk

    def per_chunk(span: int) -> int:  # gathered entries and their gradient, keys and values, ~6 score-sized tensors
        return 2 * gt * k_per_row * kv_width + 4 * span * kv_width + 6 * num_heads * gt * (span + k_per_row)

    batches, cur, widest = [], [], 0
    for c in chunks:
        w_new = max(widest, c[4])
        if cur and per_chunk(w_new) * (len(cur) + 1) > GRAD_BATCH_ELEMENTS:
            batches.append((cur, widest))
            cur, w_new = [], c[4]
        cur.append(c)
        widest = w_new
    if cur:
        batches.append((cur, widest))
    host, shapes = [], []
    for cs, span in batches:
        b = len(cs)
        tok = np.full((b, gt), t, dtype=np.int64)
        ctok = np.empty((b, gt), dtype=np.int64)
        qpos = np.empty((b, gt), dtype=np.int64)
        krow = np.full((b, span), n_keys, dtype=np.int64)
        klo = np.empty(b, dtype=np.int64)
        for i, (cr, cp, kr, clo, sp) in enumerate(cs):
            m = cr.shape[0]
            tok[i, :m], ctok[i, :m], qpos[i, :m] = cr, cr, cp
            ctok[i, m:], qpos[i, m:] = cr[-1], cp[-1]
            krow[i, :sp] = np.arange(kr, kr + sp)
            klo[i] = clo
        host += [tok.ravel(), ctok.ravel(), qpos.ravel(), krow.ravel(), klo]
        shapes.append((b, span))
    if not host:
        return []
    flat = host_to_device(torch.from_numpy(np.concatenate(host)), dev)
    out, at = [], 0
    for b, span in shapes:
        sizes = [b * gt, b * gt, b * gt, b * span, b]
        tok, ctok, qpos, krow, klo = flat[at:at + sum(sizes)].split(sizes)
        at += sum(sizes)
        out.append((tok.view(b, gt), ctok.view(b, gt), qpos.view(b, gt), krow.view(b, span), klo))
    return out


#: The fused half-precision recompute (:func:`_fused_causal_grads`) is on unless
#: ``UM_FUSED_ATTENTION_BACKWARD=0``. It is our own Triton kernel set (:mod:`.causal_grads`), deterministic by
#: construction: SDPA's fused backward (FlashAttention-2's and cuDNN's) was not bitwise run to run on the H200
#: (``benchmarks/results/h200_session29/sdpa_backward_determinism.md``), and ``rl --resume`` promises to continue
#: bitwise. ``tests/gpu/test_autograd_gpu.py::test_fused_attention_backward_is_deterministic`` checks it there.
FUSED_BACKWARD = os.environ.get("UM_FUSED_ATTENTION_BACKWARD", "1") not in ("", "0")


def fused_recompute_eligible(q_THE: torch.Tensor, plan: "_Plan", sink_H: torch.Tensor | None) -> bool:
    """Whether the backward may recompute a sequence's attention fused in ``q``'s dtype
    (:func:`_fused_causal_grads`): a half-precision query on CUDA, K/V read back in that dtype
    (so the fused kernels see exactly the values the forward's kernel read), no sliding window,
    no sink, no compressed entries, head dim <= 128 (:data:`.causal_grads.MAX_HEAD_DIM`), and not opted out (:data:`FUSED_BACKWARD`). Which sequences qualify
    is decided per sequence in :meth:`_Plan.build` (queries == keys ``0..P-1``: a whole prompt, the
    trainer's case)."""
    return (FUSED_BACKWARD and q_THE.is_cuda and q_THE.dtype in _HALF and plan.kv_read_dtype == q_THE.dtype
            and q_THE.shape[-1] <= MAX_HEAD_DIM and plan.sliding_window is None and sink_H is None
            and plan.compressed is None)


def _fused_causal_grads(q_THE: torch.Tensor, k_TGE: torch.Tensor, v_TGE: torch.Tensor, g_THE: torch.Tensor,
                        lens: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of causal self-attention ``softmax(q k^T * scale) v`` (query row i of a sequence
    attends its keys 0..i) over packed whole sequences w.r.t. ``q``, ``k``, ``v``, recomputed in
    ``q``'s dtype by :func:`.causal_grads.causal_attention_grads` (FlashAttention-2's backward, Dao
    2023, Algorithm 2: fp32 accumulation, probabilities and score gradients rounded to the operand
    dtype inside; deterministic).

    Args:
        q_THE: ``[T, H, E]`` half precision, sequence b on rows ``sum(lens[:b]) ..`` (``lens`` rows
            each); ``k_TGE``, ``v_TGE``: ``[T, G, E]`` the same rows' keys and values (any float
            dtype whose values are exact in ``q``'s dtype: the cache's read-back), G dividing H (GQA:
            query head h reads kv head ``h // (H/G)``); ``g_THE``: ``[T, H, E]`` upstream gradient;
            ``lens``: sequence lengths (sum T); ``scale``: the softmax scale.

    Returns:
        ``(dq [T, H, E], dk [T, G, E], dv [T, G, E])`` fp32 (GQA: each kv head's gradient summed over
        its query heads in fp32).

    Raises:
        ValueError: mismatched shapes, H not a multiple of G, or ``lens`` not summing to T.
    """
    from .causal_grads import causal_attention_grads

    t, h, e = q_THE.shape
    if k_TGE.shape != v_TGE.shape or k_TGE.shape[0] != t or k_TGE.shape[2] != e or g_THE.shape != q_THE.shape \
            or h % k_TGE.shape[1] or sum(lens) != t or min(lens, default=1) < 1:
        raise ValueError(f"fused causal attention gradients: q {list(q_THE.shape)}, k {list(k_TGE.shape)}, "
                         f"v {list(v_TGE.shape)}, g {list(g_THE.shape)}, sequence lengths {lens}")
    dt = q_THE.dtype
    return causal_attention_grads(q_THE.contiguous(), k_TGE.to(dt).contiguous(), v_TGE.to(dt).contiguous(),
                                  g_THE.to(dt).contiguous(), lens, scale)


class PagedAttentionFn(torch.autograd.Function):
    """Inputs ``(q, sink, plan, k_0, v_0, k_1, v_1, ..., c_0, c_1, ...)``: the query, the
    attention sink (``[H]`` fp32 or ``None``; a weight, guarded against changes between
    forward and backward), the taped writes of the window cache and (``compressed=``) those
    of the compressed cache (K = V: one tensor per write)."""

    @staticmethod
    def forward(ctx, q_THE, sink_H, plan: _Plan, *tensors):
        out = dispatch.paged_attention(q_THE, plan.k_cache, plan.v_cache, plan.block_table, plan.seq_idx,
                                        plan.positions, plan.scale, plan.k_scale, plan.v_scale, plan.sliding_window,
                                        sink=sink_H, compressed=plan.compressed)
        plan.build(mark_self_attention=fused_recompute_eligible(q_THE, plan, sink_H), num_heads=q_THE.shape[1])
        ctx.plan = plan
        ctx.sink = sink_H
        ctx.stamps = stamp(sink=sink_H)
        ctx.save_for_backward(q_THE, *tensors)
        return out

    @staticmethod
    def backward(ctx, g_THE):
        check_stamps("paged_attention", ctx.stamps)
        q_in, *tensors = ctx.saved_tensors
        plan = ctx.plan
        kv, cw = tensors[:plan.n_kv], tensors[plan.n_kv:]
        sink = None if ctx.sink is None else acc(ctx.sink.detach())
        dsink = None if sink is None else torch.zeros_like(sink)
        srcs_k = [acc(plan.read_const(plan.k_const, 0))] + [acc(plan.read_written(t, 0)) for t in kv[0::2]]
        srcs_v = [acc(plan.read_const(plan.v_const, 1))] + [acc(plan.read_written(t, 1)) for t in kv[1::2]]
        srcs_k.append(srcs_k[0].new_zeros((1, *srcs_k[0].shape[1:])))  # the zero row (index of no slot)
        srcs_v.append(srcs_v[0].new_zeros((1, *srcs_v[0].shape[1:])))
        k_all, v_all = torch.cat(srcs_k)[plan.index], torch.cat(srcs_v)[plan.index]
        q, g = acc(q_in), acc(g_THE)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all)
        grads_c = []
        if plan.window_batches is not None:
            half = torch.bfloat16 if q_in.is_cuda and q_in.dtype == torch.bfloat16 else None  # tensor cores
            dsink, grads_c = _backward_windowed(plan, q, g, k_all, v_all, cw, sink, dsink, dq, dk, dv, half)
        window_groups = [] if plan.window_batches is not None else plan.groups
        fused = [grp for grp, mark in zip(window_groups, plan.self_attention) if mark]
        if fused:  # whole prompts: one fused, deterministic recompute for all of them
            tok = torch.cat([grp[0] for grp in fused])
            keys = torch.cat([torch.arange(grp[2], grp[2] + grp[3], device=q.device) for grp in fused])
            dq[tok], dk[keys], dv[keys] = _fused_causal_grads(q_in[tok], k_all[keys], v_all[keys], g_THE[tok],
                                                              [grp[3] for grp in fused], plan.scale)
        for i, (tok, qpos, start, n, key0) in enumerate(window_groups):  # the others: one sequence at a time
            if plan.self_attention[i]:
                continue
            with torch.enable_grad():
                qb = q[tok].detach().requires_grad_()
                kb = k_all[start:start + n].detach().requires_grad_()
                vb = v_all[start:start + n].detach().requires_grad_()
                sb = None if sink is None else sink.detach().requires_grad_()
                ob = _causal(qb, kb, vb, qpos, plan.scale, key0, plan.sliding_window, sb)
                gq, gk, gv, *gs = torch.autograd.grad(ob, (qb, kb, vb) + (() if sb is None else (sb,)), g[tok])
            if gs:
                dsink += gs[0]
            dq[tok] = gq
            dk[start:start + n] = gk
            dv[start:start + n] = gv
        # gather transposed: key-row gradients summed back onto their sources
        dsrc_k = torch.zeros((sum(plan.sizes), *dk.shape[1:]), dtype=dk.dtype, device=dk.device)
        dsrc_v = torch.zeros_like(dsrc_k)
        index_add_rows(dsrc_k, plan.index, dk)
        index_add_rows(dsrc_v, plan.index, dv)
        dks, dvs = dsrc_k.split(plan.sizes)[1:-1], dsrc_v.split(plan.sizes)[1:-1]
        grads = []
        for i, t in enumerate(kv):
            d = (dks if i % 2 == 0 else dvs)[i // 2]
            grads.append(d.to(t.dtype) if ctx.needs_input_grad[3 + i] else None)
        for i, t in enumerate(cw):
            grads.append(grads_c[i].to(t.dtype) if ctx.needs_input_grad[3 + plan.n_kv + i] else None)
        gsink = dsink.to(ctx.sink.dtype) if dsink is not None and ctx.needs_input_grad[1] else None
        return (dq.to(q_in.dtype) if ctx.needs_input_grad[0] else None), gsink, None, *grads


def _backward_windowed(plan: _Plan, q, g, k_all, v_all, cw, sink, dsink, dq, dk, dv, half=None):
    """The recomputation of windowed attention, with or without compressed entries (adds into ``dq``,
    ``dk``, ``dv`` in place): the chunks of :attr:`_Plan.window_batches` (every sequence's tokens by
    position, :data:`GRAD_TOKENS` at a time, over their window span and their rows' listed entries),
    a batch of chunks per recomputation. The layout was worked out on the host in the forward, so
    nothing here waits for the device; the gradients go back to their rows through
    :func:`~unified_models.ops.grad.helpers.index_add_rows` (a fixed order: a key row is read by
    several chunks, an entry by many rows). Padding slots read a zero query and carry a zero
    gradient, so they add exact zeros. ``half``: :func:`_attend_window`'s. Returns ``(dsink, [gradient of
    each compressed write])``."""
    comp = plan.has_compressed
    if comp:
        const = acc(plan.c_const)
        c_src = torch.cat([const] + [acc(t.to(plan.c_dtype)) for t in cw] + [const.new_zeros((1, *const.shape[1:]))])
        dc_src = torch.zeros_like(c_src)
    w = plan.sliding_window
    q_pad, g_pad = (torch.cat([x, x.new_zeros((1, *x.shape[1:]))]) for x in (q, g))  # row T: padding slots
    k_pad, v_pad = (torch.cat([x, x.new_zeros((1, *x.shape[1:]))]) for x in (k_all, v_all))  # the zero key row
    dq_pad, dk_pad, dv_pad = (torch.zeros_like(x) for x in (q_pad, k_pad, v_pad))
    for tok, ctok, qpos, krow, klo in plan.window_batches:
        kpos = klo[:, None] + torch.arange(krow.shape[1], device=krow.device)  # [B, S]
        mask = kpos[:, None, :] <= qpos[:, :, None]
        if w is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - w
        cidx = plan.c_index[ctok] if comp else None  # [B, Q, K]
        with torch.enable_grad():
            qb = q_pad[tok].detach().requires_grad_()
            kb = k_pad[krow].detach().requires_grad_()
            vb = v_pad[krow].detach().requires_grad_()
            cb = c_src[cidx].detach().requires_grad_() if comp else None
            sb = None if sink is None else sink.detach().requires_grad_()
            ob = _attend_window(qb, kb, vb, mask, plan.scale, sb, cb, plan.c_valid[ctok] if comp else None, half)
            leaves = (qb, kb, vb) + ((cb,) if comp else ()) + (() if sb is None else (sb,))
            grads = list(torch.autograd.grad(ob, leaves, g_pad[tok]))
        index_add_rows(dq_pad, tok.reshape(-1), grads.pop(0).flatten(0, 1))
        index_add_rows(dk_pad, krow.reshape(-1), grads.pop(0).flatten(0, 1))
        index_add_rows(dv_pad, krow.reshape(-1), grads.pop(0).flatten(0, 1))
        if comp:
            index_add_rows(dc_src, cidx.reshape(-1), grads.pop(0).flatten(0, 2))
        if grads:
            dsink += grads.pop(0)
    dq += dq_pad[:-1]
    dk += dk_pad[:-1]
    dv += dv_pad[:-1]
    return dsink, (list(dc_src.split(plan.c_sizes)[1:-1]) if comp else [])


def paged_attention_grad(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                         tape: KVTape | None, k_scale=None, v_scale=None, sliding_window: int | None = None,
                         sink: torch.Tensor | None = None, compressed: CompressedKV | None = None,
                         c_tape: KVTape | None = None) -> torch.Tensor:
    """Kernel values of :func:`ops.paged_attention`, differentiable w.r.t. q, the taped K/V,
    the sink and (``compressed``, its cache's tape ``c_tape``) the taped compressed entries
    (FP8 caches: straight through the quantization; the scales are constants)."""
    writes = list(tape.writes) if tape is not None else []
    c_writes = list(c_tape.writes) if c_tape is not None else []
    plan = _Plan(k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, writes,
                 None if k_scale is None else k_scale.detach(), None if v_scale is None else v_scale.detach(),
                 q_THE.dtype, sliding_window, compressed, c_writes)
    return PagedAttentionFn.apply(q_THE, sink, plan, *(t for w in writes for t in (w.k_TGE, w.v_TGE)),
                                  *(w.k_TGE for w in c_writes))


def write_kv_cache(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping_T: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """:func:`ops.attention.write_kv_cache` (in place), remembering differentiable writes.

    When ``k_TGE``/``v_TGE`` require grad (grad mode on), the write is also
    recorded on ``k_cache`` so a later :func:`paged_attention` over this cache
    sends gradients back to ``k_TGE``/``v_TGE``. The cache itself never joins
    the graph. ``k_scale``/``v_scale``: fp32 ``[]`` scales of an FP8 cache
    (constants: no gradient). Raises as the op; ``ValueError`` if ``k_cache``
    was taped with another ``v_cache``.
    """
    grad = needs_grad(k_TGE, v_TGE)
    if not grad and getattr(k_cache, "_um_kv_tape", None) is None:
        return dispatch.write_kv_cache(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale, v_scale)
    with torch.no_grad():
        dispatch.write_kv_cache(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale, v_scale)
    record_write(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, grad)


def paged_attention(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                    sink: torch.Tensor | None = None, compressed: CompressedKV | None = None) -> torch.Tensor:
    """:func:`ops.attention.paged_attention`, differentiable w.r.t. ``q_THE``, the
    K/V written into this cache by differentiable :func:`write_kv_cache` calls, the
    attention ``sink`` (fp32 ``[H]``; its gradient is
    ``-sum_t p_sink(t, h) <g_t,h, o_t,h>``, from the recomputation) and, with
    ``compressed``, the entries written into ``compressed.cache`` by differentiable
    :func:`write_kv_cache` calls (``write_kv_cache(e, e, cache, cache, entry_slots)``; entries
    written earlier are constants).

    Values are the kernel's. Gradients come from a plain-torch causal attention
    recomputed per sequence in the backward; K/V slots no differentiable write
    covers (earlier chunks) are constants. An FP8 cache (``k_scale``/``v_scale``)
    is differentiated at the dequantized values, straight through the
    quantization. ``sliding_window`` W: the recomputation masks keys at or
    behind ``p - W`` as the kernel does. A shared K = V cache (``v_cache is
    k_cache``, written with ``v = k``) sends both gradients to the one tensor.
    Shapes and errors as the op.
    """
    tape = getattr(k_cache, "_um_kv_tape", None)
    grad_kv = tape is not None and tape.differentiable
    grad_sink = sink is not None and sink.requires_grad
    c_tape = None
    if isinstance(compressed, CompressedKV) and isinstance(compressed.cache, torch.Tensor):
        c_tape = getattr(compressed.cache, TAPE_ATTR, None)
    grad_c = c_tape is not None and c_tape.differentiable
    if not torch.is_grad_enabled() or not (q_THE.requires_grad or grad_kv or grad_sink or grad_c):
        return dispatch.paged_attention(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                                        k_scale, v_scale, sliding_window, sink=sink, compressed=compressed)
    if c_tape is not None:
        c_tape = tape_of(compressed.cache, compressed.cache)
    return paged_attention_grad(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                                tape_of(k_cache, v_cache), k_scale, v_scale, sliding_window, sink, compressed, c_tape)


class _ReadPlan:
    """Where each row read by :func:`read_kv_cache` comes from (built in the forward):
    ``index [X]`` into ``[constant rows | write 0 rows | ... | zero row]``, ``sizes``."""

    def __init__(self, cache: torch.Tensor, slots_X: torch.Tensor, writes: list[_Write]):
        self.cache, self.slots, self.writes = cache, slots_X, writes

    def build(self) -> None:
        c = self.cache
        _, self.index, self.sizes = _resolve(self.slots.long(), self.writes, c.shape[0] * c.shape[1], c.shape[1], ())
        self.row_shape = tuple(c.shape[2:])
        self.cache = self.writes = None  # keep no cache alive


class ReadKVFn(torch.autograd.Function):
    """Inputs ``(plan, w_0, w_1, ...)``: the taped writes (their K tensors) of the cache read."""

    @staticmethod
    def forward(ctx, plan: _ReadPlan, *ws):
        out = dispatch.read_kv_cache(plan.cache, plan.slots)
        plan.build()
        ctx.plan = plan
        ctx.dtypes = [w.dtype for w in ws]
        return out

    @staticmethod
    def backward(ctx, g_XGE):
        plan = ctx.plan
        g = acc(g_XGE)
        dsrc = torch.zeros((sum(plan.sizes), *plan.row_shape), dtype=g.dtype, device=g.device)
        index_add_rows(dsrc, plan.index, g)
        parts = dsrc.split(plan.sizes)[1:-1]
        return None, *(parts[i].to(dt) if ctx.needs_input_grad[1 + i] else None for i, dt in enumerate(ctx.dtypes))


def read_kv_cache(cache: torch.Tensor, slots_X: torch.Tensor) -> torch.Tensor:
    """:func:`ops.attention.read_kv_cache` (rows at slots, exact copy), differentiable: a row
    whose slot was last written by a differentiable :func:`write_kv_cache` into ``cache`` (as
    its K cache; a shared K = V cache is its own K cache) gets that write's gradient, straight
    through the cast to the cache dtype; other rows (earlier steps, no tape) are constants.
    Values are the op's. Shapes and errors as the op.
    """
    tape = getattr(cache, TAPE_ATTR, None)
    if not torch.is_grad_enabled() or tape is None or not tape.differentiable:
        return dispatch.read_kv_cache(cache, slots_X)
    writes = list(tape.writes)
    return ReadKVFn.apply(_ReadPlan(cache, slots_X, writes), *(w.k_TGE for w in writes))
