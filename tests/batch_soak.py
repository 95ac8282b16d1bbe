"""Batch-composition soak (issue 18 item 2): shared logic of the CPU and GPU soak tests.

Property under test: a request's sampled tokens and the logprob bits vLLM reports for them are
a function of the request alone (its prompt, seed and temperature), never of which other
requests share its steps, in which order they arrived, how its prompt was split over steps
(chunked prefill), how much of it came from the prefix cache, or what batch size a CUDA graph
was captured at. The same :class:`SoakRequest` list is run in many compositions, on engines of
several configurations, and every request's result must be identical in all of them, bit for
bit (logprobs compared as int32 views of their fp32 values, see :func:`fp32_bits`).

Where a composition dependence could hide, and which composition here exercises it:

* a kernel whose tile/split/reduction order follows the number of rows or tokens in the step
  (``together`` vs ``one_at_a_time`` vs ``groups``);
* a request's row place in the batch, or host bookkeeping that maps rows to requests
  (``together`` in another order, ``groups``, ``staggered``);
* prefill vs chunked prefill vs decode paths, and a step mixing them (a small
  ``max_num_batched_tokens``; ``staggered`` admits prompts while others decode);
* the Mamba-2 state committed at chunk / block boundaries and resumed from the prefix cache
  (prefix caching on, requests sharing a long prefix, the whole set run twice);
* CUDA graphs (GPU): a decode graph captured at one padded batch size replayed with fewer live
  requests, or a branch frozen at capture (``max_num_seqs`` changes the captured sizes;
  :class:`StepSpy` counts the replays);
* sampling: each request carries its own seed, so its draws do not depend on the batch, and
  per-request temperatures (two values) make ``compute_logits`` group rows differently per step.

Results are grouped per request by their bits; a request with more than one group is a
composition dependence, reported with the compositions of each group and the first position
where they differ (:func:`composition_differences`). The tests assert there are none.

CPU note (:func:`cpu_seeded_chunked_prefill`): vLLM samples a row for every partial prefill,
discards it, and rewinds that request's ``torch.Generator`` by ``set_offset(get_offset() - 4)``
(one Philox draw on CUDA). A CPU generator has no offset ("CPU Generator does not use offset"),
which is why ``make_llm`` keeps chunked prefill off on the CPU with per-request seeds. The shim
gives the CPU generator the same semantics (the discarded draw does not advance the request's
stream) by restoring the state saved before sampling, so the CPU soak can cover chunked prefill
and hybrid prefix caching (which needs chunked prefill) with seeds. It changes no model number.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import random
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch


# --------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class SoakRequest:
    """One request, identical in every composition."""

    name: str
    prompt: tuple[int, ...]
    seed: int
    temperature: float
    max_tokens: int


def build_requests(n: int, *, new_tokens: int, min_len: int, max_len: int, shared_prefix_len: int = 0,
                   num_shared: int = 0, temperatures: Sequence[float] = (0.8, 1.0), vocab: int = 32000,
                   salt: int = 0) -> list[SoakRequest]:
    """``n`` requests with prompts of random lengths in ``[min_len, max_len]`` (ids from a seeded
    generator, so the set is the same in every run), per-request seeds ``1000 * salt + 17 i`` and
    temperatures cycling through ``temperatures``.

    The last ``num_shared`` requests share one prompt prefix of ``shared_prefix_len`` tokens, each
    continued by a tail of its own (1, 3, 5, 9, 17, 33 tokens, then longer), so that with prefix
    caching on they hit each other's cached blocks (whole blocks only) and compute the rest.
    """
    if num_shared > n:
        raise ValueError(f"num_shared={num_shared} > n={n}")
    g = torch.Generator().manual_seed(9173 + salt)
    rng = random.Random(4099 + salt)

    def ids(k: int) -> list[int]:
        return torch.randint(10, vocab, (k,), generator=g).tolist()

    prefix = ids(shared_prefix_len) if num_shared else []
    tails = [1, 3, 5, 9, 17, 33]
    out = []
    for i in range(n):
        j = i - (n - num_shared)
        prompt = prefix + ids(tails[j % len(tails)] + j // len(tails)) if j >= 0 else ids(rng.randint(min_len, max_len))
        out.append(SoakRequest(name=f"r{i:02d}", prompt=tuple(prompt), seed=1000 * salt + 17 * i,
                               temperature=float(temperatures[i % len(temperatures)]), max_tokens=new_tokens))
    return out


def sampling_params_of(req: SoakRequest, logprobs: int):
    from unified_models.backends.vllm.sampling import sampling_params

    return sampling_params(temperature=req.temperature, seed=req.seed, max_tokens=req.max_tokens, ignore_eos=True,
                           logprobs=logprobs, detokenize=False)


# --------------------------------------------------------------------------------- results
def fp32_bits(x: float) -> int:
    """The int32 bit pattern of ``x`` as an fp32 (vLLM hands back the fp32 logprob as a Python float:
    exact, so packing it to fp32 loses nothing; anything else is a bug here and raises)."""
    b = struct.pack("<f", x)
    if struct.unpack("<f", b)[0] != x and x == x:
        raise AssertionError(f"logprob {x!r} is not an fp32 value")
    return struct.unpack("<i", b)[0]


@dataclass(frozen=True)
class Sample:
    """What one request produced: token ids, the bits of each sampled token's logprob, and per
    position the returned logprob entries ``(token id, fp32 bits, rank)`` sorted by id (the sampled
    token and the top ``logprobs`` tokens of the row)."""

    tokens: tuple[int, ...]
    bits: tuple[int, ...]
    entries: tuple[tuple[tuple[int, int, int | None], ...], ...]

    @classmethod
    def from_output(cls, out) -> "Sample":
        c = out.outputs[0]
        toks = tuple(int(t) for t in c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(toks):
            raise AssertionError(f"request {out.request_id}: {len(toks)} tokens but "
                                 f"{None if c.logprobs is None else len(c.logprobs)} logprob entries")
        bits = tuple(fp32_bits(float(step[t].logprob)) for t, step in zip(toks, c.logprobs))
        entries = tuple(tuple(sorted((int(k), fp32_bits(float(v.logprob)), v.rank) for k, v in step.items()))
                        for step in c.logprobs)
        return cls(toks, bits, entries)

    def first_difference(self, other: "Sample") -> str:
        """The first position where ``other`` differs, in words (token, logprob value and bits)."""
        n = min(len(self.tokens), len(other.tokens))
        for j in range(n):
            if (self.tokens[j], self.bits[j], self.entries[j]) != (other.tokens[j], other.bits[j], other.entries[j]):
                def lp(b: int) -> str:
                    return f"{struct.unpack('<f', struct.pack('<i', b))[0]!r} (0x{b & 0xFFFFFFFF:08x})"

                def ent(e) -> str:
                    return ", ".join(f"{t}: {lp(b)} rank {r}" for t, b, r in e)

                return (f"token {j}: id {self.tokens[j]} logprob {lp(self.bits[j])} vs id {other.tokens[j]} "
                        f"logprob {lp(other.bits[j])}; entries [{ent(self.entries[j])}] vs [{ent(other.entries[j])}]")
        return f"lengths {len(self.tokens)} vs {len(other.tokens)}"


@dataclass
class Composition:
    """One composition's results: ``samples`` by request name, plus what the engine did."""

    name: str
    samples: dict[str, Sample]
    cached_tokens: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# --------------------------------------------------------------------------------- compositions
def _tokens_prompt(req: SoakRequest):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(req.prompt))


def run_generate(llm, reqs: Sequence[SoakRequest], logprobs: int) -> tuple[dict[str, Sample], dict[str, int]]:
    """One ``llm.generate`` over ``reqs`` in the given order."""
    outs = llm.generate([_tokens_prompt(r) for r in reqs], [sampling_params_of(r, logprobs) for r in reqs],
                        use_tqdm=False)
    if len(outs) != len(reqs):
        raise AssertionError(f"{len(reqs)} requests, {len(outs)} outputs")
    return ({r.name: Sample.from_output(o) for r, o in zip(reqs, outs)},
            {r.name: int(o.num_cached_tokens or 0) for r, o in zip(reqs, outs)})


def run_groups(llm, groups: Sequence[Sequence[SoakRequest]], logprobs: int
               ) -> tuple[dict[str, Sample], dict[str, int]]:
    """One ``llm.generate`` per group, in turn (one request per group = one at a time)."""
    samples: dict[str, Sample] = {}
    cached: dict[str, int] = {}
    for grp in groups:
        s, c = run_generate(llm, grp, logprobs)
        samples.update(s)
        cached.update(c)
    return samples, cached


def run_staggered(llm, arrivals: Sequence[tuple[int, SoakRequest]], logprobs: int, tag: str
                  ) -> tuple[dict[str, Sample], dict[str, int]]:
    """Requests arrive while others decode: ``(engine step, request)`` pairs, added through
    ``llm.llm_engine.add_request`` before that step of a ``step()`` loop (steps with nothing to do
    are skipped: the next arrival comes at once)."""
    from unified_models.backends.vllm.sampling import external_request_id

    eng = llm.llm_engine
    if eng.has_unfinished_requests():
        raise AssertionError("staggered composition needs an idle engine")
    pending = sorted(arrivals, key=lambda a: a[0])
    by_id = {f"{tag}.{r.name}": r for _, r in pending}
    samples: dict[str, Sample] = {}
    cached: dict[str, int] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        if not eng.has_unfinished_requests():
            step = max(step, pending[0][0])
        while pending and pending[0][0] <= step:
            _, r = pending.pop(0)
            eng.add_request(f"{tag}.{r.name}", _tokens_prompt(r), sampling_params_of(r, logprobs))
        for out in eng.step():
            if out.finished:
                r = by_id.get(out.request_id) or by_id[external_request_id(out.request_id)]
                samples[r.name] = Sample.from_output(out)
                cached[r.name] = int(out.num_cached_tokens or 0)
        step += 1
    missing = sorted(set(r.name for r in by_id.values()) - set(samples))
    if missing:
        raise AssertionError(f"staggered composition {tag}: no output for {missing}")
    return samples, cached


def random_groups(reqs: Sequence[SoakRequest], rng: random.Random, sizes: Sequence[int]) -> list[list[SoakRequest]]:
    """``reqs`` shuffled and cut into consecutive groups of ``sizes`` (cycled until every request is placed)."""
    order = list(reqs)
    rng.shuffle(order)
    out, i, k = [], 0, 0
    while i < len(order):
        n = max(1, sizes[k % len(sizes)])
        out.append(order[i:i + n])
        i += n
        k += 1
    return out


def random_arrivals(reqs: Sequence[SoakRequest], rng: random.Random, spread: int) -> list[tuple[int, SoakRequest]]:
    """Each request arrives at a random step in ``[0, spread]``, in a shuffled order (request 0 of the
    shuffle at step 0, so the loop starts at once)."""
    order = list(reqs)
    rng.shuffle(order)
    return [(0 if i == 0 else rng.randint(0, spread), r) for i, r in enumerate(order)]


# --------------------------------------------------------------------------------- what ran
class StepSpy:
    """Records, for one engine, what every model step was and whether our model's Python forward ran.

    * ``execute_model`` of the in-process V1 runner is wrapped (instance attribute) to read the
      scheduler output: per request the start position (``num_computed_tokens``), the number of
      scheduled tokens and the prompt length (remembered from when it was new). From these: a
      *prefill segment* starts before the end of the prompt, a *split prefill* ends before it (chunked
      prefill), a *mixed step* has a prefill segment and a decode token, a *uniform decode step* has
      one decode token per request (what ``FULL_DECODE_ONLY`` captures).
    * our model's ``forward`` is wrapped (instance attribute; ``nn.Module.__call__`` looks it up)
      to count the calls outside CUDA-graph capture: a replayed graph runs no Python, so
      ``replays = steps - eager_forwards``. With graphs on, every uniform decode step of a batch size
      that vLLM captured a ``FULL`` graph for must replay, and no other step may: vLLM's
      ``CudagraphDispatcher`` keys uniform decode graphs only for capture sizes
      ``<= max_num_seqs`` (``vllm/v1/cudagraph_dispatcher.py``), so with ``max_num_seqs = 13`` and
      sizes ``[1, 2, 4, 8, 16, ...]`` a decode batch of 9-13 requests runs eagerly, natively too.

    Use as a context manager around the compositions of one engine (not around engine start:
    vLLM's warm-up and capture runs are not steps).
    """

    def __init__(self, llm):
        from unified_models.backends.vllm.live import get_model, get_runner

        self.runner = get_runner(llm)
        self.model = get_model(llm)
        self.prompt_len: dict[str, int] = {}
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (start, scheduled, prompt_len) per request
        self.eager_forwards = 0

    def __enter__(self) -> "StepSpy":
        runner, model = self.runner, self.model
        execute, forward = runner.execute_model, model.forward

        def execute_model(scheduler_output, *a, **kw):
            self._record(scheduler_output)
            return execute(scheduler_output, *a, **kw)

        def counted_forward(*a, **kw):
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                self.eager_forwards += 1
            return forward(*a, **kw)

        runner.execute_model = execute_model
        model.forward = counted_forward
        return self

    def __exit__(self, *exc) -> None:
        self.runner.__dict__.pop("execute_model", None)
        self.model.__dict__.pop("forward", None)

    def _record(self, so) -> None:
        if int(so.total_num_scheduled_tokens) == 0:
            return
        start: dict[str, int] = {}
        for r in so.scheduled_new_reqs:
            self.prompt_len[r.req_id] = len(r.prompt_token_ids)
            start[r.req_id] = int(r.num_computed_tokens)
        c = so.scheduled_cached_reqs
        for rid, n in zip(c.req_ids, c.num_computed_tokens):
            start[rid] = int(n)
        self.steps.append([(start[rid], int(n), self.prompt_len[rid]) for rid, n in so.num_scheduled_tokens.items()])

    def summary(self) -> dict[str, Any]:
        def prefill(s, n, p):
            return s < p

        split = sum(1 for st in self.steps for s, n, p in st if s < p and s + n < p)
        mixed = sum(1 for st in self.steps if any(prefill(*e) for e in st) and any(not prefill(*e) for e in st))
        uniform = sum(1 for st in self.steps if all(s >= p and n == 1 for s, n, p in st))
        return {
            "steps": len(self.steps),
            "uniform_decode_steps": uniform,
            "mixed_prefill_decode_steps": mixed,
            "split_prefill_segments": split,
            "max_requests_per_step": max((len(st) for st in self.steps), default=0),
            "max_tokens_per_step": max((sum(n for _, n, _ in st) for st in self.steps), default=0),
            "decode_batch_sizes": sorted({len(st) for st in self.steps if all(s >= p and n == 1 for s, n, p in st)}),
            "uniform_decode_steps_by_batch_size": dict(sorted(collections.Counter(
                len(st) for st in self.steps if all(s >= p and n == 1 for s, n, p in st)).items())),
            "eager_forwards": self.eager_forwards,
            "graph_replays": len(self.steps) - self.eager_forwards,
        }


@contextlib.contextmanager
def cpu_seeded_chunked_prefill(llm) -> Iterator[dict[str, int]]:
    """CPU only: vLLM's rewind of a seeded request's generator after a discarded partial-prefill
    sample, done by state (module doc). Wraps the runner's ``_sample`` (save the state of every
    generator whose row will be discarded, before it draws) and ``_bookkeeping_sync`` (hide those
    generators from vLLM's ``set_offset`` loop, then restore the saved states). Yields
    ``{"rewinds": n}``, the number of rewinds done so far."""
    import numpy as np

    from unified_models.backends.vllm.live import get_runner

    runner = get_runner(llm)
    sample, bookkeeping = runner._sample, runner._bookkeeping_sync
    saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
    count = {"rewinds": 0}

    def _sample(*a, **kw):
        saved.clear()
        ib = runner.input_batch
        for i in np.nonzero(runner.discard_request_mask.np[:ib.num_reqs])[0]:
            g = ib.generators.get(int(i))
            if g is not None:
                saved[int(i)] = (g, g.get_state())
        return sample(*a, **kw)

    def _bookkeeping_sync(*a, **kw):
        ib = runner.input_batch
        full = ib.generators
        ib.generators = {i: g for i, g in full.items() if i not in saved}
        try:
            return bookkeeping(*a, **kw)
        finally:
            ib.generators = full
            for g, state in saved.values():
                g.set_state(state)
                count["rewinds"] += 1
            saved.clear()

    runner._sample, runner._bookkeeping_sync = _sample, _bookkeeping_sync
    try:
        yield count
    finally:
        runner.__dict__.pop("_sample", None)
        runner.__dict__.pop("_bookkeeping_sync", None)


@contextlib.contextmanager
def torch_trace_uncaptured() -> Iterator[None]:
    """Detach pytest's log-capture handlers from torch's structured-trace logger for a while.

    pytest attaches its handlers to every non-propagating logger, ``torch.__trace`` included, and
    torch then builds every structured-trace payload whenever it compiles: vLLM ``torch.compile`` s
    its logprob-rank helper (``batched_count_greater_than``) on the first step that returns
    logprobs, which took ~45 s instead of ~2 s on a 2-core host. Only logging changes; the handlers
    (those the root logger also has) are put back on exit.
    """
    trace = logging.getLogger("torch.__trace")
    root = set(logging.getLogger().handlers)
    taken = [h for h in trace.handlers if h in root]
    for h in taken:
        trace.removeHandler(h)
    try:
        yield
    finally:
        for h in taken:
            trace.addHandler(h)


# --------------------------------------------------------------------------------- the soak
@dataclass
class EngineConfig:
    """One engine configuration (``make_llm`` keyword arguments) and the compositions run on it."""

    name: str
    kwargs: dict[str, Any]
    compositions: Sequence[str]


class Soak:
    """Runs :class:`EngineConfig` s one engine at a time over the same requests and keeps every result.

    Args:
        model_dir: checkpoint.
        device: ``"cpu"`` or ``"cuda"``.
        make_requests: ``block_size -> requests``, called once, with the block size of the first
            engine (run the prefix-caching configuration first so that a shared prefix spans whole blocks).
        logprobs: ``SamplingParams.logprobs`` (>= 1: the top tokens' logprobs are compared too).
        seed: drives the random orders, groups and arrivals.
        report_path: where :meth:`report` is written (JSON) after every engine, so a run stopped
            part way still leaves what it did; ``None``: not written.
    """

    def __init__(self, model_dir, *, device: str, make_requests: Callable[[int], list[SoakRequest]],
                 logprobs: int = 1, seed: int = 0, report_path=None):
        self.model_dir = Path(model_dir)
        self.device = device
        self.make_requests = make_requests
        self.requests: list[SoakRequest] | None = None
        self.logprobs = logprobs
        self.rng = random.Random(seed)
        self.results: list[Composition] = []
        self.engines: dict[str, dict[str, Any]] = {}
        self.report_path = report_path

    def run(self, cfg: EngineConfig) -> dict[str, Any]:
        """Start ``cfg``'s engine, run its compositions, record what the engine did, shut it down."""
        with torch_trace_uncaptured():
            info = self._run(cfg)
        if self.report_path is not None:
            self.write_report(self.report_path)
        return info

    def _run(self, cfg: EngineConfig) -> dict[str, Any]:
        from unified_models.backends.vllm import engine
        from unified_models.backends.vllm.live import cuda_graphs_ran, engine_settings

        t0 = time.perf_counter()
        kwargs = dict(seed=0, gpu=self.device == "cuda", skip_tokenizer_init=True, max_logprobs=max(self.logprobs, 1))
        kwargs.update(cfg.kwargs)
        llm = engine.make_llm(self.model_dir, **kwargs)
        try:
            start_s = time.perf_counter() - t0
            settings = engine_settings(llm)
            settings["cuda_graphs"] = cuda_graphs_ran(llm)
            cc = llm.llm_engine.vllm_config.compilation_config
            settings["cudagraph_capture_sizes"] = list(getattr(cc, "cudagraph_capture_sizes", None) or [])
            if self.requests is None:
                self.requests = self.make_requests(int(settings["block_size"]))
            shim = (cpu_seeded_chunked_prefill(llm) if self.device == "cpu" and settings["enable_chunked_prefill"]
                    else contextlib.nullcontext())
            with StepSpy(llm) as spy, shim as rewound:
                for comp in cfg.compositions:
                    self.results.append(self._composition(llm, f"{cfg.name}/{comp}", comp))
            info = {"settings": settings, "schedule": spy.summary(), "engine_start_s": round(start_s, 2),
                    "seconds": round(time.perf_counter() - t0, 2),
                    "cpu_seeded_rewinds": None if rewound is None else rewound["rewinds"]}
        finally:
            engine.shutdown_llm(llm)
            del llm
        self.engines[cfg.name] = info
        return info

    def _composition(self, llm, name: str, kind: str) -> Composition:
        reqs = list(self.requests)
        lp = self.logprobs
        t0 = time.perf_counter()
        if kind == "together":
            s, c = run_generate(llm, reqs, lp)
        elif kind == "together_again":  # the same, after a pass that filled the prefix cache
            s, c = run_generate(llm, reqs, lp)
        elif kind == "reversed":
            s, c = run_generate(llm, reqs[::-1], lp)
        elif kind == "shuffled":
            order = list(reqs)
            self.rng.shuffle(order)
            s, c = run_generate(llm, order, lp)
        elif kind == "one_at_a_time":
            order = list(reqs)
            self.rng.shuffle(order)
            s, c = run_groups(llm, [[r] for r in order], lp)
        elif kind == "groups":
            s, c = run_groups(llm, random_groups(reqs, self.rng, (3, 1, 5, 2)), lp)
        elif kind == "staggered":
            spread = max(2, 2 * reqs[0].max_tokens)
            s, c = run_staggered(llm, random_arrivals(reqs, self.rng, spread), lp, tag=name.replace("/", "."))
        else:
            raise ValueError(f"unknown composition {kind!r}")
        if set(s) != {r.name for r in reqs}:
            raise AssertionError(f"{name}: results for {sorted(s)}, expected every request")
        for r in reqs:
            if len(s[r.name].tokens) != r.max_tokens:
                raise AssertionError(f"{name}: {r.name} has {len(s[r.name].tokens)} tokens, asked {r.max_tokens}")
        return Composition(name, s, c, round(time.perf_counter() - t0, 2))

    # ----------------------------------------------------------------------------- verdict
    def composition_differences(self) -> list[str]:
        """Per request, the compositions grouped by identical results; one line per request with more
        than one group, naming the groups and the first difference from the largest group."""
        lines = []
        for r in self.requests or []:
            groups: dict[Sample, list[str]] = {}
            for comp in self.results:
                groups.setdefault(comp.samples[r.name], []).append(comp.name)
            if len(groups) > 1:
                ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
                ref, ref_names = ranked[0]
                for other, names in ranked[1:]:
                    lines.append(f"{r.name} (prompt {len(r.prompt)} tokens, seed {r.seed}, T {r.temperature}): "
                                 f"{names} differ from {ref_names}: {ref.first_difference(other)}")
        return lines

    def report(self) -> dict[str, Any]:
        reqs = self.requests or []
        return {
            "device": self.device,
            "model_dir": str(self.model_dir),
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "new_tokens": sum(r.max_tokens for r in reqs),
            "compositions": [{"name": c.name, "seconds": c.seconds,
                              "prefix_cache_hit_requests": sum(1 for v in c.cached_tokens.values() if v > 0),
                              "prefix_cache_hit_tokens": sum(c.cached_tokens.values())} for c in self.results],
            "engines": self.engines,
            "differences": self.composition_differences(),
        }

    def summary_text(self, title: str, seconds: float) -> str:
        """What ran, for the test log: requests, per engine its graph settings, start time and schedule,
        per composition its time and prefix-cache hits."""
        rep = self.report()
        lines = [f"{title}: {rep['requests']} requests, {rep['prompt_tokens']} prompt + {rep['new_tokens']} new "
                 f"tokens, {len(rep['compositions'])} compositions in {seconds:.1f} s"]
        for name, e in rep["engines"].items():
            s = e["settings"]
            lines.append(f"  {name}: cuda_graphs {s['cuda_graphs']} mode {s['cudagraph_mode']} compilation "
                         f"{s['compilation_mode']} capture sizes {s['cudagraph_capture_sizes']} "
                         f"block {s['block_size']}; start {e['engine_start_s']} s, total {e['seconds']} s, "
                         f"CPU seeded rewinds {e['cpu_seeded_rewinds']}\n    schedule {e['schedule']}")
        for c in rep["compositions"]:
            lines.append(f"  {c['name']}: {c['seconds']} s, prefix-cache hits {c['prefix_cache_hit_requests']} "
                         f"requests / {c['prefix_cache_hit_tokens']} tokens")
        return "\n".join(lines)

    def write_report(self, path=None) -> dict[str, Any]:
        path = path if path is not None else self.report_path
        rep = self.report()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rep, indent=2, default=str))
        return rep

    def assert_schedule_and_bits(self, *, expect_graphs: bool, chunked_engine: str, prefix_engine: str) -> None:
        """The assertions both tests share, in the order of their diagnostic value: the bits first
        (the property), then that the compositions really were what they claim."""
        diffs = self.composition_differences()
        assert not diffs, (f"{len(diffs)} composition dependence(s) over {len(self.results)} compositions:\n  "
                           + "\n  ".join(diffs))
        assert len(self.results) >= 8 and len({c.name for c in self.results}) == len(self.results)
        ch = self.engines[chunked_engine]["schedule"]
        assert ch["split_prefill_segments"] > 0, f"{chunked_engine}: no prompt was split over steps: {ch}"
        assert ch["mixed_prefill_decode_steps"] > 0, f"{chunked_engine}: no step mixed prefill and decode: {ch}"
        hits = [c for c in self.results if c.name.startswith(prefix_engine + "/")
                and any(v > 0 for v in c.cached_tokens.values())]
        assert hits, f"{prefix_engine}: no prefix-cache hit in {[c.name for c in self.results]}"
        sizes = {n: tuple(e["schedule"]["decode_batch_sizes"]) for n, e in self.engines.items()}
        assert len(set(sizes.values())) > 1, f"every engine ran the same decode batch sizes: {sizes}"
        for name, e in self.engines.items():
            s, sch = e["settings"], e["schedule"]
            assert sch["steps"] > 0 and sch["uniform_decode_steps"] > 0, (name, sch)
            if expect_graphs:
                mode = str(s["cudagraph_mode"]).rsplit(".", 1)[-1]
                assert s["cuda_graphs"] is True and mode == "FULL_DECODE_ONLY", (name, s)
                assert s["cudagraph_capture_sizes"], (name, s)
                assert str(s["compilation_mode"]).rsplit(".", 1)[-1] in ("0", "NONE"), (name, s)
                # every decode step of a captured size (padded up to one) replayed a graph; every other
                # step ran our forward eagerly (StepSpy's docstring: vLLM keys decode graphs <= max_num_seqs)
                largest = max(b for b in s["cudagraph_capture_sizes"] if b <= s["max_num_seqs"])
                replayable = sum(k for b, k in sch["uniform_decode_steps_by_batch_size"].items() if b <= largest)
                assert sch["graph_replays"] == replayable > 0, (name, largest, sch)
            else:
                assert s["cuda_graphs"] is False and s["enforce_eager"] is True, (name, s)
                assert sch["graph_replays"] == 0 and sch["eager_forwards"] == sch["steps"], (name, sch)
        if expect_graphs:  # some decode batch ran in a graph captured for a larger size (padded rows)
            padded = {n: [b for b in e["schedule"]["decode_batch_sizes"]
                          if b not in e["settings"]["cudagraph_capture_sizes"]] for n, e in self.engines.items()}
            assert any(padded.values()), f"every decode batch size was a capture size: {padded}"
