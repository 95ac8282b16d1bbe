"""Sampling through our logprob op, and recording what vLLM sampled from.

* :func:`sampling_params` -> ``vllm.SamplingParams`` whose temperature our ``compute_logits``
  applies (vLLM itself samples at temperature 1 from our rows); :class:`RowTemperatures`
  tells the model each sampling row's temperature.
* :class:`SampleRecorder` records, for every sampled token, the full fp32 row of
  log-probabilities our ``compute_logits`` returned and which request/position it
  belongs to (:func:`external_request_id` maps vLLM's internal request ids back).
* :func:`generate_token_ids`: ``llm.generate`` on token-id prompts.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from .live import get_model, get_runner


TEMPERATURE_ARG = "unified_models_temperature"
"""``SamplingParams.extra_args`` key holding a request's sampling temperature."""


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
        self.model = get_model(llm)
        self.runner = get_runner(llm)
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
