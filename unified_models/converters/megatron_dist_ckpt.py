"""Megatron distributed checkpoints (``torch_dist``) <-> Hugging Face checkpoints.

A checkpoint written here is a Megatron-core ``torch_dist`` checkpoint that
``megatron.core.dist_checkpointing.load`` of megatron-core 0.16 and 0.19 reads:

* ``.metadata`` + ``__0_0.distcp``: PyTorch DCP files; each parameter is one
  whole tensor stored under its ShardedTensor key = its Hugging Face name, in
  its original dtype (TP=1: replicated, no resharding needed).
* ``common.pt``: the common (non-tensor) state, ``{"unified_models": {...}}``
  with the format tag, the family and the original ``config.json`` text (so
  the reverse conversion rebuilds ``config.json`` byte for byte). Only plain
  strings/ints/dicts, so 0.19's ``torch.load(weights_only=True)`` reads it.
* ``metadata.json``: the 0.16 layout (``sharded_backend`` "torch_dist",
  ``common_backend`` "torch"); 0.19 ignores the common keys.
* ``hf_assets/``: tokenizer files and ``generation_config.json`` of the
  source checkpoint, copied back by :func:`megatron_to_hf`.

Writers: on CUDA (one process) Megatron's own ``dist_checkpointing.save``
(0.19 then stores the common state inside the DCP files instead of
``common.pt``; readers handle both). On CPU Megatron's save cannot run (its
``torch_dist`` writer calls ``torch.cuda.synchronize``), so the same layout is
written through ``torch.distributed.checkpoint.save(no_dist=True)`` with a
non-flattening planner (recipe B of ``reference/megatron-modelopt.md`` §3).
Reading always goes through ``dist_checkpointing.load`` against ShardedTensors
built from the spec.

Megatron's save (0.16 and 0.19) starts a ``multiprocessing`` manager with the
``spawn`` start method for its write-results queue: a script calling the
``"megatron"`` writer needs an ``if __name__ == "__main__":`` guard (spawn
re-imports the main module). Checked on the H200 with megatron-core 0.19.2:
the ``"megatron"`` writer produces the 0.19-native layout (no ``common.pt``),
and both layouts load and convert back bitwise.

Every write goes to a temporary sibling directory that is renamed into place
only when complete: an error leaves nothing half-written. Bad input raises
:class:`CheckpointError` naming the problem.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import torch
from torch.distributed.checkpoint.api import CheckpointException as _DCPException

from ..dsl import CheckpointError, ModelSpec, SpecError, UnifiedModelsError
from .hf_safetensors import load_hf_config, read_tensors, tensor_table_problems, validate_state_dict

FORMAT_NAME = "unified_models.megatron_dist_ckpt"
FORMAT_VERSION = 1
COMMON_KEY = "unified_models"
ASSETS_DIR = "hf_assets"
HF_ASSET_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
    "spiece.model", "generation_config.json", "chat_template*",
)
"""Files of a Hugging Face directory carried through a Megatron checkpoint (tokenizer, generation config)."""

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}

Writer = Literal["auto", "megatron", "torch_dcp"]

_IO_ERRORS = (Exception, _DCPException)
"""PyTorch DCP reports failures as ``CheckpointException``, a ``BaseException``."""


def describe_error(e: BaseException) -> str:
    """One line for an I/O failure; unwraps DCP's per-rank ``CheckpointException``."""
    failures = getattr(e, "failures", None)
    if isinstance(e, _DCPException) and isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) and inner else inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


@dataclass(frozen=True)
class DistCheckpointInfo:
    """What :func:`check_dist_checkpoint` learned without reading tensor data.

    Attributes:
        config_text: the stored Hugging Face ``config.json`` text.
        spec: the model spec built from it.
        tensors_metadata: ``{key: ShardedTensor without data}`` (global shape, dtype).
        digests: ``{HF name: SHA-256}`` stored at save time.
    """

    config_text: str
    spec: ModelSpec
    tensors_metadata: dict
    digests: dict

__all__ = [
    "save_dist_checkpoint", "load_dist_checkpoint", "check_dist_checkpoint", "hf_to_megatron",
    "megatron_to_hf", "DistCheckpointInfo", "tensor_digest", "verify_digests", "FORMAT_NAME", "FORMAT_VERSION",
]


# --------------------------------------------------------------------------- helpers


def _config_text(config: Any) -> str:
    """The ``config.json`` text of a dict, JSON string or transformers config."""
    if isinstance(config, str):
        try:
            json.loads(config)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"config is not valid JSON: {e}") from None
        return config
    if isinstance(config, Mapping):
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    if hasattr(config, "to_json_string"):
        return config.to_json_string()
    raise CheckpointError(f"config must be a dict, a JSON string or a transformers config, got {type(config).__name__}")


def _spec_from_config_text(text: str, source: str) -> ModelSpec:
    """Parse stored ``config.json`` text exactly as a Hugging Face directory is parsed
    (transformers' ``AutoConfig.from_pretrained``, which also decodes its special floats)."""
    import tempfile

    from ..models import spec_from_hf_config

    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{source}: stored config.json is not valid JSON: {e}") from None
    with tempfile.TemporaryDirectory(prefix="um-config-") as tmp:
        (Path(tmp) / "config.json").write_bytes(text.encode("utf-8"))
        try:
            config = load_hf_config(tmp)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: stored config: {e}") from None
    try:
        return spec_from_hf_config(config)
    except SpecError as e:
        raise type(e)(f"{source}: {e}") from None


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _ensure_process_group() -> None:
    from ..backends.megatron.parallel import ensure_process_group

    ensure_process_group()


@contextlib.contextmanager
def _atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool):
    """Yield a fresh temporary sibling of ``out_dir``; rename it into place on success.

    Raises:
        CheckpointError: ``out_dir`` is a file, or a non-empty directory without ``overwrite``.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"output directory {out} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        raise CheckpointError(f"could not write {out}: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _copy_assets(src: Path, dst: Path) -> list[str]:
    copied = []
    if not src.is_dir():
        return copied
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in HF_ASSET_PATTERNS):
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes (dtype and shape are checked separately)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def verify_digests(tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str] | None, source: str) -> None:
    """Compare tensors with the SHA-256 digests stored at save time.

    Raises:
        CheckpointError: naming every tensor whose bytes changed (corrupt data files).
    """
    if not digests:
        return
    bad = [n for n, t in tensors.items() if n in digests and tensor_digest(t) != digests[n]]
    if bad:
        raise CheckpointError(f"Megatron checkpoint {source} is corrupt: the data of {len(bad)} tensor(s) "
                              f"does not match the digest stored at save time: {bad[:10]}")


# --------------------------------------------------------------------------- writers


def _write_torch_dcp(ckpt_dir: Path, tensors: Mapping[str, torch.Tensor], common: dict) -> None:
    """The 0.16 ``torch_dist`` layout through PyTorch DCP, no Megatron and no CUDA needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    flat = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    dcp.save(flat, storage_writer=FileSystemWriter(str(ckpt_dir)),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, ckpt_dir / "common.pt")
    (ckpt_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))


def _write_megatron(ckpt_dir: Path, tensors: Mapping[str, torch.Tensor], common: dict) -> None:
    """Megatron's own ``dist_checkpointing.save`` (CUDA tensors, one process)."""
    from ..backends.megatron import compat

    _ensure_process_group()
    device = torch.device("cuda", torch.cuda.current_device())
    sharded: dict[str, Any] = {k: compat.plain_sharded_tensor(t.detach().to(device).contiguous(), k)
                               for k, t in tensors.items()}
    sharded.update(common)
    compat.dist_save(sharded, ckpt_dir)


def _resolve_writer(writer: Writer) -> str:
    if writer not in ("auto", "megatron", "torch_dcp"):
        raise ValueError(f"writer must be 'auto', 'megatron' or 'torch_dcp', got {writer!r}")
    _, world = _dist_rank_world()
    if writer == "auto":
        return "megatron" if torch.cuda.is_available() and world == 1 else "torch_dcp"
    if writer == "megatron":
        if not torch.cuda.is_available():
            raise CheckpointError("writer='megatron' needs CUDA: Megatron's torch_dist writer calls "
                                  "torch.cuda.synchronize(); use writer='torch_dcp' on CPU")
        if world != 1:
            raise CheckpointError("writer='megatron' writes whole tensors from one process; run the converter "
                                  f"in a single process (world size is {world})")
    return writer


# --------------------------------------------------------------------------- public API


def save_dist_checkpoint(state_dict: Mapping[str, torch.Tensor], config: Any, out_dir: str | os.PathLike, *,
                         spec: ModelSpec | None = None, assets_from: str | os.PathLike | None = None,
                         writer: Writer = "auto", overwrite: bool = False) -> Path:
    """Write a canonical state dict as a Megatron ``torch_dist`` checkpoint.

    Args:
        state_dict: ``{HF name: tensor}`` exactly as the spec lists it (dtypes kept).
        config: the Hugging Face config (dict, ``config.json`` text or
            transformers config); stored for the reverse conversion.
        out_dir: checkpoint directory (must not exist or be empty, unless ``overwrite``).
        spec: the model; default: built from ``config``.
        assets_from: a Hugging Face directory whose tokenizer / generation
            files are carried along (``hf_assets/``).
        writer: ``"megatron"`` (Megatron's save; CUDA, one process),
            ``"torch_dcp"`` (CPU-capable, 0.16 layout) or ``"auto"`` (megatron
            when CUDA is available and the world is one process).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: tensors do not match the spec (all named), NaN/Inf,
            unusable config, output exists, or the write failed (nothing left behind).
    """
    text = _config_text(config)
    config_spec = _spec_from_config_text(text, source="save_dist_checkpoint")
    if spec is None:
        spec = config_spec
    elif spec.parameter_shapes() != config_spec.parameter_shapes():
        raise CheckpointError("save_dist_checkpoint: the given spec and config describe different models "
                              "(the stored config must rebuild the spec on load)")
    validate_state_dict(dict(state_dict), spec, source="state_dict")
    kind = _resolve_writer(writer)
    rank, world = _dist_rank_world()
    out = Path(out_dir)
    common = {COMMON_KEY: {"format": FORMAT_NAME, "version": FORMAT_VERSION, "family": spec.family,
                           "architecture": spec.architecture, "hf_config_json": text, "writer": kind}}
    tensors = {name: state_dict[name] for name in spec.parameter_shapes()}
    common[COMMON_KEY]["sha256"] = {name: tensor_digest(t) for name, t in tensors.items()}
    if rank == 0:
        with _atomic_output_dir(out, overwrite) as tmp:
            try:
                if kind == "megatron":
                    _write_megatron(tmp, tensors, common)
                else:
                    _write_torch_dcp(tmp, tensors, common)
                if assets_from is not None:
                    _copy_assets(Path(assets_from), tmp / ASSETS_DIR)
            except UnifiedModelsError:
                raise
            except _IO_ERRORS as e:  # noqa: BLE001 - reported as a failed write; the temp dir is removed
                raise CheckpointError(f"writing Megatron checkpoint {out} failed: {describe_error(e)}") from e
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return out


def check_dist_checkpoint(ckpt_dir: str | os.PathLike, *, spec: ModelSpec | None = None):
    """Validate a checkpoint's layout, common state and tensor list without reading tensor data.

    Args:
        ckpt_dir: checkpoint directory.
        spec: if given, the checkpoint must hold exactly this model's parameters.

    Returns:
        :class:`DistCheckpointInfo`.

    Raises:
        CheckpointError: missing directory, not a ``torch_dist`` checkpoint,
            not written by unified_models, unreadable metadata, or missing /
            unexpected / mis-shaped tensors (all named).
    """
    from ..backends.megatron import compat

    d = Path(ckpt_dir)
    if not d.is_dir():
        raise CheckpointError(f"Megatron checkpoint directory {d} does not exist")
    meta_json = d / "metadata.json"
    if not meta_json.is_file():
        raise CheckpointError(f"{d} is not a Megatron distributed checkpoint: metadata.json is missing")
    try:
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_json} is not a valid checkpoint metadata file: {e}") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{meta_json}: sharded_backend={backend!r}; only 'torch_dist' checkpoints are supported")
    if not (d / ".metadata").is_file():
        raise CheckpointError(f"{d} is incomplete: the DCP index file .metadata is missing")
    _ensure_process_group()
    try:
        common = compat.load_common_state_dict(d)
    except _IO_ERRORS as e:  # noqa: BLE001
        raise CheckpointError(f"{d}: common state (common.pt / common_state) is unreadable: {describe_error(e)}") from None
    entry = common.get(COMMON_KEY) if isinstance(common, dict) else None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT_NAME:
        keys = sorted(common) if isinstance(common, dict) else type(common).__name__
        raise CheckpointError(f"{d} was not written by unified_models: its common state has no "
                              f"{COMMON_KEY!r} entry of format {FORMAT_NAME!r} (common keys: {keys})")
    if entry.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{d}: format version {entry.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    text = entry.get("hf_config_json")
    if not isinstance(text, str):
        raise CheckpointError(f"{d}: the stored Hugging Face config is missing")
    ckpt_spec = _spec_from_config_text(text, source=str(d))
    if spec is not None and spec.parameter_shapes() != ckpt_spec.parameter_shapes():
        raise CheckpointError(f"{d} holds a different model than the requested {spec.family} spec "
                              f"({len(ckpt_spec.blocks)} layers, hidden {ckpt_spec.hidden_size} in the checkpoint; "
                              f"{len(spec.blocks)} layers, hidden {spec.hidden_size} requested)")
    try:
        metadata = compat.load_tensors_metadata(d)
    except _IO_ERRORS as e:  # noqa: BLE001
        raise CheckpointError(f"{d}/.metadata is unreadable (corrupt checkpoint): {describe_error(e)}") from None
    problems = tensor_table_problems(ckpt_spec.parameter_shapes(),
                                     {n: tuple(m.global_shape) for n, m in metadata.items()}, verb="stored")
    if problems:
        raise CheckpointError(f"Megatron checkpoint {d} does not match its {ckpt_spec.family} config; "
                              + "; ".join(problems))
    digests = entry.get("sha256") or {}
    if not isinstance(digests, dict):
        raise CheckpointError(f"{d}: the stored tensor digests are malformed")
    return DistCheckpointInfo(config_text=text, spec=ckpt_spec, tensors_metadata=metadata, digests=digests)


def _load(ckpt_dir: str | os.PathLike, device: torch.device | str, check_finite: bool):
    from ..backends.megatron import compat

    info = check_dist_checkpoint(ckpt_dir)
    spec, metadata = info.spec, info.tensors_metadata
    rank, _ = _dist_rank_world()
    template = {
        name: compat.plain_sharded_tensor(
            torch.empty(shape, dtype=metadata[name].dtype, device=device), name, replica_id=rank)
        for name, shape in spec.parameter_shapes().items()
    }
    try:
        loaded = compat.dist_load(template, ckpt_dir)
    except _IO_ERRORS as e:  # noqa: BLE001 - any reader failure means a corrupt checkpoint
        raise CheckpointError(f"Megatron checkpoint {ckpt_dir} could not be read (corrupt?): "
                              f"{describe_error(e)}") from None
    tensors = {name: loaded[name] for name in spec.parameter_shapes()}
    verify_digests(tensors, info.digests, str(ckpt_dir))
    validate_state_dict(tensors, spec, source=str(ckpt_dir), check_finite=check_finite)
    return info.config_text, spec, tensors


def load_dist_checkpoint(ckpt_dir: str | os.PathLike, *, device: torch.device | str = "cpu",
                         check_finite: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a checkpoint through ``megatron.core.dist_checkpointing.load``.

    The sharded state dict is built from the stored config's spec (names and
    shapes) with the stored dtypes; tensors come back whole (TP=1).

    Returns:
        ``(config_json, state_dict)``: the Hugging Face config dict and ``{HF name: tensor}``.

    Raises:
        CheckpointError: see :func:`check_dist_checkpoint`; unreadable tensor
            data (corrupt files); NaN/Inf when ``check_finite``.
    """
    text, _, tensors = _load(ckpt_dir, device, check_finite)
    return json.loads(text), tensors


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, writer: Writer = "auto",
                   overwrite: bool = False) -> Path:
    """Convert a Hugging Face checkpoint (config.json + safetensors) to a Megatron checkpoint.

    Tensors keep their names and dtypes; ``config.json`` is stored verbatim;
    tokenizer and generation-config files travel in ``hf_assets/``.

    Raises:
        CheckpointError: missing directory / config / weights, corrupt files,
            tensors not matching the config (all named), NaN/Inf, output exists.
        SpecError: the config declares something unsupported.
    """
    from ..models import spec_from_hf_config

    src = Path(hf_dir)
    config = load_hf_config(src)
    try:
        spec = spec_from_hf_config(config)
    except SpecError as e:
        raise type(e)(f"{src}/config.json: {e}") from None
    text = (src / "config.json").read_bytes().decode("utf-8")
    tensors = read_tensors(src)
    validate_state_dict(tensors, spec, source=str(src))
    return save_dist_checkpoint(tensors, text, out_dir, spec=spec, assets_from=src, writer=writer,
                                overwrite=overwrite)


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Convert a Megatron checkpoint written by :func:`save_dist_checkpoint` back to Hugging Face.

    Writes ``model.safetensors`` (same names and dtypes), the original
    ``config.json`` text and the carried tokenizer / generation files.

    Raises:
        CheckpointError: see :func:`load_dist_checkpoint`; output exists.
    """
    from safetensors.torch import save_file

    text, _, tensors = _load(ckpt_dir, "cpu", True)
    out = Path(out_dir)
    with _atomic_output_dir(out, overwrite) as tmp:
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            (tmp / "config.json").write_bytes(text.encode("utf-8"))
            _copy_assets(Path(ckpt_dir) / ASSETS_DIR, tmp)
        except _IO_ERRORS as e:  # noqa: BLE001
            raise CheckpointError(f"writing Hugging Face checkpoint {out} failed: {describe_error(e)}") from e
    return out
