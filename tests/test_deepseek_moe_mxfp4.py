"""The DeepSeek-V4 MoE layer with MXFP4 routed experts (DeepSeek-V4-Flash ``expert_dtype: fp4``).

* the family's format rules: the routed experts' ``w1``/``w3``/``w2`` only, one format per layer,
  the stored tensors' names, shapes and dtypes;
* the layer: stored codes and masters give the same bits, batch invariance (a token's output
  unchanged when 1000x larger tokens join its batch), close to the fp64 oracle on fake-quantized
  masters, the W4A8 rule really applied;
* a toy model (the package's attention + this MoE, layer 0 hash-routed) with stored MXFP4 experts
  through both engines: vLLM rollout vs Megatron recompute, diff = 0 on every sampled token and row.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models.consistency.metrics import compare_logprobs
from unified_models.converters.modelopt import dequantize_state_dict, master_spec, quantize_state_dict
from unified_models.dsl import (AttentionSpec, BlockSpec, DeepseekV4MoESpec, EmbeddingSpec, LMHeadSpec, ModelSpec,
                                RMSNormSpec, SpecError, SublayerSpec)
from unified_models.dsl.weights import LinearFormat
from unified_models.layers import LayerContext
from unified_models.layers.deepseek_moe import FAMILY
from unified_models.layers.quantization import check_weight_formats, quantizable_linears
from unified_models.models import register_model
from unified_models.ops.mxfp4 import MXFP4Master, MXFP4Weight
from unified_models.state import FlatBatch
from toy_models import random_toy_weights, toy_prompts, write_toy_checkpoint

MODEL_TYPE = "toy_dsv4_mxfp4_lm"
ARCH = "UnifiedToyDSV4MXFP4ForCausalLM"


class ToyDSV4MXFP4Config(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
                 routed_scaling_factor=1.5, swiglu_limit=10.0, num_hash_layers=1, rms_norm_eps=1e-6,
                 max_position_embeddings=512, expert_dtype="fp4", **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.moe_intermediate_size, self.n_routed_experts = moe_intermediate_size, n_routed_experts
        self.num_experts_per_tok, self.routed_scaling_factor = num_experts_per_tok, routed_scaling_factor
        self.swiglu_limit, self.num_hash_layers = swiglu_limit, num_hash_layers
        self.rms_norm_eps, self.max_position_embeddings = rms_norm_eps, max_position_embeddings
        self.expert_dtype = expert_dtype
        super().__init__(**kwargs)


def mxfp4_experts(spec: ModelSpec, *, stored: bool = True) -> ModelSpec:
    """``spec`` with every routed expert linear of every DeepSeek-V4 MoE in MXFP4."""
    return spec.with_weight_formats({
        m.expert_linear(e, p): LinearFormat("mxfp4", stored=stored)
        for m in (s.mixer for s in spec.sublayers_of(DeepseekV4MoESpec)) for e in range(m.n_routed_experts)
        for p in ("w1", "w3", "w2")})


def toy_spec_from_config(config, *, dtype=None, **_):
    d, eps = config.hidden_size, config.rms_norm_eps
    blocks = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(name=f"{p}.self_attn", hidden_size=d, num_heads=config.num_attention_heads,
                             num_kv_heads=config.num_key_value_heads, head_dim=d // config.num_attention_heads)
        moe = DeepseekV4MoESpec(name=f"{p}.ffn", hidden_size=d, n_routed_experts=config.n_routed_experts,
                                top_k=config.num_experts_per_tok, moe_intermediate_size=config.moe_intermediate_size,
                                routed_scaling_factor=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit,
                                hash_routing=i < config.num_hash_layers, vocab_size=config.vocab_size)
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.attn_norm", hidden_size=d, eps=eps), mixer=attn),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.ffn_norm", hidden_size=d, eps=eps), mixer=moe))))
    spec = ModelSpec(
        family=MODEL_TYPE, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyDSV4MXFP4ForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=config.vocab_size, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=config.vocab_size, hidden_size=d, tied_to=None),
        dtype=dtype or torch.bfloat16, max_position_embeddings=config.max_position_embeddings)
    if config.expert_dtype == "fp4":
        spec = mxfp4_experts(spec)
        check_weight_formats(spec)
    return spec


def _masters(spec, seed=0):
    """bf16 master weights of the (master-form) spec; the router bias fp32."""
    n_experts = spec.sublayers[1].mixer.n_routed_experts

    def special(name, shape, g):
        if name.endswith("tid2eid"):
            return torch.rand(shape[0], n_experts, generator=g).argsort(-1)[:, :shape[1]]
        if name.endswith("gate.bias"):
            return torch.randn(shape, generator=g) * 0.1
        return None

    sd = random_toy_weights(spec, gain=2.0, seed=seed, special=special, dtype=None)
    return {n: t.to(torch.bfloat16) if t.is_floating_point() and not n.endswith("gate.bias") else t
            for n, t in sd.items()}


@pytest.fixture(scope="module")
def toy():
    """(stored spec, master spec, masters, stored state dict)."""
    config = ToyDSV4MXFP4Config(architectures=["ToyDSV4MXFP4ForCausalLM"], torch_dtype="bfloat16")
    stored = toy_spec_from_config(config)
    masters_spec = master_spec(stored)
    masters = _masters(masters_spec)
    return stored, masters_spec, masters, quantize_state_dict(masters, stored)


# ----------------------------------------------------------------------------- format rules


def test_format_rules_routed_and_shared_experts(toy):
    stored, _, _, sd = toy
    m = stored.sublayers[1].mixer
    w1 = m.expert_linear(3, "w1")
    shapes, dtypes = stored.parameter_shapes(), stored.parameter_dtypes()
    assert (shapes[f"{w1}.weight"], dtypes[f"{w1}.weight"]) == ((128, 64), torch.uint8)
    assert (shapes[f"{w1}.weight_scale"], dtypes[f"{w1}.weight_scale"]) == ((128, 4), torch.float8_e8m0fnu)
    assert shapes[f"{m.expert_linear(3, 'w2')}.weight_scale"] == (128, 4)
    assert shapes[f"{m.shared_linear('w1')}.weight"] == (128, 128) and f"{m.shared_linear('w1')}.weight_scale" \
        not in shapes
    assert sd[f"{w1}.weight"].dtype == torch.uint8 and sd[f"{w1}.weight_scale"].dtype == torch.float8_e8m0fnu
    roles = quantizable_linears(stored)
    moes = [s.mixer for s in stored.sublayers_of(DeepseekV4MoESpec)]
    routed = {m2.expert_linear(e, p) for m2 in moes for e in range(8) for p in ("w1", "w3", "w2")}
    shared = {m2.shared_linear(p) for m2 in moes for p in ("w1", "w3", "w2")}
    assert set(roles) == routed | shared
    assert {roles[n] for n in routed} == {"experts"} and {roles[n] for n in shared} == {"shared_experts"}
    plain = stored.replace(weight_formats=())
    sh = {m.shared_linear(p): LinearFormat("fp8_block") for p in ("w1", "w3", "w2")}
    check_weight_formats(plain.with_weight_formats(sh))  # the published checkpoints' block-FP8 shared expert
    check_weight_formats(plain.with_weight_formats(  # Flash-Base: block-FP8 routed experts
        {m.expert_linear(e, p): LinearFormat("fp8_block") for e in range(8) for p in ("w1", "w3", "w2")}))
    for bad, msg in (
            ({m.shared_linear("w1"): LinearFormat("fp8_block")}, r"shared_experts: w1/w3/w2 in formats"),
            ({m.shared_linear(p): LinearFormat("mxfp4") for p in ("w1", "w3", "w2")},
             r"shared_experts: weight format 'mxfp4'"),
            ({f"{m.name}.gate": LinearFormat("mxfp4")}, "ffn.gate: a weight format on the router"),
            ({m.expert_linear(0, "w2"): LinearFormat("mxfp4")}, r"ffn: routed experts in formats"),
            ({m.expert_linear(e, p): LinearFormat("nvfp4") for e in range(8) for p in ("w1", "w3", "w2")},
             "routed experts in weight format 'nvfp4'")):
        with pytest.raises(SpecError, match=msg):
            check_weight_formats(plain.with_weight_formats(bad))
    with pytest.raises(SpecError, match="needs K = 64 to be a multiple of 128"):
        small = ToyDSV4MXFP4Config(hidden_size=64, moe_intermediate_size=128, num_hidden_layers=1)
        toy_spec_from_config(small).parameter_shapes()


def test_frozen_views_are_the_engine_buffers(toy):
    """An engine's expert buffers (one stacked buffer per field) become one ``MXFP4Weight`` view per
    projection: an in-place weight update (codes and scales) is seen without re-stacking."""
    from unified_models.layers.deepseek_moe import deepseek_moe_frozen_views
    from unified_models.parameters import allocate_parameters

    stored, _, _, sd = toy
    params = allocate_parameters(stored)
    m = stored.sublayers[3].mixer
    views = deepseek_moe_frozen_views(m, stored, params)
    w, kind = views[f"{m.name}.experts.w2"]
    assert isinstance(w, MXFP4Weight) and kind == "mxfp4" and w.shape == (8, 128, 128)
    for f in ("weight", "weight_scale"):
        params[f"{m.expert_linear(5, 'w2')}.{f}"].copy_(sd[f"{m.expert_linear(5, 'w2')}.{f}"])
    assert torch.equal(w.expert(5).weight, sd[f"{m.expert_linear(5, 'w2')}.weight"])
    assert torch.equal(w.expert(5).weight_scale.view(torch.uint8),
                       sd[f"{m.expert_linear(5, 'w2')}.weight_scale"].view(torch.uint8))


# ----------------------------------------------------------------------------- the layer


def _layer(spec, params, x, ids):
    sub = spec.sublayers[3]  # layer 1's MoE (regular top-k routing)
    batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, ids.numel()]))
    return FAMILY.forward(sub.mixer, sub.index, params, x, batch, None, LayerContext(model=spec))


def bits(t):
    return t.contiguous().view(torch.int16)


def test_layer_stored_equals_masters_batch_invariant_and_close_to_oracle(toy):
    from unified_models.backends.reference import ReferenceModel
    from unified_models.layers.moe import expert_weights

    stored, masters_spec, masters, sd = toy
    m = stored.sublayers[3].mixer
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 128, generator=g) * 0.7).bfloat16()
    ids = torch.randint(10, 30000, (12,), generator=g)
    y = _layer(stored, sd, x, ids)
    assert isinstance(expert_weights(m, stored, sd, "w1")[0], MXFP4Weight)
    assert isinstance(expert_weights(m, masters_spec, masters, "w1")[0], MXFP4Master)
    # the trainer's masters, quantized on the forward, give the stored codes' bits
    assert torch.equal(bits(_layer(masters_spec, masters, x, ids)), bits(y))
    # batch invariance: the same tokens among 1000x larger ones, in another order
    big = (torch.randn(9, 128, generator=g) * 700).bfloat16()
    order = torch.randperm(21, generator=g)
    xb, ib = torch.cat([x, big])[order], torch.cat([ids, ids[:9]])[order]
    yb = _layer(stored, sd, xb, ib)
    pos = torch.argsort(order)[:12]
    assert torch.equal(bits(yb[pos]), bits(y))
    # W4A8 is really applied: the dequantized weights in bf16 without the FP8 activations differ
    plain = stored.replace(weight_formats=())
    deq = dequantize_state_dict(sd, stored)
    y16 = _layer(plain, deq, x, ids)
    assert not torch.equal(bits(y16), bits(y))
    # the fp64 oracle on the fake-quantized masters (no FP8 activation rounding): close
    ref = ReferenceModel(masters_spec, dtype=torch.float64)
    ref.load_state_dict_hf(masters)
    want = ref.mixer_output(m, x.double(), ids)
    rel = ((y.double() - want).abs().max() / want.abs().max()).item()
    rel16 = ((y16.double() - want).abs().max() / want.abs().max()).item()
    print(f"MXFP4 W4A8 layer vs fp64 oracle (W4A16 fake-quantized): max rel {rel:.3g}; without the FP8 "
          f"activations {rel16:.3g}")
    assert rel < 5e-2 and rel16 < 1e-2, (rel, rel16)


def test_stored_codes_take_no_gradient_but_the_input_does(toy):
    stored, masters_spec, masters, sd = toy
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 128, generator=g) * 0.7).bfloat16().requires_grad_(True)
    ids = torch.randint(10, 30000, (6,), generator=g)
    _layer(stored, sd, x, ids).float().sum().backward()
    assert x.grad is not None and x.grad.abs().max() > 0
    params = {n: t.detach().clone().requires_grad_(t.is_floating_point() and t.dtype == torch.bfloat16)
              for n, t in masters.items()}
    _layer(masters_spec, params, x.detach(), ids).float().sum().backward()
    m = stored.sublayers[3].mixer
    for p in ("w1", "w3", "w2"):  # straight through to the masters of the experts the tokens reached
        reached = [e for e in range(m.n_routed_experts) if params[f"{m.expert_linear(e, p)}.weight"].grad is not None
                   and params[f"{m.expert_linear(e, p)}.weight"].grad.abs().max() > 0]
        assert len(reached) >= 2, (p, reached)


# ----------------------------------------------------------------------------- a toy model, both engines


@pytest.fixture(scope="module")
def toy_checkpoint(toy, tmp_path_factory):
    AutoConfig.register(MODEL_TYPE, ToyDSV4MXFP4Config, exist_ok=True)
    register_model(MODEL_TYPE, toy_spec_from_config, ARCH)
    stored, _, _, sd = toy
    config = ToyDSV4MXFP4Config(architectures=["ToyDSV4MXFP4ForCausalLM"], torch_dtype="bfloat16")
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy_dsv4_mxfp4"), config, sd)


def test_toy_mxfp4_diff_zero_through_both_engines(toy, toy_checkpoint):
    """vLLM (our generic model class) samples with the stored MXFP4 codes; the Megatron module
    recomputes on the same codes: diff = 0."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm.rollout import rollout
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    stored, _, _, _ = toy
    _, spec, sd = spec_and_state_dict(toy_checkpoint)
    assert spec == stored and sd["model.layers.1.ffn.experts.0.w1.weight_scale"].dtype == torch.float8_e8m0fnu
    prompts = toy_prompts(4, 9, seed=3)
    ro = rollout(toy_checkpoint, prompts, max_new_tokens=12, seed=7, device="cpu", temperature=0.8)
    keys = ro.full_row_keys
    rec = recompute_logprobs(spec, sd, prompts, ro.completions, temperature=0.8, full_rows_for=keys)
    assert all(len(lp) == 12 for lp in ro.logprobs)
    diff = compare_logprobs(torch.cat([torch.tensor(lp, dtype=torch.float32) for lp in ro.logprobs]),
                            torch.cat([rec.logprobs[i].float() for i in range(len(prompts))]))
    print("diff:", diff.as_dict())
    assert diff.tokens_compared == 48 and diff.bitwise_equal and diff.num_mismatched == 0
    assert diff.max_abs_diff == diff.mean_abs_diff == diff.std_abs_diff == diff.k3_kl == 0.0
    assert keys
    for k in keys:
        assert torch.equal(ro.full_rows[k], rec.full_rows[k]), k
