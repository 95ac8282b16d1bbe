"""Trainer-side recompute of rollout logprobs (the ``check`` and RL path).

Sequences (prompt + sampled completion) are packed into THD micro-batches and
run through :class:`UnifiedMegatronModel` under Megatron's parallel state
(TP=1); the logprob of every sampled token is read from the same logprob op
vLLM used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

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


@torch.no_grad()
def recompute_logprobs(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], prompt_ids: list[list[int]],
                       completions: list[list[int]], *, device: str = "cpu", temperature: float = 1.0,
                       full_rows_for: list[tuple[int, int]] | None = None,
                       max_tokens_per_batch: int | None = None) -> RecomputeResult:
    """Logprob of every sampled token, recomputed by the Megatron module.

    Args:
        spec, state_dict: the model and its HF-named weights (the rollout's weights).
        prompt_ids, completions: token ids per sequence.
        device: ``"cpu"`` or ``"cuda"``.
        temperature: as in the rollout.
        full_rows_for: ``(sequence index, position)`` keys whose whole row to return.
        max_tokens_per_batch: THD micro-batch size (default 4096 CPU / 32768 GPU).
            Packing never changes a bit (each row depends only on its own sequence).

    Returns:
        :class:`RecomputeResult`.

    Raises:
        ValueError: lengths of ``prompt_ids`` and ``completions`` differ.
    """
    from .module import UnifiedMegatronModel, transformer_config_from_spec
    from .parallel import init_parallel_state

    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    init_parallel_state(tp=1)
    model = UnifiedMegatronModel(spec, transformer_config_from_spec(spec, perform_initialization=False),
                                 device=device)
    model.load_hf_state_dict(state_dict)
    model.eval()
    wanted = set(full_rows_for or [])
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completions)]
    limit = max_tokens_per_batch or (32768 if device == "cuda" else 4096)
    out: list[torch.Tensor | None] = [None] * len(seqs)
    full: dict[tuple[int, int], torch.Tensor] = {}
    for batch in micro_batches([len(s) for s in seqs], limit):
        ids = torch.tensor([t for i in batch for t in seqs[i]], dtype=torch.long, device=device)
        lens = torch.tensor([len(seqs[i]) for i in batch])
        cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        rows, owners = [], []
        for b, i in enumerate(batch):
            start, p = int(cu[b]), len(prompt_ids[i])
            for j in range(len(completions[i])):
                rows.append(start + p - 1 + j)
                owners.append((i, p - 1 + j))
        if not rows:
            for i in batch:
                out[i] = torch.zeros(0)
            continue
        need_full = any(k in wanted for k in owners)
        res = model.token_logprobs(ids, cu.to(device), torch.tensor(rows, device=device), temperature,
                                   return_full=need_full)
        tok, rows_full = (res if need_full else (res, None))
        tok = tok.cpu()
        k = 0
        for i in batch:
            n = len(completions[i])
            out[i] = tok[k:k + n]
            k += n
        if rows_full is not None:
            for r, key in enumerate(owners):
                if key in wanted:
                    full[key] = rows_full[r].cpu()
    return RecomputeResult(logprobs=out, full_rows=full)
