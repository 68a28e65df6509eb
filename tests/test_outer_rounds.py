"""Outer rounds of local-updates training (``dedloc_worker.training.outer``): DiLoCo's Nesterov step on the
sample-weighted mean of the peers' pseudo-gradients, the same outer parameters on every peer after a round, and a
loader that gets the outer state, not a peer's drifting local one. Two real hivemind averagers on loopback."""

from __future__ import annotations

import gc
import math
import threading

import hivemind
import pytest
import torch
from dedloc_worker.training.outer import OuterOptimizer, PseudoGradientAverager, lineage_after, prevailing

pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
LR, MOMENTUM = 0.7, 0.9


def nesterov(outer, deltas, momentum=None):
    """DiLoCo's outer step written out: m = mu * m + g; outer -= lr * (g + mu * m)."""
    momentum = torch.zeros_like(outer) if momentum is None else momentum
    new_momentum = MOMENTUM * momentum + deltas
    return outer - LR * (deltas + MOMENTUM * new_momentum), new_momentum


def test_the_outer_step_is_nesterov_on_the_pseudo_gradient_and_restarts_the_local_parameters():
    local = [torch.tensor([1.0, 2.0, 3.0])]
    outer = OuterOptimizer(local, lr=LR, momentum=MOMENTUM)
    expected, momentum = torch.tensor([1.0, 2.0, 3.0]), None
    for moved in (torch.tensor([0.5, -1.0, 0.25]), torch.tensor([0.1, 0.2, -0.3])):
        local[0].sub_(moved)  # inner steps moved the peer
        assert torch.allclose(outer.pseudo_gradients(local)[0], moved)
        outer.step(outer.pseudo_gradients(local), local)
        expected, momentum = nesterov(expected, moved, momentum)
        assert torch.allclose(outer.params[0], expected) and torch.equal(local[0], outer.params[0])
    assert torch.allclose(outer.momentum_buffers()[0], momentum)


def test_lr_1_without_momentum_is_plain_parameter_averaging():
    local = [torch.tensor([4.0])]
    outer = OuterOptimizer(local, lr=1.0, momentum=0.0)
    outer.step([torch.tensor([1.5])], local)  # the swarm's mean moved 1.5 down
    assert local[0].item() == 2.5


def test_an_overlapped_round_keeps_the_inner_steps_taken_while_it_ran():
    """The round began from outer - sent; the peer trained on meanwhile (drift). Applied late, the outer step is the
    same, and the local parameters are the new outer ones plus that drift, not the new outer ones alone."""
    local = [torch.tensor([1.0, 2.0])]
    outer = OuterOptimizer(local, lr=LR, momentum=MOMENTUM)
    local[0].sub_(torch.tensor([0.5, -0.5]))  # the phase's inner steps
    sent = outer.pseudo_gradients(local)
    drift = torch.tensor([0.25, 0.125])
    local[0].add_(drift)  # inner steps while the round runs
    averaged = [torch.tensor([0.3, -0.1])]  # the swarm's mean
    outer.step(averaged, local, sent=sent)
    expected, _ = nesterov(torch.tensor([1.0, 2.0]), averaged[0])
    assert torch.allclose(outer.params[0], expected)
    assert torch.allclose(local[0], expected + drift)


@pytest.mark.parametrize("lr, momentum", [(0.0, 0.9), (-0.1, 0.9), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_options_are_refused(lr, momentum):
    with pytest.raises(ValueError):
        OuterOptimizer([torch.zeros(1)], lr=lr, momentum=momentum)


@pytest.fixture(scope="module")
def dhts():
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    others = [hivemind.DHT(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                           host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True) for _ in range(2)]
    yield first, *others
    for dht in [first, *others]:
        dht.shutdown()
    gc.collect()


def averager(dht, start: float, sharing: bool = True, overlap: bool = False) -> PseudoGradientAverager:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(start)
    return PseudoGradientAverager(dht=dht, prefix="outer_test", params=model.parameters(),
                                  optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), outer_lr=LR,
                                  outer_momentum=MOMENTUM, allow_state_sharing=sharing, start=True, overlap=overlap,
                                  target_group_size=2, min_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5)


def run_round(peers) -> None:
    """One outer round of ``peers`` at once, each stepping in a thread of its own, as separate processes would."""
    threads = [threading.Thread(target=peer.step, kwargs=dict(increment_epoch=True, averaging_round=True,
                                                              averaging_opts=dict(timeout=20)))
               for peer in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def test_an_outer_round_gives_both_peers_the_same_outer_step_on_the_sample_weighted_mean(dhts):
    peers = [averager(dhts[0], 1.0), averager(dhts[1], 1.0)]
    try:
        moves, samples = (0.3, -0.6), (300, 100)  # a fast peer and a slow one
        for peer, move, count in zip(peers, moves, samples):
            with torch.no_grad():
                for param in peer.main_parameters:
                    param.sub_(move)
            peer.samples = count
        run_round(peers)
        weighted = (0.3 * 300 - 0.6 * 100) / 400  # 0.075, where the unweighted mean is -0.15
        expected, _ = nesterov(torch.tensor(1.0), torch.tensor(weighted))
        for peer in peers:
            assert peer.rounds == 1 and peer.samples == 0
            for param in peer.main_parameters:
                assert torch.allclose(param, torch.full_like(param, expected.item()), atol=1e-6), param

        # A joiner loads the outer state (parameters and momentum), not a local one that drifted since
        with torch.no_grad():
            for param in peers[0].main_parameters:
                param.add_(5.0)
        joiner = averager(dhts[2], 0.0, sharing=False)
        try:
            assert joiner.load_state_from_peers(timeout=20)
            for mine, theirs in zip(joiner.main_parameters, peers[1].outer.params):
                assert torch.allclose(mine, theirs)
            for mine, theirs in zip(joiner.outer.momentum_buffers(), peers[1].outer.momentum_buffers()):
                assert torch.allclose(mine, theirs) and theirs.abs().sum() > 0
        finally:
            joiner.shutdown()
    finally:
        for peer in peers:
            peer.shutdown()


def test_an_overlapped_round_runs_while_the_peers_take_inner_steps(dhts):
    """With ``overlap``, the round's step returns while the round runs, an inner optimizer step is not queued behind
    it, and the result, applied afterwards, is the same outer step on both peers, each keeping its later steps."""
    peers = [averager(dhts[0], 1.0, overlap=True), averager(dhts[1], 1.0, overlap=True)]
    try:
        for peer, move in zip(peers, (0.3, -0.6)):
            with torch.no_grad():
                for param in peer.main_parameters:
                    param.sub_(move)
            peer.samples = 100
        for peer in peers:  # the second peer begins its round after the first one's inner step: that one cannot end
            peer.step(increment_epoch=True, averaging_round=True, delay_averaging=True,
                      averaging_opts=dict(timeout=20))
            assert not all(update.done() for update in peer.pending_updates), "the round's step waited for it"
            # an inner step meanwhile: the gradient of sum(p), so SGD at lr 0.1 moves every value by -0.1
            for param in peer.main_parameters:
                param.grad = torch.ones_like(param)
            peer.step(optimizer_step=True, zero_grad=True)
        assert not all(update.done() for update in peers[0].pending_updates), "the inner step waited for the round"
        for peer in peers:
            peer.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        expected, _ = nesterov(torch.tensor(1.0), torch.tensor((0.3 - 0.6) / 2))
        for peer in peers:
            assert peer.rounds == 1 and peer.outer_epoch == 1
            for outer, local in zip(peer.outer.params, peer.main_parameters):
                assert torch.allclose(outer, torch.full_like(outer, expected.item()), atol=1e-6)
                assert torch.allclose(local, outer - 0.1, atol=1e-6), "the inner step taken meanwhile was lost"
    finally:
        for peer in peers:
            peer.shutdown()


def test_a_round_that_fails_leaves_the_outer_parameters_and_says_so(dhts):
    """hivemind applies a state round's buffers after a failed round too: they hold this peer's own pseudo-gradient,
    which would move it alone. The outer parameters stay, the local ones too, and ``missed`` tells the optimizer to
    take the swarm's next outer state (``training.local_updates``)."""
    alone = averager(dhts[0], 1.0)
    try:
        with torch.no_grad():
            for param in alone.main_parameters:
                param.sub_(0.5)
        alone.samples = 64
        alone.step(increment_epoch=True, averaging_round=True, averaging_opts=dict(timeout=3))  # nobody to meet
        assert (alone.rounds, alone.missed, alone.missed_rounds) == (0, True, 1)
        assert all(torch.equal(p, torch.ones_like(p)) for p in alone.outer.params)
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in alone.main_parameters)
    finally:
        alone.shutdown()


def test_a_checkpoint_resumes_the_outer_parameters_and_momentum(dhts):
    from types import SimpleNamespace

    from dedloc_worker.errors import ConfigError
    from dedloc_worker.training.options import restore

    resumed = averager(dhts[1], 0.0, sharing=False)
    try:
        params = [torch.full_like(p, 2.0) for p in resumed.main_parameters]
        momentum = [torch.full_like(p, 0.25) for p in resumed.main_parameters]
        state = {"epoch": 12, "parameters": params, "outer": {"momentum": momentum, "rounds": 4}}
        restore(SimpleNamespace(state_averager=resumed), state)
        assert (resumed.local_epoch, resumed.outer_epoch, resumed.rounds) == (12, 12, 4)
        assert all(torch.equal(a, b) for a, b in zip(resumed.outer.momentum_buffers(), momentum))
        assert all(torch.equal(a, b) for a, b in zip(resumed.main_parameters, params))
        with pytest.raises(ConfigError, match="no outer optimizer state"):
            restore(SimpleNamespace(state_averager=resumed), {"epoch": 1, "parameters": params})
    finally:
        resumed.shutdown()


def test_a_peer_whose_outer_parameters_are_of_an_older_epoch_does_not_step_from_them(dhts):
    """Each member gathers the epoch of the outer parameters it steps from. A peer one outer step behind (as a joiner
    was that took a state served mid-round, or that hivemind's catch-up moved past the state it loaded) would add
    the same average to older parameters and stay behind for good: it does not step, and says it is stale. A state
    served mid-round carries its outer parameters' epoch, not the local epoch hivemind already moved on."""
    ahead, behind = averager(dhts[0], 1.0), averager(dhts[1], 1.0, sharing=False)
    try:
        ahead.outer_epoch = ahead.local_epoch = 5  # its outer parameters are the result of epoch 5's round
        behind.outer_epoch, behind.local_epoch = 4, 5
        for peer in (ahead, behind):
            with torch.no_grad():
                for param in peer.main_parameters:
                    param.sub_(0.5)
            peer.samples = 100
        run_round([ahead, behind])
        assert (ahead.rounds, ahead.outer_epoch, ahead.missed) == (1, 6, False)
        assert (behind.rounds, behind.outer_epoch, behind.missed, behind.stale) == (0, 4, True, True)
        assert all(torch.equal(p, torch.ones_like(p)) for p in behind.outer.params)

        ahead.local_epoch = 7  # hivemind raised it for the next round, whose result is not in yet
        metadata, _, _ = ahead.get_current_state()
        assert metadata["epoch"] == 6
        assert behind.load_state_from_peers(timeout=20)
        assert (behind.outer_epoch, behind.stale, behind.missed) == (6, False, False)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(behind.outer.params, ahead.outer.params))
    finally:
        for peer in (ahead, behind):
            peer.shutdown()


def test_two_peers_whose_outer_parameters_of_one_epoch_came_from_different_rounds_end_on_one_lineage(dhts):
    """A joiner whose tracker saw no other peer yet stepped alone while the others averaged: both sides then hold
    outer parameters of one epoch, made by different rounds (in a run of the swarm test, a gap of 0.08 for good).
    Members gather their lineage with their epoch: the peers off the prevailing one (most members; ties, the least)
    do not step, and take the newest state from a peer on it."""
    on, off = averager(dhts[0], 1.0), averager(dhts[1], 2.0, sharing=False)
    try:
        on.outer_epoch = on.local_epoch = off.outer_epoch = off.local_epoch = 5
        on.lineage, off.lineage = "0a", "0b"  # a tie of one member each: the least string prevails
        assert prevailing([(5, "0b"), (5, "0a"), (4, "00")], 5) == "0a"
        assert prevailing([(5, "0b"), (5, "0a"), (5, "0b")], 5) == "0b"
        for peer in (on, off):
            with torch.no_grad():
                for param in peer.main_parameters:
                    param.sub_(0.5)
            peer.samples = 100
        run_round([on, off])
        assert (on.rounds, on.outer_epoch, on.missed, on.forked) == (1, 6, False, 0)
        assert on.lineage == lineage_after("0a", 5, [on.peer_id, off.peer_id]) != lineage_after("0a", 5, [on.peer_id])
        assert (off.rounds, off.outer_epoch, off.missed, off.stale, off.forked) == (0, 5, True, True, 1)
        assert off.load_state_from_peers(timeout=20)
        assert (off.outer_epoch, off.lineage, off.missed) == (6, on.lineage, False)
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(off.outer.params, on.outer.params))
    finally:
        for peer in (on, off):
            peer.shutdown()


def test_a_peer_alone_takes_the_outer_step_on_its_own_pseudo_gradient():
    """hivemind makes no round while it sees no other peer; DiLoCo with one worker steps on its own pseudo-gradient,
    so the founder's outer parameters (and the epoch a joiner loads) move on while it trains alone."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    alone = averager(dht, 1.0, sharing=False)
    try:
        with torch.no_grad():
            for param in alone.main_parameters:
                param.sub_(0.5)
        alone.samples = 64
        alone.local_epoch += 1  # as hivemind's step does before its round
        alone.step_alone()
        expected, _ = nesterov(torch.tensor(1.0), torch.tensor(0.5))
        assert (alone.rounds, alone.outer_epoch, alone.samples, alone.last_weight) == (1, 1, 0, 64)
        assert alone.lineage == lineage_after("", 0, [alone.peer_id])
        for outer, local in zip(alone.outer.params, alone.main_parameters):
            assert torch.allclose(outer, torch.full_like(outer, expected.item())) and torch.equal(outer, local)
    finally:
        alone.shutdown()
        dht.shutdown()
        gc.collect()  # its sockets are closed here, where this module's filter applies, not in another module's test


# Poisoned outer rounds: three peers, one of them sending a poisoned pseudo-gradient. The honest pseudo-gradient is
# about 6.5 in norm (1,056 values near 0.2), well above the run's default tau of 1.0, the robust rule's reach.
HONEST, SPREAD = 0.2, 0.01
ATTACKS = {"x1000": lambda delta: delta * 1000, "flip": lambda delta: -delta, "nan": lambda delta: delta * math.nan}
HARM = 0.25  # the outer step may part from the honest peers' mean by this share of its norm with CenteredClip


@pytest.fixture(scope="module")
def poisoned_steps(dhts):
    """{(aggregation, attack): (the honest peers' outer steps, the honest mean)} from one round per attack, each from
    zero outer parameters (outer lr 1 without momentum: the outer step is the averaged pseudo-gradient)."""
    from dedloc_common.contract import OptimizerOptions
    from dedloc_worker.averaging.robust import RobustRule
    from dedloc_worker.training.outer import OuterAverager

    defaults = OptimizerOptions()
    rules = {"centered_clip": RobustRule(tau=defaults.clip_radius, iterations=defaults.clip_iterations),
             "mean": None}
    generator, steps = torch.Generator().manual_seed(5), {}
    for aggregation, rule in rules.items():
        peers = [OuterAverager(dht=dht, prefix=f"poisoned_{aggregation}", params=torch.nn.Linear(32, 32).parameters(),
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), outer_lr=1.0, outer_momentum=0.0,
                               robust=rule, allow_state_sharing=False, start=True, target_group_size=3,
                               min_group_size=3, min_matchmaking_time=1.0, request_timeout=0.5) for dht in dhts]
        try:
            for attack, poison in ATTACKS.items():
                deltas = [HONEST + SPREAD * torch.randn(1056, generator=generator) for _ in range(3)]
                deltas[2] = poison(deltas[2])
                for peer, delta in zip(peers, deltas):
                    zeros = [torch.zeros_like(p) for p in peer.main_parameters]
                    peer.outer.load(zeros, zeros)
                    peer.outer_epoch = peer.local_epoch = 0
                    with torch.no_grad():  # local = outer - delta: the pseudo-gradient is delta
                        torch.nn.utils.vector_to_parameters(-delta, peer.main_parameters)
                    peer.samples = 100
                run_round(peers)
                steps[aggregation, attack] = ([-torch.nn.utils.parameters_to_vector(peer.outer.params)
                                               for peer in peers[:2]], (deltas[0] + deltas[1]) / 2)
        finally:
            for peer in peers:
                peer.shutdown()
            gc.collect()
    return steps


def parting(step: torch.Tensor, honest: torch.Tensor) -> float:
    """How far an outer step parts from the honest mean, over that mean's norm (inf where it is not finite)."""
    return float((step - honest).norm() / honest.norm()) if torch.isfinite(step).all() else math.inf


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_poisoned_pseudo_gradient_is_clipped_and_the_plain_mean_shows_the_harm(poisoned_steps, attack):
    clipped, honest = poisoned_steps["centered_clip", attack]
    assert all(parting(step, honest) <= HARM for step in clipped), [parting(s, honest) for s in clipped]
    assert all(torch.any(step != 0) for step in clipped), "no outer step was taken"
    unclipped, honest = poisoned_steps["mean", attack]
    assert all(parting(step, honest) > HARM for step in unclipped), [parting(s, honest) for s in unclipped]
