"""The report as one self-contained HTML page: inline CSS, plots as ``data:`` PNGs, no script,
no external reference (it opens from disk without a network).

Sections, top to bottom: the verdict (diff = 0 or the first step where it is not), a summary,
the fingerprints, the plots (:mod:`.plots`), the per-step table with the exact diff values
(``repr`` of the float: ``0.0`` is bitwise equality), the run's settings (the checkpoint's
``rl`` options and model config; a check's options, engine settings and peer check), and
every other field the files record. Fingerprint-like fields (a key holding ``fingerprint``,
``digest`` or ``sha256``) are shown wherever they occur, so fields added by later versions
appear without changes here.
"""

from __future__ import annotations

import html
import json
from datetime import datetime, timezone
from typing import Any, Iterable

from .load import RunData, finite
from .plots import PHASES, Plot, check_plots, derived_series, rl_plots

__all__ = ["DIFF_FIELDS", "render_page", "fingerprint_items", "exact"]

DIFF_FIELDS = ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched", "full_vocab_max_abs_diff")
"""Every one is exactly 0 when rollout and trainer logprobs are bitwise equal."""

_STEP_COLUMNS = ("step", "reward_mean", "reward_std", *DIFF_FIELDS, "full_vocab_rows", "importance_ratio_max",
                 "entropy", "tokens", "sequences")
_FINGERPRINT_WORDS = ("fingerprint", "digest", "sha256")
_MAX_VALUE_CHARS = 400

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;background:#f4f5f7;
color:#1d232a}
main{max-width:1180px;margin:0 auto;padding:18px 22px 40px}
h1{font-size:21px;margin:4px 0 2px}h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #d5d9de;
padding-bottom:3px}h3{font-size:14px;margin:0 0 2px}
.meta{color:#5b6470;font-size:12.5px}
.verdict{padding:9px 14px;border-radius:6px;font-weight:600;margin:12px 0;font-size:15px}
.pass{background:#e3f4e8;color:#14632e;border:1px solid #9fd3ad}.fail{background:#fde7ea;color:#8c1020;
border:1px solid #f0a3ae}.note{background:#fff6dc;border:1px solid #ecd58d;color:#6b5200;font-weight:400}
table{border-collapse:collapse;background:#fff;font-size:12.5px}
td,th{border:1px solid #dde1e5;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#eef0f3;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;font-family:ui-monospace,"DejaVu Sans Mono",monospace}
.mono,code{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px;word-break:break-all}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #dde1e5;border-radius:6px;padding:8px}
figure img{width:100%;height:auto;display:block}
figcaption{font-size:12px;color:#5b6470}
.scroll{max-height:420px;overflow:auto;border:1px solid #dde1e5}
.steps td,.steps th{white-space:nowrap}
.kv td:first-child{white-space:nowrap;color:#39424c}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(440px,1fr));gap:14px;align-items:start}
.cols table{width:100%}
.zero{color:#14632e}.nonzero{color:#b00020;font-weight:600}
details{margin:6px 0}summary{cursor:pointer;color:#39424c}
pre{background:#fff;border:1px solid #dde1e5;padding:8px;font-size:11.5px;overflow:auto;max-height:360px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def exact(v: Any) -> str:
    """A value as the page prints it: floats by ``repr`` (exact: ``0.0`` is bitwise 0, the
    shortest string that round-trips otherwise), ``null`` for None, JSON for lists/dicts
    (cut to 400 characters), else ``str``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (dict, list, tuple)):
        s = json.dumps(v, sort_keys=True)
        return s if len(s) <= _MAX_VALUE_CHARS else s[:_MAX_VALUE_CHARS] + f"… ({len(s)} chars)"
    return str(v)


def _num(v: Any, digits: int = 4) -> str:
    f = finite(v)
    if f is None:
        return "–" if v is None else exact(v)
    return f"{f:.{digits}g}"


def _td_exact(v: Any, diff: bool = False) -> str:
    cls = "num"
    if diff and isinstance(v, (int, float)) and not isinstance(v, bool):
        cls += " zero" if v == 0 else " nonzero"
    return f'<td class="{cls}">{_e(exact(v))}</td>'


def _kv_table(items: Iterable[tuple[str, Any]], *, raw: bool = False) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td><td class=\"mono\">{v if raw else _e(exact(v))}</td></tr>"
                   for k, v in items)
    return f'<table class="kv">{rows}</table>' if rows else '<p class="meta">none recorded</p>'


# ---------------------------------------------------------------------------------- fingerprints

def _is_fingerprint_key(k: str) -> bool:
    k = k.lower()
    return any(w in k for w in _FINGERPRINT_WORDS)


def _leaves(obj: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(obj, dict) and obj:
        for k in sorted(obj, key=str):
            yield from _leaves(obj[k], f"{prefix}.{k}")
    else:
        yield prefix, obj


def fingerprint_items(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted path, value)`` of every fingerprint-like field in ``obj`` (a key holding
    ``fingerprint``, ``digest`` or ``sha256``, any depth); a dict under such a key is
    flattened to its leaves (e.g. one checksum per tensor)."""
    out: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            path = f"{prefix}.{k}" if prefix else str(k)
            if _is_fingerprint_key(str(k)):
                out.extend(_leaves(obj[k], path))
            else:
                out.extend(fingerprint_items(obj[k], path))
    return out


def _runs(per_step: list[tuple[int, Any]]) -> list[tuple[int, int, Any]]:
    """``[(first step, last step, value)]``: consecutive steps with equal values merged."""
    out: list[tuple[int, int, Any]] = []
    for step, v in per_step:
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], step, v)
        else:
            out.append((step, step, v))
    return out


def _steps_label(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}–{b}"


def _rows_fingerprints(rows: list[dict], skip: set[str]) -> list[tuple[str, str]]:
    """Fingerprint fields of the metrics lines: one entry per field, its value per run of steps."""
    per: dict[str, list[tuple[int, Any]]] = {}
    for r in rows:
        for path, v in fingerprint_items(r):
            if path not in skip:
                per.setdefault(path, []).append((r["step"], v))
    out = []
    for path, vals in per.items():
        runs = _runs(vals)
        missing = len(rows) - len(vals)
        cell = "<br>".join(f"<span class=\"meta\">{_e(_steps_label(a, b))}:</span> {_e(exact(v))}"
                           for a, b, v in runs[:12])
        if len(runs) > 12:
            cell += f"<br><span class=\"meta\">… {len(runs) - 12} more changes</span>"
        if missing:
            cell += f"<br><span class=\"meta\">absent on {missing} of {len(rows)} lines</span>"
        out.append((path, cell))
    return out


def _fingerprint_section(run: RunData) -> str:
    parts = []
    if run.rows:
        items = _rows_fingerprints(run.rows, skip={"rollout_sha256"})
        # rollout_sha256 changes every step: it is in the per-step table
        if items:
            parts.append(f"<h3>{_e(run.metrics_path.name)}</h3>" + _kv_table(items, raw=True))
    for path, rep in run.checks:
        items = fingerprint_items(rep)
        if items:
            parts.append(f"<h3>{_e(path.name)}</h3>" + _kv_table(items))
    if not parts:
        return ('<p class="meta">No fingerprint fields recorded (fields whose name holds "fingerprint", '
                '"digest" or "sha256"; the per-step rollout_sha256 is in the step table).</p>')
    return f'<div class="scroll">{"".join(parts)}</div>'


# ---------------------------------------------------------------------------------- rl sections

def _rl_verdict(rows: list[dict]) -> tuple[bool, str]:
    for r in rows:
        bad = [k for k in DIFF_FIELDS if finite(r.get(k)) not in (None, 0.0)]
        if bad:
            return False, (f"diff != 0 at step {r['step']}: " +
                           ", ".join(f"{k} = {exact(r.get(k))}" for k in bad))
    missing = [r["step"] for r in rows if any(r.get(k) is None for k in ("max_abs_diff", "k3_kl"))]
    tokens = sum(int(r.get("tokens_compared") or r.get("tokens") or 0) for r in rows)
    if missing:
        return False, f"diff not measured at step {missing[0]} (null diff fields)"
    return True, (f"diff = 0 at every step: {len(rows)} steps ({rows[0]['step']}–{rows[-1]['step']}), "
                  f"{tokens} sampled tokens compared bitwise")


def _rl_summary(rows: list[dict]) -> str:
    w = min(5, len(rows))
    rewards = [finite(r.get("reward_mean")) for r in rows]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def worst(k):
        vals = [r.get(k) for r in rows if finite(r.get(k)) is not None]
        return max(vals) if vals else None

    d = derived_series(rows)
    secs = {p: sum(finite((r.get("seconds") or {}).get(p)) or 0.0 for r in rows) for p in (*PHASES, "step")}
    items = [
        ("steps", f"{rows[0]['step']}–{rows[-1]['step']} ({len(rows)} lines)"),
        (f"reward_mean, first {w} steps", _num(mean(rewards[:w]))),
        (f"reward_mean, last {w} steps", _num(mean(rewards[-w:]))),
        *((f"{k} (worst step)", exact(worst(k))) for k in ("max_abs_diff", "mean_abs_diff", "k3_kl",
                                                            "full_vocab_max_abs_diff", "importance_ratio_max")),
        ("entropy, first → last step", f"{_num(rows[0].get('entropy'))} → {_num(rows[-1].get('entropy'))} nats"),
        ("response length, mean", f"{_num(mean(d['length']), 3)} tokens"),
        ("tokens sampled", str(sum(int(r.get("tokens") or 0) for r in rows))),
        ("throughput, mean of steps", f"rollout {_num(mean(d['rollout_tokens_per_s']), 3)} tokens/s, "
                                      f"whole step {_num(mean(d['step_tokens_per_s']), 3)} tokens/s"),
        ("seconds (" + " / ".join(PHASES) + ")", " / ".join(f"{secs[p]:.1f}" for p in PHASES)
         + f"  (steps: {secs['step']:.1f} s)"),
    ]
    return _kv_table(items)


def _step_table(rows: list[dict]) -> str:
    d = derived_series(rows)
    head = "".join(f"<th>{_e(c)}</th>" for c in (*_STEP_COLUMNS, "tokens / seq", "rollout tok/s",
                                                  *(f"s {p}" for p in (*PHASES, "step")), "rollout_sha256"))
    body = []
    for i, r in enumerate(rows):
        cells = [_td_exact(r.get(c), diff=c in DIFF_FIELDS) for c in _STEP_COLUMNS]
        cells.append(f'<td class="num">{_e(_num(d["length"][i], 3))}</td>')
        cells.append(f'<td class="num">{_e(_num(d["rollout_tokens_per_s"][i], 3))}</td>')
        secs = r.get("seconds") or {}
        cells.extend(f'<td class="num">{_e(_num(secs.get(p), 3))}</td>' for p in (*PHASES, "step"))
        sha = r.get("rollout_sha256")
        cells.append(f'<td class="mono" title="{_e(sha)}">{_e(str(sha)[:16]) if sha else "–"}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table class="steps"><tr>{head}</tr>{"".join(body)}</table></div>'


def _other_row_fields(rows: list[dict]) -> str:
    """Top-level fields of the metrics not shown elsewhere, per run of steps with equal values."""
    shown = set(_STEP_COLUMNS) | {"seconds", "rollout_sha256"}
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in shown and k not in keys and not _is_fingerprint_key(k))
    items = []
    for k in keys:
        runs = _runs([(r["step"], r.get(k)) for r in rows])
        nums = [v for v in (finite(r.get(k)) for r in rows) if v is not None]
        if len(runs) == 1:
            cell = _e(exact(runs[0][2]))
        elif len(runs) <= 3 or not nums:
            cell = "<br>".join(f"<span class=\"meta\">{_e(_steps_label(a, b))}:</span> {_e(exact(v))}"
                               for a, b, v in runs[:6])
            if len(runs) > 6:
                cell += f"<br><span class=\"meta\">… {len(runs) - 6} more changes</span>"
        else:
            cell = (f"<span class=\"meta\">varies: min</span> {_e(_num(min(nums)))}<span class=\"meta\">, max"
                    f"</span> {_e(_num(max(nums)))}<span class=\"meta\">; step {rows[0]['step']}:</span> "
                    f"{_e(exact(rows[0].get(k)))}<span class=\"meta\">, step {rows[-1]['step']}:</span> "
                    f"{_e(exact(rows[-1].get(k)))}")
        items.append((k, cell))
    return _kv_table(items, raw=True)


def _checkpoint_section(run: RunData) -> str:
    ck = run.checkpoint
    if ck is None:
        return ('<p class="meta">No training checkpoint in the run directory or its subdirectories: the metrics '
                'do not record the run\'s options; <code>rl --save RUN_DIR/ckpt</code> stores them with every '
                'checkpoint.</p>')
    out = [_kv_table([("checkpoint", str(ck.path)), ("step", ck.iteration), ("family", ck.family),
                      ("architecture", ck.architecture)])]
    if ck.note:
        out.append(f'<div class="verdict note">{_e(ck.note)}</div>')
    if ck.rl:
        out.append("<h3>rl options recorded in the checkpoint</h3>" + _kv_table(sorted(ck.rl.items())))
    if ck.hf_config is not None:
        out.append("<details><summary>model config.json (from the checkpoint)</summary><pre>"
                   + _e(json.dumps(ck.hf_config, indent=2, sort_keys=True)) + "</pre></details>")
    return "".join(out)


def _rl_section(run: RunData, plots: list[Plot]) -> str:
    ok, verdict = _rl_verdict(run.rows)
    return "".join([
        f'<h2 id="rl">rl run: {_e(run.metrics_path)}</h2>',
        f'<div class="verdict {"pass" if ok else "fail"}">{_e(verdict)}</div>',
        '<div class="cols"><div><h3>Summary</h3>', _rl_summary(run.rows), "</div>",
        "<div><h3>Fingerprints</h3>", _fingerprint_section(run), "</div></div>",
        "<h2>Per step</h2>", _plot_grid(plots),
        "<h2>Steps (exact values)</h2>", _step_table(run.rows),
        "<h2>Settings</h2>", _checkpoint_section(run),
        "<h3 style=\"margin-top:12px\">Other recorded fields</h3>", _other_row_fields(run.rows),
    ])


# ---------------------------------------------------------------------------------- check sections

def _check_section(path, rep: dict, plots: list[Plot]) -> str:
    passed = rep.get("passed")
    if passed is None:
        passed = all(finite(rep.get(k)) == 0.0 for k in DIFF_FIELDS if k in rep)
    diff_items = [(k, rep.get(k)) for k in ("tokens_compared", *DIFF_FIELDS, "full_vocab_rows") if k in rep]
    timings = rep.get("timings_s") or {}
    tokens = finite(rep.get("tokens_compared"))
    derived = []
    if tokens and rep.get("num_prompts"):
        derived.append(("response length, mean", f"{tokens / rep['num_prompts']:.4g} tokens per prompt"))
    if tokens and finite(timings.get("rollout")):
        derived.append(("rollout throughput", f"{tokens / timings['rollout']:.4g} tokens/s"))
    top = [(k, rep.get(k)) for k in ("model", "device", "num_prompts", "max_new_tokens", "seed", "rollout_sha256",
                                     "passed") if k in rep]
    shown = {k for k, _ in diff_items} | {k for k, _ in top} | {"peer", "options", "timings_s", "engine"}
    rest = [(k, v) for k, v in rep.items() if k not in shown and not _is_fingerprint_key(k)]
    verdict = ("PASS: diff = 0 (every diff field exactly 0, peer within tolerance)" if passed else
               "FAIL: " + (", ".join(f"{k} = {exact(v)}" for k, v in diff_items
                                     if k in DIFF_FIELDS and finite(v) not in (None, 0.0))
                           or "see the peer check"))
    peer = rep.get("peer") or {}
    return "".join([
        f'<h2 id="check-{_e(path.name)}">check report: {_e(path)}</h2>',
        f'<div class="verdict {"pass" if passed else "fail"}">{_e(verdict)}</div>',
        '<div class="cols"><div><h3>Diff (rollout vs trainer)</h3>',
        _kv_table([(k, f'<span class="{"zero" if finite(v) == 0 else "nonzero"}">{_e(exact(v))}</span>'
                    if k in DIFF_FIELDS else _e(exact(v))) for k, v in diff_items], raw=True),
        "<h3 style=\"margin-top:10px\">Run</h3>", _kv_table(top + derived + rest), "</div>",
        "<div><h3>Peer check (our fp32 reference vs transformers)</h3>", _kv_table(sorted(peer.items())),
        "<h3 style=\"margin-top:10px\">Fingerprints</h3>", _kv_table(fingerprint_items(rep)), "</div>",
        '</div><div class="cols" style="margin-top:12px"><div><h3>Engine settings (vLLM, as resolved)</h3>',
        _kv_table(sorted((rep.get("engine") or {}).items())),
        "</div><div><h3>Options</h3>", _kv_table(sorted((rep.get("options") or {}).items())), "</div></div>",
        _plot_grid(plots) if plots else "",
    ])


# ---------------------------------------------------------------------------------- page

def _plot_grid(plots: list[Plot]) -> str:
    figs = "".join(f'<figure id="plot-{_e(p.key)}"><h3>{_e(p.title)}</h3><img alt="{_e(p.title)}" '
                   f'src="{p.data_uri}"><figcaption>{_e(p.caption)}</figcaption></figure>' for p in plots)
    return f'<div class="grid">{figs}</div>'


def render_page(run: RunData, *, generated: datetime | None = None) -> tuple[str, list[Plot]]:
    """The HTML page of ``run`` (see the module doc) and the plots embedded in it.

    Args:
        run: from :func:`.load.load_run_dir`.
        generated: timestamp printed in the header (default: now, UTC).

    Returns:
        ``(html text, plots)``.
    """
    generated = generated or datetime.now(timezone.utc)
    plots: list[Plot] = []
    body = []
    if run.rows:
        rp = rl_plots(run.rows)
        plots += rp
        body.append(_rl_section(run, rp))
    for path, rep in run.checks:
        cp = check_plots(rep, path.name)
        plots += cp
        body.append(_check_section(path, rep, cp))
    files = ([str(run.metrics_path)] if run.metrics_path else []) + [str(p) for p, _ in run.checks]
    if run.checkpoint is not None:
        files.append(str(run.checkpoint.path))
    kind = " + ".join((["rl"] if run.rows else []) + (["check"] * bool(run.checks)))
    title = f"unified-models report: {run.source}"
    page = "".join([
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>{_e(title)}</h1>",
        f'<div class="meta">{_e(kind)} run · generated {_e(generated.strftime("%Y-%m-%d %H:%M:%S %Z"))} · '
        f"from {_e(', '.join(files))}</div>",
        *body,
        "</main></body></html>\n",
    ])
    return page, plots
