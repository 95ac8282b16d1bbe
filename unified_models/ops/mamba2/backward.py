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
                    position 0 batched by chunk count, differentiated analytically
                    (:func:`~.ssd_backward.ssd_chunked_backward`, no graph); a
                    continued sequence alone from its chunk boundary (pending rows
                    and boundary state are inputs), by autograd
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
from .cpu import conv_source_index, conv_source_inverse
from .reference import ssd_chunked_torch, ssd_chunked_torch_batched
from .ssd_backward import ssd_chunked_backward


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

    def grads(self, leaves: list, need: tuple, g: torch.Tensor) -> list:
        """The gradients of the inputs marked in ``need`` (None elsewhere): autograd of ``graph`` at
        ``leaves`` (the saved inputs in the accumulation dtype, None for absent ones) against ``g``."""
        return _autograd_grads(self.graph, leaves, need, g)


def _autograd_grads(graph, leaves: list, need: tuple, g: torch.Tensor) -> list:
    """Autograd of ``graph(*leaves)`` against ``g`` for the leaves marked in ``need`` (None elsewhere, and
    None for a marked leaf the graph does not use); the leaves are detached copies, left untouched."""
    with torch.enable_grad():
        lv = [None if t is None else t.detach().requires_grad_(bool(need[i])) for i, t in enumerate(leaves)]
        out = graph(*lv)
    want = [i for i, t in enumerate(lv) if t is not None and need[i]]
    res = [None] * len(leaves)
    for i, d in zip(want, torch.autograd.grad(out, [lv[i] for i in want], g, allow_unused=True)):
        res[i] = d
    return res


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
        leaves = [None if t is None else acc(t).detach() for t in ins]
        grads = spec.grads(leaves, need, acc(g))
        res: list[torch.Tensor | None] = [None] * len(ins)
        for i, t in enumerate(ins):
            if t is not None and need[i]:
                res[i] = torch.zeros_like(t) if grads[i] is None else grads[i].to(t.dtype)
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

    def grads(self, leaves, need, g):
        """Written out, gathers only (autograd of :meth:`graph` scatter-adds ``[T, W, C]`` rows back into the
        table: a sort per call on CUDA): with ``y = sum_j w_j x[idx_j] + b`` and ``gp = g silu'(y)`` on
        valid rows, ``dw_j = sum_t gp x[idx_j]``, ``db = sum_t gp``, ``dx[t] = sum_j w_j gp[inv_j[t]]``
        (:func:`~.cpu.conv_source_inverse`: the token whose tap ``j`` reads row ``t``)."""
        x, w, b = leaves
        T, W = x.shape[0], w.shape[1]
        table = torch.cat([x, self.const.to(x.dtype), x.new_zeros((1, x.shape[1]))])
        taps = [table[self.idx[:, j]] for j in range(W)]  # [T, C] each
        y = sum(taps[j] * w[:, j] for j in range(W))
        if b is not None:
            y = y + b
        s = torch.sigmoid(y)
        gp = g * (s * (1 + y * (1 - s))) * self.valid[:, None].to(y.dtype)  # d silu(y) / dy = s (1 + y (1 - s))
        dx = dw = db = None
        if need[0]:
            inv = conv_source_inverse(self.args[3], W, T, x.device)
            gp_pad = torch.cat([gp, gp.new_zeros((1, gp.shape[1]))])
            dx = sum(gp_pad[inv[:, j]] * w[:, j] for j in range(W))
        if need[1]:
            dw = torch.stack([(gp * taps[j]).sum(0) for j in range(W)], dim=1)
        if need[2] and b is not None:
            db = gp.sum(0)
        return [dx, dw, db]


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

    def _fresh_groups(self) -> dict[int, list[tuple[int, int]]]:
        """Chunk count -> ``(first row, length)`` of the sequences that start at position 0."""
        Q = self.args[6].chunk_size
        fresh: dict[int, list[tuple[int, int]]] = {}
        for c0, L, _cnt, s0, pend in self.seqs:
            if s0 is None and pend is None:
                fresh.setdefault(-(-L // Q), []).append((c0, L))
        return dict(sorted(fresh.items()))

    def _continued(self, x, dt, A_log, B, C, D):
        """Outputs and rows of the sequences continued from cached state (one recomputation each)."""
        Q = self.args[6].chunk_size
        ys, rows = [], []
        for c0, L, cnt, s0, pend in self.seqs:
            if s0 is None and pend is None:
                continue
            xs, dts, Bs, Cs = x[c0:c0 + L], dt[c0:c0 + L], B[c0:c0 + L], C[c0:c0 + L]
            if pend is not None:
                px, pdt, pb = (t.to(x.dtype) for t in pend)
                xs, dts, Bs = torch.cat([px, xs]), torch.cat([pdt, dts]), torch.cat([pb, Bs])
                Cs = torch.cat([Cs.new_zeros((cnt, *Cs.shape[1:])), Cs])  # outputs of pending rows are dropped
            y = ssd_chunked_torch(xs, dts, A_log, Bs, Cs, D, Q, None if s0 is None else s0.to(x.dtype))
            ys.append(y[cnt:])
            rows.append(torch.arange(c0, c0 + L, device=x.device))
        return ys, rows

    def graph(self, x, dt, A_log, B, C, D):
        Q = self.args[6].chunk_size
        ys, rows = self._continued(x, dt, A_log, B, C, D)
        for chunks, group in self._fresh_groups().items():  # one batched recomputation per chunk count
            y, r = _ssd_group(x, dt, A_log, B, C, D, Q, chunks, group)
            ys.append(y)
            rows.append(r)
        out = x.new_zeros(x.shape)
        if ys:
            out = out.index_put((torch.cat(rows),), torch.cat(ys))
        return out

    def grads(self, leaves, need, g):
        """Continued sequences: autograd of their recomputation; sequences from position 0: the analytic
        backward (:func:`~.ssd_backward.ssd_chunked_backward`), batched by chunk count as in :meth:`graph`.
        Each row belongs to one sequence, so the two parts write disjoint rows; ``A_log`` and ``D`` sum."""
        x, dt, A_log, B, C, D = leaves
        res: list[torch.Tensor | None] = [None] * 6
        if any(s0 is not None or pend is not None for _c0, _L, _cnt, s0, pend in self.seqs):
            def continued(*lv):
                ys, rows = self._continued(*lv)
                return lv[0].new_zeros(lv[0].shape).index_put((torch.cat(rows),), torch.cat(ys))

            res = _autograd_grads(continued, leaves, need, g)
        res = [None if t is None or not need[i] else (torch.zeros_like(t) if res[i] is None else res[i])
               for i, t in enumerate(leaves)]
        Q = self.args[6].chunk_size
        orig = self.args
        split = x.is_cuda and any(t.dtype in (torch.bfloat16, torch.float16) for t in (orig[0], orig[3], orig[4]))
        bc_exact = orig[3].dtype == orig[4].dtype == torch.bfloat16  # B, C: bf16 values, one exact term each
        # one accumulation dtype for the written-out backward (the op takes fp64 activations beside its fp32 dt)
        wide = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in (*leaves, g)) else torch.float32
        x, dt, A_log, B, C, D, g = (None if t is None else t.to(wide) for t in (x, dt, A_log, B, C, D, g))
        for chunks, group in self._fresh_groups().items():
            idx, keep = _group_rows(group, chunks * Q, x.shape[0], x.device)

            def gathered(t):
                return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[idx]

            parts = ssd_chunked_backward(gathered(x), gathered(dt), A_log, gathered(B), gathered(C), D, Q,
                                         gathered(g), split_fp32=split, bc_exact=bc_exact)
            rows = idx.view(-1)[keep]
            for i, d in enumerate(parts):
                if res[i] is None or d is None:
                    continue
                d = d.to(res[i].dtype)
                if i in (2, 5):  # A_log, D: per head, summed over every sequence
                    res[i] += d
                else:  # per row: each row is one sequence's, written once
                    res[i].index_put_((rows,), d.reshape(-1, *d.shape[2:])[keep])
        return res


def _group_rows(group: list[tuple[int, int]], width: int, T: int, device):
    """``(idx [n, width], keep)``: row ``i`` of ``idx`` lists sequence ``i``'s flat rows, ``T`` (a zero row
    appended by the caller) past its end; ``keep`` the real entries of ``idx.view(-1)``, worked out on the host
    (one host-to-device copy each, no device read)."""
    idx = torch.full((len(group), width), T, dtype=torch.int64)
    keep = []
    for i, (c0, L) in enumerate(group):
        idx[i, :L] = torch.arange(c0, c0 + L)
        keep.append(torch.arange(i * width, i * width + L))
    return host_to_device(idx, device), host_to_device(torch.cat(keep), device)


def _ssd_group(x, dt, A_log, B, C, D, Q: int, chunks: int, group: list[tuple[int, int]]):
    """The recomputation of sequences that start at position 0 and span ``chunks`` chunks, batched.

    Each sequence ``(first row, length)`` is gathered into a row of ``[len(group), chunks * Q]`` and
    zero-padded (:func:`~.reference.ssd_chunked_torch_batched`: zero rows change nothing before them).

    Returns:
        ``(y [R, H, P], rows [R] int64)``: the sequences' outputs and their flat rows, R = sum of lengths.
    """
    T, H, P = x.shape
    idx, keep = _group_rows(group, chunks * Q, T, x.device)  # T: the zero row appended below

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
