"""The config classes our vLLM plugin registers, and the transformers view our model class reads.

DeepSeek-V4 has two checkpoint layouts (:mod:`unified_models.converters.deepseek_v4_layout`) and
vLLM parses ``config.json`` through one class per ``model_type`` (``_CONFIG_REGISTRY``, registered
into ``AutoConfig`` by ``HFConfigParser.parse`` and ``_maybe_register_hf_config``; then
``AutoConfig.from_pretrained`` -> ``from_dict``; vLLM 0.26 and 0.32 alike):

* vLLM's own ``DeepseekV4Config`` (``vllm/transformers_utils/configs/deepseek_v4.py``) is a
  pass-through ``PreTrainedConfig``: the published keys (``compress_ratios``, ``num_hash_layers``,
  ``rope_scaling``, ``compress_rope_theta``, ...) stay attributes, which vLLM's native
  ``DeepseekV4ForCausalLM`` reads (``config.compress_ratios[layer_id]``); it cannot read a
  transformers-written config (transformers' validation refuses its ``hash_moe`` / ``moe``
  ``mlp_layer_types`` under the generic class);
* transformers' ``DeepseekV4Config`` reads the transformers layout (``layer_types``,
  ``compress_rates``, ``mlp_layer_types``, nested ``rope_parameters``).

:class:`DeepseekV4ConfigByLayout` is registered in vLLM's registry (and so in ``AutoConfig``) in
their place and picks one per dict: the published layout goes to the class vLLM had registered
(so a native vLLM run with our package installed parses it exactly as without it), any other
dict to transformers' class. Our model class then reads :func:`transformers_config` of whatever
vLLM hands it.

This module imports transformers: import it lazily (``plugin.py`` does).
"""

from __future__ import annotations

from typing import Any, Mapping

from transformers import PretrainedConfig

from ...converters import deepseek_v4_layout as layout
from ...dsl import SpecError

MODEL_TYPE = "deepseek_v4"


class DeepseekV4ConfigByLayout(PretrainedConfig):
    """``model_type`` ``deepseek_v4``: a factory, never instantiated itself. Every way transformers and
    vLLM build a config from a registered class (``from_dict``, ``from_pretrained`` through it, and
    ``cls(**fields)`` as ``AutoConfig.for_model`` does) returns an instance of :meth:`class_for`
    the fields: :attr:`published_class` (vLLM's own class, set by
    :func:`unified_models.backends.vllm.plugin.use_transformers_configs`) for DeepSeek's published
    layout (:func:`~unified_models.converters.deepseek_v4_layout.is_official_config`), transformers'
    ``DeepseekV4Config`` otherwise (or for every dict while no published class is set)."""

    model_type = MODEL_TYPE
    published_class = None
    """The class vLLM's registry held for ``deepseek_v4`` before ours (None: not installed)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return cls.class_for({**kwargs, "model_type": MODEL_TYPE})(*args, **kwargs)

    @classmethod
    def class_for(cls, config_dict: Mapping) -> type:
        """The class that parses ``config_dict`` (a ``config.json`` dict or constructor fields)."""
        if cls.published_class is not None and layout.is_official_config(config_dict):
            return cls.published_class
        from transformers import DeepseekV4Config

        return DeepseekV4Config

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs: Any):
        """``class_for(config_dict).from_dict(config_dict, **kwargs)`` (what ``AutoConfig.from_pretrained``
        and ``from_pretrained`` call)."""
        return cls.class_for(config_dict).from_dict(config_dict, **kwargs)


VLLM_ONLY_KEYS = ("rope_parameters", "mm_prefix_clamp_sliding_window", "mm_prefix_span_leading_pad_modulus")
"""Keys vLLM's pass-through ``DeepseekV4Config`` adds to a published config: ``rope_parameters`` (its
alias of the published ``rope_scaling``, which transformers' RoPE mixin completes with the main
``rope_theta`` and a ``rope_type``, and which ``to_dict()`` writes in place of ``rope_scaling``:
:func:`transformers_config` puts it back as ``rope_scaling``, and
:func:`~unified_models.converters.deepseek_v4_layout.official_config_to_hf` builds the nested
transformers form from ``rope_scaling`` / ``rope_theta`` / ``compress_rope_theta``) and vLLM 0.32's
multimodal-prefix bookkeeping; plus 0.32's ``vision_*`` keys (a vision tower; text-only when
``vision_n_layers`` is 0)."""


def transformers_config(hf_config: Any) -> Any:
    """The config our declarations read, for the config object vLLM hands the model class.

    vLLM's pass-through ``DeepseekV4Config`` of a published checkpoint (its ``to_dict()`` is in the
    published layout) -> transformers' ``DeepseekV4Config`` of the same model: the dict without
    :data:`VLLM_ONLY_KEYS` and ``vision_*``, its ``rope_scaling`` the config's (or vLLM's alias of it),
    through
    :func:`~unified_models.converters.deepseek_v4_layout.official_config_to_hf` (a block-FP8 skip list
    renamed too, also when ``hf_overrides`` moved ``quantization_config`` to
    :data:`~unified_models.models.modelopt_config.QUANT_CONFIG_ATTR`, as ``engine.make_llm`` does).
    Any other config (transformers' class, another family) is returned as it is.

    Raises:
        SpecError: a vision tower (``vision_n_layers`` > 0: not declared), or the published config's
            own refusals (:func:`~unified_models.converters.deepseek_v4_layout.official_config_to_hf`).
    """
    if getattr(hf_config, "model_type", None) != MODEL_TYPE:
        return hf_config
    raw = hf_config.to_dict()
    if not layout.is_official_config(raw):
        return hf_config
    vision = raw.get("vision_n_layers") or 0
    if vision:
        raise SpecError(f"DeepseekV4 config: vision_n_layers={vision!r}; the vision tower is not declared "
                        "(text-only checkpoints have 0)")
    from ...models.modelopt_config import QUANT_CONFIG_ATTR

    scaling = getattr(hf_config, "rope_scaling", None) or raw.get("rope_parameters")
    raw = {k: v for k, v in raw.items() if k not in VLLM_ONLY_KEYS and not k.startswith("vision_")}
    raw["rope_scaling"] = dict(scaling) if isinstance(scaling, Mapping) else None
    moved = raw.get(QUANT_CONFIG_ATTR) is not None and not raw.get("quantization_config")
    if moved:  # official_config_to_hf renames the skip lists of "quantization_config"
        raw["quantization_config"] = raw.pop(QUANT_CONFIG_ATTR)
    cfg = layout.official_config_to_hf(raw)
    if moved:
        cfg[QUANT_CONFIG_ATTR] = cfg.pop("quantization_config")
    from transformers import DeepseekV4Config

    return DeepseekV4Config.from_dict(cfg)
