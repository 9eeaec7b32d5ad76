"""Object ids: 32 lowercase hex characters made by canner, optionally behind a node prefix.

Pure.  Every route validates an id with :meth:`ObjectIds.is_valid` (a full match) before it touches
the filesystem, so an id is always safe to use as a file name.  A node with a prefix also accepts
bare 32-hex ids: those the Go canner issued (tusd's), taken over by ``canner adopt-go``, and those
the node itself issued before it had a prefix.  It never issues one.
"""

from __future__ import annotations

import re
import secrets

from attrs import field, frozen

_NODE_PREFIX = re.compile(r"[a-z0-9]{1,16}")


def validate_node_prefix(prefix: str) -> None:
    """Raise ``ValueError`` unless ``prefix`` is empty or 1-16 characters of ``[a-z0-9]``."""
    if prefix and not _NODE_PREFIX.fullmatch(prefix):
        raise ValueError("a node prefix is 1-16 characters of [a-z0-9] (or empty)")


@frozen
class ObjectIds:
    """The ids one node issues: ``{prefix}-{32 hex}``, or just ``{32 hex}`` without a prefix."""

    prefix: str = ""
    pattern: re.Pattern[str] = field(init=False, eq=False, repr=False)

    @pattern.default
    def _compile(self) -> re.Pattern[str]:
        head = "(?:" + re.escape(self.prefix + "-") + ")?" if self.prefix else ""
        return re.compile(head + r"[0-9a-f]{32}")

    def new(self) -> str:
        """A fresh random id (128 bits from the OS CSPRNG)."""
        hex_part = secrets.token_hex(16)
        return f"{self.prefix}-{hex_part}" if self.prefix else hex_part

    def is_valid(self, candidate: str) -> bool:
        """True when ``candidate`` is exactly an id of this node, or a bare 32-hex id (adopted
        from the Go canner, or issued before the node had a prefix)."""
        return self.pattern.fullmatch(candidate) is not None
