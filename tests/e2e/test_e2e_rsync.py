"""End to end: the rsync intake with the real ``rsync`` client, a real ``rsync --daemon`` and real
``twistd`` daemons.

* seesaw's exact rsync command into ``rsync://<node>/<project>/<downloader>/`` -> adoption ->
  a receipt with the origin -> delivered by canner-deliver into a directory sink; the same file
  sent again by the same worker is the same object, by another worker a new one.
* A receiver SIGKILLed at each adoption step (``CANNER_CRASH_AT``) and restarted: nothing is
  lost, never two objects, and a copy sent again after the crash is still the same object;
  also when the kill lost the index row of a receipt (the receiver's start restores it).
* A file rsync is still writing (its temporary ``.<name>.XXXXXX``) is never adopted.
* ``--inplace``, ``--append`` and ``--partial`` are refused by the shipped module config.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import Deliver, DirectoryReceiver, deliveries, venv_bin, wait_for
from e2e_support import REPO, Receiver, blake3_hex, end_process, scrape
from rsync_support import RsyncDaemon, have_rsync, seesaw_rsync, seesaw_rsync_started

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not have_rsync(), reason="needs the rsync package (./dev test installs it)"),
]

# Receivers here scan every half second as well as listening to inotify: a test that waits for
# "not adopted" waits several rounds.
RSYNC_TABLE = {"scan_interval": "500ms"}
CRASH_POINTS = [
    "rsync.claim_written",
    "rsync.claimed",
    "rsync.moved",
    "rsync.staged",
    "rsync.stored",
    "rsync.accepted",
]
# The files a SIGKILL at each adoption step leaves (``{id}``: the object id the claim chose;
# ``{temp}``: the random part of a temp file's name), in incoming/, adopting/ and uploads/.
ITEM = "example/alice/item.warc.gz"
LEFTOVERS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "rsync.claim_written": ([ITEM], [".tmp-{id}.claim-{temp}"], []),
    "rsync.claimed": ([ITEM], ["{id}.claim"], []),
    "rsync.moved": ([], ["{id}", "{id}.claim"], []),
    "rsync.staged": ([], ["{id}", "{id}.claim"], ["{id}.info"]),
    "rsync.stored": ([], ["{id}.claim"], ["{id}", "{id}.info"]),
    "rsync.accepted": ([], ["{id}.claim"], ["{id}", "{id}.info"]),
}


@dataclass
class Stored:
    object_id: str
    receipt: dict[str, Any]
    origin: dict[str, Any]


def objects(data_dir: Path) -> list[Stored]:
    """Every receipt in the data directory, with its origin record."""
    found = []
    for path in sorted((data_dir / "receipts").glob("*.meta.json")):
        oid = path.name.removesuffix(".meta.json")
        receipt = data_dir / "receipts" / f"{oid}.json"
        if receipt.exists():
            found.append(
                Stored(oid, json.loads(receipt.read_bytes()), json.loads(path.read_bytes()))
            )
    return found


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if not p.is_dir())


def make_files(src: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    src.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, size in sizes.items():
        data = os.urandom(size)
        (src / name).write_bytes(data)
        made[name] = data
    return made


def check_object(stored: Stored, data: bytes, filename: str, downloader: str) -> None:
    assert stored.receipt["checksum"] == blake3_hex(data)
    assert stored.receipt["size_bytes"] == len(data)
    assert stored.origin["project"] == "example"
    assert stored.origin["filename"] == filename
    assert stored.origin["downloader"] == downloader


def assert_leftovers(data_dir: Path, expected: tuple[list[str], list[str], list[str]]) -> None:
    """incoming/, adopting/ and uploads/ hold exactly ``expected`` (see LEFTOVERS)."""
    found = [files_under(data_dir / d) for d in ("incoming", "adopting", "uploads")]
    names = [n for listing in found for n in listing]
    ids = {m.group(1) for n in names if (m := re.search(r"([0-9a-f]{32})", n))}
    assert len(ids) <= 1, f"two object ids among {found}"
    oid = ids.pop() if ids else "(none)"
    for listing, templates in zip(found, expected, strict=True):
        escaped = (re.escape(t).replace(re.escape("{id}"), oid) for t in templates)
        patterns = sorted(p.replace(re.escape("{temp}"), "[0-9a-f]{12}") for p in escaped)
        assert len(listing) == len(patterns), f"{found} is not {expected}"
        for name, pattern in zip(listing, patterns, strict=True):
            assert re.fullmatch(pattern, name), f"{found} is not {expected}"


def rsync_receiver(root: Path, cleanup: Callable[[Callable[[], Any]], None]) -> Receiver:
    rcv = Receiver.in_dir(root, rsync=RSYNC_TABLE)
    cleanup(rcv.close)
    return rcv


def rsync_daemon(rcv: Receiver, cleanup: Callable[[Callable[[], Any]], None]) -> RsyncDaemon:
    daemon = RsyncDaemon.for_config(rcv.config_path, rcv.root / "rsyncd")
    # The module directories are the receiver's to make (at its start); the daemon needs them.
    for project in ("example", "other"):
        (rcv.data_dir / "incoming" / project).mkdir(parents=True, exist_ok=True)
    daemon.start()
    cleanup(daemon.stop)
    return daemon


def rsync_waiting(rcv: Receiver) -> int:
    """``canner status --json``'s count of files waiting for adoption."""
    status = subprocess.run(
        [venv_bin("canner"), "status", "--json", "--config", str(rcv.config_path)],
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=False,
    )
    return int(json.loads(status.stdout)["rsync_waiting"])


def adopted_all(rcv: Receiver) -> bool:
    """Nothing waits in the incoming tree or the adoption area."""
    return not files_under(rcv.data_dir / "incoming") and not files_under(rcv.data_dir / "adopting")


def test_seesaw_rsync_upload_is_adopted_receipted_and_delivered(
    tmp_path: Path, cleanup: Callable[[Callable[[], Any]], None]
) -> None:
    """Files seesaw's rsync command uploads get receipts with their origin and are delivered;
    the same file again from the same worker is the same object, from another worker a new one."""
    archive = tmp_path / "archive"
    archive.mkdir()
    rcv = DirectoryReceiver.delivering_to(tmp_path / "node", archive)
    rcv.write_config(rsync=RSYNC_TABLE)
    cleanup(rcv.close)
    rcv.start()
    deliver = Deliver(rcv.config_path, rcv.data_dir, rcv.root / "deliver.log")
    cleanup(lambda: deliver.kill(signal.SIGTERM, 5))
    deliver.start()
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    sent = make_files(src, {"a.warc.gz": 300_000, "b.example.0123456789.warc.zst": 1_500})

    done = seesaw_rsync(src, sent, daemon.target("example", "alice"))
    assert done.returncode == 0, done.stderr.decode()

    stored = wait_for(
        lambda: len(objects(rcv.data_dir)) == 2 and objects(rcv.data_dir),
        20,
        "two receipts",
        describe=rcv.log_tail,
    )
    by_name = {s.origin["filename"]: s for s in stored}
    for name, data in sent.items():
        check_object(by_name[name], data, name, "alice")
    wait_for(lambda: adopted_all(rcv), 10, "incoming and adopting/ to empty")
    for name, data in sent.items():
        oid = by_name[name].object_id
        final = archive / f"example-{oid}" / name
        wait_for(final.exists, 60, f"{final} delivered", describe=deliver.log_tail)
        assert final.read_bytes() == data
        row = wait_for(lambda oid=oid: deliveries(rcv.config_path).get(oid), 30, "its row")
        assert row["project"] == "example"

    # The worker's retry after a lost exit status: the same object, nothing new.
    again = seesaw_rsync(src, ["a.warc.gz"], daemon.target("example", "alice"))
    assert again.returncode == 0, again.stderr.decode()
    wait_for(lambda: adopted_all(rcv), 10, "the copy to be adopted", describe=rcv.log_tail)
    assert len(objects(rcv.data_dir)) == 2
    assert "already accepted" in rcv.log_text()
    # Another worker's file of the same name and bytes is its own object.
    other = seesaw_rsync(src, ["a.warc.gz"], daemon.target("example", "bob"))
    assert other.returncode == 0, other.stderr.decode()
    wait_for(lambda: len(objects(rcv.data_dir)) == 3, 20, "bob's object")
    bobs = [s for s in objects(rcv.data_dir) if s.origin["downloader"] == "bob"]
    check_object(bobs[0], sent["a.warc.gz"], "a.warc.gz", "bob")

    metrics = scrape(f"{rcv.base_url}/metrics")
    assert metrics[("canner_rsync_adopted_total", frozenset({("project", "example")}))] == 3
    assert metrics[("canner_rsync_waiting_files", frozenset())] == 0
    assert rsync_waiting(rcv) == 0
    page = requests.get(f"{rcv.base_url}/", timeout=10).text
    assert re.search(r'data-field="rsync_waiting"><b>0</b>', page), "no backlog on the status page"


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_receiver_killed_at_each_adoption_step_loses_nothing_and_makes_one_object(
    point: str,
    tmp_path: Path,
    cleanup: Callable[[Callable[[], Any]], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL at an adoption step, then a restart: the file has exactly one object, and the
    same file sent again is still that object."""
    rcv = rsync_receiver(tmp_path / "node", cleanup)
    monkeypatch.setenv("CANNER_CRASH_AT", point)
    rcv.start()
    monkeypatch.delenv("CANNER_CRASH_AT")
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    sent = make_files(src, {"item.warc.gz": 200_000})

    done = seesaw_rsync(src, sent, daemon.target("example", "alice"))
    assert done.returncode == 0, done.stderr.decode()
    assert rcv.proc is not None
    wait_for(
        lambda: rcv.proc is not None and rcv.proc.poll() is not None,
        20,
        f"the receiver to die at {point}",
        describe=rcv.log_tail,
    )
    assert rcv.proc.returncode == -signal.SIGKILL
    # Before the restart: the bytes are somewhere canner will look, and the crash left exactly
    # the files of its step.
    where = files_under(rcv.data_dir / "incoming") + files_under(rcv.data_dir / "adopting")
    where += [f for f in files_under(rcv.data_dir / "uploads") if not f.endswith(".info")]
    assert where, f"the file vanished at {point}"
    assert_leftovers(rcv.data_dir, LEFTOVERS[point])
    assert rsync_waiting(rcv) == (0 if point == "rsync.accepted" else 1)
    if point == "rsync.claim_written":
        # Found an hour after the crash (a temp younger than that may be a live adoption's).
        temps = [p for p in (rcv.data_dir / "adopting").iterdir() if p.name.startswith(".tmp-")]
        for temp in temps:
            os.utime(temp, (time.time() - 2 * 3600,) * 2)

    rcv.start()
    wait_for(
        lambda: objects(rcv.data_dir), 20, "a receipt after the restart", describe=rcv.log_tail
    )
    wait_for(lambda: adopted_all(rcv), 10, "the claim to be finished", describe=rcv.log_tail)
    stored = objects(rcv.data_dir)
    assert len(stored) == 1, f"{len(stored)} objects after a crash at {point}"
    check_object(stored[0], sent["item.warc.gz"], "item.warc.gz", "alice")
    oid = stored[0].object_id
    assert files_under(rcv.data_dir / "uploads") == sorted([oid, f"{oid}.info"])
    stored_bytes = (rcv.data_dir / "uploads" / oid).read_bytes()
    assert stored_bytes == sent["item.warc.gz"]

    again = seesaw_rsync(src, sent, daemon.target("example", "alice"))
    assert again.returncode == 0, again.stderr.decode()
    wait_for(lambda: adopted_all(rcv), 10, "the copy to be adopted", describe=rcv.log_tail)
    assert [s.object_id for s in objects(rcv.data_dir)] == [oid]


def test_a_receipt_whose_index_row_a_kill_lost_is_still_the_object_after_a_restart(
    tmp_path: Path, cleanup: Callable[[Callable[[], Any]], None]
) -> None:
    """A SIGKILL after the claim went but before the index row was written leaves a receipt the
    index lacks; after a restart (canner-deliver not running, so no rescan helps) the same file
    sent again by the same worker is still that object, and the index has its row."""
    rcv = rsync_receiver(tmp_path / "node", cleanup)
    rcv.start()
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    sent = make_files(src, {"item.warc.gz": 200_000})
    assert seesaw_rsync(src, sent, daemon.target("example", "alice")).returncode == 0
    [stored] = wait_for(lambda: objects(rcv.data_dir), 20, "the receipt", describe=rcv.log_tail)
    oid = stored.object_id
    wait_for(lambda: adopted_all(rcv) and oid in deliveries(rcv.config_path), 20, "the row")
    assert rcv.kill() == -signal.SIGKILL
    # The disk as that kill leaves it: the receipt and its origin record, no claim, no row.
    with sqlite3.connect(rcv.data_dir / "delivery.sqlite", isolation_level=None) as db:
        db.execute("DELETE FROM outbound WHERE kind = 'object' AND ref = ?", (oid,))
        db.execute("DELETE FROM objects WHERE object_id = ?", (oid,))
    db.close()
    assert deliveries(rcv.config_path) == {}

    rcv.start()
    again = seesaw_rsync(src, sent, daemon.target("example", "alice"))
    assert again.returncode == 0, again.stderr.decode()
    wait_for(lambda: adopted_all(rcv), 10, "the copy to be adopted", describe=rcv.log_tail)
    assert [s.object_id for s in objects(rcv.data_dir)] == [oid], rcv.log_tail()
    assert files_under(rcv.data_dir / "uploads") == sorted([oid, f"{oid}.info"])
    assert deliveries(rcv.config_path)[oid]["downloader"] == "alice"


def test_a_file_rsync_is_still_writing_is_not_adopted(
    tmp_path: Path, cleanup: Callable[[Callable[[], Any]], None]
) -> None:
    """While rsync writes a file under its temporary name, scans and inotify leave it alone; once
    rsync renamed it into place it is adopted whole."""
    rcv = rsync_receiver(tmp_path / "node", cleanup)
    rcv.start()
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    sent = make_files(src, {"slow.warc.gz": 1_536_000})
    alice = rcv.data_dir / "incoming" / "example" / "alice"

    # 256 KiB/s: about six seconds of transfer.
    proc = seesaw_rsync_started(src, sent, daemon.target("example", "alice"), bwlimit="256")
    cleanup(lambda: end_process(proc, signal.SIGKILL, 5))
    temps = wait_for(
        lambda: alice.is_dir() and [p for p in alice.iterdir() if p.name.startswith(".slow")],
        10,
        "rsync's temporary file",
    )
    assert temps[0].name.startswith(".slow.warc.gz.")
    time.sleep(2.0)  # four scan rounds
    assert proc.poll() is None, "the transfer ended too early to watch"
    assert temps[0].exists(), "the temporary file was taken"
    assert objects(rcv.data_dir) == []
    assert files_under(rcv.data_dir / "adopting") == []

    assert proc.wait(60) == 0
    stored = wait_for(lambda: objects(rcv.data_dir), 10, "the receipt", describe=rcv.log_tail)
    check_object(stored[0], sent["slow.warc.gz"], "slow.warc.gz", "alice")


def test_options_that_expose_incomplete_files_are_refused(
    tmp_path: Path, cleanup: Callable[[Callable[[], Any]], None]
) -> None:
    """``--inplace``, ``--append`` and ``--partial`` make the shipped module refuse the transfer:
    rsync fails, and nothing reaches the incoming tree."""
    rcv = rsync_receiver(tmp_path / "node", cleanup)
    rcv.start()
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    sent = make_files(src, {"x.warc.gz": 10_000})
    for option in ("--inplace", "--append", "--partial"):
        refused = seesaw_rsync(src, sent, daemon.target("example", "alice"), extra=[option])
        assert refused.returncode != 0, f"{option} was accepted"
        assert f"refuse {option}" in refused.stderr.decode(), refused.stderr.decode()
    time.sleep(1.0)
    assert files_under(rcv.data_dir / "incoming") == []
    assert objects(rcv.data_dir) == []
