#!/usr/bin/env bash
# Builds mamba_ssm as a pure-Python wheel (its Triton kernels, none of its CUDA extensions) into .whl/,
# for Megatron-core's MambaModel in `scripts/gpu-run.sh trainer-cost` (issue 18 item 5's hybrid baseline).
# The H200 image has no mamba_ssm and no compiler for its CUDA extensions; Megatron's MambaMixer
# (use_mamba_mem_eff_path=False) needs only mamba_chunk_scan_combined and the gated RMSNorm, both Triton.
# Run here (not on the device), once: bash scripts/mamba-ssm-wheel.sh [PYTHON]; then carry ".whl" in the
# device call. .whl/ is git-ignored through .git/info/exclude (the line is added if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
version=${MAMBA_SSM_VERSION:-2.3.2.post1}
export MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE  # metadata and wheel: no CUDA build, no prebuilt download
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "mamba-ssm==$version" -d "$tmp"
tar -xzf "$tmp"/mamba_ssm-*.tar.gz -C "$tmp"
"$py" -m pip wheel -q --no-deps --no-build-isolation \
  "$tmp"/mamba_ssm-"$version" -w .whl
ls -l .whl/mamba_ssm-*.whl
