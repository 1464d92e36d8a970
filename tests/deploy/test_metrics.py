"""A real Prometheus (Debian's package, installed here if missing) scrapes the running server through the
file_sd targets of dashboards/prometheus.yml during a short workload; then every PromQL expression of the
Grafana dashboard is evaluated against it: each references an `llmaas_` series and returns data."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from deploy.client import Client
from tests.deploy.conftest import free_port
from tests.deploy.rawhttp import wait_until

ROOT = Path(__file__).resolve().parents[2]


def prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe:
        return exe
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert r.returncode == 0, f"could not install Debian's prometheus: {r.stderr[-500:]}"
    exe = shutil.which("prometheus")
    assert exe, "prometheus is not on PATH after installing it"
    return exe


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    exe = prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    cfg = (ROOT / "dashboards" / "prometheus.yml").read_text()
    assert '"../data/metrics/*.json"' in cfg
    cfg = cfg.replace('"../data/metrics/*.json"', json.dumps(str(server.data_dir / "metrics" / "*.json")))
    cfg = cfg.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("refresh_interval: 5s", "refresh_interval: 1s")
    (tmp / "prometheus.yml").write_text(cfg)
    port = free_port()
    proc = subprocess.Popen([exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()[-2000:]
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def query(url: str, expr: str) -> list:
    r = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_every_dashboard_query_returns_data(server, prometheus):
    roles = {"ingress", "executor", "governor", "io", "predictor"}
    wait_until(lambda: roles <= {s["metric"]["role"] for s in query(prometheus, 'up{job="llmaas"} == 1')},
               "Prometheus to scrape every role", 60, every_s=0.5)  # the baseline: every series scraped once, at 0
    # a short workload: contexts that do not all fit the 2 MiB pool, so chunks are swapped and restored
    app = Client(server.url, Client(server.url, server.admin).bind("metrics-tests"))
    ctxs = [app.new_ctx("You are terse.") for _ in range(4)]
    text = "Summarise: " + " ".join(["The lighthouse keeper wrote the weather in the log every hour."] * 6)
    for r in range(2):
        for c in ctxs:
            app.call(c, text if r == 0 else "And in three words?", max_tokens=6)
    missing = requests.get(server.url + "/v1/contexts/" + "0" * 32, headers={"Authorization": f"Bearer {app.token}"})
    assert missing.status_code == 404
    # a scrape after the workload and the 404 (the calls alone may have been scraped before the 404)
    wait_until(lambda: [s for s in query(prometheus, "sum(llmaas_calls_total) >= 8")], "a scrape after the workload",
               30, every_s=0.5)
    wait_until(lambda: query(prometheus, 'llmaas_requests_total{code="404"} > 0'), "a scrape after the 404", 30,
               every_s=0.5)

    dash = json.loads((ROOT / "dashboards" / "llmaas.json").read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for title, expr in exprs:
        assert re.search(r"\bllmaas_\w+", expr), (title, expr)
        result = wait_until(lambda e=expr: [s for s in query(prometheus, e) if not math.isnan(float(s["value"][1]))],
                            f"data for {title!r}: {expr}", 15, every_s=0.5)
        assert result, (title, expr)
    # the series carry what the panels group by
    routes = {s["metric"]["route"] for s in query(prometheus, "llmaas_requests_total")}
    assert "/v1/contexts/{ctx}/calls" in routes
    codes = {s["metric"]["code"] for s in query(prometheus, "llmaas_requests_total > 0")}
    assert {"200", "201", "404"} <= codes
    swapped = query(prometheus, 'sum(llmaas_swap_bytes_total{direction="out"})')
    assert float(swapped[0]["value"][1]) > 0
    calls = query(prometheus, "sum(llmaas_calls_total)")
    assert float(calls[0]["value"][1]) >= 8
