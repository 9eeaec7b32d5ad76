"""Building and re-reading a megawarc package (blocking; run it in a thread).

:func:`build_package` writes a batch's members as ArchiveTeam's ``megawarc pack`` lays them out
(``docs/reference/megawarc.md``: a gzip megawarc, and one per zstd dictionary), so ``megawarc
restore`` gives every member back; each index line also carries a ``canner`` object naming the
member's object, receipt and bytes.  :func:`verify_package` re-reads a sealed package and checks
every member against its receipt.  Both read each member once, a chunk at a time, so memory stays
bounded by the limits below whatever the member count and sizes.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import queue
import re
import tarfile
import threading
import zlib as _zlib
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from io import FileIO
from pathlib import Path
from typing import IO, Any

import blake3
import zstandard
from attrs import define, field, frozen

from canner import fs
from canner.packaging.batches import Member
from canner.sinks.plan import sanitize_filename

try:  # ISA-L's inflate has zlib's API and is about a third faster; zlib where it is missing.
    from isal import isal_zlib as _inflate
except ImportError:  # pragma: no cover - isal is a dependency; this is for odd platforms
    _inflate = _zlib  # type: ignore[misc]
# What a broken gzip member raises (isal has an error class of its own).
INFLATE_ERRORS: tuple[type[BaseException], ...] = (
    _zlib.error,
    getattr(_inflate, "error", _zlib.error),
)

WARC_GZ = ".megawarc.warc.gz"
TAR = ".megawarc.tar"
INDEX = ".megawarc.json.gz"
CHUNK = 1 << 20
# Chunks queued for the lanes' checks at most, per lane (memory: lanes x depth x chunk).
LANE_DEPTH = 4
# Members whose check may still be running while the next ones are read, and the memory
# their checks may hold outside the buffer pool (zstd dictionaries) before the builder waits.
MAX_PENDING = 64
MAX_HELD = 64 << 20
# Chunks read ahead of the verification pass's MD5 thread at most.
VERIFY_DEPTH = 4
# Start writeback of a container every this many bytes (see canner.fs.write_behind).
WRITE_BEHIND = 16 << 20
TAR_BLOCK = 512
TAR_RECORD = 10240
SKIPPABLE_MAGIC = b"\x5d\x2a\x4d\x18"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A dictionary frame larger than this is not one a worker would send: the member goes to the tar.
MAX_DICTIONARY = 32 << 20
# Input slice per zstd call: bounds the output one call can produce, which the library does not
# cap (enough for real WARCs; a crafted member of nothing but RLE blocks could still inflate one
# slice to a few hundred MiB).
ZSTD_SLICE = 64 << 10
# Input slice per inflate call: bounds what the inflater copies at each gzip member's end.
INFLATE_SLICE = 32 << 10
WARC_MAGIC = b"WARC/"


WARC_ZST = ".megawarc.warc.zst"
# A Wget-AT member without its dictionary names it: ``.<project>.<10-digit dict id>.warc.zst``.
NAMED_DICTIONARY = re.compile(r"\.([0-9a-zA-Z-]+)\.([0-9]{10})\.warc\.zst$")


def named_dictionary(filename: str | None) -> tuple[str, str] | None:
    """``(project, dict id)`` named by a dictionary-less Wget-AT member's file name, or None."""
    found = NAMED_DICTIONARY.search(filename or "")
    return (found.group(1), found.group(2)) if found else None


def is_index(suffix: str) -> bool:
    """Whether a package file (``<basename><suffix>``) is one of its megawarcs' indexes."""
    return suffix.endswith(INDEX)


class DictionaryMissing(Exception):
    """A dictionary-less ``.warc.zst`` member's dictionary was not given to the build."""

    def __init__(self, member: Member, project: str, dict_id: str) -> None:
        super().__init__(f"{member.object_id}: no zstd dictionary {dict_id} of {project}")
        self.member, self.project, self.dict_id = member, project, dict_id


class BuildStopped(Exception):
    """The build was asked to stop (shutdown); its temp files are the caller's to remove."""


class MemberMismatch(Exception):
    """A member's bytes on disk do not match its receipt (or are missing)."""

    def __init__(self, member: Member, actual: str) -> None:
        super().__init__(
            f"{member.object_id}: on disk {actual}, its receipt says {member.checksum}"
            f" ({member.size_bytes} bytes)"
        )
        self.member = member
        self.actual = actual


@frozen
class Placement:
    """Where one member went: the file (suffix) and where its bytes start in it."""

    object_id: str
    suffix: str
    data_offset: int


@frozen
class BuiltPackage:
    """The files written (suffix -> size) and every member's placement, in member order."""

    files: dict[str, int]
    placements: list[Placement]


def member_name(member: Member) -> str:
    """The member's path in the (virtual) original tar: ``<object id>/<worker's filename>``."""
    return f"{member.object_id}/{sanitize_filename(member.filename, member.object_id)}"


def tar_header(name: str, size: int, mtime: int) -> tuple[bytes, dict[str, Any]]:
    """A regular file's tar header bytes (GNU format: long names get extra blocks) and the
    header fields as megawarc records them (``type`` as a one-character string)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, mtime, 0o644, tarfile.REGTYPE
    header = info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape")
    fields: dict[str, Any] = dict(info.get_info())
    fields["type"] = info.type.decode("ascii")
    return header, fields


def _padding(size: int, block: int = TAR_BLOCK) -> int:
    return -size % block


# -- member tests ----------------------------------------------------------------------------


class GzipTest:
    """Streaming gunzip: every gzip member complete (CRC and length), the output a WARC."""

    def __init__(self) -> None:
        self._d = _inflate.decompressobj(31)
        self._head = b""
        self._in_member = False
        self.ok = True

    def feed(self, data: bytes | memoryview) -> None:
        # The inflater gets INFLATE_SLICE bytes at a time: at the end of every gzip member it
        # copies the input it did not use (``unused_data``), and a WARC has one gzip member
        # per record, so whole chunks would be copied over and over (most of the test's time).
        view = memoryview(data)
        while view and self.ok:
            self._feed(view[:INFLATE_SLICE])
            view = view[INFLATE_SLICE:]

    def _feed(self, data: bytes | memoryview) -> None:
        # Output comes CHUNK bytes at a time: when a call fills it, the inflater may hold more
        # even though it took all the input, so it is asked again until it returns less.
        more = True
        while self.ok and (data or more):
            if data:
                self._in_member = True
            try:
                out = self._d.decompress(data, CHUNK)
            except INFLATE_ERRORS:
                self.ok = False
                return
            self._see(out)
            if self._d.eof:
                data = self._d.unused_data
                self._d = _inflate.decompressobj(31)
                self._in_member = more = False
            else:
                data = self._d.unconsumed_tail
                more = len(out) == CHUNK

    def _see(self, out: bytes) -> None:
        if len(self._head) < len(WARC_MAGIC):
            self._head += out[: len(WARC_MAGIC)]
            if not WARC_MAGIC.startswith(self._head[: len(WARC_MAGIC)]):
                self.ok = False

    def finish(self) -> bool:
        return self.ok and not self._in_member and self._head.startswith(WARC_MAGIC)


class ZstdTest:
    """Streaming zstd with a dictionary: every frame complete, the output a WARC."""

    def __init__(self, dictionary: zstandard.ZstdCompressionDict) -> None:
        self._ctx = zstandard.ZstdDecompressor(dict_data=dictionary)
        self._d = self._ctx.decompressobj()
        self._head = b""
        self._in_frame = False
        self.ok = True

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view and self.ok:
            piece, view = view[:ZSTD_SLICE], view[ZSTD_SLICE:]
            self._feed(bytes(piece))

    def _feed(self, data: bytes) -> None:
        while data and self.ok:
            self._in_frame = True
            try:
                out = self._d.decompress(data)
            except zstandard.ZstdError:
                self.ok = False
                return
            if len(self._head) < len(WARC_MAGIC) and out:
                self._head += out[: len(WARC_MAGIC)]
                if not WARC_MAGIC.startswith(self._head[: len(WARC_MAGIC)]):
                    self.ok = False
            if self._d.eof:
                data = self._d.unused_data
                self._d = self._ctx.decompressobj()
                self._in_frame = False
            else:
                data = b""

    def finish(self) -> bool:
        return self.ok and not self._in_frame and self._head.startswith(WARC_MAGIC)


def read_dictionary(frame: bytes) -> tuple[zstandard.ZstdCompressionDict, int] | None:
    """The dictionary in a skippable frame (``magic, length, dictionary``), decompressed when
    it is itself zstd-compressed, and its id; None when it is no usable dictionary."""
    raw = frame[8:]
    try:
        if raw.startswith(ZSTD_MAGIC):
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_DICTIONARY)
        dictionary = zstandard.ZstdCompressionDict(raw)
        dict_id = dictionary.dict_id()
    except zstandard.ZstdError:
        return None
    return (dictionary, dict_id) if dict_id else None


def frame_dictionary(first: bytes) -> tuple[zstandard.ZstdCompressionDict, int] | None:
    """The dictionary of the skippable frame a member starts with (``first`` holds at least the
    frame), or None when it starts with no usable one."""
    length = int.from_bytes(first[4:8], "little") if len(first) >= 8 else 0
    if not first.startswith(SKIPPABLE_MAGIC) or not 0 < length <= MAX_DICTIONARY:
        return None
    return read_dictionary(first[: 8 + length])


def frame_length(f: IO[bytes], first: bytes) -> bytes:
    """``first`` (the member's first 8 bytes or fewer), read on to the end of the skippable
    frame it starts with, when it starts with one a dictionary could be in."""
    length = int.from_bytes(first[4:8], "little") if len(first) >= 8 else 0
    if first.startswith(SKIPPABLE_MAGIC) and 0 < length <= MAX_DICTIONARY:
        return _read_at_least(f, first, 8 + length)
    return first


def wanted_dictionaries(
    members: list[Member], source: Callable[[str], Path]
) -> list[tuple[str, str]]:
    """``(project, dict id)`` of every dictionary the members name and do not hold (a
    ``.warc.zst`` named ``.<project>.<10-digit dict id>.warc.zst`` that starts with no dictionary
    frame), in member order, once each.  Reads the first bytes of those members (blocking); a
    missing one is left to the build."""
    wanted: dict[str, tuple[str, str]] = {}
    for member in members:
        named = named_dictionary(member_name(member))
        if named is None or named[1] in wanted:
            continue
        try:
            with open(source(member.object_id), "rb") as f:
                if frame_dictionary(frame_length(f, _read_at_least(f, b"", 8))) is not None:
                    continue
        except FileNotFoundError:
            continue
        wanted[named[1]] = named
    return list(wanted.values())


# -- the builder -----------------------------------------------------------------------------


@define
class _Container:
    """One output file being appended to."""

    path: Path
    file: IO[bytes]
    members: int = 0
    # Where write-behind has started up to: the sealing fsync then has only the tail to flush.
    flushed: int = 0

    def tell(self) -> int:
        return self.file.tell()

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:  # unbuffered: a write may be short
            view = view[self.file.write(view) or 0 :]
        end = self.file.tell()
        if end - self.flushed >= WRITE_BEHIND:
            fs.write_behind(self.file.fileno(), self.flushed, end, max(0, end - 4 * WRITE_BEHIND))
            self.flushed = end

    def rollback(self, offset: int) -> None:
        self.file.seek(offset)
        self.file.truncate()
        self.flushed = min(self.flushed, offset)


@frozen
class _Outcome:
    """What a lane found for one member: its BLAKE3 (``blake3:<hex>``), size and test result."""

    checksum: str
    size: int
    tested: bool


Chunk = tuple[bytes | memoryview, bytearray | None]


class _MemberCheck:
    """One member's BLAKE3 and test, run on one lane over its chunks, in order; ``outcome``
    is set once the member's last chunk (:meth:`end`) is checked."""

    def __init__(self, test: GzipTest | ZstdTest | None) -> None:
        self._test = test
        self._digest = blake3.blake3()
        self._size = 0
        self._chunks: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self.outcome: Future[_Outcome] = Future()

    def put(self, data: bytes | memoryview, buffer: bytearray | None) -> None:
        self._chunks.put((data, buffer))

    def end(self) -> None:
        self._chunks.put(None)

    def run(self, lanes: _Lanes) -> None:
        """On a lane: check every chunk, give each pooled buffer back, set ``outcome``."""
        error: Exception | None = None
        while (item := self._chunks.get()) is not None:
            data, buffer = item
            if error is None and not lanes.cancelled:
                try:
                    # blake3 and the inflater release the GIL: lanes and the builder's
                    # thread run at once.
                    self._digest.update(data)
                    self._size += len(data)
                    if self._test is not None:
                        self._test.feed(data)
                except Exception as e:  # reaches the builder through outcome
                    error = e
            if buffer is not None:
                lanes.give_back(buffer)
        try:
            if error is not None:
                raise error
            tested = self._test.finish() if self._test is not None else True
        except Exception as e:  # a lane never dies: the builder would wait on it forever
            self.outcome.set_exception(e)
            return
        self.outcome.set_result(_Outcome(f"blake3:{self._digest.hexdigest()}", self._size, tested))


class _Lanes:
    """Threads ("lanes") that hash and test members while the builder's thread reads and
    writes them: the inflate, by far the slowest part, and BLAKE3 run on every core.

    A member is checked on one lane, chunk by chunk in order: the first lane free takes the
    next member, so no lane waits while members are queued; different members are checked
    side by side.  Chunks are read into a bounded pool of buffers (at most
    ``lanes x LANE_DEPTH``: memory), and a buffer is reused once its lane is done with it."""

    def __init__(self, count: int, chunk: int) -> None:
        self._chunk = chunk
        self._cap = max(2, count * LANE_DEPTH)
        self._made = 0
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[_MemberCheck | None] = queue.SimpleQueue()
        self.cancelled = False
        self._threads = [
            threading.Thread(target=self._run, name=f"canner-check-{i}") for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def buffer(self) -> bytearray:
        """A buffer no lane is reading (waits for one when the pool is used up)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._made < self._cap:
            self._made += 1
            return bytearray(self._chunk)
        return self._free.get()

    def give_back(self, buffer: bytearray) -> None:
        self._free.put(buffer)

    def begin(self, test: GzipTest | ZstdTest | None) -> _MemberCheck:
        check = _MemberCheck(test)
        self._jobs.put(check)
        return check

    def close(self) -> None:
        """Stop the lanes: checks not yet done are dropped (their outcomes never read)."""
        self.cancelled = True
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        while (check := self._jobs.get()) is not None:
            check.run(self)


@frozen
class _Pending:
    """A member read and appended whose check has not been looked at yet."""

    member: Member
    outcome: Future[_Outcome]
    target: _Container
    start: int
    # Memory its check holds outside the buffer pool (a zstd member's dictionary).
    held: int


@define
class _Megawarc:
    """One megawarc of the package, as ``megawarc pack`` lays it out: ``<prefix>`` is "" for
    the gzip one and ``.<dict id>`` for each zstd dictionary's; each has its own index, its own
    tar and its own (virtual) original tar, whose position ``src_pos`` is."""

    prefix: str
    data: str  # the suffix of its WARC container
    raw: IO[bytes]
    index: gzip.GzipFile
    # A zstd megawarc's dictionary frame (its container's first bytes) and dictionary.
    frame: bytes = b""
    dictionary: zstandard.ZstdCompressionDict | None = None
    src_pos: int = 0

    def write(self, line: dict[str, Any]) -> None:
        self.index.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")


@define
class _Builder:
    work: Path
    basename: str
    stop: threading.Event
    chunk: int
    # Dictionary frames by dict id, for members that name their dictionary instead of holding it.
    dictionaries: Mapping[str, bytes] = field(factory=dict)
    containers: dict[str, _Container] = field(factory=dict)
    megawarcs: dict[str, _Megawarc] = field(factory=dict)
    placements: list[Placement] = field(factory=list)
    # Members whose test failed in an earlier pass: straight to their megawarc's tar.
    force_tar: frozenset[str] = frozenset()
    # Each member is appended to its container while a lane checks it (:class:`_Lanes`);
    # the builder goes on to the next members meanwhile.  A BLAKE3 that differs from the
    # receipt stops the package (:class:`MemberMismatch`) as soon as it is seen; a failed test
    # builds the package again with the member in the tar (:class:`_TestsFailed`).
    lanes: _Lanes | None = None
    # Members whose check is not yet looked at, in member order (bounded: MAX_PENDING).
    pending: deque[_Pending] = field(factory=deque)
    held: int = 0
    failed: set[str] = field(factory=set)

    def container(self, suffix: str, preamble: bytes = b"") -> _Container:
        if suffix not in self.containers:
            path = self.work / (self.basename + suffix)
            f = open(path, "w+b", buffering=0)
            f.write(preamble)
            self.containers[suffix] = _Container(path, f)
        return self.containers[suffix]

    def megawarc(
        self,
        prefix: str,
        frame: bytes = b"",
        dictionary: zstandard.ZstdCompressionDict | None = None,
    ) -> _Megawarc:
        """The megawarc of ``prefix``, started (its index opened) on first use; a zstd one keeps
        the dictionary of its first member."""
        if prefix not in self.megawarcs:
            raw = open(self.work / (self.basename + prefix + INDEX), "wb")
            index = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
            data = prefix + (WARC_ZST if dictionary is not None else WARC_GZ)
            self.megawarcs[prefix] = _Megawarc(prefix, data, raw, index, frame, dictionary)
        return self.megawarcs[prefix]

    def close(self) -> None:
        if self.lanes is not None:
            self.lanes.close()
        for c in self.containers.values():
            c.file.close()
        for m in self.megawarcs.values():
            m.index.close()
            m.raw.close()

    def read_chunks(self, f: FileIO, first: bytes) -> Iterator[Chunk]:
        """The member's bytes: ``first`` (read already), then views of pooled buffers, each
        with its buffer (None for ``first``), which is the lanes' until its chunk is checked."""
        assert self.lanes is not None
        if first:
            yield first, None
        while True:
            if self.stop.is_set():
                raise BuildStopped()
            buffer = self.lanes.buffer()
            n = f.readinto(buffer)
            if not n:
                self.lanes.give_back(buffer)
                return
            yield memoryview(buffer)[:n], buffer

    def _zstd_megawarc(self, member: Member, name: str, first: bytes) -> _Megawarc | None:
        """The zstd megawarc of a ``.warc.zst`` member: its own dictionary frame's (``first``
        holds the frame), else the dictionary its name gives; None when it has neither (it is
        filed in the gzip megawarc's tar).  Raises :class:`DictionaryMissing`."""
        found = frame_dictionary(first)
        if found is not None:
            frame = first[: 8 + int.from_bytes(first[4:8], "little")]
            return self.megawarc(f".{found[1]}", frame, found[0])
        named = named_dictionary(name)
        if named is None:
            return None
        project, dict_id = named
        given = self.dictionaries.get(dict_id)
        usable = read_dictionary(given) if given is not None else None
        if given is None or usable is None:
            raise DictionaryMissing(member, project, dict_id)
        return self.megawarc(f".{dict_id}", given, usable[0])

    def add(self, member: Member, path: Path) -> None:
        """Pack one member and write its index line."""
        name = member_name(member)
        header, fields = tar_header(name, member.size_bytes, member.accepted_at)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise MemberMismatch(member, "missing") from None
        with f:
            first = b""
            group: _Megawarc | None = None
            test: GzipTest | ZstdTest | None = None
            if name.endswith(".warc.gz"):
                test = GzipTest()
            elif name.endswith(".warc.zst"):
                first = frame_length(f, _read_at_least(f, first, 8))
                group = self._zstd_megawarc(member, name, first)
                if group is not None:
                    assert group.dictionary is not None
                    test = ZstdTest(group.dictionary)
            group = group or self.megawarc("")
            if test is not None and member.object_id in self.force_tar:
                test = None
            chunks = self.read_chunks(f, first)
            if test is not None:
                line = self._append_tested(member, chunks, group, test, header, fields)
            else:
                line = self._append_tar(member, chunks, group, header, fields)
        group.write(line)
        group.src_pos += len(header) + member.size_bytes + _padding(member.size_bytes)

    def _append(
        self,
        member: Member,
        chunks: Iterator[Chunk],
        target: _Container,
        test: GzipTest | ZstdTest | None,
    ) -> int:
        """Append the member's bytes to ``target`` while its lane checks them; their size."""
        assert self.lanes is not None
        check = self.lanes.begin(test)
        start = target.tell()
        size = held = 0
        try:
            for data, buffer in chunks:
                check.put(data, buffer)  # the lane reads the buffer while it is written
                target.write(data)
                size += len(data)
                if buffer is None:  # read ahead for a dictionary, which the test loads too
                    held += 2 * len(data)
        finally:
            check.end()
        self.pending.append(_Pending(member, check.outcome, target, start, held))
        self.held += held
        self._look_at_checks(MAX_PENDING)
        return size

    def _look_at_checks(self, keep: int) -> None:
        """Look at the finished checks, oldest first, waiting while more than ``keep`` are
        left: a member that does not match its receipt stops the package."""
        while self.pending and (
            len(self.pending) > keep or self.held > MAX_HELD or self.pending[0].outcome.done()
        ):
            p = self.pending.popleft()
            self.held -= p.held
            outcome = p.outcome.result()
            if outcome.size != p.member.size_bytes or outcome.checksum != p.member.checksum:
                p.target.rollback(p.start)
                raise MemberMismatch(p.member, f"{outcome.checksum} ({outcome.size} bytes)")
            if not outcome.tested:
                self.failed.add(p.member.object_id)

    def _append_tested(
        self,
        member: Member,
        chunks: Iterator[Chunk],
        group: _Megawarc,
        test: GzipTest | ZstdTest,
        header: bytes,
        fields: dict[str, Any],
    ) -> dict[str, Any]:
        target = self.container(group.data, group.frame)
        start = target.tell()
        size = self._append(member, chunks, target, test)
        target.members += 1
        self.placements.append(Placement(member.object_id, group.data, start))
        return self._line(member, group, "warc", start, size, header, fields, group.data, start)

    def checks_done(self) -> set[str]:
        """Wait for every member's check; the ids of those whose test failed.  Raises
        :class:`MemberMismatch` for the first member that does not match its receipt."""
        self._look_at_checks(0)
        return self.failed

    def _append_tar(
        self,
        member: Member,
        chunks: Iterator[Chunk],
        group: _Megawarc,
        header: bytes,
        fields: dict[str, Any],
    ) -> dict[str, Any]:
        suffix = group.prefix + TAR
        tar = self.container(suffix)
        start = tar.tell()
        tar.write(header)
        size = self._append(member, chunks, tar, None)
        tar.write(b"\0" * _padding(size))
        tar.members += 1
        data_offset = start + len(header)
        self.placements.append(Placement(member.object_id, suffix, data_offset))
        entry_size = len(header) + size + _padding(size)
        return self._line(
            member, group, "tar", start, entry_size, header, fields, suffix, data_offset
        )

    def _line(
        self,
        member: Member,
        group: _Megawarc,
        container: str,
        offset: int,
        size: int,
        header: bytes,
        fields: dict[str, Any],
        suffix: str,
        data_offset: int,
    ) -> dict[str, Any]:
        # megawarc's restore knows two containers: "warc" (its megawarc's WARC file, gzip or
        # zstd) and "tar"; offsets in src_offsets are in this megawarc's own original tar.
        entry = group.src_pos
        data = entry + len(header)
        return {
            "target": {"container": container, "offset": offset, "size": size},
            "src_offsets": {
                "entry": entry,
                "data": data,
                "next_entry": data + member.size_bytes + _padding(member.size_bytes),
            },
            "header_fields": fields,
            "header_base64": base64.b64encode(header).decode("ascii"),
            "canner": {
                "object_id": member.object_id,
                "receipt_id": f"receipt:{member.object_id}",
                "checksum": member.checksum,
                "size_bytes": member.size_bytes,
                "project": member.project,
                "filename": member.filename,
                "accepted_at": member.accepted_at,
                "file": self.basename + suffix,
                "offset": data_offset,
            },
        }


def _read_at_least(f: IO[bytes], data: bytes, n: int) -> bytes:
    while len(data) < n:
        more = f.read(max(n - len(data), CHUNK))
        if not more:
            break
        data += more
    return data


class _TestsFailed(Exception):
    """Members appended to a container failed their test: build again, those in the tar."""

    def __init__(self, object_ids: set[str]) -> None:
        super().__init__(", ".join(sorted(object_ids)))
        self.object_ids = object_ids


def build_package(
    members: list[Member],
    source: Callable[[str], Path],
    work: Path,
    basename: str,
    stop: threading.Event,
    chunk: int = CHUNK,
    test_threads: int | None = None,
    dictionaries: Mapping[str, bytes] | None = None,
) -> BuiltPackage:
    """Write the megawarcs of ``members`` (in this order) into the directory ``work``: the
    gzip one (``<basename>.megawarc.*``) and one per zstd dictionary
    (``<basename>.<dict id>.megawarc.*``), each with its own index and tar, as megawarc does.

    ``source(object_id)`` is a member's upload file.  ``dictionaries`` holds the dictionary
    frames (``dictionary_frame``) of the members that name their dictionary instead of holding
    it, by dict id.  Every file written is fsynced (the caller renames ``work`` into place and
    fsyncs its parent).  Each member is read once, unless one fails its test: then the package
    is written again with it in its megawarc's tar.  ``test_threads`` (default: one per CPU)
    test members side by side.  Raises :class:`MemberMismatch` for a member whose bytes do not
    match its receipt, :class:`DictionaryMissing` for one whose dictionary was not given,
    :class:`BuildStopped` when ``stop`` is set, ``OSError`` for I/O failures; ``work`` is then
    left for the caller to remove.
    """
    lanes = test_threads or max(1, os.cpu_count() or 1)
    force_tar: frozenset[str] = frozenset()
    while True:
        for leftover in work.iterdir():
            leftover.unlink()
        builder = _Builder(work, basename, stop, chunk, dictionaries or {}, force_tar=force_tar)
        try:
            return _build(builder, members, source, lanes)
        except _TestsFailed as e:
            force_tar = force_tar | e.object_ids


def _build(
    builder: _Builder, members: list[Member], source: Callable[[str], Path], lanes: int
) -> BuiltPackage:
    builder.lanes = _Lanes(lanes, builder.chunk)
    try:
        for member in members:
            builder.add(member, source(member.object_id))
        failed = builder.checks_done()
        if failed:
            raise _TestsFailed(failed)
        files: dict[str, int] = {}
        for m in builder.megawarcs.values():
            # megawarc's restore needs the WARC container even when no member went there.
            builder.container(m.data, m.frame)
            tar = builder.containers.get(m.prefix + TAR)
            if tar is not None:
                tar.write(b"\0" * _padding(tar.tell(), TAR_RECORD))
            m.index.close()
            m.raw.flush()
            os.fsync(m.raw.fileno())
            files[m.prefix + INDEX] = m.raw.tell()
        warcs = {m.data for m in builder.megawarcs.values()}
        for suffix, c in list(builder.containers.items()):
            if c.members == 0 and suffix not in warcs:
                c.file.close()
                c.path.unlink()
                del builder.containers[suffix]
                continue
            c.file.flush()
            os.fsync(c.file.fileno())
            files[suffix] = c.tell()
        return BuiltPackage(files, builder.placements)
    finally:
        builder.close()


# -- reading back ----------------------------------------------------------------------------


def read_index(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of a ``.megawarc.json.gz`` index, one at a time."""
    with gzip.open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def index_files(directory: Path, basename: str) -> list[Path]:
    """The indexes of a package: its gzip megawarc's and each zstd dictionary's (a package
    built before those were apart has one, for every member)."""
    return sorted(
        p
        for p in directory.iterdir()
        if p.name.startswith(basename + ".") and p.name.endswith(INDEX)
    )


def package_lines(directory: Path, basename: str) -> Iterator[dict[str, Any]]:
    """Every index line of a package, index by index."""
    for path in index_files(directory, basename):
        yield from read_index(path)


class VerifyFailed(Exception):
    """A sealed package does not hold what its index says (a member's bytes differ)."""


def verify_package(
    directory: Path,
    basename: str,
    stop: threading.Event,
    chunk: int = CHUNK,
    expected: Collection[str] | None = None,
) -> dict[str, str]:
    """Re-read every file of a sealed package once: each member's bytes (from the index) must
    hash to its receipt, and the index must list exactly the ``expected`` object ids (when
    given: the batch's members).  Returns each file's MD5 (suffix -> hex).  Raises
    :class:`VerifyFailed` naming the member, :class:`BuildStopped`, or ``OSError``."""
    spans: dict[str, list[tuple[int, int, str, str]]] = {}
    listed: set[str] = set()
    for line in package_lines(directory, basename):
        c = line["canner"]
        listed.add(c["object_id"])
        suffix = c["file"][len(basename) :]
        spans.setdefault(suffix, []).append(
            (c["offset"], c["size_bytes"], c["checksum"], c["object_id"])
        )
    if expected is not None and listed != set(expected):
        differ = sorted(listed.symmetric_difference(expected))
        raise VerifyFailed(f"the index and the batch differ in {len(differ)} members: {differ[:5]}")
    md5s: dict[str, str] = {}
    for path in sorted(directory.iterdir()):
        suffix = path.name[len(basename) :]
        if not path.name.startswith(basename):
            continue
        md5s[suffix] = _verify_file(path, sorted(spans.pop(suffix, [])), stop, chunk)
    if spans:
        raise VerifyFailed(f"files missing from the package: {', '.join(sorted(spans))}")
    return md5s


def _verify_file(
    path: Path, spans: list[tuple[int, int, str, str]], stop: threading.Event, chunk: int
) -> str:
    # The file's MD5 (a single stream, the slowest part) runs on a thread of its own while this
    # one reads the next chunks and hashes the members' spans: both release the GIL.
    md5 = hashlib.md5(usedforsecurity=False)
    pending = deque(spans)
    current: tuple[int, int, str, str, Any] | None = None
    pos = 0
    queued: deque[tuple[Future[None], bytearray]] = deque()
    free: list[bytearray] = []
    with (
        ThreadPoolExecutor(1, "canner-verify-md5") as hasher,
        open(path, "rb", buffering=0) as f,
    ):
        while True:
            if stop.is_set():
                raise BuildStopped()
            if free:
                buffer = free.pop()
            elif len(queued) < VERIFY_DEPTH:
                buffer = bytearray(chunk)
            else:
                done, buffer = queued.popleft()
                done.result()
            n = f.readinto(buffer)
            if not n:
                break
            view = memoryview(buffer)[:n]
            queued.append((hasher.submit(md5.update, view), buffer))
            end = pos + n
            cursor = pos
            while cursor < end:
                if current is None:
                    if not pending or pending[0][0] >= end:
                        break
                    offset, size, checksum, oid = pending.popleft()
                    if offset < cursor:
                        raise VerifyFailed(f"{path.name}: overlapping members at {offset}")
                    current = (offset, size, checksum, oid, blake3.blake3())
                offset, size, checksum, oid, h = current
                lo = max(offset, cursor)
                hi = min(offset + size, end)
                if lo >= end:
                    break
                h.update(view[lo - pos : hi - pos])
                cursor = hi
                if hi == offset + size:
                    if f"blake3:{h.hexdigest()}" != checksum:
                        raise VerifyFailed(f"{oid} in {path.name} does not match its receipt")
                    current = None
            pos = end
        for done, _ in queued:
            done.result()
    if current is not None or pending:
        raise VerifyFailed(f"{path.name} ends before all of its members")
    return md5.hexdigest()
