"""The DeepSeek-V4 attention family (sliding layer type) against transformers and through both engines
(the CSA / HCA layer types: ``tests/test_deepseek_compressed_attention.py``).

* Names and shapes: :class:`DeepseekV4AttentionSpec` declares exactly the ``attn.*``
  tensors that transformers 5.19's ``save_pretrained`` writes for a tiny random
  ``DeepseekV4ForCausalLM`` (the official checkpoint names), with the sink in fp32.
* Peer, module by module: transformers' ``DeepseekV4Attention`` of a ``sliding_attention``
  layer in fp32 (eager, its sliding-window mask) against our fp32 and fp64 oracles and
  our fp32 engine forward, parameters copied by checkpoint name from the saved model; a
  prompt of 20 tokens crosses the window W = 6. Tolerance: max |diff| <= 2e-5 x max |out|
  (measured: about 1e-7, i.e. fp32 rounding).
* Gradients of the fp32 engine forward (input and every parameter, the sink included)
  match fp64 autograd of the oracle (relative error < 1e-5).
* The tests can fail: without the sink or without the output de-rotation the
  forward is far from transformers.
* A toy model registered from this file (``model_type="toy_dsv4_attn_lm"``): two layers
  of this attention + a SwiGLU MLP sublayer under the plain residual, through the vLLM
  rollout and the Megatron recompute with diff = 0 (every sampled token and every
  recorded row), prompts longer than W and decode far past it, in one prefill and in
  chunks of 8 tokens; the engine forward is within 8 bf16 ulps of the fp64 reference.
"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models.backends.reference import ReferenceModel
from unified_models.dsl import (BlockSpec, DeepseekV4AttentionSpec, EmbeddingSpec, LMHeadSpec, MLPSpec, ModelSpec,
                                RMSNormSpec, SpecError, SublayerSpec)
from unified_models.layers import deepseek_attention as dsa
from unified_models.layers import model_caches
from unified_models.layers.common import LayerContext
from unified_models.models import register_model
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch
from toy_models import BF16_ULP, random_toy_weights, toy_prompts, trainer_logits, write_toy_checkpoint

ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the engine tests run: the same test checks vLLM 0.32 on the CPU and 0.26 on an H200."""

MODEL_TYPE = "toy_dsv4_attn_lm"
ARCH = "UnifiedToyDsv4AttnForCausalLM"
W = 6
PEER_TOL = 2e-5
SIZES = dict(hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2,
             o_lora_rank=8, sliding_window=W, rms_norm_eps=1e-6, rope_theta=10000.0)


def attention_spec(i: int, **over) -> DeepseekV4AttentionSpec:
    s = {**SIZES, **over}
    return DeepseekV4AttentionSpec(
        name=f"model.layers.{i}.attn", hidden_size=s["hidden_size"], num_heads=s["num_attention_heads"],
        head_dim=s["head_dim"], q_lora_rank=s["q_lora_rank"], qk_rope_head_dim=s["qk_rope_head_dim"],
        o_groups=s["o_groups"], o_lora_rank=s["o_lora_rank"], sliding_window=s["sliding_window"],
        rope_theta=s["rope_theta"], rms_norm_eps=s["rms_norm_eps"], attention_sink=s.get("attention_sink", True))


# ----------------------------------------------------------------------------- transformers' tiny model

@pytest.fixture(scope="module")
def hf_layer(tmp_path_factory):
    """A tiny random transformers ``DeepseekV4ForCausalLM`` (sliding layers), every attention
    tensor random (sinks and norms too), saved; returns (its layer-0 attention, its rotary
    embedding, the saved checkpoint's tensors by name)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=16, partial_rotary_factor=8 / 32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, sliding_window=W, o_groups=2, o_lora_rank=8,
        layer_types=["sliding_attention"], mlp_layer_types=["moe"], hc_mult=2, index_n_heads=2, index_head_dim=16,
        index_topk=4, max_position_embeddings=256, rms_norm_eps=1e-6)
    assert cfg.qk_rope_head_dim == 8 and cfg.rope_parameters["main"]["rope_theta"] == 10000.0
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if "sinks" in name else 1.0 / max(1, p.shape[-1]) ** 0.5)
                    + (1.0 if "norm" in name else 0.0))
    d = tmp_path_factory.mktemp("hf_dsv4")
    model.save_pretrained(d)
    return attn, model.model.rotary_emb, load_file(str(d / "model.safetensors"))


def _hf_attention(attn, rotary, x_1TD):
    t = x_1TD.shape[1]
    pos = torch.arange(t)[None]
    emb = {k: rotary(x_1TD, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(t)
    mask = torch.where((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return attn(x_1TD, position_embeddings=emb, position_ids=pos, attention_mask=mask)[0][0]


def test_names_shapes_and_dtypes_are_the_checkpoints(hf_layer):
    _, _, saved = hf_layer
    spec = attention_spec(0)
    want = {k: tuple(v.shape) for k, v in saved.items() if k.startswith("model.layers.0.attn.")}
    assert spec.parameter_shapes() == want
    assert set(want) == {f"model.layers.0.attn.{n}" for n in ("wq_a.weight", "q_norm.weight", "wq_b.weight",
                                                              "wkv.weight", "norm.weight", "wo_a.weight",
                                                              "wo_b.weight", "attn_sink")}
    assert spec.trainable_parameter_dtypes() == {"model.layers.0.attn.attn_sink": torch.float32}
    assert "model.layers.0.attn.attn_sink" not in attention_spec(0, attention_sink=False).parameter_shapes()


def _engine_attention(spec_a: DeepseekV4AttentionSpec, params, x_TD):
    """The engine forward of one sublayer over a private cache (one sequence from position 0)."""
    model = _toy_model_spec([spec_a], dtype=x_TD.dtype)
    t = x_TD.shape[0]
    batch = FlatBatch.from_cu_seqlens(torch.zeros(t, dtype=torch.long), torch.tensor([0, t]))
    store = PrivateStateStore(model, [t], block_size=16)
    store.bind(batch)
    with torch.no_grad():
        return dsa.deepseek_attention_forward(spec_a, 0, params, x_TD, batch, store, LayerContext(model=model))


def _peer_inputs(hf_layer, t=20):
    attn, rotary, saved = hf_layer
    x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(3))
    want = _hf_attention(attn, rotary, x).double()
    params = {k: v.float() for k, v in saved.items() if k.startswith("model.layers.0.attn.")}
    return x[0], want, params


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


def test_module_matches_transformers_fp32(hf_layer):
    x, want, params = _peer_inputs(hf_layer)
    spec = attention_spec(0)
    errs = {
        "oracle fp32": _rel(dsa.deepseek_attention_oracle(spec, params, x), want),
        "oracle fp64": _rel(dsa.deepseek_attention_oracle(spec, {k: v.double() for k, v in params.items()},
                                                          x.double()), want),
        "engine fp32": _rel(_engine_attention(spec, params, x), want),
    }
    print("max |ours - transformers| / max |transformers|:", errs)
    assert all(e <= PEER_TOL for e in errs.values()), errs
    assert float(want.abs().max()) > 0.1  # a real signal


def test_without_sink_or_derotation_the_output_is_not_transformers(hf_layer, monkeypatch):
    x, want, params = _peer_inputs(hf_layer)
    no_sink = attention_spec(0, attention_sink=False)
    assert _rel(dsa.deepseek_attention_oracle(no_sink, params, x), want) > 100 * PEER_TOL
    assert _rel(_engine_attention(no_sink, params, x), want) > 100 * PEER_TOL
    real = dsa.rope_tail
    monkeypatch.setattr(dsa, "rope_tail", lambda x_, pos, s, c, inverse=False: x_ if inverse else real(x_, pos, s, c))
    assert _rel(_engine_attention(attention_spec(0), params, x), want) > 100 * PEER_TOL


def test_engine_gradients_match_fp64_oracle(hf_layer):
    """fp32 engine forward (attention backward by recomputation, sink included) vs fp64
    autograd of the oracle: gradients of the input and of every parameter."""
    x, _, params = _peer_inputs(hf_layer)
    spec = attention_spec(0)
    model = _toy_model_spec([spec], dtype=torch.float32)
    t = x.shape[0]
    batch = FlatBatch.from_cu_seqlens(torch.zeros(t, dtype=torch.long), torch.tensor([0, t]))
    store = PrivateStateStore(model, [t], block_size=16)
    store.bind(batch)
    g = torch.randn(t, 64, generator=torch.Generator().manual_seed(4))
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    xs = x.clone().requires_grad_()
    dsa.deepseek_attention_forward(spec, 0, ps, xs, batch, store, LayerContext(model=model)).backward(g)
    p64 = {k: v.double().requires_grad_() for k, v in params.items()}
    x64 = x.double().requires_grad_()
    dsa.deepseek_attention_oracle(spec, p64, x64).backward(g.double())
    for name, got, want in [("x", xs.grad, x64.grad)] + [(k, ps[k].grad, p64[k].grad) for k in params]:
        assert got is not None, name
        err = float((got.double() - want).norm() / want.norm())
        assert err < 1e-5, f"{name}: gradient rel. error {err:.2e}"


def test_spec_errors_name_the_field():
    # a compressed layer type needs its compress ratio (tests/test_deepseek_compressed_attention.py covers the rest)
    with pytest.raises(SpecError, match="compress_ratio=0 must be an int >= 2 for layer_type='compressed_sparse"):
        DeepseekV4AttentionSpec(**{**_kw(), "layer_type": "compressed_sparse_attention"})
    with pytest.raises(SpecError, match="compress_ratio=0 must be an int >= 2 for layer_type='heavily_compressed"):
        DeepseekV4AttentionSpec(**{**_kw(), "layer_type": "heavily_compressed_attention"})
    with pytest.raises(SpecError, match="rope_type='yarn'.*compress_rope_theta"):
        DeepseekV4AttentionSpec(**{**_kw(), "rope_type": "yarn"})
    with pytest.raises(SpecError, match="o_groups=3 does not divide"):
        DeepseekV4AttentionSpec(**{**_kw(), "o_groups": 3})
    with pytest.raises(SpecError, match="qk_rope_head_dim=7 must be even"):
        DeepseekV4AttentionSpec(**{**_kw(), "qk_rope_head_dim": 7})
    with pytest.raises(SpecError, match="sliding_window=0 must be an int >= 1"):
        DeepseekV4AttentionSpec(**{**_kw(), "sliding_window": 0})


def _kw():
    s = attention_spec(0)
    return {f: getattr(s, f) for f in s.__dataclass_fields__}


# ----------------------------------------------------------------------------- the toy model, both engines

class ToyDsv4AttnConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, num_hidden_layers=2, intermediate_size=96, max_position_embeddings=512,
                 **kw):
        self.vocab_size, self.num_hidden_layers = vocab_size, num_hidden_layers
        self.intermediate_size, self.max_position_embeddings = intermediate_size, max_position_embeddings
        for k, v in SIZES.items():
            setattr(self, k, kw.pop(k, v))
        super().__init__(**kw)


def _toy_model_spec(attns, *, dtype=torch.bfloat16, vocab=32064, intermediate=96, max_pos=512) -> ModelSpec:
    d, eps = SIZES["hidden_size"], SIZES["rms_norm_eps"]
    blocks = []
    for i, a in enumerate(attns):
        p = f"model.layers.{i}"
        mlp = MLPSpec(name=f"{p}.ffn", hidden_size=d, intermediate_size=intermediate, activation="swiglu")
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.attn_norm", hidden_size=d, eps=eps), mixer=a),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.ffn_norm", hidden_size=d, eps=eps), mixer=mlp))))
    return ModelSpec(
        family=MODEL_TYPE, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyDsv4AttnForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=vocab, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="head", vocab_size=vocab, hidden_size=d, tied_to=None),
        dtype=dtype, max_position_embeddings=max_pos)


def toy_spec_from_config(config, *, dtype=None, **_):
    return _toy_model_spec([attention_spec(i) for i in range(config.num_hidden_layers)],
                           dtype=dtype or torch.bfloat16, vocab=config.vocab_size,
                           intermediate=config.intermediate_size, max_pos=config.max_position_embeddings)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    AutoConfig.register(MODEL_TYPE, ToyDsv4AttnConfig, exist_ok=True)
    register_model(MODEL_TYPE, toy_spec_from_config, ARCH)
    config = ToyDsv4AttnConfig(architectures=["ToyDsv4AttnForCausalLM"], torch_dtype="bfloat16")
    spec = toy_spec_from_config(config)
    sd = random_toy_weights(spec, dtype=None, embed_prefixes=("model.embed", "head"),
                            special=lambda n, s, g: torch.randn(s, generator=g) if n.endswith("attn_sink") else None)
    d = tmp_path_factory.mktemp("toy_dsv4_attn")
    write_toy_checkpoint(d, config, sd)
    return d, spec, sd, config


def _prompts(n: int, length: int) -> list[list[int]]:
    return toy_prompts(n, length, seed=5)


def test_family_declarations(toy):
    from unified_models.caches import PagedKVCache
    from unified_models.layers import megatron_fields
    from unified_models.layers.quantization import quantizable_linears

    _, spec, sd, _ = toy
    caches = model_caches(spec)
    assert caches == {(i, "swa"): PagedKVCache(num_kv_heads=1, head_dim=32, sliding_window=W, shared_kv=True)
                      for i in range(2)}
    assert sd["model.layers.0.attn.attn_sink"].dtype == torch.float32
    assert sd["model.layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    f = megatron_fields(spec)
    assert (f["num_attention_heads"], f["num_query_groups"], f["kv_channels"]) == (4, 1, 32)
    rules = dsa.deepseek_attention_init_rules(spec.blocks[0].sublayers[0].mixer)
    sink = torch.ones(4)
    rules["model.layers.0.attn.attn_sink"](sink)
    assert torch.equal(sink, torch.zeros(4))
    # wo_a too: block FP8 in the published checkpoints, run dequantized (W8A16) as the reference runs it
    assert {n for n in quantizable_linears(spec) if n.startswith("model.layers.0.")} == \
        {f"model.layers.0.attn.{n}" for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}


def _engine_logits(spec, sd, ids):
    with torch.no_grad():
        return trainer_logits(spec, sd, ids)


def test_engine_forward_matches_fp64_reference(toy):
    _, spec, sd, _ = toy
    ids = torch.tensor(_prompts(1, 27)[0])
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.logits(ids)
    bound = 8 * BF16_ULP * want.abs().max().item()
    err = (_engine_logits(spec, sd, ids) - want).abs().max().item()
    assert err < bound, (err, bound)
    # the sink matters at this scale: the same weights without it give another model
    no_sink = _toy_model_spec([attention_spec(i, attention_sink=False) for i in range(2)])
    other = ReferenceModel(no_sink, dtype=torch.float64)
    other.load_state_dict_hf({k: v for k, v in sd.items() if not k.endswith("attn_sink")})
    assert (other.logits(ids) - want).abs().max().item() > 4 * bound


@pytest.mark.parametrize("chunked", [False, True])
def test_diff_zero_through_both_engines(toy, chunked):
    """``chunked``: prompts in steps of 8 tokens (vLLM frees blocks behind the window between
    chunks; unseeded sampling, as seeded sampling with chunked prefill crashes on the CPU)."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm import compat
    from unified_models.backends.vllm.rollout import RolloutEngine
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

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
    for i in range(2):
        s = by_layer[f"model.layers.{i}.attn.swa"]
        assert type(s) is SlidingWindowMLASpec and s.sliding_window == W and s.num_kv_heads == 1 and s.head_size == 32
    assert len(groups) == 1
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
