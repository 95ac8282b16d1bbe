"""Training checkpoints: model, optimizer, RNG states and iteration, with Megatron distributed checkpointing.

Layout (as Megatron-LM's): ``<root>/iter_<7-digit iteration>/`` holds one
``torch_dist`` checkpoint, ``<root>/latest_checkpointed_iteration.txt`` names
the newest. The sharded state dict is

* ``"model"``: :meth:`UnifiedMegatronModel.sharded_state_dict` (ShardedTensor
  key = Hugging Face name, model dtype);
* ``"optimizer"``: :meth:`TrainOptimizer.sharded_state_dict` (Megatron's keys
  ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>``; hyperparameters
  and the shared Adam step in the common state);
* ``"rng_state"``: a ShardedObject (Megatron-LM's ``rng_state``) holding, per
  data-parallel rank, ``random_rng_state`` (Python), ``np_rng_state`` (NumPy),
  ``torch_rng_state`` (torch CPU), ``cuda_rng_state`` (when CUDA is
  initialized) and ``rng_tracker_states`` (Megatron's tracker, when created);
* common state: ``iteration`` and the ``unified_models`` entry (family; with
  ``hf_config`` also the ``config.json`` text, which makes the checkpoint
  readable by ``unified-models convert --from megatron`` and
  :meth:`UnifiedMegatronModel.load_dist_checkpoint`; ``extra`` user data). When
  the model trains the masters of a quantized checkpoint and ``hf_config`` is
  that checkpoint's (quantized) config, the entry holds the masters' config and
  the quantization recipe instead (:mod:`unified_models.converters.trained_masters`);
* with ``assets_from``, ``hf_assets/``: the tokenizer and generation files of the
  Hugging Face checkpoint trained from (as a converted checkpoint carries them), so
  that ``convert --from megatron`` gives a checkpoint with its own tokenizer; with
  ``tokenizer_from`` too, the tokenizer files (and ``generation_config.json``, when it
  has one) of that directory instead: the tokenizer the run used.

Writers: Megatron's ``dist_checkpointing.save`` when the parameters are on
CUDA; on CPU Megatron's own translation written through PyTorch DCP
(:func:`compat.cpu_dist_save`, the 0.16 layout that 0.16 and 0.19 read).
Reads go through ``dist_checkpointing.load``. Writes (tensors, common state and
``hf_assets/``) land in a temporary sibling directory renamed into place when
complete; the tracker file is then replaced atomically.

Resume contract: after :func:`load_training_checkpoint`, parameters, fp32 main
weights, Adam moments and step, and the RNG streams equal those at save time
bit for bit, so continuing gives the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from ...converters import megatron_dist_ckpt as layout
from ...converters import trained_masters
from ...converters.hf_safetensors import tensor_table_problems
from ...dsl import CheckpointError
from ...serving.vocabulary import pad_tokenizer_dir
from . import compat
from .optimizer import TrainOptimizer, _bump_weight_versions

__all__ = ["TrainingCheckpoint", "save_training_checkpoint", "load_training_checkpoint", "latest_iteration",
           "iteration_dir", "get_rng_state", "set_rng_state", "TRACKER_FILE"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
OPTIMIZER_PREFIX = "optimizer."


@dataclass(frozen=True)
class TrainingCheckpoint:
    """What :func:`load_training_checkpoint` restored.

    Attributes:
        path: the ``iter_*`` directory read.
        iteration: the iteration it was saved at (continue with ``iteration + 1``).
        extra: the user data passed to :func:`save_training_checkpoint`.
    """

    path: Path
    iteration: int
    extra: dict = field(default_factory=dict)


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``<root>/iter_0000042`` (Megatron-LM's naming)."""
    return Path(root) / f"iter_{int(iteration):07d}"


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration named by ``<root>/latest_checkpointed_iteration.txt``; None if absent.

    Raises:
        CheckpointError: the tracker file does not hold an integer.
    """
    f = Path(root) / TRACKER_FILE
    if not f.is_file():
        return None
    text = f.read_text().strip()
    if not re.fullmatch(r"\d+", text):
        raise CheckpointError(f"{f} should hold an iteration number, got {text[:40]!r}")
    return int(text)


# --------------------------------------------------------------------------- RNG


def _dp_rank_size() -> tuple[int, int, Any]:
    if not dist.is_initialized():
        return 0, 1, None
    group = compat.data_context_parallel_group() if compat.model_parallel_is_initialized() else None
    return dist.get_rank(group), dist.get_world_size(group), group


def get_rng_state() -> dict:
    """This process's RNG states (Megatron-LM's key names)."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    tracker = compat.rng_tracker()
    if tracker is not None:
        state["rng_tracker_states"] = tracker.get_states()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`get_rng_state` output (CUDA / tracker states only where present here too).

    Raises:
        CheckpointError: a required entry is missing.
    """
    missing = [k for k in ("random_rng_state", "np_rng_state", "torch_rng_state") if k not in state]
    if missing:
        raise CheckpointError(f"RNG state lacks {missing}")
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = compat.rng_tracker()
    if tracker is not None and state.get("rng_tracker_states"):
        tracker.set_states(state["rng_tracker_states"])


def _rng_sharded_object(state_list: list | None):
    from megatron.core.dist_checkpointing import ShardedObject

    dp_rank, _, _ = _dp_rank_size()
    # TP = PP = 1 (enforced): global shape (pp, tp) = (1, 1); only DP rank 0 writes.
    return ShardedObject("rng_state", state_list, (1, 1), (0, 0), replica_id=dp_rank)


def _gathered_rng_states() -> list[dict]:
    """Every data-parallel rank's RNG state, in DP-rank order (saved by DP rank 0)."""
    dp_rank, dp_size, group = _dp_rank_size()
    mine = get_rng_state()
    if dp_size == 1:
        return [mine]
    out: list = [None] * dp_size
    dist.all_gather_object(out, mine, group=group)
    return out


# --------------------------------------------------------------------------- save / load


def _state_dict(model, optimizer: TrainOptimizer, is_loading: bool, rng_states: list | None) -> dict:
    model_ssd = model.sharded_state_dict()
    return {"model": model_ssd, "optimizer": optimizer.sharded_state_dict(model_ssd, is_loading=is_loading),
            "rng_state": _rng_sharded_object(rng_states)}


def _model_digests(model_ssd: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 of every model tensor under its checkpoint key (the HF name), over every rank: at EP > 1
    each rank holds its own experts, so the ranks' tables are gathered (collective). What
    :func:`load_training_checkpoint` and ``convert --from megatron`` check the stored tensors
    against (the optimizer state has its own table, :func:`_optimizer_digests`). Costs one host copy and hash of the weights per save
    (seconds for billions of parameters)."""
    return _gathered({t.key: layout.tensor_digest(t.data) for t in model_ssd.values()})


def _gathered(mine: dict[str, str]) -> dict[str, str]:
    """This rank's digest table merged with every other rank's (collective; itself in one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    tables: list = [None] * dist.get_world_size()
    dist.all_gather_object(tables, mine)
    return {k: v for table in tables for k, v in table.items()}


def _sharded_tensors(tree: Any, path: tuple = ()):
    """``(path, leaf)`` for every ``ShardedTensor`` leaf of a nested dict / list state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(tree, ShardedTensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _sharded_tensors(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _sharded_tensors(v, (*path, i))


def _fragment_id(t) -> str:
    """A ``ShardedTensor``'s place in the checkpoint: key, global offset and flattened range (the
    pieces one rank saves; another layout's ranks hold other pieces)."""
    r = t.flattened_range
    return f"{t.key}@{tuple(int(o) for o in t.global_offset)}" + ("" if r is None else f"[{r.start}:{r.stop}]")


def _optimizer_digests(optimizer_ssd: Any) -> dict[str, str]:
    """SHA-256 of every optimizer-state piece (fp32 main weights, ``exp_avg``, ``exp_avg_sq``) under its
    :func:`_fragment_id`, over every rank (collective): what :func:`load_training_checkpoint` checks the
    read optimizer state against before anything is applied."""
    return _gathered({_fragment_id(t): layout.tensor_digest(t.data) for _, t in _sharded_tensors(optimizer_ssd)})


def _verify_optimizer_state(template_ssd: Any, loaded: Any, digests: Mapping[str, str], source: str) -> None:
    """Compare each optimizer-state piece read with the digest stored for its place. The optimizer is
    not distributed (``use_distributed_optimizer=False``), so every piece is one parameter's state under
    the parameter's key and global offset, whatever the EP or DP size of the save and of the resume
    (``tests/backends/test_megatron_expert_parallel.py``: EP = 2 -> 1 -> 2, every piece compared). A
    checkpoint written before the table existed has none and is not compared.

    Raises:
        CheckpointError: naming the pieces whose bytes changed since the save, or the pieces the
            stored table has no digest for (a table that does not describe this checkpoint).
    """
    if not digests:
        return
    bad, missing = [], []
    for path, t in _sharded_tensors(template_ssd):
        want = digests.get(_fragment_id(t))
        if want is None:
            missing.append(_fragment_id(t))
            continue
        got = loaded
        for k in path:
            got = got[k]
        if layout.tensor_digest(got) != want:
            bad.append(t.key)
    if missing:
        raise CheckpointError(f"training checkpoint {source}: its optimizer-state digest table has no entry for "
                              f"{len(missing)} piece(s) this model reads, e.g. {missing[:3]}: the table does not "
                              "describe this checkpoint (edited metadata?)")
    if bad:
        raise CheckpointError(f"training checkpoint {source} is corrupt: {len(bad)} optimizer-state tensor(s) differ "
                              f"from the digests stored at save time: {bad[:10]}")


def _plain(extra: Mapping | None) -> dict:
    try:
        return json.loads(json.dumps(dict(extra or {})))
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must hold only JSON types (str, int, float, bool, None, lists, dicts): {e}") from None


def save_training_checkpoint(root: str | os.PathLike, model, optimizer: TrainOptimizer, *,
                             iteration: int | None = None, hf_config: Any = None, hf_quant_config: Any = None,
                             assets_from: str | os.PathLike | None = None,
                             tokenizer_from: str | os.PathLike | None = None, extra: Mapping[str, Any] | None = None,
                             overwrite: bool = False) -> Path:
    """Write ``<root>/iter_<iteration>/`` and point the tracker file at it. Collective (all ranks call it).

    Args:
        root: checkpoint root directory (created if needed).
        model: the ``UnifiedMegatronModel`` being trained.
        optimizer: its :class:`TrainOptimizer`.
        iteration: the step just finished (default: ``optimizer.iteration``).
        hf_config: the model's Hugging Face config (dict, JSON text or transformers
            config); stored so that the checkpoint converts to Hugging Face. For a
            model that trains the masters of a quantized checkpoint, that
            checkpoint's config: the masters' config (without ``quantization_config``,
            the masters' dtype) is stored, and the given config as the quantization
            recipe (:func:`unified_models.converters.trained_masters.record_masters`).
        hf_quant_config: with such an ``hf_config``, the quantized checkpoint's
            ``hf_quant_config.json`` (dict or JSON text), kept in the recipe.
        assets_from: the Hugging Face directory the model was loaded from: its tokenizer
            and generation files (:data:`~unified_models.converters.megatron_dist_ckpt.HF_ASSET_PATTERNS`)
            are written to ``hf_assets/`` with the checkpoint (padded to the vocabulary as
            ``convert --to megatron`` pads them), for ``convert --from megatron``. For trained
            masters its ``hf_quant_config.json`` is left out (the recipe holds it).
        tokenizer_from: the tokenizer directory the run used when not ``assets_from``'s (``rl --tokenizer``):
            ``hf_assets/`` takes its tokenizer files
            (:data:`~unified_models.converters.megatron_dist_ckpt.TOKENIZER_ASSET_PATTERNS`) and none of
            ``assets_from``'s, and its ``generation_config.json`` when it has one (its token ids are that
            tokenizer's), else ``assets_from``'s.
        extra: JSON-able user data (e.g. the data cursor), returned on load.
        overwrite: replace an existing ``iter_*`` directory of the same iteration.

    Returns:
        The ``iter_*`` directory.

    Raises:
        CheckpointError: ``hf_config`` describes another model than the one trained
            (nor a quantized model whose masters it trains), ``assets_from`` is not a
            directory, ``tokenizer_from`` holds no tokenizer file, the directory exists (without
            ``overwrite``) or the write failed (nothing half-written is left).
        ValueError: ``extra`` is not JSON-able, a negative iteration, or
            ``hf_quant_config`` without a quantized ``hf_config``.
    """
    iteration = optimizer.iteration if iteration is None else int(iteration)
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    extra = _plain(extra)
    spec = model.spec
    text = layout.config_text(hf_config) if hf_config is not None else None
    recipe = None
    if text is not None:
        stored = layout.spec_from_config_text(text, source="save_training_checkpoint")
        if stored.stores_quantized_weights and not spec.stores_quantized_weights:  # the masters of a quantized model
            text, recipe = trained_masters.record_masters(text, spec, hf_quant_config=hf_quant_config)
        elif stored.parameter_shapes() != spec.parameter_shapes():
            raise CheckpointError("save_training_checkpoint: hf_config describes another model than the one trained")
    if hf_quant_config is not None and recipe is None:
        raise ValueError("save_training_checkpoint: hf_quant_config applies to the masters of a quantized model "
                         "(an hf_config with quantization_config)")
    assets = None if assets_from is None else Path(assets_from)
    if assets is not None and not assets.is_dir():
        raise CheckpointError(f"save_training_checkpoint: assets_from {assets} is not a directory (it should be the "
                              "Hugging Face checkpoint trained from, whose tokenizer files the checkpoint carries)")
    tokenizer = assets if tokenizer_from is None else Path(tokenizer_from)
    if tokenizer_from is not None and not layout.asset_files(tokenizer, patterns=layout.TOKENIZER_ASSET_PATTERNS):
        raise CheckpointError(f"save_training_checkpoint: tokenizer_from {tokenizer} holds no tokenizer files "
                              f"(none of {', '.join(layout.TOKENIZER_ASSET_PATTERNS)}); it should be the tokenizer "
                              "directory the run used")
    on_cuda = next(model.parameters()).device.type == "cuda"
    recipe_field = {layout.RECIPE_KEY: recipe.to_entry()} if recipe is not None else {}
    sd = _state_dict(model, optimizer, False, _gathered_rng_states())
    entry = layout.common_entry(spec, text, writer="megatron" if on_cuda else "megatron_cpu", training=True,
                                extra_tensor_prefixes=[OPTIMIZER_PREFIX], optimizer_backend=optimizer.backend,
                                optimizer_iteration=optimizer.iteration, extra=extra,
                                digests=_model_digests(sd["model"]),
                                optimizer_sha256=_optimizer_digests(sd["optimizer"]), **recipe_field)
    sd.update({"iteration": iteration, layout.COMMON_KEY: entry})
    out = iteration_dir(root, iteration)
    rank = dist.get_rank() if dist.is_initialized() else 0

    def write(tmp: Path) -> None:
        try:
            (compat.dist_save if on_cuda else compat.cpu_dist_save)(sd, tmp)
        except layout.IO_ERRORS as e:  # noqa: BLE001 - reported as a failed write; the temp dir is removed
            raise CheckpointError(f"writing training checkpoint {out} failed: {layout.describe_error(e)}") from e

    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"training checkpoint {out} already exists; pass overwrite=True to replace it")
    if rank == 0:
        with layout.atomic_output_dir(out, overwrite) as tmp:
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list([str(tmp)], src=0)
            write(tmp)
            if tokenizer is not None:
                _write_assets(assets, tokenizer, tmp / layout.ASSETS_DIR, spec.vocab_size, out,
                              exclude=("hf_quant_config.json",) if recipe is not None else ())
        tracker = Path(root) / TRACKER_FILE
        part = tracker.with_name(f".{TRACKER_FILE}.tmp")
        part.write_text(f"{iteration}\n")
        os.replace(part, tracker)
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        write(Path(box[0]))
    if dist.is_initialized():
        dist.barrier()
    return out


def _write_assets(src: Path | None, tokenizer: Path, dst: Path, vocab_size: int, out: Path, *,
                  exclude: tuple[str, ...]) -> None:
    """The tokenizer files of ``tokenizer`` and the other asset files of ``src`` (the model's directory; none
    when None) copied into ``dst`` (a checkpoint's ``hf_assets/``), ``generation_config.json`` from
    ``tokenizer`` when it has one, and padded to ``vocab_size`` ids, as
    :func:`.dist_ckpt.save_dist_checkpoint` writes them. With ``tokenizer`` = ``src``, all of ``src``'s.

    Raises:
        CheckpointError: a file could not be copied (``out``, the checkpoint, named).
    """
    try:
        taken = layout.copy_assets(tokenizer, dst, exclude=exclude,
                                   patterns=(*layout.TOKENIZER_ASSET_PATTERNS, "generation_config.json"))
        if src is not None:
            layout.copy_assets(src, dst, exclude=(*exclude, *taken), patterns=layout.MODEL_ASSET_PATTERNS)
        pad_tokenizer_dir(dst, vocab_size)  # every id detokenizes (serving)
    except OSError as e:
        raise CheckpointError(f"writing training checkpoint {out} failed: copying the tokenizer files of "
                              f"{tokenizer}: {e}") from e


def _resolve(path: str | os.PathLike, iteration: int | None) -> Path:
    p = Path(path)
    if iteration is not None:
        return iteration_dir(p, iteration)
    if (p / TRACKER_FILE).is_file():
        return iteration_dir(p, latest_iteration(p))
    if p.is_dir() and not (p / "metadata.json").exists() and any(p.glob("iter_*")):
        raise CheckpointError(f"{p} has iter_* directories but no {TRACKER_FILE}; pass iteration=")
    return p


def _training_entry(path: str | os.PathLike, iteration: int | None, spec) -> tuple[Path, dict, dict, dict]:
    """The checkpoint directory, its common state, its unified_models entry and its tensors' metadata
    (``{key: metadata}``), from its metadata files only (no tensor data).

    Raises:
        CheckpointError: missing / incomplete / corrupt metadata, a model checkpoint without training
            state, or another model than ``spec`` (tensors named).
    """
    d = layout.check_layout_files(_resolve(path, iteration))
    try:
        common = compat.load_common_state_dict(d)
    except layout.IO_ERRORS as e:  # noqa: BLE001
        raise layout.common_state_error(d, e, "checkpoint metadata") from None
    try:
        metadata = compat.load_tensors_metadata(d)
    except layout.IO_ERRORS as e:  # noqa: BLE001
        raise CheckpointError(f"{d}: checkpoint metadata is unreadable (corrupt?): {layout.describe_error(e)}") from None
    entry = common.get(layout.COMMON_KEY) if isinstance(common, dict) else None
    if not isinstance(entry, dict) or not entry.get("training"):
        raise CheckpointError(f"{d} is not a unified_models training checkpoint (no optimizer/RNG state); "
                              "load model-only checkpoints with UnifiedMegatronModel.load_dist_checkpoint")
    stored = {n: tuple(m.global_shape) for n, m in metadata.items() if not n.startswith(OPTIMIZER_PREFIX)}
    problems = tensor_table_problems(spec.parameter_shapes(), stored, verb="stored")
    if problems:
        raise CheckpointError(f"training checkpoint {d} holds another model; " + "; ".join(problems))
    return d, common, entry, metadata


def check_training_checkpoint(path: str | os.PathLike, spec, *, iteration: int | None = None) -> int:
    """Check, from the metadata files alone (seconds before any model is built), that ``path`` is a
    training checkpoint of ``spec``'s parameters; what :func:`load_training_checkpoint` checks first.

    Args:
        path: a checkpoint root (the tracker file picks the iteration) or an ``iter_*`` directory.
        spec: the trained model's spec (for a quantized checkpoint, its masters' spec:
            :func:`unified_models.converters.modelopt.master_spec`).
        iteration: check ``<path>/iter_<iteration>`` instead of the latest.

    Returns:
        The checkpoint's iteration (the last finished step).

    Raises:
        CheckpointError: as :func:`load_training_checkpoint` for a missing, corrupt or other model's
            checkpoint.
    """
    d, common, _, _ = _training_entry(path, iteration, spec)
    try:
        return int(common["iteration"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d}: checkpoint metadata records no iteration ({layout.describe_error(e)})") from None


def training_checkpoint_extra(path: str | os.PathLike, spec, *, iteration: int | None = None) -> dict:
    """The ``extra`` record :func:`save_training_checkpoint` stored (e.g. ``rl``'s run identity), read from
    the metadata files alone; raises as :func:`check_training_checkpoint`."""
    _, _, entry, _ = _training_entry(path, iteration, spec)
    extra = entry.get("extra")
    return dict(extra) if isinstance(extra, dict) else {}


@torch.no_grad()
def load_training_checkpoint(path: str | os.PathLike, model, optimizer: TrainOptimizer, *,
                             iteration: int | None = None, restore_rng: bool = True) -> TrainingCheckpoint:
    """Restore model parameters, optimizer state, RNG states and the iteration in place. Collective.

    Args:
        path: a checkpoint root (the tracker file picks the iteration) or an ``iter_*`` directory.
        model, optimizer: freshly built (or any) model of the same spec and its optimizer.
        iteration: load ``<path>/iter_<iteration>`` instead of the latest.
        restore_rng: also restore this rank's RNG streams.

    Returns:
        :class:`TrainingCheckpoint`.

    Raises:
        CheckpointError: missing / incomplete / corrupt checkpoint (also a model tensor or an
            optimizer-state tensor that does not match the SHA-256 digest stored at save time, named;
            checkpoints of earlier versions store none; the parameters and the optimizer's tensors may
            then already hold the read values, though the iteration and the RNG are not restored:
            rebuild the model and the optimizer),
            a model checkpoint without training state, another model (tensors named), tensors stored
            in another dtype than the model's parameters (named), or optimizer groups that do not match.
    """
    d, _, entry, stored = _training_entry(path, iteration, model.spec)
    digests = layout.stored_digests(entry, str(d))
    optimizer_digests = layout.stored_digests(entry, str(d), "optimizer_sha256")
    other = [f"{n} ({stored[n].dtype}; the model's {p.dtype})" for n, p in model.named_parameters()
             if n in stored and stored[n].dtype != p.dtype]
    if other:
        raise CheckpointError(f"training checkpoint {d} stores {len(other)} tensor(s) in another dtype than this "
                              f"model's parameters: {', '.join(other[:5])}; build the model in the checkpoint's dtype")
    if entry.get("optimizer_backend") != optimizer.backend:
        raise CheckpointError(f"{d} holds {entry.get('optimizer_backend')!r} optimizer state; this run uses "
                              f"{optimizer.backend!r} (CPU AdamW and Megatron's CUDA optimizer do not share a state)")
    template = _state_dict(model, optimizer, True, [get_rng_state()])
    try:
        loaded = compat.dist_load(template, d)
    except layout.IO_ERRORS as e:  # noqa: BLE001 - any reader failure means a corrupt checkpoint
        raise CheckpointError(f"training checkpoint {d} could not be read (corrupt?): {layout.describe_error(e)}") from None
    layout.verify_digests({template["model"][n].key: loaded["model"][n] for n, _ in model.named_parameters()},
                          digests, str(d))  # before the optimizer state or the RNG is touched
    _verify_optimizer_state(template["optimizer"], loaded["optimizer"], optimizer_digests, str(d))
    for name, p in model.named_parameters():
        t = loaded["model"][name]
        if t is not p:
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    optimizer.load_state_dict(loaded["optimizer"])
    optimizer.iteration = int(entry.get("optimizer_iteration", loaded["iteration"]))
    _bump_weight_versions(model.parameters())
    if restore_rng:
        states = loaded["rng_state"]
        dp_rank, dp_size, _ = _dp_rank_size()
        set_rng_state(states[dp_rank] if len(states) == dp_size else states[0])
    return TrainingCheckpoint(path=d, iteration=int(loaded["iteration"]), extra=dict(entry.get("extra") or {}))
