"""The shipped ``conf/haproxy/canner.cfg`` passes ``haproxy -c`` unchanged, once the certificate
and the map are where its header and docs/several-nodes.md say: ``/etc/haproxy/certs/canner.pem``
and ``/etc/haproxy/canner-nodes.map``.

The check runs in a private mount namespace with a tmpfs over ``/etc/haproxy``, so the test
places both files at their real paths without touching the machine's own ``/etc/haproxy``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.e2e.cluster_support import SHIPPED_CFG, SHIPPED_MAP, require

CERT_PATH = "/etc/haproxy/certs/canner.pem"
MAP_PATH = "/etc/haproxy/canner-nodes.map"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare for a private mount namespace",
)


def self_signed_pem() -> bytes:
    """A certificate for canner.example and its private key, in one PEM (HAProxy's crt)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "canner.example")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("canner.example")]), False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


# In the namespace: a tmpfs over /etc/haproxy, both files placed as documented, then the check.
PLACE_AND_CHECK = f"""
set -e
mount -t tmpfs canner-test /etc/haproxy
mkdir -m 0700 /etc/haproxy/certs
install -m 0600 "$1" {CERT_PATH}
install -m 0644 "$2" {MAP_PATH}
if [ "$4" = place ]; then exec "$3" -c -f "$5"; fi
rm {CERT_PATH} {MAP_PATH}
exec "$3" -c -f "$5"
"""


def check(tmp_path: Path, placed: bool) -> subprocess.CompletedProcess[str]:
    pem = tmp_path / "canner.pem"
    pem.write_bytes(self_signed_pem())
    haproxy = require("haproxy")
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            PLACE_AND_CHECK,
            "sh",
            pem,
            SHIPPED_MAP,
            haproxy,
            "place" if placed else "none",
            SHIPPED_CFG,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_shipped_haproxy_config_passes_with_cert_and_map_placed(tmp_path: Path) -> None:
    done = check(tmp_path, placed=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Configuration file is valid" in done.stdout + done.stderr


def test_shipped_haproxy_config_names_both_paths(tmp_path: Path) -> None:
    """Without them the check fails naming each: the paths the docs give are the file's."""
    done = check(tmp_path, placed=False)
    assert done.returncode != 0
    assert f"unable to stat SSL certificate from file '{CERT_PATH}'" in done.stderr
    assert f"failed to open pattern file <{MAP_PATH}>" in done.stderr
