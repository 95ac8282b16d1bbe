"""The Mamba-2 ops without autograd: argument and state checks, then the Triton kernels
(:mod:`.triton`) on GPU or the CPU path (:mod:`.cpu`), then the state updates that
both share (:func:`write_conv_state`, :func:`commit_ssd_state`: exact copies)."""

from __future__ import annotations

import math

import torch

from .._dispatch import host_to_device, use_triton
from .common import Mamba2Metadata, Mamba2State, _need_state
from .cpu import causal_conv1d_torch, gated_rms_norm_torch, mamba2_dt_torch, ssd_chunk_scan_torch


def causal_conv1d(x_TC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
                  meta: Mamba2Metadata, state: Mamba2State | None = None) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU over a THD batch, continuing each sequence's conv state.

    ``y[t, c] = silu(sum_{w=0}^{W-1} weight[c, w] * in[pos_t - (W-1) + w, c] + bias[c])``,
    fp32, taps added in order w = 0..W-1, then the bias, rounded once to
    ``x_TC.dtype``. Inputs at positions before this batch come from
    ``state.conv``; negative positions are zero. Afterwards ``state.conv`` holds
    the last W-1 inputs of every (non-padding) sequence.

    Args:
        x_TC: ``[T, C]`` conv inputs (xBC of in_proj; any strides).
        weight_CW: ``[C, W]`` (HF ``conv1d.weight[:, 0, :]``); bias_C: ``[C]`` or None.
        meta: :func:`mamba2_metadata` of the batch; state: the layer's state or None.

    Returns:
        ``[T, C]`` in ``x_TC.dtype``; padding rows are 0.

    Raises:
        ValueError: shape mismatch or state/metadata mismatch.
    """
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(f"causal_conv1d: x {tuple(x_TC.shape)} must be [T, C] and weight "
                         f"{tuple(weight_CW.shape)} [C, W]")
    if bias_C is not None and bias_C.shape != (x_TC.shape[1],):
        raise ValueError(f"causal_conv1d: bias {tuple(bias_C.shape)} must be [{x_TC.shape[1]}]")
    if x_TC.shape[0] != meta.num_tokens:
        raise ValueError(f"causal_conv1d: x has {x_TC.shape[0]} rows, metadata {meta.num_tokens}")
    _need_state(meta, state, "causal_conv1d")
    W = weight_CW.shape[1]
    if state is not None and (state.conv.dim() != 3 or state.conv.shape[1:] != (W - 1, x_TC.shape[1])):
        raise ValueError(f"causal_conv1d: conv state {tuple(state.conv.shape)} must be [S, {W - 1}, {x_TC.shape[1]}]")
    _check_decode(meta, x_TC, "causal_conv1d")
    if use_triton(x_TC):
        from .triton import causal_conv1d_triton

        y = causal_conv1d_triton(x_TC, weight_CW, bias_C, meta, state)
    else:
        y = causal_conv1d_torch(x_TC, weight_CW, bias_C, meta, state)
    if state is not None and meta.uniform_decode:
        from .decode import write_conv_tail

        write_conv_tail(x_TC, meta, state)
    elif state is not None:
        write_conv_state(x_TC, meta, state)
    return y


def _check_decode(meta: Mamba2Metadata, x: torch.Tensor, name: str) -> None:
    """A :func:`.common.mamba2_decode_metadata` runs only on the Triton kernels (it has no host lists)."""
    if meta.uniform_decode and not use_triton(x):
        raise ValueError(f"{name}: decode-step metadata (mamba2_decode_metadata) needs the Triton kernels "
                         "(CUDA tensors, or UM_OPS_BACKEND=triton); build mamba2_metadata for the CPU path")


def write_conv_state(x_TC: torch.Tensor, meta: Mamba2Metadata, state: Mamba2State) -> None:
    """``state.conv[slot]`` <- inputs at positions ``end-(W-1) .. end-1`` of each sequence (exact copies).

    Rows for negative positions are written as 0 (never read). Shared by both engines.
    """
    Wm1, C = state.conv.shape[1], state.conv.shape[2]
    T = x_TC.shape[0]
    key = ("conv_write", Wm1, T, str(x_TC.device))
    if key not in meta.host:
        # the row indices follow from the layout alone: built once per step (``layout_ops`` is shared by
        # the step's slot groups, :func:`.common.mamba2_metadata`); the slots are the group's own
        shared = meta.host.setdefault("layout_ops", {})
        if key not in shared:
            shared[key] = _conv_write_rows(meta.host, Wm1, T, x_TC.device)
        slots = meta.slot.to(x_TC.device)[meta.conv_seqs.to(x_TC.device)]  # on the device: no host slots needed
        meta.host[key] = (slots, *shared[key])
    slots, nb, from_x, x_row, old_row = meta.host[key]
    if nb == 0 or Wm1 == 0:
        return
    # the kept rows gathered from x and from the old state without copying all of x into one table
    # (that copy of [T, C] was ~0.4 ms per layer at 16k-token prefill steps); exact copies either way
    old = torch.cat([state.conv[slots].reshape(-1, C), state.conv.new_zeros((1, C))])
    rows = old[old_row]
    if T:
        rows = torch.where(from_x[..., None], x_TC[x_row].to(state.conv.dtype), rows)
    state.conv[slots] = rows


def _conv_write_rows(host: dict, Wm1: int, T: int, device: torch.device) -> tuple:
    """``(nb, from_x, x_row, old_row)`` of :func:`write_conv_state`: for each of the ``nb`` sequences
    written and each kept position, whether the row comes from ``x`` (else the old state or a zero row),
    its row in ``x`` and its row in ``[old state rows; a zero row]`` (``[nb, W-1]`` each, on ``device``)."""
    c = host["cpu"]
    seqs = torch.tensor(host["conv_seqs"], dtype=torch.int64)
    nb = seqs.shape[0]
    zero = T + nb * Wm1
    L, p0, cu = c["L"][seqs].view(-1, 1), c["p0"][seqs].view(-1, 1), c["cu"][seqs].view(-1, 1)
    j = torch.arange(Wm1).view(1, -1)
    q = p0 + L - Wm1 + j  # [nb, W-1] positions kept
    idx = torch.where(q >= p0, cu + q - p0, zero)
    idx = torch.where((q < p0) & (q >= 0), T + torch.arange(nb).view(-1, 1) * Wm1 + j + L, idx)
    idx = host_to_device(idx, device)  # [nb, W-1] rows of [x; the old state rows; a zero row]
    return nb, idx < T, idx.clamp(max=max(T - 1, 0)), (idx - T).clamp(min=0)


def mamba2_dt(dt_TH: torch.Tensor, dt_bias_H: torch.Tensor,
              dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in fp32 (softplus threshold 20).

    Args:
        dt_TH: ``[T, H]`` raw dt (the last H columns of in_proj, any strides).
        dt_bias_H: ``[H]``.
        dt_limit: ``(lo, hi)``, the config's ``time_step_limit``.

    Returns:
        fp32 ``[T, H]``, elementwise (row-independent).
    """
    if dt_TH.dim() != 2 or dt_bias_H.shape != (dt_TH.shape[1],):
        raise ValueError(f"mamba2_dt: dt {tuple(dt_TH.shape)} must be [T, H], bias {tuple(dt_bias_H.shape)} [H]")
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if use_triton(dt_TH):
        from .triton import mamba2_dt_triton

        return mamba2_dt_triton(dt_TH, dt_bias_H, lo, hi)
    return mamba2_dt_torch(dt_TH, dt_bias_H, lo, hi)


def ssd_chunk_scan(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_log_H: torch.Tensor, B_TGN: torch.Tensor,
                   C_TGN: torch.Tensor, D_H: torch.Tensor | None, meta: Mamba2Metadata,
                   state: Mamba2State | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The SSD chunked scan over a THD batch, chunks aligned at absolute positions.

    Args:
        x_THP: ``[T, H, P]`` conv output x (model dtype, any strides).
        dt_TH: fp32 ``[T, H]`` from :func:`mamba2_dt`.
        A_log_H: ``[H]``; ``A = -exp(A_log)`` in fp32.
        B_TGN, C_TGN: ``[T, G, N]``; head h uses group ``h // (H // G)``.
        D_H: ``[H]`` skip (or None).
        meta: :func:`mamba2_metadata` (its ``chunk_size`` is Q).
        state: the layer's :class:`Mamba2State` (read, then updated in place:
            boundary state, pending rows), or None (training from position 0).
        out_dtype: result dtype (default fp32; the gated norm rounds once).

    Returns:
        ``[T, H, P]`` in ``out_dtype``; padding rows 0. Each token's bits depend
        only on its sequence's state and its own chunk's rows up to itself.

    Raises:
        ValueError: shape/dtype mismatch, state/metadata mismatch.
    """
    if x_THP.dim() != 3 or B_TGN.dim() != 3 or C_TGN.shape != B_TGN.shape:
        raise ValueError(f"ssd_chunk_scan: x {tuple(x_THP.shape)} must be [T,H,P], B/C {tuple(B_TGN.shape)}/"
                         f"{tuple(C_TGN.shape)} equal [T,G,N]")
    T, H, P = x_THP.shape
    G, N = B_TGN.shape[1:]
    if B_TGN.shape[0] != T or dt_TH.shape != (T, H) or A_log_H.shape != (H,) or (D_H is not None and D_H.shape != (H,)):
        raise ValueError(f"ssd_chunk_scan: dt {tuple(dt_TH.shape)}, A_log {tuple(A_log_H.shape)}, B rows "
                         f"{B_TGN.shape[0]} do not match x {tuple(x_THP.shape)}")
    if G == 0 or H % G:
        raise ValueError(f"ssd_chunk_scan: {H} heads not a multiple of {G} groups")
    if dt_TH.dtype != torch.float32:
        raise ValueError(f"ssd_chunk_scan: dt must be fp32 (from mamba2_dt), got {dt_TH.dtype}")
    if T != meta.num_tokens:
        raise ValueError(f"ssd_chunk_scan: x has {T} rows, metadata {meta.num_tokens}")
    _need_state(meta, state, "ssd_chunk_scan")
    if state is not None:
        state.check(H, P, G, N)
        if state.chunk_size != meta.chunk_size:
            raise ValueError(f"ssd_chunk_scan: state holds {state.chunk_size - 1} pending rows, chunk size is "
                             f"{meta.chunk_size}")
        if state.x.dtype != x_THP.dtype or state.B.dtype != B_TGN.dtype:
            raise ValueError(f"ssd_chunk_scan: state dtypes {state.x.dtype}/{state.B.dtype} differ from x/B "
                             f"{x_THP.dtype}/{B_TGN.dtype}")
    _check_decode(meta, x_THP, "ssd_chunk_scan")
    if use_triton(x_THP):
        from .triton import ssd_chunk_scan_triton

        y, entries = ssd_chunk_scan_triton(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    else:
        y, entries = ssd_chunk_scan_torch(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    if state is not None and meta.uniform_decode:  # boundary states already committed by the kernel
        from .decode import write_pending_rows

        write_pending_rows(x_THP, dt_TH, B_TGN, meta, state)
    elif state is not None:
        commit_ssd_state(x_THP, dt_TH, B_TGN, entries, meta, state)
    return y


def commit_ssd_state(x_THP, dt_TH, B_TGN, entries_EHPN, meta: Mamba2Metadata, state: Mamba2State) -> None:
    """After the scan: boundary states and pending rows into the cache (exact copies, both engines)."""
    if meta.commit_slot.numel():
        state.ssm[meta.commit_slot] = entries_EHPN[meta.commit_entry]
    if meta.pend_token.numel():
        tok, slot, i = meta.pend_token, meta.pend_slot, meta.pend_index
        state.x[slot, i] = x_THP[tok].to(state.x.dtype)
        state.dt[slot, i] = dt_TH[tok]
        state.B[slot, i] = B_TGN[tok].to(state.B.dtype)


def gated_rms_norm(y_TF: torch.Tensor, z_TF: torch.Tensor, weight_F: torch.Tensor, group_size: int, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out = (h / rms_group(h)) * weight`` with ``h = y * silu(z)`` (the gate is applied
    BEFORE the norm: ``norm_before_gate=False``, transformers ``Zamba2RMSNormGated``,
    vLLM ``Mixer2RMSNormGated``). RMS over consecutive groups of ``group_size``
    features (Nemotron-H: ``H*P // n_groups``). fp32 math, one rounding.

    Args:
        y_TF: ``[T, F]`` scan output (fp32 or model dtype); z_TF: ``[T, F]`` gate.
        weight_F: ``[F]``; eps: ``layer_norm_epsilon``.
        out_dtype: default ``z_TF.dtype`` (the model dtype).

    Returns:
        ``[T, F]`` in ``out_dtype``; each row depends only on itself.
    """
    if y_TF.dim() != 2 or z_TF.shape != y_TF.shape or weight_F.shape != (y_TF.shape[1],):
        raise ValueError(f"gated_rms_norm: y {tuple(y_TF.shape)}, z {tuple(z_TF.shape)}, weight "
                         f"{tuple(weight_F.shape)} must be [T,F], [T,F], [F]")
    F_ = y_TF.shape[1]
    if group_size < 1 or F_ % group_size:
        raise ValueError(f"gated_rms_norm: {F_} features not a multiple of group_size {group_size}")
    out_dtype = out_dtype or z_TF.dtype
    if use_triton(y_TF):
        from .triton import gated_rms_norm_triton

        return gated_rms_norm_triton(y_TF, z_TF, weight_F, group_size, eps, out_dtype)
    return gated_rms_norm_torch(y_TF, z_TF, weight_F, group_size, eps, out_dtype)
