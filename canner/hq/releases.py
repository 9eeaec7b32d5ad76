"""HQ release: HQ no longer references a receipt, and canner records ``released_at`` durably.

A release is a fact of its own, beside delivery and the local payload: it never changes the
delivery state.  ``objects.released_at`` in ``delivery.sqlite`` holds it, set once by a guarded
update, so a repeated release answers the first ``released_at``, whoever asks and however often;
its durable copy, which a rebuilt index reads back, is one record in the facts journal
(:mod:`canner.store.journal`): a batch of releases is one journal segment.  Only a delivered object
whose remote copy was verified may be released.

HQ clients authenticate with a bearer token; :class:`TokenFile` holds only SHA-256 digests of the
tokens (``name sha256:<hex>`` per line) and is re-read when it changes, so removing a client's line
revokes it without a restart.  Everything here blocks except the pure parts; call it through a
blocking runner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attrs import define, field, frozen

from canner.store.journal import Journal, release_record

MAX_BATCH = 1000
RELEASED = "released"
ALREADY_RELEASED = "already_released"
NOT_DELIVERED = "not_delivered"
UNKNOWN = "unknown"

_TOKEN_LINE = re.compile(r"([A-Za-z0-9._@:-]{1,128})\s+sha256:([0-9a-f]{64})")


class TokenFileError(ValueError):
    """The tokens file is unusable; ``str()`` names the line."""


def parse_tokens(text: str) -> dict[str, bytes]:
    """``name sha256:<hex>`` lines (blank lines and ``#`` comments allowed) -> name: digest."""
    tokens: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _TOKEN_LINE.fullmatch(line)
        if match is None:
            raise TokenFileError(f"line {number}: expected 'NAME sha256:<64 lowercase hex>'")
        name, digest = match.groups()
        if name in tokens:
            raise TokenFileError(f"line {number}: client {name!r} appears twice")
        tokens[name] = bytes.fromhex(digest)
    return tokens


def token_digest(token: str) -> str:
    """What a tokens file holds for ``token``: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def bearer_token(authorization: bytes | str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


@define
class TokenFile:
    """The ``[hq] tokens`` file, re-read whenever its modification time or size changes."""

    path: Path
    _tokens: dict[str, bytes] = field(factory=dict)
    _stamp: tuple[int, int] | None = None

    def current(self) -> dict[str, bytes]:
        """The clients now allowed (blocking: stats, and reads the file when it changed).

        Raises ``OSError`` or :class:`TokenFileError` when the file is unreadable or malformed.
        """
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._tokens = parse_tokens(self.path.read_text(encoding="utf-8"))
            self._stamp = stamp
        return self._tokens

    def authenticate(self, token: str | None) -> str | None:
        """The name of the client whose token this is, or None; compares every entry in
        constant time (no early exit), so timing tells nothing about near misses."""
        clients = self.current()
        if token is None:
            return None
        presented = hashlib.sha256(token.encode("utf-8")).digest()
        found = None
        for name, digest in clients.items():
            if hmac.compare_digest(presented, digest):
                found = name
        return found


@frozen
class ReleaseResult:
    """The answer for one receipt id."""

    id: str
    status: str
    released_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "status": self.status}
        if self.released_at is not None:
            doc["released_at"] = self.released_at
        return doc


def parse_release_request(body: bytes) -> list[str]:
    """The receipt ids of a release request (a JSON list, or ``{"ids": [...]}``), 1 to
    :data:`MAX_BATCH` strings; ``ValueError`` otherwise."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the body must be JSON: a list of receipt ids") from None
    if isinstance(raw, dict) and set(raw) == {"ids"}:
        raw = raw["ids"]
    if not isinstance(raw, list) or not all(isinstance(i, str) for i in raw):
        raise ValueError("the body must be a JSON list of receipt ids (strings)")
    if not raw:
        raise ValueError("the list of receipt ids is empty")
    if len(raw) > MAX_BATCH:
        raise ValueError(f"at most {MAX_BATCH} receipt ids per request")
    return raw


def object_id_of(receipt_id: str) -> str:
    """``receipt:<object_id>`` -> ``<object_id>`` (anything else -> '')."""
    return receipt_id.removeprefix("receipt:") if receipt_id.startswith("receipt:") else ""


# -- the journal record ------------------------------------------------------------------------

# -- the index -------------------------------------------------------------------------------


@frozen
class Candidate:
    """What the index says about one id of a release request."""

    object_id: str
    releasable: bool  # delivered and verified
    released_at: float | None


def release_candidates(cur: sqlite3.Cursor, object_ids: Sequence[str]) -> dict[str, Candidate]:
    """The indexed ids among ``object_ids`` (a bounded batch) with their release facts."""
    ids = list(dict.fromkeys(object_ids))
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    cur.execute(
        "SELECT object_id, state = 'delivered' AND verified_at IS NOT NULL, released_at"
        f" FROM object_delivery WHERE object_id IN ({marks})",
        ids,
    )
    return {oid: Candidate(oid, bool(ok), rel) for oid, ok, rel in cur.fetchall()}


def release_known(
    cur: sqlite3.Cursor, journal: Journal, object_ids: Sequence[str], now: float, client: str
) -> tuple[dict[str, Candidate], dict[str, float]]:
    """A release request's work in the index, in the caller's transaction: release what is
    releasable (:func:`_release_guarded`), then look up only the ids it did not release.

    Returns what :func:`classify` and :func:`finish_answers` read: the indexed ids among
    ``object_ids`` as :class:`Candidate` s, where an id this call released shows as releasable
    and not released yet (its answer comes from the times), and the ids this call released,
    at ``now``.  Releasing first leaves one look per id in the usual batch (every id
    delivered), where looking first and releasing after took three."""
    ids = list(dict.fromkeys(object_ids))
    changed = _release_guarded(cur, journal, ids, now, client)
    released = dict.fromkeys(changed, now)
    candidates = release_candidates(cur, [oid for oid in ids if oid not in released])
    candidates.update((oid, Candidate(oid, True, None)) for oid in changed)
    return candidates, released


def _release_guarded(
    cur: sqlite3.Cursor, journal: Journal, ids: list[str], now: float, client: str
) -> list[str]:
    """Set ``released_at`` to ``now`` on those of ``ids`` (distinct) delivered and verified and
    not released yet; returns them.

    The guarded update takes the index's write lock; the journal segment of the rows it changed
    is written and fsynced before the caller's transaction commits, so an answer is only ever
    given for a time that is durable twice (see :mod:`canner.store.journal` for why a crash in
    between is harmless)."""
    if not ids:
        return []
    marks = ", ".join("?" for _ in ids)
    # One look per id in each table (the delivery row through its key, not through the view,
    # whose join looks the object up a second time): at a million rows each look is a page
    # read the cache misses, the only part of a release batch that grows with the index.
    cur.execute(
        f"UPDATE objects SET released_at = ? WHERE object_id IN ({marks}) AND released_at IS NULL"
        " AND EXISTS (SELECT 1 FROM outbound d WHERE d.kind = 'object'"
        "   AND d.ref = objects.object_id AND d.state = 'delivered' AND d.verified_at IS NOT NULL)"
        " RETURNING object_id",
        [now, *ids],
    )
    changed = [oid for (oid,) in cur.fetchall()]
    if changed:
        journal.append([release_record(oid, now, client) for oid in changed])
    return changed


def classify(
    receipt_ids: Sequence[str],
    candidates: dict[str, Candidate],
    archived: dict[str, float],
    valid: Any,
) -> tuple[list[ReleaseResult | None], list[str]]:
    """Pure: the answers already known (None where a side file must be published) and the
    object ids to publish side files for.

    ``archived`` maps archived object ids to their ``released_at``; ``valid(object_id)`` says
    whether an id is this node's.
    """
    answers: list[ReleaseResult | None] = []
    to_publish: list[str] = []
    for rid in receipt_ids:
        oid = object_id_of(rid)
        c = candidates.get(oid) if oid and valid(oid) else None
        if c is None:
            if oid in archived:
                answers.append(ReleaseResult(rid, ALREADY_RELEASED, archived[oid]))
            else:
                answers.append(ReleaseResult(rid, UNKNOWN))
        elif c.released_at is not None:
            answers.append(ReleaseResult(rid, ALREADY_RELEASED, c.released_at))
        elif not c.releasable:
            answers.append(ReleaseResult(rid, NOT_DELIVERED))
        else:
            answers.append(None)
            if oid not in to_publish:
                to_publish.append(oid)
    return answers, to_publish


def finish_answers(
    receipt_ids: Sequence[str],
    answers: list[ReleaseResult | None],
    published: dict[str, float],
    now: float,
) -> list[ReleaseResult]:
    """Fill the published ids' answers: ``released`` when this request set the time (the first
    mention in the batch), ``already_released`` when an earlier release (or an earlier
    duplicate in this batch) did."""
    done: list[ReleaseResult] = []
    seen: set[str] = set()
    for rid, answer in zip(receipt_ids, answers, strict=True):
        if answer is not None:
            done.append(answer)
            continue
        oid = object_id_of(rid)
        at = published.get(oid)
        if at is None:  # no longer releasable since it was classified
            done.append(ReleaseResult(rid, NOT_DELIVERED))
            continue
        fresh = at == now and oid not in seen
        seen.add(oid)
        done.append(ReleaseResult(rid, RELEASED if fresh else ALREADY_RELEASED, at))
    return done
