"""Differentiable Mamba-2 ops: kernel values, gradients from a plain-torch recomputation.

Each entry point calls the dispatching op of :mod:`.dispatch`
directly when no input requires grad (the inference path). Otherwise a
``torch.autograd.Function`` returns the kernel's output unchanged (the
*visible* values, bitwise) and its backward differentiates a plain-torch
recomputation of the same math in fp32 (fp64 for fp64 inputs): DESIGN.md
rule 11's ``visible + (graph - graph.detach())``, done exactly and lazily
(the graph is built in the backward, so nothing of it is kept between forward
and backward). Roundings of the forward (the model-dtype conv output, the
normalised output) pass gradients straight through.

==================  ==========================================================
op                  recomputation
==================  ==========================================================
causal_conv1d       gather of each token's W inputs, fp32 multiply-add, SiLU
mamba2_dt           ``clamp(softplus(dt + bias), lo, hi)``
ssd_chunk_scan      chunked SSD with the einsums of transformers' torch path
                    (:func:`~.reference.ssd_chunked_torch_batched`): sequences from
                    position 0 batched by chunk count; a continued sequence alone
                    from its chunk boundary (pending rows and boundary state are inputs)
gated_rms_norm      ``rmsnorm_group(y * silu(z)) * w``
==================  ==========================================================

**Cached state is constant.** Conv rows, pending rows and the boundary state
read from a :class:`Mamba2State` (tokens of earlier calls) are snapshotted
before the forward updates the state and enter the recomputation as
constants: gradients do not flow into earlier calls. The trainer recomputes
whole sequences from position 0 in one call (THD packing), which needs no
state at all. Weights (conv weight/bias, dt_bias, A_log, D, norm weight) are
guarded by the weight-version stamps (:mod:`unified_models.ops.grad.weights`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._dispatch import host_to_device
from ..grad.helpers import acc
from ..grad.weights import check_stamps, stamp
from . import dispatch
from .common import _need_state
from .cpu import conv_source_index
from .reference import ssd_chunked_torch, ssd_chunked_torch_batched


__all__ = ["causal_conv1d", "mamba2_dt", "ssd_chunk_scan", "gated_rms_norm"]


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Recompute:
    """What :class:`RecomputeFn` needs: ``run()`` (visible values), ``graph(*leaves)``
    (differentiable recomputation), a name and the weight stamps."""

    name = "mamba2"
    stamps = ()

    def run(self):  # pragma: no cover - interface
        raise NotImplementedError

    def graph(self, *leaves):  # pragma: no cover - interface
        raise NotImplementedError


class RecomputeFn(torch.autograd.Function):
    """Inputs ``(spec, *tensors)``: the output is ``spec.run()``; the gradient of each
    tensor is that of ``spec.graph`` at the same (upcast) inputs."""

    @staticmethod
    def forward(ctx, spec: _Recompute, *inputs):
        out = spec.run()
        ctx.spec = spec
        ctx.save_for_backward(*inputs)
        return out

    @staticmethod
    def backward(ctx, g):
        spec = ctx.spec
        check_stamps(spec.name, spec.stamps)
        ins = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        leaves = [None if t is None else acc(t).detach().requires_grad_(bool(need[i])) for i, t in enumerate(ins)]
        with torch.enable_grad():
            out = spec.graph(*leaves)
        want = [i for i, t in enumerate(leaves) if t is not None and need[i]]
        grads = torch.autograd.grad(out, [leaves[i] for i in want], acc(g), allow_unused=True)
        res: list[torch.Tensor | None] = [None] * len(ins)
        for i, d in zip(want, grads):
            res[i] = (torch.zeros_like(ins[i]) if d is None else d.to(ins[i].dtype))
        return (None, *res)


class _Conv(_Recompute):
    name = "causal_conv1d"

    def __init__(self, x, w, b, meta, state):
        _need_state(meta, state, self.name)
        self.args = (x, w, b, meta, state)
        self.stamps = stamp(weight=w, bias=b)
        T, W = x.shape[0], w.shape[1]
        idx, seqs = conv_source_index(meta, W, T, x.device)
        self.idx = idx
        if seqs:  # conv rows of earlier calls: constants, taken before the forward updates them
            slots = torch.tensor([meta.host["slot"][b_] for b_ in seqs], device=x.device)
            self.const = state.conv[slots].reshape(-1, x.shape[1]).clone()
        else:
            self.const = x.new_zeros((0, x.shape[1]))
        self.valid = (meta.token_seq >= 0).to(x.device)

    def run(self):
        return dispatch.causal_conv1d(*self.args)

    def graph(self, x, w, b):
        table = torch.cat([x, self.const.to(x.dtype), x.new_zeros((1, x.shape[1]))])
        src = table[self.idx]  # [T, W, C]
        y = sum(src[:, j] * w[:, j] for j in range(w.shape[1]))
        if b is not None:
            y = y + b
        return F.silu(y) * self.valid[:, None].to(y.dtype)


def causal_conv1d(x_TC, weight_CW, bias_C, meta, state=None):
    """:func:`ops.mamba2.causal_conv1d`, differentiable w.r.t. ``x_TC``, ``weight_CW``, ``bias_C``.

    Conv state rows of earlier calls are constants. Shapes and errors as the op.
    """
    if not _needs_grad(x_TC, weight_CW, bias_C):
        return dispatch.causal_conv1d(x_TC, weight_CW, bias_C, meta, state)
    spec = _Conv(x_TC, weight_CW, bias_C, meta, state)
    return RecomputeFn.apply(spec, x_TC, weight_CW, bias_C)


class _Dt(_Recompute):
    name = "mamba2_dt"

    def __init__(self, dt, bias, limit):
        self.args = (dt, bias, limit)
        self.stamps = stamp(dt_bias=bias)

    def run(self):
        return dispatch.mamba2_dt(*self.args)

    def graph(self, dt, bias):
        lo, hi = self.args[2]
        return torch.clamp(F.softplus(dt + bias), float(lo), float(hi))


def mamba2_dt(dt_TH, dt_bias_H, dt_limit=(0.0, math.inf)):
    """:func:`ops.mamba2.mamba2_dt`, differentiable w.r.t. ``dt_TH`` and ``dt_bias_H``."""
    if not _needs_grad(dt_TH, dt_bias_H):
        return dispatch.mamba2_dt(dt_TH, dt_bias_H, dt_limit)
    spec = _Dt(dt_TH, dt_bias_H, dt_limit)
    return RecomputeFn.apply(spec, dt_TH, dt_bias_H)


class _Ssd(_Recompute):
    name = "ssd_chunk_scan"

    def __init__(self, x, dt, A_log, B, C, D, meta, state, out_dtype):
        _need_state(meta, state, self.name)
        self.args = (x, dt, A_log, B, C, D, meta, state, out_dtype)
        self.stamps = stamp(A_log=A_log, D=D)
        h = meta.host
        Q = meta.chunk_size
        self.seqs = []  # (first row, length, pending count, S0 or None, pending (x, dt, B) or None)
        for b_ in range(len(h["seq_len"])):
            L, p0 = h["seq_len"][b_], h["start_pos"][b_]
            if L == 0:
                continue
            cnt = p0 % Q
            slot = h["slot"][b_]
            s0 = state.ssm[slot].clone() if (state is not None and p0 >= Q) else None
            pend = ((state.x[slot, :cnt].clone(), state.dt[slot, :cnt].clone(), state.B[slot, :cnt].clone())
                    if cnt else None)
            self.seqs.append((h["cu"][b_], L, cnt, s0, pend))

    def run(self):
        return dispatch.ssd_chunk_scan(*self.args)

    def graph(self, x, dt, A_log, B, C, D):
        meta = self.args[6]
        Q = meta.chunk_size
        T, H, P = x.shape
        ys, rows = [], []
        fresh: dict[int, list[tuple[int, int]]] = {}  # chunk count -> (first row, length) of sequences from 0
        for c0, L, cnt, s0, pend in self.seqs:
            if s0 is None and pend is None:
                fresh.setdefault(-(-L // Q), []).append((c0, L))
                continue
            xs, dts, Bs, Cs = x[c0:c0 + L], dt[c0:c0 + L], B[c0:c0 + L], C[c0:c0 + L]
            if pend is not None:
                px, pdt, pb = (t.to(x.dtype) for t in pend)
                xs, dts, Bs = torch.cat([px, xs]), torch.cat([pdt, dts]), torch.cat([pb, Bs])
                Cs = torch.cat([Cs.new_zeros((cnt, *Cs.shape[1:])), Cs])  # outputs of pending rows are dropped
            y = ssd_chunked_torch(xs, dts, A_log, Bs, Cs, D, Q, None if s0 is None else s0.to(x.dtype))
            ys.append(y[cnt:])
            rows.append(torch.arange(c0, c0 + L, device=x.device))
        for chunks, group in sorted(fresh.items()):  # one batched recomputation per chunk count
            y, r = _ssd_group(x, dt, A_log, B, C, D, Q, chunks, group)
            ys.append(y)
            rows.append(r)
        out = x.new_zeros((T, H, P))
        if ys:
            out = out.index_put((torch.cat(rows),), torch.cat(ys))
        return out


def _ssd_group(x, dt, A_log, B, C, D, Q: int, chunks: int, group: list[tuple[int, int]]):
    """The recomputation of sequences that start at position 0 and span ``chunks`` chunks, batched.

    Each sequence ``(first row, length)`` is gathered into a row of ``[len(group), chunks * Q]`` and
    zero-padded (:func:`~.reference.ssd_chunked_torch_batched`: zero rows change nothing before them).

    Returns:
        ``(y [R, H, P], rows [R] int64)``: the sequences' outputs and their flat rows, R = sum of lengths.
    """
    T, H, P = x.shape
    width = chunks * Q
    idx = torch.full((len(group), width), T, dtype=torch.int64)  # T: the zero row appended below
    keep = []  # the sequences' entries in the flattened [len(group) * width], worked out on the host
    for i, (c0, L) in enumerate(group):
        idx[i, :L] = torch.arange(c0, c0 + L)
        keep.append(torch.arange(i * width, i * width + L))
    idx, keep = host_to_device(idx, x.device), host_to_device(torch.cat(keep), x.device)

    def gathered(t):
        return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[idx]

    y = ssd_chunked_torch_batched(gathered(x), gathered(dt), A_log, gathered(B), gathered(C), D, Q)
    return y.reshape(-1, H, P)[keep], idx.view(-1)[keep]  # index, not a mask: no device read


def ssd_chunk_scan(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state=None, out_dtype=torch.float32):
    """:func:`ops.mamba2.ssd_chunk_scan`, differentiable w.r.t. x, dt, A_log, B, C and D.

    The boundary state and pending rows read from ``state`` are constants.
    Shapes and errors as the op (checked before any graph is built).
    """
    if not _needs_grad(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H):
        return dispatch.ssd_chunk_scan(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    spec = _Ssd(x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H, meta, state, out_dtype)
    return RecomputeFn.apply(spec, x_THP, dt_TH, A_log_H, B_TGN, C_TGN, D_H)


class _Norm(_Recompute):
    name = "gated_rms_norm"

    def __init__(self, y, z, w, group_size, eps, out_dtype):
        self.args = (y, z, w, group_size, eps, out_dtype)
        self.stamps = stamp(weight=w)

    def run(self):
        return dispatch.gated_rms_norm(*self.args)

    def graph(self, y, z, w):
        gs, eps = self.args[3], self.args[4]
        hh = y * F.silu(z)
        g = hh.view(hh.shape[0], -1, gs)
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)
        return g.view(hh.shape) * w


def gated_rms_norm(y_TF, z_TF, weight_F, group_size, eps, out_dtype=None):
    """:func:`ops.mamba2.gated_rms_norm`, differentiable w.r.t. ``y_TF``, ``z_TF``, ``weight_F``."""
    if not _needs_grad(y_TF, z_TF, weight_F):
        return dispatch.gated_rms_norm(y_TF, z_TF, weight_F, group_size, eps, out_dtype)
    if y_TF.dim() != 2 or z_TF.shape != y_TF.shape or weight_F.shape != (y_TF.shape[1],):
        raise ValueError(f"gated_rms_norm: y {tuple(y_TF.shape)}, z {tuple(z_TF.shape)}, weight "
                         f"{tuple(weight_F.shape)} must be [T,F], [T,F], [F]")
    spec = _Norm(y_TF, z_TF, weight_F, group_size, eps, out_dtype)
    return RecomputeFn.apply(spec, y_TF, z_TF, weight_F)
