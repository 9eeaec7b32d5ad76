"""Pure tus header parsing."""

from __future__ import annotations

import base64
from urllib.parse import urljoin

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.web.http_headers import Headers

from canner.doors.tus import protocol
from canner.ids import ObjectIds
from canner.web.errors import HTTPError
from canner.web.routing import method_override

CHECKSUM = "blake3:" + "ab" * 32


def headers(**values: str) -> Headers:
    h = Headers()
    for name, value in values.items():
        h.addRawHeader(name.replace("_", "-").encode(), value.encode())
    return h


def metadata(**values: str) -> str:
    return ",".join(f"{k} {base64.b64encode(v.encode()).decode()}" for k, v in values.items())


@given(st.integers(0, 2**63 - 1))
def test_plain_digits_parse(value: int) -> None:
    """Any non-negative integer in plain digits parses to itself."""
    assert protocol.parse_strict_int(str(value), "Upload-Length") == value


@pytest.mark.parametrize(
    "text", ["+10", "1_0", " 10", "10 ", "-1", "", "0x10", "\u0661\u0660", "9" * 21]
)
def test_integers_are_parsed_strictly(text: str) -> None:
    """What Python's int() accepts beyond plain digits is a 400 here."""
    with pytest.raises(HTTPError) as caught:
        protocol.parse_strict_int(text, "Upload-Offset")
    assert caught.value.status == 400
    assert "Upload-Offset" in caught.value.message


def test_integer_above_int64_is_refused() -> None:
    """Values past 2**63 - 1 are refused."""
    with pytest.raises(HTTPError):
        protocol.parse_strict_int(str(2**63), "Upload-Length")


meta_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-.0123456789", min_size=1, max_size=20)


@given(st.dictionaries(meta_keys, st.text(max_size=50), max_size=6))
def test_metadata_round_trips(values: dict[str, str]) -> None:
    """format_metadata output parses back to the same mapping."""
    assert protocol.parse_metadata(protocol.format_metadata(values)) == values


@pytest.mark.parametrize(
    "text",
    [
        "project !!!",
        "project ZXhh,project ZXhh",
        "a b c",
        "ke\x01y dmFs",
        "project /w==",  # base64 of 0xff: not UTF-8
        "project ZX=hh",
    ],
)
def test_malformed_metadata_is_400(text: str) -> None:
    """Bad base64, duplicate keys, bad keys and non-UTF-8 values are refused."""
    with pytest.raises(HTTPError) as caught:
        protocol.parse_metadata(text)
    assert caught.value.status == 400


def test_metadata_padding_is_optional_and_bare_keys_are_empty() -> None:
    """Unpadded base64 is accepted; a key without value maps to ''."""
    assert protocol.parse_metadata("a ZXhhbXBsZQ,flag") == {"a": "example", "flag": ""}


def test_creation_parses_project_checksum_and_filename() -> None:
    """A valid creation yields its length, project, checksum and filename."""
    h = headers(
        Upload_Length="123",
        Upload_Metadata=metadata(project="example", checksum=CHECKSUM, filename="a.warc.gz"),
    )
    creation = protocol.parse_creation(h, {"example"}, 1000)
    assert (creation.length, creation.project, creation.filename) == (123, "example", "a.warc.gz")
    assert str(creation.checksum) == CHECKSUM


@pytest.mark.parametrize(
    ("values", "status"),
    [
        ({"Upload_Length": "0"}, 400),
        ({"Upload_Length": "1001"}, 413),
        ({"Upload_Defer_Length": "1"}, 400),
        ({"Upload_Length": None}, 400),
        ({"Upload_Metadata": metadata(project="nope", checksum=CHECKSUM)}, 400),
        ({"Upload_Metadata": metadata(checksum=CHECKSUM)}, 400),
        ({"Upload_Metadata": metadata(project="example")}, 400),
        ({"Upload_Metadata": metadata(project="example", checksum="blake3:AB" + "0" * 62)}, 400),
        ({"Upload_Metadata": metadata(project="example", checksum="sha256:" + "0" * 64)}, 400),
        (
            {
                "Upload_Metadata": metadata(
                    project="example", checksum=CHECKSUM, filename="x" * 1025
                )
            },
            400,
        ),
    ],
)
def test_bad_creations_are_refused_before_anything_exists(
    values: dict[str, str | None], status: int
) -> None:
    """Creation errors map to 400 or 413 as docs/architecture.md ("Wire protocol") says."""
    base = {
        "Upload_Length": "10",
        "Upload_Metadata": metadata(project="example", checksum=CHECKSUM),
    }
    merged = {k: v for k, v in {**base, **values}.items() if v is not None}
    with pytest.raises(HTTPError) as caught:
        protocol.parse_creation(headers(**merged), {"example"}, 1000)
    assert caught.value.status == status


def test_repeated_headers_are_refused() -> None:
    """A header sent twice is ambiguous: 400."""
    h = Headers({b"Upload-Offset": [b"1", b"2"]})
    with pytest.raises(HTTPError):
        protocol.upload_offset(h)


def test_tus_resumable_must_be_1_0_0() -> None:
    """Missing or other versions are 412 with Tus-Version."""
    for h in (headers(), headers(Tus_Resumable="0.2.2")):
        with pytest.raises(HTTPError) as caught:
            protocol.check_tus_resumable(h)
        assert caught.value.status == 412
        assert ("Tus-Version", "1.0.0") in caught.value.headers
    protocol.check_tus_resumable(headers(Tus_Resumable="1.0.0"))


def test_patch_content_type_is_checked() -> None:
    """PATCH bodies must be application/offset+octet-stream (415 otherwise)."""
    protocol.check_patch_content_type(headers(Content_Type="application/offset+octet-stream"))
    for h in (headers(), headers(Content_Type="application/octet-stream")):
        with pytest.raises(HTTPError) as caught:
            protocol.check_patch_content_type(h)
        assert caught.value.status == 415


def test_method_override() -> None:
    """X-HTTP-Method-Override replaces the request line's method."""
    assert method_override(b"POST", headers(X_HTTP_Method_Override="patch")) == b"PATCH"
    assert method_override(b"POST", headers()) == b"POST"


def test_location_prefers_public_url_then_trusted_forwarded_then_path_absolute() -> None:
    """Location comes from public_url, else trusted forwarded headers, else it is /files/<id>."""
    oid = "0" * 32
    assert protocol.location("https://c.example/", [], oid) == f"https://c.example/files/{oid}"
    forwarded = [("proto", "https"), ("host", "public.example")]
    assert protocol.location(None, forwarded, oid) == f"https://public.example/files/{oid}"
    with pytest.raises(HTTPError):
        protocol.location(None, [("proto", "https"), ("host", "evil/host")], oid)
    # Only one of the two forwarded values: not enough for an absolute URL.
    assert protocol.location(None, [("proto", "https")], oid) == f"/files/{oid}"


# How each client resolves a creation's Location: tus-js-client and tuspy against the URL they
# POSTed to, the Go canner SDK against its base URL (reference go-canner.md, section 1.17 step 3).
RESOLVERS = {
    "creation URL (tus-js-client, tuspy)": lambda base, files_url, loc: urljoin(files_url, loc),
    "base URL (Go canner SDK)": lambda base, files_url, loc: urljoin(base, loc),
}


@pytest.mark.parametrize("rule", sorted(RESOLVERS))
@pytest.mark.parametrize("base", ["http://127.0.0.1:8080/", "https://canner.example"])
@pytest.mark.parametrize("collection", ["files", "files/"])
def test_default_location_resolves_to_the_upload_for_every_client(
    rule: str, base: str, collection: str
) -> None:
    """With nothing configured, every client's resolution rule lands on /files/<id> of the
    origin it used (directly, behind a TLS proxy, on an ssl: listener)."""
    oid = "n1-" + "a" * 32
    files_url = base.rstrip("/") + "/" + collection
    resolved = RESOLVERS[rule](base, files_url, protocol.location(None, [], oid))
    assert resolved == f"{base.rstrip('/')}/files/{oid}"


@pytest.mark.parametrize("rule", sorted(RESOLVERS))
def test_public_url_names_a_path_prefix_for_every_client(rule: str) -> None:
    """Under a path prefix only public_url can name the prefix; with it every client lands on
    the upload below the prefix."""
    oid = "a" * 32
    base = "https://proxy.example/canner/"
    resolved = RESOLVERS[rule](base, base + "files/", protocol.location(base, [], oid))
    assert resolved == f"{base}files/{oid}"


@given(st.text(max_size=40))
def test_ids_only_match_the_full_pattern(candidate: str) -> None:
    """Only 32 lowercase hex characters (behind the node prefix, or bare: the Go canner's ids,
    adopted by ``canner adopt-go``) are ids."""
    plain, prefixed = ObjectIds(), ObjectIds("n1")
    expected = len(candidate) == 32 and all(c in "0123456789abcdef" for c in candidate)
    assert plain.is_valid(candidate) == expected
    assert prefixed.is_valid("n1-" + candidate) == expected
    own = candidate.startswith("n1-") and plain.is_valid(candidate[3:])
    assert prefixed.is_valid(candidate) == (expected or own)
    assert not prefixed.is_valid("n2-" + candidate)


def test_a_prefixed_node_accepts_bare_go_ids_but_never_issues_one() -> None:
    """The Go canner's ids (tusd's 32 hex), adopted by ``canner adopt-go``, stay valid on a
    node with a prefix; another node's prefix does not."""
    ids = ObjectIds("n1")
    assert ids.is_valid("0123456789abcdef" * 2)
    assert not ids.is_valid("n2-" + "0123456789abcdef" * 2)
    assert not ids.is_valid("-" + "0123456789abcdef" * 2)
    assert all(i.startswith("n1-") for i in (ids.new() for _ in range(20)))


def test_new_ids_are_valid_and_distinct() -> None:
    """Generated ids pass validation and do not repeat."""
    for ids in (ObjectIds(), ObjectIds("node7")):
        made = {ids.new() for _ in range(100)}
        assert len(made) == 100
        assert all(ids.is_valid(i) for i in made)
