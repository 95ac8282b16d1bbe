"""Rollout at DP = 2 (EP = 1 or 2) inside vLLM, or the single-process reference: one worker per process.

Run by ``tests/backends/test_vllm_expert_parallel.py``:

* ``torchrun --standalone --nproc-per-node 2 vllm_ep_worker.py MODEL OUT --ep {1,2}``: each process is
  one vLLM DP rank (``RolloutEngine(data_parallel_size=2, enable_expert_parallel=ep == 2)``); rank 0
  generates prompts 0-2, rank 1 prompt 3 (uneven: rank 1 runs dummy batches while rank 0 decodes);
* ``python vllm_ep_worker.py MODEL OUT --single``: one engine, every prompt (the reference).

Each then scales every routed expert's weight by 1.5 (bf16), syncs it in place (at DP = 2: rank 0
passes the full HF state dict, rank 1 only the tensors it holds, as a trainer at the same EP layout
would) and generates again. Writes ``OUT.<rank>.json``: per prompt the tokens and the fp32 logprob
bits (int32 views) before and after the update, and what the engine held and exchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
SEEDS = [100, 101, 102, 103]
NEW_TOKENS = 8
SCALE = 1.5


def _bits(lps: list[float]) -> list[int]:
    return torch.tensor(lps, dtype=torch.float32).view(torch.int32).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--single", action="store_true")
    a = ap.parse_args()

    from unified_models.backends.vllm.live import get_model
    from unified_models.backends.vllm.rollout import RolloutEngine
    from unified_models.consistency.fingerprint import verify_weight_sync
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.layers.expert_shards import expert_tensor_groups

    rank = 0 if a.single else int(os.environ["RANK"])
    mine = list(range(len(PROMPTS))) if a.single else ([0, 1, 2] if rank == 0 else [3])
    _, spec, sd = spec_and_state_dict(a.model)
    dp = {} if a.single else {"data_parallel_size": 2, "enable_expert_parallel": a.ep == 2}
    t0 = time.time()
    engine = RolloutEngine(spec, a.model, max_model_len=32, max_num_seqs=4, **dp)  # vLLM loads the safetensors
    start_s = time.time() - t0
    model = get_model(engine.llm)
    out: dict = {"rank": rank, "prompts": mine, "ep": model.shard_plan.ep_size, "start_s": start_s,
                 "held_expert_tensors": sum(n in model.params() for g in expert_tensor_groups(spec) for n in g),
                 "foreign_expert_tensors": len(model.foreign_experts),
                 "settings": {k: engine.settings[k] for k in ("data_parallel_size", "expert_parallel_size",
                                                             "cuda_graphs")},
                 "contract_fingerprint": engine.contract_fingerprint().engine_digest}

    def run(tag: str) -> None:
        t = time.time()
        res = engine.generate([PROMPTS[i] for i in mine], max_new_tokens=NEW_TOKENS, seeds=[SEEDS[i] for i in mine])
        out[tag] = {str(i): {"tokens": c, "bits": _bits(lp)} for i, c, lp in zip(mine, res.completions, res.logprobs)}
        out[f"{tag}_s"] = time.time() - t

    run("before")
    experts = {n for g in expert_tensor_groups(spec) for n in g}
    new = {n: ((t.float() * SCALE).to(t.dtype) if n in experts else t) for n, t in sd.items() if t.is_floating_point()}
    if rank == 1:  # only this rank's tensors (a trainer at the same EP layout holds exactly these)
        new = {n: t for n, t in new.items() if n not in model.foreign_experts}
    rep = engine.sync_weights(new)
    fp = verify_weight_sync(rep.source_checksums, rep.engine_checksums)
    out["sync"] = {"given": len(new), "copied": len(rep.copied), "unchanged": len(rep.unchanged),
                   "checked": fp.tensors_checked, "foreign_checked": sum(n in model.foreign_experts
                                                                        for n in rep.engine_checksums)}
    run("after")
    d = model._dispatcher
    out["dispatcher"] = None if d is None else {"calls": d.calls, "rows_sent_remote": d.rows_sent_remote}
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(out, f)
    engine.close()


if __name__ == "__main__":
    main()
