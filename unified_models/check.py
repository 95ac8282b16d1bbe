"""``unified-models check``: rollout with vLLM, recompute with Megatron, diff = 0?

Steps (each shown with progress):
1. checkpoint: ``--model`` or the built-in preset (built once with transformers);
   its spec and validated state dict are read once and handed to every engine below;
2. prompts: JSONL -> chat template -> token ids;
3. peer: our fp32 reference forward vs transformers' own class on the same
   checkpoint (each row's max |Δ logit| within ``--peer-tolerance`` x its max |logit|);
4. rollout: a :class:`~.backends.vllm.rollout.RolloutEngine` (``vllm.LLM`` in process) samples ``--max-new-tokens`` per prompt at
   ``--temperature`` with per-request seeds, returning the logprob of every
   sampled token (and, through a tap on our model class, the whole row);
5. trainer: a :class:`~.backends.megatron.trainer.Trainer` (the Megatron module) recomputes, from the same token ids and
   weights, packed (THD), the logprob of every sampled token and whole rows; before it does, the
   two engines' execution-contract fingerprints (:mod:`.consistency.fingerprint`) must be equal,
   else the check is refused naming the differing component (exit 2);
6. report: table + JSON; exit 0 only if every diff field is exactly 0 and the
   peer is within tolerance.

Under ``torchrun`` (``docs/scale-out.md``): ``--ep`` / ``--dp`` split the recompute over the
processes; ``--rollout-dp N`` / ``--rollout-ep`` run one vLLM engine per process as well
(:func:`_rollout_data_parallel`); rank 0 writes the one merged report.
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

from .run_options import check_output_path, resolve_device, tokenizer_dir_for
from .consistency.metrics import LogprobDiff, compare_logprobs, full_vocab_max_abs_diff, rollout_digest
from .dsl import PromptError, UnifiedModelsError
from .presets import DEFAULT_PRESET, build_preset_checkpoint, default_prompts_path
from .prompts import load_prompt_texts, tokenize_prompts


PEER_TOLERANCE = 2.0 ** -13
"""Default ``--peer-tolerance`` (1.2e-4, 1024 fp32 ulps): relative to each row's logit scale
(:func:`peer_check`)."""


@dataclass
class CheckOptions:
    """CLI options of ``check`` (see ``unified-models check --help``)."""

    model: str | None = None
    preset: str | None = None
    prompts: str | None = None
    tokenizer: str | None = None
    num_prompts: int = 16
    max_new_tokens: int = 128
    seed: int = 0
    temperature: float = 1.0
    stop_at_eos: bool = False
    max_num_seqs: int | None = None
    device: str = "auto"
    peer_tolerance: float = PEER_TOLERANCE
    peer_prompts: int = 2
    full_vocab_rows: int = -1
    cuda_graphs: bool | None = None
    ep: int = 1
    dp: int | None = None
    rollout_dp: int | None = None
    rollout_ep: int = 1
    json_out: str | None = None


@dataclass
class CheckReport:
    """Everything ``check`` measured; ``passed`` decides the exit status."""

    model: str
    device: str
    num_prompts: int
    max_new_tokens: int
    seed: int
    diff: LogprobDiff
    full_vocab_rows: int
    full_vocab_max_abs_diff: float
    peer: dict
    rollout_sha256: str = ""
    options: dict = field(default_factory=dict)
    timings_s: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)
    """``{"contract": digest, "rollout": ..., "trainer": ...}`` (:meth:`Fingerprint.as_dict`)."""

    @property
    def passed(self) -> bool:
        d = self.diff
        return (d.tokens_compared > 0 and d.bitwise_equal and d.mean_abs_diff == 0.0 and d.std_abs_diff == 0.0
                and d.k3_kl == 0.0 and self.full_vocab_max_abs_diff == 0.0 and bool(self.peer.get("within_tolerance")))

    def as_dict(self) -> dict:
        """Flat JSON: the diff fields at top level, then the peer block."""
        d = {k: v for k, v in self.__dict__.items() if k != "diff"}
        d.update(self.diff.as_dict())
        d["passed"] = self.passed
        return d


def row_logit_diffs(theirs_TV: torch.Tensor, ours_TV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of two ``[T, V]`` logit tensors: ``max_v |theirs - ours|`` and the row's logit
    scale ``max_v |theirs|`` (``theirs`` is the peer, i.e. transformers), both ``[T]`` fp64.

    A NaN anywhere in a row (either side) makes its difference ``inf``, so it can never pass.
    """
    t, o = theirs_TV.double(), ours_TV.double()
    diff_T = (t - o).abs().amax(-1)
    scale_T = t.abs().amax(-1)
    bad = torch.isnan(diff_T) | torch.isnan(scale_T)
    return torch.where(bad, torch.full_like(diff_T, float("inf")), diff_T), torch.nan_to_num(scale_T, nan=0.0)


def peer_check(spec, state_dict, model_dir: Path, prompt_ids: list[list[int]], tolerance: float = PEER_TOLERANCE,
               *, hf_config=None) -> dict:
    """Our fp32 reference forward vs transformers' own class, fp32, same checkpoint.

    The bound is relative to the logits' scale, since fp32 rounding grows with it: for
    every position (row) ``r``, ``max_v |theirs[r, v] - ours[r, v]| <= tolerance * scale[r]``
    with ``scale[r] = max_v |theirs[r, v]|`` (transformers' logits, the peer's). The default
    :data:`PEER_TOLERANCE` is ``2**-13`` (1024 fp32 ulps of the scale, 1.2e-4). Measured on
    CPU (2 prompts): ``nemotron_h_tiny`` 8.1e-7 (7 ulps), ``nemotron_h_hybrid_tiny`` 6.7e-6
    (56 ulps), its NVFP4 export 6.1e-6, the peaked test models (``tests/peaked_models.py``)
    1.1e-6 and 1.4e-6; one weight of our side perturbed (``tests/test_peer_tolerance.py``,
    layer 0, one element +0.01) measures 2.3e-4 to 0.8.

    Both forwards are plain fp32 torch on the host BLAS (MKL on CPU), so the
    measured difference depends on that BLAS's summation order. On CPU they
    run single-threaded so the number is the same at any thread count (it may
    still differ across CPU instruction sets, e.g. AVX2 vs AVX-512 MKL paths).

    A quantized (ModelOpt-format) checkpoint is compared on its dequantized
    model (:func:`~unified_models.converters.modelopt.dequantized_spec`: every
    weight dequantized by ModelOpt's rule, no activation/KV quantization),
    which transformers runs from those weights and the checkpoint's config without
    ``quantization_config``; the quantizers themselves are checked bit for bit
    against ModelOpt in ``tests/ops``.

    transformers builds its model from ``hf_config`` (default: read from
    ``model_dir``) and the given ``state_dict`` through its own loading path
    (``from_pretrained(state_dict=...)``: dtype casts included), so the weights
    are not read from disk again.

    Returns:
        ``{"against", "ours", "max_abs_logit_diff", "max_rel_logit_diff", "logit_scale", "bound",
        "tolerance", "within_tolerance", "tokens"}``: ``max_abs_logit_diff`` is the largest
        |Δ logit| over all rows (logits); ``max_rel_logit_diff`` the largest ratio
        ``max_v |Δ| / scale`` over the rows (dimensionless; ``inf`` on NaN logits);
        ``logit_scale`` and ``bound`` (``tolerance * logit_scale``, logits) are those of the row
        with that ratio; ``within_tolerance`` is ``max_rel_logit_diff <= tolerance``.
    """
    import tempfile

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .backends.reference import ReferenceModel
    from .converters.hf_safetensors import load_hf_config
    from .converters.modelopt import dequantize_state_dict, dequantized_spec

    # KV quantization (an FP8 KV cache, DeepSeek-V4's FP8 KV rule) alone also has no transformers
    # counterpart: compare without it (the families' dequantized() drop it)
    quantized = spec.stores_quantized_weights or dequantized_spec(spec) != spec.replace(weight_formats=())
    # On a CUDA host both fp32 forwards run on the GPU (TF32 off): a 3B-parameter model
    # single-threaded on the CPU takes minutes. On CPU hosts nothing changes.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if quantized:
        plain = dequantized_spec(spec)
        masters = dequantize_state_dict(state_dict, spec)
        weights = {n: masters[n] for n in plain.parameter_shapes()}
        ref = ReferenceModel(plain, dtype=torch.float32, device=dev)
        # transformers' config of the dequantized model: the checkpoint's without quantization_config
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        cfg.pop("quantization_config", None)
        with tempfile.TemporaryDirectory(prefix="um-peer-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
            hf_config = load_hf_config(tmp)
    else:
        weights = dict(state_dict)
        ref = ReferenceModel(spec, dtype=torch.float32, device=dev)
        if hf_config is None:
            hf_config = load_hf_config(model_dir)
    ref.load_state_dict_hf(weights)
    hf_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)  # what AutoModelForCausalLM picks for the config
    if hf_class is None:
        raise UnifiedModelsError(
            f"peer check: transformers has no causal-LM class for {type(hf_config).__name__} "
            f"(model_type {getattr(hf_config, 'model_type', '?')!r}); the peer check compares with transformers' "
            "own implementation, so register one (AutoModelForCausalLM.register) before running check")
    hf = hf_class.from_pretrained(None, config=hf_config, state_dict=dict(weights), dtype=torch.float32).to(dev)
    hf.eval()
    worst_abs, worst_rel, worst_scale, tokens = 0.0, 0.0, 0.0, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # true fp32 on both sides
    try:
        with torch.no_grad():
            for ids in prompt_ids:
                x = torch.tensor(ids, device=dev)
                theirs = hf(x[None]).logits[0].float()
                diff_T, scale_T = row_logit_diffs(theirs, ref.logits(x))
                # 0/0 (an all-zero row matched exactly) is 0; d/0 with d > 0 is inf
                rel_T = torch.where(diff_T == 0, torch.zeros_like(diff_T), diff_T / scale_T)
                r = int(rel_T.argmax())
                if float(rel_T[r]) >= worst_rel:
                    worst_rel, worst_scale = float(rel_T[r]), float(scale_T[r])
                worst_abs = max(worst_abs, float(diff_T.max()))
                tokens += len(ids)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {
        "against": f"transformers {type(hf).__name__} (fp32)" + (" on the dequantized weights" if quantized else ""),
        "ours": "unified_models reference backend (fp32)",
        "max_abs_logit_diff": worst_abs,
        "max_rel_logit_diff": worst_rel,
        "logit_scale": worst_scale,
        "bound": tolerance * worst_scale,
        "tolerance": tolerance,
        "within_tolerance": worst_rel <= tolerance,
        "tokens": tokens,
    }


def quiet_engines() -> None:
    """Engine logs below ERROR would drown the table (override with VLLM_LOGGING_LEVEL)."""
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")


def _launch_layout(opts: CheckOptions) -> tuple[int, int]:
    """``(rank, world size)`` from ``torchrun``'s environment; refuses a layout it cannot run before any
    work (the rules and messages of ``rl``'s :func:`~.rl.distributed.launch_layout`).

    Raises:
        ParallelismError: a size < 1; ``--ep`` > 1 without as many processes, a world size ``--ep`` does
            not divide; ``--dp`` other than the number of processes; ``--rollout-dp`` other than 1 (the
            default: rank 0 rolls out alone) or the number of processes; ``--rollout-ep`` other than 1
            or ``--rollout-dp``; more processes than prompts (a rank would recompute nothing).
    """
    from .launch_layout import check_layout_flags, torchrun_place

    rank, world = torchrun_place()
    check_layout_flags("check", world, ep=opts.ep, dp=opts.dp, rollout_dp=_rollout_dp(opts), rollout_ep=opts.rollout_ep,
                       rollout_dp_choices=(1, world), leave_rollout_dp_out=", or leave it out (rank 0 rolls out alone)",
                       units=opts.num_prompts, units_name="prompts", unit="sequence", units_flag="--num-prompts")
    return rank, world


def _rollout_dp(opts: CheckOptions) -> int:
    """vLLM's data-parallel size: ``--rollout-dp``, default 1 (one engine, on rank 0)."""
    return 1 if opts.rollout_dp is None else opts.rollout_dp


class _OutsideTorchrunStore:
    """While vLLM (EP = 1, its own world of one process) starts on rank 0 of a ``torchrun`` job: torch's
    ``tcp://`` rendezvous joins torchrun's agent store as a client when ``TORCHELASTIC_USE_AGENT_STORE``
    is set, and vLLM's own ``tcp://host:port`` has no server there; unset it meanwhile."""

    KEY = "TORCHELASTIC_USE_AGENT_STORE"

    def __enter__(self):
        self.saved = os.environ.pop(self.KEY, None)

    def __exit__(self, *exc):
        if self.saved is not None:
            os.environ[self.KEY] = self.saved


def _trainer_under_torchrun(opts: CheckOptions, spec, state_dict, device: str, rollout, *,
                            own_rollout_fp=None) -> tuple | None:
    """The trainer at ``--ep`` over every process of the ``torchrun`` job: rank 0 broadcasts the rollout
    (prompt ids, completions, whole-row keys, the engine's fingerprint); each rank
    recomputes its block of sequences (:func:`~.backends.megatron.parallel.shard_sequences`) with its
    experts; rank 0 gathers. ``own_rollout_fp``: this rank's own engine's fingerprint (``--rollout-dp``:
    every rank had an engine), compared with its trainer's instead of rank 0's. Returns
    ``(RecomputeResult, trainer fingerprint, layout)`` on rank 0, None elsewhere."""
    import torch.distributed as dist

    from .backends.megatron.parallel import ensure_process_group, shard_sequences
    from .backends.megatron.recompute import RecomputeResult
    from .backends.megatron.trainer import Trainer, TrainerOptions
    from .consistency.fingerprint import compare

    # env:// from torchrun (rank 0: after vLLM tore down its own world); at rollout DP > 1 every rank's
    # engine held torchrun's world and tore it down: the new world's keys go under their own prefix
    ensure_process_group(store_prefix="unified-models-check-trainer/" if _rollout_dp(opts) > 1 else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [rollout]
    dist.broadcast_object_list(box, src=0)
    prompt_ids, completions, keys, rollout_fp = box[0]
    mine = shard_sequences(len(prompt_ids), rank, world)
    with Trainer(spec, state_dict, device=device,
                 options=TrainerOptions(expert_model_parallel_size=opts.ep)) as trainer:
        trainer_fp = trainer.contract_fingerprint()
        compare(own_rollout_fp or rollout_fp, trainer_fp)  # every rank: refused before any recompute
        tr = trainer.logprobs([prompt_ids[i] for i in mine], [completions[i] for i in mine],
                              temperature=opts.temperature,
                              full_rows_for=[(s - mine.start, p) for s, p in keys if s in mine])
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n, _ in trainer.model.named_parameters()
                          if ".experts." in n})
    # cloned: the trainer's rows and logprobs are views of their micro-batch's [T, V] / [T] tensors, and
    # pickling a view sends its whole storage (a row of 16 x 128 tokens would carry ~1000 rows)
    part = (list(mine), [lp.clone() for lp in tr.logprobs],
            {(s + mine.start, p): v.clone() for (s, p), v in tr.full_rows.items()},
            [experts[0], experts[-1]] if experts else [])
    parts = [None] * world if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    logprobs: list = [None] * len(prompt_ids)
    full: dict = {}
    for seqs, lps, rows, _ in parts:
        for s, lp in zip(seqs, lps):
            logprobs[s] = lp
        full.update(rows)
    rollout_dp = _rollout_dp(opts)
    layout = {"processes": world, "trainer_ep": opts.ep, "trainer_dp": world, "rollout_dp": rollout_dp,
              "rollout_ep": opts.rollout_ep,
              "ranks": [{"rank": r, "sequences": [p[0][0], p[0][-1]], "experts": p[3],
                         "rollout_prompts": _rollout_prompts(len(prompt_ids), r, world, rollout_dp)}
                        for r, p in enumerate(parts)]}
    return RecomputeResult(logprobs=logprobs, full_rows=full), trainer_fp, layout


def _rollout_prompts(num_prompts: int, rank: int, world: int, rollout_dp: int) -> list[int]:
    """``[first, last]`` prompt rank ``rank`` rolled out (``[]``: none; at rollout DP = 1 rank 0 all)."""
    if rollout_dp == 1:
        return [0, num_prompts - 1] if rank == 0 else []
    from .backends.megatron.parallel import shard_sequences

    mine = shard_sequences(num_prompts, rank, world)
    return [mine[0], mine[-1]]


def _rollout_data_parallel(opts: CheckOptions, spec, model_dir: Path, state_dict, device: str,
                           prompt_ids: list[list[int]]):
    """``--rollout-dp N``: one vLLM engine per process (vLLM data parallel, ``external_launcher``, over
    torchrun's world; experts sharded over it at ``--rollout-ep N``). Each rank samples its contiguous
    block of prompts (:func:`~.backends.megatron.parallel.shard_sequences`) with the request seeds of
    their *global* indices (``seed + i``), so tokens and logprob bits are the single-process run's.

    Whole rows: every rank records its rows, the ranks exchange their keys (global prompt index,
    position), and every rank selects from the global key list with the single-process rule
    (``--full-vocab-rows`` keys spread evenly over all sampled positions in prompt order,
    :func:`~.backends.vllm.rollout.select_full_row_keys`): the same rows as one process. While the
    engine's world is alive, completions, logprobs and engine settings are all-gathered
    (``all_gather_object``) and the selected rows gathered to rank 0 (``gather_object``: only rank 0
    compares them, and a row is ``V`` fp32 values); then the engine is closed.

    Returns:
        ``(RolloutResult merged over the ranks, this rank's engine fingerprint)``: the same completions,
        logprobs and row keys on every rank (``engine``: rank 0's settings); the rows on rank 0 only.
    """
    import torch.distributed as dist

    from .backends.megatron.parallel import shard_sequences
    from .backends.vllm.rollout import RolloutEngine, RolloutResult, select_full_row_keys, token_budget

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = shard_sequences(len(prompt_ids), rank, world)
    # the engine's limits are the single-process run's (whole prompt list): scheduling only, no bit depends on them
    with RolloutEngine(spec, model_dir, state_dict=state_dict, device=device, seed=opts.seed,
                       max_model_len=max(map(len, prompt_ids)) + opts.max_new_tokens,
                       max_num_seqs=opts.max_num_seqs or len(prompt_ids),
                       max_num_batched_tokens=token_budget(prompt_ids, opts.max_new_tokens, device),
                       cuda_graphs=opts.cuda_graphs, data_parallel_size=world,
                       enable_expert_parallel=opts.rollout_ep > 1) as engine:
        own_fp = engine.contract_fingerprint()
        ro = engine.generate([prompt_ids[i] for i in mine], max_new_tokens=opts.max_new_tokens,
                             seeds=[opts.seed + i for i in mine], temperature=opts.temperature,
                             stop_at_eos=opts.stop_at_eos, full_vocab_rows=-1 if opts.full_vocab_rows else 0)
        # the default group is torchrun's world while the engine lives (external launcher)
        keys_of: list = [None] * world
        dist.all_gather_object(keys_of, [(s + mine.start, p) for s, p in ro.full_row_keys])
        keys = select_full_row_keys([k for ks in keys_of for k in ks], opts.full_vocab_rows)
        parts: list = [None] * world
        dist.all_gather_object(parts, (ro.completions, ro.logprobs, ro.engine))
        # the whole rows only to rank 0, which compares them; cloned: a recorded row is a view of its
        # step's [requests, V] host tensor, and pickling a view sends the whole storage
        rows = {k: ro.full_rows[(k[0] - mine.start, k[1])].clone() for k in keys if k[0] in mine}
        del ro
        rows_of: list | None = [None] * world if rank == 0 else None
        dist.gather_object(rows, rows_of, dst=0)
    full_rows = {k: v for r in rows_of for k, v in r.items()} if rank == 0 else {}
    merged = RolloutResult(completions=[c for cs, _, _ in parts for c in cs],
                           logprobs=[lp for _, lps, _ in parts for lp in lps],
                           full_rows={k: full_rows[k] for k in keys} if rank == 0 else {}, full_row_keys=keys,
                           engine=parts[0][2])
    return merged, own_fp


def run_check(opts: CheckOptions) -> int:
    """Run the whole check; print the table; write JSON; return the exit status.

    Under ``torchrun --nproc-per-node N`` with ``--ep`` (N a multiple of EP): rank 0 runs the
    peer check and the rollout (vLLM at EP = 1, in process); then every rank runs the trainer at
    EP over Megatron's groups on its block of sequences, and rank 0 merges them into the one report
    (its ``layout`` says which rank held which sequences and experts); the other ranks exit 0
    (a failed check fails the job through rank 0).

    With ``--rollout-dp N`` (N the number of processes; ``--rollout-ep`` 1 or N) every rank starts
    its own engine (vLLM data parallel) and samples its block of prompts
    (:func:`_rollout_data_parallel`; the tokens and logprob bits, hence ``rollout_sha256``, are the
    single-process run's), the engines close, the trainer runs as above, and rank 0 runs the peer
    check last (no rank waits on it) and writes the report.
    """
    quiet_engines()
    rank, world = _launch_layout(opts)
    rollout_dp = _rollout_dp(opts)
    console = Console(stderr=True, quiet=rank != 0)
    out = Console()
    device = resolve_device(opts.device)
    if opts.seed + opts.num_prompts > 2**32:
        raise UnifiedModelsError(f"--seed {opts.seed}: request seeds seed..seed+{opts.num_prompts - 1} exceed 2**32 - 1")
    if opts.json_out:
        check_output_path("--json", Path(opts.json_out), {"--model": opts.model, "--prompts": opts.prompts,
                                                           "--tokenizer": opts.tokenizer})
    timings: dict[str, float] = {}

    def step(name):
        return console.status(f"[bold]{name}[/bold]", spinner="dots")

    t0 = time.perf_counter()
    with step("checkpoint"):
        if opts.model:
            model_dir = Path(opts.model)
        else:
            model_dir = build_preset_checkpoint(opts.preset or DEFAULT_PRESET)
        from .converters.hf_safetensors import spec_and_state_dict

        # the one read and validation of the checkpoint in this process: every engine below gets these
        hf_config, spec, state_dict = spec_and_state_dict(model_dir)
    if opts.ep > 1 or opts.rollout_ep > 1:  # refuse before any engine starts
        from .backends.megatron.parallel import check_expert_layout

        check_expert_layout(spec, opts.ep, where=f"check --ep {opts.ep}")
        check_expert_layout(spec, opts.rollout_ep, where=f"check --rollout-ep {opts.rollout_ep}")
    if rank != 0 and rollout_dp == 1:  # the trainer's other ranks: the rollout is rank 0's
        _trainer_under_torchrun(opts, spec, state_dict, device, None)
        return 0
    if opts.cuda_graphs:  # refuse before any work (None/False need no check)
        from .backends.vllm.settings import cuda_graph_settings

        cuda_graph_settings(spec, gpu=device == "cuda", cuda_graphs=True, expert_parallel_size=opts.rollout_ep)
    if opts.max_new_tokens >= spec.max_position_embeddings:
        raise UnifiedModelsError(f"--max-new-tokens {opts.max_new_tokens} leaves no room for a prompt: the model's "
                                 f"max_position_embeddings is {spec.max_position_embeddings}")
    from .backends.vllm.settings import check_spec_supported

    check_spec_supported(spec)
    console.log(f"model {model_dir} ({spec.family}, pattern {spec.extra.get('pattern')}, "
                f"{sum(torch.Size(s).numel() for s in spec.parameter_shapes().values()) / 1e6:.1f}M params)")
    with step("prompts"):
        texts = load_prompt_texts(opts.prompts or default_prompts_path(), opts.num_prompts)
        max_prompt = spec.max_position_embeddings - opts.max_new_tokens
        tok_dir = tokenizer_dir_for(model_dir, opts.tokenizer)
        try:
            prompt_ids = tokenize_prompts(texts, tok_dir, vocab_size=spec.vocab_size, max_prompt_tokens=max_prompt)
        except PromptError as e:
            raise PromptError(f"{e} (tokenizer: {tok_dir}; pass --tokenizer to use another)") from None
    timings["load"] = time.perf_counter() - t0
    console.log(f"{len(prompt_ids)} prompts, {sum(map(len, prompt_ids))} prompt tokens")

    def run_peer_check() -> dict:
        t0 = time.perf_counter()
        with step("peer check against transformers"):
            peer = peer_check(spec, state_dict, model_dir, prompt_ids[: opts.peer_prompts], opts.peer_tolerance,
                              hf_config=hf_config)
        timings["peer"] = time.perf_counter() - t0
        console.log(f"peer max |logit diff| = {peer['max_abs_logit_diff']:.3g}, {peer['max_rel_logit_diff']:.3g} of "
                    f"the row's max |logit| {peer['logit_scale']:.3g} (tolerance {opts.peer_tolerance:g} relative, "
                    f"{peer['bound']:.3g} there)")
        return peer

    # at rollout DP > 1 every rank waits in the engines' collectives: the peer check runs last there
    peer = run_peer_check() if rollout_dp == 1 else None

    from .backends.vllm.rollout import RolloutEngine, token_budget

    t0 = time.perf_counter()
    own_rollout_fp = None
    if rollout_dp > 1:
        with step(f"vLLM rollout, DP = {rollout_dp}, EP = {opts.rollout_ep} ({len(prompt_ids)} x "
                  f"{opts.max_new_tokens} tokens)"):
            ro, own_rollout_fp = _rollout_data_parallel(opts, spec, model_dir, state_dict, device, prompt_ids)
            rollout_fp = own_rollout_fp
    else:
        with step(f"vLLM rollout ({len(prompt_ids)} x {opts.max_new_tokens} tokens)"):
            with _OutsideTorchrunStore(), RolloutEngine(
                    spec, model_dir, state_dict=state_dict, device=device, seed=opts.seed,
                    max_model_len=max(map(len, prompt_ids)) + opts.max_new_tokens,
                    max_num_seqs=opts.max_num_seqs or len(prompt_ids),
                    max_num_batched_tokens=token_budget(prompt_ids, opts.max_new_tokens, device),
                    cuda_graphs=opts.cuda_graphs) as engine:
                rollout_fp = engine.contract_fingerprint()
                ro = engine.generate(prompt_ids, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                                     temperature=opts.temperature, stop_at_eos=opts.stop_at_eos,
                                     full_vocab_rows=opts.full_vocab_rows)
    timings["rollout"] = time.perf_counter() - t0
    n_gen = sum(len(c) for c in ro.completions)
    console.log(f"rollout: {n_gen} tokens in {timings['rollout']:.1f} s")

    from .backends.megatron.trainer import Trainer

    t0 = time.perf_counter()
    layout = None
    with step(f"Megatron recompute ({n_gen} tokens)"):
        # the engine is closed first: its memory is free for the trainer (as in a colocated RL step)
        if world > 1 or opts.ep > 1:
            rollout = (prompt_ids, ro.completions, list(ro.full_row_keys), rollout_fp) if rank == 0 else None
            res = _trainer_under_torchrun(opts, spec, state_dict, device, rollout, own_rollout_fp=own_rollout_fp)
            if rank != 0:  # rollout DP > 1: rank 0 writes the report
                return 0
            tr, trainer_fp, layout = res
        else:
            with Trainer(spec, state_dict, device=device) as trainer:
                from .consistency.fingerprint import compare

                trainer_fp = trainer.contract_fingerprint()
                compare(rollout_fp, trainer_fp)  # refused before any recompute or diff
                tr = trainer.logprobs(prompt_ids, ro.completions, temperature=opts.temperature,
                                      full_rows_for=ro.full_row_keys)
    timings["trainer"] = time.perf_counter() - t0
    if layout is not None:
        if rollout_dp > 1:
            console.log(f"rollout: DP = {rollout_dp}, EP = {opts.rollout_ep}, "
                        + ", ".join(f"rank {r['rank']}: prompts {r['rollout_prompts'][0]}-{r['rollout_prompts'][1]}"
                                    for r in layout["ranks"]))
        console.log(f"trainer: EP = {layout['trainer_ep']} over {layout['processes']} processes "
                    + ", ".join(f"rank {r['rank']}: sequences {r['sequences'][0]}-{r['sequences'][1]}, experts "
                                f"{r['experts'][0]}-{r['experts'][1]}" if r["experts"] else f"rank {r['rank']}"
                                for r in layout["ranks"]))

    if peer is None:
        peer = run_peer_check()
    rollout_lp = torch.cat([torch.tensor(x, dtype=torch.float32) for x in ro.logprobs])
    trainer_lp = torch.cat([x.float().cpu() for x in tr.logprobs])
    diff = compare_logprobs(rollout_lp, trainer_lp)
    keys = ro.full_row_keys
    fv = full_vocab_max_abs_diff([ro.full_rows[k] for k in keys], [tr.full_rows[k] for k in keys])
    report = CheckReport(
        model=str(model_dir), device=device, num_prompts=len(prompt_ids), max_new_tokens=opts.max_new_tokens,
        seed=opts.seed, diff=diff, full_vocab_rows=len(keys), full_vocab_max_abs_diff=fv,
        peer=peer, rollout_sha256=rollout_digest(ro.completions, rollout_lp), options={k: v for k, v in vars(opts).items() if k != "json_out"},
        timings_s={k: round(v, 2) for k, v in timings.items()}, engine=ro.engine,
        fingerprints={"contract": trainer_fp.digest, "rollout": rollout_fp.as_dict(), "trainer": trainer_fp.as_dict()},
    )
    if layout is not None:
        report.engine = {**report.engine, "trainer_layout": layout}
    print_report(report, out)
    if opts.json_out:
        path = Path(opts.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(report.as_dict(), indent=2))
        os.replace(tmp, path)
    return 0 if report.passed else 1


def _failure(r: CheckReport) -> str:
    """What made a report fail, in words (engine diff, full-vocab rows, peer)."""
    why = []
    d = r.diff
    if d.tokens_compared == 0:
        why.append("no tokens compared")
    elif not (d.bitwise_equal and d.mean_abs_diff == 0.0 and d.std_abs_diff == 0.0 and d.k3_kl == 0.0):
        why.append("rollout and trainer logprobs differ")
    if r.full_vocab_max_abs_diff != 0.0:
        why.append("full-vocab rows differ")
    if not r.peer.get("within_tolerance"):
        why.append(f"peer max |logit diff| {r.peer.get('max_rel_logit_diff', float('nan')):.3g} of the row's max "
                   f"|logit| {r.peer.get('logit_scale', float('nan')):.3g}, over the relative tolerance "
                   f"{r.peer.get('tolerance', float('nan')):g} (--peer-tolerance)")
    return "; ".join(why) or "see the table"


def print_report(r: CheckReport, console: Console) -> None:
    """The diff table (rich)."""
    t = Table(title=f"rollout (vLLM) vs trainer (Megatron) logprobs — {r.device}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("tokens_compared", str(r.diff.tokens_compared))
    for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl"):
        t.add_row(k, repr(getattr(r.diff, k)))
    t.add_row("tokens with differing bits", str(r.diff.num_mismatched))
    t.add_row(f"full_vocab_max_abs_diff ({r.full_vocab_rows} rows)", repr(r.full_vocab_max_abs_diff))
    t.add_row("peer max_abs_logit_diff", f"{r.peer['max_abs_logit_diff']:.3g}")
    t.add_row("peer max_rel_logit_diff (of the row's max |logit|)",
              f"{r.peer['max_rel_logit_diff']:.3g} (tol {r.peer['tolerance']:g}; scale {r.peer['logit_scale']:.3g}, "
              f"bound {r.peer['bound']:.3g})")
    t.add_row("rollout sha256 (tokens + logprob bits)", r.rollout_sha256[:16])
    if r.fingerprints:
        n = sum(1 for k in r.fingerprints["trainer"]["components"] if k.split(".", 1)[0] not in ("vllm", "megatron"))
        t.add_row("contract fingerprint (vLLM = Megatron)", f"{r.fingerprints['contract'][:16]} ({n} components)")
    if r.engine:
        mode = str(r.engine.get("cudagraph_mode")).rsplit(".", 1)[-1]
        t.add_row("rollout CUDA graphs", f"on ({mode})" if r.engine.get("cuda_graphs") else "off (eager)")
    t.add_row("result", "[green]PASS: diff = 0[/green]" if r.passed else f"[red]FAIL: {_failure(r)}[/red]")
    console.print(t)
