"""The numerical contract: one module per operator family.

Each op has a dispatching function (Triton on GPU; a batch-invariant
plain-torch implementation on CPU, see ``_dispatch``), the Triton kernel in
``ops/triton/``, and a ``*_reference`` oracle. No op imports an engine.

The functions exported here are the differentiable entry points of
:mod:`.autograd`: with no input requiring grad (or grad mode off) they call
the dispatching function directly; otherwise a ``torch.autograd.Function``
whose forward is that same function (bitwise the same values) and whose
backward is analytic or a recomputation (DESIGN.md rule 11). The weight-version
guard (:func:`bump_weight_version`, :class:`StaleWeightError`) lives there too.
"""

from .autograd import (
    StaleWeightError,
    apply_rope,
    bump_on_step,
    bump_weight_version,
    embedding,
    gather_token_logprobs,
    linear,
    logprobs,
    name_weights,
    paged_attention,
    relu2,
    rms_norm,
    swiglu,
    weight_version,
    write_kv_cache,
)
from .rope import rope_cos_sin

__all__ = ["embedding", "rms_norm", "linear", "relu2", "swiglu", "write_kv_cache",
           "paged_attention", "logprobs", "gather_token_logprobs", "rope_cos_sin", "apply_rope",
           "StaleWeightError", "bump_weight_version", "bump_on_step", "name_weights", "weight_version"]
