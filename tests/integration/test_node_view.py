"""The node's one view on the real reactor: a worker's site on 127.0.0.1 forwards the status
page, ``/readyz``, ``/metrics`` and HQ's API to the parent's own site on a real unix socket,
and answers what the parent answers; the parent's ``/metrics`` sums its counters with two
workers' (and ``promtool check metrics`` accepts it); with the parent gone the worker answers
503 with ``Retry-After`` and still serves ``/healthz`` and receipts itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_twisted  # type: ignore[import-untyped]
import treq
from attrs import define
from prometheus_client.parser import text_string_to_metric_families
from treq.client import HTTPClient
from twisted.internet import reactor as _reactor
from twisted.internet.endpoints import serverFromString
from twisted.logger import globalLogPublisher
from twisted.web.client import Agent, HTTPConnectionPool

from canner.blocking import run_inline
from canner.config import Config, parse_config
from canner.daemon.roots import receiver_parts
from canner.daemon.site import NodeParent
from canner.delivery.index import receiver_feed
from canner.hq.releases import token_digest
from canner.ops.metrics import RECEIVER, Metrics, metrics_site
from canner.ops.node import listen_description, parent_address, worker_metrics_address
from canner.ops.node_metrics import NodeMetrics
from canner.ops.problems import RecentProblems
from canner.store.receipts import ReceiptStore
from canner.store.uploads import UploadStore
from canner.web.proxy import NodeProxy, unix_agent

reactor: Any = _reactor

TOKEN = "s3cret-token"
RECEIPT = "receipt:" + "0" * 32
OID = "0123456789abcdef0123456789abcdef"


@define
class Roster:
    configured_: int = 2
    running_: int = 2
    restarts_: int = 0

    def configured(self) -> int:
        return self.configured_

    def running(self) -> int:
        return self.running_

    def restarts(self) -> int:
        return self.restarts_


@define
class Node:
    """A parent on a unix socket, a worker on 127.0.0.1 forwarding to it, and the raw metrics of
    two workers on their private sockets."""

    parent_pid: int
    ports: dict[str, Any]
    roster: Roster
    parent_metrics: Metrics
    worker_metrics: list[Metrics]
    worker_url: str
    client: HTTPClient
    parent_client: HTTPClient
    closers: list[Any]

    async def get(self, path: str, **kwargs: Any) -> Any:
        return await self.client.get(self.worker_url + path, **kwargs)

    async def parent_get(self, path: str, **kwargs: Any) -> Any:
        return await self.parent_client.get("http://canner-node" + path, **kwargs)


def _config(tmp_path: Path) -> Config:
    data = tmp_path / "data"
    for sub in ("uploads", "receipts"):
        (data / sub).mkdir(parents=True)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"hq {token_digest(TOKEN)}\n")
    raw = {
        "issuer": "https://canner.test",
        "data_dir": str(data),
        "min_free_bytes": 1,
        "projects": {"example": {}},
        "hq": {"tokens": str(tokens)},
    }
    return parse_config(raw, tmp_path)


def _parts(config: Config, metrics: Metrics, index: Any = None, **node: Any) -> Any:
    return receiver_parts(
        config,
        uploads=UploadStore(config.data_dir / "uploads"),
        receipts=ReceiptStore(config.data_dir / "receipts"),
        run=run_inline,
        hashing=run_inline,
        clock=reactor,
        enqueue=lambda receipt, origin: None,
        index=index,
        metrics=metrics,
        problems=RecentProblems(),
        connection_limits=None,
        **node,
    )


@pytest_twisted.async_yield_fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    config = _config(tmp_path)
    # The node's private directory, short (a unix socket's path holds 107 bytes).
    private = Path(tempfile.mkdtemp(prefix="canner-node-"))
    parent_pid = 0
    roster = Roster()
    parent_metrics = Metrics(RECEIVER, config.projects)
    workers = [Metrics(RECEIVER, config.projects) for _ in range(2)]
    closers: list[Any] = []
    node_metrics, scraper = NodeMetrics.for_parent(
        parent_metrics.render, private, len(workers), reactor
    )
    closers.append(scraper.close)
    closers.append(lambda: shutil.rmtree(private, ignore_errors=True))
    _, pool, index = receiver_feed(config.data_dir / "delivery.sqlite", reactor)
    assert pool is not None
    closers.append(lambda: pool.close())
    parent = _parts(config, parent_metrics, index, parent=NodeParent(roster, node_metrics))
    ports = {
        "parent": await serverFromString(
            reactor, listen_description(parent_address(private))
        ).listen(parent.site)
    }
    for i, metrics in enumerate(workers, start=1):
        address = worker_metrics_address(private, i)
        endpoint = serverFromString(reactor, listen_description(address))
        ports[f"metrics-{i}"] = await endpoint.listen(metrics_site(metrics))
    proxy = NodeProxy(parent_address(private), reactor, timeout=5.0)
    closers.append(proxy.close)
    worker = _parts(config, workers[0], node=proxy)
    ports["worker"] = await serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
        worker.site
    )
    pool_ = HTTPConnectionPool(reactor, persistent=False)
    client = HTTPClient(Agent(reactor, pool=pool_))
    agent, parent_pool = unix_agent(reactor, parent_address(private))
    closers.append(parent_pool.closeCachedConnections)
    url = f"http://127.0.0.1:{ports['worker'].getHost().port}"
    yield Node(
        parent_pid,
        ports,
        roster,
        parent_metrics,
        workers,
        url,
        client,
        HTTPClient(agent),
        closers,
    )
    for port in ports.values():
        await port.stopListening()
    for close in closers:
        closed = close()
        if closed is not None:
            await closed


async def _answer(response: Any) -> tuple[int, dict[str, list[str]], bytes]:
    body = await treq.content(response)
    keep = ("content-type", "cache-control", "content-security-policy", "www-authenticate")
    headers = {
        name: response.headers.getRawHeaders(name)
        for name in keep
        if response.headers.hasHeader(name)
    }
    return response.code, headers, body


@pytest_twisted.ensureDeferred
async def test_a_worker_serves_the_status_page_and_readiness_the_parent_answers(
    node: Node,
) -> None:
    """The status page and /readyz through a worker are the parent's answers, workers counted."""
    through = await _answer(await node.get("/"))
    direct = await _answer(await node.parent_get("/"))
    assert through == direct
    assert through[0] == 200 and b"2 of 2 workers" in through[2]

    ready = await node.get("/readyz")
    doc = json.loads(await treq.content(ready))
    direct_doc = json.loads(await treq.content(await node.parent_get("/readyz")))
    doc.pop("free_bytes"), direct_doc.pop("free_bytes")  # the filesystem's, changing
    assert (ready.code, doc) == (200, direct_doc)
    assert doc["workers"] == {"configured": 2, "running": 2, "restarts": 0}

    node.roster.running_ = 1
    ready = await node.get("/readyz")
    doc = json.loads(await treq.content(ready))
    assert ready.code == 503 and doc["status"] == "not ready"
    assert "1 of 2 receiver workers are listening" in doc["reasons"]
    page = await treq.content(await node.get("/"))
    assert b"1 of 2 workers" in page and b"warning: 1 of 2 receiver workers" in page


@pytest_twisted.ensureDeferred
async def test_hq_requests_reach_the_parent_whole_with_the_real_client(node: Node) -> None:
    """A release and a query through a worker: bodies arrive intact, answers are the parent's,
    and the parent sees the worker's client (not the worker) as the client."""
    body = json.dumps({"ids": [RECEIPT]}).encode()
    auth = {"Authorization": [f"Bearer {TOKEN}"], "Content-Type": ["application/json"]}
    through = await node.client.post(node.worker_url + "/api/v1/releases", body, headers=auth)
    direct = await node.parent_client.post("http://canner-node/api/v1/releases", body, headers=auth)
    answer, direct_answer = await _answer(through), await _answer(direct)
    assert answer == direct_answer
    assert answer[0] == 200
    assert json.loads(answer[2])["results"][0]["id"] == RECEIPT

    query = json.dumps({"object_ids": [OID, "f" * 32]}).encode()
    found = await node.client.post(node.worker_url + "/api/v1/objects:query", query)
    results = json.loads(await treq.content(found))["results"]
    assert [r["object_id"] for r in results] == [OID, "f" * 32]

    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    try:
        refused = await node.client.post(
            node.worker_url + "/api/v1/releases",
            body,
            headers={"Authorization": ["Bearer wrong"], "X-Forwarded-For": ["10.9.9.9"]},
        )
        await treq.content(refused)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert refused.code == 401
    clients = [e["client"] for e in events if "release refused" in e.get("log_format", "")]
    # The worker vouches for its own peer: what the client claimed is not its address.
    assert clients == ["127.0.0.1"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _promtool(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )


@pytest_twisted.ensureDeferred
async def test_metrics_through_a_worker_add_up_over_the_parent_and_both_workers(
    node: Node,
) -> None:
    """Uploads accepted by the parent and two workers are the node's total, the output passes
    promtool, and a worker that stops answering keeps its counts and is counted unreachable."""
    for metrics, count in zip([node.parent_metrics, *node.worker_metrics], [1, 2, 3], strict=True):
        for _ in range(count):
            metrics.upload_accepted("example", 100, 0.01, 0.02)
    response = await node.get("/metrics")
    text = (await treq.content(response)).decode()
    assert response.code == 200
    samples = _samples(text)
    accepted = ("canner_uploads_accepted_total", (("project", "example"),))
    assert samples[accepted] == 6
    assert samples[("canner_accepted_bytes_total", (("project", "example"),))] == 600
    assert samples[("canner_acceptance_seconds_count", ())] == 6
    assert samples[("canner_receiver_workers_unreachable", ())] == 0
    assert samples[("canner_receiver_workers_running", ())] == 2
    processes = {
        dict(labels)["process"]
        for (name, labels) in samples
        if name == "canner_process_resident_memory_bytes"
    }
    assert processes == {"parent", "1", "2"}
    checked = _promtool(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    await node.ports.pop("metrics-2").stopListening()
    text = (await treq.content(await node.get("/metrics"))).decode()
    samples = _samples(text)
    assert samples[("canner_receiver_workers_unreachable", ())] == 1
    assert samples[accepted] == 6  # worker 2's last answer: the node's counter never drops
    checked = _promtool(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest_twisted.ensureDeferred
async def test_with_the_parent_gone_a_worker_answers_503_and_serves_its_own_routes(
    node: Node,
) -> None:
    """Without the parent the node's view is 503 with Retry-After and a line naming it, never
    500; /healthz and receipt lookups are the worker's own and still answer."""
    await node.ports.pop("parent").stopListening()
    for path in ("/", "/readyz", "/metrics", f"/api/v1/objects/{OID}"):
        response = await node.get(path)
        body = await treq.content(response)
        assert response.code == 503, path
        assert response.headers.getRawHeaders("Retry-After") == ["5"]
        assert body == b"the node's parent process does not answer; retry later\n"
    health = await node.get("/healthz")
    assert health.code == 200 and json.loads(await treq.content(health))["status"] == "ok"
    receipt = await node.get(f"/api/v1/receipts/{OID}")
    await treq.content(receipt)
    assert receipt.code == 404
