"""Engine adapters. Only ``backends/vllm`` imports vLLM and only
``backends/megatron`` imports Megatron; ``backends/reference`` is plain torch."""
