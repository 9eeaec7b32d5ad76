#!/usr/bin/env python3
"""What the status page's survey, ``canner status`` and ``canner show <prefix>`` cost on a node
that holds many objects (issue 37).

Builds a data directory of N objects under /tmp directly with canner's store and index code
(sparse payloads, one index transaction per batch), in the states a busy node holds: 30 %
accepted with the payload waiting in ``uploads/``, 60 % delivered and purged (receipt and
origin record left), 5 % released and archived (the receipt left for the ledger to delete),
1 % flagged for an operator (payload waiting), 4 % waiting for a retry, plus ``--partial``
uploads in flight (no receipt).  Then times, each ``--repeat`` times (the best and the worst):
the status page's survey (``take_survey(history=True)``), ``canner status`` and ``canner show
<8-character prefix>`` as processes.  ``--code DIR`` runs the timings with another checkout's
``canner`` (e.g. main, ``git archive main | tar -x -C DIR``) on the same directory, so one run
compares both.  Removes the directory afterwards (unless ``--keep``).

    .venv/bin/python bench/survey_bench.py -n 100000 --code /tmp/canner-main
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
BATCH = 5000
PAYLOAD = 64 << 10  # sparse: no blocks written


def build(root: Path, n: int, partial: int) -> tuple[Path, str]:
    """The data directory and a config naming it; returns the config and one object id."""
    sys.path.insert(0, str(HERE))
    from canner.checksum import parse_checksum
    from canner.delivery import index as sql
    from canner.delivery import outbound
    from canner.ids import ObjectIds
    from canner.store.receipts import DeliveryRecord, Origin, Receipt
    from canner.store.uploads import UploadDoor, UploadInfo

    data = root / "data"
    uploads, receipts = data / "uploads", data / "receipts"
    for d in (uploads, receipts):
        d.mkdir(parents=True)
    sql.upgrade_schema(data / "delivery.sqlite")
    conn = sqlite3.connect(data / "delivery.sqlite")
    conn.execute("PRAGMA synchronous=OFF")
    ids = ObjectIds()
    checksum = parse_checksum("blake3:" + "ab" * 32)
    now = time.time()
    sample = ""

    def write(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)

    def payload(oid: str, size: int, stored: int, accepted: bool) -> None:
        fd = os.open(uploads / oid, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fd, stored)
        os.close(fd)
        meta = {"project": "example", "filename": f"{oid}.warc.zst"}
        if accepted:
            meta["checksum"] = str(checksum)
        info = UploadInfo(oid, size, meta, int(now) - 60, door=UploadDoor.TUS)
        write(uploads / f"{oid}.info", info.to_json())

    done = 0
    while done < n:
        batch = []
        cur = conn.cursor()
        for i in range(done, min(done + BATCH, n)):
            oid = ids.new()
            sample = sample or oid
            share = i % 100
            receipt = Receipt(oid, "https://canner.test", checksum, PAYLOAD, int(now) - 3600)
            write(receipts / f"{oid}.json", receipt.to_json())
            if 90 <= share < 95:  # released and archived: only the receipt is left
                continue
            origin = Origin("example", f"{oid}.warc.zst")
            write(receipts / f"{oid}.meta.json", origin.to_json(oid))
            delivery = None
            if share < 60:
                delivery = DeliveryRecord(
                    "item",
                    f"{oid}.warc.zst",
                    "0" * 32,
                    now - 3000,
                    now - 2000,
                    now - 1000,
                    now - 900,
                )
            else:
                payload(oid, PAYLOAD, PAYLOAD, accepted=True)
            batch.append((sql.AcceptedObject.of(receipt, origin, delivery), share))
        sql.insert_objects(cur, [o for o, _ in batch], now)
        failed = [(o.object_id, "boom") for o, share in batch if 95 <= share]
        cur.executemany(
            "UPDATE outbound SET state = 'retry_wait', attempts = 3, last_error = ?,"
            " updated_at = ? WHERE kind = 'object' AND ref = ?",
            [(err, now, oid) for oid, err in failed],
        )
        outbound.flag(
            cur, sql.OBJECT, [(o.object_id, "403") for o, share in batch if share == 99], now
        )
        conn.commit()
        done += BATCH
    for i in range(partial):
        payload(ids.new(), 1 << 20, (i * 4096) % (1 << 20), accepted=False)
    conn.close()
    config = root / "canner.toml"
    config.write_text(
        f'issuer = "https://canner.test"\ndata_dir = "{data}"\nmin_free_bytes = 1\n\n'
        "[projects.example]\n",
        encoding="utf-8",
    )
    return config, sample


SURVEY = (
    "import sys, time; from pathlib import Path; from canner.ids import ObjectIds;"
    " from canner.ops.inventory import take_survey; t = time.perf_counter();"
    " s = take_survey(Path(sys.argv[1]), ObjectIds(), time.time(), history=True);"
    " print(time.perf_counter() - t, len(s.active_uploads))"
)


def timed(cmd: list[str], code: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(code)}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=code, check=False, capture_output=True, text=True)
    if done.returncode not in (0, 1, 2) or "Traceback" in done.stderr:
        raise SystemExit(f"{cmd} failed ({done.returncode}): {done.stderr}")
    return time.perf_counter() - start


def survey_s(code: Path, data: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run(
        [sys.executable, "-c", SURVEY, str(data)],
        env=env,
        cwd=code,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0])


def measure(code: Path, config: Path, data: Path, sample: str, repeat: int) -> dict[str, str]:
    cli = [sys.executable, "-m", "canner.cli"]
    figures = {
        "page survey": lambda: survey_s(code, data),
        "canner status": lambda: timed([*cli, "status", "--config", str(config)], code),
        "canner show <prefix>": lambda: timed(
            [*cli, "show", sample[:8], "--config", str(config)], code
        ),
    }
    found = {}
    for name, run in figures.items():
        times = sorted(run() for _ in range(repeat))
        found[name] = f"{times[0]:.3f} s (worst {times[-1]:.3f} s)"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=100_000, help="objects held")
    parser.add_argument("--partial", type=int, default=10_000, help="uploads in flight")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--code",
        type=Path,
        action="append",
        default=[],
        help="another checkout to time on the same directory (repeatable)",
    )
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    need = (args.n * 3 + args.partial * 2) * 4096 * 2
    free = shutil.disk_usage("/tmp").free
    if free < need:
        print(f"refusing: /tmp has {free} bytes free, this run needs about {need}")
        return 2
    root = Path(tempfile.mkdtemp(prefix="canner-survey-bench-", dir="/tmp"))
    try:
        start = time.perf_counter()
        config, sample = build(root, args.n, args.partial)
        print(f"built N={args.n} + {args.partial} partial in {time.perf_counter() - start:.1f} s")
        for code in [HERE, *args.code]:
            for name, value in measure(code, config, root / "data", sample, args.repeat).items():
                print(f"{code.name:>20}  {name:<22} {value}")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
