"""The forward's fused residual add + RMSNorm (``PlainResidual.add_and_norm``, ``ops.add_rms_norm``):
the same values as the policy's steps one at a time, whoever subclasses the policy, and at the edges."""

from __future__ import annotations

import torch

from unified_models import forward as F
from unified_models import ops
from unified_models.layers import PlainResidual
from unified_models.porting import taps


def _stream(spec, gen):
    d = spec.hidden_size
    return (torch.randn(5, d, generator=gen) * 8).to(spec.dtype), torch.randn(5, d, generator=gen).to(spec.dtype)


def test_fused_step_equals_the_policy_steps(tiny_model):
    _, spec, sd = tiny_model
    r, y = _stream(spec, torch.Generator().manual_seed(0))
    for sub, nxt in ((spec.sublayers[0], spec.sublayers[1]), (spec.sublayers[-1], None)):
        r_fused, x_fused = F._add_and_norm(spec, sd, PlainResidual(), r, sub, y, nxt)
        with taps.recording(taps.TapRecorder()):  # taps on: the steps one at a time
            r_steps, x_steps = F._add_and_norm(spec, sd, PlainResidual(), r, sub, y, nxt)
        norm = spec.final_norm if nxt is None else nxt.norm
        assert torch.equal(r_fused, r + y) and torch.equal(r_steps, r_fused)
        assert torch.equal(x_fused, ops.rms_norm(r + y, sd[norm.name + ".weight"], norm.eps, out_dtype=spec.dtype))
        assert torch.equal(x_steps, x_fused)


def test_a_subclass_keeps_its_own_add(tiny_model):
    """A plugin's policy deriving from ``PlainResidual`` with its own ``add`` is not fused past it."""
    _, spec, sd = tiny_model

    class HalfResidual(PlainResidual):
        def add(self, rspec, params, r, sub, y_TD):
            return r + 0.5 * y_TD

    r, y = _stream(spec, torch.Generator().manual_seed(1))
    sub, nxt = spec.sublayers[0], spec.sublayers[1]
    r_off, x_off = F._add_and_norm(spec, sd, HalfResidual(), r, sub, y, nxt)
    with taps.recording(taps.TapRecorder()):
        r_on, x_on = F._add_and_norm(spec, sd, HalfResidual(), r, sub, y, nxt)
    assert torch.equal(r_off, r + 0.5 * y) and torch.equal(r_on, r_off) and torch.equal(x_on, x_off)


def test_a_model_without_sublayers_is_the_final_norm_of_its_embedding(tiny_model):
    from unified_models.private_state import PrivateStateStore
    from unified_models.state import FlatBatch

    _, spec, sd = tiny_model
    cut = spec.replace(blocks=spec.blocks[:0])
    params = {n: t for n, t in sd.items() if n in set(cut.parameter_shapes())}
    ids = torch.tensor([1, 5, 9])
    batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, 3]), None)
    store = PrivateStateStore(cut, [3], block_size=16)
    store.bind(batch)
    h = F.forward_hidden(cut, params, batch, store)
    want = ops.rms_norm(ops.embedding(ids, params[cut.embedding.name + ".weight"]),
                        params[cut.final_norm.name + ".weight"], cut.final_norm.eps, out_dtype=cut.dtype)
    assert torch.equal(h, want)


def test_the_stream_is_not_differentiable_when_only_the_weight_is():
    r, u = torch.randn(3, 16), torch.randn(3, 16)
    w = torch.ones(16, requires_grad=True)
    s, y = ops.add_rms_norm(r, u, w, 1e-5)
    assert not s.requires_grad and y.requires_grad
    y.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all() and float(w.grad.abs().sum()) > 0
