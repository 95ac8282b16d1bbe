"""Per-step costs (issue 16 item 7): what is no longer rebuilt per step, and that no bit moved.

* The trainer's state stores reuse their storage across no-grad micro-batches
  (:class:`unified_models.private_state.StateBuffers`), bitwise equal to fresh stores even
  when the reused storage holds NaN (stale values are never read).
* The vLLM model's parameter dict is cached and rebuilt when a parameter is re-registered.
* A weight sync validates each tensor once (one NaN/Inf check per changed tensor), compares
  bits (a +0 -> -0 change is copied), and keeps every ``data_ptr``.
* The spec of vLLM's config is built once per process.
"""

from __future__ import annotations

import gc

import pytest
import torch

from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
from unified_models.dsl import CheckpointError
from unified_models.forward import forward_hidden
from unified_models.private_state import PrivateStateStore, StateBuffers
from unified_models.state import FlatBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poison(buffers: StateBuffers) -> int:
    n = 0
    for t in buffers._bufs.values():
        if t.is_floating_point() and t.element_size() > 1:
            t.fill_(float("nan"))
            n += 1
        else:
            t.fill_(0x7F)  # fp8 / integer storage: the e4m3 NaN pattern
            n += 1
    return n


@pytest.mark.parametrize("kind", ["attention", "hybrid"])
def test_reused_store_buffers_give_the_bits_of_fresh_stores(kind, tiny_model, peaked_checkpoint):
    """Three packed batches of different shapes through one StateBuffers (poisoned with NaN
    between batches) give the same hidden states, bit for bit, as fresh zeroed stores."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    if kind == "attention":
        _, spec, sd = tiny_model
    else:
        _, spec, sd = spec_and_state_dict(peaked_checkpoint("hybrid")[0])
    params = {n: t.to(DEVICE) for n, t in sd.items()}
    g = torch.Generator().manual_seed(0)
    batches = [[40, 7], [5, 70, 3], [64]]  # sequence lengths: more, then fewer rows than the buffers hold
    buffers = StateBuffers()
    for lens in batches:
        ids = torch.randint(0, spec.vocab_size, (sum(lens),), generator=g).to(DEVICE)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
        batch = FlatBatch.from_cu_seqlens(ids, cu)
        with torch.no_grad():
            fresh = PrivateStateStore(spec, lens, device=DEVICE)
            fresh.bind(batch)
            want = forward_hidden(spec, params, batch, fresh)
            reused = PrivateStateStore(spec, lens, device=DEVICE, buffers=buffers)
            reused.bind(batch)
            got = forward_hidden(spec, params, batch, reused)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert _poison(buffers) > 0  # the next batch reads nothing of this one's values


def test_trainer_recompute_reuses_stores_bitwise(tiny_model):
    _, spec, sd = tiny_model
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(100, 170))]
    completions = [[9, 8, 7, 6], [1, 2], [4] * 5]
    with Trainer(spec, sd, device=DEVICE, options=TrainerOptions(micro_batch_tokens=48)) as tr:
        assert len(tr.pack(prompts, completions)) == 3  # micro-batches of 41, 27 and 75 tokens
        first = tr.logprobs(prompts, completions)
        bufs = tr.model._state_buffers
        ptrs = {k: t.data_ptr() for k, t in bufs._bufs.items()}
        _poison(bufs)
        second = tr.logprobs(prompts, completions)
        assert {k: t.data_ptr() for k, t in bufs._bufs.items()} == ptrs  # nothing re-allocated
        # fresh stores (what every micro-batch allocated before): the same bits
        del tr.model._state_buffers
        store_init = PrivateStateStore.__init__

        def fresh_init(self, *a, buffers=None, **kw):
            store_init(self, *a, buffers=None, **kw)

        PrivateStateStore.__init__ = fresh_init
        try:
            fresh = tr.logprobs(prompts, completions)
        finally:
            PrivateStateStore.__init__ = store_init
    for a, b, c in zip(first.logprobs, second.logprobs, fresh.logprobs):
        assert a.shape[0] > 0
        assert torch.equal(a.view(torch.int32), c.view(torch.int32))
        assert torch.equal(b.view(torch.int32), c.view(torch.int32))


def test_state_buffers_take_grows_and_refuses_nothing():
    b = StateBuffers()
    x = b.take("k", (4, 2, 3), torch.bfloat16, "cpu", zero=True)
    assert x.shape == (4, 2, 3) and bool((x == 0).all()) and x.is_contiguous()
    x.fill_(5)
    y = b.take("k", (2, 2, 3), torch.bfloat16, "cpu", zero=True)
    assert y.data_ptr() == x.data_ptr() and bool((y == 5).all())  # reused rows are not refilled
    z = b.take("k", (6, 2, 3), torch.bfloat16, "cpu", zero=True)
    assert z.shape == (6, 2, 3) and bool((z == 0).all())  # grown: a new zeroed buffer
    w = b.take("k", (6, 2, 3), torch.float32, "cpu", zero=False)
    assert w.dtype == torch.float32 and w.stride() == (6, 3, 1)


# --------------------------------------------------------------------------- vLLM side


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_model):
    from unified_models.backends.vllm.rollout import RolloutEngine

    _, spec, sd = tiny_model
    eng = RolloutEngine(spec, tiny_checkpoint, state_dict=sd, device=DEVICE, seed=0, max_model_len=64,
                        max_num_seqs=2, gpu_memory_utilization=0.3)
    yield eng
    eng.close()
    gc.collect()


def test_params_dict_is_cached_and_follows_reregistration(engine, tiny_model):
    from unified_models.backends.vllm.live import get_model
    from unified_models.backends.vllm.model import spec_of_config

    model = get_model(engine.llm)
    a, b = model.params(), model.params()
    assert a["backbone.norm_f.weight"] is b["backbone.norm_f.weight"]
    assert model._params_cache is not None and len(a) == len(tiny_model[1].parameter_shapes())
    with pytest.raises(TypeError):
        a["backbone.norm_f.weight"] = None  # read-only view
    name = "backbone.norm_f.weight"
    owner = model.get_submodule("backbone.norm_f")
    old = owner._parameters["weight"]
    others = {n: p.data_ptr() for n, p in a.items() if n != name}
    new = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    new.weight_loader = old.weight_loader
    owner.register_parameter("weight", new)
    try:
        assert model.params()[name] is new and model.forward_params()[name] is new
        assert {n: p.data_ptr() for n, p in model.params().items() if n != name} == others
    finally:
        owner._parameters["weight"] = old  # direct table writes are seen too
    assert model.params()[name] is old
    # the spec of vLLM's config copy is built once per process
    cfg = model.vllm_config.model_config
    assert spec_of_config(cfg.hf_config, cfg.dtype) is model.spec


def test_sync_validates_each_tensor_once_and_copies_sign_of_zero(engine, tiny_model, monkeypatch):
    from unified_models.backends.vllm.live import get_model

    _, _, sd = tiny_model
    model = get_model(engine.llm)
    ptrs = {n: p.data_ptr() for n, p in model.params().items()}
    bumped = {n: (t.float() + 0.25).to(t.dtype) for n, t in sd.items()}
    calls = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: (calls.append(t.shape), isfinite(t))[1])
    report = engine.sync_weights(bumped)
    assert len(report.copied) == len(sd) and report.unchanged == ()
    assert len(calls) == len(sd)  # one NaN/Inf check per tensor (before: three passes, two casts)
    calls.clear()
    again = engine.sync_weights(bumped)
    assert again.copied == () and len(again.unchanged) == len(sd) and calls == []  # equal: no check
    live = model.params()
    assert all(torch.equal(live[n].view(torch.int16), bumped[n].view(torch.int16)) for n in sd)
    assert {n: p.data_ptr() for n, p in live.items()} == ptrs
    # +0 -> -0 is a change of bits: copied, not skipped
    name = "backbone.layers.0.mixer.q_proj.weight"
    signed = dict(bumped)
    signed[name] = bumped[name].clone()
    signed[name][0, 0] = 0.0
    engine.sync_weights(signed)
    signed[name][0, 0] = -0.0
    rep = engine.sync_weights(signed)
    assert rep.copied == (name,)
    assert torch.equal(live[name].view(torch.int16), signed[name].view(torch.int16))
    # a NaN anywhere rejects the whole sync (all bad tensors named), nothing is written
    bad = dict(sd)
    bad["backbone.norm_f.weight"] = torch.full_like(sd["backbone.norm_f.weight"], float("inf"))
    bad["backbone.layers.1.mixer.up_proj.weight"] = torch.full_like(sd["backbone.layers.1.mixer.up_proj.weight"],
                                                                    float("nan"))
    with pytest.raises(CheckpointError, match=r"norm_f\.weight.*up_proj\.weight|up_proj\.weight.*norm_f\.weight"):
        engine.sync_weights(bad)
    assert torch.equal(live[name].view(torch.int16), signed[name].view(torch.int16))
    engine.sync_weights(sd)
    assert all(torch.equal(live[n], sd[n]) for n in sd)
