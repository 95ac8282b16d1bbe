"""``unified-models report RUN_DIR [--out FILE.html]``: one self-contained HTML page of a run.

:func:`add_parser` registers the subcommand; :func:`run` executes it (exit 0 written,
2 refused input: the CLI prints the :class:`~.load.ReportInputError`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..dsl import UnifiedModelsError

__all__ = ["DEFAULT_OUT", "add_parser", "run", "default_out", "write_report"]

DEFAULT_OUT = "report.html"
"""The page's name in RUN_DIR when ``--out`` is not given."""

_DESCRIPTION = """\
Write one self-contained HTML page (plots embedded as PNG, no script, nothing fetched: it
opens from disk without a network) of an `rl` or `check` run: the diff fields (max/mean
|Δ logprob|, k3 KL, full-vocabulary diff) per step with their exact values, reward,
entropy, response length, throughput and seconds per phase per step (stacked), every
fingerprint field recorded, and the settings (the checkpoint's rl options and model
config; a check's options, engine settings and peer check).

RUN_DIR convention:
  RUN_DIR/rl_metrics.jsonl   rl --metrics RUN_DIR/rl_metrics.jsonl  (else the one *.jsonl there)
  RUN_DIR/check.json         check --json RUN_DIR/check.json         (else any *.json check report)
  RUN_DIR/ckpt/              rl --save RUN_DIR/ckpt  (optional: the run's options, model config;
                             any direct subdirectory holding latest_checkpointed_iteration.txt)
RUN_DIR may also be one metrics .jsonl or check .json file. Bad input (no such directory,
nothing to report, a malformed JSONL line) exits 2 naming the file and line."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``report`` to the ``unified-models`` subparsers; returns its parser."""
    p = subparsers.add_parser("report", help="one self-contained HTML page (plots embedded) of an rl or check run",
                              description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="directory holding rl_metrics.jsonl and/or check.json (or one such file)")
    p.add_argument("--out", metavar="FILE.html",
                   help=f"where to write the page (default: RUN_DIR/{DEFAULT_OUT}; for a file argument, "
                        "the file with suffix .html)")
    return p


def default_out(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/report.html``; for a file ``x.jsonl`` / ``x.json``: ``x.html`` next to it."""
    p = Path(run_dir)
    return p.with_suffix(".html") if p.is_file() else p / DEFAULT_OUT


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Read ``run_dir`` (:func:`.load.load_run_dir`), render the page, write it atomically.

    Returns:
        the HTML path written.

    Raises:
        ReportInputError: see :func:`.load.load_run_dir`.
        UnifiedModelsError: ``out`` cannot be written (a directory, a parent that is a file
            or not writable), or ``out`` is one of the run's input files.
    """
    from ..run_options import check_output_path
    from .load import load_run_dir
    from .page import render_page

    out_path = Path(out) if out is not None else None
    if out_path is not None:
        check_output_path("--out", out_path)
    run = load_run_dir(run_dir)
    out_path = out_path or default_out(run_dir)
    check_output_path("--out", out_path)
    inputs = ([run.metrics_path] if run.metrics_path else []) + [p for p, _ in run.checks]
    if any(out_path.resolve() == p.resolve() for p in inputs):
        raise UnifiedModelsError(f"--out {out_path} is an input of the report; choose another file")
    text, _ = render_page(run)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_path)
    return out_path


def run(args: argparse.Namespace) -> int:
    """Run ``report`` for parsed ``args`` (``run_dir``, ``out``); prints the page's path; returns 0.

    Raises:
        UnifiedModelsError: see :func:`write_report` (the CLI turns it into exit 2).
    """
    path = write_report(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0
