"""The Internet Archive sink: one project's objects PUT to IA-S3, verified by the metadata API.

:class:`IASink` talks HTTP through an injected treq ``HTTPClient`` and clock: it looks the remote
file up, probes ``check_limit``, and PUTs the file streaming from disk (read in threads through the
injected runner), cancellable, with a no-progress watchdog and bounded response reads.
:class:`IADeliverySink` adapts it to the :class:`~canner.sinks.base.Sink` protocol: it plans the
destination from stable row values only (so a retry always resolves to the same item and name),
maps the attempt's outcome to ``Delivered`` or ``DeliveryFailed``, and verifies a delivered row
against IA's metadata API.  The rules are ``docs/reference/internet-archive.md``'s.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import quote, urljoin, urlsplit

from attrs import Factory, define, evolve, field, frozen
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectionClosed, DNSLookupError
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse

from canner.blocking import BlockingRunner
from canner.config import ConfigError
from canner.observe import Destination
from canner.sinks.base import (
    Delivered,
    DeliveryFailed,
    Outcome,
    RemoteCheck,
    Verdict,
    report_parts,
)
from canner.sinks.ia.body import FileProducer, LocalFileError, open_payload
from canner.sinks.ia.config import DEFAULT_PART_SIZE, IADelivery
from canner.sinks.ia.credentials import (
    Credentials,
    CredentialsError,
    load_credentials,
    loose_permissions,
    redact,
)
from canner.sinks.ia.multipart import (
    Answer,
    AttemptEnded,
    FileRange,
    MultipartUpload,
    PartJournal,
)
from canner.sinks.ia.pacing import LimitReading, PutGate, pace, parse_check_limit
from canner.sinks.ia.readback import (
    ReadBack,
    choose_ranges,
    describe,
    parse_content_range,
    read_local,
)
from canner.sinks.ia.wire import (
    Lookup,
    RemoteFile,
    Unknown,
    classify,
    failure_class,
    parse_metadata,
)
from canner.sinks.plan import ItemPlan, is_loopback
from canner.sinks.transport import (
    DIGEST_BATCH,
    canner_user_agent,
    describe_failure,
    discard,
    first_headers,
    read_bounded,
    read_digest,
)

log = Logger()

T = TypeVar("T")


@frozen
class DeliveryResult:
    """What one :meth:`IASink.deliver` attempt came to.

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


_REDIRECTS = frozenset({301, 302, 303, 307, 308})
METADATA_BODY_MAX = 32 << 20
ERROR_BODY_MAX = 64 << 10
# A ListParts page (up to 1000 parts) or another multipart answer.
MULTIPART_BODY_MAX = 4 << 20
# An attempt held back by IA's limits (near a ration, the allowed PUTs running) probes
# check_limit again when one of those PUTs ends, or after this many seconds.
PACE_RECHECK = 60.0


@define(eq=False, kw_only=True)
class IASink:
    """Delivers planned objects to one IA account over an injected treq ``HTTPClient``.

    ``s3_url`` and ``metadata_url`` are the base URLs of a project's delivery config.  Times are
    seconds on ``clock``.  The sink holds no per-object state; attempts may run concurrently.
    """

    _http: HTTPClient
    _clock: IReactorTime
    _credentials: Credentials
    _s3_url: str
    _metadata_url: str
    _run: BlockingRunner
    check_limit: bool = True
    no_progress_timeout: float = 900.0
    answer_timeout: float = 1800.0
    attempt_timeout: float = 24 * 3600.0
    request_timeout: float = 120.0
    max_redirects: int = 3
    read_size: int = 1 << 20
    # A whole-file read-back hashes this many bytes per job on ``_run``.
    digest_batch: int = DIGEST_BATCH
    user_agent: str = field(factory=canner_user_agent)
    # Base of the download URLs the read-back uses (None: metadata_url, as on archive.org).
    download_url: str | None = None
    random: Callable[[], float] = random.random
    # Files of at least ``multipart_threshold`` bytes go up as resumable multipart uploads
    # (None: never), their parts recorded in ``journal`` (required then).
    multipart_threshold: int | None = None
    multipart_part_size: int = DEFAULT_PART_SIZE
    journal: PartJournal | None = None
    part_retry_delay: float = 1.0
    # The PUTs running to this sink's account, paced by check_limit (canner.sinks.ia.pacing); the
    # sinks of projects that share IA keys share it (internet_archive_sink).
    gate: PutGate = field(default=Factory(lambda self: PutGate(self._clock), takes_self=True))

    @classmethod
    def for_delivery(
        cls,
        delivery: IADelivery,
        http: HTTPClient,
        clock: IReactorTime,
        run: BlockingRunner,
        **kwargs: Any,
    ) -> IASink:
        """A sink for one project's delivery config; reads its credentials (blocking)."""
        return cls(
            http=http,
            clock=clock,
            credentials=load_credentials(delivery.credentials),
            s3_url=delivery.s3_url,
            metadata_url=delivery.metadata_url,
            run=run,
            **{
                "download_url": delivery.download_url,
                "multipart_threshold": delivery.multipart_threshold,
                "multipart_part_size": delivery.multipart_part_size,
                **kwargs,
            },
        )

    @property
    def account(self) -> str:
        """The IA account (access key) this sink uploads as."""
        return self._credentials.access

    def remote_file(self, plan: ItemPlan) -> Deferred[Lookup]:
        """Look the planned file up in the metadata API (bounded by ``request_timeout``).

        Fires with the :class:`RemoteFile`, ``None`` when the item or the file is absent (or not
        visible yet), or :class:`Unknown` when the lookup failed.  Fails only with
        ``CancelledError`` when cancelled.
        """
        return self.lookup(plan.identifier, plan.remote_name)

    def lookup(self, identifier: str, remote_name: str) -> Deferred[Lookup]:
        """:meth:`remote_file` by name, e.g. for a delivered row's recorded destination."""
        return Deferred.fromCoroutine(self._lookup(identifier, remote_name))

    def deliver(
        self,
        plan: ItemPlan,
        path: Path,
        on_progress: Callable[[int], None] | None = None,
        *,
        overwrite: bool = False,
    ) -> Deferred[DeliveryResult]:
        """One delivery attempt of the file at ``path`` to ``plan``'s destination.

        Skips the upload when the metadata API already shows the file with the plan's size and
        MD5, unless ``overwrite`` (a read-back found IA serving other bytes); probes
        ``check_limit`` (when enabled); then PUTs the file, streaming, following a few
        redirects.  Fires with a :class:`DeliveryResult` for every I/O outcome, including the
        watchdog, the answer timeout and the ``attempt_timeout`` cap (all transient).
        Cancelling the returned Deferred aborts the transfer; it then fails with
        ``CancelledError`` and nothing is to be recorded but a retry.  ``on_progress(n)`` is
        told about each chunk of payload handed to the connection.
        """
        attempt = _Attempt(self, plan, path, on_progress, overwrite)
        return attempt.start()

    def read_back(
        self, identifier: str, remote_name: str, path: Path, size: int, budget: int
    ) -> Deferred[ReadBack]:
        """Fetch a few random byte ranges (``budget`` bytes in all) of the remote file through
        its download URL, following IA's redirect to the datanode, and compare them with the
        local payload at ``path``.  Fires with a :class:`ReadBack` for every I/O outcome; fails
        only with ``CancelledError``."""
        return Deferred.fromCoroutine(self._read_back(identifier, remote_name, path, size, budget))

    def read_back_all(
        self, identifier: str, remote_name: str, size: int, md5: str
    ) -> Deferred[ReadBack]:
        """Download the whole remote file like :meth:`read_back` does its ranges, and compare
        its MD5 with ``md5`` (the local copy's) and its length with ``size``.

        The body streams: it is hashed as it arrives, in batches on the blocking runner, and
        never held whole.  No byte for ``no_progress_timeout`` seconds, or a download longer
        than ``attempt_timeout``, is a transient failure.  Fires with a :class:`ReadBack` for
        every I/O outcome (``mismatch`` when IA serves other bytes); fails only with
        ``CancelledError``.
        """
        return Deferred.fromCoroutine(self._read_back_all(identifier, remote_name, size, md5))

    def _download_url(self, identifier: str, remote_name: str) -> str:
        base = (self.download_url or self._metadata_url).rstrip("/")
        return f"{base}/download/{quote(identifier, safe='')}/{quote(remote_name, safe='/')}"

    async def _read_back(
        self, identifier: str, remote_name: str, path: Path, size: int, budget: int
    ) -> ReadBack:
        ranges = choose_ranges(size, budget, self.random)
        if not ranges:
            return ReadBack(True)
        try:
            local = await self._run(read_local, path, ranges)
        except FileNotFoundError:
            # Nothing left to purge, and nothing to compare with: the metadata has to do.
            log.warn(
                "no local payload to read {identifier}/{remote_name} back against",
                identifier=identifier,
                remote_name=remote_name,
            )
            return ReadBack(True)
        except OSError as e:
            return ReadBack(False, f"read-back: local payload unreadable: {e.strerror or e}")
        url = self._download_url(identifier, remote_name)
        differ: list[tuple[int, int]] = []
        for (first, last), expected in zip(ranges, local, strict=True):
            served = await self._fetch_range(url, first, last, size)
            if isinstance(served, ReadBack):
                return served
            if served != expected:
                differ.append((first, last))
        if differ:
            return ReadBack(
                False,
                f"read-back: IA serves other bytes than the local payload at offsets"
                f" {describe(differ)} (of {describe(ranges)}), though its metadata lists the"
                " right size and MD5",
                mismatch=True,
            )
        return ReadBack(True)

    async def _read_back_all(
        self, identifier: str, remote_name: str, size: int, md5: str
    ) -> ReadBack:
        where = "read-back of the whole file"
        try:
            response = await self._download(
                self._download_url(identifier, remote_name), self._plain_headers(), where
            )
            if isinstance(response, ReadBack):
                return response
            if response.code != 200:
                await read_bounded(response, ERROR_BODY_MAX, self.request_timeout, self._clock)
                return _refused(where, response.code)
            if response.length != UNKNOWN_LENGTH and response.length != size:
                discard(response)
                return ReadBack(
                    False,
                    f"{where}: IA serves a {response.length}-byte file, its receipt says {size}",
                    mismatch=True,
                )
            body = await read_digest(
                response,
                limit=size,
                run=self._run,
                clock=self._clock,
                idle=self.no_progress_timeout,
                batch=self.digest_batch,
            ).addTimeout(self.attempt_timeout, self._clock)
        except CancelledError:
            raise
        except Exception as e:
            return ReadBack(False, self._redact(describe_failure(e, where)))
        if body.cut or body.size != size:
            served = f"more than {size}" if body.cut else str(body.size)
            return ReadBack(
                False, f"{where}: IA served {served} bytes, its receipt says {size}", mismatch=True
            )
        if body.md5 != md5:
            return ReadBack(
                False,
                f"read-back: the {size} bytes IA serves have MD5 {body.md5}, the local copy's is"
                f" {md5}, though its metadata lists the right size and MD5",
                mismatch=True,
            )
        return ReadBack(True)

    async def _download(self, url: str, headers: Headers, where: str) -> IResponse | ReadBack:
        """GET ``url``, following IA's redirects (to the datanode); the final response, its body
        unread, or why there is none.  Each request is bounded by ``request_timeout``; network
        failures raise."""
        # No authorization header: downloads of access-restricted files need a logged-in
        # cookie, not the IA-S3 keys, so the secret would travel for nothing.
        for _hop in range(self.max_redirects + 1):
            response: IResponse = await self._http.get(
                url, headers=headers, allow_redirects=False, unbuffered=True
            ).addTimeout(self.request_timeout, self._clock)
            location = first_headers(response.headers).get("location")
            if response.code not in _REDIRECTS or not location:
                return response
            await read_bounded(response, ERROR_BODY_MAX, self.request_timeout, self._clock)
            url = urljoin(url, location)
            if urlsplit(url).scheme not in ("http", "https"):
                return ReadBack(False, f"{where}: redirected to a non-HTTP URL")
        return ReadBack(False, f"{where}: too many redirects")

    async def _fetch_range(self, url: str, first: int, last: int, size: int) -> bytes | ReadBack:
        """Bytes ``first..last`` of the file at ``url``, or why not."""
        span = last - first + 1
        headers = self._plain_headers()
        headers.setRawHeaders(b"range", [f"bytes={first}-{last}".encode("ascii")])
        where = f"read-back of bytes {first}-{last}"
        try:
            response = await self._download(url, headers, where)
            if isinstance(response, ReadBack):
                return response
            body, truncated = await read_bounded(response, span, self.request_timeout, self._clock)
        except CancelledError:
            raise
        except Exception as e:
            return ReadBack(False, self._redact(describe_failure(e, where)))
        code = response.code
        if code == 416:
            return ReadBack(
                False, f"{where}: IA says its copy has no byte {first} (416)", mismatch=True
            )
        if code == 200 and (first, last) != (0, size - 1):
            return ReadBack(False, f"{where}: the download ignored the Range header (200)")
        if code == 206:
            got = parse_content_range(first_headers(response.headers).get("content-range"))
            if got is not None and got[2] is not None and got[2] != size:
                return ReadBack(
                    False,
                    f"{where}: IA serves a {got[2]}-byte file, its receipt says {size}",
                    mismatch=True,
                )
            if got is None or got[:2] != (first, last):
                return ReadBack(False, f"{where}: unexpected Content-Range {got}")
        elif code != 200:
            return _refused(where, code)
        if len(body) != span and not truncated:
            return ReadBack(False, f"{where}: {len(body)} bytes arrived, not {span}")
        return body

    # -- helpers used by _Attempt ----------------------------------------------------------

    def _redact(self, text: str) -> str:
        return redact(text, self._credentials.secret)

    def uses_multipart(self, plan: ItemPlan) -> bool:
        return (
            self.journal is not None
            and self.multipart_threshold is not None
            and plan.size >= self.multipart_threshold
        )

    async def _lookup(self, identifier: str, remote_name: str) -> Lookup:
        url = self._metadata_url.rstrip("/") + "/metadata/" + quote(identifier, safe="")
        started = self._clock.seconds()
        try:
            response = await self._http.get(
                url, headers=self._plain_headers(), unbuffered=True
            ).addTimeout(self.request_timeout, self._clock)
            remaining = max(1.0, self.request_timeout - (self._clock.seconds() - started))
            body, truncated = await read_bounded(
                response, METADATA_BODY_MAX, remaining, self._clock
            )
        except CancelledError:
            raise
        except Exception as e:
            result: Lookup = Unknown(self._redact(describe_failure(e, "metadata lookup")))
        else:
            if response.code != 200:
                result = Unknown(f"metadata API answered {response.code}")
            elif truncated:
                result = Unknown(f"metadata API answer is larger than {METADATA_BODY_MAX} bytes")
            else:
                result = parse_metadata(body, remote_name)
        if isinstance(result, Unknown):
            log.warn(
                "metadata lookup for {identifier} failed: {error}",
                identifier=identifier,
                error=result.reason,
            )
        return result

    async def read_limit(self, plan: ItemPlan) -> LimitReading | None:
        """What ``check_limit`` says of ``plan``'s item and this account; None when the probe
        failed or said nothing usable (which never holds an upload back)."""
        query = (
            "?check_limit=1&accesskey="
            + quote(self._credentials.access, safe="")
            + "&bucket="
            + quote(plan.identifier, safe="")
        )
        url = self._s3_url.rstrip("/") + "/" + query
        try:
            response = await self._http.get(
                url, headers=self._plain_headers(), unbuffered=True
            ).addTimeout(self.request_timeout, self._clock)
            body, _ = await read_bounded(
                response, ERROR_BODY_MAX, self.request_timeout, self._clock
            )
            doc = json.loads(body) if response.code == 200 else None
        except CancelledError:
            raise
        except Exception as e:
            log.warn(
                "check_limit for {identifier} failed, uploading anyway: {error}",
                identifier=plan.identifier,
                error=self._redact(describe_failure(e, "check_limit")),
            )
            return None
        if not isinstance(doc, dict) or ("over_limit" not in doc and "detail" not in doc):
            log.warn(
                "check_limit for {identifier} gave no verdict, uploading anyway",
                identifier=plan.identifier,
            )
            return None
        return parse_check_limit(doc)

    def _plain_headers(self) -> Headers:
        return Headers({b"user-agent": [self.user_agent.encode("ascii")]})

    def _keeps_auth(self, url: str) -> bool:
        """Send the secret only to the configured S3 host or IA's own hosts, never in clear."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme != "https" and not is_loopback(host):
            return False
        own = urlsplit(self._s3_url).hostname or ""
        return host == own or host == "archive.org" or host.endswith(".archive.org")


def _refused(where: str, code: int) -> ReadBack:
    """A download that answered ``code`` instead of the file's bytes."""
    if code in (401, 403):
        return ReadBack(
            False,
            f"{where}: the download was refused ({code}); the item may be access-restricted"
            " for these keys",
            needs_operator=True,
        )
    return ReadBack(False, f"{where}: download answered {code}")


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
    """One run of :meth:`IASink.deliver`: owns the timers and the in-flight Deferred."""

    _sink: IASink
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
    # Counted as running by the sink's gate (left when the attempt ends).
    _gated: bool = False

    def start(self) -> Deferred[DeliveryResult]:
        clock = self._sink._clock
        self._started = clock.seconds()
        self._outer = Deferred(self._cancel)
        self._cap = clock.callLater(self._sink.attempt_timeout, self._cap_fired)
        inner = Deferred.fromCoroutine(self._run())
        inner.addBoth(self._finish)
        return self._outer

    def _finish(self, result: DeliveryResult | Failure) -> None:
        self._stop_timers()
        if self._gated:
            self._gated = False
            self._sink.gate.leave(self._plan.identifier)
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
        self._abort(f"attempt exceeded {self._sink.attempt_timeout:g}s")

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` on the clock, as cancellable as a request."""
        try:
            await self._wait(deferLater(self._sink._clock, seconds, lambda: None))
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
                outcome.verdict, self._sink._redact(outcome.reason), outcome.retry_after
            ),
            bytes_sent=self._bytes_sent,
            duration_s=self._sink._clock.seconds() - self._started,
            **kwargs,
        )

    async def _run(self) -> DeliveryResult:
        sink, plan = self._sink, self._plan
        try:
            remote = await self._wait(sink.remote_file(plan))
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
            if sink.journal is not None:
                # A multipart upload completed but not yet recorded (a crash): its journal goes.
                await sink._run(sink.journal.delete, plan.identifier, plan.remote_name)
            return self._result(Outcome(Verdict.SUCCESS, "already present"), already_present=True)
        if isinstance(remote, Unknown) and remote.needs_operator:
            return self._result(Outcome(Verdict.OPERATOR, remote.reason))
        if sink.check_limit and (held := await self._paced()) is not None:
            return held
        url = sink._s3_url.rstrip("/") + plan.path
        if sink.uses_multipart(plan):
            return await self._multipart(url)
        for _hop in range(sink.max_redirects + 1):
            answer = await self._put_once(url)
            if isinstance(answer, DeliveryResult):
                return answer
            status, headers, excerpt = answer
            location = headers.get("location")
            if status in _REDIRECTS and location:
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
            if outcome.ok and sink.journal is not None:
                # A multipart upload begun before multipart was turned off is of no use now.
                await sink._run(sink.journal.delete, plan.identifier, plan.remote_name)
            return self._reported(outcome, status, "PUT", "")
        return self._result(Outcome(Verdict.TRANSIENT, "too many redirects"))

    def _reported(self, outcome: Outcome, status: int | None, how: str, way: str) -> DeliveryResult:
        """Log the upload's outcome (``how`` it went, ``way`` said after a success) and make the
        attempt's result."""
        sink, plan = self._sink, self._plan
        if outcome.ok:
            log.info(
                "uploaded {object_id} to {identifier}/{remote_name}{way}",
                object_id=plan.object_id,
                identifier=plan.identifier,
                remote_name=plan.remote_name,
                way=way,
                size=plan.size,
                duration_s=sink._clock.seconds() - self._started,
            )
        else:
            log.warn(
                "{how} of {object_id} to {identifier} failed: {error}",
                how=how,
                object_id=plan.object_id,
                identifier=plan.identifier,
                error=sink._redact(outcome.reason),
                needs_operator=outcome.needs_operator,
            )
        return self._result(outcome, status=status)

    async def _paced(self) -> DeliveryResult | None:
        """Pass the sink's gate: probe ``check_limit`` and start the PUT while IA's limits allow
        one more to this item and account (None); over a limit, end the attempt as a SlowDown
        (the retry resumes by itself); near one, with the allowed PUTs running, wait for one to
        end (or :data:`PACE_RECHECK`) and probe again."""
        sink, plan = self._sink, self._plan
        while True:
            try:
                reading = await self._wait(Deferred.fromCoroutine(sink.read_limit(plan)))
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
            if sink.gate.enter(plan.identifier, allowed):
                self._gated = True
                return None
            log.info(
                "pacing {object_id} to {identifier}: {reason}; waiting for a running upload",
                object_id=plan.object_id,
                identifier=plan.identifier,
                reason=allowed.reason,
            )
            try:
                await self._wait(sink.gate.room_or_timeout(PACE_RECHECK))
            except CancelledError:
                pass
            if (stop := self._interrupted()) is not None:
                return stop

    async def _multipart(self, url: str) -> DeliveryResult:
        sink, plan = self._sink, self._plan
        assert sink.journal is not None
        upload = MultipartUpload(
            plan=plan,
            path=self._path,
            url=url,
            part_size=sink.multipart_part_size,
            journal=sink.journal,
            exchange=self._exchange_d,
            run_blocking=sink._run,
            pause=self._pause_d,
            on_part=self._part_done,
            retry_delay=sink.part_retry_delay,
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
        elapsed = self._sink._clock.seconds() - self._started
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
        for _hop in range(self._sink.max_redirects + 1):
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
            if answer.status not in _REDIRECTS or not location:
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
        sink, plan = self._sink, self._plan
        producer: FileProducer | None = None
        if isinstance(body, FileRange):
            try:
                # Off the reactor thread: a failing disk must not stall every timer.
                stream, actual = await sink._run(open_payload, self._path)
            except OSError as e:
                return Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}")
            if body.offset:
                try:
                    await sink._run(stream.seek, body.offset)
                except OSError as e:
                    stream.close()
                    return Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}")
            producer = FileProducer(
                stream, body.length, sink._clock, sink._run, self._progress, sink.read_size
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
            request_headers.setRawHeaders(b"user-agent", [sink.user_agent.encode("ascii")])
            if sink._keeps_auth(url):
                request_headers.setRawHeaders(
                    b"authorization", [sink._credentials.authorization.encode()]
                )
            self._put_sent = 0
            if producer is not None:
                self._put_length = body.length if isinstance(body, FileRange) else 0
                self._arm(watchdog=True)
                data: Any = producer
            else:
                self._arm(answer=True)
                data = body if body or method in ("POST", "PUT") else None
            request = sink._http.request(
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
                    read_bounded(response, limit, sink.answer_timeout, sink._clock)
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
            self._watchdog.reset(self._sink.no_progress_timeout)

    def _arm(self, watchdog: bool = False, answer: bool = False) -> None:
        clock = self._sink._clock
        if watchdog:
            self._disarm()
            timeout = self._sink.no_progress_timeout
            self._watchdog = clock.callLater(
                timeout, self._abort, f"no upload progress for {timeout:g}s"
            )
        if answer and self._answer is None:
            self._disarm(answer=False)
            timeout = self._sink.answer_timeout
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


@frozen
class IADeliverySink:
    """One Internet Archive destination (a project's, or the ledger's)."""

    destination: ClassVar[Destination] = Destination.IA

    # How much of a verified copy is read back: bytes sampled, or READBACK_ALL.
    _readback_bytes: int | Literal["all"]
    _sink: IASink

    def deliver(
        self,
        plan: ItemPlan,
        path: Path,
        progress: Callable[[int], None],
        *,
        overwrite: bool = False,
    ) -> Deferred[Delivered]:
        """One attempt (see :class:`~canner.sinks.base.Sink`); ``overwrite``: upload even when
        the metadata API lists a matching file."""
        return Deferred.fromCoroutine(self._deliver(plan, path, progress, overwrite))

    async def _deliver(
        self, plan: ItemPlan, path: Path, progress: Callable[[int], None], overwrite: bool
    ) -> Delivered:
        result = await self._sink.deliver(plan, path, progress, overwrite=overwrite)
        if result.delivered:
            return Delivered(plan.identifier, plan.remote_name)
        raise DeliveryFailed(
            result.outcome.reason,
            needs_operator=result.outcome.needs_operator,
            retry_after=result.outcome.retry_after,
            kind=failure_class(result.status, result.outcome.reason),
        )

    def verify(self, plan: ItemPlan, path: Path) -> Deferred[RemoteCheck]:
        """Is the file at IA with its size and MD5, and do the bytes IA serves match the local
        copy at ``path``?"""
        return Deferred.fromCoroutine(self._verify(plan, path))

    async def _verify(self, plan: ItemPlan, path: Path) -> RemoteCheck:
        listed = await self._verify_file(
            plan.identifier, plan.remote_name, plan.size, plan.content_md5 or None
        )
        if not listed.verified:
            return listed
        return await self._read_back(
            plan.identifier, plan.remote_name, path, plan.size, plan.content_md5
        )

    async def _verify_file(
        self, identifier: str, remote_name: str, size: int, content_md5: str | None
    ) -> RemoteCheck:
        found = await self._sink.lookup(identifier, remote_name)
        if isinstance(found, RemoteFile):
            if content_md5 is not None and found.matches(size, content_md5):
                return RemoteCheck(True)
            return RemoteCheck(
                False,
                f"remote file differs: {found.size} bytes, md5 {found.md5}",
                needs_operator=True,
            )
        if found is None:
            return RemoteCheck(False, "not listed by the metadata API yet", absent=True)
        return RemoteCheck(False, found.reason, needs_operator=found.needs_operator)

    async def _read_back(
        self, identifier: str, remote_name: str, path: Path, size: int, md5: str
    ) -> RemoteCheck:
        """The metadata matches; before a purge may follow, check the bytes IA serves against
        the local copy at ``path`` (a few ranges), or against its MD5 (``"all"``)."""
        budget = self._readback_bytes
        if isinstance(budget, str):  # READBACK_ALL
            result = await self._sink.read_back_all(identifier, remote_name, size, md5)
        elif budget <= 0:
            return RemoteCheck(True)
        else:
            result = await self._sink.read_back(identifier, remote_name, path, size, budget)
        if result.ok:
            return RemoteCheck(True)
        if result.mismatch:
            return RemoteCheck(
                False,
                result.detail + "; the payload is kept, `canner retry` uploads it again",
                needs_operator=True,
                bad_copy=True,
            )
        if result.needs_operator:
            return RemoteCheck(
                False,
                result.detail + "; set readback_bytes = 0 to verify by the metadata API alone",
                needs_operator=True,
            )
        log.warn(
            "read-back of {identifier}/{remote_name} failed, trying again later: {error}",
            identifier=identifier,
            remote_name=remote_name,
            error=result.detail,
        )
        return RemoteCheck(False, result.detail)


def internet_archive_sink(
    project_id: str,
    delivery: IADelivery,
    http: HTTPClient,
    reactor: Any,
    run: BlockingRunner,
    journal: PartJournal | None = None,
    gates: dict[str, PutGate] | None = None,
) -> IADeliverySink:
    """One project's IA sink; reads its credentials (blocking).

    ``run`` is the blocking runner that reads payloads off the reactor thread; ``journal``
    holds the parts of multipart uploads (the data directory's ``multipart/``).  ``gates``,
    by access key, is shared by every project's sink: IA rations tasks per account, so projects
    that upload with the same keys are paced together.  Raises
    :class:`ConfigError` naming the key when the credentials are unusable, so a bad project
    refuses to start instead of failing every attempt later (``parse_config`` checked the rest).
    """
    try:
        sink = IASink.for_delivery(
            delivery,
            http,
            reactor,
            run,
            journal=journal,
        )
    except CredentialsError as e:
        raise ConfigError(f"projects.{project_id}.delivery.credentials", str(e)) from None
    if loose := loose_permissions(delivery.credentials):
        log.warn(
            "projects.{project}.delivery.credentials: {problem}", project=project_id, problem=loose
        )
    if gates is not None:
        sink = evolve(sink, gate=gates.setdefault(sink.account, sink.gate))
    return IADeliverySink(delivery.readback_bytes, sink)
