"""The conformance suite through a real processor, as an operator runs it: ``toolsentry eval``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from processor.config import Settings
from processor.evaluate import CATEGORIES, load_suite, prepare_keys
from tests.integration.harness import ROOT, ProcessorProcess, isolated, settings_env
from tests.lifecycle import contracts_with_sunsets_ahead

pytestmark = pytest.mark.integration

SUITE = ROOT / "tests" / "conformance"


def test_the_conformance_suite_passes_at_100_percent(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = isolated(stack_settings, "conformance")
    suite = load_suite(SUITE)
    keys = prepare_keys(suite, tmp_path / "keys")
    trust = {
        "TOOLSENTRY_IDENTITY__JWKS_FILE": str(keys.jwks),
        "TOOLSENTRY_IDENTITY__DELEGATION_KEY_FILE": str(keys.delegation),
        "TOOLSENTRY_APPROVERS_FILE": str(keys.approvers),
        "TOOLSENTRY_POLICY_FILE": str(suite.policy),
    }
    contracts = {"TOOLSENTRY_CONTRACTS_DIR": str(contracts_with_sunsets_ahead(tmp_path / "c"))}
    proc = (
        ProcessorProcess(settings, "conformance-1", tmp_path, **trust, **contracts)
        .start()
        .wait_ready()
    )
    report_path = tmp_path / "report.json"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "processor", "eval", "--suite", str(SUITE),
             "--keys", str(keys.directory), "--timeout", "60", "--report", str(report_path)],
            cwd=ROOT,
            env={**settings_env(settings, "eval", **contracts), "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        output = result.stdout + result.stderr
        report = json.loads(report_path.read_text())
        assert report["failures"] == [], output[-6000:]
        assert result.returncode == 0, output[-6000:]
        assert report["total"] == len(suite.cases) >= 150
        assert report["passed"] == report["total"]
        assert set(report["categories"]) == set(CATEGORIES)
        for category, counts in report["categories"].items():
            assert counts["total"] >= 12, category
            assert counts["passed"] == counts["total"], category
        assert "100.0%" in output
    finally:
        assert proc.terminate() == 0, proc.log()[-3000:]
