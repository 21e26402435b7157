"""Deployment: the compose file is valid, the Prometheus config is valid and a real Prometheus
scrapes the service, and every metric the Grafana dashboard queries is exported."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from conftest import under_ci
from fastapi.testclient import TestClient
from test_server import free_port, start_server, stop, wait_ready

from app.config import Settings
from app.main import create_app

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "nmt.json"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"


def tool(name: str) -> str:
    """Path of a system tool; CI installs it (.ci/run), so there a missing one is a failure."""
    path = shutil.which(name)
    if path is None:
        if under_ci():
            pytest.fail(f"{name} is not installed (.ci/run installs it)")
        pytest.skip(f"{name} is not installed here (apt-get install {name})")
    return path


def dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert exprs, "the dashboard queries nothing"
    return {name for e in exprs for name in re.findall(r"\bnmt_[a-z0-9_]+", e)}


def test_every_dashboard_metric_is_exported(model_dir: Path) -> None:
    # (compile=False: which metrics exist does not depend on it, and it saves a 30 s compilation)
    with TestClient(create_app(Settings(model_dir=model_dir, device="cpu", compile=False))) as client:
        assert (
            client.post("/translate", json={"q": "Ein Mann.", "source": "de", "target": "en"}).status_code
            == 200
        )
        client.post(
            "/translate", json={"q": "x", "source": "xx", "target": "en"}
        )  # an error, for the 4xx panel
        exported = {
            line.split("{")[0].split(" ")[0]
            for line in client.get("/metrics").text.splitlines()
            if line and not line.startswith("#")
        }
    names = dashboard_metrics()
    assert {
        "nmt_requests_total",
        "nmt_request_duration_seconds_bucket",
        "nmt_batch_size_sequences_sum",
    } <= names
    assert names <= exported, f"not exported: {sorted(names - exported)}"


def test_compose_file_is_accepted() -> None:
    compose = tool("docker-compose")
    proc = subprocess.run(
        [compose, "-f", "docker-compose.yml", "config", "-q"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert {"translator", "translator-gpu", "lb", "prometheus", "grafana"} <= set(services)
    gpu = services["translator-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "ports" not in services["translator"]  # replicas share the load balancer's port


def test_compose_replicas_share_one_postgresql_and_one_redis() -> None:
    """--scale translator=3 is one service: every translator is given the same database and Redis,
    pinned images with healthchecks and volumes that it waits for, credentials from the environment."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    translator = services["translator"]
    for name, variable, scheme in (
        ("postgres", "NMT_DATABASE_URL", "postgresql"),
        ("redis", "NMT_REDIS_URL", "redis"),
    ):
        server = services[name]
        assert re.fullmatch(r"[a-z]+:\d+(\.\d+)+-alpine", server["image"]), server["image"]
        assert server["healthcheck"]["test"] and server["volumes"]
        assert translator["depends_on"][name] == {"condition": "service_healthy"}
        url = urlparse(
            translator["environment"][variable].replace("${", "").replace(":-", "-").replace("}", "")
        )
        assert (url.scheme, url.hostname) == (scheme, name)
        assert "${NMT_" in translator["environment"][variable]  # the password from the environment
    postgres = services["postgres"]["environment"]
    assert postgres["POSTGRES_PASSWORD"] == "${NMT_POSTGRES_PASSWORD:-nmt-postgres-password}"
    assert "NMT_POSTGRES_PASSWORD" in translator["environment"]["NMT_DATABASE_URL"]


def test_prometheus_config_is_valid() -> None:
    proc = subprocess.run(
        [tool("promtool"), "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def loopback_config(target: str) -> dict[str, object]:
    """deploy/prometheus/prometheus.yml with the compose DNS discovery replaced by ``target``."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs")
        job["static_configs"] = [{"targets": [target]}]
    return config


def query(prom: str, expr: str) -> float:
    data = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5).json()["data"]["result"]
    return float(data[0]["value"][1]) if data else 0.0


def test_real_prometheus_scrapes_the_batching_metrics(model_dir: Path, tmp_path: Path) -> None:
    binary = tool("prometheus")
    srv = start_server(tmp_path / "uvicorn.log", NMT_MODEL_DIR=str(model_dir))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(loopback_config(srv.url.removeprefix("http://"))))
    prom_log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(srv)
        for text in ["Ein Mann spielt.", "Zwei Hunde laufen im Park.", "Eine Frau liest."]:
            body = {"q": [text] * 4, "source": "de", "target": "en"}
            assert httpx.post(f"{srv.url}/translate", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        up = steps = batched = answered = 0.0
        while time.monotonic() < deadline:
            try:
                up = query(url, 'up{job="translator"}')
                steps = query(url, 'nmt_decode_steps_total{model="tiny-de-en"}')  # labelled by model
                batched = query(url, 'nmt_batch_size_sequences_count{model="tiny-de-en"}')
                # (in the loop too: a scrape between the first request and the last saw fewer)
                answered = query(url, 'nmt_requests_total{endpoint="/translate",status="200"}')
            except httpx.TransportError:
                pass  # Prometheus is still starting
            if up == 1 and steps > 0 and batched > 0 and answered >= 3:
                break
            time.sleep(0.5)
        log = (tmp_path / "prometheus.log").read_text(errors="replace")
        assert up == 1, f"target not up\n{log[-2000:]}"
        assert steps > 0 and batched > 0, "batching metrics did not arrive"
        assert answered >= 3
    finally:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
        prom_log.close()
        stop(srv)


def test_the_load_balancer_takes_every_upload_the_service_takes() -> None:
    """nginx's body limit is the service's largest upload (a document job's file) plus its form,
    so that the service, not the balancer, answers what is too large, with its own message."""
    conf = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    (size,) = re.findall(r"^\s*client_max_body_size\s+(\d+)m;", conf, re.MULTILINE)
    largest = max(Settings().job_max_bytes, Settings().max_file_bytes, Settings().max_body_bytes)
    assert largest < int(size) * 1024 * 1024 <= largest + 2 * 1024 * 1024
