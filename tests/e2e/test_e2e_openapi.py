"""``docs/hq-api.yaml`` (OpenAPI 3.1) against live answers: every endpoint of the receiver, its
successes and its refusals, validated with openapi-core (status, headers, body schema)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from deliver_support import Env, envs, wait_for
from e2e_support import OFFSET_TYPE, TUS_VERSION, blake3_hex, upload_metadata
from hq_support import (
    TOKEN,
    canner,
    check_openapi,
    ledger_tables,
    release,
    wait_purged,
)

pytestmark = pytest.mark.e2e

env_factory = pytest.fixture(name="env_factory")(envs)


def test_every_endpoint_answers_as_documented(env_factory: Callable[..., Env]) -> None:
    """tus, the seesaw PUT target, receipts, objects (indexed, unknown, archived), the batch
    and by-origin queries, releases (200, 400, 401), health, readiness, the status page and
    metrics all match the document."""
    env = env_factory(extra=ledger_tables, retention="1s", metadata_lag=0.2)
    rcv = env.receiver
    tus = {"Tus-Resumable": TUS_VERSION}
    seen: set[tuple[str, str, int]] = set()

    def check(method: str, path: str, expect: int, **kwargs: object) -> dict[str, object] | None:
        r = rcv.request(method, path, **kwargs)  # type: ignore[arg-type]
        assert r.status_code == expect, (method, path, r.status_code, r.text)
        check_openapi(r)
        seen.add((method, path.split("?")[0], r.status_code))
        return r.json() if r.headers.get("Content-Type") == "application/json" else None

    check("OPTIONS", "/files/", 204)
    data = b"openapi payload\n" * 64
    meta = upload_metadata(blake3_hex(data), filename="o.warc")
    created = rcv.request(
        "POST",
        "/files/",
        headers={**tus, "Upload-Length": str(len(data)), "Upload-Metadata": meta},
    )
    assert created.status_code == 201
    check_openapi(created)
    oid = rcv.object_id(created)
    check("HEAD", f"/files/{oid}", 200, headers=tus)
    check(
        "PATCH",
        f"/files/{oid}",
        409,
        headers={**tus, "Upload-Offset": "5", "Content-Type": OFFSET_TYPE},
        data=b"x",
    )
    check(
        "PATCH",
        f"/files/{oid}",
        204,
        headers={**tus, "Upload-Offset": "0", "Content-Type": OFFSET_TYPE},
        data=data,
    )
    check("HEAD", f"/files/{'0' * 32}", 404, headers=tus)
    check("POST", "/files/", 412, headers={"Tus-Resumable": "0.2", "Upload-Length": "1"})
    check(
        "POST",
        "/files/",
        400,
        headers={**tus, "Upload-Length": "1", "Upload-Metadata": "project eA=="},
    )
    # Archive Team's PUT target: accepted, a copy of it, a bad name; then where it is.
    seesaw, put_path = b"seesaw payload\n" * 64, "/seesaw/example/alice/o.warc"
    octets = {"Content-Type": "application/octet-stream"}
    put = check("PUT", put_path, 201, data=seesaw, headers=octets)
    assert put is not None
    check("PUT", put_path, 200, data=seesaw, headers=octets)
    check("PUT", "/seesaw/example/alice/a%01b", 400, data=seesaw, headers=octets)
    check("PUT", "/seesaw/nope/alice/o.warc", 404, data=seesaw, headers=octets)
    by_origin = "/api/v1/objects:by-origin?project=example&filename=o.warc"
    found = wait_for(
        lambda: (check("GET", by_origin, 200) or {}).get("results"), 10, "the PUT's index row"
    )
    assert {d["object_id"] for d in found} == {oid, put["object_id"]}
    check("GET", by_origin + "&downloader=alice", 200)
    check("GET", "/api/v1/objects:by-origin?project=example", 400)
    check("GET", f"/api/v1/receipts/{oid}", 200)
    check("GET", f"/api/v1/receipts/{'0' * 32}", 404)
    check("GET", f"/api/v1/objects/{oid}", 200)
    check("GET", f"/api/v1/objects/{'0' * 32}", 404)
    query = {"object_ids": [oid, "0" * 32]}
    check("POST", "/api/v1/objects:query", 200, data=json.dumps(query))
    check("POST", "/api/v1/objects:query", 400, data="{}")
    # Releases: refused before verification, 401 without a token, 400 for a bad body.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    check("POST", "/api/v1/releases", 200, data=json.dumps([f"receipt:{oid}"]), headers=auth)
    check("POST", "/api/v1/releases", 401, data=json.dumps([f"receipt:{oid}"]))
    check("POST", "/api/v1/releases", 400, data="[]", headers=auth)
    wait_purged(env, [oid])
    doc = check(
        "POST", "/api/v1/releases", 200, data=json.dumps({"ids": [f"receipt:{oid}"]}), headers=auth
    )
    assert doc is not None and doc["results"][0]["status"] == "released"  # type: ignore[index]
    check("GET", f"/api/v1/objects/{oid}", 200)
    out = canner(env, "ledger", "flush", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    archived = check("GET", f"/api/v1/objects/{oid}", 200)
    assert archived is not None and archived["archived"] is not None
    check("POST", "/api/v1/objects:query", 200, data=json.dumps({"object_ids": [oid]}))
    assert release(env, [f"receipt:{oid}"]).json()["results"][0]["status"] == "already_released"
    r = rcv.request("GET", "/api/v1/releases")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    assert "POST" in r.headers["Allow"]
    r = rcv.request("GET", "/api/v1/objectsx")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    check("GET", "/healthz", 200)
    check("GET", "/readyz", 200)
    check("GET", "/", 200)
    check("GET", "/metrics", 200)
    assert len(seen) >= 20
