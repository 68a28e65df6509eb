"""hivemind 1.1.12's pitfalls (docs/hivemind.md#pitfalls), each handled in our code and checked here."""

from __future__ import annotations

import functools
import gc
import time

import pytest
import torch
from dedloc_common.contract import EpochContribution, MetricsRecord, OptimizerOptions, RunConfig
from dedloc_worker.swarm.node import RelayWatch, create_dht, relay_addresses, relay_options
from dedloc_worker.swarm.records import add_record_validators, publish_metrics, read_metrics
from dedloc_worker.training.options import create_optimizer

from app.core.processes import group_members
from tests.support.actors import FAULTY_TASK
from tests.support.harness import ROOT

pytestmark = [
    pytest.mark.swarm,
    # hivemind run in-process leaves its background event loops unclosed when garbage-collected.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@pytest.fixture
def two_dhts():
    first = create_dht([], LOOPBACK, client_mode=False)
    second = None
    try:
        second = create_dht([str(a) for a in first.get_visible_maddrs()], LOOPBACK, client_mode=True)
        yield first, second
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()
        gc.collect()  # so hivemind's leftovers are reported here, under this module's warning filter


def tiny_config(**optimizer) -> RunConfig:
    options = OptimizerOptions(**{"matchmaking_time": 0.5, "averaging_timeout": 2.0, **optimizer})
    return RunConfig(slug="pit", run_id="pit", task="tiny-lm", target_batch_size=64, batch_size=16, optimizer=options)


def test_a_client_mode_peer_passes_its_first_epoch(two_dhts):
    """Pitfall 1: with a client-mode DHT, an Optimizer without explicit client_mode crashes at epoch 1."""
    _, client = two_dhts
    model = torch.nn.Linear(4, 1)
    opt = create_optimizer(client, tiny_config(), model.parameters(), client_mode=True)
    try:
        deadline = time.monotonic() + 60
        while opt.local_epoch < 1 and time.monotonic() < deadline:
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.local_epoch >= 1
        assert opt.grad_averager.client_mode and opt.state_averager.client_mode
    finally:
        opt.shutdown()


def test_averager_options_reach_both_averagers(two_dhts):
    """Pitfall 2: averager_opts reach only the state averager; ours go through grad_averager_factory too."""
    server, _ = two_dhts
    config = tiny_config(matchmaking_time=0.8)
    opt = create_optimizer(server, config, torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        # The matchmaking runs in the averager's own process; the options it was built with stay here.
        assert opt.grad_averager.matchmaking_kwargs["request_timeout"] == pytest.approx(0.4)
        assert opt.state_averager.matchmaking_kwargs["request_timeout"] == pytest.approx(0.4)
    finally:
        opt.shutdown()


def test_only_the_state_averager_declares_itself_a_source_of_state(two_dhts):
    """Peers load state from the state averager alone; the gradient averager's record would be DHT stores for
    nothing (docs/hivemind.md#pitfalls, 15)."""
    server, client = two_dhts
    opt = create_optimizer(server, tiny_config(), torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        sources = lambda name: (client.get(f"pit_{name}.all_averagers", latest=True) or (None,))[0]  # noqa: E731
        deadline = time.monotonic() + 30
        while not sources("state_averager") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sources("state_averager"), "the state averager never declared itself: the control failed"
        assert not opt.grad_averager.allow_state_sharing
        assert sources("grad_averager") is None
    finally:
        opt.shutdown()


def test_an_auxiliary_peer_of_a_run_with_delayed_updates_delays_nothing(two_dhts):
    """Pitfall 16: an auxiliary peer averaging in the background asserts at its first round with others (it takes
    no step; seen in tests/test_outage.py's swarm with the run's delayed updates on). Ours delays nothing there, and a
    trainer of the same run does (the control)."""
    server, client = two_dhts
    config = tiny_config(delay_optimizer_step=True)
    trainer = create_optimizer(client, config, torch.nn.Linear(4, 1).parameters(), client_mode=True)
    aux = create_optimizer(server, config, torch.nn.Linear(4, 1).parameters(), client_mode=False, aux=True)
    try:
        assert trainer.delay_optimizer_step and trainer.delay_grad_averaging
        assert not aux.delay_optimizer_step and not aux.delay_grad_averaging
    finally:
        aux.shutdown()
        trainer.shutdown()


def test_a_leaving_peer_cancels_its_open_state_round_instead_of_waiting_it_out(two_dhts):
    """Pitfall 18: hivemind's shutdown waits for a state-averaging round running in the background (delayed state
    averaging, its default) up to the averaging timeout when no partner is there to finish it; a leaving
    ``AccountedOptimizer`` cancels it once ``LEAVE_GRACE`` has passed since it was asked to leave."""
    server, _ = two_dhts
    # A matchmaking time long enough that the round looks for partners until its deadline (matchmaking.LOOK_WINDOWS)
    opt = create_optimizer(server, tiny_config(averaging_timeout=20.0, matchmaking_time=8.0),
                           torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        # What the optimizer does at an epoch that averages state (hivemind starts it only with partners around)
        opt.state_averager.step(averaging_round=True, delay_averaging=True,
                                averaging_opts=dict(timeout=opt.averaging_timeout))
        deadline = time.monotonic() + 10
        while not any(control.triggered for control in opt.state_averager.open_rounds()):
            assert time.monotonic() < deadline, "no state round ran: the check below would prove nothing"
            time.sleep(0.05)
        running = opt.state_averager.open_rounds()
    finally:
        opt.shutdown()
    # Waited out, the round would have ended with the timeout's error instead.
    assert running and all(control.cancelled() for control in running), running


def test_a_leaving_peer_does_not_cancel_a_round_twice(two_dhts):
    """A round this peer cancelled (``_wait_or_leave``, the leave timer) can still read as looking for its group when
    hivemind's shutdown cancels what is looking: cancelled twice, it raised out of the worker's exit."""
    from concurrent.futures import InvalidStateError

    from hivemind.averaging.control import AveragingStage

    server, _ = two_dhts
    opt = create_optimizer(server, tiny_config(), torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        control = opt.scheduled_grads = opt.grad_averager.schedule_step(timeout=opt.averaging_timeout)
        control.cancel()
        deadline = time.monotonic() + 10
        while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
            time.sleep(0.02)
        control.stage = AveragingStage.LOOKING_FOR_GROUP  # as read before the averager's process marked it
        with pytest.raises(InvalidStateError):
            control.cancel()  # what hivemind's shutdown does with it
    finally:
        opt.shutdown()  # raises the same if it cancels it again
    assert control.cancelled()


def test_a_leaving_peer_takes_its_next_round_out_of_matchmaking_at_once(two_dhts):
    """Ctrl-C: the gradient round scheduled ahead, still looking for its group, is cancelled as the grace begins, so
    that no group forms with a peer that is going (one that did formed during the grace, and the shutdown then waited
    for its round as well: Ctrl-C took 2.9 s against 2.2 s)."""
    from hivemind.averaging.control import AveragingStage

    server, _ = two_dhts
    # matchmaking long enough that the round still looks for partners when the peer leaves
    opt = create_optimizer(server, tiny_config(matchmaking_time=8.0, averaging_timeout=20.0),
                           torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        looking = opt.scheduled_grads = opt.grad_averager.schedule_step(timeout=opt.averaging_timeout)
        deadline = time.monotonic() + 10
        while looking.stage != AveragingStage.LOOKING_FOR_GROUP:
            assert time.monotonic() < deadline, looking.stage
            time.sleep(0.02)
        time.sleep(0.5)
        assert not looking.done(), "the round ended by itself: the check below would prove nothing"
        asked = time.monotonic()
        began = opt.begin_leaving()
        assert looking.cancelled() and opt.leave.is_set()
        assert asked <= began <= time.monotonic()
    finally:
        opt.shutdown()


def test_an_averager_leaving_with_a_round_under_way_ends_it_without_raising(two_dhts):
    """hivemind keeps a running round as a future of its all-reduce runner, and its averager's shutdown called
    ``finalize`` on that future: an averager that left with a round under way raised ``AttributeError`` out of its
    process (docs/hivemind.md#pitfalls, 24)."""
    import asyncio

    from dedloc_worker.swarm.leaving import EndsRunningRounds
    from hivemind.averaging import DecentralizedAverager

    class Averager(EndsRunningRounds, DecentralizedAverager):
        pass

    _, client = two_dhts
    outcomes = []
    for averager_class in (DecentralizedAverager, Averager):  # the control first: hivemind's own shutdown
        averager = averager_class([torch.zeros(4)], client, prefix="leaving", client_mode=True, start=False)

        async def leave() -> str:
            running = asyncio.get_running_loop().create_future()  # a round registered, its runner not built yet
            averager._running_groups[b"group"] = running
            try:
                await averager._shutdown(timeout=1.0)
            except AttributeError as error:
                return f"raised {error}"
            return "cancelled" if running.cancelled() else "left running"

        outcomes.append(asyncio.run(leave()))
    assert outcomes[0].startswith("raised"), outcomes
    assert outcomes[1] == "cancelled"


def scheduled_ahead(opt, every: int) -> tuple[bool, bool]:
    """Whether the worker's optimizer, then hivemind's, schedules a state round ahead where the next step, due now,
    averages state and state is averaged every ``every`` steps."""
    import hivemind
    from hivemind.utils import get_dht_time

    opt.average_state_every = every
    opt.tracker.global_progress.epoch = every  # the swarm's next step is the state-averaging one
    opt.delay_before_state_averaging.update(task_size=1, interval=0.0)  # hivemind schedules only with an estimate
    found = []
    for schedule in (opt._maybe_schedule_state_averaging,
                     functools.partial(hivemind.Optimizer._maybe_schedule_state_averaging, opt)):
        opt.tracker.global_progress.eta_next_epoch = get_dht_time()  # and the step is due now
        schedule()
        found.append(opt.scheduled_state is not None)
        if opt.scheduled_state is not None:
            opt.scheduled_state.cancel()
            opt.scheduled_state = None
    return found[0], found[1]


def test_a_periodic_state_round_is_not_scheduled_ahead_of_its_step(two_dhts):
    """Pitfall 20: with periodic state rounds scheduled ahead of their step, in some runs the gradient round of every
    state-averaging step started ~2 s apart at two peers, lost at both. Where hivemind's Optimizer schedules one (a
    state-averaging step due within the matchmaking time), the worker's does not; where state is averaged at every
    step (a swarm larger than one group), it does, as hivemind."""
    server, _ = two_dhts
    opt = create_optimizer(server, tiny_config(), torch.nn.Linear(4, 1).parameters(), client_mode=False)
    try:
        periodic = scheduled_ahead(opt, every=10)
        every_step = scheduled_ahead(opt, every=1)
    finally:
        opt.shutdown()
    # hivemind schedules one in both: otherwise the checks prove nothing
    assert periodic == (False, True)
    assert every_step == (True, True)


def test_signed_records_are_readable_by_a_validating_reader_and_unforgeable(two_dhts):
    """Pitfall 5: a reader needs the same validators; a signed record cannot be overwritten by another key."""
    writer, reader = two_dhts
    signature = add_record_validators(writer, "pit")
    add_record_validators(reader, "pit")
    record = MetricsRecord(username="alice", epoch=3, samples_per_second=12.5, time=time.time(),
                           recent=[EpochContribution(epoch=2, samples=64, loss_sum=10.0, mini_steps=4, seconds=1.0)])
    assert publish_metrics(writer, "pit", signature, record)
    [seen] = read_metrics(reader, "pit")
    assert seen.record == record

    forged = record.copy(update={"recent": [EpochContribution(epoch=2, samples=6400, loss_sum=1.0, mini_steps=4,
                                                              seconds=1.0)]})
    assert not reader.store("pit_metrics", forged.dict(), time.time() + 60, subkey=signature.local_public_key)
    [still] = read_metrics(reader, "pit")
    assert still.record.recent[0].samples == 64


def test_relays_a_full_peer_offers_and_a_client_asks_for_do_not_change_a_loopback_swarm(two_dhts):
    """docs/hivemind.md#relays: a peer found unreachable starts with auto-relay, the bootstrap peers as trusted relays
    and private reachability forced; on loopback it still starts, writes and reads, and lists no relayed address
    (libp2p advertises only relays with a public address)."""
    server, _ = two_dhts
    bootstrap = [str(a) for a in server.get_visible_maddrs()]
    options = relay_options(True, bootstrap + ["/ip4/10.0.0.1/tcp/1", "not a multiaddr"], unreachable=True)
    assert options == {"use_relay": True, "use_auto_relay": True, "trusted_relays": bootstrap,
                       "force_reachability": "private"}
    assert relay_options(False, bootstrap) == {"use_relay": True}
    began = time.monotonic()
    client = create_dht(bootstrap, LOOPBACK, client_mode=True, unreachable=True)
    try:
        started = time.monotonic() - began
        assert client.store("relayed-key", "from the client", time.time() + 60)
        assert server.get("relayed-key").value == "from the client"
        assert relay_addresses(client) == []
    finally:
        client.shutdown()
    assert started < 30, f"a client asking for relays took {started:.1f} s to start"


def test_the_relay_watch_says_when_a_client_receives_through_a_relay_and_when_it_stops():
    relayed = "/ip4/1.0.1.1/tcp/31337/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWClient"
    seen = [[], [relayed], [relayed], [], []]
    lines = []
    watch = RelayWatch(lambda: seen.pop(0) if len(seen) > 1 else seen[0], lines.append, wait=60, interval=0.02)
    watch.start()
    deadline = time.monotonic() + 10
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.halt(timeout=5)
    assert lines[0].startswith(f"relay: receiving through {relayed}") and "only sends" in lines[0]
    assert lines[1].startswith("relay: the relay dropped this machine's slot") and len(lines) == 2

    # hivemind's DHT call can end in a GeneratorExit (a 30-minute soak's watch died of one): the watch looks again
    answers = [GeneratorExit(), [relayed]]

    def flaky() -> list:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    lines.clear()
    watch = RelayWatch(flaky, lines.append, wait=60, interval=0.02)
    watch.start()
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.is_alive() and lines and lines[0].startswith(f"relay: receiving through {relayed}"), lines
    watch.halt(timeout=5)

    lines.clear()
    watch = RelayWatch(lambda: [], lines.append, wait=0.1, interval=0.02)
    watch.start()
    time.sleep(0.5)
    watch.halt(timeout=5)
    assert len(lines) == 1 and lines[0].startswith("relay: no relay granted this machine a slot"), lines


def test_a_failing_task_ends_the_worker_cleanly(deployment, monkeypatch):
    """Pitfall 4 (and 3): an exception in the training loop must neither hang the worker nor leave its hivemind
    processes behind: it exits with a one-line reason and its process group is empty, without our help."""
    deployment.env["PYTHONPATH"] = str(ROOT)
    done = deployment.cli("create-run", deployment.slug, "--task", FAULTY_TASK,
                          "--target-batch-size", "4096", "--task-options", '{"explode_after": 5}')
    assert done.returncode == 0, done.stderr
    deployment.start_servers()
    worker = deployment.start_worker("alice")
    assert worker.wait(90) == 4
    log = (deployment.logs / "alice.log").read_text()
    assert f"dedloc-worker: task '{FAULTY_TASK}' failed: RuntimeError: corrupt batch" in log
    assert "Traceback" not in log.split("joining run")[-1]
    deadline = time.monotonic() + 5
    while group_members(worker.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(worker.pid) == []


def test_a_caller_the_keeper_does_not_know_makes_it_read_the_tokens_at_once(two_dhts, tmp_path, monkeypatch):
    import asyncio
    import threading

    from dedloc_common.signing import new_private_key, peer_id_of, public_openssh
    from dedloc_worker.admission import keeper as keeping
    from dedloc_worker.admission.gate import AdmissionState, TokenCheck, wait_admitted
    from dedloc_worker.swarm.records import publish_token
    from hivemind.utils.crypto import RSAPrivateKey

    from tests.support.factories import peer_token

    monkeypatch.setattr(keeping, "READ_EVERY", 10**6)  # after its first round, the keeper reads only when asked
    first, second = two_dhts
    authority, mine, newcomer = new_private_key(), RSAPrivateKey(), RSAPrivateKey()
    state = AdmissionState(tmp_path)
    state.write_token(peer_token(authority, "alice", mine, lifetime=3600))
    keeper = keeping.AdmissionKeeper(first, "run", state, TokenCheck(public_openssh(authority).decode()),
                                     add_record_validators(first, "run", mine), lambda: None, threading.Event())
    keeper.start()
    try:
        assert keeper.ready.wait(30)
        late = peer_id_of(newcomer.get_public_key().to_bytes())
        publish_token(second, "run", add_record_validators(second, "run", newcomer),
                      peer_token(authority, "bob", newcomer, lifetime=3600))
        time.sleep(3 * keeper.interval)
        assert not state.admits(late)  # published after the keeper's read: unknown until someone asks
        loop = asyncio.new_event_loop()  # not asyncio.run: it would drop the loop hivemind set for this thread
        try:  # a handler meets bob's call: the keeper reads the tokens, and bob is in
            assert loop.run_until_complete(wait_admitted(state, late))
        finally:
            loop.close()
    finally:
        keeper.halt()
