"""Cost of one Mamba-2 decode step by in-chunk position p (issue 18 item 3): ours vs vLLM's native.

Not a test: a measurement. Our decode is "decode-as-chunk" (DESIGN.md rule 8): a token at
position ``k*Q + p`` re-executes its chunk's scan from the slot's boundary state and the ``p``
pending rows (x, dt, B) the slot keeps, so its cost may grow with ``p``; vLLM's native decode
(``selective_state_update``) is one recurrence step, the same at every ``p``.

For the Mamba-2 widths of a preset (default ``nemotron_3_nano_reduced``: 64 heads x 64, 8
groups, state 128, conv 4, chunk 128; every width overridable) and each batch size B, every
sequence of the batch sits at the same position ``k*Q + p`` (default ``k = 1``, so the boundary
state is read), for p in {0, 1, Q/4, Q/2, 3Q/4, Q-1}, and one decode step of ONE layer is
timed from random state slots (right dtypes; no checkpoint):

* ours, exactly what ``layers/mamba2.py::mamba2_forward`` runs between in_proj and the gated
  norm, with the batch metadata built by the layer's own ``mamba2_batch_metadata`` (a decode
  step on the Triton kernels: ``ops.mamba2_decode_metadata``): ``conv`` =
  ``ops.causal_conv1d`` (conv kernel + conv-tail write), ``ssm`` = ``ops.mamba2_dt`` +
  ``ops.ssd_chunk_scan`` (cumulative decay, scan, state kernel with COMMIT, pending-row
  write), ``step`` = both; ``meta_ms`` is the metadata build (once per forward, shared by every
  Mamba layer, not in ``step``);
* native (vLLM's mixer2 decode branch, non-speculative, no prefix caching):
  ``causal_conv1d_update`` (``conv``) and ``mamba_ssm.selective_state_update`` with
  ``dt_softplus`` (``ssm``: it applies dt's softplus itself), ``step`` = both, on the same
  widths, slots and fp32 SSM state.

Reported per (B, p): ms of each part, ours/native and the growth ours(p)/ours(p_min) (p_min =
the smallest p measured, 0 by default), the kernels' launch grids and source-row blocks at this
p (``work``), and a correctness guard (not timed): the decode step's scan output for the batch
equals, bit for bit, the general chunked scan (``ops.mamba2_metadata``, host-built) over the
same chunk prefix (the p cached rows + the token as batch rows, from the boundary state), the
slots' states after both agree bit for bit (pending rows, committed boundary state at p = Q-1),
and the conv output, conv tail and scan output equal the general metadata's on the same decode
batch (the check of ``tests/ops/test_mamba2.py::test_decode_metadata_bitwise``, here at the
benchmark's widths and positions). A failed guard exits 1.

CUDA: CUDA-graph timing (``kernel_bench.graph_time_ms``, as vLLM's captured decode steps),
default JSON ``benchmarks/results/decode_chunk_position_h200.json``. CPU: wall-clock medians (a
smoke run at tiny widths), through the Triton interpreter (``--cpu-backend triton``, the default:
the GPU's decode kernels and metadata) or the CPU engines' torch path (``--cpu-backend torch``);
vLLM's native kernels are skipped there when vLLM disables Triton (its CPU build does); default
JSON ``benchmarks/results/decode_chunk_position_cpu.json``.

    python benchmarks/decode_chunk_position.py                                   # H200, nano widths
    python benchmarks/decode_chunk_position.py --preset nemotron_h_hybrid_tiny --batch 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from kernel_bench import finish, graph_time_ms  # noqa: E402

WIDTH_FLAGS = {"heads": "num_heads", "head_dim": "head_dim", "groups": "n_groups", "state": "ssm_state_size",
               "conv": "conv_kernel"}
"""CLI flag -> :class:`~unified_models.dsl.Mamba2Spec` field (``--chunk`` takes several chunk sizes)."""


def preset_mamba_spec(name: str):
    """``(model spec, its first Mamba2Spec)`` of a preset, from its config alone (no weights built)."""
    import torch
    from transformers import AutoConfig

    from unified_models.dsl import Mamba2Spec
    from unified_models.models import spec_from_hf_config
    from unified_models.presets import load_preset

    preset = load_preset(name)
    config = AutoConfig.for_model(preset["family"], **preset["hf_config"])
    model = spec_from_hf_config(config, dtype=getattr(torch, preset.get("dtype", "bfloat16")))
    subs = model.sublayers_of(Mamba2Spec)
    if not subs:
        raise SystemExit(f"preset {name!r} has no Mamba-2 layer")
    return model, subs[0].mixer


def default_positions(Q: int) -> list[int]:
    """{0, 1, Q/4, Q/2, 3Q/4, Q-1}, in order, without repeats."""
    return sorted({0, 1, Q // 4, Q // 2, 3 * Q // 4, Q - 1})


def work_model(spec, B: int, p: int, triton_path: bool, model_bytes: int = 2) -> dict:
    """Launch grids, loop trips and bytes of our decode step's SSD kernels at in-chunk position p,
    read off the launch code and kernels of ``ops/mamba2/triton.py`` / ``decode.py`` (tile constants
    from the module), and native's ``selective_state_update`` for comparison.

    Bytes are per (sequence, head), as the masked loads and stores request them (masked-off lanes
    move nothing; reuse between the heads of a group in L2 is not subtracted; the conv, dt and
    conv-tail kernels, constant in p, are left out): ``ours_ssd_bytes_*`` = cumsum + scan + state
    kernel (COMMIT) + pending-row write; native = one state read and write plus the token's rows.
    """
    H, P, G, N, Q = spec.num_heads, spec.head_dim, spec.n_groups, spec.ssm_state_size, spec.chunk_size
    C = H * P + 2 * G * N
    e = model_bytes
    row = P * e + N * e + 4  # one chunk row of a head: x [P], B [N] (its group's), dt (fp32)
    state = P * N * 4  # fp32 SSM state of one head
    commit = p == Q - 1
    out = {}
    if triton_path:
        from unified_models.ops.mamba2 import triton as mt
        from unified_models.ops.triton._common import next_pow2

        BL = max(mt._MIN_DOT, min(mt.DECODE_SCAN_LAUNCH["block_l"], Q))
        BPS = max(mt._MIN_DOT, min(mt.STATE_LAUNCH["block_p"], max(mt._MIN_DOT, next_pow2(P))))
        trips = p // BL + 1
        out["tiles"] = {"BLOCK_L": BL, "BLOCK_P_state": BPS}
        out["scan_launch"] = dict(mt.DECODE_SCAN_LAUNCH)
        out["programs"] = {
            "conv": math.ceil(B / mt.CONV_BLOCK_T) * math.ceil(C / mt.CONV_BLOCK_C),
            "conv_tail": B * math.ceil(C / 256),
            "dt": math.ceil(B / 64),
            "cumsum": B * H,
            "scan": B * H,  # one program per (sequence, head): the row block holding the token
            "state_commit": B * H * math.ceil(P / BPS),
            "pending_rows": B * H,
        }
        out["scan_source_blocks_per_busy_program"] = trips  # source-loop trips, BL rows and 2 dots each
        out["state_commit_chunk_passes"] = B * H * math.ceil(P / BPS) if commit else 0  # programs with a loop trip
        out["ours_ssd_bytes_read_per_seq_head"] = (
            (p + 1) * 4  # cumsum: dt of rows 0..p
            + state + N * e + (trips + 1) * BL * 4  # scan: boundary state, the token's C, A_cum blocks
            + (p + 1) * row + P * e  # scan: rows 0..p (p cached + the token), x again for D
            + ((state + Q * row + (Q + 1) * 4) if commit else 0)  # state kernel: state, the Q rows, A_cum
            + (0 if commit else P * e + 4 + N * e / (H // G)))  # pending-row write: the token's row
        out["ours_ssd_bytes_written_per_seq_head"] = (Q * 4 + P * 4  # A_cum, fp32 output
                                                      + (state if commit else P * e + 4 + N * e / (H // G)))
    out["native_ssd_bytes_per_seq_head"] = {"read": state + row + N * e + 3 * 4, "written": state + P * e}
    return out


def _rand_dt(shape, dt_bias, gen):
    """fp32 dt rows as ``mamba2_dt`` makes them (softplus of raw + bias), for the pending rows."""
    import torch

    raw = torch.randn(*shape, generator=gen, device=dt_bias.device) * 0.5
    return torch.nn.functional.softplus(raw + dt_bias.float()).float()


def _clone_state(st):
    from unified_models.ops import Mamba2State

    return Mamba2State(**{f.name: getattr(st, f.name).clone() for f in dataclasses.fields(st)})


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def guard(spec, core, meta_of, prm, st, xin, dt_raw, slots, pos) -> dict:
    """Bitwise checks of the decode step at ``pos`` against the general chunked scan (not timed).

    Returns ``{check name: bool}``."""
    import torch

    from unified_models import ops

    H, P, G, N, Q = spec.num_heads, spec.head_dim, spec.n_groups, spec.ssm_state_size, spec.chunk_size
    F_ = H * P
    B, dev = xin.shape[0], xin.device
    p, k0 = pos % Q, (pos // Q) * Q
    checks = {}
    # 1. the decode step, as timed
    st_d = _clone_state(st)
    xbc_d, dt_d, y_d = core(meta_of(), st_d)
    x_d, B_d, C_d = xbc_d.split([F_, G * N, G * N], dim=-1)
    # 2. general metadata over the same single-token batch (reads the same cached rows)
    st_c = _clone_state(st)
    cu1 = torch.arange(B + 1, device=dev)
    meta_g1 = ops.mamba2_metadata(cu1, torch.full((B,), pos, device=dev), Q, num_tokens=B, state_idx_B=slots)
    xbc_c = ops.causal_conv1d(xin, prm["conv_w"], prm["conv_b"], meta_g1, st_c)
    checks["conv_out_vs_general_meta"] = _equal(xbc_d, xbc_c)
    checks["conv_tail_vs_general_meta"] = _equal(st_d.conv, st_c.conv)
    y_c = ops.ssd_chunk_scan(x_d.reshape(B, H, P), dt_d, prm["A_log"], B_d.reshape(B, G, N), C_d.reshape(B, G, N),
                             prm["D"], meta_g1, st_c, out_dtype=torch.float32)
    checks["scan_out_vs_general_meta"] = _equal(y_d, y_c)
    # 3. general chunked scan over the chunk prefix: the p cached rows and the token as batch rows,
    #    from the boundary state (start k0 = k*Q), its own commit / pending writes
    st_g = _clone_state(st)
    L = p + 1
    sl = slots.long()
    xs = torch.cat([st.x[sl, :p], x_d.reshape(B, 1, H, P)], dim=1).reshape(B * L, H, P)
    dts = torch.cat([st.dt[sl, :p], dt_d.reshape(B, 1, H)], dim=1).reshape(B * L, H)
    Bs = torch.cat([st.B[sl, :p], B_d.reshape(B, 1, G, N)], dim=1).reshape(B * L, G, N)
    Cs = torch.cat([torch.zeros((B, p, G, N), dtype=C_d.dtype, device=dev), C_d.reshape(B, 1, G, N)],
                   dim=1).reshape(B * L, G, N)  # C of the earlier rows only feeds their own outputs
    cu = torch.arange(B + 1, device=dev) * L
    meta_g = ops.mamba2_metadata(cu, torch.full((B,), k0, device=dev), Q, num_tokens=B * L, state_idx_B=slots)
    y_g = ops.ssd_chunk_scan(xs, dts, prm["A_log"], Bs, Cs, prm["D"], meta_g, st_g, out_dtype=torch.float32)
    checks["scan_out_vs_chunk_prefix"] = _equal(y_d, y_g[cu[1:] - 1])
    for name in ("ssm", "x", "dt", "B"):  # both started from the same slots; every write must agree
        checks[f"state_{name}_vs_chunk_prefix"] = _equal(getattr(st_d, name), getattr(st_g, name))
    return checks


def _wall_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _native_ops():
    """vLLM's decode kernels, or the reason they cannot run here."""
    try:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            return None, "vLLM disabled Triton on this host (vllm.triton_utils.HAS_TRITON is False)"
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]
    return (causal_conv1d_update, selective_state_update), None


def measure(spec, model, batches, positions, *, chunk_index: int = 1, iters: int = 20, wall_iters: int = 3,
            native: bool = True, cpu_backend: str = "triton", seed: int = 0, label: str = "") -> tuple[list, bool]:
    """Time and guard every (B, p). Returns ``(rows, all guards held)``."""
    import torch

    from unified_models import ops
    from unified_models.layers.common import LayerContext
    from unified_models.layers.mamba2 import mamba2_batch_metadata
    from unified_models.ops import Mamba2State
    from unified_models.ops._dispatch import use_triton
    from unified_models.state import FlatBatch, SlotState

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    old_backend = os.environ.get("UM_OPS_BACKEND")
    if not cuda:
        os.environ["UM_OPS_BACKEND"] = cpu_backend
    try:
        H, P, G, N, Q, W = (spec.num_heads, spec.head_dim, spec.n_groups, spec.ssm_state_size, spec.chunk_size,
                            spec.conv_kernel)
        F_, C = H * P, H * P + 2 * G * N
        dtype = model.dtype if model is not None else torch.bfloat16
        triton_path = use_triton(torch.empty(0, device=dev))
        path = ("decode metadata + Triton kernels" + ("" if cuda else " (interpreter)") if triton_path
                else "general metadata + CPU torch path")
        nat, why = _native_ops() if native else (None, "--no-native")
        if why:
            print(f"native baseline unavailable: {why}", flush=True)
        timer = (lambda fn: graph_time_ms(fn, iters)) if cuda else (lambda fn: _wall_ms(fn, wall_iters))
        gen = torch.Generator(device=dev).manual_seed(seed)

        def rn(*shape, scale=1.0, dt_=dtype):
            return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt_)

        # dt_bias as mamba_ssm initialises it: inverse softplus of dt ~ logU(1e-3, 1e-1)
        lo, hi = math.log(1e-3), math.log(0.1)
        dt0 = torch.exp(torch.rand(H, generator=gen, device=dev) * (hi - lo) + lo)
        prm = {"conv_w": rn(C, W, scale=0.4), "conv_b": rn(C, scale=0.1),
               "dt_bias": (dt0 + torch.log(-torch.expm1(-dt0))).to(device=dev, dtype=dtype),
               "A_log": torch.log(torch.arange(1, H + 1, dtype=torch.float32)).to(device=dev, dtype=dtype),
               "D": (1.0 + 0.1 * torch.randn(H, generator=gen, device=dev)).to(dtype)}
        rows, ok_all = [], True
        for B in batches:
            S = B + 1  # slot 0 is vLLM's null block (NULL_BLOCK_ID): never a live sequence's slot
            slots = (1 + torch.randperm(B, generator=gen, device=dev)).to(torch.int32)
            st = Mamba2State.allocate(S, num_heads=H, head_dim=P, n_groups=G, state_size=N, conv_width=W,
                                      chunk_size=Q, dtype=dtype, device=dev)
            st.conv.copy_(rn(S, W - 1, C))
            st.ssm.copy_(rn(S, H, P, N, scale=0.5, dt_=torch.float32))
            st.x.copy_(rn(S, Q - 1, H, P))
            st.dt.copy_(_rand_dt((S, Q - 1, H), prm["dt_bias"], gen))
            st.B.copy_(rn(S, Q - 1, G, N))
            xin, dt_raw = rn(B, C), rn(B, H, scale=0.5)
            # native's copies of the same slots: conv state [S, C, W-1] with C contiguous (vLLM's view);
            # causal_conv1d_update writes its output over its input, so it gets its own input rows
            n_xin = xin.clone()
            n_conv = st.conv.clone().transpose(1, 2)
            n_ssm = st.ssm.clone()
            A_n = -torch.exp(prm["A_log"].float())
            A_exp = A_n[:, None, None].expand(H, P, N)
            dtb_exp, D_exp = prm["dt_bias"][:, None].expand(H, P), prm["D"][:, None].expand(H, P)
            n_out = torch.empty((B, H, P), dtype=dtype, device=dev)
            by_p = []
            for p in positions:
                pos = chunk_index * Q + p
                cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
                start = torch.full((B,), pos, device=dev, dtype=torch.int64)
                batch = FlatBatch(input_ids=torch.zeros(B, dtype=torch.int64, device=dev),
                                  positions=start.clone(), seq_idx=torch.arange(B, device=dev, dtype=torch.int32))

                def meta_of():
                    ms = SlotState(state=st, slots_B=slots, start_B=start, cu_seqlens_B1=cu, uniform_decode=True)
                    return mamba2_batch_metadata(spec, batch, ms, LayerContext(model=model))

                meta = meta_of()
                if triton_path != meta.uniform_decode:
                    raise RuntimeError(f"the layer built {'decode' if meta.uniform_decode else 'general'} metadata "
                                       f"on the {'Triton' if triton_path else 'torch'} path")

                def conv(meta_, st_):
                    return ops.causal_conv1d(xin, prm["conv_w"], prm["conv_b"], meta_, st_)

                def ssm(xbc, meta_, st_):
                    x, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
                    dt = ops.mamba2_dt(dt_raw, prm["dt_bias"], spec.time_step_limit)
                    y = ops.ssd_chunk_scan(x.reshape(B, H, P), dt, prm["A_log"], Bm.reshape(B, G, N),
                                           Cm.reshape(B, G, N), prm["D"], meta_, st_, out_dtype=torch.float32)
                    return dt, y

                def core(meta_, st_):
                    xbc = conv(meta_, st_)
                    dt, y = ssm(xbc, meta_, st_)
                    return xbc, dt, y

                with torch.inference_mode():
                    checks = guard(spec, core, meta_of, prm, st, xin, dt_raw, slots, pos)
                    ok = all(checks.values())
                    ok_all &= ok
                    # timing (state slots change between calls as in decoding; the cost does not)
                    xbc_fixed = conv(meta, _clone_state(st))
                    row = {"label": label, "device": torch.cuda.get_device_name() if cuda else "cpu",
                           "timing": "cuda_graph" if cuda else "wall_clock", "path": path,
                           "H": H, "P": P, "G": G, "N": N, "Q": Q, "W": W, "C": C, "dtype": str(dtype).split(".")[-1],
                           "batch": B, "p": p, "position": pos,
                           "ours_conv_ms": timer(lambda: conv(meta, st)),
                           "ours_ssm_ms": timer(lambda: ssm(xbc_fixed, meta, st)),
                           "ours_step_ms": timer(lambda: core(meta, st)),
                           "meta_ms": timer(meta_of)}
                    if nat is not None:
                        conv_up, ssu = nat

                        def n_conv_fn():
                            return conv_up(n_xin, n_conv, prm["conv_w"], prm["conv_b"], "silu",
                                           conv_state_indices=slots)

                        def n_ssm_fn(xbc):
                            x, Bm, Cm = xbc.split([F_, G * N, G * N], dim=-1)
                            ssu(n_ssm, x.reshape(B, H, P), dt_raw[:, :, None].expand(B, H, P), A_exp,
                                Bm.reshape(B, G, N), Cm.reshape(B, G, N), D=D_exp, dt_bias=dtb_exp, dt_softplus=True,
                                state_batch_indices=slots, dst_state_batch_indices=slots, out=n_out)
                            return n_out

                        n_xbc = n_conv_fn()
                        row["native_conv_ms"] = timer(n_conv_fn)
                        row["native_ssm_ms"] = timer(lambda: n_ssm_fn(n_xbc))
                        row["native_step_ms"] = timer(lambda: n_ssm_fn(n_conv_fn()))
                        for part in ("conv", "ssm", "step"):
                            row[f"ours_over_native_{part}"] = row[f"ours_{part}_ms"] / row[f"native_{part}_ms"]
                    else:
                        row["native_unavailable"] = why
                row["guard_bitwise"] = ok
                row["guard"] = checks
                row["work"] = work_model(spec, B, p, triton_path, torch.finfo(dtype).bits // 8)
                by_p.append(row)
                rows.append(row)
            base = min(by_p, key=lambda r: r["p"])
            for row in by_p:
                row["growth_base_p"] = base["p"]
                for part in ("conv", "ssm", "step"):
                    row[f"growth_{part}"] = row[f"ours_{part}_ms"] / base[f"ours_{part}_ms"]
                nat_cells = (f"native ssm {row['native_ssm_ms']:.4f} conv {row['native_conv_ms']:.4f} step "
                             f"{row['native_step_ms']:.4f} | ours/native ssm {row['ours_over_native_ssm']:.2f} step "
                             f"{row['ours_over_native_step']:.2f}" if "native_ssm_ms" in row else "native n/a")
                bad = [k for k, v in row["guard"].items() if not v]
                print(f"B={row['batch']:4d} p={row['p']:4d} pos={row['position']:5d} | "
                      f"ours ssm {row['ours_ssm_ms']:.4f} conv {row['ours_conv_ms']:.4f} "
                      f"step {row['ours_step_ms']:.4f} meta {row['meta_ms']:.4f} | "
                      f"{nat_cells} | growth ssm {row['growth_ssm']:.2f} step {row['growth_step']:.2f} | "
                      f"guard {'ok' if not bad else 'FAILED ' + ','.join(bad)}", flush=True)
            del st, n_conv, n_ssm
        return rows, ok_all
    finally:
        if not cuda:
            if old_backend is None:
                os.environ.pop("UM_OPS_BACKEND", None)
            else:
                os.environ["UM_OPS_BACKEND"] = old_backend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="nemotron_3_nano_reduced",
                   help="widths of its first Mamba-2 layer")
    for flag, field in WIDTH_FLAGS.items():
        ap.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"override {field}")
    ap.add_argument("--chunk", type=int, nargs="+", default=None,
                    help="chunk sizes Q, each run in turn (default: the preset's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="batch sizes B")
    ap.add_argument("--positions", type=int, nargs="+", default=None,
                    help="in-chunk positions p (default 0 1 Q/4 Q/2 3Q/4 Q-1)")
    ap.add_argument("--chunk-index", type=int, default=1, help="k: tokens at k*Q + p (k >= 1 reads a boundary state)")
    ap.add_argument("--iters", type=int, default=20, help="CUDA: calls per captured graph")
    ap.add_argument("--wall-iters", type=int, default=3, help="CPU: timed calls (median) after one warm-up")
    ap.add_argument("--cpu-backend", choices=["triton", "torch"], default="triton",
                    help="CPU: Triton interpreter (the GPU's decode path) or the CPU engines' torch path")
    ap.add_argument("--no-native", action="store_true", help="skip vLLM's kernels")
    ap.add_argument("--scan-candidates", nargs="+", default=None, metavar="BL:WARPS:STAGES",
                    help="also run the decode scan with these launches (row block, warps, pipeline stages; "
                         "ops/mamba2/triton.DECODE_SCAN_LAUNCH) after the current one: each row records its "
                         "launch and whether its bits equal the general chunked scan's (the current launch's)")
    ap.add_argument("--json", dest="json_out", default=None,
                    help="default benchmarks/results/decode_chunk_position_{h200,cpu}.json")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and args.cpu_backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (first import)
        from unified_models.ops.triton._common import INTERPRET

        if not INTERPRET:
            ap.error("--cpu-backend triton: Triton was imported without TRITON_INTERPRET=1")
    candidates = []
    for c in args.scan_candidates or []:
        try:
            bl, warps, stages = (int(v) for v in c.split(":"))
        except ValueError:
            ap.error(f"--scan-candidates: {c!r} is not BL:WARPS:STAGES (three integers)")
        if bl < 1 or bl & (bl - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
            ap.error(f"--scan-candidates: {c!r}: BL must be a power of two, WARPS 1/2/4/8/16, STAGES >= 1")
        candidates.append({"block_l": bl, "num_warps": warps, "num_stages": stages})
    model, spec = preset_mamba_spec(args.preset)
    over = {field: getattr(args, flag) for flag, field in WIDTH_FLAGS.items() if getattr(args, flag) is not None}
    rows, ok = [], True
    for Q in args.chunk or [spec.chunk_size]:
        over_q = {**over, "chunk_size": Q} if Q != spec.chunk_size else over
        spec_q = dataclasses.replace(spec, **over_q) if over_q else spec
        positions = args.positions if args.positions is not None else default_positions(Q)
        if any(not 0 <= p < Q for p in positions) or args.chunk_index < 0:
            ap.error(f"positions must lie in [0, {Q}) and --chunk-index be >= 0")
        print(f"{args.preset}{' ' + str(over_q) if over_q else ''}: H={spec_q.num_heads} P={spec_q.head_dim} "
              f"G={spec_q.n_groups} N={spec_q.ssm_state_size} Q={Q} W={spec_q.conv_kernel}, positions {positions}, "
              f"batches {args.batch}", flush=True)
        rows_q, ok_q = measure(spec_q, model, args.batch, positions, chunk_index=args.chunk_index, iters=args.iters,
                               wall_iters=args.wall_iters, native=not args.no_native, cpu_backend=args.cpu_backend,
                               label=args.preset + (f" {over_q}" if over_q else ""))
        rows += rows_q
        ok &= ok_q
        if candidates:
            from unified_models.ops.mamba2 import triton as mt

            current = dict(mt.DECODE_SCAN_LAUNCH)
            try:
                for cand in candidates:
                    mt.DECODE_SCAN_LAUNCH.update(cand)
                    print(f"decode scan launch {cand} (current {current})", flush=True)
                    rows_c, _ = measure(spec_q, model, args.batch, positions, chunk_index=args.chunk_index,
                                        iters=args.iters, wall_iters=args.wall_iters, native=False,
                                        cpu_backend=args.cpu_backend, label=f"{args.preset} scan {cand}")
                    for r in rows_c:
                        r["scan_candidate"] = True
                    rows += rows_c  # a candidate whose guard fails is a finding, not a failed run
            finally:
                mt.DECODE_SCAN_LAUNCH.clear()
                mt.DECODE_SCAN_LAUNCH.update(current)
    json_out = args.json_out or str(HERE / "results" / f"decode_chunk_position_{'h200' if cuda else 'cpu'}.json")
    finish(rows, json_out, "(ms per decode step of one Mamba-2 layer; growth = ours(p) / ours(smallest p); "
           "guard = decode step == general chunked scan, bit for bit)")
    print(f"wrote {json_out}")
    if candidates:
        print("decode scan launches (ssm ms by B and p; guard = the general chunked scan's bits):")
        for r in rows:
            print(f"  {r['work'].get('scan_launch')} B={r['batch']} p={r['p']}: ssm {r['ours_ssm_ms']:.4f} ms "
                  f"guard {'ok' if r['guard_bitwise'] else 'DIFFERENT BITS'}")
    if not ok:
        print("GUARD FAILED: the decode step's bits differ from the general chunked scan", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
