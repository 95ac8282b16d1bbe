"""Prompt files (JSONL) -> token ids, with the tokenizer's chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .dsl import PromptError

TEXT_FIELDS = ("prompt", "question", "problem", "text")


def load_prompt_texts(path: str | os.PathLike, num_prompts: int | None = None) -> list[str]:
    """Read prompt strings from a JSONL file.

    Each line is a JSON object with one of the fields ``prompt``, ``question``,
    ``problem`` or ``text`` (first found wins), or a JSON string.

    Raises:
        PromptError: file missing, empty, a line that is not JSON, a row without
            a text field, an empty prompt, or ``num_prompts`` > rows available.
    """
    p = Path(path)
    if not p.is_file():
        raise PromptError(f"prompt file {p} does not exist")
    texts: list[str] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(row, str):
                text = row
            elif isinstance(row, dict):
                field = next((k for k in TEXT_FIELDS if k in row), None)
                if field is None:
                    raise PromptError(f"{p}:{lineno}: no text field; expected one of {TEXT_FIELDS}")
                text = row[field]
            else:
                raise PromptError(f"{p}:{lineno}: expected a JSON object or string")
            if not isinstance(text, str):
                raise PromptError(f"{p}:{lineno}: the prompt must be a string, got {type(text).__name__}")
            if not text.strip():
                raise PromptError(f"{p}:{lineno}: empty prompt")
            texts.append(text)
            if num_prompts is not None and len(texts) >= num_prompts:
                break
    if not texts:
        raise PromptError(f"prompt file {p} holds no prompts")
    if num_prompts is not None and len(texts) < num_prompts:
        raise PromptError(f"prompt file {p} holds {len(texts)} prompts, {num_prompts} requested")
    return texts


def tokenize_prompts(texts: list[str], tokenizer_dir: str | os.PathLike, *, vocab_size: int,
                     max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Apply the tokenizer's chat template (if it has one) and encode.

    Raises:
        PromptError: the tokenizer cannot be loaded, an id is outside the
            model vocabulary, or a prompt is longer than ``max_prompt_tokens``.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise PromptError(f"cannot load a tokenizer from {tokenizer_dir}: {e}") from None
    out = []
    for i, text in enumerate(texts):
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        ids = [int(x) for x in ids]
        if not ids:
            raise PromptError(f"prompt {i} tokenizes to nothing")
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            raise PromptError(f"prompt {i}: token ids {bad[:5]} are outside the model vocabulary ({vocab_size})")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise PromptError(f"prompt {i} has {len(ids)} tokens, more than the limit {max_prompt_tokens}")
        out.append(ids)
    return out
