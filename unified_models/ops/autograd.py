"""Differentiable entry points of the ops, and the weight-version guard.

These are the functions :mod:`unified_models.ops` exports; each is defined in
its family's ``ops/<family>/backward.py`` and gathered here. With grad mode
off, or when no input requires grad, each one calls the op's dispatching
function directly (the inference path is unchanged). Otherwise it goes through a
``torch.autograd.Function`` whose forward calls that same function, so the
values are bitwise the same with and without a graph (DESIGN.md rule 11):

==========================  ===============================================
op                          backward
==========================  ===============================================
embedding                   analytic (``index_add`` of the row gradients)
rms_norm, add_rms_norm      analytic, fp32
linear                      analytic (``dX = dY W``, ``dW = dY^T X``, ``db``)
relu2, swiglu               analytic, fp32
apply_rope                  analytic (inverse rotation); tables constant
write_kv_cache +            recomputation: plain-torch causal attention per
paged_attention             sequence, ``visible + (graph - graph.detach())``;
                            compressed entries (DeepSeek-V4) from their cache's tape
read_kv_cache               scatter onto the taped writes; older rows constant
logprobs                    analytic (softmax form, temperature included)
gather_token_logprobs       analytic (scatter)
token_logprobs              the two above fused: the gradient written over the kept log-probabilities
lm_head_token_logprobs      linear + token_logprobs in row chunks (recomputed per chunk)
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

from .activations.backward import relu2, swiglu
from .attention.backward import paged_attention, read_kv_cache, write_kv_cache
from .attention.common import CompressedKV
from .embedding.backward import embedding
from .grad.helpers import needs_grad
from .grad.weights import StaleWeightError, bump_on_step, bump_weight_version, name_weights, weight_version
from .linear.backward import linear
from .logprob.backward import gather_token_logprobs, logprobs, token_logprobs
from .logprob.lm_head import lm_head_token_logprobs
from .rmsnorm.backward import add_rms_norm, rms_norm
from .rope.backward import apply_rope

__all__ = [
    "embedding", "rms_norm", "add_rms_norm", "linear", "relu2", "swiglu", "apply_rope", "write_kv_cache", "paged_attention",
    "read_kv_cache", "CompressedKV",
    "logprobs", "gather_token_logprobs", "token_logprobs", "lm_head_token_logprobs", "StaleWeightError", "bump_weight_version", "bump_on_step",
    "name_weights", "weight_version", "needs_grad",
]
