"""The one verdict on a node: ok, warning or critical, and every reason for it.

``canner status`` (its exit status and stderr), the status page's header and ``/readyz`` all
word their reasons here, so the three never disagree.  :func:`upload_refusals` says why
uploads would be refused now for lack of storage (``/readyz`` answers 503 with these, and with
:func:`draining_reason` on a drained node, which is no warning); :func:`assess` adds
what a survey knows about delivery (the index unreadable, canner-deliver not running, rows
needing an operator, overdue purges, zstd dictionaries that cannot be had) and grades each
reason.  Pure: the facts come from a :class:`~canner.inventory.Survey` or from
:func:`canner.readiness.check_readiness`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

from canner.delivery.index import RECOVERY
from canner.delivery.liveness import judge
from canner.drain import DrainMark
from canner.inventory import Survey

OK, WARNING, CRITICAL = 0, 1, 2
NAMES = ("ok", "warning", "critical")


@frozen
class Verdict:
    """``code`` is the exit status of ``canner status``; each reason starts with its level
    (``critical: ...``, ``warning: ...``), the critical ones first."""

    code: int
    reasons: tuple[str, ...]

    @property
    def status(self) -> str:
        """``ok``, ``warning`` or ``critical``."""
        return NAMES[self.code]


def draining_reason(draining: DrainMark) -> str:
    return f"{draining.describe()} (new uploads go to other nodes)"


def upload_refusals(
    *,
    free_bytes: int | None,
    free_error: str | None,
    min_free_bytes: int,
    unusable: Sequence[Path],
) -> list[str]:
    """Why an upload would be refused now for lack of storage (empty: none); the drain is
    worded by :func:`draining_reason`.  ``unusable``: data directories this process cannot
    write.  An unreadable delivery index is none of these: receipts are the commit point and
    the index is rebuilt from them, so uploads go on (:func:`index_unreadable` words it)."""
    reasons = []
    if free_bytes is None:
        reasons.append(f"free space cannot be determined: {free_error or 'unknown error'}")
    elif free_bytes < min_free_bytes:
        reasons.append(
            f"free space under the floor: {free_bytes} bytes free, min_free_bytes is"
            f" {min_free_bytes}: uploads are refused"
        )
    for path in unusable:
        reasons.append(f"data directory unusable: {path} is missing or not writable")
    return reasons


def index_unreadable(index_error: str) -> str:
    """The critical reason of a node whose delivery index cannot be read: nothing is delivered
    (canner-deliver refuses to start on a damaged one) until an operator rebuilds it."""
    return f"delivery index unreadable: {index_error}: {RECOVERY}"


def assess(
    survey: Survey, *, min_free_bytes: int, delivers: bool, errors_at_start: int = 0
) -> Verdict:
    """The verdict on the node ``survey`` looked at.

    Critical: uploads refused for lack of storage, the delivery index unreadable, or
    canner-deliver not running while some project delivers.  Warning: deliveries needing an
    operator, overdue purges, zstd dictionaries that cannot be had, and (the status page only:
    the receiver's own log) ``errors_at_start`` errors logged while the receiver started."""
    critical = upload_refusals(
        free_bytes=survey.free_bytes,
        free_error=survey.free_error,
        min_free_bytes=min_free_bytes,
        unusable=survey.unusable,
    )
    if survey.index is None:
        critical.append(index_unreadable(survey.index_error or "unknown error"))
    # A drained node is the operator's own doing: /readyz names it (a load balancer must
    # know), the page shows its banner and ``canner status`` its retirement, but it is no warning.
    warning = []
    index = survey.index
    if index is not None:
        liveness = judge(index.heartbeat, survey.taken_at, lock_held=survey.deliver_lock_held)
        if delivers and not liveness.ok:
            critical.append(liveness.text)
        if index.needs_operator:
            warning.append(f"{index.needs_operator} deliveries need an operator")
        if index.purge_overdue:
            warning.append(f"{index.purge_overdue} local purges are overdue")
    if survey.dictionary_waits:
        ids = ", ".join(w.dict_id for w in survey.dictionary_waits)
        warning.append(f"members wait for zstd dictionaries that cannot be had: {ids}")
    if errors_at_start:
        errors = "1 error" if errors_at_start == 1 else f"{errors_at_start} errors"
        warning.append(f"the receiver logged {errors} while starting")
    reasons = [f"critical: {r}" for r in critical] + [f"warning: {r}" for r in warning]
    code = CRITICAL if critical else WARNING if warning else OK
    return Verdict(code, tuple(reasons))
