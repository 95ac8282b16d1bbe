"""FP8 W8A8 linear in NVIDIA ModelOpt's FP8 format: quantizers, the linear, validation.

Format (ModelOpt ``QUANTIZATION_FP8`` checkpoints, vLLM ``modelopt`` FP8; the
Mamba ``in_proj``/``out_proj`` of the published NVFP4 Nemotron-H hybrids), per
linear ``[N, K]``:

* ``weight``        float8_e4m3fn ``[N, K]``;
* ``weight_scale``  float32 0-d: ``W ~= weight * weight_scale``;
* ``input_scale``   float32 0-d: the static (calibrated) activation scale,
  ``x ~= x_q * input_scale``.

Rules (each transcribed from its source; ``tests/ops/test_fp8.py`` checks the
quantizers bit for bit against the installed ModelOpt 0.47 and vLLM):

* **weight scale** (:func:`fp8_weight_scale`): ``fp32(amax) / 448`` in fp32,
  ``amax = max |W|`` taken in the weight's dtype (exact). ModelOpt:
  ``unified_export_hf._export_quantized_weight`` (per-tensor FP8 branch:
  ``torch.tensor(amax / maxbound)``, i.e. ``quant_utils.get_scaling_factor``'s
  ``amax.float() / maxbound``). Deviation: ``amax = 0`` (an all-zero weight)
  gives scale 1.0 (ModelOpt's ``TensorQuantizer._sanitize_export_amax`` rule for
  the exported scales), where the FP8 weight export would divide 0 by 0 and
  write NaN codes.
* **weight codes** (:func:`fp8_quantize_weight`): ModelOpt's
  ``quant_utils.to_quantized_weight`` for ``QUANTIZATION_FP8`` is
  ``(weight / weights_scaling_factor).to(torch.float8_e4m3fn)`` with a 0-d fp32
  scale. A 0-d tensor does not take part in type promotion, so for a bf16/fp16
  weight the result dtype is bf16/fp16; torch's CPU kernel for a
  reduced-float tensor divided by a scalar tensor
  (``aten/src/ATen/native/cpu/BinaryOpsKernel.cpp``, ``div_true_kernel``,
  ``div_cpu_reduced_float``) computes ``fp32(a) / b`` with the ORIGINAL fp32
  ``b`` (IEEE division) and rounds the quotient to bf16/fp16; ``.to(e4m3)``
  then rounds that again (RNE, saturating at 448 in torch 2.13). The rule here,
  elementwise and device-independent::

      q = e4m3_rne( clamp( round_to_dtype(W)( fp32(W) / fp32 scale ), -448, 448 ) )

  (two roundings for bf16/fp16 weights, exactly as ModelOpt on CPU; one for
  fp32). The clamp makes the saturation explicit (older torch casts give NaN
  above 464; ModelOpt's own scale never needs it). NOTE: ModelOpt run on a
  CUDA weight takes another path: the 0-d scale is then a CUDA tensor, not a
  CPU scalar, and ``div_true_kernel_cuda`` -> ``gpu_kernel_with_scalars`` casts
  it to the common dtype first, i.e. ``bf16(fp32(a) / fp32(bf16(scale)))``.
  Checkpoints exported on a GPU can therefore differ from this rule by one
  e4m3 step on a few percent of the elements; a loaded :class:`FP8Weight` is
  used as stored, so this only matters when re-deriving codes from a master.
* **input scale** (:func:`fp8_input_scale`): ModelOpt's calibration "max"
  rule, ``get_scaling_factor``: ``amax`` sanitized by ``export_amax`` (0 or NaN
  -> 448, clamp to ``[finfo(fp32).tiny, finfo(fp32).max]``), ``.float() / 448``.
* **activation codes** (:func:`fp8_quantize_activation`): vLLM's static
  per-tensor rule (``_custom_ops.scaled_fp8_quant`` with a scale ->
  ``csrc/quantization/w8a8/fp8/common.cu`` ``scaled_fp8_quant_kernel_strided``:
  ``inv = 1.0f / scale``, ``x * inv``, clamp to +-448, RNE saturating cast;
  ``QuantFP8.forward_native`` is the same in torch)::

      inv = fp32(1 / input_scale)                     (IEEE fp32 division)
      v   = fp32(x) * inv                             (one fp32 rounding)
      v   = 448 if v > 448; -448 if v < -448          (NaN stays NaN)
      q   = e4m3_rne(v); NaN -> 0x7F                  (-0.0 -> 0x80)

  One rule, elementwise (per-tensor static scale), so a row never depends on
  the batch. NaN handling is the only difference from vLLM: its CUDA kernel
  clamps with ``fminf``/``fmaxf``, which turn NaN into +448; its torch path
  keeps the NaN's sign (0xFF for -NaN); here every NaN gives 0x7F (NaN
  arithmetic on NVIDIA GPUs returns a canonical NaN, so a sign could not be
  kept on every device).
* **linear** (:func:`fp8_linear`)::

      acc = sum_k e4m3(x_q[t, k]) * e4m3(w[n, k])     (see below)
      s   = fp32(input_scale * weight_scale)          (one fp32 rounding)
      y   = round_to(out_dtype)( acc * s + bias )     (one final rounding)

  CPU (torch implementation and the Triton kernel under the interpreter, bit
  for bit the same): ``acc`` is the EXACT dot product in fp64 (e4m3 products
  are multiples of 2^-18 below 2^17.6, so every partial sum of up to 2^17
  products is exact in fp64, in any order and whatever the BLAS);
  ``acc * s`` and ``+ bias`` are fp64 operations, then one RNE rounding to
  ``out_dtype`` (:func:`unified_models.ops.linear.round_f64`). GPU: the
  Triton kernel's fp8 tensor-core ``tl.dot`` (e4m3 x e4m3 -> fp32) over fixed
  tiles, partial sums promoted to the fp32 accumulator once per K tile, then
  ``acc * s + bias`` in fp32 and one RNE rounding. Both are batch-invariant;
  CPU and GPU differ in the accumulation (as for the bf16 linear).
* **backward** (:mod:`unified_models.ops.grad.fp8`): ModelOpt's STE. With
  ``x_dq = e4m3(x_q) * input_scale`` and ``W_dq = e4m3(w) * weight_scale``:
  ``dx = (dY W_dq) * [x not clamped]``, ``dW = dY^T x_dq`` handed to the
  master unchanged (ModelOpt's weight mask ``|w| <= amax`` always holds),
  ``db = sum_t dY``; fp32 math, the weight-version guard applies.

Shapes: T tokens, K input features, N output features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scales import scalar_scale_problems

from ._dispatch import map_row_tiles, use_triton
from .linear import round_f64

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


# ---------------------------------------------------------------------------- scales


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
        float32 0-d on ``w``'s device; 1.0 for an all-zero ``w`` (see the module doc).
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
    (``QUANTIZATION_FP8``) as torch computes it on CPU; see the module doc for the
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


# ---------------------------------------------------------------------------- activations


def fp8_quantize_activation_torch(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """Plain-torch :func:`fp8_quantize_activation` (any shape; elementwise)."""
    s = _scale(input_scale, x.device, "input_scale")
    inv = torch.reciprocal(s)  # IEEE fp32 1/s (CPU and CUDA)
    v = x.float() * inv
    v = torch.where(v > FP8_E4M3_MAX, FP8_E4M3_MAX, v)
    v = torch.where(v < -FP8_E4M3_MAX, -FP8_E4M3_MAX, v)
    v = torch.where(torch.isnan(v), float("nan"), v)  # canonical +NaN -> 0x7F
    return v.to(torch.float8_e4m3fn)


def fp8_quantize_activation(x_TK: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """vLLM's static per-tensor FP8 activation quantization (the module doc's exact rule).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32.
        input_scale: one-element fp32 scale (> 0).

    Returns:
        float8_e4m3fn ``[T, K]``; element-wise, so row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: wrong rank/dtype, scale not one element.

    Source: ``vllm/_custom_ops.py`` ``scaled_fp8_quant(x, scale)`` ->
    ``csrc/quantization/w8a8/fp8/common.cu`` (``inv_scale = 1.0f / *scale``,
    ``scaled_fp8_conversion<true>``), ``QuantFP8.forward_native``. Triton kernel on GPU
    (or with ``UM_OPS_BACKEND=triton``), plain torch on CPU; the same bits.
    """
    if x_TK.dim() != 2 or x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"fp8_quantize_activation: x must be [T, K] bf16/fp16/fp32, got "
                         f"{list(x_TK.shape)} {x_TK.dtype}")
    if use_triton(x_TK):
        from .triton.fp8_linear import fp8_quantize_activation_triton

        return fp8_quantize_activation_triton(x_TK, _scale(input_scale, x_TK.device, "input_scale"))
    return fp8_quantize_activation_torch(x_TK, input_scale)


def fp8_clamp_mask(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """True where :func:`fp8_quantize_activation` does NOT clamp ``x`` (``|fp32(x) * inv| <= 448``;
    False for NaN): where the STE passes the gradient. ModelOpt's mask is ``|x| <= amax`` with
    ``amax = 448 * input_scale``; the two differ only within an fp32 ulp of ``amax``."""
    inv = torch.reciprocal(_scale(input_scale, x.device, "input_scale"))
    return (x.float() * inv).abs() <= FP8_E4M3_MAX


# ---------------------------------------------------------------------------- linear


def fp8_linear(x_TK: torch.Tensor, weight: FP8Weight | torch.Tensor, input_scale: torch.Tensor | float | None = None,
               bias_N: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP8 W8A8 linear ``y = x W^T + b`` with ModelOpt per-tensor scales, differentiable (STE).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32 activations (any strides).
        weight: an :class:`FP8Weight` (the rollout, loaded from a ModelOpt checkpoint; no
            gradient), or a ``[N, K]`` bf16/fp16/fp32 master tensor, quantized on EVERY call by
            :func:`fp8_weight_scale` + :func:`fp8_quantize_weight` (the trainer; straight-through
            gradient to the master).
        input_scale: the static activation scale (one element, fp32); required with a master
            tensor, must be None with an :class:`FP8Weight` (which carries its own).
        bias_N: optional ``[N]`` (bf16/fp16/fp32), added before the final rounding.
        out_dtype: bf16/fp16/fp32, default ``x_TK.dtype``.

    Returns:
        ``[T, N]`` in ``out_dtype``: ``round(acc * fp32(input_scale * weight_scale) + bias)``
        (module doc). Row ``t`` depends only on ``x_TK[t]`` (bitwise).

    Raises:
        ValueError: shapes/dtypes do not match, ``input_scale`` missing or doubled.

    With grad mode on and ``x_TK``, a master ``weight`` or ``bias_N`` requiring grad the call
    goes through :class:`unified_models.ops.grad.fp8.Fp8LinearFn` (same forward values; STE
    backward, see :mod:`unified_models.ops.grad.fp8`).
    """
    if isinstance(weight, FP8Weight):
        if input_scale is not None:
            raise ValueError("fp8_linear: an FP8Weight carries its input_scale; pass input_scale=None")
        master, wq, s_w, s_x = None, weight.weight, weight.weight_scale, weight.input_scale
    elif isinstance(weight, torch.Tensor):
        if input_scale is None:
            raise ValueError("fp8_linear: a master weight tensor needs the static input_scale")
        master, s_x = weight, _scale(input_scale, x_TK.device, "input_scale")
        wq = s_w = None
    else:
        raise TypeError(f"fp8_linear: weight must be an FP8Weight or a tensor, got {type(weight).__name__}")
    w_shape = (master if master is not None else wq).shape
    if x_TK.dim() != 2 or len(w_shape) != 2 or x_TK.shape[1] != w_shape[1]:
        raise ValueError(f"fp8_linear: x {list(x_TK.shape)} @ W^T {list(w_shape)} do not match")
    out_dtype = out_dtype or x_TK.dtype
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_TK, master, bias_N)):
        from .grad.fp8 import Fp8LinearFn

        return Fp8LinearFn.apply(x_TK, master, bias_N, wq, s_w, s_x, out_dtype)
    if master is not None:
        s_w = fp8_weight_scale(master)
        wq = fp8_quantize_weight(master, s_w)
    return fp8_linear_forward(x_TK, wq, s_w, s_x, bias_N, out_dtype)


def _check_linear(name, x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype):
    if x_TK.dim() != 2 or weight_q.dim() != 2 or x_TK.shape[1] != weight_q.shape[1]:
        raise ValueError(f"{name}: x {list(x_TK.shape)} @ W^T {list(weight_q.shape)} do not match")
    if x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: x must be bf16/fp16/fp32, got {x_TK.dtype}")
    if weight_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight_q.dtype}")
    for what, s in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name}: {what} must be one fp32 element, got {s.dtype} {list(s.shape)}")
    n = weight_q.shape[0]
    if bias_N is not None and (tuple(bias_N.shape) != (n,) or bias_N.dtype not in _X_DTYPES):
        raise ValueError(f"{name}: bias must be [{n}] bf16/fp16/fp32, got {list(bias_N.shape)} {bias_N.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be bf16/fp16/fp32, got {out_dtype}")


def fp8_linear_forward(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor, bias_N: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The FP8 linear on already-quantized weights, no autograd: Triton on GPU (or with
    ``UM_OPS_BACKEND=triton``), :func:`fp8_linear_torch` on CPU.

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32. weight_q: float8_e4m3fn ``[N, K]``.
        weight_scale, input_scale: one-element fp32 tensors. bias_N: optional ``[N]``.
        out_dtype: bf16/fp16/fp32 (default ``x_TK.dtype``).

    Raises:
        ValueError: as :func:`fp8_linear_torch`.
    """
    out_dtype = out_dtype or x_TK.dtype
    if use_triton(x_TK):
        from .triton.fp8_linear import fp8_linear_triton

        return fp8_linear_triton(x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)
    return fp8_linear_torch(x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)


def fp8_linear_torch(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor, bias_N: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU implementation: exact fp64 dot products of the e4m3 values, ``* s + bias`` in fp64,
    rounded once (module doc). Independent of BLAS kernels, blocking and threads (every partial
    sum is exact for K <= 2^17); still called over fixed 16-row tiles.

    Raises:
        ValueError: wrong ranks/dtypes, mismatched K, bias of the wrong shape, scales not one
            fp32 element, unsupported ``out_dtype``.
    """
    out_dtype = out_dtype or x_TK.dtype
    _check_linear("fp8_linear_torch", x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)
    # Converted on every call on purpose (a cached copy could go stale after an in-place update).
    w64 = weight_q.double()
    s64 = (input_scale.float().reshape(()) * weight_scale.float().reshape(())).double()  # one fp32 rounding
    b64 = bias_N.double() if bias_N is not None else None

    def tile(x):
        y = fp8_quantize_activation_torch(x, input_scale).double() @ w64.t()
        y = y * s64
        if b64 is not None:
            y = y + b64
        return round_f64(y, out_dtype)

    return map_row_tiles(tile, x_TK)


def fp8_linear_reference(x_TK: torch.Tensor, weight: FP8Weight | torch.Tensor,
                         input_scale: torch.Tensor | float | None = None, bias_N: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64: ``(e4m3(x_q) * input_scale) @ (e4m3(w) * weight_scale)^T + b`` with every
    product and sum exact or fp64 (the scales are NOT multiplied in fp32 first), then ``.to``."""
    if isinstance(weight, FP8Weight):
        wq, s_w, s_x = weight.weight, weight.weight_scale, weight.input_scale
    else:
        s_w = fp8_weight_scale(weight)
        wq, s_x = fp8_quantize_weight(weight, s_w), _scale(input_scale, x_TK.device, "input_scale")
    xdq = fp8_quantize_activation_torch(x_TK, s_x).double() * s_x.double()
    y = xdq @ (wq.double() * s_w.double()).t()
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(out_dtype or x_TK.dtype)


# ---------------------------------------------------------------------------- load-time validation


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
