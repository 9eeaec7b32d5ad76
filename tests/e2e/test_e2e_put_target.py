"""End to end: the real ``curl`` binary, run with seesaw's exact upload arguments
(``docs/reference/archiveteam-targets.md``), against real ``twistd canner-receiver`` and
``canner-deliver`` processes delivering into a directory.

* upload -> 201 with the receipt -> the file delivered byte for byte;
* a response lost on the way back (a loopback relay cuts the connection when the answer comes),
  then seesaw's retry -> the first object's receipt, one object delivered;
* refusals at the free space floor and while draining -> curl fails, and the relay saw no more
  than the request head pass (the body was never sent);
* a PUT cut mid-body -> no object, nothing left in ``uploads/``;
* a receiver SIGKILLed at the commit point, restarted without canner-deliver, then seesaw's
  retry -> the first object's receipt (200), one object;
* a 2 GiB PUT (a sparse file) with the receiver's peak memory flat.

The relay only copies bytes between curl and the receiver (and counts them, or cuts the
connection where told): it changes nothing in either direction.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import Deliver, DirectoryReceiver, deliveries, venv_bin, wait_for
from e2e_support import RECEIPT_FIELDS, blake3_hex

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PROJECT = "example"
DOWNLOADER = "alice"
ITEM = "item-20261201.example.1234567890.warc.zst"


def seesaw_curl(path: Path, target: str, *observe: str) -> subprocess.CompletedProcess[bytes]:
    """seesaw's curl upload, argument for argument; ``observe`` adds options that only record
    what happened (``--dump-header``), never what is sent."""
    return subprocess.run(
        [
            "curl",
            "--fail",
            "--output",
            "/dev/null",
            "--connect-timeout",
            "60",
            "--speed-limit",
            "1",
            "--speed-time",
            "900",
            "--header",
            "X-Curl-Limits: inf,1,900",
            "--write-out",
            "Upload server: %{url_effective}\\n",
            "--location",
            *observe,
            "--upload-file",
            str(path),
            target,
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )


# -- a loopback relay between curl and the receiver ----------------------------------------------


@dataclass
class Relay:
    """Copies one TCP connection at a time to ``upstream``; counts the bytes the client sent,
    and cuts the connection after ``cut_after`` of them, or when the receiver's final answer
    starts (``drop_answer``: the response is lost)."""

    upstream: int
    cut_after: int | None = None
    drop_answer: bool = False
    sent: int = 0
    cut: threading.Event = field(default_factory=threading.Event)
    _server: socket.socket = field(init=False)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._stop = threading.Event()
        self._threads.append(threading.Thread(target=self._accept, daemon=True))
        self._threads[0].start()

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)
        for s in [*self._sockets, self._server]:
            s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, upstream]
            for target in (self._up, self._down):
                thread = threading.Thread(target=target, args=(client, upstream), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _end(self, client: socket.socket, upstream: socket.socket) -> None:
        """Cut both sides: the receiver sees the connection end, curl a reset at once (a mere
        FIN would leave it sending into a full window until its 900 s speed limit)."""
        self.cut.set()
        # Shut down before closing: a close alone neither wakes the other thread's recv nor,
        # while that recv runs, tells the peer anything.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for s in (upstream, client):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        client.close()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                if self.cut_after is not None and self.sent + len(data) >= self.cut_after:
                    upstream.sendall(data[: self.cut_after - self.sent])
                    self.sent = self.cut_after
                    self._end(client, upstream)
                    return
                upstream.sendall(data)
                self.sent += len(data)
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _down(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                if self.drop_answer and not data.startswith(b"HTTP/1.1 100"):
                    self._end(client, upstream)
                    return
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass


# -- the node ----------------------------------------------------------------------------------


@dataclass
class Node:
    receiver: DirectoryReceiver
    deliver: Deliver
    archive: Path
    files: Path
    relays: list[Relay] = field(default_factory=list)

    def target(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.receiver.port}/seesaw/{PROJECT}/{DOWNLOADER}/"

    def relay(self, **kwargs: Any) -> Relay:
        relay = Relay(self.receiver.port, **kwargs)
        self.relays.append(relay)
        return relay

    def item(self, size: int, name: str = ITEM) -> tuple[Path, bytes]:
        block = os.urandom(1 << 16)
        data = (block * (size // len(block) + 1))[:size]
        path = self.files / name
        path.write_bytes(data)
        return path, data

    def receipts(self) -> list[str]:
        return self.receiver.receipt_ids_on_disk()

    def delivered(self, object_id: str, name: str = ITEM) -> Path:
        return self.archive / f"{PROJECT}-{object_id}" / name

    def uploads_left(self) -> set[str]:
        return self.receiver.upload_entries()

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        for stop in (lambda: self.deliver.kill(15, 5), self.receiver.close):
            try:
                stop()
            except Exception:  # tear everything down, whatever fails
                pass


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(deliver: bool = True, **config: Any) -> Node:
        root = tmp_path / f"node{len(made)}"
        root.mkdir()
        files = root / "worker"
        files.mkdir()
        (root / "archive").mkdir()
        receiver = DirectoryReceiver.delivering_to(root, root / "archive", retention="1h")
        if config:
            receiver.write_config(**config)
        node = Node(
            receiver,
            Deliver(receiver.config_path, receiver.data_dir, root / "d.log"),
            root / "archive",
            files,
        )
        made.append(node)
        receiver.start()
        if deliver:
            node.deliver.start()
        return node

    yield make
    for node in made:
        node.close()


def _headers(path: Path) -> tuple[int, dict[str, str]]:
    """The final response's status and headers from curl's ``--dump-header`` file."""
    blocks = path.read_bytes().decode("latin-1").strip().split("\r\n\r\n")
    lines = blocks[-1].split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers


def _receipt(header: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(base64.urlsafe_b64decode(header + "=" * (-len(header) % 4)))
    assert list(doc) == RECEIPT_FIELDS
    return doc


# -- the tests ----------------------------------------------------------------------------------


def test_curl_upload_is_receipted_and_delivered(make_node: Callable[..., Node]) -> None:
    """seesaw's curl gets 201 with a receipt for the stored bytes; the file is delivered, and
    HQ finds it by origin."""
    node = make_node()
    path, data = node.item(3 * MiB)
    dumped = node.files.parent / "headers.txt"
    done = seesaw_curl(path, node.target(), "--dump-header", str(dumped))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == f"Upload server: {node.target()}{ITEM}\n"
    status, headers = _headers(dumped)
    assert status == 201
    receipt = _receipt(headers["artifact-receipt"])
    assert receipt["checksum"] == blake3_hex(data) and receipt["size_bytes"] == len(data)
    oid = receipt["object_id"]
    assert node.receipts() == [oid]
    looked_up = requests.get(f"{node.receiver.base_url}/api/v1/receipts/{oid}", timeout=10)
    assert _receipt(base64.urlsafe_b64encode(looked_up.content).decode()) == receipt
    delivered = wait_for(
        lambda: node.delivered(oid).exists() and node.delivered(oid),
        60,
        "the delivery",
        0.2,
        node.deliver.log_tail,
    )
    assert delivered.read_bytes() == data
    row = deliveries(node.receiver.config_path)[oid]
    assert (row["project"], row["filename"], row["downloader"]) == (PROJECT, ITEM, DOWNLOADER)
    # Where is item X: HQ asks by origin and sees it delivered.
    where = requests.get(
        f"{node.receiver.base_url}/api/v1/objects:by-origin",
        params={"project": PROJECT, "filename": ITEM, "downloader": DOWNLOADER},
        timeout=10,
    ).json()
    [found] = where["results"]
    assert found["object_id"] == oid and found["delivery"]["state"] == "delivered"


def test_a_lost_answer_then_the_retry_makes_one_object(make_node: Callable[..., Node]) -> None:
    """The first 201 never reaches curl (it fails, as seesaw would see it); the retry gets the
    same receipt, and so does one after a receiver restart; one object is delivered."""
    node = make_node()
    path, data = node.item(2 * MiB)
    relay = node.relay(drop_answer=True)
    lost = seesaw_curl(path, node.target(relay.port))
    assert lost.returncode != 0 and relay.cut.is_set()
    [oid] = wait_for(node.receipts, 10, "the first copy's receipt")
    dumped = node.files.parent / "headers.txt"
    retry = seesaw_curl(path, node.target(), "--dump-header", str(dumped))
    assert retry.returncode == 0, retry.stderr
    status, headers = _headers(dumped)
    assert status == 200 and _receipt(headers["artifact-receipt"])["object_id"] == oid
    assert node.receipts() == [oid]
    assert {e for e in node.uploads_left() if not e.endswith(".info")} == {oid}
    # After a restart the receiver remembers nothing: the index finds the first copy.
    node.receiver.restart(signal.SIGTERM)
    again = seesaw_curl(path, node.target(), "--dump-header", str(dumped))
    assert again.returncode == 0, again.stderr
    status, headers = _headers(dumped)
    assert status == 200 and _receipt(headers["artifact-receipt"])["object_id"] == oid
    assert node.receipts() == [oid]
    wait_for(lambda: node.delivered(oid).exists(), 60, "the delivery", 0.2)
    assert node.delivered(oid).read_bytes() == data
    assert [p.name for p in node.archive.iterdir()] == [f"{PROJECT}-{oid}"]
    assert list(deliveries(node.receiver.config_path)) == [oid]


def test_a_receiver_killed_at_the_commit_point_then_the_retry_makes_one_object(
    make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL right after the commit point (``accepted``: the receipt is durable, its index row
    not written, no answer sent), then a restart with canner-deliver not running, so no rescan
    helps: seesaw's retry gets 200 with the first receipt, and one object exists."""
    monkeypatch.setenv("CANNER_CRASH_AT", "accepted")
    node = make_node(deliver=False)
    monkeypatch.delenv("CANNER_CRASH_AT")
    path, data = node.item(2 * MiB)
    killed = seesaw_curl(path, node.target())
    assert killed.returncode != 0, "the receiver answered instead of dying at the commit point"
    proc = node.receiver.proc
    assert proc is not None
    wait_for(lambda: proc.poll() is not None, 20, "the receiver to die at accepted")
    assert proc.returncode == -signal.SIGKILL
    [oid] = node.receipts()
    assert deliveries(node.receiver.config_path) == {}, "the index row was written before the kill"

    node.receiver.start()
    dumped = node.files.parent / "headers.txt"
    retry = seesaw_curl(path, node.target(), "--dump-header", str(dumped))
    assert retry.returncode == 0, retry.stderr
    status, headers = _headers(dumped)
    receipt = _receipt(headers["artifact-receipt"])
    assert (status, receipt["object_id"]) == (200, oid), node.receiver.log_tail()
    assert receipt["checksum"] == blake3_hex(data) and receipt["size_bytes"] == len(data)
    assert node.receipts() == [oid]
    assert {e for e in node.uploads_left() if not e.endswith(".info")} == {oid}
    # The receiver's start put the missing row in the index: HQ finds the object by origin.
    row = deliveries(node.receiver.config_path)[oid]
    assert (row["project"], row["filename"], row["downloader"]) == (PROJECT, ITEM, DOWNLOADER)
    assert list(deliveries(node.receiver.config_path)) == [oid]


@pytest.mark.parametrize("refusal", ["floor", "draining"])
def test_a_refusal_comes_before_the_body(make_node: Callable[..., Node], refusal: str) -> None:
    """Under the free space floor (429) or draining (503): curl fails, and of a 32 MiB file no
    more than the request head crossed the wire."""
    if refusal == "floor":
        node = make_node(deliver=False, min_free_bytes=1 << 60)
    else:
        node = make_node(deliver=False)
        drained = subprocess.run(
            [venv_bin("canner"), "drain", "--config", str(node.receiver.config_path)],
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert drained.returncode == 0, drained.stderr
    path, _ = node.item(32 * MiB)
    relay = node.relay()
    started = time.monotonic()
    refused = seesaw_curl(path, node.target(relay.port))
    assert refused.returncode == 22, refused.stderr  # curl --fail: an HTTP error
    expected = b"429" if refusal == "floor" else b"503"
    assert expected in refused.stderr
    assert relay.sent < 4096, f"{relay.sent} bytes crossed before the refusal"
    assert time.monotonic() - started < 10
    assert node.receipts() == [] and node.uploads_left() == set()


def test_a_put_cut_mid_body_leaves_no_object(make_node: Callable[..., Node]) -> None:
    """The connection breaks halfway through the body: curl fails, nothing is kept."""
    node = make_node(deliver=False)
    path, _ = node.item(16 * MiB)
    relay = node.relay(cut_after=8 * MiB)
    cut = seesaw_curl(path, node.target(relay.port))
    assert cut.returncode != 0 and relay.cut.is_set()
    wait_for(lambda: not node.uploads_left(), 10, "the partial upload to go")
    assert node.receipts() == []
    # seesaw's retry uploads the whole file as a new object.
    assert seesaw_curl(path, node.target()).returncode == 0
    assert len(node.receipts()) == 1


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_2_gib_put_keeps_the_receiver_memory_flat(make_node: Callable[..., Node]) -> None:
    """A 2 GiB body streams to disk: the receiver's peak RSS grows by far less than the body."""
    node = make_node(deliver=False, max_upload_bytes=4 << 30)
    path = node.files / ITEM
    with open(path, "wb") as f:
        f.truncate(2 << 30)  # sparse: the worker side costs no disk
    assert node.receiver.proc is not None
    pid = node.receiver.proc.pid
    # Warm up the paths an upload takes, so the baseline includes their code and buffers.
    small, _ = node.item(4 * MiB, "warmup.warc.zst")
    assert seesaw_curl(small, node.target()).returncode == 0
    before = _peak_rss(pid)
    done = seesaw_curl(path, node.target())
    assert done.returncode == 0, done.stderr
    grown = _peak_rss(pid) - before
    assert grown < 128 * MiB, f"peak RSS grew by {grown // MiB} MiB for a 2 GiB body"
    [oid] = [o for o in node.receipts() if (node.receiver.uploads_dir / o).stat().st_size > MiB * 8]
    receipt = node.receiver.get_receipt(oid).json()
    assert receipt["size_bytes"] == 2 << 30
