"""The Grafana dashboard (``deploy/monitoring/grafana-dashboard.json``) and the alert rules
(``deploy/helm/ferrum-service/files/prometheus-rules.yaml``) against a real Prometheus scraping a
live ``ferrum-service serve`` process on loopback: Prometheus loads the rules and evaluates them
without error, and every query of the dashboard (panels and template variables) and of the rules
(each alert's ``(QUERY) > THRESHOLD`` without the threshold) returns data after some traffic.

The Prometheus binary: ``$FERRUM_PROMETHEUS``, else ``prometheus`` on PATH, else what
``scripts/prometheus_tool.sh`` installs (Debian's package); the test skips only when there is none
and it could not be installed."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from .support.servers import REPO, ServerProcess, free_port
from .support.traffic import serving_traffic
from .support.waits import wait_until

DASHBOARD = REPO / "deploy" / "monitoring" / "grafana-dashboard.json"
RULES = REPO / "deploy" / "helm" / "ferrum-service" / "files" / "prometheus-rules.yaml"
MOCK = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"
#: Grafana's variables, as a query over everything of the last minute
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*", "$job": ".*"}
ALERT = re.compile(r"^\((?P<query>.*)\)\s*>\s*[0-9.]+$", re.S)


def _prometheus() -> str:
    path = os.environ.get("FERRUM_PROMETHEUS") or shutil.which("prometheus")
    if path:
        return path
    r = subprocess.run(["bash", str(REPO / "scripts" / "prometheus_tool.sh")], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        pytest.skip(f"no prometheus binary and it could not be installed: {r.stderr.strip()[-300:]}")
    return r.stdout.strip()


def _api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _query(port: int, expr: str) -> list:
    return _api(port, "query", query=expr)["result"]


def _has_finite_value(result: list) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def _dashboard_queries() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(panel title, PromQL) of every panel target; (variable, metric) of every label_values variable."""
    dash = json.loads(DASHBOARD.read_text())
    targets = []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a variable this test does not know: {expr}"
            targets.append((panel["title"], expr))
    variables = []
    for v in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["query"]["query"])
        assert m, f"variable {v['name']}: not a label_values query"
        variables.append((m.group(2), m.group(1)))
    return targets, variables


def _alert_queries() -> list[tuple[str, str]]:
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            m = ALERT.match(rule["expr"].strip())
            assert m, f"{rule['alert']}: expr is not `(QUERY) > THRESHOLD`"
            out.append((rule["alert"], m.group("query")))
    return out


def test_dashboard_and_alert_queries_return_data_from_a_live_server(tmp_path):
    prometheus = _prometheus()
    targets, variables = _dashboard_queries()
    alerts = _alert_queries()
    assert len(targets) >= 10 and len(alerts) == 3
    metrics_port, prom_port = free_port(), free_port()
    with ServerProcess("--model", MOCK, "--metrics-port", str(metrics_port)) as srv:
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "ferrum", "static_configs": [
                {"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }))
        log = open(tmp_path / "prometheus.log", "w")
        prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            def up() -> bool:
                try:
                    return any(s["value"][1] == "1" for s in _query(prom_port, 'up{job="ferrum"}'))
                except OSError:
                    return False

            assert wait_until(up, timeout=60, interval=0.5), (tmp_path / "prometheus.log").read_text()[-2000:]
            serving_traffic(srv.target, "mock")
            time.sleep(1.5)
            serving_traffic(srv.target, "mock")  # two rounds a few scrapes apart: rates see them
            time.sleep(4)  # a few more scrapes and rule evaluations

            rules = [r for g in _api(prom_port, "rules")["groups"] for r in g["rules"]]
            assert sorted(r["name"] for r in rules) == sorted(a for a, _ in alerts)
            for r in rules:
                assert r["health"] == "ok" and not r.get("lastError"), r

            empty = []
            for title, expr in targets + [(f"alert {a}", q) for a, q in alerts]:
                if not _has_finite_value(_query(prom_port, expr)):
                    empty.append(f"{title}: {expr}")
            for label, metric in variables:
                if not _api(prom_port, f"label/{label}/values", **{"match[]": metric}):
                    empty.append(f"variable {label}: label_values({metric}, {label})")
            assert not empty, "queries without data:\n" + "\n".join(empty)
        finally:
            prom.terminate()
            prom.wait(20)
            log.close()
