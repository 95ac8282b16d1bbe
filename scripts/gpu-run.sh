#!/usr/bin/env bash
# On the H200 (after `.gpu/install.sh a|b|c`): install the project and run one
# stage, logging under $OUT.   usage: scripts/gpu-run.sh ops|check|train|rl|bench|all
# rl: UM_RL_STEPS (default 100) and extra flags in UM_RL_ARGS (e.g. "--lr 1e-6").
set -uo pipefail
source .gpu/env.sh
OUT=${OUT:-/tmp/um-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, vllm, megatron.core, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
export UM_GPU_OUT=$OUT
stage=${1:-all}
rc=0
if [ "$stage" = ops ] || [ "$stage" = all ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_ops_gpu.py 2>&1 | tee "$OUT/ops.log" | tail -25; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = check ] || [ "$stage" = all ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_check_gpu.py -s 2>&1 | tee "$OUT/check.log" | grep -vE "INFO|WARNING|warn" | tail -40; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = train ] || [ "$stage" = all ]; then
  # CUDA gradients, Megatron's DDP + optimizer + dist-ckpt save/resume, in-place sync into vLLM
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_autograd_gpu.py tests/backends/test_training_checkpoint.py \
    tests/backends/test_weight_sync.py tests/backends/test_megatron_grad.py 2>&1 | tee "$OUT/train.log" | tail -5
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = rl ] || [ "$stage" = all ]; then
  unified-models rl --preset nemotron_h_wide --reward target-token --steps "${UM_RL_STEPS:-100}" \
    --num-prompts-per-step 8 --group-size 8 --max-new-tokens 128 --device cuda \
    --metrics "$OUT/rl_wide/metrics.jsonl" ${UM_RL_ARGS:-} > "$OUT/rl_wide.log" 2>&1; rc=$((rc | $?))
  tail -22 "$OUT/rl_wide.log"
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  python3 benchmarks/rollout_throughput.py --preset nemotron_h_wide --num-prompts 64 --max-new-tokens 128 \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1; rc=$((rc | $?)); tail -40 "$OUT/bench.log" | grep -vE "INFO|WARNING"
fi
exit $rc
