"""Writing a safetensors file: safetensors' ``save_file`` with the file mode any file this process creates."""

from __future__ import annotations

import os
from typing import Mapping

import torch
from safetensors.torch import save_file


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file`` (contiguous tensors), then the file's mode that of any file this process
    creates (``0o666`` less the umask): ``save_file`` itself writes ``0o600``, so a checkpoint written for
    a team (or read by a serving process of another user) could not be read.

    Raises:
        As ``safetensors.torch.save_file`` (e.g. non-contiguous tensors) and ``OSError``.
    """
    save_file(dict(tensors), str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
