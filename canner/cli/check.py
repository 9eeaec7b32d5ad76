"""``canner check-config``: validate as the daemons do, print the resolved config and where
each project's files would go."""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from canner.cli import base
from canner.cli.base import Io, dump
from canner.config import Config, ConfigError, check_data_dir, load_config
from canner.hq import releases as rel
from canner.sinks.directory import DirectoryDelivery, destination_root
from canner.sinks.ia.config import IADelivery
from canner.sinks.ia.credentials import CredentialsError, load_credentials, loose_permissions
from canner.sinks.plan import PlanError, format_date, plan_package_file, plan_upload
from canner.store.datadir import DELIVER_WRITES, check_writes

EXAMPLE_FILENAME = "example.warc.gz"
EXAMPLE_HEX = "0123456789abcdef0123456789abcdef"
EMPTY_MD5 = "d41d8cd98f00b204e9800998ecf8427e"


# Who the packaged units run the daemons as (debian/canner.canner-*.service: ``User=canner``).
DAEMON_ACCOUNT = "canner"


@frozen
class Account:
    """A user to act as: uid, primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]


def daemon_account(config_path: Path, data_dir: Path) -> Account | None:
    """Run as root, the user the daemons run as: for the packaged config (``DEFAULT_CONFIG``,
    which the packaged units start the daemons on) the ``canner`` account when it exists (their
    ``User=``), else the owner of ``data_dir`` (whom every other command runs as); None when not
    root, or when that user is root."""
    if os.geteuid() != 0:
        return None
    user = None
    if config_path.resolve() == base.DEFAULT_CONFIG.resolve():
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(DAEMON_ACCOUNT)
    if user is None:  # another config (daemons started by hand), or no such account: the owner
        owner = data_dir.stat()
        try:
            user = pwd.getpwuid(owner.st_uid)
        except KeyError:  # an owner without a name: its ids alone
            return Account(owner.st_uid, owner.st_gid, ()) if owner.st_uid != 0 else None
    if user.pw_uid == 0:
        return None
    groups = tuple(os.getgrouplist(user.pw_name, user.pw_gid))
    return Account(user.pw_uid, user.pw_gid, groups)


@contextlib.contextmanager
def acting_as(account: Account | None) -> Iterator[None]:
    """Within the block, this process's effective user, group and groups are ``account``'s (so
    the kernel lets it write exactly what that user may write); root's again after it.  None:
    unchanged."""
    if account is None:
        yield
        return
    egid, groups = os.getegid(), os.getgroups()
    os.setgroups(list(account.groups))
    os.setegid(account.gid)
    os.seteuid(account.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(groups)


# -- check-config ------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def config_json(config: Config) -> dict[str, Any]:
    """The resolved config as JSON (paths absolute, durations in seconds; no secrets in it)."""
    doc = attrs.asdict(config, value_serializer=lambda _inst, _field, v: _jsonable(v))
    doc["projects"] = {
        pid: {"delivery": p["delivery"], "packaging": p["packaging"]}
        for pid, p in doc["projects"].items()
    }
    return doc


def delivery_example(config: Config, project_id: str, now: float) -> dict[str, Any] | None:
    """Where an object uploaded now would go; raises ConfigError naming the key at fault."""
    delivery = config.projects[project_id].delivery
    if delivery is None:
        return None
    packaging = config.projects[project_id].packaging
    if packaging.megawarc:
        try:
            plan = plan_package_file(
                delivery,
                project_id,
                EXAMPLE_HEX,
                format_date(int(now)),
                ".megawarc.warc.gz",
                0,
                EMPTY_MD5,
            )
        except PlanError as e:
            raise ConfigError(f"projects.{project_id}.delivery", str(e)) from None
        package = {
            "package": EXAMPLE_HEX,
            "batch_date": format_date(int(now)),
            "identifier": plan.identifier,
            "remote_name": plan.remote_name,
        }
        if isinstance(delivery, IADelivery):
            package["url"] = f"{delivery.metadata_url.rstrip('/')}/details/{plan.identifier}"
        return package
    object_id = f"{config.node_prefix}-{EXAMPLE_HEX}" if config.node_prefix else EXAMPLE_HEX
    try:
        plan = plan_upload(
            delivery, project_id, object_id, EXAMPLE_FILENAME, int(now), 0, EMPTY_MD5
        )
    except PlanError as e:
        raise ConfigError(f"projects.{project_id}.delivery", str(e)) from None
    example = {
        "object_id": object_id,
        "filename": EXAMPLE_FILENAME,
        "accepted_at": int(now),
        "identifier": plan.identifier,
        "remote_name": plan.remote_name,
    }
    if isinstance(delivery, DirectoryDelivery):
        root = destination_root(project_id, delivery)
        example["path"] = str(root / plan.identifier / plan.remote_name)
    elif isinstance(delivery, IADelivery):
        example["url"] = f"{delivery.metadata_url.rstrip('/')}/details/{plan.identifier}"
    return example


def _credential_warnings(config: Config) -> list[str]:
    warnings = []
    for pid, project in config.projects.items():
        if project.delivery is None:
            warnings.append(f"projects.{pid}: no delivery table, artifacts stay local")
            continue
        if not isinstance(project.delivery, IADelivery):
            continue  # delivery_example checked a directory sink's path
        path = project.delivery.credentials
        key = f"projects.{pid}.delivery.credentials"
        if path.exists() and not os.access(path, os.R_OK):
            warnings.append(f"{key}: {path} is not readable by this user (not checked)")
            continue
        try:
            load_credentials(path)
        except CredentialsError as e:
            raise ConfigError(key, str(e)) from None
        if (loose := loose_permissions(path)) is not None:
            warnings.append(f"{key}: {loose}")
    if config.hq is not None:
        try:
            rel.TokenFile(config.hq.tokens).current()
        except OSError as e:
            raise ConfigError(
                "hq.tokens", f"cannot read {config.hq.tokens}: {e.strerror}"
            ) from None
        except rel.TokenFileError as e:
            raise ConfigError("hq.tokens", f"{config.hq.tokens}: {e}") from None
    if config.ledger is not None:
        try:
            load_credentials(config.ledger.credentials)
        except CredentialsError as e:
            raise ConfigError("ledger.credentials", str(e)) from None
        if (loose := loose_permissions(config.ledger.credentials)) is not None:
            warnings.append(f"ledger.credentials: {loose}")
    if config.manhole is not None and not os.access(config.manhole.authorized_keys, os.R_OK):
        warnings.append(
            f"manhole.authorized_keys: {config.manhole.authorized_keys} is not readable"
            " (the daemons refuse to start with a manhole and no keys)"
        )
    return warnings


def _listen_problem(description: str) -> str | None:
    """Why ``description`` is no Twisted server endpoint this process could listen on."""
    from twisted.internet import endpoints, reactor

    if description.startswith("systemd:"):
        return None  # sockets passed by systemd exist only under systemd
    try:
        endpoints.serverFromString(reactor, description)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return f"{description!r} is not a Twisted endpoint description: {e or type(e).__name__}"
    return None


def check_config(config_path: Path, io: Io) -> int:
    """Validate as the daemons do at start (config, listen endpoint, the data directory as
    their user: :func:`daemon_account`), then print the resolved config, example destinations
    and warnings."""
    config = load_config(config_path)
    problem = _listen_problem(config.listen)
    if problem is not None:
        raise ConfigError("listen", problem)
    check_data_dir(config)
    # The daemons' own start-up check, as their user: a data directory they would refuse to
    # start on fails here with their line (the path, the user and the fix).
    with acting_as(daemon_account(config_path, config.data_dir)):
        check_writes(config, DELIVER_WRITES)
    now = io.now()
    examples = {pid: delivery_example(config, pid, now) for pid in config.projects}
    warnings = _credential_warnings(config)
    dump(
        io,
        {
            "config_file": str(config_path.resolve()),
            "config": config_json(config),
            "delivery_examples": examples,
            "warnings": warnings,
        },
    )
    for warning in warnings:
        io.err.write(f"canner: warning: {warning}\n")
    return 0
