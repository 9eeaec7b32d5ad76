"""Start-up after a power cut: every upload in flight is cut back to its durable offset.

After a power cut a data file can come back at the length the kernel had reached, its bytes past
the last fsync zeros (ext4 commits the size before the data).  HEAD answers the data file's size,
so before the receiver reads ``uploads/`` (the promises, the first request) every upload without
a receipt is truncated to what its sidecar records as durable (see ``canner.store.uploads``): the
worker resumes from bytes that are really its own.

Only after the machine restarted: a receiver killed (SIGKILL, OOM, a crash) leaves its written
bytes in the page cache, which outlives the process, so within one boot the data file's size is
exact and nothing is cut.  ``receiver.boot`` in the data directory records the kernel's boot id
(``/proc/sys/kernel/random/boot_id``) of the last start, written durably once the cut is done: a
start under another boot id (a power cut, a reboot, the volume moved to another machine), or with
no readable record, cuts; a crash during the cut leaves the old record, so the next start cuts
again.  Where the boot id cannot be read, every start cuts.

Left alone: a sidecar from before the durable offset existed (its ``Offset`` means nothing; the
file's size counts, as it did), an unreadable one (the sweep's), a rejected upload, and a complete
upload whose acceptance recorded its origin: that record is written only once acceptance has
fsynced the data (``Acceptance.sync_upload``), so its whole length is durable.  Its name counts,
not its content: acceptance writes the record without an fsync of its own
(``ReceiptStore.write_origin``), so a power cut may leave it empty beside a committed receipt.

Such a torn record reads as none (``ReceiptStore.read_origin``), and :func:`accepted_origin` reads
the upload's sidecar instead, which acceptance fsynced before it began the record and which stays
until the payload is purged.  A purge journals the object's origin (from its index row) durably
before it removes the payload, so an object whose sidecar is gone has its origin in the facts
journal, which the rescan reads; only the rescan rewrites a torn record (``record_origin``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from twisted.logger import Logger

from canner import fs
from canner.ids import ObjectIds
from canner.store.promises import open_uploads
from canner.store.receipts import Origin, ReceiptStore
from canner.store.uploads import CorruptInfo, UploadInfo, UploadStore

log = Logger()

# The kernel's id of the running boot: a new random UUID at every boot.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Where the receiver records the boot it last started in, in the data directory.
BOOT_RECORD = "receiver.boot"


def current_boot_id(source: Path = BOOT_ID) -> str | None:
    """The running boot's id; None when the kernel does not say."""
    try:
        return source.read_text("ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def cut_after_restart(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    data_dir: Path,
    boot_id: str | None,
    found: Iterable[tuple[str, UploadInfo | None]] | None = None,
) -> int:
    """Cut every upload in flight back to its durable offset unless the last start was in this
    same boot (``boot_id``, see the module docstring), then record this boot (blocking; start-up,
    before anything reads or writes ``uploads/``); returns how many uploads were cut.
    ``found`` as :func:`cut_to_durable_offsets`'s."""
    record = data_dir / BOOT_RECORD
    try:
        recorded: str | None = record.read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        recorded = None
    if boot_id is not None and recorded == boot_id:
        return 0  # only the process died since: the page cache kept every byte it wrote
    cut = cut_to_durable_offsets(uploads, receipts, ids, found)
    if boot_id is not None:
        try:
            fs.replace_file(data_dir, BOOT_RECORD, f"{boot_id}\n".encode("ascii"), sync=True)
            fs.fsync_dir(data_dir)
        except OSError as e:
            # The next start in this boot cuts again (what it would have kept, it sends again).
            log.warn("could not record the boot in {path}: {error}", path=str(record), error=str(e))
    return cut


def cut_to_durable_offsets(
    uploads: UploadStore,
    receipts: ReceiptStore,
    ids: ObjectIds,
    found: Iterable[tuple[str, UploadInfo | None]] | None = None,
) -> int:
    """Truncate each upload in flight to its durable offset (blocking; start-up, before anything
    reads or writes ``uploads/``); returns how many were cut.  ``found``: the uploads in flight
    as :func:`~canner.store.promises.open_uploads` yields them, read already by the caller
    (start-up's one pass); None reads them now."""
    if found is None:
        found = open_uploads(uploads, receipts, ids)
    cut = 0
    for upload_id, info in found:
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


def accepted_origin(receipts: ReceiptStore, uploads: UploadStore, object_id: str) -> Origin | None:
    """The origin of ``object_id`` from the data directory (blocking): its origin record, or,
    when that is missing or torn (see the module docstring), its upload's sidecar; None when
    neither holds one (the payload was purged: the facts journal has it)."""
    origin = receipts.read_origin(object_id)
    if origin is not None:
        return origin
    try:
        info = uploads.read_info(object_id)
    except CorruptInfo:
        return None
    return None if info is None else info.origin
