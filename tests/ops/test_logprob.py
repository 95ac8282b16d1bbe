"""Logprobs: Triton kernel and CPU implementation vs the fp64 oracle, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.logprob import logprobs_reference, logprobs_torch

V = 2000  # two 1024-wide chunks under the interpreter, the second one ragged


def _logits(T, dtype, gen, v=V):
    return (torch.randn(T, v, generator=gen) * 4.0).to(dtype)


def _pad(dtype, gen, v=V):
    def f(n):
        rows = torch.randn(n, v, generator=gen) * 100.0
        rows[: n // 2] = 0.0
        return (rows.to(dtype),)
    return f


TOL = dict(rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_vs_reference(dtype, temperature, device, gen):
    from unified_models.ops.logprob.triton import logprobs_triton

    x = _logits(19, dtype, gen)
    out = logprobs_triton(x.to(device), temperature)
    assert out.dtype == torch.float32 and out.shape == (19, V)
    ref = torch.log_softmax(x.double() / temperature, dim=-1)
    torch.testing.assert_close(out.cpu().double(), ref, **TOL)
    torch.testing.assert_close(out.cpu(), logprobs_reference(x, temperature), **TOL)
    # normalised: logsumexp of each row is 0
    torch.testing.assert_close(torch.logsumexp(out.cpu().double(), -1), torch.zeros(19, dtype=torch.float64),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.7])
def test_triton_temperature_is_ieee_fp32_division(temperature, device, gen, inv):
    """Dividing inside the kernel == torch's IEEE fp32 ``x / t`` fed at temperature 1 (bitwise)."""
    from unified_models.ops.logprob.triton import logprobs_triton

    x = _logits(5, torch.float32, gen)
    q = x / torch.tensor(temperature, dtype=torch.float32)
    inv.assert_bitwise(logprobs_triton(x.to(device), temperature), logprobs_triton(q.to(device), 1.0),
                       f"t={temperature}")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_triton_batch_invariant(temperature, device, gen, inv):
    from unified_models.ops.logprob.triton import logprobs_triton

    x = _logits(24, torch.float32, gen)
    inv.check_rows(lambda a: logprobs_triton(a, temperature), (x.to(device),), _pad(torch.float32, gen), gen,
                   pad_counts=(0, 4, 30), what="logprobs_triton")


def test_triton_masked_vocab_and_strided(device, gen, inv):
    from unified_models.ops.logprob.triton import logprobs_triton

    x = _logits(4, torch.float32, gen)
    x[:, :1500] = float("-inf")  # a whole leading chunk of masked logits
    out = logprobs_triton(x.to(device), 1.0).cpu()
    assert torch.isneginf(out[:, :1500]).all() and torch.isfinite(out[:, 1500:]).all()
    torch.testing.assert_close(out[:, 1500:].double(), torch.log_softmax(x[:, 1500:].double(), -1), **TOL)
    wide = torch.cat([x, x], dim=1).to(device)
    inv.assert_bitwise(logprobs_triton(wide[:, ::2], 1.0)[:, ::1],
                       logprobs_triton(wide[:, ::2].contiguous(), 1.0), "strided logits")


def test_triton_errors(device):
    from unified_models.ops.logprob.triton import logprobs_triton

    with pytest.raises(ValueError, match="temperature"):
        logprobs_triton(torch.zeros(2, 8, device=device), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_triton(torch.zeros(2, 8, device=device), float("nan"))
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        logprobs_triton(torch.zeros(8, device=device), 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_impl_vs_reference_and_invariant(temperature, gen, inv):
    x = _logits(37, torch.float32, gen)
    full = inv.check_rows(lambda a: logprobs_torch(a, temperature), (x,), _pad(torch.float32, gen), gen,
                          what="logprobs_torch")
    torch.testing.assert_close(full.double(), torch.log_softmax(x.double() / temperature, -1), **TOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_backward_vs_the_formula(temperature, device, gen):
    """The logprobs' backward kernel (``(g - exp(y) sum(g)) / T`` in one kernel) against the same formula in
    fp64 torch, on rows whose gradient is dense, one-hot (the token gather's) and zero, across a ragged
    second chunk; and its refusals."""
    from unified_models.ops.logprob.triton import logprobs_backward_triton

    z = _logits(4, torch.float32, gen).to(device)
    y = torch.log_softmax(z / temperature, -1)
    g = torch.randn(4, V, generator=gen).to(device)
    g[1] = 0.0
    g[1, 1999] = -2.5  # one-hot
    g[2] = 0.0
    dz = logprobs_backward_triton(y, g, temperature)
    ref = (g.double() - y.double().exp() * g.double().sum(-1, keepdim=True)) / temperature
    assert dz.dtype == torch.float32 and dz.shape == (4, V)
    torch.testing.assert_close(dz.double(), ref, rtol=1e-5, atol=1e-6)
    assert float(dz[2].abs().max()) == 0.0
    # one-column rows: a gradient whose V stride is not 1 (torch calls it contiguous) is taken
    y1 = torch.zeros(3, 1, device=device)
    g1 = torch.randn(1, 3, generator=gen).to(device).t()
    assert g1.stride(1) != 1 and g1.is_contiguous()
    assert float(logprobs_backward_triton(y1, g1, temperature).abs().max()) == 0.0  # (g - 1 * g) / T
    with pytest.raises(ValueError, match="fp32"):
        logprobs_backward_triton(y.bfloat16(), g, temperature)
    with pytest.raises(ValueError, match="unit stride"):
        logprobs_backward_triton(y.t().contiguous().t(), g, temperature)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_backward_triton(y, g, 0.0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_fused_equals_the_two_ops_bitwise(backend, temperature, device, gen, monkeypatch):
    """``ops.token_logprobs`` (gradient written over the kept log-probabilities) against ``logprobs`` then
    ``gather_token_logprobs``: the same forward and logits-gradient bits on the Triton path (CPU: the
    interpreter) and the torch path, with token gradients of -0.0, +0.0, tiny and large values, tokens in
    the ragged last chunk, logits that underflow exp; backward refuses a second run."""
    from unified_models import ops

    dev = device if backend == "triton" else "cpu"
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    z = _logits(6, torch.float32, gen)
    z[3, :1500] = -1e4  # exp(y) underflows to 0 in most of the row
    ids = torch.tensor([0, 1999, 1024, 5, 1998, 700])
    g = torch.tensor([-0.0, 0.0, 1e-30, -3.5, 2.0 ** 60, 0.25])

    def run(fused):
        zz = z.clone().to(dev).requires_grad_(True)
        t = ids.to(dev)
        tok = ops.token_logprobs(zz, t, temperature) if fused else \
            ops.gather_token_logprobs(ops.logprobs(zz, temperature), t)
        tok.backward(g.to(dev))
        return tok.detach(), zz.grad

    (tok_f, dz_f), (tok_u, dz_u) = run(True), run(False)
    assert torch.equal(tok_f.view(torch.int32), tok_u.view(torch.int32))
    assert torch.equal(dz_f.view(torch.int32), dz_u.view(torch.int32))
    assert dz_f.abs().max() > 0
    zz = z.clone().to(dev).requires_grad_(True)
    tok = ops.token_logprobs(zz, ids.to(dev), temperature)
    tok.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        tok.sum().backward()
    moved = ids.clone().to(dev)
    tok = ops.token_logprobs(z.clone().to(dev).requires_grad_(True), moved, temperature)
    moved.add_(1)  # the ids changed after the forward: refused like the unfused ops, not a gradient elsewhere
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tok.sum().backward()
    zz = z.clone().to(dev).requires_grad_(True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(ops.token_logprobs(zz, ids.to(dev), temperature).sum(), zz, create_graph=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_lm_head_token_logprobs_in_chunks(backend, device, gen, monkeypatch):
    """``ops.lm_head_token_logprobs`` (LM head + logprob + gather in row chunks): forward bits equal to the
    unchunked ops at every chunk size; one chunk: hidden and weight gradients bit for bit those of
    ``linear`` -> ``logprobs`` -> ``gather_token_logprobs``; several chunks: the same to fp32 rounding of
    the chunk sums, and bitwise repeatable; a second backward and a weight changed since the forward are
    refused."""
    from unified_models import ops

    dev = device if backend == "triton" else "cpu"
    monkeypatch.setenv("UM_OPS_BACKEND", backend)
    R, D, Vh = 11, 64, 300
    h0 = (torch.randn(R, D, generator=gen)).bfloat16()
    w0 = (torch.randn(Vh, D, generator=gen) / 4).bfloat16()
    ids = torch.randint(0, Vh, (R,), generator=gen)
    g = torch.randn(R, generator=gen)

    def run(rows):
        h = h0.clone().to(dev).requires_grad_(True)
        w = w0.clone().to(dev).requires_grad_(True)
        if rows is None:
            tok = ops.gather_token_logprobs(ops.logprobs(ops.linear(h, w, out_dtype=torch.float32), 0.8), ids.to(dev))
        else:
            tok = ops.lm_head_token_logprobs(h, w, ids.to(dev), 0.8, rows_per_chunk=rows)
        tok.backward(g.to(dev))
        return tok.detach(), h.grad, w.grad

    def bits(t):
        return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    ref = run(None)
    one = run(R)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(one, ref))
    for rows in (1, 4):
        got, again = run(rows), run(rows)
        assert torch.equal(bits(got[0]), bits(ref[0]))  # the forward: row-local ops
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, again))
        torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=0, atol=1e-2 * float(ref[1].abs().max()))
        torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=0, atol=1e-2 * float(ref[2].abs().max()))
    h = h0.clone().to(dev).requires_grad_(True)
    w = w0.clone().to(dev).requires_grad_(True)
    tok = ops.lm_head_token_logprobs(h, w, ids.to(dev), 0.8)
    tok.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        tok.sum().backward()
    tok = ops.lm_head_token_logprobs(h, w, ids.to(dev), 0.8)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="lm_head_token_logprobs"):
        tok.sum().backward()
    with pytest.raises(ValueError, match="rows_per_chunk"):
        ops.lm_head_token_logprobs(h, w, ids.to(dev), 0.8, rows_per_chunk=0)
    with pytest.raises(ValueError, match="one integer id per hidden row"):
        ops.lm_head_token_logprobs(h, w, torch.cat([ids, ids]).to(dev), 0.8, rows_per_chunk=2)
    tok = ops.lm_head_token_logprobs(h, w, ids.to(dev), 0.8, rows_per_chunk=4)  # several chunks: once too
    tok.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        tok.sum().backward()
    if backend == "torch":  # fp64 (the gradient checks' dtype): the hidden gradient stays fp64 as LinearFn's
        h64 = h0.double().requires_grad_(True)
        ops.lm_head_token_logprobs(h64, w0.double(), ids, 0.8).sum().backward()
        g64 = h64.grad
        h64.grad = None
        ops.gather_token_logprobs(ops.logprobs(ops.linear(h64, w0.double(), out_dtype=torch.float32), 0.8),
                                  ids).sum().backward()
        assert torch.equal(g64, h64.grad)
    with torch.no_grad():
        plain = ops.lm_head_token_logprobs(h0.to(dev), w0.to(dev), ids.to(dev), 0.8, rows_per_chunk=3)
    assert plain.grad_fn is None and torch.equal(bits(plain), bits(ref[0]))
