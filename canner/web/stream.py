"""An upload body's life, from admission to its answer: :class:`BodyStream`.

The request (``channel.py``) hands each chunk of an upload body to a :class:`BodyStream` as it
arrives.  The stream waits for the upload's admission (decided in a thread), writes chunks at
the upload's offset (in a thread, one write at a time), pauses the socket while writes lag
behind, keeps what was written when the connection drops, and then either runs ``finish``
(acceptance of a complete upload, or closing an incomplete one) or gives the answer decided
without writing (a refusal, a failed write, a body past the upload's length).

Its life is a :class:`Phase` with a transition table (:data:`NEXT`), in the manner of
``delivery/queue.py``; everything else it holds is data (chunks waiting, bytes received) or an
input from the connection (body ended, connection lost).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from attrs import define, field
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from canner.blocking import BlockingRunner, PoolStopped
from canner.store.uploads import LockedUpload
from canner.web.errors import HTTPError

log = Logger()

# Pause the socket once this much received data waits for the disk; with one write in flight a
# stream holds at most about twice this (plus one socket read) in memory.
PENDING_HIGH_WATER = 1 << 20
# What the upload bodies streaming at once hold in memory together, about: each one's share
# (:meth:`BodyBudget.share`) is its high water mark and its socket read size, so that 32 bodies
# at once hold about as much as 8 (32 hold 12 MiB: their shares are at SHARE_MIN).  8 MiB, not 16:
# the same MiB/s for 32 x 64 MiB (745 against 698, interleaved, idle machine) at a peak RSS of
# 88 MiB instead of 102 (bench/README.md).
BODIES_HIGH_WATER = 8 << 20
# The smallest share: below it reads cost more CPU per byte than the memory is worth.
SHARE_MIN = 128 << 10


@define(eq=False)
class BodyBudget:
    """The upload bodies of one process streaming at once, which share :data:`BODIES_HIGH_WATER`
    of memory (reactor thread only)."""

    high_water: int = BODIES_HIGH_WATER
    streams: int = 0

    def share(self) -> int:
        """One body's high water mark now: a third of its part of the whole (it holds its
        pending bytes, the write in flight and one read), at most :data:`PENDING_HIGH_WATER`."""
        part = self.high_water // (3 * max(self.streams, 1))
        return max(SHARE_MIN, min(PENDING_HIGH_WATER, part))


class Phase(enum.Enum):
    """Where an upload body is."""

    ADMITTING = "admitting"  # the head is in; admission runs; chunks wait
    WRITING = "writing"  # admitted: the upload is locked, chunks go to it
    ANSWERED = "answered"  # an answer was decided without (more) writing; arriving chunks drop
    SETTLING = "settling"  # answered, body over (or answered early): the lock goes, then it fires
    ACCEPTING = "accepting"  # every byte written and the body over: finish() runs
    DONE = "done"  # the result is kept for the route


NEXT: Mapping[Phase, frozenset[Phase]] = {
    Phase.ADMITTING: frozenset({Phase.WRITING, Phase.ANSWERED}),
    Phase.WRITING: frozenset({Phase.ANSWERED, Phase.ACCEPTING}),
    Phase.ANSWERED: frozenset({Phase.SETTLING}),
    Phase.SETTLING: frozenset({Phase.DONE}),
    Phase.ACCEPTING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(Exception):
    """A body stream was told to move where its phase does not lead: a bug."""


class _Transport(Protocol):
    def pauseProducing(self) -> None: ...
    def resumeProducing(self) -> None: ...


class Gate(Protocol):
    """The request behind a :class:`BodyStream` (see ``channel.ReceiverRequest``)."""

    def go_ahead(self) -> None: ...
    def answer_now(self, error: HTTPError) -> bool: ...
    def end(self) -> None: ...


Write = Callable[[LockedUpload, list[bytes]], "Deferred[int]"]
Finish = Callable[[LockedUpload, bool], "Deferred[Any]"]
# Lets go of an upload the stream answered without finishing (blocking).
Abandon = Callable[[LockedUpload], None]


@define(eq=False)
class BodyStream:
    """One upload body on its way to disk.

    The owner calls :meth:`admitted` with the locked upload once admission is decided, or
    :meth:`answered` with the final result (a value, or a Failure such as a refusal) when the body
    is not to be written; chunks received before that wait, with the socket paused.  Chunks go to
    disk through ``write(upload, chunks)``, one call at a time; a failed write becomes the
    result.  When the body has ended (or the connection dropped) and every chunk is written,
    ``finish(upload, lost)`` runs and its result is what :meth:`result` gives.  A body that would
    run past the upload's length is refused with 413 and the bytes it wrote are truncated away.
    An upload answered without ``finish`` once it was admitted (a failed write, an overrun) is
    let go of by ``abandon(upload)`` on ``run`` before the answer: by default it is closed with
    what it holds (a tus upload is resumed later); a door whose uploads cannot be resumed
    removes it there.

    A refusal made at admission while the body is still arriving is answered through ``gate``
    at once, not after the whole body.  ``last_progress`` (``now()`` of the last byte received or
    written) tells a stalled writer from a live one; :meth:`released` fires once the stream no
    longer holds the upload's lock.
    """

    _run: BlockingRunner
    _transport: _Transport
    _write: Write
    _finish: Finish
    _gate: Gate | None = None
    _now: Callable[[], float] = lambda: 0.0
    _abandon: Abandon = LockedUpload.close
    # Shared by the bodies streaming at once (the intake's); a stream alone has its own.
    _budget: BodyBudget = field(factory=BodyBudget)
    phase: Phase = Phase.ADMITTING
    last_progress: float = 0.0
    # The connection's facts, as they come.
    _ended: bool = False
    _lost: bool = False
    _paused: bool = False
    # A write (or the truncation of an overrun) is running: one at a time.
    _writing: bool = False
    _upload: LockedUpload | None = None
    _start_offset: int = 0
    _received: int = 0
    _pending: list[bytes] = field(factory=list)
    _pending_bytes: int = 0
    # The answer decided without (more) writing (phase ANSWERED and after).
    _answer: object | None = None
    _early: bool = False
    _result: object = None
    _waiters: list[Deferred[Any]] = field(factory=list)
    _let_go: bool = False
    _release_waiters: list[Deferred[None]] = field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.last_progress = self._now()
        self._budget.streams += 1

    def _enter(self, phase: Phase) -> None:
        if phase not in NEXT[self.phase]:
            raise IllegalTransition(f"{self.phase.value} -> {phase.value}")
        self.phase = phase
        if phase is Phase.DONE:
            self._budget.streams -= 1

    @property
    def read_size(self) -> int:
        """The socket read size this body's connection should use now (its share)."""
        return self._budget.share()

    @property
    def _over(self) -> bool:
        return self._ended or self._lost

    # -- the owner's calls

    def admitted(self, upload: LockedUpload) -> None:
        self._enter(Phase.WRITING)
        self._upload = upload
        self._start_offset = upload.offset
        self.last_progress = self._now()
        if self._gate is not None and not self._over:
            self._gate.go_ahead()
        self._pump()

    def answered(self, result: object) -> None:
        self._enter(Phase.ANSWERED)
        self._answer = result
        self._drop_pending()
        self._pump()

    @property
    def completes(self) -> bool:
        """True once the bytes received (written or not yet) make the upload complete: the
        stream will go on to acceptance unless writing fails."""
        upload = self._upload
        return (
            upload is not None
            and self._answer is None
            and self._start_offset + self._received >= upload.info.size
        )

    def end(self) -> None:
        """Drop the request's connection; what it wrote is kept, then the lock is released."""
        if self._gate is not None:
            self._gate.end()

    def released(self) -> Deferred[None]:
        """Fires once this stream holds no lock on its upload any more."""
        if self._let_go:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._release_waiters.append(waiter)
        return waiter

    def result(self) -> Deferred[Any]:
        """The stream's final result (now or later); cancelling it does not affect the stream.

        The result is kept rather than pushed into one Deferred, so a request that never reaches
        its route (a dropped connection, a path no route matches) leaves no failure unobserved.
        """
        waiter: Deferred[Any] = Deferred()
        if self.phase is Phase.DONE:
            _deliver(waiter, self._result)
        else:
            self._waiters.append(waiter)
        return waiter

    # -- the connection's calls (BodySink)

    def chunk(self, data: bytes) -> None:
        if self.phase is not Phase.ADMITTING and self.phase is not Phase.WRITING:
            return  # answered: nobody wants the rest
        self.last_progress = self._now()
        self._received += len(data)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= self._budget.share() and not self._paused and not self._lost:
            self._paused = True
            self._transport.pauseProducing()
        self._pump()

    def body_ended(self) -> None:
        self._ended = True
        self._pump()

    def connection_lost(self) -> None:
        self._lost = True
        self._paused = False
        self._pump()

    # -- moving on

    def _pump(self) -> None:
        """Take the next step the phase allows, unless a write is running."""
        if self._writing:
            return
        if self.phase is Phase.WRITING:
            upload = self._upload
            assert upload is not None
            if self._pending:
                self._write_pending(upload)
            elif self._over:
                self._enter(Phase.ACCEPTING)
                self._finish(upload, self._lost).addBoth(self._finished)
        elif self.phase is Phase.ANSWERED:
            if self._over:
                self._settle()
            elif self._can_answer_now():
                self._early = True
                self._settle()

    def _write_pending(self, upload: LockedUpload) -> None:
        chunks, size = self._pending, self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        if upload.offset + size > upload.info.size:
            self._refuse_overrun(upload)
            return
        self._writing = True
        self._resume()
        self._write(upload, chunks).addBoth(self._written)

    def _written(self, result: object) -> None:
        self._writing = False
        self.last_progress = self._now()
        if isinstance(result, Failure):
            if not result.check(HTTPError, PoolStopped):
                log.error(
                    "writing upload {object_id} failed: {error}",
                    object_id=self._upload.info.upload_id if self._upload else None,
                    error=str(result.value),
                )
            if self.phase is Phase.WRITING:
                self._enter(Phase.ANSWERED)
                self._answer = result
            self._drop_pending()
        self._pump()

    def _refuse_overrun(self, upload: LockedUpload) -> None:
        self._enter(Phase.ANSWERED)
        self._answer = Failure(
            HTTPError(413, "the body would pass Upload-Length; nothing was stored")
        )
        self._drop_pending()
        self._writing = True
        self._run(upload.truncate, self._start_offset).addBoth(self._written)

    def _can_answer_now(self) -> bool:
        # Only refusals made at admission, before any byte of the body was written: after a
        # failure mid-body (a full disk) the client still gets its answer after the body, as
        # clients that do not read while they send (tuspy, requests) could not see it earlier.
        answer = self._answer
        return (
            self._gate is not None
            and self._upload is None
            and isinstance(answer, Failure)
            and answer.check(HTTPError) is not None
        )

    def _drop_pending(self) -> None:
        self._pending, self._pending_bytes = [], 0
        self._resume()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._transport.resumeProducing()

    def _settle(self) -> None:
        self._enter(Phase.SETTLING)
        upload, answer = self._upload, self._answer
        closing: Deferred[Any] = (
            self._run(self._abandon, upload) if upload is not None else succeed(None)
        )
        closing.addErrback(lambda f: None if _stopping(f) else log.failure("closing an upload", f))
        # The lock goes first, so a client retrying at once after the answer finds it free.
        closing.addCallback(self._release).addCallback(lambda _: self._fire(answer))

    def _finished(self, result: object) -> None:
        self._release()
        self._fire(result)

    def _release(self, _: object = None) -> None:
        self._let_go = True
        waiters, self._release_waiters = self._release_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _fire(self, result: object) -> None:
        if isinstance(result, Failure) and _stopping(result):
            log.info("an upload stream was cut short: the receiver is stopping")
            # The client resumes from the offset HEAD reports once the receiver is back.
            result = Failure(
                HTTPError(
                    503, "the receiver is stopping: resume the upload", (("Retry-After", "5"),)
                )
            )
        if isinstance(result, Failure) and not result.check(HTTPError):
            log.failure("upload stream ended badly", result)
            result = Failure(HTTPError(500, "internal error"))
        self._enter(Phase.DONE)
        self._result = result
        if self._early and not self._ended and self._gate is not None:
            assert isinstance(result, Failure) and isinstance(result.value, HTTPError)
            if self._gate.answer_now(result.value):
                return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.called:  # a waiter cancelled by its route (connection lost)
                _deliver(waiter, result)


def _stopping(failure: Failure) -> bool:
    """The process stops under the stream: its thread pools take no more work.  What was
    written stays; the upload's file and lock close with the process."""
    return failure.check(PoolStopped) is not None


def _deliver(waiter: Deferred[Any], result: object) -> None:
    if isinstance(result, Failure):
        waiter.errback(result)
    else:
        waiter.callback(result)


def body_stream(request: object) -> BodyStream:
    """The stream that wrote ``request``'s upload body (its ``body_sink``); 404 when it has
    none (only a route whose body a door opened has one)."""
    stream = getattr(request, "body_sink", None)
    if not isinstance(stream, BodyStream):
        raise HTTPError(404, "no such upload")
    return stream
