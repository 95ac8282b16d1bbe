"""``benchmarks/mamba_backward.py`` on the CPU at small widths: both backward paths of the scan and the
conv run, their gradients agree, the written-out path writes fewer bytes (the property it exists for;
its time is the GPU's to measure), and bad sizes are refused naming the flag."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec_ = importlib.util.spec_from_file_location("mamba_backward", ROOT / "benchmarks" / "mamba_backward.py")
mb = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(mb)


def test_small_run_writes_fewer_bytes_same_gradients(tmp_path):
    out = tmp_path / "mb.json"
    assert mb.main(["--heads", "4", "--head-dim", "8", "--groups", "2", "--state", "16", "--chunk", "16",
                    "--sequences", "3", "--seq-len", "40", "--repeats", "1", "--dtype", "float32",
                    "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["op"] for r in res["rows"]] == ["ssd_chunk_scan", "causal_conv1d"]
    for r in res["rows"]:
        assert r["max_rel_diff"] < 1e-5, r
        assert 0 < r["written_out"]["bytes_written"] < r["autograd"]["bytes_written"], r
        assert r["written_out"]["aten_ops"] > 0 and r["written_out"]["seconds"] > 0


@pytest.mark.parametrize("argv, words", [(["--heads", "6", "--groups", "4"], "divide"),
                                         (["--seq-len", "0"], ">= 1")])
def test_bad_sizes_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        mb.main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
