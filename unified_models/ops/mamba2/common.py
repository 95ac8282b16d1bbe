"""The Mamba-2 state and batch layouts shared by the dispatch, the CPU path, the
kernels' callers and the backward: :class:`Mamba2State` (per-slot cache),
:class:`Mamba2Metadata` and :func:`mamba2_metadata` (where every token, chunk
item and state row of one batch lives). The layouts: :mod:`unified_models.ops.mamba2`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._dispatch import host_to_device


@dataclass
class Mamba2State:
    """Per-slot cache of one Mamba-2 layer (see the package docstring for the layout).

    The tensors may be views with any strides (a vLLM state cache hands strided
    views of one allocation); the leading dim is the slot.
    """

    conv: torch.Tensor  # [S, W-1, C] model dtype
    ssm: torch.Tensor   # [S, H, P, N] fp32
    x: torch.Tensor     # [S, Q-1, H, P] model dtype
    dt: torch.Tensor    # [S, Q-1, H] fp32
    B: torch.Tensor     # [S, Q-1, G, N] model dtype

    @staticmethod
    def shapes(*, num_heads: int, head_dim: int, n_groups: int, state_size: int, conv_width: int,
               chunk_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Per-slot shape and dtype role (``"model"`` or ``"fp32"``) of each tensor."""
        H, P, G, N = num_heads, head_dim, n_groups, state_size
        C = H * P + 2 * G * N
        return {"conv": ((conv_width - 1, C), "model"), "ssm": ((H, P, N), "fp32"),
                "x": ((chunk_size - 1, H, P), "model"), "dt": ((chunk_size - 1, H), "fp32"),
                "B": ((chunk_size - 1, G, N), "model")}

    @classmethod
    def allocate(cls, num_slots: int, *, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_width: int, chunk_size: int, dtype: torch.dtype, device="cpu",
                 fill: float | None = None) -> "Mamba2State":
        """Allocate ``num_slots`` slots (uninitialised, or filled with ``fill``)."""
        t = {}
        for name, (shape, role) in cls.shapes(num_heads=num_heads, head_dim=head_dim, n_groups=n_groups,
                                              state_size=state_size, conv_width=conv_width,
                                              chunk_size=chunk_size).items():
            dt_ = torch.float32 if role == "fp32" else dtype
            t[name] = (torch.empty((num_slots, *shape), dtype=dt_, device=device) if fill is None
                       else torch.full((num_slots, *shape), fill, dtype=dt_, device=device))
        return cls(**t)

    @property
    def chunk_size(self) -> int:
        return self.x.shape[1] + 1

    def check(self, H: int, P: int, G: int, N: int, C: int | None = None, W: int | None = None) -> None:
        S = self.ssm.shape[0]
        want = {"ssm": (S, H, P, N), "x": (S, self.chunk_size - 1, H, P), "dt": (S, self.chunk_size - 1, H),
                "B": (S, self.chunk_size - 1, G, N)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Mamba2State.{name}: shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if self.ssm.dtype != torch.float32 or self.dt.dtype != torch.float32:
            raise ValueError("Mamba2State: ssm and dt must be fp32")
        if C is not None and (self.conv.dim() != 3 or self.conv.shape[0] != S or self.conv.shape[2] != C
                              or (W is not None and self.conv.shape[1] != W - 1)):
            raise ValueError(f"Mamba2State.conv: shape {tuple(self.conv.shape)}, expected ({S}, {W and W - 1}, {C})")


@dataclass
class Mamba2Metadata:
    """Where every token, chunk item and state row of one batch lives (one per forward).

    Host-side counts are plain ints (kernel grids); index tensors live on the
    batch's device (int32/int64). Item ``u`` is chunk ``item_chunk[u]`` (absolute
    chunk index) of sequence ``item_seq[u]``; a sequence's items are contiguous
    and in chunk order. ``entries`` are the states after each COMPLETE item
    (its last row is in this batch), in the same order.
    """

    chunk_size: int
    num_tokens: int
    has_state: bool
    # per sequence [B] (padding sequences have seq_len 0)
    cu_seqlens: torch.Tensor
    start_pos: torch.Tensor
    seq_len: torch.Tensor
    slot: torch.Tensor
    seq_item_ptr: torch.Tensor   # [B+1]
    seq_entry_ptr: torch.Tensor  # [B+1]
    # per token [T]: sequence (-1: padding) and position
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    token_item: torch.Tensor
    # per item [U]
    item_seq: torch.Tensor
    item_chunk: torch.Tensor
    item_rank: torch.Tensor
    num_items: int
    num_entries: int
    state_seqs: torch.Tensor     # [Bs] sequences with at least one complete item
    # cache writes (host-built index lists)
    commit_slot: torch.Tensor    # [Bc] slot <- entries[commit_entry]
    commit_entry: torch.Tensor
    pend_token: torch.Tensor     # [Tp] token rows kept as pending rows
    pend_slot: torch.Tensor
    pend_index: torch.Tensor
    conv_seqs: torch.Tensor      # [Bw] sequences whose conv state is written
    # host copies (lists) for the CPU implementations
    host: dict
    # True: built by :func:`mamba2_decode_metadata` (every sequence at most one token, all on
    # the device, fixed shapes; the kernels commit the state themselves: ``decode.py``)
    uniform_decode: bool = False


def start_positions(cu_seqlens_B1: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """``start_pos[b]`` = position of sequence b's first token (0 for empty sequences)."""
    cu = cu_seqlens_B1.long()
    first = cu[:-1].clamp(max=max(positions_T.shape[0] - 1, 0))
    if positions_T.shape[0] == 0:
        return torch.zeros_like(cu[:-1])
    return torch.where(cu[1:] > cu[:-1], positions_T.long()[first], torch.zeros_like(first))


def mamba2_metadata(cu_seqlens_B1: torch.Tensor, start_pos_B: torch.Tensor, chunk_size: int,
                    num_tokens: int | None = None, state_idx_B: torch.Tensor | None = None,
                    host_layout: tuple[np.ndarray, np.ndarray] | None = None,
                    layout_cache: dict | None = None) -> Mamba2Metadata:
    """Build the batch description shared by every Mamba layer of one forward.

    Args:
        cu_seqlens_B1: int ``[B+1]``, token rows of each sequence (non-decreasing, from 0).
        start_pos_B: int ``[B]``, position of each sequence's first token in this
            batch = tokens already in its state.
        chunk_size: Q (config ``chunk_size``).
        num_tokens: T, rows of the batch (default ``cu_seqlens[-1]``); rows past
            ``cu_seqlens[-1]`` are padding.
        state_idx_B: int ``[B]`` state slot per sequence (``< 0``: padding
            sequence). ``None``: no state (training over whole sequences), every
            ``start_pos`` must be 0.

        host_layout: optional ``(cu_seqlens, start_pos)`` as host int arrays equal to the two
            tensors, from a caller that has them on the host already (vLLM's runner keeps
            ``query_start_loc`` and ``seq_lens`` on the host), given only with ``state_idx_B``
            whose entries are ``>= 0`` exactly for the sequences with rows (vLLM's builder sets -1
            for requests without tokens). Then nothing is read from the device (no wait for the
            stream); the slot-dependent fields are gathered on the device, and ``host["slot"]``
            (what the CPU implementations and the backward read) is filled only for CPU tensors
            (None for GPU ones: Triton kernels only).
        layout_cache: optional dict the caller keeps for one forward (e.g. ``LayerContext.cache``).
            With ``host_layout``, everything but the slots depends on the layout alone, so it is
            built and uploaded once per layout and device and shared by every slot-state group of
            the step (vLLM gives each group its own slots, the same ``query_start_loc`` and
            positions); each call then only gathers its slots on the device. The same integers
            as without it.

    Raises:
        ValueError: malformed boundaries, negative positions, ``start_pos > 0``
            without state, bad chunk size, ``host_layout`` without ``state_idx_B``.

    Without ``host_layout`` this reads the (small) index tensors on the host once per call.
    """
    Q = int(chunk_size)
    if Q < 1:
        raise ValueError(f"mamba2: chunk_size {chunk_size} must be >= 1")
    dev = cu_seqlens_B1.device
    has_state = state_idx_B is not None
    # host arithmetic in numpy: single-threaded, a few microseconds per op (torch's CPU ops on these
    # int64 vectors took ~0.4 ms each on the H200 host: profile_ours_64x256-2048.txt, session 29)
    hinted = host_layout is not None
    if hinted:
        if state_idx_B is None:
            raise ValueError("mamba2: host_layout needs state_idx_B (the slots stay on the device)")
        cu = np.asarray(host_layout[0], dtype=np.int64).reshape(-1)
        p0 = np.asarray(host_layout[1], dtype=np.int64).reshape(-1)
        if cu.shape[0] != state_idx_B.shape[0] + 1:
            raise ValueError(f"mamba2: state_idx must be [B={cu.shape[0] - 1}], got {state_idx_B.shape[0]}")
        shared_key = ("mamba2_layout", Q, num_tokens, str(cu_seqlens_B1.device), cu.tobytes(), p0.tobytes())
        if layout_cache is not None and shared_key in layout_cache:
            return _with_slots(layout_cache[shared_key], state_idx_B)
        slot = np.where(cu[1:] > cu[:-1], 0, -1)  # liveness only: the slot values stay on the device
    else:
        cu, p0, slot = _read_to_host(cu_seqlens_B1, start_pos_B, state_idx_B)
    B = cu.shape[0] - 1
    if B < 0 or p0.shape[0] != B or int(cu[0]) != 0:
        raise ValueError(f"mamba2: cu_seqlens must be [B+1] from 0 and start_pos [B]; got {cu.shape[0]} / "
                         f"{p0.shape[0]}")
    n_rows = cu[1:] - cu[:-1]
    if (n_rows < 0).any():
        raise ValueError("mamba2: cu_seqlens must be non-decreasing")
    T = int(cu[-1]) if num_tokens is None else int(num_tokens)
    if int(cu[-1]) > T:
        raise ValueError(f"mamba2: cu_seqlens ends at {int(cu[-1])} > num_tokens {T}")
    if (p0 < 0).any():
        raise ValueError("mamba2: start_pos must be >= 0")
    if slot is None:
        slot = np.zeros(B, dtype=np.int64)
    if slot.shape[0] != B:
        raise ValueError(f"mamba2: state_idx must be [B={B}], got {slot.shape[0]}")
    if not has_state and (p0 != 0).any():
        raise ValueError("mamba2: start_pos > 0 needs a state (pass state_idx and a Mamba2State)")
    L = np.where(slot >= 0, n_rows, 0)
    live = L > 0
    end = p0 + L
    # items: chunks k0..k1 of each sequence; entries: its complete chunks (all but maybe the last)
    n_items = np.where(live, np.maximum(end - 1, 0) // Q - p0 // Q + 1, 0)
    n_complete = np.where(live, end // Q - p0 // Q, 0)
    item_ptr = np.concatenate([[0], np.cumsum(n_items)]).astype(np.int64)
    ent_ptr = np.concatenate([[0], np.cumsum(n_complete)]).astype(np.int64)
    U = int(item_ptr[-1])
    item_seq = np.repeat(np.arange(B, dtype=np.int64), n_items)
    item_rank = np.arange(U, dtype=np.int64) - item_ptr[item_seq]
    item_chunk = p0[item_seq] // Q + item_rank
    # tokens
    row_seq = np.repeat(np.arange(B, dtype=np.int64), n_rows)  # sequence of each covered row
    n_cov = row_seq.shape[0]
    rows = np.arange(n_cov, dtype=np.int64)
    real = live[row_seq]
    token_seq = np.full(T, -1, dtype=np.int64)
    token_pos = np.zeros(T, dtype=np.int64)
    token_item = np.zeros(T, dtype=np.int64)
    pos = p0[row_seq] + rows - cu[row_seq]
    token_seq[:n_cov] = np.where(real, row_seq, -1)
    token_pos[:n_cov] = np.where(real, pos, 0)
    token_item[:n_cov] = np.where(real, item_ptr[row_seq] + pos // Q - p0[row_seq] // Q, 0)
    state_seqs = np.flatnonzero(live & (n_complete > 0))
    if has_state:
        commit_slot, commit_entry = slot[state_seqs], ent_ptr[state_seqs + 1] - 1
        boundary = (end // Q) * Q
        keep = np.flatnonzero(real & (pos >= boundary[row_seq]))
        pend_token, pend_slot = keep, slot[row_seq[keep]]
        pend_index = pos[keep] - boundary[row_seq[keep]]
        conv_seqs = np.flatnonzero(live)
    else:
        commit_slot = commit_entry = pend_token = pend_slot = pend_index = conv_seqs = np.zeros(0, dtype=np.int64)

    t = torch.from_numpy
    pend_seq = row_seq[keep] if has_state else np.zeros(0, dtype=np.int64)
    if hinted:  # the slots are added per group (_with_slots)
        slot = None
    host = dict(cu=cu.tolist(), start_pos=p0.tolist(), seq_len=L.tolist(), slot=None if slot is None else slot.tolist(),
                item_seq=item_seq.tolist(), item_chunk=item_chunk.tolist(), item_rank=item_rank.tolist(),
                seq_item_ptr=item_ptr.tolist(), seq_entry_ptr=ent_ptr.tolist(), conv_seqs=conv_seqs.tolist(),
                cpu=dict(cu=t(cu), p0=t(p0), L=t(L), slot=None if slot is None else t(slot), item_seq=t(item_seq),
                         item_chunk=t(item_chunk),
                         token_seq=t(token_seq), token_pos=t(token_pos), live=t(live)),
                layout_ops={})  # what ops derive from the layout alone: one dict shared by the step's slot groups
    fields = dict(cu_seqlens=(cu, torch.int32), start_pos=(p0, torch.int64), seq_len=(L, torch.int32),
                  slot=(slot, torch.int64), seq_item_ptr=(item_ptr, torch.int32), seq_entry_ptr=(ent_ptr, torch.int32),
                  token_seq=(token_seq, torch.int32), token_pos=(token_pos, torch.int64),
                  token_item=(token_item, torch.int64), item_seq=(item_seq, torch.int32),
                  item_chunk=(item_chunk, torch.int64), item_rank=(item_rank, torch.int32),
                  state_seqs=(state_seqs, torch.int32), commit_slot=(commit_slot, torch.int64),
                  commit_entry=(commit_entry, torch.int64), pend_token=(pend_token, torch.int64),
                  pend_slot=(pend_slot, torch.int64), pend_index=(pend_index, torch.int64),
                  conv_seqs=(conv_seqs, torch.int64))
    if hinted:  # the slots are on the device only: gather them there
        for name in ("slot", "commit_slot", "pend_slot"):
            del fields[name]
        fields.update(commit_seq_=(state_seqs, torch.int64), pend_seq_=(pend_seq, torch.int64))
    on_dev = _to_device(fields, dev)
    if hinted:
        layout = _SlotFreeLayout(fields=on_dev, host=host, chunk_size=Q, num_tokens=T, num_items=U,
                                 num_entries=int(ent_ptr[-1]))
        if layout_cache is not None:
            layout_cache[shared_key] = layout
        return _with_slots(layout, state_idx_B)
    return Mamba2Metadata(chunk_size=Q, num_tokens=T, has_state=has_state, num_items=U, num_entries=int(ent_ptr[-1]),
                          host=host, **on_dev)


@dataclass(frozen=True)
class _SlotFreeLayout:
    """What :func:`mamba2_metadata` builds from a host layout alone (every field but the slots)."""

    fields: dict
    host: dict
    chunk_size: int
    num_tokens: int
    num_items: int
    num_entries: int


def _with_slots(layout: _SlotFreeLayout, state_idx_B: torch.Tensor) -> Mamba2Metadata:
    """The metadata of one slot-state group: ``layout`` plus its slots, gathered on the device."""
    on_dev = dict(layout.fields)
    dev = on_dev["cu_seqlens"].device
    slot_dev = state_idx_B.detach().reshape(-1).to(device=dev, dtype=torch.int64)
    on_dev.update(slot=slot_dev, commit_slot=slot_dev[on_dev.pop("commit_seq_")],
                  pend_slot=slot_dev[on_dev.pop("pend_seq_")])
    host = dict(layout.host)  # per group: ops cache their group's slot-dependent indices in it
    if state_idx_B.device.type == "cpu":  # host copies of the slots only where reading them costs no wait
        slot = state_idx_B.detach().to(torch.int64).numpy()
        host.update(slot=slot.tolist(), cpu=dict(host["cpu"], slot=torch.from_numpy(slot)))
    return Mamba2Metadata(chunk_size=layout.chunk_size, num_tokens=layout.num_tokens, has_state=True,
                          num_items=layout.num_items, num_entries=layout.num_entries, host=host, **on_dev)


def _read_to_host(cu_B1: torch.Tensor, start_B: torch.Tensor, slot_B: torch.Tensor | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``cu_seqlens``, ``start_pos`` and the slots as int64 numpy arrays, read in ONE device-to-host
    copy when they live on a GPU (each blocking copy waits for the whole stream: three separate
    reads were three waits per Mamba KV-cache group and step)."""
    parts = [cu_B1.detach().reshape(-1), start_B.detach().reshape(-1)]
    if slot_B is not None:
        parts.append(slot_B.detach().reshape(-1))
    sizes = [x.shape[0] for x in parts]
    if all(x.device.type == "cpu" for x in parts):
        out = [x.to(torch.int64).numpy() for x in parts]
    else:
        flat = torch.cat([x.to(device=cu_B1.device, dtype=torch.int64) for x in parts]).cpu().numpy()
        out = np.split(flat, np.cumsum(sizes)[:-1])
    return out[0], out[1], (out[2] if slot_B is not None else None)


def _to_device(fields: dict[str, tuple[np.ndarray, torch.dtype]], dev: torch.device) -> dict[str, torch.Tensor]:
    """Each host index array as a tensor on ``dev`` in its dtype. On a GPU all of them go in ONE
    non-blocking copy from pinned memory, then are cut out as views (:func:`_pack_fields`): a blocking copy from pageable
    memory waits for the stream, and there were 19 per call (the GPU idled while the host built the
    rest; ``benchmarks/results/h200_session29/profile_ours_64x256-2048.txt``). Integer values: the
    same numbers either way."""
    if dev.type == "cpu":
        return {k: torch.from_numpy(np.ascontiguousarray(v)).to(dtype) for k, (v, dtype) in fields.items()}
    packed, spans = _pack_fields(fields)
    return _unpack_fields(host_to_device(packed, dev), spans)


def _pack_fields(fields: dict[str, tuple[np.ndarray, torch.dtype]]) -> tuple[torch.Tensor, dict]:
    """Every field in its own dtype (int32/int64) at a 16-byte aligned offset of one uint8 host
    buffer, so that one copy moves them all and views cut them out on the device (no cast kernel per
    field: 19 launches per :func:`mamba2_metadata` before). 16 bytes: the alignment Triton
    specializes pointer arguments on, so a field's kernel variant does not depend on its
    neighbours' lengths. Returns the buffer and ``{name: (byte offset, bytes, dtype)}``."""
    parts, spans, off = [], {}, 0
    for k, (v, dtype) in fields.items():
        raw = np.ascontiguousarray(np.asarray(v).reshape(-1).astype(_NP_INT[dtype])).view(np.uint8)
        spans[k] = (off, raw.size, dtype)
        pad = -raw.size % _FIELD_ALIGN
        parts += [raw, np.zeros(pad, dtype=np.uint8)]
        off += raw.size + pad
    if not off:  # torch.from_numpy of an empty array has stride 0, which view(dtype) refuses
        return torch.zeros(0, dtype=torch.uint8), spans
    return torch.from_numpy(np.concatenate(parts)), spans


def _unpack_fields(packed: torch.Tensor, spans: dict) -> dict[str, torch.Tensor]:
    """The fields of :func:`_pack_fields`'s buffer (on any device) as views in their dtypes."""
    return {k: packed[o:o + n].view(dtype) for k, (o, n, dtype) in spans.items()}


_NP_INT = {torch.int32: np.int32, torch.int64: np.int64}
_FIELD_ALIGN = 16


def mamba2_decode_metadata(cu_seqlens_B1: torch.Tensor, start_pos_B: torch.Tensor, state_idx_B: torch.Tensor,
                           chunk_size: int, num_tokens: int) -> Mamba2Metadata:
    """The metadata of a uniform decode step (every sequence 0 or 1 token), built on the device.

    The same description as :func:`mamba2_metadata` for such a batch, but with no host read
    and shapes fixed by ``B`` and ``T`` alone, so that a CUDA graph captured at one padded
    batch replays with any batch of that size (vLLM ``FULL_DECODE_ONLY``): item ``b`` is
    sequence ``b``'s current chunk (``num_items = B``; a sequence with no token this step is
    an item with no row, which every kernel skips), ``num_entries = B`` is an upper bound
    (only sequences whose token completes a chunk have an entry), and the state writes
    (boundary state, pending row, conv tail) are done by the decode kernels of
    :mod:`.decode` from ``slot`` / ``start_pos`` / ``seq_len`` instead of host index lists.
    The kernels read each row from the same places with the same tiles as under
    :func:`mamba2_metadata`, so a decode token's bits are the same under either.

    Args:
        cu_seqlens_B1: int ``[B+1]``, vLLM's ``query_start_loc`` (0 or 1 rows per sequence).
        start_pos_B: int ``[B]``, tokens already folded into each slot.
        state_idx_B: int ``[B]``, slot of each sequence (``< 0``: no token / padding).
        chunk_size: Q; num_tokens: T (rows of the batch, padding rows past ``cu[B]``).

    Returns:
        :class:`Mamba2Metadata` with ``uniform_decode=True`` and ``host == {}`` (the CPU
        implementations need :func:`mamba2_metadata`).

    Raises:
        ValueError: mismatched shapes or a bad chunk size (values are not checked: no host read).
    """
    Q, T = int(chunk_size), int(num_tokens)
    if Q < 2:
        raise ValueError(f"mamba2_decode_metadata: chunk_size {chunk_size} must be >= 2")
    B = state_idx_B.shape[0]
    if cu_seqlens_B1.shape[0] != B + 1 or start_pos_B.shape[0] != B:
        raise ValueError(f"mamba2_decode_metadata: cu_seqlens [{cu_seqlens_B1.shape[0]}], start_pos "
                         f"[{start_pos_B.shape[0]}] and state_idx [{B}] must be [B+1], [B], [B]")
    dev = state_idx_B.device
    cu = cu_seqlens_B1.to(device=dev, dtype=torch.int64)
    slot = state_idx_B.to(torch.int64)
    live = ((cu[1:] - cu[:-1]) > 0) & (slot >= 0)
    zero = torch.zeros_like(slot)
    p0 = torch.where(live, start_pos_B.to(device=dev, dtype=torch.int64), zero)
    L = live.to(torch.int64)
    slot = torch.where(live, slot, zero)
    ar = torch.arange(B, device=dev, dtype=torch.int64)
    complete = live & ((p0 + 1) % Q == 0)
    ent_ptr = torch.cat([zero[:1], complete.to(torch.int64).cumsum(0)]) if B else zero.new_zeros(1)
    # token rows: row cu[b] holds sequence b's token (scattered; dead sequences write row T, cut off)
    row = torch.where(live, cu[:-1], torch.full_like(cu[:-1], T))
    token_seq = torch.full((T + 1,), -1, dtype=torch.int64, device=dev).scatter(0, row, torch.where(live, ar, -1))
    token_pos = torch.zeros(T + 1, dtype=torch.int64, device=dev).scatter(0, row, p0)
    token_item = torch.zeros(T + 1, dtype=torch.int64, device=dev).scatter(0, row, ar)

    def i32(v):
        return v.to(torch.int32)

    empty = zero[:0]
    return Mamba2Metadata(
        chunk_size=Q, num_tokens=T, has_state=True,
        cu_seqlens=i32(cu), start_pos=p0, seq_len=i32(L), slot=slot,
        seq_item_ptr=i32(torch.arange(B + 1, device=dev)), seq_entry_ptr=i32(ent_ptr),
        token_seq=i32(token_seq[:T]), token_pos=token_pos[:T], token_item=token_item[:T],
        item_seq=i32(ar), item_chunk=p0 // Q, item_rank=i32(zero),
        num_items=B, num_entries=B, state_seqs=i32(ar),
        commit_slot=empty, commit_entry=empty, pend_token=empty, pend_slot=empty, pend_index=empty,
        conv_seqs=empty, host={}, uniform_decode=True)


def _need_state(meta: Mamba2Metadata, state: Mamba2State | None, name: str) -> None:
    if meta.has_state and state is None:
        raise ValueError(f"{name}: the metadata has state slots but no Mamba2State was given")
    if not meta.has_state and state is not None:
        raise ValueError(f"{name}: a Mamba2State was given but the metadata has no state_idx")
