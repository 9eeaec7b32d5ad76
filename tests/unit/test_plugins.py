"""twistd finds both plugins (the check that catches a packaging mistake dropping the dropin)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins


def test_twistd_lists_the_canner_plugins() -> None:
    """canner-receiver and canner-deliver are twistd commands."""
    names = {plugin.tapname for plugin in getPlugins(IServiceMaker)}
    assert {"canner-receiver", "canner-deliver"} <= names


@pytest.mark.parametrize("role", ["canner-receiver", "canner-deliver"])
def test_a_bad_config_refuses_to_start_naming_every_key(role: str, tmp_path: Path) -> None:
    """The real twistd command: exit 1, every bad key of the file named in one run."""
    config = tmp_path / "canner.toml"
    config.write_text(
        'issuer = "https://canner.test"\ndata_dir = "."\nmin_free_byte = 1\n'
        "delivery_concurrency = 0\n[projects.example]\n",
        encoding="utf-8",
    )
    twistd = Path(sys.executable).with_name("twistd")
    done = subprocess.run(
        [twistd, "--nodaemon", "--pidfile=", role, "--config", config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stderr.endswith(
        "canner: 2 config errors:\n"
        "  config key 'min_free_byte': unknown key (did you mean 'min_free_bytes'?)\n"
        "  config key 'delivery_concurrency': must be positive, not 0\n"
    ), done.stderr
