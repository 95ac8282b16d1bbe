"""Backward of every op vs plain PyTorch autograd of its fp64 ``*_reference``,
forward values bitwise equal to the no-grad op, and the weight-version guard.

Each op runs through both forward implementations (the CPU torch path and the
Triton kernel through the interpreter, ``UM_OPS_BACKEND=triton``); the
backward is the same plain-torch code for both.

Error measure: ``||g - g_ref||_2 / ||g_ref||_2`` per input, with ``g_ref`` the
fp64 autograd gradient of the reference evaluated at the same (upcast) inputs
and upstream gradient. Tolerances: fp32 inputs 1e-5 (the backward runs in
fp32); bf16 inputs 4e-3, just above 2^-8 = 3.9e-3, the bound on the relative
error of rounding each gradient element once to bf16 (the gradient's dtype).
Measured worst (docs/consistency.md, "Gradients"): 1.7e-7 in fp32 and
1.9e-3 in bf16.
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.ops import StaleWeightError, bump_on_step, bump_weight_version, name_weights, weight_version
from unified_models.ops.activations import relu2_reference, swiglu_reference
from unified_models.ops.attention import dense_causal_attention_reference
from unified_models.ops.embedding import embedding_reference
from unified_models.ops.linear import linear_reference
from unified_models.ops.logprob import logprobs_reference
from unified_models.ops.rmsnorm import rms_norm_reference
from unified_models.ops.rope import apply_rope_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
DTYPES = [torch.float32, torch.bfloat16]
BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, device):
    if request.param == "triton" and device == "cuda":
        pytest.skip("these inputs live on the CPU; the CUDA kernels' gradients run in tests/gpu/test_autograd_gpu.py")
    monkeypatch.setenv("UM_OPS_BACKEND", request.param)
    return request.param


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_op(op, ref, inputs, g, *, consts=(), ref_consts=None, what="", inv=None):
    """Run ``op(*inputs, *consts)`` with grad, compare its forward with the no-grad op
    bitwise and each input's gradient with fp64 autograd of ``ref``; return the errors."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = op(*xs, *consts)
    assert out.grad_fn is not None, f"{what}: no graph"
    with torch.no_grad():
        plain = op(*inputs, *consts)
    inv.assert_bitwise(out.detach(), plain, f"{what} forward with grad vs no-grad")
    out.backward(g)
    x64 = [x.detach().double().requires_grad_() for x in inputs]
    ref(*x64, *(consts if ref_consts is None else ref_consts)).backward(g.double())
    errs = []
    for i, (x, r) in enumerate(zip(xs, x64)):
        assert x.grad is not None and x.grad.dtype == x.dtype, f"{what}: grad {i} dtype"
        err = _rel(x.grad, r.grad)
        print(f"GRAD-ERR {what} input {i}: {err:.3e}")
        assert err <= TOL[x.dtype], f"{what}: input {i} gradient rel. error {err:.3e}"
        errs.append(err)
    return errs


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype, backend, gen, inv):
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4])  # repeats accumulate
    w = torch.randn(12, 32, generator=gen).to(dtype)
    g = torch.randn(ids.shape[0], 32, generator=gen).to(dtype)
    check_op(lambda w_: ops.embedding(ids, w_), lambda w_: embedding_reference(ids, w_), [w], g,
             what=f"embedding {dtype} {backend}", inv=inv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, backend, gen, inv):
    x = (torch.randn(19, 48, generator=gen) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(48, generator=gen)).to(dtype)
    g = torch.randn(19, 48, generator=gen).to(dtype)
    check_op(lambda a, b: ops.rms_norm(a, b, 1e-5), lambda a, b: rms_norm_reference(a, b, 1e-5), [x, w], g,
             what=f"rms_norm {dtype} {backend}", inv=inv)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_linear(with_bias, dtype, out_dtype, backend, gen, inv):
    x = torch.randn(19, 40, generator=gen).to(dtype)
    w = (torch.randn(24, 40, generator=gen) / 40 ** 0.5).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    g = torch.randn(19, 24, generator=gen).to(out_dtype)
    inputs = [x, w, b] if with_bias else [x, w]
    check_op(lambda *a: ops.linear(*a, out_dtype=out_dtype), linear_reference, inputs, g,
             what=f"linear {dtype}->{out_dtype} bias={with_bias} {backend}", inv=inv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2(dtype, backend, gen, inv):
    x = torch.randn(19, 40, generator=gen).to(dtype)
    g = torch.randn(19, 40, generator=gen).to(dtype)
    check_op(ops.relu2, relu2_reference, [x], g, what=f"relu2 {dtype} {backend}", inv=inv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype, backend, gen, inv):
    gate = (torch.randn(19, 40, generator=gen) * 3).to(dtype)
    up = torch.randn(19, 40, generator=gen).to(dtype)
    g = torch.randn(19, 40, generator=gen).to(dtype)
    check_op(ops.swiglu, swiglu_reference, [gate, up], g, what=f"swiglu {dtype} {backend}", inv=inv)


@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope(rotary_dim, dtype, backend, gen, inv):
    theta, e = 10000.0, 16
    pos = torch.tensor([0, 1, 2, 7, 33, 63, 5])
    x = torch.randn(7, 3, e, generator=gen).to(dtype)
    g = torch.randn(7, 3, e, generator=gen).to(dtype)
    cos, sin = ops.rope_cos_sin(64, rotary_dim, theta)
    check_op(lambda a: ops.apply_rope(a, pos, cos, sin), lambda a: apply_rope_reference(a, pos, rotary_dim, theta),
             [x], g, what=f"rope R={rotary_dim} {dtype} {backend}", inv=inv)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs(temperature, dtype, backend, gen, inv):
    z = (torch.randn(5, 1500, generator=gen) * 4).to(dtype)  # crosses the 1024-wide CPU segments
    g = torch.randn(5, 1500, generator=gen)
    check_op(lambda a: ops.logprobs(a, temperature), lambda a: logprobs_reference(a, temperature), [z], g,
             what=f"logprobs T={temperature} {dtype} {backend}", inv=inv)


def test_gather_token_logprobs(gen, inv):
    lp = torch.randn(6, 300, generator=gen)
    ids = torch.tensor([0, 299, 17, 17, 5, 120])
    g = torch.randn(6, generator=gen)
    check_op(lambda a: ops.gather_token_logprobs(a, ids), lambda a: a.gather(1, ids.view(-1, 1)).view(-1), [lp], g,
             what="gather_token_logprobs", inv=inv)


def test_logprob_chain_matches_reference(gen, inv):
    """logprobs + gather together (the trainer's loss path), bf16 logits, temperature 0.8."""
    z = torch.randn(4, 700, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([1, 2, 699, 350])
    g = torch.randn(4, generator=gen)
    check_op(lambda a: ops.gather_token_logprobs(ops.logprobs(a, 0.8), ids),
             lambda a: logprobs_reference(a, 0.8).gather(1, ids.view(-1, 1)).view(-1), [z], g,
             what="logprobs+gather bf16", inv=inv)


# ---------------------------------------------------------------------------- attention

H, G, E, S = 4, 2, 16, 16


def _paged_layout(lens, gen, start=None):
    """Block table with shuffled blocks, seq_idx, positions and slots for sequences of ``lens``."""
    start = start or [0] * len(lens)
    ends = [s + n for s, n in zip(start, lens)]
    nblk = [(e + S - 1) // S for e in ends]
    n_blocks = sum(nblk) + 2
    perm = torch.randperm(n_blocks, generator=gen)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nblk):
        table[b, :n] = perm[i:i + n].int()
        i += n
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).int()
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start, lens)])
    slots = table[seq.long(), pos // S].long() * S + pos % S
    return n_blocks, table, seq, pos, slots


def _attention(q, k, v, n_blocks, table, seq, pos, slots):
    kc = torch.zeros(n_blocks, S, G, E, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    ops.write_kv_cache(k, v, kc, vc, slots)
    return ops.paged_attention(q, kc, vc, table, seq, pos, E ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_packed_thd(dtype, backend, gen, inv):
    """Three packed sequences (5, 17, 9 tokens: across the 16-position KV tile), GQA 4/2,
    shuffled blocks; gradients to q, k and v through the cache write."""
    lens = [5, 17, 9]
    layout = _paged_layout(lens, gen)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, E, generator=gen).to(dtype) for h in (H, G, G))
    g = torch.randn(t, H, E, generator=gen).to(dtype)

    def ref(q64, k64, v64):
        cuts = torch.tensor([0, *lens]).cumsum(0).tolist()
        return torch.cat([dense_causal_attention_reference(q64[a:b], k64[a:b], v64[a:b], E ** -0.5)
                          for a, b in zip(cuts[:-1], cuts[1:])])

    check_op(lambda a, b, c: _attention(a, b, c, *layout), ref, [q, k, v], g,
             what=f"paged_attention {dtype} {backend}", inv=inv)


def test_paged_attention_chunk_reads_cached_prefix_as_constant(backend, gen, inv):
    """A second chunk (positions 6..13) over a cache whose first 6 positions were
    written without grad: gradients reach the chunk's q/k/v; the prefix is constant."""
    n0, n1 = 6, 8
    n_blocks, table, _, _, _ = _paged_layout([n0 + n1], gen)
    pos = torch.arange(n0 + n1)
    slots = table[0].long()[pos // S] * S + pos % S
    k_all, v_all = torch.randn(n0 + n1, G, E, generator=gen), torch.randn(n0 + n1, G, E, generator=gen)
    q_in = torch.randn(n1, H, E, generator=gen)
    seq = torch.zeros(n1, dtype=torch.int32)

    def chunk(q, k1, v1):
        kc = torch.zeros(n_blocks, S, G, E)
        vc = torch.zeros_like(kc)
        with torch.no_grad():
            ops.write_kv_cache(k_all[:n0], v_all[:n0], kc, vc, slots[:n0])
        ops.write_kv_cache(k1, v1, kc, vc, slots[n0:])
        return ops.paged_attention(q, kc, vc, table, seq, pos[n0:], E ** -0.5)

    def ref(q64, k64, v64):
        q_full = torch.cat([torch.zeros(n0, H, E, dtype=torch.float64), q64])
        return dense_causal_attention_reference(q_full, torch.cat([k_all[:n0].double(), k64]),
                                                torch.cat([v_all[:n0].double(), v64]), E ** -0.5)[n0:]

    check_op(chunk, ref, [q_in, k_all[n0:], v_all[n0:]], torch.randn(n1, H, E, generator=gen),
             what=f"paged_attention chunk {backend}", inv=inv)


def test_no_tape_without_grad(gen):
    layout = _paged_layout([5], gen)
    k = torch.randn(5, G, E, generator=gen, requires_grad=True)
    kc = torch.zeros(layout[0], S, G, E)
    with torch.no_grad():
        ops.write_kv_cache(k, k, kc, kc.clone(), layout[4])
    assert getattr(kc, "_um_kv_tape", None) is None


# ---------------------------------------------------------------------------- weight-version guard


def _linear_graph(gen):
    x = torch.randn(3, 8, generator=gen, requires_grad=True)
    w = torch.randn(5, 8, generator=gen, requires_grad=True)
    b = torch.randn(5, generator=gen, requires_grad=True)
    name_weights([("layers.0.proj.weight", w), ("layers.0.proj.bias", b)])
    return w, b, ops.linear(x, w, b).sum()


def _embedding_graph(gen):
    w = torch.randn(10, 4, generator=gen, requires_grad=True)
    name_weights([("embeddings.weight", w)])
    return w, None, ops.embedding(torch.tensor([1, 2]), w).sum()


def _norm_graph(gen):
    w = torch.ones(8, requires_grad=True)
    name_weights([("norm_f.weight", w)])
    return w, None, ops.rms_norm(torch.randn(3, 8, generator=gen, requires_grad=True), w, 1e-5).square().sum()


GRAPHS = {"linear": (_linear_graph, "layers.0.proj.weight"), "embedding": (_embedding_graph, "embeddings.weight"),
          "rms_norm": (_norm_graph, "norm_f.weight")}


@pytest.mark.parametrize("op", sorted(GRAPHS))
def test_guard_fires_on_in_place_update(op, gen):
    build, name = GRAPHS[op]
    w, _, loss = build(gen)
    with torch.no_grad():
        w.add_(0.01)  # an optimizer step between forward and backward
    with pytest.raises(StaleWeightError, match=rf"{op} backward: weight '{name}'.*tensor version"):
        loss.backward()
    assert issubclass(StaleWeightError, RuntimeError)


def test_guard_fires_on_bias(gen):
    _, b, loss = _linear_graph(gen)
    with torch.no_grad():
        b.zero_()
    with pytest.raises(StaleWeightError, match="bias 'layers.0.proj.bias'"):
        loss.backward()


def test_guard_param_data_writes_need_a_bump(gen):
    """Writes through ``.data`` bump no ``_version``: the explicit weight version catches them."""
    w, _, loss = _linear_graph(gen)
    v0 = w._version
    w.data.mul_(2.0)
    assert w._version == v0  # invisible to autograd's own counter
    bump_weight_version(w.data)  # an alias of the same storage is the same weight
    with pytest.raises(StaleWeightError, match=r"weight version \d+ -> \d+"):
        loss.backward()


def test_guard_fires_on_storage_swap(gen):
    w, _, loss = _linear_graph(gen)
    w.data = torch.randn_like(w)
    with pytest.raises(StaleWeightError, match=r"storage replaced"):
        loss.backward()


def test_bump_on_step_and_module_bump(gen):
    w, b, loss = _linear_graph(gen)
    opt = torch.optim.SGD([w, b], lr=0.1)
    handle = bump_on_step(opt)
    loss.backward()  # fine: nothing changed since the forward
    before = weight_version(w)
    opt.step()
    assert weight_version(w) == before + 1 and weight_version(b) >= 1
    handle.remove()
    mod = torch.nn.Linear(3, 3)
    v = weight_version(mod.weight)
    bump_weight_version(mod)
    assert weight_version(mod.weight) == v + 1
    with pytest.raises(TypeError, match="register_step_post_hook"):
        bump_on_step(object())


def test_guard_no_false_positive_across_steps(gen):
    w, b, loss = _linear_graph(gen)
    loss.backward()
    with torch.no_grad():
        w.add_(1.0)
    bump_weight_version(torch.zeros(4))  # another storage: no effect on w
    x = torch.randn(3, 8, generator=gen)
    ops.linear(x, w, b).sum().backward()  # a fresh forward after the update is fine
    assert w.grad is not None


def test_no_grad_path_is_the_kernel(gen, inv):
    """Without grad the public op is the dispatching function itself (no Function, same bits)."""
    from unified_models.ops.linear import linear as kernel

    x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(6, 8, generator=gen).to(torch.bfloat16).requires_grad_()
    with torch.no_grad():
        y = ops.linear(x, w)
    assert y.grad_fn is None
    inv.assert_bitwise(y, kernel(x, w.detach()), "no-grad linear")


# ------------------------------------------------------- attention: the fused half-precision recompute

# The fused recompute (FlashAttention-2's backward: probabilities and score gradients rounded to bf16
# inside) adds about one more bf16 rounding per term to the gradient's own rounding: 2 x 2^-8.
TOL_FUSED_BF16 = 8e-3


@pytest.mark.parametrize("lens", [[5, 17, 9], [33]], ids=["packed", "one"])
def test_paged_attention_fused_recompute(lens, gen, inv, monkeypatch):
    """The backward's fused path (on CUDA for half-precision self-attention; forced here on the
    CPU, where its Triton kernels run through the interpreter): every sequence of a whole-prompt
    packed batch takes it, in one call, and q/k/v gradients are within 2 x 2^-8 of fp64 autograd."""
    from unified_models.ops.attention import backward as attn_backward

    taken = []
    real = attn_backward._fused_causal_grads
    monkeypatch.setattr(attn_backward, "fused_recompute_eligible", lambda q, plan, sink: q.dtype == torch.bfloat16)
    monkeypatch.setattr(attn_backward, "_fused_causal_grads", lambda *a: taken.append(list(a[4])) or real(*a))
    layout = _paged_layout(lens, gen)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, E, generator=gen).to(torch.bfloat16) for h in (H, G, G))
    g = torch.randn(t, H, E, generator=gen).to(torch.bfloat16)

    def ref(q64, k64, v64):
        cuts = torch.tensor([0, *lens]).cumsum(0).tolist()
        return torch.cat([dense_causal_attention_reference(q64[a:b], k64[a:b], v64[a:b], E ** -0.5)
                          for a, b in zip(cuts[:-1], cuts[1:])])

    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = _attention(*xs, *layout)
    with torch.no_grad():
        inv.assert_bitwise(out.detach(), _attention(q, k, v, *layout), "fused-path forward vs no-grad")
    out.backward(g)
    assert len(taken) == 1 and sorted(taken[0]) == sorted(lens), f"fused calls (sequence lengths): {taken}, expected {lens}"
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref(*x64).backward(g.double())
    for name, x, r in zip("qkv", xs, x64):
        assert x.grad.dtype == torch.bfloat16
        err = _rel(x.grad, r.grad)
        print(f"GRAD-ERR fused paged_attention d{name}: {err:.3e}")
        assert err <= TOL_FUSED_BF16, f"d{name} rel. error {err:.3e}"


def test_fused_recompute_of_interleaved_tokens(gen, inv, monkeypatch):
    """Tokens of three whole prompts interleaved in the batch (rows in any order): the fused path
    gathers each sequence's rows by position and scatters the gradients back, giving the bits of
    the same batch in sequence order, row for row."""
    from unified_models.ops.attention import backward as attn_backward

    monkeypatch.setattr(attn_backward, "fused_recompute_eligible", lambda q, plan, sink: True)
    lens = [5, 17, 9]
    n_blocks, table, seq, pos, slots = _paged_layout(lens, gen)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, E, generator=gen).to(torch.bfloat16) for h in (H, G, G))
    g = torch.randn(t, H, E, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(t, generator=gen)

    def grads(p):
        xs = [x[p].detach().clone().requires_grad_() for x in (q, k, v)]
        _attention(*xs, n_blocks, table, seq[p], pos[p], slots[p]).backward(g[p])
        back = torch.empty_like(p)
        back[p] = torch.arange(t)
        return [x.grad[back] for x in xs]

    for name, a, b in zip("qkv", grads(torch.arange(t)), grads(perm)):
        inv.assert_bitwise(a, b, f"d{name}: interleaved rows vs sequence order")


def test_fused_recompute_skips_continued_chunks(gen, monkeypatch):
    """A continued chunk (queries at positions 6..13 over keys 0..13) is not self-attention:
    the plan marks it ineligible and the backward takes the fp32 recompute."""
    from unified_models.ops.attention import backward as attn_backward

    monkeypatch.setattr(attn_backward, "fused_recompute_eligible", lambda q, plan, sink: True)
    monkeypatch.setattr(attn_backward, "_fused_causal_grads",
                        lambda *a: pytest.fail("a continued chunk took the fused path"))
    n0, n1 = 6, 8
    n_blocks, table, _, _, _ = _paged_layout([n0 + n1], gen)
    pos = torch.arange(n0 + n1)
    slots = table[0].long()[pos // S] * S + pos % S
    kc = torch.zeros(n_blocks, S, G, E, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    with torch.no_grad():
        ops.write_kv_cache(torch.randn(n0, G, E).bfloat16(), torch.randn(n0, G, E).bfloat16(), kc, vc, slots[:n0])
    q = torch.randn(n1, H, E, generator=gen).bfloat16().requires_grad_()
    k1 = torch.randn(n1, G, E, generator=gen).bfloat16().requires_grad_()
    ops.write_kv_cache(k1, k1, kc, vc, slots[n0:])
    out = ops.paged_attention(q, kc, vc, table, torch.zeros(n1, dtype=torch.int32), pos[n0:], E ** -0.5)
    out.float().sum().backward()
    assert q.grad is not None and k1.grad is not None and float(q.grad.float().abs().sum()) > 0


def test_fused_causal_grads_refuses_bad_shapes():
    from unified_models.ops.attention.backward import _fused_causal_grads

    q = torch.zeros(4, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused causal attention gradients"):
        _fused_causal_grads(q, torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), q, [4], 0.3)  # 3 heads over 2
    q4 = torch.zeros(4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sequence lengths"):
        _fused_causal_grads(q4, torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), q4, [3], 0.3)  # lengths sum to 3
