"""The compressed DeepSeek-V4 attention layer types (CSA, HCA) against transformers and through both engines.

* Names, shapes, dtypes: :class:`DeepseekV4AttentionSpec` declares exactly the ``attn.*``
  tensors that transformers 5.19's ``save_pretrained`` writes for a tiny random
  ``DeepseekV4ForCausalLM`` with a sliding, a CSA and an HCA layer; ``ape`` fp32, the
  indexer untrained.
* YaRN: ``ops.rope.yarn_inv_freq`` is bitwise transformers' ``_compute_yarn_parameters``.
* Peer, module by module: transformers' ``DeepseekV4Attention`` of each layer type in fp32
  (eager, stateless single-shot, its sliding-window mask) against our fp32 and fp64 oracles
  and our fp32 engine forward, parameters copied by checkpoint name from the saved model; a
  prompt of 41 tokens crosses the window W = 6 and completes 10 CSA entries (m = 4, top-3
  of them per token) and 5 HCA entries (m = 8). Tolerance: max |diff| <= 2e-5 x max |out|.
* The engine forward over the private store: prefill, chunked prefill (chunks of 5) and
  decode give the same bits (bf16), and gradients of the compressor's parameters (fp32
  engine) match fp64 autograd of the oracle.
"""

from __future__ import annotations

import pytest
import torch

from unified_models.dsl import (BlockSpec, DeepseekV4AttentionSpec, EmbeddingSpec, LMHeadSpec, MLPSpec, ModelSpec,
                                RMSNormSpec, SpecError, SublayerSpec, YarnRope)
from unified_models.layers import deepseek_attention as dsa
from unified_models.layers.common import LayerContext
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch

W = 6
PEER_TOL = 2e-5
TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RATIOS = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
YARN = YarnRope(factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0)
COMPRESS_THETA = 160000.0
SIZES = dict(hidden_size=64, num_heads=4, head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2,
             o_lora_rank=8, sliding_window=W, rms_norm_eps=1e-6)
INDEX = dict(index_n_heads=8, index_head_dim=16, index_topk=3)


def attention_spec(i: int, layer_type: str, **over) -> DeepseekV4AttentionSpec:
    kw = dict(SIZES, name=f"model.layers.{i}.attn", layer_type=layer_type, rope_theta=10000.0)
    if layer_type != "sliding_attention":
        kw.update(rope_theta=COMPRESS_THETA, rope_type="yarn", yarn=YARN, compress_ratio=RATIOS[layer_type])
    if layer_type == "compressed_sparse_attention":
        kw.update(INDEX)
    kw.update(over)
    return DeepseekV4AttentionSpec(**kw)


# ----------------------------------------------------------------------------- transformers' tiny model

@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random transformers ``DeepseekV4ForCausalLM`` (sliding, CSA, HCA layers; YaRN on the
    compress rope), every attention tensor random, saved; returns (model, saved tensors by name)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=16, partial_rotary_factor=8 / 32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, sliding_window=W, o_groups=2, o_lora_rank=8,
        layer_types=list(TYPES), compress_rates=dict(RATIOS), mlp_layer_types=["moe"] * 3, hc_mult=2,
        index_n_heads=8, index_head_dim=16, index_topk=3, max_position_embeddings=256, rms_norm_eps=1e-6,
        compress_rope_theta=COMPRESS_THETA,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1})
    assert cfg.rope_parameters["compress"]["attention_factor"] == 1.0 and cfg.qk_rope_head_dim == 8
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for name, p in layer.self_attn.named_parameters():
                p.copy_(torch.randn(p.shape) * (0.5 if "sinks" in name else 1.0 / max(1, p.shape[-1]) ** 0.5)
                        + (1.0 if "norm" in name else 0.0))
    d = tmp_path_factory.mktemp("hf_dsv4_compressed")
    model.save_pretrained(d)
    return model, load_file(str(d / "model.safetensors"))


def _hf_attention(model, i, x_1TD):
    t = x_1TD.shape[1]
    pos = torch.arange(t)[None]
    rotary = model.model.rotary_emb
    emb = {k: rotary(x_1TD, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    j = torch.arange(t)
    mask = torch.where((j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - W), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return model.model.layers[i].self_attn(x_1TD, position_embeddings=emb, position_ids=pos,
                                               attention_mask=mask)[0][0]


def _peer_inputs(hf_model, i, t=41):
    model, saved = hf_model
    x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(3 + i))
    want = _hf_attention(model, i, x).double()
    params = {k: v.float() for k, v in saved.items() if k.startswith(f"model.layers.{i}.attn.")}
    return x[0], want, params


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


def test_names_shapes_and_dtypes_are_the_checkpoints(hf_model):
    _, saved = hf_model
    for i, lt in enumerate(TYPES):
        spec = attention_spec(i, lt)
        want = {k: tuple(v.shape) for k, v in saved.items() if k.startswith(f"model.layers.{i}.attn.")}
        assert spec.parameter_shapes() == want, lt
    csa, hca = attention_spec(1, TYPES[1]), attention_spec(2, TYPES[2])
    p = "model.layers.1.attn"
    assert {k for k in csa.parameter_shapes() if ".indexer." in k} == {
        f"{p}.indexer.wq_b.weight", f"{p}.indexer.weights_proj.weight", f"{p}.indexer.compressor.wkv.weight",
        f"{p}.indexer.compressor.wgate.weight", f"{p}.indexer.compressor.ape", f"{p}.indexer.compressor.norm.weight"}
    assert csa.trainable_parameter_dtypes() == {f"{p}.attn_sink": torch.float32, f"{p}.compressor.ape": torch.float32}
    assert csa.parameter_dtypes() == {f"{p}.indexer.compressor.ape": torch.float32}
    assert csa.untrained_parameter_names() == {k for k in csa.parameter_shapes() if ".indexer." in k}
    assert hca.untrained_parameter_names() == set() and hca.parameter_dtypes() == {}
    assert hca.trainable_parameter_dtypes()["model.layers.2.attn.compressor.ape"] == torch.float32
    model = _model_spec([attention_spec(0, TYPES[1])])
    frozen = model.untrained_parameter_names()
    assert {k for k in frozen if k.startswith("model.layers.0.attn.")} == \
        {k.replace("layers.1", "layers.0") for k in csa.untrained_parameter_names()}
    dts = model.parameter_dtypes()
    assert dts["model.layers.0.attn.compressor.ape"] == torch.float32
    assert dts["model.layers.0.attn.indexer.compressor.ape"] == torch.float32
    assert dts["model.layers.0.attn.compressor.wkv.weight"] == torch.bfloat16


def test_yarn_inv_freq_is_transformers_bitwise(hf_model):
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from unified_models.ops.rope import rope_cos_sin_yarn, yarn_inv_freq, yarn_inv_freq_reference

    model, _ = hf_model
    want, factor = _compute_yarn_parameters(model.config, layer_type="compress")
    got = yarn_inv_freq(8, COMPRESS_THETA, 4.0, 64, 32.0, 1.0)
    assert factor == 1.0 and got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got, model.model.rotary_emb.compress_inv_freq)
    ref = yarn_inv_freq_reference(8, COMPRESS_THETA, 4.0, 64, 32.0, 1.0)
    assert float(((ref - want.double()) / ref).abs().max()) < 2 ** -23
    plain = 1.0 / (COMPRESS_THETA ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    assert float((ref - plain).abs().max()) > 1e-3  # the ramp really scales some frequencies
    cos, sin = rope_cos_sin_yarn(256, 8, COMPRESS_THETA, 4.0, 64, 32.0, 1.0)
    ang = torch.arange(256, dtype=torch.float64)[:, None] * want.double()[None]
    assert cos.shape == (256, 4) and torch.equal(cos, ang.cos().float()) and torch.equal(sin, ang.sin().float())
    assert rope_cos_sin_yarn(256, 8, COMPRESS_THETA, 4.0, 64, 32.0, 1.0)[0] is cos  # memoized


@pytest.mark.parametrize("i", [0, 1, 2], ids=TYPES)
def test_oracle_matches_transformers_fp32(hf_model, i):
    x, want, params = _peer_inputs(hf_model, i)
    spec = attention_spec(i, TYPES[i])
    errs = {"oracle fp32": _rel(dsa.deepseek_attention_oracle(spec, params, x), want),
            "oracle fp64": _rel(dsa.deepseek_attention_oracle(spec, {k: v.double() for k, v in params.items()},
                                                              x.double()), want)}
    print(TYPES[i], "max |ours - transformers| / max |transformers|:", errs)
    assert all(e <= PEER_TOL for e in errs.values()), errs
    assert float(want.abs().max()) > 0.1


def test_the_compressed_entries_matter(hf_model):
    """Without the compressor (a sliding spec on the same weights) or without the indexer's
    selection (CSA attending every entry, i.e. a large top-k), the output is not transformers'."""
    for i in (1, 2):
        x, want, params = _peer_inputs(hf_model, i)
        no_entries = DeepseekV4AttentionSpec(**{
            **_fields(attention_spec(i, TYPES[i])), "layer_type": "sliding_attention", "compress_ratio": 0,
            "rope_type": "default", "yarn": None, "index_n_heads": 0, "index_head_dim": 0, "index_topk": 0})
        assert _rel(dsa.deepseek_attention_oracle(no_entries, params, x), want) > 100 * PEER_TOL
    x, want, params = _peer_inputs(hf_model, 1)
    every = attention_spec(1, TYPES[1], index_topk=64)
    assert _rel(dsa.deepseek_attention_oracle(every, params, x), want) > 100 * PEER_TOL


def _fields(s):
    return {f: getattr(s, f) for f in s.__dataclass_fields__}


def test_spec_errors_name_the_field():
    csa = _fields(attention_spec(1, TYPES[1]))
    hca = _fields(attention_spec(2, TYPES[2]))
    sl = _fields(attention_spec(0, TYPES[0]))
    cases = [
        ({**sl, "layer_type": "full_attention"}, "layer_type='full_attention' is not one of"),
        ({**sl, "rope_type": "yarn", "yarn": YARN}, "rope_type='yarn': sliding_attention layers use plain RoPE"),
        ({**hca, "yarn": None}, "yarn=None must be a YarnRope exactly when rope_type='yarn'"),
        ({**hca, "rope_type": "longrope"}, "rope_type='longrope' is not one of"),
        ({**hca, "compress_ratio": 1}, "compress_ratio=1 must be an int >= 2"),
        ({**sl, "compress_ratio": 4}, "compress_ratio=4 must be 0 for sliding_attention"),
        ({**hca, "index_topk": 3}, "index_topk=3 must be 0: only compressed_sparse_attention"),
        ({**csa, "index_n_heads": 0}, "index_n_heads=0 must be an int >= 1 for compressed_sparse_attention"),
        ({**csa, "index_head_dim": 4}, "index_head_dim=4 must be at least qk_rope_head_dim=8"),
        ({**sl, "o_groups": 3}, "o_groups=3 does not divide"),
    ]
    for kw, msg in cases:
        with pytest.raises(SpecError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            DeepseekV4AttentionSpec(**kw)
    with pytest.raises(SpecError, match=r"attention_factor=1.2.*only 1.0 is supported"):
        YarnRope(factor=4.0, original_max_position_embeddings=64, attention_factor=1.2)
    with pytest.raises(SpecError, match=r"attention_factor=1.138.*only 1.0"):  # derived: 0.1 ln 4 + 1
        YarnRope(factor=4.0, original_max_position_embeddings=64, attention_factor=None)
    assert YarnRope(factor=4.0, original_max_position_embeddings=64, attention_factor=None, mscale=1.0,
                    mscale_all_dim=1.0).resolved_attention_factor == 1.0
    with pytest.raises(SpecError, match="beta_fast=0 must be a number > 0"):
        YarnRope(factor=4.0, original_max_position_embeddings=64, beta_fast=0)


def test_cache_declarations():
    from unified_models.caches import CompressedKVCache, IndexerKeyCache, PagedKVCache

    csa, hca = attention_spec(1, TYPES[1]), attention_spec(2, TYPES[2])
    swa = PagedKVCache(num_kv_heads=1, head_dim=32, sliding_window=W, shared_kv=True)
    assert dsa.deepseek_attention_caches(csa, torch.bfloat16) == {
        "swa": swa,
        "compressor_rows": PagedKVCache(num_kv_heads=1, head_dim=128, sliding_window=8, shared_kv=True,
                                        dtype=torch.float32),
        "compressed_kv": CompressedKVCache(ratio=4, head_dim=32),
        "indexer_rows": PagedKVCache(num_kv_heads=1, head_dim=64, sliding_window=8, shared_kv=True,
                                     dtype=torch.float32),
        "indexer_keys": IndexerKeyCache(ratio=4, head_dim=16)}
    assert dsa.deepseek_attention_caches(hca, torch.bfloat16) == {
        "swa": swa,
        "compressor_rows": PagedKVCache(num_kv_heads=1, head_dim=64, sliding_window=8, shared_kv=True,
                                        dtype=torch.float32),
        "compressed_kv": CompressedKVCache(ratio=8, head_dim=32)}
    rows = dsa.deepseek_attention_caches(csa, torch.bfloat16)["compressor_rows"]
    assert rows.element_dtype(torch.bfloat16) == torch.float32 and swa.element_dtype(torch.bfloat16) == torch.bfloat16
    assert rows.group_key() != PagedKVCache(num_kv_heads=1, head_dim=128, sliding_window=8, shared_kv=True).group_key()
    with pytest.raises(ValueError, match="dtype=torch.float32 and fp8=True are exclusive"):
        PagedKVCache(num_kv_heads=1, head_dim=8, fp8=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="must be None or a floating torch dtype"):
        PagedKVCache(num_kv_heads=1, head_dim=8, dtype=torch.int32)
    rules = dsa.deepseek_attention_init_rules(csa)
    ape = torch.ones(4, 64)
    rules["model.layers.1.attn.indexer.compressor.ape"](ape)
    assert torch.equal(ape, torch.zeros(4, 64)) and "model.layers.1.attn.compressor.norm.weight" in rules
    assert set(dsa.deepseek_attention_linears(csa)) == {f"model.layers.1.attn.{n}" for n in
                                                        ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b")}


# ----------------------------------------------------------------------------- the engine forward

def _model_spec(attns, *, dtype=torch.bfloat16, max_pos=256) -> ModelSpec:
    d, eps = SIZES["hidden_size"], SIZES["rms_norm_eps"]
    blocks = []
    for i, a in enumerate(attns):
        p = f"model.layers.{i}"
        mlp = MLPSpec(name=f"{p}.ffn", hidden_size=d, intermediate_size=96, activation="swiglu")
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.attn_norm", hidden_size=d, eps=eps), mixer=a),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.ffn_norm", hidden_size=d, eps=eps), mixer=mlp))))
    return ModelSpec(
        family="toy_dsv4_compressed", architecture="UnifiedToyDsv4CompressedForCausalLM",
        hf_model_type="toy_dsv4_compressed", hf_architecture="ToyDsv4CompressedForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=32064, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="head", vocab_size=32064, hidden_size=d, tied_to=None),
        dtype=dtype, max_position_embeddings=max_pos)


def _renamed(params, i):
    return {k.replace(f"model.layers.{i}.", "model.layers.0."): v for k, v in params.items()}


def _engine(spec_a, params, x_TD, chunks=None, block_size=16):
    """The engine forward of one sublayer (layer 0) over a private store, one sequence from
    position 0, in steps of ``chunks`` tokens (None: one prefill)."""
    model = _model_spec([spec_a], dtype=x_TD.dtype)
    t = x_TD.shape[0]
    store = PrivateStateStore(model, [t], block_size=block_size)
    ctx = LayerContext(model=model)
    outs, start = [], 0
    for n in (chunks or [t]):
        batch = FlatBatch.from_cu_seqlens(torch.zeros(n, dtype=torch.long), torch.tensor([0, n]),
                                          torch.tensor([start]))
        store.bind(batch)
        outs.append(dsa.deepseek_attention_forward(spec_a, 0, params, x_TD[start:start + n], batch, store, ctx))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("i", [1, 2], ids=TYPES[1:])
def test_engine_matches_transformers_fp32(hf_model, i):
    x, want, params = _peer_inputs(hf_model, i)
    spec = attention_spec(0, TYPES[i])
    with torch.no_grad():
        got = _engine(spec, _renamed(params, i), x)
    err = _rel(got, want)
    print(TYPES[i], "engine fp32 vs transformers:", err)
    assert err <= PEER_TOL


@pytest.mark.parametrize("i", [1, 2], ids=TYPES[1:])
def test_prefill_chunked_decode_bitwise(hf_model, i):
    """bf16: one prefill, chunks of 5 (crossing window, block and entry boundaries) and token by
    token give the same bits; block size 32 vs 16 too."""
    x, _, params = _peer_inputs(hf_model, i, t=30)
    spec = attention_spec(0, TYPES[i])
    p16 = {k: (v if v.dtype == torch.float32 and (k.endswith("ape") or k.endswith("sink")) else v.bfloat16())
           for k, v in _renamed(params, i).items()}
    xb = x.bfloat16()
    with torch.no_grad():
        full = _engine(spec, p16, xb)
        chunked = _engine(spec, p16, xb, chunks=[5] * 6)
        decode = _engine(spec, p16, xb, chunks=[7] + [1] * 23)
        other_blocks = _engine(spec, p16, xb, chunks=[13, 17], block_size=32)
    assert full.dtype == torch.bfloat16
    assert torch.equal(full, chunked) and torch.equal(full, decode) and torch.equal(full, other_blocks)


@pytest.mark.parametrize("i", [1, 2], ids=TYPES[1:])
def test_engine_gradients_match_fp64_oracle(hf_model, i):
    """fp32 engine forward vs fp64 autograd of the oracle: gradients of the input and of every
    trained parameter (the compressor's wkv, wgate, ape and norm included) over one prefill of
    24 tokens (6 CSA / 3 HCA entries; the indexer's parameters are frozen and get none)."""
    x, _, params = _peer_inputs(hf_model, i, t=24)
    spec = attention_spec(0, TYPES[i])
    params = _renamed(params, i)
    model = _model_spec([spec], dtype=torch.float32)
    frozen = model.untrained_parameter_names()
    t = x.shape[0]
    g = torch.randn(t, 64, generator=torch.Generator().manual_seed(4))
    ps = {k: v.clone().requires_grad_(k not in frozen) for k, v in params.items()}
    xs = x.clone().requires_grad_()
    _engine(spec, ps, xs).backward(g)
    p64 = {k: v.double().requires_grad_(k not in frozen) for k, v in params.items()}
    x64 = x.double().requires_grad_()
    dsa.deepseek_attention_oracle(spec, p64, x64).backward(g.double())
    trained = [k for k in params if k not in frozen]
    assert {f"model.layers.0.attn.compressor.{n}" for n in ("wkv.weight", "wgate.weight", "ape", "norm.weight")} \
        <= set(trained)
    for name, got, want in [("x", xs.grad, x64.grad)] + [(k, ps[k].grad, p64[k].grad) for k in trained]:
        assert got is not None, name
        err = float((got.double() - want).norm() / want.norm())
        assert err < 1e-5, f"{name}: gradient rel. error {err:.2e}"


# ----------------------------------------------------------------------------- the toy model, both engines

MODEL_TYPE = "toy_dsv4_compressed_lm"
ARCH = "UnifiedToyDsv4CompressedForCausalLM"
ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _toy_spec(dtype=torch.bfloat16, **_):
    return _model_spec([attention_spec(i, lt) for i, lt in enumerate(TYPES)], dtype=dtype or torch.bfloat16)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from transformers import AutoConfig, PretrainedConfig

    from unified_models.models import register_model
    from toy_models import random_toy_weights, write_toy_checkpoint

    class ToyConfig(PretrainedConfig):
        model_type = MODEL_TYPE

        def __init__(self, vocab_size=32064, num_hidden_layers=3, max_position_embeddings=256, **kw):
            self.vocab_size, self.num_hidden_layers = vocab_size, num_hidden_layers
            self.max_position_embeddings, self.hidden_size = max_position_embeddings, SIZES["hidden_size"]
            self.num_attention_heads, self.head_dim = SIZES["num_heads"], SIZES["head_dim"]
            super().__init__(**kw)

    AutoConfig.register(MODEL_TYPE, ToyConfig, exist_ok=True)
    register_model(MODEL_TYPE, lambda config, *, dtype=None, **_: _toy_spec(dtype), ARCH)
    config = ToyConfig(architectures=["ToyDsv4CompressedForCausalLM"], torch_dtype="bfloat16")
    spec = _toy_spec()
    sd = random_toy_weights(spec, dtype=None, embed_prefixes=("model.embed", "head"),
                            special=lambda n, s, g: torch.randn(s, generator=g) if n.endswith(("attn_sink", "ape"))
                            else None)
    d = tmp_path_factory.mktemp("toy_dsv4_compressed")
    write_toy_checkpoint(d, config, sd)
    return d, spec, sd


def test_toy_engine_forward_matches_fp64_reference(toy):
    """bf16 engine logits within 8 bf16 ulps of the fp64 reference (the indexer keeps every
    entry here: a bf16 near-tie would pick another entry than fp64, as MoE routing can; the
    selection itself is checked in fp32 above)."""
    from unified_models.backends.reference import ReferenceModel
    from toy_models import BF16_ULP, toy_prompts, trainer_logits

    _, _, sd = toy
    spec = _model_spec([attention_spec(i, lt, **({"index_topk": 16} if i == 1 else {}))
                        for i, lt in enumerate(TYPES)])
    ids = torch.tensor(toy_prompts(1, 33, seed=5)[0])
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.logits(ids)
    bound = 8 * BF16_ULP * want.abs().max().item()
    with torch.no_grad():
        err = (trainer_logits(spec, sd, ids) - want).abs().max().item()
    assert err < bound, (err, bound)


@pytest.mark.parametrize("chunked", [False, True])
def test_diff_zero_through_both_engines(toy, chunked):
    """Sliding + CSA + HCA layers through the vLLM rollout and the Megatron recompute: every
    sampled token's logprob and every recorded row bitwise equal; prompts of 9..15 tokens and
    14 decode steps cross the window, CSA and HCA entry boundaries (``chunked``: steps of 8
    tokens)."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm import compat
    from unified_models.backends.vllm.rollout import RolloutEngine
    from toy_models import toy_prompts

    d, spec, sd = toy
    prompts = toy_prompts(3, 9, seed=5)
    new = 14
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=8) if chunked else {}
    with RolloutEngine(spec, d, device=ENGINE_DEVICE, seed=3, max_model_len=max(map(len, prompts)) + new,
                       max_num_seqs=len(prompts), **kw) as engine:
        groups = compat.model_runner(engine.llm).kv_cache_config.kv_cache_groups
        by_layer = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
        ro = engine.generate(prompts, max_new_tokens=new, seed=None if chunked else 7, temperature=0.8,
                             full_vocab_rows=6)
    rows = by_layer["model.layers.1.attn.compressor_rows"]
    assert rows.dtype == torch.float32 and rows.head_size == 128 and rows.sliding_window == 8
    assert by_layer["model.layers.2.attn.compressed_kv"].dtype == torch.bfloat16
    rec = recompute_logprobs(spec, sd, prompts, ro.completions, device=ENGINE_DEVICE, temperature=0.8,
                             full_rows_for=ro.full_row_keys)
    for i, lp in enumerate(ro.logprobs):
        assert len(lp) == new
        assert torch.equal(torch.tensor(lp, dtype=torch.float32), rec.logprobs[i].float().cpu()), i
    assert ro.full_row_keys
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k].cpu(), rec.full_rows[k].cpu()), k


def test_prefix_cache_hits_give_the_trainers_bits(toy):
    """Prefix caching on (with chunked prefill, as vLLM requires it here): the second request of a
    prompt whose first 32 tokens (two blocks of 16, several window / CSA / HCA boundaries) are cached
    reuses the cached window K = V, compressor rows, compressed entries and indexer keys; its first
    row equals the uncached run's and every sampled token's logprob equals the trainer's recompute
    (which caches nothing) bitwise. vLLM's hit count is not read here (its stats are off in our engine)."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm.rollout import RolloutEngine
    from toy_models import toy_prompts

    d, spec, sd = toy
    base = toy_prompts(1, 40, seed=9)[0]
    prompts = [base, base[:36] + [11, 12, 13, 14, 15]]
    new = 10
    with RolloutEngine(spec, d, device=ENGINE_DEVICE, seed=3, max_model_len=64, max_num_seqs=2, block_size=16,
                       enable_prefix_caching=True, enable_chunked_prefill=True,
                       max_num_batched_tokens=16) as engine:
        first = engine.generate([prompts[0]], max_new_tokens=new, temperature=0.8, full_vocab_rows=-1)
        second = engine.generate(prompts, max_new_tokens=new, temperature=0.8, full_vocab_rows=-1)
    k0 = min(k for k in first.full_rows if k[0] == 0)  # the row that samples the first token: the prompt's alone
    assert k0 in second.full_rows and torch.equal(first.full_rows[k0].cpu(), second.full_rows[k0].cpu())
    rec = recompute_logprobs(spec, sd, prompts, second.completions, device=ENGINE_DEVICE, temperature=0.8,
                             full_rows_for=second.full_row_keys)
    for i, lp in enumerate(second.logprobs):
        assert torch.equal(torch.tensor(lp, dtype=torch.float32), rec.logprobs[i].float().cpu()), i
    for k in second.full_row_keys:
        assert torch.equal(second.full_rows[k].cpu(), rec.full_rows[k].cpu()), k
