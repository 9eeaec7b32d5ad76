"""HQ and canner end to end: the HQ simulator (``tests/hq_simulator.py``, its own process with an
outbox in SQLite) polls status and releases in shuffled batches with duplicates, premature
releases and dropped answers, over two rounds with a ledger flush after each; at the end every
released object has exactly one released_at and is in exactly one verified ledger at the fake
IA, whose lines are byte for byte what canner wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deliver_support import REPO, Env, envs
from hq_support import TOKEN, canner, ledger_tables, ledgers, local_lines, remote_lines

pytestmark = pytest.mark.e2e

env_factory = pytest.fixture(name="env_factory")(envs)

SIMULATOR = REPO / "tests" / "hq_simulator.py"


def run_simulator(env: Env, db: Path, receipts: list[bytes], seed: int) -> dict[str, Any]:
    path = db.with_suffix(f".{seed}.jsonl")
    path.write_bytes(b"".join(r + b"\n" for r in receipts))
    out = subprocess.run(
        [
            sys.executable,
            str(SIMULATOR),
            "--url",
            env.receiver.base_url,
            "--token",
            TOKEN,
            "--db",
            str(db),
            "--receipts",
            str(path),
            "--seed",
            str(seed),
            "--timeout",
            "150",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr + env.describe()
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def upload_round(env: Env, tag: str, count: int) -> dict[str, bytes]:
    receipts = {}
    for i in range(count):
        oid = env.upload(f"{tag} artifact {i}\n".encode() * (20 + 3 * i), filename=f"{tag}{i}.warc")
        receipts[oid] = env.receiver.request("GET", f"/api/v1/receipts/{oid}").content
    return receipts


def test_hq_simulator_releases_everything_into_exactly_one_ledger(
    env_factory: Callable[..., Env], tmp_path: Path
) -> None:
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.2, concurrency=4)
    db = tmp_path / "hq.sqlite"
    all_receipts: dict[str, bytes] = {}
    released: dict[str, float] = {}
    for seed, tag in ((1, "first"), (2, "second")):
        receipts = upload_round(env, tag, 12)
        all_receipts.update(receipts)
        summary = run_simulator(env, db, list(receipts.values()), seed)
        assert summary["requests"] > 0 and summary["dropped"] > 0
        for oid, at in summary["released"].items():
            assert released.setdefault(oid, at) == at, f"{oid} got two released_at values"
        assert set(summary["released"]) == set(all_receipts)
        # Purges run on their own schedule: the flush archives what is released and purged, a
        # later flush the rest (a ledger -2 of the same period).
        for _ in range(40):
            out = canner(env, "ledger", "flush", "--timeout", "60")
            assert out.returncode == 0, out.stdout + out.stderr
            rows = env.rows()
            if not set(receipts) & set(rows):
                break
            subprocess.run(["sleep", "0.5"], check=True)
        assert not set(all_receipts) & set(env.rows())
    done = ledgers(env)
    assert all(x["state"] == "done" and x["verified_at"] for x in done)
    found: Counter[str] = Counter()
    for ledger in done:
        lines = remote_lines(env.fake, ledger["identifier"], ledger["remote_name"])
        assert lines == local_lines(env, ledger["name"])
        assert len(lines) == ledger["records"]
        ids = [json.loads(line)["object_id"] for line in lines]
        assert ids == sorted(ids)
        for line, oid in zip(lines, ids, strict=True):
            found[oid] += 1
            assert line.startswith(all_receipts[oid][:-1] + b",")
            assert json.loads(line)["released_at"] == released[oid]
    assert found == Counter({oid: 1 for oid in all_receipts})
    # Every ledger at the fake IA is one canner knows as verified: none uploaded twice under
    # another name.
    at_fake = {
        (o["identifier"], o["name"]) for o in env.fake.objects() if o["name"].endswith(".jsonl.zst")
    }
    assert at_fake == {(x["identifier"], x["remote_name"]) for x in done}
