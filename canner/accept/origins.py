"""Objects by origin: a worker that sends the same file again gets the same object.

:class:`AcceptedOrigins` owns the origin memory behind the one acceptance's origin rule (doors
whose uploads name a worker: ``UploadDoor.names_worker``): :meth:`AcceptedOrigins.once` commits
a file unless an object with exactly the same :class:`OriginKey` (project, downloader, file
name, size, BLAKE3) is accepted already, and answers that object's receipt instead.  The
receipt on disk decides (an object whose receipt is gone no longer counts); candidates come from
this process's own commits (remembered before any answer is written) and from the index, which
:func:`index_at_start` brings up to date with ``receipts/`` before the receiver answers its first
request, so the rule holds across a crash.  Files with the same key at the same time are
serialised.  A failing lookup counts as no match: a duplicate is safe, a refused upload is not
(docs/architecture.md, "Acceptance", has the crash windows and the start-up cost).
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from attrs import define, field, frozen
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.checksum import Checksum
from canner.delivery.index import Index, ids_by_origin, known_among, open_read_only
from canner.delivery.rescan import rescan_now
from canner.ids import ObjectIds
from canner.store.journal import Journal
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadStore

log = Logger()

# Keys of this process's own commits kept in memory; the index has their rows within a
# second or two (or, after a kill, from the next start's index_at_start), so this only has to
# outlast its lag (at thousands of acceptances a second).
RECENT_MAX = 20_000


@frozen
class OriginKey:
    """What makes two stored files the same object for a worker that sends again."""

    project: str
    downloader: str
    filename: str
    size_bytes: int
    checksum: Checksum

    @classmethod
    def of(cls, origin: Origin, size_bytes: int, checksum: Checksum) -> OriginKey:
        """The key of a file whose origin names its worker and its file name."""
        assert origin.downloader is not None and origin.filename is not None
        return cls(origin.project, origin.downloader, origin.filename, size_bytes, checksum)

    def matches(self, receipt: Receipt) -> bool:
        return receipt.size_bytes == self.size_bytes and receipt.checksum == self.checksum


@define(eq=False, kw_only=True)
class AcceptedOrigins:
    """Finds the object already accepted for an :class:`OriginKey`, and commits new ones one
    key at a time (see the module docstring for the contract).  Reactor thread only."""

    _receipts: ReceiptStore
    _run: BlockingRunner
    # The delivery index; None when the receiver runs without one (then only this process's
    # own commits are found).
    _index: Index | None = None
    _recent: OrderedDict[OriginKey, str] = field(factory=OrderedDict)
    # Keys whose commit runs now, with whoever waits for it to end.
    _committing: dict[OriginKey, list[Deferred[None]]] = field(factory=dict)

    def find(self, key: OriginKey) -> Deferred[Receipt | None]:
        """The receipt of an object accepted with exactly ``key``, or None.

        The oldest matching object wins when there are several (copies accepted before this
        existed, or during a crash window).  Never fails: a failing lookup is logged as None.
        """
        return Deferred.fromCoroutine(self._find(key))

    def once(
        self, key: OriginKey, commit: Callable[[], Deferred[Receipt]]
    ) -> Deferred[tuple[Receipt, bool]]:
        """``(receipt, True)`` after running ``commit`` when no object has ``key`` yet;
        ``(existing receipt, False)`` without running it when one has.

        ``commit`` must publish a receipt for the new object and fire once it is durable; a
        failure of it propagates, and the next file with ``key`` is looked up afresh.  A file
        with the same key that arrives while a commit of it runs waits for that commit.
        """
        return Deferred.fromCoroutine(self._once(key, commit))

    def claim(self, key: OriginKey) -> Deferred[str | None]:
        """Mark ``key`` as committing for another process of the node (a receiver worker,
        :mod:`canner.daemon.node_protocol`), once nobody commits it any more: what :meth:`once`
        does around its own commit.  Fires with the object remembered for ``key`` (None: none),
        which the caller checks against its receipt; :meth:`settle` ends the claim."""
        return Deferred.fromCoroutine(self._claim(key))

    async def _claim(self, key: OriginKey) -> str | None:
        while key in self._committing:
            waiter: Deferred[None] = Deferred()
            self._committing[key].append(waiter)
            await waiter
        self._committing[key] = []
        return self._recent.get(key)

    def settle(self, key: OriginKey, object_id: str | None) -> None:
        """End a :meth:`claim` of ``key``; ``object_id`` is the object it committed, if any."""
        if object_id is not None:
            self.remember(key, object_id)
        for waiter in self._committing.pop(key, []):
            waiter.callback(None)

    def remember(self, key: OriginKey, object_id: str) -> None:
        """Note that ``object_id`` was committed with ``key`` in this process."""
        self._recent[key] = object_id
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT_MAX:
            self._recent.popitem(last=False)

    async def _once(
        self, key: OriginKey, commit: Callable[[], Deferred[Receipt]]
    ) -> tuple[Receipt, bool]:
        while True:
            while key in self._committing:
                waiter: Deferred[None] = Deferred()
                self._committing[key].append(waiter)
                await waiter
            found = await self._find(key)
            if found is not None:
                return found, False
            if key not in self._committing:  # nobody claimed it while we looked
                break
        self._committing[key] = []
        try:
            receipt = await commit()
            self.remember(key, receipt.object_id)
        finally:
            for waiter in self._committing.pop(key):
                waiter.callback(None)
        return receipt, True

    async def _find(self, key: OriginKey) -> Receipt | None:
        try:
            recent = self._recent.get(key)
            if recent is not None:
                receipt = await self._run(self._matching, key, [recent])
                if receipt is not None:
                    return receipt
            if self._index is None:
                return None
            candidates: list[str] = await self._index.run(
                ids_by_origin, key.project, key.filename, key.downloader
            )
            return await self._run(self._matching, key, candidates)
        except Exception as e:
            log.error(
                "looking up earlier copies of {filename} from {downloader} ({project}) failed,"
                " accepting it as new: {error}",
                filename=key.filename,
                downloader=key.downloader,
                project=key.project,
                error=str(e),
            )
            return None

    def _matching(self, key: OriginKey, object_ids: list[str]) -> Receipt | None:
        """The first of ``object_ids`` whose receipt is on disk and matches (blocking)."""
        for object_id in object_ids:
            receipt = self._receipts.read(object_id)
            if receipt is not None and key.matches(receipt):
                return receipt
        return None


@contextmanager
def unindexed_among(path: Path) -> Iterator[Callable[[list[str]], list[str]]]:
    """Of a batch of ids (start-up's origin records, as it lists them), those the index at
    ``path`` lacks (blocking, one read-only connection for the whole listing): the only ones
    :func:`index_at_start` need check, so that a million objects at rest are never held.  Any
    id the index cannot be asked about (no index yet, an error) is kept: the check adds only
    what it finds missing."""
    conn: sqlite3.Connection | None
    try:
        conn = open_read_only(path)
    except (OSError, sqlite3.Error):
        conn = None

    def lacking(object_ids: list[str]) -> list[str]:
        if conn is None:
            return object_ids
        try:
            known = known_among(conn.cursor(), object_ids)
        except sqlite3.Error:
            return object_ids
        return [object_id for object_id in object_ids if object_id not in known]

    try:
        yield lacking
    finally:
        if conn is not None:
            conn.close()


def index_at_start(
    path: Path,
    *,
    receipts: ReceiptStore,
    uploads: UploadStore,
    journal: Journal,
    archived: Callable[[str], bool],
    object_ids: ObjectIds,
    now: Callable[[], float],
    recorded: Iterable[str] | None = None,
) -> int | None:
    """Insert into the index at ``path`` a row for every receipt it lacks that has its origin
    record and no verified ledger owns (``archived``): run before the receiver serves, so
    :class:`AcceptedOrigins` finds every object committed before this start (see the module
    docstring).  Blocking.  Returns the rows added; None when the pass failed (logged, never
    fatal: the receiver still accepts uploads).

    ``recorded``: the ids of every origin record in ``receipts/``, from a listing the caller
    made already (start-up's, :attr:`~canner.store.promises.Unreceipted.recorded`), or of
    those the index lacked at that listing (:func:`unindexed_among`); only those are checked
    against the index, in sorted order (the index's key order).  None lists
    ``receipts/`` here and checks every receipt in it."""

    def not_ours(object_id: str) -> bool:
        # What a kill or a failed insert may have left unindexed has its origin record (written
        # before the commit point, removed only by a purge, which needs the row).  Purged and
        # archived objects are left to canner-deliver's rescan, under the ledger's guard.
        return not receipts.origin_path(object_id).exists() or archived(object_id)

    started = time.monotonic()
    try:
        done = rescan_now(
            path,
            receipts=receipts,
            uploads=uploads,
            journal=journal,
            skip=not_ours,
            object_ids=object_ids,
            now=now,
            listed=None if recorded is None else sorted(recorded),
        )
    except Exception as e:
        log.error(
            "indexing the receipts the delivery index lacks failed at start ({error}): a copy"
            " of an object accepted before this start may become a second object until"
            " canner-deliver's rescan adds its row",
            error=str(e),
        )
        return None
    log.info(
        "delivery index checked against receipts/ at start: {added} rows added in {seconds} s",
        added=done.added,
        seconds=round(time.monotonic() - started, 3),
    )
    return done.added
