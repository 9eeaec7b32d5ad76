"""The megawarc builder: containers, the index, restore, and members that do not match."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
import threading
from pathlib import Path

import pytest
import zstandard
from warcio.archiveiterator import ArchiveIterator

from canner.packaging.batches import Member
from canner.packaging.dictionaries import dictionary_frame
from canner.packaging.megawarc import (
    INDEX,
    TAR,
    WARC_GZ,
    BuildStopped,
    DictionaryMissing,
    GzipTest,
    MemberMismatch,
    VerifyFailed,
    build_package,
    member_name,
    package_lines,
    read_index,
    verify_package,
    wanted_dictionaries,
)
from tests.packaging_support import (
    RestoreRefused,
    checksum,
    restore,
    restore_package,
    train_dictionary,
    warc_bytes,
    warc_record,
    write_member,
    zst_warc,
)

BASE = "pkg"


def members_from(tmp_path: Path, named: list[tuple[str, bytes]]) -> tuple[list[Member], Path]:
    src = tmp_path / "uploads"
    src.mkdir()
    members = []
    for i, (name, data) in enumerate(named):
        oid = f"{i:032x}"
        write_member(src, oid, data)
        members.append(Member(oid, "example", name, len(data), checksum(data), 1_700_000_000 + i))
    return members, src


def build(tmp_path: Path, members: list[Member], src: Path, chunk: int = 1 << 20) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    build_package(members, lambda oid: src / oid, work, BASE, threading.Event(), chunk)
    return work


@pytest.fixture
def mixed(tmp_path: Path) -> tuple[list[Member], Path, dict[str, bytes]]:
    dict_a, dict_b = train_dictionary(1), train_dictionary(2)
    assert dict_a.dict_id() != dict_b.dict_id()
    truncated = warc_bytes(99)[:-7]
    named = [
        ("a.warc.gz", warc_bytes(1)),
        ("notes.txt", b"not a warc at all\n" * 50),
        ("b.warc.zst", zst_warc(3, dict_a, compress_dict=False)),
        ("c.warc.gz", warc_bytes(2, records=5)),
        ("d.warc.zst", zst_warc(4, dict_b, compress_dict=True)),
        ("broken.warc.gz", truncated),
        ("e.warc.zst", zst_warc(5, dict_a, compress_dict=False)),
        ("plain.gz.warc.gz", gzip.compress(b"hello, not a WARC record\n")),
    ]
    members, src = members_from(tmp_path, named)
    return members, src, {m.object_id: data for m, (_, data) in zip(members, named, strict=True)}


def test_members_land_in_the_right_containers_and_restore_byte_for_byte(
    tmp_path: Path, mixed: tuple[list[Member], Path, dict[str, bytes]]
) -> None:
    """Valid .warc.gz go to the WARC, .warc.zst to one megawarc per dictionary (its own index,
    WARC and tar), the rest (other files, a truncated gzip, a gzip that is no WARC) to the
    gzip megawarc's tar; megawarc restore, run on each megawarc by the real tool's rules, gives
    back every member byte for byte."""
    members, src, originals = mixed
    work = build(tmp_path, members, src, chunk=4096)
    names = sorted(p.name for p in work.iterdir())
    dict_ids = sorted(
        p.name.split(".")[1] for p in work.glob(f"{BASE}.*{INDEX}") if p.name != BASE + INDEX
    )
    assert len(dict_ids) == 2
    assert names == sorted(
        [BASE + WARC_GZ, BASE + TAR, BASE + INDEX]
        + [f"{BASE}.{d}.megawarc.warc.zst" for d in dict_ids]
        + [f"{BASE}.{d}{INDEX}" for d in dict_ids]
    )
    containers = [line["target"]["container"] for line in read_index(work / (BASE + INDEX))]
    assert containers == ["warc", "tar", "warc", "tar", "tar"]
    for d in dict_ids:
        lines = list(read_index(work / f"{BASE}.{d}{INDEX}"))
        assert {line["target"]["container"] for line in lines} == {"warc"}
        assert {line["canner"]["file"] for line in lines} == {f"{BASE}.{d}.megawarc.warc.zst"}
    restored = restore_package(work, BASE, tmp_path / "restore")
    assert restored == {member_name(m): originals[m.object_id] for m in members}
    assert all(checksum(restored[member_name(m)]) == m.checksum for m in members)


def test_the_old_combined_index_is_what_megawarc_restore_rejects(tmp_path: Path) -> None:
    """megawarc restore refuses an index line whose container is not warc or tar (the one
    combined index of packages built before the zstd megawarcs were apart said "zst")."""
    (tmp_path / "old.megawarc.warc.gz").write_bytes(b"")
    line = {"target": {"container": "zst", "offset": 0, "size": 1}, "header_base64": ""}
    with gzip.open(tmp_path / "old.megawarc.json.gz", "wb") as f:
        f.write(json.dumps(line).encode() + b"\n")
    with pytest.raises(RestoreRefused, match="Unkown container: zst"):
        restore(tmp_path, "old", io.BytesIO())


def test_a_megawarc_with_only_tar_members_still_restores(tmp_path: Path) -> None:
    """A package with no valid WARC member keeps an empty WARC container, which megawarc
    restore needs, and restores byte for byte."""
    named = [("notes.txt", b"x" * 700), ("broken.warc.gz", warc_bytes(5)[:-3])]
    members, src = members_from(tmp_path, named)
    work = build(tmp_path, members, src)
    assert (work / (BASE + WARC_GZ)).stat().st_size == 0
    restored = restore_package(work, BASE, tmp_path / "restore")
    assert restored == {member_name(m): data for m, (_, data) in zip(members, named, strict=True)}


def test_the_warc_container_is_one_readable_warc_and_offsets_hash_to_receipts(
    tmp_path: Path, mixed: tuple[list[Member], Path, dict[str, bytes]]
) -> None:
    """warcio reads every record of the megawarc WARC; each index line's canner fields locate
    bytes that hash to the member's receipt; each zst container decompresses completely."""
    members, src, _ = mixed
    work = build(tmp_path, members, src)
    with open(work / (BASE + WARC_GZ), "rb") as f:
        records = [r.rec_headers.get_header("WARC-Target-URI") for r in ArchiveIterator(f)]
    assert len([r for r in records if r]) == 3 + 5
    by_id = {m.object_id: m for m in members}
    for line in package_lines(work, BASE):
        c = line["canner"]
        member = by_id[c["object_id"]]
        assert c["receipt_id"] == f"receipt:{member.object_id}"
        assert (c["checksum"], c["size_bytes"], c["project"]) == (
            member.checksum,
            member.size_bytes,
            "example",
        )
        with open(work / c["file"], "rb") as f:
            f.seek(c["offset"])
            assert checksum(f.read(c["size_bytes"])) == member.checksum
    per_file: dict[str, int] = {}
    for line in package_lines(work, BASE):
        per_file[line["canner"]["file"]] = per_file.get(line["canner"]["file"], 0) + 1
    for path in work.glob("*.megawarc.warc.zst"):
        data = path.read_bytes()
        assert data.startswith(b"\x5d\x2a\x4d\x18")
        frame_len = int.from_bytes(data[4:8], "little")
        raw = data[8 : 8 + frame_len]
        if raw.startswith(b"\x28\xb5\x2f\xfd"):
            raw = zstandard.ZstdDecompressor().decompress(raw)
        dctx = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(raw))
        text = dctx.stream_reader(io.BytesIO(data), read_across_frames=True).read()
        assert text.startswith(b"WARC/1.") and text.count(b"WARC/1.") == 3 * per_file[path.name]


def test_verification_pass_gives_md5s_and_catches_a_changed_package(
    tmp_path: Path, mixed: tuple[list[Member], Path, dict[str, bytes]]
) -> None:
    """Re-reading the sealed files checks every member and returns each file's MD5; one
    flipped byte in a container fails the pass naming the member."""
    members, src, _ = mixed
    work = build(tmp_path, members, src)
    ids = [m.object_id for m in members]
    md5s = verify_package(work, BASE, threading.Event(), chunk=1000, expected=ids)
    assert set(md5s) == {p.name[len(BASE) :] for p in work.iterdir()}
    with pytest.raises(VerifyFailed, match="differ"):
        verify_package(work, BASE, threading.Event(), expected=[*ids, "f" * 32])
    first = next(package_lines(work, BASE))["canner"]
    path = work / first["file"]
    data = bytearray(path.read_bytes())
    data[first["offset"] + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(VerifyFailed, match=first["object_id"]):
        verify_package(work, BASE, threading.Event())


def test_a_member_changed_on_disk_stops_the_build(tmp_path: Path) -> None:
    """A member whose bytes no longer hash to its receipt raises MemberMismatch naming both
    hashes; a missing one says so."""
    members, src = members_from(tmp_path, [("a.warc.gz", warc_bytes(1)), ("b.txt", b"x" * 100)])
    (src / members[1].object_id).write_bytes(b"y" * 100)
    with pytest.raises(MemberMismatch) as caught:
        build(tmp_path, members, src)
    assert caught.value.member == members[1]
    assert members[1].checksum in str(caught.value) and checksum(b"y" * 100) in str(caught.value)
    (src / members[1].object_id).unlink()
    with pytest.raises(MemberMismatch, match="missing"):
        build(tmp_path, members, src)


def test_a_stop_request_ends_the_build(tmp_path: Path) -> None:
    """A set stop event ends the build at the next chunk."""
    members, src = members_from(tmp_path, [("a.bin", b"z" * 10000)])
    stop = threading.Event()
    stop.set()
    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(BuildStopped):
        build_package(members, lambda oid: src / oid, work, BASE, stop, 1000)


def test_index_lines_follow_megawarc_format(
    tmp_path: Path, mixed: tuple[list[Member], Path, dict[str, bytes]]
) -> None:
    """In each megawarc's index, src_offsets chain entry -> data -> next_entry through its own
    original tar, and the header fields are tarfile's with the type as a one-character string."""
    members, src, _ = mixed
    work = build(tmp_path, members, src)
    by_id = {m.object_id: m for m in members}
    position: dict[str, int] = {}
    for line in package_lines(work, BASE):
        member = by_id[line["canner"]["object_id"]]
        offsets = line["src_offsets"]
        file = line["canner"]["file"]
        megawarc = file[: file.index(".megawarc.")]
        assert offsets["entry"] == position.get(megawarc, 0)
        assert offsets["data"] - offsets["entry"] == len(base64.b64decode(line["header_base64"]))
        assert offsets["next_entry"] == offsets["data"] + member.size_bytes + (
            -member.size_bytes % 512
        )
        assert line["header_fields"]["type"] == "0"
        assert line["header_fields"]["size"] == member.size_bytes
        assert json.dumps(line)  # plain JSON
        position[megawarc] = offsets["next_entry"]
    assert len(position) == 3


def test_the_same_members_always_give_the_same_bytes(
    tmp_path: Path, mixed: tuple[list[Member], Path, dict[str, bytes]]
) -> None:
    """Building again, with any number of test threads and chunk size, writes byte-identical
    files (members that fail their test cost a second pass, never a different package)."""
    members, src, _ = mixed
    built = []
    for i, (threads, chunk) in enumerate([(1, 1 << 20), (3, 3000), (2, 512)]):
        work = tmp_path / f"w{i}"
        work.mkdir()
        build_package(members, lambda oid: src / oid, work, BASE, threading.Event(), chunk, threads)
        built.append({p.name: p.read_bytes() for p in work.iterdir()})
    assert built[0] == built[1] == built[2]


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20, 1 << 30])
def test_gzip_test_reads_highly_compressed_members_to_the_end(chunk: int) -> None:
    """A member that inflates to many output chunks passes, however its input is cut; one
    byte short of the end fails."""
    record = warc_record("http://example.com/zeros", b"\0" * (5 << 20))
    data = gzip.compress(record, mtime=0) + gzip.compress(record[:1000], mtime=0)
    for blob, ok in ((data, True), (data[:-1], False)):
        test = GzipTest()
        for i in range(0, len(blob), chunk):
            test.feed(blob[i : i + chunk])
        assert test.finish() is ok


def check_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("canner-check-")]


def test_a_mismatch_behind_members_in_flight_is_the_one_reported(tmp_path: Path) -> None:
    """Members are checked on other threads while the next ones are read: the member that
    does not match is still the one named, and no checking thread outlives the build."""
    named = [(f"m{i}.warc.gz", warc_bytes(i, records=3)) for i in range(40)]
    members, src = members_from(tmp_path, named)
    (src / members[3].object_id).write_bytes(warc_bytes(1000, records=3))
    with pytest.raises(MemberMismatch) as caught:
        build(tmp_path, members, src, chunk=4096)
    assert caught.value.member == members[3]
    assert check_threads() == []


def test_a_stop_request_while_members_are_in_flight_leaves_no_thread(tmp_path: Path) -> None:
    """Stopping halfway through (members queued for their checks, one half read) ends the
    build with BuildStopped and its checking threads."""
    named = [(f"m{i}.warc.gz", warc_bytes(i, records=3)) for i in range(40)]
    members, src = members_from(tmp_path, named)
    stop = threading.Event()

    def source(oid: str) -> Path:
        if oid == members[20].object_id:
            stop.set()
        return src / oid

    work = tmp_path / "w"
    work.mkdir()
    with pytest.raises(BuildStopped):
        build_package(members, source, work, BASE, stop, 4096)
    assert check_threads() == []


def test_many_empty_and_tiny_members_are_packed(tmp_path: Path) -> None:
    """Members that need no buffer at all (empty) or one small chunk, far more of them than
    checks may be in flight, all land in the package and restore."""
    named = [(f"e{i}.bin", b"" if i % 2 else b"x" * i) for i in range(300)]
    named += [(f"w{i}.warc.gz", warc_bytes(i, records=1)) for i in range(100)]
    members, src = members_from(tmp_path, named)
    work = build(tmp_path, members, src, chunk=512)
    containers = [line["target"]["container"] for line in read_index(work / (BASE + INDEX))]
    assert containers == ["tar"] * 300 + ["warc"] * 100
    out = io.BytesIO()
    restore(work, BASE, out)
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        for entry, (_, data) in zip(tar.getmembers(), named, strict=True):
            extracted = tar.extractfile(entry)
            assert extracted is not None and extracted.read() == data
    assert check_threads() == []


def test_a_member_that_names_its_dictionary_is_packed_behind_the_given_frame(
    tmp_path: Path,
) -> None:
    """A dictionary-less .warc.zst named .<project>.<10-digit id>.warc.zst goes into
    B.<id>.megawarc.warc.zst behind the frame it is given (raw dictionaries compressed, as
    megawarc does); without that dictionary the build raises DictionaryMissing, and a member that
    holds its own dictionary needs none."""
    dictionary = train_dictionary(11)
    compressor = zstandard.ZstdCompressor(dict_data=dictionary)
    dictless = b"".join(compressor.compress(warc_bytes(i, gz=False)) for i in range(2))
    named = [
        ("x.urls.0000000042.warc.zst", dictless),
        ("held.warc.zst", zst_warc(12, dictionary, compress_dict=False)),
    ]
    members, src = members_from(tmp_path, named)
    assert wanted_dictionaries(members, lambda oid: src / oid) == [("urls", "0000000042")]
    with pytest.raises(DictionaryMissing, match="0000000042"):
        build(tmp_path, members, src)
    frame = dictionary_frame(dictionary.as_bytes())
    assert frame[8:12] == b"\x28\xb5\x2f\xfd"
    work = tmp_path / "named"
    work.mkdir()
    build_package(
        members,
        lambda oid: src / oid,
        work,
        BASE,
        threading.Event(),
        dictionaries={"0000000042": frame},
    )
    data = (work / f"{BASE}.0000000042.megawarc.warc.zst").read_bytes()
    assert data == frame + dictless
    held = (work / f"{BASE}.{dictionary.dict_id()}.megawarc.warc.zst").read_bytes()
    assert held.endswith(named[1][1])
    restored = restore_package(work, BASE, tmp_path / "restore")
    assert restored == {member_name(m): d for m, (_, d) in zip(members, named, strict=True)}
