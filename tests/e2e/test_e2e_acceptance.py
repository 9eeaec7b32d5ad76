"""Acceptance as a worker sees it: checksum mismatches, repeated final requests, interrupted and
concurrent PATCHes, and ``X-HTTP-Method-Override``."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
from e2e_support import (
    OFFSET_TYPE,
    TUS_VERSION,
    Receiver,
    Trickle,
    blake3_hex,
    read_http_response,
)

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + size).randbytes(size)


# -- 3. wrong checksum ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["one-patch", "three-patches"])
def test_wrong_checksum_is_422_and_never_receipted(receiver: Receiver, chunked: bool) -> None:
    rcv = receiver
    data = payload(300_000)
    declared = blake3_hex(b"something else entirely")
    oid = rcv.new_upload(data, checksum=declared)
    offset = 0
    if chunked:
        for end in (100_000, 200_000):
            r = rcv.patch(oid, offset, data[offset:end])
            assert r.status_code == 204
            offset = end
    final = rcv.patch(oid, offset, data[offset:])
    assert final.status_code == 422, f"final PATCH with a wrong checksum: {final.status_code}"
    assert "Artifact-Receipt" not in final.headers
    assert not (rcv.receipts_dir / f"{oid}.json").exists()
    assert rcv.get_receipt(oid).status_code == 404

    again = rcv.patch(oid, len(data), b"")  # repeated final request: offset == length, no body
    assert again.status_code == 422, f"repeated final PATCH after 422: {again.status_code}"
    assert "Artifact-Receipt" not in again.headers
    restart = rcv.patch(oid, 0, data)  # nor can it be uploaded anew
    assert restart.status_code == 422, f"re-upload after 422: {restart.status_code}"

    head = rcv.head(oid)
    assert head.status_code == 410, f"HEAD after 422: {head.status_code}"
    assert "Artifact-Receipt" not in head.headers
    assert rcv.get_receipt(oid).status_code == 404

    # Never, not even after a restart that rebuilds everything from the disk.
    rcv.restart()
    assert rcv.head(oid).status_code == 410
    assert rcv.patch(oid, len(data), b"").status_code == 422
    assert rcv.get_receipt(oid).status_code == 404
    assert not (rcv.receipts_dir / f"{oid}.json").exists()
    assert rcv.receipt_ids_on_disk() == []


# -- big uploads: hashed while they stream ------------------------------------------------------

# Over canner.store.uploads.TRAILING_HASH_MIN: read back and hashed as it is written.
BIG = 256 * MiB + 4321


def test_a_big_upload_resumed_after_a_crash_is_receipted_for_its_stored_bytes(
    make_receiver: Callable[..., Receiver],
) -> None:
    """The hash of the first PATCH dies with the process; the second PATCH catches up with those
    bytes from the file, and the receipt matches what is stored.  Declared with another
    checksum, the same bytes get 422 and no receipt."""
    rcv = make_receiver(max_upload_bytes=BIG)
    data = os.urandom(BIG)
    oid = rcv.new_upload(data)
    assert rcv.patch(oid, 0, data[: 100 * MiB]).status_code == 204
    rcv.restart()  # SIGKILL
    offset = rcv.offset(oid)
    final = rcv.patch(oid, offset, data[offset:])
    assert final.status_code == 204, f"final PATCH: {final.status_code} {final.text}"
    rcv.verify_receipt(final.headers.get("Artifact-Receipt"), oid, data)
    assert rcv.stored(oid) == data

    wrong = rcv.new_upload(data, checksum=blake3_hex(b"other bytes"))
    refused = rcv.patch(wrong, 0, data)
    assert refused.status_code == 422, f"wrong checksum: {refused.status_code}"
    assert "Artifact-Receipt" not in refused.headers
    assert not (rcv.receipts_dir / f"{wrong}.json").exists()


# -- 8. repeated final PATCH after success --------------------------------------------------------


def test_repeated_final_patch_returns_the_same_receipt(receiver: Receiver) -> None:
    rcv = receiver
    data = payload(12345)
    oid, header = rcv.upload_all(data, chunk=5000)
    rcv.verify_receipt(header, oid, data)

    again = rcv.patch(oid, len(data), b"")
    assert again.status_code == 204, f"repeated final PATCH: {again.status_code} {again.text}"
    assert again.headers.get("Artifact-Receipt") == header
    assert int(again.headers["Upload-Offset"]) == len(data)

    head = rcv.head(oid)
    assert head.status_code == 200
    assert int(head.headers["Upload-Offset"]) == len(data) == int(head.headers["Upload-Length"])
    assert head.headers.get("Artifact-Receipt") == header

    # Late bytes are refused and change nothing; so is a PATCH at an old offset.
    assert rcv.patch(oid, len(data), b"x").status_code == 413
    assert rcv.patch(oid, 0, data).status_code == 409
    assert rcv.stored(oid) == data

    rcv.restart()
    again = rcv.patch(oid, len(data), b"")
    assert again.status_code == 204
    assert again.headers.get("Artifact-Receipt") == header
    assert rcv.head(oid).headers.get("Artifact-Receipt") == header
    rcv.verify_receipt(header, oid, data)


# -- 4. PATCH cut off mid-body --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "declared", "sent"),
    [
        (200_000, 200_000, 12_345),
        (1000, 1000, 0),
        (4 * MiB + 3, 4 * MiB + 3, 3 * MiB + 7),
        (300_000, 100_000, 99_999),  # a PATCH for part of the upload, cut one byte short
    ],
    ids=["12345-of-200000", "0-of-1000", "3MiB+7-of-4MiB+3", "partial-patch"],
)
def test_cut_off_patch_keeps_received_bytes(
    shared_receiver: Receiver, length: int, declared: int, sent: int
) -> None:
    rcv = shared_receiver
    data = payload(length, seed=1)
    oid = rcv.new_upload(data)
    with rcv.open_patch(oid, 0, declared) as sock:
        # send in pieces, then drop the connection without sending the rest
        view = memoryview(data)[:sent]
        while view:
            sock.sendall(view[:65536])
            view = view[65536:]
    offset = rcv.wait_offset(oid, sent)
    assert offset == sent, f"HEAD shows offset {offset} after {sent} bytes were received"
    assert rcv.stored(oid) == data[:sent]
    assert rcv.get_receipt(oid).status_code == 404

    r = rcv.patch_retrying_locked(oid, sent, data[sent:])
    assert r.status_code == 204, f"resuming at {sent}: {r.status_code} {r.text}"
    assert int(r.headers["Upload-Offset"]) == length
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)


# -- concurrent PATCHes ---------------------------------------------------------------------------


def test_concurrent_patch_is_refused_without_interleaving(shared_receiver: Receiver) -> None:
    """While one PATCH keeps sending, others get 409/423 and write nothing; the first ends
    normally.  (A PATCH that stalls is taken over instead: test_e2e_real_networks.)"""
    rcv = shared_receiver
    data = payload(300_000, seed=2)
    other = payload(300_000, seed=3)
    oid = rcv.new_upload(data)
    with rcv.open_patch(oid, 0, len(data), data[:100_000]) as sock:
        assert rcv.wait_offset(oid, 100_000) == 100_000, "the slow PATCH's bytes did not land"
        with Trickle(sock, data[100_000:200_000]) as live:
            for offset in (0, 100_000):
                second = rcv.patch(oid, offset, other[offset:])
                assert second.status_code in (409, 423), (
                    f"second PATCH at {offset} while one is streaming: {second.status_code}"
                )
                assert "Artifact-Receipt" not in second.headers
            sent = 100_000 + live.stop()
        assert rcv.wait_offset(oid, sent) == sent
        assert rcv.stored(oid) == data[:sent], "a refused PATCH wrote into the upload"
        sock.sendall(data[sent:])
        status, headers, _ = read_http_response(sock, "PATCH")
    assert status == 204, f"the first PATCH, finished after the refused ones: {status}"
    assert int(headers["Upload-Offset"]) == len(data)
    assert rcv.stored(oid) == data
    rcv.verify_receipt(headers.get("Artifact-Receipt"), oid, data)


# -- X-HTTP-Method-Override -----------------------------------------------------------------------


def test_method_override_patch_via_post(shared_receiver: Receiver) -> None:
    rcv = shared_receiver
    data = payload(50_000, seed=4)
    oid = rcv.new_upload(data)
    headers = {
        "Tus-Resumable": TUS_VERSION,
        "X-HTTP-Method-Override": "PATCH",
        "Content-Type": OFFSET_TYPE,
    }
    url = rcv.upload_url(oid)
    first = rcv.request("POST", url, headers={**headers, "Upload-Offset": "0"}, data=data[:20_000])
    assert first.status_code == 204, f"PATCH via POST override: {first.status_code} {first.text}"
    assert first.headers["Upload-Offset"] == "20000"
    assert "Location" not in first.headers, "the override created an upload instead"
    wrong = rcv.request("POST", url, headers={**headers, "Upload-Offset": "0"}, data=b"zz")
    assert wrong.status_code == 409
    final = rcv.request(
        "POST", url, headers={**headers, "Upload-Offset": "20000"}, data=data[20_000:]
    )
    assert final.status_code == 204
    assert final.headers["Upload-Offset"] == str(len(data))
    rcv.verify_receipt(final.headers.get("Artifact-Receipt"), oid, data)
    assert rcv.stored(oid) == data


def test_creation_with_upload_completes_in_the_post(shared_receiver: Receiver) -> None:
    rcv = shared_receiver
    data = payload(70_000, seed=5)
    r = rcv.create(len(data), blake3_hex(data), body=data)
    assert r.status_code == 201, r.text
    assert r.headers["Upload-Offset"] == str(len(data))
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), rcv.object_id(r), data)

    part = rcv.create(len(data), blake3_hex(data), body=data[:1000])
    assert part.status_code == 201
    assert part.headers["Upload-Offset"] == "1000"
    assert "Artifact-Receipt" not in part.headers
    oid = rcv.object_id(part)
    r = rcv.patch(oid, 1000, data[1000:])
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)
