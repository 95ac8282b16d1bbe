"""The computing half of the weight formats (the declarative half: :mod:`unified_models.dsl.weights`).

:data:`WEIGHT_FORMATS` maps a format name to its :class:`WeightFormatRules`:
the linear itself (over :mod:`unified_models.ops`), the grouped form the MoE
experts op takes, quantize (master -> stored codes and scales), dequantize,
the fake-quantized master the fp32/fp64 oracles compute with, validation of
stored tensors, and the NVIDIA ModelOpt ``quant_algo`` it is exported as.

Layers never branch on formats: a linear is one call,
:func:`apply_linear` (``ModelSpec.weight_format(name)`` picks the rule; no
entry = ``ops.linear`` in the model dtype), and the routed experts' stacks
come from :func:`grouped_weight`. Adding a format (DeepSeek block-FP8, MXFP4)
is one :class:`~unified_models.dsl.weights.FormatLayout` entry, one entry
here, and its kernels.

Shapes: T tokens, N output features, K input features, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .. import ops
from ..dsl import SpecError
from ..dsl.weights import LinearFormat

Tensors = Mapping[str, torch.Tensor]
"""Field (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``) -> tensor of one linear."""


def _fields(params: Mapping[str, torch.Tensor], name: str, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {f: params[f"{name}.{f}"] for f in fields if f"{name}.{f}" in params}


def _no_single_linear(fmt_name: str):
    def linear(x_TK, t: Tensors, fmt: LinearFormat, bias_N, out_dtype):
        raise SpecError(f"weight format {fmt_name!r} is implemented for the routed experts only (ops.moe_experts); "
                        "a plain linear in this format has no kernel")
    return linear


def _no_grouped(fmt_name: str):
    def grouped(stacks: Tensors, fmt: LinearFormat):
        raise SpecError(f"weight format {fmt_name!r} has no grouped (MoE experts) kernel; experts support: "
                        f"{sorted(n for n, r in WEIGHT_FORMATS.items() if r.grouped_kernel)}")
    return grouped


@dataclass(frozen=True, kw_only=True)
class WeightFormatRules:
    """The rules of one weight format.

    Attributes:
        linear: ``(x_TK, tensors, fmt, bias_N, out_dtype) -> y_TN`` (stored tensors
            when ``fmt.stored``, else the master ``weight`` + ``input_scale``).
        grouped: ``(stacks, fmt) -> weight`` handed to ``ops.moe_experts`` for ``[E, N, K]``
            stacks of the experts' fields.
        grouped_kernel: the ``ops.moe_experts`` weight kind (``"nvfp4"``) or None.
        quantize: ``master [N, K] -> {field: stored tensor}`` (``input_scale`` excluded:
            calibrated, never derived).
        dequantize: ``(stored tensors, dtype) -> [N, K]`` weight.
        problems: ``(stored tensors, (N, K), fmt) -> [message]`` of a checkpoint's tensors.
        modelopt_algo: ``fmt -> quant_algo`` of ModelOpt's ``quantized_layers`` entry, or
            None for a format ModelOpt does not write (block-FP8: DeepSeek's own config).
        modelopt_entry: extra fields of that entry (``group_size``).
    """

    linear: Callable[..., torch.Tensor]
    grouped: Callable[[Tensors, LinearFormat], Any]
    grouped_kernel: str | None
    quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    dequantize: Callable[[Tensors, torch.dtype], torch.Tensor]
    problems: Callable[[Tensors, tuple[int, int], LinearFormat], list[str]]
    modelopt_algo: Callable[[LinearFormat], str] | None
    modelopt_entry: Mapping[str, Any] = ()

    def fake_quantized(self, w: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(w))`` in ``w``'s dtype, straight-through to ``w`` (the oracles'
        form of a master weight)."""
        wq = self.dequantize(self.quantize(w.detach().float()), torch.float32).to(w.dtype)
        return w + (wq - w).detach()


# ----------------------------------------------------------------------------- FP8 per tensor (ModelOpt FP8)

def _fp8_linear(x_TK, t: Tensors, fmt: LinearFormat, bias_N, out_dtype):
    if fmt.stored:
        w = ops.FP8Weight(t["weight"], t["weight_scale"], t["input_scale"])
        return ops.fp8_linear(x_TK, w, None, bias_N, out_dtype=out_dtype)
    return ops.fp8_linear(x_TK, t["weight"], t["input_scale"], bias_N, out_dtype=out_dtype)


def _fp8_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from ..ops.fp8 import fp8_quantize_weight, fp8_weight_scale

    s = fp8_weight_scale(w)
    return {"weight": fp8_quantize_weight(w, s), "weight_scale": s}


def _fp8_dequantize(t: Tensors, dtype: torch.dtype) -> torch.Tensor:
    return (t["weight"].float() * t["weight_scale"].float().reshape(())).to(dtype)


def _fp8_problems(t: Tensors, shape: tuple[int, int], fmt: LinearFormat) -> list[str]:
    from ..ops.fp8.common import fp8_problems

    return fp8_problems(t.get("weight"), t.get("weight_scale"), t.get("input_scale"), shape=shape)


# ----------------------------------------------------------------------------- NVFP4 (ModelOpt W4A16_NVFP4 / NVFP4)

def _nvfp4_grouped(stacks: Tensors, fmt: LinearFormat):
    if not fmt.stored:
        return stacks["weight"]  # masters: ops.moe_experts quantizes them by ModelOpt's rule
    return ops.NVFP4Weight(stacks["weight"], stacks["weight_scale"], stacks["weight_scale_2"],
                           stacks.get("input_scale"))


def _nvfp4_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q = ops.nvfp4_quantize(w)
    return {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2.reshape(())}


def _nvfp4_dequantize(t: Tensors, dtype: torch.dtype) -> torch.Tensor:
    q = ops.NVFP4Weight(t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(()))
    return ops.nvfp4_dequantize(q, dtype)


def _nvfp4_problems(t: Tensors, shape: tuple[int, int], fmt: LinearFormat) -> list[str]:
    from ..ops.nvfp4 import nvfp4_problems

    return nvfp4_problems(t.get("weight"), t.get("weight_scale"), t.get("weight_scale_2"), t.get("input_scale"),
                          shape=shape, require_input_scale=fmt.input_scale)


# ----------------------------------------------------------------------------- block FP8 (DeepSeek, ue8m0)

def _fp8_block_linear(x_TK, t: Tensors, fmt: LinearFormat, bias_N, out_dtype):
    from ..ops.fp8_block import FP8BlockWeight, fp8_block_linear

    w = FP8BlockWeight(t["weight"], t["weight_scale_inv"]) if fmt.stored else t["weight"]
    return fp8_block_linear(x_TK, w, bias_N, out_dtype=out_dtype)


def _fp8_block_grouped(stacks: Tensors, fmt: LinearFormat):
    from ..ops.fp8_block import FP8BlockExperts, FP8BlockMaster

    if not fmt.stored:
        return FP8BlockMaster(stacks["weight"])  # quantized by the experts op on every call (straight-through)
    return FP8BlockExperts(stacks["weight"], stacks["weight_scale_inv"])


def _fp8_block_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from ..ops.fp8_block import fp8_block_quantize_weight

    q, s = fp8_block_quantize_weight(w)
    return {"weight": q, "weight_scale_inv": s}


def _fp8_block_dequantize(t: Tensors, dtype: torch.dtype) -> torch.Tensor:
    from ..ops.fp8_block import fp8_block_dequantize

    return fp8_block_dequantize(t["weight"], t["weight_scale_inv"], dtype)


def _fp8_block_problems(t: Tensors, shape: tuple[int, int], fmt: LinearFormat) -> list[str]:
    from ..ops.fp8_block import fp8_block_problems

    return fp8_block_problems(t.get("weight"), t.get("weight_scale_inv"), shape=shape)


# ----------------------------------------------------------------------------- MXFP4 (DeepSeek-V4-Flash routed experts)

def _mxfp4_grouped(stacks: Tensors, fmt: LinearFormat):
    from ..ops.mxfp4 import MXFP4Master, MXFP4Weight

    if not fmt.stored:
        return MXFP4Master(stacks["weight"])  # quantized by the experts op on every call (straight-through)
    return MXFP4Weight(stacks["weight"], stacks["weight_scale"])


def _mxfp4_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from ..ops.mxfp4 import mxfp4_quantize

    q = mxfp4_quantize(w)
    return {"weight": q.weight, "weight_scale": q.weight_scale}


def _mxfp4_dequantize(t: Tensors, dtype: torch.dtype) -> torch.Tensor:
    from ..ops.mxfp4 import MXFP4Weight, mxfp4_dequantize

    return mxfp4_dequantize(MXFP4Weight(t["weight"], t["weight_scale"]), dtype)


def _mxfp4_problems(t: Tensors, shape: tuple[int, int], fmt: LinearFormat) -> list[str]:
    from ..ops.mxfp4 import mxfp4_problems

    return mxfp4_problems(t.get("weight"), t.get("weight_scale"), shape=shape)


WEIGHT_FORMATS: dict[str, WeightFormatRules] = {
    "fp8": WeightFormatRules(linear=_fp8_linear, grouped=_no_grouped("fp8"), grouped_kernel=None,
                             quantize=_fp8_quantize, dequantize=_fp8_dequantize, problems=_fp8_problems,
                             modelopt_algo=lambda fmt: "FP8"),
    "nvfp4": WeightFormatRules(linear=_no_single_linear("nvfp4"), grouped=_nvfp4_grouped, grouped_kernel="nvfp4",
                               quantize=_nvfp4_quantize, dequantize=_nvfp4_dequantize, problems=_nvfp4_problems,
                               modelopt_algo=lambda fmt: "NVFP4" if fmt.input_scale else "W4A16_NVFP4",
                               modelopt_entry={"group_size": 16}),
    "fp8_block": WeightFormatRules(linear=_fp8_block_linear, grouped=_fp8_block_grouped, grouped_kernel="fp8_block",
                                   quantize=_fp8_block_quantize, dequantize=_fp8_block_dequantize,
                                   problems=_fp8_block_problems, modelopt_algo=None),
    "mxfp4": WeightFormatRules(linear=_no_single_linear("mxfp4"), grouped=_mxfp4_grouped, grouped_kernel="mxfp4",
                               quantize=_mxfp4_quantize, dequantize=_mxfp4_dequantize, problems=_mxfp4_problems,
                               modelopt_algo=None),
}
"""Format name -> its rules (keys equal :data:`unified_models.dsl.weights.FORMAT_LAYOUTS`'s)."""


def format_rules(fmt: LinearFormat) -> WeightFormatRules:
    """The rules of ``fmt``'s format.

    Raises:
        SpecError: a format with a layout but no rules (names it).
    """
    rules = WEIGHT_FORMATS.get(fmt.format)
    if rules is None:
        raise SpecError(f"weight format {fmt.format!r} has no rules in layers.weight_formats.WEIGHT_FORMATS")
    return rules


def linear_fields(fmt: LinearFormat | None) -> tuple[str, ...]:
    """The tensor fields of one linear in ``fmt`` (``("weight",)`` for a model-dtype linear)."""
    if fmt is None:
        return ("weight",)
    from ..dsl.weights import linear_tensors

    return tuple(n.split(".")[-1] for n in linear_tensors("l", fmt, 1, 1 << 10, torch.float32))


def apply_linear(model: Any, params: Mapping[str, torch.Tensor], name: str, x_TK: torch.Tensor,
                 bias_N: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The linear module ``name`` (HF name without ``.weight``) in its weight format: ``[T, K] -> [T, N]``.

    Args:
        model: the ``ModelSpec`` (its :meth:`~unified_models.dsl.ModelSpec.weight_format` table).
        params: HF name -> tensor.
        name: the linear's module name.
        x_TK: input in the model dtype.
        bias_N: optional bias.
        out_dtype: default ``x_TK.dtype``.

    Raises:
        SpecError: a format without a single-linear kernel (names the format).
    """
    fmt = model.weight_format(name)
    if fmt is None:
        return ops.linear(x_TK, params[f"{name}.weight"], bias_N, out_dtype=out_dtype)
    rules = format_rules(fmt)
    return rules.linear(x_TK, _fields(params, name, linear_fields(fmt)), fmt, bias_N, out_dtype or x_TK.dtype)


def dequantized_weight(model: Any, params: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight of linear ``name`` for a layer that runs it as plain model-dtype GEMMs
    (W8A16: no activation quantization; DeepSeek-V4's grouped ``wo_a``, which the published
    reference dequantizes to bf16 and runs so): the weight itself without a format; stored codes
    dequantized by the format's rule; a master fake-quantized by the same rule, straight-through
    (:meth:`WeightFormatRules.fake_quantized`). For ``fp8_block`` both are exact in bf16 (e4m3 times
    a power of two), so stored codes and their master give the same bits.

    Raises:
        KeyError: a stored field missing from ``params``.
    """
    fmt = model.weight_format(name)
    if fmt is None:
        return params[f"{name}.weight"]
    rules = format_rules(fmt)
    if fmt.stored:
        return rules.dequantize(_fields(params, name, linear_fields(fmt)), dtype)
    return rules.fake_quantized(params[f"{name}.weight"])


def grouped_weight(model: Any, stacks: Mapping[str, torch.Tensor], linears: list[str]) -> tuple[Any, str | None]:
    """The ``ops.moe_experts`` weight of equally formatted linears (the routed experts of one
    projection) from their ``[E, ...]`` field stacks.

    Returns:
        ``(weight, kind)``: ``kind`` None = a model-dtype ``[E, N, K]`` stack, ``"nvfp4"``
        = NVFP4 (an ``ops.NVFP4Weight`` of stored codes, or masters quantized in the op),
        ``"mxfp4"`` = MXFP4 W4A8 (an ``ops.mxfp4.MXFP4Weight`` of stored codes, or an
        ``ops.mxfp4.MXFP4Master`` the DeepSeek-V4 experts op quantizes on every call).

    Raises:
        SpecError: the linears' formats differ, or the format has no grouped kernel.
    """
    fmts = {model.weight_format(n) for n in linears}
    if len(fmts) != 1:
        raise SpecError(f"{linears[0]}...: the experts of one projection have different weight formats "
                        f"{sorted(str(f) for f in fmts)}")
    fmt = next(iter(fmts))
    if fmt is None:
        return stacks["weight"], None
    rules = format_rules(fmt)
    return rules.grouped(stacks, fmt), rules.grouped_kernel


def expert_linear_weight(model: Any, params: Mapping[str, torch.Tensor], name: str) -> tuple[Any, str | None]:
    """One linear ``name`` as an experts-op weight (a layer's shared expert, run by the routed experts'
    kernel with one expert): :func:`grouped_weight` of its own ``[N, ...]`` fields.

    Returns:
        ``(weight, kind)`` as :func:`grouped_weight` (a ``[N, K]`` tensor, or the format's expert type).

    Raises:
        SpecError: the format has no grouped kernel. KeyError: a field missing from ``params``.
    """
    fmt = model.weight_format(name)
    return grouped_weight(model, _fields(params, name, linear_fields(fmt)), [name])


def oracle_weight(model: Any, name: str, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The weight an fp32/fp64 oracle computes linear ``name`` with: the model-dtype weight, or a
    master's fake-quantized form (straight-through) when the linear has a format.

    Raises:
        SpecError: the linear is stored in its format (oracles take masters:
            ``converters.modelopt.master_spec``).
    """
    w = params[f"{name}.weight"]
    fmt = model.weight_format(name)
    if fmt is None:
        return w
    if fmt.stored:
        raise SpecError(f"{name}: the oracles take master weights; convert the stored {fmt.format!r} codes first "
                        "(unified_models.converters.modelopt.master_spec / dequantize_state_dict)")
    return format_rules(fmt).fake_quantized(w)


def weight_problems(model: Any, name: str, state: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> list[str]:
    """Problems of linear ``name``'s stored tensors in ``state`` (``[N, K]`` = ``shape``), each
    prefixed with the linear's name; a master-form linear checks its input scale only."""
    fmt = model.weight_format(name)
    if fmt is None:
        return []
    t = _fields(state, name, linear_fields(fmt))
    if fmt.stored:
        probs = format_rules(fmt).problems(t, shape, fmt)
    else:
        from ..ops.scales import scalar_scale_problems

        probs = scalar_scale_problems("input_scale", t.get("input_scale"), required=True) if fmt.input_scale else []
    return [f"{name}: {p}" for p in probs]
