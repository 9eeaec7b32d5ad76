"""End to end: real ``twistd canner-receiver`` and ``canner-deliver`` processes delivering to the
fake Internet Archive (``tests/fake_ia.py``, its own process) over loopback sockets.

What the issue demands and these tests check, through HTTP, ``canner deliveries`` and the disk:

* N uploads are delivered byte-identical, exactly one remote file each, verified through the
  metadata API, purged only after verification *and* retention; receipts stay unchanged.
* Every fault of the fake (503 SlowDown, 500, reset mid-body, response lost after storing, a
  stalled transfer, 403) is survived with nothing lost and nothing stored twice.
* SIGKILL and SIGTERM of deliver mid-upload, then restart; ``delivery.sqlite`` deleted and rebuilt
  from ``receipts/`` before and after purge; a second deliver on the same data dir refused.

Retry backoff (60 s and up) is fast-forwarded with :func:`deliver_support.make_due_now`, the way an
operator retry does it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from deliver_support import (
    IDENTIFIER_TEMPLATE,
    PROJECT,
    SECRET,
    Deliver,
    Env,
    data_files,
    envs,
    file_md5,
    journal_records,
    make_checks_due_now,
    make_due_now,
    md5_hex,
    remove_index,
    wait_for,
)
from e2e_support import blake3_hex, parse_metadata
from hq_support import canner

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

MiB = 1024 * 1024
BIG = 200 * MiB
SEED = int(os.environ.get("CANNER_E2E_SEED", "20261130"))

Rows = dict[str, dict[str, Any]]


def expected_identifier(row: dict[str, Any]) -> str:
    date = time.strftime("%Y%m%d%H%M%S", time.gmtime(row["accepted_at"]))
    return IDENTIFIER_TEMPLATE.format(date=date, object_id=row["object_id"])


def receipt_files(env: Env, object_id: str) -> dict[str, Any]:
    """The receipt's bytes, and the object's origin where canner keeps it: its file in
    ``receipts/`` until the payload is purged, then the facts journal."""
    receipts = env.data_dir / "receipts"
    origin_file = receipts / f"{object_id}.meta.json"
    if origin_file.exists():
        origin = json.loads(origin_file.read_bytes())
    else:
        records = journal_records(env.data_dir, object_id, "origin")
        origin = records[-1] if records else None
    return {
        "receipt": (receipts / f"{object_id}.json").read_bytes(),
        "origin": origin and {k: origin[k] for k in ("object_id", "project", "filename")},
    }


def payload_intact(env: Env, object_id: str, data: bytes) -> bool:
    """The local payload is still there with exactly the accepted bytes."""
    path = env.data_dir / "uploads" / object_id
    if not path.exists():
        return False
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return path.stat().st_size == len(data) and "blake3:" + h.hexdigest() == blake3_hex(data)


def assert_delivered_once(
    env: Env, row: dict[str, Any], data: bytes, *, puts: int | None = 1
) -> dict[str, Any]:
    """``row`` is delivered, and the fake holds exactly one byte-identical copy, stored once."""
    assert row["state"] == "delivered", row
    assert row["remote_identifier"] == expected_identifier(row), row
    objects = env.fake.objects()
    mine = [o for o in objects if o["identifier"] == row["remote_identifier"]]
    assert len(mine) == 1, f"expected one remote file in {row['remote_identifier']}: {mine}"
    remote = mine[0]
    assert remote["name"] == row["remote_name"], (remote, row)
    assert remote["size"] == len(data) == row["size_bytes"]
    assert remote["md5"] == md5_hex(data) == row["content_md5"]
    stored = Path(remote["path"])
    assert stored.stat().st_size == len(data)
    if len(data) <= 8 * MiB:
        assert stored.read_bytes() == data, "the fake's copy differs from the uploaded bytes"
    else:
        assert file_md5(stored) == md5_hex(data), "the fake's copy differs from the upload"
    assert remote["stores"] == 1, f"stored {remote['stores']} times: {remote}"
    if puts is not None:
        assert remote["puts"] == puts, f"{remote['puts']} PUTs, expected {puts}: {remote}"
    assert remote["filemeta"].get("canner-object-id") == row["object_id"]
    return remote


def assert_clean_exit(deliver: Deliver, code: int | None) -> None:
    """A graceful stop: twistd re-raises the SIGTERM it shut down on (exit status -15, which
    systemd counts as a clean stop) after "Server Shut Down.", with no traceback on the way."""
    log = deliver.current_log()
    assert code in (0, -signal.SIGTERM), f"exit status {code}:\n{deliver.log_tail()}"
    assert "Server Shut Down." in log, deliver.log_tail()
    assert "Traceback" not in log and "Unhandled" not in log, deliver.log_tail()


def wait_settled(env: Env, ids: list[str], timeout: float) -> Rows:
    """Until every row of ``ids`` exists and none is pending or delivering."""
    return env.wait_rows(
        lambda rows: all(
            oid in rows and rows[oid]["state"] not in ("pending", "delivering") for oid in ids
        ),
        timeout,
        f"{len(ids)} rows to settle (no pending/delivering)",
    )


# -- 1. N uploads: delivered, verified, purged ---------------------------------------------------


def test_uploads_delivered_verified_then_purged(env_factory: Callable[..., Env]) -> None:
    """Six uploads (1 B .. 3 MiB) end up at the fake byte-identical, once each, and are purged
    only after the metadata API shows them (metadata lag 3 s: the first check fails) and the
    2 s retention has passed; rows stay ``delivered``; receipts stay byte-for-byte."""
    env = env_factory(metadata_lag=3.0, retention="2s")
    rng = random.Random(SEED)
    cases = [
        (1, "one-byte.txt", "one-byte.txt"),
        (1000, "../../etc/evil/name.json", "name.json"),
        (65536 + 7, ".hidden.warc.gz", "hidden.warc.gz"),
        (1 * MiB, "ünïcode ✓.bin", "ünïcode ✓.bin"),
        (2 * MiB + 3, None, None),  # no filename: the object id names the remote file
        (3 * MiB, "ctl\x01char.bin", "ctlchar.bin"),
    ]
    payloads: dict[str, bytes] = {}
    expected_names: dict[str, str] = {}
    receipts: dict[str, dict[str, bytes]] = {}
    for size, filename, remote_name in cases:
        data = rng.randbytes(size)
        oid = env.upload(data, filename=filename)
        payloads[oid] = data
        expected_names[oid] = remote_name or oid
        receipts[oid] = receipt_files(env, oid)
    ids = list(payloads)

    rows = env.wait_state(ids, 30, "all six delivered", state="delivered")
    # Retention (2 s) has passed for every object, but the metadata API does not list them yet
    # (lag 3 s, so the first verification failed and the next is >= 10 s later): nothing may go.
    latest = max(rows[oid]["delivered_at"] for oid in ids)
    time.sleep(max(0.0, latest + 3.0 - time.time()))
    rows = env.rows()
    unverified = [oid for oid in ids if rows[oid]["verified_at"] is None]
    assert unverified, "every object verified within 3 s despite a 3 s metadata lag?"
    for oid in unverified:
        assert rows[oid]["purged_at"] is None, rows[oid]
        assert time.time() > rows[oid]["purge_after"], "retention should have passed"
        assert data_files(env.data_dir, oid) == {"payload": True, "info": True, "receipt": True}
        assert payload_intact(env, oid, payloads[oid])

    rows = env.wait_state(ids, 40, "all six purged", purged_at=..., verified_at=...)
    for oid in ids:
        row, data = rows[oid], payloads[oid]
        assert row["project"] == PROJECT
        assert row["attempts"] == 1, row
        assert row["last_error"] is None and row["needs_operator"] == 0, row
        assert row["remote_name"] == expected_names[oid], row
        assert_delivered_once(env, row, data)
        assert row["delivered_at"] <= row["verified_at"] <= row["purged_at"], row
        assert row["purge_after"] == pytest.approx(row["delivered_at"] + 2.0), row
        assert row["purged_at"] >= row["purge_after"], row
        assert data_files(env.data_dir, oid) == {"payload": False, "info": False, "receipt": True}
        # The origin moved into the journal with the payload's purge: one file per object left.
        assert not (env.data_dir / "receipts" / f"{oid}.meta.json").exists()
        assert receipt_files(env, oid) == receipts[oid], "a receipt or its origin changed"
        # tus HEAD still answers the upload's metadata, from the index now.
        head = env.receiver.head(oid)
        assert head.status_code == 200 and head.headers["Upload-Offset"] == str(len(data))
        expected = {"checksum": blake3_hex(data), "project": PROJECT}
        if receipts[oid]["origin"]["filename"]:
            expected["filename"] = receipts[oid]["origin"]["filename"]
        assert parse_metadata(head.headers["Upload-Metadata"]) == expected
    assert len(env.fake.objects()) == len(ids), env.fake.objects()
    leftovers = [p.name for p in (env.data_dir / "uploads").iterdir() if p.name.startswith(".")]
    assert not leftovers, f"tus temp state left behind: {leftovers}"
    items = env.fake.items()
    for oid in ids:
        metadata = items[rows[oid]["remote_identifier"]]["metadata"]
        assert metadata.get("collection") == ["test"], metadata
        assert metadata.get("title") == [f"Artifact {oid}"], metadata
    for put in env.fake.puts():
        assert put["auth"] == "LOW e2e-access", put
        assert put["headers"].get("content-md5") in {md5_hex(d) for d in payloads.values()}
    assert SECRET not in env.deliver.log_text(), "the secret appears in the deliver log"
    # Still delivered a few ticks later: nothing re-delivers a purged object.
    time.sleep(2.5)
    assert all(r["state"] == "delivered" for r in env.rows().values())
    assert all(o["puts"] == 1 for o in env.fake.objects())


def test_purge_waits_for_retention(env_factory: Callable[..., Env]) -> None:
    """Verified at once (no metadata lag) but retention is 6 s: the payload stays until then."""
    env = env_factory(metadata_lag=0.0, retention="6s")
    data = os.urandom(300_000)
    oid = env.upload(data, filename="keep-me.bin")
    row = env.wait_state([oid], 20, "verified", verified_at=...)[oid]
    assert row["purged_at"] is None
    while time.time() < row["purge_after"] - 0.5:
        # Each look is judged by when it was made and by the purge's own time (a loaded machine
        # may stall the test past purge_after between two lines).
        looked_at = time.time()
        if not payload_intact(env, oid, data):
            assert looked_at >= row["purge_after"], "purged before the retention passed"
        purged_at = env.row(oid)["purged_at"]
        assert purged_at is None or purged_at >= row["purge_after"], "purged too early"
        time.sleep(0.5)
    row = env.wait_state([oid], 15, "purged", purged_at=...)[oid]
    assert row["purged_at"] >= row["purge_after"] >= row["delivered_at"] + 6.0 - 0.01
    assert not data_files(env.data_dir, oid)["payload"]
    assert_delivered_once(env, row, data)


# -- 2. faults -----------------------------------------------------------------------------------


TRANSIENT_FAULTS = {
    # kind: (text expected in last_error, PUTs the fake sees in all)
    "slowdown": ("503", 2),
    "error500": ("500", 2),
    "reset": ("PUT", 2),
    "lost_response": ("PUT", 1),
}


@pytest.mark.parametrize("kind", sorted(TRANSIENT_FAULTS))
def test_transient_put_fault_survived(env_factory: Callable[..., Env], kind: str) -> None:
    """One PUT fails (``kind``): the row waits to retry (backoff >= 60 s, not flagged); an
    operator-style fast-forward retries it; it is delivered with exactly one stored copy.  For
    ``lost_response`` (stored, answer dropped) the retry must find the file through the metadata
    API and send no second PUT."""
    expected_text, expected_puts = TRANSIENT_FAULTS[kind]
    env = env_factory(metadata_lag=0.0, retention="2s")
    env.fake.add_fault(kind, count=1, after_bytes=256 * 1024)
    data = os.urandom(2 * MiB)
    oid = env.upload(data, filename=f"{kind}.bin")

    row = env.wait_state([oid], 20, "the failed attempt recorded", state="retry_wait")[oid]
    now = time.time()
    assert row["attempts"] == 1, row
    assert row["needs_operator"] == 0, row
    assert row["last_error"] and expected_text in row["last_error"], row
    assert row["next_attempt_at"] > now + 30, f"backoff should be ~60 s: {row}"
    assert SECRET not in row["last_error"]
    remote = env.fake.object(expected_identifier(row), f"{kind}.bin")
    if kind == "lost_response":
        assert remote is not None and remote["stores"] == 1, remote
    else:
        assert remote is None or remote["stores"] == 0, remote
    assert payload_intact(env, oid, data)

    assert make_due_now(env.db) == 1
    row = env.wait_state([oid], 20, "delivered after the retry", state="delivered")[oid]
    assert row["attempts"] == 2, row
    assert row["last_error"] is None, row
    assert_delivered_once(env, row, data, puts=expected_puts)
    if kind == "lost_response":
        assert "already at" in env.deliver.log_text()
    row = env.wait_state([oid], 20, "verified and purged", purged_at=...)[oid]
    assert row["verified_at"] is not None and row["purged_at"] >= row["verified_at"]
    assert_delivered_once(env, row, data, puts=expected_puts)


def test_forbidden_needs_operator_then_delivers(env_factory: Callable[..., Env]) -> None:
    """403 on every PUT: flagged ``needs_operator`` with the 403 in ``last_error``, retried at the
    1-hour cap (never dropped); once the fault is gone, an operator retry delivers it."""
    env = env_factory(metadata_lag=0.0, retention="2s")
    env.fake.add_fault("forbidden", count=1000)
    data = os.urandom(100_000)
    oid = env.upload(data, filename="denied.bin")
    row = env.wait_state([oid], 20, "the 403 recorded", state="retry_wait")[oid]
    assert row["needs_operator"] == 1, row
    assert "403" in (row["last_error"] or ""), row
    assert SECRET not in row["last_error"]
    assert row["next_attempt_at"] >= time.time() + 3000, f"operator errors wait ~1 h: {row}"

    # A retry while the account is still refused: flagged again, nothing stored.
    assert make_due_now(env.db) == 1
    row = env.wait_state([oid], 20, "the second 403", state="retry_wait", attempts=2)[oid]
    assert row["needs_operator"] == 1 and "403" in row["last_error"], row
    assert env.fake.object(expected_identifier(row), "denied.bin") is None
    assert payload_intact(env, oid, data)

    env.fake.clear_faults()
    assert make_due_now(env.db) == 1
    row = env.wait_state([oid], 20, "delivered once allowed", state="delivered")[oid]
    assert row["needs_operator"] == 0 and row["last_error"] is None, row
    assert row["attempts"] == 3
    assert_delivered_once(env, row, data, puts=3)
    env.wait_state([oid], 20, "purged", purged_at=...)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stalled_upload_recovered_by_restart(env_factory: Callable[..., Env], sig: int) -> None:
    """The fake stops reading after 1 MiB and never answers.  The sink's no-progress watchdog is
    900 s and its answer timeout 1800 s (neither configurable), too long for a test; so this
    checks that stopping deliver during the stalled upload (``sig``) and restarting recovers:
    the object is delivered once, its payload intact meanwhile."""
    env = env_factory(metadata_lag=0.0, retention="2s")
    env.fake.add_fault("stall", count=1, after_bytes=1 * MiB)
    data = os.urandom(32 * MiB)
    oid = env.upload(data, filename="stalled.bin")
    wait_for(
        lambda: any(r.get("fault") == "stall" for r in env.fake.requests()),
        20,
        "the fake to stall the PUT",
        describe=env.describe,
    )
    time.sleep(1.5)
    row = env.row(oid)
    assert row["state"] == "delivering", f"the stalled attempt should still run: {row}"
    assert env.fake.object(expected_identifier(row), "stalled.bin") is None

    started = time.monotonic()
    code = env.deliver.kill(sig, timeout=15)
    took = time.monotonic() - started
    row = env.row(oid)
    if sig == signal.SIGTERM:
        assert took < 5.0, f"SIGTERM took {took:.1f}s with a stalled upload"
        assert_clean_exit(env.deliver, code)
        assert row["state"] == "retry_wait", row
        assert row["next_attempt_at"] <= time.time() + 1, f"should be due at restart: {row}"
    else:
        assert row["state"] == "delivering", row
    assert payload_intact(env, oid, data)

    env.deliver.start()
    row = env.wait_state([oid], 30, "delivered after restart", state="delivered")[oid]
    assert row["attempts"] == 2, row
    assert_delivered_once(env, row, data, puts=2)
    env.wait_state([oid], 20, "purged", purged_at=...)


# -- metadata API faults -------------------------------------------------------------------------


def test_failed_verification_lookup_keeps_payload(env_factory: Callable[..., Env]) -> None:
    """The metadata API answers 500 to the pre-upload lookup (unknown: the PUT goes ahead, as the
    reference allows) and to the first verification (unknown, never "absent" nor "verified"):
    the payload stays past its retention until a later lookup verifies it."""
    env = env_factory(metadata_lag=0.0, retention="1s")
    env.fake.add_fault("error500", count=2, target="metadata")
    data = os.urandom(200_000)
    oid = env.upload(data, filename="unverified.bin")
    env.wait_state([oid], 20, "delivered", state="delivered")
    wait_for(lambda: not env.fake.faults(), 15, "both metadata faults used", describe=env.describe)
    time.sleep(2.5)
    row = env.row(oid)
    assert row["verified_at"] is None and row["purged_at"] is None, row
    assert time.time() > row["purge_after"]
    assert "500" in (row["last_error"] or ""), row
    assert payload_intact(env, oid, data)
    make_checks_due_now(env.db)
    row = env.wait_state([oid], 20, "verified and purged", purged_at=...)[oid]
    assert row["verified_at"] <= row["purged_at"]
    assert_delivered_once(env, row, data, puts=1)


def _stall_verification(env: Env) -> str:
    """Deliver one object, then make its verification lookup hang (the fake never answers)."""
    first = env.upload(os.urandom(10_000), filename="first.bin")
    env.wait_state([first], 20, "the first object delivered", state="delivered")
    env.fake.add_fault("stall", count=1, target="metadata")
    wait_for(
        lambda: any(
            r.get("fault") == "stall" and r["uri"].startswith("/metadata/")
            for r in env.fake.requests()
        ),
        20,
        "the verification lookup to stall",
        describe=env.describe,
    )
    return first


def test_stalled_verification_does_not_block_deliveries(env_factory: Callable[..., Env]) -> None:
    """A verification lookup that hangs (metadata API stalled) must not hold up the delivery of
    new objects: delivery slots are free, the new object is due.  (The lookup's own bound is
    120 s; verifications run inside the scheduler tick, one after another.)"""
    env = env_factory(metadata_lag=30.0, retention="2s")
    _stall_verification(env)
    data = os.urandom(10_000)
    oid = env.upload(data, filename="second.bin")
    row = env.wait_state(
        [oid], 15, "the new object delivered while a lookup hangs", state="delivered"
    )[oid]
    assert_delivered_once(env, row, data)


def test_sigterm_during_stalled_verification_exits_promptly(
    env_factory: Callable[..., Env],
) -> None:
    """SIGTERM while a verification lookup hangs: "SIGTERM cancels in-flight attempts cleanly";
    the process must exit within a few seconds, not after the lookup's 120 s timeout (systemd
    would SIGKILL it after its 90 s stop timeout)."""
    env = env_factory(metadata_lag=30.0, retention="2s")
    _stall_verification(env)
    started = time.monotonic()
    code = env.deliver.kill(signal.SIGTERM, timeout=12)
    took = time.monotonic() - started
    assert took < 5.0, f"SIGTERM took {took:.1f}s (exit status {code}) with a stalled lookup"
    assert_clean_exit(env.deliver, code)


# -- 3 and 6. deliver killed or stopped mid-upload -------------------------------------------------


def start_and_catch_put(env: Env, timeout: float = 30.0) -> int:
    """Start deliver and return as soon as the fake is receiving a PUT body (bytes so far)."""
    env.deliver.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        incoming = env.fake.incoming()
        if incoming and max(incoming.values()) > 0:
            return max(incoming.values())
        assert env.deliver.running, env.deliver.log_tail()
        time.sleep(0.002)
    raise AssertionError("no PUT body reached the fake:\n" + env.describe())


def upload_big(env: Env) -> tuple[str, bytes, dict[str, bytes]]:
    data = os.urandom(BIG)
    oid = env.upload(data, filename="big.warc.gz")
    return oid, data, receipt_files(env, oid)


def test_sigkill_mid_upload_then_restart(env_factory: Callable[..., Env]) -> None:
    """SIGKILL while a 200 MiB PUT streams: nothing is stored at the fake, the row is left
    ``delivering`` and the payload intact; the restart makes it due again (``retry_wait``) and
    delivers it once; the payload is kept until verified."""
    env = env_factory(metadata_lag=0.0, retention="2s", start_deliver=False)
    oid, data, receipts = upload_big(env)
    seen = start_and_catch_put(env)
    env.deliver.kill(signal.SIGKILL)
    assert seen < BIG, "the PUT had finished before the kill"
    row = env.row(oid)
    assert row["state"] == "delivering", row
    assert env.fake.object(expected_identifier(row), "big.warc.gz") is None, "stored after kill?"
    assert payload_intact(env, oid, data)

    env.deliver.start()
    wait_for(
        lambda: "1 interrupted attempts are due again" in env.deliver.current_log(),
        10,
        "the restart to requeue the interrupted attempt",
        describe=env.deliver.log_tail,
    )
    # Until verification the payload stays, whatever the state.
    deadline = time.monotonic() + 40
    while (row := env.row(oid))["verified_at"] is None:
        assert row["purged_at"] is None
        assert payload_intact(env, oid, data), f"payload gone before verification: {row}"
        assert time.monotonic() < deadline, env.describe()
        time.sleep(0.3)
    assert row["state"] == "delivered" and row["attempts"] == 2, row
    assert_delivered_once(env, row, data, puts=2)
    row = env.wait_state([oid], 20, "purged", purged_at=...)[oid]
    assert receipt_files(env, oid) == receipts
    assert_delivered_once(env, row, data, puts=2)


def test_sigterm_mid_upload_exits_cleanly_and_resumes(env_factory: Callable[..., Env]) -> None:
    """SIGTERM while a 200 MiB PUT streams: deliver cancels the attempt and exits 0 within a few
    seconds, recording ``retry_wait`` due now ("interrupted by shutdown"); after restart the
    object is delivered once."""
    env = env_factory(metadata_lag=0.0, retention="2s", start_deliver=False)
    oid, data, _ = upload_big(env)
    seen = start_and_catch_put(env)
    started = time.monotonic()
    code = env.deliver.kill(signal.SIGTERM, timeout=15)
    took = time.monotonic() - started
    assert seen < BIG
    assert_clean_exit(env.deliver, code)
    assert took < 5.0, f"SIGTERM took {took:.1f}s"
    row = env.row(oid)
    assert row["state"] == "retry_wait", row
    assert row["last_error"] == "interrupted by shutdown", row
    assert row["next_attempt_at"] <= time.time(), row
    assert env.fake.object(expected_identifier(row), "big.warc.gz") is None
    assert payload_intact(env, oid, data)

    env.deliver.start()
    row = env.wait_state([oid], 40, "delivered after restart", state="delivered")[oid]
    assert row["attempts"] == 2, row
    assert_delivered_once(env, row, data, puts=2)
    env.wait_state([oid], 20, "purged", purged_at=...)


# -- 4. delivery.sqlite deleted and rebuilt ---------------------------------------------------


def _upload_some(env: Env, n: int = 3) -> dict[str, bytes]:
    payloads = {}
    for i in range(n):
        data = os.urandom(100_000 + i)
        payloads[env.upload(data, filename=f"rebuild-{i}.bin")] = data
    return payloads


def _rebuild(env: Env) -> None:
    assert_clean_exit(env.deliver, env.deliver.stop())
    removed = remove_index(env.data_dir)
    assert "delivery.sqlite" in removed, removed
    env.deliver.start()


def test_rebuild_before_purge(env_factory: Callable[..., Env]) -> None:
    """Delivered and verified, not purged (retention 1 h); the index is deleted with deliver
    stopped and deliver restarted: the rescan brings the rows back ``pending``, and each is
    ``delivered`` again through the metadata lookup, without a second PUT."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    payloads = _upload_some(env)
    ids = list(payloads)
    before = env.wait_state(ids, 20, "delivered and verified", verified_at=...)
    receipts = {oid: receipt_files(env, oid) for oid in ids}

    _rebuild(env)
    rows = env.wait_state(ids, 20, "rows rebuilt and delivered again", state="delivered")
    assert set(rows) == set(ids), rows
    for oid in ids:
        row, old = rows[oid], before[oid]
        for key in ("project", "filename", "size_bytes", "checksum", "accepted_at"):
            assert row[key] == old[key], (key, row, old)
        assert (row["remote_identifier"], row["remote_name"]) == (
            old["remote_identifier"],
            old["remote_name"],
        )
        assert_delivered_once(env, row, payloads[oid], puts=1)
        assert payload_intact(env, oid, payloads[oid]), "payload purged before retention"
        assert receipt_files(env, oid) == receipts[oid]
    assert env.deliver.current_log().count("no upload needed") == len(ids)
    env.wait_state(ids, 20, "verified again", verified_at=...)
    assert len(env.fake.objects()) == len(ids)


Remote = dict[tuple[str, str], dict[str, Any]]


def _purged_then_rebuilt(env: Env) -> tuple[dict[str, bytes], Rows, Rows, Remote]:
    payloads = _upload_some(env)
    ids = list(payloads)
    before = env.wait_state(ids, 25, "delivered, verified and purged", purged_at=...)
    receipts = {oid: receipt_files(env, oid) for oid in ids}
    fake_before: Remote = {(o["identifier"], o["name"]): o for o in env.fake.objects()}
    _rebuild(env)
    wait_settled(env, ids, 20)
    # Whatever the rebuilt rows wait for, give them one more immediate try.
    make_due_now(env.db)
    time.sleep(3)
    after = wait_settled(env, ids, 20)
    for oid in ids:
        assert receipt_files(env, oid) == receipts[oid], "a receipt changed"
    return payloads, before, after, fake_before


def test_rebuild_after_purge_forgets_nothing_and_uploads_nothing_twice(
    env_factory: Callable[..., Env],
) -> None:
    """After purge, the index is deleted and rebuilt from receipts (project and filename from the
    origin records): every object is back in the index with its receipt facts, and nothing is
    uploaded again (the payloads are gone; the fake's copies stay the only ones)."""
    env = env_factory(metadata_lag=0.0, retention="1s")
    payloads, before, after, fake_before = _purged_then_rebuilt(env)
    assert set(after) == set(payloads), "an accepted object is missing from the rebuilt index"
    for oid, row in after.items():
        for key in ("project", "filename", "size_bytes", "checksum", "accepted_at"):
            assert row[key] == before[oid][key], (key, row, before[oid])
        assert data_files(env.data_dir, oid)["payload"] is False
    fake_after = {(o["identifier"], o["name"]): o for o in env.fake.objects()}
    assert set(fake_after) == set(fake_before), "new remote files after the rebuild"
    for key, remote in fake_after.items():
        assert (remote["puts"], remote["stores"]) == (1, 1), remote
        assert remote["md5"] == fake_before[key]["md5"]


def test_rebuild_after_purge_keeps_delivered_state(env_factory: Callable[..., Env]) -> None:
    """The issue: the index is rebuilt from receipts "before and after payloads were purged" and
    "``delivered`` stays ``delivered``".  A purged object whose index was lost is at IA (the
    metadata API lists it under its planned identifier and name): the rebuilt row must say
    ``delivered`` with that destination, not wait forever for a payload that was purged on
    purpose, and not be flagged as needing an operator."""
    env = env_factory(metadata_lag=0.0, retention="1s")
    _payloads, before, after, _ = _purged_then_rebuilt(env)
    problems = []
    for oid, row in after.items():
        old = before[oid]
        if (
            row["state"] != "delivered"
            or row["needs_operator"]
            or (row["remote_identifier"], row["remote_name"])
            != (old["remote_identifier"], old["remote_name"])
        ):
            problems.append(
                {
                    k: row[k]
                    for k in (
                        "object_id",
                        "state",
                        "attempts",
                        "needs_operator",
                        "last_error",
                        "remote_identifier",
                        "remote_name",
                    )
                }
            )
    assert not problems, f"rebuilt rows of delivered+purged objects: {problems}"


def _append_segment(data_dir: Path, records: list[dict[str, Any]]) -> Path:
    """A journal segment after the last one, holding ``records`` (canner's line format)."""
    journal = data_dir / "journal"
    journal.mkdir(exist_ok=True)
    names = sorted(p.name for p in journal.glob("*.jsonl"))
    segment = journal / f"{int(names[-1][:12]) + 1 if names else 1:012d}.jsonl"
    lines = [json.dumps(r, separators=(",", ":"), sort_keys=True) + "\n" for r in records]
    segment.write_text("".join(lines), encoding="utf-8")
    return segment


def _append_purge_records(data_dir: Path, object_id: str, row: dict[str, Any], now: float) -> None:
    """What ``delete_payload`` journals before it unlinks anything: the object's origin and its
    delivery record, purged at ``now``."""
    _append_segment(
        data_dir,
        [
            {
                "kind": "origin",
                "object_id": object_id,
                "project": PROJECT,
                "filename": row["filename"],
            },
            {
                "kind": "delivery",
                "object_id": object_id,
                "identifier": row["remote_identifier"],
                "remote_name": row["remote_name"],
                "content_md5": row["content_md5"],
                "delivered_at": row["delivered_at"],
                "verified_at": row["verified_at"],
                "purge_after": now - 1,
                "purged_at": now,
            },
        ],
    )


def test_rebuild_purges_again_a_payload_a_crash_left_after_its_purge_record(
    env_factory: Callable[..., Env],
) -> None:
    """A crash between a purge's journal records and its unlink leaves the records and the
    payload: after the index is lost and deliver restarted, the row comes back not purged, the
    payload is purged (again), and the row records it; the other object is left alone."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    payloads = _upload_some(env, 2)
    left, other = list(payloads)
    row = env.wait_state([left, other], 20, "delivered and verified", verified_at=...)[left]
    assert_clean_exit(env.deliver, env.deliver.stop())
    now = time.time()
    # What delete_payload appends before it unlinks anything.
    _append_purge_records(env.data_dir, left, row, now)
    assert data_files(env.data_dir, left) == {"payload": True, "info": True, "receipt": True}
    assert "delivery.sqlite" in remove_index(env.data_dir)
    env.deliver.start()

    purged = env.wait_state([left], 20, "purged again", purged_at=...)[left]
    assert purged["purged_at"] > now, purged
    assert data_files(env.data_dir, left) == {"payload": False, "info": False, "receipt": True}
    assert len(journal_records(env.data_dir, left, "delivery")) == 2
    assert "it will be purged again" in env.deliver.current_log()
    assert payload_intact(env, other, payloads[other])
    assert env.row(other)["purged_at"] is None


def test_rebuild_shows_purged_a_payload_whose_purge_was_cut_between_its_unlinks(
    env_factory: Callable[..., Env],
) -> None:
    """A cut between a purge's two unlinks (the data file, then its sidecar) leaves the journal's
    records, the sidecar and the origin file: ``canner rebuild-index`` (deliver stopped) brings
    the row back delivered and purged at the recorded time at once, and finishes the purge (the
    sidecar goes); the other object is left alone."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    payloads = _upload_some(env, 2)
    cut, other = list(payloads)
    row = env.wait_state([cut, other], 20, "delivered and verified", verified_at=...)[cut]
    assert_clean_exit(env.deliver, env.deliver.stop())
    now = time.time()
    # The disk as delete_payload leaves it after its first unlink: records, then the data gone.
    _append_purge_records(env.data_dir, cut, row, now)
    (env.data_dir / "uploads" / cut).unlink()
    assert data_files(env.data_dir, cut) == {"payload": False, "info": True, "receipt": True}
    assert "delivery.sqlite" in remove_index(env.data_dir)

    rebuilt = canner(env, "rebuild-index")
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    rows = env.rows()
    assert rows[cut]["state"] == "delivered" and rows[cut]["purged_at"] == now, rows[cut]
    assert rows[cut]["remote_identifier"] == row["remote_identifier"]
    assert data_files(env.data_dir, cut) == {"payload": False, "info": False, "receipt": True}
    assert rows[other]["purged_at"] is None and payload_intact(env, other, payloads[other])


def test_a_damaged_journal_line_costs_only_its_object_in_a_rebuild_and_a_rescan(
    env_factory: Callable[..., Env],
) -> None:
    """With the delivery record of one purged object damaged in the middle of the journal,
    ``canner rebuild-index`` names the segment and line (exit 1) and indexes every object, the
    others delivered and purged and that one flagged for an operator; deliver's rescan on a lost
    index does the same."""
    env = env_factory(metadata_lag=0.0, retention="1s")
    ids = list(_upload_some(env, 3))
    env.wait_state(ids, 25, "delivered, verified and purged", purged_at=...)
    assert_clean_exit(env.deliver, env.deliver.stop())
    # The delivery record in the middle of a segment (objects are purged in no fixed order).
    damaged, segment, number = next(
        (oid, path, n)
        for path in sorted((env.data_dir / "journal").glob("*.jsonl"))
        for n, line in enumerate(path.read_bytes().splitlines()[:-1], start=1)
        for oid in ids
        if oid.encode() in line and b'"delivery"' in line
    )
    lines = segment.read_bytes().splitlines(keepends=True)
    assert number < len(lines), "not a middle line"
    lines[number - 1] = b"\0" * 16 + lines[number - 1][16:]  # a damaged sector
    segment.write_bytes(b"".join(lines))

    def check(rows: Rows) -> None:
        assert set(ids) <= set(rows), rows
        for oid in ids:
            if oid != damaged:
                assert rows[oid]["purged_at"] is not None and not rows[oid]["needs_operator"]
        assert rows[damaged]["needs_operator"], rows[damaged]

    remove_index(env.data_dir)
    out = canner(env, "rebuild-index")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"damaged journal line {segment}: line {number}: " in out.stderr, out.stderr
    assert "3 added" in out.stdout, out.stdout
    check(env.rows())
    # Deliver is stopped: nothing has replaced the error the rebuild flagged it with.
    assert f"{segment}: line {number}" in env.row(damaged)["last_error"]

    remove_index(env.data_dir)
    env.deliver.start()
    env.wait_rows(lambda rows: set(ids) <= set(rows), 20, "the rescan to index every object")
    check(env.rows())
    assert f"damaged journal line {segment}:{number}" in env.deliver.current_log()


# -- 5. a second deliver ---------------------------------------------------------------------------


def test_second_deliver_refused(env_factory: Callable[..., Env]) -> None:
    """A second canner-deliver on the same data directory exits non-zero with a clear message; the
    first keeps its lock and keeps delivering."""
    env = env_factory(metadata_lag=0.0, retention="2s")
    first = env.deliver
    assert first.proc is not None
    second = Deliver(env.config, env.data_dir, env.receiver.root / "deliver-2.log")
    proc = second.spawn()
    try:
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code != 0, f"the second deliver exited {code}"
    text = second.log_text()
    assert "another canner-deliver already owns" in text, text
    assert str(env.data_dir) in text, text
    assert "Traceback" not in text, text
    assert first.running, "the first deliver died"
    assert (env.data_dir / "deliver.lock").read_text().strip() == str(first.proc.pid)
    data = os.urandom(50_000)
    oid = env.upload(data, filename="after-refusal.bin")
    row = env.wait_state([oid], 20, "delivered by the first", state="delivered")[oid]
    assert_delivered_once(env, row, data)
    assert first.running
