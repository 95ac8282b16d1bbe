"""Sampling through our logprob op, and recording what vLLM sampled from.

* :func:`sampling_params` -> ``vllm.SamplingParams`` whose temperature our ``compute_logits``
  applies (vLLM itself samples at temperature 1 from our rows); :class:`RowTemperatures`
  tells the model each sampling row's temperature.
* :class:`SampleRecorder` records, for every sampled token, the full fp32 row of
  log-probabilities our ``compute_logits`` returned and which request/position it
  belongs to (:func:`external_request_id` maps vLLM's internal request ids back).
* :func:`generate_token_ids`: ``llm.generate`` on token-id prompts.
* :func:`adopt_request_temperature` and :func:`install_engine_hooks`: every engine that runs
  our model class (``vllm.LLM``, ``AsyncLLM``, the OpenAI server) gets the request's own
  ``temperature`` applied by our logprob op, not by vLLM's sampler (see below).

How a request's temperature reaches the logprob op (DESIGN rule 9). Our ``compute_logits``
returns ``log_softmax(logits / T)``; vLLM's sampler would divide those rows by T once more.
So, for a model served by our class, the request-local copy of its ``SamplingParams``
(``InputProcessor.process_inputs`` clones the caller's) is rewritten before the engine core
sees it: ``temperature = T`` becomes ``temperature = 1`` plus ``extra_args[TEMPERATURE_ARG] =
T``. The model runner then samples at 1 from our rows (the same distribution as vLLM's own
temperature T would give) and, with ``logprobs_mode="raw_logits"``, returns the op's values;
:class:`RowTemperatures` (installed on the model after loading by the worker hook) tells the
model each row's T. Greedy requests (``temperature < 1e-5``, vLLM's ``_SAMPLING_EPS``) are left
greedy; their logprobs are the op's at ``extra_args[TEMPERATURE_ARG]`` if given, else at 1. A
request that gives both a vLLM temperature other than 0 or 1 and ``extra_args[TEMPERATURE_ARG]``
is refused (``ValueError``: HTTP 400 from the server).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterable

import torch

from . import compat


TEMPERATURE_ARG = "unified_models_temperature"
"""``SamplingParams.extra_args`` key holding a request's sampling temperature."""

try:
    from vllm.exceptions import VLLMValidationError as _ClientError
except ImportError:  # pragma: no cover - a vLLM without the client-error hierarchy maps ValueError itself
    _ClientError = ValueError


# vLLM 0.26's VLLMValidationError is already a ValueError (listing both bases has no consistent MRO there)
_ERROR_BASES = (_ClientError,) if issubclass(_ClientError, ValueError) else (ValueError, _ClientError)


class RequestTemperatureError(*_ERROR_BASES):
    """A request's temperatures cannot be served (a ``ValueError``, and vLLM's client error where vLLM
    has one, so its OpenAI server answers HTTP 400 rather than 500)."""

    def __init__(self, message: str) -> None:
        if _ClientError is ValueError:  # pragma: no cover - see the import above
            super().__init__(message)
        else:
            _ClientError.__init__(self, message, parameter="temperature")


GREEDY_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a temperature below it means greedy (argmax) decoding."""


def sampling_params(*, temperature: float = 1.0, **kwargs):
    """``vllm.SamplingParams`` that sample at ``temperature`` through our logprob op.

    vLLM itself samples at temperature 1 from the rows our ``compute_logits``
    returns, which are ``log_softmax(logits / temperature)``: the same
    distribution, and the reported logprob is the op's value, which the trainer
    recomputes with ``ops.logprobs(..., temperature)``.

    Raises:
        ValueError: ``temperature <= 0`` (use ``temperature=1`` with vLLM's
            greedy settings for argmax decoding), or ``kwargs`` sets vLLM's own
            ``temperature`` / ``extra_args``.
    """
    from vllm import SamplingParams

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if "temperature" in kwargs or "extra_args" in kwargs:
        raise ValueError("sampling_params sets vLLM's temperature and extra_args itself")
    return SamplingParams(temperature=1.0, extra_args={TEMPERATURE_ARG: float(temperature)}, **kwargs)


class RowTemperatures:
    """``f(R) -> [T_i]``: the temperature of each sampling row of the current step.

    Row ``i`` belongs to ``runner.input_batch.req_ids[i]`` (see ``model.py``); its
    temperature is ``extra_args[TEMPERATURE_ARG]`` (default 1).

    Raises:
        ValueError: a request asks vLLM itself for a temperature other than 0 or
            1, which would apply a second temperature on top of our rows.
    """

    def __init__(self, runner):
        self.runner = runner
        self._by_request: dict[str, float] = {}  # vLLM request id -> temperature (ids are unique)

    def _temperature(self, rid: str) -> float:
        t = self._by_request.get(rid)
        if t is not None:
            return t
        state = self.runner.requests.get(rid)
        sp = getattr(state, "sampling_params", None)
        if sp is None:
            return 1.0  # not cached: the request's state may not exist yet
        if sp.temperature not in (0.0, 1.0):
            raise ValueError(
                f"request {rid}: vLLM temperature {sp.temperature} would be applied on top of unified_models' "
                "logprobs; build the request with unified_models.backends.vllm.sampling.sampling_params"
                "(temperature=...) instead")
        t = float((sp.extra_args or {}).get(TEMPERATURE_ARG, 1.0))
        if len(self._by_request) >= 1 << 16:  # finished requests are never asked again
            self._by_request.clear()
        self._by_request[rid] = t
        return t

    def __call__(self, n: int) -> list[float]:
        return [self._temperature(rid) for rid in list(self.runner.input_batch.req_ids)[:n]]


def external_request_id(internal_id: str) -> str:
    """The user-visible request id of a runner request id.

    vLLM 0.26/0.32 append ``-<8 random chars>`` to each request id
    (``InputProcessor.assign_request_id``) unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set; ``RequestOutput.request_id``
    is the user id.
    """
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return internal_id
    return internal_id.rsplit("-", 1)[0]


class SampleRecorder:
    """Record what vLLM sampled from: one entry per sampling row of ``compute_logits``.

    Use as a context manager around ``llm.generate``. Each entry is
    ``(request_id, position, row)``: the user-visible request id, the position of
    the token whose hidden state produced the row (the sampled token sits at
    ``position + 1``), and the fp32 ``[V]`` log-probabilities when that row is
    kept (else ``None``). Rows of partial prefills are recorded too (vLLM discards
    their sample); prompt-logprob calls (``logits_call_index >= 1``) are recorded in
    ``prompt_rows`` as ``(request_ids_in_batch, rows)`` per call, without further mapping.

    Args:
        llm: an in-process engine from :func:`.engine.make_llm`.
        keep_rows: copy sampling rows to the host at all (False: positions only).
        keep_rows_of: with ``keep_rows``, a predicate on the user-visible request id,
            asked once per sampling row in row order: only rows for which it is true
            leave the device (one gather + one copy per step), the others are recorded
            with ``None``. ``None`` keeps every row. :meth:`first_requests` builds the
            common one.
    """

    def __init__(self, llm, *, keep_rows: bool = True, keep_rows_of=None):
        self.runner = compat.model_runner(llm)
        self.model = _our_model(self.runner.get_model())
        if self.model is None:
            raise RuntimeError(f"the engine runs {type(self.runner.get_model()).__name__}, not unified_models' "
                               "UnifiedForCausalLM")
        self.keep_rows = keep_rows
        self.keep_rows_of = keep_rows_of
        self.entries: list[tuple[str, int, torch.Tensor | None]] = []
        self.prompt_rows: list[tuple[list[str], torch.Tensor]] = []
        self._prev = None

    @staticmethod
    def first_requests(n: int):
        """A ``keep_rows_of`` predicate: the first ``n`` distinct request ids it is asked about
        (-1: all, 0: none). vLLM admits requests in submission order, so with every request
        admitted at once these are the first ``n`` submitted."""
        kept: set[str] = set()
        limit = float("inf") if n < 0 else n

        def keep(request_id: str) -> bool:
            if request_id not in kept and len(kept) < limit:
                kept.add(request_id)
            return request_id in kept

        return keep

    def __enter__(self) -> "SampleRecorder":
        self._prev = self.model.logprob_tap
        self.model.logprob_tap = self._tap
        return self

    def __exit__(self, *exc) -> None:
        self.model.logprob_tap = self._prev

    def _tap(self, rows: torch.Tensor) -> None:
        req_ids = [external_request_id(r) for r in list(self.runner.input_batch.req_ids)]
        if self.model.logits_call_index != 0:
            self.prompt_rows.append((req_ids, rows.cpu()))
            return
        pos = self.model.last_sample_positions
        n = rows.shape[0]
        if pos is None or pos.shape[0] != n or len(req_ids) < n:
            raise RuntimeError(
                f"SampleRecorder: {n} sampling rows but {len(req_ids)} requests / "
                f"{None if pos is None else pos.shape[0]} recorded positions")
        kept: list[torch.Tensor | None] = [None] * n
        if self.keep_rows and self.keep_rows_of is None:
            kept = list(rows.cpu())
        elif self.keep_rows:
            idx = [i for i in range(n) if self.keep_rows_of(req_ids[i])]
            if idx:
                host = rows[torch.tensor(idx, device=rows.device)].cpu()
                for r, i in enumerate(idx):
                    kept[i] = host[r]
        for i in range(n):
            self.entries.append((req_ids[i], int(pos[i]), kept[i]))

    def rows_for(self, request_id: str) -> dict[int, torch.Tensor]:
        """``position -> row`` of one request's kept rows (later entries win, e.g. after a recompute)."""
        return {p: r for rid, p, r in self.entries if rid == request_id and r is not None}


def generate_token_ids(llm, prompts: Iterable[list[int]], sampling_params, *, use_tqdm: bool = False):
    """``llm.generate`` on token-id prompts (``TokensPrompt``), outputs in prompt order."""
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling_params,
                        use_tqdm=use_tqdm)


def _our_model(model) -> Any:
    """``model`` with vLLM's wrappers stripped if it is our model class (it has ``row_temperatures``), else None.

    Duck-typed so that this module imports neither :mod:`.model` nor :mod:`.live` (the plugin
    imports it, and the model imports the plugin).
    """
    inner = compat.unwrap_model(model)
    return inner if "row_temperatures" in getattr(inner, "__dict__", {}) and hasattr(inner, "spec") else None


def adopt_request_temperature(sp) -> None:
    """Move a request's own vLLM ``temperature`` into our logprob op's argument, in place.

    ``sp`` must be the request's private copy (``InputProcessor.process_inputs`` makes one).
    ``temperature = T >= 1e-5`` with no ``extra_args[TEMPERATURE_ARG]`` becomes ``temperature = 1``
    and ``extra_args[TEMPERATURE_ARG] = T``; greedy requests and requests already built by
    :func:`sampling_params` are left as they are.

    Raises:
        ValueError: ``extra_args[TEMPERATURE_ARG]`` is not a finite number > 0, or is given
            together with a vLLM temperature other than 0 or 1 (two temperatures for one request).
    """
    extra = dict(sp.extra_args or {})
    if TEMPERATURE_ARG in extra:
        t = extra[TEMPERATURE_ARG]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise RequestTemperatureError(f"extra_args[{TEMPERATURE_ARG!r}] must be a finite number > 0, got {t!r}")
        if sp.temperature >= GREEDY_EPS and sp.temperature != 1.0:
            raise RequestTemperatureError(f"temperature {sp.temperature} and extra_args[{TEMPERATURE_ARG!r}] = {t} both set a "
                             "sampling temperature; give only `temperature` (unified_models applies it in its "
                             "logprob op)")
        extra[TEMPERATURE_ARG] = float(t)
        sp.extra_args = extra
        return
    if sp.temperature < GREEDY_EPS:
        return
    extra[TEMPERATURE_ARG] = float(sp.temperature)
    sp.extra_args = extra
    sp.temperature = 1.0


_HOOKS_INSTALLED = False


def install_engine_hooks(serves_ours: Callable[[str], bool]) -> None:
    """Patch vLLM (once per process) so that every engine running our model class carries temperatures right.

    * ``InputProcessor.process_inputs`` (the frontend of ``vllm.LLM``, ``AsyncLLM`` and the OpenAI
      server): when ``serves_ours(model_config.architecture)``, :func:`adopt_request_temperature` on
      the request's private ``SamplingParams`` (its ``ValueError`` is the server's HTTP 400).
    * ``InputProcessor.__init__``: for our model, refuse a tokenizer shorter than the model's
      vocabulary (:func:`check_tokenizer_covers_vocab`) before any request can sample an id it
      cannot detokenize.
    * ``Worker.load_model`` (GPU and CPU workers): after loading, our model gets
      ``row_temperatures = RowTemperatures(runner)`` unless it has one.

    vLLM's plugin entry point (``backends/vllm/plugin.register``) calls this in every vLLM
    process; for any other model class the hooks do nothing.
    """
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_worker import Worker

    process_inputs = InputProcessor.process_inputs
    init = InputProcessor.__init__
    load_model = Worker.load_model

    def ours(processor) -> bool:
        try:
            return bool(serves_ours(processor.model_config.architecture))
        except Exception:  # noqa: BLE001 - an unresolved architecture is not ours
            return False

    @functools.wraps(init)
    def init_hooked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if ours(self) and self.tokenizer is not None:
            check_tokenizer_covers_vocab(len(self.tokenizer), self.model_config.get_vocab_size(),
                                         str(self.model_config.tokenizer))

    @functools.wraps(process_inputs)
    def process_inputs_hooked(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        if request.sampling_params is not None and ours(self):
            adopt_request_temperature(request.sampling_params)
        return request

    @functools.wraps(load_model)
    def load_model_hooked(self, *args, **kwargs):
        out = load_model(self, *args, **kwargs)
        model = _our_model(self.model_runner.get_model())
        if model is not None and model.row_temperatures is None:
            model.row_temperatures = RowTemperatures(self.model_runner)
        return out

    InputProcessor.__init__ = init_hooked
    InputProcessor.process_inputs = process_inputs_hooked
    Worker.load_model = load_model_hooked
    _HOOKS_INSTALLED = True


def check_tokenizer_covers_vocab(tokenizer_len: int, vocab_size: int, tokenizer: str) -> None:
    """Refuse to serve a model whose vocabulary has ids its tokenizer cannot detokenize.

    A random or fine-tuned model can sample any id below ``vocab_size``; vLLM's logprob
    detokenizer raises on an id past the tokenizer (``convert_ids_to_tokens`` gives ``None``)
    and the server exits. ``unified-models serve`` pads such a tokenizer with placeholder
    tokens instead (:func:`unified_models.serving.vocabulary.padded_tokenizer_dir`).

    Raises:
        ValueError: ``tokenizer_len < vocab_size``.
    """
    if tokenizer_len < vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer} has {tokenizer_len} tokens but the model's vocabulary has {vocab_size} ids: "
            f"ids {tokenizer_len}..{vocab_size - 1} could be sampled and not detokenized (vLLM's logprob "
            "detokenizer would take the server down). Serve it with `unified-models serve`, which pads the "
            "tokenizer with placeholder tokens, or pass --tokenizer with a padded copy "
            "(`python -m unified_models.serving.vocabulary SRC DST VOCAB_SIZE`)")
