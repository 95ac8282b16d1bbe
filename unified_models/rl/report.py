"""What ``unified-models rl`` prints: one line per step and the closing summary table."""

from __future__ import annotations

from .metrics import summarize
from .options import RLOptions

__all__ = ["fmt", "step_line", "print_summary"]


def fmt(x) -> str:
    """A metric for the step line: ``-`` for None, ``0`` for an exact 0.0, else 3 significant digits."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def step_line(row: dict, steps: int) -> str:
    """The progress line of one metrics ``row`` (needs ``seconds``) out of ``steps`` in total."""
    sec = row["seconds"]
    return (f"step {row['step']:>3}/{steps}  reward {row['reward_mean']:.3f}  "
            f"max|Δ| {fmt(row.get('max_abs_diff'))}  k3 {fmt(row.get('k3_kl'))}  "
            f"full-vocab {fmt(row.get('full_vocab_max_abs_diff'))}  ratio {fmt(row.get('importance_ratio_max'))}  "
            f"H {fmt(row.get('entropy'))}  tokens {row['tokens']}  "
            f"| {' '.join(f'{k} {v:.1f}s' for k, v in sec.items() if k != 'step')}")


def print_summary(out, rows, opts: RLOptions, png, saved_at, wall_s: float, failure) -> None:
    """Print the closing table on the rich console ``out``: rewards over the first and last
    steps of ``rows`` (metrics lines), the worst diffs, seconds per phase, where the metrics,
    plot ``png`` and checkpoint ``saved_at`` went, and PASS or the ``failure``."""
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
