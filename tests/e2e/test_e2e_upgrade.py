"""End to end: a data directory left by the previous release is upgraded in place and carries on.

The previous release kept each object's delivery state on its ``objects`` row (schema steps 1 to
6, which this release still ships unchanged); this one keeps it in the outbound table.  The test
accepts uploads with real daemons, rewrites ``delivery.sqlite`` in the previous layout with the
objects in every delivery state (one mid-attempt, as a SIGKILL leaves it; one flagged for an
operator; one delivered and verified, its purge due), starts the daemons of this release on it
and checks that every object carries on from where it was: nothing lost, nothing sent twice.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deliver_support import Env, data_files, envs, file_md5, remove_index
from e2e_support import REPO
from hq_support import canner

pytestmark = pytest.mark.e2e

env_factory_fixture = pytest.fixture(name="env_factory")(envs)

SCHEMA = REPO / "canner" / "delivery" / "schema"
# The previous release's objects table, in its column order.
PREVIOUS_COLUMNS = (
    "object_id, project, filename, size_bytes, checksum, accepted_at, state, attempts,"
    " next_attempt_at, last_error, needs_operator, content_md5, remote_identifier, remote_name,"
    " delivered_at, verified_at, purge_after, purged_at, next_check_at, updated_at"
)


def previous_release_index(db: Path, states: dict[str, tuple[Any, ...]]) -> None:
    """Replace the index at ``db`` with one in the previous release's layout (schema 1 to 6)
    holding the same objects, each in the delivery state ``states`` gives it: ``(state,
    attempts, next_attempt_at, last_error, needs_operator, content_md5, remote_identifier,
    remote_name, delivered_at, verified_at, purge_after, next_check_at)``."""
    conn = sqlite3.connect(db)
    objects = conn.execute(
        "SELECT object_id, project, filename, size_bytes, checksum, accepted_at FROM objects"
    ).fetchall()
    conn.close()
    assert sorted(o[0] for o in objects) == sorted(states)
    remove_index(db.parent)
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for number in range(1, 7):
            conn.executescript((SCHEMA / f"v{number}.sql").read_text(encoding="utf-8"))
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (number,))
        for row in objects:
            # The previous release's columns: the state facts, purged_at (NULL), next_check_at.
            *facts, check = states[row[0]]
            conn.execute(
                f"INSERT INTO objects ({PREVIOUS_COLUMNS}) VALUES ({', '.join('?' * 20)})",
                (*row, *facts, None, check, time.time()),
            )
    finally:
        conn.close()


def schema_version(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("SELECT max(version) FROM schema_version").fetchone()[0])
    finally:
        conn.close()


def test_a_previous_release_data_directory_is_upgraded_in_place_and_carries_on(
    env_factory: Callable[..., Env],
) -> None:
    """Pending, mid-attempt, flagged and delivered-verified objects written in the previous
    layout: after the upgrade the pending and mid-attempt ones are delivered once each and
    verified, the verified one is purged without being sent again, the flagged one waits for
    its operator (``canner status`` counts it) and goes once ``canner retry`` says so."""
    env = env_factory(start_deliver=False, retention="1s")
    payloads = {env.upload(bytes([n]) * (1000 + n), f"item{n}.warc.gz"): n for n in range(4)}
    pending, cut, flagged, verified = list(payloads)
    env.receiver.stop()
    now = time.time()
    md5 = file_md5(env.data_dir / "uploads" / verified)
    previous_release_index(
        env.db,
        {
            pending: ("pending", 0, 0.0, None, 0, None, None, None, None, None, None, None),
            # A SIGKILL mid-upload left it delivering, its attempt counted.
            cut: ("delivering", 1, 0.0, None, 0, None, None, None, None, None, None, None),
            flagged: (
                "retry_wait",
                3,
                now + 86400,
                "403 Forbidden",
                1,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
            ),
            verified: (
                "delivered",
                1,
                0.0,
                None,
                0,
                md5,
                "item-verified",
                "item3.warc.gz",
                now - 60,
                now - 50,
                now - 40,
                now - 40,
            ),
        },
    )

    env.receiver.start()
    env.deliver.start()
    assert schema_version(env.db) == max(int(p.stem[1:]) for p in SCHEMA.glob("v*.sql"))
    rows = env.wait_state(
        [pending, cut], 40, "the pending and the cut-short objects purged", purged_at=...
    )
    assert rows[pending]["attempts"] == 1 and rows[cut]["attempts"] == 2, rows
    rows = env.wait_state([verified], 20, "the verified object purged", purged_at=...)
    assert rows[verified]["remote_identifier"] == "item-verified"
    assert data_files(env.data_dir, verified) == {"payload": False, "info": False, "receipt": True}
    assert rows[flagged]["state"] == "retry_wait" and rows[flagged]["needs_operator"] == 1
    status = canner(env, "status", "--json")
    assert '"needs_operator": 1' in status.stdout, status.stdout
    # Sent once each, the verified one never again.
    assert sorted(o["puts"] for o in env.fake.objects()) == [1, 1]

    retried = canner(env, "retry", "--needs-operator")
    assert retried.returncode == 0, retried.stderr
    rows = env.wait_state([flagged], 40, "the flagged object purged after its retry", purged_at=...)
    assert rows[flagged]["attempts"] == 4 and rows[flagged]["needs_operator"] == 0
    assert sorted(o["puts"] for o in env.fake.objects()) == [1, 1, 1]
    for oid in payloads:
        assert (env.data_dir / "receipts" / f"{oid}.json").exists(), oid
