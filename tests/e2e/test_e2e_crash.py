"""SIGKILL at random moments while uploads stream in; nothing accepted may be lost or wrong, and
every started upload must still be finishable.

Phase 1: three worker threads run 30 uploads (1 B to 4 MiB, random chunk sizes) with plain
``requests`` PATCHes.  The main thread SIGKILLs the receiver 2-4 times at random points of the
overall progress and restarts it.  A worker whose request dies with the process notes the upload
as interrupted, waits for the receiver to answer again, and moves on to its next upload.
Phase 2: one more SIGKILL and restart once the workers are done (3-5 kills in all).  Then:
every ``receipts/*.json`` matches the BLAKE3 and size of ``uploads/{id}``; every receipt a worker
was given is still served unchanged; every interrupted upload resumes from its HEAD offset (whose
stored prefix is the worker's bytes) and gets a receipt; and there are exactly as many receipts
as uploads.

The seed is fixed (override with ``CANNER_E2E_SEED``) and printed.

A power cut can leave more than a SIGKILL does: an info sidecar emptied (its rename reached the
disk before its content).  That state is written by hand, and the receiver restarted on it.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass

import pytest
import requests
from e2e_support import (
    ISSUER,
    OFFSET_TYPE,
    RECEIPT_FIELDS,
    TUS_VERSION,
    Receiver,
    blake3_hex,
    decode_receipt_header,
    upload_metadata,
)

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("CANNER_E2E_SEED", "20261129"))
UPLOADS = 30
WORKERS = 3
MAX_SIZE = 4 * 1024 * 1024
PHASE_TIMEOUT = 90.0
REQUEST_TIMEOUT = 20.0


@dataclass
class Job:
    index: int
    data: bytes
    chunk: int
    checksum: str = ""
    object_id: str | None = None
    receipt: str | None = None
    interrupted: bool = False
    creations: int = 0

    def __post_init__(self) -> None:
        self.checksum = blake3_hex(self.data)


class Progress:
    """Bytes accounted for by the workers (sent, or given up on after an interruption)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0
        self.errors: list[str] = []

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n

    def error(self, message: str) -> None:
        with self._lock:
            self.errors.append(message)


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for i in range(UPLOADS):
        if i % 2:
            size = rng.randint(1, MAX_SIZE)
        else:  # log-uniform: plenty of small ones too
            size = max(1, min(MAX_SIZE, int(2 ** rng.uniform(0, 22))))
        chunk = rng.choice([4096, 65536, 300_000, 1 << 20, MAX_SIZE])
        jobs.append(Job(i, rng.randbytes(size), chunk))
    return jobs


def wait_up(rcv: Receiver, session: requests.Session, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with session.get(f"{rcv.base_url}/healthz", timeout=2) as r:
                if r.status_code == 200:
                    return True
        except requests.RequestException:
            pass
        time.sleep(0.05)
    return False


def run_job(rcv: Receiver, session: requests.Session, job: Job, progress: Progress) -> None:
    size = len(job.data)
    headers = {
        "Tus-Resumable": TUS_VERSION,
        "Upload-Length": str(size),
        "Upload-Metadata": upload_metadata(job.checksum),
    }
    for _attempt in range(10):
        job.creations += 1
        try:
            with session.post(rcv.files_url, headers=headers, timeout=REQUEST_TIMEOUT) as r:
                status, location = r.status_code, r.headers.get("Location")
        except requests.RequestException:
            # The POST died with the receiver: its upload, if created, is an orphan.
            wait_up(rcv, session)
            continue
        if status != 201 or not location:
            progress.error(f"job {job.index}: creation answered {status}")
            progress.add(size)
            return
        job.object_id = location.rsplit("/", 1)[1]
        break
    else:
        progress.error(f"job {job.index}: could not create an upload")
        progress.add(size)
        return
    offset = 0
    try:
        while offset < size:
            body = job.data[offset : offset + job.chunk]
            with session.patch(
                rcv.upload_url(job.object_id),
                headers={
                    "Tus-Resumable": TUS_VERSION,
                    "Upload-Offset": str(offset),
                    "Content-Type": OFFSET_TYPE,
                },
                data=body,
                timeout=REQUEST_TIMEOUT,
            ) as r:
                status, new_offset = r.status_code, r.headers.get("Upload-Offset")
                receipt = r.headers.get("Artifact-Receipt")
            if status != 204 or new_offset != str(offset + len(body)):
                progress.error(
                    f"job {job.index} ({job.object_id}): PATCH at {offset} answered {status}, "
                    f"offset {new_offset}"
                )
                progress.add(size - offset)
                return
            offset += len(body)
            progress.add(len(body))
            if offset == size:
                if not receipt:
                    progress.error(f"job {job.index}: final PATCH without a receipt")
                job.receipt = receipt
    except requests.RequestException:
        job.interrupted = True
        progress.add(size - offset)
        wait_up(rcv, session)


def worker(rcv: Receiver, jobs: list[Job], progress: Progress, stop: threading.Event) -> None:
    with requests.Session() as session:
        for job in jobs:
            if stop.is_set():
                return
            run_job(rcv, session, job, progress)


def check_receipts_on_disk(rcv: Receiver) -> list[str]:
    ids = rcv.receipt_ids_on_disk()
    for oid in ids:
        raw = (rcv.receipts_dir / f"{oid}.json").read_bytes()
        doc = json.loads(raw)
        assert list(doc) == RECEIPT_FIELDS, f"{oid}: fields {list(doc)}"
        assert doc["object_id"] == oid and doc["id"] == f"receipt:{oid}"
        assert doc["issuer"] == ISSUER
        assert type(doc["accepted_at"]) is int
        stored = rcv.stored(oid)
        assert len(stored) == doc["size_bytes"], (
            f"SEED={SEED}: receipt {oid} says {doc['size_bytes']} bytes, "
            f"uploads/{oid} has {len(stored)}"
        )
        assert blake3_hex(stored) == doc["checksum"], (
            f"SEED={SEED}: uploads/{oid} does not hash to its receipt's checksum"
        )
    return ids


def test_sigkill_during_uploads_loses_nothing(receiver: Receiver) -> None:
    rcv = receiver
    print(f"crash test seed: SEED={SEED} (set CANNER_E2E_SEED to replay)")
    rng = random.Random(SEED)
    jobs = make_jobs(rng)
    total = sum(len(j.data) for j in jobs)
    kills_during = rng.randint(2, 4)
    thresholds = sorted(rng.uniform(0.05, 0.9) * total for _ in range(kills_during))
    delays = [rng.uniform(0.0, 0.03) for _ in range(kills_during)]
    print(f"{UPLOADS} uploads, {total} bytes; SIGKILL at progress {[int(t) for t in thresholds]}")

    progress = Progress()
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=worker, args=(rcv, jobs[i::WORKERS], progress, stop), name=f"uploader-{i}"
        )
        for i in range(WORKERS)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    kills = 0
    try:
        for threshold, delay in zip(thresholds, delays, strict=True):
            while progress.value < threshold and any(t.is_alive() for t in threads):
                assert time.monotonic() - started < PHASE_TIMEOUT, "phase 1 took too long"
                time.sleep(0.002)
            time.sleep(delay)
            rcv.kill()
            kills += 1
            print(f"SIGKILL #{kills} at progress {progress.value}")
            rcv.start()
        for t in threads:
            t.join(max(1.0, PHASE_TIMEOUT - (time.monotonic() - started)))
        assert not any(t.is_alive() for t in threads), "uploads did not finish in time"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert progress.errors == [], f"SEED={SEED}: unexpected answers: {progress.errors}"

    # Phase 2: one more crash with everything at rest, then check the disk and finish everything.
    rcv.kill()
    kills += 1
    rcv.start()
    interrupted = [j for j in jobs if j.interrupted]
    print(
        f"{kills} SIGKILLs; {len(interrupted)} uploads interrupted, "
        f"{sum(j.creations - 1 for j in jobs)} creations retried"
    )
    assert 3 <= kills <= 5

    ids_before = check_receipts_on_disk(rcv)
    states = {"partial": 0, "complete-no-receipt": 0, "receipted": 0}

    for job in jobs:
        assert job.object_id is not None, f"SEED={SEED}: job {job.index} never got an upload"
        if job.receipt is not None:
            served = rcv.get_receipt(job.object_id)
            assert served.status_code == 200, f"SEED={SEED}: a receipt given out is gone"
            assert served.content == decode_receipt_header(job.receipt), (
                f"SEED={SEED}: receipt of {job.object_id} changed after a crash"
            )
            head = rcv.head(job.object_id)
            assert head.status_code == 200
            assert head.headers["Upload-Offset"] == str(len(job.data))
            assert head.headers.get("Artifact-Receipt") == job.receipt
            continue
        assert job.interrupted, f"job {job.index} neither finished nor was interrupted"
        head = rcv.head(job.object_id)
        assert head.status_code == 200, (
            f"SEED={SEED}: HEAD of interrupted {job.object_id}: {head.status_code}"
        )
        offset = int(head.headers["Upload-Offset"])
        assert 0 <= offset <= len(job.data)
        if head.headers.get("Artifact-Receipt") is not None:
            states["receipted"] += 1
        elif offset == len(job.data):
            states["complete-no-receipt"] += 1
        else:
            states["partial"] += 1
        if head.headers.get("Artifact-Receipt") is None:
            assert rcv.stored(job.object_id)[:offset] == job.data[:offset], (
                f"SEED={SEED}: stored prefix of {job.object_id} is not what was sent"
            )
        r = rcv.patch_retrying_locked(job.object_id, offset, job.data[offset:])
        assert r.status_code == 204, (
            f"SEED={SEED}: finishing {job.object_id} from {offset}/{len(job.data)}: "
            f"{r.status_code} {r.text}"
        )
        job.receipt = r.headers.get("Artifact-Receipt")
        rcv.verify_receipt(job.receipt, job.object_id, job.data)

    print(f"interrupted uploads found after the last restart: {states}")
    ids_after = check_receipts_on_disk(rcv)
    assert set(ids_before) <= set(ids_after)
    assert sorted(j.object_id for j in jobs if j.object_id) == ids_after, (
        f"SEED={SEED}: receipts on disk do not correspond one to one to the uploads"
    )
    for job in jobs:
        assert job.object_id is not None
        rcv.verify_receipt(job.receipt, job.object_id, job.data)


def test_uploads_a_power_cut_left_with_empty_sidecars_are_gone_or_accepted(
    receiver: Receiver,
) -> None:
    """After a restart on empty info sidecars (what ext4 leaves when a power cut commits the
    rename before the content), an upload without a receipt answers 404 to HEAD and PATCH and
    its files are swept, one with a receipt still answers with it, and the worker's new upload
    of the same bytes gets its receipt."""
    rcv = receiver
    fresh_data, partial_data, done_data = os.urandom(3000), os.urandom(5000), os.urandom(4000)
    fresh = rcv.new_upload(fresh_data)  # caught at creation
    partial = rcv.new_upload(partial_data)
    assert rcv.patch(partial, 0, partial_data[:2000]).status_code == 204
    done, receipt = rcv.upload_all(done_data)
    rcv.kill()
    for oid in (fresh, partial, done):
        (rcv.uploads_dir / f"{oid}.info").write_bytes(b"")
    rcv.start()

    for oid in (fresh, partial):
        assert rcv.head(oid).status_code == 404, oid
        assert rcv.patch(oid, 0, b"x").status_code == 404, oid
    head = rcv.head(done)
    assert head.status_code == 200
    assert head.headers["Upload-Offset"] == str(len(done_data))
    assert head.headers.get("Artifact-Receipt") == receipt

    deadline = time.monotonic() + 10.0
    left = {fresh, f"{fresh}.info", partial, f"{partial}.info"}
    while rcv.upload_entries() & left and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rcv.upload_entries() & left, "the sweep left the files of uploads that are gone"
    assert {done, f"{done}.info"} <= rcv.upload_entries()
    again, new_receipt = rcv.upload_all(fresh_data)
    rcv.verify_receipt(new_receipt, again, fresh_data)
