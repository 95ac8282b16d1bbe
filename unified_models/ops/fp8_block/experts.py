"""Block-FP8 weights of grouped experts: a stack ``[E, N, K]`` of :mod:`.common` linears.

DeepSeek-V4 stores its shared expert (every checkpoint with a block-FP8 ``quantization_config``)
and, in the Flash-Base checkpoints (``expert_dtype: fp8``), every routed expert as block-FP8
linears: per expert and projection ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv``
float8_e8m0fnu ``[ceil(N/128), K/128]``. The experts ops (:mod:`unified_models.ops.moe.deepseek`)
compute them in the W8A8 rule: the weight dequantized exactly (``e4m3 * 2^j`` is exact in bf16
and fp32), the activation quantized per token to FP8 with 1x128 ue8m0 tiles and dequantized
exactly (:func:`.dispatch.fp8_block_quantize_activation`, DeepSeek's ``act_quant`` before its
``fp8_gemm``), then the experts' own GEMM. A token's result depends on its own row only.

:class:`FP8BlockExperts` holds stored codes (no gradient); :class:`FP8BlockMaster` a model-dtype
master quantized by :func:`.common.fp8_block_quantize_weight` on every call (the trainer's form,
straight-through gradient in :mod:`unified_models.ops.moe.deepseek_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._dispatch import use_triton
from .common import BLOCK, fp8_block_quantize_weight


@dataclass(frozen=True)
class FP8BlockExperts:
    """Block-FP8 expert weights as stored: one ``[N, K]`` linear or a stack ``[E, N, K]``.

    Attributes:
        weight: float8_e4m3fn ``[..., N, K]``.
        weight_scale_inv: float8_e8m0fnu (or fp32 powers of two) ``[..., ceil(N/128), K/128]``.

    Raises:
        ValueError: dtypes, ranks or shapes that do not match, or K not a multiple of 128.
    """

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        w, s = self.weight, self.weight_scale_inv
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8BlockExperts: weight has dtype {w.dtype}, expected torch.float8_e4m3fn")
        if s.dtype not in (torch.float8_e8m0fnu, torch.float32):
            raise ValueError(f"FP8BlockExperts: weight_scale_inv has dtype {s.dtype}, expected float8_e8m0fnu")
        if w.dim() not in (2, 3) or s.dim() != w.dim():
            raise ValueError(f"FP8BlockExperts: weight {list(w.shape)} and weight_scale_inv {list(s.shape)} must "
                             "both be [N, K] / [E, N, K]-shaped")
        n, k = w.shape[-2:]
        want = (*w.shape[:-2], -(-n // BLOCK), k // BLOCK)
        if k % BLOCK or tuple(s.shape) != want:
            raise ValueError(f"FP8BlockExperts: weight {list(w.shape)} needs K a multiple of {BLOCK} and "
                             f"weight_scale_inv {list(want)}, got {list(s.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, e: int) -> "FP8BlockExperts":
        """Expert ``e`` of a stack, as a 2-D weight.

        Raises:
            ValueError: not a stack.
        """
        if self.weight.dim() != 3:
            raise ValueError("FP8BlockExperts.expert: not a stacked [E, N, K] weight")
        return FP8BlockExperts(self.weight[e], self.weight_scale_inv[e])

    def stacked(self) -> "FP8BlockExperts":
        """A 2-D weight as a one-expert stack ``[1, N, K]`` (a view); a stack as it is."""
        if self.weight.dim() == 3:
            return self
        return FP8BlockExperts(self.weight[None], self.weight_scale_inv[None])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``weight * scale`` of the 128x128 block (DeepSeek ``weight_dequant``), in ``dtype``; exact in
        bf16/fp32 (a 4-bit significand times a power of two). Same shape as :attr:`weight`. On the Triton
        path (CUDA, or ``UM_OPS_BACKEND=triton``) one kernel for the whole stack
        (:func:`.triton.fp8_block_dequantize_triton`, the same values)."""
        if use_triton(self.weight) and dtype in (torch.bfloat16, torch.float32):  # one kernel, the same values
            from .triton import fp8_block_dequantize_triton

            return fp8_block_dequantize_triton(self.weight, self.weight_scale_inv, dtype)
        w, s = self.weight, self.weight_scale_inv.float()
        n, k = w.shape[-2:]
        full = s.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
        return (w.float() * full).to(dtype)


@dataclass(frozen=True)
class FP8BlockMaster:
    """A model-dtype master ``[E, N, K]`` (or ``[N, K]``) that the experts op quantizes to block FP8 on
    every call (per expert, :func:`.common.fp8_block_quantize_weight`) and computes with in the W8A8
    rule, the gradient going straight through the quantizer to :attr:`weight`
    (``LinearFormat("fp8_block", stored=False)``).

    Raises:
        ValueError: not a floating tensor of rank 2 or 3, or K not a multiple of 128.
    """

    weight: torch.Tensor

    def __post_init__(self) -> None:
        w = self.weight
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() not in (2, 3):
            raise ValueError(f"FP8BlockMaster: expected a floating [N, K] or [E, N, K] tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}")
        if w.shape[-1] % BLOCK:
            raise ValueError(f"FP8BlockMaster: K = {w.shape[-1]} is not a multiple of the block-FP8 tile ({BLOCK})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def stacked(self) -> "FP8BlockMaster":
        """A 2-D master as a one-expert stack (a view)."""
        return self if self.weight.dim() == 3 else FP8BlockMaster(self.weight[None])

    def quantize(self) -> FP8BlockExperts:
        """The stored form of the master, expert by expert (no gradient)."""
        w = self.weight.detach()
        if w.dim() == 2:
            return FP8BlockExperts(*fp8_block_quantize_weight(w))
        parts = [fp8_block_quantize_weight(w[e]) for e in range(w.shape[0])]
        if not parts:
            n, k = w.shape[-2:]
            return FP8BlockExperts(w.new_zeros(0, n, k).to(torch.float8_e4m3fn),
                                   torch.zeros(0, -(-n // BLOCK), k // BLOCK).to(torch.float8_e8m0fnu))
        return FP8BlockExperts(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))
