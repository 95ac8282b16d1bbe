"""Op taps: every op output of the forward program, named ``layer.sublayer.op``, the same on both engines.

The tap points are one line each in :mod:`unified_models.forward` and the layer
families (:mod:`unified_models.layers`)::

    if taps.SINK is not None: y = taps.SINK(f"{p}.in_proj", y)

so with taps off (``SINK is None``, the default) a forward pays one module
attribute read and one ``is`` test per op, and the values are untouched. A
sink is any callable ``(hf_name, tensor) -> tensor`` with a ``begin(batch)``
method (called once per :func:`~unified_models.forward.forward_hidden`, before
the first op); :class:`TapRecorder` records copies, and in tests can change one
element of one op by one ulp (:class:`Perturbation`) to prove that
:mod:`.bisect` finds it.

Tap names (:func:`tap_name`): the HF module name of the op's owner without the
model's root (``backbone.`` / ``model.``) plus the op, e.g.
``layers.3.mixer.in_proj``, ``layers.3.mixer.ssm_scan``, ``layers.3.norm``;
model-level ones are ``embedding``, ``final_norm``, ``logits`` (fp32 LM head)
and ``logprobs``. Sublayer-level ones: ``<norm>`` (normed sublayer input),
``<mixer>`` (mixer output) and ``<mixer>.residual`` (the stream after the add).

Rows: a tap tensor whose dim 0 is the batch's T tokens is keyed per row by
``(sequence, position)`` (sequence = ``FlatBatch.seq_idx`` + the recorder's
``seq_offset``); one with one row per sequence (vLLM's ``compute_logits`` rows:
the last scheduled token of each request) by each sequence's last position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["SINK", "Perturbation", "TapRecorder", "TapRecords", "recording", "tap_name"]

SINK: Callable[[str, Any], Any] | None = None
"""The active sink, or ``None`` (taps off). Set through :func:`recording`."""

_ROOTS = ("backbone.", "model.", "transformer.")
_MODEL_LEVEL = {"embedding", "final_norm", "logits", "logprobs"}


def tap_name(hf_name: str) -> str:
    """``backbone.layers.3.mixer.in_proj`` -> ``layers.3.mixer.in_proj``; model-level names pass through."""
    for root in _ROOTS:
        if hf_name.startswith(root):
            return hf_name[len(root):]
    return hf_name


@dataclass(frozen=True)
class Perturbation:
    """Test-only: add one ulp (``torch.nextafter`` towards +inf) to one element of one tap's output.

    Attributes:
        name: tap name (:func:`tap_name` form), e.g. ``layers.1.mixer.attn``.
        sequence, position: the row to change (the first forward that computes it).
        element: flat index of the element inside the row.
    """

    name: str
    sequence: int = 0
    position: int = 0
    element: int = 0

    @staticmethod
    def parse(text: str) -> "Perturbation":
        """``NAME[@SEQ:POS[:ELEMENT]]`` (the test-only ``UM_BISECT_PERTURB`` value).

        Raises:
            ValueError: a malformed value (names it).
        """
        name, _, where = text.partition("@")
        try:
            nums = [int(v) for v in where.split(":")] if where else []
        except ValueError:
            raise ValueError(f"perturbation {text!r}: expected NAME[@SEQ:POS[:ELEMENT]] with integers") from None
        if not name or len(nums) not in (0, 2, 3):
            raise ValueError(f"perturbation {text!r}: expected NAME[@SEQ:POS[:ELEMENT]]")
        return Perturbation(name, *nums)


@dataclass
class TapRecords:
    """What one side recorded: per tap name, the row keys and the rows.

    Attributes:
        order: tap names in the order the forward first computed them.
        chunks: name -> list of ``(keys [n, 2] int64 (sequence, position), rows [n, ...])`` on the CPU.
        shapes, dtypes: name -> the first recorded tensor's full shape and dtype.
        unmapped: name -> how many tensors had a row count that maps to no (sequence, position).
        excused: name -> the ``(sequence, position)`` rows this side asks not to compare, with why
            (a reference whose op makes a discrete choice there within the other side's rounding:
            :func:`~.reference_taps.reference_on_engine_inputs`).
    """

    order: list[str] = field(default_factory=list)
    chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    unmapped: dict[str, int] = field(default_factory=dict)
    excused: dict[str, dict[tuple[int, int], str]] = field(default_factory=dict)

    def rows(self, name: str) -> dict[tuple[int, int], torch.Tensor]:
        """``(sequence, position) -> row`` of one tap; the first computed row wins (a padded
        row of a later step that repeats a key is ignored)."""
        out: dict[tuple[int, int], torch.Tensor] = {}
        for keys, rows in self.chunks.get(name, []):
            for (s, p), r in zip(keys.tolist(), rows):
                out.setdefault((s, p), r)
        return out


class TapRecorder:
    """A sink that keeps a CPU copy of every tapped row (and can perturb one, for tests).

    Args:
        perturb: test-only :class:`Perturbation` applied to this side's forward.
        names: record only these tap names (default: all).
    """

    def __init__(self, perturb: Perturbation | None = None, names: set[str] | None = None):
        self.records = TapRecords()
        self.perturb = perturb
        self.perturbed = False
        self.names = names
        self.seq_offset = 0
        self._seq: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    def begin(self, batch) -> None:
        """Called by ``forward_hidden`` once per forward: the rows' ``(sequence, position)`` keys."""
        seq = batch.seq_idx.detach().long().cpu() + self.seq_offset
        pos = batch.positions.detach().long().cpu()
        self._seq, self._pos = seq, pos
        last = {}
        for i, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
            last[s] = i  # rows of a sequence are consecutive: the last one wins
        self._last = torch.tensor([last[s] for s in sorted(last)], dtype=torch.long)

    def _keys(self, n: int) -> torch.Tensor | None:
        if self._seq is None:
            return None
        if n == self._seq.shape[0]:
            return torch.stack([self._seq, self._pos], 1)
        if n == self._last.shape[0]:
            return torch.stack([self._seq[self._last], self._pos[self._last]], 1)
        return None

    def __call__(self, hf_name: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        name = tap_name(hf_name)
        if self.names is not None and name not in self.names:
            return x
        keys = self._keys(x.shape[0]) if x.dim() else None
        if self.perturb is not None and not self.perturbed and name == self.perturb.name and keys is not None:
            x = self._apply_perturbation(x, keys)
        rec = self.records
        if name not in rec.shapes:
            rec.order.append(name)
            rec.shapes[name], rec.dtypes[name] = tuple(x.shape), x.dtype
        if keys is None:
            rec.unmapped[name] = rec.unmapped.get(name, 0) + 1
        else:
            rec.chunks.setdefault(name, []).append((keys, x.detach().to("cpu", copy=True)))
        return x

    def _apply_perturbation(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        pt = self.perturb
        hit = ((keys[:, 0] == pt.sequence) & (keys[:, 1] == pt.position)).nonzero()
        if not hit.numel() or not x.is_floating_point():
            return x
        row = int(hit[0])
        y = x.clone()
        flat = y[row].reshape(-1)
        v = flat[pt.element:pt.element + 1]
        flat[pt.element] = torch.nextafter(v, torch.full_like(v, float("inf")))[0]
        y[row] = flat.view(y[row].shape)
        self.perturbed = True
        return y


class recording:
    """Context manager: ``with recording(sink): ...`` turns taps on for the block (then off again).

    Raises:
        RuntimeError: taps are already on (recordings do not nest).
    """

    def __init__(self, sink):
        self.sink = sink

    def __enter__(self):
        global SINK
        if SINK is not None:
            raise RuntimeError("porting.taps: a recording is already active")
        SINK = self.sink
        return self.sink

    def __exit__(self, *exc) -> None:
        global SINK
        SINK = None
