"""Megatron parallel state survives an engine that tears the process group down
(vLLM's cleanup after a rollout in the same process): it is rebuilt, not reused."""

import torch.distributed as dist

from unified_models.backends.megatron import compat
from unified_models.backends.megatron.parallel import init_parallel_state


def test_stale_parallel_state_is_rebuilt():
    init_parallel_state(tp=1)
    dist.destroy_process_group()  # what vLLM's cleanup_dist_env_and_memory does
    assert compat.model_parallel_is_initialized() and not dist.is_initialized()
    init_parallel_state(tp=1)
    assert dist.is_initialized()
    assert compat.parallel_sizes() == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                       "context_parallel_size": 1, "expert_model_parallel_size": 1}
