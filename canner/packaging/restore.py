"""Packages on disk -> rows missing from the delivery index (``delivery.sqlite`` was lost).

A package directory holds its own index (one line per member: its receipt's facts and where it
sits in the package) and, once delivered, its delivery record: enough to bring back the
package's row and its members' rows.  :class:`PackageRestore` is the one restore:
canner-deliver's packaging pipeline runs it at every start, ``canner rebuild-index`` once.
"""

from __future__ import annotations

from collections.abc import Callable

from attrs import define
from twisted.internet.defer import Deferred
from twisted.logger import Logger

from canner.blocking import BlockingRunner
from canner.delivery.index import Index
from canner.packaging import batches as sql
from canner.packaging.batches import Member, RestoredPackage
from canner.packaging.megawarc import package_lines
from canner.packaging.store import PackageStore
from canner.sinks.plan import format_date

log = Logger()


def read_package(
    store: PackageStore, package_id: str, now: float, archived: Callable[[str], bool]
) -> RestoredPackage | None:
    """A package directory's membership, placements and delivery record (blocking);
    ``archived(object_id)`` says which members a verified ledger owns."""
    directory = store.directory(package_id)
    members, placements = [], []
    for line in package_lines(directory, package_id):
        c = line["canner"]
        members.append(
            Member(
                c["object_id"],
                c["project"],
                c.get("filename"),
                c["size_bytes"],
                c["checksum"],
                c["accepted_at"],
            )
        )
        placements.append((c["object_id"], c["file"][len(package_id) :], c["offset"]))
    if not members:
        return None
    # Member order (acceptance) across the package's megawarcs: the first names the batch date.
    members.sort(key=lambda m: (m.accepted_at, m.object_id))
    files = [
        (p.name[len(package_id) :], p.stat().st_size)
        for p in directory.iterdir()
        if p.name.startswith(package_id + ".") and ".megawarc." in p.name
    ]
    delivery = store.read_delivery(package_id)
    if delivery is not None:
        files = [(s, n) for s, n in delivery.get("sizes", {}).items()] or files
    return RestoredPackage(
        package_id,
        members[0].project,
        format_date(members[0].accepted_at),
        members,
        frozenset(m.object_id for m in members if archived(m.object_id)),
        placements,
        files,
        delivery,
        now,
    )


def package_ids(store: PackageStore) -> list[str]:
    """Every finished package on disk; none when the packages directory does not exist (a data
    directory that never packed).  Blocking."""
    if not store.root.is_dir():
        return []
    return list(store.package_ids())


def _always() -> bool:
    return True


@define(eq=False, kw_only=True)
class PackageRestore:
    """Brings back every package on disk that has no row, with its members, but for the
    members whose records a verified ledger owns (``archived``): they count in the package and
    never come back as objects (see :func:`~canner.packaging.batches.restore_package`).

    One package at a time, each in its own transaction; ``keep_going`` is asked before each
    (once false, the rest come back at the next run).
    """

    _index: Index
    _store: PackageStore
    _run: BlockingRunner
    _now: Callable[[], float]
    _archived: Callable[[str], bool]
    _keep_going: Callable[[], bool] = _always

    def run(self) -> Deferred[int]:
        """How many packages came back; logs it, when any."""
        return Deferred.fromCoroutine(self._restore())

    async def _restore(self) -> int:
        known = await self._index.run(sql.known_packages)
        on_disk = await self._run(package_ids, self._store)
        restored = 0
        for package_id in on_disk:
            if not self._keep_going():
                break
            if package_id in known:
                continue
            found = await self._run(
                read_package, self._store, package_id, self._now(), self._archived
            )
            if found is not None and await self._index.run(sql.restore_package, found):
                restored += 1
        if restored:
            log.info("restored {count} packages from disk into the index", count=restored)
        return restored
