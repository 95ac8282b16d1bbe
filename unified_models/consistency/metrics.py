"""Rollout-vs-trainer logprob diff metrics.

``k3`` is Schulman's low-variance KL estimator (http://joschu.net/blog/kl-approx.html):
for tokens sampled from the rollout policy q and trainer policy p,
``r = exp(logp_trainer - logp_rollout)``, ``k3 = mean((r - 1) - log r)`` >= 0,
an unbiased estimate of KL(q || p). It is exactly 0 when the logprobs are equal.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class LogprobDiff:
    """Diff statistics over sampled tokens (all in nats, computed in fp64)."""

    tokens_compared: int
    max_abs_diff: float
    mean_abs_diff: float
    std_abs_diff: float
    k3_kl: float
    num_mismatched: int

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def bitwise_equal(self) -> bool:
        return self.num_mismatched == 0 and self.max_abs_diff == 0.0


def compare_logprobs(rollout: torch.Tensor, trainer: torch.Tensor) -> LogprobDiff:
    """Compare per-token logprobs of the sampled tokens.

    Args:
        rollout: fp32 ``[N]`` logprobs the sampler reported.
        trainer: fp32 ``[N]`` logprobs the trainer recomputed, same order.

    Returns:
        :class:`LogprobDiff`; ``num_mismatched`` counts tokens whose fp32 bits differ.

    Raises:
        ValueError: shapes differ or N == 0.
    """
    if rollout.shape != trainer.shape or rollout.dim() != 1:
        raise ValueError(f"compare_logprobs: shapes {tuple(rollout.shape)} and {tuple(trainer.shape)} differ")
    if rollout.numel() == 0:
        raise ValueError("compare_logprobs: no tokens to compare")
    a, b = rollout.double(), trainer.double()
    d = (a - b).abs()
    log_r = b - a
    k3 = (torch.expm1(log_r) - log_r).mean()
    mismatched = int((rollout.float().view(torch.int32) != trainer.float().view(torch.int32)).sum())
    return LogprobDiff(
        tokens_compared=int(d.numel()),
        max_abs_diff=float(d.max()),
        mean_abs_diff=float(d.mean()),
        std_abs_diff=float(d.std(unbiased=False)),
        k3_kl=float(k3),
        num_mismatched=mismatched,
    )


def full_vocab_max_abs_diff(rollout_rows, trainer_rows, *, chunk_rows: int = 256) -> float:
    """Max |Δ| over whole logprob rows (fp64); ``-inf`` entries must match.

    Args:
        rollout_rows, trainer_rows: ``[N, V]`` tensors, or sequences of N ``[V]``
            rows (compared pairwise without stacking them all: 16,384 rows of a
            131,072-token vocabulary are 8.6 GB per side in fp32).
        chunk_rows: rows converted to fp64 at a time (memory bound only; the
            result is a max, independent of the chunking).

    Raises:
        ValueError: shapes or row counts differ.
    """
    n = len(rollout_rows)
    if n != len(trainer_rows):
        raise ValueError(f"full-vocab rows: {n} vs {len(trainer_rows)}")
    worst = 0.0
    for i in range(0, n, chunk_rows):
        ra, rb = rollout_rows[i:i + chunk_rows], trainer_rows[i:i + chunk_rows]
        a = (ra if isinstance(ra, torch.Tensor) else torch.stack(list(ra))).double()
        b = (rb if isinstance(rb, torch.Tensor) else torch.stack(list(rb))).to(a.device).double()
        if a.shape != b.shape:
            raise ValueError(f"full-vocab rows {tuple(a.shape)} vs {tuple(b.shape)} (rows {i}..)")
        if a.numel() == 0:
            continue
        same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
        d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
        worst = max(worst, float(d.max()))
    return worst


def rollout_digest(completions: list[list[int]], logprobs: torch.Tensor) -> str:
    """SHA-256 fingerprint of a rollout: every sampled token id and the bits of its logprob.

    Two runs with equal digests sampled the same tokens with bitwise-equal
    logprobs (used to show that a run does not depend on the host's BLAS
    kernels or thread count).

    Args:
        completions: per sequence, the sampled token ids (in order).
        logprobs: fp32 ``[N]`` logprobs of those tokens, concatenated in the same order.

    Raises:
        ValueError: ``logprobs`` does not have one entry per sampled token.
    """
    n = sum(len(c) for c in completions)
    if logprobs.shape != (n,):
        raise ValueError(f"rollout_digest: {tuple(logprobs.shape)} logprobs for {n} sampled tokens")
    h = hashlib.sha256()
    for c in completions:
        h.update(torch.tensor(c, dtype=torch.int64).numpy().tobytes())
        h.update(b"|")
    h.update(logprobs.float().contiguous().view(torch.int32).numpy().tobytes())
    return h.hexdigest()
