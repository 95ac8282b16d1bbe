"""Issue 21: Ctrl-C (SIGINT) ends a command with one line saying what was kept, exit 130,
and leaves a state that the next run accepts (no half-written destination, no stray
temporary directory, the latest training checkpoint intact)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import unified_models
from unified_models import interrupts
from unified_models.cli import main
from unified_models.paths import destination_report

REPO = Path(unified_models.__file__).resolve().parent.parent


def _tree(root: Path) -> dict:
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for n in filenames:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}."))


def _popen(code_or_args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, *code_or_args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _one_interrupt_line(err: str) -> str:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("interrupted")]
    assert len(lines) == 1, err[-3000:]
    assert err.rstrip("\n").splitlines()[-1] == lines[0]  # and it is the last thing printed
    return lines[0]


# ----------------------------------------------------------------------------- units


def test_summary_names_step_and_what_was_kept():
    interrupts.reset()
    assert interrupts.summary() == "interrupted"
    interrupts.progress(3)
    interrupts.on_interrupt(lambda: "latest checkpoint: step 2")
    assert interrupts.summary() == "interrupted at step 3; latest checkpoint: step 2"
    interrupts.on_interrupt(lambda: 1 / 0)
    assert interrupts.summary().startswith("interrupted at step 3; could not tell what was kept (ZeroDivisionError")
    with pytest.raises(KeyboardInterrupt):
        interrupts.handle_sigint()
    assert interrupts.interrupted()
    interrupts.reset()
    assert not interrupts.interrupted()


def test_destination_report_states(tmp_path):
    dst = tmp_path / "out"
    describe = destination_report(dst)
    (tmp_path / ".out.tmp-0123456789ab").mkdir()  # what an interrupted writer could leave
    (tmp_path / ".out.tmp-0123456789ab" / "half").write_text("x")
    assert describe() == f"DST {dst} was not written (it did not exist and still does not); removed the " \
                         "unfinished temporary .out.tmp-0123456789ab"
    assert _leftovers(tmp_path, "out") == []
    dst.mkdir()
    (tmp_path / ".out.tmp-preexisting").mkdir()  # not this command's: left alone
    describe = destination_report(dst)
    assert describe() == f"DST {dst} is untouched (its previous contents are kept)"
    new = tmp_path / "new"
    new.mkdir()
    os.replace(dst.parent / "out", tmp_path / "gone")
    os.replace(new, dst)
    assert describe() == f"DST {dst} was written completely before the interrupt"
    assert _leftovers(tmp_path, "out") == [".out.tmp-preexisting"]


def test_an_error_caused_by_the_interrupt_is_reported_as_the_interrupt(tiny_checkpoint, tmp_path, monkeypatch,
                                                                       capsys):
    """PyTorch DCP catches the KeyboardInterrupt of a write and re-raises it as its own error, which
    the writers report as "writing ... failed": ``main`` still ends with the one interrupt line."""
    from unified_models.backends.megatron import dist_ckpt
    from unified_models.dsl import CheckpointError

    def hf_to_megatron(src, dst, overwrite=False):
        try:
            interrupts.handle_sigint()
        except KeyboardInterrupt as e:
            raise CheckpointError(f"writing Megatron checkpoint {dst} failed: RuntimeError: [enforce fail at "
                                  "inline_container.cc:672]") from e

    monkeypatch.setattr(dist_ckpt, "hf_to_megatron", hf_to_megatron)
    dst = tmp_path / "mg"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(tiny_checkpoint), str(dst)]) == 130
    err = capsys.readouterr().err
    assert err == f"interrupted; DST {dst} was not written (it did not exist and still does not)\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # main restored the handler


# ----------------------------------------------------------------------------- convert, a real SIGINT

# Runs `unified-models convert` with the DCP writer paused after it has written the temporary
# directory (before the rename), so the SIGINT lands in the middle of the write every time.
_PAUSED_CONVERT = r"""
import sys, time
from unified_models.converters import megatron_dist_ckpt as layout
real = layout.write_torch_dcp
def paused(ckpt_dir, tensors, common):
    real(ckpt_dir, tensors, common)
    print("PAUSED", ckpt_dir, flush=True)
    time.sleep(120)
layout.write_torch_dcp = paused
from unified_models.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("existing", [False, True], ids=["new destination", "--overwrite"])
def test_sigint_during_convert(tiny_checkpoint, tmp_path, existing):
    dst = tmp_path / "mg"
    argv = ["convert", "--from", "hf", "--to", "megatron", str(tiny_checkpoint), str(dst)]
    if existing:
        assert main(argv) == 0  # a previous conversion the interrupted one would replace
        argv.append("--overwrite")
    before = _tree(dst) if existing else None
    proc = _popen(["-c", _PAUSED_CONVERT, *argv], tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PAUSED"), proc.communicate(timeout=60)
        tmp = Path(line.split(maxsplit=1)[1].strip())
        assert tmp.parent == tmp_path and tmp.name.startswith(".mg.tmp-") and any(tmp.iterdir())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    line = _one_interrupt_line(err)
    if existing:
        assert line == f"interrupted; DST {dst} is untouched (its previous contents are kept)"
        assert _tree(dst) == before
    else:
        assert line == f"interrupted; DST {dst} was not written (it did not exist and still does not)"
        assert not dst.exists()
    assert _leftovers(tmp_path, "mg") == []  # no half-written temporary directory
    # the next run accepts what is there
    assert main(argv) == 0
    from unified_models.backends.megatron.dist_ckpt import check_dist_checkpoint

    assert check_dist_checkpoint(dst).spec.family == "nemotron_h"


# ----------------------------------------------------------------------------- rl, a real SIGINT

SMALL = ["--num-prompts-per-step", "1", "--group-size", "2", "--max-new-tokens", "4", "--full-vocab-rows", "4",
         "--no-plot"]


@pytest.mark.slow
def test_sigint_during_rl_names_the_latest_checkpoint_and_resume_accepts_it(tiny_checkpoint, tmp_path):
    from unified_models.backends.megatron.checkpoint import latest_iteration

    save = tmp_path / "ckpt"
    proc = _popen(["-m", "unified_models.cli", "rl", "--model", str(tiny_checkpoint), *SMALL, "--steps", "4",
                   "--save", str(save), "--save-every", "1", "--metrics", str(tmp_path / "m.jsonl")], tmp_path)
    try:
        deadline = time.monotonic() + 900
        while latest_iteration(save) is None:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 900 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    line = _one_interrupt_line(err)
    m = re.fullmatch(r"interrupted at step (\d+); latest checkpoint: step (\d+) \((.+)\); continue with "
                     r"--resume (.+) --save (.+)", line)
    assert m, line
    at, kept = int(m[1]), int(m[2])
    assert kept == latest_iteration(save) and at - 1 <= kept <= at < 4
    assert Path(m[3]) == save / f"iter_{kept:07d}" and m[4] == m[5] == str(save)
    # the next run resumes from it and finishes one more step with diff = 0
    assert main(["rl", "--model", str(tiny_checkpoint), *SMALL, "--steps", str(kept + 1), "--resume", str(save),
                 "--save", str(save), "--metrics", str(tmp_path / "m2.jsonl")]) == 0
    assert latest_iteration(save) == kept + 1
