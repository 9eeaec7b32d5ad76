"""A tus upload resumed after a power cut, as the disk leaves it (issue 34, item 3).

A real receiver (twistd) and a real tus client (tuspy).  The worker's first PATCH is answered
204; a second one is streaming when the receiver dies (SIGKILL), and the power cut is what the
test then writes by hand: ext4 kept the data file's size but not the bytes the kernel had not
written back, so everything past the answered offset reads as zeros, and the machine came back
under a new boot id (the receiver's ``receiver.boot`` names the one before).  After the restart
HEAD must answer the offset the first PATCH was answered with (its bytes durable), the zeros must
be gone from ``uploads/``, and tuspy's resume must end in the receipt of the worker's file.
"""

from __future__ import annotations

import io
import os
import random
import time

import pytest
from e2e_support import Receiver, blake3_hex
from tusclient import client as tus_client

from canner.store.recovery import BOOT_ID

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
SIZE = 3 * MiB
DATA = random.Random(343).randbytes(SIZE)
METADATA = {"project": "example", "checksum": blake3_hex(DATA), "filename": "cut.warc.gz"}


def wait_for_size(path: os.PathLike[str], size: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.getsize(path) < size:
        assert time.monotonic() < deadline, f"{path} stayed under {size} bytes"
        time.sleep(0.02)


def test_tuspy_resumes_after_a_power_cut_zeroed_the_tail(receiver: Receiver) -> None:
    rcv = receiver
    client = tus_client.TusClient(rcv.files_url)
    first = client.uploader(
        file_stream=io.BytesIO(DATA), metadata=METADATA, chunk_size=MiB, retries=0
    )
    first.upload_chunk()
    assert first.offset == MiB, "the first PATCH was answered at 1 MiB"
    url = first.url
    assert url is not None
    object_id = url.rsplit("/", 1)[1]

    # The second PATCH streams 1.5 MiB of its 2 MiB when the receiver dies.
    streamed = MiB + MiB // 2
    sock = rcv.open_patch(object_id, MiB, SIZE - MiB, DATA[MiB : MiB + streamed])
    try:
        wait_for_size(rcv.uploads_dir / object_id, MiB + streamed)
        rcv.kill()
    finally:
        sock.close()
    # The power cut: the size is on disk, the bytes past the answered offset are not, and the
    # machine comes back under another boot id than the one the receiver recorded.
    with open(rcv.uploads_dir / object_id, "r+b") as f:
        f.seek(MiB)
        f.write(b"\0" * streamed)
    assert (rcv.data_dir / "receiver.boot").read_text().strip() == BOOT_ID.read_text().strip()
    (rcv.data_dir / "receiver.boot").write_text("an-earlier-boot\n")
    rcv.start()

    head = rcv.head(object_id)
    assert head.status_code == 200
    assert head.headers["Upload-Offset"] == str(MiB), "HEAD answered bytes that are not durable"
    assert rcv.stored(object_id) == DATA[:MiB], "the zeroed tail is still in uploads/"

    resumed = client.uploader(
        file_stream=io.BytesIO(DATA), url=url, metadata=METADATA, chunk_size=MiB, retries=0
    )
    assert resumed.offset == MiB
    resumed.upload()
    last = resumed.request.response_headers
    assert int(last["upload-offset"]) == SIZE
    doc = rcv.verify_receipt(last.get("artifact-receipt"), object_id, data=DATA)
    assert doc["checksum"] == blake3_hex(DATA)
