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
from typing import Mapping, Sequence

import torch

from ...dsl import ModelSpec


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
        input_ids: ``[T]`` prompt + completion tokens of every sequence, concatenated.
        cu_seqlens: ``[B+1]`` int32 sequence boundaries.
        rows: ``[R]`` the flat index of the hidden state that scores each completion token.
        owners: ``(sequence, completion token j)`` of each row; its position is
            ``len(prompt) - 1 + j``.
        flat: the rows' slice of the whole batch's flat token order (sequence after sequence).
    """

    seqs: list[int]
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    owners: list[tuple[int, int]]
    flat: slice


def pack_sequences(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_tokens: int,
                   device: str | torch.device) -> list[MicroBatch]:
    """Greedy in-order packing into micro-batches of <= ``max_tokens`` tokens (one sequence may exceed it alone).

    Packing never changes a bit (each row depends only on its own sequence).

    Raises:
        ValueError: lengths of ``prompt_ids`` and ``completions`` differ.
    """
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    groups = micro_batches([len(p) + len(c) for p, c in zip(prompt_ids, completions)], max_tokens)
    out, flat = [], 0
    for seqs in groups:
        ids, cu, rows, owners = [], [0], [], []
        for s in seqs:
            p, c = prompt_ids[s], completions[s]
            start = len(ids)
            ids += list(p) + list(c)
            cu.append(len(ids))
            for j in range(len(c)):
                rows.append(start + len(p) - 1 + j)
                owners.append((s, j))
        out.append(MicroBatch(seqs=list(seqs), input_ids=torch.tensor(ids, dtype=torch.long, device=device),
                              cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                              rows=torch.tensor(rows, dtype=torch.long, device=device), owners=owners,
                              flat=slice(flat, flat + len(rows))))
        flat += len(rows)
    return out
