"""fp64 oracles of DeepSeek-V4's router, hash router and clamped-SwiGLU experts (plain torch,
differentiable). Formulas: transformers 5.19 ``modeling_deepseek_v4.py`` (``DeepseekV4TopKRouter``,
``DeepseekV4HashRouter``, ``DeepseekV4Experts``, ``DeepseekV4MLP``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import NORM_EPS
from .reference import _rank_rows


def _weights_reference(s, ids, norm_topk_prob, routed_scaling_factor):
    w = s.gather(1, ids.long())
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + NORM_EPS)
    return w * routed_scaling_factor


def sqrtsoftplus_route_reference(x_TD, gate_weight_ED, bias_E, *, top_k, norm_topk_prob=True,
                                 routed_scaling_factor=1.0, dtype=torch.float64):
    """Oracle of :func:`.deepseek.sqrtsoftplus_route` in ``dtype``: same selection rule (ties to the
    lower index, slots best first). Returns ``(weights_TK dtype, ids_TK int32)``."""
    s = torch.sqrt(F.softplus(x_TD.to(dtype) @ gate_weight_ED.to(dtype).t()))
    c = s + bias_E.to(dtype) if bias_E is not None else s
    ids = _rank_rows(c, top_k)
    return _weights_reference(s, ids, norm_topk_prob, routed_scaling_factor), ids.to(torch.int32)


def hash_route_reference(x_TD, gate_weight_ED, tid2eid_VK, input_ids_T, *, norm_topk_prob=True,
                         routed_scaling_factor=1.0, dtype=torch.float64):
    """Oracle of :func:`.deepseek.hash_route`: ids ``tid2eid[input_ids]``, weights from the scores.
    ``tid2eid_VK`` may be a float copy of the table (the reference model stores every tensor in its
    dtype); its entries are small integers, exact in fp32."""
    s = torch.sqrt(F.softplus(x_TD.to(dtype) @ gate_weight_ED.to(dtype).t()))
    ids = tid2eid_VK[input_ids_T.long()].long()
    return _weights_reference(s, ids, norm_topk_prob, routed_scaling_factor), ids.to(torch.int32)


def swiglu(g, u, limit):
    """``silu(min(g, L)) * clamp(u, -L, L)`` (``DeepseekV4Experts._apply_gate``), any dtype."""
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


def swiglu_experts_reference(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, shared_TD=None, *,
                             swiglu_limit, dtype=torch.float64):
    """Oracle: ``sum_k w2_e(w_k swiglu(w1_e x, w3_e x)) (+ shared)`` in ``dtype`` (tensor weights
    ``[E, I, D]``, ``[E, I, D]``, ``[E, D, I]``)."""
    x = x_TD.to(dtype)
    wg, wu, wd = (w.to(dtype) for w in (gate, up, down))
    ids = topk_ids_TK.long()
    T, K = ids.shape
    out = torch.zeros(T, wd.shape[1], dtype=dtype, device=x.device) if shared_TD is None else shared_TD.to(dtype)
    for k in range(K):
        e = ids[:, k]
        h = swiglu(torch.einsum("td,tid->ti", x, wg[e]), torch.einsum("td,tid->ti", x, wu[e]), swiglu_limit)
        h = h * topk_weights_TK[:, k:k + 1].to(dtype)
        out = out + torch.einsum("ti,tdi->td", h, wd[e])
    return out


def swiglu_shared_expert_reference(x_TD, gate_ID, up_ID, down_DI, *, swiglu_limit, dtype=torch.float64):
    """Oracle of :func:`.deepseek.swiglu_shared_expert` (``DeepseekV4MLP``)."""
    x = x_TD.to(dtype)
    return swiglu(x @ gate_ID.to(dtype).t(), x @ up_ID.to(dtype).t(), swiglu_limit) @ down_DI.to(dtype).t()
