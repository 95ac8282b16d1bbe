"""Read what a run left in its directory: ``rl`` metrics, ``check`` reports, the training checkpoint.

RUN_DIR convention (``unified-models report RUN_DIR``)::

    RUN_DIR/
      rl_metrics.jsonl   rl --metrics RUN_DIR/rl_metrics.jsonl   (else: the one *.jsonl there)
      check.json         check --json RUN_DIR/check.json          (else: every *.json holding a check report)
      ckpt/              rl --save RUN_DIR/ckpt                   (optional: the run's settings, the model config)

RUN_DIR may also be one metrics ``.jsonl`` or one check ``.json`` file. A training
checkpoint is looked for in RUN_DIR and its direct subdirectories (the directory that
holds ``latest_checkpointed_iteration.txt``); its latest ``iter_*/common.pt`` records the
``rl`` options that fix the trajectory (:func:`unified_models.rl.options.run_identity`)
and the model's ``config.json``.

Every refusal is a :class:`ReportInputError` naming the file (and the line of a JSONL).
Nothing here imports an engine; torch is imported only to read a checkpoint's ``common.pt``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dsl import UnifiedModelsError

__all__ = ["METRICS_NAME", "CHECK_NAME", "NUMERIC_FIELDS", "ReportInputError", "CheckpointInfo", "RunData",
           "load_run_dir", "read_metrics_file", "read_check_file", "read_checkpoint_info"]

METRICS_NAME = "rl_metrics.jsonl"
"""The metrics file ``report`` looks for first in RUN_DIR (``rl``'s default ``--metrics`` name)."""
CHECK_NAME = "check.json"
"""The check report ``report`` looks for first in RUN_DIR."""
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron's tracker file naming a training checkpoint's latest iteration."""

NUMERIC_FIELDS = ("reward_mean", "reward_std", "reward_max", "max_abs_diff", "mean_abs_diff", "std_abs_diff",
                  "k3_kl", "num_mismatched", "full_vocab_max_abs_diff", "full_vocab_rows", "importance_ratio_max",
                  "importance_ratio_min", "entropy", "ref_kl", "tokens", "tokens_compared", "sequences", "loss",
                  "grad_norm", "clipped_tokens", "advantage_abs_mean", "sync_tensors_copied", "sync_bytes")
"""Metrics fields that must be a number or null where present (JSON ``null`` = NaN/Inf or not measured)."""

CHECK_FIELDS = ("tokens_compared", "max_abs_diff", "mean_abs_diff", "k3_kl", "full_vocab_max_abs_diff")
"""Fields a ``check --json`` report always has (what makes a ``.json`` file a check report)."""

_MAX_JSON_BYTES = 64 << 20


class ReportInputError(UnifiedModelsError, ValueError):
    """RUN_DIR or one of its files cannot be reported on; the message names the file (and line)."""


@dataclass
class CheckpointInfo:
    """What a training checkpoint under RUN_DIR records about its run.

    Attributes:
        path: the ``iter_*`` directory read.
        iteration: its step.
        rl: ``extra["rl"]``: the options that fix the trajectory and ``target_token_id``.
        family, architecture: of the model trained.
        hf_config: the model's ``config.json`` as a dict (None if not stored).
        note: why something could not be read (the page shows it), else None.
    """

    path: Path
    iteration: int | None = None
    rl: dict = field(default_factory=dict)
    family: str | None = None
    architecture: str | None = None
    hf_config: dict | None = None
    note: str | None = None


@dataclass
class RunData:
    """Everything ``report`` shows about one run directory.

    Attributes:
        source: RUN_DIR as given (a directory or one file).
        metrics_path: the ``rl`` metrics JSONL read, or None.
        rows: its lines, one dict per step, steps strictly increasing.
        checks: ``[(path, report dict)]`` of the ``check --json`` reports read.
        checkpoint: the training checkpoint found, or None.
    """

    source: Path
    metrics_path: Path | None = None
    rows: list[dict] = field(default_factory=list)
    checks: list[tuple[Path, dict]] = field(default_factory=list)
    checkpoint: CheckpointInfo | None = None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_row(path: Path, lineno: int, row: Any, prev_step: int | None) -> None:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise ReportInputError(f"{where}: expected a JSON object (one rl metrics step), got {type(row).__name__}")
    step = row.get("step")
    if "step" not in row:
        raise ReportInputError(f"{where}: no 'step' field (is this an rl --metrics file?)")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ReportInputError(f"{where}: field 'step' is {step!r}, expected an integer >= 1")
    if prev_step is not None and step <= prev_step:
        raise ReportInputError(f"{where}: step {step} follows step {prev_step}; steps must increase line by line")
    if "reward_mean" not in row:
        raise ReportInputError(f"{where}: no 'reward_mean' field (is this an rl --metrics file?)")
    for k in NUMERIC_FIELDS:
        v = row.get(k)
        if v is not None and not _is_number(v):
            raise ReportInputError(f"{where}: field {k!r} is {v!r}, expected a number or null")
    secs = row.get("seconds")
    if secs is not None:
        if not isinstance(secs, dict):
            raise ReportInputError(f"{where}: field 'seconds' is {secs!r}, expected an object of phase -> seconds")
        for k, v in secs.items():
            if v is not None and (not _is_number(v) or v < 0):
                raise ReportInputError(f"{where}: field 'seconds.{k}' is {v!r}, expected a number >= 0")


def read_metrics_file(path: str | os.PathLike) -> list[dict]:
    """The lines of an ``rl --metrics`` JSONL (blank lines skipped), validated.

    Returns:
        one dict per step; ``step`` strictly increasing; every field of
        :data:`NUMERIC_FIELDS` present is a number or None; ``seconds`` (if present)
        maps phase names to seconds >= 0.

    Raises:
        ReportInputError: unreadable file, no lines, or a line that is not JSON, not an
            object, or breaks the rules above (``FILE:LINE: ...``).
    """
    path = Path(path)
    rows: list[dict] = []
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read the metrics file ({e.strerror or e})") from None
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ReportInputError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from None
                _check_row(path, lineno, row, rows[-1]["step"] if rows else None)
                rows.append(row)
        except UnicodeDecodeError as e:
            raise ReportInputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise ReportInputError(f"{path}: holds no metrics lines (an rl run writes one per finished step)")
    return rows


def _load_json(path: Path) -> Any:
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise ReportInputError(f"{path}: {path.stat().st_size} bytes, too large for a check report")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path}:{e.lineno}: not JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ReportInputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read ({e.strerror or e})") from None


def read_check_file(path: str | os.PathLike) -> dict:
    """A ``check --json`` report, validated.

    Returns:
        the report dict: :data:`CHECK_FIELDS` are numbers (or null), ``peer``,
        ``options``, ``timings_s`` and ``engine`` are objects where present.

    Raises:
        ReportInputError: unreadable, not JSON (file and line named), not an object, or a
            field missing or of the wrong type (named).
    """
    path = Path(path)
    d = _load_json(path)
    if not isinstance(d, dict):
        raise ReportInputError(f"{path}: expected a JSON object (a check --json report), got {type(d).__name__}")
    missing = [k for k in CHECK_FIELDS if k not in d]
    if missing:
        raise ReportInputError(f"{path}: not a check --json report: no field {', '.join(map(repr, missing))}")
    for k in (*CHECK_FIELDS, "num_mismatched", "std_abs_diff", "full_vocab_rows"):
        v = d.get(k)
        if v is not None and not _is_number(v):
            raise ReportInputError(f"{path}: field {k!r} is {v!r}, expected a number or null")
    for k in ("peer", "options", "timings_s", "engine"):
        if d.get(k) is not None and not isinstance(d[k], dict):
            raise ReportInputError(f"{path}: field {k!r} is {d[k]!r}, expected an object")
    for k, v in (d.get("timings_s") or {}).items():
        if v is not None and (not _is_number(v) or v < 0):
            raise ReportInputError(f"{path}: field 'timings_s.{k}' is {v!r}, expected a number >= 0")
    return d


def _looks_like_check(path: Path) -> bool:
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            return False
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and all(k in d for k in CHECK_FIELDS)


def _find_tracker_root(run_dir: Path) -> Path | None:
    """RUN_DIR or its first subdirectory (sorted) holding the Megatron tracker file."""
    if (run_dir / TRACKER_FILE).is_file():
        return run_dir
    for sub in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        if (sub / TRACKER_FILE).is_file():
            return sub
    return None


def read_checkpoint_info(root: str | os.PathLike) -> CheckpointInfo:
    """What the latest training checkpoint under ``root`` (the tracker's directory) records.

    Never raises for a bad checkpoint: the report is about the run, not the checkpoint, so
    a tracker naming a missing iteration or an unreadable ``common.pt`` comes back as
    :attr:`CheckpointInfo.note`.
    """
    root = Path(root)
    info = CheckpointInfo(path=root)
    try:
        it = int((root / TRACKER_FILE).read_text().strip())
    except (OSError, ValueError) as e:
        info.note = f"{root / TRACKER_FILE}: unreadable ({e})"
        return info
    d = root / f"iter_{it:07d}"
    info.path, info.iteration = d, it
    common = d / "common.pt"
    if not common.is_file():
        info.note = f"{common}: missing (the tracker names step {it})"
        return info
    try:
        import torch

        state = torch.load(common, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure: the page says so
        info.note = f"{common}: unreadable ({type(e).__name__}: {e})"
        return info
    entry = state.get("unified_models") if isinstance(state, dict) else None
    if not isinstance(entry, dict):
        info.note = f"{common}: no unified_models entry (not written by unified_models?)"
        return info
    info.family, info.architecture = entry.get("family"), entry.get("architecture")
    extra = entry.get("extra") if isinstance(entry.get("extra"), dict) else {}
    info.rl = dict(extra.get("rl") or {})
    text = entry.get("hf_config_json")
    if isinstance(text, str):
        try:
            info.hf_config = json.loads(text)
        except ValueError:
            info.note = f"{common}: the stored config.json is not JSON"
    return info


def load_run_dir(path: str | os.PathLike) -> RunData:
    """Find and read everything ``report`` shows for ``path`` (RUN_DIR or one file; see the module doc).

    Raises:
        ReportInputError: ``path`` does not exist; RUN_DIR holds neither metrics nor a
            check report (what was looked for is named); several ``*.jsonl`` and none named
            ``rl_metrics.jsonl``; any file read is malformed (file and line named).
    """
    src = Path(path)
    run = RunData(source=src)
    if not src.exists():
        raise ReportInputError(f"{src}: no such directory or file")
    if src.is_file():
        if src.suffix == ".jsonl":
            run.metrics_path, run.rows = src, read_metrics_file(src)
        elif src.suffix == ".json":
            run.checks = [(src, read_check_file(src))]
        else:
            raise ReportInputError(f"{src}: expected a run directory, an rl metrics .jsonl or a check .json")
        root = _find_tracker_root(src.parent)
        run.checkpoint = read_checkpoint_info(root) if root is not None and run.rows else None
        return run
    if (src / METRICS_NAME).is_file():
        run.metrics_path = src / METRICS_NAME
    else:
        jsonl = sorted(p for p in src.glob("*.jsonl") if p.is_file())
        if len(jsonl) > 1:
            raise ReportInputError(f"{src}: several metrics files ({', '.join(p.name for p in jsonl)}) and no "
                                   f"{METRICS_NAME}; pass the one to report on: unified-models report {jsonl[0]}")
        run.metrics_path = jsonl[0] if jsonl else None
    if run.metrics_path is not None:
        run.rows = read_metrics_file(run.metrics_path)
    if (src / CHECK_NAME).is_file():
        run.checks.append((src / CHECK_NAME, read_check_file(src / CHECK_NAME)))
    for p in sorted(src.glob("*.json")):
        if p.name != CHECK_NAME and p.is_file() and _looks_like_check(p):
            run.checks.append((p, read_check_file(p)))
    if not run.rows and not run.checks:
        raise ReportInputError(f"{src}: no run to report on: neither {METRICS_NAME} (rl --metrics) nor another "
                               f"*.jsonl, nor {CHECK_NAME} or another check --json report (*.json)")
    root = _find_tracker_root(src)
    if root is not None:
        run.checkpoint = read_checkpoint_info(root)
    return run


def finite(v: Any) -> float | None:
    """``v`` as a float when it is a finite number, else None (for plotting)."""
    return float(v) if _is_number(v) and math.isfinite(v) else None
