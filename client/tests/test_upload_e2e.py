"""The client against real ``twistd canner-receiver`` processes, directly and through the fault
proxy: every upload must end with the right receipt, identical to ``GET /api/v1/receipts/{id}``,
whatever happens to the network, the receiver or the client in between."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import blake3
import pytest
from e2e_support import ISSUER, Receiver, free_port
from fault_proxy import Fault, FaultProxy, final_patch, is_method
from upload_support import cli_command, make_file, run_cli

from canner_client import (
    Client,
    DeadlineExceeded,
    FileChanged,
    ProgressEvent,
    Receipt,
    RetryPolicy,
    Timeouts,
    UnknownObject,
    UploadRefused,
)

pytestmark = pytest.mark.e2e

MiB = 1 << 20
FAST_RETRY = RetryPolicy(initial=0.05, maximum=1.0, deadline=90.0)


def make_client(url: str, tmp_path: Path, **kwargs: object) -> Client:
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("timeout", Timeouts(connect=5.0, read=20.0, acceptance=60.0))
    return Client(url, state_dir=tmp_path / "state", **kwargs)  # type: ignore[arg-type]


def checksum_of(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(str(path))
    return "blake3:" + h.hexdigest()


def assert_receipted(receiver: Receiver, receipt: Receipt, path: Path, tmp_path: Path) -> None:
    """What a worker and HQ check: the receipt is the server's, for this file; state is gone."""
    served = receiver.get_receipt(receipt.object_id)
    assert served.status_code == 200
    assert served.content == receipt.to_json().encode(), "receipt differs from GET"
    assert receipt.issuer == ISSUER
    assert receipt.size_bytes == path.stat().st_size
    assert receipt.checksum == checksum_of(path)
    stored = receiver.uploads_dir / receipt.object_id
    assert stored.stat().st_size == receipt.size_bytes
    assert checksum_of(stored) == receipt.checksum
    state = tmp_path / "state"
    assert not state.exists() or not list(state.glob("*.json")), "resume state left behind"


def upload_id_of(proxy: FaultProxy) -> str:
    patches = proxy.seen("PATCH")
    assert patches, "no PATCH reached the proxy"
    return patches[0].target.rsplit("/", 1)[-1]


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- plain uploads --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, chunk",
    [(1, None), (MiB + 3, None), (5 * MiB + 1, 2 * MiB), (64 * MiB, 16 * MiB)],
    ids=["1B", "1MiB+3", "5MiB-chunked", "64MiB-chunked"],
)
def test_upload_sizes(receiver: Receiver, tmp_path: Path, size: int, chunk: int | None) -> None:
    path = make_file(tmp_path / "artifact.warc.gz", size, seed=size)
    events: list[ProgressEvent] = []
    client = make_client(receiver.base_url, tmp_path, chunk_size=chunk)
    receipt = client.upload(path, "example", progress=events.append)
    assert_receipted(receiver, receipt, path, tmp_path)
    phases = [e.phase for e in events]
    assert phases[0] == "hashing" and phases[-1] == "done"
    assert "uploading" in phases and "waiting" not in phases
    uploaded = [e.done for e in events if e.phase == "uploading"]
    assert uploaded == sorted(uploaded) and uploaded[-1] == size
    origin = json.loads((receiver.receipts_dir / f"{receipt.object_id}.meta.json").read_text())
    assert origin.get("filename") == "artifact.warc.gz"


def test_upload_one_gib(receiver: Receiver, tmp_path: Path) -> None:
    path = make_file(tmp_path / "big.warc", 1 << 30, seed=1)
    started = time.monotonic()
    receipt = make_client(receiver.base_url, tmp_path).upload(path, "example")
    print(f"1 GiB hashed, uploaded and accepted in {time.monotonic() - started:.1f}s")
    assert_receipted(receiver, receipt, path, tmp_path)


def test_cli_uploads_files_in_parallel(receiver: Receiver, tmp_path: Path) -> None:
    sizes = [1, 3 * MiB, 10 * MiB + 7, 7 * MiB]
    paths = [make_file(tmp_path / f"f{i}.bin", size, seed=i) for i, size in enumerate(sizes)]
    result = run_cli(
        "--url", receiver.base_url, "--project", "example", "--state-dir", tmp_path / "state",
        "-j", "3", "--json-progress", *paths,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(paths)
    receipts = [Receipt.from_json(line) for line in lines]
    for line, receipt in zip(lines, receipts):
        served = receiver.get_receipt(receipt.object_id).content
        assert line.encode() == served, "the printed line is the server's receipt, byte for byte"
    by_checksum = {r.checksum: r for r in receipts}
    for path in paths:
        assert_receipted(receiver, by_checksum[checksum_of(path)], path, tmp_path)
    progress = [json.loads(line) for line in result.stderr.splitlines()]
    done = {p["file"] for p in progress if p["phase"] == "done"}
    assert done == {str(p) for p in paths}
    assert {p["phase"] for p in progress} >= {"hashing", "uploading", "done"}


def test_cli_prints_receipts_in_the_order_of_its_arguments(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Several files of different sizes, the first held back by the network so it finishes
    last: stdout is still one receipt line per receipted file in argument order, each the
    server's bytes; a file that failed (an empty one, in the middle) has no line."""
    sizes = [5 * MiB + 1, 1, 0, 3 * MiB, 100_000]
    paths = [make_file(tmp_path / f"f{i}.bin", size, seed=i) for i, size in enumerate(sizes)]
    held = proxy.add(Fault("delay", final_patch(sizes[0]), delay=3.0))
    result = run_cli(
        "--url", proxy.url, "--project", "example", "--state-dir", tmp_path / "state",
        "-j", "5", "--json-progress", *paths,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert held.reached.is_set()
    progress = [json.loads(line) for line in result.stderr.splitlines()]
    finished = [p["file"] for p in progress if p["phase"] == "done"]
    assert finished[-1] == str(paths[0]), "the first file was not the last to finish"
    failed = [p for p in progress if p["phase"] == "failed"]
    assert [p["file"] for p in failed] == [str(paths[2])]
    assert "empty artifacts cannot be receipted" in failed[0]["message"]
    lines = result.stdout.splitlines()
    receipted = [p for p, size in zip(paths, sizes) if size]
    assert [Receipt.from_json(line).checksum for line in lines] == [
        checksum_of(p) for p in receipted
    ]
    for line, path in zip(lines, receipted):
        receipt = Receipt.from_json(line)
        assert line.encode() == receiver.get_receipt(receipt.object_id).content
        assert_receipted(receiver, receipt, path, tmp_path)


def test_ctrl_c_prints_the_receipts_already_in_hand(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Interrupted while the first file's body is stalled, after the second file got its
    receipt: that receipt is still printed (its resume state is gone, so it is printed now or
    never), and the first file, unfinished, has no line."""
    slow = make_file(tmp_path / "slow.bin", 4 * MiB, seed=1)
    fast = make_file(tmp_path / "fast.bin", 1000, seed=2)
    stall = proxy.add(Fault("stall", final_patch(4 * MiB), after=MiB))
    proc = subprocess.Popen(
        cli_command(
            "--url", proxy.url, "--project", "example", "--state-dir", tmp_path / "state",
            "-j", "2", "--json-progress", slow, fast,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert stall.reached.wait(30), "the slow file's PATCH never came"
        assert proc.stderr is not None
        for line in proc.stderr:
            doc = json.loads(line)
            if doc["phase"] == "done":
                assert doc["file"] == str(fast)
                break
        time.sleep(0.5)  # "done" is said just before the upload call returns its receipt
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    finally:
        stall.release.set()
        proc.kill()
        proc.wait()
    assert proc.returncode == 130
    lines = out.splitlines()
    assert len(lines) == 1
    receipt = Receipt.from_json(lines[0])
    assert receipt.checksum == checksum_of(fast)
    assert lines[0].encode() == receiver.get_receipt(receipt.object_id).content


def test_cli_reports_a_refusal_with_the_servers_message(receiver: Receiver, tmp_path: Path) -> None:
    path = make_file(tmp_path / "f.bin", 100)
    ok = make_file(tmp_path / "g.bin", 200)
    result = run_cli("--url", receiver.base_url, "--project", "nope", path)
    assert result.returncode == 1
    assert "unknown project 'nope'" in result.stderr and "400" in result.stderr
    assert result.stdout == ""
    # One refused file does not stop the others; the exit status still says something failed.
    result = run_cli(
        "--url", receiver.base_url, "--project", "example", "--state-dir", tmp_path / "s", ok, path,
        "--filename", "x",
    )  # fmt: skip
    assert result.returncode == 2, "--filename with two files is a usage error"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    result = run_cli(
        "--url", receiver.base_url, "--project", "example", "--state-dir", tmp_path / "s", ok, empty
    )
    assert result.returncode == 1
    assert len(result.stdout.splitlines()) == 1
    assert "empty artifacts cannot be receipted" in result.stderr


def test_deadline_ends_retrying_a_full_receiver(
    make_full_receiver: Receiver, tmp_path: Path
) -> None:
    """The receiver's free-space guard answers 429 Retry-After: 60; with a 3 s deadline the
    client gives up at once with a clear error instead of sleeping past its deadline."""
    path = make_file(tmp_path / "f.bin", 1000)
    client = make_client(
        make_full_receiver.base_url, tmp_path, retry=RetryPolicy(initial=0.05, deadline=3.0)
    )
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="429") as info:
        client.upload(path, "example")
    assert time.monotonic() - started < 3.0
    assert "429" in (info.value.last_error or "")
    result = run_cli(
        "--url", make_full_receiver.base_url, "--project", "example", "--deadline", "2",
        "--state-dir", tmp_path / "state", path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "gave up" in result.stderr and "429" in result.stderr


def test_status_reads_the_objects_endpoint(receiver: Receiver, tmp_path: Path) -> None:
    """The client's status() reads the receiver's GET /api/v1/objects/{id}: the receipt, the
    project and the three parts; an unknown id is UnknownObject."""
    path = make_file(tmp_path / "f.bin", 10)
    client = make_client(receiver.base_url, tmp_path)
    receipt = client.upload(path, "example")
    assert client.receipt(receipt.object_id) == receipt
    status = client.status(receipt.object_id)
    assert status.receipt == receipt and status.project == "example"
    assert status.delivery["state"] == "pending" and status.delivery["verified"] is False
    assert status.payload == {"present": True, "purged_at": None}
    assert status.hq == {"released_at": None} and status.archived is None
    with pytest.raises(UnknownObject):
        client.status("0" * 32)


# -- the network misbehaves ----------------------------------------------------------------------


def test_final_response_dropped(receiver: Receiver, proxy: FaultProxy, tmp_path: Path) -> None:
    size = 40 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=3)
    drop = proxy.add(Fault("drop", final_patch(size), drop_if_header="Artifact-Receipt"))
    receipt = make_client(proxy.url, tmp_path).upload(path, "example")
    assert drop.reached.is_set()
    assert_receipted(receiver, receipt, path, tmp_path)
    assert proxy.patch_bytes() == size, "no byte was sent twice"


def test_head_says_complete_before_the_receipt_exists(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    """The answer of the final PATCH is lost; HEAD says every byte is there but carries no
    receipt, and GET of the receipt says 404 (what the receiver answers while it still hashes):
    the client must ask again until the receipt appears, never report success without it."""
    size = 3 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=4)
    drop = proxy.add(Fault("drop", final_patch(size), drop_if_header="Artifact-Receipt"))
    after_drop = lambda r: r.method == "HEAD" and drop.reached.is_set()  # noqa: E731
    proxy.add(
        Fault("reply", after_drop, status=200,
              headers={"Upload-Offset": str(size), "Upload-Length": str(size)})
    )  # fmt: skip
    get = lambda r: r.method == "GET" and "/api/v1/receipts/" in r.target  # noqa: E731
    proxy.add(Fault("reply", get, status=404, times=2))
    events: list[ProgressEvent] = []
    receipt = make_client(proxy.url, tmp_path).upload(path, "example", progress=events.append)
    assert_receipted(receiver, receipt, path, tmp_path)
    assert "accepting" in [e.phase for e in events]
    empty_patches = [r for r in proxy.seen("PATCH") if r.length == 0]
    assert empty_patches and empty_patches[0].status == 204


def test_head_held_during_acceptance_is_waited_for(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A receiver may hold HEAD until a running acceptance ends.  After the last byte was sent,
    the client waits for that HEAD as long as for acceptance, not its short read timeout."""
    size = 2 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=13)
    drop = proxy.add(Fault("drop", final_patch(size), drop_if_header="Artifact-Receipt"))
    after_drop = lambda r: r.method == "HEAD" and drop.reached.is_set()  # noqa: E731
    proxy.add(Fault("delay", after_drop, delay=2.5))
    client = make_client(proxy.url, tmp_path, timeout=Timeouts(connect=5, read=1, acceptance=30))
    events: list[ProgressEvent] = []
    receipt = client.upload(path, "example", progress=events.append)
    assert_receipted(receiver, receipt, path, tmp_path)
    assert [r.status for r in proxy.seen("HEAD")] == [200], "one HEAD, answered"
    assert len([e for e in events if e.phase == "waiting"]) == 1, "only the lost answer"


def test_head_404_after_a_lost_response_asks_for_the_receipt(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    size = 2 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=5)
    drop = proxy.add(Fault("drop", final_patch(size), drop_if_header="Artifact-Receipt"))
    after_drop = lambda r: r.method == "HEAD" and drop.reached.is_set()  # noqa: E731
    proxy.add(Fault("reply", after_drop, status=404, times=5))
    receipt = make_client(proxy.url, tmp_path).upload(path, "example")
    assert_receipted(receiver, receipt, path, tmp_path)
    assert proxy.patch_bytes() == size


def test_connections_cut_mid_body(receiver: Receiver, proxy: FaultProxy, tmp_path: Path) -> None:
    size = 24 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=6)
    proxy.add(Fault("cut", is_method("PATCH"), after=5 * MiB, times=3))
    receipt = make_client(proxy.url, tmp_path).upload(path, "example")
    assert_receipted(receiver, receipt, path, tmp_path)
    patches = [r for r in proxy.seen("PATCH") if r.length]
    assert [r.fault for r in patches[:3]] == ["cut"] * 3
    offsets = [r.offset for r in patches]
    # Each retry resumes at the offset the receiver reports: never from the start, never past
    # what the cut let through (on a loaded machine the receiver may still be writing the cut
    # request's last bytes when the client asks, so the offset may lag the cut point).
    for before, after in zip(offsets[:3], offsets[1:4], strict=True):
        assert before < after <= before + 5 * MiB, f"each retry resumed where it stopped: {offsets}"
    assert size <= proxy.patch_bytes() <= size + 3 * 5 * MiB


def test_retry_after_on_429_and_503(receiver: Receiver, proxy: FaultProxy, tmp_path: Path) -> None:
    size = 4 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=7)
    proxy.add(Fault("reply", is_method("POST"), status=429, headers={"Retry-After": "1"}))
    proxy.add(Fault("reply", is_method("PATCH"), status=503, headers={"Retry-After": "1"}))
    proxy.add(Fault("reply", is_method("HEAD"), status=502))
    proxy.add(Fault("reply", is_method("PATCH"), status=423))
    events: list[ProgressEvent] = []
    started = time.monotonic()
    receipt = make_client(proxy.url, tmp_path).upload(path, "example", progress=events.append)
    elapsed = time.monotonic() - started
    assert_receipted(receiver, receipt, path, tmp_path)
    assert elapsed >= 2.0, "both Retry-After: 1 were honoured"
    waits = [e.message or "" for e in events if e.phase == "waiting"]
    assert any("429" in w for w in waits) and any("503" in w for w in waits)
    assert any("another request is writing" in w for w in waits)
    assert len(proxy.seen("POST")) == 2, "a refused creation is retried, not duplicated"


def test_stalled_body_is_a_retry_not_a_hang(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    size = 64 * MiB  # larger than what socket buffers hold, so that the sender blocks
    path = make_file(tmp_path / "f.bin", size, seed=8)
    stall = proxy.add(Fault("stall", is_method("PATCH"), after=8 * MiB))
    client = make_client(proxy.url, tmp_path, timeout=Timeouts(connect=1.0, read=2.0))
    started = time.monotonic()
    receipt = client.upload(path, "example")
    assert stall.reached.is_set()
    assert time.monotonic() - started < 30
    assert_receipted(receiver, receipt, path, tmp_path)
    assert proxy.seen("PATCH")[1].offset == 8 * MiB


# -- processes die ------------------------------------------------------------------------------


def test_receiver_killed_mid_upload(receiver: Receiver, proxy: FaultProxy, tmp_path: Path) -> None:
    size = 48 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=9)
    stall = proxy.add(Fault("stall", is_method("PATCH"), after=size // 2))
    result: dict[str, object] = {}

    def upload() -> None:
        try:
            result["receipt"] = make_client(proxy.url, tmp_path).upload(path, "example")
        except Exception as e:  # reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=upload)
    thread.start()
    try:
        assert stall.reached.wait(30)
        oid = upload_id_of(proxy)
        assert receiver.wait_offset(oid, size // 2, timeout=15) == size // 2
        receiver.kill(signal.SIGKILL)
        time.sleep(0.3)  # the client meets a dead receiver for a while
        receiver.start()
    finally:
        stall.release.set()
        thread.join(60)
    assert "error" not in result, result.get("error")
    receipt = result["receipt"]
    assert isinstance(receipt, Receipt)
    assert receipt.object_id == oid
    assert_receipted(receiver, receipt, path, tmp_path)
    resumed = [r for r in proxy.seen("PATCH") if r.length][1:]
    assert resumed and resumed[0].offset == size // 2, "resumed from what the receiver stored"


def _start_killable_upload(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path, path: Path, stop_at: int
) -> str:
    """Run ``canner-upload`` until the receiver stored ``stop_at`` bytes, SIGKILL it, and wait
    until the receiver let go of the upload; returns the upload's id."""
    stall = proxy.add(Fault("stall", is_method("PATCH"), after=stop_at))
    proc = subprocess.Popen(
        cli_command(
            "--url", proxy.url, "--project", "example", "--state-dir", tmp_path / "state", path
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert stall.reached.wait(30), "the client never sent a PATCH"
        oid = upload_id_of(proxy)
        assert receiver.wait_offset(oid, stop_at, timeout=15) == stop_at
        states = list((tmp_path / "state").glob("*.json"))
        assert len(states) == 1 and oid in states[0].read_text(), "resume state is on disk"
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    wait_for(lambda: f"connection lost on {oid}" in receiver.log_text(), 10, "the lost PATCH")
    return oid


def test_client_killed_and_rerun_resumes(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    size = 48 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=10)
    oid = _start_killable_upload(receiver, proxy, tmp_path, path, size // 3)
    before = proxy.patch_bytes()
    result = run_cli(
        "--url", proxy.url, "--project", "example", "--state-dir", tmp_path / "state", path
    )
    assert result.returncode == 0, result.stderr
    assert (
        f"canner-upload: f.bin: resuming at 16.0 MiB of 48.0 MiB (byte {size // 3})\n"
        in result.stderr
    )
    receipt = Receipt.from_json(result.stdout)
    assert receipt.object_id == oid, "the rerun finished the same upload"
    assert_receipted(receiver, receipt, path, tmp_path)
    assert proxy.patch_bytes() - before == size - size // 3, "stored bytes were not sent again"
    assert len(proxy.seen("POST")) == 1


def test_modified_file_is_refused(receiver: Receiver, proxy: FaultProxy, tmp_path: Path) -> None:
    size = 32 * MiB
    path = make_file(tmp_path / "f.bin", size, seed=11)
    _start_killable_upload(receiver, proxy, tmp_path, path, size // 4)
    requests_before = len(proxy.seen())
    command = ["--url", proxy.url, "--project", "example", "--state-dir", tmp_path / "state", path]

    # Same size and modification time, other bytes: only the checksum can tell.
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(b"\x00" if last != b"\x00" else b"\x01")
    assert path.stat().st_size == size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    result = run_cli(*command)
    assert result.returncode == 1
    assert "changed since its upload started" in result.stderr and "checksum" in result.stderr
    assert result.stdout == ""

    with open(path, "ab") as f:  # and now another size
        f.write(b"more")
    result = run_cli(*command)
    assert result.returncode == 1
    assert "changed since its upload started" in result.stderr
    assert len(proxy.seen()) == requests_before, "nothing was sent for a changed file"

    result = run_cli(*command, "--restart")
    assert result.returncode == 0, result.stderr
    receipt = Receipt.from_json(result.stdout)
    assert_receipted(receiver, receipt, path, tmp_path)


def test_library_refuses_a_changed_file(receiver: Receiver, tmp_path: Path) -> None:
    path = make_file(tmp_path / "f.bin", 1000)
    client = make_client(receiver.base_url, tmp_path)
    # A resume state as a killed worker leaves it: created, nothing sent.
    session = client._create(str(path), "example", None, None, _NoProgress(), _backoff())
    path.write_bytes(b"x" * 1000)
    os.utime(path, ns=(0, session.mtime_ns))
    with pytest.raises(FileChanged, match="checksum"):
        client.upload(path, "example")
    with pytest.raises(FileChanged):
        client.resume(session)
    assert receiver.offset(session.object_id) == 0
    with pytest.raises(UploadRefused, match="unknown project"):
        client.upload(path, "nope")


def test_forgotten_upload_starts_over(
    receiver: Receiver, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A saved upload the server no longer knows (HEAD 404, no receipt: swept after its
    retention) is started again as a new upload, not reported as a success or left stuck."""
    path = make_file(tmp_path / "f.bin", 3 * MiB, seed=12)
    client = make_client(proxy.url, tmp_path)
    old = client._create(str(path), "example", None, None, _NoProgress(), _backoff())
    proxy.add(Fault("reply", is_method("HEAD"), status=404, times=3))
    events: list[ProgressEvent] = []
    receipt = client.upload(path, "example", progress=events.append)
    assert receipt.object_id != old.object_id
    assert_receipted(receiver, receipt, path, tmp_path)
    assert any("starting over" in (e.message or "") for e in events)
    assert len(proxy.seen("POST")) == 2


class _NoProgress:
    def emit(self, *args: object) -> None:
        pass


def _backoff() -> object:
    from canner_client.retry import Backoff

    return Backoff(FAST_RETRY)


def test_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    """Interrupted while retrying (nothing listens), the command ends at once with 130 and
    says how to resume, instead of waiting for its uploads to finish."""
    path = make_file(tmp_path / "f.bin", 10)
    proc = subprocess.Popen(
        cli_command(
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--project",
            "example",
            "--state-dir",
            tmp_path / "state",
            "--deadline",  # keep retrying the refused connections (without: 3, then it stops)
            "60",
            path,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a suite started in the background inherits SIGINT ignored, and
        # so would the client, which then never sees the Ctrl-C this test sends.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(1.0)  # hashed, and retrying the creation
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Connection refused" in err and "run the same command again to resume" in err


def test_nothing_listening_is_said_plainly_unless_asked_to_retry(tmp_path: Path) -> None:
    """A wrong port: after 3 refused connections in a row the command says nothing listens
    there and stops (exit 1, in seconds, not 6 hours); with --deadline it retries that long."""
    path = make_file(tmp_path / "f.bin", 10)
    url = f"http://127.0.0.1:{free_port()}"
    args = ("--url", url, "--project", "example", "--state-dir", tmp_path / "state")
    started = time.monotonic()
    result = run_cli(*args, path, timeout=30)
    assert (result.returncode, result.stdout) == (1, "")
    assert time.monotonic() - started < 15
    lines = result.stderr.splitlines()
    assert lines[-1] == (
        f"canner-upload: {path}: nothing listens at {url}: the connection was refused 3 times"
        " in a row. Check --url (and the port); --deadline S keeps retrying for S seconds, for a"
        " server that is still starting"
    )
    assert sum("retrying: POST: ConnectionError" in line for line in lines) == 3
    result = run_cli(*args, "--deadline", "4", path, timeout=30)
    assert result.returncode == 1
    assert "gave up after 4s of retrying" in result.stderr.splitlines()[-1]
