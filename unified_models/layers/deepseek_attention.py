"""Forward of :class:`~unified_models.dsl.DeepseekV4AttentionSpec`: shared K = V multi-query
attention over a sliding-window paged cache with a learned sink, and (CSA / HCA layer types)
the compressed entries of :mod:`.deepseek_compressor` after the window.

The math, step by step as transformers 5.19's ``DeepseekV4Attention.forward``:

1. query: ``c = q_norm(wq_a x)`` (RMSNorm with weight), ``q = wq_b c`` viewed ``[T, H, E]``,
   then ``q *= rsqrt(mean_E(q^2) + eps)`` per head (``q_b_norm``, no weight);
2. key = value: ``kv = norm(wkv x)`` ``[T, 1, E]`` (RMSNorm with weight);
3. RoPE on the last R dims of q and kv, interleaved pairs ``(2i, 2i+1)`` with angle
   ``p * inv_freq_i`` (``apply_rotary_pos_emb``); the first E - R dims pass. Sliding
   layers: ``inv_freq_i = theta^(-2i/R)`` (``rope_parameters["main"]``); compressed layers
   the ``"compress"`` rope (theta ``compress_rope_theta``, YaRN frequencies when
   ``rope_type="yarn"``) for q, kv, the entries and the indexer alike;
4. attention of each token over positions ``p-W+1..p`` of its own sequence with V = K,
   then (compressed types) over the compressed entries it may see (HCA: every complete
   entry ``j < (p+1)//m``; CSA: the indexer's top-k of them), one softmax, scale
   ``E^-0.5``, and the sink logit of each head as an extra softmax column without a value
   (``eager_attention_forward``: scores ``cat`` sinks, softmax, drop the column);
5. de-rotation: RoPE at the query's position with ``-sin`` on the last R dims of the
   output (V carried K's rotation);
6. grouped low-rank output: heads in g groups of ``H*E/g``, group j times its block of
   ``wo_a`` rows ``[j*r, (j+1)*r)`` (``DeepseekV4GroupedLinear``), concatenated
   ``[T, g*r]``, then ``wo_b``.

Engine forward over the batch-invariant ops: every linear is ``ops.linear`` (``wq_a``,
``wq_b``, ``wkv``, ``wo_b`` through :func:`.weight_formats.apply_linear`, so they may
carry a weight format), the norms ``ops.rms_norm`` (the per-head one with a weight of
ones: ``x * r * 1`` is exact), RoPE ``ops.apply_rope`` on the de-interleaved tail (a
permutation of the channels: exact) with the fp32 tables of ``ops.rope_cos_sin`` /
``ops.rope.rope_cos_sin_yarn``, attention ``ops.paged_attention`` with ``sliding_window``,
``sink`` and (compressed types) ``compressed=ops.CompressedKV(...)`` over one shared K = V
window cache and the entry cache. Order within a step: the window K = V, then the
compressor (rows, completed entries), then the indexer (its rows and keys, then its
picks), then the attention, so a token attends the entry it completes itself.

Shapes: T tokens, D hidden, H heads, E head dim, R rope dims, Q query rank, g output
groups, r output rank, m compress ratio, J compressed entries of a sequence.
"""

from __future__ import annotations

import dataclasses

from typing import Mapping

import torch

from .. import ops
from ..caches import CompressedKVCache, IndexerKeyCache, PagedKVCache
from ..dsl import DeepseekV4AttentionSpec, SpecError
from ..ops.attention import causal_mask, softmax_with_sink
from ..ops.rope import apply_rope_reference, rope_cos_sin_yarn, yarn_inv_freq_reference
from ..state import FlatBatch, StateStore
from . import deepseek_compressor as dsc
from .common import LayerContext
from .family import LayerFamily
from .oracle import linear_oracle, near_tie_margin, rms_norm_oracle, topk_near_ties
from .quantization import QuantizationRules
from .weight_formats import apply_linear, dequantized_weight

CACHE = "swa"
"""The layer's one cache: the sliding-window K = V pages (vLLM name ``<mixer>.swa``)."""

QUANTIZABLE = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
"""The linears that may carry a weight format (block-FP8 in the published checkpoints). ``wo_a``
runs as per-group ``ops.linear`` slices of its dequantized weight (W8A16, as DeepSeek's reference
runs it: "wo_a is FP8 in checkpoint", dequantized to bf16); the compressors' ``wkv``/``wgate`` and
the indexer's ``weights_proj`` stay in the model dtype."""

QUANTIZABLE_CSA = ("indexer.wq_b",)
"""CSA only: the indexer's query projection (block-FP8 in the published checkpoints)."""


def quantizable(a: DeepseekV4AttentionSpec) -> tuple[str, ...]:
    """The short names of :data:`QUANTIZABLE` (and :data:`QUANTIZABLE_CSA` for CSA)."""
    return QUANTIZABLE + (QUANTIZABLE_CSA if a.has_indexer else ())

QUANTIZABLE_FORMATS = (None, "fp8_block")


# ----------------------------------------------------------------------------- interleaved RoPE on the tail

def to_rotate_half(x: torch.Tensor, r: int) -> torch.Tensor:
    """``[..., E]`` -> ``[..., E]``: the last ``r`` dims de-interleaved to the front
    (``[even | odd | first E - r dims]``), so the neox-layout ``ops.apply_rope`` on its
    first ``r`` dims is DeepSeek-V4's interleaved rotation of the tail. Exact (a copy)."""
    tail = x[..., x.shape[-1] - r:]
    return torch.cat([tail[..., 0::2], tail[..., 1::2], x[..., :x.shape[-1] - r]], dim=-1)


def from_rotate_half(y: torch.Tensor, r: int) -> torch.Tensor:
    """Inverse of :func:`to_rotate_half` (exact)."""
    tail = torch.stack([y[..., :r // 2], y[..., r // 2:r]], dim=-1).flatten(-2)
    return torch.cat([y[..., r:], tail], dim=-1)


_NEG_SIN: dict[tuple, torch.Tensor] = {}


def _table_key(spec: DeepseekV4AttentionSpec, ctx: LayerContext, device) -> tuple:
    y = spec.yarn
    yk = None if y is None else (float(y.factor), int(y.original_max_position_embeddings), float(y.beta_fast),
                                 float(y.beta_slow), bool(y.truncate))
    return (ctx.max_positions, spec.qk_rope_head_dim, float(spec.rope_theta), yk, str(torch.device(device)))


def _tables(spec: DeepseekV4AttentionSpec, ctx: LayerContext, device, inverse: bool):
    """fp32 ``cos, sin`` ``[P, R/2]`` of the layer's RoPE (``ops.rope_cos_sin``, or with YaRN
    ``ops.rope.rope_cos_sin_yarn``); ``inverse``: ``sin`` negated (exact; memoized per table),
    the rotation by ``-angle``."""
    y = spec.yarn
    if y is None:
        cos, sin = ops.rope_cos_sin(ctx.max_positions, spec.qk_rope_head_dim, spec.rope_theta, device)
    else:
        cos, sin = rope_cos_sin_yarn(ctx.max_positions, spec.qk_rope_head_dim, spec.rope_theta, y.factor,
                                     y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.truncate,
                                     device)
    if not inverse:
        return cos, sin
    key = _table_key(spec, ctx, sin.device)
    if key not in _NEG_SIN:
        with torch.inference_mode(False):  # memoized: the trainer may save it for backward later
            _NEG_SIN[key] = -sin
    return cos, _NEG_SIN[key]


def rope_tail(x_THE: torch.Tensor, positions_T: torch.Tensor, spec: DeepseekV4AttentionSpec, ctx: LayerContext,
              inverse: bool = False) -> torch.Tensor:
    """DeepSeek-V4's interleaved RoPE on the last R dims of every head of ``x_THE`` ``[T, H, E]``
    at ``positions_T`` (``inverse``: the opposite angle, the output de-rotation), over
    ``ops.apply_rope`` (fp32 math, one rounding to ``x_THE.dtype``)."""
    r = spec.qk_rope_head_dim
    cos, sin = _tables(spec, ctx, x_THE.device, inverse)
    return from_rotate_half(ops.apply_rope(to_rotate_half(x_THE, r), positions_T, cos, sin), r)


def rope_inv_freq_oracle(spec: DeepseekV4AttentionSpec) -> torch.Tensor | None:
    """fp64 ``[R/2]`` YaRN frequencies of a ``rope_type="yarn"`` layer (the formula in fp64), else
    ``None`` (``theta^(-2i/R)`` in :func:`~unified_models.ops.rope.apply_rope_reference`)."""
    y = spec.yarn
    if y is None:
        return None
    return yarn_inv_freq_reference(spec.qk_rope_head_dim, spec.rope_theta, y.factor,
                                   y.original_max_position_embeddings, y.beta_fast, y.beta_slow, y.truncate)


def rope_tail_oracle(x_THE: torch.Tensor, positions_T: torch.Tensor, spec: DeepseekV4AttentionSpec) -> torch.Tensor:
    """fp64 oracle of :func:`rope_tail` (negative positions = the inverse rotation), in ``x_THE.dtype``."""
    r = spec.qk_rope_head_dim
    out = apply_rope_reference(to_rotate_half(x_THE, r), positions_T, r, spec.rope_theta, rope_inv_freq_oracle(spec))
    return from_rotate_half(out, r)


# ----------------------------------------------------------------------------- FP8 KV

def kv_quantize(spec: DeepseekV4AttentionSpec, kv: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[..., E]`` (RoPE applied) through the layer's KV rule: unchanged for
    ``kv_cache_dtype="auto"``, ``ops.ds_kv_fp8_roundtrip`` (straight-through gradient) for
    ``"fp8_ds_mla"``. Applied to window vectors and main-compressor entries before they are
    written (and in the oracle at the same points), so prefill, decode and the trainer read
    the same rounded values."""
    if spec.kv_cache_dtype == "fp8_ds_mla":
        return ops.ds_kv_fp8_roundtrip(kv, spec.qk_rope_head_dim)
    return kv


# ----------------------------------------------------------------------------- forward

def _compressed_kv(spec: DeepseekV4AttentionSpec, layer_index: int, params: Mapping[str, torch.Tensor],
                   x_TD: torch.Tensor, c_TQ: torch.Tensor, batch: FlatBatch, store: StateStore,
                   ctx: LayerContext):
    """The compressor (and CSA indexer) steps of this layer for this batch, then the
    ``ops.CompressedKV`` of the entries each token attends (HCA: all it may see; CSA: the
    indexer's picks)."""
    def rope(x, pos):
        return rope_tail(x, pos, spec, ctx)

    entries = store.state(layer_index, dsc.ENTRIES)
    dsc.compress_step(spec, params, x_TD, batch, store.state(layer_index, dsc.ROWS), entries, ctx, rope,
                      quantize_kv=lambda x: kv_quantize(spec, x))
    m = spec.compress_ratio
    if spec.has_indexer:
        keys = store.state(layer_index, dsc.INDEXER_KEYS)
        dsc.compress_step(spec, params, x_TD, batch, store.state(layer_index, dsc.INDEXER_ROWS), keys, ctx, rope,
                          indexer=True)
        picks_TK = dsc.indexer_entries(spec, params, x_TD, c_TQ, batch, keys, ctx, rope)
    else:
        picks_TK = dsc.hca_entries(batch, m, dsc.entry_width(batch, m, ctx))
    return ops.CompressedKV(cache=entries.k_cache, ratio=m, entries_TK=picks_TK, block_table_BN=entries.block_table)


def deepseek_attention_forward(spec: DeepseekV4AttentionSpec, layer_index: int, params: Mapping[str, torch.Tensor],
                               x_TD: torch.Tensor, batch: FlatBatch, store: StateStore,
                               ctx: LayerContext) -> torch.Tensor:
    """Steps 1-6 of the module docstring over the ops: ``[T, D] -> [T, D]`` in ``x_TD.dtype``.

    The K = V vector of each token is written into the layer's sliding-window cache at
    ``slot_mapping`` and read back through the block table, so prefill, chunked prefill,
    decode and the trainer's recompute read the same values; compressed layer types also
    write their compressor rows and completed entries (and CSA the indexer's) first
    (:mod:`.deepseek_compressor`). In profiling runs (``store.state(layer_index, "swa")`` is
    ``None``) the attention output is zeros and nothing is written.
    """
    t, h, e, eps = x_TD.shape[0], spec.num_heads, spec.head_dim, spec.rms_norm_eps
    p, dt = spec.name, x_TD.dtype
    c_TQ = ops.rms_norm(apply_linear(ctx.model, params, f"{p}.wq_a", x_TD), params[f"{p}.q_norm.weight"], eps,
                        out_dtype=dt)
    q_TE = apply_linear(ctx.model, params, f"{p}.wq_b", c_TQ).reshape(t * h, e)
    q_THE = ops.rms_norm(q_TE, torch.ones(e, dtype=dt, device=x_TD.device), eps, out_dtype=dt).view(t, h, e)
    kv_TE = ops.rms_norm(apply_linear(ctx.model, params, f"{p}.wkv", x_TD), params[f"{p}.norm.weight"], eps,
                         out_dtype=dt)
    q_THE = rope_tail(q_THE, batch.positions, spec, ctx)
    kv_T1E = kv_quantize(spec, rope_tail(kv_TE.view(t, 1, e), batch.positions, spec, ctx))
    state = store.state(layer_index, CACHE)
    if state is None:  # profiling / dummy run: no cache bound yet
        o_THE = torch.zeros_like(q_THE)
    else:
        ops.write_kv_cache(kv_T1E, kv_T1E, state.k_cache, state.v_cache, state.slot_mapping)
        sink = params[spec.sink_name] if spec.attention_sink else None
        kw = {}
        if spec.compressed:
            kw["compressed"] = _compressed_kv(spec, layer_index, params, x_TD, c_TQ, batch, store, ctx)
        o_THE = ops.paged_attention(q_THE, state.k_cache, state.v_cache, state.block_table, batch.seq_idx,
                                    batch.positions, spec.scale, sliding_window=spec.sliding_window, sink=sink, **kw)
    o_THE = rope_tail(o_THE, batch.positions, spec, ctx, inverse=True)
    g, r = spec.o_groups, spec.o_lora_rank
    o_TgI = o_THE.reshape(t, g, h * e // g)
    wo_a = dequantized_weight(ctx.model, params, f"{p}.wo_a", dt)
    y_Tgr = torch.cat([ops.linear(o_TgI[:, j].contiguous(), wo_a[j * r:(j + 1) * r]) for j in range(g)], dim=-1)
    return apply_linear(ctx.model, params, f"{p}.wo_b", y_Tgr)


def deepseek_attention_oracle(a: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor],
                              x_TD: torch.Tensor) -> torch.Tensor:
    """Steps 1-6 in plain torch for ONE sequence from position 0, in ``x_TD.dtype`` (fp32 or
    fp64), dense attention over the window and (compressed types) the entries it attends
    (:func:`.deepseek_compressor.compressor_oracle`; CSA the indexer's set,
    :func:`.deepseek_compressor.indexer_oracle`); RoPE angles in fp64
    (``apply_rope_reference``, YaRN frequencies in fp64)."""
    t, h, e, eps = x_TD.shape[0], a.num_heads, a.head_dim, a.rms_norm_eps
    pos = torch.arange(t, device=x_TD.device)
    c = rms_norm_oracle(linear_oracle(x_TD, params, f"{a.name}.wq_a", False), params[f"{a.name}.q_norm.weight"], eps)
    q = linear_oracle(c, params, f"{a.name}.wq_b", False).view(t, h, e)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
    kv = rms_norm_oracle(linear_oracle(x_TD, params, f"{a.name}.wkv", False), params[f"{a.name}.norm.weight"], eps)
    q = rope_tail_oracle(q, pos, a)
    kv = kv_quantize(a, rope_tail_oracle(kv.view(t, 1, e), pos, a)[:, 0])
    s = torch.einsum("the,se->hts", q, kv) * a.scale
    s = s.masked_fill(~causal_mask(t, a.sliding_window, x_TD.device), float("-inf"))
    if a.compressed:
        def rope(x, p_):
            return rope_tail_oracle(x, p_, a)

        ent = dsc.compressor_oracle(a, params, x_TD, rope, quantize_kv=lambda x: kv_quantize(a, x))  # [J, E]
        j = torch.arange(ent.shape[0], device=x_TD.device)
        seen = j[None, :] < ((pos + 1) // a.compress_ratio)[:, None]  # [T, J]
        if a.has_indexer:
            keys = dsc.compressor_oracle(a, params, x_TD, rope, indexer=True)
            seen = dsc.indexer_oracle(a, params, x_TD, c, keys, rope)
        sc = (torch.einsum("the,je->htj", q, ent) * a.scale).masked_fill(~seen[None], float("-inf"))
        s, kv = torch.cat([s, sc], dim=-1), torch.cat([kv, ent], dim=0)
    probs = softmax_with_sink(s, params[a.sink_name] if a.attention_sink else None)
    o = rope_tail_oracle(torch.einsum("hts,se->the", probs, kv), -pos, a)
    g, r = a.o_groups, a.o_lora_rank
    y = torch.einsum("tgi,gri->tgr", o.reshape(t, g, -1), params[f"{a.name}.wo_a.weight"].view(g, r, -1))
    return linear_oracle(y.reshape(t, g * r), params, f"{a.name}.wo_b", False)


def deepseek_attention_near_ties(a: DeepseekV4AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                                 engine_dtype: torch.dtype) -> torch.Tensor:
    """bool ``[T]`` for ONE sequence from position 0: the tokens whose indexer top-k (CSA) is decided
    by scores within the rounding of ``engine_dtype`` (the engine's indexer queries and keys are in the
    model dtype: :func:`.oracle.topk_near_ties` of :func:`.deepseek_compressor.indexer_scores_oracle`);
    none for sliding and HCA layers, which attend without a choice."""
    if not a.has_indexer:
        return torch.zeros(x_TD.shape[0], dtype=torch.bool, device=x_TD.device)

    def rope(x, p_):
        return rope_tail_oracle(x, p_, a)

    c = rms_norm_oracle(linear_oracle(x_TD, params, f"{a.name}.wq_a", False), params[f"{a.name}.q_norm.weight"],
                        a.rms_norm_eps)
    keys = dsc.compressor_oracle(a, params, x_TD, rope, indexer=True)
    score = dsc.indexer_scores_oracle(a, params, x_TD, c, keys, rope)
    return topk_near_ties(score, min(a.index_topk, keys.shape[0]), near_tie_margin(engine_dtype))


# ----------------------------------------------------------------------------- declarations

def deepseek_attention_caches(a: DeepseekV4AttentionSpec, model_dtype: torch.dtype) -> dict:
    """The layer's caches (the vLLM specs vLLM's own DeepSeek-V4 declares):

    * ``"swa"``: one sliding-window K = V vector per token (``SlidingWindowMLASpec``);
    * compressed types: ``"compressor_rows"``, fp32 ``kv | score`` rows ``[2*c*E]`` per token
      over a window of ``c*m`` tokens (``SlidingWindowMLASpec`` fp32, as vLLM's compressor
      state cache); ``"compressed_kv"``, one entry per m tokens (``MLAAttentionSpec`` with a
      compression);
    * CSA: ``"indexer_rows"`` (``[4*I]`` fp32 rows, window 2m) and ``"indexer_keys"``
      (:class:`~unified_models.caches.IndexerKeyCache`, one key per m tokens).
    """
    out: dict = {CACHE: PagedKVCache(num_kv_heads=1, head_dim=a.head_dim, sliding_window=a.sliding_window,
                                     shared_kv=True)}
    if a.compressed:
        m, c = a.compress_ratio, a.coff
        out[dsc.ROWS] = PagedKVCache(num_kv_heads=1, head_dim=2 * c * a.head_dim, sliding_window=c * m,
                                     shared_kv=True, dtype=torch.float32)
        out[dsc.ENTRIES] = CompressedKVCache(ratio=m, head_dim=a.head_dim)
    if a.has_indexer:
        m, i = a.compress_ratio, a.index_head_dim
        out[dsc.INDEXER_ROWS] = PagedKVCache(num_kv_heads=1, head_dim=4 * i, sliding_window=2 * m, shared_kv=True,
                                             dtype=torch.float32)
        out[dsc.INDEXER_KEYS] = IndexerKeyCache(ratio=m, head_dim=i)
    return out


def deepseek_attention_init_rules(a: DeepseekV4AttentionSpec) -> dict:
    """As transformers' ``DeepseekV4PreTrainedModel._init_weights``: sinks 0, norm weights 1,
    the compressors' ``ape`` (``position_bias``) 0."""
    rules = {f"{a.name}.q_norm.weight": lambda w: w.fill_(1.0), f"{a.name}.norm.weight": lambda w: w.fill_(1.0)}
    if a.attention_sink:
        rules[a.sink_name] = lambda w: w.zero_()
    for indexer in ((False, True) if a.has_indexer else (False,) if a.compressed else ()):
        pfx = a.compressor_prefix(indexer)
        rules[f"{pfx}.norm.weight"] = lambda w: w.fill_(1.0)
        rules[f"{pfx}.ape"] = lambda w: w.zero_()
    return rules


def deepseek_attention_megatron_fields(a: DeepseekV4AttentionSpec) -> dict:
    """Megatron's attention sizes: H heads, one query group (K = V shared by all heads), E, no bias."""
    return dict(num_attention_heads=a.num_heads, num_query_groups=1, kv_channels=a.head_dim, add_bias_linear=False)


def deepseek_attention_linears(a: DeepseekV4AttentionSpec) -> dict[str, str]:
    """:func:`quantizable` -> export role ``"attn_proj"`` (no ModelOpt recipe sets it yet)."""
    return {a.linear_name(n): "attn_proj" for n in quantizable(a)}


def deepseek_attention_check_formats(a: DeepseekV4AttentionSpec, weight_format) -> None:
    """Each of :func:`quantizable` in the model dtype or block-FP8 (the published checkpoints).

    Raises:
        SpecError: another format on one of them (names the linear and the format).
    """
    for n in quantizable(a):
        fmt = weight_format(a.linear_name(n))
        if (None if fmt is None else fmt.format) not in QUANTIZABLE_FORMATS:
            raise SpecError(f"{a.linear_name(n)}: weight format {fmt.format!r} is not supported for DeepSeek-V4 "
                            f"attention linears; supported: model dtype or 'fp8_block'")


def deepseek_attention_dequantized(a: DeepseekV4AttentionSpec) -> DeepseekV4AttentionSpec:
    """The layer without KV quantization (the peer check's common ground with transformers)."""
    return dataclasses.replace(a, kv_cache_dtype="auto")


def deepseek_attention_quantized(a: DeepseekV4AttentionSpec, opts) -> DeepseekV4AttentionSpec:
    """``opts.kv_cache == "fp8"``: DeepSeek-V4's FP8 KV rule (``kv_cache_dtype="fp8_ds_mla"``).

    Raises:
        SpecError: ``head_dim - qk_rope_head_dim`` is not a multiple of 64.
    """
    return dataclasses.replace(a, kv_cache_dtype="fp8_ds_mla") if opts.kv_cache == "fp8" else a


QUANTIZATION = QuantizationRules(linears=deepseek_attention_linears, check_formats=deepseek_attention_check_formats,
                                 dequantized=deepseek_attention_dequantized, quantized=deepseek_attention_quantized)

FAMILY = LayerFamily(spec_type=DeepseekV4AttentionSpec, forward=deepseek_attention_forward,
                     oracle=deepseek_attention_oracle, oracle_near_ties=deepseek_attention_near_ties,
                     caches=deepseek_attention_caches,
                     init_rules=deepseek_attention_init_rules, megatron_fields=deepseek_attention_megatron_fields,
                     quantization=QUANTIZATION)
