"""What is in flight in ``uploads/``, found by name: the set-difference walk start-up, the survey
and the sweep's full pass share, and the sweep's tick that looks only at uploads it knows of.

Each walk is checked against the walk it replaced (a stat and a receipt lookup per entry,
copied here as it was) on a directory holding every kind of entry a data directory can."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from attrs import evolve
from twisted.internet.task import Clock

from canner import fs
from canner.blocking import run_inline
from canner.checksum import Checksum
from canner.config import parse_config
from canner.daemon.roots import receiver_start_up
from canner.ids import ObjectIds
from canner.observe import UploadObserver
from canner.store.journal import Journal
from canner.store.promises import (
    PACE_ENTRIES,
    Promises,
    open_uploads,
    unreceipted,
)
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.recovery import cut_after_restart
from canner.store.sweep import (
    FULL_PASS_EVERY,
    StaleSweep,
    remove_whole_files,
    sweep_stale,
    sweep_watched,
)
from canner.store.uploads import CorruptInfo, UploadDoor, UploadInfo, UploadStore

IDS = ObjectIds("node")
CHECKSUM = "blake3:" + "cd" * 32
SIZE = 100
NOW = 1_000_000.0
RETENTION = 1800.0


def _old_open_uploads(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds
) -> Iterator[tuple[str, UploadInfo | None]]:
    """``open_uploads`` as it was: every ``.info`` name stat'ed, a receipt looked up for each."""
    with os.scandir(uploads.directory) as it:
        names = [
            e.name[: -len(".info")]
            for e in it
            if e.name.endswith(".info") and not e.name.startswith(fs.TEMP_PREFIX)
        ]
    for upload_id in names:
        if not ids.is_valid(upload_id) or receipts.receipt_path(upload_id).exists():
            continue
        try:
            info = uploads.read_info(upload_id)
        except CorruptInfo:
            yield upload_id, None
            continue
        if info is not None and info.rejected is None:
            yield upload_id, info


def _info(upload_id: str, **changes: object) -> UploadInfo:
    info = UploadInfo(upload_id, SIZE, {"project": "example", "checksum": CHECKSUM}, 5, durable=0)
    return evolve(info, **changes)


def _upload(uploads: UploadStore, info: UploadInfo, stored: int, mtime: float = NOW) -> str:
    uploads.create(info)
    uploads.data_path(info.upload_id).write_bytes(b"x" * stored)
    for path in (uploads.data_path(info.upload_id), uploads.info_path(info.upload_id)):
        os.utime(path, (mtime, mtime))
    return info.upload_id


def _receipt(receipts: ReceiptStore, object_id: str) -> None:
    receipts.commit(Receipt(object_id, "https://i", Checksum("cd" * 32), SIZE, 7))
    receipts.write_origin(object_id, Origin("example", None))


def every_kind(root: Path) -> dict[str, str]:
    """A data directory with every kind of entry, by kind: ids (or names) of each."""
    (root / "uploads").mkdir(parents=True)
    (root / "receipts").mkdir()
    uploads, receipts = UploadStore(root / "uploads"), ReceiptStore(root / "receipts")
    kinds: dict[str, str] = {}
    # A tus upload in flight, its last bytes past its durable offset (a power cut's to cut).
    kinds["partial"] = _upload(uploads, _info(IDS.new(), durable=20), 60)
    kinds["idle partial"] = _upload(uploads, _info(IDS.new()), 10, mtime=NOW - 2 * RETENTION)
    kinds["complete"] = _upload(uploads, _info(IDS.new(), durable=SIZE), SIZE)
    kinds["rejected"] = _upload(uploads, _info(IDS.new(), rejected="bad checksum"), 0)
    kinds["untrusted"] = _upload(uploads, _info(IDS.new(), untrusted="fsync failed"), 50)
    kinds["whole file"] = _upload(uploads, _info(IDS.new(), door=UploadDoor.PUT), 30)
    kinds["bare id"] = _upload(uploads, _info(ObjectIds().new(), durable=5), 40)
    unreadable = kinds["unreadable"] = _upload(uploads, _info(IDS.new()), 10)
    uploads.info_path(unreadable).write_bytes(b"")  # what a power cut leaves of a creation
    data_only = kinds["data only"] = IDS.new()
    uploads.data_path(data_only).write_bytes(b"x" * 10)
    sidecar_only = kinds["sidecar only"] = _upload(uploads, _info(IDS.new()), 0)
    uploads.data_path(sidecar_only).unlink()
    accepted = kinds["accepted"] = _upload(uploads, _info(IDS.new(), durable=SIZE), SIZE)
    _receipt(receipts, accepted)
    # An acceptance that wrote the origin record and never committed: no receipt.
    uncommitted = kinds["origin, no receipt"] = _upload(uploads, _info(IDS.new()), SIZE)
    receipts.write_origin(uncommitted, Origin("example", None))
    purged = kinds["purged"] = IDS.new()
    _receipt(receipts, purged)
    kinds["receipt only"] = IDS.new()
    receipts.commit(Receipt(kinds["receipt only"], "https://i", Checksum("cd" * 32), SIZE, 7))
    kinds["temp in uploads"] = fs.write_temp(uploads.directory, "x.info", b"{", sync=False).name
    kinds["temp in receipts"] = fs.write_temp(receipts.directory, "y.json", b"{", sync=False).name
    kinds["not an id"] = "not-an-id"
    (uploads.directory / "not-an-id").write_bytes(b"")
    (uploads.directory / "not-an-id.info").write_bytes(b"{}")
    return kinds


def stores(root: Path) -> tuple[UploadStore, ReceiptStore]:
    return UploadStore(root / "uploads"), ReceiptStore(root / "receipts")


def test_open_uploads_by_name_yields_what_the_walk_per_entry_did(tmp_path: Path) -> None:
    """Every upload without a receipt and not rejected, with its sidecar (None: unreadable):
    the same pairs as the walk that stat'ed every entry and looked up a receipt for each."""
    kinds = every_kind(tmp_path)
    uploads, receipts = stores(tmp_path)

    found = list(open_uploads(uploads, receipts, IDS))

    assert sorted(found) == sorted(_old_open_uploads(uploads, receipts, IDS))
    assert {oid for oid, _ in found} == {
        kinds[k]
        for k in (
            "partial",
            "idle partial",
            "complete",
            "untrusted",
            "whole file",
            "bare id",
            "unreadable",
            "sidecar only",
            "origin, no receipt",
        )
    }
    assert dict(found)[kinds["unreadable"]] is None


def test_unreceipted_names_every_upload_without_a_receipt_and_the_temps(tmp_path: Path) -> None:
    """By name: an upload counts with its data file or its sidecar, an origin record is no
    receipt, and the temp files of both directories are listed (for the sweep)."""
    kinds = every_kind(tmp_path)
    uploads, receipts = stores(tmp_path)
    paced: list[None] = []

    found = unreceipted(uploads, receipts, IDS, lambda: paced.append(None))

    in_flight = {"partial", "idle partial", "complete", "rejected", "untrusted", "whole file"}
    in_flight |= {"bare id", "unreadable", "sidecar only", "origin, no receipt"}
    assert found.ids == {kinds[k] for k in in_flight | {"data only"}}
    assert found.sidecars == {kinds[k] for k in in_flight}
    assert sorted(p.name for p in found.temps) == sorted(
        [kinds["temp in uploads"], kinds["temp in receipts"]]
    )
    entries = len(os.listdir(uploads.directory)) + len(os.listdir(receipts.directory))
    assert len(paced) == entries // PACE_ENTRIES


def test_unreceipted_is_paced_every_so_many_entries(tmp_path: Path) -> None:
    """The full pass's listing calls ``pace`` once per PACE_ENTRIES entries of either folder."""
    uploads, receipts = stores(tmp_path)
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    for n in range(PACE_ENTRIES + 10):
        (receipts.directory / f"{n}.json").write_bytes(b"")
    for n in range(PACE_ENTRIES):
        (uploads.directory / f"{n}").write_bytes(b"")
    paced: list[None] = []

    unreceipted(uploads, receipts, IDS, lambda: paced.append(None))

    assert len(paced) == 2


def _old_start_up(root: Path) -> dict[str, tuple[int, int]]:
    """The start-up as it was: three walks of uploads/, each with its own sidecar reads."""
    uploads, receipts = stores(root)
    remove_whole_files(uploads, receipts, IDS)
    cut_after_restart(uploads, receipts, IDS, root, "another boot")
    promises = Promises.from_disk(uploads, receipts, IDS)
    return dict(promises._open)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "receiver.boot"
    }


def test_start_up_in_one_pass_leaves_what_the_three_walks_left(tmp_path: Path) -> None:
    """The whole files go, every upload in flight is cut to its durable offset (the boot
    changed), and the promises are the same; what it hands the sweep is every upload left
    without a receipt."""
    old, new = tmp_path / "old", tmp_path / "new"
    kinds = every_kind(old)
    shutil.copytree(old, new, symlinks=True)
    (new / "receiver.boot").write_text("another boot\n")
    raw = {"issuer": "https://i", "data_dir": str(new), "node_prefix": "node"}
    config = parse_config({**raw, "min_free_bytes": 1, "projects": {"example": {}}}, new)
    old_promises = _old_start_up(old)

    started = receiver_start_up(config, *stores(new))

    assert _tree(new) == _tree(old)
    assert dict(started.promises._open) == old_promises
    assert old_promises[kinds["partial"]] == (SIZE, 20)  # cut back to its durable offset
    assert kinds["whole file"] not in old_promises
    assert started.unreceipted == unreceipted(*stores(new), IDS).ids
    assert kinds["whole file"] not in started.unreceipted


class _Observer(UploadObserver):
    def __init__(self) -> None:
        self.removed = 0

    def stale_removed(self, count: int) -> None:
        self.removed += count


def _sweep(
    root: Path,
    promises: Promises,
    watched: frozenset[str] | None,
    adopting: Path | None = None,
    unreadable: frozenset[str] | None = None,
) -> StaleSweep:
    clock = Clock()
    clock.advance(NOW)
    uploads, receipts = stores(root)
    return StaleSweep(
        uploads=uploads,
        receipts=receipts,
        journal=Journal(root / "journal"),
        ids=IDS,
        retention=RETENTION,
        run=run_inline,
        clock=clock,
        observer=_Observer(),
        promises=promises,
        adopting=adopting,
        watched=watched,
        unreadable=unreadable,
        pace=lambda: None,
    )


def test_a_tick_removes_what_the_full_pass_removes_of_the_uploads_it_watches(
    tmp_path: Path,
) -> None:
    """Given every upload without a receipt, the tick (reading only idle sidecars, the
    unreadable one on the first tick after start) removes what the full pass removes, and
    keeps the rest watched."""
    full, tick = tmp_path / "full", tmp_path / "tick"
    every_kind(full)
    shutil.copytree(full, tick, symlinks=True)
    watched = unreceipted(*stores(tick), IDS).ids

    by_pass = sweep_stale(*stores(full), Journal(full / "journal"), IDS, NOW, RETENTION)
    by_tick = sweep_watched(*stores(tick), watched, lambda _: False, NOW, RETENTION, True)

    assert sorted(by_tick.removed) == sorted(by_pass.removed)
    assert by_tick.unreadable == by_pass.unreadable
    assert by_tick.left == by_pass.left == unreceipted(*stores(tick), IDS).ids
    # The temps wait for the full pass (they are not an hour old here either way).
    assert _tree(tick) == _tree(full)


def test_the_sweep_watches_uploads_admitted_since_start_and_not_the_ones_at_rest(
    tmp_path: Path,
) -> None:
    """A tick sees an upload admitted after start (and rejected, so its promise ended) once
    it is idle, not an upload that appeared on disk unannounced: that one waits for the hourly
    full pass.  An accepted upload, and one admitted whose files do not exist yet, are left."""
    uploads, receipts = stores(tmp_path)
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    promises = Promises()
    sweep = _sweep(tmp_path, promises, frozenset())
    rejected = _upload(uploads, _info(IDS.new(), rejected="bad"), 0, mtime=NOW - 2 * RETENTION)
    assert promises.admit(rejected, SIZE, 10**9, 0) is None
    promises.release(rejected)
    accepted = _upload(uploads, _info(IDS.new()), SIZE, mtime=NOW - 2 * RETENTION)
    promises.hold(accepted, SIZE, SIZE)
    _receipt(receipts, accepted)
    unannounced = _upload(uploads, _info(IDS.new()), 1, mtime=NOW - 2 * RETENTION)
    coming = IDS.new()
    assert promises.admit(coming, SIZE, 10**9, 0) is None

    sweep.sweep()

    remaining = set(os.listdir(uploads.directory))
    assert remaining == {accepted, f"{accepted}.info", unannounced, f"{unannounced}.info"}
    assert promises.holds(coming)
    _upload(uploads, _info(coming), 1, mtime=NOW - 2 * RETENTION)
    promises.release(coming)  # its request ended: only the watch list still knows it

    sweep._clock.advance(sweep.interval)  # type: ignore[attr-defined]
    sweep.sweep()
    assert not uploads.present(coming)
    assert uploads.present(unannounced)

    sweep._clock.advance(FULL_PASS_EVERY)  # type: ignore[attr-defined]
    sweep.sweep()
    assert not uploads.present(unannounced)
    assert uploads.present(accepted)


def test_a_sweep_without_a_watch_list_starts_with_a_full_pass(tmp_path: Path) -> None:
    """Built without start-up's list (a test, a tool), the first tick lists uploads/."""
    uploads, receipts = stores(tmp_path)
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    unannounced = _upload(uploads, _info(IDS.new()), 1, mtime=NOW - 2 * RETENTION)

    _sweep(tmp_path, Promises(), None).sweep()

    assert not uploads.present(unannounced)


def test_the_first_tick_after_start_up_removes_orphaned_temps_of_small_folders(
    tmp_path: Path,
) -> None:
    """What a crash left an hour ago in the rsync adoption area (a claim's temp file) and in
    journal/ goes at the first tick, so the intake finishes that claim at once; a temp file in
    uploads/ waits for the hourly full pass (listing uploads/ is what start-up spared)."""
    uploads, receipts = stores(tmp_path)
    for directory in (uploads.directory, receipts.directory, tmp_path / "journal"):
        directory.mkdir()
    adopting = tmp_path / "adopting"
    adopting.mkdir()
    old = NOW - 2 * fs.TEMP_ORPHAN_AGE
    temps = [
        adopting / f"{fs.TEMP_PREFIX}claim",
        tmp_path / "journal" / f"{fs.TEMP_PREFIX}segment",
        uploads.directory / f"{fs.TEMP_PREFIX}sidecar",
    ]
    for temp in temps:
        temp.write_bytes(b"cut short")
        os.utime(temp, (old, old))
    young = adopting / f"{fs.TEMP_PREFIX}live-claim"
    young.write_bytes(b"being written")
    os.utime(young, (NOW, NOW))
    sweep = _sweep(tmp_path, Promises(), frozenset(), adopting)

    sweep.sweep()
    assert [temp.exists() for temp in temps] == [False, False, True]
    assert young.exists()

    sweep._clock.advance(FULL_PASS_EVERY)  # type: ignore[attr-defined]
    sweep.sweep()
    assert not temps[2].exists()


def test_a_tick_looks_at_an_upload_again_only_once_it_could_be_stale(tmp_path: Path) -> None:
    """An upload a tick saw last changed at ``t`` is not looked at before ``t`` plus the
    retention: made to look stale on disk behind the receiver's back (its mtimes set back), it
    stays until then and goes at the first tick after."""
    uploads, receipts = stores(tmp_path)
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    written = NOW - RETENTION / 2
    upload_id = _upload(uploads, _info(IDS.new()), 10, mtime=written)
    promises = Promises()
    promises.hold(upload_id, SIZE, 10)
    sweep = _sweep(tmp_path, promises, frozenset({upload_id}))
    clock: Clock = sweep._clock  # type: ignore[attr-defined]
    sweep.sweep()  # the first tick reads it: not stale, looked at again from written + RETENTION
    assert uploads.present(upload_id)
    for path in (uploads.data_path(upload_id), uploads.info_path(upload_id)):
        os.utime(path, (NOW - 2 * RETENTION, NOW - 2 * RETENTION))

    while clock.seconds() + sweep.interval < written + RETENTION:
        clock.advance(sweep.interval)
        sweep.sweep()
        assert uploads.present(upload_id), clock.seconds()
    clock.advance(sweep.interval)
    sweep.sweep()
    assert not uploads.present(upload_id)
    assert not promises.holds(upload_id)


def test_the_first_tick_reads_only_the_sidecars_start_up_could_not_read(tmp_path: Path) -> None:
    """Start-up read every sidecar of the uploads in flight already: the first tick reads again
    only those it found unreadable (and removes them at once), not the ten thousand others; a
    sidecar damaged after start-up waits until its upload could be stale."""
    uploads, receipts = stores(tmp_path)
    uploads.directory.mkdir()
    receipts.directory.mkdir()
    found = _upload(uploads, _info(IDS.new()), 10)
    later = _upload(uploads, _info(IDS.new()), 10)
    uploads.info_path(found).write_text("not json")
    sweep = _sweep(tmp_path, Promises(), frozenset({found, later}), unreadable=frozenset({found}))
    uploads.info_path(later).write_text("not json")
    os.utime(uploads.info_path(later), (NOW, NOW))

    sweep.sweep()

    assert not uploads.present(found)
    assert uploads.present(later)
