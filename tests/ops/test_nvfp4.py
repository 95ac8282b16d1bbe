"""NVFP4 (W4A16) by ModelOpt's rule: quantizer and dequantizer bit for bit against NVIDIA ModelOpt
(``modelopt.torch.quantization.qtensor.nvfp4_tensor.NVFP4QTensor``, 0.47), edge cases against the
transcribed rule, packing, the in-kernel decoders, and the load-time validator."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from unified_models.ops.nvfp4 import (
    E2M1_VALUES,
    NVFP4Error,
    NVFP4Weight,
    cast_e2m1,
    nvfp4_dequantize,
    nvfp4_quantize,
    nvfp4_quantize_into,
    nvfp4_scale_2,
    pack_e2m1,
    stack_nvfp4_experts,
    unpack_e2m1,
    validate_nvfp4,
    validate_nvfp4_experts,
)
from unified_models.ops.triton._common import e4m3_bits_to_f32 as _e4m3_to_f32
from unified_models.ops.moe.triton import _e2m1_to_f32


def _modelopt():
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same_as_modelopt(w, q: NVFP4Weight, ws2=None):
    Q = _modelopt()
    mq, ms, ms2 = Q.quantize(w, 16, weights_scaling_factor_2=ws2)
    assert torch.equal(q.weight, mq._quantized_data), "packed codes differ from ModelOpt"
    assert torch.equal(_u8(q.weight_scale), _u8(ms)), "block scales differ from ModelOpt"
    assert torch.equal(q.weight_scale_2.view(torch.int32), ms2.reshape(q.weight_scale_2.shape).view(torch.int32))
    for dtype in (torch.bfloat16, torch.float32):
        md = mq.dequantize(dtype=dtype, scale=ms, double_scale=ms2, block_sizes={-1: 16})
        ours = nvfp4_dequantize(q, dtype)
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           md.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), f"dequant {dtype}"


def _edge_weight():
    """[4, 64] bf16 with ws2 = 1 (amax 2688) and blocks whose e4m3 scale is 1 (block amax 6),
    so the scaled values are the weights themselves: every E2M1 rounding tie and its neighbours,
    an all-zero block, a one-element block, a tiny block (scale clamped to 2^-9)."""
    w = torch.zeros(4, 64)
    w[0, 0] = 2688.0  # tensor amax -> weight_scale_2 = 1.0 exactly
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    w[1, 0:8] = torch.tensor(ties)
    w[1, 8:16] = -torch.tensor(ties)
    nb = [0.2490234375, 0.251953125, 0.74609375, 0.75390625, 5.03125, 4.96875, 5.5, 6.0]  # bf16 neighbours
    w[1, 16:24] = torch.tensor(nb)
    w[1, 24:32] = -torch.tensor(nb)
    w[1, 32:48] = 0.0  # all-zero block (row 1, block 2)
    w[1, 48] = 6.0  # a block with its amax in one element
    w[2, 0:16] = 1e-30  # tiny block: the scale would underflow; clamped to 2^-9
    w[2, 16:32] = torch.linspace(-6, 6, 16)
    w[3] = torch.linspace(-2688, 2688, 64)
    return w.bfloat16()


# ---------------------------------------------------------------------------- against ModelOpt


@pytest.mark.parametrize("shape,scale,dtype", [((64, 128), 1.0, torch.bfloat16), ((16, 32), 1e-3, torch.bfloat16),
                                               ((8, 48), 300.0, torch.bfloat16), ((32, 64), 1.0, torch.float32)])
def test_quantize_matches_modelopt(shape, scale, dtype, gen):
    w = (torch.randn(*shape, generator=gen) * scale).to(dtype)
    w[0, :16] = 0.0  # an all-zero block
    w[1, 16] = w.abs().max() * 2  # the tensor amax alone in its block
    _assert_same_as_modelopt(w, nvfp4_quantize(w))


def test_quantize_edge_cases_match_modelopt():
    w = _edge_weight()
    _assert_same_as_modelopt(w, nvfp4_quantize(w))


def test_stacked_experts_match_modelopt_per_expert(gen):
    """[E, N, K] quantized at once == ModelOpt on each expert (own weight_scale_2 per expert)."""
    w = torch.randn(3, 16, 64, generator=gen).bfloat16() * torch.tensor([1.0, 0.01, 50.0]).view(3, 1, 1).bfloat16()
    q = nvfp4_quantize(w)
    assert q.weight.shape == (3, 16, 32) and q.weight_scale.shape == (3, 16, 4) and q.weight_scale_2.shape == (3,)
    for e in range(3):
        _assert_same_as_modelopt(w[e], q.expert(e))


def test_shared_scale_2_matches_modelopt(gen):
    """Fused group (e.g. gate/up): ModelOpt exports ONE weight_scale_2 = max amax / 2688; each member
    quantized with it matches ModelOpt given that scale, and differs from quantizing alone."""
    a = torch.randn(16, 32, generator=gen).bfloat16()
    b = (torch.randn(16, 32, generator=gen) * 4).bfloat16()
    s2 = nvfp4_scale_2(a, b)
    assert float(s2) == float(b.abs().max().float() / 2688.0)
    qa = nvfp4_quantize(a, s2)
    _assert_same_as_modelopt(a, qa, ws2=s2)
    assert not torch.equal(_u8(qa.weight_scale), _u8(nvfp4_quantize(a).weight_scale))


# ---------------------------------------------------------------------------- the transcribed rule


def test_e2m1_rounding_ties_to_even():
    """Round to nearest, ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4;
    above 5 -> 6 (saturating); NaN -> code 7; negative values carry the sign bit (-0.1 -> code 8)."""
    x = torch.tensor([0.0, 0.25, 0.2500001, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 7.0, 1e9,
                      -0.25, -0.75, -3.5, -0.1, float("nan"), 0.5, 1.5, 3.0, 6.0])
    want = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7,
            8, 10, 14, 8, 7, 1, 3, 5, 7]
    assert cast_e2m1(x).tolist() == want
    assert torch.equal(cast_e2m1(x), _modelopt()._cast_fp4(x.clone()))


def test_edge_case_values():
    w = _edge_weight()
    q = nvfp4_quantize(w)
    assert float(q.weight_scale_2) == 1.0
    s = q.weight_scale.float()
    codes = unpack_e2m1(q.weight)
    assert s[1, 0] == 1.0 and codes[1, 0:8].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]
    assert codes[1, 8:16].tolist() == [8, 10, 10, 12, 12, 14, 14, 15]
    assert s[1, 1] == 1.0 and codes[1, 16:24].tolist() == [0, 1, 1, 2, 7, 6, 7, 7]
    assert codes[1, 24:32].tolist() == [8, 9, 9, 10, 15, 14, 15, 15]
    assert s[1, 2] == 1.0 and codes[1, 32:48].tolist() == [0] * 16  # all-zero block: scale 1.0
    assert s[1, 3] == 1.0 and codes[1, 48] == 7  # amax alone in its block -> +6
    assert s[2, 0] == 2.0 ** -9  # clamped, not flushed to 0
    assert s[0, 0] == 448.0 and codes[0, 0] == 7  # the tensor amax -> 448 * 6 * ws2
    d = nvfp4_dequantize(q, torch.float32)
    assert d[0, 0] == 2688.0 and d[1, 48] == 6.0 and d[1, 2] == 1.0


def test_all_zero_tensor_is_exact_zero():
    """Documented deviation: ModelOpt gives NaN block scales for an all-zero tensor (0/0); here
    weight_scale_2 = 0, block scales 1.0, codes 0, and the dequantization is exactly 0."""
    q = nvfp4_quantize(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert float(q.weight_scale_2) == 0.0 and torch.all(q.weight_scale.float() == 1.0)
    assert torch.all(q.weight == 0) and torch.all(nvfp4_dequantize(q) == 0)
    mq, ms, _ = _modelopt().quantize(torch.zeros(4, 32, dtype=torch.bfloat16), 16)
    assert torch.isnan(ms.float()).all()  # the behaviour we deviate from


def test_pack_unpack_round_trip(gen):
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    # element 2j in the low nibble, 2j+1 in the high nibble (ModelOpt / vLLM break_fp4_bytes)
    assert pack_e2m1(torch.tensor([[1, 2, 15, 0]])).tolist() == [[0x21, 0x0F]]
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(1, 3, dtype=torch.uint8))


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiple of the NVFP4 block"):
        nvfp4_quantize(torch.zeros(4, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        nvfp4_quantize(torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(NVFP4Error, match="do not match"):
        NVFP4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2).to(torch.float8_e4m3fn),
                    torch.ones(()))


# ---------------------------------------------------------------------------- in-kernel decoders


@triton.jit
def _decode_kernel(b_ptr, out_ptr, n, E2M1: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    b = tl.load(b_ptr + offs, mask=m, other=0).to(tl.int32)
    if E2M1:
        v = _e2m1_to_f32(b)
    else:
        v = _e4m3_to_f32(b)
    tl.store(out_ptr + offs, v, mask=m)


def _decode(codes, e2m1, device):
    out = torch.empty(codes.shape[0], dtype=torch.float32, device=device)
    _decode_kernel[(1,)](codes.to(device), out, codes.shape[0], E2M1=e2m1, BLOCK=256)
    return out.cpu()


def test_kernel_decoders_exact(device):
    """The grouped GEMM's integer decoders: every e4m3 byte == torch's float8_e4m3fn -> fp32 (NaN for
    0x7F/0xFF), every E2M1 code == ModelOpt's table (code 8 is +0)."""
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = _decode(allb, False, device)
    want = allb.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    codes = torch.arange(16, dtype=torch.uint8)
    got = _decode(codes, True, device)
    assert torch.equal(got.view(torch.int32), torch.tensor(E2M1_VALUES, dtype=torch.float32).view(torch.int32))


# ---------------------------------------------------------------------------- load-time validation


def _expert_tensors(gen, n=8, k=32):
    q = nvfp4_quantize(torch.randn(n, k, generator=gen).bfloat16())
    return {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2,
            "input_scale": torch.tensor(0.01)}


def test_validator_accepts_good_checkpoint(gen):
    experts = {e: {"up_proj": _expert_tensors(gen), "down_proj": _expert_tensors(gen, 32, 16)} for e in range(4)}
    validate_nvfp4_experts(3, experts, num_experts=4, shapes={"up_proj": (8, 32), "down_proj": (32, 16)},
                           require_input_scale=True)
    t = experts[0]["up_proj"]
    validate_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], layer=3, expert=0, proj="up_proj")


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.pop("weight_scale_2"), "weight_scale_2 is missing"),
    (lambda t: t.pop("weight_scale"), "weight_scale is missing"),
    (lambda t: t.pop("weight"), "weight is missing"),
    (lambda t: t.__setitem__("weight_scale_2", torch.tensor(0.0)), "weight_scale_2 is zero"),
    (lambda t: t.__setitem__("weight_scale_2", torch.tensor(float("nan"))), "weight_scale_2 is NaN"),
    (lambda t: t.__setitem__("weight_scale_2", torch.tensor(float("inf"))), "weight_scale_2 is inf"),
    (lambda t: t.__setitem__("input_scale", torch.tensor(float("nan"))), "input_scale is NaN"),
    (lambda t: t.__setitem__("input_scale", torch.tensor(0.0)), "input_scale is zero"),
    (lambda t: t["weight_scale"].view(torch.uint8).__setitem__((2, 1), 0x7F),
     r"1 NaN block scale\(s\) \(first at \[2, 1\]\)"),
    (lambda t: t["weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x00), "zero block scale"),
    (lambda t: t.__setitem__("weight", t["weight"][:, :8]), "do not match"),
    (lambda t: t.__setitem__("weight_scale_2", t["weight_scale_2"].double()), "expected torch.float32"),
])
def test_validator_names_layer_and_expert(mutate, msg, gen):
    experts = {e: {"up_proj": _expert_tensors(gen), "down_proj": _expert_tensors(gen)} for e in range(6)}
    mutate(experts[5]["up_proj"])
    with pytest.raises(NVFP4Error, match=r"layer 7: bad expert ids \[5\]: expert 5 up_proj: .*" + msg):
        validate_nvfp4_experts(7, experts, num_experts=6)


def test_validator_lists_every_bad_expert(gen):
    experts = {e: {"up_proj": _expert_tensors(gen), "down_proj": _expert_tensors(gen)} for e in range(6)}
    experts[1]["down_proj"]["weight_scale_2"] = torch.tensor(0.0)
    experts[4]["up_proj"]["weight_scale_2"] = torch.tensor(float("nan"))
    del experts[2]["down_proj"]
    del experts[5]
    with pytest.raises(NVFP4Error) as err:
        validate_nvfp4_experts("backbone.layers.9.mixer", experts, num_experts=6)
    text = str(err.value)
    assert "layer backbone.layers.9.mixer" in text and "bad expert ids [1, 2, 4]" in text
    assert "expert(s) [5] missing" in text and "expert 2 down_proj: missing" in text
    assert "expert 1 down_proj: weight_scale_2 is zero" in text and "expert 4 up_proj: weight_scale_2 is NaN" in text


def test_validator_single_linear_message(gen):
    t = _expert_tensors(gen)
    with pytest.raises(NVFP4Error, match="layer 2 expert 11 down_proj: input_scale is missing"):
        validate_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], None, layer=2, expert=11,
                       proj="down_proj", require_input_scale=True)


def test_stack_experts_equals_stacked_quantize(gen):
    w = torch.randn(4, 8, 32, generator=gen).bfloat16()
    q = nvfp4_quantize(w)
    per = {e: {"weight": q.weight[e], "weight_scale": q.weight_scale[e], "weight_scale_2": q.weight_scale_2[e]}
           for e in range(4)}
    s = stack_nvfp4_experts(0, per, 4, shape=(8, 32))
    assert torch.equal(s.weight, q.weight) and torch.equal(_u8(s.weight_scale), _u8(q.weight_scale))
    assert torch.equal(s.weight_scale_2, q.weight_scale_2) and s.input_scale is None
    per[3]["weight_scale_2"] = torch.tensor(float("nan"))
    with pytest.raises(NVFP4Error, match=r"layer 0: bad expert ids \[3\]"):
        stack_nvfp4_experts(0, per, 4)


def test_quantize_into_updates_buffers_in_place(gen):
    w0, w1 = (torch.randn(2, 8, 32, generator=gen).bfloat16() for _ in range(2))
    buf = nvfp4_quantize(w0)
    ptrs = [t.data_ptr() for t in (buf.weight, buf.weight_scale, buf.weight_scale_2)]
    nvfp4_quantize_into(buf, w1)
    assert ptrs == [t.data_ptr() for t in (buf.weight, buf.weight_scale, buf.weight_scale_2)]
    q1 = nvfp4_quantize(w1)
    assert torch.equal(buf.weight, q1.weight) and torch.equal(_u8(buf.weight_scale), _u8(q1.weight_scale))
    assert torch.equal(buf.weight_scale_2, q1.weight_scale_2)
    with pytest.raises(ValueError, match="does not fit"):
        nvfp4_quantize_into(buf, w1[:, :4])
