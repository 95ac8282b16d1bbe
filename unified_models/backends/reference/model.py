"""Reference model: the spec's math in plain PyTorch, no paged cache, no custom kernels.

Used as the oracle for peer checks (against transformers' own class) and for
tolerance tests of the engine path. Computes in ``dtype`` (fp32 or fp64) end
to end; attention is a dense causal softmax per sequence.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ...dsl import AttentionSpec, MLPSpec, ModelSpec, SpecError
from ...ops.rope import apply_rope_reference


class ReferenceModel(nn.Module):
    """Oracle forward of a :class:`ModelSpec`.

    Parameters live in a flat ``nn.ParameterDict``-like store keyed by HF name
    (``.`` replaced for registration); :meth:`load_state_dict_hf` fills them.
    """

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__()
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

    def _rms(self, x, name, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.p(name + ".weight")

    def _lin(self, x, name, bias):
        y = x @ self.p(name + ".weight").t()
        return y + self.p(name + ".bias") if bias else y

    def _attention(self, a: AttentionSpec, x_TD):
        t = x_TD.shape[0]
        q = self._lin(x_TD, a.name + ".q_proj", a.bias).view(t, a.num_heads, a.head_dim)
        k = self._lin(x_TD, a.name + ".k_proj", a.bias).view(t, a.num_kv_heads, a.head_dim)
        v = self._lin(x_TD, a.name + ".v_proj", a.bias).view(t, a.num_kv_heads, a.head_dim)
        if a.rope is not None:
            pos = torch.arange(t, device=x_TD.device)
            q = apply_rope_reference(q, pos, a.rope.rotary_dim, a.rope.theta).to(self.dtype)
            k = apply_rope_reference(k, pos, a.rope.rotary_dim, a.rope.theta).to(self.dtype)
        rep = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("the,she->hts", q, k) * a.scale
        mask = torch.ones(t, t, dtype=torch.bool, device=x_TD.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hts,she->the", torch.softmax(s, -1), v).reshape(t, -1)
        return self._lin(o, a.name + ".o_proj", a.bias)

    def _mlp(self, m: MLPSpec, x_TD):
        up = self._lin(x_TD, m.name + ".up_proj", m.bias)
        if m.activation == "relu2":
            act = torch.relu(up).pow(2)
        else:
            act = nn.functional.silu(self._lin(x_TD, m.name + ".gate_proj", m.bias)) * up
        return self._lin(act, m.name + ".down_proj", m.bias)

    @torch.no_grad()
    def logits(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        """Logits of ONE sequence: int ``[T]`` -> ``[T, V]`` in ``self.dtype``."""
        s = self.spec
        h = self.p(s.embedding.name + ".weight")[input_ids_T.long()]
        for blk in s.blocks:
            x = self._rms(h, blk.norm.name, blk.norm.eps)
            h = h + (self._attention(blk.mixer, x) if isinstance(blk.mixer, AttentionSpec) else self._mlp(blk.mixer, x))
        h = self._rms(h, s.final_norm.name, s.final_norm.eps)
        return h @ self.p(s.lm_head.weight_name).t()

    def logprobs(self, input_ids_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log_softmax(logits / temperature)`` of one sequence: ``[T, V]``."""
        return torch.log_softmax(self.logits(input_ids_T) / temperature, dim=-1)
