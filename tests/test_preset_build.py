"""The preset builder (``presets.build_preset_checkpoint``) stores every tensor in its spec's stored
dtype, as the published checkpoints do (fp32 router correction bias; DeepSeek-V4's mHC weights,
attention sinks and compressor ``ape``), holding the values of the bf16 build: the engines compute the
same numbers as before the change (the `check` hashes in the README hold)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from unified_models.converters.hf_safetensors import canonical_tensors, load_hf_config
from unified_models.models import spec_from_hf_config
from unified_models.presets import build_preset_checkpoint


@pytest.mark.parametrize("preset,fp32_suffixes", [
    ("nemotron_h_hybrid_tiny", ("e_score_correction_bias",)),
    ("deepseek_v4_tiny", ("hc_fn", "hc_base", "hc_scale", "attn_sink", "compressor.ape", "gate.bias")),
])
def test_preset_tensors_are_in_the_specs_stored_dtype(preset, fp32_suffixes, tmp_path):
    d = build_preset_checkpoint(preset, out_dir=tmp_path / preset)
    written = load_file(str(d / "model.safetensors"))
    spec = spec_from_hf_config(load_hf_config(d))
    want = spec.parameter_dtypes()
    canonical = canonical_tensors(d, written)
    wrong = {n: (str(t.dtype), str(want[n])) for n, t in canonical.items() if t.dtype != want[n]}
    assert not wrong, wrong
    fp32 = [n for n, t in canonical.items() if t.dtype == torch.float32]
    for suffix in fp32_suffixes:  # the tensors transformers keeps in fp32 are written in fp32 ...
        assert any(n.endswith(suffix) for n in fp32), (suffix, fp32)
    for n in fp32:  # ... holding the values the bf16 build stored (so no engine's number moves)
        t = canonical[n]
        assert torch.equal(t.to(torch.bfloat16).float(), t), n
    assert all(t.dtype == torch.bfloat16 for n, t in canonical.items()
               if want[n] == spec.dtype), "model-dtype tensors stay bf16"
