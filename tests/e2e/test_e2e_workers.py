"""End to end: ``[receiver] workers = 2``, one canner-receiver node of a parent and two worker
processes serving its socket, against real ``twistd`` processes.

* tus, PUT (seesaw's curl) and rsync uploads are accepted, one receipt each; the same file by
  the same downloader through PUT and rsync (a worker and the parent) is one object;
* the promises of free space are the node's: the third creation is refused with creations on
  both workers;
* a stalled writer on one worker is taken over by a newer PATCH on the other;
* a worker SIGKILLed mid-upload is started again (the parent's log says so), the tus upload
  resumes with one receipt, a cut PUT leaves no file and no promise;
* SIGTERM to the parent ends every process, uploads in flight keep their durable offsets and
  resume after a start;
* a second receiver on the same data directory refuses to start, naming the one that runs.

Which worker answers a connection is the kernel's choice (both wait on the one socket): the
tests that need the other worker open fresh connections until the access log (one stream, each
line naming ``worker N pid P``) shows it, a bounded number of times.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests
from deliver_support import wait_for
from e2e_support import Receiver, blake3_hex, end_process, spawn_daemon
from rsync_support import have_rsync, seesaw_rsync
from test_e2e_backpressure import MIN_FREE, FreeSpace, small_fs  # noqa: F401 (a fixture)
from test_e2e_put_cut import data_files, open_put, wait_stored
from test_e2e_put_target import seesaw_curl
from test_e2e_rsync import (
    RSYNC_TABLE,
    adopted_all,
    check_object,
    make_files,
    objects,
    rsync_daemon,
)

pytestmark = pytest.mark.e2e

MiB = 1 << 20
TWO = {"workers": 2}
# How many fresh connections a test opens at most to reach the other worker.
TRIES = 40
ACCESS = re.compile(r"\[worker (\d+) pid (\d+)\] (\w+) (\S+) (\d+)")

T = TypeVar("T")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Receiver]:
    rcv = Receiver.in_dir(tmp_path / "node", receiver=TWO)
    try:
        rcv.start()
        wait_for(lambda: "all 2 workers serve" in rcv.log_text(), 30, "both workers to listen")
        yield rcv
    finally:
        rcv.close()


def served_by(
    rcv: Receiver, method: str, send: Callable[[], T], timeout: float = 10.0
) -> tuple[T, int]:
    """``send()`` and the worker whose access log line for ``method`` it caused (the first
    such line logged after the call began)."""
    before = len(rcv.log_text())
    result = send()
    deadline = time.monotonic() + timeout
    while True:
        for match in ACCESS.finditer(rcv.log_text()[before:]):
            if match.group(3) == method:
                return result, int(match.group(1))
        assert time.monotonic() < deadline, f"no access line for {method}:\n{rcv.log_tail()}"
        time.sleep(0.02)


def fresh(rcv: Receiver) -> requests.Session:
    """A session of its own: a new connection, so the kernel picks a worker again."""
    rcv.session.close()
    rcv.session = requests.Session()
    return rcv.session


def on_other_worker(rcv: Receiver, than: int, method: str, send: Callable[[], T]) -> T:
    """``send()`` again over fresh connections until a worker other than ``than`` answers it
    (``send`` must be harmless to repeat)."""
    for _ in range(TRIES):
        fresh(rcv)
        result, worker = served_by(rcv, method, send)
        if worker != than:
            return result
    raise AssertionError(f"worker {than} answered all {TRIES} fresh connections")


def worker_pids(rcv: Receiver) -> set[int]:
    assert rcv.proc is not None
    out = subprocess.run(
        ["pgrep", "-P", str(rcv.proc.pid)], capture_output=True, text=True, check=False
    ).stdout
    return {int(p) for p in out.split()}


def wait_gone(pids: set[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


# -- the doors ------------------------------------------------------------------------------------


def test_tus_and_put_uploads_on_both_workers_get_one_receipt_each(
    node: Receiver, tmp_path: Path
) -> None:
    seen: set[int] = set()
    ids = []
    for n in range(TRIES):
        data = random.Random(n).randbytes(200_000 + n)
        fresh(node)
        (oid, receipt), worker = served_by(node, "PATCH", partial(node.upload_all, data))
        node.verify_receipt(receipt, oid, data)
        ids.append(oid)
        seen.add(worker)
        if len(seen) == 2 and n >= 3:
            break
    assert seen == {1, 2}, f"only worker {seen} answered"
    item = tmp_path / "item-1.example.0123456789.warc.zst"
    item.write_bytes(os.urandom(300_000))
    target = f"{node.base_url}/seesaw/example/alice/{item.name}"
    done = seesaw_curl(item, target)
    assert done.returncode == 0, done.stderr.decode()
    on_disk = node.receipt_ids_on_disk()
    assert set(ids) <= set(on_disk) and len(on_disk) == len(ids) + 1, "one receipt per upload"


def _sample(text: str, name: str) -> float:
    """The value of the one sample ``name`` (with its labels as written) in metrics ``text``."""
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
    ]
    assert len(values) == 1, (name, values)
    return values[0]


def test_the_node_has_one_view_whichever_worker_answers(node: Receiver) -> None:
    """/metrics adds up the uploads both workers accepted, and /readyz and the status page are
    the parent's (the same answer from either worker), counting the workers."""
    seen: set[int] = set()
    accepted = 0
    for n in range(TRIES):
        fresh(node)
        _, worker = served_by(node, "PATCH", partial(node.upload_all, os.urandom(10_000 + n)))
        seen.add(worker)
        accepted += 1
        if len(seen) == 2 and n >= 3:
            break
    assert seen == {1, 2}, f"only worker {seen} answered"
    metrics, via = set(), set()
    for _ in range(TRIES):
        got, worker = served_by(node, "GET", lambda: fresh(node).get(f"{node.base_url}/metrics"))
        assert got.status_code == 200
        text = got.text
        metrics.add(_sample(text, 'canner_uploads_accepted_total{project="example"}'))
        assert _sample(text, "canner_receiver_workers_running") == 2
        via.add(worker)
        if len(via) == 2:
            break
    assert metrics == {accepted}, "both workers' /metrics count every upload of the node"
    ready = fresh(node).get(f"{node.base_url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["workers"] == {"configured": 2, "running": 2, "restarts": 0}
    page = fresh(node).get(f"{node.base_url}/")
    assert page.status_code == 200 and "2 of 2 workers" in page.text


@pytest.mark.skipif(not have_rsync(), reason="needs the rsync package (./dev test installs it)")
def test_rsync_and_put_of_the_same_file_are_one_object_across_the_node(
    tmp_path: Path, cleanup: Callable[[Callable[[], Any]], None]
) -> None:
    """The parent adopts rsync'd files, a worker takes the PUT: the origin memory is the
    node's, so the same file from the same downloader is one object whichever way it came."""
    rcv = Receiver.in_dir(tmp_path / "node", receiver=TWO, rsync=RSYNC_TABLE)
    cleanup(rcv.close)
    rcv.start()
    daemon = rsync_daemon(rcv, cleanup)
    src = tmp_path / "item"
    name = "b.example.0123456789.warc.zst"
    sent = make_files(src, {name: 50_000})
    done = seesaw_rsync(src, sent, daemon.target("example", "alice"))
    assert done.returncode == 0, done.stderr.decode()
    stored = wait_for(
        lambda: objects(rcv.data_dir), 20, "the rsync'd object", describe=rcv.log_tail
    )
    check_object(stored[0], sent[name], name, "alice")
    wait_for(lambda: adopted_all(rcv), 10, "incoming to empty")
    for _ in range(3):  # on whichever workers answer
        fresh(rcv)
        put = seesaw_curl(src / name, f"{rcv.base_url}/seesaw/example/alice/{name}")
        assert put.returncode == 0, put.stderr.decode()
    assert [s.object_id for s in objects(rcv.data_dir)] == [stored[0].object_id]


# -- promises -------------------------------------------------------------------------------------

PROMISED = 4 << 20


def test_the_third_creation_is_refused_across_workers(
    small_fs: Path,  # noqa: F811 (the fixture)
    make_receiver: Callable[..., Receiver],
) -> None:
    """Room for two and a half uploads: two creations (on both workers) take it, the third is
    refused whichever worker it reaches; the two complete with receipts, and then there is room."""
    rcv = make_receiver(data_dir=small_fs / "data", min_free_bytes=MIN_FREE, receiver=TWO)
    wait_for(lambda: "all 2 workers serve" in rcv.log_text(), 30, "both workers to listen")
    space = FreeSpace(small_fs)
    files = [random.Random(n).randbytes(PROMISED) for n in range(3)]
    space.set(MIN_FREE + 2 * PROMISED + PROMISED // 2)
    fresh(rcv)
    first, worker = served_by(rcv, "POST", lambda: rcv.new_upload(files[0]))
    # The second on the other worker: refusals of it are not harmless to repeat, so open
    # connections until the other worker answers a HEAD, then create over that connection.
    for _ in range(TRIES):
        fresh(rcv)
        _, other = served_by(rcv, "HEAD", lambda: rcv.head(first))
        if other != worker:
            break
    assert other != worker, "the second worker never answered"
    second, on = served_by(rcv, "POST", lambda: rcv.new_upload(files[1]))
    assert on == other
    for _ in range(4):
        fresh(rcv)
        refused = rcv.create(PROMISED, blake3_hex(files[2]))
        assert refused.status_code == 503, refused.status_code
        assert "promised to 2 uploads in flight" in refused.text, refused.text
    for oid, data in ((first, files[0]), (second, files[1])):
        fresh(rcv)
        done = rcv.patch(oid, 0, data)
        assert done.status_code == 204, (done.status_code, done.text)
        rcv.verify_receipt(done.headers.get("Artifact-Receipt"), oid, data)
    # Nothing is promised any more: room for one upload is room for one upload.
    space.set(MIN_FREE + PROMISED + PROMISED // 2)
    fresh(rcv)
    assert rcv.create(PROMISED, blake3_hex(files[2])).status_code == 201


# -- takeover -------------------------------------------------------------------------------------


def test_a_stalled_writer_on_one_worker_is_taken_over_from_the_other(node: Receiver) -> None:
    data = random.Random(7).randbytes(3 * MiB + 5)
    oid = node.new_upload(data)
    first = MiB + 17
    for _ in range(TRIES):
        before = len(node.log_text())
        stalled = node.open_patch(oid, 0, len(data), data[:first])
        with stalled:
            assert node.wait_offset(oid, first) == first
            # The stalled PATCH logs nothing until it ends: its worker is the one that answered
            # nothing since; ask which one holds it by HEADs from the other worker.
            r = on_other_worker_than_holder(node, oid, before, first, data)
            if r is None:
                continue
            assert r.status_code == 204, (r.status_code, r.text)
        node.verify_receipt(r.headers.get("Artifact-Receipt"), oid, data)
        assert "a newer request takes over" in node.log_text()
        return
    raise AssertionError("never got the PATCH onto the other worker")


def on_other_worker_than_holder(
    rcv: Receiver, oid: str, before: int, first: int, data: bytes
) -> requests.Response | None:
    """The resuming PATCH, sent over a connection answered by the worker that does not hold the
    stalled one (found by the HEADs each worker answers: the holder's HEAD takes nothing over
    and reports the live offset, as does the other's; the worker pids of the stalled PATCH's
    connection are read from /proc).  None when no such connection came."""
    holder = _holder_pid(rcv)
    for _ in range(TRIES):
        fresh(rcv)
        # Not a HEAD: on the holder it would take the stalled writer over itself.
        _, worker = served_by(rcv, "GET", lambda: rcv.request("GET", "/healthz"))
        if _pid_of(rcv, worker) != holder:
            return rcv.patch(oid, first, data[first:])
    return None


def _pid_of(rcv: Receiver, worker: int) -> int:
    pids = {int(m.group(1)): int(m.group(2)) for m in ACCESS.finditer(rcv.log_text())}
    return pids[worker]


def _holder_pid(rcv: Receiver) -> int:
    """The worker process holding the upload's lock (``/proc/locks``' flock holder)."""
    pids = worker_pids(rcv)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "FLOCK" in parts and int(parts[4]) in pids:
                # the receiver.lock flock is the parent's pid: only uploads' locks name a worker
                return int(parts[4])
        time.sleep(0.05)
    raise AssertionError("no worker holds an upload lock")


# -- a worker dies --------------------------------------------------------------------------------


def _busy_worker(rcv: Receiver) -> int:
    return _holder_pid(rcv)


def test_a_worker_killed_mid_upload_is_restarted_and_the_upload_resumes(node: Receiver) -> None:
    data = random.Random(9).randbytes(3 * MiB)
    oid = node.new_upload(data)
    first = MiB
    with node.open_patch(oid, 0, len(data), data[:first]):
        assert node.wait_offset(oid, first) == first
        victim = _busy_worker(node)
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: "ended unasked (killed by SIGKILL)" in node.log_text(),
            10,
            "the parent to see it",
        )
    wait_for(
        lambda: "restarted (pid" in node.log_text(),
        30,
        "the worker to be restarted",
        describe=node.log_tail,
    )
    assert len(worker_pids(node)) == 2 and victim not in worker_pids(node)
    fresh(node)
    offset = node.offset(oid)
    assert 0 <= offset <= first
    done = node.patch(oid, offset, data[offset:])
    assert done.status_code == 204, (done.status_code, done.text)
    node.verify_receipt(done.headers.get("Artifact-Receipt"), oid, data)
    assert node.receipt_ids_on_disk() == [oid]


def test_a_put_cut_by_a_worker_kill_leaves_no_file_and_no_promise(
    small_fs: Path,  # noqa: F811 (the fixture)
    make_receiver: Callable[..., Receiver],
) -> None:
    rcv = make_receiver(data_dir=small_fs / "data", min_free_bytes=MIN_FREE, receiver=TWO)
    wait_for(lambda: "all 2 workers serve" in rcv.log_text(), 30, "both workers to listen")
    space = FreeSpace(small_fs)
    size = 8 * MiB
    data = random.Random(3).randbytes(size)
    with open_put(rcv, size, data[: 2 * MiB]):
        wait_stored(rcv, 2 * MiB)
        os.kill(_busy_worker(rcv), signal.SIGKILL)
        wait_for(
            lambda: "whole files without a receipt removed" in rcv.log_text(),
            20,
            "the parent to settle the worker's uploads",
            describe=rcv.log_tail,
        )
    assert data_files(rcv) == []
    # Nothing is promised to it: room for exactly one more upload of that size is enough.
    space.set(MIN_FREE + size + MiB)
    wait_for(lambda: "restarted (pid" in rcv.log_text(), 30, "the worker to be restarted")
    fresh(rcv)
    put = requests.put(f"{rcv.base_url}/seesaw/example/alice/x.warc.zst", data=data, timeout=60)
    assert put.status_code == 201, (put.status_code, put.text)


# -- the parent stops, or a second one starts ------------------------------------------------


def test_sigterm_of_the_parent_ends_every_process_and_uploads_resume(node: Receiver) -> None:
    data = random.Random(11).randbytes(2 * MiB)
    oid = node.new_upload(data)
    pids = worker_pids(node)
    assert len(pids) == 2
    with node.open_patch(oid, 0, len(data), data[:MiB]):
        assert node.wait_offset(oid, MiB) == MiB
        assert node.stop() == -signal.SIGTERM, node.log_tail()
    wait_gone(pids)
    node.start()
    offset = node.offset(oid)
    assert offset == MiB, "the durable offset was not recorded at the stop"
    done = node.patch(oid, offset, data[offset:])
    assert done.status_code == 204
    node.verify_receipt(done.headers.get("Artifact-Receipt"), oid, data)


def test_a_parent_killed_takes_its_workers_with_it(node: Receiver) -> None:
    """SIGKILL to the parent: each worker notices (its channel closes; PR_SET_PDEATHSIG) and
    stops, so the data directory's lock goes and the node starts again."""
    data = random.Random(12).randbytes(2 * MiB)
    oid = node.new_upload(data)
    pids = worker_pids(node)
    assert node.kill(signal.SIGKILL) == -signal.SIGKILL
    wait_gone(pids)
    node.start()
    offset = node.offset(oid)
    done = node.patch(oid, offset, data[offset:])
    assert done.status_code == 204, (done.status_code, done.text)
    node.verify_receipt(done.headers.get("Artifact-Receipt"), oid, data)


def test_a_second_receiver_on_the_data_dir_refuses_naming_the_node(
    node: Receiver, tmp_path: Path
) -> None:
    other = Receiver.in_dir(tmp_path / "second", data_dir=node.data_dir, receiver=TWO)
    proc = spawn_daemon("receiver", other.config_path, other.log_path, 1)
    try:
        assert proc.wait(30) != 0
    finally:
        end_process(proc, signal.SIGKILL)
    text = other.log_text()
    assert node.proc is not None
    assert f"another canner-receiver already serves {node.data_dir} (pid {node.proc.pid}" in text, (
        text
    )
    assert len(worker_pids(node)) == 2
