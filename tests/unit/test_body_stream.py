"""BodyStream: which chunks are written on their own, and which go with the upload's completion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from canner.blocking import run_inline
from canner.tus.protocol import TusError
from canner.tus.store import LockedUpload, UploadInfo, UploadStore
from canner.tus.stream import BodyStream

OID = "0123456789abcdef0123456789abcdef"


class Transport:
    def __init__(self) -> None:
        self.paused = False

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False


class Recorder:
    """The owner's side of a stream: what was written, finished and completed."""

    def __init__(self, tmp_path: Path, size: int) -> None:
        (tmp_path / "uploads").mkdir()
        self.uploads = UploadStore(tmp_path / "uploads")
        info = UploadInfo(OID, size, {"project": "example", "checksum": "blake3:" + "0" * 64}, 1)
        self.uploads.create(info)
        self.upload = self.uploads.open_locked(info)
        self.writes: list[list[bytes]] = []
        self.finished: list[bool] = []
        self.completed: list[list[bytes]] = []
        self.transport = Transport()
        self.stream = BodyStream(
            run_inline, self.transport, self.write, self.finish, complete=self.complete
        )

    def write(self, upload: LockedUpload, chunks: list[bytes]) -> Deferred[int]:
        self.writes.append(list(chunks))
        return run_inline(self.uploads.append, upload, chunks)

    def finish(self, upload: LockedUpload, lost: bool) -> Deferred[Any]:
        self.finished.append(lost)
        upload.close()
        return succeed("finished")

    def complete(self, upload: LockedUpload, chunks: list[bytes]) -> Deferred[Any]:
        self.completed.append(list(chunks))
        self.uploads.append(upload, chunks)
        upload.close()
        return succeed("completed")

    def result(self) -> Any:
        results: list[Any] = []
        self.stream.result().addBoth(results.append)
        return results[0] if results else None


def test_the_chunks_that_complete_an_upload_go_with_its_completion(tmp_path: Path) -> None:
    """A body that is in at admission and completes the upload is not written on its own:
    it waits for the body's end, then goes with the completion."""
    rec = Recorder(tmp_path, 10)
    rec.stream.chunk(b"hello")
    rec.stream.chunk(b"world")
    rec.stream.admitted(rec.upload)
    assert rec.completed == [] and rec.writes == [], "the body has not ended"
    assert rec.stream.completes
    rec.stream.body_ended()
    assert rec.completed == [[b"hello", b"world"]] and rec.writes == []
    assert rec.result() == "completed"
    assert rec.uploads.data_path(OID).read_bytes() == b"helloworld"


def test_earlier_chunks_are_written_and_only_the_last_go_with_completion(
    tmp_path: Path,
) -> None:
    rec = Recorder(tmp_path, 11)
    rec.stream.admitted(rec.upload)
    rec.stream.chunk(b"hel")
    rec.stream.chunk(b"lo world")
    rec.stream.body_ended()
    assert rec.writes == [[b"hel"]] and rec.completed == [[b"lo world"]]
    assert rec.result() == "completed"
    assert rec.uploads.data_path(OID).read_bytes() == b"hello world"


def test_a_byte_past_the_end_after_the_completing_chunks_is_413(tmp_path: Path) -> None:
    """Completing chunks wait for the body's end; one more byte is an overrun and nothing of
    the body is stored."""
    rec = Recorder(tmp_path, 5)
    rec.stream.admitted(rec.upload)
    rec.stream.chunk(b"hello")
    rec.stream.chunk(b"!")
    rec.stream.body_ended()
    result = rec.result()
    assert isinstance(result, Failure) and result.check(TusError)
    assert result.value.status == 413
    assert rec.completed == [] and rec.finished == []
    assert rec.uploads.offset(OID) == 0


def test_a_body_that_does_not_complete_the_upload_is_written_and_finished(
    tmp_path: Path,
) -> None:
    rec = Recorder(tmp_path, 10)
    rec.stream.admitted(rec.upload)
    rec.stream.chunk(b"hello")
    rec.stream.body_ended()
    assert rec.writes == [[b"hello"]] and rec.completed == [] and rec.finished == [False]
    assert rec.result() == "finished"


def test_a_connection_lost_after_the_last_byte_still_completes(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, 5)
    rec.stream.admitted(rec.upload)
    rec.stream.chunk(b"hello")
    rec.stream.connection_lost()
    assert rec.completed == [[b"hello"]]
    assert rec.result() == "completed"
