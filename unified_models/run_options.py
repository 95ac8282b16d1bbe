"""Option checks shared by the commands (`check`, `rl`): device choice and output paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch

from .dsl import UnifiedModelsError


def resolve_device(opt: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is present, else ``cpu``.

    Raises:
        UnifiedModelsError: ``cuda`` requested without a CUDA device.
    """
    if opt == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if opt == "cuda" and not torch.cuda.is_available():
        raise UnifiedModelsError("--device cuda requested but no CUDA device is available")
    return opt


def check_output_path(flag: str, path: Path, inputs: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Fail before any work if ``path`` (given by ``flag``) cannot be written, or would overwrite an input.

    Args:
        flag: the CLI flag naming ``path``.
        path: the output file.
        inputs: the run's inputs by flag (files or directories; None: not given): the output may be none
            of them and lie inside none of the directories (compared as real paths, symlinks followed).

    Raises:
        UnifiedModelsError: ``path`` is a directory, a parent is a file, the nearest existing parent is
            not writable, or ``path`` is (or lies inside) one of ``inputs``.
    """
    if path.exists() and path.is_dir():
        raise UnifiedModelsError(f"{flag} {path} is a directory")
    out = Path(os.path.realpath(path))
    for name, src in (inputs or {}).items():
        if src is None:
            continue
        s = Path(os.path.realpath(src))
        if out == s or (s.is_dir() and out.is_relative_to(s)):
            where = "is" if out == s else "lies inside"
            raise UnifiedModelsError(f"{flag} {path} {where} {name} {src}, an input of this run: writing it would "
                                     f"change the input; choose another {flag}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UnifiedModelsError(f"{flag} {path}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise UnifiedModelsError(f"{flag} {path}: {parent} is not writable")
            return


def tokenizer_dir_for(model_dir: Path, explicit: str | None) -> Path:
    """The tokenizer directory a command uses: ``explicit`` (``--tokenizer``) if given, else
    ``model_dir`` when it holds ``tokenizer.json`` or ``tokenizer_config.json``, else the
    bundled Phi-3 tokenizer (:func:`unified_models.presets.tokenizer_dir`)."""
    from .presets import tokenizer_dir

    if explicit:
        return Path(explicit)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return model_dir
    return tokenizer_dir()
