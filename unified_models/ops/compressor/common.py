"""What the ``compress_pool`` dispatcher and kernel share: the argument checks."""

from __future__ import annotations

import torch


def check_pool_args(op: str, kv_ENC: torch.Tensor, score_ENC: torch.Tensor) -> tuple[int, int, int]:
    """Raise ``ValueError`` unless kv and score are fp32 ``[E, N, C]`` of one shape with ``N >= 1``
    on one device; return ``(E, N, C)``."""
    for what, t in (("kv", kv_ENC), ("score", score_ENC)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {what} must be a 3-D [E, N, C] tensor (entries, candidates, channels), "
                             f"got {shape}")
        if t.dtype != torch.float32:
            raise ValueError(f"{op}: {what} must be float32 (the compressor's fp32 rows), got {t.dtype}")
    if kv_ENC.shape != score_ENC.shape:
        raise ValueError(f"{op}: kv {tuple(kv_ENC.shape)} and score {tuple(score_ENC.shape)} must have the same "
                         "[E, N, C] shape")
    if kv_ENC.shape[1] < 1:
        raise ValueError(f"{op}: an entry needs at least one candidate (N >= 1), got kv {tuple(kv_ENC.shape)}")
    if kv_ENC.device != score_ENC.device:
        raise ValueError(f"{op}: kv on {kv_ENC.device} and score on {score_ENC.device}")
    return tuple(kv_ENC.shape)
