"""The checkpointer: in the coordinator's process, it downloads the collaboration's state from the workers every
``every_epochs`` optimizer steps (or ``every_minutes``), evaluates it on the run's held-out data and stores it as
an archive the portal serves; the last one of a run that reached its target is marked final.

It is a peer of the swarm under the coordinator's own service token: hivemind's ``TrainingStateAverager`` with the
run's optimizer, the same prefix as the workers' and state sharing off, so it never hands its (older) state to a
joiner. The download runs in its own thread; the poll loop only says which epoch the swarm is at. The spot checker
(``spot_checker``) downloads through the same averager, under ``lock``.

The task's model and the averager are built when the first checkpoint is due or the spot checker first needs them,
not at start: they cost seconds of CPU (the model, a process, and torch importing its compiler for the optimizer)
that a coordinator starting beside its swarm's first workers would take from them. They are built in the poll loop's
thread, the main one: hivemind starts an averager's process only from there (it sets a signal handler)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from dedloc_common.contract import CheckpointOptions, RunConfig
from dedloc_common.tasks import run_files
from dedloc_worker.errors import WorkerError
from dedloc_worker.tasks import Evaluated, Task, build_task
from dedloc_worker.tasks.adapters import trainable
from dedloc_worker.training.checkpoints import write_archive
from dedloc_worker.training.options import inner_optimizer, scheduler_factory

from app.runs import checkpoints as store
from app.runs import files

if TYPE_CHECKING:  # hivemind's: prepare() imports them once the averager is needed
    from app.coordinator.state_download import OuterStateAverager, PeerStateAverager

logger = logging.getLogger("dedloc.checkpointer")
DOWNLOAD_TIMEOUT = 300.0  # seconds for one state download from a worker
CHUNK_TIMEOUT = 30.0  # seconds between two parts of it


class Checkpointer(threading.Thread):
    """Saves when due; ``offer(epoch)`` after each poll, ``finish()`` once for the final model."""

    def __init__(self, dht, config: RunConfig, options: CheckpointOptions, data_dir: Path, sessions,
                 on_saved: Callable[[int, bool], None] = lambda epoch, final: None):
        super().__init__(name="dedloc-checkpointer", daemon=True)
        self.dht, self.config, self.options, self.sessions = dht, config, options, sessions
        self.data_dir = Path(data_dir)
        self.on_saved = on_saved
        # built by ``prepare`` once needed
        self.task: Optional[Task] = None
        self.averager: Optional[Union[OuterStateAverager, PeerStateAverager]] = None
        self.failure: Optional[str] = None  # why they could not be: no checkpoints then
        self.wanted = False  # a download found them not built yet: the next ``offer`` builds them
        with sessions() as session:
            newest = store.latest(session, self._run(session))
            self.saved_epoch = newest.epoch if newest is not None else -1
        self.saved_at = time.monotonic()
        self.held_epoch = -1  # the epoch of the state the averager holds from a download; -1 before the first
        self.lock = threading.Lock()  # one download or archive at a time: saves and spot checks share the averager
        self.swarm_epoch = 0
        self.final_epoch: Optional[int] = None  # the run's target once the swarm reached it: the final's epoch
        self.final_saved = False
        self._wake, self._halt = threading.Event(), threading.Event()

    def offer(self, epoch: int) -> None:
        """The swarm's epoch, from the poll loop (the main thread)."""
        self.swarm_epoch = max(self.swarm_epoch, epoch)
        if self.due() or self.wanted:
            self.prepare()
            self._wake.set()

    def finish(self, target_epoch: int) -> None:
        """The run reached its target, from the poll loop (the main thread)."""
        self.final_epoch = target_epoch
        self.prepare()
        self._wake.set()

    def due(self) -> bool:
        if self.swarm_epoch <= self.saved_epoch:
            return False
        if self.swarm_epoch - max(self.saved_epoch, 0) >= self.options.every_epochs:
            return True
        minutes = self.options.every_minutes
        return minutes is not None and time.monotonic() - self.saved_at >= 60 * minutes

    def run(self) -> None:
        while not self._halt.is_set():
            self._wake.wait(timeout=5.0)
            self._wake.clear()
            if self._halt.is_set() or self.failure is not None:
                break
            if self.final_epoch is not None and not self.final_saved:
                self.final_saved = self.save(final=True) is not None
            elif self.due():
                self.save()

    def halt(self) -> None:
        self._halt.set()
        self._wake.set()

    def shutdown(self) -> None:
        self.halt()
        self.join(timeout=DOWNLOAD_TIMEOUT + 10)
        if self.averager is not None:
            self.averager.shutdown()

    def built(self) -> bool:
        """Whether the task and the averager are built (hold ``lock``); when not, the next ``offer`` builds them."""
        self.want()
        return self.averager is not None

    def want(self) -> None:
        """Have the next ``offer`` build the task and the averager, if not yet."""
        if self.averager is None and self.failure is None:
            self.wanted = True

    def prepare(self) -> None:
        """Build the task and the averager, in the main thread, if not yet; a task that cannot be built here is said
        once, and then there are no checkpoints."""
        if self.averager is not None or self.failure is not None:
            return
        config, opt = self.config, self.config.optimizer
        paths = {name: files.path_of(self.data_dir, config.slug, name)
                 for name in run_files(config.task, config.task_options)}
        with self.lock:
            try:
                task = build_task(config, paths)
            except (WorkerError, OSError) as e:
                self.failure = str(e)
                print(f"no checkpoints for run {config.slug!r}: {e}", flush=True)
                return
            from app.coordinator.state_download import OuterStateAverager, PeerStateAverager

            on_interrupt = signal.getsignal(signal.SIGINT)
            if opt.algorithm == "local-updates":  # the peers serve the outer state (training.outer)
                self.averager = OuterStateAverager(
                    dht=self.dht, prefix=f"{config.run_id}_state_averager", params=trainable(task.model),
                    optimizer=inner_optimizer(opt), scheduler=scheduler_factory(opt), outer_lr=opt.outer_lr,
                    outer_momentum=opt.outer_momentum, allow_state_sharing=False, next_chunk_timeout=CHUNK_TIMEOUT,
                    start=True)
            else:
                self.averager = PeerStateAverager(
                    dht=self.dht, prefix=f"{config.run_id}_state_averager", params=trainable(task.model),
                    optimizer=inner_optimizer(opt), scheduler=scheduler_factory(opt),
                    # As hivemind.Optimizer builds the workers' (offloaded optimizer): the state has the same tensors.
                    offload_optimizer=True, custom_gradients=True, allow_state_sharing=False,
                    # A download's chunks may take a while on a slow link; hivemind's default would be the request
                    # timeout.
                    next_chunk_timeout=CHUNK_TIMEOUT, start=True,
                )
            signal.signal(signal.SIGINT, on_interrupt)  # starting an averager ignores Ctrl-C in its caller
            self.task, self.wanted = task, False

    def download(self) -> int:
        """Download the collaboration's newest state (hold ``lock``); the epoch of the state held, -1 when no
        download has succeeded yet."""
        if not self.built():
            return self.held_epoch
        assert self.averager is not None  # built() says so
        before = self.averager.local_epoch
        try:
            self.averager.load_state_from_peers(timeout=DOWNLOAD_TIMEOUT)
        except Exception as e:  # a worker that left mid-download: the next due time tries again
            logger.warning("could not download the collaboration's state: %s", e)
        if self.averager.local_epoch > before:
            self.held_epoch = self.averager.local_epoch
        return self.held_epoch

    def download_from(self, peer_id: str) -> Optional[tuple[int, list]]:
        """(epoch, parameters) of the state ``peer_id`` serves, in the model's parameter order, leaving the held
        state as it is (hold ``lock``); None when that peer serves none or the download failed."""
        if not self.built():
            return None
        assert self.task is not None and self.averager is not None  # built() says so
        try:
            served = self.averager.download_from(peer_id, timeout=CHUNK_TIMEOUT)
        except Exception as e:  # a peer that left, or one in client mode (it serves nothing)
            logger.info("could not download the state of peer %s: %s: %s", peer_id, type(e).__name__, e)
            return None
        shapes = [p.shape for p in trainable(self.task.model)]
        if served is None or not isinstance(served[0].get("epoch"), int) or len(served[1]) < len(shapes) or any(
                t.shape != shape for t, shape in zip(served[1], shapes)):
            return None
        return served[0]["epoch"], list(served[1][:len(shapes)])

    def save(self, final: bool = False) -> Optional[int]:
        with self.lock:
            return self._save(final)

    def _save(self, final: bool) -> Optional[int]:
        """Download the state, evaluate it, store it; the epoch saved, or None when no peer gave newer state."""
        epoch = self.download()
        if final and self.final_epoch is not None and epoch < self.final_epoch:
            # The swarm's epoch runs ahead of what a peer announces it serves: the first download may come from a
            # peer one step behind. The run loop asks again at its next wake-up.
            logger.info("no peer serves the target epoch %d yet (got %d)", self.final_epoch, epoch)
            return None
        if epoch <= self.saved_epoch and not (final and epoch == self.saved_epoch):
            logger.info("no peer holds state newer than epoch %d yet", self.saved_epoch)
            self.saved_at = time.monotonic()
            return None
        assert self.task is not None and self.averager is not None  # a download succeeded: both are built
        eval_loss = self.task.evaluate() if isinstance(self.task, Evaluated) else None
        folder = store.checkpoints_dir(self.data_dir, self.config.slug)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"epoch-{epoch:06d}.tar"
        with self.sessions() as session:
            run = self._run(session)
            from app.credit.ledger import samples_total

            samples = samples_total(session, run)
        meta = {"run": self.config.slug, "task": self.config.task, "epoch": epoch, "samples": samples,
                "eval_loss": eval_loss, "final": final}
        scheduler = self.averager.scheduler.state_dict() if self.averager.scheduler is not None else None
        params = [p for group in self.averager.optimizer.param_groups for p in group["params"]]
        outer = getattr(self.averager, "outer", None)  # a local-updates run's: its momentum resumes with it
        sha256 = write_archive(folder / name, self.task, params, self.averager.optimizer.state_dict(), scheduler,
                               meta, outer=None if outer is None else {
                                   "momentum": [m.clone() for m in outer.momentum_buffers()],
                                   "rounds": self.averager.rounds})
        with self.sessions() as session:
            run = self._run(session)
            store.store_archive(session, self.data_dir, run, epoch=epoch, samples=samples, eval_loss=eval_loss,
                                sha256=sha256, size=(folder / name).stat().st_size, file_name=name, final=final,
                                keep=self.options.keep)
            session.commit()
        self.saved_epoch, self.saved_at = epoch, time.monotonic()
        loss = "" if eval_loss is None else f", evaluation loss {eval_loss:.4f}"
        print(f"checkpoint of run {self.config.slug!r} at epoch {epoch}{loss}{' (final)' if final else ''}",
              flush=True)
        self.on_saved(epoch, final)
        if self.options.hub_repo:  # never raises: a failed push is one line, the checkpoint stays stored
            from app.coordinator.hub import push_stored

            push_stored(self.config, self.options, folder / name, self.sessions, epoch=epoch, eval_loss=eval_loss)
        return epoch

    def _run(self, session):
        from app.runs import registry

        return registry.get_run(session, self.config.slug)
