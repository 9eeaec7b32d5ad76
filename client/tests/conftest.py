"""Fixtures of the client's tests: real canner-receiver processes (through the repository's e2e
helpers), the fault proxy, deterministic test files and the ``canner-upload`` command."""

from __future__ import annotations

import os
import random
import subprocess
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


def make_file(path: Path, size: int, seed: int = 0) -> Path:
    """``size`` pseudo-random bytes (fast: a random block, varied per block)."""
    rng = random.Random(seed)
    block = rng.randbytes(min(size, 4 << 20)) if size else b""
    with open(path, "wb") as f:
        written, n = 0, 0
        while written < size:
            piece = n.to_bytes(8, "big") + block[8:]
            piece = piece[: size - written]
            f.write(piece)
            written += len(piece)
            n += 1
    return path


def cli_command(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "canner_client", *map(str, args)]


def run_cli(*args: str | os.PathLike[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, check=False
    )
