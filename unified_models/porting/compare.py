"""The first divergent op between two tap recordings (:class:`~.taps.TapRecords`).

Ops are visited in the order the first side's forward computed them; within an
op, rows are matched by ``(sequence, position)``. Bitwise (``tolerance=None``):
any differing bit pattern (so ``-0.0 != +0.0``, NaN payloads count).
With a tolerance: a row differs when ``max |a - b| > tolerance * max |b|`` over
the row (``b`` is the reference side), NaN on either side always differs.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch

from .taps import TapRecords

__all__ = ["Divergence", "Comparison", "first_divergence", "layer_and_op", "bits"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor (integers as they are)."""
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}.get(t.dtype)
    return t.contiguous().view(view) if view is not None else t


def layer_and_op(name: str) -> tuple[int | None, str]:
    """``layers.3.mixer.in_proj`` -> ``(3, "mixer.in_proj")``; ``logits`` -> ``(None, "logits")``."""
    m = re.match(r"layers\.(\d+)\.(.+)$", name)
    if m:
        return int(m.group(1)), m.group(2)
    m = re.match(r"layers\.(\d+)$", name)
    return (int(m.group(1)), "") if m else (None, name)


@dataclass
class Divergence:
    """The first op whose outputs differ, and where.

    Attributes:
        name: tap name; ``layer``/``op`` its parts (:func:`layer_and_op`).
        shapes, dtypes: each side's full tap tensor (first forward that computed it), as strings.
        max_abs_diff: max |a - b| over the compared rows of this op (fp64; ``inf`` for NaN or
            mismatched shapes).
        rows_compared, rows_differing: counts over the matched ``(sequence, position)`` rows.
        sequence, position: the first differing row (sorted by sequence, then position).
        element: index of the first differing element inside that row (a tuple over the row's shape).
        token_id: the input token at that position (when the caller knows the tokens).
        value_a, value_b: the two values there.
        tolerance: ``None`` (bitwise) or the relative tolerance used.
    """

    name: str
    layer: int | None
    op: str
    sides: tuple[str, str]
    shapes: tuple[str, str]
    dtypes: tuple[str, str]
    max_abs_diff: float
    rows_compared: int
    rows_differing: int
    sequence: int
    position: int
    element: tuple[int, ...]
    token_id: int | None
    value_a: float
    value_b: float
    tolerance: float | None = None

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        d = asdict(self)
        d["element"] = list(self.element)
        return d


@dataclass
class Comparison:
    """Everything compared: ``divergence`` is ``None`` when no op differs.

    Attributes:
        only_in: side -> the ops only that side recorded.
        not_comparable: op -> why the two sides cannot be compared there (declared by the caller).
        missing: side -> the required ops (``first_divergence``'s ``required``) that are not
            declared not comparable and that side has no row of; ``"both"`` -> those both sides
            recorded but with no ``(sequence, position)`` row in common. Empty when coverage is complete.
        excused: op -> ``{"rows": n, "why": reason, "first": [sequence, position]}``: rows a side asked not
            to compare (:attr:`.taps.TapRecords.excused`: a reference's near-tie top-k), left out of
            ``rows_compared`` and of the divergence.
    """

    sides: tuple[str, str]
    ops_compared: list[str] = field(default_factory=list)
    rows_compared: int = 0
    only_in: dict[str, list[str]] = field(default_factory=dict)
    divergence: Divergence | None = None
    not_comparable: dict[str, str] = field(default_factory=dict)
    missing: dict[str, list[str]] = field(default_factory=dict)
    excused: dict[str, dict] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every required op (not declared not comparable) has rows on both sides."""
        return not any(self.missing.values())

    @property
    def incomplete(self) -> str | None:
        """``incomplete: N ops had no counterpart on the SIDE: [...]`` (each side that lacks some), or
        None when coverage is complete."""
        if self.complete:
            return None
        parts = []
        for side, names in self.missing.items():
            if names:
                where = "rows on both sides but none in common" if side == "both" else f"no counterpart on the {side}"
                parts.append(f"{len(names)} ops had {where}: {names}")
        return "incomplete: " + "; ".join(parts)

    @property
    def verdict(self) -> str:
        """One line: ``divergent op: NAME``, else :attr:`incomplete`, else ``no divergent op``. A
        divergence is named even when coverage is incomplete (``missing`` still lists the ops)."""
        if self.divergence is not None:
            return f"divergent op: {self.divergence.name}"
        return self.incomplete or "no divergent op"

    def as_dict(self) -> dict:
        """JSON-ready fields."""
        return {"sides": list(self.sides), "verdict": self.verdict, "complete": self.complete,
                "ops_compared": len(self.ops_compared), "op_names": self.ops_compared,
                "rows_compared": self.rows_compared, "only_in": self.only_in, "missing": self.missing,
                "not_comparable": self.not_comparable, "excused": self.excused,
                "divergence": None if self.divergence is None else self.divergence.as_dict()}


def _missing(a: TapRecords, b: TapRecords, sides: tuple[str, str], required, not_comparable) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {sides[0]: [], sides[1]: [], "both": []}
    for name in required:
        if name in not_comparable:
            continue
        ra, rb = a.rows(name), b.rows(name)
        if not ra or not rb:
            for side, rows in zip(sides, (ra, rb)):
                if not rows:
                    out[side].append(name)
        elif not set(ra) & set(rb):
            out["both"].append(name)
    return {k: v for k, v in out.items() if v}


def _row_differs(a: torch.Tensor, b: torch.Tensor, tolerance: float | None) -> torch.Tensor:
    """Bool ``[R]``: which stacked rows differ (``a``, ``b``: ``[R, ...]``)."""
    if tolerance is None:
        return (bits(a) != bits(b)).reshape(a.shape[0], -1).any(1)
    ad, bd = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
    diff = (ad - bd).abs()
    nan = torch.isnan(ad).any(1) | torch.isnan(bd).any(1)
    return nan | (diff.amax(1) > tolerance * bd.abs().amax(1))


def first_divergence(a: TapRecords, b: TapRecords, *, sides: tuple[str, str] = ("a", "b"),
                     tolerance: float | None = None, tokens: dict[int, list[int]] | None = None,
                     names: list[str] | None = None, required: list[str] | None = None,
                     not_comparable: dict[str, str] | None = None) -> Comparison:
    """Compare two recordings op by op (``a``'s order) and return the first divergent op.

    Args:
        a, b: the two sides' recordings (``b`` is the reference side for ``tolerance``).
        sides: the sides' names, for the report.
        tolerance: ``None`` for bitwise, else the relative bound described in the module doc.
        tokens: sequence -> its token ids, to name the token at the differing position.
        names: compare only these ops (default: every op both sides recorded).
        required: ops that must have rows on both sides for the comparison to be complete
            (:attr:`Comparison.missing` lists those that do not).
        not_comparable: op -> why it cannot be compared (excused from ``required``; reported).

    Rows either side excuses (:attr:`.taps.TapRecords.excused`) are not compared; the comparison
    counts them per op (:attr:`Comparison.excused`).

    Returns:
        :class:`Comparison`.
    """
    out = Comparison(sides=sides, not_comparable=dict(not_comparable or {}))
    out.missing = _missing(a, b, sides, required or [], out.not_comparable)
    common = [n for n in a.order if n in b.shapes and (names is None or n in names)]
    out.only_in = {sides[0]: [n for n in a.order if n not in b.shapes],
                   sides[1]: [n for n in b.order if n not in a.shapes]}
    for name in common:
        ra, rb = a.rows(name), b.rows(name)
        keys = sorted(set(ra) & set(rb))
        why = {**a.excused.get(name, {}), **b.excused.get(name, {})}
        left_out = [k for k in keys if k in why]
        if left_out:
            out.excused[name] = {"rows": len(left_out), "why": why[left_out[0]], "first": list(left_out[0])}
            keys = [k for k in keys if k not in why]
        if not keys:
            continue
        out.ops_compared.append(name)
        out.rows_compared += len(keys)
        shape_a, shape_b = ra[keys[0]].shape, rb[keys[0]].shape
        layer, op = layer_and_op(name)
        common_fields = dict(name=name, layer=layer, op=op, sides=sides,
                             shapes=(str(list(a.shapes[name])), str(list(b.shapes[name]))),
                             dtypes=(str(a.dtypes[name]).removeprefix("torch."),
                                     str(b.dtypes[name]).removeprefix("torch.")),
                             rows_compared=len(keys), tolerance=tolerance)
        if shape_a != shape_b or (tolerance is None and a.dtypes[name] != b.dtypes[name]):
            s, p = keys[0]
            out.divergence = Divergence(**common_fields, max_abs_diff=float("inf"), rows_differing=len(keys),
                                        sequence=s, position=p, element=(), token_id=_token(tokens, s, p),
                                        value_a=float("nan"), value_b=float("nan"))
            return out
        A = torch.stack([ra[k] for k in keys])
        B = torch.stack([rb[k] for k in keys])
        bad = _row_differs(A, B, tolerance)
        if not bool(bad.any()):
            continue
        r = int(bad.nonzero()[0])
        s, p = keys[r]
        ea, eb = A[r].reshape(-1), B[r].reshape(-1)
        if tolerance is None:
            el_bad = bits(ea) != bits(eb)
        else:
            d = (ea.double() - eb.double()).abs()
            el_bad = d.isnan() | (d > tolerance * eb.double().abs().max()) | (d == d.max())
        e = int(el_bad.nonzero()[0])
        diff = (A.double() - B.double()).abs()
        out.divergence = Divergence(
            **common_fields, max_abs_diff=float(diff.nan_to_num(nan=float("inf")).max()),
            rows_differing=int(bad.sum()), sequence=s, position=p,
            element=tuple(int(i) for i in torch.unravel_index(torch.tensor(e), tuple(A[r].shape))) if A[r].dim() else (),
            token_id=_token(tokens, s, p), value_a=float(ea[e]), value_b=float(eb[e]))
        return out
    return out


def _token(tokens: dict[int, list[int]] | None, s: int, p: int) -> int | None:
    if tokens is None or s not in tokens or p >= len(tokens[s]):
        return None
    return int(tokens[s][p])
