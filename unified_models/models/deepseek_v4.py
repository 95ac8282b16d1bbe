"""DeepSeek-V4 declaration: a :class:`ModelSpec` from a transformers ``DeepseekV4Config``.

Declarations only: no kernels, no engine imports. Source of the model: transformers 5.19
``models/deepseek_v4/{configuration,modeling}_deepseek_v4.py`` (``DeepseekV4ForCausalLM``);
transformers 5.17 (the H200 image) has the same config fields and validates
``mlp_layer_types`` against the same ``("hash_moe", "moe")`` (checked on the H200: its
``DeepseekV4Config.validate_layer_type`` overrides the generic ``ALLOWED_MLP_LAYER_TYPES``
``("sparse", "dense", ...)`` of ``configuration_utils``, so ``"sparse"``/``"dense"`` are
refused there as here).

Canonical parameter names are those transformers' ``save_pretrained`` writes (its
``conversion_mapping.py`` ``"deepseek_v4"`` renames reversed on save), with the spec's
``name`` of each component:

* ``model.embed_tokens.weight``, ``model.norm.weight``, ``head.weight`` (the LM head);
* per layer ``i``: ``model.layers.{i}.attn_norm`` / ``.attn`` (:class:`DeepseekV4AttentionSpec`),
  ``model.layers.{i}.ffn_norm`` / ``.ffn`` (:class:`DeepseekV4MoESpec`), and the mHC
  mixing weights ``model.layers.{i}.hc_attn_{fn,base,scale}``, ``.hc_ffn_{...}``;
* the mHC head ``model.hc_head.hc_{fn,base,scale}`` (:class:`HyperConnectionSpec`).

DeepSeek's published layout (``embed.weight``, ``layers.{i}.attn.kv_norm``, ``hc_head_fn``,
int32 ``tid2eid``, ``mtp.*``, config keys ``compress_ratios`` / ``num_hash_layers`` /
``topk_method``) is read and written by :mod:`unified_models.converters.deepseek_v4_layout`.

Multi-token prediction (``num_nextn_predict_layers``): transformers does not instantiate or
save the MTP block (``_keys_to_ignore_on_load_unexpected = ["mtp.*"]``), so a
transformers-written checkpoint has no MTP tensors whatever the config says. DeepSeek's
published checkpoints do; they are declared as :attr:`ModelSpec.inert_parameters` (loaded,
validated, saved and converted bit for bit, never read by the forward, never trained) when
the config is a published-layout config (:func:`has_mtp_tensors`).

Block-FP8 checkpoints also get DeepSeek-V4's FP8 KV rule on every attention layer
(``kv_cache_dtype="fp8_ds_mla"``, the published recipe's QAT rounding of the KV vectors).

Block-FP8 checkpoints (DeepSeek's ``quantization_config {quant_method: fp8, fmt: e4m3,
scale_fmt: ue8m0, weight_block_size: [128, 128], activation_scheme: dynamic}``, read by
:mod:`.deepseek_fp8_config`): the linears the published checkpoints store in FP8
(:func:`published_fp8_linears`: attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, the CSA
indexer's ``wq_b``, the shared expert's and (``expert_dtype: fp8``) the routed experts' ``w1``/
``w2``/``w3``; in the MTP blocks also ``e_proj``/``h_proj``) minus those the config's
``modules_to_not_convert`` names get the ``fp8_block`` format (stored codes and scales,
``<linear>.weight`` float8_e4m3fn and ``<linear>.weight_scale_inv`` float8_e8m0fnu; DeepSeek's
published files call the scale ``<linear>.scale``, converted by the layout module). The router
gate, norms, embeddings, head, compressors and the indexer's ``weights_proj`` stay in the model
dtype / fp32 (DeepSeek's ``inference/model.py``; transformers' ``_keep_in_fp32_modules``). Which of
those formats the layer families can run is their check
(:func:`unified_models.layers.quantization.check_weight_formats`), which refuses the rest by name.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .config_dtype import config_dtype
from ..dsl import (
    BlockSpec,
    DeepseekV4AttentionSpec,
    DeepseekV4MoESpec,
    EmbeddingSpec,
    HyperConnectionSpec,
    LMHeadSpec,
    ModelSpec,
    RMSNormSpec,
    SpecError,
    SublayerSpec,
    UnsupportedLayerError,
    YarnRope,
)
from ..dsl.weights import FP8_BLOCK, LinearFormat
from .deepseek_fp8_config import FORMAT as FP8_FORMAT
from .deepseek_fp8_config import DeepseekFP8Quantization, deepseek_fp8_quantization
from .modelopt_config import QUANT_CONFIG_ATTR

ARCHITECTURE = "UnifiedDeepseekV4ForCausalLM"
HF_ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_TYPE = "deepseek_v4"

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
"""transformers' ``layer_types`` values (all three are declared; the CSA / HCA forward is the
attention family's)."""
MLP_LAYER_TYPES = ("hash_moe", "moe")
"""transformers' ``mlp_layer_types`` values (5.17 and 5.19 alike)."""
PATTERN_CHARS = {"sliding_attention": "S", "compressed_sparse_attention": "C", "heavily_compressed_attention": "H"}
"""One character per layer in ``spec.extra["pattern"]`` (attention type; a ``#`` suffix marks a hash-MoE layer)."""

HONOURED_FIELDS = frozenset({
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
    "n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings",
    "rope_theta", "layer_types", "compress_rates", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
    "index_head_dim", "index_topk", "num_nextn_predict_layers", "hidden_act", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "partial_rotary_factor", "qk_rope_head_dim", "attention_bias",
    "mlp_bias", "attention_dropout", "router_jitter_noise", "topk_method", "dtype", "torch_dtype",
    "quantization_config", QUANT_CONFIG_ATTR,
})
"""DeepseekV4Config fields that decide the forward, each read and checked below."""

INERT_FIELDS = frozenset({
    "output_router_logits", "router_aux_loss_coef",  # transformers' training loss only, never the logits
    "initializer_range",  # initialisation only
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",  # generation bookkeeping
    "expert_dtype",  # published layout: the stored dtype of the experts; only meaningful with quantization_config
    "transformers_version", "architectures", "model_type", "_name_or_path",
})
"""Fields that do not change the logits of a forward (accepted whatever their value)."""


def _generic_config_keys() -> frozenset:
    """Keys every ``PretrainedConfig.to_dict()`` carries (not DeepSeek-V4 fields)."""
    from transformers import PretrainedConfig

    return frozenset(PretrainedConfig().to_dict())


def _get(config: Any, name: str) -> Any:
    if not hasattr(config, name):
        raise SpecError(f"DeepseekV4 config has no field {name!r}")
    return getattr(config, name)


def _int(config: Any, name: str, lo: int = 1) -> int:
    v = _get(config, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecError(f"DeepseekV4 config: {name}={v!r} must be an int >= {lo}")
    return v


def has_mtp_tensors(config: Any) -> int:
    """How many MTP blocks the checkpoint of ``config`` stores (0 or ``num_nextn_predict_layers``).

    A published-layout config (it carries ``topk_method``, a key of DeepSeek's config.json
    that transformers' ``DeepseekV4Config`` does not define and ``save_pretrained`` of a
    transformers-built config never writes) stores ``num_nextn_predict_layers`` MTP blocks
    (``mtp.{k}.*``); a transformers-written checkpoint stores none (transformers does not
    instantiate the MTP block).
    """
    n = getattr(config, "num_nextn_predict_layers", 0) or 0
    return int(n) if getattr(config, "topk_method", None) is not None else 0


def layer_pattern(config: Any) -> str:
    """One char per layer (``S`` sliding, ``C`` CSA, ``H`` HCA), ``#`` after a hash-MoE layer."""
    out = []
    for t, m in zip(_get(config, "layer_types"), _get(config, "mlp_layer_types")):
        out.append(PATTERN_CHARS.get(t, "?") + ("#" if m == "hash_moe" else ""))
    return "".join(out)


def _check_fields(config: Any) -> None:
    """Refuse every config field this declaration does not know, and the values it cannot honour."""
    try:
        keys = set(config.to_dict())
    except Exception:  # noqa: BLE001 - a plain namespace in tests: check its attributes
        keys = set(vars(config))
    unknown = sorted(keys - HONOURED_FIELDS - INERT_FIELDS - _generic_config_keys())
    if unknown:
        raise SpecError(f"DeepseekV4 config: field(s) {unknown} are not understood by this declaration; refusing "
                        "rather than ignoring them")
    fixed = {"num_key_value_heads": 1, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
             "router_jitter_noise": 0.0, "hidden_act": "silu", "scoring_func": "sqrtsoftplus",
             "norm_topk_prob": True, "n_shared_experts": 1}
    why = {"num_key_value_heads": "one shared K = V head",
           "attention_bias": "transformers' DeepseekV4Attention builds no bias whatever it says",
           "mlp_bias": "a biased shared expert (DeepseekV4MLP) is not declared",
           "attention_dropout": "dropout would make the trainer's forward differ from the sampler's",
           "router_jitter_noise": "router noise would make the trainer's forward differ from the sampler's",
           "hidden_act": "the experts are SwiGLU", "scoring_func": "only sqrt-softplus routing is implemented",
           "norm_topk_prob": "transformers' V4 routers always renormalise",
           "n_shared_experts": "transformers builds one shared expert whatever the count"}
    for name, want in fixed.items():
        v = getattr(config, name, want)
        if v != want or (isinstance(want, bool) and not isinstance(v, bool)):
            raise SpecError(f"DeepseekV4 config: {name}={v!r} is not supported; only {want!r} ({why[name]})")
    tm = getattr(config, "topk_method", None)
    if tm is not None and tm != "noaux_tc":
        raise SpecError(f"DeepseekV4 config: topk_method={tm!r}; only 'noaux_tc' (bias-corrected top-k, no "
                        "group limit) is supported")


def _rope(config: Any, label: str, head_dim: int, rotary: int) -> tuple[float, str, YarnRope | None]:
    """``(theta, rope_type, yarn)`` of ``config.rope_parameters[label]`` (``"main"`` / ``"compress"``)."""
    rp = _get(config, "rope_parameters")
    if not isinstance(rp, Mapping) or not isinstance(rp.get(label), Mapping):
        raise SpecError(f"DeepseekV4 config: rope_parameters={rp!r} has no {label!r} entry (transformers nests "
                        "them as {'main': ..., 'compress': ...})")
    p = dict(rp[label])
    rtype = p.get("rope_type", p.get("type", "default"))
    theta = p.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise SpecError(f"DeepseekV4 config: rope_parameters[{label!r}]['rope_theta']={theta!r} must be > 0")
    prf = p.get("partial_rotary_factor", 1.0)
    if int(head_dim * prf) != rotary:
        raise SpecError(f"DeepseekV4 config: rope_parameters[{label!r}]['partial_rotary_factor']={prf!r} gives "
                        f"{int(head_dim * prf)} rotary dims, but qk_rope_head_dim is {rotary}")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if rtype == "default":
        extra = sorted(set(p) - known)
        if extra:
            raise SpecError(f"DeepseekV4 config: rope_parameters[{label!r}] of rope_type 'default' has keys {extra} "
                            "that transformers would not use; refusing them")
        return float(theta), "default", None
    if rtype != "yarn":
        raise SpecError(f"DeepseekV4 config: rope_parameters[{label!r}]['rope_type']={rtype!r}; supported: "
                        "'default' and (compressed layers) 'yarn'")
    if label == "main":
        raise SpecError("DeepseekV4 config: rope_parameters['main'] is YaRN; transformers applies YaRN only to "
                        "the compressed layers (rope_parameters['compress']), sliding layers use plain RoPE")
    yk = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
          "mscale_all_dim", "truncate"}
    extra = sorted(set(p) - known - yk)
    if extra:
        raise SpecError(f"DeepseekV4 config: rope_parameters[{label!r}] has unknown YaRN keys {extra}")
    orig = p.get("original_max_position_embeddings")
    factor = p.get("factor")
    if factor is None and isinstance(orig, int) and orig > 0:  # transformers' fallback
        factor = _get(config, "max_position_embeddings") / orig
    # transformers reads `truncate` from the top level of rope_parameters (only main/compress there): always True
    yarn = YarnRope(factor=factor, original_max_position_embeddings=orig,
                    beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                    attention_factor=p.get("attention_factor"), mscale=p.get("mscale"),
                    mscale_all_dim=p.get("mscale_all_dim"), truncate=True)
    return float(theta), "yarn", yarn


def attention_spec(config: Any, name: str, layer_type: str, kv_cache_dtype: str = "auto") -> DeepseekV4AttentionSpec:
    """The attention sublayer of one layer of ``layer_type`` under module name ``name``
    (``kv_cache_dtype``: ``"fp8_ds_mla"`` for a published block-FP8 checkpoint, whose recipe
    quantizes the KV vectors in prefill and decode alike).

    Raises:
        UnsupportedLayerError: an unknown layer type.
        SpecError: a field that does not fit (named).
    """
    if layer_type not in LAYER_TYPES:
        raise UnsupportedLayerError(f"{name}: layer type {layer_type!r} is not a DeepSeek-V4 layer type; "
                                    f"supported: {list(LAYER_TYPES)}")
    head_dim = _int(config, "head_dim")
    rotary = int(_get(config, "qk_rope_head_dim"))
    compressed = layer_type != "sliding_attention"
    theta, rtype, yarn = _rope(config, "compress" if compressed else "main", head_dim, rotary)
    kw: dict[str, Any] = {}
    if compressed:
        rates = _get(config, "compress_rates")
        if not isinstance(rates, Mapping) or layer_type not in rates:
            raise SpecError(f"DeepseekV4 config: compress_rates={rates!r} has no rate for {layer_type!r}")
        kw["compress_ratio"] = rates[layer_type]
    if layer_type == "compressed_sparse_attention":
        kw.update(index_n_heads=_int(config, "index_n_heads"), index_head_dim=_int(config, "index_head_dim"),
                  index_topk=_int(config, "index_topk"))
    return DeepseekV4AttentionSpec(
        name=name, hidden_size=_int(config, "hidden_size"), num_heads=_int(config, "num_attention_heads"),
        head_dim=head_dim, q_lora_rank=_int(config, "q_lora_rank"), qk_rope_head_dim=rotary,
        o_groups=_int(config, "o_groups"), o_lora_rank=_int(config, "o_lora_rank"),
        sliding_window=_int(config, "sliding_window"), rope_theta=theta, rope_type=rtype, yarn=yarn,
        rms_norm_eps=float(_get(config, "rms_norm_eps")), layer_type=layer_type, kv_cache_dtype=kv_cache_dtype,
        **kw)


def moe_spec(config: Any, name: str, hash_routing: bool) -> DeepseekV4MoESpec:
    """The MoE sublayer (``ffn``) of one layer under module name ``name``."""
    return DeepseekV4MoESpec(
        name=name, hidden_size=_int(config, "hidden_size"), n_routed_experts=_int(config, "n_routed_experts"),
        top_k=_int(config, "num_experts_per_tok"), moe_intermediate_size=_int(config, "moe_intermediate_size"),
        n_shared_experts=_get(config, "n_shared_experts"),
        routed_scaling_factor=_get(config, "routed_scaling_factor"), norm_topk_prob=_get(config, "norm_topk_prob"),
        swiglu_limit=_get(config, "swiglu_limit"), scoring_func=_get(config, "scoring_func"),
        hidden_act=_get(config, "hidden_act"), hash_routing=hash_routing,
        vocab_size=_int(config, "vocab_size") if hash_routing else None)


ATTN_FP8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
"""Attention linears the published block-FP8 checkpoints store in FP8 (DeepSeek's ``inference/model.py``
``Attention``: ``wo_a`` too, "wo_a is FP8 in checkpoint", which the reference dequantizes to bf16;
vLLM 0.32 builds all five with ``quant_config``)."""
ATTN_FP8_CSA = ("indexer.wq_b",)
"""CSA only: the indexer's query projection (FP8; its ``weights_proj`` and the compressors stay bf16)."""
MOE_FP8 = ("w1", "w2", "w3")
"""The shared expert's and (``expert_dtype: fp8``) each routed expert's FP8 linears."""
MTP_FP8 = ("e_proj", "h_proj")
"""An MTP block's own FP8 linears (besides its attention and MoE)."""


def _attention_fp8(a: DeepseekV4AttentionSpec) -> tuple[str, ...]:
    return tuple(a.linear_name(n) for n in ATTN_FP8 + (ATTN_FP8_CSA if a.has_indexer else ()))


def _moe_fp8(m: DeepseekV4MoESpec, quant: DeepseekFP8Quantization | None) -> tuple[str, ...]:
    out = tuple(m.shared_linear(j) for j in MOE_FP8)
    if quant is None or quant.expert_dtype == "fp8":  # fp4: the routed experts are MXFP4 (mxfp4_expert_linears)
        out += tuple(m.expert_linear(e, j) for e in range(m.n_routed_experts) for j in MOE_FP8)
    return out


def published_fp8_linears(spec: ModelSpec, quant: DeepseekFP8Quantization | None = None) -> tuple[str, ...]:
    """The canonical names of the linears of ``spec``'s decoder layers that DeepSeek's published block-FP8
    checkpoints store in FP8, in model order (:data:`ATTN_FP8`, :data:`ATTN_FP8_CSA`, :data:`MOE_FP8`
    of the shared and, unless ``quant.expert_dtype`` says otherwise, the routed experts); the
    skip list is not applied here. MTP linears are inert parameters (:func:`mtp_parameters`)."""
    out: list[str] = []
    for block in spec.blocks:
        attn, ffn = (s.mixer for s in block.sublayers)
        out += _attention_fp8(attn) + _moe_fp8(ffn, quant)
    return tuple(out)


def mxfp4_expert_linears(spec: ModelSpec) -> tuple[str, ...]:
    """Every routed expert linear (``w1``/``w3``/``w2``) of ``spec``'s decoder layers: what DeepSeek-V4-Flash
    (``expert_dtype: fp4``) stores in MXFP4, in model order."""
    out: list[str] = []
    for block in spec.blocks:
        ffn = block.sublayers[1].mixer
        out += [ffn.expert_linear(e, j) for e in range(ffn.n_routed_experts) for j in MOE_FP8]
    return tuple(out)


def fp8_weight_formats(spec: ModelSpec, quant: DeepseekFP8Quantization) -> ModelSpec:
    """``spec`` with ``fp8_block`` (stored) on every :func:`published_fp8_linears` entry that
    ``quant``'s skip list does not name and, for ``expert_dtype: fp4``, ``mxfp4`` (stored) on every
    routed expert linear it does not name, checked against the families.

    Raises:
        SpecError: a linear the families cannot run in block-FP8, or whose K is not a multiple of 128
            (named, with the skip-list hint).
    """
    from ..layers.quantization import check_weight_formats

    formats = {n: LinearFormat(FP8_FORMAT) for n in published_fp8_linears(spec, quant) if not quant.skipped(n)}
    if quant.expert_dtype == "fp4":
        formats.update({n: LinearFormat("mxfp4") for n in mxfp4_expert_linears(spec) if not quant.skipped(n)})
    try:
        qspec = spec.with_weight_formats(formats)
        check_weight_formats(qspec)
    except SpecError as e:
        raise SpecError(f"DeepseekV4 block-FP8 checkpoint: {e} (a published checkpoint stores it in FP8; this "
                        "model cannot run it so yet; a checkpoint that stores it unquantized names it in "
                        "quantization_config.modules_to_not_convert)") from None
    return qspec


def mtp_parameters(config: Any, dtype: torch.dtype, count: int,
                   quant: DeepseekFP8Quantization | None = None) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """``(name, shape, stored dtype)`` of the ``count`` published MTP blocks (``mtp.{k}.*``, DeepSeek's
    names, as vLLM's ``DeepSeekV4MultiTokenPredictorLayer`` loads them): ``e_proj``, ``h_proj``
    ``[D, D]``; ``enorm``, ``hnorm``, ``norm`` ``[D]``; ``hc_head_{fn,base,scale}``; one decoder
    block (``attn.*`` with ``attn.kv_norm``, ``ffn.*`` regular top-k MoE with ``gate.bias``,
    ``attn_norm``, ``ffn_norm``, ``hc_attn_*``, ``hc_ffn_*``) of the sliding layer type (the
    published ``compress_ratios`` entry of the MTP block is 0; the layout reader refuses another).
    fp32: the mHC weights, the sink and the router bias; the rest ``dtype``.

    With ``quant`` (a block-FP8 checkpoint), each MTP linear of :data:`MTP_FP8` /
    :data:`ATTN_FP8` / the experts that ``quant`` does not skip is stored as the published FP8
    linear: ``<linear>.weight`` float8_e4m3fn ``[N, K]`` and ``<linear>.weight_scale_inv``
    float8_e8m0fnu ``[ceil(N/128), ceil(K/128)]`` (DeepSeek's ``Linear``), except the routed experts
    of an ``expert_dtype: fp4`` checkpoint: MXFP4, ``weight`` uint8 ``[N, K/2]`` and ``weight_scale``
    float8_e8m0fnu ``[N, K/32]``; loaded, validated, converted and saved bit for bit, never computed with.
    """
    d, n = _int(config, "hidden_size"), _int(config, "hc_mult")
    m = (2 + n) * n
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for k in range(count):
        p = f"mtp.{k}"
        attn = attention_spec(config, f"{p}.attn", "sliding_attention")
        ffn = moe_spec(config, f"{p}.ffn", False)
        fp32 = {**attn.trainable_parameter_dtypes(), **ffn.parameter_dtypes()}
        fp8 = set(_attention_fp8(attn) + _moe_fp8(ffn, quant)) | {f"{p}.{n}" for n in MTP_FP8} if quant else set()
        fp4 = ({ffn.expert_linear(e, j) for e in range(ffn.n_routed_experts) for j in MOE_FP8}
               if quant is not None and quant.expert_dtype == "fp4" else set())

        def add(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
            linear = name[: -len(".weight")] if name.endswith(".weight") else None
            if linear in fp4 and len(shape) == 2 and not quant.skipped(linear):
                n_, k_ = shape
                out.append((name, (n_, k_ // 2), torch.uint8))
                out.append((f"{linear}.weight_scale", (n_, k_ // 32), torch.float8_e8m0fnu))
            elif linear in fp8 and len(shape) == 2 and not quant.skipped(linear):
                n_, k_ = shape
                out.append((name, tuple(shape), torch.float8_e4m3fn))
                out.append((f"{linear}.weight_scale_inv", (-(-n_ // FP8_BLOCK), -(-k_ // FP8_BLOCK)),
                            torch.float8_e8m0fnu))
            else:
                out.append((name, tuple(shape), dt))

        for part in (attn, ffn):
            for name, shape in part.parameter_shapes().items():
                name = name.replace(f"{p}.attn.norm.weight", f"{p}.attn.kv_norm.weight")
                add(name, tuple(shape), fp32.get(name, dtype))
        for name in ("e_proj.weight", "h_proj.weight"):
            add(f"{p}.{name}", (d, d), dtype)
        for name in ("enorm.weight", "hnorm.weight", "norm.weight", "attn_norm.weight", "ffn_norm.weight"):
            out.append((f"{p}.{name}", (d,), dtype))
        for site in ("hc_attn", "hc_ffn"):
            out += [(f"{p}.{site}_fn", (m, n * d), torch.float32), (f"{p}.{site}_base", (m,), torch.float32),
                    (f"{p}.{site}_scale", (3,), torch.float32)]
        out += [(f"{p}.hc_head_fn", (n, n * d), torch.float32), (f"{p}.hc_head_base", (n,), torch.float32),
                (f"{p}.hc_head_scale", (1,), torch.float32)]
    return tuple(out)


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None, mtp: int | None = None) -> ModelSpec:
    """Build the model spec of a transformers ``DeepseekV4Config`` (or a published config read by
    :func:`unified_models.converters.deepseek_v4_layout.official_config_to_hf`).

    Args:
        config: a ``DeepseekV4Config`` (transformers 5.17 or 5.19).
        dtype: parameter/activation dtype; default ``config.dtype`` if floating, else bf16.
        mtp: how many MTP blocks the checkpoint stores; default :func:`has_mtp_tensors`.

    Returns:
        ModelSpec with the canonical (transformers-written) names; ``extra["pattern"]``
        one char per layer (``S``/``C``/``H``, ``#`` = hash MoE), ``extra["mtp_layers"]``.

    Raises:
        UnsupportedLayerError: an unknown ``layer_types`` / ``mlp_layer_types`` entry (named
            with its index).
        SpecError: any field not honoured (an unknown field, a ``quantization_config`` other than
            DeepSeek's block-FP8 (:func:`~.deepseek_fp8_config.deepseek_fp8_quantization`, naming the key),
            a block-FP8 linear the families cannot run (:func:`fp8_weight_formats`),
            ``scoring_func`` other than sqrtsoftplus, ``num_key_value_heads != 1``, biases,
            dropout, router noise, ``n_shared_experts != 1``, ``norm_topk_prob`` False, a
            ``topk_method`` other than noaux_tc, RoPE parameters that do not fit, lists whose
            length is not ``num_hidden_layers``, sizes that do not fit); the message names it.
    """
    model_type = getattr(config, "model_type", None)
    if model_type != MODEL_TYPE:
        raise SpecError(f"expected a deepseek_v4 config, got model_type={model_type!r}")
    _check_fields(config)
    n_layers = _int(config, "num_hidden_layers")
    layer_types = list(_get(config, "layer_types") or [])
    mlp_types = list(_get(config, "mlp_layer_types") or [])
    for field, types in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
        if len(types) != n_layers:
            raise SpecError(f"DeepseekV4 config: {field} has {len(types)} entries, num_hidden_layers is {n_layers}")
    for i, t in enumerate(mlp_types):
        if t not in MLP_LAYER_TYPES:
            raise UnsupportedLayerError(f"DeepseekV4 config: mlp_layer_types[{i}]={t!r} is not supported; supported: "
                                        f"{list(MLP_LAYER_TYPES)} (transformers 5.17 and 5.19 spell them so)")
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPES:
            raise UnsupportedLayerError(f"DeepseekV4 config: layer_types[{i}]={t!r} is not supported; supported: "
                                        f"{list(LAYER_TYPES)}")
    d, v = _int(config, "hidden_size"), _int(config, "vocab_size")
    eps = float(_get(config, "rms_norm_eps"))
    if not eps > 0:
        raise SpecError(f"DeepseekV4 config: rms_norm_eps={eps!r} must be > 0")
    n_mtp = _get(config, "num_nextn_predict_layers")
    if isinstance(n_mtp, bool) or not isinstance(n_mtp, int) or n_mtp < 0:
        raise SpecError(f"DeepseekV4 config: num_nextn_predict_layers={n_mtp!r} must be an int >= 0")
    quant = deepseek_fp8_quantization(config)
    mtp = has_mtp_tensors(config) if mtp is None else int(mtp)
    if mtp and mtp != n_mtp:
        raise SpecError(f"DeepseekV4 config: {mtp} MTP blocks stored but num_nextn_predict_layers is {n_mtp}")
    dtype = config_dtype(config, dtype)
    prf, rot = getattr(config, "partial_rotary_factor", None), _get(config, "qk_rope_head_dim")
    if prf is not None and int(_int(config, "head_dim") * prf) != rot:
        raise SpecError(f"DeepseekV4 config: partial_rotary_factor={prf!r} gives {int(config.head_dim * prf)} "
                        f"rotary dims but qk_rope_head_dim is {rot}")

    # DeepSeek's published recipe (inference/model.py) rounds every KV vector through its FP8 rule;
    # a transformers-written bf16 checkpoint (transformers has no such rule) keeps bf16 vectors
    kv_cache_dtype = "fp8_ds_mla" if quant is not None else "auto"
    blocks, sites = [], []
    for i, (lt, mt) in enumerate(zip(layer_types, mlp_types)):
        p = f"model.layers.{i}"
        attn_norm = RMSNormSpec(name=f"{p}.attn_norm", hidden_size=d, eps=eps)
        ffn_norm = RMSNormSpec(name=f"{p}.ffn_norm", hidden_size=d, eps=eps)
        blocks.append(BlockSpec(index=i, sublayers=(
            SublayerSpec(index=i, norm=attn_norm, mixer=attention_spec(config, f"{p}.attn", lt, kv_cache_dtype)),
            SublayerSpec(index=i, norm=ffn_norm, mixer=moe_spec(config, f"{p}.ffn", mt == "hash_moe")))))
        sites += [(attn_norm.name, f"{p}.hc_attn"), (ffn_norm.name, f"{p}.hc_ffn")]
    hc_eps = float(_get(config, "hc_eps"))
    residual = HyperConnectionSpec(hc_mult=_int(config, "hc_mult"), hidden_size=d,
                                   sinkhorn_iters=_int(config, "hc_sinkhorn_iters"), hc_eps=hc_eps, norm_eps=eps,
                                   sites=tuple(sites), head_name="model.hc_head")
    tie = _get(config, "tie_word_embeddings")
    if not isinstance(tie, bool):
        raise SpecError(f"DeepseekV4 config: tie_word_embeddings={tie!r} must be a bool")
    # transformers ties lm_head to model.embed_tokens (_tied_weights_keys) and then saves no head.weight
    lm_head = LMHeadSpec(name="head", vocab_size=v, hidden_size=d,
                         tied_to="model.embed_tokens.weight" if tie else None)
    extra = {"pattern": layer_pattern(config), "mtp_layers": mtp}
    if quant is not None:
        extra["quantization"] = FP8_FORMAT
    spec = ModelSpec(
        family=MODEL_TYPE, architecture=ARCHITECTURE, hf_model_type=MODEL_TYPE, hf_architecture=HF_ARCHITECTURE,
        embedding=EmbeddingSpec(name="model.embed_tokens", vocab_size=v, hidden_size=d),
        blocks=tuple(blocks), residual=residual,
        final_norm=RMSNormSpec(name="model.norm", hidden_size=d, eps=eps), lm_head=lm_head,
        dtype=dtype, max_position_embeddings=_int(config, "max_position_embeddings"),
        inert_parameters=mtp_parameters(config, dtype, mtp, quant), extra=extra)
    return spec if quant is None else fp8_weight_formats(spec, quant)


def transformers_module_name(name: str) -> str:
    """A spec component's (canonical) module name -> the module of transformers' ``DeepseekV4ForCausalLM``
    in memory that computes it (``model.layers.{i}.attn`` -> ``model.layers.{i}.self_attn``, ``head`` ->
    ``lm_head``, ...): transformers renames at load time; the layout module holds the names
    (:func:`unified_models.converters.deepseek_v4_layout.transformers_module_name`)."""
    from ..converters.deepseek_v4_layout import transformers_module_name as layout_name

    return layout_name(name)


# ----------------------------------------------------------------------------- presets

def preset_weights(model: Any, seed: int) -> None:
    """Give a freshly initialised transformers ``DeepseekV4ForCausalLM`` the tensors its
    ``_init_weights`` leaves degenerate, in place, deterministically from ``seed`` (used by
    :func:`unified_models.presets.build_preset_checkpoint`):

    * ``tid2eid`` (zeros: every token's K experts would all be expert 0): K distinct experts
      per token, the first K of a random permutation of the E experts;
    * the router bias (zeros): ``N(0, 0.1^2)``, so selection differs from the unbiased scores;
    * the attention sinks (zeros): ``N(0, 1)``;
    * the compressors' ``position_bias`` (``ape``, zeros): ``N(0, 0.5^2)``;
    * the mHC ``base`` / ``hc_base`` (zeros): ``N(0, 0.5^2)``.
    """
    g = torch.Generator().manual_seed(int(seed) + 7919)
    with torch.no_grad():
        for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("tid2eid"):
                v, k = buf.shape
                e = model.config.n_routed_experts
                buf.copy_(torch.rand(v, e, generator=g).argsort(dim=1)[:, :k].to(buf.dtype))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
            elif name.endswith("sinks"):
                buf.copy_(torch.randn(buf.shape, generator=g))
            elif name.endswith("position_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=g))
            elif name.endswith("_hc.base") or name.endswith("hc_head.hc_base"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=g))
