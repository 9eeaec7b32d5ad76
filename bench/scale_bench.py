"""Scale benchmark: what each daemon costs on a data directory of N objects (issue 37).

    .venv/bin/python bench/scale_bench.py [--sizes 10000,100000] [--quick] [--json FILE]

For every N (and first for an empty node, N = 0, the baseline the issue's targets compare with)
it builds a data directory holding N objects in the states a busy node holds, directly on disk
through canner's own store and index code (sparse payloads, index rows inserted in batches):

- 30 % accepted, their payload waiting in ``uploads/`` (IA trouble: ``retry_wait``, due in an
  hour; a handful due now, so canner-deliver has something to deliver at once);
- 60 % delivered and purged, waiting for HQ's release (a receipt each; origin and delivery
  records in canner-deliver's journal segments);
- 5 % released and archived (gone from the node: one ``done`` ledger row counts them);
- 1 % flagged for an operator (payload on disk, ``retry_wait``, ``needs_operator``);
- plus 10,000 partial uploads in flight (at most N / 10).

Then it starts the real daemons (``twistd canner-receiver`` and ``twistd canner-deliver``, the
directory sink) and measures each figure of :data:`FIGURES`; those marked in-process are the
function the daemon runs on its timer, timed in this process on the same data directory (a
daemon does not expose its own tick's duration).  It prints a table with every figure per N and
the growth exponent between consecutive sizes, ``log(f2/f1) / log(N2/N1)``.

Bounded: it refuses to start without room for the largest size (free bytes and inodes, from a
per-object estimate), every wait has a time limit, ``--max-minutes`` bounds the whole run, and
the work directory is removed at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import http.client
import itertools
import json
import math
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import blake3

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

import canner.sinks.registry  # noqa: E402, F401  (registers the directory sink the config names)
from canner.checksum import parse_checksum  # noqa: E402
from canner.config import Config, load_config  # noqa: E402
from canner.delivery import outbound  # noqa: E402
from canner.delivery.index import (  # noqa: E402
    OBJECT,
    AcceptedObject,
    claim_due,
    configure_connection,
    insert_objects,
    upgrade_schema,
)
from canner.delivery.rescan import rescan_now  # noqa: E402
from canner.ops.inventory import take_survey  # noqa: E402
from canner.store.journal import Journal, JournalLog  # noqa: E402
from canner.store.promises import Promises  # noqa: E402
from canner.store.receipts import (  # noqa: E402
    DeliveryRecord,
    Origin,
    Receipt,
    ReceiptStore,
    delivery_journal_record,
    origin_journal_record,
)
from canner.store.sweep import sweep_stale  # noqa: E402
from canner.store.uploads import UploadDoor, UploadInfo, UploadStore  # noqa: E402

VENV = ROOT / ".venv" / "bin"
PROJECT = "bench"
TOKEN = "bench-token"
ISSUER = "https://canner.bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAYLOAD = 64 * 1024  # every stored object's (sparse) payload
PARTIAL = 1 << 20  # a partial upload's declared size; half of it is stored (sparse)
PARTIALS_MAX = 10_000
DUE_NOW = 10  # accepted objects due for delivery at once (the rest wait out IA trouble)
UPLOAD = 4096  # a new small upload's size
BATCH = 10_000  # index rows per transaction, files per progress step

# (key, label, unit, how): how is "outside" (the real daemon, from outside) or "in-process".
FIGURES: list[tuple[str, str, str, str]] = [
    ("build_s", "build the data directory", "s", "bench"),
    ("receiver_ready_s", "receiver start to /readyz 200", "s", "outside"),
    ("deliver_first_s", "deliver start to its first delivery", "s", "outside"),
    ("readyz_p50_ms", "/readyz p50 while uploads run", "ms", "outside"),
    ("readyz_p99_ms", "/readyz p99 while uploads run", "ms", "outside"),
    ("status_page_p50_ms", "status page GET / p50 while uploads run", "ms", "outside"),
    ("status_page_p99_ms", "status page GET / p99 while uploads run", "ms", "outside"),
    ("upload_p50_ms", "new 4 KiB upload p50 (POST+PATCH)", "ms", "outside"),
    ("upload_p99_ms", "new 4 KiB upload p99", "ms", "outside"),
    ("canner_status_s", "canner status", "s", "outside"),
    ("canner_show_s", "canner show <prefix>", "s", "outside"),
    ("sweep_tick_s", "one sweep tick (sweep_stale)", "s", "in-process"),
    ("rescan_s", "one receipt rescan (rescan_now)", "s", "in-process"),
    ("claim_ms", "outbound claim of the next due row", "ms", "in-process"),
    ("survey_s", "one survey (take_survey)", "s", "in-process"),
    ("promises_s", "promises rebuilt from disk", "s", "in-process"),
    ("hq_status_per_s", "HQ status queries", "/s", "outside"),
    ("hq_status_p99_ms", "HQ status query p99", "ms", "outside"),
    ("hq_release_per_s", "HQ releases (batches of 1000)", "ids/s", "outside"),
    ("receiver_rss_mib", "receiver peak RSS, largest process", "MiB", "outside"),
    ("receiver_rss_total_mib", "receiver peak RSS, all its processes", "MiB", "outside"),
    ("deliver_rss_mib", "deliver peak RSS", "MiB", "outside"),
    ("receiver_idle_cpu_s", "receiver CPU over the idle interval (all processes)", "s", "outside"),
    ("deliver_idle_cpu_s", "deliver CPU over the idle interval", "s", "outside"),
    ("sqlite_bytes_per_object", "delivery.sqlite bytes per object", "B", "disk"),
    ("journal_bytes_per_object", "journal/ bytes per object", "B", "disk"),
    ("receipts_bytes_per_object", "receipts/ bytes per object", "B", "disk"),
]

# Disk the data directory of N objects takes, per object (measured at 10^5: about 4.9 KiB and
# 1.9 inodes; every small file takes a 4 KiB block), with room to spare.
BYTES_PER_OBJECT = 8 * 1024
INODES_PER_OBJECT = 2.5
BYTES_PER_PARTIAL = 3 * 4096
SPARE_BYTES = 2 << 30


class OutOfTime(Exception):
    """The run's --max-minutes are over."""


class Deadline:
    """The run's time limit: every wait asks it how long it may take."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        left = self.until - time.monotonic()
        if left <= 0:
            raise OutOfTime("--max-minutes reached")
        return min(cap, left)


# -- the data directory ------------------------------------------------------------------------


def object_id(n: int, i: int) -> str:
    """The i-th object of the size-n directory: 32 hex characters, in no order."""
    return hashlib.md5(f"{n}:{i}".encode(), usedforsecurity=False).hexdigest()


def shares(n: int) -> dict[str, int]:
    """How many objects of N are in each state, and the partial uploads beside them."""
    accepted, delivered = n * 30 // 100, n * 60 // 100
    archived, flagged = n * 5 // 100, n // 100
    return {
        "accepted": accepted,
        "delivered": delivered,
        "archived": archived,
        "flagged": flagged,
        "partial": min(PARTIALS_MAX, n // 10),
    }


def needs(n: int) -> tuple[int, int]:
    """(bytes, inodes) a size-n run needs on the work directory's filesystem."""
    partial = shares(n)["partial"]
    return (
        n * BYTES_PER_OBJECT + partial * BYTES_PER_PARTIAL + SPARE_BYTES,
        int(n * INODES_PER_OBJECT) + partial * 2 + 100_000,
    )


def check_room(work_root: Path, n: int) -> None:
    """Refuse (SystemExit, saying how much it needs) when the filesystem lacks room for n."""
    want_bytes, want_inodes = needs(n)
    st = os.statvfs(work_root)
    free_bytes, free_inodes = st.f_bavail * st.f_frsize, st.f_favail
    if free_bytes < want_bytes or (st.f_files and free_inodes < want_inodes):
        raise SystemExit(
            f"scale_bench: N={n} needs {want_bytes / 2**30:.1f} GiB and {want_inodes:,} inodes"
            f" free under {work_root} (about {BYTES_PER_OBJECT} bytes and {INODES_PER_OBJECT}"
            f" inodes per object, plus {SPARE_BYTES / 2**30:.0f} GiB); it has"
            f" {free_bytes / 2**30:.1f} GiB and {free_inodes:,} inodes"
        )


def write_file(path: Path, data: bytes) -> None:
    """A small file, not fsynced (the build ends with one ``sync``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def stored_upload(uploads: UploadStore, info: UploadInfo, stored: int) -> None:
    """An upload as the receiver creates it (:meth:`UploadStore.create`), ``stored`` bytes long
    (a sparse file: what is measured is names and metadata, not payload bytes)."""
    uploads.create(info)
    os.truncate(uploads.data_path(info.upload_id), stored)


def build(data_dir: Path, n: int, now: float) -> dict[str, int]:
    """Fill ``data_dir`` with n objects in the states of :func:`shares` (blocking)."""
    counts = shares(n)
    uploads, receipts = UploadStore(data_dir / "uploads"), ReceiptStore(data_dir / "receipts")
    for d in (uploads.directory, receipts.directory, data_dir / "journal"):
        d.mkdir(parents=True)
    checksum = "blake3:" + blake3.blake3(bytes(PAYLOAD)).hexdigest()
    accepted_at = int(now) - 7 * 86400
    ids = iter(range(n))
    on_disk = [object_id(n, next(ids)) for _ in range(counts["accepted"] + counts["flagged"])]
    delivered = [object_id(n, next(ids)) for _ in range(counts["delivered"])]
    flagged = on_disk[counts["accepted"] :]

    def origin(oid: str) -> Origin:
        return Origin(PROJECT, f"{oid}.warc.gz")

    def receipt(oid: str) -> Receipt:
        return Receipt(oid, ISSUER, parse_checksum(checksum), PAYLOAD, accepted_at)

    # Accepted (and flagged) objects: the payload and its sidecar in uploads/, the receipt and
    # the origin record in receipts/.
    for oid in on_disk:
        meta = {"project": PROJECT, "checksum": checksum, "filename": f"{oid}.warc.gz"}
        info = UploadInfo(oid, PAYLOAD, meta, accepted_at, durable=0, door=UploadDoor.TUS)
        stored_upload(uploads, info, PAYLOAD)
        write_file(receipts.receipt_path(oid), receipt(oid).to_json())
        write_file(receipts.origin_path(oid), origin(oid).to_json(oid))
    # Delivered and purged: the receipt alone; origin and delivery records in the journal.
    log = JournalLog(Journal(data_dir / "journal"))
    for start in range(0, len(delivered), 1000):
        batch = delivered[start : start + 1000]
        for oid in batch:
            write_file(receipts.receipt_path(oid), receipt(oid).to_json())
        log.append(
            [
                record
                for oid in batch
                for record in (
                    origin_journal_record(oid, origin(oid)),
                    delivery_journal_record(oid, delivery(oid, now)),
                )
            ]
        )
    log.close()
    # Partial uploads in flight: half stored, touched just now (the sweep keeps them).
    for i in range(counts["partial"]):
        pid = hashlib.md5(f"partial:{n}:{i}".encode(), usedforsecurity=False).hexdigest()
        meta = {"project": PROJECT, "checksum": checksum, "filename": f"{pid}.warc.gz"}
        stored_upload(uploads, UploadInfo(pid, PARTIAL, meta, int(now), durable=0), PARTIAL // 2)
    fill_index(data_dir / "delivery.sqlite", on_disk, delivered, flagged, counts, now, receipt)
    subprocess.run(["sync"], check=True, timeout=600)
    return counts


def delivery(oid: str, now: float) -> DeliveryRecord:
    t = now - 6 * 86400
    return DeliveryRecord(f"{PROJECT}-{oid}", f"{oid}.warc.gz", oid, t, t + 60, t + 120, t + 130)


def fill_index(
    db: Path,
    on_disk: list[str],
    delivered: list[str],
    flagged: list[str],
    counts: dict[str, int],
    now: float,
    receipt: Callable[[str], Receipt],
) -> None:
    """The index rows of every object, through :func:`insert_objects` (batched transactions,
    ``synchronous=OFF`` while building), then the states: accepted objects wait out IA trouble
    (``retry_wait`` after one failed attempt, due in an hour) but for :data:`DUE_NOW`, flagged
    ones are held for an operator (:func:`outbound.hold`), delivered ones have their attempt in
    the history, archived ones are a ``done`` ledger's records."""
    upgrade_schema(db)
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        configure_connection(conn)
        conn.execute("PRAGMA synchronous=OFF")
        cur = conn.cursor()
        everything = [(oid, None) for oid in on_disk] + [(oid, oid) for oid in delivered]
        for start in range(0, len(everything), BATCH):
            cur.execute("BEGIN")
            insert_objects(
                cur,
                [
                    AcceptedObject.of(
                        receipt(oid),
                        Origin(PROJECT, f"{oid}.warc.gz"),
                        None if purged is None else delivery(oid, now),
                    )
                    for oid, purged in everything[start : start + BATCH]
                ],
                now,
            )
            cur.execute("COMMIT")
        waiting = on_disk[DUE_NOW : counts["accepted"]]
        cur.execute("BEGIN")
        cur.executemany(
            "UPDATE outbound SET state = 'retry_wait', attempts = 1, next_attempt_at = ?,"
            " last_error = 'IA answered 503 SlowDown' WHERE kind = 'object' AND ref = ?",
            [(now + 3600, oid) for oid in waiting],
        )
        outbound.hold(cur, OBJECT, [(oid, "IA answered 403") for oid in flagged], now + 86400, now)
        t = now - 6 * 86400
        cur.executemany(
            "INSERT INTO attempts (object_id, attempt, started_at, ended_at, outcome)"
            " VALUES (?, 1, ?, ?, 'delivered')",
            [(oid, t - 5, t) for oid in delivered],
        )
        cur.execute(
            "INSERT INTO ledgers (name, period, state, records, created_at, written_at, done_at)"
            " VALUES ('bench-ledger-1', 'day', 'done', ?, ?, ?, ?)",
            (counts["archived"], now - 86400, now - 86000, now - 85000),
        )
        cur.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def disk_bytes(path: Path) -> int:
    """Bytes a file or a directory's files take on disk (allocated blocks, as ``du``)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


# -- in-process figures --------------------------------------------------------------------------


def timed(f: Callable[[], object], repeat: int = 1) -> float:
    """The median wall time of ``repeat`` calls of ``f``, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def claim_next(db: Path) -> float:
    """Seconds to claim the next due row as canner-deliver does (:func:`claim_due`), in a
    transaction rolled back afterwards (median of 5)."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        configure_connection(conn)
        cur = conn.cursor()
        times = []
        for _ in range(5):
            cur.execute("BEGIN IMMEDIATE")
            t = time.perf_counter()
            claim_due(cur, time.time(), 1, [PROJECT])
            times.append(time.perf_counter() - t)
            cur.execute("ROLLBACK")
        return statistics.median(times)
    finally:
        conn.close()


def in_process(config: Config, n: int) -> dict[str, float]:
    """The daemons' periodic jobs, each called once as the daemon calls it."""
    data = config.data_dir
    uploads, receipts = UploadStore(data / "uploads"), ReceiptStore(data / "receipts")
    journal = Journal(data / "journal")
    ids = config.object_ids
    return {
        "sweep_tick_s": timed(
            lambda: sweep_stale(
                uploads, receipts, journal, ids, time.time(), config.partial_upload_retention
            )
        ),
        "rescan_s": timed(
            lambda: rescan_now(
                data / "delivery.sqlite",
                receipts=receipts,
                uploads=uploads,
                journal=journal,
                skip=lambda _oid: False,
                object_ids=ids,
                now=time.time,
            )
        ),
        "claim_ms": claim_next(data / "delivery.sqlite") * 1000,
        "survey_s": timed(lambda: take_survey(data, ids, time.time())),
        "promises_s": timed(lambda: Promises.from_disk(uploads, receipts, ids)),
    }


# -- daemons -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(work: Path, data_dir: Path, sink: Path) -> tuple[Path, int]:
    """The config both daemons run on (defaults but for the ports, the sink and the floor)."""
    tokens = work / "tokens"
    tokens.write_text(f"bench sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}\n")
    port = free_port()
    path = work / f"canner-{data_dir.name}.toml"
    path.write_text(
        f'issuer = "{ISSUER}"\ndata_dir = "{data_dir}"\n'
        f'listen = "tcp:{port}:interface=127.0.0.1"\nmin_free_bytes = 1\naccess_log = false\n'
        f'[metrics]\ndeliver_listen = "tcp:{free_port()}:interface=127.0.0.1"\n'
        f'[hq]\ntokens = "{tokens}"\n'
        f"[projects.{PROJECT}]\n[projects.{PROJECT}.delivery]\n"
        f'sink = "directory"\npath = "{sink}"\nidentifier = "{{project}}-{{object_id}}"\n'
        'remote_name = "{filename}"\nlocal_artifact_retention = "1h"\n'
    )
    return path, port


class Daemons:
    """The daemons this run started, so that every exit path stops them."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def spawn(self, role: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
        command = [str(VENV / "twistd"), "--nodaemon", "--pidfile=", f"canner-{role}"]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [*command, "--config", str(config)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's log (for a run that failed)."""
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in self.logs
            if log.exists()
        )

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs.clear()


def proc_status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` field in KiB (VmHWM: peak RSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a receiver of several workers is a parent and children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(task.path, "children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and its descendants, those still running."""
    total = 0.0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


def peak_rss(pid: int) -> tuple[float, float]:
    """(largest, summed) peak RSS in MiB over ``pid`` and its descendants."""
    peaks = []
    for p in tree(pid):
        with contextlib.suppress(OSError):
            peaks.append(proc_status(p, "VmHWM") / 1024)
    return max(peaks, default=0.0), sum(peaks)


def settle(pids: Sequence[int], deadline: Deadline, cap: float = 300.0) -> None:
    """Wait until every process spends under 5 % of a core over a second (start-up work done)."""
    until = time.monotonic() + deadline.left(cap)
    before = [cpu_seconds(p) for p in pids]
    while time.monotonic() < until:
        time.sleep(1.0)
        now = [cpu_seconds(p) for p in pids]
        if all(b - a < 0.05 for a, b in zip(before, now, strict=True)):
            return
        before = now


def wait_ready(port: int, proc: subprocess.Popen[bytes], deadline: Deadline) -> float:
    """Seconds until ``/readyz`` answers 200 (the receiver serves and its storage is fine)."""
    until = time.monotonic() + deadline.left(600)
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"the receiver exited ({proc.returncode}) before it was ready")
        try:
            status, _ = get(port, "/readyz", timeout=5)
            if status == 200:
                return time.monotonic()
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError("the receiver was not ready in time")


def wait_delivery(sink: Path, proc: subprocess.Popen[bytes], deadline: Deadline) -> float:
    """The moment the first object lands in the directory sink."""
    until = time.monotonic() + deadline.left(600)
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"canner-deliver exited ({proc.returncode}) before delivering")
        if sink.exists() and any(
            any(True for _ in os.scandir(item)) for item in os.scandir(sink) if item.is_dir()
        ):
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError("canner-deliver delivered nothing in time")


def wait_metrics(config: Config, proc: subprocess.Popen[bytes], deadline: Deadline) -> None:
    """Wait until canner-deliver's ``/metrics`` answers (it has started its services)."""
    port = int(str(config.metrics.deliver_listen).split(":")[1])
    until = time.monotonic() + deadline.left(120)
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise RuntimeError(f"canner-deliver exited ({proc.returncode})")
        with contextlib.suppress(OSError):
            if get(port, "/metrics", timeout=5)[0] == 200:
                return
        time.sleep(0.05)
    raise RuntimeError("canner-deliver's metrics did not answer in time")


# -- HTTP ------------------------------------------------------------------------------------------


def get(port: int, path: str, timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Uploader:
    """A minimal tus client on one keep-alive connection: creation POST, one PATCH."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def upload(self) -> float:
        """Seconds one new small upload takes, from the POST to its receipt."""
        body = secrets.token_bytes(UPLOAD)
        checksum = "blake3:" + blake3.blake3(body).hexdigest()
        name = f"new-{checksum[7:23]}.warc.gz"  # every upload its own origin
        meta = f"project {b64(PROJECT)},checksum {b64(checksum)},filename {b64(name)}"
        t = time.perf_counter()
        self.conn.request(
            "POST",
            "/files/",
            headers={
                "Tus-Resumable": "1.0.0",
                "Upload-Length": str(UPLOAD),
                "Upload-Metadata": meta,
            },
        )
        r = self.conn.getresponse()
        r.read()
        location = r.getheader("Location")
        if r.status != 201 or location is None:
            raise RuntimeError(f"creation answered {r.status}")
        self.conn.request(
            "PATCH",
            location,
            body=body,
            headers={
                "Tus-Resumable": "1.0.0",
                "Upload-Offset": "0",
                "Content-Type": "application/offset+octet-stream",
            },
        )
        r = self.conn.getresponse()
        r.read()
        if r.status != 204 or not r.getheader("Artifact-Receipt"):
            raise RuntimeError(f"the PATCH answered {r.status} without a receipt")
        return time.perf_counter() - t

    def close(self) -> None:
        self.conn.close()


def percentile(values: list[float], p: float) -> float:
    """Nearest rank (p99 of fewer than 100 samples is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def loop_until(until: float, step: Callable[[], float]) -> list[float]:
    found = []
    while time.monotonic() < until:
        found.append(step())
    return found


def probe(port: int, path: str, refused: list[int]) -> float:
    """Seconds one ``GET path`` takes; an answer other than 200 (a status page whose survey
    timed out answers 503) is counted in ``refused`` and timed all the same."""
    t = time.perf_counter()
    status, _ = get(port, path)
    if status != 200:
        refused.append(status)
    return time.perf_counter() - t


def under_load(port: int, seconds: float) -> dict[str, float]:
    """``/readyz`` and ``GET /`` latencies, each probed in a loop of its own, while one client
    uploads small objects one after the other (a bounded load)."""
    until = time.monotonic() + seconds
    results: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def run(name: str, step: Callable[[], float]) -> None:
        try:
            results[name] = loop_until(until, step)
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)

    uploader = Uploader(port)
    refused: dict[str, list[int]] = {"readyz": [], "page": []}
    threads = [
        threading.Thread(target=run, args=("uploads", uploader.upload)),
        threading.Thread(
            target=run, args=("readyz", lambda: probe(port, "/readyz", refused["readyz"]))
        ),
        threading.Thread(target=run, args=("page", lambda: probe(port, "/", refused["page"]))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    uploader.close()
    if errors:
        raise errors[0]
    return {
        "readyz_p50_ms": percentile(results["readyz"], 50) * 1000,
        "readyz_p99_ms": percentile(results["readyz"], 99) * 1000,
        "status_page_p50_ms": percentile(results["page"], 50) * 1000,
        "status_page_p99_ms": percentile(results["page"], 99) * 1000,
        "status_page_samples": len(results["page"]),
        "status_page_refused": len(refused["page"]),
        "readyz_refused": len(refused["readyz"]),
        "uploads_under_probes": len(results["uploads"]),
    }


def upload_latency(port: int, seconds: float) -> dict[str, float]:
    """A new small upload's latency, one after the other, nothing else running."""
    uploader = Uploader(port)
    try:
        for _ in range(5):  # warm the connection and the receiver's code paths
            uploader.upload()
        times = loop_until(time.monotonic() + seconds, uploader.upload)
    finally:
        uploader.close()
    return {
        "upload_p50_ms": percentile(times, 50) * 1000,
        "upload_p99_ms": percentile(times, 99) * 1000,
        "uploads": len(times),
    }


def hq(port: int, ids: list[str], work: Path, seconds: float) -> dict[str, float]:
    """HQ's status queries (``bench/node/get_load.js``, 8 keep-alive loops) and its releases
    (batches of up to 1,000 ids, at most 10), on delivered objects."""
    load = work / "load.json"
    sample = ids[: 20_000 : max(1, len(ids) // 20_000)] if len(ids) > 20_000 else ids
    load.write_text(
        json.dumps(
            {
                "base": f"http://127.0.0.1:{port}",
                "paths": [f"/api/v1/objects/{oid}" for oid in sample],
                "concurrency": 8,
                "seconds": seconds,
            }
        )
    )
    out = subprocess.run(
        ["node", str(BENCH / "node" / "get_load.js"), str(load)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    )
    got = json.loads(out.stdout)
    if got["errors"]:
        raise RuntimeError(f"{got['errors']} status queries failed")
    releasing = ids[-min(len(ids), 10_000) :]
    released = 0
    t = time.perf_counter()
    for start in range(0, len(releasing), 1000):
        body = json.dumps([f"receipt:{oid}" for oid in releasing[start : start + 1000]])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request(
                "POST",
                "/api/v1/releases",
                body=body,
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            r = conn.getresponse()
            answers = json.loads(r.read())["results"]
        finally:
            conn.close()
        released += sum(1 for a in answers if a["status"] == "released")
    elapsed = time.perf_counter() - t
    if released != len(releasing):
        raise RuntimeError(f"released {released} of {len(releasing)}")
    return {
        "hq_status_per_s": got["requests"] / got["seconds"],
        "hq_status_p99_ms": got["p99_ms"],
        "hq_release_per_s": released / elapsed,
    }


def cli(config: Path, *args: str, repeat: int = 3, ok: tuple[int, ...] = (0,)) -> float:
    """The median wall time of ``canner ARGS --config CONFIG``, which must exit with one of
    ``ok`` and print something."""

    def run() -> None:
        done = subprocess.run(
            [str(VENV / "canner"), *args, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode not in ok or not done.stdout:
            raise RuntimeError(f"canner {' '.join(args)}: {done.returncode} {done.stderr[-500:]}")

    return timed(run, repeat)


# -- one size ------------------------------------------------------------------------------------


def measure(
    n: int, work: Path, args: argparse.Namespace, deadline: Deadline, result: dict[str, Any]
) -> None:
    """Every figure of :data:`FIGURES` on a fresh data directory of n objects, into ``result``
    as each is measured (a run cut short keeps what it measured)."""
    data, sink = work / f"data-{n}", work / f"sink-{n}"
    sink.mkdir()
    config_path, port = write_config(work, data, sink)
    config = load_config(config_path)
    t = time.monotonic()
    result["states"] = build(data, n, time.time())
    result["build_s"] = time.monotonic() - t
    say(f"N={n}: built in {result['build_s']:.1f}s {result['states']}")
    result.update(in_process(config, n))
    if n:  # an empty node has no objects to divide by
        sqlite = sum(disk_bytes(p) for p in data.glob("delivery.sqlite*"))
        result["sqlite_bytes_per_object"] = sqlite / n
        result["journal_bytes_per_object"] = disk_bytes(data / "journal") / n
        result["receipts_bytes_per_object"] = disk_bytes(data / "receipts") / n
    daemons = Daemons()
    try:
        t = time.monotonic()
        receiver = daemons.spawn("receiver", config_path, work / f"receiver-{n}.log")
        result["receiver_ready_s"] = wait_ready(port, receiver, deadline) - t
        t = time.monotonic()
        deliver = daemons.spawn("deliver", config_path, work / f"deliver-{n}.log")
        if n:
            result["deliver_first_s"] = wait_delivery(sink, deliver, deadline) - t
        else:  # nothing to deliver: up once its metrics answer
            wait_metrics(config, deliver, deadline)
        say(
            f"N={n}: receiver ready in {result['receiver_ready_s']:.2f}s, deliver delivered in"
            f" {result.get('deliver_first_s', 0):.2f}s; settling, {args.idle_seconds:.0f}s idle"
        )
        pids = [receiver.pid, deliver.pid]
        settle(pids, deadline)
        before = [cpu_seconds(p) for p in pids]
        time.sleep(deadline.left(args.idle_seconds))
        after = [cpu_seconds(p) for p in pids]
        result["receiver_idle_cpu_s"] = after[0] - before[0]
        result["deliver_idle_cpu_s"] = after[1] - before[1]
        result.update(under_load(port, deadline.left(args.window_seconds)))
        result.update(upload_latency(port, deadline.left(args.window_seconds)))
        result["canner_status_s"] = cli(config_path, "status", ok=(0, 1, 2))
        first = object_id(n, 0) if n else None
        if first is not None:
            result["canner_show_s"] = cli(config_path, "show", first[:12])
        # The delivered objects are the ids after the accepted and flagged ones.
        counts = shares(n)
        lead = counts["accepted"] + counts["flagged"]
        delivered = [object_id(n, i) for i in range(lead, lead + counts["delivered"])]
        if delivered:
            result.update(hq(port, delivered, work, deadline.left(args.hq_seconds)))
        result["receiver_rss_mib"], result["receiver_rss_total_mib"] = peak_rss(receiver.pid)
        result["deliver_rss_mib"], _ = peak_rss(deliver.pid)
        result["receiver_processes"] = len(tree(receiver.pid))
    except OutOfTime:
        raise
    except Exception:
        say(f"N={n} failed; the daemons' logs end with:\n{daemons.tails()}")
        raise
    finally:
        daemons.stop_all()
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(sink, ignore_errors=True)


# -- the table -----------------------------------------------------------------------------------


def exponent(n1: int, f1: float | None, n2: int, f2: float | None) -> float | None:
    """log(f2/f1) / log(n2/n1): 0 for a figure that stays, 1 for one that grows linearly."""
    if not n1 or not n2 or f1 is None or f2 is None or f1 <= 0 or f2 <= 0:
        return None
    return math.log(f2 / f1) / math.log(n2 / n1)


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"


def table(results: list[dict[str, Any]]) -> str:
    sizes = [r["n"] for r in results]
    pairs = [(a, b) for a, b in itertools.pairwise(sizes) if a and b]
    head = ["figure", "unit", *(f"N={n:,}" if n else "empty" for n in sizes)]
    head += [f"exp {a:.0e}->{b:.0e}".replace("+0", "") for a, b in pairs]
    rows = [head]
    by_n = {r["n"]: r for r in results}
    for key, label, unit, how in FIGURES:
        mark = " *" if how == "in-process" else ""
        values = [r.get(key) for r in results]
        row = [label + mark, unit, *(number(v) for v in values)]
        row += [number(exponent(a, by_n[a].get(key), b, by_n[b].get(key))) for a, b in pairs]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(
        "* in-process: the function the daemon runs on its timer, timed in this process on the"
        " same data directory (daemons stopped)."
    )
    lines.append(
        "exp: growth exponent log(f2/f1)/log(N2/N1) between consecutive sizes (0: flat, 1: linear)."
    )
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, flush=True)


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def work_dir(root: Path) -> Iterator[Path]:
    """A fresh ``canner-scale-*`` directory under ``root``, removed at the end whatever ends it
    (SIGTERM is turned into a KeyboardInterrupt, so it unwinds as Ctrl-C does)."""
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="canner-scale-", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", help="comma-separated N (default 10000,100000; --quick: 10000)", default=None
    )
    parser.add_argument("--quick", action="store_true", help="N=10^4, short idle and windows")
    parser.add_argument(
        "--no-empty", action="store_true", help="skip the empty node (N=0) baseline"
    )
    parser.add_argument("--idle-seconds", type=float, help="idle CPU interval (60; --quick 10)")
    parser.add_argument("--window-seconds", type=float, help="each latency window (15; --quick 5)")
    parser.add_argument("--hq-seconds", type=float, help="HQ status query load (10; --quick 3)")
    parser.add_argument("--max-minutes", type=float, default=90.0, help="bound of the whole run")
    parser.add_argument("--work-root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    quick = args.quick
    sizes = [int(s) for s in (args.sizes or ("10000" if quick else "10000,100000")).split(",")]
    if not args.no_empty:
        sizes = [0, *sizes]
    for name, full, short in (("idle_seconds", 60, 10), ("window_seconds", 15, 5)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    if args.hq_seconds is None:
        args.hq_seconds = 3 if quick else 10
    check_room(args.work_root, max(sizes))
    deadline = Deadline(args.max_minutes * 60)
    results: list[dict[str, Any]] = []
    failed = False
    try:
        with work_dir(args.work_root) as work:
            for n in sizes:
                check_room(args.work_root, n)
                results.append({"n": n})
                measure(n, work, args, deadline, results[-1])
    except KeyboardInterrupt:
        say("scale_bench: interrupted; the work directory is removed")
        return 130
    except OutOfTime:
        say("scale_bench: --max-minutes reached; the sizes measured so far:")
    except Exception as e:  # a daemon failed: print what was measured before it
        say(f"scale_bench: N={results[-1]['n']} failed ({e!r}); the figures measured so far:")
        failed = True
    say(table(results))
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
