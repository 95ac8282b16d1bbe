"""`check` on the tiny preset gives the same report, bit for bit, whatever the host BLAS does.

Each run is a fresh process (OpenBLAS reads ``OPENBLAS_CORETYPE`` and its
thread count once, at load), under an older kernel family (Prescott) and an
AVX2 one (Haswell, when the CPU has AVX2), with 1 and 2 threads. The reports
must agree on every field except the wall-clock timings, including the SHA-256
of every sampled token and the bits of its logprob (issue 5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _blas_settings() -> list[dict[str, str]]:
    settings = [{"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}]
    if _has_avx2():
        settings.append({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"})
    else:  # still vary the threads; the AVX2 family cannot run on this CPU
        settings.append({"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"})
    return settings


def _run_check(tiny_checkpoint: Path, out: Path, env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, "-m", "unified_models.cli", "check", "--model", str(tiny_checkpoint),
           "--num-prompts", "4", "--max-new-tokens", "24", "--max-num-seqs", "3", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"check under {env_extra} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    report.pop("timings_s")
    return report


@pytest.mark.slow
def test_check_report_is_independent_of_blas_core_type_and_threads(tiny_checkpoint, tmp_path):
    reports = [_run_check(tiny_checkpoint, tmp_path / f"r{i}.json", s) for i, s in enumerate(_blas_settings())]
    first = reports[0]
    assert first["passed"] and first["tokens_compared"] == 4 * 24
    assert len(first["rollout_sha256"]) == 64
    for settings, other in zip(_blas_settings()[1:], reports[1:]):
        assert other == first, f"report under {settings} differs from the one under {_blas_settings()[0]}"
