"""Sliding-window and shared-K=V attention layers through both engines (cache declarations, issue 16).

A toy model registered from this file (``model_type="toy_window_lm"``), three blocks of
attention + MLP sublayers under the plain residual:

* layer 0: attention with a sliding window of ``W`` = 6 positions (separate K and V);
* layer 1: the same window, shared K = V (no ``v_proj``; one cache tensor);
* layer 2: full attention.

Prompts are longer than the window and decode runs well past it. Checked:

* vLLM builds one KV-cache group per declared kind, from the declarations: a
  ``SlidingWindowSpec``, a ``SlidingWindowMLASpec`` (one vector per token: half the page,
  so vLLM doubles its block size to unify the pages) and a ``FullAttentionSpec``;
* the vLLM rollout and the Megatron recompute agree bitwise (diff = 0) on every sampled
  token and every recorded row;
* the engine forward is within 8 bf16 ulps of the fp64 reference (which applies the
  window and K = V itself), and the window is really applied (full attention differs).
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models.backends.reference import ReferenceModel
from unified_models.dsl import (AttentionSpec, BlockSpec, EmbeddingSpec, LMHeadSpec, MLPSpec, ModelSpec, RMSNormSpec,
                                SpecError, SublayerSpec)
from unified_models.models import register_model
from toy_models import BF16_ULP, random_toy_weights, toy_prompts, trainer_logits, write_toy_checkpoint

ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the engine tests run: the same test checks vLLM 0.32 on the CPU and 0.26 on an H200."""

MODEL_TYPE = "toy_window_lm"
ARCH = "UnifiedToyWindowForCausalLM"
W = 6
LAYERS = ({"sliding_window": W}, {"sliding_window": W, "shared_kv": True}, {})


class ToyWindowConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=512, **kw):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.rms_norm_eps = intermediate_size, rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kw)


def toy_spec_from_config(config, *, dtype=None, layers=LAYERS, **_):
    d, eps = config.hidden_size, config.rms_norm_eps
    blocks = []
    for i, extra in enumerate(layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(name=f"{p}.self_attn", hidden_size=d, num_heads=config.num_attention_heads,
                             num_kv_heads=config.num_key_value_heads, head_dim=d // config.num_attention_heads, **extra)
        mlp = MLPSpec(name=f"{p}.mlp", hidden_size=d, intermediate_size=config.intermediate_size, activation="swiglu")
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.input_layernorm", hidden_size=d, eps=eps), mixer=attn),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.post_attention_layernorm", hidden_size=d, eps=eps),
                         mixer=mlp))))
    return ModelSpec(
        family=MODEL_TYPE, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyWindowForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=config.vocab_size, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=config.vocab_size, hidden_size=d, tied_to=None),
        dtype=dtype or torch.bfloat16, max_position_embeddings=config.max_position_embeddings)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    AutoConfig.register(MODEL_TYPE, ToyWindowConfig, exist_ok=True)
    register_model(MODEL_TYPE, toy_spec_from_config, ARCH)
    config = ToyWindowConfig(architectures=["ToyWindowForCausalLM"], torch_dtype="bfloat16")
    spec = toy_spec_from_config(config)
    sd = random_toy_weights(spec)
    d = tmp_path_factory.mktemp("toy_window")
    write_toy_checkpoint(d, config, sd)
    return d, spec, sd, config


def _prompts(n: int, length: int) -> list[list[int]]:
    return toy_prompts(n, length, seed=5)


def test_spec_declares_the_cache_kinds(toy):
    from unified_models.caches import PagedKVCache
    from unified_models.layers import model_caches

    _, spec, sd, _ = toy
    caches = model_caches(spec)
    assert caches[(0, "attn")] == PagedKVCache(num_kv_heads=2, head_dim=16, sliding_window=W)
    assert caches[(1, "attn")] == PagedKVCache(num_kv_heads=2, head_dim=16, sliding_window=W, shared_kv=True)
    assert caches[(2, "attn")] == PagedKVCache(num_kv_heads=2, head_dim=16)
    assert len({c.group_key() for c in caches.values()}) == 3
    assert "model.layers.1.self_attn.v_proj.weight" not in sd and "model.layers.0.self_attn.v_proj.weight" in sd
    with pytest.raises(SpecError, match=r"sliding_window=0 must be None .*or an int >= 1"):
        AttentionSpec(name="a", hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, sliding_window=0)
    with pytest.raises(SpecError, match="shared_kv=True with kv_cache_dtype='fp8_e4m3' is not supported"):
        AttentionSpec(name="a", hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, shared_kv=True,
                      kv_cache_dtype="fp8_e4m3")


def _engine_logits(spec, sd, ids):
    return trainer_logits(spec, sd, ids)


def test_engine_forward_matches_fp64_reference_and_window_is_applied(toy):
    _, spec, sd, config = toy
    ids = torch.tensor(_prompts(1, 27)[0])
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.logits(ids)
    bound = 8 * BF16_ULP * want.abs().max().item()
    err = (_engine_logits(spec, sd, ids) - want).abs().max().item()
    assert err < bound, (err, bound)
    # the same weights without windows (layer 1 still K = V) give another model past position W
    full_spec = toy_spec_from_config(config, layers=({}, {"shared_kv": True}, {}))
    full = ReferenceModel(full_spec, dtype=torch.float64)
    full.load_state_dict_hf(sd)
    other = full.logits(ids)
    assert (other[:W] - want[:W]).abs().max().item() < 1e-9  # inside the window: the same attention
    assert (other[W:] - want[W:]).abs().max().item() > 4 * bound


@pytest.mark.parametrize("chunked", [False, True])
def test_vllm_groups_and_diff_zero_through_both_engines(toy, chunked):
    """``chunked``: prompts split over steps of 8 tokens (vLLM frees blocks behind the window
    between chunks; unseeded sampling, as seeded sampling with chunked prefill crashes on the CPU)."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm import compat
    from unified_models.backends.vllm.rollout import RolloutEngine
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec

    d, spec, sd, _ = toy
    prompts = _prompts(3, 9)  # 9, 12, 15 tokens: longer than W; 14 decode steps go far past it
    new = 14
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=8) if chunked else {}
    with RolloutEngine(spec, d, device=ENGINE_DEVICE, seed=3, max_model_len=max(map(len, prompts)) + new,
                       max_num_seqs=len(prompts), **kw) as engine:
        groups = compat.model_runner(engine.llm).kv_cache_config.kv_cache_groups
        by_layer = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
        ro = engine.generate(prompts, max_new_tokens=new, seed=None if chunked else 7, temperature=0.8,
                             full_vocab_rows=6)
    s0 = by_layer["model.layers.0.self_attn.attn"]
    s1 = by_layer["model.layers.1.self_attn.attn"]
    s2 = by_layer["model.layers.2.self_attn.attn"]
    assert type(s0) is SlidingWindowSpec and s0.sliding_window == W and s0.num_kv_heads == 2 and s0.head_size == 16
    assert type(s1) is SlidingWindowMLASpec and s1.sliding_window == W and s1.num_kv_heads == 2
    assert type(s2) is FullAttentionSpec and s2.sliding_window is None
    assert len(groups) == 3
    # one page size for all groups: the one-vector cache holds twice the tokens per block
    assert s0.page_size_bytes == s1.page_size_bytes == s2.page_size_bytes
    assert s1.block_size == 2 * s0.block_size
    rec = recompute_logprobs(spec, sd, prompts, ro.completions, device=ENGINE_DEVICE, temperature=0.8,
                             full_rows_for=ro.full_row_keys)
    n = 0
    for i, lp in enumerate(ro.logprobs):
        assert len(lp) == new
        assert torch.equal(torch.tensor(lp, dtype=torch.float32), rec.logprobs[i].float().cpu()), i
        n += len(lp)
    assert n == 3 * new and ro.full_row_keys
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k].cpu(), rec.full_rows[k].cpu()), k
