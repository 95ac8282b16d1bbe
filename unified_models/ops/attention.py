"""Causal GQA attention over a paged KV cache, and the KV-cache write.

One kernel for prefill, decode and training (DESIGN.md rule 3): a token at
position ``p`` of its sequence reads positions ``0..p`` through the block
table, in KV tiles aligned at absolute position 0, in increasing order, with an
fp32 online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao 2022).
Tiles past a token's own position are fully masked for it, which leaves the
online-softmax state bit-for-bit unchanged (``alpha = 1``, ``p = 0``), so
neighbours never change a token's bits. The Triton path (``triton/attention.py``)
also runs the KV range in splits of fixed absolute positions (``SPLIT_KV``),
each from a fresh state, merged in increasing order by a second kernel.

Cache layout: ``k_cache``/``v_cache`` are ``[N, S, G, E]`` views with any strides
(N blocks, S positions per block, G kv heads, E head dim); slot = block*S + offset.

FP8 KV cache (``float8_e4m3fn`` caches, static per-tensor fp32 scales
``k_scale``/``v_scale``; vLLM's ``kv_cache_dtype="fp8"``, whose CUDA cache write
``reshape_and_cache_flash`` computes ``cvt_satfinite_rn(x / scale)``). One rule
for both engines, in every implementation (Triton kernels on GPU and through
the interpreter, the CPU torch implementation, the fp64 references):

* write: ``code = e4m3(clamp(fp32(k) / k_scale, -448, 448))`` with an exactly
  rounded IEEE division, rounded to nearest, ties to even (subnormals kept,
  the sign of zero kept, NaN -> the NaN code with the input's sign);
* read: ``k = q.dtype(fp32(e4m3 value) * k_scale)`` (the fp32 product rounded
  once to fp32, then to the query dtype), the same for V, after which the
  attention math is that of a model-dtype cache.

:func:`kv_fp8_quantize` / :func:`kv_fp8_dequantize` are the torch form of the
two halves; the trainer's backward uses their composition
(:func:`kv_fp8_roundtrip`) as the forward value and passes gradients straight
through it.
"""

from __future__ import annotations

import math

import torch

from ._dispatch import ROW_TILE, pad_rows, use_triton

KV_TILE_CPU = 16
"""KV positions per online-softmax step in the CPU implementation."""

KV_FP8_DTYPE = torch.float8_e4m3fn
"""Element type of an FP8 KV cache (vLLM allocates uint8; engines view it as this)."""

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: the write saturates to +-448."""


def kv_cache_is_fp8(cache: torch.Tensor) -> bool:
    """True for a float8_e4m3fn cache (which needs ``k_scale``/``v_scale``)."""
    return cache.dtype == KV_FP8_DTYPE


def check_kv_scales(what: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate the KV-cache scales against the cache dtype.

    Returns:
        ``(k_scale, v_scale)`` as 0-d fp32 tensors for a float8_e4m3fn cache,
        ``None`` for a model-dtype cache.

    Raises:
        ValueError: an FP8 cache without both scales, scales for a
            model-dtype cache, K and V caches of different dtypes, a scale that
            is not a one-element fp32 tensor on the cache's device, or (scales
            on the CPU) a scale that is zero, negative, NaN or Inf. On CUDA the
            values are not read here (no device sync per layer); the engines'
            loaders refuse such checkpoints.
    """
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{what}: k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not kv_cache_is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{what}: k_scale/v_scale are only used with a float8_e4m3fn KV cache; "
                             f"this cache is {k_cache.dtype}")
        return None
    out = []
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"{what}: a float8_e4m3fn KV cache needs k_scale and v_scale (fp32 scalars); "
                             f"{name} is missing")
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or sc.numel() != 1:
            desc = f"{tuple(sc.shape)} {sc.dtype}" if isinstance(sc, torch.Tensor) else type(sc).__name__
            raise ValueError(f"{what}: {name} must be a one-element fp32 tensor (shape [] or [1]), got {desc}")
        if sc.device != k_cache.device:
            raise ValueError(f"{what}: {name} is on {sc.device}, the cache on {k_cache.device}")
        if sc.device.type == "cpu":
            val = float(sc.reshape(()))
            if not (math.isfinite(val) and val > 0):
                raise ValueError(f"{what}: {name}={val} must be finite and > 0")
        out.append(sc.reshape(()))
    return out[0], out[1]


def kv_fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 KV write rule in torch: ``e4m3(clamp(fp32(x) / scale, -448, 448))``.

    Args:
        x: any float tensor (K or V rows).
        scale: 0-d fp32 (> 0).

    Returns:
        float8_e4m3fn tensor of ``x``'s shape (IEEE division, RNE; NaN stays NaN).
    """
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(KV_FP8_DTYPE)


def kv_fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 KV read rule in torch: ``dtype(fp32(codes) * scale)``."""
    return (codes.float() * scale).to(dtype)


def kv_fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the attention reads back after writing ``x`` into an FP8 cache (no gradient rule)."""
    return kv_fp8_dequantize(kv_fp8_quantize(x, scale), scale, dtype)


def _check(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T):
    if q_THE.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"attention: q {tuple(q_THE.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)} must be [T,H,E] and two equal [N,S,G,E]")
    h, g = q_THE.shape[1], k_cache.shape[2]
    if h % g or q_THE.shape[2] != k_cache.shape[3]:
        raise ValueError(f"attention: {h} q heads / {g} kv heads or head dims {q_THE.shape[2]} vs {k_cache.shape[3]} mismatch")
    if block_table_BN.dim() != 2 or seq_idx_T.shape != positions_T.shape or seq_idx_T.shape[0] != q_THE.shape[0]:
        raise ValueError("attention: block_table must be [B, max_blocks]; seq_idx and positions must be [T]")


def write_kv_cache(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping_T: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Write this step's K/V rows into the paged cache (in place).

    Args:
        k_TGE, v_TGE: ``[T, G, E]`` new keys/values.
        k_cache, v_cache: ``[N, S, G, E]`` cache views (any strides); model
            dtype (an exact cast) or float8_e4m3fn (the FP8 write rule of the
            module docstring).
        slot_mapping_T: int ``[T]``, ``block * S + offset``; ``< 0`` = padding, skipped.
        k_scale, v_scale: fp32 ``[]`` scales, required for (and only for) an FP8 cache.

    Raises:
        ValueError: shape mismatch; missing, superfluous or bad scales
            (:func:`check_kv_scales`).
    """
    if k_TGE.shape != v_TGE.shape or k_TGE.shape[1:] != k_cache.shape[2:] or slot_mapping_T.shape[0] != k_TGE.shape[0]:
        raise ValueError(f"write_kv_cache: k {tuple(k_TGE.shape)} does not fit cache {tuple(k_cache.shape)}")
    scales = check_kv_scales("write_kv_cache", k_cache, v_cache, k_scale, v_scale)
    ks, vs = scales if scales is not None else (None, None)
    if use_triton(k_cache):
        from .triton.attention import write_kv_cache_triton

        return write_kv_cache_triton(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, ks, vs)
    return write_kv_cache_torch(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, ks, vs)


def write_kv_cache_torch(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale=None, v_scale=None) -> None:
    """CPU: an indexed copy (exact), or for an FP8 cache :func:`kv_fp8_quantize` then the copy."""
    scales = check_kv_scales("write_kv_cache_torch", k_cache, v_cache, k_scale, v_scale)
    s = k_cache.shape[1]
    keep = slot_mapping_T >= 0
    slots = slot_mapping_T[keep].long()
    blk, off = slots // s, slots % s
    if scales is not None:
        k_cache[blk, off] = kv_fp8_quantize(k_TGE[keep], scales[0])
        v_cache[blk, off] = kv_fp8_quantize(v_TGE[keep], scales[1])
        return
    k_cache[blk, off] = k_TGE[keep].to(k_cache.dtype)
    v_cache[blk, off] = v_TGE[keep].to(v_cache.dtype)


def paged_attention(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each token over its own sequence's cached K/V.

    Args:
        q_THE: ``[T, H, E]`` queries.
        k_cache, v_cache: ``[N, S, G, E]`` paged cache holding positions ``0..p``
            (model dtype, or float8_e4m3fn read through the FP8 read rule).
        block_table_BN: int32 ``[B, max_blocks]``; row ``b`` lists sequence b's blocks.
        seq_idx_T: int ``[T]``, block-table row of each token.
        positions_T: int ``[T]``, position of each token in its own sequence.
        scale: softmax scale (``head_dim ** -0.5`` for Nemotron-H).
        k_scale, v_scale: fp32 ``[]`` KV-cache scales, required for (and only
            for) an FP8 cache.

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype``; row t depends only on q[t] and its
        sequence's cache up to ``positions_T[t]``.

    Raises:
        ValueError: shape mismatch; missing, superfluous or bad scales; on CPU
            also a block size S that is not a multiple of the CPU KV tile (16).
            The Triton kernel takes any S.
    """
    _check(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T)
    scales = check_kv_scales("paged_attention", k_cache, v_cache, k_scale, v_scale)
    ks, vs = scales if scales is not None else (None, None)
    if use_triton(q_THE):
        from .triton.attention import paged_attention_triton

        return paged_attention_triton(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, ks, vs)
    return paged_attention_torch(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale, ks, vs)


def paged_attention_torch(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                          k_scale=None, v_scale=None) -> torch.Tensor:
    """CPU implementation: 16-token query tiles x 16-position KV tiles, fixed shapes.

    Each torch call has a shape fixed by the model (16 tokens, G, H/G, E, 16
    positions), so its kernel and thread partition never depend on the batch.
    No result depends on the host's BLAS either: scores are exact fp64 dot
    products of the bf16/fp16 operands rounded once to fp32 (exact while the
    products of one score span fewer than ``53 - 22 - ceil(log2 E)`` binary
    orders), and ``P @ V`` and the row sum of ``P`` are accumulated
    elementwise in fp64 in position order, then rounded once to fp32. An FP8
    cache is read through :func:`kv_fp8_dequantize` to ``q``'s dtype first.
    """
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
    outs = []
    for i in range(0, q_pad.shape[0], ROW_TILE):
        qd = q_pad[i:i + ROW_TILE].double().view(ROW_TILE, g, r, e)
        pos = torch.where(valid_row[i:i + ROW_TILE], pos_pad[i:i + ROW_TILE], -1)
        rows = block_table_BN[sidx_pad[i:i + ROW_TILE]].long()  # [16, nb]
        m = torch.full((ROW_TILE, g, r), float("-inf"), device=q_THE.device)
        l = torch.zeros((ROW_TILE, g, r), device=q_THE.device)
        acc = torch.zeros((ROW_TILE, g, r, e), device=q_THE.device)
        n_tiles = int(pos.max().item()) // kv + 1 if bool(valid_row[i:i + ROW_TILE].any()) else 0
        for j in range(n_tiles):
            p = j * kv + ar  # [KV] absolute positions
            valid = p.view(1, kv) <= pos.view(ROW_TILE, 1)  # [16, KV]
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
        l_safe = torch.where(l > 0, l, torch.ones_like(l))
        outs.append((acc / l_safe.unsqueeze(-1)).view(ROW_TILE, h, e))
    if not outs:
        return q_THE.new_zeros((0, h, e))
    return torch.cat(outs)[:t_all].to(q_THE.dtype)


def dense_causal_attention_reference(q_THE: torch.Tensor, k_TGE: torch.Tensor, v_TGE: torch.Tensor,
                                     scale: float) -> torch.Tensor:
    """Oracle for ONE sequence: full causal softmax attention in fp64, no cache.

    Args:
        q_THE: ``[T, H, E]``; k_TGE, v_TGE: ``[T, G, E]`` of the same sequence.

    Returns:
        ``[T, H, E]`` in ``q_THE.dtype``.
    """
    t, h, e = q_THE.shape
    g = k_TGE.shape[1]
    q = q_THE.double()
    k = k_TGE.double().repeat_interleave(h // g, dim=1)
    v = v_TGE.double().repeat_interleave(h // g, dim=1)
    sc = torch.einsum("the,she->hts", q, k) * scale
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    sc = sc.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hts,she->the", torch.softmax(sc, dim=-1), v)
    return out.to(q_THE.dtype)


def paged_attention_reference(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                              k_scale=None, v_scale=None, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle over the paged cache: per token, gather its prefix and do fp64 softmax.

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
        idx = torch.arange(p + 1, device=q_THE.device)
        blk = block_table_BN[int(seq_idx_T[t])].long()[idx // s]
        k = read(k_cache[blk, idx % s], 0).repeat_interleave(h // g, dim=1)  # [P, H, E]
        v = read(v_cache[blk, idx % s], 1).repeat_interleave(h // g, dim=1)
        sc = torch.einsum("he,phe->hp", q_THE[t].double(), k) * scale
        out[t] = torch.einsum("hp,phe->he", torch.softmax(sc, dim=-1), v).to(q_THE.dtype)
    return out
