"""The Grafana dashboard and the alerting rules of ``dashboards/``, checked against a real
Prometheus scraping a real processor and a real executor.

A ``toolsentry run`` subprocess and a ``toolsentry executor run`` subprocess (read-only
calls), each with a metrics port, decide and run two waves of the same mix: valid calls
(routed and executed), schema-invalid ones, an unknown tool, cut-off JSON, a bad token, a
call parked for approval, an idempotency hit and two records that cannot be tied to a
run. A ``prometheus`` process (the Debian package's binary, from PATH) scrapes both every
second with the shipped ``dashboards/prometheus.yml`` and evaluates the shipped
``dashboards/alerts.yml``. Then every query of every panel, with Grafana's variables
filled in as Grafana would, must succeed; the panels the traffic necessarily fed must
show it; every metric the dashboard and the rules name must be one the processor or the
executor exports; and the rules must evaluate cleanly and stay quiet.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from processor.client import ToolsentryClient
from processor.config import Settings
from processor.contracts.registry import load_contracts
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack.local import free_ports
from tests.integration.harness import (
    ROOT,
    ProcessorProcess,
    existing,
    isolated,
    settings_env,
    token,
)

pytestmark = pytest.mark.integration

DASHBOARDS = ROOT / "dashboards"
DASHBOARD = DASHBOARDS / "toolsentry.json"
TENANT = "acme-dash"
CANCEL = {"order_id": "WO-24680-D", "reason_code": "customer_request", "confirm": True}
PROCESSOR_JOB, EXECUTOR_JOB = "toolsentry", "toolsentry-executor"

GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
"""What Grafana puts in for its own variables. One minute holds both waves of traffic."""

PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$"
)
SERIES_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


# -- the dashboard and the rules, read as Grafana and Prometheus read them -------------------


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in doc["panels"]:
        yield panel
        yield from panel.get("panels", ())


def queries(doc: dict[str, Any]) -> list[Query]:
    return [
        Query(p["title"], t["refId"], t["expr"]) for p in panels(doc) for t in p.get("targets", ())
    ]


def variable_queries(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, label_values(...) query) of each query variable, in order."""
    out = []
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((v["name"], q["query"] if isinstance(q, dict) else q))
    return out


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (or ``label_values`` reads)."""
    found = LABEL_VALUES.match(expr)
    if found:
        expr = found.group("selector") or ""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = LABEL_LISTS.sub(" ", text)  # by (le), on (job), ...
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[a-zA-Z_:][\w:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group(0).lower() in PROMQL_WORDS:
            continue  # a function or an operator
        names.add(m.group(0))
    return names


def fill(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable substitution: ``$name`` and ``${name}``; whatever is left with a
    ``$`` is a variable the dashboard does not define, and fails the query."""
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


def regex_value(value: str) -> str:
    """One selected value of a multi-value variable, as Grafana writes it into ``=~"..."``:
    regex-escaped, then escaped for a PromQL string."""
    return re.escape(value).replace("\\", "\\\\")


# -- processes -------------------------------------------------------------------------------


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH: ./scripts/bootstrap.sh installs the Debian package")
    return path


def http_json(url: str, params: dict[str, str] | None = None) -> dict[str, Any]:
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            doc: dict[str, Any] = orjson.loads(response.read())
    except urllib.error.HTTPError as exc:  # a bad query: 400 with the error in the body
        doc = orjson.loads(exc.read())
    return doc


def exported(port: int) -> set[str]:
    """Every series name a /metrics page can hold: its samples', and the names a family's
    type gives (a labelled counter never incremented has a TYPE line and no sample)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body = response.read().decode()
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.update(family + suffix for suffix in SERIES_SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def stop_processor(proc: ProcessorProcess) -> None:
    if proc.alive():
        try:
            proc.terminate(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Prometheus:
    """A prometheus process of the test's own: free port, temp storage, the shipped
    configuration with the test's targets and a 1 s scrape and evaluation interval."""

    def __init__(self, work_dir: Path, targets: dict[str, int]) -> None:
        self.work_dir = work_dir
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
        config["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
        config["rule_files"] = [str(DASHBOARDS / f) for f in config["rule_files"]]
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        assert set(jobs) == {PROCESSOR_JOB, EXECUTOR_JOB}, f"the shipped jobs: {sorted(jobs)}"
        for name, port in targets.items():
            jobs[name]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        config["scrape_configs"] = list(jobs.values())
        self.config = work_dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = work_dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        command = [
            binary("prometheus"),
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for("prometheus to be ready", self.ready, timeout=30)
        return self

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def query(self, expr: str) -> dict[str, Any]:
        return http_json(f"{self.url}/api/v1/query", {"query": expr})

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        assert answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def value(self, expr: str) -> float:
        """The value of a one-element vector; NaN when the vector is empty."""
        result = self.vector(expr)
        return float(result[0]["value"][1]) if result else math.nan

    def targets_up(self) -> bool:
        active = http_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"]
        return len(active) == 2 and all(t["health"] == "up" for t in active)


# -- the traffic ------------------------------------------------------------------------------


IDEMPOTENT_CALL = ("search_kb", {"query": "refund policy", "limit": 2})
"""Sent under one explicit idempotency key: run once, then answered from its record."""


def send_wave(client: ToolsentryClient, idempotency_key: str, first: bool) -> None:
    """One of each kind of decision, then two records the DLQ takes; waits for every
    observation and for the executed calls' results.

    The first wave starts by running the call under ``idempotency_key``; each wave then
    sends it again and gets the cached answer (an idempotency hit)."""

    def run() -> str:
        return f"dash-{uuid.uuid4().hex[:10]}"

    def idempotent() -> str:
        tool, arguments = IDEMPOTENT_CALL
        return client.propose(tool, arguments, run_id=run(), idempotency_key=idempotency_key)

    if first:
        original = idempotent()
        assert client.wait_result(original, 60)["decision"] == "COMPLETED"
    search = "search_kb"
    routed = [
        client.propose(
            search, {"query": f"return policy {uuid.uuid4().hex[:6]}", "limit": 3}, run_id=run()
        )
        for _ in range(3)
    ]
    hit = idempotent()
    refused = [
        client.propose(search, {"query": "return policy", "limit": "10"}, run_id=run()),
        client.propose("cancel_order", {**CANCEL, "order_id": "ORD-12345"}, run_id=run()),
        client.propose("search_orders", {"query": "late parcels"}, run_id=run()),
        client.propose("cancel_order", None, arguments_raw='{"order_id": "WO-2', run_id=run()),
        client.propose(
            search, {"query": "return policy", "limit": 1}, run_id=run(), principal_token="x.y.z"
        ),
        client.propose("cancel_order", CANCEL, run_id=run()),  # parked for approval
    ]
    client.send_raw(b"not json at all", b"dash")
    client.send_raw(orjson.dumps({"proposal_id": str(uuid.uuid4())}), b"dash")  # no run_id
    client.flush(30)
    for pid in refused:
        client.wait(pid, 60)
    for pid in routed:
        assert client.wait_result(pid, 60)["decision"] == "COMPLETED", client.history(pid)
    answer = client.wait_result(hit, 60)
    assert answer["decision"] == "COMPLETED" and answer["gate"] == "idempotency", answer


@dataclass
class Scraped:
    prometheus: Prometheus
    processor_port: int
    executor_port: int
    variables: dict[str, str]
    """Grafana's variables as a user who picked this processor's job and instance has them."""


def samples_total(prometheus: Prometheus, port: int, metric: str, job: str) -> bool:
    """Whether Prometheus holds the sum of ``metric`` the exporter on ``port`` shows now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body = response.read().decode()
    direct = sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith(f"{metric}{{")
    )
    return direct > 0 and prometheus.value(f'sum({metric}{{job="{job}"}})') == direct


def sampled_twice(prometheus: Prometheus, metric: str) -> bool:
    return prometheus.value(f"min(count_over_time({metric}[1m]))") >= 2


@pytest.fixture(scope="module")
def scraped(
    stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scraped]:
    binary("prometheus")  # fail before starting anything
    work = tmp_path_factory.mktemp("dashboards")
    settings = isolated(
        stack_settings.model_copy(
            # librdkafka statistics (where the lag gauge comes from) every second, not 5.
            update={"consumer": {**stack_settings.consumer, "statistics.interval.ms": 1000}}
        ),
        f"dash-{time.time_ns()}",
    )
    publish_references(settings, existing(TENANT, "cancel_order", CANCEL))
    processor_port, executor_port = free_ports(2)
    with contextlib.ExitStack() as cleanup:
        proc = ProcessorProcess(
            settings, "dash-1", work, TOOLSENTRY_METRICS_PORT=str(processor_port)
        ).start()
        cleanup.callback(stop_processor, proc)
        executor_log = (work / "executor.log").open("wb")
        cleanup.callback(executor_log.close)
        executor = subprocess.Popen(
            [sys.executable, "-m", "processor", "executor", "run", "--db", str(work / "s.db"),
             "--classes", "read_only", "--executor-id", "dash-exec-1",
             "--metrics-port", str(executor_port)],
            cwd=ROOT, env=settings_env(settings, "dash-exec-1"),
            stdout=executor_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        cleanup.callback(stop, executor)
        prometheus = Prometheus(work, {PROCESSOR_JOB: processor_port, EXECUTOR_JOB: executor_port})
        cleanup.callback(prometheus.stop)
        prometheus.start()
        proc.wait_ready()
        wait_until_loaded(settings)
        wait_for("both targets up", prometheus.targets_up)

        client = ToolsentryClient(settings, TENANT, principal_token=token(settings, TENANT))
        cleanup.callback(client.close)
        idempotency_key = f"dash-{uuid.uuid4().hex}"
        synced = (
            (processor_port, "toolsentry_decisions_total", PROCESSOR_JOB),
            (processor_port, "toolsentry_dead_letters_total", PROCESSOR_JOB),
            (processor_port, "toolsentry_results_total", PROCESSOR_JOB),
            (executor_port, "toolsentry_executor_results_total", EXECUTOR_JOB),
        )
        for first in (True, False):
            # The second wave lands after Prometheus has sampled the first: rates over
            # both are then above zero for every kind of decision, not only for new series.
            send_wave(client, idempotency_key, first)
            for port, metric, job in synced:
                wait_for(
                    f"{metric} scraped",
                    functools.partial(samples_total, prometheus, port, metric, job),
                )
        # A rate needs two samples, and a series the second wave created may have one.
        for _, metric, _ in synced:
            wait_for(
                f"two samples of every {metric}",
                functools.partial(sampled_twice, prometheus, metric),
            )
        assert proc.alive() and executor.poll() is None, proc.log()[-3000:]

        variables = {
            **GRAFANA_INTERVALS,
            "job": regex_value(PROCESSOR_JOB),
            "instance": regex_value(f"127.0.0.1:{processor_port}"),
        }
        yield Scraped(prometheus, processor_port, executor_port, variables)


# -- the tests ---------------------------------------------------------------------------------


def labels_of(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in result}


def single(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


REFUSED_CLASSES = {
    "TYPE_MISMATCH",  # limit "10"
    "OUT_OF_BOUNDS",  # ORD-12345
    "STRUCTURAL_VIOLATION",  # search_orders
    "SYNTACTIC_PARSE_FAIL",  # cut-off JSON
    "PERMISSION_DENIED",  # a token that is not one
    "CONFIRMATION_MISSING",  # parked
}


def check_panels(results: dict[str, dict[str, list[dict[str, Any]]]], fingerprint: str) -> None:
    """What the two waves necessarily show, panel by panel (results[title][refId])."""
    r = results

    assert single(r["Decisions/s"]["A"]) > 0
    assert 0 < single(r["Rejection share"]["A"]) < 1
    assert 0 < single(r["Decision latency p99"]["A"]) <= 0.05  # the highest finite bucket
    assert single(r["Instances"]["A"]) == 1
    assert single(r["Assigned partitions"]["A"]) > 0
    assert single(r["Contract sets in use"]["A"]) == 1
    assert single(r["Identity verification"]["A"]) == 0

    outcomes = labels_of(r["Decisions/s by outcome"]["A"], "outcome")
    assert {"ROUTED", "REJECTED", "PARKED", "SETTLED"} <= set(outcomes), outcomes
    assert all(outcomes[o] > 0 for o in ("ROUTED", "REJECTED", "PARKED", "SETTLED")), outcomes
    classes = labels_of(r["Refusals/s by taxonomy class"]["A"], "taxonomy")
    assert set(classes) >= REFUSED_CLASSES and "SUCCESS" not in classes, classes
    assert all(classes[c] > 0 for c in REFUSED_CLASSES), classes
    gates = labels_of(r["Rejections/s by gate"]["A"], "gate")
    assert {"parse", "resolve", "schema", "identity"} <= set(gates), gates
    share = r["Rejection share and first-pass validity"]
    rejected, well_formed = single(share["A"]), single(share["B"])
    assert 0 < rejected < 1 and 0 < well_formed < 1, (rejected, well_formed)
    top = labels_of(r["Top rejected tools"]["A"], "tool")
    assert {"unresolved", "search_kb", "cancel_order"} <= set(top), top
    assert all(v > 0 for v in top.values()), top
    reasons = labels_of(r["Dead letters/s by reason"]["A"], "reason")
    assert "no_run_id" in reasons and len(reasons) == 2, reasons
    assert all(v > 0 for v in reasons.values()), reasons
    admission = r["Admission: budgets, rate limits, idempotency"]
    assert single(admission["B"]) > 0  # the second wave's idempotency hit

    for title in ("Decision latency per proposal", "Batch seconds"):
        p50, p99, mean = (single(r[title][ref]) for ref in "ABC")
        assert 0 < p50 <= p99 and mean > 0, (title, p50, p99, mean)
    assert 0 < single(r["Batch size"]["A"]) <= single(r["Batch size"]["B"])
    assert single(r["Batch size"]["C"]) >= 1  # records per transaction

    transactions = labels_of(r["Kafka transactions/s"]["A"], "result")
    assert transactions.get("committed", 0) > 0 and transactions.get("aborted", 0) == 0
    approvals = r["Approvals/s"]
    assert single(approvals["A"]) > 0  # parked
    assert labels_of(approvals["B"], "result").get("requested", 0) > 0
    settled = {
        (s["metric"]["state"], s["metric"]["status"]): float(s["value"][1])
        for s in r["Results settled/s"]["A"]
    }
    assert settled.get(("COMPLETED", "settled"), 0) > 0, settled
    executors = r["Executors"]
    assert labels_of(executors["A"], "outcome").get("SUCCEEDED", 0) > 0
    assert labels_of(executors["B"], "result").get("committed", 0) > 0
    [contract_set] = r["Contract set per instance"]["A"]
    assert contract_set["metric"]["fingerprint"] == fingerprint
    assert single(r["Reference loader"]["A"]) == 0  # what was published is in Redis


def test_every_panel_query_succeeds_and_shows_the_traffic(scraped: Scraped) -> None:
    doc = dashboard()
    prometheus = scraped.prometheus

    # The variables' own queries, as Grafana runs them: this processor's job and
    # instance are among the choices.
    for name, query in variable_queries(doc):
        found = LABEL_VALUES.match(query)
        assert found, f"variable {name}: not a label_values() query: {query}"
        selector = fill(found.group("selector"), scraped.variables)
        answer = http_json(
            f"{prometheus.url}/api/v1/label/{found.group('label')}/values", {"match[]": selector}
        )
        assert answer["status"] == "success", (name, answer)
        wanted = {"job": PROCESSOR_JOB, "instance": f"127.0.0.1:{scraped.processor_port}"}
        assert wanted[name] in answer["data"], (name, answer["data"])

    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    failures = []
    for q in queries(doc):
        expr = fill(q.expr, scraped.variables)
        if "$" in expr:
            failures.append(f"{q.panel} {q.ref}: undefined variable in {expr}")
            continue
        answer = prometheus.query(expr)
        if answer["status"] != "success":
            failures.append(f"{q.panel} {q.ref}: {answer.get('error')}\n  {expr}")
            continue
        assert answer["data"]["resultType"] == "vector", (q, answer)
        for sample in answer["data"]["result"]:
            value = float(sample["value"][1])
            if math.isinf(value) or value < 0:
                failures.append(f"{q.panel} {q.ref}: implausible {value} for {sample['metric']}")
        results.setdefault(q.panel, {})[q.ref] = answer["data"]["result"]
    assert not failures, "\n".join(failures)
    check_panels(results, load_contracts(ROOT / "contracts").fingerprint)


def test_the_lag_panels_show_a_processor_that_has_caught_up(scraped: Scraped) -> None:
    for q in queries(dashboard()):
        if q.panel in ("Consumer lag", "Consumer lag by instance"):
            assert scraped.prometheus.value(fill(q.expr, scraped.variables)) == 0, q


def test_every_metric_the_dashboard_and_the_rules_name_is_exported(scraped: Scraped) -> None:
    exported_names = exported(scraped.processor_port) | exported(scraped.executor_port)
    doc = dashboard()
    named: dict[str, set[str]] = {}
    for q in queries(doc):
        names = metric_names(q.expr)
        assert names, f"{q.panel} {q.ref}: no metric found in {q.expr}"
        named[f"panel {q.panel!r} {q.ref}"] = names
    for name, query in variable_queries(doc):
        named[f"variable {name}"] = metric_names(query)
    for rule in alert_rules():
        # ``up`` is Prometheus' own, per target.
        named[f"alert {rule['alert']}"] = metric_names(rule["expr"]) - {"up"}
    unknown = {
        where: sorted(names - exported_names)
        for where, names in named.items()
        if names - exported_names
    }
    assert not unknown, f"not exported by the processor or the executor: {unknown}"
    assert "toolsentry_decisions_total" in set().union(*named.values())


def test_the_alerting_rules_evaluate_cleanly_and_stay_quiet(scraped: Scraped) -> None:
    prometheus = scraped.prometheus
    expected = {rule["alert"] for rule in alert_rules()}

    def evaluated() -> bool:
        groups = http_json(f"{prometheus.url}/api/v1/rules")["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        # RFC 3339 times; a rule never evaluated has the zero time, year 0001.
        return {r["name"] for r in rules} == expected and all(
            r["lastEvaluation"] > "2000" for r in rules
        )

    wait_for("every rule evaluated", evaluated, timeout=10)
    groups = http_json(f"{prometheus.url}/api/v1/rules")["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    unhealthy = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not unhealthy, unhealthy
    alerts = http_json(f"{prometheus.url}/api/v1/alerts")["data"]["alerts"]
    assert [a for a in alerts if a["state"] == "firing"] == [], "a healthy processor raised alerts"

    # A scrape that caught the waves waiting before the first commit was counted (a slow,
    # loaded machine) holds ToolsentryStuck pending, never firing (it must hold for 5
    # minutes): a healthy processor clears it at its next evaluations.
    def quiet() -> bool:
        return http_json(f"{prometheus.url}/api/v1/alerts")["data"]["alerts"] == []

    wait_for("no alert pending", quiet, timeout=60)


def test_promtool_accepts_the_shipped_configuration_and_the_rules_pass_their_tests() -> None:
    promtool = binary("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts.test.yml"],
    ):
        done = subprocess.run(
            [promtool, *args], cwd=DASHBOARDS, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_the_dashboard_is_provisioned_as_docker_compose_mounts_it() -> None:
    doc = dashboard()
    assert doc["uid"] == "toolsentry" and doc["schemaVersion"] >= 39
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    [ds_variable] = [v for v in doc["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (ds_variable["type"], ds_variable["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = [p["title"] for p in panels(doc) if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "panel titles repeat"
    for p in panels(doc):
        if p["type"] == "row":
            continue
        assert p["datasource"] == datasource, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == datasource and t["expr"].strip(), (p["title"], t)
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = {
        service: dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in spec["volumes"])
        for service, spec in compose.items()
        if service in ("prometheus", "grafana")
    }
    for service, volumes in mounts.items():
        for host in volumes:
            assert (ROOT / host).exists(), f"{service} mounts {host}, which is missing"
    assert mounts["prometheus"]["./dashboards/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert mounts["prometheus"]["./dashboards/alerts.yml"] == "/etc/prometheus/alerts.yml"

    provider = yaml.safe_load((DASHBOARDS / "provisioning/dashboards/toolsentry.yml").read_text())
    [source] = provider["providers"]
    mounted_json = mounts["grafana"]["./dashboards/toolsentry.json"]
    assert Path(mounted_json).parent == Path(source["options"]["path"])
    sources = yaml.safe_load((DASHBOARDS / "provisioning/datasources/prometheus.yml").read_text())
    [prom] = sources["datasources"]
    assert prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090"
    assert "prometheus" in compose and "9090:9090" in compose["prometheus"]["ports"]
