"""End to end: resumable multipart delivery (issue 26 §1) with real ``twistd canner-receiver``
and ``canner-deliver`` processes against the fake IA (``tests/fake_ia.py``, its own process),
which speaks S3 multipart and counts every part body byte it receives.

* deliver is SIGKILLed while part 2 and then part 3 are in flight: each restart resumes at the
  part that was in flight; parts that finished are never sent again; ``canner status`` shows
  the parts at IA meanwhile.
* A completed file that IA lists right but serves with one byte flipped is caught by the
  whole-file read-back and its payload is kept.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from deliver_support import REPO, Env, data_files, envs, md5_hex, venv_bin, wait_for

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

PART = 5 << 20  # S3's (and canner's) smallest part
MULTIPART = {"multipart_threshold": PART, "multipart_part_size": PART, "readback_bytes": "all"}
SIZE = 3 * PART + 1000  # four parts


def part_puts(env: Env) -> list[dict[str, Any]]:
    return [r for r in env.fake.requests() if "part" in r]


def status_text(env: Env) -> str:
    out = subprocess.run(
        [venv_bin("canner"), "status", "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return out.stdout


def stalled_at(env: Env, part: int) -> bool:
    return any(r.get("fault") == "stall" and r["part"] == part for r in part_puts(env))


def test_sigkilled_deliver_resumes_without_resending_finished_parts(
    env_factory: Callable[..., Env],
) -> None:
    """SIGKILL while part 2 hangs, then while part 3 hangs: after each restart the upload goes on
    at the part in flight; every finished part reached the fake exactly once, the file IA stores
    is the payload, and the payload is purged only after the read-back."""
    env = env_factory(retention="1s", start_deliver=False, delivery=MULTIPART)
    data = os.urandom(SIZE)
    oid = env.upload(data, filename="big.warc.gz")
    for part in (2, 3):
        env.fake.add_fault("stall", target="part", part=part, after_bytes=1)
        env.deliver.start()
        wait_for(lambda p=part: stalled_at(env, p), 30, f"part {part} in flight", 0.1, env.describe)
        if part == 3:
            # What an operator sees: the parts at IA, part 1 (sent before the restart) included.
            wait_for(
                lambda: "2 of 4 parts at IA" in status_text(env),
                15,
                "canner status to show the parts at IA",
                0.5,
                lambda: status_text(env),
            )
        env.deliver.kill(signal.SIGKILL)
        assert env.row(oid)["state"] == "delivering"
        journals = list((env.data_dir / "multipart").rglob("*.json"))
        assert len(journals) == 1, journals
    env.deliver.start()
    row = env.wait_state([oid], 60, "delivered, verified and purged", purged_at=...)[oid]
    stored = env.fake.object(row["remote_identifier"], row["remote_name"])
    assert stored is not None and stored["md5"] == md5_hex(data) and stored["size"] == SIZE

    answered = [r["part"] for r in part_puts(env) if r["status"] == 200]
    assert sorted(answered) == [1, 2, 3, 4], part_puts(env)
    tried = [r["part"] for r in part_puts(env)]
    assert sorted(tried) == [1, 2, 2, 3, 3, 4], part_puts(env)
    received = env.fake.multipart()["part_bytes"][f"{row['remote_identifier']}/big.warc.gz"]
    # The two hung parts got at most a part each before the kill; nothing else twice.
    assert SIZE <= received < SIZE + 2 * PART, received
    assert not list((env.data_dir / "multipart").rglob("*.json")), "journal left behind"
    assert not data_files(env.data_dir, oid)["payload"]


def test_a_completed_file_with_one_wrong_byte_is_caught_and_kept(
    env_factory: Callable[..., Env],
) -> None:
    """IA completes the multipart upload and lists the right size and MD5 but serves one byte
    flipped: the whole-file read-back flags the row as a bad copy and the payload stays."""
    env = env_factory(retention="1s", delivery=MULTIPART)
    env.fake.add_fault("flip_byte", count=1000)
    data = os.urandom(SIZE)
    oid = env.upload(data, filename="flipped.warc")
    row = env.wait_state([oid], 60, "the read-back mismatch flagged", needs_operator=1)[oid]
    assert row["state"] == "delivered" and row["verified_at"] is None, row
    assert row["force_upload"] == 1 and f"the local copy's is {md5_hex(data)}" in row["last_error"]
    assert sorted(r["part"] for r in part_puts(env)) == [1, 2, 3, 4]
    time.sleep(2.5)  # past the 1 s retention
    row = env.row(oid)
    assert row["purged_at"] is None and data_files(env.data_dir, oid)["payload"], row
