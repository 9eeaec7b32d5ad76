"""End to end: the directory sink with real ``twistd`` processes, real files and real mounts.

* The dev config (``conf/canner.dev.toml``, as ``./dev run`` uses it): tuspy upload -> receipt ->
  the file byte-identical under the archive directory -> the local payload purged.
* A destination on another filesystem (a tmpfs this test mounts), a destination tampered with
  before verification (flagged, payload kept), a destination that is full (retried with backoff,
  nothing lost), and SIGKILL of deliver mid-copy (never a partial file under its final name).

Mounting needs root, as CI runs.  Retry backoff is fast-forwarded with ``make_due_now``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import (
    Deliver,
    DirectoryReceiver,
    deliveries,
    make_due_now,
    venv_bin,
    wait_for,
)
from e2e_support import REPO, Receiver, blake3_hex, end_process, free_port, spawn_daemon
from tusclient import client as tus_client

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PARTIAL_PREFIX = ".canner-partial-"


def payload(size: int) -> bytes:
    block = os.urandom(1 << 16)
    return (block * (size // len(block) + 1))[:size]


# -- a tmpfs the test mounts --------------------------------------------------------------------


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``mount_tmpfs(name, size)`` mounts a fresh tmpfs of ``size`` (e.g. "1m") under tmp_path."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the suite as root)")
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=True
        )
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-l", str(point)], check=False)


def remount(point: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)


# -- receiver + deliver with a directory sink ---------------------------------------------------


@dataclass
class DirEnv:
    receiver: Receiver
    deliver: Deliver
    archive: Path

    @property
    def config(self) -> Path:
        return self.receiver.config_path

    @property
    def db(self) -> Path:
        return self.receiver.data_dir / "delivery.sqlite"

    def row(self, object_id: str) -> dict[str, Any]:
        return deliveries(self.config).get(object_id, {})

    def final(self, object_id: str, filename: str) -> Path:
        return self.archive / f"example-{object_id}" / filename

    def wait_row(
        self, object_id: str, ok: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            row = self.row(object_id)
            return row if row and ok(row) else None

        return wait_for(check, timeout, what, 0.2, self.describe)

    def describe(self) -> str:
        return (
            f"rows: {list(deliveries(self.config).values())}\n--- deliver log ---\n"
            + self.deliver.log_tail(40)
        )

    def close(self) -> None:
        for stop in (lambda: self.deliver.kill(signal.SIGTERM, 5), self.receiver.close):
            try:
                stop()
            except Exception:  # tear everything down, whatever fails
                pass


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Callable[..., DirEnv]]:
    made: list[DirEnv] = []

    def make(archive: Path, retention: str = "2s", start_deliver: bool = True) -> DirEnv:
        root = tmp_path / f"env{len(made)}"
        root.mkdir()
        rcv = DirectoryReceiver.delivering_to(root, archive, retention)
        env = DirEnv(rcv, Deliver(rcv.config_path, rcv.data_dir, root / "deliver.log"), archive)
        made.append(env)
        rcv.start()
        if start_deliver:
            env.deliver.start()
        return env

    try:
        yield make
    finally:
        for env in made:
            env.close()


def partials(root: Path) -> list[Path]:
    return [p for p in root.rglob(PARTIAL_PREFIX + "*")]


# -- the dev config ----------------------------------------------------------------------------


def test_dev_config_upload_receipt_archive_purge(tmp_path: Path) -> None:
    """conf/canner.dev.toml as ./dev run uses it (only the ports and the retention changed, so
    the test neither collides with a developer's daemons nor waits a minute): a tuspy upload gets
    a receipt, the file appears byte-identical under run/archive, the local payload is purged,
    and both daemons serve their metrics."""
    conf = tmp_path / "conf"
    conf.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    text = (REPO / "conf" / "canner.dev.toml").read_text(encoding="utf-8")
    metrics_port = free_port()
    text, n_listen = re.subn(r"tcp:8080:", f"tcp:{port}:", text)
    text, n_metrics = re.subn(r"tcp:9464:", f"tcp:{metrics_port}:", text)
    text, n_issuer = re.subn(r'issuer = "http://127\.0\.0\.1:8080"', f'issuer = "{url}"', text)
    text, n_retention = re.subn(
        r'local_artifact_retention = "[^"]*"', 'local_artifact_retention = "2s"', text
    )
    assert (n_listen, n_metrics, n_issuer, n_retention) == (1, 1, 1, 1)
    config = conf / "canner.dev.toml"
    config.write_text(text, encoding="utf-8")
    run = tmp_path / "run"
    for sub in ("archive", "data"):
        (run / sub).mkdir(parents=True)  # ./dev run makes both
    data_dir, archive = run / "data", run / "archive"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role in ("receiver", "deliver"):
            procs.append(spawn_daemon(role, config, tmp_path / f"{role}.log", 1))

        def healthy() -> bool:
            try:
                return requests.get(f"{url}/healthz", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_for(healthy, 20, "the dev receiver to answer /healthz")
        data = payload(3 * MiB + 7)
        uploader = tus_client.TusClient(f"{url}/files/").uploader(
            file_stream=io.BytesIO(data),
            metadata={"project": "example", "checksum": blake3_hex(data), "filename": "a.warc"},
            chunk_size=MiB,
            retries=0,
        )
        uploader.upload()
        assert uploader.request.response_headers.get("artifact-receipt")
        object_id = uploader.url.rsplit("/", 1)[1]
        receipt = requests.get(f"{url}/api/v1/receipts/{object_id}", timeout=5).json()
        assert receipt["checksum"] == blake3_hex(data)
        final = archive / f"example-{object_id}" / "a.warc"

        def delivered() -> bool:
            return final.exists() and final.read_bytes() == data

        wait_for(delivered, 60, "the file under run/archive", 0.2)
        payload_path = data_dir / "uploads" / object_id
        wait_for(lambda: not payload_path.exists(), 60, "the local payload to be purged", 0.2)
        assert (data_dir / "receipts" / f"{object_id}.json").exists()
        assert final.read_bytes() == data
        status = subprocess.run(
            [venv_bin("canner"), "status", "--json", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(status.stdout)["states"]["delivered"] == 1
        # The status page shows where the file went, and links to no IA item.
        path = f'<code class="path">{archive.resolve()}/example-{object_id}/a.warc</code>'
        page = wait_for(
            lambda: t if path in (t := requests.get(url + "/", timeout=5).text) else None,
            10,
            "the destination path on the status page",
        )
        assert "/details/" not in page and "archive.org" not in page
        # Both daemons' metrics, as the dev config exposes them.
        receiver = requests.get(f"{url}/metrics", timeout=5).text
        deliver = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'canner_build_info{role="receiver"' in receiver
        assert 'canner_deliveries_completed_total{kind="object",project="example"} 1.0' in deliver
    finally:
        for proc in procs:
            end_process(proc, signal.SIGTERM)
    for proc in procs:
        assert proc.returncode in (0, -signal.SIGTERM), (tmp_path / "deliver.log").read_text()


# -- a destination of its own ------------------------------------------------------------------


def test_destination_on_another_filesystem(
    mount_tmpfs: Callable[[str, str], Path], make_env: Callable[..., DirEnv]
) -> None:
    """A tmpfs destination (another filesystem than the data directory) gets a byte-identical,
    verified copy; the payload is purged after retention; no partial file remains."""
    archive = mount_tmpfs("archive", "64m")
    env = make_env(archive)
    assert os.stat(archive).st_dev != os.stat(env.receiver.data_dir).st_dev
    data = payload(5 * MiB + 1)
    object_id, _ = env.receiver.upload_all(data, filename="crawl.warc.gz")
    row = env.wait_row(object_id, lambda r: r["purged_at"] is not None, "purge after verify")
    assert row["state"] == "delivered" and row["verified_at"] is not None
    assert env.final(object_id, "crawl.warc.gz").read_bytes() == data
    assert not (env.receiver.uploads_dir / object_id).exists()
    assert partials(archive) == []


def test_tampered_destination_is_flagged_and_the_payload_kept(
    mount_tmpfs: Callable[[str, str], Path], make_env: Callable[..., DirEnv]
) -> None:
    """A destination changed between copy and verification fails verification for an operator;
    the local payload outlives its retention and the changed file is left alone."""
    archive = mount_tmpfs("archive", "64m")
    env = make_env(archive)
    data = payload(2 * MiB)
    object_id, _ = env.receiver.upload_all(data, filename="crawl.warc.gz")
    env.wait_row(object_id, lambda r: r["state"] == "delivered", "the copy")
    env.deliver.kill(signal.SIGKILL)
    # Rewind to "copied, not yet verified" in case the verification already ran (test-only).
    with sqlite3.connect(env.db) as db:
        db.execute(
            "UPDATE outbound SET verified_at = NULL, next_check_at = 0"
            " WHERE kind = 'object' AND ref = ?",
            (object_id,),
        )
    final = env.final(object_id, "crawl.warc.gz")
    with open(final, "r+b") as f:
        f.seek(MiB)
        f.write(b"tampered")
    tampered = final.read_bytes()
    env.deliver.start()
    row = env.wait_row(
        object_id, lambda r: "differs from its receipt" in (r["last_error"] or ""), "the flag"
    )
    assert row["needs_operator"] == 1 and row["verified_at"] is None
    time.sleep(4)  # past the 2 s retention, several ticks
    row = env.row(object_id)
    assert row["purged_at"] is None and row["verified_at"] is None
    assert (env.receiver.uploads_dir / object_id).read_bytes() == data
    assert final.read_bytes() == tampered


def test_full_destination_is_retried_with_backoff(
    mount_tmpfs: Callable[[str, str], Path], make_env: Callable[..., DirEnv]
) -> None:
    """A destination without room fails the attempt (ENOSPC), retried with backoff and no partial
    file left; once there is room, the retry delivers and nothing was lost."""
    archive = mount_tmpfs("archive", "1m")
    env = make_env(archive)
    data = payload(3 * MiB)
    object_id, _ = env.receiver.upload_all(data, filename="crawl.warc.gz")
    row = env.wait_row(object_id, lambda r: r["state"] == "retry_wait", "the failed attempt")
    assert "No space left on device" in row["last_error"]
    assert row["needs_operator"] == 0
    assert row["next_attempt_at"] - row["updated_at"] >= 50  # 60 s backoff, some jitter
    assert partials(archive) == []
    assert not env.final(object_id, "crawl.warc.gz").exists()
    assert (env.receiver.uploads_dir / object_id).read_bytes() == data
    remount(archive, "16m")
    assert make_due_now(env.db) == 1
    row = env.wait_row(object_id, lambda r: r["purged_at"] is not None, "delivery after room")
    assert row["attempts"] == 2
    assert env.final(object_id, "crawl.warc.gz").read_bytes() == data
    assert partials(archive) == []


def test_sigkill_mid_copy_never_shows_a_partial_file(
    mount_tmpfs: Callable[[str, str], Path], make_env: Callable[..., DirEnv]
) -> None:
    """deliver killed while its copy is in progress leaves only the partial file (never the final
    name); after restart the copy is redone, byte-identical, and the partial file is gone."""
    archive = mount_tmpfs("archive", "1g")
    env = make_env(archive, start_deliver=False)
    data = payload(256 * MiB)
    object_id, _ = env.receiver.upload_all(data, chunk=32 * MiB, filename="big.warc")
    final = env.final(object_id, "big.warc")
    partial = final.parent / (PARTIAL_PREFIX + object_id)
    env.deliver.start()
    deadline = time.monotonic() + 60
    while not partial.exists():
        assert not final.exists(), "the final name appeared before any partial file was seen"
        assert time.monotonic() < deadline, env.describe()
        time.sleep(0.001)
    env.deliver.kill(signal.SIGKILL)
    assert not final.exists(), "a partial copy is visible under its final name"
    assert partial.stat().st_size < len(data)
    env.deliver.start()
    row = env.wait_row(object_id, lambda r: r["verified_at"] is not None, "the redone copy", 120)
    assert row["state"] == "delivered"
    assert final.stat().st_size == len(data)
    assert blake3_hex(final.read_bytes()) == blake3_hex(data)
    assert partials(archive) == []


def test_unmounted_destination_gets_nothing_until_it_is_back(
    mount_tmpfs: Callable[[str, str], Path], make_env: Callable[..., DirEnv]
) -> None:
    """With the destination unmounted after start-up, nothing is written into the bare mount
    point; the attempt is retried, and succeeds once the filesystem is mounted again."""
    archive = mount_tmpfs("archive", "16m")
    env = make_env(archive)
    subprocess.run(["umount", str(archive)], check=True)
    data = payload(MiB)
    object_id, _ = env.receiver.upload_all(data, filename="crawl.warc.gz")
    row = env.wait_row(object_id, lambda r: r["state"] == "retry_wait", "the failed attempt")
    assert "unmounted?" in row["last_error"] and row["needs_operator"] == 0
    assert list(archive.iterdir()) == []
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(archive)], check=True)
    assert make_due_now(env.db) == 1
    env.wait_row(object_id, lambda r: r["purged_at"] is not None, "delivery once mounted")
    assert env.final(object_id, "crawl.warc.gz").read_bytes() == data
