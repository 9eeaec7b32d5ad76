"""``canner adopt-go``: a Go canner's data directory (tests/go_canner_fixture.py, written as
docs/reference/go-canner.md describes it) taken over into canner's, in every state it holds."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from canner.cli.base import Io
from canner.cli.main import main
from canner.fs import DataDirLock
from canner.go_canner.godir import GoDataDir
from canner.store.uploads import UploadStore
from tests.go_canner_fixture import NOW, STATES, kill_writer_after, listing, write_go_data_dir

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Setup:
    def __init__(self, root: Path) -> None:
        self.go = write_go_data_dir(root / "go")
        self.data_dir = root / "data"
        self.data_dir.mkdir()
        self.config = root / "canner.toml"
        self.config.write_text(
            'issuer = "https://canner.test"\n'
            f'data_dir = "{self.data_dir}"\n'
            f'listen = "tcp:{free_port()}:interface=127.0.0.1"\n'
            'node_prefix = "n1"\n'
            "min_free_bytes = 1\n\n[projects.example]\n",
            encoding="utf-8",
        )
        self.receipts_before = self.go.receipts

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = main([*argv, "--config", str(self.config)], Io(out, err, lambda: NOW))
        return code, out.getvalue(), err.getvalue()

    def subprocess(self, *argv: str, crash_at: str = "") -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CANNER_CRASH_AT": crash_at}
        return subprocess.run(
            [sys.executable, "-m", "canner.cli.main", *argv, "--config", str(self.config)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )

    def rows(self) -> dict[str, dict[str, Any]]:
        conn = sqlite3.connect(self.data_dir / "delivery.sqlite")
        conn.row_factory = sqlite3.Row
        try:
            return {r["object_id"]: dict(r) for r in conn.execute("SELECT * FROM object_delivery")}
        finally:
            conn.close()


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def oid(setup: Setup, state: str) -> str:
    return setup.go.of(state).oid


def test_the_fixture_is_a_go_data_directory(setup: Setup) -> None:
    """.info files point elsewhere (absolute Storage), the partial upload has its .attempt,
    an identity package kept after its source purge is a hard link to nothing else."""
    go = setup.go.root
    info = json.loads((go / "uploads" / f"{oid(setup, 'partial')}.info").read_bytes())
    assert info["Storage"]["Path"].startswith("/srv/old-canner/") and info["Offset"] == 0
    assert (go / "uploads" / f"{oid(setup, 'partial')}.attempt").exists()
    delivering = oid(setup, "delivering")
    linked = [
        p
        for p in (go / "packages").iterdir()
        if p.stat().st_ino == (go / "uploads" / delivering).stat().st_ino
    ]
    assert len(linked) == 1 and linked[0].name.endswith(".gz")


def test_dry_run_prints_a_step_per_object_and_changes_nothing(setup: Setup) -> None:
    before = sorted(str(p) for p in setup.go.root.rglob("*"))
    code, out, err = setup("adopt-go", str(setup.go.root))
    assert code == 0, err
    for state, action in STATES.items():
        line = next(line for line in out.splitlines() if line.startswith(oid(setup, state)))
        assert line.split()[1] == action, line
    packages = [line for line in out.splitlines() if line.startswith("package ")]
    assert len(packages) == 5, out  # the Go packages not delivered, each used or rebuilt
    used = [line for line in packages if "from the Go package file packages/" in line]
    assert len(used) == 2 and all("sealed" in line for line in used)
    assert sum(1 for line in packages if "rebuilt" in line) == 3
    assert "leftover receipts/.receipt-456: would be deleted" in out
    assert "nothing was changed" in out
    assert sorted(str(p) for p in setup.go.root.rglob("*")) == before
    assert not (setup.data_dir / "adopt-go").exists()


def check_adopted(setup: Setup, out: str) -> None:
    """Everything adoption promises, after one run or a killed run and a second one."""
    receipts = setup.data_dir / "receipts"
    # Every receipt byte for byte, none left in the Go directory.
    for object_id, data in setup.receipts_before.items():
        assert (receipts / f"{object_id}.json").read_bytes() == data
    assert setup.go.receipts == {}
    rows = setup.rows()
    for state, action in STATES.items():
        obj = setup.go.of(state)
        if action == "delivered":
            row = rows[obj.oid]
            assert row["state"] == "delivered" and row["verified_at"] is not None, row
            assert row["remote_identifier"].startswith("saveweb-example-")
            assert row["purged_at"] is not None and row["next_check_at"] is None
        elif action == "deliver":
            assert rows[obj.oid]["state"] == "pending", state
            assert (setup.data_dir / "uploads" / obj.oid).read_bytes() == obj.data, state
        else:
            assert obj.oid not in rows
    assert len(rows) == sum(1 for a in STATES.values() if a != "in_flight")
    # Uploads in flight: same offset and metadata, canner's sidecar (no Storage).
    uploads = UploadStore(setup.data_dir / "uploads")
    for state in ("partial", "empty", "complete"):
        obj = setup.go.of(state)
        info = uploads.read_info(obj.oid)
        assert info is not None and info.size == len(obj.data)
        assert dict(info.metadata) == obj.metadata()
        assert b"Storage" not in uploads.info_path(obj.oid).read_bytes()
        stored = {"partial": len(obj.data) // 2, "empty": 0, "complete": len(obj.data)}[state]
        assert uploads.offset(obj.oid) == stored
    partial = uploads.data_path(oid(setup, "partial"))
    assert partial.stat().st_mtime == setup.go.last_patch_at  # idle since Go's last PATCH
    # Leftovers gone, the Go index retired, the directory marked.
    go = setup.go.root
    for name in setup.go.leftovers:
        assert not (go / name).exists(), name
    assert not (go / "delivery.sqlite").exists()
    assert (go / "delivery.sqlite.adopted-by-canner").exists()
    assert (go / "ADOPTED-BY-CANNER").exists()
    assert not any(p.name.endswith((".info", ".attempt")) for p in (go / "uploads").iterdir())
    assert (
        "adopt-go: receipts 11, uploads in flight 3, delivered 4, to deliver 7 (3 from Go"
        " package files, 3 rebuilt), problems 0" in out
    )


def test_apply_takes_every_state_over(setup: Setup) -> None:
    code, out, err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 0, out + err
    check_adopted(setup, out)
    assert "cleaned delivery.lock" in out


def test_a_second_apply_changes_nothing(setup: Setup) -> None:
    setup("adopt-go", str(setup.go.root), "--apply")
    rows = setup.rows()
    code, out, err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 0, err
    assert setup.rows() == rows
    check_adopted(setup, out)


def test_a_rebuilt_index_keeps_adopted_deliveries_delivered(setup: Setup) -> None:
    """The facts journal holds the Go deliveries: rebuild-index after losing delivery.sqlite
    brings them back delivered, never pending."""
    setup("adopt-go", str(setup.go.root), "--apply")
    for suffix in ("", "-wal", "-shm"):
        (setup.data_dir / f"delivery.sqlite{suffix}").unlink(missing_ok=True)
    code, _out, err = setup("rebuild-index")
    assert code == 0, err
    rows = setup.rows()
    for state, action in STATES.items():
        if action == "delivered":
            assert rows[oid(setup, state)]["state"] == "delivered", state
        elif action == "deliver":
            assert rows[oid(setup, state)]["state"] == "pending", state


@pytest.mark.parametrize("crash_at", ["adopt-go.placed", "adopt-go.indexed", "adopt-go.receipts"])
def test_sigkill_during_apply_then_a_second_run_finishes(setup: Setup, crash_at: str) -> None:
    """A real process killed (SIGKILL) between two durable steps; the second run finishes the
    job from the saved plan, and nothing is there twice."""
    killed = setup.subprocess("adopt-go", str(setup.go.root), "--apply", crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (setup.data_dir / "adopt-go" / "plan.json").exists()
    assert not (setup.go.root / "ADOPTED-BY-CANNER").exists()
    done = setup.subprocess("adopt-go", str(setup.go.root), "--apply")
    assert done.returncode == 0, done.stdout + done.stderr
    check_adopted(setup, done.stdout)
    # One facts-journal record per delivered object and kind, whatever the kill cut short.
    records = [
        json.loads(line)
        for seg in sorted((setup.data_dir / "journal").glob("*.jsonl"))
        for line in seg.read_bytes().splitlines()
    ]
    delivered = {oid(setup, s) for s, a in STATES.items() if a == "delivered"}
    assert {r["object_id"] for r in records} == delivered
    if crash_at != "adopt-go.placed":  # killed after the rows were in: no second copy
        assert len(records) == 2 * len(delivered)


def test_refuses_while_a_daemon_runs(setup: Setup) -> None:
    """The Go deliver's delivery.lock held, or an upload lock naming a live process."""
    import fcntl

    fd = os.open(setup.go.root / "delivery.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code, _out, err = setup("adopt-go", str(setup.go.root), "--apply")
    finally:
        os.close(fd)
    assert code == 1 and "delivery.lock" in err
    lock = setup.go.root / "uploads" / f"{oid(setup, 'partial')}.lock"
    lock.write_text(str(os.getpid()))
    code, _out, err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 1 and f"pid {os.getpid()}" in err
    assert setup.go.receipts == setup.receipts_before


def test_refuses_while_the_canner_receiver_listens(setup: Setup) -> None:
    text = setup.config.read_text()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        setup.config.write_text(text.replace("listen = ", f'listen = "tcp:{port}"\n#'))
        code, out, _err = setup("adopt-go", str(setup.go.root))
        assert code == 0 and "warning: something (canner-receiver?) answers on" in out
        code, _out, err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 1 and "answers on" in err


def test_refuses_while_a_canner_receiver_holds_its_lock(setup: Setup) -> None:
    """A canner-receiver serving the data directory (its receiver.lock held) on another port
    than the config's ``listen``: the dry run warns, ``--apply`` refuses naming the lock."""
    lock = DataDirLock(setup.data_dir / "receiver.lock")
    lock.acquire()
    try:
        code, out, _err = setup("adopt-go", str(setup.go.root))
        assert code == 0 and "warning: canner-receiver holds" in out and "receiver.lock" in out
        code, _out, err = setup("adopt-go", str(setup.go.root), "--apply")
    finally:
        lock.release()
    assert code == 1 and "receiver.lock" in err
    assert setup.go.receipts == setup.receipts_before


def test_a_receipt_without_bytes_is_a_reported_problem(setup: Setup) -> None:
    """Go purged a sealed package's source and lost the package file: the receipt is still
    served, the object is flagged for an operator, the run says so."""
    gone = setup.go.of("sealed_pending")
    for p in (setup.go.root / "packages").glob("example-*.gz"):
        if p.read_bytes() == gone.data:
            p.unlink()
    code, out, _err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 1
    assert f"problem {gone.oid}: receipt kept, but no upload or package file" in out
    assert (setup.data_dir / "receipts" / f"{gone.oid}.json").exists()
    row = setup.rows()[gone.oid]
    assert row["needs_operator"] == 1 and "Go canner" in row["last_error"]
    # Waiting for an operator, not pending: canner-deliver does not try it at once (its
    # reason would give way to "the local payload is missing") and HQ reads retry_wait.
    assert row["state"] == "retry_wait" and row["next_attempt_at"] > NOW, row
    assert_flagged(setup, gone.oid, "no upload or package file holds its bytes")
    # canner retry: due now, flag cleared, and told that the bytes must be put back first.
    code, out, err = setup("retry", gone.oid)
    assert code == 0, err
    assert "is due now" in out and f"uploads/{gone.oid} is missing" in out, out
    row = setup.rows()[gone.oid]
    assert (row["needs_operator"], row["next_attempt_at"]) == (0, NOW)


def assert_flagged(setup: Setup, object_id: str, why: str) -> None:
    """``canner status`` warns (exit 1) and names the object; ``canner deliveries
    --needs-operator`` and ``canner show`` give the reason."""
    code, out, err = setup("status")
    assert code == 1, out + err
    assert "warning: 1 deliveries need an operator" in err
    assert any(object_id in line and why in line for line in out.splitlines()), out
    code, out, err = setup("deliveries", "--needs-operator")
    assert code == 0, err
    [line] = out.splitlines()
    assert json.loads(line)["object_id"] == object_id and why in json.loads(line)["last_error"]
    code, out, err = setup("show", object_id)
    assert code == 0, err
    delivery = json.loads(out)["delivery"]
    assert delivery["needs_operator"] == 1
    assert "adopted from the Go canner" in delivery["last_error"]


def test_a_receipt_without_a_project_is_flagged(setup: Setup) -> None:
    """Go lost the artifacts row and the .info of an accepted object: the receipt is kept and
    served, the row (project unknown) is flagged for an operator, never delivered, and a retry
    says why it cannot help."""
    lost = setup.go.of("accepted")
    (setup.go.root / "uploads" / f"{lost.oid}.info").unlink()
    db = sqlite3.connect(setup.go.root / "delivery.sqlite")
    db.execute("DELETE FROM artifacts WHERE object_id = ?", (lost.oid,))
    db.commit()
    db.close()
    code, out, _err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 1
    assert f"problem {lost.oid}: receipt kept, but no project is known for it" in out, out
    assert f"its bytes stay at uploads/{lost.oid} in the Go directory" in out, out
    assert (setup.data_dir / "receipts" / f"{lost.oid}.json").exists()
    row = setup.rows()[lost.oid]
    assert (row["state"], row["needs_operator"], row["project"]) == ("retry_wait", 1, "(unknown)")
    assert_flagged(setup, lost.oid, "no project is known")
    code, out, err = setup("retry", lost.oid)
    assert code == 1 and "no project is known" in err, out + err
    code, out, err = setup("retry", "--needs-operator")
    assert code == 0 and f"{lost.oid} (project unknown) is not retried" in out, out + err
    assert setup.rows()[lost.oid]["needs_operator"] == 1


# -- a Go directory left with a WAL: the dry run reads it and changes no byte -------------------


def leave_go_wal(setup: Setup, how: str) -> str:
    """The Go index as a killed Go daemon leaves it (``killed``: the last commit only in -wal,
    -shm kept), the same without its -shm (``wal_without_shm``), or closed cleanly (``clean``:
    no -wal).  The commit in the WAL moves the object ``accepted`` to project ``from-the-wal``;
    returns the project the plan must show for it."""
    if how == "clean":
        assert not (setup.go.root / "delivery.sqlite-wal").exists()
        return "example"
    kill_writer_after(
        setup.go.root,
        "UPDATE artifacts SET project = 'from-the-wal' WHERE object_id = ?",
        oid(setup, "accepted"),
    )
    if how == "wal_without_shm":
        (setup.go.root / "delivery.sqlite-shm").unlink()
    return "from-the-wal"


@pytest.mark.parametrize("how", ["killed", "wal_without_shm", "clean"])
def test_dry_run_reads_the_go_wal_and_changes_no_byte(setup: Setup, how: str) -> None:
    project = leave_go_wal(setup, how)
    before = listing(setup.go.root)
    code, out, err = setup("adopt-go", str(setup.go.root))
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith(oid(setup, "accepted")))
    assert line.split()[1:3] == ["deliver", project], line
    assert listing(setup.go.root) == before
    assert not (setup.data_dir / "adopt-go").exists()


def test_apply_after_a_killed_go_daemon_takes_the_wal_commits(setup: Setup) -> None:
    """--apply on the killed daemon's directory: the plan has the WAL's commit, and the retired
    Go index holds it with no -wal or -shm left beside it."""
    leave_go_wal(setup, "killed")
    code, out, err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 0, out + err
    assert setup.rows()[oid(setup, "accepted")]["project"] == "from-the-wal"
    go = setup.go.root
    left = sorted(p.name for p in go.iterdir() if p.name.endswith(("-wal", "-shm")))
    assert left == [], left
    retired = sqlite3.connect(f"file:{go / 'delivery.sqlite.adopted-by-canner'}?mode=ro", uri=True)
    try:
        [(project,)] = retired.execute(
            "SELECT project FROM artifacts WHERE object_id = ?", (oid(setup, "accepted"),)
        ).fetchall()
    finally:
        retired.close()
    assert project == "from-the-wal"


def test_go_reader_derives_paths_from_ids(setup: Setup) -> None:
    go = GoDataDir(setup.go.root)
    assert go.upload_ids() == sorted(
        oid(setup, s)
        for s in ("accepted", "building", "delivering", "blocked", "partial", "empty", "complete")
    )
    artifacts, packages = go.read_index()
    assert len(artifacts) == 11 and len(packages) == 8


def test_an_id_canner_already_has_is_left_alone(setup: Setup) -> None:
    """A Go id that canner already holds (a node without a prefix issues bare ids too) is a
    problem: neither file is overwritten."""
    clash = setup.go.of("accepted")
    mine = b'{"mine":true}'
    (setup.data_dir / "receipts").mkdir()
    (setup.data_dir / "receipts" / f"{clash.oid}.json").write_bytes(mine)
    code, out, _err = setup("adopt-go", str(setup.go.root), "--apply")
    assert code == 1 and f"problem {clash.oid}: canner already has" in out
    assert (setup.data_dir / "receipts" / f"{clash.oid}.json").read_bytes() == mine
    assert (setup.go.root / "receipts" / f"{clash.oid}.json").exists()


def test_another_filesystem_is_copied_then_removed(tmp_path: Path) -> None:
    """The Go directory on another filesystem (tmpfs here): files are copied, fsynced and
    renamed into place, then removed from the Go side."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem")
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as other:
        setup = Setup(tmp_path)
        moved = Path(other) / "go"
        subprocess.run(["cp", "-a", str(setup.go.root), str(moved)], check=True)
        setup.go.root = moved
        code, out, err = setup("adopt-go", str(moved), "--apply")
        assert code == 0, out + err
        check_adopted(setup, out)
        assert not list((setup.data_dir / "uploads").glob(".*"))
