"""Switching from the Go canner (issue 28): ``canner adopt-go --apply`` on a Go data directory
(tests/go_canner_fixture.py), then real canner-receiver and canner-deliver daemons and the fake
IA.  A worker following the Go SDK's rules (docs/reference/go-canner.md §1.17, in
go_style_client.py) resumes its half-sent upload at the same URL and gets its receipt; the Go
receipts are served byte for byte at the same paths; what Go delivered is never sent again,
what it had not delivered is."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from cluster_support import SHIPPED_NGINX, HAProxy, Nginx
from deliver_support import (
    REPO,
    Deliver,
    DeliveryReceiver,
    FakeIA,
    canner_command,
    deliveries,
    venv_bin,
    wait_for,
)
from e2e_support import Receiver, free_port
from go_style_client import GoStyleClient

from tests.go_canner_fixture import STATES, GoDir, listing, write_go_data_dir
from tests.go_peer import GO_PEER


def adopt_go(config: Path, go_dir: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return canner_command(config, "adopt-go", str(go_dir), *more)


def canner(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return canner_command(config, *argv, timeout=60)


@pytest.fixture
def adopted(
    tmp_path: Path,
) -> Iterator[tuple[GoDir, dict[str, bytes], FakeIA, DeliveryReceiver]]:
    fake = FakeIA(tmp_path / "fake")
    fake.start()
    # A node prefix: the Go ids (bare 32 hex) must still be served.
    receiver = DeliveryReceiver.configured(tmp_path / "canner", fake.url, node_prefix="n1")
    deliver = Deliver(receiver.config_path, receiver.data_dir, tmp_path / "canner" / "deliver.log")
    try:
        go = write_go_data_dir(tmp_path / "go")
        receipts = go.receipts
        run = subprocess.run(
            [
                venv_bin("canner"),
                "adopt-go",
                str(go.root),
                "--apply",
                "--config",
                str(receiver.config_path),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "uploads in flight 3, delivered 4, to deliver 7" in run.stdout
        receiver.start()
        deliver.start()
        yield go, receipts, fake, receiver
    finally:
        deliver.kill()
        receiver.close()
        fake.stop()


def test_after_adoption_uploads_resume_and_only_undelivered_objects_are_delivered(
    adopted: tuple[GoDir, dict[str, bytes], FakeIA, DeliveryReceiver],
) -> None:
    go, before, fake, receiver = adopted
    assert len(before) == 11
    # Receipts: the same bytes at the same path, Go ids and all.
    for oid, data in before.items():
        r = receiver.session.get(f"{receiver.base_url}/api/v1/receipts/{oid}", timeout=10)
        assert r.status_code == 200 and r.content == data, oid
    # The worker's saved session, as the Go SDK wrote it before the switch.
    partial = go.of("partial")
    session = {
        "upload_url": f"{receiver.base_url}/files/{partial.oid}",
        "object_id": partial.oid,
        "project": "example",
        "filename": partial.filename,
        "checksum": partial.checksum,
        "size_bytes": len(partial.data),
    }
    client = GoStyleClient(receiver.base_url)
    receipt = client.resume(session, partial.data)
    assert b'"object_id":"' + partial.oid.encode() in receipt
    # HEAD said where to go on: only the second half was sent.
    patches = [line for line in client.log if line.startswith("PATCH")]
    assert patches == ["PATCH 204"], client.log
    # Every byte in, no receipt (Go was killed before acceptance): a HEAD starts canner's
    # acceptance, and the receipt follows.
    complete = go.of("complete")
    head = receiver.session.head(
        f"{receiver.base_url}/files/{complete.oid}", headers={"Tus-Resumable": "1.0.0"}
    )
    assert head.status_code == 200 and head.headers["Upload-Offset"] == str(len(complete.data))

    def receipt_of_complete() -> bytes | None:
        r = receiver.session.get(f"{receiver.base_url}/api/v1/receipts/{complete.oid}")
        return r.content if r.status_code == 200 else None

    late = wait_for(receipt_of_complete, 20, "the complete Go upload's receipt", 0.1)
    assert late is not None and f'"checksum":"{complete.checksum}"'.encode() in late
    # A new upload through the same client gets a prefixed id.
    fresh = client.upload(b"after the switch" * 100)
    assert b'"object_id":"n1-' in fresh

    to_send = {go.of(s).oid for s, a in STATES.items() if a == "deliver"}
    to_send |= {partial.oid, complete.oid}
    delivered_by_go = {go.of(s).oid for s, a in STATES.items() if a == "delivered"}

    def all_sent() -> bool:
        rows = deliveries(receiver.config_path)
        return all(rows.get(oid, {}).get("state") == "delivered" for oid in to_send)

    wait_for(all_sent, 60, "the adopted objects to be delivered", 0.3)
    sent = {o["identifier"] for o in fake.objects()}
    for oid in to_send:
        assert any(oid in identifier for identifier in sent), oid
    for oid in delivered_by_go:
        assert not any(oid in identifier for identifier in sent), oid
    assert not any(oid in p["uri"] for p in fake.puts() for oid in delivered_by_go)
    assert sum(1 for p in fake.puts() if any(oid in p["uri"] for oid in to_send)) >= len(to_send)
    rows = deliveries(receiver.config_path)
    for oid in delivered_by_go:
        assert rows[oid]["state"] == "delivered"
        assert rows[oid]["remote_identifier"].startswith("saveweb-example-")


def test_the_shipped_proxy_examples_route_go_ids_to_the_adopting_node(tmp_path: Path) -> None:
    """conf/haproxy and conf/nginx in front of n1 and n2, n2 having adopted the Go directory
    (its "go-canner" map line): a Go receipt and the Go upload in flight are reached through
    both (n1 would answer 404)."""
    n1 = Receiver.in_dir(tmp_path / "n1", node_prefix="n1")
    n2 = Receiver.in_dir(tmp_path / "n2", node_prefix="n2")
    go = write_go_data_dir(tmp_path / "go")
    receipts = go.receipts
    run = subprocess.run(
        [venv_bin("canner"), "adopt-go", str(go.root), "--apply", "--config", str(n2.config_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    nodes = {"n1": n1.port, "n2": n2.port}
    haproxy, nginx = HAProxy(tmp_path / "haproxy"), Nginx(tmp_path / "nginx")
    try:
        n1.start()
        n2.start()
        haproxy.configure(nodes)
        with open(haproxy.map_path, "a", encoding="utf-8") as f:
            f.write("go-canner canner_n2\n")
        haproxy.start()
        shipped = SHIPPED_NGINX.read_text()
        assert "go-canner canner_n1;" in shipped
        nginx.start(nodes, shipped.replace("go-canner canner_n1;", "go-canner canner_n2;"))
        partial = go.of("partial")
        for front in (haproxy.url, nginx.url):
            for oid, data in receipts.items():
                r = requests.get(f"{front}/api/v1/receipts/{oid}", timeout=10)
                assert r.status_code == 200 and r.content == data, (front, oid)
            r = requests.head(
                f"{front}/files/{partial.oid}", headers={"Tus-Resumable": "1.0.0"}, timeout=10
            )
            assert r.status_code == 200, front
            assert r.headers["Upload-Offset"] == str(len(partial.data) // 2)
        # Without the route, a Go id lands on any node: n1 does not have it.
        r = requests.get(f"{n1.base_url}/api/v1/receipts/{next(iter(receipts))}", timeout=10)
        assert r.status_code == 404
    finally:
        nginx.stop()
        haproxy.stop()
        n1.close()
        n2.close()


def test_adopted_problems_are_flagged_for_an_operator_everywhere(tmp_path: Path) -> None:
    """A Go receipt whose bytes are gone and one whose project is unknown: after adoption and
    with both daemons running, canner status exits 1 naming both, the status page warns and
    lists them, HQ's objects API reads retry_wait with no payload, canner-deliver leaves them
    waiting; canner retry sends the first again (flagged again while its bytes are missing)
    and refuses the second."""
    fake = FakeIA(tmp_path / "fake")
    fake.start()
    receiver = DeliveryReceiver.configured(tmp_path / "canner", fake.url, node_prefix="n1")
    deliver = Deliver(receiver.config_path, receiver.data_dir, tmp_path / "canner" / "deliver.log")
    go = write_go_data_dir(tmp_path / "go")
    gone, lost = go.of("sealed_pending"), go.of("accepted")
    for p in (go.root / "packages").glob("example-*.gz"):
        if p.read_bytes() == gone.data:
            p.unlink()
    (go.root / "uploads" / f"{lost.oid}.info").unlink()
    db = sqlite3.connect(go.root / "delivery.sqlite")
    db.execute("DELETE FROM artifacts WHERE object_id = ?", (lost.oid,))
    db.commit()
    db.close()
    config = receiver.config_path
    try:
        run = adopt_go(config, go.root, "--apply")
        assert run.returncode == 1, run.stdout + run.stderr
        assert "problems 2" in run.stdout
        receiver.start()
        deliver.start()

        def warned() -> subprocess.CompletedProcess[str] | None:
            done = canner(config, "status")
            return done if done.returncode == 1 else None

        status = wait_for(warned, 30, "canner status to warn (deliver up)", 0.5)
        assert "canner: warning: 2 deliveries need an operator" in status.stderr
        for oid, why in ((gone.oid, "no upload or package file"), (lost.oid, "no project")):
            assert any(oid in line and why in line for line in status.stdout.splitlines())
        page = requests.get(receiver.base_url + "/", timeout=10).text
        assert "warning: 2 deliveries need an operator" in page
        assert gone.oid[:8] in page and lost.oid[:8] in page
        for oid in (gone.oid, lost.oid):
            r = requests.get(f"{receiver.base_url}/api/v1/objects/{oid}", timeout=10)
            assert r.status_code == 200, r.text
            doc = r.json()
            assert doc["delivery"]["state"] == "retry_wait" and not doc["payload"]["present"]
        lost_doc = requests.get(f"{receiver.base_url}/api/v1/objects/{lost.oid}", timeout=10)
        assert lost_doc.json()["project"] is None
        # canner-deliver (it delivers the other adopted objects meanwhile) leaves them waiting.
        time.sleep(3)
        rows = deliveries(config)
        for oid in (gone.oid, lost.oid):
            assert rows[oid]["state"] == "retry_wait" and rows[oid]["attempts"] == 0, rows[oid]
            assert "adopted from the Go canner" in rows[oid]["last_error"]
        # canner retry: the first is sent again (and flagged again, its bytes being missing).
        again = canner(config, "retry", gone.oid)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"uploads/{gone.oid} is missing" in again.stdout

        def tried() -> dict[str, object] | None:
            row = deliveries(config)[gone.oid]
            return row if row["attempts"] == 1 and row["state"] == "retry_wait" else None

        row = wait_for(tried, 30, "the retried object's attempt", 0.5)
        assert row["needs_operator"] == 1 and "payload is missing" in str(row["last_error"])
        refused = canner(config, "retry", lost.oid)
        assert refused.returncode == 1 and "no project is known" in refused.stderr
    finally:
        deliver.kill()
        receiver.close()
        fake.stop()


def test_dry_run_on_a_killed_go_canner_changes_no_byte(tmp_path: Path) -> None:
    """The real Go canner (GO_PEER/start.sh) accepts two uploads and is SIGKILLed: its index's
    commits are in delivery.sqlite-wal, beside its -shm.  A dry run lists both objects and
    leaves every file as it was (size, mtime, SHA-256), -wal and -shm included; --apply then
    takes both over and retires the Go index with its WAL folded in."""
    start, client = GO_PEER / "start.sh", GO_PEER / "gocanner"
    assert start.exists() and client.exists(), f"the Go canner peer is needed at {GO_PEER}"
    port, root = free_port(), tmp_path / "go-canner"
    log = (tmp_path / "go.log").open("wb")
    go = subprocess.Popen([str(start), str(port), str(root)], stdout=log, stderr=log)
    files = []
    try:
        wait_for(lambda: _answers(port), 20, "the Go canner to listen", 0.2)
        for n, size in enumerate((300_000, 5_000)):
            path = tmp_path / f"item-{n}.warc.gz"
            path.write_bytes(os.urandom(size))
            files.append(path)
            up = subprocess.run(
                [str(client), "upload", f"http://127.0.0.1:{port}/", "bench", str(path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert up.returncode == 0 and up.stdout.startswith("RECEIPT "), up.stdout + up.stderr
    finally:
        go.send_signal(signal.SIGKILL)
        go.wait(10)
        log.close()
    data = root / "data"
    for name in ("delivery.sqlite-wal", "delivery.sqlite-shm"):
        assert (data / name).exists(), name
    receipts = {p.name: p.read_bytes() for p in (data / "receipts").glob("*.json")}
    assert len(receipts) == 2
    canner_node = Receiver.in_dir(tmp_path / "canner", node_prefix="n1")
    before = listing(data)
    dry = adopt_go(canner_node.config_path, data)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    for name in receipts:
        line = next(x for x in dry.stdout.splitlines() if x.startswith(name[: -len(".json")]))
        assert line.split()[1:3] == ["deliver", "bench"], line
    assert listing(data) == before
    # The real thing: both taken over, the Go index retired whole (its WAL folded in).
    done = adopt_go(canner_node.config_path, data, "--apply")
    assert done.returncode == 0, done.stdout + done.stderr
    for name, content in receipts.items():
        assert (canner_node.data_dir / "receipts" / name).read_bytes() == content
    assert not (data / "delivery.sqlite-wal").exists()
    assert not (data / "delivery.sqlite-shm").exists()
    retired = data / "delivery.sqlite.adopted-by-canner"
    conn = sqlite3.connect(f"file:{retired}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT count(*) FROM artifacts").fetchone()[0] == 2
    finally:
        conn.close()


def _answers(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/", timeout=1)
    except requests.RequestException:
        return False
    return True
