"""The coordinator process: bootstrap peer with a persistent identity, polling the DHT into the database."""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from dedloc_common.cleanup import end_descendants
from dedloc_common.contract import AckRecord
from dedloc_worker import patches
from dedloc_worker.admission.gate import AdmissionState, RunAuthorizer, TokenCheck, to_access_token
from dedloc_worker.admission.identity import persistent_key
from dedloc_worker.admission.keeper import AdmissionKeeper
from dedloc_worker.swarm.node import SwarmDHT, reach_peers
from dedloc_worker.swarm.records import (
    TOKEN_RECORD_TTL,
    add_record_validators,
    metrics_ttl,
    publish_acks,
    publish_denylist,
    publish_plan,
    read_metrics,
    read_progress,
)
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from app.authority import tokens
from app.coordinator.addresses import announced_maddrs, default_listen
from app.coordinator.planning import LinkSeen, PlanKeeper
from app.coordinator.summary import PeerSeen, summarize
from app.core.clock import utcnow
from app.core.config import Settings
from app.core.database import make_engine, make_sessionmaker, migrate
from app.credit.ledger import SignedMetrics, samples_total
from app.credit.settlement import acknowledgements, credit_epochs, owners
from app.credit.stats_export import export_if_due
from app.runs import registry
from app.runs.snapshots import record_snapshot

logger = logging.getLogger("dedloc.coordinator")
# Worker addresses remembered for a restart; a few reachable ones are enough to rejoin the swarm.
MAX_KNOWN_PEERS = 16


class CoordinatorNode:
    """One run's coordinator. ``serve`` blocks until ``stop`` is set; the DHT is always shut down."""

    def __init__(self, settings: Settings, slug: str, listen: str | None = None):
        self.settings = settings
        url = settings.resolved_database_url
        migrate(url)
        self.sessions = make_sessionmaker(make_engine(url))
        with self.sessions() as session:
            self.run = registry.get_run(session, slug)
            self.config = registry.run_config(self.run)
        self.identity = Path(settings.data_dir).resolve() / "identities" / f"{slug}.key"
        self.identity.parent.mkdir(parents=True, exist_ok=True)
        self.listen = listen
        # Where peers reach us from outside (containers, NAT); empty: the addresses the daemon sees itself.
        self.announce = announced_maddrs(settings.announce_maddrs, listen)
        self.plans = PlanKeeper(settings, min_interval_s=settings.plan_interval, config=self.config)
        self.checkpointer = None
        self.spot_checker = None
        self.denylist_sent: tuple[Optional[list], float] = (None, 0.0)  # usernames last published, and when
        self.plan_sent: tuple[Optional[object], float] = (None, 0.0)  # the plan record last published, and when
        self.acked: dict[str, tuple[int, float]] = {}  # peer key -> (epoch acknowledged, when: time.monotonic())

    def serve(self, stop: threading.Event) -> None:
        folder = Path(tempfile.mkdtemp(prefix="dedloc-coordinator-"))
        # Tokens for the identity's own key: workers admit a PeerID by the key its token names (the checkpointer).
        key = persistent_key(self.identity)
        public_key = key.get_public_key().to_bytes()
        with self.sessions() as session:
            run = registry.get_run(session, self.run.slug)
            check = TokenCheck(tokens.authority_public_key(session, self.settings, run))
        state = AdmissionState(folder)
        state.write_token(to_access_token(self._service_token(public_key)))
        patches.install(admission=state)  # the checkpointer's averager answers only admitted peers, like a worker's
        dht = self._start_dht(RunAuthorizer(check, state, key))
        keeper = None
        self.checkpointer = None
        try:
            self.signature = add_record_validators(dht, self.config.run_id, key)
            keeper = AdmissionKeeper(dht, self.config.run_id, state, check, self.signature,
                                     lambda: self._service_token(public_key), stop)
            keeper.start()
            # What workers are offered to join through: the announced addresses when given (a container's own
            # are unreachable from outside), else what the daemon sees.
            addrs = ([f"{addr}/p2p/{dht.peer_id}" for addr in self.announce] if self.announce
                     else [str(addr) for addr in dht.get_visible_maddrs()])
            with self.sessions() as session:
                self.coordinator_id = registry.register_coordinator(session, self.run, str(dht.peer_id), addrs).id
            logger.info("coordinator of %s up at %s", self.run.slug, addrs)
            where = f"{self.listen}, announced to peers as {addrs[0]}" if self.announce else addrs[0]
            print(f"coordinator of run {self.run.slug!r} listening at {where}", flush=True)
            self.checkpointer = self._start_checkpointer(dht)
            self.spot_checker = self._start_spot_checker()
            while not stop.is_set():
                self.poll_once(dht)
                stop.wait(self.settings.poll_interval)
        finally:
            self._mark_stopped()
            if self.spot_checker is not None:
                self.spot_checker.shutdown()
            if self.checkpointer is not None:
                self.checkpointer.shutdown()
            if keeper is not None:
                keeper.halt()
            dht.shutdown()
            end_descendants()
            shutil.rmtree(folder, ignore_errors=True)

    def _start_checkpointer(self, dht):
        """The run's checkpointer; it builds its model at the first checkpoint or spot check due, and says there
        when this run's task cannot be saved here."""
        import torch
        from dedloc_common.contract import CheckpointOptions

        from app.coordinator.checkpointer import Checkpointer

        # Checkpoints and spot checks are background work, often on a host that also trains: one torch thread
        # recomputes a check for the least CPU (docs/benchmarks.md#the-coordinators-torch-threads).
        torch.set_num_threads(1)
        with self.sessions() as session:
            options = CheckpointOptions(**(registry.get_run(session, self.run.slug).checkpoints or {}))
        checkpointer = Checkpointer(dht, self.config, options, self.settings.data_dir, self.sessions,
                                    on_saved=self._saved)
        checkpointer.start()
        return checkpointer

    def _start_spot_checker(self):
        """The run's spot checker (docs/spot-checks.md); it builds its model at the first pick."""
        from app.coordinator.spot_checker import SpotChecker

        checker = SpotChecker(self.checkpointer, self.sessions)
        checker.start()
        return checker

    def _saved(self, epoch: int, final: bool) -> None:
        if final:
            with self.sessions() as session:
                registry.set_state(session, registry.get_run(session, self.run.slug), "finished")
            print(f"run {self.run.slug!r} reached its target at epoch {epoch} and is finished", flush=True)

    def _service_token(self, public_key: bytes):
        with self.sessions() as session:
            return tokens.issue_service_token(session, self.settings, registry.get_run(session, self.run.slug),
                                              public_key, "coordinator")

    def _start_dht(self, authorizer):
        """Listen where this identity listened before and bootstrap from the workers it saw then: after a
        restart the swarm has dropped us from its routing tables, so we must call them, not wait for them."""
        listen = f"/ip4/{self.settings.host}/tcp/0"
        with self.sessions() as session:
            # Workers any coordinator of the run saw lately, and the other coordinators that are up.
            known = registry.known_worker_addrs(session, self.run) + [
                addr for row in registry.live_coordinators(session, self.run, self.settings.coordinator_timeout)
                for addr in row.multiaddrs]
            if self.identity.exists():
                peer_id = str(PeerID.from_identity(self.identity.read_bytes()))
                previous = registry.find_coordinator(session, self.run, peer_id)
                if previous is not None:
                    listen = default_listen(previous.multiaddrs, self.settings.host)
                    known = [addr for addr in known if not addr.endswith(peer_id)]
        start = lambda peers: SwarmDHT(  # noqa: E731
            initial_peers=peers, host_maddrs=[self.listen or listen], identity_path=str(self.identity),
            announce_maddrs=self.announce or None,
            # After a crash the swarm still lists our PeerID for a while; the check would refuse our own restart.
            check_if_identity_free=False, authorizer=authorizer, start=True,
            # Serve as a circuit relay for workers behind NAT, which ask their bootstrap peers (us) first
            # (hivemind's default too; dedloc_worker.swarm.node.relay_options, docs/hivemind.md#relays).
            use_relay=True,
        )
        if known:
            try:
                return start(known)
            except P2PDaemonError as e:  # all gone, or busy: the poll loop calls them again while it sees nobody
                logger.warning("none of the %d workers seen before answered (%s); starting a new swarm and calling "
                               "them again while nobody trains", len(known), e)
        return start([])

    def poll_once(self, dht) -> None:
        """Read progress and metrics from the DHT; credit new epochs, write a snapshot, refresh the heartbeat."""
        max_age = self.config.optimizer.metadata_expiration
        peers = [
            PeerSeen(p.peer_key, p.progress.epoch, p.progress.samples_accumulated, p.progress.samples_per_second,
                     p.progress.client_mode)
            for p in read_progress(dht, self.config.run_id, max_age)
        ]
        if not peers:
            self._reach_known_workers(dht)
        metrics = [SignedMetrics(m.peer_key, m.record) for m in read_metrics(dht, self.config.run_id)]
        online = {p.peer_key for p in peers}
        known_peers = [addr for m in metrics if m.peer_key in online for addr in m.record.addrs][:MAX_KNOWN_PEERS]
        try:
            with self.sessions() as session:
                run = registry.get_run(session, self.run.slug)  # fresh: organizers change bans and the ceiling live
                denylist = self._denylist_due(session, run)
                credit_epochs(session, run, metrics)
                acks = tokens.signed_acks(session, self.settings, run, self._acks_due(session, run, metrics))
                fields = summarize(peers, metrics, self.run.target_batch_size, samples_total(session, self.run))
                checkpoint_offer = (run.state, run.checkpoints, run.target_epochs, fields["epoch"], bool(peers))
                if self.spot_checker is not None and run.state == "active":
                    self.spot_checker.offer(fields["epoch"], [p.peer_key for p in peers], metrics)
                record_snapshot(session, self.run, **fields)
                registry.heartbeat(session, self.coordinator_id, known_peers=known_peers)
                plan = self.plans.update(session, run, links_online(session, run, metrics, online, max_age))
                session.commit()
            export_if_due(self.sessions, self.settings.data_dir, utcnow())  # the public daily stats dumps
        except IntegrityError as e:
            # Another coordinator on this database wrote the same rows first (a new peer, an epoch): nothing is lost,
            # the next poll reads what it wrote.
            logger.warning("another coordinator recorded this poll's rows first; the next poll goes on from them (%s)",
                           e.orig)
            return
        except SQLAlchemyError as e:
            # The records stay in the DHT for minutes: the next poll catches up.
            logger.warning("database unavailable, will retry at the next poll: %s", getattr(e, "orig", None) or e)
            return
        # After the commit: building the checkpointer's model takes seconds, which must not hold the database's
        # write lock nor delay the snapshot the dashboard reads.
        self._offer_checkpoint(*checkpoint_offer)
        if denylist is not None:
            publish_denylist(dht, self.config.run_id, self.signature, denylist)
            self.denylist_sent = (denylist["usernames"], time.monotonic())
        if plan is not None and self._plan_due(plan):
            publish_plan(dht, self.config.run_id, self.signature, plan)
            self.plan_sent = (plan, time.monotonic())
        if acks:
            publish_acks(dht, self.config.run_id, self.signature, [AckRecord(**ack) for ack in acks])
            now = time.monotonic()
            self.acked.update({ack["peer_key"]: (ack["epoch"], now) for ack in acks})

    def _plan_due(self, plan) -> bool:
        """A new plan, or the one published a third of its record's lifetime ago: every store is signed RPCs to
        every node that holds it, on the CPU of peers that train."""
        sent, at = self.plan_sent
        return plan is not sent or time.monotonic() - at >= TOKEN_RECORD_TTL / 3

    def _denylist_due(self, session, run) -> Optional[dict]:
        """The signed denylist when it changed or the one published is a third of its lifetime old, else None: each
        store is signed and sent to every peer, and peers republish it themselves
        (``admission.keeper.AdmissionKeeper``)."""
        usernames, (sent, at) = tokens.banned_usernames(session, run), self.denylist_sent
        if usernames == sent and time.monotonic() - at < TOKEN_RECORD_TTL / 3:
            return None
        return tokens.signed_denylist(session, self.settings, run)

    def _acks_due(self, session, run, metrics: list[SignedMetrics]) -> dict[str, int]:
        """Peer keys whose records carry claims, with the newest epoch the database holds of theirs, where that is
        news or the last acknowledgement published is a third of its lifetime old (workers keep every claim in
        their record until an acknowledgement covers it)."""
        stale = time.monotonic() - metrics_ttl() / 3
        epochs = acknowledgements(session, run, (m.peer_key for m in metrics if m.record.recent))
        return {key: epoch for key, epoch in epochs.items()
                if self.acked.get(key, (-1, 0.0))[0] < epoch or self.acked[key][1] < stale}

    def _offer_checkpoint(self, state: str, checkpoints: Optional[dict], target_epochs: Optional[int], epoch: int,
                          training: bool) -> None:
        if self.checkpointer is None or state == "finished":
            return
        from dedloc_common.contract import CheckpointOptions

        options = self.checkpointer.options = CheckpointOptions(**(checkpoints or {}))  # changed live
        if training and state == "active" and options.spot_check_rate > 0:
            self.checkpointer.want()  # the spot checker's picks download through it: built here, once
        self.checkpointer.offer(epoch)
        if target_epochs is not None and epoch >= target_epochs:
            self.checkpointer.finish(target_epochs)

    def _reach_known_workers(self, dht) -> None:
        """Seeing nobody, call the workers any coordinator of this run saw lately: a restarted or second
        coordinator is in no worker's routing table, so it has to make the first call."""
        try:
            with self.sessions() as session:
                addrs = registry.known_worker_addrs(session, self.run)
        except SQLAlchemyError:
            return
        if addrs:
            reached = dht.run_coroutine(functools.partial(reach_peers, addrs=addrs))
            if reached:
                logger.info("rejoined the swarm through %d of %d known workers", reached, len(addrs))

    def _mark_stopped(self) -> None:
        if getattr(self, "coordinator_id", None) is None:
            return
        try:
            with self.sessions() as session:
                registry.heartbeat(session, self.coordinator_id, alive=False)
        except SQLAlchemyError:
            pass


def links_online(session, run, metrics: list[SignedMetrics], online: set[str], max_age: float) -> list[LinkSeen]:
    """Peers online now that reported their link, named by the token issued for their key (not by the record).
    Auxiliary peers publish no progress record: a fresh metrics record counts as online too."""
    now = get_dht_time()
    reporting = [(m, m.record.link) for m in metrics if m.record.link is not None
                 and (m.peer_key in online or now - m.record.time <= max_age)]
    known = owners(session, run, (m.peer_key for m, _ in reporting))
    return [LinkSeen(m.peer_key, known[m.peer_key][1], known[m.peer_key][0], link, m.record.hardware,
                     m.record.samples_per_second, m.record.reachability)
            for m, link in reporting if m.peer_key in known]
