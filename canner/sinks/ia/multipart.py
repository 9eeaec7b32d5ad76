"""Resumable S3 multipart delivery of one big file to IA, and its durable part journal.

A file at or above a project's ``multipart_threshold`` goes up in parts: initiate (``POST
?uploads``), one ``PUT ?partNumber=N&uploadId=ID`` per part with its ``Content-MD5``, complete
(``POST ?uploadId=ID`` with the list of parts), abort (``DELETE ?uploadId=ID``) when an upload can
no longer complete.  The upload id and every finished part are written to a :class:`PartJournal`
file (fsynced, atomically replaced) before the next part starts, so a deliver restart, a network
failure or a SlowDown costs at most the part in flight.

The XML is read leniently (with or without the S3 namespace; IA's answers are logged), and the
complete request is sent without a namespace (a user of IA's S3 had to strip it).  The pure half
(part layout, XML, journal records) is at the top; :class:`MultipartUpload` is the shell, driven
by the IA sink's attempt through the :class:`Exchange` protocol, so this module imports nothing
of :mod:`canner.sinks.ia.attempt`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol
from urllib.parse import quote
from xml.etree import ElementTree

import attrs
from attrs import frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.fs import fsync_dir, orphaned_temps, replace_file
from canner.sinks.base import Outcome, Verdict
from canner.sinks.ia.config import MAX_PARTS, MIN_PART_SIZE
from canner.sinks.ia.wire import classify, short
from canner.sinks.plan import ItemPlan

log = Logger()

JOURNAL_VERSION = 1
# How often one part is tried within an attempt before the attempt gives up (the next attempt
# resumes at the same part), and the first pause between tries (doubling).
PART_TRIES = 4
PART_RETRY_DELAY = 1.0
# A SlowDown asking for a longer pause than this ends the attempt instead (the scheduler waits).
MAX_INLINE_PAUSE = 60.0
# An answer excerpt logged for IA's initiate/complete answers.
LOGGED_ANSWER = 500


# --- the part layout (pure) -------------------------------------------------------------------


def part_size_for(size: int, configured: int) -> int:
    """The part size for a ``size``-byte file: ``configured``, grown when the file would need
    more than :data:`MAX_PARTS` parts (rounded up to a MiB)."""
    needed = -(-size // MAX_PARTS)
    if needed <= configured:
        return max(configured, MIN_PART_SIZE)
    return -(-needed // (1 << 20)) * (1 << 20)


def part_ranges(size: int, part_size: int) -> list[tuple[int, int, int]]:
    """``(number, offset, length)`` of every part, numbered from 1; the last may be short."""
    return [
        (i + 1, offset, min(part_size, size - offset))
        for i, offset in enumerate(range(0, max(size, 1), part_size))
    ]


# --- the journal (pure records, blocking I/O) -------------------------------------------------


@frozen
class FileIdentity:
    """What says a local file is still the one an upload started from (no re-hash needed)."""

    size: int
    content_md5: str
    inode: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path, content_md5: str) -> FileIdentity:
        """Stat ``path`` (blocking; raises ``OSError``)."""
        st = os.stat(path)
        return cls(st.st_size, content_md5, st.st_ino, st.st_mtime_ns)


@frozen
class FinishedPart:
    """A part IA acknowledged: its number, size, MD5 (hex, ours) and the ETag IA gave."""

    number: int
    size: int
    md5: str
    etag: str


@frozen
class UploadRecord:
    """The durable state of one multipart upload, as the journal file holds it.

    ``completing``: the complete request was sent (its answer may never have arrived).
    """

    identifier: str
    remote_name: str
    upload_id: str
    part_size: int
    file: FileIdentity
    parts: tuple[FinishedPart, ...] = ()
    completing: bool = False

    def finished(self) -> dict[int, FinishedPart]:
        return {p.number: p for p in self.parts}

    def with_part(self, part: FinishedPart) -> UploadRecord:
        kept = tuple(p for p in self.parts if p.number != part.number)
        return attrs.evolve(self, parts=tuple(sorted((*kept, part), key=lambda p: p.number)))

    def to_json(self) -> bytes:
        doc = {
            "version": JOURNAL_VERSION,
            **attrs.asdict(self, recurse=True),
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> UploadRecord:
        """Parse a journal file; ``ValueError`` when it is not one this version wrote."""
        try:
            doc = json.loads(data)
            if doc.get("version") != JOURNAL_VERSION:
                raise ValueError(f"journal version {doc.get('version')!r}")
            return cls(
                identifier=str(doc["identifier"]),
                remote_name=str(doc["remote_name"]),
                upload_id=str(doc["upload_id"]),
                part_size=int(doc["part_size"]),
                file=FileIdentity(**doc["file"]),
                parts=tuple(FinishedPart(**p) for p in doc["parts"]),
                completing=bool(doc.get("completing", False)),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a multipart journal: {e}") from None


@frozen
class PartJournal:
    """One journal file per destination (item + remote name) in ``directory``.

    All methods block (run them through the runner).  :meth:`save` is durable when it returns:
    the file is fsynced, renamed over the old one and the directory fsynced.
    """

    directory: Path

    @classmethod
    def opened(cls, directory: Path, now: float) -> PartJournal:
        """The journal in ``directory``, rid of the temp files a crash left in the middle of a
        :meth:`save` (older than an hour: no save takes that long)."""
        journal = cls(directory)
        if directory.is_dir():
            for temp in orphaned_temps(directory, now):
                temp.unlink(missing_ok=True)
        return journal

    def path_for(self, identifier: str, remote_name: str) -> Path:
        key = hashlib.sha256(f"{identifier}\0{remote_name}".encode()).hexdigest()[:40]
        return self.directory / f"{key}.json"

    def load(self, identifier: str, remote_name: str) -> UploadRecord | None:
        """The record for this destination, or None (absent, or unreadable: logged)."""
        path = self.path_for(identifier, remote_name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = UploadRecord.from_json(data)
        except ValueError as e:
            log.warn("ignoring multipart journal {path}: {error}", path=str(path), error=str(e))
            return None
        if (record.identifier, record.remote_name) != (identifier, remote_name):
            return None
        return record

    def save(self, record: UploadRecord) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(record.identifier, record.remote_name)
        replace_file(self.directory, path.name, record.to_json(), sync=True)
        fsync_dir(self.directory)

    def delete(self, identifier: str, remote_name: str) -> bool:
        """Remove the record (durably); True when there was one."""
        try:
            self.path_for(identifier, remote_name).unlink()
        except FileNotFoundError:
            return False
        fsync_dir(self.directory)
        return True


def hash_range(path: Path, offset: int, length: int, read_size: int = 1 << 20) -> str:
    """MD5 (hex) of ``length`` bytes of ``path`` at ``offset`` (blocking).  Raises ``OSError``,
    or ``EOFError`` when the file is shorter."""
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0:
            chunk = f.read(min(read_size, left))
            if not chunk:
                raise EOFError(f"the local file ended before byte {offset + length}")
            md5.update(chunk)
            left -= len(chunk)
    return md5.hexdigest()


# --- IA's XML, read leniently (pure) ----------------------------------------------------------


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _xml(body: bytes) -> ElementTree.Element | None:
    try:
        return ElementTree.fromstring(body)
    except ElementTree.ParseError:
        return None


def _text(root: ElementTree.Element, name: str) -> str | None:
    """The text of the first element named ``name`` (any namespace), or None."""
    for element in root.iter():
        if _local(element.tag) == name:
            return (element.text or "").strip()
    return None


def parse_upload_id(body: bytes) -> str | None:
    """The ``UploadId`` of an InitiateMultipartUploadResult (namespaced or not), or None."""
    root = _xml(body)
    if root is not None:
        found = _text(root, "UploadId")
        return found or None
    match = re.search(rb"<(?:\w+:)?UploadId>\s*([^<\s]+)\s*</", body)
    return match.group(1).decode("utf-8", "replace") if match else None


def error_code(body: bytes) -> str | None:
    """The ``Code`` of an S3 ``<Error>`` document, or None when the body is not one."""
    root = _xml(body)
    if root is None or _local(root.tag) != "Error":
        return None
    return _text(root, "Code")


@frozen
class ListedPart:
    number: int
    size: int
    etag: str


def parse_list_parts(body: bytes) -> tuple[list[ListedPart], int | None] | None:
    """The parts of a ListPartsResult and the next part-number marker (None: the last page);
    None when the body is not a ListPartsResult."""
    root = _xml(body)
    if root is None or _local(root.tag) != "ListPartsResult":
        return None
    parts = []
    for element in root.iter():
        if _local(element.tag) != "Part":
            continue
        try:
            parts.append(
                ListedPart(
                    int(_text(element, "PartNumber") or ""),
                    int(_text(element, "Size") or ""),
                    unquote_etag(_text(element, "ETag") or ""),
                )
            )
        except ValueError:
            continue
    truncated = (_text(root, "IsTruncated") or "").lower() == "true"
    marker = _text(root, "NextPartNumberMarker")
    return parts, int(marker) if truncated and marker and marker.isdigit() else None


def unquote_etag(value: str) -> str:
    return value.strip().strip('"').lower()


def complete_body(parts: tuple[FinishedPart, ...]) -> bytes:
    """The CompleteMultipartUpload request, without a namespace (IA is reported to choke on
    one)."""
    items = "".join(
        f'<Part><PartNumber>{p.number}</PartNumber><ETag>"{p.etag or p.md5}"</ETag></Part>'
        for p in parts
    )
    return f"<CompleteMultipartUpload>{items}</CompleteMultipartUpload>".encode()


def excerpt(body: bytes) -> str:
    return short(body[:LOGGED_ANSWER].decode("utf-8", "replace"), LOGGED_ANSWER)


# --- the shell ----------------------------------------------------------------------------------


@frozen
class Answer:
    """An HTTP answer: status, lowercase headers, the start of the body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@frozen
class FileRange:
    """A request body of ``length`` bytes of the payload at ``offset``, streamed from disk."""

    offset: int
    length: int


class Exchange(Protocol):
    """What the IA sink's attempt does for a multipart upload: one authorised request to a URL
    under the S3 base (following redirects), bounded by the attempt's timers."""

    def __call__(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | FileRange
    ) -> Deferred[Answer | Outcome]:
        """The answer, or the Outcome that ended the exchange (a network failure, the
        no-progress watchdog, a local read error); fails with :class:`AttemptEnded` when the
        attempt's cap fired and with ``CancelledError`` when the attempt is cancelled."""
        ...


class AttemptEnded(Exception):
    """The attempt's own cap fired: nothing more may be sent in it."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.reason)
        self.outcome = outcome


class _StartOver(Exception):
    """The upload can no longer complete (IA forgot it): begin a new one."""


@attrs.define(eq=False, kw_only=True)
class MultipartUpload:
    """One attempt's multipart delivery of ``path`` to ``plan``'s destination.

    :meth:`run` resumes the journal's upload (checking it with ListParts, and starting over
    when IA forgot it or the file changed), sends every missing part (each tried up to
    :data:`PART_TRIES` times), and completes the upload.  It returns an :class:`Outcome` and the
    status of the last answer; SUCCESS means IA accepted the complete request (the journal is
    then deleted: the upload id means nothing afterwards, and the metadata API plus the
    read-back verify the file as for a single PUT).
    """

    plan: ItemPlan
    path: Path
    url: str  # the file's S3 URL, without a query
    part_size: int
    journal: PartJournal
    exchange: Exchange
    run_blocking: BlockingRunner
    pause: Callable[[float], Deferred[None]]
    on_part: Callable[[int, int, int], None] | None = None  # (parts done, parts, bytes done)
    tries: int = PART_TRIES
    retry_delay: float = PART_RETRY_DELAY
    _status: int | None = None

    async def run(self) -> tuple[Outcome, int | None]:
        try:
            identity = await self.run_blocking(FileIdentity.of, self.path, self.plan.content_md5)
        except OSError as e:
            return Outcome(Verdict.OPERATOR, f"local file unreadable: {e.strerror}"), None
        if identity.size != self.plan.size:
            return Outcome(
                Verdict.OPERATOR,
                f"local file is {identity.size} bytes, its receipt says {self.plan.size}",
            ), None
        try:
            record = await self._resumable(identity)
            for _ in range(2):
                try:
                    return await self._send(identity, record), self._status
                except _StartOver:
                    record = None
        except AttemptEnded as e:
            return e.outcome, self._status
        return Outcome(Verdict.TRANSIENT, "multipart upload forgotten twice in one attempt"), (
            self._status
        )

    async def _resumable(self, identity: FileIdentity) -> UploadRecord | None:
        """The journal's upload when it can go on; else None, after aborting a stale one."""
        plan = self.plan
        record = await self.run_blocking(self.journal.load, plan.identifier, plan.remote_name)
        if record is None:
            return None
        if record.file == identity:
            return record
        log.warn(
            "the local file of {object_id} changed since multipart upload {upload_id} to"
            " {identifier}/{remote_name} began: aborting it and starting over",
            object_id=plan.object_id,
            upload_id=record.upload_id,
            identifier=plan.identifier,
            remote_name=plan.remote_name,
        )
        await self._abort(record)
        return None

    async def _send(self, identity: FileIdentity, record: UploadRecord | None) -> Outcome:
        if record is not None:
            checked = await self._check(record)
            if isinstance(checked, Outcome):
                return checked
            record = checked
        if record is None:
            started = await self._initiate(identity)
            if isinstance(started, Outcome):
                return started
            record = started
        ranges = part_ranges(self.plan.size, record.part_size)
        # A complete request sent before (its answer lost in a crash) is sent again.
        resent = record.completing
        if self.on_part is not None:
            self.on_part(len(record.parts), len(ranges), sum(p.size for p in record.parts))
        if not record.completing:
            for number, offset, length in ranges:
                if number in record.finished():
                    continue
                sent = await self._part(record, number, offset, length)
                if isinstance(sent, Outcome):
                    return sent
                record = record.with_part(sent)
                await self.run_blocking(self.journal.save, record)
                if self.on_part is not None:
                    done = sum(p.size for p in record.parts)
                    self.on_part(len(record.parts), len(ranges), done)
            record = attrs.evolve(record, completing=True)
            await self.run_blocking(self.journal.save, record)
        return await self._complete(record, len(ranges), resent)

    async def _check(self, record: UploadRecord) -> UploadRecord | Outcome | None:
        """Confirm the journal's parts with ListParts where IA answers it: parts it does not
        list are sent again; NoSuchUpload means start over (None).  Any other answer leaves the
        journal as it is (a part PUT then finds out)."""
        listed: dict[int, ListedPart] = {}
        marker = 0
        while True:
            query = f"?uploadId={quote(record.upload_id, safe='')}"
            if marker:
                query += f"&part-number-marker={marker}"
            answer = await self.exchange("GET", self.url + query, [], b"")
            if isinstance(answer, Outcome):
                log.info("ListParts failed, trusting the journal: {error}", error=answer.reason)
                return record
            self._status = answer.status
            if answer.status == 404 and error_code(answer.body) == "NoSuchUpload":
                if record.completing:
                    # The complete request was most likely carried out.
                    return await self._forgotten_after_complete(record)
                self._forgotten(record, "ListParts")
                await self.run_blocking(
                    self.journal.delete, self.plan.identifier, self.plan.remote_name
                )
                return None
            page = parse_list_parts(answer.body) if answer.status == 200 else None
            if page is None:
                log.info(
                    "ListParts of {upload_id} answered {status}, trusting the journal: {answer}",
                    upload_id=record.upload_id,
                    status=answer.status,
                    answer=excerpt(answer.body),
                )
                return record
            listed.update((p.number, p) for p in page[0])
            if page[1] is None or page[1] <= marker:
                break
            marker = page[1]
        if record.completing:
            return record
        kept = tuple(
            p
            for p in record.parts
            if p.number in listed
            and listed[p.number].size == p.size
            and listed[p.number].etag in (p.etag, p.md5, "")
        )
        if len(kept) != len(record.parts):
            log.warn(
                "IA lists {listed} of the {parts} finished parts of {upload_id}: sending the"
                " others again",
                listed=len(kept),
                parts=len(record.parts),
                upload_id=record.upload_id,
            )
            record = attrs.evolve(record, parts=kept)
            await self.run_blocking(self.journal.save, record)
        log.info(
            "resuming multipart upload {upload_id} of {object_id} with {parts} parts done",
            upload_id=record.upload_id,
            object_id=self.plan.object_id,
            parts=len(record.parts),
        )
        return record

    async def _forgotten_after_complete(self, record: UploadRecord) -> Outcome:
        """The upload is gone after a complete request whose answer was lost (a crash): most
        likely IA carried it out, and its metadata API has not listed the file yet (which can
        take hours).  Count it delivered: verification looks the file up as after any PUT, and
        delivers it again when IA never lists it (``verify_timeout``)."""
        log.warn(
            "multipart upload {upload_id} of {object_id} is gone after its complete request:"
            " counting it delivered; verification will find the file, or deliver it again",
            upload_id=record.upload_id,
            object_id=self.plan.object_id,
        )
        await self.run_blocking(self.journal.delete, self.plan.identifier, self.plan.remote_name)
        return Outcome(Verdict.SUCCESS, "multipart upload completed before a restart")

    def _forgotten(self, record: UploadRecord, where: str) -> None:
        log.warn(
            "IA no longer knows multipart upload {upload_id} of {object_id} ({where} answered"
            " NoSuchUpload): starting the upload over, {parts} parts lost",
            upload_id=record.upload_id,
            object_id=self.plan.object_id,
            where=where,
            parts=len(record.parts),
        )

    async def _initiate(self, identity: FileIdentity) -> UploadRecord | Outcome:
        # The item's metadata, auto-make-bucket and size hint go with the initiate, as with a
        # single PUT; Content-MD5 is per part.
        headers = [(k, v) for k, v in self.plan.headers if k.lower() != "content-md5"]
        answer = await self.exchange("POST", self.url + "?uploads", headers, b"")
        if isinstance(answer, Outcome):
            return answer
        self._status = answer.status
        log.info(
            "IA answered the initiate of {identifier}/{remote_name} with {status}: {answer}",
            identifier=self.plan.identifier,
            remote_name=self.plan.remote_name,
            status=answer.status,
            answer=excerpt(answer.body),
        )
        outcome = _classify(answer)
        if not outcome.ok:
            return outcome
        upload_id = parse_upload_id(answer.body)
        if not upload_id:
            return Outcome(
                Verdict.TRANSIENT, f"initiate answered {answer.status} without an UploadId"
            )
        record = UploadRecord(
            identifier=self.plan.identifier,
            remote_name=self.plan.remote_name,
            upload_id=upload_id,
            part_size=part_size_for(self.plan.size, self.part_size),
            file=identity,
        )
        # Durable before the first part: a crash from here on resumes this upload.
        await self.run_blocking(self.journal.save, record)
        log.info(
            "began multipart upload {upload_id} of {object_id} to {identifier}/{remote_name}"
            " in {parts} parts",
            upload_id=upload_id,
            object_id=self.plan.object_id,
            identifier=self.plan.identifier,
            remote_name=self.plan.remote_name,
            parts=len(part_ranges(self.plan.size, record.part_size)),
        )
        return record

    async def _part(
        self, record: UploadRecord, number: int, offset: int, length: int
    ) -> FinishedPart | Outcome:
        try:
            md5 = await self.run_blocking(hash_range, self.path, offset, length)
        except (OSError, EOFError) as e:
            return Outcome(Verdict.OPERATOR, f"local file unreadable: {e}")
        url = f"{self.url}?partNumber={number}&uploadId={quote(record.upload_id, safe='')}"
        delay = self.retry_delay
        outcome = Outcome(Verdict.TRANSIENT, "no try")
        for tried in range(1, self.tries + 1):
            answer = await self.exchange(
                "PUT", url, [("content-md5", md5)], FileRange(offset, length)
            )
            if isinstance(answer, Outcome):
                outcome = answer
                if answer.verdict is not Verdict.TRANSIENT:
                    return answer
            else:
                self._status = answer.status
                if answer.status == 404 and error_code(answer.body) == "NoSuchUpload":
                    self._forgotten(record, f"part {number}")
                    await self.run_blocking(
                        self.journal.delete, self.plan.identifier, self.plan.remote_name
                    )
                    raise _StartOver()
                outcome = _classify(answer)
                if outcome.ok:
                    etag = unquote_etag(answer.headers.get("etag", ""))
                    if etag and re.fullmatch(r"[0-9a-f]{32}", etag) and etag != md5:
                        outcome = Outcome(
                            Verdict.TRANSIENT,
                            f"part {number}: IA's ETag {etag} is not its MD5 {md5}",
                        )
                    else:
                        return FinishedPart(number, length, md5, etag or md5)
                if outcome.verdict is not Verdict.TRANSIENT:
                    return outcome
            if tried == self.tries:
                break
            pause = max(delay, outcome.retry_after or 0.0)
            if pause > MAX_INLINE_PAUSE:
                break
            log.warn(
                "part {part} of {object_id} failed ({error}); trying it again in {delay}s",
                part=number,
                object_id=self.plan.object_id,
                error=outcome.reason,
                delay=pause,
            )
            await self.pause(pause)
            delay *= 4
        return Outcome(outcome.verdict, f"part {number}: {outcome.reason}", outcome.retry_after)

    async def _complete(self, record: UploadRecord, parts: int, resent: bool) -> Outcome:
        query = f"?uploadId={quote(record.upload_id, safe='')}"
        answer = await self.exchange(
            "POST",
            self.url + query,
            [("content-type", "application/xml")],
            complete_body(record.parts),
        )
        if isinstance(answer, Outcome):
            return answer
        self._status = answer.status
        log.info(
            "IA answered the complete of {upload_id} ({parts} parts) with {status}: {answer}",
            upload_id=record.upload_id,
            parts=parts,
            status=answer.status,
            answer=excerpt(answer.body),
        )
        code = error_code(answer.body)
        if answer.status == 404 and code == "NoSuchUpload":
            if resent:
                return await self._forgotten_after_complete(record)
            self._forgotten(record, "complete")
            await self.run_blocking(
                self.journal.delete, self.plan.identifier, self.plan.remote_name
            )
            raise _StartOver()
        if code in ("InvalidPart", "InvalidPartOrder", "EntityTooSmall"):
            # IA does not hold the parts we listed: nothing to resume.
            log.warn(
                "IA refused to complete multipart upload {upload_id} ({code}): aborting it",
                upload_id=record.upload_id,
                code=code,
            )
            await self._abort(record)
            return Outcome(Verdict.TRANSIENT, f"complete refused ({code}); starting over")
        # S3 may answer 200 and still fail (an <Error> body): only a clean 2xx completes.
        outcome = _classify(answer) if code is None else _classify(attrs.evolve(answer, status=500))
        if outcome.ok:
            await self.run_blocking(
                self.journal.delete, self.plan.identifier, self.plan.remote_name
            )
        return outcome

    async def _abort(self, record: UploadRecord) -> None:
        """Abort ``record``'s upload at IA (best effort) and forget it locally."""
        answer = await self.exchange(
            "DELETE", f"{self.url}?uploadId={quote(record.upload_id, safe='')}", [], b""
        )
        if isinstance(answer, Outcome):
            status: object = answer.reason
        else:
            status = answer.status
        log.info(
            "aborted multipart upload {upload_id}: {status}",
            upload_id=record.upload_id,
            status=status,
        )
        await self.run_blocking(self.journal.delete, self.plan.identifier, self.plan.remote_name)


def _classify(answer: Answer) -> Outcome:
    return classify(answer.status, answer.headers, answer.body)
