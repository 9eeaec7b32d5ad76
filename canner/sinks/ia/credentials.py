"""IA-S3 credentials: read once at start-up, never logged, masked in every reason text."""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from urllib.parse import quote

from attrs import field, frozen


class CredentialsError(ValueError):
    """The credentials file is unreadable or malformed; the message never holds the secret."""


@frozen
class Credentials:
    """An IA-S3 key pair.  ``repr`` leaves the secret out."""

    access: str
    secret: str = field(repr=False)

    @property
    def authorization(self) -> str:
        return f"LOW {self.access}:{self.secret}"


def loose_permissions(path: Path) -> str | None:
    """Why ``path`` is readable by more than its owner (the guide says 0600), or None.

    A warning, not an error: the keys still work, and an unreadable or missing file is
    :func:`load_credentials`'s to report."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (
        f"{path} is mode {mode:04o}: other users of this host can read the IA keys;"
        f" chmod 0600 {path}"
    )


_KEY_TOKEN = re.compile(r"[\x21-\x7e]+")


def load_credentials(path: Path) -> Credentials:
    """Read IA-S3 keys (blocking; call at start-up).

    ``path`` is either an ``ia.ini`` (``[s3]`` with ``access`` and ``secret``), read with the
    ``internetarchive`` library's config reader (so ``IA_ACCESS_KEY_ID`` and
    ``IA_SECRET_ACCESS_KEY`` override it, as for the ``ia`` tool), or a two-line file: access key,
    then secret.  Raises :class:`CredentialsError`; its text never contains the secret.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CredentialsError(f"cannot read credentials {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise CredentialsError(f"credentials {path} are not UTF-8 text") from None
    if re.search(r"^\s*\[", text, re.MULTILINE):
        # Imported here: the library pulls in requests, which only this start-up step needs.
        from internetarchive.config import get_config

        try:
            config = get_config(config_file=str(path))
        except configparser.Error as e:
            # configparser quotes offending lines, which may hold the secret: say where only.
            line = getattr(e, "lineno", None)
            where = f" (line {line})" if line else ""
            raise CredentialsError(f"credentials {path} are not a valid ia.ini{where}") from None
        except ValueError as e:
            raise CredentialsError(f"credentials {path}: {e}") from None
        s3 = config.get("s3", {})
        access, secret = s3.get("access"), s3.get("secret")
        if not access or not secret:
            raise CredentialsError(f"credentials {path}: [s3] needs both 'access' and 'secret'")
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) != 2:
            raise CredentialsError(
                f"credentials {path}: expected an ia.ini with an [s3] section, or two lines "
                f"(access key, then secret), found {len(lines)} non-empty lines"
            )
        access, secret = lines
    if not _KEY_TOKEN.fullmatch(access) or ":" in access:
        raise CredentialsError(f"credentials {path}: the access key must be printable ASCII")
    if not _KEY_TOKEN.fullmatch(secret):
        raise CredentialsError(f"credentials {path}: the secret must be printable ASCII")
    return Credentials(access, secret)


def redact(text: str, secret: str) -> str:
    """``text`` with every form of ``secret`` (raw, percent-encoded) replaced by ``***``."""
    if not secret:
        return text
    for form in {secret, quote(secret, safe=""), quote(secret)}:
        text = text.replace(form, "***")
    return text
