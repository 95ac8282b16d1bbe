"""Diff metrics between rollout and trainer logprobs, and their report."""

from .metrics import LogprobDiff, compare_logprobs

__all__ = ["LogprobDiff", "compare_logprobs"]
