"""The rsync intake: config, the rsyncd.conf templates, the incoming tree, and adoption through
the real acceptance over a real data directory (inline runners, a Clock, no inotify)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import blake3
import pytest
from attrs import define, field
from twisted.internet.task import Clock

from canner.accept.acceptance import Acceptance
from canner.accept.origins import AcceptedOrigins
from canner.blocking import run_inline
from canner.config import ConfigError, parse_config
from canner.doors.rsync.adoption import AdoptionArea, Claim, ClaimState, claim_state
from canner.doors.rsync.conf import GLOBAL_TEMPLATE, MODULE_TEMPLATE, rsyncd_conf
from canner.doors.rsync.incoming import Arrival, arrivals, count_waiting
from canner.doors.rsync.intake import RsyncIntake
from canner.ids import ObjectIds
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadStore
from tests.fakes import succeeded

REPO = Path(__file__).resolve().parents[2]
ISSUER = "https://canner.test"
START = 1784764800.0


def config(tmp_path: Path, **rsync: Any) -> dict[str, Any]:
    return {
        "issuer": ISSUER,
        "data_dir": "data",
        "min_free_bytes": 1,
        "rsync": rsync,
        "projects": {"example": {}, "other": {}},
    }


# -- config and rsyncd.conf ----------------------------------------------------------------------


def test_rsync_table_defaults_to_incoming_in_the_data_directory(tmp_path: Path) -> None:
    """``[rsync]`` with no keys: ``<data_dir>/incoming``, a 10 s scan, 64 connections."""
    parsed = parse_config(config(tmp_path), tmp_path).rsync
    assert parsed is not None
    assert parsed.incoming == (tmp_path / "data" / "incoming").resolve()
    assert (parsed.scan_interval, parsed.max_connections) == (10.0, 64)
    assert parse_config({**config(tmp_path), "rsync": None}, tmp_path).rsync is None


@pytest.mark.parametrize(
    ("rsync", "key"),
    [
        ({"scan_interval": "0s"}, "rsync.scan_interval"),
        ({"max_connections": 0}, "rsync.max_connections"),
        ({"incoming": ""}, "rsync.incoming"),
        ({"inplace": True}, "rsync.inplace"),
    ],
)
def test_bad_rsync_settings_are_refused(tmp_path: Path, rsync: dict[str, Any], key: str) -> None:
    """A bad ``[rsync]`` value is a config error naming its key."""
    with pytest.raises(ConfigError) as e:
        parse_config(config(tmp_path, **rsync), tmp_path)
    assert key in str(e.value)


def shipped(name: str) -> str:
    return (REPO / "conf" / "rsyncd" / name).read_text(encoding="utf-8")


def test_the_shipped_templates_make_one_refusing_module_per_project(tmp_path: Path) -> None:
    """Each project gets a module writing into its incoming directory, with max connections and
    the refused options; the lock file is in the runtime directory."""
    text = rsyncd_conf(
        shipped(GLOBAL_TEMPLATE),
        shipped(MODULE_TEMPLATE),
        projects=["example", "other"],
        incoming=Path("/var/lib/canner/incoming"),
        max_connections=7,
        runtime_dir=Path("/run/canner/rsyncd"),
    )
    assert "lock file = /run/canner/rsyncd/rsyncd.lock" in text
    assert "$" not in text
    modules = text.split("\n[")[1:]
    assert [m.split("]")[0] for m in modules] == ["example", "other"]
    for module, project in zip(modules, ["example", "other"], strict=True):
        assert f"path = /var/lib/canner/incoming/{project}\n" in module
        assert "max connections = 7\n" in module
        refused = next(
            line.split("=", 1)[1].split()
            for line in module.splitlines()
            if line.strip().startswith("refuse options")
        )
        assert {"inplace", "append", "append-verify", "partial", "partial-dir"} <= set(refused)


def test_an_unknown_placeholder_is_an_error() -> None:
    """A template naming a value the code does not fill cannot render."""
    with pytest.raises(KeyError):
        rsyncd_conf(
            "",
            "[$project]\n  x = $nope\n",
            projects=["p"],
            incoming=Path("/i"),
            max_connections=1,
            runtime_dir=Path("/r"),
        )


# -- the incoming tree ----------------------------------------------------------------------------


def test_only_final_names_of_regular_files_arrive(tmp_path: Path) -> None:
    """rsync's temporary names, ``.~tmp~/``, symlinks, unknown projects and deeper files are left
    alone; a file straight in the module has no downloader."""
    incoming = tmp_path / "incoming"
    alice = incoming / "example" / "alice"
    (alice / ".~tmp~").mkdir(parents=True)
    (alice / "done.warc.gz").write_bytes(b"x")
    (alice / ".done2.warc.gz.Ab12Cd").write_bytes(b"partial")
    (alice / ".~tmp~" / "held.warc.gz").write_bytes(b"held")
    (alice / "deeper").mkdir()
    (alice / "deeper" / "x.warc.gz").write_bytes(b"deep")
    (alice / "link.warc.gz").symlink_to(alice / "done.warc.gz")
    (incoming / "example" / "loose.warc.gz").write_bytes(b"yy")
    (incoming / "unknown").mkdir()
    (incoming / "unknown" / "x.warc.gz").write_bytes(b"z")
    found = sorted(arrivals(incoming, ["example", "other"]), key=lambda a: a.filename)
    assert [(a.project, a.downloader, a.filename, a.size) for a in found] == [
        ("example", "alice", "done.warc.gz", 1),
        ("example", None, "loose.warc.gz", 2),
    ]


# -- adoption -------------------------------------------------------------------------------------


@define
class Node:
    """A data directory with the receiver's stores, acceptance and rsync intake."""

    root: Path
    clock: Clock = field(factory=Clock)
    enqueued: list[tuple[Receipt, Origin]] = field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.clock.advance(START)
        for name in ("uploads", "receipts", "adopting", "incoming/example", "incoming/other"):
            (self.data / name).mkdir(parents=True, exist_ok=True)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def uploads(self) -> UploadStore:
        return UploadStore(self.data / "uploads")

    @property
    def receipts(self) -> ReceiptStore:
        return ReceiptStore(self.data / "receipts")

    @property
    def area(self) -> AdoptionArea:
        return AdoptionArea(self.data / "adopting")

    def intake(self, observer: Any = None) -> RsyncIntake:
        acceptance = Acceptance(
            uploads=self.uploads,
            receipts=self.receipts,
            run=run_inline,
            hash=run_inline,
            clock=self.clock,
            issuer=ISSUER,
            enqueue=lambda r, o: self.enqueued.append((r, o)),
            origins=AcceptedOrigins(receipts=self.receipts, run=run_inline),
        )
        return RsyncIntake(
            incoming=self.data / "incoming",
            projects=("example", "other"),
            area=self.area,
            uploads=self.uploads,
            receipts=self.receipts,
            acceptance=acceptance,
            run=run_inline,
            hash=run_inline,
            clock=self.clock,
            ids=ObjectIds(),
            interval=10.0,
            **({"observer": observer} if observer is not None else {}),
        )

    def arrive(self, name: str, data: bytes, downloader: str = "alice") -> Path:
        path = self.data / "incoming" / "example" / downloader / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def round(self) -> None:
        """One round of a started intake (a scan, as the periodic timer runs it)."""
        intake = self.intake()
        intake.startService()  # the first round runs at once, inline
        succeeded(intake.stopService())

    def objects(self) -> dict[str, tuple[Receipt, Origin]]:
        found = {}
        for oid in self.receipts.object_ids():
            receipt, origin = self.receipts.read(oid), self.receipts.read_origin(oid)
            assert receipt is not None and origin is not None
            found[oid] = (receipt, origin)
        return found

    def leftovers(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.data))
            for d in ("incoming", "adopting")
            for p in (self.data / d).rglob("*")
            if not p.is_dir()
        )


def b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def test_a_finished_file_becomes_an_object_with_its_origin(tmp_path: Path) -> None:
    """Adoption: a receipt over the stored bytes, the origin with the downloader, the upload in
    ``uploads/``, the incoming entry gone, one enqueue."""
    node = Node(tmp_path)
    node.arrive("a.warc.gz", b"payload")
    node.round()
    ((oid, (receipt, origin)),) = node.objects().items()
    assert str(receipt.checksum) == b3(b"payload") and receipt.size_bytes == 7
    assert origin == Origin("example", "a.warc.gz", "alice")
    assert (node.data / "uploads" / oid).read_bytes() == b"payload"
    assert node.leftovers() == []
    assert [r.object_id for r, _ in node.enqueued] == [oid]


def test_a_file_under_an_rsync_temporary_name_is_not_adopted(tmp_path: Path) -> None:
    """``.<name>.XXXXXX`` stays where it is and makes no object."""
    node = Node(tmp_path)
    node.arrive(".a.warc.gz.x1Y2z3", b"half")
    node.round()
    assert node.objects() == {}
    assert node.leftovers() == ["incoming/example/alice/.a.warc.gz.x1Y2z3"]


def test_the_same_file_again_from_the_same_worker_is_the_same_object(tmp_path: Path) -> None:
    """Same project, downloader, name, size and BLAKE3: no new object and the copy goes; from
    another worker it is a new object."""
    node = Node(tmp_path)
    intake = node.intake()
    intake.startService()
    node.arrive("a.warc.gz", b"payload")
    intake.kick()
    node.arrive("a.warc.gz", b"payload")
    intake.kick()
    assert len(node.objects()) == 1
    node.arrive("a.warc.gz", b"payload", downloader="bob")
    intake.kick()
    succeeded(intake.stopService())
    assert sorted(o.downloader or "" for _, o in node.objects().values()) == ["alice", "bob"]
    assert node.leftovers() == []


def test_an_empty_file_is_removed_without_an_object(tmp_path: Path) -> None:
    """Zero bytes: nothing to deliver, and the name does not wait for ever."""
    node = Node(tmp_path)
    node.arrive("empty.warc.gz", b"")
    node.round()
    assert node.objects() == {} and node.leftovers() == []


def claimed(node: Node, data: bytes) -> tuple[Claim, Arrival]:
    path = node.arrive("a.warc.gz", data)
    (arrival,) = arrivals(node.data / "incoming", ["example"])
    assert arrival.path == path
    return Claim("ab" * 16, "example", "alice", "a.warc.gz"), arrival


def test_recovery_finishes_a_claim_from_each_state(tmp_path: Path) -> None:
    """A claim left at each step by a crash ends as exactly one object with the claim's id (or,
    when the move never happened, one object for the file still in incoming)."""
    data = b"some bytes"
    for step in ("claimed", "moved", "staged", "stored", "receipted"):
        node = Node(tmp_path / step)
        claim, arrival = claimed(node, data)
        area = node.area
        if step == "claimed":
            (area.directory / f"{claim.object_id}.claim").write_bytes(claim.to_json())
            expected = ClaimState.UNMOVED
        else:
            assert area.claim(claim, arrival)
            expected = ClaimState.MOVED
        if step in ("staged", "stored", "receipted"):
            info = claim.upload_info(len(data), b3(data), int(START))
            if step == "staged":
                # The sidecar is written, the bytes not moved yet.
                (node.data / "uploads" / f"{claim.object_id}.info").write_bytes(info.to_json())
            else:
                area.stage(info, node.uploads)
                expected = ClaimState.STORED
        if step == "receipted":
            node.round()
            (area.directory / f"{claim.object_id}.claim").write_bytes(claim.to_json())
            node.enqueued.clear()
            expected = ClaimState.RECEIPTED
        assert claim_state(claim, area, node.uploads, node.receipts) is expected, step
        assert count_waiting(node.data / "incoming", ["example"], node.data) == (
            0 if step == "receipted" else 1
        ), step
        node.round()
        objects = node.objects()
        assert len(objects) == 1, step
        ((oid, (receipt, origin)),) = objects.items()
        if step != "claimed":
            assert oid == claim.object_id, step
        assert str(receipt.checksum) == b3(data) and origin.downloader == "alice", step
        assert node.leftovers() == [], step
        assert [r.object_id for r, _ in node.enqueued] == [oid], step
        assert count_waiting(node.data / "incoming", ["example"], node.data) == 0


def test_a_copy_sent_again_after_a_crash_past_the_commit_is_the_same_object(
    tmp_path: Path,
) -> None:
    """Recovery of a claim found committed remembers its origin: the re-sent copy is dropped even
    though no index knows the object."""
    node = Node(tmp_path)
    claim, arrival = claimed(node, b"bytes")
    node.area.claim(claim, arrival)
    node.area.stage(claim.upload_info(5, b3(b"bytes"), int(START)), node.uploads)
    node.round()  # accepted: the claim would be released here ...
    (node.area.directory / f"{claim.object_id}.claim").write_bytes(claim.to_json())  # ... crash
    intake = node.intake()
    intake.startService()  # recovery: the claim is found committed
    node.arrive("a.warc.gz", b"bytes")
    intake.kick()
    succeeded(intake.stopService())
    assert list(node.objects()) == [claim.object_id]
    assert node.leftovers() == []


def test_nothing_runs_after_stop(tmp_path: Path) -> None:
    """A stopped intake leaves no timer behind and ignores kicks."""
    node = Node(tmp_path)
    intake = node.intake()
    intake.startService()
    succeeded(intake.stopService())
    assert node.clock.getDelayedCalls() == []
    node.arrive("a.warc.gz", b"x")
    intake.kick()
    assert node.objects() == {}
    assert os.path.exists(node.data / "incoming" / "example" / "alice" / "a.warc.gz")


@define
class Backlog:
    """An adoption observer that records the waiting counts it is told."""

    waiting: list[int] = field(factory=list)
    projects: list[str] = field(factory=list)

    def adoption_waiting(self, count: int) -> None:
        self.waiting.append(count)

    def adopted(self, project: str, seconds: float | None) -> None:
        self.projects.append(project)


def test_a_claim_that_cannot_finish_keeps_counting_as_waiting(tmp_path: Path) -> None:
    """A claim whose upload cannot be read (a damaged sidecar) stays, is reported as waiting, and
    does not stop the files after it."""
    node = Node(tmp_path)
    claim, arrival = claimed(node, b"bytes")
    node.area.claim(claim, arrival)
    node.area.stage(claim.upload_info(5, b3(b"bytes"), int(START)), node.uploads)
    (node.data / "uploads" / f"{claim.object_id}.info").write_bytes(b"{damaged")
    node.arrive("b.warc.gz", b"other")
    backlog = Backlog()
    intake = node.intake(backlog)
    intake.startService()
    succeeded(intake.stopService())
    assert backlog.waiting == [2, 1]
    assert backlog.projects == ["example"]
    assert [o.filename for _, o in node.objects().values()] == ["b.warc.gz"]
    assert node.leftovers() == [f"adopting/{claim.object_id}.claim"]
