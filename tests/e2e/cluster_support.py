"""Machinery of the scale-out tests: several canner nodes (a receiver and a deliver process each,
own data directory, issuer and node prefix) behind a real HAProxy from Debian's package, run
with the shipped ``conf/haproxy/canner.cfg``.

The shipped configuration is used as it is, except for what only a test can know: the
``global`` section (no chroot, user or daemon mode; a stats socket in the test directory), the
``bind`` line (a loopback port), the map file's path, and the server addresses.  The node
backends are generated from the shipped ``canner_n1`` backend, one per node.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from deliver_support import ACCESS, SECRET, Deliver, DeliveryReceiver, FakeIA, free_port, wait_for
from e2e_support import REPO, end_process

SHIPPED_CFG = REPO / "conf" / "haproxy" / "canner.cfg"
SHIPPED_MAP = REPO / "conf" / "haproxy" / "canner-nodes.map"
SHIPPED_NGINX = REPO / "conf" / "nginx" / "canner.conf"
ID = re.compile(r"([a-z0-9]{1,16})-[0-9a-f]{32}")


def require(program: str) -> str:
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if found is None:
        raise AssertionError(f"{program} is not installed (./dev test installs it with apt)")
    return found


def sections(text: str) -> list[tuple[str, list[str]]]:
    """HAProxy config text as (section header, body lines); comments before a header stay
    with the previous section."""
    found: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            found.append((line.strip(), []))
        else:
            found[-1][1].append(line)
    return found


def haproxy_config(
    port: int, nodes: dict[str, int], map_path: Path, stats_socket: Path, shipped: str
) -> str:
    """The shipped configuration, for ``nodes`` (prefix -> receiver port) on loopback."""
    out = [
        "global",
        f"    stats socket {stats_socket} mode 600 level admin expose-fd listeners",
        "    log stdout format raw local0",
        "    hard-stop-after 60s",
        "",
    ]
    template: list[str] | None = None
    for header, body in sections(shipped):
        if header in ("", "global"):
            continue
        if re.fullmatch(r"backend canner_n[0-9]+", header):
            if header == "backend canner_n1":
                template = body
            continue
        lines = []
        for line in body:
            stripped = line.strip()
            if stripped.startswith("bind "):
                line = f"    bind 127.0.0.1:{port}"
            elif stripped.startswith("server "):
                continue
            line = line.replace("/etc/haproxy/canner-nodes.map", str(map_path))
            lines.append(line)
        if header == "backend canner_new":
            lines += [f"    server {p} 127.0.0.1:{n} check" for p, n in nodes.items()]
        out += [header, *lines]
    assert template is not None, "the shipped config has no backend canner_n1"
    for prefix, node_port in nodes.items():
        out.append(f"backend canner_{prefix}")
        for line in template:
            line = line.replace("10.0.0.1:8080", f"127.0.0.1:{node_port}")
            out.append(re.sub(r"\bn1\b", prefix, line))
    return "\n".join(out) + "\n"


def map_file(prefixes: list[str]) -> str:
    """The shipped map's format: comments, then ``<prefix> canner_<prefix>`` lines."""
    comments = [line for line in SHIPPED_MAP.read_text().splitlines() if line.startswith("#")]
    return "\n".join([*comments, *(f"{p} canner_{p}" for p in prefixes)]) + "\n"


@dataclass
class HAProxy:
    """``haproxy -W -db`` (master-worker, foreground) on a loopback port."""

    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.root / "haproxy.cfg"

    @property
    def map_path(self) -> Path:
        return self.root / "canner-nodes.map"

    @property
    def socket_path(self) -> Path:
        return self.root / "admin.sock"

    @property
    def log_path(self) -> Path:
        return self.root / "haproxy.log"

    def configure(self, nodes: dict[str, int]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.map_path.write_text(map_file(list(nodes)))
        text = haproxy_config(
            self.port, nodes, self.map_path, self.socket_path, SHIPPED_CFG.read_text()
        )
        self.config_path.write_text(text)
        check = subprocess.run(
            [require("haproxy"), "-c", "-f", str(self.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert check.returncode == 0, (
            f"haproxy -c refused the config:\n{check.stdout}{check.stderr}"
        )

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [require("haproxy"), "-W", "-db", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._listening, 20, "haproxy to listen", 0.05, self.log_tail)

    def _listening(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_tail()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self.socket_path.exists()
        except OSError:
            return False

    def reload(self) -> None:
        """What ``systemctl reload haproxy`` does: SIGUSR2 to the master, which starts a new
        worker with the new config; the old one finishes its connections."""
        assert self.proc is not None
        before = self.worker_pids()
        self.proc.send_signal(signal.SIGUSR2)
        wait_for(
            lambda: self.worker_pids() - before, 20, "a new haproxy worker", 0.1, self.log_tail
        )

    def worker_pids(self) -> set[int]:
        assert self.proc is not None
        found = set()
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            if f"\nPPid:\t{self.proc.pid}\n" in text:
                found.add(int(status.parent.name))
        return found

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.socket_path))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def server_states(self, backend: str = "canner_new") -> dict[str, str]:
        """Server name -> status (``UP``, ``DOWN``, ``UP 1/2``, ...) from ``show stat``."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            r["svname"]: r["status"]
            for r in rows
            if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_state(self, server: str, state: str, timeout: float = 20) -> None:
        wait_for(
            lambda: self.server_states().get(server) == state,
            timeout,
            f"haproxy to see {server} {state}",
            0.2,
            lambda: json.dumps(self.server_states()),
        )

    def stop(self) -> None:
        end_process(self.proc, signal.SIGTERM, 10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Node:
    """One canner node: a receiver and a deliver process on their own data directory."""

    prefix: str
    receiver: DeliveryReceiver
    deliver: Deliver

    @property
    def issuer(self) -> str:
        return f"https://{self.prefix}.canner.test"

    def close(self) -> None:
        for stop in (lambda: self.deliver.kill(signal.SIGTERM, timeout=5), self.receiver.close):
            try:
                stop()
            except Exception:  # tear everything down, whatever fails
                pass


def make_node(
    root: Path, prefix: str, fake: FakeIA, data_dir: Path | None = None, **config: Any
) -> Node:
    """A node delivering project ``example`` to ``fake``, started (receiver and deliver)."""
    home = root / prefix
    home.mkdir(parents=True, exist_ok=True)
    (home / "keys").write_text(f"{ACCESS}\n{SECRET}\n", encoding="utf-8")
    rcv = DeliveryReceiver(
        root=home,
        port=free_port(),
        data_dir=data_dir or home / "data",
        config_path=home / "canner.toml",
        log_path=home / "receiver.log",
        fake_url=fake.url,
        retention="1h",
        concurrency=2,
        metadata={"collection": ["test"], "title": ["Artifact {object_id}"]},
    )
    config.setdefault("max_upload_bytes", 64 * 1024 * 1024)
    rcv.write_config(issuer=f"https://{prefix}.canner.test", node_prefix=prefix, **config)
    node = Node(prefix, rcv, Deliver(rcv.config_path, rcv.data_dir, home / "deliver.log"))
    rcv.start()
    node.deliver.start()
    return node


def get(url: str, **kwargs: Any) -> requests.Response:
    kwargs.setdefault("timeout", 30)
    with requests.get(url, **kwargs) as r:
        r.content  # noqa: B018 - read the body before the connection goes back
        return r


def node_of(object_id: str) -> str:
    match = ID.fullmatch(object_id)
    assert match, f"{object_id!r} is not a prefixed object id"
    return match.group(1)


def nginx_config(port: int, nodes: dict[str, int], shipped: str) -> str:
    """The shipped nginx example for ``nodes`` (prefix -> receiver port), plain HTTP on a
    loopback port; the lines of shipped nodes not in ``nodes`` are left out."""
    out = []
    for line in shipped.splitlines():
        stripped = line.strip()
        if stripped.startswith("listen "):
            line = f"    listen 127.0.0.1:{port};"
        elif stripped.startswith("ssl_certificate"):
            continue
        node = re.search(r"10\.0\.0\.([0-9]+):8080|^n([0-9]+) canner_n", stripped)
        if node is not None:
            prefix = f"n{node.group(1) or node.group(2)}"
            if prefix not in nodes:
                continue
            line = line.replace(f"10.0.0.{prefix[1:]}:8080", f"127.0.0.1:{nodes[prefix]}")
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class Nginx:
    """``nginx`` in the foreground with the shipped example included in its http block."""

    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, nodes: dict[str, int], shipped: str | None = None) -> None:
        """Start with the shipped example (or ``shipped``, an edited copy of it)."""
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        site = self.root / "canner.conf"
        text = SHIPPED_NGINX.read_text() if shipped is None else shipped
        site.write_text(nginx_config(self.port, nodes, text))
        main = self.root / "nginx.conf"
        main.write_text(
            "events {}\n"
            f"http {{\n    access_log {self.root / 'access.log'};\n    include {site};\n}}\n"
        )
        pid, errors = self.root / "nginx.pid", self.root / "error.log"
        globals_ = f"daemon off; pid {pid}; error_log {errors};"
        command = [require("nginx"), "-p", str(self.root), "-c", str(main), "-g", globals_]
        check = subprocess.run(
            [*command, "-t"], capture_output=True, text=True, timeout=30, check=False
        )
        assert check.returncode == 0, f"nginx -t refused the config:\n{check.stderr}"
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        wait_for(self._listening, 20, "nginx to listen", 0.05)

    def _listening(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "nginx exited"
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish requests, then exit
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
