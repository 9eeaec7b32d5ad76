"""canner-deliver benchmark: throughput to the fake Internet Archive on loopback, deliver's RSS,
a plain ``curl -T`` baseline to the same fake, and the scheduler tick cost with 100,000 rows.

    .venv/bin/python bench/deliver_bench.py [--quick] [--dir DIR] [--concurrency 2 4]

Workloads (each in its own data directory, written directly on disk with canner's own code:
``canner.store.uploads`` for the payload and its tus info sidecar, ``canner.store.receipts`` for
the receipt and its origin record, exactly what acceptance leaves behind):

* ``big``:   4 x 1 GiB   (``--quick``: 4 x 128 MiB)
* ``small``: 500 x 1 MiB (``--quick``: 100 x 1 MiB)

For each workload and each ``delivery_concurrency``: a fresh fake IA process (``tests/fake_ia.py``),
a fresh ``delivery.sqlite`` (deleted; deliver's start-up rescan rebuilds it from ``receipts/``) and
a ``twistd canner-deliver`` process.  Throughput = bytes / (last ``delivered_at`` per
``canner deliveries`` - first claim, seen by polling the index every 50 ms).  Every attempt
includes canner's one-pass BLAKE3+MD5 check of the payload before its PUT.  Peak RSS is deliver's
``VmHWM``.  The baseline runs ``curl -T FILE http://127.0.0.1:PORT/ident/name`` with the LOW
authorization header, the same files and the same parallelism, against a fresh fake.

The tick cost builds ``delivery.sqlite`` with 100,000 rows of project ``example`` and times the
tick's queries (:func:`canner.delivery.index.claim_due` then ``follow_ups_due``) on a ``sqlite3``
cursor, each tick one committed transaction as under ``runInteraction``.

Everything written is removed at the end (``--keep`` keeps it).  Disk space is checked first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import blake3  # noqa: E402
from deliver_support import ACCESS, SECRET, Deliver, FakeIA, deliveries  # noqa: E402

from canner import fs  # noqa: E402
from canner.checksum import parse_checksum  # noqa: E402
from canner.delivery import index as sql  # noqa: E402
from canner.delivery import outbound  # noqa: E402
from canner.delivery.index import AcceptedObject  # noqa: E402
from canner.ids import ObjectIds  # noqa: E402
from canner.observe import Outbound  # noqa: E402
from canner.store.receipts import Origin, Receipt, ReceiptStore  # noqa: E402
from canner.store.uploads import UploadInfo, UploadStore  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
ISSUER = "https://canner.test"
PROJECT = "example"
CHUNK = 64 * MiB


def log(text: str) -> None:
    print(text, flush=True)


# -- preparing a data directory -----------------------------------------------------------------


def write_object(
    uploads: UploadStore, receipts: ReceiptStore, ids: ObjectIds, size: int, filename: str
) -> str:
    """One accepted object on disk: payload + info sidecar, origin record, receipt."""
    oid = ids.new()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    path = uploads.data_path(oid)
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(CHUNK, left))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    checksum = "blake3:" + h.hexdigest()
    now = int(time.time())
    info = UploadInfo(
        oid, size, {"project": PROJECT, "checksum": checksum, "filename": filename}, now
    )
    fs.replace_file(uploads.directory, f"{oid}.info", info.to_json(), sync=False)
    origin = Origin(PROJECT, filename)
    receipt = Receipt(oid, ISSUER, parse_checksum(checksum), size, now)
    if hasattr(receipts, "record_origin"):  # the origin record is written before the receipt
        receipts.record_origin(oid, origin)
        receipts.commit(receipt)
    else:
        receipts.commit(receipt, origin)  # type: ignore[call-arg]
    return oid


def prepare(data_dir: Path, count: int, size: int) -> list[str]:
    uploads = UploadStore(data_dir / "uploads")
    receipts = ReceiptStore(data_dir / "receipts")
    for folder in (uploads.directory, receipts.directory):
        folder.mkdir(parents=True, exist_ok=True)
    ids = ObjectIds("")
    made = [write_object(uploads, receipts, ids, size, f"obj-{i:04d}.bin") for i in range(count)]
    os.sync()
    return made


def write_config(root: Path, data_dir: Path, fake_url: str, concurrency: int) -> Path:
    keys = root / "keys"
    keys.write_text(f"{ACCESS}\n{SECRET}\n", encoding="utf-8")
    config = root / f"canner-c{concurrency}.toml"
    config.write_text(
        "\n".join(
            [
                f'issuer = "{ISSUER}"',
                f"data_dir = {json.dumps(str(data_dir))}",
                'listen = "tcp:0:interface=127.0.0.1"',
                "min_free_bytes = 1",
                f"delivery_concurrency = {concurrency}",
                "",
                f"[projects.{PROJECT}.delivery]",
                'sink = "internet_archive"',
                f"credentials = {json.dumps(str(keys))}",
                'identifier = "example-{date}-{object_id}"',
                'remote_name = "{filename}"',
                'local_artifact_retention = "24h"',
                f"s3_url = {json.dumps(fake_url)}",
                f"metadata_url = {json.dumps(fake_url)}",
                "",
                f"[projects.{PROJECT}.delivery.metadata]",
                'collection = ["test"]',
                'title = ["Artifact {object_id}"]',
                "",
            ]
        ),
        encoding="utf-8",
    )
    return config


# -- measuring ------------------------------------------------------------------------------------


def proc_status(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


@dataclass
class Run:
    label: str
    objects: int
    total_bytes: int
    seconds: float
    peak_rss: int | None = None
    detail: str = ""

    @property
    def rate(self) -> float:
        return self.total_bytes / self.seconds if self.seconds > 0 else 0.0


def attempt_stats(log_text: str, size: int) -> str:
    """Per-attempt phases from deliver's JSON log: the payload check (claim -> sink start) and
    the sink's part (metadata lookup, check_limit, PUT: ``duration_s`` of "uploaded ...")."""
    events = []
    for line in log_text.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    claims: dict[str, float] = {}
    uploads: dict[str, dict[str, Any]] = {}
    for e in events:
        text = e.get("message") or ""
        if "time" in e:
            e["unix_time"] = datetime.fromisoformat(e["time"]).timestamp()
        if e.get("logger") == "canner.delivery.outbound_service" and text.startswith("delivering "):
            claims.setdefault(e["subject"], e["unix_time"])
        elif e.get("logger") == "canner.sinks.ia.attempt" and text.startswith("uploaded "):
            uploads[e["object_id"]] = e
    if not uploads:
        return "(no attempt events in the log)"
    check = [
        u["unix_time"] - u["duration_s"] - claims[o] for o, u in uploads.items() if o in claims
    ]
    sink = [u["duration_s"] for u in uploads.values()]
    seconds = sorted({int(t) for t in claims.values()})
    per_second = len(claims) / max(1, seconds[-1] - seconds[0] + 1)
    return (
        f"per attempt: payload check (BLAKE3+MD5) median {statistics.median(check):.3f}s, "
        f"sink (lookup+check_limit+PUT) median {statistics.median(sink):.3f}s "
        f"= {size / statistics.median(sink) / MiB:.1f} MiB/s per stream; "
        f"claims per wall-clock second {per_second:.2f}"
    )


def fresh_fake(root: Path) -> FakeIA:
    shutil.rmtree(root, ignore_errors=True)
    fake = FakeIA(root, metadata_lag=0.0)
    fake.start()
    return fake


def run_deliver(
    root: Path, data_dir: Path, ids: list[str], size: int, concurrency: int, timeout: float
) -> Run:
    for name in ("delivery.sqlite", "delivery.sqlite-wal", "delivery.sqlite-shm"):
        (data_dir / name).unlink(missing_ok=True)
    fake = fresh_fake(root / "fake")
    try:
        config = write_config(root, data_dir, fake.url, concurrency)
        deliver = Deliver(
            config,
            data_dir,
            root / f"deliver-c{concurrency}.log",
            twistd_args=["--logger=canner.logs.json_observer"],
        )
        deliver.start()
        assert deliver.proc is not None
        pid = deliver.proc.pid
        db = data_dir / "delivery.sqlite"
        first_claim: float | None = None
        peak_sampled = 0
        deadline = time.monotonic() + timeout
        done = False
        while not done:
            if time.monotonic() > deadline:
                raise SystemExit(f"deliver did not finish in {timeout:.0f}s:\n{deliver.log_tail()}")
            if not deliver.running:
                raise SystemExit(f"deliver died:\n{deliver.log_tail()}")
            peak_sampled = max(peak_sampled, proc_status(pid, "VmRSS") or 0)
            try:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                try:
                    states = dict(
                        conn.execute(
                            "SELECT state, count(*) FROM objects GROUP BY state"
                        ).fetchall()
                    )
                finally:
                    conn.close()
            except sqlite3.Error:
                states = {}
            if first_claim is None and sum(v for k, v in states.items() if k != "pending"):
                first_claim = time.time()
            done = states.get("delivered", 0) == len(ids)
            time.sleep(0.05)
        peak = proc_status(pid, "VmHWM")
        rows = deliveries(config)
        deliver.stop()
        assert first_claim is not None
        last = max(rows[oid]["delivered_at"] for oid in ids)
        bad = [r for r in rows.values() if r["attempts"] != 1]
        if bad:
            log(f"  note: {len(bad)} objects needed more than one attempt")
        objects = fake.objects()
        assert len(objects) == len(ids) and all(o["stores"] == 1 for o in objects), "fake state"
        run = Run(
            f"deliver c={concurrency}",
            len(ids),
            len(ids) * size,
            last - first_claim,
            max(peak or 0, peak_sampled),
        )
        run.detail = attempt_stats(deliver.log_text(), size)
        return run
    finally:
        fake.stop()
        shutil.rmtree(root / "fake", ignore_errors=True)


def run_curl(root: Path, data_dir: Path, ids: list[str], size: int, parallel: int) -> Run:
    fake = fresh_fake(root / "fake")
    try:

        def put(oid: str) -> None:
            out = subprocess.run(
                [
                    "curl",
                    "-sS",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "-T",
                    str(data_dir / "uploads" / oid),
                    "-H",
                    f"authorization: LOW {ACCESS}:{SECRET}",
                    "-H",
                    "x-archive-auto-make-bucket: 1",
                    "-H",
                    "Expect:",
                    f"{fake.url}/curl-{oid}/file.bin",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.stdout.strip() != "200":
                raise RuntimeError(f"curl PUT {oid}: {out.stdout} {out.stderr}")

        start = time.time()
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(put, ids))
        seconds = time.time() - start
        assert len(fake.objects()) == len(ids)
        return Run(f"curl -T x{parallel}", len(ids), len(ids) * size, seconds)
    finally:
        fake.stop()
        shutil.rmtree(root / "fake", ignore_errors=True)


# -- the outbound service tick with 100,000 rows ----------------------------------------------


def build_index(path: Path, rows: int, state: str, due: bool) -> None:
    path.unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    sql.upgrade_schema(path)
    conn = sqlite3.connect(path, isolation_level=None)
    sql.configure_connection(conn)
    now = time.time()
    ids = ObjectIds("")
    objects = [
        AcceptedObject(ids.new(), PROJECT, f"f{i}.bin", 1 + i, "blake3:" + "0" * 64, int(now))
        for i in range(rows)
    ]
    cur = conn.cursor()
    cur.execute("BEGIN")
    sql.insert_objects(cur, objects, now - 10 if due else now + 86400)
    if state == "delivered":
        cur.execute("UPDATE objects SET purge_after = ?", (now + 86400,))
        cur.execute(
            "UPDATE outbound SET state = 'delivered', delivered_at = ?, next_check_at = ?",
            (now, now + 86400),
        )
    cur.execute("COMMIT")
    cur.execute("ANALYZE")
    conn.close()


def time_ticks(path: Path, ticks: int, free_slots: int) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    sql.configure_connection(conn)
    cur = conn.cursor()
    times = []
    for _ in range(ticks):
        now = time.time()
        start = time.perf_counter()
        cur.execute("BEGIN")
        outbound.claim_due_any(cur, now, free_slots, {Outbound.OBJECT: [PROJECT]})
        cur.execute("COMMIT")
        cur.execute("BEGIN")
        outbound.follow_ups_due_any(cur, now, 32, {Outbound.OBJECT: [PROJECT]})
        cur.execute("COMMIT")
        times.append((time.perf_counter() - start) * 1000)
    conn.close()
    return times


def tick_bench(root: Path, rows: int) -> None:
    log(
        f"\n== outbound service tick, {rows:,} rows"
        " (claim_due_any(limit=2) + follow_ups_due_any(limit=32), one commit each) =="
    )
    path = root / "tick" / "delivery.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    scenarios = [
        ("pending, all due", "pending", True),
        ("pending, none due yet", "pending", False),
        ("delivered, follow-ups not due", "delivered", False),
    ]
    for label, state, due in scenarios:
        start = time.perf_counter()
        build_index(path, rows, state, due)
        built = time.perf_counter() - start
        times = time_ticks(path, 50, 2)
        times.sort()
        median, p95 = statistics.median(times), times[int(len(times) * 0.95) - 1]
        log(
            f"  {label:32s} build {built:5.1f}s   per tick: median {median:6.2f} ms"
            f"  p95 {p95:6.2f} ms  max {times[-1]:6.2f} ms"
        )
    conn = sqlite3.connect(path)
    plan = conn.execute(
        "EXPLAIN QUERY PLAN SELECT object_id FROM objects WHERE state IN ('pending', 'retry_wait')"
        " AND next_attempt_at <= ? AND project IN (?) ORDER BY next_attempt_at LIMIT ?",
        (time.time(), PROJECT, 2),
    ).fetchall()
    conn.close()
    log("  claim subquery plan: " + "; ".join(str(p[-1]) for p in plan))
    shutil.rmtree(path.parent, ignore_errors=True)


# -- main ------------------------------------------------------------------------------------------


def fmt_rate(rate: float) -> str:
    return f"{rate / MiB:8.1f} MiB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 x 128 MiB and 100 x 1 MiB")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tick-rows", type=int, default=100_000)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    big_size = 128 * MiB if args.quick else GiB
    workloads = [("big", 4, big_size), ("small", 100 if args.quick else 500, MiB)]
    payload = sum(n * s for _, n, s in workloads)
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    # payloads + one fake copy at a time + slack
    need = 2 * payload + 2 * GiB
    log(f"disk: {free / GiB:.1f} GiB free under {base}, need ~{need / GiB:.1f} GiB")
    if free < need:
        raise SystemExit("not enough disk space")
    root = Path(tempfile.mkdtemp(prefix="canner-deliver-bench-", dir=base))
    log(f"work directory: {root}")
    log(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}")
    try:
        results: list[tuple[str, Run]] = []
        for name, count, size in workloads:
            data_dir = root / name / "data"
            start = time.time()
            ids = prepare(data_dir, count, size)
            log(
                f"\n== workload {name}: {count} x {size / MiB:.0f} MiB = "
                f"{count * size / GiB:.2f} GiB (prepared in {time.time() - start:.1f}s) =="
            )
            timeout = 600.0 if not args.quick else 300.0
            for concurrency in args.concurrency:
                run = run_deliver(root / name, data_dir, ids, size, concurrency, timeout)
                curl = run_curl(root / name, data_dir, ids, size, concurrency)
                results += [(name, run), (name, curl)]
                log(
                    f"  {run.label:16s} {fmt_rate(run.rate)}  ({run.seconds:6.2f}s)  deliver "
                    f"peak RSS (VmHWM) {run.peak_rss / MiB if run.peak_rss else 0:6.1f} MiB"
                )
                log(f"    {run.detail}")
                log(f"  {curl.label:16s} {fmt_rate(curl.rate)}  ({curl.seconds:6.2f}s)")
                log(
                    f"  ratio deliver/curl at parallelism {concurrency}: {run.rate / curl.rate:.2f}"
                )
            if name == "big" and not args.keep:
                shutil.rmtree(data_dir, ignore_errors=True)
        tick_bench(root, args.tick_rows)
        log("\n== summary ==")
        for name, run in results:
            rss = f"  VmHWM {run.peak_rss / MiB:6.1f} MiB" if run.peak_rss else ""
            log(f"  {name:6s} {run.label:16s} {fmt_rate(run.rate)}{rss}")
    finally:
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            log(f"removed {root}")


if __name__ == "__main__":
    main()
