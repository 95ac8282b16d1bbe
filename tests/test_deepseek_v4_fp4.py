"""DeepSeek-V4-Flash's own mix on the CPU: block-FP8 attention and shared-expert linears (W8A8),
MXFP4 routed experts (``expert_dtype: fp4``, W4A8), FP8 KV cache (preset ``deepseek_v4_tiny_fp4``).

* ``quantize`` writes the published layout: routed experts' ``.weight`` int8 packed e2m1 pairs and
  ``.scale`` float8_e8m0fnu ``[N, K/32]`` (the names vLLM's DeepSeek-V4 loader maps to
  ``weight_scale``), the other linears' block-FP8 ``.scale``; stored codes equal the MXFP4 rule of
  the bf16 master, checked with an independent formula;
* published <-> transformers layouts round-trip every byte; both read into the same spec;
* ``check`` on the preset: diff = 0 on every field, peer on the dequantized weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from unified_models.converters import deepseek_v4_layout as layout
from unified_models.converters.hf_safetensors import read_tensors, spec_and_state_dict

PRESET = "deepseek_v4_tiny_fp4"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 or t.is_floating_point() else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    import os
    from unittest import mock

    from unified_models.presets import build_preset_checkpoint

    root = tmp_path_factory.mktemp("um_cache_fp4")
    with mock.patch.dict(os.environ, UNIFIED_MODELS_CACHE=str(root)):  # the bf16 base is built there too
        quantized = build_preset_checkpoint(PRESET)
    (base,) = [p for p in root.iterdir() if p.name.startswith(f"{PRESET}-bf16-")]
    return root, base, quantized


def _independent_mxfp4_value(w_row: torch.Tensor) -> torch.Tensor:
    """One 32-element block by DeepSeek-V4's FP4 rule, written without ops.mxfp4: scale
    ``s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))`` (the fp32 quotient; frexp gives the exact exponent),
    element ``e2m1_rne(w / s)`` (nearest magnitude, ties to the even code; never above 6 by the
    choice of ``s``); returns the values ``code * s`` in fp64."""
    import math

    amax = max(float(w_row.float().abs().max()), 6 * 2.0 ** -126)
    q = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(6.0))
    m, e = math.frexp(q)  # q = m * 2^e, m in [0.5, 1)
    sc = 2.0 ** (e - 1 if m == 0.5 else e)
    out = []
    for v in w_row.float().tolist():
        a = abs(v) / sc
        assert a <= 6.0
        best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
        out.append(math.copysign(E2M1[best] * sc, v) if E2M1[best] else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def test_published_layout_stores_int8_codes_and_e8m0_scales_equal_to_the_mxfp4_rule(cache, tmp_path):
    from unified_models.cli import main
    from unified_models.ops.mxfp4 import MXFP4Weight, mxfp4_dequantize

    _, base, quantized = cache
    official = tmp_path / "official"
    # the CLI: bf16 source -> DeepSeek-V4-Flash's mix in the published layout
    assert main(["quantize", str(base), str(official), "--expert-dtype", "fp4"]) == 0
    cfg = json.loads((official / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4"
    off, masters = read_tensors(official), read_tensors(base)
    w = off["layers.2.ffn.experts.3.w1.weight"]
    s = off["layers.2.ffn.experts.3.w1.scale"]
    assert w.dtype == torch.int8 and w.shape == (128, 64) and s.dtype == torch.float8_e8m0fnu and s.shape == (128, 4)
    assert off["layers.2.ffn.shared_experts.w1.weight"].dtype == torch.float8_e4m3fn
    assert off["layers.2.ffn.shared_experts.w1.scale"].dtype == torch.float8_e8m0fnu  # fp4 files: e8m0 containers
    got = mxfp4_dequantize(MXFP4Weight(w, s), torch.float64)
    m = masters["model.layers.2.ffn.experts.3.w1.weight"]
    for row in (0, 77, 127):
        for blk in range(4):
            want = _independent_mxfp4_value(m[row, blk * 32:(blk + 1) * 32])
            assert torch.equal(got[row, blk * 32:(blk + 1) * 32], want), (row, blk)
    # the same bytes as the transformers-layout preset, under the canonical names and containers
    hf = read_tensors(quantized)
    assert hf["model.layers.2.ffn.experts.3.w1.weight"].dtype == torch.uint8
    assert torch.equal(_bits(hf["model.layers.2.ffn.experts.3.w1.weight"]), _bits(w))
    assert torch.equal(_bits(hf["model.layers.2.ffn.experts.3.w1.weight_scale"]), _bits(s))
    # published -> transformers -> published: every byte, every dtype
    back, again = tmp_path / "hf", tmp_path / "again"
    layout.convert_checkpoint(official, back, to="hf")
    layout.convert_checkpoint(back, again, to="official")
    assert _same(read_tensors(official), read_tensors(again))
    assert _same(read_tensors(back), hf)
    _, spec_off, sd_off = spec_and_state_dict(official)
    _, spec_hf, sd_hf = spec_and_state_dict(quantized)
    assert spec_off == spec_hf and _same(sd_off, sd_hf)
    fmts = dict(spec_hf.weight_formats)
    assert fmts["model.layers.0.ffn.experts.0.w2"].format == "mxfp4"
    # the tokenizer next to a published config (HCA ratio 16, which transformers' config class cannot
    # read) loads and gives the transformers-layout directory's ids
    from unified_models.prompts import tokenize_prompts

    text = ["Natalia sold clips to 48 of her friends in April."]
    assert tokenize_prompts(text, official, vocab_size=32064) == tokenize_prompts(text, quantized, vocab_size=32064)
    assert fmts["model.layers.0.ffn.shared_experts.w2"].format == "fp8_block"


def test_check_on_the_flash_mix_is_diff_zero(cache, tmp_path, monkeypatch):
    from unified_models.check import CheckOptions, run_check

    root, _, _ = cache
    monkeypatch.setenv("UNIFIED_MODELS_CACHE", str(root))
    out = tmp_path / "report.json"
    rc = run_check(CheckOptions(preset=PRESET, num_prompts=8, max_new_tokens=32, device="cpu", json_out=str(out)))
    report = json.loads(out.read_text())
    assert report["tokens_compared"] == 256
    diff = {k: report[k] for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched",
                                   "full_vocab_max_abs_diff")}
    assert diff == dict.fromkeys(diff, 0), diff
    assert report["peer"]["within_tolerance"] and rc == 0
