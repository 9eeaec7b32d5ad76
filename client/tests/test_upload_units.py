"""Unit tests of the client's pure parts: receipts, hashing, retry timing, resume state, CLI
argument handling."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import blake3
import pytest
from upload_support import make_file

from canner_client import Receipt
from canner_client import hashing as hashing_module
from canner_client.cli import (
    JsonReporter,
    PlainReporter,
    RichReporter,
    build_parser,
    main,
    parse_size,
)
from canner_client.client import ProgressEvent, _parse_status
from canner_client.errors import DeadlineExceeded
from canner_client.hashing import blake3_file
from canner_client.retry import Backoff, RetryPolicy, parse_retry_after
from canner_client.state import StateStore, UploadSession

OID = "0123456789abcdef0123456789abcdef"
DOC = {
    "id": f"receipt:{OID}",
    "issuer": "https://canner.test",
    "object_id": OID,
    "checksum": "blake3:" + "ab" * 32,
    "size_bytes": 12,
    "accepted_at": 1796000000,
}


def test_receipt_round_trips_the_servers_bytes() -> None:
    raw = json.dumps(DOC, separators=(",", ":")).encode()
    header = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    receipt = Receipt.from_header(header)
    assert receipt.to_json().encode() == raw
    assert Receipt.from_json(raw) == receipt
    assert list(json.loads(receipt.to_json())) == list(DOC)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"extra": 1}, "exactly the fields"),
        ({"id": "receipt:other"}, "does not name"),
        ({"size_bytes": "12"}, "size_bytes"),
        ({"checksum": "sha256:00"}, "blake3"),
    ],
)
def test_receipt_rejects_what_hq_would(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Receipt.from_dict({**DOC, **change})


def test_receipt_header_must_be_base64url() -> None:
    with pytest.raises(ValueError, match="base64url"):
        Receipt.from_header("eyJ+/==")


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_blake3_file_matches_one_shot_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # Small windows, so that window edges fall inside these files.
    monkeypatch.setattr(hashing_module, "WINDOW", 4096)
    path = make_file(tmp_path / "f", size, seed=size)
    seen: list[int] = []
    checksum, hashed = blake3_file(str(path), seen.append)
    assert checksum == "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()
    assert hashed == size
    assert seen == sorted(seen) and (not size or seen[-1] == size)


def test_blake3_file_falls_back_to_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unmappable(*args: object, **kwargs: object) -> int:
        raise OSError("no mmap here")

    monkeypatch.setattr(hashing_module, "_hash_mapped", unmappable)
    path = make_file(tmp_path / "f", 3 << 20, seed=7)
    checksum, hashed = blake3_file(str(path))
    assert checksum == "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()
    assert hashed == 3 << 20


def test_retry_after_seconds_and_dates() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=90.0) == 10.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=200.0) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_backoff_grows_with_jitter_and_caps() -> None:
    policy = RetryPolicy(initial=1.0, maximum=8.0, jitter=0.5)
    assert [policy.delay(n, rng=lambda: 0.0) for n in range(1, 6)] == [1, 2, 4, 8, 8]
    assert policy.delay(3, rng=lambda: 1.0) == 2.0


def test_backoff_honours_retry_after_capped_and_the_deadline() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    backoff = Backoff(
        RetryPolicy(initial=0.1, maximum=1.0, max_retry_after=5.0, deadline=12.0),
        sleep=sleep,
        clock=lambda: now[0],
    )
    backoff.wait("busy", retry_after=3.0)
    backoff.wait("busy", retry_after=60.0)  # capped at 5
    assert slept == [3.0, 5.0]
    with pytest.raises(DeadlineExceeded, match="busy"):
        backoff.wait("still busy", retry_after=5.0)  # would end past the deadline
    assert slept == [3.0, 5.0], "it gave up instead of sleeping past the deadline"


def _session(path: str, project: str = "example") -> UploadSession:
    return UploadSession(
        files_url="http://127.0.0.1:1/files/",
        project=project,
        path=path,
        size=3,
        mtime_ns=5,
        checksum="blake3:" + "00" * 32,
        filename="f",
        upload_url=f"http://127.0.0.1:1/files/{OID}",
        created_at=1.0,
    )


def test_state_store_saves_loads_and_removes(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    session = _session("/data/f")
    assert store.load(session.files_url, "example", "/data/f") is None
    saved = store.save(session)
    assert saved.parent == tmp_path / "state"
    assert store.load(session.files_url, "example", "/data/f") == session
    assert session.object_id == OID
    # Another project or another receiver is another upload.
    assert store.load(session.files_url, "other", "/data/f") is None
    assert store.load("http://elsewhere/files/", "example", "/data/f") is None
    assert store.sessions() == [session]
    store.remove(session)
    assert store.load(session.files_url, "example", "/data/f") is None
    assert list((tmp_path / "state").iterdir()) == []


def test_state_store_reports_a_corrupt_state(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    session = _session("/data/f")
    store.save(session).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        store.load(session.files_url, "example", "/data/f")


def test_parse_size() -> None:
    assert parse_size("64M") == 64 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    for bad in ("0", "x", "1.5G", "-1"):
        with pytest.raises(Exception, match="not a size"):
            parse_size(bad)


@pytest.mark.parametrize(
    "option",
    ["--deadline", "--connect-timeout", "--read-timeout", "--acceptance-timeout", "--log-interval"],
)
@pytest.mark.parametrize(
    "text, seconds", [("20s", 20.0), ("1h30m", 5400.0), ("500ms", 0.5), ("90", 90.0), ("0", 0.0)]
)
def test_time_options_take_the_config_duration_syntax(
    option: str, text: str, seconds: float
) -> None:
    """``--deadline 20s``: the durations of canner's config (Go syntax), or plain seconds."""
    args = build_parser().parse_args(["--project", "p", option, text, "/etc/hostname"])
    assert getattr(args, option[2:].replace("-", "_")) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["20 s", "1d", "-1s", "s", "", "-5", "1h 30m"])
def test_a_bad_duration_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "http://127.0.0.1:1", "--project", "p", "--deadline", text, "/etc/hostname"])
    assert exit_info.value.code == 2
    assert "--deadline" in capsys.readouterr().err


def test_status_document_parts() -> None:
    class Response:
        def json(self) -> object:
            return {
                **DOC,
                "project": "example",
                "delivery": {"state": "delivered"},
                "payload": {"present": False, "purged_at": 5},
                "hq": {"released_at": None},
            }

    status = _parse_status(OID, Response())  # type: ignore[arg-type]
    assert status.receipt == Receipt.from_dict(DOC)
    assert status.project == "example"
    assert status.delivery == {"state": "delivered"}
    assert status.payload["purged_at"] == 5
    assert status.archived is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "http://127.0.0.1:1", "--project", "p", "/nonexistent/file"],
        ["--url", "http://127.0.0.1:1", "/etc/hostname"],
        ["--url", "http://127.0.0.1:1", "--project", "p", "--chunk-size", "0", "/etc/hostname"],
        ["--url", "ftp://x", "--project", "p", "/etc/hostname"],
        ["--url", "http://x", "--project", "p", "--filename", "a", "/etc/hostname", "/etc/hosts"],
    ],
)
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip()


def _events(path: str) -> list[ProgressEvent]:
    return [
        ProgressEvent(path, "hashing", 0, 100),
        ProgressEvent(path, "hashing", 100, 100),
        ProgressEvent(path, "uploading", 0, 100, OID),
        ProgressEvent(path, "waiting", 0, 100, OID, "PATCH: 503 busy"),
        ProgressEvent(path, "uploading", 40, 100, OID),
        ProgressEvent(path, "uploading", 100, 100, OID),
        ProgressEvent(path, "done", 100, 100, OID),
    ]


def test_json_progress_lines(tmp_path: Path) -> None:
    path = str(make_file(tmp_path / "f", 100))
    out = io.StringIO()
    reporter = JsonReporter([path], out)
    for ev in _events(path):
        reporter.event(ev)
    reporter.failed(path, "refused")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d["phase"] for d in lines] == [
        "hashing", "uploading", "waiting", "uploading", "done", "failed"
    ]  # fmt: skip
    assert lines[2]["message"] == "PATCH: 503 busy" and lines[2]["object_id"] == OID
    assert lines[-1] == {"file": path, "phase": "failed", "message": "refused"}


def test_plain_progress_lines(tmp_path: Path) -> None:
    path = str(make_file(tmp_path / "f", 100))
    out = io.StringIO()
    reporter = PlainReporter([path], out, interval=0)
    reporter.start()
    for ev in _events(path):
        reporter.event(ev)
    reporter.stop()
    assert out.getvalue().splitlines() == [
        "canner-upload: f: hashing (100 B)",
        "canner-upload: f: uploading",
        "canner-upload: f: retrying: PATCH: 503 busy",
        "canner-upload: f: uploading",
        f"canner-upload: f: receipted as {OID}",
    ]


def test_live_display_runs(tmp_path: Path) -> None:
    path = str(make_file(tmp_path / "f", 100))
    out = io.StringIO()
    reporter = RichReporter([path], out)
    reporter.start()
    for ev in _events(path):
        reporter.event(ev)
    reporter.failed(path, "refused [bold]for[/] a test")
    reporter.stop()
    assert f"canner-upload: {path}: refused [bold]for[/] a test\n" in out.getvalue()
