"""End to end: a data directory whose ``delivery.sqlite`` is 8 KiB of random bytes, met by real
``twistd canner-deliver`` and ``canner-receiver`` processes and the real ``canner`` command.

Each of them names the recovery (docs/operator-guide.md, "Recover") in one line: deliver refuses
to start without a traceback, ``canner rebuild-index`` refuses and names ``--replace-damaged``,
which moves the damaged files aside (never deletes them) and rebuilds the index from receipts;
the receiver keeps accepting uploads (receipts are the commit point), so ``/readyz`` stays 200
while ``canner status`` says critical and ``canner_index_readable`` is 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from deliver_support import Env, envs, wait_for
from e2e_support import scrape
from hq_support import canner

pytestmark = pytest.mark.e2e
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

INDEX_FILES = ("delivery.sqlite", "delivery.sqlite-wal", "delivery.sqlite-shm")
# What every one-line refusal or warning names: the procedure and the command that runs it.
PROCEDURE = "canner rebuild-index --replace-damaged"


def damage_index(data_dir: Path) -> bytes:
    """Make ``delivery.sqlite`` 8 KiB of random bytes (no WAL or SHM beside it); returns them."""
    garbage = os.urandom(8192)
    for name in INDEX_FILES[1:]:
        (data_dir / name).unlink(missing_ok=True)
    (data_dir / "delivery.sqlite").write_bytes(garbage)
    return garbage


def upload_some(env: Env, count: int) -> list[str]:
    return [env.upload(os.urandom(20_000 + i), filename=f"f{i}.warc") for i in range(count)]


def deliver_refusal(env: Env) -> tuple[int, list[str]]:
    """Start canner-deliver, wait for it to end (it must refuse); its exit status and log lines."""
    env.deliver.proc = env.deliver.spawn()
    try:
        code = env.deliver.proc.wait(60)
    except subprocess.TimeoutExpired:
        env.deliver.kill()
        log = env.deliver.log_tail()
        raise AssertionError("canner-deliver started on a damaged index:\n" + log) from None
    return code, [line for line in env.deliver.current_log().splitlines() if line.strip()]


def test_a_damaged_index_is_named_with_its_recovery_and_rebuilt_on_request(
    env_factory: Callable[..., Env],
) -> None:
    """With the index 8 KiB of random bytes: deliver exits non-zero with one line naming the
    procedure and no traceback; the receiver logs the procedure, answers /readyz 200 and accepts
    an upload with a receipt while ``canner status`` is critical and ``canner_index_readable``
    0; ``canner rebuild-index`` refuses in one line naming ``--replace-damaged``, and with it
    moves the damaged files aside and brings every object back; deliver then starts."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    before = upload_some(env, 3)
    env.wait_state(before, 30, "the uploads to be indexed")
    env.deliver.stop()
    env.receiver.stop()
    garbage = damage_index(env.data_dir)

    code, lines = deliver_refusal(env)
    assert code != 0
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    named = [line for line in lines if PROCEDURE in line]
    assert len(named) == 1, "\n".join(lines)
    assert "delivery.sqlite" in named[0] and "Recover" in named[0], named[0]

    env.receiver.start()
    named = [line for line in env.receiver.log_text().splitlines() if PROCEDURE in line]
    assert len(named) == 1, env.receiver.log_tail()
    assert "deliver rescan" not in named[0], named[0]
    ready = requests.get(env.receiver.base_url + "/readyz", timeout=10)
    during, receipt = env.receiver.upload_all(os.urandom(30_000), filename="during.warc")
    assert receipt and (env.data_dir / "receipts" / f"{during}.json").exists()
    assert (ready.status_code, ready.json()["reasons"]) == (200, []), ready.text
    status = canner(env, "status", "--json")
    assert status.returncode == 2, status.stdout + status.stderr
    assert any(
        "delivery index unreadable" in r and PROCEDURE in r
        for r in json.loads(status.stdout)["reasons"]
    ), status.stdout
    metrics_url = env.receiver.base_url + "/metrics"
    assert scrape(metrics_url)[("canner_index_readable", frozenset())] == 0
    env.receiver.stop()

    refused = canner(env, "rebuild-index")
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "--replace-damaged" in refused.stderr, refused
    assert "Recover" in refused.stderr, refused.stderr
    assert (env.data_dir / "delivery.sqlite").read_bytes() == garbage

    rebuilt = canner(env, "rebuild-index", "--replace-damaged")
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    aside = [p for p in env.data_dir.iterdir() if p.name.startswith("delivery-damaged-")]
    assert [p.name.endswith(".sqlite") for p in aside] == [True], aside
    assert aside[0].read_bytes() == garbage, "the damaged index was not kept as it was"
    assert aside[0].name in rebuilt.stdout, rebuilt.stdout
    rows = env.rows()
    assert set(rows) == {*before, during}, rows
    assert all(row["state"] == "pending" for row in rows.values()), rows

    again = canner(env, "rebuild-index", "--replace-damaged")
    assert again.returncode == 0, again.stderr
    assert "not damaged" in again.stdout, again.stdout
    assert len([p for p in env.data_dir.iterdir() if p.name.startswith("delivery-")]) == 1

    env.receiver.start()
    env.deliver.start()
    env.wait_state([*before, during], 60, "every object delivered", state="delivered")


def test_the_replacement_is_refused_while_deliver_runs_and_for_a_sound_index(
    env_factory: Callable[..., Env],
) -> None:
    """``--replace-damaged`` refuses while canner-deliver holds deliver.lock, and moves nothing
    aside when the index is a readable database."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    ids = upload_some(env, 1)
    env.wait_state(ids, 30, "the upload to be indexed")
    refused = canner(env, "rebuild-index", "--replace-damaged")
    assert refused.returncode == 1 and "deliver.lock" in refused.stderr, refused.stderr
    env.deliver.stop()
    sound = canner(env, "rebuild-index", "--replace-damaged")
    assert sound.returncode == 0, sound.stderr
    assert not [p for p in env.data_dir.iterdir() if p.name.startswith("delivery-damaged-")]
    assert set(env.rows()) == set(ids)


def test_an_index_damaged_while_the_receiver_runs(env_factory: Callable[..., Env]) -> None:
    """The index damaged under a running receiver (deliver stopped): an upload is still
    receipted, the receiver's log names the procedure, /readyz stays 200 and
    ``canner_index_readable`` goes to 0; no traceback is logged."""
    env = env_factory(metadata_lag=0.0, retention="1h")
    ids = upload_some(env, 1)
    env.wait_state(ids, 30, "the upload to be indexed")
    env.deliver.stop()
    damage_index(env.data_dir)
    oid, receipt = env.receiver.upload_all(os.urandom(10_000), filename="late.warc")
    assert receipt and (env.data_dir / "receipts" / f"{oid}.json").exists()
    metrics_url = env.receiver.base_url + "/metrics"
    wait_for(
        lambda: scrape(metrics_url)[("canner_index_readable", frozenset())] == 0,
        30,
        "the metrics survey to see the damaged index",
    )
    wait_for(lambda: PROCEDURE in env.receiver.log_text(), 30, "the receiver to name the procedure")
    ready = requests.get(env.receiver.base_url + "/readyz", timeout=10)
    assert (ready.status_code, ready.json()["reasons"]) == (200, []), ready.text
    # One more survey and trend sample tick's worth of time: still no traceback.
    time.sleep(2)
    assert "Traceback" not in env.receiver.log_text(), env.receiver.log_tail()
    env.receiver.kill(signal.SIGTERM)
