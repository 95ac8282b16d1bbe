"""CPU path of DeepSeek-V4's MoE: sqrt-softplus router scores over fixed tiles, and the
clamped-SwiGLU experts as exact fp64 dot products rounded once per expert over fixed 16-row tiles.

Formulas: transformers 5.19 ``models/deepseek_v4/modeling_deepseek_v4.py``
(``DeepseekV4TopKRouter``, ``DeepseekV4Experts._apply_gate``); rounding points: package
doc of :mod:`.deepseek`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dispatch import map_row_tiles
from ..linear import round_f64
from .common import ExpertWeight, expert_rows, expert_weight

SCORE_COLS = 64
"""The router scores run on ``[16, E padded to a multiple of 64]`` tiles: every element goes
through ATen's vectorised path whatever its row's place in the batch (as the sigmoid router)."""


def sqrtsoftplus_torch(logits_TE: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(logits))`` in fp32 (``torch.nn.functional.softplus``, beta 1, threshold 20,
    as transformers' ``SqrtSoftplusActivation``), over fixed tiles. ``[T, E]`` fp32 -> fp32."""
    E = logits_TE.shape[1]
    ecols = -(-E // SCORE_COLS) * SCORE_COLS

    def tile(lg):
        return torch.sqrt(F.softplus(F.pad(lg.float(), (0, ecols - E))))[:, :E]

    return map_row_tiles(tile, logits_TE.float())


def swiglu_hidden(g_f32: torch.Tensor, u_f32: torch.Tensor, w_f32: torch.Tensor | None, limit: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The experts' epilogue in fp32, ONE rounding to ``dtype``:
    ``round((silu(min(g, L)) * clamp(u, -L, L)) * w)`` (``w``: per-row routing weight ``[R, 1]``
    or None for weight 1). The clamp rule is ``DeepseekV4Experts._apply_gate``."""
    g = g_f32.clamp(max=limit)
    u = u_f32.clamp(min=-limit, max=limit)
    h = F.silu(g) * u
    if w_f32 is not None:
        h = h * w_f32
    return h.to(dtype)


def swiglu_expert_outputs_torch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                                gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight,
                                swiglu_limit: float) -> torch.Tensor:
    """CPU: fp32 ``[T*K, D]``, row ``t*K + k`` = ``fp32(round_x(swiglu(x_t) * w_tk) down_e^T)`` for
    ``e = ids[t, k]``; the three GEMMs are exact fp64 dot products of the (bf16) operands rounded once
    to fp32, the epilogue :func:`swiglu_hidden`, over fixed 16-row tiles. Arguments are checked by
    the dispatcher (:func:`.deepseek.swiglu_expert_outputs`)."""
    E = gate.shape[0]
    T, K = topk_ids_TK.shape
    y = torch.zeros(T * K, down.shape[1], dtype=torch.float32, device=x_TD.device)
    if T == 0:
        return y
    w_R = topk_weights_TK.float().reshape(-1, 1)
    for e, rows in expert_rows(topk_ids_TK, E):
        wg, wu, wd = (expert_weight(w, e, x_TD.dtype).double() for w in (gate, up, down))

        def tile(a, w, wg=wg, wu=wu, wd=wd):
            a64 = a.double()
            h = swiglu_hidden(round_f64(a64 @ wg.t(), torch.float32), round_f64(a64 @ wu.t(), torch.float32), w,
                              swiglu_limit, x_TD.dtype)
            return round_f64(h.double() @ wd.t(), torch.float32)

        y[rows] = map_row_tiles(tile, x_TD[rows // K], w_R[rows])
    return y
