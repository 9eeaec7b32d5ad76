"""Workers on real networks, against real receiver processes: a PATCH whose connection went
half-open, refusals that must come before the body, a receipt looked up while its acceptance
runs, slow clients, a disk that fills mid-PATCH, and a client that follows the Go SDK's rules
through all of it (``go_style_client.py``).
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import blake3
import pytest
import requests
from e2e_support import (
    OFFSET_TYPE,
    TUS_VERSION,
    Receiver,
    blake3_hex,
    decode_receipt_header,
    read_http_response,
    spawn_daemon,
    upload_metadata,
)
from go_style_client import GoStyleClient, UploadFailed
from tusclient import client as tus_client

pytestmark = pytest.mark.e2e

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + size).randbytes(size)


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes (FIN or reset), within ``timeout``."""
    sock.settimeout(timeout)
    received = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        received += chunk
    return received


def patch_head(port: int, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"PATCH {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


# -- 1. a stalled PATCH is taken over -------------------------------------------------------------


@pytest.mark.parametrize("resume", ["head-then-patch", "patch"])
def test_stalled_patch_is_taken_over_and_its_bytes_are_kept(
    receiver: Receiver, resume: str
) -> None:
    """A PATCH goes silent without closing (the worker's network changed): the worker's resume
    is not refused with 423 until the idle timeout; the silent request is ended, the bytes it
    wrote count, the offset is exact and the upload completes."""
    data = payload(3 * MiB + 5, seed=1)
    oid = receiver.new_upload(data)
    first = MiB + 17
    with receiver.open_patch(oid, 0, len(data), data[:first]) as stalled:
        assert receiver.wait_offset(oid, first) == first
        if resume == "head-then-patch":
            head = receiver.head(oid)
            assert head.status_code == 200, head.status_code
            assert int(head.headers["Upload-Offset"]) == first
        # The session's timeout (30 s) is far below the 300 s idle timeout that used to free it.
        r = receiver.patch(oid, first, data[first:])
        assert r.status_code == 204, (r.status_code, r.text)
        assert read_until_closed(stalled, 5.0) == b"", "the stalled request got an answer"
    receiver.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)
    assert "a newer request takes over" in receiver.log_text()


def test_go_style_client_resumes_after_a_half_open_patch(receiver: Receiver) -> None:
    data = payload(4 * MiB, seed=2)
    client = GoStyleClient(receiver.base_url, stall_first_patch_after=MiB)
    try:
        receipt = client.upload(data)
    finally:
        client.close()
    assert "PATCH stalled after 1048576 bytes" in client.log
    assert "PATCH 423" not in client.log, client.log
    oid = _receipt_id(receipt)
    assert receiver.get_receipt(oid).content == receipt
    assert receiver.stored(oid) == data


def _receipt_id(receipt: bytes) -> str:
    object_id: str = json.loads(receipt)["object_id"]
    return object_id


# -- 2. refusals come from the head ---------------------------------------------------------------

TWO_GIB = str(2 * GiB)


def _refusal_cases(oid: str, unknown: str) -> dict[str, tuple[int, str, dict[str, str]]]:
    base = {"Tus-Resumable": TUS_VERSION, "Content-Type": OFFSET_TYPE, "Upload-Offset": "0"}
    return {
        "409-wrong-offset": (409, f"/files/{oid}", {**base, "Upload-Offset": "5"}),
        "404-unknown-upload": (404, f"/files/{unknown}", base),
        "415-content-type": (415, f"/files/{oid}", {**base, "Content-Type": "text/plain"}),
        "412-tus-version": (412, f"/files/{oid}", {**base, "Tus-Resumable": "0.2.2"}),
        "413-past-its-length": (413, f"/files/{oid}", base),
    }


@pytest.mark.parametrize("expect_continue", [False, True], ids=["plain", "expect-100"])
@pytest.mark.parametrize(
    "case",
    [
        "409-wrong-offset",
        "404-unknown-upload",
        "415-content-type",
        "412-tus-version",
        "413-past-its-length",
    ],
)
def test_refusal_is_answered_before_any_body_byte(
    shared_receiver: Receiver, case: str, expect_continue: bool
) -> None:
    """A 2 GiB PATCH into a 1 MiB upload, measured on a raw socket: the refusal arrives with
    not one body byte sent, never after a ``100 Continue``, and the connection is closed."""
    rcv = shared_receiver
    data = payload(MiB, seed=3)
    oid = rcv.new_upload(data)
    unknown = "f" * 32
    status, path, headers = _refusal_cases(oid, unknown)[case]
    headers = {**headers, "Content-Length": TWO_GIB}
    if expect_continue:
        headers["Expect"] = "100-continue"
    with socket.create_connection(("127.0.0.1", rcv.port)) as sock:
        sock.sendall(patch_head(rcv.port, path, headers))
        answer = read_until_closed(sock)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"100 Continue" not in answer
    assert b"\r\nConnection: close\r\n" in answer
    assert b"\r\nTus-Resumable: 1.0.0\r\n" in answer
    assert rcv.offset(oid) == 0, "a refused PATCH stored bytes"


def test_a_client_that_keeps_sending_after_a_refusal_is_cut_off(shared_receiver: Receiver) -> None:
    """It got its 409 at once; the server does not read a 2 GiB body nobody wants."""
    rcv = shared_receiver
    oid = rcv.new_upload(payload(MiB, seed=4))
    block = b"x" * (64 * KiB)
    sent = 0
    with socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as sock:
        headers = {
            "Tus-Resumable": TUS_VERSION,
            "Content-Type": OFFSET_TYPE,
            "Upload-Offset": "7",
            "Content-Length": TWO_GIB,
        }
        sock.sendall(patch_head(rcv.port, f"/files/{oid}", headers))
        try:
            while sent < 512 * MiB:
                sock.sendall(block)
                sent += len(block)
        except OSError:
            pass
    assert sent < 64 * MiB, f"the server read {sent} bytes of a refused body"
    assert rcv.offset(oid) == 0


def test_an_admitted_body_gets_100_continue_then_its_answer(shared_receiver: Receiver) -> None:
    rcv = shared_receiver
    data = payload(100 * KiB, seed=5)
    oid = rcv.new_upload(data)
    headers = {
        "Tus-Resumable": TUS_VERSION,
        "Content-Type": OFFSET_TYPE,
        "Upload-Offset": "0",
        "Content-Length": str(len(data)),
        "Expect": "100-continue",
    }
    with socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as sock:
        sock.sendall(patch_head(rcv.port, f"/files/{oid}", headers))
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            chunk = sock.recv(1)
            assert chunk, "closed before 100 Continue"
            interim += chunk
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(data)
        status, answer, _ = read_http_response(sock, "PATCH")
    assert status == 204
    rcv.verify_receipt(answer.get("Artifact-Receipt"), oid, data)


# -- 3. the receipt window ------------------------------------------------------------------------


def test_receipt_lookup_racing_a_1gib_acceptance_gets_the_receipt(
    make_receiver: Callable[..., Receiver],
) -> None:
    """The final answer of a 1 GiB upload is lost; the worker asks for the receipt while canner
    still hashes and commits: the lookup and HEAD wait and carry the receipt, never a 404 or a
    complete upload without one."""
    receiver = make_receiver(max_upload_bytes=2 * GiB)
    block = payload(MiB, seed=6)
    count = 1024
    hasher = blake3.blake3()
    for _ in range(count):
        hasher.update(block)
    size = len(block) * count
    r = receiver.create(size, "blake3:" + hasher.hexdigest())
    assert r.status_code == 201, r.text
    oid = receiver.object_id(r)
    with receiver.open_patch(oid, 0, size) as sock:
        for _ in range(count):
            sock.sendall(block)
        # The worker's answer is lost from here on: once the receiver has every byte (the
        # file is whole on disk), acceptance (hash 1 GiB, fsync, commit) runs.
        deadline = time.monotonic() + 60
        while (receiver.uploads_dir / oid).stat().st_size < size:
            assert time.monotonic() < deadline, "the receiver never got the whole body"
            time.sleep(0.005)
        looked_up = requests.get(f"{receiver.base_url}/api/v1/receipts/{oid}", timeout=60)
        head = receiver.head(oid)
        status, headers, _ = read_http_response(sock, "PATCH")
    assert status == 204
    receipt = decode_receipt_header(headers["Artifact-Receipt"])
    assert looked_up.status_code == 200, (looked_up.status_code, looked_up.text)
    assert looked_up.content == receipt
    assert head.status_code == 200
    assert head.headers.get("Artifact-Receipt") == headers["Artifact-Receipt"]


def test_go_style_client_whose_final_answer_is_lost(receiver: Receiver) -> None:
    data = payload(64 * MiB, seed=7)
    client = GoStyleClient(receiver.base_url, drop_final_answer=True)
    receipt = client.upload(data)
    assert "PATCH sent whole, answer dropped" in client.log
    assert receiver.get_receipt(_receipt_id(receipt)).content == receipt


# -- 5. slow clients ------------------------------------------------------------------------------


@pytest.fixture
def many_files() -> Iterator[None]:
    """This test process holds over a thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_slow_connections_from_one_address_do_not_lock_others_out(
    tmp_path: Path, many_files: None
) -> None:
    """1,100 connections from 127.0.0.2 trickle request heads into a receiver whose open-file
    limit is 1024: the address gets its 256 connections and then 503s, the receiver keeps its
    files, and tuspy, the Go-style client and /healthz from 127.0.0.1 go on working."""
    rcv = Receiver.in_dir(tmp_path / "receiver")
    rcv.launch_prefix = ["prlimit", "--nofile=1024:1024", "--"]
    slow: list[socket.socket] = []
    try:
        rcv.start()
        assert "allows 768 client connections" in rcv.log_text()
        for _ in range(1100):
            sock = socket.create_connection(
                ("127.0.0.1", rcv.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            sock.sendall(b"PATCH /files/")
            slow.append(sock)
        for i in range(3):
            data = payload(300 * KiB, seed=10 + i)
            uploader = tus_client.TusClient(rcv.files_url).uploader(
                file_stream=io.BytesIO(data),
                metadata={"project": "example", "checksum": blake3_hex(data)},
                retries=3,
                retry_delay=1,
            )
            uploader.upload()
            header = uploader.request.response_headers.get("artifact-receipt")
            rcv.verify_receipt(header, uploader.url.rsplit("/", 1)[1], data)
        assert GoStyleClient(rcv.base_url).upload(payload(MiB, seed=20))
        assert requests.get(f"{rcv.base_url}/healthz", timeout=10).status_code == 200
        refused = 0
        for sock in slow:
            sock.settimeout(0.01)
            try:
                refused += sock.recv(64).startswith(b"HTTP/1.1 503 ")
            except (TimeoutError, BlockingIOError):
                pass
        assert refused == 1100 - 256, f"{refused} of the slow connections were refused"
        assert rcv.proc is not None and rcv.proc.poll() is None
        assert "Too many open files" not in rcv.log_text()
        assert "connection cap reached" in rcv.log_text(), "the operator is not told"
        assert "Traceback" not in rcv.log_text()
    finally:
        for sock in slow:
            sock.close()
        rcv.close()


def test_request_heads_have_a_deadline(make_receiver: Callable[..., Receiver]) -> None:
    """A head trickled a byte at a time gets 408 at the deadline; a connection that never sends
    anything is closed; requests that send their head at once are served meanwhile."""
    rcv = make_receiver(connections={"header_timeout": "2s"})
    with (
        socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as trickling,
        socket.create_connection(("127.0.0.1", rcv.port), timeout=10) as silent,
    ):
        trickling.sendall(b"PATCH /files/" + b"a" * 32 + b" HTTP/1.1\r\n")
        answer = b""
        started = time.monotonic()
        trickling.settimeout(0.25)
        while time.monotonic() - started < 8:
            try:
                trickling.sendall(b"X")
                chunk = trickling.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert requests.get(f"{rcv.base_url}/healthz", timeout=5).status_code == 200
        assert read_until_closed(silent, 8.0) == b""


# -- 6. the disk fills mid-PATCH ------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,nr_inodes=64", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@needs_root
def test_disk_filling_mid_patch_is_503_and_keeps_the_bytes(
    make_receiver: Callable[..., Receiver], small_tmpfs: Path
) -> None:
    """A 40 MiB PATCH onto a 24 MiB tmpfs: 503 with Retry-After (never a 500), the bytes that
    fit are kept and HEAD says how many; once the volume grows the worker sends the rest.  (The
    upload is created while the volume is large enough: the receiver refuses a creation whose
    length free space cannot cover; the volume then shrinks under it, as when something else
    takes the space.)"""
    rcv = make_receiver(data_dir=small_tmpfs / "data")
    data = payload(40 * MiB, seed=8)
    subprocess.run(["mount", "-o", "remount,size=96m", str(small_tmpfs)], check=True)
    oid = rcv.new_upload(data)
    subprocess.run(["mount", "-o", "remount,size=24m", str(small_tmpfs)], check=True)
    r = rcv.patch(oid, 0, data)
    assert r.status_code == 503, (r.status_code, r.text)
    assert "Retry-After" in r.headers
    kept = rcv.offset(oid)
    assert 0 < kept < len(data)
    assert rcv.stored(oid) == data[:kept]
    assert "out of space while writing" in rcv.log_text()
    assert "Traceback" not in rcv.log_text()
    subprocess.run(["mount", "-o", "remount,size=96m", str(small_tmpfs)], check=True)
    again = rcv.patch(oid, kept, data[kept:])
    assert again.status_code == 204, (again.status_code, again.text)
    rcv.verify_receipt(again.headers.get("Artifact-Receipt"), oid, data)


@needs_root
def test_no_inode_left_at_creation_is_503(
    make_receiver: Callable[..., Receiver], small_tmpfs: Path
) -> None:
    rcv = make_receiver(data_dir=small_tmpfs / "data")
    statuses = []
    for _ in range(80):
        r = rcv.create(10, blake3_hex(b"x" * 10))
        statuses.append(r.status_code)
        if r.status_code != 201:
            assert r.status_code == 503, (r.status_code, r.text)
            assert "Retry-After" in r.headers
            break
    assert statuses[-1] == 503, "the tmpfs never ran out of inodes"
    assert "Traceback" not in rcv.log_text()


# -- the Go SDK's rules, under the floor and across a restart -------------------------------------


def test_go_style_client_waits_out_429_and_a_restart(
    make_receiver: Callable[..., Receiver],
) -> None:
    """Under the free-space floor creation is 429; the operator fixes it and restarts the
    receiver.  The SDK waits out the 429s but gives up on a creation that meets the restart (a
    transport error there is ambiguous), so the worker, as workers do, runs the upload again:
    the upload goes through, with one receipt for it."""
    rcv = make_receiver(min_free_bytes=1 << 60)
    data = payload(2 * MiB, seed=9)

    def operator() -> None:
        time.sleep(1.5)
        rcv.write_config(min_free_bytes=1)
        rcv.restart()

    fixing = threading.Thread(target=operator)
    fixing.start()
    clients = []
    try:
        for _ in range(60):  # the worker's own retries, half a second apart
            clients.append(GoStyleClient(rcv.base_url, max_attempts=120))
            try:
                receipt = clients[-1].upload(data)
                break
            except UploadFailed as e:
                assert "transport error" in str(e), (e, clients[-1].log)
                time.sleep(0.5)
        else:
            pytest.fail(f"no receipt: {clients[-1].log}")
    finally:
        fixing.join()
    assert "POST 429" in clients[0].log
    assert rcv.get_receipt(_receipt_id(receipt)).content == receipt
    assert rcv.stored(_receipt_id(receipt)) == data


@pytest.mark.parametrize("form", ["default", "public_url", "trusted forwarded headers"])
def test_go_style_client_uploads_with_every_location_form(receiver: Receiver, form: str) -> None:
    """The Go SDK's rules (Location resolved against its base URL) get a receipt from every
    form of Location canner emits, the default (path-absolute) first: the relative ``./<id>``
    used to send it to ``/<id>`` and fail every upload."""
    origin = urlsplit(receiver.base_url)
    proxy_headers: dict[str, str] = {}
    if form == "public_url":
        receiver.write_config(public_url=receiver.base_url + "/")
        receiver.restart()
    elif form == "trusted forwarded headers":
        receiver.write_config(trust_forwarded_headers=True)
        receiver.restart()
        proxy_headers = {"X-Forwarded-Proto": origin.scheme, "X-Forwarded-Host": origin.netloc}
    data = payload(300 * KiB, seed=31)
    client = GoStyleClient(receiver.base_url + "/", extra_headers=proxy_headers)
    receipt = client.upload(data)
    assert client.log == ["POST 201", "HEAD 200", "PATCH 204"], client.log
    assert receiver.stored(_receipt_id(receipt)) == data


def test_go_style_client_refuses_a_cross_origin_location(
    make_receiver: Callable[..., Receiver],
) -> None:
    """The client is as strict as the SDK (so its successes above mean something): a
    ``public_url`` that is not the origin the worker uses makes every upload fail at creation,
    which is why canner's default Location names no origin."""
    rcv = make_receiver(public_url="https://elsewhere.example/")
    with pytest.raises(UploadFailed, match="cross-origin upload location"):
        GoStyleClient(rcv.base_url).upload(b"abc")


# -- 4. Location on an ssl: listener --------------------------------------------------------------


# tuspy can only switch certificate checks off (our requests below check against the cert).
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_uploads_over_an_ssl_listener_get_a_usable_location(tmp_path: Path) -> None:
    """On an ``ssl:`` listener the Location used to be ``http://``; path-absolute, it resolves to
    the https URL the client used: tuspy (verifying nothing but the protocol) and the Go SDK's
    rules (verifying the certificate) get their receipts."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    rcv = Receiver.in_dir(tmp_path / "receiver")
    rcv.write_config(listen=f"ssl:{rcv.port}:privateKey={key}:certKey={cert}:interface=127.0.0.1")
    base = f"https://127.0.0.1:{rcv.port}"
    rcv.proc = spawn_daemon("receiver", rcv.config_path, rcv.log_path, 1)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert rcv.proc.poll() is None, rcv.log_tail()
            try:
                if requests.get(f"{base}/healthz", verify=str(cert), timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                assert time.monotonic() < deadline, rcv.log_tail()
                time.sleep(0.1)
        data = payload(200 * KiB, seed=30)
        created = requests.post(
            f"{base}/files/",
            verify=str(cert),
            timeout=10,
            headers={
                "Tus-Resumable": TUS_VERSION,
                "Upload-Length": str(len(data)),
                "Upload-Metadata": upload_metadata(blake3_hex(data)),
            },
        )
        assert created.status_code == 201
        assert urljoin(f"{base}/files/", created.headers["Location"]).startswith(f"{base}/files/")
        uploader = tus_client.TusClient(f"{base}/files/").uploader(
            file_stream=io.BytesIO(data),
            metadata={"project": "example", "checksum": blake3_hex(data)},
            verify_tls_cert=False,
        )
        uploader.upload()
        assert uploader.url.startswith(f"{base}/files/")
        receipt = decode_receipt_header(uploader.request.response_headers["artifact-receipt"])
        oid = json.loads(receipt)["object_id"]
        assert requests.get(
            f"{base}/api/v1/receipts/{oid}", verify=str(cert), timeout=10
        ).content == (receipt)
        # The Go SDK's rules, checking the certificate: its base URL is the https origin.
        go_client = GoStyleClient(
            f"{base}/", ssl_context=ssl.create_default_context(cafile=str(cert))
        )
        go_data = payload(100 * KiB, seed=32)
        go_receipt = json.loads(go_client.upload(go_data))
        assert go_client.log == ["POST 201", "HEAD 200", "PATCH 204"], go_client.log
        assert go_receipt["checksum"] == blake3_hex(go_data)
    finally:
        rcv.close()
