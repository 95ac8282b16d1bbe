"""Block-FP8 W8A8 linear (DeepSeek-V3.1+/V4 checkpoints): 128x128 weight blocks, 1x128 activation tiles.

Format (``quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
scale_fmt: ue8m0, activation_scheme: dynamic}``), per linear ``[N, K]``:

* ``weight``            float8_e4m3fn ``[N, K]``;
* ``weight_scale_inv``  float8_e8m0fnu ``[ceil(N/128), K/128]``, powers of two;
  ``W[n, k] ~= weight[n, k] * weight_scale_inv[n // 128, k // 128]`` (a multiplier despite
  the name; DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant``). K must be a multiple of 128.

Rules (``../shared/reference/architectures.md`` section 3; DeepSeek-V3.2/V4 ``inference/kernel.py``
``act_quant`` with ``scale_fmt="ue8m0"`` and ``fp8_gemm``):

* **ue8m0 scale** (:func:`ue8m0_scale`) of a tile: ``amax = max(max |x|, 1e-4)`` in fp32,
  ``s = 2^ceil(log2(amax / 448))`` (fp32 division, then the exponent rounded up: the bit
  trick "exponent + 1 when the mantissa is non-zero"). A power of two, so ``x / s`` is exact.
* **codes**: ``q = e4m3_rne(clamp(fp32(x) / s, -448, 448))`` (round to nearest even). The
  weight's stored codes are exactly ``cast(w / stored scale)`` (:func:`fp8_block_quantize_weight`;
  the same rule over 128x128 blocks).
* **activations** (:func:`fp8_block_quantize_activation`): the same rule per token and 128
  columns, dynamic: a token's codes and scales depend on its own row only, never on the
  other tokens of the batch.
* **GEMM**: ``y[t, n] = round( (0 + sum_kb (fp32(x_q[t, kb] . w_q[n, kb]) * sx[t, kb]) * sw[n // 128, kb]) + b )``,
  the sum over K blocks in fp32 in ascending ``kb`` order (DeepSeek's "promotion" every 128 K),
  one rounding to the output dtype. On CPU each 128-long block dot is an exact fp64 sum of
  e4m3 products (4-bit significands: products span < 2^37, a 128-term sum stays below 53
  bits) rounded once to fp32, so the result is independent of BLAS and of the batch.

Files: ``common.py`` (quantizers, :class:`FP8BlockWeight`, validation), ``cpu.py`` (the
linear on CPU), ``triton.py`` (the GPU kernel; equal to the CPU path under the Triton
interpreter), ``dispatch.py`` (argument checks, then one of the two), ``reference.py`` (fp64 oracle on dequantized operands), ``backward.py``
(STE autograd and the differentiable :func:`fp8_block_linear`), ``experts.py`` (block-FP8 expert stacks, stored and master, for the W8A8 experts of
:mod:`unified_models.ops.moe.deepseek`), ``kv.py`` (DeepSeek-V4's FP8 KV rule,
:func:`ds_kv_fp8_roundtrip`: 64-dim tiles of the no-RoPE dims, the same ue8m0 scale rule).
"""

from .backward import fp8_block_linear
from .common import (BLOCK, FP8BlockWeight, fp8_block_dequantize, fp8_block_problems, fp8_block_quantize_weight,
                     ue8m0_scale)
from .dispatch import fp8_block_quantize_activation
from .experts import FP8BlockExperts, FP8BlockMaster
from .kv import KV_TILE, ds_kv_fp8_roundtrip
from .reference import fp8_block_linear_reference

__all__ = ["BLOCK", "FP8BlockWeight", "fp8_block_linear", "fp8_block_dequantize", "fp8_block_problems",
           "fp8_block_quantize_activation", "fp8_block_quantize_weight", "ue8m0_scale", "fp8_block_linear_reference",
           "KV_TILE", "ds_kv_fp8_roundtrip", "FP8BlockExperts", "FP8BlockMaster"]
