"""Mixture of experts (Nemotron-H): sigmoid router, relu2 experts over grouped tokens, ordered combine.

Shapes: T tokens, D expert input width (hidden, or the latent width), E routed
experts, K = top-k slots per token, R = T*K assignments, I expert intermediate
width, G expert groups.

**Router** (:func:`moe_route`; transformers ``NemotronHTopkRouter``, vLLM
``grouped_topk`` with ``scoring_func="sigmoid"``):

1. ``logits = x W^T`` from ONE fp32-output GEMM (:func:`ops.linear.linear`,
   the batch-invariant GEMM; bf16 ``x``/``W`` stay bf16 operands, any other
   mix is computed on fp32 operands);
2. ``s = sigmoid(logits)`` (fp32);
3. selection score ``c = s + e_score_correction_bias`` (fp32; the bias is
   used ONLY for selection);
4. group-limited selection when ``n_group > 1``: group score = sum of the top
   two ``c`` of each group (transformers' rule, with or without a bias; vLLM
   takes the max when a model has no correction bias), the ``topk_group``
   best groups are kept, every other expert's ``c`` becomes ``-inf``;
5. top-k of ``c`` as a **total order** (DESIGN.md rule 4): each candidate's
   key packs ``(c, index)`` into one int64, the order-preserving integer image
   of the fp32 ``c`` in the high 32 bits and ``E - 1 - index`` in the low 32
   bits, so **among equal scores the lower expert index wins** (the same rule
   ranks groups). ``-0.0`` is canonicalised to ``+0.0`` first so equal values
   are equal keys;
6. the selected slots are in **descending key order** (best first; ties by
   ascending expert index). That order is the combine's accumulation order;
7. weights = ``s`` (not ``c``) gathered at the selected experts; when
   ``norm_topk_prob``: divided by ``(w_0 + w_1 + ... + w_{K-1}) + 1e-20`` (the
   sum in slot order, transformers' epsilon); then times
   ``routed_scaling_factor`` (fp32). (vLLM scales the summed output instead;
   the two differ only by fp32 rounding. Here the scale is in the weights, as
   in transformers.)

**Experts** (:func:`moe_experts`): non-gated relu2 MLPs, ``E_e(x) =
down_e(relu(up_e x)^2)`` (``NemotronHExperts``: ``up_proj [E, I, D]``,
``down_proj [E, D, I]``; no gate projection). Assignments are grouped by
expert with a stable, batch-independent rule (sort by ``(expert, token,
slot)``) and run as a grouped GEMM whose tiles are fixed per weight shape
``(N, K)``, never by the number of tokens. Per assignment:
``h = round_x(relu(fp32(x up_e^T))^2)`` (the relu2 epilogue in fp32, ONE
rounding to the activation dtype) and ``y = fp32(h down_e^T)``; the GEMMs
accumulate in fp32 on GPU and as exact fp64 dot products rounded once on CPU.
Weights are bf16 tensors or :class:`~unified_models.ops.nvfp4.NVFP4Weight`
(dequantized to bf16 tiles inside the kernel by ModelOpt's rule: no FP4
tensor cores on the H200).

**Combine** (DESIGN.md rule 6): ``out_t = round(((0 + w_t0 y_t0) + w_t1 y_t1
+ ... + w_t,K-1 y_t,K-1) + shared_t)`` in fp32, in slot order, then one
rounding to the output dtype. ``shared_t`` is the shared expert's fp32 output
(:func:`moe_shared_expert`), added before that single rounding. With a latent
MoE (``moe_latent_size``) the layer runs the experts on the latent ``u =
fc1(x)`` without ``shared``, then ``fc2`` and the shared expert outside.

Every token's result depends only on its own row: fixed tiles, a full K loop
per program, no split-K, no atomics; on CPU exact products and exact sums
(docs/consistency.md, "CPU results do not depend on the host's BLAS") and
elementwise fp32 steps in a fixed order. The router's sigmoid on CPU runs on
fixed ``[16, E padded to 64]`` tiles, so every element goes through ATen's
vectorised path whatever its row's place in the batch.
"""

from __future__ import annotations

import torch

from ._dispatch import map_row_tiles, use_triton
from .linear import linear, round_f64
from .nvfp4 import NVFP4Weight, nvfp4_dequantize

ExpertWeight = torch.Tensor | NVFP4Weight
"""``[E, N, K]`` bf16/fp32 tensor, or NVFP4 (``NVFP4Weight`` with ``[E, N, K/2]`` codes)."""

NORM_EPS = 1e-20
"""Added to the top-k weight sum before the division (transformers ``NemotronHTopkRouter``)."""

_SIGMOID_COLS = 64


# ---------------------------------------------------------------------------- router


def _check_route_args(E: int, top_k: int, n_group: int, topk_group: int) -> None:
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k = {top_k} must be in [1, {E}] (n_routed_experts)")
    if n_group < 1 or E % n_group:
        raise ValueError(f"moe_route: n_group = {n_group} must divide n_routed_experts = {E}")
    if n_group > 1:
        if E // n_group < 2:
            raise ValueError(f"moe_route: group scores sum the top 2 experts of a group; {E} experts in "
                             f"{n_group} groups leave {E // n_group} per group")
        if not 1 <= topk_group <= n_group or topk_group * (E // n_group) < top_k:
            raise ValueError(f"moe_route: topk_group = {topk_group} of {n_group} groups cannot hold "
                             f"top_k = {top_k} experts")


def total_order_keys(score_TE: torch.Tensor) -> torch.Tensor:
    """int64 keys ranking fp32 ``score_TE`` descending, ties to the LOWER column index.

    High 32 bits: the order-preserving int32 image of the fp32 value (negative
    floats have their 31 low bits flipped; ``-0.0`` is first made ``+0.0``);
    low 32 bits: ``C - 1 - column``. All keys of a row are distinct.
    """
    s = (score_TE.float() + 0.0).contiguous()
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    c = s.shape[-1]
    col = torch.arange(c - 1, -1, -1, device=s.device, dtype=torch.long)
    return (ordered << 32) + col


def topk_total_order(score_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest scores per row, best first, ties to the lower column (int64 ``[T, k]``)."""
    return torch.topk(total_order_keys(score_TE), k, dim=-1, largest=True, sorted=True).indices


def moe_select(logits_TE: torch.Tensor, e_score_correction_bias_E: torch.Tensor | None, *, top_k: int,
               n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
               routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-7 (see the module doc) from fp32 logits.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first.

    Raises:
        ValueError: inconsistent ``top_k``/``n_group``/``topk_group``, bias shape.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"moe_select: logits must be [T, E], got {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    _check_route_args(E, top_k, n_group, topk_group)
    if e_score_correction_bias_E is not None and e_score_correction_bias_E.shape != (E,):
        raise ValueError(f"moe_select: e_score_correction_bias must be [{E}], "
                         f"got {tuple(e_score_correction_bias_E.shape)}")
    logits = logits_TE.float()
    bias = e_score_correction_bias_E.float() if e_score_correction_bias_E is not None else None
    if logits.device.type == "cpu":
        ecols = -(-E // _SIGMOID_COLS) * _SIGMOID_COLS

        def tile(lg):
            padded = torch.nn.functional.pad(lg, (0, ecols - E))
            return torch.sigmoid(padded)[:, :E]

        scores = map_row_tiles(tile, logits)
    else:  # CUDA: every element goes through the same scalar functor
        scores = torch.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        per = E // n_group
        grouped = choice.view(T, n_group, per)
        top2 = grouped.topk(2, dim=-1, sorted=True).values  # values only: tie order is irrelevant
        group_score = top2[..., 0] + top2[..., 1]
        keep = topk_total_order(group_score, topk_group)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = topk_total_order(choice, top_k)
    w = scores.gather(1, ids)
    if norm_topk_prob:
        den = w[:, 0]
        for k in range(1, top_k):  # fixed slot order, elementwise
            den = den + w[:, k]
        w = w / (den + NORM_EPS)[:, None]
    w = w * float(routed_scaling_factor)
    return w, ids.to(torch.int32)


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` fp32 router logits from one batch-invariant GEMM (fp32 output)."""
    if x_TD.dtype != gate_weight_ED.dtype or x_TD.dtype not in (torch.bfloat16, torch.float32):
        x_TD, gate_weight_ED = x_TD.float(), gate_weight_ED.float()
    return linear(x_TD, gate_weight_ED, None, torch.float32)


def moe_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, e_score_correction_bias_E: torch.Tensor | None,
              *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k router (module doc, steps 1-7).

    Args:
        x_TD: ``[T, D]`` activations (the full hidden state, also for a latent MoE).
        gate_weight_ED: ``[E, D]`` router weight (``mixer.gate.weight``).
        e_score_correction_bias_E: ``[E]`` selection bias (``mixer.gate.e_score_correction_bias``) or None.
        top_k: ``num_experts_per_tok``.
        n_group, topk_group: group-limited routing (``n_group = 1``: plain top-k).
        norm_topk_prob: renormalise the selected weights to sum to 1.
        routed_scaling_factor: multiplies the weights.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``; row ``t`` depends only on ``x_TD[t]``.

    Raises:
        ValueError: shapes or routing arguments inconsistent.
    """
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ValueError(f"moe_route: x {tuple(x_TD.shape)} and gate weight {tuple(gate_weight_ED.shape)} "
                         "do not match")
    return moe_select(router_logits(x_TD, gate_weight_ED), e_score_correction_bias_E, top_k=top_k,
                      n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                      routed_scaling_factor=routed_scaling_factor)


# ---------------------------------------------------------------------------- experts


def _expert_shape(w: ExpertWeight) -> tuple[int, int, int]:
    shape = w.shape
    if len(shape) != 3:
        raise ValueError(f"moe_experts: expert weights must be [E, N, K], got {tuple(shape)}")
    return tuple(shape)


def check_expert_args(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                      down: ExpertWeight) -> tuple[int, int, int]:
    """Validate shapes; returns ``(E, I, D)``.

    Raises:
        ValueError: mismatched shapes/dtypes, ids out of range (checked on CPU).
    """
    if x_TD.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, D], got {tuple(x_TD.shape)}")
    E, I, D = _expert_shape(up)
    Ed, Dd, Id = _expert_shape(down)
    if (Ed, Dd, Id) != (E, D, I) or x_TD.shape[1] != D:
        raise ValueError(f"moe_experts: x {tuple(x_TD.shape)}, up {list(up.shape)} [E, I, D] and down "
                         f"{list(down.shape)} [E, D, I] do not match")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0] or topk_ids_TK.dtype.is_floating_point:
        raise ValueError(f"moe_experts: topk ids must be integer [T, K] with T = {x_TD.shape[0]}, "
                         f"got {tuple(topk_ids_TK.shape)} {topk_ids_TK.dtype}")
    for name, w in (("up", up), ("down", down)):
        if isinstance(w, torch.Tensor) and w.dtype != x_TD.dtype:
            raise ValueError(f"moe_experts: {name} weight dtype {w.dtype} differs from x dtype {x_TD.dtype}")
    if topk_ids_TK.device.type == "cpu" and topk_ids_TK.numel():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"moe_experts: expert ids must be in [0, {E}), got [{lo}, {hi}]")
    return E, I, D


def expert_weight(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s ``[N, K]`` weight as the kernels compute with it (NVFP4 dequantized by ModelOpt's rule)."""
    if isinstance(w, NVFP4Weight):
        return nvfp4_dequantize(w.expert(e), dtype)
    return w[e]


def group_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments ``r = t*K + k`` sorted by ``(expert, t, k)`` and the per-expert counts.

    The sort key ``expert * R + r`` is unique, so the permutation is fully
    determined by the ids (stable and batch-independent in its rule; where a
    row lands changes with the batch, never how it is computed).
    """
    flat = topk_ids_TK.reshape(-1).long()
    R = flat.shape[0]
    order = torch.argsort(flat * R + torch.arange(R, device=flat.device))
    return order, expert_counts(flat[order], num_experts)


def expert_rows(topk_ids_TK: torch.Tensor, num_experts: int):
    """Yield ``(expert, rows)`` for every expert with assignments, in expert order;
    ``rows`` are the flat assignments ``t*K + k`` of :func:`group_by_expert`'s order."""
    order, counts = group_by_expert(topk_ids_TK, num_experts)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            yield e, order[start:start + n]
            start += n


def expert_counts(sorted_experts_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert from the sorted expert ids (``searchsorted``: deterministic, and
    allowed under ``torch.use_deterministic_algorithms``, unlike CUDA ``bincount``)."""
    edges = torch.arange(num_experts, device=sorted_experts_R.device, dtype=sorted_experts_R.dtype)
    cum = torch.searchsorted(sorted_experts_R, edges, right=True)
    return torch.diff(cum, prepend=cum.new_zeros(1))


def moe_expert_outputs(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                       down: ExpertWeight) -> torch.Tensor:
    """fp32 ``[T*K, D]``: row ``t*K + k`` = expert ``ids[t, k]`` applied to ``x_TD[t]``
    (``fp32(round_x(relu(fp32(x up^T))^2) down^T)``). Raises as :func:`check_expert_args`."""
    check_expert_args(x_TD, topk_ids_TK, up, down)
    if use_triton(x_TD):
        from .triton.moe import moe_expert_outputs_triton

        return moe_expert_outputs_triton(x_TD, topk_ids_TK, up, down)
    return moe_expert_outputs_torch(x_TD, topk_ids_TK, up, down)


def moe_expert_outputs_torch(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                             down: ExpertWeight) -> torch.Tensor:
    """CPU: per expert, exact fp64 dot products of the (dequantized) operands rounded once to fp32,
    the relu2 epilogue in fp32 rounded once to ``x``'s dtype, over fixed 16-row tiles.

    Equal, bit for bit, to the Triton kernel under the interpreter (both are
    exact sums rounded once) while a dot product's terms span fewer than
    ``53 - 16 - log2(K)`` binary orders (docs/consistency.md).
    """
    E, I, D = check_expert_args(x_TD, topk_ids_TK, up, down)
    T, K = topk_ids_TK.shape
    y = torch.zeros(T * K, D, dtype=torch.float32, device=x_TD.device)
    if T == 0:
        return y
    for e, rows in expert_rows(topk_ids_TK, E):
        wu = expert_weight(up, e, x_TD.dtype).double()
        wd = expert_weight(down, e, x_TD.dtype).double()

        def tile(a, wu=wu, wd=wd):
            u = round_f64(a.double() @ wu.t(), torch.float32)
            h = torch.relu(u).square().to(x_TD.dtype)
            return round_f64(h.double() @ wd.t(), torch.float32)

        y[rows] = map_row_tiles(tile, x_TD[rows // K])
    return y


def moe_combine(expert_out_RD: torch.Tensor, topk_weights_TK: torch.Tensor, shared_TD: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``round(((0 + w_0 y_0) + ... + w_{K-1} y_{K-1}) + shared)`` per token, fp32, slot order, one rounding.

    Args:
        expert_out_RD: fp32 ``[T*K, D]`` (:func:`moe_expert_outputs`).
        topk_weights_TK: fp32 ``[T, K]``.
        shared_TD: optional ``[T, D]`` (fp32 from :func:`moe_shared_expert`, or any float dtype).
        out_dtype: result dtype.

    Raises:
        ValueError: shapes do not match.
    """
    if topk_weights_TK.dim() != 2:
        raise ValueError(f"moe_combine: weights must be [T, K], got {tuple(topk_weights_TK.shape)}")
    T, K = topk_weights_TK.shape
    if expert_out_RD.dim() != 2 or expert_out_RD.shape[0] != T * K:
        raise ValueError(f"moe_combine: expert outputs {tuple(expert_out_RD.shape)} do not match [T*K = {T * K}, D]")
    D = expert_out_RD.shape[1]
    if shared_TD is not None and shared_TD.shape != (T, D):
        raise ValueError(f"moe_combine: shared {tuple(shared_TD.shape)} is not [{T}, {D}]")
    if use_triton(expert_out_RD):
        from .triton.moe import moe_combine_triton

        return moe_combine_triton(expert_out_RD, topk_weights_TK, shared_TD, out_dtype)
    return moe_combine_torch(expert_out_RD, topk_weights_TK, shared_TD, out_dtype)


def moe_combine_torch(expert_out_RD, topk_weights_TK, shared_TD, out_dtype) -> torch.Tensor:
    """CPU: elementwise IEEE fp32 multiply and add in slot order (no reduction kernel), one rounding."""
    T, K = topk_weights_TK.shape
    y = expert_out_RD.float().view(T, K, expert_out_RD.shape[1])
    w = topk_weights_TK.float()
    acc = torch.zeros(T, y.shape[2], dtype=torch.float32, device=y.device)
    for k in range(K):
        acc = acc + w[:, k:k + 1] * y[:, k]
    if shared_TD is not None:
        acc = acc + shared_TD.float()
    return acc.to(out_dtype)


def moe_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, up: ExpertWeight,
                down: ExpertWeight, shared_TD: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed relu2 experts and the ordered combine (module doc).

    Args:
        x_TD: ``[T, D]`` bf16 expert input.
        topk_ids_TK, topk_weights_TK: from :func:`moe_route`.
        up: ``[E, I, D]`` (``experts.up_proj``), bf16 or :class:`NVFP4Weight`.
        down: ``[E, D, I]`` (``experts.down_proj``), bf16 or :class:`NVFP4Weight`.
        shared_TD: optional shared-expert output added before the rounding.
        out_dtype: default ``x_TD.dtype``.

    Returns:
        ``[T, D]``; row ``t`` depends only on ``x_TD[t]``, its ids and weights.
    """
    y = moe_expert_outputs(x_TD, topk_ids_TK, up, down)
    return moe_combine(y, topk_weights_TK, shared_TD, out_dtype or x_TD.dtype)


def stack_expert(w: ExpertWeight) -> ExpertWeight:
    """A single ``[N, K]`` weight as a one-expert stack ``[1, N, K]`` (tensor view or NVFP4)."""
    if isinstance(w, NVFP4Weight):
        if w.weight.dim() == 3:
            return w
        return NVFP4Weight(w.weight[None], w.weight_scale[None], w.weight_scale_2.reshape(1),
                           None if w.input_scale is None else w.input_scale.reshape(1))
    return w if w.dim() == 3 else w[None]


def moe_shared_expert(x_TD: torch.Tensor, up_ID: ExpertWeight, down_DI: ExpertWeight) -> torch.Tensor:
    """The shared expert ``down(relu(up x)^2)`` as fp32 ``[T, D]`` for :func:`moe_combine`'s ``shared``:
    the same grouped kernel and roundings as a routed expert (one expert, every token, weight 1;
    the combine's ``0 + 1 * y`` is ``y`` exactly, with ``-0`` made ``+0``)."""
    T = x_TD.shape[0]
    ids = torch.zeros(T, 1, dtype=torch.int32, device=x_TD.device)
    ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
    return moe_experts(x_TD, ids, ones, stack_expert(up_ID), stack_expert(down_DI), None, torch.float32)


# ---------------------------------------------------------------------------- oracle


def moe_route_reference(x_TD, gate_weight_ED, e_score_correction_bias_E, *, top_k, n_group=1, topk_group=1,
                        norm_topk_prob=True, routed_scaling_factor=1.0, dtype=torch.float64):
    """Oracle in ``dtype`` (fp64): same selection rule (ties to the lower index), slots best first."""
    logits = x_TD.to(dtype) @ gate_weight_ED.to(dtype).t()
    s = torch.sigmoid(logits)
    c = s + e_score_correction_bias_E.to(dtype) if e_score_correction_bias_E is not None else s
    T, E = c.shape
    if n_group > 1:
        per = E // n_group
        gs = c.view(T, n_group, per).topk(2, dim=-1).values.sum(-1)
        keep = _rank_rows(gs, topk_group)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=c.device).scatter_(1, keep, True)
        c = c.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = _rank_rows(c, top_k)
    w = s.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + NORM_EPS)
    return w * routed_scaling_factor, ids.to(torch.int32)


def _rank_rows(c, k):
    """Per row, the k best columns: value descending, then column ascending (python sort, any dtype)."""
    out = []
    for row in c.tolist():
        out.append(sorted(range(len(row)), key=lambda j: (-row[j], j))[:k])
    return torch.tensor(out, dtype=torch.long, device=c.device).view(c.shape[0], k)


def moe_experts_reference(x_TD, topk_ids_TK, topk_weights_TK, up, down, shared_TD=None, dtype=torch.float64):
    """Oracle: ``sum_k w_k down_e(relu(up_e x)^2) (+ shared)`` in ``dtype`` (NVFP4 weights dequantized
    by ModelOpt's rule), differentiable (plain torch)."""
    E = up.shape[0]
    T, K = topk_ids_TK.shape
    wu = torch.stack([expert_weight(up, e, torch.float32) if isinstance(up, NVFP4Weight) else up[e]
                      for e in range(E)]).to(dtype)
    wd = torch.stack([expert_weight(down, e, torch.float32) if isinstance(down, NVFP4Weight) else down[e]
                      for e in range(E)]).to(dtype)
    x = x_TD.to(dtype)
    ids = topk_ids_TK.long()
    out = torch.zeros(T, wd.shape[1], dtype=dtype, device=x.device) if shared_TD is None else shared_TD.to(dtype)
    for k in range(K):
        u = torch.einsum("td,tid->ti", x, wu[ids[:, k]])
        y = torch.einsum("ti,tdi->td", torch.relu(u) ** 2, wd[ids[:, k]])
        out = out + topk_weights_TK[:, k:k + 1].to(dtype) * y
    return out


def moe_shared_expert_reference(x_TD, up_ID, down_DI, dtype=torch.float64):
    """Oracle of :func:`moe_shared_expert`."""
    wu = nvfp4_dequantize(up_ID, torch.float32) if isinstance(up_ID, NVFP4Weight) else up_ID
    wd = nvfp4_dequantize(down_DI, torch.float32) if isinstance(down_DI, NVFP4Weight) else down_DI
    return torch.relu(x_TD.to(dtype) @ wu.to(dtype).t()) ** 2 @ wd.to(dtype).t()
