"""GRPO math: advantages, loss gradient sign, importance ratio, k3, token weights."""

import math

import pytest
import torch

from unified_models.rl.grpo import group_advantages, grpo_loss, importance_ratio, k3_kl, token_weights


def test_group_advantages_normalise_each_group():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(4 * 8, generator=g, dtype=torch.float64)
    a = group_advantages(r, 8)
    assert a.dtype == torch.float32 and a.shape == (32,)
    for k in range(4):
        grp, adv = r[k * 8:(k + 1) * 8], a[k * 8:(k + 1) * 8].double()
        expect = (grp - grp.mean()) / (grp.std(unbiased=True) + 1e-6)
        assert torch.allclose(adv, expect, atol=1e-6)
        assert abs(float(adv.sum())) < 1e-5
        assert torch.equal(torch.argsort(adv), torch.argsort(grp))  # order preserved
    # a group with equal rewards has no signal
    same = group_advantages(torch.tensor([0.5] * 4 + [0.0, 1.0, 0.0, 1.0]), 4)
    assert torch.equal(same[:4], torch.zeros(4))
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="multiple|flat"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([0.0, float("nan")]), 2)


def test_importance_ratio_is_exactly_one_for_equal_logprobs():
    lp = torch.log_softmax(torch.randn(64, 100, generator=torch.Generator().manual_seed(1)), -1)[:, 3]
    assert torch.equal(importance_ratio(lp, lp.clone()), torch.ones(64))
    other = lp + 1e-3
    assert not torch.equal(importance_ratio(other, lp), torch.ones(64))
    assert torch.allclose(importance_ratio(other, lp), torch.full((64,), math.exp(1e-3)))


def test_k3_is_zero_when_equal_nonnegative_and_estimates_kl():
    lp = torch.linspace(-5, -0.1, 50)
    assert torch.equal(k3_kl(lp, lp.clone()), torch.zeros(50))
    g = torch.Generator().manual_seed(2)
    logits_p, logits_q = torch.randn(20, generator=g), torch.randn(20, generator=g)
    lp_p, lp_q = torch.log_softmax(logits_p.double(), 0), torch.log_softmax(logits_q.double(), 0)
    assert bool((k3_kl(lp_p, lp_q) >= 0).all())
    # E_{x ~ p}[k3(x)] = KL(p || q) exactly when averaged over p's probabilities
    p = lp_p.exp()
    kl = float((p * (lp_p - lp_q)).sum())
    assert abs(float((p * k3_kl(lp_p, lp_q)).sum()) - kl) < 1e-12
    # and as a Monte-Carlo estimate from samples of p
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    assert abs(float(k3_kl(lp_p[x], lp_q[x]).mean()) - kl) < 0.02 * max(kl, 1e-3) + 2e-3


def test_token_weights_average_each_sequence_then_the_batch():
    w = token_weights([2, 4, 0, 1])
    assert w.shape == (7,)
    assert torch.allclose(w, torch.tensor([1 / 8, 1 / 8, 1 / 16, 1 / 16, 1 / 16, 1 / 16, 1 / 4]))
    assert abs(float(w.sum()) - 3 / 4) < 1e-7  # the empty sequence counts in S but has no token


def _policy(seed=0, n=6, v=11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, requires_grad=True)
    toks = torch.randint(0, v, (n,), generator=g)
    return logits, toks


def test_loss_gradient_raises_positive_advantage_tokens_and_lowers_negative_ones():
    logits, toks = _policy()
    logp = torch.log_softmax(logits, -1).gather(1, toks[:, None]).view(-1)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    w = token_weights([3, 3])
    out = grpo_loss(logp, logp.detach(), adv, w)
    assert torch.equal(out.ratio_N, torch.ones(6)) and not bool(out.clipped_N.any())
    out.loss.backward()
    # gradient descent step on the logits moves logp in the direction of the advantage
    with torch.no_grad():
        stepped = torch.log_softmax(logits - 0.1 * logits.grad, -1).gather(1, toks[:, None]).view(-1)
    moved = stepped - logp.detach()
    assert bool((moved[:3] > 0).all()) and bool((moved[3:] < 0).all())
    # at ratio 1 the gradient is the plain policy gradient -Σ w A ∇logp
    logits2 = logits.detach().clone().requires_grad_(True)
    pg = -(w * adv * torch.log_softmax(logits2, -1).gather(1, toks[:, None]).view(-1)).sum()
    pg.backward()
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-7)


def test_clip_stops_the_gradient_beyond_the_trust_region():
    logits, toks = _policy(3)
    logp = torch.log_softmax(logits, -1).gather(1, toks[:, None]).view(-1)
    old = logp.detach() - 1.0  # ratio e ~ 2.72 > 1.2
    out = grpo_loss(logp, old, torch.ones(6), token_weights([6]), clip_eps=0.2)
    assert bool(out.clipped_N.all())
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_kl_term_pulls_towards_the_reference():
    logits, toks = _policy(4)
    logp = torch.log_softmax(logits, -1).gather(1, toks[:, None]).view(-1)
    ref = logp.detach() - 0.5  # the reference rates these tokens lower
    w = token_weights([6])
    out = grpo_loss(logp, logp.detach(), torch.zeros(6), w, ref_logp_N=ref, kl_coef=0.1)
    d = -0.5
    assert torch.allclose(out.k3_N, torch.full((6,), math.exp(d) - d - 1))
    assert abs(float(out.loss.detach()) - 0.1 * (math.exp(d) - d - 1)) < 1e-6
    out.loss.backward()
    with torch.no_grad():
        stepped = torch.log_softmax(logits - 1.0 * logits.grad, -1).gather(1, toks[:, None]).view(-1)
    assert bool((stepped < logp.detach()).all())  # logp moves down towards ref
    with pytest.raises(ValueError, match="ref_logp_N"):
        grpo_loss(logp, logp.detach(), torch.zeros(6), w, kl_coef=0.1)
    with pytest.raises(ValueError, match="shape"):
        grpo_loss(logp, logp.detach()[:3], torch.zeros(6), w)
