"""Forward of :class:`~unified_models.dsl.AttentionSpec`: causal GQA over a paged KV cache.

Shapes: T tokens, D hidden, H query heads, G kv heads, E head dim,
N cache blocks, S block size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .. import ops
from ..caches import PagedKVCache
from ..dsl import AttentionSpec
from ..ops.attention import causal_mask, kv_fp8_roundtrip
from ..ops.rope import apply_rope_reference
from ..porting import taps
from ..state import FlatBatch, StateStore
from .common import LayerContext, bias_getter
from .family import LayerFamily
from .oracle import linear_oracle, rms_norm_oracle
from .quantization import QuantizationOptions, QuantizationRules, Track, scalar_problems

CACHE = "attn"
"""The layer's one cache: paged K/V (forward-context name ``<mixer>.attn`` in vLLM)."""


def attention_forward(spec: AttentionSpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                      batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """q/k/v projections, per-head q/k RMSNorm (``spec.qk_norm_eps``, if any), RoPE (if any), K/V written into the layer's cache
    group at ``slot_mapping``, paged attention read through the group's
    ``block_table``, o projection: ``[T, D] -> [T, D]``.

    In profiling runs (``store.state(layer_index, "attn")`` gives ``None``) the attention
    output is zeros and no cache is touched.

    ``spec.sliding_window`` W: each token attends its last W positions (its own
    included); ``spec.shared_kv``: V = K, one cache tensor.

    FP8 KV cache (``spec.kv_cache_dtype == "fp8_e4m3"``): the store hands
    float8_e4m3fn cache views and the layer passes its ``k_proj.k_scale`` /
    ``v_proj.v_scale`` parameters to the write and the read (one rule for
    vLLM's cache and the trainer's private one).
    """
    t = x_TD.shape[0]
    p = spec.name
    bias = bias_getter(p, params, spec.bias)
    q_THE = ops.linear(x_TD, params[f"{p}.q_proj.weight"], bias("q_proj")).view(t, spec.num_heads, spec.head_dim)
    k_TGE = ops.linear(x_TD, params[f"{p}.k_proj.weight"], bias("k_proj")).view(t, spec.num_kv_heads, spec.head_dim)
    if not spec.shared_kv:
        v_TGE = ops.linear(x_TD, params[f"{p}.v_proj.weight"], bias("v_proj")).view(t, spec.num_kv_heads, spec.head_dim)
        if taps.SINK is not None: v_TGE = taps.SINK(f"{p}.v_proj", v_TGE)
    if taps.SINK is not None: q_THE, k_TGE = taps.SINK(f"{p}.q_proj", q_THE), taps.SINK(f"{p}.k_proj", k_TGE)
    if spec.qk_norm_eps is not None:  # per-head RMSNorm over E (rows of [T*H, E]), before RoPE
        q_THE = ops.rms_norm(q_THE.reshape(-1, spec.head_dim), params[f"{p}.q_norm.weight"], spec.qk_norm_eps,
                             out_dtype=q_THE.dtype).view(t, spec.num_heads, spec.head_dim)
        k_TGE = ops.rms_norm(k_TGE.reshape(-1, spec.head_dim), params[f"{p}.k_norm.weight"], spec.qk_norm_eps,
                             out_dtype=k_TGE.dtype).view(t, spec.num_kv_heads, spec.head_dim)
        if taps.SINK is not None: q_THE, k_TGE = taps.SINK(f"{p}.q_norm", q_THE), taps.SINK(f"{p}.k_norm", k_TGE)
    if spec.rope is not None:
        cos, sin = ops.rope_cos_sin(ctx.max_positions, spec.rope.rotary_dim, spec.rope.theta, x_TD.device)
        q_THE = ops.apply_rope(q_THE, batch.positions, cos, sin)
        k_TGE = ops.apply_rope(k_TGE, batch.positions, cos, sin)
        if taps.SINK is not None: q_THE, k_TGE = taps.SINK(f"{p}.q_rope", q_THE), taps.SINK(f"{p}.k_rope", k_TGE)
    if spec.shared_kv:  # V = K (after RoPE); the store hands one cache as k_cache and v_cache
        v_TGE = k_TGE
    state = store.state(layer_index, CACHE)
    if state is None:  # profiling / dummy run: no cache bound yet
        o_THE = torch.zeros_like(q_THE)
    else:
        k_scale, v_scale = kv_scales(spec, params)
        ops.write_kv_cache(k_TGE, v_TGE, state.k_cache, state.v_cache, state.slot_mapping, k_scale, v_scale)
        o_THE = ops.paged_attention(q_THE, state.k_cache, state.v_cache, state.block_table, batch.seq_idx,
                                    batch.positions, spec.scale, k_scale, v_scale, spec.sliding_window)
    if taps.SINK is not None: o_THE = taps.SINK(f"{p}.attn", o_THE)
    o_TD = ops.linear(o_THE.reshape(t, spec.num_heads * spec.head_dim), params[f"{p}.o_proj.weight"], bias("o_proj"))
    if taps.SINK is not None: o_TD = taps.SINK(f"{p}.o_proj", o_TD)
    return o_TD


def kv_scales(spec: AttentionSpec, params: Mapping[str, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """``(k_scale, v_scale)`` fp32 ``[]`` parameters of an FP8-KV layer, ``(None, None)`` otherwise.

    Raises:
        KeyError: an FP8-KV layer whose parameters lack a scale (names it).
    """
    if not spec.kv_fp8:
        return None, None
    names = spec.kv_scale_names()
    missing = [n for n in names if n not in params]
    if missing:
        raise KeyError(f"{spec.name}: FP8 KV cache (kv_cache_dtype='fp8_e4m3') needs the scale parameters "
                       f"{missing}")
    return params[names[0]], params[names[1]]


def attention_caches(spec: AttentionSpec, model_dtype: torch.dtype) -> dict[str, PagedKVCache]:
    """One paged K/V cache: full attention or the spec's sliding window, separate K and V
    or one shared K = V tensor; FP8 pages for an FP8-KV layer."""
    return {CACHE: PagedKVCache(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, fp8=spec.kv_fp8,
                                sliding_window=spec.sliding_window, shared_kv=spec.shared_kv)}


def attention_oracle(a: AttentionSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """Dense causal softmax attention of one sequence from position 0 in ``x_TD.dtype``
    (over the spec's sliding window if any; V = K for shared-KV; per-head q/k RMSNorm
    before RoPE when ``qk_norm_eps`` is set).

    FP8 KV cache: K and V pass through the cache's write-then-read rule
    (``ops.attention.kv_fp8_roundtrip`` with the layer's scales), gradients straight through.
    """
    t = x_TD.shape[0]
    q = linear_oracle(x_TD, params, a.name + ".q_proj", a.bias).view(t, a.num_heads, a.head_dim)
    k = linear_oracle(x_TD, params, a.name + ".k_proj", a.bias).view(t, a.num_kv_heads, a.head_dim)
    if not a.shared_kv:
        v = linear_oracle(x_TD, params, a.name + ".v_proj", a.bias).view(t, a.num_kv_heads, a.head_dim)
    if a.qk_norm_eps is not None:
        q = rms_norm_oracle(q, params[a.name + ".q_norm.weight"], a.qk_norm_eps)
        k = rms_norm_oracle(k, params[a.name + ".k_norm.weight"], a.qk_norm_eps)
    if a.rope is not None:
        pos = torch.arange(t, device=x_TD.device)
        q = apply_rope_reference(q, pos, a.rope.rotary_dim, a.rope.theta).to(x_TD.dtype)
        k = apply_rope_reference(k, pos, a.rope.rotary_dim, a.rope.theta).to(x_TD.dtype)
    if a.shared_kv:
        v = k
    if a.kv_fp8:  # the FP8 KV cache's write-then-read rule, straight-through to k and v
        ks, vs = (params[n].detach().float() for n in a.kv_scale_names())
        k = k + (kv_fp8_roundtrip(k.detach(), ks, k.dtype) - k).detach()
        v = v + (kv_fp8_roundtrip(v.detach(), vs, v.dtype) - v).detach()
    rep = a.num_heads // a.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("the,she->hts", q, k) * a.scale
    s = s.masked_fill(~causal_mask(t, a.sliding_window, x_TD.device), float("-inf"))
    o = torch.einsum("hts,she->the", torch.softmax(s, -1), v).reshape(t, -1)
    return linear_oracle(o, params, a.name + ".o_proj", a.bias)


def attention_init_rules(a: AttentionSpec) -> dict:
    """The q/k norm gains start at 1 (transformers' ``Qwen3RMSNorm``)."""
    if a.qk_norm_eps is None:
        return {}
    return {f"{a.name}.{n}.weight": lambda p: p.fill_(1.0) for n in ("q_norm", "k_norm")}


def attention_megatron_fields(a: AttentionSpec) -> dict:
    """Megatron's attention sizes: heads, query groups, head dim (``kv_channels``), bias."""
    out = dict(num_attention_heads=a.num_heads, num_query_groups=a.num_kv_heads, kv_channels=a.head_dim,
               add_bias_linear=a.bias)
    if a.qk_norm_eps is not None:
        out["qk_layernorm"] = True
    return out


# ----------------------------------------------------------------------------- ModelOpt quantization (FP8 KV cache)

def attention_dequantized(a: AttentionSpec) -> AttentionSpec:
    """A model-dtype KV cache."""
    if a.kv_cache_dtype != "auto":
        return dataclasses.replace(a, kv_cache_dtype="auto")
    return a


def attention_quantized(a: AttentionSpec, options: QuantizationOptions) -> AttentionSpec:
    """An FP8 KV cache when ``options.kv_cache``."""
    if options.kv_cache:
        return dataclasses.replace(a, kv_cache_dtype="fp8_e4m3")
    return a


def attention_calibration_hooks(a: AttentionSpec, mod: Any, options: QuantizationOptions, track: Track) -> list:
    """The outputs of ``k_proj`` / ``v_proj`` (``k_scale`` / ``v_scale``)."""
    if not options.kv_cache:
        return []
    kn, vn = a.kv_scale_names()
    return [mod.k_proj.register_forward_hook(lambda _m, _a, out, n=kn: track(n, out)),
            mod.v_proj.register_forward_hook(lambda _m, _a, out, n=vn: track(n, out))]


def attention_validate_quantized(a: AttentionSpec, layer_index: int, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The KV scales of an FP8-KV layer."""
    problems: list[str] = []
    if a.kv_cache_dtype != "auto":
        for n in a.kv_scale_names():
            problems += scalar_problems(n, state.get(n))
    return problems


QUANTIZATION = QuantizationRules(dequantized=attention_dequantized, quantized=attention_quantized,
                                 calibration_hooks=attention_calibration_hooks, validate=attention_validate_quantized)

FAMILY = LayerFamily(spec_type=AttentionSpec, forward=attention_forward, oracle=attention_oracle,
                     caches=attention_caches, init_rules=attention_init_rules,
                     megatron_fields=attention_megatron_fields, quantization=QUANTIZATION)
