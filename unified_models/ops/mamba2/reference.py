"""Oracles of the Mamba-2 ops in fp64 (one sequence each, differentiable), and
:func:`ssd_chunked_torch`, the differentiable chunked form of the scan that the
backward recomputes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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


def mamba2_dt_reference(dt_TH, dt_bias_H, dt_limit=(0.0, math.inf)) -> torch.Tensor:
    """Oracle in fp64 (differentiable)."""
    v = dt_TH.double() + dt_bias_H.double()
    return torch.clamp(F.softplus(v), float(dt_limit[0]), float(dt_limit[1]))


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


def gated_rms_norm_reference(y_TF, z_TF, weight_F, group_size: int, eps: float, out_dtype=None) -> torch.Tensor:
    """Oracle in fp64 (differentiable)."""
    hh = y_TF.double() * F.silu(z_TF.double())
    g = hh.view(hh.shape[0], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.view(hh.shape) * weight_F.double()
    return out.to(out_dtype) if out_dtype is not None else out
