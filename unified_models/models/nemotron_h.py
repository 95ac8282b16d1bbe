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
``quant_config``), as the published NVFP4 hybrids mix it: NVFP4 routed experts
(``quant_algo`` ``NVFP4`` / ``W4A16_NVFP4``) give ``MoESpec.quantization =
"nvfp4"`` (W4A16 on our kernels), FP8 Mamba ``in_proj``/``out_proj`` give
``Mamba2Spec.proj_quantization = "fp8"`` (W8A8), ``kv_cache_quant_algo`` FP8
an FP8 KV cache; any other quantized module is refused with a clear error. A
quantized config means the tensors are stored in ModelOpt's format
(``checkpoint_format = "modelopt"``); :func:`unified_models.converters.modelopt.master_spec`
gives the trainer's bf16-master form of the same model.
"""

from __future__ import annotations

import fnmatch
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

ARCHITECTURE = "UnifiedNemotronHForCausalLM"
HF_ARCHITECTURE = "NemotronHForCausalLM"
PATTERN_CHARS = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
SUPPORTED_LAYER_TYPES = ("full_attention", "mlp", "linear_attention", "moe")
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
QUANT_CONFIG_ATTR = "unified_models_quantization_config"
"""Config attribute holding the ModelOpt config when an engine hides ``quantization_config``
from its own quantization methods (see ``backends.vllm.engine.quantization_overrides``)."""
_ALWAYS_UNQUANTIZED = ("lm_head", ".mixer.gate")  # vLLM never quantizes the LM head or the router


def _get(config: Any, name: str) -> Any:
    if not hasattr(config, name):
        raise SpecError(f"NemotronH config has no field {name!r}")
    return getattr(config, name)


def layer_pattern(config: Any) -> str:
    """The hybrid pattern string (e.g. ``"*-*-"``) of a NemotronH config."""
    return "".join(PATTERN_CHARS.get(t, "?") for t in _get(config, "layers_block_type"))


def _as_dict(qc: Any) -> dict | None:
    if qc is None:
        return None
    if isinstance(qc, Mapping):
        return dict(qc)
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    raise SpecError(f"NemotronH quantization_config of type {type(qc).__name__} is not a mapping")


def _canonical(module: str) -> str:
    """Checkpoint module name (transformers' in-memory ``model.`` prefix -> ``backbone.``)."""
    return "backbone." + module[len("model."):] if module.startswith("model.") else module


def _matches(module: str, pattern: str) -> bool:
    pattern = _canonical(pattern)
    return (module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)
            or fnmatch.fnmatchcase(module, pattern + ".*"))


def _layer_linears(i: int, t: str, config: Any) -> list[str]:
    """Module names of the quantizable linears of layer ``i`` (checkpoint names, no ``.weight``)."""
    m = f"backbone.layers.{i}.mixer"
    if t == "linear_attention":
        return [f"{m}.in_proj", f"{m}.out_proj"]
    if t == "full_attention":
        return [f"{m}.{x}_proj" for x in "qkvo"]
    if t == "mlp":
        return [f"{m}.up_proj", f"{m}.down_proj"]
    return [f"{m}.shared_experts.up_proj", f"{m}.shared_experts.down_proj"]


def _expert_modules(i: int, config: Any) -> list[str]:
    m = f"backbone.layers.{i}.mixer.experts"
    return [f"{m}.{e}.{p}" for e in range(int(_get(config, "n_routed_experts"))) for p in ("up_proj", "down_proj")]


def _quant_inner(config: Any, quant_config: Mapping | None) -> dict | None:
    """The ModelOpt ``quantization`` dict of a checkpoint (``hf_quant_config.json`` or
    ``config.quantization_config``), or None for an unquantized checkpoint."""
    if quant_config is None:
        quant_config = getattr(config, "quantization_config", None) or getattr(config, QUANT_CONFIG_ATTR, None)
    qc = _as_dict(quant_config)
    if not qc:
        return None
    if isinstance(qc.get("quantization"), Mapping):  # hf_quant_config.json
        return dict(qc["quantization"])
    method = str(qc.get("quant_method", "")).lower()
    if not method.startswith("modelopt"):
        raise SpecError(f"NemotronH quantization_config quant_method={qc.get('quant_method')!r} is not "
                        "supported; only ModelOpt checkpoints (quant_method 'modelopt') are")
    return qc


def layer_quantization(config: Any, quant_config: Mapping | None = None) -> dict[int, str]:
    """Weight format per quantizable layer from a ModelOpt config (published NVFP4 hybrids mix formats).

    Args:
        config: the ``NemotronHConfig`` (its ``quantization_config`` is read when
            ``quant_config`` is None).
        quant_config: the checkpoint's ``hf_quant_config.json`` (``{"producer":
            ..., "quantization": {"quant_algo": ..., "exclude_modules": [...]}}``)
            or a ``quantization_config`` dict (``{"quant_method": "modelopt",
            "quant_algo": ..., "ignore": [...]}``); ``MIXED_PRECISION`` reads
            the ``quantized_layers`` table.

    Returns:
        layer index -> format, for every ``moe`` layer (``"bf16"``, ``"nvfp4"``
        (W4A16 export, no input scale) or ``"nvfp4+input_scale"`` (an NVFP4
        W4A4 export: its ``input_scale`` is validated, the kernels stay W4A16))
        and every ``linear_attention`` layer (``"bf16"`` or ``"fp8"``: FP8
        W8A8 ``in_proj`` and ``out_proj``).

    Raises:
        SpecError: a non-ModelOpt method, an unsupported algorithm, a quantized
            module other than the routed experts (NVFP4) and the Mamba in/out
            projections (FP8) (the message names the module and its algorithm),
            a layer whose experts are only partly quantized, or a Mamba layer
            with only one of in_proj/out_proj quantized.
    """
    layer_types = list(_get(config, "layers_block_type"))
    inner = _quant_inner(config, quant_config)
    if inner is None:
        return {i: "bf16" for i, t in enumerate(layer_types) if t in ("moe", "linear_attention")}
    algo = str(inner.get("quant_algo") or "").upper()
    exclude = list(inner.get("exclude_modules") or inner.get("ignore") or [])

    def algo_of(module: str) -> str | None:
        if any(k in module for k in _ALWAYS_UNQUANTIZED):
            return None
        if algo == "MIXED_PRECISION":
            table = inner.get("quantized_layers") or {}
            hits = [str(v.get("quant_algo", "")).upper() for k, v in table.items() if _matches(module, k)]
            return hits[-1] if hits else None
        if any(_matches(module, p) for p in exclude):
            return None
        return algo

    if algo not in (*NVFP4_ALGOS, "FP8", "MIXED_PRECISION"):
        raise SpecError(f"NemotronH ModelOpt quant_algo={algo or None!r} is not supported; supported: NVFP4 or "
                        "W4A16_NVFP4 routed experts and FP8 Mamba in/out projections (directly or in a "
                        "MIXED_PRECISION quantized_layers table)")
    out: dict[int, str] = {}
    for i, t in enumerate(layer_types):
        linears = _layer_linears(i, t, config)
        if t == "linear_attention":
            algos = {m: algo_of(m) for m in linears}
            kinds = set(algos.values())
            if kinds == {None}:
                out[i] = "bf16"
            elif kinds == {"FP8"}:
                out[i] = "fp8"
            else:
                raise SpecError(f"NemotronH layer {i}: Mamba projections quantized as "
                                f"{ {m.rsplit('.', 1)[1]: a for m, a in algos.items()} }; supported: both FP8 or "
                                "neither")
            continue
        for module in linears:
            a = algo_of(module)
            if a is not None:
                raise SpecError(f"NemotronH checkpoint quantizes {module} with {a}; only routed MoE experts "
                                "(NVFP4) and Mamba in_proj/out_proj (FP8) may be quantized in this version")
        if t == "moe":
            algos = {algo_of(m) for m in _expert_modules(i, config)}
            if algos == {None}:
                out[i] = "bf16"
            elif len(algos) == 1 and next(iter(algos)) in NVFP4_ALGOS:
                out[i] = "nvfp4+input_scale" if algos == {"NVFP4"} else "nvfp4"
            else:
                raise SpecError(f"NemotronH layer {i}: routed experts quantized as {sorted(map(str, algos))}; "
                                "every expert of a layer must be NVFP4 (or none)")
    return out


def expert_quantization(config: Any, quant_config: Mapping | None = None) -> dict[int, str]:
    """Routed-expert format per MoE layer (``"bf16"`` / ``"nvfp4"``); see :func:`layer_quantization`."""
    types = list(_get(config, "layers_block_type"))
    return {i: q.split("+")[0] for i, q in layer_quantization(config, quant_config).items() if types[i] == "moe"}


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None,
                        quant_config: Mapping | None = None) -> ModelSpec:
    """Build the model spec of a transformers ``NemotronHConfig``.

    Args:
        config: a ``NemotronHConfig`` (or any object with its fields).
        dtype: parameter/activation dtype; default: ``config.dtype`` if it is
            a floating dtype, else bf16.
        quant_config: the checkpoint's ``hf_quant_config.json`` dict, if any
            (see :func:`expert_quantization`; default ``config.quantization_config``).

    Returns:
        ModelSpec with HF parameter names.

    Raises:
        UnsupportedLayerError: an unknown layer type; the message names the
            type, its pattern char and index.
        SpecError: inconsistent sizes, a non-relu2 MLP activation, or a
            feature we do not implement (sliding window, MTP layers, latent
            MoE, ``n_shared_experts`` other than 1, quantized modules other
            than NVFP4 routed experts).
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

    quant = layer_quantization(config, quant_config)
    packed = _quant_inner(config, quant_config) is not None
    kv_algo = _kv_algo(config, quant_config)
    kv_cache_dtype = _kv_cache_dtype(kv_algo)
    blocks = []
    for i, t in enumerate(layer_types):
        prefix = f"backbone.layers.{i}"
        if t == "linear_attention":
            mixer = _mamba_spec(config, f"{prefix}.mixer", d, eps, quant[i], packed)
        elif t == "moe":
            mixer = _moe_spec(config, f"{prefix}.mixer", d, quant[i], packed)
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
        extra=extra,
    )


def _kv_algo(config: Any, quant_config: Mapping | None) -> str | None:
    inner = _quant_inner(config, quant_config) or {}
    kv = inner.get("kv_cache_quant_algo")
    return str(kv).upper() if kv else None


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


def _mamba_spec(config: Any, name: str, d: int, eps: float, quant: str, packed: bool) -> Mamba2Spec:
    return Mamba2Spec(
        name=name, hidden_size=d, num_heads=int(_get(config, "mamba_num_heads")),
        head_dim=int(_get(config, "mamba_head_dim")), n_groups=int(_get(config, "n_groups")),
        ssm_state_size=int(_get(config, "ssm_state_size")), conv_kernel=int(_get(config, "conv_kernel")),
        chunk_size=int(_get(config, "chunk_size")), time_step_limit=_time_step_limit(config), eps=eps,
        use_conv_bias=bool(getattr(config, "use_conv_bias", True)),
        # transformers' NemotronHMamba2Mixer and vLLM's MambaMixer2 both take in/out_proj bias from use_bias
        use_bias=bool(getattr(config, "use_bias", False)),
        activation=str(getattr(config, "mamba_hidden_act", "silu")),
        proj_quantization=quant, checkpoint_format="modelopt" if packed and quant == "fp8" else "master",
    )


def _moe_spec(config: Any, name: str, d: int, quant: str, packed: bool) -> MoESpec:
    quantization = quant.split("+")[0]
    nvfp4_packed = packed and quantization == "nvfp4"
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
        activation=str(_get(config, "mlp_hidden_act")), quantization=quantization,
        latent_size=getattr(config, "moe_latent_size", None),
        checkpoint_format="modelopt" if nvfp4_packed else "master",
        expert_input_scale=nvfp4_packed and quant.endswith("+input_scale"),
    )
