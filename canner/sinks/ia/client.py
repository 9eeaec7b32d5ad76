"""The Internet Archive HTTP client: one account's keys, URLs and limits.

:class:`IAClient` looks a remote file up in the metadata API, probes ``check_limit``, reads a
delivered file back through its download URL, and starts delivery attempts
(:mod:`canner.sinks.ia.attempt`), handing each one an
:class:`~canner.sinks.ia.attempt.AttemptContext`.  It talks HTTP through an injected treq
``HTTPClient`` and clock and reads files through the injected blocking runner.  The rules are
``docs/reference/internet-archive.md``'s.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from attrs import Factory, define, field
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse

from canner.blocking import BlockingRunner
from canner.sinks.ia.attempt import (
    ERROR_BODY_MAX,
    REDIRECTS,
    AttemptContext,
    DeliveryResult,
    start_attempt,
)
from canner.sinks.ia.config import DEFAULT_PART_SIZE, IADelivery
from canner.sinks.ia.credentials import Credentials, load_credentials, redact
from canner.sinks.ia.multipart import PartJournal
from canner.sinks.ia.pacing import LimitReading, PutGate, parse_check_limit
from canner.sinks.ia.readback import (
    ReadBack,
    choose_ranges,
    describe,
    parse_content_range,
    read_local,
)
from canner.sinks.ia.wire import Lookup, Unknown, parse_metadata
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

METADATA_BODY_MAX = 32 << 20


@define(eq=False, kw_only=True)
class IAClient:
    """Talks to one IA account over an injected treq ``HTTPClient``: delivers planned objects,
    looks files up, reads them back.

    ``s3_url`` and ``metadata_url`` are the base URLs of a project's delivery config.  Times are
    seconds on ``clock``.  The client holds no per-object state; attempts may run concurrently.
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
    # The PUTs running to this client's account, paced by check_limit (canner.sinks.ia.pacing);
    # the clients of projects that share IA keys share it (internet_archive_sink).
    gate: PutGate = field(default=Factory(lambda self: PutGate(self._clock), takes_self=True))

    @classmethod
    def for_delivery(
        cls,
        delivery: IADelivery,
        http: HTTPClient,
        clock: IReactorTime,
        run: BlockingRunner,
        **kwargs: Any,
    ) -> IAClient:
        """A client for one project's delivery config; reads its credentials (blocking)."""
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
        """The IA account (access key) this client uploads as."""
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
        return start_attempt(self._attempt_context(), plan, path, on_progress, overwrite)

    def _attempt_context(self) -> AttemptContext:
        return AttemptContext(
            http=self._http,
            clock=self._clock,
            run=self._run,
            s3_url=self._s3_url,
            user_agent=self.user_agent,
            authorization=self._credentials.authorization,
            redact=self._redact,
            keeps_auth=self._keeps_auth,
            lookup=self.remote_file,
            read_limit=self.read_limit if self.check_limit else None,
            gate=self.gate,
            journal=self.journal,
            multipart_threshold=self.multipart_threshold,
            multipart_part_size=self.multipart_part_size,
            part_retry_delay=self.part_retry_delay,
            max_redirects=self.max_redirects,
            read_size=self.read_size,
            no_progress_timeout=self.no_progress_timeout,
            answer_timeout=self.answer_timeout,
            attempt_timeout=self.attempt_timeout,
        )

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
            if response.code not in REDIRECTS or not location:
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

    def _redact(self, text: str) -> str:
        return redact(text, self._credentials.secret)

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
