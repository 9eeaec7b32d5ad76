"""Receiver benchmark: canner-receiver against stock @tus/server on the same load (bench/README.md).

    ./dev bench [--quick] [--profile] [--json FILE] [sizes and selections, see --help]

Starts each server itself on loopback (canner through ``twistd canner-receiver``, @tus/server
through ``node bench/node/tus_server.js``), drives both with the one Node load generator
(``bench/node/load.js``), samples the server's RSS and CPU while it runs, and prints a table with
the ratio canner / @tus/server per scenario.  Every server gets a fresh process and a fresh data
directory per scenario; data directories are removed as soon as a scenario ends.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import blake3

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
NODE_DIR = BENCH / "node"
TWISTD = ROOT / ".venv" / "bin" / "twistd"
sys.path.insert(0, str(ROOT))
from tests.go_peer import GO_PEER  # noqa: E402  (the Go canner built for side-by-side runs)

PY_SPY = ROOT / ".venv" / "bin" / "py-spy"

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
POOL_SIZE = 64 * MiB
PROJECT = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
RSS_INTERVAL = 0.05
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


# -- small helpers ------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+)\s*(B|KiB|MiB|GiB|K|M|G)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 65536, 64KiB, 64MiB or 1GiB")
    unit = {"B": 1, "K": KiB, "KiB": KiB, "M": MiB, "MiB": MiB, "G": GiB, "GiB": GiB}
    return int(match.group(1)) * unit.get(match.group(2) or "B", 1)


def human_size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p99 of fewer than 100 samples is the maximum)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fs_type(path: Path) -> str:
    out = subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- machine facts ------------------------------------------------------------------------------


def machine_facts(work: Path, dd_bytes: int) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": _cpu_model(),
        "mem_total_gib": round(_meminfo("MemTotal") / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "node": subprocess.run(
            ["node", "--version"], capture_output=True, text=True
        ).stdout.strip(),
        "work_dir": str(work),
        "work_fs": fs_type(work),
        "canner_commit": _git_head(),
    }
    target = work / "dd-probe.bin"
    count = max(1, dd_bytes // MiB)
    log(f"dd {count} MiB with conv=fsync into {work} ...")
    start = time.monotonic()
    try:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fsync"],
            capture_output=True,
            check=True,
            timeout=600,
        )
        seconds = time.monotonic() - start
        facts["dd_fsync_mib_s"] = round(count / seconds, 1)
        facts["dd_bytes"] = count * MiB
    finally:
        target.unlink(missing_ok=True)
    return facts


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * KiB
    return 0


def _git_head() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


# -- payloads -----------------------------------------------------------------------------------


@dataclass
class Payloads:
    """A random pool file; upload i sends pool bytes from its offset, wrapping around."""

    path: Path
    data: bytes
    _cache: dict[tuple[int, int], str] = field(default_factory=dict)

    @classmethod
    def create(cls, work: Path, size: int) -> Payloads:
        data = os.urandom(size)
        path = work / "pool.bin"
        path.write_bytes(data)
        return cls(path, data)

    def checksum(self, offset: int, size: int) -> str:
        key = (offset % len(self.data), size)
        if key not in self._cache:
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            view = memoryview(self.data)
            pos, left = key[0], size
            while left:
                n = min(left, len(view) - pos)
                hasher.update(view[pos : pos + n])
                left -= n
                pos = (pos + n) % len(view)
            self._cache[key] = f"blake3:{hasher.hexdigest()}"
        return self._cache[key]

    def specs(self, count: int, size: int) -> list[dict[str, Any]]:
        # Distinct content per upload: offsets 1 MiB + 4 KiB apart.
        step = MiB + 4 * KiB
        out = []
        for i in range(count):
            offset = (i * step) % len(self.data)
            out.append({"offset": offset, "size": size, "checksum": self.checksum(offset, size)})
        return out


# -- servers ------------------------------------------------------------------------------------


class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/files/"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} at start; log:\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            if self._ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {START_TIMEOUT:.0f}s")

    def _ready(self) -> bool:
        req = urllib.request.Request(self.base, method="OPTIONS")
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return bool(resp.status < 300)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log(f"{self.name} ignored SIGTERM for {STOP_TIMEOUT:.0f}s; killing")
                self.proc.kill()
                self.proc.wait(10)


def _knows_workers(tree: Path) -> bool:
    """Whether the canner in ``tree`` reads ``[receiver] workers`` (added in #36)."""
    config = tree / "canner" / "config.py"
    return config.exists() and "_RECEIVER_KEYS" in config.read_text()


class CannerServer(Server):
    name = "canner"

    def __init__(
        self,
        work: Path,
        max_upload: int,
        access_log: bool = True,
        workers: int = 1,
        tree: Path | None = None,
    ) -> None:
        self.workers = workers
        if workers > 1:
            self.name = f"{self.name} w{workers}"
        self.port = free_port()
        self.data_dir = work / "canner-data"
        self.data_dir.mkdir()
        config = work / "canner-bench.toml"
        config.write_text(
            f'issuer = "http://127.0.0.1:{self.port}"\n'
            f"data_dir = {json.dumps(str(self.data_dir))}\n"
            f'listen = "tcp:{self.port}:interface=127.0.0.1"\n'
            f"max_upload_bytes = {max_upload}\n"
            "min_free_bytes = 1\n"
            'partial_upload_retention = "30m"\n'
            f"access_log = {'true' if access_log else 'false'}\n"
            # Always named: its default is every core, so a one-process row must say 1 (a
            # --base-tree from before the key runs one process anyway, and would refuse it).
            + (f"\n[receiver]\nworkers = {workers}\n" if _knows_workers(tree or ROOT) else "")
            + f"\n[projects.{PROJECT}]\n"
        )
        self.log_path = work / "canner.log"
        env = dict(os.environ)
        if tree is not None:
            # Another checkout's canner (its package first on the path), run by this venv.
            env["PYTHONPATH"] = str(tree)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(TWISTD),
                    "--nodaemon",
                    "--pidfile=",
                    # as under systemd: JSON lines (and the access log) on stdout
                    "--logger=canner.logs.json_observer",
                    "canner-receiver",
                    "--config",
                    str(config),
                ],
                cwd=tree or ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_ready()

    def _ready(self) -> bool:
        # A node of several workers is measured once every worker serves the socket.
        return len(process_tree(self.pid)) >= (self.workers + 1 if self.workers > 1 else 1) and (
            super()._ready()
        )


class CannerBaseServer(CannerServer):
    """canner-receiver from another checkout (``--base-tree``, e.g. main), beside this one's:
    named ``canner@`` and the checkout's folder name."""

    def __init__(self, work: Path, max_upload: int, access_log: bool, tree: Path) -> None:
        self.name = base_name(tree)
        super().__init__(work, max_upload, access_log, tree=tree)


def base_name(tree: Path) -> str:
    return f"canner@{tree.name}"


class CannerPutServer(CannerServer):
    """The same canner-receiver, loaded through its seesaw PUT target instead of tus."""

    name = "canner PUT"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/seesaw/{PROJECT}/bench/"

    def _ready(self) -> bool:
        if len(process_tree(self.pid)) < (self.workers + 1 if self.workers > 1 else 1):
            return False
        # The PUT target answers no OPTIONS: the tus endpoint of the same process does.
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/files/", method="OPTIONS")
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return bool(resp.status < 300)
        except OSError:
            return False


class GoCannerServer(Server):
    """The Go canner (saveweb/canner, built from its source: the peer's README), started by its
    own ``start.sh PORT DIR``: tus at ``/files/``, as durable as upstream ships it, answering the
    final PATCH with an ``Artifact-Receipt`` as canner does."""

    name = "Go canner"

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.root = work / "go-canner"
        self.data_dir = self.root / "data"
        self.log_path = work / "go-canner.log"
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                # start.sh execs the server: the pid sampled is the Go process's own.
                ["sh", str(GO_PEER / "start.sh"), str(self.port), str(self.root)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_ready()


class TusServer(Server):
    name = "@tus/server"

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.data_dir = work / "tus-data"
        self.data_dir.mkdir()
        self.log_path = work / "tus.log"
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                ["node", "tus_server.js", "--port", str(self.port), "--dir", str(self.data_dir)],
                cwd=NODE_DIR,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_ready()


def ensure_node_modules() -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise SystemExit("bench: node and npm are required (./dev installs them)")
    if not (NODE_DIR / "node_modules" / "@tus" / "server").is_dir():
        log("npm install in bench/node ...")
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--silent"],
            cwd=NODE_DIR,
            check=True,
            timeout=600,
        )


# -- sampling -----------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a canner node's parent and its workers)."""
    children: defaultdict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def _tree_user_sys(pids: Sequence[int]) -> dict[int, tuple[float, float]]:
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            found[pid] = _proc_user_sys(pid)
    return found


def _proc_user_sys(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK  # utime, stime


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


PF_KTHREAD = 0x00200000


def _kernel_thread_seconds() -> dict[int, float]:
    """CPU seconds of every kernel thread (writeback kworkers, jbd2, ksoftirqd, ...), by pid."""
    out: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[6]) & PF_KTHREAD:
                out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def _machine_ticks() -> tuple[int, int, int]:
    """(busy, iowait, total) jiffies over all CPUs."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = values[3], values[4]
    total = sum(values[:8])
    return total - idle - iowait, iowait, total


def _thread_cpu_seconds(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of every live thread of ``pid``, by native thread id."""
    out: dict[int, tuple[float, float]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                fields = Path(f"{entry.path}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(entry.name)] = (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)
    return out


class Sampler:
    """Samples a server's VmRSS every 50 ms; its CPU time (whole process, and per thread: the
    main thread is the reactor); whole-machine CPU use.  A server of several processes (a
    canner node: its parent and workers) is measured over all of them: CPU summed, and the peak
    RSS both of the largest single process (``peak_rss_kib``) and of all together
    (``peak_total_rss_kib``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_rss_kib = 0
        self.peak_total_rss_kib = 0
        self.processes = 1
        self.main_tids: set[int] = {pid}
        self.thread_cpu_s: dict[int, float] = {}
        self.thread_sys_s: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        pids = process_tree(self.pid)
        self._cpu0 = _tree_user_sys(pids)
        self._threads0: dict[int, tuple[float, float]] = {}
        for pid in pids:
            self._threads0.update(_thread_cpu_seconds(pid))
        self._machine0 = _machine_ticks()
        self._kernel0 = _kernel_thread_seconds()
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in process_tree(self.pid):
                with contextlib.suppress(OSError, ValueError):
                    rss = _status_kib(pid, "VmRSS")
                    self.peak_rss_kib = max(self.peak_rss_kib, rss)
                    total += rss
            self.peak_total_rss_kib = max(self.peak_total_rss_kib, total)
            self._stop.wait(RSS_INTERVAL)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.monotonic() - self._t0
        pids = process_tree(self.pid)
        self.processes = len(pids)
        for pid in pids:
            with contextlib.suppress(OSError, ValueError):
                # The processes are fresh per scenario, so their high-water marks are its own.
                self.peak_rss_kib = max(self.peak_rss_kib, _status_kib(pid, "VmHWM"))
        cpu1 = _tree_user_sys(pids)
        # A process that started during the run counts from zero.
        self.server_user_s = sum(u - self._cpu0.get(p, (0.0, 0.0))[0] for p, (u, _) in cpu1.items())
        self.server_sys_s = sum(s - self._cpu0.get(p, (0.0, 0.0))[1] for p, (_, s) in cpu1.items())
        self.server_cpu_s = self.server_user_s + self.server_sys_s
        self.main_tids = set(pids)
        threads1: dict[int, tuple[float, float]] = {}
        for pid in pids:
            threads1.update(_thread_cpu_seconds(pid))
        for tid, (user, system) in threads1.items():
            user0, system0 = self._threads0.get(tid, (0.0, 0.0))
            self.thread_cpu_s[tid] = user - user0 + system - system0
            self.thread_sys_s[tid] = system - system0
        kernel1 = _kernel_thread_seconds()
        self.kernel_threads_s = sum(
            cpu - self._kernel0.get(pid, 0.0) for pid, cpu in kernel1.items()
        )
        busy1, iowait1, total1 = _machine_ticks()
        busy0, iowait0, total0 = self._machine0
        span = max(1, total1 - total0)
        self.machine_busy = (busy1 - busy0) / span
        self.machine_iowait = (iowait1 - iowait0) / span

    @property
    def main_thread_cores(self) -> float:
        """CPU of the main (reactor) threads, in cores (of every process of a node)."""
        return sum(self.thread_cpu_s.get(pid, 0.0) for pid in self.main_tids) / self.wall


# -- profiling ----------------------------------------------------------------------------------


class Profiler:
    """py-spy record on the receiver while a scenario runs (raw collapsed stacks)."""

    def __init__(self, pid: int, out: Path, gil: bool) -> None:
        self.out = out
        self.gil = gil
        command = [str(PY_SPY), "record", "--pid", str(pid), "--rate", "100", "--format", "raw"]
        command += ["--threads", "--nonblocking", "--output", str(out)]
        if gil:
            command.append("--gil")
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> str | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return "py-spy did not stop"
        if not self.out.exists():
            return "py-spy wrote nothing: " + err.decode(errors="replace")[-500:]
        return None


def summarize_profile(path: Path, sampler: Sampler, gil: bool, top: int = 12) -> str:
    """Top frames of a raw py-spy profile, by thread group, next to each group's true CPU time.

    py-spy counts a sample for every thread that is not idle: running Python, or inside a call
    such as pwrite/fsync (or, with --gil, only the thread holding the GIL).  CPU time comes from
    /proc/PID/task/TID/stat, which py-spy's thread ids (native ids) let us group by name.
    """
    groups: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    group_leaf: dict[str, Counter[str]] = defaultdict(Counter)
    tid_group: dict[int, str] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        group = "?"
        match = re.match(r"thread \((\w+)\)(?:: ?(.*))?", frames[0])
        if match is not None:
            group = _thread_group(match.group(2) or "unnamed thread")
            if match.group(1).isdigit():
                tid_group[int(match.group(1))] = group
        frames = [f for f in frames if not f.startswith(("thread ", "process "))]
        if not frames:
            continue
        total += count
        groups[group] += count
        leaf[_short(frames[-1])] += count
        group_leaf[group][_short(frames[-1])] += count
        for name in {_short(f) for f in frames if "canner/" in f}:
            inclusive[name] += count
    if not total:
        return "  (no samples)"
    wall = sampler.wall
    cpu: defaultdict[str, float] = defaultdict(float)
    system: defaultdict[str, float] = defaultdict(float)
    for tid, seconds in sampler.thread_cpu_s.items():
        group = tid_group.get(tid, "threads py-spy never saw running")
        cpu[group] += seconds
        system[group] += sampler.thread_sys_s.get(tid, 0.0)
    what = "GIL-holding" if gil else "non-idle (running, or in a syscall such as pwrite/fsync)"
    lines = [f"  {total} py-spy samples at 100 Hz of {what} threads over {wall:.1f}s"]
    lines.append("  by thread group: samples share | CPU from /proc (cores, kernel share)")
    for name in sorted(set(groups) | set(cpu), key=lambda g: -cpu[g]):
        kernel = f"{100 * system[name] / cpu[name]:3.0f}% sys" if cpu[name] else "   -    "
        share = 100 * groups[name] / total
        lines.append(f"    {share:5.1f}%  {cpu[name] / wall:5.2f} cores {kernel}  {name}")
    lines.append("  self time (leaf frame), all threads:")
    for name, n in leaf.most_common(top):
        lines.append(f"    {100 * n / total:5.1f}%  {name}")
    lines.append("  canner functions, inclusive:")
    for name, n in inclusive.most_common(top):
        lines.append(f"    {100 * n / total:5.1f}%  {name}")
    for group, counter in sorted(group_leaf.items(), key=lambda kv: -groups[kv[0]])[:4]:
        lines.append(f"  self time in {group}:")
        for name, n in counter.most_common(8):
            lines.append(f"    {100 * n / groups[group]:5.1f}%  {name}")
    return "\n".join(lines)


def _thread_group(name: str) -> str:
    name = name.strip()
    if name == "MainThread":
        return "MainThread (reactor)"
    if re.fullmatch(r"PoolThread-\d+-\d+", name):
        return "PoolThread-<id> (adbapi: delivery.sqlite)"
    return re.sub(r"-\d+$", "-*", name) or "?"


def _short(frame: str) -> str:
    # "function (path/to/module.py:123)" -> "function (module.py:123)"
    match = re.match(r"(.*) \((.*):(\d+)\)$", frame)
    if match is None:
        return frame
    func, path, line = match.groups()
    parts = Path(path).parts
    where = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{func} ({where}:{line})"


# -- scenarios ----------------------------------------------------------------------------------


@dataclass
class Scenario:
    key: str
    label: str
    count: int
    size: int
    concurrency: int
    unit: str  # "MiB/s" or "uploads/s"
    head_probe: bool = False

    @property
    def total_bytes(self) -> int:
        return self.count * self.size


@dataclass
class Run:
    scenario: Scenario
    server: str
    result: dict[str, Any]
    sampler: Sampler | None
    sync_s: float = 0.0
    profile: str | None = None
    rep: int = 0
    # head scenario, canner: seconds `b3sum` takes over the stored file (page cache warm, as
    # the receiver's own hash found it), to set the finalize window against.
    b3sum_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.result.get("timedOut") and "fatal" not in self.result

    @property
    def rate(self) -> float | None:
        return self._rate(0.0)

    @property
    def durable_rate(self) -> float | None:
        """The rate counting the time a filesystem sync took after the last response."""
        return self._rate(self.sync_s)

    def _rate(self, extra_seconds: float) -> float | None:
        r = self.result
        if not self.ok or not r.get("wallSeconds"):
            return None
        seconds = float(r["wallSeconds"]) + extra_seconds
        if self.scenario.unit == "MiB/s":
            return float(r["bytes"]) / MiB / seconds
        return float(r["ok"]) / seconds

    def latency(self, p: float) -> float | None:
        return percentile(self.result.get("latenciesMs", []), p)

    @property
    def cost(self) -> float | None:
        """Server CPU per unit of work: CPU-seconds per GiB, or CPU-ms per upload (small)."""
        r, s = self.result, self.sampler
        if s is None or not self.ok or not r.get("ok"):
            return None
        if self.scenario.unit == "MiB/s":
            return s.server_cpu_s / (float(r["bytes"]) / GiB) if r.get("bytes") else None
        return s.server_cpu_s * 1000 / float(r["ok"])

    @property
    def kernel_cores(self) -> float | None:
        """Cores used by kernel threads: page-cache writeback, the ext4 journal, softirqs."""
        s = self.sampler
        return None if s is None else s.kernel_threads_s / s.wall

    def other_cores(self, nproc: int) -> float | None:
        """Cores busy with neither the server, the load generator nor kernel threads (noise
        from other processes on the machine)."""
        s, client, kernel = self.sampler, self.client_cpu, self.kernel_cores
        if s is None or client is None or kernel is None:
            return None
        return max(0.0, s.machine_busy * nproc - s.server_cpu_s / s.wall - client - kernel)

    @property
    def client_cpu(self) -> float | None:
        r = self.result
        if not self.ok or not r.get("runSeconds"):
            return None
        cpu = float(r["clientCpuUserSeconds"]) + float(r["clientCpuSystemSeconds"])
        return cpu / float(r["runSeconds"])


class LoadTarget(Protocol):
    """What the load generator needs of a server: its tus endpoint and a name for the logs."""

    @property
    def base(self) -> str: ...

    @property
    def name(self) -> str: ...


def run_load(
    work: Path,
    server: LoadTarget,
    scenario: Scenario,
    specs: list[dict[str, Any]],
    args: Any,
    tag: str,
) -> dict[str, Any]:
    budget = args.max_seconds or (120 + scenario.total_bytes / (10 * MiB) + scenario.count * 0.05)
    config = {
        "base": server.base,
        "pool": str(work / "pool.bin"),
        "uploads": specs,
        "concurrency": scenario.concurrency,
        "patchSize": args.patch_size,
        "chunk": args.chunk,
        "project": PROJECT,
        "expectReceipt": server.name.startswith("canner") or server.name == "Go canner",
        "put": server.name == "canner PUT",
        "timeoutMs": int(budget * 1000),
        "probeChecksum": "blake3:" + "0" * 64,
        "headProbe": (
            {"intervalMs": args.head_interval_ms, "baseline": args.head_baseline}
            if scenario.head_probe
            else None
        ),
    }
    config_path = work / f"load-{tag}.json"
    config_path.write_text(json.dumps(config))
    try:
        out = subprocess.run(
            ["node", str(NODE_DIR / "load.js"), str(config_path)],
            capture_output=True,
            text=True,
            timeout=budget + 30,
        )
    except subprocess.TimeoutExpired:
        return {"timedOut": True, "fatal": f"load generator killed after {budget + 30:.0f}s"}
    finally:
        config_path.unlink(missing_ok=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"fatal": f"load.js exited {out.returncode}: {out.stderr[-2000:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def wait_idle(limit: float, nproc: int) -> float:
    """Wait up to ``limit`` seconds for the machine to be quiet (under 0.2 busy cores over a
    second); returns the busy cores seen last."""
    deadline = time.monotonic() + limit
    while True:
        busy0, _, total0 = _machine_ticks()
        time.sleep(1.0)
        busy1, _, total1 = _machine_ticks()
        cores = (busy1 - busy0) / max(1, total1 - total0) * nproc
        if cores < 0.2 or time.monotonic() >= deadline:
            if cores >= 0.2:
                log(f"machine still busy ({cores:.2f} cores used elsewhere); measuring anyway")
            return cores


def canner_workers(label: str) -> int:
    """The ``[receiver] workers`` of a canner row's label (``canner w2``: 2; ``canner``: 1)."""
    last = label.rsplit(" ", 1)[-1]
    return int(last[1:]) if last.startswith("w") and last[1:].isdigit() else 1


def canner_label(base: str, workers: int) -> str:
    return base if workers == 1 else f"{base} w{workers}"


def run_one(
    work: Path,
    scenario: Scenario,
    server_name: str,
    specs: list[dict[str, Any]],
    args: Any,
    *,
    profile: bool,
) -> Run:
    need = scenario.total_bytes + scenario.count * 16 * KiB + 256 * MiB
    if free_bytes(work) < need:
        raise SystemExit(
            f"bench: {scenario.label} needs {human_size(need)} free in {work}, "
            f"only {human_size(free_bytes(work))} available"
        )
    # Start from a clean page cache state: no dirty pages of an earlier run (@tus/server never
    # fsyncs) may be written back while this one is measured.
    os.sync()
    if args.idle_wait > 0:
        wait_idle(args.idle_wait, len(os.sched_getaffinity(0)))
    server: Server
    workers = canner_workers(server_name)
    if server_name.startswith("canner@"):
        tree = next(t for t in args.base_tree if base_name(t) == server_name)
        server = CannerBaseServer(work, max(scenario.size, 1), args.access_log == "on", tree)
    elif server_name.startswith("canner PUT"):
        server = CannerPutServer(work, max(scenario.size, 1), args.access_log == "on", workers)
    elif server_name.startswith("canner"):
        server = CannerServer(work, max(scenario.size, 1), args.access_log == "on", workers)
    elif server_name == "Go canner":
        server = GoCannerServer(work)
    else:
        server = TusServer(work)
    profiler: Profiler | None = None
    profile_text: str | None = None
    try:
        if profile and server_name.startswith("canner") and not scenario.head_probe:
            if PY_SPY.exists():
                profiler = Profiler(
                    server.pid, work / f"profile-{scenario.key}.txt", args.profile_gil
                )
                time.sleep(0.5)
            else:
                log("--profile: no .venv/bin/py-spy (.venv/bin/pip install py-spy)")
        with Sampler(server.pid) as sampler:
            tag = f"{scenario.key}-{server_name.strip('@').replace('/', '-')}"
            result = run_load(work, server, scenario, specs, args, tag)
        # What it costs to make the data durable afterwards (canner fsyncs before answering, so
        # this is ~0 for it; @tus/server never syncs): syncfs on the data directory's filesystem.
        start = time.monotonic()
        subprocess.run(["sync", "-f", str(server.data_dir)], check=False, timeout=600)
        sync_s = time.monotonic() - start
        b3sum_s = None
        if scenario.head_probe and server_name == "canner":
            b3sum_s = time_b3sum(server.data_dir)
        if profiler is not None:
            problem = profiler.stop()
            if problem:
                profile_text = "  " + problem
            else:
                kept = args.profile_dir / f"canner-{scenario.key}.raw.txt"
                shutil.copyfile(profiler.out, kept)
                summary = summarize_profile(profiler.out, sampler, profiler.gil)
                profile_text = f"{summary}\n  raw profile: {kept}"
    finally:
        if profiler is not None and profiler.proc.poll() is None:
            profiler.proc.kill()
        server.stop()
        shutil.rmtree(getattr(server, "root", server.data_dir), ignore_errors=True)
        if server.proc.returncode not in (0, -signal.SIGTERM):
            log(f"{server.name} exited with {server.proc.returncode}")
    run = Run(scenario, server.name, result, sampler, sync_s, profile_text, b3sum_s=b3sum_s)
    if args.keep_logs:
        shutil.copyfile(server.log_path, args.profile_dir / f"{tag}.log")
    server.log_path.unlink(missing_ok=True)
    return run


def time_b3sum(data_dir: Path) -> float | None:
    """Wall seconds of ``b3sum`` (multi-threaded, mmap) over the largest stored upload."""
    if shutil.which("b3sum") is None:
        log("no b3sum (apt-get install b3sum): the finalize window is not set against it")
        return None
    files = [p for p in (data_dir / "uploads").iterdir() if p.is_file()]
    if not files:
        return None
    biggest = max(files, key=lambda p: p.stat().st_size)
    start = time.monotonic()
    subprocess.run(["b3sum", str(biggest)], check=True, stdout=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - start


# -- report -------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _median_run(group: list[Run]) -> Run:
    """The run with the median rate (the lower one of an even count)."""
    ordered = sorted(group, key=lambda run: run.rate or 0.0)
    return ordered[(len(ordered) - 1) // 2]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def print_report(facts: dict[str, Any], runs: list[Run], args: Any) -> None:
    print()
    print("machine:")
    print(
        f"  nproc {facts['nproc']}, {facts['cpu']}, {facts['mem_total_gib']} GiB RAM, "
        f"kernel {facts['kernel']}, python {facts['python']}, node {facts['node']}"
    )
    print(
        f"  work dir {facts['work_dir']} ({facts['work_fs']}); dd {human_size(facts['dd_bytes'])}"
        f" conv=fsync: {facts['dd_fsync_mib_s']} MiB/s; canner at {facts['canner_commit']}"
    )
    print()
    groups: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.scenario.label, run.server].append(run)
    medians = {key: _median_run(group) for key, group in groups.items()}
    header = (
        f"{'scenario':<24} {'server':<12} {'rate':>16} {'range':>11} {'+sync':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'cre p50':>8} {'fin p50':>8} {'peak RSS':>9} {'all RSS':>8} "
        f"{'srv CPU':>7} {'sys':>4} {'main':>5} {'cost':>11} {'cli CPU':>7} {'kern':>5} "
        f"{'other':>5} {'fail':>4}"
    )
    print(f"median of {args.repeat} run(s) per row (range: slowest-fastest rate)")
    print(header)
    print("-" * len(header))
    for key, group in groups.items():
        run = medians[key]
        r = run.result
        s = run.sampler
        failures = sum(int(g.result.get("failures", 0)) for g in group)
        fails = failures if all(g.ok for g in group) else "ERR"
        finalize = percentile(r.get("finalizeMs", []), 50)
        creation = percentile(r.get("creationMs", []), 50)
        cpu = s.server_cpu_s / s.wall if s else None
        rate = run.rate
        rate_text = "-" if rate is None else f"{rate:,.1f} {run.scenario.unit}"
        rates = [g.rate for g in group if g.rate is not None]
        spread = f"{min(rates):.0f}-{max(rates):.0f}" if len(rates) > 1 else "-"
        peak = max((g.sampler.peak_rss_kib for g in group if g.sampler), default=None)
        # Of all the server's processes together (a canner node: its parent and workers).
        total_rss = max((g.sampler.peak_total_rss_kib for g in group if g.sampler), default=None)
        main_cpu = s.main_thread_cores if s else None
        sys_share = f"{100 * s.server_sys_s / s.server_cpu_s:.0f}%" if s and s.server_cpu_s else "-"
        cost = run.cost
        unit = "s/GiB" if run.scenario.unit == "MiB/s" else "ms/up"
        cost_text = "-" if cost is None else f"{cost:.2f} {unit}"
        print(
            f"{run.scenario.label:<24} {run.server:<12} {rate_text:>16} {spread:>11} "
            f"{fmt(run.durable_rate):>8} {fmt(run.latency(50)):>8} {fmt(run.latency(99)):>8} "
            f"{fmt(creation):>8} {fmt(finalize):>8} "
            f"{(f'{peak / 1024:.0f} MiB' if peak else '-'):>9} "
            f"{(f'{total_rss / 1024:.0f} MiB' if total_rss else '-'):>8} "
            f"{fmt(cpu, '.2f'):>7} {sys_share:>4} {fmt(main_cpu, '.2f'):>5} {cost_text:>11} "
            f"{fmt(run.client_cpu, '.2f'):>7} {fmt(run.kernel_cores, '.2f'):>5} "
            f"{fmt(run.other_cores(facts['nproc']), '.2f'):>5} "
            f"{fails!s:>4}"
        )
    print()
    labels = list(dict.fromkeys(label for label, _ in groups))
    print("ratio canner PUT / canner tus (throughput; >1 means the PUT target is faster):")
    for label in labels:
        c, t = medians.get((label, "canner PUT")), medians.get((label, "canner"))
        if c is not None and t is not None:
            print(
                f"  {label:<24} throughput x{_ratio(c.rate, t.rate)}"
                f"   cost x{_ratio(c.cost, t.cost)}"
                f"   p50 latency x{_ratio(c.latency(50), t.latency(50))}"
            )
    print(
        "ratio canner / Go canner (both durable; throughput >1 means canner is faster; cost is"
        " CPU per upload or per GiB, <1 means canner spends less):"
    )
    tus_rows = [
        name
        for name in dict.fromkeys(server for _, server in groups)
        if name.startswith("canner") and not name.startswith("canner PUT")
    ]
    for label, row in itertools.product(labels, tus_rows):
        c, g = medians.get((label, row)), medians.get((label, "Go canner"))
        if c is not None and g is not None:
            print(
                f"  {label:<24} {row:<14} throughput x{_ratio(c.rate, g.rate)}"
                f"   cost x{_ratio(c.cost, g.cost)}"
                f"   p50 latency x{_ratio(c.latency(50), g.latency(50))}"
                f"   p99 latency x{_ratio(c.latency(99), g.latency(99))}"
            )
    print("ratio canner / @tus/server (throughput; >1 means canner is faster):")
    for label in labels:
        c, t = medians.get((label, "canner")), medians.get((label, "@tus/server"))
        if c is not None and t is not None:
            print(
                f"  {label:<24} throughput x{_ratio(c.rate, t.rate)}"
                f"   with sync x{_ratio(c.durable_rate, t.durable_rate)}"
                f"   p50 latency x{_ratio(c.latency(50), t.latency(50))}"
                f"   p99 latency x{_ratio(c.latency(99), t.latency(99))}"
            )
    for (label, server), group in groups.items():
        probes = [g.result["probe"] for g in group if g.result.get("probe")]
        if not probes:
            continue
        print()
        print(
            f"HEAD latency on another upload, one HEAD every {args.head_interval_ms} ms"
            f" (open loop), {server}, {label}, {len(probes)} run(s) pooled:"
        )
        for phase, meaning in (
            ("idle", "idle server (sequential)"),
            ("body", "while the final PATCH body streams"),
            ("finalize", "body sent -> final response (fsync+hash+receipt)"),
        ):
            samples = [x for p in probes for x in (p.get(phase) or {}).get("samples", [])]
            errors = sum(len((p.get(phase) or {}).get("errors", [])) for p in probes)
            print(
                f"  {phase:<9} n={len(samples):<5} p50 {fmt(percentile(samples, 50), '.2f'):>7} ms"
                f"  p99 {fmt(percentile(samples, 99), '.2f'):>7} ms"
                f"  max {fmt(max(samples) if samples else None, '.2f'):>7} ms"
                f"  errors {errors}   ({meaning})"
            )
        windows = [w for g in group for w in (g.result.get("finalizeMs") or [])]
        if windows:
            size = human_size(group[0].scenario.size)
            shown = ", ".join(f"{w:.0f}" for w in windows)
            print(f"  finalize window of the {size} upload: {shown} ms")
            b3sums = [g.b3sum_s * 1000 for g in group if g.b3sum_s]
            if b3sums:
                ratio = statistics.median(windows) / statistics.median(b3sums)
                shown = ", ".join(f"{b:.0f}" for b in b3sums)
                print(f"  b3sum of the stored file: {shown} ms; finalize / b3sum x{ratio:.2f}")
    failed = [run for run in runs if not run.ok or run.result.get("failures")]
    for run in failed:
        print()
        print(f"FAILURES {run.scenario.label} / {run.server}:")
        for line in run.result.get("failureSamples", []) or [run.result.get("fatal", "?")]:
            print(f"  {line}")
    for run in runs:
        if run.profile:
            print()
            print(f"py-spy profile of canner-receiver during {run.scenario.label}:")
            print(run.profile)


# -- main ---------------------------------------------------------------------------------------


def build_scenarios(args: Any) -> list[Scenario]:
    all_scenarios = [
        Scenario(
            "big",
            f"{args.big_count}x{human_size(args.big_size)} c{args.big_count}",
            args.big_count,
            args.big_size,
            args.big_count,
            "MiB/s",
        ),
        Scenario(
            "mid",
            f"{args.mid_count}x{human_size(args.mid_size)} c{args.mid_count}",
            args.mid_count,
            args.mid_size,
            args.mid_count,
            "MiB/s",
        ),
        Scenario(
            "small",
            f"{args.small_count}x{human_size(args.small_size)} c{args.small_concurrency}",
            args.small_count,
            args.small_size,
            args.small_concurrency,
            "uploads/s",
        ),
        Scenario(
            "head",
            f"HEAD during {human_size(args.head_size)} hash",
            1,
            args.head_size,
            1,
            "MiB/s",
            head_probe=True,
        ),
    ]
    wanted = args.scenarios.split(",")
    unknown = set(wanted) - {s.key for s in all_scenarios}
    if unknown:
        raise SystemExit(f"bench: unknown scenarios {sorted(unknown)} (big, mid, small, head)")
    return [s for s in all_scenarios if s.key in wanted]


QUICK = {
    "big_count": 2,
    "big_size": 128 * MiB,
    "mid_count": 8,
    "mid_size": 16 * MiB,
    "small_count": 200,
    "head_size": 256 * MiB,
    "dd_size": 256 * MiB,
}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="canner-receiver vs @tus/server, one load generator (bench/README.md)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes for a fast smoke run")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per scenario and server, alternating servers; the table shows the median",
    )
    p.add_argument(
        "--scenarios", default="big,mid,small,head", help="comma list of: big,mid,small,head"
    )
    p.add_argument(
        "--servers",
        default="canner,go,tus",
        help="comma list of: canner (tus), put (canner's seesaw PUT target), go (the Go canner"
        " peer, skipped with a message where it is absent), tus (@tus/server), base (canner"
        " from --base-tree)",
    )
    p.add_argument(
        "--base-tree",
        type=Path,
        action="append",
        default=[],
        help="another checkout of canner (e.g. `git archive main` unpacked) run as the server"
        " `base` with this venv, to compare a branch with main in one run (repeat it for several)",
    )
    p.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1],
        help="comma list of [receiver] workers for canner's rows (e.g. 1,2: rows canner and"
        " canner w2)",
    )
    p.add_argument("--big-count", type=int, default=None, help="default 4 (quick 2)")
    p.add_argument("--big-size", type=parse_size, default=None, help="default 1GiB (quick 128MiB)")
    p.add_argument("--mid-count", type=int, default=None, help="default 32 (quick 8)")
    p.add_argument("--mid-size", type=parse_size, default=None, help="default 64MiB (quick 16MiB)")
    p.add_argument("--small-count", type=int, default=None, help="default 2000 (quick 200)")
    p.add_argument("--small-size", type=parse_size, default=64 * KiB, help="default 64KiB")
    p.add_argument("--small-concurrency", type=int, default=16)
    p.add_argument("--head-size", type=parse_size, default=None, help="default 1GiB (quick 256MiB)")
    p.add_argument("--head-interval-ms", type=float, default=5.0)
    p.add_argument("--head-baseline", type=int, default=200, help="idle HEADs before the upload")
    p.add_argument(
        "--patch-size", type=parse_size, default=0, help="bytes per PATCH (0: one PATCH per upload)"
    )
    p.add_argument("--chunk", type=parse_size, default=MiB, help="client socket write size")
    p.add_argument("--dd-size", type=parse_size, default=None, help="default 1GiB (quick 256MiB)")
    p.add_argument(
        "--work-root",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the data directories go (a disk, not tmpfs); default the temp dir",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=30,
        help="before each run, wait up to this long for other CPU use to calm down (0: never)",
    )
    p.add_argument("--max-seconds", type=float, default=0, help="per-run limit (default: by size)")
    p.add_argument("--profile", action="store_true", help="py-spy record canner (not during head)")
    p.add_argument(
        "--profile-gil", action="store_true", help="with --profile: sample only the GIL holder"
    )
    p.add_argument(
        "--profile-dir", type=Path, default=None, help="where raw profiles/logs are kept"
    )
    p.add_argument("--keep-logs", action="store_true", help="keep server logs in --profile-dir")
    p.add_argument("--json", type=Path, default=None, help="also write all results here")
    p.add_argument(
        "--access-log",
        choices=("on", "off"),
        default="on",
        help="canner's access log (default on, as in production); compare to see its cost",
    )
    args = p.parse_args(argv)
    defaults = {
        "big_count": 4,
        "big_size": GiB,
        "mid_count": 32,
        "mid_size": 64 * MiB,
        "small_count": 2000,
        "head_size": GiB,
        "dd_size": GiB,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    return args


@contextlib.contextmanager
def work_dir(root: Path) -> Iterator[Path]:
    root.mkdir(parents=True, exist_ok=True)
    kind = fs_type(root)
    if kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"bench: {root} is {kind}; pass --work-root on a disk")
    path = Path(tempfile.mkdtemp(prefix="canner-bench-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    servers = args.servers.split(",")
    if set(servers) - {"canner", "base", "put", "go", "tus"}:
        raise SystemExit("bench: --servers takes canner, base, put, go and/or tus")
    if "base" in servers and not args.base_tree:
        raise SystemExit("bench: --servers base needs --base-tree")
    if "base" in servers:
        where = servers.index("base")
        servers[where : where + 1] = [base_name(tree) for tree in args.base_tree]
    if "go" in servers and not (GO_PEER / "start.sh").exists():
        log(f"bench: no Go canner at {GO_PEER} (set CANNER_GO_PEER): measuring without it")
        servers.remove("go")
    if not TWISTD.exists() and {"canner", "put"} & set(servers):
        raise SystemExit(f"bench: {TWISTD} missing; run ./dev bench (it installs the venv)")
    scenarios = build_scenarios(args)
    ensure_node_modules()
    runs: list[Run] = []
    with work_dir(args.work_root) as work:
        if args.profile_dir is None:
            args.profile_dir = args.work_root / "canner-bench-profiles"
        if args.profile or args.keep_logs:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
        facts = machine_facts(work, args.dd_size)
        log(f"machine: {facts}")
        payloads = Payloads.create(work, POOL_SIZE)
        for scenario in scenarios:
            log(f"{scenario.label}: hashing payloads ...")
            specs = payloads.specs(scenario.count, scenario.size)
            rows = [
                canner_label({"canner": "canner", "put": "canner PUT"}[name], workers)
                if name in ("canner", "put")
                else {"go": "Go canner", "tus": "@tus/server"}.get(name, name)
                for name in servers
                for workers in (args.workers if name in ("canner", "put") else [1])
            ]
            for rep, label in itertools.product(range(args.repeat), rows):
                if scenario.head_probe and label != "canner":
                    continue
                log(f"{scenario.label}: {label} (run {rep + 1}/{args.repeat}) ...")
                run = run_one(work, scenario, label, specs, args, profile=args.profile and rep == 0)
                run.rep = rep
                r = run.result
                log(
                    f"{scenario.label}: {label}: rate {fmt(run.rate)} {scenario.unit}, "
                    f"p50 {fmt(run.latency(50))} ms, p99 {fmt(run.latency(99))} ms, "
                    f"failures {r.get('failures', r.get('fatal'))}"
                )
                runs.append(run)
    print_report(facts, runs, args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": facts,
                    "runs": [
                        {
                            "scenario": run.scenario.label,
                            "repeat_index": run.rep,
                            "server": run.server,
                            "rate": run.rate,
                            "unit": run.scenario.unit,
                            "p50_ms": run.latency(50),
                            "p99_ms": run.latency(99),
                            "peak_rss_kib": run.sampler.peak_rss_kib if run.sampler else None,
                            "peak_total_rss_kib": (
                                run.sampler.peak_total_rss_kib if run.sampler else None
                            ),
                            "processes": run.sampler.processes if run.sampler else None,
                            "server_cpu_s": run.sampler.server_cpu_s if run.sampler else None,
                            "server_sys_s": run.sampler.server_sys_s if run.sampler else None,
                            "cost": run.cost,
                            "machine_busy": run.sampler.machine_busy if run.sampler else None,
                            "kernel_thread_cores": run.kernel_cores,
                            "machine_iowait": run.sampler.machine_iowait if run.sampler else None,
                            "main_thread_cores": (
                                run.sampler.main_thread_cores if run.sampler else None
                            ),
                            "sync_s": run.sync_s,
                            "b3sum_s": run.b3sum_s,
                            "durable_rate": run.durable_rate,
                            "result": {k: v for k, v in run.result.items() if k != "latenciesMs"},
                        }
                        for run in runs
                    ],
                },
                indent=1,
            )
        )
    bad = [run for run in runs if not run.ok or run.result.get("failures")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
