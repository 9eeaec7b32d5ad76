"""How fast could a Python/Twisted tus receiver take small uploads on this machine at all?

    .venv/bin/python bench/receiver_floor.py [--count 2000] [--concurrency 16] [--rounds 3]

Runs the small-upload scenario of ``receiver_bench.py`` (the same ``bench/node/load.js`` client,
64 KiB bodies, 16 at a time) against stripped-down receivers written only for this measurement,
next to canner itself, the Go canner peer (``go``) and @tus/server, and prints uploads/s, latency
and server CPU per upload.
The stripped-down receivers keep canner's storage work per upload and drop everything else:

- the syscalls of a creation (data file, sidecar by rename) and of an acceptance (write, fsync of
  data, sidecar and ``uploads/``; origin and receipt written to temp files, fsynced, linked;
  ``receipts/`` fsynced), plus BLAKE3 of the stored bytes, run in Twisted's thread pool;
- no routing, no validation, no metrics, no logging, no admission, no locks.

Variants: ``web`` answers through ``twisted.web`` (what Klein sits on); ``raw`` through a bare
``Protocol`` that parses just enough HTTP/1.1 for this client (Content-Length bodies,
keep-alive), the leanest request path Twisted allows; ``-nosync`` drops every fsync.  What the
stripped-down receivers reach is an upper bound for any receiver built on the same stack with
the same durability, not a design: they are not tus servers anyone should run.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
from receiver_bench import (
    CannerServer,
    GoCannerServer,
    Payloads,
    Scenario,
    Server,
    TusServer,
    _proc_user_sys,
    ensure_node_modules,
    free_port,
    run_load,
)

from tests.go_peer import GO_PEER

KiB = 1024
Answer = tuple[int, dict[str, str]]  # status, headers

# -- the stripped-down receivers (run in a child process: ``serve``) --------------------------


class Storage:
    """canner's per-upload syscalls, nothing else.  Blocking: call from a thread."""

    def __init__(self, root: Path, sync: bool) -> None:
        self.uploads = root / "uploads"
        self.receipts = root / "receipts"
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.receipts.mkdir(parents=True, exist_ok=True)
        self.sync = sync

    def _fsync(self, path: Path, directory: bool = False) -> None:
        if self.sync:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write(self, path: Path, data: bytes, flags: int) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, data)
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _publish(self, name: str, data: bytes) -> None:
        temp = self.receipts / f".tmp-{name}-{secrets.token_hex(6)}"
        self._write(temp, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.link(temp, self.receipts / name)
        os.unlink(temp)

    def create(self, length: int, metadata: str) -> Answer:
        oid = secrets.token_hex(16)
        os.close(os.open(self.uploads / oid, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        info = json.dumps({"id": oid, "size": length, "metadata": metadata}).encode()
        temp = self.uploads / f".tmp-{oid}.info"
        temp.write_bytes(info)
        os.replace(temp, self.uploads / f"{oid}.info")
        return 201, {"Location": f"/files/{oid}", "Tus-Resumable": "1.0.0"}

    def accept(self, oid: str, body: bytes) -> Answer:
        """Store ``body`` as the whole upload; answer with its receipt."""
        info = json.loads((self.uploads / f"{oid}.info").read_bytes())
        self._write(self.uploads / oid, body, os.O_WRONLY)
        self._fsync(self.uploads / f"{oid}.info")
        self._fsync(self.uploads, directory=True)
        self._publish(f"{oid}.meta.json", json.dumps({"metadata": info["metadata"]}).encode())
        digest = blake3.blake3((self.uploads / oid).read_bytes()).hexdigest()
        receipt = json.dumps(
            {"object_id": oid, "checksum": f"blake3:{digest}", "size_bytes": len(body)}
        ).encode()
        self._publish(f"{oid}.json", receipt)
        self._fsync(self.receipts, directory=True)
        header = base64.urlsafe_b64encode(receipt).rstrip(b"=").decode()
        return 204, {
            "Upload-Offset": str(len(body)),
            "Artifact-Receipt": header,
            "Tus-Resumable": "1.0.0",
        }


def serve_web(storage: Storage, port: int) -> None:
    from twisted.internet import reactor as installed
    from twisted.internet import threads
    from twisted.internet.defer import Deferred
    from twisted.web import resource, server

    reactor: Any = installed

    class Files(resource.Resource):
        isLeaf = True

        def render(self, request: Any) -> Any:
            def done(answer: Answer) -> None:
                code, headers = answer
                request.setResponseCode(code)
                for name, value in headers.items():
                    request.setHeader(name, value)
                request.finish()

            method = request.method
            if method == b"OPTIONS":
                return b""
            d: Deferred[Answer]
            if method == b"POST":
                length = int(request.getHeader("upload-length"))
                metadata = request.getHeader("upload-metadata") or ""
                d = threads.deferToThread(storage.create, length, metadata)
            else:
                oid = request.postpath[-1].decode()
                d = threads.deferToThread(storage.accept, oid, request.content.read())
            d.addCallback(done)
            return server.NOT_DONE_YET

    reactor.suggestThreadPoolSize(16)
    reactor.listenTCP(port, server.Site(Files()), interface="127.0.0.1")
    reactor.run()


def serve_raw(storage: Storage, port: int) -> None:
    from twisted.internet import protocol, threads
    from twisted.internet import reactor as installed
    from twisted.internet.defer import Deferred

    reactor: Any = installed

    class Raw(protocol.Protocol):
        """HTTP/1.1 for this one client: request line, headers, Content-Length body."""

        def __init__(self) -> None:
            self.buffer = b""

        def dataReceived(self, data: bytes) -> None:
            self.buffer += data
            while True:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buffer[:end].decode("latin-1").split("\r\n")
                headers = {}
                for line in head[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                if len(self.buffer) < end + 4 + length:
                    return
                body = self.buffer[end + 4 : end + 4 + length]
                self.buffer = self.buffer[end + 4 + length :]
                self.handle(head[0].split(" "), headers, body)

        def handle(self, line: list[str], headers: dict[str, str], body: bytes) -> None:
            method, path = line[0], line[1]
            if method == "OPTIONS":
                self.answer((204, {}))
                return
            d: Deferred[Answer]
            if method == "POST":
                length, metadata = int(headers["upload-length"]), headers.get("upload-metadata", "")
                d = threads.deferToThread(storage.create, length, metadata)
            else:
                d = threads.deferToThread(storage.accept, path.rsplit("/", 1)[1], body)
            d.addCallback(self.answer)

        def answer(self, answer: Answer) -> None:
            code, headers = answer
            reason = {201: "Created", 204: "No Content"}[code]
            lines = [f"HTTP/1.1 {code} {reason}"]
            lines += [f"{name}: {value}" for name, value in headers.items()]
            if code != 204:
                lines.append("Content-Length: 0")
            assert self.transport is not None
            self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    reactor.suggestThreadPoolSize(16)
    reactor.listenTCP(port, protocol.Factory.forProtocol(Raw), interface="127.0.0.1")
    reactor.run()


SERVERS: dict[str, Callable[[Storage, int], None]] = {"web": serve_web, "raw": serve_raw}


def serve(variant: str, port: int, root: Path) -> None:
    kind, _, sync = variant.partition("-")
    SERVERS[kind](Storage(root, sync != "nosync"), port)


# -- the measurement ----------------------------------------------------------------------------


class FloorServer(Server):
    """A stripped-down receiver in a child process, started and stopped like the others."""

    def __init__(self, work: Path, variant: str) -> None:
        self.name = variant
        self.port = free_port()
        self.data_dir = work / f"floor-{variant}"
        self.log_path = work / f"floor-{variant}.log"
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "serve", variant, str(self.port), str(self.data_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()


def measure(work: Path, name: str, args: argparse.Namespace, specs: list[dict[str, Any]]) -> str:
    server: Server
    if name == "canner":
        server = CannerServer(work, max_upload=1 << 30)
    elif name == "@tus/server":
        server = TusServer(work)
    elif name == "go":
        server = GoCannerServer(work)
    else:
        server = FloorServer(work, name)
    scenario = Scenario(
        "small", "small", len(specs), specs[0]["size"], args.concurrency, "uploads/s"
    )
    try:
        before = sum(_proc_user_sys(server.pid))
        result = run_load(work, server, scenario, specs, args, name.replace("/", "-"))
        after = sum(_proc_user_sys(server.pid))
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(server.data_dir)], check=False)
    if result.get("fatal") or result.get("failures"):
        return f"{name:<14} failed: {result.get('fatal') or result.get('failureSamples')}"
    latencies = sorted(result["latenciesMs"])
    rate = result["ok"] / result["wallSeconds"]
    p50 = statistics.median(latencies)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    cost = (after - before) / result["ok"] * 1000
    return f"{name:<14} {rate:8.1f} {p50:8.1f} {p99:8.1f} {cost:9.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument(
        "--servers",
        default="canner,go,@tus/server,web,web-nosync,raw,raw-nosync",
        help="comma list of: canner, go (the Go canner peer, skipped where it is absent),"
        " @tus/server, web, web-nosync, raw, raw-nosync",
    )
    args = p.parse_args()
    servers = args.servers.split(",")
    if "go" in servers and not (GO_PEER / "start.sh").exists():
        print(f"skipping go: no Go canner peer at {GO_PEER}", file=sys.stderr)
        servers.remove("go")
    # The load settings run_load reads from receiver_bench's arguments.
    args.max_seconds, args.patch_size, args.chunk = None, 0, 1 << 20
    args.head_interval_ms = args.head_baseline = 0
    ensure_node_modules()
    with tempfile.TemporaryDirectory(prefix="canner-floor-") as tmp:
        work = Path(tmp)
        payloads = Payloads.create(work, 64 << 20)
        specs = payloads.specs(args.count, 64 * KiB)
        print(f"{args.count} x 64 KiB, concurrency {args.concurrency}, {args.rounds} rounds")
        print(f"{'server':<14} {'uploads/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/up':>9}")
        for round_ in range(args.rounds):
            for name in servers:
                print(measure(work, name, args, specs), flush=True)
            if round_ + 1 < args.rounds:
                print()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
