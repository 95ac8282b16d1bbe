"""The DeepSeek-V4 compressors' pooling: ``compress_pool`` (CSA and HCA, main and indexer).

A compressed entry pools N candidate rows of C channels: per channel c,
``w[n, c] = softmax_n(score[n, c])`` and ``pooled[c] = sum_n w[n, c] kv[n, c]`` in fp32.
A candidate whose score is ``-inf`` has weight 0 (and its kv is never used); an entry
whose candidates are all ``-inf`` pools to 0. The caller builds the candidates (CSA:
block i-1's channels ``[:d]``, then block i's ``[d:]``; HCA: block i), then RMS-norms and
ropes the pooled entry (the compressed-attention layer, ``layers/deepseek_attention.py``).

Source: transformers 5.19 ``DeepseekV4CSACompressor.forward`` / ``DeepseekV4HCACompressor
.forward`` (``(new_kv * new_gate.softmax(dim=2, dtype=torch.float32)).sum(dim=2)``; the
contract keeps the product and the sum in fp32, where transformers rounds the weights to the
kv dtype first), and vLLM's ``vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py``
(``tl.softmax(score, dim=0)`` then ``tl.sum(kv * score, axis=0)`` over the fp32 state rows,
masked candidates loaded as score ``-inf``, kv 0).

Files (as every op family, see :mod:`unified_models.ops`): ``dispatch.py`` the public op
(argument checks, then the Triton kernel on GPU or the CPU path); ``cpu.py`` the
batch-invariant plain-torch path; ``triton.py`` the kernel (imported on first use);
``reference.py`` the fp64 oracle; ``backward.py`` the autograd function (analytic) and the
differentiable entry point that :mod:`unified_models.ops` exports.
"""

from .cpu import compress_pool_torch
from .dispatch import compress_pool
from .reference import compress_pool_reference

__all__ = ["compress_pool", "compress_pool_torch", "compress_pool_reference"]
