"""twistd finds both plugins (the check that catches a packaging mistake dropping the dropin)."""

from __future__ import annotations

from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins


def test_twistd_lists_the_canner_plugins() -> None:
    """canner-receiver and canner-deliver are twistd commands."""
    names = {plugin.tapname for plugin in getPlugins(IServiceMaker)}
    assert {"canner-receiver", "canner-deliver"} <= names
