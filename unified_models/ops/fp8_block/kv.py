"""DeepSeek-V4's FP8 KV rule: the no-RoPE dims of each K = V vector through e4m3 with one
power-of-two scale per 64 dims, the RoPE dims left in the model dtype.

Source: DeepSeek-V4 ``inference/model.py`` (``Attention.forward`` and ``Compressor``:
``act_quant(kv[..., :-rope_head_dim], 64, scale_fmt, inplace=True)``, a quantize-and-dequantize
in place applied in prefill and decode alike: the QAT rule of the published checkpoints) and
vLLM's ``fp8_ds_mla`` cache layout (448 e4m3 codes + one ue8m0 scale per 64 dims + the 64 RoPE
dims in bf16). Here the rule is the exact round trip (:func:`ds_kv_fp8_roundtrip`): every
dequantized value ``e4m3 code * 2^k`` (``k >= -31``) is exactly representable in bf16, so a
cache holding the round-tripped bf16 vector reads back bit for bit what an FP8 cache of codes
and scales would dequantize to, and the trainer, which writes its private cache with the same
function, sees the same values.

Per vector ``x`` of E dims, ``n = E - R`` no-RoPE dims in tiles of 64:

* ``s = ue8m0_scale(max |x_tile|)`` = ``2^ceil(log2(max(amax, 1e-4) / 448))`` (official ``act_quant``;
  vLLM's CPU kernel floors the scale at 1e-4 instead of the amax: the two differ only for
  tiles with amax < 0.0448, and this rule is the published reference's);
* ``x_tile <- dtype(fp32(e4m3_rne(clamp(fp32(x_tile) / s, -448, 448))) * s)``;
* the last R dims unchanged.

Elementwise per tile in plain torch: the same bits on every device and for every batch
(a vector's result depends on that vector alone). The gradient is straight through
(:class:`DsKvFp8Fn`, DESIGN.md rule 11).
"""

from __future__ import annotations

import torch

from .common import E4M3_MAX, ue8m0_scale

KV_TILE = 64
"""Dims per FP8 scale of the DeepSeek-V4 KV rule."""


def ds_kv_fp8_roundtrip_forward(x_TE: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """The rule of the module docstring without autograd.

    Args:
        x_TE: ``[..., E]`` bf16/fp32 K = V vectors (fp64 for the oracles: the tile's values are
            divided and quantized in fp64 there, the same codes whenever ``x`` is fp32-exact) (RoPE already applied to the last dims).
        rope_dims: R, the trailing dims left unquantized (``qk_rope_head_dim``); ``E - R`` must be
            a positive multiple of 64.

    Returns:
        ``[..., E]`` in ``x_TE.dtype``.

    Raises:
        ValueError: a dtype other than bf16/fp32/fp64 (fp16 cannot hold every dequantized value), or ``E - R`` not a positive multiple of 64.
    """
    if x_TE.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"ds_kv_fp8_roundtrip: x must be bf16, fp32 or fp64 (every dequantized value is exact "
                         f"there; fp16 cannot hold the small ones), got {x_TE.dtype}")
    e = x_TE.shape[-1]
    n = e - rope_dims
    if rope_dims < 0 or n <= 0 or n % KV_TILE:
        raise ValueError(f"ds_kv_fp8_roundtrip: head dim {e} minus rope dims {rope_dims} = {n} must be a positive "
                         f"multiple of {KV_TILE} (one FP8 scale per {KV_TILE} no-RoPE dims)")
    wide = torch.float64 if x_TE.dtype == torch.float64 else torch.float32
    nope = x_TE[..., :n].to(wide).reshape(*x_TE.shape[:-1], n // KV_TILE, KV_TILE)
    s = ue8m0_scale(nope.abs().amax(dim=-1, keepdim=True)).to(wide)
    codes = torch.clamp(nope / s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    deq = (codes.to(wide) * s).reshape(*x_TE.shape[:-1], n).to(x_TE.dtype)
    return torch.cat([deq, x_TE[..., n:]], dim=-1)


class DsKvFp8Fn(torch.autograd.Function):
    """Straight-through gradient of :func:`ds_kv_fp8_roundtrip_forward` (the scales come from
    each tile's own amax, so nothing is clamped: the quantizer is taken as the identity)."""

    @staticmethod
    def forward(ctx, x_TE, rope_dims):
        return ds_kv_fp8_roundtrip_forward(x_TE, rope_dims)

    @staticmethod
    def backward(ctx, g):
        return g, None


def ds_kv_fp8_roundtrip(x_TE: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """Differentiable :func:`ds_kv_fp8_roundtrip_forward` (straight-through gradient).

    Args and returns as :func:`ds_kv_fp8_roundtrip_forward`; with no input requiring grad the
    forward is called directly (the same bits).
    """
    if torch.is_grad_enabled() and x_TE.requires_grad:
        return DsKvFp8Fn.apply(x_TE, rope_dims)
    return ds_kv_fp8_roundtrip_forward(x_TE, rope_dims)
