"""HQ's API end to end: status queries and authenticated releases against real daemons.

A real receiver and canner-deliver deliver to the fake IA; HQ's requests go over HTTP with a
bearer token whose SHA-256 is in the ``[hq] tokens`` file.  Every check is what HQ or an operator
sees: the JSON answers, the facts journal (``journal/``) and ``canner deliveries``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from deliver_support import Env, envs, remove_index
from hq_support import (
    OTHER_TOKEN,
    TOKEN,
    canner,
    hq_tables,
    release,
    release_records,
    status,
    tokens_line,
    wait_verified,
)

pytestmark = pytest.mark.e2e

env_factory = pytest.fixture(name="env_factory")(envs)


@pytest.fixture
def hq_env(env_factory: Callable[..., Env]) -> Iterator[Env]:
    yield env_factory(extra=hq_tables, metadata_lag=1.5, retention="1h")


def test_status_query_shows_three_independent_facts(hq_env: Env) -> None:
    """GET /api/v1/objects/{id} answers the receipt, the project, delivery, payload and HQ
    parts; an unknown or malformed id is a JSON 404."""
    env = hq_env
    data = b"status query payload\n" * 100
    oid, _receipt_header = env.receiver.upload_all(data, filename="a.warc.gz")
    r = status(env, oid)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "application/json"
    doc = r.json()
    receipt = json.loads(env.receiver.request("GET", f"/api/v1/receipts/{oid}").content)
    assert {k: doc[k] for k in receipt} == receipt
    assert doc["project"] == "example" and doc["filename"] == "a.warc.gz"
    assert doc["payload"] == {"present": True, "purged_at": None}
    assert doc["hq"] == {"released_at": None}
    assert doc["archived"] is None
    wait_verified(env, [oid])
    doc = status(env, oid).json()
    row = env.row(oid)
    assert doc["delivery"]["state"] == "delivered" and doc["delivery"]["verified"] is True
    assert doc["delivery"]["identifier"] == row["remote_identifier"]
    assert doc["delivery"]["remote_name"] == "a.warc.gz"
    assert doc["delivery"]["verified_at"] == row["verified_at"]
    assert doc["delivery"]["attempts"] == 1
    for bad in ("0" * 32, "not-an-id", "A" * 32):
        r = status(env, bad)
        assert r.status_code == 404
        assert r.json()["error"] == "not_found"
    # The batch form: one result per id, in order, unknown ones included.
    r = env.receiver.request(
        "POST",
        "/api/v1/objects:query",
        data=json.dumps({"object_ids": [oid, "0" * 32, oid]}),
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["found"] for x in results] == [True, False, True]
    assert results[0]["object"] == doc and results[1]["object"] is None
    too_many = json.dumps({"object_ids": ["0" * 32] * 1001})
    assert env.receiver.request("POST", "/api/v1/objects:query", data=too_many).status_code == 400


def test_release_before_verification_is_refused_then_succeeds(hq_env: Env) -> None:
    """A release before the remote copy is verified answers not_delivered and changes nothing;
    once verified it answers released, and a repeat answers already_released with the same
    released_at; the journal and the index agree."""
    env = hq_env
    oid = env.upload(b"release me later\n" * 50)
    r = release(env, [f"receipt:{oid}"])
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [{"id": f"receipt:{oid}", "status": "not_delivered"}]
    assert release_records(env, oid) == []
    wait_verified(env, [oid])
    first = release(env, [f"receipt:{oid}", "receipt:" + "0" * 32, f"receipt:{oid}", "x"])
    assert first.status_code == 200
    results = first.json()["results"]
    assert results[0]["status"] == "released"
    released_at = results[0]["released_at"]
    assert results[1] == {"id": "receipt:" + "0" * 32, "status": "unknown"}
    assert results[2] == {
        "id": f"receipt:{oid}",
        "status": "already_released",
        "released_at": released_at,
    }
    assert results[3] == {"id": "x", "status": "unknown"}
    again = release(env, [f"receipt:{oid}"], token=OTHER_TOKEN).json()["results"]
    assert again == [
        {"id": f"receipt:{oid}", "status": "already_released", "released_at": released_at}
    ]
    # One journal record, from the first release only.
    [record] = release_records(env, oid)
    assert record["released_at"] == released_at and record["client"] == "hq"
    assert env.row(oid)["released_at"] == released_at
    assert status(env, oid).json()["hq"] == {"released_at": released_at}
    # The delivery part is untouched by the release.
    assert env.row(oid)["state"] == "delivered"


def test_bad_tokens_are_401_and_change_nothing(hq_env: Env) -> None:
    """Wrong token, missing token, and the token of a client removed from the tokens file: 401
    with a JSON error, no journal record, no released_at; the failures are logged with the client
    address."""
    env = hq_env
    oid = env.upload(b"never released\n" * 40)
    wait_verified(env, [oid])
    for token in (None, "wrong-token", TOKEN + "x", ""):
        r = release(env, [f"receipt:{oid}"], token=token)
        assert r.status_code == 401, (token, r.text)
        assert r.json()["error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    r = env.receiver.request(
        "POST",
        "/api/v1/releases",
        data=json.dumps([f"receipt:{oid}"]),
        headers={"Authorization": f"Basic {TOKEN}"},
    )
    assert r.status_code == 401
    # Remove client hq2: its token stops working without a restart.
    tokens = env.receiver.root / "hq-tokens"
    tokens.write_text(tokens_line("hq", TOKEN))
    r = release(env, [f"receipt:{oid}"], token=OTHER_TOKEN)
    assert r.status_code == 401
    assert release_records(env, oid) == []
    assert env.row(oid)["released_at"] is None
    log = env.receiver.log_text()
    assert "release refused from 127.0.0.1" in log
    # Bad bodies from an authenticated client are 400.
    for body in ("{", "[]", json.dumps(["a"] * 1001), json.dumps([1])):
        r = env.receiver.request(
            "POST",
            "/api/v1/releases",
            data=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 400, body
        assert r.json()["error"] == "bad_request"


def test_operator_release_and_rebuilt_index_keeps_released_at(hq_env: Env) -> None:
    """``canner release`` releases like HQ; after the index is deleted, rebuild-index brings
    released_at back from the facts journal."""
    env = hq_env
    a = env.upload(b"operator release a\n" * 30)
    b = env.upload(b"operator release b\n" * 30)
    out = canner(env, "release", a[:10])
    assert out.returncode == 1, out.stdout + out.stderr  # not verified yet
    assert json.loads(out.stdout) == {"id": f"receipt:{a}", "status": "not_delivered"}
    wait_verified(env, [a, b])
    out = canner(env, "release", a, f"receipt:{b}")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [x["status"] for x in lines] == ["released", "released"]
    times = {x["id"]: x["released_at"] for x in lines}
    hq_view = release(env, [f"receipt:{a}"]).json()["results"][0]
    assert hq_view == {
        "id": f"receipt:{a}",
        "status": "already_released",
        "released_at": times[f"receipt:{a}"],
    }
    env.deliver.stop()
    env.receiver.stop()
    remove_index(env.data_dir)
    out = canner(env, "rebuild-index")
    assert out.returncode == 0, out.stderr
    rows = env.rows()
    assert rows[a]["released_at"] == times[f"receipt:{a}"]
    assert rows[b]["released_at"] == times[f"receipt:{b}"]
