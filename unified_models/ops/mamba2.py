"""Mamba-2 ops: causal depthwise conv1d, dt, the SSD chunked scan, gated grouped RMSNorm.

Sources: Dao & Gu 2024 ("Transformers are SSMs", SSD, ``ssd_minimal_discrete``);
transformers ``models/nemotron_h/modeling_nemotron_h.py`` (``NemotronHMamba2Mixer``
torch path, ``Zamba2RMSNormGated``); vLLM ``layers/mamba/mamba_mixer2.py`` and
``ops/ssd_*.py``. Shapes: T tokens (flat THD batch), B sequences, S state slots,
H heads, P head dim, G groups (B/C), N state size, C conv channels
(``H*P + 2*G*N``), W conv width, Q chunk size, F = H*P, U chunk items.

Math (per head h, group g = h // (H/G), per sequence; a_t = dt_t * A_h < 0)::

    xBC   = silu(sum_w weight[:, w] * xBC_in[t - (W-1) + w] + bias)   (causal, depthwise, fp32,
                                                                       rounded once to the model dtype)
    dt    = clamp(softplus(dt_raw + dt_bias), *dt_limit)             (fp32)
    S_t   = exp(a_t) S_{t-1} + dt_t x_t B_t^T        (S: [P, N], fp32)
    y_t   = S_t C_t + D_h x_t
    out   = rmsnorm_per_group(y * silu(z)) * weight                   (gate BEFORE the norm)

**One numerical path (DESIGN.md rule 8).** The scan is evaluated in chunks of Q
tokens aligned at ABSOLUTE positions ``[kQ, (k+1)Q)`` of each sequence. For a
token at position ``kQ + l``::

    A_cum[l] = sum_{j<=l} a_j                                (within the chunk)
    y[l]     = sum_{s<=l} (C_l . B_s) exp(A_cum[l] - A_cum[s]) dt_s x_s     (diagonal block)
             + exp(A_cum[l]) (S_k C_l)                                      (boundary state)
             + D x_l
    S_{k+1}  = exp(A_cum[Q-1]) S_k + sum_s exp(A_cum[Q-1] - A_cum[s]) dt_s x_s B_s^T

with S_0 = 0. A token's value depends only on the boundary state S_k and the
rows ``kQ .. kQ+l`` of its chunk, computed in fixed-shape tiles whose masked
entries are exact zeros, and S_{k+1} only on S_k and the Q rows of chunk k. So
full prefill, chunked prefill split anywhere, token-by-token decode and
training evaluate the very same expressions and give the same bits: decode
does not run a one-step recurrence, it re-executes the current chunk from the
boundary state and the cached rows of the chunk so far. (Inputs are assumed
finite: a masked term is ``0 * x``.)

**State layout** (:class:`Mamba2State`, one per layer; a sequence owns one slot
``s``; ``p`` = number of its tokens already processed)::

    conv [S, W-1, C]   model dtype   conv inputs xBC_in at positions p-(W-1) .. p-1
                                     (rows for negative positions unused)
    ssm  [S, H, P, N]  fp32          SSM state at the last chunk boundary kQ = floor(p/Q)*Q
    x    [S, Q-1, H, P] model dtype  x rows (conv output) of positions kQ .. p-1, at index pos - kQ
    dt   [S, Q-1, H]   fp32          dt rows (after softplus / limits) of those positions
    B    [S, Q-1, G, N] model dtype  B rows of those positions

The number of pending rows is ``p % Q``: it is not stored, the caller gives
``p`` (``start_pos``) per sequence. C rows are not kept (a past token's output
is never recomputed). Nothing of a slot is read before it is written: for
``p == 0`` no state is read; ``ssm`` is read only when ``p >= Q``; pending row
``i`` only when ``i < p % Q``; conv row ``j`` only for positions ``>= 0``. So a
fresh slot needs no zeroing and stale memory (even NaN) never enters.

**Batch layout** (:class:`Mamba2Metadata`, built once per forward by
:func:`mamba2_metadata` and shared by every Mamba layer): tokens of sequence
``b`` are rows ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` in position order starting
at ``start_pos[b]``; rows past ``cu_seqlens[B]`` and sequences whose state slot
is negative are padding (zero output, nothing read or written).

**Engines.** CUDA tensors run the Triton kernels in ``ops/triton/mamba2.py``; CPU
tensors run the plain-torch implementations below (``UM_OPS_BACKEND=triton``
forces the kernels through the interpreter). The CPU implementations are
batch-invariant by construction and independent of the host BLAS (docs/
consistency.md): every contraction is an elementwise fp64 multiply-add in a
fixed index order (no BLAS call, no vectorized reduction), rounded once to fp32;
transcendental functions run through :func:`_ew`, which feeds ATen fixed-size,
fully vectorised segments so no element ever takes a scalar tail path; the
group norm's mean square is an ATen reduction over fixed tiles below the
parallel grain, as in ``rms_norm_torch``.

**dt lives in its own op** (:func:`mamba2_dt`): the scan takes the processed
fp32 dt, which is also what its cache keeps, so no cached row has to be
re-activated. ``dt_limit`` is the config's ``time_step_limit`` (vLLM and
mamba_ssm use ``(0, inf)``); note that transformers 5.19's Nemotron-H mixer
passes ``(time_step_min, inf)`` on both its kernel and torch paths.

The scan returns fp32 by default and the gated norm rounds once (DESIGN.md
rule 5), as transformers' torch path (fp32 scan output) does; vLLM rounds the
scan output to the model dtype first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._dispatch import map_row_tiles, use_triton

# --------------------------------------------------------------------------- helpers

_EW_SEG = 8192
"""Elements per ATen call in :func:`_ew`: a multiple of every SIMD loop step
(2 x 16 fp32 lanes on AVX-512) and below ATen's parallel grain (32768)."""

ROWS_CPU = 64
"""Query rows per step of the CPU scan / conv (elementwise, so any value gives the same bits)."""


def _ew(fn, *xs: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise ``fn`` so every element takes ATen's vectorised path.

    ATen's elementwise loops run full SIMD vectors and finish a range with a
    scalar loop whose transcendental functions (exp, sigmoid, ...) can differ
    in the last bit from the vector ones; which elements fall in that tail
    depends on the tensor size and on the thread split. Here the flat inputs
    are padded to whole ``_EW_SEG`` segments, each call is one contiguous
    segment below the parallel grain, so there is no tail and no split: an
    element's bits depend only on its own value.
    """
    shape = xs[0].shape
    n = xs[0].numel()
    flat = [x.reshape(-1) for x in xs]
    pad = (-n) % _EW_SEG
    if pad:
        flat = [torch.cat([f, f.new_zeros(pad)]) for f in flat]
    outs = [fn(*(f[i:i + _EW_SEG] for f in flat)) for i in range(0, n + pad, _EW_SEG)]
    if not outs:
        return fn(*xs)
    return torch.cat(outs)[:n].view(shape)


def _softplus(v: torch.Tensor) -> torch.Tensor:
    return F.softplus(v)  # threshold 20: v > 20 -> v


# --------------------------------------------------------------------------- state


@dataclass
class Mamba2State:
    """Per-slot cache of one Mamba-2 layer (see the module docstring for the layout).

    The tensors may be views with any strides (a vLLM state cache hands strided
    views of one allocation); the leading dim is the slot.
    """

    conv: torch.Tensor  # [S, W-1, C] model dtype
    ssm: torch.Tensor   # [S, H, P, N] fp32
    x: torch.Tensor     # [S, Q-1, H, P] model dtype
    dt: torch.Tensor    # [S, Q-1, H] fp32
    B: torch.Tensor     # [S, Q-1, G, N] model dtype

    @staticmethod
    def shapes(*, num_heads: int, head_dim: int, n_groups: int, state_size: int, conv_width: int,
               chunk_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Per-slot shape and dtype role (``"model"`` or ``"fp32"``) of each tensor."""
        H, P, G, N = num_heads, head_dim, n_groups, state_size
        C = H * P + 2 * G * N
        return {"conv": ((conv_width - 1, C), "model"), "ssm": ((H, P, N), "fp32"),
                "x": ((chunk_size - 1, H, P), "model"), "dt": ((chunk_size - 1, H), "fp32"),
                "B": ((chunk_size - 1, G, N), "model")}

    @classmethod
    def allocate(cls, num_slots: int, *, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_width: int, chunk_size: int, dtype: torch.dtype, device="cpu",
                 fill: float | None = None) -> "Mamba2State":
        """Allocate ``num_slots`` slots (uninitialised, or filled with ``fill``)."""
        t = {}
        for name, (shape, role) in cls.shapes(num_heads=num_heads, head_dim=head_dim, n_groups=n_groups,
                                              state_size=state_size, conv_width=conv_width,
                                              chunk_size=chunk_size).items():
            dt_ = torch.float32 if role == "fp32" else dtype
            t[name] = (torch.empty((num_slots, *shape), dtype=dt_, device=device) if fill is None
                       else torch.full((num_slots, *shape), fill, dtype=dt_, device=device))
        return cls(**t)

    @property
    def chunk_size(self) -> int:
        return self.x.shape[1] + 1

    def check(self, H: int, P: int, G: int, N: int, C: int | None = None, W: int | None = None) -> None:
        S = self.ssm.shape[0]
        want = {"ssm": (S, H, P, N), "x": (S, self.chunk_size - 1, H, P), "dt": (S, self.chunk_size - 1, H),
                "B": (S, self.chunk_size - 1, G, N)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Mamba2State.{name}: shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if self.ssm.dtype != torch.float32 or self.dt.dtype != torch.float32:
            raise ValueError("Mamba2State: ssm and dt must be fp32")
        if C is not None and (self.conv.dim() != 3 or self.conv.shape[0] != S or self.conv.shape[2] != C
                              or (W is not None and self.conv.shape[1] != W - 1)):
            raise ValueError(f"Mamba2State.conv: shape {tuple(self.conv.shape)}, expected ({S}, {W and W - 1}, {C})")


# --------------------------------------------------------------------------- metadata


@dataclass
class Mamba2Metadata:
    """Where every token, chunk item and state row of one batch lives (one per forward).

    Host-side counts are plain ints (kernel grids); index tensors live on the
    batch's device (int32/int64). Item ``u`` is chunk ``item_chunk[u]`` (absolute
    chunk index) of sequence ``item_seq[u]``; a sequence's items are contiguous
    and in chunk order. ``entries`` are the states after each COMPLETE item
    (its last row is in this batch), in the same order.
    """

    chunk_size: int
    num_tokens: int
    has_state: bool
    # per sequence [B] (padding sequences have seq_len 0)
    cu_seqlens: torch.Tensor
    start_pos: torch.Tensor
    seq_len: torch.Tensor
    slot: torch.Tensor
    seq_item_ptr: torch.Tensor   # [B+1]
    seq_entry_ptr: torch.Tensor  # [B+1]
    # per token [T]: sequence (-1: padding) and position
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    token_item: torch.Tensor
    # per item [U]
    item_seq: torch.Tensor
    item_chunk: torch.Tensor
    item_rank: torch.Tensor
    num_items: int
    num_entries: int
    state_seqs: torch.Tensor     # [Bs] sequences with at least one complete item
    # cache writes (host-built index lists)
    commit_slot: torch.Tensor    # [Bc] slot <- entries[commit_entry]
    commit_entry: torch.Tensor
    pend_token: torch.Tensor     # [Tp] token rows kept as pending rows
    pend_slot: torch.Tensor
    pend_index: torch.Tensor
    conv_seqs: torch.Tensor      # [Bw] sequences whose conv state is written
    # host copies (lists) for the CPU implementations
    host: dict


def start_positions(cu_seqlens_B1: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """``start_pos[b]`` = position of sequence b's first token (0 for empty sequences)."""
    cu = cu_seqlens_B1.long()
    first = cu[:-1].clamp(max=max(positions_T.shape[0] - 1, 0))
    if positions_T.shape[0] == 0:
        return torch.zeros_like(cu[:-1])
    return torch.where(cu[1:] > cu[:-1], positions_T.long()[first], torch.zeros_like(first))


def mamba2_metadata(cu_seqlens_B1: torch.Tensor, start_pos_B: torch.Tensor, chunk_size: int,
                    num_tokens: int | None = None, state_idx_B: torch.Tensor | None = None) -> Mamba2Metadata:
    """Build the batch description shared by every Mamba layer of one forward.

    Args:
        cu_seqlens_B1: int ``[B+1]``, token rows of each sequence (non-decreasing, from 0).
        start_pos_B: int ``[B]``, position of each sequence's first token in this
            batch = tokens already in its state.
        chunk_size: Q (config ``chunk_size``).
        num_tokens: T, rows of the batch (default ``cu_seqlens[-1]``); rows past
            ``cu_seqlens[-1]`` are padding.
        state_idx_B: int ``[B]`` state slot per sequence (``< 0``: padding
            sequence). ``None``: no state (training over whole sequences), every
            ``start_pos`` must be 0.

    Raises:
        ValueError: malformed boundaries, negative positions, ``start_pos > 0``
            without state, bad chunk size.

    This reads the (small) index tensors on the host once per forward.
    """
    Q = int(chunk_size)
    if Q < 1:
        raise ValueError(f"mamba2: chunk_size {chunk_size} must be >= 1")
    dev = cu_seqlens_B1.device
    cu = cu_seqlens_B1.detach().to("cpu", torch.int64).view(-1)
    p0 = start_pos_B.detach().to("cpu", torch.int64).view(-1)
    B = cu.shape[0] - 1
    if B < 0 or p0.shape[0] != B or int(cu[0]) != 0:
        raise ValueError(f"mamba2: cu_seqlens must be [B+1] from 0 and start_pos [B]; got {cu.shape[0]} / "
                         f"{p0.shape[0]}")
    n_rows = cu[1:] - cu[:-1]
    if (n_rows < 0).any():
        raise ValueError("mamba2: cu_seqlens must be non-decreasing")
    T = int(cu[-1]) if num_tokens is None else int(num_tokens)
    if int(cu[-1]) > T:
        raise ValueError(f"mamba2: cu_seqlens ends at {int(cu[-1])} > num_tokens {T}")
    if (p0 < 0).any():
        raise ValueError("mamba2: start_pos must be >= 0")
    has_state = state_idx_B is not None
    slot = state_idx_B.detach().to("cpu", torch.int64).view(-1) if has_state else torch.zeros(B, dtype=torch.int64)
    if slot.shape[0] != B:
        raise ValueError(f"mamba2: state_idx must be [B={B}], got {slot.shape[0]}")
    if not has_state and (p0 != 0).any():
        raise ValueError("mamba2: start_pos > 0 needs a state (pass state_idx and a Mamba2State)")
    L = torch.where(slot >= 0, n_rows, 0)
    live = L > 0
    end = p0 + L
    # items: chunks k0..k1 of each sequence; entries: its complete chunks (all but maybe the last)
    n_items = torch.where(live, (end - 1).clamp(min=0) // Q - p0 // Q + 1, 0)
    n_complete = torch.where(live, end // Q - p0 // Q, 0)
    zero1 = torch.zeros(1, dtype=torch.int64)
    item_ptr = torch.cat([zero1, n_items.cumsum(0)])
    ent_ptr = torch.cat([zero1, n_complete.cumsum(0)])
    U = int(item_ptr[-1])
    item_seq = torch.repeat_interleave(torch.arange(B), n_items)
    item_rank = torch.arange(U) - item_ptr[item_seq]
    item_chunk = p0[item_seq] // Q + item_rank
    # tokens
    row_seq = torch.repeat_interleave(torch.arange(B), n_rows)  # sequence of each covered row
    rows = torch.arange(row_seq.shape[0])
    real = live[row_seq]
    token_seq = torch.full((T,), -1, dtype=torch.int64)
    token_pos = torch.zeros(T, dtype=torch.int64)
    token_item = torch.zeros(T, dtype=torch.int64)
    pos = p0[row_seq] + rows - cu[row_seq]
    token_seq[rows] = torch.where(real, row_seq, -1)
    token_pos[rows] = torch.where(real, pos, 0)
    token_item[rows] = torch.where(real, item_ptr[row_seq] + pos // Q - p0[row_seq] // Q, 0)
    state_seqs = live.logical_and(n_complete > 0).nonzero().view(-1)
    if has_state:
        commit_slot, commit_entry = slot[state_seqs], ent_ptr[state_seqs + 1] - 1
        boundary = (end // Q) * Q
        keep = (real & (pos >= boundary[row_seq])).nonzero().view(-1)
        pend_token, pend_slot = keep, slot[row_seq[keep]]
        pend_index = pos[keep] - boundary[row_seq[keep]]
        conv_seqs = live.nonzero().view(-1)
    else:
        commit_slot = commit_entry = pend_token = pend_slot = pend_index = conv_seqs = torch.zeros(0, dtype=torch.int64)

    host = dict(cu=cu.tolist(), start_pos=p0.tolist(), seq_len=L.tolist(), slot=slot.tolist(),
                item_seq=item_seq.tolist(), item_chunk=item_chunk.tolist(), item_rank=item_rank.tolist(),
                seq_item_ptr=item_ptr.tolist(), seq_entry_ptr=ent_ptr.tolist(), conv_seqs=conv_seqs.tolist(),
                cpu=dict(cu=cu, p0=p0, L=L, slot=slot, item_seq=item_seq, item_chunk=item_chunk, token_seq=token_seq,
                         token_pos=token_pos, live=live))

    def i64(v):
        return v.to(device=dev, dtype=torch.int64)

    def i32(v):
        return v.to(device=dev, dtype=torch.int32)

    return Mamba2Metadata(
        chunk_size=Q, num_tokens=T, has_state=has_state,
        cu_seqlens=i32(cu), start_pos=i64(p0), seq_len=i32(L), slot=i64(slot),
        seq_item_ptr=i32(item_ptr), seq_entry_ptr=i32(ent_ptr),
        token_seq=i32(token_seq), token_pos=i64(token_pos), token_item=i64(token_item),
        item_seq=i32(item_seq), item_chunk=i64(item_chunk), item_rank=i32(item_rank),
        num_items=U, num_entries=int(ent_ptr[-1]), state_seqs=i32(state_seqs),
        commit_slot=i64(commit_slot), commit_entry=i64(commit_entry),
        pend_token=i64(pend_token), pend_slot=i64(pend_slot), pend_index=i64(pend_index),
        conv_seqs=i64(conv_seqs), host=host)


def _need_state(meta: Mamba2Metadata, state: Mamba2State | None, name: str) -> None:
    if meta.has_state and state is None:
        raise ValueError(f"{name}: the metadata has state slots but no Mamba2State was given")
    if not meta.has_state and state is not None:
        raise ValueError(f"{name}: a Mamba2State was given but the metadata has no state_idx")


# --------------------------------------------------------------------------- causal conv1d


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
    if use_triton(x_TC):
        from .triton.mamba2 import causal_conv1d_triton

        y = causal_conv1d_triton(x_TC, weight_CW, bias_C, meta, state)
    else:
        y = causal_conv1d_torch(x_TC, weight_CW, bias_C, meta, state)
    if state is not None:
        write_conv_state(x_TC, meta, state)
    return y


def conv_source_index(meta: Mamba2Metadata, W: int, T: int, device) -> tuple[torch.Tensor, list[int]]:
    """Row of every (token, tap) input in ``[x rows (T) | state rows | one zero row]``.

    Returns ``(idx [T, W], state_seqs)``: the state rows are ``W-1`` rows per
    sequence of ``state_seqs`` (sequences starting past position 0), in order.
    Cached in the metadata per ``(W, device)``.
    """
    key = ("conv_src", W, T, str(device))
    if key in meta.host:
        return meta.host[key]
    c = meta.host["cpu"]
    seqs = (c["live"] & (c["p0"] > 0)).nonzero().view(-1)
    base = torch.full_like(c["p0"], -1)
    base[seqs] = T + torch.arange(seqs.shape[0]) * (W - 1)
    zero = T + seqs.shape[0] * (W - 1)
    tseq = c["token_seq"]
    valid = tseq >= 0
    sq = tseq.clamp(min=0)
    t = torch.arange(T).view(-1, 1)
    q = c["token_pos"].view(-1, 1) - (W - 1) + torch.arange(W).view(1, -1)  # [T, W] source positions
    p0 = c["p0"][sq].view(-1, 1)
    from_x = valid.view(-1, 1) & (q >= p0)
    from_s = valid.view(-1, 1) & (q < p0) & (q >= 0) & (base[sq].view(-1, 1) >= 0)
    idx = torch.where(from_x, t - (W - 1) + torch.arange(W).view(1, -1), zero)
    idx = torch.where(from_s, base[sq].view(-1, 1) + (W - 1) + q - p0, idx)
    res = (idx.to(device), seqs.tolist())
    meta.host[key] = res
    return res


def causal_conv1d_torch(x_TC, weight_CW, bias_C, meta, state) -> torch.Tensor:
    """CPU: per-token gather of the W inputs, fp32 multiply-adds in tap order (exact IEEE
    elementwise ops, no BLAS), SiLU through :func:`_ew`."""
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    idx, seqs = conv_source_index(meta, W, T, x_TC.device)
    parts = [x_TC]
    if seqs:
        slots = torch.tensor([meta.host["slot"][b] for b in seqs], device=x_TC.device)
        parts.append(state.conv[slots].reshape(-1, C).to(x_TC.dtype))
    parts.append(x_TC.new_zeros((1, C)))
    table = torch.cat(parts)
    w = weight_CW.float()
    bias = bias_C.float() if bias_C is not None else None
    valid = meta.token_seq.to(x_TC.device) >= 0
    out = x_TC.new_zeros((T, C))
    for i in range(0, T, ROWS_CPU):
        src = table[idx[i:i + ROWS_CPU]].float()  # [R, W, C]
        acc = src[:, 0] * w[:, 0]
        for j in range(1, W):
            acc = acc + src[:, j] * w[:, j]
        if bias is not None:
            acc = acc + bias
        y = _ew(F.silu, acc).to(x_TC.dtype)
        out[i:i + ROWS_CPU] = torch.where(valid[i:i + ROWS_CPU, None], y, torch.zeros_like(y))
    return out


def write_conv_state(x_TC: torch.Tensor, meta: Mamba2Metadata, state: Mamba2State) -> None:
    """``state.conv[slot]`` <- inputs at positions ``end-(W-1) .. end-1`` of each sequence (exact copies).

    Rows for negative positions are written as 0 (never read). Shared by both engines.
    """
    Wm1, C = state.conv.shape[1], state.conv.shape[2]
    T = x_TC.shape[0]
    key = ("conv_write", Wm1, T, str(x_TC.device))
    if key not in meta.host:
        c = meta.host["cpu"]
        seqs = torch.tensor(meta.host["conv_seqs"], dtype=torch.int64)
        nb = seqs.shape[0]
        zero = T + nb * Wm1
        L, p0, cu = c["L"][seqs].view(-1, 1), c["p0"][seqs].view(-1, 1), c["cu"][seqs].view(-1, 1)
        j = torch.arange(Wm1).view(1, -1)
        q = p0 + L - Wm1 + j  # [nb, W-1] positions kept
        idx = torch.where(q >= p0, cu + q - p0, zero)
        idx = torch.where((q < p0) & (q >= 0), T + torch.arange(nb).view(-1, 1) * Wm1 + j + L, idx)
        meta.host[key] = (idx.to(x_TC.device), c["slot"][seqs].to(x_TC.device), nb)
    idx, slots, nb = meta.host[key]
    if nb == 0 or Wm1 == 0:
        return
    table = torch.cat([x_TC.to(state.conv.dtype), state.conv[slots].reshape(-1, C),
                       x_TC.new_zeros((1, C), dtype=state.conv.dtype)])
    state.conv[slots] = table[idx]


def causal_conv1d_reference(x_LC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
                            prefix_KC: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle for ONE sequence in fp64: ``prefix_KC`` are the inputs just before ``x_LC``
    (zeros when shorter than W-1 or None). Returns ``[L, C]`` fp64."""
    W = weight_CW.shape[1]
    x = x_LC.double()
    pre = torch.zeros(W - 1, x.shape[1], dtype=torch.float64, device=x.device)
    if prefix_KC is not None and prefix_KC.shape[0] > 0:
        k = min(W - 1, prefix_KC.shape[0])
        pre[W - 1 - k:] = prefix_KC[-k:].double()
    xp = torch.cat([pre, x])
    out = sum(xp[j:j + x.shape[0]] * weight_CW[:, j].double() for j in range(W))
    if bias_C is not None:
        out = out + bias_C.double()
    return F.silu(out)


# --------------------------------------------------------------------------- dt


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
        from .triton.mamba2 import mamba2_dt_triton

        return mamba2_dt_triton(dt_TH, dt_bias_H, lo, hi)
    return mamba2_dt_torch(dt_TH, dt_bias_H, lo, hi)


def mamba2_dt_torch(dt_TH, dt_bias_H, lo: float, hi: float) -> torch.Tensor:
    v = dt_TH.float() + dt_bias_H.float()
    return torch.clamp(_ew(_softplus, v), lo, hi)


def mamba2_dt_reference(dt_TH, dt_bias_H, dt_limit=(0.0, math.inf)) -> torch.Tensor:
    """Oracle in fp64 (differentiable)."""
    v = dt_TH.double() + dt_bias_H.double()
    return torch.clamp(F.softplus(v), float(dt_limit[0]), float(dt_limit[1]))


# --------------------------------------------------------------------------- SSD chunked scan


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
    if use_triton(x_THP):
        from .triton.mamba2 import ssd_chunk_scan_triton

        y, entries = ssd_chunk_scan_triton(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    else:
        y, entries = ssd_chunk_scan_torch(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    if state is not None:
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


def _ssd_sources(x_THP, dt_TH, B_TGN, meta: Mamba2Metadata, state: Mamba2State | None):
    """Rows of every item ``[U, Q, ...]`` (batch rows, pending rows, zeros) and the presence mask."""
    c = meta.host["cpu"]
    Q, T = meta.chunk_size, x_THP.shape[0]
    dev = x_THP.device
    pend = (c["live"] & (c["p0"] % Q > 0)).nonzero().view(-1)
    pbase = torch.full_like(c["p0"], -1)
    pbase[pend] = T + torch.arange(pend.shape[0]) * (Q - 1)
    zero = T + pend.shape[0] * (Q - 1)
    b = c["item_seq"]
    l = torch.arange(Q).view(1, -1)
    q = c["item_chunk"].view(-1, 1) * Q + l  # [U, Q]
    p0, L, cu = c["p0"][b].view(-1, 1), c["L"][b].view(-1, 1), c["cu"][b].view(-1, 1)
    idx = torch.where((q >= p0) & (q < p0 + L), cu + q - p0, zero)
    idx = torch.where((q < p0) & (pbase[b].view(-1, 1) >= 0), pbase[b].view(-1, 1) + l, idx)
    idx = idx.to(dev)
    present = idx != zero
    tabs = []
    for t_, name in ((x_THP, "x"), (dt_TH, "dt"), (B_TGN, "B")):
        parts = [t_]
        if pend.numel():
            parts.append(getattr(state, name)[c["slot"][pend].to(dev)].reshape(-1, *t_.shape[1:]).to(t_.dtype))
        parts.append(t_.new_zeros((1, *t_.shape[1:])))
        tabs.append(torch.cat(parts)[idx])
    return tabs[0], tabs[1], tabs[2], present


def ssd_chunk_scan_torch(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta: Mamba2Metadata,
                         state: Mamba2State | None, out_dtype: torch.dtype):
    """CPU implementation; returns ``(y [T,H,P], entries [E,H,P,N])``.

    Every contraction is an elementwise fp64 multiply-add loop in a fixed index
    order (n = 0..N-1 for C.B and C.S, s = 0..Q-1 for the diagonal block and
    the chunk state), rounded once to fp32: each product is exact (operands of
    <= 24 significand bits) and no BLAS or vectorised reduction picks the order.
    Masked terms are exact zeros, the identity of the accumulation (inputs are
    finite; the accumulator is never -0). Each query row is computed
    on its own (rows of a step never interact), so a decode step computes the
    same expressions as the prefill rows it stands for.
    """
    T, H, P = x_THP.shape
    G, N = B_TGN.shape[1:]
    R = H // G
    Q = meta.chunk_size
    dev = x_THP.device
    h = meta.host
    out = torch.zeros((T, H, P), dtype=out_dtype, device=dev)
    E = meta.num_entries
    entries = torch.zeros((E, H, P, N), dtype=torch.float32, device=dev)
    U = meta.num_items
    if U == 0:
        return out, entries
    A = -_ew(torch.exp, A_log_H.float())  # [H]
    xs, dts, Bs, present = _ssd_sources(x_THP, dt_TH, B_TGN, meta, state)  # [U,Q,H,P], [U,Q,H], [U,Q,G,N]
    dts = torch.where(present[..., None], dts.float(), torch.zeros((), device=dev))
    a = (dts * A).double()
    acum = torch.empty((U, Q, H), dtype=torch.float64, device=dev)
    run = torch.zeros((U, H), dtype=torch.float64, device=dev)
    for l in range(Q):  # sequential prefix sums in fp64
        run = run + a[:, l]
        acum[:, l] = run
    acum = acum.float()
    alast = acum[:, Q - 1]  # [U, H]
    chunk_decay = _ew(torch.exp, alast)  # [U, H]

    # ---- chunk states and the state recurrence (complete items only)
    item_entry = torch.full((U,), -1, dtype=torch.int64)
    for b in range(len(h["seq_len"])):
        e0, e1 = h["seq_entry_ptr"][b], h["seq_entry_ptr"][b + 1]
        u0 = h["seq_item_ptr"][b]
        for j in range(e1 - e0):
            item_entry[u0 + j] = e0 + j
    comp = (item_entry >= 0).nonzero().view(-1)
    if comp.numel():
        cu_ = comp.to(dev)
        w = _ew(torch.exp, alast[cu_][:, None, :] - acum[cu_]) * dts[cu_]  # [Uc, Q, H]
        xw = (xs[cu_].float() * w[..., None]).double().transpose(0, 1).contiguous()  # [Q, Uc, H, P]
        Bh = Bs[cu_].repeat_interleave(R, dim=2).double().transpose(0, 1).contiguous()  # [Q, Uc, H, N]
        cs = torch.zeros((comp.numel(), H, P, N), dtype=torch.float64, device=dev)
        for s in range(Q):
            cs = cs + xw[s][..., None] * Bh[s][..., None, :]
        cs = cs.float()
        cpos = {int(u): i for i, u in enumerate(comp.tolist())}
        for b in range(len(h["seq_len"])):
            e0, e1 = h["seq_entry_ptr"][b], h["seq_entry_ptr"][b + 1]
            if e1 == e0:
                continue
            S = _initial_state(meta, state, b, H, P, N, dev)
            u0 = h["seq_item_ptr"][b]
            for j in range(e1 - e0):
                u = u0 + j
                S = chunk_decay[u][:, None, None] * S + cs[cpos[u]]
                entries[e0 + j] = S

    # ---- start state of every item
    sstart = torch.zeros((U, H, P, N), dtype=torch.float32, device=dev)
    for u in range(U):
        b, r = h["item_seq"][u], h["item_rank"][u]
        sstart[u] = entries[h["seq_entry_ptr"][b] + r - 1] if r > 0 else _initial_state(meta, state, b, H, P, N, dev)

    # ---- outputs, one query row at a time (in steps of ROWS_CPU rows)
    rows_all = (meta.token_seq.to(dev) >= 0).nonzero().view(-1)
    tok_item = meta.token_item.to(dev)
    tok_l = (meta.token_pos.to(dev) % Q)
    sarange = torch.arange(Q, device=dev)
    Dv = D_H.float() if D_H is not None else None
    # fp64 copies laid out with the contraction index first, so every step of the
    # fixed-order loops below reads one contiguous slab (gathered per query row)
    Bs_n = Bs.double().permute(3, 0, 1, 2).contiguous()  # [N, U, Q, G]
    xs_s = xs.double().transpose(0, 1).contiguous()  # [Q, U, H, P]
    ss_n = sstart.double().permute(3, 0, 1, 2).contiguous()  # [N, U, H, P]
    for i in range(0, rows_all.numel(), ROWS_CPU):
        rows = rows_all[i:i + ROWS_CPU]
        nr = rows.numel()
        it, l = tok_item[rows], tok_l[rows]
        Ct = C_TGN[rows].double().permute(2, 0, 1).contiguous()  # [N, R_, G]
        cb = torch.zeros((nr, Q, G), dtype=torch.float64, device=dev)
        for n in range(N):
            cb = cb + Ct[n][:, None, :] * Bs_n[n][it]
        cb = cb.float().repeat_interleave(R, dim=2)  # [R_, Q, H]
        ac = acum[it]  # [R_, Q, H]
        acl = ac.gather(1, l.view(-1, 1, 1).expand(-1, 1, H))  # [R_, 1, H]
        causal = (sarange.view(1, Q) <= l.view(-1, 1))[..., None]  # [R_, Q, 1]
        dec = _ew(torch.exp, torch.where(causal, acl - ac, torch.zeros((), device=dev)))
        m = torch.where(causal, cb * dec * dts[it], torch.zeros((), device=dev))  # [R_, Q, H]
        md = m.double().transpose(0, 1).contiguous()  # [Q, R_, H]
        # Masked terms are +-0: the accumulator starts at +0 and is never -0 (an exact zero
        # sum rounds to +0), so adding them is the identity; rows past a query never count.
        yd = torch.zeros((nr, H, P), dtype=torch.float64, device=dev)
        for s in range(int(l.max()) + 1):
            yd = yd + md[s][..., None] * xs_s[s][it]
        Ch = Ct.repeat_interleave(R, dim=2)  # [N, R_, H]
        yo = torch.zeros((nr, H, P), dtype=torch.float64, device=dev)
        for n in range(N):
            yo = yo + Ch[n][..., None] * ss_n[n][it]
        yo = yo.float() * _ew(torch.exp, acl[:, 0])[..., None]
        y = yd.float() + yo
        if Dv is not None:
            y = y + Dv[:, None] * x_THP[rows].float()
        out[rows] = y.to(out_dtype)
    return out, entries


def _initial_state(meta, state, b, H, P, N, dev):
    """State at the first boundary of sequence b in this batch: the cache's when ``start_pos >= Q``, else 0."""
    h = meta.host
    if state is not None and h["start_pos"][b] >= meta.chunk_size:
        return state.ssm[h["slot"][b]].float().clone()
    return torch.zeros((H, P, N), dtype=torch.float32, device=dev)


def ssd_reference(x_LHP: torch.Tensor, dt_LH: torch.Tensor, A_log_H: torch.Tensor, B_LGN: torch.Tensor,
                  C_LGN: torch.Tensor, D_H: torch.Tensor | None, initial_state_HPN: torch.Tensor | None = None):
    """Oracle for ONE sequence: the step-by-step recurrence in fp64 (differentiable).

    Returns ``(y [L, H, P] fp64, final state [H, P, N] fp64)``.
    """
    L, H, P = x_LHP.shape
    G, N = B_LGN.shape[1:]
    x, dt = x_LHP.double(), dt_LH.double()
    A = -torch.exp(A_log_H.double())
    Bh = B_LGN.double().repeat_interleave(H // G, dim=1)
    Ch = C_LGN.double().repeat_interleave(H // G, dim=1)
    S = (initial_state_HPN.double() if initial_state_HPN is not None
         else torch.zeros(H, P, N, dtype=torch.float64, device=x.device))
    ys = []
    for t in range(L):
        S = torch.exp(dt[t] * A)[:, None, None] * S + (dt[t][:, None] * x[t])[..., None] * Bh[t][:, None, :]
        y = (S * Ch[t][:, None, :]).sum(-1)
        if D_H is not None:
            y = y + D_H.double()[:, None] * x[t]
        ys.append(y)
    y = torch.stack(ys) if ys else x.new_zeros((0, H, P))
    return y, S


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum_{j < k <= i} a[..., k]`` (``-inf`` above the diagonal); masked cumsum
    (transformers' ``segment_sum``), stable and differentiable."""
    Q = a.shape[-1]
    x = a[..., None].expand(*a.shape, Q)
    low = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~low, 0)
    s = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=0)
    return s.masked_fill(~keep, -torch.inf)


def ssd_chunked_torch(x_LHP, dt_LH, A_log_H, B_LGN, C_LGN, D_H, chunk_size: int,
                      initial_state_HPN: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable chunked SSD for ONE sequence starting at a chunk boundary (plain
    torch einsums in the inputs' dtype, fp32/fp64). Used by the backward recomputation.
    Returns ``[L, H, P]``."""
    L, H, P = x_LHP.shape
    G, N = B_LGN.shape[1:]
    Q = chunk_size
    pad = (-L) % Q
    dtype = x_LHP.dtype
    A = -torch.exp(A_log_H.to(dtype))

    def padded(t):
        return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t

    x, dt = padded(x_LHP), padded(dt_LH.to(dtype))
    Bh = padded(B_LGN.to(dtype)).repeat_interleave(H // G, dim=1)
    Ch = padded(C_LGN.to(dtype)).repeat_interleave(H // G, dim=1)
    c = x.shape[0] // Q
    xq = (x * dt[..., None]).view(c, Q, H, P)
    a = (dt * A).view(c, Q, H).permute(2, 0, 1)  # [H, c, Q]
    Bq, Cq = Bh.view(c, Q, H, N), Ch.view(c, Q, H, N)
    acum = torch.cumsum(a, dim=-1)
    Lm = torch.exp(_segsum(a))  # [H, c, Q, Q]
    y_diag = torch.einsum("clhn,cshn,hcls,cshp->clhp", Cq, Bq, Lm, xq)
    decay_states = torch.exp(acum[..., -1:] - acum)  # [H, c, Q]
    states = torch.einsum("clhn,hcl,clhp->chpn", Bq, decay_states, xq)
    init = (initial_state_HPN.to(dtype)[None] if initial_state_HPN is not None
            else torch.zeros((1, H, P, N), dtype=dtype, device=x.device))
    states = torch.cat([init, states], dim=0)  # [c+1, H, P, N]
    decay_chunk = torch.exp(_segsum(F.pad(acum[..., -1], (1, 0))))  # [H, c+1, c+1]
    new_states = torch.einsum("hzc,chpn->zhpn", decay_chunk, states)
    states = new_states[:-1]
    y_off = torch.einsum("clhn,chpn,hcl->clhp", Cq, states, torch.exp(acum))
    y = (y_diag + y_off).reshape(c * Q, H, P)
    if D_H is not None:
        y = y + D_H.to(dtype)[:, None] * x
    return y[:L]


# --------------------------------------------------------------------------- gated RMSNorm


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
        from .triton.mamba2 import gated_rms_norm_triton

        return gated_rms_norm_triton(y_TF, z_TF, weight_F, group_size, eps, out_dtype)
    return gated_rms_norm_torch(y_TF, z_TF, weight_F, group_size, eps, out_dtype)


def gated_rms_norm_torch(y_TF, z_TF, weight_F, group_size: int, eps: float, out_dtype) -> torch.Tensor:
    """CPU: fixed row tiles below ATen's parallel grain (as ``rms_norm_torch``); SiLU and rsqrt via :func:`_ew`."""
    F_ = y_TF.shape[1]
    w = weight_F.float()

    def tile(y, z):
        hh = y.float() * _ew(F.silu, z.float())
        g = hh.view(hh.shape[0], F_ // group_size, group_size)
        ms = g.square().mean(dim=-1, keepdim=True)
        r = _ew(torch.rsqrt, ms + eps)
        return ((g * r).view(hh.shape[0], F_) * w).to(out_dtype)

    rows = max(1, min(16, 16384 // max(1, F_)))
    return map_row_tiles(tile, y_TF, z_TF, rows=rows)


def gated_rms_norm_reference(y_TF, z_TF, weight_F, group_size: int, eps: float, out_dtype=None) -> torch.Tensor:
    """Oracle in fp64 (differentiable)."""
    hh = y_TF.double() * F.silu(z_TF.double())
    g = hh.view(hh.shape[0], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.view(hh.shape) * weight_F.double()
    return out.to(out_dtype) if out_dtype is not None else out
