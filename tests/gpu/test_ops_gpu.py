"""Op kernels natively on CUDA (the H200) at realistic sizes.

The interpreter is trivially batch-invariant; the GPU is where the contract
(DESIGN.md rules 1-3, 5, 9, 10) is really tested. Every property is bitwise:
a row/token computed alone, in prefixes ``x[:m]`` (the cuBLAS failure mode),
in random bigger batches, permutations and with padding; attention in one
prefill == chunked prefill == token-by-token decode, for several cache block
sizes and random block tables; CUDA-graph replay == eager. Attention over
~3000-position contexts (several query tiles and KV splits) at the 8B and Nano
widths: prefill == chunked prefill == token-by-token decode, a sequence alone ==
in a batch of 8, a decode step replayed from a CUDA graph (batch 1, 8, 64) ==
eager. Plus kernel vs fp64 oracle within dtype tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_OPS_TESTS = str(Path(__file__).resolve().parents[1] / "ops")
if _OPS_TESTS not in sys.path:
    sys.path.append(_OPS_TESTS)
from invariance import scattered_block_table  # noqa: E402  (tests/ops: shared test helpers)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
T_LIST = (1, 3, 17, 64, 511, 2048)


def _bits(t):
    t = t.detach().contiguous()
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}.get(t.dtype)
    return t.view(view) if view is not None else t


def assert_bitwise(a, b, what=""):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ba, bb = _bits(a), _bits(b)
    if not torch.equal(ba, bb):
        n = int((ba != bb).sum())
        d = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max()
        raise AssertionError(f"{what}: {n}/{ba.numel()} elements differ bitwise (max |diff| {float(d)})")


def check_rows(fn, x, gen, what, pad_scale=50.0):
    """Row invariance of ``fn`` over ``x`` [2048, ...]: prefixes, single rows, permutations, padding."""
    T = x.shape[0]
    full = fn(x)
    for m in T_LIST:
        if m <= T:
            assert_bitwise(fn(x[:m]), full[:m], f"{what} x[:{m}]")
    for i in (0, 1, 777, T - 1):
        assert_bitwise(fn(x[i:i + 1]), full[i:i + 1], f"{what} row {i} alone")
    for trial, (k, n_pad) in enumerate([(5, 12), (100, 411), (1500, 548), (T, 0)]):
        idx = torch.randperm(T, generator=gen)[:k].to(DEV)
        pad = torch.randn((n_pad, *x.shape[1:]), generator=gen).to(DEV).to(x.dtype) * pad_scale
        pad[: n_pad // 2] = 0
        order = torch.randperm(k + n_pad, generator=gen).to(DEV)
        out = fn(torch.cat([x[idx], pad])[order])
        where = torch.argsort(order)[:k]
        assert_bitwise(out[where], full[idx], f"{what} composition {trial} ({k} rows + {n_pad} padding)")
    return full


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2024)


# --------------------------------------------------------------------------- linear

LINEAR_SHAPES = [(4096, 4096), (7168, 2048), (2048, 7168), (4096, 64), (7168, 64)]  # (K, N)


@pytest.mark.parametrize("K,N", LINEAR_SHAPES)
def test_linear_batch_invariant(K, N, gen):
    from unified_models.ops.linear.triton import linear_triton

    x = torch.randn(2048, K, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=gen).to(DEV, torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float32):
        check_rows(lambda a: linear_triton(a, w, b, out_dtype), x, gen, f"linear K={K} N={N} {out_dtype}")


@pytest.mark.parametrize("K", [4096, 5120, 7168])
def test_linear_prefix_rows_equal_full_batch(K, gen):
    """``linear(x[:m]) == linear(x)[:m]`` for small outputs, where cuBLAS bf16 differs on the H200."""
    from unified_models.ops.linear.triton import linear_triton

    x = torch.randn(2048, K, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(64, K, generator=gen).to(DEV, torch.bfloat16)
    full = linear_triton(x, w, None, torch.bfloat16)
    for m in list(range(1, 65)) + [100, 255, 256, 300, 511, 512, 1000]:
        assert_bitwise(linear_triton(x[:m], w, None, torch.bfloat16), full[:m], f"K={K} x[:{m}]")
    cublas = max(float((x[:m] @ w.t() - (x @ w.t())[:m]).abs().max()) for m in (1, 3, 17, 64, 300))
    print(f"K={K}: cuBLAS x[:m]@w vs (x@w)[:m] max |diff| = {cublas} (informational)")


@pytest.mark.parametrize("K,N", [(4096, 4096), (7168, 2048), (7168, 64)])
def test_linear_vs_reference(K, N, gen):
    from unified_models.ops.linear import linear_reference
    from unified_models.ops.linear.triton import linear_triton

    x = torch.randn(511, K, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=gen).to(DEV, torch.bfloat16)
    exact = x.double() @ w.double().t() + b.double()
    out32 = linear_triton(x, w, b, torch.float32)
    torch.testing.assert_close(out32.double(), exact, rtol=1e-4, atol=1e-4)
    out16 = linear_triton(x, w, b, torch.bfloat16)
    torch.testing.assert_close(out16.double(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out16.double(), linear_reference(x, w, b, torch.bfloat16).double(), rtol=1e-2,
                               atol=1e-2)
    assert_bitwise(out16, out32.to(torch.bfloat16), "bf16 out == fp32 out rounded once (RTNE)")


def test_linear_fp32_router(gen):
    """fp32 operands (router GEMM style) use IEEE fp32, batch-invariant."""
    from unified_models.ops.linear.triton import linear_triton

    x = torch.randn(2048, 2048, generator=gen).to(DEV)
    w = torch.randn(256, 2048, generator=gen).to(DEV) / 45.0
    full = check_rows(lambda a: linear_triton(a, w, None, torch.float32), x, gen, "fp32 linear")
    torch.testing.assert_close(full.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


def test_linear_cuda_graph_equals_eager(gen):
    from unified_models.ops.linear.triton import linear_triton

    x = torch.randn(64, 4096, generator=gen).to(DEV, torch.bfloat16)
    w = torch.randn(4096, 4096, generator=gen).to(DEV, torch.bfloat16)
    eager = linear_triton(x, w, None, torch.bfloat16)
    static_x = x.clone()
    linear_triton(static_x, w, None, torch.bfloat16)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = linear_triton(static_x, w, None, torch.bfloat16)
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(static_out, eager, "graph replay vs eager")


# --------------------------------------------------------------------------- rmsnorm / activations / embedding

@pytest.mark.parametrize("D", [2048, 4096, 7168])
def test_rms_norm(D, gen):
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    x = (torch.randn(2048, D, generator=gen) * 3).to(DEV, torch.bfloat16)
    w = (1 + 0.5 * torch.randn(D, generator=gen)).to(DEV, torch.bfloat16)
    full = check_rows(lambda a: rms_norm_triton(a, w, 1e-5, torch.bfloat16), x, gen, f"rms_norm D={D}")
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(full.double(), exact, rtol=1e-2, atol=1e-5)
    out32 = rms_norm_triton(x, w, 1e-5, torch.float32)
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-5)
    assert_bitwise(full, out32.to(torch.bfloat16), "bf16 out == fp32 out rounded once")


@pytest.mark.parametrize("F", [2048, 7168])
def test_activations(F, gen):
    from unified_models.ops.activations.triton import relu2_triton, swiglu_triton

    g = (torch.randn(2048, F, generator=gen) * 4).to(DEV, torch.bfloat16)
    u = (torch.randn(2048, F, generator=gen) * 4).to(DEV, torch.bfloat16)
    r = check_rows(relu2_triton, g, gen, "relu2")
    assert_bitwise(r, torch.relu(g.double()).pow(2).to(torch.bfloat16), "relu2 vs reference")
    gu = torch.stack([g, u], dim=1)
    s = check_rows(lambda a: swiglu_triton(a[:, 0], a[:, 1]), gu, gen, "swiglu")
    exact = g.double() * torch.sigmoid(g.double()) * u.double()
    torch.testing.assert_close(s.double(), exact, rtol=1e-2, atol=1e-4)


def test_embedding(gen):
    from unified_models.ops.embedding.triton import embedding_triton

    w = torch.randn(131072, 4096, generator=gen).to(DEV, torch.bfloat16)
    ids = torch.randint(0, 131072, (2048,), generator=gen).to(DEV)
    full = check_rows(lambda i: embedding_triton(i, w), ids, gen, "embedding", pad_scale=0)
    assert_bitwise(full, w[ids], "embedding vs reference")


# --------------------------------------------------------------------------- logprobs

@pytest.mark.parametrize("V", [32064, 131072])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs(V, temperature, gen):
    from unified_models.ops.logprob.triton import logprobs_triton

    x = (torch.randn(2048, V, generator=gen) * 4).to(DEV)
    full = check_rows(lambda a: logprobs_triton(a, temperature), x, gen, f"logprobs V={V}")
    exact = torch.log_softmax(x.double() / temperature, dim=-1)
    torch.testing.assert_close(full.double(), exact, rtol=1e-5, atol=1e-4)
    xb = x[:64].to(torch.bfloat16)
    torch.testing.assert_close(logprobs_triton(xb, temperature).double(),
                               torch.log_softmax(xb.double() / temperature, -1), rtol=1e-5, atol=1e-4)
    # temperature is one IEEE fp32 division, the same as torch's x / t
    q = x[:64] / torch.tensor(temperature, dtype=torch.float32, device=DEV)
    assert_bitwise(full[:64], logprobs_triton(q, 1.0), "IEEE fp32 temperature division")


# --------------------------------------------------------------------------- attention

H, G, E = 32, 8, 128
SCALE = E ** -0.5
LENGTHS = [1, 3, 17, 64, 511, 2048]


class Paged:
    """A paged cache (random block permutation, block size S; K/V strided views of one
    NaN-filled allocation) and the per-token outputs of a schedule of steps."""

    def __init__(self, seqs, S, gen):
        from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

        self.write, self.attend = write_kv_cache_triton, paged_attention_triton
        self.seqs, self.S, self.gen = seqs, S, gen
        self.lens = [s["q"].shape[0] for s in seqs]
        self.offsets = torch.tensor([0] + self.lens).cumsum(0).tolist()
        self.q = torch.cat([s["q"] for s in seqs])
        self.k = torch.cat([s["k"] for s in seqs])
        self.v = torch.cat([s["v"] for s in seqs])
        need = [-(-n // S) for n in self.lens]
        nb = sum(need) + 7
        self.buf = torch.full((nb, 2, S, G, E), float("nan"), dtype=torch.bfloat16, device=DEV)
        self.k_cache, self.v_cache = self.buf[:, 0], self.buf[:, 1]
        self.bt = scattered_block_table(need, nb, gen, max(need) + 3).to(DEV)  # stale ids past the ends
        self.out = torch.full_like(self.q, float("nan"))

    def step(self, chunks, n_pad=0):
        seq = torch.cat([torch.full((e - s,), b) for b, s, e in chunks] + [torch.zeros(n_pad, dtype=torch.int64)])
        pos = torch.cat([torch.arange(s, e) for _, s, e in chunks] + [torch.full((n_pad,), -1)])
        order = torch.randperm(seq.shape[0], generator=self.gen)
        seq, pos = seq[order].to(DEV), pos[order].to(DEV)
        real = pos >= 0
        flat = torch.tensor(self.offsets, device=DEV)[seq] + pos.clamp(min=0)
        junk = lambda *s: (torch.randn(*s, generator=self.gen) * 100).to(DEV, torch.bfloat16)  # noqa: E731
        n = seq.shape[0]
        q = torch.where(real[:, None, None], self.q[flat], junk(n, H, E))
        k = torch.where(real[:, None, None], self.k[flat], junk(n, G, E))
        v = torch.where(real[:, None, None], self.v[flat], junk(n, G, E))
        slots = torch.where(real, self.bt[seq, pos.clamp(min=0) // self.S].long() * self.S + pos % self.S, -1)
        self.write(k, v, self.k_cache, self.v_cache, slots)
        o = self.attend(q, self.k_cache, self.v_cache, self.bt, seq.int(), pos, SCALE)
        self.out[flat[real]] = o[real]
        assert (o[~real] == 0).all()

    def prefill(self):
        self.step([(b, 0, n) for b, n in enumerate(self.lens)], n_pad=13)

    def chunked(self):
        pos = [0] * len(self.lens)
        while any(p < n for p, n in zip(pos, self.lens)):
            chunks = []
            for b, n in enumerate(self.lens):
                if pos[b] < n and int(torch.randint(0, 4, (1,), generator=self.gen)):
                    c = int(torch.randint(1, 300, (1,), generator=self.gen))
                    chunks.append((b, pos[b], min(n, pos[b] + c)))
                    pos[b] = chunks[-1][2]
            if chunks:
                self.step(chunks, n_pad=int(torch.randint(0, 9, (1,), generator=self.gen)))

    def decode(self, prefix):
        """Prefill the first ``prefix`` tokens of each sequence, then decode the rest one by one."""
        self.step([(b, 0, min(prefix, n)) for b, n in enumerate(self.lens)], n_pad=2)
        for p in range(prefix, max(self.lens)):
            self.step([(b, p, p + 1) for b, n in enumerate(self.lens) if p < n], n_pad=1)


@pytest.fixture(scope="module")
def attn_seqs():
    gen = torch.Generator().manual_seed(7)
    return [dict(q=torch.randn(n, H, E, generator=gen).to(DEV, torch.bfloat16),
                 k=(torch.randn(n, G, E, generator=gen) * 2).to(DEV, torch.bfloat16),
                 v=torch.randn(n, G, E, generator=gen).to(DEV, torch.bfloat16)) for n in LENGTHS]


def test_attention_prefill_chunked_decode_block_sizes(attn_seqs, gen):
    base = Paged(attn_seqs, 16, gen)
    base.prefill()
    assert torch.isfinite(base.out).all()
    runs = {}
    for S in (16, 32, 64):
        for mode in ("prefill", "chunked", "decode"):
            r = Paged(attn_seqs, S, gen)
            if mode == "prefill":
                r.prefill()
            elif mode == "chunked":
                r.chunked()
            else:
                r.decode(prefix=1500)  # the 2048-token sequence decodes its last 548 tokens
            runs[(mode, S)] = r
            assert_bitwise(r.out, base.out, f"attention {mode} S={S} vs prefill S=16")
    full_decode = Paged(attn_seqs[:5], 16, gen)  # every token of the shorter sequences one by one
    full_decode.decode(prefix=0)
    assert_bitwise(full_decode.out, base.out[: full_decode.out.shape[0]], "full token-by-token decode")


def test_attention_prefill_launch_never_syncs(attn_seqs, gen):
    """An eager prefill/chunked batch (contiguous runs, as vLLM sends them) queues the tile
    schedule, partial and merge kernels without any device-to-host read: the grid comes
    from host-known shapes, so vLLM's async scheduling keeps overlapping host and GPU.
    The same batch under the default grid and with programs capped to 7 (each walks many
    tiles) gives the same bits."""
    from unified_models.ops.attention.triton import AttentionLaunch, paged_attention_triton

    run = Paged(attn_seqs, 16, gen)
    run.prefill()
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(LENGTHS)]).to(DEV).int()
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).to(DEV)
    q = torch.randn(seq.shape[0], H, E, generator=gen).to(DEV, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_attention_triton(q, run.k_cache, run.v_cache, run.bt, seq, pos, SCALE)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    capped = paged_attention_triton(q, run.k_cache, run.v_cache, run.bt, seq, pos, SCALE,
                                    launch=AttentionLaunch(max_programs=7))
    assert_bitwise(capped, out, "attention with 7 programs per chunk vs the default grid")


def test_attention_vs_reference(attn_seqs, gen):
    from unified_models.ops.attention import dense_causal_attention_reference

    run = Paged(attn_seqs, 16, gen)
    run.prefill()
    for b, s in enumerate(attn_seqs):
        exact = dense_causal_attention_reference(s["q"].double(), s["k"].double(), s["v"].double(), SCALE)
        got = run.out[run.offsets[b]:run.offsets[b + 1]]
        torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)


def test_attention_cuda_graph_equals_eager(attn_seqs, gen):
    run = Paged(attn_seqs, 16, gen)
    run.prefill()
    T = 64
    seq = torch.randint(0, len(LENGTHS), (T,), generator=gen)
    pos = torch.tensor([int(torch.randint(0, LENGTHS[b], (1,), generator=gen)) for b in seq])
    seq, pos = seq.to(DEV).int(), pos.to(DEV)
    q = torch.randn(T, H, E, generator=gen).to(DEV, torch.bfloat16)
    eager = run.attend(q, run.k_cache, run.v_cache, run.bt, seq, pos, SCALE)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = run.attend(q, run.k_cache, run.v_cache, run.bt, seq, pos, SCALE)
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(static_out, eager, "attention graph replay vs eager")


# --------------------------------------------------------------------------- attention: query tiles and KV splits
#
# The read path runs query tiles (consecutive tokens of one sequence x the q heads of one kv head)
# over KV splits of SPLIT_KV = 1024 absolute positions, merged in a second kernel. Contexts of
# ~3000 positions cross two split edges; every property is bitwise, at the 8B widths (32 q / 8 kv
# heads) and the Nano widths (32 q / 2 kv heads), head dim 128, bf16.

LONG = 3000
WIDTHS = {"8b": (32, 8), "nano": (32, 2)}


def _seqs(lengths, Hq, Gk, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [dict(q=torch.randn(n, Hq, E, generator=gen, device=DEV).to(torch.bfloat16),
                 k=(torch.randn(n, Gk, E, generator=gen, device=DEV) * 2).to(torch.bfloat16),
                 v=torch.randn(n, Gk, E, generator=gen, device=DEV).to(torch.bfloat16)) for n in lengths]


class FlatPaged:
    """A bf16 paged cache for ``seqs`` (random block permutation, block size S, K/V strided views of
    one NaN-filled allocation, stale block-table entries) and steps given as flat token lists;
    ``launch``: the :class:`AttentionLaunch` every step uses (None: the default)."""

    def __init__(self, seqs, S, gen, launch=None):
        from functools import partial

        from unified_models.ops.attention.triton import paged_attention_triton, write_kv_cache_triton

        self.write, self.attend = write_kv_cache_triton, partial(paged_attention_triton, launch=launch)
        self.seqs, self.S, self.gen = seqs, S, gen
        self.lens = [s["q"].shape[0] for s in seqs]
        self.offsets = torch.tensor([0] + self.lens).cumsum(0).to(DEV)
        self.q, self.k, self.v = (torch.cat([s[n] for s in seqs]) for n in "qkv")
        self.Hq, self.Gk = self.q.shape[1], self.k.shape[1]
        need = [-(-n // S) for n in self.lens]
        nb = sum(need) + 5
        self.buf = torch.full((nb, 2, S, self.Gk, E), float("nan"), dtype=torch.bfloat16, device=DEV)
        self.k_cache, self.v_cache = self.buf[:, 0], self.buf[:, 1]
        self.bt = scattered_block_table(need, nb, gen, max(need) + 3).to(DEV)  # stale ids past the ends
        self.out = torch.full_like(self.q, float("nan"))

    def step(self, seq, pos):
        """``seq``/``pos``: int64 [T] (on any device), ``pos < 0`` = padding token."""
        seq, pos = seq.to(DEV), pos.to(DEV)
        real = pos >= 0
        flat = self.offsets[seq] + pos.clamp(min=0)
        n = seq.shape[0]
        junk = lambda *s: (torch.randn(*s, generator=self.gen) * 100).to(DEV, torch.bfloat16)  # noqa: E731
        q = torch.where(real[:, None, None], self.q[flat], junk(n, self.Hq, E))
        k = torch.where(real[:, None, None], self.k[flat], junk(n, self.Gk, E))
        v = torch.where(real[:, None, None], self.v[flat], junk(n, self.Gk, E))
        slots = torch.where(real, self.bt[seq, pos.clamp(min=0) // self.S].long() * self.S + pos % self.S, -1)
        self.write(k, v, self.k_cache, self.v_cache, slots)
        o = self.attend(q, self.k_cache, self.v_cache, self.bt, seq.int(), pos, SCALE)
        self.out[flat[real]] = o[real]
        assert bool((o[~real] == 0).all()), "padding tokens must give zeros"
        return o

    def run(self, chunks, n_pad=0):
        """One step of ``chunks`` = [(seq, start, end)] in this order, then ``n_pad`` padding tokens."""
        seq = torch.cat([torch.full((e - s,), b) for b, s, e in chunks] + [torch.zeros(n_pad, dtype=torch.int64)])
        pos = torch.cat([torch.arange(s, e) for _, s, e in chunks] + [torch.full((n_pad,), -1)])
        return self.step(seq, pos)

    def token(self, b):
        return self.out[int(self.offsets[b]):int(self.offsets[b + 1])]


def test_attention_constants_are_model_constants():
    from unified_models.ops.attention import triton as tri

    assert tri.SPLIT_KV == 1024 and tri.BLOCK_KV == 64 and tri.SPLIT_KV % tri.BLOCK_KV == 0
    assert tri.tile_shape(32, 8) == (4, 64, 16) and tri.tile_shape(32, 2) == (16, 64, 4)


@pytest.mark.parametrize("width", list(WIDTHS))
def test_attention_long_context_prefill_chunked_decode(width, gen):
    """One ~3000-token sequence: prefill in one call == chunked prefill cut at 1, 63, 64, 1000,
    1025 (one cut at a time, and all at once) == decode token by token from position 0."""
    Hq, Gk = WIDTHS[width]
    seqs = _seqs([LONG], Hq, Gk, seed=11)
    base = FlatPaged(seqs, 16, gen)
    base.run([(0, 0, LONG)], n_pad=5)
    assert bool(torch.isfinite(base.out).all())
    cut_sets = [(c,) for c in (1, 63, 64, 1000, 1025)] + [(1, 63, 64, 1000, 1025)]
    for cuts in cut_sets:
        r = FlatPaged(seqs, 32, gen)
        bounds = [0, *cuts, LONG]
        for a, b in zip(bounds[:-1], bounds[1:]):
            r.run([(0, a, b)], n_pad=int(torch.randint(0, 4, (1,), generator=gen)))
        assert_bitwise(r.out, base.out, f"{width}: chunked at {cuts} vs prefill")
    d = FlatPaged(seqs, 16, gen)
    for p in range(LONG):
        d.step(torch.tensor([0]), torch.tensor([p]))
    assert_bitwise(d.out, base.out, f"{width}: token-by-token decode vs prefill")
    from unified_models.ops.attention import dense_causal_attention_reference

    s = seqs[0]
    exact = dense_causal_attention_reference(s["q"].double(), s["k"].double(), s["v"].double(), SCALE)
    torch.testing.assert_close(base.out.double(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("width", list(WIDTHS))
def test_attention_long_context_batch_composition(width, gen):
    """The same ~3000-token sequence alone == with 7 other sequences of other lengths (before and
    after it, padding between), in prefill and in decode steps at positions around the split edges."""
    Hq, Gk = WIDTHS[width]
    others = [17, 500, 1023, 1025, 2048, 2999, 3500]
    seqs = _seqs([LONG] + others, Hq, Gk, seed=12)
    alone = FlatPaged(seqs, 16, gen)
    alone.run([(0, 0, LONG)])
    for trial in range(2):
        mixed = FlatPaged(seqs, 16 * (trial + 1), gen)
        order = torch.randperm(len(seqs), generator=gen).tolist()
        seq = torch.cat([torch.full((seqs[b]["q"].shape[0],), b) for b in order])
        pos = torch.cat([torch.arange(seqs[b]["q"].shape[0]) for b in order])
        for _ in range(9):  # padding tokens at random places
            i = int(torch.randint(0, seq.shape[0] + 1, (1,), generator=gen))
            seq = torch.cat([seq[:i], torch.zeros(1, dtype=torch.int64), seq[i:]])
            pos = torch.cat([pos[:i], torch.full((1,), -1), pos[i:]])
        mixed.step(seq, pos)
        assert_bitwise(mixed.token(0), alone.token(0), f"{width}: prefill alone vs in a batch of 8 ({trial})")
        # decode steps: sequence 0 at a few positions, with the others at random positions
        for p in (0, 1023, 1024, 2047, 2048, LONG - 1):
            want = alone.out[p:p + 1]
            for n_others in (0, 7):
                bs = [0] + torch.randperm(len(others), generator=gen)[:n_others].add(1).tolist()
                ps = [p] + [int(torch.randint(0, seqs[b]["q"].shape[0], (1,), generator=gen)) for b in bs[1:]]
                perm = torch.randperm(len(bs), generator=gen).tolist()
                s_t = torch.tensor([bs[i] for i in perm] + [0])
                p_t = torch.tensor([ps[i] for i in perm] + [-1])
                o = mixed.attend(mixed.q[mixed.offsets[s_t.to(DEV)] + p_t.to(DEV).clamp(min=0)], mixed.k_cache,
                                 mixed.v_cache, mixed.bt, s_t.to(DEV).int(), p_t.to(DEV), SCALE)
                where = perm.index(0)
                assert_bitwise(o[where:where + 1], want, f"{width}: decode p={p} with {n_others} others")


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("S", [16, 64])
def test_attention_cuda_graph_decode_step_long(width, batch, S, gen):
    """A decode step captured in a CUDA graph (static q/seq_idx/positions buffers, no host sync in
    the capture) and replayed with new contents (positions across 1-3 splits, padding) == eager;
    block size 16 (pointer-gathered K/V tiles) and 64 (TMA K/V tiles, ``kv_tma=True``)."""
    from functools import partial

    from unified_models.ops.attention.triton import AttentionLaunch
    from unified_models.ops.attention.triton import paged_attention_triton as attend

    paged_attention_triton = partial(attend, launch=AttentionLaunch(kv_tma=True)) if S == 64 else attend

    Hq, Gk = WIDTHS[width]
    n_seq = 64
    lens = torch.randint(1, LONG + 1, (n_seq,), generator=gen)
    lens[:4] = torch.tensor([LONG, 1024, 1025, 2049])
    need = (lens + S - 1) // S
    nb = int(need.sum()) + 3
    g_dev = torch.Generator(device=DEV).manual_seed(5)
    buf = torch.randn((nb, 2, S, Gk, E), generator=g_dev, device=DEV).to(torch.bfloat16)
    k_cache, v_cache = buf[:, 0], buf[:, 1]
    bt = torch.randint(0, nb, (n_seq, int(need.max()) + 2), generator=gen, dtype=torch.int32)
    perm = torch.randperm(nb, generator=gen)
    used = 0
    for b in range(n_seq):
        n = int(need[b])
        bt[b, :n] = perm[used:used + n].int()
        used += n
    bt = bt.to(DEV)

    def inputs():
        seq = torch.randperm(n_seq, generator=gen)[:batch]
        pos = torch.stack([torch.randint(0, int(lens[b]), (1,), generator=gen)[0] for b in seq])
        if batch > 1:
            pos[-1] = -1  # a padding token
        q = torch.randn(batch, Hq, E, generator=gen).to(DEV, torch.bfloat16)
        return q, seq.to(DEV, torch.int32), pos.to(DEV)

    q_s, seq_s, pos_s = inputs()
    paged_attention_triton(q_s, k_cache, v_cache, bt, seq_s, pos_s, SCALE)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_s = paged_attention_triton(q_s, k_cache, v_cache, bt, seq_s, pos_s, SCALE)
    for trial in range(4):
        q, seq, pos = inputs()
        if trial == 0:  # the longest contexts (3 splits) in the batch
            seq[: min(batch, 4)] = torch.arange(min(batch, 4), device=DEV, dtype=torch.int32)
            pos[: min(batch, 4)] = lens[:min(batch, 4)].to(DEV) - 1
        q_s.copy_(q)
        seq_s.copy_(seq)
        pos_s.copy_(pos)
        g.replay()
        torch.cuda.synchronize()
        eager = paged_attention_triton(q.clone(), k_cache, v_cache, bt, seq.clone(), pos.clone(), SCALE)
        assert_bitwise(out_s, eager, f"{width} batch {batch}: graph replay {trial} vs eager")
        real = pos >= 0
        assert bool(torch.isfinite(out_s[real]).all()) and bool((out_s[~real] == 0).all())


@pytest.mark.parametrize("width", list(WIDTHS))
def test_attention_kv_tma_equals_pointer_gathers(width, gen):
    """K/V tiles read by TMA (block size a multiple of BLOCK_KV) give the bits of the
    per-position pointer gathers: a prefill, chunked prefill and decode run of a ~3000-token
    sequence and 7 others at block sizes 64 and 128 (NaN-filled cache, stale block ids) equal the
    block-size-16 run, and one mixed decode + prefill step with ``kv_tma`` forced on and off is
    bitwise equal (forcing it on raises if TMA did not apply, so both paths really ran)."""
    from unified_models.ops.attention.triton import AttentionLaunch, paged_attention_triton

    Hq, Gk = WIDTHS[width]
    lens = [LONG, 17, 64, 500, 1023, 1025, 2048, 2111]
    seqs = _seqs(lens, Hq, Gk, seed=13)
    base = FlatPaged(seqs, 16, gen)
    base.run([(b, 0, n) for b, n in enumerate(lens)], n_pad=3)
    assert bool(torch.isfinite(base.out).all())
    tma = AttentionLaunch(kv_tma=True)
    for S in (64, 128):
        pre = FlatPaged(seqs, S, gen, launch=tma)
        pre.run([(b, 0, n) for b, n in enumerate(lens)][::-1], n_pad=2)
        assert_bitwise(pre.out, base.out, f"{width}: TMA prefill S={S} vs pointer S=16")
        dec = FlatPaged(seqs, S, gen, launch=tma)  # prefill up to 1000 (or the end), then cut at 1700, then decode
        dec.run([(b, 0, min(n, 1000)) for b, n in enumerate(lens)])
        dec.run([(b, 1000, min(n, 1700)) for b, n in enumerate(lens) if n > 1000], n_pad=1)
        for p in range(1700, max(lens)):
            live = [b for b, n in enumerate(lens) if p < n]
            dec.step(torch.tensor(live), torch.full((len(live),), p))
        assert_bitwise(dec.out, base.out, f"{width}: TMA chunked + decode S={S} vs pointer S=16")
        seq = torch.tensor([0, 6, 7, 3] + [1] * 17 + [0]).to(DEV).int()
        pos = torch.tensor([LONG - 1, 2047, 1024, 499] + list(range(17)) + [-1]).to(DEV)
        q = dec.q[dec.offsets[seq.long()] + pos.clamp(min=0)]
        on = paged_attention_triton(q, dec.k_cache, dec.v_cache, dec.bt, seq, pos, SCALE,
                                    launch=AttentionLaunch(kv_tma=True))
        off = paged_attention_triton(q, dec.k_cache, dec.v_cache, dec.bt, seq, pos, SCALE,
                                     launch=AttentionLaunch(kv_tma=False))
        assert_bitwise(on, off, f"{width}: kv_tma on vs off, S={S}")
        assert_bitwise(on[:-1], torch.cat([base.out[base.offsets[b] + p:base.offsets[b] + p + 1]
                                           for b, p in zip(seq[:-1].tolist(), pos[:-1].tolist())]),
                       f"{width}: mixed step vs prefill")
    with pytest.raises(ValueError, match="kv_tma=True"):  # block size 16: no TMA, and it says so
        paged_attention_triton(q, base.k_cache, base.v_cache, base.bt, seq, pos, SCALE,
                               launch=AttentionLaunch(kv_tma=True))


# --------------------------------------------------------------------------- rope

def test_rope(gen):
    from unified_models.ops.rope import apply_rope, apply_rope_reference, rope_cos_sin

    x = torch.randn(2048, 32, 128, generator=gen).to(DEV).bfloat16()
    pos = torch.randint(0, 4096, (2048,), generator=gen).to(DEV)
    cos, sin = rope_cos_sin(4096, 64, 10000.0, DEV)
    full = apply_rope(x, pos, cos, sin)
    for m in (1, 3, 17, 511):
        assert_bitwise(apply_rope(x[:m], pos[:m], cos, sin), full[:m], f"rope x[:{m}]")
    perm = torch.randperm(2048, generator=gen).to(DEV)
    assert_bitwise(apply_rope(x[perm], pos[perm], cos, sin), full[perm], "rope permuted")
    assert_bitwise(apply_rope(x[7:8], pos[7:8], cos, sin), full[7:8], "rope row alone")
    ref = apply_rope_reference(x.cpu(), pos.cpu(), 64, 10000.0).float()
    assert (full.float().cpu() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


# --------------------------------------------------------------------------- linear tiers

# Weight shapes [N, K] of the bundled presets: the dense bench widths and the Nano
# widths (hidden 2688; the 131072-wide LM head is replaced by a 32064-wide one).
TIER_SHAPES = [(4096, 4096, torch.bfloat16), (1024, 4096, torch.bfloat16), (21504, 4096, torch.bfloat16),
               (4096, 21504, torch.bfloat16), (32064, 4096, torch.float32),
               (4096, 2688, torch.bfloat16), (2688, 4096, torch.bfloat16), (1856, 2688, torch.bfloat16),
               (2688, 1856, torch.bfloat16), (32064, 2688, torch.float32)]  # (N, K, out dtype)
TIER_ROWS = (1, 63, 64, 65, 300, 513, 1000)


def _tier_input(T, K, gen):
    x = torch.randn(T, K, generator=gen)
    big = torch.randperm(T, generator=gen)[: max(1, T // 50)]
    x[big] *= 300.0  # a few large-magnitude rows
    return x.to(DEV, torch.bfloat16)


@pytest.mark.parametrize("N,K,out_dtype", TIER_SHAPES)
def test_linear_tiers_give_identical_bits(N, K, out_dtype, gen):
    """Every GPU tier of ``gemm_config`` gives the same bits (what batch invariance rests on).

    ``linear_triton`` picks its tile config by the number of rows (``GPU_TIERS``); a
    row's bits are only independent of the batch if all tiers agree bit for bit.
    A new tier must pass this test.
    """
    from unified_models.ops.linear.triton import FP32_OUT_LAST_TIER, GPU_TIERS, gemm_config, linear_triton

    tiers = [cfg for _, cfg in GPU_TIERS]
    if out_dtype == torch.float32:  # (a 128x256 fp32 output tile does not fit in shared memory)
        tiers[-1] = FP32_OUT_LAST_TIER
    # each tier as the model runs it (TMA loads) and with masked pointer loads (the fallback
    # for operands TMA cannot address), all against the first tier
    configs = tiers + [cfg._replace(tma=False, persistent=False) for cfg in tiers]
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=gen).to(DEV, torch.bfloat16)
    for T in TIER_ROWS:
        x = _tier_input(T, K, gen)
        ref = linear_triton(x, w, b, out_dtype, config=configs[0])
        for cfg in configs[1:]:
            assert_bitwise(linear_triton(x, w, b, out_dtype, config=cfg), ref,
                           f"[{N},{K}] T={T} {tuple(cfg)} vs {tuple(configs[0])}")
        assert_bitwise(linear_triton(x, w, b, out_dtype), ref, f"[{N},{K}] T={T} default {gemm_config(N, K, T)}")
    # Rows of a large batch (last tier) == the same rows alone (first tier) and in a
    # T=40 batch (first tier) and in a T=300 batch (middle tier), through the default path.
    x = _tier_input(2000, K, gen)
    full = linear_triton(x, w, b, out_dtype)
    for i in (0, 1, 517, 1999):
        assert_bitwise(linear_triton(x[i:i + 1], w, b, out_dtype), full[i:i + 1], f"[{N},{K}] row {i} alone")
    idx = torch.randperm(2000, generator=gen)[:40].to(DEV)
    assert_bitwise(linear_triton(x[idx], w, b, out_dtype), full[idx], f"[{N},{K}] 40 rows in a T=40 batch")
    idx = torch.randperm(2000, generator=gen)[:300].to(DEV)
    assert_bitwise(linear_triton(x[idx], w, b, out_dtype), full[idx], f"[{N},{K}] 300 rows in a T=300 batch")


def test_linear_tiers_give_identical_bits_fp32_operands(gen):
    """fp32 operands (router GEMM, IEEE dot) give the same bits in every fp32-operand tier too."""
    from unified_models.ops.linear.triton import FP32_OPERAND_TIERS, linear_triton

    w = torch.randn(128, 2688, generator=gen).to(DEV) / 50.0
    for T in TIER_ROWS:
        x = torch.randn(T, 2688, generator=gen).to(DEV)
        outs = [linear_triton(x, w, None, torch.float32, config=cfg) for _, cfg in FP32_OPERAND_TIERS]
        for cfg, out in zip(FP32_OPERAND_TIERS[1:], outs[1:]):
            assert_bitwise(out, outs[0], f"fp32 operands T={T} {tuple(cfg[1])}")
