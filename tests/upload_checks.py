"""What tests of the receiver send (a tus client's values) and check on disk afterwards,
shared by the in-memory and the end-to-end tests."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from pathlib import Path

import blake3


def blake3_hex(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def b64(text: str | bytes) -> str:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def metadata_header(pairs: Iterable[tuple[str, str | bytes | None]]) -> str:
    """``Upload-Metadata`` from ``(key, value)`` pairs (None: a key without a value)."""
    return ",".join(key if value is None else f"{key} {b64(value)}" for key, value in pairs)


def snapshot(root: Path) -> set[Path]:
    """Every file and directory below ``root``."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(Path(dirpath) / name)
    return found
