"""``unified-models bisect``: the first op whose outputs differ between two implementations.

``--against trainer`` (default): the vLLM model class (rollout, in process) vs the
Megatron module (trainer recompute), bitwise. Each prompt is sampled alone with vLLM
(prefill, then one decode step per token) with every op tapped
(:mod:`.taps`); the trainer then recomputes all sequences packed (THD) with taps on.
Rows are matched by (sequence, position), ops visited in forward order: the
first op with a differing bit is the divergence (later ops only inherit it).
Before the trainer recomputes, both engines' execution-contract fingerprints
(:mod:`unified_models.consistency.fingerprint`) are compared; a difference is
refused naming the component (exit 2), and the report carries both.

``--against reference``: the Megatron module (model dtype) vs our fp32/fp64
reference (:class:`~unified_models.backends.reference.ReferenceModel`), sublayer by
sublayer on the engine's own inputs (each sublayer's oracle gets the engine's normed
input, so errors do not accumulate), within ``--tolerance`` relative to the
reference row's max |value|.

``--against peer``: our fp32 reference vs transformers' own class, module by module
(forward hooks on the transformers modules that compute our taps, their names mapped by the
family: :func:`.reference_taps.peer_module_names`), within ``--tolerance`` (default
``check.PEER_TOLERANCE``). The taps no transformers module outputs (a residual stream inside a
decoder block; every stream of an mHC residual) are reported as not comparable, with the reason.

Coverage: every mode must compare each sublayer's mixer and ``logits``
(:func:`.reference_taps.required_tap_names`) unless the mode declares the op not comparable.
When some have no rows on a side, the verdict is ``incomplete: N ops had no counterpart on the
SIDE: [...]``, never "no divergent op".

A found divergence is written as a reproduction (:mod:`.repro`): the op's inputs as
safetensors and ``repro.py``, which recomputes the op from them and exits 1 when a
side's recorded output differs from the recomputation.

Exit status: 0 no divergent op (every required op compared), 1 a divergent op (reported),
2 refused input, 3 incomplete (no divergent op among the ops compared, but required ops had no
counterpart on a side).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ..dsl import UnifiedModelsError
from .compare import Comparison, first_divergence
from .reference_taps import required_tap_names
from ..arg_types import add_plugin_flag, positive, seed
from .taps import Perturbation, TapRecorder, recording

__all__ = ["BisectOptions", "BisectReport", "add_parser", "run", "run_bisect", "PERTURB_ENV", "EXIT_INCOMPLETE"]

PERTURB_ENV = "UM_BISECT_PERTURB"
"""Test-only: ``SIDE=NAME[@SEQ:POS[:ELEMENT]]`` adds one ulp to that op's output on that side
(:class:`~.taps.Perturbation`), to prove that the search finds it. Never set in real use."""

REFERENCE_TOLERANCE = 2.0 ** -6
"""Default ``--tolerance`` of ``--against reference`` (relative to the reference row's max |value|):
a bf16 sublayer output on the engine's own input is within a few bf16 ulps (2**-8) of its fp64 oracle."""

SIDES = {"trainer": ("rollout", "trainer"), "reference": ("trainer", "reference"), "peer": ("reference", "transformers")}

EXIT_INCOMPLETE = 3
"""Exit status of a bisect that found no divergent op but could not compare every required op."""


@dataclass
class BisectOptions:
    """CLI options of ``bisect`` (see ``unified-models bisect --help``)."""

    model: str | None = None
    preset: str | None = None
    against: str = "trainer"
    prompts: str | None = None
    tokenizer: str | None = None
    num_prompts: int = 2
    max_new_tokens: int = 8
    seed: int = 0
    device: str = "auto"
    tolerance: float | None = None
    ref_dtype: str = "float64"
    repro_dir: str = "bisect_repro"
    json_out: str | None = None
    perturb: tuple[str, Perturbation] | None = None


@dataclass
class BisectReport:
    """What ``bisect`` compared and found."""

    model: str
    against: str
    device: str
    comparison: Comparison
    sequences: int
    tokens: int
    repro: str | None = None
    perturbed: str | None = None
    timings_s: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)
    """``--against trainer``: ``contract`` (the digest both engines agreed on), ``rollout`` and
    ``trainer`` (each engine's components); empty for the other modes (no second engine)."""

    @property
    def found(self) -> bool:
        return self.comparison.divergence is not None

    @property
    def passed(self) -> bool:
        """No op diverges and every required op was compared."""
        return not self.found and self.comparison.complete

    @property
    def exit_status(self) -> int:
        """0 passed, 1 a divergent op, :data:`EXIT_INCOMPLETE` no divergent op but incomplete coverage."""
        return 1 if self.found else 0 if self.comparison.complete else EXIT_INCOMPLETE

    def as_dict(self) -> dict:
        """JSON-ready fields; ``passed`` is True when no op diverges and coverage is complete
        (``verdict`` says which, ``missing`` lists the required ops not compared)."""
        return {"model": self.model, "against": self.against, "device": self.device, "sequences": self.sequences,
                "tokens": self.tokens, "passed": self.passed, **self.comparison.as_dict(), "repro": self.repro,
                "perturbed": self.perturbed, "timings_s": self.timings_s, "fingerprints": self.fingerprints}


# ----------------------------------------------------------------------------- sides

def _load(opts: BisectOptions):
    from ..converters.hf_safetensors import spec_and_state_dict
    from ..presets import DEFAULT_PRESET, build_preset_checkpoint

    if opts.model and opts.preset:
        raise UnifiedModelsError("--model and --preset are mutually exclusive")
    model_dir = Path(opts.model) if opts.model else build_preset_checkpoint(opts.preset or DEFAULT_PRESET)
    hf_config, spec, state_dict = spec_and_state_dict(model_dir)
    return model_dir, hf_config, spec, state_dict


def _prompts(opts: BisectOptions, spec, model_dir: Path) -> list[list[int]]:
    from ..presets import default_prompts_path
    from ..prompts import load_prompt_texts, tokenize_prompts
    from ..run_options import tokenizer_dir_for

    texts = load_prompt_texts(opts.prompts or default_prompts_path(), opts.num_prompts)
    return tokenize_prompts(texts, tokenizer_dir_for(model_dir, opts.tokenizer), vocab_size=spec.vocab_size,
                            max_prompt_tokens=spec.max_position_embeddings - opts.max_new_tokens)


def _recorder(opts: BisectOptions, side: str, names=None) -> TapRecorder:
    pt = opts.perturb[1] if opts.perturb is not None and opts.perturb[0] == side else None
    return TapRecorder(perturb=pt, names=names)


def rollout_side(spec, model_dir, state_dict, prompt_ids, *, max_new_tokens: int, seed: int, device: str,
                 recorder: TapRecorder, fingerprints: dict | None = None) -> list[list[int]]:
    """Sample each prompt alone with the vLLM model class, every op tapped into ``recorder``
    (sequence ``i`` = prompt ``i``). Returns the completions (token ids per prompt).

    ``fingerprints``, when given, receives the engine's contract fingerprint under ``"rollout"``."""
    from ..backends.vllm.rollout import RolloutEngine, token_budget

    completions = []
    with RolloutEngine(spec, model_dir, state_dict=state_dict, device=device, seed=seed,
                       max_model_len=max(map(len, prompt_ids)) + max_new_tokens, max_num_seqs=1,
                       max_num_batched_tokens=token_budget(prompt_ids, max_new_tokens, device)) as engine:
        if fingerprints is not None:
            fingerprints["rollout"] = engine.contract_fingerprint()
        for i, ids in enumerate(prompt_ids):
            recorder.seq_offset = i
            seeds = None if engine.chunked_prefill and device != "cuda" else [seed + i]
            with recording(recorder):
                ro = engine.generate([ids], max_new_tokens=max_new_tokens, seeds=seeds)
            completions.append(ro.completions[0])
    return completions


def trainer_side(spec, state_dict, sequences: list[list[int]], *, device: str, recorder: TapRecorder,
                 fingerprints: dict | None = None) -> None:
    """Recompute every sequence packed (THD) with the Megatron module, every op tapped into
    ``recorder``; logprob rows for every position (the last one scores token 0).

    ``fingerprints``, when given, receives the trainer's contract fingerprint under ``"trainer"``;
    when it already holds the rollout's, the two are compared first.

    Raises:
        FingerprintMismatchError: the trainer's execution contract differs from the rollout's
            (names the component); nothing is recomputed then.
    """
    from ..backends.megatron.trainer import Trainer

    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = torch.tensor([0, *map(len, sequences)]).cumsum(0)
    targets = torch.cat([torch.tensor(s[1:] + [0], dtype=torch.long) for s in sequences])
    with Trainer(spec, state_dict, device=device) as trainer:
        if fingerprints is not None:
            from ..consistency.fingerprint import compare

            fingerprints["trainer"] = trainer.contract_fingerprint()
            if "rollout" in fingerprints:
                compare(fingerprints["rollout"], fingerprints["trainer"])  # refused before any recompute
        with torch.no_grad(), recording(recorder):
            trainer.model.token_logprobs(ids, cu, rows=torch.arange(ids.shape[0]), target_ids=targets)


# ----------------------------------------------------------------------------- modes

def _against_trainer(opts, spec, model_dir, state_dict, prompt_ids, device):
    a, b = _recorder(opts, "rollout"), _recorder(opts, "trainer")
    fingerprints: dict = {}
    t0 = time.perf_counter()
    completions = rollout_side(spec, model_dir, state_dict, prompt_ids, max_new_tokens=opts.max_new_tokens,
                               seed=opts.seed, device=device, recorder=a, fingerprints=fingerprints)
    t1 = time.perf_counter()
    sequences = [p + c for p, c in zip(prompt_ids, completions)]
    trainer_side(spec, state_dict, sequences, device=device, recorder=b, fingerprints=fingerprints)
    timings = {"rollout": t1 - t0, "trainer": time.perf_counter() - t1}
    cmp = first_divergence(a.records, b.records, sides=SIDES["trainer"], tokens=dict(enumerate(sequences)),
                           required=required_tap_names(spec))
    return cmp, sequences, (a, b), timings, fingerprints


def _against_reference(opts, spec, model_dir, state_dict, prompt_ids, device):
    from .reference_taps import reference_on_engine_inputs, sublayer_tap_names

    if spec.stores_quantized_weights:
        raise UnifiedModelsError("bisect --against reference: the reference takes master weights; this checkpoint "
                                 "stores quantized weights (compare its dequantized bf16 source instead)")
    dtype = {"float32": torch.float32, "float64": torch.float64}[opts.ref_dtype]
    names = set(sublayer_tap_names(spec))
    a = _recorder(opts, "trainer", names)
    t0 = time.perf_counter()
    trainer_side(spec, state_dict, prompt_ids, device=device, recorder=a)
    t1 = time.perf_counter()
    b = reference_on_engine_inputs(spec, state_dict, a.records, dtype=dtype, recorder=_recorder(opts, "reference"),
                                    tokens=dict(enumerate(prompt_ids)))
    tol = REFERENCE_TOLERANCE if opts.tolerance is None else opts.tolerance
    cmp = first_divergence(a.records, b.records, sides=SIDES["reference"], tolerance=tol,
                           tokens=dict(enumerate(prompt_ids)), required=required_tap_names(spec))
    return cmp, prompt_ids, (a, b), {"trainer": t1 - t0, "reference": time.perf_counter() - t1}, {}


def _against_peer(opts, spec, model_dir, state_dict, prompt_ids, device, hf_config):
    from ..check import PEER_TOLERANCE
    from .reference_taps import peer_not_comparable, peer_recordings

    if spec.stores_quantized_weights:
        raise UnifiedModelsError("bisect --against peer: compares bf16/fp32 checkpoints with transformers; this "
                                 "checkpoint stores quantized weights (compare its dequantized source)")
    t0 = time.perf_counter()
    a, b = peer_recordings(spec, state_dict, hf_config, prompt_ids, ours=_recorder(opts, "reference"),
                           theirs=_recorder(opts, "transformers"))
    tol = PEER_TOLERANCE if opts.tolerance is None else opts.tolerance
    cmp = first_divergence(a.records, b.records, sides=SIDES["peer"], tolerance=tol,
                           tokens=dict(enumerate(prompt_ids)), required=required_tap_names(spec),
                           not_comparable=peer_not_comparable(spec))
    return cmp, prompt_ids, (a, b), {"peer": time.perf_counter() - t0}, {}


def run_bisect(opts: BisectOptions, console: Console | None = None) -> BisectReport:
    """Run the comparison of ``opts.against`` and write the reproduction of a found divergence.

    Raises:
        UnifiedModelsError: bad options or checkpoint (names the field).
    """
    from ..check import quiet_engines
    from ..run_options import resolve_device

    quiet_engines()
    if opts.against not in SIDES:
        raise UnifiedModelsError(f"--against {opts.against!r}: expected one of {sorted(SIDES)}")
    if opts.perturb is not None and opts.perturb[0] not in SIDES[opts.against]:
        raise UnifiedModelsError(f"{PERTURB_ENV}: side {opts.perturb[0]!r} is not one of {SIDES[opts.against]}")
    device = resolve_device(opts.device)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the taps live in this process
    model_dir, hf_config, spec, state_dict = _load(opts)
    if opts.max_new_tokens >= spec.max_position_embeddings:
        raise UnifiedModelsError(f"--max-new-tokens {opts.max_new_tokens}: the model's max_position_embeddings "
                                 f"is {spec.max_position_embeddings}")
    prompt_ids = _prompts(opts, spec, model_dir)
    if opts.against == "trainer":
        cmp, seqs, recs, timings, fps = _against_trainer(opts, spec, model_dir, state_dict, prompt_ids, device)
    elif opts.against == "reference":
        cmp, seqs, recs, timings, fps = _against_reference(opts, spec, model_dir, state_dict, prompt_ids, device)
    else:
        cmp, seqs, recs, timings, fps = _against_peer(opts, spec, model_dir, state_dict, prompt_ids, device, hf_config)
    report = BisectReport(model=str(model_dir), against=opts.against, device=device, comparison=cmp,
                          sequences=len(seqs), tokens=sum(map(len, seqs)),
                          timings_s={k: round(v, 2) for k, v in timings.items()},
                          fingerprints={"contract": fps["trainer"].digest,
                                        **{side: fp.as_dict() for side, fp in fps.items()}} if fps else {})
    if opts.perturb is not None:
        side, pt = opts.perturb
        hit = any(r.perturbed for r in recs)
        report.perturbed = f"{side}={pt.name}@{pt.sequence}:{pt.position}:{pt.element}" + ("" if hit else " (never hit)")
    if cmp.divergence is not None:
        from .repro import write_repro

        report.repro = str(write_repro(Path(opts.repro_dir), spec, model_dir, state_dict, cmp.divergence,
                                       recs[0].records, recs[1].records, seqs, mode=opts.against))
    return report


# ----------------------------------------------------------------------------- report and CLI

def print_report(r: BisectReport, console: Console) -> None:
    """The result table (rich)."""
    c = r.comparison
    t = Table(title=f"bisect: {c.sides[0]} vs {c.sides[1]} ({r.against}) — {r.device}")
    t.add_column("field")
    t.add_column("value", justify="right")
    t.add_row("sequences / tokens", f"{r.sequences} / {r.tokens}")
    t.add_row("ops compared", str(len(c.ops_compared)))
    t.add_row("rows compared", str(c.rows_compared))
    if c.not_comparable:
        t.add_row("not comparable (declared)", str(len(c.not_comparable)))
    if c.excused:
        t.add_row("rows excused (near-tie top-k)", str(sum(e["rows"] for e in c.excused.values())))
    if not c.complete:
        t.add_row("[bold red]required ops NOT compared[/bold red]",
                  f"[bold red]{sum(map(len, c.missing.values()))}[/bold red]")
    if r.fingerprints:
        t.add_row("contract fingerprint (vLLM = Megatron)", r.fingerprints["contract"][:16])
    d = c.divergence
    if d is None:
        t.add_row("result", "[green]no divergent op[/green]" if c.complete else "[bold red]incomplete[/bold red]")
    else:
        t.add_row("first divergent op", f"[red]{d.name}[/red]")
        t.add_row("layer / op", f"{d.layer if d.layer is not None else '-'} / {d.op}")
        t.add_row("shapes", f"{d.shapes[0]} vs {d.shapes[1]}")
        t.add_row("dtypes", f"{d.dtypes[0]} vs {d.dtypes[1]}")
        t.add_row("max |Δ|", f"{d.max_abs_diff:.6g}" + ("" if d.tolerance is None else f" (tol {d.tolerance:g} rel)"))
        t.add_row("rows differing", f"{d.rows_differing} / {d.rows_compared}")
        t.add_row("first element", f"sequence {d.sequence}, position {d.position} (token {d.token_id}), "
                                   f"element {list(d.element)}")
        t.add_row("values", f"{d.value_a!r} vs {d.value_b!r}")
        t.add_row("reproduction", str(r.repro))
    if r.perturbed:
        t.add_row("test-only perturbation", r.perturbed)
    console.print(t)
    if not c.complete:  # never a plain "no divergent op" on thin coverage
        console.print(c.incomplete, style="bold red", markup=False, highlight=False, soft_wrap=True)
    by_reason: dict[str, list[str]] = {}
    for name, why in c.not_comparable.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        console.print(f"not comparable ({len(names)}): {why}: {names}", markup=False, highlight=False, soft_wrap=True)
    for name, e in c.excused.items():
        console.print(f"excused {name}: {e['rows']} row(s), first (sequence, position) {tuple(e['first'])}: {e['why']}",
                      markup=False, highlight=False, soft_wrap=True)


def _perturb_from_env() -> tuple[str, Perturbation] | None:
    text = os.environ.get(PERTURB_ENV)
    if not text:
        return None
    side, sep, rest = text.partition("=")
    if not sep:
        raise UnifiedModelsError(f"{PERTURB_ENV}={text!r}: expected SIDE=NAME[@SEQ:POS[:ELEMENT]]")
    try:
        return side, Perturbation.parse(rest)
    except ValueError as e:
        raise UnifiedModelsError(f"{PERTURB_ENV}: {e}") from None


def add_parser(subparsers) -> None:
    """Register ``bisect``."""
    b = subparsers.add_parser("bisect", help="the first op whose outputs differ: rollout vs trainer (bitwise), "
                                             "engine vs our reference, or our reference vs transformers")
    b.add_argument("--model", help="HF checkpoint directory (default: the built-in tiny Nemotron-H)")
    b.add_argument("--preset", default=None, help="built-in preset to build when --model is not given")
    b.add_argument("--against", choices=sorted(SIDES), default="trainer",
                   help="trainer: vLLM class vs Megatron module, bitwise (default); reference: Megatron module vs "
                        "our fp32/fp64 reference per sublayer, within --tolerance; peer: our fp32 reference vs "
                        "transformers module by module, within --tolerance")
    b.add_argument("--prompts", help="JSONL prompt file (default: bundled GSM8K questions)")
    b.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, else the bundled Phi-3 one)")
    b.add_argument("--num-prompts", type=positive(int), default=2)
    b.add_argument("--max-new-tokens", type=positive(int), default=8,
                   help="tokens sampled per prompt by the rollout (--against trainer)")
    b.add_argument("--seed", type=seed, default=0)
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    b.add_argument("--tolerance", type=positive(float), default=None,
                   help=f"relative tolerance per row (reference: default {REFERENCE_TOLERANCE:g}; peer: default "
                        "check's --peer-tolerance 2**-13); --against trainer is always bitwise")
    b.add_argument("--ref-dtype", choices=["float32", "float64"], default="float64",
                   help="dtype of the reference in --against reference (default float64)")
    b.add_argument("--repro-dir", default="bisect_repro", help="where a found divergence's reproduction is written")
    b.add_argument("--json", dest="json_out", help="write the report as JSON here")
    add_plugin_flag(b)


def run(args) -> int:
    """``bisect``: 0 no divergent op (complete coverage), 1 a divergent op found, 3 incomplete coverage."""
    from ..run_options import check_output_path

    if args.against == "trainer" and args.tolerance is not None:
        raise UnifiedModelsError("--tolerance: --against trainer is bitwise (diff = 0); use it with reference/peer")
    if args.json_out:
        check_output_path("--json", Path(args.json_out))
    opts = BisectOptions(**{k: v for k, v in vars(args).items() if k not in ("command", "plugin")},
                         perturb=_perturb_from_env())
    report = run_bisect(opts)
    print_report(report, Console())
    if opts.json_out:
        path = Path(opts.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.as_dict(), indent=2))
    return report.exit_status
