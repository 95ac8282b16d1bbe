"""`unified-models report RUN_DIR`: one self-contained HTML page of a real CPU `rl` run and a
`check` report (every plot embedded, the exact diff values, the settings), rendered by a
headless browser where one is installed; bad input exits 2 naming the file and line."""

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from unified_models.cli import main
from unified_models.report.page import exact

RL_PLOTS = ("diff", "reward", "entropy", "length", "throughput", "phases")
SMALL = ["--num-prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--full-vocab-rows", "4",
         "--seed", "5", "--lr", "1e-3", "--reward", "token-set"]
"""4 sequences x 4 tokens per step: the smallest rl run that has every metric."""


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _embedded_pngs(text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)]


def _assert_self_contained(text: str) -> None:
    """No attribute and no CSS url() points outside the page; no script."""
    for attr, value in re.findall(r'\b(src|href|action|poster|srcset)\s*=\s*"([^"]*)"', text, flags=re.I):
        assert value.startswith("data:") or value.startswith("#"), (attr, value[:80])
    assert not re.search(r"url\s*\(", text, flags=re.I)
    assert "<script" not in text.lower() and "<link" not in text.lower() and "@import" not in text
    assert not re.search(r'(src|href)\s*=\s*"?(https?:)?//', text, flags=re.I)


# ------------------------------------------------------------------ a real CPU rl run and check report


@pytest.fixture(scope="module")
def run_dir(tiny_checkpoint, tmp_path_factory):
    """RUN_DIR with rl_metrics.jsonl + ckpt/ of a 2-step rl run and check.json of a 2-prompt check."""
    d = tmp_path_factory.mktemp("report_run")
    assert main(["rl", "--model", str(tiny_checkpoint), *SMALL, "--steps", "2", "--metrics",
                 str(d / "rl_metrics.jsonl"), "--save", str(d / "ckpt"), "--no-plot"]) == 0
    assert main(["check", "--model", str(tiny_checkpoint), "--num-prompts", "2", "--max-new-tokens", "4",
                 "--peer-prompts", "1", "--json", str(d / "check.json")]) == 0
    return d


@pytest.fixture(scope="module")
def page(run_dir):
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report.html"
    return out, out.read_text(encoding="utf-8")


@pytest.mark.slow
def test_page_of_rl_and_check_run_holds_every_plot_value_and_setting(run_dir, page):
    out, text = page
    _assert_self_contained(text)
    rows = [json.loads(line) for line in (run_dir / "rl_metrics.jsonl").read_text().splitlines()]
    check = json.loads((run_dir / "check.json").read_text())
    assert [r["step"] for r in rows] == [1, 2]
    for key in RL_PLOTS + ("training", "check-timings-check-json"):
        assert f'id="plot-{key}"' in text, key
    pngs = _embedded_pngs(text)
    assert len(pngs) == len(RL_PLOTS) + 2
    from PIL import Image

    for png in pngs:
        im = Image.open(io.BytesIO(png))
        assert im.format == "PNG" and im.width >= 400 and len(np.unique(np.asarray(im.convert("L")))) > 16
    # the step table holds the exact values of every diff field, per step (0.0 = bitwise equal)
    table = text[text.index("Steps (exact values)"):]
    for r in rows:
        cells = re.search(rf'<tr><td class="num">{r["step"]}</td>(.*?)</tr>', table).group(1)
        for k in ("reward_mean", "max_abs_diff", "mean_abs_diff", "k3_kl", "full_vocab_max_abs_diff", "entropy",
                  "tokens"):
            assert f">{exact(r[k])}</td>" in cells, (r["step"], k, r[k])
        assert r["rollout_sha256"][:16] in cells
    assert "diff = 0 at every step: 2 steps" in text
    # the rl options from the checkpoint, and the check's diff, engine settings and options
    assert f"checkpoint</td><td class=\"mono\">{run_dir / 'ckpt' / 'iter_0000002'}" in text
    for k, v in (("seed", 5), ("group_size", 2), ("max_new_tokens", 4), ("reward", "token-set")):
        assert f"<td>{k}</td><td class=\"mono\">{v}</td>" in text, k
    assert check["rollout_sha256"] in text and "PASS: diff = 0" in text
    for k, v in check["engine"].items():
        assert f"<td>{k}</td><td class=\"mono\">{html.escape(exact(v))}</td>" in text, k
    assert f"<td>tokens_compared</td><td class=\"mono\">{check['tokens_compared']}</td>" in text
    # fingerprint-like fields of either file are listed (whatever the versions record)
    for k in [k for k in check if "fingerprint" in k]:
        assert k in text
    assert os.stat(out).st_size < 2_000_000


def _browser() -> list[str] | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        exe = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
        if exe:
            return [exe]
    return None


@pytest.mark.slow
def test_page_renders_in_a_headless_browser(page, tmp_path):
    exe = _browser()
    if exe is None:
        pytest.skip("no headless browser installed (apt-get install chromium); the page was not rendered")
    out, _ = page
    shot = tmp_path / "shot.png"
    cmd = [*exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600", f"--screenshot={shot}",
           out.resolve().as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    from PIL import Image

    im = Image.open(shot).convert("RGB")
    assert im.size == (1200, 1600)
    px = np.asarray(im).reshape(-1, 3).astype(int)
    assert len(np.unique(px, axis=0)) > 200  # text, tables and plots, not one flat colour
    # the verdict banner (green) and the plots' blue lines (#4c72b0) were drawn
    assert int((px == (0xE3, 0xF4, 0xE8)).all(1).sum()) > 5000
    assert int((np.abs(px - (0x4C, 0x72, 0xB0)) < 12).all(1).sum()) > 200


# ------------------------------------------------------------------ fast: synthetic files, bad input


def _row(step, **kw):
    r = {"step": step, "reward_mean": 0.25 * step, "reward_std": 0.1, "reward_max": 0.5, "tokens": 16,
         "sequences": 4, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "std_abs_diff": 0.0, "k3_kl": 0.0,
         "num_mismatched": 0, "full_vocab_max_abs_diff": 0.0, "importance_ratio_max": 1.0, "entropy": 2.5,
         "rollout_sha256": f"{step:064x}",
         "seconds": {"rollout": 1.0, "recompute": 0.5, "update": 2.0, "sync": 0.1, "save": 0.0, "step": 3.75}}
    r.update(kw)
    return r


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_nonzero_diff_and_new_fingerprint_fields_are_shown(tmp_path, capsys):
    rows = [_row(1, contract_fingerprint={"vllm": "c0ffee", "megatron": "c0ffee"}),
            _row(2, max_abs_diff=1.1920928955078125e-07, num_mismatched=3, k3_kl=2.5e-15,
                 contract_fingerprint={"vllm": "c0ffee", "megatron": "c0ffee"}, weight_fingerprint=12345)]
    _write(tmp_path / "rl_metrics.jsonl", rows)
    out = tmp_path / "sub" / "page.html"
    assert main(["report", str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    text = out.read_text()
    _assert_self_contained(text)
    assert "diff != 0 at step 2: max_abs_diff = 1.1920928955078125e-07, k3_kl = 2.5e-15, num_mismatched = 3" in text
    assert 'class="num nonzero">1.1920928955078125e-07</td>' in text
    assert "contract_fingerprint.megatron" in text and "steps 1–2:</span> c0ffee" in text
    assert "weight_fingerprint" in text and "absent on 1 of 2 lines" in text
    assert "No training checkpoint" in text
    assert len(_embedded_pngs(text)) == len(RL_PLOTS)  # no loss/grad_norm recorded: no training plot


def test_a_file_argument_writes_next_to_it(tmp_path):
    m = _write(tmp_path / "run7.jsonl", [_row(1), _row(2)])
    assert main(["report", str(m)]) == 0
    assert "diff = 0 at every step: 2 steps" in (tmp_path / "run7.html").read_text()


@pytest.mark.parametrize("lines, message", [
    (['{"step": 1, "reward_mean": 0.5}', "{not json"], ":2: not JSON"),
    (["[1, 2]"], ":1: expected a JSON object"),
    ([json.dumps(_row(1)), "", json.dumps(_row(1))], ":3: step 1 follows step 1"),
    ([json.dumps(_row(1, max_abs_diff="0"))], ":1: field 'max_abs_diff' is '0', expected a number or null"),
    ([json.dumps(_row(1, seconds={"rollout": -1}))], ":1: field 'seconds.rollout' is -1"),
    ([json.dumps({"reward_mean": 1.0})], ":1: no 'step' field"),
    ([""], "holds no metrics lines"),
])
def test_malformed_metrics_exit_2_naming_file_and_line(tmp_path, capsys, lines, message):
    m = tmp_path / "rl_metrics.jsonl"
    m.write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    line = _error_line(capsys)
    assert str(m) in line and message in line, line
    assert not (tmp_path / "report.html").exists()


def test_missing_or_empty_run_dir_and_bad_check_json_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}: no such directory or file" in _error_line(capsys)
    (tmp_path / "notes.txt").write_text("x")
    assert main(["report", str(tmp_path)]) == 2
    line = _error_line(capsys)
    assert "no run to report on" in line and "rl_metrics.jsonl" in line and "check.json" in line
    (tmp_path / "check.json").write_text('{"tokens_compared": 4,\n "max_abs_diff": }')
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path / 'check.json'}:2: not JSON" in _error_line(capsys)
    (tmp_path / "check.json").write_text(json.dumps({"tokens_compared": 4, "max_abs_diff": 0.0}))
    assert main(["report", str(tmp_path)]) == 2
    assert "not a check --json report: no field 'mean_abs_diff', 'k3_kl', 'full_vocab_max_abs_diff'" in \
        _error_line(capsys)
    (tmp_path / "check.json").unlink()
    _write(tmp_path / "a.jsonl", [_row(1)])
    _write(tmp_path / "b.jsonl", [_row(1)])
    assert main(["report", str(tmp_path)]) == 2
    assert "several metrics files (a.jsonl, b.jsonl)" in _error_line(capsys)
    assert main(["report", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "a.jsonl")]) == 2
    assert "is an input of the report" in _error_line(capsys)
    assert main(["report", str(tmp_path / "a.jsonl"), "--out", str(tmp_path)]) == 2
    assert "is a directory" in _error_line(capsys)
