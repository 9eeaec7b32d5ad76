"""zstd dictionaries that members name: the API client over a fake API, and the store."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import zstandard
from klein import Klein
from treq.client import HTTPClient
from treq.testing import RequestTraversalAgent
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.web.iweb import IRequest

from canner.packaging.dictionaries import DictionaryStore
from canner.packaging.dictionary_api import DictionaryApi, DictionaryUnavailable
from tests.packaging_support import train_dictionary

DICT_ID = "1234567890"


class FakeApi:
    """``/api?project=&id=`` and ``/dict``, answering as ``answer`` says."""

    app = Klein()

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.answer: dict[str, Any] = {
            "id": DICT_ID,
            "url": "http://dicts.test/dict",
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        self.code = 200

    @app.route("/api")
    def api(self, request: IRequest) -> bytes:
        request.setResponseCode(self.code)
        return json.dumps(self.answer).encode()

    @app.route("/dict")
    def dictionary(self, request: IRequest) -> bytes:
        return self.data


def fetch(fake: FakeApi) -> bytes:
    agent = RequestTraversalAgent(fake.app.resource())
    api = DictionaryApi(http=HTTPClient(agent), clock=Clock())
    d = Deferred.fromCoroutine(api.fetch("http://dicts.test/api", "urls", DICT_ID))
    agent.flush()
    results: list[Any] = []
    d.addBoth(results.append)
    assert results, "the fetch did not finish"
    if isinstance(results[0], bytes):
        return results[0]
    results[0].raiseException()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("compressed", [False, True])
def test_the_api_gives_a_dictionary_checked_by_sha256(compressed: bool) -> None:
    """A dictionary served raw or zstd-compressed, whose SHA-256 matches, comes back as served."""
    raw = train_dictionary(1).as_bytes()
    served = zstandard.ZstdCompressor().compress(raw) if compressed else raw
    assert fetch(FakeApi(served)) == served


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"id": "0000000001"}, "mismatch"),
        ({"sha256": "0" * 64}, "mismatch"),
        ({"url": 7}, "api"),
        ({"code": 503}, "api"),
        ({"data": b"no dictionary"}, "invalid"),
        ({"data": b"x" * ((32 << 20) + 1)}, "download"),
    ],
)
def test_a_dictionary_the_api_cannot_give_is_unavailable(
    change: dict[str, Any], reason: str
) -> None:
    """Another id, another SHA-256, a bad answer, an error status, bytes that are no dictionary
    or too many: DictionaryUnavailable with the failure class."""
    fake = FakeApi(train_dictionary(2).as_bytes())
    if "code" in change:
        fake.code = change["code"]
    elif "data" in change:
        fake.data = change["data"]
        fake.answer["sha256"] = hashlib.sha256(fake.data).hexdigest()
    else:
        fake.answer.update(change)
    with pytest.raises(DictionaryUnavailable) as caught:
        fetch(fake)
    assert caught.value.reason == reason


def test_a_kept_dictionary_whose_bytes_changed_is_dropped(tmp_path: Path) -> None:
    """The store gives back what it kept, by id; a copy whose bytes no longer match the SHA-256
    in its name is removed (fetched again), and keeping clears the id's wait record."""
    store = DictionaryStore(tmp_path / "dictionaries")
    assert store.load(DICT_ID) is None
    store.keep(DICT_ID, b"dictionary bytes")
    assert store.load(DICT_ID) == b"dictionary bytes"
    (kept,) = store.root.iterdir()
    kept.write_bytes(b"dictionary bytez")
    assert store.load(DICT_ID) is None
    assert list(store.root.iterdir()) == []
