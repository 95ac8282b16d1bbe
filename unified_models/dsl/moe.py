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
from typing import Literal

import torch

from .errors import SpecError

ExpertQuantization = Literal["bf16", "nvfp4"]
CheckpointFormat = Literal["master", "modelopt"]
"""How quantized weights are stored: ``"master"`` = model-dtype master weights,
quantized on every forward by the shared rule; ``"modelopt"`` = NVIDIA
ModelOpt's exported format (packed codes and scales), used as stored."""

NVFP4_BLOCK = 16
"""Elements of K per NVFP4 block scale (ModelOpt ``group_size``)."""


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

    ``quantization`` is the routed experts' weight format: ``"bf16"`` or
    ``"nvfp4"`` (W4A16 by ModelOpt's rule: the trainer quantizes its bf16
    masters on every forward; the rollout engine may hold ModelOpt-format
    weights). The router, the correction bias and the shared expert stay in
    the model dtype.

    ``checkpoint_format`` (NVFP4 only): ``"master"`` (bf16 expert weights,
    quantized by ModelOpt's rule on every forward; what the trainer trains) or
    ``"modelopt"`` (ModelOpt's export: per expert ``weight`` uint8 ``[N, K/2]``,
    ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_scale_2`` fp32 ``[]``
    and, when ``expert_input_scale`` (``quant_algo`` NVFP4, i.e. a W4A4 export),
    ``input_scale`` fp32 ``[]``, validated but unused by the W4A16 kernels).

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
    quantization: ExpertQuantization = "bf16"
    latent_size: int | None = None
    checkpoint_format: CheckpointFormat = "master"
    expert_input_scale: bool = False

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
        if self.quantization not in ("bf16", "nvfp4"):
            raise SpecError(f"{self.name}: expert quantization {self.quantization!r}; known: 'bf16', 'nvfp4'")
        if self.quantization == "nvfp4":
            for what, k in (("hidden_size (up_proj K)", self.hidden_size),
                            ("moe_intermediate_size (down_proj K)", self.intermediate_size)):
                if k % NVFP4_BLOCK:
                    raise SpecError(f"{self.name}: NVFP4 experts need {what}={k} divisible by {NVFP4_BLOCK}")
        if self.checkpoint_format not in ("master", "modelopt"):
            raise SpecError(f"{self.name}: checkpoint_format {self.checkpoint_format!r}; known: 'master', 'modelopt'")
        if self.checkpoint_format == "modelopt" and self.quantization != "nvfp4":
            raise SpecError(f"{self.name}: checkpoint_format 'modelopt' needs quantization 'nvfp4'")
        if self.expert_input_scale and self.checkpoint_format != "modelopt":
            raise SpecError(f"{self.name}: expert_input_scale applies to ModelOpt-format NVFP4 experts only")
        object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))

    def route_kwargs(self) -> dict:
        """Keyword arguments of ``ops.moe_route`` for this layer."""
        return dict(top_k=self.top_k, n_group=self.n_group, topk_group=self.topk_group,
                    norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)

    def expert_weight_name(self, expert: int, proj: str) -> str:
        """HF name of routed expert ``expert``'s ``proj`` (``up_proj`` / ``down_proj``) weight."""
        return f"{self.name}.experts.{expert}.{proj}.weight"

    def stacked_expert_name(self, proj: str) -> str:
        """Key under which an engine may hand the layer all experts' ``proj`` at once
        (``[E, N, K]`` tensor or ``ops.NVFP4Weight``): transformers' in-memory name
        ``<mixer>.experts.up_proj`` / ``.down_proj``. Not a checkpoint parameter."""
        return f"{self.name}.experts.{proj}"

    @property
    def packed(self) -> bool:
        """True when the routed experts are stored in ModelOpt's NVFP4 format."""
        return self.checkpoint_format == "modelopt"

    def expert_tensor_names(self, expert: int, proj: str) -> dict[str, str]:
        """Field (``weight``/``weight_scale``/``weight_scale_2``/``input_scale``) -> HF
        name of one routed expert projection's stored tensors (only ``weight``
        unless :attr:`packed`)."""
        base = f"{self.name}.experts.{expert}.{proj}"
        fields = ["weight"]
        if self.packed:
            fields += ["weight_scale", "weight_scale_2"] + (["input_scale"] if self.expert_input_scale else [])
        return {f: f"{base}.{f}" for f in fields}

    def expert_proj_shapes(self, proj: str) -> dict[str, tuple[int, ...]]:
        """Field -> shape of one expert's stored ``proj`` tensors (see :meth:`expert_tensor_names`)."""
        n, k = (self.intermediate_size, self.hidden_size) if proj == "up_proj" else (self.hidden_size,
                                                                                        self.intermediate_size)
        if not self.packed:
            return {"weight": (n, k)}
        out = {"weight": (n, k // 2), "weight_scale": (n, k // NVFP4_BLOCK), "weight_scale_2": ()}
        if self.expert_input_scale:
            out["input_scale"] = ()
        return out

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Tensors not stored in the model dtype: the fp32 correction bias and,
        when :attr:`packed`, the NVFP4 codes (uint8) and scales (e4m3 / fp32)."""
        out = {f"{self.name}.gate.e_score_correction_bias": torch.float32}
        if self.packed:
            dt = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32,
                  "input_scale": torch.float32}
            for e in range(self.n_routed_experts):
                for proj in ("up_proj", "down_proj"):
                    out.update({n: dt[f] for f, n in self.expert_tensor_names(e, proj).items()})
        return out

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, e = self.hidden_size, self.n_routed_experts
        p = self.name
        shapes: dict[str, tuple[int, ...]] = {
            f"{p}.gate.weight": (e, d),
            f"{p}.gate.e_score_correction_bias": (e,),
        }
        for j in range(e):
            for proj in ("up_proj", "down_proj"):
                fshapes = self.expert_proj_shapes(proj)
                shapes.update({n: fshapes[f] for f, n in self.expert_tensor_names(j, proj).items()})
        if self.shared_intermediate_size is not None:
            s = self.shared_intermediate_size
            shapes[f"{p}.shared_experts.up_proj.weight"] = (s, d)
            shapes[f"{p}.shared_experts.down_proj.weight"] = (d, s)
        return shapes
