"""Helpers shared by the Triton kernels (``_common.py``).

Each op family's kernel is ``ops/<family>/triton.py`` (its ``*_triton`` entry
points). They run natively on CUDA and through the Triton interpreter on CPU
(``TRITON_INTERPRET=1`` must be set before Triton is imported). Tile sizes are
fixed per device kind (``_common.INTERPRET``) and never depend on the batch: no
autotuning, no split-K, no atomics, fixed ``num_warps``/``num_stages``.
"""
