"""CPU path of the KV-cache write and of paged attention: plain torch, 16-token query
tiles x 16-position KV tiles of fixed shapes, scores and ``P @ V`` exact in fp64
and rounded once, so no result depends on the batch or on the host's BLAS."""

from __future__ import annotations

import torch

from .._dispatch import ROW_TILE, pad_rows
from .common import (CompressedKV, check_compressed_entries, check_kv_scales, compressed_entry_slots, kv_fp8_dequantize,
                     kv_fp8_quantize, window_start)


KV_TILE_CPU = 16
"""KV positions per online-softmax step in the CPU implementation."""


def write_kv_cache_torch(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale=None, v_scale=None) -> None:
    """CPU: an indexed copy (exact), or for an FP8 cache :func:`kv_fp8_quantize` then the copy.
    A shared K = V cache (``v_cache is k_cache``) is written once, from ``k_TGE``."""
    scales = check_kv_scales("write_kv_cache_torch", k_cache, v_cache, k_scale, v_scale)
    s = k_cache.shape[1]
    keep = slot_mapping_T >= 0
    slots = slot_mapping_T[keep].long()
    blk, off = slots // s, slots % s
    shared = v_cache is k_cache
    if scales is not None:
        k_cache[blk, off] = kv_fp8_quantize(k_TGE[keep], scales[0])
        if not shared:
            v_cache[blk, off] = kv_fp8_quantize(v_TGE[keep], scales[1])
        return
    k_cache[blk, off] = k_TGE[keep].to(k_cache.dtype)
    if not shared:
        v_cache[blk, off] = v_TGE[keep].to(v_cache.dtype)


def paged_attention_torch(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                          k_scale=None, v_scale=None, sliding_window: int | None = None,
                          sink: torch.Tensor | None = None, compressed: CompressedKV | None = None) -> torch.Tensor:
    """CPU implementation: 16-token query tiles x 16-position KV tiles, fixed shapes.

    ``sliding_window`` W: a token at position p reads positions ``max(0, p-W+1)..p``
    only. A query tile starts at the KV tile of its lowest window start; the tiles
    it skips are fully masked for every row, which leaves each row's online-softmax
    state bit for bit as it was (m = -inf, l = 0, acc = 0), so the bits do not
    depend on the tile's other rows. Positions outside a row's window are never
    gathered (block 0 is read there and the values replaced by 0), so block-table
    entries behind the window (vLLM's null block) are never used.

    Each torch call has a shape fixed by the model (16 tokens, G, H/G, E, 16
    positions), so its kernel and thread partition never depend on the batch.
    No result depends on the host's BLAS either: scores are exact fp64 dot
    products of the bf16/fp16 operands rounded once to fp32 (exact while the
    products of one score span fewer than ``53 - 22 - ceil(log2 E)`` binary
    orders), and ``P @ V`` and the row sum of ``P`` are accumulated
    elementwise in fp64 in position order, then rounded once to fp32. An FP8
    cache is read through :func:`kv_fp8_dequantize` to ``q``'s dtype first.

    ``sink`` (fp32 ``[H]`` or ``None``): after the last KV tile each row's denominator
    becomes ``l + exp(sink_h - m)`` (``m`` its final running max, 0 for an empty row),
    one fp32 exp and one add; without it nothing changes.

    ``compressed`` (:class:`~.common.CompressedKV` or ``None``; DeepSeek-V4 CSA/HCA): after
    the window tiles, the same online softmax runs over each row's listed entries in list
    order, 16 list slots per step (the tile of slots ``16c .. 16c+15``), with the same scale
    and the same fixed-order fp64 arithmetic; ``-1`` slots are masked (block 0 read, values
    replaced by 0). A step in which a row has no valid slot leaves that row's state as it
    was (selected, not recomputed), so trailing ``-1`` slots and wider lists are exact
    no-ops and a row's bits never depend on the other rows' lists. Then the sink. The ids
    are checked first (:func:`~.common.check_compressed_entries`, ``ValueError``).
    """
    if compressed is not None:
        check_compressed_entries("paged_attention_torch", compressed, positions_T)
    scales = check_kv_scales("paged_attention_torch", k_cache, v_cache, k_scale, v_scale)
    if scales is None:
        read_k = read_v = lambda c: c.float()  # noqa: E731
    else:
        read_k = lambda c: kv_fp8_dequantize(c, scales[0], q_THE.dtype).float()  # noqa: E731
        read_v = lambda c: kv_fp8_dequantize(c, scales[1], q_THE.dtype).float()  # noqa: E731
    t_all, h, e = q_THE.shape
    s, g = k_cache.shape[1], k_cache.shape[2]
    r = h // g
    kv = KV_TILE_CPU
    if s % kv:
        raise ValueError(f"attention: cache block size {s} is not a multiple of the KV tile {kv}")
    nb = block_table_BN.shape[1]
    q_pad = pad_rows(q_THE)
    pos_pad = pad_rows(positions_T.long().view(-1, 1)).view(-1)
    valid_row = pad_rows(torch.ones(t_all, 1, dtype=torch.bool, device=q_THE.device)).view(-1)
    sidx_pad = pad_rows(seq_idx_T.long().view(-1, 1)).view(-1)
    ar = torch.arange(kv, device=q_THE.device)
    if compressed is not None:
        c_slots = compressed_slots_padded(compressed, seq_idx_T, q_pad.shape[0], kv)  # [T pad, K pad], -1 = none
        c_pages = compressed.cache.shape[1]
        c_flat = compressed.cache
    outs = []
    for i in range(0, q_pad.shape[0], ROW_TILE):
        qd = q_pad[i:i + ROW_TILE].double().view(ROW_TILE, g, r, e)
        pos = torch.where(valid_row[i:i + ROW_TILE], pos_pad[i:i + ROW_TILE], -1)
        rows = block_table_BN[sidx_pad[i:i + ROW_TILE]].long()  # [16, nb]
        m = torch.full((ROW_TILE, g, r), float("-inf"), device=q_THE.device)
        l = torch.zeros((ROW_TILE, g, r), device=q_THE.device)
        acc = torch.zeros((ROW_TILE, g, r, e), device=q_THE.device)
        n_tiles = int(pos.max().item()) // kv + 1 if bool(valid_row[i:i + ROW_TILE].any()) else 0
        lo = window_start(pos, sliding_window)  # [16] first position each row reads
        j0 = int(torch.where(pos >= 0, lo, pos.new_full((), 1 << 62)).min().item()) // kv if n_tiles else 0
        for j in range(j0, n_tiles):
            p = j * kv + ar  # [KV] absolute positions
            valid = (p.view(1, kv) <= pos.view(ROW_TILE, 1)) & (p.view(1, kv) >= lo.view(ROW_TILE, 1))  # [16, KV]
            col = (p // s).clamp(max=nb - 1)
            # Masked positions may point at stale or out-of-range block-table
            # entries: read block 0 there (the values are replaced by 0 below).
            blk = torch.where(valid, rows[:, col], 0)  # [16, KV]
            off = (p % s).view(1, kv).expand(ROW_TILE, kv)
            vmask = valid.view(ROW_TILE, kv, 1, 1)
            k = torch.where(vmask, read_k(k_cache[blk, off]), 0.0)  # [16, KV, G, E]
            v = torch.where(vmask, read_v(v_cache[blk, off]), 0.0)
            # Scores: exact fp64 products of the bf16/fp16 operands, one rounding to
            # fp32 (BLAS order cannot matter while the fp64 sum is exact).
            sc = torch.matmul(qd, k.double().permute(0, 2, 3, 1)).float() * scale  # [16, G, R, KV]
            sc = sc.masked_fill(~valid.view(ROW_TILE, 1, 1, kv), float("-inf"))
            m_new = torch.maximum(m, sc.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            pr = torch.exp(sc - m_safe.unsqueeze(-1))
            # P @ V and the row sum of P in a fixed order (position 0..KV-1 of the
            # tile), elementwise in fp64 (each product exact), rounded once to fp32:
            # no BLAS call and no vectorized reduction can reorder it.
            pd, vd = pr.double(), v.double().permute(0, 2, 1, 3)  # [16, G, R, KV], [16, G, KV, E]
            pv = pd[..., 0:1] * vd[:, :, 0:1, :]
            ps = pd[..., 0]
            for c in range(1, kv):
                pv = pv + pd[..., c:c + 1] * vd[:, :, c:c + 1, :]
                ps = ps + pd[..., c]
            l = l * alpha + ps.float()
            acc = acc * alpha.unsqueeze(-1) + pv.float()
            m = m_new
        if compressed is not None:  # the listed entries, after the window, in list order
            cs = c_slots[i:i + ROW_TILE]  # [16, K pad]
            used = cs >= 0
            n_c = int(((torch.arange(cs.shape[1]) + 1) * used).amax().item()) if cs.numel() else 0
            for c0 in range(0, n_c, kv):
                sl = cs[:, c0:c0 + kv]  # [16, KV]
                valid = sl >= 0
                blk = torch.where(valid, sl // c_pages, 0)
                off = torch.where(valid, sl % c_pages, 0)
                vmask = valid.view(ROW_TILE, kv, 1, 1)
                k = torch.where(vmask, c_flat[blk, off].float(), 0.0)  # [16, KV, G, E]; K = V
                sc = torch.matmul(qd, k.double().permute(0, 2, 3, 1)).float() * scale  # [16, G, R, KV]
                sc = sc.masked_fill(~valid.view(ROW_TILE, 1, 1, kv), float("-inf"))
                m_new = torch.maximum(m, sc.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                alpha = torch.exp(m - m_safe)
                pr = torch.exp(sc - m_safe.unsqueeze(-1))
                pd, vd = pr.double(), k.double().permute(0, 2, 1, 3)
                pv = pd[..., 0:1] * vd[:, :, 0:1, :]
                ps = pd[..., 0]
                for c in range(1, kv):
                    pv = pv + pd[..., c:c + 1] * vd[:, :, c:c + 1, :]
                    ps = ps + pd[..., c]
                keep = valid.any(dim=1).view(ROW_TILE, 1, 1)  # rows with a valid slot in this step
                l = torch.where(keep, l * alpha + ps.float(), l)
                acc = torch.where(keep.unsqueeze(-1), acc * alpha.unsqueeze(-1) + pv.float(), acc)
                m = torch.where(keep, m_new, m)
        if sink is not None:  # the sink's column without a value: denominator only, after the last tile
            m_fin = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            l = l + torch.exp(sink.view(1, g, r) - m_fin)
        l_safe = torch.where(l > 0, l, torch.ones_like(l))
        outs.append((acc / l_safe.unsqueeze(-1)).view(ROW_TILE, h, e))
    if not outs:
        return q_THE.new_zeros((0, h, e))
    return torch.cat(outs)[:t_all].to(q_THE.dtype)


def compressed_slots_padded(compressed: CompressedKV, seq_idx_T: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """int64 ``[rows, K']``: the cache slot (``page * (S // ratio) + offset``) of each listed entry,
    ``-1`` for ``-1`` ids and for the padding rows ``T..rows-1``; ``K'`` is K rounded up to a
    multiple of ``width`` with ``-1`` columns."""
    t, k = compressed.entries_TK.shape
    out = torch.full((rows, -(-k // width) * width), -1, dtype=torch.long, device=compressed.entries_TK.device)
    if t and k:
        out[:t, :k] = compressed_entry_slots(compressed, seq_idx_T)
    return out


def read_kv_cache_torch(cache: torch.Tensor, slots_X: torch.Tensor) -> torch.Tensor:
    """The rows at cache slots ``block * S + offset`` (an exact copy; ``slot < 0``: a zero row).

    One torch gather on every device: a copy rounds nothing, so it has no batch-dependent
    bits, and the indices are clamped rather than filtered (no host sync: CUDA-graph safe).
    """
    s = cache.shape[1]
    sl = slots_X.long()
    valid = sl >= 0
    s0 = torch.where(valid, sl, 0)
    rows = cache[s0 // s, s0 % s]  # [X, G, E]
    return torch.where(valid.view(-1, 1, 1), rows, torch.zeros((), dtype=cache.dtype, device=cache.device))
