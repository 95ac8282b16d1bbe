"""Per-step metrics of ``unified-models rl``: one JSON object per line (JSONL).

Every line has at least (all floats in nats unless named otherwise):

==========================  ==================================================
``step``                    1-based update index (the line of step k is
                            written after update k and its weight sync)
``reward_mean``             mean reward over the step's S = P·G completions
``reward_std``              its population std
``max_abs_diff``            max |rollout logprob - trainer logprob| over the
                            step's sampled tokens (fp64); 0 = bitwise equal
``mean_abs_diff``,          mean / std of the same, and the rollout-vs-trainer
``std_abs_diff``, ``k3_kl`` k3 KL estimator (:mod:`..consistency.metrics`)
``num_mismatched``          sampled tokens whose fp32 bits differ
``full_vocab_max_abs_diff`` max |Δ| over whole logprob rows
                            (``full_vocab_rows`` of them; None when none was
                            compared)
``importance_ratio_max``    max and min of ρ = exp(trainer - old logprob) at
``importance_ratio_min``    the update (exactly 1 while diff = 0)
``entropy``                 mean policy entropy -Σ_v p log p over the sampled
                            positions (exact, from the trainer's full rows)
``ref_kl``                  mean k3 KL to the frozen reference (0 if β = 0)
``tokens``                  completion tokens compared / trained on
``loss``, ``grad_norm``     GRPO loss, global grad norm before clipping
``old_logprobs``            ``"recompute"`` or ``"rollout"`` (see ``--use-rollout-logprobs``)
``rollout_sha256``          SHA-256 of the sampled token ids and the bits of
                            their logprobs (equal digests = identical rollouts)
``prompt_rows``             1-based lines of the step's prompts in the file
``target_token_id``         the rewarded token (``target-token`` only)
``sync_tensors_copied``,    parameters (bytes) copied into vLLM after the
``sync_bytes``              update
``seconds``                 ``{"rollout", "recompute", "update", "sync", "save", "step"}``
                            (rank 0's, under ``torchrun``)
``layout``                  under ``torchrun`` only: ``world``, ``trainer_ep``,
                            ``trainer_dp``, ``rollout_dp``, ``rollout_ep``
                            (:mod:`.distributed`); every other field is merged
                            over all ranks (sync counts and fingerprinted
                            tensors summed over the engines; ``weight_fingerprint``
                            is the SHA-256 of the engines' digests in rank order,
                            which ``weight_fingerprint_ranks`` lists)
==========================  ==================================================
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

__all__ = ["REQUIRED_FIELDS", "PHASES", "MetricsWriter", "read_metrics", "json_safe", "summarize"]

REQUIRED_FIELDS = ("step", "reward_mean", "max_abs_diff", "mean_abs_diff", "k3_kl", "full_vocab_max_abs_diff",
                   "importance_ratio_max", "entropy", "tokens", "seconds")
PHASES = ("rollout", "recompute", "update", "sync")


def json_safe(x: Any) -> Any:
    """Floats that JSON can hold (NaN/Inf -> None); recurses into dicts and lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def read_metrics(path: str | os.PathLike, *, require_step: bool = False) -> list[dict]:
    """All lines of a metrics JSONL (blank lines skipped).

    Args:
        require_step: every line must hold an integer ``step`` (as every line ``rl`` writes does;
            what a resumed run keeps or drops the file's lines by).

    Raises:
        ValueError: a line is not a JSON object, or (``require_step``) has no integer ``step``; the
            message names the line.
    """
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: not a JSON object")
            step = row.get("step")
            if require_step and (isinstance(step, bool) or not isinstance(step, int)):
                raise ValueError(f"{path}:{lineno}: step {step!r} is not an integer (every line `rl` writes has one)")
            rows.append(row)
    return rows


def _leads_up_to(steps: list[int], k: int) -> bool:
    """True when ``steps`` are m..k-1 in order with m >= 1, or none at k = 1 (a run killed between its
    first checkpoint and that step's line)."""
    return steps == list(range(k - len(steps), k)) and (steps[0] >= 1 if steps else k == 1)


_RUN_SPECIFIC = ("seconds", "restored_from_checkpoint")
"""Fields of a metrics line that differ between the file and the checkpoint's copy of it (the file's
``seconds`` include the save; a restored line is marked)."""


def check_same_run(path: Path, rows: list[dict], saved_row: dict | None, k: int) -> None:
    """Refuse appending a resumed run to a file whose line of step ``k`` is not the one the checkpoint of
    step ``k`` recorded (another run's metrics: another seed, model or prompts), comparing the fields both
    hold except :data:`_RUN_SPECIFIC`. Checkpoints that record no line are not compared.

    Raises:
        ValueError: naming the file, the step and the first differing fields.
    """
    if not isinstance(saved_row, dict) or saved_row.get("step") != k:
        return
    line = next((r for r in rows if r["step"] == k), None)
    if line is None:
        return
    saved = json_safe(saved_row)
    differ = sorted(f for f in set(line) & set(saved) - set(_RUN_SPECIFIC) if line[f] != saved[f])
    if differ:
        raise ValueError(f"{path}: its line of step {k} is not the one the resumed checkpoint recorded (differing: "
                         f"{', '.join(differ[:5])}): the file holds another run's metrics; pass another --metrics "
                         "file (or the saved run's own)")


class MetricsWriter:
    """Append one JSON line per step, flushed and fsynced (a killed run keeps every finished step).

    Args:
        path: the JSONL file; its directory is created.
        resume_step: None for a fresh run (the file is truncated); k for a run
            resumed after step k (lines with ``step <= k`` are kept, later ones
            dropped, so the file reads like one uninterrupted run).
        saved_row: on resume, the line the checkpoint of step k recorded
            (:func:`.startup.save_checkpoint`): appended, marked ``"restored_from_checkpoint": true``
            (its ``seconds`` without the save), when the file holds the lines of steps m..k-1 in order
            (m >= 1: from 1, or from where an earlier resume into a new file began; none at k = 1) and
            not k (the run stopped between its checkpoint and the line); :attr:`restored_step` is then
            k. Otherwise (a gap, an empty file at k > 1) nothing is restored.

    Raises:
        ValueError: on resume, a line of the existing file is not a JSON object or has no integer
            ``step``, or the file's line of step k is not the one the checkpoint recorded (another
            run's file: :func:`check_same_run`); the file is left as it was.
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None, saved_row: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.restored_step: int | None = None
        keep: list[dict] = []
        if resume_step is not None and self.path.is_file():
            keep = [r for r in read_metrics(self.path, require_step=True) if r["step"] <= resume_step]
            check_same_run(self.path, keep, saved_row, resume_step)
        if (resume_step is not None and self.path.is_file() and isinstance(saved_row, dict)
                and type(saved_row.get("step")) is int and saved_row["step"] == resume_step
                and _leads_up_to([r["step"] for r in keep], resume_step)):
            keep.append(json_safe(dict(saved_row, restored_from_checkpoint=True)))
            self.restored_step = resume_step
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        """Append ``row`` (must hold :data:`REQUIRED_FIELDS`).

        Raises:
            ValueError: a required field is missing.
        """
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if missing:
            raise ValueError(f"metrics row lacks {missing}")
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(json_safe(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rows(self) -> list[dict]:
        return read_metrics(self.path)


def summarize(rows: Iterable[dict], window: int = 5) -> dict:
    """First/last-``window`` mean reward, worst diff over all steps and time per phase (for the end table)."""
    rows = list(rows)
    if not rows:
        return {}
    rewards = [r["reward_mean"] for r in rows]
    w = min(window, len(rows))

    def worst(key):
        vals = [r.get(key) for r in rows if r.get(key) is not None]
        return max(vals) if vals else None

    secs = {p: sum((r.get("seconds") or {}).get(p, 0.0) or 0.0 for r in rows) for p in (*PHASES, "save", "step")}
    return {
        "steps": len(rows), "first_step": rows[0]["step"], "last_step": rows[-1]["step"],
        f"reward_mean_first_{w}": sum(rewards[:w]) / w, f"reward_mean_last_{w}": sum(rewards[-w:]) / w,
        "max_abs_diff": worst("max_abs_diff"), "full_vocab_max_abs_diff": worst("full_vocab_max_abs_diff"),
        "k3_kl": worst("k3_kl"), "importance_ratio_max": worst("importance_ratio_max"),
        "tokens": sum(r.get("tokens", 0) for r in rows), "seconds": secs,
    }
