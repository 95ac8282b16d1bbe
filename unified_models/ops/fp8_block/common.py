"""The block-FP8 weight format: :class:`FP8BlockWeight`, the ue8m0 scale rule, the weight and
activation quantizers, dequantization and load-time checks (rules: :mod:`unified_models.ops.fp8_block`).
Plain torch, elementwise per tile, the same on every device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
"""Weight block (both dims) and activation tile width along K."""

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
"""DeepSeek's ``act_quant`` floor of a tile's amax (an all-zero tile gets a finite scale)."""


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(max(amax, 1e-4) / 448))`` as fp32 (DeepSeek ``act_quant``, ``scale_fmt="ue8m0"``).

    Args:
        amax: fp32 tile amaxes (any shape; NaN propagates as NaN).

    Returns:
        fp32 powers of two, same shape.
    """
    s = torch.clamp(amax.float(), min=AMAX_FLOOR) / torch.full_like(amax.float(), E4M3_MAX)
    bits = s.view(torch.int32)
    exp, mant = bits & 0x7F800000, bits & 0x007FFFFF
    up = torch.where(mant != 0, exp + 0x00800000, exp)
    return torch.where(torch.isfinite(s), up.view(torch.float32), s)


def _codes(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    v = x.float() / s
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _blocks(w_NK: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``[Nb, 128, Kb, 128]`` fp32 view of ``w`` padded along N to a multiple of 128."""
    n, k = w_NK.shape
    nb, kb = -(-n // BLOCK), k // BLOCK
    w = w_NK.float()
    if n % BLOCK:
        w = torch.cat([w, w.new_zeros(nb * BLOCK - n, k)])
    return w.view(nb, BLOCK, kb, BLOCK), nb, kb


def _check_k(k: int, what: str) -> None:
    if k % BLOCK:
        raise ValueError(f"{what}: K = {k} must be a multiple of {BLOCK} (block-FP8 tiles along K)")


def fp8_block_quantize_weight(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a master weight to block FP8.

    Args:
        w_NK: ``[N, K]`` bf16/fp16/fp32, K a multiple of 128.

    Returns:
        ``(weight e4m3 [N, K], weight_scale_inv e8m0 [ceil(N/128), K/128])``; each code is
        ``e4m3_rne(fp32(w) / s)`` with its block's power-of-two ``s``.

    Raises:
        ValueError: not 2-D, or K not a multiple of 128.
    """
    if w_NK.dim() != 2:
        raise ValueError(f"fp8_block_quantize_weight: weight must be [N, K], got {list(w_NK.shape)}")
    _check_k(w_NK.shape[1], "fp8_block_quantize_weight")
    n = w_NK.shape[0]
    wb, nb, kb = _blocks(w_NK.detach())
    s = ue8m0_scale(wb.abs().amax(dim=(1, 3)))  # [Nb, Kb]
    q = _codes(wb, s[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:n]
    return q, s.to(torch.float8_e8m0fnu)


def fp8_block_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``dtype(fp32(weight) * scale[n // 128, k // 128])`` (DeepSeek ``weight_dequant``): ``[N, K]``."""
    n, k = weight.shape
    s = weight_scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def fp8_block_quantize_activation_torch(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic 1x128 activation quantization (DeepSeek ``act_quant``, ue8m0 scales) in plain torch
    (elementwise ops and exact maxima: the same bits on every device). The op is
    :func:`.dispatch.fp8_block_quantize_activation` (this, or the Triton kernel with the same bits).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32, K a multiple of 128.

    Returns:
        ``(codes e4m3 [T, K], scales fp32 [T, K/128])``; row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: not 2-D, or K not a multiple of 128.
    """
    if x_TK.dim() != 2:
        raise ValueError(f"fp8_block_quantize_activation: x must be [T, K], got {list(x_TK.shape)}")
    _check_k(x_TK.shape[1], "fp8_block_quantize_activation")
    t, k = x_TK.shape
    xb = x_TK.float().view(t, k // BLOCK, BLOCK)
    s = ue8m0_scale(xb.abs().amax(dim=2))
    return _codes(xb, s[:, :, None]).view(t, k), s


@dataclass(frozen=True)
class FP8BlockWeight:
    """One block-FP8 linear weight as stored.

    Attributes:
        weight: float8_e4m3fn ``[N, K]``.
        weight_scale_inv: float8_e8m0fnu (or fp32 powers of two) ``[ceil(N/128), K/128]``.

    Raises:
        ValueError: wrong dtypes or shapes.
    """

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        # shapes and dtypes only: a value scan syncs the device (and cannot run under CUDA-graph capture);
        # checkpoints' values are scanned once, when they are validated (fp8_block_problems)
        problems = fp8_block_problems(self.weight, self.weight_scale_inv, check_values=False)
        shape_problems = [p for p in problems if "dtype" in p or "shape" in p or "missing" in p or "2-D" in p]
        if shape_problems:
            raise ValueError("FP8BlockWeight: " + "; ".join(shape_problems))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def fp8_block_problems(weight: torch.Tensor | None, weight_scale_inv: torch.Tensor | None, *,
                       shape: tuple[int, int] | None = None, check_values: bool = True) -> list[str]:
    """What is wrong with one block-FP8 linear's checkpoint tensors (empty list: nothing).

    Checked: presence; ``weight`` float8_e4m3fn 2-D (of ``shape`` when given), K a multiple of
    128, no NaN codes; ``weight_scale_inv`` float8_e8m0fnu or fp32, ``[ceil(N/128), K/128]``,
    finite, > 0 and powers of two (ue8m0; e8m0's NaN code 0xFF refused). ``check_values=False``:
    presence, dtypes and shapes only (no value is read: no device sync).
    """
    out = []
    if weight is None:
        out.append("weight is missing")
    if weight_scale_inv is None:
        out.append("weight_scale_inv is missing")
    if out:
        return out
    if weight.dtype != torch.float8_e4m3fn:
        out.append(f"weight has dtype {weight.dtype}, expected torch.float8_e4m3fn")
    if weight.dim() != 2:
        return out + [f"weight must be 2-D [N, K], got {list(weight.shape)}"]
    n, k = weight.shape
    if shape is not None and (n, k) != tuple(shape):
        out.append(f"weight has shape {[n, k]}, expected {list(shape)}")
    if k % BLOCK:
        out.append(f"weight K = {k} is not a multiple of {BLOCK}")
    want = (-(-n // BLOCK), k // BLOCK)
    if tuple(weight_scale_inv.shape) != want:
        out.append(f"weight_scale_inv has shape {list(weight_scale_inv.shape)}, expected {list(want)}")
    if weight_scale_inv.dtype not in (torch.float8_e8m0fnu, torch.float32):
        out.append(f"weight_scale_inv has dtype {weight_scale_inv.dtype}, expected torch.float8_e8m0fnu")
    elif weight_scale_inv.numel() and check_values:
        if weight_scale_inv.dtype == torch.float8_e8m0fnu:
            bad = weight_scale_inv.view(torch.uint8) == 0xFF
            what = "NaN"
        else:
            s = weight_scale_inv
            mant = s.view(torch.int32) & 0x007FFFFF
            bad = ~torch.isfinite(s) | (s <= 0) | (mant != 0)
            what = "non-finite, non-positive or non-power-of-two"
        if bool(bad.any()):
            out.append(f"weight_scale_inv has {int(bad.sum())} {what} scale(s) (first at "
                       f"{[int(i) for i in bad.nonzero()[0]]})")
    if weight.dtype == torch.float8_e4m3fn and weight.numel() and check_values:
        nan = (weight.view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            out.append(f"weight has {int(nan.sum())} NaN code(s) (first at {[int(i) for i in nan.nonzero()[0]]})")
    return out
