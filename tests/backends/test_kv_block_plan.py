"""vLLM 0.26's DeepSeek-V4 KV-cache grouping (``kv_cache_utils._get_kv_cache_groups_uniform_groups``)
and the per-cache block sizes that meet it (``compat.plan_kv_block_sizes``).

0.26 is not installed on the CPU, so its rule is restated here (every compressed cache in one group
at the engine's block size; sliding one-vector caches grouped by ``(block_size, window)``; every
sliding page at most the largest compressed page, padded to the nearest compressed page size; equal
layer counts per padded size inside each sliding group) and checked against the plan for
DeepSeek-V4's caches at the published widths and at the CPU presets' widths. The real grouping
runs on the H200 (``tests/gpu/test_deepseek_gpu.py``)."""

from __future__ import annotations

from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch

from unified_models.caches import CompressedKVCache, IndexerKeyCache, PagedKVCache


def _cfg(block_size):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}),
                           model_config=SimpleNamespace(dtype=torch.bfloat16),
                           cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"))


def _dsv4_decls(layer_types, e, i, window, ratios):
    """DeepSeek-V4's caches per layer (layers.deepseek_attention.deepseek_attention_caches)."""
    out = {}
    for li, t in enumerate(layer_types):
        out[f"l{li}.swa"] = PagedKVCache(num_kv_heads=1, head_dim=e, sliding_window=window, shared_kv=True)
        if t == "S":
            continue
        m = ratios[t]
        c = 2 if t == "C" else 1
        out[f"l{li}.rows"] = PagedKVCache(num_kv_heads=1, head_dim=2 * c * e, sliding_window=c * m, shared_kv=True,
                                          dtype=torch.float32)
        out[f"l{li}.ckv"] = CompressedKVCache(ratio=m, head_dim=e)
        if t == "C":
            out[f"l{li}.irows"] = PagedKVCache(num_kv_heads=1, head_dim=4 * i, sliding_window=2 * m, shared_kv=True,
                                               dtype=torch.float32)
            out[f"l{li}.ikeys"] = IndexerKeyCache(ratio=m, head_dim=i)
    return out


def _check_026_rule(infos, plan, block_size):
    """0.26's assertions in ``_get_kv_cache_groups_uniform_groups`` over the planned pages."""
    comp_pages = [(block_size // i["ratio"]) * i["bytes_per_row"] for _, i in infos if i["kind"] == "compressed"]
    p_max = max(comp_pages)
    groups = defaultdict(Counter)
    for name, info in infos:
        if info["kind"] != "sliding_mla":
            continue
        page = plan[name] * info["bytes_per_row"]
        assert page <= p_max, (name, page, p_max)
        groups[(plan[name], info["window"])][min(p for p in comp_pages if p >= page)] += 1
    for key, per_size in groups.items():
        assert len(set(per_size.values())) == 1, (key, per_size)


@pytest.mark.parametrize("layers, e, i, window, ratios", [
    ("SCHC", 512, 128, 128, {"C": 4, "H": 128}),  # deepseek_v4_flash_reduced (published widths)
    ("SCHC", 32, 16, 16, {"C": 4, "H": 16}),  # deepseek_v4_tiny
    ("SCHC", 80, 16, 16, {"C": 4, "H": 16}),  # deepseek_v4_tiny_fp8
    ("SSCHCHCH", 512, 128, 128, {"C": 4, "H": 128}),
])
def test_plan_meets_the_026_rule(layers, e, i, window, ratios):
    from unified_models.backends.vllm import compat
    from unified_models.backends.vllm.caches import cache_module

    decls = _dsv4_decls(layers, e, i, window, ratios)
    block = 128 if 128 in ratios.values() else 64
    mods = [cache_module(d, n, _cfg(block)) for n, d in decls.items()]
    infos = [(m.layer_name, m.plan_info()) for m in mods]
    plan = compat.plan_block_sizes_uniform_groups(infos, block)
    assert set(plan) == {n for n, d in decls.items() if isinstance(d, PagedKVCache)}
    assert all(b >= 1 and b & (b - 1) == 0 and b <= block for b in plan.values())
    _check_026_rule(infos, plan, block)
    if layers == "SCHC" and e == 512:  # published widths, S = 128: SWA 32 tokens, CSA rows 4, HCA 8, indexer 16
        assert plan["l0.swa"] == 32 and plan["l1.rows"] == 4 and plan["l2.rows"] == 8 and plan["l1.irows"] == 16


def test_plan_only_where_the_rule_applies():
    from unified_models.backends.vllm import compat

    swa = ("a", {"kind": "sliding_mla", "bytes_per_row": 64, "window": 16})
    assert compat.plan_block_sizes_uniform_groups([swa], 64) == {}  # sliding only: 0.26 keeps one page size
    with pytest.raises(ValueError, match="exceeds the largest compressed page"):
        compat.plan_block_sizes_uniform_groups([swa, ("c", {"kind": "compressed", "ratio": 64, "bytes_per_row": 32})],
                                               64)
    if not compat.groups_deepseek_v4_style():  # 0.32 (CPU): its own page unification, every cache keeps S
        assert compat.plan_kv_block_sizes([swa, ("c", {"kind": "compressed", "ratio": 4, "bytes_per_row": 32})],
                                          64) == {}
        assert compat.kernel_block_multiple(16) == 16


def test_default_block_size_holds_whole_entries():
    from transformers import AutoConfig

    from unified_models.backends.vllm.engine import DEFAULT_BLOCK_SIZE, default_block_size
    from unified_models.models import spec_from_hf_config
    from unified_models.presets import load_preset

    for name, want in (("deepseek_v4_tiny", DEFAULT_BLOCK_SIZE), ("deepseek_v4_flash_reduced", 128)):
        cfg = AutoConfig.for_model("deepseek_v4", **dict(load_preset(name)["hf_config"]))
        assert default_block_size(spec_from_hf_config(cfg)) == want, name
