"""rsync intake benchmark: how long a worker's finished file waits for its receipt (adoption
latency) and how many files a receiver adopts per second (rate).

    .venv/bin/python bench/rsync_adoption.py [--files 1000] [--size 65536] [--samples 50]

A real ``twistd canner-receiver`` with ``[rsync]`` and a real ``rsync --daemon`` (configured by
``canner rsyncd-conf`` from ``conf/rsyncd/``) run on loopback from a fresh data directory under
the system's temp directory; files go up with seesaw's exact rsync command.

* Latency: ``--samples`` items sent one at a time, each by its own rsync run, as workers do; for
  each, the seconds from rsync's exit (the worker counts the item done) to its receipt on disk.
  This is the window in which a done item exists only as rsync's unsynced file.
* Rate: ``--files`` files sent by one rsync run; the seconds from its exit until the last receipt,
  and from its start, give files adopted per second.
* Adoption: the receiver's own ``canner_rsync_adoption_seconds`` (rsync's rename of each file into
  place -> its durable receipt), averaged over every file of both runs.

Needs the rsync package.  Everything is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SEESAW = [
    "-rltv",
    "--timeout=300",
    "--contimeout=300",
    "--progress",
    "--bwlimit",
    "0",
    "--recursive",
    "--min-size",
    "1",
    "--no-compress",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.002
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(interval)


def receipts(data: Path) -> int:
    return sum(1 for n in os.listdir(data / "receipts") if not n.endswith(".meta.json"))


def more_receipts(data: Path, than: int) -> bool:
    return receipts(data) > than


def send(src: Path, names: list[str], target: str) -> None:
    done = subprocess.run(
        ["rsync", *SEESAW, "--files-from=-", f"{src}/", target],
        input="".join(f"{n}\n" for n in names).encode(),
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"rsync failed: {done.stderr.decode()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000, help="files in the rate run")
    parser.add_argument("--size", type=int, default=65536, help="bytes per file")
    parser.add_argument("--samples", type=int, default=50, help="one-file items timed for latency")
    args = parser.parse_args()
    if shutil.which("rsync") is None:
        raise SystemExit("needs rsync")
    root = Path(tempfile.mkdtemp(prefix="canner-rsync-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        data, src = root / "data", root / "src"
        data.mkdir()
        src.mkdir()
        port, rsync_port = free_port(), free_port()
        config = root / "canner.toml"
        config.write_text(
            f'issuer = "https://canner.bench"\ndata_dir = "{data}"\n'
            f'listen = "tcp:{port}:interface=127.0.0.1"\nmin_free_bytes = 1\naccess_log = false\n'
            '[rsync]\nscan_interval = "10s"\n[projects.bench]\n',
            encoding="utf-8",
        )
        subprocess.run(
            [
                BIN / "canner",
                "rsyncd-conf",
                "--config",
                config,
                "--templates",
                REPO / "conf" / "rsyncd",
                "--runtime-dir",
                root,
                "--output",
                root / "rsyncd.conf",
            ],
            check=True,
        )
        log = open(root / "receiver.log", "wb")
        procs.append(
            subprocess.Popen(
                [BIN / "twistd", "--nodaemon", "--pidfile=", "canner-receiver", "--config", config],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        (data / "incoming" / "bench").mkdir(parents=True, exist_ok=True)
        as_root = ["--dparam=uid=0", "--dparam=gid=0"] if os.geteuid() == 0 else []
        procs.append(
            subprocess.Popen(
                [
                    "rsync",
                    "--daemon",
                    "--no-detach",
                    "--address=127.0.0.1",
                    f"--port={rsync_port}",
                    f"--config={root / 'rsyncd.conf'}",
                    f"--log-file={root / 'rsyncd.log'}",
                    *as_root,
                ],
            )
        )
        wait_until(lambda: (data / "adopting").is_dir(), 30, "the receiver", 0.05)
        time.sleep(0.5)
        target = f"rsync://127.0.0.1:{rsync_port}/bench/worker/"

        latencies = []
        for i in range(args.samples):
            name = f"item{i:05d}.warc.gz"
            (src / name).write_bytes(os.urandom(args.size))
            before = receipts(data)
            send(src, [name], target)
            exited = time.monotonic()
            wait_until(partial(more_receipts, data, before), 30, f"{name}'s receipt")
            latencies.append(time.monotonic() - exited)
            (src / name).unlink()
        if latencies:
            latencies.sort()
            p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
            print(
                f"latency, rsync exit -> receipt, {len(latencies)} one-file items:"
                f" median {statistics.median(latencies) * 1000:.1f} ms,"
                f" p95 {p95 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
            )

        names = [f"batch{i:05d}.warc.gz" for i in range(args.files)]
        for name in names:
            (src / name).write_bytes(os.urandom(args.size))
        before = receipts(data)
        started = time.monotonic()
        send(src, names, target)
        exited = time.monotonic()
        wait_until(lambda: receipts(data) >= before + args.files, 600, "every receipt", 0.01)
        ended = time.monotonic()
        print(
            f"rate, {args.files} files of {args.size} bytes in one rsync run:"
            f" rsync {exited - started:.2f} s, last receipt {ended - exited:.2f} s after its"
            f" exit; {args.files / (ended - started):.0f} files/s end to end"
        )
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        values = dict(
            line.split(" ", 1)
            for line in metrics.decode().splitlines()
            if line.startswith("canner_rsync_adoption_seconds_")
            and not line.startswith("canner_rsync_adoption_seconds_bucket")
        )
        count = float(values["canner_rsync_adoption_seconds_count"])
        total = float(values["canner_rsync_adoption_seconds_sum"])
        print(
            f"adoption, rsync's rename -> receipt (canner_rsync_adoption_seconds), {count:.0f}"
            f" files: mean {total / count * 1000:.1f} ms"
        )
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
