"""fp64 oracles of attention: dense causal attention of one sequence, and per-token
attention over the paged cache."""

from __future__ import annotations

import torch

from .common import check_kv_scales, kv_fp8_dequantize


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
                              sliding_window: int | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle over the paged cache: per token, gather its window (positions
    ``max(0, p-W+1)..p``; the whole prefix without a window) and do fp64 softmax
    (with ``sink [H]``: :func:`softmax_with_sink`).

    An FP8 cache is dequantized by the read rule to ``kv_dtype`` (default
    ``q``'s dtype; pass the model dtype when ``q`` is given in fp64).
    """
    scales = check_kv_scales("paged_attention_reference", k_cache, v_cache, k_scale, v_scale)
    kv_dtype = kv_dtype or q_THE.dtype

    def read(c, i):
        return c.double() if scales is None else kv_fp8_dequantize(c, scales[i], kv_dtype).double()

    t_all, h, e = q_THE.shape
    s, g = k_cache.shape[1], k_cache.shape[2]
    out = q_THE.new_zeros((t_all, h, e))
    for t in range(t_all):
        p = int(positions_T[t])
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        idx = torch.arange(lo, p + 1, device=q_THE.device)
        blk = block_table_BN[int(seq_idx_T[t])].long()[idx // s]
        k = read(k_cache[blk, idx % s], 0).repeat_interleave(h // g, dim=1)  # [P, H, E]
        v = read(v_cache[blk, idx % s], 1).repeat_interleave(h // g, dim=1)
        sc = torch.einsum("he,phe->hp", q_THE[t].double(), k) * scale
        probs = softmax_with_sink(sc, None if sink is None else sink.double())
        out[t] = torch.einsum("hp,phe->he", probs, v).to(q_THE.dtype)
    return out
