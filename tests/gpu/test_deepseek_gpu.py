"""DeepSeek-V4 on the H200 (issue 18 item 4): its kernels at the published widths, and ``check``.

(i) **Attention at the published widths** (head dim 512 shared K = V, 64 q heads, window 128, the
sink, CSA-like lists at ratio 4 and HCA lists at ratio 128): one prefill, chunked prefill and
token-by-token decode give every token the same bits, for two block layouts; the result is the
fp64 oracle's within bf16 tolerance. (The window kernel asked for 328,704 bytes of shared memory
at this width before ``ops.attention.triton.WIDE_LAUNCH``.) The other DeepSeek-V4 kernels
(compressor, indexer, compressed attention, mHC, DeepSeek MoE, block-FP8) run natively from
``tests/ops`` (``scripts/gpu-run.sh deepseek-v4``).

(ii) ``check`` on ``deepseek_v4_flash_reduced`` (published widths, layers sliding / CSA / HCA / CSA,
bf16) and its block-FP8 export ``deepseek_v4_flash_reduced_fp8``: ``UM_DSV4_PROMPTS`` x
``UM_DSV4_NEW_TOKENS`` (default 64 x 256), every diff field 0, every sampled row's full
vocabulary compared, peer within tolerance. vLLM 0.26 groups these caches by its own
DeepSeek-V4 rule; ``backends/vllm/compat.plan_kv_block_sizes`` gives each sliding cache the block
size that rule needs.

(iii) the same with prefix caching on and chunked prefill forced (``max_num_batched_tokens`` 256,
``max_num_seqs`` 16 < the prompts), the schedule recorded and asserted.

Reports (JSON) go to ``$UM_GPU_OUT`` when set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

_OPS_TESTS = str(Path(__file__).resolve().parents[1] / "ops")
if _OPS_TESTS not in sys.path:
    sys.path.append(_OPS_TESTS)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the H200)")

DEVICE = "cuda"
REDUCED, REDUCED_FP8 = "deepseek_v4_flash_reduced", "deepseek_v4_flash_reduced_fp8"
CHECK_PROMPTS = int(os.environ.get("UM_DSV4_PROMPTS", "64"))
CHECK_NEW_TOKENS = int(os.environ.get("UM_DSV4_NEW_TOKENS", "256"))
CHECK_PEER_TOL = 1e-3
FORCED_BATCHED_TOKENS, FORCED_MAX_SEQS = 256, 16


def _out_dir(tmp_path) -> Path:
    p = Path(os.environ.get("UM_GPU_OUT") or tmp_path)
    p.mkdir(parents=True, exist_ok=True)
    return p


# ------------------------------------------------------------------------- (i) attention, published widths
@needs_cuda
@pytest.mark.parametrize("ratio,hca,lengths,layouts", [
    (4, False, [300, 3, 140], ((32, 8), (64, 16))),
    (128, True, [520, 3, 270], ((128, 1), (256, 2))),
], ids=["csa", "hca"])
def test_wide_attention_prefill_chunked_decode_bitwise(ratio, hca, lengths, layouts, monkeypatch):
    import test_attention_compressed as tac
    import test_attention_window as taw
    from invariance import Inv

    e, h = 512, 64
    for mod in (tac, taw):
        monkeypatch.setattr(mod, "E", e)
        monkeypatch.setattr(mod, "SCALE", e ** -0.5)
    gen = torch.Generator().manual_seed(0)
    case = tac._case(lengths, ratio, gen, hca=hca, topk=16, H=h)
    window = 128
    runs = {}
    for S, pages in layouts:
        for name in taw.SCHEDULES:
            runs[(S, pages, name)] = tac._run(case, S, pages, window, ratio, "triton", DEVICE, gen, name)
    base = runs[(*layouts[0], "prefill")]
    for key, run in runs.items():
        for b in range(len(lengths)):
            Inv.assert_bitwise(run.out[b], base.out[b], f"seq {b} {key} vs prefill")
    worst = 0.0
    for b in range(len(lengths)):
        want = tac._oracle(case, b, window)
        torch.testing.assert_close(base.out[b].double(), want, rtol=2e-2, atol=2e-2)
        worst = max(worst, float((base.out[b].double() - want).abs().max()))
    print(f"\nwide attention ratio {ratio}: {sum(lengths)} tokens, max |out - fp64 oracle| {worst:.3g}")


# ------------------------------------------------------------------------- (ii, iii) check
class _EngineSpy:
    """Records what ``rollout``'s engine ran: settings, KV-cache groups, schedule, prefix-cache hits."""

    def __init__(self, monkeypatch):
        from unified_models.backends.vllm import engine, sampling
        from unified_models.backends.vllm.model import UnifiedForCausalLM

        self.settings: dict = {}
        self.groups: list = []
        self.cached_tokens: list[int] = []
        self.steps: list[tuple[list[int], list[int]]] = []  # (start position, query length) per request
        make_llm, gen, flat = engine.make_llm, sampling.generate_token_ids, UnifiedForCausalLM._flat_batch

        def spy_make_llm(*a, **kw):
            from unified_models.backends.vllm.live import engine_settings

            llm = make_llm(*a, **kw)
            self.settings = engine_settings(llm)
            try:
                from unified_models.backends.vllm.compat import model_runner

                cfg = model_runner(llm).kv_cache_config
                self.groups = [{"block_size": int(g.kv_cache_spec.block_size), "layers": list(g.layer_names)}
                               for g in cfg.kv_cache_groups]
            except Exception as exc:  # noqa: BLE001 - a record only
                self.groups = [f"unavailable: {exc!r}"]
            return llm

        def spy_generate(*a, **kw):
            outs = gen(*a, **kw)
            self.cached_tokens += [int(o.num_cached_tokens or 0) for o in outs]
            return outs

        def spy_flat(model, input_ids, positions, mds):
            batch, store = flat(model, input_ids, positions, mds)
            if mds is not None and not torch.cuda.is_current_stream_capturing():
                md = next(iter(mds.values()))
                qsl = md.query_start_loc[: md.num_reqs + 1].tolist()
                sl = md.seq_lens[: md.num_reqs].tolist()
                q = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
                self.steps.append(([s - n for s, n in zip(sl, q)], q))
            return batch, store

        monkeypatch.setattr(engine, "make_llm", spy_make_llm)
        monkeypatch.setattr(sampling, "generate_token_ids", spy_generate)
        monkeypatch.setattr(UnifiedForCausalLM, "_flat_batch", spy_flat)

    def schedule(self) -> dict:
        qlens = [[q for q in ql if q > 0] for _, ql in self.steps]
        pairs = [(s, q) for (st, ql) in self.steps for s, q in zip(st, ql) if q > 0]
        return {
            "steps": len(self.steps),
            "max_tokens_per_step": max((sum(q) for q in qlens), default=0),
            "max_requests_per_step": max((len(q) for q in qlens), default=0),
            "continued_prefill_chunks": sum(1 for s, q in pairs if s > 0 and q > 1),
            "prefix_cache_hit_requests": sum(1 for c in self.cached_tokens if c > 0),
            "prefix_cache_hit_tokens": sum(self.cached_tokens),
        }


def _assert_check_report(r: dict, status: int) -> None:
    n = CHECK_PROMPTS * CHECK_NEW_TOKENS
    assert r["tokens_compared"] == n, r["tokens_compared"]
    for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "full_vocab_max_abs_diff"):
        assert r[k] == 0.0, (k, r[k])
    assert r["num_mismatched"] == 0
    assert r["full_vocab_rows"] == n
    assert r["peer"]["within_tolerance"], r["peer"]
    assert r["passed"] and status == 0


def _run_check(tmp_path, monkeypatch, name: str, preset: str, **opts) -> tuple[dict, int, _EngineSpy]:
    import time

    from unified_models.check import CheckOptions, run_check
    from unified_models.presets import build_preset_checkpoint

    t0 = time.perf_counter()
    ckpt = build_preset_checkpoint(preset)
    print(f"\n{preset}: checkpoint {ckpt} ready in {time.perf_counter() - t0:.1f} s")
    spy = _EngineSpy(monkeypatch)
    report = _out_dir(tmp_path) / f"{name}.json"
    status = run_check(CheckOptions(preset=preset, num_prompts=CHECK_PROMPTS, max_new_tokens=CHECK_NEW_TOKENS, seed=0,
                                    device=DEVICE, peer_tolerance=CHECK_PEER_TOL, json_out=str(report), **opts))
    r = json.loads(report.read_text())
    extra = {"engine": spy.settings, "kv_cache_groups": spy.groups, "schedule": spy.schedule()}
    (_out_dir(tmp_path) / f"{name}.engine.json").write_text(json.dumps(extra, indent=2, default=str))
    print(f"\n{name}: status {status}, tokens {r['tokens_compared']}, max_abs_diff {r['max_abs_diff']}, "
          f"mean {r['mean_abs_diff']}, k3 {r['k3_kl']}, mismatched {r['num_mismatched']}, "
          f"full-vocab rows {r['full_vocab_rows']} max {r['full_vocab_max_abs_diff']}, "
          f"peer {r['peer'].get('max_abs_logit_diff')}, sha {r.get('rollout_sha256', '')[:16]}, "
          f"timings {r['timings_s']}\n  groups {[g['block_size'] if isinstance(g, dict) else g for g in spy.groups]}"
          f"\n  schedule {extra['schedule']}")
    return r, status, spy


@needs_cuda
@pytest.mark.parametrize("preset", [REDUCED, REDUCED_FP8])
def test_check_deepseek_v4_reduced_diff_zero(preset, tmp_path, monkeypatch):
    r, status, spy = _run_check(tmp_path, monkeypatch, f"check_{preset}", preset)
    _assert_check_report(r, status)
    assert "unified_models" in spy.settings["model_class"]


@needs_cuda
@pytest.mark.parametrize("preset", [REDUCED])
def test_check_deepseek_v4_prefix_caching_chunked_prefill_diff_zero(preset, tmp_path, monkeypatch):
    import unified_models.backends.vllm.rollout as rollout_mod

    class Forced(rollout_mod.RolloutEngine):
        def __init__(self, *a, **kw):
            kw.update(max_num_batched_tokens=FORCED_BATCHED_TOKENS, enable_chunked_prefill=True,
                      enable_prefix_caching=True)
            super().__init__(*a, **kw)

    monkeypatch.setattr(rollout_mod, "RolloutEngine", Forced)  # check.run_check imports it at call time
    r, status, spy = _run_check(tmp_path, monkeypatch, f"check_{preset}_prefix_chunked", preset,
                                max_num_seqs=FORCED_MAX_SEQS)
    _assert_check_report(r, status)
    s, sched = spy.settings, spy.schedule()
    assert s["enable_prefix_caching"] is True, s
    assert s["enable_chunked_prefill"] is True, s
    assert sched["max_tokens_per_step"] <= FORCED_BATCHED_TOKENS, sched
    assert 0 < sched["max_requests_per_step"] <= FORCED_MAX_SEQS < CHECK_PROMPTS, sched
    assert sched["continued_prefill_chunks"] > 0, f"no prompt was split over several steps: {sched}"
