"""canner.sinks.directory: copies into place durably, never overwrites, verifies by re-reading."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import attrs
import blake3
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from twisted.internet import reactor as _reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure

from canner.blocking import run_inline
from canner.config import ConfigError, parse_config
from canner.delivery.index import ObjectRow
from canner.delivery.objects import located, plan_row
from canner.sinks.base import Delivered, DeliveryFailed, RemoteCheck
from canner.sinks.directory import (
    PARTIAL_PREFIX,
    DirectoryDelivery,
    DirectorySink,
    destination_root,
)
from canner.sinks.plan import ItemPlan

reactor: Any = _reactor
P = ParamSpec("P")
T = TypeVar("T")

OID = "0123456789abcdef0123456789abcdef"
ACCEPTED = 1784764800  # 2026-07-23 00:00:00 UTC


def delivery(path: str, **changes: Any) -> DirectoryDelivery:
    base = DirectoryDelivery(
        sink="directory",
        identifier="example-{object_id}",
        remote_name="{filename}",
        local_artifact_retention=60.0,
        path=path,
    )
    return attrs.evolve(base, **changes)


def plan_for(payload: Path, **changes: Any) -> ItemPlan:
    """The plan the scheduler sends for ``payload``'s row (the default templates)."""
    return plan_row(delivery("/unused"), row_for(payload, **changes))


def row_for(payload: Path, **changes: Any) -> ObjectRow:
    data = payload.read_bytes()
    base = ObjectRow(
        object_id=OID,
        project="example",
        filename="crawl.warc.gz",
        size_bytes=len(data),
        checksum="blake3:" + blake3.blake3(data).hexdigest(),
        accepted_at=ACCEPTED,
        state="delivering",
        attempts=1,
        next_attempt_at=0.0,
        last_error=None,
        needs_operator=0,
        content_md5=hashlib.md5(data).hexdigest(),
        remote_identifier=None,
        remote_name=None,
        delivered_at=None,
        verified_at=None,
        purge_after=None,
        purged_at=None,
        next_check_at=None,
        updated_at=0.0,
    )
    return attrs.evolve(base, **changes)


def fired(d: Deferred[Any]) -> Any:
    results: list[Any] = []
    d.addBoth(results.append)
    assert results, "the Deferred has not fired"
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


@attrs.define
class Setup:
    root: Path
    payload: Path
    clock: Clock
    data: bytes
    reported: list[int] = attrs.field(factory=list)

    def sink(self, run: Any = run_inline, hash: Any = run_inline, **kw: Any) -> DirectorySink:
        config = delivery(str(self.root.parent / "{project}"), **kw)
        return DirectorySink.for_delivery("example", config, run, hash, self.clock)

    @property
    def final(self) -> Path:
        return self.root / f"example-{OID}" / "crawl.warc.gz"


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    root = tmp_path / "example"
    root.mkdir()
    payload = tmp_path / "payload"
    data = os.urandom(5 << 20 | 123)
    payload.write_bytes(data)
    return Setup(root, payload, Clock(), data)


def test_copies_the_payload_under_identifier_and_remote_name(setup: Setup) -> None:
    """The copy lands at path/identifier/remote_name, byte-identical, with no partial file left."""
    result = fired(
        setup.sink().deliver(plan_for(setup.payload), setup.payload, setup.reported.append)
    )
    assert result == Delivered(f"example-{OID}", "crawl.warc.gz")
    assert setup.final.read_bytes() == setup.data
    assert sum(setup.reported) == len(setup.data), "every copied byte is reported"
    assert os.listdir(setup.final.parent) == ["crawl.warc.gz"]
    assert setup.clock.getDelayedCalls() == []


def test_remote_name_with_directories_is_created(setup: Setup) -> None:
    """A remote name with slashes creates the directories below the identifier."""
    sink = setup.sink(remote_name="{date}/{filename}")
    plan = plan_row(delivery("/unused", remote_name="{date}/{filename}"), row_for(setup.payload))
    result = fired(sink.deliver(plan, setup.payload, setup.reported.append))
    target = setup.root / result.identifier / result.remote_name
    assert result.remote_name == "20260723000000/crawl.warc.gz"
    assert target.read_bytes() == setup.data


def test_an_identical_file_is_not_copied_again(setup: Setup) -> None:
    """An existing file with the receipt's size and BLAKE3 counts as delivered, untouched."""
    setup.final.parent.mkdir()
    setup.final.write_bytes(setup.data)
    before = os.stat(setup.final)
    result = fired(
        setup.sink().deliver(plan_for(setup.payload), setup.payload, setup.reported.append)
    )
    assert result.remote_name == "crawl.warc.gz"
    after = os.stat(setup.final)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_different_file_is_flagged_never_overwritten(setup: Setup) -> None:
    """An existing file with other content fails the attempt for an operator and stays as is."""
    setup.final.parent.mkdir()
    setup.final.write_bytes(b"someone else's file")
    with pytest.raises(DeliveryFailed) as info:
        fired(setup.sink().deliver(plan_for(setup.payload), setup.payload, setup.reported.append))
    assert info.value.needs_operator
    assert "not overwriting" in info.value.reason
    assert setup.final.read_bytes() == b"someone else's file"


def test_a_stale_partial_file_is_replaced(setup: Setup) -> None:
    """A partial copy left by a killed attempt is replaced and never becomes the final name."""
    setup.final.parent.mkdir()
    partial = setup.final.parent / (PARTIAL_PREFIX + OID)
    partial.write_bytes(setup.data[:1000])
    fired(setup.sink().deliver(plan_for(setup.payload), setup.payload, setup.reported.append))
    assert setup.final.read_bytes() == setup.data
    assert not partial.exists()


def test_a_payload_of_the_wrong_size_is_not_copied(setup: Setup) -> None:
    """A local payload shorter than its receipt needs an operator; nothing is published."""
    row = plan_for(setup.payload)
    with open(setup.payload, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DeliveryFailed) as info:
        fired(setup.sink().deliver(row, setup.payload, setup.reported.append))
    assert info.value.needs_operator
    assert not setup.final.exists()
    assert os.listdir(setup.final.parent) == []


def test_a_destination_on_another_filesystem_than_at_start_gets_nothing(setup: Setup) -> None:
    """When path is no longer on the filesystem it was on at start-up (an unmounted NAS leaves
    its mount point), nothing is written and the attempt is retried."""
    config = delivery(str(setup.root.parent / "{project}"))
    moved = os.stat(setup.root).st_dev + 1
    sink = DirectorySink(config, setup.root, moved, run_inline, run_inline, setup.clock)
    with pytest.raises(DeliveryFailed) as info:
        fired(sink.deliver(plan_for(setup.payload), setup.payload, setup.reported.append))
    assert not info.value.needs_operator
    assert "unmounted?" in info.value.reason
    assert os.listdir(setup.root) == []


def test_a_missing_destination_root_is_never_created(setup: Setup) -> None:
    """A path that disappeared after start-up is an error for the attempt, not recreated."""
    sink = setup.sink()
    setup.root.rmdir()
    with pytest.raises(DeliveryFailed) as info:
        fired(sink.deliver(plan_for(setup.payload), setup.payload, setup.reported.append))
    assert not info.value.needs_operator
    assert not setup.root.exists()


def test_verify_re_reads_the_destination(setup: Setup) -> None:
    """Verification compares the destination's BLAKE3 with the receipt; tampering is flagged."""
    sink = setup.sink()
    row = plan_for(setup.payload)
    done = fired(sink.deliver(row, setup.payload, setup.reported.append))
    delivered = located(
        attrs.evolve(
            row_for(setup.payload),
            remote_identifier=done.identifier,
            remote_name=done.remote_name,
            state="delivered",
        )
    )
    assert fired(sink.verify(delivered)) == RemoteCheck(True)
    with open(setup.final, "r+b") as f:
        f.write(b"X")
    check = fired(sink.verify(delivered))
    assert not check.verified and check.needs_operator
    assert "differs from its receipt" in check.detail
    setup.final.unlink()
    check = fired(sink.verify(delivered))
    assert not check.verified and check.needs_operator and "missing" in check.detail


def test_no_progress_fails_the_attempt_and_stops_the_copy(setup: Setup) -> None:
    """A copy that makes no progress fails the attempt after no_progress_timeout (transient)."""
    jobs: list[tuple[Any, ...]] = []

    def stuck(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        jobs.append(args)
        return Deferred()

    sink = setup.sink(run=stuck)
    sink.no_progress_timeout = 30.0
    d = sink.deliver(plan_for(setup.payload), setup.payload, setup.reported.append)
    setup.clock.advance(29)
    assert not d.called
    setup.clock.advance(2)
    with pytest.raises(DeliveryFailed) as info:
        fired(d)
    assert "no copy progress for 30s" in info.value.reason
    assert not info.value.needs_operator
    stop = jobs[0][-1]
    assert isinstance(stop, threading.Event) and stop.is_set()
    assert setup.clock.getDelayedCalls() == []


def test_cancelling_stops_the_copy(setup: Setup) -> None:
    """Cancelling an attempt (shutdown) fails it with CancelledError and sets the copy's stop."""
    jobs: list[tuple[Any, ...]] = []

    def pending(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        jobs.append(args)
        return Deferred()

    d = setup.sink(run=pending).deliver(
        plan_for(setup.payload), setup.payload, setup.reported.append
    )
    d.cancel()
    with pytest.raises(CancelledError):
        fired(d)
    assert jobs[0][-1].is_set()
    assert setup.clock.getDelayedCalls() == []


@attrs.define
class RecordingRunner:
    """Runs jobs in the reactor's thread pool and records the thread of each."""

    threads: list[int] = attrs.field(factory=list)

    def __call__(self, f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        def job() -> T:
            self.threads.append(threading.get_ident())
            return f(*args, **kwargs)

        return deferToThread(job)


@pytest_twisted.ensureDeferred
async def test_copying_and_hashing_run_off_the_reactor_thread(tmp_path: Path) -> None:
    """Delivery and verification touch the disk only through the runners' threads."""
    root = tmp_path / "example"
    root.mkdir()
    payload = tmp_path / "payload"
    payload.write_bytes(os.urandom(1 << 20))
    run, hashing = RecordingRunner(), RecordingRunner()
    config = delivery(str(tmp_path / "{project}"))
    sink = DirectorySink.for_delivery("example", config, run, hashing, reactor)
    row = plan_for(payload)
    done = await sink.deliver(row, payload, lambda n: None)
    check = await sink.verify(
        attrs.evolve(row, identifier=done.identifier, remote_name=done.remote_name)
    )
    assert check.verified
    assert len(run.threads) == 1 and len(hashing.threads) == 2
    assert threading.get_ident() not in run.threads + hashing.threads


# --- configuration ---------------------------------------------------------------------------


def test_path_must_exist(tmp_path: Path) -> None:
    """A destination that does not exist refuses to start, naming the key."""
    with pytest.raises(ConfigError) as info:
        destination_root("example", delivery(str(tmp_path / "absent" / "{project}")))
    assert info.value.key == "projects.example.delivery.path"


def test_path_takes_only_the_project_placeholder(tmp_path: Path) -> None:
    """{object_id} and friends belong in identifier and remote_name, not in path."""
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, _table(str(tmp_path / "{object_id}")), "example")
    assert info.value.key == "projects.example.delivery.path"


def test_templates_follow_the_ia_rules(tmp_path: Path) -> None:
    """The identifier template is checked as for IA (here: no {object_id} anywhere)."""
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, _table(str(tmp_path), identifier="example-static"), "example")
    assert info.value.key == "projects.example.delivery.identifier"


def _table(path: str, **changes: Any) -> dict[str, Any]:
    """``delivery(path)`` as its TOML table."""
    table = {"sink": "directory", "path": path, "identifier": "example-{object_id}"}
    return {**table, "local_artifact_retention": "1m", **changes}


def _config(tmp_path: Path, table: dict[str, Any], project: str = "p") -> Any:
    raw = {
        "issuer": "http://127.0.0.1:8080",
        "data_dir": "data",
        "listen": "tcp:0:interface=127.0.0.1",
        "max_upload_bytes": 1 << 30,
        "min_free_bytes": 1 << 20,
        "projects": {project: {"delivery": table}},
    }
    return parse_config(raw, tmp_path)


def test_directory_table_parses_relative_to_the_config(tmp_path: Path) -> None:
    """path is resolved against the config file's directory; no credentials are needed."""
    table = {
        "sink": "directory",
        "path": "archive/{project}",
        "identifier": "x-{object_id}",
        "local_artifact_retention": "1m",
    }
    parsed = _config(tmp_path, table).projects["p"].delivery
    assert parsed.path == str(tmp_path / "archive" / "{project}")
    assert isinstance(parsed, DirectoryDelivery)


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"sink": "directory"}, "projects.p.delivery.path"),
        ({"sink": "directory", "path": "a", "credentials": "x"}, "projects.p.delivery.credentials"),
        ({"sink": "directory", "path": "a", "s3_url": "https://x"}, "projects.p.delivery.s3_url"),
        ({"sink": "internet_archive", "credentials": "x", "path": "a"}, "projects.p.delivery.path"),
    ],
)
def test_sink_specific_keys_name_the_key(tmp_path: Path, table: dict[str, Any], key: str) -> None:
    """Each sink's own keys are required by it and refused by the other."""
    full = {"identifier": "x-{object_id}", "local_artifact_retention": "1m", **table}
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, full)
    assert info.value.key == key
