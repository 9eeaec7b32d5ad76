"""Log vocabulary and the JSON observer used under systemd.

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
``package``       a megawarc package id (32 hex); ``batch_id`` its batch's row number
``members``       how many objects a package holds; ``bytes`` their size together
``files``         the files of a package (suffixes), or how many were delivered
``assigned``      objects put into batches by one tick; ``closed`` batches it closed
``client``        the address of an HTTP client (access log, refused releases)
``hq_client``     the name of an HQ client (its line in ``[hq] tokens``)
``ledger``        a ledger's name (``<node>-<period>[-n]``)
================  ============================================================================

Access log events (namespace ``canner.access``, one per answered receiver request) carry
``client``, ``method``, ``path`` (object ids cut to 8 characters), ``status``, ``bytes`` (response
body bytes) and ``duration_s``.  Delivery failures carry ``failure_class`` (``forbidden``,
``rate_limited``, ``server_error``, ``client_error``, ``network``, ``local_payload``,
``timeout``, ``internal``, ``other``).

Inside the process every event also carries Twisted's own fields: ``log_time`` (Unix time),
``log_level``, ``log_namespace`` (the emitting module, e.g. ``canner.accept.acceptance``),
``log_format`` and, for unexpected errors, ``log_failure``.

Metrics never read these events: the domain tells them its facts through the typed observers of
:mod:`canner.observe`, so a log message can be reworded freely.

``twistd --logger=canner.logs.json_observer`` writes one flat JSON object per line on stdout
(:func:`flat_event`): ``time`` (ISO 8601 UTC), ``level`` (``debug``, ``info``, ``warning``,
``error``, ``critical``), ``logger`` (the namespace), ``message`` (the rendered text), then the
event's own fields above; an unexpected error adds ``exception`` and ``traceback``.  No Twisted
internals, e.g. ``jq 'select(.level == "error") | {time, message, object_id}'``.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import IO, Any, cast

from twisted.logger import ILogObserver, formatEvent
from zope.interface import provider

# Twisted's level names, except the conventional "warning" for "warn".
_LEVELS = {"warn": "warning"}
# Keys of Twisted's legacy (twisted.python.log) events, which carry no facts of ours.
_LEGACY = frozenset({"format", "message", "isError", "system", "time", "why", "failure"})


def _jsonable(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if depth < 4 and isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v, depth + 1) for v in value]
    if depth < 4 and isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    return str(value)


def _message(event: Mapping[str, Any]) -> str:
    """``formatEvent``'s text for the event.  A plain template (no ``{name()}`` calls, which
    only Twisted's formatter knows) is rendered by ``str.format_map`` directly, the same text at
    a tenth of the cost; anything else, or any error, goes to ``formatEvent``."""
    template = event.get("log_format")
    if isinstance(template, str) and "()" not in template and "log_flattened" not in event:
        try:
            return template.format_map(event)
        except Exception:
            pass
    return formatEvent(dict(event))


def flat_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """One log event as a flat, conventional JSON object (see the module docstring)."""
    when = event.get("log_time")
    stamp = datetime.fromtimestamp(when if isinstance(when, int | float) else 0.0, UTC)
    level = event.get("log_level")
    doc: dict[str, Any] = {
        "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": _LEVELS.get(name, name)
        if isinstance(name := getattr(level, "name", None), str)
        else "info",
        "logger": str(event.get("log_namespace", "")),
        "message": _message(event),
    }
    failure = event.get("log_failure")
    if failure is not None and hasattr(failure, "getTraceback"):
        doc["exception"] = f"{failure.type.__name__}: {failure.getErrorMessage()}"
        doc["traceback"] = failure.getTraceback()
    for key, value in event.items():
        if key.startswith("log_") or key in _LEGACY or key in doc:
            continue
        doc[key] = _jsonable(value)
    return doc


def json_observer(stream: IO[str] | None = None) -> ILogObserver:
    """The observer factory named by ``twistd --logger``: flat JSON lines on stdout.

    One line per event and no record separator: journald stores each line as one message.
    Events logged from worker threads are written whole (a lock serialises the writes).
    """
    out = stream if stream is not None else sys.stdout
    lock = threading.Lock()
    # json.dumps with these options, without building an encoder per line.
    encode = json.JSONEncoder(ensure_ascii=False, default=str).encode

    @provider(ILogObserver)
    def observe(event: Mapping[str, Any]) -> None:
        line = encode(flat_event(event)) + "\n"
        with lock:
            out.write(line)
            out.flush()

    return cast(ILogObserver, observe)
