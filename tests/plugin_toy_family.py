"""A ``unified-models`` plugin (``--plugin plugin_toy_family``): a toy layer family and model.

Importing this module registers, the way an outside package would
(``docs/architecture.md``, "From outside the package"):

* a transformers config class, ``model_type = "toy_negated_mlp_lm"``;
* a mixer spec :class:`NegatedMLPSpec` and its :class:`~unified_models.layers.LayerFamily`:
  an MLP whose output is negated (exact in bf16), with its oracle and Megatron fields;
* the model declaration: each layer is attention, then the negated MLP.

Nothing in ``unified_models/`` knows this family; ``tests/test_plugins.py`` checks that the
command line finds it through ``--plugin`` and through the ``unified_models.plugins``
entry-point group.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoConfig, PretrainedConfig

from unified_models.dsl import (AttentionSpec, BlockSpec, EmbeddingSpec, LMHeadSpec, MLPSpec, ModelSpec, RMSNormSpec,
                                SublayerSpec)
from unified_models.layers import LayerFamily, family_of, register_family
from unified_models.models import register_model

MODEL_TYPE = "toy_negated_mlp_lm"
ARCH = "UnifiedToyNegatedMLPForCausalLM"
FAMILY_NAME = "toy_negated_mlp"


class ToyNegatedMLPConfig(PretrainedConfig):
    """transformers config of the toy model (small widths, the bundled tokenizer's vocabulary)."""

    model_type = MODEL_TYPE

    def __init__(self, vocab_size=32064, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5, max_position_embeddings=512,
                 **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.intermediate_size, self.rms_norm_eps = intermediate_size, rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NegatedMLPSpec:
    """``-mlp(x)``: the MLP's parameters, its output negated."""

    name: str
    mlp: MLPSpec

    def parameter_shapes(self):
        return self.mlp.parameter_shapes()


def _forward(spec, layer_index, params, x_TD, batch, store, ctx):
    return -family_of(spec.mlp).forward(spec.mlp, layer_index, params, x_TD, batch, store, ctx)


def _oracle(spec, params, x_TD):
    return -family_of(spec.mlp).oracle(spec.mlp, params, x_TD)


NEGATED_MLP = LayerFamily(spec_type=NegatedMLPSpec, forward=_forward, oracle=_oracle,
                          megatron_fields=lambda s: family_of(s.mlp).megatron_fields(s.mlp))


def spec_from_config(config, *, dtype=None, **_):
    """The toy model's spec: ``num_hidden_layers`` blocks of (attention, negated MLP)."""
    d, eps = config.hidden_size, config.rms_norm_eps
    blocks = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(name=f"{p}.self_attn", hidden_size=d, num_heads=config.num_attention_heads,
                             num_kv_heads=config.num_key_value_heads, head_dim=d // config.num_attention_heads)
        neg = NegatedMLPSpec(name=f"{p}.neg", mlp=MLPSpec(name=f"{p}.neg.mlp", hidden_size=d,
                                                          intermediate_size=config.intermediate_size,
                                                          activation="relu2"))
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.attn_norm", hidden_size=d, eps=eps), mixer=attn),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.mlp_norm", hidden_size=d, eps=eps), mixer=neg))))
    return ModelSpec(
        family=FAMILY_NAME, architecture=ARCH, hf_model_type=MODEL_TYPE, hf_architecture="ToyNegatedMLPForCausalLM",
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=config.vocab_size, hidden_size=d),
        blocks=tuple(blocks), final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=config.vocab_size, hidden_size=d, tied_to=None),
        dtype=dtype or torch.bfloat16, max_position_embeddings=config.max_position_embeddings)


AutoConfig.register(MODEL_TYPE, ToyNegatedMLPConfig, exist_ok=True)
register_family(NEGATED_MLP)
register_model(MODEL_TYPE, spec_from_config, ARCH)
