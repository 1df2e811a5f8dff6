"""docker-compose.yml and the Prometheus it runs agree on who serves metrics where.

No Docker engine here runs the file; these checks read it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from processor.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> Any:
    return yaml.safe_load((ROOT / name).read_text())


def _served(service: dict[str, Any]) -> int | None:
    """The metrics port a compose service's toolsentry command serves, if any."""
    command = str(service.get("command", ""))
    if "toolsentry run" in command:
        env = service.get("environment", {})
        return int(
            env.get("TOOLSENTRY_METRICS_PORT", Settings.model_fields["metrics_port"].default)
        )
    found = re.search(r"toolsentry executor run\b.*--metrics-port (\d+)", command, re.S)
    return int(found.group(1)) if found else None


def test_prometheus_scrapes_every_compose_service_that_serves_metrics() -> None:
    services = _load("docker-compose.yml")["services"]
    served = {name: port for name, s in services.items() if (port := _served(s)) is not None}
    assert {"processor", "executor"} <= set(served)
    jobs = _load("dashboards/prometheus.yml")["scrape_configs"]
    targets = {t for job in jobs for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:{port}" for name, port in served.items()}
    for name, port in served.items():
        assert f"{port}:{port}" in services[name].get("ports", []), name
    assert set(served) <= set(services["prometheus"]["depends_on"])
