"""Fixtures of the end-to-end suite: real canner-receiver processes on loopback ports."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import e2e_support
import pytest
from e2e_support import AS_NOBODY, REPO, Nobody, Receiver

# Suites that run twice: on one process and on a node of two workers (DESIGN §9): tus
# conformance, the third-party clients, the Go SDK in every network situation.
NODE_SUITES = frozenset(
    {"test_e2e_acceptance.py", "test_e2e_clients.py", "test_e2e_real_networks.py"}
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if Path(str(metafunc.module.__file__)).name in NODE_SUITES:
        metafunc.parametrize(
            "node_workers", [1, 2], indirect=True, scope="module", ids=["w1", "w2"]
        )


@pytest.fixture(scope="module", autouse=True)
def node_workers(request: pytest.FixtureRequest) -> Iterator[int]:
    """``[receiver] workers`` of the receivers a module's tests start without naming it: 1 and
    2 for :data:`NODE_SUITES`, else ``CANNER_E2E_WORKERS`` (default 1)."""
    before = e2e_support.E2E_WORKERS
    e2e_support.E2E_WORKERS = getattr(request, "param", before)
    yield e2e_support.E2E_WORKERS
    e2e_support.E2E_WORKERS = before


@pytest.fixture
def receiver(tmp_path: Path, node_workers: int) -> Iterator[Receiver]:
    """A fresh receiver (projects ``example`` and ``other``, ``min_free_bytes = 1``)."""
    rcv = Receiver.in_dir(tmp_path / "receiver")
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


@pytest.fixture(scope="module")
def shared_receiver(
    tmp_path_factory: pytest.TempPathFactory, node_workers: int
) -> Iterator[Receiver]:
    """One receiver for a whole module of tests that neither kill it nor change its config."""
    rcv = Receiver.in_dir(tmp_path_factory.mktemp("shared") / "receiver")
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


@pytest.fixture
def make_receiver(tmp_path: Path, node_workers: int) -> Iterator[Callable[..., Receiver]]:
    """A factory for receivers with a custom data directory or config keys (started)."""
    made: list[Receiver] = []

    def make(name: str = "receiver", data_dir: Path | None = None, **config: Any) -> Receiver:
        rcv = Receiver.in_dir(tmp_path / name, data_dir=data_dir, **config)
        made.append(rcv)
        rcv.start()
        return rcv

    try:
        yield make
    finally:
        for rcv in made:
            rcv.close()


@pytest.fixture
def nobody() -> Iterator[Nobody]:
    """Running a daemon as nobody: a temporary directory nobody can reach (``tmp_path`` lies
    under pytest's 0700 root), and the repository bind-mounted into it (a clone may itself lie
    under a directory nobody cannot search), the daemon started from that mount."""
    folder = Path(tempfile.mkdtemp(prefix="canner-e2e-", dir="/tmp"))
    folder.chmod(0o755)
    repo = folder / "repo"
    repo.mkdir()
    subprocess.run(["mount", "--bind", str(REPO), str(repo)], check=True)
    # The mount's source first on sys.path: the venv's editable install names the original path.
    run_twistd = (
        f"import sys; sys.path.insert(0, {str(repo)!r}); sys.argv[0] = 'twistd';"
        " from twisted.scripts.twistd import run; run()"
    )
    try:
        yield Nobody(folder, AS_NOBODY, [str(repo / ".venv" / "bin" / "python3"), "-c", run_twistd])
    finally:
        subprocess.run(["umount", str(repo)], check=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cleanup() -> Iterator[Callable[[Callable[[], Any]], None]]:
    """Register stops (daemons, rsync servers) that run at the test's end, last first."""
    stops: list[Callable[[], Any]] = []
    yield stops.append
    for stop in reversed(stops):
        try:
            stop()
        except Exception:  # tear everything down, whatever fails
            pass
