"""Nemotron-H declaration: a :class:`ModelSpec` from a transformers ``NemotronHConfig``.

Declarations only: no kernels, no engine imports. Names are the Hugging Face
names of ``transformers.models.nemotron_h.modeling_nemotron_h`` (``backbone.*``,
``lm_head.weight``). Layer types come from ``config.layers_block_type`` (pattern
characters ``M`` Mamba-2, ``E`` MoE, ``*`` attention, ``-`` MLP).

Supported in this version: ``*`` (``full_attention``: GQA, no RoPE, as in
``NemotronHAttention``) and ``-`` (``mlp``: ``down(relu(up(x))^2)``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..dsl import (
    AttentionSpec,
    EmbeddingSpec,
    LMHeadSpec,
    MLPSpec,
    ModelSpec,
    ResidualBlockSpec,
    RMSNormSpec,
    SpecError,
    UnsupportedLayerError,
)

ARCHITECTURE = "UnifiedNemotronHForCausalLM"
HF_ARCHITECTURE = "NemotronHForCausalLM"
PATTERN_CHARS = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
SUPPORTED_LAYER_TYPES = ("full_attention", "mlp")


def _get(config: Any, name: str) -> Any:
    if not hasattr(config, name):
        raise SpecError(f"NemotronH config has no field {name!r}")
    return getattr(config, name)


def layer_pattern(config: Any) -> str:
    """The hybrid pattern string (e.g. ``"*-*-"``) of a NemotronH config."""
    return "".join(PATTERN_CHARS.get(t, "?") for t in _get(config, "layers_block_type"))


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None) -> ModelSpec:
    """Build the model spec of a transformers ``NemotronHConfig``.

    Args:
        config: a ``NemotronHConfig`` (or any object with its fields).
        dtype: parameter/activation dtype; default: ``config.dtype`` if it is
            a floating dtype, else bf16.

    Returns:
        ModelSpec with HF parameter names.

    Raises:
        UnsupportedLayerError: a layer type other than ``full_attention`` /
            ``mlp``; the message names the type, its pattern char and index.
        SpecError: inconsistent sizes, a non-relu2 MLP activation, or a
            feature we do not implement (sliding window, MTP layers).
    """
    model_type = getattr(config, "model_type", None)
    if model_type != "nemotron_h":
        raise SpecError(f"expected a nemotron_h config, got model_type={model_type!r}")
    layer_types = list(_get(config, "layers_block_type"))
    if not layer_types:
        raise SpecError("NemotronH config has an empty layers_block_type")
    for i, t in enumerate(layer_types):
        if t not in SUPPORTED_LAYER_TYPES:
            char = PATTERN_CHARS.get(t, "?")
            raise UnsupportedLayerError(
                f"layer {i} has type {t!r} (pattern char {char!r}), which is not supported yet; "
                f"supported: {', '.join(repr(s) for s in SUPPORTED_LAYER_TYPES)} ('*', '-')"
            )
    if getattr(config, "sliding_window", None):
        raise SpecError("NemotronH sliding_window attention is not supported yet")
    if getattr(config, "num_nextn_predict_layers", 0):
        raise SpecError("NemotronH multi-token-prediction layers are not supported yet")
    act = _get(config, "mlp_hidden_act")
    if act != "relu2":
        raise SpecError(f"NemotronH mlp_hidden_act={act!r}; only 'relu2' is supported")

    d = int(_get(config, "hidden_size"))
    v = int(_get(config, "vocab_size"))
    eps = float(_get(config, "layer_norm_epsilon"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(getattr(config, "head_dim", None) or d // heads)
    if dtype is None:
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = getattr(torch, cfg_dtype, None)
        dtype = cfg_dtype if isinstance(cfg_dtype, torch.dtype) and cfg_dtype.is_floating_point else torch.bfloat16

    blocks = []
    for i, t in enumerate(layer_types):
        prefix = f"backbone.layers.{i}"
        if t == "full_attention":
            mixer = AttentionSpec(
                name=f"{prefix}.mixer", hidden_size=d, num_heads=heads, num_kv_heads=kv_heads,
                # transformers' NemotronHAttention (and vLLM's) build q/k/v/o without
                # bias whatever ``attention_bias`` says, so checkpoints never hold one.
                head_dim=head_dim, bias=False, rope=None,
            )
        else:
            mixer = MLPSpec(
                name=f"{prefix}.mixer", hidden_size=d, intermediate_size=int(_get(config, "intermediate_size")),
                activation="relu2", bias=bool(getattr(config, "mlp_bias", False)),
            )
        blocks.append(ResidualBlockSpec(index=i, norm=RMSNormSpec(name=f"{prefix}.norm", hidden_size=d, eps=eps), mixer=mixer))

    # transformers' NemotronHForCausalLM declares no tied weights (``_tied_weights_keys
    # = {}``) and always saves ``lm_head.weight``, whatever ``tie_word_embeddings``
    # says; follow the checkpoint producer.
    return ModelSpec(
        family="nemotron_h",
        architecture=ARCHITECTURE,
        hf_model_type="nemotron_h",
        hf_architecture=HF_ARCHITECTURE,
        embedding=EmbeddingSpec(name="backbone.embeddings", vocab_size=v, hidden_size=d),
        blocks=tuple(blocks),
        final_norm=RMSNormSpec(name="backbone.norm_f", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=v, hidden_size=d, tied_to=None),
        dtype=dtype,
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
        extra={"pattern": layer_pattern(config)},
    )
