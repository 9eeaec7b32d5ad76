"""An HQ simulator: the job tracker's side of canner's HQ protocol, as a separate process.

It keeps its state in SQLite the way HQ does: ``jobs`` (one per receipt a worker handed in) and
an ``outbox`` of release events written in the same transaction that closes a job.  It polls
``POST /api/v1/objects:query`` until canner reports a job's object delivered and verified, then
closes the job and queues its release; the outbox is sent to ``POST /api/v1/releases`` in
shuffled batches (out of order) padded with duplicates, and a share of the answers is thrown away
as if the connection dropped after canner acted, so the event is sent again.  A share of the
events is sent before delivery is confirmed (canner refuses them as ``not_delivered``; they are
retried).  Every ``released_at`` canner gives for an object must be the same each time; a
conflict ends the run with exit status 3.

Usage::

    python tests/hq_simulator.py --url URL --token T --db hq.sqlite --receipts receipts.jsonl
        [--batch 7] [--drop 0.3] [--early 0.2] [--seed 1] [--timeout 120]

``receipts.jsonl`` holds the receipts workers handed in (one JSON line each); jobs already in
the database are kept, so a second run adds jobs.  Prints one JSON summary line:
``{"released": {object_id: released_at}, "requests": n, "dropped": n, "refused": n}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import time
from typing import Any

import requests

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    object_id    TEXT PRIMARY KEY,
    receipt      TEXT NOT NULL,
    state        TEXT NOT NULL DEFAULT 'open',  -- open -> closed (delivery confirmed)
    released_at  REAL
);
CREATE TABLE IF NOT EXISTS outbox (
    event_id     INTEGER PRIMARY KEY,
    object_id    TEXT NOT NULL,
    due_at       REAL NOT NULL,
    done         INTEGER NOT NULL DEFAULT 0
);
"""


class Conflict(Exception):
    """canner gave two different released_at values for one object."""


def open_db(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(SCHEMA)
    return conn


def add_jobs(conn: sqlite3.Connection, lines: list[str], early: float, rng: random.Random) -> None:
    conn.execute("BEGIN")
    for line in lines:
        receipt = json.loads(line)
        oid = receipt["object_id"]
        added = conn.execute(
            "INSERT OR IGNORE INTO jobs (object_id, receipt) VALUES (?, ?)", (oid, line)
        ).rowcount
        if added and rng.random() < early:
            # A premature release (a bug in HQ, or an operator): canner must refuse it.
            conn.execute("INSERT INTO outbox (object_id, due_at) VALUES (?, 0)", (oid,))
    conn.execute("COMMIT")


def poll(conn: sqlite3.Connection, session: requests.Session, url: str) -> None:
    """Close the jobs whose objects canner reports delivered and verified (job + outbox event
    in one transaction, as HQ's outbox pattern wants)."""
    open_ids = [r[0] for r in conn.execute("SELECT object_id FROM jobs WHERE state = 'open'")]
    for start in range(0, len(open_ids), 1000):
        chunk = open_ids[start : start + 1000]
        r = session.post(url + "/api/v1/objects:query", json={"object_ids": chunk}, timeout=30)
        r.raise_for_status()
        for result in r.json()["results"]:
            doc = result["object"]
            if doc is None:
                continue
            confirmed = (doc.get("delivery") or {}).get("verified") or doc.get("archived")
            if confirmed:
                conn.execute("BEGIN")
                conn.execute(
                    "UPDATE jobs SET state = 'closed' WHERE object_id = ? AND state = 'open'",
                    (result["object_id"],),
                )
                conn.execute(
                    "INSERT INTO outbox (object_id, due_at) VALUES (?, 0)", (result["object_id"],)
                )
                conn.execute("COMMIT")


def record(conn: sqlite3.Connection, oid: str, released_at: float) -> None:
    row = conn.execute("SELECT released_at FROM jobs WHERE object_id = ?", (oid,)).fetchone()
    if row is None:
        return
    if row[0] is not None and row[0] != released_at:
        raise Conflict(f"{oid}: released_at {row[0]} and then {released_at}")
    conn.execute("UPDATE jobs SET released_at = ? WHERE object_id = ?", (released_at, oid))
    conn.execute("UPDATE outbox SET done = 1 WHERE object_id = ?", (oid,))


def send(
    conn: sqlite3.Connection,
    session: requests.Session,
    url: str,
    token: str,
    batch: int,
    drop: float,
    rng: random.Random,
    stats: dict[str, int],
) -> None:
    now = time.time()
    pending = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT object_id FROM outbox WHERE done = 0 AND due_at <= ?", (now,)
        )
    ]
    rng.shuffle(pending)
    done = [r[0] for r in conn.execute("SELECT object_id FROM jobs WHERE released_at IS NOT NULL")]
    for start in range(0, len(pending), batch):
        ids = pending[start : start + batch]
        # Duplicates: some ids twice, and some already released ones again.
        ids += rng.sample(ids, k=min(len(ids), 2))
        ids += rng.sample(done, k=min(len(done), 2))
        rng.shuffle(ids)
        r = session.post(
            url + "/api/v1/releases",
            json=[f"receipt:{oid}" for oid in ids],
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        stats["requests"] += 1
        r.raise_for_status()
        # The first answer is always lost (so every run exercises a retry), then a share.
        if stats["requests"] == 1 or rng.random() < drop:
            stats["dropped"] += 1  # the answer is lost: every event stays and is sent again
            continue
        conn.execute("BEGIN")
        for result in r.json()["results"]:
            oid = result["id"].removeprefix("receipt:")
            if result["status"] in ("released", "already_released"):
                record(conn, oid, result["released_at"])
            elif result["status"] == "not_delivered":
                stats["refused"] += 1
                conn.execute(
                    "UPDATE outbox SET due_at = ? WHERE object_id = ? AND done = 0",
                    (time.time() + 0.5, oid),
                )
            else:
                raise Conflict(f"{oid}: canner does not know it ({result['status']})")
        conn.execute("COMMIT")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--receipts", required=True)
    parser.add_argument("--batch", type=int, default=7)
    parser.add_argument("--drop", type=float, default=0.3)
    parser.add_argument("--early", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    conn = open_db(args.db)
    with open(args.receipts, encoding="utf-8") as f:
        add_jobs(conn, [line for line in f if line.strip()], args.early, rng)
    stats = {"requests": 0, "dropped": 0, "refused": 0}
    deadline = time.monotonic() + args.timeout
    with requests.Session() as session:
        try:
            while True:
                poll(conn, session, args.url)
                send(conn, session, args.url, args.token, args.batch, args.drop, rng, stats)
                left = conn.execute("SELECT count(*) FROM jobs WHERE released_at IS NULL")
                if left.fetchone()[0] == 0:
                    break
                if time.monotonic() > deadline:
                    print("hq_simulator: timed out with jobs unreleased", file=sys.stderr)
                    return 2
                time.sleep(0.2)
        except Conflict as e:
            print(f"hq_simulator: {e}", file=sys.stderr)
            return 3
    released = dict(conn.execute("SELECT object_id, released_at FROM jobs").fetchall())
    summary: dict[str, Any] = {"released": released, **stats}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
