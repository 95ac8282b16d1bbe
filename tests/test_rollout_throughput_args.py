"""``benchmarks/rollout_throughput.py``'s ``--engine-cpus``: the CPU list both engine workers are pinned to."""

from __future__ import annotations

import argparse
import importlib.util
import os
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
