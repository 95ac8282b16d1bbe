"""Batch-composition soak on the tiny presets (issue 18 item 2; logic in ``tests/batch_soak.py``).

Property: every request's sampled tokens and the fp32 bits of their logprobs (and of the top-1
entries vLLM returns beside them) are the same in every batch composition and step mix. Eight
requests (five prompts of 3 to 120 tokens, three continuing one shared prefix of two blocks + 5
tokens; each its own seed, temperatures 0.8 and 1.0 alternating, 16 new tokens: ~720 prompt
and 128 sampled tokens) run in 8 compositions on two engines per preset:

* ``prefix_chunked``: ``max_num_seqs=3`` and a 64-token step budget (prompts split over steps,
  partial prefills mixed with decodes), prefix caching on (the hybrid's Mamba state resumed at
  block boundaries); all requests in one ``generate``, the same again (every long prompt now hits
  the cache), random groups in random order, staggered arrival through ``LLMEngine.add_request`` +
  ``step()``;
* ``base``: ``max_num_seqs=8``, whole prompts per step, no prefix caching; all in one
  ``generate``, one at a time (shuffled), random groups in random order, staggered arrival.

It fails when a kernel's reduction order, a tile choice, a row's place in the batch, the
prefill / chunked-prefill / decode path, a prefix-cache resume or the sampler's per-request
stream depends on what else is in the step. On the CPU the engines run eagerly (no CUDA
graphs): this is the eager path's batch and step-mix invariance; the graph variant is
``tests/gpu/test_graph_soak_gpu.py``. The schedule each engine really ran is asserted (prompts
split, mixed steps, prefix-cache hits, decode batch sizes differing between engines, every step
an eager forward), so a configuration that silently ran something else fails too.

Per-request seeds with chunked prefill need ``batch_soak.cpu_seeded_chunked_prefill`` on the
CPU (vLLM rewinds a seeded generator by offset, which a CPU generator does not have; the shim
rewinds it by state). Set ``UM_SOAK_OUT`` to keep the JSON report.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from batch_soak import EngineConfig, Soak, build_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 16
MAX_MODEL_LEN = 256
CHUNK_BUDGET = 64  # hybrid prefix caching ("align") needs the block size (64 here) <= the step budget


def _requests(block_size: int):
    return build_requests(8, new_tokens=NEW_TOKENS, min_len=3, max_len=120, shared_prefix_len=2 * block_size + 5,
                          num_shared=3, salt=18)


CONFIGS = (
    EngineConfig("prefix_chunked", dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=3,
                                        max_num_batched_tokens=CHUNK_BUDGET, enable_chunked_prefill=True,
                                        enable_prefix_caching=True),
                 ("together", "together_again", "groups", "staggered")),
    EngineConfig("base", dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, enable_chunked_prefill=False,
                              enable_prefix_caching=False),
                 ("together", "one_at_a_time", "groups", "staggered")),
)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["nemotron_h_hybrid_tiny", "nemotron_h_tiny"])
def test_batch_composition_soak(preset, tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    t0 = time.perf_counter()
    ckpt = build_preset_checkpoint(preset, out_dir=tmp_path_factory.mktemp("soak") / preset)
    out = os.environ.get("UM_SOAK_OUT")
    soak = Soak(ckpt, device=DEVICE, make_requests=_requests, logprobs=1, seed=18,
                report_path=os.path.join(out, f"soak_{preset}.json") if out else None)
    for cfg in CONFIGS:
        soak.run(cfg)
    rep = soak.report()
    print("\n" + soak.summary_text(preset, time.perf_counter() - t0))
    assert rep["prompt_tokens"] + rep["new_tokens"] >= 300
    soak.assert_schedule_and_bits(expect_graphs=DEVICE == "cuda", chunked_engine="prefix_chunked",
                                  prefix_engine="prefix_chunked")
    if DEVICE == "cpu":  # seeded partial-prefill samples were discarded and their generators rewound
        assert rep["engines"]["prefix_chunked"]["cpu_seeded_rewinds"] > 0, rep["engines"]["prefix_chunked"]
        assert rep["engines"]["base"]["cpu_seeded_rewinds"] is None


def test_soak_verdict_names_a_one_ulp_difference():
    """The verdict itself (no engine): a logprob one fp32 ulp off in one composition is a difference,
    reported with the request, the compositions on each side and the first differing token."""
    import struct

    from batch_soak import Composition, Sample, SoakRequest

    def bits(x: float) -> int:
        return struct.unpack("<i", struct.pack("<f", x))[0]

    lp = [-1.25, -0.5, -3.0]
    same = Sample((5, 6, 7), tuple(bits(x) for x in lp), tuple(((t, bits(x), 1),) for t, x in zip((5, 6, 7), lp)))
    off = list(same.bits)
    off[1] += 1  # -0.5 and its fp32 neighbour
    other = Sample(same.tokens, tuple(off), same.entries)
    soak = Soak("unused", device="cpu", make_requests=lambda bs: [])
    soak.requests = [SoakRequest("r00", (1, 2), 0, 1.0, 3)]
    soak.results = [Composition("a/together", {"r00": same}), Composition("b/staggered", {"r00": same}),
                    Composition("c/groups", {"r00": other})]
    diffs = soak.composition_differences()
    assert len(diffs) == 1
    assert "r00" in diffs[0] and "['c/groups'] differ from ['a/together', 'b/staggered']" in diffs[0]
    assert "token 1:" in diffs[0] and "0xbf000000" in diffs[0] and "0xbf000001" in diffs[0]
    soak.results = soak.results[:2]
    assert soak.composition_differences() == []
