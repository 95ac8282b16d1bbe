"""Trainer -> rollout engine weight sync, in place, without a disk round trip.

:func:`sync_weights` takes the trainer's tensors by Hugging Face name (e.g.
``UnifiedMegatronModel.named_parameters()``) and, for every tensor whose value
differs from the engine's, copies it into vLLM's existing parameter buffer
(``data_ptr`` unchanged, so CUDA graphs and cached views stay valid), lets the
model recompute derived tensors in place, and resets vLLM's prefix cache so no
KV computed with the old weights is reused. Each tensor is validated once per
sync: names and shapes, then one cast to its parameter's dtype and device, then
its NaN/Inf and "unchanged" flags, gathered on the device and read with one host
sync for the whole sync (:meth:`~.model.UnifiedForCausalLM.prepare_weights`);
the copies go through each parameter's ``weight_loader``
(:meth:`~.model.UnifiedForCausalLM.copy_weights`).

Quantized engines: when the engine holds a ModelOpt-format model (NVFP4
experts, FP8 Mamba projections), the trainer's tensors are its bf16 masters
(:func:`unified_models.converters.modelopt.master_spec` names); they are
quantized by the same shared rules the trainer's forward applies
(:func:`~unified_models.converters.modelopt.quantize_state_dict`) and the
resulting codes and scales are copied in place.

Derived tensors: a model class may define
``refresh_derived_tensors(changed: set[str]) -> Iterable[str]``, called after
the copies with the names that changed; it must recompute quantized weights,
scales, pre-transposed copies, ... *in place* and return the names of what it
recomputed. No model defines derived tensors today, so nothing is called.

Weight fingerprint: after the copies, every given tensor's checksum
(:func:`unified_models.consistency.fingerprint.tensor_checksum`, over the raw bits,
order-independent) is computed on the trainer's side (its own device, cast to the
engine dtype) and on the engine's parameter after the copy (the engine's device);
both tables come back in the :class:`SyncReport` and
:func:`~unified_models.consistency.fingerprint.verify_weight_sync` compares them.

Rollout expert parallelism (EP > 1): the engine holds only its rank's routed experts. The
trainer's tensors may be a full set (the experts other ranks hold are shape-checked and left
out) or only this rank's experts (a trainer at the same EP layout); ``strict`` asks for every
parameter held here, and both checksum tables cover only the tensors this rank holds.

Only the in-process engine is reachable (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
which :func:`.engine.make_llm` pins).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from ...dsl import CheckpointError
from . import engine, live

__all__ = ["SyncReport", "sync_weights"]

DERIVED_HOOK = "refresh_derived_tensors"


@dataclass(frozen=True)
class SyncReport:
    """What :func:`sync_weights` did.

    Attributes:
        copied: names whose values changed and were copied into the engine.
        unchanged: names given whose values already equal the engine's (not copied).
        derived: derived tensors the model recomputed in place.
        bytes_copied: bytes written into engine parameters.
        prefix_cache_reset: True when the prefix cache was reset (something changed).
        seconds: wall time of the sync (the checksums included).
        source_checksums: name -> checksum of every given tensor as sent (after quantization,
            cast to its engine parameter's dtype, on the tensor's own device); None when the
            sync ran with ``fingerprint=False``.
        engine_checksums: name -> checksum of the same engine parameters after the copy (on
            the engine's device); None likewise.
        checksum_seconds: wall time of both checksum tables.
    """

    copied: tuple[str, ...]
    unchanged: tuple[str, ...]
    derived: tuple[str, ...]
    bytes_copied: int
    prefix_cache_reset: bool
    seconds: float
    source_checksums: Mapping[str, int] | None = None
    engine_checksums: Mapping[str, int] | None = None
    checksum_seconds: float = 0.0


def _pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out, seen = [], set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"sync_weights expects (name, tensor) pairs, got {type(item).__name__}")
        name, t = item
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"sync_weights expects (str, Tensor) pairs, got ({type(name).__name__}, "
                             f"{type(t).__name__})")
        if name in seen:
            raise CheckpointError(f"weight sync rejected: tensor {name} is given twice")
        if not t.is_floating_point():
            raise CheckpointError(f"weight sync rejected: tensor {name} has dtype {t.dtype}; parameters are floating point")
        seen.add(name)
        out.append((name, t.detach()))
    return out


@torch.no_grad()
def sync_weights(llm, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                 strict: bool = True, skip_unchanged: bool = True, fingerprint: bool = True) -> SyncReport:
    """Copy the trainer's weights into a live vLLM engine in place.

    Args:
        llm: an in-process engine from :func:`.engine.make_llm`.
        named_tensors: ``{HF name: tensor}`` or ``(HF name, tensor)`` pairs (any
            device; e.g. ``model.named_parameters()``). Tensors are cast to the
            engine dtype by ``copy_`` (round to nearest even); pass the bf16
            model parameters, not fp32 main weights, to copy bits unchanged.
        strict: every floating-point engine parameter must be given (a full sync; integer
            tables such as ``tid2eid`` are never trained and never synced). At rollout EP > 1:
            every one this rank holds; the experts other ranks hold may be given or not.
        skip_unchanged: copy only tensors whose bits (after the cast) differ from the engine's.
        fingerprint: compute the per-tensor checksums of both sides (``SyncReport.source_checksums``,
            ``engine_checksums``), over every given tensor held here, copied or unchanged.

    Returns:
        :class:`SyncReport`. Afterwards every given tensor equals the engine's
        parameter (after the cast) and every engine ``data_ptr`` is unchanged.

    Raises:
        CheckpointError: unknown names, missing names (``strict``), shape
            mismatches (all named), a name given twice, a non-float tensor, or
            NaN/Inf; nothing is copied then.
        ValueError: not ``(str, Tensor)`` pairs.
        RuntimeError: the engine is not in process, a copy moved a parameter's
            storage, or the prefix cache could not be reset.
    """
    start = time.perf_counter()
    pairs = _pairs(named_tensors)
    model = live.get_model(llm)
    params = model.params()
    foreign = model.foreign_experts  # experts other expert-parallel ranks hold (EP > 1)
    stored: set[str] = set()
    if model.spec.stores_quantized_weights:
        from ...converters.modelopt import quantize_state_dict

        masters = {n: t for n, t in pairs if n not in foreign}  # master names of experts are stored names too
        pairs = list(quantize_state_dict(masters, model.spec).items())
        stored = {n for n, _ in pairs}
        # an NVFP4 W4A4 export's calibrated expert input_scale has no master (the W4A16
        # kernels never read it): the engine keeps its own
        pairs += [(n, p.detach()) for n, p in params.items() if n.endswith(".input_scale") and n not in stored]
    # integer tables (hash routing) are never trained: a full sync gives every floating-point parameter
    # and the stored codes the masters quantize to (NVFP4's uint8 e2m1 pairs are integer tensors)
    problems = model.weight_table_problems({n: tuple(p.shape) for n, p in params.items()
                                            if p.is_floating_point() or n in stored},
                                           {n: tuple(t.shape) for n, t in pairs}, require_all=strict)
    if problems:
        raise CheckpointError("weight sync rejected; " + "; ".join(problems))
    pairs = [(n, t) for n, t in pairs if n not in foreign]  # checked above; held by other EP ranks
    # the one validation: cast once, NaN/Inf and bitwise-unchanged flags read with one host sync
    changed, unchanged = model.prepare_weights(pairs, skip_unchanged=skip_unchanged, what="weight sync")
    derived: list[str] = []
    if changed:
        ptrs = {n: params[n].data_ptr() for n in changed}
        model.copy_weights(changed)
        engine.reset_prefix_cache(llm)
        moved = [n for n, ptr in ptrs.items() if params[n].data_ptr() != ptr]
        if moved:
            raise RuntimeError(f"weight sync replaced the storage of {moved[:5]}; in-place copies are required "
                               "(CUDA graphs hold the old buffers)")
        hook = getattr(model, DERIVED_HOOK, None)
        if callable(hook):
            derived = sorted(hook(set(changed)) or ())
    source_sums = engine_sums = None
    t_sum = time.perf_counter()
    if fingerprint:
        from ...consistency.fingerprint import tensor_checksums

        source_sums = tensor_checksums((n, t.to(dtype=params[n].dtype)) for n, t in pairs)
        params = model.params()
        engine_sums = tensor_checksums((n, params[n]) for n, _ in pairs)
    t_sum = time.perf_counter() - t_sum
    return SyncReport(copied=tuple(changed), unchanged=tuple(unchanged), derived=tuple(derived),
                      bytes_copied=sum(t.numel() * t.element_size() for t in changed.values()),
                      prefix_cache_reset=bool(changed), seconds=time.perf_counter() - start,
                      source_checksums=source_sums, engine_checksums=engine_sums, checksum_seconds=t_sum)
