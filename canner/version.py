"""The installed canner version (``canner --version``, the status page, ``canner_build_info``)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("canner")
    except metadata.PackageNotFoundError:
        return "0+unknown"
