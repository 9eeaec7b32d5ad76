"""Start-up: cut every upload in flight back to the offset whose bytes are durable.

After a power cut a data file can come back at the length the kernel had reached, its bytes past
the last fsync zeros (ext4 commits the size before the data).  HEAD answers the data file's size,
so before the receiver reads ``uploads/`` (the promises, the first request) every upload without
a receipt is truncated to what its sidecar records as durable (see ``canner.tus.store``): the
worker resumes from bytes that are really its own.  A SIGKILL loses nothing on disk, but cannot
be told from a power cut: what a PATCH wrote after its last checkpoint is sent again.

Left alone: a sidecar from before the durable offset existed (its ``Offset`` means nothing; the
file's size counts, as it did), an unreadable one (the sweep's), a rejected upload, and a complete
upload whose acceptance recorded its origin: that record is written only once acceptance has
fsynced the data (``Acceptance.sync_upload``), so its whole length is durable.
"""

from __future__ import annotations

from twisted.logger import Logger

from canner import fs
from canner.ids import ObjectIds
from canner.promises import open_uploads
from canner.receipts import ReceiptStore
from canner.tus.store import UploadStore

log = Logger()


def cut_to_durable_offsets(uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds) -> int:
    """Truncate each upload in flight to its durable offset (blocking; start-up, before anything
    reads or writes ``uploads/``); returns how many were cut."""
    cut = 0
    for upload_id, info in open_uploads(uploads, receipts, ids):
        if info is None or info.durable is None:
            continue
        keep = info.durable
        if receipts.origin_path(upload_id).exists():
            keep = info.size  # acceptance fsynced it all (see above)
        try:
            length = uploads.cut_back(upload_id, keep)
        except fs.Locked:
            continue  # written by someone else right now: not an upload a crash left
        if length is None:
            continue
        cut += 1
        log.info(
            "{object_id} cut back from {length} to its durable offset {offset}: the bytes after"
            " it were written after its last fsync, and an unclean stop may have left zeros",
            object_id=upload_id,
            length=length,
            offset=keep,
        )
    return cut
