"""The analytic backward of the chunked SSD scan, for sequences that start at position 0 (the
trainer's THD batches).

DESIGN.md rule 11 lets a backward compute its gradients any correct way; before this module the SSD's
came from autograd over the chunked einsums of :func:`~.reference.ssd_chunked_torch_batched`, which
keeps a dozen ``[Bt, c, Q, Q, H]`` fp32 intermediates and walks them again in the backward (the
hybrid step's largest backward node on the H200, ``benchmarks/RESULTS.md`` session 33). Here the
gradients of the same formula are written out (Mamba-2, Dao & Gu 2024, section 6, the SSD chunked
form; ``mamba_ssm/ops/triton/ssd_combined.py``'s backward splits it the same way), each product a
batched GEMM (:func:`~unified_models.ops.grad.helpers.grad_matmul`: tensor cores on CUDA for a bf16
model), with four ``[Bt, c, H, Q, Q]`` tensors in all and the heads of a B/C group stacked along a
GEMM dimension. On the GPU the intra-chunk part (the ``Q x Q`` matrices) runs fused in Triton
(:mod:`.ssd_intra_grads`), the rest as GEMMs.

The forward, per head ``h`` (group ``g``), chunk ``k`` of ``Q`` rows, rows ``l, s`` of it::

    a = dt A,  A = -exp(A_log),  acum_l = sum_{j <= l} a_j  (within the chunk),  xd = x dt
    y_l = sum_{s <= l} (C_l . B_s) exp(acum_l - acum_s) xd_s       (intra-chunk)
        + exp(acum_l) C_l . S_k                                   (inter-chunk)
        + D x_l
    S_{k+1} = exp(acum_{Q-1}) S_k + sum_s exp(acum_{Q-1} - acum_s) xd_s B_s^T,   S_0 = 0

and the backward, given ``gy``: the intra-chunk matrix ``M = CB * Lm`` gives ``dxd = M^T gy`` and
``dM = gy xd^T``; ``dM * Lm`` summed over a group's heads is ``d(CB)`` (hence ``dC``, ``dB``), and
``dM * Lm * CB`` gives ``dacum`` (its row sums minus its column sums); the inter-chunk term gives
``dS = (gy e^acum)^T C``, ``dC``, ``dacum``; the state recurrence, in closed form (a lower-triangular
decay matrix over the chunks), gives ``d(states) = Dm^T dS`` and the chunk decays' gradients;
the chunk states give ``dxd``, ``dB``, ``dacum``; ``dacum`` becomes ``da`` by a reverse cumulative
sum, and ``a = dt A``, ``xd = x dt`` give ``ddt``, ``dA_log``, ``dx``.
"""

from __future__ import annotations

import torch
from triton.compiler.errors import CompilationError
from triton.runtime import errors as triton_errors

from .._dispatch import use_triton
from ..grad.helpers import backward_gemm_mode, grad_matmul
from .ssd_intra_grads import ssd_intra_chunk_grads


def _bmm(a: torch.Tensor, b: torch.Tensor, split: bool) -> torch.Tensor:
    """``a @ b`` over any leading batch dimensions (equal in both), through :func:`grad_matmul`; the result in the
    accumulation dtype (fp64 if an operand is, else fp32: a bf16 operand is an exact term, not the result's dtype)."""
    lead = a.shape[:-2]
    out = grad_matmul(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), split_fp32=split)
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return out.view(*lead, a.shape[-2], b.shape[-1]).to(wide)


def ssd_chunked_backward(x_BLHP: torch.Tensor, dt_BLH: torch.Tensor, A_log_H: torch.Tensor,
                         B_BLGN: torch.Tensor, C_BLGN: torch.Tensor, D_H: torch.Tensor | None, chunk_size: int,
                         gy_BLHP: torch.Tensor, *, split_fp32: bool = False, bc_exact: bool = False):
    """Gradients of :func:`~.reference.ssd_chunked_torch_batched` (no initial state) at the given inputs.

    Rows past a sequence's end are zero rows (``x = dt = B = C = 0``), as the forward allows; their
    gradients are returned like any row's and the caller drops them.

    Args:
        x_BLHP: ``[Bt, L, H, P]``; dt_BLH: ``[Bt, L, H]`` (after softplus / limits); A_log_H: ``[H]``;
            B_BLGN, C_BLGN: ``[Bt, L, G, N]`` (G divides H); D_H: ``[H]`` or None; chunk_size: ``Q``;
            gy_BLHP: ``[Bt, L, H, P]``, the output's gradient. All one floating dtype (fp32 or fp64:
            the backward's accumulation dtype) on one device.
        split_fp32: the GEMMs' fp32 operands split into bf16 ``hi + lo`` terms on tensor cores (a bf16
            model on CUDA; :func:`grad_matmul`), else plain GEMMs in the inputs' dtype. With it, fp32
            inputs and the Triton kernels (CUDA, or ``UM_OPS_BACKEND=triton`` under the interpreter), the
            intra-chunk part runs fused (:func:`~.ssd_intra_grads.ssd_intra_chunk_grads`: no ``Q x Q``
            tensor written; the same precision rules).
        bc_exact: ``B`` and ``C`` hold bf16 values (a bf16 model's activations): one exact bf16 term each
            in every GEMM they enter (a split would give them a zero ``lo``). A promise, not checked: other
            values are rounded to bf16 (``_Ssd.grads`` sets it from the forward's dtypes).

    Returns:
        ``(dx, ddt, dA_log, dB, dC, dD)`` in the inputs' shapes and dtype (``dD`` None when ``D_H`` is).

    Raises:
        ValueError: inconsistent shapes or dtypes.
    """
    Bt, L, H, P = x_BLHP.shape
    G, N = B_BLGN.shape[2:]
    dtype = x_BLHP.dtype
    if (dt_BLH.shape != (Bt, L, H) or B_BLGN.shape != C_BLGN.shape or B_BLGN.shape[:2] != (Bt, L) or H % G
            or gy_BLHP.shape != x_BLHP.shape or A_log_H.shape != (H,) or (D_H is not None and D_H.shape != (H,))):
        raise ValueError(f"ssd_chunked_backward: x {tuple(x_BLHP.shape)}, dt {tuple(dt_BLH.shape)}, A_log "
                         f"{tuple(A_log_H.shape)}, B {tuple(B_BLGN.shape)}, C {tuple(C_BLGN.shape)}, gy "
                         f"{tuple(gy_BLHP.shape)} must be [Bt,L,H,P], [Bt,L,H], [H], [Bt,L,G,N] x2 (G | H), [Bt,L,H,P]")
    if any(t is not None and t.dtype != dtype for t in (dt_BLH, A_log_H, B_BLGN, C_BLGN, D_H, gy_BLHP)):
        raise ValueError("ssd_chunked_backward: every input must have x's dtype (the accumulation dtype)")
    Q = chunk_size
    r = H // G
    pad = (-L) % Q
    c = (L + pad) // Q

    def chunked(t):  # [Bt, L, ...] -> [Bt, c, Q, ...], zero rows appended
        t = torch.cat([t, t.new_zeros((Bt, pad, *t.shape[2:]))], dim=1) if pad else t
        return t.view(Bt, c, Q, *t.shape[2:])

    def head_major(t):  # [Bt, c, Q, X, Y] -> [Bt, c, X, Q, Y]
        return t.permute(0, 1, 3, 2, 4).contiguous()

    A = -torch.exp(A_log_H)
    x, gy = head_major(chunked(x_BLHP)), head_major(chunked(gy_BLHP))  # [Bt, c, H, Q, P]
    dt = chunked(dt_BLH).permute(0, 1, 3, 2).contiguous()  # [Bt, c, H, Q]
    Bg, Cg = head_major(chunked(B_BLGN)), head_major(chunked(C_BLGN))  # [Bt, c, G, Q, N]
    # B and C as the bf16 values they hold (a bf16 model's activations): one exact term in each GEMM they enter,
    # where an fp32 operand is split into two (the lo term would be zero)
    exact = bc_exact and split_fp32 and dtype == torch.float32
    Bm, Cm = (Bg.to(torch.bfloat16), Cg.to(torch.bfloat16)) if exact else (Bg, Cg)
    # the within-chunk cumulative sums in fp64: the decays are exponentials of their differences, which
    # cancel (|acum| reaches hundreds: an fp32 difference would carry an absolute error of 2^-24 |acum|)
    acum64 = torch.cumsum(dt.double() * A.double()[:, None], dim=-1)  # [Bt, c, H, Q]
    xd = x * dt[..., None]

    def grouped(t):  # [Bt, c, H, ...] -> [Bt, c, G, r, ...]
        return t.view(Bt, c, G, r, *t.shape[3:])

    def rows_of_group(t):  # [Bt, c, H, Q, P] -> [Bt, c, G, Q, r*P]: a group's heads side by side
        return grouped(t).permute(0, 1, 2, 4, 3, 5).reshape(Bt, c, G, Q, r * P)

    def heads_of_rows(t):  # inverse of rows_of_group
        return t.view(Bt, c, G, Q, r, P).permute(0, 1, 2, 4, 3, 5).reshape(Bt, c, H, Q, P)

    fused = None
    if split_fp32 and dtype == torch.float32 and use_triton(x):
        # ---- intra-chunk, fused (Triton): the Q x Q tiles stay in registers
        Uc = Bt * c
        fused = _fused_intra_chunk_grads(xd.view(Uc, H, Q, P), gy.view(Uc, H, Q, P), Cg.view(Uc, G, Q, N),
                                         Bg.view(Uc, G, Q, N), acum64.view(Uc, H, Q), bc_exact)
    if fused is not None:
        dxd, dC, dB, dacum = fused
        dxd, dacum = dxd.view(Bt, c, H, Q, P), dacum.view(Bt, c, H, Q)
        dC, dB = dC.view(Bt, c, G, Q, N), dB.view(Bt, c, G, Q, N)
    else:
        dxd, dC, dB, dacum = _intra_chunk_grads(x, xd, gy, Cm, Bm, acum64, split_fp32)

    # ---- chunk states S_k (entering chunk k): the recurrence in closed form, S = Dm states with
    # Dm[k, j] = exp(e_{j+1} + ... + e_{k-1}) for j < k (e_i: chunk i's total decay exponent), one GEMM per
    # (sequence, head) however many chunks (no loop over them), the exponents from fp64 prefix sums
    w = torch.exp(acum64[..., -1:] - acum64).to(dtype)  # [Bt, c, H, Q]: decay from row s to the chunk's end
    xdw = xd * w[..., None]
    states = _bmm(rows_of_group(xdw).transpose(-1, -2), Bm, split_fp32).view(Bt, c, H, P, N)  # chunk's own
    e_cum = acum64[..., -1].cumsum(1)  # [Bt, c, H]: e_0 + ... + e_m
    e_before = torch.cat([e_cum.new_zeros((Bt, 1, H)), e_cum[:, :-1]], dim=1)  # e_0 + ... + e_{k-1}
    earlier = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)  # j < k
    Dm = torch.exp((e_before[:, :, None] - e_cum[:, None]).masked_fill(~earlier[..., None], -torch.inf))
    Dm = Dm.permute(0, 3, 1, 2).to(dtype)  # [Bt, H, c(k), c(j)]
    st_h = states.permute(0, 2, 1, 3, 4).reshape(Bt, H, c, P * N)
    del states
    S = _bmm(Dm, st_h, split_fp32).view(Bt, H, c, P, N).permute(0, 2, 1, 3, 4).contiguous()  # [Bt, c, H, P, N]

    # ---- inter-chunk: y += exp(acum) C . S
    gyE = gy * torch.exp(acum64).to(dtype)[..., None]  # [Bt, c, H, Q, P]
    gyE_rows = rows_of_group(gyE)  # [Bt, c, G, Q, r*P]
    S_rows = S.view(Bt, c, G, r * P, N)
    dS = _bmm(gyE_rows.transpose(-1, -2), Cm, split_fp32).view(Bt, c, H, P, N)
    dC += _bmm(gyE_rows, S_rows, split_fp32)
    y_off = heads_of_rows(_bmm(Cm, S_rows.transpose(-1, -2), split_fp32))  # exp(acum) dropped: in gyE
    dacum += (gyE * y_off).sum(-1, dtype=torch.float64)
    del gyE, gyE_rows, y_off

    # ---- the closed form backwards: d(states) = Dm^T dS; d(exponent[k, j]) = <dS_k, states_j> Dm[k, j]
    # (fp64: tiny), and e_i gets those of every (k, j) with j < i < k
    dS_h = dS.permute(0, 2, 1, 3, 4).reshape(Bt, H, c, P * N)
    del dS, S
    dstates = _bmm(Dm.transpose(-1, -2), dS_h, split_fp32)  # [Bt, H, c, P*N]
    Z = _bmm(dS_h, st_h.transpose(-1, -2), split_fp32).double() * Dm.double()  # [Bt, H, c(k), c(j)]
    del dS_h, st_h, Dm
    before_i = Z.cumsum(-1) - Z  # [k, i]: sum over j < i
    after_k = before_i.flip(-2).cumsum(-2).flip(-2) - before_i  # [k, i]: sum over k' > k
    dacum[..., -1] += after_k.diagonal(dim1=-2, dim2=-1).transpose(1, 2)  # k = i: sum over j < i < k'
    dstates = dstates.view(Bt, H, c, P, N).permute(0, 2, 1, 3, 4).contiguous()  # [Bt, c, H, P, N]

    # ---- chunk states: states_k = sum_s w_s xd_s B_s^T
    ds_rows = dstates.view(Bt, c, G, r * P, N)
    U = heads_of_rows(_bmm(Bm, ds_rows.transpose(-1, -2), split_fp32))  # [Bt, c, H, Q, P]: B_s dstates^T
    dxd += U * w[..., None]
    dB += _bmm(rows_of_group(xdw), ds_rows, split_fp32)
    dw = (xd * U).sum(-1, dtype=torch.float64) * w  # [Bt, c, H, Q]
    dacum -= dw
    dacum[..., -1] += dw.sum(-1)
    del U, xdw, dstates

    # ---- acum = cumsum(dt A), xd = x dt, y += D x
    da = dacum.flip(-1).cumsum(-1).flip(-1)  # fp64
    A64 = A.double()
    ddt = (da * A64[:, None]).to(dtype) + (dxd * x).sum(-1)
    dA_log = ((da * dt.double()).sum((0, 1, 3)) * A64).to(dtype)
    dx = dxd * dt[..., None]
    dD = None
    if D_H is not None:
        dx += gy * D_H[:, None, None]
        dD = (gy * x).sum((0, 1, 3, 4))

    def unchunked(t):  # [Bt, c, X, Q, ...] -> [Bt, L, X, ...]
        t = t.transpose(2, 3)
        return t.reshape(Bt, c * Q, *t.shape[3:])[:, :L]

    return (unchunked(dx), unchunked(ddt.unsqueeze(-1)).squeeze(-1), dA_log, unchunked(dB), unchunked(dC), dD)


_FUSED_UNAVAILABLE: str | None = None
"""Why the fused intra-chunk kernels did not build on this GPU (set once; the torch form runs instead)."""

_BUILD_ERRORS = (CompilationError, triton_errors.OutOfResources) + (
    (triton_errors.PTXASError,) if hasattr(triton_errors, "PTXASError") else ())
"""Triton's errors for a kernel that does not build on this GPU (registers, shared memory, ptxas)."""


def _fused_intra_chunk_grads(xd, gy, Cg, Bg, acum64, bc_exact):
    """:func:`~.ssd_intra_grads.ssd_intra_chunk_grads`, or None (warned once) when its kernels do not build
    on this GPU (registers or shared memory: Triton's ``OutOfResources`` / compilation errors): the torch
    form then gives the same gradients at the same precision, slower."""
    global _FUSED_UNAVAILABLE
    if _FUSED_UNAVAILABLE is not None:
        return None
    try:
        return ssd_intra_chunk_grads(xd, gy, Cg, Bg, acum64, split=backward_gemm_mode() == "split", bc_exact=bc_exact)
    except _BUILD_ERRORS as e:
        import warnings

        _FUSED_UNAVAILABLE = f"{type(e).__name__}: {e}"
        warnings.warn(f"the fused SSD intra-chunk backward does not build here ({_FUSED_UNAVAILABLE}); its torch form "
                      "runs instead (same gradients, more memory traffic)", RuntimeWarning, stacklevel=2)
        return None


def _intra_chunk_grads(x, xd, gy, Cg, Bg, acum64, split_fp32):
    """The intra-chunk gradients ``(dxd, dC, dB, dacum)`` in torch ops (head-major layouts of
    :func:`ssd_chunked_backward`); :func:`~.ssd_intra_grads.ssd_intra_chunk_grads` is the fused form."""
    Bt, c, H, Q, _P = x.shape
    G = Cg.shape[2]
    r = H // G
    dtype = x.dtype

    def grouped(t):  # [Bt, c, H, ...] -> [Bt, c, G, r, ...]
        return t.view(Bt, c, G, r, *t.shape[3:])

    # M = CB * Lm (lower triangle), y = M xd
    CB = _bmm(Cg, Bg.transpose(-1, -2), split_fp32)  # [Bt, c, G, Q(l), Q(s)]
    lower = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    Lm = torch.exp((acum64[..., :, None] - acum64[..., None, :]).to(dtype).masked_fill_(~lower, -torch.inf))
    M = (grouped(Lm) * CB[:, :, :, None]).view(Bt, c, H, Q, Q)
    dxd = _bmm(M.transpose(-1, -2), gy, split_fp32)  # [Bt, c, H, Q, P]
    del M
    dM = _bmm(gy, xd.transpose(-1, -2), split_fp32)  # [Bt, c, H, Q, Q]
    dM.mul_(Lm)  # d(CB) per head
    del Lm
    dCB = grouped(dM).sum(3)  # [Bt, c, G, Q, Q]
    dM.view(Bt, c, G, r, Q, Q).mul_(CB[:, :, :, None])  # d(acum_l - acum_s)
    # dacum in fp64 (small: [Bt, c, H, Q]): its row-sum-minus-column-sum terms cancel, and an fp32 sum
    # would leave an error of 2^-24 of the sums where the difference is far smaller (dt and A_log)
    dacum = dM.sum(-1, dtype=torch.float64) - dM.sum(-2, dtype=torch.float64)  # [Bt, c, H, Q]
    del dM, CB
    dC = _bmm(dCB, Bg, split_fp32)  # [Bt, c, G, Q, N]
    dB = _bmm(dCB.transpose(-1, -2), Cg, split_fp32)
    del dCB
    return dxd, dC, dB, dacum
