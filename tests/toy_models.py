"""Shared machinery of the toy-model tests (a family or residual policy defined in a test file and
run through both engines): write a toy checkpoint, make prompts, run the trainer's forward.

Used by ``tests/test_family_protocol.py``, ``test_mhc_residual.py``, ``test_cache_kinds_e2e.py``,
``test_deepseek_moe_family.py``, ``test_deepseek_attention_family.py`` and ``test_plugins.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from unified_models.converters.hf_safetensors import save_state_dict
from unified_models.forward import forward_hidden, logits_fp32
from unified_models.presets import tokenizer_dir
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch

BF16_ULP = 2.0 ** -8
"""Spacing of bf16 numbers in [1, 2) (8 significand bits): its relative rounding step."""


def write_toy_checkpoint(directory: Path, config, state_dict: dict[str, torch.Tensor]) -> Path:
    """``config.json`` (from the transformers config object), ``model.safetensors`` and the bundled
    tokenizer's files in ``directory``; returns it."""
    save_state_dict(state_dict, directory, config_json=config.to_dict())
    for f in os.listdir(tokenizer_dir()):
        shutil.copy(tokenizer_dir() / f, directory / f)
    return directory


def toy_prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    """``n`` random prompts of ``length``, ``length + 3``, ... tokens (ids 10..31999)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 32000, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def trainer_logits(spec, state_dict, ids_T: torch.Tensor) -> torch.Tensor:
    """fp64 ``[T, V]`` logits of one sequence through the engines' forward with the trainer's store."""
    batch = FlatBatch.from_cu_seqlens(ids_T, torch.tensor([0, ids_T.numel()]))
    store = PrivateStateStore(spec, [ids_T.numel()], block_size=16)
    store.bind(batch)
    return logits_fp32(spec, state_dict, forward_hidden(spec, state_dict, batch, store)).double()


def random_toy_weights(spec, *, gain: float = 1.0, seed: int = 0, special=None, dtype=torch.bfloat16,
                       embed_prefixes: tuple[str, ...] = ("model.embed", "lm_head")) -> dict[str, torch.Tensor]:
    """Random weights of a toy spec, drawn in ``parameter_shapes()`` order from one generator:
    norms ``1 + 0.1 N(0, 1)``; embedding and LM head ``N(0, 1)``; every other tensor
    ``N(0, (gain / sqrt(fan_in))^2)`` (``gain`` 2 keeps the logits far from uniform).

    Args:
        special: optional ``(name, shape, generator) -> tensor or None``, asked first for every
            tensor (hash tables, biases, mixing parameters); None falls back to the rules above.
        dtype: the stored dtype of every tensor, or None for ``spec.parameter_dtypes()``.
        embed_prefixes: names drawn with std 1.
    """
    g = torch.Generator().manual_seed(seed)
    dtypes = spec.parameter_dtypes()
    sd = {}
    for name, shape in spec.parameter_shapes().items():
        t = special(name, shape, g) if special is not None else None
        if t is None:
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                std = 1.0 if name.startswith(embed_prefixes) else gain / shape[-1] ** 0.5
                t = torch.randn(shape, generator=g) * std
        sd[name] = t if not t.is_floating_point() else t.to(dtype or dtypes[name])
    return sd
