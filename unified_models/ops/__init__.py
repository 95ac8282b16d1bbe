"""The numerical contract: one package per operator family.

Every op family (``activations``, ``attention``, ``compressor``, ``embedding``, ``fp8``, ``fp8_block``,
``linear``, ``logprob``, ``mamba2``, ``mhc``, ``moe``, ``rmsnorm``, ``rope``) is a package
``ops/<family>/`` with the same files:

* ``__init__.py``  the family's public names (imported from the files below);
* ``dispatch.py``  the public ops without autograd (the contract: shapes, dtypes,
  errors): each checks its arguments, then runs the Triton kernel on GPU or the
  batch-invariant plain-torch implementation on CPU (see ``_dispatch``);
* ``cpu.py``       that CPU path (``*_torch``);
* ``triton.py``    the Triton kernel (``*_triton``), imported on first use;
* ``reference.py`` the fp64 oracle (``*_reference``);
* ``backward.py``  the autograd functions and the differentiable entry points;
* ``common.py``    (attention, compressor, fp8, fp8_block, mamba2, moe) what several of these share:
  formats, data classes, checks.

Imports point one way: ``dispatch`` imports ``cpu`` and (lazily) ``triton``;
``backward`` imports ``dispatch``; the kernel, the CPU path and the oracle never
import the dispatcher (``tests/test_import_graph.py`` checks that no module of
the package takes part in an import cycle). Shared by all families:
``_dispatch.py`` (which implementation runs, CPU row tiles), ``triton/_common.py``
(helpers of the kernels), ``grad/`` (the weight-version guard, backward helpers),
``scales.py`` (scale checks) and ``nvfp4.py`` (the NVFP4 weight format, whose
kernel side is in ``moe/triton.py``). No op imports an engine.

The functions exported here are the differentiable entry points of
:mod:`.autograd`: with no input requiring grad (or grad mode off) they call
the dispatching function directly; otherwise a ``torch.autograd.Function``
whose forward is that same function (bitwise the same values) and whose
backward is analytic or a recomputation (DESIGN.md rule 11). The weight-version
guard (:func:`bump_weight_version`, :class:`StaleWeightError`) lives there too.
"""

from .autograd import (
    StaleWeightError,
    add_rms_norm,
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
    lm_head_token_logprobs,
    swiglu,
    token_logprobs,
    weight_version,
    write_kv_cache,
)
from .rope import rope_cos_sin
from .moe.backward import moe_experts, moe_route, moe_shared_expert
from .nvfp4 import (NVFP4Error, NVFP4Weight, nvfp4_dequantize, nvfp4_quantize, nvfp4_quantize_into, nvfp4_scale_2,
                    stack_nvfp4_experts, validate_nvfp4, validate_nvfp4_experts)

__all__ = ["embedding", "rms_norm", "add_rms_norm", "linear", "relu2", "swiglu", "write_kv_cache",
           "paged_attention", "logprobs", "gather_token_logprobs", "token_logprobs", "lm_head_token_logprobs",
           "rope_cos_sin", "apply_rope",
           "StaleWeightError", "bump_weight_version", "bump_on_step", "name_weights", "weight_version"]
__all__ += ["moe_route", "moe_experts", "moe_shared_expert", "NVFP4Error", "NVFP4Weight", "nvfp4_quantize",
            "nvfp4_dequantize", "nvfp4_quantize_into", "nvfp4_scale_2", "validate_nvfp4", "validate_nvfp4_experts",
            "stack_nvfp4_experts"]
from .mamba2.backward import causal_conv1d, gated_rms_norm, mamba2_dt, ssd_chunk_scan
from .mamba2 import Mamba2Metadata, Mamba2State, mamba2_decode_metadata, mamba2_metadata, start_positions

__all__ += ["causal_conv1d", "mamba2_dt", "ssd_chunk_scan", "gated_rms_norm", "Mamba2State", "Mamba2Metadata",
            "mamba2_metadata", "mamba2_decode_metadata", "start_positions"]
from .fp8 import (FP8_E4M3_MAX, FP8Error, FP8Weight, fp8_input_scale, fp8_linear, fp8_quantize, fp8_quantize_activation,
                  fp8_quantize_into, fp8_quantize_weight, fp8_weight_scale, validate_fp8)

__all__ += ["FP8_E4M3_MAX", "FP8Error", "FP8Weight", "fp8_input_scale", "fp8_linear", "fp8_quantize",
            "fp8_quantize_activation", "fp8_quantize_into", "fp8_quantize_weight", "fp8_weight_scale", "validate_fp8"]
from .mhc.backward import hc_head, hc_post, hc_pre

__all__ += ["hc_pre", "hc_post", "hc_head"]
from .fp8_block import FP8BlockWeight, ds_kv_fp8_roundtrip, fp8_block_linear

__all__ += ["FP8BlockWeight", "fp8_block_linear", "ds_kv_fp8_roundtrip"]
from .moe.deepseek_backward import hash_route, sqrtsoftplus_route, swiglu_experts, swiglu_shared_expert

__all__ += ["sqrtsoftplus_route", "hash_route", "swiglu_experts", "swiglu_shared_expert"]
from .moe.softmax_backward import softmax_route

__all__ += ["softmax_route"]
from .compressor.backward import compress_pool

__all__ += ["compress_pool"]
from .autograd import CompressedKV, read_kv_cache

__all__ += ["CompressedKV", "read_kv_cache"]
from .indexer import indexer_topk

__all__ += ["indexer_topk"]
