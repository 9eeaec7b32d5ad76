"""The fake Internet Archive itself, over a real loopback socket: protocol, lag, faults, admin."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted  # type: ignore[import-untyped]
from treq.client import HTTPClient
from twisted.internet import reactor as _reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.web.client import (
    Agent,
    HTTPConnectionPool,
    RequestGenerationFailed,
    RequestTransmissionFailed,
    ResponseFailed,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IBodyProducer
from zope.interface import implementer

from tests.fake_ia import FakeIA, Fault, url_of

reactor: Any = _reactor

AUTH = "LOW fake-access:fake-secret"
ITEM = "fake-item-0001"
BODY = b"hello, archive\n" * 1000
BODY_MD5 = hashlib.md5(BODY).hexdigest()


@attrs.define
class Served:
    fake: FakeIA
    url: str
    clock: Clock
    http: HTTPClient

    async def put(
        self,
        name: str = "a.warc",
        body: Any = BODY,
        identifier: str = ITEM,
        headers: dict[str, str] | None = None,
        auth: str | None = AUTH,
        md5: str | None = BODY_MD5,
        auto: bool = True,
    ) -> tuple[int, dict[str, str], bytes]:
        h: dict[str, str] = {}
        if auth is not None:
            h["authorization"] = auth
        if md5 is not None:
            h["content-md5"] = md5
        if auto:
            h["x-archive-auto-make-bucket"] = "1"
        h.update(headers or {})
        response = await self.http.put(
            f"{self.url}/{identifier}/{name}",
            data=body,
            headers=Headers({k.encode(): [v.encode()] for k, v in h.items()}),
            allow_redirects=False,
        )
        content = await response.content()
        headers_out = {
            k.decode().lower(): v[0].decode() for k, v in response.headers.getAllRawHeaders()
        }
        return response.code, headers_out, content

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await self.http.get(self.url + path)
        return response.code, await response.content()

    async def metadata(self, identifier: str = ITEM) -> Any:
        code, body = await self.get(f"/metadata/{identifier}")
        assert code == 200
        return json.loads(body)

    async def admin(self, method: str, what: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        response = await self.http.request(method, f"{self.url}/_fake/{what}", data=data)
        return response.code, json.loads(await response.content())


@pytest_twisted.async_yield_fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    clock = Clock()
    fake = FakeIA(tmp_path / "ia", clock, metadata_lag=30.0)
    port = fake.listen(reactor)
    http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
    yield Served(fake, url_of(port), clock, http)
    fake.drop_connections()
    stopped = port.stopListening()
    if stopped is not None:
        await stopped
    await deferLater(reactor, 0.01, lambda: None)
    assert fake.errors == []


def s3_code(body: bytes) -> str:
    return body.split(b"<Code>")[1].split(b"</Code>")[0].decode()


@pytest_twisted.ensureDeferred
async def test_put_shows_in_metadata_only_after_the_lag(served: Served) -> None:
    """A stored file appears in GET /metadata with name, size, md5 and sha1 after the lag."""
    status, _, body = await served.put("dir/a b.warc")
    assert (status, body) == (200, b"")
    assert await served.metadata() == {}
    served.clock.advance(30)
    doc = await served.metadata()
    names = [f["name"] for f in doc["files"]]
    assert names == [f"{ITEM}_meta.xml", f"{ITEM}_files.xml", "dir/a b.warc"]
    entry = doc["files"][2]
    assert entry["size"] == str(len(BODY))
    assert entry["md5"] == BODY_MD5
    assert entry["sha1"] == hashlib.sha1(BODY).hexdigest()
    assert doc["metadata"]["identifier"] == ITEM
    (stored,) = served.fake.objects()
    assert Path(stored["path"]).read_bytes() == BODY
    assert (stored["puts"], stored["stores"], stored["visible"]) == (1, 1, True)


@pytest_twisted.ensureDeferred
async def test_overwrite_shows_the_old_version_until_the_lag(served: Served) -> None:
    """IA keeps showing the previous file until its archive task for the new one ran."""
    await served.put()
    served.clock.advance(30)
    other = b"other bytes"
    status, _, _ = await served.put(body=other, md5=hashlib.md5(other).hexdigest())
    assert status == 200
    assert (await served.metadata())["files"][2]["md5"] == BODY_MD5
    served.clock.advance(30)
    assert (await served.metadata())["files"][2]["md5"] == hashlib.md5(other).hexdigest()


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    ("auth", "code"),
    [
        (None, "AccessDenied"),
        ("Bearer x", "InvalidAccessKeyId"),
        ("LOW other:fake-secret", "InvalidAccessKeyId"),
        ("LOW fake-access:wrong", "SignatureDoesNotMatch"),
    ],
)
async def test_put_checks_low_auth(served: Served, auth: str | None, code: str) -> None:
    """Anything but the configured LOW key pair is refused with 403 and stores nothing."""
    status, _, body = await served.put(auth=auth)
    assert status == 403
    assert s3_code(body) == code
    assert served.fake.objects() == []


@pytest_twisted.ensureDeferred
async def test_new_item_needs_auto_make_bucket(served: Served) -> None:
    """Without x-archive-auto-make-bucket a PUT into a missing item is 404 NoSuchBucket."""
    status, _, body = await served.put(auto=False)
    assert (status, s3_code(body)) == (404, "NoSuchBucket")
    status, _, _ = await served.put(headers={"x-amz-auto-make-bucket": "1"}, auto=False)
    assert status == 200
    status, _, _ = await served.put("second", auto=False)
    assert status == 200


@pytest_twisted.ensureDeferred
async def test_content_md5_is_verified(served: Served) -> None:
    """A wrong Content-MD5 is 400 BadDigest, a malformed one 400 InvalidDigest; nothing stored."""
    status, _, body = await served.put(md5="0" * 32)
    assert (status, s3_code(body)) == (400, "BadDigest")
    status, _, body = await served.put(md5="base64ish==")
    assert (status, s3_code(body)) == (400, "InvalidDigest")
    assert served.fake.objects() == []
    assert list((served.fake.root / "incoming").iterdir()) == []


@implementer(IBodyProducer)
class UnknownLengthProducer:
    length = UNKNOWN_LENGTH

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(b"chunked body")
        return Deferred.fromCoroutine(_done())

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


async def _done() -> None:
    return None


@pytest_twisted.ensureDeferred
async def test_chunked_body_is_refused(served: Served) -> None:
    """IA needs Content-Length: a chunked PUT gets 411."""
    status, _, body = await served.put(body=UnknownLengthProducer(), md5=None)
    assert (status, s3_code(body)) == (411, "MissingContentLength")


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    ("identifier", "name", "code"),
    [
        ("ab", "a", "InvalidBucketName"),
        ("bad%20item", "a", "InvalidBucketName"),
        (ITEM, "history/a", "InvalidURI"),
        (ITEM, "a/%2E%2E/b", "InvalidURI"),
    ],
)
async def test_bad_destinations_are_refused(
    served: Served, identifier: str, name: str, code: str
) -> None:
    """Invalid identifiers and remote names get IA's 400 codes."""
    status, _, body = await served.put(name, identifier=identifier)
    assert (status, s3_code(body)) == (400, code)


@pytest_twisted.ensureDeferred
async def test_metadata_headers_apply_when_the_item_is_created(served: Served) -> None:
    """x-archive-meta headers (indexed, uri()-encoded, -- for _) set item metadata once."""
    headers = {
        "x-archive-meta02-collection": "second",
        "x-archive-meta01-collection": "first",
        "x-archive-meta-title": "uri(Caf%C3%A9%20x)",
        "x-archive-meta-external--id": "E1",
        "x-archive-filemeta-canner-object-id": "oid",
    }
    assert (await served.put(headers=headers))[0] == 200
    assert (await served.put("b", headers={"x-archive-meta-title": "changed"}))[0] == 200
    served.clock.advance(30)
    doc = await served.metadata()
    assert doc["metadata"] == {
        "identifier": ITEM,
        "collection": ["first", "second"],
        "title": "Café x",
        "external_id": "E1",
    }
    assert doc["files"][2]["canner-object-id"] == "oid"
    status, _, body = await served.put(
        "c", identifier="fake-item-0002", headers={"x-archive-meta-xmlish": "x"}
    )
    assert (status, s3_code(body)) == (400, "InvalidArgument")


@pytest_twisted.ensureDeferred
async def test_faults_apply_to_the_next_n_requests(served: Served) -> None:
    """A fault with count N hits exactly the next N PUTs, then IA behaves again."""
    served.fake.add_fault("slowdown", count=2)
    results = [await served.put() for _ in range(3)]
    assert [r[0] for r in results] == [503, 503, 200]
    assert s3_code(results[0][2]) == "SlowDown"
    assert served.fake.faults == []
    (stored,) = served.fake.objects()
    assert (stored["puts"], stored["stores"]) == (3, 1)


@pytest_twisted.ensureDeferred
@pytest.mark.parametrize(
    ("kind", "status", "marker"),
    [
        ("error500", 500, b"Internal Server Error"),
        ("forbidden", 403, b"<Code>AccessDenied</Code>"),
        ("spam", 503, b"appears to be spam"),
        ("redirect", 307, b"<Code>TemporaryRedirect</Code>"),
    ],
)
async def test_answer_faults(served: Served, kind: str, status: int, marker: bytes) -> None:
    """Error faults answer after the body with IA's status and body, and store nothing."""
    served.fake.add_fault(kind)
    code, headers, body = await served.put()
    assert code == status
    assert marker in body
    if kind == "redirect":
        assert headers["location"] == f"{served.url}/{ITEM}/a.warc"
    assert served.fake.objects() == []


@pytest_twisted.ensureDeferred
async def test_reset_mid_body_stores_nothing(served: Served) -> None:
    """A reset fault drops the connection after some body bytes; nothing is stored."""
    served.fake.add_fault("reset", after_bytes=100_000)
    big = os.urandom(4 << 20)
    with pytest.raises((RequestTransmissionFailed, ResponseFailed)):
        await served.put(body=big, md5=hashlib.md5(big).hexdigest())
    assert served.fake.objects() == []
    (entry,) = [r for r in served.fake.requests if r.get("fault") == "reset"]
    assert entry["received"] >= 100_000
    assert list((served.fake.root / "incoming").iterdir()) == []


@pytest_twisted.ensureDeferred
async def test_lost_response_stores_then_hangs_up(served: Served) -> None:
    """lost_response keeps the file but the client never sees an answer."""
    served.fake.add_fault("lost_response")
    with pytest.raises(ResponseFailed):
        await served.put()
    (stored,) = served.fake.objects()
    assert stored["md5"] == BODY_MD5


@pytest_twisted.ensureDeferred
async def test_vanish_answers_200_but_never_lists_or_serves(served: Served) -> None:
    """vanish: IA's 200, then the file is lost; a later PUT stores it normally."""
    served.fake.add_fault("vanish")
    assert (await served.put())[0] == 200
    served.clock.advance(30)
    assert served.fake.objects() == [] and "files" not in await served.metadata()
    assert (await served.get(f"/download/{ITEM}/a.warc"))[0] == 404
    assert [r["fault"] for r in served.fake.requests if r.get("fault")] == ["vanish"]
    assert (await served.put())[0] == 200
    served.clock.advance(30)
    (obj,) = served.fake.objects()
    assert (obj["md5"], obj["puts"], obj["stores"]) == (BODY_MD5, 2, 1)


async def _ranged(served: Served, path: str, byte_range: str) -> Any:
    response = await served.http.get(
        served.url + path, headers={"range": byte_range}, allow_redirects=False
    )
    return response, await response.content()


@pytest_twisted.ensureDeferred
async def test_download_redirects_to_a_datanode_that_serves_ranges(served: Served) -> None:
    """/download/ answers 302 to the datanode URL, which honours single byte ranges."""
    await served.put()
    response, _ = await _ranged(served, f"/download/{ITEM}/a.warc", "bytes=0-0")
    assert response.code == 302
    [location] = response.headers.getRawHeaders("location")
    datanode = location.removeprefix(served.url)
    assert datanode == f"/datanode/items/{ITEM}/a.warc"
    size = len(BODY)
    for header, first, last in [
        ("bytes=0-9", 0, 9),
        (f"bytes=5-{size + 100}", 5, size - 1),
        ("bytes=3-", 3, size - 1),
        ("bytes=-4", size - 4, size - 1),
    ]:
        response, body = await _ranged(served, datanode, header)
        assert response.code == 206, header
        assert response.headers.getRawHeaders("content-range") == [f"bytes {first}-{last}/{size}"]
        assert body == BODY[first : last + 1]
    response, _ = await _ranged(served, datanode, f"bytes={size}-")
    assert response.code == 416
    assert (await served.get(datanode)) == (200, BODY)


@pytest_twisted.ensureDeferred
async def test_altered_download_keeps_the_metadata(served: Served) -> None:
    """altered serves other bytes of the same length; the metadata still shows the MD5."""
    await served.put()
    served.clock.advance(30)
    served.fake.add_fault("altered", count=2)
    response, body = await _ranged(served, f"/datanode/items/{ITEM}/a.warc", "bytes=0-9")
    assert response.code == 206 and len(body) == 10 and body != BODY[:10]
    (entry,) = [f for f in (await served.metadata())["files"] if f["name"] == "a.warc"]
    assert entry["md5"] == BODY_MD5
    assert (await served.get(f"/download/{ITEM}/a.warc"))[1] != BODY
    assert (await served.get(f"/download/{ITEM}/a.warc"))[1] == BODY
    served.fake.add_fault("error500", target="download")
    assert (await served.get(f"/download/{ITEM}/a.warc"))[0] == 500


@pytest_twisted.ensureDeferred
async def test_stall_stops_reading_and_never_answers(served: Served) -> None:
    """A stalled transfer takes some bytes, then neither reads nor answers."""
    served.fake.add_fault("stall", after_bytes=1 << 20)
    big = os.urandom(32 << 20)
    d = Deferred.fromCoroutine(served.put(body=big, md5=None))
    await deferLater(reactor, 0.5, lambda: None)
    assert not d.called
    d.cancel()
    with pytest.raises(RequestGenerationFailed):
        await d
    (entry,) = [r for r in served.fake.requests if r.get("fault") == "stall"]
    assert (1 << 20) <= entry["received"] < len(big)
    assert served.fake.objects() == []


@pytest_twisted.ensureDeferred
async def test_check_limit(served: Served) -> None:
    """check_limit answers JSON with over_limit, and can be made to say 1 or fail."""
    path = f"/?check_limit=1&accesskey=fake-access&bucket={ITEM}"
    code, body = await served.get(path)
    assert code == 200 and json.loads(body)["over_limit"] == 0
    served.fake.add_fault("over_limit")
    assert json.loads((await served.get(path))[1])["over_limit"] == 1
    served.fake.add_fault("error500", target="check_limit")
    assert (await served.get(path))[0] == 500
    served.fake.add_fault("garbage", target="check_limit")
    code, body = await served.get(path)
    assert code == 200 and body.startswith(b"<html>")


@pytest_twisted.ensureDeferred
async def test_metadata_faults(served: Served) -> None:
    """The metadata API can fail with 500, 503, non-JSON, or report a dark item."""
    await served.put()
    served.clock.advance(30)
    served.fake.add_fault("error500", target="metadata")
    assert (await served.get(f"/metadata/{ITEM}"))[0] == 500
    served.fake.add_fault("slowdown", target="metadata")
    assert (await served.get(f"/metadata/{ITEM}"))[0] == 503
    served.fake.add_fault("garbage")
    assert (await served.get(f"/metadata/{ITEM}"))[1].startswith(b"<html>")
    served.fake.add_fault("dark")
    assert (await served.metadata())["is_dark"] is True
    assert "is_dark" not in await served.metadata()


@pytest_twisted.ensureDeferred
async def test_admin_endpoints(served: Served) -> None:
    """Tests in another process set faults and read objects over HTTP."""
    code, faults = await served.admin("POST", "faults", [{"kind": "slowdown", "count": 2}])
    assert code == 200 and faults[0]["kind"] == "slowdown" and faults[0]["count"] == 2
    assert (await served.admin("GET", "faults"))[1][0]["target"] == "put"
    assert (await served.admin("DELETE", "faults"))[1] == []
    assert (await served.admin("POST", "faults", {"kind": "nonsense"}))[0] == 400
    assert (await served.admin("POST", "settings", {"metadata_lag": 0}))[1] == {"metadata_lag": 0.0}
    await served.put()
    (obj,) = (await served.admin("GET", "objects"))[1]
    assert (obj["name"], obj["size"], obj["md5"], obj["puts"]) == ("a.warc", len(BODY), BODY_MD5, 1)
    requests = (await served.admin("GET", "requests"))[1]
    (put,) = [r for r in requests if r["method"] == "PUT"]
    assert put["auth"] == "LOW fake-access"
    assert all("fake-secret" not in json.dumps(r) for r in requests)
    code, body = await served.get(f"/download/{ITEM}/a.warc")
    assert (code, body) == (200, BODY)


def test_fault_spec_parsing() -> None:
    """--fault KIND[:COUNT[:TARGET]] picks a sensible default target."""
    assert Fault.from_arg("slowdown:3") == Fault("slowdown", 3, "put")
    assert Fault.from_arg("over_limit").target == "check_limit"
    assert Fault.from_arg("error500:1:metadata").target == "metadata"
    with pytest.raises(ValueError):
        Fault.from_arg("reset:1:metadata")


@pytest_twisted.ensureDeferred
async def test_state_survives_a_restart(served: Served, tmp_path: Path) -> None:
    """A new fake on the same directory knows what the old one stored."""
    await served.put()
    again = FakeIA(served.fake.root, Clock())
    (obj,) = again.objects()
    assert (obj["name"], obj["md5"], obj["puts"]) == ("a.warc", BODY_MD5, 1)


def test_runs_as_a_process_and_streams_big_bodies(tmp_path: Path) -> None:
    """As a separate process it writes its port, takes command-line faults, and streams a
    256 MiB body to disk with flat memory."""
    port_file = tmp_path / "port"
    fake = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve().parents[1] / "fake_ia.py"),
            "--port=0",
            f"--dir={tmp_path / 'ia'}",
            f"--port-file={port_file}",
            "--fault=slowdown:1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert fake.poll() is None, fake.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        port = int(port_file.read_text())
        size = 256 << 20
        block = os.urandom(1 << 20)
        source = tmp_path / "big"
        digest = hashlib.md5()
        with open(source, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
                digest.update(block)

        def put(body: Any, length: int, md5: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, blocksize=1 << 20)
            try:
                conn.request(
                    "PUT",
                    f"/{ITEM}/big.bin",
                    body=body,
                    headers={
                        "authorization": AUTH,
                        "content-md5": md5,
                        "content-length": str(length),
                        "x-archive-auto-make-bucket": "1",
                    },
                )
                response = conn.getresponse()
                response.read()
                return response.status
            finally:
                conn.close()

        assert put(b"tiny", 4, hashlib.md5(b"tiny").hexdigest()) == 503
        with open(source, "rb") as body:
            assert put(body, size, digest.hexdigest()) == 200
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/_fake/objects")
        (obj,) = json.loads(conn.getresponse().read())
        conn.close()
        assert (obj["size"], obj["md5"], obj["puts"]) == (size, digest.hexdigest(), 2)
        status = Path(f"/proc/{fake.pid}/status").read_text()
        peak_kib = int(status.split("VmHWM:")[1].split()[0])
        assert peak_kib < 150 * 1024, f"fake IA peak RSS {peak_kib} KiB"
    finally:
        fake.terminate()
        fake.communicate(timeout=10)
