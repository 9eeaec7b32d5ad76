"""Draining a node: the durable marker, ``/readyz``, ``canner drain``/``undrain`` and when
``canner status`` calls a drained node retirable."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from twisted.internet.task import Clock

from canner.blocking import run_inline
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.ids import ObjectIds
from canner.ops.inventory import take_survey
from canner.ops.metrics import RECEIVER, Metrics, SurveyCache, SurveyCollector
from canner.ops.status_page import StatusView, render_status
from canner.store import drain
from canner.store.drain import DrainMark, retirement
from canner.store.uploads import UploadInfo, UploadStore
from tests.fakes import SyncIndex, succeeded
from tests.unit.test_cli import CHECKSUM, NOW, Run, oid
from tests.unit.test_readiness import data_dir, readyz

__all__ = ["data_dir"]  # the fixture, used by name


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


def test_drain_marker_is_durable_and_keeps_its_first_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draining writes the marker and fsyncs it and the data directory; a second drain keeps
    the first one's time and reason; undrain removes it."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    mark, new = drain.start_draining(tmp_path, 1000.0, "moving to bigger disks")
    assert new and mark == DrainMark(1000.0, "moving to bigger disks")
    assert str(tmp_path) in synced, "the data directory was not fsynced"
    assert any(".tmp-draining.json" in p for p in synced), "the marker was not fsynced"
    assert json.loads((tmp_path / "draining.json").read_text()) == {
        "since": 1000.0,
        "reason": "moving to bigger disks",
    }
    again, new = drain.start_draining(tmp_path, 2000.0, "other")
    assert not new and again == mark and drain.read_drain(tmp_path) == mark
    assert drain.stop_draining(tmp_path)
    assert drain.read_drain(tmp_path) is None
    assert not drain.stop_draining(tmp_path)


def test_an_unreadable_marker_still_drains(tmp_path: Path) -> None:
    """A damaged marker keeps the node drained (fail closed) and says so."""
    (tmp_path / "draining.json").write_bytes(b"\x00garbage")
    mark = drain.read_drain(tmp_path)
    assert mark is not None and "unreadable marker" in mark.describe()


def test_mark_description_names_time_and_reason() -> None:
    assert DrainMark(1_784_764_800.0, "disk swap").describe() == (
        "node draining since 2026-07-23T00:00:00Z: disk swap"
    )
    assert DrainMark(None, "").describe() == "node draining since an unknown time"


@pytest.mark.parametrize(
    ("active", "waiting", "missing", "retirable", "names"),
    [
        (0, 0, 0, True, []),
        (2, 0, 0, False, ["2 uploads in progress"]),
        (0, 3, 0, False, ["3 objects not yet delivered and verified"]),
        (0, 0, 4, False, ["4 receipts not yet in the delivery index"]),
        (0, None, None, False, ["cannot be read"]),
        (1, 1, 1, False, ["uploads in progress", "receipts not yet", "not yet delivered"]),
    ],
)
def test_retirable_only_when_nothing_is_left(
    active: int,
    waiting: int | None,
    missing: int | None,
    retirable: bool,
    names: list[str],
) -> None:
    """Retirable means no upload in progress, every receipt indexed, everything delivered and
    verified; otherwise each thing left is named."""
    found = retirement(active, waiting, missing)
    assert found.retirable is retirable
    assert len(found.remaining) == len(names)
    for text, name in zip(found.remaining, names, strict=True):
        assert name in text


def test_readyz_fails_while_draining(data_dir: Path) -> None:
    """A drained node answers /readyz 503 naming the drain; undrained it is ready again."""
    drain.start_draining(data_dir, NOW, "retiring n3")
    code, doc = readyz(data_dir, 1)
    assert code == 503
    assert doc["reasons"] == [
        "node draining since 2026-07-23T00:00:00Z: retiring n3 (new uploads go to other nodes)"
    ]
    drain.stop_draining(data_dir)
    assert readyz(data_dir, 1)[0] == 200


def _deliver_everything(run: Run, verified: bool) -> None:
    index = run.index()
    try:
        if not index.query("SELECT 1 FROM objects"):
            index.run(
                sql.insert_objects,
                [AcceptedObject(oid(n), "example", None, 10, CHECKSUM, 500) for n in (1, 2)],
                NOW - 100,
            )
        index.query(
            "UPDATE outbound SET state = 'delivered', delivered_at = ?, verified_at = ?"
            " WHERE kind = 'object'",
            NOW - 50,
            NOW - 40 if verified else None,
        )
    finally:
        index.close()


def test_drain_status_and_undrain_through_the_command(run: Run) -> None:
    """``canner drain`` is reported by ``canner status`` with what keeps the node from being
    retired, until every receipt is indexed, delivered and verified; ``undrain`` ends it."""
    run.receipt(1)
    run.receipt(2)
    run.index().close()
    code, out, _ = run("status", "--json")
    doc = json.loads(out)
    assert doc["draining"] is None and doc["retirement"] is None

    code, out, _ = run("drain", "--reason", "retiring")
    assert code == 0 and "node draining since 2026-07-23T00:00:00Z: retiring" in out
    code, out, _ = run("drain")
    assert code == 0 and out.startswith("already draining")

    code, out, err = run("status", "--json")
    doc = json.loads(out)
    assert code == 0, "draining by itself is no warning"
    # ... nor ok: its own status, worded as /readyz words it, with what keeps it from retiring.
    assert doc["status"] == "draining", doc["status"]
    assert doc["reasons"] == [
        "draining: node draining since 2026-07-23T00:00:00Z: retiring (new uploads go to other"
        " nodes); not retirable yet: 2 receipts not yet in the delivery index (canner-deliver's"
        " rescan adds them)"
    ]
    assert err == f"canner: {doc['reasons'][0]}\n"
    assert doc["draining"] == {
        "since": NOW,
        "since_utc": "2026-07-23T00:00:00Z",
        "reason": "retiring",
    }
    assert doc["retirement"]["retirable"] is False
    assert doc["retirement"]["remaining"] == [
        "2 receipts not yet in the delivery index (canner-deliver's rescan adds them)"
    ]

    _deliver_everything(run, verified=False)
    code, out, _ = run("status")
    assert "not retirable yet" in out
    assert "2 objects not yet delivered and verified" in out

    _deliver_everything(run, verified=True)
    code, out, err = run("status")
    assert "retirable: nothing here is undelivered" in out
    assert (
        code == 0
        and err.startswith("canner: draining: node draining since")
        and err.endswith(
            "(new uploads go to other nodes); retirable: nothing here is undelivered\n"
        )
    ), err
    assert json.loads(run("status", "--json")[1])["retirement"] == {
        "retirable": True,
        "remaining": [],
    }

    UploadStore(run.data_dir / "uploads").create(
        UploadInfo(oid(9), 10, {"project": "example", "checksum": CHECKSUM}, int(NOW))
    )
    code, out, _ = run("status")
    assert "1 uploads in progress" in out

    code, out, _ = run("undrain")
    assert code == 0 and "no longer draining" in out
    doc = json.loads(run("status", "--json")[1])
    assert doc["draining"] is None and doc["status"] == "ok"
    assert run("undrain")[1] == "not draining: nothing to do\n"


def test_drain_refuses_a_missing_data_dir(run: Run) -> None:
    """Without its data directory (an unmounted volume) drain says so and writes nothing."""
    os.rename(run.data_dir, run.root / "elsewhere")
    code, _, err = run("drain")
    assert code == 1 and "does not exist" in err
    assert not (run.data_dir / "draining.json").exists()


def test_status_page_and_gauges_say_draining_and_retirable(tmp_path: Path) -> None:
    """The status page's verdict names the drain and what is left; ``canner_draining`` and
    ``canner_retirable`` follow the marker and the index."""
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    index = SyncIndex(tmp_path / "delivery.sqlite")
    index.run(sql.insert_objects, [AcceptedObject(oid(1), "example", None, 10, CHECKSUM, 500)], NOW)
    clock = Clock()
    clock.advance(NOW)
    cache = SurveyCache(run_inline, lambda now: take_survey(tmp_path, ObjectIds(), now), clock)
    metrics = Metrics(RECEIVER)
    metrics.register(SurveyCollector(cache, 1))

    def gauges() -> tuple[float | None, float | None]:
        succeeded(cache.refresh())
        get = metrics.registry.get_sample_value
        return get("canner_draining"), get("canner_retirable")

    def page() -> str:
        survey = take_survey(tmp_path, ObjectIds(), NOW)
        return render_status(StatusView("i", survey, 1, ())).decode()

    assert gauges() == (0, 0) and "node draining" not in page()
    drain.start_draining(tmp_path, NOW, "disk swap")
    assert gauges() == (1, 0)
    assert re.search(
        r'data-level="draining">draining: node draining since [^<]*disk swap[^<]*not yet'
        r" delivered",
        page(),
    )
    index.query(
        "UPDATE outbound SET state = 'delivered', verified_at = ? WHERE kind = 'object'",
        NOW,
    )
    assert gauges() == (1, 1)
    assert "; retirable: nothing here is undelivered</li>" in page()
    index.close()


def test_the_status_page_of_a_drained_node_says_draining_not_ok(tmp_path: Path) -> None:
    """A drained node's page does not open with a green "OK, nothing needs attention" above its
    drain banner: its verdict is "Draining", with the drain's reason and whether the node is
    retirable; a warning on a drained node is still a warning, with the drain among its
    reasons."""
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    index = SyncIndex(tmp_path / "delivery.sqlite")
    index.run(sql.insert_objects, [AcceptedObject(oid(1), "example", None, 10, CHECKSUM, 500)], NOW)

    def verdict() -> str:
        survey = take_survey(tmp_path, ObjectIds(), NOW)
        page = render_status(StatusView("i", survey, 1, ())).decode()
        found = re.search(r'<section id="verdict".*?</section>', page, re.S)
        assert found is not None, page[:2000]
        return found.group(0)

    assert 'data-status="ok"' in verdict()
    drain.start_draining(tmp_path, NOW, "disk swap")
    section = verdict()
    assert 'data-status="draining"' in section, section
    assert ">Draining</h2>" in section and ">OK<" not in section, section
    assert "Nothing needs attention" not in section, section
    assert "node draining since 2026-07-23T00:00:00Z: disk swap" in section, section
    assert "not retirable yet: 1 objects not yet delivered and verified" in section, section
    index.query(
        "UPDATE outbound SET state = 'delivered', verified_at = ? WHERE kind = 'object'", NOW
    )
    assert "retirable: nothing here is undelivered" in verdict()
    index.query("UPDATE outbound SET needs_operator = 1 WHERE kind = 'object'")
    section = verdict()
    assert 'data-status="warning"' in section and "node draining since" in section, section
    index.close()
