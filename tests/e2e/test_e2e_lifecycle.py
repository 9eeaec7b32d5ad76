"""SIGTERM at any moment of a daemon's life: from spawn, through start-up, just after it is
ready, and again while it stops.  Every time, the process ends within a bound, the way twistd
ends on SIGTERM (by that signal, after a clean stop), without a traceback; canner-deliver's
``deliver.lock`` is free afterwards.  And ``./dev daemons`` (what ``./dev run`` runs) sends each
daemon exactly one SIGTERM."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
import requests
from deliver_support import Deliver, DirectoryReceiver, venv_bin, wait_for
from e2e_support import REPO, START_TIMEOUT, spawn_daemon

from canner.delivery.liveness import read_heartbeat

pytestmark = pytest.mark.e2e

TRIALS = 12
# A clean stop takes well under a second here; past this the process is taken to hang.
STOP_BOUND = 15.0
# Receipts the rescan reads (and skips, damaged) at every start: a rescan still running while
# the SIGTERMs of the early trials land, as on a data directory with many receipts.
DAMAGED_RECEIPTS = 1500


def directory_receiver(root: Path) -> DirectoryReceiver:
    rcv = DirectoryReceiver.delivering_to(root, root / "archive")
    rcv.archive.mkdir(parents=True)
    return rcv


def sigterm_at_random_moments(
    spawn: Callable[[], subprocess.Popen[bytes]],
    ready: Callable[[], bool],
    log_of_start: Callable[[int], str],
    after_each: Callable[[str], None] = lambda what: None,
) -> None:
    """Start the daemon ``TRIALS`` times; SIGTERM it at a random moment from spawn (odd trials)
    or just after ``ready`` (even ones), in half the trials once more while it stops; each
    time it must end by that signal within ``STOP_BOUND`` seconds and log no traceback."""
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    for trial in range(1, TRIALS + 1):
        proc = spawn()
        try:
            if trial % 2:
                delay = rng.uniform(0.0, 1.0)
            else:
                wait_for(ready, START_TIMEOUT, "the daemon to be ready", 0.02)
                delay = rng.uniform(0.0, 0.5)
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            again = rng.uniform(0.0, 0.3) if rng.random() < 0.5 else None
            if again is not None:
                time.sleep(again)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            moment = "spawn" if trial % 2 else "ready"
            what = (
                f"trial {trial} (seed {seed}): SIGTERM {delay:.2f}s after {moment}, again {again}"
            )
            try:
                proc.wait(STOP_BOUND)
            except subprocess.TimeoutExpired:
                tail = log_of_start(trial)[-3000:]
                pytest.fail(f"{what}: still running {STOP_BOUND:.0f}s after SIGTERM:\n{tail}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = log_of_start(trial)
        assert proc.returncode == -signal.SIGTERM, f"{what}: exit {proc.returncode}\n{log[-3000:]}"
        assert "Traceback" not in log, f"{what}:\n{log[-3000:]}"
        after_each(what)


def lock_is_free(path: Path) -> bool:
    """Whether no process holds ``path``'s flock (taken and dropped at once when free)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # the process ended before it took the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_deliver_ends_on_sigterm_at_any_moment(tmp_path: Path) -> None:
    """canner-deliver ends on SIGTERM wherever in start-up or shut-down it lands, and frees its
    lock: the next deliver starts and, stopped, marks its heartbeat stopped."""
    rcv = directory_receiver(tmp_path)
    receipts = rcv.data_dir / "receipts"
    receipts.mkdir()
    for _ in range(DAMAGED_RECEIPTS):
        (receipts / f"{os.urandom(16).hex()}.json").write_text("{}")
    deliver = Deliver(rcv.config_path, rcv.data_dir, tmp_path / "deliver.log")
    lock = rcv.data_dir / "deliver.lock"

    def spawn() -> subprocess.Popen[bytes]:
        deliver.proc = deliver.spawn()
        return deliver.proc

    def lock_freed(what: str) -> None:
        assert lock_is_free(lock), f"{what}: deliver.lock is still held"

    sigterm_at_random_moments(
        spawn,
        deliver.ready,
        lambda trial: deliver.current_log(),
        lock_freed,
    )
    deliver.start()
    assert deliver.stop() == -signal.SIGTERM, deliver.log_tail()
    status = subprocess.run(
        [venv_bin("canner"), "status", "--json", "--config", str(rcv.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert json.loads(status.stdout)["deliver"]["state"] == "stopped", status.stdout


def test_receiver_ends_on_sigterm_at_any_moment(tmp_path: Path) -> None:
    """canner-receiver ends on SIGTERM wherever in start-up or shut-down it lands."""
    rcv = directory_receiver(tmp_path)

    def spawn() -> subprocess.Popen[bytes]:
        rcv.starts += 1
        rcv.proc = spawn_daemon("receiver", rcv.config_path, rcv.log_path, rcv.starts)
        return rcv.proc

    def ready() -> bool:
        assert rcv.proc is not None and rcv.proc.poll() is None, rcv.log_tail()
        try:
            return requests.get(f"{rcv.base_url}/healthz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def log_of_start(trial: int) -> str:
        return rcv.log_text().rpartition(f"===== start #{trial} =====")[2]

    sigterm_at_random_moments(spawn, ready, log_of_start)


def as_from_a_terminal() -> None:
    """A child's SIGINT back to the default, as a terminal's Ctrl-C finds it: a suite started
    with SIGINT ignored (``nohup``, ``cmd &`` in a script, some CI runners) would hand the
    ignore down, and bash cannot trap a signal ignored when it started (the Ctrl-C is lost)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("how", "suite_ignores_sigint", "relative"),
    [
        ("ctrl-c", False, False),
        ("ctrl-c", True, False),
        ("a daemon ends", False, False),
        ("ctrl-c", False, True),
    ],
    ids=[
        "ctrl-c",
        "ctrl-c, suite started with SIGINT ignored",
        "a daemon ends",
        "ctrl-c, CONFIG relative to the caller",
    ],
)
def test_dev_daemons_sends_each_daemon_one_sigterm(
    tmp_path: Path, how: str, suite_ignores_sigint: bool, relative: bool
) -> None:
    """``./dev daemons CONFIG`` stops both daemons with one SIGTERM each, on Ctrl-C (SIGINT to
    the script) or when one of them ends, and waits for both; the Ctrl-C reaches it also from
    a suite that runs with SIGINT ignored; a relative CONFIG is the caller's, not the clone's."""
    rcv = directory_receiver(tmp_path)
    out = tmp_path / "dev.log"
    started = time.time()
    # Relative: from the directory above the test's, so the path has a directory part too.
    cwd = tmp_path.parent if relative else REPO
    config = os.path.relpath(rcv.config_path, cwd) if relative else str(rcv.config_path)

    def deliver_beats(since: float) -> bool:
        # The first heartbeat is written from the index's thread pool, which starts once the
        # reactor runs: its signal handlers are installed by then (a SIGTERM before them would
        # kill deliver without its "Received SIGTERM").
        try:
            with closing(sqlite3.connect(rcv.data_dir / "delivery.sqlite", timeout=1)) as db:
                beat = read_heartbeat(db.cursor())
        except sqlite3.Error:
            return False
        return beat is not None and beat.started_at >= since and beat.stopped_at is None

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if suite_ignores_sigint else None
    try:
        with open(out, "wb") as f:
            dev = subprocess.Popen(
                [str(REPO / "dev"), "daemons", config],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=as_from_a_terminal,
            )
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    try:

        def both_ready() -> bool:
            assert dev.poll() is None, out.read_text()
            try:
                healthy = requests.get(f"{rcv.base_url}/healthz", timeout=1).status_code == 200
            except requests.RequestException:
                return False
            text = out.read_text()
            return healthy and text.count("reactor class") == 2 and deliver_beats(started)

        wait_for(both_ready, START_TIMEOUT, "both daemons to start", 0.05, out.read_text)
        if how == "ctrl-c":
            dev.send_signal(signal.SIGINT)
        else:
            found = subprocess.run(
                ["pgrep", "-P", str(dev.pid), "-f", "canner-receiver"],
                capture_output=True,
                text=True,
                check=True,
            )
            os.kill(int(found.stdout.split()[0]), signal.SIGTERM)
        dev.wait(STOP_BOUND)
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()
    text = out.read_text()
    assert dev.returncode == (0 if how == "ctrl-c" else 128 + signal.SIGTERM), text
    assert text.count("Received SIGTERM") == 2, text
    assert "already stopping" not in text, text
    assert "Traceback" not in text, text
    assert lock_is_free(rcv.data_dir / "deliver.lock")
