"""The ledger's deletion of archived objects' local files (``canner.ledger.steps``)."""

from __future__ import annotations

from pathlib import Path

from canner.ledger.steps import leftovers, remove_leftovers, remove_receipts
from canner.store.receipts import ReceiptStore

ARCHIVED, LIVE = "a" * 32, "b" * 32


def test_only_archived_objects_lose_files_and_the_receipt_goes_in_its_own_step(
    tmp_path: Path,
) -> None:
    receipts = ReceiptStore(tmp_path / "receipts")
    uploads = tmp_path / "uploads"
    receipts.directory.mkdir()
    uploads.mkdir()
    names = {
        receipts.directory: [
            f"{oid}{suffix}"
            for oid in (ARCHIVED, LIVE)
            for suffix in (".json", ".meta.json", ".delivery.json", ".package.json")
        ],
        uploads: [ARCHIVED, f"{ARCHIVED}.info", f".tmp-{ARCHIVED}", LIVE, f"{LIVE}.info"],
    }
    for directory, files in names.items():
        for name in files:
            (directory / name).write_bytes(b"{}")

    found = leftovers(receipts, uploads, lambda oid: oid == ARCHIVED)
    assert sorted(p.name for p in found) == sorted(
        [
            f"{ARCHIVED}.meta.json",
            f"{ARCHIVED}.delivery.json",
            f"{ARCHIVED}.package.json",
            ARCHIVED,
            f"{ARCHIVED}.info",
        ]
    )
    remove_leftovers(receipts, uploads, found)
    # The receipt stays until its own step; the receiver's sweep owns tus temp files.
    assert sorted(p.name for p in receipts.directory.iterdir() if ARCHIVED in p.name) == [
        f"{ARCHIVED}.json"
    ]
    assert sorted(p.name for p in uploads.iterdir() if ARCHIVED in p.name) == [f".tmp-{ARCHIVED}"]
    remove_leftovers(receipts, uploads, found)  # a repeat after a crash: missing is done
    remove_receipts(receipts, [ARCHIVED, ARCHIVED])
    assert not receipts.receipt_path(ARCHIVED).exists()
    # The live object keeps everything.
    assert len([p for p in receipts.directory.iterdir() if LIVE in p.name]) == 4
    assert sorted(p.name for p in uploads.iterdir() if LIVE in p.name) == [LIVE, f"{LIVE}.info"]
