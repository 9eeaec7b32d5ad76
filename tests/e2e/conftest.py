"""Fixtures of the end-to-end suite: real canner-receiver processes on loopback ports."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import Receiver


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
def open_tmp() -> Iterator[Path]:
    """A temporary directory the unprivileged user of ``AS_NOBODY`` can reach (``tmp_path``
    lies under pytest's 0700 root)."""
    folder = Path(tempfile.mkdtemp(prefix="canner-e2e-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
