"""Fixtures of the end-to-end suite: real canner-receiver processes on loopback ports."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import AS_NOBODY, REPO, Nobody, Receiver


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    """A fresh receiver (projects ``example`` and ``other``, ``min_free_bytes = 1``)."""
    rcv = Receiver.in_dir(tmp_path / "receiver")
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


@pytest.fixture(scope="module")
def shared_receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    """One receiver for a whole module of tests that neither kill it nor change its config."""
    rcv = Receiver.in_dir(tmp_path_factory.mktemp("shared") / "receiver")
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


@pytest.fixture
def make_receiver(tmp_path: Path) -> Iterator[Callable[..., Receiver]]:
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
