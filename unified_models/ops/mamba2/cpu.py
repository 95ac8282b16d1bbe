"""CPU path of the Mamba-2 ops: plain torch, batch-invariant by construction and
independent of the host BLAS (elementwise fp64 multiply-adds in a fixed index
order rounded once to fp32; transcendentals through :func:`_ew`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dispatch import map_row_tiles
from .common import Mamba2Metadata, Mamba2State


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


def conv_source_inverse(meta: Mamba2Metadata, W: int, T: int, device) -> torch.Tensor:
    """``inv [T, W]``: the token whose tap ``j`` reads x row ``t`` (:func:`conv_source_index`), ``T`` where
    none does (each x row is read by at most one token per tap); the backward's gather in place of a
    scatter-add. Worked out on the host, cached in the metadata per ``(W, device)``."""
    key = ("conv_inv", W, T, str(device))
    if key not in meta.host:
        idx = conv_source_index(meta, W, T, "cpu")[0]
        inv = torch.full((T + 1, W), T, dtype=torch.int64)  # row T: a sink for taps reading no x row
        taps = torch.arange(W).expand(T, W)
        inv[idx.clamp(max=T), taps] = torch.arange(T).view(-1, 1).expand(T, W)
        meta.host[key] = inv[:T].to(device)
    return meta.host[key]


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


def mamba2_dt_torch(dt_TH, dt_bias_H, lo: float, hi: float) -> torch.Tensor:
    v = dt_TH.float() + dt_bias_H.float()
    return torch.clamp(_ew(_softplus, v), lo, hi)


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
