"""Every megatron-core version difference the Megatron backend depends on.

Supported: megatron-core 0.16.x (CPU CI, Python 3.11) and 0.19.2 (H200 target,
Python 3.12). Nothing else in ``backends/megatron`` or the Megatron converter
branches on the version; they call the helpers here.

Known differences used (``shared/reference/megatron-modelopt.md``):

* ``parallel_state.initialize_model_parallel`` gained keywords in 0.19
  (``gtp_remat_size``, ``expert_gtp_remat_size``, ``rank_offset``,
  ``local_world_size``); we pass only keywords the installed version accepts.
* ``dist_checkpointing.save``: 0.16 takes ``common_strategy`` and writes the
  common state to ``common.pt``; 0.19 drops ``common_strategy``, adds
  ``async_strategy``/``verify_integrity`` and stores the common state inside
  the DCP files (``common_state`` ShardedObject). 0.16 cannot read a
  0.19-native checkpoint, so CPU-side writers produce the 0.16 layout (read
  by both).
* ``dist_checkpointing.load`` adds ``verify_integrity``/``process_group`` in 0.19.
* ``PackedSeqParams`` adds ``total_tokens``/``seq_idx``/``tokens_per_sample``/
  ``pad_between_seqs`` in 0.19 (we only read ``qkv_format``, ``cu_seqlens_q``
  and ``cu_seqlens_q_padded``, present in both).
* ``TransformerConfig`` fields come and go between versions: unknown fields
  are dropped with :func:`filter_dataclass_kwargs` instead of failing.
* ``make_sharded_tensor_for_checkpoint`` (0.19 adds a GTP guard and FSDP2
  marker; same signature).
* Both versions' ``dist_checkpointing.save`` create a ``spawn``-context
  multiprocessing manager (callers' main modules need a ``__main__`` guard);
  0.19 logs "MCore's async save is deprecated" even for a synchronous save.

Checked: 0.16.1 on CPU (tests); 0.19.2's pure-Python sources on CPU under
Python 3.11 (``UM_MCORE019_SITE`` test) and 0.19.2 on the H200 (CUDA save,
load, module forward).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import torch

import megatron.core
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing import ShardedTensor


def _parse_version(text: str) -> tuple[int, int, int]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


MCORE_VERSION: tuple[int, int, int] = _parse_version(megatron.core.__version__)
"""Installed megatron-core version as ``(major, minor, patch)``."""

MCORE_0_19_PLUS = MCORE_VERSION >= (0, 19, 0)
"""True on the GPU target's megatron-core (common state inside the DCP files)."""

SUPPORTED_RANGE = ((0, 16, 0), (0, 20, 0))
"""Versions this backend was written against: 0.16 <= version < 0.20."""


def version_string() -> str:
    return megatron.core.__version__


def accepted_kwargs(fn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` restricted to the parameters ``fn`` accepts (by signature)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def filter_dataclass_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` restricted to the fields of dataclass ``cls`` (e.g. ``TransformerConfig``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}


# --------------------------------------------------------------------------- parallel state


def initialize_model_parallel(*, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                              context_parallel_size: int, expert_model_parallel_size: int,
                              **extra: Any) -> None:
    """``parallel_state.initialize_model_parallel`` with the keywords this version accepts."""
    kwargs = dict(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        **extra,
    )
    parallel_state.initialize_model_parallel(**accepted_kwargs(parallel_state.initialize_model_parallel, kwargs))


def model_parallel_is_initialized() -> bool:
    return bool(parallel_state.model_parallel_is_initialized())


def parallel_sizes() -> dict[str, int]:
    """Current sizes from Megatron's parallel state (call only once it is initialized)."""
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
    }


def destroy_model_parallel() -> None:
    parallel_state.destroy_model_parallel()


def expert_parallel_state() -> dict[str, Any]:
    """This rank's expert-parallel place from Megatron's parallel state: ``ep_size``, ``ep_rank``,
    ``ep_group`` (``get_expert_model_parallel_group``), ``expert_dp_group``
    (``get_expert_data_parallel_group``), ``expert_tp_group`` (``get_expert_tensor_parallel_group``)
    and ``expert_mp_group`` (``get_expert_tensor_model_pipeline_parallel_group``: where the experts'
    grad-norm squares are summed)."""
    return {
        "ep_size": parallel_state.get_expert_model_parallel_world_size(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "ep_group": parallel_state.get_expert_model_parallel_group(),
        "expert_dp_group": parallel_state.get_expert_data_parallel_group(),
        "expert_tp_group": parallel_state.get_expert_tensor_parallel_group(),
        "expert_mp_group": parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
    }


def tensor_parallel_group():
    return parallel_state.get_tensor_model_parallel_group()


def data_context_parallel_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


# --------------------------------------------------------------------------- sharded tensors


def replicated_sharded_tensor(tensor: torch.Tensor, key: str, *, prepend_offsets=(), tp_group=None,
                              dp_cp_group=None) -> ShardedTensor:
    """A ShardedTensor of a parameter replicated over TP and DP (TP=1 layout).

    Uses Megatron's ``make_sharded_tensor_for_checkpoint`` (replica id
    ``(0, tp_rank, dp_rank)``, so only DP rank 0 writes). Pass both groups or
    neither (then Megatron's parallel state supplies them).
    """
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    kwargs = {}
    if tp_group is not None or dp_cp_group is not None:
        kwargs = {"tp_group": tp_group, "dp_cp_group": dp_cp_group}
    return make_sharded_tensor_for_checkpoint(tensor, key, prepend_offsets=prepend_offsets, **kwargs)


def plain_sharded_tensor(tensor: torch.Tensor, key: str, replica_id: int = 0) -> ShardedTensor:
    """A whole (unsharded) tensor as a ShardedTensor with an explicit replica id.

    Needs no parallel state; used by the standalone converter.
    """
    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)


# --------------------------------------------------------------------------- dist_checkpointing


def dist_load(sharded_state_dict: dict, checkpoint_dir: str | Path) -> dict:
    """``dist_checkpointing.load`` (tensors are loaded into the ShardedTensors' ``data``)."""
    return dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir))


def dist_save(sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
    """Megatron's own synchronous ``torch_dist`` save. Needs CUDA tensors in 0.16 and 0.19.

    0.19 writes the common state inside the DCP files (``common_state``);
    0.16 writes ``common.pt``. ``async_strategy`` is left to 0.19's default
    (it only matters for async saves, which we do not request).
    """
    dist_checkpointing.save(sharded_state_dict, str(checkpoint_dir), async_sharded_save=False)


def load_common_state_dict(checkpoint_dir: str | Path) -> dict:
    """The non-tensor ("common") state of a checkpoint: ``common.pt`` or 0.19's ``common_state``."""
    return dist_checkpointing.load_common_state_dict(str(checkpoint_dir))


def load_tensors_metadata(checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
    """``{ShardedTensor.key: ShardedTensor without data}``: global shapes and dtypes stored."""
    return dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))


def reader_exception_types() -> tuple[type[BaseException], ...]:
    """Exceptions a failed checkpoint read can raise.

    PyTorch DCP's ``CheckpointException`` derives from ``BaseException``, not
    ``Exception``, so a plain ``except Exception`` misses a corrupt data file.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


# --------------------------------------------------------------------------- packed sequences


def packed_seq_cu_seqlens(packed_seq_params: Any) -> torch.Tensor:
    """Sequence boundaries ``[B+1]`` of a THD ``PackedSeqParams``.

    The ``_padded`` boundaries win when present: each sequence then owns its
    padding tokens, which sit after its real tokens and so cannot change them
    under causal attention.

    Raises:
        ValueError: not THD, or no ``cu_seqlens_q``.
    """
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"PackedSeqParams.qkv_format={fmt!r}; only 'thd' (packed sequences) is supported")
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    cu = padded if padded is not None else getattr(packed_seq_params, "cu_seqlens_q", None)
    if cu is None:
        raise ValueError("PackedSeqParams has neither cu_seqlens_q_padded nor cu_seqlens_q")
    kv = getattr(packed_seq_params, "cu_seqlens_kv_padded" if padded is not None else "cu_seqlens_kv", None)
    if kv is not None and not torch.equal(kv.to(cu.device).long(), cu.long()):
        raise ValueError("PackedSeqParams: cu_seqlens_kv differs from cu_seqlens_q (self-attention needs equal boundaries)")
    return cu


# --------------------------------------------------------------------------- optimizer (training)
#
# Same in 0.16 and 0.19 (checked against both sources): ``OptimizerConfig``
# fields used here, ``get_standard_config_overrides``, ``_get_param_groups``
# (private; its 0.16 version applies the standard overrides itself when given
# None, 0.19's does not, so they are always passed explicitly),
# ``get_megatron_optimizer(config, model_chunks, config_overrides=...)``,
# ``DistributedDataParallel(config=, ddp_config=, module=)`` and
# ``finish_grad_sync()`` / ``zero_grad_buffer()``.


def megatron_optimizer_config(**kwargs: Any):
    """Megatron's ``OptimizerConfig`` with the fields this version has (others dropped)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**filter_dataclass_kwargs(OptimizerConfig, kwargs))


def optimizer_param_groups(model_chunks: list, optimizer_config) -> list[dict]:
    """Megatron's own parameter groups (standard overrides: no weight decay on
    biases and 1-D parameters). Runs on CPU; needs ``torch.distributed``."""
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    return _get_param_groups(model_chunks, optimizer_config, get_standard_config_overrides(optimizer_config))


def megatron_optimizer(optimizer_config, model_chunks: list):
    """``get_megatron_optimizer`` with the standard overrides passed explicitly. CUDA only."""
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides

    return get_megatron_optimizer(optimizer_config, model_chunks,
                                  config_overrides=get_standard_config_overrides(optimizer_config))


def ddp_wrap(module, transformer_config, **ddp_kwargs: Any):
    """Megatron's ``DistributedDataParallel`` around ``module``. CUDA only (grad buffers on the GPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(**filter_dataclass_kwargs(DistributedDataParallelConfig, ddp_kwargs))
    return DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=module)


# --------------------------------------------------------------------------- dist_checkpointing save without CUDA


def cpu_dist_save(sharded_state_dict: dict, checkpoint_dir: str | Path, *, thread_count: int = 1) -> None:
    """Save a sharded state dict in the ``torch_dist`` layout without CUDA (recipe A of
    ``reference/megatron-modelopt.md`` §3: Megatron's own translation, PyTorch DCP's writer).

    Megatron's ``dist_checkpointing.save`` cannot run on CPU (its writer calls
    ``torch.cuda.synchronize``); this is the same pipeline with the CPU-capable
    ``FileSystemWriter``: ``save_preprocess`` (factories, non-persistent objects,
    access-integrity validation) -> rank 0 writes ``common.pt`` -> ShardedTensor /
    ShardedObject keys (main replicas only) -> PyTorch sharded tensors ->
    ``torch.distributed.checkpoint.save`` with ``MCoreSavePlanner`` -> rank 0
    writes ``metadata.json``. Collective over the default process group. The
    result is the 0.16 layout, which 0.16 and 0.19 both load.

    Uses private helpers of ``dist_checkpointing.strategies.torch``
    (``_replace_state_dict_keys_with_sharded_keys``, identical in 0.16 and 0.19).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    ckpt = Path(checkpoint_dir)
    sharded_part, common = save_preprocess(sharded_state_dict, True)
    rank = dist.get_rank()
    if rank == 0:
        torch.save(common, ckpt / "common.pt")
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=True)
    pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
    dcp.save(pyt_state_dict, storage_writer=FileSystemWriter(str(ckpt), thread_count=thread_count),
             planner=MCoreSavePlanner(flatten_state_dict=False))
    dist.barrier()
    if rank == 0:
        save_config(CheckpointingConfig("torch_dist", 1), str(ckpt))
    dist.barrier()


def rng_tracker():
    """Megatron's model-parallel CUDA RNG tracker if one was created (``model_parallel_cuda_manual_seed``),
    else None. Module global ``tensor_parallel.random._CUDA_RNG_STATE_TRACKER`` in 0.16 and 0.19."""
    from megatron.core.tensor_parallel import random as mrandom

    return getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
