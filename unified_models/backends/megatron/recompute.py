"""Trainer-side recompute of rollout logprobs: THD packing and the one-shot wrapper.

Sequences (prompt + sampled completion) are packed into THD micro-batches
(:func:`pack_sequences`) and run through :class:`UnifiedMegatronModel` under
Megatron's parallel state (TP=1) by :class:`~.trainer.Trainer`; the logprob of
every sampled token is read from the same logprob op vLLM used.
:func:`unified_models.backends.megatron.trainer.recompute_logprobs` builds a trainer, recomputes once and
closes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np
import torch

from ...dsl import ModelSpec
from ...ops._dispatch import host_to_device


@dataclass
class RecomputeResult:
    """``logprobs[i]``: fp32 ``[len(completions[i])]``; ``full_rows[(i, pos)]``: fp32 ``[V]``."""

    logprobs: list[torch.Tensor]
    full_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing of sequence indices (in order) into batches of <= max_tokens tokens."""
    batches, cur, cur_tokens = [], [], 0
    for i, n in enumerate(lengths):
        if cur and cur_tokens + n > max_tokens:
            batches.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        batches.append(cur)
    return batches


@dataclass
class MicroBatch:
    """One THD micro-batch of whole sequences.

    Attributes:
        seqs: the packed sequence indices, in order.
        input_ids: ``[T]`` int64 prompt + completion tokens of every sequence, concatenated.
        cu_seqlens: ``[B+1]`` int32 sequence boundaries.
        rows: ``[R]`` int64 flat index of the hidden state that scores each completion token
            (completion token ``j`` of a sequence starting at ``start``: ``start + len(prompt) - 1 + j``).
        flat: the rows' slice of the whole batch's flat token order (sequence after sequence).
        completion_lengths: ``len(completion)`` of each of ``seqs`` (host ints; they sum to ``R``).
        owners: ``(sequence, completion token j)`` of each row, a list of ``R`` tuples (built from
            ``seqs`` and ``completion_lengths`` on first use and cached, not stored at construction);
            its position is ``len(prompt) - 1 + j``.
    """

    seqs: list[int]
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    flat: slice
    completion_lengths: list[int]

    @cached_property
    def owners(self) -> list[tuple[int, int]]:
        return [(s, j) for s, n in zip(self.seqs, self.completion_lengths) for j in range(n)]


def _host_ids(x: Sequence[int] | np.ndarray | torch.Tensor, what: str) -> np.ndarray:
    """``[n]`` int64 host array of a sequence of token ids (list, tuple, numpy array or torch tensor).

    Raises:
        ValueError: ``x`` is not 1-D, holds non-integer values (floats are never truncated into ids)
            or ids outside int64; ``what`` names it in the message.
    """
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{what}: token ids must be 1-D, got shape {list(a.shape)}")
    if a.size and a.dtype.kind not in "iub":
        raise ValueError(f"{what}: token ids must be integers, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: token id {int(a.max())} does not fit in int64")
    return a.astype(np.int64).reshape(-1)


def pack_sequences(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_tokens: int,
                   device: str | torch.device) -> list[MicroBatch]:
    """Greedy in-order packing into micro-batches of <= ``max_tokens`` tokens (one sequence may exceed it alone).

    Packing never changes a bit (each row depends only on its own sequence). Each micro-batch's
    layout is worked out on the host in numpy and its three tensors go to ``device`` by
    :func:`~unified_models.ops._dispatch.host_to_device` (pinned, non-blocking on a GPU).

    Args:
        prompt_ids, completions: token ids per sequence (lists, tuples, numpy arrays or torch
            tensors of ints).
        max_tokens: micro-batch size in tokens (:func:`micro_batches`).
        device: where the micro-batches' tensors live.

    Returns:
        The micro-batches (:class:`MicroBatch`) in order: ``input_ids`` int64 ``[T]``, ``cu_seqlens`` int32
        ``[B+1]``, ``rows`` int64 ``[R]`` on ``device``.

    Raises:
        ValueError: lengths of ``prompt_ids`` and ``completions`` differ; a sequence's ids are not a
            1-D run of integers (floats are refused, not truncated); a completion follows an empty
            prompt (nothing scores its first token); a micro-batch past 2^31 - 1 tokens.
    """
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    dev = torch.device(device)
    ps = [_host_ids(p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
    cs = [_host_ids(c, f"completion {i}") for i, c in enumerate(completions)]
    p_len = np.array([len(p) for p in ps], dtype=np.int64)
    c_len = np.array([len(c) for c in cs], dtype=np.int64)
    no_prompt = np.flatnonzero((p_len == 0) & (c_len > 0))
    if no_prompt.size:  # completion token 0 is scored by the hidden state of the prompt's last token
        raise ValueError(f"sequence {int(no_prompt[0])} has a completion but an empty prompt")
    out, flat = [], 0
    for seqs in micro_batches((p_len + c_len).tolist(), max_tokens):
        pl, cl = p_len[seqs], c_len[seqs]
        ids = np.concatenate([a for s in seqs for a in (ps[s], cs[s])])
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(pl + cl, out=cu[1:])
        if cu[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"a micro-batch of {int(cu[-1])} tokens does not fit int32 cu_seqlens")
        # completion token j of sequence b: cu[b] + pl[b] - 1 + j, with j = k - (completion tokens before b)
        c_before = np.cumsum(cl) - cl
        n_rows = int(cl.sum())
        rows = np.repeat(cu[:-1] + pl - 1 - c_before, cl) + np.arange(n_rows, dtype=np.int64)
        out.append(MicroBatch(seqs=list(seqs), input_ids=host_to_device(torch.from_numpy(ids), dev),
                              cu_seqlens=host_to_device(torch.from_numpy(cu.astype(np.int32)), dev),
                              rows=host_to_device(torch.from_numpy(rows), dev), flat=slice(flat, flat + n_rows),
                              completion_lengths=cl.tolist()))
        flat += n_rows
    return out
