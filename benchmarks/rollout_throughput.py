"""Rollout throughput: our model class vs vLLM's native NemotronHForCausalLM.

Same checkpoint, same prompts, same SamplingParams (temperature 1.0, per-request
seeds, fixed number of new tokens, EOS ignored), both eager (no CUDA graphs,
no torch.compile), one after the other in the same process. Reports generated
tokens per second of each and the ratio ours/native. Not a test: a measurement.

    python benchmarks/rollout_throughput.py --preset nemotron_h_wide \
        --num-prompts 64 --max-new-tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _generate(llm, prompt_ids, max_new_tokens, seed, repeats):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_new_tokens, ignore_eos=True, logprobs=0,
                             detokenize=False)
              for i in range(len(prompt_ids))]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    warm = [SamplingParams(temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True, detokenize=False) for _ in prompt_ids[:4]]
    llm.generate(prompts[:4], warm, use_tqdm=False)  # warm-up: kernels compiled, allocator primed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        times.append(time.perf_counter() - t0)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    best = min(times)
    return {"generated_tokens": n, "seconds_best": best, "seconds_all": times, "tokens_per_s": n / best}


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free(llm):
    from unified_models.backends.vllm.engine import shutdown_llm

    shutdown_llm(llm)
    gc.collect()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nemotron_h_wide")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build --preset)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)

    import torch
    import vllm

    from unified_models.backends.vllm.engine import PINNED_ENV, make_llm

    os.environ.update(PINNED_ENV)  # both engines: in-process, V1 runner, no FlashInfer sampler
    from unified_models.models import spec_from_hf_config
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.presets import build_preset_checkpoint, default_prompts_path, tokenizer_dir
    from unified_models.prompts import load_prompt_texts, tokenize_prompts

    model_dir = args.model or str(build_preset_checkpoint(args.preset))
    spec = spec_from_hf_config(load_hf_config(model_dir))
    prompt_ids = tokenize_prompts(load_prompt_texts(default_prompts_path(), args.num_prompts), tokenizer_dir(),
                                  vocab_size=spec.vocab_size)
    gpu = torch.cuda.is_available()
    max_len = max(map(len, prompt_ids)) + args.max_new_tokens + 16

    native = vllm.LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, seed=args.seed,
                      max_model_len=max_len, max_num_seqs=args.num_prompts, enable_prefix_caching=False,
                      **({"gpu_memory_utilization": args.gpu_memory_utilization} if gpu else {}))
    res_native = _generate(native, prompt_ids, args.max_new_tokens, args.seed, args.repeats)
    _free(native)

    ours = make_llm(model_dir, seed=args.seed, max_model_len=max_len, max_num_seqs=args.num_prompts,
                    gpu=gpu, enable_prefix_caching=False, **({"gpu_memory_utilization": args.gpu_memory_utilization} if gpu else {}))
    res_ours = _generate(ours, prompt_ids, args.max_new_tokens, args.seed, args.repeats)
    _free(ours)

    result = {
        "model": model_dir, "preset": args.preset, "pattern": spec.extra.get("pattern"),
        "hidden_size": spec.hidden_size, "num_layers": len(spec.blocks),
        "num_prompts": len(prompt_ids), "prompt_tokens": sum(map(len, prompt_ids)),
        "max_new_tokens": args.max_new_tokens, "eager": True,
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "vllm": vllm.__version__, "torch": torch.__version__,
        "native_NemotronHForCausalLM": res_native, "unified_models": res_ours,
        "ratio_ours_over_native": res_ours["tokens_per_s"] / res_native["tokens_per_s"],
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
