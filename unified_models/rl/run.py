"""One GRPO step of ``unified-models rl``: rollout, rewards and advantages, recompute and
bitwise compare, update, weight sync (:class:`RLRun`; the steps are described in :mod:`.loop`).

The run holds one :class:`~..backends.vllm.rollout.RolloutEngine` and one
:class:`~..backends.megatron.trainer.Trainer` and uses only their public methods
(``generate``, ``sync_weights``; ``logprobs``, ``step``, ``named_weights``).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..consistency.metrics import compare_logprobs, full_vocab_max_abs_diff, rollout_digest
from .data import prompts_for_step, request_seed
from .distributed import RLLayout, all_gather, rollout_weights
from .grpo import group_advantages, grpo_loss, token_weights
from .options import RLOptions
from .rewards import Completion, build_reward, reward_info

__all__ = ["DiffNotZeroError", "RLRun", "StepResult", "WeightSyncMismatch", "entropy_sum", "first_mismatch",
           "full_vocab_of_pairs"]


class DiffNotZeroError(RuntimeError):
    """Rollout and trainer logprobs differ: names the step, sequence and position (the run exits 1)."""

    def __init__(self, message: str, diff=None, full_vocab: float | None = None):
        super().__init__(message)
        self.diff = diff
        self.full_vocab = full_vocab


class WeightSyncMismatch(DiffNotZeroError):
    """The weight fingerprint after a sync differs between the trainer and vLLM's buffers: names the
    tensor(s) and the step (the run exits 1, as for a diff != 0)."""


def entropy_sum(lp_RV: torch.Tensor) -> float:
    """Σ over rows of ``-Σ_v p log p`` (fp64), ``p = exp(lp)``; ``-inf`` entries contribute 0."""
    total = 0.0
    for lp in lp_RV.detach().split(1024):  # bounded temporaries on large micro-batches
        p = lp.exp()
        total += float((-(torch.where(p > 0, p * lp, torch.zeros_like(lp))).sum(-1)).double().sum())
    return total


def full_vocab_of_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> float:
    """Max |Δ| over ``(rollout row, trainer row, key)`` pairs (0.0 when none were recorded)."""
    if not pairs:
        return 0.0
    return full_vocab_max_abs_diff(torch.stack([a for a, _, _ in pairs]), torch.stack([b for _, b, _ in pairs]))


def first_mismatch(a_N: torch.Tensor, b_N: torch.Tensor) -> int | None:
    """Index of the first element whose fp32 bits differ between ``a_N`` and ``b_N`` (same shape ``[N]``), else None."""
    bad = (a_N.float().view(torch.int32) != b_N.float().view(torch.int32)).nonzero()
    return int(bad[0]) if bad.numel() else None


@dataclass
class StepResult:
    """One step's metrics line (:mod:`.metrics`, without ``seconds``) and the diff that stopped it, if any."""

    row: dict
    error: DiffNotZeroError | None = None


@dataclass
class RLRun:
    """The state of one ``rl`` run: options, model, prompts, reward, the two engines.

    Built by :func:`.startup.load_run`; :func:`.startup.start_engines` sets ``engine``
    and ``trainer``; :meth:`step` runs one GRPO step.
    """

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
    tokenizer_dir: Path | None = None
    """The tokenizer directory the prompts were tokenized with; its files go to every checkpoint's
    ``hf_assets/`` (:func:`.startup.save_checkpoint`)."""
    engine: Any = None
    """The :class:`~..backends.vllm.rollout.RolloutEngine` (one ``vllm.LLM`` for the run)."""
    trainer: Any = None
    """The :class:`~..backends.megatron.trainer.Trainer` (module, optimizer, frozen reference)."""
    first_step_of_process: int = 1
    saved_metrics_row: dict | None = None
    """On ``--resume``: the metrics line the checkpoint recorded for its step (or None)."""
    state_dict: dict | None = None
    """The checkpoint's validated tensors until both engines hold them (then None)."""
    initial_weights_sha256: str | None = None
    """With ``--kl-coef > 0``: the digest of the weights the KL reference is built from (``--model`` /
    the preset; :func:`.startup.weights_sha256`), saved with each checkpoint and checked on ``--resume``."""
    contract: Any = None
    """The execution-contract :class:`~..consistency.fingerprint.Fingerprint` both engines agreed on
    (:meth:`verify_contract`)."""
    layout: RLLayout = field(default_factory=RLLayout)
    """Where the work lives (:mod:`.distributed`; one process by default)."""
    _sync_step: int | None = None
    _sync_fields: dict | None = None

    # ------------------------------------------------------------------ fingerprints

    def verify_contract(self):
        """Compute both engines' contract fingerprints and refuse a difference (before any rollout).

        Returns:
            The trainer's :class:`~..consistency.fingerprint.Fingerprint` (its ``digest`` equals the engine's).

        Raises:
            FingerprintMismatchError: the components differ (names the component and both values).
        """
        from ..consistency.fingerprint import compare

        rollout_fp, trainer_fp = self.engine.contract_fingerprint(), self.trainer.contract_fingerprint()
        compare(rollout_fp, trainer_fp)
        self.contract = trainer_fp
        return trainer_fp

    def verify_sync(self, rep, step: int | None) -> dict:
        """Compare a sync's per-tensor checksums (both sides, :class:`~..backends.vllm.weight_sync.SyncReport`).

        Returns:
            The metrics fields ``weight_fingerprint`` (digest, None when the sync computed no
            checksums), ``weight_fingerprint_tensors`` (tensors compared) and
            ``weight_fingerprint_seconds``.

        Raises:
            WeightSyncMismatch: a tensor differs; names it and the step.
        """
        from ..consistency.fingerprint import WeightFingerprintError, verify_weight_sync

        src, eng = getattr(rep, "source_checksums", None), getattr(rep, "engine_checksums", None)
        if src is None or eng is None:
            return {"weight_fingerprint": None, "weight_fingerprint_tensors": 0, "weight_fingerprint_seconds": 0.0}
        try:
            wf = verify_weight_sync(src, eng, step=step)
        except WeightFingerprintError as e:
            raise WeightSyncMismatch(str(e)) from e
        return {"weight_fingerprint": wf.digest, "weight_fingerprint_tensors": wf.tensors_checked,
                "weight_fingerprint_seconds": round(rep.checksum_seconds, 4)}

    # ------------------------------------------------------------------ rollout

    def rollout(self, step: int, seq_prompts: list[list[int]], first: int = 0, total: int | None = None):
        """Completions, per-sequence fp32 logprobs and the recorded whole rows keyed ``(s, j)``
        (``s`` local to ``seq_prompts``).

        ``seq_prompts`` are the step's sequences ``first, first + 1, ...`` of ``total`` (default: all
        of them): request seeds and the row selection use the global index. Whole rows are kept for
        the first ``ceil(full_vocab_rows / max_new_tokens)`` sequences of the step only (-1: all),
        so only those leave the device.
        """
        o = self.opts
        total = len(seq_prompts) if total is None else total
        if o.full_vocab_rows < 0:
            keep = -1
        else:
            keep = max(0, min(total, math.ceil(o.full_vocab_rows / o.max_new_tokens)) - first)
            keep = min(keep, len(seq_prompts))
        ro = self.engine.generate(seq_prompts, max_new_tokens=o.max_new_tokens,
                                  seeds=[request_seed(o.seed, step, first + s) for s in range(len(seq_prompts))],
                                  temperature=o.temperature, stop_at_eos=o.stop_at_eos, full_row_requests=keep)
        logprobs = [torch.tensor(lps, dtype=torch.float32) for lps in ro.logprobs]
        full_rows = {(s, pos - len(seq_prompts[s]) + 1): ro.full_rows[(s, pos)] for s, pos in ro.full_row_keys}
        return ro.completions, logprobs, full_rows

    # ------------------------------------------------------------------ diff

    def _where(self, step: int, s: int, j: int, prompt_rows: list[int], seq_prompts, first: int = 0) -> str:
        """Names sequence ``s`` of ``seq_prompts`` (global index ``first + s``), and its rank when distributed."""
        g, gs = self.opts.group_size, first + s
        rank = f" on rank {self.layout.rank}" if self.layout.distributed else ""
        return (f"step {step}, sequence {gs}{rank} (prompt row {self.rows[prompt_rows[gs // g]].line} of the prompt "
                f"file, sample {gs % g} of {g}), position {len(seq_prompts[s]) + j} (completion token {j})")

    def check(self, step: int, phase: str, rollout_N: torch.Tensor, trainer_N: torch.Tensor, owners, prompt_rows,
              seq_prompts, full_pairs: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]], first: int = 0):
        """Raise :class:`DiffNotZeroError` at the first differing token (or row) of ``seq_prompts``
        (sequences ``first, first + 1, ...`` of the step; ``owners`` and pair keys are local ``(s, j)``)."""
        k = first_mismatch(rollout_N, trainer_N)
        if k is not None:
            s, j = owners[k]
            diff = compare_logprobs(rollout_N, trainer_N)
            raise DiffNotZeroError(
                f"diff != 0 at {self._where(step, s, j, prompt_rows, seq_prompts, first)}: rollout logprob "
                f"{float(rollout_N[k])!r} vs trainer ({phase}) {float(trainer_N[k])!r}; "
                f"{diff.num_mismatched} of {diff.tokens_compared} tokens differ (max |diff| {diff.max_abs_diff:.3g})",
                diff=diff)
        for a, b, (s, j) in full_pairs:
            if not torch.equal(a, b):
                fv = full_vocab_max_abs_diff(a[None], b[None])
                raise DiffNotZeroError(
                    f"diff != 0 at {self._where(step, s, j, prompt_rows, seq_prompts, first)}: the sampled token's "
                    f"logprob agrees but the whole row ({phase}) differs, max |diff| {fv:.3g}",
                    diff=compare_logprobs(rollout_N, trainer_N), full_vocab=fv)

    @staticmethod
    def _error_info(error: DiffNotZeroError | None):
        """What an all-gather carries of a rank's mismatch: ``(message, full_vocab)`` or None."""
        return None if error is None else (str(error), error.full_vocab)

    def _first_error(self, error: DiffNotZeroError | None, infos: list, rollout_N: torch.Tensor,
                     trainer_N: torch.Tensor) -> DiffNotZeroError | None:
        """The step's mismatch, the same on every rank: the lowest rank's (``infos``: every rank's
        :meth:`_error_info`, all-gathered), with the diff over all ranks' tokens (``rollout_N`` /
        ``trainer_N`` global). One process: ``error`` itself."""
        if not self.layout.distributed:
            return error
        first = next((e for e in infos if e is not None), None)
        if first is None:
            return None
        diff = compare_logprobs(rollout_N, trainer_N) if trainer_N.numel() == rollout_N.numel() else None
        return DiffNotZeroError(first[0], diff=diff, full_vocab=first[1])

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
               adv_N: torch.Tensor, w_N: torch.Tensor, full_rows: dict, compare: bool, prompt_rows,
               first: int = 0) -> dict:
        """One :meth:`Trainer.step`: per micro-batch the forward with a graph is compared bitwise
        with the rollout, then the GRPO loss; one optimizer update.

        Under ``torchrun`` a mismatch does not raise inside the step (the other ranks would wait in the
        backward's collectives): the micro-batch's loss becomes 0, the mismatch is returned as
        ``error`` and the run stops after the step, before the sync."""
        o = self.opts
        acc = {"loss": 0.0, "entropy_sum": 0.0, "importance_ratio_max": -math.inf,
               "importance_ratio_min": math.inf, "ref_kl_sum": 0.0, "clipped_tokens": 0}
        trainer_parts, fv_pairs, errors = [], [], []

        def loss_fn(tb):
            mb = tb.batch
            new_R = tb.logprobs.detach().float().cpu()
            trainer_parts.append(new_R)
            with torch.no_grad():  # metrics: the rows formed without a graph and dropped before the backward
                rows = tb.rows
                acc["entropy_sum"] += entropy_sum(rows)
                pairs = [(full_rows[key], rows[r].float().cpu(), key)
                         for r, key in enumerate(mb.owners) if key in full_rows] if compare else []
                del rows
            fv_pairs.extend(pairs)
            # every token (and recorded row) is compared before this micro-batch's backward
            try:
                self.check(step, "update forward", rollout_N[mb.flat], new_R, mb.owners, prompt_rows, seq_prompts,
                           pairs, first)
            except DiffNotZeroError as e:
                if not self.layout.distributed:
                    raise
                errors.append(e)
                return tb.logprobs.sum() * 0.0  # the backward's collectives still run on every rank
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
                "trainer_N": trainer_N, "fv_pairs": fv_pairs, "error": errors[0] if errors else None}

    def sync(self):
        """Copy every changed parameter into vLLM's buffers in place (bf16 bits unchanged); reset the prefix cache;
        compare both sides' weight fingerprints (:meth:`verify_sync`; raises :class:`WeightSyncMismatch`).
        Under ``torchrun`` the experts the trainer holds on other ranks are gathered first where the rollout's
        expert layout needs them (:func:`.distributed.rollout_weights`); a mismatch on any rank raises on every
        rank, naming it."""
        rep = self.engine.sync_weights(rollout_weights(self.trainer, self.layout))
        error = None
        try:
            self._sync_fields = self.verify_sync(rep, self._sync_step)
        except WeightSyncMismatch as e:
            if not self.layout.distributed:
                raise
            error = e
        if self.layout.distributed:
            errors = all_gather(None if error is None else str(error), self.layout)
            bad = [(r, m) for r, m in enumerate(errors) if m is not None]
            if bad:
                raise WeightSyncMismatch(f"rank {bad[0][0]}: {bad[0][1]}") from (error.__cause__ if error else None)
        return rep

    # ------------------------------------------------------------------ one step

    def step(self, step: int, timer: dict) -> StepResult:
        """Run GRPO step ``step`` (1-based); fill ``timer`` (seconds per phase).

        A diff != 0 does not raise: it comes back in :attr:`StepResult.error`, with the
        diff fields of the step's row filled, so the caller writes that row first. Under
        ``torchrun`` (:mod:`.distributed`) this rank samples, recomputes and trains on its block of
        GRPO groups; the row (merged over every rank) and the error are the same on every rank.
        """
        o, lay, g = self.opts, self.layout, self.opts.group_size
        if self.contract is None:
            self.verify_contract()
        t0 = time.perf_counter()
        prompt_rows = prompts_for_step(len(self.prompt_ids), o.num_prompts_per_step, o.seed, step)
        all_prompts = [self.prompt_ids[i] for i in prompt_rows for _ in range(g)]
        groups = lay.groups(len(prompt_rows))
        first, stop = groups.start * g, groups.stop * g
        seq_prompts = all_prompts[first:stop]
        local_completions, local_lps, full_rows = self.rollout(step, seq_prompts, first, len(all_prompts))
        parts = all_gather((local_completions, local_lps), lay)
        completions = [c for cs, _ in parts for c in cs]
        rollout_lps = [lp for _, lps in parts for lp in lps]
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
            ref = self.rows[prompt_rows[s // g]].answer
            rewards.append(float(self.reward(Completion(token_ids=toks, text=text, reference=ref))))
        rewards_S = torch.tensor(rewards, dtype=torch.float64)
        adv_S = group_advantages(rewards_S, g)
        lengths = [len(c) for c in completions]
        # this rank's tokens: a contiguous block of the step's flat token order
        lo = sum(lengths[:first])
        mine = slice(lo, lo + sum(lengths[first:stop]))
        adv_N = torch.repeat_interleave(adv_S, torch.tensor(lengths, dtype=torch.long))[mine]
        # the step's global weights; x DP because the optimizer averages the ranks' gradients
        w_N = token_weights(lengths)[mine] * lay.trainer_dp
        rollout_all_N = torch.cat(rollout_lps) if rollout_lps else torch.zeros(0)
        rollout_N = rollout_all_N[mine]
        completions_mine = completions[first:stop]
        timer["rollout"] = self._elapsed(t0)

        row: dict[str, Any] = {
            "step": step, "reward_mean": float(rewards_S.mean()), "reward_std": float(rewards_S.std(unbiased=False)),
            "reward_max": float(rewards_S.max()), "tokens": int(rollout_all_N.numel()),
            "sequences": len(completions), "prompt_rows": [self.rows[i].line for i in prompt_rows],
            "rollout_sha256": rollout_digest(completions, rollout_all_N),
            "contract_fingerprint": self.contract.digest,
        }
        if lay.distributed:
            row["layout"] = lay.as_dict()
        if step == self.first_step_of_process:  # the components once per process (the report names them)
            row["contract_fingerprint_components"] = self.contract.as_dict()["components"]
        if self.target_token_id is not None:
            row["target_token_id"] = self.target_token_id
        owners = [(s, j) for s, c in enumerate(completions_mine) for j in range(len(c))]  # flat token order, local
        use_rollout = o.use_rollout_logprobs and step > self.first_step_of_process
        row["old_logprobs"] = "rollout" if use_rollout else "recompute"
        try:
            t0 = time.perf_counter()
            if use_rollout:
                old_N, timer["recompute"] = rollout_N, 0.0
            else:
                trainer_N, trainer_rows = self.recompute(seq_prompts, completions_mine, set(full_rows))
                timer["recompute"] = self._elapsed(t0)
                pairs = [(full_rows[k], trainer_rows[k], k) for k in full_rows]
                error = None
                try:
                    self.check(step, "recompute", rollout_N, trainer_N, owners, prompt_rows, seq_prompts, pairs,
                               first)
                except DiffNotZeroError as e:
                    error = e
                merged = all_gather((trainer_N, full_vocab_of_pairs(pairs), len(pairs), self._error_info(error)),
                                    lay)
                trainer_all_N = torch.cat([m[0] for m in merged])
                row.update(compare_logprobs(rollout_all_N, trainer_all_N).as_dict())
                rows_compared = sum(m[2] for m in merged)
                # None, not 0.0, when no whole row was compared (--full-vocab-rows 0)
                row.update(full_vocab_max_abs_diff=max(m[1] for m in merged) if rows_compared else None,
                           full_vocab_rows=rows_compared)
                error = self._first_error(error, [m[3] for m in merged], rollout_all_N, trainer_all_N)
                if error is not None:
                    raise error
                old_N = trainer_N
            t0 = time.perf_counter()
            up = self.update(step, seq_prompts, completions_mine, rollout_N, old_N, adv_N, w_N, full_rows,
                             use_rollout, prompt_rows, first)
            timer["update"] = self._elapsed(t0)
            up_parts = all_gather({k: v for k, v in up.items() if k not in ("fv_pairs", "error")}
                                  | {"error": self._error_info(up["error"]), "fv": full_vocab_of_pairs(up["fv_pairs"]),
                                     "fv_rows": len(up["fv_pairs"])}, lay)
            error = self._first_error(up["error"], [p["error"] for p in up_parts], rollout_all_N,
                                      torch.cat([p["trainer_N"] for p in up_parts]))
            if error is not None:
                raise error
        except DiffNotZeroError as e:
            if e.diff is not None:
                row.update(e.diff.as_dict())
            if e.full_vocab is not None:
                row["full_vocab_max_abs_diff"] = e.full_vocab
            row.setdefault("full_vocab_max_abs_diff", None)
            return StepResult(row=row, error=e)
        if use_rollout:
            diff = compare_logprobs(rollout_all_N, torch.cat([p["trainer_N"] for p in up_parts]))
            row.update(diff.as_dict())
            rows_compared = sum(p["fv_rows"] for p in up_parts)
            row.update(full_vocab_max_abs_diff=max(p["fv"] for p in up_parts) if rows_compared else None,
                       full_vocab_rows=rows_compared)
        n = max(int(rollout_all_N.numel()), 1)
        row.update(importance_ratio_max=max(p["importance_ratio_max"] for p in up_parts),
                   importance_ratio_min=min(p["importance_ratio_min"] for p in up_parts),
                   entropy=sum(p["entropy_sum"] for p in up_parts) / n,
                   ref_kl=sum(p["ref_kl_sum"] for p in up_parts) / n,
                   loss=sum(p["loss"] for p in up_parts) / lay.trainer_dp,
                   grad_norm=up["grad_norm"], clipped_tokens=sum(p["clipped_tokens"] for p in up_parts),
                   advantage_abs_mean=float(adv_S.abs().mean()))
        t0 = time.perf_counter()
        self._sync_step, self._sync_fields = step, None
        try:
            rep = self.sync()
        except WeightSyncMismatch as e:
            timer["sync"] = self._elapsed(t0)
            row.update(weight_fingerprint=None, weight_fingerprint_mismatch=e.__cause__.tensors
                       if e.__cause__ is not None else None)
            return StepResult(row=row, error=e)
        finally:
            self._sync_step = None
        timer["sync"] = self._elapsed(t0)
        fields = self._sync_fields or self.verify_sync(rep, step)  # a sync() that did not verify (tests)
        if lay.distributed:  # copies and tensors checked over every rank (each engine holds its own copy)
            synced = all_gather((len(rep.copied), rep.bytes_copied, fields["weight_fingerprint_tensors"],
                                 fields["weight_fingerprint"]), lay)
            row.update(sync_tensors_copied=sum(s[0] for s in synced), sync_bytes=sum(s[1] for s in synced))
            digests = [s[3] for s in synced]
            # one digest over the engines' (rank order); each rank's own is kept beside it
            merged_digest = (hashlib.sha256("|".join(digests).encode()).hexdigest()
                             if all(d is not None for d in digests) else None)
            fields = {**fields, "weight_fingerprint": merged_digest, "weight_fingerprint_ranks": digests,
                      "weight_fingerprint_tensors": sum(s[2] for s in synced)}
        else:
            row.update(sync_tensors_copied=len(rep.copied), sync_bytes=rep.bytes_copied)
        row.update(fields)
        return StepResult(row=row)
