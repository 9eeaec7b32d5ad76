"""Machinery shared by the HQ end-to-end tests: ``[hq]`` and ``[ledger]`` config tables, HQ's
requests, and the ``canner`` command."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import requests
import zstandard
from deliver_support import (
    ACCESS,
    REPO,
    SECRET,
    Env,
    FakeIA,
    journal_records,
    make_checks_due_now,
    venv_bin,
    wait_for,
)

from canner.ledger import store as ledger_store

TOKEN = "hq-token-0123456789abcdef"
OTHER_TOKEN = "hq-token-of-the-second-client"
NODE = "testnode"


def tokens_line(name: str, token: str) -> str:
    return f"{name} sha256:{hashlib.sha256(token.encode()).hexdigest()}\n"


def hq_tables(fake: FakeIA, root: Path) -> str:
    """``[hq]`` with two clients (``hq`` and ``hq2``)."""
    tokens = root / "hq-tokens"
    root.mkdir(parents=True, exist_ok=True)
    tokens.write_text("# HQ clients\n" + tokens_line("hq", TOKEN) + tokens_line("hq2", OTHER_TOKEN))
    return f"[hq]\ntokens = {json.dumps(str(tokens))}\n"


def ledger_tables(fake: FakeIA, root: Path, delay: str = "0s") -> str:
    """``[hq]`` plus a daily ``[ledger]`` uploading to the fake IA."""
    keys = root / "ledger-keys"
    root.mkdir(parents=True, exist_ok=True)
    keys.write_text(f"{ACCESS}\n{SECRET}\n", encoding="utf-8")
    return hq_tables(fake, root) + "\n".join(
        [
            "[ledger]",
            'period = "day"',
            f"delay = {json.dumps(delay)}",
            f'node = "{NODE}"',
            f"credentials = {json.dumps(str(keys))}",
            'identifier = "canner-ledger-{node}-{period}"',
            f"s3_url = {json.dumps(fake.url)}",
            f"metadata_url = {json.dumps(fake.url)}",
            "[ledger.metadata]",
            'collection = ["test-ledgers"]',
            'title = ["canner ledger {node} {period}"]',
            "",
        ]
    )


def release(env: Env, ids: list[str], token: str | None = TOKEN) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return env.receiver.request("POST", "/api/v1/releases", data=json.dumps(ids), headers=headers)


def status(env: Env, object_id: str) -> requests.Response:
    return env.receiver.request("GET", f"/api/v1/objects/{object_id}")


def wait_verified(env: Env, ids: list[str], timeout: float = 60.0) -> None:
    def done() -> bool:
        make_checks_due_now(env.db)
        rows = env.rows()
        return all(o in rows and rows[o]["verified_at"] is not None for o in ids)

    wait_for(done, timeout, f"{ids} verified", 0.3, env.describe)


def wait_purged(env: Env, ids: list[str], timeout: float = 60.0) -> None:
    def done() -> bool:
        make_checks_due_now(env.db)
        rows = env.rows()
        return all(o in rows and rows[o]["purged_at"] is not None for o in ids)

    wait_for(done, timeout, f"{ids} purged", 0.3, env.describe)


def release_records(env: Env, object_id: str) -> list[dict[str, Any]]:
    """The object's release records in the facts journal, in order."""
    return journal_records(env.data_dir, object_id, "release")


def canner(env: Env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv_bin("canner"), *args, "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ledgers(env: Env) -> list[dict[str, Any]]:
    out = canner(env, "ledger")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def remote_lines(fake: FakeIA, identifier: str, name: str) -> list[bytes]:
    """The decompressed lines of a ledger as the fake IA stores it."""
    stored = fake.object(identifier, name)
    assert stored is not None, f"{identifier}/{name} is not at the fake IA"
    data = Path(stored["path"]).read_bytes()
    return zstandard.ZstdDecompressor().decompressobj().decompress(data).splitlines(keepends=True)


def local_lines(env: Env, name: str) -> list[bytes]:
    data = (env.data_dir / "ledger" / f"{name}.jsonl.zst").read_bytes()
    return zstandard.ZstdDecompressor().decompressobj().decompress(data).splitlines(keepends=True)


def fast_forward_ledgers(env: Env) -> None:
    """Test-only: every ledger step waiting for a retry is due now (as for deliveries)."""
    conn = sqlite3.connect(env.db, timeout=10, isolation_level=None)
    try:
        conn.execute("UPDATE ledgers SET next_attempt_at = 0 WHERE state != 'done'")
        # A ledger being sent waits on its outbound row: its retry or its next check.
        conn.execute(
            "UPDATE outbound SET next_attempt_at = 0, next_check_at = CASE WHEN"
            " next_check_at IS NOT NULL THEN 0 END WHERE kind = 'ledger'"
        )
    finally:
        conn.close()


def next_ledger_attempts(env: Env) -> list[float]:
    """Each ledger's next_attempt_at (``canner ledger`` does not show it)."""
    conn = sqlite3.connect(env.db, timeout=10, isolation_level=None)
    try:
        # The index's own reading: a ledger being sent waits on its outbound row.
        rows = ledger_store.ledgers(conn.cursor())
    finally:
        conn.close()
    return [float(r.next_attempt_at) for r in rows]


def age_ledger_uploads(env: Env, seconds: float) -> None:
    """Test-only: every uploaded ledger was uploaded ``seconds`` earlier, and its next step is
    due now (so a timeout counted from the upload has passed)."""
    conn = sqlite3.connect(env.db, timeout=10, isolation_level=None)
    try:
        conn.execute(
            "UPDATE outbound SET delivered_at = delivered_at - ?, next_check_at = 0"
            " WHERE kind = 'ledger' AND state = 'delivered' AND verified_at IS NULL",
            (seconds,),
        )
    finally:
        conn.close()


_SPEC: list[Any] = []


def check_openapi(response: requests.Response) -> requests.Response:
    """Validate a live response (status, headers, body) against ``docs/hq-api.yaml``."""
    from openapi_core import OpenAPI
    from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

    if not _SPEC:
        _SPEC.append(OpenAPI.from_file_path(str(REPO / "docs" / "hq-api.yaml")))
    _SPEC[0].validate_response(
        RequestsOpenAPIRequest(response.request), RequestsOpenAPIResponse(response)
    )
    return response
