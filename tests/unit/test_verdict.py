"""The one verdict (``canner.ops.verdict``): what ``canner status``, the status page's header and
``/readyz`` say about a node, from one implementation; and how the page shows it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs
from twisted.logger import Logger, LogPublisher

from canner.config import parse_config
from canner.delivery.index import ObjectRow
from canner.delivery.liveness import Heartbeat
from canner.ids import ObjectIds
from canner.ops.inventory import IndexSummary, Survey, take_survey
from canner.ops.problems import RecentProblems
from canner.ops.readiness import FloorWatch, check_readiness
from canner.ops.status_page import DeliveryTarget, StatusView, delivery_targets, render_status
from canner.ops.verdict import CRITICAL, OK, WARNING, assess, draining_reason
from canner.store.drain import DrainMark, Retirement

NOW = 1_784_764_800.0
IDS = ObjectIds()
OID = "ab" * 16


def row(**fields: object) -> ObjectRow:
    values: dict[str, object] = {
        "object_id": OID,
        "project": "example",
        "filename": "a.warc",
        "size_bytes": 5,
        "checksum": "blake3:" + "0" * 64,
        "accepted_at": 1,
        "state": "retry_wait",
        "attempts": 1,
        "next_attempt_at": NOW + 60,
        "last_error": "403 AccessDenied",
        "needs_operator": 0,
        "content_md5": None,
        "remote_identifier": None,
        "remote_name": None,
        "delivered_at": None,
        "verified_at": None,
        "purge_after": None,
        "purged_at": None,
        "next_check_at": None,
        "updated_at": NOW,
    }
    values.update(fields)
    return ObjectRow(**values)  # type: ignore[arg-type]


def survey(*, needs_operator: int = 0, beat_age: float | None = 1.0, **fields: object) -> Survey:
    beat = None if beat_age is None else Heartbeat(7, "1", NOW - 600, NOW - beat_age, None)
    index = IndexSummary(
        states={},
        state_bytes={},
        projects=(),
        oldest_undelivered_at=None,
        needs_operator=needs_operator,
        purge_overdue=0,
        oldest_purge_due=None,
        recent_failures=tuple(row(needs_operator=1) for _ in range(needs_operator)),
        heartbeat=beat,
    )
    base = Survey(taken_at=NOW, free_bytes=10**9, active_uploads=(), index=index)
    return attrs.evolve(base, **fields)


def test_ok_warning_critical_and_their_reasons() -> None:
    """Nothing wrong is ok; a delivery needing an operator is a warning; deliver not running is
    critical only where something delivers; the critical reasons come first."""
    assert assess(survey(), min_free_bytes=1, delivers=True).code == OK
    flagged = assess(survey(needs_operator=2), min_free_bytes=1, delivers=True)
    assert (flagged.code, flagged.status) == (WARNING, "warning")
    assert flagged.reasons == ("warning: 2 deliveries need an operator",)
    down = survey(needs_operator=1, beat_age=None)
    assert assess(down, min_free_bytes=1, delivers=False).code == WARNING
    found = assess(down, min_free_bytes=1, delivers=True)
    assert found.code == CRITICAL and found.reasons[0].startswith("critical: canner-deliver")
    assert found.reasons[1] == "warning: 1 deliveries need an operator"


def test_a_drained_node_is_draining_neither_ok_nor_an_alarm() -> None:
    """Draining is its own status with exit status 0 (no alarm); its reason is /readyz's words
    and the retirement; anything worse keeps its level, the drain still named last."""
    mark = DrainMark(NOW, "disk swap")
    drained = survey(draining=mark, retirement=Retirement(False, ("2 uploads in progress",)))
    found = assess(drained, min_free_bytes=1, delivers=True)
    assert (found.code, found.status) == (OK, "draining")
    assert found.reasons == (
        f"draining: {draining_reason(mark)}; not retirable yet: 2 uploads in progress",
    )
    worse = assess(attrs.evolve(drained, free_bytes=0), min_free_bytes=1, delivers=True)
    assert (worse.code, worse.status) == (CRITICAL, "critical")
    assert worse.reasons[-1] == found.reasons[0]
    assert assess(survey(), min_free_bytes=1, delivers=True).status == "ok"


def test_storage_reasons_are_readyz_reasons_word_for_word(tmp_path: Path) -> None:
    """A data directory without receipts/ and with an unreadable index: ``/readyz``'s reasons
    (:func:`check_readiness`) are exactly the verdict's first critical reasons; the verdict adds
    the index, which refuses no upload, with what to do about it."""
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    os.rmdir(tmp_path / "receipts")
    (tmp_path / "delivery.sqlite").write_bytes(b"not a database at all" * 100)
    ready = check_readiness(tmp_path, 1, FloorWatch(1))
    found = assess(take_survey(tmp_path, IDS, NOW), min_free_bytes=1, delivers=True)
    assert not ready.ready and len(ready.reasons) == 1
    assert found.reasons[:1] == tuple(f"critical: {r}" for r in ready.reasons)
    assert "receipts is missing or not writable" in ready.reasons[0]
    assert found.reasons[1:] == (
        "critical: delivery index unreadable: file is not a database: stop both daemons, run"
        " canner rebuild-index --replace-damaged (it moves delivery.sqlite* aside and rebuilds"
        " the index from receipts), start both (docs/operator-guide.md, Recover)",
    )
    floor = 10**18
    under = assess(take_survey(tmp_path, IDS, NOW), min_free_bytes=floor, delivers=True)
    ready = check_readiness(tmp_path, floor, FloorWatch(floor))
    # Free space is read twice, while other processes write to the same filesystem: the
    # sentences must be the same, the byte counts in them may have moved.
    assert _without_byte_counts(under.reasons[:2]) == _without_byte_counts(
        tuple(f"critical: {r}" for r in ready.reasons)
    )
    assert "free space under the floor" in under.reasons[0]


def _without_byte_counts(reasons: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(re.sub(r"\d+ bytes free", "N bytes free", r) for r in reasons)


def test_the_page_header_carries_the_verdict_and_what_needs_doing_above_the_charts() -> None:
    """The verdict and its reasons open the page; deliveries needing an operator and the
    latest failures come before the charts."""
    page = render_status(StatusView("i", survey(needs_operator=1), 1, (), delivers=True)).decode()
    assert re.search(r'<section[^>]*data-status="warning"', page)
    assert "<li" in page and "warning: 1 deliveries need an operator" in page
    positions = [page.index(f'id="{i}"') for i in ("verdict", "needs-operator", "trends")]
    assert positions == sorted(positions)
    assert page.index('id="delivery-failures"') < page.index('id="trends"')
    healthy = render_status(StatusView("i", survey(), 1, (), delivers=True)).decode()
    assert 'data-status="ok"' in healthy and 'id="needs-operator"' not in healthy


def test_errors_logged_while_starting_are_shown_once_and_counted() -> None:
    """What a starting receiver logs (twistd replays it once its log begins: counted once) is
    listed apart, above the charts, warns in the header, and the page never says there was no
    error since start."""
    problems = RecentProblems(starting=True)
    seen: list[dict[str, object]] = []
    publisher = LogPublisher()
    publisher.addObserver(problems.observe)
    publisher.addObserver(seen.append)
    Logger(namespace="canner.test", observer=publisher).error("index unusable")
    problems.observe(seen[0])
    assert len(problems.at_start()) == 1
    problems.started()
    assert problems.latest() == ()
    view = StatusView("i", survey(), 1, problems.latest(), at_start=problems.at_start())
    page = render_status(view).decode()
    assert 'data-status="warning"' in page
    assert "warning: the receiver logged 1 error while starting" in page
    assert page.index('id="at-start"') < page.index('id="trends"')
    assert "index unusable" in page and "No warnings or errors since start." not in page


def test_deliveries_link_to_ia_items_only_for_ia_projects() -> None:
    """An IA project's delivery links to its item; a directory sink's shows the file's path,
    and no archive.org link anywhere."""
    delivered = row(
        state="delivered",
        remote_identifier="example-" + OID,
        remote_name="a.warc",
        delivered_at=NOW - 5,
        verified_at=NOW - 4,
    )
    index = attrs.evolve(survey().index, recent_deliveries=(delivered,))
    view = StatusView(
        "i",
        attrs.evolve(survey(), index=index),
        1,
        (),
        targets={"example": DeliveryTarget(directory="/srv/archive/example")},
    )
    page = render_status(view).decode()
    assert f'<code class="path">/srv/archive/example/example-{OID}/a.warc</code>' in page
    assert "/details/" not in page and "archive.org" not in page
    ia = attrs.evolve(view, targets={"example": DeliveryTarget(item_url="https://ia.test/")})
    page = render_status(ia).decode()
    assert f'href="https://ia.test/details/example-{OID}"' in page


def test_delivery_targets_follow_each_projects_sink(tmp_path: Path) -> None:
    """A directory project gets its expanded root, an IA project its item page base, a
    project without delivery nothing."""
    (tmp_path / "keys").write_text("a\nb\n")
    (tmp_path / "archive" / "dirproj").mkdir(parents=True)
    config = parse_config(
        {
            "issuer": "https://canner.test",
            "data_dir": str(tmp_path),
            "min_free_bytes": 1,
            "projects": {
                "dirproj": {
                    "delivery": {
                        "sink": "directory",
                        "path": str(tmp_path / "archive" / "{project}"),
                        "identifier": "{project}-{object_id}",
                        "remote_name": "{object_id}",
                        "local_artifact_retention": "1h",
                    }
                },
                "iaproj": {
                    "delivery": {
                        "sink": "internet_archive",
                        "credentials": str(tmp_path / "keys"),
                        "identifier": "x-{object_id}",
                        "remote_name": "{object_id}",
                        "local_artifact_retention": "1h",
                        "metadata_url": "https://ia.test",
                    }
                },
                "local": {},
            },
        },
        tmp_path,
    )
    assert delivery_targets(config) == {
        "dirproj": DeliveryTarget(directory=str(tmp_path / "archive" / "dirproj")),
        "iaproj": DeliveryTarget(item_url="https://ia.test"),
    }
