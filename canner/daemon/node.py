"""The parent of a canner-receiver node: one listening socket, N worker processes serving it.

With ``[receiver] workers = N > 1`` the twistd process (the one systemd, the pidfile, SIGTERM
and the manhole see) does every start-up step of a single receiver, keeps what is one per node
(:class:`~canner.daemon.node_protocol.NodeState`: promises, connection caps, origins; the sweep,
the rsync intake, the trend sampler, the metrics survey, the manhole) and serves its own site on
a private unix socket only.  :class:`SharedListener` opens ``listen`` without ever accepting on
it; :class:`WorkerSupervisor` runs ``python -m canner.tap.worker`` N times, each inheriting
the listening socket, one end of a socketpair for its AMP channel, a pipe for its log events and
``receiver.lock`` (a flock: a worker that outlives its parent keeps the data directory locked).

A worker that ends unasked is logged in one line with its exit status, what it held is let go
(:meth:`NodeState.worker_gone`, :func:`settle_uploads`) and it is started again, after
:data:`RESPAWN_DELAY` doubled per quick failure up to :data:`RESPAWN_MAX`.  When the parent
stops, every worker gets SIGTERM and stops as a single receiver stops; one still running after
:data:`STOP_WAIT` gets SIGKILL, with a line saying so.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from attrs import define, field, frozen
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError, ProcessDone, ProcessTerminated
from twisted.internet.protocol import Factory, ProcessProtocol, Protocol
from twisted.logger import Logger, LogPublisher, eventFromJSON
from twisted.python.failure import Failure

from canner.config import Config
from canner.daemon.node_protocol import ChannelFactory, NodeAnswers, NodeState
from canner.daemon.services import cannot_listen
from canner.fs import DataDirLock
from canner.store.promises import Promises
from canner.store.receipts import ReceiptStore
from canner.store.uploads import CorruptInfo, UploadStore

log = Logger()

# The descriptors a worker finds open (canner.daemon.worker reads the same numbers).
LOG_FD = 3
LISTEN_FD = 4
CHANNEL_FD = 5
LOCK_FD = 6

RESPAWN_DELAY = 1.0
RESPAWN_MAX = 30.0
# A worker that ran this long before it ended counts as healthy: the next respawn waits 1 s.
HEALTHY_RUN = 30.0
# How long a stopping parent waits for its workers before SIGKILL (below the unit's
# TimeoutStopSec=30s, so the parent's own stop still runs).
STOP_WAIT = 20.0


class SharedListener(Service):
    """The node's listening socket, open but never accepted on here (each worker adopts it).
    A description it cannot listen on ends start-up with the single receiver's line."""

    def __init__(self, description: str, reactor: Any) -> None:
        self._description = description
        self._reactor = reactor
        self.port: Any = None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        results: list[Any] = []
        serverFromString(self._reactor, self._description).listen(
            Factory.forProtocol(Protocol)
        ).addBoth(results.append)
        result = results[0]  # tcp, unix and systemd endpoints listen at once
        if isinstance(result, Failure):
            if isinstance(result.value, CannotListenError):
                raise cannot_listen(self._description, "listen", result.value)
            result.raiseException()
        result.stopReading()
        self.port = result

    def fileno(self) -> int:
        return int(self.port.fileno())

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self.port is None:
            return None
        return defer.maybeDeferred(self.port.stopListening)


def settle_uploads(
    uploads: UploadStore, receipts: ReceiptStore, promises: Promises, upload_ids: Iterable[str]
) -> int:
    """The promises of the uploads a dead worker held (blocking): one with a receipt, or
    without a sidecar, owes nothing; a whole-file upload without a receipt can never be resumed,
    so its files go with its promise (as at start, :func:`canner.store.sweep.remove_whole_files`);
    a tus upload keeps its size with the bytes stored re-read from disk.  Returns how many whole
    files were removed."""
    removed = 0
    for upload_id in upload_ids:
        if receipts.receipt_path(upload_id).exists():
            promises.release(upload_id)
            continue
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo:
            info = None
        if info is None or info.rejected is not None:
            promises.release(upload_id)
            continue
        if info.whole_file:
            try:
                uploads.remove(upload_id)
                receipts.forget_origin(upload_id)
                removed += 1
            except OSError as e:
                log.warn(
                    "{object_id} stays for the sweep: {error}",
                    object_id=upload_id,
                    error=e.strerror or str(e),
                )
            promises.release(upload_id)
            continue
        stored = 0 if uploads.is_untrusted(info) else uploads.offset(upload_id)
        promises.hold(upload_id, info.size, stored)
    return removed


@define
class WorkerRecord:
    """One worker as the manhole's ``workers`` shows it."""

    index: int
    pid: int | None = None
    started: float | None = None
    listening: bool = False
    restarts: int = 0
    delay: float = RESPAWN_DELAY


class WorkerProcess(ProcessProtocol):
    """One worker's process: its log events re-published in the parent's stream, naming it."""

    def __init__(
        self,
        record: WorkerRecord,
        channel: NodeAnswers,
        publisher: LogPublisher,
        ended: Callable[..., None],
    ):
        self.record = record
        self.channel = channel
        self._publisher = publisher
        self._ended = ended
        self._buffers: dict[int, bytes] = {}
        self.gone: Deferred[None] = Deferred()

    def childDataReceived(self, child_fd: int, data: bytes) -> None:
        lines = (self._buffers.pop(child_fd, b"") + data).split(b"\n")
        self._buffers[child_fd] = lines.pop()
        for line in lines:
            if line.strip():
                self._line(child_fd, line)

    def _line(self, child_fd: int, line: bytes) -> None:
        system = f"worker {self.record.index} pid {self.record.pid}"
        if child_fd == LOG_FD:
            try:
                event = eventFromJSON(line.decode("utf-8", "replace").lstrip("\x1e"))
            except ValueError:
                event = None
            if event is not None:
                event["log_system"] = system
                event["worker"] = self.record.index
                event["worker_pid"] = self.record.pid
                self._publisher(event)
                return
        log.info(
            "{system} wrote: {line}",
            system=system,
            line=line.decode("utf-8", "replace"),
            worker=self.record.index,
            worker_pid=self.record.pid,
        )

    def processEnded(self, reason: Failure) -> None:
        for fd, rest in list(self._buffers.items()):
            if rest.strip():
                self._line(fd, rest)
        self._buffers.clear()
        self._ended(self, reason)
        self.gone.callback(None)


def exit_status(reason: Failure) -> str:
    """``exit status N`` or ``killed by SIGNAME`` for a process that ended."""
    error = reason.value
    if isinstance(error, ProcessDone):
        return "exit status 0"
    if isinstance(error, ProcessTerminated):
        if error.signal is not None:
            import signal

            try:
                return f"killed by {signal.Signals(error.signal).name}"
            except ValueError:
                return f"killed by signal {error.signal}"
        return f"exit status {error.exitCode}"
    return str(error)


@frozen
class Roster:
    """The workers as the supervisor last saw them; read from any thread (``/readyz``)."""

    _count: int
    _workers: dict[int, WorkerRecord]

    def configured(self) -> int:
        return self._count

    def running(self) -> int:
        return sum(1 for record in list(self._workers.values()) if record.listening)

    def restarts(self) -> int:
        return sum(record.restarts for record in list(self._workers.values()))


@define(eq=False, kw_only=True)
class WorkerSupervisor(Service):
    """Starts the node's workers, starts one again when it ends unasked, and stops them all."""

    _reactor: Any
    _count: int
    _command: Callable[[int], list[str]]
    _listener: SharedListener
    _node: NodeState
    _lock_fd: int
    _settle: Callable[[set[str]], Deferred[int]]
    _publisher: LogPublisher
    workers: dict[int, WorkerRecord] = field(factory=dict)
    _processes: dict[int, WorkerProcess] = field(factory=dict)
    _listening: Deferred[None] = field(factory=Deferred)
    _stopping: bool = False

    def __attrs_post_init__(self) -> None:
        Service.__init__(self)

    @property
    def roster(self) -> Roster:
        """What the node's view reads of the workers (:class:`canner.ops.node.WorkerRoster`)."""
        return Roster(self._count, self.workers)

    def all_listening(self) -> Deferred[None]:
        """Fires once every worker has said it serves the socket (the first time)."""
        return self._listening

    def startService(self) -> None:
        super().startService()
        for index in range(1, self._count + 1):
            self.workers[index] = WorkerRecord(index)
            self._spawn(index)

    def _spawn(self, index: int) -> None:
        if self._stopping:
            return
        record = self.workers[index]
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        answers = NodeAnswers(self._node, index, self._worker_listening)
        self._reactor.adoptStreamConnection(
            parent_end.fileno(), socket.AF_UNIX, ChannelFactory(answers)
        )
        parent_end.close()
        process = WorkerProcess(record, answers, self._publisher, self._ended)
        argv = self._command(index)
        try:
            transport = self._reactor.spawnProcess(
                process,
                argv[0],
                argv,
                env=dict(os.environ),
                childFDs={
                    0: "w",
                    1: "r",
                    2: "r",
                    LOG_FD: "r",
                    LISTEN_FD: self._listener.fileno(),
                    CHANNEL_FD: child_end.fileno(),
                    LOCK_FD: self._lock_fd,
                },
            )
        finally:
            child_end.close()
        record.pid = transport.pid
        record.started = self._reactor.seconds()
        record.listening = False
        self._processes[index] = process

    def _worker_listening(self, index: int, pid: int) -> None:
        record = self.workers[index]
        record.listening = True
        if record.restarts:
            log.info(
                "worker {worker} restarted (pid {pid}, restart {restarts})",
                worker=index,
                pid=pid,
                restarts=record.restarts,
            )
        if not self._listening.called and all(r.listening for r in self.workers.values()):
            log.info(
                "all {count} workers serve {listen}",
                count=self._count,
                listen=self._listener._description,
            )
            self._listening.callback(None)

    def _ended(self, process: WorkerProcess, reason: Failure) -> None:
        record = process.record
        if self._processes.get(record.index) is process:
            del self._processes[record.index]
        status = exit_status(reason)
        # What it held is let go once every box it sent has been answered (its socket's end
        # may come after its exit status).
        process.channel.lost.addCallback(lambda _: self._let_go(process, status))

    def _let_go(self, process: WorkerProcess, status: str) -> None:
        record = process.record
        held = self._node.worker_gone(process.channel)
        if self._stopping:
            log.info(
                "worker {worker} (pid {pid}) stopped: {status}",
                worker=record.index,
                pid=record.pid,
                status=status,
            )
            return
        ran = self._reactor.seconds() - (record.started or 0.0)
        record.delay = RESPAWN_DELAY if ran >= HEALTHY_RUN else record.delay
        delay = record.delay
        record.delay = min(record.delay * 2, RESPAWN_MAX)
        record.restarts += 1
        record.listening = False
        log.error(
            "worker {worker} (pid {pid}) ended unasked ({status}) after {ran} s, holding"
            " {uploads} uploads; restarting it in {delay} s",
            worker=record.index,
            pid=record.pid,
            status=status,
            ran=round(ran, 1),
            uploads=len(held),
            delay=delay,
        )
        if held:
            self._settle(held).addCallbacks(
                lambda removed: log.info(
                    "{count} uploads of worker {worker} settled ({removed} whole files without"
                    " a receipt removed)",
                    count=len(held),
                    worker=record.index,
                    removed=removed,
                ),
                lambda f: log.failure(
                    "settling the uploads of worker {worker}", f, worker=record.index
                ),
            )
        self._reactor.callLater(delay, self._spawn, record.index)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        self._stopping = True
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        running = list(self._processes.values())
        for process in running:
            self._signal(process, "TERM")
        if not running:
            return
        gone = defer.DeferredList([p.gone for p in running])
        gone.addTimeout(STOP_WAIT, self._reactor)
        try:
            await gone
        except defer.TimeoutError:
            for process in running:
                if not process.gone.called:
                    log.warn(
                        "worker {worker} (pid {pid}) did not stop within {wait} s: killed",
                        worker=process.record.index,
                        pid=process.record.pid,
                        wait=STOP_WAIT,
                    )
                    self._signal(process, "KILL")
            await defer.DeferredList([p.gone for p in running])

    def _signal(self, process: WorkerProcess, name: str) -> None:
        try:
            process.transport.signalProcess(name)  # type: ignore[union-attr]
        except Exception:  # it ended already
            pass


@frozen
class WorkerNode:
    """What :func:`canner.daemon.roots.receiver_service` adds for a node of several workers."""

    listener: SharedListener
    supervisor: WorkerSupervisor
    # The parent's own full site (status, readiness, metrics, HQ): a private unix socket.
    site_description: str
    private_dir: Path

    @classmethod
    def build(
        cls,
        config: Config,
        config_path: Path,
        reactor: Any,
        node: NodeState,
        lock: DataDirLock,
        settle: Callable[[set[str]], Deferred[int]],
        publisher: LogPublisher,
    ) -> WorkerNode:
        listener = SharedListener(config.listen, reactor)
        # A directory of its own (0700; systemd's RuntimeDirectory when there is one): a short
        # path, whatever the data directory's (a unix socket's path holds 107 bytes).  Not
        # Linux's abstract namespace: Twisted would log its name, NUL included.
        private = Path(
            tempfile.mkdtemp(prefix="canner-node-", dir=os.environ.get("RUNTIME_DIRECTORY"))
        )
        address = str(private / "site.sock")
        description = f"unix:{address}:lockfile=0"

        def command(index: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "canner.tap.worker",
                "--config",
                str(config_path),
                "--index",
                str(index),
                "--node-site",
                address,
            ]

        supervisor = WorkerSupervisor(
            reactor=reactor,
            count=config.receiver.workers,
            command=command,
            listener=listener,
            node=node,
            lock_fd=lock.fileno(),
            settle=settle,
            publisher=publisher,
        )
        return cls(listener, supervisor, description, private)

    def remove_private_dir(self) -> None:
        """Remove the directory of the node's own site (once it has stopped)."""
        shutil.rmtree(self.private_dir, ignore_errors=True)
