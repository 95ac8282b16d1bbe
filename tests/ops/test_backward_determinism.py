"""The trainer's backward runs no op whose CUDA kernel sums or writes in run-to-run order.

``rl --resume`` continues bitwise and two runs of one step give the same gradients: on CUDA
that fails as soon as one gradient is a sum whose order the hardware picks. PyTorch's CUDA
``index_add_`` and ``scatter_add_`` add with atomics (``torch.use_deterministic_algorithms``
lists them), so a destination hit twice (an embedding row of a repeated token, a compressed
entry several queries read, a router row listing an expert twice) gets a different rounding
from run to run. The CPU cannot show such a race, so this audits the ops instead: a
``TorchDispatchMode`` records every aten op of one trainer backward, per model family, with
:func:`unified_models.ops.grad.helpers.sorted_accumulate` forced on (the CUDA form of the
backward's scatter-adds and the router's gather), and fails on any op of :data:`ATOMIC_WHEN_REPEATED`
with a repeated destination and any op of :data:`ALWAYS_RACY`, naming the op and the repo line
that called it. ``tests/gpu/test_autograd_gpu.py`` checks the bits themselves on the H200.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unified_models.ops.grad import helpers

#: aten ops whose CUDA kernel (PyTorch 2.11 on the H200, 2.13 here) accumulates or writes with atomics, racing only when two
#: elements go to the same destination: index -> how to find the destinations in the call's arguments.
ATOMIC_WHEN_REPEATED = {"aten.index_add", "aten.index_add_", "aten.scatter_add", "aten.scatter_add_",
                        "aten.scatter_reduce", "aten.scatter_reduce_", "aten.scatter", "aten.scatter_",
                        "aten.index_copy", "aten.index_copy_", "aten.index_put", "aten.index_put_",
                        "aten._index_put_impl_"}
#: aten ops nondeterministic on CUDA whatever their indices (torch.use_deterministic_algorithms' list).
ALWAYS_RACY = {"aten.put_", "aten.put", "aten.histc", "aten.nll_loss_forward", "aten.nll_loss2d_forward",
               "aten.index_reduce", "aten.index_reduce_"}
#: scans PyTorch runs with CUB's decoupled look-back on CUDA when the tensor is one row (order varies).
SCANS = {"aten.cumsum", "aten.cumsum_", "aten.cumprod", "aten.cumprod_", "aten.logcumsumexp"}


def _repeats(index: torch.Tensor) -> bool:
    return index.numel() != torch.unique(index).numel()


def _repeats_along(index: torch.Tensor, dim: int) -> bool:
    if index.dim() == 0 or index.shape[dim] < 2:
        return False
    s = index.sort(dim).values
    n = s.shape[dim]
    return bool((s.narrow(dim, 1, n - 1) == s.narrow(dim, 0, n - 1)).any())


def racy_call(name: str, args: tuple, kwargs: dict) -> str | None:
    """Why this aten call would give run-to-run different bits on CUDA, or None."""
    if name in ALWAYS_RACY:
        return "nondeterministic on CUDA"
    if name in SCANS:
        x, dim = args[0], args[1]
        one_row = x.dim() == 0 or x.numel() == x.shape[dim]
        return "a one-row floating scan (CUB decoupled look-back)" if one_row and x.is_floating_point() \
            and x.numel() > 1 else None
    if name not in ATOMIC_WHEN_REPEATED:
        return None
    if name.startswith("aten.index_add") or name.startswith("aten.index_copy"):
        return "atomics into a repeated destination row" if _repeats(args[2]) else None
    if name.startswith("aten.scatter"):
        if len(args) < 3 or not isinstance(args[2], torch.Tensor):
            return None
        return "atomics into a repeated destination in a row" if _repeats_along(args[2], args[1]) else None
    # index_put: accumulate=True is PyTorch's sort-based kernel on CUDA (deterministic); without
    # it a repeated destination is a race between writes
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    indices = [i for i in args[1] if i is not None]
    if accumulate or len(indices) != 1 or indices[0].dtype == torch.bool:
        return None
    return "racing writes to a repeated destination" if _repeats(indices[0]) else None


class AtomicAudit(TorchDispatchMode):
    """Records every aten call :func:`racy_call` objects to, with the innermost repo frame that made it."""

    def __init__(self):
        super().__init__()
        self.findings: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        why = racy_call(str(func.overloadpacket), args, kwargs)
        if why is not None:
            frames = [f for f in traceback.extract_stack() if "unified_models" in f.filename]
            where = f"{frames[-1].filename.split('unified_models/')[-1]}:{frames[-1].lineno}" if frames else \
                "autograd of a forward op"
            self.findings.append(f"{func.overloadpacket} at {where}: {why}")
        return func(*args, **kwargs)


def test_audit_catches_a_repeated_index_add():
    """The auditor itself: an ``index_add_`` onto a repeated row is reported with its cause; one onto
    distinct rows, and the sort-based ``index_put_(accumulate=True)``, are not."""
    dst = torch.zeros(4, 3)
    with AtomicAudit() as audit:
        dst.index_add_(0, torch.tensor([0, 2]), torch.ones(2, 3))
        dst.index_put_((torch.tensor([1, 1]),), torch.ones(2, 3), accumulate=True)
    assert audit.findings == []
    with AtomicAudit() as audit:
        dst.index_add_(0, torch.tensor([1, 3, 1]), torch.ones(3, 3))
        torch.zeros(2, 4).scatter_add_(1, torch.tensor([[0, 0], [1, 2]]), torch.ones(2, 2))
        torch.arange(5.0).cumsum(0)
    assert len(audit.findings) == 3, audit.findings
    assert "repeated destination row" in audit.findings[0] and "aten.scatter_add" in audit.findings[1]
    assert "one-row floating scan" in audit.findings[2]


@pytest.mark.parametrize("cuda_form", [False, True])
def test_index_add_rows_sums_repeats_in_a_fixed_order(monkeypatch, cuda_form):
    """Both forms (``index_add_`` on the CPU, ``index_put_(accumulate=True)`` as on CUDA) give the exact
    sums of integer-valued rows and fp64-close sums of rounding-sensitive ones; the CPU form the same
    bits on a repeat. (The CUDA form's repeat is checked on the H200: on the CPU, ``index_put_`` with
    ``accumulate=True`` adds with atomics once a call has 32,768 elements and two threads, which is why
    the CPU form is ``index_add_``; this test saw it differ.)"""
    monkeypatch.setattr(helpers, "sorted_accumulate", lambda t: cuda_form)
    idx = torch.tensor([3, 0, 3, 3, 1, 0])
    src = torch.arange(18, dtype=torch.float32).view(6, 3)
    got = helpers.index_add_rows(torch.zeros(5, 3), idx, src)
    want = torch.zeros(5, 3)
    for i, r in enumerate(idx.tolist()):
        want[r] += src[i]
    assert torch.equal(got, want)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 7, (4000,), generator=g)
    src = torch.randn(4000, 16, generator=g) * torch.logspace(-6, 6, 16)
    a = helpers.index_add_rows(torch.zeros(7, 16), idx, src)
    b = helpers.index_add_rows(torch.zeros(7, 16), idx, src)
    if not cuda_form:
        assert torch.equal(a, b)
    ref = torch.zeros(7, 16, dtype=torch.float64).index_add_(0, idx, src.double())
    assert torch.allclose(a.double(), ref, rtol=1e-5, atol=1e-6 * float(src.abs().max()))


def test_index_add_rows_refuses_mismatched_rows():
    """One src row per index, rows of dst's shape: anything else is named (the CUDA form, index_put_, would
    broadcast a single row over every index)."""
    with pytest.raises(ValueError, match="one src row per index"):
        helpers.index_add_rows(torch.zeros(4, 2), torch.tensor([0, 1, 2]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="one src row per index"):
        helpers.index_add_rows(torch.zeros(4, 2), torch.tensor([0, 1]), torch.ones(2, 3))


@pytest.mark.parametrize("cuda_form", [False, True])
def test_router_weights_with_a_repeated_expert(monkeypatch, cuda_form):
    """A routing row that lists an expert twice (a hash table can): the weights and their gradients are
    those of the gather, in the CUDA form (advanced indexing, sort-based backward) too."""
    from unified_models.ops.moe.backward import _route_weights

    monkeypatch.setattr(helpers, "sorted_accumulate", lambda t: cuda_form)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 0], [1, 5], [3, 3], [2, 4], [5, 5]], dtype=torch.int32)
    out = _route_weights(x, w, ids, True, 1.5)
    dx, dw = torch.autograd.grad(out.square().sum(), (x, w))
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    sel = torch.sigmoid(x2 @ w2.t()).gather(1, ids.long())
    ref = sel / (sel.sum(-1, keepdim=True) + 1e-20) * 1.5
    rx, rw = torch.autograd.grad(ref.square().sum(), (x2, w2))
    assert torch.allclose(out, ref, rtol=1e-12) and torch.allclose(dx, rx, rtol=1e-10) \
        and torch.allclose(dw, rw, rtol=1e-10)


# one preset per family and backward path: attention + MLP; Mamba-2 + relu2 MoE with NVFP4 masters;
# DeepSeek-V4 (mHC, compressed attention, hash and top-k routers, clamped SwiGLU) in bf16 and with
# block-FP8 / MXFP4 masters (straight-through); Qwen3 MoE
PRESETS = ["nemotron_h_tiny", "nemotron_h_hybrid_tiny_nvfp4", "deepseek_v4_tiny", "deepseek_v4_tiny_fp8",
           "deepseek_v4_tiny_fp4", "qwen3_moe_tiny"]


@pytest.mark.parametrize("preset", PRESETS)
def test_trainer_backward_has_no_atomic_race(monkeypatch, preset):
    """One micro-batch's backward (sum of the completion tokens' logprobs) of a trainer built from the
    preset: repeated tokens in every sequence (repeated embedding rows, compressed entries read by many
    queries), two sequences packed; no op of the backward, in its CUDA form, sums or writes in an order the
    hardware picks."""
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    monkeypatch.setattr(helpers, "sorted_accumulate", lambda t: True)
    _, spec, sd = spec_and_state_dict(build_preset_checkpoint(preset))
    prompts = [[1, 5, 9, 13, 5, 5, 9], [1, 7, 7, 7, 3]]
    completions = [[5, 5, 9, 22, 5, 9, 5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 3, [7, 7, 3, 5, 7] * 4]
    with Trainer(spec, sd, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as trainer:
        mb = trainer.pack(prompts, completions)[0]
        tok_R, rows_fn = trainer.model.token_logprobs_and_rows(mb.input_ids, mb.cu_seqlens, mb.rows, 1.0)
        rows_RV = rows_fn()  # the step's path: the token logprobs' fused backward and the full rows' own
        with AtomicAudit() as audit:
            (tok_R.sum() + rows_RV.logsumexp(-1).sum()).backward()
        grads = [p.main_grad for p in trainer.model.parameters() if p.requires_grad]  # the optimizer's fp32 buffers
    assert audit.ops > 200, f"{preset}: only {audit.ops} aten ops recorded: the audit saw no backward"
    assert sum(bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2, f"{preset}: most gradients are zero"
    assert audit.findings == [], f"{preset}: " + "; ".join(sorted(set(audit.findings)))


def test_train_batch_rows_read_without_grad_then_with_grad():
    """``TrainBatch.rows`` read first under ``torch.no_grad()`` (a metric) and then in the loss: the loss's
    rows carry their graph, so the step's gradient equals that of a loss that reads them only with grad."""
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    _, spec, sd = spec_and_state_dict(build_preset_checkpoint("nemotron_h_tiny"))
    prompts, completions = [[1, 5, 9, 13], [1, 7, 3]], [[5, 9, 22, 5, 9], [7, 3, 5, 7]]

    def entropy(rows):
        return -(rows.exp() * rows).sum()

    def metric_first(tb):
        with torch.no_grad():
            assert tb.rows.grad_fn is None and float(entropy(tb.rows)) > 0
        return -entropy(tb.rows) - 0.0 * tb.logprobs.sum()

    def grad_only(tb):
        return -entropy(tb.rows) - 0.0 * tb.logprobs.sum()

    norms = []
    for loss_fn in (metric_first, grad_only):
        with Trainer(spec, sd, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as trainer:
            norms.append(trainer.step(prompts, completions, loss_fn)["grad_norm"])
    assert norms[0] > 0 and norms[0] == norms[1], norms


@pytest.mark.parametrize("preset", ["nemotron_h_hybrid_tiny", "deepseek_v4_tiny"])
def test_trainer_gradients_repeat_bitwise(preset):
    """Two identical backwards of one 1,024-token micro-batch over a 64-id alphabet (every embedding row,
    router row and compressed entry hit many times) give the same fp32 gradient bits in every parameter,
    on this machine's threads: PyTorch's CPU ``index_put_(accumulate=True)`` (the backward of ``t[idx]``)
    adds with atomics once a call has 32,768 elements, which made DeepSeek-V4's compressor ``ape``
    gradients differ run to run before ``ops.embedding`` took that lookup.
    (``tests/gpu/test_autograd_gpu.py`` runs the same check on CUDA.)"""
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    _, spec, sd = spec_and_state_dict(build_preset_checkpoint(preset))
    g = torch.Generator().manual_seed(11)
    prompts = [[1] + torch.randint(2, 66, (15,), generator=g).tolist() for _ in range(4)]
    completions = [torch.randint(2, 66, (240,), generator=g).tolist() for _ in range(4)]
    with Trainer(spec, sd, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as trainer:
        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        runs = []
        for _ in range(2):
            trainer.optimizer.zero_grad()
            (mb,) = trainer.pack(prompts, completions)
            tok_R, _ = trainer.model.token_logprobs_and_rows(mb.input_ids, mb.cu_seqlens, mb.rows, 1.0)  # the step's
            tok_R.sum().backward()
            runs.append([p.main_grad.clone() for _, p in named])
    assert sum(bool(a.abs().sum() > 0) for a in runs[0]) > len(named) // 2
    differ = [n for (n, _), a, b in zip(named, *runs) if not torch.equal(a, b)]
    assert not differ, f"{preset}: gradients differ between two identical backwards: {differ[:8]}"
