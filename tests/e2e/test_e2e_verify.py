"""End to end: deliveries the Internet Archive loses after its ``200``, and copies it serves
wrong, against real ``twistd canner-receiver``/``canner-deliver`` processes and the fake IA
(``tests/fake_ia.py``, its own process) over loopback (issue 8, items 8 and 9).

* IA answers the PUT ``200`` and never lists the file (``vanish``): once ``verify_timeout``
  (2 s here) passes, the object is delivered again, then verified and purged.
* IA keeps losing it: after 3 re-deliveries the row is flagged (payload kept); ``canner retry
  ID`` sends it to be delivered again.
* IA serves other bytes than its metadata promises (``altered`` downloads): the read-back
  before the purge flags the row with the offsets, the payload stays; once IA serves the right
  bytes an operator retry uploads again (although the metadata matches) and it is purged.
* IA serves a 4 MB file with one byte flipped (``flip_byte``), and the project reads back the
  whole file (``readback_bytes = "all"``): flagged, the payload stays.

What is checked is what an operator sees: ``canner deliveries``, ``canner retry``, the data
directory, and the fake's stored files and request log.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from deliver_support import REPO, Env, data_files, envs, md5_hex, venv_bin

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

VERIFY_TIMEOUT = {"verify_timeout": "2s"}


def canner(env: Env, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv_bin("canner"), *argv, "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def remote(env: Env, row: dict[str, Any]) -> dict[str, Any] | None:
    return env.fake.object(row["remote_identifier"], row["remote_name"])


def vanished_puts(env: Env) -> int:
    return sum(1 for r in env.fake.requests() if r.get("fault") == "vanish")


def test_file_lost_after_its_200_is_delivered_again(env_factory: Callable[..., Env]) -> None:
    """IA loses the file after answering 200: it is not listed, so after verify_timeout the
    object goes back to be delivered, is uploaded again (the pre-upload lookup finds nothing),
    verified and purged; the payload is kept until then."""
    env = env_factory(retention="1s", delivery=VERIFY_TIMEOUT)
    env.fake.add_fault("vanish", count=1)
    data = os.urandom(300_000)
    oid = env.upload(data, filename="lost.warc")
    row = env.wait_state([oid], 20, "the first delivery", state="delivered")[oid]
    assert vanished_puts(env) == 1 and remote(env, row) is None
    assert data_files(env.data_dir, oid)["payload"]

    row = env.wait_state([oid], 30, "re-delivered, verified and purged", purged_at=...)[oid]
    assert row["redeliveries"] == 1 and row["attempts"] == 2, row
    assert row["needs_operator"] == 0 and row["last_error"] is None, row
    stored = remote(env, row)
    assert stored is not None
    assert (stored["puts"], stored["stores"], stored["md5"]) == (2, 1, md5_hex(data))
    assert not data_files(env.data_dir, oid)["payload"]
    log = env.deliver.log_text()
    assert "delivering it again (re-delivery 1 of 3)" in log, env.deliver.log_tail()


def test_repeatedly_lost_file_is_flagged_then_retried(env_factory: Callable[..., Env]) -> None:
    """IA loses the file after every 200: three automatic re-deliveries, then the row is flagged
    for an operator and left delivered-unverified with its payload; ``canner status`` warns;
    ``canner retry ID`` re-queues it, and with IA healthy again it is verified and purged."""
    env = env_factory(retention="1s", delivery=VERIFY_TIMEOUT)
    env.fake.add_fault("vanish", count=4)
    data = os.urandom(50_000)
    oid = env.upload(data, filename="cursed.warc")

    row = env.wait_state([oid], 60, "flagged after 3 re-deliveries", needs_operator=1)[oid]
    assert row["state"] == "delivered" and row["verified_at"] is None, row
    assert row["redeliveries"] == 3 and row["attempts"] == 4, row
    assert "after 3 re-deliveries" in row["last_error"], row
    assert vanished_puts(env) == 4
    # Flagged: no fifth upload, however long we wait; the payload stays.
    time.sleep(3)
    row = env.row(oid)
    assert row["state"] == "delivered" and row["attempts"] == 4 and row["purged_at"] is None
    assert len(env.fake.puts()) == 4 and data_files(env.data_dir, oid)["payload"]
    status = canner(env, "status")
    assert status.returncode == 1 and "1 deliveries need an operator" in status.stderr, status

    retried = canner(env, "retry", oid[:12])
    assert retried.returncode == 0, retried.stderr
    assert f"{oid} is due now (delivered again)" in retried.stdout
    row = env.wait_state([oid], 30, "delivered after the retry, purged", purged_at=...)[oid]
    assert row["attempts"] == 5 and row["redeliveries"] == 0 and row["needs_operator"] == 0, row
    stored = remote(env, row)
    assert stored is not None and stored["md5"] == md5_hex(data) and stored["stores"] == 1
    assert not data_files(env.data_dir, oid)["payload"]


def test_altered_bytes_are_flagged_and_the_payload_kept(env_factory: Callable[..., Env]) -> None:
    """IA's metadata lists the right size and MD5 but its downloads serve other bytes: the
    read-back before the purge flags the row with the offsets it compared, the payload stays
    (not purged, not re-delivered, even past retention and verify_timeout); after IA is fixed,
    ``canner retry`` uploads the file again although the metadata matches, and only then is it
    verified and purged."""
    env = env_factory(retention="1s", delivery=VERIFY_TIMEOUT)
    env.fake.add_fault("altered", count=1000)
    data = os.urandom(2 * 1024 * 1024 + 5)
    oid = env.upload(data, filename="rotten.warc")
    row = env.wait_state([oid], 30, "the read-back mismatch flagged", needs_operator=1)[oid]
    assert row["state"] == "delivered" and row["verified_at"] is None, row
    assert row["force_upload"] == 1, row
    error = row["last_error"]
    assert "IA serves other bytes than the local payload at offsets" in error, row
    offsets = re.search(r"at offsets ([0-9, -]+) \(of", error)
    assert offsets is not None, error
    for part in offsets.group(1).split(", "):
        first, last = (int(x) for x in part.split("-"))
        assert 0 <= first <= last < len(data) and last - first + 1 == 64 * 1024
    ranged = [r for r in env.fake.requests() if "/datanode/" in r["uri"]]
    assert ranged and all(r["status"] == 206 and "range" in r["headers"] for r in ranged)

    time.sleep(3)  # past the 1 s retention and the 2 s verify_timeout
    row = env.row(oid)
    assert row["purged_at"] is None and row["needs_operator"] == 1 and row["attempts"] == 1, row
    assert data_files(env.data_dir, oid)["payload"]
    assert len(env.fake.puts()) == 1

    env.fake.clear_faults()
    retried = canner(env, "retry", oid)
    assert retried.returncode == 0, retried.stderr
    row = env.wait_state([oid], 30, "uploaded again, verified, purged", purged_at=...)[oid]
    assert row["attempts"] == 2 and row["force_upload"] == 0 and row["needs_operator"] == 0
    stored = remote(env, row)
    assert stored is not None and (stored["puts"], stored["stores"]) == (2, 2), stored
    assert "a read-back found other bytes there: uploading it again" in env.deliver.log_text()
    assert not data_files(env.data_dir, oid)["payload"]


def test_one_flipped_byte_is_caught_by_a_whole_file_read_back(
    env_factory: Callable[..., Env],
) -> None:
    """With readback_bytes = "all", a 4 MB file that IA lists right but serves with its middle
    byte flipped is downloaded whole (one request, no Range), flagged as a bad copy naming the
    MD5s, and its payload is kept past retention and verify_timeout."""
    env = env_factory(retention="1s", delivery={**VERIFY_TIMEOUT, "readback_bytes": "all"})
    env.fake.add_fault("flip_byte", count=1000)
    data = os.urandom(4_000_000)
    oid = env.upload(data, filename="flipped.warc")
    row = env.wait_state([oid], 30, "the read-back mismatch flagged", needs_operator=1)[oid]
    assert row["state"] == "delivered" and row["verified_at"] is None, row
    assert row["force_upload"] == 1, row
    assert f"the local copy's is {md5_hex(data)}" in row["last_error"], row
    served = [r for r in env.fake.requests() if "/datanode/" in r["uri"]]
    assert served and all(r["status"] == 200 and "range" not in r["headers"] for r in served)
    assert all(r.get("fault") == "flip_byte" for r in served)

    time.sleep(3)  # past the 1 s retention and the 2 s verify_timeout
    row = env.row(oid)
    assert row["purged_at"] is None and row["needs_operator"] == 1 and row["attempts"] == 1, row
    assert data_files(env.data_dir, oid)["payload"]
    assert len(env.fake.puts()) == 1
