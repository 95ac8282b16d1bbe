"""``benchmarks/rollout_throughput.py``: ``--engine-cpus`` (the CPU list both engine workers are pinned to), usage
errors, and the ``--interleave`` driver against fake engine workers."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("rollout_throughput", ROOT / "benchmarks" / "rollout_throughput.py")
rt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rt)


def test_cpu_lists_parse_to_sorted_cpus():
    allowed = sorted(os.sched_getaffinity(0))
    first = allowed[0]
    assert rt.parse_cpu_list(str(first)) == [first]
    if len(allowed) >= 2 and allowed[1] == first + 1:
        assert rt.parse_cpu_list(f"{first + 1},{first}-{first}") == [first, first + 1]
        assert rt.parse_cpu_list(f"{first}-{first + 1}") == [first, first + 1]


@pytest.mark.parametrize("text,message", [("a-b", "not a CPU list"), ("3-1", "not a CPU list"), ("", "not a CPU list"),
                                          ("-1", "not a CPU list"), ("100000", "not available")])
def test_bad_cpu_lists_are_named(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        rt.parse_cpu_list(text)


def test_the_flag_is_a_usage_error_for_unavailable_cpus(capsys):
    with pytest.raises(SystemExit) as e:
        rt.main(["--engine-cpus", "100000", "--preset", "nemotron_h_tiny"])
    assert e.value.code == 2 and "--engine-cpus" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["--preset", "nosuch"], "unknown preset 'nosuch'"),
                                          (["--model", "/nonexistent/ckpt", "--engines", "ours"], "--model: ")])
def test_unknown_presets_and_checkpoints_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        rt.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


_FAKE_ENGINE = r'''
import json, os, sys, time
which, reply_fd, hang = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hang"
reply = os.fdopen(reply_fd, "w", buffering=1)
reply.write(json.dumps({"engine": which, "start_s": 0.1, "settings": None, "workloads": {}, "error": None}) + "\n")
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "quit":
        if hang:  # an engine whose teardown never ends
            time.sleep(3600)
        break
    seconds = {"ours": 2.0, "native": 1.0}[which] * (1 + cmd["repeat"])
    reply.write(json.dumps({"warmup_s": 0.0} if cmd["op"] == "warmup" else {"seconds": seconds}) + "\n")
'''


def test_interleaved_runs_alternate_and_an_engine_slow_to_quit_is_killed(tmp_path, monkeypatch, capsys):
    """``--interleave``'s driver against two fake engine workers speaking its protocol: every workload's
    repeats run on both, the paired ratios land in the record and in the printed line, and an engine that
    never quits is killed after ``CLOSE_GRACE_S`` (it once held the stage past its timeout)."""
    script = tmp_path / "fake_engine.py"
    script.write_text(_FAKE_ENGINE)

    def command(which, plan_path, result_path):
        return [sys.executable, str(script), which, "{fd}", "hang" if which == "ours" else "quit"], dict(os.environ)

    def popen_with_fd(cmd, *a, pass_fds=(), **k):
        return real_popen([c.replace("{fd}", str(pass_fds[0])) for c in cmd], *a, pass_fds=pass_fds, **k)

    real_popen = rt.subprocess.Popen
    monkeypatch.setattr(rt, "_worker_command", command)
    monkeypatch.setattr(rt.subprocess, "Popen", popen_with_fd)
    monkeypatch.setattr(rt, "CLOSE_GRACE_S", 1.0)
    plan = {"workloads": [{"name": "4x8/16", "num_requests": 4, "input_len": 8, "output_len": 16}], "repeats": 2}
    t0 = time.monotonic()
    res = rt._run_interleaved(["native", "ours"], plan, tmp_path / "plan.json", tmp_path, "x", timeout_s=30)
    assert time.monotonic() - t0 < 20
    rec = res["ours"]["workloads"]["4x8/16"]
    assert rec["seconds"] == [2.0, 4.0] and res["native"]["workloads"]["4x8/16"]["seconds"] == [1.0, 2.0]
    assert rec["paired_ratios"] == [0.5, 0.5] and rec["tok_s"] == 64 / 2.0
    assert "(best of 2; ours/native per repeat [0.5, 0.5])" in capsys.readouterr().out


def test_step_timing_splits_decode_and_prefill_steps():
    """``--step-timing``: each phase's time goes to the step it serves, also in async scheduling's order
    (vLLM schedules and launches step N+1 before it waits for and updates step N): the launch phases to
    the step just scheduled, the wait and the update to the oldest step not yet updated, the output
    processing to the step updated last. Step kinds: ``decode`` (running requests, one token each),
    ``prefill`` (a new request, even of one token, or several tokens), ``empty``; ``close()`` restores
    the methods."""
    from types import SimpleNamespace

    def out(n, new=()):
        return SimpleNamespace(num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()),
                               scheduled_new_reqs=list(new))

    steps = [out({"a": 8, "b": 1}, new=["a"]), out({"a": 1, "b": 1}), out({"c": 1}, new=["c"]), out({})]

    class Scheduler:
        def __init__(self):
            self.steps = iter(steps)

        def schedule(self):
            return next(self.steps)

        def update_from_output(self, o):
            pass

    class Runner:
        def execute_model(self, o):
            time.sleep(0.002)

        def wait(self, o):  # the prefill's device time shows in the wait for its output
            time.sleep(0.03 if o.total_num_scheduled_tokens > 2 else 0.001)

    sched, runner = Scheduler(), Runner()
    timing = rt.StepTiming()
    for obj, attr, name in ((sched, "schedule", None), (sched, "update_from_output", None),
                            (runner, "execute_model", None), (runner, "wait", "wait_output")):
        timing._wrap(obj, attr, name)
    a = sched.schedule(); runner.execute_model(a)  # noqa: E702 - async order: a, then b launched before a's wait
    b = sched.schedule(); runner.execute_model(b)  # noqa: E702
    runner.wait(a); sched.update_from_output(a)  # noqa: E702
    runner.wait(b); sched.update_from_output(b)  # noqa: E702
    c = sched.schedule(); runner.execute_model(c); runner.wait(c); sched.update_from_output(c)  # noqa: E702
    sched.schedule()
    snap = timing.snapshot(1.0)
    kinds = snap["by_kind"]
    assert snap["steps"] == 4 and set(kinds) == {"decode", "prefill", "empty"}
    assert kinds["prefill"]["steps"] == 2 and kinds["decode"]["steps"] == 1 and kinds["empty"]["steps"] == 1
    assert kinds["prefill"]["wait_output_ms_per_step"] >= 15 > kinds["decode"]["wait_output_ms_per_step"]
    assert kinds["decode"]["execute_model_ms_per_step"] >= 1  # its launch (2 ms) went to the step it launched
    timing.close()
    assert "schedule" not in vars(sched) and "execute_model" not in vars(runner)
