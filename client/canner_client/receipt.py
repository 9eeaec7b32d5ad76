"""The ArtifactReceipt a worker hands to HQ: six fields, compact JSON, in HQ's order."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

FIELDS = ("id", "issuer", "object_id", "checksum", "size_bytes", "accepted_at")
_CHECKSUM = re.compile(r"blake3:[0-9a-f]{64}")


@dataclass(frozen=True)
class Receipt:
    """An immutable receipt.  ``to_json()`` gives the same bytes the server serves."""

    id: str
    issuer: str
    object_id: str
    checksum: str
    size_bytes: int
    accepted_at: int

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def to_json(self) -> str:
        """Compact JSON with exactly the six fields HQ accepts, in order."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, doc: Any) -> Receipt:
        """Validate a decoded receipt; ``ValueError`` names what is wrong."""
        if not isinstance(doc, dict) or tuple(doc) != FIELDS:
            keys = list(doc) if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"a receipt has exactly the fields {', '.join(FIELDS)}; got {keys}")
        for name in ("id", "issuer", "object_id", "checksum"):
            if not isinstance(doc[name], str):
                raise ValueError(f"receipt field {name} is not a string")
        for name in ("size_bytes", "accepted_at"):
            if type(doc[name]) is not int or doc[name] < 0:
                raise ValueError(f"receipt field {name} is not a non-negative integer")
        if doc["id"] != "receipt:" + doc["object_id"]:
            raise ValueError(f"receipt id {doc['id']!r} does not name {doc['object_id']!r}")
        if not _CHECKSUM.fullmatch(doc["checksum"]):
            raise ValueError(f"receipt checksum {doc['checksum']!r} is not blake3:<64 hex>")
        return cls(**doc)

    @classmethod
    def from_json(cls, data: str | bytes) -> Receipt:
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise ValueError(f"receipt is not JSON: {e}") from None
        return cls.from_dict(doc)

    @classmethod
    def from_header(cls, value: str) -> Receipt:
        """Decode an ``Artifact-Receipt`` header (the JSON as unpadded base64url)."""
        value = value.strip()
        if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            raise ValueError("Artifact-Receipt is not unpadded base64url")
        try:
            raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"Artifact-Receipt does not decode: {e}") from None
        return cls.from_json(raw)
