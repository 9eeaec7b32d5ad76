"""``canner ledger`` (list the ledgers) and ``canner ledger flush`` (archive now)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from canner.cli.base import (
    CommandError,
    Io,
    become_data_dir_owner,
    existing_data_dir,
    line,
    transact,
)
from canner.config import load_config
from canner.fs import lock_held
from canner.ledger import store as ledger_store
from canner.ledger.files import LedgerDir, Manifest
from canner.ops import inventory


def _ledger_doc(row: ledger_store.LedgerRow, manifest: Manifest | None) -> dict[str, Any]:
    return {
        "name": row.name,
        "period": row.period,
        "state": row.state,
        "records": row.records,
        "bytes": row.bytes,
        "md5": row.md5,
        "blake3": row.blake3,
        "identifier": row.identifier,
        "remote_name": row.remote_name,
        "url": manifest.url if manifest else None,
        "created_at": row.created_at,
        "written_at": row.written_at,
        "uploaded_at": row.uploaded_at,
        "verified_at": row.verified_at,
        "done_at": row.done_at,
        "needs_operator": bool(row.needs_operator),
        "last_error": row.last_error,
    }


NO_LEDGER = (
    "no [ledger] table in the config: this node writes no ledgers (released records stay"
    " local); see docs/operator-guide.md for [ledger]"
)


def list_ledgers(config_path: Path, io: Io) -> int:
    """``canner ledger``: one JSON line per ledger (the index, and verified ones on disk).

    Without ``[ledger]`` it says so and exits 2, like a usage error: the command does not apply
    to this node as configured, which a script must be able to tell from 1, a failure."""
    config = load_config(config_path)
    if config.ledger is None:
        io.err.write(f"canner: {NO_LEDGER}\n")
        return 2
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    for doc in _ledger_docs(data_dir):
        line(io, doc)
    return 0


def _ledger_docs(data_dir: Path) -> list[dict[str, Any]]:
    manifests = {m.name: m for m in LedgerDir(data_dir / "ledger").manifests()}
    conn = inventory.open_read_only(data_dir / inventory.INDEX_NAME)
    try:
        rows = ledger_store.ledgers(conn.cursor())
    finally:
        conn.close()
    docs = [_ledger_doc(row, manifests.pop(row.name, None)) for row in rows]
    for m in manifests.values():  # verified, and not (yet) known to a rebuilt index
        docs.append(
            {
                "name": m.name,
                "period": m.period,
                "state": "done" if m.done_at else "deleting",
                "records": m.records,
                "bytes": m.size,
                "md5": m.md5,
                "blake3": m.blake3,
                "identifier": m.identifier,
                "remote_name": m.remote_name,
                "url": m.url,
                "created_at": None,
                "written_at": None,
                "uploaded_at": None,
                "verified_at": m.verified_at,
                "done_at": m.done_at,
                "needs_operator": False,
                "last_error": None,
            }
        )
    return docs


def _read_flush(data_dir: Path) -> tuple[tuple[float, float | None] | None, int]:
    conn = inventory.open_read_only(data_dir / inventory.INDEX_NAME)
    try:
        return ledger_store.flush_state(conn.cursor()), ledger_store.unfinished(conn.cursor())
    finally:
        conn.close()


def flush_ledger(config_path: Path, timeout: float, io: Io) -> int:
    """``canner ledger flush``: ask canner-deliver to close the current period now and archive
    every record past ``delay``; wait until every ledger is done (or ``timeout``)."""
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    if config.ledger is None:
        io.err.write(f"canner: {NO_LEDGER}\n")
        return 2
    if not lock_held(data_dir / "deliver.lock"):
        raise CommandError("canner-deliver is not running: it writes and uploads the ledgers")
    requested = io.now()
    deadline = time.monotonic() + timeout
    while True:
        try:
            transact(data_dir, ledger_store.request_flush, requested)
            break
        except sqlite3.OperationalError:
            # canner-deliver holds the write lock (a large deletion commits): try again.
            if time.monotonic() > deadline:
                raise
    while True:
        # Read-only: never waits behind canner-deliver's writes (WAL readers do not block).
        state, unfinished = _read_flush(data_dir)
        if state is not None and state[1] is not None and unfinished == 0:
            break
        if time.monotonic() > deadline:
            for doc in _ledger_docs(data_dir):
                if doc["state"] != "done":
                    io.err.write(
                        f"canner: ledger {doc['name']} is {doc['state']}: "
                        f"{doc['last_error'] or 'in progress'}\n"
                    )
            raise CommandError(f"the flush did not finish within {timeout:.0f}s")
        time.sleep(0.2)
    for doc in _ledger_docs(data_dir):
        line(io, doc)
    return 0
