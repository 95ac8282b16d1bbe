"""fp64 oracles of the MoE router, experts and shared expert."""

from __future__ import annotations

import torch

from ..nvfp4 import NVFP4Weight, nvfp4_dequantize
from .common import NORM_EPS, expert_weight


def moe_route_reference(x_TD, gate_weight_ED, e_score_correction_bias_E, *, top_k, n_group=1, topk_group=1,
                        norm_topk_prob=True, routed_scaling_factor=1.0, dtype=torch.float64):
    """Oracle in ``dtype`` (fp64): same selection rule (ties to the lower index), slots best first."""
    logits = x_TD.to(dtype) @ gate_weight_ED.to(dtype).t()
    s = torch.sigmoid(logits)
    c = s + e_score_correction_bias_E.to(dtype) if e_score_correction_bias_E is not None else s
    T, E = c.shape
    if n_group > 1:
        per = E // n_group
        gs = c.view(T, n_group, per).topk(2, dim=-1).values.sum(-1)
        keep = _rank_rows(gs, topk_group)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=c.device).scatter_(1, keep, True)
        c = c.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = _rank_rows(c, top_k)
    w = s.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + NORM_EPS)
    return w * routed_scaling_factor, ids.to(torch.int32)


def _rank_rows(c, k):
    """Per row, the k best columns: value descending, then column ascending (python sort, any dtype)."""
    out = []
    for row in c.tolist():
        out.append(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])
    return torch.tensor(out, dtype=torch.long, device=c.device).view(c.shape[0], k)


def moe_experts_reference(x_TD, topk_ids_TK, topk_weights_TK, up, down, shared_TD=None, dtype=torch.float64):
    """Oracle: ``sum_k w_k down_e(relu(up_e x)^2) (+ shared)`` in ``dtype`` (NVFP4 weights dequantized
    by ModelOpt's rule), differentiable (plain torch)."""
    E = up.shape[0]
    T, K = topk_ids_TK.shape
    wu = torch.stack([expert_weight(up, e, torch.float32) if isinstance(up, NVFP4Weight) else up[e]
                      for e in range(E)]).to(dtype)
    wd = torch.stack([expert_weight(down, e, torch.float32) if isinstance(down, NVFP4Weight) else down[e]
                      for e in range(E)]).to(dtype)
    x = x_TD.to(dtype)
    ids = topk_ids_TK.long()
    out = torch.zeros(T, wd.shape[1], dtype=dtype, device=x.device) if shared_TD is None else shared_TD.to(dtype)
    for k in range(K):
        u = torch.einsum("td,tid->ti", x, wu[ids[:, k]])
        y = torch.einsum("ti,tdi->td", torch.relu(u) ** 2, wd[ids[:, k]])
        out = out + topk_weights_TK[:, k:k + 1].to(dtype) * y
    return out


def moe_shared_expert_reference(x_TD, up_ID, down_DI, dtype=torch.float64):
    """Oracle of :func:`moe_shared_expert`."""
    wu = nvfp4_dequantize(up_ID, torch.float32) if isinstance(up_ID, NVFP4Weight) else up_ID
    wd = nvfp4_dequantize(down_DI, torch.float32) if isinstance(down_DI, NVFP4Weight) else down_DI
    return torch.relu(x_TD.to(dtype) @ wu.to(dtype).t()) ** 2 @ wd.to(dtype).t()
