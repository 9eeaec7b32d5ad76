"""Receipt values, their wire form, and the publish-once store."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canner.checksum import Checksum
from canner.store.receipts import Origin, Receipt, ReceiptStore, parse_receipt

OID = "0123456789abcdef0123456789abcdef"


def receipt(**overrides: object) -> Receipt:
    values: dict[str, object] = {
        "object_id": OID,
        "issuer": "https://canner.example",
        "checksum": Checksum("ab" * 32),
        "size_bytes": 123,
        "accepted_at": 1784764800,
        **overrides,
    }
    return Receipt(**values)  # type: ignore[arg-type]


def test_receipt_json_is_exactly_the_six_fields_in_order() -> None:
    """The JSON is HQ's ArtifactReceipt: six fields, this order, integers, compact."""
    data = receipt().to_json()
    assert data == (
        b'{"id":"receipt:' + OID.encode() + b'","issuer":"https://canner.example",'
        b'"object_id":"' + OID.encode() + b'","checksum":"blake3:' + b"ab" * 32 + b'",'
        b'"size_bytes":123,"accepted_at":1784764800}'
    )


def test_header_is_unpadded_base64url_of_the_json() -> None:
    """Artifact-Receipt decodes to the same bytes as the JSON."""
    value = receipt().header_value()
    assert "=" not in value and "+" not in value and "/" not in value
    assert base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)) == receipt().to_json()


@given(
    st.integers(1, 2**53),
    st.integers(1, 2**40),
    st.text(min_size=1, max_size=100).filter(lambda s: len(s.encode()) <= 512),
)
def test_receipts_round_trip(size: int, accepted: int, issuer: str) -> None:
    """parse_receipt(to_json()) gives the receipt back."""
    r = receipt(size_bytes=size, accepted_at=accepted, issuer=issuer)
    assert parse_receipt(r.to_json()) == r


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(extra=1),
        lambda d: d.update(size_bytes=0),
        lambda d: d.update(accepted_at=1.5),
        lambda d: d.update(id="receipt:other"),
        lambda d: d.update(checksum="blake3:xyz"),
        lambda d: d.pop("issuer"),
    ],
)
def test_parse_refuses_anything_hq_would_refuse(mutate: object) -> None:
    """Extra, missing or out-of-range fields are not receipts."""
    doc = json.loads(receipt().to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises((ValueError, KeyError)):
        parse_receipt(json.dumps(doc).encode())


def test_commit_never_overwrites_an_existing_receipt(tmp_path: Path) -> None:
    """A second commit returns the first receipt; neither receipt nor origin is overwritten."""
    store = ReceiptStore(tmp_path)
    store.record_origin(OID, Origin("example", "a.warc"))
    first = store.commit(receipt(accepted_at=100))
    store.record_origin(OID, Origin("other", None))
    second = store.commit(receipt(accepted_at=200))
    assert first == second
    assert store.read_bytes(OID) == receipt(accepted_at=100).to_json()
    assert store.read_origin(OID) == Origin("example", "a.warc")
    assert list(store.object_ids()) == [OID]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_missing_receipt_reads_as_none(tmp_path: Path) -> None:
    """No file: no receipt and no origin."""
    store = ReceiptStore(tmp_path)
    assert store.read(OID) is None and store.read_origin(OID) is None
