import json

import pytest

from unified_models.dsl import PromptError
from unified_models.presets import default_prompts_path, tokenizer_dir
from unified_models.prompts import load_prompt_texts, tokenize_prompts


def test_bundled_gsm8k_with_chat_template():
    texts = load_prompt_texts(default_prompts_path(), 2)
    assert texts[0].startswith("Janet")
    ids = tokenize_prompts(texts, tokenizer_dir(), vocab_size=32064)
    # DESIGN data README: the chat template turns the first question into 76 ids.
    assert len(ids[0]) == 76 and ids[0][0] == 32010  # <|user|>
    assert ids[0][-1] == 32001 or 32001 in ids[0][-3:]  # <|assistant|>


@pytest.mark.parametrize("content,match", [
    ("", "no prompts"),
    ("\n\n", "no prompts"),
    ("{not json}\n", "not valid JSON"),
    ('{"answer": "4"}\n', "no text field"),
    ('{"question": "   "}\n', "empty prompt"),
    ("[1, 2]\n", "JSON object or string"),
])
def test_bad_prompt_files(tmp_path, content, match):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    with pytest.raises(PromptError, match=match):
        load_prompt_texts(p)


def test_non_utf8_and_lone_surrogates_name_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_prompt_texts(p)
    p.write_text('{"prompt": "ok"}\n{"prompt": "lone \\ud800 surrogate"}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: the prompt is not valid Unicode \(surrogates not allowed"):
        load_prompt_texts(p)


def test_tokenizer_directory_is_checked(tmp_path):
    with pytest.raises(PromptError, match="tokenizer directory .*nope does not exist"):
        tokenize_prompts(["hi"], tmp_path / "nope", vocab_size=32064)
    with pytest.raises(PromptError, match=r"holds none of \('tokenizer.json'"):
        tokenize_prompts(["hi"], tmp_path, vocab_size=32064)


def test_missing_file_and_too_few_prompts(tmp_path):
    with pytest.raises(PromptError, match="does not exist"):
        load_prompt_texts(tmp_path / "nope.jsonl")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(PromptError, match="1 prompts, 3 requested"):
        load_prompt_texts(p, 3)


def test_ids_outside_vocabulary_are_refused():
    with pytest.raises(PromptError, match="outside the model vocabulary"):
        tokenize_prompts(["hello world"], tokenizer_dir(), vocab_size=1000)
