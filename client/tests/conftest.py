"""Fixtures of the client's tests: real canner-receiver processes (started through the
repository's e2e helpers) and the fault proxy."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_support import Receiver  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402

MAX_UPLOAD = 2 << 30


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    """A fresh receiver that takes uploads up to 2 GiB (project ``example``)."""
    rcv = Receiver.in_dir(tmp_path / "receiver", max_upload_bytes=MAX_UPLOAD)
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()


@pytest.fixture
def proxy(receiver: Receiver) -> Iterator[FaultProxy]:
    fp = FaultProxy(receiver.port)
    try:
        yield fp
    finally:
        fp.close()


@pytest.fixture
def make_full_receiver(tmp_path: Path) -> Iterator[Receiver]:
    """A receiver whose free-space floor can never be met: POST and PATCH get 429."""
    rcv = Receiver.in_dir(tmp_path / "full", min_free_bytes=1 << 60)
    try:
        rcv.start()
        yield rcv
    finally:
        rcv.close()
