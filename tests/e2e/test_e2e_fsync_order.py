"""The durability order of one acceptance, read from a real receiver's system calls.

The receiver runs under ``strace -f -y`` (every thread; file descriptors shown with their paths).
For one upload the test checks, from the calls as the kernel saw them: the receipt's name is
linked only after the data file, the info sidecar, ``uploads/`` and the receipt's own content
were fsynced (each call *returned* before the link *started*), and ``receipts/`` was fsynced
after the link and before the ``204`` went out on the socket.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import Receiver, blake3_hex

pytestmark = pytest.mark.e2e

_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<time>\d+\.\d+) (?P<rest>.*)$")
_RESUMED = re.compile(r"^<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)$")
_CALL = re.compile(r"^(?P<name>\w+)\((?P<args>.*)$")


@dataclass
class Call:
    name: str
    args: str
    started: float
    ended: float | None = None
    result: str = ""


def parse_strace(text: str) -> list[Call]:
    """Calls with start and end times; an ``<unfinished ...>`` call is completed by its
    ``<... name resumed>`` line in the same thread."""
    calls: list[Call] = []
    pending: dict[str, Call] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid, when, rest = m["pid"], float(m["time"]), m["rest"]
        resumed = _RESUMED.match(rest)
        if resumed:
            call = pending.pop(pid, None)
            if call is not None:
                call.ended, call.result = when, resumed["rest"]
            continue
        c = _CALL.match(rest)
        if not c:
            continue
        call = Call(c["name"], c["args"], when)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = call
        else:
            call.ended, call.result = when, rest
        calls.append(call)
    return calls


def _syncs_of(calls: list[Call], path: str) -> Iterator[Call]:
    for call in calls:
        if call.name in ("fsync", "fdatasync") and call.args.split(">")[0].endswith("<" + path):
            yield call


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[Receiver, Path]]:
    trace = tmp_path / "strace.txt"
    rcv = Receiver.in_dir(tmp_path / "receiver")
    rcv.launch_prefix = [
        "strace",
        "-f",
        "-y",
        "-ttt",
        "-s",
        "24",
        "-o",
        str(trace),
        "-e",
        "trace=fsync,fdatasync,link,linkat,rename,renameat,renameat2,write,sendto,sendmsg",
    ]
    try:
        rcv.start(timeout=60)
        yield rcv, trace
    finally:
        # A signal to strace only detaches it: the traced receiver itself must be stopped.
        for pid in _traced_children(rcv):
            _end(pid)
        rcv.close()


def _traced_children(rcv: Receiver) -> list[int]:
    """The processes strace started (the receiver), while strace runs."""
    assert rcv.proc is not None
    try:
        text = Path(f"/proc/{rcv.proc.pid}/task/{rcv.proc.pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(pid) for pid in text.split()]


def _end(pid: int) -> None:
    """SIGTERM, then SIGKILL after 15 s (bounded)."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_receipt_is_linked_only_after_everything_it_rests_on_is_durable(
    traced: tuple[Receiver, Path],
) -> None:
    rcv, trace = traced
    data = b"durable bytes " * 1000
    r = rcv.create(len(data), blake3_hex(data))
    oid = rcv.object_id(r)
    done = rcv.patch(oid, 0, data)
    assert done.status_code == 204
    rcv.verify_receipt(done.headers.get("Artifact-Receipt"), oid, data)
    for pid in _traced_children(rcv):
        _end(pid)  # strace ends with its tracee, its trace complete
    rcv.stop()
    calls = parse_strace(trace.read_text(errors="replace"))

    uploads, receipts = str(rcv.uploads_dir), str(rcv.receipts_dir)
    link = next(c for c in calls if c.name in ("link", "linkat") and f'{oid}.json"' in c.args)
    assert link.result.strip().endswith("= 0"), link
    must_be_durable = {
        "data file": f"{uploads}/{oid}",
        "info sidecar": f"{uploads}/{oid}.info",
        "uploads/": uploads,
    }
    for what, path in must_be_durable.items():
        synced = [
            c for c in _syncs_of(calls, path) if c.ended is not None and c.ended <= link.started
        ]
        assert synced, f"{what} was not fsynced before the receipt was linked"
        assert all(c.result.strip().endswith("= 0") for c in synced)
    temp = re.search(r'"(?P<temp>[^"]*\.tmp-' + oid + r'\.json-[0-9a-f]+)"', link.args)
    assert temp, link.args
    assert any(
        c.ended is not None and c.ended <= link.started for c in _syncs_of(calls, temp["temp"])
    ), "the receipt's content was not fsynced before its name appeared"
    assert link.ended is not None
    directory_sync = next((c for c in _syncs_of(calls, receipts) if c.started >= link.ended), None)
    assert directory_sync is not None and directory_sync.ended is not None, (
        "receipts/ was not fsynced after the link"
    )
    answer = next(
        c
        for c in calls
        if c.name in ("write", "sendto", "sendmsg")
        and "HTTP/1.1 204" in c.args
        and c.started >= link.started
    )
    assert directory_sync.ended <= answer.started, "the 204 went out before receipts/ was durable"
