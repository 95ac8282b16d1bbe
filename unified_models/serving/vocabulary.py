"""Tokenizers that cover a model's whole vocabulary (placeholder tokens for the padded ids).

Checkpoints pad their embedding and LM head to a multiple of 64 or 128 (the presets: 32,064
ids over the Phi-3 tokenizer's 32,011), and a model can sample any of those ids. vLLM's
logprob detokenizer raises on an id past the tokenizer, which takes an OpenAI server down.
Published checkpoints with padded vocabularies name the extra ids with added placeholder
tokens; :func:`pad_tokenizer_dir` does the same here: ids ``n..V-1`` become special added tokens
``<|pad_{id}|>`` (:func:`placeholder`), appended to ``tokenizer.json`` (and to
``tokenizer_config.json``'s ``added_tokens_decoder``). Nothing else changes: a text that does not
contain a placeholder string tokenizes to the same ids, and special tokens decode to nothing
with ``skip_special_tokens``.

* :func:`tokenizer_length`: ids a tokenizer directory covers (``len(tokenizer)``).
* :func:`pad_tokenizer_dir`: pad the tokenizer files of a directory in place (used by the
  presets and ``convert``).
* :func:`padded_tokenizer_dir`: a padded copy of a short tokenizer in the cache (``serve``).

``python -m unified_models.serving.vocabulary SRC DST VOCAB_SIZE`` writes a padded copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..dsl import UnifiedModelsError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_COPIED = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "generation_config")
"""Name prefixes of the files a tokenizer copy takes along."""


def placeholder(token_id: int) -> str:
    """The placeholder token of a padded id: ``<|pad_32011|>``."""
    return f"<|pad_{token_id}|>"


def tokenizer_length(tokenizer_dir: str | os.PathLike) -> int | None:
    """Ids covered by the tokenizer of a directory (``tokenizer.json``: model vocabulary plus
    added tokens), or None when it has no ``tokenizer.json``.

    Raises:
        UnifiedModelsError: ``tokenizer.json`` is not a tokenizer the ``tokenizers`` library reads.
    """
    from tokenizers import Tokenizer

    f = Path(tokenizer_dir) / TOKENIZER_JSON
    if not f.is_file():
        return None
    try:
        return Tokenizer.from_file(str(f)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise UnifiedModelsError(f"{f}: not a readable tokenizer ({e})") from None


def _padded_json(text: str, vocab_size: int, source: Path) -> tuple[str, int]:
    """``tokenizer.json`` text with placeholders up to ``vocab_size``; returns (text, old length)."""
    from tokenizers import Tokenizer

    try:
        n = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise UnifiedModelsError(f"{source}: not a readable tokenizer ({e})") from None
    if n >= vocab_size:
        return text, n
    data = json.loads(text)
    ids = [int(t["id"]) for t in data.get("added_tokens", [])] + [int(i) for i in _model_ids(data)]
    if ids and max(ids) != n - 1:
        raise UnifiedModelsError(f"{source}: its token ids are not contiguous (largest {max(ids)}, {n} tokens); "
                                 "cannot append placeholder tokens")
    added = data.setdefault("added_tokens", [])
    for i in range(n, vocab_size):
        added.append({"id": i, "content": placeholder(i), "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    out = json.dumps(data, ensure_ascii=False, indent=2)
    tok = Tokenizer.from_str(out)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size or tok.token_to_id(placeholder(vocab_size - 1)) != vocab_size - 1:
        raise UnifiedModelsError(f"{source}: padding the tokenizer to {vocab_size} ids gave {got} ids")
    return out, n


def _model_ids(data: dict):
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.values()
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        return range(len(vocab))
    return ()


def _padded_config(text: str, start: int, vocab_size: int) -> str:
    cfg = json.loads(text)
    dec = cfg.get("added_tokens_decoder")
    if isinstance(dec, dict):
        for i in range(start, vocab_size):
            dec.setdefault(str(i), {"content": placeholder(i), "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": True})
    return json.dumps(cfg, ensure_ascii=False, indent=2) + "\n"


def pad_tokenizer_dir(tokenizer_dir: str | os.PathLike, vocab_size: int) -> int:
    """Pad the tokenizer files of ``tokenizer_dir`` in place so that it covers ``vocab_size`` ids.

    Each file is replaced atomically (written beside it, then renamed). A directory whose
    tokenizer already covers ``vocab_size`` ids, or that holds no ``tokenizer.json``, is left
    byte-identical.

    Args:
        tokenizer_dir: a directory with ``tokenizer.json`` (and optionally ``tokenizer_config.json``).
        vocab_size: the model's vocabulary size (``config.json`` ``vocab_size``).

    Returns:
        The number of placeholder tokens added (0 when nothing changed).

    Raises:
        UnifiedModelsError: unreadable tokenizer files, or ids that are not contiguous.
    """
    d = Path(tokenizer_dir)
    f = d / TOKENIZER_JSON
    if not f.is_file():
        return 0
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UnifiedModelsError(f"{f}: cannot read it ({e})") from None
    new, n = _padded_json(text, int(vocab_size), f)
    if n >= vocab_size:
        return 0
    writes = {f: new}
    cfg = d / TOKENIZER_CONFIG
    if cfg.is_file():
        try:
            writes[cfg] = _padded_config(cfg.read_text(encoding="utf-8"), n, int(vocab_size))
        except (OSError, ValueError) as e:
            raise UnifiedModelsError(f"{cfg}: cannot read it as JSON ({e})") from None
    for path, content in writes.items():
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)
    return int(vocab_size) - n


def padded_tokenizer_dir(tokenizer_dir: str | os.PathLike, vocab_size: int, cache_dir: str | os.PathLike) -> Path:
    """``tokenizer_dir`` itself if it covers ``vocab_size`` ids, else a padded copy under ``cache_dir``.

    The copy (every file of ``tokenizer_dir`` whose name starts with ``tokenizer``, ``special_tokens``,
    ``added_tokens``, ``chat_template`` or ``generation_config``, then :func:`pad_tokenizer_dir`) is
    named by a digest of those files and ``vocab_size``, written once, atomically.

    Raises:
        UnifiedModelsError: no ``tokenizer.json`` in a short tokenizer directory, or the errors
            of :func:`pad_tokenizer_dir`.
    """
    src = Path(tokenizer_dir)
    n = tokenizer_length(src)
    if n is None:
        from transformers import AutoTokenizer

        try:
            n = len(AutoTokenizer.from_pretrained(str(src)))
        except (OSError, ValueError) as e:
            raise UnifiedModelsError(f"cannot load a tokenizer from {src}: {e}") from None
        if n < vocab_size:
            raise UnifiedModelsError(f"the tokenizer in {src} has {n} tokens, the model {vocab_size} ids, and no "
                                     f"{TOKENIZER_JSON} to pad; pass a tokenizer that covers the vocabulary")
        return src
    if n >= vocab_size:
        return src
    files = sorted(f for f in src.iterdir() if f.is_file() and f.name.startswith(_COPIED))
    h = hashlib.sha256(str(vocab_size).encode())
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    target = Path(cache_dir) / f"tokenizer-{vocab_size}-{h.hexdigest()[:16]}"
    if (target / TOKENIZER_JSON).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for f in files:
            shutil.copy2(f, tmp / f.name)
        pad_tokenizer_dir(tmp, vocab_size)
        try:
            os.replace(tmp, target)
        except OSError:  # another process wrote it first
            if not (target / TOKENIZER_JSON).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m unified_models.serving.vocabulary SRC DST VOCAB_SIZE``: copy SRC's tokenizer files
    (see :func:`padded_tokenizer_dir`) into a new directory DST, padded to VOCAB_SIZE ids."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or not argv[2].isdigit():
        print("usage: python -m unified_models.serving.vocabulary SRC DST VOCAB_SIZE", file=sys.stderr)
        return 2
    src, dst, v = Path(argv[0]), Path(argv[1]), int(argv[2])
    made = False
    try:
        if dst.exists():
            raise UnifiedModelsError(f"{dst} exists; give a new directory")
        if not (src / TOKENIZER_JSON).is_file():
            raise UnifiedModelsError(f"{src} holds no {TOKENIZER_JSON}")
        dst.mkdir(parents=True)
        made = True
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name.startswith(_COPIED):
                shutil.copy2(f, dst / f.name)
        added = pad_tokenizer_dir(dst, v)
        ids = tokenizer_length(dst)  # VOCAB_SIZE, or more when the tokenizer already had more
    except UnifiedModelsError as e:
        if made:  # nothing half-written is left behind
            shutil.rmtree(dst, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {dst}: {ids} ids ({added} placeholder tokens added)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
