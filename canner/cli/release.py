"""``canner release``: release receipts as HQ does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from canner.cli.base import (
    Io,
    become_data_dir_owner,
    existing_data_dir,
    line,
    resolve_object_id,
    transact,
)
from canner.config import load_config
from canner.hq import releases as rel
from canner.ledger.files import ArchivedIds, LedgerDir
from canner.store.journal import Journal


def release(config_path: Path, given: Sequence[str], io: Io) -> int:
    """Release receipts as HQ would (``canner release ID...``): one JSON line per id; exit 1
    when any was refused (not delivered and verified yet, or unknown)."""
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    receipt_ids = []
    for text in given:
        oid = rel.object_id_of(text) or text
        if not config.object_ids.is_valid(oid):
            oid = resolve_object_id(config, oid)
        receipt_ids.append(f"receipt:{oid}")
    oids = [rel.object_id_of(r) for r in receipt_ids]
    now = io.now()
    journal = Journal(data_dir / "journal")
    candidates, released = transact(data_dir, rel.release_known, journal, oids, now, "operator")
    archived_ids = ArchivedIds(LedgerDir(data_dir / "ledger"))
    archived = {}
    for oid in oids:
        where = archived_ids.find(oid) if oid not in candidates else None
        if where is not None:
            archived[oid] = where.released_at
    answers, _ = rel.classify(receipt_ids, candidates, archived, config.object_ids.is_valid)
    results = rel.finish_answers(receipt_ids, answers, released, now)
    for result in results:
        line(io, result.as_dict())
    refused = [r for r in results if r.status in (rel.NOT_DELIVERED, rel.UNKNOWN)]
    for r in refused:
        io.err.write(f"canner: {r.id}: {r.status.replace('_', ' ')}\n")
    return 1 if refused else 0
