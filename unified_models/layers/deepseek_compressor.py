"""The compressor and the lightning indexer of DeepSeek-V4's compressed attention layer types
(CSA, HCA): engine steps over the ops, and their plain-torch oracles.

The math (transformers 5.19 ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` /
``DeepseekV4Indexer``), per token t at position p, for a compressor of head width d (E for
the main compressor, I for the indexer's), ratio m and width factor c (2 CSA, 1 HCA):

1. ``kv_t = wkv x_t``, ``score_t = wgate x_t + ape[p % m]``, both ``[c*d]``;
2. entry i (tokens ``m*i .. m*i+m-1``) is complete when the token at ``p = m*i+m-1`` is
   computed; its candidates, in this order: CSA first the m tokens of block i-1 with
   channels ``[:d]`` (block -1: kv 0, score -inf), then the m tokens of block i with
   channels ``[d:]``; HCA the m tokens of block i;
3. ``pooled = sum_n softmax_n(score)[per channel] * kv``, RMS-normed with the
   compressor's ``norm`` weight (eps ``rms_norm_eps``), then the layer's interleaved RoPE
   (the ``"compress"`` rope) on the last R dims at position ``m*i``;
4. causality: a token at p attends entry j only if ``j < (p+1) // m``; HCA attends all
   of them, CSA the indexer's top ``index_topk`` by ``score[t, j] = sum_h relu(q_I[t,h] .
   k_j) * I^-0.5 * w[t,h]`` with ``q_I = rope(indexer.wq_b c_q)`` (c_q the layer's query
   latent), ``w = weights_proj x * Hi^-0.5`` and ``k_j`` the indexer compressor's entries.

Engine steps (one code path for prefill, chunked prefill, decode and the trainer): every
step writes its tokens' fp32 ``kv | score`` rows ``[T, 1, 2*c*d]`` into the layer's rows
cache (a shared-K=V sliding-window ``PagedKVCache`` of window c*m, fp32), then for every
entry completed in this step gathers its candidates' rows back from that cache
(``ops.read_kv_cache``: rows of earlier steps and of this one alike), pools them
(``ops.compress_pool``), rounds once to the model dtype, norms (``ops.rms_norm``), ropes
(``ops.apply_rope``) and writes the entry into its entry cache at ``state.entry_slots``
(``ops.write_kv_cache``). An unfinished block is only rows: never attended.

Precision (what the bits need): the two linears give fp32 rows directly (``out_dtype=fp32``:
no rounding between the GEMM's fp32 accumulator and the pool, as vLLM's compressor keeps
fp32 state rows); ``ape`` is fp32 and added in fp32; the pool is fp32; the pooled vector is
rounded once to the model dtype before the norm (the norm's input dtype, as transformers'
compressor feeds its norm the kv dtype); the norm and the RoPE round once each, as the
layer's own K = V. Indexer: its query is the model dtype (``wq_b`` then RoPE), its head
weights are fp32 straight from the linear, scaled in fp32.

Gradients: the rows are written with their graphs (the write tape), read back through
``ops.read_kv_cache``, pooled by the differentiable ``ops.compress_pool``, and the entry's
write is taped too, so the attention's loss reaches ``compressor.{wkv, wgate, ape, norm}``.
The indexer runs under ``torch.no_grad`` on detached inputs (its top-k is discrete; its
parameters are declared untrained).

Shapes: T tokens, B sequences, E entries completed this step, N candidates per entry
(2m CSA, m HCA), d compressor width, c width factor, Hi indexer heads, I indexer head dim,
K entries attended per token.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..dsl import DeepseekV4AttentionSpec
from ..state import AttentionState, FlatBatch, entry_slots
from .common import LayerContext
from .oracle import linear_oracle, rms_norm_oracle
from .weight_formats import apply_linear

ROWS = "compressor_rows"
ENTRIES = "compressed_kv"
INDEXER_ROWS = "indexer_rows"
INDEXER_KEYS = "indexer_keys"


def _width(spec: DeepseekV4AttentionSpec, indexer: bool) -> tuple[int, int]:
    """``(d, c)`` of the main compressor or of the indexer's."""
    return (spec.index_head_dim, 2) if indexer else (spec.head_dim, spec.coff)


def completing_rows(positions_T: torch.Tensor, real_T: torch.Tensor, ratio: int, num_seqs: int) -> torch.Tensor:
    """Row indices ``[E]`` of the tokens that complete an entry (``(p + 1) % m == 0``), in row
    order, padded with rows that do not complete one; ``E = min(T, T // m + B)`` bounds
    their number for any packing (each sequence's run of consecutive positions completes at
    most ``len // m + 1``), a shape that depends only on T and B (no device sync)."""
    t = positions_T.shape[0]
    done = real_T & ((positions_T + 1) % ratio == 0)
    e = min(t, t // ratio + num_seqs)
    return torch.argsort((~done).to(torch.int8), stable=True)[:e]


def _row_slots(state: AttentionState, seq_E: torch.Tensor, pos_EN: torch.Tensor) -> torch.Tensor:
    """Slot ``block * S + offset`` of position ``pos_EN`` of sequence ``seq_E`` in the rows
    cache's group (positions < 0: -1, read as zero rows)."""
    s = state.group.block_size
    p = pos_EN.clamp(min=0)
    blk = state.block_table[seq_E.long()].long().gather(1, p // s)
    return torch.where(pos_EN >= 0, blk * s + p % s, torch.full_like(p, -1))


def compress_step(spec: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                  batch: FlatBatch, rows: AttentionState, entries: AttentionState, ctx: LayerContext,
                  rope, indexer: bool = False, quantize_kv=None) -> None:
    """Steps 1-3 of the module docstring for this step's tokens: write their rows, then pool,
    norm, rope and write every entry they complete (in place; nothing returned).

    Args:
        spec: a compressed layer's spec; ``indexer``: the indexer's compressor (CSA).
        params: HF name -> tensor (``compressor.*`` / ``indexer.compressor.*``).
        x_TD: ``[T, D]`` the layer's (normed) input, model dtype.
        batch: the flat batch.
        rows: the rows cache (``[N, S, 1, 2*c*d]`` fp32) with its group's tables.
        entries: the entry cache (``[N, S // m, 1, d]``, model dtype) with its group's tables.
        ctx: the layer context (model dtype, weight formats).
        rope: ``rope(x_EHd, positions_E) -> x_EHd``, the layer's interleaved RoPE on the last R dims.
        quantize_kv: ``x -> x``, the layer's KV rule applied to the main compressor's entries
            before they are written (FP8 KV); None = none. Not applied to the indexer's keys.
    """
    d, c = _width(spec, indexer)
    m, pfx, dt = spec.compress_ratio, spec.compressor_prefix(indexer), x_TD.dtype
    t, pos, seq = x_TD.shape[0], batch.positions.long(), batch.seq_idx.long()
    kv_TC = apply_linear(ctx.model, params, f"{pfx}.wkv", x_TD, out_dtype=torch.float32)
    sc_TC = apply_linear(ctx.model, params, f"{pfx}.wgate", x_TD, out_dtype=torch.float32)
    # a table lookup through ops.embedding: its backward sums repeated rows in a fixed order (t[idx]'s
    # CPU backward adds with atomics at this size: tests/ops/test_backward_determinism.py)
    sc_TC = sc_TC + ops.embedding(pos.clamp(min=0) % m, params[f"{pfx}.ape"].float())
    row_T1R = torch.cat([kv_TC, sc_TC], dim=-1).view(t, 1, 2 * c * d)
    ops.write_kv_cache(row_T1R, row_T1R, rows.k_cache, rows.k_cache, rows.slot_mapping)
    if t == 0:
        return
    idx_E = completing_rows(pos, rows.slot_mapping >= 0, m, rows.block_table.shape[0])
    p_E, seq_E = pos[idx_E], seq[idx_E]
    done_E = ((p_E + 1) % m == 0) & (rows.slot_mapping[idx_E] >= 0)
    first_E = p_E - (m - 1)  # first token of the entry: m*i
    n = c * m
    cand_EN = first_E[:, None] - (c - 1) * m + torch.arange(n, device=pos.device)[None, :]
    slots = _row_slots(rows, seq_E, cand_EN)
    slots = torch.where(done_E[:, None], slots, torch.full_like(slots, -1))
    r_ENR = ops.read_kv_cache(rows.k_cache, slots.view(-1)).view(idx_E.shape[0], n, 2 * c * d)
    kv_all, sc_all = r_ENR[..., :c * d], r_ENR[..., c * d:]
    if c == 2:  # block i-1's channels [:d], then block i's [d:]
        kv_ENd = torch.cat([kv_all[:, :m, :d], kv_all[:, m:, d:]], dim=1)
        sc_ENd = torch.cat([sc_all[:, :m, :d], sc_all[:, m:, d:]], dim=1)
    else:
        kv_ENd, sc_ENd = kv_all, sc_all
    before = (cand_EN < 0)[..., None]  # block -1 of entry 0 (CSA): kv 0, score -inf
    kv_ENd = torch.where(before, torch.zeros_like(kv_ENd), kv_ENd)
    sc_ENd = torch.where(before, torch.full_like(sc_ENd, float("-inf")), sc_ENd)
    pooled_Ed = ops.compress_pool(kv_ENd.contiguous(), sc_ENd.contiguous())
    normed_Ed = ops.rms_norm(pooled_Ed.to(dt), params[f"{pfx}.norm.weight"], spec.rms_norm_eps, out_dtype=dt)
    entry_E1d = rope(normed_Ed.view(-1, 1, d), first_E.clamp(min=0))
    if quantize_kv is not None and not indexer:
        entry_E1d = quantize_kv(entry_E1d)
    slot_E = entry_slots(entries.block_table, seq_E, torch.where(done_E, p_E, torch.full_like(p_E, -1)), m,
                         entries.group.block_size)
    ops.write_kv_cache(entry_E1d, entry_E1d, entries.k_cache, entries.k_cache, slot_E)


def entry_width(batch: FlatBatch, ratio: int, ctx: LayerContext) -> int:
    """K of the HCA entry lists: the batch's largest ``(p + 1) // m`` (a host read), or under
    CUDA-graph capture ``max_position_embeddings // m`` (a static bound; trailing -1 entries
    change no bit of the attention)."""
    pos = batch.positions
    if pos.numel() == 0:
        return 0
    if pos.is_cuda and torch.cuda.is_current_stream_capturing():
        return ctx.max_positions // ratio
    return (int(pos.max()) + 1) // ratio


def hca_entries(batch: FlatBatch, ratio: int, width: int) -> torch.Tensor:
    """int32 ``[T, width]``: every entry ``j < (p + 1) // m`` of each token, descending, then -1."""
    n_T = ((batch.positions.long() + 1) // ratio).clamp(min=0)
    j = n_T[:, None] - 1 - torch.arange(width, device=n_T.device)[None, :]
    return torch.where(j >= 0, j, torch.full_like(j, -1)).to(torch.int32)


def indexer_entries(spec: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                    c_TQ: torch.Tensor, batch: FlatBatch, keys: AttentionState, ctx: LayerContext,
                    rope) -> torch.Tensor:
    """int32 ``[T, index_topk]``: the lightning indexer's picks (step 4), descending, then -1.

    Runs without gradients on detached ``x_TD`` and ``c_TQ`` (the query latent).
    """
    t, hi, i = x_TD.shape[0], spec.index_n_heads, spec.index_head_dim
    with torch.no_grad():
        x, c = x_TD.detach(), c_TQ.detach()
        q_THI = rope(apply_linear(ctx.model, params, f"{spec.name}.indexer.wq_b", c).view(t, hi, i), batch.positions)
        w_TH = apply_linear(ctx.model, params, f"{spec.name}.indexer.weights_proj", x, out_dtype=torch.float32)
        w_TH = w_TH * spec.index_weights_scale
        return ops.indexer_topk(q_THI, w_TH, keys.k_cache, keys.block_table, batch.seq_idx, batch.positions,
                                spec.compress_ratio, spec.index_topk, spec.index_softmax_scale)


# ----------------------------------------------------------------------------- oracles (one sequence, dense)

def compressor_oracle(spec: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                      rope, indexer: bool = False, quantize_kv=None) -> torch.Tensor:
    """Steps 1-3 in plain torch for ONE sequence from position 0 (transformers' stateless
    single-shot compressor): ``[T // m, d]`` entries, in ``x_TD.dtype``.

    ``rope(x_EHd, positions_E)``: the layer's RoPE oracle; ``quantize_kv``: the layer's KV rule
    on the main compressor's entries (None = none), as :func:`compress_step`."""
    d, c = _width(spec, indexer)
    m, pfx = spec.compress_ratio, spec.compressor_prefix(indexer)
    t = x_TD.shape[0]
    n_win = t // m
    kv = linear_oracle(x_TD[:n_win * m], params, f"{pfx}.wkv", False).view(n_win, m, c * d)
    sc = linear_oracle(x_TD[:n_win * m], params, f"{pfx}.wgate", False).view(n_win, m, c * d)
    sc = sc + params[f"{pfx}.ape"].to(sc.dtype)
    if c == 2:  # transformers' new_kv / new_gate: [Ca of window w-1 | Cb of window w]
        kv_prev = torch.cat([torch.zeros_like(kv[:1, :, :d]), kv[:-1, :, :d]], dim=0)
        sc_prev = torch.cat([torch.full_like(sc[:1, :, :d], float("-inf")), sc[:-1, :, :d]], dim=0)
        kv = torch.cat([kv_prev, kv[..., d:]], dim=1)
        sc = torch.cat([sc_prev, sc[..., d:]], dim=1)
    pooled = (kv * sc.softmax(dim=1)).sum(dim=1)
    normed = rms_norm_oracle(pooled, params[f"{pfx}.norm.weight"], spec.rms_norm_eps)
    out = rope(normed.view(n_win, 1, d), torch.arange(n_win, device=x_TD.device) * m)[:, 0]
    return quantize_kv(out) if quantize_kv is not None and not indexer else out


def indexer_scores_oracle(spec: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                          c_TQ: torch.Tensor, keys_Jd: torch.Tensor, rope) -> torch.Tensor:
    """The indexer's scores ``[T, J]`` for ONE sequence from position 0 in ``x_TD.dtype``, ``-inf`` where
    an entry is not causal yet (transformers' ``DeepseekV4Indexer`` + ``DeepseekV4IndexerScorer``)."""
    t, hi, i, m = x_TD.shape[0], spec.index_n_heads, spec.index_head_dim, spec.compress_ratio
    pos = torch.arange(t, device=x_TD.device)
    q = rope(linear_oracle(c_TQ, params, f"{spec.name}.indexer.wq_b", False).view(t, hi, i), pos)
    w = linear_oracle(x_TD, params, f"{spec.name}.indexer.weights_proj", False) * spec.index_weights_scale
    score = (torch.relu(torch.einsum("thi,ji->thj", q, keys_Jd)) * spec.index_softmax_scale * w[..., None]).sum(1)
    j = torch.arange(keys_Jd.shape[0], device=x_TD.device)
    causal = j[None, :] < ((pos + 1) // m)[:, None]
    return score.masked_fill(~causal, float("-inf"))


def indexer_oracle(spec: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                   c_TQ: torch.Tensor, keys_Jd: torch.Tensor, rope) -> torch.Tensor:
    """Step 4 in plain torch for ONE sequence from position 0: bool ``[T, J]``, the entries
    each token attends (the top ``index_topk`` of its causal entries as a set;
    :func:`indexer_scores_oracle`). Ties (frequent: a score is 0 when
    every head's ``relu`` is 0) go to the larger j, the total order of ``ops.indexer_topk``
    (DESIGN rule 4); transformers' ``torch.topk`` leaves them unspecified."""
    score = indexer_scores_oracle(spec, params, x_TD, c_TQ, keys_Jd, rope)
    causal = torch.isfinite(score)
    k = min(spec.index_topk, keys_Jd.shape[0])
    chosen = torch.zeros_like(causal)
    if k:  # the total order (score desc, then j desc): a stable sort of the j-descending order
        order = torch.argsort(score.flip(-1), dim=-1, descending=True, stable=True)[:, :k]
        chosen.scatter_(1, keys_Jd.shape[0] - 1 - order, True)
    return chosen & causal
