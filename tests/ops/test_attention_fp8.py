"""FP8 (e4m3) KV cache: one write rule, one read rule, every schedule bitwise.

Rules (``ops.attention`` module docstring; vLLM ``kv_cache_dtype="fp8"``):
write ``code = e4m3(clamp(fp32(k) / k_scale, -448, 448))`` (IEEE division,
round to nearest even), read ``k = q.dtype(fp32(e4m3) * k_scale)``; the same
for V. Checked here, for the CPU torch implementation and the Triton kernels
(through the interpreter on CPU, natively on CUDA):

* the write against an explicit transcription of the rule (nearest value of
  the e4m3 table in fp64, ties to the even code), including saturation,
  +-inf, -0.0, subnormals, exact ties and NaN;
* the read: attention over an FP8 cache equals, bitwise, attention over a
  model-dtype cache holding the dequantized values;
* prefill == chunked prefill == token-by-token decode, bitwise, for several
  block sizes, random block tables, strided K/V views and stale (NaN-code)
  memory; within tolerance of the fp64 dense oracle of the
  quantize-dequantize math;
* the gradient: straight through the quantization (dense fp64 autograd at the
  round-tripped K/V), forward values unchanged by the graph;
* bad scales are refused with clear errors.
"""

from __future__ import annotations

import pytest
import torch

from invariance import scattered_block_table
from unified_models import ops
from unified_models.dsl import AttentionSpec, SpecError
from unified_models.ops.attention import (FP8_E4M3_MAX, dense_causal_attention_reference, kv_fp8_dequantize,
                                          kv_fp8_quantize, kv_fp8_roundtrip, paged_attention_reference,
                                          paged_attention_torch, write_kv_cache_torch)

FP8 = torch.float8_e4m3fn
E = 16
SCALE = E ** -0.5
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _triton_impl():
    from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

    return write_kv_cache_triton, paged_attention_triton


def _torch_impl():
    return write_kv_cache_torch, paged_attention_torch


IMPLS = {"torch": _torch_impl, "triton": _triton_impl}


# ----------------------------------------------------------------------------- the write rule, transcribed

def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [126], values fp64 [126])``: every finite non-negative e4m3fn value, decoded
    from its bit fields (bias 7; exponent 0 = subnormal, m * 2^-9)."""
    codes, vals = [], []
    for c in range(0x7F):  # 0x7F is NaN
        e, m = c >> 3, c & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        codes.append(c)
    return torch.tensor(codes), torch.tensor(vals, dtype=torch.float64)


def write_rule_transcription(x: torch.Tensor, scale: float) -> torch.Tensor:
    """uint8 codes of ``x`` by the write rule, written out: ``y = fp32(x) / fp32(scale)``
    (one IEEE division), saturate at 448, the nearest e4m3 value (fp64 distances),
    a tie to the even code, the sign bit of ``y`` kept (also for zero), NaN -> 0x7F | sign."""
    codes, vals = _e4m3_table()
    y = x.float().reshape(-1) / torch.tensor(scale, dtype=torch.float32)
    sign = (y.view(torch.int32) < 0).to(torch.uint8) * 0x80
    mag = y.double().abs().clamp(max=FP8_E4M3_MAX)
    dist = (mag[:, None] - vals[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist == best
    even = ties & (codes[None, :] % 2 == 0)
    pick = torch.where(even.any(1), even.float().argmax(1), ties.float().argmax(1))
    out = codes[pick].to(torch.uint8)
    out = torch.where(y.isnan(), torch.tensor(0x7F, dtype=torch.uint8), out)
    return (out | sign).view(x.shape)


def _rule_inputs(dtype: torch.dtype, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Values that exercise every branch of the rule once divided by ``scale``."""
    _, vals = _e4m3_table()
    v = vals.float()
    mids = (v[1:] + v[:-1]) / 2  # exact ties between neighbours (all representable in fp32)
    special = torch.tensor([0.0, -0.0, 447.9, 448.0, 449.0, 464.0, 480.0, 1e6, float("inf"), float("-inf"),
                            2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -6 * (1 - 2.0 ** -12), 1e-30, -1e-30, 2.0 ** -9])
    y = torch.cat([v, -v, mids, -mids, special, -special, torch.randn(200, generator=gen) * 30])
    x = (y * scale).to(dtype)
    if dtype == torch.float32:
        x = torch.cat([x, torch.tensor([float("nan"), -float("nan")])])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.5, 0.02, 3.7])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_write_rule_bitwise(impl, scale, dtype, gen, device):
    dev = device if impl == "triton" else "cpu"
    x = _rule_inputs(dtype, scale, gen)
    n = x.numel() - x.numel() % 4
    k = x[:n].view(-1, 2, 2).to(dev)  # [T, G=2, E=2]
    v = (-x[:n]).view(-1, 2, 2).to(dev)
    t = k.shape[0]
    kc = torch.full((t, 1, 2, 2), 0x55, dtype=torch.uint8, device=dev).view(FP8)
    vc = torch.full((t, 1, 2, 2), 0x55, dtype=torch.uint8, device=dev).view(FP8)
    ks = torch.tensor(scale, device=dev)
    vs = torch.tensor(scale, device=dev)
    slots = torch.randperm(t, generator=gen).to(dev)
    IMPLS[impl]()[0](k, v, kc, vc, slots, ks, vs)
    got_k = kc.view(torch.uint8).cpu().view(t, 2, 2)[slots.cpu()]  # row i = token i's slot
    got_v = vc.view(torch.uint8).cpu().view(t, 2, 2)[slots.cpu()]
    assert torch.equal(got_k, write_rule_transcription(k.cpu(), scale)), "K codes differ from the write rule"
    assert torch.equal(got_v, write_rule_transcription(v.cpu(), scale)), "V codes differ from the write rule"
    # the torch helper the trainer's backward uses is the same rule
    assert torch.equal(kv_fp8_quantize(k.cpu(), torch.tensor(scale)).view(torch.uint8),
                       write_rule_transcription(k.cpu(), scale))
    zero_codes = got_k[(k.cpu() == 0)]
    assert set(zero_codes.tolist()) <= {0x00, 0x80} and (got_k[k.cpu().view(-1, 2, 2) == float("inf")] == 0x7E).all()


def test_write_keeps_the_sign_of_zero_and_skips_padding(device, inv):
    write, _ = _triton_impl()
    k = torch.tensor([[[-0.0, 0.0]], [[-1e-30, 1e-30]], [[5.0, 5.0]]], device=device)
    kc = torch.full((2, 2, 1, 2), 0x33, dtype=torch.uint8, device=device).view(FP8)
    vc = torch.full((2, 2, 1, 2), 0x33, dtype=torch.uint8, device=device).view(FP8)
    one = torch.tensor(1.0, device=device)
    write(k, k, kc, vc, torch.tensor([0, 3, -1], device=device), one, one)
    codes = kc.view(torch.uint8).cpu().view(4, 2)
    assert codes[0].tolist() == [0x80, 0x00] and codes[3].tolist() == [0x80, 0x00]
    assert (codes[1:3] == 0x33).all(), "padding token or unused slot written"


# ----------------------------------------------------------------------------- the read rule

@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32])
def test_read_rule_equals_a_cache_of_dequantized_values(impl, qdtype, gen, device, inv):
    """Attention over an FP8 cache == attention over a model-dtype cache holding
    ``q.dtype(fp32(e4m3) * scale)``: the read path adds nothing but the dequantization."""
    dev = device if impl == "triton" else "cpu"
    _, attend = IMPLS[impl]()
    n, G, H, S = 37, 2, 4, 16
    codes = torch.randint(0, 256, (3, S, G, E), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    kc = codes.view(FP8).to(dev)
    vc = codes.flip(0).contiguous().view(FP8).to(dev)
    ks, vs = torch.tensor(0.013, device=dev), torch.tensor(0.29, device=dev)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32, device=dev)
    q = torch.randn(n, H, E, generator=gen).to(qdtype).to(dev)
    seq = torch.zeros(n, dtype=torch.int32, device=dev)
    pos = torch.arange(n, device=dev)
    got = attend(q, kc, vc, table, seq, pos, SCALE, ks, vs)
    plain_k = kv_fp8_dequantize(kc.cpu(), ks.cpu(), qdtype).to(dev)
    plain_v = kv_fp8_dequantize(vc.cpu(), vs.cpu(), qdtype).to(dev)
    want = attend(q, plain_k, plain_v, table, seq, pos, SCALE)
    inv.assert_bitwise(got, want, f"{impl} {qdtype}: FP8 read vs dequantized cache")
    ref = paged_attention_reference(q.cpu().double(), kc.cpu(), vc.cpu(), table.cpu(), seq.cpu(), pos.cpu(), SCALE,
                                    ks.cpu(), vs.cpu(), kv_dtype=qdtype)
    torch.testing.assert_close(got.cpu().double(), ref, **(BF16_TOL if qdtype == torch.bfloat16 else
                                                          dict(rtol=1e-4, atol=1e-5)))


# ----------------------------------------------------------------------------- schedules

class Fp8Run:
    """One FP8 cache (random block permutation, block size S, K/V strided views of one
    allocation, stale NaN codes everywhere) and a schedule of steps."""

    def __init__(self, seqs, S, G, device, gen, impl, ks, vs):
        self.seqs, self.S, self.device, self.gen = seqs, S, device, gen
        self.write, self.attend = impl
        self.ks, self.vs = ks.to(device), vs.to(device)
        need = [-(-s["q"].shape[0] // S) for s in seqs]
        num_blocks = sum(need) + 2
        self.buf = torch.full((num_blocks, 2, S, G, E), 0x7F, dtype=torch.uint8, device=device).view(FP8)
        self.k_cache, self.v_cache = self.buf[:, 0], self.buf[:, 1]
        self.block_table = scattered_block_table(need, num_blocks, gen, max(need) + 1).to(device)
        self.out = [torch.full_like(s["q"], float("nan")) for s in seqs]

    def slot(self, b, p):
        return int(self.block_table[b, p // self.S]) * self.S + p % self.S

    def step(self, chunks, n_pad=0):
        toks = [(b, p) for b, s, e in chunks for p in range(s, e)] + [(-1, -1)] * n_pad
        order = torch.randperm(len(toks), generator=self.gen).tolist()
        toks = [toks[i] for i in order]
        s0 = self.seqs[0]
        H, G, dt = s0["q"].shape[1], s0["k"].shape[1], s0["q"].dtype
        junk = lambda *shape: (torch.randn(*shape, generator=self.gen) * 100).to(dt)  # noqa: E731
        q = torch.stack([self.seqs[b]["q"][p] if b >= 0 else junk(H, E) for b, p in toks]).to(self.device)
        k = torch.stack([self.seqs[b]["k"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        v = torch.stack([self.seqs[b]["v"][p] if b >= 0 else junk(G, E) for b, p in toks]).to(self.device)
        slots = torch.tensor([self.slot(b, p) if b >= 0 else -1 for b, p in toks], dtype=torch.int64)
        seq_idx = torch.tensor([max(b, 0) for b, _ in toks], dtype=torch.int32)
        pos = torch.tensor([p for _, p in toks], dtype=torch.int64)
        self.write(k, v, self.k_cache, self.v_cache, slots.to(self.device), self.ks, self.vs)
        o = self.attend(q, self.k_cache, self.v_cache, self.block_table, seq_idx.to(self.device),
                        pos.to(self.device), SCALE, self.ks, self.vs).cpu()
        for i, (b, p) in enumerate(toks):
            if b >= 0:
                self.out[b][p] = o[i]

    def check_cache(self):
        """Written slots hold the write rule's codes; every other slot still holds the stale NaN code."""
        expect = torch.full(self.buf.shape, 0x7F, dtype=torch.uint8)
        for b, s in enumerate(self.seqs):
            for p in range(s["q"].shape[0]):
                blk, off = int(self.block_table[b, p // self.S]), p % self.S
                expect[blk, 0, off] = write_rule_transcription(s["k"][p], float(self.ks))
                expect[blk, 1, off] = write_rule_transcription(s["v"][p], float(self.vs))
        assert torch.equal(self.buf.view(torch.uint8).cpu(), expect), "cache codes differ from the write rule"


def _sequences(lengths, H, G, dtype, gen):
    return [dict(q=torch.randn(n, H, E, generator=gen).to(dtype),
                 k=(torch.randn(n, G, E, generator=gen) * 3.0).to(dtype),
                 v=torch.randn(n, G, E, generator=gen).to(dtype)) for n in lengths]


def _run(run, name, gen):
    lens = [s["q"].shape[0] for s in run.seqs]
    if name == "prefill":
        run.step([(b, 0, n) for b, n in enumerate(lens)], n_pad=3)
    elif name == "decode":
        for p in range(max(lens)):
            run.step([(b, p, p + 1) for b in range(len(lens)) if p < lens[b]], n_pad=1)
    else:  # chunked prefill: random chunks of several sequences per step
        pos = [0] * len(lens)
        while any(p < n for p, n in zip(pos, lens)):
            chunks = []
            for b in range(len(lens)):
                if pos[b] < lens[b] and int(torch.randint(0, 4, (1,), generator=gen)) > 0:
                    c = int(torch.randint(1, 12, (1,), generator=gen))
                    chunks.append((b, pos[b], min(pos[b] + c, lens[b])))
                    pos[b] = chunks[-1][2]
            if chunks:
                run.step(chunks, n_pad=2)


@pytest.mark.parametrize("impl,block_sizes", [("torch", (16, 32)), ("triton", (16, 8))])
def test_prefill_chunked_decode_bitwise(impl, block_sizes, gen, device, inv):
    dev = device if impl == "triton" else "cpu"
    H, G = 4, 2
    seqs = _sequences([29, 1, 18], H, G, torch.bfloat16, gen)
    amax_k = max(float(s["k"].float().abs().max()) for s in seqs)
    amax_v = max(float(s["v"].float().abs().max()) for s in seqs)
    ks = torch.tensor(amax_k / 448 * 0.7)  # the largest keys saturate
    vs = torch.tensor(amax_v / 448)
    runs = {}
    for S in block_sizes:
        for name in ("prefill", "chunked", "decode"):
            run = Fp8Run(seqs, S, G, dev, gen, IMPLS[impl](), ks, vs)
            _run(run, name, gen)
            run.check_cache()
            runs[(name, S)] = run
    base = runs[("prefill", block_sizes[0])]
    for key, run in runs.items():
        for b in range(len(seqs)):
            inv.assert_bitwise(run.out[b], base.out[b], f"{impl} seq {b} {key} vs prefill")
    for b, s in enumerate(seqs):
        # fp64 oracle of the quantize-dequantize math (dense causal attention over the round-tripped K/V)
        kq = write_rule_transcription(s["k"], float(ks)).view(FP8).double() * float(ks)
        vq = write_rule_transcription(s["v"], float(vs)).view(FP8).double() * float(vs)
        exact = dense_causal_attention_reference(s["q"].double(), kq, vq, SCALE)
        torch.testing.assert_close(base.out[b].double(), exact, **BF16_TOL)
    # the FP8 path is really taken: a bf16 cache gives other bits
    plain = IMPLS[impl]()
    s = seqs[0]
    n = s["q"].shape[0]
    kc = torch.zeros(2, 16, G, E, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=dev)
    plain[0](s["k"].to(dev), s["v"].to(dev), kc, vc, torch.arange(n, device=dev))
    o16 = plain[1](s["q"].to(dev), kc, vc, table, torch.zeros(n, dtype=torch.int32, device=dev),
                   torch.arange(n, device=dev), SCALE).cpu()
    assert not torch.equal(o16, base.out[0])


def test_torch_and_triton_write_the_same_codes(gen, device):
    """Both implementations write one rule (their caches are interchangeable)."""
    k = (torch.randn(40, 2, E, generator=gen) * 5).to(torch.bfloat16)
    v = torch.randn(40, 2, E, generator=gen).to(torch.bfloat16)
    ks, vs = torch.tensor(0.0173), torch.tensor(0.0041)
    caches = []
    for impl, dev in (("torch", "cpu"), ("triton", device)):
        kc = torch.zeros(3, 16, 2, E, dtype=FP8, device=dev)
        vc = torch.zeros_like(kc)
        IMPLS[impl]()[0](k.to(dev), v.to(dev), kc, vc, torch.arange(40, device=dev), ks.to(dev), vs.to(dev))
        caches.append((kc.view(torch.uint8).cpu(), vc.view(torch.uint8).cpu()))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


# ----------------------------------------------------------------------------- gradient

def test_gradient_straight_through_the_quantization(gen, inv):
    """Two packed sequences through the differentiable ops (CPU torch implementation):
    values equal the no-grad path bitwise; gradients equal fp64 autograd of dense
    attention at the round-tripped K/V, passed straight through to k and v."""
    H, G, lens = 4, 2, [13, 7]
    t = sum(lens)
    q = torch.randn(t, H, E, generator=gen).to(torch.bfloat16)
    k = (torch.randn(t, G, E, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(t, G, E, generator=gen).to(torch.bfloat16)
    ks, vs = torch.tensor(0.021), torch.tensor(0.0047)
    seq = torch.tensor([0] * lens[0] + [1] * lens[1], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    slots = seq.long() * 16 + pos
    g = torch.randn(t, H, E, generator=gen).to(torch.bfloat16)

    def run(grad: bool):
        kc = torch.zeros(2, 16, G, E, dtype=FP8)
        vc = torch.zeros_like(kc)
        qq, kk, vv = (x.clone().requires_grad_(grad) for x in (q, k, v))
        ops.write_kv_cache(kk, vv, kc, vc, slots, ks, vs)
        o = ops.paged_attention(qq, kc, vc, table, seq, pos, SCALE, ks, vs)
        return o, (qq, kk, vv)

    o_plain, _ = run(False)
    o, leaves = run(True)
    inv.assert_bitwise(o.detach(), o_plain, "values with a graph")
    (o.float() * g.float()).sum().backward()

    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    q64, k64, v64 = ref_leaves
    # STE: forward at the round-tripped values, identity derivative
    kq = k64 + (kv_fp8_roundtrip(k, ks, torch.bfloat16).double() - k64).detach()
    vq = v64 + (kv_fp8_roundtrip(v, vs, torch.bfloat16).double() - v64).detach()
    outs, a = [], 0
    for n in lens:
        outs.append(dense_causal_attention_reference(q64[a:a + n], kq[a:a + n], vq[a:a + n], SCALE))
        a += n
    (torch.cat(outs) * g.double()).sum().backward()
    for name, got, want in zip("qkv", leaves, ref_leaves):
        err = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert err < 1e-2, f"d{name}: relative error {float(err)}"
    # and not the gradient at the unquantized K (the quantization is really in the forward)
    k_plain = k.double().requires_grad_()
    outs, a = [], 0
    for n in lens:
        outs.append(dense_causal_attention_reference(q.double()[a:a + n], k_plain[a:a + n], v.double()[a:a + n],
                                                     SCALE))
        a += n
    (torch.cat(outs) * g.double()).sum().backward()
    assert (leaves[1].grad.double() - k_plain.grad).norm() / k_plain.grad.norm() > \
        2 * (leaves[1].grad.double() - ref_leaves[1].grad).norm() / ref_leaves[1].grad.norm()


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("impl", ["dispatch", "torch", "triton"])
def test_bad_scales_are_refused(impl, device):
    dev = device if impl == "triton" else "cpu"
    if impl == "dispatch":
        from unified_models.ops.attention import paged_attention, write_kv_cache

        write, attend = write_kv_cache, paged_attention
    else:
        write, attend = IMPLS[impl]()
    k = torch.randn(3, 2, E).to(dev)
    kc = torch.zeros(1, 16, 2, E, dtype=FP8, device=dev)
    vc = torch.zeros_like(kc)
    bf = torch.zeros(1, 16, 2, E, dtype=torch.bfloat16, device=dev)
    slots = torch.arange(3, device=dev)
    q = torch.randn(3, 4, E).to(dev)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    idx = torch.zeros(3, dtype=torch.int32, device=dev)
    one = torch.tensor(1.0, device=dev)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write(k, k, kc, vc, slots)
    with pytest.raises(ValueError, match="v_scale is missing"):
        attend(q, kc, vc, table, idx, slots, SCALE, one, None)
    with pytest.raises(ValueError, match="only used with a float8_e4m3fn"):
        write(k, k, bf, bf.clone(), slots, one, one)
    with pytest.raises(ValueError, match="k_cache is torch.float8_e4m3fn but v_cache is torch.bfloat16"):
        write(k, k, kc, bf, slots, one, one)
    with pytest.raises(ValueError, match="one-element fp32"):
        write(k, k, kc, vc, slots, one.to(torch.bfloat16), one)
    with pytest.raises(ValueError, match="one-element fp32"):
        attend(q, kc, vc, table, idx, slots, SCALE, one, torch.ones(2, device=dev))
    if dev == "cpu":  # values are checked where they cost no device sync (CUDA: at load, see engines)
        for bad in (0.0, -0.5, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="k_scale=.* must be finite and > 0"):
                write(k, k, kc, vc, slots, torch.tensor(bad), one)
            with pytest.raises(ValueError, match="v_scale=.* must be finite and > 0"):
                attend(q, kc, vc, table, idx, slots, SCALE, one, torch.tensor(bad))
    # a one-element [1] scale is accepted (vLLM's KVCacheScaleParameter loads [] or [1])
    write(k, k, kc, vc, slots, one.view(1), one)


def test_spec_declares_the_scales():
    a = AttentionSpec(name="m", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, kv_cache_dtype="fp8_e4m3")
    assert a.kv_scale_names() == ("m.k_proj.k_scale", "m.v_proj.v_scale")
    assert a.parameter_shapes()["m.k_proj.k_scale"] == () and a.parameter_shapes()["m.v_proj.v_scale"] == ()
    assert a.parameter_dtypes() == {"m.k_proj.k_scale": torch.float32, "m.v_proj.v_scale": torch.float32}
    plain = AttentionSpec(name="m", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
    assert plain.kv_cache_dtype == "auto" and plain.parameter_dtypes() == {}
    assert not any("scale" in n for n in plain.parameter_shapes())
    with pytest.raises(SpecError, match="m: kv_cache_dtype='fp8'"):
        AttentionSpec(name="m", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, kv_cache_dtype="fp8")


def test_layer_names_a_missing_scale():
    from unified_models.layers.attention import kv_scales

    a = AttentionSpec(name="backbone.layers.3.mixer", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                      kv_cache_dtype="fp8_e4m3")
    with pytest.raises(KeyError, match=r"backbone.layers.3.mixer: FP8 KV cache .*v_proj.v_scale"):
        kv_scales(a, {"backbone.layers.3.mixer.k_proj.k_scale": torch.tensor(1.0)})
