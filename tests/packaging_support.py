"""Members for packaging tests: real WARCs (warcio), zstd WARCs with trained dictionaries, and
an independent megawarc ``restore`` written from the documented format
(``docs/reference/megawarc.md``), not from canner's builder."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import random
import tarfile
import uuid
from pathlib import Path
from typing import IO

import blake3
import zstandard

SKIPPABLE_MAGIC = b"\x5d\x2a\x4d\x18"


def warc_record(uri: str, payload: bytes) -> bytes:
    """One WARC/1.1 response record, uncompressed."""
    block = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n" + payload
    record_id = uuid.UUID(bytes=blake3.blake3(uri.encode()).digest()[:16])
    head = (
        "WARC/1.1\r\nWARC-Type: response\r\n"
        f"WARC-Target-URI: {uri}\r\nWARC-Record-ID: <urn:uuid:{record_id}>\r\n"
        "WARC-Date: 2026-11-30T12:00:00Z\r\n"
        "Content-Type: application/http;msgtype=response\r\n"
        f"Content-Length: {len(block)}\r\n\r\n"
    )
    return head.encode() + block + b"\r\n\r\n"


def warc_bytes(seed: int, records: int = 3, gz: bool = True, body: int = 400) -> bytes:
    """A WARC of ``records`` response records (one gzip member per record when ``gz``)."""
    rnd = random.Random(seed)
    out = b""
    for i in range(records):
        payload = (f"<html>{seed}-{i} ".encode() + rnd.randbytes(body // 2).hex().encode())[:body]
        record = warc_record(f"http://example.com/{seed}/{i}", payload)
        out += gzip.compress(record, mtime=0) if gz else record
    return out


def train_dictionary(seed: int, size: int = 2048) -> zstandard.ZstdCompressionDict:
    samples = [warc_bytes(seed * 1000 + i, records=1, gz=False, body=300) for i in range(60)]
    return zstandard.train_dictionary(size, samples)


def zst_warc(seed: int, dictionary: zstandard.ZstdCompressionDict, compress_dict: bool) -> bytes:
    """A Wget-AT style ``.warc.zst``: the dictionary in a skippable frame (itself zstd
    compressed when ``compress_dict``), then one frame per record with that dictionary."""
    raw = dictionary.as_bytes()
    frame = zstandard.ZstdCompressor().compress(raw) if compress_dict else raw
    out = SKIPPABLE_MAGIC + len(frame).to_bytes(4, "little") + frame
    compressor = zstandard.ZstdCompressor(dict_data=dictionary)
    for i in range(3):
        out += compressor.compress(warc_bytes(seed * 10 + i, records=1, gz=False))
    return out


def checksum(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


class RestoreRefused(Exception):
    """What ``megawarc restore`` would stop with."""


def restore(directory: Path, name: str, out: IO[bytes]) -> None:
    """``megawarc restore <name>`` by the real tool's rules (ArchiveTeam/megawarc): it needs
    ``<name>.megawarc.warc.gz`` and ``<name>.megawarc.json.gz``; for each index line, a "warc"
    member is its header, its bytes from ``<name>.megawarc.warc.gz`` and zeros to 512, a "tar"
    member its entry copied from ``<name>.megawarc.tar``; any other container is refused
    ("Unkown container"); the output is padded to 10240.  Written from the format, not from
    canner's builder."""
    for ext in (".megawarc.warc.gz", ".megawarc.json.gz"):
        if not (directory / (name + ext)).exists():
            raise RestoreRefused(f"Input file {name + ext} does not exist.")
    written = 0

    def copy(file: str, offset: int, size: int) -> None:
        nonlocal written
        with open(directory / file, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise RestoreRefused(f"End of file: {size} bytes expected, {len(data)} read")
        out.write(data + b"\0" * (-size % 512))
        written += size + (-size % 512)

    with gzip.open(directory / f"{name}.megawarc.json.gz", "rb") as index:
        for raw_line in index:
            line = json.loads(raw_line)
            target = line["target"]
            if target["container"] == "warc":
                header = base64.b64decode(line["header_base64"])
                out.write(header)
                written += len(header)
                copy(f"{name}.megawarc.warc.gz", target["offset"], target["size"])
            elif target["container"] == "tar":
                copy(f"{name}.megawarc.tar", target["offset"], target["size"])
            else:
                raise RestoreRefused(f"Unkown container: {target['container']}")
    out.write(b"\0" * (-written % 10240))


def restore_package(directory: Path, basename: str, scratch: Path) -> dict[str, bytes]:
    """Every member of a package, by its tar name, as ``megawarc restore`` gives them back:
    once for the gzip megawarc (``<basename>``) and once per zstd dictionary
    (``<basename>.<dict id>``), whose ``.megawarc.warc.zst`` the tool reads under the
    ``.megawarc.warc.gz`` name (a symlink in ``scratch``, as an operator would make)."""
    scratch.mkdir(exist_ok=True)
    members: dict[str, bytes] = {}
    for index in sorted(directory.glob(f"{basename}*.megawarc.json.gz")):
        name = index.name[: -len(".megawarc.json.gz")]
        for path in directory.glob(f"{name}.megawarc.*"):
            link = scratch / path.name
            if not link.exists():
                link.symlink_to(path)
        zst = scratch / f"{name}.megawarc.warc.zst"
        gz = scratch / f"{name}.megawarc.warc.gz"
        if zst.exists() and not gz.exists():
            gz.symlink_to(zst.resolve())
        out = io.BytesIO()
        restore(scratch, name, out)
        assert len(out.getvalue()) % 10240 == 0
        with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
            for entry in tar.getmembers():
                extracted = tar.extractfile(entry)
                assert extracted is not None and entry.name not in members
                members[entry.name] = extracted.read()
    return members


def write_member(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    os.utime(path, (0, 0))
    return path
