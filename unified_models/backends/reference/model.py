"""Reference model: the spec's math in plain PyTorch, no paged cache, no custom kernels.

Used as the oracle for peer checks (against transformers' own class) and for
tolerance tests of the engine path. Computes in ``dtype`` (fp32 or fp64) end
to end; attention is a dense causal softmax per sequence.

Mamba-2 (``M``) and MoE (``E``) layers use the ops' fp64 oracles
(``causal_conv1d_reference``, ``mamba2_dt_reference``, ``ssd_reference``, the
step-by-step recurrence, ``gated_rms_norm_reference``; ``moe_route_reference``,
``moe_experts_reference``, ``moe_shared_expert_reference``) and round their
outputs to ``dtype``: plain torch, differentiable. NVFP4 experts compute with
the dequantized weights (ModelOpt's rule) and pass gradients straight through
to the masters. Attention layers with an FP8 KV cache see K and V through the
cache's write-then-read rule (``ops.attention.kv_fp8_roundtrip`` with the
layer's ``k_scale``/``v_scale``), gradients straight through.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ...dsl import AttentionSpec, Mamba2Spec, MLPSpec, ModelSpec, MoESpec, SpecError
from ...ops.attention import kv_fp8_roundtrip
from ...ops.mamba2 import causal_conv1d_reference, gated_rms_norm_reference, mamba2_dt_reference, ssd_reference
from ...ops.moe import moe_experts_reference, moe_route_reference, moe_shared_expert_reference
from ...ops.nvfp4 import nvfp4_dequantize, nvfp4_quantize
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
        if a.kv_fp8:  # the FP8 KV cache's write-then-read rule, straight-through to k and v
            ks, vs = (self.p(n).detach().float() for n in a.kv_scale_names())
            k = k + (kv_fp8_roundtrip(k.detach(), ks, k.dtype) - k).detach()
            v = v + (kv_fp8_roundtrip(v.detach(), vs, v.dtype) - v).detach()
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

    def _mamba2(self, m: Mamba2Spec, x_TD):
        """One sequence from position 0; fp64 oracles, result in ``self.dtype``."""
        t = x_TD.shape[0]
        H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
        F, C = m.intermediate_size, m.conv_dim
        zxbcdt = self._lin(x_TD, m.name + ".in_proj", m.use_bias)
        z, xBC, dt = zxbcdt.split([F, C, H], dim=-1)
        conv_b = self.p(m.name + ".conv1d.bias") if m.use_conv_bias else None
        xBC = causal_conv1d_reference(xBC, self.p(m.name + ".conv1d.weight")[:, 0, :], conv_b).to(self.dtype)
        xs, B, Cm = xBC.split([F, G * N, G * N], dim=-1)
        dt = mamba2_dt_reference(dt, self.p(m.name + ".dt_bias"), m.time_step_limit)
        y, _ = ssd_reference(xs.reshape(t, H, P), dt, self.p(m.name + ".A_log"), B.reshape(t, G, N),
                             Cm.reshape(t, G, N), self.p(m.name + ".D"))
        y = gated_rms_norm_reference(y.reshape(t, F), z, self.p(m.name + ".norm.weight"), m.group_size, m.eps)
        return self._lin(y.to(self.dtype), m.name + ".out_proj", m.use_bias)

    def _expert_stack(self, m: MoESpec, proj: str):
        w = torch.stack([self.p(m.expert_weight_name(e, proj)) for e in range(m.n_routed_experts)])
        if m.quantization == "nvfp4":  # dequantized by ModelOpt's rule, straight-through to the masters
            wq = nvfp4_dequantize(nvfp4_quantize(w.detach().float()), torch.float32).to(w.dtype)
            w = w + (wq - w).detach()
        return w

    def _moe(self, m: MoESpec, x_TD):
        wts, ids = moe_route_reference(x_TD, self.p(m.name + ".gate.weight"),
                                       self.p(m.name + ".gate.e_score_correction_bias"), **m.route_kwargs())
        shared = None
        if m.shared_intermediate_size is not None:
            shared = moe_shared_expert_reference(x_TD, self.p(m.name + ".shared_experts.up_proj.weight"),
                                                 self.p(m.name + ".shared_experts.down_proj.weight"))
        y = moe_experts_reference(x_TD, ids, wts, self._expert_stack(m, "up_proj"), self._expert_stack(m, "down_proj"),
                                  shared)
        return y.to(self.dtype)

    def _mixer(self, mixer, x_TD):
        if isinstance(mixer, AttentionSpec):
            return self._attention(mixer, x_TD)
        if isinstance(mixer, MLPSpec):
            return self._mlp(mixer, x_TD)
        if isinstance(mixer, Mamba2Spec):
            return self._mamba2(mixer, x_TD)
        if isinstance(mixer, MoESpec):
            return self._moe(mixer, x_TD)
        raise SpecError(f"reference model: no forward for mixer {type(mixer).__name__}")

    @torch.no_grad()
    def logits(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        """Logits of ONE sequence: int ``[T]`` -> ``[T, V]`` in ``self.dtype``."""
        s = self.spec
        h = self.p(s.embedding.name + ".weight")[input_ids_T.long()]
        for blk in s.blocks:
            x = self._rms(h, blk.norm.name, blk.norm.eps)
            h = h + self._mixer(blk.mixer, x)
        h = self._rms(h, s.final_norm.name, s.final_norm.eps)
        return h @ self.p(s.lm_head.weight_name).t()

    def logprobs(self, input_ids_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log_softmax(logits / temperature)`` of one sequence: ``[T, V]``."""
        return torch.log_softmax(self.logits(input_ids_T) / temperature, dim=-1)
