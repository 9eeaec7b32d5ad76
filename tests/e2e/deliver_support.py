"""Machinery of the delivery end-to-end tests: a fake Internet Archive process, a receiver whose
config delivers to it, and ``twistd canner-deliver`` processes on the same data directory.

Nothing is mocked.  The fake IA is ``tests/fake_ia.py`` run as its own process on a loopback port;
the tests talk to it through its admin API (``/_fake/objects``, ``/_fake/faults``,
``/_fake/requests``) and read its stored files.  The deliver process is observed the way an
operator would: ``canner deliveries --config FILE`` (JSONL), the data directory, and its log.

Two test-only techniques fast-forward time in ``delivery.sqlite`` (see :func:`make_due_now` and
:func:`make_checks_due_now`): canner's retry backoff starts at 60 s and its verification re-check
at 10 s, too slow for a test; an operator retry does the same thing by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import requests
from e2e_support import REPO, Receiver, end_process, free_port, spawn_daemon

FAKE_IA = REPO / "tests" / "fake_ia.py"
ACCESS = "e2e-access"
SECRET = "e2e-secret-not-in-logs"
PROJECT = "example"
IDENTIFIER_TEMPLATE = "example-{date}-{object_id}"
PACKAGE_IDENTIFIER = "example-{batch_date}-{package}"
START_TIMEOUT = 20.0

T = TypeVar("T")


def venv_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if not candidate.exists():
        candidate = REPO / ".venv" / "bin" / name
    return str(candidate)


def canner_command(
    config: Path, *argv: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``canner ARGV... --config CONFIG`` as an operator runs it, from the repository root."""
    return subprocess.run(
        [venv_bin("canner"), *argv, "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy (bounded); return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = "\n" + describe() if describe is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def file_md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# -- the fake Internet Archive ---------------------------------------------------------------


@dataclass
class FakeIA:
    """``tests/fake_ia.py`` as a separate process."""

    root: Path
    metadata_lag: float = 0.0
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def store_dir(self) -> Path:
        return self.root / "store"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "fake_ia.log"

    def start(self, *faults: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        port_file = self.root / "port"
        port_file.unlink(missing_ok=True)
        args = [
            sys.executable,
            str(FAKE_IA),
            "--port",
            str(self.port),
            "--dir",
            str(self.store_dir),
            "--port-file",
            str(port_file),
            "--metadata-lag",
            str(self.metadata_lag),
            "--access",
            ACCESS,
            "--secret",
            SECRET,
        ]
        for fault in faults:
            args += ["--fault", fault]
        self.store_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the fake IA did not start:\n" + self.log_tail())
            time.sleep(0.02)
        self.port = int(port_file.read_text().strip())
        wait_for(self._healthy, START_TIMEOUT, "the fake IA's health endpoint")

    def _healthy(self) -> bool:
        try:
            return self.session.get(self.url + "/_fake/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        end_process(self.proc, signal.SIGTERM, 10)
        self.session.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _get(self, what: str) -> Any:
        r = self.session.get(f"{self.url}/_fake/{what}", timeout=10)
        r.raise_for_status()
        return r.json()

    def objects(self) -> list[dict[str, Any]]:
        return list(self._get("objects"))

    def object(self, identifier: str, name: str) -> dict[str, Any] | None:
        for o in self.objects():
            if o["identifier"] == identifier and o["name"] == name:
                return o
        return None

    def items(self) -> dict[str, Any]:
        return dict(self._get("items"))

    def requests(self) -> list[dict[str, Any]]:
        return list(self._get("requests"))

    def puts(self) -> list[dict[str, Any]]:
        return [r for r in self.requests() if r["method"] == "PUT"]

    def multipart(self) -> dict[str, Any]:
        """Open multipart uploads and the part body bytes received per "identifier/name"."""
        return dict(self._get("multipart"))

    def faults(self) -> list[dict[str, Any]]:
        return list(self._get("faults"))

    def add_fault(self, kind: str, count: int = 1, target: str = "", **extra: Any) -> None:
        body = {"kind": kind, "count": count, "target": target, **extra}
        r = self.session.post(f"{self.url}/_fake/faults", data=json.dumps(body), timeout=10)
        assert r.status_code == 200, f"adding fault {body}: {r.status_code} {r.text}"

    def clear_faults(self) -> None:
        r = self.session.delete(f"{self.url}/_fake/faults", timeout=10)
        assert r.status_code == 200

    def set_metadata_lag(self, seconds: float) -> None:
        r = self.session.post(
            f"{self.url}/_fake/settings", data=json.dumps({"metadata_lag": seconds}), timeout=10
        )
        assert r.status_code == 200

    def incoming(self) -> dict[str, int]:
        """PUT bodies being received right now: temp file name -> bytes so far."""
        found = {}
        folder = self.store_dir / "incoming"
        for entry in folder.iterdir() if folder.exists() else ():
            try:
                found[entry.name] = entry.stat().st_size
            except FileNotFoundError:
                continue
        return found


# -- the receiver, configured to deliver to the fake -------------------------------------------


@dataclass
class DeliveryReceiver(Receiver):
    """A receiver whose config file also carries ``[projects.example.delivery]`` (same file for
    canner-deliver).  ``other`` stays a project without delivery."""

    fake_url: str = ""
    retention: str = "2s"
    concurrency: int = 2
    metadata: dict[str, list[str]] = field(default_factory=dict)
    # More keys of [projects.example.delivery] (verify_timeout, readback_bytes, ...).
    delivery: dict[str, Any] = field(default_factory=dict)
    # [projects.example.packaging] (mode = "megawarc" ...); empty: identity delivery
    packaging: dict[str, str] = field(default_factory=dict)
    # More TOML tables appended to the config file ([hq], [ledger], ...).
    extra: str = ""

    @classmethod
    def configured(
        cls,
        root: Path,
        fake_url: str,
        retention: str = "2s",
        concurrency: int = 2,
        delivery: dict[str, Any] | None = None,
        packaging: dict[str, str] | None = None,
        extra: str = "",
        **config: Any,
    ) -> DeliveryReceiver:
        root.mkdir(parents=True, exist_ok=True)
        rcv = cls(
            root=root,
            port=free_port(),
            data_dir=root / "srv" / "canner" / "data",
            config_path=root / "canner.toml",
            log_path=root / "receiver.log",
            fake_url=fake_url,
            retention=retention,
            concurrency=concurrency,
            metadata={"collection": ["test"], "title": ["Artifact {object_id}"]},
            delivery=dict(delivery or {}),
            packaging=packaging or {},
            extra=extra,
        )
        if rcv.packaging:
            rcv.metadata = {"collection": ["test"], "title": ["Batch {batch_date} {package}"]}
        (root / "keys").write_text(f"{ACCESS}\n{SECRET}\n", encoding="utf-8")
        config.setdefault("max_upload_bytes", 512 * 1024 * 1024)
        rcv.write_config(**config)
        return rcv

    def write_config(self, **overrides: Any) -> None:
        overrides.setdefault("delivery_concurrency", self.concurrency)
        super().write_config(**overrides)
        if not self.fake_url:
            return
        packed = bool(self.packaging)
        lines = [
            "",
            *(
                [f"[projects.{PROJECT}.packaging]"]
                + [f"{key} = {json.dumps(value)}" for key, value in self.packaging.items()]
                if packed
                else []
            ),
            "",
            f"[projects.{PROJECT}.delivery]",
            'sink = "internet_archive"',
            f"credentials = {json.dumps(str(self.root / 'keys'))}",
            f"identifier = {json.dumps(PACKAGE_IDENTIFIER if packed else IDENTIFIER_TEMPLATE)}",
            f"remote_name = {json.dumps('{package}' if packed else '{filename}')}",
            f"local_artifact_retention = {json.dumps(self.retention)}",
            f"s3_url = {json.dumps(self.fake_url)}",
            f"metadata_url = {json.dumps(self.fake_url)}",
            *(f"{key} = {json.dumps(value)}" for key, value in self.delivery.items()),
            "",
            f"[projects.{PROJECT}.delivery.metadata]",
            *(f"{key} = {json.dumps(values)}" for key, values in self.metadata.items()),
            "",
            self.extra,
            "",
        ]
        with open(self.config_path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines))

    @property
    def db_path(self) -> Path:
        return self.data_dir / "delivery.sqlite"


@dataclass
class DirectoryReceiver(Receiver):
    """A receiver whose config also delivers project ``example`` into ``archive``."""

    archive: Path = Path("/nonexistent")
    retention: str = "2s"

    @classmethod
    def delivering_to(cls, root: Path, archive: Path, retention: str = "2s") -> DirectoryReceiver:
        """A receiver in ``root`` (data in ``root/data``) delivering into ``archive``; its config
        is written, nothing is started."""
        rcv = cls(
            root=root,
            port=free_port(),
            data_dir=root / "data",
            config_path=root / "canner.toml",
            log_path=root / "receiver.log",
            archive=archive,
            retention=retention,
        )
        rcv.write_config()
        return rcv

    def write_config(self, **overrides: Any) -> None:
        overrides.setdefault("max_upload_bytes", 512 * 1024 * 1024)
        super().write_config(**overrides)
        lines = [
            "",
            "[projects.example.delivery]",
            'sink = "directory"',
            f'path = "{self.archive}"',
            'identifier = "{project}-{object_id}"',
            'remote_name = "{filename}"',
            f'local_artifact_retention = "{self.retention}"',
            "",
        ]
        with open(self.config_path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines))


# -- canner-deliver ----------------------------------------------------------------------------


@dataclass
class Deliver:
    """One ``twistd canner-deliver`` process."""

    config_path: Path
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    twistd_args: list[str] = field(default_factory=list)  # e.g. a --logger

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for anything."""
        self.starts += 1
        return spawn_daemon(
            "deliver", self.config_path, self.log_path, self.starts, self.twistd_args
        )

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start and wait until the process holds the data directory lock (it writes its pid)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = self.spawn()
        wait_for(self.ready, timeout, "canner-deliver to take its lock", 0.05, self.log_tail)

    def ready(self) -> bool:
        """Whether the process has taken its lock and runs its reactor (raises if it ended)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"canner-deliver exited with {self.proc.returncode} during start-up:\n"
                + self.log_tail()
            )
        try:
            locked = (self.data_dir / "deliver.lock").read_text().strip() == str(self.proc.pid)
        except FileNotFoundError:
            return False
        return locked and "reactor class" in self.current_log()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 15.0) -> int | None:
        return end_process(self.proc, sig, timeout)

    def stop(self) -> int | None:
        return self.kill(signal.SIGTERM)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def current_log(self) -> str:
        """The log of the latest start only."""
        return self.log_text().rpartition(f"===== start #{self.starts} =====")[2]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(no log)"


# -- inspecting and fast-forwarding the delivery index ----------------------------------------


def deliveries(config_path: Path) -> dict[str, dict[str, Any]]:
    """``canner deliveries --config FILE``, by object id."""
    out = subprocess.run(
        [venv_bin("canner"), "deliveries", "--config", str(config_path)],
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, f"canner deliveries failed: {out.stderr.decode()}"
    rows = [json.loads(line) for line in out.stdout.decode().splitlines() if line.strip()]
    return {row["object_id"]: row for row in rows}


@contextmanager
def _db(db: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=10000")
        yield conn
    finally:
        conn.close()


def make_due_now(db: Path) -> int:
    """Test-only fast-forward: every ``retry_wait`` row becomes due at once.

    canner retries a failed attempt after 60 s, 120 s, ... (an operator error after an hour):
    too slow for a test.  This is what an operator retry does by hand (``next_attempt_at`` is the
    only column touched; the state machine is left alone, so the scheduler still claims the row
    with its guarded update).  Returns the number of rows made due.
    """
    with _db(db) as conn:
        return conn.execute(
            "UPDATE outbound SET next_attempt_at = 0 WHERE kind = 'object' AND state = 'retry_wait'"
        ).rowcount


def make_checks_due_now(db: Path) -> int:
    """Test-only fast-forward of verification/purge follow-ups (``next_check_at``)."""
    with _db(db) as conn:
        return conn.execute(
            "UPDATE outbound SET next_check_at = 0 WHERE kind = 'object' AND state = 'delivered'"
            " AND next_check_at IS NOT NULL"
        ).rowcount


def remove_index(data_dir: Path) -> list[str]:
    """Delete ``delivery.sqlite`` and its WAL/SHM files; returns what was there."""
    removed = []
    for name in ("delivery.sqlite", "delivery.sqlite-wal", "delivery.sqlite-shm"):
        path = data_dir / name
        if path.exists():
            path.unlink()
            removed.append(name)
    return removed


# -- a test environment: fake IA + receiver + deliver -----------------------------------------


@dataclass
class Env:
    fake: FakeIA
    receiver: DeliveryReceiver
    deliver: Deliver

    @property
    def config(self) -> Path:
        return self.receiver.config_path

    @property
    def db(self) -> Path:
        return self.receiver.db_path

    @property
    def data_dir(self) -> Path:
        return self.receiver.data_dir

    def rows(self) -> dict[str, dict[str, Any]]:
        return deliveries(self.config)

    def row(self, object_id: str) -> dict[str, Any]:
        return self.rows()[object_id]

    def upload(self, data: bytes, filename: str | None = None) -> str:
        oid, _receipt = self.receiver.upload_all(data, filename=filename)
        return oid

    def describe(self) -> str:
        rows = json.dumps(list(self.rows().values()), indent=1)[-4000:]
        return (
            f"deliveries:\n{rows}\n--- deliver log ---\n{self.deliver.log_tail(40)}"
            f"\n--- fake objects ---\n{json.dumps(self.fake.objects(), indent=1)[-2000:]}"
        )

    def wait_rows(
        self,
        predicate: Callable[[dict[str, dict[str, Any]]], bool],
        timeout: float,
        what: str,
        interval: float = 0.2,
    ) -> dict[str, dict[str, Any]]:
        def check() -> dict[str, dict[str, Any]] | None:
            rows = self.rows()
            return rows if predicate(rows) else None

        result = wait_for(check, timeout, what, interval, self.describe)
        assert result is not None
        return result

    def wait_state(
        self, object_ids: list[str], timeout: float, what: str = "", **expected: Any
    ) -> dict[str, dict[str, Any]]:
        def ok(rows: dict[str, dict[str, Any]]) -> bool:
            return all(
                oid in rows
                and all(
                    (rows[oid][k] is not None) if v is ... else rows[oid][k] == v
                    for k, v in expected.items()
                )
                for oid in object_ids
            )

        return self.wait_rows(ok, timeout, what or f"{object_ids} to reach {expected}")

    def close(self) -> None:
        # A deliver that ignores SIGTERM (a bug some tests expose) is killed after 5 s.
        def stop_deliver() -> None:
            self.deliver.kill(signal.SIGTERM, timeout=5)

        for stop in (stop_deliver, self.receiver.close, self.fake.stop):
            try:
                stop()
            except Exception:  # tear everything down, whatever fails
                pass


def make_env(
    root: Path,
    *,
    metadata_lag: float = 0.0,
    retention: str = "2s",
    concurrency: int = 2,
    start_deliver: bool = True,
    delivery: dict[str, Any] | None = None,
    extra: Callable[[FakeIA, Path], str] | None = None,
    **config: Any,
) -> Env:
    fake = FakeIA(root / "fake", metadata_lag=metadata_lag)
    fake.start()
    receiver = DeliveryReceiver.configured(
        root / "canner",
        fake.url,
        retention=retention,
        concurrency=concurrency,
        delivery=delivery,
        extra=extra(fake, root / "canner") if extra is not None else "",
        **config,
    )
    deliver = Deliver(receiver.config_path, receiver.data_dir, root / "canner" / "deliver.log")
    env = Env(fake, receiver, deliver)
    try:
        receiver.start()
        if start_deliver:
            deliver.start()
    except BaseException:
        env.close()
        raise
    return env


def envs(tmp_path: Path) -> Iterator[Callable[..., Env]]:
    """The body of an ``env_factory`` fixture: ``env_factory(**options)`` -> a started
    :class:`Env` in ``tmp_path``; everything is stopped afterwards.  A test module registers it
    with ``pytest.fixture(name="env_factory")(envs)``."""
    made: list[Env] = []

    def make(**options: Any) -> Env:
        env = make_env(tmp_path / f"env{len(made)}", **options)
        made.append(env)
        return env

    try:
        yield make
    finally:
        for env in made:
            env.close()


def identifier_for(row: dict[str, Any]) -> str:
    return str(row["remote_identifier"])


def data_files(data_dir: Path, object_id: str) -> dict[str, bool]:
    uploads = data_dir / "uploads"
    return {
        "payload": (uploads / object_id).exists(),
        "info": (uploads / f"{object_id}.info").exists(),
        "receipt": (data_dir / "receipts" / f"{object_id}.json").exists(),
    }


def journal_records(data_dir: Path, object_id: str, kind: str) -> list[dict[str, Any]]:
    """The object's records of ``kind`` in the facts journal (``journal/*.jsonl``), in order."""
    found = []
    for segment in sorted((data_dir / "journal").glob("*.jsonl")):
        for line in segment.read_bytes().splitlines():
            record = json.loads(line)
            if record["object_id"] == object_id and record["kind"] == kind:
                found.append(record)
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
