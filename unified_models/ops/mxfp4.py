"""MXFP4 weights (OCP MX FP4), DeepSeek-V4-Flash's routed experts: quantize, pack, dequantize, validate.

Format (DeepSeek-V4-Flash ``expert_dtype: "fp4"``, ``../shared/reference/architectures.md`` 2.4; vLLM
0.32 ``Mxfp4MoEMethod``, parameters ``w13_weight`` / ``w13_weight_scale``), per linear ``[N, K]``:

* ``weight``        uint8 ``[N, K/2]``: E2M1 codes, element ``2j`` in the LOW nibble of byte ``j``,
  element ``2j+1`` in the high nibble (vLLM ``fused_moe/flashinfer_moe_ep._dequant_mxfp4_ue8m0_gran32``:
  ``values[:, ::2] = lut[raw & 0x0F]``, ``values[:, 1::2] = lut[raw >> 4]``; the quantizer
  ``quantization/utils/mxfp4_utils._compute_quant_and_scale``: ``evens | (odds << 4)``; the same
  order as NVFP4). Code = ``sign << 3 | magnitude index`` over ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``;
  code 8 is ``-0``.
* ``weight_scale``  float8_e8m0fnu ``[N, K/32]``: one power-of-two scale ``2^(code - 127)`` per 32
  elements of K (the OCP MX block); code 255 is NaN. vLLM's DeepSeek-V4 loader maps the
  checkpoint's ``experts.{j}.w{1,2,3}.scale`` to this name (``_make_deepseek_v4_weights_mapper``)
  and holds the raw bytes as uint8.

``W[n, k] = e2m1(code[n, k]) * 2^(scale[n, k // 32] - 127)``.

**Quantizer** (:func:`mxfp4_quantize`; DeepSeek-V4 ``inference/kernel.py`` ``fp4_act_quant``, its
e8m0 path, the rule the published FP4 experts follow), per 32-element block of a row:

1. ``amax = max(max |w|, 6 * 2^-126)`` in fp32 (the official floor: an all-zero block gets the
   finite scale ``2^-126``);
2. ``s = 2^ceil(log2(amax / 6))`` (IEEE fp32 division, then the exponent rounded up: "exponent + 1
   when the mantissa is non-zero", as :func:`unified_models.ops.fp8_block.ue8m0_scale`). The
   official kernel multiplies by the fp32 constant ``1/6`` instead; for every fp32 ``amax`` the two
   give the same power of two (``tests/ops/test_mxfp4.py`` checks every mantissa near the only
   place they could differ, ``amax / 6`` next to a power of two);
3. ``code = e2m1_rne(clamp(w / s, -6, 6))``: round to nearest, ties to the even code, the sign
   from the sign bit (so ``-0.1 / s`` gives ``-0``, code 8). ``w / s`` is exact (``s`` a power of
   two in ``[2^-126, 2^126]``).

A non-finite block (NaN or Inf in it) gets the NaN scale code 255 (the load validator refuses it).

**Dequantization** (:func:`mxfp4_dequantize`) is exact: ``e2m1 * 2^e`` has at most two significant
bits and, for every finite scale a checkpoint may hold (validated: ``e2m1 * 2^e < 2^128``), lies in
bf16's and fp32's range (subnormals included), so bf16, fp32 and fp64 all hold the same value.

**Not a code-level fixed point.** ``quantize(dequantize(q))`` returns ``q`` exactly when every
block's largest magnitude is 4 or 6 (the canonical encoding). A block whose largest magnitude is
``m < 4`` (e.g. the quantizer's own output when ``amax / s`` is in ``(3, 3.5)``: ``m = 3``) is
re-encoded with a smaller scale and larger codes that represent the same values:
``dequantize(quantize(dequantize(q))) == dequantize(q)`` bit for bit (the e2m1 grid is closed
under the doublings involved), except below the floor (a stored scale under ``2^-126`` with its
values under ``2^-126``). The kernels compute with dequantized values only, so a re-encoding never
changes a forward's bits.

Everything here is elementwise or an amax over a fixed 32-block of one row (order-free) in plain
torch with IEEE operations only (tensor / tensor division, integer bit manipulation), so the codes
do not depend on the batch, the device or the host.

**Compute** (W4A8, :mod:`unified_models.ops.moe.deepseek`): the experts' activations are
quantized per token to FP8 with 1x128 ue8m0 tiles (:func:`~unified_models.ops.fp8_block.fp8_block_quantize_activation`,
DeepSeek's ``act_quant``), so a K of an MXFP4 linear must be a multiple of 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .nvfp4 import E2M1_MAX, cast_e2m1, pack_e2m1, unpack_e2m1

BLOCK = 32
"""Elements of K per ``weight_scale`` entry (the OCP MX block)."""

ACT_TILE = 128
"""The FP8 activation tile along K of the W4A8 compute (1x128, ue8m0 scales): K must divide by it."""

AMAX_FLOOR = 6.0 * 2.0 ** -126
"""The official quantizer's floor of a block amax (``fp4_act_quant``: ``amax.clamp_min(6 * 2**-126)``)."""

E8M0_NAN = 255
"""The e8m0 NaN code."""

E8M0_MAX_FINITE_CODE = 254
"""``2^127``."""

E2M1_SIGNED_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit code (OCP: code 8 is ``-0``)."""

_E2M1_FLOOR_LOG2 = (-1000, -1, 0, 0, 1, 1, 2, 2)
"""``floor(log2(magnitude))`` of magnitude indices 0..7 (index 0 = zero: never overflows)."""


class MXFP4Error(ValueError):
    """A bad MXFP4 tensor (missing, mis-shaped, wrong dtype, NaN or overflowing scale)."""


# ---------------------------------------------------------------------------- views and the weight type


def as_codes(weight: torch.Tensor) -> torch.Tensor:
    """The packed codes as uint8 (a view): uint8 as it is; int8 / ``torch.float4_e2m1fn_x2`` (the same
    bytes under another dtype, as some exports store them) reinterpreted.

    Raises:
        MXFP4Error: any other dtype.
    """
    if weight.dtype == torch.uint8:
        return weight
    if weight.dtype == torch.int8 or weight.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return weight.view(torch.uint8)
    raise MXFP4Error(f"MXFP4 weight has dtype {weight.dtype}, expected torch.uint8 (packed E2M1)")


def as_scale_codes(weight_scale: torch.Tensor) -> torch.Tensor:
    """The e8m0 scale bytes as uint8 (a view of float8_e8m0fnu, or uint8 as vLLM holds them).

    Raises:
        MXFP4Error: any other dtype.
    """
    if weight_scale.dtype == torch.float8_e8m0fnu:
        return weight_scale.view(torch.uint8)
    if weight_scale.dtype == torch.uint8:
        return weight_scale
    raise MXFP4Error(f"MXFP4 weight_scale has dtype {weight_scale.dtype}, expected torch.float8_e8m0fnu")


@dataclass(frozen=True)
class MXFP4Weight:
    """One MXFP4 weight ``[N, K]`` or a stack of experts ``[E, N, K]`` as stored.

    Attributes:
        weight: uint8 ``[..., N, K/2]`` packed E2M1 codes (low nibble = even element); an int8 or
            ``float4_e2m1fn_x2`` tensor is viewed as uint8.
        weight_scale: float8_e8m0fnu ``[..., N, K/32]``; a uint8 tensor (raw bytes) is viewed as e8m0.

    Raises:
        MXFP4Error: dtypes or shapes that do not match.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor

    def __post_init__(self):
        w = as_codes(self.weight)
        s = as_scale_codes(self.weight_scale).view(torch.float8_e8m0fnu)
        if w.dim() not in (2, 3) or s.dim() != w.dim() or w.shape[:-1] != s.shape[:-1] \
                or w.shape[-1] * 2 != s.shape[-1] * BLOCK:
            raise MXFP4Error(f"MXFP4Weight: weight {list(w.shape)} and weight_scale {list(s.shape)} do not match "
                             f"([..., N, K/2] and [..., N, K/{BLOCK}])")
        object.__setattr__(self, "weight", w)
        object.__setattr__(self, "weight_scale", s)

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape ``[..., N, K]``."""
        return torch.Size((*self.weight.shape[:-1], self.weight.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, e: int) -> "MXFP4Weight":
        """Expert ``e`` of a stacked ``[E, N, K]`` weight, as a 2-D weight.

        Raises:
            ValueError: not a stack.
        """
        if self.weight.dim() != 3:
            raise ValueError("MXFP4Weight.expert: not a stacked [E, N, K] weight")
        return MXFP4Weight(self.weight[e], self.weight_scale[e])

    def to(self, device) -> "MXFP4Weight":
        return MXFP4Weight(self.weight.to(device), self.weight_scale.to(device))


@dataclass(frozen=True)
class MXFP4Master:
    """A model-dtype master ``[E, N, K]`` (or ``[N, K]``) that the experts op quantizes by
    :func:`mxfp4_quantize` on every call and computes with in the W4A8 rule, the gradient going
    straight through the quantizer to ``weight`` (the trainer's form, ``LinearFormat("mxfp4",
    stored=False)``).

    Raises:
        MXFP4Error: not a floating tensor of rank 2 or 3, or K not a multiple of 32.
    """

    weight: torch.Tensor

    def __post_init__(self):
        w = self.weight
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() not in (2, 3):
            raise MXFP4Error(f"MXFP4Master: expected a floating [N, K] or [E, N, K] tensor, got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}")
        if w.shape[-1] % BLOCK:
            raise MXFP4Error(f"MXFP4Master: K = {w.shape[-1]} is not a multiple of the MXFP4 block ({BLOCK})")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def quantize(self) -> MXFP4Weight:
        """:func:`mxfp4_quantize` of the master (no gradient)."""
        return mxfp4_quantize(self.weight)


# ---------------------------------------------------------------------------- quantize / dequantize


def _check_k(w: torch.Tensor, what: str) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"{what}: expected [N, K] or [E, N, K], got {list(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{what}: K = {w.shape[-1]} is not a multiple of the MXFP4 block ({BLOCK})")


def mxfp4_scale_codes(block_amax: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (uint8) of ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))`` (module doc, steps 1-2).

    Args:
        block_amax: fp32 (or any float) block amaxes, any shape.

    Returns:
        uint8 codes, same shape: ``127 + exponent`` (1..253 for finite input), 255 for NaN/Inf.
    """
    amax = torch.clamp(block_amax.float(), min=AMAX_FLOOR)
    s = amax / torch.full_like(amax, E2M1_MAX)  # IEEE division on every device; >= 2^-126, normal
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    up = torch.where((bits & 0x007FFFFF) != 0, exp + 1, exp)
    return torch.where(torch.isfinite(s), up, torch.full_like(up, E8M0_NAN)).to(torch.uint8)


_SCALE_TABLE: dict[torch.device, torch.Tensor] = {}


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(code - 127)`` of e8m0 codes (uint8 or float8_e8m0fnu), NaN for 255; exact
    (code 0 is the fp32 subnormal ``2^-127``)."""
    c = as_scale_codes(codes)
    table = _SCALE_TABLE.get(c.device)
    if table is None:
        vals = [2.0 ** (i - 127) for i in range(255)] + [float("nan")]
        table = _SCALE_TABLE[c.device] = torch.tensor(vals, dtype=torch.float32, device=c.device)
    return table[c.long()]


def e2m1_signed_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 ``codes`` (any integer dtype, 0..15) in ``dtype``; code 8 is ``-0``."""
    table = torch.tensor(E2M1_SIGNED_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()].to(dtype)


def cast_e2m1_signed(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15) of ``x`` rounded to nearest E2M1, ties to the even code, saturating at 6,
    the sign from the sign bit (``-0.0`` and ``-0.1`` give code 8, ``-0``). NaN gives code 7 / 15."""
    mag = cast_e2m1(x.abs())  # ModelOpt's searchsorted rule on |x|: round half to even, > 5 -> 6
    return (torch.signbit(x).to(torch.uint8) << 3) | mag


def mxfp4_quantize(w: torch.Tensor) -> MXFP4Weight:
    """Quantize a bf16/fp16/fp32/fp64 weight to MXFP4 by the official rule (module doc).

    Args:
        w: ``[N, K]`` or a stack of experts ``[E, N, K]``, K a multiple of 32. fp64 input is first
            rounded to fp32 (the rule's arithmetic is fp32).

    Returns:
        :class:`MXFP4Weight` (``weight`` uint8 ``[..., N, K/2]``, ``weight_scale`` e8m0 ``[..., N, K/32]``);
        each row's block depends only on its own 32 elements.

    Raises:
        ValueError: wrong rank, K not a multiple of 32.
    """
    _check_k(w, "mxfp4_quantize")
    blocks = w.detach().float().unflatten(-1, (-1, BLOCK))
    codes = mxfp4_scale_codes(blocks.abs().amax(-1))  # NaN amax -> NaN (amax propagates NaN) -> 255
    s = e8m0_values(codes).unsqueeze(-1)
    scaled = torch.clamp(blocks / s, -E2M1_MAX, E2M1_MAX).flatten(-2)
    return MXFP4Weight(pack_e2m1(cast_e2m1_signed(scaled)), codes.view(torch.float8_e8m0fnu))


def mxfp4_dequantize(q: MXFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype``: ``e2m1(code) * 2^(scale - 127)``, exact (module doc)."""
    vals = e2m1_signed_values(unpack_e2m1(q.weight)).unflatten(-1, (-1, BLOCK))
    return (vals * e8m0_values(q.weight_scale).unsqueeze(-1)).flatten(-2).to(dtype)


def mxfp4_round_trip(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mxfp4_dequantize(mxfp4_quantize(w))`` in ``dtype`` (default ``w``'s): the weight the kernels use."""
    return mxfp4_dequantize(mxfp4_quantize(w), dtype or w.dtype)


def mxfp4_quantize_into(dst: MXFP4Weight, w: torch.Tensor) -> MXFP4Weight:
    """Re-quantize ``w`` into ``dst``'s buffers in place (DESIGN.md rule 10).

    Raises:
        ValueError: the quantized shapes differ from ``dst``'s.
    """
    q = mxfp4_quantize(w)
    for name in ("weight", "weight_scale"):
        a, b = getattr(dst, name), getattr(q, name)
        if a.shape != b.shape:
            raise ValueError(f"mxfp4_quantize_into: {name} {list(b.shape)} does not fit the buffer {list(a.shape)}")
        a.view(torch.uint8).copy_(b.view(torch.uint8))
    return dst


# ---------------------------------------------------------------------------- load-time validation


def _first(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]


def mxfp4_problems(weight: torch.Tensor | None, weight_scale: torch.Tensor | None, *,
                   shape: tuple[int, int] | None = None) -> list[str]:
    """What is wrong with one MXFP4 linear's stored tensors (empty list: nothing); each message
    names the tensor (``weight`` / ``weight_scale``).

    Checked: presence; dtypes (``weight`` uint8, or int8 / float4_e2m1fn_x2 holding the same bytes;
    ``weight_scale`` float8_e8m0fnu or uint8 bytes); 2-D shapes ``[N, K/2]`` and ``[N, K/32]``,
    ``(N, K) == shape`` when given, K a multiple of 128 (the W4A8 activation tile); no NaN scale
    (e8m0 code 255); no block whose largest value ``e2m1 * 2^e`` reaches ``2^128`` (Inf in bf16/fp32).
    """
    out = []
    if weight is None:
        out.append("weight is missing")
    if weight_scale is None:
        out.append("weight_scale is missing")
    codes = scodes = None
    if weight is not None:
        try:
            codes = as_codes(weight)
        except MXFP4Error:
            out.append(f"weight has dtype {weight.dtype}, expected torch.uint8 (packed E2M1, two per byte)")
        if weight.dim() != 2:
            out.append(f"weight must be 2-D [N, K/2], got {list(weight.shape)}")
            codes = None
    if weight_scale is not None:
        try:
            scodes = as_scale_codes(weight_scale)
        except MXFP4Error:
            out.append(f"weight_scale has dtype {weight_scale.dtype}, expected torch.float8_e8m0fnu")
        if weight_scale.dim() != 2:
            out.append(f"weight_scale must be 2-D [N, K/{BLOCK}], got {list(weight_scale.shape)}")
            scodes = None
    if weight is not None and weight.dim() == 2:
        n, k = weight.shape[0], weight.shape[1] * 2
        if shape is not None and (n, k) != tuple(shape):
            out.append(f"weight unpacks to [{n}, {k}], expected {list(shape)}")
        if k % ACT_TILE:
            out.append(f"weight K = {k} is not a multiple of {ACT_TILE} (the W4A8 activation tile)")
        if weight_scale is not None and weight_scale.dim() == 2 and tuple(weight_scale.shape) != (n, k // BLOCK):
            out.append(f"weight_scale has shape {list(weight_scale.shape)}, expected {[n, k // BLOCK]} "
                       f"(one e8m0 scale per {BLOCK} of K)")
            scodes = None
    if scodes is not None and scodes.numel():
        nan = scodes == E8M0_NAN
        if bool(nan.any()):
            out.append(f"weight_scale has {int(nan.sum())} NaN scale(s) (e8m0 code 255; first at {_first(nan)})")
        if codes is not None and tuple(scodes.shape) == (codes.shape[0], codes.shape[1] * 2 // BLOCK):
            mag = (unpack_e2m1(codes) & 0x7).unflatten(-1, (-1, BLOCK)).amax(-1)
            top = torch.tensor(_E2M1_FLOOR_LOG2, dtype=torch.int32, device=mag.device)[mag.long()]
            over = ~nan & (top + scodes.to(torch.int32) - 127 >= 128)
            if bool(over.any()):
                out.append(f"weight_scale has {int(over.sum())} scale(s) whose block values overflow bf16/fp32 "
                           f"(e2m1 * 2^e >= 2^128; first at {_first(over)})")
    return out


def validate_mxfp4(weight: torch.Tensor | None, weight_scale: torch.Tensor | None, *, name: str = "MXFP4 weight",
                   shape: tuple[int, int] | None = None) -> None:
    """Raise :class:`MXFP4Error` ``"<name>: <problem>; ..."`` if one linear's tensors are bad
    (:func:`mxfp4_problems`); ``name`` is the linear (e.g. ``model.layers.3.ffn.experts.5.w1``)."""
    probs = mxfp4_problems(weight, weight_scale, shape=shape)
    if probs:
        raise MXFP4Error(f"{name}: " + "; ".join(probs))
