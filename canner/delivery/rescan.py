"""Receipts on disk -> rows missing from the delivery index.

``receipts/`` is the source of truth for what was accepted.  :func:`missing_objects` lists the
receipts the index does not know and reads each one with its origin record (or, for a receipt
whose origin record was never written, the upload's info sidecar) and, for an object whose payload
was purged after delivery, its delivery record.  Blocking; run in a thread.
"""

from __future__ import annotations

from collections.abc import Set

from twisted.logger import Logger

from canner.delivery.index import AcceptedObject
from canner.ids import ObjectIds
from canner.receipts import Origin, ReceiptStore
from canner.tus.store import CorruptInfo, UploadStore

log = Logger()


def _origin(receipts: ReceiptStore, uploads: UploadStore, object_id: str) -> Origin | None:
    origin = receipts.read_origin(object_id)
    if origin is not None:
        return origin
    try:
        info = uploads.read_info(object_id)
    except CorruptInfo:
        info = None
    if info is None:
        return None
    origin = Origin(info.project, info.filename)
    receipts.record_origin(object_id, origin)
    return origin


def missing_objects(
    receipts: ReceiptStore, uploads: UploadStore, ids: ObjectIds, known: Set[str]
) -> list[AcceptedObject]:
    """Every receipt on disk whose object id is not in ``known``, with its origin.

    A receipt that cannot be read, or whose project cannot be recovered, is logged and skipped
    (it is retried at the next rescan), never fatal.
    """
    found = []
    for object_id in receipts.object_ids():
        if object_id in known or not ids.is_valid(object_id):
            continue
        try:
            receipt = receipts.read(object_id)
            origin = _origin(receipts, uploads, object_id)
        except (OSError, ValueError, KeyError) as e:
            log.error("rescan skipped {object_id}: {error}", object_id=object_id, error=str(e))
            continue
        if receipt is None:
            continue
        if origin is None:
            log.error(
                "rescan skipped {object_id}: no origin record and no info sidecar names its"
                " project",
                object_id=object_id,
            )
            continue
        found.append(AcceptedObject.of(receipt, origin, receipts.read_delivery(object_id)))
    return found
