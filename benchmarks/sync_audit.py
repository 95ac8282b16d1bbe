"""Where does a rollout step block the host on the GPU? (CUDA sync audit, GPU only.)

Not a test: a diagnostic. vLLM overlaps the host work of step N+1 (scheduling,
input preparation, sampling bookkeeping) with the GPU work of step N (async
scheduling); one synchronizing call per step in the model's path (a ``.item()``,
a device-to-host copy into pageable memory, ...) serializes the two. This runs
a short rollout of one engine with ``torch.cuda.set_sync_debug_mode("warn")``
after a warm-up and prints every call site that synchronized, with its count
and the innermost frames of its stack.

    python benchmarks/sync_audit.py --engine ours --preset nemotron_h_dense_bench
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import traceback
import warnings
from pathlib import Path


SYNC_MODE_NOTICE = "Synchronization debug mode is a prototype feature"
"""The warning ``torch.cuda.set_sync_debug_mode`` itself raises once; every other warning it raises names a
synchronizing call."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ours", "native"], default="ours")
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="nemotron_h_dense_bench")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engines' step token budget (default: vLLM's)")
    ap.add_argument("--ours-prefix-caching", choices=["check", "off"], default="check",
                    help="ours: `check`'s setting (on for hybrids on a GPU) or off, as the rollout bench runs it")
    ap.add_argument("--frames", type=int, default=10, help="innermost stack frames shown per site")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    from unified_models.backends.vllm.engine import PINNED_ENV

    os.environ.update(PINNED_ENV)
    import torch
    from vllm.inputs import TokensPrompt

    from unified_models.presets import build_preset_checkpoint, load_preset

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    path = build_preset_checkpoint(args.preset)
    vocab = int(load_preset(args.preset)["hf_config"]["vocab_size"])
    rng = random.Random(0)

    def prompts(n):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.input_len)]) for _ in range(n)]

    common = dict(max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.requests, seed=0,
                  skip_tokenizer_init=True)
    if args.max_num_batched_tokens:
        common["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.engine == "ours":
        from unified_models.backends.vllm.engine import make_llm
        from unified_models.backends.vllm.sampling import sampling_params

        off = {"enable_prefix_caching": False} if args.ours_prefix_caching == "off" else {}
        llm = make_llm(path, gpu=True, gpu_memory_utilization=0.6, **off, **common)
        params = lambda n, m: [sampling_params(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True, logprobs=0,
                                               detokenize=False) for i in range(n)]
    else:
        import vllm

        llm = vllm.LLM(model=str(path), dtype="bfloat16", gpu_memory_utilization=0.6, **common)
        params = lambda n, m: [vllm.SamplingParams(temperature=1.0, seed=i, max_tokens=m, ignore_eos=True,
                                                   logprobs=0, detokenize=False) for i in range(n)]
    llm.generate(prompts(args.requests), params(args.requests, 8), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(SYNC_MODE_NOTICE):  # torch's notice on entering the mode, not a sync
            return
        stack = traceback.extract_stack()[:-1]
        frames = tuple(f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}"
                       for f in stack[-args.frames:])
        sites[(str(message).splitlines()[0][:120], frames)] += 1

    old_show = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        llm.generate(prompts(args.requests), params(args.requests, args.output_len), use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old_show
    print(f"{args.engine}: {sum(sites.values())} synchronizing calls in {args.output_len} steps "
          f"({args.requests} requests), {len(sites)} call sites")
    rows = []
    for (msg, frames), n in sites.most_common():
        print(f"\n{n:6d} x {msg}")
        for f in frames:
            print(f"           {f}")
        rows.append({"count": n, "message": msg, "frames": list(frames)})
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
