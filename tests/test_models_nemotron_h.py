import pytest
import torch
from transformers import NemotronHConfig

from unified_models.dsl import SpecError, UnsupportedLayerError
from unified_models.models import spec_from_hf_config
from unified_models.models.nemotron_h import ARCHITECTURE


def _cfg(pattern="*-*-", **kw):
    base = dict(hybrid_override_pattern=pattern, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, vocab_size=100)
    base.update(kw)
    return NemotronHConfig(**base)


def test_spec_names_match_checkpoints_written_by_transformers(tmp_path):
    """Canonical names are the checkpoint (hub) names: transformers writes
    ``backbone.*`` and renames to ``model.*`` only in memory."""
    from safetensors import safe_open
    from transformers import NemotronHForCausalLM

    cfg = _cfg("*--*")
    spec = spec_from_hf_config(cfg)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        theirs = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert spec.parameter_shapes() == theirs
    assert spec.architecture == ARCHITECTURE
    assert spec.extra["pattern"] == "*--*"


@pytest.mark.parametrize("pattern,index", [("*M-", 1), ("E", 0), ("*-*-M", 4)])
def test_unknown_layer_type_names_type_and_index(pattern, index):
    """Every published layer type (M, *, -, E) is supported; any other type is
    refused with its name and index (transformers' own pattern parser refuses
    unknown characters, so the type is set on the config directly)."""
    cfg = _cfg(pattern)
    spec_from_hf_config(cfg)  # the real pattern builds
    types = list(cfg.layers_block_type)
    types[index] = "bogus_mixer"
    cfg.layers_block_type = types
    with pytest.raises(UnsupportedLayerError) as e:
        spec_from_hf_config(cfg)
    assert f"layer {index}" in str(e.value) and "'bogus_mixer'" in str(e.value)


def test_bad_configs_are_refused():
    with pytest.raises(SpecError, match="num_kv_heads"):
        spec_from_hf_config(_cfg(num_attention_heads=4, num_key_value_heads=3))
    with pytest.raises(SpecError, match="mlp_hidden_act"):
        spec_from_hf_config(_cfg(mlp_hidden_act="gelu"))
    from transformers import LlamaConfig

    with pytest.raises(SpecError, match="model_type"):
        spec_from_hf_config(LlamaConfig())


def test_spec_is_frozen_and_keyword_only():
    spec = spec_from_hf_config(_cfg())
    with pytest.raises(Exception):
        spec.blocks = ()
    from unified_models.dsl import RMSNormSpec

    with pytest.raises(TypeError):
        RMSNormSpec("x", 4, 1e-5)


@pytest.mark.parametrize("flag", [{"tie_word_embeddings": True}, {"attention_bias": True}])
def test_flags_transformers_ignores_are_ignored_too(flag, tmp_path):
    """transformers' NemotronH saves lm_head.weight even when tied and never
    builds attention biases; the spec follows what the checkpoint holds."""
    from safetensors import safe_open
    from transformers import NemotronHForCausalLM

    cfg = _cfg(**flag)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        theirs = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert spec_from_hf_config(cfg).parameter_shapes() == theirs


def test_dtype_from_config_or_argument():
    assert spec_from_hf_config(_cfg(), dtype=torch.float32).dtype == torch.float32
    assert spec_from_hf_config(_cfg()).dtype == torch.bfloat16
