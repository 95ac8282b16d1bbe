"""The expert-parallel seam (``layers/expert_parallel.py``): a dispatcher handed to the forward
replaces how the routed experts run, without touching the layers, and a dispatcher that follows
the seam's contract (per-assignment expert outputs computed at the experts' owners on the rows
they receive, the combine at the token's owner in slot order) is bitwise equal to EP = 1.

The two-owner dispatcher below simulates EP = 2 in one process: each "rank" receives only the
rows of its own experts (what an all-to-all would move) and holds only its block of the stacks.
"""

from __future__ import annotations

import pytest
import torch

from unified_models import ops
from unified_models.converters.hf_safetensors import spec_and_state_dict
from unified_models.dsl import MoESpec, ParallelismError
from unified_models.dsl.weights import LinearFormat
from unified_models.forward import forward_hidden
from unified_models.layers.expert_parallel import LOCAL_EXPERTS, ShardPlan
from unified_models.ops.moe import moe_combine, moe_expert_outputs
from unified_models.private_state import PrivateStateStore
from unified_models.state import FlatBatch


class TwoOwners:
    """EP = 2 in one process: rank r holds experts ``plan.local_experts(E, r)`` and computes the
    expert outputs of the assignment rows routed to them; the rows go back to their ``[T*K]``
    places and ``moe_combine`` sums them in slot order at the token's owner."""

    def __init__(self):
        self.calls = 0
        self.rows_per_rank = [0, 0]

    def experts(self, plan, x_TD, ids_TK, w_TK, up, down, shared_TD, *, nvfp4, out_dtype):
        assert plan.ep_size == 1  # the engines' plan; this dispatcher simulates its own
        sim = ShardPlan(ep_size=2)
        self.calls += 1
        T, K = ids_TK.shape
        E = up.shape[0]
        if nvfp4:  # masters quantized per expert by ModelOpt's rule: slicing first gives the same codes
            up, down = ops.nvfp4_quantize(up), ops.nvfp4_quantize(down)
        flat = ids_TK.reshape(-1)
        token = torch.arange(T).repeat_interleave(K)
        owner = sim.owner(flat, E)
        rows = torch.empty(T * K, x_TD.shape[1], dtype=torch.float32)
        for r in range(2):
            sel = (owner == r).nonzero().squeeze(1)
            local = sim.local_experts(E, r)
            self.rows_per_rank[r] += int(sel.numel())
            if not sel.numel():
                continue
            part = lambda w: (w[local.start:local.stop] if isinstance(w, torch.Tensor)
                              else ops.NVFP4Weight(w.weight[local.start:local.stop],
                                                   w.weight_scale[local.start:local.stop],
                                                   w.weight_scale_2[local.start:local.stop]))
            ids_r = (flat[sel] - local.start).view(-1, 1).to(ids_TK.dtype)
            rows[sel] = moe_expert_outputs(x_TD[token[sel]], ids_r, part(up), part(down))
        return moe_combine(rows, w_TK, shared_TD, out_dtype)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path_factory.mktemp("ep") / "h")
    _, spec, sd = spec_and_state_dict(d)
    return spec, sd


def _forward(spec, sd, seqs, **kw):
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)
    batch = FlatBatch.from_cu_seqlens(ids, cu, None)
    store = PrivateStateStore(spec, [len(s) for s in seqs], block_size=16)
    store.bind(batch)
    with torch.no_grad():
        return forward_hidden(spec, sd, batch, store, **kw)


def _nvfp4(spec):
    return spec.with_weight_formats({m.expert_linear(e, p): LinearFormat("nvfp4", stored=False)
                                     for m in (s.mixer for s in spec.sublayers_of(MoESpec))
                                     for e in range(m.n_routed_experts) for p in ("up_proj", "down_proj")})


@pytest.mark.parametrize("experts", ["bf16", "nvfp4"])
def test_a_two_owner_dispatcher_is_bitwise_equal_to_ep1(hybrid, experts):
    spec, sd = hybrid
    spec = _nvfp4(spec) if experts == "nvfp4" else spec
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 32000, (n,), generator=g) for n in (37, 5, 64)]
    local = _forward(spec, sd, seqs)
    two = TwoOwners()
    ep = _forward(spec, sd, seqs, dispatcher=two)
    assert two.calls == len(spec.sublayers_of(MoESpec)) == 2
    assert min(two.rows_per_rank) > 0  # both "ranks" computed rows
    assert torch.equal(local.view(torch.int16), ep.view(torch.int16))


def test_the_dispatcher_is_the_only_way_the_experts_run(hybrid):
    """A dispatcher that drops the routed experts changes the output: the forward really goes through it."""
    spec, sd = hybrid

    class SharedOnly:
        def experts(self, plan, x_TD, ids_TK, w_TK, up, down, shared_TD, *, nvfp4, out_dtype):
            return shared_TD.to(out_dtype)

    seqs = [torch.arange(1, 20)]
    assert not torch.equal(_forward(spec, sd, seqs), _forward(spec, sd, seqs, dispatcher=SharedOnly()))


def test_shard_plan_and_local_dispatcher_refuse_what_they_cannot_do():
    plan = ShardPlan(ep_size=4, ep_rank=1)
    assert plan.local_experts(8) == range(2, 4)
    assert plan.owner(torch.tensor([0, 3, 7]), 8).tolist() == [0, 1, 3]
    with pytest.raises(ParallelismError, match="do not split over ep_size=4"):
        plan.experts_per_rank(6)
    with pytest.raises(ParallelismError, match="ep_rank=2 of ep_size=2"):
        ShardPlan(ep_size=2, ep_rank=2)
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ParallelismError, match="needs an expert-parallel dispatcher"):
        LOCAL_EXPERTS.experts(ShardPlan(ep_size=2), x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
                              torch.zeros(2, 4, 4, dtype=torch.bfloat16), torch.zeros(2, 4, 4, dtype=torch.bfloat16),
                              None, nvfp4=False, out_dtype=torch.bfloat16)
