"""The public ops route to the Triton kernels when ``UM_OPS_BACKEND=triton`` (or on CUDA)
and to the plain-torch implementations otherwise."""

from __future__ import annotations

import torch

from unified_models import ops


def _inputs(gen, device):
    x = torch.randn(5, 64, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(48, 64, generator=gen).to(device, torch.bfloat16)
    return x, w


def test_public_ops_call_triton_when_forced(monkeypatch, device, gen, inv):
    from unified_models.ops.activations.triton import relu2_triton, swiglu_triton
    from unified_models.ops.embedding.triton import embedding_triton
    from unified_models.ops.linear.triton import linear_triton
    from unified_models.ops.logprob.triton import logprobs_triton
    from unified_models.ops.rmsnorm.triton import rms_norm_triton

    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    x, w = _inputs(gen, device)
    g = torch.ones(64, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 1, 4], device=device)
    logits = torch.randn(3, 300, generator=gen).to(device)
    inv.assert_bitwise(ops.linear(x, w), linear_triton(x, w, None, torch.bfloat16), "linear")
    inv.assert_bitwise(ops.rms_norm(x, g, 1e-6), rms_norm_triton(x, g, 1e-6, torch.bfloat16), "rms_norm")
    inv.assert_bitwise(ops.relu2(x), relu2_triton(x), "relu2")
    inv.assert_bitwise(ops.swiglu(x, x), swiglu_triton(x, x), "swiglu")
    inv.assert_bitwise(ops.embedding(ids, w), embedding_triton(ids, w), "embedding")
    inv.assert_bitwise(ops.logprobs(logits, 0.7), logprobs_triton(logits, 0.7), "logprobs")


def test_public_ops_call_torch_on_cpu_by_default(monkeypatch, gen, inv):
    from unified_models.ops.linear import linear_torch
    from unified_models.ops.logprob import logprobs_torch

    monkeypatch.delenv("UM_OPS_BACKEND", raising=False)
    x, w = _inputs(gen, "cpu")
    logits = torch.randn(3, 300, generator=gen)
    inv.assert_bitwise(ops.linear(x, w), linear_torch(x, w, None, torch.bfloat16), "linear")
    inv.assert_bitwise(ops.logprobs(logits, 0.7), logprobs_torch(logits, 0.7), "logprobs")
