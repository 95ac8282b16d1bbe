"""``benchmarks/mamba_prefill.py``'s command line: batches and launch candidates are parsed into the
values the kernels take, and bad ones are refused with a message naming the flag's value (the
benchmark itself needs the GPU to mean anything; its interpreter run takes minutes, so CI runs only
this)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec_ = importlib.util.spec_from_file_location("mamba_prefill", ROOT / "benchmarks" / "mamba_prefill.py")
mp = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(mp)


def test_batches_and_launches_parse():
    assert mp.parse_batch("8x2048") == (8, 2048)
    assert mp.parse_batch("64X256") == (64, 256)
    assert mp.parse_launch("64:4:1", "block_l") == {"block_l": 64, "num_warps": 4, "num_stages": 1}
    assert mp.parse_launch("32:8:2", "block_p") == {"block_p": 32, "num_warps": 8, "num_stages": 2}


@pytest.mark.parametrize("text, words", [("8x", "not SxL"), ("0x16", ">= 1"), ("8by16", "not SxL")])
def test_bad_batch_is_named(text, words):
    with pytest.raises(ValueError, match=words) as e:
        mp.parse_batch(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text, words", [("48:4:1", "power of two"), ("64:3:1", "warps"), ("64:4:0", "stages"),
                                         ("64:4", "three integers")])
def test_bad_launch_is_named(text, words, capsys):
    with pytest.raises(ValueError, match=words):
        mp.parse_launch(text, "block_l")
    with pytest.raises(SystemExit) as e:  # through argparse: exit 2 with the value in the message
        mp.main(["--scan-candidates", text])
    assert e.value.code == 2 and repr(text) in capsys.readouterr().err
