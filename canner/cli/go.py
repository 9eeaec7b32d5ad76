"""Moving from the Go canner: ``canner adopt-go`` (take its data directory over) and
``canner import-go-config`` (its config as canner TOML)."""

from __future__ import annotations

from pathlib import Path

from canner.cli.base import CommandError, Io, become_data_dir_owner, existing_data_dir
from canner.config import load_config
from canner.fs import fsync_dir, replace_file
from canner.go_canner.adopt import AdoptError, adopt
from canner.go_canner.config_import import convert_config


def adopt_go(config_path: Path, go_dir: Path, apply: bool, io: Io) -> int:
    """``canner adopt-go``: see :mod:`canner.go_canner.adopt`."""
    config = load_config(config_path)
    data_dir = existing_data_dir(config)
    become_data_dir_owner(data_dir)
    try:
        return adopt(go_dir, data_dir, config.listen, config.projects, apply, io.out, io.now)
    except AdoptError as e:
        raise CommandError(str(e)) from None


def import_go_config(source: Path, output: Path | None, io: Io) -> int:
    """Print (or write atomically to ``output``) the canner TOML of a Go canner config; each
    finding is one stderr line.  Exit 1, writing nothing, when a finding is an error."""
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"cannot read {source}: {e}") from None
    conversion = convert_config(text, source, source.resolve().parent)
    for finding in conversion.findings:
        io.err.write(f"canner: {finding.line()}\n")
    if conversion.toml is None:
        io.err.write(f"canner: {source}: not converted (errors above)\n")
        return 1
    if output is None:
        io.out.write(conversion.toml)
    else:
        directory = output.resolve().parent
        replace_file(directory, output.name, conversion.toml.encode("utf-8"), sync=True)
        fsync_dir(directory)
    return 0
