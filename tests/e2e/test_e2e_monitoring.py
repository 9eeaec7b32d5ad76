"""What Prometheus and Grafana get: the shipped alert rules pass ``promtool check rules``,
every metric named by the rules and the dashboard exists in a live scrape of both daemons, and a
real Prometheus scraping both daemons fires the shipped rule on the first 403 from the IA.

Needs the Debian package ``prometheus`` (``promtool`` and the ``prometheus`` server);
``./dev test`` installs it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from deliver_support import make_env, wait_for
from e2e_support import REPO, end_process, free_port

pytestmark = pytest.mark.e2e

RULES = REPO / "conf" / "prometheus" / "canner-alerts.yml"
ALERT_TESTS = Path(__file__).parent / "data"
DASHBOARD = REPO / "conf" / "grafana" / "canner.json"
METRIC = re.compile(r"\b((?:canner|process)_[a-z0-9_]+)\b")


def promtool() -> str:
    found = subprocess.run(["sh", "-c", "command -v promtool"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail("promtool is missing: apt-get install prometheus (./dev test installs it)")
    return found.stdout.strip()


def rule_expressions() -> list[str]:
    text = RULES.read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^\s+expr: (.+)$", text, re.M)]


def dashboard_expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


def test_alert_rules_pass_promtool() -> None:
    """``promtool check rules`` accepts the shipped rules, and they alert on what the issue
    asks: deliver down, backlog age, needs-operator rows, free space, purges, acceptance, the
    rsync adoption backlog."""
    checked = subprocess.run(
        [promtool(), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 12 rules found" in checked.stdout
    names = set(METRIC.findall(" ".join(rule_expressions())))
    for needed in (
        "canner_deliver_up",
        "canner_oldest_undelivered_age_seconds",
        "canner_deliveries_needing_operator",
        "canner_data_free_bytes",
        "canner_purge_lag_seconds",
        "canner_acceptance_failures_total",
        "canner_rsync_waiting_files",
    ):
        assert needed in names, needed


def test_outbound_alert_fires_for_the_kind_that_fails() -> None:
    """``promtool test rules``: CannerOutboundFailing fires for ledgers failing an hour with none
    delivered, and not for objects that fail now and then but keep being delivered."""
    tested = subprocess.run(
        [promtool(), "test", "rules", str(ALERT_TESTS / "outbound_alert_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_dashboard_is_grafana_json_with_a_query_per_panel() -> None:
    """The dashboard parses, every panel has a datasource and at least one PromQL target."""
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert doc["title"] == "canner" and doc["panels"]
    for panel in doc["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["type"] == "prometheus"


def exported_names(text: str) -> set[str]:
    """Every metric name a scrape carries: families (``# TYPE``) and sample names."""
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    return names


def test_every_metric_in_dashboard_and_alerts_exists_in_a_live_scrape(tmp_path: Path) -> None:
    """Scrape a running receiver and deliver: no metric named by a rule or a panel is missing,
    and there are no ``_created`` series."""
    metrics_port = free_port()
    env = make_env(tmp_path, start_deliver=False)
    try:
        with open(env.config, "a", encoding="utf-8") as f:
            f.write(
                f'\n[metrics]\ndeliver_listen = "tcp:{metrics_port}:interface=127.0.0.1"\n'
                'refresh = "1s"\n'
            )
        env.receiver.close()
        env.receiver.start()
        env.deliver.start()
        env.upload(b"m" * 5000, filename="m.warc")

        def scraped() -> str | None:
            receiver = requests.get(env.receiver.base_url + "/metrics", timeout=10).text
            deliver = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            both = receiver + "\n" + deliver
            ready = (
                "canner_deliver_heartbeat_timestamp_seconds" in receiver
                and "canner_deliver_up 1.0" in deliver
            )
            return both if ready else None

        text = wait_for(scraped, 20, "both daemons to export the heartbeat gauges")
    finally:
        env.close()
    exported = exported_names(text)
    wanted = set()
    for expr in rule_expressions() + dashboard_expressions():
        wanted |= set(METRIC.findall(expr))
    missing = sorted(wanted - exported)
    assert not missing, f"named by rules or dashboard but not exported: {missing}"
    assert not [n for n in exported if n.endswith("_created")]
    assert 'canner_build_info{role="receiver"' in text and 'role="deliver"' in text


# -- the shipped rules in a real Prometheus ------------------------------------------------------

PROMETHEUS_CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [{rules}]
scrape_configs:
  - job_name: canner
    static_configs:
      - targets: [{receiver}, {deliver}]
"""


def prometheus_server() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus is missing: apt-get install prometheus (./dev test installs it)")
    return path


def prom_get(base: str, what: str, **params: str) -> Any:
    r = requests.get(f"{base}/api/v1/{what}", params=params, timeout=5)
    r.raise_for_status()
    return r.json()["data"]


def firing(base: str) -> set[str]:
    alerts = prom_get(base, "alerts")["alerts"]
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}


def test_one_forbidden_upload_fires_the_shipped_alert_in_prometheus(tmp_path: Path) -> None:
    """A real Prometheus (1 s scrape and evaluation interval, the shipped rule file unchanged)
    scrapes a receiver and canner-deliver: the 403 counter is there at 0 before anything fails,
    nothing about 403s fires, and one 403 from the IA fires CannerDeliveriesForbidden."""
    server = prometheus_server()
    metrics_port, prom_port = free_port(), free_port()
    env = make_env(
        tmp_path,
        extra=lambda fake, root: (
            f'[metrics]\ndeliver_listen = "tcp:{metrics_port}:interface=127.0.0.1"\n'
            'refresh = "1s"\n'
        ),
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(
        PROMETHEUS_CONFIG.format(
            rules=json.dumps(str(RULES)),
            receiver=json.dumps(env.receiver.base_url.split("//", 1)[1]),
            deliver=json.dumps(f"127.0.0.1:{metrics_port}"),
        ),
        encoding="utf-8",
    )
    base = f"http://127.0.0.1:{prom_port}"
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        prom = subprocess.Popen(
            [
                server,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def scraped_at_zero() -> bool:
            try:
                found = prom_get(
                    base, "query", query='sum(canner_delivery_failures_total{reason="forbidden"})'
                )["result"]
                up = prom_get(base, "query", query="sum(up)")["result"]
            except requests.RequestException:
                return False
            return bool(found and up) and found[0]["value"][1] == "0" and up[0]["value"][1] == "2"

        wait_for(scraped_at_zero, 20, "Prometheus to scrape both daemons", 0.2)
        assert "CannerDeliveriesForbidden" not in firing(base)
        started = time.monotonic()
        env.fake.add_fault("forbidden", count=1)
        env.upload(b"f" * 5000, filename="refused.warc")
        wait_for(
            lambda: "CannerDeliveriesForbidden" in firing(base),
            20,
            "the forbidden alert to fire",
            0.2,
        )
        fired_after = time.monotonic() - started
    finally:
        end_process(prom, signal.SIGTERM)
        env.close()
    print(f"CannerDeliveriesForbidden fired {fired_after:.1f}s after the 403 was armed")
    assert "level=error" not in log.read_text(encoding="utf-8", errors="replace")
