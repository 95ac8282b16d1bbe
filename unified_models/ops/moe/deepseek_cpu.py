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
from ..fp8_block.common import BLOCK as ACT_TILE
from ..fp8_block.common import fp8_block_quantize_activation_torch
from ..linear import round_f64
from .common import ExpertWeight, expert_rows, expert_weight, quantizes_activations

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


def fp8_activation_f64(a_TK: torch.Tensor) -> torch.Tensor:
    """The W4A8 activation rule as fp64 values: ``a`` quantized per token to FP8 with 1x128 ue8m0 tiles
    (``ops.fp8_block.fp8_block_quantize_activation``, DeepSeek ``act_quant``) and dequantized exactly
    (``e4m3 * 2^j``: 4 significant bits). Row ``t`` depends only on ``a_TK[t]``. ``[T, K]`` -> fp64 ``[T, K]``."""
    q, s = fp8_block_quantize_activation_torch(a_TK)
    return q.double() * s.double().repeat_interleave(ACT_TILE, 1)


def swiglu_expert_outputs_torch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                                gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight,
                                swiglu_limit: float) -> torch.Tensor:
    """CPU: fp32 ``[T*K, D]``, row ``t*K + k`` = ``fp32(round_x(swiglu(x_t) * w_tk) down_e^T)`` for
    ``e = ids[t, k]``; the three GEMMs are exact fp64 dot products of the (bf16) operands rounded once
    to fp32, the epilogue :func:`swiglu_hidden`, over fixed 16-row tiles. Arguments are checked by
    the dispatcher (:func:`.deepseek.swiglu_expert_outputs`).

    MXFP4 weights (W4A8): the GEMM's activation (``x`` for ``w1``/``w3``, the bf16 ``h`` for ``w2``)
    goes through :func:`fp8_activation_f64` per token first, and the weight is dequantized exactly;
    each product of an e4m3 and an e2m1 value has at most 6 significant bits, so the fp64 dot product
    is exact while its terms span fewer than ``53 - 6 - log2(K)`` binary orders, then rounded once
    to fp32 as before. Other weights: unchanged (no activation quantization)."""
    E = gate.shape[0]
    T, K = topk_ids_TK.shape
    y = torch.zeros(T * K, down.shape[1], dtype=torch.float32, device=x_TD.device)
    if T == 0:
        return y
    w_R = topk_weights_TK.float().reshape(-1, 1)
    qg, qu, qd = (quantizes_activations(w) for w in (gate, up, down))
    for e, rows in expert_rows(topk_ids_TK, E):
        wg, wu, wd = (expert_weight(w, e, x_TD.dtype).double() for w in (gate, up, down))

        def tile(a, w, wg=wg, wu=wu, wd=wd):
            a64 = a.double()
            aq = fp8_activation_f64(a) if qg or qu else None
            h = swiglu_hidden(round_f64((aq if qg else a64) @ wg.t(), torch.float32),
                              round_f64((aq if qu else a64) @ wu.t(), torch.float32), w, swiglu_limit, x_TD.dtype)
            return round_f64((fp8_activation_f64(h) if qd else h.double()) @ wd.t(), torch.float32)

        y[rows] = map_row_tiles(tile, x_TD[rows // K], w_R[rows])
    return y
