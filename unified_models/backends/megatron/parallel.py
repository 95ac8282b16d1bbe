"""The Megatron backend's parallel plan: which layouts are allowed, and setting them up.

Allowed in this version: tensor, pipeline and context parallel size 1; any
expert-parallel size that divides the world and every MoE layer's routed-expert
count; any data-parallel size. Refusals (each a :class:`ParallelismError` naming
the setting) happen before anything is initialized:

* TP > 1 is refused by design (DESIGN.md rule 7: a TP all-reduce sums partial
  products in an order vLLM's kernels do not share).
* PP > 1 and CP > 1 are not implemented yet (CP would exchange K/V, never sum).
* EP > 1 (:mod:`unified_models.layers.expert_all_to_all` over Megatron's EP group):
  refused when it does not divide the world size (:func:`init_parallel_state`), or
  a MoE layer's routed-expert count, or the model has no routed experts
  (:func:`check_expert_layout`).
* More ranks than sequences (:func:`shard_sequences`): a rank without a sequence
  would have nothing to recompute.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ...dsl import ParallelismError
from ...layers.expert_shards import check_expert_layout, expert_groups  # noqa: F401 - re-exported

_CREATED_PROCESS_GROUP = False


def check_parallel_sizes(*, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                         context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                         where: str = "parallel layout") -> None:
    """Refuse layouts this backend cannot compute bit-exactly.

    Raises:
        ParallelismError: naming the first refused setting and its value.
    """
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ParallelismError(f"{where}: {name}={value!r} must be a positive integer")
    if tensor_model_parallel_size > 1:
        raise ParallelismError(
            f"{where}: tensor_model_parallel_size={tensor_model_parallel_size} is refused: tensor parallelism "
            "sums partial products across GPUs in an order the rollout engine does not share, so trainer and "
            "rollout logprobs could not be bitwise equal (docs/consistency.md, row 12). Use TP=1 and scale with data "
            "parallelism.")
    if pipeline_model_parallel_size > 1:
        raise ParallelismError(
            f"{where}: pipeline_model_parallel_size={pipeline_model_parallel_size} is not supported yet "
            "(UnifiedMegatronModel is a single pipeline stage); use PP=1.")
    if context_parallel_size > 1:
        raise ParallelismError(
            f"{where}: context_parallel_size={context_parallel_size} is not supported yet (the trainer "
            "forward does not exchange K/V over a CP group); use CP=1.")


def shard_sequences(num_sequences: int, rank: int, world_size: int) -> range:
    """The sequences rank ``rank`` of ``world_size`` recomputes and trains on: a contiguous block,
    ``[rank B / W, (rank + 1) B / W)`` (floor), the same rule at every layout. Because every op is
    batch-invariant, a sequence's logprobs do not depend on which rank holds it.

    Raises:
        ParallelismError: more ranks than sequences (a rank would hold none).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ParallelismError(f"shard_sequences: rank {rank} of world size {world_size}")
    if num_sequences < world_size:
        raise ParallelismError(f"{world_size} ranks for {num_sequences} sequences: every rank needs at least one "
                               f"sequence; use at most {num_sequences} ranks or more sequences")
    return range(rank * num_sequences // world_size, (rank + 1) * num_sequences // world_size)


def ensure_process_group(backend: str | None = None, *, timeout_minutes: int = 30,
                         store_prefix: str | None = None) -> None:
    """Initialize ``torch.distributed`` if it is not initialized yet.

    Under a launcher (``torchrun``: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` set) the ``env://`` rendezvous is used. Otherwise a
    single-process world of size 1 is created on an in-process ``HashStore``
    (no port to pick, so parallel test runs cannot collide).

    Args:
        backend: ``"gloo"`` / ``"nccl"``; default nccl when CUDA is available, else gloo.
        store_prefix: under a launcher, the world's keys go under this prefix of the launcher's
            store. Needed when this process already joined (and left) an ``env://`` world, e.g. a
            vLLM engine at ``data_parallel_size`` > 1 (external launcher): torch names the new default
            group as it named the old one, and gloo would read the old world's stale addresses.
            Every rank must pass the same prefix.
    """
    global _CREATED_PROCESS_GROUP
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        if store_prefix is None:
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        else:
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(backend=backend, store=dist.PrefixStore(store_prefix, store), rank=rank,
                                    world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _CREATED_PROCESS_GROUP = True


def init_parallel_state(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, backend: str | None = None,
                        timeout_minutes: int = 30) -> None:
    """Initialize ``torch.distributed`` (if needed) and Megatron's ``parallel_state``.

    Idempotent for the same sizes. The sizes are checked before anything is
    touched, so a refused layout leaves the process as it was.

    Args:
        tp, pp, cp, ep: tensor / pipeline / context / expert parallel sizes.
        backend: process-group backend (default: nccl with CUDA, else gloo).

    Raises:
        ParallelismError: a refused size (see :func:`check_parallel_sizes`), a world
            size (``torch.distributed``'s, else ``WORLD_SIZE``) that EP or TP*PP*CP does
            not divide, or Megatron's parallel state is already initialized with other sizes.
    """
    check_parallel_sizes(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         context_parallel_size=cp, expert_model_parallel_size=ep, where="init_parallel_state")
    from . import compat

    want = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp, "expert_model_parallel_size": ep}
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp * cp) or world % (ep * tp * pp):
        raise ParallelismError(
            f"init_parallel_state: world size {world} is not divisible by TP*PP*CP={tp * pp * cp} and "
            f"EP*TP*PP={ep * tp * pp} (expert_model_parallel_size={ep}); start as many processes as a "
            "multiple of EP (torchrun --nproc-per-node)")
    if compat.model_parallel_is_initialized() and not dist.is_initialized():
        # Stale: the process group under Megatron's groups was torn down (e.g. by
        # vLLM's cleanup_dist_env_and_memory after a rollout in this process).
        compat.destroy_model_parallel()
    if compat.model_parallel_is_initialized():
        have = compat.parallel_sizes()
        if have != want:
            raise ParallelismError(
                f"init_parallel_state: Megatron parallel state is already initialized with {have}, "
                f"not {want}; call destroy_parallel_state() first")
        return
    ensure_process_group(backend, timeout_minutes=timeout_minutes)
    compat.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_minutes)


def check_current_parallel_state(where: str) -> None:
    """Refuse if Megatron's parallel state (when initialized) holds a refused layout."""
    from . import compat

    if compat.model_parallel_is_initialized():
        check_parallel_sizes(**compat.parallel_sizes(), where=f"{where} (Megatron parallel_state)")


def destroy_parallel_state(*, destroy_process_group: bool = False) -> None:
    """Tear down Megatron's parallel state; optionally the process group this module created."""
    global _CREATED_PROCESS_GROUP
    from . import compat

    if compat.model_parallel_is_initialized():
        compat.destroy_model_parallel()
    if destroy_process_group and _CREATED_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
        _CREATED_PROCESS_GROUP = False
