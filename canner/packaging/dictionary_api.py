"""A project's zstd dictionary API (megawarc's ``--server``) and the dictionaries a build needs.

The API, as megawarc uses it: ``GET <url>?project=<project>&id=<dict id>`` answers JSON
``{"id": "<dict id>", "url": "...", "sha256": "<hex>"}`` (another ``id`` is an error), and
``GET <that url>`` the dictionary, whose SHA-256 must be ``sha256``.  :class:`DictionaryApi`
does those two requests over an injected treq client, every read bounded in size and time.
:class:`Dictionaries` gives a build the frames of the dictionaries its members name: kept ones
from :class:`~canner.packaging.dictionaries.DictionaryStore`, the others fetched (once per id)
and kept first.  A dictionary that cannot be had raises :class:`DictionaryUnavailable` with the
time of its next attempt (backoff per id), and its wait is recorded for operators.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlencode

from attrs import define
from treq.client import HTTPClient
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from canner.blocking import BlockingRunner
from canner.observe import UNOBSERVED, DictionaryObserver
from canner.packaging.dictionaries import (
    DictionaryStore,
    DictionaryWait,
    dictionary_frame,
    retry_delay,
    usable,
)
from canner.packaging.megawarc import MAX_DICTIONARY
from canner.sinks.transport import canner_user_agent, read_bounded

log = Logger()

# The API's JSON answer is small; the dictionary is at most MAX_DICTIONARY bytes.
ANSWER_LIMIT = 64 << 10
TIMEOUT = 60.0


class DictionaryUnavailable(Exception):
    """A dictionary could not be had: ``reason`` is a failure class (``unconfigured``, ``api``,
    ``download``, ``mismatch``, ``invalid``); ``next_attempt_at`` when to try again."""

    def __init__(
        self, project: str, dict_id: str, reason: str, detail: str, next_attempt_at: float = 0.0
    ) -> None:
        super().__init__(f"zstd dictionary {dict_id} of {project}: {detail}")
        self.project, self.dict_id, self.reason = project, dict_id, reason
        self.detail, self.next_attempt_at = detail, next_attempt_at


class DictionarySource(Protocol):
    """Where dictionaries come from (:class:`DictionaryApi`; tests use a fake)."""

    async def fetch(self, url: str, project: str, dict_id: str) -> bytes:
        """The dictionary's bytes as served, checked; raises :class:`DictionaryUnavailable`."""
        ...


@define(eq=False, kw_only=True)
class DictionaryApi:
    """The two requests of the dictionary API (collaborators by keyword)."""

    _http: HTTPClient
    _clock: IReactorTime
    _timeout: float = TIMEOUT

    async def fetch(self, url: str, project: str, dict_id: str) -> bytes:
        """The dictionary ``dict_id`` of ``project``, checked by SHA-256 and found to be a zstd
        dictionary.  Raises :class:`DictionaryUnavailable` (without a next attempt)."""
        query = urlencode({"project": project, "id": dict_id})
        answer = await self._get(url + ("&" if "?" in url else "?") + query, ANSWER_LIMIT)
        try:
            doc = json.loads(answer)
            found_id, where, sha256 = doc["id"], doc["url"], doc["sha256"]
            if not all(isinstance(v, str) for v in (found_id, where, sha256)):
                raise TypeError("id, url and sha256 must be strings")
        except (ValueError, KeyError, TypeError) as e:
            raise DictionaryUnavailable(
                project, dict_id, "api", f"the dictionary API's answer is not usable: {e}"
            ) from None
        if found_id != dict_id:
            raise DictionaryUnavailable(
                project, dict_id, "mismatch", f"the dictionary API answered for id {found_id!r}"
            )
        try:
            data = await self._get(where, MAX_DICTIONARY)
        except DictionaryUnavailable as e:
            raise DictionaryUnavailable(project, dict_id, "download", e.detail) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256.lower():
            raise DictionaryUnavailable(
                project, dict_id, "mismatch", f"{where} has SHA-256 {actual}, the API says {sha256}"
            )
        if not usable(data):
            raise DictionaryUnavailable(project, dict_id, "invalid", f"{where} is no dictionary")
        return data

    async def _get(self, url: str, limit: int) -> bytes:
        def unavailable(detail: str) -> DictionaryUnavailable:
            return DictionaryUnavailable("", "", "api", f"GET {url}: {detail}")

        headers = Headers({b"User-Agent": [canner_user_agent().encode()]})
        try:
            response = await self._http.get(url, headers=headers).addTimeout(
                self._timeout, self._clock
            )
            body, truncated = await read_bounded(response, limit + 1, self._timeout, self._clock)
        except Exception as e:  # every network failure is one more reason to wait
            raise unavailable(str(e) or type(e).__name__) from None
        if response.code != 200:
            raise unavailable(f"answered {response.code}")
        if truncated or len(body) > limit:
            raise unavailable(f"more than {limit} bytes")
        return body


@define(eq=False, kw_only=True)
class Dictionaries:
    """The dictionaries builds need, kept or fetched (collaborators by keyword)."""

    _store: DictionaryStore
    # None: this deliver process fetches nothing (every dictionary not kept waits).
    _api: DictionarySource | None
    _run: BlockingRunner
    _now: Callable[[], float]
    observer: DictionaryObserver = UNOBSERVED

    async def frames(
        self, owner: str, url: str | None, wanted: list[tuple[str, str]]
    ) -> dict[str, bytes]:
        """The frames (``dictionary_frame``) of the ``wanted`` ``(project, dict id)`` by dict id,
        fetching from ``url`` (the ``zstd_dictionary_url`` of the canner project ``owner``, the
        label of the counts) the ones not kept.  Raises
        :class:`DictionaryUnavailable` once each was tried, for the one due again first, when
        any cannot be had (or its next attempt is not due yet)."""
        frames = {}
        missing: list[DictionaryUnavailable] = []
        for project, dict_id in wanted:
            data = await self._run(self._store.load, dict_id)
            if data is None:
                try:
                    data = await self._fetch(owner, url, project, dict_id)
                except DictionaryUnavailable as e:
                    missing.append(e)
                    continue
            frames[dict_id] = dictionary_frame(data)
        if missing:
            raise min(missing, key=lambda e: e.next_attempt_at)
        return frames

    async def _fetch(self, owner: str, url: str | None, project: str, dict_id: str) -> bytes:
        now = self._now()
        wait = await self._run(self._store.wait, dict_id)
        if wait is not None and wait.next_attempt_at > now:
            raise DictionaryUnavailable(
                project, dict_id, "waiting", wait.error, wait.next_attempt_at
            )
        try:
            if url is None or self._api is None:
                raise DictionaryUnavailable(
                    project, dict_id, "unconfigured", "the project has no zstd_dictionary_url"
                )
            data = await self._api.fetch(url, project, dict_id)
        except DictionaryUnavailable as e:
            attempts = 1 + (wait.attempts if wait is not None else 0)
            next_at = now + retry_delay(attempts)
            detail = e.detail
            waiting = DictionaryWait(
                dict_id, project, detail, wait.since if wait else now, attempts, next_at
            )
            await self._run(self._store.record_wait, waiting)
            self.observer.dictionary_unavailable(owner, e.reason)
            log.warn(
                "zstd dictionary {dict_id} of {project} cannot be had (attempt {attempt}), its"
                " members wait; next try in {delay:.0f}s: {error}",
                dict_id=dict_id,
                project=project,
                attempt=attempts,
                delay=next_at - now,
                error=detail,
            )
            raise DictionaryUnavailable(project, dict_id, e.reason, detail, next_at) from None
        await self._run(self._store.keep, dict_id, data)
        self.observer.dictionary_fetched(owner)
        log.info(
            "fetched and kept zstd dictionary {dict_id} of {project} ({size} bytes)",
            dict_id=dict_id,
            project=project,
            size=len(data),
        )
        return data
