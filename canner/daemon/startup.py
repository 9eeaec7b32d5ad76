"""canner-deliver's own start-up refusals, beside the data directory's
(:mod:`canner.store.datadir`): a package store it cannot write, and a damaged delivery index
(:func:`upgrade_index`), each one line naming the fix, never a traceback.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from canner import fs
from canner.delivery.index import damaged_index, is_damaged, upgrade_schema
from canner.packaging.store import PackageStore
from canner.store.datadir import CannotStart, unwritable


def prepare_packages(packages: PackageStore) -> None:
    """Create the package store's directory and check this process can write it
    (:class:`CannotStart` when not)."""
    try:
        packages.prepare()
        fs.check_writable(packages.root)
    except OSError as e:
        raise unwritable(packages.root, packages.root, e) from None


def upgrade_index(path: Path) -> None:
    """Bring the delivery index at ``path`` to the newest schema (blocking), or refuse with
    :class:`CannotStart` naming the recovery when the file is damaged: a daemon restarted on it
    (systemd's ``Restart=on-failure``) then logs that one line each time, never a traceback."""
    try:
        upgrade_schema(path)
    except sqlite3.DatabaseError as e:
        if not is_damaged(e):
            raise
        raise CannotStart(damaged_index(path, e)) from None
