"""The node of several receiver workers: the parent's answers and the workers' stand-ins over
AMP (``twisted.test.iosim``: real AMP boxes, in memory), what a dead worker leaves, and a channel
whose connection cap is answered later."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.test import iosim

from canner.accept.intake import ACCEPTANCE_RETRY_AFTER, ACCEPTANCE_WAIT
from canner.accept.origins import AcceptedOrigins, OriginKey
from canner.blocking import BlockingRunner
from canner.checksum import parse_checksum
from canner.config import ConfigError, parse_config, usable_cores
from canner.daemon import node_protocol
from canner.daemon.node import settle_uploads
from canner.daemon.node_protocol import (
    STORED_EVERY,
    STORED_STEP,
    Admit,
    BeginOrigin,
    Disconnect,
    EndOrigin,
    NodeAnswers,
    NodeConnections,
    NodePromises,
    NodeState,
    TakeOver,
    WorkerLink,
    key_text,
)
from canner.store.promises import Promises
from canner.store.receipts import Receipt, ReceiptStore
from canner.store.uploads import UploadDoor, UploadInfo, UploadStore
from canner.web.connections import ConnectionLimits
from tests.unit.receiver_harness import InMemoryReceiver, blake3_hex

KEY = OriginKey("example", "alice", "a.warc.gz", 10, parse_checksum("blake3:" + "ab" * 32))


class Inline:
    """callFromThread at once (the test is the reactor thread)."""

    def callFromThread(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)


def inline_runner(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
    return succeed(f(*args))


def _same(answers: NodeAnswers) -> NodeAnswers:
    return answers


class Node:
    """A parent's state with two workers' links, each over its own in-memory AMP connection."""

    def __init__(self, tmp_path: Path, total: int = 10, per_address: int = 2) -> None:
        receipts = ReceiptStore(tmp_path)
        self.state = NodeState(
            promises=Promises(),
            limits=ConnectionLimits(total, per_address),
            origins=AcceptedOrigins(receipts=receipts, run=cast(BlockingRunner, inline_runner)),
        )
        self.listening: list[tuple[int, int]] = []
        self.links: dict[int, WorkerLink] = {}
        self.answers: dict[int, NodeAnswers] = {}
        self.pumps: list[iosim.IOPump] = []
        for worker in (1, 2):
            answers = NodeAnswers(self.state, worker, self._listening)
            link, server, pump = iosim.connectedServerAndClient(
                partial(_same, answers), partial(WorkerLink, Inline())
            )
            self.links[worker], self.answers[worker] = link, server
            self.pumps.append(pump)

    def _listening(self, worker: int, pid: int) -> None:
        self.listening.append((worker, pid))

    def flush(self) -> None:
        for _ in range(5):
            for pump in self.pumps:
                pump.flush()

    def ask(self, worker: int, command: Any, **arguments: Any) -> Any:
        d = self.links[worker].ask(command, **arguments)
        self.flush()
        return d


def result_of(d: Deferred[Any]) -> Any:
    results: list[Any] = []
    d.addBoth(results.append)
    assert results, "not fired"
    return results[0]


def test_creations_on_two_workers_are_admitted_against_one_account(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert (
        result_of(node.ask(1, Admit, upload_id="a", size=40, free=100, floor=10))["refused"]
        is False
    )
    refused = result_of(node.ask(2, Admit, upload_id="b", size=60, free=100, floor=10))
    assert refused["refused"] and refused["promised_bytes"] == 40 and refused["uploads"] == 1
    assert node.state.promises.total == 40
    # Worker 1 dies: what it held is returned for settling, nothing else is forgotten.
    assert node.state.worker_gone(node.answers[1]) == {"a"}
    assert node.state.worker_gone(node.answers[2]) == set()


def test_stand_in_promises_tell_the_parent_in_order(tmp_path: Path) -> None:
    node = Node(tmp_path)
    promises = NodePromises(link=node.links[1])
    size = 4 * STORED_STEP
    promises.hold("a", size, 10)
    promises.stored("a", 30)
    node.flush()
    # A small step is not told: the parent counts it as owing more, never less.
    assert promises.total == size - 30 and node.state.promises.total == size - 10
    promises.stored("a", STORED_STEP + 10)
    node.flush()
    assert node.state.promises.total == promises.total == size - STORED_STEP - 10
    promises.release_all(["a"])
    node.flush()
    assert node.state.promises.total == 0 and node.answers[1].held.uploads == set()


def test_stand_in_promises_tell_small_writes_later_and_at_the_end_of_a_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes smaller than a step reach the parent once STORED_EVERY has passed since it last
    heard of the upload, and the bytes a request ended with when it ends (what the parent's
    surveys show of the upload, and when its idle time starts)."""
    now = [1000.0]
    monkeypatch.setattr(node_protocol.time, "monotonic", lambda: now[0])
    node = Node(tmp_path)
    promises = NodePromises(link=node.links[1])
    size = 4 * STORED_STEP
    promises.hold("a", size, 0)
    node.flush()
    parent = node.state.promises
    version = parent.versions()["a"]
    promises.stored("a", 30)
    node.flush()
    assert parent.versions()["a"] == version and parent.total == size
    now[0] += STORED_EVERY
    promises.stored("a", 40)
    node.flush()
    assert parent.total == size - 40 and parent.versions()["a"] > version
    promises.stored("a", 50)
    promises.settled("a", 55)
    node.flush()
    assert parent.total == promises.total == size - 55
    promises.release("a")
    promises.settled("a", 60)  # a request ending after the sweep's release tells nothing
    node.flush()
    assert parent.total == 0 and "a" not in parent.versions()


def test_connections_are_capped_across_workers_and_a_dead_worker_frees_its_own(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, per_address=2)
    one = NodeConnections(node.links[1], 2)
    two = NodeConnections(node.links[2], 2)
    first, second = one.admit("10.0.0.2"), two.admit("10.0.0.2")
    node.flush()
    assert result_of(first) is True and result_of(second) is True
    third = two.admit("10.0.0.2")
    node.flush()
    assert result_of(third) is False and two.refused == 1
    # A disconnect the worker never held changes nothing.
    node.links[1].tell(Disconnect, address="10.0.0.9")
    node.flush()
    assert node.state.limits.open == 2
    node.state.worker_gone(node.answers[1])
    again = two.admit("10.0.0.2")
    node.flush()
    assert result_of(again) is True and node.state.limits.open == 2
    two.release("10.0.0.2")
    node.flush()
    assert node.state.limits.open == 1


def test_a_commit_of_an_origin_waits_for_the_other_workers_and_finds_its_object(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    text = key_text(KEY)
    first = node.ask(1, BeginOrigin, key=text)
    assert result_of(first) == {"object_id": None}
    waiting = node.ask(2, BeginOrigin, key=text)
    assert not waiting.called, "two workers commit the same key at once"
    node.links[1].tell(EndOrigin, key=text, object_id="obj1")
    node.flush()
    assert result_of(waiting) == {"object_id": "obj1"}
    # Worker 2 dies while it holds the key: the next one does not wait for ever.
    node.state.worker_gone(node.answers[2])
    assert result_of(node.ask(1, BeginOrigin, key=text)) == {"object_id": "obj1"}
    # One that waited for a key and went before it got it claims nothing.
    waiting = node.ask(2, BeginOrigin, key=text)
    node.answers[2].lost.callback(None)
    node.links[1].tell(EndOrigin, key=text, object_id="obj1")
    node.flush()
    assert result_of(node.ask(1, BeginOrigin, key=text)) == {"object_id": "obj1"}


def test_takeover_asks_the_other_workers(tmp_path: Path) -> None:
    node = Node(tmp_path)
    asked: list[str] = []

    def live(upload_id: str) -> Deferred[bool]:
        asked.append(upload_id)
        return succeed(True)

    node.links[2].take_over_here = live
    node.links[1].take_over_here = lambda upload_id: pytest.fail("asked the asking worker")
    assert result_of(node.ask(1, TakeOver, upload_id="u")) == {"live": True}
    assert asked == ["u"]
    node.links[2].take_over_here = lambda upload_id: succeed(False)
    assert result_of(node.ask(1, TakeOver, upload_id="u")) == {"live": False}


def _info(upload_id: str, door: UploadDoor, size: int = 100) -> UploadInfo:
    return UploadInfo(
        upload_id=upload_id,
        size=size,
        metadata={"project": "example"},
        created_at=1,
        durable=0,
        door=door,
    )


def test_a_dead_workers_put_goes_and_its_tus_upload_keeps_its_promise(tmp_path: Path) -> None:
    (tmp_path / "uploads").mkdir()
    (tmp_path / "receipts").mkdir()
    uploads, receipts = UploadStore(tmp_path / "uploads"), ReceiptStore(tmp_path / "receipts")
    put, tus = "a" * 32, "b" * 32
    for upload_id, door in ((put, UploadDoor.PUT), (tus, UploadDoor.TUS)):
        uploads.create(_info(upload_id, door))
        upload = uploads.open_locked(_info(upload_id, door))
        uploads.append(upload, [b"x" * 30])
        upload.close()
    promises = Promises()
    promises.hold(put, 100, 10)
    promises.hold(tus, 100, 10)
    assert settle_uploads(uploads, receipts, promises, {put, tus}) == 1
    assert uploads.read_info(put) is None and not (tmp_path / "uploads" / put).exists()
    assert promises.total == 70 and promises.uploads == 1


def test_receiver_workers_must_be_a_positive_integer(tmp_path: Path) -> None:
    raw: dict[str, Any] = {
        "issuer": "https://x.test",
        "data_dir": str(tmp_path),
        "min_free_bytes": 1,
        "projects": {"example": {}},
    }
    assert parse_config({**raw, "receiver": {"workers": 3}}, tmp_path).receiver.workers == 3
    assert parse_config(raw, tmp_path).receiver.workers == usable_cores()
    for bad in (0, -1, "2", True):
        with pytest.raises(ConfigError) as e:
            parse_config({**raw, "receiver": {"workers": bad}}, tmp_path)
        assert "receiver.workers" in str(e.value)


class LaterCaps(ConnectionLimits):
    """Caps whose answers the test gives (as a node's worker gets its parent's)."""

    def __init__(self) -> None:
        super().__init__(10, 0)
        self.asked: list[Deferred[bool]] = []
        self.released: list[str] = []

    def admit(self, address: str) -> Deferred[bool]:  # type: ignore[override]
        d: Deferred[bool] = Deferred()
        self.asked.append(d)
        return d

    def release(self, address: str) -> None:
        self.released.append(address)


def test_a_channel_waits_for_its_cap_with_its_transport_paused(tmp_path: Path) -> None:
    rcv = InMemoryReceiver.build(tmp_path)
    caps = LaterCaps()
    rcv.site.connection_limits = caps
    admitted = rcv.connect("10.0.0.2")
    assert admitted.transport.producerState == "paused"
    caps.asked[0].callback(True)
    assert admitted.transport.producerState == "producing"
    admitted.send_head("GET", "/healthz")
    assert admitted.answer().status == 200

    refused = rcv.connect("10.0.0.3")
    caps.asked[1].callback(False)
    rcv.settle()
    assert refused.answer().status == 503 and refused.closed

    gone = rcv.connect("10.0.0.4")
    gone.close()
    caps.asked[2].callback(True)
    assert caps.released[-1] == "10.0.0.4", "a connection lost while asking kept its slot"


def test_a_receipt_lookup_waits_while_another_worker_accepts_the_upload(tmp_path: Path) -> None:
    """On a node, the final PATCH of an upload may be accepted by another worker: every byte is
    on disk, that worker holds the upload's lock, no receipt exists yet.  A lookup here waits
    for the receipt (as it waits for an acceptance of its own) instead of answering 404."""
    rcv = InMemoryReceiver.build(tmp_path)
    # A worker of a node: other processes write uploads too.
    rcv.intake.take_over_elsewhere = lambda upload_id: succeed(False)
    data = b"x" * 1000
    oid = rcv.new_upload(data)
    path = rcv.data_dir / "uploads" / oid
    path.write_bytes(data)  # the other worker received every byte
    other = os.open(path, os.O_RDONLY)  # and holds the lock (another open file description)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lookup = rcv.connect()
        lookup.send_head("GET", f"/api/v1/receipts/{oid}", [])
        rcv.advance(1.0)
        assert lookup.answers == [], "answered while another worker accepts the upload"
        receipt = Receipt(
            object_id=oid,
            issuer=rcv.config.issuer,
            checksum=parse_checksum(blake3_hex(data)),
            size_bytes=len(data),
            accepted_at=1,
        )
        ReceiptStore(rcv.data_dir / "receipts").commit(receipt)  # its commit point
    finally:
        os.close(other)  # its acceptance ends: the lock goes
    rcv.advance(0.1)
    answer = lookup.answer()
    assert answer.status == 200, answer.status_line
    assert json.loads(answer.body)["object_id"] == oid


def test_a_lookup_waits_for_another_workers_acceptance_only_so_long(tmp_path: Path) -> None:
    """An acceptance elsewhere that never ends gets the lookup a 503 with Retry-After after the
    bounded wait, as one of this process's would."""
    rcv = InMemoryReceiver.build(tmp_path)
    rcv.intake.take_over_elsewhere = lambda upload_id: succeed(False)
    data = b"y" * 1000
    oid = rcv.new_upload(data)
    path = rcv.data_dir / "uploads" / oid
    path.write_bytes(data)
    other = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lookup = rcv.connect()
        lookup.send_head("GET", f"/api/v1/receipts/{oid}", [])
        rcv.advance(ACCEPTANCE_WAIT + 1)
        answer = lookup.answer()
    finally:
        os.close(other)
    assert answer.status == 503 and answer.header("Retry-After") == str(ACCEPTANCE_RETRY_AFTER)
