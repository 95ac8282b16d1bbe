"""``unified-models rl``: GRPO with vLLM rollout, Megatron update and in-place weight sync.

The run holds one :class:`~..backends.vllm.rollout.RolloutEngine` and one
:class:`~..backends.megatron.trainer.Trainer`, both built from the spec and state
dict read once. Each step k = 1..N (one optimizer update per step, DESIGN.md rule 10):

1. **rollout** (vLLM, in process, our model class): P prompts
   (:func:`.data.prompts_for_step`) x G samples, each request with its own
   seed (:func:`.data.request_seed`), ``--max-new-tokens`` tokens at
   ``--temperature`` through the logprob op. vLLM reports the logprob of every
   sampled token; the engine's :class:`SampleRecorder` keeps the whole fp32 row it
   was sampled from for the first ``ceil(--full-vocab-rows / --max-new-tokens)``
   sequences. Rewards are scored and
   group-normalised (:mod:`.grpo`).
2. **recompute** (Megatron module, no grad): the trainer recomputes, from the
   same token ids and weights, packed (THD), the logprob of every sampled token
   and the recorded whole rows; they are compared with
   :mod:`unified_models.consistency.metrics`. The first token whose fp32 bits
   differ stops the run (exit 1) naming the step, sequence and position.
3. **update** (``Trainer.step``, with grad): the same forward with a graph,
   GRPO loss over the completion tokens, backward per micro-batch (gradients
   accumulate in fp32), one optimizer step (:mod:`..backends.megatron.optimizer`).
   The importance ratio trainer/old is computed per token (exactly 1 while
   diff = 0) and the forward's logprobs are compared bitwise with the
   rollout's before any backward.
4. **sync**: every parameter is copied into vLLM's existing buffers by
   Hugging Face name, derived tensors recomputed, prefix cache reset
   (:mod:`..backends.vllm.weight_sync`). Step k+1's diff = 0 proves the sync.

``--use-rollout-logprobs`` (old logprobs = the rollout's; saves the no-grad
forward of step 2). Rule: the first step of every process (a fresh run, and
the first step after ``--resume``) always runs the recompute and compares; from
the next step on the recompute is skipped and the comparison moves to the
update's forward (step 3), which still checks every sampled token and the
recorded rows bitwise before its backward, so a diff != 0 still stops the run
before the update it would corrupt. The metrics line says which source was
used (``old_logprobs``).

Checkpoints: ``--save DIR`` writes Megatron training checkpoints (model,
optimizer, RNG, step; :mod:`..backends.megatron.checkpoint`) every
``--save-every`` steps and after the last; ``--resume DIR`` continues from
DIR's latest one up to ``--steps``. Prompts and request seeds depend only on
``(seed, step)``, so a resumed run samples, scores and updates exactly as the
uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..run_options import check_output_path, resolve_device
from ..consistency.metrics import compare_logprobs, full_vocab_max_abs_diff
from ..dsl import PromptError, UnifiedModelsError
from .data import load_prompt_rows, prompts_for_step, request_seed
from .grpo import group_advantages, grpo_loss, token_weights
from .metrics import MetricsWriter, summarize
from .rewards import Completion, build_reward, reward_info

__all__ = ["RLOptions", "DiffNotZeroError", "run_rl", "resolve_options"]

AUTO = "auto"


@dataclass(kw_only=True)
class RLOptions:
    """Options of ``unified-models rl`` (see ``unified-models rl --help``).

    ``temperature``, ``max_new_tokens`` and ``lr`` default (None) to the
    reward's registered defaults (:mod:`.rewards`), then to the loop's.
    """

    model: str | None = None
    preset: str | None = None
    prompts: str | None = None
    tokenizer: str | None = None
    reward: str = "target-token"
    target_token_id: int | str = AUTO
    steps: int = 30
    group_size: int = 8
    num_prompts_per_step: int = 4
    lr: float | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int = 0
    device: str = "auto"
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    clip_grad: float = 1.0
    metrics: str = "rl_metrics.jsonl"
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    use_rollout_logprobs: bool = False
    stop_at_eos: bool = False
    full_vocab_rows: int = 256
    micro_batch_tokens: int | None = None
    plot: bool = True


LOOP_DEFAULTS = {"temperature": 1.0, "max_new_tokens": 64, "lr": 1e-6}
"""Used where neither the flag nor the reward sets a value."""


def resolve_options(opts: RLOptions) -> RLOptions:
    """Fill ``temperature`` / ``max_new_tokens`` / ``lr`` from the reward's defaults, then :data:`LOOP_DEFAULTS`."""
    info = reward_info(opts.reward)
    out = RLOptions(**asdict(opts))
    for key, fallback in LOOP_DEFAULTS.items():
        if getattr(out, key) is None:
            setattr(out, key, info.defaults.get(key, fallback))
    return out


class DiffNotZeroError(RuntimeError):
    """Rollout and trainer logprobs differ: names the step, sequence and position (the run exits 1)."""

    def __init__(self, message: str, diff=None, full_vocab: float | None = None):
        super().__init__(message)
        self.diff = diff
        self.full_vocab = full_vocab


# --------------------------------------------------------------------------- helpers


def _validate(opts: RLOptions) -> None:
    """Every refusal that needs no model, before anything starts."""
    if opts.model and opts.preset:
        raise UnifiedModelsError("--model and --preset are mutually exclusive")
    reward_info(opts.reward)
    if opts.group_size < 2:
        raise UnifiedModelsError(f"--group-size {opts.group_size}: GRPO needs at least 2 samples per prompt "
                                 "(the group mean is the baseline)")
    if not opts.temperature > 0:
        raise UnifiedModelsError(f"--temperature must be > 0, got {opts.temperature}")
    if not (opts.lr > 0 and math.isfinite(opts.lr)):
        raise UnifiedModelsError(f"--lr must be a finite number > 0, got {opts.lr}")
    if opts.kl_coef < 0 or not math.isfinite(opts.kl_coef):
        raise UnifiedModelsError(f"--kl-coef must be >= 0, got {opts.kl_coef}")
    if opts.save_every and not opts.save:
        raise UnifiedModelsError("--save-every needs --save DIR")
    if opts.save_every < 0:
        raise UnifiedModelsError(f"--save-every must be >= 0, got {opts.save_every}")
    if opts.target_token_id != AUTO and opts.reward != "target-token":
        raise UnifiedModelsError(f"--target-token-id applies to --reward target-token, not {opts.reward!r}")
    check_output_path("--metrics", Path(opts.metrics))
    if opts.resume:
        from ..backends.megatron.checkpoint import latest_iteration

        r = Path(opts.resume)
        if not r.is_dir():
            raise UnifiedModelsError(f"--resume {r}: no such directory")
        if latest_iteration(r) is None and not (r / "metadata.json").is_file():
            raise UnifiedModelsError(f"--resume {r}: no training checkpoint there (no "
                                     "latest_checkpointed_iteration.txt); write one with --save")
    if opts.save:
        from ..backends.megatron.checkpoint import latest_iteration

        s = Path(opts.save)
        if s.exists() and not s.is_dir():
            raise UnifiedModelsError(f"--save {s} is a file")
        have = latest_iteration(s) if s.is_dir() else None
        if have is not None and not (opts.resume and Path(opts.resume).resolve() == s.resolve()):
            raise UnifiedModelsError(f"--save {s} already holds checkpoints (latest step {have}); pass --resume {s} "
                                     "to continue that run, or choose an empty directory")


def _tokenizer_dir(model_dir: Path, explicit: str | None) -> Path:
    from ..presets import tokenizer_dir

    if explicit:
        return Path(explicit)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return model_dir
    return tokenizer_dir()


def _entropy_sum(lp_RV: torch.Tensor) -> float:
    """Σ over rows of ``-Σ_v p log p`` (fp64), ``p = exp(lp)``; ``-inf`` entries contribute 0."""
    total = 0.0
    for lp in lp_RV.detach().split(1024):  # bounded temporaries on large micro-batches
        p = lp.exp()
        total += float((-(torch.where(p > 0, p * lp, torch.zeros_like(lp))).sum(-1)).double().sum())
    return total


def _full_vocab(pairs: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> float:
    """Max |Δ| over ``(rollout row, trainer row, key)`` pairs (0.0 when none were recorded)."""
    if not pairs:
        return 0.0
    return full_vocab_max_abs_diff(torch.stack([a for a, _, _ in pairs]), torch.stack([b for _, b, _ in pairs]))


def _first_mismatch(a_N: torch.Tensor, b_N: torch.Tensor) -> int | None:
    bad = (a_N.float().view(torch.int32) != b_N.float().view(torch.int32)).nonzero()
    return int(bad[0]) if bad.numel() else None


# --------------------------------------------------------------------------- the run


@dataclass
class _StepOut:
    row: dict
    error: DiffNotZeroError | None = None


@dataclass
class _Run:
    opts: RLOptions
    device: str
    spec: Any
    model_dir: Path
    prompt_ids: list[list[int]]
    rows: list
    tokenizer: Any
    reward: Any
    reward_name: str
    target_token_id: int | None
    engine: Any = None
    """The :class:`~..backends.vllm.rollout.RolloutEngine` (one ``vllm.LLM`` for the run)."""
    trainer: Any = None
    """The :class:`~..backends.megatron.trainer.Trainer` (module, optimizer, frozen reference)."""
    first_step_of_process: int = 1

    # ------------------------------------------------------------------ rollout

    def rollout(self, step: int, seq_prompts: list[list[int]]):
        """Completions, per-sequence fp32 logprobs and the recorded whole rows keyed ``(s, j)``.

        Whole rows are kept for the first ``ceil(full_vocab_rows / max_new_tokens)``
        sequences only (-1: all), so only those leave the device.
        """
        o = self.opts
        if o.full_vocab_rows < 0:
            keep = -1
        else:
            keep = min(len(seq_prompts), math.ceil(o.full_vocab_rows / o.max_new_tokens))
        ro = self.engine.generate(seq_prompts, max_new_tokens=o.max_new_tokens,
                                  seeds=[request_seed(o.seed, step, s) for s in range(len(seq_prompts))],
                                  temperature=o.temperature, stop_at_eos=o.stop_at_eos, full_row_requests=keep)
        logprobs = [torch.tensor(lps, dtype=torch.float32) for lps in ro.logprobs]
        full_rows = {(s, pos - len(seq_prompts[s]) + 1): ro.full_rows[(s, pos)] for s, pos in ro.full_row_keys}
        return ro.completions, logprobs, full_rows

    # ------------------------------------------------------------------ diff

    def _where(self, step: int, s: int, j: int, prompt_rows: list[int], seq_prompts) -> str:
        g = self.opts.group_size
        return (f"step {step}, sequence {s} (prompt row {self.rows[prompt_rows[s // g]].line} of the prompt file, "
                f"sample {s % g} of {g}), position {len(seq_prompts[s]) + j} (completion token {j})")

    def check(self, step: int, phase: str, rollout_N: torch.Tensor, trainer_N: torch.Tensor, owners, prompt_rows,
              seq_prompts, full_pairs: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]]):
        """Raise :class:`DiffNotZeroError` at the first differing token (or row)."""
        k = _first_mismatch(rollout_N, trainer_N)
        if k is not None:
            s, j = owners[k]
            diff = compare_logprobs(rollout_N, trainer_N)
            raise DiffNotZeroError(
                f"diff != 0 at {self._where(step, s, j, prompt_rows, seq_prompts)}: rollout logprob "
                f"{float(rollout_N[k])!r} vs trainer ({phase}) {float(trainer_N[k])!r}; "
                f"{diff.num_mismatched} of {diff.tokens_compared} tokens differ (max |diff| {diff.max_abs_diff:.3g})",
                diff=diff)
        for a, b, (s, j) in full_pairs:
            if not torch.equal(a, b):
                fv = full_vocab_max_abs_diff(a[None], b[None])
                raise DiffNotZeroError(
                    f"diff != 0 at {self._where(step, s, j, prompt_rows, seq_prompts)}: the sampled token's logprob "
                    f"agrees but the whole row ({phase}) differs, max |diff| {fv:.3g}",
                    diff=compare_logprobs(rollout_N, trainer_N), full_vocab=fv)

    # ------------------------------------------------------------------ trainer phases

    def _elapsed(self, t0: float) -> float:
        """Seconds since ``t0`` once the GPU has finished the phase's queued work
        (without the synchronize, asynchronous kernels are billed to the next phase)."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def recompute(self, seq_prompts, completions, full_keys: set) -> tuple[torch.Tensor, dict]:
        """Trainer logprobs ``[N]`` (flat order) and the whole rows of ``full_keys`` (``(s, j)``)."""
        at = {(s, len(seq_prompts[s]) - 1 + j): (s, j) for s, j in full_keys}
        res = self.trainer.logprobs(seq_prompts, completions, temperature=self.opts.temperature, full_rows_for=at)
        rows = {at[k]: r for k, r in res.full_rows.items()}
        return (torch.cat(res.logprobs) if res.logprobs else torch.zeros(0)), rows

    def update(self, step: int, seq_prompts, completions, rollout_N: torch.Tensor, old_N: torch.Tensor,
               adv_N: torch.Tensor, w_N: torch.Tensor, full_rows: dict, compare: bool, prompt_rows) -> dict:
        """One :meth:`Trainer.step`: per micro-batch the forward with a graph is compared bitwise
        with the rollout, then the GRPO loss; one optimizer update."""
        o = self.opts
        acc = {"loss": 0.0, "entropy_sum": 0.0, "importance_ratio_max": -math.inf,
               "importance_ratio_min": math.inf, "ref_kl_sum": 0.0, "clipped_tokens": 0}
        trainer_parts, fv_pairs = [], []

        def loss_fn(tb):
            mb = tb.batch
            new_R = tb.logprobs.detach().float().cpu()
            trainer_parts.append(new_R)
            acc["entropy_sum"] += _entropy_sum(tb.rows)
            pairs = [(full_rows[key], tb.rows[r].detach().float().cpu(), key)
                     for r, key in enumerate(mb.owners) if key in full_rows] if compare else []
            fv_pairs.extend(pairs)
            # every token (and recorded row) is compared before this micro-batch's backward
            self.check(step, "update forward", rollout_N[mb.flat], new_R, mb.owners, prompt_rows, seq_prompts,
                       pairs)
            ref = tb.reference_logprobs() if o.kl_coef > 0 else None
            dev = tb.logprobs.device
            res = grpo_loss(tb.logprobs.float(), old_N[mb.flat].to(dev), adv_N[mb.flat].to(dev),
                            w_N[mb.flat].to(dev), ref_logp_N=ref, kl_coef=o.kl_coef, clip_eps=o.clip_eps)
            acc["loss"] += float(res.loss.detach())
            if res.ratio_N.numel():
                acc["importance_ratio_max"] = max(acc["importance_ratio_max"], float(res.ratio_N.max()))
                acc["importance_ratio_min"] = min(acc["importance_ratio_min"], float(res.ratio_N.min()))
            acc["clipped_tokens"] += int(res.clipped_N.sum())
            if res.k3_N is not None:
                acc["ref_kl_sum"] += float(res.k3_N.double().sum())
            return res.loss

        stats = self.trainer.step(seq_prompts, completions, loss_fn, temperature=o.temperature)
        trainer_N = torch.cat(trainer_parts) if trainer_parts else torch.zeros(0)
        return {**acc, "grad_norm": stats.get("grad_norm"), "update_successful": stats.get("update_successful"),
                "trainer_N": trainer_N, "fv_pairs": fv_pairs}

    def sync(self):
        """Copy every changed parameter into vLLM's buffers in place (bf16 bits unchanged); reset the prefix cache."""
        return self.engine.sync_weights(self.trainer.named_weights())

    # ------------------------------------------------------------------ one step

    def step(self, step: int, timer: dict) -> _StepOut:
        o = self.opts
        t0 = time.perf_counter()
        prompt_rows = prompts_for_step(len(self.prompt_ids), o.num_prompts_per_step, o.seed, step)
        seq_prompts = [self.prompt_ids[i] for i in prompt_rows for _ in range(o.group_size)]
        completions, rollout_lps, full_rows = self.rollout(step, seq_prompts)
        if self.reward_name == "target-token" and self.target_token_id is None:
            # auto: the token the initial policy sampled most often in step 1 (ties: smallest id)
            counts = torch.bincount(torch.tensor([t for c in completions for t in c], dtype=torch.long),
                                    minlength=self.spec.vocab_size)
            self.target_token_id = int(torch.argmax(counts))
            self.reward = build_reward("target-token", target_token_id=self.target_token_id)
        info = reward_info(self.reward_name)
        rewards = []
        for s, toks in enumerate(completions):
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if info.needs_text else None
            ref = self.rows[prompt_rows[s // o.group_size]].answer
            rewards.append(float(self.reward(Completion(token_ids=toks, text=text, reference=ref))))
        rewards_S = torch.tensor(rewards, dtype=torch.float64)
        adv_S = group_advantages(rewards_S, o.group_size)
        lengths = [len(c) for c in completions]
        adv_N = torch.repeat_interleave(adv_S, torch.tensor(lengths, dtype=torch.long))
        w_N = token_weights(lengths)
        rollout_N = torch.cat(rollout_lps) if rollout_lps else torch.zeros(0)
        timer["rollout"] = self._elapsed(t0)

        from ..consistency.metrics import rollout_digest

        row: dict[str, Any] = {
            "step": step, "reward_mean": float(rewards_S.mean()), "reward_std": float(rewards_S.std(unbiased=False)),
            "reward_max": float(rewards_S.max()), "tokens": int(rollout_N.numel()),
            "sequences": len(completions), "prompt_rows": [self.rows[i].line for i in prompt_rows],
            "rollout_sha256": rollout_digest(completions, rollout_N),
        }
        if self.target_token_id is not None:
            row["target_token_id"] = self.target_token_id
        owners = [(s, j) for s, c in enumerate(completions) for j in range(len(c))]  # flat token order
        use_rollout = o.use_rollout_logprobs and step > self.first_step_of_process
        row["old_logprobs"] = "rollout" if use_rollout else "recompute"
        try:
            t0 = time.perf_counter()
            if use_rollout:
                old_N, timer["recompute"] = rollout_N, 0.0
            else:
                trainer_N, trainer_rows = self.recompute(seq_prompts, completions, set(full_rows))
                timer["recompute"] = self._elapsed(t0)
                pairs = [(full_rows[k], trainer_rows[k], k) for k in full_rows]
                diff = compare_logprobs(rollout_N, trainer_N)
                row.update(diff.as_dict())
                row.update(full_vocab_max_abs_diff=_full_vocab(pairs), full_vocab_rows=len(pairs))
                self.check(step, "recompute", rollout_N, trainer_N, owners, prompt_rows, seq_prompts, pairs)
                old_N = trainer_N
            t0 = time.perf_counter()
            up = self.update(step, seq_prompts, completions, rollout_N, old_N, adv_N, w_N, full_rows, use_rollout,
                             prompt_rows)
            timer["update"] = self._elapsed(t0)
        except DiffNotZeroError as e:
            if e.diff is not None:
                row.update(e.diff.as_dict())
            if e.full_vocab is not None:
                row["full_vocab_max_abs_diff"] = e.full_vocab
            row.setdefault("full_vocab_max_abs_diff", None)
            return _StepOut(row=row, error=e)
        if use_rollout:
            diff = compare_logprobs(rollout_N, up["trainer_N"])
            pairs = up["fv_pairs"]
            row.update(diff.as_dict())
            row.update(full_vocab_max_abs_diff=_full_vocab(pairs), full_vocab_rows=len(pairs))
        n = max(int(rollout_N.numel()), 1)
        row.update(importance_ratio_max=up["importance_ratio_max"], importance_ratio_min=up["importance_ratio_min"],
                   entropy=up["entropy_sum"] / n, ref_kl=up["ref_kl_sum"] / n, loss=up["loss"],
                   grad_norm=up["grad_norm"], clipped_tokens=up["clipped_tokens"],
                   advantage_abs_mean=float(adv_S.abs().mean()))
        t0 = time.perf_counter()
        rep = self.sync()
        timer["sync"] = self._elapsed(t0)
        row.update(sync_tensors_copied=len(rep.copied), sync_bytes=rep.bytes_copied)
        return _StepOut(row=row)


def _load(opts: RLOptions, console) -> _Run:
    from ..backends.vllm.engine import check_spec_supported
    from ..converters.hf_safetensors import spec_and_state_dict
    from ..presets import DEFAULT_PRESET, build_preset_checkpoint, default_prompts_path
    from ..prompts import tokenize_prompts

    device = resolve_device(opts.device)
    model_dir = Path(opts.model) if opts.model else build_preset_checkpoint(opts.preset or DEFAULT_PRESET)
    _, spec, state_dict = spec_and_state_dict(model_dir)
    check_spec_supported(spec)
    if opts.max_new_tokens >= spec.max_position_embeddings:
        raise UnifiedModelsError(f"--max-new-tokens {opts.max_new_tokens} leaves no room for a prompt: the model's "
                                 f"max_position_embeddings is {spec.max_position_embeddings}")
    tid = opts.target_token_id
    if tid != AUTO:
        if not isinstance(tid, int) or not 0 <= tid < spec.vocab_size:
            raise UnifiedModelsError(f"--target-token-id {tid} is outside the model vocabulary [0, {spec.vocab_size})")
    info = reward_info(opts.reward)
    prompts_path = opts.prompts or default_prompts_path()
    rows = load_prompt_rows(prompts_path, need_answer=info.needs_reference)
    if opts.num_prompts_per_step > len(rows):
        raise UnifiedModelsError(f"--num-prompts-per-step {opts.num_prompts_per_step} exceeds the {len(rows)} "
                                 f"prompts in {prompts_path}")
    tok_dir = _tokenizer_dir(model_dir, opts.tokenizer)
    max_prompt = spec.max_position_embeddings - opts.max_new_tokens
    try:
        prompt_ids = tokenize_prompts([r.text for r in rows], tok_dir, vocab_size=spec.vocab_size,
                                      max_prompt_tokens=max_prompt)
    except PromptError as e:
        raise PromptError(f"{e} (tokenizer: {tok_dir}; pass --tokenizer to use another)") from None
    tokenizer = None
    if info.needs_text:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    reward = None if (opts.reward == "target-token" and tid == AUTO) else \
        build_reward(opts.reward, target_token_id=tid if tid != AUTO else None)
    run = _Run(opts=opts, device=device, spec=spec, model_dir=model_dir, prompt_ids=prompt_ids, rows=rows,
               tokenizer=tokenizer, reward=reward, reward_name=opts.reward,
               target_token_id=None if tid == AUTO else int(tid))
    run._state_dict = state_dict
    return run


def _start_engines(run: _Run, console) -> int:
    """vLLM engine, trainer module, optimizer, reference; restore ``--resume``. Returns the last finished step."""
    from ..backends.megatron import destroy_parallel_state
    from ..backends.megatron.optimizer import OptimizerConfig
    from ..backends.megatron.trainer import Trainer, TrainerOptions
    from ..backends.vllm.rollout import RolloutEngine

    o = run.opts
    # Megatron's groups from an earlier run in this process may sit on a process
    # group vLLM's shutdown has destroyed: drop them; vLLM (re)creates the world.
    destroy_parallel_state()
    longest = max(len(p) for p in run.prompt_ids)
    s = o.num_prompts_per_step * o.group_size
    # the engine gets the state dict read once in _load: vLLM does not read the checkpoint again
    run.engine = RolloutEngine(run.spec, run.model_dir, state_dict=run._state_dict, device=run.device, seed=o.seed,
                               max_model_len=longest + o.max_new_tokens, max_num_seqs=s,
                               max_num_batched_tokens=max(longest + o.max_new_tokens, s * longest))
    # a ModelOpt checkpoint: the trainer trains bf16 masters, quantized on every forward
    run.trainer = Trainer(run.spec, run._state_dict, device=run.device,
                          options=TrainerOptions(optimizer=OptimizerConfig(lr=o.lr, clip_grad=o.clip_grad),
                                                 reference_model=o.kl_coef > 0,  # frozen copy of the initial weights
                                                 micro_batch_tokens=o.micro_batch_tokens))
    run.spec = run.trainer.spec
    run._state_dict = None
    start = 0
    if o.resume:
        ck = run.trainer.resume(o.resume)
        start = ck.iteration
        saved = ck.extra.get("rl", {})
        if run.reward_name == "target-token" and run.target_token_id is None:
            if saved.get("target_token_id") is None:
                raise UnifiedModelsError(f"--resume {o.resume}: the checkpoint does not record the target token "
                                         "that 'auto' chose; pass --target-token-id")
            run.target_token_id = int(saved["target_token_id"])
            run.reward = build_reward("target-token", target_token_id=run.target_token_id)
        changed = {k: (saved.get(k), v) for k, v in _run_identity(o).items() if k in saved and saved[k] != v}
        if changed:
            console.log(f"[yellow]note[/yellow]: resumed with other settings than the saved run: "
                        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        if start >= o.steps:
            raise UnifiedModelsError(f"--resume {o.resume} is at step {start}; --steps {o.steps} leaves nothing to do")
        run.sync()  # the engine starts from the checkpoint's weights
    elif run.trainer.trains_masters:
        # dequantize -> requantize is not the identity (scales are recomputed from the
        # rounded masters): give the engine the masters' codes before the first rollout
        rep = run.sync()
        console.log(f"ModelOpt checkpoint: trainer holds bf16 masters; engine re-quantized from them "
                    f"({len(rep.copied)} tensors, {rep.seconds:.1f} s)")
    run.first_step_of_process = start + 1
    return start


def _run_identity(o: RLOptions) -> dict:
    """What must match for a resumed run to continue the same trajectory."""
    return {"reward": o.reward, "seed": o.seed, "group_size": o.group_size,
            "num_prompts_per_step": o.num_prompts_per_step, "temperature": o.temperature,
            "max_new_tokens": o.max_new_tokens, "lr": o.lr, "kl_coef": o.kl_coef,
            "prompts": str(o.prompts) if o.prompts else None, "stop_at_eos": o.stop_at_eos}


def _save(run: _Run, step: int) -> Path:
    extra = {"rl": {**_run_identity(run.opts), "target_token_id": run.target_token_id, "step": step}}
    return run.trainer.save(run.opts.save, iteration=step, hf_config=(run.model_dir / "config.json").read_text(),
                            extra=extra, overwrite=True)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def _step_line(row: dict, steps: int) -> str:
    sec = row["seconds"]
    return (f"step {row['step']:>3}/{steps}  reward {row['reward_mean']:.3f}  "
            f"max|Δ| {_fmt(row.get('max_abs_diff'))}  k3 {_fmt(row.get('k3_kl'))}  "
            f"full-vocab {_fmt(row.get('full_vocab_max_abs_diff'))}  ratio {_fmt(row.get('importance_ratio_max'))}  "
            f"H {_fmt(row.get('entropy'))}  tokens {row['tokens']}  "
            f"| {' '.join(f'{k} {v:.1f}s' for k, v in sec.items() if k != 'step')}")


def run_rl(opts: RLOptions) -> int:
    """Run GRPO; print progress and a summary; write metrics (and plot, checkpoints).

    Returns:
        0 when every step finished with diff = 0; 1 at the first diff != 0
        (the metrics line of that step is written, then the plot).

    Raises:
        UnifiedModelsError: bad options or inputs (before any engine starts where possible).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..check import quiet_engines
    from .plot import plot_metrics, plot_path_for

    quiet_engines()
    opts = resolve_options(opts)
    _validate(opts)
    console, out = Console(stderr=True), Console()
    wall0 = time.perf_counter()
    with console.status("[bold]loading checkpoint and prompts[/bold]", spinner="dots"):
        run = _load(opts, console)
    console.log(f"model {run.model_dir} ({run.spec.family}, pattern {run.spec.extra.get('pattern')}); "
                f"reward {opts.reward}; {opts.num_prompts_per_step} prompts x {opts.group_size} samples x "
                f"{opts.max_new_tokens} tokens per step at T={opts.temperature:g}, lr {opts.lr:g}, device {run.device}")
    failure: DiffNotZeroError | None = None
    saved_at: Path | None = None
    try:
        with console.status("[bold]starting vLLM and the Megatron trainer[/bold]", spinner="dots"):
            start = _start_engines(run, console)
        if start:
            console.log(f"resumed from {opts.resume} at step {start}")
        writer = MetricsWriter(opts.metrics, resume_step=start if opts.resume else None)
        columns = (SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("GRPO", total=opts.steps, completed=start, info="")
            for step in range(start + 1, opts.steps + 1):
                progress.update(task, description=f"step {step}")
                timer = {p: 0.0 for p in ("rollout", "recompute", "update", "sync", "save")}
                t_step = time.perf_counter()
                res = run.step(step, timer)
                if res.error is None and opts.save and (step == opts.steps or
                                                        (opts.save_every and step % opts.save_every == 0)):
                    t0 = time.perf_counter()
                    saved_at = _save(run, step)
                    timer["save"] = time.perf_counter() - t0
                timer["step"] = time.perf_counter() - t_step
                res.row["seconds"] = {k: round(v, 4) for k, v in timer.items()}
                res.row.setdefault("importance_ratio_max", None)
                res.row.setdefault("entropy", None)
                writer.write(res.row)
                if res.error is not None:
                    failure = res.error
                    break
                progress.console.log(_step_line(res.row, opts.steps))
                progress.update(task, advance=1,
                                info=f"reward {res.row['reward_mean']:.3f}  max|Δ| {_fmt(res.row['max_abs_diff'])}")
    finally:
        from ..backends.megatron import destroy_parallel_state

        if run.trainer is not None:
            run.trainer.close()
        destroy_parallel_state()  # its groups live on the process group vLLM's shutdown tears down
        if run.engine is not None:
            run.engine.close()
    rows = writer.rows()
    png = None
    if opts.plot and rows:
        try:
            png = plot_metrics(opts.metrics, plot_path_for(opts.metrics), title=f"GRPO {opts.reward}")
        except ImportError as e:  # the run itself is complete; say why there is no picture
            console.log(f"[yellow]no plot[/yellow]: {e} (matplotlib is in requirements-cpu.txt; "
                        "re-run ./scripts/install-cpu.sh or pip install matplotlib)")
    _print_summary(out, rows, opts, png, saved_at, time.perf_counter() - wall0, failure)
    if failure is not None:
        console.print(f"[red]FAIL[/red]: {failure}")
        return 1
    return 0


def _print_summary(out, rows, opts: RLOptions, png, saved_at, wall_s: float, failure) -> None:
    from rich.table import Table

    s = summarize(rows)
    t = Table(title=f"unified-models rl: GRPO, reward {opts.reward}")
    t.add_column("")
    t.add_column("value", justify="right")
    if s:
        w = min(5, s["steps"])
        t.add_row("steps in metrics", f"{s['first_step']}..{s['last_step']}")
        t.add_row(f"reward_mean, first {w} steps", f"{s[f'reward_mean_first_{w}']:.4f}")
        t.add_row(f"reward_mean, last {w} steps", f"{s[f'reward_mean_last_{w}']:.4f}")
        for k in ("max_abs_diff", "full_vocab_max_abs_diff", "k3_kl", "importance_ratio_max"):
            t.add_row(f"{k} (worst step)", repr(s[k]))
        t.add_row("tokens sampled", str(s["tokens"]))
        t.add_row("seconds (rollout / recompute / update / sync / save)",
                  " / ".join(f"{s['seconds'][p]:.1f}" for p in ("rollout", "recompute", "update", "sync", "save")))
    t.add_row("wall time (this process)", f"{wall_s:.1f} s")
    t.add_row("metrics", str(opts.metrics))
    if png:
        t.add_row("plot", str(png))
    if saved_at:
        t.add_row("checkpoint", str(saved_at))
    t.add_row("result", f"[red]FAIL: {failure}[/red]" if failure else "[green]PASS: diff = 0 at every step[/green]")
    out.print(t)
