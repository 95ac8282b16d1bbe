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
* **backward** (:mod:`.backward`): ModelOpt's STE. With
  ``x_dq = e4m3(x_q) * input_scale`` and ``W_dq = e4m3(w) * weight_scale``:
  ``dx = (dY W_dq) * [x not clamped]``, ``dW = dY^T x_dq`` handed to the
  master unchanged (ModelOpt's weight mask ``|w| <= amax`` always holds),
  ``db = sum_t dY``; fp32 math, the weight-version guard applies.

Shapes: T tokens, K input features, N output features.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports; ``common.py`` the
format: :class:`FP8Weight`, ModelOpt's scale and weight-code rules, load-time
validation. Here :func:`fp8_linear` itself is differentiable (it is the entry point of
``backward.py``); :func:`fp8_linear_forward` is the dispatching op without autograd.
"""

from .backward import Fp8LinearFn, fp8_clamp_mask, fp8_linear
from .common import (FP8_E4M3_MAX, FP8Error, FP8Weight, fp8_input_scale, fp8_problems, fp8_quantize, fp8_quantize_into,
                     fp8_quantize_weight, fp8_weight_scale, validate_fp8)
from .cpu import fp8_linear_torch, fp8_quantize_activation_torch
from .dispatch import fp8_linear_forward, fp8_quantize_activation
from .reference import fp8_linear_reference

__all__ = ["FP8_E4M3_MAX", "FP8Error", "FP8Weight", "fp8_weight_scale", "fp8_quantize_weight", "fp8_input_scale",
           "fp8_quantize", "fp8_quantize_into", "fp8_problems", "validate_fp8", "fp8_quantize_activation",
           "fp8_linear_forward", "fp8_quantize_activation_torch", "fp8_linear_torch", "fp8_linear_reference",
           "fp8_linear", "fp8_clamp_mask", "Fp8LinearFn"]
