"""The ledger's files in ``ledger/``: record lines, periods, the archived-id index, manifests.

For a ledger named ``<node>-<period>`` (``-2``, ``-3``... for later ledgers of a period that was
flushed early) there are three files:

``<name>.jsonl.zst``
    one record per line, sorted by object id: the receipt JSON exactly as served (its six fields,
    byte for byte), then project, filename, IA location and the delivered, verified, purged and
    released times.  Zstandard-compressed; this is what is uploaded.
``<name>.ids``
    the compact archived-id index: :data:`ID_RECORD` bytes per object (the 16 bytes of the id's
    32 hex digits, then ``released_at`` as a big-endian double), in the ledger's line order, so
    a binary search finds an id's line.  Written and fsynced with the ledger.
``<name>.json``
    the manifest: written (fsynced) only once the remote copy verified.  Its existence makes the
    ledger the owner of its records: from then on the receipts, side files and index rows of the
    ids in ``<name>.ids`` may be deleted, and no rescan or rebuild brings them back.

Pure parts (periods, record lines) and blocking file I/O; run the latter in a thread.
"""

from __future__ import annotations

import bisect
import calendar
import json
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import define, field, frozen

from canner import fs

ID_RECORD = 24
_RELEASED = struct.Struct(">d")
_HEX32 = re.compile(r"[0-9a-f]{32}")
SUFFIX = ".jsonl.zst"


# -- periods ---------------------------------------------------------------------------------


def period_of(when: float, period: str) -> str:
    """The UTC period holding ``when``: ``YYYY-MM-DD`` (day) or ``YYYY-MM`` (month)."""
    return time.strftime("%Y-%m-%d" if period == "day" else "%Y-%m", time.gmtime(when))


def period_end(name: str) -> float:
    """The Unix time at which period ``name`` (``YYYY-MM-DD`` or ``YYYY-MM``) ends."""
    parts = [int(p) for p in name.split("-")]
    if len(parts) == 3:
        return float(calendar.timegm((parts[0], parts[1], parts[2], 0, 0, 0)) + 86400)
    year, month = parts
    year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0)))


def period_sql(period: str) -> str:
    """SQL for the period of a row's archive key (the later of release and purge)."""
    fmt = "%Y-%m-%d" if period == "day" else "%Y-%m"
    return f"strftime('{fmt}', max(released_at, purged_at), 'unixepoch')"


# -- record lines ----------------------------------------------------------------------------

RECORD_FIELDS = (
    "project",
    "filename",
    "identifier",
    "remote_name",
    "delivered_at",
    "verified_at",
    "purged_at",
    "released_at",
)


def record_line(receipt_json: bytes, facts: Mapping[str, Any]) -> bytes:
    """One ledger line: the receipt's own bytes with the facts of :data:`RECORD_FIELDS` added
    at the end (compact JSON, one line, ``\\n``-terminated)."""
    body = receipt_json.rstrip()
    if not body.endswith(b"}") or b"\n" in body:
        raise ValueError("a receipt is one compact JSON object")
    extra = json.dumps(
        {k: facts[k] for k in RECORD_FIELDS}, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")
    return body[:-1] + b"," + extra[1:] + b"\n"


def id_key(object_id: str) -> bytes:
    """The 16 bytes an id is kept as in ``.ids`` files (its 32 hex digits)."""
    tail = object_id[-32:]
    if not _HEX32.fullmatch(tail):
        raise ValueError(f"{object_id!r} does not end in 32 lowercase hex digits")
    return bytes.fromhex(tail)


def id_record(object_id: str, released_at: float) -> bytes:
    return id_key(object_id) + _RELEASED.pack(released_at)


# -- manifests and the archived-id index -------------------------------------------------------


@frozen
class Manifest:
    """A verified ledger, as ``<name>.json`` records it."""

    name: str
    period: str
    records: int
    size: int
    md5: str
    blake3: str
    identifier: str
    remote_name: str
    url: str
    verified_at: float
    done_at: float | None = None

    def to_json(self) -> bytes:
        return json.dumps(
            {k: getattr(self, k) for k in _MANIFEST_FIELDS}, separators=(",", ":")
        ).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        return cls(**{k: raw.get(k) for k in _MANIFEST_FIELDS})


_MANIFEST_FIELDS = (
    "name",
    "period",
    "records",
    "size",
    "md5",
    "blake3",
    "identifier",
    "remote_name",
    "url",
    "verified_at",
    "done_at",
)


@frozen
class LedgerDir:
    """``ledger/`` in the data directory."""

    directory: Path

    def ledger_path(self, name: str) -> Path:
        return self.directory / f"{name}{SUFFIX}"

    def ids_path(self, name: str) -> Path:
        return self.directory / f"{name}.ids"

    def manifest_path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def write_manifest(self, manifest: Manifest) -> None:
        """Durably (re)write ``<name>.json``: the ledger now owns its records."""
        fs.replace_file(self.directory, f"{manifest.name}.json", manifest.to_json(), sync=True)
        fs.fsync_dir(self.directory)

    def manifests(self) -> list[Manifest]:
        """Every verified ledger (blocking), oldest name first; none when there is no dir."""
        found = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(".json") and not name.startswith(fs.TEMP_PREFIX):
                found.append(Manifest.from_json((self.directory / name).read_bytes()))
        return found

    def ids(self, name: str) -> Iterator[tuple[str, float]]:
        """``(32 hex digits, released_at)`` of each line of ledger ``name``, in order."""
        with open(self.ids_path(name), "rb") as f:
            while chunk := f.read(ID_RECORD * 4096):
                for at in range(0, len(chunk), ID_RECORD):
                    rec = chunk[at : at + ID_RECORD]
                    yield rec[:16].hex(), _RELEASED.unpack(rec[16:])[0]


@frozen
class Archived:
    """Where an archived object's record is."""

    manifest: Manifest
    line: int  # 1-based line of the ledger file
    released_at: float

    def as_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "ledger": m.name,
            "file": f"{m.name}{SUFFIX}",
            "line": self.line,
            "identifier": m.identifier,
            "remote_name": m.remote_name,
            "url": m.url,
            "verified_at": m.verified_at,
        }


class _Keys:
    """An ``.ids`` file as a sequence of 16-byte keys, for :func:`bisect`."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // ID_RECORD

    def __getitem__(self, i: int) -> bytes:
        return bytes(self.data[i * ID_RECORD : i * ID_RECORD + 16])


@define
class ArchivedIds:
    """The archived-id index of every verified ledger, memory-mapped (blocking reads).

    Re-reads the list of manifests when ``ledger/`` changes (its mtime), so a ledger verified by
    canner-deliver is seen by the receiver at its next lookup.
    """

    ledgers: LedgerDir
    _stamp: int | None = None
    _tables: list[tuple[Manifest, _Keys]] = field(factory=list)
    _lock: threading.Lock = field(factory=threading.Lock)

    def _refresh(self) -> None:
        try:
            stamp = os.stat(self.ledgers.directory).st_mtime_ns
        except FileNotFoundError:
            self._tables, self._stamp = [], None
            return
        if stamp == self._stamp:
            return
        tables = []
        for manifest in self.ledgers.manifests():
            with open(self.ledgers.ids_path(manifest.name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data: mmap.mmap | bytes = (
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
                )
            tables.append((manifest, _Keys(data)))
        self._tables, self._stamp = tables, stamp

    def find(self, object_id: str) -> Archived | None:
        """The verified ledger holding ``object_id``'s record, or None (thread-safe)."""
        try:
            key = id_key(object_id)
        except ValueError:
            return None
        with self._lock:
            self._refresh()
            tables = self._tables
        for manifest, keys in tables:
            i = bisect.bisect_left(keys, key)
            if i < len(keys) and keys[i] == key:
                start = i * ID_RECORD + 16
                released = _RELEASED.unpack(bytes(keys.data[start : start + 8]))[0]
                return Archived(manifest, i + 1, released)
        return None

    def contains(self, object_id: str) -> bool:
        return self.find(object_id) is not None
