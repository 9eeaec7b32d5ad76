"""The ledger end to end: released, purged records leave the node in a verified JSONL.zst ledger.

Real receiver and canner-deliver processes, the fake IA for deliveries and ledgers, HQ's
requests over HTTP and the ``canner`` command; SIGKILL at the delete step, a remote copy whose
MD5 is wrong, one whose bytes are wrong behind a correct listing (the whole-file read-back), a
ledger IA lost after its 200, IA's Retry-After, and a rebuilt index.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deliver_support import Env, FakeIA, envs, remove_index, wait_for
from e2e_support import free_port, scrape
from hq_support import (
    NODE,
    age_ledger_uploads,
    canner,
    fast_forward_ledgers,
    ledger_tables,
    ledgers,
    local_lines,
    next_ledger_attempts,
    release,
    release_records,
    remote_lines,
    status,
    wait_purged,
)

pytestmark = pytest.mark.e2e

env_factory = pytest.fixture(name="env_factory")(envs)

RECEIPT_FIELDS = ["id", "issuer", "object_id", "checksum", "size_bytes", "accepted_at"]


def archivable(env: Env, count: int, tag: str) -> dict[str, bytes]:
    """Upload ``count`` objects, wait until delivered, verified and purged, release them all;
    returns object id -> receipt JSON as served."""
    ids = [
        env.upload(f"{tag} {i}\n".encode() * (50 + i), filename=f"{tag}-{i}.warc")
        for i in range(count)
    ]
    wait_purged(env, ids)
    receipts = {oid: env.receiver.request("GET", f"/api/v1/receipts/{oid}").content for oid in ids}
    answers = release(env, [f"receipt:{oid}" for oid in ids]).json()["results"]
    assert [a["status"] for a in answers] == ["released"] * count
    assert all(len(release_records(env, oid)) == 1 for oid in ids)
    return receipts


def completes_once_ia_is_right(env: Env, receipts: dict[str, bytes]) -> dict[str, Any]:
    """IA's faults cleared, the ledger is flushed to done and the receipts it holds are gone;
    the ledger as ``canner ledger flush`` printed it."""
    env.fake.clear_faults()
    fast_forward_ledgers(env)
    out = flush(env)
    assert out.returncode == 0, out.stdout + out.stderr
    [ledger] = [json.loads(line) for line in out.stdout.splitlines()]
    assert ledger["state"] == "done" and ledger["needs_operator"] is False
    for oid in receipts:
        assert not (env.data_dir / "receipts" / f"{oid}.json").exists()
    return ledger


def receipt_files(env: Env, oid: str) -> list[str]:
    return sorted(p.name for p in (env.data_dir / "receipts").glob(f"{oid}*"))


def flush(env: Env, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return canner(env, "ledger", "flush", "--timeout", str(timeout), timeout=timeout + 30)


def test_flush_archives_released_records_in_a_verified_ledger(
    env_factory: Callable[..., Env],
) -> None:
    """canner ledger flush writes, uploads and verifies one ledger; its lines (sorted by object
    id) carry each receipt byte for byte; then the receipts, side files, rows and journal records
    are gone, the status query says where the record is, a repeated release answers the same
    released_at, and a rebuilt index does not bring the objects back."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.3)
    receipts = archivable(env, 3, "ledger")
    kept = env.upload(b"not released\n" * 10)
    released_at = {oid: env.row(oid)["released_at"] for oid in receipts}
    # Files an older canner left beside a receipt go with it once it is archived, not before.
    first = min(receipts)
    wait_purged(env, [kept])
    assert receipt_files(env, first) == [f"{first}.json"], "the purge left its origin file"
    for oid in (first, kept):
        origin = {"object_id": oid, "project": "example", "filename": None}
        (env.data_dir / "receipts" / f"{oid}.meta.json").write_text(json.dumps(origin))
    (env.data_dir / "receipts" / f"{first}.delivery.json").write_bytes(b"{}")
    out = flush(env)
    assert out.returncode == 0, out.stdout + out.stderr
    [ledger] = [json.loads(line) for line in out.stdout.splitlines()]
    assert ledger["state"] == "done" and ledger["records"] == 3
    assert ledger["name"].startswith(f"{NODE}-") and ledger["verified_at"] is not None
    assert ledger["identifier"] == f"canner-ledger-{NODE}-{ledger['period']}"
    assert ledger["remote_name"] == f"{ledger['name']}.jsonl.zst"
    # The remote copy and the local one are the same lines; each starts with the receipt.
    remote = remote_lines(env.fake, ledger["identifier"], ledger["remote_name"])
    assert remote == local_lines(env, ledger["name"])
    ordered = sorted(receipts)
    assert [json.loads(line)["object_id"] for line in remote] == ordered
    for line, oid in zip(remote, ordered, strict=True):
        assert line.startswith(receipts[oid][:-1] + b","), line
        record = json.loads(line)
        assert list(record)[:6] == RECEIPT_FIELDS
        assert record["released_at"] == released_at[oid]
        assert record["project"] == "example" and record["purged_at"] is not None
        assert record["identifier"].startswith("example-")
    stored = env.fake.object(ledger["identifier"], ledger["remote_name"])
    assert stored is not None and stored["md5"] == ledger["md5"]
    # Local state of archived records is gone; the unreleased object is untouched.
    rows = env.rows()
    for n, oid in enumerate(ordered, start=1):
        assert receipt_files(env, oid) == []
        assert release_records(env, oid) == []
        assert oid not in rows
        doc = status(env, oid).json()
        assert doc["archived"]["ledger"] == ledger["name"]
        assert doc["archived"]["line"] == n
        assert doc["hq"] == {"released_at": released_at[oid]}
    # The operator's view agrees (canner show reads the same archived-id index).
    shown = canner(env, "show", ordered[0])
    assert shown.returncode == 0, shown.stderr
    archived = json.loads(shown.stdout)["archived"]
    assert (archived["ledger"], archived["line"]) == (ledger["name"], 1)
    assert archived["released_at"] == released_at[ordered[0]]
    assert kept in rows
    assert receipt_files(env, kept) == [f"{kept}.json", f"{kept}.meta.json"]
    again = release(env, [f"receipt:{ordered[0]}"]).json()["results"]
    assert again == [
        {
            "id": f"receipt:{ordered[0]}",
            "status": "already_released",
            "released_at": released_at[ordered[0]],
        }
    ]
    # A lost index is rebuilt without the archived objects; the ledger is still listed.
    env.deliver.stop()
    env.receiver.stop()
    remove_index(env.data_dir)
    out = canner(env, "rebuild-index")
    assert out.returncode == 0, out.stderr
    rows = env.rows()
    assert kept in rows and not set(ordered) & set(rows)
    assert [x["name"] for x in ledgers(env)] == [ledger["name"]]
    env.deliver.start()
    wait_for(lambda: any(x["state"] == "done" for x in ledgers(env)), 30, "ledger adopted")
    assert not set(ordered) & set(env.rows())


def retried_by_an_operator(env: Env, ledger: dict[str, Any]) -> None:
    """``canner retry LEDGER`` sends the flagged ledger again (the one way for every kind)."""
    out = canner(env, "retry", ledger["name"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ledger {ledger['name']}" in out.stdout, out.stdout


def test_wrong_remote_md5_is_flagged_until_an_operator_retries(
    env_factory: Callable[..., Env],
) -> None:
    """While IA's metadata shows a different MD5 for the ledger, nothing local is deleted and
    the ledger is flagged, as an object would be: it is not uploaded again on its own, and
    ``canner retry LEDGER`` sends it again; once the remote copy verifies, it completes.  The
    deliver process's metrics count the ledger's attempts, bytes, verification and purge under
    kind="ledger", like any other transfer."""
    port = free_port()

    def tables(fake: FakeIA, root: Path) -> str:
        listen = f'\n[metrics]\ndeliver_listen = "tcp:{port}:interface=127.0.0.1"\n'
        return ledger_tables(fake, root) + listen

    env = env_factory(extra=tables, retention="1s", metadata_lag=0.3)
    receipts = archivable(env, 2, "wrongmd5")
    env.fake.add_fault("wrong_md5", count=1000, target="metadata")
    out = flush(env, timeout=8)
    assert out.returncode == 1 and "did not finish" in out.stderr, out.stdout + out.stderr
    [ledger] = ledgers(env)
    assert ledger["needs_operator"] is True
    assert "remote file differs" in ledger["last_error"], ledger
    assert ledger["state"] == "uploaded"
    stored = env.fake.object(ledger["identifier"], ledger["remote_name"])
    assert stored is not None and stored["puts"] == 1  # flagged, not sent again on its own
    for oid in receipts:
        assert (env.data_dir / "receipts" / f"{oid}.json").exists()
        assert env.row(oid)["released_at"] is not None
    assert not (env.data_dir / "ledger" / f"{ledger['name']}.json").exists()
    status_out = canner(env, "status")  # the ledger counts as needing an operator
    assert "needs operator   1\n" in status_out.stdout, status_out.stdout
    assert status_out.returncode == 1 and "1 deliveries need an operator" in status_out.stderr
    retried_by_an_operator(env, ledger)
    ledger = completes_once_ia_is_right(env, receipts)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    kind = frozenset({("kind", "ledger")})
    attempts = samples[("canner_delivery_attempts_total", kind | {("project", "")})]
    stored = env.fake.object(ledger["identifier"], ledger["remote_name"])
    # Each attempt PUTs the whole file, unless IA already lists it with the right MD5.
    assert stored is not None and attempts >= stored["puts"] >= 1 and attempts == 2
    assert samples[("canner_ia_sent_bytes_total", kind)] == stored["puts"] * ledger["bytes"]
    assert samples[("canner_deliveries_completed_total", kind | {("project", "")})] == attempts
    assert samples[("canner_deliveries_verified_total", kind)] == 1
    assert samples[("canner_purged_total", kind)] == 1
    assert samples[("canner_deliveries_verified_total", frozenset({("kind", "object")}))] == 2


def test_wrong_bytes_behind_a_right_listing_are_flagged_and_retried_with_an_upload(
    env_factory: Callable[..., Env],
) -> None:
    """IA lists the ledger with its size and MD5 but serves it with one byte flipped: the
    whole-file read-back does not verify it, nothing local is deleted, the ledger is flagged;
    ``canner retry LEDGER`` uploads it again although the listing matches; once IA serves the
    right bytes, it completes."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.3)
    receipts = archivable(env, 2, "flipped")
    env.fake.add_fault("flip_byte", count=1000, target="download")
    out = flush(env, timeout=8)
    assert out.returncode == 1 and "did not finish" in out.stderr, out.stdout + out.stderr
    [ledger] = ledgers(env)
    assert ledger["needs_operator"] is True and ledger["verified_at"] is None
    assert "read-back: the" in ledger["last_error"], ledger
    assert f"the local copy's is {ledger['md5']}" in ledger["last_error"], ledger
    assert ledger["state"] == "uploaded"
    stored = env.fake.object(ledger["identifier"], ledger["remote_name"])
    assert stored is not None and stored["md5"] == ledger["md5"] and stored["puts"] == 1
    served = [r for r in env.fake.requests() if r.get("fault") == "flip_byte"]
    assert served and all("range" not in r["headers"] for r in served)
    for oid in receipts:
        assert (env.data_dir / "receipts" / f"{oid}.json").exists()
        assert status(env, oid).json()["archived"] is None
    assert not (env.data_dir / "ledger" / f"{ledger['name']}.json").exists()
    retried_by_an_operator(env, ledger)
    wait_for(
        lambda: env.fake.object(ledger["identifier"], ledger["remote_name"])["puts"] == 2,
        20,
        "the ledger uploaded again, though IA lists the right MD5",
    )
    completes_once_ia_is_right(env, receipts)


def test_a_ledger_lost_after_its_200_is_uploaded_again(env_factory: Callable[..., Env]) -> None:
    """IA answers the ledger's PUT 200 and never lists it: the ledger waits, unverified, with
    its records kept; once the verify timeout (6 h) has passed since the upload, it goes back
    to be uploaded again, is verified and completes."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.3)
    receipts = archivable(env, 2, "lost")
    env.fake.add_fault("vanish", count=1, target="put")
    out = flush(env, timeout=5)
    assert out.returncode == 1, out.stdout + out.stderr
    [ledger] = ledgers(env)
    assert ledger["state"] == "uploaded" and ledger["needs_operator"] is False
    assert "not listed by the metadata API yet" in ledger["last_error"], ledger
    assert env.fake.object(ledger["identifier"], ledger["remote_name"]) is None
    for oid in receipts:
        assert (env.data_dir / "receipts" / f"{oid}.json").exists()
    age_ledger_uploads(env, 6 * 3600)
    out = flush(env, timeout=20)
    assert out.returncode == 0, out.stdout + out.stderr
    [ledger] = [json.loads(line) for line in out.stdout.splitlines()]
    assert ledger["state"] == "done"
    stored = env.fake.object(ledger["identifier"], ledger["remote_name"])
    assert stored is not None and stored["puts"] == 2 and stored["md5"] == ledger["md5"]
    # The one policy's words, as for objects and packages.
    assert f"ledger {ledger['name']} is still not listed at its destination" in (
        env.deliver.log_text()
    )
    for oid in receipts:
        assert not (env.data_dir / "receipts" / f"{oid}.json").exists()


def test_retry_after_delays_the_next_ledger_upload(env_factory: Callable[..., Env]) -> None:
    """A ledger PUT answered 503 with Retry-After: 1800 is not tried again before then (the
    ledger's own backoff would say a minute); once due, it completes."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.3)
    archivable(env, 1, "slow")
    env.fake.add_fault("slowdown", count=1, target="put", retry_after=1800)
    before = time.time()
    out = flush(env, timeout=4)
    assert out.returncode == 1, out.stdout + out.stderr
    [ledger] = ledgers(env)
    assert ledger["state"] == "written" and "SlowDown" in ledger["last_error"], ledger
    assert next_ledger_attempts(env) >= [before + 1800], ledger
    assert len([p for p in env.fake.puts() if p["uri"].endswith(".jsonl.zst")]) == 1
    fast_forward_ledgers(env)
    out = flush(env)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sigkill_during_delete_resumes_after_restart(env_factory: Callable[..., Env]) -> None:
    """canner-deliver killed while deleting an archived ledger's local state (one receipt
    cannot be deleted yet): after a restart the deletion finishes; nothing is archived twice."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.3)
    receipts = archivable(env, 3, "sigkill")
    ordered = sorted(receipts)
    stuck = env.data_dir / "receipts" / f"{ordered[1]}.json"
    # An immutable file cannot be unlinked, even by root: the delete step stops there.
    subprocess.run(["chattr", "+i", str(stuck)], check=True)
    try:
        out = flush(env, timeout=6)
        assert out.returncode == 1
        [ledger] = ledgers(env)
        assert ledger["state"] == "deleting" and "delete:" in (ledger["last_error"] or "")
        assert not (env.data_dir / "receipts" / f"{ordered[0]}.json").exists()
        assert stuck.exists()
        assert env.deliver.kill(signal.SIGKILL) == -signal.SIGKILL
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    rows = env.rows()
    assert ordered[1] in rows and ordered[2] in rows  # rows go after their files
    env.deliver.start()
    fast_forward_ledgers(env)
    wait_for(lambda: ledgers(env)[0]["state"] == "done", 30, "the ledger done after restart")
    [ledger] = ledgers(env)
    for oid in ordered:
        assert not list((env.data_dir / "receipts").glob(f"{oid}*"))
        assert oid not in env.rows()
    remote = remote_lines(env.fake, ledger["identifier"], ledger["remote_name"])
    assert len(remote) == 3
    assert [o["name"] for o in env.fake.objects() if o["identifier"] == ledger["identifier"]] == [
        ledger["remote_name"]
    ]


def test_sigkill_during_upload_and_verification_resumes(env_factory: Callable[..., Env]) -> None:
    """canner-deliver killed while the ledger's PUT hangs, and again while IA's metadata API
    fails: each restart resumes (upload again, verify), nothing local is deleted before the
    remote copy verified, and exactly one ledger file ends up at IA."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.2)
    receipts = archivable(env, 2, "killed")
    env.fake.add_fault("stall", count=1, target="put")
    out = flush(env, timeout=4)
    assert out.returncode == 1
    [ledger] = ledgers(env)
    assert ledger["state"] == "written"  # its PUT never answers
    assert env.deliver.kill(signal.SIGKILL) == -signal.SIGKILL
    env.fake.clear_faults()
    env.fake.add_fault("error500", count=100000, target="metadata")  # no answer from IA yet
    env.deliver.start()
    wait_for(lambda: ledgers(env)[0]["state"] == "uploaded", 30, "the ledger uploaded again")
    assert env.deliver.kill(signal.SIGKILL) == -signal.SIGKILL
    for oid in receipts:  # not verified: nothing local deleted
        assert (env.data_dir / "receipts" / f"{oid}.json").exists()
        assert status(env, oid).json()["archived"] is None
    env.fake.clear_faults()
    env.deliver.start()
    fast_forward_ledgers(env)
    out = flush(env)
    assert out.returncode == 0, out.stdout + out.stderr
    [ledger] = ledgers(env)
    assert ledger["state"] == "done" and ledger["records"] == 2
    for oid in receipts:
        assert not (env.data_dir / "receipts" / f"{oid}.json").exists()
        assert status(env, oid).json()["archived"]["ledger"] == ledger["name"]
    ledgers_at_fake = [o for o in env.fake.objects() if o["name"].endswith(".jsonl.zst")]
    assert [o["name"] for o in ledgers_at_fake] == [ledger["remote_name"]]
    assert len(remote_lines(env.fake, ledger["identifier"], ledger["remote_name"])) == 2


def test_archived_package_members_stay_archived_when_the_index_is_rebuilt(
    env_factory: Callable[..., Env],
) -> None:
    """Members of a megawarc package archived by a done ledger come back neither from
    rebuild-index nor from a deliver start that restores the package: the package still counts
    them, a repeated release answers the original released_at, and the next flush is done."""
    env = env_factory(
        extra=ledger_tables,
        retention="1s",
        metadata_lag=0.3,
        packaging={"mode": "megawarc", "target_bytes": "1MB", "max_wait": "1s"},
    )
    ids = [env.upload(f"packed {i}\n".encode() * 60, filename=f"packed-{i}.txt") for i in range(3)]
    env.wait_state(ids, 60, "members delivered", verified_at=..., purged_at=...)
    answers = release(env, [f"receipt:{oid}" for oid in ids]).json()["results"]
    assert [a["status"] for a in answers] == ["released"] * 3
    released_at = {oid: env.row(oid)["released_at"] for oid in ids}
    out = flush(env)
    assert out.returncode == 0, out.stdout + out.stderr
    [ledger] = [json.loads(line) for line in out.stdout.splitlines()]
    assert ledger["state"] == "done" and ledger["records"] == 3
    assert not set(ids) & set(env.rows())

    def archived_and_counted() -> None:
        assert not set(ids) & set(env.rows())
        listed = canner(env, "packages")
        assert listed.returncode == 0, listed.stderr
        packed = [json.loads(line) for line in listed.stdout.splitlines()]
        assert packed and sum(p["members"] for p in packed) == 3
        assert all(p["remote_verified_at"] for p in packed)

    # The whole index lost: rebuild-index restores the package, not its archived members.
    env.deliver.stop()
    env.receiver.stop()
    remove_index(env.data_dir)
    out = canner(env, "rebuild-index")
    assert out.returncode == 0 and "packages restored" in out.stdout, out.stdout + out.stderr
    archived_and_counted()
    # Lost again: canner-deliver's start restores the package, not its archived members.
    remove_index(env.data_dir)
    env.deliver.start()
    wait_for(lambda: ledgers(env) and ledgers(env)[0]["state"] == "done", 30, "ledger adopted")
    wait_for(lambda: canner(env, "packages").stdout.strip(), 30, "the package restored")
    archived_and_counted()
    env.receiver.start()
    again = release(env, [f"receipt:{oid}" for oid in ids]).json()["results"]
    assert [(a["status"], a["released_at"]) for a in again] == [
        ("already_released", released_at[oid]) for oid in ids
    ]
    out = flush(env, timeout=15)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [x["state"] for x in ledgers(env)] == ["done"]
