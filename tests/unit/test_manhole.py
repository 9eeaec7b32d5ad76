"""The manhole: its config, host key, socket directory, authorized keys, listeners and helpers;
and the ``[metrics]`` config section."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from twisted.conch.ssh import keys
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor

from canner.blocking import run_inline
from canner.checksum import parse_checksum
from canner.config import ConfigError, ManholeConfig, loopback_endpoint, parse_config
from canner.delivery import index as sql
from canner.delivery.index import AcceptedObject
from canner.ids import ObjectIds
from canner.ops.manhole import (
    AuthorizedKeysFile,
    ManholeSetupError,
    OperatorHelpers,
    load_host_key,
    manhole_service,
    prepare_socket_dir,
    ssh_factory,
    unix_endpoint,
    with_aliases,
)
from canner.store.receipts import Origin, Receipt, ReceiptStore
from canner.store.uploads import UploadInfo, UploadStore
from tests.fakes import SyncIndex, succeeded

BASE: dict[str, Any] = {
    "issuer": "https://canner.test",
    "min_free_bytes": 10,
    "projects": {"example": {}},
    "data_dir": "/srv/canner",
}
OID = "0123456789abcdef0123456789abcdef"
NOW = 1_784_764_800.0


def public_key_line() -> bytes:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


# -- config ------------------------------------------------------------------------------------


def test_manhole_is_off_without_its_section(tmp_path: Path) -> None:
    """No [manhole] table, no manhole; no [metrics] table, deliver serves no metrics."""
    config = parse_config(BASE, tmp_path)
    assert config.manhole is None
    assert config.metrics.deliver_listen is None and config.metrics.refresh == 15.0


def test_manhole_defaults(tmp_path: Path) -> None:
    """Sockets default to each role's runtime directory and the host key to the data dir."""
    config = parse_config({**BASE, "manhole": {"authorized_keys": "keys"}}, tmp_path)
    assert config.manhole == ManholeConfig(
        authorized_keys=tmp_path / "keys",
        host_key=Path("/srv/canner/manhole_host_key"),
        receiver_socket=Path("/run/canner/receiver/manhole.sock"),
        deliver_socket=Path("/run/canner/deliver/manhole.sock"),
    )


def test_manhole_options(tmp_path: Path) -> None:
    """An empty socket turns the socket off; SSH ports are per role and loopback only."""
    raw = {
        "authorized_keys": "/etc/canner/keys",
        "host_key": "hk",
        "receiver_socket": "",
        "deliver_ssh": "tcp:2223:interface=127.0.0.1",
    }
    manhole = parse_config({**BASE, "manhole": raw}, tmp_path).manhole
    assert manhole is not None
    assert manhole.host_key == tmp_path / "hk"
    assert manhole.socket_for("receiver") is None and manhole.ssh_for("receiver") is None
    assert manhole.ssh_for("deliver") == "tcp:2223:interface=127.0.0.1"


@pytest.mark.parametrize(
    ("section", "raw", "key"),
    [
        ("manhole", {}, "manhole.authorized_keys"),
        ("manhole", {"authorized_keys": "k", "colour": "x"}, "manhole.colour"),
        ("manhole", {"authorized_keys": 1}, "manhole.authorized_keys"),
        ("manhole", {"authorized_keys": "k", "receiver_ssh": "tcp:22"}, "manhole.receiver_ssh"),
        (
            "manhole",
            {"authorized_keys": "k", "deliver_ssh": "tcp:22:interface=0.0.0.0"},
            "manhole.deliver_ssh",
        ),
        (
            "manhole",
            {"authorized_keys": "k", "deliver_socket": "/" + "x" * 120},
            "manhole.deliver_socket",
        ),
        ("manhole", "yes", "manhole"),
        ("metrics", {"deliver_listen": "tcp:9464"}, "metrics.deliver_listen"),
        ("metrics", {"deliver_listen": "ssl:9464:interface=127.0.0.1"}, "metrics.deliver_listen"),
        ("metrics", {"refresh": "10ms"}, "metrics.refresh"),
        ("metrics", {"refresh": "soon"}, "metrics.refresh"),
        ("metrics", {"port": 1}, "metrics.port"),
    ],
)
def test_bad_operator_sections_name_the_key(
    section: str, raw: Any, key: str, tmp_path: Path
) -> None:
    """Every refusal names the offending key."""
    with pytest.raises(ConfigError) as e:
        parse_config({**BASE, section: raw}, tmp_path)
    assert e.value.key == key


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp:9464:interface=127.0.0.1",
        "tcp:9464:interface=127.0.0.2",
        r"tcp6:9464:interface=\:\:1",
        "unix:/run/canner/metrics.sock",
    ],
)
def test_loopback_endpoints_are_accepted(endpoint: str) -> None:
    """Loopback TCP (v4 or v6) and unix sockets are fine for operator surfaces."""
    assert loopback_endpoint(endpoint, "k") == endpoint


def test_metrics_section(tmp_path: Path) -> None:
    """``deliver_listen`` and ``refresh`` are read as given."""
    raw = {"deliver_listen": "tcp:9464:interface=127.0.0.1", "refresh": "5s"}
    metrics = parse_config({**BASE, "metrics": raw}, tmp_path).metrics
    assert metrics.deliver_listen == "tcp:9464:interface=127.0.0.1" and metrics.refresh == 5.0


# -- files -------------------------------------------------------------------------------------


def test_host_key_is_generated_once_private_and_published(tmp_path: Path) -> None:
    """A missing host key is created 0600 with a .pub beside it; later starts reuse it."""
    path = tmp_path / "state" / "host_key"
    key = load_host_key(path)
    assert key.type() == "Ed25519" and key.isPublic() is False
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pub = path.with_name("host_key.pub").read_bytes()
    assert (
        pub.startswith(b"ssh-ed25519 ")
        and pub.split()[1] == key.public().toString("OPENSSH").split()[1]
    )
    assert load_host_key(path) == key
    assert {p.name for p in path.parent.iterdir()} == {"host_key", "host_key.pub"}


def test_unusable_host_key_is_a_setup_error(tmp_path: Path) -> None:
    """Garbage in the host key file stops start-up with a message naming the file."""
    path = tmp_path / "host_key"
    path.write_text("not a key")
    with pytest.raises(ManholeSetupError, match="host_key"):
        load_host_key(path)


def test_socket_directory_is_created_0750(tmp_path: Path) -> None:
    """A missing runtime directory is created with mode 0750."""
    target = tmp_path / "run" / "receiver"
    prepare_socket_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o750


def test_open_socket_directory_of_ours_is_tightened(tmp_path: Path) -> None:
    """An existing directory we own that others may enter becomes 0750."""
    target = tmp_path / "open"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o777)
    prepare_socket_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o750


def test_shared_socket_directory_is_refused(tmp_path: Path) -> None:
    """A sticky, world-writable directory (like /tmp) is never used or changed."""
    target = tmp_path / "tmp"
    target.mkdir()
    os.chmod(target, 0o1777)
    with pytest.raises(ManholeSetupError, match="shared directory"):
        prepare_socket_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o1777


def test_authorized_keys_are_read_at_each_login(tmp_path: Path) -> None:
    """Any user name gets the keys in the file as it is now; a missing file authorizes nobody."""
    path = tmp_path / "keys"
    db = AuthorizedKeysFile(path)
    assert db.getAuthorizedKeys(b"anyone") == []
    line = public_key_line()
    path.write_bytes(b"# operators\n" + line + b" alice@example\n")
    found = db.getAuthorizedKeys(b"root")
    assert [k.toString("OPENSSH") for k in found] == [line]
    path.write_bytes(b"")
    assert db.getAuthorizedKeys(b"root") == []


# -- listeners ---------------------------------------------------------------------------------


def manhole_config(tmp_path: Path, **overrides: Any) -> ManholeConfig:
    keys_file = tmp_path / "authorized_keys"
    keys_file.write_bytes(public_key_line() + b"\n")
    values: dict[str, Any] = {
        "authorized_keys": keys_file,
        "host_key": tmp_path / "host_key",
        "receiver_socket": tmp_path / "run" / "receiver" / "manhole.sock",
        "deliver_socket": None,
        "receiver_ssh": "tcp:0:interface=127.0.0.1",
    }
    values.update(overrides)
    return ManholeConfig(**values)


def test_manhole_listens_on_a_0600_socket_and_loopback_ssh(tmp_path: Path) -> None:
    """The unix socket is mode 0600 with a pid lock file; SSH goes to the loopback port."""
    reactor = MemoryReactor()
    service = manhole_service(manhole_config(tmp_path), "receiver", {}, reactor)
    assert service is not None
    service.startService()
    try:
        [(address, _factory, _backlog, mode, want_pid)] = reactor.unixServers
        assert address == str(tmp_path / "run" / "receiver" / "manhole.sock")
        assert mode == 0o600 and want_pid
        [(port, _f, _b, interface)] = reactor.tcpServers
        assert (port, interface) == (0, "127.0.0.1")
        assert stat.S_IMODE((tmp_path / "run" / "receiver").stat().st_mode) == 0o750
    finally:
        service.stopService()


def test_a_role_without_listeners_gets_no_manhole(tmp_path: Path) -> None:
    """The deliver role here has neither a socket nor SSH: nothing is set up."""
    assert manhole_service(manhole_config(tmp_path), "deliver", {}, MemoryReactor()) is None
    assert not (tmp_path / "host_key").exists()


def test_unreadable_authorized_keys_stop_start_up(tmp_path: Path) -> None:
    """A manhole without its keys file is a start-up error naming the key."""
    config = manhole_config(tmp_path, authorized_keys=tmp_path / "missing")
    with pytest.raises(ManholeSetupError, match=r"manhole\.authorized_keys"):
        manhole_service(config, "receiver", {}, MemoryReactor())


def test_ssh_factory_keys_belong_to_the_instance(tmp_path: Path) -> None:
    """Host keys are set on the factory, never on ConchFactory's shared class dictionaries."""
    from twisted.conch.manhole_ssh import ConchFactory

    key = load_host_key(tmp_path / "hk")
    factory = ssh_factory({}, tmp_path / "keys", key)
    assert factory.privateKeys == {b"ssh-ed25519": key}
    assert factory.publicKeys[b"ssh-ed25519"] == key.public()
    assert ConchFactory.publicKeys == {} and ConchFactory.privateKeys == {}


def test_unix_endpoint_escapes_colons() -> None:
    """A path with a colon still makes one endpoint string."""
    assert unix_endpoint(Path("/run/a:b/m.sock")) == r"unix:/run/a\:b/m.sock:mode=600:lockfile=1"


# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    for sub in ("uploads", "receipts"):
        (tmp_path / sub).mkdir()
    return tmp_path


def test_lookup_stuck_and_survey_helpers(data_dir: Path) -> None:
    """lookup() joins receipt and delivery row; stuck() lists flagged retries; survey() counts."""
    receipts = ReceiptStore(data_dir / "receipts")
    receipt = Receipt(
        object_id=OID,
        issuer="https://canner.example",
        checksum=parse_checksum("blake3:" + "0" * 64),
        size_bytes=5,
        accepted_at=1000,
    )
    receipts.record_origin(OID, Origin("example", "a.warc"))
    receipts.commit(receipt)
    (data_dir / "uploads" / OID).write_bytes(b"hello")
    index = SyncIndex(data_dir / "delivery.sqlite")
    try:
        obj = AcceptedObject(OID, "example", "a.warc", 5, str(receipt.checksum), 1000)
        succeeded(index.run(sql.insert_objects, [obj], NOW))
        index.query(
            "UPDATE outbound SET state = 'retry_wait', attempts = 1, needs_operator = 1,"
            " last_error = '403 Forbidden'"
        )
        index.conn.commit()
        clock = Clock()
        clock.advance(NOW)
        helpers = OperatorHelpers(data_dir, ObjectIds(), run_inline, clock)
        namespace = helpers.bind({"config": None})
        assert set(namespace) == {"config", "lookup", "stuck", "survey"}
        found = succeeded(namespace["lookup"](OID))
        assert found["receipt"]["size_bytes"] == 5 and found["payload_present"] is True
        assert found["origin"] == {"object_id": OID, "project": "example", "filename": "a.warc"}
        assert found["delivery"]["state"] == "retry_wait"
        stuck = succeeded(namespace["stuck"]())
        assert [row["object_id"] for row in stuck] == [OID]
        assert stuck[0]["last_error"] == "403 Forbidden"
        survey = succeeded(namespace["survey"]())
        assert survey["states"]["retry_wait"] == 1 and survey["needs_operator"] == 1
        with pytest.raises(ValueError, match="not an object id"):
            namespace["lookup"]("../../etc/passwd")
    finally:
        index.close()


def test_the_old_name_scheduler_is_the_outbound_service() -> None:
    """``scheduler``, typed by operators before it was ``outbound``, names the same object, and
    only where the daemon has an outbound service."""
    outbound = object()
    namespace = with_aliases({"config": None, "outbound": outbound})
    assert namespace == {"config": None, "outbound": outbound, "scheduler": outbound}
    assert with_aliases({"config": None}) == {"config": None}


def test_lookup_of_an_upload_in_progress(data_dir: Path) -> None:
    """An upload without a receipt shows its sidecar and no delivery row."""
    uploads = UploadStore(data_dir / "uploads")
    uploads.create(UploadInfo(OID, 10, {"project": "example", "checksum": "blake3:" + "0" * 64}, 7))
    helpers = OperatorHelpers(data_dir, ObjectIds(), run_inline, Clock())
    found = succeeded(helpers.lookup(OID))
    assert found["receipt"] is None and found["delivery"] is None
    assert found["upload"]["size"] == 10 and found["upload"]["offset"] == 0
    assert succeeded(helpers.lookup(OID[:8] + "…")) == found, "a prefix as the page shows it"


def test_generated_key_loads_with_conch(tmp_path: Path) -> None:
    """The host key file is a standard OpenSSH private key."""
    path = tmp_path / "hk"
    load_host_key(path)
    assert keys.Key.fromFile(str(path)).type() == "Ed25519"
