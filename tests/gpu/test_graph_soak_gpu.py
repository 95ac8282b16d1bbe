"""Batch-composition soak with CUDA graphs on, at the Nano-30B widths (issue 18 item 2; H200).

The property and the machinery are those of the CPU soak (``tests/batch_soak.py``,
``tests/backends/test_batch_composition_soak.py``): 48 requests (45 prompts of 8 to 400 tokens
and 3 continuing one shared prefix of one KV block + 5 tokens; their own seeds; temperatures
0.8 and 1.0 alternating; 64 new tokens each, 3,072 sampled tokens, logprobs=1) must give the
same tokens and the same fp32 logprob bits (sampled token and top-1 entries) in all 11
compositions over three engines, every one with decode steps in CUDA graphs
(``FULL_DECODE_ONLY``, compilation mode NONE, ``settings.cuda_graph_settings``):

* ``prefix``: ``max_num_seqs=32`` (< 48: requests wait and join running decodes), prefix caching
  on ("align": the hybrid's Mamba state cached at block boundaries; a Nano block is thousands of
  tokens, read from the engine, and the shared prefix spans one); all in one ``generate``, the
  same again (cache hits), staggered arrival;
* ``base``: ``max_num_seqs=64`` (every decode batch of the 48 requests a captured size or padded
  to one), prefix caching off; all in one ``generate``, reversed, one at a time, random groups,
  staggered arrival;
* ``chunked``: ``max_num_seqs=13`` (other capture sizes; a decode batch whose size is not one
  replays the next larger graph with padded rows, asserted to have happened somewhere), a 256-token step
  budget (prompts split over steps, partial prefills mixed with decodes); all in one ``generate``,
  random groups, staggered arrival.

What can break it here and not on the CPU: a graph captured at one padded batch size replayed with
fewer live requests (padded rows writing state or cache slots, reading stale metadata), host
values frozen at capture (a branch, a grid, a slot count), GEMM / attention / MoE / Mamba kernel
configurations chosen by the number of rows (the tiered Triton GEMM of ``docs/consistency.md`` row
2), and CUDA's per-request Philox generators rewound after partial prefills.

Which graph mode ran is recorded and asserted per engine: ``cuda_graphs`` true,
``cudagraph_mode`` ``FULL_DECODE_ONLY``, compilation mode NONE, and the replays counted by
``batch_soak.StepSpy`` (steps whose model forward ran no Python) equal the uniform decode steps:
every decode step replayed a captured graph, every prefill / mixed step ran eagerly. The JSON
report (engine settings and capture sizes, schedule, timings, differences) goes to
``$UM_GPU_OUT/graph_soak_<preset>.json``. ``scripts/gpu-run.sh graph-soak`` runs the bf16 preset;
``UM_SOAK_K=nvfp4`` selects the ModelOpt export (NVFP4 experts, FP8 Mamba projections and KV cache).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from batch_soak import EngineConfig, Soak, build_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the H200)")]

NANO, NANO_NVFP4 = "nemotron_3_nano_reduced", "nemotron_3_nano_reduced_nvfp4"
REQUESTS, NEW_TOKENS = 48, 64
MAX_MODEL_LEN = 8192  # the preset's max_position_embeddings; a shared prefix of one Nano block must fit
CHUNK_BUDGET, CHUNK_SEQS = 256, 13


def _requests(block_size: int):
    reqs = build_requests(REQUESTS, new_tokens=NEW_TOKENS, min_len=8, max_len=400, shared_prefix_len=block_size + 5,
                          num_shared=3, vocab=32000, salt=182)
    longest = max(len(r.prompt) for r in reqs) + NEW_TOKENS
    assert longest <= MAX_MODEL_LEN, \
        f"block size {block_size}: requests on a shared prefix of one block need {longest} > {MAX_MODEL_LEN} positions"
    return reqs


CONFIGS = (
    # first: its block size (prefix caching in "align" mode) sizes the shared prefix
    EngineConfig("prefix", dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=32, enable_prefix_caching=True,
                                enable_chunked_prefill=True, cuda_graphs=True),
                 ("together", "together_again", "staggered")),
    EngineConfig("base", dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=64, enable_prefix_caching=False,
                              cuda_graphs=True),
                 ("together", "reversed", "one_at_a_time", "groups", "staggered")),
    EngineConfig("chunked", dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=CHUNK_SEQS,
                                 max_num_batched_tokens=CHUNK_BUDGET, enable_chunked_prefill=True,
                                 enable_prefix_caching=False, cuda_graphs=True),
                 ("together", "groups", "staggered")),
)


@pytest.mark.parametrize("preset", [NANO, NANO_NVFP4])
def test_graph_soak_nano(preset, tmp_path):
    from unified_models.presets import build_preset_checkpoint

    t0 = time.perf_counter()
    ckpt = Path(build_preset_checkpoint(preset))
    out = Path(os.environ.get("UM_GPU_OUT") or tmp_path)
    soak = Soak(ckpt, device="cuda", make_requests=_requests, logprobs=1, seed=182,
                report_path=out / f"graph_soak_{preset}.json")
    for cfg in CONFIGS:
        soak.run(cfg)  # writes the report after each engine
    print("\n" + soak.summary_text(preset, time.perf_counter() - t0))
    soak.assert_schedule_and_bits(expect_graphs=True, chunked_engine="chunked", prefix_engine="prefix")
