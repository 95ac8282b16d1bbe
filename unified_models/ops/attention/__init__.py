"""Causal GQA attention over a paged KV cache, and the KV-cache write.

One kernel for prefill, decode and training (DESIGN.md rule 3): a token at
position ``p`` of its sequence reads positions ``0..p`` (with a sliding window
W: ``max(0, p-W+1)..p``, never a block behind it) through the block
table, in KV tiles aligned at absolute position 0, in increasing order, with an
fp32 online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao 2022).
Tiles past a token's own position are fully masked for it, which leaves the
online-softmax state bit-for-bit unchanged (``alpha = 1``, ``p = 0``), so
neighbours never change a token's bits. The Triton path (``triton.py``)
also runs the KV range in splits of fixed absolute positions (``SPLIT_KV``),
each from a fresh state, merged in increasing order by a second kernel.

Cache layout: ``k_cache``/``v_cache`` are ``[N, S, G, E]`` views with any strides
(N blocks, S positions per block, G kv heads, E head dim); slot = block*S + offset.
A shared K = V cache is one tensor passed as both (``v_cache is k_cache``, ``v = k``).

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

Attention sink (optional, DeepSeek-V4 / gpt-oss): one fp32 logit per query head that
joins every row's softmax as a column without a value, so only the denominator grows:
``o = sum_i e^(x_i - m) v_i / (sum_i e^(x_i - m) + e^(sink_h - m))``. Every
implementation adds it once, after the row's last KV tile (or split merge), from the
row's final running max; without a sink no code path changes.

Compressed entries (DeepSeek-V4 CSA/HCA, ``compressed=`` :class:`CompressedKV`): after
its window keys a row attends the entries listed for it (ids into a ``[N, S//ratio, G, E]``
compressed cache, K = V, valid ids first, -1 trailing) in list order, in the same online
softmax with the same scale; the sink joins once after both. List slots are taken in fixed
tiles and a tile without a valid slot for the row keeps its state as is (a selection), so
the list width, the other rows, the block layouts and the step in which keys or entries
were written change no bit. :func:`read_kv_cache` reads cache rows back (an exact copy).

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports; ``common.py`` the
FP8 KV-cache rule and the scale checks, which the kernel, the CPU path, the oracle and
the backward share.
"""

from .common import (FP8_E4M3_MAX, KV_FP8_DTYPE, CompressedKV, check_compressed, check_compressed_entries,
                     check_kv_scales, check_sink, check_sliding_window, compressed_entry_slots, kv_cache_is_fp8,
                     kv_fp8_dequantize, kv_fp8_quantize, kv_fp8_roundtrip, window_start)
from .cpu import KV_TILE_CPU, paged_attention_torch, read_kv_cache_torch, write_kv_cache_torch
from .dispatch import paged_attention, read_kv_cache, write_kv_cache
from .reference import (causal_mask, dense_causal_attention_reference, dense_compressed_attention_reference,
                        paged_attention_reference, read_kv_cache_reference, softmax_with_sink)

__all__ = ["write_kv_cache", "paged_attention", "KV_FP8_DTYPE", "FP8_E4M3_MAX", "kv_cache_is_fp8", "check_kv_scales",
           "kv_fp8_quantize", "kv_fp8_dequantize", "kv_fp8_roundtrip", "KV_TILE_CPU", "write_kv_cache_torch",
           "paged_attention_torch", "dense_causal_attention_reference", "paged_attention_reference",
           "check_sliding_window", "check_sink", "window_start", "causal_mask", "softmax_with_sink",
           "CompressedKV", "check_compressed", "check_compressed_entries", "compressed_entry_slots", "read_kv_cache",
           "read_kv_cache_torch", "read_kv_cache_reference", "dense_compressed_attention_reference"]
