"""Trainer -> vLLM weight sync in place: data pointers kept, next rollout equals the trainer bitwise.

One engine on the tiny preset and the Megatron module in the same process (as
the RL loop runs them): roll out, update the trainer with the optimizer, sync,
roll out again; the engine's logprobs equal the Megatron module's recompute with
the new weights, bit for bit, and differ from the old weights' numbers.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vllm  # noqa: F401  (a required dependency: a missing install must fail, not skip)

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.backends.megatron.optimizer import OptimizerConfig, build_optimizer
from unified_models.backends.vllm import engine
from unified_models.backends.vllm.weight_sync import sync_weights
from unified_models.dsl import CheckpointError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# a prompt longer than one KV block (64): its first block is prefix-cached by the first rollout
PROMPTS = [list(range(5, 75)), [1, 9, 33, 7], list(range(200, 217))]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint):
    init_parallel_state()
    model = UnifiedMegatronModel.from_pretrained(tiny_checkpoint, device=DEVICE)
    opt = build_optimizer(model, OptimizerConfig(lr=2e-3, clip_grad=1.0))
    yield model, opt
    opt.close()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint, trainer):
    llm = engine.make_llm(tiny_checkpoint, seed=0, max_model_len=128, max_num_seqs=4, max_logprobs=0,
                          skip_tokenizer_init=True, gpu=DEVICE == "cuda", gpu_memory_utilization=0.3)
    yield llm
    engine.shutdown_llm(llm)
    del llm
    gc.collect()


def _rollout(llm) -> tuple[list[list[int]], list[torch.Tensor]]:
    params = [engine.sampling_params(seed=40 + i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                                     detokenize=False) for i in range(len(PROMPTS))]
    outs = engine.generate_token_ids(llm, PROMPTS, params)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [torch.tensor([step[t].logprob for t, step in zip(tk, o.outputs[0].logprobs)], dtype=torch.float32)
           for tk, o in zip(toks, outs)]
    return toks, lps


def _recompute(model, completions, grad: bool = False) -> list[torch.Tensor]:
    """The Megatron module's logprob of every sampled token (all sequences packed, THD)."""
    seqs = [p + c for p, c in zip(PROMPTS, completions)]
    ids = torch.tensor([t for s in seqs for t in s], device=DEVICE)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    rows = [int(cu[i]) + len(p) - 1 + j for i, (p, c) in enumerate(zip(PROMPTS, completions)) for j in range(len(c))]
    with torch.set_grad_enabled(grad):
        lp = model.token_logprobs(ids, cu.to(DEVICE), torch.tensor(rows, device=DEVICE))
    return list((lp if grad else lp.cpu()).split([len(c) for c in completions]))


def _train_step(model, opt, completions) -> None:
    """A policy-gradient step on the rollout: push the sampled tokens' logprobs up."""
    opt.zero_grad()
    loss = -torch.cat(_recompute(model, completions, grad=True)).sum()
    loss.backward()
    assert opt.step()["update_successful"]


def test_sync_keeps_pointers_and_next_rollout_equals_trainer(llm, trainer):
    model, opt = trainer
    live = engine.get_model(llm).params()
    ptrs = {n: p.data_ptr() for n, p in live.items()}

    toks, lps = _rollout(llm)
    for a, b in zip(lps, _recompute(model, toks)):
        assert torch.equal(a, b)

    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(model, opt, toks)
    report = sync_weights(llm, model.named_parameters())

    assert set(report.copied) | set(report.unchanged) == set(live) and len(report.copied) > len(live) // 2
    assert all(not torch.equal(old[n], dict(model.named_parameters())[n]) for n in report.copied)
    assert report.prefix_cache_reset and report.derived == ()
    assert report.bytes_copied == sum(live[n].numel() * live[n].element_size() for n in report.copied)
    for n, p in model.named_parameters():
        assert live[n].data_ptr() == ptrs[n], f"{n}: storage moved"
        assert torch.equal(live[n], p.detach()), n

    toks2, lps2 = _rollout(llm)
    for i, (a, b) in enumerate(zip(lps2, _recompute(model, toks2))):
        assert torch.equal(a, b), f"prompt {i}: max |diff| {float((a - b).abs().max()):.3e}"
    # the engine really computes with the new weights: the old weights score the new tokens differently
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.load_hf_state_dict(old)
    assert not all(torch.equal(a, b) for a, b in zip(lps2, _recompute(model, toks2)))
    model.load_hf_state_dict(new)

    again = sync_weights(llm, dict(model.named_parameters()))  # nothing changed since
    assert again.copied == () and not again.prefix_cache_reset


def test_bad_syncs_change_nothing(llm, trainer):
    model, _ = trainer
    live = engine.get_model(llm).params()
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
