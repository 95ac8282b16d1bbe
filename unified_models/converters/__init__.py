"""Checkpoint converters: HF safetensors <-> canonical <-> Megatron dist-ckpt."""
