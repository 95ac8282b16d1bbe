"""Full `check` on the H200 with CUDA graphs on (the default on CUDA) and off.

* the wide Nemotron-H preset, 64 prompts x 128 tokens;
* a fresh checkpoint of the issue-8 benchmark widths (``nemotron_h_dense_bench``: hidden 4096,
  32/8 heads x 128, relu2 MLP 21504), 64 prompts x 256 tokens;
* graph replay == eager: the same rollout with graphs on and off gives the same tokens and
  logprob bits, with chunked prefill forcing decode batches of every size from 1 to 13 (so
  several of vLLM's captured sizes, padded, replay); dense and hybrid (Mamba-2 + MoE, bf16
  and NVFP4) presets.
"""

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIFF_FIELDS = ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "full_vocab_max_abs_diff")


def _run(tmp_path, name: str, **kw) -> tuple[dict, int]:
    from unified_models.check import CheckOptions, run_check

    out = os.environ.get("UM_GPU_OUT", str(tmp_path))
    report = os.path.join(out, f"{name}.json")
    status = run_check(CheckOptions(seed=0, device="cuda", peer_tolerance=1e-3, json_out=report, **kw))
    return json.load(open(report)), status


@pytest.mark.parametrize("preset,prompts,tokens", [("nemotron_h_wide", 64, 128), ("nemotron_h_dense_bench", 64, 256)])
def test_check_diff_is_zero_with_cuda_graphs(tmp_path, preset, prompts, tokens):
    r, status = _run(tmp_path, f"check_{preset}_graphs", preset=preset, num_prompts=prompts, max_new_tokens=tokens,
                     full_vocab_rows=512)
    assert r["engine"]["cuda_graphs"] is True, r["engine"]
    assert "FULL" in str(r["engine"]["cudagraph_mode"]), r["engine"]
    assert r["tokens_compared"] >= prompts * tokens
    for k in DIFF_FIELDS:
        assert r[k] == 0.0, (k, r[k])
    assert r["peer"]["within_tolerance"], r["peer"]
    assert status == 0


def test_check_cuda_graphs_off_reports_eager(tmp_path):
    r, status = _run(tmp_path, "check_wide_eager", preset="nemotron_h_wide", num_prompts=16, max_new_tokens=64,
                     cuda_graphs=False)
    assert r["engine"]["cuda_graphs"] is False and r["engine"]["enforce_eager"] is True, r["engine"]
    for k in DIFF_FIELDS:
        assert r[k] == 0.0, (k, r[k])
    assert status == 0


@pytest.mark.parametrize("preset", ["nemotron_h_wide", "nemotron_h_hybrid_tiny", "nemotron_3_nano_reduced",
                                    "nemotron_3_nano_reduced_nvfp4"])
def test_cuda_graph_replay_equals_eager(preset):
    """Dense, and the hybrids (Mamba-2 + MoE; the tiny one has chunk size 16, so decode steps
    cross many chunk boundaries and commit boundary states inside the graph)."""
    from unified_models.backends.vllm.rollout import rollout
    from unified_models.presets import build_preset_checkpoint

    model = build_preset_checkpoint(preset)
    g = torch.Generator().manual_seed(5)
    lens = [5, 9, 17, 33, 60, 64, 65, 100, 129, 150, 200, 7, 80]
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in lens]
    hybrid = preset != "nemotron_h_wide"
    runs = {}
    for graphs in (False, True):
        # a 96-token budget admits the prompts a few at a time, so decode batches of 1..13 requests occur
        # (hybrids: prefix caching off, its "align" mode needs block size <= the token budget)
        runs[graphs] = rollout(model, prompts, max_new_tokens=40, seed=3, device="cuda", max_num_seqs=16,
                               max_num_batched_tokens=96, enable_chunked_prefill=True, full_vocab_rows=0,
                               enable_prefix_caching=False if hybrid else None, cuda_graphs=graphs)
    assert runs[True].engine["cuda_graphs"] is True and runs[False].engine["cuda_graphs"] is False
    assert "FULL" in str(runs[True].engine["cudagraph_mode"]), runs[True].engine
    assert runs[True].completions == runs[False].completions
    a = torch.tensor([x for lp in runs[True].logprobs for x in lp])
    b = torch.tensor([x for lp in runs[False].logprobs for x in lp])
    assert a.shape[0] == len(lens) * 40
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
        f"{int((a != b).sum())} of {a.shape[0]} logprobs differ between graph replay and eager"
