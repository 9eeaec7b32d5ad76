"""End to end: three canner nodes behind a real HAProxy (Debian's package) with the shipped
``conf/haproxy/canner.cfg``, on loopback.

Each node is a receiver and a deliver process with its own data directory, issuer and node
prefix (``n1``, ``n2``, ``n3``); all deliver to one fake Internet Archive.  ``n2``'s data
directory is a small tmpfs, so its free space can be pushed under its floor.  The tests run in
order on one cluster, and each checks what a worker and an operator would:

1. 300 uploads through the proxy (tuspy, tus-js-client and canner-upload's library, at once):
   every receipt's prefix names the node that holds the bytes and issued it; receipt lookups,
   HEADs and resumes after a dropped connection reach the owner through the proxy.
2. ``n2`` under its floor: HAProxy stops sending it new uploads; its uploads in progress are
   refused (429) while it is under, and finish once space is back.
3. ``n3`` SIGKILLed (receiver and deliver) with uploads in flight, then restarted: they resume
   through the proxy; canner-upload uploads running meanwhile all succeed.
4. ``n3`` drained, emptied (retirable), removed from the map and HAProxy reloaded while
   canner-upload keeps uploading: no upload fails.
5. Every accepted object reached the fake IA exactly once.
"""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import pytest
import requests
from canner_client import Client, RetryPolicy
from cluster_support import HAProxy, Nginx, Node, get, make_node, node_of, require
from deliver_support import FakeIA, venv_bin, wait_for
from e2e_support import JS_DIR, OFFSET_TYPE, REPO, TUS_VERSION, blake3_hex, upload_metadata
from tusclient import client as tus_client

pytestmark = pytest.mark.e2e

KiB = 1024
SEED = int(os.environ.get("CANNER_E2E_SEED", "20261130"))
N2_TMPFS = "96m"
N2_FLOOR = 24 * 1024 * 1024


@dataclass
class Accepted:
    """What a worker holds after an upload: the receipt, and what it uploaded."""

    receipt: bytes
    checksum: str
    size: int
    client: str


@dataclass
class Cluster:
    root: Path
    fake: FakeIA
    nodes: dict[str, Node]
    proxy: HAProxy
    mount: Path
    accepted: dict[str, Accepted] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: int = 0

    # Another front (nginx) for the raw tus helpers; None: the HAProxy.
    front_url: str | None = None

    @property
    def files_url(self) -> str:
        return (self.front_url or self.proxy.url) + "/files/"

    def record(
        self, object_id: str, receipt: bytes, data_checksum: str, size: int, client: str
    ) -> None:
        with self.lock:
            assert object_id not in self.accepted, f"{object_id} receipted twice"
            self.accepted[object_id] = Accepted(receipt, data_checksum, size, client)

    def payload_file(self, size: int) -> tuple[Path, bytes]:
        with self.lock:
            self.counter += 1
            n = self.counter
        data = random.Random(SEED + n).randbytes(size)
        path = self.root / "files" / f"artifact-{n}.warc"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        return path, data

    def node_status(self, prefix: str) -> dict[str, Any]:
        done = subprocess.run(
            [
                venv_bin("canner"),
                "status",
                "--json",
                "--config",
                str(self.nodes[prefix].receiver.config_path),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode in (0, 1), done.stderr
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc

    def describe(self) -> str:
        parts = [f"haproxy: {self.proxy.log_tail(15)}"]
        for node in self.nodes.values():
            parts.append(f"--- {node.prefix} receiver ---\n{node.receiver.log_tail(10)}")
        return "\n".join(parts)


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {where} (needs root and mount(2)): {done.stderr}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require("haproxy")
    root = tmp_path_factory.mktemp("cluster")
    mount = root / "n2-volume"
    mount_tmpfs(mount, N2_TMPFS)
    fake = FakeIA(root / "fake")
    nodes: dict[str, Node] = {}
    proxy = HAProxy(root / "haproxy")
    try:
        fake.start()
        nodes["n1"] = make_node(root, "n1", fake)
        (mount / "data").mkdir()
        nodes["n2"] = make_node(root, "n2", fake, data_dir=mount / "data", min_free_bytes=N2_FLOOR)
        nodes["n3"] = make_node(root, "n3", fake)
        proxy.configure({p: n.receiver.port for p, n in nodes.items()})
        proxy.start()
        for prefix in nodes:
            proxy.wait_state(prefix, "UP")
        yield Cluster(root, fake, nodes, proxy, mount)
    finally:
        proxy.stop()
        for node in nodes.values():
            node.close()
        fake.stop()
        done = subprocess.run(["umount", str(mount)], capture_output=True, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def verify_now(db: Path) -> None:
    """Test-only fast-forward: delivered rows not yet verified are checked at once (canner
    looks again after 10 s and more).  Verified rows keep their schedule: with a retention of
    an hour their next check is the purge, and making it due would only make deliver spin."""
    conn = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute(
            "UPDATE outbound SET next_check_at = 0 WHERE kind = 'object'"
            " AND state = 'delivered' AND verified_at IS NULL AND next_check_at > 0"
        )
    finally:
        conn.close()


# -- the three clients -------------------------------------------------------------------------


def sizes(n: int, seed: int) -> list[int]:
    """Mostly small artifacts, every tenth a few hundred KiB (sent in chunks)."""
    rng = random.Random(seed)
    return [
        rng.randint(300 * KiB, 600 * KiB) if i % 10 == 9 else rng.randint(1, 40 * KiB)
        for i in range(n)
    ]


def chunk_for(size: int) -> int | None:
    return 128 * KiB if size > 100 * KiB else None


def tuspy_upload(cl: Cluster, size: int) -> str:
    path, data = cl.payload_file(size)
    kwargs: dict[str, Any] = {}
    if chunk_for(size):
        kwargs["chunk_size"] = chunk_for(size)
    with open(path, "rb") as stream:
        uploader = tus_client.TusClient(cl.files_url).uploader(
            file_stream=stream,
            metadata={"project": "example", "checksum": blake3_hex(data), "filename": path.name},
            retries=0,
            **kwargs,
        )
        uploader.upload()
    object_id = uploader.url.rsplit("/", 1)[1]
    header = uploader.request.response_headers.get("artifact-receipt")
    assert header, f"tuspy upload {object_id}: no Artifact-Receipt"
    cl.record(object_id, decode(header), blake3_hex(data), size, "tuspy")
    return object_id


def client_upload(cl: Cluster, client: Client, size: int) -> str:
    path, data = cl.payload_file(size)
    receipt = client.upload(path, project="example", filename=path.name)
    cl.record(
        receipt.object_id, receipt.to_json().encode(), blake3_hex(data), size, "canner-upload"
    )
    return receipt.object_id


def make_client(cl: Cluster, name: str) -> Client:
    return Client(
        cl.proxy.url,
        timeout=30,
        retry=RetryPolicy(initial=0.2, maximum=2.0, deadline=120),
        state_dir=cl.root / f"state-{name}",
        chunk_size=128 * KiB,
    )


def js_uploads(cl: Cluster, all_sizes: list[int]) -> subprocess.Popen[str]:
    node = require("node")
    if not (JS_DIR / "node_modules" / "tus-js-client").is_dir():
        pytest.fail("tus-js-client is missing: run `cd tests/e2e/js && npm install`")
    manifest = []
    for size in all_sizes:
        path, data = cl.payload_file(size)
        manifest.append(
            {
                "file": str(path),
                "project": "example",
                "checksum": blake3_hex(data),
                "filename": path.name,
                "chunkSize": chunk_for(size),
                "size": size,
            }
        )
    manifest_path = cl.root / "js-manifest.json"
    manifest_path.write_text(json.dumps(manifest))
    return subprocess.Popen(
        [
            node,
            str(JS_DIR / "upload_many.js"),
            cl.files_url,
            str(manifest_path),
            "--concurrency",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def decode(header: str) -> bytes:
    return base64.urlsafe_b64decode(header + "=" * (-len(header) % 4))


# -- raw tus through the proxy -------------------------------------------------------------------


def create(cl: Cluster, data: bytes) -> requests.Response:
    r = requests.post(
        cl.files_url,
        headers={
            "Tus-Resumable": TUS_VERSION,
            "Upload-Length": str(len(data)),
            "Upload-Metadata": upload_metadata(blake3_hex(data), filename="raw.warc"),
        },
        timeout=30,
    )
    r.close()
    return r


def upload_id(response: requests.Response) -> str:
    assert response.status_code == 201, f"creation: {response.status_code} {response.text}"
    return response.headers["Location"].rsplit("/", 1)[1]


def patch(cl: Cluster, object_id: str, offset: int, body: bytes) -> requests.Response:
    r = requests.patch(
        cl.files_url + object_id,
        headers={
            "Tus-Resumable": TUS_VERSION,
            "Upload-Offset": str(offset),
            "Content-Type": OFFSET_TYPE,
        },
        data=body,
        timeout=30,
    )
    r.close()
    return r


def head(cl: Cluster, object_id: str) -> requests.Response:
    r = requests.head(cl.files_url + object_id, headers={"Tus-Resumable": TUS_VERSION}, timeout=30)
    r.close()
    return r


def finish(cl: Cluster, object_id: str, data: bytes, client: str = "raw") -> None:
    """Ask the proxy where the upload stands and send the rest: the worker's resume."""
    r = head(cl, object_id)
    assert r.status_code == 200, f"HEAD {object_id}: {r.status_code}"
    offset = int(r.headers["Upload-Offset"])
    r = patch(cl, object_id, offset, data[offset:])
    assert r.status_code == 204, f"PATCH {object_id} at {offset}: {r.status_code} {r.text}"
    cl.record(object_id, decode(r.headers["Artifact-Receipt"]), blake3_hex(data), len(data), client)


def started_on(
    cl: Cluster, prefix: str, count: int, size: int = 200 * KiB
) -> list[tuple[str, bytes]]:
    """``count`` uploads created through the proxy that landed on ``prefix``, half sent; the
    creations that landed elsewhere are completed and recorded."""
    found: list[tuple[str, bytes]] = []
    for _ in range(60):
        data = random.Random(SEED + len(cl.accepted) + len(found) * 7919).randbytes(size)
        oid = upload_id(create(cl, data))
        if node_of(oid) != prefix:
            finish(cl, oid, data)
            continue
        assert patch(cl, oid, 0, data[: size // 2]).status_code == 204
        found.append((oid, data))
        if len(found) == count:
            return found
    raise AssertionError(f"60 creations through the proxy never landed {count} on {prefix}")


def drop_mid_patch(cl: Cluster, object_id: str, offset: int, body: bytes) -> None:
    """Send a PATCH's head and ``body`` through the proxy, promising twice as much, then drop
    the connection: a worker whose link broke mid-upload."""
    with socket.create_connection(("127.0.0.1", cl.proxy.port), timeout=30) as sock:
        sock.sendall(
            (
                f"PATCH /files/{object_id} HTTP/1.1\r\nHost: 127.0.0.1:{cl.proxy.port}\r\n"
                f"Tus-Resumable: {TUS_VERSION}\r\nUpload-Offset: {offset}\r\n"
                f"Content-Type: {OFFSET_TYPE}\r\nContent-Length: {2 * len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        time.sleep(0.3)


# -- the tests -----------------------------------------------------------------------------------


def test_300_uploads_through_haproxy_land_on_their_owners(cluster: Cluster) -> None:
    """tuspy, tus-js-client and canner-upload, 100 uploads each at once through HAProxy: each
    receipt is issued by the node its prefix names, which holds the bytes; lookups, HEADs and
    resumes through the proxy reach that node."""
    cl = cluster
    js = js_uploads(cl, sizes(100, SEED + 1))
    client = make_client(cl, "bulk")
    with ThreadPoolExecutor(8) as pool:
        python = [pool.submit(tuspy_upload, cl, s) for s in sizes(100, SEED + 2)]
        python += [pool.submit(client_upload, cl, client, s) for s in sizes(100, SEED + 3)]
        out, err = js.communicate(timeout=600)
        for future in python:
            future.result()
    results = [json.loads(line) for line in out.splitlines() if line.strip()]
    failures = [r for r in results if "error" in r]
    assert js.returncode == 0 and not failures, f"tus-js-client: {failures[:3]} {err[-2000:]}"
    assert len(results) == 100
    manifest = {m["file"]: m for m in json.loads((cl.root / "js-manifest.json").read_text())}
    for r in results:
        assert r["receipt"], f"tus-js-client upload of {r['file']}: no Artifact-Receipt"
        item = manifest[r["file"]]
        cl.record(
            r["url"].rsplit("/", 1)[1],
            decode(r["receipt"]),
            item["checksum"],
            item["size"],
            "tus-js-client",
        )

    # Resumes after a dropped connection, through the proxy.
    for i in range(6):
        data = random.Random(SEED - i).randbytes(150 * KiB)
        oid = upload_id(create(cl, data))
        drop_mid_patch(cl, oid, 0, data[: 50 * KiB])
        finish(cl, oid, data, "raw-resumed")
        assert cl.accepted[oid].size == len(data)

    # Creation-with-upload: the body streams through the creation backend too.
    for size in (3 * KiB, 3 * 1024 * KiB):
        data = random.Random(SEED + size).randbytes(size)
        r = requests.post(
            cl.files_url,
            headers={
                "Tus-Resumable": TUS_VERSION,
                "Upload-Length": str(size),
                "Upload-Metadata": upload_metadata(blake3_hex(data), filename="whole.warc"),
                "Content-Type": OFFSET_TYPE,
            },
            data=data,
            timeout=30,
        )
        r.close()
        oid = upload_id(r)
        assert int(r.headers["Upload-Offset"]) == size, "the creation did not store the body"
        cl.record(oid, decode(r.headers["Artifact-Receipt"]), blake3_hex(data), size, "raw")

    assert len(cl.accepted) == 308
    by_node: dict[str, int] = {}
    for oid, acc in cl.accepted.items():
        prefix = node_of(oid)
        by_node[prefix] = by_node.get(prefix, 0) + 1
        doc = json.loads(acc.receipt)
        assert doc["object_id"] == oid and doc["id"] == f"receipt:{oid}"
        assert doc["issuer"] == f"https://{prefix}.canner.test", "issued by another node"
        assert doc["checksum"] == acc.checksum and doc["size_bytes"] == acc.size
        owner = cl.nodes[prefix].receiver
        assert blake3_hex(owner.stored(oid)) == acc.checksum, f"{oid}: bytes not on {prefix}"
        for other in cl.nodes.values():
            if other.prefix != prefix:
                assert not (other.receiver.receipts_dir / f"{oid}.json").exists()
        looked_up = get(f"{cl.proxy.url}/api/v1/receipts/{oid}")
        assert looked_up.status_code == 200 and looked_up.content == acc.receipt
    for oid in list(cl.accepted)[::25]:
        r = head(cl, oid)
        assert r.status_code == 200 and int(r.headers["Upload-Offset"]) == cl.accepted[oid].size
    # leastconn spreads the work: every node took a fair share.
    assert all(by_node.get(p, 0) >= 40 for p in cl.nodes), by_node
    clients = {acc.client for acc in cl.accepted.values()}
    assert clients == {"tuspy", "tus-js-client", "canner-upload", "raw-resumed", "raw"}


def test_a_node_under_its_floor_gets_no_new_uploads_and_finishes_its_own(cluster: Cluster) -> None:
    """``n2`` under ``min_free_bytes``: /readyz fails, HAProxy sends new uploads to n1 and
    n3; n2's uploads in progress get 429 while it is under and complete once it is not."""
    cl = cluster
    in_progress = started_on(cl, "n2", 2)
    filler = cl.mount / "filler"
    free = os.statvfs(cl.mount).f_bavail * os.statvfs(cl.mount).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * (free - N2_FLOOR + 4 * 1024 * 1024))
    try:
        cl.proxy.wait_state("n2", "DOWN")
        for i in range(20):
            data = random.Random(SEED + 1000 + i).randbytes(5 * KiB)
            oid = upload_id(create(cl, data))
            assert node_of(oid) != "n2", "a new upload went to the node under its floor"
            finish(cl, oid, data)
        for oid, data in in_progress:
            r = patch(cl, oid, len(data) // 2, data[len(data) // 2 :])
            assert r.status_code == 429 and r.headers["Retry-After"] == "60", r.status_code
    finally:
        filler.unlink()
    cl.proxy.wait_state("n2", "UP")
    for oid, data in in_progress:
        finish(cl, oid, data)
        assert node_of(oid) == "n2"


def test_a_node_killed_and_restarted_resumes_its_uploads_through_the_proxy(
    cluster: Cluster,
) -> None:
    """SIGKILL of n3's receiver and deliver with uploads in flight: canner-upload uploads that
    run meanwhile all succeed; after the restart n3's uploads resume through the proxy."""
    cl = cluster
    n3 = cl.nodes["n3"]
    in_flight = started_on(cl, "n3", 2)
    client = make_client(cl, "kill")
    with ThreadPoolExecutor(3) as pool:
        background = [pool.submit(client_upload, cl, client, s) for s in sizes(24, SEED + 4)]
        time.sleep(0.5)
        n3.receiver.kill(signal.SIGKILL)
        n3.deliver.kill(signal.SIGKILL)
        r = head(cl, in_flight[0][0])
        assert r.status_code == 503, f"HEAD of a dead node's upload answered {r.status_code}"
        cl.proxy.wait_state("n3", "DOWN")
        time.sleep(1)
        n3.receiver.start()
        n3.deliver.start()
        for oid, data in in_flight:
            finish(cl, oid, data)
        for future in background:
            future.result()
    cl.proxy.wait_state("n3", "UP")


def test_a_drained_node_is_emptied_and_removed_without_failing_an_upload(cluster: Cluster) -> None:
    """``canner drain`` on n3 while canner-upload keeps uploading through the proxy: n3's
    uploads in progress finish, it takes no new upload, becomes retirable, leaves the map
    (HAProxy reloaded) and stops; no upload fails."""
    cl = cluster
    n3 = cl.nodes["n3"]
    in_progress = started_on(cl, "n3", 2)
    client = make_client(cl, "drain")
    with ThreadPoolExecutor(3) as pool:
        background = [pool.submit(client_upload, cl, client, s) for s in sizes(45, SEED + 5)]
        time.sleep(0.3)
        done = subprocess.run(
            [
                venv_bin("canner"),
                "drain",
                "--reason",
                "retiring n3",
                "--config",
                str(n3.receiver.config_path),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        time.sleep(0.5)
        # Everything n3 may still receipt: what it had when the drain began.
        allowed = {p.name for p in n3.receiver.uploads_dir.iterdir()} | {
            p.name.split(".")[0] for p in n3.receiver.receipts_dir.iterdir()
        }
        for oid, data in in_progress:
            finish(cl, oid, data)
        cl.proxy.wait_state("n3", "DOWN")

        def retirable() -> bool:
            verify_now(n3.receiver.db_path)
            return bool(cl.node_status("n3")["retirement"]["retirable"])

        wait_for(
            retirable, 120, "n3 to become retirable", 0.5, lambda: json.dumps(cl.node_status("n3"))
        )
        cl.proxy.configure({p: n.receiver.port for p, n in cl.nodes.items() if p != "n3"})
        cl.proxy.reload()
        n3.close()
        for future in background:
            future.result()
    receipted = {
        p.name[: -len(".json")]
        for p in n3.receiver.receipts_dir.glob("*.json")
        if p.name.count(".") == 1
    }
    assert receipted <= allowed, f"n3 took new uploads after the drain: {receipted - allowed}"
    # A retired node's receipts are no longer served: any node answers 404 for its prefix.
    gone = next(oid for oid in cl.accepted if node_of(oid) == "n3")
    assert get(f"{cl.proxy.url}/api/v1/receipts/{gone}").status_code == 404
    data = random.Random(SEED + 99).randbytes(3 * KiB)
    oid = upload_id(create(cl, data))
    assert node_of(oid) in ("n1", "n2")
    finish(cl, oid, data)


def test_nginx_example_routes_by_prefix_and_skips_a_draining_node(cluster: Cluster) -> None:
    """The shipped nginx example in front of n1 and n2: uploads and lookups reach the owner;
    with n2 drained, creations land on n1 (nginx retries the 503) while n2's upload in
    progress finishes through nginx."""
    cl = cluster
    front = Nginx(cl.root / "nginx")
    front.start({p: cl.nodes[p].receiver.port for p in ("n1", "n2")})
    via = Cluster(cl.root, cl.fake, cl.nodes, cl.proxy, cl.mount, cl.accepted, cl.lock)
    via.front_url = front.url
    n2 = cl.nodes["n2"]
    try:
        client = Client(front.url, timeout=30, state_dir=cl.root / "state-nginx")
        ids = [client_upload(cl, client, s) for s in sizes(10, SEED + 6)]
        for oid in ids:
            assert node_of(oid) in ("n1", "n2")
            looked_up = get(f"{front.url}/api/v1/receipts/{oid}")
            assert looked_up.status_code == 200 and looked_up.content == cl.accepted[oid].receipt
        in_progress = started_on(via, "n2", 1)
        done = subprocess.run(
            [venv_bin("canner"), "drain", "--config", str(n2.receiver.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        for i in range(8):
            data = random.Random(SEED + 2000 + i).randbytes(2 * KiB)
            oid = upload_id(create(via, data))
            assert node_of(oid) == "n1", "nginx left a creation on the draining node"
            finish(via, oid, data)
        for oid, data in in_progress:
            finish(via, oid, data)
            assert node_of(oid) == "n2"
    finally:
        subprocess.run(
            [venv_bin("canner"), "undrain", "--config", str(n2.receiver.config_path)],
            capture_output=True,
            timeout=30,
            check=False,
        )
        front.stop()
    cl.proxy.wait_state("n2", "UP")


def test_every_accepted_object_reached_the_fake_ia_exactly_once(cluster: Cluster) -> None:
    """Nothing accepted anywhere is lost: every receipt's object is delivered, verified and
    stored at the fake IA once, with its bytes; nothing else is there."""
    cl = cluster

    def settled(prefix: str) -> bool:
        node = cl.nodes[prefix]
        verify_now(node.receiver.db_path)
        doc = cl.node_status(prefix)
        # At least what workers hold receipts for; an extra object shows up at the IA below.
        return doc["pending_objects"] == 0 and doc["states"]["delivered"] >= sum(
            1 for oid in cl.accepted if node_of(oid) == prefix
        )

    for prefix in ("n1", "n2"):
        wait_for(lambda p=prefix: settled(p), 120, f"{prefix} to deliver everything", 0.5)
    stored: dict[str, dict[str, Any]] = {}
    for obj in cl.fake.objects():
        oid = obj["identifier"].split("-", 2)[2]
        assert oid not in stored, f"{oid} stored under two names"
        stored[oid] = obj
    assert set(stored) == set(cl.accepted), (
        f"missing at IA: {sorted(set(cl.accepted) - set(stored))[:5]},"
        f" unexpected: {sorted(set(stored) - set(cl.accepted))[:5]}"
    )
    for oid, obj in stored.items():
        assert obj["stores"] == 1, f"{oid} stored {obj['stores']} times"
        assert obj["size"] == cl.accepted[oid].size
        with open(obj["path"], "rb") as f:
            assert "blake3:" + blake3.blake3(f.read()).hexdigest() == cl.accepted[oid].checksum
