"""The worker's receipt log and how an epoch's claim takes its round from it (``credit.receipts.ReceiptLog``,
``training.optimizer.AccountedOptimizer._take_receipts``, ``training.loop.take_settled``), down to the coordinator's
decision: a round this peer only tagged along in, with weight 0, carried none of its samples."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from dedloc_common.contract import EpochContribution
from dedloc_worker.credit.receipts import ReceiptLog
from dedloc_worker.training.loop import take_settled
from dedloc_worker.training.optimizer import AccountedOptimizer

from app.credit.settlement import credit_epochs
from app.models import Dispute
from tests.support.credit import Peer, aged_run, claim, totals

WEIGHTED, TAGGED_ALONG = "aa" * 16, "bb" * 16


def settled_claim(log: ReceiptLog, samples: int = 16) -> EpochContribution:
    """The claim of an epoch of ``samples`` samples, as the trainer settles it once its round's receipts are in."""
    optimizer = SimpleNamespace(receipts=log, rounds_over=[], _round_running=True, _sent_bytes=lambda group: None)
    AccountedOptimizer._take_receipts(optimizer)  # the real method, on the fields it reads
    unsettled = deque([EpochContribution(epoch=92, samples=samples, loss_sum=1.0, mini_steps=1, seconds=1.0)])
    [settled] = take_settled(unsettled, optimizer.rounds_over)
    return settled


def test_a_round_joined_with_weight_is_the_claims_even_when_a_weightless_one_follows(tmp_path):
    log = ReceiptLog(tmp_path)
    log.note_round(bytes.fromhex(WEIGHTED), ["QmA", "QmB"], weight=16.0)
    log.note_round(bytes.fromhex(TAGGED_ALONG), ["QmA", "QmC"], weight=0.0)  # it then caught up with the swarm
    settled = settled_claim(log)
    assert (settled.group, settled.samples) == (WEIGHTED, 16)


def test_a_claim_whose_only_round_was_weightless_says_it_carried_no_samples(tmp_path):
    log = ReceiptLog(tmp_path)
    log.note_round(bytes.fromhex(TAGGED_ALONG), ["QmA", "QmC"], weight=0.0)
    settled = settled_claim(log)
    assert (settled.group, settled.samples) == (TAGGED_ALONG, 0)
    # the control: a log from before weights were noted reads as before
    older = ReceiptLog(tmp_path / "older")
    older.path.parent.mkdir()
    older.note_round(bytes.fromhex(TAGGED_ALONG), ["QmA", "QmC"])
    assert settled_claim(older).samples == 16


def test_the_coordinator_holds_nothing_and_disputes_nothing_for_a_weightless_round(sessions, tmp_path):
    """The seed-9 soak's case: the founder claimed 16 samples in a round it had tagged along in, its aggregator
    saw 0, and with one other volunteer it was "disputed". Its claim now says 0: nothing held, no dispute. The
    control: the 16-sample claim the old worker published is still disputed."""
    for name, samples in (("now", 0), ("before", 16)):
        with sessions() as session:
            run = aged_run(session, f"weightless-{name}")
            founder, other = Peer(session, run, "founder", tmp_path, 0), Peer(session, run, "other", tmp_path, 1)
            members = sorted([founder.peer_id, other.peer_id])
            credit_epochs(session, run, [
                founder.record(claim(92, samples, "g92", {"g92": {other.peer_id: 448.0}}, members)),
                other.record(claim(94, 448, "g92", {"g92": {founder.peer_id: 0.0}}, members)),
            ])
            disputes = session.query(Dispute).filter_by(run_id=run.id).count()
            assert totals(session, run) == {"founder": (0, samples), "other": (448, 0)}
            assert disputes == (1 if samples else 0), (name, disputes)
