"""``GET /readyz``: 503 with the reason while uploads would be refused; the floor watch logs
each crossing once."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.logger import LogPublisher, globalLogPublisher

from canner import fs
from canner.blocking import run_inline
from canner.daemon.site import ReceiverRoutes
from canner.ids import ObjectIds
from canner.ops.inventory import take_survey
from canner.ops.metrics import RECEIVER, Metrics
from canner.ops.problems import RecentProblems
from canner.ops.readiness import FloorWatch, check_readiness
from canner.ops.status_page import StatusSource
from canner.store.receipts import ReceiptStore
from tests.fakes import SyncIndex, succeeded


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    SyncIndex(tmp_path / "delivery.sqlite").close()
    return tmp_path


def readyz(data_dir: Path, floor: int) -> tuple[int, dict[str, Any]]:
    clock = Clock()
    status = StatusSource(
        run=run_inline,
        take=lambda now: take_survey(data_dir, ObjectIds(), now),
        clock=clock,
        problems=RecentProblems(),
        issuer="i",
        min_free_bytes=floor,
    )
    routes = ReceiverRoutes(
        ReceiptStore(data_dir / "receipts"),
        ObjectIds(),
        data_dir,
        run_inline,
        Metrics(RECEIVER),
        status,
        partial(check_readiness, data_dir, floor, FloorWatch(floor)),
    )
    response = succeeded(StubTreq(routes.app.resource()).get("http://localhost/readyz"))
    return response.code, json.loads(succeeded(response.content()))


def test_ready_when_uploads_would_be_accepted(data_dir: Path) -> None:
    """Space over the floor, writable directories, a readable index: 200."""
    code, doc = readyz(data_dir, 1)
    assert code == 200 and doc["status"] == "ready" and doc["reasons"] == []
    assert doc["free_bytes"] > 0


def test_not_ready_under_the_floor(data_dir: Path) -> None:
    """Under min_free_bytes the answer is 503 and says why, as the 429s would."""
    floor = fs.free_bytes(data_dir) + 10**15
    code, doc = readyz(data_dir, floor)
    assert code == 503 and doc["status"] == "not ready"
    assert any("free space under the floor" in r for r in doc["reasons"])


def test_not_ready_without_data_directories(data_dir: Path) -> None:
    """A missing receipts directory is named; an unreadable index beside it is not a reason."""
    os.rmdir(data_dir / "receipts")
    (data_dir / "delivery.sqlite").write_bytes(b"not a database at all" * 100)
    for extra in ("-wal", "-shm"):
        (data_dir / f"delivery.sqlite{extra}").unlink(missing_ok=True)
    code, doc = readyz(data_dir, 1)
    assert code == 503
    assert [r for r in doc["reasons"] if "receipts is missing or not writable" in r]
    assert len(doc["reasons"]) == 1, doc


def test_ready_with_a_damaged_index(data_dir: Path) -> None:
    """Uploads are accepted and receipted while the index is unreadable (receipts are the
    commit point), so /readyz says 200; the verdict reports the index."""
    (data_dir / "delivery.sqlite").write_bytes(os.urandom(8192))
    for extra in ("-wal", "-shm"):
        (data_dir / f"delivery.sqlite{extra}").unlink(missing_ok=True)
    code, doc = readyz(data_dir, 1)
    assert (code, doc["reasons"]) == (200, [])


def test_floor_crossing_and_recovery_are_logged_once_each() -> None:
    """However often free space is looked at, each change of side is one event."""
    seen: list[dict[str, Any]] = []
    publisher = LogPublisher()
    publisher.addObserver(seen.append)
    globalLogPublisher.addObserver(publisher)
    try:
        watch = FloorWatch(100)
        for available in (500, 500, 50, 40, 30, 200, 300, None, None, 150):
            watch.observe(available)
    finally:
        globalLogPublisher.removeObserver(publisher)
    texts = [e["log_format"] for e in seen if e.get("log_namespace") == "canner.ops.readiness"]
    assert len(texts) == 4
    assert "under the floor" in texts[0] and "back over the floor" in texts[1]
    assert "cannot be determined" in texts[2] and "back over the floor" in texts[3]
