"""What the workers of one canner-receiver node ask its parent, over AMP.

With ``[receiver] workers = N > 1`` the parent (:mod:`canner.daemon.node`) keeps everything that is
one per node: the promises of free space (:class:`~canner.store.promises.Promises`), the connection
caps (:class:`~canner.web.connections.ConnectionLimits`), the origin memory
(:class:`~canner.accept.origins.AcceptedOrigins`, which the parent's rsync intake shares) and the
list of workers, so that a stalled writer on one worker can be taken over from another.  Each
worker (:mod:`canner.daemon.worker`) builds the same request-serving graph as a single process,
with the stand-ins here in place of those objects:

- :class:`NodePromises` admits a creation with ``Admit`` (from an I/O thread, as the single
  process does); ``Hold``, ``Stored``, ``Release`` and ``ReleaseAll`` need no answer;
- :class:`NodeConnections` asks ``Connect`` for each new connection (the channel waits for the
  answer, its transport paused) and tells ``Disconnect``;
- :class:`NodeOrigins` commits a file of an origin between ``BeginOrigin`` (which waits while
  another process of the node commits the same key) and ``EndOrigin``;
- ``TakeOver`` goes both ways: a worker whose append finds the upload locked by nobody of its
  own asks the parent, which asks every other worker to run its own takeover.

:class:`NodeAnswers` is the parent's side of one worker's channel; :class:`WorkerLink` the
worker's.  The parent counts what each worker holds, so a worker that dies leaves nothing held
(:meth:`NodeState.worker_gone`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, cast

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Factory
from twisted.internet.threads import blockingCallFromThread
from twisted.logger import Logger
from twisted.protocols import amp
from twisted.python.failure import Failure

from canner.accept.origins import AcceptedOrigins, OriginKey
from canner.checksum import parse_checksum
from canner.store.promises import Overpromised, Promises
from canner.store.receipts import Receipt
from canner.web.connections import ConnectionLimits

log = Logger()

# ``ReleaseAll`` carries this many ids per box (an AMP value holds at most 64 KiB).
RELEASE_BATCH = 500
# A worker tells the parent an upload's stored bytes once they grew by this much since it last
# did, or this many seconds after it last did (not per write), and when the request writing it
# ends (``settled``): until then the parent counts the upload as owing more than it does, which
# only errs towards refusing a creation, and its surveys show the bytes and the idle time the
# parent last heard of (canner.ops.inventory.InFlightScan).
STORED_STEP = 16 << 20
STORED_EVERY = 5.0


# -- the commands ---------------------------------------------------------------------------------


class Listening(amp.Command):
    """worker -> parent: the worker serves the shared socket."""

    arguments = [(b"pid", amp.Integer())]  # noqa: RUF012
    response: ClassVar[list[tuple[bytes, amp.Argument]]] = []


class Admit(amp.Command):
    """worker -> parent: promise ``size`` bytes to a new upload; the refusal's fields, or none."""

    arguments = [  # noqa: RUF012
        (b"upload_id", amp.Unicode()),
        (b"size", amp.Integer()),
        (b"free", amp.Integer()),
        (b"floor", amp.Integer()),
    ]
    response = [  # noqa: RUF012
        (b"refused", amp.Boolean()),
        (b"free_bytes", amp.Integer(optional=True)),
        (b"promised_bytes", amp.Integer(optional=True)),
        (b"uploads", amp.Integer(optional=True)),
    ]


class Hold(amp.Command):
    arguments = [  # noqa: RUF012
        (b"upload_id", amp.Unicode()),
        (b"size", amp.Integer()),
        (b"stored", amp.Integer()),
    ]
    requiresAnswer = False


class Stored(amp.Command):
    arguments = [(b"upload_id", amp.Unicode()), (b"offset", amp.Integer())]  # noqa: RUF012
    requiresAnswer = False


class Release(amp.Command):
    arguments = [(b"upload_id", amp.Unicode())]  # noqa: RUF012
    requiresAnswer = False


class ReleaseAll(amp.Command):
    arguments = [(b"upload_ids", amp.ListOf(amp.Unicode()))]  # noqa: RUF012
    requiresAnswer = False


class Connect(amp.Command):
    """worker -> parent: may a new connection from ``address`` stay open?"""

    arguments = [(b"address", amp.Unicode())]  # noqa: RUF012
    response = [(b"admitted", amp.Boolean())]  # noqa: RUF012


class Disconnect(amp.Command):
    arguments = [(b"address", amp.Unicode())]  # noqa: RUF012
    requiresAnswer = False


class BeginOrigin(amp.Command):
    """worker -> parent: the worker commits ``key`` now (waits while another process does);
    the object the node remembers for it, if any."""

    arguments = [(b"key", amp.Unicode())]  # noqa: RUF012
    response = [(b"object_id", amp.Unicode(optional=True))]  # noqa: RUF012


class EndOrigin(amp.Command):
    """worker -> parent: the commit of ``key`` ended, with ``object_id`` committed (or none)."""

    arguments = [(b"key", amp.Unicode()), (b"object_id", amp.Unicode(optional=True))]  # noqa: RUF012
    requiresAnswer = False


class TakeOver(amp.Command):
    """Take over the writer of ``upload_id`` (worker -> parent: on every other worker; parent ->
    worker: on this one); ``live`` when a writer still sending keeps it."""

    arguments = [(b"upload_id", amp.Unicode())]  # noqa: RUF012
    response = [(b"live", amp.Boolean())]  # noqa: RUF012


def key_text(key: OriginKey) -> str:
    """An :class:`OriginKey` as one AMP value."""
    return json.dumps(
        [key.project, key.downloader, key.filename, key.size_bytes, str(key.checksum)]
    )


def key_of(text: str) -> OriginKey:
    project, downloader, filename, size, checksum = json.loads(text)
    return OriginKey(project, downloader, filename, int(size), parse_checksum(checksum))


class ChannelFactory(Factory):
    """Builds the one given protocol: each end of a channel adopts its socket with it."""

    def __init__(self, protocol: amp.AMP) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: Any) -> amp.AMP:
        return self._protocol


# -- the parent's side ----------------------------------------------------------------------------


@define
class WorkerHoldings:
    """What one worker holds of the node: upload ids it admitted or appends to, connections by
    address, origin keys it commits now."""

    uploads: set[str] = field(factory=set)
    connections: Counter[str] = field(factory=Counter)
    origins: set[OriginKey] = field(factory=set)


@define(eq=False, kw_only=True)
class NodeState:
    """The node's one account of promises, connections and origins, and its workers' channels.
    Reactor thread only (the promises themselves are safe across threads)."""

    promises: Promises
    limits: ConnectionLimits
    origins: AcceptedOrigins
    channels: dict[int, NodeAnswers] = field(factory=dict)

    def take_over(self, upload_id: str, asking: int) -> Deferred[bool]:
        """Run the takeover of ``upload_id`` on every worker but ``asking``: True when a writer
        still sending keeps it on one of them."""
        return Deferred.fromCoroutine(self._take_over(upload_id, asking))

    async def _take_over(self, upload_id: str, asking: int) -> bool:
        others = [c for worker, c in self.channels.items() if worker != asking]
        for channel in others:
            try:
                answer = await channel.callRemote(TakeOver, upload_id=upload_id)
            except Exception as e:  # a worker going away holds no lock any more
                log.info(
                    "worker {worker} did not answer a takeover: {error}",
                    worker=channel.worker,
                    error=str(e),
                )
                continue
            if answer["live"]:
                return True
        return False

    def worker_gone(self, channel: NodeAnswers) -> set[str]:
        """Forget the connections and origin commits of a worker that ended, once its
        ``channel`` is closed (no box of it is answered after); the upload ids it admitted or
        wrote are returned (their promises are the caller's: see
        :func:`canner.daemon.node.settle_uploads`)."""
        if self.channels.get(channel.worker) is channel:
            del self.channels[channel.worker]
        held, channel.held = channel.held, WorkerHoldings()
        for address, count in held.connections.items():
            for _ in range(count):
                self.limits.release(address)
        for key in held.origins:
            self.origins.settle(key, None)
        return held.uploads


class NodeAnswers(amp.AMP):
    """The parent's end of worker ``worker``'s channel."""

    def __init__(self, node: NodeState, worker: int, listening: Callable[[int, int], None]):
        super().__init__()
        self.node = node
        self.worker = worker
        self._listening = listening
        # What this worker holds (a worker started again gets a channel of its own).
        self.held = WorkerHoldings()
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        super().connectionMade()
        self.node.channels[self.worker] = self

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        super().connectionLost(reason)
        if self.node.channels.get(self.worker) is self:
            del self.node.channels[self.worker]
        if not self.lost.called:
            self.lost.callback(None)

    @Listening.responder
    def listening(self, pid: int) -> dict[str, Any]:
        self._listening(self.worker, pid)
        return {}

    @Admit.responder
    def admit(self, upload_id: str, size: int, free: int, floor: int) -> dict[str, Any]:
        refusal = self.node.promises.admit(upload_id, size, free, floor)
        if refusal is None:
            self.held.uploads.add(upload_id)
            return {"refused": False}
        return {
            "refused": True,
            "free_bytes": refusal.free_bytes,
            "promised_bytes": refusal.promised_bytes,
            "uploads": refusal.uploads,
        }

    @Hold.responder
    def hold(self, upload_id: str, size: int, stored: int) -> dict[str, Any]:
        self.node.promises.hold(upload_id, size, stored)
        self.held.uploads.add(upload_id)
        return {}

    @Stored.responder
    def stored(self, upload_id: str, offset: int) -> dict[str, Any]:
        self.node.promises.stored(upload_id, offset)
        return {}

    @Release.responder
    def release(self, upload_id: str) -> dict[str, Any]:
        self.node.promises.release(upload_id)
        self.held.uploads.discard(upload_id)
        return {}

    @ReleaseAll.responder
    def release_all(self, upload_ids: list[str]) -> dict[str, Any]:
        self.node.promises.release_all(upload_ids)
        self.held.uploads.difference_update(upload_ids)
        return {}

    @Connect.responder
    def connect(self, address: str) -> dict[str, Any]:
        admitted = self.node.limits.admit(address)
        if admitted:
            self.held.connections[address] += 1
        return {"admitted": admitted}

    @Disconnect.responder
    def disconnect(self, address: str) -> dict[str, Any]:
        held = self.held.connections
        if held[address] > 0:  # never release what this worker does not hold
            self.node.limits.release(address)
            held[address] -= 1
            if not held[address]:
                del held[address]
        return {}

    @BeginOrigin.responder
    def begin_origin(self, key: str) -> Deferred[dict[str, Any]]:
        origin = key_of(key)

        def claimed(object_id: str | None) -> dict[str, Any]:
            if self.lost.called:  # the worker went while it waited: nobody commits it
                self.node.origins.settle(origin, None)
            else:
                self.held.origins.add(origin)
            return {"object_id": object_id}

        return self.node.origins.claim(origin).addCallback(claimed)

    @EndOrigin.responder
    def end_origin(self, key: str, object_id: str | None = None) -> dict[str, Any]:
        origin = key_of(key)
        if origin in self.held.origins:
            self.held.origins.discard(origin)
            self.node.origins.settle(origin, object_id)
        return {}

    @TakeOver.responder
    def take_over(self, upload_id: str) -> Deferred[dict[str, Any]]:
        return self.node.take_over(upload_id, self.worker).addCallback(lambda live: {"live": live})


# -- the worker's side ----------------------------------------------------------------------------


class WorkerLink(amp.AMP):
    """The worker's end of its channel to the parent.  ``take_over_here`` runs this worker's
    own takeover of an upload (True: a writer still sending keeps it); ``lost`` fires when the
    parent is gone."""

    def __init__(self, reactor: Any) -> None:
        super().__init__()
        # The reactor whose thread sends (IReactorFromThreads).
        self._from_threads = reactor
        self.take_over_here: Callable[[str], Deferred[bool]] = lambda upload_id: succeed(False)
        self.lost: Deferred[None] = Deferred()

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        super().connectionLost(reason)
        if not self.lost.called:
            self.lost.callback(None)

    @TakeOver.responder
    def take_over(self, upload_id: str) -> Deferred[dict[str, Any]]:
        return self.take_over_here(upload_id).addCallback(lambda live: {"live": live})

    def tell(self, command: type[amp.Command], **arguments: Any) -> None:
        """Send a command that needs no answer, from any thread, in the order told.  Nothing
        is sent once the parent is gone (the worker is stopping then)."""
        self._reactor().callFromThread(self._send, command, arguments)

    def _send(self, command: type[amp.Command], arguments: dict[str, Any]) -> None:
        if self.transport is None or self.lost.called:
            return
        self.callRemote(command, **arguments)

    def ask(self, command: type[amp.Command], **arguments: Any) -> Deferred[dict[str, Any]]:
        """Call ``command`` (reactor thread)."""
        return cast(Deferred[dict[str, Any]], self.callRemote(command, **arguments))

    def ask_from_thread(self, command: type[amp.Command], **arguments: Any) -> dict[str, Any]:
        """Call ``command`` from a thread other than the reactor's and wait for its answer."""
        return cast(
            dict[str, Any],
            blockingCallFromThread(self._reactor(), self._call, command, arguments),
        )

    def _call(self, command: type[amp.Command], arguments: dict[str, Any]) -> Deferred[Any]:
        return cast(Deferred[Any], self.callRemote(command, **arguments))

    def _reactor(self) -> Any:
        return self._from_threads


@define(eq=False)
class NodePromises(Promises):
    """The node's promises as a worker sees them: admission is the parent's; this worker's own
    share is still kept here, though no view reads it any more (``/readyz`` and the status page
    are the parent's, which count the node's).  Safe across threads, like :class:`Promises`."""

    _link: WorkerLink | None = None
    # The stored bytes last told to the parent, and when (time.monotonic), by upload.
    _told: dict[str, tuple[int, float]] = field(factory=dict)

    def admit(self, upload_id: str, size: int, free: int, floor: int) -> Overpromised | None:
        assert self._link is not None
        answer = self._link.ask_from_thread(
            Admit, upload_id=upload_id, size=size, free=free, floor=floor
        )
        if answer["refused"]:
            return Overpromised(
                answer["free_bytes"], answer["promised_bytes"], answer["uploads"], size, floor
            )
        super().hold(upload_id, size, 0)
        with self._lock:
            self._told[upload_id] = (0, time.monotonic())
        return None

    def hold(self, upload_id: str, size: int, stored: int) -> None:
        super().hold(upload_id, size, stored)
        with self._lock:
            self._told[upload_id] = (stored, time.monotonic())
        self._tell(Hold, upload_id=upload_id, size=size, stored=stored)

    def stored(self, upload_id: str, offset: int) -> None:
        super().stored(upload_id, offset)
        now = time.monotonic()
        with self._lock:
            told, at = self._told.get(upload_id, (0, now))
            if offset - told < STORED_STEP and now - at < STORED_EVERY:
                return
            self._told[upload_id] = (offset, now)
        self._tell(Stored, upload_id=upload_id, offset=offset)

    def settled(self, upload_id: str, offset: int) -> None:
        super().stored(upload_id, offset)
        with self._lock:
            if upload_id not in self._told:
                return  # released meanwhile (the sweep's, or a reset's)
            self._told[upload_id] = (offset, time.monotonic())
        self._tell(Stored, upload_id=upload_id, offset=offset)

    def release(self, upload_id: str) -> None:
        super().release(upload_id)
        with self._lock:
            self._told.pop(upload_id, None)
        self._tell(Release, upload_id=upload_id)

    def release_all(self, upload_ids: Iterable[str]) -> None:
        ids = list(upload_ids)
        super().release_all(ids)
        with self._lock:
            for upload_id in ids:
                self._told.pop(upload_id, None)
        for start in range(0, len(ids), RELEASE_BATCH):
            self._tell(ReleaseAll, upload_ids=ids[start : start + RELEASE_BATCH])

    def _tell(self, command: type[amp.Command], **arguments: Any) -> None:
        assert self._link is not None
        self._link.tell(command, **arguments)


@define(eq=False)
class NodeConnections:
    """The node's connection caps as a worker's channel asks them (reactor thread only): an
    answer comes later, so :meth:`admit` returns a Deferred; a lost parent admits nobody."""

    _link: WorkerLink
    per_address: int
    refused: int = 0
    open: int = 0

    def admit(self, address: str) -> Deferred[bool]:
        def answered(answer: dict[str, Any]) -> bool:
            admitted = bool(answer["admitted"])
            if admitted:
                self.open += 1
            else:
                self.refused += 1
            return admitted

        def unanswered(failure: Failure) -> bool:
            self.refused += 1
            return False

        return self._link.ask(Connect, address=address).addCallbacks(answered, unanswered)

    def release(self, address: str) -> None:
        self.open -= 1
        self._link.tell(Disconnect, address=address)


@define(eq=False, kw_only=True)
class NodeOrigins(AcceptedOrigins):
    """The origin rule across the node: a commit of a key runs between ``BeginOrigin`` (which
    waits while another process of the node commits it) and ``EndOrigin``; the index and the
    object the parent remembers are looked up as by :class:`AcceptedOrigins`."""

    _link: WorkerLink

    async def _once(
        self, key: OriginKey, commit: Callable[[], Deferred[Receipt]]
    ) -> tuple[Receipt, bool]:
        text = key_text(key)
        answer = await self._link.ask(BeginOrigin, key=text)
        committed: str | None = None
        try:
            remembered = answer.get("object_id")
            if remembered is not None:
                self.remember(key, remembered)
            found = await self._find(key)
            if found is not None:
                return found, False
            receipt = await commit()
            committed = receipt.object_id
            self.remember(key, committed)
            return receipt, True
        finally:
            self._link.tell(EndOrigin, key=text, object_id=committed)
