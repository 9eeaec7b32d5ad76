"""Multipart delivery benchmark: one big file to the fake Internet Archive over a link that drops
the connection every few GiB, and how many bytes that costs (issue 26: goal under 1.1x the file).

    .venv/bin/python bench/multipart_bench.py [--size 20G] [--part-size 512M] [--cut-every 3G]
        [--dir DIR] [--keep]

The file is sparse (it reads as zeros) but every byte of it is read, hashed (its MD5 once for the
plan, each part's MD5 before the part is sent) and sent for real: canner's :class:`IAClient` (the
production HTTP client, a thread runner) sends it as an S3 multipart upload to the fake IA
(``tests/fake_ia.py``, its own process), through a cutting proxy (this file with
``--serve-proxy``, its own process) that aborts the connection carrying the request whenever the
bytes it has forwarded towards the fake pass the next cut, ``--cut-every`` after the last one
give or take half (seeded by ``--seed``).  Attempts are
repeated at once until the file is delivered (canner's outbound service would wait a minute or more
between attempts; this measures bytes, not backoff).

Reported: bytes canner handed to the connection, part body bytes the fake received (its
``/_fake/multipart`` counter), both against the file size; cuts, attempts, wall time.  The fake
keeps every part and then the whole file, so it needs about twice ``--size`` of disk (checked
first).  Everything written is removed at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from twisted.internet.defer import Deferred

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

P = ParamSpec("P")
T = TypeVar("T")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


# -- the cutting proxy (its own process) ---------------------------------------------------------


def serve_proxy(
    target_port: int, cut_every: int, port_file: Path, stats_file: Path, seed: int
) -> None:
    """Forward 127.0.0.1:<ephemeral> to 127.0.0.1:target_port; abort the connection whose
    client-to-server bytes carry the running total past the next cut, which comes after
    ``cut_every`` bytes give or take half (seeded: a fixed period would always cut the same
    distance into a part, which says more about the period than about the parts)."""
    jitter = random.Random(seed)

    def gap() -> int:
        return int(cut_every * jitter.uniform(0.5, 1.5))

    state = {"forwarded": 0, "next_cut": gap(), "cuts": 0}

    def save() -> None:
        stats_file.write_text(json.dumps(state))

    async def pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: bool,
        other: asyncio.StreamWriter,
    ) -> None:
        try:
            while data := await reader.read(1 << 18):
                if upstream:
                    state["forwarded"] += len(data)
                    if state["forwarded"] >= state["next_cut"]:
                        state["next_cut"] += gap()
                        state["cuts"] += 1
                        save()
                        for w in (writer, other):
                            w.transport.abort()
                        return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.transport.abort()
            return
        await asyncio.gather(
            pipe(client_r, server_w, True, client_w),
            pipe(server_r, client_w, False, server_w),
        )
        save()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        save()
        port_file.write_text(str(port))
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the run -------------------------------------------------------------------------------------


def in_thread(f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
    """The blocking runner: the reactor's thread pool."""
    from twisted.internet.threads import deferToThread

    return deferToThread(f, *args, **kwargs)


def make_sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def file_md5(path: Path) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            md5.update(chunk)
    return md5.hexdigest()


async def deliver_until_done(
    args: argparse.Namespace, root: Path, fake: Any, proxy_url: str
) -> dict[str, Any]:
    from deliver_support import ACCESS, SECRET
    from twisted.internet import reactor
    from twisted.internet.task import deferLater
    from twisted.internet.threads import deferToThread

    from canner.sinks.ia.client import IAClient
    from canner.sinks.ia.config import IADelivery
    from canner.sinks.ia.credentials import Credentials
    from canner.sinks.ia.multipart import PartJournal
    from canner.sinks.plan import plan_upload
    from canner.sinks.transport import make_http_client

    path = root / "payload.warc.zst"
    make_sparse(path, args.size)
    started = time.monotonic()
    md5 = await deferToThread(file_md5, path)
    hashed = time.monotonic() - started
    config = IADelivery(
        sink="internet_archive",
        credentials=root / "unused",
        identifier="bench-{object_id}",
        remote_name="{filename}",
        local_artifact_retention=60.0,
        s3_url=proxy_url,
        metadata_url=fake.url,
    )
    plan = plan_upload(config, "bench", "0" * 32, path.name, 0, args.size, md5)
    sink = IAClient(
        http=make_http_client(reactor),
        clock=reactor,
        credentials=Credentials(ACCESS, SECRET),
        s3_url=proxy_url,
        metadata_url=fake.url,
        run=in_thread,
        check_limit=False,
        multipart_threshold=1,
        multipart_part_size=args.part_size,
        journal=PartJournal(root / "multipart"),
        no_progress_timeout=60.0,
    )
    sent = 0
    attempts = 0
    began = time.monotonic()
    while True:
        attempts += 1
        result = await sink.deliver(plan, path)
        sent += result.bytes_sent
        print(
            f"  attempt {attempts}: {result.outcome.verdict.value} {result.outcome.reason}"
            f" ({result.bytes_sent / 2**30:.2f} GiB sent)",
            flush=True,
        )
        if result.delivered:
            break
        if attempts >= 50:
            raise SystemExit("gave up after 50 attempts")
        await deferLater(reactor, 1.0, lambda: None)
    took = time.monotonic() - began
    stored = fake.object(plan.identifier, plan.remote_name)
    assert stored is not None and stored["md5"] == md5, stored
    received = fake.multipart()["part_bytes"][f"{plan.identifier}/{plan.remote_name}"]
    return {
        "size": args.size,
        "part_size": args.part_size,
        "cut_every": args.cut_every,
        "attempts": attempts,
        "sent": sent,
        "received": received,
        "upload_s": took,
        "hash_s": hashed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("20G"))
    parser.add_argument("--part-size", type=parse_size, default=parse_size("512M"))
    parser.add_argument("--cut-every", type=parse_size, default=parse_size("3G"))
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument(
        "--serve-proxy", nargs=5, metavar=("TARGET", "CUT", "PORTFILE", "STATS", "SEED")
    )
    args = parser.parse_args()
    if args.serve_proxy:
        target, cut, port_file, stats, seed = args.serve_proxy
        serve_proxy(int(target), int(cut), Path(port_file), Path(stats), int(seed))
        return

    from deliver_support import FakeIA

    root = Path(tempfile.mkdtemp(prefix="canner-multipart-bench-", dir=args.dir))
    free = shutil.disk_usage(root).free
    if free < 2 * args.size + (1 << 30):
        raise SystemExit(f"need {2 * args.size + (1 << 30)} bytes free in {root}, have {free}")
    fake = FakeIA(root / "fake")
    proxy = None
    try:
        fake.start()
        port_file, stats_file = root / "proxy.port", root / "proxy.json"
        proxy = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-proxy",
                str(fake.port),
                str(args.cut_every),
                str(port_file),
                str(stats_file),
                str(args.seed),
            ]
        )
        deadline = time.monotonic() + 10
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit("the cutting proxy did not start")
            time.sleep(0.05)
        proxy_url = f"http://127.0.0.1:{port_file.read_text().strip()}"

        from twisted.internet import reactor

        outcome: dict[str, Any] = {}

        the_reactor: Any = reactor

        def run() -> None:
            d = Deferred.fromCoroutine(deliver_until_done(args, root, fake, proxy_url))
            d.addCallback(outcome.update)
            d.addErrback(lambda f: outcome.setdefault("error", f.getTraceback()))
            d.addBoth(lambda _: the_reactor.stop())

        the_reactor.callWhenRunning(run)
        the_reactor.run()
        if "error" in outcome:
            raise SystemExit(outcome["error"])
        cuts = json.loads(stats_file.read_text())["cuts"]
        size = outcome["size"]
        gib = 2**30
        print(
            f"file {size / gib:.2f} GiB in parts of {outcome['part_size'] / 2**20:.0f} MiB,"
            f" a cut every {outcome['cut_every'] / gib:.2f} GiB (+-50%) forwarded: {cuts} cuts,"
            f" {outcome['attempts']} attempt(s)\n"
            f"canner sent {outcome['sent'] / gib:.2f} GiB = {outcome['sent'] / size:.3f}x the"
            f" file; the fake received {outcome['received'] / gib:.2f} GiB of part bodies ="
            f" {outcome['received'] / size:.3f}x\n"
            f"upload {outcome['upload_s']:.0f} s"
            f" ({size / outcome['upload_s'] / 2**20:.0f} MiB/s of file),"
            f" plus {outcome['hash_s']:.0f} s for the file's MD5"
        )
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        fake.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
