"""Paged causal attention and KV-cache write in Triton (one read path for
prefill, chunked prefill, decode and training).

Cache layout: ``k_cache``/``v_cache`` are 4-D ``[num_blocks, S, G, E]`` views
with arbitrary strides (vLLM hands a strided view of one allocation). Slot
``s`` is block ``s // S``, offset ``s % S``.

Reading (FlashAttention-2 style, batch-invariant by construction):

* **Query tiles.** A tile is up to ``BLOCK_T`` consecutive flat tokens of one
  sequence with consecutive positions (a *run* is a maximal such stretch; a
  tile starts where a run starts or at an offset in the run that is a
  multiple of ``BLOCK_T``). A program takes one tile times the ``Q_PER_KV``
  query heads of one kv head, flattened into ``ROWS`` rows (row ``r`` =
  token ``r // QP``, head ``r % QP``, ``QP = next_pow2(Q_PER_KV)``,
  ``BLOCK_T = max(1, ROWS // QP)``), so one K tile and one V tile feed a
  tensor-core ``tl.dot`` for all rows. Each row has its own causal mask
  ``p <= pos_row``; a row fully masked in a KV tile keeps its online-softmax
  state bit for bit (``alpha = 1``, ``p = 0``), so a row's bits never
  depend on the other rows of its tile.
* **KV splits at fixed absolute positions.** Split ``s`` covers positions
  ``[s*SPLIT_KV, (s+1)*SPLIT_KV)``. The partial kernel, grid (tiles, G,
  max splits), runs an fp32 online softmax from a fresh state over the KV
  tiles of its split (``BLOCK_KV`` positions, aligned at absolute position
  0, increasing order) up to the tile's last position. A token whose
  position is below ``SPLIT_KV`` has one split: its program divides and
  rounds once to the output dtype right there. Any other token's rows write
  fp32 partials ``m``, ``l``, ``acc`` to a workspace, and the merge kernel
  (one program per token and kv head) combines its splits ``0..pos //
  SPLIT_KV`` in increasing order (start from split 0's state as is, then
  ``M' = max(M, m_s)``, ``L' = L*2^(M-M') + l_s*2^(m_s-M')``, ``ACC`` alike),
  divides and rounds once.
* **Sliding window** (``sliding_window`` W): row ``r`` reads positions
  ``pos_r - W + 1 .. pos_r`` (its own mask, like the causal one). A tile's KV
  loop starts at the KV tile of its first token's window start, and the merge
  at that token's window-start split; what they skip is fully masked for the
  row (the empty online-softmax state), so the bits are those of a walk from
  position 0 and do not depend on the batch. Loads are masked to the tile's
  ``[window start of its first token, last position]``: block-table entries of
  blocks behind the window (vLLM's null block, stale memory) are never read.
* **Compressed entries** (``compressed=``, DeepSeek-V4 CSA/HCA): every token then goes
  through the merge. The partial kernel writes every row's window splits as partials; a
  third kernel (:func:`_attention_compressed_kernel`, one program per token and kv head)
  runs the online softmax from a fresh state over the token's own entry list, in list
  order, ``BLOCK_KV`` list slots per step (K = V: one load feeds both dots), into one more
  workspace split; the merge combines the window splits in increasing order, then that
  partial, then adds the sink, divides and rounds once. A step without a valid slot keeps
  the state by selection, so the list width K never changes a bit.
* Each position's physical block is looked up through the block table on its
  own (``block_table[seq, p // S]``), so neither the tiling nor the bits
  depend on the cache block size ``S`` or on which physical blocks hold the
  sequence; block-table entries past a tile's last position are never read.
* K/V tiles are loaded by two TMA bulk copies per KV tile wherever TMA
  applies (Hopper or newer, ``S % BLOCK_KV == 0`` so a tile lies in one cache
  block, bf16/fp16 queries, no FP8 cache, ``E`` a power of two;
  :func:`_kv_descriptors`), by per-position pointer gathers otherwise (any
  ``S``). Both feed the dots the same values (the TMA path zeroes the tail
  tile's positions past the last query token, as the gathers' masks do), so
  they give the same bits: H200, ``tests/gpu/test_ops_gpu.py::
  test_attention_kv_tma_equals_pointer_gathers``. TMA decode runs 1.5-1.6x
  faster than the gathers on the H200 (``benchmarks/attention_decode.py``,
  benchmarks/RESULTS.md session 15); its sm_90 lowering is checked on the
  CPU (``tests/test_sm90_lowering.py``).

Every constexpr (``ROWS``, ``BLOCK_T``, ``BLOCK_KV``, ``SPLIT_KV``, warps,
stages) depends only on the model (H, G, E, dtype), never on the batch, so
prefill, chunked prefill, decode and the trainer give every token the same
bits.

Tile schedule: one small kernel turns ``seq_idx``/``positions`` into the
list of tile starts and its length on the device (no host sync; CUDA-graph
capturable). The partial kernel's grid is sized from host-known shapes only
(:func:`_grid_sizes`: the token count and the block-table rows), never by
reading the tile count back, so an eager prefill step queues its kernels
without waiting for the device (vLLM's async scheduling keeps overlapping).
The grid is only a launch size: the programs walk the device tile list in a
grid-stride loop, so no grid can drop or repeat a tile, and a tile's bits do
not depend on which program computes it.

Workspace: ``[Tc, H, splits(, E)]`` fp32 where ``splits = cdiv(max_blocks *
S, SPLIT_KV)`` (block-table width); the tokens are processed in chunks of
``Tc`` so the workspace stays under ``WORKSPACE_BYTES`` (the chunking, a
function of shapes only, never changes a bit).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import KV_FP8_DTYPE, CompressedKV, check_compressed, check_kv_scales, check_sink, check_sliding_window
from ..triton._common import _INTERP, FLOAT_DTYPES, INTERPRET, check_device, interpreter_dot, e4m3_bits_to_f32, next_pow2, round_to

if INTERPRET:
    # Small tiles and splits so that small test sequences span several query
    # tiles, KV tiles and splits.
    ROWS = 32
    BLOCK_KV = 16
    SPLIT_KV = 32
    SCHED_BLOCK = 64
    NUM_WARPS, NUM_STAGES = 4, 1
    WORKSPACE_BYTES = 1 << 24
else:
    ROWS = 64
    BLOCK_KV = 64
    SPLIT_KV = 1024
    SCHED_BLOCK = 1024
    NUM_WARPS, NUM_STAGES = 4, 2
    WORKSPACE_BYTES = 1 << 28
"""``ROWS``: query rows (tokens x q heads of one kv head) per program (at least
the padded q heads per kv head). ``BLOCK_KV``: KV positions per online-softmax
step. ``SPLIT_KV``: KV positions per split (a multiple of ``BLOCK_KV``).
``WORKSPACE_BYTES``: cap on the fp32 split workspace per launch (tokens are
chunked to stay under it; never changes a bit)."""

assert SPLIT_KV % BLOCK_KV == 0

WIDE_HEAD_DIM = 512
"""Head dims (``BLOCK_E``) from here up take :data:`WIDE_LAUNCH` on the GPU: DeepSeek-V4's 512
(64 q heads over one shared K = V head). With the default launch the partial kernel would
stage a 64 x 512 query tile and two K/V stages of 64 x 512 each in shared memory (328,704 bytes
asked, 232,448 on an H200) and hold a 64 x 512 fp32 accumulator in 128 threads."""

WIDE_LAUNCH = (8, 1)
"""``(num_warps, num_stages)`` of the partial and compressed-entry kernels at head dims >=
:data:`WIDE_HEAD_DIM` on the GPU: one K/V stage (q + K + V = 192 KiB of shared memory) and 8 warps
(128 accumulator registers per thread). The tiles (``ROWS``, ``BLOCK_KV``, splits) and the order
of every reduction are those of the other widths; the launch is a constant of the head dim, never
of the batch (rule 1). The interpreter keeps its launch (the CPU bits do not move)."""


def launch_warps_stages(block_e: int) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the partial kernel for a padded head dim ``block_e``."""
    if not INTERPRET and block_e >= WIDE_HEAD_DIM:
        return WIDE_LAUNCH
    return NUM_WARPS, NUM_STAGES


MIN_BLOCK_H = 16
"""The rows of a program are at least 16 (tensor-core ``tl.dot`` minimum)."""

_LOG2E = 1.4426950408889634
_LOG2E_F = tl.constexpr(_LOG2E)
"""log2(e) as a kernel constant (the sink's logit to the log2 domain of the scores)."""
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> float8_e4m3fn bit patterns (int32 0..255): saturate to +-448, round to
    nearest even (subnormals included), keep the sign (also of zero); NaN -> 0x7F | sign.

    Integer arithmetic on the fp32 bits plus one exact power-of-two scaling and
    a 2^23 round-to-integer for the subnormal range, so no hardware fp8
    conversion or unary minus (which drops -0.0 on the GPU) is involved.
    """
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # |x| <= 448 (the bits of non-negative floats are ordered like their values)
    # normal range (|x| >= 2^-6): drop 20 mantissa bits, ties to even; exponent bias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal range: |x| / 2^-9 rounded to an integer 0..8 (8 = the smallest normal, code 0x08)
    f = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((f + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a >= 0x3C800000, normal, sub)
    mag = tl.where(is_nan, 0x7F, mag)
    return mag | sign


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, G, E, S,
                     stride_kt, stride_kg, stride_ke, stride_vt, stride_vg, stride_ve,
                     stride_kcb, stride_kcs, stride_kcg, stride_kce,
                     stride_vcb, stride_vcs, stride_vcg, stride_vce,
                     BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    e = tl.arange(0, BLOCK_E)
    mask = (g[:, None] < G) & (e[None, :] < E)
    valid = slot >= 0  # slot < 0: padding token, nothing written
    blk = tl.where(valid, slot // S, 0)
    off = tl.where(valid, slot % S, 0)
    g_lim = tl.where(valid, G, 0)  # (a scalar bool in a mask trips the interpreter)
    store_mask = (g[:, None] < g_lim) & (e[None, :] < E)
    k = tl.load(k_ptr + t * stride_kt + g[:, None] * stride_kg + e[None, :] * stride_ke, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + g[:, None] * stride_vg + e[None, :] * stride_ve, mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + g[:, None] * stride_kcg + e[None, :] * stride_kce
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + g[:, None] * stride_vcg + e[None, :] * stride_vce
    if FP8:  # caches are uint8 views of float8_e4m3fn
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)
        tl.store(kc, f32_to_e4m3_bits(tl.math.div_rn(k.to(tl.float32), ks)).to(tl.uint8), mask=store_mask)
        tl.store(vc, f32_to_e4m3_bits(tl.math.div_rn(v.to(tl.float32), vs)).to(tl.uint8), mask=store_mask)
    else:
        tl.store(kc, round_to(k.to(tl.float32), kc_ptr.dtype.element_ty), mask=store_mask)
        tl.store(vc, round_to(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["T", "T_CHUNK"])
def _tile_schedule_kernel(seq_ptr, pos_ptr, sched_ptr, T, T_CHUNK, stride_sc,
                          BLOCK_T: tl.constexpr, SB: tl.constexpr):
    """One program per token chunk ``[c*T_CHUNK, min(T, (c+1)*T_CHUNK))``: writes
    ``sched[c, 0]`` = the number of query tiles of the chunk and ``sched[c, 1 + i]``
    = the chunk-local index of tile ``i``'s first token, in token order.

    A token starts a run when it is the chunk's first, its sequence differs
    from the previous token's, its position is not the previous one + 1, or
    the previous token is padding; it starts a tile when its offset in its
    run is a multiple of ``BLOCK_T``. Padding tokens (position < 0) start no
    tile and belong to none.
    """
    c = tl.program_id(0)
    base = c.to(tl.int64) * T_CHUNK
    n = tl.minimum(T - base, T_CHUNK).to(tl.int32)
    sc = sched_ptr + c.to(tl.int64) * stride_sc
    count = tl.zeros((), dtype=tl.int32)
    carry = tl.zeros((), dtype=tl.int32)  # start of the run of the previous block's last token
    for b0 in range(0, n, SB):
        i = b0 + tl.arange(0, SB)
        inb = i < n
        has_prev = inb & (i > 0)
        s = tl.load(seq_ptr + base + i, mask=inb, other=0).to(tl.int64)
        p = tl.load(pos_ptr + base + i, mask=inb, other=-1).to(tl.int64)
        sp = tl.load(seq_ptr + base + i - 1, mask=has_prev, other=0).to(tl.int64)
        pp = tl.load(pos_ptr + base + i - 1, mask=has_prev, other=-1).to(tl.int64)
        brk = (s != sp) | (p != pp + 1) | (pp < 0) | (p < 0)  # i == 0: pp = -1
        rs = tl.associative_scan(tl.where(brk, i, 0), 0, _max_combine)
        rs = tl.maximum(rs, carry)
        start = inb & (p >= 0) & ((i - rs) % BLOCK_T == 0)
        st = start.to(tl.int32)
        idx = count + tl.cumsum(st, 0) - 1
        tl.store(sc + 1 + idx, i, mask=start)
        count += tl.sum(st, 0)
        carry = tl.max(tl.where(inb, rs, 0), 0)
    tl.store(sc, count)


@triton.jit
def _load_kv_tile(kc_ptr, vc_ptr, k_desc, v_desc, bt_row, stride_btn, j, min_pos, max_pos, g, e, mask_e, kv_ar, S, E,
                  kv_rows_per_block, stride_kcb, stride_kcs, stride_kcg, stride_kce,
                  stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs, DTYPE: tl.constexpr,
                  BLOCK_KV: tl.constexpr, FP8: tl.constexpr, KV_TMA: tl.constexpr, TAIL: tl.constexpr):
    """KV tile ``j`` of kv head ``g``: positions ``p`` [BLOCK_KV], ``K^T`` [BLOCK_E, BLOCK_KV] and
    ``V`` [BLOCK_KV, BLOCK_E] in ``DTYPE`` (fp8 caches dequantized), positions outside
    ``[min_pos, max_pos]`` zero (their block-table entries are not read by the gathers).
    ``TAIL`` False promises every position lies in ``[min_pos, max_pos]`` (no masking needed)."""
    p = j * BLOCK_KV + kv_ar.to(tl.int64)
    col_ok = (p <= max_pos) & (p >= min_pos)
    if KV_TMA:  # the tile lies in one cache block (S % BLOCK_KV == 0): two TMA copies
        p0 = j * BLOCK_KV
        blk0 = tl.load(bt_row + (p0 // S) * stride_btn).to(tl.int32)
        row0 = blk0 * kv_rows_per_block + p0 % S
        col0 = (g * E).to(tl.int32)
        k = k_desc.load([row0, col0])
        v = v_desc.load([row0, col0])
        if TAIL:
            k = tl.where(col_ok[:, None], k, 0.0)
            v = tl.where(col_ok[:, None], v, 0.0)
        kt = k.T
    else:  # each position's block looked up on its own (any S)
        blk = tl.load(bt_row + (p // S) * stride_btn, mask=col_ok, other=0).to(tl.int64)
        off = p % S
        kt = tl.load(kc_ptr + blk[None, :] * stride_kcb + off[None, :] * stride_kcs + g * stride_kcg
                     + e[:, None] * stride_kce, mask=mask_e[:, None] & col_ok[None, :], other=0.0)
        v = tl.load(vc_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + g * stride_vcg
                    + e[None, :] * stride_vce, mask=col_ok[:, None] & mask_e[None, :], other=0.0)
        if FP8:  # read rule: q.dtype(fp32(e4m3) * scale)
            kt = round_to(e4m3_bits_to_f32(kt.to(tl.int32)) * ks, DTYPE)
            v = round_to(e4m3_bits_to_f32(v.to(tl.int32)) * vs, DTYPE)
    return p, kt, v


@triton.jit
def _online_softmax_step(q, kt, v, p, pos_r, lo_r, m_i, l_i, acc, qk_scale, FP32_DOT: tl.constexpr):
    """One fp32 online-softmax step of ``ROWS`` query rows over one KV tile (each row's own
    mask ``lo_r <= p <= pos_r``: causal, and its sliding window); returns the new ``(m, l, acc)``."""
    if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
        s = interpreter_dot(q, kt).to(tl.float32)
    elif FP32_DOT:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    s = s * qk_scale  # log2 domain
    valid = (p[None, :] <= pos_r[:, None]) & (p[None, :] >= lo_r[:, None])  # each row's own causal/window mask
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with nothing valid yet keeps m = -inf: exponent base 0, no NaN. A row
    # whose maximum did not move (e.g. fully masked here) gets alpha = 1 exactly.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    pr = tl.where(valid, tl.exp2(s - m_safe[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if _INTERP:
        pv = interpreter_dot(pr, v).to(tl.float32)
    elif FP32_DOT:
        pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pr.to(q.dtype), v.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _kv_tiles(j_a, j_b, q, pos_r, lo_r, m_i, l_i, acc, qk_scale, kc_ptr, vc_ptr, k_desc, v_desc, bt_row, stride_btn,
              min_pos, max_pos, g, e, mask_e, kv_ar, S, E, kv_rows_per_block, stride_kcb, stride_kcs, stride_kcg, stride_kce,
              stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs, DTYPE: tl.constexpr, BLOCK_KV: tl.constexpr,
              FP8: tl.constexpr, FP32_DOT: tl.constexpr, KV_TMA: tl.constexpr, TAIL: tl.constexpr):
    """Online-softmax steps over KV tiles ``j_a .. j_b - 1`` in increasing order; returns ``(m, l, acc)``.
    ``DTYPE``: the query's storage dtype (what FP8 cache values are rounded to)."""
    for j in range(j_a, j_b):
        p, kt, v = _load_kv_tile(kc_ptr, vc_ptr, k_desc, v_desc, bt_row, stride_btn, j, min_pos, max_pos, g, e, mask_e,
                                 kv_ar,
                                 S, E, kv_rows_per_block, stride_kcb, stride_kcs, stride_kcg, stride_kce,
                                 stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs, DTYPE, BLOCK_KV, FP8,
                                 KV_TMA, TAIL)
        m_i, l_i, acc = _online_softmax_step(q, kt, v, p, pos_r, lo_r, m_i, l_i, acc, qk_scale, FP32_DOT)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T"])  # (no variant compiled for T == 1: one code for every batch)
def _attention_partial_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_ptr, pos_ptr, sched_ptr, out_ptr, ks_ptr, vs_ptr, sink_ptr,
        m_ptr, l_ptr, acc_ptr,
        qk_scale, T, E, S, WINDOW,
        stride_qt, stride_qh, stride_qe,
        stride_kcb, stride_kcs, stride_kcg, stride_kce,
        stride_vcb, stride_vcs, stride_vcg, stride_vce,
        stride_btb, stride_btn,
        stride_ot, stride_oh, stride_oe,
        stride_wt, stride_wh, stride_ws,
        stride_at, stride_ah, stride_as, stride_ae,
        k_desc, v_desc, kv_rows_per_block,
        Q_PER_KV: tl.constexpr, QP: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_KV: tl.constexpr, SPLIT_KV: tl.constexpr,
        FP32_DOT: tl.constexpr, FP8: tl.constexpr, KV_TMA: tl.constexpr, SINK: tl.constexpr,
        COMPRESSED: tl.constexpr = False):
    """Grid (tile programs, G, splits): query tile x kv head ``g`` x KV split (module docstring).

    ``COMPRESSED``: every row writes its splits' partial states (none is finalized here); the
    merge kernel adds the compressed entries' partial (:func:`_attention_compressed_kernel`).

    ``SINK``: ``sink_ptr`` holds one fp32 logit per q head; a row finalized here (one split)
    divides by ``l + exp2(sink * log2(e) - m)`` (log2 domain, ``m`` its final max).

    ``WINDOW`` > 0: sliding window, row ``r`` reads positions ``pos_r - WINDOW + 1 .. pos_r``;
    the tile's KV loop starts at the KV tile of its first token's window start (the tiles
    before it are fully masked for every row: skipping them changes no bit).

    ``KV_TMA``: K/V tiles come through the TMA descriptors ``k_desc``/``v_desc`` (2-D
    ``[slot rows, G*E]`` views, one block per ``kv_rows_per_block`` rows; see
    :func:`_kv_descriptors`) instead of per-position pointer gathers. The values fed to
    the dots are the same, so the bits are too."""
    g = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    kv_lo = split * SPLIT_KV
    n_tiles = tl.load(sched_ptr)

    r = tl.arange(0, ROWS)
    ti = r // QP  # token of the row within the tile
    hq = r % QP  # q head of the row within the kv head's group
    h = g * Q_PER_KV + hq
    e = tl.arange(0, BLOCK_E)
    mask_e = e < E
    i_t = tl.arange(0, BLOCK_T)
    kv_ar = tl.arange(0, BLOCK_KV)
    ks = 1.0
    vs = 1.0
    if FP8:
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)

    # Grid-stride over the device tile list: the grid size is only a hint.
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        t0 = tl.load(sched_ptr + 1 + tile).to(tl.int64)
        seq = tl.load(seq_ptr + t0).to(tl.int64)
        pos0 = tl.load(pos_ptr + t0).to(tl.int64)
        # The tile: tokens t0 + i while they continue the run (at most BLOCK_T).
        tt = t0 + i_t
        in_t = tt < T
        s_i = tl.load(seq_ptr + tt, mask=in_t, other=-1).to(tl.int64)
        p_i = tl.load(pos_ptr + tt, mask=in_t, other=-1).to(tl.int64)
        cont = in_t & (s_i == seq) & (p_i == pos0 + i_t)
        n_tok = tl.min(tl.where(cont, BLOCK_T, i_t), 0)  # the first token that breaks the run
        max_pos = pos0 + n_tok - 1

        row_ok = (ti < n_tok) & (hq < Q_PER_KV)
        pos_r = tl.where(row_ok, pos0 + ti, -1)
        # Window: row r reads [lo_r, pos_r]; the tile reads [min_pos, max_pos] (min_pos = lo of its first token).
        lo_r = tl.where(WINDOW > 0, pos_r - WINDOW + 1, 0)
        min_pos = tl.where(WINDOW > 0, tl.maximum(pos0 - WINDOW + 1, 0), 0)
        t_r = t0 + ti
        q = tl.load(q_ptr + t_r[:, None] * stride_qt + h[:, None] * stride_qh + e[None, :] * stride_qe,
                    mask=row_ok[:, None] & mask_e[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)

        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)

        # KV tiles of this split from the tile's window start up to its last position (none if the
        # split ends before the window or starts after the last position).
        j_lo = (tl.maximum(kv_lo, min_pos) // BLOCK_KV).to(tl.int32)
        last = tl.minimum(max_pos, kv_lo + SPLIT_KV - 1)
        j_hi = tl.where(max_pos >= kv_lo, last // BLOCK_KV + 1, j_lo).to(tl.int32)
        bt_row = bt_ptr + seq * stride_btb
        # Pointer gathers mask every tile as they load it: one loop. TMA copies whole tiles:
        # the head tile first if it starts below min_pos (window), masked; then the tiles wholly
        # inside [min_pos, max_pos], unmasked; then the tail tile (at most one), whose positions
        # past max_pos are zeroed (stale cache memory, possibly NaN, never reaches the math). The
        # head tile's block holds min_pos, so it is inside the window (never vLLM's null block).
        # Either way the online-softmax steps run in the same order.
        if KV_TMA:
            j_h = tl.minimum(tl.where(j_lo.to(tl.int64) * BLOCK_KV < min_pos, j_lo + 1, j_lo), tl.maximum(j_hi, j_lo))
            m_i, l_i, acc = _kv_tiles(j_lo, j_h, q, pos_r, lo_r, m_i, l_i, acc, qk_scale, kc_ptr, vc_ptr, k_desc,
                                      v_desc, bt_row, stride_btn, min_pos, max_pos, g, e, mask_e, kv_ar, S, E,
                                      kv_rows_per_block, stride_kcb, stride_kcs, stride_kcg, stride_kce,
                                      stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs,
                                      q_ptr.dtype.element_ty, BLOCK_KV, FP8, FP32_DOT, KV_TMA, True)
            j_mid = tl.maximum(j_h, tl.minimum(j_hi, ((max_pos + 1) // BLOCK_KV).to(tl.int32)))
            m_i, l_i, acc = _kv_tiles(j_h, j_mid, q, pos_r, lo_r, m_i, l_i, acc, qk_scale, kc_ptr, vc_ptr, k_desc,
                                      v_desc, bt_row, stride_btn, min_pos, max_pos, g, e, mask_e, kv_ar, S, E,
                                      kv_rows_per_block, stride_kcb, stride_kcs, stride_kcg, stride_kce,
                                      stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs,
                                      q_ptr.dtype.element_ty, BLOCK_KV, FP8, FP32_DOT, KV_TMA, False)
        else:
            j_mid = j_lo
        m_i, l_i, acc = _kv_tiles(j_mid, j_hi, q, pos_r, lo_r, m_i, l_i, acc, qk_scale, kc_ptr, vc_ptr, k_desc, v_desc,
                                  bt_row, stride_btn, min_pos, max_pos, g, e, mask_e, kv_ar, S, E, kv_rows_per_block,
                                  stride_kcb, stride_kcs, stride_kcg, stride_kce,
                                  stride_vcb, stride_vcs, stride_vcg, stride_vce, ks, vs,
                                  q_ptr.dtype.element_ty, BLOCK_KV, FP8, FP32_DOT, KV_TMA, True)

        # A token below SPLIT_KV has this one split: divide and round once, here.
        # (a scalar bool in a mask trips the interpreter: fold it into the bound)
        if COMPRESSED:  # every row is finalized by the merge, after its compressed entries
            one_split = row_ok & (pos_r < 0)
        else:
            one_split = row_ok & (pos_r < tl.where(split == 0, SPLIT_KV, 0))
        l_fin = l_i
        if SINK:  # the sink's column without a value: denominator only (the partials below keep l_i)
            sk = tl.load(sink_ptr + h, mask=row_ok, other=0.0)
            l_fin = l_i + tl.exp2(sk * _LOG2E_F - tl.where(m_i == float("-inf"), 0.0, m_i))
        l_safe = tl.where(l_fin > 0, l_fin, 1.0)
        tl.store(out_ptr + t_r[:, None] * stride_ot + h[:, None] * stride_oh + e[None, :] * stride_oe,
                 round_to(acc / l_safe[:, None], out_ptr.dtype.element_ty),
                 mask=one_split[:, None] & mask_e[None, :])
        # Other tokens: this split's partial state, merged by _attention_merge_kernel.
        if COMPRESSED:
            partial = row_ok & (pos_r >= kv_lo)
        else:
            partial = row_ok & (pos_r >= SPLIT_KV) & (pos_r >= kv_lo)
        w = t_r * stride_wt + h * stride_wh + split * stride_ws
        tl.store(m_ptr + w, m_i, mask=partial)
        tl.store(l_ptr + w, l_i, mask=partial)
        tl.store(acc_ptr + t_r[:, None] * stride_at + h[:, None] * stride_ah + split * stride_as
                 + e[None, :] * stride_ae, acc, mask=partial[:, None] & mask_e[None, :])


@triton.jit
def _attention_merge_kernel(
        pos_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, sink_ptr, E, WINDOW,
        stride_ot, stride_oh, stride_oe,
        stride_wt, stride_wh, stride_ws,
        stride_at, stride_ah, stride_as, stride_ae,
        Q_PER_KV: tl.constexpr, QP: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT_KV: tl.constexpr,
        SINK: tl.constexpr, COMPRESSED: tl.constexpr = False, C_SPLIT=0):
    """Grid (T, G): token ``t``'s q heads of kv head ``g``. Positions >= SPLIT_KV: merge the
    splits in increasing order, divide, round once; padding tokens: zeros; others: nothing
    (the partial kernel wrote them). ``WINDOW`` > 0: the merge starts at the split of the
    token's window start (the splits before it hold the empty state m = -inf, l = acc = 0,
    and merging the empty state first changes no bit: ``L = 0 * 0 + l_s``). ``SINK``: the
    merged denominator gets ``exp2(sink * log2(e) - M)`` once, after the last split.
    ``COMPRESSED``: every token (position >= 0) is merged here, its window splits and then the
    compressed entries' partial at workspace split ``C_SPLIT``, by the same rule; then the sink."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    hq = tl.arange(0, QP)
    h = g * Q_PER_KV + hq
    e = tl.arange(0, BLOCK_E)
    mask_e = e < E
    if COMPRESSED:
        multi = pos >= 0
    else:
        multi = pos >= SPLIT_KV
    # (a scalar bool in a mask trips the interpreter: fold it into a bound)
    row_m = hq < tl.where(multi, Q_PER_KV, 0)
    row_out = hq < tl.where(multi | (pos < 0), Q_PER_KV, 0)
    n_split = tl.where(multi, pos // SPLIT_KV + 1, 1).to(tl.int32)
    s0 = tl.where(multi & (WINDOW > 0), tl.maximum(pos - WINDOW + 1, 0) // SPLIT_KV, 0).to(tl.int32)
    w = t * stride_wt + h * stride_wh + s0 * stride_ws
    a = t * stride_at + h[:, None] * stride_ah + e[None, :] * stride_ae + s0 * stride_as
    mask_a = row_m[:, None] & mask_e[None, :]
    # The first split's state as is (exact); padding rows stay at m = l = acc = 0 -> zeros.
    M = tl.load(m_ptr + w, mask=row_m, other=0.0)
    L = tl.load(l_ptr + w, mask=row_m, other=0.0)
    ACC = tl.load(acc_ptr + a, mask=mask_a, other=0.0)
    for s in range(1, n_split - s0):
        m_s = tl.load(m_ptr + w + s * stride_ws, mask=row_m, other=0.0)
        l_s = tl.load(l_ptr + w + s * stride_ws, mask=row_m, other=0.0)
        acc_s = tl.load(acc_ptr + a + s * stride_as, mask=mask_a, other=0.0)
        M_new = tl.maximum(M, m_s)
        c_old = tl.where(M == M_new, 1.0, tl.exp2(M - M_new))
        c_new = tl.where(m_s == M_new, 1.0, tl.exp2(m_s - M_new))
        L = L * c_old + l_s * c_new
        ACC = ACC * c_old[:, None] + acc_s * c_new[:, None]
        M = M_new
    if COMPRESSED:  # the compressed entries' partial, merged after the window's splits
        wc = t * stride_wt + h * stride_wh + C_SPLIT * stride_ws
        ac = t * stride_at + h[:, None] * stride_ah + e[None, :] * stride_ae + C_SPLIT * stride_as
        m_s = tl.load(m_ptr + wc, mask=row_m, other=0.0)
        l_s = tl.load(l_ptr + wc, mask=row_m, other=0.0)
        acc_s = tl.load(acc_ptr + ac, mask=mask_a, other=0.0)
        M_new = tl.maximum(M, m_s)
        c_old = tl.where(M == M_new, 1.0, tl.exp2(M - M_new))
        c_new = tl.where(m_s == M_new, 1.0, tl.exp2(m_s - M_new))
        L = L * c_old + l_s * c_new
        ACC = ACC * c_old[:, None] + acc_s * c_new[:, None]
        M = M_new
    if SINK:  # the sink's column without a value: denominator only, after the merge
        sk = tl.load(sink_ptr + h, mask=row_m, other=0.0)
        L = L + tl.where(row_m, tl.exp2(sk * _LOG2E_F - tl.where(M == float("-inf"), 0.0, M)), 0.0)
    L_safe = tl.where(L > 0, L, 1.0)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + e[None, :] * stride_oe,
             round_to(ACC / L_safe[:, None], out_ptr.dtype.element_ty), mask=row_out[:, None] & mask_e[None, :])


@triton.jit(do_not_specialize=["K"])
def _attention_compressed_kernel(
        q_ptr, cc_ptr, ent_ptr, cbt_ptr, seq_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
        qk_scale, K, E, SC, RATIO, C_SPLIT,
        stride_qt, stride_qh, stride_qe,
        stride_ccb, stride_ccs, stride_ccg, stride_cce,
        stride_et, stride_ek,
        stride_cbb, stride_cbn,
        stride_wt, stride_wh, stride_ws,
        stride_at, stride_ah, stride_as, stride_ae,
        Q_PER_KV: tl.constexpr, CROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
        FP32_DOT: tl.constexpr):
    """Grid (T, G): token ``t``'s q heads of kv head ``g`` over its listed compressed entries.

    An fp32 online softmax from a fresh state over the list slots ``BLOCK_C*c ..
    BLOCK_C*c + BLOCK_C - 1`` (c = 0, 1, ...: list order), the scores in the log2 domain
    (``qk_scale`` = scale * log2(e), as the window's); entry ``j`` is page
    ``cbt[seq, j // SC]``, offset ``j % SC`` of the ``[N, SC, G, E]`` cache (K = V: one
    load feeds both dots). Slots with ``-1``, or with ``j >= (p+1) // RATIO`` (not complete
    at the token's position; masked, not raised: no device sync) are masked and their
    block-table entries are not read. A step in which the token has no valid slot keeps its
    state (selected, not recomputed), so trailing ``-1`` slots are exact no-ops and the bits
    do not depend on K. Writes ``(m, l, acc)`` to workspace split ``C_SPLIT`` for the merge
    kernel (padding tokens, ``p < 0``: the empty state)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    hq = tl.arange(0, CROWS)
    h = g * Q_PER_KV + hq
    row_ok = hq < Q_PER_KV
    e = tl.arange(0, BLOCK_E)
    mask_e = e < E
    n_done = tl.where(pos >= 0, (pos + 1) // RATIO, 0)  # entries complete at this position
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + e[None, :] * stride_qe,
                mask=row_ok[:, None] & mask_e[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((CROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((CROWS,), dtype=tl.float32)
    acc = tl.zeros((CROWS, BLOCK_E), dtype=tl.float32)
    kk0 = tl.arange(0, BLOCK_C)
    bt_row = cbt_ptr + seq * stride_cbb
    for c0 in range(0, K, BLOCK_C):
        kk = c0 + kk0
        ids = tl.load(ent_ptr + t * stride_et + kk * stride_ek, mask=kk < K, other=-1).to(tl.int64)
        valid = (ids >= 0) & (ids < n_done)
        ids0 = tl.where(valid, ids, 0)
        blk = tl.load(bt_row + (ids0 // SC) * stride_cbn, mask=valid, other=0).to(tl.int64)
        off = ids0 % SC
        c = tl.load(cc_ptr + blk[:, None] * stride_ccb + off[:, None] * stride_ccs + g * stride_ccg
                    + e[None, :] * stride_cce, mask=valid[:, None] & mask_e[None, :], other=0.0)  # [BLOCK_C, BLOCK_E]
        ct = tl.trans(c)
        if _INTERP:  # no BLAS under the interpreter (see interpreter_dot)
            sc = interpreter_dot(q, ct).to(tl.float32)
        elif FP32_DOT:
            sc = tl.dot(q, ct.to(tl.float32), input_precision="ieee")
        else:
            sc = tl.dot(q, ct.to(q.dtype))
        sc = sc * qk_scale
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
        pr = tl.where(valid[None, :], tl.exp2(sc - m_safe[:, None]), 0.0)
        l_new = l_i * alpha + tl.sum(pr, axis=1)
        if _INTERP:
            pv = interpreter_dot(pr, c).to(tl.float32)
        elif FP32_DOT:
            pv = tl.dot(pr, c.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(q.dtype), c.to(q.dtype))
        acc_new = acc * alpha[:, None] + pv
        keep = (tl.zeros((CROWS,), dtype=tl.int32) + tl.sum(valid.to(tl.int32), axis=0)) > 0
        m_i = tl.where(keep, m_new, m_i)
        l_i = tl.where(keep, l_new, l_i)
        acc = tl.where(keep[:, None], acc_new, acc)
    w = t * stride_wt + h * stride_wh + C_SPLIT * stride_ws
    tl.store(m_ptr + w, m_i, mask=row_ok)
    tl.store(l_ptr + w, l_i, mask=row_ok)
    tl.store(acc_ptr + t * stride_at + h[:, None] * stride_ah + C_SPLIT * stride_as + e[None, :] * stride_ae, acc,
             mask=row_ok[:, None] & mask_e[None, :])


def _grid_sizes(chunks: list[tuple[int, int]], block_t: int, num_block_rows: int,
                max_programs: int | None = None) -> list[int]:
    """Partial-kernel programs per token chunk, from host-known sizes only (no device read).

    A chunk of ``n`` tokens has at most ``cdiv(n, BLOCK_T) + runs`` tiles (a run: the
    consecutive positions of one sequence; each run adds at most one partial tile) and at
    most ``n`` tiles. A vLLM step or a packed trainer batch has one run per sequence and at
    most ``num_block_rows`` (the block table's rows) sequences, so
    ``min(n, cdiv(n, BLOCK_T) + num_block_rows)`` programs give every tile its own program
    there; any other batch (more runs than block-table rows) still gets every tile, since
    the programs stride over the device tile list. For decode (``n`` = rows) this is ``n``,
    the same at CUDA-graph capture and replay.

    Args:
        chunks: ``(first token, token count)`` of each chunk.
        block_t: query tokens per tile (``BLOCK_T``).
        num_block_rows: ``block_table.shape[0]``.
        max_programs: optional cap (tests: force programs to stride over several tiles).
    """
    sizes = []
    for _, n in chunks:
        g = max(1, min(n, -(-n // block_t) + num_block_rows))
        sizes.append(g if max_programs is None else max(1, min(g, max_programs)))
    return sizes


class AttentionLaunch(NamedTuple):
    """Overrides of the partial kernel's launch (benchmarks/tests): ``rows`` per program
    (query tokens x q heads), ``num_warps``, ``num_stages``, ``max_programs`` (a cap on
    the programs per chunk: they then stride over several tiles), ``kv_tma`` (True: K/V tiles
    by TMA copies, ValueError where TMA does not apply; False: pointer gathers); ``None``
    keeps the default (TMA wherever it applies)."""

    rows: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_programs: int | None = None
    kv_tma: bool | None = None


TMA_MAX_BOX = 256
"""A TMA copy's box is at most 256 elements per dimension: wider heads (DeepSeek-V4's 512) take
the pointer gathers (the same values, so the same bits)."""


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """Whether ``device`` has the Tensor Memory Accelerator (CUDA compute capability >= 9.0)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _kv_descriptors(kc: torch.Tensor, vc: torch.Tensor, S: int, E: int, block_e: int, fp32_dot: bool,
                    fp8: bool):
    """TMA descriptors of the K and V caches for the partial kernel, or ``None`` where TMA
    does not apply (interpreter, a device before Hopper, fp32 queries, an FP8 cache, ``S`` not a multiple of
    ``BLOCK_KV``, ``E`` not a power of two or above :data:`TMA_MAX_BOX`, a layout that is not rows of ``G*E`` contiguous
    elements, or more than ``2**31 - 1`` slot rows).

    Each cache ``[num_blocks, S, G, E]`` is seen as a 2-D ``[rows, G*E]`` tensor of slot
    rows: slot ``(b, s)`` is row ``b * rows_per_block + s`` where ``rows_per_block =
    stride(0) // stride(1)`` (vLLM's ``[num_blocks, 2, S, G, E]`` allocation interleaves the
    K and V blocks, so there it is ``2*S``); ``rows`` ends at the last block's last slot, so
    nothing outside the cache is addressed. Returns ``(k_desc, v_desc, rows_per_block)``.
    """
    if INTERPRET or fp32_dot or fp8 or S % BLOCK_KV or E != block_e or block_e > TMA_MAX_BOX or not _has_tma(kc.device):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    G = kc.shape[2]
    es = kc.element_size()
    descs = []
    for c in (kc, vc):
        if (c.stride(3) != 1 or c.stride(2) != E or c.stride(1) != G * E or c.stride(0) % c.stride(1)
                or c.stride(0) != kc.stride(0) or c.data_ptr() % 16 or (G * E * es) % 16):
            return None
        rows_per_block = c.stride(0) // c.stride(1)
        rows = (c.shape[0] - 1) * rows_per_block + S
        if rows > 2**31 - 1:  # TMA coordinates are int32
            return None
        descs.append(TensorDescriptor(c, [rows, G * E], [G * E, 1], [BLOCK_KV, block_e]))
    return descs[0], descs[1], rows_per_block


def tile_shape(H: int, G: int) -> tuple[int, int, int]:
    """``(QP, rows, BLOCK_T)`` for ``H`` q heads over ``G`` kv heads: the q heads of a kv
    head padded to ``QP = next_pow2(H // G)``, the rows of a program and the query tokens
    of a tile. Model constants only."""
    qp = next_pow2(H // G)
    rows = max(ROWS, MIN_BLOCK_H, qp)
    return qp, rows, max(1, rows // qp)


def num_splits(block_table_BN: torch.Tensor, S: int) -> int:
    """KV splits a sequence of this block table can span: ``cdiv(max_blocks * S, SPLIT_KV)``."""
    return max(1, -(-block_table_BN.shape[1] * S // SPLIT_KV))


def _check_cache(name: str, cache: torch.Tensor, G: int, E: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != G or cache.shape[3] != E:
        raise ValueError(f"{name} must be a 4-D [num_blocks, S, {G}, {E}] view, got {tuple(cache.shape)}")
    if cache.dtype not in FLOAT_DTYPES and cache.dtype != KV_FP8_DTYPE:
        raise ValueError(f"{name} dtype must be bf16/fp16/fp32/float8_e4m3fn, got {cache.dtype}")


def _kernel_views(k_cache, v_cache, scales):
    """``(k, v, k_scale, v_scale, fp8)`` kernel arguments: uint8 bit views and the
    scales for an FP8 cache, the caches themselves (and unused scale pointers) otherwise."""
    if scales is None:
        return k_cache, v_cache, k_cache, v_cache, False
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales[0], scales[1], True


def write_kv_cache_triton(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping_T: torch.Tensor,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K and V into its cache slot (in place).

    Model-dtype caches get an exact copy cast to the cache dtype; float8_e4m3fn
    caches get ``e4m3(clamp(div_rn(fp32(k), k_scale), -448, 448))`` (RNE,
    :func:`f32_to_e4m3_bits`), the same for V.

    Args:
        k_TGE: ``[T, G, E]`` keys (bf16/fp16/fp32, any strides).
        v_TGE: ``[T, G, E]`` values.
        k_cache: ``[num_blocks, S, G, E]`` view with arbitrary strides.
        v_cache: same shape as ``k_cache`` (strides may differ).
        slot_mapping_T: int32/int64 ``[T]``; slot = block * S + offset; a
            negative slot marks a padding token and is skipped.
        k_scale, v_scale: fp32 ``[]`` scales of an FP8 cache (else None).

    Raises:
        ValueError: wrong ranks/shapes/dtypes or devices; missing, superfluous
            or bad scales (``ops.attention.check_kv_scales``).
    """
    if k_TGE.dim() != 3 or v_TGE.shape != k_TGE.shape:
        raise ValueError(f"write_kv_cache_triton: k {tuple(k_TGE.shape)} and v {tuple(v_TGE.shape)} "
                         "must both be [T, G, E]")
    if k_TGE.dtype not in FLOAT_DTYPES or v_TGE.dtype not in FLOAT_DTYPES:
        raise ValueError(f"write_kv_cache_triton: k/v dtype must be bf16/fp16/fp32, got {k_TGE.dtype}/{v_TGE.dtype}")
    T, G, E = k_TGE.shape
    _check_cache("write_kv_cache_triton: k_cache", k_cache, G, E)
    _check_cache("write_kv_cache_triton: v_cache", v_cache, G, E)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"write_kv_cache_triton: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if slot_mapping_T.shape != (T,) or slot_mapping_T.dtype not in _INDEX_DTYPES:
        raise ValueError(f"write_kv_cache_triton: slot_mapping must be int32/int64 [{T}], got "
                         f"{tuple(slot_mapping_T.shape)} {slot_mapping_T.dtype}")
    check_device("write_kv_cache_triton", k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T)
    scales = check_kv_scales("write_kv_cache_triton", k_cache, v_cache, k_scale, v_scale)
    if T == 0:
        return
    S = k_cache.shape[1]
    kc, vc, ks, vs, fp8 = _kernel_views(k_cache, v_cache, scales)
    _write_kv_kernel[(T,)](
        k_TGE, v_TGE, kc, vc, slot_mapping_T, ks, vs, G, E, S,
        *k_TGE.stride(), *v_TGE.stride(), *kc.stride(), *vc.stride(),
        BLOCK_G=next_pow2(G), BLOCK_E=next_pow2(E), FP8=fp8, num_warps=4)


def paged_attention_triton(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor,
                           positions_T: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, *, sliding_window: int | None = None,
                           sink: torch.Tensor | None = None, launch: AttentionLaunch | None = None,
                           compressed: CompressedKV | None = None) -> torch.Tensor:
    """Causal paged attention (GQA), batch-invariant per token.

    Token ``t`` attends to positions ``0..positions_T[t]`` of sequence
    ``seq_idx_T[t]`` (its row of ``block_table_BN``), or with ``sliding_window``
    W to positions ``max(0, p-W+1)..p``; those positions must already be in the
    cache (write the current tokens first). Block-table entries of positions
    below a query tile's first window start are never read. q head ``h`` uses
    kv head ``h // (H // G)``.

    Args:
        q_THE: ``[T, H, E]`` queries (bf16/fp16/fp32, any strides).
        k_cache: ``[num_blocks, S, G, E]`` view, arbitrary strides, any ``S``.
        v_cache: same shape as ``k_cache``.
        block_table_BN: int32 ``[B, max_blocks]``; entry ``[b, i]`` is the
            physical block holding positions ``[i*S, (i+1)*S)`` of sequence ``b``.
        seq_idx_T: int32/int64 ``[T]``, row of ``block_table_BN`` per token.
        positions_T: int32/int64 ``[T]``, position of the token in its own
            sequence; a negative position marks a padding token (zero output).
        scale: softmax scale (e.g. ``E ** -0.5``).
        k_scale, v_scale: fp32 ``[]`` scales of a float8_e4m3fn cache (else
            None): K/V tiles are read as ``q.dtype(fp32(e4m3) * scale)``.
        sliding_window: ``None`` (full causal) or W >= 1 (``ops.attention.check_sliding_window``).
        sink: ``None`` or fp32 ``[H]`` attention-sink logits (``ops.attention.check_sink``): a row's
            denominator gets ``exp2(sink_h * log2(e) - m)`` once, where it is finalized (the
            partial kernel for one split, else the merge); ``None`` compiles the kernels without it.
        compressed: ``None`` or a ``CompressedKV`` (``ops.attention.check_compressed``; needs
            ``sliding_window``): every token then goes through the merge kernel, which merges
            its window splits, then the partial state of its listed entries
            (:func:`_attention_compressed_kernel`, workspace split ``n_split``), then adds the
            sink. Ids that break causality are masked, not raised (no device sync).
        launch: benchmarks and tests only: override the partial kernel's rows,
            warps, stages, grid cap or K/V loads (:class:`AttentionLaunch`); the
            model never passes it.

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype`` (rounded once from fp32).

    Raises:
        ValueError: wrong ranks/shapes/dtypes, ``H`` not a multiple of ``G``,
            devices differ; missing, superfluous or bad scales; ``launch.kv_tma``
            where TMA does not apply.

    Numerics: scores and the online softmax are fp32 (exp2 with the scale
    folded in); on GPU the dot operands are ``q``'s dtype (K/V tiles and the
    probabilities are cast to it for the tensor-core ``tl.dot``, fp32
    accumulation); for fp32 ``q`` everything is fp32 (IEEE dot). Under the
    interpreter (CPU) the two products are :func:`interpreter_dot` (exact fp64
    products, numpy's fixed summation order, one rounding to fp32), so no
    host BLAS kernel decides any bit.
    """
    if q_THE.dim() != 3 or q_THE.dtype not in FLOAT_DTYPES:
        raise ValueError(f"paged_attention_triton: q must be [T, H, E] bf16/fp16/fp32, got "
                         f"{tuple(q_THE.shape)} {q_THE.dtype}")
    T, H, E = q_THE.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != E:
        raise ValueError(f"paged_attention_triton: k_cache must be [num_blocks, S, G, {E}], got "
                         f"{tuple(k_cache.shape)}")
    G = k_cache.shape[2]
    _check_cache("paged_attention_triton: k_cache", k_cache, G, E)
    _check_cache("paged_attention_triton: v_cache", v_cache, G, E)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention_triton: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if G == 0 or H % G != 0:
        raise ValueError(f"paged_attention_triton: H={H} q heads is not a multiple of G={G} kv heads")
    if block_table_BN.dim() != 2 or block_table_BN.dtype not in _INDEX_DTYPES:
        raise ValueError(f"paged_attention_triton: block_table must be int32 [B, max_blocks], got "
                         f"{tuple(block_table_BN.shape)} {block_table_BN.dtype}")
    for name, idx in (("seq_idx", seq_idx_T), ("positions", positions_T)):
        if idx.shape != (T,) or idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"paged_attention_triton: {name} must be int32/int64 [{T}], got "
                             f"{tuple(idx.shape)} {idx.dtype}")
    check_device("paged_attention_triton", q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T)
    scales = check_kv_scales("paged_attention_triton", k_cache, v_cache, k_scale, v_scale)
    window = check_sliding_window("paged_attention_triton", sliding_window) or 0  # 0: no window
    sink = check_sink("paged_attention_triton", sink, H, q_THE.device)
    compressed = check_compressed("paged_attention_triton", compressed, q_THE, k_cache, window or None)
    comp = compressed is not None
    sink_arg = sink if sink is not None else q_THE  # (an unused pointer without a sink)
    out = torch.empty((T, H, E), dtype=q_THE.dtype, device=q_THE.device)
    if T == 0:
        return out
    S = k_cache.shape[1]
    q_per_kv = H // G
    qp, rows, block_t = tile_shape(H, G)
    block_e = max(16, next_pow2(E))
    num_warps, num_stages = launch_warps_stages(block_e)
    # the compressed-entry kernel: Triton's default stages except at the wide head dims
    c_launch = dict(num_stages=WIDE_LAUNCH[1]) if (not INTERPRET and block_e >= WIDE_HEAD_DIM) else {}
    if launch is not None:
        if launch.rows is not None:
            rows = max(launch.rows, MIN_BLOCK_H, qp)
            block_t = max(1, rows // qp)
        num_warps = launch.num_warps or num_warps
        num_stages = launch.num_stages or num_stages
    n_split = num_splits(block_table_BN, S)
    fp32_dot = INTERPRET or q_THE.dtype == torch.float32
    kc, vc, ks, vs, fp8 = _kernel_views(k_cache, v_cache, scales)
    seq, pos = seq_idx_T.contiguous(), positions_T.contiguous()

    # Tokens in chunks of tc so that the fp32 split workspace (tc x H x n_split x (E + 2)) stays bounded.
    # With compressed entries one more split slot (n_split) holds their partial state.
    n_ws = n_split + 1 if comp else n_split
    tc = T if n_ws == 1 else max(1, min(T, WORKSPACE_BYTES // (H * n_ws * (E + 2) * 4)))
    chunks = [(a, min(tc, T - a)) for a in range(0, T, tc)]
    sched = torch.empty((len(chunks), tc + 1), dtype=torch.int32, device=q_THE.device)
    _tile_schedule_kernel[(len(chunks),)](seq, pos, sched, T, tc, sched.stride(0), BLOCK_T=block_t,
                                          SB=SCHED_BLOCK, num_warps=4)
    if n_ws > 1:  # one allocation: acc [tc, H, n_ws, E] (rows aligned), then (m, l) [tc, H, n_ws, 2]
        n_acc = tc * H * n_ws * E
        ws = torch.empty((n_acc + tc * H * n_ws * 2,), dtype=torch.float32, device=q_THE.device)
        acc_ws = ws[:n_acc].view(tc, H, n_ws, E)
        ml_ws = ws[n_acc:].view(tc, H, n_ws, 2)
        m_ws, l_ws = ml_ws[..., 0], ml_ws[..., 1]
        w_strides, a_strides = m_ws.stride(), acc_ws.stride()
    else:  # every token is finalized by the partial kernel; nothing is written here
        ws = torch.empty((1,), dtype=torch.float32, device=q_THE.device)
        acc_ws = m_ws = l_ws = ws
        w_strides, a_strides = (0, 0, 0), (0, 0, 0, 0)
    kv_tma = None if launch is None else launch.kv_tma  # None: TMA wherever it applies
    tma = None if kv_tma is False else _kv_descriptors(kc, vc, S, E, block_e, fp32_dot, fp8)
    if kv_tma and tma is None:
        raise ValueError("paged_attention_triton: launch.kv_tma=True but TMA does not apply to this cache "
                         f"(S={S}, E={E}, dtype {k_cache.dtype}, strides {tuple(k_cache.stride())})")
    k_desc, v_desc, rows_per_block = tma if tma is not None else (None, None, 0)
    sizes = _grid_sizes(chunks, block_t, block_table_BN.shape[0], None if launch is None else launch.max_programs)
    for c, (a, n) in enumerate(chunks):
        q_c, o_c, s_c, p_c = q_THE[a:a + n], out[a:a + n], seq[a:a + n], pos[a:a + n]
        _attention_partial_kernel[(sizes[c], G, n_split)](
            q_c, kc, vc, block_table_BN, s_c, p_c, sched[c], o_c, ks, vs, sink_arg, m_ws, l_ws, acc_ws,
            float(scale) * _LOG2E, n, E, S, window,
            *q_c.stride(), *kc.stride(), *vc.stride(), *block_table_BN.stride(), *o_c.stride(),
            *w_strides, *a_strides, k_desc, v_desc, rows_per_block,
            Q_PER_KV=q_per_kv, QP=qp, ROWS=rows, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_KV=BLOCK_KV,
            SPLIT_KV=SPLIT_KV, FP32_DOT=fp32_dot, FP8=fp8, KV_TMA=tma is not None, SINK=sink is not None,
            COMPRESSED=comp, num_warps=num_warps, num_stages=num_stages)
        if comp:
            cc, ent = compressed.cache, compressed.entries_TK[a:a + n]
            cbt = compressed.block_table_BN
            _attention_compressed_kernel[(n, G)](
                q_c, cc, ent, cbt, s_c, p_c, m_ws, l_ws, acc_ws, float(scale) * _LOG2E, ent.shape[1], E, cc.shape[1],
                compressed.ratio, n_split, *q_c.stride(), *cc.stride(), *ent.stride(), *cbt.stride(),
                *w_strides, *a_strides, Q_PER_KV=q_per_kv, CROWS=max(MIN_BLOCK_H, qp), BLOCK_E=block_e,
                BLOCK_C=BLOCK_KV, FP32_DOT=fp32_dot, num_warps=num_warps, **c_launch)
            _attention_merge_kernel[(n, G)](
                p_c, o_c, m_ws, l_ws, acc_ws, sink_arg, E, window, *o_c.stride(), *w_strides, *a_strides,
                Q_PER_KV=q_per_kv, QP=qp, BLOCK_E=block_e, SPLIT_KV=SPLIT_KV, SINK=sink is not None,
                COMPRESSED=True, C_SPLIT=n_split, num_warps=4)
            continue
        _attention_merge_kernel[(n, G)](
            p_c, o_c, m_ws, l_ws, acc_ws, sink_arg, E, window, *o_c.stride(), *w_strides, *a_strides,
            Q_PER_KV=q_per_kv, QP=qp, BLOCK_E=block_e, SPLIT_KV=SPLIT_KV, SINK=sink is not None, num_warps=4)
    return out
