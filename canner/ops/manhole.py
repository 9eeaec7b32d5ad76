"""The operator's manhole: a Python shell inside a running daemon, over SSH only.

Off unless ``[manhole]`` is configured.  Each daemon listens on a unix socket in its runtime
directory (socket 0600, directory 0750, so only the daemon's user and root get near it) and,
optionally, on a loopback TCP port.  Both listeners speak SSH (``twisted.conch``): the host key is
an Ed25519 key kept in ``host_key`` (generated on first start), and clients log in with a key
listed in the ``authorized_keys`` file (any user name; the file is re-read at each login).

The shell's namespace holds the daemon's objects (``config``, ``services``, ``index``, ``metrics``
and the role's own: the receiver's ``intake``/``acceptance``/``uploads``/``receipts``, the deliver
process's ``outbound``/``sinks``) and helpers that return Deferreds, which the shell prints when
they fire: ``lookup(object_id)``, ``stuck(attempts_over=5)`` and ``survey()``.  ``conf/manhole.md``
is the operator's note.
"""

from __future__ import annotations

import os
import stat
import warnings
from functools import partial
from pathlib import Path
from typing import Any

from attrs import define
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from twisted.application import strports
from twisted.application.service import IService, MultiService
from twisted.conch import manhole, manhole_ssh
from twisted.conch.insults import insults
from twisted.conch.interfaces import IConchUser
from twisted.conch.ssh import keys
from twisted.cred.portal import Portal
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from canner import fs
from canner.blocking import BlockingRunner
from canner.config import Config, ConfigError, ManholeConfig
from canner.delivery import index as sql
from canner.ids import ObjectIds
from canner.ops import inventory

with warnings.catch_warnings():
    # twisted.conch.checkers tries ``import spwd`` (deprecated in Python 3.11) for its /etc/shadow
    # checker, which canner never uses.
    warnings.filterwarnings("ignore", "'spwd' is deprecated", DeprecationWarning)
    from twisted.conch.checkers import (
        IAuthorizedKeysDB,
        SSHPublicKeyChecker,
        readAuthorizedKeyFile,
    )

log = Logger()

HOST_KEY = "manhole.host_key"


class ManholeSetupError(ConfigError):
    """The manhole cannot start: a file or directory its config names is unusable."""


# -- files -------------------------------------------------------------------------------------


def prepare_socket_dir(directory: Path, key: str = "manhole socket") -> None:
    """Make sure ``directory`` exists with mode 0750 and is not shared with other users.

    A missing directory is created 0750.  An existing one that others may enter is tightened to
    0750 when this process owns it; a shared one (sticky, like ``/tmp``) or one owned by someone
    else and open to others is refused.  Blocking; run at start-up.
    """
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as e:
        raise ManholeSetupError(key, f"cannot create {directory}: {e.strerror}") from None
    if info.st_mode & stat.S_ISVTX:
        raise ManholeSetupError(
            key, f"{directory} is a shared directory: give the socket a directory of its own"
        )
    if stat.S_IMODE(info.st_mode) & 0o027:
        if info.st_uid != os.geteuid():
            raise ManholeSetupError(
                key, f"{directory} is open to other users and not ours to tighten: make it 0750"
            )
        os.chmod(directory, 0o750)


def load_host_key(path: Path) -> keys.Key:
    """The SSH host key at ``path``; a new Ed25519 key is written there first if none exists.

    The private key is created 0600 and appears atomically (two daemons starting at once end up
    with the same key); ``<path>.pub`` holds the public half for ``known_hosts``.  Blocking.
    """
    try:
        if not path.exists():
            private = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
            _publish_private(path, private)
        key: keys.Key = keys.Key.fromString(path.read_bytes())
    except OSError as e:
        raise ManholeSetupError(HOST_KEY, f"{path}: {e.strerror}") from None
    except keys.BadKeyError as e:
        raise ManholeSetupError(HOST_KEY, f"{path} is not a usable key: {e}") from None
    public = key.public().toString("OPENSSH") + b" canner-manhole\n"
    pub_path = path.with_name(path.name + ".pub")
    try:
        current = pub_path.read_bytes()
    except FileNotFoundError:
        current = None
    if current != public:
        try:
            fs.replace_file(path.parent, pub_path.name, public, sync=True)
        except OSError as e:
            log.warn("cannot write {path}: {error}", path=str(pub_path), error=e.strerror)
    return key


def _publish_private(path: Path, data: bytes) -> None:
    """Create ``path`` (0600) holding ``data`` durably, unless it appeared meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{fs.TEMP_PREFIX}{path.name}-{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)
    fs.fsync_dir(path.parent)


@implementer(IAuthorizedKeysDB)
@define(eq=False)
class AuthorizedKeysFile:
    """The keys in one ``authorized_keys`` file, for any user name.

    Read at each login (a small file, read once per login attempt) so that adding or removing
    a key needs no restart.  A missing file authorizes nobody.
    """

    path: Path

    def getAuthorizedKeys(self, avatar_id: bytes) -> list[keys.Key]:
        try:
            with open(self.path, "rb") as f:
                return list(readAuthorizedKeyFile(f))
        except OSError as e:
            log.warn(
                "manhole login refused: cannot read {path}: {error}",
                path=str(self.path),
                error=e.strerror,
            )
            return []


# -- the helpers in the shell ------------------------------------------------------------------


@define(eq=False)
class OperatorHelpers:
    """``lookup``, ``stuck`` and ``survey`` for the shell: each returns a Deferred."""

    _data_dir: Path
    _ids: ObjectIds
    _run: BlockingRunner
    _clock: Any

    def lookup(self, object_id: str) -> Deferred[dict[str, Any]]:
        """Receipt, origin, tus sidecar, payload presence, delivery row and attempts of
        ``object_id`` (or of the one object a prefix of at least 4 characters names)."""

        if not self._ids.is_valid(object_id):
            inventory.id_prefix(object_id)  # refuses what cannot be an id at once

        def find() -> dict[str, Any]:
            oid = inventory.resolve_id(self._data_dir, self._ids, object_id)
            return inventory.lookup_object(self._data_dir, oid)

        return self._run(find)

    def stuck(
        self, attempts_over: int = inventory.STUCK_ATTEMPTS
    ) -> Deferred[list[dict[str, Any]]]:
        """Deliveries in retry_wait that need an operator or failed more than ``attempts_over``,
        and delivered ones flagged before verification."""

        def rows() -> list[dict[str, Any]]:
            path = self._data_dir / inventory.INDEX_NAME
            found = inventory.read_index(path, inventory.stuck_rows, attempts_over)
            return [row.as_dict() for row in found]

        return self._run(rows)

    def survey(self) -> Deferred[dict[str, Any]]:
        """What ``canner status --json`` shows, taken now."""

        now = self._clock.seconds()

        def take() -> dict[str, Any]:
            return inventory.survey_json(inventory.take_survey(self._data_dir, self._ids, now))

        return self._run(take)

    def bind(self, namespace: dict[str, Any]) -> dict[str, Any]:
        namespace.update(lookup=self.lookup, stuck=self.stuck, survey=self.survey)
        return namespace


# -- the service -------------------------------------------------------------------------------


def _shell(namespace: dict[str, Any]) -> Any:
    return insults.ServerProtocol(manhole.ColoredManhole, namespace)


class _ShellSession(manhole_ssh.TerminalSession):
    """Twisted's terminal session, except that resizing the operator's terminal redraws the
    prompt, an end-of-file is ignored, where Twisted's raises NotImplementedError (an error
    in the log for every resize), and a session without a pty (``ssh -T``, a script piping its
    input) gets an 80x24 shell where Twisted's failed (``shell request failed on channel 0``)."""

    _terminal: Any = None
    # What getPty sets; a session that asked for no pty keeps these.
    width, height = 80, 24

    def openShell(self, proto: Any) -> None:
        self._terminal = self.chainedProtocolFactory()
        self.transportFactory(
            proto, self._terminal, IConchUser(self.original), self.width, self.height
        )

    def windowChanged(self, size: Any) -> None:
        self.height, self.width = size[:2]
        if self._terminal is not None:
            self._terminal.terminalProtocol.terminalSize(self.width, self.height)

    def eofReceived(self) -> None:
        pass


def ssh_factory(
    namespace: dict[str, Any], authorized_keys: Path, host_key: keys.Key
) -> manhole_ssh.ConchFactory:
    """An SSH server factory whose sessions are manhole shells over ``namespace``."""
    realm = manhole_ssh.TerminalRealm()
    realm.sessionFactory = _ShellSession
    # Called with no arguments for each session; Twisted types it as the protocol class.
    realm.chainedProtocolFactory = partial(_shell, namespace)  # type: ignore[assignment]
    checker = SSHPublicKeyChecker(AuthorizedKeysFile(authorized_keys))
    factory = manhole_ssh.ConchFactory(Portal(realm, [checker]))  # type: ignore[arg-type]
    # Instance attributes: ConchFactory's class-level dicts are shared by every factory.
    factory.publicKeys = {host_key.sshType(): host_key.public()}
    factory.privateKeys = {host_key.sshType(): host_key}  # type: ignore[dict-item]
    return factory


def unix_endpoint(path: Path) -> str:
    """A ``unix:`` endpoint string for ``path``: mode 0600, with a lock file against races."""
    escaped = str(path).replace("\\", "\\\\").replace(":", "\\:")
    return f"unix:{escaped}:mode=600:lockfile=1"


def manhole_service(
    config: ManholeConfig, role: str, namespace: dict[str, Any], reactor: Any
) -> IService | None:
    """The SSH listeners of ``role``'s manhole, or None when the role has none configured.

    Blocking set-up (socket directory, host key, the keys file) runs here, at start-up, and
    raises :class:`ManholeSetupError` (a :class:`~canner.config.ConfigError`) naming the key
    whose file or directory is unusable.
    """
    socket, ssh = config.socket_for(role), config.ssh_for(role)
    if socket is None and ssh is None:
        return None
    if not os.access(config.authorized_keys, os.R_OK):
        raise ManholeSetupError(
            "manhole.authorized_keys",
            f"cannot read {config.authorized_keys} (list the operators' SSH public keys there)",
        )
    factory = ssh_factory(namespace, config.authorized_keys, load_host_key(config.host_key))
    top = MultiService()
    if socket is not None:
        prepare_socket_dir(socket.parent, f"manhole.{role}_socket")
        strports.service(unix_endpoint(socket), factory, reactor=reactor).setServiceParent(top)
    if ssh is not None:
        strports.service(ssh, factory, reactor=reactor).setServiceParent(top)
    return top


# Old names an operator may have typed (in notes, in shell history), each to the name it now has.
ALIASES = {"scheduler": "outbound"}  # the OutboundService, before it had that name


def with_aliases(namespace: dict[str, Any]) -> dict[str, Any]:
    """``namespace`` with each old name of :data:`ALIASES` bound beside its new one."""
    old = {alias: namespace[name] for alias, name in ALIASES.items() if name in namespace}
    return {**namespace, **old}


def daemon_manhole(
    config: Config,
    role: str,
    services: IService,
    run: BlockingRunner,
    reactor: Any,
    **shell: Any,
) -> IService | None:
    """The role's manhole (None when not configured).  Its shell's namespace holds ``config``,
    ``services`` (the daemon's root), the role's objects in ``shell``, ``sql`` (the index's
    cursor functions) and the helpers."""
    if config.manhole is None:
        return None
    namespace = with_aliases({"config": config, "services": services, **shell, "sql": sql})
    helpers = OperatorHelpers(config.data_dir, config.object_ids, run, reactor)
    return manhole_service(config.manhole, role, helpers.bind(namespace), reactor)
