"""The one verdict on a node: ok, warning, critical or draining, and every reason for it.

``canner status`` (its exit status and stderr), the status page's header and ``/readyz`` all
word their reasons here, so the three never disagree.  :func:`upload_refusals` says why
uploads would be refused now for lack of storage (``/readyz`` answers 503 with these, and with
:func:`draining_reason` on a drained node, which is no warning); :func:`assess` adds
what a survey knows about delivery (the index unreadable, canner-deliver not running, rows
needing an operator, overdue purges, zstd dictionaries that cannot be had) and grades each
reason.  A drained node is neither ok nor an alarm: the operator's own doing, its verdict is
``draining`` (exit status 0, no alarm) unless something is worse, and the drain is always among
its reasons, worded as ``/readyz`` words it, with whether the node can be retired.  Pure: the
facts come from a :class:`~canner.ops.inventory.Survey` or from
:func:`canner.ops.readiness.check_readiness`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

from canner.delivery.index import RECOVERY
from canner.delivery.liveness import judge
from canner.ops.inventory import Survey
from canner.store.drain import DrainMark, Retirement

OK, WARNING, CRITICAL = 0, 1, 2
NAMES = ("ok", "warning", "critical")


DRAINING = "draining"


@frozen
class Verdict:
    """``code`` is the exit status of ``canner status`` (the alarm: 0 none, 1 warning, 2
    critical); each reason starts with its level (``critical: ...``, ``warning: ...``,
    ``draining: ...``), the critical ones first and the drain last.  ``draining``: the node is
    drained."""

    code: int
    reasons: tuple[str, ...]
    draining: bool = False

    @property
    def status(self) -> str:
        """``ok``, ``warning`` or ``critical``; ``draining`` for a drained node with nothing
        worse (no alarm, yet not ok: it takes no uploads)."""
        if self.code == OK and self.draining:
            return DRAINING
        return NAMES[self.code]


def draining_reason(draining: DrainMark) -> str:
    return f"{draining.describe()} (new uploads go to other nodes)"


def _drained(draining: DrainMark, retirement: Retirement | None) -> str:
    """The drain as a reason: ``/readyz``'s words, then whether the node can be retired."""
    reason = draining_reason(draining)
    return reason if retirement is None else f"{reason}; {retirement.describe()}"


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
    survey: Survey,
    *,
    min_free_bytes: int,
    delivers: bool,
    errors_at_start: int = 0,
    workers_missing: str | None = None,
) -> Verdict:
    """The verdict on the node ``survey`` looked at.

    Critical: uploads refused for lack of storage, the delivery index unreadable, or
    canner-deliver not running while some project delivers.  Warning: deliveries needing an
    operator, overdue purges, zstd dictionaries that cannot be had, and (the status page only:
    the receiver's own knowledge) ``errors_at_start`` errors logged while the receiver started
    and ``workers_missing``, fewer of its workers listening than configured (it serves less;
    ``/readyz`` is not ready meanwhile).
    Draining (no alarm): the node's drain marker, with its retirement."""
    critical = upload_refusals(
        free_bytes=survey.free_bytes,
        free_error=survey.free_error,
        min_free_bytes=min_free_bytes,
        unusable=survey.unusable,
    )
    if survey.index is None:
        critical.append(index_unreadable(survey.index_error or "unknown error"))
    # A drained node is the operator's own doing: /readyz names it (a load balancer must
    # know), and the verdict says "draining" with its retirement, but it is no warning.
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
    if workers_missing is not None:
        warning.append(workers_missing)
    reasons = [f"critical: {r}" for r in critical] + [f"warning: {r}" for r in warning]
    if survey.draining is not None:
        reasons.append(f"{DRAINING}: {_drained(survey.draining, survey.retirement)}")
    code = CRITICAL if critical else WARNING if warning else OK
    return Verdict(code, tuple(reasons), draining=survey.draining is not None)
