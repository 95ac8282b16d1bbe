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

**Engines.** CUDA tensors run the Triton kernels in ``triton.py``; CPU
tensors run the plain-torch implementations of ``cpu.py`` (``UM_OPS_BACKEND=triton``
forces the kernels through the interpreter). The CPU implementations are
batch-invariant by construction and independent of the host BLAS (docs/
consistency.md): every contraction is an elementwise fp64 multiply-add in a
fixed index order (no BLAS call, no vectorized reduction), rounded once to fp32;
transcendental functions run through ``cpu._ew``, which feeds ATen fixed-size,
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

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports; ``common.py`` the
state and batch layouts (:class:`Mamba2State`, :class:`Mamba2Metadata`), which the
dispatch, the CPU path and the backward share. The ops here have no autograd; the
differentiable ones are those of :mod:`unified_models.ops`.
"""

from .common import Mamba2Metadata, Mamba2State, mamba2_decode_metadata, mamba2_metadata, start_positions
from .cpu import (ROWS_CPU, causal_conv1d_torch, conv_source_index, gated_rms_norm_torch, mamba2_dt_torch,
                  ssd_chunk_scan_torch)
from .dispatch import (causal_conv1d, commit_ssd_state, gated_rms_norm, mamba2_dt, ssd_chunk_scan,
                       write_conv_state)
from .reference import (causal_conv1d_reference, gated_rms_norm_reference, mamba2_dt_reference, ssd_chunked_torch,
                        ssd_chunked_torch_batched, ssd_reference)

__all__ = ["Mamba2State", "Mamba2Metadata", "start_positions", "mamba2_metadata", "mamba2_decode_metadata", "causal_conv1d", "write_conv_state",
           "mamba2_dt", "ssd_chunk_scan", "commit_ssd_state", "gated_rms_norm", "ROWS_CPU", "conv_source_index",
           "causal_conv1d_torch", "mamba2_dt_torch", "ssd_chunk_scan_torch", "gated_rms_norm_torch",
           "causal_conv1d_reference", "mamba2_dt_reference", "ssd_reference", "ssd_chunked_torch",
           "ssd_chunked_torch_batched", "gated_rms_norm_reference"]
