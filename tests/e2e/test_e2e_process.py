"""Process-level behaviour: recovery of an upload whose acceptance a SIGKILL interrupted, the
stale-upload sweep, graceful stop during a PATCH, two receivers sharing one data directory, and
the ``Location`` a receiver hands out, and a data directory its user cannot write (at start and
while running, with the daemons run as an unprivileged user)."""

from __future__ import annotations

import json
import os
import pwd
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urljoin

import pytest
import requests
from deliver_support import venv_bin
from e2e_support import (
    OBJECT_ID,
    REPO,
    Nobody,
    Receiver,
    blake3_hex,
    end_process,
    spawn_daemon,
)

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024


def crash_during_acceptance(rcv: Receiver, size: int = 8 * MiB) -> tuple[str, bytes]:
    """Leave an upload complete on disk without a receipt, the way a real crash does: send the
    last byte, and SIGKILL the receiver as soon as the data file is complete (acceptance then
    runs: fsync, BLAKE3, receipt).  Retried a few times in case acceptance won the race."""
    rng = random.Random(size)
    for _attempt in range(8):
        data = rng.randbytes(size)
        oid = rcv.new_upload(data)
        assert rcv.patch(oid, 0, data[:-1]).status_code == 204
        path = rcv.uploads_dir / oid
        with rcv.open_patch(oid, size - 1, 1, data[-1:]):
            deadline = time.monotonic() + 5
            while path.stat().st_size < size and time.monotonic() < deadline:
                pass
            rcv.kill()
        rcv.start()
        if path.stat().st_size == size and not (rcv.receipts_dir / f"{oid}.json").exists():
            return oid, data
    pytest.fail("could not SIGKILL the receiver between the last byte and the receipt")


def test_head_after_crash_runs_acceptance_again(receiver: Receiver) -> None:
    rcv = receiver
    oid, data = crash_during_acceptance(rcv)
    assert rcv.get_receipt(oid).status_code == 404
    deadline = time.monotonic() + 15
    while True:
        head = rcv.head(oid)
        assert head.status_code == 200, head.status_code
        assert head.headers["Upload-Offset"] == str(len(data))
        if head.headers.get("Artifact-Receipt") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    header = head.headers.get("Artifact-Receipt")
    assert header, "HEAD on a complete, unaccepted upload never led to a receipt"
    rcv.verify_receipt(header, oid, data)
    final = rcv.patch_retrying_locked(oid, len(data), b"")
    assert final.status_code == 204
    assert final.headers.get("Artifact-Receipt") == header


def test_final_patch_after_crash_runs_acceptance_again(receiver: Receiver) -> None:
    rcv = receiver
    oid, data = crash_during_acceptance(rcv)
    final = rcv.patch_retrying_locked(oid, len(data), b"")
    assert final.status_code == 204, f"{final.status_code} {final.text}"
    rcv.verify_receipt(final.headers.get("Artifact-Receipt"), oid, data)


def test_sweep_removes_idle_partial_uploads_only(make_receiver: Callable[..., Receiver]) -> None:
    """``partial_upload_retention = "2s"``: an idle incomplete upload goes; an accepted one, and
    a complete one whose acceptance a crash interrupted, stay (the latter can still get its
    receipt)."""
    rcv = make_receiver(partial_upload_retention="2s")
    data = random.Random(1).randbytes(10_000)
    accepted, receipt = rcv.upload_all(data)
    complete, complete_data = crash_during_acceptance(rcv, size=2 * MiB)
    partial = rcv.new_upload(data)
    assert rcv.patch(partial, 0, data[:5000]).status_code == 204
    # Without touching the uploads (a HEAD would start acceptance), wait until the sweep has
    # removed the idle partial upload and had its chance at the others.
    deadline = time.monotonic() + 12
    while (rcv.uploads_dir / partial).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (rcv.uploads_dir / partial).exists(), "the idle partial upload was not swept"
    time.sleep(1.5)  # at least one more sweep pass (interval: 1 s)
    assert rcv.head(partial).status_code == 404
    assert not (rcv.uploads_dir / f"{partial}.info").exists()

    assert (rcv.uploads_dir / accepted).exists(), "the sweep removed an accepted upload"
    head = rcv.head(accepted)
    assert head.status_code == 200 and head.headers.get("Artifact-Receipt") == receipt
    assert rcv.get_receipt(accepted).status_code == 200

    assert (rcv.uploads_dir / complete).exists(), (
        "the sweep removed a complete upload that had no receipt yet (its acceptance was "
        "interrupted by a crash): it can now never be receipted"
    )
    final = rcv.patch_retrying_locked(complete, len(complete_data), b"")
    assert final.status_code == 204, final.status_code
    rcv.verify_receipt(final.headers.get("Artifact-Receipt"), complete, complete_data)


def test_graceful_stop_during_patch_keeps_received_bytes(receiver: Receiver) -> None:
    rcv = receiver
    data = random.Random(2).randbytes(500_000)
    oid = rcv.new_upload(data)
    with rcv.open_patch(oid, 0, len(data), data[:123_457]):
        assert rcv.wait_offset(oid, 123_457) == 123_457
        started = time.monotonic()
        rcv.stop()  # SIGTERM while the PATCH is open
        assert time.monotonic() - started < 10, "SIGTERM waited for an open PATCH"
    assert rcv.proc is not None and rcv.proc.returncode is not None
    assert "Traceback" not in rcv.log_text(), rcv.log_tail()
    rcv.start()
    assert rcv.offset(oid) == 123_457
    r = rcv.patch(oid, 123_457, data[123_457:])
    assert r.status_code == 204
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)


def test_a_second_receiver_on_the_same_data_dir_is_refused(
    make_receiver: Callable[..., Receiver],
) -> None:
    """A second canner-receiver on a data directory another one serves (on another port) exits
    non-zero with one line naming the first's pid; the first keeps receiver.lock and serves an
    upload begun before, and after its SIGKILL the lock is free for a new one."""
    first = make_receiver("first")
    assert first.proc is not None
    data = random.Random(3).randbytes(300_000)
    oid = first.new_upload(data)
    assert first.patch(oid, 0, data[:100_000]).status_code == 204
    second = Receiver.in_dir(first.root.parent / "second", data_dir=first.data_dir)
    second.starts += 1
    proc = spawn_daemon("receiver", second.config_path, second.log_path, second.starts)
    try:
        code = proc.wait(30)
    finally:
        end_process(proc, signal.SIGKILL)
    assert code != 0, f"the second receiver exited {code}"
    lines = [
        line
        for line in second.log_text().rpartition("===== start #1 =====")[2].splitlines()
        if line.strip()
    ]
    assert len(lines) == 1, lines
    [refusal] = lines
    assert refusal.startswith("canner-receiver: another canner-receiver already serves"), refusal
    assert str(first.data_dir) in refusal and "receiver.lock" in refusal, refusal
    assert f"pid {first.proc.pid}" in refusal, refusal
    assert "Traceback" not in second.log_text(), second.log_text()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{second.base_url}/healthz", timeout=2)
    assert (first.data_dir / "receiver.lock").read_text().strip() == str(first.proc.pid)
    r = first.patch(oid, 100_000, data[100_000:])
    assert r.status_code == 204
    first.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)
    # The lock dies with its process: a receiver started after a SIGKILL serves the directory.
    first.kill()
    second.start()
    try:
        assert second.get_receipt(oid).status_code == 200
        assert second.proc is not None
        assert (first.data_dir / "receiver.lock").read_text().strip() == str(second.proc.pid)
    finally:
        second.close()


def test_location_ignores_forwarded_headers_unless_trusted(receiver: Receiver) -> None:
    data = b"abc"
    r = receiver.create(
        len(data),
        blake3_hex(data),
        headers={"X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https"},
    )
    assert r.status_code == 201
    location = urljoin(receiver.files_url, r.headers["Location"])
    assert location.startswith(receiver.files_url), r.headers["Location"]


def test_location_uses_public_url(make_receiver: Callable[..., Receiver]) -> None:
    rcv = make_receiver(public_url="https://uploads.canner.test/base")
    data = b"abc"
    r = rcv.create(len(data), blake3_hex(data))
    assert r.status_code == 201
    location = r.headers["Location"]
    prefix = "https://uploads.canner.test/base/files/"
    assert location.startswith(prefix), location
    assert OBJECT_ID.fullmatch(location[len(prefix) :]), location
    assert os.path.exists(rcv.uploads_dir / location[len(prefix) :])


NOBODY = pwd.getpwnam("nobody")


def _refusal(role: str, rcv: Receiver, log: Path, nobody: Nobody) -> list[str]:
    """Start canner-``role`` as nobody; it must end by itself with status 1.  Its output lines."""
    proc = spawn_daemon(role, rcv.config_path, log, 1, prefix=nobody.prefix, twistd=nobody.twistd)
    try:
        assert proc.wait(30) == 1
    finally:
        end_process(proc, 9)
    text = log.read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line and not line.startswith("=====")]


def test_a_data_dir_its_user_cannot_write_stops_both_daemons_in_one_line(nobody: Nobody) -> None:
    """A data directory, or an ``uploads/`` in it, that the daemon's user cannot write ends
    start-up with one line naming the path, the user and the fix."""
    open_tmp = nobody.folder
    rcv = Receiver.in_dir(open_tmp / "node")
    data = rcv.data_dir
    fix = f"fix the ownership: chown -R nobody:nogroup {data}"
    for role in ("receiver", "deliver"):
        lines = _refusal(role, rcv, open_tmp / f"{role}.log", nobody)
        assert lines == [
            f"canner-{role}: cannot write {data} as user nobody: Permission denied; {fix}"
        ]
    assert os.listdir(data) == []
    os.chown(data, NOBODY.pw_uid, NOBODY.pw_gid)
    for sub in ("uploads", "receipts"):  # as a run as root leaves them
        (data / sub).mkdir()
    lines = _refusal("receiver", rcv, open_tmp / "uploads.log", nobody)
    uploads = data / "uploads"
    assert lines == [
        f"canner-receiver: cannot write {uploads} as user nobody: Permission denied; {fix}"
    ]


def _check_config(config: Path) -> subprocess.CompletedProcess[str]:
    """``canner check-config`` run as this test runs (root)."""
    return subprocess.run(
        [venv_bin("canner"), "check-config", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_as_root_refuses_a_data_dir_the_daemons_refuse(nobody: Nobody) -> None:
    """Run as root, ``canner check-config`` runs the daemons' start-up check as their user (the
    data directory's owner, nobody, where no ``canner`` account exists): a data directory both
    daemons refuse to start on fails it with the daemons' own line, naming the path and the
    fix; once fixed, it passes; it creates nothing."""
    open_tmp = nobody.folder
    rcv = Receiver.in_dir(open_tmp / "node")
    data = rcv.data_dir
    os.chown(data, NOBODY.pw_uid, NOBODY.pw_gid)
    for sub in ("uploads", "receipts"):  # as a run as root leaves them
        (data / sub).mkdir()
    fix = f"fix the ownership: chown -R nobody:nogroup {data}"
    cases = {
        "uploads owned by root": (data / "uploads", lambda: None),
        "data_dir 0500": (data, lambda: data.chmod(0o500)),
    }
    for n, (what, (path, spoil)) in enumerate(cases.items()):
        spoil()
        refusal = f"cannot write {path} as user nobody: Permission denied; {fix}"
        for role in ("receiver", "deliver"):
            lines = _refusal(role, rcv, open_tmp / f"{role}-{n}.log", nobody)
            assert lines == [f"canner-{role}: {refusal}"], (what, lines)
        before = sorted(os.listdir(data))
        done = _check_config(rcv.config_path)
        assert (done.returncode, done.stdout, done.stderr) == (1, "", f"canner: {refusal}\n"), what
        assert sorted(os.listdir(data)) == before, what
    data.chmod(0o750)
    for path in (data, *data.rglob("*")):
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    done = _check_config(rcv.config_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["config"]["data_dir"] == str(data)


def _storage_trouble(r: requests.Response, what: str) -> None:
    assert r.status_code == 503, f"{what}: {r.status_code} {r.text}"
    assert r.headers.get("Retry-After"), f"{what}: 503 without Retry-After"


def _own(path: Path, user: pwd.struct_passwd, mode: int) -> None:
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(mode)


def test_storage_failures_while_running_are_503_with_retry_after(nobody: Nobody) -> None:
    """Files and directories the receiver's user can no longer read or write: POST, HEAD and
    PATCH get 503 with Retry-After (never 500), nothing is left half-written, and the upload
    completes once the permissions are fixed."""
    rcv = Receiver.in_dir(nobody.folder / "node")
    for sub in ("", "uploads", "receipts"):
        (rcv.data_dir / sub).mkdir(exist_ok=True)
        _own(rcv.data_dir / sub, NOBODY, 0o755)
    rcv.launch_prefix, rcv.launch_twistd = nobody.prefix, nobody.twistd
    rcv.start()
    root = pwd.getpwuid(0)
    try:
        data = os.urandom(100_000)
        oid = rcv.new_upload(data)
        assert rcv.patch(oid, 0, data[:40_000]).status_code == 204
        before = rcv.upload_entries()
        rcv.uploads_dir.chmod(0o555)
        _storage_trouble(rcv.create(10, blake3_hex(b"0" * 10)), "POST, uploads/ read-only")
        assert rcv.upload_entries() == before
        rcv.uploads_dir.chmod(0o755)
        sidecar, stored = rcv.uploads_dir / f"{oid}.info", rcv.uploads_dir / oid
        _own(sidecar, root, 0o600)
        _storage_trouble(rcv.head(oid), "HEAD, sidecar unreadable")
        _storage_trouble(rcv.patch(oid, 40_000, data[40_000:]), "PATCH, sidecar unreadable")
        _own(sidecar, NOBODY, 0o644)
        _own(stored, root, 0o644)
        _storage_trouble(rcv.patch(oid, 40_000, data[40_000:]), "PATCH, data file not writable")
        assert rcv.offset(oid) == 40_000
        _own(stored, NOBODY, 0o644)
        rcv.receipts_dir.chmod(0o555)
        _storage_trouble(rcv.patch(oid, 40_000, data[40_000:]), "final PATCH, receipts/ read-only")
        assert rcv.receipt_ids_on_disk() == []
        rcv.receipts_dir.chmod(0o755)
        final = rcv.patch(oid, len(data), b"")
        assert final.status_code == 204, final.text
        rcv.verify_receipt(final.headers.get("Artifact-Receipt"), oid, data)
    finally:
        rcv.close()
    assert "Traceback" not in rcv.log_text()
