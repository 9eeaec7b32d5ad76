"""canner.sinks (IA): the pure plan half exhaustively, and IAClient against the fake IA."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import attrs
import blake3
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent
from twisted.internet import reactor as _reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IConsumer
from twisted.internet.task import Clock, deferLater
from twisted.internet.threads import deferToThread
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import Request
from zope.interface import implementer

from canner.blocking import run_inline
from canner.checksum import HashCancelled, delivery_digests
from canner.config import ConfigError
from canner.sinks.base import Verdict
from canner.sinks.ia.attempt import DeliveryResult
from canner.sinks.ia.body import FileProducer
from canner.sinks.ia.client import IAClient
from canner.sinks.ia.config import IADelivery, validate_delivery
from canner.sinks.ia.credentials import Credentials, CredentialsError, load_credentials, redact
from canner.sinks.ia.metadata import encode_metadata_value, metadata_headers
from canner.sinks.ia.wire import RemoteFile, Unknown, classify, parse_metadata, parse_retry_after
from canner.sinks.plan import (
    FILENAME_MAX_BYTES,
    ItemPlan,
    PlanError,
    format_date,
    plan_upload,
    remote_name_problem,
    sanitize_filename,
)
from tests.fake_ia import FakeIA, url_of

reactor: Any = _reactor

OID = "0123456789abcdef0123456789abcdef"
ACCEPTED = 1784764800  # 2026-07-23 00:00:00 UTC
MD5 = "d41d8cd98f00b204e9800998ecf8427e"
SECRET = "s3cr3t-K3y/with+odd=chars"


def delivery(**changes: Any) -> IADelivery:
    base = IADelivery(
        sink="internet_archive",
        credentials=Path("/nonexistent/ia.ini"),
        identifier="example-{date}-{object_id}",
        remote_name="{filename}",
        local_artifact_retention=86400.0,
        s3_url="https://s3.us.archive.org",
        metadata_url="https://archive.org",
        metadata={},
    )
    return attrs.evolve(base, **changes)


# --- templates and plans ----------------------------------------------------------------------


def test_date_is_receipt_time_in_utc() -> None:
    """{date} is the receipt time as UTC YYYYMMDDhhmmss."""
    assert format_date(0) == "19700101000000"
    assert format_date(ACCEPTED + 3661) == "20260723010101"


def test_plan_expands_templates_from_stable_inputs() -> None:
    """The identifier and remote name come from project, object id, filename and receipt time."""
    config = delivery(
        identifier="{project}-{date}-{object_id}", remote_name="warcs/{date}/{filename}"
    )
    plan = plan_upload(config, "example", OID, "crawl 1.warc.gz", ACCEPTED, 123, MD5)
    assert plan.identifier == f"example-20260723000000-{OID}"
    assert plan.remote_name == "warcs/20260723000000/crawl 1.warc.gz"
    assert plan.path == f"/example-20260723000000-{OID}/warcs/20260723000000/crawl%201.warc.gz"
    assert plan == plan_upload(config, "example", OID, "crawl 1.warc.gz", ACCEPTED, 123, MD5)


def test_plan_headers_follow_the_reference_encoding() -> None:
    """Metadata becomes x-archive-meta headers: index only for lists, _ as --, uri() encoding."""
    config = delivery(
        metadata={
            "collection": ("example-collection", "other"),
            "mediatype": ("web",),
            "title": ("Café — {filename}",),
            "external_id": ("{object_id}",),
            "empty": ("  ",),
        }
    )
    plan = plan_upload(config, "example", OID, "a.warc", ACCEPTED, 5000, MD5)
    assert plan.headers == (
        ("content-md5", MD5),
        ("x-archive-auto-make-bucket", "1"),
        ("x-archive-size-hint", "5000"),
        ("x-archive-filemeta-canner-object-id", OID),
        ("x-archive-meta01-collection", "example-collection"),
        ("x-archive-meta02-collection", "other"),
        ("x-archive-meta-mediatype", "web"),
        ("x-archive-meta-title", "uri(Caf%C3%A9%20%E2%80%94%20a.warc)"),
        ("x-archive-meta-external--id", OID),
    )
    assert plan.size_hint == 5000
    assert not any(name.lower() == "authorization" for name, _ in plan.headers)


def test_metadata_value_encoding_matches_the_reference_example() -> None:
    """Non-ASCII or whitespace means uri(); XML-forbidden characters are dropped first."""
    assert encode_metadata_value("Café — x") == "uri(Caf%C3%A9%20%E2%80%94%20x)"
    assert encode_metadata_value("web") == "web"
    assert encode_metadata_value("a\x01b") == "ab"
    assert encode_metadata_value("\x00") is None
    assert encode_metadata_value(" \t ") is None
    assert encode_metadata_value("a\tb") == "uri(a%09b)"


def test_metadata_headers_refuse_keys_that_cannot_round_trip() -> None:
    """A key that already contains -- cannot be told apart from an encoded _."""
    with pytest.raises(ValueError, match="cannot be expressed"):
        metadata_headers({"a--b": ["x"]})


def test_plan_renames_a_filename_that_would_be_one_of_ias_own_files() -> None:
    """A worker filename equal to {identifier}_meta.xml is renamed deterministically."""
    config = delivery(identifier="example-{object_id}")
    plan = plan_upload(config, "example", OID, f"example-{OID}_meta.xml", ACCEPTED, 1, MD5)
    assert plan.remote_name == f"{OID}-example-{OID}_meta.xml"
    assert remote_name_problem(plan.remote_name, plan.identifier) is None


def test_plan_refuses_a_malformed_md5() -> None:
    """Content-MD5 must be 32 lowercase hex digits."""
    with pytest.raises(PlanError):
        plan_upload(
            delivery(), "example", OID, "a", ACCEPTED, 1, "D41D8CD98F00B204E9800998ECF8427E"
        )


# --- filename sanitising ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (None, OID),
        ("", OID),
        ("crawl-00001.warc.gz", "crawl-00001.warc.gz"),
        ("../../etc/passwd", "passwd"),
        ("C:\\Users\\x\\file.warc", "file.warc"),
        (".hidden", "hidden"),
        ("...", OID),
        ("dir/", OID),
        ("a\x00b\nc\u202e", "abc\u202e"),
        ("  spaced name  ", "spaced name"),
        (". .x", "x"),
        ("héllo wörld.txt", "héllo wörld.txt"),
    ],
)
def test_sanitize_filename_examples(name: str | None, expected: str) -> None:
    """Path parts, control characters and leading dots go; nothing usable means the object id."""
    assert sanitize_filename(name, OID) == expected


def test_sanitize_filename_bounds_length_and_keeps_the_extension() -> None:
    """A long name is cut to the byte limit, keeping a short extension."""
    result = sanitize_filename("é" * 500 + ".warc.gz", OID)
    assert len(result.encode()) <= FILENAME_MAX_BYTES
    assert result.endswith(".warc.gz")
    assert result.startswith("é")


@given(st.one_of(st.none(), st.text(max_size=600)))
def test_sanitized_filenames_are_always_safe(name: str | None) -> None:
    """Whatever the worker sends, the result is one bounded, valid remote-name segment."""
    result = sanitize_filename(name, OID)
    assert result
    assert "/" not in result and "\\" not in result
    assert not result.startswith(".")
    assert result == result.strip()
    assert len(result.encode("utf-8")) <= FILENAME_MAX_BYTES
    assert remote_name_problem(result, "some-identifier") is None
    assert sanitize_filename(result, OID) == result


# --- config validation --------------------------------------------------------------------


def test_validate_accepts_the_design_example() -> None:
    """The example delivery table of docs/architecture.md ("Configuration") is valid."""
    validate_delivery(
        "example",
        delivery(
            metadata={
                "collection": ("example-collection",),
                "mediatype": ("web",),
                "title": ("Example artifact {object_id}",),
            }
        ),
    )


def test_validate_allows_plain_http_only_on_loopback() -> None:
    """The secret travels as-is, so only a loopback fake may use http://."""
    validate_delivery(
        "example", delivery(s3_url="http://127.0.0.1:8080", metadata_url="http://localhost:1")
    )
    with pytest.raises(ConfigError) as info:
        validate_delivery("example", delivery(s3_url="http://s3.us.archive.org"))
    assert info.value.key == "projects.example.delivery.s3_url"
    with pytest.raises(ConfigError) as info:
        validate_delivery("example", delivery(download_url="http://archive.org"))
    assert info.value.key == "projects.example.delivery.download_url"


@pytest.mark.parametrize(
    ("project", "changes", "key"),
    [
        ("example", {"identifier": "example-{filename}-{object_id}"}, "identifier"),
        ("example", {"identifier": "example-{date}", "remote_name": "{filename}"}, "identifier"),
        ("example", {"identifier": "x" * 52 + "{object_id}"}, "identifier"),
        ("example", {"identifier": "my item {object_id}"}, "identifier"),
        ("example", {"identifier": "-{object_id}"}, "identifier"),
        ("ex:ample", {"identifier": "{project}-{object_id}"}, "identifier"),
        ("example", {"identifier": "example-{nope}-{object_id}"}, "identifier"),
        ("example", {"identifier": "example-{object_id:>50}"}, "identifier"),
        ("example", {"identifier": "example-{object_id"}, "identifier"),
        ("example", {"remote_name": "history/{filename}"}, "remote_name"),
        ("example", {"remote_name": "{filename}/"}, "remote_name"),
        ("example", {"remote_name": "a//{filename}"}, "remote_name"),
        ("example", {"remote_name": "./{filename}"}, "remote_name"),
        ("example", {"remote_name": "{filename}/data.warc"}, "remote_name"),
        ("example", {"remote_name": "{filename}" + "x" * 60}, "remote_name"),
        ("example", {"remote_name": "a\tb/{filename}"}, "remote_name"),
        ("example", {"remote_name": ""}, "remote_name"),
        ("example", {"remote_name": "{nope}"}, "remote_name"),
        ("example", {"metadata": {"Title": ("x",)}}, "metadata.Title"),
        ("example", {"metadata": {"xmlthing": ("x",)}}, "metadata.xmlthing"),
        ("example", {"metadata": {"a--b": ("x",)}}, "metadata.a--b"),
        ("example", {"metadata": {"a_-b": ("x",)}}, "metadata.a_-b"),
        ("example", {"metadata": {"1abc": ("x",)}}, "metadata.1abc"),
        ("example", {"metadata": {"title": ("",)}}, "metadata.title"),
        ("example", {"metadata": {"subject": ("x",) * 100}}, "metadata.subject"),
        ("example", {"metadata": {"title": ("{nope}",)}}, "metadata.title"),
    ],
)
def test_validate_names_the_offending_key(project: str, changes: dict[str, Any], key: str) -> None:
    """A template that could break IA's rules refuses to load, naming its key."""
    with pytest.raises(ConfigError) as info:
        validate_delivery(project, delivery(**changes))
    assert info.value.key == f"projects.{project}.delivery.{key}"


def test_validate_accepts_the_longest_safe_identifier() -> None:
    """51 literal characters plus the longest object id (49) is exactly 100."""
    validate_delivery("example", delivery(identifier="x" * 51 + "{object_id}"))


# --- classification -----------------------------------------------------------------------


def s3_error(code: str, message: str = "msg") -> bytes:
    xml = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    return ("<?xml version='1.0'?>" + xml).encode()


@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        (200, b"", Verdict.SUCCESS),
        (201, b"", Verdict.SUCCESS),
        (503, s3_error("SlowDown", "Please reduce your request rate."), Verdict.TRANSIENT),
        (503, s3_error("SlowDown", "Your upload appears to be spam."), Verdict.OPERATOR),
        (500, b"Internal Server Error", Verdict.TRANSIENT),
        (502, b"<html>bad gateway</html>", Verdict.TRANSIENT),
        (504, b"", Verdict.TRANSIENT),
        (429, b"", Verdict.TRANSIENT),
        (408, b"", Verdict.TRANSIENT),
        (400, s3_error("RequestTimeout"), Verdict.TRANSIENT),
        (400, s3_error("IncompleteBody"), Verdict.TRANSIENT),
        (400, s3_error("BadDigest"), Verdict.TRANSIENT),
        (400, s3_error("InvalidBucketName"), Verdict.OPERATOR),
        (400, s3_error("InvalidURI"), Verdict.OPERATOR),
        (400, s3_error("InvalidArgument"), Verdict.OPERATOR),
        (400, s3_error("MetadataTooLarge"), Verdict.OPERATOR),
        (400, s3_error("EntityTooLarge"), Verdict.OPERATOR),
        (400, s3_error("InvalidDigest"), Verdict.OPERATOR),
        (400, s3_error("SomethingNew"), Verdict.TRANSIENT),
        (403, s3_error("AccessDenied"), Verdict.OPERATOR),
        (403, s3_error("InvalidAccessKeyId"), Verdict.OPERATOR),
        (403, b"", Verdict.OPERATOR),
        (404, s3_error("NoSuchBucket"), Verdict.OPERATOR),
        (404, b"", Verdict.TRANSIENT),
        (409, s3_error("BucketAlreadyExists"), Verdict.OPERATOR),
        (409, b"", Verdict.TRANSIENT),
        (411, b"", Verdict.OPERATOR),
        (501, b"", Verdict.OPERATOR),
        (307, b"", Verdict.TRANSIENT),
        (418, b"", Verdict.TRANSIENT),
        (599, b"\xff\xfe", Verdict.TRANSIENT),
    ],
)
def test_classify_table(status: int, body: bytes, verdict: Verdict) -> None:
    """Each IA answer maps to success, retry, or retry-and-flag as the reference says."""
    assert classify(status, {}, body).verdict is verdict


def test_classify_reason_is_status_code_and_message() -> None:
    """The reason carries status, S3 Code and Message, short enough for last_error."""
    outcome = classify(503, {"retry-after": "120"}, s3_error("SlowDown", "Please  slow\n down"))
    assert outcome.reason == "503 SlowDown: Please slow down"
    assert outcome.retry_after == 120.0
    long = classify(500, {}, b"x" * 10_000)
    assert len(long.reason) <= 300
    assert classify(400, {}, s3_error("BadDigest", "a &amp; b")).reason == "400 BadDigest: a & b"


def test_retry_after_only_as_seconds() -> None:
    """Retry-After is used only as delta-seconds."""
    assert parse_retry_after("30") == 30.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None


# --- the metadata API ---------------------------------------------------------------------


def test_parse_metadata_cases() -> None:
    """Only the entry whose name equals the remote name counts; failures are Unknown."""
    doc = {
        "files": [
            {"name": "id_files.xml", "summation": "md5"},
            {"name": "a.warc", "size": "10", "md5": MD5, "sha1": "ab"},
        ]
    }
    assert parse_metadata(json.dumps(doc).encode(), "a.warc") == RemoteFile("a.warc", 10, MD5, "ab")
    assert parse_metadata(json.dumps(doc).encode(), "b.warc") is None
    assert parse_metadata(b"{}", "a.warc") is None
    assert parse_metadata(b'{"files": [{"name": "a.warc"}]}', "a.warc") == RemoteFile(
        "a.warc", None, None
    )
    assert isinstance(parse_metadata(b"<html>", "a.warc"), Unknown)
    assert isinstance(parse_metadata(b"[]", "a.warc"), Unknown)
    assert isinstance(parse_metadata(b'{"files": {}}', "a.warc"), Unknown)
    dark = parse_metadata(b'{"is_dark": true, "files": []}', "a.warc")
    assert isinstance(dark, Unknown) and dark.needs_operator


def test_remote_file_matches_on_size_and_md5() -> None:
    """Same size and MD5 (any case) match; SHA-1 counts only when both sides know it."""
    remote = RemoteFile("a", 10, MD5.upper(), "ab")
    assert remote.matches(10, MD5)
    assert remote.matches(10, MD5, "AB")
    assert not remote.matches(10, MD5, "cd")
    assert not remote.matches(11, MD5)
    assert not remote.matches(10, "0" * 32)
    assert not RemoteFile("a", None, None).matches(10, MD5)


# --- credentials --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_ia_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IA_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("IA_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("IA_CONFIG_FILE", raising=False)


def test_credentials_from_ia_ini(tmp_path: Path) -> None:
    """The standard ia.ini [s3] section gives the key pair."""
    path = tmp_path / "ia.ini"
    path.write_text(f"[s3]\naccess = AKEY\nsecret = {SECRET}\n\n[cookies]\nlogged-in-user = x\n")
    assert load_credentials(path) == Credentials("AKEY", SECRET)


def test_credentials_from_two_line_file(tmp_path: Path) -> None:
    """The Go canner's key file: access key, then secret."""
    path = tmp_path / "keys"
    path.write_text(f"AKEY\n{SECRET}\n\n")
    creds = load_credentials(path)
    assert creds == Credentials("AKEY", SECRET)
    assert creds.authorization == f"LOW AKEY:{SECRET}"
    assert SECRET not in repr(creds)


def test_credentials_environment_overrides_ia_ini(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for the ia tool, IA_ACCESS_KEY_ID and IA_SECRET_ACCESS_KEY override the file."""
    path = tmp_path / "ia.ini"
    path.write_text("[s3]\naccess = A\nsecret = B\n")
    monkeypatch.setenv("IA_ACCESS_KEY_ID", "ENVA")
    monkeypatch.setenv("IA_SECRET_ACCESS_KEY", "ENVB")
    assert load_credentials(path) == Credentials("ENVA", "ENVB")


@pytest.mark.parametrize(
    "content",
    [
        "[s3]\naccess = AKEY\n",
        f"[s3]\nsecret = {SECRET}\n",
        f"AKEY\n{SECRET}\nextra\n",
        "AKEY\n",
        f"[s3]\naccess = AKEY\nsecret = {SECRET}\n  {SECRET}-continued\n[broken\n",
        f"[s3\naccess = AKEY\nsecret = {SECRET}\n",
        f"AK:EY\n{SECRET}\n",
        f"AKEY\n{SECRET} with spaces\n",
    ],
)
def test_bad_credentials_never_show_the_secret(tmp_path: Path, content: str) -> None:
    """Malformed files are refused with a message that names the file, not the secret."""
    path = tmp_path / "ia.ini"
    path.write_text(content)
    with pytest.raises(CredentialsError) as info:
        load_credentials(path)
    assert str(path) in str(info.value)
    assert SECRET not in str(info.value)


def test_missing_credentials_file(tmp_path: Path) -> None:
    """An unreadable file is a CredentialsError naming it."""
    with pytest.raises(CredentialsError, match="cannot read"):
        load_credentials(tmp_path / "absent")


def test_redact_replaces_every_form_of_the_secret() -> None:
    """Raw and percent-encoded forms of the secret are masked."""
    text = f"LOW a:{SECRET} and s3cr3t-K3y%2Fwith%2Bodd%3Dchars"
    assert redact(text, SECRET) == "LOW a:*** and ***"


def test_delivery_digests(tmp_path: Path) -> None:
    """One read gives the hex MD5 (for Content-MD5) and the BLAKE3, and stops when asked."""
    path = tmp_path / "f"
    data = os.urandom(5 << 20)
    path.write_bytes(data)
    blake, md5_hex, size = delivery_digests(path)
    assert md5_hex == hashlib.md5(data).hexdigest()
    assert str(blake) == "blake3:" + blake3.blake3(data).hexdigest()
    assert size == len(data)
    stop = threading.Event()
    stop.set()
    with pytest.raises(HashCancelled):
        delivery_digests(path, stop)


# --- IAClient over a traversal agent (no sockets) --------------------------------------------


class EchoingIA(Resource):
    """A broken server that echoes the authorization header in its error message."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.args.get(b"check_limit"):
            return b'{"over_limit": 0}'
        return b"{}"

    def render_PUT(self, request: Request) -> bytes:
        auth = request.getHeader(b"authorization") or b""
        request.setResponseCode(400)
        return b"<Error><Code>InvalidArgument</Code><Message>bad " + auth + b"</Message></Error>"


def drive(d: Deferred[Any], agent: RequestTraversalAgent, clock: Clock) -> Any:
    results: list[Any] = []
    d.addBoth(results.append)
    for _ in range(1000):
        if results:
            break
        clock.advance(0)
        agent.flush()
    assert results, "the Deferred never fired"
    return results[0]


def test_secret_never_reaches_the_outcome(tmp_path: Path) -> None:
    """Even a server that echoes the authorization header cannot put the secret in last_error."""
    agent = RequestTraversalAgent(EchoingIA())
    clock = Clock()
    sink = IAClient(
        http=HTTPClient(agent),
        clock=clock,
        credentials=Credentials("AKEY", SECRET),
        s3_url="https://ia",
        metadata_url="https://ia",
        run=run_inline,
    )
    path = tmp_path / "artifact"
    path.write_bytes(b"hello")
    plan = plan_upload(
        delivery(), "example", OID, "a", ACCEPTED, 5, hashlib.md5(b"hello").hexdigest()
    )
    result = drive(sink.deliver(plan, path), agent, clock)
    assert isinstance(result, DeliveryResult)
    assert result.outcome.verdict is Verdict.OPERATOR
    assert "InvalidArgument" in result.outcome.reason
    assert SECRET not in result.outcome.reason
    assert "***" in result.outcome.reason
    assert clock.getDelayedCalls() == []


def test_secret_is_never_sent_in_clear(tmp_path: Path) -> None:
    """Over plain http to a non-loopback host the PUT goes without the authorization header."""
    agent = RequestTraversalAgent(EchoingIA())
    clock = Clock()
    sink = IAClient(
        http=HTTPClient(agent),
        clock=clock,
        credentials=Credentials("AKEY", SECRET),
        s3_url="http://ia",
        metadata_url="http://ia",
        run=run_inline,
    )
    path = tmp_path / "artifact"
    path.write_bytes(b"hello")
    plan = plan_upload(
        delivery(), "example", OID, "a", ACCEPTED, 5, hashlib.md5(b"hello").hexdigest()
    )
    result = drive(sink.deliver(plan, path), agent, clock)
    assert result.outcome.reason == "400 InvalidArgument: bad"


# --- IAClient against the fake IA over loopback ------------------------------------------------


P = ParamSpec("P")
T = TypeVar("T")


def in_thread(f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
    """A BlockingRunner on the reactor's thread pool."""
    return deferToThread(f, *args, **kwargs)


@attrs.define
class RecordingRunner:
    """A thread runner that records the thread each job ran on, and what it ran."""

    jobs: list[tuple[str, int]] = attrs.field(factory=list)

    def __call__(self, f: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Deferred[T]:
        def job() -> T:
            self.jobs.append((getattr(f, "__name__", repr(f)), threading.get_ident()))
            return f(*args, **kwargs)

        return deferToThread(job)


@attrs.define
class World:
    fake: FakeIA
    url: str
    tmp: Path
    fake_clock: Clock

    def sink(self, **kwargs: Any) -> IAClient:
        pool = HTTPConnectionPool(reactor, persistent=False)
        http = HTTPClient(Agent(reactor, connectTimeout=5, pool=pool))
        creds = Credentials(
            kwargs.pop("access", "fake-access"), kwargs.pop("secret", "fake-secret")
        )
        url = kwargs.pop("url", self.url)
        run = kwargs.pop("run", in_thread)
        return IAClient(
            http=http,
            clock=reactor,
            credentials=creds,
            s3_url=url,
            metadata_url=url,
            run=run,
            **kwargs,
        )

    def artifact(
        self, size: int, name: str = "crawl.warc.gz", object_id: str = OID, md5: str | None = None
    ) -> tuple[ItemPlan, Path]:
        path = self.tmp / f"artifact-{object_id}"
        chunk = os.urandom(1 << 16)
        with open(path, "wb") as f:
            left = size
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
        config = delivery(
            s3_url=self.url,
            metadata_url=self.url,
            metadata={"collection": ("a", "b"), "title": ("Artifact {object_id}",)},
        )
        plan = plan_upload(
            config, "example", object_id, name, ACCEPTED, size, md5 or delivery_digests(path)[1]
        )
        return plan, path

    def stored(self, plan: ItemPlan) -> dict[str, Any] | None:
        return self.fake.object(plan.identifier, plan.remote_name)

    def puts(self) -> list[dict[str, Any]]:
        return [r for r in self.fake.requests if r["method"] == "PUT"]


@pytest_twisted.async_yield_fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    fake_clock = Clock()
    fake = FakeIA(tmp_path / "fake-ia", fake_clock)
    port = fake.listen(reactor)
    yield World(fake, url_of(port), tmp_path, fake_clock)
    fake.drop_connections()
    stopped = port.stopListening()
    if stopped is not None:
        await stopped
    await deferLater(reactor, 0.01, lambda: None)
    assert fake.errors == []


async def deliver(sink: IAClient, plan: ItemPlan, path: Path) -> DeliveryResult:
    return await sink.deliver(plan, path)


@pytest_twisted.ensureDeferred
async def test_deliver_streams_the_file_with_the_planned_headers(world: World) -> None:
    """A PUT carries exact length, hex Content-MD5, LOW auth and metadata; the bytes arrive."""
    plan, path = world.artifact(3 << 20)
    result = await deliver(world.sink(), plan, path)
    assert result.delivered and not result.already_present
    assert result.status == 200
    assert result.bytes_sent == plan.size
    stored = world.stored(plan)
    assert stored is not None
    assert (stored["size"], stored["md5"], stored["puts"], stored["stores"]) == (
        plan.size,
        plan.content_md5,
        1,
        1,
    )
    assert Path(stored["path"]).read_bytes() == path.read_bytes()
    (put,) = world.puts()
    assert put["auth"] == "LOW fake-access"
    headers = put["headers"]
    assert headers["content-length"] == str(plan.size)
    assert "transfer-encoding" not in headers
    assert headers["content-md5"] == plan.content_md5
    assert headers["x-archive-auto-make-bucket"] == "1"
    assert headers["x-archive-size-hint"] == str(plan.size)
    assert headers["user-agent"].startswith("canner/")
    assert world.fake.items[plan.identifier].metadata == {
        "collection": ["a", "b"],
        "title": [f"Artifact {OID}"],
    }
    checks = [r for r in world.fake.requests if "check_limit" in r["uri"]]
    assert len(checks) == 1


@pytest_twisted.ensureDeferred
async def test_deliver_skips_a_file_already_present(world: World) -> None:
    """When the metadata API shows the same size and MD5, no PUT is sent."""
    plan, path = world.artifact(1000)
    assert (await deliver(world.sink(), plan, path)).delivered
    again = await deliver(world.sink(), plan, path)
    assert again.delivered and again.already_present and again.bytes_sent == 0
    assert len(world.puts()) == 1


@pytest_twisted.ensureDeferred
async def test_deliver_overwrites_a_different_remote_file(world: World) -> None:
    """Same name with other content is uploaded again."""
    plan, path = world.artifact(1000)
    assert (await deliver(world.sink(), plan, path)).delivered
    path.write_bytes(b"y" * 1000)
    changed = attrs.evolve(plan, content_md5=delivery_digests(path)[1])
    changed = attrs.evolve(
        changed,
        headers=tuple(
            ("content-md5", changed.content_md5) if k == "content-md5" else (k, v)
            for k, v in changed.headers
        ),
    )
    result = await deliver(world.sink(), changed, path)
    assert result.delivered and not result.already_present
    assert world.stored(plan)["md5"] == changed.content_md5  # type: ignore[index]


@pytest_twisted.ensureDeferred
async def test_remote_file_appears_after_the_metadata_lag(world: World) -> None:
    """A stored file is absent from the metadata API until IA's lag has passed."""
    world.fake.metadata_lag = 60.0
    plan, path = world.artifact(1000)
    sink = world.sink()
    assert (await deliver(sink, plan, path)).delivered
    assert await sink.remote_file(plan) is None
    world.fake_clock.advance(61)
    remote = await sink.remote_file(plan)
    assert isinstance(remote, RemoteFile) and remote.matches(plan.size, plan.content_md5)


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", ["error500", "slowdown", "garbage", "stall"])
async def test_failed_lookup_is_unknown_and_upload_proceeds(world: World, kind: str) -> None:
    """A failed metadata lookup is Unknown, never absent; the PUT goes ahead."""
    plan, path = world.artifact(1000)
    sink = world.sink(request_timeout=0.5)
    world.fake.add_fault(kind, target="metadata")
    assert isinstance(await sink.remote_file(plan), Unknown)
    world.fake.add_fault(kind, target="metadata")
    result = await deliver(sink, plan, path)
    assert result.delivered and not result.already_present
    assert len(world.puts()) == 1


@pytest_twisted.ensureDeferred
async def test_dark_item_needs_an_operator(world: World) -> None:
    """A darked item is flagged, and nothing is uploaded."""
    plan, path = world.artifact(1000)
    world.fake.add_fault("dark")
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is Verdict.OPERATOR
    assert world.puts() == []


@pytest_twisted.ensureDeferred
async def test_over_limit_ends_the_attempt_before_the_body(world: World) -> None:
    """check_limit over_limit is a SlowDown retry without sending the body."""
    plan, path = world.artifact(1000)
    world.fake.add_fault("over_limit")
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "over_limit" in result.outcome.reason
    assert world.puts() == []


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("kind", ["error500", "garbage"])
async def test_broken_check_limit_does_not_block_delivery(world: World, kind: str) -> None:
    """A failed probe counts as 'go ahead'."""
    plan, path = world.artifact(1000)
    world.fake.add_fault(kind, target="check_limit")
    assert (await deliver(world.sink(), plan, path)).delivered


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    ("kind", "verdict", "reason"),
    [
        ("slowdown", Verdict.TRANSIENT, "503 SlowDown"),
        ("error500", Verdict.TRANSIENT, "500"),
        ("forbidden", Verdict.OPERATOR, "403 AccessDenied"),
        ("spam", Verdict.OPERATOR, "spam"),
        ("reset", Verdict.TRANSIENT, "PUT"),
        ("lost_response", Verdict.TRANSIENT, "PUT"),
    ],
)
async def test_each_put_fault_ends_in_the_right_outcome(
    world: World, kind: str, verdict: Verdict, reason: str
) -> None:
    """Every injected fault ends the attempt with the outcome the reference gives it."""
    plan, path = world.artifact(2 << 20)
    world.fake.add_fault(kind)
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is verdict, result
    assert reason in result.outcome.reason
    stored = world.stored(plan)
    if kind == "lost_response":
        assert stored is not None and stored["md5"] == plan.content_md5
    else:
        assert stored is None
    # The retry succeeds, and the remote holds exactly one copy.
    again = await deliver(world.sink(), plan, path)
    assert again.delivered
    assert again.already_present is (kind == "lost_response")
    assert world.stored(plan)["stores"] == 1  # type: ignore[index]


@pytest_twisted.ensureDeferred
async def test_stalled_transfer_trips_the_watchdog(world: World) -> None:
    """When the server stops reading, the no-progress watchdog aborts the attempt as transient."""
    plan, path = world.artifact(64 << 20)
    world.fake.add_fault("stall", after_bytes=1 << 20)
    result = await deliver(world.sink(no_progress_timeout=0.5), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "no upload progress" in result.outcome.reason
    assert 0 < result.bytes_sent < plan.size
    assert world.stored(plan) is None


@pytest_twisted.ensureDeferred
async def test_missing_answer_trips_the_answer_timeout(world: World) -> None:
    """All bytes sent but no answer: the answer timer ends the attempt as transient."""
    plan, path = world.artifact(100_000)
    world.fake.add_fault("stall", after_bytes=plan.size)
    result = await deliver(world.sink(answer_timeout=0.5, no_progress_timeout=60), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "no answer" in result.outcome.reason
    assert result.bytes_sent == plan.size


@pytest_twisted.ensureDeferred
async def test_attempt_cap_ends_a_slow_attempt(world: World) -> None:
    """The attempt timeout (24 h in production) bounds the whole attempt."""
    plan, path = world.artifact(64 << 20)
    world.fake.add_fault("stall", after_bytes=1 << 20)
    result = await deliver(world.sink(attempt_timeout=0.5), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "attempt exceeded" in result.outcome.reason


@pytest_twisted.ensureDeferred
async def test_cancelling_aborts_the_transfer(world: World) -> None:
    """Cancelling the attempt's Deferred aborts the PUT and fails with CancelledError."""
    plan, path = world.artifact(64 << 20)
    world.fake.add_fault("stall", after_bytes=1 << 20)
    d = world.sink().deliver(plan, path)
    await deferLater(reactor, 0.3, lambda: None)
    d.cancel()
    with pytest.raises(CancelledError):
        await d
    for _ in range(50):
        if any(r.get("fault") == "stall" for r in world.fake.requests):
            break
        await deferLater(reactor, 0.02, lambda: None)
    assert world.stored(plan) is None


@pytest_twisted.ensureDeferred
async def test_redirects_are_followed_with_a_fresh_body(world: World) -> None:
    """A 307 is re-sent to Location with the whole body again."""
    plan, path = world.artifact(300_000)
    world.fake.add_fault("redirect", count=2)
    result = await deliver(world.sink(), plan, path)
    assert result.delivered
    assert [p["status"] for p in world.puts()] == [307, 307, 200]
    assert all(p["auth"] == "LOW fake-access" for p in world.puts())
    assert result.bytes_sent == 3 * plan.size


@pytest_twisted.ensureDeferred
async def test_too_many_redirects_is_transient(world: World) -> None:
    """Redirect loops end the attempt after a few hops."""
    plan, path = world.artifact(1000)
    world.fake.add_fault("redirect", count=10)
    result = await deliver(world.sink(max_redirects=2), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "redirect" in result.outcome.reason
    assert len(world.puts()) == 3


@pytest_twisted.ensureDeferred
async def test_redirect_to_another_host_drops_the_authorization(world: World) -> None:
    """The secret is sent only to the configured host and *.archive.org."""
    plan, path = world.artifact(1000)
    port = world.url.rsplit(":", 1)[1]
    world.fake.add_fault("redirect", location=f"http://localhost:{port}")
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is Verdict.OPERATOR
    assert [p["auth"] for p in world.puts()] == ["LOW fake-access", None]


@pytest_twisted.ensureDeferred
async def test_wrong_secret_is_flagged_and_not_shown(world: World) -> None:
    """Bad keys need an operator, and the secret never appears in the outcome."""
    plan, path = world.artifact(1000)
    result = await deliver(world.sink(secret=SECRET), plan, path)
    assert result.outcome.verdict is Verdict.OPERATOR
    assert "SignatureDoesNotMatch" in result.outcome.reason
    assert SECRET not in repr(result)


@pytest_twisted.ensureDeferred
async def test_md5_mismatch_is_a_transient_bad_digest(world: World) -> None:
    """A wrong Content-MD5 gets 400 BadDigest from IA, nothing stored, retried."""
    plan, path = world.artifact(1000, md5="0" * 32)
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT
    assert "BadDigest" in result.outcome.reason
    assert world.stored(plan) is None


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize("damage", ["missing", "shorter"])
async def test_local_file_problems_need_an_operator(world: World, damage: str) -> None:
    """A vanished or truncated artifact is not a network fault: flag it, send nothing."""
    plan, path = world.artifact(1000)
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(b"x" * 10)
    result = await deliver(world.sink(), plan, path)
    assert result.outcome.verdict is Verdict.OPERATOR
    assert "local file" in result.outcome.reason
    assert world.puts() == []


@pytest_twisted.ensureDeferred
async def test_unreachable_ia_is_transient(world: World) -> None:
    """A refused connection is a transient failure, and the lookup is Unknown."""
    plan, path = world.artifact(1000)
    sink = world.sink(url="http://127.0.0.1:1")
    assert isinstance(await sink.remote_file(plan), Unknown)
    result = await deliver(sink, plan, path)
    assert result.outcome.verdict is Verdict.TRANSIENT


def test_for_delivery_reads_the_credentials(tmp_path: Path) -> None:
    """IAClient.for_delivery builds a sink from a project's delivery config."""
    keys = tmp_path / "keys"
    keys.write_text(f"AKEY\n{SECRET}\n")
    http = HTTPClient(RequestTraversalAgent(EchoingIA()))
    sink = IAClient.for_delivery(delivery(credentials=keys), http, Clock(), run_inline)
    assert SECRET not in repr(sink)


# --- reading payloads off the reactor thread ---------------------------------------------------


class ThreadNotingStream(io.BytesIO):
    """An in-memory file that notes the thread of every read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_threads: list[int] = []

    def read(self, size: int | None = -1, /) -> bytes:
        self.read_threads.append(threading.get_ident())
        return super().read(size)


@implementer(IConsumer)
@attrs.define
class PausingConsumer:
    """Takes chunks, and pauses its producer after each one until told to resume."""

    producer: FileProducer
    chunks: list[bytes] = attrs.field(factory=list)

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.chunks.append(data)
        self.producer.pauseProducing()


@pytest_twisted.ensureDeferred
async def test_file_producer_reads_in_threads_with_backpressure() -> None:
    """Every chunk is read off the reactor thread, and no read starts while paused."""
    data = os.urandom(10 * 1000)
    stream = ThreadNotingStream(data)
    producer = FileProducer(stream, len(data), reactor, in_thread, lambda n: None, 1000)
    consumer = PausingConsumer(producer)
    done = producer.startProducing(consumer)
    reactor_thread = threading.get_ident()
    while not done.called:
        await deferLater(reactor, 0.01, lambda: None)
        # Paused after each chunk: the next read waits for the resume.
        assert len(stream.read_threads) == len(consumer.chunks)
        producer.resumeProducing()
    assert b"".join(consumer.chunks) == data
    assert len(stream.read_threads) == 10
    assert reactor_thread not in stream.read_threads
    producer.close()
    await deferLater(reactor, 0.05, lambda: None)
    assert stream.closed


@pytest_twisted.ensureDeferred
async def test_deliver_opens_and_reads_the_payload_off_the_reactor_thread(world: World) -> None:
    """IAClient opens, reads and closes the local payload only through its blocking runner."""
    runner = RecordingRunner()
    plan, path = world.artifact(1 << 20)
    result = await deliver(world.sink(run=runner, read_size=64 << 10), plan, path)
    assert result.delivered
    await deferLater(reactor, 0.05, lambda: None)  # the close runs after the answer
    names = [name for name, _ in runner.jobs]
    assert names[0] == "open_payload"
    assert names.count("read") == 16
    assert names[-1] == "close"
    assert threading.get_ident() not in {thread for _, thread in runner.jobs}
