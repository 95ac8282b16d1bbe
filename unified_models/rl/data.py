"""Prompt rows for RL and the deterministic per-step prompt schedule.

A prompt file is the JSONL that ``check`` reads (:func:`unified_models.prompts.load_prompt_texts`:
one of ``prompt`` / ``question`` / ``problem`` / ``text`` per row); for rewards
that need a reference (``gsm8k``) every row must also carry ``answer``.

The schedule depends only on ``(seed, step)``, never on what ran before, so a
run resumed at step k draws the same prompts as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..dsl import PromptError
from ..prompts import load_prompt_texts

__all__ = ["PromptRow", "load_prompt_rows", "prompts_for_step", "request_seed"]


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its text, its reference answer (``answer`` field, or None) and its 1-based line."""

    text: str
    answer: str | None
    line: int


def load_prompt_rows(path: str | os.PathLike, *, need_answer: bool = False) -> list[PromptRow]:
    """Read every prompt of ``path`` with its ``answer``.

    Raises:
        PromptError: as :func:`load_prompt_texts`; with ``need_answer``, a row
            without a string ``answer`` (the message names the line).
    """
    texts = load_prompt_texts(path)  # validates the file and every prompt
    rows: list[PromptRow] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            answer = obj.get("answer") if isinstance(obj, dict) else None
            if answer is not None and not isinstance(answer, str):
                answer = str(answer)
            if need_answer and not (answer and answer.strip()):
                raise PromptError(f"{path}:{lineno}: no 'answer' field; this reward compares against the "
                                  "reference answer of every row (GSM8K format: '... #### 42')")
            rows.append(PromptRow(text=texts[len(rows)], answer=answer, line=lineno))
    return rows


def prompts_for_step(num_rows: int, per_step: int, seed: int, step: int) -> list[int]:
    """Row indices of the prompts of ``step`` (1-based).

    Rows are visited in epochs; epoch ``e`` is a permutation drawn from
    ``numpy.random.default_rng([seed, e])``, and step ``k`` takes the ``per_step``
    entries starting at ``(k - 1) * per_step`` of the concatenated epochs.

    Raises:
        ValueError: ``per_step`` not in ``[1, num_rows]`` or ``step < 1``.
    """
    if not 1 <= per_step <= num_rows:
        raise ValueError(f"{per_step} prompts per step from {num_rows} prompt rows")
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    start = (step - 1) * per_step
    out = []
    for flat in range(start, start + per_step):
        epoch, i = divmod(flat, num_rows)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(num_rows)[i]))
    return out


def request_seed(seed: int, step: int, sequence: int) -> int:
    """The ``SamplingParams.seed`` of sequence ``sequence`` of ``step``: a 32-bit value from
    ``numpy.random.SeedSequence([seed, step, sequence])``, independent of the batch and of
    every other request."""
    return int(np.random.SeedSequence([seed, step, sequence]).generate_state(1, dtype=np.uint32)[0])
