"""``benchmarks/trainer_cost.py`` on the CPU at tiny sizes: our trainer and Megatron's own GPTModel both
run an optimizer step on ``nemotron_h_tiny``, with equal parameter counts (the widths match), and the
report has its schema. Values only, no timing assertions (performance lives in benchmarks/). The vLLM
native prefill side is left out here (its CPU engine start alone takes about a minute)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trainer_cost", ROOT / "benchmarks" / "trainer_cost.py")
tc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tc)

TINY = ["--device", "cpu", "--sequences", "2", "--seq-len", "32", "--micro-batch-tokens", "32", "--repeats", "1",
        "--in-process"]


def test_ours_and_megatron_gpt_step_on_the_tiny_preset(tmp_path, monkeypatch):
    monkeypatch.delenv("UM_BACKWARD_GEMM", raising=False)
    out = tmp_path / "tc.json"
    report = tc.run(tc.parse_args(["--preset", "nemotron_h_tiny", "--sides", "ours,megatron", "--json", str(out),
                                   *TINY]))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert {"recompute", "step", "sides", "settings", "tokens_per_step", "versions"} <= set(report)
    assert report["tokens_per_step"] == 2 * 32 and set(report["sides"]) == {"ours", "megatron"}
    ours, meg = report["sides"]["ours"], report["sides"]["megatron"]
    assert ours["error"] is None and meg["error"] is None, (ours.get("traceback"), meg.get("traceback"))
    assert ours["micro_batches"] == 2 and meg["micro_batch_sequences"] == 1  # 32-token micro-batches: one sequence
    for rec in (ours["recompute"], ours["backbone"], ours["step"], meg["step"]):
        assert rec["tok_s"] > 0
    for side in (ours, meg):
        st = side["step"]
        assert math.isfinite(st["loss"]) and 9.0 < st["loss"] < 12.0  # ~ln(32064) for random weights
        assert math.isfinite(st["grad_norm"]) and st["grad_norm"] > 0 and st["update_successful"] is True
        assert set(st["median_s"]) == set(tc.STEP_PHASES)
        assert all(st["median_s"][p] > 0 for p in ("forward", "backward", "optimizer"))
        assert side["optimizer_backend"] == "torch_adamw"  # the CPU path of build_optimizer, both sides
    assert meg["model_class"] == "megatron.core.models.gpt.GPTModel" and meg["megatron_layers"] == 3
    assert meg["parameters"] == ours["parameters"] == 18_581_248  # same widths: 3 x (attention + MLP) layers
    assert report["step"]["same_parameter_count"] is True
    assert report["step"]["ratio_tok_s_ours_over_megatron"] > 0
    assert report["recompute"]["native_prefill_tok_s"] is None  # native not run
    assert report["settings"]["backward_gemm"] == "split"  # the default mode, recorded
    assert isinstance(report["settings"]["fused_attention_backward"], bool)
    table = tc.format_table(report)
    assert "GPTModel (18,581,248 params)" in table and "| backward |" in table and "| not run |" in table


def test_megatron_mamba_model_failure_is_recorded(tmp_path):
    report = tc.run(tc.parse_args(["--preset", "nemotron_h_hybrid_tiny", "--sides", "megatron",
                                   "--json", str(tmp_path / "h.json"), *TINY]))
    meg = report["sides"]["megatron"]
    assert meg["model_class"] == "megatron.core.models.mamba.MambaModel"
    assert set(meg["packages_importable"]) == set(tc.BLOCKER_PACKAGES)
    if meg["packages_importable"]["mamba_ssm"]:
        pytest.skip("mamba_ssm is installed: Megatron's MambaModel may build")
    assert meg["error"].startswith("ImportError: MambaSSM is not installed") and "Traceback" in meg["traceback"]
    assert f"error: {meg['error']}" in tc.format_table(report)


def test_mamba_ssm_without_cuda_extensions_imports_its_submodules(tmp_path, monkeypatch):
    """A stand-in ``mamba_ssm`` whose ``__init__`` fails like the pure-Python wheel's (it imports the
    Mamba-1 CUDA extension): its Triton submodules still import, and its ``__init__`` never runs."""
    import sys

    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import selective_scan_cuda\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text("def mamba_chunk_scan_combined():\n    return 42\n")
    (tmp_path / "mamba_ssm-9.9.dist-info").mkdir()
    (tmp_path / "mamba_ssm-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mamba_ssm\nVersion: 9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "megatron.core.ssm.mamba_mixer", object())  # imported too early:
    with pytest.raises(RuntimeError, match="imported before mamba_ssm"):
        tc.import_mamba_ssm_triton_only()
    monkeypatch.delitem(sys.modules, "megatron.core.ssm.mamba_mixer")
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match="selective_scan_cuda"):
        importlib.import_module("mamba_ssm")
    monkeypatch.delitem(sys.modules, "mamba_ssm", raising=False)
    assert tc.import_mamba_ssm_triton_only() == "mamba_ssm 9.9 (Triton kernels only)"
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    assert mamba_chunk_scan_combined() == 42
    assert importlib.util.find_spec("mamba_ssm") is not None  # what the report's package check calls
    assert tc.import_mamba_ssm_triton_only() == "mamba_ssm 9.9 (Triton kernels only)"  # registered already
    # a full build (its CUDA extension imports) is left to import as it is
    del sys.modules["mamba_ssm"]
    (tmp_path / "selective_scan_cuda.py").write_text("")
    assert tc.import_mamba_ssm_triton_only() == "mamba_ssm 9.9" and "mamba_ssm" not in sys.modules
    # an extension that fails to load (built against another torch) counts as absent
    (tmp_path / "selective_scan_cuda.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    del sys.modules["selective_scan_cuda"]
    assert tc.import_mamba_ssm_triton_only() == "mamba_ssm 9.9 (Triton kernels only)"
    # no package metadata (a source tree on the path): the version is unknown, not an error
    del sys.modules["mamba_ssm"]
    import shutil

    shutil.rmtree(tmp_path / "mamba_ssm-9.9.dist-info")
    assert tc.import_mamba_ssm_triton_only() == "mamba_ssm ? (Triton kernels only)"
    for name in [m for m in sys.modules if m in ("mamba_ssm", "selective_scan_cuda") or m.startswith("mamba_ssm.")]:
        del sys.modules[name]


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "64", "--micro-batch-tokens", "32"], "a micro-batch holds whole sequences"),
    (["--sides", "ours,trainer"], "--sides"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--preset", "no_such_preset"], "unknown preset"),
])
def test_bad_command_lines_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tc.parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_profile_breaks_the_backward_down_by_autograd_node(tmp_path):
    report = tc.run(tc.parse_args(["--preset", "nemotron_h_hybrid_tiny", "--sides", "ours", "--profile",
                                   "--json", str(tmp_path / "p.json"), *TINY]))
    prof = report["sides"]["ours"]["profile"]["step"]
    nodes = {x["node"]: x for x in prof["backward_nodes"]}
    # every layer kind of the hybrid has its node; the MoE experts' node runs ATen ops, on the CPU host time
    assert {"ExpertsFnBackward", "PagedAttentionFnBackward", "LinearFnBackward", "RMSNormFnBackward"} <= set(nodes)
    assert nodes["ExpertsFnBackward"]["ops"] > 0 and nodes["ExpertsFnBackward"]["cpu_ms"] > 0
    assert [x["cpu_ms"] for x in prof["backward_nodes"]] == sorted((x["cpu_ms"] for x in prof["backward_nodes"]),
                                                                   reverse=True)
    assert prof["top"] and {"name", "self_ms", "calls"} <= set(prof["top"][0])
    assert "| ExpertsFnBackward |" in tc.format_table(report)
