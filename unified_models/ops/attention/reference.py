"""fp64 oracles of attention: dense causal attention of one sequence, and per-token
attention over the paged cache."""

from __future__ import annotations

import torch

from .common import CompressedKV, check_compressed_entries, check_kv_scales, kv_fp8_dequantize


def softmax_with_sink(scores: torch.Tensor, sink_H: torch.Tensor | None) -> torch.Tensor:
    """``softmax`` over the last dim of ``scores [H, ..., S]``; with a sink (``[H]``) its logit
    joins as one extra column that is dropped after the softmax (transformers'
    ``eager_attention_forward`` for DeepSeek-V4 / gpt-oss), so it only enlarges the
    denominator. Computes in ``scores.dtype``; differentiable in both."""
    if sink_H is None:
        return torch.softmax(scores, dim=-1)
    col = sink_H.to(scores.dtype).view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


def dense_causal_attention_reference(q_THE: torch.Tensor, k_TGE: torch.Tensor, v_TGE: torch.Tensor,
                                     scale: float, sliding_window: int | None = None,
                                     sink: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle for ONE sequence: causal softmax attention in fp64, no cache.

    Args:
        q_THE: ``[T, H, E]``; k_TGE, v_TGE: ``[T, G, E]`` of the same sequence.
        sliding_window: W, or ``None``: query i attends keys ``max(0, i-W+1)..i``.
        sink: ``[H]`` attention-sink logits (:func:`softmax_with_sink`), or ``None``.

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype``.
    """
    t, h, e = q_THE.shape
    g = k_TGE.shape[1]
    q = q_THE.double()
    k = k_TGE.double().repeat_interleave(h // g, dim=1)
    v = v_TGE.double().repeat_interleave(h // g, dim=1)
    sc = torch.einsum("the,she->hts", q, k) * scale
    sc = sc.masked_fill(~causal_mask(t, sliding_window, q.device), float("-inf"))
    sk = None if sink is None else sink.double()
    out = torch.einsum("hts,she->the", softmax_with_sink(sc, sk), v)
    return out.to(q_THE.dtype)


def causal_mask(t: int, sliding_window: int | None, device) -> torch.Tensor:
    """bool ``[T, T]``: query i sees key j iff ``j <= i`` and (with a window W) ``i - j < W``."""
    i = torch.arange(t, device=device)
    mask = i[None, :] <= i[:, None]
    if sliding_window is not None:
        mask &= i[:, None] - i[None, :] < sliding_window
    return mask


def paged_attention_reference(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                              k_scale=None, v_scale=None, kv_dtype: torch.dtype | None = None,
                              sliding_window: int | None = None, sink: torch.Tensor | None = None,
                              compressed: CompressedKV | None = None) -> torch.Tensor:
    """Oracle over the paged cache: per token, gather its window (positions
    ``max(0, p-W+1)..p``; the whole prefix without a window) and do fp64 softmax
    (with ``sink [H]``: :func:`softmax_with_sink`).

    ``compressed`` (:class:`~.common.CompressedKV`): the row's listed entries (ids >= 0,
    read at page ``block_table[b, j // (S // ratio)]``, offset ``j % (S // ratio)``) join
    the keys after the window, K = V, the same scale. The ids are checked
    (:func:`~.common.check_compressed_entries`: ``ValueError`` for ``j >= (p+1)//ratio``).

    An FP8 cache is dequantized by the read rule to ``kv_dtype`` (default
    ``q``'s dtype; pass the model dtype when ``q`` is given in fp64).
    """
    scales = check_kv_scales("paged_attention_reference", k_cache, v_cache, k_scale, v_scale)
    kv_dtype = kv_dtype or q_THE.dtype

    def read(c, i):
        return c.double() if scales is None else kv_fp8_dequantize(c, scales[i], kv_dtype).double()

    t_all, h, e = q_THE.shape
    s, g = k_cache.shape[1], k_cache.shape[2]
    if compressed is not None:
        check_compressed_entries("paged_attention_reference", compressed, positions_T)
    out = q_THE.new_zeros((t_all, h, e))
    for t in range(t_all):
        p = int(positions_T[t])
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        idx = torch.arange(lo, p + 1, device=q_THE.device)
        blk = block_table_BN[int(seq_idx_T[t])].long()[idx // s]
        k = read(k_cache[blk, idx % s], 0).repeat_interleave(h // g, dim=1)  # [P, H, E]
        v = read(v_cache[blk, idx % s], 1).repeat_interleave(h // g, dim=1)
        if compressed is not None:
            ids = compressed.entries_TK[t].long()
            ids = ids[ids >= 0]
            sc_pages = compressed.cache.shape[1]
            cblk = compressed.block_table_BN[int(seq_idx_T[t])].long()[ids // sc_pages]
            c = compressed.cache[cblk, ids % sc_pages].double().repeat_interleave(h // g, dim=1)  # [K', H, E]
            k, v = torch.cat([k, c]), torch.cat([v, c])
        sc = torch.einsum("he,phe->hp", q_THE[t].double(), k) * scale
        probs = softmax_with_sink(sc, None if sink is None else sink.double())
        out[t] = torch.einsum("hp,phe->he", probs, v).to(q_THE.dtype)
    return out


def dense_compressed_attention_reference(q_THE: torch.Tensor, k_TGE: torch.Tensor, v_TGE: torch.Tensor,
                                         comp_CGE: torch.Tensor, entries_TK: torch.Tensor, scale: float,
                                         sliding_window: int, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle for ONE sequence of DeepSeek-V4 compressed attention, in fp64, no cache.

    Token i attends keys ``max(0, i-W+1)..i`` (K/V) and then the compressed entries
    ``comp_CGE[entries_TK[i, k]]`` for each ``entries_TK[i, k] >= 0`` (K = V), in one softmax
    with the same ``scale``, plus the sink's column (:func:`softmax_with_sink`). Plain torch,
    differentiable in q, k, v, ``comp_CGE`` and ``sink`` (transformers ``DeepseekV4Attention``:
    ``kv = cat([window kv, compressed kv])``, the compressor's block bias masking the
    entries a query may not see).

    Args:
        q_THE: ``[T, H, E]``; k_TGE, v_TGE: ``[T, G, E]``; comp_CGE: ``[C, G, E]`` the
            sequence's compressed entries (entry j = row j); entries_TK: int ``[T, K]``, -1 = none.
        sliding_window: W >= 1; sink: ``[H]`` or ``None``.

    Returns:
        ``[T, H, E]`` fp64.

    Raises:
        ValueError: an id ``>= C`` (this oracle does not check causality; the tests pass
            causal lists).
    """
    t, h, e = q_THE.shape
    g = k_TGE.shape[1]
    ent = entries_TK.long()
    if ent.numel() and int(ent.max()) >= comp_CGE.shape[0]:
        raise ValueError(f"dense_compressed_attention_reference: entry id {int(ent.max())} >= "
                         f"{comp_CGE.shape[0]} entries")
    q = q_THE.double()
    k = k_TGE.double().repeat_interleave(h // g, dim=1)
    v = v_TGE.double().repeat_interleave(h // g, dim=1)
    c = comp_CGE.double().repeat_interleave(h // g, dim=1)[ent.clamp(min=0)]  # [T, K, H, E]
    sw = torch.einsum("the,she->hts", q, k) * scale
    sw = sw.masked_fill(~causal_mask(t, sliding_window, q.device), float("-inf"))
    scmp = torch.einsum("the,tkhe->htk", q, c) * scale
    scmp = scmp.masked_fill((ent < 0).unsqueeze(0), float("-inf"))
    probs = softmax_with_sink(torch.cat([sw, scmp], dim=-1), None if sink is None else sink.double())
    return torch.einsum("hts,she->the", probs[..., :t], v) + torch.einsum("htk,tkhe->the", probs[..., t:], c)


def read_kv_cache_reference(cache: torch.Tensor, slots_X: torch.Tensor) -> torch.Tensor:
    """Oracle of :func:`ops.read_kv_cache`: row x is ``cache[slot // S, slot % S]`` (``[G, E]``),
    a zero row for ``slot < 0``; one Python loop, no gather tricks."""
    s = cache.shape[1]
    out = cache.new_zeros((slots_X.shape[0], *cache.shape[2:]))
    for x, sl in enumerate(slots_X.tolist()):
        if sl >= 0:
            out[x] = cache[sl // s, sl % s]
    return out
