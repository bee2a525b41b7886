"""Which traces the goal verifier samples (goal/sampling.py)."""

from __future__ import annotations

import random

import pytest

from spanguard.goal.sampling import should_sample


def test_sampling_is_deterministic_per_trace_id():
    rng = random.Random(6)
    ids = [format(rng.getrandbits(128), "032x") for _ in range(200)]
    first = [should_sample(t, 0.3) for t in ids]
    assert first == [should_sample(t, 0.3) for t in ids]  # a redelivered trace: same answer
    assert first == [should_sample(t.upper(), 0.3) for t in ids]  # hex case does not matter


def test_sampling_is_roughly_proportional_and_nested():
    rng = random.Random(2024)
    ids = [format(rng.getrandbits(128), "032x") for _ in range(4_000)]
    quarter = {t for t in ids if should_sample(t, 0.25)}
    assert 0.20 * len(ids) <= len(quarter) <= 0.30 * len(ids)
    tenth = {t for t in ids if should_sample(t, 0.10)}
    assert tenth <= quarter  # raising the rate keeps every trace already sampled
    assert all(should_sample(t, 1.0) for t in ids[:50])
    assert not any(should_sample(t, 0.0) for t in ids[:50])


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_sampling_rate_out_of_range(rate):
    with pytest.raises(ValueError, match="sample rate"):
        should_sample("0af7651916cd43dd8448eb211c80319c", rate)
