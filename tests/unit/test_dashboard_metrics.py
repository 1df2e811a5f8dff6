"""The dashboard, the alerting rules and the README's metrics section against the metrics
the code registers, without a broker or a Prometheus.

A panel or an alert that selects a metric nobody exports, groups by a label the metric
does not carry, or filters on a gate, outcome or taxonomy class that does not exist shows
an empty graph or never fires, and nothing says so. tests/integration/test_dashboards.py
checks the names against a live scrape; these checks run in the fast suite and cover the
labels too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from processor.executor import ExecutorMetrics
from processor.metrics import BatchHistogram, Metrics
from processor.model import Gate, Outcome, TaxonomyClass

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"

TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds to every series it scrapes."""
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
ENUM_LABELS: dict[str, frozenset[str]] = {
    "gate": frozenset(g.value for g in Gate),
    "outcome": frozenset(o.value for o in Outcome),
    "taxonomy": frozenset(t.value for t in TaxonomyClass),
}
"""Labels whose values the code takes from an enum: a matcher may name only those."""
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
SELECTOR = re.compile(r"\b(toolsentry_\w+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)\s*\(")


@dataclass(frozen=True)
class Series:
    family: str
    labels: frozenset[str]


def registered() -> dict[str, Series]:
    """Every series name the processor and the executor expose, with its labels."""
    registry = CollectorRegistry()
    out: dict[str, Series] = {}
    for owner in (Metrics(registry), ExecutorMetrics(registry)):
        for metric in vars(owner).values():
            if isinstance(metric, BatchHistogram):
                name, kind, labels = metric.name, "histogram", ()
            else:
                # prometheus_client keeps a metric's label names only here.
                name, kind, labels = metric._name, metric._type, metric._labelnames
            for suffix in SUFFIXES[kind]:
                extra = {"le"} if suffix == "_bucket" else set()
                out[name + suffix] = Series(name, frozenset(labels) | extra)
    return out


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of the dashboard."""
    doc: dict[str, Any] = json.loads((DASHBOARDS / "toolsentry.json").read_text())
    for panel in doc["panels"]:
        for p in (panel, *panel.get("panels", ())):
            for target in p.get("targets", ()):
                yield f"panel {p['title']!r} {target['refId']}", target["expr"]
    for variable in doc["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield (
                f"variable {variable['name']}",
                (query["query"] if isinstance(query, dict) else query),
            )


def alert_exprs() -> Iterator[tuple[str, str]]:
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"]


EXPRESSIONS = [*dashboard_exprs(), *alert_exprs()]


def balanced(text: str, start: int) -> str:
    """The text inside the parenthesis that opens just before ``start``."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError(f"unbalanced parentheses in {text}")


def problems(expr: str, series: dict[str, Series]) -> list[str]:
    """What in one PromQL expression names a metric, a label or a label value the code
    does not have."""
    found = []
    for m in SELECTOR.finditer(expr):
        name, matchers = m.group(1), m.group(2) or ""
        if name not in series:
            found.append(f"{name} is not registered")
            continue
        for label, op, value in MATCHER.findall(matchers):
            if label not in series[name].labels | TARGET_LABELS:
                found.append(f"{name} has no label {label!r}")
            elif label in ENUM_LABELS:
                values = value.split("|") if op in ("=~", "!~") else [value]
                unknown = sorted(set(values) - ENUM_LABELS[label])
                if unknown:
                    found.append(f"{name}: no {label} is ever {unknown}")
    for m in GROUPING.finditer(expr):
        wanted = {label.strip() for label in m.group(1).split(",") if label.strip()}
        for name in {s.group(1) for s in SELECTOR.finditer(balanced(expr, m.end()))}:
            if name in series:
                missing = wanted - series[name].labels - TARGET_LABELS
                if missing:
                    found.append(f"{name} has no label {sorted(missing)} to group by")
    return found


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_every_dashboard_and_alert_query_names_what_the_code_exports(where: str, expr: str) -> None:
    series = registered()
    assert SELECTOR.search(expr) or re.fullmatch(r"\s*up\{[^}]*\}\s*==\s*0\s*", expr), expr
    assert problems(expr, series) == [], f"{where}: {expr}"


def test_the_checks_catch_a_metric_a_label_and_a_value_the_code_does_not_have() -> None:
    series = registered()
    assert problems("sum(rate(toolsentry_decision_total[5m]))", series) == [
        "toolsentry_decision_total is not registered"
    ]
    assert problems('sum by (tenant) (toolsentry_decisions_total{gate="budgets"})', series) == [
        "toolsentry_decisions_total: no gate is ever ['budgets']",
        "toolsentry_decisions_total has no label ['tenant'] to group by",
    ]
    assert problems('toolsentry_results_total{outcome="SETTLED"}', series) == [
        "toolsentry_results_total has no label 'outcome'"
    ]


README_METRIC = re.compile(r"`(toolsentry_\w+)(?:\{([^}]*)\})?`")


def readme_metrics() -> dict[str, list[str | None]]:
    """The metric families the README's Metrics section lists (the processor's and the
    executors'), each with what every mention of it gives in braces (None: no braces)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, list[str | None]] = {}
    for name, labels in README_METRIC.findall(section):
        listed.setdefault(name.removesuffix("_total"), []).append(labels or None)
    return listed


def test_the_readme_lists_every_metric_and_only_those() -> None:
    families = {s.family for s in registered().values()}
    assert set(readme_metrics()) == families


def test_the_readme_lists_each_metric_with_its_labels() -> None:
    """A label list in braces names exactly the metric's labels, a matcher only one of
    them, and a metric with labels is listed with them at least once: a query written from
    the README must select series that exist."""
    labels = {s.family: s.labels - {"le"} for s in registered().values()}
    for family, mentions in readme_metrics().items():
        given = [m for m in mentions if m is not None]
        for m in given:
            names = {part.split("=", 1)[0].strip() for part in m.split(",")}
            if "=" in m:
                assert names <= labels[family], (family, m)
            else:
                assert names == labels[family], (family, m)
        if labels[family]:
            assert any("=" not in m for m in given), f"{family}: its labels are not listed"


def test_every_metric_the_readme_names_is_registered() -> None:
    series = registered()
    named = set(re.findall(r"\b(toolsentry_\w+)", (ROOT / "README.md").read_text()))
    named = {name for name in named if not name.endswith("_")}  # toolsentry_executor_*
    families = {s.family for s in series.values()}
    assert {n for n in named if n not in series and n not in families} == set()


def test_every_status_a_refused_result_is_counted_under_is_documented() -> None:
    """A result admission refuses is counted under its verdict's status and dead-lettered
    with a reason: an operator reading either must find both in the metric's help and in
    the README."""
    from processor.app import _RESULTS_REFUSED

    registry = CollectorRegistry()
    Metrics(registry)
    [help_text] = [m.documentation for m in registry.collect() if m.name == "toolsentry_results"]
    section = (ROOT / "README.md").read_text().split("\n## Metrics\n", 1)[1]
    bullet = section.split("- `toolsentry_results_total", 1)[1].split("\n- `", 1)[0]
    for status, (reason, _) in _RESULTS_REFUSED.items():
        assert re.search(rf"\b{status}\b", help_text), status
        assert f'"{status}"' in bullet and f"`{reason}`" in bullet, (status, reason)


LEGEND_LABEL = re.compile(r"\{\{(.*?)\}\}")


def legend_problems(legend: str, expr: str, series: dict[str, Series]) -> list[str]:
    """What in a panel target's legend Grafana cannot fill in: a ``{{...}}`` that is not
    one label name (stray braces), or a label the query's result does not carry (the
    labels it groups by, or the metric's own when it does not aggregate)."""
    groups = [m.group(1) for m in GROUPING.finditer(expr)]
    if groups:
        carried = {label.strip() for g in groups for label in g.split(",")}
    else:
        names = {m.group(1) for m in SELECTOR.finditer(expr)}
        carried = {label for n in names if n in series for label in series[n].labels}
        carried |= TARGET_LABELS
    found = []
    for inner in LEGEND_LABEL.findall(legend):
        label = inner.strip()
        if not re.fullmatch(r"\w+", label):
            found.append(f"legend {legend!r}: {{{{{inner}}}}} is not a label name")
        elif label not in carried:
            found.append(f"legend {legend!r}: the query's series have no label {label!r}")
    return found


def test_every_panel_legend_names_labels_its_query_carries() -> None:
    """A legend Grafana cannot fill in shows every series under the same broken name
    ("behind }}"), and the instances cannot be told apart."""
    series = registered()
    doc: dict[str, Any] = json.loads((DASHBOARDS / "toolsentry.json").read_text())
    found = [
        f"panel {p['title']!r} {target['refId']}: {problem}"
        for panel in doc["panels"]
        for p in (panel, *panel.get("panels", ()))
        for target in p.get("targets", ())
        for problem in legend_problems(target.get("legendFormat", ""), target["expr"], series)
    ]
    assert found == []


def test_the_legend_check_catches_stray_braces_and_labels_grouped_away() -> None:
    series = registered()
    expr = "max by (instance) (toolsentry_reference_lag_records)"
    assert legend_problems("behind {{instance}}", expr, series) == []
    assert legend_problems("behind {{{{instance}}}}", expr, series) == [
        "legend 'behind {{{{instance}}}}': {{{{instance}} is not a label name"
    ]
    assert legend_problems("{{result}}", expr, series) == [
        "legend '{{result}}': the query's series have no label 'result'"
    ]
    assert legend_problems("{{fingerprint}}", "toolsentry_contract_set_info", series) == []
