"""Mamba-2 ops: causal conv1d, dt, SSD chunked scan, gated RMSNorm.

Both forward implementations run every test: the CPU torch path and the Triton
kernels through the interpreter (``UM_OPS_BACKEND=triton``). Checked:

* bitwise, per implementation, at every position of every sequence: full
  prefill (sequences in random order, padding sequences and padding rows)
  == training (no state) == chunked prefill split at random points (chunks of
  1, 2 and 3 tokens, shorter than the conv width, included) == token-by-token
  decode (every position inside a chunk re-executed from the boundary state and
  the cached rows) == prefill of a prefix then decode; the final states
  (conv rows, boundary state, pending rows) are bitwise equal too. State slots
  are a random permutation, filled with stale NaN before first use;
* each op against its fp64 reference, within the tolerances below;
* the composed mixer (in_proj, our four ops, out_proj) against transformers'
  ``NemotronHMamba2Mixer`` torch path in fp32;
* gradients against fp64 autograd of the references, also for a continuation
  over cached state (treated as constant).

Tolerances (|ours - fp64 ref| <= atol + rtol |ref|): fp32 inputs: scan output
1e-5/1e-5, conv/norm/dt 1e-6/1e-5; bf16 inputs: ops whose output is bf16 one
bf16 rounding (rtol 4e-3 > 2^-8), the fp32 scan output 1e-5/1e-5 on the same bf16
inputs. Peer (transformers fp32): 2e-5/1e-4. Gradients: relative L2 error
1e-5 (fp32) / 4e-3 (bf16), as tests/ops/test_autograd.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from unified_models import ops
from unified_models.ops import Mamba2State, StaleWeightError, bump_weight_version, mamba2_metadata
from unified_models.ops.mamba2 import (causal_conv1d_reference, gated_rms_norm_reference, mamba2_dt_reference,
                                       ssd_chunked_torch, ssd_chunked_torch_batched, ssd_reference,
                                       start_positions)

H, P, G, N, Q, W = 4, 8, 2, 16, 8, 4
F_ = H * P
CD = F_ + 2 * G * N
EPS = 1e-5
LIMIT = (0.0, math.inf)
BACKENDS = ["torch", "triton"]
LENGTHS = [21, 1, 8, 11, 4]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, device):
    if request.param == "triton" and device == "cuda":
        pytest.skip("CPU tensors here; the CUDA kernels run in tests/gpu")
    monkeypatch.setenv("UM_OPS_BACKEND", request.param)
    return request.param


class Params:
    def __init__(self, dtype, gen):
        self.conv_w = (torch.randn(CD, W, generator=gen) * 0.4).to(dtype)
        self.conv_b = (torch.randn(CD, generator=gen) * 0.1).to(dtype)
        # dt_bias as transformers/mamba_ssm initialise it: inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(dtype)
        self.A_log = torch.log(torch.arange(1, H + 1, dtype=torch.float32)).to(dtype)
        self.D = (1.0 + 0.1 * torch.randn(H, generator=gen)).to(dtype)
        self.norm_w = (1.0 + 0.1 * torch.randn(F_, generator=gen)).to(dtype)


def _seqs(lengths, dtype, gen):
    return [dict(xin=torch.randn(n, CD, generator=gen).to(dtype),
                 dt=(torch.randn(n, H, generator=gen) * 1.5).to(dtype),
                 z=torch.randn(n, F_, generator=gen).to(dtype)) for n in lengths]


def mixer_core(prm, xin, dtraw, z, meta, state):
    """conv -> split -> dt -> scan -> gated norm, as the layer will call them."""
    T = xin.shape[0]
    xbc = ops.causal_conv1d(xin, prm.conv_w, prm.conv_b, meta, state)
    x, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
    dt = ops.mamba2_dt(dtraw, prm.dt_bias, LIMIT)
    y = ops.ssd_chunk_scan(x.view(T, H, P), dt, prm.A_log, Bm.view(T, G, N), Cm.view(T, G, N), prm.D, meta, state)
    o = ops.gated_rms_norm(y.view(T, F_), z, prm.norm_w, F_ // G, EPS)
    return dict(xbc=xbc, dt=dt, y=y.view(T, F_), o=o)


class Run:
    """One state cache (random slots, stale NaN) and a schedule of steps over ``seqs``."""

    def __init__(self, seqs, prm, dtype, gen, stateful=True):
        self.seqs, self.prm, self.dtype, self.gen = seqs, prm, dtype, gen
        n = len(seqs)
        self.state = (Mamba2State.allocate(n + 3, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W,
                                           chunk_size=Q, dtype=dtype, fill=float("nan")) if stateful else None)
        self.slots = torch.randperm(n + 3, generator=gen)[:n].tolist()
        self.pos = [0] * n
        self.out = [{k: None for k in ("xbc", "dt", "y", "o")} for _ in seqs]

    def junk(self, n):
        j = lambda *s: (torch.randn(*s, generator=self.gen) * 50).to(self.dtype)  # noqa: E731
        return dict(xin=j(n, CD), dt=j(n, H), z=j(n, F_))

    def step(self, chunks, pad_seqs=0, pad_rows=0, decode_meta=False):
        """``chunks`` = [(seq, n_tokens)]; plus padding sequences (slot -1) and trailing padding rows.
        ``decode_meta``: a decode step (every chunk one token) described by ``mamba2_decode_metadata``
        (its padding sequences have no rows, as vLLM pads a decode batch)."""
        parts = [(b, self.pos[b], self.pos[b] + c) for b, c in chunks]
        if self.state is not None:
            parts += [(-1, 0 if decode_meta else int(torch.randint(0, 7, (1,), generator=self.gen)), None)
                      for _ in range(pad_seqs)]
        order = torch.randperm(len(parts), generator=self.gen).tolist()
        parts = [parts[i] for i in order]
        rows, cu, p0, slots = {"xin": [], "dt": [], "z": []}, [0], [], []
        for b, s, e in parts:
            if b >= 0:
                src = {k: self.seqs[b][k][s:e] for k in rows}
                p0.append(s)
                slots.append(self.slots[b])
            else:
                src = self.junk(s)
                p0.append(int(torch.randint(0, 40, (1,), generator=self.gen)))
                slots.append(-1)
            for k in rows:
                rows[k].append(src[k])
            cu.append(cu[-1] + src["xin"].shape[0])
        tail = self.junk(pad_rows)
        for k in rows:
            rows[k].append(tail[k])
        batch = {k: torch.cat(v) for k, v in rows.items()}
        T = batch["xin"].shape[0]
        if decode_meta:
            meta = ops.mamba2_decode_metadata(torch.tensor(cu), torch.tensor(p0), torch.tensor(slots), Q, T)
        else:
            meta = mamba2_metadata(torch.tensor(cu), torch.tensor(p0), Q, num_tokens=T,
                                   state_idx_B=torch.tensor(slots) if self.state is not None else None)
        res = mixer_core(self.prm, batch["xin"], batch["dt"], batch["z"], meta, self.state)
        real = torch.zeros(T, dtype=torch.bool)
        for i, (b, s, e) in enumerate(parts):
            if b < 0:
                continue
            real[cu[i]:cu[i + 1]] = True
            for k, v in res.items():
                cur = self.out[b][k]
                self.out[b][k] = v[cu[i]:cu[i + 1]].clone() if cur is None else torch.cat([cur, v[cu[i]:cu[i + 1]]])
            self.pos[b] = e
        for k in ("xbc", "y", "o"):
            assert (res[k][~real] == 0).all(), f"padding rows of {k} are not zero"
        return res

    def final_state(self, b):
        """The meaningful part of sequence b's state (what a later call may read)."""
        s, L = self.slots[b], self.pos[b]
        st = self.state
        d = dict(conv=st.conv[s, max(0, W - 1 - L):].clone(), x=st.x[s, :L % Q].clone(), dt=st.dt[s, :L % Q].clone(),
                 B=st.B[s, :L % Q].clone())
        if L >= Q:
            d["ssm"] = st.ssm[s].clone()
        return d


def _prefill(run):
    run.step([(b, s["xin"].shape[0]) for b, s in enumerate(run.seqs)], pad_seqs=2, pad_rows=3)


def _chunked(run, sizes=(1, 2, 3, 5, 9, 17)):
    lens = [s["xin"].shape[0] for s in run.seqs]
    while any(p < n for p, n in zip(run.pos, lens)):
        chunks = []
        for b in range(len(lens)):
            if run.pos[b] < lens[b] and int(torch.randint(0, 4, (1,), generator=run.gen)) > 0:
                c = sizes[int(torch.randint(0, len(sizes), (1,), generator=run.gen))]
                chunks.append((b, min(c, lens[b] - run.pos[b])))
        if chunks:
            run.step(chunks, pad_seqs=1, pad_rows=2)


def _decode(run, prefix=None, decode_meta=False):
    lens = [s["xin"].shape[0] for s in run.seqs]
    if prefix is not None:
        run.step([(b, min(prefix[b], n)) for b, n in enumerate(lens) if min(prefix[b], n) > 0], pad_seqs=1)
    while any(p < n for p, n in zip(run.pos, lens)):
        run.step([(b, 1) for b in range(len(lens)) if run.pos[b] < lens[b]], pad_seqs=1 + decode_meta,
                 pad_rows=1, decode_meta=decode_meta)


def _schedules(seqs, prm, dtype, gen):
    runs = {}
    for name in ("prefill", "train", "chunked", "decode", "prefix+decode"):
        run = Run(seqs, prm, dtype, gen, stateful=name != "train")
        if name == "train":
            run.step([(b, s["xin"].shape[0]) for b, s in enumerate(seqs)], pad_rows=5)
        elif name == "prefill":
            _prefill(run)
        elif name == "chunked":
            _chunked(run)
        elif name == "decode":
            _decode(run)
        else:
            lens = [s["xin"].shape[0] for s in seqs]
            _decode(run, prefix=[int(torch.randint(n // 2, n + 1, (1,), generator=gen)) for n in lens])
        runs[name] = run
    return runs


@pytest.fixture
def nan_empty(monkeypatch):
    """``torch.empty`` filled with NaN (floating dtypes) during the test: an output a kernel leaves
    partly unwritten (padding rows) shows instead of reading as the zeros of fresh memory."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_schedules_bitwise_and_vs_reference(dtype, backend, gen, inv, nan_empty):
    prm = Params(dtype, gen)
    seqs = _seqs(LENGTHS, dtype, gen)
    runs = _schedules(seqs, prm, dtype, gen)
    base = runs["prefill"]
    for name, run in runs.items():
        for b in range(len(seqs)):
            for k in ("xbc", "dt", "y", "o"):
                inv.assert_bitwise(run.out[b][k], base.out[b][k], f"{backend} {dtype} seq {b} {k}: {name} vs prefill")
            if run.state is not None:
                fs, fb = run.final_state(b), base.final_state(b)
                assert fs.keys() == fb.keys()
                for k in fs:
                    inv.assert_bitwise(fs[k], fb[k], f"{backend} {dtype} seq {b} state {k}: {name} vs prefill")
    # every position of a chunk was produced by decode (one row re-executing its chunk)
    assert max(LENGTHS) > 2 * Q
    _check_reference(base, prm, seqs, dtype, backend)


def _close(got, ref, rtol, atol, what):
    err = (got.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    worst = float((err / bound).max()) if err.numel() else 0.0
    print(f"ERR {what}: max abs {float(err.max()) if err.numel() else 0:.3e}, worst/bound {worst:.3f}")
    assert worst <= 1.0, f"{what}: error {float(err.max()):.3e} exceeds atol {atol} + rtol {rtol}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_metadata_bitwise(dtype, device, monkeypatch, gen, inv):
    """Decode steps described on the device (``mamba2_decode_metadata``: fixed grids, the
    kernels commit boundary states, pending rows and conv tails themselves, as under a CUDA
    graph) give the bits of a full prefill, outputs and final states, from position 0 and
    after a prefill of a prefix; dead and padding sequences (no rows, slot -1) write nothing."""
    if device == "cuda":
        pytest.skip("CPU tensors here; tests/gpu runs the kernels natively")
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    prm = Params(dtype, gen)
    seqs = _seqs(LENGTHS, dtype, gen)
    base = Run(seqs, prm, dtype, gen)
    _prefill(base)
    lens = [s["xin"].shape[0] for s in seqs]
    for prefix in (None, [int(torch.randint(n // 2, n + 1, (1,), generator=gen)) for n in lens]):
        run = Run(seqs, prm, dtype, gen)
        _decode(run, prefix=prefix, decode_meta=True)
        for b in range(len(seqs)):
            for k in ("xbc", "dt", "y", "o"):
                inv.assert_bitwise(run.out[b][k], base.out[b][k], f"{dtype} seq {b} {k}: device decode vs prefill")
            fs, fb = run.final_state(b), base.final_state(b)
            assert fs.keys() == fb.keys()
            for k in fs:
                inv.assert_bitwise(fs[k], fb[k], f"{dtype} seq {b} state {k}: device decode vs prefill")
        # slots of no sequence (stale NaN) were never written
        unused = sorted(set(range(run.state.ssm.shape[0])) - set(run.slots))
        assert torch.isnan(run.state.ssm[unused]).all() and torch.isnan(run.state.conv[unused]).all()


def test_decode_metadata_refused_on_cpu_path(gen):
    meta = ops.mamba2_decode_metadata(torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([0]), Q, 1)
    st = Mamba2State.allocate(1, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W, chunk_size=Q,
                              dtype=torch.float32, fill=0.0)
    with pytest.raises(ValueError, match="needs the Triton kernels"):
        ops.causal_conv1d(torch.zeros(1, CD), torch.zeros(CD, W), None, meta, st)


def _check_reference(run, prm, seqs, dtype, backend):
    """Each op of the prefill run against its fp64 reference on the same inputs."""
    f32 = dtype == torch.float32
    tol_bf16 = dict(rtol=4e-3, atol=1e-6)  # one bf16 rounding: 2^-8 = 3.9e-3 relative
    tol_small = dict(rtol=1e-5, atol=1e-6) if f32 else tol_bf16
    for b, s in enumerate(seqs):
        out = run.out[b]
        L = s["xin"].shape[0]
        conv = causal_conv1d_reference(s["xin"], prm.conv_w, prm.conv_b)
        _close(out["xbc"], conv, what=f"{backend} {dtype} conv seq {b}", **tol_small)
        dt = mamba2_dt_reference(s["dt"], prm.dt_bias, LIMIT)
        _close(out["dt"], dt, rtol=1e-5, atol=1e-7, what=f"{backend} {dtype} dt seq {b}")
        x, Bm, Cm = out["xbc"].split([F_, G * N, G * N], dim=-1)  # the scan's inputs are the conv's output
        y, _ = ssd_reference(x.view(L, H, P), out["dt"], prm.A_log, Bm.view(L, G, N), Cm.view(L, G, N), prm.D)
        _close(out["y"], y.reshape(L, F_), rtol=1e-5, atol=1e-5, what=f"{backend} {dtype} scan seq {b}")
        o = gated_rms_norm_reference(out["y"], s["z"], prm.norm_w, F_ // G, EPS)
        _close(out["o"], o, what=f"{backend} {dtype} norm seq {b}", **tol_small)


def test_continuation_shorter_than_conv_width(backend, gen, inv):
    """A sequence continued by 1-token and 2-token chunks (< W-1 = 3 conv rows) right after a
    chunk boundary and across one: same bits as one prefill."""
    dtype = torch.bfloat16
    prm = Params(dtype, gen)
    seqs = _seqs([2 * Q + 3], dtype, gen)
    a = Run(seqs, prm, dtype, gen)
    _prefill(a)
    b = Run(seqs, prm, dtype, gen)
    for c in (1, 2, Q - 4, 1, 1, 2, Q - 3, 1, 2):  # boundaries hit by 1-token chunks
        b.step([(0, c)], pad_seqs=1)
    assert b.pos[0] == 2 * Q + 3
    for k in ("xbc", "y", "o"):
        inv.assert_bitwise(b.out[0][k], a.out[0][k], f"{backend} {k}")
    for k, v in b.final_state(0).items():
        inv.assert_bitwise(v, a.final_state(0)[k], f"{backend} state {k}")


def test_triton_equals_across_row_blocks_and_items(device, monkeypatch, gen, inv):
    """The kernel's row blocks (BLOCK_L < Q under the interpreter) and the CPU's row steps:
    every sequence alone == all sequences together (both implementations)."""
    if device == "cuda":
        pytest.skip("compares the CPU torch path with the interpreter on CPU tensors; the CUDA kernel runs in the other tests")
    dtype = torch.bfloat16
    prm = Params(dtype, gen)
    seqs = _seqs([Q + 7, 3, 2 * Q], dtype, gen)
    for be in BACKENDS:
        monkeypatch.setenv("UM_OPS_BACKEND", be)
        together = Run(seqs, prm, dtype, gen)
        _prefill(together)
        for b in range(len(seqs)):
            alone = Run([seqs[b]], prm, dtype, gen)
            alone.step([(0, seqs[b]["xin"].shape[0])])
            for k in ("xbc", "y", "o"):
                inv.assert_bitwise(alone.out[0][k], together.out[b][k], f"{be} seq {b} {k}")


def test_cpu_path_independent_of_threads(monkeypatch, gen, inv):
    """The CPU implementations at wider shapes (ATen calls above the parallel grain):
    1 and 2 threads give the same bits (no BLAS, no thread-split reductions)."""
    monkeypatch.setenv("UM_OPS_BACKEND", "torch")
    h, p, g, n, q, w = 8, 16, 2, 32, 32, 4
    lens = [70, 33, 5]
    cu = torch.tensor([0, *lens]).cumsum(0)
    T = int(cu[-1])
    cd = h * p + 2 * g * n
    xin = torch.randn(T, cd, generator=gen).to(torch.bfloat16)
    cw = (torch.randn(cd, w, generator=gen) * 0.4).to(torch.bfloat16)
    dtraw = torch.randn(T, h, generator=gen).to(torch.bfloat16)
    z = torch.randn(T, h * p, generator=gen).to(torch.bfloat16)
    A_log = torch.log(torch.arange(1, h + 1, dtype=torch.float32))
    meta = mamba2_metadata(cu, torch.zeros(3, dtype=torch.long), q)

    def run():
        xbc = ops.causal_conv1d(xin, cw, None, meta)
        x, Bm, Cm = xbc.split([h * p, g * n, g * n], dim=-1)
        dt = ops.mamba2_dt(dtraw, torch.zeros(h), LIMIT)
        y = ops.ssd_chunk_scan(x.reshape(T, h, p), dt, A_log, Bm.reshape(T, g, n), Cm.reshape(T, g, n), None, meta)
        return [xbc, dt, y, ops.gated_rms_norm(y.view(T, -1), z, torch.ones(h * p), h * p // g, EPS)]

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(old)
    for a, b, k in zip(one, two, ("conv", "dt", "scan", "norm")):
        inv.assert_bitwise(a, b, f"{k}: 1 vs 2 threads")


def test_dispatch(monkeypatch, device, gen, inv):
    if device == "cuda":
        pytest.skip("compares the CPU torch path with the interpreter on CPU tensors; the CUDA kernel runs in the other tests")
    from unified_models.ops.mamba2 import ssd_chunk_scan_torch
    from unified_models.ops.mamba2.triton import ssd_chunk_scan_triton

    T = 2 * Q + 1
    meta = mamba2_metadata(torch.tensor([0, T]), torch.tensor([0]), Q)
    ins = _ssd_inputs(T, torch.bfloat16, gen)
    for be, impl in (("torch", ssd_chunk_scan_torch), ("triton", ssd_chunk_scan_triton)):
        monkeypatch.setenv("UM_OPS_BACKEND", be)
        inv.assert_bitwise(ops.ssd_chunk_scan(*ins, meta), impl(*ins, meta, None, torch.float32)[0], be)


# --------------------------------------------------------------------------- peer: transformers


def _hf_mixer(gen):
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(hidden_size=64, num_hidden_layers=1, hybrid_override_pattern="M", mamba_num_heads=H,
                          mamba_head_dim=P, n_groups=G, ssm_state_size=N, conv_kernel=W, chunk_size=Q,
                          layer_norm_epsilon=EPS, use_conv_bias=True, mamba_proj_bias=False, vocab_size=32,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=64)
    mixer = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p_ in (mixer.in_proj.weight, mixer.out_proj.weight):
            p_.copy_(torch.randn(p_.shape, generator=gen) * p_.shape[1] ** -0.5)
        mixer.conv1d.weight.copy_(torch.randn(mixer.conv1d.weight.shape, generator=gen) * 0.4)
        mixer.conv1d.bias.copy_(torch.randn(mixer.conv1d.bias.shape, generator=gen) * 0.1)
        mixer.norm.weight.copy_(1 + 0.1 * torch.randn(F_, generator=gen))
        mixer.D.copy_(1 + 0.1 * torch.randn(H, generator=gen))
        dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        mixer.dt_bias.copy_(dt0 + torch.log(-torch.expm1(-dt0)))
    return cfg, mixer


def test_peer_transformers_mixer_fp32(backend, gen):
    """Our ops composed as the mixer == transformers' NemotronHMamba2Mixer (torch path) in fp32.

    transformers clamps dt to ``(time_step_min, inf)`` (its ``time_step_limit``);
    we pass the same limit here. Sequences go through transformers one at a time
    and through our ops as one THD batch (with state: a later chunk continues).
    """
    cfg, mixer = _hf_mixer(gen)
    lens = [2 * Q + 5, Q - 3, 9]
    hs = [torch.randn(1, n, cfg.hidden_size, generator=gen) for n in lens]
    with torch.no_grad():
        ref = [mixer(h)[0] for h in hs]
    limit = mixer.time_step_limit
    assert limit[0] == cfg.time_step_min  # the transformers quirk we follow here
    state = Mamba2State.allocate(len(lens), num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W,
                                 chunk_size=Q, dtype=torch.float32, fill=float("nan"))
    w_in, w_out = mixer.in_proj.weight.detach(), mixer.out_proj.weight.detach()
    outs = [[] for _ in lens]
    for cut in ((0, 6), (6, None)):  # two calls: the second continues from the state
        parts = [(b, h[0, cut[0]:cut[1]]) for b, h in enumerate(hs) if h[0, cut[0]:cut[1]].shape[0]]
        x = torch.cat([p_ for _, p_ in parts])
        cu = torch.tensor([0] + [p_.shape[0] for _, p_ in parts]).cumsum(0)
        meta = mamba2_metadata(cu, torch.tensor([cut[0]] * len(parts)), Q,
                               state_idx_B=torch.tensor([b for b, _ in parts]))
        T = x.shape[0]
        with torch.no_grad():
            zxbcdt = x.double() @ w_in.double().t()  # projections are not under test: exact-ish
            z, xbc, dt = zxbcdt.float().split([F_, CD, H], dim=-1)
            xbc = ops.causal_conv1d(xbc, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, meta, state)
            xs, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
            dtp = ops.mamba2_dt(dt, mixer.dt_bias, limit)
            y = ops.ssd_chunk_scan(xs.reshape(T, H, P), dtp, mixer.A_log, Bm.reshape(T, G, N), Cm.reshape(T, G, N),
                                   mixer.D, meta, state)
            o = ops.gated_rms_norm(y.view(T, F_), z, mixer.norm.weight, F_ // G, EPS)
            out = (o.double() @ w_out.double().t()).float()
        for i, (b, _) in enumerate(parts):
            outs[b].append(out[cu[i]:cu[i + 1]])
    for b in range(len(lens)):
        _close(torch.cat(outs[b]), ref[b], rtol=1e-4, atol=2e-5, what=f"{backend} peer transformers seq {b}")


def test_peer_transformers_chunk_scan_function(backend, gen):
    """The scan alone vs transformers' ``mamba2_chunk_scan`` (raw dt, softplus inside) in fp32."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    L = 3 * Q - 5
    x = torch.randn(1, L, H, P, generator=gen)
    dtraw = torch.randn(1, L, H, generator=gen)
    B = torch.randn(1, L, G, N, generator=gen) * 0.5
    C = torch.randn(1, L, G, N, generator=gen) * 0.5
    A_log = torch.log(torch.arange(1, H + 1, dtype=torch.float32))
    D = torch.rand(H, generator=gen) + 0.5
    dt_bias = torch.randn(H, generator=gen) * 0.5
    ref = mamba2_chunk_scan(x, dtraw, -torch.exp(A_log), B, C, Q, D=D, dt_bias=dt_bias, dt_softplus=True,
                            dt_limit=(0.0, math.inf))
    meta = mamba2_metadata(torch.tensor([0, L]), torch.tensor([0]), Q)
    dt = ops.mamba2_dt(dtraw[0], dt_bias, (0.0, math.inf))
    y = ops.ssd_chunk_scan(x[0], dt, A_log, B[0], C[0], D, meta)
    _close(y, ref[0], rtol=1e-4, atol=2e-5, what=f"{backend} peer mamba2_chunk_scan")


# --------------------------------------------------------------------------- gradients

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _grads(op, ref, inputs, g, what, inv):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = op(*xs)
    assert out.grad_fn is not None, f"{what}: no graph"
    with torch.no_grad():
        plain = op(*inputs)
    inv.assert_bitwise(out.detach(), plain, f"{what}: forward with grad vs no-grad")
    out.backward(g)
    x64 = [x.detach().double().requires_grad_() for x in inputs]
    ref(*x64).backward(g.double())
    for i, (x, r) in enumerate(zip(xs, x64)):
        assert x.grad is not None and x.grad.dtype == x.dtype, f"{what}: grad {i}"
        err = _rel(x.grad, r.grad)
        print(f"GRAD-ERR {what} input {i}: {err:.3e}")
        assert err <= TOL[x.dtype], f"{what}: input {i} gradient rel. error {err:.3e}"


def _packed(lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_conv_dt_norm(dtype, backend, gen, inv):
    lens = [Q + 3, 5]
    cu = _packed(lens)
    T = int(cu[-1])
    meta = mamba2_metadata(cu, torch.zeros(2, dtype=torch.long), Q, num_tokens=T + 2)
    x = torch.randn(T + 2, CD, generator=gen).to(dtype)
    w = (torch.randn(CD, W, generator=gen) * 0.4).to(dtype)
    bias = (torch.randn(CD, generator=gen) * 0.1).to(dtype)
    g = torch.randn(T + 2, CD, generator=gen).to(dtype)
    g[T:] = 0

    def conv_ref(x_, w_, b_):
        return torch.cat([causal_conv1d_reference(x_[cu[i]:cu[i + 1]], w_, b_) for i in range(2)]
                         + [x_.new_zeros(2, CD)])

    _grads(lambda x_, w_, b_: ops.causal_conv1d(x_, w_, b_, meta), conv_ref, [x, w, bias], g,
           f"conv {dtype} {backend}", inv)
    dtr = (torch.randn(T, H, generator=gen) * 3).to(dtype)
    dtb = torch.randn(H, generator=gen).to(dtype)
    _grads(lambda a, b_: ops.mamba2_dt(a, b_, (0.0, 2.0)), lambda a, b_: mamba2_dt_reference(a, b_, (0.0, 2.0)),
           [dtr, dtb], torch.randn(T, H, generator=gen), f"dt {dtype} {backend}", inv)
    y = torch.randn(T, F_, generator=gen)
    z = torch.randn(T, F_, generator=gen).to(dtype)
    nw = (1 + 0.1 * torch.randn(F_, generator=gen)).to(dtype)
    _grads(lambda y_, z_, w_: ops.gated_rms_norm(y_, z_, w_, F_ // G, EPS),
           lambda y_, z_, w_: gated_rms_norm_reference(y_, z_, w_, F_ // G, EPS),
           [y, z, nw], torch.randn(T, F_, generator=gen).to(dtype), f"norm {dtype} {backend}", inv)


def test_grad_conv_sequences_shorter_than_the_width(gen, inv):
    """The conv's written-out backward (gathers through the inverse tap table) on packed sequences of
    1, 2, W and W + 1 tokens and padding rows: each x row's gradient from its own sequence's taps only."""
    lens = [1, 2, W, W + 1, 3]
    cu = _packed(lens)
    T = int(cu[-1])
    meta = mamba2_metadata(cu, torch.zeros(len(lens), dtype=torch.long), Q, num_tokens=T + 3)
    x = torch.randn(T + 3, CD, generator=gen)
    w = torch.randn(CD, W, generator=gen) * 0.4
    bias = torch.randn(CD, generator=gen) * 0.1

    def conv_ref(x_, w_, b_):
        return torch.cat([causal_conv1d_reference(x_[cu[i]:cu[i + 1]], w_, b_) for i in range(len(lens))]
                         + [x_.new_zeros(3, CD)])

    _grads(lambda x_, w_, b_: ops.causal_conv1d(x_, w_, b_, meta), conv_ref, [x, w, bias],
           torch.randn(T + 3, CD, generator=gen), "conv short sequences", inv)


def _ssd_inputs(T, dtype, gen):
    return [torch.randn(T, H, P, generator=gen).to(dtype), torch.rand(T, H, generator=gen) * 0.3 + 0.01,
            torch.log(torch.arange(1, H + 1, dtype=torch.float32)).to(dtype),
            (torch.randn(T, G, N, generator=gen) * 0.5).to(dtype),
            (torch.randn(T, G, N, generator=gen) * 0.5).to(dtype),
            (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_ssd_packed(dtype, backend, gen, inv):
    lens = [2 * Q + 5, 7, Q]
    cu = _packed(lens)
    T = int(cu[-1])
    meta = mamba2_metadata(cu, torch.zeros(3, dtype=torch.long), Q)
    ins = _ssd_inputs(T, dtype, gen)

    def ref(x, dt, A_log, B, C, D):
        return torch.cat([ssd_reference(x[cu[i]:cu[i + 1]], dt[cu[i]:cu[i + 1]], A_log, B[cu[i]:cu[i + 1]],
                                        C[cu[i]:cu[i + 1]], D)[0] for i in range(3)])

    _grads(lambda *a: ops.ssd_chunk_scan(*a, meta), ref, ins, torch.randn(T, H, P, generator=gen),
           f"ssd packed {dtype} {backend}", inv)


def test_grad_ssd_and_conv_continuation(backend, gen, inv):
    """A chunk continuing a cached sequence (boundary state and pending rows constant)."""
    dtype = torch.float32
    L0, L1 = Q + 5, Q + 2
    full = _ssd_inputs(L0 + L1, dtype, gen)
    state = Mamba2State.allocate(2, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W, chunk_size=Q,
                                 dtype=dtype, fill=float("nan"))
    slot = torch.tensor([1])
    m0 = mamba2_metadata(torch.tensor([0, L0]), torch.tensor([0]), Q, state_idx_B=slot)
    with torch.no_grad():
        ops.ssd_chunk_scan(*(t[:L0] if t.dim() > 1 else t for t in full), m0, state)
    snap = Mamba2State(**{k: v.clone() for k, v in vars(state).items()})
    m1 = mamba2_metadata(torch.tensor([0, L1]), torch.tensor([L0]), Q, state_idx_B=slot)
    new = [t[L0:] if t.dim() > 1 else t for t in full]

    def op(x, dt, A_log, B, C, D):
        st = Mamba2State(**{k: v.clone() for k, v in vars(snap).items()})
        return ops.ssd_chunk_scan(x, dt, A_log, B, C, D, m1, st)

    bq = (L0 // Q) * Q  # boundary; rows bq..L0-1 are pending, the state at bq is cached

    def ref(x, dt, A_log, B, C, D):
        s_b = ssd_reference(full[0][:bq], full[1][:bq], A_log.detach(), full[3][:bq], full[4][:bq], None)[1]
        xs = torch.cat([full[0][bq:L0].double(), x])
        dts = torch.cat([full[1][bq:L0].double(), dt])
        Bs = torch.cat([full[3][bq:L0].double(), B])
        Cs = torch.cat([full[4][bq:L0].double(), C])
        return ssd_reference(xs, dts, A_log, Bs, Cs, D, s_b.detach())[0][L0 - bq:]

    _grads(op, ref, new, torch.randn(L1, H, P, generator=gen), f"ssd continuation {backend}", inv)

    # conv: the cached rows are constants
    x = torch.randn(L0 + L1, CD, generator=gen)
    w = torch.randn(CD, W, generator=gen) * 0.4
    bias = torch.randn(CD, generator=gen) * 0.1
    with torch.no_grad():
        ops.causal_conv1d(x[:L0], w, bias, m0, state)
    conv_snap = state.conv.clone()

    def conv_op(x_, w_, b_):
        st = Mamba2State(**{**{k: v.clone() for k, v in vars(snap).items()}, "conv": conv_snap.clone()})
        return ops.causal_conv1d(x_, w_, b_, m1, st)

    _grads(conv_op, lambda x_, w_, b_: causal_conv1d_reference(x_, w_, b_, x[:L0]), [x[L0:], w, bias],
           torch.randn(L1, CD, generator=gen), f"conv continuation {backend}", inv)


def test_grad_ssd_continued_beside_fresh_sequences(gen, inv):
    """One call holding a sequence continued from cached state (autograd of its recomputation) between
    sequences from position 0 (the analytic backward, two chunk counts): each row gets its own
    sequence's gradient, A_log and D the sum of both parts (fp32, vs fp64 autograd of the recurrence)."""
    dtype = torch.float32
    L0, L1, La, Lb = Q + 5, Q + 2, 2 * Q + 3, 5
    full = _ssd_inputs(L0 + L1, dtype, gen)
    state = Mamba2State.allocate(3, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W, chunk_size=Q,
                                 dtype=dtype, fill=float("nan"))
    m0 = mamba2_metadata(torch.tensor([0, L0]), torch.tensor([0]), Q, state_idx_B=torch.tensor([1]))
    with torch.no_grad():
        ops.ssd_chunk_scan(*(t[:L0] if t.dim() > 1 else t for t in full), m0, state)
    snap = Mamba2State(**{k: v.clone() for k, v in vars(state).items()})
    fresh = _ssd_inputs(La + Lb, dtype, gen)
    # rows: fresh a, the continued chunk, fresh b
    ins = [torch.cat([f[:La], n[L0:], f[La:]]) if n.dim() > 1 else n for f, n in zip(fresh, full)]
    cu = _packed([La, L1, Lb])
    m1 = mamba2_metadata(cu, torch.tensor([0, L0, 0]), Q, state_idx_B=torch.tensor([0, 1, 2]))

    def op(*a):
        return ops.ssd_chunk_scan(*a, m1, Mamba2State(**{k: v.clone() for k, v in vars(snap).items()}))

    bq = (L0 // Q) * Q

    def ref(x, dt, A_log, B, C, D):
        s_b = ssd_reference(full[0][:bq], full[1][:bq], A_log.detach(), full[3][:bq], full[4][:bq], None)[1]
        a, b = slice(0, La), slice(La + L1, La + L1 + Lb)
        mid = [torch.cat([full[i][bq:L0].double(), t[La:La + L1]]) for i, t in ((0, x), (1, dt), (3, B), (4, C))]
        return torch.cat([ssd_reference(x[a], dt[a], A_log, B[a], C[a], D)[0],
                          ssd_reference(mid[0], mid[1], A_log, mid[2], mid[3], D, s_b.detach())[0][L0 - bq:],
                          ssd_reference(x[b], dt[b], A_log, B[b], C[b], D)[0]])

    _grads(op, ref, ins, torch.randn(La + L1 + Lb, H, P, generator=gen), "ssd continued beside fresh", inv)


@pytest.mark.parametrize("with_D", [True, False])
def test_ssd_analytic_backward_equals_autograd(with_D, gen):
    """The analytic SSD backward (``ssd_chunked_backward``) equals autograd of the chunked form it
    differentiates, in fp64 to rounding: sequences of several chunk counts zero-padded to one length
    (zero rows past the end, as the trainer's groups), a group of 2 and of 1 heads per B/C group."""
    from unified_models.ops.mamba2.ssd_backward import ssd_chunked_backward

    for Hh, Gg, L in ((H, G, 3 * Q - 3), (H, H, Q), (2, 1, 5)):
        Bt = 3
        x = torch.randn(Bt, L, Hh, P, generator=gen, dtype=torch.float64)
        dt = torch.rand(Bt, L, Hh, generator=gen, dtype=torch.float64) * 0.5
        B = torch.randn(Bt, L, Gg, N, generator=gen, dtype=torch.float64) * 0.5
        C = torch.randn(Bt, L, Gg, N, generator=gen, dtype=torch.float64) * 0.5
        for t in (x, dt, B, C):
            t[1, L // 2:] = 0  # a shorter sequence, zero-padded
        A_log = torch.randn(Hh, generator=gen, dtype=torch.float64)
        D = torch.randn(Hh, generator=gen, dtype=torch.float64) if with_D else None
        leaves = [t.clone().requires_grad_() for t in (x, dt, A_log, B, C) + ((D,) if with_D else ())]
        y = ssd_chunked_torch_batched(*leaves[:5], leaves[5] if with_D else None, Q)
        gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        want = torch.autograd.grad(y, leaves, gy)
        got = ssd_chunked_backward(x, dt, A_log, B, C, D, Q, gy)
        assert got[5] is None if not with_D else got[5].shape == (Hh,)
        for name, a, b in zip(("x", "dt", "A_log", "B", "C", "D"), got, want):
            assert a.shape == b.shape and a.dtype == torch.float64, name
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=lambda m: f"d{name} (H={Hh}, G={Gg}): {m}")


def test_ssd_analytic_backward_fp32_as_accurate_as_autograd(gen):
    """In fp32, with decays whose cumulative sums reach ~-150 in a chunk (where differences of fp32 sums
    would cancel), each gradient of the analytic backward is within 2x the error of fp32 autograd of the
    chunked form, both against fp64 (the decays and the dt / A_log reductions are formed in fp64)."""
    from unified_models.ops.mamba2.ssd_backward import ssd_chunked_backward

    Q_, L = 64, 256
    x = torch.randn(2, L, H, P, generator=gen)
    dt = torch.rand(2, L, H, generator=gen) * 0.3 + 0.01
    B, C = (torch.randn(2, L, G, N, generator=gen) * 0.5 for _ in range(2))
    A_log = torch.log(torch.tensor([4.0, 8.0, 12.0, 16.0]))
    D = 1 + 0.1 * torch.randn(H, generator=gen)
    gy = torch.randn(2, L, H, P, generator=gen)
    ins = (x, dt, A_log, B, C, D)

    def autograd(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in ins]
        return torch.autograd.grad(ssd_chunked_torch_batched(*leaves, Q_), leaves, gy.to(dtype))

    exact, auto32 = autograd(torch.float64), autograd(torch.float32)
    ours = ssd_chunked_backward(*ins, Q_, gy)
    for name, e, a, o in zip(("x", "dt", "A_log", "B", "C", "D"), exact, auto32, ours):
        err_auto, err_ours = _rel(a, e), _rel(o, e)
        print(f"fp32 d{name}: analytic {err_ours:.2e}, autograd {err_auto:.2e}")
        assert err_ours <= 2 * err_auto + 1e-7, f"d{name}: {err_ours:.2e} vs autograd's {err_auto:.2e}"


def test_grad_ssd_fp64_activations_beside_fp32_dt(gen):
    """The op takes fp64 activations and weights beside its fp32 ``dt``: the written-out backward runs in one
    accumulation dtype (fp64 here) and matches fp64 autograd of the recurrence to the fp32 rounding of the
    op's output gradient; so does fp32 ``x`` with fp64 ``A_log`` / ``D`` (a helper's case: both raised)."""
    L = Q + 3
    meta = mamba2_metadata(torch.tensor([0, L]), torch.tensor([0]), Q)
    base = [t.double() for t in _ssd_inputs(L, torch.float32, gen)]
    g = torch.randn(L, H, P, generator=gen, dtype=torch.float64)
    for dts in ((torch.float64, torch.float32, torch.float64, torch.float64, torch.float64, torch.float64),
                (torch.float32, torch.float32, torch.float64, torch.float32, torch.float32, torch.float64)):
        ins = [t.to(d).clone().requires_grad_() for t, d in zip(base, dts)]
        ops.ssd_chunk_scan(*ins, meta).backward(g.to(ins[0].dtype))
        ref = [t.detach().double().requires_grad_() for t in ins]
        ssd_reference(*ref)[0].backward(g)
        for i, (a, r) in enumerate(zip(ins, ref)):
            assert a.grad.dtype == a.dtype, i
            assert _rel(a.grad, r.grad) <= 1e-6, (dts, i)  # the op's output (and so its gradient) is fp32


def test_ssd_analytic_backward_on_the_tensor_core_path(gen, monkeypatch):
    """A bf16 model's SSD backward on CUDA: every GEMM through ``grad_matmul``'s tensor-core path (emulated:
    bf16 operands, exact products, fp32 sums; fp32 operands as ``hi + lo``). Against fp64 each gradient is
    within 5e-5 (the split keeps 16 bits of each fp32 operand; fp32 autograd on CUDA cores was ~1e-7),
    ``dA_log`` the worst (its terms cancel)."""
    from tensor_cores import emulate_tensor_cores
    from unified_models.ops.mamba2 import ssd_backward

    emulate_tensor_cores(monkeypatch, ssd_backward)
    Q_, L = 16, 64
    ins = (torch.randn(2, L, H, P, generator=gen), torch.rand(2, L, H, generator=gen) * 0.3 + 0.01,
           torch.log(torch.tensor([1.0, 2.0, 4.0, 8.0])), torch.randn(2, L, G, N, generator=gen) * 0.5,
           torch.randn(2, L, G, N, generator=gen) * 0.5, 1 + 0.1 * torch.randn(H, generator=gen))
    gy = torch.randn(2, L, H, P, generator=gen)
    leaves = [t.double().requires_grad_() for t in ins]
    exact = torch.autograd.grad(ssd_chunked_torch_batched(*leaves, Q_), leaves, gy.double())
    ours = ssd_backward.ssd_chunked_backward(*ins, Q_, gy, split_fp32=True)
    for name, o, e in zip(("x", "dt", "A_log", "B", "C", "D"), ours, exact):
        err = _rel(o, e)
        print(f"tensor-core SSD backward d{name}: {err:.2e}")
        assert err <= 5e-5, (name, err)


def test_ssd_analytic_backward_errors(gen):
    from unified_models.ops.mamba2.ssd_backward import ssd_chunked_backward

    x = torch.randn(1, 4, H, P, generator=gen)
    dt, A_log, B = torch.rand(1, 4, H, generator=gen), torch.zeros(H), torch.randn(1, 4, G, N, generator=gen)
    with pytest.raises(ValueError, match="must be"):
        ssd_chunked_backward(x, dt, A_log, B, B[:, :3], None, Q, x)
    with pytest.raises(ValueError, match="dtype"):
        ssd_chunked_backward(x, dt.double(), A_log, B, B, None, Q, x)


def test_grad_mixer_core_composed(backend, gen, inv):
    """conv -> split views -> dt -> scan -> gated norm, differentiated end to end (fp32)
    against fp64 autograd of the composed references, packed sequences."""
    lens = [Q + 5, 6]
    cu = _packed(lens)
    T = int(cu[-1])
    meta = mamba2_metadata(cu, torch.zeros(2, dtype=torch.long), Q)
    prm = Params(torch.float32, gen)
    seq = _seqs([T], torch.float32, gen)[0]
    ins = [seq["xin"], seq["dt"], seq["z"], prm.conv_w, prm.conv_b, prm.dt_bias, prm.A_log, prm.D, prm.norm_w]

    def op(xin, dtraw, z, cw, cb, dtb, A_log, D, nw):
        xbc = ops.causal_conv1d(xin, cw, cb, meta)
        x, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
        dt = ops.mamba2_dt(dtraw, dtb, LIMIT)
        y = ops.ssd_chunk_scan(x.view(T, H, P), dt, A_log, Bm.view(T, G, N), Cm.view(T, G, N), D, meta)
        return ops.gated_rms_norm(y.view(T, F_), z, nw, F_ // G, EPS)

    def ref(xin, dtraw, z, cw, cb, dtb, A_log, D, nw):
        outs = []
        for i in range(len(lens)):
            s_ = slice(int(cu[i]), int(cu[i + 1]))
            xbc = causal_conv1d_reference(xin[s_], cw, cb)
            x, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
            n_ = x.shape[0]
            dt = mamba2_dt_reference(dtraw[s_], dtb, LIMIT)
            y, _ = ssd_reference(x.reshape(n_, H, P), dt, A_log, Bm.reshape(n_, G, N), Cm.reshape(n_, G, N), D)
            outs.append(gated_rms_norm_reference(y.reshape(n_, F_), z[s_], nw, F_ // G, EPS))
        return torch.cat(outs)

    _grads(op, ref, ins, torch.randn(T, F_, generator=gen), f"mixer core {backend}", inv)


def test_chunked_torch_matches_reference(gen):
    """The backward's recomputation (chunked einsums) equals the step recurrence (fp64)."""
    x, dt, A_log, B, C, D = (t.double() for t in _ssd_inputs(2 * Q + 3, torch.float32, gen))
    s0 = torch.randn(H, P, N, generator=gen, dtype=torch.float64)
    y = ssd_chunked_torch(x, dt, A_log, B, C, D, Q, s0)
    r, _ = ssd_reference(x, dt, A_log, B, C, D, s0)
    torch.testing.assert_close(y, r, rtol=1e-10, atol=1e-12)


def test_chunked_torch_batched_equals_each_sequence(gen):
    """The batched recomputation (sequences zero-padded to one length, as the backward groups them)
    gives each sequence's rows of the single-sequence form (fp64), with and without initial states."""
    lens = [Q + 3, 2 * Q, 5, Q - 1]
    Lp = 2 * Q
    seqs = [[t.double() for t in _ssd_inputs(n, torch.float32, gen)] for n in lens]
    A_log, D = seqs[0][2], seqs[0][5]

    def stack(i):  # field i of every sequence, zero-padded to Lp rows
        return torch.stack([torch.cat([s[i], s[i].new_zeros((Lp - s[i].shape[0], *s[i].shape[1:]))]) for s in seqs])

    s0 = torch.randn(len(lens), H, P, N, generator=gen, dtype=torch.float64)
    for init in (None, s0):
        y = ssd_chunked_torch_batched(stack(0), stack(1), A_log, stack(3), stack(4), D, Q, init)
        assert y.shape == (len(lens), Lp, H, P)
        for b, (n, s) in enumerate(zip(lens, seqs)):
            one = ssd_chunked_torch(s[0], s[1], A_log, s[3], s[4], D, Q, None if init is None else init[b])
            torch.testing.assert_close(y[b, :n], one, rtol=1e-12, atol=1e-12)
            r, _ = ssd_reference(s[0], s[1], A_log, s[3], s[4], D, None if init is None else init[b])
            torch.testing.assert_close(y[b, :n], r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_ssd_many_sequences_batched(dtype, gen, inv):
    """Sequences from position 0 recompute batched by chunk count (groups of 3, 2 and 2 sequences of
    different lengths): gradients against fp64 autograd of the step recurrence, per sequence."""
    lens = [Q, 3, 2 * Q + 1, Q - 2, 2 * Q, 9, 3 * Q]
    cu = _packed(lens)
    T = int(cu[-1])
    meta = mamba2_metadata(cu, torch.zeros(len(lens), dtype=torch.long), Q)
    ins = _ssd_inputs(T, dtype, gen)

    def ref(x, dt, A_log, B, C, D):
        return torch.cat([ssd_reference(x[cu[i]:cu[i + 1]], dt[cu[i]:cu[i + 1]], A_log, B[cu[i]:cu[i + 1]],
                                        C[cu[i]:cu[i + 1]], D)[0] for i in range(len(lens))])

    _grads(lambda *a: ops.ssd_chunk_scan(*a, meta), ref, ins, torch.randn(T, H, P, generator=gen),
           f"ssd batched {dtype}", inv)


def test_grad_guard_stale_weight(gen):
    prm = Params(torch.float32, gen)
    w = prm.norm_w.clone().requires_grad_()
    y = torch.randn(4, F_, generator=gen, requires_grad=True)
    out = ops.gated_rms_norm(y, torch.randn(4, F_, generator=gen), w, F_ // G, EPS)
    bump_weight_version(w)
    with pytest.raises(StaleWeightError, match="gated_rms_norm"):
        out.sum().backward()


# --------------------------------------------------------------------------- metadata and errors


def test_metadata_and_errors():
    meta = mamba2_metadata(torch.tensor([0, 3, 3, 40]), torch.tensor([14, 0, 5]), 16, num_tokens=42,
                           state_idx_B=torch.tensor([2, 0, -1]))
    # seq 0: positions 14..16 -> chunks 0 (complete: 16 = Q) and 1; seq 2 is padding
    assert meta.host["item_seq"] == [0, 0] and meta.host["item_chunk"] == [0, 1]
    assert meta.num_entries == 1 and meta.commit_slot.tolist() == [2]
    assert meta.pend_index.tolist() == [0]  # position 16 becomes pending row 0
    assert (meta.token_seq[3:] == -1).all()
    assert start_positions(torch.tensor([0, 2, 2, 5]), torch.tensor([7, 8, 0, 1, 2])).tolist() == [7, 0, 0]
    with pytest.raises(ValueError, match="needs a state"):
        mamba2_metadata(torch.tensor([0, 3]), torch.tensor([4]), Q)
    with pytest.raises(ValueError, match="non-decreasing"):
        mamba2_metadata(torch.tensor([0, 3, 2]), torch.tensor([0, 0]), Q)
    m = mamba2_metadata(torch.tensor([0, 3]), torch.tensor([0]), Q)
    with pytest.raises(ValueError, match="fp32"):
        ops.ssd_chunk_scan(torch.zeros(3, H, P), torch.zeros(3, H, dtype=torch.bfloat16), torch.zeros(H),
                           torch.zeros(3, G, N), torch.zeros(3, G, N), None, m)
    with pytest.raises(ValueError, match="rows"):
        ops.causal_conv1d(torch.zeros(4, CD), torch.zeros(CD, W), None, m)
    with pytest.raises(ValueError, match="group_size"):
        ops.gated_rms_norm(torch.zeros(2, 12), torch.zeros(2, 12), torch.zeros(12), 5, EPS)
    state = Mamba2State.allocate(1, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W,
                                 chunk_size=2 * Q, dtype=torch.float32)
    ms = mamba2_metadata(torch.tensor([0, 3]), torch.tensor([0]), Q, state_idx_B=torch.tensor([0]))
    with pytest.raises(ValueError, match="chunk size"):
        ops.ssd_chunk_scan(torch.zeros(3, H, P), torch.zeros(3, H), torch.zeros(H), torch.zeros(3, G, N),
                           torch.zeros(3, G, N), None, ms, state)


def _metadata_by_definition(cu, p0, slot, Q, T):
    """:func:`mamba2_metadata`'s fields from their definitions, one token and one chunk at a time."""
    B = len(cu) - 1
    live = [cu[b + 1] > cu[b] and slot[b] >= 0 for b in range(B)]
    end = [p0[b] + (cu[b + 1] - cu[b] if live[b] else 0) for b in range(B)]
    items = [(b, c) for b in range(B) if live[b] for c in range(p0[b] // Q, (end[b] - 1) // Q + 1)]
    entries = [(b, c) for b in range(B) if live[b] for c in range(p0[b] // Q, end[b] // Q)]  # complete chunks
    token_seq, token_pos, token_item, pend = [-1] * T, [0] * T, [0] * T, []
    for b in range(B):
        for r in range(cu[b], cu[b + 1]):
            if live[b]:
                pos = p0[b] + r - cu[b]
                token_seq[r], token_pos[r], token_item[r] = b, pos, items.index((b, pos // Q))
                if pos >= end[b] // Q * Q:
                    pend.append((r, slot[b], pos - end[b] // Q * Q))
    last_entry = {b: i for i, (b, _) in enumerate(entries)}
    return dict(item_seq=[b for b, _ in items], item_chunk=[c for _, c in items], num_entries=len(entries),
                token_seq=token_seq, token_pos=token_pos, token_item=token_item,
                commit_slot=[slot[b] for b in sorted(last_entry)], commit_entry=[last_entry[b] for b in sorted(last_entry)],
                pend_token=[p[0] for p in pend], pend_slot=[p[1] for p in pend], pend_index=[p[2] for p in pend],
                conv_seqs=[b for b in range(B) if live[b]])


def _random_batches(seed: int, n: int, slots_follow_rows: bool):
    """``n`` random ``(cu, p0, slot, Q, T)`` Mamba batches as lists: empty, padding (slot -1) and
    continued sequences, padded rows, chunk sizes 1-16. ``slots_follow_rows``: slot >= 0 exactly
    for the sequences with rows (what vLLM's builder gives)."""
    import random

    rng = random.Random(seed)
    for _ in range(n):
        B, Q = rng.randint(0, 7), rng.choice([1, 2, 4, 16])
        lens = [rng.choice([0, 1, 2, 5, 9, 17, 33]) for _ in range(B)]
        cu = [0]
        for k in lens:
            cu.append(cu[-1] + k)
        p0 = [rng.choice([0, 3, 15, 16, 40]) for _ in range(B)]
        if slots_follow_rows:
            slot = [rng.choice([0, 2, 5, 7]) if k else -1 for k in lens]
        else:
            slot = [rng.choice([-1, 0, 2, 5]) for _ in range(B)]
        yield cu, p0, slot, Q, cu[-1] + rng.choice([0, 3])


def test_metadata_matches_its_definition_on_random_batches():
    """Every index field, on 300 random batches (empty, padding and continued sequences, padded
    rows, chunk sizes 1-16), equals its definition computed token by token."""
    for cu, p0, slot, Q, T in _random_batches(0, 300, slots_follow_rows=False):
        meta = mamba2_metadata(torch.tensor(cu), torch.tensor(p0), Q, num_tokens=T, state_idx_B=torch.tensor(slot))
        want = _metadata_by_definition(cu, p0, slot, Q, T)
        got = dict(item_seq=meta.item_seq.tolist(), item_chunk=meta.item_chunk.tolist(), num_entries=meta.num_entries,
                   token_seq=meta.token_seq.tolist(), token_pos=meta.token_pos.tolist(),
                   token_item=meta.token_item.tolist(), commit_slot=meta.commit_slot.tolist(),
                   commit_entry=meta.commit_entry.tolist(), pend_token=meta.pend_token.tolist(),
                   pend_slot=meta.pend_slot.tolist(), pend_index=meta.pend_index.tolist(),
                   conv_seqs=meta.conv_seqs.tolist())
        assert got == want, (cu, p0, slot, Q, T)
        assert meta.host["item_seq"] == want["item_seq"] and meta.num_items == len(want["item_seq"])


def _assert_same_metadata(want, got, case) -> None:
    """Every field of two :class:`Mamba2Metadata` equal (tensors in value and dtype), and the host lists
    (not the ops' caches of derived indices, ``layout_ops``, which fill as ops run)."""
    import dataclasses

    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (f.name, case)
        elif f.name != "host":
            assert a == b, (f.name, case)
    skip = ("cpu", "layout_ops")
    assert {k: v for k, v in want.host.items() if k not in skip} == {k: v for k, v in got.host.items() if k not in skip}


def test_metadata_from_host_layout_equals_the_read_one():
    """``host_layout`` (vLLM's host copies of ``query_start_loc`` and the start positions) gives the
    same metadata as reading the tensors, field for field, when the slots are >= 0 exactly for the
    sequences with rows; a mismatched slot count is refused."""
    for cu, p0, slot, Q, T in _random_batches(1, 200, slots_follow_rows=True):
        args = (torch.tensor(cu, dtype=torch.int32), torch.tensor(p0), Q)
        read = mamba2_metadata(*args, num_tokens=T, state_idx_B=torch.tensor(slot, dtype=torch.int32))
        hinted = mamba2_metadata(*args, num_tokens=T, state_idx_B=torch.tensor(slot, dtype=torch.int32),
                                 host_layout=(np.array(cu), np.array(p0)))
        _assert_same_metadata(read, hinted, (cu, p0, slot, Q))
    with pytest.raises(ValueError, match="state_idx must be"):
        mamba2_metadata(torch.tensor([0, 2]), torch.tensor([0]), 4, state_idx_B=torch.tensor([0, 1]),
                        host_layout=(np.array([0, 2]), np.array([0])))
    with pytest.raises(ValueError, match="state_idx must be"):  # also when the layout is cached already
        cache: dict = {}
        mamba2_metadata(torch.tensor([0, 2]), torch.tensor([0]), 4, state_idx_B=torch.tensor([0]),
                        host_layout=(np.array([0, 2]), np.array([0])), layout_cache=cache)
        mamba2_metadata(torch.tensor([0, 2]), torch.tensor([0]), 4, state_idx_B=torch.tensor([0, 1]),
                        host_layout=(np.array([0, 2]), np.array([0])), layout_cache=cache)
    with pytest.raises(ValueError, match="needs state_idx_B"):
        mamba2_metadata(torch.tensor([0, 2]), torch.tensor([0]), 4, host_layout=(np.array([0, 2]), np.array([0])))


def test_layout_cache_shares_the_layout_across_slot_groups():
    """Slot-state groups of one step (same layout, own slots) share one layout build through
    ``layout_cache``: each group's metadata equals the one read from its own tensors, field for
    field and in the host lists; the slot-free tensors are the same objects (built and uploaded once);
    the per-group ``host`` dicts (where ops cache slot-dependent indices) are separate, while the
    conv-state write's row indices are built once for both; each group's conv-state write through the
    shared metadata equals the write through its own; another layout or chunk size is built anew."""
    from unified_models.ops.mamba2.dispatch import write_conv_state

    W, C = 4, 3
    for cu, p0, slot, Q, T in _random_batches(2, 120, slots_follow_rows=True):
        cache: dict = {}
        rng = np.random.default_rng(len(cu) * 1000 + Q)
        live = [i for i, s_ in enumerate(slot) if s_ >= 0]
        other = list(slot)
        for i, v in zip(live, rng.permutation([slot[i] + 100 for i in live])):
            other[i] = int(v)  # another group: its own slots for the same sequences
        metas = []
        for sl in (slot, other):
            args = (torch.tensor(cu, dtype=torch.int32), torch.tensor(p0), Q)
            idx = torch.tensor(sl, dtype=torch.int32)
            read = mamba2_metadata(*args, num_tokens=T, state_idx_B=idx)
            shared = mamba2_metadata(*args, num_tokens=T, state_idx_B=idx, host_layout=(np.array(cu), np.array(p0)),
                                     layout_cache=cache)
            _assert_same_metadata(read, shared, (cu, p0, sl, Q))
            assert torch.equal(read.host["cpu"]["slot"], shared.host["cpu"]["slot"])
            x = torch.randn(T, C)
            conv = torch.randn(max(sl, default=0) + 1, W - 1, C)
            want, got = SimpleNamespace(conv=conv.clone()), SimpleNamespace(conv=conv.clone())  # only .conv is written
            write_conv_state(x, read, want)
            write_conv_state(x, shared, got)
            assert torch.equal(want.conv, got.conv), (cu, p0, sl, Q)
            metas.append(shared)
        assert len(cache) == 1
        assert metas[0].token_seq is metas[1].token_seq and metas[0].item_chunk is metas[1].item_chunk
        assert metas[0].host is not metas[1].host
        assert metas[0].host["layout_ops"] is metas[1].host["layout_ops"] and len(metas[0].host["layout_ops"]) == 1
        metas[0].host["probe"] = 1
        assert "probe" not in metas[1].host
        mamba2_metadata(torch.tensor(cu, dtype=torch.int32), torch.tensor(p0), 2 * Q, num_tokens=T,
                        state_idx_B=torch.tensor(slot, dtype=torch.int32), host_layout=(np.array(cu), np.array(p0)),
                        layout_cache=cache)
        assert len(cache) == 2


def test_metadata_upload_packing_is_exact():
    """The one-copy upload of the metadata (:func:`~unified_models.ops.mamba2.common._pack_fields`):
    int32 and int64 fields of odd and zero lengths, extreme values, cut back out as views in their
    dtypes with the same values and 16-byte aligned offsets; only empty fields (or none) too."""
    from unified_models.ops.mamba2.common import _pack_fields, _unpack_fields

    i32, i64 = np.iinfo(np.int32), np.iinfo(np.int64)
    fields = dict(a=(np.array([i32.min, -1, 0, i32.max, 7]), torch.int32), b=(np.array([i64.min, i64.max]), torch.int64),
                  c=(np.zeros(0, dtype=np.int64), torch.int32), d=(np.array([3]), torch.int32),
                  e=(np.arange(9, dtype=np.int64) - 4, torch.int64))
    packed, spans = _pack_fields(fields)
    assert packed.dtype == torch.uint8 and all(o % 16 == 0 for o, _, _ in spans.values())
    out = _unpack_fields(packed, spans)
    for k, (v, dtype) in fields.items():
        assert out[k].dtype == dtype and out[k].tolist() == v.tolist(), k
    for only_empty in ({}, dict(c=fields["c"]), dict(c=fields["c"], f=(np.zeros(0, dtype=np.int32), torch.int64))):
        out = _unpack_fields(*_pack_fields(only_empty))
        assert {k: (t.dtype, t.numel()) for k, t in out.items()} == {k: (d, 0) for k, (_, d) in only_empty.items()}
