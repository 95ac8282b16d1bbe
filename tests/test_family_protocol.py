"""A toy family defined through the family protocol, outside the package, run by both engines.

Nothing in ``unified_models/`` knows this family. It is declared here the way a
newcomer would add one (``docs/architecture.md``):

* a transformers config class (``model_type="toy_parallel_lm"``) registered with ``AutoConfig``;
* a mixer spec :class:`ParallelAttnMLPSpec` (GPT-J-style parallel pair: attention and
  an MLP on the same normed input, summed in fp32 and rounded once) and its
  :class:`~unified_models.layers.LayerFamily`: forward over the package's layer
  functions, oracle over their oracles, the attention's cache declarations,
  Megatron fields;
* a residual policy with **two streams** (:class:`TwoStreamSpec`): each sublayer
  reads the mean of both streams; its output goes into stream 0 and the streams
  swap; the head reads their mean. Row-wise elementwise math (DESIGN rule 2).
* blocks of two sublayers (the parallel pair, then a plain MLP) and one
  ``register_model`` line.

Then vLLM (our generic model class) samples and the Megatron module recomputes:
diff = 0 on every sampled token and every whole row; the engine forward is close
to the fp64 oracle (the reference model runs the same declarations); and dropping
the second stream (a plain residual) changes the result, so the policy is really
in the path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models.backends.reference import ReferenceModel
from unified_models.dsl import (PLAIN_RESIDUAL, AttentionSpec, BlockSpec, EmbeddingSpec, LMHeadSpec, MLPSpec,
                                ModelSpec, RMSNormSpec, SublayerSpec)
from unified_models.layers import FAMILIES, LayerFamily, family_of, register_family, register_residual
from unified_models.models import register_model
from toy_models import BF16_ULP, random_toy_weights, toy_prompts, trainer_logits, write_toy_checkpoint

MODEL_TYPE = "toy_parallel_lm"
ARCH = "UnifiedToyParallelForCausalLM"


class ToyParallelConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=512,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.rms_norm_eps = intermediate_size, rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------- the family


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelAttnMLPSpec:
    """``round(fp32(attn(x)) + fp32(mlp(x)))`` on one normed input."""

    name: str
    attn: AttentionSpec
    mlp: MLPSpec

    def parameter_shapes(self):
        return {**self.attn.parameter_shapes(), **self.mlp.parameter_shapes()}


def _parallel_forward(spec, layer_index, params, x_TD, batch, store, ctx):
    a = family_of(spec.attn).forward(spec.attn, layer_index, params, x_TD, batch, store, ctx)
    m = family_of(spec.mlp).forward(spec.mlp, layer_index, params, x_TD, batch, store, ctx)
    return (a.float() + m.float()).to(x_TD.dtype)


def _parallel_oracle(spec, params, x_TD):
    return family_of(spec.attn).oracle(spec.attn, params, x_TD) + family_of(spec.mlp).oracle(spec.mlp, params, x_TD)


PARALLEL = LayerFamily(
    spec_type=ParallelAttnMLPSpec, forward=_parallel_forward, oracle=_parallel_oracle,
    caches=lambda s, dt: family_of(s.attn).caches(s.attn, dt),
    megatron_fields=lambda s: {**family_of(s.attn).megatron_fields(s.attn), **family_of(s.mlp).megatron_fields(s.mlp)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwoStreamSpec:
    """Two residual streams (no parameters)."""

    def parameter_shapes(self):
        return {}


class TwoStream:
    """expand: (h, h); input: mean of the streams (fp32, one rounding); add: (b, a + y); contract: mean."""

    def expand(self, rspec, params, h_TD):
        return (h_TD, h_TD)

    @staticmethod
    def _mean(r):
        return ((r[0].float() + r[1].float()) * 0.5).to(r[0].dtype)

    def sublayer_input(self, rspec, params, r, sub):
        return self._mean(r)

    def add(self, rspec, params, r, sub, y_TD):
        return (r[1], r[0] + y_TD)

    def contract(self, rspec, params, r):
        return self._mean(r)


def toy_spec_from_config(config, *, dtype=None, **_):
    d, eps, layers = config.hidden_size, config.rms_norm_eps, config.num_hidden_layers
    blocks = []
    for i in range(layers):
        p = f"model.layers.{i}"
        pair = ParallelAttnMLPSpec(
            name=f"{p}.mix",
            attn=AttentionSpec(name=f"{p}.mix.self_attn", hidden_size=d, num_heads=config.num_attention_heads,
                               num_kv_heads=config.num_key_value_heads, head_dim=d // config.num_attention_heads),
            mlp=MLPSpec(name=f"{p}.mix.mlp", hidden_size=d, intermediate_size=config.intermediate_size,
                        activation="swiglu"))
        mlp = MLPSpec(name=f"{p}.ffn", hidden_size=d, intermediate_size=config.intermediate_size, activation="relu2")
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.mix_norm", hidden_size=d, eps=eps), mixer=pair),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.ffn_norm", hidden_size=d, eps=eps), mixer=mlp))))
    return ModelSpec(
        family=MODEL_TYPE, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyParallelForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=config.vocab_size, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=config.vocab_size, hidden_size=d, tied_to=None),
        residual=TwoStreamSpec(), dtype=dtype or torch.bfloat16,
        max_position_embeddings=config.max_position_embeddings)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Register the family (config, layer family, residual policy, model) and write a checkpoint."""
    AutoConfig.register(MODEL_TYPE, ToyParallelConfig, exist_ok=True)
    register_family(PARALLEL)
    register_residual(TwoStreamSpec, TwoStream())
    register_model(MODEL_TYPE, toy_spec_from_config, ARCH)
    config = ToyParallelConfig(architectures=["ToyParallelForCausalLM"], torch_dtype="bfloat16")
    spec = toy_spec_from_config(config)
    sd = random_toy_weights(spec, gain=2.0)  # logits far from uniform
    d = tmp_path_factory.mktemp("toy_parallel")
    write_toy_checkpoint(d, config, sd)
    yield d, spec, sd
    FAMILIES.pop(ParallelAttnMLPSpec, None)


def _prompts(n: int, length: int) -> list[list[int]]:
    return toy_prompts(n, length, seed=3)




def _engine_logits(spec, sd, ids):
    return trainer_logits(spec, sd, ids)


def test_toy_family_engine_forward_matches_oracle_and_uses_both_streams(toy):
    _, spec, sd = toy
    ids = torch.tensor(_prompts(1, 24)[0])
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.logits(ids)
    top = want.softmax(-1).max(-1).values.mean().item()
    assert top > 0.2, f"toy logits are near-uniform (mean max-prob {top:.3f}); the bound would mean nothing"
    scale = want.abs().max().item()
    # The engine rounds activations to bf16 at ~6 points per sublayer (norm, projections,
    # residual adds, stream means) over 4 sublayers; measured 0.47 at logits of 39 (3 ulps of
    # the largest logit). Bound: 8 bf16 ulps of the largest logit.
    bound = 8 * BF16_ULP * scale
    err = (_engine_logits(spec, sd, ids) - want).abs().max().item()
    assert err < bound, (err, bound)
    # the 2-stream policy is in the path: one plain stream gives another model
    one_stream = _engine_logits(spec.replace(residual=PLAIN_RESIDUAL), sd, ids)
    assert (one_stream - want).abs().max().item() > 4 * bound


def test_toy_family_check_diff_zero_through_both_engines(toy):
    """vLLM (generic model class, toy caches from the declarations) vs the Megatron module."""
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
    n = 0
    for i, lp in enumerate(ro.logprobs):
        assert len(lp) == 12
        assert torch.equal(torch.tensor(lp, dtype=torch.float32), rec.logprobs[i].float()), i
        n += len(lp)
    assert n == 48 and keys
    for k in keys:
        assert torch.equal(ro.full_rows[k], rec.full_rows[k]), k


def test_toy_family_peer_check_names_the_missing_transformers_class(toy):
    """``check``'s peer needs transformers' own class for the config: without one, a clear error."""
    from unified_models.check import peer_check
    from unified_models.dsl import UnifiedModelsError

    d, spec, sd = toy
    with pytest.raises(UnifiedModelsError, match=r"transformers has no causal-LM class for ToyParallelConfig "
                                                r"\(model_type 'toy_parallel_lm'\).*AutoModelForCausalLM.register"):
        peer_check(spec, sd, d, _prompts(1, 5), 1e-4)
