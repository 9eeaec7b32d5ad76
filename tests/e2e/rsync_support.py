"""The rsync side of the end-to-end tests: a real ``rsync --daemon`` on loopback, configured by
``canner rsyncd-conf`` from the shipped templates (``conf/rsyncd/``), and the real ``rsync``
client run with seesaw's exact arguments.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deliver_support import venv_bin
from e2e_support import REPO, end_process, free_port

# seesaw's RsyncUpload (ArchiveTeam/seesaw-kit, seesaw/externalprocess.py):
#   rsync -rltv --timeout=300 --contimeout=300 --progress --bwlimit <n> [extra args]
#         --files-from=- <src dir> <target>
# with the extra args pipelines commonly add.
SEESAW_ARGS = ["-rltv", "--timeout=300", "--contimeout=300", "--progress"]
PIPELINE_EXTRA = ["--recursive", "--min-size", "1", "--no-compress"]


def have_rsync() -> bool:
    return shutil.which("rsync") is not None


def seesaw_command(src: Path, target: str, bwlimit: str, extra: Sequence[str] = ()) -> list[str]:
    """The rsync command line a seesaw worker runs, reading its file list from stdin."""
    return [
        "rsync",
        *SEESAW_ARGS,
        "--bwlimit",
        bwlimit,
        *PIPELINE_EXTRA,
        *extra,
        "--files-from=-",
        f"{src}/",
        target,
    ]


def seesaw_rsync(
    src: Path,
    names: Iterable[str],
    target: str,
    *,
    bwlimit: str = "0",
    extra: Sequence[str] = (),
    timeout: float = 120,
) -> subprocess.CompletedProcess[bytes]:
    """Upload ``names`` (relative to ``src``) to ``target`` as a seesaw worker does."""
    return subprocess.run(
        seesaw_command(src, target, bwlimit, extra),
        input="".join(f"{n}\n" for n in names).encode(),
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def seesaw_rsync_started(
    src: Path, names: Iterable[str], target: str, *, bwlimit: str
) -> subprocess.Popen[bytes]:
    """The same command, left running (a slow transfer the test watches)."""
    proc = subprocess.Popen(
        seesaw_command(src, target, bwlimit),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    proc.stdin.write("".join(f"{n}\n" for n in names).encode())
    proc.stdin.close()
    return proc


@dataclass
class RsyncDaemon:
    """One ``rsync --daemon`` on 127.0.0.1 serving canner's modules."""

    root: Path
    config_path: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def for_config(cls, canner_config: Path, root: Path) -> RsyncDaemon:
        """Write the daemon's config with ``canner rsyncd-conf`` from the shipped templates."""
        root.mkdir(parents=True, exist_ok=True)
        config_path = root / "rsyncd.conf"
        out = subprocess.run(
            [
                venv_bin("canner"),
                "rsyncd-conf",
                "--config",
                str(canner_config),
                "--templates",
                str(REPO / "conf" / "rsyncd"),
                "--runtime-dir",
                str(root),
                "--output",
                str(config_path),
            ],
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, f"canner rsyncd-conf failed: {out.stderr.decode()}"
        return cls(root=root, config_path=config_path, port=free_port())

    def start(self, timeout: float = 10.0) -> None:
        # Started by root (as CI runs), the daemon would switch to nobody; the tests' data
        # directories belong to root, as they belong to canner in production (where the daemon
        # runs as canner and no switch happens).
        as_root = ["--dparam=uid=0", "--dparam=gid=0"] if os.geteuid() == 0 else []
        log = open(self.root / "rsyncd.out", "ab")
        self.proc = subprocess.Popen(
            [
                "rsync",
                "--daemon",
                "--no-detach",
                "--address=127.0.0.1",
                f"--port={self.port}",
                f"--config={self.config_path}",
                f"--log-file={self.root / 'rsyncd.log'}",
                *as_root,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"rsync --daemon exited: {self.log_tail()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"rsync --daemon did not listen: {self.log_tail()}") from e
                time.sleep(0.05)

    def target(self, project: str, downloader: str) -> str:
        """A tracker's upload target for ``downloader``."""
        return f"rsync://127.0.0.1:{self.port}/{project}/{downloader}/"

    def log_tail(self) -> str:
        text = ""
        for name in ("rsyncd.out", "rsyncd.log"):
            path = self.root / name
            if path.exists():
                text += path.read_text(errors="replace")[-3000:]
        return text

    def stop(self) -> None:
        end_process(self.proc, signal.SIGTERM, 5)
