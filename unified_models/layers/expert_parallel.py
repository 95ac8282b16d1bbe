"""Where expert parallelism plugs in: a shard plan and an expert dispatcher in the layer context.

The MoE forward (:mod:`.moe`) is route -> experts -> combine. The middle step is
one call, ``ctx.dispatcher.experts(ctx.shard_plan, ...)``: at EP = 1 the
:class:`LocalExperts` dispatcher runs every expert on this process
(``ops.moe_experts``). The expert-parallel dispatcher
(:class:`~.expert_all_to_all.AllToAllExperts`: tokens sent to their experts'
owners by an all-to-all that moves data only, expert outputs returned to the
token's owner and combined there in fp32 in top-k slot order) is another
:class:`ExpertDispatcher` handed to the engines; the layers do not change. The contract that keeps such a dispatcher bitwise equal to EP = 1:

* the expert outputs of an assignment ``(t, k)`` are ``ops.moe_expert_outputs`` of
  that row alone (batch-invariant: whatever other rows an owner computes with it);
* the combine is ``ops.moe_combine`` at the token's owner over the rows in their
  original ``[T*K]`` order (slot order), so no sum crosses processes.

``tests/test_expert_parallel_seam.py`` runs a simulated two-owner dispatcher
through the whole model and checks it against :class:`LocalExperts` bit for bit.

Shapes: T tokens, D hidden, E routed experts, K top-k, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import ops
from ..dsl import ParallelismError


@dataclass(frozen=True)
class ShardPlan:
    """How the routed experts are sharded over the expert-parallel group.

    Megatron's layout (``megatron.core.transformer.moe``: each EP rank holds a
    contiguous block of ``E / ep_size`` experts): rank ``r`` owns experts
    ``[r E / ep_size, (r + 1) E / ep_size)``.

    Attributes:
        ep_size: processes in the expert-parallel group (1: every expert local).
        ep_rank: this process's rank in it.

    Raises:
        ParallelismError: ``ep_size`` < 1 or ``ep_rank`` outside ``[0, ep_size)``.
    """

    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ParallelismError(f"ShardPlan: ep_rank={self.ep_rank} of ep_size={self.ep_size}")

    def experts_per_rank(self, num_experts: int) -> int:
        """``E / ep_size``.

        Raises:
            ParallelismError: ``ep_size`` does not divide ``num_experts``.
        """
        if num_experts % self.ep_size:
            raise ParallelismError(f"{num_experts} routed experts do not split over ep_size={self.ep_size}")
        return num_experts // self.ep_size

    def owner(self, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The EP rank holding each expert id (same shape, int64)."""
        return expert_ids.long() // self.experts_per_rank(num_experts)

    def local_experts(self, num_experts: int, rank: int | None = None) -> range:
        """The expert ids ``rank`` (default: this rank) holds."""
        n = self.experts_per_rank(num_experts)
        r = self.ep_rank if rank is None else rank
        return range(r * n, (r + 1) * n)


class ExpertDispatcher(Protocol):
    """Runs the routed experts of one MoE sublayer and combines their outputs."""

    def experts(self, plan: ShardPlan, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, up: Any,
                down: Any, shared_TD: torch.Tensor | None, *, nvfp4: bool, out_dtype: torch.dtype) -> torch.Tensor:
        """``[T, D]`` in ``out_dtype``: ``round(sum_k w_k expert_{ids_k}(x) + shared)`` in fp32 slot order.

        ``up``/``down`` are this process's expert stacks (``[E_local, N, K]`` tensors or
        ``ops.NVFP4Weight``, as :func:`.weight_formats.grouped_weight` gives them);
        ``nvfp4`` quantizes tensor masters by ModelOpt's rule inside the op."""
        ...

    def swiglu_experts(self, plan: ShardPlan, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                       gate: Any, up: Any, down: Any, shared_TD: torch.Tensor | None, *, swiglu_limit: float,
                       out_dtype: torch.dtype, weight_before_down: bool = True) -> torch.Tensor:
        """DeepSeek-V4's clamped-SwiGLU experts (:mod:`.deepseek_moe`): the same contract with three
        stacks (``w1``/``w3`` ``[E_local, I, D]``, ``w2`` ``[E_local, D, I]``). The routing weight is
        applied before the down projection, so it travels with the token: an EP dispatcher sends
        ``(x_t, w_tk)`` to the owner, which computes ``ops.moe.swiglu_expert_outputs`` of that row,
        and combines at the token's owner with ``ops.moe.moe_combine`` over unit weights.
        ``weight_before_down=False`` (Qwen3-MoE, :mod:`.qwen3_moe`; ``swiglu_limit=inf``): the owner
        computes the rows with weight 1 and the token's owner combines with the routing weights,
        as :meth:`experts`."""
        ...


class LocalExperts:
    """EP = 1: every expert on this process, ``ops.moe_experts`` (differentiable)."""

    def experts(self, plan: ShardPlan, x_TD, ids_TK, w_TK, up, down, shared_TD, *, nvfp4: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`ExpertDispatcher.experts`.

        Raises:
            ParallelismError: ``plan.ep_size`` > 1 (this dispatcher holds every expert).
        """
        if plan.ep_size != 1:
            raise ParallelismError(f"LocalExperts runs every expert on one process; ep_size={plan.ep_size} "
                                   "needs an expert-parallel dispatcher")
        return ops.moe_experts(x_TD, ids_TK, w_TK, up, down, shared_TD, nvfp4=nvfp4, out_dtype=out_dtype)

    def swiglu_experts(self, plan: ShardPlan, x_TD, ids_TK, w_TK, gate, up, down, shared_TD, *,
                       swiglu_limit: float, out_dtype: torch.dtype, weight_before_down: bool = True) -> torch.Tensor:
        """See :meth:`ExpertDispatcher.swiglu_experts` (``ops.swiglu_experts``, differentiable).

        Raises:
            ParallelismError: ``plan.ep_size`` > 1.
        """
        if plan.ep_size != 1:
            raise ParallelismError(f"LocalExperts runs every expert on one process; ep_size={plan.ep_size} "
                                   "needs an expert-parallel dispatcher")
        return ops.swiglu_experts(x_TD, ids_TK, w_TK, gate, up, down, shared_TD, swiglu_limit=swiglu_limit,
                                  out_dtype=out_dtype, weight_before_down=weight_before_down)


LOCAL_EXPERTS = LocalExperts()
"""The default dispatcher of :class:`~.common.LayerContext`."""
