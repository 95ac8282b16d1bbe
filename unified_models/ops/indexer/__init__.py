"""The lightning indexer of DeepSeek-V4's compressed sparse attention (CSA): which compressed
entries each query token attends (:func:`indexer_topk`).

Shapes: T tokens, H indexer heads (``index_n_heads``), I indexer head dim
(``index_head_dim``), B sequences (block-table rows), N cache blocks, P = S // ratio entries
per cache block (S = the block size in tokens), J entries, K = ``topk`` (``index_topk``).

**Score** (transformers 5.19 ``DeepseekV4IndexerScorer``; paper section 2.3.1)::

    score[t, j] = sum_h  w[t, h] * (relu(q[t, h] . k_j) * softmax_scale)

with ``k_j`` the indexer key of compressed entry j of t's own sequence (an
:class:`~unified_models.caches.IndexerKeyCache` page ``[N, P, 1, I]``: entry j of sequence b
lives in block ``block_table[b, j // P]`` at offset ``j % P``, which is
``state.entry_slots``' rule ``block_table[b, j*ratio // S]``, ``(j*ratio % S) // ratio``).
The caller passes ``w`` already scaled (transformers: ``weights_proj(x) * index_n_heads**-0.5``)
and ``softmax_scale`` (transformers: ``index_head_dim**-0.5``), which is applied here.
Rounding points, in every implementation:

1. ``q[t, h] . k_j`` from the model-dtype operands, accumulated in fp32 or better in a fixed
   order per (t, h, j), rounded to fp32 (CPU and the Triton interpreter: exact fp64 products
   of the bf16/fp16 operands, summed exactly, rounded once; CUDA: a tensor-core ``tl.dot``
   with fp32 accumulation whose tile shape depends only on the model);
2. ``relu``, then ``* softmax_scale`` (fp32), then ``* w[t, h]`` (fp32), each one fp32 rounding;
3. the sum over h in fp32 in a fixed order (CPU: ``h = 0, 1, ..., H-1``; CUDA: one ``tl.sum``
   over a register tile whose shape depends only on H).

**Causality.** A token at position p (its position in its own sequence) may select entry j
only if ``j < (p + 1) // ratio`` (entry j is complete when position ``ratio*j + ratio - 1``
is). A token with ``p < 0`` or ``seq_idx < 0`` (padding) selects nothing.

**Selection is a total order** (DESIGN.md rule 4). Each valid (t, j) gets one int64 key
(:func:`indexer_keys`): high 32 bits the order-preserving int32 image of the fp32 score
(non-negative floats keep their bits, negative floats have their 31 low bits flipped),
low 32 bits ``j``. So among equal scores the LARGER j wins. ``-0.0`` is made ``+0.0``
before packing (``-0.0 + 0.0 = +0.0``), so the two zeros are one score; a NaN score (only
from NaN/inf inputs) ranks as ``-inf``. Keys of one row are distinct, so ``torch.topk``
on them has one answer on every device. The top ``topk`` valid keys are taken, their
entries sorted DESCENDING, and ``-1`` fills the rest (fewer valid entries than ``topk``).

**Batch invariance.** ``score[t, j]`` depends only on ``q[t]``, ``w[t]``, ``softmax_scale``
and the key of entry j, never on the other tokens, the other sequences, their lengths, the
block layout or the block size: CPU computes fixed-shape tiles (16 tokens x 16 entries,
entry tiles aligned at j = 0) whose dot products are exact and whose sums over h are a fixed
chain; the Triton kernel (one program per token and entry tile, every constexpr a function
of H, I and the dtype) looks each entry's block up on its own. The selection sees a row's
valid keys only (invalid columns are the minimal int64, never selected), so the width of
the score matrix (CPU: the batch's largest bound; CUDA: the block table's ``nb * P``) does
not matter either. For bf16/fp16 operands the CPU path and the Triton kernel under the
interpreter give the same scores bit for bit up to the sign of a zero score (the kernel's
padded heads add +0.0; the keys canonicalise zeros) and so the same selection (exact fp64
dots rounded once, the same h order); on CUDA
the bits are the GPU's own (not those of the CPU), identical for rollout and trainer.

Not differentiable: the indexer's input is detached and its weights are not trained
(transformers' ``DeepseekV4Indexer`` returns integer indices), so there is no backward.

Limitation: the CUDA path materialises fp32 scores and int64 keys for a chunk of tokens
over the whole block-table width (chunks of at most 2^26 scores) before ``torch.topk``;
a fused streaming top-k would avoid that memory at long context. Measured on the H200
(published shapes H = 64, I = 128, bf16, ratio 4, top-k 512; 8,809 tokens of four sequences
up to 6,000 positions, block size 256): 24 ms per call; the selection bitwise the same for
random sub-batches, single tokens and three other block layouts, and equal to the CPU path's
and the fp64 oracle's on 2,509 checked rows (the fp32 scores themselves differ from the CPU
path's by up to 1.4e-6: tensor-core sums).
"""

from .dispatch import indexer_keys, indexer_scores, indexer_topk, select_entries
from .reference import indexer_scores_reference, indexer_topk_reference

__all__ = ["indexer_topk", "indexer_scores", "indexer_keys", "select_entries", "indexer_topk_reference",
           "indexer_scores_reference"]
