"""``unified-models rl`` under ``torchrun``: the layout of a multi-process run and the data it exchanges.

One process per rank; every rank holds one vLLM engine and one share of the trainer, both in the
world ``torchrun`` starts (DESIGN.md rules 6-7: what crosses processes is data, never a sum in the
compared path):

* **rollout**: vLLM data parallel over all ``W`` processes (``data_parallel_size = W``, vLLM's
  ``external_launcher`` mode: one engine per process, vLLM's DP / EP groups on torchrun's world),
  expert parallel over them when ``--rollout-ep`` = ``W`` (each engine holds its block of experts),
  else every engine holds every expert (``--rollout-ep 1``).
* **trainer**: Megatron data parallel over the ``W`` processes (TP = PP = CP = 1, so DP = W) and
  expert parallel ``--ep`` (Megatron's EP groups, ``layers/expert_all_to_all.py``).
* **assignment** (:meth:`RLLayout.groups`): the step's P GRPO groups (G samples of one prompt)
  are split in contiguous blocks over the ranks (``shard_sequences``). A rank samples its groups,
  scores them, recomputes and trains on them: groups never straddle ranks, so advantages are local.
  Request seeds, token weights and every row are functions of the sequence's *global* index, so
  the tokens and logprobs a rank produces do not depend on the layout (the step-1 rollout digest of
  a 2-process run equals the 1-process run's).
* **gradients**: the local loss is ``DP x`` the global per-token weights over the rank's tokens;
  Megatron's DDP (GPU) / the CPU optimizer averages over DP (pre-scale 1/DP, then sum), which gives
  the single-process loss's gradient (in another summation order: rule 11, backward is not bitwise).
* **weight sync**: the trainer at EP > 1 holds its experts only. When the rollout's expert layout
  differs from the trainer's (``--rollout-ep`` != ``--ep``), the expert stacks are all-gathered over
  the trainer's EP group (data only) and each engine keeps the experts it holds
  (:func:`rollout_weights`); with the same layout each rank's experts go to its own engine.
* **metrics**: each rank's per-token results are all-gathered (:func:`all_gather`), so every rank
  computes the same merged metrics row, the same global first mismatch (named with its rank) and the
  same decision to stop; rank 0 writes the metrics file, the plot and the console output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from ..dsl import ParallelismError
from ..launch_layout import check_layout_flags, torchrun_place

__all__ = ["RLLayout", "launch_layout", "check_layout_for_spec", "all_gather", "rollout_weights"]


@dataclass(frozen=True)
class RLLayout:
    """Where a ``rl`` run's work lives.

    Attributes:
        world: processes (``torchrun``'s ``WORLD_SIZE``; 1 without torchrun).
        rank: this process's rank.
        trainer_ep: Megatron expert-parallel size (``--ep``).
        trainer_dp: Megatron data-parallel size (``--dp``; = ``world`` at TP = PP = CP = 1).
        rollout_dp: vLLM ``data_parallel_size`` (``--rollout-dp``; = ``world``: one engine per process).
        rollout_ep: experts sharded over the rollout's DP ranks (``--rollout-ep``: 1 or ``rollout_dp``).
    """

    world: int = 1
    rank: int = 0
    trainer_ep: int = 1
    trainer_dp: int = 1
    rollout_dp: int = 1
    rollout_ep: int = 1

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def groups(self, num_groups: int) -> range:
        """The GRPO groups (of the step's ``num_groups``) this rank samples and trains on: a contiguous
        block (:func:`~..backends.megatron.parallel.shard_sequences`)."""
        from ..backends.megatron.parallel import shard_sequences

        return shard_sequences(num_groups, self.rank, self.world)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rank"}


def launch_layout(*, ep: int, dp: int | None, rollout_dp: int | None, rollout_ep: int, num_prompts_per_step: int,
                  use_rollout_logprobs: bool, kl_coef: float, tp: int = 1) -> RLLayout:
    """The run's layout from ``torchrun``'s environment and the flags; every refusal that needs no model.

    Args:
        ep, dp, rollout_dp, rollout_ep: ``--ep``, ``--dp``, ``--rollout-dp``, ``--rollout-ep``
            (``None``: the number of processes).
        num_prompts_per_step: P (each rank needs at least one GRPO group).
        use_rollout_logprobs, kl_coef: options refused under more than one process.
        tp: ``--tp``, tensor parallel size of both sides: 1 only (DESIGN.md rule 7).

    Raises:
        ParallelismError: naming the flag: ``--tp`` > 1 (its all-reduce sums partial products across
            GPUs; ``docs/scale-out.md`` says what a bitwise TP would need); the layout refusals of
            :func:`~..launch_layout.check_layout_flags` (``--rollout-dp`` must be the number of
            processes); ``--use-rollout-logprobs`` under more than one process or ``--kl-coef`` > 0
            with ``--ep`` > 1.
    """
    from ..backends.megatron.parallel import check_parallel_sizes

    check_parallel_sizes(tensor_model_parallel_size=tp, where=f"rl --tp {tp}")
    rank, world = torchrun_place()
    dp = world if dp is None else dp
    rollout_dp = world if rollout_dp is None else rollout_dp
    check_layout_flags("rl", world, ep=ep, dp=dp, rollout_dp=rollout_dp, rollout_ep=rollout_ep,
                       rollout_dp_choices=(world,), leave_rollout_dp_out=" or leave it out",
                       units=num_prompts_per_step, units_name="prompts per step", unit="GRPO group",
                       units_flag="--num-prompts-per-step")
    if world > 1 and use_rollout_logprobs:
        raise ParallelismError("rl --use-rollout-logprobs is not supported under torchrun yet: the only comparison "
                               "left would be inside the update, where one rank stopping would leave the others "
                               "waiting in the backward's collectives; drop the flag")
    if ep > 1 and kl_coef > 0:
        raise ParallelismError("rl --kl-coef > 0 with --ep > 1 is not supported yet (the frozen reference model "
                               "has no expert-parallel padding passes); use --ep 1 or --kl-coef 0")
    return RLLayout(world=world, rank=rank, trainer_ep=ep, trainer_dp=dp, rollout_dp=rollout_dp,
                    rollout_ep=rollout_ep)


def check_layout_for_spec(layout: RLLayout, spec) -> None:
    """Refuse expert-parallel sizes ``spec`` cannot shard (before any engine starts).

    Raises:
        ParallelismError: ``--ep`` / ``--rollout-ep`` > 1 on a model without routed experts, or not
            dividing a MoE layer's routed-expert count (the layer is named).
    """
    from ..backends.megatron.parallel import check_expert_layout

    check_expert_layout(spec, layout.trainer_ep, where="rl --ep")
    check_expert_layout(spec, layout.rollout_ep, where="rl --rollout-ep")


def all_gather(obj: Any, layout: RLLayout) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``all_gather_object`` over the world;
    ``[obj]`` in a single process). Tensors travel pickled on the CPU."""
    if not layout.distributed:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * layout.world
    dist.all_gather_object(out, obj)
    return out


def rollout_weights(trainer, layout: RLLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` to sync into this rank's engine: the trainer's own tensors, plus, when the
    rollout's expert layout differs from the trainer's, the experts other EP ranks hold.

    Those are all-gathered over Megatron's expert-parallel group, one collective per MoE layer,
    projection and tensor field: each rank contributes its ``[E/EP, ...]`` stack in expert order
    (data only; every rank makes the same calls in the same order).

    Raises:
        RuntimeError: a trainer expert stack is missing on this rank (the module does not hold the
            contiguous block Megatron's layout gives it).
    """
    own = dict(trainer.named_weights())
    if layout.trainer_ep == 1 or layout.rollout_ep == layout.trainer_ep:
        yield from own.items()
        return
    import torch.distributed as dist

    from ..backends.megatron import compat
    from ..backends.megatron.parallel import expert_groups
    from ..layers.expert_parallel import ShardPlan
    from ..layers.weight_formats import linear_fields

    state = compat.expert_parallel_state()
    plan = ShardPlan(ep_size=state["ep_size"], ep_rank=state["ep_rank"])
    for _, linears in expert_groups(trainer.spec):
        for field in linear_fields(trainer.spec.weight_format(linears[0])):
            names = [f"{n}.{field}" for n in linears]
            mine = [names[e] for e in plan.local_experts(len(names))]
            missing = [n for n in mine if n not in own]
            if missing:
                raise RuntimeError(f"rollout_weights: the trainer on EP rank {plan.ep_rank} does not hold {missing[0]}")
            local = torch.stack([own[n].detach() for n in mine])
            parts = [torch.empty_like(local) for _ in range(plan.ep_size)]
            dist.all_gather(parts, local, group=state["ep_group"])
            for r, part in enumerate(parts):
                for e, t in zip(plan.local_experts(len(names), r), part):
                    if names[e] not in own:
                        yield names[e], t
    yield from own.items()
