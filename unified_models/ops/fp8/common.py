"""The FP8 (ModelOpt per-tensor) weight format: :class:`FP8Weight`, the scale and
weight-code rules, load-time validation (the rules: :mod:`unified_models.ops.fp8`).
Plain torch, the same on every device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..linear import round_f64
from ..scales import scalar_scale_problems


FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (ModelOpt's ``maxbound`` for (4, 3) quantizers)."""

_FP32_TINY = torch.finfo(torch.float32).tiny

_FP32_MAX = torch.finfo(torch.float32).max

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class FP8Error(ValueError):
    """A bad FP8 checkpoint tensor (missing, mis-shaped, wrong dtype, zero/negative/NaN/Inf scale)."""


@dataclass(frozen=True)
class FP8Weight:
    """One FP8 (ModelOpt per-tensor) linear weight.

    Attributes:
        weight: float8_e4m3fn ``[N, K]``.
        weight_scale: float32 0-d (``W ~= weight * weight_scale``).
        input_scale: float32 0-d, the static activation scale.

    Raises:
        FP8Error: wrong dtypes or shapes (values are checked by :func:`validate_fp8`).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor

    def __post_init__(self):
        w, ws, xs = self.weight, self.weight_scale, self.input_scale
        if w.dtype != torch.float8_e4m3fn or ws.dtype != torch.float32 or xs.dtype != torch.float32:
            raise FP8Error(f"FP8Weight: dtypes must be float8_e4m3fn / float32 / float32, got "
                           f"{w.dtype} / {ws.dtype} / {xs.dtype}")
        if w.dim() != 2:
            raise FP8Error(f"FP8Weight: weight must be [N, K], got {list(w.shape)}")
        if ws.dim() != 0 or xs.dim() != 0:
            raise FP8Error(f"FP8Weight: weight_scale and input_scale must be 0-d, got {list(ws.shape)} "
                           f"and {list(xs.shape)}")

    @property
    def shape(self) -> torch.Size:
        """``[N, K]``."""
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def to(self, device) -> "FP8Weight":
        return FP8Weight(self.weight.to(device), self.weight_scale.to(device), self.input_scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``[N, K]`` in ``dtype``: the exact product ``e4m3 * weight_scale`` (fp64) rounded ONCE
        to ``dtype`` (RNE). ModelOpt's ``from_quantized_weight`` instead multiplies in ``dtype``
        (``w.to(dtype) * scale.to(dtype)``, scale rounded first); this is the value the
        linear's math uses."""
        return round_f64(self.weight.double() * self.weight_scale.double(), dtype)

    @classmethod
    def from_checkpoint(cls, weight, weight_scale, input_scale, *, name: str,
                        shape: tuple[int, int] | None = None) -> "FP8Weight":
        """Validate one linear's checkpoint tensors (:func:`validate_fp8`) and build the weight
        (one-element scales of shape ``[]`` or ``[1]`` become 0-d).

        Raises:
            FP8Error: as :func:`validate_fp8`.
        """
        validate_fp8(weight, weight_scale, input_scale, name=name, shape=shape)
        return cls(weight, weight_scale.reshape(()), input_scale.reshape(()))


def _scale(s, device, what: str) -> torch.Tensor:
    """A one-element scale (tensor or number) as an fp32 0-d tensor on ``device``."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ValueError(f"{what} must have one element, got shape {list(s.shape)}")
        return s.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(s), dtype=torch.float32, device=device)


def fp8_weight_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-tensor FP8 weight scale: ``fp32(max |W|) / 448`` (fp32 0-d).

    Args:
        w: any shape, bf16/fp16/fp32 (the amax is exact in the weight's dtype).

    Returns:
        float32 0-d on ``w``'s device; 1.0 for an all-zero ``w`` (see the package doc).
        NaN in ``w`` gives a NaN scale (not checked here: no host sync).

    Raises:
        ValueError: empty ``w``.

    Source: ``modelopt/torch/export/unified_export_hf.py`` ``_export_quantized_weight``
    (``torch.tensor(amax / maxbound)``) and ``quant_utils.get_scaling_factor``.
    """
    if w.numel() == 0:
        raise ValueError("fp8_weight_scale: empty weight")
    amax = w.detach().abs().amax().float()
    amax = torch.where(amax == 0, torch.full_like(amax, FP8_E4M3_MAX), amax)
    # tensor / tensor: IEEE division on every device (CUDA computes tensor / python-scalar
    # as tensor * (1 / scalar), which can differ by one ulp: the codes would depend on the device)
    return amax / torch.full_like(amax, FP8_E4M3_MAX)


def fp8_quantize_weight(w: torch.Tensor, weight_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """ModelOpt's FP8 weight codes: ``e4m3(clamp(round_to_dtype(fp32(W) / scale), +-448))``.

    Args:
        w: ``[N, K]`` (any shape) bf16/fp16/fp32.
        weight_scale: one-element fp32 scale; default :func:`fp8_weight_scale` of ``w``.

    Returns:
        float8_e4m3fn, ``w``'s shape and device.

    Raises:
        ValueError: ``w`` not a float tensor of a supported dtype; scale not one element.

    Source: ``modelopt/torch/export/quant_utils.py`` ``to_quantized_weight``
    (``QUANTIZATION_FP8``) as torch computes it on CPU; see the package doc for the
    type promotion and for the CUDA difference.
    """
    if w.dtype not in _X_DTYPES:
        raise ValueError(f"fp8_quantize_weight: weight dtype must be bf16/fp16/fp32, got {w.dtype}")
    w = w.detach()
    s = fp8_weight_scale(w) if weight_scale is None else _scale(weight_scale, w.device, "weight_scale")
    q = (w.float() / s).to(w.dtype).float()  # IEEE fp32 division, rounded to the weight's dtype
    q = torch.where(q > FP8_E4M3_MAX, FP8_E4M3_MAX, q)
    q = torch.where(q < -FP8_E4M3_MAX, -FP8_E4M3_MAX, q)
    return q.to(torch.float8_e4m3fn)


def fp8_input_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's static input scale from a calibrated activation amax: ``amax / 448`` (fp32 0-d).

    ``amax`` is first sanitized as ``TensorQuantizer.export_amax`` does: 0 or NaN -> 448
    (scale 1.0), then clamped to ``[finfo(fp32).tiny, finfo(fp32).max]``.

    Raises:
        ValueError: ``amax`` has more than one element.

    Source: ``modelopt/torch/export/quant_utils.py`` ``get_scaling_factor``
    (``amax.float() / quantizer.maxbound``) over ``export_amax``.
    """
    a = _scale(amax, amax.device if isinstance(amax, torch.Tensor) else "cpu", "amax")
    a = torch.where((a == 0) | torch.isnan(a), torch.full_like(a, FP8_E4M3_MAX), a)
    a = a.clamp(min=_FP32_TINY, max=_FP32_MAX)
    return a / torch.full_like(a, FP8_E4M3_MAX)  # IEEE division on every device (see fp8_weight_scale)


def fp8_quantize(w: torch.Tensor, input_scale: torch.Tensor | float) -> FP8Weight:
    """A master weight as the :class:`FP8Weight` ModelOpt would export (own per-tensor scale).

    Args:
        w: ``[N, K]`` bf16/fp16/fp32 master.
        input_scale: the static activation scale (one element).
    """
    if w.dim() != 2:
        raise ValueError(f"fp8_quantize: weight must be [N, K], got {list(w.shape)}")
    s = fp8_weight_scale(w)
    return FP8Weight(fp8_quantize_weight(w, s), s, _scale(input_scale, w.device, "input_scale"))


def fp8_quantize_into(dst: FP8Weight, w: torch.Tensor) -> FP8Weight:
    """Re-quantize master ``w`` into ``dst``'s buffers in place (DESIGN.md rule 10: a weight update
    copies into the engine's buffers and recomputes the derived tensors there); the input scale
    is kept.

    Raises:
        ValueError: ``w``'s shape differs from ``dst``'s.
    """
    if tuple(w.shape) != tuple(dst.weight.shape):
        raise ValueError(f"fp8_quantize_into: weight {list(w.shape)} does not fit the buffer "
                         f"{list(dst.weight.shape)}")
    s = fp8_weight_scale(w)
    dst.weight.copy_(fp8_quantize_weight(w, s))
    dst.weight_scale.copy_(s)
    return dst


def fp8_problems(weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                 input_scale: torch.Tensor | None, *, shape: tuple[int, int] | None = None) -> list[str]:
    """What is wrong with one FP8 linear's checkpoint tensors (empty list: nothing).

    Checked: presence of all three; ``weight`` float8_e4m3fn, 2-D, of ``shape`` when given, no
    NaN codes (0x7F/0xFF: ModelOpt writes them only for a NaN or all-zero weight); scales fp32,
    one element (``[]`` or ``[1]``), finite and > 0.
    """
    out = []
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("input_scale", input_scale)):
        if t is None:
            out.append(f"{name} is missing")
    if weight is not None:
        if weight.dtype != torch.float8_e4m3fn:
            out.append(f"weight has dtype {weight.dtype}, expected torch.float8_e4m3fn")
        if weight.dim() != 2:
            out.append(f"weight must be 2-D [N, K], got {list(weight.shape)}")
        elif shape is not None and tuple(weight.shape) != tuple(shape):
            out.append(f"weight has shape {list(weight.shape)}, expected {list(shape)}")
        if weight.dtype == torch.float8_e4m3fn and weight.numel():
            nan = (weight.view(torch.uint8) & 0x7F) == 0x7F
            if bool(nan.any()):
                first = [int(i) for i in nan.nonzero()[0]]
                out.append(f"weight has {int(nan.sum())} NaN element(s) (first at {first})")
    for name, t in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        out += scalar_scale_problems(name, t, allow_1d=True)
    return out


def validate_fp8(weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                 input_scale: torch.Tensor | None, *, name: str, shape: tuple[int, int] | None = None) -> None:
    """Raise :class:`FP8Error` naming the module if one FP8 linear's tensors are bad.

    Args:
        weight, weight_scale, input_scale: the checkpoint tensors (None = missing).
        name: the module, e.g. ``"backbone.layers.0.mixer.in_proj"``; starts the message.
        shape: expected ``(N, K)``.

    Raises:
        FP8Error: ``"FP8 checkpoint: <name>: input_scale is missing; weight_scale is zero"``
            (every problem of :func:`fp8_problems`, joined).
    """
    probs = fp8_problems(weight, weight_scale, input_scale, shape=shape)
    if probs:
        raise FP8Error(f"FP8 checkpoint: {name}: " + "; ".join(probs))
