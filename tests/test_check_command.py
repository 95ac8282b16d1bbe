"""`unified-models check` and `convert` end to end through the CLI entry point (CPU)."""

import filecmp
import json

from unified_models.cli import main


def test_check_writes_the_report_and_exits_0(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "report.json"
    status = main(["check", "--model", str(tiny_checkpoint), "--num-prompts", "3", "--max-new-tokens", "8",
                   "--seed", "7", "--max-num-seqs", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    assert status == 0 and r["passed"] is True
    assert r["tokens_compared"] == 24 and r["full_vocab_rows"] == 24
    for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "full_vocab_max_abs_diff"):
        assert r[k] == 0.0
    assert r["num_mismatched"] == 0
    peer = r["peer"]
    assert peer["within_tolerance"] and 0 < peer["max_abs_logit_diff"] < 1e-4
    assert 0 < peer["max_rel_logit_diff"] < 1e-5 and peer["tolerance"] == 2.0 ** -13  # relative to the logit scale
    assert peer["bound"] == peer["tolerance"] * peer["logit_scale"] and peer["logit_scale"] > 0
    assert r["options"]["seed"] == 7 and r["options"]["max_num_seqs"] == 2
    table = capsys.readouterr().out
    assert "tokens_compared" in table and "PASS" in table


def test_check_fails_when_the_peer_is_out_of_tolerance(tiny_checkpoint, tmp_path):
    """A peer tolerance below the measured fp32 difference must fail the check (exit 1)."""
    out = tmp_path / "report.json"
    status = main(["check", "--model", str(tiny_checkpoint), "--num-prompts", "1", "--max-new-tokens", "2",
                   "--peer-tolerance", "1e-12", "--json", str(out)])
    r = json.loads(out.read_text())
    assert status == 1 and r["passed"] is False and not r["peer"]["within_tolerance"]
    assert r["max_abs_diff"] == 0.0  # the engines still agree bitwise


def test_convert_round_trip_is_byte_identical(tiny_checkpoint, tmp_path):
    mg, back = tmp_path / "megatron", tmp_path / "hf"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(tiny_checkpoint), str(mg)]) == 0
    assert (mg / "metadata.json").is_file()
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(back)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert filecmp.cmp(tiny_checkpoint / name, back / name, shallow=False), name
    # a non-empty destination is refused unless --overwrite
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(back)]) == 2
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(back), "--overwrite"]) == 0
