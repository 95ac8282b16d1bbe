"""Rewards: gsm8k parsing on the bundled GSM8K rows, target-token fractions, the registry."""

import json
from decimal import Decimal

import pytest

from unified_models.dsl import PromptError, UnifiedModelsError
from unified_models.presets import default_prompts_path
from unified_models.rl.rewards import (
    Completion,
    build_reward,
    final_number,
    gsm8k_reference_answer,
    register_reward,
    reward_info,
    reward_names,
)


def _gsm8k_rows(n):
    with open(default_prompts_path(), encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def test_gsm8k_reference_is_the_number_after_the_marker():
    rows = _gsm8k_rows(50)
    for row in rows:
        tail = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        assert gsm8k_reference_answer(row["answer"]) == Decimal(tail)
    assert gsm8k_reference_answer("so 1,234 eggs\n#### 1,234") == Decimal(1234)
    with pytest.raises(PromptError, match="####"):
        gsm8k_reference_answer("no marker 12")
    with pytest.raises(PromptError, match="no number"):
        gsm8k_reference_answer("#### none")


def test_gsm8k_reward_reads_the_final_number_of_the_completion():
    reward = build_reward("gsm8k")
    for row in _gsm8k_rows(20):
        ref = gsm8k_reference_answer(row["answer"])
        # the dataset's own worked solution scores 1 (its last number is the answer)
        assert reward(Completion(token_ids=[], text=row["answer"], reference=row["answer"])) == 1.0
        right = f"First 3 + 4 = 7, then the answer is ${ref:,}."
        assert reward(Completion(token_ids=[], text=right, reference=row["answer"])) == 1.0
        wrong = f"The answer is {ref}, no wait, {ref + 1}"
        assert reward(Completion(token_ids=[], text=wrong, reference=row["answer"])) == 0.0
        assert reward(Completion(token_ids=[], text="I do not know", reference=row["answer"])) == 0.0


def test_final_number_forms():
    assert final_number("a 1,000 b 2.50") == Decimal("2.50")
    assert final_number("owes -5 dollars") == Decimal(-5)
    assert final_number("18.") == Decimal(18) and final_number("$18.00") == Decimal(18)
    assert final_number("none") is None


def test_target_token_fraction():
    reward = build_reward("target-token", target_token_id=7)
    assert reward(Completion(token_ids=[7, 7, 3, 7])) == 0.75
    assert reward(Completion(token_ids=[1, 2, 3])) == 0.0
    assert reward(Completion(token_ids=[7] * 5)) == 1.0
    assert reward(Completion(token_ids=[])) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        build_reward("target-token", target_token_id=-1)


def test_token_set_is_a_fifth_of_the_ids_without_structure():
    from unified_models.rl.rewards import TokenSetReward

    reward = build_reward("token-set")
    members = [t for t in range(32064) if reward.contains(t)]
    assert abs(len(members) / 32064 - 0.2) < 0.005
    for lo in (0, 10000, 20000):  # every id range holds about a fifth
        assert abs(sum(1 for t in members if lo <= t < lo + 2000) / 2000 - 0.2) < 0.03
    # independent formula: (t * 2654435761) mod 2^32 < 0.2 * 2^32
    assert members[:5] == [t for t in range(200) if (t * 2654435761) % 2 ** 32 < int(0.2 * 2 ** 32)][:5]
    inside, outside = members[0], next(t for t in range(100) if t not in members)
    assert reward(Completion(token_ids=[inside, inside, outside, inside])) == 0.75
    assert reward(Completion(token_ids=[outside] * 3)) == 0.0
    assert reward(Completion(token_ids=[])) == 0.0
    assert reward_info("token-set").defaults["temperature"] == 0.1
    for bad in (0.0, 1.0, -0.5, True, "0.2"):
        with pytest.raises(ValueError, match="fraction"):
            TokenSetReward(bad)


def test_registry():
    assert {"gsm8k", "target-token", "token-set"} <= set(reward_names())
    assert reward_info("gsm8k").needs_text and reward_info("gsm8k").needs_reference
    assert not reward_info("target-token").needs_text
    with pytest.raises(UnifiedModelsError, match="known rewards"):
        reward_info("nope")
    info = register_reward("length-test", lambda **_: (lambda c: float(len(c.token_ids))), description="len")
    try:
        assert build_reward("length-test")(Completion(token_ids=[1, 2])) == 2.0
        with pytest.raises(ValueError, match="already registered"):
            register_reward("length-test", info.factory)
    finally:
        from unified_models.rl import rewards

        rewards._REGISTRY.pop("length-test")
