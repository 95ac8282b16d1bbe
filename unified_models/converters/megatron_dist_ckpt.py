"""The Megatron ``torch_dist`` checkpoint layout, engine-free (no Megatron import).

The reading and writing through Megatron (``dist_checkpointing.save``/``load``,
``hf_to_megatron``, ``megatron_to_hf``, ``load_dist_checkpoint``) lives in
:mod:`unified_models.backends.megatron.dist_ckpt`; this module holds what that
code and other tools share without importing an engine:

* the format: a Megatron-core ``torch_dist`` checkpoint that megatron-core 0.16
  and 0.19 read:

  - ``.metadata`` + ``__<rank>_<n>.distcp``: PyTorch DCP files; each parameter
    is one whole tensor stored under its ShardedTensor key = its Hugging Face
    name, in its original dtype (TP=1: replicated, no resharding needed).
  - ``common.pt``: the common (non-tensor) state, ``{COMMON_KEY: {...}}`` with
    the format tag, the family and the original ``config.json`` text (so the
    reverse conversion rebuilds ``config.json`` byte for byte). Only plain
    strings/ints/dicts, so 0.19's ``torch.load(weights_only=True)`` reads it.
  - ``metadata.json``: the 0.16 layout (``sharded_backend`` "torch_dist",
    ``common_backend`` "torch"); 0.19 ignores the common keys.
  - ``hf_assets/``: tokenizer files and ``generation_config.json`` of the
    source checkpoint (a converted one, or the model an ``rl --save`` training
    checkpoint was trained from; its tokenizer files those of the tokenizer
    the run used, ``--tokenizer`` when given).

  A training checkpoint of a quantized model's masters (``rl --save`` on a ModelOpt
  or block-FP8 checkpoint) stores the masters' config (the quantized config without
  its ``quantization_config``) and, under :data:`RECIPE_KEY`, the quantized
  checkpoint's config it was trained under (:mod:`.trained_masters`).

* :func:`write_torch_dcp`: that layout written through
  ``torch.distributed.checkpoint.save(no_dist=True)`` with a non-flattening
  planner (recipe B of ``reference/megatron-modelopt.md`` §3), which needs
  neither Megatron nor CUDA;
* the common-state entry (:func:`common_entry`, :func:`parse_common_entry`),
  file-level layout checks (:func:`check_layout_files`), tensor digests,
  atomic output directories and the tokenizer-asset copy.

Bad input raises :class:`CheckpointError` naming the problem.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping

import torch
from torch.distributed.checkpoint.api import CheckpointException as _DCPException

from ..dsl import CheckpointError, ModelSpec, SpecError
from .hf_safetensors import load_hf_config

FORMAT_NAME = "unified_models.megatron_dist_ckpt"
FORMAT_VERSION = 1
COMMON_KEY = "unified_models"
RECIPE_KEY = "quantization_recipe"
"""Common-entry field of a training checkpoint of a quantized model's masters: the quantization
recipe it was trained under (:class:`.trained_masters.QuantizationRecipe`); absent otherwise."""
ASSETS_DIR = "hf_assets"
TOKENIZER_ASSET_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.tiktoken",
    "spiece.model", "chat_template*",
)
"""The tokenizer files among :data:`HF_ASSET_PATTERNS` (those a run's ``--tokenizer`` directory supplies)."""
MODEL_ASSET_PATTERNS = ("generation_config.json", "hf_quant_config.json")
"""The other files among :data:`HF_ASSET_PATTERNS` (the model's generation config and quantization file)."""
HF_ASSET_PATTERNS = (*TOKENIZER_ASSET_PATTERNS, *MODEL_ASSET_PATTERNS)
"""Files of a Hugging Face directory carried through a Megatron checkpoint (tokenizer, generation config,
ModelOpt's hf_quant_config.json)."""

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}

Writer = Literal["auto", "megatron", "torch_dcp"]

IO_ERRORS = (Exception, _DCPException)
"""What a failed checkpoint read/write can raise: PyTorch DCP reports failures as
``CheckpointException``, a ``BaseException``."""

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "COMMON_KEY", "RECIPE_KEY", "ASSETS_DIR", "TOKENIZER_ASSET_PATTERNS",
    "MODEL_ASSET_PATTERNS", "HF_ASSET_PATTERNS", "METADATA_JSON", "Writer", "IO_ERRORS", "DistCheckpointInfo",
    "describe_error", "config_text", "spec_from_config_text", "atomic_output_dir", "asset_files", "copy_assets",
    "tensor_digest", "verify_digests", "stored_digests", "write_torch_dcp", "common_entry", "parse_common_entry", "check_layout_files",
    "common_state_error",
]


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
    """What a checkpoint check learned without reading tensor data.

    Attributes:
        config_text: the stored Hugging Face ``config.json`` text.
        spec: the spec of the model tensors held: built from ``config_text``, or for a
            quantized model's masters the masters' spec of the recipe's config.
        tensors_metadata: ``{key: ShardedTensor without data}`` (global shape, dtype)
            of the model's tensors.
        digests: ``{HF name: SHA-256}`` stored at save time (may be empty).
        recipe: the quantization recipe the masters were trained under
            (:class:`.trained_masters.QuantizationRecipe`), or None.
    """

    config_text: str
    spec: ModelSpec
    tensors_metadata: dict
    digests: dict
    recipe: Any = None


def config_text(config: Any) -> str:
    """The ``config.json`` text of a dict, JSON string or transformers config.

    Raises:
        CheckpointError: invalid JSON text or an unsupported type.
    """
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


def spec_from_config_text(text: str, source: str) -> ModelSpec:
    """Parse stored ``config.json`` text exactly as a Hugging Face directory is parsed
    (transformers' ``AutoConfig.from_pretrained``, which also decodes its special floats).

    Raises:
        CheckpointError: invalid JSON or an unreadable config, prefixed by ``source``.
        SpecError: the config declares something unsupported.
    """
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


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, overwrite: bool):
    """Yield a fresh temporary sibling of ``out_dir``; rename it into place on success.

    On any error the temporary directory is removed, so nothing half-written remains.

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
            if old.is_symlink():  # a DST that was a link: the link was replaced, its target is left alone
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:
        raise CheckpointError(f"could not write {out}: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def asset_files(src: Path, *, patterns: Iterable[str] = HF_ASSET_PATTERNS, exclude: Iterable[str] = ()) -> list[Path]:
    """The files of ``src`` whose names match one of ``patterns`` (default :data:`HF_ASSET_PATTERNS`) and
    are not in ``exclude``, sorted by name; none when ``src`` is not a directory."""
    if not src.is_dir():
        return []
    patterns, skip = tuple(patterns), set(exclude)
    return [f for f in sorted(src.iterdir())
            if f.is_file() and f.name not in skip and any(fnmatch.fnmatch(f.name, p) for p in patterns)]


def copy_assets(src: Path, dst: Path, *, patterns: Iterable[str] = HF_ASSET_PATTERNS,
                exclude: Iterable[str] = ()) -> list[str]:
    """Copy the tokenizer / generation files of ``src`` into ``dst`` (:func:`asset_files`).

    Args:
        src: a Hugging Face directory (nothing is copied when it is not a directory).
        dst: the directory to copy into (created when a file is copied).
        patterns: the file-name patterns to copy (default :data:`HF_ASSET_PATTERNS`).
        exclude: file names not to copy although they match a pattern.

    Returns:
        The names of the files copied, sorted.
    """
    copied = []
    for f in asset_files(src, patterns=patterns, exclude=exclude):
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


def write_torch_dcp(ckpt_dir: Path, tensors: Mapping[str, torch.Tensor], common: dict) -> None:
    """The 0.16 ``torch_dist`` layout through PyTorch DCP, no Megatron and no CUDA needed.

    Args:
        ckpt_dir: an existing empty directory.
        tensors: ``{ShardedTensor key: whole tensor}`` (copied to CPU).
        common: the common state, saved as ``common.pt``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    flat = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    dcp.save(flat, storage_writer=FileSystemWriter(str(ckpt_dir)),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, ckpt_dir / "common.pt")
    (ckpt_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))


def common_entry(spec: ModelSpec, text: str, *, writer: str,
                 digests: Mapping[str, str] | None = None, **extra: Any) -> dict:
    """The ``common[COMMON_KEY]`` entry that marks a unified_models checkpoint.

    Args:
        spec: the model; text: its ``config.json`` text.
        writer: ``"megatron"`` / ``"torch_dcp"`` / ``"megatron_cpu"`` (recorded only).
        digests: ``{HF name: SHA-256}`` of the model tensors (optional).
        **extra: further plain fields (e.g. ``training=True``).
    """
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "family": spec.family,
            "architecture": spec.architecture, "hf_config_json": text, "writer": writer,
            "sha256": dict(digests or {}), **extra}


def parse_common_entry(common: Any, source: str) -> dict:
    """Validate the common state of a checkpoint and return its :data:`COMMON_KEY` entry.

    Raises:
        CheckpointError: not written by unified_models, an unsupported format
            version, or no stored Hugging Face config.
    """
    entry = common.get(COMMON_KEY) if isinstance(common, dict) else None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT_NAME:
        keys = sorted(map(str, common)) if isinstance(common, dict) else type(common).__name__
        raise CheckpointError(f"{source} was not written by unified_models: its common state has no "
                              f"{COMMON_KEY!r} entry of format {FORMAT_NAME!r} (common keys: {keys})")
    if entry.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{source}: format version {entry.get('version')!r} is not supported "
                              f"(expected {FORMAT_VERSION})")
    if not isinstance(entry.get("hf_config_json"), str):
        if entry.get("training"):
            raise CheckpointError(
                f"{source} is a training checkpoint saved without a Hugging Face config (what `rl --save` wrote "
                "for a quantized model's masters before unified_models recorded their config), so it cannot be "
                "converted; it still resumes: `rl --resume` it with this version and `--save` again for a "
                "checkpoint that converts")
        raise CheckpointError(f"{source}: the stored Hugging Face config is missing")
    if entry.get(RECIPE_KEY) is not None and not isinstance(entry[RECIPE_KEY], dict):
        raise CheckpointError(f"{source}: the stored quantization recipe is malformed "
                              f"({type(entry[RECIPE_KEY]).__name__}, not a dict)")
    stored_digests(entry, source)
    return entry


def stored_digests(entry: Mapping[str, Any], source: str, field: str = "sha256") -> dict[str, str]:
    """The ``{name: SHA-256}`` table of a checkpoint's entry (empty when it stores none): the model
    tensors' (``sha256``) or, in a training checkpoint, the optimizer state's (``optimizer_sha256``).

    Raises:
        CheckpointError: the table is not a dict of strings.
    """
    digests = entry.get(field) or {}
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        what = "optimizer state" if field != "sha256" else "tensor"
        raise CheckpointError(f"{source}: the stored {what} digests are malformed")
    return digests


def common_state_error(ckpt_dir: str | os.PathLike, e: BaseException, what: str = "common state") -> CheckpointError:
    """The error for a checkpoint whose common (non-tensor) state could not be read.

    A missing ``common.pt`` is named as such (megatron-core 0.16 then fails with an
    unrelated ``AttributeError`` while listing the directory for its log message);
    otherwise the reader's own error is quoted.
    """
    d = Path(ckpt_dir)
    if not (d / "common.pt").is_file():
        import megatron.core as mcore  # only called after a Megatron reader failed

        return CheckpointError(
            f"Megatron checkpoint {d} is incomplete: common.pt (the non-tensor state: format tag and stored "
            f"config.json) is missing, and megatron-core {getattr(mcore, '__version__', '?')} found no common "
            "state inside the DCP files either (0.19's own save keeps it there; 0.16 reads only common.pt); "
            "copy the checkpoint again or convert it again from its source")
    return CheckpointError(f"{d}: {what} (common.pt) is unreadable: {describe_error(e)}")


def check_layout_files(ckpt_dir: str | os.PathLike) -> Path:
    """File-level checks of a ``torch_dist`` checkpoint directory (no tensor data read).

    Returns:
        The directory as a ``Path``.

    Raises:
        CheckpointError: missing directory, no/invalid ``metadata.json``, another
            backend than ``torch_dist``, or no DCP index ``.metadata``.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise CheckpointError(f"Megatron checkpoint directory {d} does not exist")
    meta_json = d / "metadata.json"
    if not meta_json.is_file():
        tracker = d / "latest_checkpointed_iteration.txt"
        if tracker.is_file():
            latest = tracker.read_text().strip()
            hint = (f"; it is a training checkpoint root ({tracker.name} names step {latest[:20]!r}): pass one of "
                    f"its iter_* directories, e.g. {d / ('iter_' + latest.zfill(7))}" if latest.isdigit()
                    else f"; it is a training checkpoint root: pass one of its iter_* directories")
            raise CheckpointError(f"{d} is not a Megatron distributed checkpoint: metadata.json is missing{hint}")
        raise CheckpointError(f"{d} is not a Megatron distributed checkpoint: metadata.json is missing")
    try:
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_json} is not a valid checkpoint metadata file: {e}") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{meta_json}: sharded_backend={backend!r}; only 'torch_dist' checkpoints are supported")
    if not (d / ".metadata").is_file():
        raise CheckpointError(f"{d} is incomplete: the DCP index file .metadata is missing")
    return d
