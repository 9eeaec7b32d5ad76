"""Operating canner, end to end: the status page in headless Chromium against ``canner status
--json`` and ``/metrics``; the SSH manhole of each daemon through a real ``ssh`` client (over the
loopback TCP port and over the unix socket); deliver's metrics listener; operator retries and
``rebuild-index`` refusing while deliver runs.

Needs the Debian packages ``chromium`` and ``openssh-client`` (``ssh``, ``ssh-keygen``); the
tests install nothing and fail with a hint when they are missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import pwd
import re
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import time
import zlib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import (
    PROJECT,
    Deliver,
    DeliveryReceiver,
    FakeIA,
    venv_bin,
    wait_for,
)
from e2e_support import REPO, Nobody, Receiver, blake3_hex, free_port, scrape

pytestmark = pytest.mark.e2e

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-Za-z]|\r")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Free space moves while tests write elsewhere on the same filesystem (the parallel e2e workers
# include a 1 GiB upload).
FREE_SPACE_SLACK = 1536 * 1024 * 1024


def need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is missing: apt-get install {package} (the e2e suite needs it)")
    return path


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for unix sockets (sun_path holds 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="cn-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- helpers: metrics, the canner command, Chromium ------------------------------------------


def metric(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


def canner(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv_bin("canner"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    binary = need("chromium", "chromium")
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def cell(dom: str, name: str, within: str | None = None) -> int:
    """The number shown in the page cell labelled ``data-field=name``."""
    scope = dom
    if within is not None:
        match = re.search(within, dom, re.S)
        assert match, f"no {within!r} in the page"
        scope = match.group(0)
    found = re.search(rf'data-field="{name}"><b>([0-9,]+)</b>', scope)
    assert found, f"no {name} cell in the page"
    return int(found.group(1).replace(",", ""))


def png_facts(path: Path) -> tuple[int, int, int]:
    """Width, height and the number of distinct byte values of a PNG's pixel data."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


# -- helpers: SSH into a manhole -----------------------------------------------------------------


class Shell:
    """``ssh`` on a pseudo-terminal, talking to a manhole's Python prompt."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.fd = master
        self.seen = b""

    def text(self) -> str:
        return ANSI.sub(b"", self.seen).decode("utf-8", "replace")

    def read_until(self, pattern: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"no {pattern!r} from the manhole; it said:\n{self.text()}")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.2))
            if ready:
                try:
                    self.seen += os.read(self.fd, 65536)
                except OSError:
                    break
        return self.text()

    def resize(self, rows: int, columns: int) -> None:
        """Change the terminal size and tell ssh, as a resized terminal window does."""
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc.send_signal(signal.SIGWINCH)

    def eval(self, expression: str, expect: str, timeout: float = 15.0) -> str:
        self.seen = b""
        os.write(self.fd, expression.encode() + b"\r")
        return self.read_until(expect, timeout)

    def close(self) -> int:
        try:
            os.write(self.fd, b"\x04")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            os.close(self.fd)
        return self.proc.returncode


def ssh_argv(key: Path, known_hosts: Path, *target: str) -> list[str]:
    return [
        need("ssh", "openssh-client"),
        "-F",
        "/dev/null",
        "-i",
        str(key),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "ConnectTimeout=10",
        *target,
    ]


def user_key(root: Path, name: str = "operator") -> Path:
    key = root / name
    subprocess.run(
        [need("ssh-keygen", "openssh-client"), "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
        check=True,
        timeout=30,
    )
    return key


def known_hosts(root: Path, host_key: Path, *names: str) -> Path:
    """A known_hosts file trusting the daemon's generated host key under ``names``."""
    kind, blob = host_key.with_name(host_key.name + ".pub").read_text().split()[:2]
    path = root / "known_hosts"
    path.write_text("".join(f"{name} {kind} {blob}\n" for name in names))
    return path


def tcp_shell(key: Path, hosts: Path, port: int) -> Shell:
    return Shell(ssh_argv(key, hosts, "-p", str(port), "operator@127.0.0.1"))


def unix_shell(key: Path, hosts: Path, config: Path, role: str) -> Shell:
    """conf/manhole.md's recipe: ``canner manhole-proxy ROLE`` as ssh's ProxyCommand."""
    proxy = f"ProxyCommand={sys.executable} -m canner.cli --config {config} manhole-proxy {role}"
    alias = f"HostKeyAlias=canner-{role}"
    return Shell(ssh_argv(key, hosts, "-o", proxy, "-o", alias, "operator@manhole"))


def manhole_toml(root: Path, keys: Path, **settings: str) -> str:
    lines = ["", "[manhole]", f"authorized_keys = {json.dumps(str(keys))}"]
    lines.append(f"host_key = {json.dumps(str(root / 'manhole_host_key'))}")
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    return "\n".join(lines) + "\n"


def append(config: Path, text: str) -> None:
    with open(config, "a", encoding="utf-8") as f:
        f.write(text)


# -- the receiver --------------------------------------------------------------------------------


def test_status_page_matches_status_json_and_metrics(tmp_path: Path) -> None:
    """Headless Chromium renders the status page; the numbers it shows equal ``canner status
    --json`` and ``/metrics``, the page refreshes itself, and a checksum rejection shows up among
    the recent errors with its id shortened."""
    rcv = Receiver.in_dir(tmp_path / "receiver")
    append(rcv.config_path, '\n[metrics]\nrefresh = "1s"\n')
    rcv.start()
    try:
        rcv.upload_all(os.urandom(150_000), filename="a.warc")
        rcv.upload_all(os.urandom(70_000), filename="b.warc")
        rcv.upload_all(os.urandom(33_000), project="other")
        partial = rcv.new_upload(b"p" * 10_000)
        assert rcv.patch(partial, 0, b"p" * 3_000).status_code == 204
        bad = rcv.new_upload(b"x" * 500, checksum=blake3_hex(b"y" * 500))
        assert rcv.patch(bad, 0, b"x" * 500).status_code == 422
        assert rcv.create(10, blake3_hex(b"q"), project="nobody").status_code == 400
        since = time.time()

        samples = wait_for(
            lambda: (
                s
                if (s := scrape(rcv.base_url + "/metrics"))[
                    ("canner_survey_timestamp_seconds", frozenset())
                ]
                > since
                else None
            ),
            10,
            "a survey after the uploads",
        )
        status = canner("status", "--json", "--config", str(rcv.config_path))
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)

        profile = tmp_path / "chromium"
        dump = chromium("--dump-dom", rcv.base_url + "/", profile=profile)
        assert dump.returncode == 0, dump.stderr[-2000:]
        dom = dump.stdout
        shot = tmp_path / "status.png"
        taken = chromium(
            f"--screenshot={shot}", "--window-size=1200,900", rcv.base_url + "/", profile=profile
        )
        assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    finally:
        rcv.close()

    # The page against `canner status --json`.
    assert '<meta http-equiv="refresh" content="10">' in dom
    assert abs(cell(dom, "free_bytes") - doc["free_bytes"]) < FREE_SPACE_SLACK
    assert cell(dom, "active_uploads") == doc["active_uploads"] == 1
    assert cell(dom, "active_upload_bytes") == doc["active_upload_bytes"] == 3_000
    for project, totals in doc["projects"].items():
        row = rf'<tr data-project="{project}">.*?</tr>'
        for field in ("accepted_objects", "accepted_bytes", "pending_objects", "pending_bytes"):
            assert cell(dom, field, row) == totals[field], (project, field)
    for state, count in doc["states"].items():
        assert cell(dom, f"state_{state}") == count, state
    summary = r'<table id="delivery-summary">.*?</table>'
    assert cell(dom, "pending_bytes", summary) == doc["pending_bytes"] == 253_000
    assert "rejected " + bad[:8] + "…" in dom and bad not in dom and partial not in dom

    # The page against /metrics.
    assert cell(dom, "state_pending") == metric(samples, "canner_deliveries", state="pending") == 3
    assert cell(dom, "active_upload_bytes") == metric(samples, "canner_active_upload_bytes")
    other = r'<tr data-project="other">.*?</tr>'
    assert cell(dom, "pending_bytes", other) == metric(
        samples, "canner_pending_bytes", project="other"
    )
    assert (
        abs(cell(dom, "free_bytes") - metric(samples, "canner_data_free_bytes")) < FREE_SPACE_SLACK
    )
    assert metric(samples, "canner_uploads_created_total", project="example") == 4
    assert metric(samples, "canner_uploads_accepted_total", project="example") == 2
    assert metric(samples, "canner_accepted_bytes_total", project="other") == 33_000
    assert metric(samples, "canner_uploads_rejected_total", reason="checksum_mismatch") == 1
    assert metric(samples, "canner_uploads_rejected_total", reason="invalid_request") == 1
    # Every byte written to the store, the rejected upload's 500 included.
    assert metric(samples, "canner_received_bytes_total") == 253_000 + 3_000 + 500
    assert metric(samples, "canner_acceptance_seconds_count") == 3
    assert metric(samples, "canner_hash_seconds_count") == 3
    assert metric(samples, "canner_oldest_undelivered_age_seconds") >= 0

    # The screenshot is the page at the requested size, not a blank frame.
    width, height, distinct = png_facts(shot)
    assert (width, height) == (1200, 900)
    assert distinct > 16, "the screenshot is (nearly) uniform"


def test_receiver_manhole_over_tcp_ssh_and_the_unix_socket(tmp_path: Path, short_dir: Path) -> None:
    """An operator key gets a Python prompt in the receiver over loopback SSH and over the
    0600 unix socket (in a 0750 directory); an unknown key is refused."""
    key, stranger = user_key(tmp_path), user_key(tmp_path, "stranger")
    keys = tmp_path / "authorized_keys"
    keys.write_text(key.with_suffix(".pub").read_text())
    socket = short_dir / "receiver" / "manhole.sock"
    port = free_port()
    rcv = Receiver.in_dir(tmp_path / "receiver")
    append(
        rcv.config_path,
        manhole_toml(
            tmp_path,
            keys,
            receiver_socket=str(socket),
            receiver_ssh=f"tcp:{port}:interface=127.0.0.1",
        ),
    )
    rcv.start()
    shells: list[Shell] = []
    try:
        data = os.urandom(12_345)
        oid, _receipt = rcv.upload_all(data, filename="m.warc")
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600 and stat.S_ISSOCK(socket.stat().st_mode)
        assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o750
        hosts = known_hosts(
            tmp_path, tmp_path / "manhole_host_key", f"[127.0.0.1]:{port}", "canner-receiver"
        )

        tcp = tcp_shell(key, hosts, port)
        shells.append(tcp)
        tcp.read_until(">>> ")
        tcp.resize(50, 160)
        assert "2007" in tcp.eval("len(config.projects) * 1000 + 7", r"\n2007\n")
        found = tcp.eval(f"lookup({oid!r})", r"Deferred #0 called back: \{.*\}\n")
        assert "'size_bytes': 12345" in found and "'state': 'pending'" in found
        assert "'payload_present': True" in found

        local = unix_shell(key, hosts, rcv.config_path, "receiver")
        shells.append(local)
        local.read_until(">>> ")
        said = local.eval(f"receipts.read({oid!r}).size_bytes + 1", r"\n12346\n")
        assert "12346" in said
        stuck = local.eval("stuck()", r"Deferred #0 called back: \[\]")
        assert "called back: []" in stuck

        # Scripted (conf/manhole.md): input piped in, with or without a remote terminal.
        for tty in ("-T", "-tt"):
            scripted = subprocess.run(
                ssh_argv(key, hosts, tty, "-p", str(port), "operator@127.0.0.1"),
                input=b"6 * 7\n\x04",
                capture_output=True,
                timeout=30,
                check=False,
            )
            assert b"\n42\r\n>>> " in scripted.stdout, (tty, scripted)
        refused = subprocess.run(
            ssh_argv(stranger, hosts, "-p", str(port), "operator@127.0.0.1", "true"),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert refused.returncode == 255 and "Permission denied" in refused.stderr
    finally:
        for shell in shells:
            shell.close()
        rcv.close()
    assert "Traceback" not in rcv.log_text()


# -- canner-deliver ------------------------------------------------------------------------------


def test_deliver_metrics_manhole_retry_and_rebuild_guard(tmp_path: Path, short_dir: Path) -> None:
    """A delivery refused with 403 is stuck (manhole ``stuck()``) and counted (deliver's
    /metrics); ``canner retry`` after the fault clears delivers it; ``rebuild-index`` refuses
    while deliver runs; ``check-config`` shows where objects go."""
    fake = FakeIA(tmp_path / "fake")
    fake.start()
    rcv = DeliveryReceiver.configured(tmp_path / "canner", fake.url, retention="1h")
    metrics_port, ssh_port = free_port(), free_port()
    key = user_key(tmp_path)
    keys = tmp_path / "authorized_keys"
    keys.write_text(key.with_suffix(".pub").read_text())
    socket = short_dir / "deliver" / "manhole.sock"
    append(
        rcv.config_path,
        f'\n[metrics]\ndeliver_listen = "tcp:{metrics_port}:interface=127.0.0.1"\nrefresh = "1s"\n'
        + manhole_toml(
            tmp_path,
            keys,
            receiver_socket="",
            deliver_socket=str(socket),
            deliver_ssh=f"tcp:{ssh_port}:interface=127.0.0.1",
        ),
    )
    deliver = Deliver(rcv.config_path, rcv.data_dir, tmp_path / "canner" / "deliver.log")
    config = str(rcv.config_path)
    shell: Shell | None = None
    try:
        checked = canner("check-config", "--config", config)
        assert checked.returncode == 0, checked.stderr
        example = json.loads(checked.stdout)["delivery_examples"][PROJECT]
        assert re.fullmatch(
            r"example-\d{14}-0123456789abcdef0123456789abcdef", example["identifier"]
        )

        rcv.start()
        deliver.start()
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600
        fake.add_fault("forbidden", count=1000)
        data = os.urandom(200_000)
        oid, _ = rcv.upload_all(data, filename="denied.warc")

        def row() -> dict[str, Any]:
            out = canner("show", oid, "--config", config)
            assert out.returncode == 0, out.stderr
            return dict(json.loads(out.stdout)["delivery"] or {})

        wait_for(lambda: row().get("needs_operator") == 1, 20, "the 403 flagged for an operator")
        hosts = known_hosts(tmp_path, tmp_path / "manhole_host_key", f"[127.0.0.1]:{ssh_port}")
        shell = tcp_shell(key, hosts, ssh_port)
        shell.read_until(">>> ")
        stuck = shell.eval("stuck()", r"Deferred #0 called back: \[.*\]\n")
        assert oid in stuck and "403" in stuck
        assert "[]" in shell.eval("scheduler.active", r"\[\]")

        busy = canner("rebuild-index", "--config", config)
        assert busy.returncode == 1 and "canner-deliver is running" in busy.stderr

        fake.clear_faults()
        retried = canner("retry", oid, "--config", config)
        assert retried.returncode == 0, retried.stderr
        wait_for(lambda: row().get("verified_at") is not None, 20, "verified after the retry")
        again = canner("retry", oid, "--config", config)
        assert again.returncode == 1 and "delivered and verified" in again.stderr

        url = f"http://127.0.0.1:{metrics_port}/metrics"
        samples = wait_for(
            lambda: (
                s
                if (s := scrape(url)).get(
                    ("canner_deliveries", frozenset({("state", "delivered")}))
                )
                == 1
                else None
            ),
            10,
            "deliver's gauges to show the delivery",
        )
        # Bytes are counted as they stream: the refused attempt sent the body too.
        obj = {"project": PROJECT, "kind": "object"}
        assert metric(samples, "canner_ia_sent_bytes_total", kind="object") == 2 * 200_000
        assert metric(samples, "canner_delivered_bytes") == 200_000
        assert metric(samples, "canner_deliveries_completed_total", **obj) == 1
        assert metric(samples, "canner_delivery_retries_total", **obj) >= 1
        failures = metric(
            samples,
            "canner_delivery_failures_total",
            **obj,
            needs_operator="true",
            reason="forbidden",
        )
        assert failures >= 1
        assert metric(samples, "canner_deliveries_needing_operator") == 0
        assert ("canner_uploads_accepted_total", frozenset({("project", PROJECT)})) not in samples
    finally:
        if shell is not None:
            shell.close()
        code = deliver.stop()
        rcv.close()
        fake.stop()
    assert code in (0, -signal.SIGTERM), deliver.log_tail()
    assert "Traceback" not in deliver.log_text(), deliver.log_tail()


# -- the status page as a person sees it -----------------------------------------------------


def page_dom(url: str, profile: Path) -> str:
    dump = chromium("--dump-dom", url, profile=profile)
    assert dump.returncode == 0, dump.stderr[-2000:]
    return dump.stdout


def screenshot(url: str, path: Path, profile: Path) -> None:
    taken = chromium(f"--screenshot={path}", "--window-size=1280,2400", url, profile=profile)
    assert taken.returncode == 0 and path.exists(), taken.stderr[-2000:]
    width, height, distinct = png_facts(path)
    assert (width, height) == (1280, 2400)
    assert distinct > 16, f"{path.name} is (nearly) uniform"


def chart_points(dom: str, chart_id: str) -> int:
    found = re.search(rf'<figure id="{chart_id}">\s*<svg[^>]*data-points="(\d+)"', dom)
    assert found, f"no chart {chart_id} on the page"
    return int(found.group(1))


def section(dom: str, element_id: str) -> str:
    found = re.search(rf'<table id="{element_id}">.*?</table>', dom, re.S)
    assert found, f"no table {element_id} on the page"
    return found.group(0)


def test_status_page_idle_uploading_and_delivering_with_a_failure(tmp_path: Path) -> None:
    """Headless Chromium at three moments (screenshots in the test's tmp dir): idle with deliver
    alive and trend charts drawn; an upload coming in; a delivery streaming (bytes, progress)
    beside a refused one (listed with its next retry).  Once deliver stops, the page says so."""
    fake = FakeIA(tmp_path / "fake")
    fake.start()
    rcv = DeliveryReceiver.configured(tmp_path / "canner", fake.url, retention="1h")
    deliver = Deliver(rcv.config_path, rcv.data_dir, tmp_path / "canner" / "deliver.log")
    profile = tmp_path / "chromium"
    url = rcv.base_url + "/"
    try:
        rcv.start()
        deliver.start()

        # 1. Idle: deliver's heartbeat is fresh, nothing moves, the charts have their samples.
        idle = wait_for(
            lambda: d if 'id="deliver-state" class="ok"' in (d := page_dom(url, profile)) else None,
            20,
            "the page to see deliver's heartbeat",
        )
        screenshot(url, tmp_path / "1-idle.png", profile)
        assert 'id="deliver-banner"' not in idle
        assert "No delivery running right now." in idle and "No uploads in progress." in idle
        assert chart_points(idle, "trend-free") >= 1
        assert chart_points(idle, "trend-backlog-bytes") >= 1
        assert re.search(r'id="version">\d', idle)

        # 2. Uploading: a tus upload 40 % in.
        partial = rcv.new_upload(b"u" * 100_000)
        assert rcv.patch(partial, 0, b"u" * 40_000).status_code == 204
        # The page shares a survey for up to 2 s: wait for one taken after the PATCH.
        uploading = wait_for(
            lambda: d if 'id="active-uploads"' in (d := page_dom(url, profile)) else None,
            20,
            "the upload on the status page",
        )
        screenshot(url, tmp_path / "2-uploading.png", profile)
        row = section(uploading, "active-uploads")
        assert partial[:8] + "…" in row and "40%" in row and partial not in uploading

        # 3. Delivering with a failure: one object refused (403), another stalled mid-PUT.
        fake.add_fault("forbidden", count=1)
        refused, _ = rcv.upload_all(os.urandom(50_000), filename="refused.warc")
        wait_for(
            lambda: refused[:8] in page_dom(url, profile), 20, "the refusal on the status page"
        )
        fake.add_fault("stall", count=1, after_bytes=1 << 20)
        streaming, _ = rcv.upload_all(os.urandom(24 << 20), filename="big.warc")

        def in_flight() -> str | None:
            dom = page_dom(url, profile)
            return dom if 'id="in-flight"' in dom and streaming[:8] in dom else None

        delivering = wait_for(in_flight, 30, "the stalled PUT among the deliveries in flight")
        screenshot(url, tmp_path / "3-delivering.png", profile)
        moving = section(delivering, "in-flight")
        sent = re.search(r'data-field="sent"><b>([0-9,]+)</b>', moving)
        assert sent and int(sent.group(1).replace(",", "")) >= 1 << 20
        assert "uploading" in moving and "big.warc" in moving
        failures = section(delivering, "delivery-failures")
        assert refused[:8] + "…" in failures and "403" in failures
        wait = re.search(r"in (\d+)m \d+s", failures)
        assert wait and 55 <= int(wait.group(1)) <= 70, "the next retry is about an hour away"
        assert streaming[:8] not in failures

        # Deliver stops: the page says plainly that nothing is being delivered.
        assert deliver.stop() in (0, -signal.SIGTERM)
        stopped = wait_for(
            lambda: d if 'id="deliver-banner"' in (d := page_dom(url, profile)) else None,
            20,
            "the page to say deliver stopped",
        )
        assert "not running" in stopped
        assert 'id="in-flight"' not in stopped
    finally:
        deliver.stop()
        rcv.close()
        fake.stop()


# -- the verdict at the top, in each state ---------------------------------------------------------


class PageDom(HTMLParser):
    """The parts of a dumped DOM the verdict tests read: the ids in document order, the text
    inside each element with an id, the reasons listed, and links by class."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.text: dict[str, str] = {}
        self.status = ""
        self.reasons: list[str] = []
        self.links: dict[str, list[str]] = {}
        self.codes: dict[str, list[str]] = {}
        self._open: list[tuple[str, str | None]] = []
        self._li: list[str] | None = None
        self._code: tuple[str, list[str]] | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        element_id = found.get("id")
        if element_id:
            self.ids.append(element_id)
            self.text.setdefault(element_id, "")
        if element_id == "verdict":
            self.status = found.get("data-status") or ""
        if tag == "li" and any(i == "reasons" for _, i in self._open):
            self._li = []
        if tag == "a" and found.get("class"):
            self.links.setdefault(found["class"] or "", []).append(found.get("href") or "")
        if tag == "code" and found.get("class"):
            self._code = (found["class"] or "", [])
        if tag not in ("br", "meta", "img", "input", "link", "rect", "circle", "polyline"):
            self._open.append((tag, element_id))

    def handle_endtag(self, tag: str) -> None:
        if tag == "li" and self._li is not None:
            self.reasons.append("".join(self._li).strip())
            self._li = None
        if tag == "code" and self._code is not None:
            self.codes.setdefault(self._code[0], []).append("".join(self._code[1]))
            self._code = None
        while self._open:
            name, _ = self._open.pop()
            if name == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, element_id in self._open:
            if element_id:
                self.text[element_id] += data
        if self._li is not None:
            self._li.append(data)
        if self._code is not None:
            self._code[1].append(data)

    def before(self, first: str, then: str) -> bool:
        return self.ids.index(first) < self.ids.index(then)


NOBODY = pwd.getpwnam("nobody")


def status_reasons(config: Path) -> tuple[int, list[str]]:
    """``canner status``'s exit status and the reasons it gives on stderr."""
    done = canner("status", "--config", str(config))
    prefix = "canner: "
    return done.returncode, [
        line[len(prefix) :] for line in done.stderr.splitlines() if line.startswith(prefix)
    ]


def served(url: str) -> PageDom:
    """The page as served (no scripts run on it: what waits poll, cheaper than a browser)."""
    return PageDom(requests.get(url, timeout=10).text)


def page_once(url: str, profile: Path, shot: Path) -> PageDom:
    screenshot(url, shot, profile)
    return PageDom(page_dom(url, profile))


def test_status_page_verdict_healthy_needs_operator_and_deliver_down(tmp_path: Path) -> None:
    """Headless Chromium (a screenshot of each state in the test's tmp dir): the page's header
    carries ``canner status``'s verdict and reasons, word for word, while all is well, once a
    403 leaves a delivery needing an operator (listed, with the failure, above the charts; the
    delivered object links to its IA item) and once canner-deliver has stopped."""
    fake = FakeIA(tmp_path / "fake")
    fake.start()
    rcv = DeliveryReceiver.configured(tmp_path / "canner", fake.url, retention="1h")
    deliver = Deliver(rcv.config_path, rcv.data_dir, tmp_path / "canner" / "deliver.log")
    profile = tmp_path / "chromium"
    url = rcv.base_url + "/"
    try:
        rcv.start()
        deliver.start()
        delivered, _ = rcv.upload_all(os.urandom(20_000), filename="good.warc")

        # 1. Healthy: deliver alive, the object delivered, nothing to do.
        def healthy() -> PageDom | None:
            page = served(url)
            links = page.links.get("ia-item", [])
            return page if page.status == "ok" and links else None

        wait_for(healthy, 30, "a healthy page listing the delivery")
        page = page_once(url, profile, tmp_path / "1-healthy.png")
        assert page.status == "ok" and page.reasons == []
        assert "Nothing needs attention." in page.text["verdict"]
        assert status_reasons(rcv.config_path) == (0, [])
        [link] = page.links["ia-item"]
        assert link.startswith(f"{fake.url}/details/example-") and link.endswith(delivered)
        assert "needs-operator" not in page.ids and page.before("failures", "trends")

        # 2. Needs an operator: the IA refuses the next object (403).
        fake.add_fault("forbidden", count=1)
        refused, _ = rcv.upload_all(os.urandom(30_000), filename="refused.warc")
        wait_for(
            lambda: "needs-operator" in served(url).ids,
            30,
            "the refused delivery needing an operator",
        )
        page = page_once(url, profile, tmp_path / "2-needs-operator.png")
        code, reasons = status_reasons(rcv.config_path)
        assert (code, page.status) == (1, "warning")
        assert page.reasons == reasons == ["warning: 1 deliveries need an operator"]
        assert page.before("verdict", "needs-operator")
        assert page.before("needs-operator", "failures") and page.before("failures", "trends")
        assert refused[:8] + "…" in page.text["needs-operator"]
        assert "canner retry --needs-operator" in page.text["needs-operator"]
        assert "403" in page.text["delivery-failures"]

        # 3. Deliver down.
        assert deliver.stop() in (0, -signal.SIGTERM)
        wait_for(
            lambda: served(url).status == "critical",
            20,
            "the page to say deliver stopped",
        )
        page = page_once(url, profile, tmp_path / "4-deliver-down.png")
        code, reasons = status_reasons(rcv.config_path)
        assert (code, page.status) == (2, "critical")
        assert page.reasons == reasons
        assert reasons[0] == "critical: canner-deliver is not running (stopped cleanly)"
        assert "deliver-banner" in page.ids
    finally:
        deliver.stop()
        rcv.close()
        fake.stop()


def test_status_page_verdict_unready_with_an_error_at_start(tmp_path: Path, nobody: Nobody) -> None:
    """The issue's case: a receiver (run as nobody) that logged an error at start (its index
    unreadable), then its uploads/ and receipts/ made unwritable.  /readyz answers 503 for the
    directories (an unreadable index refuses no upload), and the page says critical with those
    very reasons and the index's (and ``canner status`` the same), its storage state is not
    "ok", and what start-up logged is shown above the charts."""
    rcv = Receiver.in_dir(nobody.folder / "node")
    (rcv.data_dir / "delivery.sqlite").write_bytes(b"not a database at all" * 100)
    for sub in ("", "uploads", "receipts", "delivery.sqlite"):
        path = rcv.data_dir / sub
        if sub in ("uploads", "receipts"):
            path.mkdir()
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    rcv.launch_prefix, rcv.launch_twistd = nobody.prefix, nobody.twistd
    profile = tmp_path / "chromium"
    url = rcv.base_url + "/"
    rcv.start()
    try:
        rcv.uploads_dir.chmod(0o555)
        rcv.receipts_dir.chmod(0o555)
        ready = rcv.session.get(rcv.base_url + "/readyz", timeout=10)
        assert ready.status_code == 503
        refusals = ready.json()["reasons"]
        assert len(refusals) == 2, refusals
        page = PageDom(page_dom(url, profile))
        screenshot(url, tmp_path / "3-unready.png", profile)
        code, reasons = status_reasons(rcv.config_path)
    finally:
        rcv.close()
    assert page.status == "critical" and code == 2
    assert [f"critical: {r}" for r in refusals] == page.reasons[:2] == reasons[:2]
    assert page.reasons[2] == reasons[2]
    assert reasons[2].startswith("critical: delivery index unreadable: file is not a database")
    # The page alone knows what this receiver logged while starting.
    assert page.reasons[3:] == ["warning: the receiver logged 1 error while starting"]
    assert reasons[3:] == []
    storage = page.text["storage-state"]
    assert "ok" != storage.strip() and "uploads is missing or not writable" in storage
    assert "delivery index" in page.text["at-start"] and page.before("at-start", "trends")
    assert "No warnings or errors since start." not in page.text.get("no-problems", "")
