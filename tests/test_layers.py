"""Family registry and state stores: unknown spec types are refused; each cache gets its group's views."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from unified_models.caches import PagedKVCache
from unified_models.dsl import AttentionSpec, MLPSpec, SpecError
from unified_models.forward import forward_hidden, forward_logprobs
from unified_models.layers import FAMILIES, family_of, model_caches
from unified_models.layers.attention import attention_forward
from unified_models.layers.mlp import mlp_forward
from unified_models.state import AttentionState, FlatBatch, PagedGroup
from unified_models.private_state import PrivateStateStore


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UnknownMixerSpec:
    name: str

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


def _batch(seq_lens: list[int], vocab: int = 32000) -> FlatBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sum(seq_lens),), generator=g)
    return FlatBatch.from_cu_seqlens(ids, torch.tensor([0, *seq_lens]).cumsum(0))


def test_registry_maps_each_family_to_its_declarations():
    assert FAMILIES[AttentionSpec].forward is attention_forward and FAMILIES[MLPSpec].forward is mlp_forward
    attn = AttentionSpec(name="a", hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4)
    assert family_of(attn, 0).forward is attention_forward
    assert family_of(attn).caches(attn, torch.bfloat16) == {"attn": PagedKVCache(num_kv_heads=1, head_dim=4)}

    class MyMLP(MLPSpec):  # a subclass finds its base family
        pass

    assert family_of(MyMLP(name="m", hidden_size=8, intermediate_size=16, activation="relu2"), 1).forward is mlp_forward


def test_registry_refuses_unknown_spec_type_naming_type_and_layer():
    with pytest.raises(SpecError, match=r"layer 7: no layer family for spec type _UnknownMixerSpec"):
        family_of(_UnknownMixerSpec(name="x"), 7)


def test_forward_refuses_unknown_mixer_before_computing(tiny_model):
    _, spec, sd = tiny_model
    blocks = list(spec.blocks)
    blocks[2] = dataclasses.replace(blocks[2], sublayers=(dataclasses.replace(
        blocks[2].sublayers[0], mixer=_UnknownMixerSpec(name="backbone.layers.2.mixer")),))
    bad = spec.replace(blocks=tuple(blocks))
    batch = _batch([5])
    with pytest.raises(SpecError, match=r"layer 2: no layer family for spec type _UnknownMixerSpec"):
        PrivateStateStore(bad, [5], block_size=16)
    store = PrivateStateStore(spec, [5], block_size=16)
    store.bind(batch)
    with pytest.raises(SpecError, match=r"layer 2: no layer family for spec type _UnknownMixerSpec"):
        forward_hidden(bad, sd, batch, store)


def test_private_store_gives_each_layer_its_group_views(tiny_model):
    _, spec, _ = tiny_model
    lens = [33, 1, 70]
    batch = _batch(lens)
    store = PrivateStateStore(spec, lens, block_size=16)
    store.bind(batch)
    attn = spec.sublayers_of(AttentionSpec)
    assert len(attn) >= 2 and len(store.groups) == 1
    assert set(model_caches(spec)) == {(b.index, "attn") for b in attn}
    states = {b.index: store.state(b.index, "attn") for b in attn}
    with pytest.raises(KeyError, match="no cache 'kv' declared for layer"):
        store.state(attn[0].index, "kv")
    group = next(iter(store.groups.values()))
    n_blocks = sum(-(-n // 16) for n in lens)
    for blk in attn:
        st = states[blk.index]
        assert isinstance(st, AttentionState) and st.group is group
        assert st.k_cache.shape == st.v_cache.shape == (n_blocks, 16, blk.mixer.num_kv_heads, blk.mixer.head_dim)
    # every layer has its own pages, its group's tables
    ptrs = {states[b.index].k_cache.data_ptr() for b in attn}
    assert len(ptrs) == len(attn)
    assert group.block_table.shape == (3, 5) and group.block_size == 16
    assert group.block_table[2].tolist() == [4, 5, 6, 7, 8]
    t = batch.positions.shape[0]
    assert group.slot_mapping.shape == (t,)
    # token 34 is sequence 2's position 0 -> its first block, offset 0
    assert int(group.slot_mapping[34]) == 4 * 16
    assert int(group.slot_mapping[34 + 69]) == 8 * 16 + 69 % 16


def test_several_groups_with_own_block_sizes_change_no_bit(tiny_model, monkeypatch):
    """One group per attention layer, each with its own block size: same bits as one group."""
    _, spec, sd = tiny_model
    lens = [33, 1, 70, 16]
    batch = _batch(lens)
    one = PrivateStateStore(spec, lens, block_size=64)
    one.bind(batch)
    ref = forward_logprobs(spec, sd, forward_hidden(spec, sd, batch, one))

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class PerLayerKV(PagedKVCache):  # a paged KV kind whose group is its layer
        layer: str

        def group_key(self):
            return self.layer

    fam = FAMILIES[AttentionSpec]
    monkeypatch.setitem(FAMILIES, AttentionSpec, dataclasses.replace(fam, caches=lambda a, dt: {
        "attn": PerLayerKV(num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, layer=a.name)}))
    attn = spec.sublayers_of(AttentionSpec)
    sizes = {b.mixer.name: s for b, s in zip(attn, (16, 32, 48, 64))}
    many = PrivateStateStore(spec, lens, block_size=64, group_block_sizes=sizes)
    many.bind(batch)
    assert len(many.groups) == len(attn)
    for blk in attn:
        st = many.state(blk.index, "attn")
        assert st.group is many.groups[blk.mixer.name] and st.group.block_size == sizes[blk.mixer.name]
        assert st.k_cache.shape[1] == sizes[blk.mixer.name]
    got = forward_logprobs(spec, sd, forward_hidden(spec, sd, batch, many))
    assert torch.equal(ref, got)


def test_vllm_store_maps_layers_to_their_groups():
    """vLLM side: one PagedGroup per distinct metadata object (= KV-cache group), padded slots."""
    import vllm  # noqa: F401  (required: a missing install must fail, not skip)
    from unified_models.backends.vllm.attention_backend import UnifiedAttentionMetadata
    from unified_models.backends.vllm.model import UnifiedForCausalLM

    def md(block_table, slots, block_size):
        return UnifiedAttentionMetadata(
            query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
            seq_lens=torch.tensor([2, 5], dtype=torch.int32),
            block_table=block_table, slot_mapping=slots, num_actual_tokens=3, num_reqs=2, max_query_len=2,
            block_size=block_size)

    from unified_models.backends.vllm.caches import UnifiedAttentionCache, VllmStateStore

    caches = {i: torch.randn(4, 2, 16, 1, 8).unbind(1) for i in (0, 2, 3)}

    class _Cache:  # UnifiedAttentionCache's step protocol over fake pages (no vLLM config needed)
        metadata_type = UnifiedAttentionMetadata
        step_group = staticmethod(UnifiedAttentionCache.step_group)
        view = UnifiedAttentionCache.view

        def __init__(self, i):
            self.i, self.layer_name = i, f"backbone.layers.{i}.mixer.attn"

        def kv_views(self):
            return caches[self.i]

    full = md(torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([0, 1, 20]), 16)
    window = md(torch.tensor([[3, 0], [2, 1]], dtype=torch.int32), torch.tensor([48, 49, 36]), 32)
    fake = SimpleNamespace(_caches={(i, "attn"): _Cache(i) for i in (0, 2, 3)}, logprob_tap=None,
                           record_sample_positions=False)
    mds = {(0, "attn"): full, (2, "attn"): window, (3, "attn"): full}
    batch, store = UnifiedForCausalLM._flat_batch(fake, torch.arange(4), torch.tensor([0, 1, 4, 0]), mds)
    assert batch.seq_idx.tolist() == [0, 0, 1, 0] and batch.positions.tolist() == [0, 1, 4, 0]
    s0, s2, s3 = (store.state(i, "attn") for i in (0, 2, 3))
    assert s0.group is s3.group and s0.group is not s2.group
    assert s0.k_cache is caches[0][0] and s2.v_cache is caches[2][1]
    assert s0.slot_mapping.tolist() == [0, 1, 20, -1] and s2.slot_mapping.tolist() == [48, 49, 36, -1]
    assert s2.block_table is window.block_table and s2.group.block_size == 32
    # profiling runs: nothing bound
    _, idle = UnifiedForCausalLM._flat_batch(fake, torch.arange(4), torch.arange(4), None)
    assert isinstance(idle, VllmStateStore) and idle.state(0, "attn") is None
    assert isinstance(s0.group, PagedGroup)
