"""A disk that fails writes for real: ext4 on a loop device whose backing file sits on a tmpfs.

The backing file is fully allocated while the filesystem is made, then the filesystem's free
blocks are punched out of it.  Everything the filesystem already uses (superblocks, inode tables,
the pre-grown ``uploads/`` directory) is backed by tmpfs pages; every block allocated later (upload
data, new directory blocks) lands in a hole that needs a fresh tmpfs page.  :meth:`fill` takes all
of the tmpfs' free space, so writeback of those blocks fails with ENOSPC/EIO exactly as a failing
disk reports it (through the kernel's real writeback and errseq path); :meth:`free` gives the space
back.  The filesystem itself still shows plenty of free space, so canner's free-space guard is not
what refuses anything.

The directories are pre-grown and the journal is backed, so the filesystem's own metadata never
fails (a failed journal or metadata write would abort the journal and turn the whole filesystem
read-only, which is not the fault under test): what fails is the data of files, as on a disk whose
free sectors have gone bad.  :meth:`remount` unmounts, drops the page cache and mounts again: what
the test reads afterwards is what the "disk" holds.

Needs root (mount, losetup), as CI runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BLOCK = 4096


def _run(*args: str) -> str:
    done = subprocess.run(args, check=True, capture_output=True, text=True)
    return done.stdout


class FailingDisk:
    """One loop-mounted ext4 at :attr:`mount` whose free space is backed by nothing."""

    def __init__(self, root: Path, size_mb: int = 320) -> None:
        self.root = root
        self.backing = root / "backing"
        self.mount = root / "mnt"
        self.image = self.backing / "disk.img"
        self.size = size_mb << 20
        self._mounted = False
        self._backing_mounted = False

    # -- lifecycle -------------------------------------------------------------------------------

    def create(self, data_dirs: list[str]) -> None:
        """Make the filesystem with ``data_dirs`` (relative paths) created and pre-grown."""
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        # Room for the whole image plus a little; fill() takes the rest.
        _run(
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={self.size + (8 << 20)}",
            "tmpfs",
            str(self.backing),
        )
        self._backing_mounted = True
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        _run(
            "mkfs.ext4",
            "-q",
            "-F",
            "-b",
            str(BLOCK),
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
            str(self.image),
        )
        _run("fallocate", "-l", str(self.size), str(self.image))
        self._mount()
        for rel in data_dirs:
            path = self.mount / rel
            path.mkdir(parents=True)
            if path.name in ("uploads", "receipts"):
                # Grow the directory while every block is backed, so the files of a few dozen
                # uploads never need a new directory block.
                for i in range(200):
                    (path / f"pad-{i:04d}-{'x' * 40}").touch()
                for i in range(200):
                    (path / f"pad-{i:04d}-{'x' * 40}").unlink()
        os.sync()
        self._unmount()
        self._punch_free_blocks()
        self._mount()

    def close(self) -> None:
        if self._mounted:
            self._unmount()
        if self._backing_mounted:
            subprocess.run(["umount", str(self.backing)], check=False)
            self._backing_mounted = False

    def _mount(self) -> None:
        _run("mount", "-o", "loop,nodiscard,errors=continue", str(self.image), str(self.mount))
        self._mounted = True

    def _unmount(self) -> None:
        _run("umount", str(self.mount))
        self._mounted = False

    def _punch_free_blocks(self) -> None:
        out = _run("dumpe2fs", str(self.image))
        for line in out.splitlines():
            line = line.strip()
            if not line.startswith("Free blocks: "):
                continue
            for part in line.removeprefix("Free blocks: ").split(","):
                part = part.strip()
                if not part:
                    continue
                first, _, last = part.partition("-")
                start, end = int(first), int(last or first)
                _run(
                    "fallocate",
                    "--punch-hole",
                    "--offset",
                    str(start * BLOCK),
                    "--length",
                    str((end - start + 1) * BLOCK),
                    str(self.image),
                )

    # -- faults ------------------------------------------------------------------------------------

    def fill(self) -> None:
        """Take every free byte of the backing tmpfs: new blocks can no longer be written."""
        stat = os.statvfs(self.backing)
        free = stat.f_bavail * stat.f_frsize
        with open(self.backing / "filler", "ab") as f:
            start = os.fstat(f.fileno()).st_size
            while free > 0:
                try:
                    os.posix_fallocate(f.fileno(), start, free)
                    return
                except OSError:
                    free -= 4096

    def free(self) -> None:
        """Give the space back: writes succeed again (pages that already failed stay lost)."""
        (self.backing / "filler").unlink(missing_ok=True)

    def remount(self) -> None:
        """Unmount (writing back what can be), drop caches and mount again: read the disk."""
        self._unmount()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        self._mount()
