"""mHC (manifold-constrained hyper-connections): the residual streams' mixing ops.

With n streams ``h [T, n, D]`` (DeepSeek-V4: n = ``hc_mult`` = 4):

* :func:`hc_pre` (one per sublayer): ``flat = rms(h.flatten().float())`` (unweighted,
  ``rms_norm_eps``), ``mix = flat fn^T`` (fp32, ``M = (2 + n) n`` logits), then
  ``pre = sigmoid(.) + hc_eps``, ``post = 2 sigmoid(.)``, ``comb = Sinkhorn(softmax(.) + hc_eps)``
  (fp32, a fixed number of iterations, fixed order) and the sublayer input
  ``x = round(sum_j pre_j h_j)``;
* :func:`hc_post`: ``h'_k = round(round(post_k) y) + round(sum_j round(comb[j, k]) h_j)``;
* :func:`hc_head` (before the final norm): ``round(sum_j (sigmoid(.) + hc_eps) h_j)``.

Source: transformers 5.19 ``models/deepseek_v4/modeling_deepseek_v4.py``
(``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead``, ``DeepseekV4DecoderLayer``), whose
rounding points the CPU path keeps; paper: Xie et al., arXiv 2512.24880.

Files (as every op family, see :mod:`unified_models.ops`): ``dispatch.py`` the public ops;
``cpu.py`` the batch-invariant CPU path (fixed row tiles, fp64-exact projection via the
linear's CPU path, stream sums as fixed chains of adds); ``triton.py`` the GPU kernels (a
fixed-chunk projection on tensor cores, the coefficients and Sinkhorn per tile of tokens, the
collapse and the post, same formulas and rounding points); ``reference.py`` the
formulas in differentiable torch and the fp64 oracle; ``backward.py`` the differentiable
entry points (recomputation of the formulas).
"""

from .dispatch import hc_head, hc_post, hc_pre
from .reference import hc_head_reference, hc_post_reference, hc_pre_reference

__all__ = ["hc_pre", "hc_post", "hc_head", "hc_pre_reference", "hc_post_reference", "hc_head_reference"]
