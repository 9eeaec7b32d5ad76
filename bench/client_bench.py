"""canner-upload benchmark: hashing against ``b3sum``, upload against ``curl``, client peak RSS.

    .venv/bin/python bench/client_bench.py [--size 4G] [--dir DIR] [--repeat 3] [--keep]

One file of ``--size`` pseudo-random bytes (default 4 GiB) is written into a temporary directory
under ``--dir`` (default: the system temp dir) and deleted at the end.

* Hashing: ``b3sum FILE`` against the client's own hasher (``canner_client.hashing.blake3_file``,
  run in a child process, timed around the call; the child's whole run is printed too), best of
  ``--repeat`` (at least 5) rounds, both on the same file, warm in the page cache.  Peak RSS of
  every child: its ``VmHWM``, sampled every 10 ms.
  Without ``b3sum`` (Debian: ``apt-get install b3sum``) the baseline is the blake3 module's
  ``update_mmap`` with all threads (the same Rust code b3sum runs), and the table says so.
* Upload: one ``twistd canner-receiver`` on loopback (fresh data directory per run).  Baseline:
  the creation ``POST`` with ``requests``, then ``curl -X PATCH -T FILE`` with the tus headers,
  timed from curl's start to its exit (the answer comes after the receiver's acceptance: its fsync
  and BLAKE3 of the stored file).  Client: ``Client.upload`` (what ``canner-upload`` runs) in a
  child process; its upload time is from its first ``uploading`` event to the receipt (the span
  curl's time covers), and its total includes its own hashing.  Runs alternate curl and client.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_support import Receiver  # noqa: E402

MiB = 1 << 20
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_file(path: Path, size: int) -> None:
    block = random.Random(1).randbytes(16 * MiB)
    with open(path, "wb") as f:
        written, n = 0, 0
        while written < size:
            piece = (n.to_bytes(8, "big") + block[8:])[: size - written]
            f.write(piece)
            written += len(piece)
            n += 1
        f.flush()
        os.fsync(f.fileno())


def _hwm(pid: int) -> int:
    """VmHWM of ``pid`` in bytes (0 once it is gone).  Unlike ``ru_maxrss`` of a child, this
    is the peak of the program itself, not of the interpreter forked to start it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(
    argv: list[str], stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL
) -> tuple[float, int, int]:
    """Run ``argv``; (wall seconds, exit status, peak RSS bytes sampled every 10 ms)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _hwm(proc.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - started
    return wall, proc.returncode, peak


HASH_CHILD = """
import sys, time
from canner_client.hashing import blake3_file
t = time.perf_counter(); checksum, n = blake3_file(sys.argv[1])
print(checksum, time.perf_counter() - t)
"""

MMAP_CHILD = """
import sys, time, blake3
t = time.perf_counter(); h = blake3.blake3(max_threads=blake3.blake3.AUTO)
h.update_mmap(sys.argv[1]); print("blake3:" + h.hexdigest(), time.perf_counter() - t)
"""

UPLOAD_CHILD = """
import json, sys, time
from canner_client import Client
first = []
def progress(ev):
    if ev.phase == "uploading" and not first:
        first.append(time.perf_counter())
t = time.perf_counter()
receipt = Client(sys.argv[1], state_dir=sys.argv[2]).upload(sys.argv[3], "example",
                                                            progress=progress)
end = time.perf_counter()
print(json.dumps({"total": end - t, "upload": end - first[0], "size": receipt.size_bytes}))
"""


def bench_hashing(path: Path, size: int, repeat: int) -> dict[str, Any]:
    b3sum = shutil.which("b3sum")
    results: dict[str, Any] = {"baseline": "b3sum" if b3sum else "blake3.update_mmap (no b3sum)"}
    base_times, client_times, client_rss, base_rss = [], [], [], []
    client_process: list[float] = []
    checksums = set()
    os.sync()
    for i in range(repeat):
        log(f"hashing, round {i + 1}/{repeat}")
        if b3sum:
            wall, rc, rss = run_measured([b3sum, "--no-names", str(path)])
            assert rc == 0
        else:
            wall, rc, rss = run_measured([sys.executable, "-c", MMAP_CHILD, str(path)])
        base_times.append(wall)
        base_rss.append(rss)
        with tempfile.TemporaryFile("w+") as out:
            wall, rc, rss = run_measured([sys.executable, "-c", HASH_CHILD, str(path)], out)
            assert rc == 0
            out.seek(0)
            checksum, inside = out.read().split()
            checksums.add(checksum)
        # The hashing itself, as inside canner-upload; the interpreter's start-up and imports
        # (paid once per run, whatever the file size) are reported apart.
        client_times.append(float(inside))
        client_process.append(wall)
        client_rss.append(rss)
    assert len(checksums) == 1
    results.update(
        baseline_s=min(base_times),
        client_s=min(client_times),
        client_process_s=min(client_process),
        baseline_gib_s=size / min(base_times) / (1 << 30),
        client_gib_s=size / min(client_times) / (1 << 30),
        baseline_rss=max(base_rss),
        client_rss=max(client_rss),
    )
    results["ratio"] = results["baseline_s"] / results["client_s"]
    return results


def curl_upload(receiver: Receiver, path: Path, size: int, checksum: str) -> tuple[float, int]:
    r = receiver.create(size, checksum, project="example", filename=path.name)
    assert r.status_code == 201, r.text
    # Path-absolute (/files/<id>) unless public_url is set: resolve it as a tus client does.
    location = urljoin(receiver.files_url, r.headers["Location"])
    with tempfile.TemporaryFile("w+") as out:
        wall, rc, rss = run_measured(
            [
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                "PATCH",
                "-H",
                "Tus-Resumable: 1.0.0",
                "-H",
                "Upload-Offset: 0",
                "-H",
                "Content-Type: application/offset+octet-stream",
                "-H",
                "Expect:",
                "-T",
                str(path),
                location,
            ],
            stdout=out,
        )
        out.seek(0)
        code = out.read().strip()
    assert rc == 0 and code == "204", f"curl exit {rc}, HTTP {code}"
    return wall, rss


def client_upload(receiver: Receiver, path: Path, work: Path) -> tuple[dict[str, Any], int]:
    state = work / "state"
    shutil.rmtree(state, ignore_errors=True)
    with tempfile.TemporaryFile("w+") as out:
        wall, rc, rss = run_measured(
            [sys.executable, "-c", UPLOAD_CHILD, receiver.base_url, str(state), str(path)], out
        )
        out.seek(0)
        text = out.read()
    assert rc == 0, text
    result: dict[str, Any] = json.loads(text)
    result["process_s"] = wall
    return result, rss


def bench_upload(path: Path, size: int, work: Path, repeat: int, checksum: str) -> dict[str, Any]:
    curl_times, curl_rss, client_runs, client_rss = [], [], [], []
    for i in range(repeat):
        for who in ("curl", "client") if i % 2 == 0 else ("client", "curl"):
            log(f"upload with {who}, round {i + 1}/{repeat}")
            root = work / f"receiver-{who}-{i}"
            receiver = Receiver.in_dir(root, max_upload_bytes=size + MiB)
            receiver.start()
            # The receiver fsyncs the upload before it answers: start each run with no dirty
            # pages left from the previous one, so that runs do not pay for each other.
            os.sync()
            try:
                if who == "curl":
                    wall, rss = curl_upload(receiver, path, size, checksum)
                    curl_times.append(wall)
                    curl_rss.append(rss)
                else:
                    run, rss = client_upload(receiver, path, work)
                    client_runs.append(run)
                    client_rss.append(rss)
            finally:
                receiver.close()
                shutil.rmtree(root, ignore_errors=True)
    best_client = min(client_runs, key=lambda r: r["upload"])
    log("curl runs (s): " + ", ".join(f"{t:.2f}" for t in curl_times))
    log("client upload parts (s): " + ", ".join(f"{r['upload']:.2f}" for r in client_runs))
    return {
        "curl_s": min(curl_times),
        "client_upload_s": best_client["upload"],
        "client_total_s": min(r["total"] for r in client_runs),
        "curl_mib_s": size / min(curl_times) / MiB,
        "client_mib_s": size / best_client["upload"] / MiB,
        "ratio": min(curl_times) / best_client["upload"],
        "curl_rss": max(curl_rss),
        "client_rss": max(client_rss),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if shutil.disk_usage(args.dir).free < 2.2 * args.size:
        print(f"need {2.2 * args.size / (1 << 30):.1f} GiB free in {args.dir}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="canner-client-bench-", dir=args.dir))
    try:
        path = work / "artifact.warc"
        log(f"writing {args.size / (1 << 30):.2f} GiB to {path}")
        write_file(path, args.size)
        hashing = bench_hashing(path, args.size, max(5, args.repeat))
        from canner_client.hashing import blake3_file

        checksum, _ = blake3_file(str(path))
        upload = bench_upload(path, args.size, work, args.repeat, checksum)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    gib = args.size / (1 << 30)
    print(
        f"canner-upload benchmark: one {gib:.2f} GiB file, best of {args.repeat}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"hashing  {hashing['baseline']:<28} {hashing['baseline_s']:6.2f} s "
        f"{hashing['baseline_gib_s']:6.2f} GiB/s  peak RSS {hashing['baseline_rss'] / MiB:7.1f} MiB"
    )
    print(
        f"hashing  {'canner_client':<28} {hashing['client_s']:6.2f} s "
        f"{hashing['client_gib_s']:6.2f} GiB/s  peak RSS {hashing['client_rss'] / MiB:7.1f} MiB"
        f"  -> {100 * hashing['ratio']:.0f} % of the baseline"
    )
    print(
        f"hashing  canner_client as a process (Python start-up and imports included) "
        f"{hashing['client_process_s']:.2f} s"
    )
    print(
        f"upload   {'curl -X PATCH -T':<28} {upload['curl_s']:6.2f} s "
        f"{upload['curl_mib_s']:6.0f} MiB/s  peak RSS {upload['curl_rss'] / MiB:7.1f} MiB"
    )
    print(
        f"upload   {'canner-upload (PATCH part)':<28} {upload['client_upload_s']:6.2f} s "
        f"{upload['client_mib_s']:6.0f} MiB/s  peak RSS {upload['client_rss'] / MiB:7.1f} MiB"
        f"  -> {100 * upload['ratio']:.0f} % of curl"
    )
    print(
        f"upload   canner-upload total (hash + upload + receipt) {upload['client_total_s']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
