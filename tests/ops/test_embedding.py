"""Embedding: Triton kernel and CPU implementation vs oracle (exact) and batch invariance."""

from __future__ import annotations

import pytest
import torch

from unified_models.ops.embedding import embedding_reference, embedding_torch

V, D = 300, 96


def _table(dtype, gen):
    return torch.randn(V, D, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_triton_exact_copy_and_invariant(dtype, id_dtype, device, gen, inv):
    from unified_models.ops.embedding.triton import embedding_triton

    w = _table(dtype, gen).to(device)
    ids = torch.randint(0, V, (37,), generator=gen).to(id_dtype)
    ids[:2] = torch.tensor([0, V - 1])
    out = embedding_triton(ids.to(device), w)
    inv.assert_bitwise(out, embedding_reference(ids.to(device), w), "triton vs reference")
    pad = lambda n: (torch.randint(0, V, (n,), generator=gen).to(id_dtype),)  # noqa: E731
    inv.check_rows(lambda i: embedding_triton(i, w), (ids.to(device),), pad, gen, what="embedding_triton")


def test_triton_strided_table(device, gen, inv):
    from unified_models.ops.embedding.triton import embedding_triton

    big = torch.randn(V, 2 * D, generator=gen).to(torch.bfloat16).to(device)
    w = big[:, 1::2]  # non-contiguous columns
    ids = torch.randint(0, V, (9,), generator=gen).to(device)
    inv.assert_bitwise(embedding_triton(ids, w), w[ids.long()], "strided table")


def test_triton_errors(device):
    from unified_models.ops.embedding.triton import embedding_triton

    w = torch.zeros(V, D, device=device)
    with pytest.raises(ValueError, match="int32/int64"):
        embedding_triton(torch.zeros(3, device=device), w)
    with pytest.raises(ValueError, match=r"\[V, D\]"):
        embedding_triton(torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(V, device=device))
    if device == "cpu":
        with pytest.raises(ValueError, match="token ids must be in"):
            embedding_triton(torch.tensor([0, V]), w)


def test_triton_empty(device):
    from unified_models.ops.embedding.triton import embedding_triton

    out = embedding_triton(torch.zeros(0, dtype=torch.int64, device=device), torch.ones(V, D, device=device))
    assert out.shape == (0, D)


def test_torch_impl_exact_and_invariant(gen, inv):
    w = _table(torch.bfloat16, gen)
    ids = torch.randint(0, V, (29,), generator=gen)
    inv.assert_bitwise(embedding_torch(ids, w), embedding_reference(ids, w), "torch vs reference")
    pad = lambda n: (torch.randint(0, V, (n,), generator=gen),)  # noqa: E731
    inv.check_rows(lambda i: embedding_torch(i, w), (ids,), pad, gen, what="embedding_torch")
