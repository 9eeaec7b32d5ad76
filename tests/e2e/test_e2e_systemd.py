"""The daemons as systemd runs them: ``Type=notify`` readiness and watchdog over a real
``$NOTIFY_SOCKET``, one-line refusals (port in use, placeholder issuer, missing data_dir) and
``/readyz`` over real HTTP.  No systemd is needed: the test binds the notify socket itself."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from deliver_support import wait_for
from e2e_support import REPO, Receiver, end_process, twistd_command

pytestmark = pytest.mark.e2e


@pytest.fixture
def notify_socket() -> Iterator[tuple[Path, socket.socket]]:
    folder = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    path = folder / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield path, sock
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def messages(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Datagrams received until one equals ``until`` (bounded by ``timeout``)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while until not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {until!r} from the daemon; got {seen}")
        sock.settimeout(left)
        try:
            seen.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
    return seen


def run_daemon(
    role: str, config: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                *twistd_command(),
                "--nodaemon",
                "--pidfile=",
                f"canner-{role}",
                "--config",
                str(config),
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


def test_receiver_tells_systemd_ready_once_listening_and_feeds_the_watchdog(
    tmp_path: Path, notify_socket: tuple[Path, socket.socket]
) -> None:
    """READY=1 arrives when the port already answers; WATCHDOG=1 every third of WatchdogSec
    while the reactor runs, none while it is frozen; STOPPING=1 on SIGTERM."""
    path, sock = notify_socket
    rcv = Receiver.in_dir(tmp_path / "receiver")
    proc = run_daemon(
        "receiver",
        rcv.config_path,
        rcv.log_path,
        {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1500000"},
    )
    try:
        seen = messages(sock, "READY=1", 20)
        assert requests.get(rcv.base_url + "/healthz", timeout=5).status_code == 200
        assert set(seen) <= {"READY=1", "WATCHDOG=1"}
        pings = messages(sock, "WATCHDOG=1", 3) + messages(sock, "WATCHDOG=1", 3)
        assert pings.count("WATCHDOG=1") >= 2
        proc.send_signal(signal.SIGSTOP)  # a wedged reactor: no more pings
        time.sleep(0.2)
        sock.setblocking(False)
        try:
            while sock.recv(4096):
                pass
        except BlockingIOError:
            pass
        time.sleep(1.5)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in messages(sock, "STOPPING=1", 15)
    finally:
        end_process(proc, signal.SIGTERM)


def test_deliver_tells_systemd_ready_once_its_index_answers(
    tmp_path: Path, notify_socket: tuple[Path, socket.socket]
) -> None:
    """canner-deliver sends READY=1 after opening its index (its heartbeat row exists then)."""
    path, sock = notify_socket
    rcv = Receiver.in_dir(tmp_path / "receiver")
    proc = run_daemon(
        "deliver", rcv.config_path, tmp_path / "deliver.log", {"NOTIFY_SOCKET": str(path)}
    )
    try:
        messages(sock, "READY=1", 20)
        assert (rcv.data_dir / "delivery.sqlite").exists()
    finally:
        end_process(proc, signal.SIGTERM)


def one_line_refusal(role: str, config: Path, log: Path) -> str:
    proc = run_daemon(role, config, log)
    assert proc.wait(30) == 1
    text = log.read_text(encoding="utf-8")
    assert "Traceback" not in text, text
    return text


def test_a_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    """Another process on the port: exit 1, one line naming the endpoint and the reason."""
    rcv = Receiver.in_dir(tmp_path / "receiver")
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", rcv.port))
        taken.listen()
        text = one_line_refusal("receiver", rcv.config_path, rcv.log_path)
    [line] = [t for t in text.splitlines() if "cannot listen" in t]
    assert f"cannot listen on tcp:{rcv.port}:interface=127.0.0.1 (listen)" in line
    assert "Address already in use" in line


def test_placeholder_issuer_and_missing_data_dir_are_refused_in_one_line(tmp_path: Path) -> None:
    """The shipped example issuer and a data_dir that does not exist stop start-up, each with
    one line naming the key; nothing is created."""
    rcv = Receiver.in_dir(tmp_path / "receiver", issuer="https://canner.example")
    text = one_line_refusal("receiver", rcv.config_path, tmp_path / "placeholder.log")
    assert text.strip().count("\n") == 0
    assert "config key 'issuer': is still the placeholder 'https://canner.example'" in text
    rcv.write_config(data_dir=str(tmp_path / "unmounted" / "data"))
    for role in ("receiver", "deliver"):
        log = tmp_path / f"missing-{role}.log"
        text = one_line_refusal(role, rcv.config_path, log)
        assert f"config key 'data_dir': {tmp_path / 'unmounted' / 'data'} does not exist" in text
    assert not (tmp_path / "unmounted").exists()


def test_readyz_over_http(tmp_path: Path) -> None:
    """200 while uploads are accepted; 503 with the reason while free space is under the floor,
    with the crossing logged once however many requests see it."""
    rcv = Receiver.in_dir(tmp_path / "ok")
    rcv.start()
    try:
        ok = requests.get(rcv.base_url + "/readyz", timeout=10)
        assert ok.status_code == 200 and ok.json()["status"] == "ready"
    finally:
        rcv.close()
    full = Receiver.in_dir(tmp_path / "full", min_free_bytes=10**18)
    full.start()
    try:
        for _ in range(3):
            refused = requests.get(full.base_url + "/readyz", timeout=10)
            assert refused.status_code == 503
        assert any("free space under the floor" in r for r in refused.json()["reasons"])
        assert full.create(10, "blake3:" + "0" * 64).status_code == 429
        wait_for(lambda: "under the floor" in full.log_text(), 10, "the floor warning")
    finally:
        full.close()
    assert full.log_text().count("is under the floor") == 1
