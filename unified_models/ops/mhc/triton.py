"""Triton kernels of mHC: NOT WRITTEN YET.

The GPU path needs three kernels with the CPU path's rounding points and fixed orders
(:mod:`.cpu`): ``hc_pre`` (row RMS of the flattened streams, the ``[M, n D]`` projection
with fp32 accumulation in a fixed tile order and no split-K, sigmoid / softmax / Sinkhorn
per row in registers, the weighted collapse), ``hc_post`` and ``hc_head``. Until then every
entry point here raises, so a CUDA tensor never falls back silently to another path.
"""

from __future__ import annotations


def _missing(op: str):
    raise NotImplementedError(
        f"mhc.{op}: no Triton kernel yet (unified_models/ops/mhc/triton.py); mHC runs only on CPU tensors "
        f"(the batch-invariant path of ops/mhc/cpu.py) until the {op} kernel is written")


def hc_pre_triton(*args, **kwargs):
    """Raises :class:`NotImplementedError` (kernel not written)."""
    _missing("hc_pre")


def hc_post_triton(*args, **kwargs):
    """Raises :class:`NotImplementedError` (kernel not written)."""
    _missing("hc_post")


def hc_head_triton(*args, **kwargs):
    """Raises :class:`NotImplementedError` (kernel not written)."""
    _missing("hc_head")
