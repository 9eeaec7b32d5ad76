"""The ledger's blocking steps: write a ledger file from its assigned records, and delete the
local state of records a verified ledger owns.  Run them in a thread.

Writing streams: records are read a page at a time through a read-only connection of its own,
each line is compressed as it is made, and MD5 and BLAKE3 are computed over the compressed bytes
on their way to disk, so memory stays bounded whatever the number of records.  Both files are
written under temp names, fsynced, renamed into place and the directory fsynced: a SIGKILL at any
point leaves either nothing or a complete file, and rewriting gives the same bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import blake3
import zstandard
from attrs import frozen

from canner import fs
from canner.delivery.index import BUSY_TIMEOUT_MS
from canner.ledger import store
from canner.ledger.files import LedgerDir, id_key, id_record, record_line
from canner.store.receipts import ReceiptStore

PAGE = 2000
READERS = 8
ZSTD_LEVEL = 3


@frozen
class Written:
    """A ledger file on disk."""

    records: int
    size: int
    md5: str
    blake3: str


class _HashingWriter:
    """A file object that hashes what passes through it (MD5 and BLAKE3) and counts it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.md5 = hashlib.md5(usedforsecurity=False)
        self.blake3 = blake3.blake3()
        self.size = 0

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.md5.update(chunk)
        self.blake3.update(chunk)
        self.size += len(chunk)
        return self.raw.write(chunk)

    def flush(self) -> None:
        self.raw.flush()


class LedgerError(Exception):
    """A ledger cannot be written (a record's receipt is missing or unreadable, ...)."""


def _read_only(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


def write_ledger(
    db: Path, ledgers: LedgerDir, receipts: ReceiptStore, ledger_id: int, name: str
) -> Written:
    """Write ``<name>.jsonl.zst`` and ``<name>.ids`` from the records assigned to ``ledger_id``."""
    ledgers.directory.mkdir(exist_ok=True)
    conn = _read_only(db)
    temps: list[Path] = []
    try:
        data_temp = ledgers.directory / f"{fs.TEMP_PREFIX}{name}.jsonl.zst"
        ids_temp = ledgers.directory / f"{fs.TEMP_PREFIX}{name}.ids"
        temps += [data_temp, ids_temp]
        with open(data_temp, "wb") as raw, open(ids_temp, "wb") as ids:
            out = _HashingWriter(raw)
            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            records, after, last_key = 0, "", b""
            with (
                compressor.stream_writer(out, closefd=False) as z,  # type: ignore[arg-type]
                ThreadPoolExecutor(READERS, thread_name_prefix="ledger-read") as readers,
            ):
                while page := store.records_page(conn.cursor(), ledger_id, after, PAGE):
                    # A page's receipts are read by several threads: each read waits on a
                    # lookup in a directory of millions of names, and they overlap.
                    oids = [r["object_id"] for r in page]
                    parts = [
                        oids[i : i + PAGE // READERS] for i in range(0, len(oids), PAGE // READERS)
                    ]
                    read = itertools.chain.from_iterable(
                        readers.map(_read_receipts, itertools.repeat(receipts), parts)
                    )
                    for rec, receipt in zip(page, read, strict=True):
                        oid = rec["object_id"]
                        key = id_key(oid)
                        if key <= last_key:
                            raise LedgerError(f"{oid}: ids not in order (mixed node prefixes?)")
                        last_key = key
                        if receipt is None:
                            raise LedgerError(f"{oid}: its receipt is missing")
                        facts = dict(rec)
                        facts["identifier"] = rec["remote_identifier"]
                        z.write(record_line(receipt, facts))
                        ids.write(id_record(oid, rec["released_at"]))
                        records += 1
                    after = page[-1]["object_id"]
            raw.flush()
            os.fsync(raw.fileno())
            ids.flush()
            os.fsync(ids.fileno())
        os.replace(data_temp, ledgers.ledger_path(name))
        os.replace(ids_temp, ledgers.ids_path(name))
        fs.fsync_dir(ledgers.directory)
        return Written(records, out.size, out.md5.hexdigest(), out.blake3.hexdigest())
    finally:
        conn.close()
        for temp in temps:
            temp.unlink(missing_ok=True)


def _read_receipts(receipts: ReceiptStore, object_ids: list[str]) -> list[bytes | None]:
    return [receipts.read_bytes(oid) for oid in object_ids]


# Files besides the receipt that an archived object may still have, by directory.
_RECEIPT_SIDES = (".meta.json", ".delivery.json", ".package.json")


def leftovers(receipts: ReceiptStore, uploads: Path, archived: Callable[[str], bool]) -> list[Path]:
    """The files of archived objects, other than their receipts, in ``receipts/`` and
    ``uploads/``: an origin record no purge moved to the journal (a packed member's, or one an
    older canner left), a delivery record of a 0.1 data directory, a packed member's package
    record, upload leftovers.  Few objects have any.

    One listing of each directory instead of a lookup per object and file: a lookup of a
    missing name in a directory of millions costs about 10 µs and waits for the unlinks
    running beside it, which made lookups most of the cost of deleting a ledger's state.  No
    file of an archived object is created after its ledger is verified, so the listing stays
    true while the deletion runs.
    """
    found = []
    for directory, object_id in ((receipts.directory, _receipt_side), (uploads, _upload_file)):
        with os.scandir(directory) as entries:
            for entry in entries:
                oid = object_id(entry.name)
                if oid is not None and archived(oid):
                    found.append(Path(entry.path))
    return found


def _receipt_side(name: str) -> str | None:
    for suffix in _RECEIPT_SIDES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _upload_file(name: str) -> str | None:
    if name.startswith(fs.TEMP_PREFIX):
        return None  # the receiver's sweep owns tus temp files
    return name.removesuffix(".info")


def remove_leftovers(receipts: ReceiptStore, uploads: Path, paths: list[Path]) -> None:
    """Delete :func:`leftovers` (missing is done), then make that durable."""
    for path in paths:
        path.unlink(missing_ok=True)
    fs.fsync_dir(receipts.directory)
    fs.fsync_dir(uploads)


def remove_receipts(receipts: ReceiptStore, object_ids: list[str]) -> None:
    """Delete the receipt files of archived objects; missing is done.  Only a caller whose
    ledger is verified (its manifest written), and whose :func:`leftovers` are gone, may call
    this: the receipt goes last, so a crash in between leaves it to be deleted again (the
    manifest keeps a rebuilt index from taking it back).  An object's release, delivery and
    origin records are in the journal, which :meth:`~canner.store.journal.JournalLog.remove_spent`
    prunes.  The caller fsyncs ``receipts/``.
    """
    for oid in object_ids:
        receipts.receipt_path(oid).unlink(missing_ok=True)


def id_batches(
    ledgers: LedgerDir, name: str, full_id: Callable[[str], str], size: int = 1000
) -> Iterator[list[str]]:
    """The object ids of ledger ``name``, ``size`` at a time (the ``.ids`` file is the truth);
    lazy, so memory stays bounded."""
    batch: list[str] = []
    for tail, _ in ledgers.ids(name):
        batch.append(full_id(tail))
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
