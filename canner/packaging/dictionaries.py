"""``dictionaries/``: the zstd dictionaries of members that name theirs instead of holding it.

Today's Wget-AT pipelines (``--warc-zstd-dict-no-include``) upload ``.warc.zst`` files without
their dictionary frame, named ``<name>.<project>.<10-digit dict id>.warc.zst``; the project's
dictionary API (:mod:`canner.packaging.dictionary_api`) serves the dictionary.  Each one fetched
is kept here, once per id, as ``<dict id>-<sha256>.dict`` (the bytes the API served, fsynced
before the name appears, checked against the SHA-256 in the name whenever read), so a restart or
a rebuild never fetches it again.  A dictionary that cannot be had leaves a wait record,
``<dict id>.waiting.json`` (the project, the error, since when, attempts, the next attempt),
which ``canner status`` and the status page show; it goes once the dictionary is kept.
Blocking I/O.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import zstandard
from attrs import frozen

from canner import fs
from canner.packaging.megawarc import SKIPPABLE_MAGIC, ZSTD_MAGIC, read_dictionary

WAITING = ".waiting.json"
DICTIONARY = ".dict"
# A dictionary that cannot be had is asked for again after this long, doubling, at most MAX.
FIRST_RETRY = 15.0
MAX_RETRY = 900.0


def retry_delay(attempts: int) -> float:
    """Seconds until the next try for a dictionary that failed ``attempts`` times in a row."""
    return min(FIRST_RETRY * 2.0 ** min(max(attempts - 1, 0), 16), MAX_RETRY)


def dictionary_frame(served: bytes) -> bytes:
    """The skippable frame megawarc writes at the start of a dictionary's WARC: the bytes as the
    API served them when they are zstd-compressed, else those bytes compressed."""
    payload = served
    if not served.startswith(ZSTD_MAGIC):
        payload = zstandard.ZstdCompressor().compress(served)
    return SKIPPABLE_MAGIC + len(payload).to_bytes(4, "little") + payload


def usable(served: bytes) -> bool:
    """Whether the served bytes are a zstd dictionary (raw or compressed)."""
    try:
        return read_dictionary(dictionary_frame(served)) is not None
    except zstandard.ZstdError:
        return False


@frozen
class DictionaryWait:
    """A dictionary that could not be had yet (a wait record)."""

    dict_id: str
    project: str
    error: str
    since: float
    attempts: int
    next_attempt_at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "dict_id": self.dict_id,
            "project": self.project,
            "error": self.error,
            "since": self.since,
            "attempts": self.attempts,
            "next_attempt_at": self.next_attempt_at,
        }


@frozen
class DictionaryStore:
    """The dictionaries directory of a data directory."""

    root: Path

    def prepare(self) -> None:
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            fs.fsync_dir(self.root.parent)

    def load(self, dict_id: str) -> bytes | None:
        """The dictionary kept for ``dict_id``, or None.  A copy whose bytes no longer match the
        SHA-256 in its name is removed (it is fetched again)."""
        for path in self._kept(dict_id):
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == path.name[len(dict_id) + 1 : -len(DICTIONARY)]:
                return data
            path.unlink(missing_ok=True)
            fs.fsync_dir(self.root)
        return None

    def keep(self, dict_id: str, data: bytes) -> None:
        """Keep a dictionary, durably (content fsynced before the name, then the directory),
        and drop its wait record."""
        self.prepare()
        digest = hashlib.sha256(data).hexdigest()
        fs.publish_once(self.root, f"{dict_id}-{digest}{DICTIONARY}", data)
        (self.root / (dict_id + WAITING)).unlink(missing_ok=True)
        fs.fsync_dir(self.root)

    def wait(self, dict_id: str) -> DictionaryWait | None:
        try:
            doc = json.loads((self.root / (dict_id + WAITING)).read_bytes())
        except FileNotFoundError:
            return None
        return DictionaryWait(**doc)

    def record_wait(self, wait: DictionaryWait) -> None:
        """Replace ``wait``'s record (not fsynced: it is for operators, and is redone)."""
        self.prepare()
        data = json.dumps(wait.as_dict(), separators=(",", ":")).encode()
        fs.replace_file(self.root, wait.dict_id + WAITING, data, sync=False)

    def _kept(self, dict_id: str) -> list[Path]:
        if not self.root.is_dir():
            return []
        prefix = dict_id + "-"
        return sorted(
            self.root / name
            for name in os.listdir(self.root)
            if name.startswith(prefix) and name.endswith(DICTIONARY)
        )


def read_waits(root: Path) -> tuple[DictionaryWait, ...]:
    """Every wait record in ``root`` (none when it does not exist); unreadable ones skipped."""
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(WAITING))
    except OSError:
        return ()
    waits = []
    for name in names:
        try:
            waits.append(DictionaryWait(**json.loads((root / name).read_bytes())))
        except (OSError, ValueError, TypeError):
            continue
    return tuple(waits)
