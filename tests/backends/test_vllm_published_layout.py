"""DeepSeek-V4 checkpoints in DeepSeek's published layout through our vLLM backend, on the CPU.

* with our plugin registered (it runs in every vLLM process, a user's native run too), vLLM's config
  path (``vllm.transformers_utils.config.get_config``, what its engine calls) parses a published
  ``config.json`` with vLLM's own pass-through ``DeepseekV4Config``, exactly as without the plugin
  (``compress_ratios``, ``num_hash_layers``, ... kept: vLLM's native model reads them), and a
  transformers-written one with transformers' class; our model class builds one spec from either
  (tiny bf16, block-FP8 with a published skip list, MXFP4 experts), and ``make_llm`` on the
  published copy samples the same tokens and logprobs as on the transformers-layout original;
* ``engine.validate_checkpoint`` (the pre-flight of ``make_llm``, safetensors headers only) checks a
  published checkpoint under the canonical names its tensors load as (the tiny bf16, block-FP8 and
  MXFP4-expert presets), lists a corrupted one's missing / unexpected / mis-shaped tensors by
  canonical name, and refuses a config and tensor names in different layouts.
"""

from __future__ import annotations

import json
import os
from unittest import mock
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unified_models.converters import deepseek_v4_layout as layout
from unified_models.dsl import CheckpointError

PRESETS = ("deepseek_v4_tiny", "deepseek_v4_tiny_fp8", "deepseek_v4_tiny_fp4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``preset -> (transformers-layout dir, published-layout dir)``, built on first use in a private cache."""
    from unified_models.presets import build_preset_checkpoint

    root = tmp_path_factory.mktemp("um_cache")
    built: dict[str, tuple] = {}

    def get(preset: str):
        if preset not in built:
            with mock.patch.dict(os.environ, UNIFIED_MODELS_CACHE=str(root)):  # quantized presets' bases too
                hf = build_preset_checkpoint(preset)
            built[preset] = hf, layout.convert_checkpoint(hf, root / f"{preset}-published", to="official")
        return built[preset]

    return get


def _names(d) -> list[str]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        return list(h.keys())


def test_official_name_to_canonical():
    f = layout.official_name_to_canonical
    assert f("embed.weight") == "model.embed_tokens.weight" and f("model.norm.weight") == "model.norm.weight"
    assert f("layers.3.attn.kv_norm.weight") == "model.layers.3.attn.norm.weight"
    assert f("hc_head_fn") == "model.hc_head.hc_fn" and f("head.weight") == "head.weight"
    assert f("layers.1.attn.wq_a.scale") == "model.layers.1.attn.wq_a.weight_scale_inv"
    assert f("layers.2.ffn.experts.5.w2.scale") == "model.layers.2.ffn.experts.5.w2.weight_scale_inv"
    assert f("layers.2.ffn.experts.5.w2.scale", mxfp4_expert=True) == "model.layers.2.ffn.experts.5.w2.weight_scale"
    assert f("mtp.0.attn.kv_norm.weight") == "mtp.0.attn.kv_norm.weight"
    assert f("model.layers.0.ffn.gate.tid2eid") == "model.layers.0.ffn.gate.tid2eid"  # canonical: unchanged
    assert layout.routed_expert_of_scale("layers.2.ffn.experts.5.w2.scale") == "model.layers.2.ffn.experts.5.w2"
    assert layout.routed_expert_of_scale("layers.2.ffn.shared_experts.w2.scale") is None
    # the tensor-level conversion names tensors the same way
    assert layout.official_tensor_to_canonical("layers.0.ffn.gate.tid2eid", torch.zeros(2, 2, dtype=torch.int32))[0] \
        == "model.layers.0.ffn.gate.tid2eid"
    with pytest.raises(CheckpointError, match="embed.weight and model.embed_tokens.weight both map to "
                                              "model.embed_tokens.weight"):
        layout.official_names_to_canonical(["embed.weight", "model.embed_tokens.weight"], lambda lin: False)


@pytest.mark.parametrize("preset", PRESETS)
def test_validate_checkpoint_passes_on_a_published_checkpoint(checkpoints, preset):
    from unified_models.backends.vllm.engine import _spec, validate_checkpoint

    hf, pub = checkpoints(preset)
    names = _names(pub)
    assert "embed.weight" in names and "layers.0.attn.kv_norm.weight" in names
    assert not any(n.startswith("model.") for n in names)
    spec = _spec(pub)
    assert spec == _spec(hf)
    validate_checkpoint(pub)
    validate_checkpoint(pub, spec)
    validate_checkpoint(hf)
    # the names validate_checkpoint checks are the spec's, bit for bit the loader's (official_to_canonical)
    expected = spec.parameter_shapes()
    mapped = layout.official_names_to_canonical(names, lambda lin: f"{lin}{layout.MXFP4_SCALE}" in expected)
    assert sorted(mapped.values()) == sorted(layout.official_to_canonical(load_file(str(pub / "model.safetensors"))))
    assert set(mapped.values()) == set(expected)
    scales = {n: mapped[n] for n in names if n.endswith(".experts.0.w1.scale")}
    if preset == "deepseek_v4_tiny":
        assert not scales
    else:  # fp8 experts: block-FP8 scales; fp4 (MXFP4) experts: weight_scale
        want = ".weight_scale" if preset.endswith("fp4") else ".weight_scale_inv"
        assert scales and all(v.endswith(want) for v in scales.values()), scales


def test_validate_checkpoint_lists_the_bad_tensors_of_a_published_checkpoint(checkpoints, tmp_path):
    from unified_models.backends.vllm.engine import validate_checkpoint

    _, pub = checkpoints("deepseek_v4_tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((pub / "config.json").read_text())
    t = load_file(str(pub / "model.safetensors"))
    del t["layers.1.attn.kv_norm.weight"], t["embed.weight"]
    t["layers.1.attn.bogus.weight"] = torch.zeros(3)
    t["norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(bad)
    msg = str(e.value)
    assert f"checkpoint {bad} does not match the deepseek_v4 spec" in msg
    assert "missing tensors: ['model.embed_tokens.weight', 'model.layers.1.attn.norm.weight']" in msg
    assert "unexpected tensors: ['model.layers.1.attn.bogus.weight']" in msg
    assert "mis-shaped tensors: ['model.norm.weight: expected (64,), got (7,)']" in msg


def test_validate_checkpoint_refuses_a_config_and_tensors_in_different_layouts(checkpoints, tmp_path):
    from unified_models.backends.vllm.engine import validate_checkpoint

    hf, pub = checkpoints("deepseek_v4_tiny")
    for config_from, tensors_from, said in ((pub, hf, "DeepSeek's published layout but the tensor names are in "
                                                      "the transformers layout"),
                                            (hf, pub, "the transformers layout but the tensor names are in "
                                                      "DeepSeek's published layout")):
        d = tmp_path / f"mixed_{config_from.name}"
        d.mkdir()
        (d / "config.json").write_text((config_from / "config.json").read_text())
        (d / "model.safetensors").symlink_to(tensors_from / "model.safetensors")
        assert json.loads((d / "config.json").read_text())["model_type"] == "deepseek_v4"
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {d}: config.json is in {said}; convert one")):
            validate_checkpoint(d)


# ----------------------------------------------------------------------------- config parsing (plugin)

@pytest.fixture
def vllm_config():
    """vLLM's config module with our plugin's config classes registered (as ``plugin.register`` does)."""
    from vllm.transformers_utils import config as vc

    from unified_models.backends.vllm import plugin

    plugin.use_transformers_configs()
    return vc


def test_plugin_leaves_a_published_config_to_vllms_own_class(checkpoints, vllm_config):
    from transformers import AutoConfig, DeepseekV4Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from unified_models.backends.vllm import plugin
    from unified_models.backends.vllm.config_classes import DeepseekV4ConfigByLayout

    vc = vllm_config
    hf, pub = checkpoints("deepseek_v4_tiny")
    entry = vc._CONFIG_REGISTRY["deepseek_v4"]
    native = entry.published_class
    assert entry is DeepseekV4ConfigByLayout and CONFIG_MAPPING["deepseek_v4"] is entry
    assert (native.__module__, native.__name__) == ("vllm.transformers_utils.configs.deepseek_v4", "DeepseekV4Config")
    plugin.use_transformers_configs()  # idempotent: still ours, still wrapping vLLM's class
    assert vc._CONFIG_REGISTRY["deepseek_v4"] is entry and entry.published_class is native

    raw = json.loads((pub / "config.json").read_text())
    c = vc.get_config(str(pub), trust_remote_code=False)
    assert type(c) is native
    assert c.compress_ratios == raw["compress_ratios"] == [0, 4, 16, 4] and c.num_hash_layers == 1
    assert c.compress_rope_theta == 160000.0 and c.rope_theta == 10000.0 and c.qk_rope_head_dim == 8
    assert c.rope_scaling["factor"] == 4.0 and c.topk_method == "noaux_tc"
    assert getattr(c, "layer_types", None) is None and getattr(c, "compress_rates", None) is None
    # exactly what vLLM parses without our plugin
    try:
        vc._CONFIG_REGISTRY["deepseek_v4"] = native
        bare = vc.get_config(str(pub), trust_remote_code=False)
    finally:
        plugin.use_transformers_configs()
    assert type(bare) is native and bare.to_dict() == c.to_dict()
    assert vc._CONFIG_REGISTRY["deepseek_v4"] is entry and entry.published_class is native
    assert CONFIG_MAPPING["deepseek_v4"] is entry  # get_config registered vLLM's class: ours again

    t = vc.get_config(str(hf), trust_remote_code=False)
    assert type(t) is DeepseekV4Config
    assert t.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention"]
    assert t.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"] and t.compress_rates == {
        "compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    assert getattr(t, "compress_ratios", None) is None
    # AutoConfig's other ways in pick the class by layout too
    assert type(AutoConfig.from_pretrained(str(pub))) is native
    assert type(AutoConfig.from_pretrained(str(hf))) is DeepseekV4Config
    fields = {k: v for k, v in json.loads((hf / "config.json").read_text()).items() if k != "model_type"}
    assert type(AutoConfig.for_model("deepseek_v4", **fields)) is DeepseekV4Config
    made = AutoConfig.for_model("deepseek_v4", **{k: v for k, v in raw.items() if k != "model_type"})
    assert type(made) is native and made.compress_ratios == [0, 4, 16, 4]


@pytest.mark.parametrize("preset", PRESETS)
def test_our_spec_from_vllms_config_is_the_same_for_both_layouts(checkpoints, vllm_config, preset):
    """The config vLLM hands our model class (with make_llm's hf_overrides: quantization_config moved
    aside) gives the spec ``spec_and_state_dict`` builds from the transformers-layout original."""
    from unified_models.backends.vllm import plugin
    from unified_models.backends.vllm.engine import quantization_overrides
    from unified_models.backends.vllm.model import spec_of_config
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config

    hf, pub = checkpoints(preset)
    want = spec_from_hf_config(load_hf_config(hf))
    assert want == spec_from_hf_config(load_hf_config(pub))
    raw = json.loads((pub / "config.json").read_text())
    if preset == "deepseek_v4_tiny_fp8":  # a skip list in published module names: renamed for the spec too
        assert raw["quantization_config"]["modules_to_not_convert"][0] == "layers.0.attn.wo_a"
    for d in (hf, pub):
        overrides = {"architectures": [want.architecture], **quantization_overrides(d)}
        c = vllm_config.get_config(str(d), trust_remote_code=False, hf_overrides_kw=overrides)
        assert (getattr(c, "compress_ratios", None) is not None) == (d == pub)
        spec = spec_of_config(c, None)
        assert spec == want and spec.extra["pattern"] == "S#CHC"
        # vLLM's config as a native run builds it: our native override reads it too
        native = vllm_config.get_config(str(d), trust_remote_code=False)
        assert plugin.native_hf_overrides(native).architectures == [plugin.model_architecture(want)]
    assert bool(want.weight_formats) == (preset != "deepseek_v4_tiny")


def test_a_vision_tower_in_vllms_config_is_refused(checkpoints, vllm_config):
    from unified_models.backends.vllm.config_classes import transformers_config
    from unified_models.dsl import SpecError

    _, pub = checkpoints("deepseek_v4_tiny")
    c = vllm_config.get_config(str(pub), trust_remote_code=False)
    c.vision_n_layers = 2
    with pytest.raises(SpecError, match="vision_n_layers=2; the vision tower is not declared"):
        transformers_config(c)


def test_make_llm_on_the_published_copy_samples_what_the_original_does(checkpoints):
    """End to end: the published copy loads through make_llm's overrides (transformers' form of its
    config), our model class, the pre-flight and the loader's name mapping, gets the original's engine
    settings, and samples the original's tokens and logprobs bitwise."""
    from vllm import SamplingParams

    from unified_models.backends.vllm import engine

    hf, pub = checkpoints("deepseek_v4_tiny")
    prompt = {"prompt_token_ids": [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889, 3750, 338,
                                   278, 29871, 29896, 29945, 29900]}
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=0, detokenize=False)
    runs, settings = {}, {}
    for d in (pub, hf):
        llm = engine.make_llm(d, max_model_len=128, max_num_seqs=2, skip_tokenizer_init=True, max_logprobs=1)
        try:
            # vLLM sees transformers' config of either layout (engine_hf_overrides), so it derives the
            # same settings: from its pass-through class it would take the model for MLA and turn
            # prefix caching and chunked prefill off on the CPU
            cfg = llm.llm_engine.model_config.hf_config
            assert type(cfg).__name__ == "DeepseekV4Config" and list(cfg.layer_types) and not hasattr(
                cfg, "compress_ratios"), type(cfg)
            vc = llm.llm_engine.vllm_config
            settings[d] = (vc.cache_config.enable_prefix_caching, vc.scheduler_config.max_num_batched_tokens,
                           vc.scheduler_config.enable_chunked_prefill, llm.llm_engine.model_config.use_mla)
            out = llm.generate([prompt], params)[0].outputs[0]
        finally:
            engine.shutdown_llm(llm)
        runs[d] = list(out.token_ids), [next(iter(lp.values())).logprob for lp in out.logprobs]
    assert len(runs[pub][0]) == 4 and runs[pub] == runs[hf]
    assert settings[pub] == settings[hf] and settings[hf][0] is True and settings[hf][3] is False, settings


def test_vllm_weight_loading_reads_a_power_of_two_scale_in_another_float_dtype_exactly(tmp_path):
    """vLLM's weight loading takes a ue8m0 scale stored as float32 / bf16 as every other load does
    (``cast_to_stored_dtypes``: cast exactly when a power of two, refused by name otherwise): `serve`
    and `check` accept and refuse the same checkpoints (a break test found `serve` refusing what
    `check` ran)."""
    from unified_models.backends.vllm.weight_loading import WeightLoading
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.dsl import CheckpointError
    from unified_models.models import spec_from_hf_config
    from unified_models.presets import build_preset_checkpoint

    spec = spec_from_hf_config(load_hf_config(build_preset_checkpoint("deepseek_v4_tiny_fp8")))
    dtypes = spec.parameter_dtypes()
    name = next(n for n, d in dtypes.items() if d == torch.float8_e8m0fnu)
    shape = spec.parameter_shapes()[name]

    class Loader(WeightLoading):
        def __init__(self):
            self.spec, self._source = spec, str(tmp_path)
            self._shapes, self._dtypes = {name: shape}, {name: dtypes[name]}
            self._params = {name: torch.nn.Parameter(torch.zeros(shape).to(torch.float8_e8m0fnu),
                                                     requires_grad=False)}

        def params(self):
            return self._params

        def invalidate_params(self):
            pass

        def _after_copy(self, loaded):
            pass

    scale = torch.tensor([2.0 ** -9, 2.0 ** 3, 1.0]).repeat(shape[0] * shape[1])[: shape[0] * shape[1]].view(shape)
    for dtype in (torch.float32, torch.bfloat16):
        m = Loader()
        assert m.load_weights([(name, scale.to(dtype))]) == {name}
        assert torch.equal(m.params()[name].float(), scale)  # the same values, held as e8m0
        with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: stored {dtype} holding .*not a power of two"):
            Loader().load_weights([(name, (scale * 1.5).to(dtype))])
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} has dtype torch.uint8"):  # codes are not scales
        Loader().load_weights([(name, torch.zeros(shape, dtype=torch.uint8))])
