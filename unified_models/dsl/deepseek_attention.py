"""DeepSeek-V4 attention spec: shared K = V multi-query attention with a low-rank query,
partial interleaved RoPE, a learned attention sink and a grouped low-rank output, over a
sliding window, plus (compressed layer types) a compressor of the past into one entry per
``compress_ratio`` tokens and (CSA) a lightning indexer that picks the entries attended.

Forward: :mod:`unified_models.layers.deepseek_attention` (and
:mod:`unified_models.layers.deepseek_compressor`). Source of the math and the names:
transformers 5.19 ``models/deepseek_v4/modeling_deepseek_v4.py`` (``DeepseekV4Attention``,
``DeepseekV4GroupedLinear``, ``apply_rotary_pos_emb``, ``eager_attention_forward``,
``DeepseekV4CSACompressor``, ``DeepseekV4HCACompressor``, ``DeepseekV4Indexer``,
``DeepseekV4IndexerScorer``), ``modeling_rope_utils._compute_yarn_parameters`` (YaRN), and
the checkpoint names ``save_pretrained`` writes (the official DeepSeek-V4 layout:
``attn.wq_a`` ... ``attn.attn_sink``, ``attn.compressor.{wkv,wgate,ape,norm}``,
``attn.indexer.{wq_b,weights_proj}``, ``attn.indexer.compressor.{wkv,wgate,ape,norm}``;
transformers' ``conversion_mapping.py`` ``"deepseek_v4"`` maps them to its module names).

Layer types (transformers ``layer_types``):

* ``"sliding_attention"``: the window only, plain RoPE (``rope_parameters["main"]``);
* ``"compressed_sparse_attention"`` (CSA): window + a compressor with overlapping blocks
  (``coff = 2``: entry i pools the m tokens of block i-1 and the m of block i) + the
  lightning indexer's top-``index_topk`` over the compressed entries;
* ``"heavily_compressed_attention"`` (HCA): window + a compressor without overlap
  (``coff = 1``), every complete entry attended.

Compressed layers use the ``"compress"`` RoPE for everything (queries, keys, entries, the
indexer): ``rope_theta = compress_rope_theta``, YaRN when ``rope_parameters["compress"]``
says so (:class:`YarnRope`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SpecError

DEEPSEEK_V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
"""transformers' ``DeepseekV4Config.layer_types`` values."""

SUPPORTED_LAYER_TYPES = DEEPSEEK_V4_LAYER_TYPES

COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")

ROPE_TYPES = ("default", "yarn")

KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
"""``DeepseekV4AttentionSpec.kv_cache_dtype`` values (vLLM's names: ``auto``, ``fp8_ds_mla``)."""

LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
"""The linear modules of one attention sublayer (checkpoint names under the spec's ``name``)."""


def _is_int(v, lo: int) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= lo


@dataclass(frozen=True, kw_only=True)
class YarnRope:
    """YaRN scaling of the inverse frequencies (transformers 5.19 ``_compute_yarn_parameters``;
    Peng et al. 2023, arXiv 2309.00071), the ``rope_parameters["compress"]`` of DeepSeek-V4.

    Attributes:
        factor: s > 0, the context extension factor (config ``factor``; transformers falls back
            to ``max_position_embeddings / original_max_position_embeddings`` when it is
            ``None``: the config translation resolves that).
        original_max_position_embeddings: L > 0, the pretraining length of the ramp.
        beta_fast, beta_slow: the ramp's rotation bounds (> 0; transformers reads
            ``beta_fast or 32`` and ``beta_slow or 1``: the translation resolves a 0/None).
        attention_factor: the cos/sin scale transformers multiplies into the tables; only
            1.0 is supported (DeepSeek-V4's config sets it to 1.0 for YaRN: the official
            reference applies no mscale). ``None`` = derived as transformers does from
            ``factor``, ``mscale`` and ``mscale_all_dim`` (then it must come out 1.0).
        mscale, mscale_all_dim: only read to derive a ``None`` ``attention_factor``.
        truncate: floor/ceil the correction range (transformers reads ``truncate`` from the
            top level of ``config.rope_parameters``, which for DeepSeek-V4 holds only
            ``main``/``compress``: always True there).

    Raises:
        SpecError: a field out of range, or an attention factor other than 1.0 (names it).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise SpecError(f"YarnRope: factor={self.factor!r} must be a number > 0")
        if not _is_int(self.original_max_position_embeddings, 1):
            raise SpecError(f"YarnRope: original_max_position_embeddings={self.original_max_position_embeddings!r} "
                            "must be an int >= 1")
        for f in ("beta_fast", "beta_slow"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise SpecError(f"YarnRope: {f}={v!r} must be a number > 0")
        if not isinstance(self.truncate, bool):
            raise SpecError(f"YarnRope: truncate={self.truncate!r} must be a bool")
        af = self.resolved_attention_factor
        if af != 1.0:
            raise SpecError(f"YarnRope: attention_factor={af!r} (derived from factor/mscale/mscale_all_dim when "
                            "None): only 1.0 is supported (transformers would multiply cos/sin by it; DeepSeek-V4 "
                            "sets attention_factor 1.0)")

    @property
    def resolved_attention_factor(self) -> float:
        """``attention_factor``, or transformers' derivation from ``factor``/``mscale``/``mscale_all_dim``."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return float(get_mscale(self.factor))


@dataclass(frozen=True, kw_only=True)
class DeepseekV4AttentionSpec:
    """One DeepSeek-V4 attention sublayer (``model.layers.{i}.attn``), any of the three layer types.

    Shapes: D ``hidden_size``, H ``num_heads``, E ``head_dim`` (one shared K = V head,
    G = 1), Q ``q_lora_rank``, R ``qk_rope_head_dim`` (RoPE on the last R dims of each
    head, interleaved pairs), g ``o_groups``, r ``o_lora_rank``, m ``compress_ratio``,
    c ``coff`` (2 for CSA, 1 for HCA), Hi ``index_n_heads``, I ``index_head_dim``.

    Parameters (checkpoint names under ``name``; transformers' in-memory module names
    in brackets), stored in the model dtype unless said:

    * ``wq_a.weight [Q, D]`` (``q_a_proj``), ``q_norm.weight [Q]`` (``q_a_norm``),
      ``wq_b.weight [H*E, Q]`` (``q_b_proj``): the low-rank query, then an RMS norm
      without weight per head (``q_b_norm``, eps ``rms_norm_eps``);
    * ``wkv.weight [E, D]`` (``kv_proj``), ``norm.weight [E]`` (``kv_norm``; the official
      layout calls it ``kv_norm``): the one K = V vector per token;
    * ``wo_a.weight [g*r, H*E/g]`` (``o_a_proj``, ``DeepseekV4GroupedLinear``: block g
      of rows maps head group g), ``wo_b.weight [D, g*r]`` (``o_b_proj``);
    * ``attn_sink [H]`` (``sinks``), stored and trained in fp32 (transformers keeps it
      fp32; the official checkpoints store it fp32), only with ``attention_sink``;
    * compressed types, ``compressor.`` (``compressor.``): ``wkv.weight [c*E, D]``
      (``kv_proj``), ``wgate.weight [c*E, D]`` (``gate_proj``), ``ape [m, c*E]``
      (``position_bias``, fp32: transformers keeps it fp32 (``_keep_in_fp32_modules_strict``),
      vLLM and the official reference allocate it fp32), ``norm.weight [E]`` (``kv_norm``);
      all trained;
    * CSA only, the indexer (never trained: :meth:`untrained_parameter_names`):
      ``indexer.wq_b.weight [Hi*I, Q]`` (``compressor.indexer.q_b_proj``),
      ``indexer.weights_proj.weight [Hi, D]`` (``compressor.indexer.scorer.weights_proj``),
      ``indexer.compressor.{wkv,wgate}.weight [2I, D]``, ``indexer.compressor.ape [m, 2I]``
      (fp32), ``indexer.compressor.norm.weight [I]`` (``compressor.indexer.*``).

    Attributes:
        name: module prefix, e.g. ``model.layers.3.attn``.
        sliding_window: W positions attended, the token's own included (config ``sliding_window``).
        rope_theta: RoPE base: sliding layers ``rope_parameters["main"]["rope_theta"]``,
            compressed layers ``rope_parameters["compress"]["rope_theta"]`` (``compress_rope_theta``).
        rope_type: ``"default"`` or ``"yarn"`` (compressed layers only; then ``yarn`` is given).
        yarn: the YaRN parameters of ``rope_type="yarn"``, else ``None``.
        rms_norm_eps: eps of every RMS norm (config ``rms_norm_eps``).
        attention_sink: the learned per-head sink in the softmax denominator (always on in
            DeepSeek-V4; ``False`` only for ablations and tests).
        layer_type: config ``layer_types[i]``, one of :data:`DEEPSEEK_V4_LAYER_TYPES`.
        compress_ratio: m: 0 for sliding layers; >= 2 for compressed ones (config
            ``compress_rates[layer_type]``: 4 / 128 published).
        index_n_heads, index_head_dim, index_topk: CSA only (0 otherwise): Hi, I (>= R: the
            indexer rotates its last R dims) and the entries kept per token.
        kv_cache_dtype: ``"auto"`` (K = V vectors in the model dtype) or ``"fp8_ds_mla"``:
            DeepSeek-V4's FP8 KV rule (``ops.ds_kv_fp8_roundtrip``: the E - R no-RoPE dims
            through e4m3 with one power-of-two scale per 64 dims, the R RoPE dims kept), applied
            to every window vector and every main-compressor entry before it is written, in
            prefill and decode alike (the published QAT rule; vLLM's ``fp8_ds_mla`` cache).
            E - R must be a multiple of 64.

    Raises:
        SpecError: an unknown layer type, a RoPE type or YaRN block that does not fit the
            layer type, a compress ratio or indexer field that does not fit it, or sizes that
            do not fit (each names the field).
    """

    name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    rope_type: str = "default"
    yarn: YarnRope | None = None
    attention_sink: bool = True
    layer_type: str = "sliding_attention"
    compress_ratio: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        n = self.name
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SpecError(f"{n}: kv_cache_dtype={self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8_ds_mla" and (self.head_dim - self.qk_rope_head_dim) % 64:
            raise SpecError(f"{n}: kv_cache_dtype='fp8_ds_mla' needs head_dim - qk_rope_head_dim = "
                            f"{self.head_dim - self.qk_rope_head_dim} to be a multiple of 64 (one FP8 scale per 64 "
                            "no-RoPE dims)")
        if self.layer_type not in DEEPSEEK_V4_LAYER_TYPES:
            raise SpecError(f"{n}: layer_type={self.layer_type!r} is not one of {list(DEEPSEEK_V4_LAYER_TYPES)}")
        if self.rope_type not in ROPE_TYPES:
            raise SpecError(f"{n}: rope_type={self.rope_type!r} is not one of {list(ROPE_TYPES)}")
        if not self.compressed and self.rope_type != "default":
            raise SpecError(f"{n}: rope_type={self.rope_type!r}: sliding_attention layers use plain RoPE "
                            "('default', theta rope_parameters['main']); YaRN with compress_rope_theta belongs to the "
                            "compressed layer types")
        if (self.rope_type == "yarn") != (self.yarn is not None):
            raise SpecError(f"{n}: yarn={self.yarn!r} must be a YarnRope exactly when rope_type='yarn' "
                            f"(rope_type={self.rope_type!r})")
        if self.yarn is not None and not isinstance(self.yarn, YarnRope):
            raise SpecError(f"{n}: yarn={self.yarn!r} must be a YarnRope")
        for f in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "o_groups",
                  "o_lora_rank", "sliding_window"):
            v = getattr(self, f)
            if not _is_int(v, 1):
                raise SpecError(f"{n}: {f}={v!r} must be an int >= 1")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise SpecError(f"{n}: qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most "
                            f"head_dim={self.head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise SpecError(f"{n}: o_groups={self.o_groups} does not divide num_heads * head_dim = "
                            f"{self.num_heads * self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise SpecError(f"{n}: rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} "
                            "must be > 0")
        if not isinstance(self.attention_sink, bool):
            raise SpecError(f"{n}: attention_sink={self.attention_sink!r} must be a bool")
        if self.compressed:
            if not _is_int(self.compress_ratio, 2):
                raise SpecError(f"{n}: compress_ratio={self.compress_ratio!r} must be an int >= 2 for "
                                f"layer_type={self.layer_type!r}")
        elif self.compress_ratio != 0:
            raise SpecError(f"{n}: compress_ratio={self.compress_ratio!r} must be 0 for sliding_attention")
        index = ("index_n_heads", "index_head_dim", "index_topk")
        if self.has_indexer:
            for f in index:
                if not _is_int(getattr(self, f), 1):
                    raise SpecError(f"{n}: {f}={getattr(self, f)!r} must be an int >= 1 for "
                                    "compressed_sparse_attention (the lightning indexer)")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise SpecError(f"{n}: index_head_dim={self.index_head_dim} must be at least qk_rope_head_dim="
                                f"{self.qk_rope_head_dim} (the indexer rotates its last qk_rope_head_dim dims)")
        else:
            for f in index:
                if getattr(self, f) != 0:
                    raise SpecError(f"{n}: {f}={getattr(self, f)!r} must be 0: only compressed_sparse_attention "
                                    f"layers have an indexer (layer_type={self.layer_type!r})")

    # ------------------------------------------------------------------ derived facts

    @property
    def compressed(self) -> bool:
        """CSA or HCA: a compressor and its caches."""
        return self.layer_type in COMPRESSED_LAYER_TYPES

    @property
    def has_indexer(self) -> bool:
        """CSA: the lightning indexer picks the attended entries."""
        return self.layer_type == "compressed_sparse_attention"

    @property
    def coff(self) -> int:
        """Compressor width factor: 2 (CSA, overlapping blocks), 1 (HCA), 0 (sliding)."""
        return 2 if self.has_indexer else (1 if self.compressed else 0)

    @property
    def scale(self) -> float:
        """Softmax scale ``head_dim ** -0.5`` (transformers' ``scaling``; no YaRN mscale)."""
        return self.head_dim ** -0.5

    @property
    def index_softmax_scale(self) -> float:
        """Indexer score scale ``index_head_dim ** -0.5`` (``DeepseekV4IndexerScorer.softmax_scale``)."""
        return self.index_head_dim ** -0.5

    @property
    def index_weights_scale(self) -> float:
        """Indexer head-weight scale ``index_n_heads ** -0.5`` (``weights_scaling``)."""
        return self.index_n_heads ** -0.5

    @property
    def sink_name(self) -> str:
        """HF name of the per-head sink logits (``<name>.attn_sink``)."""
        return f"{self.name}.attn_sink"

    def linear_name(self, short: str) -> str:
        """Module name of one of :data:`LINEARS` (``<name>.wq_a`` ...) or of a compressor/indexer
        linear (``"compressor.wkv"``, ``"indexer.wq_b"`` ...)."""
        return f"{self.name}.{short}"

    def compressor_prefix(self, indexer: bool = False) -> str:
        """``<name>.compressor`` or (the indexer's) ``<name>.indexer.compressor``."""
        return f"{self.name}.indexer.compressor" if indexer else f"{self.name}.compressor"

    def _compressor_shapes(self, indexer: bool) -> dict[str, tuple[int, ...]]:
        d, m = self.hidden_size, self.compress_ratio
        w, c = (self.index_head_dim, 2) if indexer else (self.head_dim, self.coff)
        p = self.compressor_prefix(indexer)
        return {f"{p}.wkv.weight": (c * w, d), f"{p}.wgate.weight": (c * w, d), f"{p}.ape": (m, c * w),
                f"{p}.norm.weight": (w,)}

    def trainable_parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Trained in fp32: the sink and the compressor's ``ape``."""
        out = {self.sink_name: torch.float32} if self.attention_sink else {}
        if self.compressed:
            out[f"{self.compressor_prefix()}.ape"] = torch.float32
        return out

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Stored in a dtype of their own and never trained: the indexer compressor's ``ape`` (fp32)."""
        return {f"{self.compressor_prefix(True)}.ape": torch.float32} if self.has_indexer else {}

    def untrained_parameter_names(self) -> set[str]:
        """Every indexer tensor (CSA): the indexer's inputs are detached and its top-k is
        discrete, so no loss reaches them (as in the published recipe, which does not train
        the indexer with the language-model loss)."""
        if not self.has_indexer:
            return set()
        p = self.name
        return {f"{p}.indexer.wq_b.weight", f"{p}.indexer.weights_proj.weight", *self._compressor_shapes(True)}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, h, e, q = self.hidden_size, self.num_heads, self.head_dim, self.q_lora_rank
        g, r = self.o_groups, self.o_lora_rank
        p = self.name
        shapes = {
            f"{p}.wq_a.weight": (q, d),
            f"{p}.q_norm.weight": (q,),
            f"{p}.wq_b.weight": (h * e, q),
            f"{p}.wkv.weight": (e, d),
            f"{p}.norm.weight": (e,),
            f"{p}.wo_a.weight": (g * r, h * e // g),
            f"{p}.wo_b.weight": (d, g * r),
        }
        if self.attention_sink:
            shapes[self.sink_name] = (h,)
        if self.compressed:
            shapes.update(self._compressor_shapes(False))
        if self.has_indexer:
            shapes[f"{p}.indexer.wq_b.weight"] = (self.index_n_heads * self.index_head_dim, q)
            shapes[f"{p}.indexer.weights_proj.weight"] = (self.index_n_heads, d)
            shapes.update(self._compressor_shapes(True))
        return shapes
