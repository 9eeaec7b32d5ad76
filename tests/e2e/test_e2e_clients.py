"""Real tus clients against a real receiver: tuspy (Python) and tus-js-client (Node).

Each upload must end with an ``Artifact-Receipt`` whose decoded JSON is byte for byte the receipt
served by ``GET /api/v1/receipts/{id}``, with HQ's six fields in order, and the stored file must
hash to the receipt's checksum.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from e2e_support import JS_DIR, Receiver, blake3_hex, parse_metadata
from tusclient import client as tus_client

pytestmark = pytest.mark.e2e

KiB = 1024
MiB = 1024 * 1024


def payload(size: int) -> bytes:
    return random.Random(size).randbytes(size)


# -- tuspy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "chunk_size"),
    [
        (1, None),
        (10, 3),
        (100 * KiB, None),
        (100 * KiB, 7 * KiB),
        (3 * MiB, 1 * MiB),
        (3 * MiB + 1, 1 * MiB),
    ],
    ids=["1B", "10B-chunk3", "100KiB", "100KiB-chunk7KiB", "3MiB-chunk1MiB", "3MiB+1-chunk1MiB"],
)
def test_tuspy_upload_gets_receipt_identical_to_get(
    shared_receiver: Receiver, size: int, chunk_size: int | None
) -> None:
    """The receipt is read from tuspy's final PATCH response (``uploader.request``, which holds
    the last request tuspy made), with no subclassing; HEAD afterwards must carry the same."""
    rcv = shared_receiver
    data = payload(size)
    started = time.time()
    client = tus_client.TusClient(rcv.files_url)
    kwargs: dict[str, object] = {}
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    uploader = client.uploader(
        file_stream=io.BytesIO(data),
        metadata={"project": "example", "checksum": blake3_hex(data), "filename": "a.warc.gz"},
        retries=0,
        **kwargs,
    )
    uploader.upload()
    assert uploader.offset == size
    last = uploader.request.response_headers  # the final PATCH's headers (lower-cased)
    assert last.get("tus-resumable") == "1.0.0"
    assert int(last["upload-offset"]) == size, "the final 204 must carry Upload-Offset"
    object_id = uploader.url.rsplit("/", 1)[1]
    header = last.get("artifact-receipt")
    doc = rcv.verify_receipt(header, object_id, data=data, not_before=started)
    assert doc["size_bytes"] == size

    head = rcv.head(object_id)
    assert head.status_code == 200
    assert head.headers["Artifact-Receipt"] == header
    assert int(head.headers["Upload-Offset"]) == size
    assert int(head.headers["Upload-Length"]) == size
    assert head.headers.get("Cache-Control") == "no-store"
    assert parse_metadata(head.headers["Upload-Metadata"]) == {
        "project": "example",
        "checksum": blake3_hex(data),
        "filename": "a.warc.gz",
    }


def test_tuspy_other_project_and_no_filename(shared_receiver: Receiver) -> None:
    rcv = shared_receiver
    data = payload(4321)
    uploader = tus_client.TusClient(rcv.files_url).uploader(
        file_stream=io.BytesIO(data),
        metadata={"project": "other", "checksum": blake3_hex(data)},
        chunk_size=1000,
        retries=0,
    )
    uploader.upload()
    object_id = uploader.url.rsplit("/", 1)[1]
    rcv.verify_receipt(uploader.request.response_headers.get("artifact-receipt"), object_id, data)
    meta = json.loads((rcv.receipts_dir / f"{object_id}.meta.json").read_bytes())
    assert meta["project"] == "other"
    assert meta.get("filename") is None


# -- tus-js-client --------------------------------------------------------------------------------


def node_upload(rcv: Receiver, path: Path, data: bytes, *options: str) -> dict[str, object]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (./dev test installs nodejs)")
    if not (JS_DIR / "node_modules" / "tus-js-client").is_dir():
        pytest.fail("tus-js-client is missing: run `cd tests/e2e/js && npm install`")
    path.write_bytes(data)
    done = subprocess.run(
        [
            node,
            str(JS_DIR / "upload.js"),
            rcv.files_url,
            str(path),
            "example",
            blake3_hex(data),
            *options,
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    out = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0, (
        f"tus-js-client upload failed ({done.returncode}):\n{out}\n"
        f"{done.stderr.decode('utf-8', 'replace')}"
    )
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("size", "options", "expect_patches"),
    [
        (1, [], 1),
        (100 * KiB, [], 1),
        (3 * MiB, ["--chunk-size", str(1 * MiB)], 3),
        (3 * MiB + 5, ["--chunk-size", str(1 * MiB)], 4),
        (1, ["--data-during-creation"], 0),
        (100 * KiB, ["--data-during-creation"], 0),
        (3 * MiB + 5, ["--chunk-size", str(1 * MiB), "--data-during-creation"], 3),
        (10, ["--chunk-size", "3", "--data-during-creation"], 3),
    ],
    ids=[
        "1B",
        "100KiB",
        "3MiB-chunk1MiB",
        "3MiB+5-chunk1MiB",
        "1B-with-creation",
        "100KiB-with-creation",
        "3MiB+5-chunk1MiB-with-creation",
        "10B-chunk3-with-creation",
    ],
)
def test_tus_js_client_upload_gets_receipt_identical_to_get(
    shared_receiver: Receiver, tmp_path: Path, size: int, options: list[str], expect_patches: int
) -> None:
    rcv = shared_receiver
    data = payload(size + 17)[:size]
    started = time.time()
    result = node_upload(rcv, tmp_path / "artifact.warc.gz", data, *options)
    responses = result["responses"]
    assert isinstance(responses, list)
    methods = [r["method"] for r in responses]
    assert methods == ["POST"] + ["PATCH"] * expect_patches, methods
    for r in responses:
        assert r["tusResumable"] == "1.0.0", r
    *earlier, last = responses
    assert last["status"] == (204 if expect_patches else 201), last
    assert int(last["offset"]) == size, "the final response must carry Upload-Offset == length"
    for r in earlier:
        assert r["receipt"] is None, f"a receipt before the upload was complete: {r}"
    assert result["receipt"] == last["receipt"] == result["lastResponseReceipt"]
    url = result["url"]
    assert isinstance(url, str) and url.startswith(rcv.files_url)
    object_id = url.rsplit("/", 1)[1]
    header = result["receipt"]
    assert isinstance(header, str)
    rcv.verify_receipt(header, object_id, data=data, not_before=started)
    head = rcv.head(object_id)
    assert head.headers.get("Artifact-Receipt") == header
