"""``unified-models serve``: vLLM's OpenAI server with our model class, driven by the official client.

One server (CPU, the tiny preset's weights) is started as a subprocess on 127.0.0.1 and stopped by
its PID. Its checkpoint directory holds the bundled Phi-3 tokenizer as it is (32,011 tokens) while
the model has 32,064 ids, so the same server also shows that a vocabulary larger than the
tokenizer is served safely (``serve`` pads the tokenizer with placeholder tokens).

Every sampled token's logprob is compared bitwise with the Megatron module's recompute at the
request's own temperature, the way ``check`` recomputes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

NEW_TOKENS = 4
"""Sampled tokens per request in the concurrency test (kept small: 2 busy CPU cores)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def short_tokenizer_checkpoint(tmp_path_factory) -> Path:
    """The tiny preset's weights and config with the *unpadded* bundled tokenizer (32,011 < 32,064)."""
    from unified_models.presets import build_preset_checkpoint, tokenizer_dir
    from unified_models.serving.vocabulary import tokenizer_length

    src = build_preset_checkpoint("nemotron_h_tiny")
    d = tmp_path_factory.mktemp("short_tok") / "ckpt"
    d.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).is_file():
            os.symlink(src / name, d / name)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    assert tokenizer_length(d) == 32011 < vocab == 32064
    return d


@pytest.fixture(scope="module")
def server(short_tokenizer_checkpoint, tmp_path_factory):
    """``unified-models serve --model DIR`` on a free port; yields (base URL, Popen); stopped by PID."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # conftest's in-process pin
    cmd = [sys.executable, "-m", "unified_models.cli", "serve", "--model", str(short_tokenizer_checkpoint),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
           "--max-model-len", "512", "--max-num-seqs", "32"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        while not _alive(base):
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() - t0 > 420:
                pytest.fail(f"server not up after 420 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the API server and vLLM's engine-core child
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model():
    """(spec, state_dict, prompt token ids of 8 GSM8K questions) of the tiny preset."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint, default_prompts_path
    from unified_models.prompts import load_prompt_texts, tokenize_prompts

    d = build_preset_checkpoint("nemotron_h_tiny")
    _, spec, sd = spec_and_state_dict(d)
    ids = tokenize_prompts(load_prompt_texts(default_prompts_path(), 8), d, vocab_size=spec.vocab_size)
    return spec, sd, [p[:48] for p in ids]


def _ids(tokens: list[str]) -> list[int]:
    """``return_tokens_as_token_ids`` tokens (``token_id:123``) -> ids."""
    return [int(t.rsplit(":", 1)[1]) for t in tokens]


def _completion(client, prompt_ids, *, temperature, seed, logprobs, max_tokens=NEW_TOKENS):
    r = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                  seed=seed, logprobs=logprobs,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    return {"prompt": list(prompt_ids), "tokens": _ids(c.logprobs.tokens),
            "logprobs": list(c.logprobs.token_logprobs), "top": c.logprobs.top_logprobs, "temperature": temperature}


def _chat(client, text, *, temperature, seed, logprobs, max_tokens=NEW_TOKENS):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=temperature,
        seed=seed, logprobs=True, top_logprobs=logprobs,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    toks = _ids([x.token for x in c.logprobs.content])
    assert toks == list(c.token_ids)
    return {"prompt": list(r.prompt_token_ids), "tokens": toks, "logprobs": [x.logprob for x in c.logprobs.content],
            "top": [{t.token: t.logprob for t in x.top_logprobs} for x in c.logprobs.content],
            "temperature": temperature}


def _recompute(spec, sd, results: list[dict]) -> None:
    """Assert every returned sampled-token logprob is bitwise the trainer's at its request's temperature."""
    from unified_models.backends.megatron.trainer import Trainer

    with Trainer(spec, sd, device="cpu") as trainer:
        for t in sorted({r["temperature"] for r in results}):
            group = [r for r in results if r["temperature"] == t]
            tr = trainer.logprobs([r["prompt"] for r in group], [r["tokens"] for r in group],
                                  temperature=t if t > 0 else 1.0)
            for r, lp in zip(group, tr.logprobs):
                got = torch.tensor(r["logprobs"], dtype=torch.float64)
                want = lp.double().cpu()
                assert got.shape == want.shape and torch.equal(got, want), (t, r["tokens"], got, want)
                # the JSON value is the fp32 op output exactly (no rounding on the way)
                assert torch.equal(got.float().double(), got)


def test_concurrent_requests_match_trainer_bitwise(server, model):
    """8 threads, completions + chat, temperatures 0.7 / 1.0, seeds, logprobs 0 / 5, 64 requests:
    none fails, the server stays up, every logprob is the trainer's at the request's temperature,
    and a request alone gives the same bits as under load. Bad requests get 4xx and change nothing."""
    import openai

    base, proc, log = server
    spec, sd, prompts = model
    from unified_models.presets import default_prompts_path
    from unified_models.prompts import load_prompt_texts

    texts = load_prompt_texts(default_prompts_path(), 8)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    jobs = []
    for i in range(64):
        kind = "chat" if i % 2 else "completion"
        jobs.append(dict(kind=kind, idx=i % 8, temperature=(0.7, 1.0)[(i // 2) % 2], seed=1000 + i,
                         logprobs=(0, 5)[(i // 4) % 2]))

    def run(job):
        kw = dict(temperature=job["temperature"], seed=job["seed"], logprobs=job["logprobs"])
        if job["kind"] == "chat":
            return _chat(client, texts[job["idx"]], **kw)
        return _completion(client, prompts[job["idx"]], **kw)

    t0 = time.monotonic()
    alone = [run(j) for j in jobs[:6]]  # one at a time
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(run, jobs))
    took = time.monotonic() - t0
    assert proc.poll() is None and _alive(base), log.read_text()[-3000:]
    for a, b in zip(alone, loaded[:6]):
        assert a == b  # tokens, logprobs and top-5 bit for bit
    for job, r in zip(jobs, loaded):
        assert len(r["tokens"]) == NEW_TOKENS
        if job["logprobs"] == 5:
            assert all(len(t) >= 5 for t in r["top"])

    # greedy: temperature 0 -> argmax, logprobs at temperature 1
    greedy = _completion(client, prompts[0], temperature=0.0, seed=None, logprobs=1)
    greedy["temperature"] = 0.0
    _recompute(spec, sd, loaded + [greedy])

    bad = [
        dict(prompt=prompts[0], max_tokens=2, temperature=-1.0),  # negative temperature
        dict(prompt=prompts[0], max_tokens=2, logprobs=50),  # above --max-logprobs (20)
        dict(prompt=prompts[0], max_tokens=100000),  # beyond max_model_len
        dict(prompt=[10**6], max_tokens=2),  # token id outside the vocabulary
        dict(prompt=prompts[0], max_tokens=2, temperature=0.7,  # two temperatures
             extra_body={"vllm_xargs": {"unified_models_temperature": 0.5}}),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", **kw)
        assert 400 <= e.value.status_code < 500
    assert proc.poll() is None and _alive(base)
    again = _completion(client, prompts[jobs[0]["idx"]], temperature=jobs[0]["temperature"], seed=jobs[0]["seed"],
                        logprobs=jobs[0]["logprobs"])
    assert again == alone[0]
    print(f"64 concurrent + 6 single requests in {took:.1f} s")


def test_ids_past_the_tokenizer_never_take_the_server_down(server):
    """Thousands of sampled tokens with top-5 logprobs on a model with 53 more ids than its checkpoint's
    tokenizer: the ids past the tokenizer come back as placeholders and the server stays up."""
    import openai

    base, proc, log = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)

    def run(i):
        r = client.completions.create(model="tiny", prompt=[1, 450 + i], max_tokens=64, temperature=1.0,
                                      seed=7000 + i, logprobs=5, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        return lp.tokens, lp.top_logprobs

    with ThreadPoolExecutor(32) as pool:
        out = list(pool.map(run, range(32)))
    sampled = sum(len(t) for t, _ in out)
    assert sampled == 32 * 64
    names = {name for _, tops in out for top in tops for name in top}
    pads = {n for n in names if n.startswith("<|pad_")}
    assert pads, "no id past the tokenizer came up; the test shows nothing"
    assert all(32011 <= int(n[len("<|pad_"):-2]) < 32064 for n in pads)
    assert proc.poll() is None and _alive(base), log.read_text()[-3000:]


def test_server_fingerprint_equals_the_trainers_and_a_different_one_is_refused(server, model, monkeypatch):
    """``GET /unified_models/fingerprint`` (computed in vLLM's worker process) equals the trainer's
    contract; a trainer reading another torch version is refused naming the component."""
    from unified_models.backends.megatron.trainer import Trainer
    from unified_models.consistency import fingerprint as F
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.client import check_server_contract, server_fingerprint

    base, proc, log = server
    spec, sd, _ = model
    with Trainer(spec, sd, device="cpu") as trainer:
        ours = trainer.contract_fingerprint()
    fp = check_server_contract(base, ours)
    assert fp.engine == "vllm" and fp.digest == ours.digest
    assert fp.components["vllm.settings"]["logprobs_mode"].endswith("raw_logits")
    with pytest.raises(F.FingerprintMismatchError, match="library.torch"):
        check_server_contract(base, ours.with_component("library.torch", "2.0.0+other"))
    with pytest.raises(UnifiedModelsError, match="HTTP 404"):
        server_fingerprint(base + "/v1")  # a route the server does not have
    assert proc.poll() is None and _alive(base)


def test_plain_vllm_refuses_a_short_tokenizer_at_start():
    """Our hook refuses, before any request, a tokenizer shorter than the model's vocabulary."""
    from unified_models.backends.vllm.sampling import check_tokenizer_covers_vocab

    check_tokenizer_covers_vocab(32064, 32064, "t")
    with pytest.raises(ValueError, match=r"32011 tokens but the model's vocabulary has 32064 ids"):
        check_tokenizer_covers_vocab(32011, 32064, "t")


def test_presets_write_tokenizers_that_cover_the_vocabulary(model):
    """The preset's tokenizer has one id per vocabulary row; the prompts' ids are the bundled tokenizer's."""
    from unified_models.presets import build_preset_checkpoint, default_prompts_path, tokenizer_dir
    from unified_models.prompts import load_prompt_texts, tokenize_prompts
    from unified_models.serving.vocabulary import placeholder, tokenizer_length

    spec = model[0]
    d = build_preset_checkpoint("nemotron_h_tiny")
    assert tokenizer_length(d) == spec.vocab_size == 32064
    assert tokenizer_length(tokenizer_dir()) == 32011
    texts = load_prompt_texts(default_prompts_path(), 200)
    assert tokenize_prompts(texts, d, vocab_size=spec.vocab_size) == tokenize_prompts(
        texts, tokenizer_dir(), vocab_size=spec.vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    assert tok.convert_ids_to_tokens([32011, 32063]) == [placeholder(32011), placeholder(32063)]
    assert tok.decode([450, 32011, 32063], skip_special_tokens=True) == tok.decode([450])


def test_override_setting_loads_native_names_with_our_class(monkeypatch):
    """``UNIFIED_MODELS_OVERRIDE_NATIVE=1``: plain vLLM engine args resolve a ``NemotronHForCausalLM``
    checkpoint to our class (hybrid variant for a Mamba pattern) without ``hf_overrides``."""
    from vllm.engine.arg_utils import EngineArgs

    from unified_models.backends.vllm import plugin
    from unified_models.presets import build_preset_checkpoint

    original = EngineArgs.create_model_config
    monkeypatch.setenv("UNIFIED_MODELS_OVERRIDE_NATIVE", "1")
    try:
        plugin.register()
        for preset, want in (("nemotron_h_tiny", "UnifiedNemotronHForCausalLM"),
                             ("nemotron_h_hybrid_tiny", "UnifiedNemotronHHybridForCausalLM")):
            d = build_preset_checkpoint(preset)
            assert json.loads((d / "config.json").read_text())["architectures"] == ["NemotronHForCausalLM"]
            cfg = EngineArgs(model=str(d), tokenizer=str(d), model_impl="vllm").create_model_config()
            assert cfg.architecture == want
    finally:
        EngineArgs.create_model_config = original


def test_server_block_size_holds_whole_pages_of_every_cache(tiny_checkpoint):
    """``serve`` pins the engine's block size of the spec (``default_block_size``: 64 here, the
    lcm with every compression ratio for DeepSeek-V4) and refuses one that breaks it, naming it."""
    from unified_models.backends.vllm.engine import default_block_size
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.serve import server_namespace

    ns = server_namespace(tiny_checkpoint, [], gpu=False)
    assert ns.block_size == 64 and "worker_extension" in ns.worker_extension_cls
    assert server_namespace(tiny_checkpoint, ["--block-size", "128"], gpu=False).block_size == 128
    with pytest.raises(UnifiedModelsError, match="--block-size 48: must be a multiple of 64"):
        server_namespace(tiny_checkpoint, ["--block-size", "48"], gpu=False)
    with pytest.raises(UnifiedModelsError, match="--worker-extension-cls"):
        server_namespace(tiny_checkpoint, ["--worker-extension-cls", "x.Y"], gpu=False)
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    assert default_block_size(spec_and_state_dict(tiny_checkpoint)[1]) == 64


def test_a_flag_vllm_refuses_is_named_in_one_line(tiny_checkpoint, capsys):
    """A server flag vLLM's parser refuses gives one error naming it and why, not vLLM's whole usage or a
    traceback; a positional argument (vLLM's model tag, which would be ignored: the default model served
    instead of the one meant) is refused."""
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.serve import server_namespace

    for flags, why in ((["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                       (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
                       (["--foo.bar"], "'--foo.bar': IndexError"),  # vLLM's own pre-parsing of dotted flags
                       (["--config", "/no/such.yaml"], "FileNotFoundError"),
                       (["/some/checkpoint"], "not as a positional argument ('/some/checkpoint' would be ignored")):
        with pytest.raises(UnifiedModelsError, match=re.escape(why)):
            server_namespace(tiny_checkpoint, flags, gpu=False)
        assert "usage:" not in capsys.readouterr().err
    assert server_namespace(tiny_checkpoint, ["--max-num-seqs=8"], gpu=False).max_num_seqs == 8


PINNED_AT_VLLM_DEFAULT = (
    (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode"), (["--logprobs-mode=raw_logprobs"], "--logprobs-mode"),
    (["--logprobs_mode", "raw_logprobs"], "--logprobs-mode"), (["--logprobs-m", "raw_logprobs"], "--logprobs-mode"),
    (["--hf-overrides", "{}"], "--hf-overrides"), (["--hf-overrides={}"], "--hf-overrides"),
    (["--hf-overrides.architectures", '["NemotronHForCausalLM"]'], "--hf-overrides"),
    (["--model-impl", "auto"], "--model-impl"), (["--model-impl=auto"], "--model-impl"),
    (["--dtype", "auto"], "--dtype"), (["--dtype=auto"], "--dtype"),
    (["--worker-extension-cls", ""], "--worker-extension-cls"), (["--worker-extension-cls="], "--worker-extension-cls"),
    (["--no-enforce-eager"], "--no-enforce-eager"),  # the CPU pins --enforce-eager
    (["--model", "Qwen/Qwen3-0.6B"], "--model"), (["--model=/elsewhere"], "--model"),
    (["--compilation-config", '{"mode": 3}'], "--compilation-config"), (["-cc.mode", "3"], "--compilation-config"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--spec-method=ngram"], "--spec-method"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"), (["-tp", "2"], "--tensor-parallel-size"),
    (["-pp=2"], "--pipeline-parallel-size"),
)
"""(vLLM server flags, the flag named in the refusal): every pinned flag, most at vLLM's own default, in
the spellings vLLM's parser accepts (``--flag=value``, ``--flag_name``, abbreviation, dotted key, alias)."""


@pytest.mark.parametrize("flags,named", PINNED_AT_VLLM_DEFAULT, ids=[" ".join(f) for f, _ in PINNED_AT_VLLM_DEFAULT])
def test_a_pinned_flag_is_refused_at_any_other_value_however_spelled(tiny_checkpoint, flags, named):
    """A pinned flag given at a value other than its pin is refused in one line naming it, even at vLLM's
    default (the user's flags are parsed after ours, so it would silently undo the pin)."""
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.serve import server_namespace

    with pytest.raises(UnifiedModelsError, match=rf"would undo serve's pins: {re.escape(named)}\b.* given") as e:
        server_namespace(tiny_checkpoint, flags, gpu=False)
    assert "\n" not in str(e.value)


def test_a_pinned_flag_at_its_pin_is_accepted_and_pins_always_win(tiny_checkpoint, tmp_path):
    """A pinned flag given at exactly the pinned value is accepted; a ``--config FILE`` entry is checked like a
    flag; on a GPU engine the pins are the graph settings (``--no-enforce-eager``, our compilation config)."""
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.pins import PINNED_FLAGS
    from unified_models.serving.serve import server_namespace

    base = server_namespace(tiny_checkpoint, [], gpu=False)
    assert (base.logprobs_mode, base.model_impl, base.enforce_eager, base.tensor_parallel_size) == (
        "raw_logits", "vllm", True, 1)
    same = ["--logprobs-mode", "raw_logits", "--model-impl=vllm", "--dtype", "bfloat16", "--enforce-eager", "-tp", "1",
            "--pipeline-parallel-size=1", "--hf-overrides", json.dumps(base.hf_overrides), "--worker-extension-cls",
            base.worker_extension_cls, "--speculative-config", "null", "--model", base.model]
    ns = server_namespace(tiny_checkpoint, same, gpu=False)
    assert all(getattr(ns, k) == getattr(base, k) for k in PINNED_FLAGS)
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\nlogprobs-mode: raw_logprobs\n")
    with pytest.raises(UnifiedModelsError, match="--logprobs-mode 'raw_logprobs' given, serve pins --logprobs-mode "
                                                 "'raw_logits' "):
        server_namespace(tiny_checkpoint, ["--config", str(config)], gpu=False)
    config.write_text("max-num-seqs: 8\nlogprobs-mode: raw_logits\n")
    assert server_namespace(tiny_checkpoint, ["--config", str(config)], gpu=False).max_num_seqs == 8
    gpu = server_namespace(tiny_checkpoint, ["--no-enforce-eager"], gpu=True)
    assert not gpu.enforce_eager and gpu.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"
    for flags, named in ((["--enforce-eager"], "--enforce-eager"), (["-cc", "{}"], "--compilation-config")):
        with pytest.raises(UnifiedModelsError, match=rf"{re.escape(named)}\b.* given, serve pins"):
            server_namespace(tiny_checkpoint, flags, gpu=True)


def test_max_num_batched_tokens_below_the_model_length_is_named_in_one_line(tiny_checkpoint):
    """With chunked prefill off (always on the CPU) a step must hold a whole prompt: ``--max-num-batched-tokens``
    below the max model length is refused naming it, not left to vLLM's ``SchedulerConfig`` (a pydantic
    traceback at startup); ``unified-models serve`` exits 2 with that one line, as it does for a flag combination
    only vLLM's own config classes refuse."""
    from unified_models.dsl import UnifiedModelsError
    from unified_models.serving.serve import server_namespace

    with pytest.raises(UnifiedModelsError, match=r"--max-num-batched-tokens 10: must be >= the max model length 4096"):
        server_namespace(tiny_checkpoint, ["--max-num-batched-tokens", "10"], gpu=False)
    with pytest.raises(UnifiedModelsError, match=r"--max-num-batched-tokens 100: must be >= the max model length 512 "
                                                 r"\(--max-model-len\)"):
        server_namespace(tiny_checkpoint, ["--max-model-len", "512", "--max-num-batched-tokens=100"], gpu=False)
    with pytest.raises(UnifiedModelsError, match=r"--max-num-batched-tokens 100: must be >= --max-num-seqs 128"):
        server_namespace(tiny_checkpoint, ["--max-model-len", "64", "--max-num-batched-tokens", "100",
                                           "--max-num-seqs", "128"], gpu=False)
    ns = server_namespace(tiny_checkpoint, ["--max-model-len", "512", "--max-num-batched-tokens", "512"], gpu=False)
    assert (ns.max_num_batched_tokens, ns.enable_chunked_prefill) == (512, False)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    for flags, named in ((["--max-num-batched-tokens", "10"], "--max-num-batched-tokens 10: must be >="),
                         (["--logprobs-mode", "raw_logprobs"], "--logprobs-mode 'raw_logprobs' given"),
                         (["--long-prefill-token-threshold", "100000"], "at startup (SchedulerConfig): Value error, "
                                                                        "long_prefill_token_threshold (100000)")):
        r = subprocess.run([sys.executable, "-m", "unified_models.cli", "serve", "--model", str(tiny_checkpoint),
                            "--port", str(_free_port()), *flags], capture_output=True, text=True, env=env, timeout=300)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1 and named in errors[0], r.stderr


def test_vocabulary_cli_names_a_bad_tokenizer_and_reports_the_ids_written(tmp_path, capsys):
    """`python -m unified_models.serving.vocabulary SRC DST V`: an unreadable tokenizer.json is a one-line
    error naming it, with no DST left behind; the ids reported are the copy's (not V when SRC has more)."""
    from unified_models.presets import tokenizer_dir
    from unified_models.serving.vocabulary import main, tokenizer_length

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"bad": 1}')
    assert main([str(bad), str(tmp_path / "out"), "40000"]) == 2
    assert "tokenizer.json: not a readable tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    n = tokenizer_length(tokenizer_dir())
    assert main([str(tokenizer_dir()), str(tmp_path / "small"), "100"]) == 0
    assert f": {n} ids (0 placeholder tokens added)" in capsys.readouterr().out


def test_a_checkpoint_value_that_stops_the_engine_is_named_in_one_line(tiny_checkpoint, tmp_path):
    """A NaN weight passes the pre-flight (names, shapes, dtypes: headers only) and stops vLLM's engine
    process as it loads; vLLM's own error only points at that process's log. ``serve`` then names the
    tensor in one ``error:`` line and exits 2 (a break test found only ``Engine core initialization
    failed. See root cause above.``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan_weight"
    shutil.copytree(tiny_checkpoint, bad)
    sd = load_file(str(bad / "model.safetensors"))
    name = sorted(n for n in sd if n.endswith("norm.weight"))[0]
    sd[name] = sd[name].clone()
    sd[name][0] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    r = subprocess.run([sys.executable, "-m", "unified_models.cli", "serve", "--model", str(bad),
                        "--port", str(_free_port())], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert "vLLM's engine could not start" in errors[0] and f"tensor {name} holds NaN or Inf" in errors[0], errors


def test_a_server_stopped_by_its_dead_engine_is_recorded(monkeypatch):
    """vLLM stops the HTTP server when its engine dies (``terminate_if_errored``, from its watchdog and
    its error handlers); ``serve`` records that, to exit 1 instead of 0. Both places vLLM calls it from
    see the recording version; a live engine is not recorded."""
    from types import SimpleNamespace

    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    from unified_models.serving.serve import _recording_engine_death

    monkeypatch.setattr(launcher, "terminate_if_errored", launcher.terminate_if_errored)  # restored afterwards
    monkeypatch.setattr(vllm_error, "terminate_if_errored", vllm_error.terminate_if_errored)
    died: list = []
    _recording_engine_death(died)
    assert launcher.terminate_if_errored is vllm_error.terminate_if_errored
    server = SimpleNamespace(should_exit=False)
    launcher.terminate_if_errored(server, SimpleNamespace(errored=False, is_running=True))
    assert died == [] and server.should_exit is False
    vllm_error.terminate_if_errored(server, SimpleNamespace(errored=True, is_running=False))
    assert died == [True] and server.should_exit is True
