"""Oracles of the Mamba-2 ops in fp64 (one sequence each, differentiable), and
:func:`ssd_chunked_torch` / :func:`ssd_chunked_torch_batched`, the differentiable chunked form of
the scan that the backward recomputes."""

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
    Returns ``[L, H, P]``; :func:`ssd_chunked_torch_batched` with a batch of one."""
    init = None if initial_state_HPN is None else initial_state_HPN[None]
    return ssd_chunked_torch_batched(x_LHP[None], dt_LH[None], A_log_H, B_LGN[None], C_LGN[None], D_H,
                                     chunk_size, init)[0]


def ssd_chunked_torch_batched(x_BLHP, dt_BLH, A_log_H, B_BLGN, C_BLGN, D_H, chunk_size: int,
                              initial_state_BHPN: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable chunked SSD for a batch of sequences of one length ``L``, each starting at a
    chunk boundary: the chunked form of transformers' torch path (``torch_forward`` of
    ``modeling_nemotron_h.py``), plain torch einsums in the inputs' dtype (fp32/fp64).

    Rows past a sequence's end may be zero (``x = dt = B = C = 0``): a zero ``dt`` row decays nothing
    and adds nothing to the state, so a shorter sequence zero-padded to ``L`` gives its own rows
    unchanged (its padded rows' outputs are to be dropped).

    Args:
        x_BLHP: ``[Bt, L, H, P]``; dt_BLH: ``[Bt, L, H]`` (after softplus / limits); A_log_H: ``[H]``;
        B_BLGN, C_BLGN: ``[Bt, L, G, N]`` (G divides H); D_H: ``[H]`` or None; chunk_size: Q;
        initial_state_BHPN: ``[Bt, H, P, N]`` or None (zeros).

    Returns:
        ``[Bt, L, H, P]`` in x's dtype.
    """
    Bt, L, H, P = x_BLHP.shape
    G, N = B_BLGN.shape[2:]
    Q = chunk_size
    pad = (-L) % Q
    dtype = x_BLHP.dtype
    A = -torch.exp(A_log_H.to(dtype))

    def padded(t):
        return torch.cat([t, t.new_zeros((Bt, pad, *t.shape[2:]))], dim=1) if pad else t

    x, dt = padded(x_BLHP), padded(dt_BLH.to(dtype))
    Bh = padded(B_BLGN.to(dtype)).repeat_interleave(H // G, dim=2)
    Ch = padded(C_BLGN.to(dtype)).repeat_interleave(H // G, dim=2)
    c = x.shape[1] // Q
    xq = (x * dt[..., None]).view(Bt, c, Q, H, P)
    a = (dt * A).view(Bt, c, Q, H).permute(0, 3, 1, 2)  # [Bt, H, c, Q]
    Bq, Cq = Bh.view(Bt, c, Q, H, N), Ch.view(Bt, c, Q, H, N)
    acum = torch.cumsum(a, dim=-1)
    Lm = torch.exp(_segsum(a))  # [Bt, H, c, Q, Q]
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cq, Bq, Lm, xq)
    decay_states = torch.exp(acum[..., -1:] - acum)  # [Bt, H, c, Q]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bq, decay_states, xq)
    init = (initial_state_BHPN.to(dtype)[:, None] if initial_state_BHPN is not None
            else torch.zeros((Bt, 1, H, P, N), dtype=dtype, device=x.device))
    states = torch.cat([init, states], dim=1)  # [Bt, c+1, H, P, N]
    decay_chunk = torch.exp(_segsum(F.pad(acum[..., -1], (1, 0))))  # [Bt, H, c+1, c+1]
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states = new_states[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cq, states, torch.exp(acum))
    y = (y_diag + y_off).reshape(Bt, c * Q, H, P)
    if D_H is not None:
        y = y + D_H.to(dtype)[:, None] * x
    return y[:, :L]


def gated_rms_norm_reference(y_TF, z_TF, weight_F, group_size: int, eps: float, out_dtype=None) -> torch.Tensor:
    """Oracle in fp64 (differentiable)."""
    hh = y_TF.double() * F.silu(z_TF.double())
    g = hh.view(hh.shape[0], -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.view(hh.shape) * weight_F.double()
    return out.to(out_dtype) if out_dtype is not None else out
