"""HQ protocol benchmark: status queries, releases, and archiving into a ledger.

    .venv/bin/python bench/hq_bench.py [--rows 1000000] [--archive 1000000] [--seconds 10]
                                       [--concurrency 16] [--skip status,release,archive]

1. **Status queries**: a data directory whose ``delivery.sqlite`` holds ``--rows`` delivered
   objects (receipt files for a sample of them); a real ``twistd canner-receiver`` answers
   ``GET /api/v1/objects/{id}`` for sampled ids, driven by ``bench/node/get_load.js``
   (keep-alive, closed loop).  Prints queries/s, latency, and the receiver's CPU use (its reactor
   is one thread: queries/s per CPU-second is the one-core figure).
2. **Releases**: ``POST /api/v1/releases`` with batches of 1,000 ids of the same receiver
   (each answered only once its journal segment and index rows are durable); prints ids/s.
3. **Archiving**: a second data directory with ``--archive`` released, purged records (receipt
   and origin files each, their delivery records and releases in the facts journal, as in
   production), a real ``twistd canner-deliver`` with ``[ledger] delay = "0s"`` uploading to
   ``tests/fake_ia.py``, and ``canner ledger flush``; prints the time of each step and the
   deliver process's peak RSS.

Everything runs on loopback in a temporary directory under ``--work`` (removed at the end).
The machine is shared: numbers are noisy, run it twice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from canner.delivery.index import upgrade_schema  # noqa: E402
from canner.store.journal import (  # noqa: E402
    Journal,
    JournalLog,
    release_record,
)
from canner.store.receipts import (  # noqa: E402
    DeliveryRecord,
    Origin,
    delivery_journal_record,
    origin_journal_record,
)

VENV = ROOT / ".venv" / "bin"
TOKEN = "bench-token"
ISSUER = "https://canner.bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
T0 = 1_700_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def object_id(i: int) -> str:
    return hashlib.md5(str(i).encode(), usedforsecurity=False).hexdigest()


def receipt_bytes(oid: str) -> bytes:
    doc = {
        "id": f"receipt:{oid}",
        "issuer": ISSUER,
        "object_id": oid,
        "checksum": "blake3:" + oid * 2,
        "size_bytes": 1000,
        "accepted_at": T0,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def fill_index(db: Path, count: int, released: bool) -> None:
    """``count`` delivered, verified, purged rows (released too when ``released``), each with
    its delivery attempt in the history."""
    import sqlite3

    upgrade_schema(db)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    step = 50_000
    for start in range(0, count, step):
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO objects (object_id, project, filename, size_bytes, checksum,"
            " accepted_at, state, attempts, content_md5, remote_identifier, remote_name,"
            " delivered_at, verified_at, purge_after, purged_at, released_at, updated_at)"
            " VALUES (?, 'bench', 'f.warc', 1000, ?, ?, 'delivered', 1, ?, ?, 'f.warc',"
            " ?, ?, ?, ?, ?, ?)",
            [
                (
                    oid,
                    "blake3:" + oid * 2,
                    T0,
                    oid,
                    f"bench-{oid}",
                    T0 + 10,
                    T0 + 20,
                    T0 + 30,
                    T0 + 40,
                    (T0 + 50) if released else None,
                    T0 + 50,
                )
                for oid in map(object_id, range(start, min(count, start + step)))
            ],
        )
        # Each delivered object has its attempt in the history, which archiving deletes too.
        conn.executemany(
            "INSERT INTO attempts (object_id, attempt, started_at, ended_at, outcome)"
            " VALUES (?, 1, ?, ?, 'delivered')",
            [(object_id(i), T0 + 5, T0 + 10) for i in range(start, min(count, start + step))],
        )
        conn.execute("COMMIT")
    conn.close()


def write_files(data_dir: Path, ids: list[str], everything: bool) -> None:
    """The receipt of each id; with ``everything``, what a purged and released object has
    besides, as production makes it: its origin and delivery records appended to a journal log
    (the purge moved its origin file there) and its release in a journal segment of 1,000 ids
    (HQ's batch)."""
    receipts = data_dir / "receipts"
    for oid in ids:
        (receipts / f"{oid}.json").write_bytes(receipt_bytes(oid))
    if not everything:
        return
    journal = Journal(data_dir / "journal")
    log = JournalLog(journal)
    origin = Origin("bench", "f.warc")
    for start in range(0, len(ids), 1000):
        batch = ids[start : start + 1000]
        log.append(
            [
                record
                for oid in batch
                for record in (
                    origin_journal_record(oid, origin),
                    delivery_journal_record(oid, delivery(oid)),
                )
            ]
        )
        journal.append([release_record(oid, T0 + 50, "bench") for oid in batch])
    log.close()


def delivery(oid: str) -> DeliveryRecord:
    return DeliveryRecord(f"bench-{oid}", "f.warc", oid, T0 + 10, T0 + 20, T0 + 30, T0 + 40)


def config_text(work: Path, data_dir: Path, port: int, extra: str = "") -> Path:
    tokens = work / "tokens"
    tokens.write_text(f"bench sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}\n")
    path = work / f"canner-{data_dir.name}.toml"
    path.write_text(
        f'issuer = "{ISSUER}"\ndata_dir = "{data_dir}"\n'
        f'listen = "tcp:{port}:interface=127.0.0.1"\nmin_free_bytes = 1\naccess_log = false\n'
        # The metrics survey (index totals over every row) would run during the measurement:
        # once an hour here, so the numbers are the queries' own cost.
        '[metrics]\nrefresh = "1h"\n'
        f'[projects.bench]\n[hq]\ntokens = "{tokens}"\n{extra}'
    )
    return path


def pinned(cpu: int | None) -> list[str]:
    """``taskset -c CPU`` when pinning (the receiver on one core, the load on another)."""
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def spawn(role: str, config: Path, log: Path, cpu: int | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                *pinned(cpu),
                str(VENV / "twistd"),
                "--nodaemon",
                "--pidfile=",
                f"canner-{role}",
                "--config",
                str(config),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def settle(pid: int, timeout: float = 120.0) -> None:
    """Wait until the process is idle (its start-up survey and trend sample are done)."""
    deadline = time.monotonic() + timeout
    before = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cpu_seconds(pid)
        if now - before < 0.05:
            return
        before = now


def wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer within {timeout:.0f}s")
        time.sleep(0.1)


def status_and_release(
    work: Path, rows: int, seconds: float, concurrency: int, pin: bool
) -> dict[str, Any]:
    data = work / "status"
    (data / "receipts").mkdir(parents=True)
    (data / "uploads").mkdir()
    t = time.monotonic()
    fill_index(data / "delivery.sqlite", rows, released=False)
    sample = [object_id(i) for i in range(0, rows, max(1, rows // 20_000))]
    write_files(data, sample, everything=False)
    print(f"prepared {rows} rows, {len(sample)} receipts in {time.monotonic() - t:.1f}s")
    port = free_port()
    proc = spawn(
        "receiver", config_text(work, data, port), work / "receiver.log", 0 if pin else None
    )
    result: dict[str, Any] = {"rows": rows}
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/healthz")
        settle(proc.pid)
        load = work / "load.json"
        paths = [f"/api/v1/objects/{oid}" for oid in sample]
        load.write_text(
            json.dumps(
                {"base": base, "paths": paths, "concurrency": concurrency, "seconds": seconds}
            )
        )
        cpu0 = cpu_seconds(proc.pid)
        spy = None
        if os.environ.get("HQ_BENCH_PROFILE"):
            spy = subprocess.Popen(
                [
                    str(VENV / "py-spy"),
                    "record",
                    "-p",
                    str(proc.pid),
                    "-d",
                    str(int(seconds)),
                    "-f",
                    "raw",
                    "-o",
                    os.environ["HQ_BENCH_PROFILE"],
                    "--threads",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        out = subprocess.run(
            [*pinned(1 if pin else None), "node", str(BENCH / "node" / "get_load.js"), str(load)],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
            check=True,
        )
        cpu = cpu_seconds(proc.pid) - cpu0
        if spy is not None:
            spy.wait(60)
        got = json.loads(out.stdout)
        result["status"] = {
            **got,
            "per_s": got["requests"] / got["seconds"],
            "receiver_cpu_s": cpu,
            "per_cpu_s": got["requests"] / cpu if cpu else None,
        }
        # Releases: batches of 1,000 (the sampled ids: delivered and verified).
        batches = [sample[i : i + 1000] for i in range(0, len(sample), 1000)]
        released = 0
        t = time.monotonic()
        for batch in batches:
            body = json.dumps([f"receipt:{oid}" for oid in batch]).encode()
            req = urllib.request.Request(
                base + "/api/v1/releases",
                data=body,
                headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                answers = json.loads(r.read())["results"]
            released += sum(1 for a in answers if a["status"] == "released")
        elapsed = time.monotonic() - t
        assert released == len(sample), f"released {released} of {len(sample)}"
        result["release"] = {"ids": released, "seconds": elapsed, "per_s": released / elapsed}
    finally:
        stop(proc)
    shutil.rmtree(data, ignore_errors=True)
    return result


def archive(work: Path, count: int) -> dict[str, Any]:
    data = work / "archive"
    (data / "receipts").mkdir(parents=True)
    (data / "uploads").mkdir()
    t = time.monotonic()
    fill_index(data / "delivery.sqlite", count, released=True)
    step = 100_000
    for start in range(0, count, step):
        ids = [object_id(i) for i in range(start, min(count, start + step))]
        write_files(data, ids, everything=True)
    subprocess.run(["sync"], check=True)
    took = time.monotonic() - t
    print(f"prepared {count} archivable records (a receipt each, and the journal) in {took:.1f}s")
    fake_dir = work / "fake"
    fake_dir.mkdir()
    (work / "keys").write_text("bench-access\nbench-secret\n")
    fake = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "fake_ia.py"),
            "--port",
            "0",
            "--dir",
            str(fake_dir / "store"),
            "--port-file",
            str(fake_dir / "port"),
            "--access",
            "bench-access",
            "--secret",
            "bench-secret",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deliver = None
    try:
        while not (fake_dir / "port").exists():
            time.sleep(0.05)
        fake_url = f"http://127.0.0.1:{(fake_dir / 'port').read_text().strip()}"
        ledger = (
            f'[ledger]\nperiod = "day"\ndelay = "0s"\nnode = "bench"\n'
            f'credentials = "{work / "keys"}"\ns3_url = "{fake_url}"\n'
            f'metadata_url = "{fake_url}"\n'
        )
        config = config_text(work, data, free_port(), ledger)
        deliver = spawn("deliver", config, work / "deliver.log")
        peak = [0]
        running = threading.Event()
        running.set()

        def sample_rss() -> None:
            assert deliver is not None
            while running.is_set() and deliver.poll() is None:
                peak[0] = max(peak[0], rss_bytes(deliver.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        time.sleep(3)  # deliver is up (its start-up rescan holds the ledger until it ends)
        t = time.monotonic()
        out = subprocess.run(
            [str(VENV / "canner"), "ledger", "flush", "--timeout", "1800", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=2000,
            check=False,
        )
        elapsed = time.monotonic() - t
        running.clear()
        sampler.join()
        shutil.copy(work / "deliver.log", Path(tempfile.gettempdir()) / "hq_bench_deliver.log")
        if out.returncode != 0:
            raise SystemExit(f"flush failed: {out.stderr}")
        [doc] = [json.loads(line) for line in out.stdout.splitlines()]
        start = doc["created_at"]
        print(
            "ledger steps after assignment: "
            + ", ".join(
                f"{k} +{doc[k] - start:.1f}s"
                for k in ("written_at", "uploaded_at", "verified_at", "done_at")
            )
        )
        steps = [
            line
            for line in (work / "deliver.log").read_text().splitlines()
            if "ledger" in line or "rescan" in line or "busy" in line or "error" in line
        ]
        print("\n".join(line[:200] for line in steps))
        left = sum(1 for _ in os.scandir(data / "receipts"))
        return {
            "records": doc["records"],
            "ledger_bytes": doc["bytes"],
            "flush_seconds": elapsed,
            "deliver_peak_rss": peak[0],
            "receipt_files_left": left,
            "ledger": doc,
        }
    finally:
        if deliver is not None:
            stop(deliver)
        stop(fake)
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(fake_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--archive", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--skip", default="", help="comma-separated: status, archive")
    parser.add_argument(
        "--pin", action="store_true", help="receiver on CPU 0, load generator on CPU 1 (taskset)"
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(tempfile.mkdtemp(prefix="canner-hq-bench-", dir=args.work))
    results: dict[str, Any] = {}
    try:
        if "status" not in skip:
            results.update(
                status_and_release(work, args.rows, args.seconds, args.concurrency, args.pin)
            )
            s, r = results["status"], results["release"]
            print(
                f"status queries: {s['per_s']:.0f}/s over {s['seconds']:.1f}s"
                f" (p50 {s['p50_ms']:.1f} ms, p99 {s['p99_ms']:.1f} ms, {s['errors']} errors),"
                f" receiver CPU {s['receiver_cpu_s']:.1f}s = {s['per_cpu_s']:.0f} queries per"
                f" CPU-second; {args.rows} rows in the index"
            )
            print(
                f"releases: {r['per_s']:.0f} ids/s ({r['ids']} ids in batches of 1000,"
                f" {r['seconds']:.1f}s, durable)"
            )
        if "archive" not in skip:
            a = archive(work, args.archive)
            results["archive"] = a
            print(
                f"archive: {a['records']} records -> {a['ledger_bytes']} byte ledger, written,"
                f" uploaded, verified and local state deleted in {a['flush_seconds']:.1f}s;"
                f" deliver peak RSS {a['deliver_peak_rss'] / 2**20:.0f} MiB;"
                f" receipt files left {a['receipt_files_left']}"
            )
        print(json.dumps(results, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
