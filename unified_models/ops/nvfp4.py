"""NVFP4 weights (W4A16) by NVIDIA ModelOpt's rule: quantize, pack, dequantize, validate.

Format (ModelOpt checkpoints, vLLM ``modelopt_fp4``), per linear ``[N, K]``:

* ``weight``          uint8 ``[N, K/2]``: E2M1 codes, element ``2j`` in the LOW
  nibble of byte ``j``, element ``2j+1`` in the high nibble; code =
  ``sign << 3 | magnitude index`` over ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``;
* ``weight_scale``    float8_e4m3fn ``[N, K/16]``: one scale per 16 elements of K;
* ``weight_scale_2``  float32 0-d: the per-tensor ("global") scale, ``amax / (6 * 448)``;
* ``input_scale``     float32 0-d, W4A4 checkpoints only (W4A16 ignores it; it is
  validated when present).

The quantizer is a transcription of ModelOpt 0.47's dynamic path,
``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``:
``NVFP4QTensor.get_weights_scaling_factor_2`` (``reduce_amax(W).float() / (6.0 * 448.0)``),
``NVFP4QTensor.get_weights_scaling_factor`` (block amax in the weight dtype,
``.float()``, divided by the fp32 product ``6.0 * ws2``; exact zeros -> 1.0;
``_cast_per_block_scale_to_fp8``: clamp to ``[2^-9, 448]``, cast RNE),
``NVFP4QTensor.quantize`` (``W / (fp32(scale) * ws2)``: one rounded fp32 product,
then an IEEE fp32 division) and ``NVFP4QTensor._cast_fp4`` (searchsorted over
the bounds ``[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]``, plus one where ``|x|`` is
exactly 0.75, 1.75 or 3.5: round half to even; ``> 5`` -> 6; NaN -> code 7;
sign = ``x < 0``). The dequantization is ``NVFP4QTensor.dequantize``:
``bf16(e2m1 * fp32(fp32(scale) * ws2))`` (two fp32 roundings, then one to the
target dtype; code 8, "-0", dequantizes to +0). ``tests/ops/test_nvfp4.py``
checks all of it bit for bit against the installed ModelOpt.

One deliberate deviation: an all-zero tensor (``amax = 0``). ModelOpt divides
0 by 0 there and writes NaN block scales and code 7 (= 6.0) everywhere; here
it gets ``weight_scale_2 = 0``, block scales 1.0 and code 0, so it dequantizes
to exact zeros (the load validator still refuses ``weight_scale_2 = 0`` in a
checkpoint, as the issue asks for every zero scale).

Weights that share one input in a fused engine layer (q/k/v; an expert's
gate/up) share ONE ``weight_scale_2`` in ModelOpt's export (the max amax of the
group): pass :func:`nvfp4_scale_2` of the group to :func:`nvfp4_quantize` for
each member. Nemotron-H experts are not gated, so each expert's ``up_proj`` and
``down_proj`` keep their own.

Everything here is elementwise or an amax (order-free) in plain torch, so it
is independent of the batch (weights only) and of reduction order; CPU and
CUDA both use IEEE fp32 division (every division is tensor / tensor: torch on
CUDA turns ``tensor / python_scalar`` into a multiplication by the reciprocal,
which gave other codes than the CPU's on the H200) and
round-to-nearest-even casts. Checked against ModelOpt on CPU bit for bit;
ModelOpt on CUDA divides ``amax`` by the Python constant ``6 * 448`` and so can
differ from this rule (and from itself on CPU) by one ulp of ``weight_scale_2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .scales import scalar_scale_problems

BLOCK = 16
"""Elements of K per ``weight_scale`` entry."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SCALE = 2.0 ** -9
"""Smallest e4m3 subnormal: ModelOpt clamps block scales up to it (no flush to 0)."""

E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit code (ModelOpt's ``e2m1_values``; code 8 is +0)."""


class NVFP4Error(ValueError):
    """A bad NVFP4 checkpoint tensor (missing, mis-shaped, zero/NaN/Inf scale)."""


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 weight ``[N, K]`` or a stack of experts ``[E, N, K]``, ModelOpt layout.

    Attributes:
        weight: uint8 ``[..., N, K/2]`` packed E2M1 codes (low nibble = even element).
        weight_scale: float8_e4m3fn ``[..., N, K/16]`` block scales.
        weight_scale_2: float32 ``[]`` (one tensor) or ``[E]`` (one per expert).
        input_scale: optional float32, same shape as ``weight_scale_2`` (W4A4
            checkpoints; unused by the W4A16 kernels).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor | None = None

    def __post_init__(self):
        w, s, s2 = self.weight, self.weight_scale, self.weight_scale_2
        if w.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn or s2.dtype != torch.float32:
            raise NVFP4Error(f"NVFP4Weight: dtypes must be uint8 / float8_e4m3fn / float32, got "
                             f"{w.dtype} / {s.dtype} / {s2.dtype}")
        if w.dim() not in (2, 3) or s.dim() != w.dim() or w.shape[:-1] != s.shape[:-1] \
                or w.shape[-1] * 2 != s.shape[-1] * BLOCK:
            raise NVFP4Error(f"NVFP4Weight: weight {tuple(w.shape)} and weight_scale {tuple(s.shape)} do not "
                             f"match ([..., N, K/2] and [..., N, K/{BLOCK}])")
        want = () if w.dim() == 2 else (w.shape[0],)
        if tuple(s2.shape) != want:
            raise NVFP4Error(f"NVFP4Weight: weight_scale_2 must have shape {list(want)}, got {list(s2.shape)}")
        if self.input_scale is not None and tuple(self.input_scale.shape) != want:
            raise NVFP4Error(f"NVFP4Weight: input_scale must have shape {list(want)}, "
                             f"got {list(self.input_scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape ``[..., N, K]``."""
        return torch.Size((*self.weight.shape[:-1], self.weight.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, e: int) -> "NVFP4Weight":
        """Expert ``e`` of a stacked ``[E, N, K]`` weight, as a 2-D weight."""
        if self.weight.dim() != 3:
            raise ValueError("NVFP4Weight.expert: not a stacked [E, N, K] weight")
        return NVFP4Weight(self.weight[e], self.weight_scale[e], self.weight_scale_2[e],
                           None if self.input_scale is None else self.input_scale[e])

    def to(self, device) -> "NVFP4Weight":
        return NVFP4Weight(self.weight.to(device), self.weight_scale.to(device), self.weight_scale_2.to(device),
                           None if self.input_scale is None else self.input_scale.to(device))


# ---------------------------------------------------------------------------- codes and packing


def cast_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15) of ``x`` rounded to E2M1, ModelOpt's ``NVFP4QTensor._cast_fp4``.

    Magnitude index = number of bounds strictly below ``|x|`` (``searchsorted``,
    left side), plus one where ``|x|`` equals 0.75, 1.75 or 3.5, i.e. round to
    nearest with ties to the even code; values above 5 saturate to 6 (code 7),
    NaN gives code 7. Sign bit set for ``x < 0`` (so -0.1 gives code 8).
    """
    bounds = torch.tensor(E2M1_BOUNDS, dtype=x.dtype, device=x.device)
    a = x.abs()
    idx = torch.searchsorted(bounds, a.contiguous(), out_int32=True).to(torch.uint8)
    odd = ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(torch.uint8)
    return ((x < 0).to(torch.uint8) << 3) + idx + odd


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 ``codes`` (any integer dtype), code 8 -> +0."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()].to(dtype)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> uint8 ``[..., K/2]``: element 2j low nibble, 2j+1 high nibble.

    Raises:
        ValueError: odd K.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 1::2] << 4) | c[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> codes uint8 ``[..., K]`` (inverse of :func:`pack_e2m1`)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1: expected uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- quantize / dequantize


def _check_k(w: torch.Tensor, what: str) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"{what}: expected [N, K] or [E, N, K], got {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{what}: K = {w.shape[-1]} is not a multiple of the NVFP4 block ({BLOCK})")


def nvfp4_scale_2(*weights: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2`` for weights quantized together (fp32 0-d):
    ``max_i amax(|W_i|)`` (in the weight dtype, then ``.float()``) ``/ (6 * 448)``.

    One weight: ``NVFP4QTensor.get_weights_scaling_factor_2``. Several: the
    export's shared scale for weights fed the same input (fused q/k/v, gate/up).
    """
    if not weights:
        raise ValueError("nvfp4_scale_2: no weights")
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    return amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)  # IEEE division on every device (see below)


def nvfp4_block_scales(w: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn block scales ``[..., N, K/16]`` of ``w`` for a given ``weight_scale_2``
    (ModelOpt's ``get_weights_scaling_factor``, dynamic path).

    ``weight_scale_2``: 0-d, or ``[E]`` for a stacked ``[E, N, K]`` ``w``.
    """
    _check_k(w, "nvfp4_block_scales")
    ws2 = _ws2_view(weight_scale_2, w)
    block_amax = w.detach().unflatten(-1, (-1, BLOCK)).abs().amax(-1).float()
    scale = block_amax / (E2M1_MAX * ws2)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale = torch.where(ws2 == 0, torch.ones_like(scale), scale)  # all-zero tensor (0/0; see module doc)
    return scale.clamp(min=E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)


def _ws2_view(ws2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ws2 = ws2.to(torch.float32).to(w.device)
    if w.dim() == 3:
        if ws2.dim() == 0:
            return ws2
        if ws2.shape != (w.shape[0],):
            raise ValueError(f"weight_scale_2 {list(ws2.shape)} does not match {w.shape[0]} experts")
        return ws2.view(-1, 1, 1)
    if ws2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar for a 2-D weight, got {list(ws2.shape)}")
    return ws2.reshape(())


def nvfp4_quantize(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a bf16/fp16/fp32 weight to NVFP4 exactly as ModelOpt's ``NVFP4QTensor.quantize``.

    Args:
        w: ``[N, K]`` or a stack of experts ``[E, N, K]`` (K a multiple of 16).
        weight_scale_2: the fp32 per-tensor scale to use (0-d, or ``[E]`` for a
            stack). Default: each tensor's (each expert's) own
            ``amax / (6 * 448)``. Pass :func:`nvfp4_scale_2` of a fused group to
            reproduce ModelOpt's shared scale.

    Returns:
        :class:`NVFP4Weight` (``input_scale`` None: W4A16).

    Raises:
        ValueError: wrong rank, K not a multiple of 16.
    """
    _check_k(w, "nvfp4_quantize")
    w = w.detach()
    if weight_scale_2 is None:
        amax = w.abs().amax(dim=(1, 2)) if w.dim() == 3 else w.abs().amax()
        amax = amax.float()
        # tensor / tensor: IEEE division on CPU and CUDA alike. torch on CUDA computes
        # tensor / python-scalar as tensor * (1 / scalar): one ulp off at times, and then
        # other codes (seen on the H200); ModelOpt itself inherits that on CUDA.
        weight_scale_2 = amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)
    s2 = torch.as_tensor(weight_scale_2).to(device=w.device, dtype=torch.float32)
    if w.dim() == 3 and s2.dim() == 0:
        s2 = s2.expand(w.shape[0]).clone()
    ws2 = _ws2_view(s2, w)  # [] or [E, 1, 1]
    scale = nvfp4_block_scales(w, s2)
    denom = (scale.float() * ws2).unsqueeze(-1)  # one rounded fp32 product, as ModelOpt
    scaled = (w.float().unflatten(-1, (-1, BLOCK)) / denom).flatten(-2)  # IEEE fp32 division
    # all-zero tensor: ModelOpt's 0/0 gives NaN; defined here as exact zeros
    scaled = torch.where(ws2 == 0, torch.zeros_like(scaled), scaled)
    return NVFP4Weight(pack_e2m1(cast_e2m1(scaled)), scale, s2.reshape(s2.shape))


def nvfp4_quantize_into(dst: NVFP4Weight, w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> NVFP4Weight:
    """Re-quantize ``w`` into the existing buffers of ``dst`` (in place; DESIGN.md rule 10: a weight
    update copies into the engine's buffers and recomputes the derived tensors there).

    Raises:
        ValueError: ``w``'s quantized shapes differ from ``dst``'s.
    """
    q = nvfp4_quantize(w, weight_scale_2)
    for name in ("weight", "weight_scale", "weight_scale_2"):
        a, b = getattr(dst, name), getattr(q, name)
        if a.shape != b.shape:
            raise ValueError(f"nvfp4_quantize_into: {name} {list(b.shape)} does not fit the buffer {list(a.shape)}")
        a.copy_(b)
    return dst


def nvfp4_dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype``: ``dtype(e2m1 * fp32(fp32(weight_scale) * weight_scale_2))``,
    ModelOpt's ``NVFP4QTensor.dequantize`` (non-fast path) bit for bit."""
    ws2 = _ws2_view(q.weight_scale_2, q.weight)
    block = q.weight_scale.float() * ws2  # [..., N, K/16], one fp32 rounding
    vals = e2m1_values(unpack_e2m1(q.weight)).unflatten(-1, (-1, BLOCK))
    return (vals * block.unsqueeze(-1)).flatten(-2).to(dtype)


def nvfp4_round_trip(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``nvfp4_dequantize(nvfp4_quantize(w))``: the weight the NVFP4 kernels compute with."""
    return nvfp4_dequantize(nvfp4_quantize(w, weight_scale_2), dtype or w.dtype)


# ---------------------------------------------------------------------------- load-time validation


def _describe(layer, expert, proj) -> str:
    where = [] if layer is None else [f"layer {layer}"]
    if expert is not None:
        where.append(f"expert {expert}")
    if proj:
        where.append(str(proj))
    return " ".join(where) or "NVFP4 weight"


def nvfp4_problems(weight: torch.Tensor | None, weight_scale: torch.Tensor | None,
                   weight_scale_2: torch.Tensor | None, input_scale: torch.Tensor | None = None, *,
                   shape: tuple[int, int] | None = None, require_input_scale: bool = False) -> list[str]:
    """What is wrong with one NVFP4 linear's checkpoint tensors (empty list: nothing).

    Checked: presence; dtypes (uint8 / float8_e4m3fn / float32); shapes
    (``[N, K/2]``, ``[N, K/16]``, one-element scales; ``shape = (N, K)`` when
    given); ``weight_scale_2`` and ``input_scale`` finite and > 0; block scales
    neither NaN (e4m3 0x7F/0xFF) nor zero (ModelOpt never writes a zero block
    scale: it clamps to 2^-9) nor negative.
    """
    out = []
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("weight_scale_2", weight_scale_2)):
        if t is None:
            out.append(f"{name} is missing")
    if require_input_scale and input_scale is None:
        out.append("input_scale is missing")
    if weight is not None and weight.dtype != torch.uint8:
        out.append(f"weight has dtype {weight.dtype}, expected torch.uint8 (packed E2M1)")
    if weight_scale is not None:
        if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            out.append(f"weight_scale has dtype {weight_scale.dtype}, expected torch.float8_e4m3fn")
        else:
            bits = weight_scale.view(torch.uint8) if weight_scale.dtype != torch.uint8 else weight_scale
            nan = (bits & 0x7F) == 0x7F
            zero = (bits & 0x7F) == 0
            neg = ((bits & 0x80) != 0) & ~nan & ~zero
            for what, m in (("NaN", nan), ("zero", zero), ("negative", neg)):
                if bool(m.any()):
                    first = [int(i) for i in m.nonzero()[0]]
                    out.append(f"weight_scale has {int(m.sum())} {what} block scale(s) (first at {first})")
    if weight is not None and weight_scale is not None and weight.dim() == 2 and weight_scale.dim() == 2:
        n, k2 = weight.shape
        if weight_scale.shape != (n, k2 * 2 // BLOCK) or (k2 * 2) % BLOCK:
            out.append(f"weight {list(weight.shape)} and weight_scale {list(weight_scale.shape)} do not match "
                       f"([N, K/2] and [N, K/{BLOCK}])")
        if shape is not None and (n, k2 * 2) != tuple(shape):
            out.append(f"weight unpacks to [{n}, {k2 * 2}], expected {list(shape)}")
    elif weight is not None and weight.dim() != 2:
        out.append(f"weight must be 2-D [N, K/2], got {list(weight.shape)}")
    for name, t in (("weight_scale_2", weight_scale_2), ("input_scale", input_scale)):
        out += scalar_scale_problems(name, t, allow_1d=True)
    return out


def validate_nvfp4(weight, weight_scale, weight_scale_2, input_scale=None, *, layer=None, expert=None,
                   proj: str | None = None, shape: tuple[int, int] | None = None,
                   require_input_scale: bool = False) -> None:
    """Raise :class:`NVFP4Error` naming ``layer``/``expert``/``proj`` if one linear's tensors are bad
    (see :func:`nvfp4_problems`)."""
    probs = nvfp4_problems(weight, weight_scale, weight_scale_2, input_scale, shape=shape,
                           require_input_scale=require_input_scale)
    if probs:
        raise NVFP4Error(f"NVFP4 checkpoint: {_describe(layer, expert, proj)}: " + "; ".join(probs))


def validate_nvfp4_experts(layer, experts: Mapping[int, Mapping[str, Mapping[str, torch.Tensor | None]]], *,
                           num_experts: int | None = None, projs: tuple[str, ...] = ("up_proj", "down_proj"),
                           shapes: Mapping[str, tuple[int, int]] | None = None,
                           require_input_scale: bool = False) -> None:
    """Validate every routed expert of one MoE layer; one error lists every bad (expert, projection).

    Args:
        layer: the layer id (index or checkpoint prefix) used in the message.
        experts: ``experts[e][proj][name]`` with names ``weight``, ``weight_scale``,
            ``weight_scale_2``, ``input_scale`` (absent key = missing tensor).
        num_experts: when given, experts ``0..num_experts-1`` must all be present.
        projs: the projections each expert must have.
        shapes: optional logical ``(N, K)`` per projection.
        require_input_scale: W4A4 checkpoints must carry ``input_scale``.

    Raises:
        NVFP4Error: ``"NVFP4 checkpoint: layer 3: expert 5 up_proj: weight_scale_2 is missing; ..."``.
    """
    probs = []
    ids = sorted(experts)
    if num_experts is not None:
        missing = sorted(set(range(num_experts)) - set(ids))
        if missing:
            probs.append(f"expert(s) {missing} missing")
    for e in ids:
        for p in projs:
            t = experts[e].get(p)
            if t is None:
                probs.append(f"expert {e} {p}: missing")
                continue
            for msg in nvfp4_problems(t.get("weight"), t.get("weight_scale"), t.get("weight_scale_2"),
                                      t.get("input_scale"), shape=(shapes or {}).get(p),
                                      require_input_scale=require_input_scale):
                probs.append(f"expert {e} {p}: {msg}")
    if probs:
        bad = sorted({int(m.split()[1]) for m in probs if m.startswith("expert ") and m.split()[1].isdigit()})
        head = f"NVFP4 checkpoint: layer {layer}: " + (f"bad expert ids {bad}: " if bad else "")
        raise NVFP4Error(head + "; ".join(probs))


def stack_nvfp4_experts(layer, experts: Mapping[int, Mapping[str, torch.Tensor | None]], num_experts: int, *,
                        proj: str = "up_proj", shape: tuple[int, int] | None = None) -> NVFP4Weight:
    """Validate and stack one projection of experts ``0..E-1`` into an ``[E, N, K]`` :class:`NVFP4Weight`.

    ``experts[e]`` maps ``weight``/``weight_scale``/``weight_scale_2``/``input_scale`` to tensors.

    Raises:
        NVFP4Error: as :func:`validate_nvfp4_experts`, or experts of different shapes.
    """
    validate_nvfp4_experts(layer, {e: {proj: t} for e, t in experts.items()}, num_experts=num_experts,
                           projs=(proj,), shapes={proj: shape} if shape else None)
    shapes = {tuple(experts[e]["weight"].shape) for e in range(num_experts)}
    if len(shapes) != 1:
        raise NVFP4Error(f"NVFP4 checkpoint: layer {layer}: {proj} experts have different shapes {sorted(shapes)}")
    ins = [experts[e].get("input_scale") for e in range(num_experts)]
    return NVFP4Weight(
        torch.stack([experts[e]["weight"] for e in range(num_experts)]),
        torch.stack([experts[e]["weight_scale"].view(torch.float8_e4m3fn) for e in range(num_experts)]),
        torch.stack([experts[e]["weight_scale_2"].reshape(()) for e in range(num_experts)]),
        None if any(i is None for i in ins) else torch.stack([i.reshape(()) for i in ins]))
