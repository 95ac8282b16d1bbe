"""Which implementation of an op runs for a given tensor.

* CUDA tensors always run the Triton kernels (fixed tiles, no autotuning).
* CPU tensors run the plain-torch implementation that is batch-invariant by
  construction (fixed row tiles, fixed shapes per torch call), because the
  Triton interpreter is too slow for whole engines on two cores (DESIGN.md,
  "Known facts"). Both engines on one device call the same implementation.
* ``UM_OPS_BACKEND=triton`` forces the Triton kernels on CPU too (through
  the interpreter; requires ``TRITON_INTERPRET=1`` at import time). The op
  tests use this to exercise the kernel source in CI.
"""

from __future__ import annotations

import os

import torch

ROW_TILE = 16
"""Rows per torch call in the CPU implementations (tokens are padded to it)."""


def use_triton(x: torch.Tensor) -> bool:
    """True when ``x``'s op should run the Triton kernel (CUDA, or forced)."""
    if x.is_cuda:
        return True
    return os.environ.get("UM_OPS_BACKEND", "torch") == "triton"


def host_to_device(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host tensor ``x`` on ``dev`` without waiting for the stream: on a GPU through pinned memory and a
    non-blocking copy (a blocking copy from pageable memory waits for every queued kernel); on the
    CPU ``x.to(dev)``."""
    if dev.type == "cpu":
        return x.to(dev)
    return x.pin_memory().to(dev, non_blocking=True)


def pad_rows(x: torch.Tensor, multiple: int = ROW_TILE) -> torch.Tensor:
    """Pad dim 0 of ``x`` with zeros up to a multiple of ``multiple``."""
    t = x.shape[0]
    pad = (-t) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))], dim=0)


def map_row_tiles(fn, *xs: torch.Tensor, rows: int = ROW_TILE) -> torch.Tensor:
    """Apply ``fn`` to fixed-size row tiles of ``xs`` and concatenate.

    Every call of ``fn`` sees tensors of exactly ``rows`` rows, whatever the
    batch, so the torch/BLAS kernel (and its thread partition) chosen for a
    row never depends on how many other rows there are. Rows past the end are
    zero padding and are dropped.
    """
    t = xs[0].shape[0]
    padded = [pad_rows(x, rows) for x in xs]
    outs = [fn(*(p[i:i + rows] for p in padded)) for i in range(0, max(t, 1) if t else 0, rows)]
    if not outs:
        probe = fn(*(p.new_zeros((rows, *p.shape[1:])) for p in padded))
        return probe[:0]
    return torch.cat(outs, dim=0)[:t]
