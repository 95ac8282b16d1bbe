"""Weight formats per linear: how one linear layer's weight is stored and computed.

The architecture spec (the sublayer specs of :mod:`.attention`, :mod:`.mamba2`,
:mod:`.moe`, ...) declares every linear in the model dtype; which linears are
quantized, and how, is a separate table, ``ModelSpec.weight_formats``: linear
module name (HF name without ``.weight``, e.g.
``backbone.layers.1.mixer.in_proj`` or ``backbone.layers.3.mixer.experts.7.up_proj``)
-> :class:`LinearFormat`. A model declaration fills it from the checkpoint's
quantization config (:func:`unified_models.models.modelopt_config.linear_formats`);
a linear absent from it is a plain model-dtype linear.

This module holds the declarative half of each format: the tensors a linear
of ``[N, K]`` stores (:data:`FORMAT_LAYOUTS`: names, shapes, dtypes, what K must
divide). The computing half (the linear itself, quantize, dequantize,
validation, the ModelOpt ``quant_algo``) is
:data:`unified_models.layers.weight_formats.WEIGHT_FORMATS`. Adding a format is
one entry in each table plus its kernels in :mod:`unified_models.ops`.

Formats:

* ``"fp8"``: FP8 W8A8 with per-tensor scales (NVIDIA ModelOpt ``FP8``): stored
  ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` fp32 ``[]``, static
  ``input_scale`` fp32 ``[]`` (always: the activation scale is calibrated).
* ``"nvfp4"``: NVFP4 (ModelOpt ``W4A16_NVFP4``, or ``NVFP4`` = W4A4 when
  ``input_scale``): stored ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes per byte),
  ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 ``[]``
  (+ ``input_scale`` fp32 ``[]``, validated, unused by the W4A16 kernels).
* ``"fp8_block"``: block-FP8 W8A8 (DeepSeek-V3.1+/V4 ``quant_method: fp8``,
  ``weight_block_size [128, 128]``, ``scale_fmt: ue8m0``, dynamic 1x128 activation
  scales): stored ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale_inv``
  float8_e8m0fnu ``[ceil(N/128), K/128]``; K a multiple of 128.
* ``"mxfp4"``: MXFP4 W4A8 (DeepSeek-V4-Flash ``expert_dtype: fp4``, the routed experts only; OCP MX
  FP4): stored ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes per byte, element ``2j`` in the low
  nibble), ``weight_scale`` float8_e8m0fnu ``[N, K/32]`` (one power-of-two scale per 32 of K);
  activations quantized per token to FP8 with 1x128 ue8m0 tiles, so K must be a multiple of 128
  (:mod:`unified_models.ops.mxfp4`). DeepSeek's checkpoint names the scale ``.scale``; vLLM maps
  it to ``weight_scale``, as here.

``stored=False`` is the master form of the same format (what a trainer
trains): ``weight`` in the model dtype, quantized by the format's rule on
every forward (straight-through gradient), plus the static ``input_scale``
where the format computes with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SpecError


@dataclass(frozen=True)
class LinearFormat:
    """The weight format of one linear.

    Attributes:
        format: a key of :data:`FORMAT_LAYOUTS` (``"fp8"``, ``"nvfp4"``).
        stored: True: the checkpoint holds the format's codes and scales, used as
            they are; False: a model-dtype master quantized on every forward.
        input_scale: a static fp32 ``[]`` activation scale is part of the linear.
    """

    format: str
    stored: bool = True
    input_scale: bool = False

    def __post_init__(self) -> None:
        layout = FORMAT_LAYOUTS.get(self.format)
        if layout is None:
            raise SpecError(f"weight format {self.format!r} is unknown; known: {sorted(FORMAT_LAYOUTS)}")
        if layout.input_scale_required and not self.input_scale:
            raise SpecError(f"weight format {self.format!r} needs a static input_scale")

    def master(self) -> "LinearFormat":
        """The trainer's master form: model-dtype weight, the input scale kept only where
        the format computes with it."""
        keep = self.input_scale and FORMAT_LAYOUTS[self.format].master_keeps_input_scale
        return LinearFormat(self.format, stored=False, input_scale=keep)


TensorLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Field (``weight``, ``weight_scale``, ...) -> (shape, dtype) of one linear's tensors."""


@dataclass(frozen=True, kw_only=True)
class FormatLayout:
    """What one format stores for a linear of ``[N, K]``.

    Attributes:
        stored: ``(N, K) -> {field: (shape, dtype)}`` of the stored form, without
            ``input_scale`` (added as fp32 ``[]`` when the linear has one).
        k_multiple: K must be a multiple of this (the format's block along K).
        input_scale_required: the format always carries a static input scale.
        master_keeps_input_scale: the master form computes with the input scale.
    """

    stored: Callable[[int, int], TensorLayout]
    k_multiple: int = 1
    input_scale_required: bool = False
    master_keeps_input_scale: bool = False


NVFP4_BLOCK = 16
"""Elements of K per NVFP4 block scale (ModelOpt ``group_size``)."""

FP8_BLOCK = 128
"""Block-FP8 weight blocks (128 x 128) and activation tiles (1 x 128)."""

MXFP4_BLOCK = 32
"""Elements of K per MXFP4 e8m0 scale (the OCP MX block); an MXFP4 linear's K must also divide by
``FP8_BLOCK``, its activations' FP8 tile (W4A8)."""

FORMAT_LAYOUTS: dict[str, FormatLayout] = {
    "fp8": FormatLayout(stored=lambda n, k: {"weight": ((n, k), torch.float8_e4m3fn),
                                              "weight_scale": ((), torch.float32)},
                        input_scale_required=True, master_keeps_input_scale=True),
    "nvfp4": FormatLayout(stored=lambda n, k: {"weight": ((n, k // 2), torch.uint8),
                                                "weight_scale": ((n, k // NVFP4_BLOCK), torch.float8_e4m3fn),
                                                "weight_scale_2": ((), torch.float32)},
                          k_multiple=NVFP4_BLOCK),
    "fp8_block": FormatLayout(stored=lambda n, k: {"weight": ((n, k), torch.float8_e4m3fn),
                                                    "weight_scale_inv": ((-(-n // FP8_BLOCK), k // FP8_BLOCK),
                                                                         torch.float8_e8m0fnu)},
                              k_multiple=FP8_BLOCK),
    "mxfp4": FormatLayout(stored=lambda n, k: {"weight": ((n, k // 2), torch.uint8),
                                                "weight_scale": ((n, k // MXFP4_BLOCK), torch.float8_e8m0fnu)},
                          k_multiple=FP8_BLOCK),
}
"""Format name -> :class:`FormatLayout` (the computing half: ``layers.weight_formats``)."""


def linear_tensors(name: str, fmt: LinearFormat | None, n: int, k: int,
                   model_dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF name -> (shape, dtype) of every tensor of the linear ``name`` (``[N, K]``) in ``fmt``.

    ``fmt`` None: ``{name.weight: ((N, K), model_dtype)}``. The bias (if any) is
    the sublayer's own and not listed.

    Raises:
        SpecError: K is not a multiple of the format's block (names the linear).
    """
    if fmt is None:
        return {f"{name}.weight": ((n, k), model_dtype)}
    layout = FORMAT_LAYOUTS[fmt.format]
    if k % layout.k_multiple:
        raise SpecError(f"{name}: weight format {fmt.format!r} needs K = {k} to be a multiple of "
                        f"{layout.k_multiple}")
    fields = layout.stored(n, k) if fmt.stored else {"weight": ((n, k), model_dtype)}
    if fmt.input_scale:
        fields = {**fields, "input_scale": ((), torch.float32)}
    return {f"{name}.{f}": v for f, v in fields.items()}
