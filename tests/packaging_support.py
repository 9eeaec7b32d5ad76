"""Members for packaging tests: real WARCs (warcio), zstd WARCs with trained dictionaries, and
an independent megawarc ``restore`` written from the documented format
(``docs/reference/megawarc.md``), not from canner's builder."""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import uuid
from pathlib import Path
from typing import IO, Any

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


def restore(directory: Path, basename: str, out: IO[bytes]) -> None:
    """megawarc restore, from the documented format: for each index line, the header then the
    member's bytes padded to 512 (warc/zst members), or the tar entry as is; pad to 10240."""
    files: dict[str, Any] = {}

    def container(name: str) -> Any:
        if name not in files:
            files[name] = open(directory / name, "rb")
        return files[name]

    written = 0
    with gzip.open(directory / f"{basename}.megawarc.json.gz", "rb") as index:
        for raw_line in index:
            line = json.loads(raw_line)
            target = line["target"]
            if target["container"] == "tar":
                f = container(f"{basename}.megawarc.tar")
                f.seek(target["offset"])
                data = f.read(target["size"])
                out.write(data)
                written += len(data)
                continue
            name = (
                f"{basename}.megawarc.warc.gz"
                if target["container"] == "warc"
                else f"{basename}.{target['dict_id']}.megawarc.warc.zst"
            )
            f = container(name)
            f.seek(target["offset"])
            header = base64.b64decode(line["header_base64"])
            data = f.read(target["size"])
            pad = b"\0" * (-len(data) % 512)
            out.write(header + data + pad)
            written += len(header) + len(data) + len(pad)
    out.write(b"\0" * (-written % 10240))
    for f in files.values():
        f.close()


def write_member(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    os.utime(path, (0, 0))
    return path
