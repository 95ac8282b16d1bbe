"""Megatron-core backend: the spec as a ``MegatronModule`` running the shared forward.

Only this package imports Megatron (checkpoint I/O through Megatron lives in
:mod:`.dist_ckpt` and :mod:`.checkpoint`; ``converters/`` keeps the engine-free
layout). Version differences between megatron-core
0.16 (CPU) and 0.19 (GPU) live in :mod:`.compat`.
"""

from .module import UnifiedMegatronModel, transformer_config_from_spec
from .parallel import (
    check_parallel_sizes,
    destroy_parallel_state,
    ensure_process_group,
    init_parallel_state,
)

__all__ = [
    "UnifiedMegatronModel", "transformer_config_from_spec", "init_parallel_state",
    "destroy_parallel_state", "ensure_process_group", "check_parallel_sizes",
]
