"""Reference model: the spec's math in plain PyTorch, no paged cache, no custom kernels.

Used as the oracle for peer checks (against transformers' own class) and for
tolerance tests of the engine path. Computes in ``dtype`` (fp32 or fp64) end
to end. It is the forward's loop over the layer families' oracles
(:attr:`unified_models.layers.LayerFamily.oracle`: dense causal softmax
attention per sequence; Mamba-2 and MoE with the ops' fp64 oracles; NVFP4
experts (any linear with a weight format) with the fake-quantized masters, FP8 KV through the cache's
write-then-read rule, gradients straight through) and the residual policy's
oracle (:func:`unified_models.layers.residual_policy`).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ...dsl import ModelSpec, SpecError
from ...layers import family_of, residual_policy
from ...layers.oracle import rms_norm_oracle
from ...layers.weight_formats import oracle_weight


class _HFView(Mapping):
    """Read-only ``{HF name: tensor}`` view of the reference model's parameters, as the
    oracles take them: the ``weight`` of a linear with a (master-form) weight format is
    its fake-quantized form (:func:`~unified_models.layers.weight_formats.oracle_weight`,
    straight-through), so the oracles never branch on formats."""

    def __init__(self, model: "ReferenceModel"):
        self._m = model

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._m.p(name)
        if name.endswith(".weight") and self._m.spec.weight_format(name[: -len(".weight")]) is not None:
            return oracle_weight(self._m.spec, name[: -len(".weight")], {name: t})
        return t

    def __iter__(self):
        return iter(self._m._names)

    def __len__(self) -> int:
        return len(self._m._names)

    def __contains__(self, name) -> bool:
        return name.replace(".", "__") in self._m.params if isinstance(name, str) else False


class ReferenceModel(nn.Module):
    """Oracle forward of a :class:`ModelSpec`.

    Parameters live in a flat ``nn.ParameterDict``-like store keyed by HF name
    (``.`` replaced for registration); :meth:`load_state_dict_hf` fills them.
    """

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
        if spec.stores_quantized_weights:
            raise SpecError("the reference model takes master weights; convert the stored codes first "
                            "(unified_models.converters.modelopt.master_spec / dequantize_state_dict)")
        self.spec = spec
        self.dtype = dtype
        self._names = list(spec.parameter_shapes())
        self.params = nn.ParameterDict({
            n.replace(".", "__"): nn.Parameter(torch.zeros(s, dtype=dtype, device=device), requires_grad=False)
            for n, s in spec.parameter_shapes().items()
        })

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    @torch.no_grad()
    def load_state_dict_hf(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict in (cast to ``self.dtype``).

        Raises:
            SpecError: a spec parameter is missing from ``state_dict``.
        """
        missing = [n for n in self._names if n not in state_dict]
        if missing:
            raise SpecError(f"reference model: state dict lacks {missing}")
        for n in self._names:
            self.p(n).copy_(state_dict[n].to(self.dtype))

    def hf_params(self) -> Mapping[str, torch.Tensor]:
        """Read-only ``{HF name: parameter}`` view (``self.dtype``), as the oracles take it."""
        return _HFView(self)

    def mixer_output(self, mixer, x_TD: torch.Tensor, input_ids_T: torch.Tensor | None = None) -> torch.Tensor:
        """One sublayer's oracle (its family's) on its normed input: ``[T, D] -> [T, D]``, one sequence
        (``input_ids_T`` int ``[T]``: its token ids, for a family whose oracle takes them).

        Raises:
            SpecError: no layer family for the mixer's spec type.
        """
        fam = family_of(mixer)
        extra = {"input_ids_T": input_ids_T} if fam.oracle_takes_input_ids else {}
        return fam.oracle(mixer, _HFView(self), x_TD, **extra)

    @torch.no_grad()
    def logits(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        """Logits of ONE sequence: int ``[T]`` -> ``[T, V]`` in ``self.dtype``."""
        s = self.spec
        params = _HFView(self)
        policy = residual_policy(s.residual, oracle=True)
        r = policy.expand(s.residual, params, self.p(s.embedding.name + ".weight")[input_ids_T.long()])
        for sub in s.sublayers:
            x = rms_norm_oracle(policy.sublayer_input(s.residual, params, r, sub), self.p(sub.norm.name + ".weight"),
                                sub.norm.eps)
            fam = family_of(sub.mixer, sub.index)
            extra = {"input_ids_T": input_ids_T} if fam.oracle_takes_input_ids else {}
            r = policy.add(s.residual, params, r, sub, fam.oracle(sub.mixer, params, x, **extra))
        h = rms_norm_oracle(policy.contract(s.residual, params, r), self.p(s.final_norm.name + ".weight"),
                            s.final_norm.eps)
        return h @ self.p(s.lm_head.weight_name).t()

    def logprobs(self, input_ids_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log_softmax(logits / temperature)`` of one sequence: ``[T, V]``."""
        return torch.log_softmax(self.logits(input_ids_T) / temperature, dim=-1)
