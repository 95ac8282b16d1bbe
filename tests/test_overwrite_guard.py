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


def test_a_link_inside_the_source_pointing_elsewhere_is_refused(layout, capsys):
    """``DST`` = ``SRC/link`` -> outside: the writers replace the link where it stands (its temporary
    directory goes next to it), so the output would land inside the source."""
    elsewhere = layout / "elsewhere"
    elsewhere.mkdir()
    (layout / "p" / "src" / "link").symlink_to(elsewhere)
    before = _tree(layout)
    for argv in (["quantize", "{src}", "{dst}", "--experts", "none", "--mamba-proj", "none", "--overwrite"],
                 ["convert", "--from", "hf", "--to", "megatron", "{src}", "{dst}", "--overwrite"]):
        argv = [a.format(src=layout / "p" / "src", dst=layout / "p" / "src" / "link") for a in argv]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is a link at" in err and "would be written into the source" in err
        assert _tree(layout) == before


def test_replacing_a_link_destination_leaves_its_target_and_no_stray_link(layout, tiny_checkpoint):
    """``--overwrite`` on ``DST`` that is a link to another directory: the link is replaced by
    the new checkpoint, the link's target is left as it was, and no ``.DST.old-*`` link remains."""
    target = layout / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep me")
    dst = layout / "out"
    dst.symlink_to(target)
    assert main(["convert", "--from", "hf", "--to", "megatron", str(layout / "p" / "src"), str(dst),
                 "--overwrite"]) == 0
    assert not dst.is_symlink() and (dst / "metadata.json").is_file()
    assert _tree(target) == {"keep.txt": hashlib.sha256(b"keep me").hexdigest()}
    assert sorted(n for n in os.listdir(layout) if n.startswith(".out")) == []


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint("deepseek_v4_tiny", out_dir=tmp_path_factory.mktemp("ds") / "deepseek_v4_tiny")


@pytest.mark.parametrize("case", ["same", "parent", "inside", "symlink to the parent"])
def test_deepseek_quantize_refuses_a_destination_over_the_source(deepseek_checkpoint, tmp_path, case, capsys):
    p = tmp_path / "p"
    shutil.copytree(deepseek_checkpoint, p / "src")
    (tmp_path / "to_p").symlink_to(p)
    dst_rel, message = CASES[case]
    before = _tree(tmp_path)
    assert main(["quantize", str(p / "src"), str(tmp_path / dst_rel), "--overwrite"]) == 2
    assert message in capsys.readouterr().err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("save_rel, message", [("m", "are the same directory"), (".", "contains --model"),
                                               ("m/ckpt", "is inside --model")])
def test_rl_save_over_the_model_is_refused_before_anything_is_read(tmp_path, save_rel, message, capsys):
    """``rl --save`` writes ``iter_*`` directories and a tracker file: never into (or over) ``--model``.
    The model directory holds no checkpoint at all here: the refusal comes before any read."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    before = _tree(tmp_path)
    assert main(["rl", "--model", str(tmp_path / "m"), "--save", str(tmp_path / save_rel),
                 "--metrics", str(tmp_path / "out" / "m.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and "--save" in err
    assert _tree(tmp_path) == before
