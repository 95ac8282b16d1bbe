"""Qwen3-MoE sparse MLP spec (the FFN sublayer of a Qwen3-MoE layer).

Forward: :mod:`unified_models.layers.qwen3_moe`. Stateless.

Names are those ``Qwen3MoeForCausalLM.save_pretrained`` writes (transformers 5.19 holds the experts
in memory as one fused ``experts.gate_up_proj [E, 2I, D]`` and ``experts.down_proj [E, D, I]`` and
splits them per expert on save; vLLM's loader reads the same names). With ``name`` =
``model.layers.{i}.mlp``: ``gate.weight [E, D]`` (router), ``experts.{e}.gate_proj.weight [I, D]``,
``experts.{e}.up_proj.weight [I, D]``, ``experts.{e}.down_proj.weight [D, I]``. No shared expert.

Shapes: D hidden, E routed experts, K top-k (``num_experts_per_tok``), I ``moe_intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecError

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
"""The routed experts' linears, in the order of the SwiGLU experts op (gate, up, down)."""


@dataclass(frozen=True, kw_only=True)
class Qwen3MoESpec:
    """Softmax-routed top-k MoE with SwiGLU experts (transformers ``Qwen3MoeSparseMoeBlock``).

    Router (``Qwen3MoeTopKRouter``): logits ``x gate^T`` in the model dtype, ``p = softmax`` in
    fp32, the top ``top_k`` by ``p`` (total order, ties to the lower expert index), weights ``p`` at
    the selected experts, divided by their sum when ``norm_topk_prob``. Experts
    (``Qwen3MoeExperts``): ``down_e(silu(gate_e x) * up_e x)`` times the routing weight, summed in
    fp32 in slot order and rounded once (:mod:`unified_models.ops.moe.softmax`,
    :func:`unified_models.ops.moe.deepseek.swiglu_experts` with ``weight_before_down=False``).

    Raises:
        SpecError: a size not an integer >= 1, ``top_k`` > experts, an activation other than silu.
    """

    name: str
    hidden_size: int
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for field in ("hidden_size", "n_routed_experts", "top_k", "moe_intermediate_size"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{self.name}: {field}={v!r} must be an integer >= 1")
        if self.top_k > self.n_routed_experts:
            raise SpecError(f"{self.name}: num_experts_per_tok={self.top_k} exceeds num_experts={self.n_routed_experts}")
        if self.hidden_act != "silu":
            raise SpecError(f"{self.name}: hidden_act={self.hidden_act!r}; only 'silu' (SwiGLU experts) is supported")
        if not isinstance(self.norm_topk_prob, bool):
            raise SpecError(f"{self.name}: norm_topk_prob={self.norm_topk_prob!r} must be a bool")

    def expert_linear(self, expert: int, proj: str) -> str:
        """Module name of routed expert ``expert``'s ``proj`` (``gate_proj`` / ``up_proj`` / ``down_proj``)."""
        return f"{self.name}.experts.{expert}.{proj}"

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, e, i = self.hidden_size, self.n_routed_experts, self.moe_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {f"{self.name}.gate.weight": (e, d)}
        proj_shape = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
        for j in range(e):
            for proj in EXPERT_PROJS:
                shapes[f"{self.expert_linear(j, proj)}.weight"] = proj_shape[proj]
        return shapes
