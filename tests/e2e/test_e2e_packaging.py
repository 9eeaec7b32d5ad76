"""End to end: a megawarc project with real ``twistd`` processes, tuspy uploads and the fake IA.

200 small artifacts (WARCs and other files) are batched (one batch closed by size, the last by
``max_wait``), packed, verified, their uploads purged, each package delivered as one item,
verified there and purged after retention; every member's bytes at IA, found through the
package index, hash to its receipt.  Then ``delivery.sqlite`` is deleted and ``canner
rebuild-index`` brings back every object and package, and a restarted deliver sends nothing
again.  A second test SIGKILLs canner-deliver again and again while it works.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import REPO, Env, envs, remove_index, venv_bin, wait_for
from e2e_support import blake3_hex
from tusclient import client as tus_client

from tests.packaging_support import warc_bytes

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

SEED = 20261130


def artifacts(count: int, seed: int) -> list[tuple[str, bytes]]:
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        if i % 10 == 9:
            out.append((f"log-{i}.txt", rnd.randbytes(rnd.randint(100, 3000))))
        elif i % 25 == 12:  # cut short: fails its test, goes to the tar
            out.append((f"cut-{i}.warc.gz", warc_bytes(seed + i, records=2)[:-9]))
        else:
            out.append((f"crawl-{i}.warc.gz", warc_bytes(seed + i, records=rnd.randint(1, 3))))
    return out


def tus_upload(env: Env, name: str, data: bytes) -> str:
    uploader = tus_client.TusClient(env.receiver.files_url).uploader(
        file_stream=io.BytesIO(data),
        metadata={"project": "example", "checksum": blake3_hex(data), "filename": name},
        retries=0,
    )
    uploader.upload()
    return str(uploader.url).rsplit("/", 1)[1]


def canner(env: Env, *args: str) -> str:
    out = subprocess.run(
        [venv_bin("canner"), *args, "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, f"canner {args} failed: {out.stderr.decode()}"
    return out.stdout.decode()


def packages(env: Env) -> list[dict[str, Any]]:
    return [json.loads(line) for line in canner(env, "packages").splitlines() if line.strip()]


def check_at_ia(env: Env, uploaded: dict[str, bytes]) -> None:
    """Every member's bytes, found through its package's index at the fake IA, hash to its
    receipt; every package file was stored exactly once."""
    objects = {(o["identifier"], o["name"]): o for o in env.fake.objects()}
    assert all(o["stores"] == 1 for o in objects.values()), objects
    found: dict[str, str] = {}
    for (identifier, name), o in objects.items():
        if not name.endswith(".megawarc.json.gz"):
            continue
        basename = name[: -len(".megawarc.json.gz")]
        for raw in gzip.decompress(Path(o["path"]).read_bytes()).splitlines():
            line = json.loads(raw)
            c = line["canner"]
            kind = "tar" if not c["filename"].endswith(".warc.gz") else "warc"
            if c["filename"].startswith("cut-"):
                kind = "tar"  # a truncated gzip fails its test
            assert line["target"]["container"] == kind, line
            container = objects[(identifier, basename + c["file"][len(basename) :])]
            with open(container["path"], "rb") as f:
                f.seek(c["offset"])
                found[c["object_id"]] = blake3_hex(f.read(c["size_bytes"]))
    assert found == {oid: blake3_hex(data) for oid, data in uploaded.items()}


def all_delivered(env: Env, ids: list[str]) -> None:
    env.wait_state(
        ids,
        240,
        "every object delivered, verified and its upload purged",
        state="delivered",
        verified_at=...,
        purged_at=...,
    )


def test_two_hundred_artifacts_become_packages_at_ia_and_survive_an_index_rebuild(
    env_factory: Any,
) -> None:
    """200 tuspy uploads: batches close by size and by max_wait, each package is one verified
    item, sources and packages are purged, and rebuild-index after the purge restores it all
    without uploading anything again."""
    env = env_factory(
        packaging={"mode": "megawarc", "target_bytes": "120KB", "max_wait": "15s"},
        retention="2s",
    )
    uploaded: dict[str, bytes] = {}
    for name, data in artifacts(200, SEED):
        uploaded[tus_upload(env, name, data)] = data
    ids = list(uploaded)
    all_delivered(env, ids)

    def purged() -> list[dict[str, Any]] | None:
        rows = packages(env)
        return rows if rows and all(r["purged_at"] for r in rows) else None

    rows = wait_for(purged, 60, "every package purged after retention", 0.5, env.describe)
    assert rows is not None
    reasons = {r["close_reason"] for r in rows}
    assert {"size", "max_wait"} <= reasons
    assert sum(r["members"] for r in rows) == 200
    for r in rows:
        assert r["remote_identifier"] == f"example-{r['batch_date']}-{r['package_id']}"
        assert r["remote_verified_at"] and r["sources_purged_at"] and r["verified_at"]
        names = {f["remote_name"] for f in r["files"]}
        assert f"{r['package_id']}.megawarc.json.gz" in names
    for oid in ids:
        assert not (env.data_dir / "uploads" / oid).exists()
        assert (env.data_dir / "receipts" / f"{oid}.json").exists()
    check_at_ia(env, uploaded)
    shown = json.loads(canner(env, "show", ids[0]))
    assert shown["package"]["identifier"].startswith("example-")
    assert shown["package"]["remote_name"].endswith(".megawarc.warc.gz")
    # HQ's status query says the same: the package and the byte offset in its file.
    status = requests.get(f"{env.receiver.base_url}/api/v1/objects/{ids[0]}", timeout=10)
    assert status.status_code == 200, status.text
    delivery = status.json()["delivery"]
    assert delivery["package_id"] == shown["package"]["package"]
    assert delivery["package_offset"] == shown["package"]["offset"]
    assert delivery["identifier"] == shown["package"]["identifier"]

    puts = len(env.fake.puts())
    env.deliver.stop()
    remove_index(env.data_dir)
    out = canner(env, "rebuild-index")
    assert f"{len(rows)} packages restored" in out
    again = {r["package_id"]: r for r in packages(env)}
    assert set(again) == {r["package_id"] for r in rows}
    assert all(r["purged_at"] and r["remote_verified_at"] for r in again.values())
    rebuilt = env.rows()
    assert all(rebuilt[oid]["state"] == "delivered" and rebuilt[oid]["purged_at"] for oid in ids)
    env.deliver.start()
    time.sleep(5)
    assert len(env.fake.puts()) == puts
    assert len(packages(env)) == len(rows)


def sources_wait_for_verified_packages(db: Path, data_dir: Path, ids: list[str]) -> None:
    """No upload is gone unless its package is verified (checked from outside, any moment)."""
    uploads = data_dir / "uploads"
    gone = [oid for oid in ids if not (uploads / oid).exists()]
    if not gone or not db.exists():
        return
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        for oid in gone:
            row = conn.execute(
                "SELECT p.verified_at FROM objects o LEFT JOIN packages p USING (batch_id)"
                " WHERE o.object_id = ?",
                (oid,),
            ).fetchone()
            side = data_dir / "receipts" / f"{oid}.package.json"
            assert side.exists(), f"{oid}'s upload is gone but its receipt names no package"
            assert row is not None and row[0] is not None, f"{oid} purged before verification"
    finally:
        conn.close()


def db_value(db: Path, sql: str) -> Any:
    if not db.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            row = conn.execute(sql).fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return None  # before the schema exists
    return None if row is None else row[0]


# When to kill: a build's temp directory exists, a package is sealed but not verified, a
# package upload hangs (the fake stalls a PUT), a package awaits its purge, a batch is open.
PHASES = {
    "building": lambda env: any((env.data_dir / "packages").glob(".tmp-*")),
    "verifying": lambda env: db_value(env.db, "SELECT 1 FROM packages WHERE state = 'sealed'"),
    "uploading": lambda env: db_value(
        env.db, "SELECT 1 FROM package_delivery WHERE delivery_state = 'delivering'"
    ),
    "purging": lambda env: db_value(
        env.db,
        "SELECT 1 FROM package_delivery WHERE remote_verified_at IS NOT NULL AND purged_at IS NULL",
    ),
    "batching": lambda env: db_value(env.db, "SELECT 1 FROM packages WHERE state = 'open'"),
}


def test_sigkill_at_random_points_loses_and_repeats_nothing(env_factory: Any) -> None:
    """canner-deliver is SIGKILLed while it builds, verifies, uploads, purges and batches (and
    at random moments); after the last restart every member is at IA exactly once and
    byte-identical, no upload was ever purged before its package was verified, and unfinished
    builds leave no temp directory behind."""
    env = env_factory(
        packaging={"mode": "megawarc", "target_bytes": "3MB", "max_wait": "2s"},
        retention="1s",
        start_deliver=False,
    )
    rnd = random.Random(SEED + 1)
    uploaded: dict[str, bytes] = {}
    named = artifacts(30, SEED + 7) + [(f"big-{i}.bin", rnd.randbytes(1 << 20)) for i in range(8)]
    rnd.shuffle(named)
    hit = []

    def kill_when(phase: str) -> None:
        seen = PHASES.get(phase)
        deadline = time.monotonic() + (rnd.uniform(0.1, 2.0) if seen is None else 20)
        while time.monotonic() < deadline:
            if seen is not None and seen(env):
                hit.append(phase)
                break
            time.sleep(0.005)
        env.deliver.kill(signal.SIGKILL)
        sources_wait_for_verified_packages(env.db, env.data_dir, list(uploaded))

    # Batching: deliver runs while the first half arrives.
    env.deliver.start()
    for name, data in named[:15]:
        uploaded[tus_upload(env, name, data)] = data
    kill_when("batching")
    for name, data in named[15:]:
        uploaded[tus_upload(env, name, data)] = data
    ids = list(uploaded)
    for phase in ("building", "verifying", "uploading", "purging", "random", "random"):
        if phase == "uploading":
            env.fake.add_fault("stall", count=1, after_bytes=4096)
        env.deliver.start()
        kill_when(phase)
        env.fake.clear_faults()
    assert "uploading" in hit, hit
    env.deliver.start()
    all_delivered(env, ids)
    check_at_ia(env, uploaded)
    sources_wait_for_verified_packages(env.db, env.data_dir, ids)
    assert not list((env.data_dir / "packages").glob(".tmp-*"))
    print("phases hit:", hit)


def test_a_package_whose_bytes_at_ia_differ_is_flagged_and_kept(env_factory: Any) -> None:
    """IA lists every package file with the right size and MD5 but serves other bytes: the
    read-back before the purge flags the package with the offsets it compared, and its files
    stay on disk past retention."""
    env = env_factory(
        packaging={"mode": "megawarc", "target_bytes": "1GB", "max_wait": "2s"},
        retention="1s",
    )
    env.fake.add_fault("altered", count=1000)
    for name, data in artifacts(5, SEED + 1):
        tus_upload(env, name, data)

    def flagged() -> list[dict[str, Any]] | None:
        rows = packages(env)
        return rows if rows and all(r["needs_operator"] for r in rows) else None

    rows = wait_for(flagged, 120, "the package flagged by its read-back", 0.5, env.describe)
    assert rows is not None and len(rows) == 1
    row = rows[0]
    assert "IA serves other bytes than the local payload at offsets" in row["last_error"], row
    assert row["remote_verified_at"] is None and row["purged_at"] is None, row
    time.sleep(2)  # past retention: still not purged
    row = packages(env)[0]
    assert row["purged_at"] is None, row
    package_dir = env.data_dir / "packages"
    assert any(p.name.startswith(row["package_id"]) for p in package_dir.rglob("*")), (
        "the package files were deleted although IA serves other bytes"
    )
    # The operator's retry (once IA is healthy) uploads every file again over IA's listing,
    # which a normal delivery would have trusted; then it verifies and is purged.
    assert {o["puts"] for o in env.fake.objects()} == {1}
    env.fake.clear_faults()
    retried = subprocess.run(
        [venv_bin("canner"), "retry", row["package_id"], "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert retried.returncode == 0 and f"package {row['package_id']} is due now" in retried.stdout

    def purged() -> dict[str, Any] | None:
        rows = packages(env)
        return rows[0] if rows[0]["purged_at"] is not None else None

    row = wait_for(purged, 60, "the retried package verified and purged", 0.5, env.describe)
    assert row["needs_operator"] == 0 and row["force_upload"] == 0, row
    files = env.fake.objects()
    assert files and {o["puts"] for o in files} == {2}, "every file is uploaded again"


def test_a_package_ia_loses_after_its_200_is_delivered_again(env_factory: Any) -> None:
    """IA answers 200 for a package file and never lists it: once verify_timeout has passed the
    package goes back to be delivered (one re-delivery counted), the lost file is uploaded again
    (the others are found in place), and the package is verified and purged."""
    env = env_factory(
        packaging={"mode": "megawarc", "target_bytes": "1GB", "max_wait": "2s"},
        retention="1s",
        delivery={"verify_timeout": "3s"},
    )
    env.fake.add_fault("vanish", count=1)
    for name, data in artifacts(5, SEED + 2):
        tus_upload(env, name, data)

    def purged() -> dict[str, Any] | None:
        rows = packages(env)
        return rows[0] if rows and rows[0]["purged_at"] is not None else None

    row = wait_for(purged, 120, "the package re-delivered, verified and purged", 0.5, env.describe)
    assert row["redeliveries"] == 1 and row["needs_operator"] == 0, row
    assert sum(1 for r in env.fake.requests() if r.get("fault") == "vanish") == 1
    objects = [o for o in env.fake.objects() if o["identifier"] == row["remote_identifier"]]
    # Every file stored once: the lost one only by the re-delivery, the others found in place.
    assert len(objects) >= 2 and all(o["stores"] == 1 for o in objects), objects
    log = env.deliver.log_text()
    assert "delivering it again (re-delivery 1 of 3)" in log, env.deliver.log_tail()
