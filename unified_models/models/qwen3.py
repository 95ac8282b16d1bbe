"""Qwen3 (dense) and Qwen3-MoE declarations: a :class:`ModelSpec` from a transformers ``Qwen3Config`` /
``Qwen3MoeConfig``.

Declarations only: no kernels, no engine imports. Names are the Hugging Face names of
``transformers.models.qwen3`` / ``qwen3_moe`` as written to checkpoints (``model.*``,
``lm_head.weight`` unless ``tie_word_embeddings``; Qwen3-MoE experts one tensor per expert and
projection). Every layer is two pre-norm sublayers under the plain residual:

* ``model.layers.{i}.self_attn`` (norm ``input_layernorm``): GQA with per-head ``q_norm`` /
  ``k_norm`` RMSNorm over ``head_dim`` before RoPE (:class:`AttentionSpec` with ``qk_norm_eps``),
  q/k/v/o bias when ``attention_bias`` (transformers biases all four), a sliding window on the
  layers ``layer_types`` calls ``sliding_attention`` (dense Qwen3);
* ``model.layers.{i}.mlp`` (norm ``post_attention_layernorm``): SwiGLU :class:`MLPSpec`
  (``intermediate_size``), or on Qwen3-MoE's sparse layers (``(i + 1) % decoder_sparse_step == 0``
  and ``i`` not in ``mlp_only_layers``) a :class:`Qwen3MoESpec` (softmax top-k router,
  ``norm_topk_prob``, ``moe_intermediate_size``, no shared expert).

Every config field is honoured or refused by name (:data:`HONOURED_FIELDS`, :data:`INERT_FIELDS`;
an unknown field is refused rather than ignored).
"""

from __future__ import annotations

from typing import Any

import torch

from .config_dtype import config_dtype
from ..dsl import (AttentionSpec, BlockSpec, EmbeddingSpec, LMHeadSpec, MLPSpec, ModelSpec, Qwen3MoESpec,
                   RMSNormSpec, RopeSpec, SpecError, SublayerSpec, UnsupportedLayerError)

ARCHITECTURE = "UnifiedQwen3ForCausalLM"
HF_ARCHITECTURE = "Qwen3ForCausalLM"
MOE_ARCHITECTURE = "UnifiedQwen3MoeForCausalLM"
MOE_HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
LAYER_TYPES = ("full_attention", "sliding_attention")

_COMMON = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "attention_bias",
    "use_sliding_window", "sliding_window", "attention_dropout", "dtype", "torch_dtype", "quantization_config",
}
HONOURED_FIELDS = {
    "qwen3": frozenset(_COMMON | {"max_window_layers", "layer_types"}),
    "qwen3_moe": frozenset(_COMMON | {"decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok",
                                      "num_experts", "num_local_experts", "norm_topk_prob", "mlp_only_layers",
                                      "shared_expert_intermediate_size"}),
}
"""Config fields that decide the forward, per model type, each read and checked below."""

INERT_FIELDS = frozenset({
    "output_router_logits", "router_aux_loss_coef",  # transformers' auxiliary training loss only, never the logits
    "initializer_range",  # initialisation only
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",  # generation bookkeeping
    "transformers_version", "architectures", "model_type", "_name_or_path",
})
"""Fields that do not change the logits of a forward (accepted whatever their value)."""


def _generic_config_keys() -> frozenset:
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig().to_dict())


def _name(model_type: str) -> str:
    return "Qwen3Moe" if model_type == "qwen3_moe" else "Qwen3"


def _get(config: Any, name: str, model_type: str) -> Any:
    if not hasattr(config, name):
        raise SpecError(f"{_name(model_type)} config has no field {name!r}")
    return getattr(config, name)


def _int(config: Any, name: str, model_type: str, lo: int = 1) -> int:
    v = _get(config, name, model_type)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecError(f"{_name(model_type)} config: {name}={v!r} must be an int >= {lo}")
    return v


def _check_fields(config: Any, model_type: str) -> None:
    """Refuse unknown fields and values this declaration cannot honour (the message names the field)."""
    who = f"{_name(model_type)} config"
    try:
        keys = set(config.to_dict())
    except Exception:  # noqa: BLE001 - a plain namespace in tests: check its attributes
        keys = set(vars(config))
    unknown = sorted(keys - HONOURED_FIELDS[model_type] - INERT_FIELDS - _generic_config_keys())
    if unknown:
        raise SpecError(f"{who}: field(s) {unknown} are not understood by this declaration; refusing rather "
                        "than ignoring them")
    if getattr(config, "quantization_config", None):
        raise SpecError(f"{who}: quantization_config is set; quantized Qwen3 checkpoints are not supported "
                        "(only model-dtype weights)")
    act = _get(config, "hidden_act", model_type)
    if act != "silu":
        raise SpecError(f"{who}: hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    drop = getattr(config, "attention_dropout", 0.0) or 0.0
    if float(drop) != 0.0:
        raise SpecError(f"{who}: attention_dropout={drop!r}; only 0.0 is supported (the trainer must recompute "
                        "the rollout's logprobs exactly)")
    if model_type == "qwen3_moe":
        if getattr(config, "use_sliding_window", False):
            raise SpecError(f"{who}: use_sliding_window=True is not supported: transformers' Qwen3MoeAttention "
                            "then windows every layer while vLLM's Qwen3MoeForCausalLM ignores the window; the two "
                            "disagree")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            raise SpecError(f"{who}: shared_expert_intermediate_size={shared!r}; Qwen3-MoE has no shared expert "
                            "(only 0 / absent is supported)")


def _rope(config: Any, model_type: str, head_dim: int) -> RopeSpec:
    """Plain RoPE over the whole head dim from ``rope_parameters`` (transformers 5, which also folds a
    legacy ``rope_scaling`` / ``rope_theta`` into it) or ``rope_theta``."""
    who = f"{_name(model_type)} config"
    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        theta = getattr(config, "rope_theta", None)
        if theta is None:
            raise SpecError(f"{who}: neither rope_parameters nor rope_theta is set")
        return RopeSpec(theta=float(theta), rotary_dim=head_dim)
    if not isinstance(rp, dict):
        raise SpecError(f"{who}: rope_parameters={rp!r} must be a dict")
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
        raise SpecError(f"{who}: rope_parameters.rope_type={rtype!r} (RoPE scaling) is not supported; only "
                        "'default' (plain RoPE with rope_theta)")
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise SpecError(f"{who}: rope_parameters keys {extra} are not supported with rope_type 'default'")
    prf = rp.get("partial_rotary_factor", 1.0)
    if prf is not None and float(prf) != 1.0:
        raise SpecError(f"{who}: rope_parameters.partial_rotary_factor={prf!r}; Qwen3 rotates the whole head "
                        "(only 1.0 is supported)")
    if "rope_theta" not in rp:
        raise SpecError(f"{who}: rope_parameters has no rope_theta")
    return RopeSpec(theta=float(rp["rope_theta"]), rotary_dim=head_dim)


def _layer_windows(config: Any, model_type: str, n_layers: int) -> list[int | None]:
    """The sliding window of each layer (None: full attention) from ``layer_types`` (dense Qwen3)."""
    if model_type == "qwen3_moe":
        return [None] * n_layers
    who = f"{_name(model_type)} config"
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
    if len(types) != n_layers:
        raise SpecError(f"{who}: layer_types has {len(types)} entries, num_hidden_layers is {n_layers}")
    window = getattr(config, "sliding_window", None)
    out: list[int | None] = []
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise UnsupportedLayerError(f"{who}: layer_types[{i}]={t!r} is not supported; supported: "
                                        f"{list(LAYER_TYPES)}")
        if t == "sliding_attention":
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise SpecError(f"{who}: layer_types[{i}] is 'sliding_attention' but sliding_window={window!r} "
                                "(use_sliding_window must be true and sliding_window an int >= 1)")
            out.append(window)
        else:
            out.append(None)
    return out


def _sparse_layers(config: Any, n_layers: int) -> list[bool]:
    """Which Qwen3-MoE layers are sparse (transformers ``Qwen3MoeDecoderLayer``)."""
    who = "Qwen3Moe config"
    step = _int(config, "decoder_sparse_step", "qwen3_moe")
    only = list(getattr(config, "mlp_only_layers", None) or [])
    for j in only:
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < n_layers:
            raise SpecError(f"{who}: mlp_only_layers entry {j!r} is not a layer index in [0, {n_layers})")
    n_exp = _int(config, "num_experts", "qwen3_moe", lo=0)
    return [i not in only and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers)]


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None) -> ModelSpec:
    """Build the model spec of a transformers ``Qwen3Config`` or ``Qwen3MoeConfig``.

    Args:
        config: the config (``model_type`` ``qwen3`` or ``qwen3_moe``).
        dtype: parameter/activation dtype; default ``config.dtype`` if floating, else bf16.

    Returns:
        ModelSpec with HF names; ``extra["pattern"]`` one char per layer (``A`` attention + dense
        MLP, ``W`` sliding-window attention + dense MLP, ``E`` attention + MoE).

    Raises:
        UnsupportedLayerError: an unknown ``layer_types`` entry (named with its index).
        SpecError: any field not honoured (an unknown field, RoPE scaling, an activation other than silu,
            dropout, quantization, a sliding window on Qwen3-MoE, a shared expert, sizes that do not
            fit); the message names it.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in HONOURED_FIELDS:
        raise SpecError(f"expected a qwen3 or qwen3_moe config, got model_type={model_type!r}")
    _check_fields(config, model_type)
    who = f"{_name(model_type)} config"
    n_layers = _int(config, "num_hidden_layers", model_type)
    d, v = _int(config, "hidden_size", model_type), _int(config, "vocab_size", model_type)
    heads = _int(config, "num_attention_heads", model_type)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    head_dim = d // heads if head_dim is None else head_dim  # transformers: getattr(config, "head_dim", D // H)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise SpecError(f"{who}: head_dim={head_dim!r} must be an int >= 1")
    eps = float(_get(config, "rms_norm_eps", model_type))
    if not eps > 0:
        raise SpecError(f"{who}: rms_norm_eps={eps!r} must be > 0")
    rope = _rope(config, model_type, head_dim)
    bias = bool(getattr(config, "attention_bias", False))
    windows = _layer_windows(config, model_type, n_layers)
    sparse = _sparse_layers(config, n_layers) if model_type == "qwen3_moe" else [False] * n_layers
    blocks, pattern = [], []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        attn = AttentionSpec(name=f"{p}.self_attn", hidden_size=d, num_heads=heads, num_kv_heads=int(kv_heads),
                             head_dim=head_dim, bias=bias, rope=rope, sliding_window=windows[i], qk_norm_eps=eps)
        if sparse[i]:
            ffn: Any = Qwen3MoESpec(
                name=f"{p}.mlp", hidden_size=d, n_routed_experts=_int(config, "num_experts", model_type),
                top_k=_int(config, "num_experts_per_tok", model_type),
                moe_intermediate_size=_int(config, "moe_intermediate_size", model_type),
                norm_topk_prob=bool(_get(config, "norm_topk_prob", model_type)), hidden_act=config.hidden_act)
        else:
            ffn = MLPSpec(name=f"{p}.mlp", hidden_size=d,
                          intermediate_size=_int(config, "intermediate_size", model_type), activation="swiglu")
        pattern.append("E" if sparse[i] else ("W" if windows[i] else "A"))
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.input_layernorm", hidden_size=d, eps=eps), mixer=attn),
            SublayerSpec(index=i, norm=RMSNormSpec(name=f"{p}.post_attention_layernorm", hidden_size=d, eps=eps),
                         mixer=ffn))))
    tie = bool(getattr(config, "tie_word_embeddings", False))
    moe = model_type == "qwen3_moe"
    return ModelSpec(
        family=model_type,
        architecture=MOE_ARCHITECTURE if moe else ARCHITECTURE,
        hf_model_type=model_type,
        hf_architecture=MOE_HF_ARCHITECTURE if moe else HF_ARCHITECTURE,
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=v, hidden_size=d),
        blocks=tuple(blocks),
        final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps),
        lm_head=LMHeadSpec(name="lm_head", vocab_size=v, hidden_size=d,
                           tied_to="model.embed_tokens.weight" if tie else None),
        dtype=config_dtype(config, dtype),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 4096)),
        extra={"pattern": "".join(pattern)},
    )
