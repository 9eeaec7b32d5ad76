"""Local purge after verified delivery: selection (pure), then deletion (blocking I/O).

A delivered object's payload may go once IA's metadata shows the remote file with the right size
and MD5 (``verified_at``) and its project's retention has passed since delivery.  Deleting is
idempotent: a file already gone counts as deleted.  The receipt always stays.
"""

from __future__ import annotations

from canner import fs
from canner.delivery.index import QueueRow
from canner.tus.store import UploadStore


def purge_is_due(row: QueueRow, now: float) -> bool:
    """True when ``row`` may lose its local payload now."""
    return (
        row.state == "delivered"
        and row.verified_at is not None
        and row.purged_at is None
        and row.purge_after is not None
        and row.purge_after <= now
    )


def delete_payload(uploads: UploadStore, object_id: str) -> None:
    """Delete the artifact, its tus info sidecar and any tus temp files; missing is done."""
    uploads.remove(object_id)
    prefix = f"{fs.TEMP_PREFIX}{object_id}"
    for entry in uploads.directory.iterdir():
        if entry.name.startswith(prefix):
            entry.unlink(missing_ok=True)
    fs.fsync_dir(uploads.directory)
