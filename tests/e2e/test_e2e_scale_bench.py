"""The scale benchmark runs (issue 37): ``bench/scale_bench.py`` builds a data directory of N
objects, starts the real daemons on it, prints every figure it promises and leaves nothing
behind.  A smoke test of the script, not a measurement: no figure's value is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import REPO

pytestmark = pytest.mark.e2e

BENCH = REPO / "bench" / "scale_bench.py"


def figures() -> list[tuple[str, str, str, str]]:
    """The figures the bench promises (its FIGURES table), read without importing it."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import scale_bench

        return scale_bench.FIGURES
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_quick_variant_prints_every_figure_and_removes_its_data(tmp_path: Path) -> None:
    work_root = tmp_path / "work"
    work_root.mkdir()
    out = tmp_path / "figures.json"
    # The quick variant, smaller: 2,000 objects, no empty-node baseline, short windows.
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--sizes",
            "2000",
            "--no-empty",
            "--idle-seconds",
            "2",
            "--window-seconds",
            "2",
            "--hq-seconds",
            "2",
            "--max-minutes",
            "5",
            "--work-root",
            str(work_root),
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("figure ") :]
    [result] = json.loads(out.read_text())["results"]
    assert result["n"] == 2000
    assert result["states"] == {
        "accepted": 600,
        "delivered": 1200,
        "archived": 100,
        "flagged": 20,
        "partial": 200,
    }
    for key, label, _unit, _how in figures():
        assert label in table, f"the table lacks {label!r}:\n{table}"
        assert isinstance(result.get(key), int | float), f"{key} was not measured: {result}"
    assert "in-process" in table
    # Every data directory, sink and config is gone with the work directory.
    assert list(work_root.iterdir()) == []


def test_refuses_without_room_saying_how_much_it_needs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--sizes", "1000000000000", "--work-root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "needs" in done.stderr and "GiB" in done.stderr and "inodes" in done.stderr
    assert list(tmp_path.iterdir()) == []
