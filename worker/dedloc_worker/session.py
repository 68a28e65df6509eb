"""``dedloc-worker join``: sign-in, peer token, admission, swarm, training, clean exit, in that order."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from dedloc_worker.errors import AdmissionError, SwarmError

CREDENTIAL_ENV = "DEDLOC_WORKER_CREDENTIAL"  # for headless machines: a credential issued by the portal
HALT_GRACE = 1.0  # seconds the background threads get to finish their DHT call before the DHT shuts down
RELAY_NOTE = " (libp2p grants a slot after about 3 minutes; a 'relay:' line says when)"


def obtain_credential(portal_url: str) -> str:
    """The API credential for ``portal_url``: from the environment, the saved login, or a new device login."""
    if os.environ.get(CREDENTIAL_ENV):
        return os.environ[CREDENTIAL_ENV]
    from dedloc_worker.portal.login import device_login, load_credential, save_credential

    credential = load_credential(portal_url)
    if credential is None:
        credential = device_login(portal_url)
        save_credential(credential)
    return credential.access_token


def run_join(args, stop: threading.Event):
    """Join the run and train until ``stop`` or ``--max-epochs``; returns the training result."""
    # Heavy imports here, after the command line is known to be valid: `--help` stays instant.
    import torch
    from dedloc_common.cleanup import end_descendants

    from dedloc_worker import terminal
    from dedloc_worker.training import device

    terminal.quiet(args.verbose)  # before any hivemind process forks from this one
    placement = device.choose(args.device, args.threads)
    torch.set_num_threads(placement.threads)
    folder = Path(tempfile.mkdtemp(prefix="dedloc-worker-"))  # mode 0700: our key and token live here
    try:
        return _join(args, stop, folder, placement)
    finally:
        end_descendants()
        shutil.rmtree(folder, ignore_errors=True)


def _join(args, stop, folder: Path, placement):
    from dedloc_common.tasks import run_files

    from dedloc_worker import patches
    from dedloc_worker.admission.gate import AdmissionState, RunAuthorizer, TokenCheck, to_access_token
    from dedloc_worker.admission.identity import PeerIdentity
    from dedloc_worker.admission.keeper import AdmissionKeeper
    from dedloc_worker.averaging.planning import LinkMeter, PlanFollower, link_report
    from dedloc_worker.credit.outbox import ClaimKeeper, ClaimOutbox
    from dedloc_worker.credit.receipts import ReceiptLog
    from dedloc_worker.portal.client import (
        RunWatch,
        fetch_denylist,
        fetch_join_info,
        measure_link,
        request_peer_token,
        wait_for_peers,
    )
    from dedloc_worker.portal.run_files import fetch_run_files
    from dedloc_worker.progress import ProgressDisplay
    from dedloc_worker.swarm.records import add_record_validators
    from dedloc_worker.tasks import Placeable, build_task
    from dedloc_worker.tasks.adapters import trainable
    from dedloc_worker.training import memory
    from dedloc_worker.training.loop import train

    # An unknown run, an ended one or an unreachable portal fails before any login.
    ended(fetch_join_info(args.portal, args.run).config)
    credential = obtain_credential(args.portal)
    identity = PeerIdentity(folder)
    refresh = lambda: request_peer_token(args.portal, args.run, credential, identity.public_key)  # noqa: E731
    grant, granted_at = refresh(), time.monotonic()
    deadline = time.monotonic() + args.wait
    config, username = grant.join.config, grant.token.username
    # The task first: a run this worker cannot train fails in one line before any wait for peers.
    files = fetch_run_files(args.portal, args.run, run_files(config.task, config.task_options))
    task = build_task(config, files, data_seed=int(identity.peer_id.encode().hex()[-8:], 16))
    # before the model moves to the GPU: a run that cannot fit is one line, not an out-of-memory traceback
    need = memory.estimate(task.model.parameters(), trainable(task.model),
                           offload=config.optimizer.algorithm == "large-batch",
                           moment_bytes=1 if config.optimizer.name == "adamw-8bit" else 4)
    memory.check_fits(need, placement.device)
    if isinstance(task, Placeable):
        task.to(placement.device, placement.amp)
    micro_batch = report = None
    if not args.aux:  # an auxiliary peer computes nothing: its model's memory is all it needs
        micro_batch, activations = memory.choose_micro_batch(task, need, config.batch_size, placement.device)
        line = memory.describe(need, activations, micro_batch, config.batch_size, placement.device)
        print(f"memory: {line}", flush=True)
        report = memory.report(need, activations, micro_batch, placement.device, placement.amp)
    else:
        print(f"memory: this run's model needs {need.describe()}", flush=True)
    info = grant.join if grant.join.initial_peers else wait_for_peers(args.portal, args.run, args.wait)
    if time.monotonic() - granted_at > grant.lifetime_seconds / 2:  # a long wait for a coordinator: a fresh token
        grant = refresh()
    role = " as an auxiliary peer" if args.aux else ""
    print(f"joining run {config.slug!r} as {username}{role}: task {config.task}, "
          f"global batch {config.target_batch_size} samples, on {placement.description}", flush=True)
    measured, measured_at = measure_link(args.portal, args.run, credential), time.time()
    if measured:
        print(f"link to the portal: {8 * measured[0] / 1e6:,.0f} Mbit/s up, "
              f"{8 * measured[1] / 1e6:,.0f} Mbit/s down", flush=True)

    state, check = AdmissionState(folder), TokenCheck(grant.authority_public_key)
    state.write_token(to_access_token(grant.token))
    receipts = ReceiptLog(folder)
    patches.install(admission=state, receipts=receipts)  # before any hivemind process forks
    authorizer = RunAuthorizer(check, state, identity.private_key)
    dht = join_swarm(args, info, deadline, identity.identity_path, authorizer, client_mode=bool(args.client))
    client_mode, reachability = decide_mode(args, dht, credential)
    if client_mode and not args.client:  # an address nobody can dial would slow every round it is planned into
        dht.shutdown()
        dht = join_swarm(args, info, deadline, identity.identity_path, authorizer, client_mode=True,
                         unreachable=True)
    link = link_report(measured, trainable(task.model), client_mode, args.aux, measured_at=measured_at,
                       compression=config.optimizer.compression)
    keeper = follower = meter = watch = claims = relays = None
    try:
        if client_mode:  # it asked for a relay slot (swarm.relay_options): say when it receives through one
            from dedloc_worker.swarm.node import RelayWatch, relay_addresses

            relays = RelayWatch(lambda: relay_addresses(dht), lambda line: print(line, flush=True))
            relays.start()
        signature = add_record_validators(dht, config.run_id, identity.private_key)
        # Every claim stays in this peer's metrics record, kept alive, until the coordinator acknowledges it.
        outbox = ClaimOutbox(receipts)
        claims = ClaimKeeper(dht, config.run_id, signature, check, outbox)
        claims.start()
        coordinators = lambda: fetch_join_info(args.portal, args.run).initial_peers  # noqa: E731
        # A ban reaches this peer from the portal too: while no coordinator is up, nobody publishes it in the DHT.
        denylist = lambda: fetch_denylist(args.portal, args.run, credential).model_dump()  # noqa: E731
        keeper = AdmissionKeeper(dht, config.run_id, state, check, signature, lambda: refresh().token, stop,
                                 coordinators=coordinators, portal_denylist=denylist)
        keeper.start()
        # Peers must know our token before our first call reaches them (they read tokens every keeper interval),
        # and we theirs: training waits an interval from here, which building its optimizer mostly covers.
        keeper.ready.wait(timeout=15)
        admitted_at = time.monotonic() + keeper.interval
        # The link again every few minutes, in a thread of its own, right after a round where it can
        meter = LinkMeter(lambda: measure_link(args.portal, args.run, credential))
        meter.start()
        follower = PlanFollower(dht, config.run_id, check, link, meter=meter)
        follower.start()
        # Organizers' pauses reach a worker within a few matchmaking times (10 s at most).
        watch = RunWatch(args.portal, args.run, config.state,
                         interval=max(1.0, min(10.0, 4 * config.optimizer.matchmaking_time)),
                         target_epochs=config.target_epochs)
        watch.start()
        resume = resume_state(args.portal, dht, config, info.checkpoint, folder) if not args.aux else None
        with ProgressDisplay() as display:
            result = train(dht, config, task, username, stop, signature, args.max_epochs, client_mode,
                           display.update, receipts, follower, args.aux, hardware=placement.description,
                           watch=watch, resume=resume, reachability=reachability, admitted_at=admitted_at,
                           outbox=outbox, expired=keeper.expired,
                           micro_batch=micro_batch, memory=report)
        if keeper.failure:
            raise AdmissionError(keeper.failure)
        result.username, result.peer_id = username, identity.peer_id
        return result
    finally:
        # All asked at once, then a shared grace: one thread inside a slow DHT read must not hold the others up.
        threads = [thread for thread in (watch, follower, meter, relays, keeper, claims) if thread is not None]
        for thread in threads:
            thread.halt(timeout=0)
        grace = time.monotonic() + HALT_GRACE
        for thread in threads:
            thread.join(max(grace - time.monotonic(), 0.0))
        dht.shutdown()


def join_swarm(args, info, deadline: float, identity_path: Path, authorizer, client_mode: bool = False,
               unreachable: bool = False):
    """Start the DHT node; while the run's peers are unreachable (a coordinator restarting), ask the portal
    again until ``deadline``. ``unreachable``: the portal's dial-back found this machine unreachable."""
    from hivemind.p2p import P2PDaemonError

    from dedloc_worker.portal.client import wait_for_peers
    from dedloc_worker.swarm.node import create_dht

    while True:
        try:
            return create_dht(info.initial_peers, args.listen, client_mode, str(identity_path), authorizer,
                              unreachable=unreachable)
        except (P2PDaemonError, RuntimeError) as e:
            # hivemind raises RuntimeError when no initial peer answered its bootstrap ping (a busy coordinator)
            if not isinstance(e, P2PDaemonError) and "bootstrap failed" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise SwarmError(f"cannot reach any peer of run {args.run!r} ({e}); retry in a minute") from None
            print("the run's coordinator is unreachable; asking the portal again...", flush=True)
            time.sleep(2.0)
            info = wait_for_peers(args.portal, args.run, max(deadline - time.monotonic(), 1.0))


def decide_mode(args, dht, credential: str) -> tuple[bool, str]:
    """(client mode, ``contract.REACHABILITY``): as forced by --client / --no-client (or --aux, which must accept
    connections), else by the portal's dial-back of this node's addresses; one line says which, and why."""
    from dedloc_worker.portal.client import check_reachability

    say = lambda line: print(line, flush=True)  # noqa: E731
    if args.client:
        say("client mode, as asked (--client): this peer sends its gradients to others and aggregates none; it "
            f"asks the run's peers for a relay to receive through{RELAY_NOTE}")
        return True, "client"
    if args.client is False or args.aux:
        return False, ""
    addrs = [str(addr) for addr in dht.get_visible_maddrs()]
    # Loopback addresses say nothing about outsiders (unless this machine has no other, as in a local demo).
    outside = [addr for addr in addrs if not addr.startswith(("/ip4/127.", "/ip6/::1/"))]
    report = check_reachability(args.portal, args.run, credential, outside or addrs)
    if report is None:
        say("reachability: the portal could not dial this machine back; staying a full peer (--client forces "
            "client mode)")
        return False, ""
    if report.reachable:
        answered = next(check for check in report.checks if check.reachable)
        say(f"reachable: peers can connect to this machine ({answered.dialed}: {answered.reason}); a full peer")
        return False, "reachable"
    why = report.checks[0].reason if report.checks else "no address to dial"
    say(f"unreachable from outside ({why}); switching to client mode: this peer sends its gradients to others "
        f"and aggregates none; it asks the run's peers for a relay to receive through{RELAY_NOTE}")
    return True, "unreachable"


def ended(config) -> None:
    """Refuse to join a run that is over: ``RunFinished``, which the CLI reports with its own exit code."""
    from dedloc_worker.errors import RunFinished

    if config.state == "finished":
        raise RunFinished(f"run {config.slug!r} is finished; its final model is on the run's page")


def resume_state(portal_url: str, dht, config, checkpoint, folder: Path):
    """The newest checkpoint's training state when no peer of the swarm trains now (it was stopped, every worker
    left); None when peers are training (hivemind downloads their newer state) or there is no checkpoint."""
    from dedloc_worker.portal.client import download_checkpoint
    from dedloc_worker.swarm.records import read_progress
    from dedloc_worker.training.checkpoints import extract, read_state

    if checkpoint is None:
        return None
    training = [p for p in read_progress(dht, config.run_id, config.optimizer.metadata_expiration)
                if p.progress.epoch >= checkpoint.epoch]
    if training:
        return None
    archive = download_checkpoint(portal_url, checkpoint, folder)
    state = read_state(extract(archive, folder / "resume"))
    print(f"resuming the run from its checkpoint at epoch {state['epoch']}", flush=True)
    return state
