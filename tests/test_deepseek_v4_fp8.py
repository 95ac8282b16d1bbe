"""Block-FP8 DeepSeek-V4 checkpoints (DeepSeek's published W8A8 linears) end to end on the CPU.

* the declaration reads DeepSeek's ``quantization_config`` into ``fp8_block`` weight formats for the
  published FP8 linears, minus a skip list, and refuses every other value naming the key;
* ``unified-models quantize`` writes the published checkpoint from a bf16 one: stored codes equal
  ``cast_e4m3(w / s)`` bit for bit with the stored ue8m0 ``s`` (checked by an independent formula);
* the published <-> transformers layouts and HF <-> Megatron dist checkpoints round-trip the codes,
  the scales and the MTP blocks' FP8 inert tensors bit for bit;
* ``check`` on the quantized tiny preset: diff = 0 on every field, peer on the dequantized weights;
* the trainer's masters (``master_spec``) re-quantize to the stored codes exactly.
"""

from __future__ import annotations

import json
import math
import pytest
import torch

from unified_models.converters import deepseek_v4_layout as layout
from unified_models.converters.hf_safetensors import load_hf_config, read_tensors, spec_and_state_dict
from unified_models.dsl import SpecError
from unified_models.models import spec_from_hf_config

PRESET = "deepseek_v4_tiny_fp8"
PUBLISHED_QC = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                "activation_scheme": "dynamic"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The preset built once (bf16 base + its hf-layout block-FP8 export) in a private cache."""
    import os
    from unittest import mock

    from unified_models.presets import build_preset_checkpoint

    root = tmp_path_factory.mktemp("um_cache")
    with mock.patch.dict(os.environ, UNIFIED_MODELS_CACHE=str(root)):  # the bf16 base is built there too
        quantized = build_preset_checkpoint(PRESET)
    (base,) = [p for p in root.iterdir() if p.name.startswith(f"{PRESET}-bf16-")]
    return root, base, quantized


@pytest.fixture(scope="module")
def official(cache, tmp_path_factory):
    """``unified-models quantize BASE OUT`` (the CLI, default: DeepSeek's published layout)."""
    from unified_models.cli import main

    _, base, _ = cache
    out = tmp_path_factory.mktemp("official") / "ckpt"
    assert main(["quantize", str(base), str(out)]) == 0
    return out


def _independent_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 by the published formula, written here without ops.fp8_block: per 128x128 block
    ``s = 2^ceil(log2(max(amax, 1e-4) / 448))`` (the fp32 quotient; math.frexp gives the exact
    exponent), codes ``e4m3_rne(clamp(w / s, -448, 448))``; a ragged last block along N or K is
    its own block (DeepSeek's ``Linear``: ``ceil`` scale shapes)."""
    n, k = w.shape
    w32 = w.float()
    s = torch.empty(-(-n // 128), -(-k // 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = max(float(w32[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()), 1e-4)
            q = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0))
            m, e = math.frexp(q)  # q = m * 2^e, m in [0.5, 1)
            s[i, j] = 2.0 ** (e - 1 if m == 0.5 else e)
    s_full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w32 / s_full).clamp(-448, 448).to(torch.float8_e4m3fn), s


# ----------------------------------------------------------------------------- declaration

def _config(**qc_over):
    """The preset's config with a published ``quantization_config`` (``None`` drops a key)."""
    from transformers import AutoConfig

    from unified_models.presets import load_preset

    hf = dict(load_preset(PRESET)["hf_config"])
    qc = {**PUBLISHED_QC, **qc_over}
    qc = {k: v for k, v in qc.items() if v is not None}
    return AutoConfig.for_model("deepseek_v4", **hf, quantization_config=qc, expert_dtype="fp8")


def test_declaration_reads_the_published_fp8_linears_and_refuses_what_it_cannot_run():
    # the published set includes wo_a (K = H*E/g = 80 here: not a multiple of the 128 block) and the
    # experts (no block-FP8 grouped kernel): refused by name
    with pytest.raises(SpecError, match=r"model\.layers\.0\.attn\.wo_a.*modules_to_not_convert"):
        spec_from_hf_config(_config())
    skip = [f"layers.{i}.attn.wo_a" for i in range(4)] + [f"model.layers.{i}.ffn.experts" for i in range(4)] + \
        ["*.shared_experts"]
    spec = spec_from_hf_config(_config(modules_to_not_convert=skip))
    fmts = dict(spec.weight_formats)
    want = {f"model.layers.{i}.attn.{n}" for i in range(4) for n in ("wq_a", "wq_b", "wkv", "wo_b")}
    want |= {f"model.layers.{i}.attn.indexer.wq_b" for i in (1, 3)}  # the CSA layers
    assert set(fmts) == want and all(f.format == "fp8_block" and f.stored for f in fmts.values())
    shapes, dtypes = spec.parameter_shapes(), spec.parameter_dtypes()
    assert dtypes["model.layers.1.attn.wq_b.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.1.attn.wq_b.weight_scale_inv"] == torch.float8_e8m0fnu
    assert shapes["model.layers.1.attn.wq_b.weight_scale_inv"] == (-(-2 * 80 // 128), 1)
    for stays in ("model.layers.1.attn.wo_a.weight", "model.layers.1.ffn.gate.weight", "head.weight",
                  "model.layers.1.attn.compressor.wkv.weight", "model.layers.1.attn.indexer.weights_proj.weight",
                  "model.layers.1.ffn.shared_experts.w1.weight", "model.layers.1.ffn.experts.0.w2.weight"):
        assert dtypes[stays] == torch.bfloat16, stays
    assert not any(n.endswith("wo_a.weight_scale_inv") for n in shapes)
    # the published recipe's FP8 KV rule on every attention layer (a bf16 config keeps bf16 vectors)
    attn = [s.mixer for s in spec.sublayers if hasattr(s.mixer, "kv_cache_dtype")]
    assert len(attn) == 4 and {a.kv_cache_dtype for a in attn} == {"fp8_ds_mla"}
    # without skipping them, the shared and (expert_dtype fp8) routed experts are block FP8 (W8A8)
    spec = spec_from_hf_config(_config(modules_to_not_convert=[f"layers.{i}.attn.wo_a" for i in range(4)]))
    fmts = dict(spec.weight_formats)
    experts = {f"model.layers.{i}.ffn.{n}" for i in range(4)
               for n in [f"experts.{e}.{j}" for e in range(4) for j in ("w1", "w2", "w3")]
               + [f"shared_experts.{j}" for j in ("w1", "w2", "w3")]}
    assert set(fmts) == want | experts and {f.format for f in fmts.values()} == {"fp8_block"}


@pytest.mark.parametrize("key,value", [
    ("quant_method", "fbgemm_fp8"), ("fmt", "e5m2"), ("scale_fmt", "float"), ("weight_block_size", [128, 64]),
    ("activation_scheme", "static"), ("dequantize", True), ("moe_quant_algo", "NVFP4"), ("group_size", 32),
    ("modules_to_not_convert", "layers.0.attn.wo_a"),
])
def test_quantization_config_refusals_name_the_key(key, value):
    with pytest.raises(SpecError, match=key):
        spec_from_hf_config(_config(**{key: value}))


def test_a_missing_key_and_expert_dtype_are_refused_by_name_fp4_experts_are_mxfp4():
    with pytest.raises(SpecError, match="scale_fmt"):
        spec_from_hf_config(_config(scale_fmt=None))
    cfg = _config(modules_to_not_convert=[f"layers.{i}.attn.wo_a" for i in range(4)])
    cfg.expert_dtype = "fp4"
    fmts = dict(spec_from_hf_config(cfg).weight_formats)
    assert fmts["model.layers.2.ffn.experts.3.w2"].format == "mxfp4"
    assert fmts["model.layers.2.ffn.shared_experts.w2"].format == "fp8_block"
    assert fmts["model.layers.2.attn.wq_b"].format == "fp8_block"
    for bad in (None, "int4"):
        cfg.expert_dtype = bad
        with pytest.raises(SpecError, match=f"expert_dtype={bad!r}"):
            spec_from_hf_config(cfg)


# ----------------------------------------------------------------------------- quantize

def test_stored_codes_are_the_cast_of_the_weight_over_the_stored_scale(cache, official):
    _, base, quantized = cache
    masters = read_tensors(base)
    cfg = json.loads((official / "config.json").read_text())
    assert {k: cfg["quantization_config"][k] for k in PUBLISHED_QC} == PUBLISHED_QC
    assert cfg["expert_dtype"] == "fp8" and "compress_ratios" in cfg
    assert "layers.0.attn.wo_a" in cfg["quantization_config"]["modules_to_not_convert"]  # published names
    off = read_tensors(official)
    hf = read_tensors(quantized)
    n_checked = 0
    for name, t in off.items():
        if not name.endswith(".scale"):
            continue
        lin = name[: -len(".scale")]
        canon = layout._canonical_name(lin + ".weight")
        w = masters[canon]
        codes, s = _independent_codes(w)
        assert t.dtype == torch.float32 and torch.equal(t, s), name  # float32 power-of-two container
        assert off[lin + ".weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(_bits(off[lin + ".weight"]), _bits(codes)), name  # bitwise
        # and the transformers layout holds the same bits, the scale as e8m0
        h = canon[: -len(".weight")]
        assert torch.equal(_bits(hf[canon]), _bits(codes)) and hf[h + ".weight_scale_inv"].dtype == torch.float8_e8m0fnu
        assert torch.equal(hf[h + ".weight_scale_inv"].float(), s)
        n_checked += 1
    # wq_a, wq_b, wkv, wo_b per layer + the two CSA indexers' wq_b + per layer 4 routed experts' and the
    # shared expert's w1, w2, w3 (expert_dtype fp8, as DeepSeek-V4-Flash-Base)
    assert n_checked == 4 * 4 + 2 + 4 * (4 + 1) * 3
    # every other tensor is the bf16 source's, bit for bit (in its declared stored dtype: the loader
    # widens the mHC / sink / bias tensors transformers saved in bf16 to fp32, exactly)
    q = {layout._canonical_name(n) for n in off if n.endswith(".weight") and n[:-7] + ".scale" in off}
    for name, t in hf.items():
        if name not in q and not name.endswith(".weight_scale_inv"):
            assert torch.equal(_bits(t), _bits(masters[name].to(t.dtype))), name
            assert torch.equal(masters[name].to(t.dtype).to(masters[name].dtype), masters[name]), name


def test_published_and_transformers_layouts_round_trip_bit_for_bit(cache, official, tmp_path):
    _, _, quantized = cache
    back, again = tmp_path / "hf", tmp_path / "official"
    layout.convert_checkpoint(official, back, to="hf")
    layout.convert_checkpoint(back, again, to="official")
    assert _same(read_tensors(official), read_tensors(again))
    assert json.loads((again / "config.json").read_text()) == json.loads((official / "config.json").read_text())
    assert _same(read_tensors(back), read_tensors(quantized))  # == the preset (the hf-layout export)
    _, spec_off, sd_off = spec_and_state_dict(official)
    _, spec_hf, sd_hf = spec_and_state_dict(quantized)
    assert spec_off == spec_hf and spec_off.stores_quantized_weights and _same(sd_off, sd_hf)


def test_a_scale_that_is_not_a_power_of_two_is_refused(official, tmp_path):
    from safetensors.torch import save_file

    from unified_models.dsl import CheckpointError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((official / "config.json").read_text())
    t = read_tensors(official)
    t["layers.2.attn.wkv.scale"] = t["layers.2.attn.wkv.scale"] * 1.5
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wkv\.scale.*power of two"):
        spec_and_state_dict(bad)


def test_masters_requantize_to_the_stored_codes(cache):
    from unified_models.converters.modelopt import dequantize_state_dict, master_spec, quantize_state_dict

    _, _, quantized = cache
    _, spec, stored = spec_and_state_dict(quantized)
    masters = dequantize_state_dict(stored, spec)
    mspec = master_spec(spec)
    assert all(not f.stored and f.format == "fp8_block" for _, f in mspec.weight_formats)
    assert set(masters) == set(mspec.parameter_shapes())
    assert _same(quantize_state_dict(masters, spec), stored)  # the trainer's rule gives the engine's codes back


def test_mtp_fp8_tensors_round_trip_through_megatron_and_both_layouts(official, tmp_path):
    from safetensors.torch import save_file

    from unified_models.backends.megatron.dist_ckpt import hf_to_megatron, megatron_to_hf

    off = tmp_path / "mtp_official"
    off.mkdir()
    cfg = json.loads((official / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, compress_ratios=cfg["compress_ratios"] + [0])
    (off / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(load_hf_config(off))
    inert = {n: (s, d) for n, s, d in spec.inert_parameters}
    assert inert["mtp.0.e_proj.weight"][1] == torch.float8_e4m3fn
    assert inert["mtp.0.attn.wo_b.weight_scale_inv"] == ((1, 1), torch.float8_e8m0fnu)
    # inert, so stored as published whatever the families run: wo_a (K = 80: one ragged block) and
    # the experts in FP8 too (the skip list names the decoder layers only); the router stays bf16
    assert inert["mtp.0.attn.wo_a.weight_scale_inv"] == ((1, 1), torch.float8_e8m0fnu)
    assert inert["mtp.0.ffn.experts.3.w2.weight"][1] == torch.float8_e4m3fn
    assert inert["mtp.0.ffn.gate.weight"][1] == torch.bfloat16
    g = torch.Generator().manual_seed(3)
    t = read_tensors(official)
    canon: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in inert.items():
        if dtype == torch.float8_e4m3fn:
            q, sc = _independent_codes((torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16))
            canon[name], canon[name[:-7] + ".weight_scale_inv"] = q, sc.to(torch.float8_e8m0fnu)
        elif not name.endswith(".weight_scale_inv"):
            canon[name] = torch.randn(shape, generator=g).to(dtype)
    t.update(layout.canonical_to_official(canon))
    assert t["mtp.0.e_proj.scale"].dtype == torch.float32
    save_file(t, str(off / "model.safetensors"))
    _, spec2, sd = spec_and_state_dict(off)
    assert spec2 == spec and all(_same({n: sd[n]}, {n: canon[n]}) for n in canon)
    hf, meg, hf2, off2 = tmp_path / "hf", tmp_path / "meg", tmp_path / "hf2", tmp_path / "off2"
    layout.convert_checkpoint(off, hf, to="hf")
    hf_to_megatron(hf, meg)
    megatron_to_hf(meg, hf2)
    assert _same(read_tensors(hf), read_tensors(hf2))
    layout.convert_checkpoint(hf2, off2, to="official")
    assert _same(read_tensors(off), read_tensors(off2))


# ----------------------------------------------------------------------------- check

def test_check_on_the_quantized_tiny_preset_is_diff_zero(cache, tmp_path, monkeypatch):
    """The issue's CPU gate: every attention layer type, hash and regular MoE, mHC, block-FP8 linears and
    the FP8 KV rule; 32 prompts x 64 tokens = 2048 tokens compared (about 90 s on two cores), every diff
    field 0 over all of them and their full-vocabulary rows, peer within tolerance."""
    from unified_models.check import CheckOptions, run_check

    root, _, quantized = cache
    monkeypatch.setenv("UNIFIED_MODELS_CACHE", str(root))
    _, spec, _ = spec_and_state_dict(quantized)
    assert spec.stores_quantized_weights and len(spec.weight_formats) == 18 + 4 * (4 + 1) * 3  # + the experts
    assert spec.extra["pattern"] == "S#CHC"
    assert {s.mixer.kv_cache_dtype for s in spec.sublayers if hasattr(s.mixer, "kv_cache_dtype")} == {"fp8_ds_mla"}
    out = tmp_path / "report.json"
    rc = run_check(CheckOptions(preset=PRESET, num_prompts=32, max_new_tokens=64, device="cpu", json_out=str(out)))
    report = json.loads(out.read_text())
    assert report["tokens_compared"] >= 2000
    diff = {k: report[k] for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched")}
    assert all(v == 0 for v in diff.values()), diff
    assert report["full_vocab_rows"] > 0 and report["full_vocab_max_abs_diff"] == 0.0
    assert "dequantized" in report["peer"]["against"]
    assert report["peer"]["within_tolerance"] and report["peer"]["max_rel_logit_diff"] < 1e-5, report["peer"]
    assert rc == 0 and report["passed"]


def test_quantize_cli_refuses_nemotron_options_on_a_deepseek_source(cache, tmp_path, capsys):
    from unified_models.cli import main

    _, base, _ = cache
    assert main(["quantize", str(base), str(tmp_path / "o"), "--experts", "nvfp4"]) == 2
    assert "--experts apply to Nemotron-H" in capsys.readouterr().err and not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # argparse: --layout is official or hf
        main(["quantize", str(base), str(tmp_path / "o"), "--layout", "fortran"])


@pytest.mark.parametrize("bad", ["nan_scale", "bf16_codes"])
def test_convert_to_megatron_refuses_what_check_refuses(tmp_path, bad):
    """`convert --from hf --to megatron` checks the quantized tensors as every load does: a NaN
    block scale or bf16 values where e4m3 codes belong are refused naming the tensor, not written
    into a Megatron checkpoint that no engine can load."""
    import shutil

    from safetensors.torch import load_file, save_file

    from unified_models.cli import main
    from unified_models.presets import build_preset_checkpoint

    d = tmp_path / "fp8"
    shutil.copytree(build_preset_checkpoint(PRESET), d)
    sd = load_file(str(d / "model.safetensors"))
    lin = "model.layers.0.attn.wkv"
    if bad == "nan_scale":
        sd[f"{lin}.weight_scale_inv"] = torch.full_like(sd[f"{lin}.weight_scale_inv"].float(), math.nan).to(
            torch.float8_e8m0fnu)
        want = f"{lin}: weight_scale_inv has 1 NaN scale"
    else:
        sd[f"{lin}.weight"] = sd[f"{lin}.weight"].to(torch.bfloat16)
        want = f"{lin}.weight: stored torch.bfloat16, expected torch.float8_e4m3fn"
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(Exception, match=want.replace(".", "[.]")):
        spec_and_state_dict(d)  # what check refuses
    assert main(["convert", "--from", "hf", "--to", "megatron", str(d), str(tmp_path / "mg")]) == 2
    assert not (tmp_path / "mg").exists() or not any((tmp_path / "mg").iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_that_is_not_a_power_of_two_is_refused_in_transformers_layout_too(tmp_path, dtype):
    """The published layout refuses a float32 `.scale` that is not a power of two; a transformers-layout
    `weight_scale_inv` stored in a wider float dtype must not be rounded to one silently either (the
    loaded weights would not be the checkpoint's: 0.000366 became 0.000488)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from unified_models.dsl import CheckpointError
    from unified_models.presets import build_preset_checkpoint

    d = tmp_path / "fp8"
    shutil.copytree(build_preset_checkpoint(PRESET), d)
    sd = load_file(str(d / "model.safetensors"))
    k = "model.layers.0.attn.wkv.weight_scale_inv"
    exact = sd[k].float().to(dtype)
    sd[k] = exact
    save_file(sd, str(d / "model.safetensors"))
    assert spec_and_state_dict(d)[2][k].dtype == torch.float8_e8m0fnu  # a power of two: cast exactly
    sd[k] = (exact.float() * 1.5).to(dtype)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{k.replace('.', '[.]')}: stored {dtype}.*not a power of two"):
        spec_and_state_dict(d)
