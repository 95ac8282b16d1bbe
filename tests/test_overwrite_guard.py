"""Issue 21: ``quantize`` / ``convert ... --overwrite`` must never delete or write into the source.

A destination equal to the source, above it, or inside it (also through a symlink) is
refused before anything is written, and the source tree survives byte for byte."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from unified_models.cli import main
from unified_models.dsl import UnifiedModelsError
from unified_models.paths import check_destination


def _tree(root):
    """``{relative path: sha256}`` of every file under ``root`` (symlinks not followed), plus its directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            out[os.path.relpath(os.path.join(dirpath, n), root) + "/"] = "dir"
        for n in filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = "link" if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def layout(tiny_checkpoint, tmp_path):
    """``tmp/p/src`` (a checkpoint), ``tmp/p/other`` (a bystander file), ``tmp/to_src`` -> p/src,
    ``tmp/to_p`` -> p."""
    p = tmp_path / "p"
    shutil.copytree(tiny_checkpoint, p / "src")
    (p / "other").write_text("keep me")
    (tmp_path / "to_src").symlink_to(p / "src")
    (tmp_path / "to_p").symlink_to(p)
    return tmp_path


CASES = {
    "same": ("p/src", "are the same directory"),
    "parent": ("p", "contains SRC"),
    "inside": ("p/src/out", "is inside SRC"),
    "symlink to the source": ("to_src", "are the same directory"),
    "symlink to the parent": ("to_p", "contains SRC"),
}

COMMANDS = {
    "quantize": ["quantize", "{src}", "{dst}", "--experts", "none", "--mamba-proj", "none", "--overwrite"],
    "convert": ["convert", "--from", "hf", "--to", "megatron", "{src}", "{dst}", "--overwrite"],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", COMMANDS)
def test_overwrite_refuses_a_destination_over_the_source(layout, command, case, capsys):
    dst_rel, message = CASES[case]
    before = _tree(layout)
    argv = [a.format(src=layout / "p" / "src", dst=layout / dst_rel) for a in COMMANDS[command]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"DST {layout / dst_rel} and SRC {layout / 'p' / 'src'}" in err and message in err
    assert _tree(layout) == before  # nothing deleted, nothing written (no temporary directory either)


def test_megatron_to_hf_refuses_the_parent_of_its_source(layout, capsys):
    mg = layout / "p" / "mg"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(layout / "p" / "src"), str(mg)]) == 0
    before = _tree(layout)
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(layout / "p"), "--overwrite"]) == 2
    assert "contains SRC" in capsys.readouterr().err
    assert _tree(layout) == before and (mg / "metadata.json").is_file()


def test_distinct_destinations_are_accepted(tmp_path):
    (tmp_path / "src").mkdir()
    for ok in ("src2", "out", "src_out/x", "../elsewhere"):  # a shared name prefix is not containment
        check_destination(tmp_path / "src", tmp_path / ok)
    with pytest.raises(UnifiedModelsError, match=r"is inside SRC"):
        check_destination(tmp_path / "src", tmp_path / "src" / ".." / "src" / "deeper")
