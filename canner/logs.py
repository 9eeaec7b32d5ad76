"""Log vocabulary, the event kinds that metrics count, and the JSON observer used under systemd.

Both daemons log ``twisted.logger`` events.  The message is a PEP 3101 template (``log_format``)
that observers render; the facts travel in keyword fields whose names are stable, so that
``jq``, journald queries and alerting can rely on them:

================  ============================================================================
field             meaning
================  ============================================================================
``object_id``     the upload/object id (``[prefix-]<32 hex>``); the tus upload id is the same
``project``       the project id of the upload (from its ``Upload-Metadata``)
``size``          bytes: an upload's declared length, or bytes hashed/sent by an operation
``size_bytes``    bytes of an accepted object (as in its receipt)
``offset``        bytes stored so far of an upload
``state``         a delivery state: ``pending``, ``delivering``, ``retry_wait``, ``delivered``
``attempt``       delivery attempt number (1-based)
``delay``         seconds until the next delivery attempt
``needs_operator``  true when retrying alone will not fix a delivery failure
``identifier``    Internet Archive item identifier
``remote_name``   file name inside the IA item
``status``        an HTTP status code (from IA)
``duration_s``    seconds an operation took (an IA upload, ...)
``hash_s``        seconds the BLAKE3 hash of an accepted upload took
``error``         a short error text (never a secret)
``reason``        why an upload was rejected for good
``count``         how many things an event covers; ``ids`` lists them when useful
``path``          a file system path
``label``         the name of a periodic job whose run failed
================  ============================================================================

Every event also carries Twisted's own fields: ``log_time`` (Unix time), ``log_level``
(``debug``/``info``/``warn``/``error``/``critical``), ``log_namespace`` (the emitting module,
e.g. ``canner.acceptance``), ``log_format`` and, for unexpected errors, ``log_failure``.

The events counted by :mod:`canner.metrics` are named in :data:`EVENTS` by namespace and the
start of their template; :func:`event_kind` classifies an event.  Changing one of those templates
changes a metric: ``tests/unit/test_metrics.py`` checks that each one still exists.

``twistd --logger=canner.logs.json_observer`` writes one JSON object per line on stdout: the
fields above plus ``log_format`` (the template, not the rendered text), ``log_time``,
``log_namespace`` and ``log_level`` as an object whose ``name`` is the level, e.g.
``jq 'select(.log_level.name == "error")'``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from twisted.logger import ILogObserver, jsonFileLogObserver

# kind -> (log_namespace, start of log_format)
EVENTS: Mapping[str, tuple[str, str]] = {
    "accepted": ("canner.acceptance", "accepted {object_id} ("),
    "rejected": ("canner.acceptance", "rejected {object_id}: "),
    "acceptance_failed": ("canner.acceptance", "acceptance of {object_id} failed"),
    "stale_removed": ("canner.service", "removed {count} stale uploads"),
    "attempt": ("canner.delivery.scheduler", "delivering {object_id} (attempt"),
    "delivered": ("canner.delivery.scheduler", "delivered {object_id} as "),
    "delivery_failed": ("canner.delivery.scheduler", "delivery of {object_id} failed"),
    "verified": ("canner.delivery.scheduler", "verified {object_id} at "),
    "purged": ("canner.delivery.scheduler", "purged local payload of {object_id}"),
    "uploaded": ("canner.sinks.internet_archive", "uploaded {object_id} to "),
    "copied": ("canner.sinks.directory", "copied {object_id} to "),
}

_BY_NAMESPACE: dict[str, list[tuple[str, str]]] = {}
for _kind, (_namespace, _prefix) in EVENTS.items():
    _BY_NAMESPACE.setdefault(_namespace, []).append((_prefix, _kind))


def event_kind(event: Mapping[str, Any]) -> str | None:
    """The :data:`EVENTS` kind of a log event, or None for any other event."""
    candidates = _BY_NAMESPACE.get(event.get("log_namespace", ""))
    if not candidates:
        return None
    text = event.get("log_format")
    if not isinstance(text, str):
        return None
    for prefix, kind in candidates:
        if text.startswith(prefix):
            return kind
    return None


def json_observer() -> ILogObserver:
    """The observer factory named by ``twistd --logger``: JSON lines on stdout.

    No record separator: journald stores each line as one message, and a leading RS byte
    would make every line invalid JSON for the tools that read it back.
    """
    return jsonFileLogObserver(sys.stdout, recordSeparator="")
