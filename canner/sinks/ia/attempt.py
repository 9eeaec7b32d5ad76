"""One delivery attempt to IA: the metadata lookup, pacing, and the PUT or multipart upload.

An :class:`_Attempt` owns the attempt's timers (the ``attempt_timeout`` cap, the no-progress
watchdog, the answer timeout) and its in-flight Deferred, so cancelling the attempt aborts the
transfer.  Everything it needs of the client arrives as one :class:`AttemptContext`; it never
reaches into :class:`~canner.sinks.ia.client.IAClient`.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

from attrs import define, frozen
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectionClosed, DNSLookupError
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from canner.blocking import BlockingRunner
from canner.sinks.base import Outcome, Verdict, report_parts
from canner.sinks.ia.body import FileProducer, LocalFileError, open_payload
from canner.sinks.ia.multipart import (
    Answer,
    AttemptEnded,
    FileRange,
    MultipartUpload,
    PartJournal,
)
from canner.sinks.ia.pacing import LimitReading, PutGate, pace
from canner.sinks.ia.wire import Lookup, RemoteFile, Unknown, classify
from canner.sinks.plan import ItemPlan
from canner.sinks.transport import describe_failure, first_headers, read_bounded

log = Logger()

T = TypeVar("T")


@frozen
class DeliveryResult:
    """What one :meth:`~canner.sinks.ia.client.IAClient.deliver` attempt came to.

    ``outcome.ok`` means the file is at IA (``already_present``: found by the metadata lookup, no
    PUT sent).  Otherwise ``outcome`` says whether to retry normally or flag for an operator.
    """

    outcome: Outcome
    already_present: bool = False
    bytes_sent: int = 0
    duration_s: float = 0.0
    status: int | None = None

    @property
    def delivered(self) -> bool:
        return self.outcome.ok


# Shared with the client's downloads: the redirects followed, and the bound of an error body.
REDIRECTS = frozenset({301, 302, 303, 307, 308})
ERROR_BODY_MAX = 64 << 10
# A ListParts page (up to 1000 parts) or another multipart answer.
MULTIPART_BODY_MAX = 4 << 20
# An attempt held back by IA's limits (near a ration, the allowed PUTs running) probes
# check_limit again when one of those PUTs ends, or after this many seconds.
PACE_RECHECK = 60.0


ReadLimit = Callable[[ItemPlan], Coroutine[Any, Any, LimitReading | None]]


@frozen(kw_only=True)
class AttemptContext:
    """What an attempt reads of its client: one account's connection, keys and limits.

    ``lookup`` is the metadata lookup of a plan's file; ``read_limit`` the ``check_limit``
    probe (None: the probe is off); ``redact`` removes the secret from a text; ``keeps_auth``
    says whether a URL may receive ``authorization``.  Files of at least ``multipart_threshold``
    bytes go up in parts recorded in ``journal`` (both needed for that).
    """

    http: HTTPClient
    clock: IReactorTime
    run: BlockingRunner
    s3_url: str
    user_agent: str
    authorization: str
    redact: Callable[[str], str]
    keeps_auth: Callable[[str], bool]
    lookup: Callable[[ItemPlan], Deferred[Lookup]]
    read_limit: ReadLimit | None
    gate: PutGate
    journal: PartJournal | None
    multipart_threshold: int | None
    multipart_part_size: int
    part_retry_delay: float
    max_redirects: int
    read_size: int
    no_progress_timeout: float
    answer_timeout: float
    attempt_timeout: float

    def uses_multipart(self, plan: ItemPlan) -> bool:
        return (
            self.journal is not None
            and self.multipart_threshold is not None
            and plan.size >= self.multipart_threshold
        )


def start_attempt(
    context: AttemptContext,
    plan: ItemPlan,
    path: Path,
    on_progress: Callable[[int], None] | None,
    overwrite: bool,
) -> Deferred[DeliveryResult]:
    """Start one delivery attempt of ``path`` to ``plan``'s destination (the contract is
    :meth:`~canner.sinks.ia.client.IAClient.deliver`'s)."""
    return _Attempt(context, plan, path, on_progress, overwrite).start()


def _local_failure(error: BaseException) -> LocalFileError | None:
    """The LocalFileError inside a RequestGenerationFailed, if the body producer failed."""
    if isinstance(error, LocalFileError):
        return error
    for reason in getattr(error, "reasons", None) or ():
        if isinstance(reason, Failure) and isinstance(reason.value, LocalFileError):
            return reason.value
    return None


@define(eq=False)
class _Attempt:
    """One run of :meth:`~canner.sinks.ia.client.IAClient.deliver`: owns the timers and the
    in-flight Deferred; reads nothing of the client but its :class:`AttemptContext`."""

    _context: AttemptContext
    _plan: ItemPlan
    _path: Path
    _on_progress: Callable[[int], None] | None = None
    _overwrite: bool = False
    _current: Deferred[Any] | None = None
    _abort_reason: str | None = None
    _cancelled: bool = False
    _cap: IDelayedCall | None = None
    _watchdog: IDelayedCall | None = None
    _answer: IDelayedCall | None = None
    _bytes_sent: int = 0
    _put_sent: int = 0
    _put_length: int = 0
    _capped: bool = False
    _started: float = 0.0
    _outer: Deferred[DeliveryResult] | None = None
    # Counted as running by the account's gate (left when the attempt ends).
    _gated: bool = False

    def start(self) -> Deferred[DeliveryResult]:
        clock = self._context.clock
        self._started = clock.seconds()
        self._outer = Deferred(self._cancel)
        self._cap = clock.callLater(self._context.attempt_timeout, self._cap_fired)
        inner = Deferred.fromCoroutine(self._run())
        inner.addBoth(self._finish)
        return self._outer

    def _finish(self, result: DeliveryResult | Failure) -> None:
        self._stop_timers()
        if self._gated:
            self._gated = False
            self._context.gate.leave(self._plan.identifier)
        outer = self._outer
        assert outer is not None
        if outer.called:
            # Cancelled: the caller already got CancelledError.
            if isinstance(result, Failure) and not result.check(CancelledError):
                log.failure("cancelled delivery attempt ended badly", result)
            return
        if isinstance(result, Failure):
            outer.errback(result)
        else:
            outer.callback(result)

    def _stop_timers(self) -> None:
        for call in (self._cap, self._watchdog, self._answer):
            if call is not None and call.active():
                call.cancel()
        self._cap = self._watchdog = self._answer = None

    def _cancel(self, outer: Deferred[DeliveryResult]) -> None:
        self._cancelled = True
        self._stop_timers()
        if self._current is not None:
            self._current.cancel()

    def _cap_fired(self) -> None:
        self._capped = True
        self._abort(f"attempt exceeded {self._context.attempt_timeout:g}s")

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` on the clock, as cancellable as a request."""
        try:
            await self._wait(deferLater(self._context.clock, seconds, lambda: None))
        except CancelledError:
            if self._cancelled:
                raise
            raise AttemptEnded(
                Outcome(Verdict.TRANSIENT, self._abort_reason or "interrupted")
            ) from None

    def _abort(self, reason: str) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason
        if self._current is not None:
            self._current.cancel()

    async def _wait(self, d: Deferred[T]) -> T:
        self._current = d
        try:
            return await d
        finally:
            self._current = None

    def _interrupted(self) -> DeliveryResult | None:
        if self._cancelled:
            raise CancelledError()
        if self._abort_reason is not None:
            return self._result(Outcome(Verdict.TRANSIENT, self._abort_reason))
        return None

    def _result(self, outcome: Outcome, **kwargs: Any) -> DeliveryResult:
        return DeliveryResult(
            outcome=Outcome(
                outcome.verdict, self._context.redact(outcome.reason), outcome.retry_after
            ),
            bytes_sent=self._bytes_sent,
            duration_s=self._context.clock.seconds() - self._started,
            **kwargs,
        )

    async def _run(self) -> DeliveryResult:
        context, plan = self._context, self._plan
        try:
            remote = await self._wait(context.lookup(plan))
        except CancelledError:
            remote = Unknown("lookup cancelled")
        if (stop := self._interrupted()) is not None:
            return stop
        listed = isinstance(remote, RemoteFile) and remote.matches(plan.size, plan.content_md5)
        if listed and self._overwrite:
            log.warn(
                "{object_id} is listed at {identifier}/{remote_name}, but a read-back found other"
                " bytes there: uploading it again",
                object_id=plan.object_id,
                identifier=plan.identifier,
                remote_name=plan.remote_name,
            )
        elif listed:
            log.info(
                "{object_id} is already at {identifier}/{remote_name}; no upload needed",
                object_id=plan.object_id,
                identifier=plan.identifier,
                remote_name=plan.remote_name,
            )
            if context.journal is not None:
                # A multipart upload completed but not yet recorded (a crash): its journal goes.
                await context.run(context.journal.delete, plan.identifier, plan.remote_name)
            return self._result(Outcome(Verdict.SUCCESS, "already present"), already_present=True)
        if isinstance(remote, Unknown) and remote.needs_operator:
            return self._result(Outcome(Verdict.OPERATOR, remote.reason))
        if context.read_limit is not None:
            if (held := await self._paced(context.read_limit)) is not None:
                return held
        url = context.s3_url.rstrip("/") + plan.path
        if context.uses_multipart(plan):
            return await self._multipart(url)
        for _hop in range(context.max_redirects + 1):
            answer = await self._put_once(url)
            if isinstance(answer, DeliveryResult):
                return answer
            status, headers, excerpt = answer
            location = headers.get("location")
            if status in REDIRECTS and location:
                target = urljoin(url, location)
                if urlsplit(target).scheme not in ("http", "https"):
                    break
                log.info(
                    "PUT for {identifier} redirected ({status})",
                    identifier=plan.identifier,
                    status=status,
                )
                url = target
                continue
            outcome = classify(status, headers, excerpt)
            if outcome.ok and context.journal is not None:
                # A multipart upload begun before multipart was turned off is of no use now.
                await context.run(context.journal.delete, plan.identifier, plan.remote_name)
            return self._reported(outcome, status, "PUT", "")
        return self._result(Outcome(Verdict.TRANSIENT, "too many redirects"))

    def _reported(self, outcome: Outcome, status: int | None, how: str, way: str) -> DeliveryResult:
        """Log the upload's outcome (``how`` it went, ``way`` said after a success) and make the
        attempt's result."""
        context, plan = self._context, self._plan
        if outcome.ok:
            log.info(
                "uploaded {object_id} to {identifier}/{remote_name}{way}",
                object_id=plan.object_id,
                identifier=plan.identifier,
                remote_name=plan.remote_name,
                way=way,
                size=plan.size,
                duration_s=context.clock.seconds() - self._started,
            )
        else:
            log.warn(
                "{how} of {object_id} to {identifier} failed: {error}",
                how=how,
                object_id=plan.object_id,
                identifier=plan.identifier,
                error=context.redact(outcome.reason),
                needs_operator=outcome.needs_operator,
            )
        return self._result(outcome, status=status)

    async def _paced(self, read_limit: ReadLimit) -> DeliveryResult | None:
        """Pass the account's gate: probe ``check_limit`` and start the PUT while IA's limits allow
        one more to this item and account (None); over a limit, end the attempt as a SlowDown
        (the retry resumes by itself); near one, with the allowed PUTs running, wait for one to
        end (or :data:`PACE_RECHECK`) and probe again."""
        context, plan = self._context, self._plan
        while True:
            try:
                reading = await self._wait(Deferred.fromCoroutine(read_limit(plan)))
            except CancelledError:
                reading = None
            if (stop := self._interrupted()) is not None:
                return stop
            allowed = pace(reading)
            if allowed.stopped:
                log.warn(
                    "IA's limits allow no upload now; not uploading: {reason}",
                    identifier=plan.identifier,
                    reason=allowed.reason,
                )
                return self._result(Outcome(Verdict.TRANSIENT, f"503 SlowDown: {allowed.reason}"))
            if context.gate.enter(plan.identifier, allowed):
                self._gated = True
                return None
            log.info(
                "pacing {object_id} to {identifier}: {reason}; waiting for a running upload",
                object_id=plan.object_id,
                identifier=plan.identifier,
                reason=allowed.reason,
            )
            try:
                await self._wait(context.gate.room_or_timeout(PACE_RECHECK))
            except CancelledError:
                pass
            if (stop := self._interrupted()) is not None:
                return stop

    async def _multipart(self, url: str) -> DeliveryResult:
        context, plan = self._context, self._plan
        assert context.journal is not None
        upload = MultipartUpload(
            plan=plan,
            path=self._path,
            url=url,
            part_size=context.multipart_part_size,
            journal=context.journal,
            exchange=self._exchange_d,
            run_blocking=context.run,
            pause=self._pause_d,
            on_part=self._part_done,
            retry_delay=context.part_retry_delay,
        )
        outcome, status = await upload.run()
        return self._reported(outcome, status, "multipart upload", " in parts")

    def _exchange_d(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | FileRange
    ) -> Deferred[Answer | Outcome]:
        return Deferred.fromCoroutine(self._exchange(method, url, headers, body))

    def _pause_d(self, seconds: float) -> Deferred[None]:
        return Deferred.fromCoroutine(self._pause(seconds))

    def _part_done(self, done: int, parts: int, done_bytes: int) -> None:
        report_parts(self._on_progress, done, parts, done_bytes)
        if done == 0 or self._bytes_sent == 0:
            return  # the upload (re)starts: nothing to report yet
        elapsed = self._context.clock.seconds() - self._started
        rate = self._bytes_sent / elapsed if elapsed > 0 else 0.0
        left = self._plan.size - done_bytes
        log.info(
            "part {part_count} of {parts} of {object_id} is at IA",
            object_id=self._plan.object_id,
            part_count=done,
            parts=parts,
            bytes_done=done_bytes,
            size=self._plan.size,
            rate_bps=round(rate),
            eta_s=round(left / rate) if rate > 0 else None,
        )

    async def _put_once(self, url: str) -> DeliveryResult | tuple[int, dict[str, str], bytes]:
        answer = await self._request_once(
            "PUT", url, list(self._plan.headers), FileRange(0, self._plan.size), ERROR_BODY_MAX
        )
        if isinstance(answer, Outcome):
            return self._result(answer)
        return answer.status, dict(answer.headers), answer.body

    async def _exchange(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | FileRange
    ) -> Answer | Outcome:
        """A multipart request (see :class:`~canner.sinks.ia.multipart.Exchange`): redirects
        followed, the watchdog's verdict returned (the part may be tried again), the cap's
        raised."""
        for _hop in range(self._context.max_redirects + 1):
            if self._capped:
                raise AttemptEnded(Outcome(Verdict.TRANSIENT, self._abort_reason or "capped"))
            # A watchdog that fired for an earlier request does not end this one.
            self._abort_reason = None
            answer = await self._request_once(method, url, headers, body, MULTIPART_BODY_MAX)
            if self._capped:
                raise AttemptEnded(Outcome(Verdict.TRANSIENT, self._abort_reason or "capped"))
            if isinstance(answer, Outcome):
                return answer
            location = answer.headers.get("location")
            if answer.status not in REDIRECTS or not location:
                return answer
            url = urljoin(url, location)
            if urlsplit(url).scheme not in ("http", "https"):
                return Outcome(Verdict.TRANSIENT, f"{method} redirected to a non-HTTP URL")
        return Outcome(Verdict.TRANSIENT, "too many redirects")

    async def _request_once(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | FileRange,
        limit: int,
    ) -> Answer | Outcome:
        """One request whose body is ``body`` (a payload range streams from disk, watched for
        progress); the answer with the first ``limit`` bytes of its body, or the Outcome that
        ended it.  Fails only with ``CancelledError``."""
        context, plan = self._context, self._plan
        producer: FileProducer | None = None
        if isinstance(body, FileRange):
            try:
                # Off the reactor thread: a failing disk must not stall every timer.
                stream, actual = await context.run(open_payload, self._path)
            except OSError as e:
                return Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}")
            if body.offset:
                try:
                    await context.run(stream.seek, body.offset)
                except OSError as e:
                    stream.close()
                    return Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}")
            producer = FileProducer(
                stream, body.length, context.clock, context.run, self._progress, context.read_size
            )
        try:
            if (stop := self._interrupted()) is not None:
                return stop.outcome
            if producer is not None and actual != plan.size:
                return Outcome(
                    Verdict.OPERATOR, f"local file is {actual} bytes, its receipt says {plan.size}"
                )
            request_headers = Headers()
            for name, value in headers:
                request_headers.addRawHeader(name.encode("ascii"), value.encode("ascii"))
            request_headers.setRawHeaders(b"user-agent", [context.user_agent.encode("ascii")])
            if context.keeps_auth(url):
                request_headers.setRawHeaders(b"authorization", [context.authorization.encode()])
            self._put_sent = 0
            if producer is not None:
                self._put_length = body.length if isinstance(body, FileRange) else 0
                self._arm(watchdog=True)
                data: Any = producer
            else:
                self._arm(answer=True)
                data = body if body or method in ("POST", "PUT") else None
            request = context.http.request(
                method,
                url,
                headers=request_headers,
                data=data,
                allow_redirects=False,
                unbuffered=True,
            )
            try:
                response = await self._wait(request)
                # Headers are in: from here on only the answer timer runs.
                self._arm(answer=True)
                answer, _ = await self._wait(
                    read_bounded(response, limit, context.answer_timeout, context.clock)
                )
            except Exception as e:
                if (stop := self._interrupted()) is not None:
                    return stop.outcome
                local = _local_failure(e)
                if local is not None:
                    return Outcome(Verdict.OPERATOR, str(local))
                if not isinstance(
                    e, (ConnectError, DNSLookupError, ConnectionClosed, TimeoutError)
                ) and not type(e).__module__.startswith("twisted.web"):
                    log.failure(
                        "unexpected failure uploading {object_id}",
                        Failure(e),
                        object_id=plan.object_id,
                    )
                return Outcome(Verdict.TRANSIENT, describe_failure(e, method))
            finally:
                self._disarm()
            if (stop := self._interrupted()) is not None:
                return stop.outcome
            return Answer(response.code, first_headers(response.headers), answer)
        finally:
            if producer is not None:
                producer.close()

    def _progress(self, n: int) -> None:
        self._bytes_sent += n
        self._put_sent += n
        if self._on_progress is not None:
            self._on_progress(n)
        if self._put_sent >= self._put_length:
            # The last byte is with the transport: wait for the answer, not for progress.
            self._arm(answer=True)
        elif self._watchdog is not None and self._watchdog.active():
            self._watchdog.reset(self._context.no_progress_timeout)

    def _arm(self, watchdog: bool = False, answer: bool = False) -> None:
        clock = self._context.clock
        if watchdog:
            self._disarm()
            timeout = self._context.no_progress_timeout
            self._watchdog = clock.callLater(
                timeout, self._abort, f"no upload progress for {timeout:g}s"
            )
        if answer and self._answer is None:
            self._disarm(answer=False)
            timeout = self._context.answer_timeout
            self._answer = clock.callLater(
                timeout, self._abort, f"no answer within {timeout:g}s of the last byte"
            )

    def _disarm(self, answer: bool = True) -> None:
        """Cancel the watchdog, and the answer timer too unless ``answer`` is False."""
        if self._watchdog is not None:
            if self._watchdog.active():
                self._watchdog.cancel()
            self._watchdog = None
        if answer and self._answer is not None:
            if self._answer.active():
                self._answer.cancel()
            self._answer = None
