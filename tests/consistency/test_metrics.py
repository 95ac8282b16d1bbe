import math

import pytest
import torch

from unified_models.consistency.metrics import compare_logprobs, full_vocab_max_abs_diff


def test_equal_logprobs_give_exact_zeros():
    a = torch.tensor([-1.5, -0.25, -7.0])
    d = compare_logprobs(a, a.clone())
    assert (d.max_abs_diff, d.mean_abs_diff, d.std_abs_diff, d.k3_kl, d.num_mismatched) == (0.0, 0.0, 0.0, 0.0, 0)
    assert d.bitwise_equal and d.tokens_compared == 3


def test_values_of_a_known_difference():
    a = torch.tensor([-1.0, -2.0])
    b = torch.tensor([-1.5, -2.0])
    d = compare_logprobs(a, b)
    assert d.max_abs_diff == 0.5 and d.mean_abs_diff == 0.25 and d.std_abs_diff == 0.25
    # k3 = mean((r-1) - log r), r = exp(b - a)
    expected = ((math.exp(-0.5) - 1) + 0.5) / 2
    assert d.k3_kl == pytest.approx(expected, rel=1e-12)
    assert d.num_mismatched == 1 and not d.bitwise_equal


def test_one_ulp_is_detected():
    a = torch.tensor([-3.0])
    b = torch.nextafter(a, torch.tensor([0.0]))
    d = compare_logprobs(a, b)
    assert d.num_mismatched == 1 and d.max_abs_diff > 0


def test_full_vocab_rows_and_errors():
    a = torch.tensor([[-0.1, float("-inf")], [-2.0, -0.2]])
    assert full_vocab_max_abs_diff(a, a.clone()) == 0.0
    b = a.clone()
    b[1, 0] = -2.25
    assert full_vocab_max_abs_diff(a, b) == 0.25
    with pytest.raises(ValueError):
        compare_logprobs(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError):
        compare_logprobs(torch.zeros(0), torch.zeros(0))
