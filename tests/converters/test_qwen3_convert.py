"""Qwen3 / Qwen3-MoE checkpoints through ``unified-models convert`` both ways (HF safetensors ->
Megatron torch_dist -> HF), bitwise, and ``unified-models inspect``; the Megatron checkpoint loads
into our Megatron module with the same logprobs as the HF checkpoint (tied embeddings included)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.cli import main
from unified_models.converters.hf_safetensors import spec_and_state_dict


@pytest.fixture(scope="module", params=["qwen3_tiny", "qwen3_moe_tiny"])
def preset_dir(request, tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint(request.param, out_dir=tmp_path_factory.mktemp("q3") / request.param)


def test_convert_round_trip_is_bitwise(preset_dir, tmp_path, capsys):
    mg, back = tmp_path / "mg", tmp_path / "hf"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(preset_dir), str(mg)]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(back)]) == 0
    a, b = load_file(str(preset_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert list(a) and set(a) == set(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert (back / "config.json").read_bytes() == (preset_dir / "config.json").read_bytes()
    cfg = json.loads((preset_dir / "config.json").read_text())
    if cfg["tie_word_embeddings"]:
        assert "lm_head.weight" not in a  # tied: transformers writes the table once
    else:
        assert any(".mlp.experts.7.down_proj.weight" in n for n in a)  # one tensor per expert, as transformers

    init_parallel_state()
    _, spec, _ = spec_and_state_dict(preset_dir)
    from_mg = UnifiedMegatronModel(spec, device="cpu")
    from_mg.load_dist_checkpoint(mg)
    direct = UnifiedMegatronModel.from_pretrained(preset_dir, device="cpu")
    ids, cu = torch.arange(3, 40), torch.tensor([0, 12, 37], dtype=torch.int32)
    with torch.no_grad():
        from_mg.requires_grad_(False)
        direct.requires_grad_(False)
        assert torch.equal(from_mg.token_logprobs(ids, cu), direct.token_logprobs(ids, cu))

    capsys.readouterr()
    assert main(["inspect", str(preset_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{cfg['model_type']} (Unified") and "self_attn.q_norm.weight" in out
