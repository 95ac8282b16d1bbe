"""Forward of :class:`~unified_models.dsl.Mamba2Spec`: the Mamba-2 mixer over the layer's state slots.

``in_proj -> split z | xBC | dt -> causal conv1d + SiLU (conv state) -> dt
(softplus, bias, limits) -> SSD chunked scan (boundary state + pending chunk
rows) -> gated grouped RMSNorm -> out_proj``, every step an op of
:mod:`unified_models.ops` (DESIGN.md rule 8: decode re-executes the chunked
math of the current chunk, so prefill, chunked prefill, decode and training
give the same bits).

The batch description (:class:`~unified_models.ops.Mamba2Metadata`) is built
once per forward from the Mamba group's ``slots_B`` / ``start_B`` /
``cu_seqlens_B1`` (:class:`~unified_models.state.SlotState`) and kept in
``ctx.cache`` for every Mamba layer of the forward.

Shapes: T tokens, B sequences, D hidden, H heads, P head dim, G groups,
N state size, F = H*P, C = F + 2GN conv channels, W conv width.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import ops
from ..caches import SlotStateCache
from ..dsl import Mamba2Spec, SpecError
from ..dsl.mamba2 import QUANTIZABLE_PROJS
from ..ops._dispatch import use_triton
from ..ops.mamba2 import (Mamba2State, causal_conv1d_reference, gated_rms_norm_reference, mamba2_dt_reference,
                          ssd_reference)
from ..porting import taps
from ..state import FlatBatch, SlotState, StateStore
from .common import LayerContext, bias_getter
from .family import LayerFamily
from .oracle import linear_oracle
from .quantization import QuantizationOptions, QuantizationRules, Track
from .weight_formats import apply_linear

CACHE = "state_cache"
"""The layer's one cache: its state slots (forward-context name ``<mixer>.state_cache`` in vLLM)."""

STATE_ORDER: tuple[str, ...] = ("ssm", "dt", "conv", "x", "B")
"""Order of the ``Mamba2State`` tensors in a slot (vLLM packs them into one page in
this order; fp32 first keeps every offset aligned to its element size)."""


def state_layout(spec: Mamba2Spec, model_dtype: torch.dtype) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """``(name, per-slot shape, dtype)`` of each state tensor, in :data:`STATE_ORDER`::

        ssm  [H, P, N]     fp32
        dt   [Q-1, H]      fp32
        conv [W-1, C]      model dtype
        x    [Q-1, H, P]   model dtype
        B    [Q-1, G, N]   model dtype
    """
    shapes = Mamba2State.shapes(**spec.state_kwargs())
    out = []
    for name in STATE_ORDER:
        shape, role = shapes[name]
        out.append((name, tuple(int(s) for s in shape), torch.float32 if role == "fp32" else model_dtype))
    return tuple(out)


def _cu_from_seq_idx(seq_idx_T: torch.Tensor, num_seqs: int | None) -> torch.Tensor:
    """``cu_seqlens [B+1]`` of a batch whose tokens are grouped by sequence in row order.

    Raises:
        ValueError: ``seq_idx`` is not non-decreasing or names a row >= ``num_seqs``.
    """
    seq = seq_idx_T.long()
    t = seq.shape[0]
    if t and (bool((seq[1:] < seq[:-1]).any()) or int(seq.min()) < 0):
        raise ValueError("mamba2: FlatBatch.seq_idx must be grouped by sequence in row order (non-decreasing); "
                         "pass MambaState.cu_seqlens_B1 for other layouts")
    b = num_seqs if num_seqs is not None else (int(seq.max()) + 1 if t else 0)
    if t and int(seq.max()) >= b:
        raise ValueError(f"mamba2: seq_idx names row {int(seq.max())} but the Mamba group has {b} sequences")
    counts = torch.bincount(seq, minlength=b) if t else torch.zeros(b, dtype=torch.int64, device=seq.device)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def mamba2_batch_metadata(spec: Mamba2Spec, batch: FlatBatch, ms: SlotState | None,
                          ctx: LayerContext) -> ops.Mamba2Metadata:
    """The batch's :class:`~unified_models.ops.Mamba2Metadata`, built once per forward.

    Keyed in ``ctx.cache`` by the chunk size and the identity of the group's
    ``slots_B``/``start_B``/``cu_seqlens_B1`` (the entry holds them, so the
    ids cannot be reused during the forward). ``ms is None`` (profiling run):
    stateless, every sequence from position 0. A decode step (``ms.uniform_decode``) on
    the Triton kernels is described on the device (:func:`~unified_models.ops.mamba2_decode_metadata`:
    no host read, so vLLM can capture it in a CUDA graph).
    """
    objs = (ms.slots_B, ms.start_B, ms.cu_seqlens_B1) if ms is not None else (None, None, None)
    key = ("mamba2_metadata", spec.chunk_size, batch.seq_idx.shape[0], *(id(o) for o in objs))
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit[0]
    t = batch.seq_idx.shape[0]
    if ms is None:
        cu = _cu_from_seq_idx(batch.seq_idx, None)
        meta = ops.mamba2_metadata(cu, torch.zeros(cu.shape[0] - 1, dtype=torch.int64, device=cu.device),
                                   spec.chunk_size, num_tokens=t)
    elif ms.uniform_decode and ms.cu_seqlens_B1 is not None and use_triton(ms.slots_B):
        # decode step: no host read, fixed shapes (CUDA graphs); same bits as the general form
        meta = ops.mamba2_decode_metadata(ms.cu_seqlens_B1, ms.start_B, ms.slots_B, spec.chunk_size, t)
    else:
        b = ms.slots_B.shape[0]
        cu = ms.cu_seqlens_B1 if ms.cu_seqlens_B1 is not None else _cu_from_seq_idx(batch.seq_idx, b)
        hint = ms.host_layout if ms.cu_seqlens_B1 is not None else None  # vLLM's host copies: no device read
        meta = ops.mamba2_metadata(cu, ms.start_B, spec.chunk_size, num_tokens=t, state_idx_B=ms.slots_B,
                                   host_layout=hint, layout_cache=ctx.cache)  # one layout build per step
    ctx.cache[key] = (meta, objs, batch.seq_idx)
    return meta


def mamba2_forward(spec: Mamba2Spec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                   batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """The Mamba-2 mixer: ``[T, D] -> [T, D]``, reading and writing the layer's state slots.

    ``store.state(layer_index, "state_cache")`` gives the layer's slots and the group's
    ``slots_B``/``start_B``; ``None`` (profiling) runs stateless from position 0.
    Rounding points (as vLLM's mixer and transformers' torch path): in_proj
    output and conv output in the model dtype, dt and the scan in fp32, the
    gated norm rounds once to the model dtype, out_proj. With
    a weight format on ``in_proj``/``out_proj`` (``ModelSpec.weight_formats``,
    e.g. FP8 W8A8) they run through :func:`.weight_formats.apply_linear`.
    """
    p = spec.name
    t = x_TD.shape[0]
    H, P, G, N = spec.num_heads, spec.head_dim, spec.n_groups, spec.ssm_state_size
    F, C, W = spec.intermediate_size, spec.conv_dim, spec.conv_kernel
    bias = bias_getter(p, params, spec.use_bias)
    zxbcdt = apply_linear(ctx.model, params, f"{p}.in_proj", x_TD, bias("in_proj"))  # [T, F + C + H]
    if taps.SINK is not None: zxbcdt = taps.SINK(f"{p}.in_proj", zxbcdt)
    z_TF, xBC_TC, dt_TH = zxbcdt.split([F, C, H], dim=-1)
    ms = store.state(layer_index, CACHE)
    meta = mamba2_batch_metadata(spec, batch, ms, ctx)
    state = ms.state if ms is not None else None
    conv_b = params[f"{p}.conv1d.bias"] if spec.use_conv_bias else None
    xBC_TC = ops.causal_conv1d(xBC_TC, params[f"{p}.conv1d.weight"].view(C, W), conv_b, meta, state)
    if taps.SINK is not None: xBC_TC = taps.SINK(f"{p}.conv1d", xBC_TC)
    x_TF, B_TGN, C_TGN = xBC_TC.split([F, G * N, G * N], dim=-1)
    dt_TH = ops.mamba2_dt(dt_TH, params[f"{p}.dt_bias"], spec.time_step_limit)
    if taps.SINK is not None: dt_TH = taps.SINK(f"{p}.dt", dt_TH)
    y_THP = ops.ssd_chunk_scan(x_TF.view(t, H, P), dt_TH, params[f"{p}.A_log"], B_TGN.view(t, G, N),
                               C_TGN.view(t, G, N), params[f"{p}.D"], meta, state, out_dtype=torch.float32)
    if taps.SINK is not None: y_THP = taps.SINK(f"{p}.ssm_scan", y_THP)
    y_TF = ops.gated_rms_norm(y_THP.reshape(t, F), z_TF, params[f"{p}.norm.weight"], spec.group_size, spec.eps,
                              out_dtype=x_TD.dtype)
    if taps.SINK is not None: y_TF = taps.SINK(f"{p}.norm", y_TF)
    o_TD = apply_linear(ctx.model, params, f"{p}.out_proj", y_TF, bias("out_proj"))
    if taps.SINK is not None: o_TD = taps.SINK(f"{p}.out_proj", o_TD)
    return o_TD


def mamba2_caches(spec: Mamba2Spec, model_dtype: torch.dtype) -> dict[str, SlotStateCache]:
    """One slot-state cache: :func:`state_layout`, viewed as an ``ops.Mamba2State``."""
    return {CACHE: SlotStateCache(layout=state_layout(spec, model_dtype), view=Mamba2State)}


def mamba2_oracle(m: Mamba2Spec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """One sequence from position 0 with the ops' fp64 oracles (conv, dt, SSD, gated
    norm), result in ``x_TD.dtype``. Quantized projections come fake-quantized in ``params``
    (the reference model's view); FP8 activation quantization is not modelled."""
    t, dtype = x_TD.shape[0], x_TD.dtype
    H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
    F, C = m.intermediate_size, m.conv_dim
    zxbcdt = linear_oracle(x_TD, params, m.name + ".in_proj", m.use_bias)
    z, xBC, dt = zxbcdt.split([F, C, H], dim=-1)
    conv_b = params[m.name + ".conv1d.bias"] if m.use_conv_bias else None
    xBC = causal_conv1d_reference(xBC, params[m.name + ".conv1d.weight"][:, 0, :], conv_b).to(dtype)
    xs, B, Cm = xBC.split([F, G * N, G * N], dim=-1)
    dt = mamba2_dt_reference(dt, params[m.name + ".dt_bias"], m.time_step_limit)
    y, _ = ssd_reference(xs.reshape(t, H, P), dt, params[m.name + ".A_log"], B.reshape(t, G, N),
                         Cm.reshape(t, G, N), params[m.name + ".D"])
    y = gated_rms_norm_reference(y.reshape(t, F), z, params[m.name + ".norm.weight"], m.group_size, m.eps)
    return linear_oracle(y.to(dtype), params, m.name + ".out_proj", m.use_bias)


def _log_1_to_h(p: torch.Tensor) -> None:
    p.copy_(torch.log(torch.arange(1, p.shape[0] + 1, dtype=torch.float32, device=p.device)).to(p.dtype))


def mamba2_init_rules(m: Mamba2Spec) -> dict:
    """As transformers' ``NemotronHMamba2Mixer``: ``A_log = log(1..H)``, ``D = 1``,
    ``dt_bias = 1``, gated-norm weight 1."""
    return {f"{m.name}.A_log": _log_1_to_h, f"{m.name}.D": lambda p: p.fill_(1.0),
            f"{m.name}.dt_bias": lambda p: p.fill_(1.0), f"{m.name}.norm.weight": lambda p: p.fill_(1.0)}


def mamba2_megatron_fields(m: Mamba2Spec) -> dict:
    """Megatron's Mamba sizes (``mamba_{num_heads,head_dim,num_groups,state_dim}``)."""
    return dict(mamba_num_heads=m.num_heads, mamba_head_dim=m.head_dim, mamba_num_groups=m.n_groups,
                mamba_state_dim=m.ssm_state_size)


# ----------------------------------------------------------------------------- quantization (FP8 in/out_proj)

def mamba2_linears(m: Mamba2Spec) -> dict[str, str]:
    """``in_proj`` and ``out_proj``: export role ``"mamba_proj"`` (FP8 W8A8 in ModelOpt's exports)."""
    return {f"{m.name}.{proj}": "mamba_proj" for proj in QUANTIZABLE_PROJS}


def mamba2_check_formats(m: Mamba2Spec, weight_format) -> None:
    """Both projections FP8, or neither (the published hybrids; vLLM's mixer takes one method for both)."""
    fmts = {proj: weight_format(f"{m.name}.{proj}") for proj in QUANTIZABLE_PROJS}
    kinds = {None if f is None else f.format for f in fmts.values()}
    if kinds not in ({None}, {"fp8"}):
        raise SpecError(f"{m.name}: Mamba projections in formats "
                        f"{ {p: None if f is None else f.format for p, f in fmts.items()} }; supported: both "
                        "'fp8' or neither")


def mamba2_calibration_hooks(m: Mamba2Spec, mod: Any, options: QuantizationOptions, track: Track) -> list:
    """The input of each FP8 projection (its ``input_scale``)."""
    hooks = []
    if options.mamba_proj:
        for proj in QUANTIZABLE_PROJS:
            hooks.append(getattr(mod, proj).register_forward_pre_hook(
                lambda _m, args, n=f"{m.name}.{proj}.input_scale": track(n, args[0])))
    return hooks


QUANTIZATION = QuantizationRules(linears=mamba2_linears, check_formats=mamba2_check_formats,
                                 calibration_hooks=mamba2_calibration_hooks)

FAMILY = LayerFamily(spec_type=Mamba2Spec, forward=mamba2_forward, oracle=mamba2_oracle, caches=mamba2_caches,
                     init_rules=mamba2_init_rules, megatron_fields=mamba2_megatron_fields, quantization=QUANTIZATION)
