"""Directory sink benchmark: copy throughput of :class:`canner.sinks.directory.DirectorySink`
against ``cp`` followed by ``sync FILE`` (the same bytes made durable), and the verification
re-read.

    .venv/bin/python bench/directory_bench.py [--size-mib 1024] [--count 2] [--src DIR] [--dest DIR]

The payloads are written to a temp directory under ``--src`` and copied to one under ``--dest``
(both default to the system's temp directory; point ``--dest`` at another filesystem to measure a
cross-filesystem copy, where ``copy_file_range`` gives way to read and write).  Each sink copy
runs as in canner-deliver: a real reactor, the copy in a thread of the I/O pool, the hash in a
thread of the hash pool.  Page cache: every payload is read once before timing, so both sides
read from memory and the numbers compare the write paths.  Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import attrs  # noqa: E402
import blake3  # noqa: E402
from twisted.internet import defer, task  # noqa: E402
from twisted.internet.threads import deferToThread  # noqa: E402

from canner.blocking import BlockingRunner  # noqa: E402
from canner.delivery.index import ObjectRow  # noqa: E402
from canner.delivery.objects import plan_row  # noqa: E402
from canner.sinks.directory import DirectoryDelivery, DirectorySink  # noqa: E402

MiB = 1 << 20


def write_payload(path: Path, size: int) -> tuple[str, str]:
    block = os.urandom(4 * MiB)
    b3, md5 = blake3.blake3(), hashlib.md5(usedforsecurity=False)
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = block[: min(left, len(block))]
            f.write(chunk)
            b3.update(chunk)
            md5.update(chunk)
            left -= len(chunk)
    return "blake3:" + b3.hexdigest(), md5.hexdigest()


def row(object_id: str, size: int, checksum: str, md5: str) -> ObjectRow:
    return ObjectRow(
        object_id,
        "bench",
        "payload.bin",
        size,
        checksum,
        1784764800,
        "delivering",
        1,
        0.0,
        None,
        0,
        md5,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--count", type=int, default=2)
    parser.add_argument("--src", type=Path, default=None)
    parser.add_argument("--dest", type=Path, default=None)
    args = parser.parse_args()
    size = args.size_mib * MiB
    base = Path(tempfile.mkdtemp(prefix="canner-dirbench-", dir=args.dest))
    src = Path(tempfile.mkdtemp(prefix="canner-dirbench-src-", dir=args.src))
    try:
        dst, cp_dst = base / "archive", base / "cp"
        for d in (dst, cp_dst):
            d.mkdir()
        payloads = []
        for i in range(args.count):
            object_id = f"{i:032x}"
            path = src / object_id
            checksum, md5 = write_payload(path, size)
            payloads.append((object_id, path, checksum, md5))
        subprocess.run(["sync"], check=True)

        started = time.monotonic()
        for _, path, _, _ in payloads:
            target = cp_dst / path.name
            subprocess.run(["cp", str(path), str(target)], check=True)
            subprocess.run(["sync", str(target)], check=True)
        cp_s = time.monotonic() - started
        shutil.rmtree(cp_dst)  # room for the sink's copies on a small destination

        results: dict[str, float] = {}

        async def run_sink(reactor: Any) -> None:
            in_thread = cast(BlockingRunner, deferToThread)

            config = DirectoryDelivery(
                sink="directory",
                identifier="bench-{object_id}",
                remote_name="{filename}",
                local_artifact_retention=60.0,
                path=str(dst),
            )
            reactor.getThreadPool().adjustPoolsize(2, 4)
            sink = DirectorySink.for_delivery("bench", config, in_thread, in_thread, reactor)
            rows = [plan_row(config, row(o, size, c, m)) for o, _, c, m in payloads]
            t0 = time.monotonic()
            done = []
            for r, (_, path, _, _) in zip(rows, payloads, strict=True):
                done.append(await sink.deliver(r, path, lambda copied: None))
            results["copy_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            for r, d in zip(rows, done, strict=True):
                check = await sink.verify(
                    attrs.evolve(r, identifier=d.identifier, remote_name=d.remote_name)
                )
                assert check.verified, check
            results["verify_s"] = time.monotonic() - t0

        task.react(lambda reactor: defer.ensureDeferred(run_sink(reactor)), [])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
        total = args.count * size / MiB
        print(f"payloads: {args.count} x {args.size_mib} MiB, {src} -> {base}")
        print(f"cp + sync FILE      : {total / cp_s:8.1f} MiB/s ({cp_s:.2f} s)")
        copy_s, verify_s = results["copy_s"], results["verify_s"]
        print(f"DirectorySink copy  : {total / copy_s:8.1f} MiB/s ({copy_s:.2f} s, with fsyncs)")
        print(f"DirectorySink verify: {total / verify_s:8.1f} MiB/s ({verify_s:.2f} s, BLAKE3)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
