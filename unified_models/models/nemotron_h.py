"""Nemotron-H declaration: a :class:`ModelSpec` from a transformers ``NemotronHConfig``.

Declarations only: no kernels, no engine imports. Names are the Hugging Face
names of ``transformers.models.nemotron_h.modeling_nemotron_h`` as written to
checkpoints (``backbone.*``, ``lm_head.weight``, one tensor per routed expert).
Layer types come from ``config.layers_block_type`` (pattern characters ``M``
Mamba-2, ``E`` MoE, ``*`` attention, ``-`` MLP); every one is supported:

* ``M`` (``linear_attention``): :class:`Mamba2Spec` (``NemotronHMamba2Mixer``);
  dt clamp = ``config.time_step_limit`` (vLLM's and mamba_ssm's rule; note that
  transformers' mixer clamps with ``(time_step_min, inf)`` instead);
* ``E`` (``moe``): :class:`MoESpec` (``NemotronHMoE``); latent MoE refused;
* ``*`` (``full_attention``): GQA, no RoPE, as in ``NemotronHAttention``;
* ``-`` (``mlp``): ``down(relu(up(x))^2)``.

Quantization comes from the checkpoint's ModelOpt quantization config
(``config.quantization_config`` or the ``hf_quant_config.json`` dict passed as
``quant_config``; :mod:`.modelopt_config`) as a weight format per linear
(``ModelSpec.weight_formats``), as the published NVFP4 hybrids mix it: NVFP4
routed experts (``quant_algo`` ``NVFP4`` / ``W4A16_NVFP4``, W4A16 on our
kernels), FP8 W8A8 Mamba ``in_proj``/``out_proj``; ``kv_cache_quant_algo`` FP8
gives an FP8 KV cache. Any other quantized module is refused with a clear
error (the families' :func:`~unified_models.layers.quantization.check_weight_formats`).
A quantized config means the tensors are stored in ModelOpt's format;
:func:`unified_models.converters.modelopt.master_spec` gives the trainer's
bf16-master form of the same model.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..dsl import (
    AttentionSpec,
    BlockSpec,
    EmbeddingSpec,
    LMHeadSpec,
    Mamba2Spec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RMSNormSpec,
    SpecError,
    UnsupportedLayerError,
)
from .modelopt_config import QUANT_CONFIG_ATTR, kv_cache_algo, linear_formats, modelopt_quantization

ARCHITECTURE = "UnifiedNemotronHForCausalLM"
HF_ARCHITECTURE = "NemotronHForCausalLM"
PATTERN_CHARS = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
SUPPORTED_LAYER_TYPES = ("full_attention", "mlp", "linear_attention", "moe")
_ALWAYS_UNQUANTIZED = ("lm_head", ".mixer.gate")  # vLLM never quantizes the LM head or the router


def _get(config: Any, name: str) -> Any:
    if not hasattr(config, name):
        raise SpecError(f"NemotronH config has no field {name!r}")
    return getattr(config, name)


def layer_pattern(config: Any) -> str:
    """The hybrid pattern string (e.g. ``"*-*-"``) of a NemotronH config."""
    return "".join(PATTERN_CHARS.get(t, "?") for t in _get(config, "layers_block_type"))


def _canonical(module: str) -> str:
    """Checkpoint module name (transformers' in-memory ``model.`` prefix -> ``backbone.``)."""
    return "backbone." + module[len("model."):] if module.startswith("model.") else module


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None,
                        quant_config: Mapping | None = None) -> ModelSpec:
    """Build the model spec of a transformers ``NemotronHConfig``.

    Args:
        config: a ``NemotronHConfig`` (or any object with its fields).
        dtype: parameter/activation dtype; default: ``config.dtype`` if it is
            a floating dtype, else bf16.
        quant_config: the checkpoint's ``hf_quant_config.json`` dict, if any
            (:mod:`.modelopt_config`; default ``config.quantization_config``).

    Returns:
        ModelSpec with HF parameter names.

    Raises:
        UnsupportedLayerError: an unknown layer type; the message names the
            type, its pattern char and index.
        SpecError: inconsistent sizes, a non-relu2 MLP activation, or a
            feature we do not implement (sliding window, MTP layers, latent
            MoE, ``n_shared_experts`` other than 1, quantized modules other
            than NVFP4 routed experts and FP8 Mamba projections).
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
                f"supported: {', '.join(repr(s) for s in SUPPORTED_LAYER_TYPES)} ('*', '-', 'M', 'E')"
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

    quant = modelopt_quantization(config, quant_config, "NemotronH")
    kv_algo = kv_cache_algo(quant)
    kv_cache_dtype = _kv_cache_dtype(kv_algo)
    blocks = []
    for i, t in enumerate(layer_types):
        prefix = f"backbone.layers.{i}"
        if t == "linear_attention":
            mixer = _mamba_spec(config, f"{prefix}.mixer", d, eps)
        elif t == "moe":
            mixer = _moe_spec(config, f"{prefix}.mixer", d)
        elif t == "full_attention":
            mixer = AttentionSpec(
                name=f"{prefix}.mixer", hidden_size=d, num_heads=heads, num_kv_heads=kv_heads,
                # transformers' NemotronHAttention (and vLLM's) build q/k/v/o without
                # bias whatever ``attention_bias`` says, so checkpoints never hold one.
                head_dim=head_dim, bias=False, rope=None, kv_cache_dtype=kv_cache_dtype,
            )
        else:  # "mlp"
            mixer = MLPSpec(
                name=f"{prefix}.mixer", hidden_size=d, intermediate_size=int(_get(config, "intermediate_size")),
                activation="relu2", bias=bool(getattr(config, "mlp_bias", False)),
            )
        blocks.append(BlockSpec.single(i, RMSNormSpec(name=f"{prefix}.norm", hidden_size=d, eps=eps), mixer))

    extra: dict[str, Any] = {"pattern": layer_pattern(config)}
    if kv_algo:  # applied above: every attention layer's kv_cache_dtype
        extra["kv_cache_quant_algo"] = kv_algo
    # transformers' NemotronHForCausalLM declares no tied weights (``_tied_weights_keys
    # = {}``) and always saves ``lm_head.weight``, whatever ``tie_word_embeddings``
    # says; follow the checkpoint producer.
    spec = ModelSpec(
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
        extra=extra,
    )
    if quant is None:
        return spec
    from ..layers.quantization import check_weight_formats

    shapes = spec.parameter_shapes()
    linears = [n[: -len(".weight")] for n, shp in shapes.items()
               if n.endswith(".weight") and len(shp) == 2 and n != f"{spec.embedding.name}.weight"]
    spec = spec.replace(weight_formats=tuple(linear_formats(
        quant, linears, family="NemotronH", canonical=_canonical, never_quantized=_ALWAYS_UNQUANTIZED).items()))
    check_weight_formats(spec)
    return spec


def _kv_cache_dtype(kv_algo: str | None) -> str:
    """``AttentionSpec.kv_cache_dtype`` for a ModelOpt ``kv_cache_quant_algo``: FP8 -> ``"fp8_e4m3"``
    (per-tensor ``k_scale``/``v_scale``, vLLM's ``kv_cache_dtype="fp8"``), none -> ``"auto"``."""
    if kv_algo is None:
        return "auto"
    if kv_algo == "FP8":
        return "fp8_e4m3"
    raise SpecError(f"NemotronH ModelOpt kv_cache_quant_algo={kv_algo!r} is not supported; supported: FP8 "
                    "(e4m3 KV cache with per-tensor k_scale/v_scale) or none")


def _time_step_limit(config: Any) -> tuple[float, float]:
    lim = getattr(config, "time_step_limit", None)
    if lim is None:
        return (0.0, math.inf)
    vals = []
    for v in lim:
        if isinstance(v, Mapping) and "__float__" in v:  # JSON-encoded infinity
            v = v["__float__"]
        vals.append(float(v))
    if len(vals) != 2:
        raise SpecError(f"NemotronH time_step_limit={lim!r} must be a pair (lo, hi)")
    return (vals[0], vals[1])


def _mamba_spec(config: Any, name: str, d: int, eps: float) -> Mamba2Spec:
    return Mamba2Spec(
        name=name, hidden_size=d, num_heads=int(_get(config, "mamba_num_heads")),
        head_dim=int(_get(config, "mamba_head_dim")), n_groups=int(_get(config, "n_groups")),
        ssm_state_size=int(_get(config, "ssm_state_size")), conv_kernel=int(_get(config, "conv_kernel")),
        chunk_size=int(_get(config, "chunk_size")), time_step_limit=_time_step_limit(config), eps=eps,
        use_conv_bias=bool(getattr(config, "use_conv_bias", True)),
        # transformers' NemotronHMamba2Mixer and vLLM's MambaMixer2 both take in/out_proj bias from use_bias
        use_bias=bool(getattr(config, "use_bias", False)),
        activation=str(getattr(config, "mamba_hidden_act", "silu")),
    )


def _moe_spec(config: Any, name: str, d: int) -> MoESpec:
    n_shared = getattr(config, "n_shared_experts", 1)
    if n_shared != 1:
        # transformers always builds one shared expert of moe_shared_expert_intermediate_size;
        # vLLM builds n_shared_experts * that width (none for 0): only 1 means the same model in both
        raise SpecError(f"NemotronH n_shared_experts={n_shared}: only 1 is supported (transformers and vLLM "
                        "disagree on any other value)")
    if getattr(config, "mlp_bias", False):
        raise SpecError("NemotronH MoE layers with mlp_bias=True are not supported")
    return MoESpec(
        name=name, hidden_size=d, n_routed_experts=int(_get(config, "n_routed_experts")),
        top_k=int(_get(config, "num_experts_per_tok")), intermediate_size=int(_get(config, "moe_intermediate_size")),
        shared_intermediate_size=int(_get(config, "moe_shared_expert_intermediate_size")),
        n_group=int(getattr(config, "n_group", 1) or 1), topk_group=int(getattr(config, "topk_group", 1) or 1),
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        activation=str(_get(config, "mlp_hidden_act")),
        latent_size=getattr(config, "moe_latent_size", None),
    )
