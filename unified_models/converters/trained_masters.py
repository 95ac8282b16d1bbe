"""A quantized model's trained masters in a Megatron training checkpoint: what the checkpoint says it
holds, the quantization recipe it was trained under, and the two ways back to Hugging Face.

``unified-models rl`` on a quantized checkpoint (ModelOpt NVFP4 / FP8, DeepSeek block-FP8) trains
model-dtype masters (:func:`.modelopt.master_spec`: each quantized linear's weight in the model dtype,
quantized by its format's rule on every forward; the static activation and KV-cache scales kept as
they were calibrated). Its training checkpoint
(:func:`unified_models.backends.megatron.checkpoint.save_training_checkpoint`) stores in its
``unified_models`` common entry

* ``hf_config_json``: the config of what it holds, as a Hugging Face model: the quantized config
  without its ``quantization_config``, ``dtype`` the masters' dtype (:func:`masters_config_text`);
* ``quantization_recipe`` (:class:`QuantizationRecipe`): the quantized checkpoint's ``config.json``
  text verbatim, and its ``hf_quant_config.json`` if it had one. The masters' spec is rebuilt from it
  (:meth:`QuantizationRecipe.master_spec`): what the stored tensors are checked against.

Back to Hugging Face (``unified-models convert --from megatron``):

* by default the masters (:func:`masters_hf_state_dict`): every tensor the masters' config lists,
  bit for bit. The recipe's static scales (FP8 ``input_scale``, KV ``k_scale`` / ``v_scale``) have no
  place in a plain model and are left out (a plain model runs no FP8 activation or KV rule);
* ``--requantize`` (:func:`requantized_state_dict`): the masters quantized by
  :func:`.modelopt.quantize_state_dict` (the rule of the trainer's forward and of every weight sync
  into vLLM) with the recorded static scales, under the recorded ``config.json`` (and
  ``hf_quant_config.json``): the quantized checkpoint the rollout engine ran after that step.

Engine-free (no Megatron import). Bad input raises :class:`CheckpointError` naming the problem.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..dsl import CheckpointError, ModelSpec
from . import megatron_dist_ckpt as layout
from .hf_safetensors import json_object, tensor_table_problems
from .modelopt import master_spec, quantize_state_dict
from .quantized import validate_quantized

__all__ = ["QuantizationRecipe", "masters_config_text", "record_masters", "plain_tensor_problems",
           "masters_hf_state_dict", "requantized_state_dict"]


@dataclass(frozen=True)
class QuantizationRecipe:
    """The quantized checkpoint a training checkpoint's masters were trained from.

    Attributes:
        config_text: its ``config.json`` text, verbatim (with its ``quantization_config``).
        hf_quant_config_text: its ``hf_quant_config.json`` text (ModelOpt), or None.
    """

    config_text: str
    hf_quant_config_text: str | None = None

    def to_entry(self) -> dict:
        """The plain dict stored as the common entry's ``quantization_recipe``."""
        return {"config_json": self.config_text, "hf_quant_config_json": self.hf_quant_config_text}

    @classmethod
    def from_entry(cls, value: Any, source: str) -> "QuantizationRecipe":
        """Read :meth:`to_entry`'s dict back.

        Raises:
            CheckpointError: not a dict of JSON texts (``source`` named).
        """
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{source}: the stored quantization recipe is malformed: a "
                                  f"{type(value).__name__}, not a dict")
        if not isinstance(value.get("config_json"), str):
            kind = type(value.get("config_json")).__name__
            raise CheckpointError(f"{source}: the stored quantization recipe is malformed: its 'config_json' (the "
                                  f"quantized checkpoint's config.json text) is {kind}, not a string")
        quant = value.get("hf_quant_config_json")
        if quant is not None and not isinstance(quant, str):
            raise CheckpointError(f"{source}: the stored quantization recipe's hf_quant_config_json is a "
                                  f"{type(quant).__name__}, not JSON text")
        for what, text in (("config.json", value["config_json"]), ("hf_quant_config.json", quant)):
            if text is None:
                continue
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{source}: the stored quantization recipe's {what} is not valid JSON: "
                                      f"{e}") from None
        return cls(config_text=value["config_json"], hf_quant_config_text=quant)

    def quantized_spec(self, source: str) -> ModelSpec:
        """The quantized model's spec (stored formats), from the recorded ``config.json``.

        Raises:
            CheckpointError: the recorded config is unreadable or describes no quantized weights.
            SpecError: it declares something unsupported.
        """
        spec = layout.spec_from_config_text(self.config_text, source=f"{source} (quantization recipe)")
        if not spec.stores_quantized_weights:
            raise CheckpointError(f"{source}: the stored quantization recipe's config.json quantizes no weight "
                                  "(no quantization_config); the checkpoint is not a quantized model's masters")
        return spec

    def master_spec(self, source: str) -> ModelSpec:
        """The masters' spec (:func:`.modelopt.master_spec` of :meth:`quantized_spec`): what a
        training checkpoint of this recipe holds and resumes into."""
        return master_spec(self.quantized_spec(source))

    def describe(self) -> str:
        """One line: the quantization method and algorithm, how many linears each format covers and
        the KV-cache rule, e.g. ``modelopt MIXED_PRECISION: 4 fp8 linears, 32 nvfp4 linears; FP8 KV cache``."""
        raw = json.loads(self.config_text)
        qc = raw.get("quantization_config") if isinstance(raw, dict) else None
        qc = qc if isinstance(qc, dict) else {}
        head = " ".join(str(qc[k]) for k in ("quant_method", "quant_algo") if qc.get(k)) or "quantized"
        try:
            counts = Counter(f.format for _, f in self.quantized_spec("recipe").weight_formats)
        except Exception:  # noqa: BLE001 - a description only; loading reports the error itself
            counts = Counter()
        parts = ", ".join(f"{n} {fmt} linear{'s' if n != 1 else ''}" for fmt, n in sorted(counts.items()))
        kv = qc.get("kv_cache_quant_algo")
        return head + (f": {parts}" if parts else "") + (f"; {kv} KV cache" if kv else "")


def masters_config_text(quantized_config_text: str, dtype: torch.dtype) -> str:
    """The Hugging Face ``config.json`` of a quantized model's masters: the quantized config without
    its ``quantization_config``, ``dtype`` (and ``torch_dtype``, where the config has it) the
    masters' dtype; every other field as it was.

    Raises:
        CheckpointError: the text is not a JSON object.
    """
    cfg = json_object(quantized_config_text, "config")
    cfg.pop("quantization_config", None)
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def plain_tensor_problems(plain: ModelSpec, masters: ModelSpec) -> list[str]:
    """How the plain model of the masters' config (``plain``) fails to be part of the masters
    (``masters``): tensors it lists that the masters lack, or hold in another shape or dtype.
    Empty when each of its tensors is a master tensor as it is."""
    shapes, dtypes = masters.parameter_shapes(), masters.parameter_dtypes()
    problems = []
    missing = [n for n in plain.parameter_shapes() if n not in shapes]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        problems.append(f"the masters lack {missing[:8]}{more}")
    pd = plain.parameter_dtypes()
    other = [f"{n}: {tuple(s)} {pd[n]} in the config, {tuple(shapes[n])} {dtypes[n]} in the masters"
             for n, s in plain.parameter_shapes().items()
             if n in shapes and (tuple(s) != tuple(shapes[n]) or pd[n] != dtypes[n])]
    if other:
        problems.append(f"other shapes or dtypes: {other[:8]}")
    return problems


def record_masters(config: Any, trained: ModelSpec, *, hf_quant_config: Any = None) -> tuple[str, QuantizationRecipe]:
    """The masters' ``config.json`` text and the recipe record of a trainer that trains the masters
    of a quantized checkpoint.

    Args:
        config: the quantized checkpoint's config (dict, JSON text or transformers config), with
            its ``quantization_config``.
        trained: the spec the trainer trains (:func:`.modelopt.master_spec` of the quantized one).
        hf_quant_config: that checkpoint's ``hf_quant_config.json`` (dict or JSON text), or None.

    Returns:
        ``(masters config text, QuantizationRecipe)``.

    Raises:
        CheckpointError: ``config`` quantizes nothing, its masters are not ``trained`` (tensors
            named), or the masters' config would describe tensors the masters do not hold.
    """
    text = layout.config_text(config)
    quant = None if hf_quant_config is None else layout.config_text(hf_quant_config)
    recipe = QuantizationRecipe(config_text=text, hf_quant_config_text=quant)
    source = "save_training_checkpoint"
    mspec = recipe.master_spec(source)
    problems = tensor_table_problems(mspec.parameter_shapes(), trained.parameter_shapes(), verb="trained")
    if problems:
        raise CheckpointError(f"{source}: hf_config is a quantized model whose masters are not the model trained "
                              "(the trained model's tensors against those masters: " + "; ".join(problems) + ")")
    masters_text = masters_config_text(text, trained.dtype)
    plain = layout.spec_from_config_text(masters_text, source=f"{source} (masters' config)")
    problems = plain_tensor_problems(plain, trained)
    if problems:
        raise CheckpointError(f"{source}: the masters' config (the quantized config without quantization_config) "
                              f"describes other tensors than the masters hold: " + "; ".join(problems))
    return masters_text, recipe


def masters_hf_state_dict(masters: Mapping[str, torch.Tensor], masters_config: str, *,
                          source: str) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The Hugging Face state dict of the masters: the tensors the masters' config lists, as they are
    (the recipe's static scales left out).

    Args:
        masters: every stored master tensor (the masters' spec's names).
        masters_config: the masters' ``config.json`` text (the checkpoint's ``hf_config_json``).
        source: the checkpoint, for messages.

    Returns:
        ``(plain spec, {HF name: tensor})`` in the spec's order.

    Raises:
        CheckpointError: the config lists a tensor the masters lack, or in another shape or dtype.
    """
    plain = layout.spec_from_config_text(masters_config, source=source)
    shapes = plain.parameter_shapes()
    dtypes = plain.parameter_dtypes()
    bad = [n for n in shapes if n not in masters]
    bad += [f"{n}: {tuple(masters[n].shape)} {masters[n].dtype}, config {tuple(shapes[n])} {dtypes[n]}"
            for n in shapes if n in masters and (tuple(masters[n].shape) != tuple(shapes[n])
                                                 or masters[n].dtype != dtypes[n])]
    if bad:
        raise CheckpointError(f"{source}: the stored masters' config does not match the stored masters: {bad[:8]}")
    return plain, {n: masters[n] for n in shapes}


def requantized_state_dict(masters: Mapping[str, torch.Tensor], recipe: QuantizationRecipe, *,
                           source: str) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The masters quantized under ``recipe``: :func:`.modelopt.quantize_state_dict` (the trainer's
    forward rule, the one every weight sync into vLLM applies) with the recorded static scales,
    validated as a loaded checkpoint is (:func:`.quantized.validate_quantized`).

    Returns:
        ``(quantized spec, {HF name: tensor})`` in the quantized spec's order.

    Raises:
        CheckpointError: a stored tensor the masters cannot give (an NVFP4 W4A4 export's calibrated
            expert ``input_scale``, which no master keeps), or bad scales (named).
    """
    qspec = recipe.quantized_spec(source)
    stored = quantize_state_dict(masters, qspec)
    missing = [n for n in qspec.parameter_shapes() if n not in stored]
    if missing:
        raise CheckpointError(f"{source}: cannot re-quantize under the recorded recipe: it stores {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                              + ", which the trained masters do not hold (an NVFP4 W4A4 linear's calibrated "
                              "input_scale has no master); convert without --requantize for the masters")
    stored = {n: stored[n] for n in qspec.parameter_shapes()}
    validate_quantized(stored, qspec, source=source)
    return qspec, stored
