"""Mixture of experts (Nemotron-H): sigmoid router, relu2 experts over grouped tokens, ordered combine.

Shapes: T tokens, D expert input width (hidden, or the latent width), E routed
experts, K = top-k slots per token, R = T*K assignments, I expert intermediate
width, G expert groups.

**Router** (:func:`moe_route`; transformers ``NemotronHTopkRouter``, vLLM
``grouped_topk`` with ``scoring_func="sigmoid"``):

1. ``logits = x W^T`` from ONE fp32-output GEMM (:func:`ops.linear.linear`,
   the batch-invariant GEMM; bf16 ``x``/``W`` stay bf16 operands, any other
   mix is computed on fp32 operands);
2. ``s = sigmoid(logits)`` (fp32);
3. selection score ``c = s + e_score_correction_bias`` (fp32; the bias is
   used ONLY for selection);
4. group-limited selection when ``n_group > 1``: group score = sum of the top
   two ``c`` of each group (transformers' rule, with or without a bias; vLLM
   takes the max when a model has no correction bias), the ``topk_group``
   best groups are kept, every other expert's ``c`` becomes ``-inf``;
5. top-k of ``c`` as a **total order** (DESIGN.md rule 4): each candidate's
   key packs ``(c, index)`` into one int64, the order-preserving integer image
   of the fp32 ``c`` in the high 32 bits and ``E - 1 - index`` in the low 32
   bits, so **among equal scores the lower expert index wins** (the same rule
   ranks groups). ``-0.0`` is canonicalised to ``+0.0`` first so equal values
   are equal keys;
6. the selected slots are in **descending key order** (best first; ties by
   ascending expert index). That order is the combine's accumulation order;
7. weights = ``s`` (not ``c``) gathered at the selected experts; when
   ``norm_topk_prob``: divided by ``(w_0 + w_1 + ... + w_{K-1}) + 1e-20`` (the
   sum in slot order, transformers' epsilon); then times
   ``routed_scaling_factor`` (fp32). (vLLM scales the summed output instead;
   the two differ only by fp32 rounding. Here the scale is in the weights, as
   in transformers.)

**Experts** (:func:`moe_experts`): non-gated relu2 MLPs, ``E_e(x) =
down_e(relu(up_e x)^2)`` (``NemotronHExperts``: ``up_proj [E, I, D]``,
``down_proj [E, D, I]``; no gate projection). Assignments are grouped by
expert with a stable, batch-independent rule (sort by ``(expert, token,
slot)``) and run as a grouped GEMM whose tiles are fixed per weight shape
``(N, K)``, never by the number of tokens. Per assignment:
``h = round_x(relu(fp32(x up_e^T))^2)`` (the relu2 epilogue in fp32, ONE
rounding to the activation dtype) and ``y = fp32(h down_e^T)``; the GEMMs
accumulate in fp32 on GPU and as exact fp64 dot products rounded once on CPU.
Weights are bf16 tensors or :class:`~unified_models.ops.nvfp4.NVFP4Weight`
(dequantized to bf16 tiles inside the kernel by ModelOpt's rule: no FP4
tensor cores on the H200).

**Combine** (DESIGN.md rule 6): ``out_t = round(((0 + w_t0 y_t0) + w_t1 y_t1
+ ... + w_t,K-1 y_t,K-1) + shared_t)`` in fp32, in slot order, then one
rounding to the output dtype. ``shared_t`` is the shared expert's fp32 output
(:func:`moe_shared_expert`), added before that single rounding. With a latent
MoE (``moe_latent_size``) the layer runs the experts on the latent ``u =
fc1(x)`` without ``shared``, then ``fc2`` and the shared expert outside.

Every token's result depends only on its own row: fixed tiles, a full K loop
per program, no split-K, no atomics; on CPU exact products and exact sums
(docs/consistency.md, "CPU results do not depend on the host's BLAS") and
elementwise fp32 steps in a fixed order. The router's sigmoid on CPU runs on
fixed ``[16, E padded to 64]`` tiles, so every element goes through ATen's
vectorised path whatever its row's place in the batch.

Files (the same for every op family): ``dispatch.py`` the public ops (argument checks,
then the Triton kernel on GPU or the CPU path, see ``ops/_dispatch.py``); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the Triton kernel (imported on first
use); ``reference.py`` the fp64 oracle; ``backward.py`` the autograd functions and the
differentiable entry points that :mod:`unified_models.ops` exports; ``common.py`` the
expert weights' type and checks and the expert grouping, which the kernel, the CPU path,
the oracle and the backward share. The names here are the ops without autograd; the
differentiable ``moe_route``, ``moe_experts`` and ``moe_shared_expert`` are those of
:mod:`unified_models.ops`.
"""

from .common import (NORM_EPS, ExpertWeight, check_expert_args, expert_counts, expert_rows, expert_weight,
                     group_by_expert, stack_expert)
from .cpu import moe_combine_torch, moe_expert_outputs_torch
from .dispatch import (moe_combine, moe_expert_outputs, moe_experts, moe_route, moe_select, moe_shared_expert,
                       router_logits, topk_total_order, total_order_keys)
from .reference import moe_experts_reference, moe_route_reference, moe_shared_expert_reference
from .deepseek import (hash_route, hash_select, sqrtsoftplus_route, sqrtsoftplus_scores, sqrtsoftplus_select,
                       swiglu_expert_outputs, swiglu_experts, swiglu_shared_expert, topk_slot_weights)
from .deepseek_cpu import swiglu_expert_outputs_torch
from .deepseek_reference import (hash_route_reference, sqrtsoftplus_route_reference, swiglu_experts_reference,
                                 swiglu_shared_expert_reference)

__all__ = ["moe_route", "moe_select", "router_logits", "total_order_keys", "topk_total_order", "moe_expert_outputs",
           "moe_combine", "moe_experts", "moe_shared_expert", "ExpertWeight", "NORM_EPS", "check_expert_args",
           "expert_weight", "group_by_expert", "expert_rows", "expert_counts", "stack_expert",
           "moe_expert_outputs_torch", "moe_combine_torch", "moe_route_reference", "moe_experts_reference",
           "moe_shared_expert_reference"]
# DeepSeek-V4 (deepseek.py, deepseek_cpu.py, deepseek_reference.py, deepseek_backward.py): sqrt-softplus and
# hash routers, clamped-SwiGLU experts (routing weight before the down projection), the same ordered combine
__all__ += ["sqrtsoftplus_scores", "topk_slot_weights", "sqrtsoftplus_select", "sqrtsoftplus_route", "hash_select",
            "hash_route", "swiglu_expert_outputs", "swiglu_experts", "swiglu_shared_expert",
            "swiglu_expert_outputs_torch", "sqrtsoftplus_route_reference", "hash_route_reference",
            "swiglu_experts_reference", "swiglu_shared_expert_reference"]
# Qwen3-MoE (softmax.py, softmax_cpu.py, softmax_triton.py, softmax_reference.py, softmax_backward.py): the
# softmax top-k router; its experts are the SwiGLU experts above with weight_before_down=False, swiglu_limit=inf
from .softmax import softmax_route, softmax_scores, softmax_select
from .softmax_cpu import softmax_scores_torch
from .softmax_reference import softmax_route_reference

__all__ += ["softmax_scores", "softmax_select", "softmax_route", "softmax_scores_torch", "softmax_route_reference"]
