"""The report's plots: matplotlib figures rendered to PNG bytes (embedded base64 by :mod:`.page`).

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas directly (no
pyplot state, no display). One figure per quantity, all steps on the x axis:

* ``diff``: ``max_abs_diff``, ``mean_abs_diff``, ``k3_kl`` and ``full_vocab_max_abs_diff``
  (nats) on a symlog axis, linear below 1e-7, so the expected line at exactly 0 is visible
  and any non-zero diff stands out;
* ``reward``: ``reward_mean`` with its ± std band over the step's samples, ``reward_max``;
* ``entropy``: mean policy entropy over the sampled positions (nats);
* ``length``: completion length, tokens per sampled sequence (``tokens / sequences``);
* ``throughput``: sampled tokens per second of the rollout phase and of the whole step;
* ``phases``: seconds per phase per step, stacked (rollout, recompute, update, sync,
  save, and ``other`` = step minus their sum);
* ``training``: GRPO loss and the grad norm before clipping (when recorded).

A check report is one measurement, so its only plot is ``check_timings`` (seconds per phase).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from .load import finite

__all__ = ["Plot", "PHASES", "derived_series", "rl_plots", "check_plots"]

PHASES = ("rollout", "recompute", "update", "sync", "save")
"""The phases of an ``rl`` step (``seconds`` keys), bottom to top in the stacked plot."""

_PHASE_COLORS = {"rollout": "#4c72b0", "recompute": "#dd8452", "update": "#55a868", "sync": "#c44e52",
                 "save": "#8172b3", "other": "#b0b0b0"}


@dataclass(frozen=True)
class Plot:
    """One rendered figure.

    Attributes:
        key: stable id (also the HTML element id, ``plot-<key>``).
        title: heading shown above it.
        caption: one sentence saying what is drawn (units included).
        png: the PNG bytes.
    """

    key: str
    title: str
    caption: str
    png: bytes

    @property
    def data_uri(self) -> str:
        """``data:image/png;base64,...`` for an ``<img src>``."""
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


def _figure(width: float = 5.6, height: float = 2.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _nan(v):
    f = finite(v)
    return float("nan") if f is None else f


def derived_series(rows: list[dict]) -> dict[str, list[float | None]]:
    """Per-step quantities computed from the metrics lines (None where an input is missing or 0).

    Returns:
        ``{"length": tokens / sequences (tokens per completion), "rollout_tokens_per_s":
        tokens / seconds.rollout, "step_tokens_per_s": tokens / seconds.step}``, one entry per row.
    """
    def ratio(a, b):
        a, b = finite(a), finite(b)
        return a / b if a is not None and b else None

    out: dict[str, list[float | None]] = {"length": [], "rollout_tokens_per_s": [], "step_tokens_per_s": []}
    for r in rows:
        secs = r.get("seconds") or {}
        out["length"].append(ratio(r.get("tokens"), r.get("sequences")))
        out["rollout_tokens_per_s"].append(ratio(r.get("tokens"), secs.get("rollout")))
        out["step_tokens_per_s"].append(ratio(r.get("tokens"), secs.get("step")))
    return out


def _style(ax, ylabel: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _diff_plot(steps, rows) -> Plot:
    fig = _figure()
    ax = fig.add_subplot()
    nonzero, top = False, 0.0
    for key, style in (("max_abs_diff", "-"), ("mean_abs_diff", "--"), ("k3_kl", "-."),
                       ("full_vocab_max_abs_diff", ":")):
        vals = [r.get(key) for r in rows]
        if all(finite(v) is None for v in vals):
            continue
        nonzero |= any(finite(v) not in (None, 0.0) for v in vals)
        top = max([top] + [abs(finite(v)) for v in vals if finite(v) is not None])
        ax.plot(steps, [_nan(v) for v in vals], style, marker="o", ms=3, label=key)
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.set_ylim(bottom=0.0, top=max(1e-1, 2 * top))  # |Δ| >= 0: the line at exactly 0 sits on the axis
    _style(ax, "|Δ logprob| (nats)")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    verdict = "diff != 0 at some step" if nonzero else "diff = 0 at every step"
    ax.set_title(verdict, fontsize=9, color="#b00020" if nonzero else "#1b7f3b")
    return Plot("diff", "Rollout vs trainer diff", "max / mean |Δ logprob| over the sampled tokens, k3 KL "
                "estimator, and max |Δ| over whole logprob rows (full vocabulary), nats, symlog axis.", _png(fig))


def _reward_plot(steps, rows) -> Plot:
    fig = _figure()
    ax = fig.add_subplot()
    mean = [_nan(r.get("reward_mean")) for r in rows]
    std = [finite(r.get("reward_std")) or 0.0 for r in rows]
    ax.plot(steps, mean, marker="o", ms=3, color="#4c72b0", label="reward_mean")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color="#4c72b0", alpha=0.15, label="± std")
    if any(finite(r.get("reward_max")) is not None for r in rows):
        ax.plot(steps, [_nan(r.get("reward_max")) for r in rows], ":", color="#4c72b0", label="reward_max")
    _style(ax, "reward")
    ax.legend(loc="best", fontsize=7)
    return Plot("reward", "Reward", "Mean reward over the step's completions, ± its std, and the best one.",
                _png(fig))


def _line_plot(key, title, caption, steps, series: dict[str, list], ylabel) -> Plot:
    fig = _figure()
    ax = fig.add_subplot()
    for label, vals in series.items():
        ax.plot(steps, [_nan(v) for v in vals], marker="o", ms=3, label=label)
    if not any(finite(v) is not None for vals in series.values() for v in vals):
        ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="#888")
    _style(ax, ylabel)
    if len(series) > 1:
        ax.legend(loc="best", fontsize=7)
    ax.set_ylim(bottom=0)
    return Plot(key, title, caption, _png(fig))


def _phases_plot(steps, rows) -> Plot:
    fig = _figure()
    ax = fig.add_subplot()
    secs = [r.get("seconds") or {} for r in rows]
    bottom = [0.0] * len(rows)
    stacks: dict[str, list[float]] = {}
    for p in PHASES:
        stacks[p] = [finite(s.get(p)) or 0.0 for s in secs]
    stacks["other"] = [max(0.0, (finite(s.get("step")) or 0.0) - sum(stacks[p][i] for p in PHASES))
                       for i, s in enumerate(secs)]
    for name, vals in stacks.items():
        if not any(vals):
            continue
        ax.bar(steps, vals, bottom=bottom, color=_PHASE_COLORS[name], label=name, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    _style(ax, "seconds")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    ax.set_ylim(top=max(bottom + [1e-3]) * 1.35)
    return Plot("phases", "Seconds per phase", "Wall seconds of each phase per step, stacked; 'other' is the "
                "rest of the step (rewards, bookkeeping).", _png(fig))


def _training_plot(steps, rows) -> Plot | None:
    loss = [r.get("loss") for r in rows]
    gn = [r.get("grad_norm") for r in rows]
    if all(finite(v) is None for v in loss + gn):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(steps, [_nan(v) for v in loss], marker="o", ms=3, color="#55a868", label="loss")
    _style(ax, "GRPO loss")
    ax2 = ax.twinx()
    ax2.plot(steps, [_nan(v) for v in gn], "--", marker=".", color="#c44e52", label="grad_norm")
    ax2.set_ylabel("grad norm (before clipping)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=7)
    return Plot("training", "Loss and grad norm", "GRPO loss of the update and the global grad norm before "
                "clipping.", _png(fig))


def rl_plots(rows: list[dict]) -> list[Plot]:
    """The plots of an ``rl`` run from its metrics lines (:func:`.load.read_metrics_file`).

    Returns:
        ``diff``, ``reward``, ``entropy``, ``length``, ``throughput``, ``phases`` and, where
        loss or grad norm are recorded, ``training`` (a missing quantity is drawn as an
        empty axis saying "not recorded").
    """
    steps = [r["step"] for r in rows]
    d = derived_series(rows)
    plots = [
        _diff_plot(steps, rows),
        _reward_plot(steps, rows),
        _line_plot("entropy", "Entropy", "Mean policy entropy -Σ p log p over the sampled positions, nats "
                   "(from the trainer's whole rows).", steps, {"entropy": [r.get("entropy") for r in rows]},
                   "entropy (nats)"),
        _line_plot("length", "Response length", "Mean completion length, tokens per sampled sequence.", steps,
                   {"tokens / sequence": d["length"]}, "tokens"),
        _line_plot("throughput", "Throughput", "Sampled tokens per second: of the rollout phase (vLLM "
                   "generation and rewards) and of the whole step.", steps,
                   {"rollout": d["rollout_tokens_per_s"], "whole step": d["step_tokens_per_s"]}, "tokens / s"),
        _phases_plot(steps, rows),
    ]
    t = _training_plot(steps, rows)
    if t is not None:
        plots.append(t)
    return plots


def check_plots(report: dict, name: str) -> list[Plot]:
    """The plot of one ``check --json`` report: seconds per phase (``timings_s``), if recorded.

    ``name`` (the file name) makes the plot key unique on a page with several reports.
    """
    timings = {k: finite(v) for k, v in (report.get("timings_s") or {}).items() if finite(v) is not None}
    if not timings:
        return []
    fig = _figure(5.6, 0.6 + 0.35 * len(timings))
    ax = fig.add_subplot()
    names = list(timings)
    ax.barh(names, [timings[n] for n in names], color="#4c72b0")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.grid(alpha=0.3, axis="x")
    for i, n in enumerate(names):
        ax.text(timings[n], i, f" {timings[n]:.2f}", va="center", fontsize=7)
    ax.set_xlim(right=max(timings.values()) * 1.2 or 1.0)
    key = "check-timings-" + "".join(c if c.isalnum() else "-" for c in name)
    return [Plot(key, f"{name}: seconds per phase", "Wall seconds of each phase of the check.", _png(fig))]
