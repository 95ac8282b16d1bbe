"""Mixture-of-experts spec (Nemotron-H ``E`` layers).

Forward: :mod:`unified_models.layers.moe`. Stateless.

Names are those of transformers' ``NemotronHMoE`` as written to checkpoints
(``save_pretrained`` splits the in-memory ``[E, I, D]`` stacks back into one
tensor per expert; vLLM's loader reads the same names):
``gate.weight [E, D]``, ``gate.e_score_correction_bias [E]``,
``experts.{e}.up_proj.weight [I, D]``, ``experts.{e}.down_proj.weight [D, I]``,
``shared_experts.up_proj.weight [Is, D]``, ``shared_experts.down_proj.weight [D, Is]``.

Shapes: D hidden, E routed experts, K top-k, I expert width, Is shared expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from .errors import SpecError


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Sigmoid-routed top-k MoE with non-gated relu2 experts and one shared expert.

    Router (transformers ``NemotronHTopkRouter``): fp32 logits ``x gate^T``,
    ``s = sigmoid``, selection by ``s + e_score_correction_bias`` (group-limited
    when ``n_group > 1``), weights ``s`` at the selected experts, divided by
    their sum when ``norm_topk_prob``, times ``routed_scaling_factor``.
    Experts: ``down_e(relu(up_e x)^2)``. Shared expert: the same form with
    width ``shared_intermediate_size``, on the same input, added before the
    single rounding of the combine. ``None``: no shared expert.

    The routed experts' linears (``experts.{e}.up_proj`` / ``down_proj``) may
    have a weight format (``ModelSpec.weight_formats``; NVFP4 in the published
    hybrids, all experts of a layer alike); the router, the correction bias and
    the shared expert stay in the model dtype.

    ``gate.e_score_correction_bias`` is stored and used in fp32 (transformers
    keeps it as an fp32 buffer; vLLM as an fp32 parameter).

    Latent MoE (``moe_latent_size``, Nemotron-3 Super) is refused.
    """

    name: str
    hidden_size: int
    n_routed_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int | None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    activation: str = "relu2"
    latent_size: int | None = None

    def __post_init__(self) -> None:
        if self.latent_size is not None:
            raise SpecError(f"{self.name}: latent MoE (moe_latent_size={self.latent_size}) is not supported; "
                            "only moe_latent_size=None (Nemotron-3 Nano and older Nemotron-H) is")
        if self.activation != "relu2":
            raise SpecError(f"{self.name}: MoE expert activation {self.activation!r}; only 'relu2' is supported")
        for field in ("hidden_size", "n_routed_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{self.name}: {field}={v!r} must be an integer >= 1")
        if self.shared_intermediate_size is not None and self.shared_intermediate_size < 1:
            raise SpecError(f"{self.name}: shared_intermediate_size={self.shared_intermediate_size} must be >= 1")
        e = self.n_routed_experts
        if self.top_k > e:
            raise SpecError(f"{self.name}: num_experts_per_tok={self.top_k} exceeds n_routed_experts={e}")
        if e % self.n_group:
            raise SpecError(f"{self.name}: n_group={self.n_group} does not divide n_routed_experts={e}")
        if self.n_group > 1:
            per = e // self.n_group
            if per < 2:
                raise SpecError(f"{self.name}: group scores sum the top 2 experts of a group; {e} experts in "
                                f"{self.n_group} groups leave {per} per group")
            if not 1 <= self.topk_group <= self.n_group or self.topk_group * per < self.top_k:
                raise SpecError(f"{self.name}: topk_group={self.topk_group} of n_group={self.n_group} cannot "
                                f"hold num_experts_per_tok={self.top_k} experts")
        object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))

    def route_kwargs(self) -> dict:
        """Keyword arguments of ``ops.moe_route`` for this layer."""
        return dict(top_k=self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                    norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)

    def expert_weight_name(self, expert: int, proj: str) -> str:
        """HF name of routed expert ``expert``'s ``proj`` (``up_proj`` / ``down_proj``) weight."""
        return f"{self.name}.experts.{expert}.{proj}.weight"

    def expert_linear(self, expert: int, proj: str) -> str:
        """Module name of routed expert ``expert``'s ``proj`` linear (its weight format's key)."""
        return f"{self.name}.experts.{expert}.{proj}"

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Tensors not stored in the model dtype: the fp32 correction bias."""
        return {f"{self.name}.gate.e_score_correction_bias": torch.float32}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, e = self.hidden_size, self.n_routed_experts
        p = self.name
        shapes: dict[str, tuple[int, ...]] = {
            f"{p}.gate.weight": (e, d),
            f"{p}.gate.e_score_correction_bias": (e,),
        }
        for j in range(e):
            shapes[self.expert_weight_name(j, "up_proj")] = (self.intermediate_size, d)
            shapes[self.expert_weight_name(j, "down_proj")] = (d, self.intermediate_size)
        if self.shared_intermediate_size is not None:
            s = self.shared_intermediate_size
            shapes[f"{p}.shared_experts.up_proj.weight"] = (s, d)
            shapes[f"{p}.shared_experts.down_proj.weight"] = (d, s)
        return shapes
