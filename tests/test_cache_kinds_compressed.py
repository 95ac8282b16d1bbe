"""Compressed-KV and indexer-key cache kinds (one entry per ``ratio`` tokens) and paged caches
of a dtype of their own (DeepSeek-V4's fp32 compressor rows): declarations, the vLLM spec
each maps to, the views of what vLLM binds, the trainer's allocation and the entry-slot rule
both stores share. (DeepSeek-V4's CSA / HCA layers write them:
``tests/test_deepseek_compressed_attention.py`` runs them through both engines.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from unified_models.caches import CompressedKVCache, IndexerKeyCache, PagedKVCache
from unified_models.dsl import (AttentionSpec, BlockSpec, EmbeddingSpec, LMHeadSpec, ModelSpec, RMSNormSpec,
                                SublayerSpec)
from unified_models.layers import FAMILIES, LayerFamily, register_family
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch, entry_slots

CKV = CompressedKVCache(ratio=4, head_dim=8)
IDX = IndexerKeyCache(ratio=4, head_dim=16)


def _vllm_config(block_size=64, dtype=torch.bfloat16):
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}),
                           model_config=SimpleNamespace(dtype=dtype), cache_config=SimpleNamespace(block_size=block_size,
                                                                                                   cache_dtype="auto"))


def test_declarations_validate_and_group_by_kind():
    assert CKV.group_key() != IDX.group_key() != CompressedKVCache(ratio=128, head_dim=8).group_key()
    assert CKV.entries_per_block(64) == 16 and CKV.rows_per_block(64) == 16
    with pytest.raises(ValueError, match="block size 30 is not a multiple of the compression ratio 4"):
        CKV.entries_per_block(30)
    with pytest.raises(ValueError, match="ratio=0 must be an int >= 1"):
        CompressedKVCache(ratio=0, head_dim=8)
    with pytest.raises(ValueError, match="sliding_window=0 must be None or an int >= 1"):
        PagedKVCache(num_kv_heads=1, head_dim=8, sliding_window=0)


def test_vllm_spec_and_bound_views():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from unified_models.backends.vllm.attention_backend import UnifiedSharedKVBackend
    from unified_models.backends.vllm.caches import UnifiedCompressedCache, cache_module

    cfg = _vllm_config()
    mod = cache_module(CKV, "model.layers.0.attn.ckv", cfg)
    idx = cache_module(IDX, "model.layers.0.attn.idx", cfg)
    assert isinstance(mod, UnifiedCompressedCache) and mod.get_attn_backend() is UnifiedSharedKVBackend
    assert cfg.compilation_config.static_forward_context["model.layers.0.attn.ckv"] is mod
    spec, ispec = mod.get_kv_cache_spec(cfg), idx.get_kv_cache_spec(cfg)
    assert type(spec) is MLAAttentionSpec and type(ispec) is MLAAttentionSpec
    ratio_field = "tokens_per_state" if hasattr(spec, "tokens_per_state") else "compress_ratio"
    assert getattr(spec, ratio_field) == 4 and spec.num_kv_heads == 1 and spec.head_size == 8
    assert spec.page_size_bytes == 64 // 4 * 1 * 8 * 2  # 16 entries x G x E x bf16, no V part
    assert ispec.page_size_bytes == 64 // 4 * 16 * 2 and spec != ispec  # its own group
    with pytest.raises(ValueError, match="multiple of 16 and of the compression ratio 128"):
        cache_module(CompressedKVCache(ratio=128, head_dim=8), "model.layers.1.attn.hca", cfg).get_kv_cache_spec(cfg)
    assert mod.kv_views() is None  # before binding
    # 0.32 binds the logical [N, H, N_states, C] view; 0.26 our get_kv_cache_shape [N, 1, S/r, G, E]
    raw = torch.arange(5 * 16 * 8, dtype=torch.float32).view(5, 1, 16, 8).to(torch.bfloat16)
    for bound, want in ((raw, raw.permute(0, 2, 1, 3)), (raw.view(5, 1, 16, 1, 8), raw.view(5, 16, 1, 8))):
        mod.kv_cache = bound
        k, v = mod.kv_views()
        assert k is v and k.shape == (5, 16, 1, 8) and torch.equal(k, want)
        assert k.data_ptr() == raw.data_ptr()


def test_shared_and_sliding_paged_specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec

    from unified_models.backends.vllm.caches import cache_module

    cfg = _vllm_config(block_size=32)
    cases = [(PagedKVCache(num_kv_heads=2, head_dim=16), FullAttentionSpec, 2),
             (PagedKVCache(num_kv_heads=2, head_dim=16, sliding_window=8), SlidingWindowSpec, 2),
             (PagedKVCache(num_kv_heads=2, head_dim=16, shared_kv=True), MLAAttentionSpec, 1),
             (PagedKVCache(num_kv_heads=2, head_dim=16, sliding_window=8, shared_kv=True), SlidingWindowMLASpec, 1)]
    for i, (decl, cls, vectors) in enumerate(cases):
        spec = cache_module(decl, f"model.layers.{i}.attn.attn", cfg).get_kv_cache_spec(cfg)
        assert type(spec) is cls, (decl, type(spec))
        assert spec.page_size_bytes == 32 * 2 * 16 * 2 * vectors  # S x G x E x bf16 x (K and V | one vector)
        assert getattr(spec, "sliding_window", None) == decl.sliding_window


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """A sublayer that only declares the compressed caches (next to an attention's KV)."""

    name: str
    attn: AttentionSpec

    def parameter_shapes(self):
        return self.attn.parameter_shapes()


@pytest.fixture
def probe_family():
    fam = LayerFamily(spec_type=ProbeSpec, forward=None, oracle=None,
                      caches=lambda s, dt: {"attn": PagedKVCache(num_kv_heads=1, head_dim=8), "ckv": CKV, "idx": IDX},
                      megatron_fields=lambda s: {})
    register_family(fam)
    yield
    FAMILIES.pop(ProbeSpec, None)


def test_private_store_allocates_entries_and_shares_the_slot_rule(probe_family):
    d = 8
    attn = AttentionSpec(name="model.layers.0.p.attn", hidden_size=d, num_heads=1, num_kv_heads=1, head_dim=8)
    block = BlockSpec.single(0, RMSNormSpec(name="model.layers.0.norm", hidden_size=d, eps=1e-5),
                             ProbeSpec(name="model.layers.0.p", attn=attn))
    spec = ModelSpec(family="probe", architecture="Probe", hf_model_type="probe", hf_architecture="Probe",
                     embedding=EmbeddingSpec(name="e", vocab_size=16, hidden_size=d), blocks=(block,),
                     final_norm=RMSNormSpec(name="n", hidden_size=d, eps=1e-5),
                     lm_head=LMHeadSpec(name="h", vocab_size=16, hidden_size=d, tied_to=None))
    lens = [37, 9]
    store = PrivateStateStore(spec, lens, block_size=16)
    batch = FlatBatch.from_cu_seqlens(torch.zeros(sum(lens), dtype=torch.long), torch.tensor([0, 37, 46]))
    store.bind(batch)
    ckv, idx, kv = store.state(0, "ckv"), store.state(0, "idx"), store.state(0, "attn")
    assert ckv.k_cache is ckv.v_cache and ckv.k_cache.shape == (3 + 1, 4, 1, 8)  # ceil(37/16) + ceil(9/16) blocks
    assert idx.k_cache.shape == (4, 4, 1, 16) and kv.k_cache.shape == (4, 16, 1, 8)
    assert len(store.groups) == 3
    slots = entry_slots(ckv.block_table, batch.seq_idx, batch.positions, 4, 16)
    pos, seq = batch.positions, batch.seq_idx.long()
    done = (pos + 1) % 4 == 0
    assert torch.equal(slots >= 0, done)
    # entry j of sequence b: block table[b, 4j // 16], offset (4j % 16) // 4; all distinct
    j = pos[done] // 4
    want = ckv.block_table[seq[done], (4 * j) // 16].long() * 4 + (4 * j % 16) // 4
    assert torch.equal(slots[done], want) and slots[done].unique().numel() == int(done.sum())
    assert int(slots.max()) < ckv.k_cache.shape[0] * 4


def test_fp32_rows_cache_keeps_its_dtype_in_both_stores(probe_family):
    """A ``PagedKVCache(dtype=torch.float32)`` (the compressor rows) is fp32 in a bf16 model: the
    vLLM spec, and the trainer's pages; its group is not the model-dtype one's."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    from unified_models.backends.vllm.caches import cache_module

    rows = PagedKVCache(num_kv_heads=1, head_dim=16, sliding_window=8, shared_kv=True, dtype=torch.float32)
    same_bf16 = PagedKVCache(num_kv_heads=1, head_dim=16, sliding_window=8, shared_kv=True)
    assert rows.group_key() != same_bf16.group_key() and rows.element_dtype(torch.bfloat16) == torch.float32
    cfg = _vllm_config(block_size=32)
    spec = cache_module(rows, "model.layers.0.attn.rows", cfg).get_kv_cache_spec(cfg)
    assert type(spec) is SlidingWindowMLASpec and spec.dtype == torch.float32
    assert spec.page_size_bytes == 32 * 16 * 4  # S x E x fp32, one vector
    assert cache_module(same_bf16, "model.layers.0.attn.swa", cfg).get_kv_cache_spec(cfg).dtype == torch.bfloat16
    FAMILIES[ProbeSpec] = dataclasses.replace(FAMILIES[ProbeSpec], caches=lambda s, dt: {"rows": rows,
                                                                                          "swa": same_bf16})
    d = 8
    attn = AttentionSpec(name="model.layers.0.p.attn", hidden_size=d, num_heads=1, num_kv_heads=1, head_dim=8)
    block = BlockSpec.single(0, RMSNormSpec(name="model.layers.0.norm", hidden_size=d, eps=1e-5),
                             ProbeSpec(name="model.layers.0.p", attn=attn))
    model = ModelSpec(family="probe", architecture="Probe", hf_model_type="probe", hf_architecture="Probe",
                      embedding=EmbeddingSpec(name="e", vocab_size=16, hidden_size=d), blocks=(block,),
                      final_norm=RMSNormSpec(name="n", hidden_size=d, eps=1e-5),
                      lm_head=LMHeadSpec(name="h", vocab_size=16, hidden_size=d, tied_to=None))
    store = PrivateStateStore(model, [20], block_size=16)
    assert store.state(0, "rows").k_cache.dtype == torch.float32
    assert store.state(0, "swa").k_cache.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exclusive"):
        PagedKVCache(num_kv_heads=1, head_dim=8, fp8=True, dtype=torch.float16)
