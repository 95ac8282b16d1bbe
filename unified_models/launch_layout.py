"""The process layout of a command under ``torchrun`` (``check``, ``rl``): the scale-out flags'
refusals both commands share, before any engine starts (``docs/scale-out.md``)."""

from __future__ import annotations

import os

from .dsl import ParallelismError

__all__ = ["torchrun_place", "check_layout_flags"]


def torchrun_place() -> tuple[int, int]:
    """``(rank, world size)`` from ``torchrun``'s environment (``RANK``, ``WORLD_SIZE``; ``(0, 1)`` outside it)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check_layout_flags(command: str, world: int, *, ep: int, dp: int | None, rollout_dp: int, rollout_ep: int,
                       rollout_dp_choices: tuple[int, ...], leave_rollout_dp_out: str, units: int, units_name: str,
                       unit: str, units_flag: str) -> None:
    """Refuse a layout ``command`` cannot run on ``world`` processes (TP = PP = CP = 1).

    Args:
        command: ``"check"`` / ``"rl"`` (the messages' prefix).
        world: processes.
        ep, dp, rollout_dp, rollout_ep: ``--ep``, ``--dp`` (None: ``world``), ``--rollout-dp``, ``--rollout-ep``.
        rollout_dp_choices: the ``--rollout-dp`` values the command runs (``world``: one engine per process).
        leave_rollout_dp_out: what the message says leaving ``--rollout-dp`` out does.
        units, units_name, unit, units_flag: the work split over the ranks (``4``, ``"prompts per step"``,
            ``"GRPO group"``, ``"--num-prompts-per-step"``): every rank needs at least one ``unit``.

    Raises:
        ParallelismError: naming the flag: a size < 1; ``--dp`` other than ``world``; ``--rollout-dp``
            outside ``rollout_dp_choices``; an ``--ep`` that does not divide ``world``; ``--rollout-ep``
            other than 1 or ``--rollout-dp``; more processes than ``units``.
    """
    hint = "run under torchrun --nproc-per-node N" if world == 1 else f"this job has {world} processes"
    for flag, v in (("--ep", ep), ("--dp", dp), ("--rollout-dp", rollout_dp), ("--rollout-ep", rollout_ep)):
        if v is not None and v < 1:
            raise ParallelismError(f"{command} {flag} {v} must be >= 1")
    if dp is not None and dp != world:
        raise ParallelismError(f"{command} --dp {dp}: the trainer's data-parallel size is the number of processes at "
                               f"TP = PP = CP = 1 ({hint}); pass --dp {world} or leave it out")
    if rollout_dp not in rollout_dp_choices:
        raise ParallelismError(f"{command} --rollout-dp {rollout_dp}: one vLLM engine runs in every process (vLLM's "
                               f"external_launcher data parallel), so --rollout-dp is the number of processes "
                               f"({hint}); pass --rollout-dp {world}{leave_rollout_dp_out}")
    if world % ep:
        raise ParallelismError(f"{command} --ep {ep}: {world} process(es) do not split into expert-parallel groups of "
                               f"{ep}; run under torchrun --nproc-per-node {ep} (or a multiple)")
    if rollout_ep not in (1, rollout_dp):
        if world == 1:
            where = (f"with one process there is one engine: run under torchrun --nproc-per-node {rollout_ep} "
                     "(vLLM data parallel) for --rollout-ep > 1")
        else:
            where = f"use --rollout-ep 1 or --rollout-ep {rollout_dp}" + (
                "" if rollout_dp > 1 else " (with --rollout-dp N, N the number of processes)")
        raise ParallelismError(f"{command} --rollout-ep {rollout_ep}: vLLM shards experts over all of its "
                               f"data-parallel ranks or none; {where}")
    if world > units:
        raise ParallelismError(f"{command}: {world} processes for {units} {units_name}: every rank needs at least "
                               f"one {unit}; use more {units_flag} or fewer processes")
