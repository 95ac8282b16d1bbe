"""Prompt files (JSONL) -> token ids, with the tokenizer's chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .dsl import PromptError

TEXT_FIELDS = ("prompt", "question", "problem", "text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""A tokenizer directory holds at least one of these (Hugging Face tokenizer files)."""


def load_prompt_texts(path: str | os.PathLike, num_prompts: int | None = None) -> list[str]:
    """Read prompt strings from a JSONL file.

    Each line is a JSON object with one of the fields ``prompt``, ``question``,
    ``problem`` or ``text`` (first found wins), or a JSON string.

    Raises:
        PromptError: file missing (or a directory), empty, a line that is not
            UTF-8 or not JSON, a row without a text field, an empty prompt, a
            prompt that is not valid Unicode (a lone surrogate escape), or
            ``num_prompts`` > rows available.
    """
    p = Path(path)
    if not p.exists():
        raise PromptError(f"prompt file {p} does not exist")
    if not p.is_file():
        raise PromptError(f"prompt file {p} is not a file")
    texts: list[str] = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptError(f"{p}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                                  ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
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
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PromptError(f"{p}:{lineno}: the prompt is not valid Unicode ({e.reason} at character "
                                  f"{e.start})") from None
            texts.append(text)
            if num_prompts is not None and len(texts) >= num_prompts:
                break
    if not texts:
        raise PromptError(f"prompt file {p} holds no prompts")
    if num_prompts is not None and len(texts) < num_prompts:
        raise PromptError(f"prompt file {p} holds {len(texts)} prompts, {num_prompts} requested")
    return texts


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    """``AutoTokenizer.from_pretrained(tokenizer_dir)``; when that fails on the directory's model config
    (a checkpoint's ``config.json`` that transformers' config class cannot read, e.g. DeepSeek's
    published DeepSeek-V4 layout with an HCA ratio other than 128), loaded again with the config
    our loader reads from it (:func:`unified_models.converters.hf_safetensors.load_hf_config`), so the
    tokenizer is configured exactly as next to the transformers-layout config.

    Raises:
        PromptError: neither load works (the first error, named with the directory).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, KeyError, TypeError) as first:
        try:
            from .converters.hf_safetensors import load_hf_config

            return AutoTokenizer.from_pretrained(str(tokenizer_dir), config=load_hf_config(tokenizer_dir))
        except Exception:  # noqa: BLE001 - the first error is the one to report
            raise PromptError(f"cannot load a tokenizer from {tokenizer_dir}: {type(first).__name__}: "
                              f"{first}") from None


def tokenize_prompts(texts: list[str], tokenizer_dir: str | os.PathLike, *, vocab_size: int,
                     max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Apply the tokenizer's chat template (if it has one) and encode.

    Raises:
        PromptError: the tokenizer directory is missing or holds no tokenizer
            files (:data:`TOKENIZER_FILES`), the tokenizer cannot be loaded, an id is outside the
            model vocabulary, or a prompt is longer than ``max_prompt_tokens``.
    """
    d = Path(tokenizer_dir)
    if not d.exists():
        raise PromptError(f"tokenizer directory {d} does not exist")
    if not d.is_dir():
        raise PromptError(f"tokenizer directory {d} is not a directory")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise PromptError(f"tokenizer directory {d} holds none of {TOKENIZER_FILES}")
    tok = load_tokenizer(d)
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
