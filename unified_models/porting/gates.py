"""``unified-models gates``: the porting gates C0-C9 on the CPU, one JSON record per gate.

Each gate is one function that measures, and a record with its explicit pass
condition, the measured values and a status ``pass`` / ``fail`` / ``not-run``
(with the reason). ``docs/porting.md`` walks a new architecture through them.

* C0 inventory: the spec from the checkpoint's config (modules, precisions, formats) and what is refused;
* C1 native baseline: needs the GPU benchmark, recorded ``not-run`` on the CPU (never a pass);
* C2-C4 self-consistency on a cut model (the shortest prefix of blocks holding every
  operator class of the model), through the trainer's state store: alone vs batched
  (packing and order), whole prompt vs token by token, prefill + decode and chunked
  prefill in mixed batches; bitwise;
* C5 ``check``: vLLM rollout == Megatron recompute, bitwise, peer within tolerance;
* C6 fp32 trainer forward vs our fp64 reference; C7 gradients vs fp64 autograd (cut model);
* C8 two consecutive ``rl`` updates: diff = 0 before each update, the update reaches vLLM
  and the policy moves; C9 the first step after a resume equals the uninterrupted run's.

Exit status: 0 when no gate failed (not-run gates are listed, not counted as passes), 1 otherwise.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from ..dsl import UnifiedModelsError
from ..arg_types import add_plugin_flag, positive

__all__ = ["GateRecord", "GATES", "run_gates", "cut_model", "add_parser", "run"]


@dataclass
class GateRecord:
    """One gate's JSON record."""

    gate: str
    title: str
    command: str
    pass_condition: str
    status: str = "not-run"
    values: dict = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0


@dataclass
class GateContext:
    """What every gate reads: the checkpoint once, options, a scratch directory."""

    model_dir: Path
    model_arg: str
    hf_config: object
    spec: object
    state_dict: dict
    device: str
    work: Path
    num_prompts: int
    max_new_tokens: int
    rl_steps: int


def _bits(t: torch.Tensor) -> torch.Tensor:
    from .compare import bits

    return bits(t.detach().cpu())


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bitwise comparison values of two equally shaped tensors."""
    same_shape = a.shape == b.shape
    n = int((_bits(a) != _bits(b)).sum()) if same_shape else a.numel()
    d = float((a.double() - b.double()).abs().max()) if same_shape and a.numel() else (0.0 if same_shape else float("inf"))
    return {"elements": int(a.numel()), "differing_elements": n, "max_abs_diff": d}


def operator_class(mixer) -> tuple:
    """A mixer's operator class: its spec type, and where one spec type runs different operators,
    the variant (DeepSeek-V4's attention ``layer_type``: sliding, CSA, HCA; its MoE's hash routing)."""
    return type(mixer), getattr(mixer, "layer_type", None), getattr(mixer, "hash_routing", None)


def cut_model(spec, state_dict):
    """The shortest prefix of blocks that holds every operator class of ``spec`` (:func:`operator_class`;
    and its weights). A residual policy with one site per sublayer (mHC) keeps the cut sublayers' sites.

    Returns:
        ``(cut spec, its state dict, number of blocks)``.
    """
    import dataclasses

    kinds = {operator_class(sub.mixer) for sub in spec.sublayers}
    seen: set = set()
    k = 0
    for k, block in enumerate(spec.blocks, start=1):
        seen |= {operator_class(sub.mixer) for sub in block.sublayers}
        if seen == kinds:
            break
    blocks = spec.blocks[:k]
    residual = spec.residual
    if getattr(residual, "sites", None) is not None:
        kept = {sub.norm.name for blk in blocks for sub in blk.sublayers}
        residual = dataclasses.replace(residual, sites=tuple(s for s in residual.sites if s[0] in kept))
    cut = spec.replace(blocks=blocks, residual=residual)
    names = set(cut.parameter_shapes())
    return cut, {n: t for n, t in state_dict.items() if n in names}, k


def _seqs(lens: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 32000), (n,), generator=g) for n in lens]


def _hidden(spec, params, seqs, store=None, starts=None) -> list[torch.Tensor]:
    """The trainer store's forward of sequences (or chunks) packed in one batch, split back per sequence."""
    from ..forward import forward_hidden
    from ..private_state import PrivateStateStore
    from ..state import FlatBatch

    ids = torch.cat(seqs)
    cu = torch.tensor([0, *map(len, seqs)]).cumsum(0)
    batch = FlatBatch.from_cu_seqlens(ids, cu, None if starts is None else torch.tensor(starts))
    store = store or PrivateStateStore(spec, [len(s) for s in seqs], block_size=16)
    store.bind(batch)
    with torch.no_grad():
        h = forward_hidden(spec, params, batch, store)
    return [h[int(cu[i]):int(cu[i + 1])] for i in range(len(seqs))]


def _logprob_rows(spec, params, h: torch.Tensor) -> torch.Tensor:
    from ..forward import forward_logprobs

    with torch.no_grad():
        return forward_logprobs(spec, params, h)


def _merge(values: list[dict]) -> dict:
    return {"comparisons": len(values), "elements": sum(v["elements"] for v in values),
            "differing_elements": sum(v["differing_elements"] for v in values),
            "max_abs_diff": max(v["max_abs_diff"] for v in values)}


# ----------------------------------------------------------------------------- gates

def gate_c0(ctx: GateContext, rec: GateRecord) -> None:
    from ..backends.vllm.settings import check_spec_supported

    spec = ctx.spec
    mixers: dict[str, int] = {}
    for sub in spec.sublayers:
        mixers[type(sub.mixer).__name__] = mixers.get(type(sub.mixer).__name__, 0) + 1
    dtypes = sorted({str(d).removeprefix("torch.") for d in spec.parameter_dtypes().values()})
    refused = ["tensor parallelism > 1 (DESIGN rule 7: cross-GPU reductions stay outside the compared path)",
               "pipeline parallelism (the vLLM class refuses intermediate_tensors)",
               "prompt embeddings (inputs_embeds)"]
    serving = "ok"
    try:
        check_spec_supported(spec)
    except UnifiedModelsError as e:
        serving = str(e)
    rec.values = {"family": spec.family, "architecture": spec.architecture, "hf_architecture": spec.hf_architecture,
                  "blocks": len(spec.blocks), "sublayers_by_type": mixers, "pattern": spec.extra.get("pattern"),
                  "parameters": sum(torch.Size(s).numel() for s in spec.parameter_shapes().values()),
                  "tensors": len(spec.parameter_shapes()), "checkpoint_tensors": len(ctx.state_dict),
                  "model_dtype": str(spec.dtype).removeprefix("torch."), "stored_dtypes": dtypes,
                  "weight_formats": sorted({f.format for _, f in spec.weight_formats}),
                  "residual": type(spec.residual).__name__, "vllm_serving": serving, "refused": refused}
    rec.status = "pass" if serving == "ok" and len(ctx.state_dict) >= len(spec.parameter_shapes()) else "fail"


def gate_c1(ctx: GateContext, rec: GateRecord) -> None:
    rec.status = "not-run"
    rec.reason = ("C1 needs the GPU benchmark: run the benchmark of the native vLLM class on the H200 "
                  "(benchmarks/, docs/porting.md C1) and keep its result file; a CPU run measures nothing")


def gate_c2(ctx: GateContext, rec: GateRecord) -> None:
    spec, params, k = cut_model(ctx.spec, ctx.state_dict)
    seqs = _seqs([37, 1, 70, 16, 5], spec.vocab_size, seed=2)
    packed = _hidden(spec, params, seqs)
    reordered = _hidden(spec, params, seqs[::-1])[::-1]
    vals = []
    for i, s in enumerate(seqs):
        alone = _hidden(spec, params, [s])[0]
        vals += [_diff(packed[i], alone), _diff(packed[i], reordered[i])]
        vals.append(_diff(_logprob_rows(spec, params, packed[i]), _logprob_rows(spec, params, alone)))
    rec.values = {"cut_blocks": k, "sequence_lengths": [len(s) for s in seqs], **_merge(vals)}
    rec.status = "pass" if rec.values["differing_elements"] == 0 else "fail"


def gate_c3(ctx: GateContext, rec: GateRecord) -> None:
    from ..private_state import PrivateStateStore

    spec, params, k = cut_model(ctx.spec, ctx.state_dict)
    s = _seqs([40], spec.vocab_size, seed=3)[0]
    whole = _hidden(spec, params, [s])[0]
    store = PrivateStateStore(spec, [len(s)], block_size=16)
    steps = [_hidden(spec, params, [s[p:p + 1]], store=store, starts=[p])[0] for p in range(len(s))]
    tok = torch.cat(steps)
    rec.values = {"cut_blocks": k, "tokens": len(s), **_merge([_diff(whole, tok), _diff(
        _logprob_rows(spec, params, whole), _logprob_rows(spec, params, tok))])}
    rec.status = "pass" if rec.values["differing_elements"] == 0 else "fail"


def gate_c4(ctx: GateContext, rec: GateRecord) -> None:
    from ..private_state import PrivateStateStore

    spec, params, k = cut_model(ctx.spec, ctx.state_dict)
    lens = [53, 40, 35]
    seqs = _seqs(lens, spec.vocab_size, seed=4)
    full = _hidden(spec, params, seqs)
    plan = [[13, 2, 1, 20, 1, 1, 1, 14], [16, 0, 17, 1, 1, 5, 0, 0], [1, 1, 1, 30, 0, 1, 0, 1]]
    store = PrivateStateStore(spec, lens, block_size=16)
    pos, got = [0, 0, 0], [[] for _ in lens]
    for step in range(len(plan[0])):
        live = [b for b in range(len(lens)) if plan[b][step]]
        chunks = [seqs[b][pos[b]:pos[b] + plan[b][step]] for b in range(len(lens))]
        out = _hidden(spec, params, chunks, store=store, starts=list(pos))
        for b in live:
            got[b].append(out[b])
        for b in range(len(lens)):
            pos[b] += plan[b][step]
    vals = [_diff(torch.cat(got[b]), full[b]) for b in range(len(lens))]
    rec.values = {"cut_blocks": k, "sequence_lengths": lens, "chunk_plan": plan, **_merge(vals)}
    rec.status = "pass" if rec.values["differing_elements"] == 0 else "fail"


def gate_c5(ctx: GateContext, rec: GateRecord) -> None:
    from ..check import CheckOptions, run_check

    out = ctx.work / "c5_check.json"
    status = run_check(CheckOptions(model=str(ctx.model_dir), num_prompts=ctx.num_prompts,
                                    max_new_tokens=ctx.max_new_tokens, device=ctx.device, json_out=str(out)))
    r = json.loads(out.read_text())
    rec.values = {k: r.get(k) for k in ("tokens_compared", "max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl",
                                        "num_mismatched", "full_vocab_rows", "full_vocab_max_abs_diff",
                                        "rollout_sha256")}
    rec.values["peer_max_rel_logit_diff"] = r["peer"]["max_rel_logit_diff"]
    rec.values["peer_tolerance"] = r["peer"]["tolerance"]
    rec.status = "pass" if status == 0 and r["passed"] else "fail"


def _fp32_models(ctx: GateContext):
    from ..backends.megatron import UnifiedMegatronModel, init_parallel_state
    from ..backends.reference import ReferenceModel

    spec, params, k = cut_model(ctx.spec, ctx.state_dict)
    spec32 = spec.replace(dtype=torch.float32)
    sd32 = {n: t.float() if t.is_floating_point() else t for n, t in params.items()}
    init_parallel_state()
    model = UnifiedMegatronModel(spec32, device="cpu")
    model.load_hf_state_dict(sd32)
    ref = ReferenceModel(spec32, dtype=torch.float64)
    ref.load_state_dict_hf(sd32)
    return spec32, model, ref, k


def _float_requires_grad(module) -> None:
    for p in module.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)


def gate_c6_c7(ctx: GateContext, c6: GateRecord, c7: GateRecord) -> None:
    import inspect

    from ..backends.reference import ReferenceModel

    if ctx.spec.stores_quantized_weights or ctx.spec.weight_formats:
        for rec in (c6, c7):
            rec.reason = "quantized checkpoint: run C6/C7 on its bf16 source (the fp64 reference takes masters)"
        return
    spec, model, ref, k = _fp32_models(ctx)
    seqs = _seqs([21, 34], spec.vocab_size, seed=5)
    cu = torch.tensor([0, 21, 55])
    temperature = 0.9
    _float_requires_grad(model)  # integer tables (DeepSeek-V4's tid2eid) take no gradient
    model.zero_grad(set_to_none=True)
    tok = model.token_logprobs(torch.cat(seqs), cu, temperature=temperature)
    tok.sum().backward()
    logits = inspect.unwrap(ReferenceModel.logits)
    _float_requires_grad(ref.params)
    total, want = 0, []
    for s in seqs:
        lp = torch.log_softmax(logits(ref, s) / temperature, dim=-1)
        want.append(lp[:-1].gather(1, s[1:, None])[:, 0])
        total = total + want[-1].sum()
    total.backward()
    fwd = float((tok.double() - torch.cat(want)).abs().max())
    c6.values = {"cut_blocks": k, "tokens": int(tok.numel()), "max_abs_logprob_diff": fwd, "bound": 1e-4}
    c6.status = "pass" if fwd < 1e-4 else "fail"
    errs, untrained = {}, []
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        w = ref.p(name).grad
        if w is None or float(w.abs().max()) == 0.0:
            untrained.append(name)
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        errs[name] = float((g.double() - w).norm() / w.norm())
    worst = max(errs, key=errs.get)
    c7.values = {"cut_blocks": k, "parameters_checked": len(errs), "without_gradient": untrained,
                 "worst_relative_error": errs[worst], "worst_parameter": worst, "bound": 1e-4}
    c7.status = "pass" if errs[worst] < 1e-4 else "fail"


def _rl(ctx: GateContext, metrics: Path, steps: int, save: Path | None = None, resume: Path | None = None,
        save_every: int = 0) -> int:
    from ..rl.loop import run_rl
    from ..rl.options import RLOptions

    # token-set: a dense reward whose groups differ from step 1 on any model (with target-token all of a
    # group's samples can score alike, zero advantages, no update: DeepSeek-V4's tiny preset in steps 1-2)
    opts = RLOptions(model=str(ctx.model_dir), reward="token-set", steps=steps, group_size=4, num_prompts_per_step=2, max_new_tokens=6,
                     full_vocab_rows=12, seed=3, lr=1e-3, device=ctx.device, metrics=str(metrics), plot=False,
                     save=str(save) if save else None, save_every=save_every,
                     resume=str(resume) if resume else None)
    return run_rl(opts)


def _diff_zero(row: dict) -> bool:
    return (row["max_abs_diff"] == 0.0 and row["num_mismatched"] == 0 and row["full_vocab_max_abs_diff"] == 0.0
            and row["importance_ratio_max"] == 1.0 and row["importance_ratio_min"] == 1.0)


def gate_c8_c9(ctx: GateContext, c8: GateRecord, c9: GateRecord) -> None:
    from ..rl.metrics import read_metrics

    n = ctx.rl_steps
    a = ctx.work / "rl_a"
    status = _rl(ctx, a / "m.jsonl", n, save=a / "ckpt", save_every=n - 1)
    rows = read_metrics(a / "m.jsonl")
    c8.values = {"steps": [r["step"] for r in rows], "exit_status": status,
                 "diff_zero_every_step": all(_diff_zero(r) for r in rows),
                 "max_abs_diff": [r["max_abs_diff"] for r in rows],
                 "tokens_compared": [r["tokens_compared"] for r in rows],
                 "sync_tensors_copied": [r.get("sync_tensors_copied") for r in rows],
                 "rollout_sha256": [r["rollout_sha256"][:16] for r in rows],
                 "reward_mean": [r["reward_mean"] for r in rows]}
    moved = len({r["rollout_sha256"] for r in rows}) == len(rows) and all((r.get("sync_tensors_copied") or 0) > 0
                                                                          for r in rows)
    c8.values["policy_moved"] = moved
    c8.status = "pass" if status == 0 and len(rows) == n and c8.values["diff_zero_every_step"] and moved else "fail"
    b = ctx.work / "rl_b"
    status_b = _rl(ctx, b / "m.jsonl", n, resume=a / "ckpt" / f"iter_{n - 1:07d}")
    rows_b = read_metrics(b / "m.jsonl")
    after = [r for r in rows_b if r["step"] == n]
    want = [r for r in rows if r["step"] == n]
    keys = ("rollout_sha256", "loss", "reward_mean", "max_abs_diff")
    same = bool(after and want and all(after[0].get(k) == want[0].get(k) for k in keys))
    c9.values = {"resumed_from_step": n - 1, "exit_status": status_b, "compared": list(keys),
                 "resumed": {k: after[0].get(k) for k in keys} if after else None,
                 "uninterrupted": {k: want[0].get(k) for k in keys} if want else None,
                 "diff_zero": bool(after) and _diff_zero(after[0])}
    c9.status = "pass" if status_b == 0 and same and c9.values["diff_zero"] else "fail"


GATES: list[tuple[str, str, str, str]] = [
    ("C0", "inventory", "unified-models inspect MODEL",
     "the spec builds from config.json, every spec tensor is in the checkpoint with its shape and dtype, and the "
     "vLLM class accepts the spec; values list modules, precisions, formats and what is refused"),
    ("C1", "native baseline", "python benchmarks/... on the H200 (GPU only)",
     "the native class's benchmark result file exists and is frozen (GPU only: never passes on the CPU)"),
    ("C2", "alone vs batched", "unified-models gates --only C2",
     "cut model: every sequence's hidden rows and logprob rows are bitwise equal packed, alone and reordered "
     "(differing_elements == 0)"),
    ("C3", "whole prompt vs token by token", "unified-models gates --only C3",
     "cut model: decoding a sequence token by token through the state store gives the whole-prompt bits "
     "(differing_elements == 0)"),
    ("C4", "prefill + decode, chunked prefill", "unified-models gates --only C4",
     "cut model: chunks crossing chunk/block boundaries and decode steps in mixed batches give the full "
     "forward's bits (differing_elements == 0)"),
    ("C5", "trainer recompute == rollout", "unified-models check --model MODEL",
     "check passes: tokens_compared > 0, every |Δ logprob| field exactly 0, full-vocab rows equal, peer within "
     "tolerance"),
    ("C6", "forward vs fp64 reference", "unified-models gates --only C6",
     "cut model in fp32: token logprobs within 1e-4 of our fp64 reference"),
    ("C7", "gradients vs fp64 reference", "unified-models gates --only C7",
     "cut model in fp32: every parameter's gradient within 1e-4 relative norm error of fp64 autograd"),
    ("C8", "consecutive RL updates", "unified-models rl --model MODEL --steps N",
     "every step diff = 0 before its update (logprobs bitwise, importance ratios exactly 1), each update reaches "
     "vLLM (tensors copied > 0) and moves the policy (every step's rollout sha256 differs)"),
    ("C9", "first step after a resume", "unified-models rl --model MODEL --resume CKPT",
     "the resumed run's first step equals the uninterrupted run's step (rollout sha256, loss, reward) with diff = 0"),
]


def run_gates(model: str | None = None, preset: str | None = None, *, device: str = "auto",
              only: list[str] | None = None, num_prompts: int = 4, max_new_tokens: int = 16, rl_steps: int = 3,
              json_out: str | None = None, console: Console | None = None) -> list[GateRecord]:
    """Run the gates (``only``: a subset by id) and return their records (written to ``json_out``).

    Raises:
        UnifiedModelsError: bad options or checkpoint.
    """
    from ..check import quiet_engines
    from ..converters.hf_safetensors import spec_and_state_dict
    from ..presets import DEFAULT_PRESET, build_preset_checkpoint
    from ..run_options import resolve_device

    quiet_engines()
    if model and preset:
        raise UnifiedModelsError("--model and --preset are mutually exclusive")
    ids = [g[0] for g in GATES]
    bad = [g for g in (only or []) if g not in ids]
    if bad:
        raise UnifiedModelsError(f"--only {bad}: known gates {ids}")
    if rl_steps < 2:
        raise UnifiedModelsError(f"--rl-steps {rl_steps}: C8/C9 need at least 2 steps")
    model_dir = Path(model) if model else build_preset_checkpoint(preset or DEFAULT_PRESET)
    hf_config, spec, state_dict = spec_and_state_dict(model_dir)
    records = {g: GateRecord(gate=g, title=t, command=c.replace("MODEL", str(model_dir)), pass_condition=p)
               for g, t, c, p in GATES}
    with tempfile.TemporaryDirectory(prefix="um-gates-") as tmp:
        ctx = GateContext(model_dir=model_dir, model_arg=str(model_dir), hf_config=hf_config, spec=spec,
                          state_dict=state_dict, device=resolve_device(device), work=Path(tmp),
                          num_prompts=num_prompts, max_new_tokens=max_new_tokens, rl_steps=rl_steps)
        steps: list[tuple[tuple[str, ...], Callable]] = [
            (("C0",), gate_c0), (("C1",), gate_c1), (("C2",), gate_c2), (("C3",), gate_c3), (("C4",), gate_c4),
            (("C5",), gate_c5), (("C6", "C7"), gate_c6_c7), (("C8", "C9"), gate_c8_c9)]
        for gids, fn in steps:
            wanted = [g for g in gids if only is None or g in only]
            if not wanted:
                for g in gids:
                    records[g].reason = records[g].reason or "not selected (--only)"
                continue
            t0 = time.perf_counter()
            try:
                fn(ctx, *(records[g] for g in gids))
            except Exception as e:  # a gate that crashes fails, with the error as its reason
                for g in gids:
                    records[g].status, records[g].reason = "fail", f"{type(e).__name__}: {e}"
            for g in gids:
                records[g].seconds = round((time.perf_counter() - t0) / len(gids), 2)
    out = [records[g] for g in ids]
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": str(model_dir), "gates": [asdict(r) for r in out]}, indent=2,
                                   default=str))
    return out


def print_gates(records: list[GateRecord], console: Console) -> None:
    """The pass/fail/not-run table (rich)."""
    t = Table(title="porting gates")
    for col in ("gate", "title", "status", "key values / reason", "s"):
        t.add_column(col)
    color = {"pass": "green", "fail": "red", "not-run": "yellow"}
    for r in records:
        keys = ("differing_elements", "max_abs_diff", "tokens_compared", "worst_relative_error",
                "max_abs_logprob_diff", "diff_zero_every_step", "policy_moved", "diff_zero", "vllm_serving")
        text = r.reason or ", ".join(f"{k}={r.values[k]}" for k in keys if k in r.values)
        t.add_row(r.gate, r.title, f"[{color[r.status]}]{r.status}[/{color[r.status]}]", text[:90], f"{r.seconds:g}")
    console.print(t)


def add_parser(subparsers) -> None:
    """Register ``gates``."""
    g = subparsers.add_parser("gates", help="run the porting gates C0-C9 on the CPU; pass/fail/not-run table + JSON")
    g.add_argument("--model", help="HF checkpoint directory (default: the built-in tiny Nemotron-H)")
    g.add_argument("--preset", default=None, help="built-in preset to build when --model is not given")
    g.add_argument("--only", action="append", default=None, metavar="GATE", help="run only this gate (repeatable)")
    g.add_argument("--num-prompts", type=positive(int), default=4, help="C5's check prompts (default 4)")
    g.add_argument("--max-new-tokens", type=positive(int), default=16, help="C5's tokens per prompt (default 16)")
    g.add_argument("--rl-steps", type=positive(int), default=3, help="C8/C9's rl steps (default 3; resume at N-1)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--json", dest="json_out", help="write every gate's record here")
    add_plugin_flag(g)


def run(args) -> int:
    """``gates``: 0 when no gate failed, 1 otherwise."""
    from ..run_options import check_output_path

    if args.json_out:
        check_output_path("--json", Path(args.json_out), {"--model": args.model})
    records = run_gates(args.model, args.preset, device=args.device, only=args.only, num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, rl_steps=args.rl_steps, json_out=args.json_out)
    print_gates(records, Console())
    return 1 if any(r.status == "fail" for r in records) else 0
