"""CenteredClip alone (dedloc_worker.averaging.centered_clip), and the reducer that applies it to a round's parts."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from dedloc_worker.averaging.centered_clip import centered_clip
from dedloc_worker.averaging.robust import RobustPartReducer, RobustRule, notable_attestations
from hypothesis import given, settings
from hypothesis import strategies as st

finite = st.floats(min_value=-100, max_value=100, allow_nan=False, width=32)


@st.composite
def stacks(draw, min_inputs: int = 1):
    n = draw(st.integers(min_inputs, 6))
    d = draw(st.integers(1, 5))
    values = draw(st.lists(finite, min_size=n * d, max_size=n * d))
    weights = draw(st.lists(st.floats(0.5, 50), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float64).reshape(n, d), torch.tensor(weights, dtype=torch.float64)


@settings(max_examples=100, deadline=None)
@given(stacks())
def test_with_a_radius_beyond_every_offset_it_is_the_weighted_mean(stack):
    inputs, weights = stack
    spread = float((inputs.max(0).values - inputs.min(0).values).norm())
    result = centered_clip(inputs, weights, tau=2 * spread + 1.0, iterations=3)
    expected = (weights[:, None] * inputs).sum(0) / weights.sum()
    torch.testing.assert_close(result.centre, expected, atol=1e-9, rtol=1e-9)
    assert torch.all(result.scales == 1.0)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.lists(finite, min_size=3, max_size=3), st.floats(1e-3, 1e9), st.floats(0.01, 10),
       st.floats(0.05, 1.0), st.integers(1, 50))
def test_one_outlier_moves_the_result_by_at_most_its_weight_share_of_tau(honest, point, scale, tau, share, steps):
    """Honest inputs agree; the outlier, anywhere, with no more weight than they have together, pulls by at most
    tau * w / (W - w): each iteration it adds at most tau * w / W and the honest pull back all but w / W."""
    weight = share * honest
    centre = torch.tensor(point, dtype=torch.float64)
    outlier = centre + scale * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    inputs = torch.stack([centre] * honest + [outlier])
    weights = torch.tensor([1.0] * honest + [weight], dtype=torch.float64)
    result = centered_clip(inputs, weights, tau=tau, iterations=steps)
    bound = tau * weight / honest
    assert float((result.centre - centre).norm()) <= bound * (1 + 1e-9) + 1e-9
    if scale * 2.3 > tau + bound:  # farther than tau from any centre it can reach: it was clipped
        assert float(result.scales[-1]) < 1.0


def test_a_sign_flipped_input_is_outvoted():
    honest = torch.tensor([[1.0, 1.0], [1.1, 0.9], [0.9, 1.1]])
    inputs = torch.cat([honest, -1000 * honest[:1]])
    result = centered_clip(inputs, torch.ones(4), tau=0.5, iterations=50)
    assert float((result.centre - honest.mean(0)).norm()) < 0.5 / 3 + 0.2
    assert result.scales[-1] < 1e-3 and torch.all(result.scales[:3] == 1.0)


def test_bad_arguments_are_refused_in_words():
    with pytest.raises(ValueError, match="one weight per input"):
        centered_clip(torch.zeros(2, 3), torch.ones(3), 1.0, 1)
    with pytest.raises(ValueError, match="tau must be > 0"):
        centered_clip(torch.zeros(2, 3), torch.ones(2), 0.0, 1)


# --- the reducer: every sender's copy of a part, then the rule ---------------------------------------------------


def reduce(parts, weights, rule, weight_cap=math.inf):
    async def run():
        reducer = RobustPartReducer([parts[0].shape], len(parts), rule=rule, weight_cap=weight_cap,
                                    total_elements=parts[0].numel())
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, part, weight=w)
                                         for i, (part, w) in enumerate(zip(parts, weights))))
        return results[0], notable_attestations(reducer, [f"peer{i}" for i in range(len(parts))])
    return asyncio.run(run())


def test_the_reducer_drops_non_finite_parts_caps_weights_and_clips_and_says_whom():
    honest = [torch.full((4,), v) for v in (1.0, 1.2, 0.8)]
    nan = torch.tensor([1.0, float("nan"), float("inf"), 1.0])
    rule = RobustRule(tau=100.0, iterations=10)
    result, notes = reduce(honest + [nan], [1.0, 1.0, 1.0, 1.0], rule)
    torch.testing.assert_close(result, torch.full((4,), 1.0))  # the mean of the honest three
    assert list(notes) == ["peer3"] and notes["peer3"]["dropped"] == 1

    # weight x100 against a cap of 2 samples: it counts twice, not a hundred times (tau large: a plain mean)
    result, notes = reduce(honest + [torch.full((4,), 5.0)], [1.0, 1.0, 1.0, 100.0], rule, weight_cap=2.0)
    torch.testing.assert_close(result, torch.full((4,), (3.0 + 2 * 5.0) / 5))
    assert notes == {"peer3": {"parts": 1, "weight": 100.0, "used": 2.0, "dropped": 0, "clipped": 0, "kept": 1.0,
                               "expected": 1, "nonfinite": 0, "zeros": 0}}

    # x1000 with a small radius: clipped, and named with how much of its offset was kept
    result, notes = reduce(honest + [1000 * honest[0]], [1.0] * 4, RobustRule(tau=2.0, iterations=30))
    assert float((result - 1.0).norm()) <= 2.0 / 3 + 1e-6  # tau * w / (W - w)
    assert list(notes) == ["peer3"] and notes["peer3"]["clipped"] == 1 and notes["peer3"]["kept"] < 0.01


def test_a_part_nobody_trustworthy_sent_averages_to_zeros():
    result, notes = reduce([torch.full((2,), float("nan"))] * 2, [1.0, 1.0], RobustRule(tau=1.0, iterations=3))
    assert torch.equal(result, torch.zeros(2)) and set(notes) == {"peer0", "peer1"}


def test_a_part_that_cannot_be_aggregated_fails_every_sender_instead_of_hanging():
    async def run():
        reducer = RobustPartReducer([torch.Size([4])], 2, rule=RobustRule(1.0, 3), weight_cap=math.inf,
                                    total_elements=4)
        sends = [reducer.accumulate_part(0, 0, torch.ones(4)), reducer.accumulate_part(1, 0, torch.ones(3))]
        return await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), timeout=5)

    assert all(isinstance(outcome, RuntimeError) for outcome in asyncio.run(run()))


def test_the_cap_is_the_ceiling_times_the_observed_time_plus_grace():
    assert RobustRule(1.0, 1, ceiling=100.0, grace=0.5).weight_cap(2.0) == pytest.approx(250.0)
    assert RobustRule(1.0, 1).weight_cap(2.0) == math.inf


# sha256 of inspect.getsource(TensorPartReducer.accumulate_part) in hivemind 1.1.12, which RobustPartReducer copies
# (keeping each part instead of summing it). If this changes, port hivemind's change to
# dedloc_worker/averaging/robust.py.
ACCUMULATE_PART_SHA256 = "1d64a8bd77052ac43ed43003ec04ade86d07114ac5b50ec0a023470896d21793"


def test_the_hivemind_reducer_code_copied_is_that_of_1_1_12():
    import hashlib
    import inspect

    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import TensorPartReducer

    source = inspect.getsource(TensorPartReducer.accumulate_part)
    assert hashlib.sha256(source.encode()).hexdigest() == ACCUMULATE_PART_SHA256
    # the runner builds its reducer in __init__, where PlannedAverager replaces it before the round starts
    assert "self.tensor_part_reducer = TensorPartReducer(" in inspect.getsource(AllReduceRunner.__init__)


def test_the_worker_takes_its_rule_from_the_run_config():
    from dedloc_common.contract import OptimizerOptions, RunConfig
    from dedloc_worker.training.options import robust_rule

    def config(**options):
        return RunConfig(slug="r", run_id="r", task="tiny-lm", target_batch_size=64, batch_size=16,
                         samples_per_second_ceiling=500.0, optimizer=OptimizerOptions(**options))

    assert robust_rule(config(clip_radius=2.0, clip_iterations=5, matchmaking_time=1.5)) == RobustRule(
        tau=2.0, iterations=5, ceiling=500.0, grace=1.5, overlapped=True)  # delayed gradient averaging, the default
    assert robust_rule(config(aggregation="mean")) is None
    # the cap's clock starts where the senders began accumulating: after the previous round, or as it began
    assert not robust_rule(config(delay_grad_averaging=False)).overlapped
    assert robust_rule(config(algorithm="local-updates")).overlapped  # overlapped outer rounds, the default
    assert not robust_rule(config(algorithm="local-updates", overlap_outer_rounds=False)).overlapped


def test_the_caps_clock_starts_where_senders_began_accumulating():
    assert RobustRule(1.0, 1).clock_start(previous_began=10.0, previous_ended=14.0) == 14.0
    assert RobustRule(1.0, 1, overlapped=True).clock_start(previous_began=10.0, previous_ended=14.0) == 10.0
