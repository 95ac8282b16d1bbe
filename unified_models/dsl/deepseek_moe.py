"""DeepSeek-V4 mixture-of-experts spec (the FFN sublayer of every DeepSeek-V4 layer).

Forward: :mod:`unified_models.layers.deepseek_moe`. Stateless (a hash layer reads the
batch's token ids, no cache).

Names are those ``DeepseekV4ForCausalLM.save_pretrained`` writes (transformers 5.19:
``conversion_mapping.py`` "deepseek_v4" reverses its load-time renames on save, so the
checkpoint holds DeepSeek's own names; checked by saving a tiny model). With the spec's
``name`` = ``model.layers.{i}.ffn``:

* ``gate.weight [E, D]`` (router);
* regular layer: ``gate.bias [E]`` fp32 (in memory ``gate.e_score_correction_bias``);
* hash layer: ``gate.tid2eid [V, K]`` int64 (token id -> its K experts; no bias);
* ``experts.{j}.w1.weight [I, D]`` (gate), ``experts.{j}.w3.weight [I, D]`` (up),
  ``experts.{j}.w2.weight [D, I]`` (down) (in memory one fused
  ``experts.gate_up_proj [E, 2I, D]`` = cat(w1, w3) and ``experts.down_proj [E, D, I]``);
* ``shared_experts.w1.weight [I, D]``, ``w3 [I, D]``, ``w2 [D, I]`` (in memory
  ``shared_experts.{gate,up,down}_proj``).

Shapes: D hidden, E routed experts, K top-k (``num_experts_per_tok``), I
``moe_intermediate_size``, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpecError

EXPERT_PROJS = ("w1", "w3", "w2")
"""The routed and shared experts' linears: gate, up, down (DeepSeek's names)."""


@dataclass(frozen=True, kw_only=True)
class DeepseekV4MoESpec:
    """sqrt-softplus routed top-k (or hash-routed) MoE with clamped-SwiGLU experts and one shared expert.

    Router (transformers ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``): fp32
    logits ``x gate^T``, scores ``s = sqrt(softplus(logits))``; selection by
    ``s + gate.bias`` (regular layer; the bias ONLY selects) or ``tid2eid[token id]``
    (hash layer); weights ``s`` at the selected experts divided by their sum
    (+1e-20), times ``routed_scaling_factor``. Experts (``DeepseekV4Experts``) and the
    shared expert (``DeepseekV4MLP``): ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``,
    ``L = swiglu_limit``; the shared expert's width is ``moe_intermediate_size`` (transformers
    reads ``config.intermediate_size``, mapped to ``moe_intermediate_size``).

    Attributes:
        name: module prefix (``model.layers.{i}.ffn``).
        hidden_size, n_routed_experts, top_k, moe_intermediate_size: D, E, K, I.
        n_shared_experts: must be 1 (transformers builds one shared MLP of width I
            whatever this says; vLLM's width is ``I * n_shared_experts``: they agree only at 1).
        routed_scaling_factor: multiplies the routing weights.
        norm_topk_prob: must be True (transformers' V4 routers always normalise).
        swiglu_limit: ``L > 0`` (transformers clamps unconditionally; DeepSeek's code skips
            the clamp at 0, so 0 is refused as ambiguous).
        scoring_func: ``"sqrtsoftplus"`` (the only one supported).
        hidden_act: ``"silu"``.
        hash_routing: a ``hash_moe`` layer (``config.mlp_layer_types[i]``).
        vocab_size: rows of ``tid2eid`` (required for a hash layer).

    Raises:
        SpecError: any unsupported or inconsistent field, naming it.
    """

    name: str
    hidden_size: int
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    hidden_act: str = "silu"
    hash_routing: bool = False
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        for field in ("hidden_size", "n_routed_experts", "top_k", "moe_intermediate_size"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"{self.name}: {field}={v!r} must be an integer >= 1")
        if self.top_k > self.n_routed_experts:
            raise SpecError(f"{self.name}: num_experts_per_tok={self.top_k} exceeds "
                            f"n_routed_experts={self.n_routed_experts}")
        if self.scoring_func != "sqrtsoftplus":
            raise SpecError(f"{self.name}: scoring_func={self.scoring_func!r}; only 'sqrtsoftplus' is supported")
        if self.hidden_act != "silu":
            raise SpecError(f"{self.name}: hidden_act={self.hidden_act!r}; only 'silu' (SwiGLU experts) is supported")
        if self.n_shared_experts != 1:
            raise SpecError(f"{self.name}: n_shared_experts={self.n_shared_experts!r}; only 1 is supported "
                            "(transformers' DeepseekV4MLP has width moe_intermediate_size whatever the count)")
        if self.norm_topk_prob is not True:
            raise SpecError(f"{self.name}: norm_topk_prob={self.norm_topk_prob!r}; transformers' DeepSeek-V4 "
                            "routers always renormalise the top-k weights, so only True is supported")
        limit = float(self.swiglu_limit) if isinstance(self.swiglu_limit, (int, float)) else float("nan")
        if not limit > 0 or limit == float("inf"):
            raise SpecError(f"{self.name}: swiglu_limit={self.swiglu_limit!r} must be a finite number > 0")
        if self.hash_routing:
            if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
                raise SpecError(f"{self.name}: a hash-routed layer needs vocab_size >= 1 (rows of gate.tid2eid), "
                                f"got {self.vocab_size!r}")
        object.__setattr__(self, "swiglu_limit", limit)
        object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))

    def route_kwargs(self) -> dict:
        """Keyword arguments of ``ops.sqrtsoftplus_route`` / ``ops.hash_route`` for this layer."""
        return dict(norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)

    @property
    def selection_name(self) -> str:
        """HF name of the selection tensor: ``gate.tid2eid`` (hash) or ``gate.bias``."""
        return f"{self.name}.gate.{'tid2eid' if self.hash_routing else 'bias'}"

    def expert_linear(self, expert: int, proj: str) -> str:
        """Module name of routed expert ``expert``'s ``proj`` (``w1`` / ``w3`` / ``w2``) linear."""
        return f"{self.name}.experts.{expert}.{proj}"

    def shared_linear(self, proj: str) -> str:
        """Module name of the shared expert's ``proj`` (``w1`` / ``w3`` / ``w2``) linear."""
        return f"{self.name}.shared_experts.{proj}"

    def parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Tensors not in the model dtype (never trained): the fp32 bias or the int64 hash table."""
        return {self.selection_name: torch.int64 if self.hash_routing else torch.float32}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        d, e, i = self.hidden_size, self.n_routed_experts, self.moe_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            f"{self.name}.gate.weight": (e, d),
            self.selection_name: (self.vocab_size, self.top_k) if self.hash_routing else (e,),
        }
        proj_shape = {"w1": (i, d), "w3": (i, d), "w2": (d, i)}
        for j in range(e):
            for proj in EXPERT_PROJS:
                shapes[f"{self.expert_linear(j, proj)}.weight"] = proj_shape[proj]
        for proj in EXPERT_PROJS:
            shapes[f"{self.shared_linear(proj)}.weight"] = proj_shape[proj]
        return shapes
