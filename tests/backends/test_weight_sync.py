"""Trainer -> vLLM weight sync in place: data pointers kept, next rollout equals the trainer bitwise.

One :class:`RolloutEngine` on the tiny preset (started from the state dict read
once, on vLLM's dummy weights) and one :class:`Trainer` in the same process (as
the RL loop runs them): generate, one optimizer step, sync, generate again; the
engine's logprobs and whole rows equal the trainer's recompute with the new
weights, bit for bit, and differ from the old weights' numbers.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vllm  # noqa: F401  (a required dependency: a missing install must fail, not skip)

from unified_models.backends.megatron.optimizer import OptimizerConfig
from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
from unified_models.backends.vllm.live import get_model
from unified_models.backends.vllm.rollout import RolloutEngine
from unified_models.backends.vllm.weight_sync import sync_weights
from unified_models.dsl import CheckpointError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a prompt longer than one KV block (64): its first block is prefix-cached by the first rollout
PROMPTS = [list(range(5, 75)), [1, 9, 33, 7], list(range(200, 217))]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def trainer(tiny_model):
    _, spec, sd = tiny_model
    tr = Trainer(spec, sd, device=DEVICE, options=TrainerOptions(optimizer=OptimizerConfig(lr=2e-3, clip_grad=1.0)))
    yield tr
    tr.close()


@pytest.fixture(scope="module")
def rollout_engine(tiny_checkpoint, tiny_model, trainer):
    _, spec, sd = tiny_model
    eng = RolloutEngine(spec, tiny_checkpoint, state_dict=sd, device=DEVICE, seed=0, max_model_len=128,
                        max_num_seqs=4, gpu_memory_utilization=0.3)
    yield eng
    eng.close()
    gc.collect()


@pytest.fixture(scope="module")
def llm(rollout_engine):
    return rollout_engine.llm


def _generate(eng, **rows):
    ro = eng.generate(PROMPTS, max_new_tokens=MAX_TOKENS, seed=40, **rows)
    assert [len(c) for c in ro.completions] == [MAX_TOKENS] * len(PROMPTS)
    return ro


def _assert_trainer_equals_rollout(trainer, ro) -> list[torch.Tensor]:
    tr = trainer.logprobs(PROMPTS, ro.completions, full_rows_for=ro.full_row_keys)
    for i, (a, b) in enumerate(zip(ro.logprobs, tr.logprobs)):
        a = torch.tensor(a, dtype=torch.float32)
        assert torch.equal(a, b), f"prompt {i}: max |diff| {float((a - b).abs().max()):.3e}"
    assert ro.full_row_keys and set(tr.full_rows) == set(ro.full_row_keys)
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k], tr.full_rows[k]), k
    return tr.logprobs


def test_sync_keeps_pointers_and_next_rollout_equals_trainer(rollout_engine, llm, trainer):
    model = trainer.model
    live = get_model(llm).params()
    ptrs = {n: p.data_ptr() for n, p in live.items()}
    # the engine started on dummy weights and got the state dict in place: it holds the checkpoint's
    assert all(torch.equal(live[n], p.detach()) for n, p in model.named_parameters())

    ro = _generate(rollout_engine, full_vocab_rows=-1)
    assert len(ro.full_row_keys) == len(PROMPTS) * MAX_TOKENS
    _assert_trainer_equals_rollout(trainer, ro)

    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a policy-gradient step on the rollout: push the sampled tokens' logprobs up
    stats = trainer.step(PROMPTS, ro.completions, lambda tb: -tb.logprobs.sum())
    assert stats["update_successful"] and stats["iteration"] == 1
    report = rollout_engine.sync_weights(trainer.named_weights())

    assert set(report.copied) | set(report.unchanged) == set(live) and len(report.copied) > len(live) // 2
    assert all(not torch.equal(old[n], dict(model.named_parameters())[n]) for n in report.copied)
    assert report.prefix_cache_reset and report.derived == ()
    assert report.bytes_copied == sum(live[n].numel() * live[n].element_size() for n in report.copied)
    for n, p in model.named_parameters():
        assert live[n].data_ptr() == ptrs[n], f"{n}: storage moved"
        assert torch.equal(live[n], p.detach()), n

    # whole rows of the first two requests only (what rl keeps)
    ro2 = _generate(rollout_engine, full_row_requests=2)
    assert {i for i, _ in ro2.full_row_keys} == {0, 1} and len(ro2.full_row_keys) == 2 * MAX_TOKENS
    lps2 = _assert_trainer_equals_rollout(trainer, ro2)
    # the engine really computes with the new weights: the old weights score the new tokens differently
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_hf_state_dict(old)
    assert not all(torch.equal(a, b) for a, b in zip(lps2, trainer.logprobs(PROMPTS, ro2.completions).logprobs))
    model.load_hf_state_dict(new)

    again = rollout_engine.sync_weights(dict(trainer.named_weights()))  # nothing changed since
    assert again.copied == () and not again.prefix_cache_reset


def test_bad_syncs_change_nothing(llm, trainer):
    model = trainer.model
    live = get_model(llm).params()
    before = {n: p.clone() for n, p in live.items()}
    good = {n: p.detach() for n, p in model.named_parameters()}
    victim = "backbone.layers.1.mixer.up_proj.weight"
    bump = {n: t + 1 for n, t in good.items()}  # a change everywhere: a partial copy would show

    def rejects(tensors, match, **kw):
        with pytest.raises((CheckpointError, ValueError), match=match):
            sync_weights(llm, tensors, **kw)
        assert all(torch.equal(live[n], before[n]) for n in live)

    rejects({k: v for k, v in bump.items() if k != victim}, r"missing tensors: \['backbone.layers.1")
    rejects({**bump, "backbone.layers.99.mixer.up_proj.weight": bump[victim]}, "unexpected tensors")
    rejects({**bump, victim: bump[victim][:-1]}, "mis-shaped")
    nan = bump[victim].clone()
    nan[0, 0] = float("nan")
    rejects({**bump, victim: nan}, "NaN")
    rejects(list(bump.items()) + [(victim, bump[victim])], "given twice")
    rejects([(victim, bump[victim].tolist())], r"\(str, Tensor\)")
    # a partial sync is allowed without strict
    report = sync_weights(llm, {victim: good[victim]}, strict=False)
    assert report.copied == () and report.unchanged == (victim,)
