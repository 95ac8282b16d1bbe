"""mHC as the residual policy of a toy model, run by both engines.

A toy family declared as a newcomer would (``docs/architecture.md``): a transformers config
(``model_type="toy_mhc_lm"``) registered with ``AutoConfig``, blocks of two sublayers with
DeepSeek-V4's names (``self_attn`` after ``input_layernorm``, ``mlp`` after
``post_attention_layernorm``; the package's attention and MLP families) and the
:class:`~unified_models.dsl.HyperConnectionSpec` residual with ``hc_mult = 4`` streams
(parameters ``model.layers.{i}.hc_attn_*`` / ``.hc_ffn_*`` and ``model.hc_head.*``, as
transformers' ``DeepseekV4ForCausalLM``), and one ``register_model`` line.

Checked: the engine forward is close to the fp64 oracle (the reference model over the
mHC oracle); replacing the Sinkhorn matrix by the identity (no stream mixing) gives
another model, so the mixing is in the path; and vLLM's rollout and the Megatron
trainer's recompute agree bitwise on every sampled token and whole row (diff = 0).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models import ops
from unified_models.backends.reference import ReferenceModel
from unified_models.consistency.metrics import compare_logprobs, full_vocab_max_abs_diff
from unified_models.dsl import (AttentionSpec, BlockSpec, EmbeddingSpec, HyperConnectionSpec, LMHeadSpec, MLPSpec,
                                ModelSpec, RMSNormSpec, SpecError, SublayerSpec)
from unified_models.forward import forward_hidden, logits_fp32
from unified_models.layers import register_residual
from unified_models.layers.residual import RESIDUALS, HyperConnectionResidual
from unified_models.models import register_model
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch
from toy_models import BF16_ULP, random_toy_weights, toy_prompts, trainer_logits, write_toy_checkpoint

MODEL_TYPE = "toy_mhc_lm"
ARCH = "UnifiedToyMHCForCausalLM"


class ToyMHCConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=512,
                 hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.rms_norm_eps = intermediate_size, rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps = hc_mult, hc_sinkhorn_iters, hc_eps
        super().__init__(**kwargs)


def toy_spec_from_config(config, *, dtype=None, **_):
    d, eps = config.hidden_size, config.rms_norm_eps
    blocks, sites = [], []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(name=f"{p}.self_attn", hidden_size=d, num_heads=config.num_attention_heads,
                             num_kv_heads=config.num_key_value_heads, head_dim=d // config.num_attention_heads)
        mlp = MLPSpec(name=f"{p}.mlp", hidden_size=d, intermediate_size=config.intermediate_size, activation="swiglu")
        subs = (SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.input_layernorm", hidden_size=d, eps=eps), mixer=attn),
                SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.post_attention_layernorm", hidden_size=d, eps=eps),
                             mixer=mlp))
        blocks.append(BlockSpec(index=i, sublayers=subs))
        sites += [(f"{p}.input_layernorm", f"{p}.hc_attn"), (f"{p}.post_attention_layernorm", f"{p}.hc_ffn")]
    residual = HyperConnectionSpec(hc_mult=config.hc_mult, hidden_size=d, sinkhorn_iters=config.hc_sinkhorn_iters,
                                   hc_eps=config.hc_eps, norm_eps=eps, sites=tuple(sites))
    return ModelSpec(
        family=MODEL_TYPE, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyMHCForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=config.vocab_size, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=config.vocab_size, hidden_size=d, tied_to=None),
        residual=residual, dtype=dtype or torch.bfloat16, max_position_embeddings=config.max_position_embeddings)


def _weights(spec, seed=0):
    """Random bf16 weights: norms ~1, projections ~ N(0, (2/sqrt(fan_in))^2) (logits far from uniform);
    HC ``fn`` gives mixing logits ~ N(0, 2^2), ``base`` ~ N(0, 0.5^2), ``scale`` ~ 1."""
    def special(name, shape, g):
        if name.endswith("scale"):
            return 1.0 + 0.1 * torch.randn(shape, generator=g)
        if name.endswith("base"):
            return 0.5 * torch.randn(shape, generator=g)
        return None

    return random_toy_weights(spec, gain=2.0, seed=seed, special=special)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Register the config and the model; write a checkpoint (with the tokenizer)."""
    AutoConfig.register(MODEL_TYPE, ToyMHCConfig, exist_ok=True)
    register_model(MODEL_TYPE, toy_spec_from_config, ARCH)
    config = ToyMHCConfig(architectures=["ToyMHCForCausalLM"], torch_dtype="bfloat16")
    spec = toy_spec_from_config(config)
    sd = _weights(spec)
    d = tmp_path_factory.mktemp("toy_mhc")
    write_toy_checkpoint(d, config, sd)
    return d, spec, sd


def _prompts(n: int, length: int) -> list[list[int]]:
    return toy_prompts(n, length, seed=3)


def _engine_logits(spec, sd, ids):
    return trainer_logits(spec, sd, ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IdentityCombSpec(HyperConnectionSpec):
    """mHC with the Sinkhorn matrix replaced by the identity: streams are no longer mixed."""


def _identity_comb_pre(*args, **kwargs):
    x, post, comb = ops.hc_pre(*args, **kwargs)
    return x, post, torch.eye(comb.shape[-1]).expand_as(comb)


def test_mhc_toy_spec_names_and_forward_against_oracle(toy):
    _, spec, sd = toy
    names = spec.parameter_shapes()
    assert names["model.layers.1.hc_ffn_fn"] == (24, 256) and names["model.hc_head.hc_scale"] == (1,)
    assert sum(".hc_attn_" in n or ".hc_ffn_" in n for n in names) == 2 * 2 * 3
    ids = torch.tensor(_prompts(1, 24)[0])
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.logits(ids)
    top = want.softmax(-1).max(-1).values.mean().item()
    assert top > 0.2, f"toy logits are near-uniform (mean max-prob {top:.3f}); the bound would mean nothing"
    scale = want.abs().max().item()
    # bf16 roundings per sublayer: the collapse, the norm, the mixer's projections, post * y,
    # comb^T h and their sum (x 4 streams), over 4 sublayers and the head. Measured 0.94 at
    # logits of 39.6 (6 ulps of the largest logit); bound: 12 bf16 ulps of the largest logit.
    bound = 12 * BF16_ULP * scale
    got = _engine_logits(spec, sd, ids)
    err = (got - want).abs().max().item()
    print(f"engine vs fp64 oracle: max |logit diff| {err:.4g} at max |logit| {scale:.4g} (bound {bound:.4g})")
    assert err < bound, (err, bound)
    # the Sinkhorn mixing is in the path: the identity instead gives another model
    register_residual(IdentityCombSpec, HyperConnectionResidual(pre=_identity_comb_pre))
    try:
        fields = {f.name: getattr(spec.residual, f.name) for f in dataclasses.fields(spec.residual)}
        no_mix = _engine_logits(spec.replace(residual=IdentityCombSpec(**fields)), sd, ids)
    finally:
        RESIDUALS.pop(IdentityCombSpec, None)
    moved = (no_mix - want).abs().max().item()  # measured 18.6
    print(f"identity comb vs oracle: max |logit diff| {moved:.4g}")
    assert moved > 4 * bound, (moved, bound)


def test_mhc_toy_diff_zero_through_both_engines(toy):
    """vLLM (our generic model class) samples; the Megatron module recomputes: diff = 0."""
    d, spec, _ = toy
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm.rollout import rollout
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    _, spec2, sd = spec_and_state_dict(d)
    assert spec2 == spec
    prompts = _prompts(4, 9)
    ro = rollout(d, prompts, max_new_tokens=12, seed=7, device="cpu", temperature=0.8)
    keys = ro.full_row_keys
    rec = recompute_logprobs(spec, sd, prompts, ro.completions, temperature=0.8, full_rows_for=keys)
    assert all(len(lp) == 12 for lp in ro.logprobs)
    diff = compare_logprobs(torch.cat([torch.tensor(lp, dtype=torch.float32) for lp in ro.logprobs]),
                            torch.cat([rec.logprobs[i].float() for i in range(len(prompts))]))
    print("diff:", diff.as_dict())
    assert diff.tokens_compared == 48
    assert diff.bitwise_equal and diff.num_mismatched == 0
    assert diff.max_abs_diff == diff.mean_abs_diff == diff.std_abs_diff == diff.k3_kl == 0.0
    assert keys
    full = full_vocab_max_abs_diff([ro.full_rows[k] for k in keys], [rec.full_rows[k] for k in keys])
    assert full == 0.0
    for k in keys:
        assert torch.equal(ro.full_rows[k], rec.full_rows[k]), k


def test_mhc_sites_must_be_the_sublayers():
    """ModelSpec refuses an mHC residual whose sites miss a sublayer (names it)."""
    spec = toy_spec_from_config(ToyMHCConfig())
    rs = spec.residual
    short = dataclasses.replace(rs, sites=rs.sites[:-1])
    with pytest.raises(SpecError, match=r"missing \['model.layers.1.post_attention_layernorm'\]"):
        spec.replace(residual=short)
    with pytest.raises(SpecError, match=r"order differs"):
        spec.replace(residual=dataclasses.replace(rs, sites=(rs.sites[1], rs.sites[0], *rs.sites[2:])))
    with pytest.raises(SpecError, match=r"no site for the sublayer of layer 0 normed by 'x'"):
        rs.site(SublayerSpec(index=0, norm=RMSNormSpec(name="x", hidden_size=64, eps=1e-6), mixer=None))


def test_mhc_init_rules_are_transformers():
    """base 0 and scale 1 (``DeepseekV4PreTrainedModel._init_weights``); fn keeps the generic normal."""
    spec = toy_spec_from_config(ToyMHCConfig())
    rules = HyperConnectionResidual.init_rules(spec.residual)
    assert set(rules) == {n for n in spec.residual.parameter_shapes() if n.endswith(("base", "scale"))}
    p = torch.full((3,), 7.0)
    rules["model.layers.0.hc_attn_scale"](p)
    assert torch.equal(p, torch.ones(3))
    rules["model.hc_head.hc_base"](p)
    assert torch.equal(p, torch.zeros(3))


def test_mhc_gradients_reach_every_hc_parameter(toy):
    """Backward through the whole engine forward: every HC parameter gets a finite, non-zero gradient
    (the op-level gradients are checked against fp64 autograd in ``tests/ops/test_mhc.py``)."""
    _, spec, sd = toy
    hc = list(spec.residual.parameter_shapes())
    params = {n: t.clone().requires_grad_(n in hc) for n, t in sd.items()}
    ids = torch.tensor(_prompts(1, 10)[0])
    batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, ids.numel()]))
    store = PrivateStateStore(spec, [ids.numel()], block_size=16)
    store.bind(batch)
    logits = logits_fp32(spec, params, forward_hidden(spec, params, batch, store))
    torch.log_softmax(logits, -1)[torch.arange(9), ids[1:]].sum().backward()
    assert len(hc) == 2 * 2 * 3 + 3
    for n in hc:
        g = params[n].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0, n
