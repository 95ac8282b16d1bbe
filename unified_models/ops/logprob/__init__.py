"""Logprob op: ``log_softmax(logits / temperature)`` over the vocabulary in fp32.

DESIGN.md rule 9. The vLLM model class returns these values from
``compute_logits`` (with ``logprobs_mode="raw_logits"`` vLLM only gathers them),
and the trainer calls the same op, so both sides hold the same bits.
Temperature is one IEEE fp32 division per element on both sides.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports.
"""

from .cpu import VOCAB_SEGMENT_CPU, logprobs_torch
from .dispatch import gather_token_logprobs, logprobs
from .reference import logprobs_reference

__all__ = ["logprobs", "gather_token_logprobs", "logprobs_torch", "VOCAB_SEGMENT_CPU", "logprobs_reference"]
