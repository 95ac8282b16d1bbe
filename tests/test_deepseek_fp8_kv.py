"""DeepSeek-V4's FP8 KV rule in the attention layer (``kv_cache_dtype="fp8_ds_mla"``): every window
vector and every main-compressor entry in the caches is a fixed point of the rule (what an FP8 cache of
codes + ue8m0 scales dequantizes to), the RoPE dims are untouched, prefill == chunked prefill == decode
bitwise with it, the fp64 oracle applies it at the same points, the gradient passes straight through,
the family's quantization rules switch it on and off, and a head dim whose no-RoPE part is not a
multiple of 64 is refused. Shapes: head_dim 80 = 64 no-RoPE dims (one FP8 tile) + 16 RoPE dims."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unified_models.dsl import SpecError
from unified_models.layers import deepseek_attention as dsa
from unified_models.layers.quantization import QuantizationOptions
from unified_models.ops import ds_kv_fp8_roundtrip
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch

from test_deepseek_compressed_attention import SIZES, TYPES, _model_spec, attention_spec

E, R = 80, 16
FP8 = dict(head_dim=E, qk_rope_head_dim=R, o_groups=2, kv_cache_dtype="fp8_ds_mla")


def _params(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in spec.parameter_shapes().items():
        fan = shape[-1] if len(shape) > 1 else 1
        t = torch.randn(shape, generator=g) * (1.0 / fan ** 0.5 if len(shape) > 1 else 0.5)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        out[name] = t
    dt = spec.trainable_parameter_dtypes()
    return {k: v if k in dt else v.bfloat16() for k, v in out.items()}


def _run(spec, params, x_TD, chunks=None, block_size=16):
    model = _model_spec([spec], dtype=x_TD.dtype)
    t = x_TD.shape[0]
    store = PrivateStateStore(model, [t], block_size=block_size)
    ctx = dsa.LayerContext(model=model)
    outs, start = [], 0
    for n in chunks or [t]:
        batch = FlatBatch.from_cu_seqlens(torch.zeros(n, dtype=torch.long), torch.tensor([0, n]), torch.tensor([start]))
        store.bind(batch)
        outs.append(dsa.deepseek_attention_forward(spec, 0, params, x_TD[start:start + n], batch, store, ctx))
        start += n
    return torch.cat(outs), store


@pytest.mark.parametrize("layer_type", TYPES)
def test_caches_hold_fixed_points_and_steps_agree(layer_type):
    spec = attention_spec(0, layer_type, **FP8)
    plain = dataclasses.replace(spec, kv_cache_dtype="auto")
    params = _params(spec)
    x = torch.randn(29, SIZES["hidden_size"], generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        full, store = _run(spec, params, x)
        assert torch.equal(full, _run(spec, params, x, chunks=[5] * 5 + [4])[0])
        assert torch.equal(full, _run(spec, params, x, chunks=[6] + [1] * 23, block_size=32)[0])
        other = _run(plain, params, x)[0]
    assert not torch.equal(full, other)  # the rule changes the output
    names = ["swa"] + (["compressed_kv"] if spec.compressed else [])
    for name in names:
        cache = store.state(0, name).k_cache
        used = cache.reshape(-1, E)[cache.reshape(-1, E).abs().sum(-1) > 0]
        assert used.shape[0] > 0, name
        assert torch.equal(ds_kv_fp8_roundtrip(used, R), used), name  # e4m3 codes * 2^k, exactly
        assert not torch.equal(ds_kv_fp8_roundtrip(used.float() * 1.001, R), used.float() * 1.001)


@pytest.mark.parametrize("layer_type", TYPES[1:])
def test_oracle_applies_the_rule_at_the_same_points(layer_type):
    """The fp32 engine forward (fp32 rows: the rule's codes are those of the oracle's fp32-exact values
    nearly everywhere) vs the fp64 oracle; both with the rule, and the rule matters."""
    spec = attention_spec(0, layer_type, **FP8)
    params = {k: v.float() for k, v in _params(spec, seed=2).items()}
    x = torch.randn(26, SIZES["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = _run(spec, params, x)[0].double()
        want = dsa.deepseek_attention_oracle(spec, {k: v.double() for k, v in params.items()}, x.double())
        plain = dsa.deepseek_attention_oracle(dataclasses.replace(spec, kv_cache_dtype="auto"),
                                              {k: v.double() for k, v in params.items()}, x.double())
    err = float((got - want).abs().max() / want.abs().max())
    gap = float((plain - want).abs().max() / want.abs().max())
    assert err < 1e-3 < gap, (err, gap)  # an FP8 code flips on a rare fp32 vs fp64 rounding; the rule is ~2^-4


def test_gradient_is_straight_through_the_rule():
    spec = attention_spec(0, "heavily_compressed_attention", **FP8)
    params = {k: v.float().requires_grad_() for k, v in _params(spec, seed=4).items()}
    x = torch.randn(20, SIZES["hidden_size"], generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = _run(spec, params, x)[0]
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert params["model.layers.0.attn.wkv.weight"].grad.abs().sum() > 0
    assert params["model.layers.0.attn.compressor.wkv.weight"].grad.abs().sum() > 0


def test_quantization_rules_and_refusal():
    spec = attention_spec(0, "compressed_sparse_attention", **FP8)
    rules = dsa.QUANTIZATION
    assert rules.dequantized(spec).kv_cache_dtype == "auto"
    assert rules.quantized(dataclasses.replace(spec, kv_cache_dtype="auto"),
                           QuantizationOptions(kv_cache="fp8")).kv_cache_dtype == "fp8_ds_mla"
    assert rules.quantized(spec, QuantizationOptions()).kv_cache_dtype == "fp8_ds_mla"
    with pytest.raises(SpecError, match="multiple of 64"):
        attention_spec(0, "sliding_attention", head_dim=96, qk_rope_head_dim=16, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(SpecError, match="kv_cache_dtype"):
        attention_spec(0, "sliding_attention", kv_cache_dtype="fp8")


def test_block_fp8_wo_a_runs_dequantized_and_stored_equals_master():
    """``wo_a`` in block FP8 (the published checkpoints store it so; DeepSeek's reference dequantizes it
    and runs it in bf16, W8A16): stored codes and their bf16 master give the same bits, and the output
    differs from the unquantized weight's."""
    from unified_models.dsl.weights import LinearFormat
    from unified_models.ops.fp8_block import fp8_block_quantize_weight

    spec = attention_spec(0, "sliding_attention", head_dim=128, qk_rope_head_dim=16, num_heads=2, o_groups=2,
                          o_lora_rank=8)
    name = "model.layers.0.attn.wo_a"
    base = _model_spec([spec])
    params = _params(spec, seed=6)
    codes, scale = fp8_block_quantize_weight(params[f"{name}.weight"])
    stored = {k: v for k, v in params.items() if k != f"{name}.weight"}
    stored.update({f"{name}.weight": codes, f"{name}.weight_scale_inv": scale})
    x = torch.randn(12, SIZES["hidden_size"], generator=torch.Generator().manual_seed(7)).bfloat16()

    def run(model, p):
        store = PrivateStateStore(model, [12], block_size=16)
        batch = FlatBatch.from_cu_seqlens(torch.zeros(12, dtype=torch.long), torch.tensor([0, 12]))
        store.bind(batch)
        return dsa.deepseek_attention_forward(spec, 0, p, x, batch, store, dsa.LayerContext(model=model))

    with torch.no_grad():
        y_stored = run(base.with_weight_formats({name: LinearFormat("fp8_block")}), stored)
        y_master = run(base.with_weight_formats({name: LinearFormat("fp8_block").master()}), params)
        y_plain = run(base, params)
    assert torch.equal(y_stored, y_master) and not torch.equal(y_stored, y_plain)
