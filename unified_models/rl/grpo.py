"""GRPO: group-normalised advantages and the per-token policy-gradient loss.

Group Relative Policy Optimization (Shao et al. 2024, *DeepSeekMath*, §4.1,
arXiv:2402.03300), outcome supervision: for each prompt, G completions
``o_1..o_G`` are sampled from the old policy and scored ``r_1..r_G``; every
token of ``o_i`` gets the advantage

    A_i = (r_i - mean(r)) / (std(r) + eps)                 (DeepSeekMath §4.1.2)

(``std`` is the unbiased sample std of the group, as in TRL's GRPOTrainer; a
group with equal rewards gets A = 0). The objective (DeepSeekMath eq. 3),
written as a loss to minimise, is

    L = 1/S Σ_i 1/|o_i| Σ_t [ -min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) + β k3_it ]

over the S sequences of the step, with the importance ratio

    ρ_it = π_θ(o_it | q, o_i<t) / π_old(o_it | q, o_i<t) = exp(logp_it - old_logp_it)

(``old_logp`` detached) and, optionally, the k3 estimator of KL(π_θ || π_ref)
to a frozen reference policy (DeepSeekMath eq. 4; Schulman 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

    k3_it = π_ref/π_θ - log(π_ref/π_θ) - 1 = exp(d) - d - 1,   d = ref_logp_it - logp_it   (>= 0)

This loop does one optimizer update per rollout step (DESIGN.md rule 10), so
π_θ at the update is the policy that sampled: with rollout and trainer logprobs
bitwise equal (diff = 0), ρ = exp(0) = 1 exactly, the clip is inactive and the
gradient is the plain policy gradient ``-A ∇logp`` per token.

Shapes: N completion tokens of the step, flat (sequence after sequence);
S sequences; P prompts; G samples per prompt (S = P·G). All tensors fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["group_advantages", "importance_ratio", "k3_kl", "token_weights", "GRPOLossOutput", "grpo_loss"]


def group_advantages(rewards_S: torch.Tensor, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean_g) / (std_g + eps)`` (DeepSeekMath §4.1.2).

    Args:
        rewards_S: fp32/fp64 ``[S]``, sequences ordered group after group
            (sequence ``s`` belongs to prompt ``s // group_size``).
        group_size: G >= 2.
        eps: added to the unbiased group std.

    Returns:
        fp32 ``[S]``; each group sums to ~0; a group of equal rewards gives zeros.

    Raises:
        ValueError: G < 2, S not a multiple of G, or a non-finite reward.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if rewards_S.dim() != 1 or rewards_S.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards_S.shape)} are not a flat [P * {group_size}] vector")
    if not bool(torch.isfinite(rewards_S).all()):
        raise ValueError("a reward is NaN or Inf")
    r_PG = rewards_S.double().view(-1, group_size)
    mean_P1 = r_PG.mean(dim=1, keepdim=True)
    std_P1 = r_PG.std(dim=1, unbiased=True, keepdim=True)
    return ((r_PG - mean_P1) / (std_P1 + eps)).view(-1).float()


def importance_ratio(logp_N: torch.Tensor, old_logp_N: torch.Tensor) -> torch.Tensor:
    """``ρ = exp(logp - old_logp)`` (gradient flows through ``logp`` only); exactly 1 where the bits are equal."""
    return torch.exp(logp_N - old_logp_N.detach())


def k3_kl(logp_N: torch.Tensor, ref_logp_N: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ || π_ref): ``exp(d) - d - 1``, ``d = ref_logp - logp`` (>= 0).

    Unbiased for KL(π_θ || π_ref) when the tokens are sampled from π_θ
    (Schulman 2020; DeepSeekMath eq. 4). ``ref_logp`` is treated as a constant.
    Computed with ``expm1`` so it is exactly 0 when the logprobs are equal.
    """
    d = ref_logp_N.detach() - logp_N
    return torch.expm1(d) - d


def token_weights(completion_lengths: list[int]) -> torch.Tensor:
    """fp32 ``[N]`` weights ``1 / (S |o_i|)`` of each completion token (DeepSeekMath eq. 3's
    ``1/G Σ_i 1/|o_i| Σ_t``, averaged over all S sequences of the step).

    Summing ``weight * per-token loss`` over micro-batches gives the step loss,
    so the gradient does not depend on how sequences are split into micro-batches.
    Empty completions contribute nothing.
    """
    s = len(completion_lengths)
    if s == 0:
        return torch.zeros(0)
    parts = [torch.full((n,), 1.0 / (s * n), dtype=torch.float32) for n in completion_lengths if n > 0]
    return torch.cat(parts) if parts else torch.zeros(0)


@dataclass
class GRPOLossOutput:
    """``loss`` (scalar, differentiable) and detached per-token diagnostics ``[N]``."""

    loss: torch.Tensor
    ratio_N: torch.Tensor
    k3_N: torch.Tensor | None
    clipped_N: torch.Tensor


def grpo_loss(logp_N: torch.Tensor, old_logp_N: torch.Tensor, advantages_N: torch.Tensor, weights_N: torch.Tensor,
              *, ref_logp_N: torch.Tensor | None = None, kl_coef: float = 0.0,
              clip_eps: float = 0.2) -> GRPOLossOutput:
    """GRPO loss of a set of completion tokens (see the module doc for the formula).

    Args:
        logp_N: fp32 ``[N]`` logprobs of the sampled tokens under the current
            parameters, with a graph to them.
        old_logp_N: fp32 ``[N]`` logprobs of the policy that sampled (recomputed by
            the trainer, or the rollout's); a constant.
        advantages_N: fp32 ``[N]`` the advantage of each token's sequence.
        weights_N: fp32 ``[N]`` from :func:`token_weights` (the tokens' share of the step loss).
        ref_logp_N: fp32 ``[N]`` logprobs of the frozen reference policy (needed when ``kl_coef > 0``).
        kl_coef: β >= 0.
        clip_eps: ε of the clipped ratio (PPO); inactive while ρ = 1.

    Returns:
        :class:`GRPOLossOutput`; ``loss = Σ_n w_n ℓ_n``.

    Raises:
        ValueError: shapes differ, ``kl_coef < 0``, or ``kl_coef > 0`` without ``ref_logp_N``.
    """
    n = logp_N.shape
    for name, t in (("old_logp_N", old_logp_N), ("advantages_N", advantages_N), ("weights_N", weights_N)):
        if t.shape != n:
            raise ValueError(f"grpo_loss: {name} has shape {tuple(t.shape)}, logp_N {tuple(n)}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    adv = advantages_N.detach().to(logp_N.dtype)
    ratio = importance_ratio(logp_N, old_logp_N)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    k3 = None
    if kl_coef > 0:
        if ref_logp_N is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logp_N")
        if ref_logp_N.shape != n:
            raise ValueError(f"grpo_loss: ref_logp_N has shape {tuple(ref_logp_N.shape)}, logp_N {tuple(n)}")
        k3 = k3_kl(logp_N, ref_logp_N)
        per_token = per_token + kl_coef * k3
    loss = (weights_N.detach().to(per_token.dtype) * per_token).sum()
    return GRPOLossOutput(loss=loss, ratio_N=ratio.detach(), k3_N=None if k3 is None else k3.detach(),
                          clipped_N=(clipped.detach() < unclipped.detach()))
