"""Shared fixtures: the tiny preset checkpoint, built once per session."""

from __future__ import annotations

import os

import torch

# The op tests run the Triton kernels through the interpreter on CPU. Triton
# reads TRITON_INTERPRET when a kernel is defined, so it must be set before any
# test module (including engine tests collected earlier) imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Pin the engine knobs every test relies on (the engine helpers set them too).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Directory of the built-in tiny Nemotron-H checkpoint (pattern ``*-*-*-``)."""
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint("nemotron_h_tiny", out_dir=tmp_path_factory.mktemp("ckpt") / "nemotron_h_tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """``(hf_config, spec, state_dict)`` of the tiny checkpoint."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    return spec_and_state_dict(tiny_checkpoint)


@pytest.fixture(scope="session")
def peaked_checkpoint(tmp_path_factory):
    """``name -> (directory, distribution stats)`` of a peaked test checkpoint
    (``tests/peaked_models.py``: ``"attention"`` ``*-*-`` or ``"hybrid"`` ``M*-E``,
    vocabulary 1024, written by transformers' ``NemotronHForCausalLM``), each built
    once per session; building asserts the next-token distribution is peaked."""
    from peaked_models import build_peaked_checkpoint

    root, built = tmp_path_factory.mktemp("peaked"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_peaked_checkpoint(name, root / name)
        return built[name]

    return get
