"""The ops' dispatching functions, imported by name from their modules.

The package ``unified_models.ops`` re-exports differentiable wrappers under
the same names as some of its submodules (``embedding``, ``linear``), so
``from . import linear`` inside the package can return a function; the
autograd code reaches the forward kernels through this module instead.
"""

from ..activations import relu2, swiglu
from ..attention import paged_attention, write_kv_cache
from ..embedding import embedding
from ..linear import linear
from ..logprob import gather_token_logprobs, logprobs
from ..rmsnorm import rms_norm
from ..rope import apply_rope

__all__ = ["relu2", "swiglu", "paged_attention", "write_kv_cache", "embedding", "linear",
           "gather_token_logprobs", "logprobs", "rms_norm", "apply_rope"]
