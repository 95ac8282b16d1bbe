"""Bitwise batch-invariance helpers shared by the op tests."""

from __future__ import annotations

import torch


class Inv:
    """Helpers for bitwise batch-invariance checks."""

    @staticmethod
    def padding(width: int, dtype: torch.dtype, gen: torch.Generator, scale: float):
        """``f(n) -> (rows,)``: n padding rows of ``width``, half zeros (as engines
        pad) and half junk of a very different scale (``scale``)."""
        def f(n):
            rows = torch.randn(n, width, generator=gen) * scale
            rows[: n // 2] = 0.0
            return (rows.to(dtype),)
        return f

    @staticmethod
    def bits(t: torch.Tensor) -> torch.Tensor:
        """The raw bit pattern (so -0.0 != +0.0 and NaN payloads count)."""
        t = t.detach().cpu().contiguous()
        view = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype)
        return t.view(view) if view is not None else t

    @classmethod
    def assert_bitwise(cls, a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
        assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        assert a.dtype == b.dtype, f"{what}: dtypes {a.dtype} vs {b.dtype}"
        ba, bb = cls.bits(a), cls.bits(b)
        if not torch.equal(ba, bb):
            n = int((ba != bb).sum())
            diff = (a.detach().cpu().double() - b.detach().cpu().double()).abs()
            raise AssertionError(f"{what}: {n}/{ba.numel()} elements differ bitwise "
                                 f"(max |diff| {float(diff.nan_to_num(nan=float('inf')).max())})")

    @classmethod
    def check_rows(cls, fn, inputs, pad_fn, gen: torch.Generator, *, trials: int = 3,
                   pad_counts=(0, 5, 40), prefixes=(1, 3), what: str = "") -> torch.Tensor:
        """Assert that row ``i`` of ``fn(*inputs)`` is bitwise the same whatever batch it is in.

        ``inputs`` share dim 0 (rows). Checked: each of a few rows alone, the
        prefixes ``x[:m]``, the two halves of a split, and ``trials`` random
        compositions (random subset in random order, mixed with
        ``pad_fn(n)`` padding rows at random places). Returns the full result.
        """
        T = inputs[0].shape[0]
        full = fn(*inputs)
        for i in sorted({0, T // 2, T - 1}):
            cls.assert_bitwise(fn(*(x[i:i + 1] for x in inputs)), full[i:i + 1], f"{what} row {i} alone")
        for m in prefixes:
            if m < T:
                cls.assert_bitwise(fn(*(x[:m] for x in inputs)), full[:m], f"{what} prefix [:{m}]")
        cut = int(torch.randint(1, max(T, 2), (1,), generator=gen))
        if cut < T:
            halves = torch.cat([fn(*(x[:cut] for x in inputs)), fn(*(x[cut:] for x in inputs))])
            cls.assert_bitwise(halves, full, f"{what} split at {cut}")
        for trial in range(trials):
            k = int(torch.randint(1, T + 1, (1,), generator=gen))
            idx = torch.randperm(T, generator=gen)[:k]
            n_pad = pad_counts[trial % len(pad_counts)]
            pads = pad_fn(n_pad) if n_pad else None
            batch = [x[idx] if pads is None else torch.cat([x[idx], p.to(x.device)]) for x, p in
                     zip(inputs, pads if pads is not None else [None] * len(inputs))]
            order = torch.randperm(k + n_pad, generator=gen)
            batch = [b[order.to(b.device)] for b in batch]
            out = fn(*batch)
            where = torch.argsort(order)[:k]  # where each real row landed
            cls.assert_bitwise(out[where.to(out.device)], full[idx.to(full.device)],
                               f"{what} composition {trial} ({k} rows + {n_pad} padding)")
        return full


def scattered_block_table(need: list[int], num_blocks: int, gen: torch.Generator, width: int,
                          stale: int | None = None) -> torch.Tensor:
    """A paged-cache block table (CPU int32 ``[len(need), width]``) as vLLM hands it.

    Row ``b``'s first ``need[b]`` entries are distinct blocks drawn from a random
    permutation of ``num_blocks`` (so sequences interleave in the pool); the entries
    past a sequence's end hold stale ids like vLLM's persistent table: random blocks,
    or ``stale`` everywhere (e.g. an out-of-range id).

    Raises:
        ValueError: ``sum(need) > num_blocks`` or ``max(need) > width``.
    """
    if sum(need) > num_blocks or max(need) > width:
        raise ValueError(f"need {need} does not fit {num_blocks} blocks / width {width}")
    shape = (len(need), width)
    table = (torch.randint(0, num_blocks, shape, generator=gen, dtype=torch.int32) if stale is None
             else torch.full(shape, stale, dtype=torch.int32))
    perm = torch.randperm(num_blocks, generator=gen)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n].int()
        used += n
    return table
