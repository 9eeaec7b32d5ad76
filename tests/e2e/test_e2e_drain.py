"""End to end: draining one node with ``canner drain`` while real receiver and deliver processes
run against the fake Internet Archive.

A drained node refuses creations (503 with Retry-After, also creation-with-upload), fails
``/readyz`` naming the drain, keeps taking PATCHes of its uploads in progress and delivering;
``canner status`` calls it retirable only once everything it accepted is delivered and verified;
the marker survives a SIGKILL and restart of the receiver; ``canner undrain`` ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from deliver_support import Env, canner_command, envs, make_checks_due_now, wait_for
from e2e_support import blake3_hex

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)


def canner(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return canner_command(config, *argv, timeout=30)


def status(env: Env) -> dict[str, Any]:
    done = canner(env.config, "status", "--json")
    assert done.returncode in (0, 1), done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_drained_node_finishes_its_uploads_delivers_and_becomes_retirable(
    env_factory: Any,
) -> None:
    """Creations are refused from the drain on; the upload in progress completes with its
    receipt and is delivered; status says retirable only after delivery and verification."""
    env: Env = env_factory()
    rcv = env.receiver
    data = os.urandom(300_000)
    delivered_before = env.upload(os.urandom(1000), filename="before.bin")
    oid = rcv.new_upload(data, filename="in-progress.bin")
    assert rcv.patch(oid, 0, data[:100_000]).status_code == 204

    done = canner(env.config, "drain", "--reason", "retiring this volume")
    assert done.returncode == 0, done.stderr
    assert "retiring this volume" in done.stdout

    refused = rcv.create(1000, blake3_hex(b"x" * 1000))
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "60"
    assert "draining" in refused.text and "retiring this volume" in refused.text
    with_body = rcv.create(3, blake3_hex(b"abc"), body=b"abc")
    assert with_body.status_code == 503
    ready = rcv.session.get(rcv.base_url + "/readyz", timeout=10)
    assert ready.status_code == 503
    assert any("retiring this volume" in r for r in ready.json()["reasons"])
    assert rcv.session.get(rcv.base_url + "/healthz", timeout=10).status_code == 200

    doc = status(env)
    assert doc["draining"]["reason"] == "retiring this volume"
    # Neither ok nor an alarm: the command and the page both say draining.
    assert doc["status"] == "draining", doc["reasons"]
    page = rcv.session.get(rcv.base_url + "/", timeout=10).text
    assert 'data-status="draining"' in page and "Nothing needs attention" not in page
    assert doc["retirement"]["retirable"] is False
    assert any("1 uploads in progress" in r for r in doc["retirement"]["remaining"])

    assert rcv.head(oid).status_code == 200
    r = rcv.patch(oid, 100_000, data[100_000:])
    assert r.status_code == 204, r.text
    rcv.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)

    def retirable() -> bool:
        make_checks_due_now(env.db)
        return bool(status(env)["retirement"]["retirable"])

    wait_for(retirable, 60, "the drained node to become retirable", 0.5, env.describe)
    rows = env.rows()
    assert {delivered_before, oid} <= set(rows)
    assert all(row["state"] == "delivered" and row["verified_at"] for row in rows.values())
    text = canner(env.config, "status").stdout
    assert "retirable: nothing here is undelivered" in text

    # The marker is on the node's volume: a crashed and restarted receiver is still drained.
    rcv.restart(signal.SIGKILL)
    assert rcv.create(1000, blake3_hex(b"x" * 1000)).status_code == 503
    assert rcv.session.get(rcv.base_url + "/readyz", timeout=10).status_code == 503

    assert canner(env.config, "undrain").returncode == 0
    assert rcv.session.get(rcv.base_url + "/readyz", timeout=10).status_code == 200
    again = os.urandom(2000)
    new_oid, receipt = rcv.upload_all(again)
    rcv.verify_receipt(receipt, new_oid, again)
    assert status(env)["draining"] is None
