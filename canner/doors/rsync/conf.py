"""rsyncd.conf for canner's rsync intake, from the shipped templates (``conf/rsyncd/``).

Pure: :func:`rsyncd_conf` fills ``rsyncd.conf`` (the global part) once and ``module.conf`` once
per project, in the order of canner.toml.  The placeholders are ``$runtime_dir`` in the global
part and ``$project``, ``$path``, ``$max_connections`` in a module; an unknown one is a
``KeyError``, so a template and this code cannot drift apart silently.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from string import Template

GLOBAL_TEMPLATE = "rsyncd.conf"
MODULE_TEMPLATE = "module.conf"


def rsyncd_conf(
    global_template: str,
    module_template: str,
    *,
    projects: Iterable[str],
    incoming: Path,
    max_connections: int,
    runtime_dir: Path,
) -> str:
    """The daemon's whole configuration: one module per project, writing into
    ``incoming/<project>``."""
    parts = [Template(global_template).substitute(runtime_dir=str(runtime_dir))]
    module = Template(module_template)
    for project in projects:
        parts.append(
            module.substitute(
                project=project,
                path=str(incoming / project),
                max_connections=str(max_connections),
            )
        )
    return "".join(parts)
