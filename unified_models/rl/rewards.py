"""Pluggable rewards for ``unified-models rl``.

A reward scores one sampled completion with a float. Rewards are registered by
name (``--reward NAME``) through :func:`register_reward`; each registration
declares whether the reward reads decoded text (then the loop detokenizes the
completion) or token ids, whether it needs the reference answer of the prompt
row, and the sampling defaults that suit it (used when the CLI flag is not
given).

Built in:

* ``gsm8k``: 1.0 if the final number in the completion equals the number after
  ``####`` in the row's ``answer`` field (GSM8K's format, Cobbe et al. 2021),
  else 0.0. Numbers are compared as exact decimals after dropping thousands
  separators, a leading ``$`` and a trailing ``.``; ``18``, ``18.0`` and
  ``18.00`` are equal.
* ``target-token``: the fraction of the completion's tokens equal to a given
  token id, in [0, 1]: a synthetic reward on which even a randomly
  initialised model can learn, which proves the loop updates the policy.
* ``token-set``: the fraction of the completion's tokens inside a fixed
  pseudo-random fifth of the vocabulary (:class:`TokenSetReward`): a dense
  synthetic signal. A randomly initialised model already scores about 0.2 and
  every group's samples differ, so every step has a non-zero advantage (with
  ``target-token`` the hybrid presets sample the target in step 1 only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Protocol, Sequence

from ..dsl import PromptError, UnifiedModelsError

__all__ = [
    "Completion", "Reward", "RewardInfo", "register_reward", "reward_names", "reward_info", "build_reward",
    "check_references",
    "Gsm8kReward", "TargetTokenReward", "TokenSetReward", "gsm8k_reference_answer", "final_number",
    "numbers_equal",
]


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled completion, what a reward may read.

    Attributes:
        token_ids: the sampled token ids (int, length = completion tokens).
        text: the decoded completion (only for rewards with ``needs_text``; else None).
        reference: the prompt row's reference answer (the JSONL ``answer`` field), or None.
    """

    token_ids: Sequence[int]
    text: str | None = None
    reference: str | None = None


class Reward(Protocol):
    """``reward(completion) -> float``; must be deterministic (resume replays nothing,
    but two runs with the same seed must score the same)."""

    def __call__(self, completion: Completion) -> float: ...


@dataclass(frozen=True, kw_only=True)
class RewardInfo:
    """A registered reward.

    Attributes:
        name: the ``--reward`` value.
        factory: ``factory(**options) -> Reward``; options come from CLI flags
            (e.g. ``target_token_id``); unknown options are ignored by the loop.
        needs_text: decode completions to text before scoring.
        needs_reference: every prompt row must carry a reference answer.
        description: one line for ``--help``.
        defaults: sampling defaults for this reward (``temperature``,
            ``max_new_tokens``, ``lr`` ...), used where the CLI flag is not given.
        check_reference: ``check_reference(answer) -> None`` raises ``PromptError`` for a
            reference answer the reward cannot score; :func:`check_references` runs it on
            every prompt row before any engine starts (None: no check).
    """

    name: str
    factory: Callable[..., Reward]
    needs_text: bool = False
    needs_reference: bool = False
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    check_reference: Callable[[str], Any] | None = None


_REGISTRY: dict[str, RewardInfo] = {}


def register_reward(name: str, factory: Callable[..., Reward], *, needs_text: bool = False,
                    needs_reference: bool = False, description: str = "",
                    defaults: dict[str, Any] | None = None, replace: bool = False,
                    check_reference: Callable[[str], Any] | None = None) -> RewardInfo:
    """Register a reward under ``name`` (the ``--reward`` value).

    Raises:
        ValueError: ``name`` is taken (pass ``replace=True`` to override) or empty.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"reward {name!r} is already registered")
    info = RewardInfo(name=name, factory=factory, needs_text=needs_text, needs_reference=needs_reference,
                      description=description, defaults=dict(defaults or {}), check_reference=check_reference)
    _REGISTRY[name] = info
    return info


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REGISTRY)


def reward_info(name: str) -> RewardInfo:
    """The registration of ``name``.

    Raises:
        UnifiedModelsError: unknown name (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise UnifiedModelsError(f"unknown reward {name!r}; known rewards: {reward_names()}")
    return _REGISTRY[name]


def check_references(info: RewardInfo, rows: Sequence[Any], path: Any) -> None:
    """Run ``info.check_reference`` on the ``answer`` of every prompt row (``.answer``, ``.line``).

    Raises:
        PromptError: ``<path>:<line>: <what is wrong>`` for the first row the reward cannot score.
    """
    if info.check_reference is None:
        return
    for row in rows:
        if row.answer is None:
            continue
        try:
            info.check_reference(row.answer)
        except PromptError as e:
            raise PromptError(f"{path}:{row.line}: {e} (reward {info.name!r})") from None


def build_reward(name: str, **options: Any) -> Reward:
    """``reward_info(name).factory(**options)``."""
    return reward_info(name).factory(**options)


# --------------------------------------------------------------------------- gsm8k

_NUMBER = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _to_decimal(s: str) -> Decimal | None:
    s = s.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def final_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (``1,234``, ``-5``, ``$18``, ``2.50``), or None."""
    found = _NUMBER.findall(text)
    for s in reversed(found):
        d = _to_decimal(s)
        if d is not None:
            return d
    return None


def gsm8k_reference_answer(answer: str) -> Decimal:
    """The number after the last ``####`` of a GSM8K ``answer`` field.

    Raises:
        PromptError: no ``####`` or no number after it.
    """
    if "####" not in answer:
        raise PromptError(f"GSM8K answer has no '####' marker: {answer[-80:]!r}")
    tail = answer.rsplit("####", 1)[1]
    d = _to_decimal(tail) if tail.strip() else None
    if d is None:
        d = final_number(tail)
    if d is None:
        raise PromptError(f"GSM8K answer has no number after '####': {tail.strip()[:80]!r}")
    return d


def numbers_equal(a: Decimal | None, b: Decimal | None) -> bool:
    """Exact decimal equality (``18 == 18.0``); None equals nothing."""
    return a is not None and b is not None and a == b


class Gsm8kReward:
    """1.0 if the completion's final number equals the reference's ``####`` number, else 0.0."""

    def __call__(self, completion: Completion) -> float:
        if completion.reference is None:
            raise PromptError("the gsm8k reward needs the prompt row's 'answer' field")
        if completion.text is None:
            raise ValueError("the gsm8k reward reads decoded text; Completion.text is None")
        return 1.0 if numbers_equal(final_number(completion.text), gsm8k_reference_answer(completion.reference)) \
            else 0.0


# --------------------------------------------------------------------------- target-token


class TargetTokenReward:
    """Fraction of the completion's tokens equal to ``token_id`` (0.0 for an empty completion).

    Args:
        token_id: int >= 0 (the loop checks it against the vocabulary).

    Raises:
        ValueError: ``token_id`` is not a non-negative int.
    """

    def __init__(self, token_id: int):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"target token id must be a non-negative integer, got {token_id!r}")
        self.token_id = token_id

    def __call__(self, completion: Completion) -> float:
        ids = completion.token_ids
        if len(ids) == 0:
            return 0.0
        return sum(1 for t in ids if int(t) == self.token_id) / len(ids)


# --------------------------------------------------------------------------- token-set

_HASH_MULT = 2654435761
"""Knuth's multiplicative hash constant (2^32 / golden ratio, odd): ``(t * c) mod 2^32`` spreads
consecutive token ids over [0, 2^32), so the set has no structure in the id order."""


class TokenSetReward:
    """Fraction of the completion's tokens in the set ``{t : (t * 2654435761) mod 2^32 < fraction * 2^32}``
    (0.0 for an empty completion).

    The set holds ``fraction`` of any id range up to rounding (about 0.2 of the vocabulary by
    default), so a near-uniform initial policy scores about ``fraction`` with a spread between
    samples: a dense signal. It depends only on the ids, not on the tokenizer.

    Args:
        fraction: share of the ids in the set, in (0, 1).

    Raises:
        ValueError: ``fraction`` not in (0, 1).
    """

    def __init__(self, fraction: float = 0.2):
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
            raise ValueError(f"token-set fraction must be a number in (0, 1), got {fraction!r}")
        self.fraction = float(fraction)
        self._threshold = int(self.fraction * 2 ** 32)

    def contains(self, token_id: int) -> bool:
        """Whether ``token_id`` is in the set."""
        return (int(token_id) * _HASH_MULT) % 2 ** 32 < self._threshold

    def __call__(self, completion: Completion) -> float:
        ids = completion.token_ids
        if len(ids) == 0:
            return 0.0
        return sum(1 for t in ids if self.contains(t)) / len(ids)


def _token_set_factory(**_: Any) -> Reward:
    return TokenSetReward()


def _target_token_factory(*, target_token_id: int, **_: Any) -> Reward:
    return TargetTokenReward(int(target_token_id))


def _gsm8k_factory(**_: Any) -> Reward:
    return Gsm8kReward()


register_reward(
    "gsm8k", _gsm8k_factory, needs_text=True, needs_reference=True,
    description="1 if the completion's final number equals the answer after '####', else 0",
    defaults={"temperature": 1.0, "max_new_tokens": 64, "lr": 1e-6},
    check_reference=gsm8k_reference_answer,
)
register_reward(
    "target-token", _target_token_factory,
    description="fraction of sampled tokens equal to --target-token-id (synthetic; a random model learns it)",
    # A randomly initialised model is nearly uniform over its vocabulary (the
    # tiny preset: 32,064 tokens, logit std 0.32, no token above 8e-5 on
    # average at T = 1), so at T = 1 no sample of a CPU-sized step contains
    # the target and every group advantage is 0. At T = 0.1 the same logits
    # give the most likely token a mean probability of ~4%: every step has
    # signal. The temperature is applied by the logprob op on both engines,
    # so the tempered policy is the one trained.
    # lr 3e-5 (Adam): measured on the tiny preset, reward rises over ~10-20
    # steps; 1e-4 saturates in 5 and 1e-3 in 2.
    defaults={"temperature": 0.1, "max_new_tokens": 16, "lr": 3e-5},
)
register_reward(
    "token-set", _token_set_factory,
    description="fraction of sampled tokens in a fixed pseudo-random fifth of the vocabulary (synthetic, dense)",
    # At T = 0.1 a random model's samples concentrate on a few likely tokens per context, some in
    # the set and some not, so every group has an advantage from step 1 on, and moving mass among
    # likely tokens is learnable. Measured on nemotron_h_hybrid_tiny (20 steps, diff = 0 at every
    # step): lr 1e-3 rises 0.21 -> 0.30 (step 5) -> 0.94 (step 9) -> 1.0 (step 11); lr 1e-4 stays
    # at 0.20-0.27, and at T = 1 (near-uniform over 32k ids) even lr 1e-3 stays at 0.20.
    defaults={"temperature": 0.1, "max_new_tokens": 16, "lr": 1e-3},
)
