"""The receiver's per-request cost of its access log, in isolation (bench/README.md).

    .venv/bin/python bench/access_log_cost.py [--requests N]

Drives ``MeteredSite.log`` (what Twisted calls for every answered request) with a finished tus
PATCH, with ``access_log`` on and off, through the production JSON observer writing to
``/dev/null``, and prints the CPU time per request of each and the difference.  The whole-server
view is ``./dev bench --scenarios small --access-log on|off``; on 2 shared cores its noise is
larger than this difference.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from twisted.logger import LogPublisher, globalLogPublisher
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from canner.daemon.site import MeteredSite
from canner.logs import json_observer
from canner.ops.metrics import RECEIVER, Metrics

OID = "0123456789abcdef" * 2


def per_request(access_log: bool, requests: int) -> float:
    """CPU seconds per ``MeteredSite.log`` call."""
    site = MeteredSite(Resource(), object(), Metrics(RECEIVER, ["bench"]), access_log)  # type: ignore[arg-type]
    # DummyRequest lacks the attributes a served request has: they are set here by hand.
    request: Any = DummyRequest([b"files", OID.encode()])
    request.method = b"PATCH"
    request.uri = request.path = b"/files/" + OID.encode()
    request.requestHeaders.setRawHeaders(b"Upload-Offset", [b"0"])
    request.responseHeaders.setRawHeaders(b"Upload-Offset", [b"65536"])
    request.code = 204
    request.sentLength = 0
    start = time.process_time()
    for _ in range(requests):
        site.log(request)
    return (time.process_time() - start) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    with open("/dev/null", "w", encoding="utf-8") as sink:
        publisher = LogPublisher(json_observer(sink))
        globalLogPublisher.addObserver(publisher)
        try:
            per_request(True, 1000)  # warm up
            off = min(per_request(False, args.requests) for _ in range(3))
            on = min(per_request(True, args.requests) for _ in range(3))
        finally:
            globalLogPublisher.removeObserver(publisher)
    print(f"requests per run      {args.requests}")
    print(f"access_log = false    {off * 1e6:8.1f} us CPU per request (metrics only)")
    print(f"access_log = true     {on * 1e6:8.1f} us CPU per request (metrics + one JSON line)")
    print(f"access log cost       {(on - off) * 1e6:8.1f} us CPU per request")


if __name__ == "__main__":
    main()
