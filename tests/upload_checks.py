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


def upload_metadata(checksum: str, project: str = "example", filename: str | None = None) -> str:
    """``Upload-Metadata`` of a creation as canner's clients send it."""
    pairs: list[tuple[str, str | bytes | None]] = [("project", project), ("checksum", checksum)]
    if filename is not None:
        pairs.append(("filename", filename))
    return metadata_header(pairs)


def bad_framing(object_id: str) -> dict[str, bytes]:
    """PATCHes of ``object_id`` whose framing the HTTP layer refuses before canner's code runs,
    by what is wrong with them; each must get a 4xx that still carries ``Tus-Resumable``."""
    head = (
        f"PATCH /files/{object_id} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\n"
        "Upload-Offset: 0\r\nContent-Type: application/offset+octet-stream\r\n"
        "Connection: close\r\n"
    ).encode()
    return {
        "Content-Length +5": head + b"Content-Length: +5\r\n\r\nhello",
        "Content-Length twice": head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    }


def check_framing_refusal(what: str, answer: bytes) -> None:
    """``answer`` (raw bytes) to a :func:`bad_framing` request is a 4xx with Tus-Resumable."""
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 4"), f"{what}: {answer[:200]!r}"
    header_block = rest.split(b"\r\n\r\n", 1)[0].lower()
    assert b"tus-resumable: 1.0.0" in header_block, (
        f"{what}: {status_line.decode()} without Tus-Resumable: {answer[:200]!r}"
    )


def snapshot(root: Path) -> set[Path]:
    """Every file and directory below ``root``."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(Path(dirpath) / name)
    return found
