"""``canner rebuild-index``: add every receipt and package missing from ``delivery.sqlite``
(canner-deliver stopped), and move a damaged index aside when asked."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from attrs import define, field, frozen

from canner.blocking import result_now, run_inline
from canner.cli.base import CommandError, Io, become_data_dir_owner, existing_data_dir
from canner.config import Config, load_config
from canner.delivery import index as sql
from canner.delivery.index import ConnectionIndex, configure_connection, upgrade_schema
from canner.delivery.rescan import ReceiptRescan
from canner.fs import DataDirLock, Locked, lock_held
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.ops import inventory
from canner.packaging.restore import PackageRestore
from canner.packaging.store import PackageStore
from canner.store.journal import Journal
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore


@define
class ProgressLine:
    """``label: done/total`` rewritten in place on a terminal; silent elsewhere."""

    stream: TextIO
    label: str
    total: int
    done: int = 0
    _shown: int = -1

    def step(self, count: int = 1) -> None:
        self.done += count
        # Redraw about 200 times over the whole run, and at the end.
        if self.done == self.total or self.done - self._shown >= max(1, self.total // 200):
            self._shown = self.done
            self.stream.write(f"\r{self.label}: {self.done}/{self.total}")
            self.stream.flush()

    def finish(self) -> None:
        self.stream.write(f"\r{self.label}: {self.done}/{self.total}\n")
        self.stream.flush()


@frozen
class _CountedReceipts(ReceiptStore):
    """A ReceiptStore whose listing reports each id to a progress display."""

    progress: ProgressLine | None = field(default=None, kw_only=True)

    def object_ids(self) -> Iterator[str]:
        for object_id in super().object_ids():
            if self.progress is not None:
                self.progress.step()
            yield object_id


def rebuild_index(config_path: Path, io: Io, replace_damaged: bool = False) -> int:
    """``canner rebuild-index [--replace-damaged]``, with deliver.lock held: a damaged index is
    refused, or with ``replace_damaged`` moved aside (never deleted), then the index is
    rebuilt from receipts."""
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    lock = DataDirLock(data_dir / "deliver.lock")
    try:
        lock.acquire()
    except Locked:
        raise CommandError(
            f"canner-deliver is running on {data_dir} (it holds deliver.lock):"
            " stop it first (systemctl stop canner-deliver)"
        ) from None
    try:
        _replace_if_damaged(data_dir / inventory.INDEX_NAME, replace_damaged, io)
        return _rebuild(config, data_dir, io)
    finally:
        lock.release()


def _replace_if_damaged(path: Path, replace: bool, io: Io) -> None:
    """Refuse a damaged index at ``path`` naming ``--replace-damaged``; with ``replace``, move
    it aside and say where (and say so when there was nothing to move)."""
    damage = sql.index_damage(path)
    if damage is None:
        if replace and path.exists():
            io.out.write(f"rebuild-index: {path} is not damaged: nothing moved aside\n")
        return
    if not replace:
        raise CommandError(
            f"delivery index {path} is damaged ({damage}): with deliver and the receiver"
            " stopped, canner rebuild-index --replace-damaged moves delivery.sqlite* aside and"
            " rebuilds it from receipts (docs/operator-guide.md, Recover)"
        )
    if lock_held(path.parent / "receiver.lock"):
        # A running receiver keeps writing into the file it opened, wherever it is moved.
        raise CommandError(
            f"canner-receiver is running on {path.parent} (it holds receiver.lock): stop it"
            " first (systemctl stop canner-receiver), then run rebuild-index --replace-damaged"
        )
    for old, new in sql.move_aside(path, io.now()):
        io.out.write(f"rebuild-index: damaged ({damage}): moved {old} aside to {new}\n")


def _rebuild(config: Config, data_dir: Path, io: Io) -> int:
    path = data_dir / inventory.INDEX_NAME
    upgrade_schema(path)
    receipts_dir = data_dir / "receipts"
    scan = None
    if io.err.isatty():
        total = sum(1 for _ in ReceiptStore(receipts_dir).object_ids())
        scan = ProgressLine(io.err, "reading receipts", total)
    archived = ArchivedIds(LedgerDir(data_dir / "ledger"))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        configure_connection(conn)
        index = ConnectionIndex(conn)
        known = sql.count_objects(conn.cursor())
        # The daemon's rescan and package restore, run inline: no reactor, no threads.
        rescan = ReceiptRescan(
            index=index,
            receipts=_CountedReceipts(receipts_dir, progress=scan),
            uploads=UploadStore(data_dir / "uploads"),
            journal=Journal(data_dir / "journal"),
            archived=archived.contains,
            object_ids=config.object_ids,
            run=run_inline,
            now=io.now,
        )
        scanned = result_now(rescan.run())
        if scan is not None:
            scan.finish()
        restore = PackageRestore(
            index=index,
            store=PackageStore(config.packages_path),
            run=run_inline,
            now=io.now,
            archived=archived.contains,
        )
        restored = result_now(restore.run())
    finally:
        conn.close()
    if restored:
        io.out.write(f"rebuild-index: {restored} packages restored from {config.packages_path}\n")
    damage, problems = scanned.damage, scanned.problems
    for line in damage:
        whose = "no legible object id" if line.object_id is None else f"object {line.object_id}"
        io.err.write(f"canner: rebuild-index: damaged journal line {line.describe()} ({whose})\n")
    for problem in problems:
        io.err.write(f"canner: rebuild-index skipped {problem}\n")
    io.out.write(
        f"rebuild-index: {known} objects were indexed, {scanned.added} added from receipts"
        f" ({scanned.read - scanned.added} appeared meanwhile)\n"
    )
    if damage:
        io.err.write(
            f"canner: {len(damage)} journal lines could not be read: the records they held are"
            " lost; the objects named that were added are flagged for an operator"
            " (canner deliveries --needs-operator)\n"
        )
    if problems:
        io.err.write(
            f"canner: {len(problems)} receipts were skipped: repair or move the files named"
            " above, then run rebuild-index again\n"
        )
    return 1 if problems or damage else 0
