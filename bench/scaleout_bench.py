"""Scale-out benchmark: canner nodes behind HAProxy (the shipped conf/haproxy/canner.cfg), per
node uploads/s and MiB/s (bench/README.md, "Scale-out benchmark").

    .venv/bin/python bench/scaleout_bench.py [--nodes 1,3] [--quick] [--json FILE]

For each node count it starts that many ``canner-receiver`` processes (each its own data
directory, issuer and node prefix) and one HAProxy in front of them, drives the proxy with the
receiver benchmark's Node load generator (``bench/node/load.js``: creation, one streamed PATCH,
the receipt checked), then counts the receipts on each node's disk to attribute the work.  Two
scenarios: ``small`` (many small uploads: uploads/s) and ``big`` (fewer large ones: MiB/s).
Every process runs on this machine, so with N nodes they share its cores and its disk: the
one-node row is what one node does with the machine to itself; the N-node rows show how the
proxy spreads the work and what it costs.  Delivery is not running (bench/deliver_bench.py
measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from receiver_bench import (
    CLK_TCK,
    ROOT,
    TWISTD,
    GiB,
    KiB,
    MiB,
    Payloads,
    free_port,
    human_size,
    log,
    machine_facts,
    parse_size,
    run_load,
    wait_idle,
    work_dir,
)

sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from cluster_support import SHIPPED_CFG, haproxy_config, map_file

PROJECT = "bench"
START_TIMEOUT = 60.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its reaped children so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / CLK_TCK


@dataclass
class Node:
    prefix: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes]

    def receipts(self) -> tuple[int, int]:
        """Receipts on disk and their bytes (from the receipts themselves)."""
        count = size = 0
        for path in (self.data_dir / "receipts").glob("*.json"):
            if path.name.count(".") != 1:
                continue  # .meta.json and friends
            count += 1
            size += int(json.loads(path.read_bytes())["size_bytes"])
        return count, size


def start_node(work: Path, prefix: str, max_upload: int) -> Node:
    port = free_port()
    data_dir = work / prefix
    data_dir.mkdir()
    config = work / f"{prefix}.toml"
    config.write_text(
        f'issuer = "https://{prefix}.canner.bench"\n'
        f"data_dir = {json.dumps(str(data_dir))}\n"
        f'listen = "tcp:{port}:interface=127.0.0.1"\n'
        f'node_prefix = "{prefix}"\n'
        f"max_upload_bytes = {max_upload}\n"
        "min_free_bytes = 1\n"
        'partial_upload_retention = "30m"\n'
        f"\n[projects.{PROJECT}]\n"
    )
    with (work / f"{prefix}.log").open("ab") as out:
        proc = subprocess.Popen(
            [
                str(TWISTD),
                "--nodaemon",
                "--pidfile=",
                "--logger=canner.logs.json_observer",
                "canner-receiver",
                "--config",
                str(config),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return Node(prefix, port, data_dir, proc)


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    import urllib.request

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: {what} exited with {proc.returncode} at start")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"bench: {what} did not answer {url} in {START_TIMEOUT:.0f}s")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass(frozen=True)
class Front:
    """HAProxy in front of the nodes, as the load generator sees it."""

    base: str
    name: str


@dataclass
class Result:
    nodes: int
    scenario: str
    count: int
    size: int
    wall_s: float
    ok: int
    failed: int
    per_node: dict[str, tuple[int, int]]  # prefix -> (uploads, bytes)
    node_cpu: float  # cores, all nodes together
    proxy_cpu: float  # cores

    @property
    def uploads_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def mib_per_s(self) -> float:
        return sum(b for _, b in self.per_node.values()) / MiB / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "scenario": self.scenario,
            "count": self.count,
            "size": self.size,
            "wall_s": round(self.wall_s, 3),
            "ok": self.ok,
            "failed": self.failed,
            "uploads_per_s": round(self.uploads_per_s, 2),
            "mib_per_s": round(self.mib_per_s, 2),
            "per_node": {p: {"uploads": u, "bytes": b} for p, (u, b) in self.per_node.items()},
            "node_cpu_cores": round(self.node_cpu, 2),
            "proxy_cpu_cores": round(self.proxy_cpu, 2),
        }


def run_cluster(
    work: Path, n: int, scenario: str, count: int, size: int, concurrency: int, args: Any
) -> Result:
    root = work / f"{n}-nodes-{scenario}"
    root.mkdir()
    nodes = [start_node(root, f"n{i + 1}", max(size, MiB)) for i in range(n)]
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for node in nodes:
            wait_ready(f"http://127.0.0.1:{node.port}/readyz", node.proc, node.prefix)
        port = free_port()
        (root / "canner-nodes.map").write_text(map_file([x.prefix for x in nodes]))
        config = haproxy_config(
            port,
            {x.prefix: x.port for x in nodes},
            root / "canner-nodes.map",
            root / "haproxy.sock",
            SHIPPED_CFG.read_text(),
        ).replace("    log stdout format raw local0\n", "")
        (root / "haproxy.cfg").write_text(config)
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        with (root / "haproxy.log").open("ab") as out:
            proxy = subprocess.Popen(
                [haproxy, "-db", "-f", str(root / "haproxy.cfg")],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        # Ready once every node passed its /readyz checks (rise 2, inter 2s).
        time.sleep(5)
        wait_ready(f"http://127.0.0.1:{port}/healthz", proxy, "haproxy")
        payloads = Payloads.create(root, args.pool)
        specs = payloads.specs(count, size)
        front = Front(base=f"http://127.0.0.1:{port}/files/", name="canner")
        subprocess.run(["sync"], check=False)
        wait_idle(args.idle_wait, len(os.sched_getaffinity(0)))
        pids = [x.proc.pid for x in nodes]
        before = [cpu_seconds(p) for p in pids], cpu_seconds(proxy.pid)
        started = time.monotonic()
        load_args = SimpleNamespace(
            max_seconds=args.max_seconds,
            patch_size=0,
            chunk=MiB,
            head_interval_ms=0,
            head_baseline=False,
        )
        loaded = run_load(root, front, _scenario(count, size, concurrency), specs, load_args, "s")
        elapsed = time.monotonic() - started
        after = [cpu_seconds(p) for p in pids], cpu_seconds(proxy.pid)
        if "fatal" in loaded or loaded.get("timedOut"):
            raise SystemExit(f"bench: the load failed: {loaded.get('fatal', 'timed out')}")
        wall = float(loaded.get("wallSeconds") or elapsed)
        return Result(
            nodes=n,
            scenario=scenario,
            count=count,
            size=size,
            wall_s=wall,
            ok=int(loaded["ok"]),
            failed=count - int(loaded["ok"]),
            per_node={x.prefix: x.receipts() for x in nodes},
            node_cpu=(sum(after[0]) - sum(before[0])) / elapsed,
            proxy_cpu=(after[1] - before[1]) / elapsed,
        )
    finally:
        if proxy is not None:
            stop(proxy, signal.SIGUSR1)  # HAProxy's graceful stop
        for node in nodes:
            stop(node.proc)
        shutil.rmtree(root, ignore_errors=True)


def _scenario(count: int, size: int, concurrency: int) -> Any:
    # The fields run_load reads from receiver_bench.Scenario.
    return SimpleNamespace(
        count=count, size=size, concurrency=concurrency, total_bytes=count * size, head_probe=False
    )


def print_report(facts: dict[str, Any], results: list[Result]) -> None:
    print()
    print(
        f"machine: {facts['nproc']} cores ({facts['cpu']}), {facts['mem_total_gib']} GiB,"
        f" {facts['work_fs']} at {facts['work_dir']}, dd+fsync {facts.get('dd_fsync_mib_s')} MiB/s"
    )
    print("every process (nodes, HAProxy, load generator) shares this machine: see bench/README.md")
    print()
    header = (
        f"{'nodes':>5}  {'scenario':<22} {'uploads/s':>9} {'MiB/s':>8}  "
        f"{'per node uploads/s':<24} {'per node MiB/s':<24} {'nodes CPU':>9} {'proxy CPU':>9}"
        f" {'fail':>4}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        per_up = " ".join(f"{u / r.wall_s:.1f}" for u, _ in r.per_node.values())
        per_mib = " ".join(f"{b / MiB / r.wall_s:.1f}" for _, b in r.per_node.values())
        label = f"{r.scenario} {r.count}x{human_size(r.size)}"
        print(
            f"{r.nodes:>5}  {label:<22} {r.uploads_per_s:>9.1f} {r.mib_per_s:>8.1f}  "
            f"{per_up:<24} {per_mib:<24} {r.node_cpu:>9.2f} {r.proxy_cpu:>9.2f} {r.failed:>4}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="1,3", help="node counts to run, comma-separated")
    p.add_argument("--quick", action="store_true", help="small counts and sizes (~1 minute)")
    p.add_argument("--small-count", type=int, default=2000)
    p.add_argument("--small-size", type=parse_size, default=64 * KiB)
    p.add_argument("--small-concurrency", type=int, default=16)
    p.add_argument("--big-count", type=int, default=24)
    p.add_argument("--big-size", type=parse_size, default=128 * MiB)
    p.add_argument("--big-concurrency", type=int, default=6)
    p.add_argument("--pool", type=parse_size, default=64 * MiB, help="random payload pool")
    p.add_argument("--work-root", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")))
    p.add_argument("--idle-wait", type=float, default=15.0)
    p.add_argument("--max-seconds", type=float, default=0.0)
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.small_count, args.big_count, args.big_size = 300, 8, 32 * MiB
        args.idle_wait = 5.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    if not (shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists()):
        raise SystemExit("bench: haproxy is not installed (apt-get install haproxy)")
    with work_dir(args.work_root) as work:
        need = max(args.small_count * args.small_size, args.big_count * args.big_size) + GiB
        if shutil.disk_usage(work).free < need:
            raise SystemExit(f"bench: {work} has less than {human_size(need)} free")
        facts = machine_facts(work, 256 * MiB)
        results = []
        for n in counts:
            for scenario, count, size, concurrency in (
                ("small", args.small_count, args.small_size, args.small_concurrency),
                ("big", args.big_count, args.big_size, args.big_concurrency),
            ):
                log(f"{n} node(s), {scenario}: {count} x {human_size(size)}, {concurrency} at once")
                results.append(run_cluster(work, n, scenario, count, size, concurrency, args))
        print_report(facts, results)
        if args.json:
            args.json.write_text(
                json.dumps({"machine": facts, "results": [r.as_dict() for r in results]}, indent=2)
            )
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
