"""Helpers of the client's tests: deterministic test files and the ``canner-upload`` command."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path


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


def run_cli(
    *args: str | os.PathLike[str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_command(*args), capture_output=True, text=True, timeout=timeout, check=False
    )
