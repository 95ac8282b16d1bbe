"""Compile the GPU paths of our Triton kernels for Hopper (sm_90) on a machine without a GPU.

Run as a script in a process where ``TRITON_INTERPRET`` is unset (``tests/test_sm90_lowering.py``
does): the op wrappers (linear and its GEMM tiers, paged attention and the KV-cache write, FP8
linear, RMSNorm, activations, RoPE, embedding, logprobs) run on CPU tensors with
their GPU constants, Triton's driver replaced by one that reports an sm_90 target, and every kernel
launch turned into a compile-only warmup (Triton front end, the NVIDIA backend's passes and the
wheel's bundled ``ptxas``). Nothing executes, so no bit is checked here: this shows that the
kernels lower for sm_90 and which instructions they lower to, e.g. the 64-row ``tl.dot`` of the
attention tile becoming ``wgmma`` (a 16-row dot lowers to ``mma.sync``, whose bits differ:
``benchmarks/RESULTS.md``, session 12) and the TMA variants issuing bulk tensor copies. It uses
the Triton of the environment it runs in (the CPU venv's, 3.9 today; the H200 image has 3.6),
so it catches a kernel that no longer compiles or lowers differently there, not every
difference between Triton releases; each record carries ``triton``, the version used.

Prints one JSON object per compiled kernel: ``triton``, ``case``, ``kernel``, ``constexprs`` (the
specialization's compile-time values), ``num_warps``, ``num_stages``, ``shared`` (bytes of shared
memory the launch needs), PTX instruction counts ``wgmma_m64``, ``mma_sync``,
``tma_copies`` (``cp.async.bulk.tensor``), ``wgmma_shapes`` (the distinct ``wgmma`` instructions), and
``reduce_operands`` (the tensor type, layout spelled out, of each ``tt.reduce``'s operand in the TTGIR:
with the combine function, what fixes a reduction's order on the GPU).

    env -u TRITON_INTERPRET python tests/sm90_lowering.py
"""

from __future__ import annotations

import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("sm90_lowering.py: unset TRITON_INTERPRET (it compiles the GPU code paths)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


class _Sm90Driver:
    """Just enough of Triton's active driver for compile-only launches."""

    def get_current_target(self):
        return SM90

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


RECORDS: list[dict] = []
_CASE = ["?"]


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


def _reduce_operands(ttgir: str) -> list[str]:
    layouts = dict(re.findall(r"^(#[\w]+) = (.*)$", ttgir, re.M))
    found = []
    for operand in re.findall(r'"tt\.reduce"\((%[\w.]+)\)', ttgir):
        m = re.search(rf"^\s*{re.escape(operand)} = .*: (tensor<[^>]*>)\s*(loc\(.*\))?$", ttgir, re.M)
        ty = m.group(1) if m else "?"
        found.append(re.sub(r"#\w+", lambda a: layouts.get(a.group(0), a.group(0)), ty))
    return found


def _compile_only(run):
    def wrapped(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        ptx = kernel.asm["ptx"]
        consts = {k: v for k, v in kwargs.items() if k.isupper()}
        RECORDS.append(dict(
            triton=triton.__version__, case=_CASE[0], kernel=self.fn.__name__, constexprs=consts, num_warps=kernel.metadata.num_warps,
            num_stages=kernel.metadata.num_stages, shared=kernel.metadata.shared,
            wgmma_m64=_count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64"), mma_sync=_count(ptx, r"\bmma\.sync"),
            tma_copies=_count(ptx, r"cp\.async\.bulk\.tensor"), reduce_operands=_reduce_operands(kernel.asm["ttgir"]),
            wgmma_shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.[a-z0-9.]+", ptx)))))
        return kernel
    return wrapped


def main() -> int:
    triton_driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only(JITFunction.run)

    import unified_models.ops.triton as ops_triton
    from unified_models.ops.activations import triton as activations
    from unified_models.ops.attention import causal_grads
    from unified_models.ops.attention import triton as attention
    from unified_models.ops.embedding import triton as embedding
    from unified_models.ops.fp8 import triton as fp8_linear
    from unified_models.ops.linear import triton as linear
    from unified_models.ops.logprob import triton as logprob
    from unified_models.ops.rmsnorm import triton as rmsnorm
    from unified_models.ops.rope import triton as rope

    for mod in (activations, attention, causal_grads, embedding, fp8_linear, linear, logprob, rmsnorm, rope):
        mod.check_device = lambda *a, **k: None  # CPU tensors stand in for CUDA ones: nothing runs
    linear._num_sms = lambda device: 132  # H200
    attention._has_tma = lambda device: True  # sm_90 has TMA (the CPU tensors' device does not)
    assert not ops_triton._common.INTERPRET

    bf16 = torch.bfloat16
    N, K = 256, 128
    w = torch.zeros(N, K, dtype=bf16)
    for T in linear.tier_probe_rows():
        for out_dtype in (bf16, torch.float32):
            _CASE[0] = f"linear T={T} bf16->{str(out_dtype).split('.')[-1]}"
            linear.linear_triton(torch.zeros(T, K, dtype=bf16), w, None, out_dtype)
    for T in (1, 65, 513):
        _CASE[0] = f"linear T={T} fp32 operands"
        linear.linear_triton(torch.zeros(T, K), w.float(), None, torch.float32)

    E = 128
    for width, (H, G) in {"8b": (32, 8), "nano": (32, 2)}.items():
        for S, kv_tma in ((16, False), (64, False), (64, True)):
            buf = torch.zeros(9, 2, S, G, E, dtype=bf16)  # vLLM's [blocks, 2, S, G, E] allocation
            T = 5
            _CASE[0] = f"attention {width} S={S} kv_tma={kv_tma}"
            attention.paged_attention_triton(
                torch.zeros(T, H, E, dtype=bf16), buf[:, 0], buf[:, 1], torch.zeros(2, 40, dtype=torch.int32),
                torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int64), E ** -0.5,
                launch=attention.AttentionLaunch(kv_tma=kv_tma))
    # FP8 cache: the pointer path with the e4m3 read rule
    buf = torch.zeros(9, 2, 64, 8, E, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    _CASE[0] = "attention 8b S=64 fp8 cache"
    attention.write_kv_cache_triton(torch.zeros(5, 8, E, dtype=bf16), torch.zeros(5, 8, E, dtype=bf16), buf[:, 0],
                                    buf[:, 1], torch.zeros(5, dtype=torch.int64), one, one)
    attention.paged_attention_triton(torch.zeros(5, 32, E, dtype=bf16), buf[:, 0], buf[:, 1],
                                     torch.zeros(2, 40, dtype=torch.int32), torch.zeros(5, dtype=torch.int32),
                                     torch.zeros(5, dtype=torch.int64), E ** -0.5, one, one)

    # the trainer's fused attention backward (whole prompts), nano widths: 32 query heads over 2 kv heads
    for e in (64, 128):
        _CASE[0] = f"causal attention grads E={e}"
        q = torch.zeros(300, 32, e, dtype=bf16)
        kv = torch.zeros(300, 2, e, dtype=bf16)
        causal_grads.causal_attention_grads(q, kv, kv, q, [300], e ** -0.5)

    D, V = 4096, 32064
    x = torch.zeros(7, D, dtype=bf16)
    for name, call in {
        "rms_norm": lambda: rmsnorm.rms_norm_triton(x, torch.ones(D, dtype=bf16), 1e-5),
        "relu2": lambda: activations.relu2_triton(torch.zeros(7, 21504, dtype=bf16)),
        "swiglu": lambda: activations.swiglu_triton(torch.zeros(7, 1024, dtype=bf16), torch.zeros(7, 1024, dtype=bf16)),
        "logprobs": lambda: logprob.logprobs_triton(torch.zeros(7, V), 0.7),
        "embedding": lambda: embedding.embedding_triton(torch.zeros(7, dtype=torch.int64), torch.zeros(V, D, dtype=bf16)),
        "rope": lambda: rope.apply_rope_triton(torch.zeros(7, 32, E, dtype=bf16), torch.zeros(7, dtype=torch.int64),
                                               torch.zeros(64, E // 2), torch.zeros(64, E // 2)),
        "fp8_linear": lambda: fp8_linear.fp8_linear_triton(x, torch.zeros(256, D, dtype=torch.float8_e4m3fn),
                                                           one.reshape(1), one.reshape(1)),
    }.items():
        _CASE[0] = name
        call()
    # the fused residual add + RMSNorm next to the plain norm: Nano-30B, 8B / Flash hidden sizes
    for d in (2688, 4096, 7168):
        for stream in (bf16, torch.float32):
            xs, wd = torch.zeros(7, d, dtype=stream), torch.ones(d, dtype=bf16)
            _CASE[0] = f"rms_norm D={d} {str(stream).split('.')[-1]}"
            rmsnorm.rms_norm_triton(xs, wd, 1e-5, bf16)
            _CASE[0] = f"add_rms_norm D={d} {str(stream).split('.')[-1]}"
            rmsnorm.add_rms_norm_triton(xs, xs.clone(), wd, 1e-5, bf16)
    for rec in RECORDS:
        print(json.dumps(rec, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
