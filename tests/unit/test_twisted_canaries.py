"""Canaries for what the receiver's channel relies on in twisted.web beyond its documented API.

Two private names remain: ``HTTPChannel._respondToBadRequestAndDisconnect``, where Twisted
answers malformed framing with a bare 400 (no ``Tus-Resumable``); ``ReceiverChannel`` overrides
it; and ``SSL4ServerEndpoint._sslContextFactory``, the TLS context a receiver node's worker puts
on the ``ssl:`` socket it adopts.  The rest are public methods whose order of calls the channel
depends on.  Each test fails with a message naming what changed, so a Twisted upgrade that
breaks the seam says where.
``pyproject.toml`` bounds Twisted above the newest release these ran against.
"""

from __future__ import annotations

from twisted.internet.testing import StringTransport
from twisted.web.http import HTTPChannel, Request
from twisted.web.resource import Resource
from twisted.web.server import Site


def _channel(request_factory: type[Request] = Request) -> tuple[HTTPChannel, StringTransport]:
    channel = HTTPChannel()
    channel.factory = Site(Resource())
    channel.requestFactory = request_factory  # as Site.buildProtocol sets it
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport


def test_twisted_answers_malformed_framing_through_respond_to_bad_request() -> None:
    """A bad Content-Length still reaches HTTPChannel._respondToBadRequestAndDisconnect, the
    one private method ReceiverChannel overrides."""
    calls: list[str] = []

    class Watched(HTTPChannel):
        def _respondToBadRequestAndDisconnect(self) -> None:
            calls.append("called")
            super()._respondToBadRequestAndDisconnect()

    assert hasattr(HTTPChannel, "_respondToBadRequestAndDisconnect"), (
        "Twisted removed HTTPChannel._respondToBadRequestAndDisconnect: ReceiverChannel's"
        " override no longer words malformed-request answers (canner/web/channel.py)"
    )
    channel = Watched()
    channel.factory = Site(Resource())
    channel.makeConnection(StringTransport())
    channel.dataReceived(b"PATCH /files/x HTTP/1.1\r\nContent-Length: +10\r\n\r\n")
    assert calls == ["called"], (
        "Twisted no longer answers a malformed Content-Length through"
        " _respondToBadRequestAndDisconnect: see ReceiverChannel in canner/web/channel.py"
    )


def test_the_request_line_comes_to_line_received_first() -> None:
    """HTTPChannel.lineReceived sees the request line as the first non-empty line of a head,
    which is where ReceiverChannel keeps it (twisted.web hands it to the Request only after
    the body)."""
    lines: list[bytes] = []

    class Watched(HTTPChannel):
        def lineReceived(self, line: bytes) -> None:
            lines.append(line)
            super().lineReceived(line)

    channel = Watched()
    channel.factory = Site(Resource())
    channel.makeConnection(StringTransport())
    channel.dataReceived(b"\r\nPOST /files/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n")
    assert [line for line in lines if line][:2] == [b"POST /files/ HTTP/1.1", b"Host: x"], lines


def test_all_headers_received_calls_got_length_before_handling_expect() -> None:
    """HTTPChannel.allHeadersReceived routes the body (Request.gotLength) and only then looks
    at Expect, and sends no 100 Continue when the header is gone: ReceiverChannel takes the
    expectation away before calling it and answers 100 Continue itself once a body is
    admitted."""
    seen: list[list[bytes] | None] = []

    class Watched(Request):
        def gotLength(self, length: int | None) -> None:
            seen.append(self.requestHeaders.getRawHeaders(b"expect"))
            super().gotLength(length)

    channel, transport = _channel(Watched)
    head = b"PATCH /files/x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n"
    channel.dataReceived(head + b"\r\n")
    assert seen == [[b"100-continue"]], "gotLength no longer runs before the Expect handling"
    assert transport.value() == b"HTTP/1.1 100 Continue\r\n\r\n"

    class Quiet(HTTPChannel):
        def allHeadersReceived(self) -> None:
            self.requests[-1].requestHeaders.removeHeader(b"expect")
            super().allHeadersReceived()

    quiet = Quiet()
    quiet.factory = Site(Resource())
    quiet_transport = StringTransport()
    quiet.makeConnection(quiet_transport)
    quiet.dataReceived(head + b"\r\n")
    assert quiet_transport.value() == b"", (
        "Twisted sends 100 Continue though the Expect header was removed in allHeadersReceived:"
        " ReceiverChannel would send it before admission (canner/web/channel.py)"
    )


def test_an_ssl_endpoint_keeps_its_context_factory_where_a_node_worker_reads_it() -> None:
    """A receiver node's worker serves an ``ssl:`` listener's adopted socket with the context of
    the endpoint the description parses to (``canner.daemon.worker.served``): Twisted's
    ``SSL4ServerEndpoint._sslContextFactory``, the second private name relied on."""
    from twisted.internet.endpoints import SSL4ServerEndpoint

    context = object()
    endpoint = SSL4ServerEndpoint(None, 0, context)
    assert getattr(endpoint, "_sslContextFactory", None) is context, (
        "SSL4ServerEndpoint no longer keeps _sslContextFactory: canner.daemon.worker.served"
        " must find an ssl: listener's context another way"
    )
