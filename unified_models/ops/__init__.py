"""The numerical contract: one module per operator family.

Each op has a dispatching public function (Triton on GPU; a batch-invariant
plain-torch implementation on CPU, see ``_dispatch``), the Triton kernel in
``ops/triton/``, and a ``*_reference`` oracle. No op imports an engine.
"""

from .activations import relu2, swiglu
from .attention import paged_attention, write_kv_cache
from .embedding import embedding
from .linear import linear
from .logprob import gather_token_logprobs, logprobs
from .rmsnorm import rms_norm
from .rope import apply_rope, rope_cos_sin

__all__ = ["embedding", "rms_norm", "linear", "relu2", "swiglu", "write_kv_cache",
           "paged_attention", "logprobs", "gather_token_logprobs", "rope_cos_sin", "apply_rope"]
