"""The acceptance commit sequence, with inline blocking work and a fake clock."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import blake3
import pytest
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock

from canner.accept.acceptance import INLINE_HASH_MAX, Acceptance, AcceptanceFailed, ChecksumMismatch
from canner.blocking import run_inline
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import LockedUpload, UploadInfo, UploadStore
from tests.fakes import succeeded

OID = "0123456789abcdef0123456789abcdef"


class Env:
    def __init__(self, tmp_path: Path, runner: Any = run_inline) -> None:
        (tmp_path / "uploads").mkdir()
        (tmp_path / "receipts").mkdir()
        self.uploads = UploadStore(tmp_path / "uploads")
        self.receipts = ReceiptStore(tmp_path / "receipts")
        self.clock = Clock()
        self.clock.advance(1784764800.7)
        self.enqueued: list[tuple[Receipt, Origin]] = []
        self.acceptance = Acceptance(
            uploads=self.uploads,
            receipts=self.receipts,
            run=runner,
            hash=run_inline,
            clock=self.clock,
            issuer="https://canner.example",
            enqueue=lambda r, o: self.enqueued.append((r, o)),
        )

    def complete_upload(self, data: bytes, declared: bytes | None = None) -> LockedUpload:
        digest = blake3.blake3(declared if declared is not None else data).hexdigest()
        info = UploadInfo(OID, len(data), {"project": "example", "checksum": f"blake3:{digest}"}, 1)
        self.uploads.create(info)
        upload = self.uploads.open_locked(info)
        upload.write([data])
        return upload


def test_complete_upload_gets_a_durable_receipt_and_is_enqueued(tmp_path: Path) -> None:
    """Acceptance publishes the receipt, records the origin and enqueues the object."""
    env = Env(tmp_path)
    upload = env.complete_upload(b"hello world")
    receipt = succeeded(env.acceptance.accept(upload))
    assert receipt.size_bytes == 11
    assert receipt.accepted_at == 1784764800
    assert env.receipts.read(OID) == receipt
    assert env.receipts.read_origin(OID) == Origin("example", None)
    assert env.enqueued == [(receipt, Origin("example", None))]
    assert upload.fd == -1, "the lock is released when acceptance ends"


def test_checksum_mismatch_rejects_for_good(tmp_path: Path) -> None:
    """A mismatch raises, writes no receipt, marks the sidecar and frees the bytes."""
    env = Env(tmp_path)
    upload = env.complete_upload(b"hello world", declared=b"other bytes")
    with pytest.raises(ChecksumMismatch):
        succeeded(env.acceptance.accept(upload))
    assert env.receipts.read(OID) is None
    assert env.receipts.read_origin(OID) is None
    info = env.uploads.read_info(OID)
    assert info is not None and info.rejected is not None and "mismatch" in info.rejected
    assert env.uploads.offset(OID) == 0
    assert env.enqueued == []


def test_existing_receipt_is_returned_unchanged(tmp_path: Path) -> None:
    """Repeating acceptance returns the receipt already on disk, byte for byte."""
    env = Env(tmp_path)
    first = succeeded(env.acceptance.accept(env.complete_upload(b"abc")))
    env.clock.advance(500)
    info = env.uploads.read_info(OID)
    assert info is not None
    again = succeeded(env.acceptance.accept(env.uploads.open_locked(info)))
    assert again == first
    assert env.receipts.read_bytes(OID) == first.to_json()


class FlakyReceipts(ReceiptStore):
    """A ReceiptStore whose first receipt publication fails with ``error``."""

    error: OSError | None = None

    def commit(self, receipt: Receipt) -> Receipt:
        error, FlakyReceipts.error = FlakyReceipts.error, None
        if error is not None:
            raise error
        return super().commit(receipt)


@pytest.mark.parametrize("size", [7, INLINE_HASH_MAX + 1], ids=["inline", "hash-pool"])
@pytest.mark.parametrize(
    ("store", "code", "no_space"),
    [
        (FlakyReceipts, errno.ENOSPC, True),
        (FlakyReceipts, errno.EIO, False),
    ],
)
def test_failed_receipt_publication_leaves_the_upload_acceptable(
    tmp_path: Path, store: Any, code: int, no_space: bool, size: int
) -> None:
    """A receipt that could not be written fails acceptance; a retry then succeeds."""
    env = Env(tmp_path)
    env.acceptance._receipts = FlakyReceipts(env.receipts.directory)  # type: ignore[misc]
    store.error = OSError(code, os.strerror(code))
    upload = env.complete_upload(os.urandom(size))
    with pytest.raises(AcceptanceFailed) as caught:
        succeeded(env.acceptance.accept(upload))
    assert caught.value.no_space is no_space
    assert store.error is None, "the fault fired"
    assert env.receipts.read(OID) is None
    info = env.uploads.read_info(OID)
    assert info is not None and info.rejected is None
    receipt = succeeded(env.acceptance.accept(env.uploads.open_locked(info)))
    assert json.loads(env.receipts.read_bytes(OID) or b"")["size_bytes"] == size
    assert receipt.size_bytes == size


def test_large_mismatch_is_rejected_in_the_hash_pool(tmp_path: Path) -> None:
    """Uploads above INLINE_HASH_MAX hash in the hash pool and are rejected the same way."""
    env = Env(tmp_path)
    data = os.urandom(INLINE_HASH_MAX + 1)
    with pytest.raises(ChecksumMismatch):
        succeeded(env.acceptance.accept(env.complete_upload(data, declared=b"other")))
    info = env.uploads.read_info(OID)
    assert info is not None and info.rejected is not None
    assert env.receipts.read(OID) is None and env.uploads.offset(OID) == 0


def test_joiners_share_one_acceptance_and_may_cancel(tmp_path: Path) -> None:
    """in_flight() joins a running acceptance; cancelling a joiner does not stop it."""
    pending: list[Deferred[Any]] = []

    def slow_hash(f: Any, *args: Any) -> Deferred[Any]:
        d = run_inline(f, *args)
        gate: Deferred[Any] = Deferred()
        pending.append(gate)
        return gate.addCallback(lambda _: d).addCallback(lambda r: r)

    env = Env(tmp_path)
    env.acceptance._hash = slow_hash  # type: ignore[misc]
    first = env.acceptance.accept(env.complete_upload(os.urandom(INLINE_HASH_MAX + 1)))
    joined = env.acceptance.in_flight(OID)
    cancelled = env.acceptance.in_flight(OID)
    assert joined is not None and cancelled is not None
    cancelled.cancel()
    cancelled.addErrback(lambda f: f.trap(CancelledError))
    pending[0].callback(None)
    assert succeeded(first) == succeeded(joined)
    assert env.acceptance.in_flight(OID) is None
