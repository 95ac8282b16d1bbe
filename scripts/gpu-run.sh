#!/usr/bin/env bash
# On the H200 (after `.gpu/install.sh a|b|c`): install the project and run one
# stage, logging under $OUT.   usage: scripts/gpu-run.sh ops|check|train|rl|bench|all
#   or: scripts/gpu-run.sh hybrid|hybrid-peer|hybrid-check|hybrid-bench   (issue 7; not part of `all`)
#   or: scripts/gpu-run.sh perf-ops|graphs|dense-bench|dense-bench-interleave|sync-audit|host-diag   (issue 8; not part of `all`)
#   or: scripts/gpu-run.sh moe-kernels|hybrid-profile   (issue 18 item 3; not part of `all`)
# moe-kernels: the MoE op tests natively (NVFP4 tiles == ModelOpt's dequantized bf16, bitwise) + benchmarks/moe_kernels.py
#   (ours vs vLLM's fused_experts per token count, launch candidates with their bits; ~3 min). hybrid-profile:
#   benchmarks/rollout_throughput.py --profile on nemotron_3_nano_reduced 128x2048/128 (prefill-bound), both engines,
#   top CUDA kernels of a 2-token run (UM_PROFILE_PRESET / UM_PROFILE_WORKLOAD / UM_PROFILE_MAX_TOKENS override; ours
#   with prefix caching off like native, as the bar runs: UM_PROFILE_ARGS replaces that; ~6 min; the outputs are
#   tarred into profile.tgz, as the device returns only a few files). First (UM_PROFILE_SYNC=0 skips it) a sync audit
#   of ours on 16 x 2048-token prompts, 4 tokens (benchmarks/sync_audit.py: every call that waits for the GPU).
#   or: scripts/gpu-run.sh hybrid-smoke   (issue 18; not part of `all`)
# hybrid-smoke: the MoE and Mamba-2 op tests natively, `check` on nemotron_h_hybrid_tiny with CUDA graphs, and a sync
#   audit of ours on 16 x 2048-token prompts of it (every call that waits for the GPU in prefill steps; ~4 min;
#   UM_SMOKE_SYNC=0 skips the audit).
#   or: scripts/gpu-run.sh norm-kernels   (issue 18 item 3; not part of `all`)
# norm-kernels: tests/ops/test_rmsnorm.py natively (the fused residual add + RMSNorm == the add then the norm, bit for
#   bit, at D = 64/200/2688) + benchmarks/residual_norm.py (fused vs add + norm vs vLLM's fused_add_rms_norm at D =
#   2688/4096/7168, T = 1/64/256/8192, CUDA-graph timing; fails on any bit difference); JSON $OUT/residual_norm.json (~1 min).
#   or: scripts/gpu-run.sh mamba-backward   (issue 18 item 5; not part of `all`)
# mamba-backward: tests/ops/test_mamba2.py's gradient tests natively + benchmarks/mamba_backward.py: one Mamba-2 layer's
#   scan and conv backward at the nemotron_3_nano_reduced widths over 16 x 1,024 tokens, written out (the scan's
#   intra-chunk part in the fused Triton kernels, the rest tensor-core GEMMs), the scan's GEMM-only form (session 34)
#   and autograd of the recomputation (before session 34): time, ATen ops, bytes; JSON $OUT/mamba_backward.json;
#   first the gradient tests natively, with tests/ops/test_ssd_intra_grads.py (on CUDA tensors where they take them).
#   or: scripts/gpu-run.sh deepseek-v4|deepseek-v4-ops|deepseek-v4-check|deepseek-v4-bench   (issue 18 item 4; not part of `all`)
#   or: scripts/gpu-run.sh decode-chunk   (issue 18 item 3; not part of `all`)
# decode-chunk: benchmarks/decode_chunk_position.py: one Mamba-2 decode step of one layer at the
#   nemotron_3_nano_reduced widths, chunk 128 and 256 (one process), B = 64 and 256, in-chunk positions
#   0 1 Q/4 Q/2 3Q/4 Q-1, ours (decode-as-chunk) vs vLLM's selective_state_update + causal_conv1d_update,
#   CUDA-graph timing, JSON $OUT/decode_chunk_position_h200.json; a bitwise guard (decode step == general
#   chunked scan) at every position fails the stage (timeout 170 s). UM_DCP_ARGS adds flags (e.g. "--batch 8 64 256").
#   or: scripts/gpu-run.sh mamba-prefill   (issue 18 item 3; not part of `all`)
# mamba-prefill: benchmarks/mamba_prefill.py: one Mamba-2 layer's prefill (conv + dt + SSD) at the nemotron_3_nano_reduced
#   widths, 8x2048 and 64x256 tokens, ours vs vLLM's causal_conv1d_fn + mamba_chunk_scan_combined_varlen; UM_MP_ARGS adds
#   flags (e.g. "--scan-candidates 64:4:2 --state-candidates 64:4:2 32:4:2": each compared bit for bit with the current
#   launch); JSON $OUT/mamba_prefill.json (~2 min).
#   or: scripts/gpu-run.sh nano-interleave   (issue 18's bar; not part of `all`)
# nano-interleave: benchmarks/rollout_throughput.py --interleave on UM_BENCH_PRESET (default nemotron_3_nano_reduced;
#   nemotron_3_nano_reduced_nvfp4 for the ModelOpt export), 256x128/512 64x256/2048 128x2048/128, UM_BENCH_REPEATS
#   (default 2: with cold compile caches the engine starts take ~260 s and 3 repeats ran past 580 s; on a machine
#   whose caches an earlier call warmed, UM_BENCH_REPEATS=3 fits) timed repeats per engine alternating, host ms per
#   step by phase; JSON $OUT/<preset>_interleaved.json (~6-8 min with the checkpoint build). Ours runs prefix caching off like native (UM_BENCH_ARGS replaces that
#   default: UM_BENCH_ARGS="" runs ours with the `check` setting, prefix caching on; session 29 measured its cost).
#   UM_BENCH_CPUS=0-7 pins both engine workers to the same CPUs (--engine-cpus; default: no pinning).
#   or: scripts/gpu-run.sh graph-soak   (issue 18 item 2; not part of `all`)
# graph-soak: tests/gpu/test_graph_soak_gpu.py on nemotron_3_nano_reduced: 48 requests x 64 tokens (own seeds,
#   logprobs=1) in 11 batch compositions over 3 engines with CUDA graphs on (FULL_DECODE_ONLY; max_num_seqs 32 with
#   prefix caching + a shared one-block prefix, 64, and 13 with a 256-token step budget); every request's tokens and
#   logprob bits must be equal in all of them, and every decode step must have replayed a graph. Report
#   $OUT/graph_soak_<preset>.json (settings, capture sizes, schedule, replays, differences); ~5 min with the checkpoint
#   build. UM_SOAK_K (pytest -k, default "not nvfp4") picks the preset: UM_SOAK_K=nvfp4 for the ModelOpt export.
#   or: scripts/gpu-run.sh trainer-cost   (issue 18 item 5; not part of `all`)
# trainer-cost: benchmarks/trainer_cost.py on nemotron_3_nano_reduced (hybrid: Megatron's MambaModel is recorded as
#   not buildable without mamba_ssm) and nemotron_h_dense_bench (Megatron's GPTModel, local layers): our recompute vs
#   vLLM's native prefill, one optimizer step (64 x 1024 tokens) of ours vs Megatron's own model, per phase (~7 min).
#   UM_TC_ARGS adds flags (e.g. "--profile", "--repeats 5"), UM_TC_PRESETS narrows the presets; JSON per preset in $OUT, side logs in trainer_cost_logs.tgz.
#   First tests/gpu/test_autograd_gpu.py (the CUDA backward's gradients vs fp64 autograd; $OUT/autograd_gpu.log;
#   UM_TC_GRADCHECK=0 skips it; it includes the fused attention backward's determinism test and two identical
#   trainer backwards' bits), the batched MoE backward's and mHC's analytic backward's tests natively.
#   UM_FUSED_ATTENTION_BACKWARD=0 times the fp32 attention recompute instead of the fused one (ops/attention/causal_grads.py).
#   UM_BACKWARD_GEMM=bf16 times our backward with fp32 GEMM operands rounded to bf16 (Megatron-core's precision) instead
#   of split into hi + lo (the default); the JSON's settings record both choices.
#   Megatron's MambaModel (the hybrid baseline) needs mamba_ssm: `bash scripts/mamba-ssm-wheel.sh` here once, then
#   carry ".whl" in the device call (installed into /tmp/um-whl there); without it the row records the ImportError.
# deepseek-v4-ops: tests/gpu/test_deepseek_gpu.py -k wide (window + compressed attention at head dim 512 x 64 heads)
#   and the DeepSeek-V4 kernels' tests/ops natively (compressor, indexer, compressed attention, sink, mHC, DeepSeek
#   MoE, block FP8), then the sliding + CSA + HCA toy through both engines (vLLM 0.26's grouping). deepseek-v4-check:
#   `check` on deepseek_v4_flash_reduced (bf16) and deepseek_v4_flash_reduced_fp8, then with prefix caching + forced
#   chunked prefill; UM_DSV4_PROMPTS x UM_DSV4_NEW_TOKENS (default 64 x 256), UM_DSV4_K (pytest -k) narrows it.
#   deepseek-v4-bench: benchmarks/rollout_throughput.py on UM_DSV4_PRESET (default deepseek_v4_flash_reduced_fp8: block-FP8
#   weights and FP8 KV cache on both sides; vLLM 0.26's native DeepSeek-V4 refuses a bf16 KV cache), ours vs native.
#   or: scripts/gpu-run.sh deepseek-experts   (issue 18 item 4; not part of `all`)
# deepseek-experts: tests/ops/test_fp8_block_experts.py natively (block-FP8 tiles decoded in the K loop == the stack
#   dequantized once, bit for bit) + benchmarks/deepseek_experts.py: the routed experts of deepseek_v4_flash_reduced_fp8
#   at T = 1 8 64 256 2048, in-loop vs once vs bf16-resident vs vLLM's block-FP8 fused_experts; JSON
#   $OUT/deepseek_experts.json (~2 min).
# perf-ops: GPU op tests (attention splits, graph replay, hybrid ops) + benchmarks/gemm_configs.py
#   + benchmarks/attention_decode.py (~5 min). sync-audit: benchmarks/sync_audit.py, ours and native (~2.5 min).
# graphs: tests/gpu/test_check_gpu.py: `check` with CUDA graphs on the wide and dense-bench presets,
#   graphs off, graph replay == eager (~6 min). dense-bench: benchmarks/rollout_throughput.py on
#   nemotron_h_dense_bench, the three issue-8 workloads, ours vs native alternating twice, best of 2x2, host ms per
#   engine step by phase (~7 min; UM_BENCH_ARGS=--profile adds the torch/cProfile profiles). dense-bench-interleave:
#   the same with both engines alive at once, each timed repeat on one then the other (~4-5 min). host-diag:
#   256x128/512, native + ours and ours with prefix caching off / block size 1024, step timing (~5 min).
# rl: UM_RL_STEPS (default 100) and extra flags in UM_RL_ARGS (e.g. "--lr 1e-6").
# hybrid: tests/gpu/test_hybrid_gpu.py = hybrid-peer (peer vs vLLM's native NemotronHForCausalLM,
#   ~4-5 min) + hybrid-check (`check` on nemotron_3_nano_reduced, 64 x 256, default and with prefix
#   caching + forced chunked prefill, ~5-6 min). hybrid-bench: benchmarks/rollout_throughput.py on
#   nemotron_3_nano_reduced, 256x128/512 and 64x256/2048, ours vs native (~5-6 min). Each builds the
#   3.45B preset checkpoint first if it is not cached (~1 min on the CPU).
set -uo pipefail
source .gpu/env.sh
OUT=${OUT:-/tmp/um-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, vllm, megatron.core, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" > "$OUT/versions.txt" 2>&1 \
  || { tail -2 "$OUT/versions.txt"; echo "gpu-run.sh: the staged packages do not import on this machine: run bash .gpu/install.sh a, b, c" \
       "here first (a device call that was refused, or a machine that went back in between, leaves a part out)"; exit 3; }
tail -1 "$OUT/versions.txt" | tee -a "$OUT/gpu.txt"
export UM_GPU_OUT=$OUT
# presets are built once per machine in the repo copy (git-ignored, kept between device calls)
export UNIFIED_MODELS_CACHE=${UNIFIED_MODELS_CACHE:-$PWD/.um-cache}
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
nano_checkpoint() {  # build (once, cached under $UNIFIED_MODELS_CACHE) and time the Nano-widths presets
  for preset in "$@"; do
    python3 -c "import time; t=time.perf_counter(); from unified_models.presets import build_preset_checkpoint as b; \
p=b('$preset'); print('checkpoint', p, f'ready in {time.perf_counter()-t:.1f} s')" 2>&1 | tail -1 | tee -a "$OUT/nano_checkpoint.log"
  done
}
if [ "$stage" = hybrid ] || [ "$stage" = hybrid-peer ] || [ "$stage" = hybrid-check ]; then
  nano_checkpoint nemotron_3_nano_reduced nemotron_3_nano_reduced_nvfp4
  sel=(); [ "$stage" = hybrid-peer ] && sel=(-k peer); [ "$stage" = hybrid-check ] && sel=(-k check)
  python3 -m pytest -q -m gpu tests/gpu/test_hybrid_gpu.py -s -p no:cacheprovider ${sel[@]+"${sel[@]}"} 2>&1 | tee "$OUT/$stage.log" \
    | grep -vE "INFO|WARNING|warn|Loading|it/s\]" | tail -60; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = hybrid-bench ]; then
  nano_checkpoint nemotron_3_nano_reduced
  python3 benchmarks/rollout_throughput.py --preset nemotron_3_nano_reduced --workloads 256x128/512 64x256/2048 \
    --engine-timeout-s 280 --json "$OUT/rollout_throughput.json" > "$OUT/hybrid_bench.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING" "$OUT/hybrid_bench.log" | tail -20
fi
if [ "$stage" = perf-ops ]; then
  timeout 420 python3 -m pytest -q -m gpu tests/gpu/test_ops_gpu.py tests/gpu/test_hybrid_ops_gpu.py -p no:cacheprovider \
    2>&1 | tee "$OUT/perf_ops.log" | grep -vE "DEBUG" | tail -30; rc=$((rc | ${PIPESTATUS[0]}))
  timeout 200 python3 benchmarks/gemm_configs.py --json "$OUT/gemm_configs.json" 2>&1 | tee "$OUT/gemm_configs.log" | tail -25
  timeout 200 python3 benchmarks/attention_decode.py --json "$OUT/attention_decode.json" 2>&1 | tee "$OUT/attention_decode.log" | tail -8
fi
if [ "$stage" = sync-audit ]; then  # synchronizing calls in a rollout's steps, ours and native
  for engine in ours native; do
    python3 benchmarks/sync_audit.py --engine $engine --json "$OUT/sync_$engine.json" > "$OUT/sync_$engine.log" 2>&1
    grep -vE "INFO|WARNING" "$OUT/sync_$engine.log" | tail -30
  done
fi
if [ "$stage" = graphs ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_check_gpu.py -s -p no:cacheprovider 2>&1 | tee "$OUT/graphs.log" \
    | grep -vE "INFO|WARNING|warn|DEBUG|it/s\]" | tail -60; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = dense-bench ]; then
  nano_checkpoint nemotron_h_dense_bench
  python3 benchmarks/rollout_throughput.py --preset nemotron_h_dense_bench --workloads 256x128/512 128x2048/128 64x256/2048 \
    --rounds 2 --repeats 2 --step-timing ${UM_BENCH_ARGS:-} --engine-timeout-s 400 --json "$OUT/rollout_throughput.json" \
    > "$OUT/dense_bench.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING|DEBUG" "$OUT/dense_bench.log" | tail -20
fi
if [ "$stage" = dense-bench-interleave ]; then  # both engines alive, repeats alternate (benchmark docstring)
  nano_checkpoint nemotron_h_dense_bench
  python3 benchmarks/rollout_throughput.py --preset nemotron_h_dense_bench --workloads 256x128/512 128x2048/128 64x256/2048 \
    --interleave --repeats ${UM_BENCH_REPEATS:-3} --step-timing ${UM_BENCH_ARGS:-} --engine-timeout-s 400 \
    --json "$OUT/rollout_throughput_interleaved.json" > "$OUT/dense_bench_interleaved.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING|DEBUG" "$OUT/dense_bench_interleaved.log" | tail -20
fi
if [ "$stage" = nano-interleave ]; then  # issue 18's bar: the three workloads, both engines alive, repeats alternate
  p=${UM_BENCH_PRESET:-nemotron_3_nano_reduced}; nano_checkpoint "$p"
  # like for like by default: native Nemotron-H runs prefix caching off (vLLM's default for it), so ours does too
  python3 benchmarks/rollout_throughput.py --preset "$p" --workloads 256x128/512 64x256/2048 128x2048/128 \
    --interleave --repeats ${UM_BENCH_REPEATS:-2} --step-timing ${UM_BENCH_ARGS---ours-prefix-caching off} \
    ${UM_BENCH_CPUS:+--engine-cpus $UM_BENCH_CPUS} \
    --engine-timeout-s 560 \
    --json "$OUT/${p}_interleaved.json" > "$OUT/${p}_interleaved.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING|DEBUG" "$OUT/${p}_interleaved.log" | tail -24
fi
if [ "$stage" = host-diag ]; then  # 256x128/512, step timing: both engines, then ours with prefix caching off and
  # with block size 1024; UM_DIAG_ARGS="--engines ours --profile" runs that instead, with a chrome trace
  nano_checkpoint nemotron_h_dense_bench
  d="$OUT/host_diag"; mkdir -p "$d"
  bench() { name=$1; shift; python3 benchmarks/rollout_throughput.py --preset nemotron_h_dense_bench \
      --workloads 256x128/512 --repeats 2 --engine-timeout-s 250 --json "$d/$name.json" "$@" > "$d/$name.log" 2>&1
    rc=$((rc | $?)); grep -vE "INFO|WARNING|DEBUG" "$d/$name.log" | grep -E "tok/s|ours/native|^256|start" | tail -4; }
  if [ -n "${UM_DIAG_ARGS:-}" ]; then UM_PROFILE_TRACE=1 bench custom $UM_DIAG_ARGS; else
    bench both --step-timing
    bench ours_prefix_off --engines ours --ours-prefix-caching off --step-timing
    bench ours_block1024 --engines ours --ours-block-size 1024 --step-timing
  fi
  tar -czf "$OUT/host_diag.tgz" -C "$d" . && rm -rf "$d"  # one file: the device returns only a few
fi
if [ "$stage" = deepseek-v4 ] || [ "$stage" = deepseek-v4-ops ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_deepseek_gpu.py -k wide -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/dsv4_wide_attention.log" | grep -vE "DEBUG" | tail -12; rc=$((rc | ${PIPESTATUS[0]}))
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/ops/test_compressor.py tests/ops/test_indexer.py \
    tests/ops/test_attention_compressed.py tests/ops/test_attention_sink.py tests/ops/test_mhc.py \
    tests/ops/test_deepseek_moe.py tests/ops/test_fp8_block.py tests/ops/test_fp8_block_kv.py \
    tests/ops/test_fp8_block_experts.py 2>&1 | tee "$OUT/dsv4_ops.log" | grep -vE "DEBUG" | tail -15
  rc=$((rc | ${PIPESTATUS[0]}))
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_deepseek_compressed_attention.py -k "engines or prefix" \
    2>&1 | tee "$OUT/dsv4_toy_engines.log" | grep -vE "INFO|WARNING|DEBUG" | tail -15; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = deepseek-experts ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_fp8_block_experts.py 2>&1 \
    | tee "$OUT/fp8_block_experts_ops.log" | grep -vE "DEBUG" | tail -6; rc=$((rc | ${PIPESTATUS[0]}))
  timeout 300 python3 benchmarks/deepseek_experts.py --json "$OUT/deepseek_experts.json" 2>&1 \
    | tee "$OUT/deepseek_experts.log" | grep -vE "INFO|WARNING|DEBUG" | tail -12; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = deepseek-v4 ] || [ "$stage" = deepseek-v4-check ]; then
  python3 -m pytest -q -m gpu tests/gpu/test_deepseek_gpu.py -k "${UM_DSV4_K:-check}" -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/dsv4_check.log" | grep -vE "INFO|WARNING|warn|DEBUG|it/s\]" | tail -40; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = deepseek-v4-bench ]; then
  p=${UM_DSV4_PRESET:-deepseek_v4_flash_reduced_fp8}  # FP8 KV on both sides: vLLM's native DeepSeek-V4 needs it
  python3 -c "from unified_models.presets import build_preset_checkpoint as b; print(b('$p'))"
  python3 benchmarks/rollout_throughput.py --preset "$p" --workloads ${UM_DSV4_WORKLOADS:-64x128/256} \
    --native-kv-cache-dtype fp8 --engine-timeout-s 400 --json "$OUT/dsv4_rollout_throughput.json" > "$OUT/dsv4_bench.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING|DEBUG" "$OUT/dsv4_bench.log" | tail -40
fi
if [ "$stage" = moe-kernels ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_moe.py tests/ops/test_nvfp4.py \
    tests/ops/test_deepseek_moe.py tests/ops/test_moe_backward_groups.py 2>&1 | tee "$OUT/moe_ops.log" | grep -vE "DEBUG" | tail -8; rc=$((rc | ${PIPESTATUS[0]}))
  timeout 300 python3 benchmarks/moe_kernels.py --json "$OUT/moe_kernels.json" 2>&1 | tee "$OUT/moe_kernels.log" | tail -12
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = norm-kernels ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_rmsnorm.py 2>&1 | tee "$OUT/rmsnorm_ops.log" | tail -4
  rc=$((rc | ${PIPESTATUS[0]}))
  timeout 150 python3 benchmarks/residual_norm.py --json "$OUT/residual_norm.json" 2>&1 | tee "$OUT/residual_norm.log" | tail -16
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = mamba-backward ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_mamba2.py -k "grad or analytic" 2>&1 \
    | tee "$OUT/mamba2_grad_tests.log" | tail -4
  rc=$((rc | ${PIPESTATUS[0]}))
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/ops/test_ssd_intra_grads.py 2>&1 \
    | tee "$OUT/ssd_intra_grads_tests.log" | tail -4
  rc=$((rc | ${PIPESTATUS[0]}))
  timeout 200 python3 benchmarks/mamba_backward.py --device cuda --json "$OUT/mamba_backward.json" 2>&1 \
    | tee "$OUT/mamba_backward.log" | tail -8
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = hybrid-smoke ]; then  # the GPU-only paths of the hybrid (MoE plan kernels, Mamba-2) on a tiny model
  python3 -m pytest -q tests/ops/test_moe.py tests/ops/test_mamba2.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/hybrid_smoke_ops.log" | tail -4; rc=$((rc | ${PIPESTATUS[0]}))
  timeout 240 unified-models check --preset nemotron_h_hybrid_tiny --device cuda --json "$OUT/hybrid_tiny_cuda.json" \
    > "$OUT/hybrid_tiny_cuda.log" 2>&1; rc=$((rc | $?))
  grep -E "rollout_sha256|result" "$OUT/hybrid_tiny_cuda.log" | tail -3
  if [ "${UM_SMOKE_SYNC:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/sync_audit.py --engine ours --preset nemotron_h_hybrid_tiny --requests 16 \
      --input-len 2048 --output-len 4 --max-num-batched-tokens 16384 --ours-prefix-caching off \
      --json "$OUT/sync_hybrid_tiny.json" > "$OUT/sync_hybrid_tiny.log" 2>&1; rc=$((rc | $?))
    grep -vE "INFO|WARNING|DEBUG" "$OUT/sync_hybrid_tiny.log" | head -40
  fi
fi
if [ "$stage" = hybrid-profile ]; then
  p=${UM_PROFILE_PRESET:-nemotron_3_nano_reduced}; nano_checkpoint "$p"
  mkdir -p "$OUT/profile"
  if [ "${UM_PROFILE_SYNC:-1}" = 1 ]; then  # every synchronizing call of ours in prefill-heavy steps
    timeout 300 python3 benchmarks/sync_audit.py --engine ours --preset "$p" --requests 16 --input-len 2048 \
      --output-len 4 --max-num-batched-tokens 16384 --ours-prefix-caching off --json "$OUT/profile/sync_ours.json" \
      > "$OUT/profile/sync_ours.log" 2>&1; rc=$((rc | $?))
    grep -vE "INFO|WARNING|DEBUG" "$OUT/profile/sync_ours.log" | head -40
  fi
  # the bar's settings (nano-interleave): ours with prefix caching off like native; UM_PROFILE_ARGS replaces that
  python3 benchmarks/rollout_throughput.py --preset "$p" --workloads ${UM_PROFILE_WORKLOAD:-128x2048/128} --repeats 1 \
    --profile --profile-max-tokens ${UM_PROFILE_MAX_TOKENS:-2} ${UM_PROFILE_ARGS---ours-prefix-caching off} \
    --engine-timeout-s 400 --json "$OUT/profile/rollout_throughput.json" \
    > "$OUT/hybrid_profile.log" 2>&1; rc=$((rc | $?))
  grep -vE "INFO|WARNING|DEBUG" "$OUT/hybrid_profile.log" | tail -12
  for f in "$OUT"/profile/profile_*.txt; do [ -f "$f" ] && head -32 "$f"; done
  tar -czf "$OUT/profile.tgz" -C "$OUT/profile" . && rm -rf "$OUT/profile"  # one file: the device returns only a few
fi
if [ "$stage" = decode-chunk ]; then  # issue 18 item 3: decode-as-chunk cost by in-chunk position
  timeout 170 python3 benchmarks/decode_chunk_position.py --chunk 128 256 ${UM_DCP_ARGS:-} \
    --json "$OUT/decode_chunk_position_h200.json" 2>&1 | tee "$OUT/decode_chunk_position.log" \
    | grep -vE "INFO|WARNING|DEBUG" | tail -32; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = mamba-prefill ]; then  # issue 18 item 3: one Mamba-2 layer's prefill vs native, launch candidates
  timeout 240 python3 benchmarks/mamba_prefill.py ${UM_MP_ARGS:-} --json "$OUT/mamba_prefill.json" 2>&1 \
    | tee "$OUT/mamba_prefill.log" | grep -viE "warn" | tail -40; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = graph-soak ]; then
  soak_k=${UM_SOAK_K:-not nvfp4}
  nano_checkpoint nemotron_3_nano_reduced
  case "$soak_k" in *"not nvfp4"*) ;; *nvfp4*) nano_checkpoint nemotron_3_nano_reduced_nvfp4 ;; esac
  timeout 480 python3 -m pytest -q -m gpu tests/gpu/test_graph_soak_gpu.py -s -p no:cacheprovider -k "$soak_k" 2>&1 \
    | tee "$OUT/graph_soak.log" | grep -vE "INFO|WARNING|warn|DEBUG|it/s\]" | tail -40; rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "$stage" = trainer-cost ]; then  # issue 18 item 5: the trainer's cost (benchmarks/trainer_cost.py docstring)
  presets=${UM_TC_PRESETS:-nemotron_3_nano_reduced nemotron_h_dense_bench}
  if ls .whl/mamba_ssm-*.whl > /dev/null 2>&1; then  # Megatron's MambaModel (scripts/mamba-ssm-wheel.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/um-whl \
      .whl/mamba_ssm-*.whl && export PYTHONPATH=/tmp/um-whl:$PYTHONPATH
  fi
  if [ "${UM_TC_GRADCHECK:-1}" = 1 ]; then  # the gradients the timed backward computes, against fp64 autograd
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_autograd_gpu.py tests/ops/test_moe_backward_groups.py \
      tests/ops/test_mhc_backward.py -s 2>&1 \
      | tee "$OUT/autograd_gpu.log" \
      | grep -E "GRAD-ERR|passed|failed" | tail -8; rc=$((rc | ${PIPESTATUS[0]}))
  fi
  nano_checkpoint $presets
  d="$OUT/trainer_cost_logs"; mkdir -p "$d"
  for preset in $presets; do
    UM_FUSED_ATTENTION_BACKWARD=${UM_FUSED_ATTENTION_BACKWARD:-1} \
    python3 benchmarks/trainer_cost.py --preset $preset --device cuda --timeout-s 240 ${UM_TC_ARGS:-} \
      --json "$d/trainer_cost_$preset.json" > "$d/trainer_cost_$preset.log" 2>&1; rc=$((rc | $?))
    cp "$d/trainer_cost_$preset.json" "$OUT/" 2>/dev/null
    grep -vE "INFO|WARNING|DEBUG|warn" "$d/trainer_cost_$preset.log" | tail -24
  done
  tar -czf "$OUT/trainer_cost_logs.tgz" -C "$d" . && rm -rf "$d"  # one file: the device returns only a few
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  python3 benchmarks/rollout_throughput.py --preset nemotron_h_wide --workloads 64x128/128 256x128/512 \
    --engine-timeout-s 280 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1; rc=$((rc | $?)); tail -40 "$OUT/bench.log" | grep -vE "INFO|WARNING"
fi
exit $rc
