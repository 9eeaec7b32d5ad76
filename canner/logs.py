"""Log vocabulary and the JSON observer used under systemd.

Events are ``twisted.logger`` events whose facts travel in keyword fields with stable names:

``object_id``  the upload/object id          ``project``     the project id
``offset``     bytes stored so far           ``size``        bytes (an upload's length)
``state``      a delivery state              ``attempt``     delivery attempt number
``identifier`` IA item identifier            ``duration_s``  seconds an operation took
``error``      a short error text            ``count``       how many things an event covers

``twistd --logger=canner.logs.json_observer`` writes one JSON object per line on stdout.
"""

from __future__ import annotations

import sys

from twisted.logger import ILogObserver, jsonFileLogObserver


def json_observer() -> ILogObserver:
    """The observer factory named by ``twistd --logger``: JSON lines on stdout.

    No record separator: journald stores each line as one message, and a leading RS byte
    would make every line invalid JSON for the tools that read it back.
    """
    return jsonFileLogObserver(sys.stdout, recordSeparator="")
