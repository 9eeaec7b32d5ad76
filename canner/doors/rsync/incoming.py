"""The incoming tree the rsync daemon writes: ``<incoming>/<project>/[<downloader>/]<file>``.

One rsync module per project points at ``<incoming>/<project>``; a seesaw target
``rsync://host/<project>/<downloader>/`` puts each file in the worker's own directory.  rsync
writes a file under a temporary name (``.<name>.XXXXXX``) and renames it to its final name once
the whole file arrived and its whole-file check passed: only regular files whose path has no
component starting with ``.`` are ever adopted (rsync's temporary names, ``--delay-updates``'
``.~tmp~/``, hidden files).  Symlinks and other non-regular entries are never followed.
:func:`arrivals` blocks; call it through a blocking runner.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from attrs import frozen

# Deeper than <project>/<downloader>/<file> is not looked at (a worker's own tree stays put).
MAX_DEPTH = 2


@frozen
class Arrival:
    """A finished file in the incoming tree, as found by a scan."""

    path: Path
    project: str
    downloader: str | None
    filename: str
    size: int
    # When its name appeared (rsync's rename sets the ctime; -t keeps the worker's mtime).
    arrived_at: float


def is_final_name(name: str) -> bool:
    """False for the names rsync writes while a file is incomplete (and other hidden names)."""
    return bool(name) and not name.startswith(".")


def project_dirs(incoming: Path, projects: Iterable[str]) -> dict[str, Path]:
    return {project: incoming / project for project in projects}


def arrivals(incoming: Path, projects: Iterable[str]) -> Iterator[Arrival]:
    """Every adoptable file under the configured projects' directories (blocking)."""
    for project, top in project_dirs(incoming, projects).items():
        yield from _walk(top, project, None, 1)


def _walk(directory: Path, project: str, downloader: str | None, depth: int) -> Iterator[Arrival]:
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if not is_final_name(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield Arrival(
                Path(entry.path), project, downloader, entry.name, st.st_size, st.st_ctime
            )
        elif stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
            yield from _walk(Path(entry.path), project, entry.name, depth + 1)


def count_waiting(incoming: Path, projects: Iterable[str], data_dir: Path) -> int:
    """Files that rsync has finished and canner has not yet accepted (blocking; for ``canner
    status`` and the status page): finished files in the incoming tree, plus claimed ones that
    left it (in ``adopting/``, or in ``uploads/`` without a receipt yet).  Each is counted once."""
    waiting = sum(1 for _ in arrivals(incoming, projects))
    adopting = adoption_dir(data_dir)
    try:
        with os.scandir(adopting) as it:
            claims = [e.name[: -len(CLAIM_SUFFIX)] for e in it if e.name.endswith(CLAIM_SUFFIX)]
    except FileNotFoundError:
        return waiting
    for object_id in claims:
        if os.path.lexists(adopting / object_id) or (
            os.path.lexists(data_dir / "uploads" / object_id)
            and not os.path.lexists(data_dir / "receipts" / f"{object_id}.json")
        ):
            waiting += 1
    return waiting


CLAIM_SUFFIX = ".claim"


def adoption_dir(data_dir: Path) -> Path:
    """``<data_dir>/adopting``: claims and the files they hold
    (:mod:`canner.doors.rsync.adoption`)."""
    return data_dir / "adopting"
