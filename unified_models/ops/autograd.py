"""Differentiable entry points of the ops, and the weight-version guard.

These are the functions :mod:`unified_models.ops` exports. With grad mode off,
or when no input requires grad, each one calls the op's dispatching function
directly (the inference path is unchanged). Otherwise it goes through a
``torch.autograd.Function`` whose forward calls that same function, so the
values are bitwise the same with and without a graph (DESIGN.md rule 11):

==========================  ===============================================
op                          backward
==========================  ===============================================
embedding                   analytic (``index_add`` of the row gradients)
rms_norm                    analytic, fp32
linear                      analytic (``dX = dY W``, ``dW = dY^T X``, ``db``)
relu2, swiglu               analytic, fp32
apply_rope                  analytic (inverse rotation); tables constant
write_kv_cache +            recomputation: plain-torch causal attention per
paged_attention             sequence, ``visible + (graph - graph.detach())``
logprobs                    analytic (softmax form, temperature included)
gather_token_logprobs       analytic (scatter)
==========================  ===============================================

Roundings of the forward (bf16 outputs, the KV-cache dtype, the FP8 KV-cache
quantization) pass gradients straight through (KV scales get none); gradients are computed in fp32 and cast to each input's
dtype. Backwards are correct, not batch-invariant.

**Weight-version guard.** Every backward that uses a weight (embedding,
rms_norm and linear weights and biases) refuses to run, raising
:class:`StaleWeightError` (a ``RuntimeError``) naming the weight, if the
weight changed since its forward: a ``tensor._version`` bump (any in-place
torch op, e.g. a torch optimizer's step), an explicit
:func:`bump_weight_version` (writes through ``param.data``, other views of
the storage or kernels, which bump no ``_version``) or a ``param.data = ...``
swap. In a training loop::

    name_weights(model.named_parameters())       # done by UnifiedMegatronModel
    bump_on_step(optimizer)                       # torch optimizers: bump after step()
    for batch in data:
        loss = -(model.token_logprobs(...) * adv).sum()
        loss.backward()                           # checks the stamps of the forward
        optimizer.step(); optimizer.zero_grad()
        bump_weight_version(model)                # Megatron optimizer / .data writes

A graph built before an update and differentiated after it raises instead of
returning gradients of no weight version.
"""

from __future__ import annotations

import torch

from .grad import kernels as _ops
from .grad.attention import paged_attention_grad, record_write, tape_of
from .grad.functions import (
    EmbeddingFn,
    GatherTokenFn,
    LinearFn,
    LogprobsFn,
    Relu2Fn,
    RMSNormFn,
    RopeFn,
    SwigluFn,
)
from .grad.weights import StaleWeightError, bump_on_step, bump_weight_version, name_weights, weight_version

__all__ = [
    "embedding", "rms_norm", "linear", "relu2", "swiglu", "apply_rope", "write_kv_cache", "paged_attention",
    "logprobs", "gather_token_logprobs", "StaleWeightError", "bump_weight_version", "bump_on_step",
    "name_weights", "weight_version", "needs_grad",
]


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def embedding(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """:func:`ops.embedding.embedding`, differentiable w.r.t. ``weight_VD``.

    ``[T]`` int ids, ``[V, D]`` -> ``[T, D]`` in the weight's dtype. Raises as the op.
    """
    if needs_grad(weight_VD):
        return EmbeddingFn.apply(input_ids_T, weight_VD)
    return _ops.embedding(input_ids_T, weight_VD)


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.rmsnorm.rms_norm`, differentiable w.r.t. ``x_TD`` and ``weight_D``.

    ``[T, D]``, ``[D]`` -> ``[T, D]`` in ``out_dtype`` (default the weight's). Raises as the op.
    """
    if needs_grad(x_TD, weight_D):
        return RMSNormFn.apply(x_TD, weight_D, eps, out_dtype or weight_D.dtype)
    return _ops.rms_norm(x_TD, weight_D, eps, out_dtype)


def linear(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.linear.linear`, differentiable w.r.t. ``x_TK``, ``weight_NK``, ``bias_N``.

    ``[T, K] @ [N, K]^T (+ [N])`` -> ``[T, N]`` in ``out_dtype`` (default x's). Raises as the op.
    """
    if needs_grad(x_TK, weight_NK, bias_N):
        return LinearFn.apply(x_TK, weight_NK, bias_N, out_dtype or x_TK.dtype)
    return _ops.linear(x_TK, weight_NK, bias_N, out_dtype)


def relu2(x_TF: torch.Tensor) -> torch.Tensor:
    """:func:`ops.activations.relu2`, differentiable: ``[T, F]`` -> ``[T, F]``."""
    if needs_grad(x_TF):
        return Relu2Fn.apply(x_TF)
    return _ops.relu2(x_TF)


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """:func:`ops.activations.swiglu`, differentiable w.r.t. both inputs (``[T, F]`` each).

    Raises:
        ValueError: shapes differ (checked before any graph is built).
    """
    if needs_grad(gate_TF, up_TF):
        if gate_TF.shape != up_TF.shape:
            raise ValueError(f"swiglu: gate {tuple(gate_TF.shape)} and up {tuple(up_TF.shape)} differ")
        return SwigluFn.apply(gate_TF, up_TF)
    return _ops.swiglu(gate_TF, up_TF)


def apply_rope(x_THE: torch.Tensor, positions_T: torch.Tensor, cos_PR: torch.Tensor,
               sin_PR: torch.Tensor) -> torch.Tensor:
    """:func:`ops.rope.apply_rope`, differentiable w.r.t. ``x_THE`` (``[T, H, E]``);
    the cos/sin tables get no gradient. Raises as the op."""
    if needs_grad(x_THE):
        return RopeFn.apply(x_THE, positions_T, cos_PR, sin_PR)
    return _ops.apply_rope(x_THE, positions_T, cos_PR, sin_PR)


def write_kv_cache(k_TGE: torch.Tensor, v_TGE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping_T: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """:func:`ops.attention.write_kv_cache` (in place), remembering differentiable writes.

    When ``k_TGE``/``v_TGE`` require grad (grad mode on), the write is also
    recorded on ``k_cache`` so a later :func:`paged_attention` over this cache
    sends gradients back to ``k_TGE``/``v_TGE``. The cache itself never joins
    the graph. ``k_scale``/``v_scale``: fp32 ``[]`` scales of an FP8 cache
    (constants: no gradient). Raises as the op; ``ValueError`` if ``k_cache``
    was taped with another ``v_cache``.
    """
    grad = needs_grad(k_TGE, v_TGE)
    if not grad and getattr(k_cache, "_um_kv_tape", None) is None:
        return _ops.write_kv_cache(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale, v_scale)
    with torch.no_grad():
        _ops.write_kv_cache(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, k_scale, v_scale)
    record_write(k_TGE, v_TGE, k_cache, v_cache, slot_mapping_T, grad)


def paged_attention(q_THE: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ops.attention.paged_attention`, differentiable w.r.t. ``q_THE`` and the
    K/V written into this cache by differentiable :func:`write_kv_cache` calls.

    Values are the kernel's. Gradients come from a plain-torch causal attention
    recomputed per sequence in the backward; K/V slots no differentiable write
    covers (earlier chunks) are constants. An FP8 cache (``k_scale``/``v_scale``)
    is differentiated at the dequantized values, straight through the
    quantization. Shapes and errors as the op.
    """
    tape = getattr(k_cache, "_um_kv_tape", None)
    grad_kv = tape is not None and tape.differentiable
    if not torch.is_grad_enabled() or not (q_THE.requires_grad or grad_kv):
        return _ops.paged_attention(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                                    k_scale, v_scale)
    return paged_attention_grad(q_THE, k_cache, v_cache, block_table_BN, seq_idx_T, positions_T, scale,
                                tape_of(k_cache, v_cache), k_scale, v_scale)


def logprobs(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`ops.logprob.logprobs`, differentiable: ``[T, V]`` -> fp32 ``[T, V]``. Raises as the op."""
    if needs_grad(logits_TV):
        return LogprobsFn.apply(logits_TV, temperature)
    return _ops.logprobs(logits_TV, temperature)


def gather_token_logprobs(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """:func:`ops.logprob.gather_token_logprobs`, differentiable: ``[T, V]``, ``[T]`` -> ``[T]``."""
    if needs_grad(logprobs_TV):
        return GatherTokenFn.apply(logprobs_TV, token_ids_T)
    return _ops.gather_token_logprobs(logprobs_TV, token_ids_T)
