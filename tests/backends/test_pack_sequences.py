"""THD packing of the trainer (:func:`unified_models.backends.megatron.recompute.pack_sequences`).

The numpy packing gives exactly the micro-batches of the straightforward per-token loop it
replaced (copied below as the reference): same grouping, ``input_ids`` / ``cu_seqlens`` / ``rows``
(values and dtypes), ``owners`` and ``flat``, for list, tuple, numpy and torch inputs, empty
completions, one-token prompts and a sequence longer than ``max_tokens`` on its own.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from unified_models.backends.megatron.recompute import MicroBatch, micro_batches, pack_sequences

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(prompt_ids, completions, max_tokens, device):
    """The per-token loop ``pack_sequences`` used before the numpy version, as plain dicts."""
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    groups = micro_batches([len(p) + len(c) for p, c in zip(prompt_ids, completions)], max_tokens)
    out, flat = [], 0
    for seqs in groups:
        ids, cu, rows, owners = [], [0], [], []
        for s in seqs:
            p, c = prompt_ids[s], completions[s]
            start = len(ids)
            ids += [int(t) for t in p] + [int(t) for t in c]
            cu.append(len(ids))
            for j in range(len(c)):
                rows.append(start + len(p) - 1 + j)
                owners.append((s, j))
        out.append(dict(seqs=list(seqs), input_ids=torch.tensor(ids, dtype=torch.long, device=device),
                        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
                        rows=torch.tensor(rows, dtype=torch.long, device=device), owners=owners,
                        flat=slice(flat, flat + len(rows))))
        flat += len(rows)
    return out


def _assert_same(got: list[MicroBatch], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.seqs == w["seqs"] and g.flat == w["flat"]
        assert g.owners == w["owners"] and isinstance(g.owners, list)
        assert all(type(o) is tuple and all(type(x) is int for x in o) for o in g.owners)
        for name in ("input_ids", "cu_seqlens", "rows"):
            a, b = getattr(g, name), w[name]
            assert a.dtype == b.dtype and a.device == b.device and a.shape == b.shape, name
            assert torch.equal(a, b), name
        assert g.completion_lengths == [sum(1 for o in w["owners"] if o[0] == s) for s in w["seqs"]]


def _random_case(rng: random.Random, n: int, max_len: int):
    prompts, completions = [], []
    for _ in range(n):
        lp = rng.choice([1, 1, rng.randint(1, max_len)])  # one-token prompts often
        lc = rng.choice([0, 0, 1, rng.randint(0, max_len)])  # empty completions often
        prompts.append([rng.randrange(50_000) for _ in range(lp)])
        completions.append([rng.randrange(50_000) for _ in range(lc)])
    return prompts, completions


def _as_kind(xs, kind: str, rng: random.Random):
    if kind == "list":
        return [list(x) for x in xs]
    if kind == "tuple":
        return tuple(tuple(x) for x in xs)
    if kind == "numpy":
        return [np.asarray(x, dtype=rng.choice([np.int64, np.int32])) for x in xs]
    if kind == "torch":
        return [torch.tensor(x, dtype=rng.choice([torch.int64, torch.int32])) for x in xs]
    # mixed: each sequence its own container
    return [_as_kind([x], rng.choice(["list", "tuple", "numpy", "torch"]), rng)[0] for x in xs]


@pytest.mark.parametrize("kind", ["list", "tuple", "numpy", "torch", "mixed"])
@pytest.mark.parametrize("seed", range(4))
def test_same_micro_batches_as_the_per_token_loop(kind, seed):
    rng = random.Random(1000 * seed + len(kind))
    prompts, completions = _random_case(rng, rng.randint(1, 60), 40)
    # a sequence longer than max_tokens alone, somewhere in the middle
    at = rng.randrange(len(prompts) + 1)
    prompts.insert(at, [rng.randrange(50_000) for _ in range(30)])
    completions.insert(at, [rng.randrange(50_000) for _ in range(50)])
    p, c = _as_kind(prompts, kind, rng), _as_kind(completions, kind, rng)
    for max_tokens in (1, 17, 64, 10_000):
        got = pack_sequences(p, c, max_tokens, DEVICE)  # on a GPU: the pinned non-blocking copies
        _assert_same(got, _reference(prompts, completions, max_tokens, DEVICE))
        if max_tokens == 64:
            assert any(int(mb.cu_seqlens[-1]) > 64 for mb in got)  # the long one sits alone
            assert all(len(mb.seqs) == 1 for mb in got if int(mb.cu_seqlens[-1]) > 64)


def test_edge_cases():
    # all completions empty: no rows anywhere, still one micro-batch per group
    got = pack_sequences([[5], [6, 7]], [[], []], 8, torch.device("cpu"))
    _assert_same(got, _reference([[5], [6, 7]], [[], []], 8, "cpu"))
    assert got[0].rows.numel() == 0 and got[0].owners == [] and got[0].flat == slice(0, 0)
    # nothing to pack
    assert pack_sequences([], [], 8, "cpu") == []
    # a torch row of a 2-D batch, and a non-contiguous view
    batch = torch.arange(40, dtype=torch.int64).reshape(4, 10)
    p, c = [batch[0, :3], batch[1, ::2]], [batch[2, :4], batch[3, 1::3]]
    ref = _reference([t.tolist() for t in p], [t.tolist() for t in c], 9, "cpu")
    _assert_same(pack_sequences(p, c, 9, "cpu"), ref)


def test_owners_are_cached_and_settable_fields_stay_fields():
    (mb,) = pack_sequences([[1, 2]], [[3, 4, 5]], 100, "cpu")
    assert mb.owners == [(0, 0), (0, 1), (0, 2)] and mb.owners is mb.owners
    direct = MicroBatch(seqs=[3], input_ids=mb.input_ids, cu_seqlens=mb.cu_seqlens, rows=mb.rows,
                        flat=slice(0, 3), completion_lengths=[3])
    assert direct.owners == [(3, 0), (3, 1), (3, 2)]


def test_mismatched_lengths_name_the_counts():
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        pack_sequences([[1], [2], [3]], [[4], [5]], 16, "cpu")


@pytest.mark.parametrize("prompts, completions, message", [
    ([torch.tensor([1.7, 2.2])], [[3]], "prompt 0: token ids must be integers, got dtype float32"),
    ([[1, 2]], [np.array([3.0])], "completion 0: token ids must be integers, got dtype float64"),
    ([[1], torch.tensor([[5, 6]])], [[2], [7]], r"prompt 1: token ids must be 1-D, got shape \[1, 2\]"),
    ([np.array([2 ** 63 + 5], dtype=np.uint64)], [[1]], "does not fit in int64"),
    ([[1], []], [[2], [3, 4]], "sequence 1 has a completion but an empty prompt"),
])
def test_bad_token_ids_are_refused_by_name(prompts, completions, message):
    """Ids are never truncated or reshaped into something else: floats, a [1, n] tokenizer row, ids past
    int64 and a completion without a prompt token to score it are refused with the sequence named."""
    with pytest.raises(ValueError, match=message):
        pack_sequences(prompts, completions, 16, "cpu")
