"""PNG plot of an ``unified-models rl`` run: reward and rollout-vs-trainer diff per step.

Written next to the metrics JSONL (``run.jsonl`` -> ``run.png``) with
matplotlib's Agg backend (no display needed). Top panel: mean reward per step
(± std band). Bottom panel: ``max_abs_diff``, ``mean_abs_diff``,
``full_vocab_max_abs_diff`` and ``k3_kl`` on a symlog axis (linear around 0,
so the expected flat line at exactly 0 is visible, and any non-zero diff
stands out); the title says whether every step had diff = 0.
"""

from __future__ import annotations

import os
from pathlib import Path

from .metrics import read_metrics

__all__ = ["plot_path_for", "plot_metrics"]


def plot_path_for(metrics_path: str | os.PathLike) -> Path:
    """``run.jsonl`` -> ``run.png`` (same directory)."""
    p = Path(metrics_path)
    return p.with_suffix(".png") if p.suffix else p.with_name(p.name + ".png")


def plot_metrics(metrics_path: str | os.PathLike, out: str | os.PathLike | None = None, *,
                 title: str | None = None) -> Path:
    """Draw the run in ``metrics_path`` to ``out`` (default :func:`plot_path_for`).

    Returns:
        the PNG path.

    Raises:
        ValueError: the JSONL holds no rows.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no metrics rows to plot")
    out = Path(out) if out is not None else plot_path_for(metrics_path)
    steps = [r["step"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    std = [r.get("reward_std") or 0.0 for r in rows]

    fig, (ax_r, ax_d) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, constrained_layout=True)
    ax_r.plot(steps, reward, marker="o", ms=3, color="tab:blue", label="reward_mean")
    ax_r.fill_between(steps, [m - s for m, s in zip(reward, std)], [m + s for m, s in zip(reward, std)],
                      color="tab:blue", alpha=0.15, label="± std over samples")
    ax_r.set_ylabel("reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="best", fontsize=8)

    all_zero = True
    for key, style in (("max_abs_diff", "-"), ("mean_abs_diff", "--"), ("full_vocab_max_abs_diff", ":"),
                       ("k3_kl", "-.")):
        vals = [r.get(key) for r in rows]
        if all(v is None for v in vals):
            continue
        all_zero &= all(v == 0 for v in vals if v is not None)
        ax_d.plot(steps, [float("nan") if v is None else v for v in vals], style, marker=".", label=key)
    ax_d.set_yscale("symlog", linthresh=1e-7)
    ax_d.set_ylim(bottom=0.0, top=max(1e-1, *(2 * (r.get("max_abs_diff") or 0.0) for r in rows)))
    ax_d.set_ylabel("|Δ logprob| rollout vs trainer (nats)")
    ax_d.set_xlabel("step")
    ax_d.grid(alpha=0.3)
    ax_d.legend(loc="best", fontsize=8)
    verdict = "diff = 0 at every step" if all_zero else "diff != 0 at some step"
    fig.suptitle(f"{title + ': ' if title else ''}{verdict}", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
