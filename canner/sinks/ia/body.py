"""The streaming request body: a local payload read in chunks off the reactor thread.

canner-deliver never touches the disk on the reactor thread (a failing disk would stall every
timer): :func:`open_payload` and every chunk read of :class:`FileProducer` run through the
injected :class:`~canner.blocking.BlockingRunner`.  One read is in flight at a time and none
starts while the consumer has paused the producer, so at most one chunk is in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from canner.blocking import BlockingRunner

log = Logger()


class LocalFileError(Exception):
    """The local artifact is missing, unreadable, or not the size its receipt says."""


def open_payload(path: Path) -> tuple[IO[bytes], int]:
    """Open ``path`` unbuffered for reading and return it with its size (blocking)."""
    stream = open(path, "rb", buffering=0)
    try:
        return cast(IO[bytes], stream), os.fstat(stream.fileno()).st_size
    except BaseException:
        stream.close()
        raise


@implementer(IBodyProducer)
class FileProducer:
    """Streams exactly ``length`` bytes of an open file, ``read_size`` at a time.

    Each read runs through ``run`` (a thread in production); the next one is scheduled on
    ``clock`` once the chunk is handed to the consumer, and none while paused.  ``on_progress(n)``
    is told about every chunk handed to the consumer.  A short or unreadable file fails the
    ``startProducing`` Deferred with :class:`LocalFileError`.  The producer owns ``stream``:
    :meth:`close` closes it through ``run`` once no read is in flight.
    """

    def __init__(
        self,
        stream: IO[bytes],
        length: int,
        clock: IReactorTime,
        run: BlockingRunner,
        on_progress: Callable[[int], None],
        read_size: int = 1 << 20,
    ) -> None:
        self.length = length
        self._stream = stream
        self._clock = clock
        self._run = run
        self._on_progress = on_progress
        self._read_size = read_size
        self._consumer: IConsumer | None = None
        self._done: Deferred[None] | None = None
        self._call: IDelayedCall | None = None
        self._reading = False
        self._held: bytes | None = None  # a chunk read while paused, written on resume
        self._paused = False
        self._stopped = False
        self._closing = False
        self._sent = 0

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        self._consumer = consumer
        self._done = Deferred()
        self._schedule()
        return self._done

    def pauseProducing(self) -> None:
        self._paused = True
        self._unschedule()

    def resumeProducing(self) -> None:
        self._paused = False
        held, self._held = self._held, None
        if held is not None:
            self._write(held)
        else:
            self._schedule()

    def stopProducing(self) -> None:
        # IBodyProducer: after stopProducing the startProducing Deferred need not fire.
        self._stopped = True
        self._held = None
        self._unschedule()

    def close(self) -> None:
        """Stop, and close the file through the runner once no read is in flight (never waits:
        a read stuck on a failing disk must not hold up the attempt's result)."""
        self.stopProducing()
        if not self._closing:
            self._closing = True
            if not self._reading:
                self._close_now()

    def _close_now(self) -> None:
        self._run(self._stream.close).addErrback(lambda f: log.failure("closing a payload file", f))

    def _schedule(self) -> None:
        if (
            self._call is None
            and not self._reading
            and not self._paused
            and not self._stopped
            and self._done is not None
        ):
            self._call = self._clock.callLater(0, self._step)

    def _unschedule(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _step(self) -> None:
        self._call = None
        if self._paused or self._stopped or self._done is None or self._done.called:
            return
        want = min(self._read_size, self.length - self._sent)
        if want <= 0:
            self._finish()
            return
        self._reading = True
        self._run(self._stream.read, want).addBoth(self._got, want)

    def _got(self, result: bytes | Failure, want: int) -> None:
        self._reading = False
        if self._closing:
            self._close_now()
        if self._stopped or self._done is None or self._done.called:
            return
        if isinstance(result, Failure):
            if not result.check(OSError, ValueError):
                self._fail(f"reading the local file failed: {result.getErrorMessage()}")
                log.failure("reading a payload file", result)
                return
            self._fail(f"reading the local file failed: {result.value}")
            return
        if not result:
            self._fail(f"the local file ended at {self._sent} of {self.length} bytes")
            return
        if self._paused:
            self._held = result
            return
        self._write(result)

    def _write(self, data: bytes) -> None:
        assert self._consumer is not None
        self._sent += len(data)
        self._consumer.write(data)
        self._on_progress(len(data))
        if self._sent >= self.length:
            self._finish()
            return
        self._schedule()

    def _finish(self) -> None:
        assert self._done is not None
        self._stopped = True
        self._done.callback(None)

    def _fail(self, reason: str) -> None:
        assert self._done is not None
        self._stopped = True
        self._done.errback(LocalFileError(reason))
