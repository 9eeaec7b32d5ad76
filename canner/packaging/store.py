"""``packages/``: where megawarc packages are built and kept until delivered (blocking I/O).

A package lives in ``<packages>/<package id>/`` as ``<package id><suffix>`` files.  It is built in
a temp directory (``.tmp-<package id>-<random>``) whose files are fsynced, then renamed into
place, and ``packages/`` is fsynced: a package directory under its final name is always complete.
A temp directory is only ever a build in progress, so at start-up every one is an orphan of a
crash and is removed.  Once a package is delivered, verified at IA and past retention, its
containers are deleted; its indexes (``*.megawarc.json.gz``: the gzip megawarc's and one per
zstd dictionary) and a delivery record
(``.delivery.json``) stay, so a lost ``delivery.sqlite`` can be rebuilt from this directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attrs import frozen

from canner import fs
from canner.packaging.megawarc import index_files, is_index

DELIVERY_RECORD = ".delivery.json"


@frozen
class PackageStore:
    """The packages directory (another filesystem than the data directory if configured)."""

    root: Path

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fs.fsync_dir(self.root.parent)

    def directory(self, package_id: str) -> Path:
        return self.root / package_id

    def sweep_temps(self) -> list[str]:
        """Remove every temp directory (call only while no build runs); returns their names."""
        removed = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(fs.TEMP_PREFIX):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.name)
        if removed:
            fs.fsync_dir(self.root)
        return removed

    def new_work(self, package_id: str) -> Path:
        """A fresh temp directory for building ``package_id``.  A package directory of the same
        id left by a build whose sealing was never recorded is removed first: its batch owns it
        and is building it again."""
        stale = self.directory(package_id)
        if stale.exists():
            shutil.rmtree(stale)
            fs.fsync_dir(self.root)
        work = self.root / f"{fs.TEMP_PREFIX}{package_id}-{secrets.token_hex(6)}"
        work.mkdir()
        return work

    def discard(self, work: Path) -> None:
        shutil.rmtree(work, ignore_errors=True)

    def publish(self, work: Path, package_id: str) -> Path:
        """Rename a finished build (its files already fsynced) into place, durably."""
        fs.fsync_dir(work)
        final = self.directory(package_id)
        os.rename(work, final)
        fs.fsync_dir(self.root)
        return final

    def free_bytes(self) -> int:
        return fs.free_bytes(self.root)

    def record_delivery(self, package_id: str, record: dict[str, Any]) -> None:
        """Durably keep where the package went, beside its index (before its files go)."""
        directory = self.directory(package_id)
        fs.replace_file(
            directory,
            package_id + DELIVERY_RECORD,
            json.dumps(record, separators=(",", ":")).encode(),
            sync=True,
        )
        fs.fsync_dir(directory)

    def read_delivery(self, package_id: str) -> dict[str, Any] | None:
        try:
            data = (self.directory(package_id) / (package_id + DELIVERY_RECORD)).read_bytes()
        except FileNotFoundError:
            return None
        doc: dict[str, Any] = json.loads(data)
        return doc

    def purge(self, package_id: str, suffixes: list[str]) -> None:
        """Delete a delivered package's containers (missing is done); its indexes and delivery
        record stay."""
        directory = self.directory(package_id)
        for suffix in suffixes:
            if not is_index(suffix):
                (directory / (package_id + suffix)).unlink(missing_ok=True)
        fs.fsync_dir(directory)

    def package_ids(self) -> Iterator[str]:
        """Every package directory under its final name (one with an index: a package of
        zstd members only has no gzip megawarc, hence no ``<id>.megawarc.json.gz``)."""
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_dir() and not entry.name.startswith(fs.TEMP_PREFIX):
                    if index_files(Path(entry.path), entry.name):
                        yield entry.name
