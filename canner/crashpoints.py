"""Test-only crash points: ``CANNER_CRASH_AT=<name>`` SIGKILLs the process when it reaches the
step called ``<name>``, so the end-to-end tests can kill a real receiver between two durable
steps of a commit sequence.  Unset (production), :func:`crash_point` only compares a string.
"""

from __future__ import annotations

import os
import signal

_AT = os.environ.get("CANNER_CRASH_AT", "")


def crash_point(name: str) -> None:
    """SIGKILL this process if the environment names ``name`` (see the module docstring)."""
    if _AT and _AT == name:
        os.kill(os.getpid(), signal.SIGKILL)
