"""Expert parallelism over a process group: tokens go to their experts' owners by an all-to-all, come back, combine at home.

:class:`AllToAllExperts` is the :class:`~.expert_parallel.ExpertDispatcher` of EP > 1. Each
rank of the expert-parallel group holds a contiguous block of ``E / ep`` experts
(:class:`~.expert_parallel.ShardPlan`, Megatron's layout) and its own tokens. One MoE call:

1. the ``[T*K]`` assignments (rows of ``ids_TK`` flattened, row ``t*K + k``) are ordered by
   owner rank, stably (so each destination receives its rows in ``(t, k)`` order), and every
   rank learns how many rows it receives (``all_to_all_single`` of the counts);
2. the rows' inputs ``x_TD[t]`` (model dtype) and expert ids go to the owners
   (``all_to_all_single``; :class:`AllToAll`, whose backward is the reverse all-to-all);
3. each owner computes ``ops.moe_expert_outputs`` of the rows it received against its local
   expert stacks (:class:`ExpertRowsFn`): fp32 rows, each a function of its own row only
   (batch-invariant per row, DESIGN.md rule 2), so the rows equal EP = 1's bit for bit;
4. the fp32 rows come back to the token's rank by the reverse all-to-all and are put back in
   ``[T*K]`` order;
5. ``ops.moe_combine`` sums them in fp32 in top-k slot order with the shared expert and rounds
   once (:class:`CombineFn`), on the token's rank.

Only data crosses processes (DESIGN.md rule 6): token rows, expert ids, expert output rows,
and their gradients in the backward. No collective sums anything, so the forward is bitwise
EP = 1's at any EP size and any assignment of sequences to ranks.

Collectives are ``torch.distributed``'s (``all_to_all_single``: gloo on the CPU, NCCL on the
GPU) over the group handed in: Megatron's ``parallel_state.get_expert_model_parallel_group()``
in the trainer (:mod:`unified_models.backends.megatron`). Every rank of the group must call the
dispatcher the same number of times in the same order (each MoE layer once per forward, the
reverse all-to-alls once per backward), also with no tokens: the counts exchange always runs.

Backward (DESIGN.md rule 11: correct, not batch-invariant): the combine's gradient at the
token's rank (``d rows = w g``, ``d w = <g, rows>``, ``d shared = g``), the reverse
all-to-all to the owners, the relu2 expert recomputed per expert in fp32 (as
``ops.moe.backward.ExpertsFn``: ``d down = dy^T h``, ``d up = du^T x``, ``dx = du up``; NVFP4
masters take the straight-through gradient), then the all-to-all back to the token's rank;
gradients of the experts' weights stay on their owner (Megatron's expert-parallel
parameters: ``allreduce = False``).

DeepSeek-V4 / Qwen3-MoE SwiGLU experts (:meth:`AllToAllExperts.swiglu_experts`) run through the
same exchange (the routing weight travels with the row when it is applied before the down
projection); the owner's rows come from the differentiable ``ops.swiglu_experts`` with one slot
per row, whose backward is the ops' own.

Shapes: T tokens, D hidden, E experts (global), L local experts, K top-k, I expert width,
S rows sent, R rows received.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import ops
from ..dsl import ParallelismError
from ..ops.grad.helpers import acc
from ..ops.grad.weights import check_stamps, stamp
from ..ops.moe import dispatch
from ..ops.moe.common import expert_rows, expert_weight
from ..ops.nvfp4 import nvfp4_quantize
from .expert_parallel import ShardPlan

__all__ = ["AllToAll", "ExpertRowsFn", "CombineFn", "AllToAllExperts", "num_local_experts"]


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows: ``send[r]`` rows of ``x`` (in order) go to rank ``r`` of ``group``,
    ``recv[r]`` rows arrive from rank ``r``. Backward: the reverse all-to-all of the gradient rows.
    Moves data only."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.group), None, None, None


def _rows_backward(g_RD, x_RD, ids_R, up, down, up_dtype, down_dtype, nx, nu, nd):
    """Gradients of the relu2 expert rows ``y_r = relu(x_r up_e^T)^2 down_e^T`` (``e = ids_r``) to
    ``x``, ``up`` and ``down`` (fp32, fp64 for fp64 input), recomputed per expert."""
    dt = torch.float64 if x_RD.dtype == torch.float64 else torch.float32
    g, x = g_RD.to(dt), x_RD.to(dt)
    L, I, D = up.shape
    dx = torch.zeros_like(x) if nx else None
    dup = torch.zeros((L, I, D), dtype=up_dtype, device=x.device) if nu else None
    ddown = torch.zeros((L, D, I), dtype=down_dtype, device=x.device) if nd else None
    for e, rows in expert_rows(ids_R.view(-1, 1), L):
        wu = expert_weight(up, e, x_RD.dtype).to(dt)
        wd = expert_weight(down, e, x_RD.dtype).to(dt)
        xe, ge = x[rows], g[rows]
        u = xe @ wu.t()
        r = torch.relu(u)
        if nd:
            ddown[e] = (ge.t() @ (r * r)).to(ddown.dtype)
        if nx or nu:
            du = (ge @ wd) * (2.0 * r)
            if nu:
                dup[e] = (du.t() @ xe).to(dup.dtype)
            if nx:
                dx[rows] = du @ wu
    return dx, dup, ddown


class ExpertRowsFn(torch.autograd.Function):
    """fp32 ``[R, D]``: row ``r`` = local expert ``ids_R[r]`` (relu2) on ``x_RD[r]``
    (``ops.moe_expert_outputs``, batch-invariant per row). ``up``/``down`` are the local
    ``[L, I, D]`` / ``[L, D, I]`` masters (quantized here by ModelOpt's rule when ``nvfp4``;
    straight-through gradient) or fixed ``ops.NVFP4Weight`` codes (no gradient)."""

    @staticmethod
    def forward(ctx, x_RD, up, down, ids_R, nvfp4: bool):
        up_q = nvfp4_quantize(up) if nvfp4 and isinstance(up, torch.Tensor) else up
        down_q = nvfp4_quantize(down) if nvfp4 and isinstance(down, torch.Tensor) else down
        y = dispatch.moe_expert_outputs(x_RD, ids_R.view(-1, 1), up_q, down_q)
        ctx.save_for_backward(x_RD, ids_R)
        ctx.up, ctx.down = up_q, down_q
        ctx.dtypes = tuple(w.dtype if isinstance(w, torch.Tensor) else None for w in (up, down))
        ctx.stamps = stamp(up_proj=up if isinstance(up, torch.Tensor) else None,
                           down_proj=down if isinstance(down, torch.Tensor) else None)
        return y

    @staticmethod
    def backward(ctx, g_RD):
        check_stamps("moe_experts (expert parallel)", ctx.stamps)
        x_RD, ids_R = ctx.saved_tensors
        nx, nu, nd = ctx.needs_input_grad[:3]
        if not (nx or nu or nd):
            return None, None, None, None, None
        dx, dup, ddown = _rows_backward(g_RD, x_RD, ids_R, ctx.up, ctx.down, *ctx.dtypes, nx, nu, nd)
        return (dx.to(x_RD.dtype) if nx else None), dup, ddown, None, None


class CombineFn(torch.autograd.Function):
    """``ops.moe_combine``: ``round(sum_k w_k y_{t*K+k} + shared_t)`` in fp32 slot order, on the token's
    rank. Backward: ``d y_{t*K+k} = w_k g_t``, ``d w_k = <g_t, y_{t*K+k}>``, ``d shared = g``."""

    @staticmethod
    def forward(ctx, rows_RD, w_TK, shared_TD, out_dtype):
        ctx.save_for_backward(rows_RD, w_TK)
        ctx.shared_dtype = shared_TD.dtype if shared_TD is not None else None
        return dispatch.moe_combine(rows_RD, w_TK, shared_TD, out_dtype)

    @staticmethod
    def backward(ctx, g_TD):
        rows_RD, w_TK = ctx.saved_tensors
        nr, nw, ns = ctx.needs_input_grad[:3]
        g = acc(g_TD)
        T, K = w_TK.shape
        y = rows_RD.to(g.dtype).view(T, K, -1)
        drows = (w_TK.to(g.dtype)[:, :, None] * g[:, None, :]).reshape(T * K, -1).to(rows_RD.dtype) if nr else None
        dw = (g[:, None, :] * y).sum(-1).to(w_TK.dtype) if nw else None
        ds = g_TD.to(ctx.shared_dtype) if ns else None
        return drows, dw, ds, None


def _leading(w: Any) -> int:
    return int((w.weight if hasattr(w, "weight") and not isinstance(w, torch.Tensor) else w).shape[0])


def num_local_experts(w: Any) -> int:
    """``L``: experts in a local stack (``[L, N, K]`` tensor, or a quantized weight's codes)."""
    return _leading(w)


class AllToAllExperts:
    """The expert-parallel :class:`~.expert_parallel.ExpertDispatcher` over ``group`` (module doc).

    Args:
        group: the expert-parallel process group (Megatron's
            ``parallel_state.get_expert_model_parallel_group()``); ``None`` = the default group.

    The ``plan`` handed to each call must be this rank's place in ``group``
    (``plan.ep_size == group size``, ``plan.ep_rank == rank in group``); the expert stacks
    are this rank's ``plan.local_experts(E)`` block.
    """

    def __init__(self, group=None):
        self.group = group
        self.calls = 0
        """MoE calls run (forward), for diagnostics."""
        self.rows_sent_remote = 0
        """Assignment rows this rank sent to another rank's experts (forward), for diagnostics."""

    def _check(self, plan: ShardPlan, local: int) -> int:
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (plan.ep_size, plan.ep_rank) != (size, rank):
            raise ParallelismError(f"AllToAllExperts: shard plan ep_rank={plan.ep_rank} of ep_size={plan.ep_size} "
                                   f"is not this process's place in the expert-parallel group ({rank} of {size})")
        return local * plan.ep_size

    def _exchange(self, plan: ShardPlan, ids_TK: torch.Tensor, local: int):
        """Ordering of the ``[T*K]`` rows by owner and the split sizes both ways."""
        flat = ids_TK.reshape(-1).long()
        owner = torch.div(flat, local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_t = torch.bincount(owner, minlength=plan.ep_size).to(torch.int64)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=self.group)
        send = send_t.tolist()
        self.calls += 1
        self.rows_sent_remote += sum(send) - send[plan.ep_rank]
        return flat, order, send, recv_t.tolist()

    def _route(self, plan: ShardPlan, ids_TK: torch.Tensor, up) -> tuple:
        """``(order, send, recv, ids_R)``: the assignments sorted by owner, the row counts sent to /
        received from each rank, and the received rows' local expert ids (``up`` holds this rank's
        experts).

        Raises:
            ParallelismError: ``plan`` is not this rank's place in the group.
        """
        local = num_local_experts(up)
        self._check(plan, local)
        flat, order, send, recv = self._exchange(plan, ids_TK, local)
        ids_R = _all_to_all(flat[order], send, recv, self.group) - plan.ep_rank * local
        return order, send, recv, ids_R

    def experts(self, plan: ShardPlan, x_TD, ids_TK, w_TK, up, down, shared_TD, *, nvfp4: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`.expert_parallel.ExpertDispatcher.experts` (relu2 experts, Nemotron-H).

        Raises:
            ParallelismError: ``plan`` is not this rank's place in the group.
        """
        order, send, recv, ids_R = self._route(plan, ids_TK, up)
        x_S = x_TD[torch.div(order, ids_TK.shape[1], rounding_mode="floor")]  # each assignment's token row, by owner
        grad = torch.is_grad_enabled()
        x_R = AllToAll.apply(x_S, send, recv, self.group) if grad else _all_to_all(x_S, send, recv, self.group)
        if grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x_R, up, down)):
            y_R = ExpertRowsFn.apply(x_R, up, down, ids_R, nvfp4)
            y_S = AllToAll.apply(y_R, recv, send, self.group)
        else:
            if nvfp4:
                up = nvfp4_quantize(up) if isinstance(up, torch.Tensor) else up
                down = nvfp4_quantize(down) if isinstance(down, torch.Tensor) else down
            y_S = _all_to_all(dispatch.moe_expert_outputs(x_R, ids_R.view(-1, 1), up, down), recv, send, self.group)
        rows = y_S[torch.argsort(order)]  # back to [T*K] order (t, k)
        if grad and any(t is not None and t.requires_grad for t in (rows, w_TK, shared_TD)):
            return CombineFn.apply(rows, w_TK, shared_TD, out_dtype)
        return dispatch.moe_combine(rows, w_TK, shared_TD, out_dtype)

    def swiglu_experts(self, plan: ShardPlan, x_TD, ids_TK, w_TK, gate, up, down, shared_TD, *,
                       swiglu_limit: float, out_dtype: torch.dtype, weight_before_down: bool = True) -> torch.Tensor:
        """See :meth:`.expert_parallel.ExpertDispatcher.swiglu_experts`: the same exchange; with
        ``weight_before_down`` (DeepSeek-V4) the fp32 routing weight travels with its row (and its
        gradient back), else (Qwen3-MoE) the owner computes the rows with weight 1 and the token's
        rank combines with the routing weights.

        The owner's rows are ``ops.swiglu_experts`` of the received rows with one slot each and an
        fp32 output: ``0 + 1 * y`` in fp32 is ``y``, so they are ``ops.moe.swiglu_expert_outputs``'s
        rows bit for bit, and the op's own backward (``SwigluExpertsFn``) gives the gradients to the
        rows, their routing weights and the local expert stacks.

        Raises:
            ParallelismError: ``plan`` is not this rank's place in the group.
        """
        T, K = ids_TK.shape
        order, send, recv, ids_R = self._route(plan, ids_TK, up)
        raw = [getattr(w, "weight", w) for w in (gate, up, down)]
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in (x_TD, w_TK, shared_TD, *raw))
        a2a = (lambda t, s, r: AllToAll.apply(t, s, r, self.group)) if grad else (
            lambda t, s, r: _all_to_all(t, s, r, self.group))
        x_R = a2a(x_TD[torch.div(order, K, rounding_mode="floor")], send, recv)
        ones_TK = torch.ones((T, K), dtype=torch.float32, device=x_TD.device)
        w_R = a2a((w_TK.float() if weight_before_down else ones_TK).reshape(-1)[order], send, recv)
        if grad:
            y_R = ops.swiglu_experts(x_R, ids_R.view(-1, 1), w_R.view(-1, 1), gate, up, down, None,
                                     swiglu_limit=swiglu_limit, out_dtype=torch.float32, weight_before_down=True)
        else:
            y_R = ops.moe.swiglu_expert_outputs(x_R, ids_R.view(-1, 1), w_R.view(-1, 1), gate, up, down,
                                                swiglu_limit=swiglu_limit)
        rows = a2a(y_R, recv, send)[torch.argsort(order)]
        combine_w = ones_TK if weight_before_down else w_TK.float()
        if grad:
            return CombineFn.apply(rows, combine_w, shared_TD, out_dtype)
        return dispatch.moe_combine(rows, combine_w, shared_TD, out_dtype)
